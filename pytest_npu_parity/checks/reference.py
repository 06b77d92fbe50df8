"""Where a check's expected leaves come from: a stored baseline, a live CPU run, or (record mode) nowhere.

``expected_for`` gives a check's ``Expected`` leaves: the baseline's entry when the session's
reference mode and the test's baseline file say so (checked fresh against the check's fingerprints,
``check_hashes``), else the reference computation run live on the CPU once per test and computation
(``memo_key``). In record mode ``pending_entry`` turns the reference run into the entry the test's
baseline file will hold (``recording_provenance`` describes the recording). A baseline that cannot
be used becomes an ``error`` record (``baseline_error_record``); a stale one says what changed
(``stale_cause``), and ``stale_suites`` finds suites whose model changed as a whole. Failures
against a baseline recorded with another torch release or thread count carry a note
(``torch_version_mismatch``, ``thread_count_mismatch``).
"""
from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..store.suites import SuiteStores
from ..store.format import (BaselineError, CheckBaseline, CorruptBaselineError, MissingBaselineError, StaleBaselineError,
                            UnsafeBaselineError)
from ..store.compact import compact_leaves
from ..store.digests import fingerprint_module, fingerprint_tensors, module_tensor_digests, uninitialized
from ..store.summaries import summarize_tensors
from ..runtime.golden_run import GoldenUnavailableError
from ..modules import owner_module
from ..runtime.machine import collect_provenance
from ..runtime.npu import base_version
from ..runtime.recipes import precision_flags, strict_fp32_flags
from ..runtime.side import CheckCall
from ..structure import module_structure, pack_structure, structure_hash
from .fingerprints import META_KEY as FINGERPRINTS_KEY
from .fingerprints import STALE_KINDS, check_fingerprints, fingerprint_changes
from .plan import CaseFacts, CheckPlan
from .record import BaselineProblem, CheckRecord
from .stored_golden import META_KEY as GOLDEN_META_KEY
from .stored_golden import UNAVAILABLE_NOTE, GoldenSource, add_goldens, recorded_golden


@dataclass(frozen=True)
class Expected:
    """A check's expected leaves and where they came from.

    Attributes:
        leaves: ``{leaf path: CPU tensor or None}`` (with layer records ``layer:<path>`` until split).
        reference: ``baseline``, ``cpu`` (a live run) or ``given`` (``ParityCase.compare``).
        provenance: the baseline's one-line provenance (``Baseline.describe()``), or None.
        rng: the reference's random stream mode: a baseline entry's recorded ``rng`` (``shared``
            for baselines that predate it), a live run's the session's for a sampling check.
        compact: the baseline entry's ``compact`` record (``compact.compact_leaves``), or None.
        recorded: the baseline file's provenance dict (for the version and thread-count notes), or None.
        entry: the baseline entry as ``BaselineStore.check_fresh`` returned it (its stored golden,
            ``checks.stored_golden``), or None.
        path: the baseline file, or None.
    """

    leaves: dict
    reference: str
    provenance: str | None = None
    rng: str = "shared"
    compact: dict | None = None
    recorded: dict | None = None
    entry: CheckBaseline | None = None
    path: Any = None


@dataclass(frozen=True)
class ReferenceSource:
    """Where the session takes references from, as ``expected_for`` needs it.

    Attributes:
        mode: ``auto``, ``cpu`` or ``baseline`` (``ParitySession.reference``).
        store: the baseline store, or None.
        test_id: the test's node id (names its baseline file).
        recipe: the test's recipe name.
        rng: the session's random stream mode for sampling checks (``ParitySession.rng``).
        memo: the session's live-reference memo (``memo_key`` -> ``(fn, leaves, reference patches)``).
        reference_patches: the test's ``(device) -> context manager`` of the reference side
            (``ParityCase.reference_patches``), or None: part of the memo key (``reference_patches_key``).
    """

    mode: str
    store: Any
    test_id: str
    recipe: str
    rng: str
    memo: dict
    reference_patches: Any = None


def reference_patches_key(factory: Any) -> tuple:
    """What tells two reference-patch factories apart in the live-reference memo: ``()`` for None; for a
    function its code object and the identities of its closure's values (the suite's fixture returns a fresh
    ``lambda device: ...`` per test: one definition over the same values is one patch set); any other callable
    by identity. The memo keeps the factory with its result, so these identities stay unique."""
    if factory is None:
        return ()
    code = getattr(factory, "__code__", None)
    if code is None:
        return (id(factory),)
    cells = tuple(id(c.cell_contents) for c in (getattr(factory, "__closure__", None) or ()))
    return (id(code), cells, id(getattr(factory, "__self__", None)))


def check_hashes(fn: Any, args: tuple, kwargs: dict, *, modes: bool = True, labels: Any = None) -> dict[str, Any]:
    """Bitwise fingerprints of the input and the module, an order-sensitive input summary that
    tells a real change from last-bit differences of the same activations recomputed on another
    machine, the module's per-tensor digests that name the weights that changed, and the
    module's configuration and structure (``structure.module_structure``, with each submodule's
    training mode unless ``modes`` is False) with its hash (see ``BaselineStore.check_fresh``).
    The summary and digests are callables, computed only where needed: when recording, or when
    a hash differs from the recorded one. ``labels`` (a training step's) join the input's
    fingerprint and summary when given. ``fingerprints``: what the others leave out — non-tensor
    arguments, module state outside the ``state_dict``, a function's code and closure
    (``checks.fingerprints.check_fingerprints``), taken now, before any run."""
    module = owner_module(fn)
    structure: dict | None = None
    state = None
    if module is not None:
        state = module.state_dict(keep_vars=True)  # taken once for the parts below
        config = fingerprint_module(module, state)
        config_tensors: Callable[[], dict] = lambda: module_tensor_digests(module)  # noqa: E731
        if any(uninitialized(t) for t in state.values()):
            # a lazy module: the recorded digests are those of the fingerprint, before its first run materializes it
            digests = module_tensor_digests(module)
            config_tensors = lambda: digests  # noqa: E731
        structure = module_structure(module, modes=modes)
    else:
        config = fingerprint_tensors(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}")
        config_tensors = dict
    given = (args, kwargs) if labels is None else (args, kwargs, labels)
    return {"input_hash": fingerprint_tensors(given), "config_hash": config,
            "input_summary": lambda: summarize_tensors(given), "config_tensors": config_tensors,
            "structure_hash": structure_hash(structure) if structure is not None else None,
            "structure": structure, FINGERPRINTS_KEY: check_fingerprints(fn, given, state)}


def train_hashes(module: Any, given: tuple) -> dict[str, Any]:
    """``check_hashes`` of a training step: ``given`` its ``(positional, keyword, labels)``; the
    submodules' training modes left out (the step sets them)."""
    return check_hashes(module, given[0], given[1], modes=False, labels=given[2])


def memo_key(test_id: str, name: str, recipe: str, hashes: dict[str, Any], call: CheckCall) -> tuple:
    """What makes two runs of a check the same computation: the test, name, recipe, seed, autograd,
    kind, the very function or module object, the input and the weights, the structure, the
    ``fingerprints`` record (a module's attributes, a function's closure: one module whose mask
    was edited between two checks of it is another computation), and ``call.memo`` (the layer
    records; a train step's optimizer, loss and clipping): two tests of one module, input and
    check name with another optimizer, or one with ``layers=False`` before one with layer
    records, must not share a reference.

    The test's node id is part of it because what a computation reads is not all in its
    fingerprints: a class attribute or a module-level global the forward reads (``is_causal=
    type(self).causal``, set per parametrized test) is in no record, and a reference or golden
    memoized by another test would judge this test's target against that test's computation
    (a causal-mask fault passed when its test ran after the non-causal one, and failed alone)."""
    fingerprints = hashes.get(FINGERPRINTS_KEY)
    return (test_id, name, recipe, call.seed, call.grad, call.kind, id(call.fn),
            hashes["input_hash"], hashes["config_hash"], hashes.get("structure_hash"),
            json.dumps(fingerprints, sort_keys=True, default=str) if fingerprints is not None else None) \
        + tuple(call.memo)


def load_baseline(store: Any, test_id: str, used: set) -> Any:
    """The test's baseline file (``store.load``): a ``baselines.Baseline``, None when there is none,
    or the ``BaselineError`` loading it raised (every check of the test then fails the same way;
    none falls back to a CPU run); None also without a store. The file's path joins ``used``."""
    if store is None:
        return None
    try:
        baseline = store.load(test_id)
    except BaselineError as exc:
        baseline = exc
    if isinstance(baseline, BaselineError):
        used.add(baseline.path or store.path_for(test_id))
    elif baseline is not None:
        used.add(baseline.path)
    return baseline


def expected_for(source: ReferenceSource, baseline: Any, name: str, run: Callable, hashes: dict[str, Any],
                 call: CheckCall) -> Expected:
    """The ``Expected`` leaves of check ``name``: ``baseline``'s entry (the test's loaded baseline
    file, or None) when the mode is ``baseline`` or the file holds the check, else ``run`` on the
    CPU (unpatched), memoized per session by ``memo_key`` (which holds the test id).

    Raises:
        baselines.MissingBaselineError: mode ``baseline`` and no file.
        baselines.StaleBaselineError: the entry's fingerprints differ (``stale_cause`` and
            ``provenance`` set on it); other ``BaselineError`` as ``store.check_fresh``.
    """
    __tracebackhide__ = True
    if source.mode in ("auto", "baseline"):
        has_check = baseline is not None and name in baseline.checks
        if source.mode == "baseline" or has_check:
            if baseline is None:
                raise source.store.missing_error(source.test_id)
            return _baseline_entry(source, baseline, name, hashes, call)
    live_rng = source.rng if call.sample_dim is not None else "shared"
    # a reference run under other reference patches (the suite's parity_reference_patches) is another run
    key = memo_key(source.test_id, name, source.recipe, hashes, call) + (live_rng,) \
        + reference_patches_key(source.reference_patches)
    memo = source.memo
    if key not in memo:  # the function/module and the patch factory are kept with the result: their ids stay unique
        memo[key] = (call.fn, run(torch.device("cpu"), patched=False)[0], source.reference_patches)
    return Expected(memo[key][1], "cpu", None, live_rng, None)


def _baseline_entry(source: ReferenceSource, baseline: Any, name: str, hashes: dict[str, Any],
                    call: CheckCall) -> Expected:
    """``expected_for`` from the baseline file's entry ``name``, checked fresh."""
    __tracebackhide__ = True
    recorded = baseline.checks[name].meta if name in baseline.checks else {}
    found = fingerprint_changes(recorded.get(FINGERPRINTS_KEY), hashes.get(FINGERPRINTS_KEY))
    given = {k: v for k, v in hashes.items() if k != FINGERPRINTS_KEY}
    try:
        entry = source.store.check_fresh(baseline, name, **given, recipe=source.recipe, seed=call.seed,
                                         more_changes=[line for _, line in found])
    except StaleBaselineError as exc:
        # What changed, from the recorded fingerprints (for the suite-wide summary), and
        # which recording it was.
        exc.stale_cause = stale_cause(recorded, hashes, getattr(exc, "structure_changed", False),
                                      input_changed=getattr(exc, "input_changed", None),
                                      kinds=tuple(kind for kind, _ in found))
        exc.provenance = baseline.describe()
        raise
    expected: dict[str, torch.Tensor | None] = dict(entry.tensors)
    expected.update({p: None for p in entry.none_leaves})
    compact = entry.meta.get("compact") if isinstance(entry.meta.get("compact"), dict) else None
    # "<file> — <device, date, versions>"
    return Expected(expected, "baseline", baseline.describe(), str(entry.meta.get("rng") or "shared"), compact,
                    baseline.provenance, entry, baseline.path)


def baseline_error_record(facts: CaseFacts, plan: CheckPlan, exc: BaselineError,
                          weights: str | None = None) -> CheckRecord:
    """The ``error`` record of a check whose baseline is missing, stale, corrupt or unsafe."""
    kinds = ((MissingBaselineError, "missing"), (StaleBaselineError, "stale"),
             (CorruptBaselineError, "corrupt"), (UnsafeBaselineError, "unsafe"))
    kind = next((label for cls, label in kinds if isinstance(exc, cls)), "unreadable")
    problem = BaselineProblem(kind, str(exc.path) if exc.path else None, getattr(exc, "stale_cause", None) or None)
    return facts.record(plan, "baseline", status="error", message=str(exc),
                        reference_provenance=getattr(exc, "provenance", None), weights=weights,
                        baseline_problem=problem)


#: The baseline entry's meta key for the inputs the reference run changed in place (a sorted list of
#: argument paths, ``args[0]``, ``kwargs['mask']``; older entries have none: unknown).
INPUT_CHANGES_META_KEY = "input_changes"


def recording(facts: CaseFacts, plan: CheckPlan, leaves: dict, hashes: dict[str, Any], call: CheckCall,
              rng: str, extras: dict | None = None, replay_meta: dict | None = None,
              golden: tuple[dict | None, str | None] | None = None,
              reference_patches: list[str] | None = None) -> tuple[CheckBaseline, CheckRecord]:
    """Record mode: ``(the baseline entry, the recorded record)`` of the reference run's ``leaves``
    (a train step's compacted as ``plan.train_store`` says, ``compact``; ``rng`` the run's stream mode),
    with the ``extras`` and ``replay_meta`` of ``checks.replay.recorded_extras`` and, for a check judged
    by a golden verdict, ``golden``: ``(golden leaves or None, why it is unavailable or None)``, stored
    as ``checks.stored_golden.recorded_golden`` says (reduced like the leaves of a compact step).
    ``reference_patches``: the names of the patches the reference ran under (the suite's
    ``parity_reference_patches``), stored as the entry's ``reference_patches`` meta when there are any.
    The inputs the reference run changed in place are stored as ``INPUT_CHANGES_META_KEY``."""


    __tracebackhide__ = True
    extra_meta: dict[str, Any] = {"replay": replay_meta} if replay_meta else {}
    if reference_patches:
        extra_meta["reference_patches"] = list(reference_patches)
    # the inputs the reference changed in place (none: []), so that a compare run can tell a target that
    # changes its arguments otherwise (``checks.verdict.input_change_verdict``)
    extra_meta[INPUT_CHANGES_META_KEY] = sorted((call.input_changes or {}).get("reference") or ())
    compact = None
    if plan.train_store is not None and plan.train_store.mode != "full":
        leaves, compact = compact_leaves(leaves, plan.train_store)
        extra_meta.update({"train_store": plan.train_store.describe(), "compact": compact})
    golden_extras: dict = {}
    if golden is not None:
        golden_extras, extra_meta[GOLDEN_META_KEY] = recorded_golden(golden[0], golden[1], plan.golden_policy, compact)
    entry = pending_entry(plan.name, leaves, hashes, call.seed, plan.submodule, facts.recipe.name, rng=rng,
                          extra_meta=extra_meta or None)
    entry.extras = {**(extras or {}), **golden_extras}
    return entry, facts.record(plan, "recorded", status="recorded")


def golden_for(golden_memo: Callable[[tuple, Any, Callable[[], dict]], dict], key: tuple, plan: CheckPlan,
               owner: Any, golden_run: Callable[[], dict] | None,
               source: GoldenSource | None = None) -> tuple[dict | None, str | None]:
    """``(golden leaves, note or None)`` of a check under a golden verdict policy, ``(None, why)`` when
    the golden is unavailable (``golden.GoldenUnavailableError``), else ``(None, None)``.

    ``source`` (``checks.stored_golden.golden_source`` of the check's baseline entry; None: a live
    reference) says where the golden comes from: the stored leaves (no golden run), unavailable at
    recording (no run, judged by allclose), or the live run, ``golden_memo(key, owner, golden_run)``
    (``ParitySession.golden``, memoized by ``key``, ``memo_key``), with the source's note."""


    __tracebackhide__ = True
    if plan.golden_policy is None or golden_run is None:
        return None, None
    source = source or GoldenSource("live")
    if source.kind == "stored":
        return source.leaves, source.note
    if source.kind == "unavailable":
        return None, source.note
    try:
        return golden_memo(key, owner, golden_run), source.note
    except GoldenUnavailableError as exc:
        return None, UNAVAILABLE_NOTE + str(exc)


def recorded_golden_run(golden_memo: Callable[[tuple, Any, Callable[[], dict]], dict], key: tuple, plan: CheckPlan,
                        owner: Any, golden_run: Callable[[], dict] | None,
                        rng: str) -> tuple[dict | None, str | None] | None:
    """Record mode: what ``recording`` stores of the check's golden — ``(leaves, None)`` from
    ``golden_memo(key, owner, golden_run)``, ``(None, why)`` when it is unavailable — for a check whose
    verdict policy is golden and whose recording is judged leaf by leaf; None for the others (allclose,
    or samples drawn from the device's own stream, ``rng == "device"``, which are judged as distributions)."""
    __tracebackhide__ = True
    if plan.golden_policy is None or golden_run is None or rng == "device":
        return None
    try:
        return golden_memo(key, owner, golden_run), None
    except GoldenUnavailableError as exc:
        return None, str(exc)


def pending_entry(name: str, leaves: dict, hashes: dict[str, Any], seed: int, submodule: str | None,
                  recipe: str, rng: str = "shared", extra_meta: dict | None = None) -> CheckBaseline:
    """The baseline entry a recording stores for check ``name``: its tensor leaves (contiguous),
    its None leaves, and its metadata (the fingerprints of ``hashes`` evaluated, the packed
    structure of a module, seed, submodule, recipe, random stream, shapes, dtypes, ``extra_meta``)."""
    tensors = {p: t.contiguous() for p, t in leaves.items() if t is not None}
    facts = {k: v() if callable(v) else v for k, v in hashes.items()}
    if facts.get("structure") is None:  # a function: no structure to record
        facts.pop("structure", None)
        facts.pop("structure_hash", None)
    else:
        facts["structure"] = pack_structure(facts["structure"])
    meta = dict(facts, seed=seed, submodule=submodule, recipe=recipe, rng=rng,
                shapes={p: list(t.shape) for p, t in tensors.items()},
                dtypes={p: str(t.dtype).removeprefix("torch.") for p, t in tensors.items()})
    if extra_meta:
        meta.update(extra_meta)
    return CheckBaseline(name=name, tensors=tensors, none_leaves=[p for p, t in leaves.items() if t is None],
                         meta=meta)


def recording_provenance(target: torch.device, recipe: str, seed: int, rng: str) -> dict[str, Any]:
    """The provenance a recorded baseline file stores (``provenance.collect_provenance`` with the
    strict fp32 precision flags and the random stream mode ``rng``)."""
    with strict_fp32_flags():
        flags = precision_flags()
    return collect_provenance(target, recipe=recipe, seed=seed, precision_flags=flags, extra={"rng": rng})


def stale_cause(recorded_meta: dict, hashes: dict[str, Any], structure_changed: bool = False, *,
                input_changed: bool | None = None, kinds: tuple[str, ...] = ()) -> str:
    """What a stale baseline entry's recorded fingerprints say changed: ``weights`` (the module's
    ``config_hash``; not a function's, which only names it), ``config`` (its configuration or structure: ``structure_changed``, as
    ``baselines.StaleBaselineError.structure_changed`` says), ``input`` (the input), ``arguments``,
    ``attributes``, ``function`` (``kinds``: a non-tensor argument, module state outside the
    ``state_dict``, a function's code or closure, ``checks.fingerprints.STALE_KINDS``), joined by
    ``+`` in that order (``config+input``: a submodule whose captured input changed with the model's
    config), or ``other`` (none of them: a leaf, shape, dtype, recipe or seed).

    Args:
        recorded_meta: the stored check's metadata (``baselines.CheckBaseline.meta``).
        hashes: the current ``input_hash`` and ``config_hash`` (hex strings).
        structure_changed: the recorded configuration or structure differs from the module's.
        input_changed: the input is a change, as ``baselines.StaleBaselineError.input_changed``
            says: its hash differs and its summary does not agree. An input hash that differs while
            the summary agrees (another machine's draws, a changed non-tensor argument) is no
            ``input`` cause. None: the input hashes decide.
        kinds: the kinds of ``checks.fingerprints.fingerprint_changes``' changes.
    """
    # a function's config hash only names it (``check_hashes``): no weights of its own changed
    function = (hashes.get("structure") is None and isinstance(recorded_meta.get("config_tensors"), dict)
                and not recorded_meta["config_tensors"])
    changed = ["weights"] if recorded_meta.get("config_hash") != hashes.get("config_hash") and not function else []
    if structure_changed:
        changed.append("config")
    if input_changed if input_changed is not None else recorded_meta.get("input_hash") != hashes.get("input_hash"):
        changed.append("input")
    changed += [kind for kind in STALE_KINDS if kind in kinds]
    return "+".join(changed) or "other"


#: The causes ``stale_cause`` names, in the order it joins them.
STALE_CAUSES = ("weights", "config", "input") + STALE_KINDS


@dataclass
class StaleSuite:
    """A suite whose checks of a model found their baselines stale for one cause (``stale_suites``).

    Attributes:
        suite: the baseline store's suite name (``baselines.SuiteStores.suite_of``).
        directory: the directory holding the suite's test files (what the fix records), relative
            like the test ids.
        cause: what every stale check of a model shares: ``weights``, ``config``, ``input`` or
            several of them joined by ``+`` (``stale_cause``).
        checks: (test id, check, recipe) of every stale check of the suite (also of free functions
            whose input changed with the model).
        fresh: checks of the suite whose baseline still matched (free functions, another model).
        provenance: one recording's provenance line (``Baseline.describe()`` after its " — "), or None.
        causes: each stale check's own cause (``stale_cause``) by (test id, check, recipe): a function
            check of the suite may be stale for its own reason (its closure), a check of the model for
            ``cause`` and another one besides (``weights+arguments``).
    """

    suite: str
    directory: str
    cause: str
    checks: list[tuple[str, str, str]]
    fresh: int
    provenance: str | None = None
    causes: dict[tuple[str, str, str], str] = field(default_factory=dict)

    def extra_causes(self, key: tuple[str, str, str]) -> set[str]:
        """The causes check ``key`` has besides the shared ``cause``; not ``input`` beside a shared
        ``weights`` or ``config`` (a submodule's captured input changes with the model that computed it)."""
        shared = set(self.cause.split("+"))
        parts = set(self.causes.get(key, self.cause).split("+")) - {"other"}
        extra = parts - shared
        if shared <= parts and shared & {"weights", "config"}:
            extra.discard("input")
        return extra

    def other_causes(self) -> dict[str, int]:
        """``{cause: number of stale checks}`` of the causes (``STALE_CAUSES``) some stale checks have
        besides the shared ``cause`` (``extra_causes``), in ``STALE_CAUSES`` order."""
        counts = dict.fromkeys(STALE_CAUSES, 0)
        for key in self.checks:
            for part in self.extra_causes(key):
                counts[part] = counts.get(part, 0) + 1
        return {c: n for c, n in counts.items() if n}

    def fix(self, update_command: str) -> str:
        """The one command that re-records the suite: ``<update_command> <directory>``."""
        return f"{update_command} {shlex.quote(self.directory)}"


def stale_suites(rows: list[dict[str, Any]]) -> list[StaleSuite]:
    """Suites where the model (or the inputs) changed for the suite as a whole: report rows
    (``CheckRecord.rows``) grouped by suite; a suite qualifies when at least two of its checks are
    stale, more than half of its checks of a module (``weights`` set) that met a baseline are stale,
    and those share a cause (``stale_cause``: ``weights`` in ``weights`` and ``weights+input``;
    ``other`` never qualifies). A second model of the suite whose baselines still match (the
    Aurora suite's tiny training-step model) does not hide it. Suites are those of
    ``baselines.SuiteStores``; every stale check of the suite is a member, the others ``fresh``,
    each member's own cause in ``StaleSuite.causes``. An input counts as a cause only where it is
    a change (``stale_cause``'s ``input_changed``): on another machine every input hash may differ
    (other draws) while the summaries agree, and separate edits of the model then share no cause.
    """
    per_check: dict[tuple, dict] = {}
    for row in rows:
        per_check.setdefault((row["test_id"], row["check"], row["recipe"]), row)
    by_suite: dict[str, list[dict]] = {}
    for row in per_check.values():
        if row.get("baseline_error") == "stale" or row.get("reference") == "baseline":
            try:
                suite = SuiteStores.suite_of(row["test_id"])[0]
            except Exception:  # noqa: BLE001 - a node id no store maps: not part of any suite
                continue
            by_suite.setdefault(suite, []).append(row)
    found = []
    for suite, suite_rows in sorted(by_suite.items()):
        stale = [r for r in suite_rows if r.get("baseline_error") == "stale"]
        of_modules = [r for r in suite_rows if r.get("weights")]
        stale_modules = [r for r in of_modules if r.get("baseline_error") == "stale"]
        if len(stale) < 2 or 2 * len(stale_modules) <= len(of_modules):
            continue
        # The cause the stale checks of a model share (a submodule's captured input changes with
        # the weights that computed it: "weights+input" there, "weights" for the whole model).
        common = set(STALE_CAUSES)
        for r in stale_modules:
            common &= set(str(r.get("stale_cause") or "").split("+"))
        if not common:
            continue
        files = sorted({r["test_id"].partition("::")[0] for r in stale})
        directory = os.path.dirname(os.path.commonpath(files)) if len(files) == 1 else os.path.commonpath(files)
        provenance = next((str(r["reference_provenance"]).rpartition(" — ")[2] for r in stale
                           if r.get("reference_provenance")), None)
        found.append(StaleSuite(suite, directory or ".", "+".join(c for c in STALE_CAUSES if c in common),
                                sorted((r["test_id"], r["check"], r["recipe"]) for r in stale),
                                len(suite_rows) - len(stale), provenance,
                                {(r["test_id"], r["check"], r["recipe"]): str(r.get("stale_cause") or "other")
                                 for r in stale}))
    return found


def torch_version_mismatch(provenance: Any) -> str | None:
    """A note when a baseline was recorded with another torch release than this run's, else None.

    Compared by release (``2.5.1+cpu`` and ``2.5.1+cu124`` are one release): kernels, fast paths
    and autocast rules change between releases, so a failure against such a baseline may be a
    legitimate version difference rather than a fault of the target.
    """
    recorded = provenance.get("torch") if isinstance(provenance, dict) else None
    if not recorded:
        return None
    if base_version(str(recorded)) == base_version(torch.__version__):
        return None
    return (f"Note: torch-version mismatch — the baseline was recorded with torch {recorded}, this run uses "
            f"torch {torch.__version__}. Kernels differ between releases; judge bf16 and training checks by "
            "the golden verdict (--parity-policy golden), or record baselines with this torch.")


def thread_count_mismatch(provenance: Any, target: torch.device) -> str | None:
    """A note when a CPU baseline was recorded with another intra-op thread count than this CPU
    run's (``torch.get_num_threads()``), else None (also for a baseline that recorded no count).

    bf16 CPU kernels block their reductions by thread count: a 1-thread run of the Aurora flow
    sampler differed from its 2-thread baseline in 5 of 384 elements by one bf16 step
    (docs/explanation/verdict-accuracy.md); fp32 results were identical.
    """
    if not isinstance(provenance, dict) or provenance.get("device_type") != "cpu" or torch.device(target).type != "cpu":
        return None
    recorded = provenance.get("threads")
    if not isinstance(recorded, int) or recorded == torch.get_num_threads():
        return None
    return (f"Note: thread-count mismatch — the CPU baseline was recorded with {recorded} intra-op thread"
            f"{'s' * (recorded != 1)}, this run uses {torch.get_num_threads()}; bf16 CPU kernels block their "
            f"reductions by thread count (set OMP_NUM_THREADS={recorded} or torch.set_num_threads({recorded})).")


def write_recording(session: Any, test_id: str, recipe: str, pending: dict[str, CheckBaseline], outcome: str) -> str:
    """End of a recording test (``ParityCase.finish``): write its baseline file with every entry of
    ``pending`` when its body ``passed`` (``store.write``), else nothing (``"not written"``, the
    ``outcome`` kept in ``session.not_written``); the status is kept in ``session.baseline_writes``.

    Returns:
        ``"created"``, ``"changed"``, ``"unchanged"`` or ``"not written"``.

    Raises:
        OSError: the file cannot be written (the old baseline is left intact).
    """
    if outcome != "passed":
        session.baseline_writes[test_id] = "not written"
        session.not_written[test_id] = outcome
        session.baselines_used.add(session.store.path_for(test_id))
        return "not written"
    provenance = recording_provenance(session.target, recipe, session.seed, session.rng)
    status = session.store.write(test_id, pending, provenance)
    session.baseline_writes[test_id] = status
    session.baselines_used.add(session.store.path_for(test_id))
    return status


def store_goldens(session: Any, test_id: str, recipe: str, additions: dict[str, tuple]) -> str:
    """``--parity-store-goldens`` at the end of a compare test (``ParityCase.finish``): add the goldens
    its checks computed live (their baseline entries store none) to its baseline file, whatever the
    verdicts (a golden does not depend on the target; ``checks.stored_golden.add_goldens``); the status
    is kept in ``session.baseline_writes`` like a recording's.

    Raises:
        BaselineError, OSError: as ``add_goldens``.
    """
    facts = recording_provenance(session.target, recipe, session.seed, session.rng)
    status = add_goldens(session.store, test_id, additions, facts)
    session.baseline_writes[test_id] = status
    return status

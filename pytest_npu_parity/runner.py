"""The engine behind the ``parity`` fixture: run a computation on the reference and the target, compare.

One ``ParitySession`` lives for a pytest session (or a script); it knows the target device, where the
reference comes from, the recipes, tolerance overrides and the baseline store, and it collects a
``CheckRecord`` for every check. One ``ParityCase`` serves one test for one recipe:

``case.check(name, fn, *args, **kwargs)``
    runs ``fn`` (a module, a bound method of a module, or a function) on the reference and on the
    target and compares every output leaf. The reference side is the upstream computation on the CPU
    (or, with ``--update-baselines``, on the recording device), or a stored baseline. The target side
    runs on the target device under the recipe and the suite's patch set. Both sides draw their
    randomness from the same seeded CPU stream (``rng.same_randomness``). A sampling check
    (``sample_dim=`` given) under ``rng="device"`` (``--parity-rng device``), or against a baseline
    recorded that way, lets each side draw from its own device's generator and judges the two
    sample sets as distributions (``distribution.compare_distributions``).
``case.train_step(name, module, inputs)``
    one optimizer step on each side from the same weights; compares the loss, every trainable
    parameter's gradient, every parameter after the step and every buffer.
``case.compare(name, actual, expected)``
    judges outputs the user computed.

Modules are moved to the target once per session (a cached deep copy keyed by the module object);
a module with any submodule in training mode gets a fresh copy for every run so that BatchNorm
running statistics or other state changed by one side never leak into the other (``fresh_copy``:
buffers and module objects are copied, parameters — which a forward does not change — are shared
when they already sit on the run's device in the run's dtype).
"""
from __future__ import annotations

import contextlib
import copy
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .baselines import (BaselineError, CorruptBaselineError, MissingBaselineError, StaleBaselineError,
                        UnsafeBaselineError)
from .compare import CompareResult, ParityError, compare, flatten
from .modules import owner_module  # noqa: F401  (also runner.owner_module, as before)
from .policy import Tolerance
from .recipes import RECIPES, Recipe, strict_fp32_flags
from .audit import not_audited
from .checks.settings import (DEFAULT_POLICIES, TRAINING_DEFAULT_POLICIES, CheckSettings,  # noqa: F401
                              IniSettings, MarkerSettings, audit_mode as resolve_audit_mode)
from .rng import RNG_MODES, randomness, target_seed
from .report import columns as col

PatchFactory = Callable[[torch.device], ContextManager[Any]]

# DEFAULT_POLICIES and TRAINING_DEFAULT_POLICIES live with the settings resolver (checks/settings.py).
#: What an audited check does with events beyond its audit budget (``ParitySession(audit_mode=...)``).
AUDIT_JUDGEMENTS = ("off", "record", "warn", "fail")


def is_training(fn: Any) -> bool:
    """Whether ``fn`` is a module that computes differently in training mode: a dropout (p > 0) or a
    batch-norm layer in training mode. (A fresh ``nn.Linear`` is in training mode too but computes
    the same; such modules keep the eval default.)"""
    if not isinstance(fn, torch.nn.Module):
        return False
    for m in fn.modules():
        if not m.training:
            continue
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            return True
    return False


@dataclass
class CheckRecord:
    """What happened in one check, for the terminal summary and the report.

    ``status`` is ``pass``, ``fail``, ``error`` or ``recorded``. ``reference`` is ``cpu`` (live run),
    ``baseline`` or ``recorded``; ``reference_provenance`` is the baseline's file and one-line
    provenance (``Baseline.describe()``: ``"<file> — <device> · <date> · torch <version> …"``).
    ``audit`` is the device-propagation record (a dict) when the audit ran; judged by an audit
    budget (audit modes ``warn``/``fail``), ``extra["audit_budget"]`` is the budget's description,
    ``extra["audit_problem"]`` the events beyond it (``audit.AuditBudget.judge``) and
    ``extra["audit_verdict"]`` what they did (``fail`` or ``warn``); all go into every row of the check. A check whose baseline
    could not be used has status ``error`` and ``extra`` holding ``baseline_error`` (``missing``,
    ``stale``, ``corrupt``, ``unsafe`` or ``unreadable``) and ``baseline_file``; both also go into its row.
    Checks that fail as a whole (every leaf within tolerance) hold the reason in ``extra["check_problem"]``:
    ``extra["vacuous"]`` (``selfcheck.vacuity_problem``), ``extra["teeth"]``/``teeth_problem``
    (``--parity-selfcheck``); a failing check's first-divergence table is ``extra["localization"]``
    (``localize.Localization.to_rows()``, a JSON-able list of dicts).
    ``weights`` is the fingerprint of the module the check ran (``provenance.fingerprint_module``;
    None for a free function or a ``compare``); a stale baseline's record also holds
    ``extra["stale_cause"]``: what the recorded fingerprints say changed, ``weights``, ``input`` or
    ``weights+input`` (``other`` when neither hash differs). Localization (``localize.Localizer``)
    adds ``extra`` keys ``localization_s``, ``localization_reused``, ``localization_skipped`` and
    ``localization_stopped``; these and ``stale_cause`` also go into the check's rows.
    ``distribution_policy`` is the ``distribution.DistributionPolicy`` of a sampling check judged
    as distributions (``result`` is then a ``distribution.DistributionResult``), else None.
    ``layer_records`` is ``(target's, reference's)`` layer records (``layers.capture_layers``) of a
    check judged by a layer policy, else None; ``extra`` then holds ``layer_policy``,
    ``layers_judged``, ``layer_worst``/``layer_worst_rel_l2`` and (failing) ``layers_failing``, which
    also go into every row of the check.
    ``golden_policy`` is the ``golden.GoldenPolicy`` the check was judged by, or None for the
    allclose tolerance; a check that asked for the golden but could not get one (``GoldenRunner``
    raised ``GoldenUnavailableError``) is judged by allclose and says why in ``extra["policy_note"]``.
    """

    test_id: str
    check: str
    recipe: str
    target: str
    target_name: str
    reference: str
    tolerance: Tolerance
    status: str = "pass"
    submodule: str | None = None
    group: str | None = None
    result: CompareResult | None = None
    reference_provenance: str | None = None
    audit: dict | None = None
    duration_s: float = 0.0
    message: str | None = None
    extra: dict = field(default_factory=dict)
    golden_policy: Any = None
    weights: str | None = None
    distribution_policy: Any = None
    layer_records: tuple | None = None

    @property
    def policy(self) -> str:
        """The verdict policy the check was judged by: ``allclose``, ``golden`` or ``distribution``
        (a sampling check whose sides drew from their own streams, ``distribution.DistributionPolicy``)."""
        if self.distribution_policy is not None:
            return "distribution"
        return "allclose" if self.golden_policy is None else "golden"

    def rows(self) -> list[dict[str, Any]]:
        """One dict per compared leaf (the report's row schema); one row with no metrics otherwise."""
        base = {
            "test_id": self.test_id, "check": self.check, "submodule": self.submodule,
            "group": self.group or self.submodule or self.check,
            "recipe": self.recipe, "target": self.target, "target_name": self.target_name,
            "reference": self.reference, "reference_provenance": self.reference_provenance,
            "duration_s": self.duration_s, "policy": self.policy,
            "golden_policy": self.golden_policy.describe() if self.golden_policy is not None else None,
            "distribution_policy": (self.distribution_policy.describe()
                                    if self.distribution_policy is not None else None),
            "policy_note": self.extra.get("policy_note"),
            "weights": self.weights[:16] if self.weights else None,
        }
        counts = (self.audit or {}).get("counts", {})
        for kind in ("mixed_device", "h2d", "d2h", "host_sync", "cpu_fallback", "fp64"):
            base[f"audit_{kind}"] = counts.get(kind)
        for key in ("audit_budget", "audit_problem", "audit_verdict", "layer_policy", "layers_judged",
                    "layer_worst", "layer_worst_rel_l2", "layers_failing"):
            base[key] = self.extra.get(key)
        leaves = self.result.leaves if self.result is not None else []
        if not leaves:
            row = dict(base, leaf=None, verdict=self.status, problem=self.message,
                       rtol=self.tolerance.rtol, atol=self.tolerance.atol, budget=self.tolerance.budget,
                       tolerance_source=self.tolerance.source, tolerance_reason=self.tolerance.reason)
            for key in ("baseline_error", "baseline_file", "stale_cause"):
                if key in self.extra:
                    row[key] = self.extra[key]
            return [dict(row, **self._extra_columns(first=True))]
        rows = []
        for i, leaf in enumerate(leaves):
            row = dict(base, **leaf.to_row())
            if self.status == "error":
                row["verdict"] = "error"
            elif self.status == "fail" and self.extra.get("check_problem") and row["verdict"] == "pass":
                # Every leaf within tolerance, but the check failed as a whole (vacuous, no teeth).
                row["verdict"], row["problem"] = "fail", self.extra["check_problem"]
            rows.append(dict(row, **self._extra_columns(first=i == 0)))
        return rows

    def _extra_columns(self, first: bool) -> dict[str, Any]:
        """Row columns from ``extra``: ``vacuous``/``vacuous_ok``/``teeth``/``teeth_problem`` on every
        row, the first-divergence table ``localization`` (JSON text) on the check's first row only."""
        columns = {k: self.extra[k] for k in ("vacuous", "vacuous_ok", "teeth", "teeth_problem") if k in self.extra}
        if first:
            columns.update({k: self.extra[k] for k in _LOCALIZATION_COLUMNS if k in self.extra})
        if first and self.extra.get("localization") is not None:
            import json

            columns["localization"] = json.dumps(self.extra["localization"], default=str)
        return columns


#: ``CheckRecord.extra`` keys ``localize.Localizer`` sets, exported on a check's first row.
_LOCALIZATION_COLUMNS = ("localization_s", "localization_reused", "localization_skipped", "localization_stopped")


def stale_cause(recorded_meta: dict, hashes: dict[str, Any], structure_changed: bool = False) -> str:
    """What a stale baseline entry's recorded fingerprints say changed: ``weights`` (the module's
    ``config_hash``), ``config`` (its configuration or structure: ``structure_changed``, as
    ``baselines.StaleBaselineError.structure_changed`` says), ``input`` (``input_hash``), joined by
    ``+`` in that order (``config+input``: a submodule whose captured input changed with the model's
    config), or ``other`` (none of them: a leaf, shape, dtype, recipe or seed).

    Args:
        recorded_meta: the stored check's metadata (``baselines.CheckBaseline.meta``).
        hashes: the current ``input_hash`` and ``config_hash`` (hex strings).
        structure_changed: the recorded configuration or structure differs from the module's.
    """
    changed = ["weights"] if recorded_meta.get("config_hash") != hashes.get("config_hash") else []
    if structure_changed:
        changed.append("config")
    if recorded_meta.get("input_hash") != hashes.get("input_hash"):
        changed.append("input")
    return "+".join(changed) or "other"


#: The causes ``stale_cause`` names, in the order it joins them.
STALE_CAUSES = ("weights", "config", "input")


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
    """

    suite: str
    directory: str
    cause: str
    checks: list[tuple[str, str, str]]
    fresh: int
    provenance: str | None = None

    def fix(self, update_command: str) -> str:
        """The one command that re-records the suite: ``<update_command> <directory>``."""
        import shlex

        return f"{update_command} {shlex.quote(self.directory)}"


def stale_suites(rows: list[dict[str, Any]]) -> list[StaleSuite]:
    """Suites where the model (or the inputs) changed for the suite as a whole: report rows
    (``CheckRecord.rows``) grouped by suite; a suite qualifies when at least two of its checks are
    stale, more than half of its checks of a module (``weights`` set) that met a baseline are stale,
    and those share a cause (``stale_cause``: ``weights`` in ``weights`` and ``weights+input``;
    ``other`` never qualifies). A second model of the suite whose baselines still match (the
    Aurora suite's tiny training-step model) does not hide it. Suites are those of
    ``baselines.SuiteStores``; every stale check of the suite is a member, the others ``fresh``.
    """
    import os

    from .baselines import SuiteStores

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
                                len(suite_rows) - len(stale), provenance))
    return found


@dataclass
class CheckCall:
    """How one check computes its output, for hooks that run it again (localization, self-check).

    Attributes:
        kind: ``check`` (``fn(*args, **kwargs)``) or ``train_step`` (``fn`` is the module; one
            training step on ``fn(**kwargs)``, ``args`` is empty).
        fn: a module, a bound method of one, or a function (``check``); the module (``train_step``).
        args, kwargs: the check's inputs as given (CPU tensors, before placement).
        seed: seed of the shared random stream both sides ran under.
        grad: autograd was on (always for a train step).
        rerun: ``(device, patched, args, kwargs) -> {leaf path: CPU tensor or None}``: the whole
            check on one side with other inputs (patched: under the case's patch set, as the target).
        vacuous_ok: why the check may be vacuous (``parity.check(..., vacuous_ok=...)`` or the
            ``parity`` marker), or None.
        fault_weight: the parameter of the check's module (a ``named_parameters`` name) that
            ``--parity-selfcheck`` perturbs, or None for ``selfcheck.sensitive_parameter``'s choice.
        sample_dim: the axis of i.i.d. samples of a sampling check, or None.
        replay: for a plain training step (``train_step`` without ``loop`` or loss scaling),
            ``(leaves) -> {param.<p>: CPU tensor}``: the optimizer step replayed on a fresh CPU copy
            of the module from the ``grad.<p>`` leaves in ``leaves`` (see ``ParityCase.train_step``,
            optimizer replay); None for other checks.
        memo: what else makes the run another computation, for the session's reference and golden
            memos (``ParityCase._memo_key``): the layer records' sample count (None without
            layer records); a train step's ``optimizer``, ``loss_fn``, ``max_grad_norm`` and
            ``loop`` (callables by identity, ``_Same``).
        notes: what the check's note says besides the verdict's own (e.g. the layer check is off
            for a compiled module, ``_layers_unless_compiled``).
    """

    kind: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    seed: int
    grad: bool
    rerun: Callable[..., dict]
    vacuous_ok: str | None = None
    fault_weight: str | None = None
    sample_dim: int | None = None
    replay: Callable[[dict], dict] | None = None
    memo: tuple = ()
    notes: list[str] = field(default_factory=list)

    @property
    def module(self) -> torch.nn.Module | None:
        """The module the computation belongs to (``owner_module(fn)``), or None for a function."""
        return owner_module(self.fn)


class _Same:
    """A memo-key part that equals only another ``_Same`` of the very same object (hashed by
    ``id``, which works for unhashable callables); it holds the object, so that no other object
    takes its ``id`` while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


class _CopyOnEntry:
    """A module argument of ``ParityCase._call`` that is deep-copied to the run's device only once
    the run's patch set is entered (``train_step``: each side trains a fresh copy). Copying before
    the patches would hide from the target a patch that edits the module's weights, which
    ``_call`` otherwise applies before placing a module."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def copy(self, device: torch.device) -> torch.nn.Module:
        """``trainable_copy(module).to(device)``."""
        return trainable_copy(self.module).to(device)


def trainable_copy(module: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(module)`` whose parameters are leaves with the original's ``requires_grad``.

    A plain deep copy of a module holding a ``torch.jit.script`` submodule gives that submodule's
    parameters a ``grad_fn`` (``CloneBackward0``; torch 2.5.1 and 2.14.1): they are no leaves, and
    an optimizer over them raises ``ValueError: can't optimize a non-leaf Tensor``. Copied under
    ``torch.no_grad()`` they are leaves (without ``requires_grad`` there), which is then restored.
    """
    with torch.no_grad():
        fresh = copy.deepcopy(module)
    for (_, theirs), (_, ours) in zip(module.named_parameters(remove_duplicate=False),
                                      fresh.named_parameters(remove_duplicate=False)):
        if ours.requires_grad != theirs.requires_grad:
            ours.requires_grad_(theirs.requires_grad)
    return fresh


def _move(obj: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """Copy every tensor in a nested structure to ``device`` (floating ones cast to ``float_dtype``).

    Always a new tensor, also where ``Tensor.to`` would return the caller's own (same device and
    dtype: a CPU reference, a CPU target): each side runs on its own copy of the caller's inputs,
    so a computation that changes an input in place (``x.sub_(mean)``, ``masked_fill_`` on a mask
    argument) changes neither the caller's tensor nor what the next side is given. A copy of a
    tensor that requires grad stays connected to it, as a copy to another device is.
    """
    if isinstance(obj, torch.Tensor):
        if float_dtype is not None and obj.is_floating_point():
            moved = obj.to(device=device, dtype=float_dtype)
        else:
            moved = obj.to(device)
        return obj.clone() if moved is obj else moved
    if isinstance(obj, dict) or hasattr(obj, "items") and hasattr(obj, "keys"):
        return type(obj)({k: _move(v, device, float_dtype) for k, v in obj.items()}) if isinstance(obj, dict) \
            else {k: _move(v, device, float_dtype) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_move(v, device, float_dtype) for v in obj)
    if isinstance(obj, list):
        return [_move(v, device, float_dtype) for v in obj]
    return obj


def _layers_unless_compiled(policy: Any, module: torch.nn.Module | None) -> tuple[Any, str | None]:
    """``(layer policy, note)``: the check's layer policy, or None with a note when ``module`` is (or
    holds) a ``torch.compile``d module (``layers.compiled_modules``). The layer check's forward hooks
    would be traced into the compiled program — graph breaks at the record's sampling, another graph
    than the one production runs — so a compiled module is judged by its outputs alone."""
    if policy is None or module is None:
        return policy, None
    from .layers import compiled_modules

    compiled = compiled_modules(module)
    if not compiled:
        return policy, None
    where = f"submodule {compiled[0]!r}" if compiled[0] else f"the {type(module).__name__}"
    return None, (f"layer check off: {where} is compiled (torch.compile), and recording its layers would "
                  "change the compiled program (graph breaks); its outputs are judged")


def _changed_inputs(given: tuple[tuple, dict], ran: tuple[Any, Any]) -> list[str]:
    """Paths (``args[0]``, ``kwargs['mask']``, ``args[1][2]``) of the tensors in ``ran`` — one side's
    ``(args, kwargs)`` copies after its run (``_move``) — whose values differ from the caller's
    ``given``: inputs the computation changed in place (NaN equal to NaN)."""
    return _changed(given[0], ran[0], "args") + _changed(given[1], ran[1], "kwargs")


def _changed(given: Any, ran: Any, path: str) -> list[str]:
    if isinstance(given, torch.Tensor) and isinstance(ran, torch.Tensor):
        if ran.shape != given.shape:
            return [path]
        before, after = given.detach().to(device=ran.device, dtype=ran.dtype), ran.detach()
        if after.is_floating_point() or after.is_complex():
            same = bool(torch.eq(after, before).logical_or_(after.isnan() & before.isnan()).all())
        else:
            same = torch.equal(after, before)
        return [] if same else [path]
    if isinstance(given, (tuple, list)) and isinstance(ran, (tuple, list)) and len(given) == len(ran):
        return [p for i, (g, r) in enumerate(zip(given, ran)) for p in _changed(g, r, f"{path}[{i}]")]
    if isinstance(given, dict) and isinstance(ran, dict):
        return [p for k, g in given.items() if k in ran for p in _changed(g, ran[k], f"{path}[{k!r}]")]
    return []


def _input_change_verdict(changes: dict[str, set[str]] | None, *, live_reference: bool) -> tuple[str | None, str | None]:
    """``(note, problem)`` for the inputs a check's runs changed in place (``_changed_inputs``).

    The note says which inputs changed (each side ran on its own copy of the caller's inputs, so
    the comparison is unaffected). The problem, when a live reference ran: the two sides changed
    different inputs — a port that drops (or adds) an in-place update of its argument computes
    something else, even where the outputs agree."""
    if not changes:
        return None, None
    ref, tgt = changes.get("reference", set()), changes.get("target", set())
    shown = ", ".join(sorted(ref | tgt))
    note = (f"the computation changes its input(s) {shown} in place; each side ran on its own copy of the "
            "caller's inputs")
    if not live_reference or ref == tgt:
        return note, None
    only_ref, only_tgt = sorted(ref - tgt), sorted(tgt - ref)
    parts = ([f"{', '.join(only_ref)} on the reference only"] if only_ref else []) + (
        [f"{', '.join(only_tgt)} on the target only"] if only_tgt else [])
    return note, ("Input changed in place on one side only: " + "; ".join(parts)
                  + " — the target changes its arguments differently from the reference.")


def _to_cpu_leaves(output: Any) -> dict[str, torch.Tensor | None]:
    return {path: (t.detach().cpu() if t is not None else None) for path, t in flatten(output)}


def _any_training(module: torch.nn.Module) -> bool:
    return any(m.training for m in module.modules())


def _sync_modes(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    for a, b in zip(src.modules(), dst.modules()):
        b.training = a.training


def _on_device(module: torch.nn.Module, device: torch.device, dtype: torch.dtype | None) -> bool:
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device != device:
            return False
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            return False
    return True


def fresh_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose buffers and submodule objects (their ``training`` flags, cached
    attributes) are new, sharing the parameter tensors with ``module``.

    For a forward in training mode: BatchNorm running statistics, ``num_batches_tracked`` and other
    buffers change in the copy only, while the weights — up to 210 M parameters for Aurora, which a
    forward does not modify — are not duplicated. Not for a training step: an optimizer updates
    the shared parameters in place (``ParityCase.train_step`` deep-copies).
    """
    return copy.deepcopy(module, memo={id(p): p for p in module.parameters()})


class ParitySession:
    """Session-wide parity state (no pytest needed: usable from a script or notebook).

    Args:
        target: the device under test.
        reference: ``auto`` (stored baseline when one exists for the check, else a live CPU run),
            ``cpu`` or ``baseline`` (a missing baseline is a failure).
        update_baselines: record mode: run each check's reference computation on ``target`` and
            store it instead of comparing.
        store: a ``baselines.BaselineStore`` (required for ``baseline`` and record mode).
        check_tolerances: per check name (exact name or ``fnmatch`` pattern): a ``Tolerance`` or a
            spec string (``"rtol=1e-4 # reason"``, parsed over the recipe's default).
        recipe_tolerances: per recipe default overrides (from ini).
        seed: default seed for every check.
        audit_factory: ``(device) -> context manager yielding an object with .to_dict()`` to audit
            target runs (e.g. :func:`target_audit`), or None (no audit, no cost). An object with
            ``to_target`` places the module and inputs itself; one with ``logical`` True audits an
            extra run (see ``ParityCase._run``).
        failure_hooks: callables ``(case, record, call, result) -> str | None`` (``call`` a
            ``CheckCall``), run when a check is out of tolerance; their text is appended to the
            failure message (``localize.Localizer``: first-divergence localization within a budget,
            shared across checks; ``localize.failure_hook``: without either).
        check_hooks: callables ``(case, record, call, actual, expected) -> str | None`` run after
            every comparison (pass or fail; ``actual``/``expected`` the CPU leaves); a returned
            text fails the check with that text (``selfcheck.SelfCheck``: ``--parity-selfcheck``).
        recipe_policies: verdict policy per recipe (``"allclose"``, ``"golden"``, ``"golden rmse=3 …"``
            or a ``golden.GoldenPolicy``); recipes not named use ``DEFAULT_POLICIES``.
        check_policies: per check name (exact or ``fnmatch`` pattern): a policy spec string as above.
        golden_runner: computes golden outputs (``golden.GoldenRunner``; default: a new one). A suite
            may set its ``root`` (share one golden copy of a model) and ``shims``.
        audit_mode: ``off`` (no audit), or what an audited check does with events beyond its audit
            budget (``audit.AuditBudget``): ``record`` (keep the audit in the record, judge
            nothing), ``warn`` (also put the events in ``extra["audit_problem"]`` and issue an
            ``audit.ParityAuditWarning``) or ``fail`` (the check fails with them). Default:
            ``record`` with an ``audit_factory``, else ``off``. A test may choose another
            (``ParityCase(audit_mode=...)``); nothing is audited without an ``audit_factory``.
        audit_budget: the budget of a check that declares none (an ``audit.AuditBudget`` or a spec
            for ``audit.parse_audit_budget``; default ``audit.DEFAULT_AUDIT_BUDGET``).
        rng: how sampling checks (``check(..., sample_dim=...)``) draw randomness (``rng.RNG_MODES``):
            ``shared`` (default: one seeded CPU stream for both sides, samples compared one by one) or
            ``device`` (each side its own device's generators, the target's seeded with
            ``rng.target_seed``; judged as distributions). Other checks always use the shared stream.
        distribution_policy: the ``distribution.DistributionPolicy`` of distribution verdicts
            (default: ``DistributionPolicy()``, alpha 1e-3, 1999 permutations).
        train_store: how training steps are recorded in baselines: ``"full"`` (default),
            ``"summary"`` or ``"summary min_numel=N samples=K"`` (``compact.parse_train_store``) or a
            ``compact.TrainStore``: large gradients and parameters kept as a deterministic sample
            plus summary statistics (module ``compact``).
        layers: the layer check (module ``layers``): ``"default"`` (``layers.DEFAULT_LIMITS``: fp32
            layers judged at rel-L2 1e-5, other recipes not), ``"off"``/None, or a relative L2 limit
            (a float, a spec string or a ``layers.LayerPolicy``) for the fp32 recipe; other recipes
            then record no layers unless a test asks (``ParityCase(marker_layers=...)``).
        settings: the seven per-check settings above (``check_tolerances`` … ``layers``) already parsed
            (``checks.settings.IniSettings``, what the pytest plugin builds at start-up); give either it
            or those keywords (TypeError otherwise).
    """

    def __init__(self, target: torch.device, *, reference: str = "auto", update_baselines: bool = False,
                 store: Any = None, check_tolerances: dict[str, Tolerance | str] | None = None,
                 recipe_tolerances: dict[str, Tolerance] | None = None, seed: int = 0,
                 audit_factory: Callable[[torch.device], ContextManager[Any]] | None = None,
                 failure_hooks: list[Callable[..., str | None]] | None = None,
                 check_hooks: list[Callable[..., str | None]] | None = None,
                 recipe_policies: dict[str, Any] | None = None, check_policies: dict[str, str] | None = None,
                 golden_runner: Any = None, audit_mode: str | None = None, audit_budget: Any = None,
                 rng: str = "shared", distribution_policy: Any = None, train_store: Any = None,
                 layers: Any = "default", settings: IniSettings | None = None):
        from .distribution import DistributionPolicy
        from .golden import GoldenRunner

        if reference not in ("auto", "cpu", "baseline"):
            raise ValueError(f"--parity-reference={reference!r}: use auto, cpu or baseline")
        if rng not in RNG_MODES:
            raise ValueError(f"--parity-rng={rng!r}: use {' or '.join(RNG_MODES)}")
        self.rng = rng
        self.distribution_policy = distribution_policy or DistributionPolicy()
        if (reference == "baseline" or update_baselines) and store is None:
            raise ValueError("a baseline store is needed for --parity-reference=baseline and --update-baselines")
        self.target = target
        self.reference = reference
        self.update_baselines = update_baselines
        self.store = store
        self.seed = seed
        self.audit_factory = audit_factory
        if audit_mode is None:
            audit_mode = "record" if audit_factory is not None else "off"
        if audit_mode not in AUDIT_JUDGEMENTS:
            raise ValueError(f"audit_mode={audit_mode!r}: use one of {', '.join(AUDIT_JUDGEMENTS)}")
        self.audit_mode = audit_mode
        specs = dict(check_tolerances=check_tolerances, recipe_tolerances=recipe_tolerances,
                     recipe_policies=recipe_policies, check_policies=check_policies, audit_budget=audit_budget,
                     train_store=train_store, layers=layers)
        if settings is None:
            settings = IniSettings.from_specs(**specs)
        elif any(value is not None for key, value in specs.items() if key != "layers") or layers != "default":
            raise TypeError("ParitySession: give settings= or the per-check settings keywords, not both")
        self.settings = CheckSettings(settings)
        self.check_tolerances = dict(check_tolerances if check_tolerances is not None else settings.check_tolerances)
        self.recipe_tolerances = dict(settings.recipe_tolerances)
        self.recipe_policies: dict[str, Any] = dict(settings.recipe_policies)
        self.check_policies = dict(settings.check_policies)
        self.audit_budget = settings.audit_budget
        self.train_store = settings.train_store
        self.layers = settings.layers
        self.patterns_used = self.settings.patterns_used  # check_tolerances/check_policies patterns that matched
        self.failure_hooks = list(failure_hooks or [])
        self.check_hooks = list(check_hooks or [])
        self.golden_runner = golden_runner if golden_runner is not None else GoldenRunner()
        self._golden_memo: dict[tuple, Any] = {}
        self.records: list[CheckRecord] = []
        self.baseline_writes: dict[str, str] = {}  # test_id -> created/changed/unchanged/not written
        self.not_written: dict[str, str] = {}  # test_id -> why not (failed, skipped, interrupted)
        self.baselines_used: set = set()
        self._copies: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        self._reference_memo: dict[tuple, dict] = {}
        self.patches_applied: set[str] = set()
        from .devices import device_name

        self.target_name = device_name(target)

    def layer_policy(self, recipe: str) -> Any:
        """The ``layers.LayerPolicy`` of ``recipe``'s checks, or None when they record no layers."""
        return self.settings.layer_policy(recipe)

    # -- modules -------------------------------------------------------------------------------
    def place(self, module: torch.nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """``module`` on ``device`` (floating tensors in ``dtype`` if given), copied at most once per session.

        A module already there is returned as is. Modules in training mode get a fresh copy each
        call (see module doc). Weights edited after the first placement are not seen by the cached
        copy: call ``forget(module)`` after editing.
        """
        if _any_training(module):
            if _on_device(module, device, dtype):
                return fresh_copy(module)  # buffers new, weights shared (a forward does not change them)
            return copy.deepcopy(module).to(device=device, dtype=dtype)
        if _on_device(module, device, dtype):
            return module
        per_module = self._copies.setdefault(module, {})
        key = (str(device), dtype)
        placed = per_module.get(key)
        if placed is None:
            placed = copy.deepcopy(module).to(device=device, dtype=dtype) if dtype else copy.deepcopy(module).to(device)
            per_module[key] = placed
        _sync_modes(module, placed)
        return placed

    def metadata(self, recipes: list[str], pytest_args: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """The run's metadata for reports: versions, machine, target, reference, flags, patch set."""
        import datetime
        import uuid

        from .provenance import collect_provenance
        from .recipes import precision_flags

        with strict_fp32_flags():
            flags = precision_flags()
        prov = collect_provenance(self.target, recipe=",".join(recipes), seed=self.seed, precision_flags=flags)
        created = datetime.datetime.now(datetime.timezone.utc)
        return {
            "run_id": created.strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6],
            "created": created.isoformat(timespec="seconds"),
            "git_revision": prov.get("git_revision"),
            "machine": prov.get("platform"),
            "python": prov.get("python"),
            "torch": prov.get("torch"),
            "torch_npu": prov.get("torch_npu"),
            "cann": prov.get("cann"),
            "transformers": prov.get("transformers"),
            "aurora_model": prov.get("aurora_model"),
            "plugin_version": prov.get("plugin_version"),
            "threads": prov.get("threads"),
            "interop_threads": prov.get("interop_threads"),
            "target": str(self.target),
            "target_name": self.target_name,
            "reference": "recording" if self.update_baselines else self.reference,
            "rng": self.rng,
            "recipes": list(recipes),
            "precision_flags": flags,
            "patch_set": sorted(self.patches_applied),
            "pytest_args": list(pytest_args),
        }

    def forget(self, module: torch.nn.Module) -> None:
        """Drop cached device copies of ``module`` and every cached golden copy and result (after
        editing its weights)."""
        self._copies.pop(module, None)
        self.golden_runner.forget()
        self._golden_memo.clear()

    def verdict_policy(self, recipe: str, check: str, marker: str | None = None,
                       explicit: str | None = None, *, training: bool = False) -> Any:
        """The verdict policy of ``check`` under ``recipe``: None (allclose, by ``tolerance()``) or a
        ``golden.GoldenPolicy``. Precedence: ``DEFAULT_POLICIES`` (``TRAINING_DEFAULT_POLICIES`` first
        for a ``training`` check) < ``recipe_policies`` (ini
        ``parity_<recipe>_policy``, ``--parity-policy``) < ``check_policies`` (ini ``parity_policies``)
        < ``marker`` (``@pytest.mark.parity(policy=...)``) < ``explicit`` (``check(..., policy=...)``);
        see ``checks.settings.CheckSettings.verdict_policy``.

        Raises:
            ValueError: a policy spec that ``golden.parse_policy_spec`` rejects.
        """
        return self.settings.verdict_policy(recipe, check, marker, explicit, training=training)

    def golden(self, key: tuple, owner: Any, run: Callable[[], dict]) -> dict[str, torch.Tensor | None]:
        """The golden leaves of one check: ``run()`` once per session per ``key`` (see
        ``ParityCase._memo_key``), then reused; ``owner`` (the check's function or module, whose
        ``id`` is in the key) is kept alive with the result so that no other object takes its id.

        Raises:
            golden.GoldenUnavailableError: as ``run`` (not memoized: it is raised again).
        """
        if key not in self._golden_memo:
            self._golden_memo[key] = (owner, run())
        return self._golden_memo[key][1]

    def tolerance(self, recipe: str, check: str, marker: Tolerance | None = None,
                  explicit: dict[str, Any] | None = None) -> Tolerance:
        """The tolerance for ``check`` under ``recipe``: default < ini recipe < ini per-check < marker < explicit
        (``checks.settings.CheckSettings.tolerance``)."""
        return self.settings.tolerance(recipe, check, marker, explicit)


class ParityCase:
    """The ``parity`` fixture's object: checks for one test under one recipe.

    Args:
        session: the ``ParitySession``.
        test_id: the pytest node id (names the baseline file).
        recipe: a recipe name from ``recipes.RECIPES``.
        marker_tolerance: tolerance from ``@pytest.mark.parity(...)``, if any.
        patches: ``(device) -> context manager`` applying the suite's patch set on the target side.
        vacuous_ok: why every check of the test may be vacuous (``@pytest.mark.parity(vacuous_ok=...)``);
            a check's own ``vacuous_ok`` takes precedence.
        marker_policy: verdict policy spec from ``@pytest.mark.parity(policy=...)`` (``"golden"``,
            ``"golden rmse=3 # reason"``, ``"allclose"``), or None.
        audit_budget: the audit budget of every check of the test (an ``audit.AuditBudget`` or a
            spec over the session's, see ``audit.parse_audit_budget``), or None for the session's.
        audit_mode: ``off`` (no audit for this test), ``warn`` or ``fail``; None: the session's.
        marker_train_store: train store from ``@pytest.mark.parity(train_store=...)`` (``"summary"``
            …), or None for the session's.
        marker_layers: the layer check of every check of the test (``@pytest.mark.parity(layers=...)``:
            ``False``/``"off"``, a relative L2 limit, ``True`` for the fp32 default; see
            ``layers.parse_layer_spec``), or None for the session's per recipe.
    """

    #: Inputs each side's run changed in place (``"reference"``/``"target"`` -> paths such as
    #: ``args[0]``) while a check's pipeline runs (``_record_or_compare`` to ``_judge``); None outside.
    _input_changes: dict[str, set[str]] | None = None

    def __init__(self, session: ParitySession, test_id: str, recipe: str = "fp32", *,
                 marker_tolerance: Tolerance | None = None, patches: PatchFactory | None = None,
                 vacuous_ok: str | None = None, marker_policy: str | None = None, audit_budget: Any = None,
                 audit_mode: str | None = None, marker_train_store: str | None = None, marker_layers: Any = None):
        if recipe not in RECIPES:
            raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
        self.session = session
        self.test_id = test_id
        self.recipe: Recipe = RECIPES[recipe]
        self.marker_tolerance = marker_tolerance
        self.patches = patches
        self.vacuous_ok = vacuous_ok
        self.marker_policy = marker_policy
        # The marker's settings, parsed once for this test (a bad spec fails before any run).
        self.marker: MarkerSettings = session.settings.marker(
            recipe, tolerance=marker_tolerance, policy=marker_policy, audit_mode=audit_mode, audit_budget=audit_budget,
            train_store=marker_train_store, layers=marker_layers)
        self.audit_mode = audit_mode
        self.audit_budget = self.marker.audit_budget
        self.marker_train_store = self.marker.train_store
        self.marker_layers = marker_layers
        self.layer_policy = self.marker.layers
        self.records: list[CheckRecord] = []
        self._pending: dict[str, Any] = {}
        self._baseline: Any = None
        self._baseline_loaded = False
        self.not_written: str | None = None

    # -- public API ----------------------------------------------------------------------------
    @property
    def target(self) -> torch.device:
        return self.session.target

    def check(self, name: str, fn: Callable[..., Any], *args: Any, submodule: str | None = None,
              group: str | None = None, seed: int | None = None, grad: bool = False, rtol: float | None = None,
              atol: float | None = None, budget: float | None = None, reason: str | None = None,
              vacuous_ok: str | None = None, fault_weight: str | None = None, policy: str | None = None,
              audit_budget: Any = None, sample_dim: int | None = None, layers: Any = None,
              **kwargs: Any) -> CheckRecord:
        """Run ``fn(*args, **kwargs)`` on the reference and the target and compare every output leaf.

        Args:
            name: the check's name, unique within the test (names the stored baseline entry).
            fn: an ``nn.Module``, a bound method of one (e.g. ``model.generate``) or a function.
                Tensors in ``args``/``kwargs`` and the module's parameters/buffers are moved to
                each side's device.
            submodule: dotted path of the module inside its model, for the report.
            group: what the check is counted under in the summary (e.g. the module's class);
                default: ``submodule`` or ``name``.
            seed: seed of the shared random stream (default: the session's).
            grad: run with autograd enabled (default: ``torch.no_grad()``).
            rtol, atol, budget, reason: per-check tolerance override (``reason`` is shown in the report).
            vacuous_ok: why this check may be vacuous (its reference output constant, or without
                teeth under ``--parity-selfcheck``); without it such a check fails.
            fault_weight: the parameter of ``fn``'s module that ``--parity-selfcheck`` perturbs
                (default: its largest trainable weight matrix, ``selfcheck.sensitive_parameter``).
            policy: verdict policy of this check: ``"allclose"`` (the tolerance) or ``"golden"``
                (``"golden rmse=3 … # reason"`` for other limits): both sides are then compared
                with a CPU golden run of ``fn`` in ``golden.golden_dtypes(recipe)`` (fp64; for bf16
                work fp32 where fp64 cannot run) and judged by ``golden.judge_golden``. Default: the session's
                ``verdict_policy``.
            audit_budget: what this check's audited target run may do (``audit.parse_audit_budget``:
                ``{"h2d": 2}``, ``"h2d=2 # reason"``), over the test's budget; used when the session
                audits (``--parity-audit``): events beyond it fail the check (or warn).
            sample_dim: for a sampling computation (``generate(num_samples=S)``), the axis of its
                i.i.d. samples in every floating output leaf. With the shared random stream (the
                default) the samples are compared one by one as any output; where the sides draw
                from their own streams (session ``rng="device"``, or a baseline recorded so) the
                two sample sets are judged as distributions by ``distribution.compare_distributions``
                under ``session.distribution_policy``, and ``rtol``/``atol``/``policy`` do not apply.
            layers: this check's layer check (``layers.parse_layer_spec``: ``False`` off, a relative
                L2 limit, ``True`` the fp32 default); default: the test's (marker ``layers=``), else
                the session's for the recipe (fp32: every weighted submodule's output within
                rel-L2 1e-5 of the reference's, module ``layers``). Not applied to samples judged
                as distributions.

        Returns:
            The ``CheckRecord`` (also kept for the summary and report).

        Raises:
            ParityError: an output leaf is out of tolerance, or shapes/dtypes/structure differ, or
                a weighted layer's output moved beyond the layer limit (``layers.judge_layers``), or
                the check is vacuous (``selfcheck.vacuity_problem``), or (audit mode ``fail``) its
                audited target run has events beyond its audit budget.
            baselines.BaselineError: the stored baseline is missing (with ``--parity-reference
                baseline``), stale or corrupt.
            recipes.RecipeUnsupportedError: the computation runs under fp32 but not under the
                test's recipe on this device (an op the backend cannot run in that precision).
        """
        __tracebackhide__ = True
        seed = self.session.seed if seed is None else seed
        tol = self.session.tolerance(self.recipe.name, name, self.marker_tolerance,
                                     dict(rtol=rtol, atol=atol, budget=budget, reason=reason))
        golden_policy = self._verdict_policy(name, policy, training=grad or is_training(fn))
        budget = self._audit_budget(name, audit_budget)
        layer_policy, layer_note = _layers_unless_compiled(self._layer_policy(name, layers), owner_module(fn))
        self._check_name(name)
        start = time.perf_counter()
        hashes = self._hashes(fn, args, kwargs)

        own = sample_dim is not None and self.session.rng == "device"
        if sample_dim is not None and (not isinstance(sample_dim, int) or isinstance(sample_dim, bool)):
            raise TypeError(f"parity check {name!r}: sample_dim must be an int (the sample axis), got {sample_dim!r}")

        def stream(patched: bool) -> tuple[str, int]:
            # device mode: each side its own generators; the target's stream independent of the
            # reference's (patched runs are the target's; a recording is the reference)
            if not own:
                return "shared", seed
            return "device", target_seed(seed) if patched else seed

        def run(device: torch.device, patched: bool, audited: bool = False):
            __tracebackhide__ = True
            return self._run(fn, args, kwargs, device, seed=seed, patched=patched, grad=grad, audited=audited,
                             stream=stream(patched), layers=layer_policy)

        def rerun(device: torch.device, patched: bool, call_args: tuple, call_kwargs: dict) -> dict:
            return self._run(fn, call_args, call_kwargs, device, seed=seed, patched=patched, grad=grad,
                             stream=stream(patched))[0]

        def golden() -> dict:
            return self.session.golden_runner.run(fn, args, kwargs, recipe=self.recipe.name, seed=seed, grad=grad)

        call = CheckCall("check", fn, args, kwargs, seed, grad, rerun, vacuous_ok, fault_weight, sample_dim,
                         memo=(getattr(layer_policy, "samples", None),), notes=[layer_note] if layer_note else [])
        return self._record_or_compare(name, run, hashes, call, tol, submodule, group, start,
                                       golden_policy, golden, budget, layer_policy=layer_policy)

    def train_step(self, name: str, module: torch.nn.Module, inputs: Any, *,
                   labels: Any = None, loss_fn: Callable[..., torch.Tensor] | None = None,
                   optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
                   max_grad_norm: float | None = 1.0, seed: int | None = None, submodule: str | None = None,
                   group: str | None = None,
                   rtol: float | None = None, atol: float | None = None, budget: float | None = None,
                   reason: str | None = None, vacuous_ok: str | None = None,
                   fault_weight: str | None = None, policy: str | None = None,
                   loop: Callable[[torch.nn.Module, dict, Recipe | None], dict] | None = None,
                   audit_budget: Any = None, store: str | None = None, layers: Any = None) -> CheckRecord:
        """One training step on each side from the same weights, compared leaf by leaf.

        Each side deep-copies ``module``, puts it in training mode on its device, runs the forward
        under the recipe (forward and loss under autocast for bf16, backward outside it, as Hugging
        Face Trainer does), computes the loss, ``loss.backward()``, clips the global gradient norm to
        ``max_grad_norm`` (``torch.nn.utils.clip_grad_norm_``) and takes one ``optimizer`` step
        (default ``default_optimizer``: AdamW as upstream Aurora trains).

        Args:
            inputs: what the forward is called with: a dict (``module(**inputs)``; a Hugging Face
                batch with ``labels`` inside computes its own ``output.loss``), a tuple or list
                (``module(*inputs)``) or one tensor (``module(inputs)``).
            labels: targets of the loss, outside the forward's inputs (a tensor or any nested
                structure of them; moved to each side's device like the inputs). With ``labels``,
                the loss is ``loss_fn(output, labels)`` — the ``criterion(outputs, labels)`` of a
                PyTorch training loop, so ``loss_fn=torch.nn.CrossEntropyLoss()`` works as it is.
            loss_fn: ``loss_fn(output)`` without ``labels``, ``loss_fn(output, labels)`` with them;
                default (without ``labels`` only): ``output.loss``, else ``output[0]`` of a tuple or
                list, else the output itself, which must be a one-element tensor. A loss module with
                tensors (``CrossEntropyLoss(weight=w)``) is copied to each side's device and dtype.

        Compared leaves: ``loss``; ``grad.<param>`` for every trainable parameter; ``param.<param>``
        after the step for every trainable parameter; ``buffer.<name>`` for every buffer (e.g.
        BatchNorm running mean/var and num_batches_tracked). The ``param.<param>`` leaves are judged
        by **optimizer replay**: the expected values after the step are ``optimizer``'s step on a
        fresh CPU copy of ``module`` (in the recipe's weights dtype) from the *target's* recorded
        ``grad.<param>`` (``replay_optimizer_step``), so they test the target's optimizer step and
        starting weights while the ``grad.*`` leaves test the gradients; AdamW's first step, about
        ``lr·g/(|g| + eps)``, would otherwise turn a rounding-level gradient difference of a
        parameter with tiny gradients into a difference of up to ±lr. The replay is used only when
        replaying the reference's own gradients reproduces the reference's ``param.*`` within the
        check's tolerance (an optimizer that is not a function of the weights and gradients alone
        fails that; against a compact baseline, on the parameters it stores whole, and the replayed
        parameters are then reduced to ``@sample``/``@stats`` as recorded); otherwise the
        reference's own step is the expected value, the parameters whose reference gradient is
        rounding noise are left out (``rounding_level_params``), and the note says why. Not with ``loop`` or a loss-scaling
        recipe (their steps are compared as they are). Under a loss-scaling recipe (``fp16``)
        the backward, clipping and step go through a dynamic ``GradScaler``
        (:func:`scaled_backward_and_step`), ``grad.<param>`` are the unscaled gradients, and three
        leaves more are compared: ``amp.scale``, ``amp.skipped_steps`` and ``amp.grad_norm``.
        ``labels`` are part of the input's fingerprint (a baseline recorded with other labels is
        stale). ``vacuous_ok``, ``fault_weight``, ``policy`` and ``audit_budget`` are as in ``check``; the
        golden of a training step is the same step on a CPU copy of ``module`` in the golden dtype,
        without autocast. The audit (``--parity-audit``) covers the forward, the loss and the
        backward; the gradient clipping, the loss scaler and the optimizer step are the plugin's and
        not audited. ``store``: how a recording keeps the leaves (``"full"``, ``"summary"``, see
        ``compact``; default: the marker's ``train_store=``, else the session's); a comparison with
        a baseline follows what the baseline recorded. ``layers``: as in ``check``; the layers'
        outputs are those of the training-mode forward.

        ``loop``: a whole training loop instead of the single step (``hf_trainer.TrainerLoop``: N steps
        through Hugging Face Trainer): ``loop(module, inputs, recipe)`` trains each side's fresh copy of
        ``module`` (in training mode, on its device, inside the shared random stream) under ``recipe``
        (None for the golden run) and returns its leaves, named as above (``grad.<p>``, ``param.<p>``,
        ``buffer.<b>``; losses as it chooses). ``loss_fn``, ``optimizer`` and ``max_grad_norm`` are then
        the loop's business and ignored here.

        Raises:
            ValueError: ``labels`` without a ``loss_fn``; no scalar loss in the output; a bad ``store`` spec.
            ParityError, baselines.BaselineError, recipes.RecipeUnsupportedError: as ``check``.
        """
        __tracebackhide__ = True
        if labels is not None and loss_fn is None:
            raise ValueError(f"train_step {name!r}: labels= needs a loss_fn(output, labels), e.g. "
                             "loss_fn=torch.nn.CrossEntropyLoss()")
        seed = self.session.seed if seed is None else seed
        tol = self.session.tolerance(self.recipe.name, name, self.marker_tolerance,
                                     dict(rtol=rtol, atol=atol, budget=budget, reason=reason))
        golden_policy = self._verdict_policy(name, policy, training=True)
        budget = self._audit_budget(name, audit_budget)
        layer_policy, layer_note = _layers_unless_compiled(self._layer_policy(name, layers), module)
        from .compact import parse_train_store

        train_store = (parse_train_store(store, source="check") if store is not None
                       else self.marker_train_store or self.session.train_store)
        self._check_name(name)
        start = time.perf_counter()
        optimizer = optimizer or default_optimizer
        positional, keywords = _forward_inputs(inputs)
        hashes = self._hashes(module, positional, keywords, modes=False, labels=labels)
        # computed when recording, or comparing with a baseline that recorded one
        hashes["train_recipe"] = lambda: train_recipe_of(module, optimizer, max_grad_norm, loss_fn, loop)

        def step(m: torch.nn.Module, _recipe_context: bool = True, _positional: tuple = (), _labels: Any = None,
                 **batch: Any) -> dict[str, torch.Tensor]:
            __tracebackhide__ = True
            m.train()
            if loop is not None:
                return loop(m, batch, self.recipe if _recipe_context else None)
            params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
            with not_audited():
                opt = optimizer([p for _, p in params])
                opt.zero_grad(set_to_none=True)
            with self.recipe.context(_device_of(m)) if _recipe_context else contextlib.nullcontext():
                output = m(*_positional, **batch)
                if loss_fn is None:
                    loss = _default_loss(output)
                elif labels is None:
                    loss = loss_fn(output)
                else:
                    loss = _loss_on(loss_fn, m)(output, _labels)
            amp: dict[str, torch.Tensor] = {}
            if self.recipe.loss_scaling:
                # only the backward inside is audited (the scaler's ops are not the model's)
                amp = scaled_backward_and_step(loss, opt, params, _device_of(m), max_grad_norm)
                grads = {k: v for k, v in amp.items() if k.startswith("grad.")}
                amp = {k: v for k, v in amp.items() if k.startswith("amp.")}
            else:
                loss.backward()
                with not_audited():  # the plugin's training recipe, not the model (audit.not_audited)
                    if max_grad_norm is not None:
                        torch.nn.utils.clip_grad_norm_([p for _, p in params], max_grad_norm)
                    grads = {f"grad.{n}": p.grad.detach().clone() for n, p in params if p.grad is not None}
                    opt.step()
            out: dict[str, torch.Tensor] = {"loss": loss.detach()}
            out.update(grads)
            out.update(amp)
            out.update({f"param.{n}": p.detach() for n, p in params})
            out.update({f"buffer.{n}": b.detach() for n, b in m.named_buffers()})
            return out

        def run(device: torch.device, patched: bool, audited: bool = False, args: tuple | None = None,
                batch: dict | None = None):
            __tracebackhide__ = True
            # Copied inside the run, after the patch set is entered: a patch that edits the
            # module's weights (a fault, a port's weight conversion) must reach the copy that trains.
            m = _CopyOnEntry(module)
            return self._run(step, (m, True, positional if args is None else tuple(args), labels),
                             keywords if batch is None else batch, device, seed=seed, patched=patched,
                             grad=True, audited=audited, recipe_context=False,
                             layers=layer_policy if args is None and batch is None else None)

        def golden() -> dict:
            from .golden import GoldenUnavailableError, golden_dtypes

            first = None
            for dtype in golden_dtypes(self.recipe.name):  # fp64, else (bf16 work) fp32
                m = trainable_copy(module).to(dtype)
                try:
                    return self.session.golden_runner.run(step, (m, False, positional, labels), keywords,
                                                          recipe=self.recipe.name, seed=seed, grad=True, dtype=dtype)
                except GoldenUnavailableError as exc:
                    first = first or exc
            raise first

        replay = None
        if loop is None and not self.recipe.loss_scaling:
            def replay(leaves: dict) -> dict:
                return replay_optimizer_step(module, leaves, optimizer, self.recipe.weights_dtype)

        call = CheckCall("train_step", module, positional, keywords, seed, True,
                         lambda device, patched, args, batch: run(device, patched, args=args, batch=batch)[0],
                         vacuous_ok, fault_weight, replay=replay,
                         memo=(getattr(layer_policy, "samples", None), _Same(optimizer), _Same(loss_fn),
                               max_grad_norm, _Same(loop)), notes=[layer_note] if layer_note else [])
        return self._record_or_compare(name, run, hashes, call, tol, submodule, group, start,
                                       golden_policy, golden, budget, train_store=train_store,
                                       layer_policy=layer_policy)

    def _record_or_compare(self, name: str, run: Callable, hashes: dict[str, Any], call: "CheckCall",
                           tol: Tolerance, submodule: str | None, group: str | None, start: float,
                           golden_policy: Any = None, golden_run: Callable[[], dict] | None = None,
                           audit_budget: Any = None, train_store: Any = None, layer_policy: Any = None) -> CheckRecord:
        """The tail shared by ``check`` and ``train_step``: record the reference run in record mode;
        else get the reference (baseline or live CPU), run the target under the patch set (audited
        when the session audits and the test does not turn it off), judge (under ``golden_policy``
        with the golden from ``golden_run``, when given; the audit by ``audit_budget``). A train step's
        leaves are recorded as ``train_store`` says (``compact``); the target's (and the golden's)
        leaves are reduced the way the baseline recorded them. A train step's expected ``param.*``
        leaves are replaced by the optimizer replay from the target's gradients when
        ``_optimizer_replay`` trusts it (else its parameters with a rounding-noise reference
        gradient are left out, ``rounding_level_params``). Layer records (``layers``) are stored
        with the leaves and judged by ``layer_policy`` beside them."""
        __tracebackhide__ = True
        from .compact import apply_recorded, compact_leaves

        self._input_changes = {}
        weights = hashes["config_hash"] if call.module is not None else None
        own_stream = call.sample_dim is not None and self.session.rng == "device"
        if self.session.update_baselines:
            leaves, _ = run(self.target, patched=False)
            extra_meta = None
            if train_store is not None and train_store.mode != "full":
                leaves, compact = compact_leaves(leaves, train_store)
                extra_meta = {"train_store": train_store.describe(), "compact": compact}
            return self._record_pending(name, leaves, hashes, call.seed, submodule, tol, start, group,
                                        rng="device" if own_stream else "shared", extra_meta=extra_meta)
        try:
            expected, reference, provenance, reference_rng, compact = self._reference(name, run, hashes, call)
        except BaselineError as exc:
            self._baseline_error(name, exc, tol, submodule, group, start, weights)
            raise
        actual, audit = run(self.target, patched=True, audited=self._audit_mode() != "off")
        from .layers import split_layers

        actual, actual_layers = split_layers(actual)
        expected, expected_layers = split_layers(expected)
        layer_records = (actual_layers, expected_layers, layer_policy) if layer_policy is not None else None
        if call.sample_dim is not None and (own_stream or reference_rng == "device"):
            return self._judge_distribution(name, actual, expected, tol, reference, provenance, submodule, start,
                                            audit, call, group, weights, own_stream, reference_rng)
        replayed, replay_note = self._optimizer_replay(call, actual, expected, tol, compact)
        actual = apply_recorded(actual, compact)
        if compact:  # re-runs (--parity-selfcheck) are compared with the same compact leaves
            rerun = call.rerun
            call.rerun = lambda *args: apply_recorded(rerun(*args), compact)
        golden, note = None, None
        if golden_policy is not None and golden_run is not None:
            from .golden import GoldenUnavailableError

            try:
                golden = self.session.golden(self._memo_key(name, hashes, call), call.fn, golden_run)
            except GoldenUnavailableError as exc:
                note = f"golden unavailable, judged by allclose: {exc}"
            golden = apply_recorded(golden, compact)
        if compact:
            note = ((note + "; ") if note else "") + (
                f"{len(compact)} large leaves compared as the baseline recorded them (train store summary): "
                f"{next(iter(compact.values()))['samples']} sampled elements and [sum, L2 norm, max |x|, "
                "position-weighted sum] each (leaves <name>@sample, <name>@stats)")
        if replayed is not None:
            expected = {**expected, **replayed}
        if replay_note:
            note = ((note + "; ") if note else "") + replay_note
        if call.kind == "train_step" and replayed is None:
            dropped = rounding_level_params(expected)
            if dropped:
                actual, expected = _without(actual, dropped), _without(expected, dropped)
                golden = _without(golden, dropped) if golden is not None else None
                shown = ", ".join(sorted(dropped)[:4]) + (", …" if len(dropped) > 4 else "")
                note = ((note + "; ") if note else "") + (
                    f"{len(dropped)} parameter(s) after the step not compared ({shown}): the reference's gradient "
                    "is rounding noise (the loss does not depend on them), which AdamW turns into steps of up to "
                    "±lr; their grad.* leaves are compared")
        return self._judge(name, actual, expected, tol, reference, provenance, submodule, start, audit,
                           call=call, group=group, golden_policy=golden_policy if golden is not None else None,
                           golden=golden, policy_note=note, weights=weights, audit_budget=audit_budget,
                           layer_records=layer_records)

    @staticmethod
    def _optimizer_replay(call: "CheckCall", actual: dict, expected: dict, tol: Tolerance,
                          compact: dict | None) -> tuple[dict | None, str | None]:
        """``(replayed param.* leaves or None, note or None)`` of a training step's optimizer replay
        (``train_step``, Compared leaves): the step replayed from the target's full ``grad.<p>``
        leaves (``actual``, before ``compact.apply_recorded``), reduced as the baseline recorded them
        (``compact``), used only when the same replay from the reference's own ``grad.<p>``
        reproduces the reference's ``param.<p>`` within ``tol``. A compact baseline keeps large
        gradients only as ``@sample``/``@stats``: the replay is then validated on the parameters it
        stores whole (an optimizer whose step of one parameter depends on others' gradients fails
        that check, their gradients being absent), and not used when it stores none whole. Otherwise
        None and a note why; the caller then falls back to ``rounding_level_params``."""
        from .compact import SAMPLE_SUFFIX, STATS_SUFFIX, apply_recorded

        if call.kind != "train_step" or call.replay is None:
            return None, None
        fallback = ("optimizer replay not used ({}): param.* after the step compared with the reference's "
                    "own step")
        params = {k for k in expected if k.startswith("param.")}
        whole = {k for k in params if not k.endswith((SAMPLE_SUFFIX, STATS_SUFFIX))}
        if not any(isinstance(expected.get("grad." + k[len("param."):]), torch.Tensor) for k in whole):
            if whole != params:
                return None, fallback.format("the compact baseline stores no parameter's gradient whole, so the "
                                             "reference's step cannot be replayed from it")
            return None, None
        try:
            check = call.replay(expected)  # compacted gradients are absent: those parameters are not stepped
            mismatch = sorted(k for k in whole if not isinstance(expected[k], torch.Tensor) or k not in check
                              or check[k].shape != expected[k].shape)
            if not mismatch:
                result = compare({k: check[k] for k in whole}, {k: expected[k] for k in whole}, tol)
                mismatch = [leaf.path for leaf in result.leaves if not leaf.passed]
            if mismatch:
                shown = ", ".join(mismatch[:3]) + (", …" if len(mismatch) > 3 else "")
                return None, fallback.format(f"replaying the reference's own gradients does not reproduce "
                                             f"its step on {shown}: the optimizer is not a function of the "
                                             "weights and gradients alone")
            replayed = apply_recorded(call.replay(actual), compact)
        except Exception as exc:  # noqa: BLE001 - a user optimizer that cannot be replayed: the old comparison
            return None, fallback.format(f"the replay raised {type(exc).__name__}: {exc}")
        validated = (f" (validated on the {len(whole)} parameter(s) the compact baseline stores whole)"
                     if whole != params else "")
        return {k: v for k, v in replayed.items() if k in params}, (
            "param.* after the step compared with the CPU optimizer's step from the target's gradients "
            "(optimizer replay): a gradient difference within tolerance is not amplified by AdamW" + validated)

    def compare(self, name: str, actual: Any, expected: Any, *, rtol: float | None = None,
                atol: float | None = None, budget: float | None = None, reason: str | None = None,
                submodule: str | None = None, group: str | None = None,
                vacuous_ok: str | None = None, golden: Any = None, policy: str | None = None) -> CheckRecord:
        """Judge outputs computed by the caller (``actual`` on the target, ``expected`` the reference).

        ``golden``: the caller's golden output (same structure, higher precision); under a golden
        verdict policy (``policy`` or the session's) the check is judged by ``golden.judge_golden``
        when it is given, else by allclose with a note saying the golden was missing.

        Raises:
            ParityError: when a leaf is out of tolerance or ``expected`` is vacuous (constant).
        """
        __tracebackhide__ = True
        tol = self.session.tolerance(self.recipe.name, name, self.marker_tolerance,
                                     dict(rtol=rtol, atol=atol, budget=budget, reason=reason))
        golden_policy = self._verdict_policy(name, policy)
        self._check_name(name)
        start = time.perf_counter()
        note = None
        if golden_policy is not None and golden is None:
            golden_policy, note = None, "golden unavailable, judged by allclose: parity.compare was given no golden="
        if golden_policy is not None:
            golden = _to_cpu_leaves(golden)
            expected_leaves = _to_cpu_leaves(expected)
            for path, g in golden.items():
                e = expected_leaves.get(path)
                if (g is not None and e is not None and g.is_floating_point() and e.is_floating_point()
                        and torch.finfo(g.dtype).bits < torch.finfo(e.dtype).bits):
                    raise ValueError(f"parity check {name!r}: golden leaf {path or '<output>'!r} is "
                                     f"{str(g.dtype).removeprefix('torch.')}, coarser than the expected "
                                     f"{str(e.dtype).removeprefix('torch.')}; a golden must be at least as precise")
        return self._judge(name, _to_cpu_leaves(actual), _to_cpu_leaves(expected), tol, "given", None,
                           submodule, start, None, call=None, group=group, vacuous_ok=vacuous_ok,
                           golden_policy=golden_policy, golden=golden if golden_policy is not None else None,
                           policy_note=note)

    def finish(self, *, failed: bool = False, outcome: str = "passed") -> str | None:
        """End of the test: in record mode write the baseline file, with every check the test
        recorded — or nothing at all.

        Args:
            failed: the test failed (same as ``outcome="failed"``).
            outcome: how the test's body ended: ``"passed"`` (it ran to its end) writes the file;
                anything else (``"failed"``, ``"skipped"`` — ``pytest.skip()`` or an xfail between
                checks —, ``"interrupted"`` — Ctrl-C, no call report at all) writes nothing, so a
                half-run test never replaces a complete baseline with some of its checks.

        Returns:
            ``"created"``, ``"changed"`` or ``"unchanged"`` (see ``BaselineStore.write``),
            ``"not written"`` for a test that did not pass in record mode (``self.not_written``
            says why), or None when nothing was recorded.

        Raises:
            OSError: the file cannot be written (the old baseline is left intact).
        """
        if not (self.session.update_baselines and self._pending):
            return None
        if failed:
            outcome = "failed"
        if outcome != "passed":
            self.not_written = outcome
            self.session.baseline_writes[self.test_id] = "not written"
            self.session.not_written[self.test_id] = outcome
            self.session.baselines_used.add(self.session.store.path_for(self.test_id))
            return "not written"
        from .provenance import collect_provenance

        with strict_fp32_flags():
            from .recipes import precision_flags

            flags = precision_flags()
        provenance = collect_provenance(self.target, recipe=self.recipe.name, seed=self.session.seed,
                                        precision_flags=flags, extra={"rng": self.session.rng})
        status = self.session.store.write(self.test_id, self._pending, provenance)
        self.session.baseline_writes[self.test_id] = status
        self.session.baselines_used.add(self.session.store.path_for(self.test_id))
        return status

    # -- internals -----------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        if not name or "/" in name:
            raise ValueError(f"check name {name!r} must be non-empty and contain no '/'")
        if any(r.check == name for r in self.records):
            raise ValueError(f"check name {name!r} is used twice in {self.test_id}; names must be unique per test")

    def _hashes(self, fn: Any, args: tuple, kwargs: dict, *, modes: bool = True, labels: Any = None) -> dict[str, Any]:
        """Bitwise fingerprints of the input and the module, an order-sensitive input summary that
        tells a real change from last-bit differences of the same activations recomputed on another
        machine, the module's per-tensor digests that name the weights that changed, and the
        module's configuration and structure (``structure.module_structure``, with each submodule's
        training mode unless ``modes`` is False) with its hash (see ``BaselineStore.check_fresh``).
        The summary and digests are callables, computed only where needed: when recording, or when
        a hash differs from the recorded one. ``labels`` (a training step's) join the input's
        fingerprint and summary when given."""
        from .provenance import fingerprint_module, fingerprint_tensors, module_tensor_digests, summarize_tensors
        from .structure import module_structure, structure_hash

        module = owner_module(fn)
        structure: dict | None = None
        if module is not None:
            config = fingerprint_module(module)
            config_tensors: Callable[[], dict] = lambda: module_tensor_digests(module)  # noqa: E731
            structure = module_structure(module, modes=modes)
        else:
            config = fingerprint_tensors(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}")
            config_tensors = dict
        given = (args, kwargs) if labels is None else (args, kwargs, labels)
        return {"input_hash": fingerprint_tensors(given), "config_hash": config,
                "input_summary": lambda: summarize_tensors(given), "config_tensors": config_tensors,
                "structure_hash": structure_hash(structure) if structure is not None else None,
                "structure": structure}

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device, *, seed: int,
             patched: bool, grad: bool, audited: bool = False, recipe_context: bool = True,
             stream: tuple[str, int] | None = None, layers: Any = None):
        """``(leaves on the CPU, audit dict or None)`` of one run of ``fn`` on ``device``; with a
        ``layers.LayerPolicy`` as ``layers`` the leaves also hold the run's layer records
        (``layers.capture_layers`` on the computation's module, keys ``layer:<path>``).

        ``audited``: record a device-propagation audit (``session.audit_factory(device)``). A real
        audit watches this very run. A *logical* one (``audit.logical``, a CPU target) watches an
        extra run whose output is dropped: the numbers come from a plain run, because the logical
        audit's function mode turns off PyTorch's transformer fast path (about 2.4e-7 apart on
        Aurora). Modules among ``args`` are deep-copied for the extra run (a train step mutates them).
        ``stream``: ``(rng mode, seed)`` of the run's randomness (default ``("shared", seed)``).

        Raises:
            recipes.RecipeUnsupportedError: the run raised a ``RuntimeError`` under a recipe other
                than fp32 and the same run passes under fp32 (``_recipe_error``); the original
                error is its ``__cause__``. Any other error propagates as it is.
        """
        __tracebackhide__ = True
        try:
            return self._run_once(fn, args, kwargs, device, seed=seed, patched=patched, grad=grad, audited=audited,
                                  recipe_context=recipe_context, stream=stream, layers=layers)
        except RuntimeError as exc:
            from .recipes import RecipeUnsupportedError

            if self.recipe.name == "fp32" or isinstance(exc, RecipeUnsupportedError):
                raise
            error = self._recipe_error(exc, fn, args, kwargs, device, seed=seed, patched=patched, grad=grad,
                                       recipe_context=recipe_context, stream=stream)
            if error is None:
                raise
            raise error from exc

    def _recipe_error(self, exc: BaseException, fn: Callable[..., Any], args: tuple, kwargs: dict,
                      device: torch.device, *, seed: int, patched: bool, grad: bool,
                      recipe_context: bool, stream: tuple[str, int] | None = None) -> Exception | None:
        """A ``recipes.RecipeUnsupportedError`` for ``exc``, raised by a run under this case's recipe,
        when the same run passes under fp32; None when it fails under fp32 too (not the recipe's doing).

        Costs two extra runs, on this error path only: the fp32 run, and a re-run under the recipe with
        a dispatch mode that names the ATen op that raised (when the error is raised below PyTorch's
        Python dispatch key; a run under a dispatch mode may also take another path and pass, or the
        error may come from before dispatch: then the op is the call on the error's innermost line).
        """
        from .recipes import RECIPES, RecipeUnsupportedError

        def fresh() -> tuple:
            return tuple(copy.deepcopy(a) if isinstance(a, torch.nn.Module) else a for a in args)

        recipe = self.recipe
        try:
            self.recipe = RECIPES["fp32"]
            self._call(fn, fresh(), kwargs, device, seed=seed, patched=patched, grad=grad,
                       recipe_context=recipe_context, stream=stream)
        except Exception:  # noqa: BLE001 - fails under fp32 too: the recipe is not the cause
            return None
        finally:
            self.recipe = recipe
        recorder = _RaisingOp()
        try:
            self._call(fn, fresh(), kwargs, device, seed=seed, patched=patched, grad=grad,
                       recipe_context=recipe_context, audit=recorder, stream=stream)
        except Exception:  # noqa: BLE001 - expected: it raises again
            pass
        module, where, call = _error_site(exc)
        return RecipeUnsupportedError(recipe.name, device, exc, op=recorder.op or call, module=module, where=where)

    def _run_once(self, fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device, *, seed: int,
                  patched: bool, grad: bool, audited: bool = False, recipe_context: bool = True,
                  stream: tuple[str, int] | None = None, layers: Any = None):
        """``_run`` without the recipe diagnosis."""
        __tracebackhide__ = True
        audit = self.session.audit_factory(device) if audited else None
        if audit is not None and getattr(audit, "logical", False):
            leaves, _ = self._run(fn, args, kwargs, device, seed=seed, patched=patched, grad=grad,
                                  recipe_context=recipe_context, stream=stream, layers=layers)
            fresh = tuple(copy.deepcopy(a) if isinstance(a, torch.nn.Module) else a for a in args)
            self._call(fn, fresh, kwargs, device, seed=seed, patched=patched, grad=grad,
                       recipe_context=recipe_context, audit=audit, stream=stream)
            return leaves, audit.to_dict()
        records: dict[str, torch.Tensor] | None = {} if layers is not None else None
        output, entered = self._call(fn, args, kwargs, device, seed=seed, patched=patched, grad=grad,
                                     recipe_context=recipe_context, audit=audit, stream=stream,
                                     layers=records, layer_samples=getattr(layers, "samples", None))
        leaves = _to_cpu_leaves(output)
        if records:
            leaves.update(records)
        return leaves, (entered.to_dict() if entered is not None and hasattr(entered, "to_dict") else None)

    def _call(self, fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device, *, seed: int,
              patched: bool, grad: bool, recipe_context: bool, audit: Any = None,
              stream: tuple[str, int] | None = None, layers: dict | None = None,
              layer_samples: int | None = None) -> tuple[Any, Any]:
        """Run ``fn`` once on ``device`` under the recipe, shared randomness and (if given) ``audit``;
        an audit with ``to_target`` (``audit.DeviceAudit``) places the module and inputs first.
        ``layers``: a dict that receives the run's layer records (``layers.capture_layers`` on the
        placed module, or on the first module among the arguments: a train step's copy).
        Returns ``(output, the entered audit or None)``."""
        __tracebackhide__ = True
        weights_dtype = self.recipe.weights_dtype
        module = owner_module(fn)
        with contextlib.ExitStack() as stack:
            # Patches first: a patch may edit weights or classes that placement then copies.
            if patched and self.patches is not None:
                applied = stack.enter_context(self.patches(device))
                names = getattr(applied, "applied", None)
                # A patch context that names no patches (a user's parity_patches override) is named
                # after its factory, so that the report never says "none" while patches ran.
                self.session.patches_applied.update(names if names is not None else (patch_factory_name(self.patches),))
            args = tuple(a.copy(device) if isinstance(a, _CopyOnEntry) else a for a in args)
            if isinstance(fn, torch.nn.Module):
                call = self.session.place(fn, device, weights_dtype)
            elif module is not None:
                call = getattr(self.session.place(module, device, weights_dtype), fn.__name__)
            else:
                call = fn
            args_d, kwargs_d = _move(args, device, weights_dtype), _move(kwargs, device, weights_dtype)
            stack.enter_context(self.recipe.context(device) if recipe_context else strict_fp32_flags())
            mode, stream_seed = stream or ("shared", seed)
            stack.enter_context(randomness(mode, stream_seed))
            stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
            if audit is not None:
                if hasattr(audit, "to_target"):
                    owner = owner_module(call)
                    if owner is not None:
                        audit.to_target(owner)
                    args_d, kwargs_d = audit.to_target(args_d), audit.to_target(kwargs_d)
                audit = stack.enter_context(audit)
            if layers is not None:
                from .layers import DEFAULT_SAMPLES, capture_layers

                root = owner_module(call) or next((a for a in args_d if isinstance(a, torch.nn.Module)), None)
                captured = stack.enter_context(capture_layers(root, layer_samples or DEFAULT_SAMPLES))
            output = call(*args_d, **kwargs_d)
        if layers is not None:
            layers.update(captured)  # on the CPU once the capture has ended
        if self._input_changes is not None:  # after the audit: the comparison is not the computation's
            changed = _changed_inputs((args, kwargs), (args_d, kwargs_d))
            if changed:
                self._input_changes.setdefault("target" if patched else "reference", set()).update(changed)
        return output, audit

    def _load_baseline(self):
        __tracebackhide__ = True
        if not self._baseline_loaded:
            if self.session.store is not None:
                try:
                    self._baseline = self.session.store.load(self.test_id)
                except BaselineError as exc:
                    # Every later check of the test fails the same way; none falls back to a CPU run.
                    self._baseline = exc
                if isinstance(self._baseline, BaselineError):
                    self.session.baselines_used.add(self._baseline.path or self.session.store.path_for(self.test_id))
                elif self._baseline is not None:
                    self.session.baselines_used.add(self._baseline.path)
            self._baseline_loaded = True
        if isinstance(self._baseline, BaselineError):
            raise self._baseline
        return self._baseline

    def _verdict_policy(self, name: str, policy: Any, training: bool = False) -> Any:
        """``session.settings.verdict_policy`` for this check; a bad ``policy=`` names the check."""
        try:
            return self.session.settings.verdict_policy(self.recipe.name, name, explicit=policy, training=training,
                                                        marker_parsed=self.marker)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"parity check {name!r}: policy={policy!r}: {exc}") from None

    def _memo_key(self, name: str, hashes: dict[str, Any], call: "CheckCall") -> tuple:
        """What makes two runs of a check the same computation: name, recipe, seed, autograd, kind,
        the very function or module object (a closure or a module attribute that is not a tensor
        is not in the fingerprints), the input and the weights, and ``call.memo`` (the layer
        records; a train step's optimizer, loss and clipping): two tests of one module, input and
        check name with another optimizer, or one with ``layers=False`` before one with layer
        records, must not share a reference."""
        return (name, self.recipe.name, call.seed, call.grad, call.kind, id(call.fn),
                hashes["input_hash"], hashes["config_hash"], hashes.get("structure_hash")) + tuple(call.memo)

    def _reference(self, name: str, run: Callable, hashes: dict[str, str], call: "CheckCall"):
        """(expected leaves, reference kind, provenance line, the reference's random stream mode, the
        baseline's ``compact`` record or None) for a check: a baseline's stream is its entry's recorded
        ``rng`` (``shared`` for baselines that predate it), a live CPU run's the session's for a
        sampling check."""
        __tracebackhide__ = True
        mode = self.session.reference
        if mode in ("auto", "baseline"):
            baseline = self._load_baseline()
            has_check = baseline is not None and name in baseline.checks
            if mode == "baseline" or has_check:
                if baseline is None:
                    raise self.session.store.missing_error(self.test_id)
                try:
                    entry = self.session.store.check_fresh(baseline, name, **hashes, recipe=self.recipe.name,
                                                           seed=call.seed)
                except StaleBaselineError as exc:
                    # What changed, from the recorded fingerprints (for the suite-wide summary), and
                    # which recording it was.
                    exc.stale_cause = stale_cause(baseline.checks[name].meta, hashes,
                                                  getattr(exc, "structure_changed", False))
                    exc.provenance = baseline.describe()
                    raise
                expected: dict[str, torch.Tensor | None] = dict(entry.tensors)
                expected.update({p: None for p in entry.none_leaves})
                compact = entry.meta.get("compact") if isinstance(entry.meta.get("compact"), dict) else None
                # "<file> — <device, date, versions>"
                return expected, "baseline", baseline.describe(), str(entry.meta.get("rng") or "shared"), compact
        live_rng = self.session.rng if call.sample_dim is not None else "shared"
        key = self._memo_key(name, hashes, call) + (live_rng,)
        memo = self.session._reference_memo
        if key not in memo:  # the function/module is kept with the result: its id stays unique
            memo[key] = (call.fn, run(torch.device("cpu"), patched=False)[0])
        return memo[key][1], "cpu", None, live_rng, None

    def _baseline_error(self, name: str, exc: BaselineError, tol: Tolerance, submodule: str | None,
                        group: str | None, start: float, weights: str | None = None) -> CheckRecord:
        """Keep an ``error`` record for a check whose baseline is missing, stale, corrupt or unsafe."""
        kinds = ((MissingBaselineError, "missing"), (StaleBaselineError, "stale"),
                 (CorruptBaselineError, "corrupt"), (UnsafeBaselineError, "unsafe"))
        kind = next((label for cls, label in kinds if isinstance(exc, cls)), "unreadable")
        extra = {col.BASELINE_ERROR: kind, col.BASELINE_FILE: str(exc.path) if exc.path else None}
        if getattr(exc, "stale_cause", None):
            extra[col.STALE_CAUSE] = exc.stale_cause
        record = CheckRecord(self.test_id, name, self.recipe.name, str(self.target), self.session.target_name,
                             "baseline", tol, status="error", submodule=submodule, group=group,
                             message=str(exc), duration_s=time.perf_counter() - start,
                             reference_provenance=getattr(exc, "provenance", None), extra=extra, weights=weights)
        self._keep(record)
        return record

    def _record_pending(self, name, leaves, hashes, seed, submodule, tol, start, group=None,
                        rng: str = "shared", extra_meta: dict | None = None) -> CheckRecord:
        from .baselines import CheckBaseline

        from .structure import pack_structure

        tensors = {p: t.contiguous() for p, t in leaves.items() if t is not None}
        facts = {k: v() if callable(v) else v for k, v in hashes.items()}
        if facts.get("structure") is None:  # a function: no structure to record
            facts.pop("structure", None)
            facts.pop("structure_hash", None)
        else:
            facts["structure"] = pack_structure(facts["structure"])
        meta = dict(facts, seed=seed, submodule=submodule,
                    recipe=self.recipe.name, rng=rng,
                    shapes={p: list(t.shape) for p, t in tensors.items()},
                    dtypes={p: str(t.dtype).removeprefix("torch.") for p, t in tensors.items()})
        if extra_meta:
            meta.update(extra_meta)
        self._pending[name] = CheckBaseline(name=name, tensors=tensors,
                                            none_leaves=[p for p, t in leaves.items() if t is None], meta=meta)
        record = CheckRecord(self.test_id, name, self.recipe.name, str(self.target), self.session.target_name,
                             "recorded", tol, status="recorded", submodule=submodule, group=group,
                             duration_s=time.perf_counter() - start)
        self._keep(record)
        return record

    def _judge(self, name, actual, expected, tol, reference, provenance, submodule, start, audit,
               call: CheckCall | None, group=None, vacuous_ok: str | None = None, golden_policy: Any = None,
               golden: dict | None = None, policy_note: str | None = None,
               weights: str | None = None, audit_budget: Any = None, layer_records: tuple | None = None) -> CheckRecord:
        __tracebackhide__ = True
        if golden_policy is not None:
            from .golden import judge_golden

            from .golden import WORK_DTYPES

            result = judge_golden(actual, expected, golden, golden_policy, tolerance=tol, name=name,
                                  work_dtype=WORK_DTYPES.get(self.recipe.name))
        else:
            result = compare(actual, expected, tol, name=name)
        record = CheckRecord(self.test_id, name, self.recipe.name, str(self.target), self.session.target_name,
                             reference, tol, status="pass" if result.passed else "fail", submodule=submodule,
                             group=group, result=result, reference_provenance=provenance, audit=audit,
                             duration_s=time.perf_counter() - start, golden_policy=golden_policy, weights=weights)
        if call is not None and call.notes:
            policy_note = "; ".join([*([policy_note] if policy_note else []), *call.notes])
        changes, self._input_changes = self._input_changes, None  # re-runs of diagnoses are not judged
        change_note, change_problem = _input_change_verdict(changes, live_reference=reference == "cpu")
        if change_note:
            policy_note = f"{policy_note}; {change_note}" if policy_note else change_note
        if policy_note:
            record.extra[col.POLICY_NOTE] = policy_note
        self._keep(record)
        vacuous_ok = (call.vacuous_ok if call is not None else vacuous_ok) or self.vacuous_ok
        problems = _vacuity_problems(name, expected, record, vacuous_ok)
        if change_problem:
            problems.append(change_problem)
        layer_problem = self._judge_layers(record, layer_records)
        if layer_problem:
            problems.append(layer_problem)
        audit_problem = self._judge_audit(record, audit_budget)
        if audit_problem:
            problems.append(audit_problem)
        if call is not None:
            call.vacuous_ok = vacuous_ok
            for hook in self.session.check_hooks:  # e.g. --parity-selfcheck
                text = hook(self, record, call, actual, expected)
                if text:
                    problems.append(text)
        if result.passed and not problems:
            return record
        record.status = "fail"
        ref_text = {"cpu": "a live CPU run", "given": "the given expected output"}.get(
            reference, f"baseline {provenance}")
        context = f"recipe {self.recipe.name}, target {self.target} ({self.session.target_name}) vs {ref_text}"
        if result.passed:
            record.extra["check_problem"] = " ".join(problems)
            message = "\n\n".join([f"Parity check {name!r} failed ({context}) with every output leaf within "
                                    "tolerance:"] + problems)
        else:
            message = "\n\n".join([result.format(context)] + problems)
            baseline = self._load_baseline() if reference == "baseline" else None
            mismatch = torch_version_mismatch(baseline.provenance if baseline is not None else None)
            if mismatch:
                record.extra["torch_mismatch"] = mismatch
                message += "\n\n" + mismatch
            threads = thread_count_mismatch(baseline.provenance if baseline is not None else None, self.target)
            if threads:
                message += "\n\n" + threads
            hooks = self.session.failure_hooks if call is not None else ()
            if golden_policy is not None and hooks:
                # First-divergence localization judges submodule outputs by the allclose tolerance,
                # which says nothing about a golden verdict: not run (its claims would mislead).
                hooks = ()
                message += ("\n\n(First-divergence localization is by allclose tolerance and is not run "
                            "under the golden verdict; rerun with --parity-policy allclose to localize.)")
            for hook in hooks:
                try:
                    extra = hook(self, record, call, result)
                except Exception as exc:  # noqa: BLE001 - a diagnosis must never hide the failure itself
                    extra = f"({getattr(hook, '__name__', type(hook).__name__)} could not run: {type(exc).__name__}: {exc})"
                if extra:
                    message += "\n\n" + extra
        record.message = message
        raise ParityError(message, result)

    def _layer_policy(self, name: str, spec: Any) -> Any:
        """The ``layers.LayerPolicy`` of check ``name``: its own ``layers=`` over the test's; a bad spec names the check."""
        try:
            return self.session.settings.layer_policy(self.recipe.name, self.marker, spec)
        except ValueError as exc:
            raise ValueError(f"parity check {name!r}: {exc}") from None

    def _judge_layers(self, record: CheckRecord, layer_records: tuple | None) -> str | None:
        """Judge the check's layer records (``layers.judge_layers``) into ``record.extra``; the
        failure text, or None. A reference without layer records (a baseline recorded before them,
        or with the layer check off) leaves a note and judges nothing."""
        if layer_records is None:
            return None
        from .layers import judge_layers

        actual, expected, policy = layer_records
        record.layer_records = (actual, expected)
        record.extra[col.LAYER_POLICY] = policy.describe()
        if actual and not expected:
            note = ("layer check not run: the reference has no layer records (re-record the baseline with "
                    "--update-baselines to judge every weighted layer)")
            record.extra[col.POLICY_NOTE] = "; ".join(filter(None, [record.extra.get(col.POLICY_NOTE), note]))
            return None
        verdict = judge_layers(actual, expected, policy)
        record.extra[col.LAYERS_JUDGED] = verdict.judged
        worst = verdict.worst()
        if worst is not None:
            record.extra[col.LAYER_WORST], record.extra[col.LAYER_WORST_REL_L2] = worst
        if verdict.passed:
            return None
        record.extra[col.LAYERS_FAILING] = ", ".join(verdict.failing)
        return verdict.format()

    def _audit_mode(self) -> str:
        """``off`` (no audit), ``record``, ``warn`` or ``fail`` for this test's checks."""
        return resolve_audit_mode(self.session.audit_mode, self.marker, auditable=self.session.audit_factory is not None)

    def _audit_budget(self, name: str, spec: Any) -> Any:
        """The ``audit.AuditBudget`` of check ``name``: ``spec`` over the test's; a bad spec names the check."""
        try:
            return self.session.settings.audit_budget(self.marker, spec)
        except ValueError as exc:
            raise ValueError(f"parity check {name!r}: {exc}") from None

    def _judge_audit(self, record: CheckRecord, budget: Any) -> str | None:
        """Judge the check's audit by ``budget`` (audit modes ``warn``/``fail``): the events beyond
        it go to ``record.extra["audit_problem"]``; under ``warn`` an ``audit.ParityAuditWarning``
        points at the first event's source line. Returns the problem text when it fails the check."""
        mode = self._audit_mode()
        if record.audit is None or mode not in ("warn", "fail") or record.audit.get("skipped"):
            return None
        from .audit import AuditRecord, ParityAuditWarning

        budget = budget if budget is not None else self.audit_budget
        record.extra[col.AUDIT_BUDGET] = budget.describe()
        audit = AuditRecord.from_dict(record.audit)
        text = budget.judge(audit, record.check, failing=mode == "fail")
        if not text:
            return None
        record.extra[col.AUDIT_PROBLEM] = text
        record.extra[col.AUDIT_VERDICT] = mode
        if mode == "fail":
            return text
        import warnings

        over = budget.excess(audit)
        first = next((e for e in audit.events if e.kind in over), None)
        path, _, line = (first.source if first is not None else "").rpartition(":")
        if path and line.isdigit():
            warnings.warn_explicit(f"{self.test_id} ({self.recipe.name}): {text}", ParityAuditWarning, path, int(line))
        else:
            warnings.warn(f"{self.test_id} ({self.recipe.name}): {text}", ParityAuditWarning, stacklevel=2)
        return None

    def _judge_distribution(self, name, actual, expected, tol, reference, provenance, submodule, start, audit,
                            call: CheckCall, group, weights, own_stream: bool, reference_rng: str) -> CheckRecord:
        """Judge a sampling check whose sides drew from their own streams: every floating leaf as two
        sample sets along ``call.sample_dim`` (``distribution.compare_distributions``). No golden,
        no self-check perturbation and no first-divergence localization: they compare elements."""
        from .distribution import compare_distributions

        policy = self.session.distribution_policy
        result = compare_distributions(actual, expected, call.sample_dim, policy, name=name)
        record = CheckRecord(self.test_id, name, self.recipe.name, str(self.target), self.session.target_name,
                             reference, tol, status="pass" if result.passed else "fail", submodule=submodule,
                             group=group, result=result, reference_provenance=provenance, audit=audit,
                             duration_s=time.perf_counter() - start, weights=weights, distribution_policy=policy)
        target_stream = ("its device's own generator (--parity-rng device)" if own_stream
                         else "the shared CPU stream")
        reference_stream = ("its device's own generator" if reference_rng == "device" else "the shared CPU stream")
        reference_stream = (f"a live CPU run from {reference_stream}" if reference == "cpu"
                            else f"a baseline recorded from {reference_stream}")
        streams = f"target samples from {target_stream}; reference: {reference_stream}"
        record.extra[col.POLICY_NOTE] = f"samples compared as distributions along axis {call.sample_dim} ({streams})"
        self._keep(record)
        problems = _vacuity_problems(name, expected, record, call.vacuous_ok or self.vacuous_ok)
        if result.passed and not problems:
            return record
        record.status = "fail"
        ref_text = "a live CPU run" if reference == "cpu" else f"baseline {provenance}"
        context = f"recipe {self.recipe.name}, target {self.target} ({self.session.target_name}) vs {ref_text}"
        message = "\n\n".join([result.format(context), f"({streams}.)"] + problems)
        record.message = message
        raise ParityError(message, result)

    def _keep(self, record: CheckRecord) -> None:
        self.records.append(record)
        self.session.records.append(record)


def replay_optimizer_step(module: torch.nn.Module, leaves: dict[str, Any],
                          optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                          weights_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One ``optimizer`` step replayed on the CPU from given gradients (``train_step``'s optimizer replay).

    A fresh copy of ``module`` on the CPU (cast to ``weights_dtype`` unless None), in training mode;
    ``optimizer`` (a factory, as ``train_step`` takes it) over its trainable parameters in
    ``named_parameters`` order; each parameter's ``.grad`` set to ``leaves["grad.<p>"]`` cast to the
    parameter's dtype (left None where that leaf is missing, None, or of another shape: the
    optimizer then skips the parameter, as it does one without a gradient); one ``opt.step()`` under
    ``torch.no_grad()`` and ``recipes.strict_fp32_flags``. Nothing is clipped: the ``grad.<p>``
    leaves of a training step are the clipped gradients its optimizer consumed.

    Args:
        module: the module as the training step started from (not modified).
        leaves: a training step's leaves; only the full ``grad.<p>`` leaves are read (compacted
            ``@sample``/``@stats`` leaves cannot be replayed from).
        optimizer: ``(params) -> torch.optim.Optimizer``.
        weights_dtype: the recipe's weights dtype, or None to keep the module's dtypes.

    Returns:
        ``{"param.<p>": CPU tensor}`` after the step for every trainable parameter.
    """
    m = trainable_copy(module).cpu()
    if weights_dtype is not None:
        m = m.to(weights_dtype)
    m.train()
    params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    with strict_fp32_flags():
        opt = optimizer([p for _, p in params])
        opt.zero_grad(set_to_none=True)
        for n, p in params:
            g = leaves.get(f"grad.{n}")
            if isinstance(g, torch.Tensor) and g.shape == p.shape and g.is_floating_point():
                p.grad = g.detach().to(device=p.device, dtype=p.dtype).clone()
        with torch.no_grad():
            opt.step()
    return {f"param.{n}": p.detach() for n, p in params}


#: A parameter's gradient is rounding noise when its largest magnitude is at most this many fp32
#: epsilons (1.19e-7) of the largest gradient magnitude of the step (see ``rounding_level_params``).
ROUNDING_LEVEL_EPS = 100


def rounding_level_params(leaves: dict[str, Any]) -> set[str]:
    """The ``param.<name>`` leaves of a training step whose gradient is rounding noise (left out of
    the comparison where the optimizer replay is not used, see ``ParityCase.train_step``).

    A parameter the loss does not depend on analytically (the key projection's bias under softmax,
    a bias before a training-mode BatchNorm) gets a gradient of pure rounding noise, and AdamW,
    which divides by ``|g| + eps``, turns it into a step of up to ±lr in a random direction: its
    value after the step differs between two correct devices by up to 2·lr. Such a parameter has
    ``max|grad| <= ROUNDING_LEVEL_EPS · eps(fp32) · max over all grads`` in the *reference's* leaves
    (measured on Aurora's tiny training step: six such biases at <= 8.2e-9 against a largest
    gradient of 6.4e-2, the next smallest gradient at 2.0e-5).

    Args:
        leaves: a training step's leaves (``grad.<p>``, ``param.<p>`` …), as ``train_step`` records
            them, or as a compact baseline keeps them (``grad.<p>@stats`` holds ``max |g|``).
    Returns:
        The ``param.<p>`` names to leave out (their ``grad.<p>`` stays compared); for a compacted
        parameter its ``param.<p>@sample`` and ``param.<p>@stats``.
    """
    from .compact import SAMPLE_SUFFIX, STATS_SUFFIX, base_leaf

    largest: dict[str, float] = {}
    for k, v in leaves.items():
        if not (k.startswith("grad.") and isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()):
            continue
        if k.endswith(SAMPLE_SUFFIX):
            continue  # a compacted gradient (``compact``): its @stats leaf holds the exact max |g|
        largest[base_leaf(k)[len("grad."):]] = float(v[2]) if k.endswith(STATS_SUFFIX) else float(
            v.detach().abs().max())
    if not largest:
        return set()
    top = max(largest.values())
    if not top > 0:
        return set()
    limit = ROUNDING_LEVEL_EPS * torch.finfo(torch.float32).eps * top
    rounding = {p for p, m in largest.items() if m <= limit}
    return {k for k in leaves if k.startswith("param.") and base_leaf(k)[len("param."):] in rounding}


def _without(leaves: Any, names: set[str]) -> Any:
    return {k: v for k, v in leaves.items() if k not in names} if isinstance(leaves, dict) else leaves


def torch_version_mismatch(provenance: Any) -> str | None:
    """A note when a baseline was recorded with another torch release than this run's, else None.

    Compared by release (``2.5.1+cpu`` and ``2.5.1+cu124`` are one release): kernels, fast paths
    and autocast rules change between releases, so a failure against such a baseline may be a
    legitimate version difference rather than a fault of the target.
    """
    recorded = provenance.get("torch") if isinstance(provenance, dict) else None
    if not recorded:
        return None
    from .npu import base_version

    if base_version(str(recorded)) == base_version(torch.__version__):
        return None
    return (f"Note: torch-version mismatch — the baseline was recorded with torch {recorded}, this run uses "
            f"torch {torch.__version__}. Kernels differ between releases; judge bf16 and training checks by "
            "the golden verdict (--parity-policy golden), or record baselines with this torch.")


#: Most overflowing attempts ``scaled_backward_and_step`` backs off from (2^16 down to 2^-8 with
#: the default scaler) before it records the step as skipped.
MAX_SCALE_BACKOFFS = 24


def scaled_backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                             params: list[tuple[str, torch.nn.Parameter]], device: torch.device,
                             max_grad_norm: float | None) -> dict[str, torch.Tensor]:
    """Backward, clipping and one optimizer step through a dynamic loss scaler (the ``fp16`` recipe).

    The scaler is ``recipes.make_grad_scaler(device)`` (looked up when called, so a patch set can
    replace it on the target side). Each attempt follows PyTorch's AMP recipe for clipping
    (docs "Automatic Mixed Precision examples", "Gradient clipping"):
    ``scaler.scale(loss).backward()``, ``scaler.unscale_(optimizer)``, ``clip_grad_norm_``,
    ``scaler.step(optimizer)``, ``scaler.update()``. An attempt whose scaled gradients overflow is
    skipped by the scaler (no optimizer step; ``update`` multiplies the scale by its
    ``backoff_factor``, which both torch's and torch_npu's scalers require < 1, so a smaller scale
    after ``update`` means a skipped step); it is then retried from the same forward with the
    smaller scale, as the first iterations of an fp16 training run do (with the default 2^16 the
    tiny Aurora's first attempt overflows in ``embed_layer.proj_layer.weight``: measured on torch
    2.5.1 and 2.14.1). Retries stop at the first step taken, at a non-finite loss (no scale helps)
    or after ``MAX_SCALE_BACKOFFS``.

    Args:
        loss: the scalar loss of the forward (its graph is kept for the retries).
        optimizer: the step's optimizer over ``params``.
        params: ``(name, parameter)`` of every trainable parameter.
        device: where the step runs (chooses the scaler).
        max_grad_norm: clip value of ``torch.nn.utils.clip_grad_norm_`` on the unscaled gradients,
            or None.

    Returns:
        ``grad.<name>`` (the unscaled, clipped gradients of the attempt last run), ``amp.scale``
        (float32 0-d: the scale after the last ``update``), ``amp.skipped_steps`` (int64 0-d:
        attempts skipped for overflow) and ``amp.grad_norm`` (float32 0-d: the global 2-norm of
        the unscaled gradients before clipping; clipping makes the gradients blind to a wrong
        unscale factor, this leaf is not).

    Raises:
        recipes.RecipeError: no GradScaler for the device.
    """
    from . import recipes

    scaler = recipes.make_grad_scaler(device)
    tensors = [p for _, p in params]
    skipped = 0
    while True:
        with not_audited():  # the scaler, clipping and step are the plugin's recipe, not the model
            optimizer.zero_grad(set_to_none=True)
            scale_before = float(scaler.get_scale())
            scaled = scaler.scale(loss)
        scaled.backward(retain_graph=True)
        with not_audited():
            scaler.unscale_(optimizer)
            present = [p.grad for p in tensors if p.grad is not None]
            if max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(tensors, max_grad_norm)
            elif present:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in present]))
            else:
                norm = torch.zeros(())
            grads = {f"grad.{n}": p.grad.detach().clone() for n, p in params if p.grad is not None}
            scaler.step(optimizer)
            scaler.update()
            taken = float(scaler.get_scale()) >= scale_before
        if taken or skipped + 1 >= MAX_SCALE_BACKOFFS or not bool(torch.isfinite(loss.detach())):
            skipped += 0 if taken else 1
            break
        skipped += 1
    out: dict[str, torch.Tensor] = dict(grads)
    out["amp.scale"] = torch.tensor(float(scaler.get_scale()), dtype=torch.float32)
    out["amp.skipped_steps"] = torch.tensor(skipped, dtype=torch.int64)
    out["amp.grad_norm"] = norm.detach().to(torch.float32).reshape(())
    return out



def _vacuity_problems(name: str, expected: dict, record: "CheckRecord", vacuous_ok: str | None) -> list[str]:
    """The vacuity problem of a check's reference leaves (``selfcheck.vacuity_problem``: one min/max
    per floating leaf), as a one-item list, or ``[]`` when it has none or ``vacuous_ok`` allows it;
    records ``vacuous`` / ``vacuous_ok`` in ``record.extra``."""
    from .selfcheck import ParityVacuityWarning, below_tolerance, vacuity_problem

    vacuous = vacuity_problem(expected)
    if not vacuous:
        tiny = None if vacuous_ok or record.golden_policy is not None and not record.golden_policy.allclose_floor \
            else below_tolerance(expected, record.tolerance)
        if tiny:  # it can still fail elsewhere (other leaves' dtypes, the layer check): a warning, not a failure
            record.extra["policy_note"] = "; ".join(filter(None, (record.extra.get("policy_note"), tiny)))
            warnings.warn(f"{record.test_id} ({record.recipe}): parity check {name!r} is nearly vacuous: {tiny}. "
                          "Give it inputs/weights whose outputs exceed atol (pretrained or stable_init_ weights), "
                          "a smaller atol, or vacuous_ok='<reason>'.", ParityVacuityWarning, stacklevel=4)
        return []
    record.extra[col.VACUOUS] = vacuous
    if vacuous_ok:
        record.extra[col.VACUOUS_OK] = vacuous_ok
        return []
    return [f"Parity check {name!r} is vacuous: {vacuous}, so no fault on the target could make it fail. "
            "Give it inputs/weights that reach the output, or allow it with vacuous_ok='<reason>' (check "
            "argument or @pytest.mark.parity)."]

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


def train_recipe_of(module: torch.nn.Module,
                    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                    max_grad_norm: float | None, loss_fn: Any, loop: Any = None) -> dict[str, Any]:
    """``structure.train_recipe`` of a ``train_step``: ``optimizer`` built once (never stepped) on the
    trainable parameters of a throwaway ``trainable_copy(module)``; with ``loop`` only the loop is
    described (it owns optimizer, clipping and loss).

    Raises:
        whatever ``optimizer(params)`` raises (the step itself would raise it too).
    """
    from .structure import train_recipe

    if loop is not None:
        return train_recipe(loop=loop)
    params = [p for p in trainable_copy(module).parameters() if p.requires_grad]
    return train_recipe(optimizer(params), max_grad_norm, loss_fn)


def default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1): Aurora's training setup."""
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None:
        loss = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("train_step: the output has no scalar loss; pass loss_fn=lambda out: ... , or "
                         "labels=... with loss_fn=torch.nn.CrossEntropyLoss() (called as loss_fn(output, labels))")
    return loss


def _forward_inputs(inputs: Any) -> tuple[tuple, Any]:
    """``(positional, keyword)`` forward arguments of ``train_step``'s ``inputs``: a mapping is the
    keywords (kept as given, so its fingerprint is what it was before positional inputs existed), a
    tuple or list the positional arguments, anything else the one positional argument."""
    if isinstance(inputs, Mapping):
        return (), inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _loss_on(loss_fn: Callable[..., torch.Tensor], m: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """``loss_fn``, or for a loss module holding tensors (``CrossEntropyLoss(weight=w)``) a copy on
    ``m``'s device with its floating tensors in the dtype of ``m``'s first floating parameter."""
    if not isinstance(loss_fn, torch.nn.Module) or not any(True for _ in loss_fn.state_dict()):
        return loss_fn
    dtype = next((p.dtype for p in m.parameters() if p.is_floating_point()), None)
    copied = copy.deepcopy(loss_fn).to(_device_of(m))
    return copied.to(dtype) if dtype is not None else copied


def _device_of(module: torch.nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


class _RaisingOp(TorchDispatchMode):
    """A dispatch mode that remembers the innermost ATen op that raised (``aten::index_add_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = True
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.op is None:
                schema = func._schema
                name = schema.name if "::" in schema.name else f"aten::{schema.name}"
                self.op = name + (f".{schema.overload_name}" if schema.overload_name else "")
            raise


def _error_site(exc: BaseException) -> tuple[str | None, str | None, str | None]:
    """From ``exc``'s traceback: the innermost running module (``"layers.0 (TransformerEncoderLayer)"``,
    named inside the outermost module on the stack), the innermost source line (``torch/nn/...:921``,
    a path below site-packages shortened to the package) and the call on that line
    (``torch._transformer_encoder_layer_fwd``; the line's code in backticks when it holds several
    calls), each None when unknown."""
    import linecache
    import os
    import re

    modules: list[torch.nn.Module] = []
    tb = exc.__traceback__
    last = None
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and (not modules or modules[-1] is not owner):
            modules.append(owner)
        last = tb
        tb = tb.tb_next
    module = None
    if modules:
        inner, root = modules[-1], modules[0]
        name = next((n for n, m in root.named_modules() if m is inner), None)
        label = type(inner).__name__
        module = f"{name} ({label})" if name else label
    if last is None:
        return module, None, None
    filename, line = last.tb_frame.f_code.co_filename, last.tb_lineno
    shown = filename
    marker = f"{os.sep}site-packages{os.sep}"
    if marker in filename:
        shown = filename.rsplit(marker, 1)[1]
    else:
        try:
            rel = os.path.relpath(filename)
            shown = filename if rel.startswith(os.pardir) else rel
        except ValueError:
            pass
    code = linecache.getline(filename, line).strip().split("  #")[0].rstrip()  # without an inline comment
    calls = [c for c in re.findall(r"([A-Za-z_][\w.]*)\s*\(", code) if c not in ("return", "print")]
    if len(calls) == 1:
        call = calls[0]
    else:  # several calls on the line (or none): which one raised is not known, show the line
        call = f"`{code if len(code) <= 80 else code[:77] + '...'}`" if code else None
    return module, f"{shown}:{line}", call


def patch_factory_name(factory: Any) -> str:
    """``module.qualname`` of a patch factory (``<locals>.`` left out), e.g.
    ``test_model.parity_patches.corrupt``: how the report names a patch set that names no patches."""
    qualname = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    module = getattr(factory, "__module__", None) or type(factory).__module__
    name = qualname.replace("<locals>.", "")
    return f"{module}.{name}" if module else name


def target_audit(device: torch.device) -> Any:
    """The device-propagation audit of a target run (``--parity-audit``): an ``audit.DeviceAudit``.

    An accelerator target (``npu:0``, ``cuda:0``) is audited in real-device mode. A CPU target has no
    device boundary, so its runs are audited as the *logical* device ``audit.DEFAULT_LOGICAL_TARGET``
    (``cuda:1``) over CPU tensors: what an accelerator would see, measured on this machine.

    Raises:
        ValueError: as ``DeviceAudit`` (a device that is not available here).
    """
    from .audit import DEFAULT_LOGICAL_TARGET, DeviceAudit

    if torch.device(device).type == "cpu":
        return DeviceAudit(DEFAULT_LOGICAL_TARGET, logical=True)
    return DeviceAudit(device, logical=False)


@contextlib.contextmanager
def no_patches(device: torch.device) -> Iterator[None]:
    """A patch factory that applies nothing."""
    yield

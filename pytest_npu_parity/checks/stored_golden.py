"""Goldens stored with the baseline: a compare run against a baseline judges the golden verdict without
running the golden.

A check judged by a golden verdict (``golden.judge_golden``; the default of every bf16 and fp16 check and of
fp32 training checks, see ``checks.settings``) compares both sides with a CPU run of the same computation in
float64 (``golden.GoldenRunner``). Against a live CPU reference that run is part of the reference's cost;
against a stored baseline it used to be the only CPU work left on the target host. So a recording
(``--update-baselines``) of a check whose verdict policy is golden — the same decision the compare run
makes, ``CheckPlan.golden_policy`` — runs the golden once and stores it in the check's baseline entry:

* its leaves as ``CheckBaseline.extras`` named ``"golden:<leaf path>"`` (content-addressed and covered by
  the file's checksum, ``baselines``), in the dtype the golden run returned them (float64; float32 where
  only a float32 golden runs, bf16 work), so the verdict is the live golden's bit for bit. Rounded to
  float32 they would take half the bytes, but the verdict's ratios of float32 outputs moved by up to 16 %
  (48 of the calibration's 58 fp32 cases by more than 1e-3; no verdict flipped among its 107 cases:
  ``benchmarks/stored_golden_precision.py``) — the rounding floor of a float32 output, the golden rounded
  to float32, is then the golden itself; rounding only the goldens of bf16 outputs moved no ratio by more
  than 3.1e-7 but would save 1.3 of the Aurora suite's 14 MiB of goldens;
* for a compact training step (``compact``) reduced as its leaves were (``compact.apply_recorded``:
  ``@sample``/``@stats``), which is what a compare run reduces a live golden to;
* in the entry's meta under ``golden`` (:data:`META_KEY`): ``dtype`` (the golden's floating dtypes),
  ``policy`` (the verdict policy the recording was made under), ``leaves`` (the stored leaf paths) and
  ``none_leaves`` (the golden's ``None`` leaves), and :data:`AS_REAL_KEY` where a complex128 golden
  leaf is stored as its float64 real view — or ``unavailable`` (why the golden could not run,
  ``golden.GoldenUnavailableError``: the compare run then judges by allclose with the same note, and runs
  no golden either).

At compare time :func:`golden_source` says where a check's golden comes from: the stored one when the
entry has it and the check runs on exactly the recorded inputs (bitwise, or the recorded ones replayed,
``checks.replay``); else the live golden run as before, with a one-line note — the entry stores none (a
file recorded before this, or under another policy), or the inputs differ from the recorded ones within
the summary rule of ``BaselineStore.check_fresh`` (the stored golden was computed from the recorded
inputs and the target runs on the current ones: a live golden of the current inputs keeps the verdict
measured in docs/explanation/verdict-accuracy.md). A live CPU reference runs the live golden, no note. A
stored golden that lacks a leaf its meta names, or holds a non-tensor, is a ``CorruptBaselineError``
(the check is an error, never a silent pass).

``--parity-store-goldens`` adds a compare run's live golden to an entry that stores none (:func:`addable`,
:func:`add_goldens`) only beside a reference of the computation the golden came from: the stored reference
must not be far beyond the check's golden verdict's limits when judged against a live CPU run of the
check (:func:`reference_mismatch`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..leaves import without
from ..store.format import BaselineError, CorruptBaselineError
from ..store.compact import apply_recorded

if TYPE_CHECKING:
    from ..judge.golden_policy import GoldenPolicy
    from ..judge.tolerance import Tolerance

__all__ = ["GOLDEN_PREFIX", "META_KEY", "NOT_ADDED", "MISMATCH_FACTOR", "GoldenSource", "recorded_golden",
           "golden_source", "addable", "reference_mismatch", "reference_multiple", "add_goldens"]

#: Name prefix of a stored golden leaf among a check's extras.
GOLDEN_PREFIX = "golden:"
#: Key of the stored golden's record in a check's meta.
META_KEY = "golden"
#: Key, in a check's ``golden`` meta record, of the complex golden leaves stored as their real view
#: (``torch.view_as_real``: float64 with a last dimension of 2), since safetensors has no complex128 dtype
#: (its ``_TYPES`` table stops at complex64); read back with ``torch.view_as_complex``.
AS_REAL_KEY = "complex_as_real"
_UNSTORABLE_COMPLEX = (torch.complex128,)
#: The note of a check whose baseline entry stores no golden.
NOT_STORED = ("golden computed live: the baseline stores none for this check (add it with --parity-store-goldens, "
              "or re-record)")
#: The note of a check whose entry stores no golden and whose inputs are not the recorded bits (activations
#: the running machine computed): a golden computed here is of other inputs, so ``--parity-store-goldens``
#: cannot add one.
NOT_STORED_OTHER_INPUTS = ("golden computed live: the baseline stores none for this check, and its inputs differ "
                           "from the recorded ones in their last bits, so --parity-store-goldens cannot add it "
                           "(a re-record stores the inputs with their golden)")
#: The start of the note of a check whose live golden ``--parity-store-goldens`` did not add
#: (``reference_mismatch``, and ``runner.ParityCase`` when the live CPU run it needs raises).
NOT_ADDED = "golden not added"
#: The note of a check whose inputs differ from the recorded ones within the summary rule.
OTHER_INPUTS = ("golden computed live: the inputs differ from the recorded ones (within the summary rule) "
                "that the stored golden was computed from")


@dataclass(frozen=True)
class GoldenSource:
    """Where a check's golden comes from at compare time (:func:`golden_source`).

    Attributes:
        kind: ``stored`` (``leaves`` from the baseline, no golden run), ``unavailable`` (the recording
            found none could run: judged by allclose, ``note`` says why) or ``live`` (the golden run).
        leaves: the stored golden leaves (``{leaf path: CPU tensor or None}``), for ``stored``.
        note: one line for the check's notes, or None.
    """

    kind: str
    leaves: dict | None = None
    note: str | None = None


def _dtype_names(leaves: dict) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in leaves.values()
                   if isinstance(t, torch.Tensor) and t.is_floating_point()})


def recorded_golden(golden: dict | None, why: str | None, policy: Any,
                    compact: dict | None) -> tuple[dict[str, torch.Tensor], dict]:
    """What a recording stores of a check's golden: ``(extras, meta)``.

    Args:
        golden: the golden leaves (``{leaf path: CPU tensor or None}``, ``golden.GoldenRunner.run``), or
            None when it could not run.
        why: the ``golden.GoldenUnavailableError`` text when ``golden`` is None.
        policy: the check's ``golden.GoldenPolicy`` (its description is recorded).
        compact: the entry's ``compact`` record (``compact.compact_leaves``), or None: the golden is
            reduced the same way.

    Returns:
        ``extras``: ``{"golden:<leaf>": tensor}`` (detached CPU copies in the golden's dtype);
        ``meta``: the entry's ``golden`` record (module docstring).
    """
    described = policy.describe() if hasattr(policy, "describe") else str(policy)
    if golden is None:
        return {}, {"unavailable": str(why), "policy": described}
    leaves = apply_recorded(dict(golden), compact) or {}
    extras: dict[str, torch.Tensor] = {}
    as_real: list[str] = []
    for path, t in leaves.items():
        if not isinstance(t, torch.Tensor):
            continue
        t = t.detach().to("cpu", copy=True)
        if t.dtype in _UNSTORABLE_COMPLEX:  # safetensors has no complex128: its float64 (…, 2) real view
            t = torch.view_as_real(t.resolve_conj()).clone()
            as_real.append(path)
        extras[GOLDEN_PREFIX + path] = t
    meta = {"dtype": ",".join(_dtype_names(leaves)) or None, "policy": described,
            "leaves": sorted(p for p, t in leaves.items() if isinstance(t, torch.Tensor)),
            "none_leaves": sorted(p for p, t in leaves.items() if t is None)}
    if as_real:
        meta[AS_REAL_KEY] = sorted(as_real)
    return extras, meta


def golden_source(entry: Any, path: Any = None) -> GoldenSource:
    """Where the golden of a check compared against baseline ``entry`` comes from (module docstring).

    Args:
        entry: the check's fresh baseline entry (``BaselineStore.check_fresh``: its meta's
            ``bitwise_input`` says whether the inputs were the recorded ones), or None for a live CPU
            reference.
        path: the baseline file (named by the error).

    Returns:
        A ``GoldenSource``.

    Raises:
        baselines.CorruptBaselineError: the entry's golden record is malformed, or a leaf it names is
            not stored.
    """
    if entry is None:
        return GoldenSource("live")
    record = entry.meta.get(META_KEY)
    if record is None:
        other = entry.meta.get("bitwise_input") is False
        return GoldenSource("live", note=NOT_STORED_OTHER_INPUTS if other else NOT_STORED)
    where = f"baseline {path}" if path is not None else "the baseline"
    if not isinstance(record, dict):
        raise CorruptBaselineError(f"{where} has a malformed golden record for check {entry.name!r}; re-record it", path)
    if "unavailable" in record:
        return GoldenSource("unavailable", note=f"golden unavailable, judged by allclose: {record['unavailable']}")
    if entry.meta.get("bitwise_input") is False:
        return GoldenSource("live", note=OTHER_INPUTS)
    names, none_leaves = record.get("leaves"), record.get("none_leaves", [])
    if not isinstance(names, list) or not isinstance(none_leaves, list) or not (names or none_leaves):
        raise CorruptBaselineError(f"{where} has a golden record without leaves for check {entry.name!r}; "
                                   "re-record it", path)
    stored = {k[len(GOLDEN_PREFIX):]: v for k, v in entry.extras.items() if k.startswith(GOLDEN_PREFIX)}
    missing = [name for name in names if not isinstance(stored.get(name), torch.Tensor)]
    if missing:
        raise CorruptBaselineError(f"{where} lacks the stored golden of output {missing[0]!r} of check "
                                   f"{entry.name!r} (its golden record names it); re-record it", path)
    extra = sorted(set(stored) - set(names))
    if extra:
        raise CorruptBaselineError(f"{where} stores golden leaves {extra[:3]} of check {entry.name!r} that its "
                                   "golden record does not name; re-record it", path)
    leaves: dict[str, torch.Tensor | None] = {name: stored[name] for name in names}
    for name in record.get(AS_REAL_KEY, []):
        real = leaves.get(name)
        if real is None or real.dtype != torch.float64 or real.dim() == 0 or real.shape[-1] != 2:
            raise CorruptBaselineError(f"{where} stores the complex golden of output {name!r} of check "
                                       f"{entry.name!r} as something other than its float64 real view; "
                                       "re-record it", path)
        leaves[name] = torch.view_as_complex(real.contiguous())
    leaves.update({name: None for name in none_leaves})
    return GoldenSource("stored", leaves=leaves)


#: The prefix of ``golden_for``'s note when the golden could not run (its ``GoldenUnavailableError`` follows).
UNAVAILABLE_NOTE = "golden unavailable, judged by allclose: "


def addable(entry: Any, source: GoldenSource | None, golden: tuple[dict | None, str | None]) -> tuple | None:
    """What ``--parity-store-goldens`` may add to baseline ``entry`` from a compare run's live golden.

    Args:
        entry: the check's fresh baseline entry (``BaselineStore.check_fresh``), or None (a live CPU
            reference: nothing to add to).
        source: the check's ``golden_source`` (None: not a golden-judged check).
        golden: ``checks.reference.golden_for``'s ``(golden leaves or None, note or None)``.

    Returns:
        ``(golden leaves or None, why it is unavailable or None)`` when the entry stores no golden
        (``NOT_STORED``) and the check ran on exactly the recorded inputs (a golden of other inputs is
        not the recorded reference's golden: ``OTHER_INPUTS`` is never added), else None.
    """
    if entry is None or source is None or source.kind != "live" or source.note != NOT_STORED:
        return None
    if entry.meta.get("bitwise_input") is False:
        return None
    leaves, note = golden
    if leaves is not None:
        return dict(leaves), None
    if note and note.startswith(UNAVAILABLE_NOTE):
        return None, note[len(UNAVAILABLE_NOTE):]
    return None


#: How far beyond its verdict's limits the stored reference may be, judged against the live run, before
#: ``--parity-store-goldens`` refuses to add a golden beside it (``reference_mismatch``). Measured by
#: ``benchmarks/store_goldens_guard.py`` (10 input seeds each; 2-core AMD EPYC, torch 2.14.1; output in
#: benchmarks/results/store_goldens_guard_avx512bf16.txt): references of the same computation recorded with
#: another summation order came to at most 10.9 times the limits (fp32 training steps) and 16.3 (bf16
#: training steps; a bf16 check 1.2); with the computation changed by 1e-4 relative, the fp32 training steps
#: came to 64-3,700 times, all refused. bf16 resolves less: a bf16 check changed by 1e-1 came to 16 times
#: (added), bf16 training steps changed by 1e-2 were refused in 3 of 30 cases.
MISMATCH_FACTOR = 30.0


def reference_mismatch(stored: dict, live: dict, golden: dict, compact: dict | None, policy: GoldenPolicy,
                       tolerance: Tolerance | None, name: str, work_dtype: torch.dtype | None, *,
                       training: bool = False) -> str | None:
    """Why ``--parity-store-goldens`` must not add ``golden`` to an entry whose reference is ``stored``,
    or None. The stored reference is judged, as the side under test, against ``live`` (a CPU run of the
    check as it is now, unpatched, as a recording runs it) with ``judge.golden.judge_golden``: the golden
    is refused when a leaf does not match at all (missing, another shape or dtype kind, non-finite where the
    live run is finite or the reverse) or is more than :data:`MISMATCH_FACTOR` times beyond a ratio limit
    (``reference_multiple``). The allclose floor is not applied (within it, a changed computation would
    pass unseen), except to an infinite ratio; integer leaves are not judged.

    Why: the golden verdict divides the target's error by the reference's (``judge.golden``), and
    nothing bounds the reference's own. A golden computed now comes from the computation as it is now;
    the stored reference from the one at its recording. Where something no fingerprint covers changed in
    between (the model's code or its package's version, a class attribute or global its forward reads),
    the reference's error against the new golden holds that change, and stored with it the golden would
    let a target differ by as much from then on, with no note (docs/explanation/golden-floor.md). The
    factor leaves room for a reference of the same computation recorded with other CPU kernels (see
    :data:`MISMATCH_FACTOR`; not measured for references recorded on another device class); a change
    within it is not seen.

    Args:
        stored: the entry's reference leaves, ``{path: CPU tensor or None}`` (layer records taken out;
            compact leaves as recorded).
        live: the live CPU run's leaves, the same form (layer records taken out; reduced here as
            ``compact`` says).
        golden: the live golden's leaves (float64, or float32 where no float64 golden runs), full; reduced
            the same way.
        compact: the entry's compact record (``compact.apply_recorded``), or None.
        policy: the check's golden verdict policy.
        tolerance: the check's tolerance (the informative metrics and the allclose floor), or None for
            the dtype's default.
        name: the check's name, for messages.
        work_dtype: the recipe's work dtype (``judge.golden_policy.WORK_DTYPES``).
        training: a training step: its ``param.*`` leaves (the parameters after the step) are left out,
            since AdamW turns last-bit gradient differences into steps of up to +-lr (the check's own verdict
            replays the optimizer for that, ``checks.verdict.optimizer_replay``); its loss and gradients carry
            a changed computation.

    Returns:
        The check's note (starting with :data:`NOT_ADDED`), or None.

    Raises:
        TypeError, ValueError: as ``judge_golden`` for leaves it cannot compare (the caller refuses then).
    """
    from ..judge.golden import judge_golden

    live, golden = apply_recorded(live, compact), apply_recorded(golden, compact)
    if training:
        params = {key for key in live if str(key).startswith("param.")}
        stored, live, golden = without(stored, params), without(live, params), without(golden, params)
    result = judge_golden(stored, live, golden, policy, tolerance=tolerance, name=name, work_dtype=work_dtype)
    times, metric, where, problem = reference_multiple(result)
    if problem is not None:
        return (f"{NOT_ADDED}: the stored reference does not match a live CPU run of this check (leaf {where}: "
                f"{problem}): the computation may have changed since the recording (re-record with "
                "--update-baselines)")
    if times <= MISMATCH_FACTOR:
        return None
    return (f"{NOT_ADDED}: judged against a live CPU run of this check, the stored reference is {times:.3g} times "
            f"beyond the golden verdict's {metric} limit on leaf {where} (other CPU kernels stay within "
            f"{MISMATCH_FACTOR:g} times): the model's code, a package version or an attribute no fingerprint "
            "covers may have changed since the recording (re-record with --update-baselines)")


def reference_multiple(result: Any) -> tuple[float, str | None, str | None, str | None]:
    """``(multiple, metric, leaf, problem)`` of ``reference_mismatch``'s verdict ``result`` (a
    ``judge.golden.GoldenCompareResult`` with the stored reference as the side under test): the largest
    ratio / limit over its leaves and metrics (0.0 when none) with that metric and leaf (``repr`` of its path),
    or the first leaf that does not match at all and why (``problem``; then the multiple is ``inf``).

    A leaf's ``problem`` (missing, another shape or dtype kind) and non-finite elements on one side only
    (``nonfinite_mismatched``, which the ratios leave out) do not match. An infinite ratio (the live run
    and the golden rounded to the dtype both exact) of a leaf within the allclose floor of the live run
    (``within_floor``, under a policy with the floor) is left out: last-bit differences against an exact
    value. NaN ratios (no error on either side under msprobe's rule) are left out. Integer leaves have no
    ratios."""
    from ..judge.golden import golden_shape_differs

    worst: tuple[float, str | None, str | None] = (0.0, None, None)
    for leaf in result.leaves:
        where = repr(leaf.path or "<output>")
        nonfinite = getattr(leaf, "nonfinite_mismatched", 0)
        shape = getattr(leaf, "golden_shape", None)  # judged by the floor alone: no ratio to measure the reference by
        problem = (leaf.problem
                   or (f"{nonfinite} non-finite element(s) where the other side is finite" if nonfinite else None)
                   or (golden_shape_differs(shape, tuple(leaf.shape)) if shape is not None else None))
        if problem is not None:
            return math.inf, None, where, problem
        limits = leaf.policy.limits if getattr(leaf, "policy", None) is not None else {}
        for metric, value in (getattr(leaf, "ratios", None) or {}).items():
            limit = limits.get(metric)
            if not limit or value != value or (math.isinf(value) and getattr(leaf, "within_floor", False)):
                continue
            if value / limit > worst[0]:
                worst = (value / limit, metric, where)
    return (*worst, None)


def add_goldens(store: Any, test_id: str, additions: dict[str, tuple[dict | None, str | None, Any]],
                facts: dict) -> str:
    """Add goldens computed by a compare run to ``test_id``'s baseline file, nothing else changed.

    Every other byte of meaning stays as recorded: each check's reference leaves, ``None`` leaves,
    fingerprints and replay extras, and the file's provenance (the machine that recorded the reference);
    the provenance gains ``goldens_added`` (``facts``: where and with what the goldens were computed).
    The file is rewritten atomically with a new checksum (``BaselineStore.write``).

    Args:
        store: the ``baselines.SuiteStores``/``BaselineStore`` holding the file.
        test_id: the file's test id (``ParityCase.test_id``).
        additions: ``{check name: (golden leaves or None, why unavailable or None, GoldenPolicy)}``, from
            :func:`addable`. A check the file no longer holds, or whose entry has a golden already, is
            left alone.
        facts: JSON-serializable provenance of the golden runs (``recording_provenance``'s keys).

    Returns:
        ``BaselineStore.write``'s status, or ``"unchanged"`` when nothing was added.

    Raises:
        BaselineError: the file is gone or unreadable (``BaselineStore.load``'s errors).
        OSError: it cannot be written (the old file is left intact).
    """
    baseline = store.load(test_id)
    if baseline is None:
        raise BaselineError(f"cannot add goldens to the baseline of {test_id!r}: the file is gone", None)
    checks = dict(baseline.checks)
    added = 0
    for name, (golden, why, policy) in sorted(additions.items()):
        entry = checks.get(name)
        if entry is None or META_KEY in entry.meta:
            continue
        extras, meta = recorded_golden(golden, why, policy, entry.meta.get("compact"))
        checks[name] = replace(entry, meta={**entry.meta, META_KEY: meta}, extras={**entry.extras, **extras})
        added += 1
    if not added:
        return "unchanged"
    return store.write(test_id, checks, {**baseline.provenance, "goldens_added": facts})

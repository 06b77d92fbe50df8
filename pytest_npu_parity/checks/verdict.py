"""How a check is judged: ``(side result, expected, settings, golden) -> record and problems``.

``measure`` compares the target's leaves with the expected ones (allclose by the tolerance, or the
golden verdict, ``golden.judge_golden``) into a ``CheckRecord``; ``check_problems`` adds what fails a
check as a whole (vacuity, the layer check, the audit budget); ``failure_message`` is the text a
failing check raises with. Which judge applies is decided in one place, ``verdict_for``: leaf by
leaf (``LEAVES``) or, for a sampling check whose sides drew from their own streams, as
distributions (``DistributionVerdict``, ``measure_distribution``); a ``ParityCase.trajectory`` is judged
by its curves (``TrajectoryVerdict``, ``judge.trajectory``). A training step's expected ``param.*`` leaves come from the optimizer
replay when it is trusted (``optimizer_replay``), else its parameters whose reference gradient is
rounding noise are left out (``compared_sides``). ``given_sides`` prepares what ``ParityCase.compare``
was handed. Nothing here runs a computation of
the check or calls back into its case: the case runs the hooks (``checks.hooks``) and keeps records.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..runtime.audit import AuditRecord, ParityAuditWarning
from ..store.compact import SAMPLE_SUFFIX, STATS_SUFFIX, apply_recorded
from ..judge.allclose import compare
from ..judge.distribution import compare_distributions
from ..judge.golden import judge_golden
from ..judge.golden_policy import WORK_DTYPES
from ..judge.layers import judge_layers
from ..judge.trajectory import TrajectoryPolicy, judge_trajectory
from ..judge.tolerance import Tolerance
from ..runtime.input_changes import input_path, is_inplace_leaf
from ..runtime.layer_capture import split_layers
from ..runtime.side import CheckCall, _to_cpu_leaves
from ..leaves import without
from ..runtime.training import rounding_level_params
from ..diagnose.selfcheck import ParityVacuityWarning, below_tolerance, vacuity_problem
from .plan import CaseFacts, CheckPlan
from .record import CheckRecord
from .reference import INPUT_CHANGES_META_KEY, Expected, thread_count_mismatch, torch_version_mismatch


@dataclass(frozen=True)
class Sides:
    """What a verdict judges: the target's side and the expected one.

    Attributes:
        actual: the target's leaves (``{path: CPU tensor or None}``).
        expected: the expected leaves and their origin.
        audit: the target run's audit dict, or None.
        weights: the module's fingerprint (``CheckRecord.weights``), or None.
        golden: the golden leaves, or None (judged by allclose).
        golden_policy: the ``golden.GoldenPolicy`` the golden is judged by, or None.
        note: how the verdict was reached (``CheckNotes.policy_note``), or None.
        layer_records: ``(target's, reference's, layers.LayerPolicy)``, or None.
        notes: more notes for ``CheckNotes.policy_note`` (``CheckCall.notes``).
        input_changes: the inputs each side's runs changed in place (``runtime.side.Side.input_changes``),
            or None.
        input_hash: the bitwise fingerprint of the check's inputs (``checks.reference.check_hashes``), or None.
        optimizer_step: ``(the target's param.* leaves, the optimizer replay's from the target's gradients)``
            when the replay is used (``compared_sides``), judged on their own by ``optimizer_step_problem``;
            else None.
    """

    actual: dict
    expected: Expected
    audit: dict | None = None
    weights: str | None = None
    golden: dict | None = None
    golden_policy: Any = None
    note: str | None = None
    layer_records: tuple | None = None
    notes: tuple = ()
    input_changes: dict | None = None
    input_hash: str | None = None
    optimizer_step: tuple | None = None


def _joined(note: str | None, more: str | None) -> str | None:
    return ((note + "; ") if note else "") + more if more else note


def split_layer_records(sides: Sides, layer_policy: Any) -> Sides:
    """``sides`` with the layer records taken out of both leaf sets into ``layer_records``
    (``layers.split_layers``), kept there when ``layer_policy`` judges them."""


    __tracebackhide__ = True
    actual, actual_layers = split_layers(sides.actual)
    expected, expected_layers = split_layers(sides.expected.leaves)
    layer_records = (actual_layers, expected_layers, layer_policy) if layer_policy is not None else None
    return dataclasses.replace(sides, actual=actual, expected=dataclasses.replace(sides.expected, leaves=expected),
                               layer_records=layer_records)


def stream_override_note(overridden: set[str] | None) -> str | None:
    """The note of a check whose target runs called, in place of the patch set's own random functions, the
    shared random stream's (``runtime.side.Side.stream_overrides``: functions the patch set replaced and the
    computation called): under the shared stream ``F.dropout``, SDPA's dropout and
    ``torch.rand``/``randn``/… are the plugin's on both sides, so that both draw the same numbers; a
    patch set's replacement of one of them is then not judged (its probability, its scaling, a dropout
    left out all pass). None when there is none."""
    if not overridden:
        return None
    shown = ", ".join(name + (" with dropout" if name.endswith("scaled_dot_product_attention") else "")
                      for name in sorted(overridden))
    return (f"the patch set's own {shown} did not run: under the shared random stream both sides call the plugin's "
            "(the same draws on both), so the patch set's version is not judged here")


def _not_compared(leaf_paths: Any, why: str) -> str:
    """The note naming the inputs whose written values (``inplace:`` leaves) are not compared, and why."""
    shown = ", ".join(sorted(input_path(p) for p in leaf_paths))
    return f"the values written in place into {shown} not compared: {why}"


def without_unpaired_inplace(leaves: Any, expected: Any) -> Any:
    """``leaves`` (a run's ``{path: leaf}``) less its ``inplace:`` leaves (``runtime.input_changes``) that
    ``expected`` does not hold: a re-run of the target (``call.rerun``), the store run's live CPU run or a
    counterfactual's leaves, made comparable with the expected leaves ``paired_input_leaves`` and
    ``compared_sides`` kept."""
    if not isinstance(leaves, dict):
        return leaves
    held = expected if isinstance(expected, dict) else {}
    return without(leaves, {p for p in leaves if is_inplace_leaf(p) and p not in held})


def without_inplace_leaves(sides: Sides, why: str) -> Sides:
    """``sides`` with no ``inplace:`` leaf on either side, and a note naming the inputs whose written values are
    therefore not compared, ``why`` (a check judged as distributions, whose leaves are samples)."""
    names = sorted({p for leaves in (sides.actual, sides.expected.leaves) if isinstance(leaves, dict)
                    for p in leaves if is_inplace_leaf(p)})
    if not names:
        return sides
    return dataclasses.replace(sides, actual=without(sides.actual, set(names)),
                               expected=dataclasses.replace(sides.expected, leaves=without(sides.expected.leaves,
                                                                                          set(names))),
                               notes=(*sides.notes, _not_compared(names, why)))


def paired_input_leaves(sides: Sides) -> Sides:
    """``sides`` with the inputs' values after the run (``runtime.input_changes``, leaves ``inplace:<path>``)
    kept where both sides hold one: an input changed in place on one side only is judged as such
    (``input_change_verdict``), not as a missing leaf. Where the reference is a baseline entry that
    recorded the input as changed but holds no value for it (recorded before the values were stored), the
    note says the value was not compared."""
    actual, expected = sides.actual, sides.expected.leaves
    if not isinstance(actual, dict) or not isinstance(expected, dict):
        return sides
    one_sided = {p for p in set(actual) ^ set(expected) if is_inplace_leaf(p)}
    if not one_sided:
        return sides
    recorded = recorded_input_changes(sides.expected.entry) or set()
    unstored = [p for p in one_sided if p in actual and input_path(p) in recorded]
    notes = sides.notes
    if unstored:
        notes = (*notes, _not_compared(unstored, "the baseline was recorded before they were stored (re-record "
                                                 "with --update-baselines)"))
    return dataclasses.replace(sides, actual=without(actual, one_sided), notes=notes,
                               expected=dataclasses.replace(sides.expected, leaves=without(expected, one_sided)))


def compared_sides(sides: Sides, call: CheckCall, replay: tuple[dict | None, str | None],
                   golden: tuple[dict | None, str | None], golden_policy: Any) -> Sides:
    """The leaves a check compares: the target's (and the golden's) reduced as a compact baseline
    recorded them (``compact.apply_recorded``; ``call.rerun`` then reduces its re-runs the same
    way), a training step's ``param.*`` expected from the optimizer ``replay`` when it is used,
    else its parameters with a rounding-noise reference gradient left out
    (``runtime.training.rounding_level_params``); the notes of each say so.

    Args:
        replay: ``(replayed param.* leaves or None, note or None, exact)`` (``optimizer_replay``).
        golden: ``(golden leaves or None, note or None)``; None leaves: judged by allclose.
    """


    __tracebackhide__ = True
    compact = sides.expected.compact
    actual = apply_recorded(sides.actual, compact)
    if compact:  # re-runs (--parity-selfcheck) are compared with the same compact leaves
        rerun = call.rerun
        call.rerun = lambda *args: apply_recorded(rerun(*args), compact)
    golden_leaves, note = apply_recorded(golden[0], compact), golden[1]
    if compact:
        note = _joined(note, f"{len(compact)} large leaves compared as the baseline recorded them (train store "
                             f"summary): {next(iter(compact.values()))['samples']} sampled elements and [sum, L2 "
                             "norm, max |x|, position-weighted sum] each (leaves <name>@sample, <name>@stats)")
    replayed, replay_note, exact = replay
    expected = sides.expected.leaves if replayed is None else {**sides.expected.leaves, **replayed}
    note = _joined(note, replay_note)
    if golden_leaves is not None:  # the golden run, on its float64 copy, may leave an input the sides changed
        unchanged = {p for p in expected if is_inplace_leaf(p) and p not in golden_leaves}
        if unchanged:
            actual, expected = without(actual, unchanged), without(expected, unchanged)
            note = _joined(note, _not_compared(unchanged, "the golden run did not change that input (a "
                                                          "value-dependent in-place op, on its float64 copy)"))
    if call.kind == "train_step" and replayed is None:
        dropped = rounding_level_params(expected)
        if dropped:
            actual, expected = without(actual, dropped), without(expected, dropped)
            golden_leaves = without(golden_leaves, dropped)
            shown = ", ".join(sorted(dropped)[:4]) + (", …" if len(dropped) > 4 else "")
            note = _joined(note, f"{len(dropped)} parameter(s) after the step not compared ({shown}): the "
                                 "reference's gradient is rounding noise (the loss does not depend on them), which "
                                 "AdamW turns into steps of up to ±lr; their grad.* leaves are compared")
    step = ({k: actual[k] for k in replayed if k in actual}, replayed) if replayed is not None and exact else None
    return dataclasses.replace(sides, actual=actual, expected=dataclasses.replace(sides.expected, leaves=expected),
                               golden=golden_leaves, golden_policy=golden_policy if golden_leaves is not None else None,
                               note=note, optimizer_step=step)


def rejudged(facts: CaseFacts, plan: CheckPlan, sides: Sides, call: CheckCall,
             golden: tuple[dict | None, str | None], leaves: dict) -> Any:
    """Another target run's ``leaves`` (``{path: CPU tensor or None}``, as ``call.rerun`` returns them)
    judged as the check judged its own (``CheckCall.rejudge``): the same expected leaves, the same
    ``golden`` (computed once, by the check), the optimizer replay from these leaves' gradients, the
    compact reduction (``compact.apply_recorded``, which leaves reduced leaves as they are) and the
    verdict (allclose or golden, ``measure``). ``sides``: the check's sides before
    ``compared_sides``; ``call``: a copy of the check's call (``compared_sides`` may wrap its
    ``rerun``). Returns the ``CompareResult`` (a ``GoldenCompareResult`` under a golden verdict);
    nothing is recorded or raised."""
    actual = without_unpaired_inplace(split_layers(leaves)[0], sides.expected.leaves)
    again = dataclasses.replace(sides, actual=actual)
    replay = optimizer_replay(call, actual, again.expected.leaves, plan.tolerance, again.expected.compact)
    again = compared_sides(again, dataclasses.replace(call), replay, golden, plan.golden_policy)
    return measure(facts, plan, again).result


def optimizer_replay(call: CheckCall, actual: dict, expected: dict, tol: Tolerance,
                     compact: dict | None) -> tuple[dict | None, str | None, bool]:
    """``(replayed param.* leaves or None, note or None, exact)`` of a training step's optimizer replay
    (``train_step``, Compared leaves): the step replayed from the target's full ``grad.<p>``
    leaves (``actual``, before ``compact.apply_recorded``), reduced as the baseline recorded them
    (``compact``), used only when the same replay from the reference's own ``grad.<p>``
    reproduces the reference's ``param.<p>`` within ``tol``. A compact baseline keeps large
    gradients only as ``@sample``/``@stats``: the replay is then validated on the parameters it
    stores whole (an optimizer whose step of one parameter depends on others' gradients fails
    that check, their gradients being absent), and not used when it stores none whole. Otherwise
    None and a note why; the caller then falls back to ``rounding_level_params``. A replay that is used
    also says whether it reproduces the reference's step at the default tolerance of its parameters'
    dtype (``exact``, ``policy.default_for_dtype``), not only at ``tol``: then the target's step is judged
    against the replay at that tolerance as well (``optimizer_step_problem``)."""
    if call.kind != "train_step" or call.replay is None:
        return None, None, False
    fallback = ("optimizer replay not used ({}): param.* after the step compared with the reference's "
                "own step")
    params = {k for k in expected if k.startswith("param.")}
    whole = {k for k in params if not k.endswith((SAMPLE_SUFFIX, STATS_SUFFIX))}
    if not any(isinstance(expected.get("grad." + k[len("param."):]), torch.Tensor) for k in whole):
        if whole != params:
            return None, fallback.format("the compact baseline stores no parameter's gradient whole, so the "
                                         "reference's step cannot be replayed from it"), False
        return None, None, False
    grads = (expected.get("grad." + k[len("param."):]) for k in whole)
    if any(isinstance(g, torch.Tensor) and g.is_floating_point() and not bool(torch.isfinite(g).all()) for g in grads):
        return None, fallback.format("the reference's gradients are not finite: a loss scaler skips such a step, "
                                     "which a replay from them does not"), False
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
                                         "weights and gradients alone"), False
        # the replay reproduces the reference's step to its parameters' own precision, not only the recipe's:
        # then the target's step is judged against it at that precision too (optimizer_step_problem)
        exact = compare({k: check[k] for k in whole}, {k: expected[k] for k in whole}, None).passed
        replayed = apply_recorded(call.replay(actual), compact)
    except Exception as exc:  # noqa: BLE001 - a user optimizer that cannot be replayed: the old comparison
        return None, fallback.format(f"the replay raised {type(exc).__name__}: {exc}"), False
    validated = (f" (validated on the {len(whole)} parameter(s) the compact baseline stores whole)"
                 if whole != params else "")
    return {k: v for k, v in replayed.items() if k in params}, (
        "param.* after the step compared with the CPU optimizer's step from the target's gradients "
        "(optimizer replay): a gradient difference within tolerance is not amplified by AdamW" + validated), exact


def measure(facts: CaseFacts, plan: CheckPlan, sides: Sides) -> CheckRecord:
    """The record of comparing ``sides``: by ``golden.judge_golden`` under ``sides.golden_policy``
    (work dtype of the recipe), else by ``compare.compare`` with the plan's tolerance; status
    ``pass`` or ``fail`` by the leaves alone."""
    __tracebackhide__ = True
    name, tol, expected = plan.name, plan.tolerance, sides.expected
    if sides.golden_policy is not None:
        result = judge_golden(sides.actual, expected.leaves, sides.golden, sides.golden_policy, tolerance=tol,
                              name=name, work_dtype=WORK_DTYPES.get(facts.recipe.name))
    else:
        result = compare(sides.actual, expected.leaves, tol, name=name)
    record = facts.record(plan, expected.reference, status="pass" if result.passed else "fail", result=result,
                          reference_provenance=expected.provenance, audit=sides.audit,
                          golden_policy=sides.golden_policy, weights=sides.weights)
    record.notes.policy_note = "; ".join(filter(None, (sides.note, *sides.notes))) or None
    return record


def check_problems(facts: CaseFacts, plan: CheckPlan, sides: Sides, record: CheckRecord,
                   vacuous_ok: str | None) -> list[str]:
    """What fails the check as a whole, each recorded in ``record``: its reference is vacuous
    (unless ``vacuous_ok``), a layer moved beyond the layer limit, its audit went beyond its budget
    (audit mode ``fail``; under ``warn`` a warning)."""


    __tracebackhide__ = True
    problems = vacuity_problems(plan.name, sides.expected.leaves, record, vacuous_ok)
    changes, known = sides.input_changes, record.reference == "cpu"
    recorded = recorded_input_changes(sides.expected.entry)
    # What the reference changed, as recorded, where the target ran on the recorded input bitwise: a value-dependent
    # in-place op (hardtanh(inplace=True) at its clip value) changes an input the summary rule lets through as the
    # same, differing in last bits, otherwise.
    unheld = None
    if recorded is not None and record.reference == "baseline":
        if sides.input_hash is not None and sides.expected.entry.meta.get("input_hash") == sides.input_hash:
            changes, known = dict(changes or {}, reference=recorded), True
        elif (changes or {}).get("target") != recorded:
            unheld = (f"the baseline's reference changed {', '.join(sorted(recorded)) or 'no input'} in place, the "
                      f"target {', '.join(sorted((changes or {}).get('target') or ())) or 'no input'}: not judged, "
                      "since this input differs from the recorded one in its last bits (re-record, or record its "
                      "inputs for replay, to judge it)")
    change_note, change_problem = input_change_verdict(changes, live_reference=known)
    change_note = _joined(change_note, unheld)
    if change_note:
        record.notes.policy_note = _joined(record.notes.policy_note, change_note)
    if change_problem:
        problems.append(change_problem)
    step_problem = optimizer_step_problem(sides.optimizer_step)
    if step_problem:
        problems.append(step_problem)
    layer_problem = judge_layer_records(record, sides.layer_records)
    if layer_problem:
        problems.append(layer_problem)
    audit_problem = judge_audit(facts, record, plan.audit_budget)
    if audit_problem:
        problems.append(audit_problem)
    return problems


def failure_message(facts: CaseFacts, record: CheckRecord, expected: Expected, problems: list[str]) -> str:
    """The message of a failing check (before the failure hooks' texts), its record marked ``fail``:
    with every leaf within tolerance the problems (also ``notes.check_problem``), else the comparison's
    table, the problems and the torch-version and thread-count notes of a baseline reference."""
    record.status = "fail"
    context = facts.context(expected.reference, expected.provenance)
    result = record.result
    if result.passed:
        record.notes.check_problem = " ".join(problems)
        return "\n\n".join([f"Parity check {record.check!r} failed ({context}) with every output leaf within "
                            "tolerance:"] + problems)
    message = "\n\n".join([result.format(context)] + problems)
    mismatch = torch_version_mismatch(expected.recorded)
    if mismatch:
        record.notes.torch_mismatch = mismatch
        message += "\n\n" + mismatch
    threads = thread_count_mismatch(expected.recorded, facts.target)
    if threads:
        message += "\n\n" + threads
    return message


def judge_layer_records(record: CheckRecord, layer_records: tuple | None) -> str | None:
    """Judge the check's layer records (``layers.judge_layers``) into ``record.layer_check``; the
    failure text, or None. A reference without layer records (a baseline recorded before them,
    or with the layer check off) leaves a note and judges nothing."""
    if layer_records is None:
        return None
    actual, expected, policy = layer_records
    record.layer_records = (actual, expected)
    record.layer_check.layer_policy = policy.describe()
    if actual and not expected:
        note = ("layer check not run: the reference has no layer records (re-record the baseline with "
                "--update-baselines to judge every weighted layer)")
        record.notes.policy_note = "; ".join(filter(None, [record.notes.policy_note, note]))
        return None
    verdict = judge_layers(actual, expected, policy)
    record.layer_check.layers_judged = verdict.judged
    worst = verdict.worst()
    if worst is not None:
        record.layer_check.layer_worst, record.layer_check.layer_worst_rel_l2 = worst
    if verdict.passed:
        return None
    record.layer_check.layers_failing = ", ".join(verdict.failing)
    return verdict.format()


def judge_audit(facts: CaseFacts, record: CheckRecord, budget: Any) -> str | None:
    """Judge the check's audit by ``budget`` (else the test's; audit modes ``warn``/``fail``): the
    events beyond it go to ``record.audit_check``; under ``warn`` an ``audit.ParityAuditWarning``
    points at the first event's source line. Returns the problem text when it fails the check."""
    mode = facts.audit_mode
    if record.audit is None or mode not in ("warn", "fail") or record.audit.get("skipped"):
        return None
    budget = budget if budget is not None else facts.audit_budget
    record.audit_check.audit_budget = budget.describe()
    audit = AuditRecord.from_dict(record.audit)
    text = budget.judge(audit, record.check, failing=mode == "fail")
    if not text:
        return None
    record.audit_check.audit_problem = text
    record.audit_check.audit_verdict = mode
    if mode == "fail":
        return text
    over = budget.excess(audit)
    first = next((e for e in audit.events if e.kind in over), None)
    path, _, line = (first.source if first is not None else "").rpartition(":")
    if path and line.isdigit():
        warnings.warn_explicit(f"{facts.test_id} ({facts.recipe.name}): {text}", ParityAuditWarning, path, int(line))
    else:
        warnings.warn(f"{facts.test_id} ({facts.recipe.name}): {text}", ParityAuditWarning, stacklevel=2)
    return None


def optimizer_step_problem(step: tuple | None) -> str | None:
    """Why the target's optimizer step fails, or None: its parameters after the step (``step[0]``) against
    the optimizer replay's from the target's own gradients (``step[1]``, ``Sides.optimizer_step``), compared
    at the default tolerance of each parameter's dtype (``policy.default_for_dtype``: fp32 1e-5) rather than
    the recipe's.

    Why: the replay takes the target's gradients, so what is left between the two is the optimizer's own
    arithmetic (its rounding), whatever the recipe did to the gradients. Under bf16 autocast the parameters
    are fp32, and the recipe's tolerance (1e-3 + 1e-3·|p|) holds a whole AdamW step of lr 1e-3: a target
    optimizer that did not step, or stepped at 1.5 times the learning rate, passed the recipe's verdict.
    A bf16 parameter (``bf16-weights``) is judged at bf16's tolerance, which still holds such a step."""
    if step is None:
        return None
    actual, replayed = step
    result = compare(actual, replayed, None, name="optimizer step")
    failed = result.failures
    if not failed:
        return None
    worst = max(failed, key=lambda leaf: leaf.err_ratio if leaf.problem is None else math.inf)
    shown = ", ".join(leaf.path for leaf in failed[:3]) + (", …" if len(failed) > 3 else "")
    size = (f"max abs difference {worst.max_abs:.3g} where {worst.tolerance.atol:g} + {worst.tolerance.rtol:g}·|p| "
            "is allowed" if worst.problem is None else worst.problem)
    return (f"The target's optimizer step differs from the CPU optimizer's step from the target's own gradients on "
            f"{len(failed)} parameter(s) ({shown}; {worst.path}: {size}): the optimizer on the target (its "
            "learning rate, its update, or a step not taken) computes something else.")


def recorded_input_changes(entry: Any) -> set[str] | None:
    """The inputs a baseline entry's reference run changed in place (``checks.reference.INPUT_CHANGES_META_KEY``),
    or None when the entry does not say (recorded before it was stored, or no entry)."""
    found = getattr(entry, "meta", {}).get(INPUT_CHANGES_META_KEY) if entry is not None else None
    if not isinstance(found, list) or not all(isinstance(x, str) for x in found):
        return None
    return set(found)


def input_change_verdict(changes: dict[str, set[str]] | None, *,
                         live_reference: bool) -> tuple[str | None, str | None]:
    """``(note, problem)`` for the inputs a check's runs changed in place (``runtime.side._changed_inputs``).

    The note says which inputs changed (each side ran on its own copy of the caller's inputs, so
    the comparison is unaffected). The problem, when a live reference ran in this check: the two
    sides changed different inputs — a port that drops (or adds) an in-place update of its argument
    computes something else, even where the outputs agree. ``live_reference``: the reference's changes are
    known (a live run, or a baseline entry that recorded them, ``recorded_input_changes``)."""
    if not changes:
        return None, None
    ref, tgt = changes.get("reference"), changes.get("target")
    changed = (ref or set()) | (tgt or set())
    if not changed:
        return None, None
    note = (f"the computation changes its input(s) {', '.join(sorted(changed))} in place; each side ran on its "
            "own copy of the caller's inputs")
    if not live_reference or ref is None or tgt is None or ref == tgt:
        return note, None
    only_ref, only_tgt = sorted(ref - tgt), sorted(tgt - ref)
    parts = ([f"{', '.join(only_ref)} on the reference only"] if only_ref else []) + (
        [f"{', '.join(only_tgt)} on the target only"] if only_tgt else [])
    return note, ("Input changed in place on one side only: " + "; ".join(parts)
                  + " — the target changes its arguments differently from the reference.")


def vacuity_problems(name: str, expected: dict, record: CheckRecord, vacuous_ok: str | None) -> list[str]:
    """The vacuity problem of a check's reference leaves (``selfcheck.vacuity_problem``: one min/max
    per floating leaf), as a one-item list, or ``[]`` when it has none or ``vacuous_ok`` allows it;
    records ``vacuous`` / ``vacuous_ok`` in ``record.vacuity``. A reference output within atol of
    zero (``selfcheck.below_tolerance``) is no failure but a ``selfcheck.ParityVacuityWarning`` and a
    note, unless ``vacuous_ok`` allows it or the golden verdict without the allclose floor judges it."""
    vacuous = vacuity_problem(expected)
    if not vacuous:
        golden = record.golden_policy
        tiny = None if vacuous_ok or golden is not None and not golden.allclose_floor \
            else below_tolerance(expected, record.tolerance)
        if tiny:  # it can still fail elsewhere (other leaves' dtypes, the layer check): a warning, not a failure
            record.notes.policy_note = _joined(record.notes.policy_note, tiny)
            warnings.warn(f"{record.test_id} ({record.recipe}): parity check {name!r} is nearly vacuous: {tiny}. "
                          "Give it inputs/weights whose outputs exceed atol (pretrained or stable_init_ weights), "
                          "a smaller atol, or vacuous_ok='<reason>'.", ParityVacuityWarning, stacklevel=2)
        return []
    record.vacuity.vacuous = vacuous
    if vacuous_ok:
        record.vacuity.vacuous_ok = vacuous_ok
        return []
    return [f"Parity check {name!r} is vacuous: {vacuous}, so no fault on the target could make it fail. "
            "Give it inputs/weights that reach the output, or allow it with vacuous_ok='<reason>' (check "
            "argument or @pytest.mark.parity)."]


def _streams(expected: Expected, own_stream: bool) -> str:
    """Which random streams the two sample sets of a distribution verdict came from."""
    target_stream = ("its device's own generator (--parity-rng device)" if own_stream
                     else "the shared CPU stream")
    reference_stream = ("its device's own generator" if expected.rng == "device" else "the shared CPU stream")
    reference_stream = (f"a live CPU run from {reference_stream}" if expected.reference == "cpu"
                        else f"a baseline recorded from {reference_stream}")
    return f"target samples from {target_stream}; reference: {reference_stream}"


def measure_distribution(facts: CaseFacts, plan: CheckPlan, sides: Sides, sample_dim: int,
                         own_stream: bool) -> CheckRecord:
    """The record of a sampling check whose sides drew from their own streams: every floating leaf
    as two sample sets along ``sample_dim`` (``distribution.compare_distributions`` under
    ``facts.distribution_policy``). No golden, no self-check perturbation and no first-divergence
    localization: they compare elements."""


    __tracebackhide__ = True
    policy = facts.distribution_policy
    result = compare_distributions(sides.actual, sides.expected.leaves, sample_dim, policy, name=plan.name)
    record = facts.record(plan, sides.expected.reference, status="pass" if result.passed else "fail",
                          result=result, reference_provenance=sides.expected.provenance, audit=sides.audit,
                          weights=sides.weights, distribution_policy=policy)
    streams = _streams(sides.expected, own_stream)
    record.notes.policy_note = "; ".join((f"samples compared as distributions along axis {sample_dim} ({streams})",
                                          *filter(None, sides.notes)))
    return record


def distribution_failure(facts: CaseFacts, record: CheckRecord, expected: Expected, problems: list[str],
                         own_stream: bool) -> str:
    """The message of a failing distribution verdict, its record marked ``fail``."""
    record.status = "fail"
    context = facts.context(expected.reference, expected.provenance)
    return "\n\n".join([record.result.format(context), f"({_streams(expected, own_stream)}.)"] + problems)


def check_golden_precision(name: str, golden: dict, expected: dict) -> None:
    """Raise ``ValueError`` when a given golden leaf is of a coarser floating dtype than the expected one.

    Raises:
        ValueError: naming the check, the leaf and both dtypes.
    """


    __tracebackhide__ = True
    for path, g in golden.items():
        e = expected.get(path)
        if (g is not None and e is not None and g.is_floating_point() and e.is_floating_point()
                and torch.finfo(g.dtype).bits < torch.finfo(e.dtype).bits):
            raise ValueError(f"parity check {name!r}: golden leaf {path or '<output>'!r} is "
                             f"{str(g.dtype).removeprefix('torch.')}, coarser than the expected "
                             f"{str(e.dtype).removeprefix('torch.')}; a golden must be at least as precise")


def given_sides(name: str, actual: Any, expected: Any, golden: Any, golden_policy: Any) -> Sides:
    """The ``Sides`` of outputs the caller computed (``ParityCase.compare``), all moved to the CPU
    as leaves: judged under ``golden_policy`` with ``golden`` when both are given; a golden policy
    without a golden is judged by allclose with a note saying so.

    Raises:
        ValueError: a golden leaf coarser than its expected leaf (``check_golden_precision``).
    """


    __tracebackhide__ = True
    note = None
    if golden_policy is not None and golden is None:
        golden_policy, note = None, "golden unavailable, judged by allclose: parity.compare was given no golden="
    expected_leaves = _to_cpu_leaves(expected)
    if golden_policy is not None:
        golden = _to_cpu_leaves(golden)
        check_golden_precision(name, golden, expected_leaves)
    return Sides(_to_cpu_leaves(actual), Expected(expected_leaves, "given"),
                 golden=golden if golden_policy is not None else None, golden_policy=golden_policy, note=note)


@dataclass(frozen=True)
class LeafVerdict:
    """Leaf by leaf (allclose or golden, ``measure``), with the check's problems (``check_problems``);
    the session's check and failure hooks apply (``hooked``)."""

    hooked: ClassVar[bool] = True

    def measure(self, facts: CaseFacts, plan: CheckPlan, sides: Sides) -> CheckRecord:
        """``measure``."""
        __tracebackhide__ = True
        return measure(facts, plan, sides)

    def problems(self, facts: CaseFacts, plan: CheckPlan, sides: Sides, record: CheckRecord,
                 vacuous_ok: str | None) -> list[str]:
        """``check_problems``."""
        __tracebackhide__ = True
        return check_problems(facts, plan, sides, record, vacuous_ok)

    def failure_message(self, facts: CaseFacts, record: CheckRecord, expected: Expected, problems: list[str]) -> str:
        """``failure_message``."""
        __tracebackhide__ = True
        return failure_message(facts, record, expected, problems)


@dataclass(frozen=True)
class DistributionVerdict:
    """As distributions along ``sample_dim`` (``measure_distribution``), vacuity the only check
    problem; no hooks (they perturb or localize elements). ``own_stream``: the target drew from its
    own device's generator."""

    sample_dim: int
    own_stream: bool
    hooked: ClassVar[bool] = False

    def measure(self, facts: CaseFacts, plan: CheckPlan, sides: Sides) -> CheckRecord:
        """``measure_distribution``."""
        __tracebackhide__ = True
        return measure_distribution(facts, plan, sides, self.sample_dim, self.own_stream)

    def problems(self, facts: CaseFacts, plan: CheckPlan, sides: Sides, record: CheckRecord,
                 vacuous_ok: str | None) -> list[str]:
        """``vacuity_problems`` of the expected samples."""
        __tracebackhide__ = True
        return vacuity_problems(plan.name, sides.expected.leaves, record, vacuous_ok)

    def failure_message(self, facts: CaseFacts, record: CheckRecord, expected: Expected, problems: list[str]) -> str:
        """``distribution_failure``."""
        __tracebackhide__ = True
        return distribution_failure(facts, record, expected, problems, self.own_stream)


@dataclass(frozen=True)
class TrajectoryVerdict:
    """As training trajectories (``judge.trajectory.judge_trajectory`` under ``policy``): the mean
    relative loss error against its limit, and where the loss, grad-norm and per-module grad-norm
    curves part. Its problems: a curve that could not be compared, and a constant reference loss
    curve or a learning rate of 0 at every step (vacuous: nothing was trained). Forecast metrics of the trained models, when the loop
    evaluated any, are judged too (``judge.forecast``; ``window_labels`` name the held-out windows, and
    ``drill_down``, a command with ``{window}``, is how to rerun the tensor-level checks on one).
    No hooks (they perturb or localize one step's elements)."""

    policy: TrajectoryPolicy
    window_labels: tuple[str, ...] | None = None
    drill_down: str | None = None
    hooked: ClassVar[bool] = False

    def measure(self, facts: CaseFacts, plan: CheckPlan, sides: Sides) -> CheckRecord:
        """The record of the curves judged; ``notes.policy_note`` gives the steps and the limits."""
        __tracebackhide__ = True
        result = judge_trajectory(sides.actual, sides.expected.leaves, self.policy, self.window_labels)
        record = facts.record(plan, sides.expected.reference, status="pass" if result.passed else "fail",
                              result=result, reference_provenance=sides.expected.provenance, audit=sides.audit,
                              weights=sides.weights, trajectory_policy=self.policy)
        steps = result.curves[0].steps if result.curves else 0
        record.notes.policy_note = "; ".join((f"trajectory of {steps} steps: mean relative loss error "
                                              f"{result.mean_rel_loss_error:.3g} (limit {self.policy.loss_limit:g})",
                                              *filter(None, sides.notes)))
        if result.problems:
            record.notes.check_problem = "; ".join(result.problems)
        return record

    def problems(self, facts: CaseFacts, plan: CheckPlan, sides: Sides, record: CheckRecord,
                 vacuous_ok: str | None) -> list[str]:
        """A constant reference loss curve, unless ``vacuous_ok`` says why it may be."""
        __tracebackhide__ = True
        loss, lr = sides.expected.leaves.get("loss"), sides.expected.leaves.get("lr")
        if vacuous_ok or loss is None:
            return []
        if lr is not None and lr.numel() and not bool(lr.ne(0).any()):
            problem = (f"{plan.name}: the reference's learning rate is 0 at every step: nothing was trained, so "
                       "the curves cannot tell a fault; pass vacuous_ok='why' if this is meant")
        elif loss.numel() >= 2 and not bool((loss != loss[0]).any()):
            problem = (f"{plan.name}: the reference's loss is the same at every step ({float(loss[0]):g}): nothing "
                       "was trained (learning rate 0, frozen parameters?), so the curves cannot tell a fault; "
                       "pass vacuous_ok='why' if this is meant")
        else:
            return []
        record.notes.check_problem = problem
        return [problem]

    def failure_message(self, facts: CaseFacts, record: CheckRecord, expected: Expected, problems: list[str]) -> str:
        """``TrajectoryResult.format`` with the test's context, then the problems; the record marked ``fail``."""
        __tracebackhide__ = True
        record.status = "fail"
        context = facts.context(expected.reference, expected.provenance)
        parts = [record.result.format(context)]
        if record.result.passed:  # failed by a problem alone: say so first, not "Trajectories agree"
            parts.insert(0, f"Trajectory check failed ({context}): " + " ".join(problems))
            problems = []
        forecast = record.result.forecast
        if self.drill_down and forecast is not None and forecast.windows and not forecast.passed:
            parts.append(f"Drill down into the window whose forecast differs most ({forecast.windows[0][0]}):\n  "
                         + self.drill_down.format(window=forecast.windows[0][0]))
        return "\n\n".join(parts + problems)


#: The leaf-by-leaf verdict.
LEAVES = LeafVerdict()


def verdict_for(sample_dim: int | None, own_stream: bool, reference_rng: str) -> LeafVerdict | DistributionVerdict:
    """Which judge applies: as distributions for a sampling check (``sample_dim`` given) whose target
    (``own_stream``) or reference (``reference_rng == "device"``) drew from its own device's
    generator, else ``LEAVES``."""
    if sample_dim is not None and (own_stream or reference_rng == "device"):
        return DistributionVerdict(sample_dim, own_stream)
    return LEAVES

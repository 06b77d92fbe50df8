"""What makes a failing check pass: counterfactual re-runs of its target side and fp32 precision islands.

A localization says where the target first computes something else; it does not say whether fixing
that place is enough, and under a golden verdict (every bf16 and fp16 check) it does not run at all. Here the
check's *target* side is run again with one piece changed and the new outputs are judged by the
check's *own* verdict (``CheckCall.rejudge``: allclose or the golden floor, against the same
expected leaves and the same golden as the original comparison; nothing of the reference side or the
golden is computed again). An unmodified re-run reproduces the check's target outputs bitwise and
its verdict (tests/diagnose/test_counterfactual.py).

Modifications (``modify``), context managers over the target's module, through forward hooks on the
named submodules that survive the copies a run makes (``copy.deepcopy`` keeps hooks):

* ``fp32`` (``fp32_islands``): the submodule runs with autocast off and its 16-bit floating inputs in
  float32;
* ``reference``: the submodule's output replaced by the pristine module's same-named submodule (the
  check's own module, copied before any patch of the re-run edits weights) run on the CPU in float64
  from the target's own inputs of that call, cast back to the target output's dtype and device. The
  attribution records those inputs in one unmodified re-run (``recorded_inputs``), computes the
  references outside the patch set (``reference_runs``: a patched class or function does not reach
  them) and returns them from the suspect's calls in its own re-run (``replaced_outputs``);
  ``reference_outputs`` does it in one run, inside the call's hook.

Counterfactual attribution (``attribution.attribute``): for each suspect — the localization's first
divergence, the op trace's culprit op's module, the patch set as a whole; where nothing is localized
(a golden verdict) the top-level children of the check's module — one re-run with that piece
replaced by its reference behaviour (the patch set: turned off). Where turning the whole patch set
off removes a share of the error or cannot run, and the patch set can turn single patches off (its
context returns an object with ``applied`` and ``suspended(*names)``, as ``aurora.patches.PatchSet``),
the set is bisected down to the patch the error comes from (``attribution.bisect_patches``), each part
turned off with the rest of the set in force. The end-to-end error is the largest
``rerun.leaf_error`` over the leaves that failed (allclose: err/tol; golden: the worst metric ratio
over its limit); the share of it that disappears is ``1 − after / before``: ``root cause`` (the
re-run passes, or share >= ``ROOT_CAUSE_SHARE``), ``contributing`` (>= ``CONTRIBUTING_SHARE``),
``no effect``.

Precision islands (``islands.find_islands``), for a failing check under an autocast recipe (bf16,
fp16): the whole module in float32 first (failing too: precision is not the cause), then a
hierarchical bisection for the smallest set of submodules whose float32 run makes the check pass,
verified by a re-run with exactly the printed fix (``pytest_npu_parity.fp32_islands``).

Under a golden verdict no localization traced the ops; the module suspect found to be the root cause is
then traced in one more re-run (``trace_root_cause``, ``modify.op_traced``: ``op_trace.trace_ops`` on
its calls until one has a culprit op, each from the call's own inputs, in the run's own patch set, recipe
and random stream), so a bf16 failure gets the op table too (the report's ``localization_ops``).

``what_makes_it_pass`` runs both within a deadline and ``rerun.MAX_RERUNS`` re-runs, fills
``record.whatfix`` (``checks.record.CounterfactualOutcome``: report columns ``counterfactual``,
``fp32_islands``, ``counterfactual_s``) and returns the failure message's section. The session's
``localize.Localizer`` calls it after the localization (allclose) or instead of it (golden verdict).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any

from .attribution import (CONTRIBUTING_SHARE, MAX_CHILD_SUSPECTS, ROOT_CAUSE_SHARE, Attribution,  # noqa: F401
                          Suspect, attribute, child_suspects, module_suspect)
from .islands import IslandSearch, find_islands
from .modify import fp32_islands, op_traced, pristine_float64, reference_outputs, reference_stream  # noqa: F401
from .rerun import MAX_RERUNS, Outcome, Rerunner, Spent, end_to_end_error, failing_paths, leaf_error  # noqa: F401

__all__ = ["WhatMakesItPass", "what_makes_it_pass", "fp32_islands", "reference_outputs", "Rerunner",
           "attribute", "find_islands", "Suspect"]


@dataclass
class WhatMakesItPass:
    """The outcome of ``what_makes_it_pass``: the ``attributions`` (``attribution.Attribution``), the
    ``islands`` search (``islands.IslandSearch``, or None where not run), the check's own error
    ``before``, the re-runs made and their seconds, ``stopped`` (the budget ran out) and ``train_step``
    (the check is a training step: only forward values are replaced, ``format`` says so)."""

    before: float
    measure: str
    attributions: list[Attribution] = field(default_factory=list)
    islands: IslandSearch | None = None
    runs: int = 0
    seconds: float = 0.0
    stopped: bool = False
    train_step: bool = False
    op_trace: Any = None
    op_trace_note: str | None = None
    op_stream: Any = None
    op_trace_of: str = "the root cause"  # or "the check's module" (no module suspect is the root cause)

    def to_rows(self) -> list[dict[str, Any]]:
        """The report's ``counterfactual`` rows: attributions, then the island search's re-runs."""
        rows = [a.to_row() for a in self.attributions]
        return rows + (self.islands.to_rows() if self.islands is not None else [])

    def format(self) -> str:
        """The failure message's section."""
        lines = [f"What makes it pass ({self.runs} re-run(s) of the target, {self.seconds:.2g} s, each judged by the "
                 f"check's own verdict; error: {self.measure}, {_fmt(self.before)} in the check):"]
        if self.train_step:
            lines.append("  (a training step: a suspect's forward values are replaced, its backward stays the target's, "
                         "so a fault in a backward is not removed here and NO EFFECT does not clear it; the backward "
                         "table names the layer whose backward differs: rerun with --parity-policy allclose)")
        ranked = sorted(self.attributions, key=lambda a: (-a.share if math.isfinite(a.share) else 0.0))
        split = [a for a in ranked if a.split]
        for a in (a for a in ranked if not a.split):
            if a.outcome.problem is not None:
                lines.append(f"  {a.suspect.label()} {_replaced(a)}: not run ({a.outcome.problem})")
                continue
            lines.append(f"  {a.suspect.label()} {_replaced(a)}: error {_fmt(a.before)} -> "
                         f"{_fmt(a.outcome.error)} ({a.share:.0%} removed{_passes(a.outcome)}): "
                         f"{a.verdict.upper()}  [{a.suspect.why}]")
        if split:
            lines.append(f"  ({len(split)} group(s) of patches turned off on the way to single patches: in the report's "
                         "counterfactual rows)")
        if not self.attributions:
            lines.append("  (no suspect re-run: budget spent)")
        if self.op_trace is not None:
            lines.append(f"Op trace of {self.op_trace_of} (one more re-run, the ops of its calls compared with "
                         "their float64 golden):")
            lines += ["  " + line for line in self.op_trace.format().splitlines()]
            if self.op_stream is not None:
                lines.append("  " + self.op_stream.summary())
        elif self.op_trace_note:
            lines.append(f"(No op trace of the root cause: {self.op_trace_note}.)")
        lines += self._island_lines()
        if self.stopped:
            lines.append("  (the re-run budget ran out: later suspects or finer islands were not tried)")
        return "\n".join(lines)

    def _island_lines(self) -> list[str]:
        found = self.islands
        if found is None:
            return []
        if found.status == "not applicable":
            return [f"Precision islands: not applicable ({found.why})."]
        if found.status == "budget":
            return ["Precision islands: not searched (budget spent)."]
        if found.status == "not precision":
            return ["Precision islands: even the whole module in float32 fails this check, so precision is not the "
                    "cause."]
        names = ", ".join(n or "<the whole module>" for n in found.islands)
        if found.status == "unverified":
            return [f"Precision islands: {names} in float32 — NOT verified (the re-run with exactly this fix did not "
                    "pass)."]
        fix = "\n".join("    " + line for line in found.fix().splitlines())
        return [f"Precision islands: the check passes with {names} in float32 ({len(found.tried)} re-run(s); "
                "verified by a re-run with exactly this fix). Fix:", fix]


def _fmt(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.3g}"


def _passes(outcome: Any) -> str:
    """``, passes`` for a re-run the check's verdict passes; one whose error is still beyond the limit
    (> 1) passes by what the verdict forgives besides the limit (the golden floor's allclose floor, an
    allclose budget), and says so."""
    if not outcome.passed:
        return ""
    if not outcome.error > 1:
        return ", passes"
    return ", passes: beyond the limit, within the verdict's allclose floor or budget"


def _replaced(a: Attribution) -> str:
    from .attribution import REPLACED_BY

    if a.suspect.kind == "patches":
        return "turned off, the rest of the patch set in force"
    return f"replaced by {REPLACED_BY[a.suspect.kind]}"


def suspects_for(case: Any, record: Any, call: Any, localization: Any = None) -> list[Suspect]:
    """The suspects of a failing check: the localization's first divergence and the module of its op
    trace's culprit op (each once), else the check's module's top-level children
    (``attribution.child_suspects``); then the patch set, when the case has one."""
    module = call.module
    out: list[Suspect] = []
    prefix = getattr(record, "submodule", None)
    if localization is not None:
        first = getattr(localization, "first", None)
        if first is not None:
            out.append(module_suspect(module, first.path, "first divergence", prefix))
        trace = getattr(localization, "op_trace", None)
        op = getattr(trace, "first", None) if trace is not None else None
        if op is not None:
            out.append(module_suspect(module, op.module, f"module of the culprit op {op.op}", prefix))
    merged: list[Suspect] = []
    for suspect in (s for s in out if s is not None):  # one suspect per module, its reasons joined
        same = next((i for i, t in enumerate(merged) if t.name == suspect.name), None)
        if same is None:
            merged.append(suspect)
        else:
            merged[same] = dataclasses.replace(merged[same], why=f"{merged[same].why}; {suspect.why}")
    out = merged
    if not out:
        out = child_suspects(module)
    if getattr(case, "patches", None) is not None:
        out.append(Suspect("patch set", "", "the case's patch set"))
    return out


def what_makes_it_pass(case: Any, record: Any, call: Any, result: Any, *, localization: Any = None,
                       deadline: float | None = None, islands: bool | None = None,
                       max_runs: int = MAX_RERUNS) -> WhatMakesItPass | None:
    """Counterfactual attribution and (for an autocast recipe) the precision-island search of a failing
    check (package doc), within ``deadline`` (``time.perf_counter()``) and ``max_runs`` re-runs.

    Args:
        case, record, call, result: as a ``ParitySession`` failure hook gets them.
        localization: the check's ``localize.Localization``, or None (then the top-level children are
            the suspects).
        islands: search precision islands (default: under an autocast recipe, ``recipe.autocast_dtype``).

    Returns:
        The outcome (also written to ``record.whatfix``), or None where the check cannot be re-run
        (a function, no ``call.rejudge``).
    """
    if call is None or call.module is None or getattr(call, "rejudge", None) is None:
        return None
    start = time.perf_counter()
    paths = failing_paths(result)
    measure = ("worst metric ratio / its limit over the failing leaves" if getattr(record, "golden_policy", None)
               is not None else "worst err/tol over the failing leaves")
    runner = Rerunner(case, call, paths, deadline=deadline, max_runs=max_runs)
    out = WhatMakesItPass(end_to_end_error(result, paths), measure, train_step=call.kind == "train_step")
    out.attributions = attribute(runner, suspects_for(case, record, call, localization), result)
    if getattr(localization, "op_trace", None) is None:
        out.op_trace, out.op_trace_note, out.op_stream = trace_root_cause(runner, out.attributions,
                                                                          getattr(record, "submodule", None))
        if root_module(out.attributions) is None:
            out.op_trace_of = "the check's module"
    if islands is None:
        islands = getattr(case.recipe, "autocast_dtype", None) is not None
    if islands:
        out.islands = find_islands(runner, case.recipe)
    out.runs, out.seconds = runner.runs, time.perf_counter() - start
    out.stopped = not runner.left() or bool(out.islands is not None and out.islands.stopped)
    localized = getattr(record, "localized", None)
    if out.op_trace is not None and localized is not None and getattr(localized, "localization_ops", None) is None:
        localized.localization_ops = out.op_trace.to_rows() + (out.op_stream.to_rows() if out.op_stream else [])
    whatfix = getattr(record, "whatfix", None)
    if whatfix is not None:
        whatfix.counterfactual = out.to_rows()
        whatfix.counterfactual_s = out.seconds
        if out.islands is not None and out.islands.status == "found":
            whatfix.fp32_islands = ", ".join(out.islands.islands)
    return out


def trace_root_cause(runner: Rerunner, attributions: list, prefix: str | None) -> tuple[Any, str | None, Any]:
    """Where no localization traced the ops (a golden verdict), the op trace (``op_trace.trace_ops``) of the
    module suspect that is the root cause with the largest share: one more re-run of the target with
    ``modify.op_traced`` on it, the trace judged at the recipe's precision. Where no module suspect is the
    root cause (a wrong kernel in every layer, a fault in the module's own code), the check's whole module
    is traced instead (``OpTrace.notes`` says so). The traced call's op stream is aligned with the
    reference's same call (``modify.reference_stream``, ``op_stream.compare_streams``): the program
    difference. Returns ``(OpTrace or None, why not, ProgramDifference or None)``."""
    if not attributions:
        return None, None, None
    best = root_module(attributions)
    name = best.suspect.name if best is not None else ""
    path = ".".join(p for p in (prefix or "", name) if p)
    found: list = []
    calls: list = []
    try:
        outcome = runner.run(functools.partial(op_traced, name=name, found=found, calls=calls,
                                               device=runner.case.target, recipe=runner.case.recipe, path=path,
                                               deadline=runner.deadline))
    except Spent:
        return None, "the re-run budget is spent", None
    if not found:
        return None, (f"its traced re-run raised ({outcome.problem})" if outcome.problem else
                      f"{path or 'the module'} was not called in the re-run"), None
    trace = _culprit_call(found, path)
    if best is None:
        trace.notes.append("no module suspect is the root cause on its own, so the check's whole module "
                           "was traced")
    return trace, None, _program_difference(runner, name, path, next((c for c in calls if c.trace is trace), None),
                                            trace)


def root_module(attributions: list) -> Any:
    """The module suspect attributed as root cause with the largest share, or None."""
    roots = [a for a in attributions if a.suspect.kind == "module" and a.verdict == "root cause"]
    return max(roots, key=lambda a: a.share if math.isfinite(a.share) else 1.0) if roots else None


def _program_difference(runner: Rerunner, name: str, path: str, call: Any, trace: Any) -> Any:
    """The reference's op stream of the traced call aligned with the target's, or None (a note on ``trace``)."""
    from ..op_stream import compare_streams

    if call is None or call.stream is None or call.stream.failed is not None:
        trace.notes.append("no program difference: the target's op stream was not recorded")
        return None
    module = runner.call.module
    try:
        sub = module.get_submodule(name) if name else module
        reference = reference_stream(sub, call, runner.case.recipe, path,
                                     getattr(runner.case, "reference_patches", None))
    except Exception as exc:  # noqa: BLE001 - the op trace stands without it
        trace.notes.append(f"no program difference: the reference's run of the same call raised "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        return None
    if reference.failed is not None:
        trace.notes.append(f"no program difference: recording the reference's op stream failed ({reference.failed})")
        return None
    return compare_streams(reference, call.stream)


def _culprit_call(traces: list, path: str) -> Any:
    """Of the traces of one module's calls (call order), the first with a culprit op, else the first.
    Where several calls were traced, the trace is named as the localization names calls (``path#k``,
    from 0) and a note says how many were traced."""
    index = next((i for i, t in enumerate(traces) if t.first is not None), 0)
    trace = traces[index]
    if len(traces) > 1:
        trace.module = f"{path or trace.module}#{index}"
        trace.notes.append(f"{len(traces)} calls of {path or 'the module'} traced; "
                           + (f"the first culprit op is in call #{index}, the calls before it are within their budgets"
                              if trace.first is not None else "no call has a culprit op"))
    return trace

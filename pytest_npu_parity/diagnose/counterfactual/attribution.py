"""Counterfactual attribution: replace one suspect by its reference behaviour, measure what disappears.

Part of ``pytest_npu_parity.diagnose.counterfactual`` (the package docstring describes the method).
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .modify import called_children, pristine_float64, recorded_inputs, reference_runs, replaced_outputs
from .rerun import Outcome, Rerunner, Spent, end_to_end_error, patch_names, share_removed

#: Share of the end-to-end error that must disappear for a suspect to be the root cause (a re-run
#: that passes is the root cause whatever its share). Measured on the planted faults of
#: tests/diagnose/test_counterfactual.py (2-core CPU, torch 2.14.1): the faulty piece replaced by its
#: reference removed 0.9995 (fp32 scaled Linear, allclose), 0.9998 (tiny Llama down_proj x 1.01),
#: 0.9986 (the bf16 fragile moments module, golden verdict) of the error, and 0.815 while passing
#: (a bf16 head weight x 1.5); a train step's scaled block, whose fault also acts in the backward that
#: a forward replacement keeps, 0.25 on that CPU (AMD EPYC, AVX512-BF16), 0.15 on an Intel Xeon with AMX
#: and -0.01 on ATen's default kernels with oneDNN at AVX2: there the largest error left is the upstream
#: gradients', which no forward replacement removes (the report says "no effect" does not clear it).
ROOT_CAUSE_SHARE = 0.9
#: Share from which a suspect is said to contribute (between this and ``ROOT_CAUSE_SHARE``); below
#: it, "no effect". In the same measurements the pieces without a fault removed between -0.57 (the
#: error grew: a float64 block before a fragile one) and 0.017: about ten times that is 0.2.
CONTRIBUTING_SHARE = 0.2
#: Top-level children attributed where nothing was localized (a golden verdict), at most.
MAX_CHILD_SUSPECTS = 8

#: What each kind of suspect is replaced by.
REPLACED_BY = {"module": "its float64 CPU reference", "patch set": "the target run without its patch set",
               "patches": "the target run with it turned off, the rest of the patch set in force"}
#: Verdicts of a group of patches turned off that send the bisection into its halves: it removed a share
#: of the error, or the target cannot run without it (a needed patch hides a faulty one in its group).
_DRILL = ("root cause", "contributing", "not run")


@dataclass(frozen=True)
class Suspect:
    """A piece of the target's computation to replace: a submodule (``kind="module"``, ``name`` its
    qualified name in the check's module, ``""`` the module itself), the whole patch set
    (``kind="patch set"``) or some patches of it (``kind="patches"``, ``name`` their names joined by
    ``", "``); ``why`` says where the suspicion came from."""

    kind: str
    name: str
    why: str
    module_type: str = ""

    def label(self) -> str:
        """``blocks.2.b (Linear)``, ``the patch set``."""
        if self.kind == "patch set":
            return "the patch set"
        if self.kind == "patches":
            return f"patch{'es' if ', ' in self.name else ''} {self.name}"
        return f"{self.name or '<module>'} ({self.module_type})" if self.module_type else (self.name or "<module>")


@dataclass
class Attribution:
    """One suspect's counterfactual re-run: its ``outcome`` (``rerun.Outcome``), the error ``before``
    (the check's own), the ``share`` of it that disappeared and the ``verdict``: ``root cause``,
    ``contributing``, ``no effect`` or ``not run`` (the re-run raised: ``outcome.problem``)."""

    suspect: Suspect
    outcome: Outcome
    before: float
    share: float
    verdict: str
    split: bool = False  # a group of patches that the bisection split further (its halves follow)

    def to_row(self) -> dict[str, Any]:
        """A JSON-able row (the report's ``counterfactual`` entries)."""
        return {"kind": "counterfactual", "suspect": self.suspect.label(), "suspect_kind": self.suspect.kind,
                "submodule": self.suspect.name if self.suspect.kind == "module" else None,
                "patches": self.suspect.name.split(", ") if self.suspect.kind == "patches" else None,
                "why": self.suspect.why, "replaced_by": REPLACED_BY[self.suspect.kind],
                "error_before": _num(self.before), "error_after": _num(self.outcome.error),
                "share": _num(self.share), "passed": self.outcome.passed, "verdict": self.verdict,
                "seconds": self.outcome.seconds, "problem": self.outcome.problem, "split": self.split}


def _num(value: float) -> float | None:
    return None if value is None or math.isnan(value) else (value if math.isfinite(value) else str(value))


def classify(outcome: Outcome, share: float) -> str:
    """``root cause`` (the re-run passes, or ``share >= ROOT_CAUSE_SHARE``), ``contributing``
    (``share >= CONTRIBUTING_SHARE``), ``no effect``; ``not run`` where the re-run raised."""
    if outcome.problem is not None:
        return "not run"
    if outcome.passed or share >= ROOT_CAUSE_SHARE:
        return "root cause"
    return "contributing" if share >= CONTRIBUTING_SHARE else "no effect"


def module_suspect(module: torch.nn.Module, path: str, why: str, prefix: str | None = None) -> Suspect | None:
    """A module suspect for a display path of the localization (``blocks.2.b#1``, ``<Net>``,
    ``encoder.blocks.0`` under a check ``submodule`` prefix ``encoder``): the call index and the prefix
    dropped, the root as ``""``; None when the path names no submodule of ``module``."""
    name = re.sub(r"#\d+$", "", path or "")
    if prefix and (name == prefix or name.startswith(prefix + ".")):
        name = name[len(prefix) + 1:] if name != prefix else ""
    if name.startswith("<"):
        name = ""
    try:
        sub = module.get_submodule(name) if name else module
    except AttributeError:
        return None
    return Suspect("module", name, why, type(sub).__name__)


def child_suspects(module: torch.nn.Module, limit: int = MAX_CHILD_SUSPECTS) -> list[Suspect]:
    """The top-level children of ``module`` (``modify.called_children``: a ``ModuleList``'s items in
    its place), parameter-free ones included (a fragile computation needs no weights), in
    registration order, at most ``limit``. Each costs one re-run, and the cheapest ranking is none:
    all are measured and the message sorts them by the share of the error they remove."""
    return [Suspect("module", name, "top-level child of the check's module", type(child).__name__)
            for name, child in called_children(module)[:limit]]


def measured_paths(runner: Rerunner, suspect: Suspect) -> list[str]:
    """The failing leaves a suspect's replacement is measured on: all of them, except in a train step
    the leaves of the replaced module's own state (``grad.<name>.…``, ``param.<name>.…``,
    ``buffer.<name>.…``; every such leaf for the check's module itself): replacing a module's
    *output* cannot change its own weights, their gradients or its buffers, so a scaled weight would
    otherwise never be found. Where that leaves none, all of them."""
    if runner.call.kind != "train_step" or suspect.kind != "module":
        return runner.paths
    own = tuple(f"{kind}.{suspect.name}." if suspect.name else f"{kind}." for kind in ("grad", "param", "buffer"))
    kept = [p for p in runner.paths if not p.startswith(own)]
    return kept or runner.paths


def attribute(runner: Rerunner, suspects: list[Suspect], result: Any) -> list[Attribution]:
    """Re-run the check's target once per suspect with that suspect replaced by its reference
    behaviour and classify the share of the check's own end-to-end error (in ``result``, the check's
    comparison) that disappears, both measured on ``measured_paths``.

    A module suspect's reference behaviour is its pristine submodule (a float64 CPU copy of the
    check's module's same-named submodule, taken here, outside any run) on the inputs the target gave
    that submodule: one unmodified re-run first records the inputs of every module suspect's calls
    (``modify.recorded_inputs``); the references are computed from them outside the patch set
    (``modify.reference_runs``: a patch of the submodule's class or of a function it calls does not
    reach them), and each suspect's re-run returns them in place of its calls' outputs
    (``modify.replaced_outputs``; a call the recording did not see keeps its own). The patch set's
    re-run is the target without it; where that removes a share of the error (or the target cannot run
    without it) and the patch set can turn single patches off (``rerun.patch_names``), ``bisect_patches``
    names the patch. Stops quietly when the runner's budget is spent (the suspects not run are left
    out)."""
    out: list[Attribution] = []
    module = runner.call.module
    names = [s.name for s in suspects if s.kind == "module"]
    calls: dict[str, list] = {}
    if names:
        try:
            runner.run(partial(_recording, names=names, store=calls))
        except Spent:
            return out
    for suspect in suspects:
        try:
            if suspect.kind == "patch set":
                outcome = runner.run(None, patched=False)
            else:
                try:
                    with _reference_patches(runner.case):
                        refs = reference_runs(pristine_float64(module, suspect.name), calls.get(suspect.name, []))
                except Exception as exc:  # noqa: BLE001 - e.g. upstream code that cannot run in float64
                    problem = f"its float64 CPU reference raised {type(exc).__name__}: {str(exc).splitlines()[0]}"
                    out.append(Attribution(suspect, Outcome(False, math.inf, 0.0, problem), math.nan, math.nan,
                                           "not run"))
                    continue
                outcome = runner.run(partial(_replacing, name=suspect.name, outputs=refs))
        except Spent:
            break
        out.append(_attributed(runner, suspect, outcome, result))
        if suspect.kind == "patch set" and out[-1].verdict in _DRILL:
            try:
                bisect_patches(runner, patch_names(runner.case), result, out)
            except Spent:
                break
    return out


def _reference_patches(case: Any) -> Any:
    """The case's reference patches on the CPU (what the reference needs to run at all), or nothing."""
    factory = getattr(case, "reference_patches", None)
    return factory(torch.device("cpu")) if factory is not None else contextlib.nullcontext()


def _attributed(runner: Rerunner, suspect: Suspect, outcome: Outcome, result: Any) -> Attribution:
    paths = measured_paths(runner, suspect)
    before = end_to_end_error(result, paths)
    if outcome.result is not None:
        outcome.error = end_to_end_error(outcome.result, paths)
    share = share_removed(before, outcome.error)
    return Attribution(suspect, outcome, before, share, classify(outcome, share))


def bisect_patches(runner: Rerunner, names: list[str], result: Any, out: list[Attribution]) -> None:
    """Which patches of the patch set the error comes from: the patches ``names`` are split in halves,
    each half turned off (the rest of the set in force: ``Rerunner.run(suspended=...)``) and attributed
    like any suspect; a half that removes a share of the error, or without which the target does not
    run, is split again (``Attribution.split``), down to single patches. One faulty patch among ``n`` costs about
    ``2·log2(n)`` re-runs; every attribution is appended to ``out``.

    Raises:
        Spent: the runner's budget ran out (the attributions made so far are in ``out``).
    """
    if len(names) < 2:
        return
    half = (len(names) + 1) // 2
    for group in (names[:half], names[half:]):
        suspect = Suspect("patches", ", ".join(group), "one patch of the patch set" if len(group) == 1 else
                          "part of the patch set")
        attribution = _attributed(runner, suspect, runner.run(None, suspended=tuple(group)), result)
        out.append(attribution)
        if attribution.verdict in _DRILL and len(group) > 1:
            attribution.split = True
            bisect_patches(runner, group, result, out)


def _recording(module: torch.nn.Module, names: list[str], store: dict) -> Any:
    return recorded_inputs(module, names, store)


def _replacing(module: torch.nn.Module, name: str, outputs: list) -> Any:
    return replaced_outputs(module, name, outputs)

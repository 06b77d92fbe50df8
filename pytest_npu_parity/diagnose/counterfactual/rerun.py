"""Re-running a failing check's target side with a modification, judged by the check's own verdict.

Part of ``pytest_npu_parity.diagnose.counterfactual`` (the package docstring describes the method).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch

from ...runtime.side import patches_suspended

#: Re-runs one failing check may make for its counterfactual attribution and island search together.
MAX_RERUNS = 40


def leaf_error(leaf: Any) -> float:
    """One leaf's error in units of its verdict's limit (> 1: beyond it, as the verdict sees it).

    Allclose: ``err_ratio`` (max |actual − expected| / (atol + rtol·|expected|)). Golden verdict
    (``golden.GoldenLeafResult``): the largest ratio / its policy limit over the judged metrics
    (``rmse``, ``max_rel``, ``mean_rel``, ``small_share``, and ``max_abs`` under our limit set). A leaf
    with a structural problem (missing, shape or dtype) or a NaN measure: ``inf``."""
    if getattr(leaf, "problem", None) is not None:
        return math.inf
    policy = getattr(leaf, "policy", None)
    ratios = getattr(leaf, "ratios", None)
    if policy is not None and ratios:
        limits = policy.limits
        worst = 0.0
        for metric, value in ratios.items():
            if metric in limits:
                part = float(value) / float(limits[metric])
                worst = max(worst, math.inf if math.isnan(part) else part)
        return worst
    value = float(getattr(leaf, "err_ratio", math.nan))
    return math.inf if math.isnan(value) else value


def end_to_end_error(result: Any, paths: list[str]) -> float:
    """The check's end-to-end error: the largest ``leaf_error`` over the leaves ``paths`` (the leaves
    that failed in the check's own comparison); ``inf`` when one of them is absent from ``result``."""
    by_path = {leaf.path: leaf for leaf in getattr(result, "leaves", [])}
    worst = 0.0
    for path in paths:
        leaf = by_path.get(path)
        worst = max(worst, math.inf if leaf is None else leaf_error(leaf))
    return worst


def failing_paths(result: Any) -> list[str]:
    """The paths of ``result``'s failing leaves (every leaf's when none fails on its own)."""
    leaves = list(getattr(result, "leaves", []))
    failing = [leaf.path for leaf in leaves if not leaf.passed]
    return failing or [leaf.path for leaf in leaves]


def share_removed(before: float, after: float) -> float:
    """``1 − after / before``: the share of the end-to-end error that disappears (1: all of it, 0: none,
    negative: the error grew). ``before`` infinite (NaN/Inf or structural): 1 when ``after`` is
    finite, else 0."""
    if math.isinf(before):
        return 1.0 if math.isfinite(after) else 0.0
    if before <= 0:
        return 0.0
    return 1.0 - after / before


class Spent(Exception):
    """The re-run budget (count or deadline) is spent."""


@dataclass
class Outcome:
    """One re-run: ``passed`` by the check's verdict, its ``error`` (``end_to_end_error``), ``seconds``,
    and ``problem`` (the re-run raised: its exception as text; ``passed`` False, ``error`` inf)."""

    passed: bool
    error: float
    seconds: float
    problem: str | None = None
    result: Any = None


@dataclass
class Rerunner:
    """Runs the target side of a failing check again under modifications and judges each run by the
    check's own verdict (``CheckCall.rejudge``).

    Args:
        case: the check's ``runner.ParityCase`` (target device, recipe, patch set, session).
        call: the check's ``runtime.side.CheckCall`` (its ``rerun`` and ``rejudge``).
        paths: the leaves whose error is measured (``failing_paths`` of the check's result).
        deadline: ``time.perf_counter()`` value after which no re-run starts, or None.
        max_runs: re-runs allowed (``MAX_RERUNS``).

    Attributes:
        runs, seconds: re-runs made and their wall seconds.
    """

    case: Any
    call: Any
    paths: list[str]
    deadline: float | None = None
    max_runs: int = MAX_RERUNS
    runs: int = 0
    seconds: float = 0.0
    targets: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.targets = target_modules(self.case, self.call)

    def left(self) -> bool:
        """Whether another re-run may start (count and deadline)."""
        return self.runs < self.max_runs and (self.deadline is None or time.perf_counter() < self.deadline)

    def run(self, modification: Callable[[torch.nn.Module], ContextManager[Any]] | None,
            patched: bool = True, suspended: tuple[str, ...] = ()) -> Outcome:
        """One re-run of the whole check's target side (``patched``: under the case's patch set, less
        the patches ``suspended``: ``runtime.side.patches_suspended``) with ``modification(m)`` entered
        for each module the target may run (``target_modules``), judged by ``call.rejudge``.

        Raises:
            Spent: no re-run is left (``left``).
        """
        if not self.left():
            raise Spent()
        self.runs += 1
        start = time.perf_counter()
        try:
            with _entered(self.targets, modification), patches_suspended(suspended):
                leaves = self.call.rerun(self.case.target, patched, self.call.args, self.call.kwargs)
            result = self.call.rejudge(leaves)
        except Exception as exc:  # noqa: BLE001 - a modified run that raises is an outcome, not an error
            elapsed = time.perf_counter() - start
            self.seconds += elapsed
            return Outcome(False, math.inf, elapsed, f"{type(exc).__name__}: {exc}")
        elapsed = time.perf_counter() - start
        self.seconds += elapsed
        return Outcome(bool(result.passed), end_to_end_error(result, self.paths), elapsed, result=result)


@contextlib.contextmanager
def _entered(modules: list, modification: Callable[[torch.nn.Module], ContextManager[Any]] | None) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if modification is not None:
            for module in modules:
                stack.enter_context(modification(module))
        yield


def target_modules(case: Any, call: Any) -> list[torch.nn.Module]:
    """The module objects a target re-run of ``call`` computes with or copies from: the check's own
    module (a train step and a module in training mode copy it inside the run, hooks included), and
    for an eval module the session's placed copy on the target (``ParitySession.place``: the module
    itself on a CPU target in its own dtype, else a cached copy). Placing here also makes the cached
    copy exist before a modification registers hooks, so no copy with hooks is ever cached."""
    module = call.module
    if module is None:
        return []
    modules = [module]
    if call.kind == "check" and not any(m.training for m in module.modules()):
        placed = case.session.place(module, case.target, case.recipe.weights_dtype)
        if placed is not module:
            modules.append(placed)
    return modules


def patch_names(case: Any) -> list[str]:
    """The names of the patches in ``case``'s patch set that can be turned off one by one: the patch
    context is entered once on the target (nothing runs in it) and must return an object with
    ``applied`` (names) and ``suspended(*names)`` (``aurora.patches.PatchSet``); [] for any other
    patch set, none, or one whose entry raises."""
    factory = getattr(case, "patches", None)
    if factory is None:
        return []
    try:
        with factory(case.target) as applied:
            names = list(getattr(applied, "applied", None) or [])
            return names if callable(getattr(applied, "suspended", None)) else []
    except Exception:  # noqa: BLE001 - a patch set that cannot be entered alone is attributed as a whole
        return []

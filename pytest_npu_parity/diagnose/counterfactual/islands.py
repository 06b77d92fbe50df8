"""Precision islands: the smallest set of submodules that must run in float32 for a 16-bit check to pass.

Part of ``pytest_npu_parity.diagnose.counterfactual`` (the package docstring describes the search).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from .modify import called_children, fp32_islands, sixteen_bit_parameters
from .rerun import Outcome, Rerunner, Spent


@dataclass
class IslandSearch:
    """The outcome of ``find_islands``.

    Attributes:
        status: ``found`` (``islands`` verified by a re-run with exactly that fix), ``unverified``
            (the verification re-run failed or could not run), ``not precision`` (even the whole
            module in float32 fails: precision is not the cause), ``not applicable`` (``why``) or
            ``budget`` (spent before the whole-module run).
        islands: the qualified names (``""``: the whole module), or [].
        tried: ``(names, Outcome)`` of each re-run, in order (the verification last).
        why: for ``not applicable``.
        stopped: the budget ran out during the search (the islands are then coarser than they could be).
    """

    status: str
    islands: list[str] = field(default_factory=list)
    tried: list[tuple[tuple[str, ...], Outcome]] = field(default_factory=list)
    why: str | None = None
    stopped: bool = False

    def fix(self) -> str:
        """The ready-to-paste fix: a ``with`` block around the model's forward."""
        names = ", ".join(f'"{n}"' for n in self.islands)
        return f"with pytest_npu_parity.fp32_islands(model, [{names}]):\n    output = model(...)"

    def to_rows(self) -> list[dict[str, Any]]:
        """One JSON-able row per re-run (the report's ``counterfactual`` entries, kind ``fp32 island``)."""
        return [{"kind": "fp32 island", "suspect": ", ".join(n or "<module>" for n in names),
                 "submodules": list(names), "replaced_by": "float32 (autocast off, inputs upcast)",
                 "error_after": outcome.error if outcome.error != float("inf") else "inf",
                 "passed": outcome.passed, "seconds": outcome.seconds, "problem": outcome.problem,
                 "verdict": "verified fix" if i == len(self.tried) - 1 and self.status == "found" else None}
                for i, (names, outcome) in enumerate(self.tried)]


class _Search:
    """The re-runs of one island search, memoized by the set of names."""

    def __init__(self, runner: Rerunner, module: torch.nn.Module, out: IslandSearch):
        self.runner, self.module, self.out = runner, module, out
        self.memo: dict[frozenset, bool | None] = {}

    def passes(self, names: list[str]) -> bool | None:
        """Whether the check passes with ``names`` in float32; None once the budget is spent."""
        key = frozenset(names)
        if key not in self.memo:
            try:
                outcome = self.runner.run(partial(_fp32, names=sorted(key)))
            except Spent:
                self.out.stopped = True
                return None
            self.out.tried.append((tuple(sorted(key)), outcome))
            self.memo[key] = outcome.passed
        return self.memo[key]

    def children(self, name: str) -> list[str]:
        return [full for full, _ in called_children(self.module, name)]

    def minimal(self, candidates: list[str], fixed: list[str]) -> list[str]:
        """A minimal subset S of ``candidates`` with ``passes(S + fixed)``, given that all of them
        pass: halve, keep a half that passes alone, else the minimal part of each half with the
        other's kept (bisection, about 2·|S|·log2(|candidates|) re-runs). Out of budget: all."""
        if len(candidates) <= 1:
            return list(candidates)
        half = len(candidates) // 2
        first, second = candidates[:half], candidates[half:]
        for part in (first, second):
            verdict = self.passes(part + fixed)
            if verdict is None:
                return list(candidates)
            if verdict:
                return self.minimal(part, fixed)
        kept_first = self.minimal(first, fixed + second)
        return kept_first + self.minimal(second, fixed + kept_first)

    def refine(self, name: str, others: list[str]) -> list[str]:
        """``name`` (with ``others`` in float32 beside it) narrowed to its children where all of its
        children in float32 are enough (else its own code needs it: ``[name]``), recursively."""
        kids = self.children(name)
        if not kids or not self.passes(kids + others):
            return [name]
        picked = self.minimal(kids, others)
        out: list[str] = []
        for i, kid in enumerate(picked):
            out += self.refine(kid, others + out + picked[i + 1:])
        return out


def _fp32(module: torch.nn.Module, names: list[str]) -> Any:
    return fp32_islands(module, names)


def find_islands(runner: Rerunner, recipe: Any) -> IslandSearch:
    """Search the smallest set of submodules of the check's module that must run in float32
    (``modify.fp32_islands``) for the check to pass, by its own verdict (``runner``).

    First the whole module in float32: if even that fails, precision is not the cause
    (``not precision``). Then hierarchically: the module's children all in float32; if that passes, a
    minimal subset of them by bisection (``_Search.minimal``), and each chosen child is narrowed the
    same way within itself, its siblings' choice kept in float32. A module whose children all in
    float32 are not enough keeps itself (the fragile part is its own code). The result is verified by a
    fresh re-run with exactly that fix. Only for an autocast recipe (``recipe.autocast_dtype``: bf16,
    fp16): under ``bf16-weights`` the weights themselves are 16-bit and ``fp32_islands`` does not upcast
    them (``not applicable``). Bounded by the runner's re-runs and deadline (``stopped``).
    """
    module = runner.call.module
    if module is None:
        return IslandSearch("not applicable", why="the check computes a function, not a module")
    if getattr(recipe, "autocast_dtype", None) is None:
        low = sixteen_bit_parameters(module)
        why = (f"recipe {recipe.name} has 16-bit weights ({len(low)} tensors), which fp32_islands does not upcast"
               if low or recipe.weights_dtype is not None else f"recipe {recipe.name} computes in float32 already")
        return IslandSearch("not applicable", why=why)
    out = IslandSearch("found")
    search = _Search(runner, module, out)
    whole = search.passes([""])
    if whole is None:
        out.status = "budget"
        return out
    if not whole:
        out.status = "not precision"
        return out
    islands = search.refine("", [])
    out.islands = islands
    try:
        verified = runner.run(partial(_fp32, names=islands))
    except Spent:
        out.status, out.stopped = "unverified", True
        return out
    out.tried.append((tuple(islands), verified))
    out.status = "found" if verified.passed else "unverified"
    return out

"""``Localizer``: the session's failure hook, localization within a time budget.

Part of ``pytest_npu_parity.diagnose.localize`` (the package docstring describes the descent).
"""
from __future__ import annotations

import math
import shlex
import time
from collections import Counter
from typing import Any

from ...budgets import DEFAULT_BUDGET_S
from ...judge.allclose import CompareResult
from ..counterfactual import what_makes_it_pass
from .cache import LocalizationCache
from .descent import localize, structural_problem

#: A localization's expected cost in units of its check's own duration (``CheckRecord.duration_s``):
#: two hooked passes, a few local re-runs and smaller passes below (measured on Aurora: 2–3×).
COST_FACTOR = 3.0


class Localizer:
    """The ``ParitySession`` failure hook of a session: localization within a time budget, shared
    across the failing checks (module doc).

    Args:
        budget_s: wall seconds the session may spend localizing (``DEFAULT_BUDGET_S``); None: no
            limit. Localizations answered from the cache cost nothing and run even when it is spent.
        forced: localize every failing check whatever the budget (``--parity-localize``).
        hint: the command that localizes one check despite the budget, with ``{test_id}`` for its
            shell-quoted test id (the plugin gives ``pytest --npu-parity --parity-localize {test_id}``).
        counterfactual: after the localization (allclose) or instead of it (golden verdict), re-run the
            target with suspects replaced by their reference behaviour and, under an autocast recipe,
            search fp32 precision islands (``counterfactual.what_makes_it_pass``), within what is left
            of the same budget; False: localization only (and nothing under a golden verdict).

    Attributes:
        spent_s: wall seconds spent localizing so far; ``cache``: the ``LocalizationCache``;
        localized / reused / skipped: checks localized by running, answered from the cache, and not
            localized (a ``Counter`` by reason: ``budget``, ``structure``).

    Per failing check it sets ``record.localized`` (``checks.record.LocalizationOutcome``):
    ``localization`` (the table, as ``failure_hook``), ``localization_s`` (seconds this check
    spent), ``localization_reused`` (the check whose localization answered it),
    ``localization_skipped`` (``budget`` or ``structure``) and ``localization_stopped`` (``budget``: the descent stopped between levels).
    With ``counterfactual`` it also sets ``record.whatfix`` (``checks.record.CounterfactualOutcome``) where
    the counterfactual ran: after a localization made here (not one answered by an earlier check's,
    nor a structural difference), and under a golden verdict instead of a localization when its
    expected cost (``fits``) fits the budget.

    Raises:
        ValueError: ``budget_s`` negative or not finite.
    """

    def __init__(self, budget_s: float | None = DEFAULT_BUDGET_S, *, forced: bool = False, hint: str | None = None,
                 counterfactual: bool = True):
        if budget_s is not None and not (math.isfinite(budget_s) and budget_s >= 0):
            raise ValueError(f"localization budget {budget_s!r}: give a number of seconds >= 0")
        self.budget_s = budget_s
        self.forced = forced
        self.hint = hint
        self.counterfactual = counterfactual
        self.spent_s = 0.0
        self.cache = LocalizationCache()
        self.localized = 0
        self.reused = 0
        self.skipped: Counter = Counter()
        self._last: Any = None

    @property
    def runs_under_golden(self) -> bool:
        """Whether this hook runs under a golden verdict (``checks.hooks.failure_diagnosis``): with
        ``counterfactual``, which judges its re-runs by the check's own verdict."""
        return self.counterfactual

    @property
    def over_budget(self) -> bool:
        """True once the budget is spent (never when ``forced`` or without a budget)."""
        return not self.forced and self.budget_s is not None and self.spent_s >= self.budget_s

    def fits(self, record: Any) -> bool:
        """Whether a localization of ``record``'s check may start: its expected cost
        (``COST_FACTOR`` × the check's own duration) fits in what is left of the budget."""
        if self.forced or self.budget_s is None:
            return True
        return self.spent_s + COST_FACTOR * float(getattr(record, "duration_s", 0.0) or 0.0) <= self.budget_s

    def __call__(self, case: Any, record: Any, call: Any, result: CompareResult) -> str | None:
        if call.module is None:
            return None
        if record.golden_policy is not None:  # only with counterfactual (runs_under_golden)
            return self._what_makes_it_pass(case, record, call, result, None)
        text = self._localize(case, record, call, result)
        if self.counterfactual and self._last is not None and self._last.levels:  # localized here, not reused
            more = self._what_makes_it_pass(case, record, call, result, self._last)
            text = "\n\n".join(t for t in (text, more) if t) or None
        return text

    def _what_makes_it_pass(self, case: Any, record: Any, call: Any, result: CompareResult,
                            localization: Any) -> str | None:
        """The counterfactual section (``counterfactual.what_makes_it_pass``) within what is left of the
        budget, its seconds added to ``spent_s``; a note where no budget is left."""
        if structural_problem(result) is not None:
            return None
        if self.over_budget or (localization is None and not self.fits(record)):
            return ("(What makes it pass: not run, it does not fit in what is left of the localization budget; "
                    "--parity-localize runs it whatever the budget.)")
        start = time.perf_counter()
        deadline = None if self.forced or self.budget_s is None else start + self.budget_s - self.spent_s
        try:
            found = what_makes_it_pass(case, record, call, result, localization=localization, deadline=deadline)
        finally:
            self.spent_s += time.perf_counter() - start
        return found.format() if found is not None else None

    def _localize(self, case: Any, record: Any, call: Any, result: CompareResult) -> str | None:
        """The first-divergence localization's text (``localize``), or why it did not run; the
        ``Localization`` in ``self._last`` (None where there is none)."""
        self._last = None
        problem = structural_problem(result)
        if problem is not None:
            record.localized.localization_skipped = "structure"
            self.skipped["structure"] += 1
            return (f"(First-divergence localization not run: the outputs differ in structure, shape or dtype "
                    f"({problem}); that difference is the finding, no submodule run would add to it.)")
        over = not self.fits(record)
        start = time.perf_counter()
        deadline = None if self.forced or self.budget_s is None else start + self.budget_s - self.spent_s
        try:
            loc = localize(case, record, call, result, cache=self.cache, deadline=deadline, cached_only=over)
        finally:
            elapsed = time.perf_counter() - start
            self.spent_s += elapsed
            record.localized.localization_s = elapsed
        if loc is None:
            if not over:
                return None
            record.localized.localization_skipped = "budget"
            self.skipped["budget"] += 1
            command = (self.hint.format(test_id=shlex.quote(record.test_id)) if self.hint
                       else "a Localizer with forced=True")
            left = max(0.0, self.budget_s - self.spent_s)
            return (f"(First-divergence localization skipped: it would take about "
                    f"{COST_FACTOR * record.duration_s:.2g} s, more than the {left:.2g} s left of this session's "
                    f"localization budget of {self.budget_s:g} s ({self.spent_s:.2g} s went to earlier failures). "
                    f"To localize this check: {command})")
        self._last = loc
        record.localized.localization = loc.to_rows()
        record.localized.localization_ops = loc.op_rows()
        record.localized.localization_backward = loc.backward_rows()
        if loc.reused_from is not None:
            record.localized.localization_reused = loc.reused_from
        if loc.levels:
            self.localized += 1
        else:
            self.reused += 1
        if loc.stopped is not None:
            record.localized.localization_stopped = loc.stopped
        return loc.format()

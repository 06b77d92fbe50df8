"""What one check was asked to do (``CheckPlan``) and the facts of the test it belongs to (``CaseFacts``).

Both are built by ``runner.ParityCase`` once a check's settings are resolved, and read by the
pieces of its pipeline (``checks.reference``, ``checks.verdict``), which never reach back into the
case.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..judge.tolerance import Tolerance
from ..runtime.recipes import Recipe
from .record import CheckRecord


@dataclass(frozen=True)
class CheckPlan:
    """One check's resolved settings.

    Attributes:
        name: the check's name, unique within the test.
        tolerance: its allclose tolerance (``ParitySession.tolerance``).
        start: ``time.perf_counter()`` when the check began (its records' ``duration_s``).
        submodule, group: as ``ParityCase.check`` takes them (for the report).
        golden_policy: the ``golden.GoldenPolicy`` it is judged by, or None for allclose.
        golden_run: ``() -> golden leaves`` (``golden.GoldenRunner.run``), or None.
        audit_budget: the ``audit.AuditBudget`` of its audited run, or None for the test's.
        train_store: how a recording keeps a training step's leaves (``compact.TrainStore``), or None.
        layer_policy: the ``layers.LayerPolicy`` its layer records are judged by, or None.
        vacuous_ok: why the check may be vacuous, where no ``CheckCall`` carries it (``compare``).
        notes: what the check's note says of its settings (e.g. the layer check is off for a
            compiled module).
    """

    name: str
    tolerance: Tolerance
    start: float
    submodule: str | None = None
    group: str | None = None
    golden_policy: Any = None
    golden_run: Callable[[], dict] | None = None
    audit_budget: Any = None
    train_store: Any = None
    layer_policy: Any = None
    vacuous_ok: str | None = None
    notes: tuple = ()


@dataclass(frozen=True)
class CaseFacts:
    """The facts of the test a check belongs to, as its records and verdicts need them.

    Attributes:
        test_id: the pytest node id.
        recipe: the test's recipe.
        target: the device under test; target_name its name (``devices.device_name``).
        audit_mode: ``off``, ``record``, ``warn`` or ``fail`` (``ParityCase._audit_mode``).
        audit_budget: the test's audit budget (``audit.AuditBudget``).
        distribution_policy: the session's ``distribution.DistributionPolicy``.
    """

    test_id: str
    recipe: Recipe
    target: torch.device
    target_name: str
    audit_mode: str = "off"
    audit_budget: Any = None
    distribution_policy: Any = None

    def record(self, plan: CheckPlan, reference: str, **fields: Any) -> CheckRecord:
        """A ``CheckRecord`` of ``plan``'s check against ``reference``, its duration measured now."""
        return CheckRecord(self.test_id, plan.name, self.recipe.name, str(self.target), self.target_name,
                           reference, plan.tolerance, submodule=plan.submodule, group=plan.group,
                           duration_s=time.perf_counter() - plan.start, **fields)

    def context(self, reference: str, provenance: str | None) -> str:
        """``"recipe <r>, target <t> (<name>) vs <reference>"`` for a failure message."""
        ref_text = {"cpu": "a live CPU run", "given": "the given expected output"}.get(
            reference, f"baseline {provenance}")
        return f"recipe {self.recipe.name}, target {self.target} ({self.target_name}) vs {ref_text}"


def check_name(name: str, records: list[CheckRecord], test_id: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a new check name of test ``test_id`` (its ``records`` so
    far): non-empty, without ``/``, used by no record."""
    if not name or "/" in name:
        raise ValueError(f"check name {name!r} must be non-empty and contain no '/'")
    if any(r.check == name for r in records):
        raise ValueError(f"check name {name!r} is used twice in {test_id}; names must be unique per test")

"""What one check produced (``CheckRecord``), as typed fields, and the report rows made from it.

A record is filled along a check's pipeline: the reference (a baseline problem), the verdict (the
comparison's result, vacuity, layer and audit verdicts, notes), and the diagnosis hooks
(``selfcheck.SelfCheck``: teeth; ``localize.Localizer``: first-divergence localization). Each of
those writes its own small dataclass. The field names of those dataclasses are the report's column
names (``rows``); ``CheckRecord.extra`` is a read-only mapping of the fields that are set, under
those names, for code that reads the record by key (tests, scripts).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from ..judge.allclose import CompareResult
from ..judge.tolerance import Tolerance


def _set_items(outcome: Any) -> Iterator[tuple[str, Any]]:
    """``(field name, value)`` of every field of the dataclass ``outcome`` that is not None."""
    for f in fields(outcome):
        value = getattr(outcome, f.name)
        if value is not None:
            yield f.name, value


@dataclass
class CheckNotes:
    """Texts about how a check was judged.

    Attributes:
        policy_note: how the verdict was reached when it is not the plain one (golden unavailable,
            optimizer replay, compact leaves, distributions, layer check not run), or None.
        check_problem: why a check failed as a whole with every leaf within tolerance (vacuous, no
            teeth, a layer or the audit beyond its limit), or None.
        torch_mismatch: the note that the baseline was recorded with another torch release
            (``checks.reference.torch_version_mismatch``), or None.
    """

    policy_note: str | None = None
    check_problem: str | None = None
    torch_mismatch: str | None = None


@dataclass
class BaselineProblem:
    """Why a check's baseline could not be used (its record has status ``error``).

    Attributes:
        baseline_error: ``missing``, ``stale``, ``corrupt``, ``unsafe`` or ``unreadable``.
        baseline_file: the baseline file, or None when the error names none.
        stale_cause: what a stale entry's fingerprints say changed (``checks.reference.stale_cause``),
            or None.
    """

    baseline_error: str
    baseline_file: str | None = None
    stale_cause: str | None = None

    def columns(self) -> dict[str, Any]:
        """The row columns: ``baseline_error`` and ``baseline_file`` always, ``stale_cause`` when known."""
        columns = {"baseline_error": self.baseline_error, "baseline_file": self.baseline_file}
        if self.stale_cause:
            columns["stale_cause"] = self.stale_cause
        return columns


@dataclass
class VacuityOutcome:
    """Whether the check could fail at all (``selfcheck.vacuity_problem``, or the self-check's input test).

    Attributes:
        vacuous: why the reference output cannot reveal a fault, or None.
        vacuous_ok: the reason the check may be vacuous anyway, or None.
    """

    vacuous: str | None = None
    vacuous_ok: str | None = None


@dataclass
class SelfCheckOutcome:
    """What ``--parity-selfcheck`` measured (``selfcheck.SelfCheck``).

    Attributes:
        teeth: whether a fault on the target makes the check fail (None: not measured).
        teeth_problem: why it has none, or None.
        selfcheck: the measurement's details (a JSON-able dict; not a report column), or None.
    """

    teeth: bool | None = None
    teeth_problem: str | None = None
    selfcheck: dict | None = None


@dataclass
class LayerCheckOutcome:
    """The layer check's verdict (``layers.judge_layers``), all None when no layer policy applied.

    Attributes:
        layer_policy: the policy's description.
        layers_judged: how many layers were judged.
        layer_worst: the layer furthest from the reference; layer_worst_rel_l2 its relative L2 error.
        layers_failing: the layers beyond the limit, comma-separated.
    """

    layer_policy: str | None = None
    layers_judged: int | None = None
    layer_worst: str | None = None
    layer_worst_rel_l2: float | None = None
    layers_failing: str | None = None


@dataclass
class AuditCheckOutcome:
    """The audit budget's verdict on the check's audited run (audit modes ``warn``/``fail``).

    Attributes:
        audit_budget: the budget's description (``audit.AuditBudget.describe``).
        audit_problem: the events beyond it (``audit.AuditBudget.judge``), or None.
        audit_verdict: what they did: ``fail`` or ``warn``, or None.
    """

    audit_budget: str | None = None
    audit_problem: str | None = None
    audit_verdict: str | None = None


@dataclass
class LocalizationOutcome:
    """First-divergence localization of a failing check (``localize.Localizer``, ``localize.failure_hook``).

    Attributes:
        localization: the table (``localize.Localization.to_rows()``: a JSON-able list of dicts), or None.
        localization_s: seconds the localization took.
        localization_reused: the check whose localization was reused, or None.
        localization_skipped: why it was not run (``structure``, ``budget``), or None.
        localization_stopped: why a descent stopped early (``budget``), or None.
        localization_ops: the op table of the module where the descent ended
            (``localize.Localization.op_rows()``: JSON-able dicts, the first culprit op first), or under a
            golden verdict of the counterfactual's root-cause module (``counterfactual.trace_root_cause``),
            or None.
        localization_backward: a failing train step's backward table, layer by layer in backward
            order (``localize.Localization.backward_rows()``: JSON-able dicts), or None.
    """

    localization: list | None = None
    localization_s: float | None = None
    localization_reused: str | None = None
    localization_skipped: str | None = None
    localization_stopped: str | None = None
    localization_ops: list | None = None
    localization_backward: list | None = None


@dataclass
class CounterfactualOutcome:
    """What makes a failing check pass (``diagnose.counterfactual``): counterfactual re-runs of its
    target side, judged by its own verdict.

    Attributes:
        counterfactual: one row per re-run made (``counterfactual.WhatMakesItPass.to_rows()``: a
            JSON-able list of dicts: the suspect, the modification, the error before/after, the share
            of the error that disappears, the verdict, the class ``root cause``/``contributing``/``no
            effect``; the precision-island search's runs last), or None.
        fp32_islands: the verified precision-island fix: the submodule names, comma-separated, whose
            float32 run makes the check pass (``""``: the whole module), or None.
        counterfactual_s: seconds the counterfactual re-runs and the island search took.
    """

    counterfactual: list | None = None
    fp32_islands: str | None = None
    counterfactual_s: float | None = None


#: ``LocalizationOutcome`` fields exported on a check's first row, besides the JSON table.
_LOCALIZATION_COLUMNS = ("localization_s", "localization_reused", "localization_skipped", "localization_stopped")
#: Audit counts exported as ``audit_<kind>`` columns.
_AUDIT_KINDS = ("mixed_device", "h2d", "d2h", "host_sync", "cpu_fallback", "fp64")


@dataclass
class CheckRecord:
    """What happened in one check, for the terminal summary and the report.

    ``status`` is ``pass``, ``fail``, ``error`` or ``recorded``. ``reference`` is ``cpu`` (live run),
    ``baseline``, ``recorded`` or ``given`` (``ParityCase.compare``); ``reference_provenance`` is the
    baseline's file and one-line provenance (``Baseline.describe()``: ``"<file> — <device> · <date> ·
    torch <version> …"``). ``audit`` is the device-propagation record (a dict) when the audit ran;
    judged by an audit budget, ``audit_check`` says how (``AuditCheckOutcome``). A check whose
    baseline could not be used has status ``error`` and ``baseline_problem`` (``BaselineProblem``).
    ``weights`` is the fingerprint of the module the check ran (``provenance.fingerprint_module``;
    None for a free function or a ``compare``). ``distribution_policy`` is the
    ``distribution.DistributionPolicy`` of a sampling check judged as distributions (``result`` is
    then a ``distribution.DistributionResult``), else None. ``trajectory_policy`` is the
    ``judge.trajectory.TrajectoryPolicy`` of a ``ParityCase.trajectory`` (``result`` is then a
    ``judge.trajectory.TrajectoryResult``, one row per curve), else None. ``layer_records`` is ``(target's,
    reference's)`` layer records (``layers.capture_layers``) of a check judged by a layer policy,
    else None, until its test ends (``ParityCase.finish`` releases them); ``layer_check`` holds that
    verdict. ``golden_policy`` is the ``golden.GoldenPolicy``
    the check was judged by, or None for the allclose tolerance; a check that asked for the golden
    but could not get one is judged by allclose and says why in ``notes.policy_note``. ``vacuity``,
    ``self_check`` and ``localized`` are filled by the vacuity test, ``--parity-selfcheck`` and the
    first-divergence localization.
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
    golden_policy: Any = None
    weights: str | None = None
    distribution_policy: Any = None
    layer_records: tuple | None = None
    trajectory_policy: Any = None
    notes: CheckNotes = field(default_factory=CheckNotes)
    baseline_problem: BaselineProblem | None = None
    vacuity: VacuityOutcome = field(default_factory=VacuityOutcome)
    self_check: SelfCheckOutcome = field(default_factory=SelfCheckOutcome)
    layer_check: LayerCheckOutcome = field(default_factory=LayerCheckOutcome)
    audit_check: AuditCheckOutcome = field(default_factory=AuditCheckOutcome)
    localized: LocalizationOutcome = field(default_factory=LocalizationOutcome)
    whatfix: CounterfactualOutcome = field(default_factory=CounterfactualOutcome)

    @property
    def extra(self) -> Mapping[str, Any]:
        """The typed outcomes that are set, by their report names (a read-only mapping, rebuilt on
        each access): ``policy_note``, ``check_problem``, ``baseline_error`` … ``localization_stopped``."""
        items: dict[str, Any] = dict(_set_items(self.notes))
        if self.baseline_problem is not None:
            items.update(self.baseline_problem.columns())
        for outcome in (self.vacuity, self.self_check, self.layer_check, self.audit_check, self.localized,
                        self.whatfix):
            items.update(_set_items(outcome))
        return MappingProxyType(items)

    @property
    def policy(self) -> str:
        """The verdict policy the check was judged by: ``allclose``, ``golden``, ``distribution``
        (a sampling check whose sides drew from their own streams, ``distribution.DistributionPolicy``)
        or ``trajectory`` (``ParityCase.trajectory``, ``judge.trajectory.TrajectoryPolicy``)."""
        if self.distribution_policy is not None:
            return "distribution"
        if self.trajectory_policy is not None:
            return "trajectory"
        return "allclose" if self.golden_policy is None else "golden"

    def rows(self) -> list[dict[str, Any]]:
        """One dict per compared leaf (the report's row schema); one row with no metrics otherwise."""
        base = self._base_columns()
        leaves = self.result.leaves if self.result is not None else []
        if not leaves:
            row = dict(base, leaf=None, verdict=self.status, problem=self.message,
                       rtol=self.tolerance.rtol, atol=self.tolerance.atol, budget=self.tolerance.budget,
                       tolerance_source=self.tolerance.source, tolerance_reason=self.tolerance.reason)
            if self.baseline_problem is not None:
                row.update(self.baseline_problem.columns())
            return [dict(row, **self._extra_columns(first=True))]
        rows = []
        for i, leaf in enumerate(leaves):
            row = dict(base, **leaf.to_row())
            if self.status == "error":
                row["verdict"] = "error"
            elif self.status == "fail" and self.notes.check_problem and row["verdict"] == "pass":
                # Every leaf within tolerance, but the check failed as a whole (vacuous, no teeth).
                row["verdict"], row["problem"] = "fail", self.notes.check_problem
            rows.append(dict(row, **self._extra_columns(first=i == 0)))
        return rows

    def _base_columns(self) -> dict[str, Any]:
        """The columns every row of the check shares (identity, policy, audit counts and verdicts, layers)."""
        base = {
            "test_id": self.test_id, "check": self.check, "submodule": self.submodule,
            "group": self.group or self.submodule or self.check,
            "recipe": self.recipe, "target": self.target, "target_name": self.target_name,
            "reference": self.reference, "reference_provenance": self.reference_provenance,
            "duration_s": self.duration_s, "policy": self.policy,
            "golden_policy": self.golden_policy.describe() if self.golden_policy is not None else None,
            "distribution_policy": (self.distribution_policy.describe()
                                    if self.distribution_policy is not None else None),
            "policy_note": self.notes.policy_note,
            "weights": self.weights[:16] if self.weights else None,
        }
        counts = (self.audit or {}).get("counts", {})
        for kind in _AUDIT_KINDS:
            base[f"audit_{kind}"] = counts.get(kind)
        audit, layers = self.audit_check, self.layer_check
        base.update(audit_budget=audit.audit_budget, audit_problem=audit.audit_problem,
                    audit_verdict=audit.audit_verdict, layer_policy=layers.layer_policy,
                    layers_judged=layers.layers_judged, layer_worst=layers.layer_worst,
                    layer_worst_rel_l2=layers.layer_worst_rel_l2, layers_failing=layers.layers_failing)
        return base

    def _extra_columns(self, first: bool) -> dict[str, Any]:
        """Vacuity and self-check columns (``vacuous``/``vacuous_ok``/``teeth``/``teeth_problem``) on
        every row, the localization columns, the first-divergence table ``localization`` and the op
        table ``localization_ops`` and the backward table ``localization_backward`` (JSON text) on the check's
        first row only; a trajectory's curves to plot (``trajectory_series``, JSON) and its findings
        (``traj_mean_rel_loss``, ``traj_loss_parted_at``, ``traj_grad_norm_parted_at``, ``traj_first_layer``)
        there too."""
        columns = dict(_set_items(self.vacuity))
        columns.update((k, v) for k, v in _set_items(self.self_check) if k != "selfcheck")
        if first:
            localized = dict(_set_items(self.localized))
            columns.update({k: localized[k] for k in _LOCALIZATION_COLUMNS if k in localized})
            if self.localized.localization is not None:
                columns["localization"] = json.dumps(self.localized.localization, default=str)
            if self.localized.localization_ops is not None:
                columns["localization_ops"] = json.dumps(self.localized.localization_ops, default=str)
            whatfix = self.whatfix
            if whatfix.counterfactual is not None:
                columns["counterfactual"] = json.dumps(whatfix.counterfactual, default=str)
            if whatfix.fp32_islands is not None:
                columns["fp32_islands"] = whatfix.fp32_islands
            if whatfix.counterfactual_s is not None:
                columns["counterfactual_s"] = whatfix.counterfactual_s
            if self.localized.localization_backward is not None:
                columns["localization_backward"] = json.dumps(self.localized.localization_backward, default=str)
            if self.trajectory_policy is not None and self.result is not None:
                layer = self.result.first_parting_layer
                columns.update(trajectory_series=json.dumps(self.result.series),
                               traj_mean_rel_loss=self.result.mean_rel_loss_error,
                               traj_loss_parted_at=self.result.loss_parted_at,
                               traj_grad_norm_parted_at=self.result.grad_norm_parted_at,
                               traj_first_layer=None if layer is None else f"{layer[0]} at step {layer[1]}")
        return columns

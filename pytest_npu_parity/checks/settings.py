"""Which settings judge one check: one resolver, ``default < ini recipe < ini check pattern < marker < call``.

Five per-check settings follow that order: the allclose tolerance, the verdict policy (allclose or
golden), the layer limit, the audit budget and the train store (how a training step's baseline keeps
its leaves). Their specs are parsed once: the session's (ini keys, command-line options) when
``IniSettings`` is built, a test's ``@pytest.mark.parity(...)`` once per test in ``MarkerSettings``;
only a check's own keywords (``parity.check(..., rtol=..., policy=...)``) are parsed per check.
No pytest here: ``runner.ParitySession`` and ``runner.ParityCase`` call it, scripts can too.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch

from ..runtime.audit import AuditBudget, parse_audit_budget
from ..store.compact import TrainStore, parse_train_store
from ..judge.golden_policy import parse_policy_spec
from ..judge.layers import LayerPolicy, default_layer_policy, parse_layer_spec
from ..judge.tolerance import Tolerance, default_for_recipe, parse_spec_items
from ..runtime.layer_capture import compiled_modules

#: Verdict policy per recipe when nothing else is configured (measured: docs/explanation/verdict-accuracy.md).
#: fp32 eval checks keep allclose 1e-5: no legitimate variant failed it (other torch release, other
#: CPU kernel path, thread count, transformer slow path). bf16 is judged by the golden verdict with
#: the user's allclose 1e-3 as a floor: against baselines of another torch release or CPU kernel
#: path allclose 1e-3 failed 18 of 49 bf16 tests (err/tol up to 380, cosine >= 0.998), the golden
#: floor none; in the calibration it fails 0/19 legitimate variants and 19 of the 21 faults a bf16
#: run can resolve. The user's 1e-3 stays one option away: ``--parity-policy allclose`` or ini
#: ``parity_bf16_policy = allclose``. fp16 likewise (2026-12, the suite's 78 fp16 tests against fp16 baselines
#: recorded on a 2-core AMD EPYC with torch 2.14.1): allclose 1e-3 failed 12 on ATen's default kernels with
#: oneDNN capped to AVX2 (err/tol up to 5.3) and 13 on torch 2.5.1 (up to 31), the golden floor none; under
#: allclose a linear's output of 0.04 or 0.01 sign-flipped passed (err/tol 77, 20: the built-in budget takes
#: 100x), the golden floor fails it.
DEFAULT_POLICIES: dict[str, str] = {"fp32": "allclose", "bf16": "golden floor", "bf16-weights": "golden floor",
                                    "fp16": "golden floor"}
#: Training computations (``train_step``; ``check`` of a module with dropout or batch norm in training
#: mode, see ``runner.is_training``) amplify rounding: across torch releases and CPU kernel paths fp32
#: training checks moved by up to 6e-5 (err/tol 5.8 at 1e-5), and one AdamW step moves each parameter
#: by about ±lr whatever its gradient's size. Their fp32 default is the golden verdict with the
#: allclose floor.
TRAINING_DEFAULT_POLICIES: dict[str, str] = {"fp32": "golden floor"}
#: Audit modes a test may choose (``@pytest.mark.parity(audit=...)``; None: the session's).
MARKER_AUDIT_MODES = (None, "off", "warn", "fail")


@dataclass(frozen=True)
class TolerancePatch:
    """A tolerance spec (``"rtol=1e-4 budget=0 # reason"``) parsed once, applied over any recipe's tolerance.

    Attributes:
        text: the spec as written (quoted in errors).
        values: the keys it sets (``rtol``, ``atol``, ``budget``; floats).
        reason: the text after ``#``, or None (the base's reason is kept).
    """

    text: str
    values: Mapping[str, float]
    reason: str | None

    @classmethod
    def parse(cls, text: str) -> "TolerancePatch":
        """Parse ``text`` and validate it over the fp32 default (as ``policy.parse_tolerance_spec``).

        Raises:
            ValueError: an unknown key, a key given twice, a value that is not a number or that
                ``Tolerance`` rejects, quoting ``text``.
        """
        values, reason = parse_spec_items(text, {k: k for k in ("rtol", "atol", "budget")}, what="tolerance",
                                          expected="rtol=, atol= or budget=")
        patch = cls(text, MappingProxyType(dict(values)), reason or None)
        patch.over(default_for_recipe("fp32"), source="ini")
        return patch

    def over(self, base: Tolerance, *, source: str) -> Tolerance:
        """``base`` with this patch's values (keys not given keep ``base``'s; so does an empty reason).

        Raises:
            ValueError: ``Tolerance`` rejects the result (``bad tolerance '<text>': …``).
        """
        try:
            return base.replace(**self.values, source=source, reason=self.reason or base.reason)
        except ValueError as exc:
            raise ValueError(f"bad tolerance {self.text!r}: {exc}") from None


@dataclass(frozen=True)
class IniSettings:
    """A session's per-check settings below the marker, each parsed once (frozen).

    Attributes:
        recipe_tolerances: recipe -> ``Tolerance`` replacing its default (ini ``parity_<recipe>_tolerance``).
        check_tolerances: ``(pattern, TolerancePatch | Tolerance)`` in order, the first match wins (ini
            ``parity_tolerances``; a pattern is a check name or an ``fnmatch`` glob).
        recipe_policies: recipe -> ``golden.GoldenPolicy`` or None (allclose) (ini ``parity_<recipe>_policy``,
            ``--parity-policy``); recipes not named use ``DEFAULT_POLICIES``.
        check_policies: ``(pattern, spec)`` in order (ini ``parity_policies``); a spec's golden limits
            default to the recipe's, so it is parsed once per recipe that uses it.
        audit_budget: the ``audit.AuditBudget`` of a check that declares none.
        train_store: the ``compact.TrainStore`` of training steps.
        layers: ``"default"`` (``layers.DEFAULT_LIMITS`` per recipe) or the fp32 recipe's ``LayerPolicy``
            (None: off; other recipes then record no layers).
    """

    recipe_tolerances: Mapping[str, Tolerance] = field(default_factory=lambda: MappingProxyType({}))
    check_tolerances: tuple[tuple[str, Any], ...] = ()
    recipe_policies: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    check_policies: tuple[tuple[str, str], ...] = ()
    audit_budget: AuditBudget = field(default_factory=AuditBudget)
    train_store: TrainStore = field(default_factory=lambda: TrainStore(source="default"))
    layers: Any = "default"

    @classmethod
    def from_specs(cls, *, check_tolerances: Mapping[str, Tolerance | str] | None = None,
                   recipe_tolerances: Mapping[str, Tolerance] | None = None,
                   recipe_policies: Mapping[str, Any] | None = None, check_policies: Mapping[str, str] | None = None,
                   audit_budget: Any = None, train_store: Any = None, layers: Any = "default") -> "IniSettings":
        """Parse ``runner.ParitySession``'s keyword arguments (strings or parsed objects) once.

        Raises:
            ValueError: a spec the engine parsers reject (``golden.parse_policy_spec``,
                ``audit.parse_audit_budget``, ``compact.parse_train_store``, ``layers.parse_layer_spec``,
                ``TolerancePatch.parse``), with their messages.
        """
        patches = tuple((pattern, TolerancePatch.parse(spec) if isinstance(spec, str) else spec)
                        for pattern, spec in (check_tolerances or {}).items())
        policies = {recipe: parse_policy_spec(spec, source="ini", recipe=recipe) if isinstance(spec, str) else spec
                    for recipe, spec in (recipe_policies or {}).items()}
        return cls(recipe_tolerances=MappingProxyType(dict(recipe_tolerances or {})), check_tolerances=patches,
                   recipe_policies=MappingProxyType(policies), check_policies=tuple((check_policies or {}).items()),
                   audit_budget=parse_audit_budget(audit_budget, source="default"),
                   train_store=parse_train_store(train_store, source="ini"),
                   layers="default" if layers == "default" else parse_layer_spec(layers, source="option"))


@dataclass(frozen=True)
class MarkerSettings:
    """One test's ``@pytest.mark.parity(...)`` settings under one recipe, parsed once per test.

    Attributes:
        tolerance: the marker's ``Tolerance`` (replaces everything below it), or None.
        has_policy: whether the marker chose a verdict policy; ``policy`` is then its
            ``GoldenPolicy`` or None (allclose).
        audit_mode: ``off``, ``warn``, ``fail`` or None (the session's).
        audit_budget: the test's ``AuditBudget`` (over the session's).
        train_store: the marker's ``TrainStore``, or None (the session's).
        layers: the test's ``LayerPolicy`` (None: no layer records).
    """

    tolerance: Tolerance | None = None
    has_policy: bool = False
    policy: Any = None
    audit_mode: str | None = None
    audit_budget: AuditBudget | None = None
    train_store: TrainStore | None = None
    layers: LayerPolicy | None = None


def marker_tolerance(kwargs: Mapping[str, Any], recipe: str) -> Tolerance | None:
    """The ``Tolerance`` of a marker's ``rtol``/``atol``/``budget`` (over ``recipe``'s default, with its
    ``reason``), or None when it names none."""
    values = {k: kwargs[k] for k in ("rtol", "atol", "budget") if kwargs.get(k) is not None}
    if not values:
        return None
    return default_for_recipe(recipe).replace(**values, source="marker", reason=kwargs.get("reason"))


def audit_mode(session_mode: str, marker: MarkerSettings | None, *, auditable: bool) -> str:
    """``off``, ``record``, ``warn`` or ``fail`` for a test's checks: off without an audit factory
    (``auditable`` False), else the marker's mode over the session's."""
    if not auditable:
        return "off"
    return (marker.audit_mode if marker is not None else None) or session_mode


class CheckSettings:
    """The resolver: ``IniSettings`` (frozen) plus which check patterns matched (for the summary).

    Args:
        ini: the session's parsed settings.
    """

    def __init__(self, ini: IniSettings) -> None:
        self.ini = ini
        self.patterns_used: set[str] = set()  # check_tolerances/check_policies patterns that matched a check
        self._policies: dict[tuple[str, str, str], Any] = {}  # (spec, source, recipe) -> policy, parsed once

    def _policy(self, spec: Any, source: str, recipe: str) -> Any:
        if not isinstance(spec, str):
            return parse_policy_spec(spec, source=source, recipe=recipe)
        key = (spec, source, recipe)
        if key not in self._policies:
            self._policies[key] = parse_policy_spec(spec, source=source, recipe=recipe)
        return self._policies[key]

    def _match(self, pairs: tuple[tuple[str, Any], ...], check: str) -> tuple[str, Any] | None:
        for pattern, value in pairs:
            if pattern == check or fnmatch.fnmatchcase(check, pattern):
                if check:
                    self.patterns_used.add(pattern)
                return pattern, value
        return None

    def marker(self, recipe: str, *, tolerance: Tolerance | None = None, policy: Any = None,
               audit_mode: str | None = None, audit_budget: Any = None, train_store: Any = None,
               layers: Any = None) -> MarkerSettings:
        """Parse one test's marker values for ``recipe`` (each once; None: not given).

        Raises:
            ValueError, TypeError: a bad policy, audit mode, audit budget, train store or layer spec.
        """
        policy_value = self.verdict_policy(recipe, "", policy) if policy is not None else None
        if audit_mode not in MARKER_AUDIT_MODES:
            raise ValueError(f"audit={audit_mode!r}: use off, warn or fail")
        budget = parse_audit_budget(audit_budget, source="marker", base=self.ini.audit_budget)
        store = parse_train_store(train_store, source="marker") if train_store is not None else None
        layer_policy = (parse_layer_spec(layers, source="marker") if layers is not None
                        else self.layer_policy(recipe))
        return MarkerSettings(tolerance=tolerance, has_policy=policy is not None, policy=policy_value,
                              audit_mode=audit_mode, audit_budget=budget, train_store=store, layers=layer_policy)

    def tolerance(self, recipe: str, check: str, marker: Tolerance | None = None,
                  explicit: Mapping[str, Any] | None = None) -> Tolerance:
        """The tolerance of ``check`` under ``recipe``: default < ini recipe < ini check < marker < explicit
        (``explicit``: the call's ``rtol``/``atol``/``budget``/``reason``, None for not given)."""
        tol = self.ini.recipe_tolerances.get(recipe, default_for_recipe(recipe))
        matched = self._match(self.ini.check_tolerances, check)
        if matched is not None:
            override = matched[1]
            tol = override.over(tol, source="ini") if isinstance(override, TolerancePatch) else override
        if marker is not None:
            tol = marker
        if explicit:
            values = {k: v for k, v in explicit.items() if v is not None and k != "reason"}
            if values:
                tol = tol.replace(**values, source="check", reason=explicit.get("reason") or tol.reason)
        return tol

    def verdict_policy(self, recipe: str, check: str, marker: Any = None, explicit: Any = None, *,
                       training: bool = False, marker_parsed: MarkerSettings | None = None) -> Any:
        """The verdict policy of ``check`` under ``recipe``: None (allclose) or a ``golden.GoldenPolicy``.

        Precedence: ``DEFAULT_POLICIES`` (``TRAINING_DEFAULT_POLICIES`` first for a ``training`` check) <
        ini recipe < ini check pattern < the marker (``marker_parsed`` when it chose one, else the spec
        ``marker``) < ``explicit`` (the call's ``policy=``).

        Raises:
            ValueError, TypeError: a policy spec that ``golden.parse_policy_spec`` rejects.
        """
        default = (TRAINING_DEFAULT_POLICIES.get(recipe) if training else None) or DEFAULT_POLICIES.get(recipe, "allclose")
        policy = (self.ini.recipe_policies[recipe] if recipe in self.ini.recipe_policies
                  else self._policy(default, "default", recipe))
        matched = self._match(self.ini.check_policies, check)
        if matched is not None:
            policy = self._policy(matched[1], "ini", recipe)
        if marker_parsed is not None and marker_parsed.has_policy:
            policy = marker_parsed.policy
        elif marker is not None:
            policy = self._policy(marker, "marker", recipe)
        if explicit is not None:
            policy = parse_policy_spec(explicit, source="check", recipe=recipe)
        return policy

    def layer_policy(self, recipe: str, marker: MarkerSettings | None = None, explicit: Any = None) -> Any:
        """The ``layers.LayerPolicy`` of a check under ``recipe`` (None: no layer records): the default
        per recipe < ``--parity-layers``/ini (fp32 only) < the marker's < the call's ``layers=``.

        Raises:
            ValueError: ``explicit`` is not a layer spec (``layers.parse_layer_spec``).
        """
        if explicit is not None:
            return parse_layer_spec(explicit, source="check")
        if marker is not None:
            return marker.layers
        if self.ini.layers == "default":
            return default_layer_policy(recipe)
        return self.ini.layers if recipe == "fp32" else None

    def audit_budget(self, marker: MarkerSettings | None = None, explicit: Any = None) -> AuditBudget:
        """The ``audit.AuditBudget`` of a check: the session's < the test's (suite fixture and marker) < the call's.

        Raises:
            ValueError: ``explicit`` is not an audit budget (``audit.parse_audit_budget``).
        """
        base = marker.audit_budget if marker is not None and marker.audit_budget is not None else self.ini.audit_budget
        return parse_audit_budget(explicit, source="check", base=base)

    def train_store(self, marker: MarkerSettings | None = None, explicit: Any = None) -> TrainStore:
        """The ``compact.TrainStore`` of a training step: the session's < the marker's < the call's ``store=``.

        Raises:
            ValueError: ``explicit`` is not a train store spec (``compact.parse_train_store``).
        """
        if explicit is not None:
            return parse_train_store(explicit, source="check")
        return (marker.train_store if marker is not None else None) or self.ini.train_store


@dataclass(frozen=True)
class Asked:
    """The settings keywords of one check's own call (None: not given), as ``CaseSettings.resolve`` takes them.

    Attributes:
        tolerance: ``rtol``, ``atol``, ``budget`` and ``reason``.
        policy, audit_budget, layers: as ``ParityCase.check`` takes them.
        training: the check computes in training mode (its default verdict policy:
            ``TRAINING_DEFAULT_POLICIES``).
        step: a ``train_step``: its plan keeps a train store (``store``, else the test's).
        store: a ``train_step``'s ``store=``.
    """

    tolerance: Mapping[str, Any]
    policy: Any = None
    training: bool = False
    audit_budget: Any = None
    layers: Any = None
    step: bool = False
    store: Any = None


@dataclass(frozen=True)
class CaseSettings:
    """One test's settings as its checks resolve theirs (``runner.ParityCase`` builds it when a check
    asks): the session's resolver, the test's recipe and marker. A bad spec of a check's own raises
    naming the check.

    Attributes:
        resolver: the session's ``CheckSettings``.
        recipe: the test's recipe name.
        marker: the test's parsed marker.
        marker_tolerance: the marker's tolerance, or None.
        train_store: the test's train store (the marker's, else the session's).
        session_audit_mode: the session's audit mode (``ParitySession.audit_mode``).
        auditable: the session has an audit factory.
    """

    resolver: CheckSettings
    recipe: str
    marker: MarkerSettings
    marker_tolerance: Tolerance | None = None
    train_store: Any = None
    session_audit_mode: str = "off"
    auditable: bool = False

    def verdict_policy(self, name: str, policy: Any, training: bool = False) -> Any:
        """``CheckSettings.verdict_policy`` for check ``name``; a bad ``policy=`` names the check."""
        try:
            return self.resolver.verdict_policy(self.recipe, name, explicit=policy, training=training,
                                                marker_parsed=self.marker)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"parity check {name!r}: policy={policy!r}: {exc}") from None

    def layer_policy(self, name: str, spec: Any) -> Any:
        """The ``layers.LayerPolicy`` of check ``name``: its own ``layers=`` over the test's; a bad spec names the check."""
        try:
            return self.resolver.layer_policy(self.recipe, self.marker, spec)
        except ValueError as exc:
            raise ValueError(f"parity check {name!r}: {exc}") from None

    def audit_mode(self) -> str:
        """``off`` (no audit), ``record``, ``warn`` or ``fail`` for this test's checks."""
        return audit_mode(self.session_audit_mode, self.marker, auditable=self.auditable)

    def audit_budget(self, name: str, spec: Any) -> Any:
        """The ``audit.AuditBudget`` of check ``name``: ``spec`` over the test's; a bad spec names the check."""
        try:
            return self.resolver.audit_budget(self.marker, spec)
        except ValueError as exc:
            raise ValueError(f"parity check {name!r}: {exc}") from None

    def resolve(self, name: str, asked: Asked, owner: torch.nn.Module | None = None) -> dict[str, Any]:
        """Check ``name``'s ``CheckPlan`` settings resolved in this order (a bad spec raises naming the
        check): tolerance, verdict policy, audit budget, layer policy (none for a compiled ``owner``:
        ``layers_unless_compiled``, ``notes`` then say so), a train step's ``train_store``."""
        fields: dict[str, Any] = {"tolerance": self.resolver.tolerance(self.recipe, name, self.marker_tolerance,
                                                                        asked.tolerance)}
        fields["golden_policy"] = self.verdict_policy(name, asked.policy, training=asked.training)
        fields["audit_budget"] = self.audit_budget(name, asked.audit_budget)
        fields["layer_policy"], layer_note = layers_unless_compiled(self.layer_policy(name, asked.layers), owner)
        if layer_note:
            fields["notes"] = (layer_note,)
        if asked.step:
            fields["train_store"] = (parse_train_store(asked.store, source="check") if asked.store is not None
                                     else self.train_store)
        return fields


def layers_unless_compiled(policy: Any, module: torch.nn.Module | None) -> tuple[Any, str | None]:
    """``(layer policy, note)``: the check's layer policy, or None with a note when ``module`` is (or
    holds) a ``torch.compile``d module (``layers.compiled_modules``). The layer check's forward hooks
    would be traced into the compiled program — graph breaks at the record's sampling, another graph
    than the one production runs — so a compiled module is judged by its outputs alone."""
    if policy is None or module is None:
        return policy, None
    compiled = compiled_modules(module)
    if not compiled:
        return policy, None
    where = f"submodule {compiled[0]!r}" if compiled[0] else f"the {type(module).__name__}"
    return None, (f"layer check off: {where} is compiled (torch.compile), and recording its layers would "
                  "change the compiled program (graph breaks); its outputs are judged")

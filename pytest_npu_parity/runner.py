"""The engine behind the ``parity`` fixture: run a computation on the reference and the target, compare.

One ``ParitySession`` lives for a pytest session (or a script); it knows the target device, where the
reference comes from, the recipes, tolerance overrides and the baseline store, and it collects a
``CheckRecord`` for every check. One ``ParityCase`` serves one test for one recipe:

``case.check(name, fn, *args, **kwargs)``
    runs ``fn`` (a module, a bound method of a module, or a function) on the reference and on the
    target and compares every output leaf. The reference side is the upstream computation on the CPU
    (or, with ``--update-baselines``, on the recording device), or a stored baseline. The target side
    runs on the target device under the recipe and the suite's patch set. Both sides draw their
    randomness from the same seeded CPU stream (``rng.same_randomness``). A sampling check
    (``sample_dim=`` given) under ``rng="device"`` (``--parity-rng device``), or against a baseline
    recorded that way, lets each side draw from its own device's generator and judges the two
    sample sets as distributions (``distribution.compare_distributions``).
``case.train_step(name, module, inputs)``
    one optimizer step on each side from the same weights; compares the loss, every trainable
    parameter's gradient, every parameter after the step and every buffer.
``case.compare(name, actual, expected)``
    judges outputs the user computed.

Modules are moved to the target once per session and state (a cached deep copy keyed by the module
object, dropped when a check finds the module changed: ``ParitySession.note_state``);
a module with any submodule in training mode gets a fresh copy for every run so that BatchNorm
running statistics or other state changed by one side never leak into the other (``fresh_copy``:
buffers and module objects are copied, parameters — which a forward does not change — are shared
when they already sit on the run's device in the run's dtype).

A check's data flows one way through the pieces ``ParityCase`` drives: its settings (``checks.plan``)
-> its reference (``checks.reference``: baseline, live CPU run, or the recording) -> the target's run
(``runtime.side``; a training step's mechanics in ``runtime.training``) -> the verdict
(``checks.verdict``) -> the session's hooks (``checks.hooks``) -> its record (``checks.record``). The
names that moved there are re-exported here.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import time
import weakref
from functools import partial
from typing import Any, Callable, ContextManager, Mapping

import torch

from .store.format import BaselineError
from .checks.fingerprints import META_KEY as FINGERPRINTS_KEY
from .checks.hooks import check_hook_problems, failure_diagnosis
from .checks.plan import CaseFacts, CheckPlan, check_name
from .checks.replay import REPLAY_LIMIT_BYTES, plan_replay, recorded_extras, replayed  # noqa: F401
from .checks.stored_golden import NOT_ADDED, add_goldens, addable, golden_source, reference_mismatch  # noqa: F401
# Moved to the checks package; re-exported here, where tests, scripts and other modules import them.
from .checks.record import _LOCALIZATION_COLUMNS, CheckRecord  # noqa: F401
from .checks.reference import (STALE_CAUSES, Expected, ReferenceSource, StaleSuite,  # noqa: F401
                               baseline_error_record, check_hashes, expected_for, golden_for, load_baseline,
                               memo_key, recorded_golden_run, recording, recording_provenance, stale_cause,
                               stale_suites, store_goldens, thread_count_mismatch, torch_version_mismatch,
                               train_hashes, write_recording)
from .checks.verdict import (LEAVES, DistributionVerdict, LeafVerdict, Sides, TrajectoryVerdict, compared_sides,
                             given_sides, optimizer_replay, paired_input_leaves, rejudged, split_layer_records,
                             stream_override_note, verdict_for, without_inplace_leaves,
                             without_unpaired_inplace)
from .checks.verdict import vacuity_problems as _vacuity_problems  # the name runner had
from .judge.allclose import CompareResult, ParityError, compare  # noqa: F401  (also runner.compare, as before)
from .leaves import flatten  # noqa: F401  (also runner.flatten, as before)
from .runtime.layer_capture import compiled_modules  # noqa: F401
from .runtime.layer_capture import split_layers
from .modules import owner_module  # noqa: F401  (also runner.owner_module, as before)
from .judge.golden_policy import WORK_DTYPES
from .judge.tolerance import Tolerance
from .judge.trajectory import TrajectoryPolicy
from .judge.trajectory import default_policy as default_trajectory_policy
from .runtime.recipes import RECIPES, Recipe, strict_fp32_flags
from .checks.settings import (DEFAULT_POLICIES, TRAINING_DEFAULT_POLICIES, Asked, CaseSettings,  # noqa: F401
                              CheckSettings, IniSettings, MarkerSettings, audit_mode as resolve_audit_mode)
from .checks.settings import layers_unless_compiled as _layers_unless_compiled  # noqa: F401  (the name runner had)
from .runtime.rng import RNG_MODES
from .runtime.trajectory import TrajectoryLoop
# Moved to the runtime package; re-exported here, where tests, scripts and other modules import them.
from .runtime.side import (CheckCall, PatchFactory, RunSpec, Side, _any_training, _CopyOnEntry,  # noqa: F401
                           _error_site, _move, _on_device, _RaisingOp, _Same, _sync_modes, _to_cpu_leaves,
                           check_runs, fresh_copy, no_patches, patch_factory_name, run_side, target_audit,
                           trainable_copy)
from .runtime.training import (MAX_SCALE_BACKOFFS, ROUNDING_LEVEL_EPS, TrainCheck, TrainSpec,  # noqa: F401
                               _default_loss, _device_of, _forward_inputs, _loss_on, _without, default_optimizer,
                               golden_step, is_training, replay_optimizer_step, rounding_level_params,
                               scaled_backward_and_step, train_check, train_inputs, train_recipe_of, train_runs,
                               training_step)

# DEFAULT_POLICIES and TRAINING_DEFAULT_POLICIES live with the settings resolver (checks/settings.py).
#: What an audited check does with events beyond its audit budget (``ParitySession(audit_mode=...)``).
AUDIT_JUDGEMENTS = ("off", "record", "warn", "fail")


def _plain_json(record: Any) -> str:
    """``record`` as canonical JSON text (NaN as ``NaN``: a summary of a ``-inf`` mask holds NaN, which is not
    equal to itself in a dict comparison)."""
    return json.dumps(record, sort_keys=True, default=str)


def _modeless(structure: dict | None) -> Any:
    """A ``structure.module_structure`` record without the submodules' ``training`` flags."""
    if not structure:
        return structure
    modules = {path: [entry[0], {k: v for k, v in entry[1].items() if k != "training"}]
               for path, entry in structure.get("modules", {}).items()}
    return dict(structure, modules=modules)


class ParitySession:
    """Session-wide parity state (no pytest needed: usable from a script or notebook).

    Args:
        target: the device under test.
        reference: ``auto`` (stored baseline when one exists for the check, else a live CPU run),
            ``cpu`` or ``baseline`` (a missing baseline is a failure).
        update_baselines: record mode: run each check's reference computation on ``target`` and
            store it instead of comparing.
        store: a ``baselines.BaselineStore`` (required for ``baseline`` and record mode).
        check_tolerances: per check name (exact name or ``fnmatch`` pattern): a ``Tolerance`` or a
            spec string (``"rtol=1e-4 # reason"``, parsed over the recipe's default).
        recipe_tolerances: per recipe default overrides (from ini).
        seed: default seed for every check.
        audit_factory: ``(device) -> context manager yielding an object with .to_dict()`` to audit
            target runs (e.g. :func:`target_audit`), or None (no audit, no cost). An object with
            ``to_target`` places the module and inputs itself; one with ``logical`` True audits an
            extra run (see ``ParityCase._run``).
        failure_hooks: callables ``(case, record, call, result) -> str | None`` (``call`` a
            ``CheckCall``), run when a check is out of tolerance; their text is appended to the
            failure message (``localize.Localizer``: first-divergence localization within a budget,
            shared across checks; ``localize.failure_hook``: without either).
        check_hooks: callables ``(case, record, call, actual, expected) -> str | None`` run after
            every comparison (pass or fail; ``actual``/``expected`` the CPU leaves); a returned
            text fails the check with that text (``selfcheck.SelfCheck``: ``--parity-selfcheck``).
        recipe_policies: verdict policy per recipe (``"allclose"``, ``"golden"``, ``"golden rmse=3 …"``
            or a ``golden.GoldenPolicy``); recipes not named use ``DEFAULT_POLICIES``.
        check_policies: per check name (exact or ``fnmatch`` pattern): a policy spec string as above.
        golden_runner: computes golden outputs (``golden.GoldenRunner``; default: a new one). A suite
            may set its ``root`` (share one golden copy of a model) and ``shims``.
        audit_mode: ``off`` (no audit), or what an audited check does with events beyond its audit
            budget (``audit.AuditBudget``): ``record`` (keep the audit in the record, judge
            nothing), ``warn`` (also put the events in ``extra["audit_problem"]`` and issue an
            ``audit.ParityAuditWarning``) or ``fail`` (the check fails with them). Default:
            ``record`` with an ``audit_factory``, else ``off``. A test may choose another
            (``ParityCase(audit_mode=...)``); nothing is audited without an ``audit_factory``.
        audit_budget: the budget of a check that declares none (an ``audit.AuditBudget`` or a spec
            for ``audit.parse_audit_budget``; default ``audit.DEFAULT_AUDIT_BUDGET``).
        rng: how sampling checks (``check(..., sample_dim=...)``) draw randomness (``rng.RNG_MODES``):
            ``shared`` (default: one seeded CPU stream for both sides, samples compared one by one) or
            ``device`` (each side its own device's generators, the target's seeded with
            ``rng.target_seed``; judged as distributions). Other checks always use the shared stream.
        distribution_policy: the ``distribution.DistributionPolicy`` of distribution verdicts
            (default: ``DistributionPolicy()``, alpha 1e-3, 1999 permutations).
        train_store: how training steps are recorded in baselines: ``"full"`` (default),
            ``"summary"`` or ``"summary min_numel=N samples=K"`` (``compact.parse_train_store``) or a
            ``compact.TrainStore``: large gradients and parameters kept as a deterministic sample
            plus summary statistics (module ``compact``).
        layers: the layer check (module ``layers``): ``"default"`` (``layers.DEFAULT_LIMITS``: fp32
            layers judged at rel-L2 1e-5, other recipes not), ``"off"``/None, or a relative L2 limit
            (a float, a spec string or a ``layers.LayerPolicy``) for the fp32 recipe; other recipes
            then record no layers unless a test asks (``ParityCase(marker_layers=...)``).
        settings: the seven per-check settings above (``check_tolerances`` … ``layers``) already parsed
            (``checks.settings.IniSettings``, what the pytest plugin builds at start-up); give either it
            or those keywords (TypeError otherwise).
    """

    def __init__(self, target: torch.device, *, reference: str = "auto", update_baselines: bool = False,
                 store: Any = None, check_tolerances: dict[str, Tolerance | str] | None = None,
                 recipe_tolerances: dict[str, Tolerance] | None = None, seed: int = 0,
                 audit_factory: Callable[[torch.device], ContextManager[Any]] | None = None,
                 failure_hooks: list[Callable[..., str | None]] | None = None,
                 check_hooks: list[Callable[..., str | None]] | None = None,
                 recipe_policies: dict[str, Any] | None = None, check_policies: dict[str, str] | None = None,
                 golden_runner: Any = None, audit_mode: str | None = None, audit_budget: Any = None,
                 rng: str = "shared", distribution_policy: Any = None, train_store: Any = None,
                 layers: Any = "default", settings: IniSettings | None = None):
        from .judge.distribution import DistributionPolicy
        from .runtime.golden_run import GoldenRunner

        if reference not in ("auto", "cpu", "baseline"):
            raise ValueError(f"--parity-reference={reference!r}: use auto, cpu or baseline")
        if rng not in RNG_MODES:
            raise ValueError(f"--parity-rng={rng!r}: use {' or '.join(RNG_MODES)}")
        self.rng = rng
        self.distribution_policy = distribution_policy or DistributionPolicy()
        if (reference == "baseline" or update_baselines) and store is None:
            raise ValueError("a baseline store is needed for --parity-reference=baseline and --update-baselines")
        self.target = target
        self.reference = reference
        self.update_baselines = update_baselines
        self.store = store
        self.seed = seed
        self.audit_factory = audit_factory
        if audit_mode is None:
            audit_mode = "record" if audit_factory is not None else "off"
        if audit_mode not in AUDIT_JUDGEMENTS:
            raise ValueError(f"audit_mode={audit_mode!r}: use one of {', '.join(AUDIT_JUDGEMENTS)}")
        self.audit_mode = audit_mode
        specs = dict(check_tolerances=check_tolerances, recipe_tolerances=recipe_tolerances,
                     recipe_policies=recipe_policies, check_policies=check_policies, audit_budget=audit_budget,
                     train_store=train_store, layers=layers)
        if settings is None:
            settings = IniSettings.from_specs(**specs)
        elif any(value is not None for key, value in specs.items() if key != "layers") or layers != "default":
            raise TypeError("ParitySession: give settings= or the per-check settings keywords, not both")
        self.settings = CheckSettings(settings)
        self.check_tolerances = dict(check_tolerances if check_tolerances is not None else settings.check_tolerances)
        self.recipe_tolerances = dict(settings.recipe_tolerances)
        self.recipe_policies: dict[str, Any] = dict(settings.recipe_policies)
        self.check_policies = dict(settings.check_policies)
        self.audit_budget = settings.audit_budget
        self.train_store = settings.train_store
        self.layers = settings.layers
        self.patterns_used = self.settings.patterns_used  # check_tolerances/check_policies patterns that matched
        self.failure_hooks = list(failure_hooks or [])
        self.check_hooks = list(check_hooks or [])
        self.golden_runner = golden_runner if golden_runner is not None else GoldenRunner()
        #: bytes a check may record for replay (its inputs and weights, ``checks.replay``).
        self.replay_limit = REPLAY_LIMIT_BYTES
        #: a compare run adds the goldens it computes live to baseline entries that store none
        #: (``--parity-store-goldens``, ``checks.stored_golden.add_goldens``).
        self.store_goldens = False
        self._golden_memo: dict[tuple, Any] = {}
        self.records: list[CheckRecord] = []
        self.baseline_writes: dict[str, str] = {}  # test_id -> created/changed/unchanged/not written
        self.not_written: dict[str, str] = {}  # test_id -> why not (failed, skipped, interrupted)
        self.baselines_used: set = set()
        self._copies: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        #: each checked module's state at its last check (``note_state``)
        self._states: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
        self._reference_memo: dict[tuple, dict] = {}
        self.patches_applied: set[str] = set()
        self.reference_patches_applied: set[str] = set()
        from .runtime.devices import device_name

        self.target_name = device_name(target)

    def layer_policy(self, recipe: str) -> Any:
        """The ``layers.LayerPolicy`` of ``recipe``'s checks, or None when they record no layers."""
        return self.settings.layer_policy(recipe)

    # -- modules -------------------------------------------------------------------------------
    def place(self, module: torch.nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """``module`` on ``device`` (floating tensors in ``dtype`` if given), copied at most once per session.

        A module already there is returned as is. Modules in training mode get a fresh copy each
        call (see module doc). The cached copy is dropped when a check finds the module's weights,
        structure or attributes changed (``note_state``); after an edit no fingerprint sees (through
        ``p.data``) call ``forget(module)``.
        """
        if _any_training(module):
            if _on_device(module, device, dtype):
                return fresh_copy(module)  # buffers new, weights shared (a forward does not change them)
            return copy.deepcopy(module).to(device=device, dtype=dtype)
        if _on_device(module, device, dtype):
            return module
        per_module = self._copies.setdefault(module, {})
        key = (str(device), dtype)
        placed = per_module.get(key)
        if placed is None:
            placed = copy.deepcopy(module).to(device=device, dtype=dtype) if dtype else copy.deepcopy(module).to(device)
            per_module[key] = placed
        _sync_modes(module, placed)
        return placed

    def metadata(self, recipes: list[str], pytest_args: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
        """The run's metadata for reports: versions, machine, target, reference, flags, patch set."""
        import datetime
        import uuid

        from .runtime.machine import collect_provenance
        from .runtime.recipes import precision_flags

        with strict_fp32_flags():
            flags = precision_flags()
        prov = collect_provenance(self.target, recipe=",".join(recipes), seed=self.seed, precision_flags=flags)
        created = datetime.datetime.now(datetime.timezone.utc)
        return {
            "run_id": created.strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6],
            "created": created.isoformat(timespec="seconds"),
            "git_revision": prov.get("git_revision"),
            "machine": prov.get("platform"),
            "python": prov.get("python"),
            "torch": prov.get("torch"),
            "torch_npu": prov.get("torch_npu"),
            "cann": prov.get("cann"),
            "transformers": prov.get("transformers"),
            "aurora_model": prov.get("aurora_model"),
            "plugin_version": prov.get("plugin_version"),
            "threads": prov.get("threads"),
            "interop_threads": prov.get("interop_threads"),
            "target": str(self.target),
            "target_name": self.target_name,
            "reference": "recording" if self.update_baselines else self.reference,
            "rng": self.rng,
            "recipes": list(recipes),
            "precision_flags": flags,
            "patch_set": sorted(self.patches_applied),
            "reference_patch_set": sorted(self.reference_patches_applied),
            "pytest_args": list(pytest_args),
        }

    def forget(self, module: torch.nn.Module) -> None:
        """Drop cached device copies of ``module`` and every cached golden copy and result (after
        editing its weights). A check notices such an edit itself (``note_state``); this is for an
        edit it cannot see (through ``p.data``, which bypasses the version counter)."""
        self._copies.pop(module, None)
        self.golden_runner.forget()
        self._golden_memo.clear()

    def note_state(self, module: torch.nn.Module, hashes: dict[str, Any]) -> bool:
        """Called by every check of ``module`` with its fingerprints (``checks.reference.check_hashes``):
        when the module's weights, structure or attributes differ from those of its last check, every
        cached copy of the session (device and dtype copies, golden copies) and every memoized golden
        is dropped, since each was made from the earlier state; the training modes alone do not count
        (copies follow the module's modes). A module checked for the first time while the golden runner
        holds a copy of its root (``GoldenRunner.root``, from which submodules' goldens are taken) has the
        root's state checked instead. Returns True when it dropped them.

        Without it, a model checked, then edited (a checkpoint loaded, a mask attribute changed), then
        checked again was judged against a golden of its old weights (a false pass) and, under a
        dtype or device copy, run with its old weights (a false failure against a baseline)."""
        fingerprints = hashes.get(FINGERPRINTS_KEY) or {}
        state = (hashes.get("config_hash"), hashes.get("structure_hash"), hashes.get("structure"),
                 fingerprints.get("attributes"))
        last = self._states.get(module)
        self._states[module] = state
        if last is None:
            # A module not checked before may be taken from the golden runner's copy of its model (the root):
            # that copy is as the root was at its own check, so the root's state is checked now (only while
            # such a copy exists: in a run against stored goldens there is none, and this costs nothing).
            root = getattr(self.golden_runner, "root", None)
            if (root is not None and root is not module and getattr(self.golden_runner, "_root_copies", None)
                    and root in self._states):
                return self.note_state(root, check_hashes(root, (), {}))
            return False
        same_attributes = last[3] == state[3] or _plain_json(last[3]) == _plain_json(state[3])  # NaN != NaN
        if last[0] == state[0] and same_attributes and (
                last[1] == state[1] or _modeless(last[2]) == _modeless(state[2])):
            return False  # (a check and a training step of one module: structure with and without modes)
        self._copies = weakref.WeakKeyDictionary()
        self.golden_runner.forget()
        self._golden_memo.clear()
        return True

    def verdict_policy(self, recipe: str, check: str, marker: str | None = None,
                       explicit: str | None = None, *, training: bool = False) -> Any:
        """The verdict policy of ``check`` under ``recipe``: None (allclose, by ``tolerance()``) or a
        ``golden.GoldenPolicy``. Precedence: ``DEFAULT_POLICIES`` (``TRAINING_DEFAULT_POLICIES`` first
        for a ``training`` check) < ``recipe_policies`` (ini
        ``parity_<recipe>_policy``, ``--parity-policy``) < ``check_policies`` (ini ``parity_policies``)
        < ``marker`` (``@pytest.mark.parity(policy=...)``) < ``explicit`` (``check(..., policy=...)``);
        see ``checks.settings.CheckSettings.verdict_policy``.

        Raises:
            ValueError: a policy spec that ``golden.parse_policy_spec`` rejects.
        """
        return self.settings.verdict_policy(recipe, check, marker, explicit, training=training)

    def golden(self, key: tuple, owner: Any, run: Callable[[], dict]) -> dict[str, torch.Tensor | None]:
        """The golden leaves of one check: ``run()`` once per session per ``key`` (see
        ``ParityCase._memo_key``), then reused; ``owner`` (the check's function or module, whose
        ``id`` is in the key) is kept alive with the result so that no other object takes its id.

        Raises:
            golden.GoldenUnavailableError: as ``run`` (not memoized: it is raised again).
        """
        if key not in self._golden_memo:
            self._golden_memo[key] = (owner, run())
        return self._golden_memo[key][1]

    def tolerance(self, recipe: str, check: str, marker: Tolerance | None = None,
                  explicit: dict[str, Any] | None = None) -> Tolerance:
        """The tolerance for ``check`` under ``recipe``: default < ini recipe < ini per-check < marker < explicit
        (``checks.settings.CheckSettings.tolerance``)."""
        return self.settings.tolerance(recipe, check, marker, explicit)


class ParityCase:
    """The ``parity`` fixture's object: checks for one test under one recipe.

    Args:
        session: the ``ParitySession``.
        test_id: the pytest node id (names the baseline file).
        recipe: a recipe name from ``recipes.RECIPES``.
        marker_tolerance: tolerance from ``@pytest.mark.parity(...)``, if any.
        patches: ``(device) -> context manager`` applying the suite's patch set on the target side.
        vacuous_ok: why every check of the test may be vacuous (``@pytest.mark.parity(vacuous_ok=...)``);
            a check's own ``vacuous_ok`` takes precedence.
        marker_policy: verdict policy spec from ``@pytest.mark.parity(policy=...)`` (``"golden"``,
            ``"golden rmse=3 # reason"``, ``"allclose"``), or None.
        audit_budget: the audit budget of every check of the test (an ``audit.AuditBudget`` or a
            spec over the session's, see ``audit.parse_audit_budget``), or None for the session's.
        audit_mode: ``off`` (no audit for this test), ``warn`` or ``fail``; None: the session's.
        marker_train_store: train store from ``@pytest.mark.parity(train_store=...)`` (``"summary"``
            …), or None for the session's.
        marker_layers: the layer check of every check of the test (``@pytest.mark.parity(layers=...)``:
            ``False``/``"off"``, a relative L2 limit, ``True`` for the fp32 default; see
            ``layers.parse_layer_spec``), or None for the session's per recipe.
        reference_patches: ``(device) -> context manager`` for the reference side's runs (live and
            recorded), or None: only what the model needs to run there at all under this recipe
            (``runtime.side.Side.reference_patches``; the suite's ``parity_reference_patches`` fixture).
            Their names are the session metadata's ``reference_patch_set``.
    """

    #: Inputs each side's run changed in place (``"reference"``/``"target"`` -> paths such as
    #: ``args[0]``) while a check's pipeline runs (``_record_or_compare`` to ``_judge``); None outside.
    _input_changes: dict[str, set[str]] | None = None

    def __init__(self, session: ParitySession, test_id: str, recipe: str = "fp32", *,
                 marker_tolerance: Tolerance | None = None, patches: PatchFactory | None = None,
                 vacuous_ok: str | None = None, marker_policy: str | None = None, audit_budget: Any = None,
                 audit_mode: str | None = None, marker_train_store: str | None = None, marker_layers: Any = None,
                 reference_patches: PatchFactory | None = None):
        if recipe not in RECIPES:
            raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
        self.session = session
        self.test_id = test_id
        self.recipe: Recipe = RECIPES[recipe]
        self.marker_tolerance = marker_tolerance
        self.patches = patches
        self.reference_patches = reference_patches
        #: names of the reference patches this test's reference ran under (live, recorded, or as the baseline
        #: entry it is compared with says); the session's reference_patch_set is their union.
        self.reference_patches_applied: set[str] = set()
        self.vacuous_ok = vacuous_ok
        self.marker_policy = marker_policy
        # The marker's settings, parsed once for this test (a bad spec fails before any run).
        self.marker: MarkerSettings = session.settings.marker(
            recipe, tolerance=marker_tolerance, policy=marker_policy, audit_mode=audit_mode, audit_budget=audit_budget,
            train_store=marker_train_store, layers=marker_layers)
        self.audit_mode = audit_mode
        self.audit_budget = self.marker.audit_budget
        self.marker_train_store = self.marker.train_store
        self.marker_layers = marker_layers
        self.layer_policy = self.marker.layers
        self.records: list[CheckRecord] = []
        self._pending: dict[str, Any] = {}
        self._golden_additions: dict[str, tuple] = {}  # --parity-store-goldens: check -> (golden, why, policy)
        self._baseline: Any = None
        self._baseline_loaded = False
        self.not_written: str | None = None

    # -- public API ----------------------------------------------------------------------------
    @property
    def target(self) -> torch.device:
        return self.session.target

    def check(self, name: str, fn: Callable[..., Any], *args: Any, submodule: str | None = None,
              group: str | None = None, seed: int | None = None, grad: bool = False, rtol: float | None = None,
              atol: float | None = None, budget: float | None = None, reason: str | None = None,
              vacuous_ok: str | None = None, fault_weight: str | None = None, policy: str | None = None,
              audit_budget: Any = None, sample_dim: int | None = None, layers: Any = None,
              **kwargs: Any) -> CheckRecord:
        """Run ``fn(*args, **kwargs)`` on the reference and the target and compare every output leaf.

        Args:
            name: the check's name, unique within the test (names the stored baseline entry).
            fn: an ``nn.Module``, a bound method of one (e.g. ``model.generate``) or a function.
                Tensors in ``args``/``kwargs`` and the module's parameters/buffers are moved to
                each side's device.
            submodule: dotted path of the module inside its model, for the report.
            group: what the check is counted under in the summary (e.g. the module's class);
                default: ``submodule`` or ``name``.
            seed: seed of the shared random stream (default: the session's).
            grad: run with autograd enabled (default: ``torch.no_grad()``).
            rtol, atol, budget, reason: per-check tolerance override (``reason`` is shown in the report).
            vacuous_ok: why this check may be vacuous (its reference output constant, or without
                teeth under ``--parity-selfcheck``); without it such a check fails.
            fault_weight: the parameter of ``fn``'s module that ``--parity-selfcheck`` perturbs
                (default: its largest trainable weight matrix, ``selfcheck.sensitive_parameter``).
            policy: verdict policy of this check: ``"allclose"`` (the tolerance) or ``"golden"``
                (``"golden rmse=3 … # reason"`` for other limits): both sides are then compared
                with a CPU golden run of ``fn`` in ``golden.golden_dtypes(recipe)`` (fp64; for bf16
                work fp32 where fp64 cannot run) and judged by ``golden.judge_golden``. Default: the session's
                ``verdict_policy``.
            audit_budget: what this check's audited target run may do (``audit.parse_audit_budget``:
                ``{"h2d": 2}``, ``"h2d=2 # reason"``), over the test's budget; used when the session
                audits (``--parity-audit``): events beyond it fail the check (or warn).
            sample_dim: for a sampling computation (``generate(num_samples=S)``), the axis of its
                i.i.d. samples in every floating output leaf. With the shared random stream (the
                default) the samples are compared one by one as any output; where the sides draw
                from their own streams (session ``rng="device"``, or a baseline recorded so) the
                two sample sets are judged as distributions by ``distribution.compare_distributions``
                under ``session.distribution_policy``, and ``rtol``/``atol``/``policy`` do not apply.
            layers: this check's layer check (``layers.parse_layer_spec``: ``False`` off, a relative
                L2 limit, ``True`` the fp32 default); default: the test's (marker ``layers=``), else
                the session's for the recipe (fp32: every weighted submodule's output within
                rel-L2 1e-5 of the reference's, module ``layers``). Not applied to samples judged
                as distributions.

        Returns:
            The ``CheckRecord`` (also kept for the summary and report).

        Raises:
            ParityError: an output leaf is out of tolerance, or shapes/dtypes/structure differ, or
                a weighted layer's output moved beyond the layer limit (``layers.judge_layers``), or
                the check is vacuous (``selfcheck.vacuity_problem``), or (audit mode ``fail``) its
                audited target run has events beyond its audit budget.
            baselines.BaselineError: the stored baseline is missing (with ``--parity-reference
                baseline``), stale or corrupt.
            recipes.RecipeUnsupportedError: the computation runs under fp32 but not under the
                test's recipe on this device (an op the backend cannot run in that precision).
        """
        __tracebackhide__ = True
        seed = self.session.seed if seed is None else seed
        plan = self._plan(name, Asked(dict(rtol=rtol, atol=atol, budget=budget, reason=reason), policy,
                                      grad or is_training(fn), audit_budget, layers), owner_module(fn),
                          submodule=submodule, group=group)
        hashes = check_hashes(fn, args, kwargs)
        given = (args, kwargs)
        fn, (args, kwargs), hashes, plan = self._replayed(plan, fn, given, hashes, lambda f, g: check_hashes(f, *g))
        own = sample_dim is not None and self.session.rng == "device"
        if sample_dim is not None and (not isinstance(sample_dim, int) or isinstance(sample_dim, bool)):
            raise TypeError(f"parity check {name!r}: sample_dim must be an int (the sample axis), got {sample_dim!r}")

        side = self._side()
        run, rerun = check_runs(side, RunSpec(fn, args, kwargs, seed, grad, layers=plan.layer_policy), own)
        golden = partial(self.session.golden_runner.run, fn, args, kwargs, recipe=self.recipe.name, seed=seed,
                         grad=grad)
        call = CheckCall("check", fn, args, kwargs, seed, grad, rerun, vacuous_ok, fault_weight, sample_dim,
                         memo=(getattr(plan.layer_policy, "samples", None),), input_changes=side.input_changes,
                         stream_overrides=side.stream_overrides)
        return self._record_or_compare(plan, run, hashes, call, golden, given)

    def train_step(self, name: str, module: torch.nn.Module, inputs: Any, *, labels: Any = None,
                   loss_fn: Callable[..., torch.Tensor] | None = None,
                   optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
                   max_grad_norm: float | None = 1.0, seed: int | None = None, submodule: str | None = None,
                   group: str | None = None, rtol: float | None = None, atol: float | None = None,
                   budget: float | None = None, reason: str | None = None, vacuous_ok: str | None = None,
                   fault_weight: str | None = None, policy: str | None = None,
                   loop: Callable[[torch.nn.Module, dict, Recipe | None], dict] | None = None,
                   audit_budget: Any = None, store: str | None = None, layers: Any = None) -> CheckRecord:
        """One training step on each side from the same weights, compared leaf by leaf.

        Each side deep-copies ``module``, puts it in training mode on its device, runs the forward
        under the recipe (forward and loss under autocast for bf16, backward outside it, as Hugging
        Face Trainer does), computes the loss, ``loss.backward()``, clips the global gradient norm to
        ``max_grad_norm`` (``torch.nn.utils.clip_grad_norm_``) and takes one ``optimizer`` step
        (default ``default_optimizer``: AdamW as upstream Aurora trains).

        Args:
            inputs: what the forward is called with: a dict (``module(**inputs)``; a Hugging Face
                batch with ``labels`` inside computes its own ``output.loss``), a tuple or list
                (``module(*inputs)``) or one tensor (``module(inputs)``).
            labels: targets of the loss, outside the forward's inputs (a tensor or any nested
                structure of them; moved to each side's device like the inputs). With ``labels``,
                the loss is ``loss_fn(output, labels)`` — the ``criterion(outputs, labels)`` of a
                PyTorch training loop, so ``loss_fn=torch.nn.CrossEntropyLoss()`` works as it is.
            loss_fn: ``loss_fn(output)`` without ``labels``, ``loss_fn(output, labels)`` with them;
                default (without ``labels`` only): ``output.loss``, else ``output[0]`` of a tuple or
                list, else the output itself, which must be a one-element tensor. A loss module with
                tensors (``CrossEntropyLoss(weight=w)``) is copied to each side's device and dtype.

        Compared leaves: ``loss``; ``grad.<param>`` for every trainable parameter; ``param.<param>``
        after the step for every trainable parameter; ``buffer.<name>`` for every buffer (e.g.
        BatchNorm running mean/var and num_batches_tracked). The ``param.<param>`` leaves are judged
        by **optimizer replay**: the expected values after the step are ``optimizer``'s step on a
        fresh CPU copy of ``module`` (in the recipe's weights dtype) from the *target's* recorded
        ``grad.<param>`` (``replay_optimizer_step``), so they test the target's optimizer step and
        starting weights while the ``grad.*`` leaves test the gradients; AdamW's first step, about
        ``lr·g/(|g| + eps)``, would otherwise turn a rounding-level gradient difference of a
        parameter with tiny gradients into a difference of up to ±lr. The replay is used only when
        replaying the reference's own gradients reproduces the reference's ``param.*`` within the
        check's tolerance (an optimizer that is not a function of the weights and gradients alone
        fails that; against a compact baseline, on the parameters it stores whole, and the replayed
        parameters are then reduced to ``@sample``/``@stats`` as recorded); otherwise the
        reference's own step is the expected value, the parameters whose reference gradient is
        rounding noise are left out (``rounding_level_params``), and the note says why (also where the
        reference's gradients are not finite: a loss scaler skipped that step). Not with ``loop`` (the loop
        owns its optimizer; its steps are compared as they are). Under a loss-scaling recipe (``fp16``)
        the backward, clipping and step go through a dynamic ``GradScaler``
        (:func:`scaled_backward_and_step`), ``grad.<param>`` are the unscaled gradients, and three
        leaves more are compared: ``amp.scale``, ``amp.skipped_steps`` and ``amp.grad_norm``.
        ``labels`` are part of the input's fingerprint (a baseline recorded with other labels is
        stale). ``vacuous_ok``, ``fault_weight``, ``policy`` and ``audit_budget`` are as in ``check``; the
        golden of a training step is the same step on a CPU copy of ``module`` in the golden dtype,
        without autocast. The audit (``--parity-audit``) covers the forward, the loss and the
        backward; the gradient clipping, the loss scaler and the optimizer step are the plugin's and
        not audited. ``store``: how a recording keeps the leaves (``"full"``, ``"summary"``, see
        ``compact``; default: the marker's ``train_store=``, else the session's); a comparison with
        a baseline follows what the baseline recorded. ``layers``: as in ``check``; the layers'
        outputs are those of the training-mode forward.

        ``loop``: a whole training loop instead of the single step (``hf_trainer.TrainerLoop``: N steps
        through Hugging Face Trainer): ``loop(module, inputs, recipe)`` trains each side's fresh copy of
        ``module`` (in training mode, on its device, inside the shared random stream) under ``recipe``
        (None for the golden run) and returns its leaves, named as above (``grad.<p>``, ``param.<p>``,
        ``buffer.<b>``; losses as it chooses). ``loss_fn``, ``optimizer`` and ``max_grad_norm`` are then
        the loop's business and ignored here.

        Raises:
            ValueError: ``labels`` without a ``loss_fn``; no scalar loss in the output; a bad ``store`` spec.
            ParityError, baselines.BaselineError, recipes.RecipeUnsupportedError: as ``check``.
        """
        __tracebackhide__ = True
        given = train_inputs(name, inputs, labels, loss_fn)
        asked = Asked(dict(rtol=rtol, atol=atol, budget=budget, reason=reason), policy, True, audit_budget, layers,
                      True, store)
        plan = self._plan(name, asked, module, submodule=submodule, group=group)
        return self._train(plan, module, given, (optimizer or default_optimizer, loss_fn, max_grad_norm, loop), seed,
                           vacuous_ok, fault_weight)

    def trajectory(self, name: str, module: torch.nn.Module, batches: Any, *, loop: TrajectoryLoop | None = None,
                   policy: TrajectoryPolicy | None = None, held_out: Any = None,
                   window_labels: list[str] | None = None, drill_down: str | None = None,
                   seed: int | None = None, submodule: str | None = None,
                   group: str | None = None, vacuous_ok: str | None = None,
                   audit_budget: Any = None) -> CheckRecord:
        """N training steps on each side from the same weights, judged by their loss curves.

        Each side trains a fresh copy of ``module`` (training mode, its device, the shared random
        stream, the recipe's autocast) with ``loop`` (default ``TrajectoryLoop()``: 300 AdamW steps as
        upstream Aurora trains, constant lr 1e-4, clip 1.0) over ``batches``, cycled. The curves it
        records (loss, global grad norm, per-module grad norms per step; weight norms at checkpoints)
        are the check's leaves: a baseline stores them. The verdict (``judge.trajectory``): the mean
        relative loss error over all steps within ``policy.loss_limit`` and the grad-norm curves'
        within ``policy.grad_norm_limit``; the message names the step where the loss curves part,
        the step where the grad-norm curves part and the module whose gradient norm parts first.

        Args:
            batches: the training batches, each as ``TrajectoryLoop`` takes it (a dict for
                ``module(**batch)`` with ``output.loss`` or the loop's ``loss_fn``, or ``(inputs…,
                target)`` with ``loss_fn``), CPU tensors; a list, or any iterable (a ``DataLoader`` is
                drawn once, here, so both sides train on the same batches).
            loop: the training loop (``runtime.trajectory.TrajectoryLoop``: steps, optimizer settings,
                lr schedule, loss), or Hugging Face Trainer itself (``hf_trainer.TrainerLoop(curves=True)``,
                which joins the batches row-wise and steps through them ``batch_size`` rows at a time).
            policy: the limits (``judge.trajectory.TrajectoryPolicy``); default
                ``judge.trajectory.default_policy`` of the test's recipe (measured).
            held_out: with a loop that evaluates (``TrajectoryLoop(evaluate=…)``), the held-out inputs
                it evaluates each side's trained model on (CPU tensors, moved like the batches); the
                per-window metrics it returns (``forecast.<metric>``, e.g. MSE, MAE, CRPS of
                forecasts) are judged by ``judge.forecast`` against ``policy.forecast_limit``.
            window_labels: one label per held-out window, for the message's list of the windows
                whose forecasts differ most.
            drill_down: a command with ``{window}`` (a label) that reruns the tensor-level checks on
                one held-out window; a failing forecast's message gives it for the window whose
                CRPS differs most.
            seed, submodule, group, vacuous_ok, audit_budget: as ``train_step`` takes them. The check
                is judged by its curves only: no golden, layer records, self-check or localization.

        Raises:
            ValueError: no batches; a batch the loop cannot compute a loss from.
            ParityError: the curves part (the message says where), or a curve is missing on one side.
            baselines.BaselineError: as ``check``.
        """
        __tracebackhide__ = True
        loop = TrajectoryLoop() if loop is None else loop
        batches = list(batches)
        if not batches:
            raise ValueError(f"parity trajectory {name!r}: no batches to train on")
        evaluate = getattr(loop, "evaluate", None)  # hf_trainer.TrainerLoop(curves=True) evaluates nothing
        if (held_out is None) != (evaluate is None):
            raise ValueError(f"parity trajectory {name!r}: held_out and a loop with evaluate= go together "
                             f"(held_out {'given' if held_out is not None else 'missing'}, "
                             f"evaluate {'set' if evaluate is not None else 'not set'})")
        if window_labels is not None and held_out is None:
            raise ValueError(f"parity trajectory {name!r}: window_labels name held-out windows; pass held_out= too")
        given = train_inputs(name, {"batches": batches, **({"held_out": held_out} if held_out is not None else {})},
                             None, None)
        asked = Asked({}, "allclose", True, audit_budget, False, True, "full")
        plan = self._plan(name, asked, module, submodule=submodule, group=group)
        judge = TrajectoryVerdict(policy if policy is not None else default_trajectory_policy(self.recipe.name),
                                  tuple(window_labels) if window_labels is not None else None, drill_down)
        return self._train(plan, module, given, (default_optimizer, None, loop.max_grad_norm, loop), seed, vacuous_ok,
                           None, judge)

    def _train(self, plan: CheckPlan, module: torch.nn.Module, given: tuple, how: tuple, seed: int | None,
               vacuous_ok: str | None, fault_weight: str | None, judge: Any = None) -> CheckRecord:
        """The pipeline of ``train_step`` and ``trajectory`` once the plan is resolved: replayed inputs
        against a baseline that recorded them, the run, then ``_record_or_compare`` (``judge``: the
        verdict, None for ``verdict_for``'s). ``how``: ``(optimizer, loss_fn, max_grad_norm, loop)``."""
        __tracebackhide__ = True
        module, forward, hashes, plan = self._replayed(plan, module, given, train_hashes(module, given), train_hashes)
        optimizer, loss_fn, max_grad_norm, loop = how
        spec = TrainSpec(optimizer, loss_fn, forward[2] is not None, max_grad_norm, loop)
        train = TrainCheck(module, forward, self.session.seed if seed is None else seed, spec, vacuous_ok, fault_weight)
        run, golden, call = train_check(train, self._side(), self.recipe, self.session.golden_runner, plan.layer_policy)
        return self._record_or_compare(plan, run, dict(hashes, train_recipe=train.train_recipe), call, golden, given,
                                       judge)

    def compare(self, name: str, actual: Any, expected: Any, *, rtol: float | None = None,
                atol: float | None = None, budget: float | None = None, reason: str | None = None,
                submodule: str | None = None, group: str | None = None,
                vacuous_ok: str | None = None, golden: Any = None, policy: str | None = None) -> CheckRecord:
        """Judge outputs computed by the caller (``actual`` on the target, ``expected`` the reference).

        ``golden``: the caller's golden output (same structure, higher precision); under a golden
        verdict policy (``policy`` or the session's) the check is judged by ``golden.judge_golden``
        when it is given, else by allclose with a note saying the golden was missing.

        Raises:
            ParityError: when a leaf is out of tolerance or ``expected`` is vacuous (constant).
        """
        __tracebackhide__ = True
        tol = self.session.tolerance(self.recipe.name, name, self.marker_tolerance,
                                     dict(rtol=rtol, atol=atol, budget=budget, reason=reason))
        golden_policy = self._settings().verdict_policy(name, policy)
        check_name(name, self.records, self.test_id)
        plan = CheckPlan(name, tol, time.perf_counter(), submodule, group, vacuous_ok=vacuous_ok)
        return self._settle(plan, given_sides(name, actual, expected, golden, golden_policy), None, LEAVES)

    def compare_trajectory(self, name: str, actual: Any, expected: Any, *, policy: TrajectoryPolicy | None = None,
                           submodule: str | None = None, group: str | None = None,
                           vacuous_ok: str | None = None) -> CheckRecord:
        """Judge training curves computed by the caller as ``trajectory`` judges its own: ``actual`` (the
        target's) and ``expected`` (the reference's) map curve names (``loss``, ``grad_norm``,
        ``layer_grad_norm.<module>``) to 1-D tensors ``[steps]`` (lists of numbers are taken as such); e.g. the curves of
        ``runtime.distributed_trajectory.data_parallel_trajectory``.

        Args:
            policy: the limits; default ``judge.trajectory.default_policy`` of the test's recipe.

        Raises:
            ParityError: the curves part, or the reference's loss is constant (vacuous).
            ValueError: no ``loss`` curve on one side.
            TypeError: ``actual`` or ``expected`` is not a mapping of curves.
        """
        __tracebackhide__ = True
        curves = []
        for side, given in (("actual", actual), ("expected", expected)):
            if not isinstance(given, Mapping):
                raise TypeError(f"parity compare_trajectory {name!r}: {side} must map curve names to 1-D tensors, "
                                f"got {type(given).__name__}")
            curves.append({k: torch.as_tensor(v) if isinstance(v, (list, tuple)) else v for k, v in given.items()})
        actual, expected = curves
        check_name(name, self.records, self.test_id)
        tol = self.session.tolerance(self.recipe.name, name, self.marker_tolerance, {})
        plan = CheckPlan(name, tol, time.perf_counter(), submodule, group, vacuous_ok=vacuous_ok)
        judge = TrajectoryVerdict(policy if policy is not None else default_trajectory_policy(self.recipe.name))
        return self._settle(plan, given_sides(name, actual, expected, None, None), None, judge)

    def finish(self, *, failed: bool = False, outcome: str = "passed") -> str | None:
        """End of the test: in record mode write the baseline file, with every check the test
        recorded — or nothing at all. Each record's layer records (``CheckRecord.layer_records``,
        the sampled layer outputs of both sides) are released: the session keeps every record for
        its summary, which needs only their verdict (``layer_check``).

        Args:
            failed: the test failed (same as ``outcome="failed"``).
            outcome: how the test's body ended: ``"passed"`` (it ran to its end) writes the file;
                anything else (``"failed"``, ``"skipped"`` — ``pytest.skip()`` or an xfail between
                checks —, ``"interrupted"`` — Ctrl-C, no call report at all) writes nothing, so a
                half-run test never replaces a complete baseline with some of its checks.

        Returns:
            ``"created"``, ``"changed"`` or ``"unchanged"`` (see ``BaselineStore.write``),
            ``"not written"`` for a test that did not pass in record mode (``self.not_written``
            says why), or None when nothing was recorded.

        Raises:
            OSError: the file cannot be written (the old baseline is left intact).
        """
        for record in self.records:  # ~1,600 small tensors per full-Aurora check, held to the session's end
            record.layer_records = None
        if self._golden_additions:  # --parity-store-goldens (a compare run): checks.reference.store_goldens
            status = store_goldens(self.session, self.test_id, self.recipe.name, self._golden_additions)
            self._golden_additions = {}
            return status
        if not (self.session.update_baselines and self._pending):
            return None
        outcome = "failed" if failed else outcome
        if outcome != "passed":
            self.not_written = outcome
        return write_recording(self.session, self.test_id, self.recipe.name, self._pending, outcome)

    # -- the check's pipeline: settings -> reference (record mode stops there) -> target -> verdict ------
    def _record_or_compare(self, plan: CheckPlan, run: Callable, hashes: dict[str, Any], call: CheckCall,
                           golden_run: Callable[[], dict], given: tuple, judge: Any = None) -> CheckRecord:
        """The tail shared by ``check`` and ``train_step``: in record mode record the reference run
        (``_record``); else the reference (``checks.reference``), the target's run under the patch set
        (audited unless the audit is off), the leaves to compare (``checks.verdict.compared_sides``:
        compact leaves, optimizer replay, golden) and the verdict that applies (``_settle``; ``judge``: the
        check's own, else ``checks.verdict.verdict_for``'s). ``given``:
        the check's inputs as the caller passed them (recorded for replay, ``checks.replay``)."""
        __tracebackhide__ = True
        module = call.module
        if module is not None:
            self.session.note_state(module, hashes)
        if self.session.update_baselines:
            return self._record(plan, run, hashes, call, given, golden_run)
        weights = hashes["config_hash"] if call.module is not None else None
        try:
            baseline = self._load_baseline() if self.session.reference in ("auto", "baseline") else None
            expected = expected_for(self._source(), baseline, plan.name, run, hashes, call)
            if expected.entry is not None:  # the recording's reference patches (checks.reference.recording)
                self.reference_patches_applied.update(expected.entry.meta.get("reference_patches") or ())
            # a baseline entry's stored golden, else the live golden run (checks.stored_golden)
            source = golden_source(expected.entry, expected.path) if plan.golden_policy is not None else None
        except BaselineError as exc:
            self._keep(baseline_error_record(self._facts(), plan, exc, weights))
            raise
        actual, audit = run(self.target, patched=True, audited=self._settings().audit_mode() != "off")
        notes = (*plan.notes, *filter(None, [stream_override_note(call.stream_overrides)]))
        sides = paired_input_leaves(split_layer_records(
            Sides(actual, expected, audit, weights, notes=notes, input_changes=call.input_changes,
                  input_hash=hashes.get("input_hash")), plan.layer_policy))
        if judge is None:
            judge = verdict_for(call.sample_dim, call.sample_dim is not None and self.session.rng == "device",
                                expected.rng)
        if judge is LEAVES:  # samples judged as distributions are compared as they are
            replay = optimizer_replay(call, sides.actual, sides.expected.leaves, plan.tolerance, expected.compact)
            key = memo_key(self.test_id, plan.name, self.recipe.name, hashes, call)
            golden = golden_for(self.session.golden, key, plan, call.fn, golden_run, source)
            if self.session.store_goldens:  # --parity-store-goldens: keep it for the baseline (finish)
                found = addable(expected.entry, source, golden)
                if found is not None and found[0] is not None:
                    # only beside a reference of the computation the golden came from (checks.stored_golden)
                    try:
                        live = without_unpaired_inplace(split_layers(run(torch.device("cpu"), patched=False)[0])[0],
                                                        sides.expected.leaves)
                        why = reference_mismatch(sides.expected.leaves, live, found[0], sides.expected.compact,
                                                 plan.golden_policy, plan.tolerance, plan.name,
                                                 WORK_DTYPES.get(self.recipe.name), training=call.kind == "train_step")
                    except Exception as exc:  # noqa: BLE001 - then nothing tells the reference is of this computation
                        first = (str(exc).strip().splitlines() or [""])[0][:200]
                        why = (f"{NOT_ADDED}: checking the stored reference against a live CPU run of this check "
                               f"raised {type(exc).__name__}: {first}")
                    if why is not None:
                        found = None
                        sides = dataclasses.replace(sides, notes=(*sides.notes, why))
                if found is not None:
                    self._golden_additions[plan.name] = (*found, plan.golden_policy)
            call.rejudge = partial(rejudged, self._facts(), plan, sides, dataclasses.replace(call), golden)
            sides = compared_sides(sides, call, replay, golden, plan.golden_policy)
        else:  # a distribution's leaves are samples: an input's written values are no sample
            sides = without_inplace_leaves(sides, "the check is judged as distributions")
        if call.rerun is not None:  # re-runs (self-check, counterfactuals) hold the inplace: leaves compared here
            rerun, compared = call.rerun, sides.expected.leaves
            call.rerun = lambda *args: without_unpaired_inplace(rerun(*args), compared)
        return self._settle(plan, sides, call, judge)

    def _record(self, plan: CheckPlan, run: Callable, hashes: dict[str, Any], call: CheckCall,
                given: tuple, golden_run: Callable[[], dict]) -> CheckRecord:
        """Record mode: the reference computation on the target, kept for ``finish``, with the inputs and
        weights it was computed from (``checks.replay.recorded_extras``) and, under a golden verdict
        policy, its golden (``checks.stored_golden``: a compare run against the entry runs none)."""
        __tracebackhide__ = True
        extras, replay_meta = recorded_extras(call.fn, given, self.session.replay_limit)
        leaves, _ = run(self.target, patched=False)
        rng = "device" if call.sample_dim is not None and self.session.rng == "device" else "shared"
        key = memo_key(self.test_id, plan.name, self.recipe.name, hashes, call)
        golden = recorded_golden_run(self.session.golden, key, plan, call.fn, golden_run, rng)
        self._pending[plan.name], record = recording(self._facts(), plan, leaves, hashes, call, rng,
                                                     extras=extras, replay_meta=replay_meta, golden=golden,
                                                     reference_patches=sorted(self.reference_patches_applied))
        self._keep(record)
        return record

    def _replayed(self, plan: CheckPlan, fn: Any, given: tuple, hashes: dict[str, Any],
                  rehash: Callable[[Any, tuple], dict[str, Any]]) -> tuple[Any, tuple, dict[str, Any], CheckPlan]:
        """Compare mode against a baseline entry that recorded its inputs and weights: ``(fn, given,
        hashes, plan)`` to run the check with (``checks.replay.replayed``)."""
        comparing = not self.session.update_baselines and self.session.reference in ("auto", "baseline")
        return replayed(self._load_baseline if comparing else None, plan, fn, given, hashes, rehash)

    def _load_baseline(self):
        __tracebackhide__ = True
        if not self._baseline_loaded:
            self._baseline = load_baseline(self.session.store, self.test_id, self.session.baselines_used)
            self._baseline_loaded = True
        if isinstance(self._baseline, BaselineError):
            raise self._baseline
        return self._baseline

    def _settle(self, plan: CheckPlan, sides: Sides, call: CheckCall | None,
                judge: LeafVerdict | DistributionVerdict) -> CheckRecord:
        """Judge ``sides`` by ``judge`` (``checks.verdict``), keep the record, run the check hooks and
        on a failure the failure hooks (``checks.hooks``) where the judge takes them; the record,
        or ``ParityError``."""
        __tracebackhide__ = True
        facts = self._facts()
        record = judge.measure(facts, plan, sides)
        self._keep(record)
        vacuous_ok = (call.vacuous_ok if call is not None else plan.vacuous_ok) or self.vacuous_ok
        problems = judge.problems(facts, plan, sides, record, vacuous_ok)
        if call is not None and judge.hooked:
            call.vacuous_ok = vacuous_ok
            problems += check_hook_problems(self.session.check_hooks, self, record, call, sides)
        if record.result.passed and not problems:
            return record
        message = judge.failure_message(facts, record, sides.expected, problems)
        if not record.result.passed and judge.hooked:
            message += failure_diagnosis(self.session.failure_hooks if call is not None else (), self, record, call)
        record.message = message
        raise ParityError(message, record.result)

    # -- internals -----------------------------------------------------------------------------
    def _plan(self, name: str, asked: Asked, owner: torch.nn.Module | None = None, **fields: Any) -> CheckPlan:
        """Check ``name``'s settings resolved (``checks.settings.CaseSettings.resolve``: a bad spec raises
        naming the check), then the name checked and the clock started; ``fields``' submodule and group as given."""
        __tracebackhide__ = True
        resolved = self._settings().resolve(name, asked, owner)
        check_name(name, self.records, self.test_id)
        return CheckPlan(name, start=time.perf_counter(), **resolved, **fields)

    def _run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device, *, patched: bool,
             audited: bool = False, **spec: Any):
        """``runtime.side.run_side`` of ``fn(*args, **kwargs)`` under this case's recipe and patch set;
        ``spec``: the other ``runtime.side.RunSpec`` fields (``seed``, ``grad``, ``stream`` …)."""
        __tracebackhide__ = True
        return run_side(self._side(), RunSpec(fn, args, kwargs, **spec), device, patched, audited)

    def _source(self) -> ReferenceSource:
        """Where this test's references come from (``checks.reference.expected_for``)."""
        return ReferenceSource(self.session.reference, self.session.store, self.test_id, self.recipe.name,
                               self.session.rng, self.session._reference_memo, self.reference_patches)

    def _side(self) -> Side:
        """What each run of this case's checks is lent: recipe, placement, patch set, audit."""
        return Side(self.recipe, self.session.place, self.patches, self.session.audit_factory,
                    self.session.patches_applied, self.reference_patches, self.reference_patches_applied)

    def _facts(self) -> CaseFacts:
        """This test's facts for records and verdicts."""
        return CaseFacts(self.test_id, self.recipe, self.target, self.session.target_name,
                         self._settings().audit_mode(), self.audit_budget, self.session.distribution_policy)

    def _settings(self) -> CaseSettings:
        """This test's settings as its checks resolve theirs (``checks.settings.CaseSettings``)."""
        return CaseSettings(self.session.settings, self.recipe.name, self.marker, self.marker_tolerance,
                            self.marker_train_store or self.session.train_store, self.session.audit_mode,
                            self.session.audit_factory is not None)

    def _keep(self, record: CheckRecord) -> None:
        self.session.reference_patches_applied |= self.reference_patches_applied
        self.records.append(record)
        self.session.records.append(record)


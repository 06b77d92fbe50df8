"""pytest glue for pytest-npu-parity: options, ini keys, markers, fixtures, header and summary.

Everything that judges numbers lives in the engine modules (``runner``, ``compare``, ``policy``,
``baselines`` …); this module only adapts them to pytest.
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from . import npu as _npu
from .report import columns as col

# The pytest11 entry point is imported before any conftest: with torch_npu installed but unusable
# (no CANN), `import torch` itself would fail there (device-backend autoload). Import torch and
# torch_npu safely now; the reason the NPU is not used, if any, goes into the report header.
try:
    NPU_UNUSED_REASON = _npu.prepare_torch()
except Exception as _exc:  # noqa: BLE001 - never fail pytest's start-up over the NPU probe
    NPU_UNUSED_REASON = f"NPU detection failed: {type(_exc).__name__}: {_exc}"

SESSION_KEY = pytest.StashKey["Any"]()
CASES_KEY = pytest.StashKey["list"]()
ROWS_KEY = pytest.StashKey["list"]()
COLLECTED_KEY = pytest.StashKey["list"]()  # node ids of every collected test (they keep their baselines)
OUTCOME_KEY = pytest.StashKey["dict"]()  # node id -> outcome of its call phase (only "passed" writes a baseline)
LOCK_KEY = pytest.StashKey["Any"]()  # the store lock a record run holds for its whole session
TEMP_KEY = pytest.StashKey["tuple"]()  # ("removed" | "found", [(path, bytes)]) temporary files of killed writes
DEEPSPEED_LINT_KEY = pytest.StashKey[tuple]()  # (config as named in ini, [deepspeed_config.Finding])
PROFILE_KEY = pytest.StashKey[str]()  # the hypothesis profile in force before this session loaded its own

_SKIP_REASON = "parity suites run only with --npu-parity (or --update-baselines)"

#: Keyword arguments of ``@pytest.mark.parity``.
MARKER_KEYS = ("rtol", "atol", "budget", "reason", "recipes", "vacuous_ok", "policy", "audit", "audit_budget",
               "train_store", "layers")
#: Largest seed (``--parity-seed``, ini ``parity_seed``): torch generators take 64-bit seeds, numpy
#: and the shared random stream signed 64-bit ones.
MAX_SEED = 2**63 - 1
#: Recipes with their own ini ``parity_<recipe>_tolerance`` / ``parity_<recipe>_policy`` keys
#: (``bf16-weights`` follows ``bf16``).
OVERRIDABLE_RECIPES = ("fp32", "bf16", "fp16")
#: Path options whose separate value (``--baseline-dir DIR``) pytest reads as a test path while it
#: chooses its rootdir and ini file, before this plugin's options are known.
PATH_OPTIONS = ("--baseline-dir", "--parity-report", "--parity-history")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("npu-parity", "numerical parity of a target device (NPU/CUDA/CPU) with a reference")
    group.addoption("--npu-parity", action="store_true", default=False,
                    help="run the parity suites (tests using the 'parity' fixture); they are skipped otherwise")
    group.addoption("--parity-device", default=None, metavar="DEVICE",
                    help="target device: auto (npu > cuda > cpu), npu, npu:N, cuda, cuda:N or cpu "
                         "(default: ini parity_device or auto); an absent device is an error")
    group.addoption("--parity-reference", default=None, choices=("auto", "cpu", "baseline"),
                    help="what the target is compared with: auto (stored baseline when one exists for the "
                         "check, else a live CPU run), cpu (always a live CPU run) or baseline (a missing "
                         "baseline fails). Default: ini parity_reference or auto")
    group.addoption("--parity-dtypes", default=None, metavar="RECIPES",
                    help="comma-separated recipes to run every parity test under: fp32, bf16, bf16-weights, "
                         "fp16 (autocast fp16; training steps with a dynamic GradScaler) "
                         "(default: ini parity_dtypes or fp32,bf16)")
    group.addoption("--update-baselines", action="store_true", default=False,
                    help="record mode: run each check's reference computation on --parity-device and write "
                         "it to the baseline store (implies --npu-parity)")
    group.addoption("--baseline-dir", default=None, metavar="DIR",
                    help="baseline store root (default: ini parity_baseline_dir or <rootdir>/baselines)")
    group.addoption("--parity-report", default=None, metavar="DIR",
                    help="write results.parquet/csv, summary.md and report.html for this session to DIR")
    group.addoption("--parity-history", default=None, metavar="PATH",
                    help="append this run's results to the history file PATH (trends, new failures)")
    group.addoption("--parity-seed", default=None, type=int, metavar="N",
                    help="seed of the shared random stream of every check (default: ini parity_seed or 0)")
    group.addoption("--parity-rng", default=None, choices=("shared", "device"),
                    help="randomness of sampling checks (parity.check(..., sample_dim=...)): shared (one seeded "
                         "CPU stream for both sides, samples compared one by one; the default) or device (each "
                         "side draws from its own device's generator; the samples are judged as distributions: "
                         "per-step mean and spread, quantiles and energy distance in one permutation test). "
                         "Other checks always share the stream. Default: ini parity_rng or shared")
    group.addoption("--parity-layers", default=None, metavar="LIMIT",
                    help="layer check of fp32 checks: every weighted submodule's output (sampled) within this "
                         "relative L2 error of the reference's, besides the outputs' tolerance; 'off' to judge "
                         "outputs only (default: ini parity_layers or 1e-5). Other recipes: "
                         "@pytest.mark.parity(layers=LIMIT)")
    group.addoption("--parity-worker-devices", default=None, metavar="INDICES",
                    help="pytest-xdist: comma-separated device indices, worker gwK runs on entry K mod n "
                         "(default: ini parity_worker_devices, else gwK runs on index K mod device count)")
    group.addoption("--parity-policy", default=None, choices=("allclose", "golden", "golden-floor"),
                    help="verdict policy of every recipe and check: allclose (rtol/atol/budget), golden (target and "
                         "reference errors against a higher-precision CPU golden run, ratio limits 2/10/2/2) or "
                         "golden-floor (golden, a leaf within allclose passes; the default of bf16 and of fp32 "
                         "training checks; fp32 eval checks default to allclose); "
                         "'golden msprobe op=…' in ini or the marker for msprobe 26.2.0's standard); replaces ini parity_<recipe>_policy, while ini parity_policies lines, the "
                         "marker's policy= and parity.check(policy=...) still choose per check")
    group.addoption("--parity-audit", action="store_true", default=False,
                    help="audit device propagation of every target run (an extra run on a CPU target): events "
                         "beyond a check's audit budget (default: no mixed-device op, host<->device copy, CPU op "
                         "or float64 on the target; host syncs allowed) fail it, or warn with --parity-audit-mode "
                         "warn (default: ini parity_audit, off)")
    group.addoption("--parity-audit-mode", default=None, choices=("fail", "warn", "off"),
                    help="what the audit does with events beyond a check's budget: fail the check or warn; off "
                         "turns the audit off (a mode other than off implies --parity-audit)")
    group.addoption("--parity-localize", action="store_true", default=False,
                    help="localize the first divergence of every failing check of the selected tests, whatever "
                         "the localization budget (e.g. with -k NAME or a node id)")
    group.addoption("--parity-localize-budget", default=None, metavar="SECONDS",
                    help="wall seconds a session may spend localizing failing checks (first-divergence tables); "
                         "later failures say they were not localized and how to localize one; 0 turns "
                         f"localization off (default: ini parity_localize_budget or {_default_budget():g})")
    group.addoption("--parity-selfcheck", action="store_true", default=False,
                    help="prove every check has teeth: after it passes, perturb the target's output (and, for a "
                         "module, one weight) beyond the tolerance and require a failure; also require the "
                         "reference to react to its inputs (about two extra runs per check; see selfcheck)")

    parser.addini("parity_device", "default for --parity-device", default="auto")
    parser.addini("parity_audit", "device-propagation audit of every target run: off (default), fail or warn "
                  "(see --parity-audit, --parity-audit-mode)", default="off")
    parser.addini("parity_reference", "default for --parity-reference", default="auto")
    parser.addini("parity_dtypes", "default for --parity-dtypes", default="fp32,bf16")
    parser.addini("parity_baseline_dir", "default for --baseline-dir (relative to rootdir)", default="baselines")
    parser.addini("parity_seed", "default for --parity-seed", default="0")
    parser.addini("parity_rng", "default for --parity-rng (shared or device)", default="shared")
    parser.addini("parity_lock_timeout", "seconds a record run waits for another record run on the same "
                  "baseline store to finish (default 1800)", default="1800")
    parser.addini("parity_worker_devices", "default for --parity-worker-devices", default="")
    parser.addini("parity_localize_budget", "default for --parity-localize-budget (seconds)",
                  default=str(_default_budget()))
    parser.addini("parity_paths", "what --update-baselines runs when given no path", type="linelist",
                  default=["parity_suites"])
    parser.addini("parity_tolerances", type="linelist", default=[],
                  help="per-check tolerance overrides, one per line: "
                       "'<check name or glob>: rtol=1e-4 atol=1e-4 budget=0 # reason'")
    for recipe in OVERRIDABLE_RECIPES:
        parser.addini(f"parity_{recipe}_tolerance", default="",
                      help=f"override of the {recipe} default tolerance, e.g. 'rtol=1e-5 atol=1e-5 # reason'")
        parser.addini(f"parity_{recipe}_policy", default="",
                      help=f"verdict policy of {recipe} checks{' (and bf16-weights)' if recipe == 'bf16' else ''}: "
                           "'allclose' (default) or 'golden [rmse=2 max_rel=10 mean_rel=2 small=2] [# reason]'")
    parser.addini("parity_deepspeed_config", default="",
                  help="a DeepSpeed JSON config (relative to rootdir) to lint by the Ascend guide's rules at start-up "
                       "(bf16 on, fp16 off, no communication_backend, no aio): a summary in the header, each "
                       "finding a PytestConfigWarning; a missing or non-JSON file is a usage error")
    parser.addini("parity_layers", default="",
                  help="default for --parity-layers: the layer check's relative L2 limit of fp32 checks, or 'off' "
                       "(default 1e-5)")
    parser.addini("parity_train_store", default="full",
                  help="how training-step baselines keep gradients and parameters: 'full' (default) or 'summary "
                       "[min_numel=65536] [samples=4096]' (leaves with at least min_numel elements stored as that "
                       "many sampled elements plus sum, L2 norm, max |x| and a position-weighted sum)")
    parser.addini("parity_policies", type="linelist", default=[],
                  help="per-check verdict policy, one per line: '<check name or glob>: golden [rmse=3 …] # reason' "
                       "or '<check name or glob>: allclose'")


def _audit_mode(config: pytest.Config) -> str:
    """The session's audit mode (off, fail, warn): ``--parity-audit-mode``; else with
    ``--parity-audit`` ini ``parity_audit`` when it names fail or warn, else fail; else ini
    ``parity_audit`` (default off)."""
    value = str(config.getini("parity_audit") or "off").strip().lower()
    if value not in ("off", "fail", "warn"):
        raise pytest.UsageError(f"ini parity_audit={value!r}: use off, fail or warn")
    option = config.getoption("parity_audit_mode")
    if option is not None:
        return option
    if config.getoption("parity_audit"):
        return value if value != "off" else "fail"
    return value


def _default_budget() -> float:
    from .localize import DEFAULT_BUDGET_S

    return DEFAULT_BUDGET_S


def _localize_budget(config: pytest.Config) -> float:
    """Seconds of ``--parity-localize-budget`` (or ini ``parity_localize_budget``); a usage error otherwise."""
    option = config.getoption("parity_localize_budget")
    where = "--parity-localize-budget" if option is not None else "ini parity_localize_budget"
    value = option if option is not None else config.getini("parity_localize_budget")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (seconds >= 0 and seconds != float("inf")):
        raise pytest.UsageError(f"{where}={value!r}: give the seconds localization may take in this session, a "
                                "number >= 0 (0 turns it off); --parity-localize localizes the selected tests "
                                "whatever the budget")
    return seconds


def _opt(config: pytest.Config, name: str, ini: str) -> Any:
    value = config.getoption(name)
    return config.getini(ini) if value is None else value


def parity_enabled(config: pytest.Config) -> bool:
    """True when this session runs parity checks (``--npu-parity`` or ``--update-baselines``)."""
    return bool(config.getoption("npu_parity") or config.getoption("update_baselines"))


def _recipe_names(config: pytest.Config) -> list[str]:
    from .recipes import parse_recipes

    try:
        return [r.name for r in parse_recipes(_opt(config, "parity_dtypes", "parity_dtypes"))]
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def _tolerance_overrides(config: pytest.Config) -> tuple[dict, dict]:
    from .policy import default_for_recipe, parse_tolerance_spec

    per_check: dict = {}
    per_recipe: dict = {}
    try:
        for recipe in OVERRIDABLE_RECIPES:
            spec = config.getini(f"parity_{recipe}_tolerance").strip()
            if spec:
                per_recipe[recipe] = parse_tolerance_spec(spec, source="ini", base=default_for_recipe(recipe))
        for line in config.getini("parity_tolerances"):
            pattern, sep, spec = line.partition(":")
            if not sep:
                raise ValueError(f"parity_tolerances line {line!r} needs '<check>: rtol=… atol=…'")
            parse_tolerance_spec(spec, source="ini", base=default_for_recipe("fp32"))  # validate now
            if not pattern.strip():
                config.issue_config_time_warning(pytest.PytestConfigWarning(
                    f"ini parity_tolerances line {line!r} has an empty check pattern and is ignored; "
                    "write '<check name or glob>: rtol=… atol=…'"), stacklevel=2)
                continue
            per_check[pattern.strip()] = spec  # parsed per recipe, over that recipe's default
    except ValueError as exc:
        raise pytest.UsageError(f"ini: {exc}") from None
    return per_check, per_recipe


def _policy_overrides(config: pytest.Config) -> tuple[dict, dict]:
    """``(per recipe, per check)`` verdict policy specs from ``--parity-policy`` and the ini keys,
    validated now (a bad spec is a usage error naming the key)."""
    from .golden import parse_policy_spec

    per_recipe: dict = {}
    per_check: dict = {}
    option = (config.getoption("parity_policy") or "").replace("golden-floor", "golden floor") or None
    for recipe in OVERRIDABLE_RECIPES:
        key = f"parity_{recipe}_policy"
        spec = option or config.getini(key).strip()
        if spec:
            where = "--parity-policy" if option else f"ini {key}"
            try:
                per_recipe[recipe] = parse_policy_spec(spec, source="ini", recipe=recipe)
            except ValueError as exc:
                raise pytest.UsageError(f"{where}: {exc}") from None
    if "bf16" in per_recipe:  # bf16-weights is bf16 work too
        per_recipe.setdefault("bf16-weights", per_recipe["bf16"])
    for line in config.getini("parity_policies"):
        pattern, sep, spec = line.partition(":")
        try:
            if not sep or not pattern.strip():
                raise ValueError(f"line {line!r} needs '<check or glob>: golden …' or '<check or glob>: allclose'")
            parse_policy_spec(spec.strip(), source="ini", recipe="fp32")
        except ValueError as exc:
            raise pytest.UsageError(f"ini parity_policies: {exc}") from None
        per_check[pattern.strip()] = spec.strip()
    return per_recipe, per_check


def _hypothesis_profiles(config: pytest.Config) -> None:
    """Register the ``npu-parity-ci`` and ``nightly`` hypothesis profiles (``strategies.register_profiles``)
    and, in a parity session whose user chose no profile, load ``npu-parity-ci`` (bounded, derandomized).

    Runs before hypothesis' own ``pytest_configure`` (``tryfirst`` below), which loads
    ``--hypothesis-profile``: so ``--hypothesis-profile nightly`` finds the profile, and an explicit
    choice is never overridden.
    """
    try:
        from hypothesis import settings

        from . import strategies
    except ImportError:  # hypothesis missing: nothing to configure (the property tests cannot run)
        return
    strategies.register_profiles()
    if parity_enabled(config):
        current = strategies.current_profile_name()
        name = strategies.profile_to_load(config.getoption("hypothesis_profile", default=None), current)
        if name:
            config.stash[PROFILE_KEY] = current  # restored at unconfigure (in-process pytester runs)
            settings.load_profile(name)


def pytest_unconfigure(config: pytest.Config) -> None:
    _release_store(config)
    previous = config.stash.get(PROFILE_KEY, None)
    if previous is not None:
        from hypothesis import settings

        settings.load_profile(previous)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _hypothesis_profiles(config)
    config.addinivalue_line(
        "markers",
        "parity(rtol=None, atol=None, budget=None, reason=None, recipes=None, vacuous_ok=None, policy=None, "
        "audit=None, audit_budget=None, train_store=None, layers=None): "
        "tolerance override for every check of the test (shown in the report with its reason), the recipes it "
        "runs under, why its checks may be vacuous (constant reference output, no teeth under "
        "--parity-selfcheck), their verdict policy ('allclose' or 'golden [rmse=… # reason]'), the test's "
        "device-propagation audit mode ('fail', 'warn', 'off') and what its target runs may do "
        "(audit_budget={'h2d': 2} or 'h2d=2 host_sync=any # reason') and how its training steps are recorded "
        "('full' or 'summary [min_numel=N samples=K]') and the layer check of its checks (False, or a relative "
        "L2 limit per weighted layer)",
    )
    config.stash[CASES_KEY] = []
    config.stash[ROWS_KEY] = []
    config.stash[COLLECTED_KEY] = []
    config.stash[OUTCOME_KEY] = {}
    if config.getoption("update_baselines"):
        _record_parity_paths(config)
    if not parity_enabled(config):
        return
    _validate_paths(config)
    from .npu import explain_import_error, import_torch

    try:  # a broken torch_npu can break `import torch` itself: say why, in one sentence
        import_torch()
    except Exception as exc:  # noqa: BLE001 - any import failure becomes a usage error
        raise pytest.UsageError(explain_import_error(exc)) from None
    _recipe_names(config)  # validate early
    config.stash[SESSION_KEY] = _make_session(config)
    _lint_deepspeed_config(config)
    config.pluginmanager.register(_StaleSuiteReport(), "npu-parity-stale-suites")


def _lint_deepspeed_config(config: pytest.Config) -> None:
    """Lint ini ``parity_deepspeed_config`` (``deepspeed_config.lint_file``): findings are kept for the header
    and each is issued as a ``PytestConfigWarning`` (warnings summary; ``-W error`` makes them errors). They
    are advice on a training config, not parity results, so they never fail the run by themselves.

    Raises:
        pytest.UsageError: the file is missing or not a JSON object (one sentence naming it).
    """
    value = str(config.getini("parity_deepspeed_config") or "").strip()
    if not value:
        return
    from .deepspeed_config import DeepSpeedConfigError, lint_config, load_config

    path = Path(value).expanduser()
    shown = value if path.is_absolute() else str(Path(value))
    path = path if path.is_absolute() else config.rootpath / path
    try:
        findings = lint_config(load_config(path), shown)  # findings name the file as the ini does
    except DeepSpeedConfigError as exc:
        raise pytest.UsageError(f"ini parity_deepspeed_config: {exc}") from None
    config.stash[DEEPSPEED_LINT_KEY] = (shown, findings)
    for finding in findings:
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"parity_deepspeed_config {finding.severity}: {finding.message}"), stacklevel=2)


def _deepspeed_header(config: pytest.Config) -> str | None:
    linted = config.stash.get(DEEPSPEED_LINT_KEY, None)
    if linted is None:
        return None
    shown, findings = linted
    if not findings:
        return f"npu-parity: DeepSpeed config {shown}: follows the guide's rules (bf16 on, fp16 off, no " \
               "communication_backend, no aio)"
    errors = sum(f.severity == "error" for f in findings)
    keys = ", ".join(f.key for f in findings)
    return (f"npu-parity: DeepSpeed config {shown}: {errors} error(s), {len(findings) - errors} warning(s) ({keys}); "
            "see the warnings summary")


def _record_parity_paths(config: pytest.Config) -> None:
    """Make ``pytest --update-baselines`` with no path record the parity suites (ini ``parity_paths``).

    Without paths pytest runs ``testpaths`` (usually the unit tests) or the invocation directory;
    ``config.args_source`` (pytest >= 7.2) tells these apart from paths the user typed, which are
    kept as they are. A run started inside one of the parity paths keeps its directory (it records
    that suite only). Parity paths that do not exist are ignored; with none left the args stay.
    """
    source = getattr(config, "args_source", None)
    if source is None or source == pytest.Config.ArgsSource.ARGS:
        return
    paths = [Path(config.rootpath, p).resolve() for p in config.getini("parity_paths")]
    paths = [p for p in paths if p.exists()]
    invocation = Path(config.invocation_params.dir).resolve()
    if not paths or any(invocation.is_relative_to(p) for p in paths):
        return
    config.args[:] = [str(p) for p in paths]


def _make_session(config: pytest.Config):
    from .devices import DeviceUnavailableError, resolve_worker_target
    from .runner import ParitySession

    try:
        # Under pytest-xdist each worker (gwK) pins its own device; see devices.pinned_device.
        target = resolve_worker_target(_opt(config, "parity_device", "parity_device"), _xdist_worker_id(config),
                                       _opt(config, "parity_worker_devices", "parity_worker_devices") or None)
    except (ValueError, DeviceUnavailableError) as exc:
        raise pytest.UsageError(str(exc)) from None
    _launch(config, target)
    reference = _opt(config, "parity_reference", "parity_reference")
    if reference not in ("auto", "cpu", "baseline"):
        raise pytest.UsageError(f"ini parity_reference={reference!r}: use auto, cpu or baseline")
    per_check, per_recipe = _tolerance_overrides(config)
    recipe_policies, check_policies = _policy_overrides(config)
    seed = _seed(config)
    rng = _opt(config, "parity_rng", "parity_rng")
    if rng not in ("shared", "device"):
        raise pytest.UsageError(f"ini parity_rng={rng!r}: use shared or device")
    from . import localize, selfcheck
    from .runner import target_audit

    return ParitySession(
        target, reference=reference, update_baselines=config.getoption("update_baselines"),
        store=_make_store(config), check_tolerances=per_check, recipe_tolerances=per_recipe, seed=seed,
        # Always available, so that @pytest.mark.parity(audit=...) can audit one test; a CPU target is
        # audited as a logical device. The session mode says whether the other tests are audited.
        audit_factory=target_audit, audit_mode=_audit_mode(config),
        failure_hooks=[localize.Localizer(_localize_budget(config), forced=config.getoption("parity_localize"),
                                          hint=localize_command(config))],
        check_hooks=[selfcheck.SelfCheck()] if config.getoption("parity_selfcheck") else [],
        recipe_policies=recipe_policies, check_policies=check_policies, rng=rng, train_store=_train_store(config),
        layers=_layers(config),
    )


def _is_xdist_controller(config: pytest.Config) -> bool:
    """True in the pytest-xdist controller of a distributed run: it runs no test (its workers do),
    so it binds no device. xdist's own test (``plugin._is_distribution_mode``): ``--dist`` not ``no``
    and test environments (``--tx``, set from ``-n``), and not ``--collect-only``."""
    if getattr(config, "workerinput", None) is not None:
        return False
    option = config.option
    return (getattr(option, "dist", "no") != "no" and bool(getattr(option, "tx", None))
            and not getattr(option, "collectonly", False))


def _launch(config: pytest.Config, target: Any) -> None:
    """On an NPU target, before any suite imports aurora: the launcher steps of the Ascend guide
    (``npu.launch``: transfer_to_npu, compile mode, ``torch.npu.set_device``), in every process that
    runs tests (each xdist worker with its own pinned device). A CPU/CUDA target: nothing."""
    if target.type != "npu" or _is_xdist_controller(config):
        return
    from .npu import LaunchOrderError, launch

    try:
        launch(target)
    except (LaunchOrderError, RuntimeError, ValueError, ImportError) as exc:  # ImportError: transfer_to_npu
        raise pytest.UsageError(f"--parity-device={target}: {exc}") from None


def _layers(config: pytest.Config):
    """``--parity-layers`` / ini ``parity_layers`` as a ``layers.LayerPolicy`` (None: off), or
    ``"default"`` when neither is set; a usage error naming the option otherwise."""
    from .layers import parse_layer_spec

    value, where = config.getoption("parity_layers"), "--parity-layers"
    if value is None:
        value, where = config.getini("parity_layers"), "ini parity_layers"
    if value is None or not str(value).strip():
        return "default"
    try:
        return parse_layer_spec(value, source="option" if where.startswith("--") else "ini")
    except ValueError as exc:
        raise pytest.UsageError(f"{where}={value!r}: {exc}") from None


def _train_store(config: pytest.Config):
    """ini ``parity_train_store`` as a ``compact.TrainStore``; a usage error naming the key otherwise."""
    from .compact import parse_train_store

    value = config.getini("parity_train_store")
    try:
        return parse_train_store(value, source="ini")
    except ValueError as exc:
        raise pytest.UsageError(f"ini parity_train_store={value!r}: {exc}") from None


def _seed(config: pytest.Config) -> int:
    """The session seed (``--parity-seed`` or ini ``parity_seed``), range-checked.

    Raises:
        pytest.UsageError: not an integer, or outside 0..``MAX_SEED``; names the option.
    """
    option = config.getoption("parity_seed")
    where = "--parity-seed" if option is not None else "ini parity_seed"
    value = option if option is not None else config.getini("parity_seed")
    try:
        seed = int(str(value).strip())
    except ValueError:
        raise pytest.UsageError(f"{where}={value!r} is not an integer; use an integer from 0 to {MAX_SEED}") from None
    if not 0 <= seed <= MAX_SEED:
        raise pytest.UsageError(f"{where}={seed} is out of range; use an integer from 0 to 2**63-1 ({MAX_SEED})")
    return seed


def _baseline_root(config: pytest.Config) -> tuple[Path, str]:
    """(the store root, the option or ini key that named it)."""
    option = config.getoption("baseline_dir")
    root = Path(option if option is not None else config.getini("parity_baseline_dir")).expanduser()
    if not root.is_absolute():  # a command-line path is relative to where pytest runs, an ini one to rootdir
        root = (Path(config.invocation_params.dir) if option is not None else config.rootpath) / root
    return root, ("--baseline-dir" if option is not None else "ini parity_baseline_dir")


def _make_store(config: pytest.Config):
    from .baselines import SuiteStores

    return SuiteStores(_baseline_root(config)[0], update_command=rerun_command(config, "--update-baselines"))


#: Options a record command depends on (which file, which recipes, which seed, which ini and
#: rootdir), as (dest, flag); ``rerun_command`` repeats those given on the command line or in
#: PYTEST_ADDOPTS/addopts. The target device is not one of them: a baseline is recorded on the
#: trusted machine's device, whatever the failing run's target was.
RECORD_OPTIONS = (("inifilename", "-c"), ("rootdir", "--rootdir"), ("baseline_dir", "--baseline-dir"),
                  ("parity_dtypes", "--parity-dtypes"), ("parity_seed", "--parity-seed"))
#: Options a localizing re-run depends on besides those: the same target, reference and verdict.
LOCALIZE_OPTIONS = RECORD_OPTIONS + (("parity_device", "--parity-device"), ("parity_reference", "--parity-reference"),
                                     ("parity_policy", "--parity-policy"))


def rerun_command(config: pytest.Config, mode: str, options: tuple = RECORD_OPTIONS) -> str:
    """The command, without test ids, that re-runs this session's parity tests in ``mode``
    (``--update-baselines``, or ``--npu-parity --parity-localize``), repeating every option of
    ``options`` this run was given (``--baseline-dir=DIR``, ``--parity-dtypes=…``, ``-c FILE`` …):
    without them the hint would look for another store or run other recipes. Test ids are relative
    to the rootdir, so when pytest was started elsewhere the command starts with ``cd <rootdir> &&``
    and path values are made absolute.
    """
    import shlex

    invocation = Path(config.invocation_params.dir)
    elsewhere = invocation.resolve() != Path(config.rootpath).resolve()
    words = ["pytest", *mode.split()]
    for dest, flag in options:
        value = getattr(config.option, dest, None)
        if value is None or value == "":
            continue
        if dest in ("inifilename", "rootdir", "baseline_dir") and elsewhere:
            value = str((invocation / Path(str(value)).expanduser()).resolve())
        words.append(f"{flag}={value}" if flag.startswith("--") else flag)
        if not flag.startswith("--"):
            words.append(str(value))
    command = " ".join(shlex.quote(w) for w in words)
    return f"cd {shlex.quote(str(config.rootpath))} && {command}" if elsewhere else command


def localize_command(config: pytest.Config) -> str:
    """``rerun_command`` for localizing one failing check (``{test_id}`` stands for its test id)."""
    return rerun_command(config, "--npu-parity --parity-localize", LOCALIZE_OPTIONS).replace(
        "{", "{{").replace("}", "}}") + " {test_id}"


def _creatable(path: Path, kind: str) -> str | None:
    """Why ``path`` cannot be (or be written as) a ``kind`` (``"directory"``/``"file"``), or None."""
    if path.exists():
        if kind == "directory" and not path.is_dir():
            return "is a file, not a directory"
        if kind == "file" and path.is_dir():
            return "is a directory, not a file"
        target = path if kind == "directory" else path.parent
        return None if os.access(target, os.W_OK | os.X_OK) else f"{'is' if target == path else 'lies in'} " \
            "a directory this process cannot write to"
    ancestor = path.parent
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot be created: {ancestor} is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be created: {ancestor} is not writable"
    return None


def _validate_paths(config: pytest.Config) -> None:
    """Start-up checks of the path options (a usage error naming the option and the fix):
    a separate value that moved pytest's rootdir, a report/history path that cannot be created,
    a baseline store that is a file, or (record mode) one this process cannot write to."""
    for name in PATH_OPTIONS:
        _refuse_rootdir_move(config, name)
    invocation = Path(config.invocation_params.dir)
    for option, name, kind in (("parity_report", "--parity-report", "directory"),
                               ("parity_history", "--parity-history", "file")):
        value = config.getoption(option)
        if value is None:
            continue
        if not str(value).strip():
            raise pytest.UsageError(f"{name} is empty; give a {kind} path")
        why = _creatable(invocation / Path(value).expanduser(), kind)
        if why:
            raise pytest.UsageError(f"{name}={value}: {why}; pick another path")
        if name == "--parity-history" and Path(value).suffix.lower() not in (".parquet", ".csv"):
            raise pytest.UsageError(f"{name}={value}: the history file must end in .parquet or .csv")
    root, where = _baseline_root(config)
    if root.exists() and not root.is_dir():
        raise pytest.UsageError(f"{where}={root} is a file, not a directory; point it at the baseline "
                                "directory (created on the first --update-baselines run)")
    if config.getoption("update_baselines"):
        from .baselines import SuiteStores

        bad = SuiteStores(root).unwritable()
        if bad:
            shown = ", ".join(str(p) for p in bad[:5]) + (" …" if len(bad) > 5 else "")
            raise pytest.UsageError(
                f"--update-baselines cannot write to the baseline store {root} ({where}): not writable: {shown}; "
                "fix its permissions or record into another --baseline-dir=DIR")
    timeout = config.getini("parity_lock_timeout")
    try:
        if float(timeout) < 0:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"ini parity_lock_timeout={timeout!r}: give seconds, a number >= 0") from None


def _refuse_rootdir_move(config: pytest.Config, name: str) -> None:
    """Usage error when ``name DIR`` (separate value) was given, ``DIR`` exists and pytest, which
    reads it as a test path before this plugin's options are known, chose another rootdir or ini
    file than without it.

    Why this cannot be repaired here: ``Config.parse`` (``_pytest/config/__init__.py``, pytest 7.4
    to 9.x) calls ``determine_setup(args=ns.file_or_dir, …)`` on the command line and
    ``PYTEST_ADDOPTS`` *before* it loads the ``pytest11`` entry points that register this plugin's
    options, so ``--parity-report DIR`` is an unknown option followed by a free argument, and
    ``findpaths.get_dirs_from_args`` takes every existing free argument as a test path for the
    rootdir and ini-file search. Rootdir, ini file, ``addopts`` and the node ids are fixed by the
    time any plugin hook runs; a run on the moved rootdir would look for baselines, ini keys and
    test ids elsewhere. Ini ``addopts`` are read after that search and cannot move it.
    """
    import shlex

    sources = [(list(config.invocation_params.args), "")]
    env = os.environ.get("PYTEST_ADDOPTS", "")
    if env.strip():
        try:
            sources.append((shlex.split(env), " (in PYTEST_ADDOPTS)"))
        except ValueError:
            pass  # pytest itself reports an unparsable PYTEST_ADDOPTS
    invocation = Path(config.invocation_params.dir)
    for args, where in sources:
        values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
        for value in values:
            if not (invocation / value).exists():
                continue
            moved = _setup_without(config, value)
            if moved:
                raise pytest.UsageError(
                    f"{name} {value}{where}: pytest took the separate value for a test path while choosing its "
                    f"rootdir and ini file ({moved}); write {name}={value} with '='")


def _setup_without(config: pytest.Config, value: str) -> str | None:
    """How pytest's rootdir/ini file differ from those it would pick if ``value`` were no test path
    (text), or None when they are the same. Unknown pytest internals count as different."""
    try:
        from _pytest.config.findpaths import determine_setup
    except ImportError:
        return "it may have moved"
    args = [str(a) for a in (config.option.file_or_dir or [])]
    kwargs = dict(inifile=config.option.inifilename, args=args, rootdir_cmd_arg=config.option.rootdir or None)
    try:
        try:
            found = determine_setup(**kwargs, override_ini=config.option.override_ini,
                                    invocation_dir=config.invocation_params.dir)
        except TypeError:  # pytest 7: (inifile, args, rootdir_cmd_arg, config)
            found = determine_setup(kwargs["inifile"], args, kwargs["rootdir_cmd_arg"], config=config)
    except Exception:  # noqa: BLE001 - be safe: report it
        return "it may have moved"
    rootpath, inipath = Path(found[0]), found[1]
    if (rootpath, inipath and Path(inipath)) == (config.rootpath, config.inipath):
        return None
    return (f"rootdir {config.rootpath} instead of {rootpath}, ini file {config.inipath or 'none'} "
            f"instead of {inipath or 'none'}")


def _xdist_worker_id(config: pytest.Config) -> str | None:
    """``gwK`` inside a pytest-xdist worker, else None."""
    return (getattr(config, "workerinput", None) or {}).get("workerid")


def _worker_pinning_line(config: pytest.Config) -> str | None:
    """Header line naming each xdist worker's device (the controller's own target is worker 0's)."""
    workers = getattr(config.option, "numprocesses", None)
    if not isinstance(workers, int) or workers < 1 or getattr(config.option, "dist", "no") == "no":
        return None
    from .devices import resolve_worker_target

    spec = _opt(config, "parity_device", "parity_device")
    mapping = _opt(config, "parity_worker_devices", "parity_worker_devices") or None
    pins = [f"gw{k}→{resolve_worker_target(spec, f'gw{k}', mapping)}" for k in range(min(workers, 8))]
    return "npu-parity: xdist workers " + ", ".join(pins) + (" …" if workers > 8 else "")


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not parity_enabled(config):
        return ["npu-parity: off (parity suites are skipped; run with --npu-parity)"]
    import torch

    from .npu import npu_status
    from .recipes import precision_flags, strict_fp32_flags

    session = config.stash[SESSION_KEY]
    status = npu_status()
    mode = "recording baselines" if session.update_baselines else f"reference {session.reference}"
    with strict_fp32_flags():
        flags = precision_flags()
    lines = [
        f"npu-parity: target {session.target} ({session.target_name}) · {mode} · recipes "
        f"{','.join(_recipe_names(config))} · baselines {session.store.root}",
        f"npu-parity: torch {torch.__version__} · torch_npu {status.torch_npu_version or '-'} · "
        f"CANN {status.cann_version or '-'} · precision flags "
        + " ".join(f"{k}={v}" for k, v in flags.items()),
    ]
    def verdict(recipe: str) -> str:
        text = _policy_text(session.verdict_policy(recipe, ''), session.tolerance(recipe, ''))
        training = _policy_text(session.verdict_policy(recipe, '', training=True), session.tolerance(recipe, ''))
        return f"{recipe} {text}" + (f" (training checks: {training})" if training != text else "")

    audit = _audit_mode(config)
    if audit != "off":
        from .audit import DEFAULT_LOGICAL_TARGET

        lines.append(f"npu-parity: audit {audit} · default audit budget {session.audit_budget.describe()}"
                     + (f" · a CPU target is audited as the logical device {DEFAULT_LOGICAL_TARGET}"
                        if session.target.type == "cpu" else ""))
    if session.rng == "device":
        lines.append("npu-parity: random streams: sampling checks draw from each side's own device generator and "
                     f"are judged as distributions ({session.distribution_policy.describe()}); other checks share "
                     "one seeded CPU stream")
    lines.append("npu-parity: verdicts " + " · ".join(verdict(recipe) for recipe in _recipe_names(config)) + (" (per-check choices in parity_policies)" if session.check_policies else ""))
    layered = [(r, session.layer_policy(r)) for r in _recipe_names(config)]
    lines.append("npu-parity: layer check " + (" · ".join(f"{r}: {p.describe()}" for r, p in layered if p is not None)
                                               or "off") + " (--parity-layers)")
    if session.target.type != "npu" and not status.available and (status.torch_npu_version or _npu.quarantined()):
        lines.append(f"npu-parity: torch_npu is installed but the NPU is not used: {status.reason}")
    deepspeed = _deepspeed_header(config)
    if deepspeed:
        lines.append(deepspeed)
    record = _npu.launched() if session.target.type == "npu" else None
    if record is not None:
        lines.append(f"npu-parity: launcher (before any import of aurora): {record.describe()}")
    elif session.target.type == "npu" and _is_xdist_controller(config):
        lines.append("npu-parity: launcher (before any import of aurora): in every xdist worker, transfer_to_npu → "
                     "set_compile_mode(jit_compile=False) → set_device(<the worker's device>)")
    warning = _npu.fp16_warning(session.target, _recipe_names(config))
    if warning:
        lines.append(f"npu-parity: {warning}")
    pinning = _worker_pinning_line(config)
    return lines + [pinning] if pinning else lines


def _policy_text(golden_policy: Any, tolerance: Any) -> str:
    """``allclose rtol=1e-05 atol=1e-05 budget=0`` or the golden policy's description."""
    if golden_policy is not None:
        return golden_policy.describe()
    return f"allclose rtol={tolerance.rtol:g} atol={tolerance.atol:g} budget={tolerance.budget:g}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "parity_recipe" not in metafunc.fixturenames:
        return
    names = _recipe_names(metafunc.config)
    marker = metafunc.definition.get_closest_marker("parity")
    allowed = _marker_recipes(marker.kwargs.get("recipes")) if marker else None
    if allowed is not None:
        names = [n for n in names if n in allowed]  # whole names: "bf16-weights" never selects bf16
    if names:
        metafunc.parametrize("parity_recipe", names, ids=names)
    else:
        metafunc.parametrize("parity_recipe", [pytest.param(None, marks=pytest.mark.skip(
            reason=f"none of the recipes {allowed} is selected by --parity-dtypes"))], ids=["no-recipe"])


def _marker_recipes(value: Any) -> list[str] | None:
    """The ``recipes=`` of a parity marker as a list of names: a string is one name or a
    comma-separated list (``"bf16-weights"``, ``"fp32,bf16"``), a list/tuple/set its items; None for
    None. Items that are not strings are kept (``_marker_problems`` reports them)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [v.strip() if isinstance(v, str) else v for v in value]
    return [value]


def _marker_problems(marker: Any) -> list[str]:
    """What is wrong with one ``@pytest.mark.parity(...)``: unknown keywords, positional arguments,
    values of the wrong type or range, unknown recipe or policy names."""
    import numbers

    from .golden import parse_policy_spec
    from .recipes import RECIPES

    problems = []
    if marker.args:
        problems.append(f"positional arguments {marker.args!r}; use keywords ({', '.join(MARKER_KEYS)})")
    for key in marker.kwargs:
        if key not in MARKER_KEYS:
            import difflib

            close = difflib.get_close_matches(key, MARKER_KEYS, n=1)
            problems.append(f"unknown keyword {key}=" + (f" (did you mean {close[0]}=?)" if close else "")
                            + f"; known: {', '.join(MARKER_KEYS)}")
    for key in ("rtol", "atol", "budget"):
        value = marker.kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0):
            problems.append(f"{key}={value!r} must be a number >= 0")
    for key in ("reason", "vacuous_ok", "policy", "train_store"):
        value = marker.kwargs.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            problems.append(f"{key}={value!r} must be a non-empty string")
    recipes = _marker_recipes(marker.kwargs.get("recipes"))
    if recipes is not None:
        unknown = [r for r in recipes if r not in RECIPES]
        if unknown or not recipes:
            problems.append(f"recipes={marker.kwargs['recipes']!r}: "
                            + (f"unknown recipe(s) {', '.join(map(repr, unknown))}" if unknown else "no recipe")
                            + f"; known: {', '.join(RECIPES)}")
    audit = marker.kwargs.get("audit")
    if audit is not None and audit not in ("off", "fail", "warn"):
        problems.append(f"audit={audit!r} must be 'fail', 'warn' or 'off'")
    from .audit import parse_audit_budget
    from .compact import parse_train_store
    from .layers import parse_layer_spec

    # Keywords whose value an engine parser judges; a policy or train store that is not a non-empty
    # string is reported above, and their own text is repeated in the message.
    parsers = {"audit_budget": lambda v: parse_audit_budget(v, source="marker"),
               "policy": lambda v: parse_policy_spec(v, source="marker", recipe="fp32"),
               "layers": lambda v: parse_layer_spec(v, source="marker"),
               "train_store": lambda v: parse_train_store(v, source="marker")}
    for key, parse in parsers.items():
        value = marker.kwargs.get(key)
        quoted = key in ("policy", "train_store")
        if value is None or (quoted and not (isinstance(value, str) and value.strip())):
            continue
        try:
            parse(value)
        except (ValueError, TypeError) as exc:
            problems.append(f"{key}={value!r}: {exc}" if quoted else f"{key}=: {exc}")
    return problems


def _validate_markers(items: list[pytest.Item]) -> None:
    """One usage error listing every bad ``@pytest.mark.parity`` among the collected tests."""
    seen: dict[int, list[str]] = {}
    lines = []
    for item in items:
        for marker in item.iter_markers("parity"):
            key = id(marker.mark) if hasattr(marker, "mark") else id(marker)
            problems = seen.get(key)
            if problems is None:
                problems = seen[key] = _marker_problems(marker)
                lines += [f"  {item.nodeid}: {p}" for p in problems]
    if lines:
        raise pytest.UsageError("@pytest.mark.parity: bad arguments\n" + "\n".join(lines))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if parity_enabled(config):
        _validate_markers(items)
        # Before -k/-m deselection: every collected test keeps its baseline (see _unused_baselines).
        config.stash[COLLECTED_KEY] = [item.nodeid for item in items]
        return
    skip = pytest.mark.skip(reason=_SKIP_REASON)
    for item in items:
        if "parity" in getattr(item, "fixturenames", ()) or item.get_closest_marker("parity"):
            item.add_marker(skip)


def _marker_tolerance(node: pytest.Item, recipe: str):
    from .policy import default_for_recipe

    marker = node.get_closest_marker("parity")
    if marker is None:
        return None
    values = {k: marker.kwargs[k] for k in ("rtol", "atol", "budget") if marker.kwargs.get(k) is not None}
    if not values:
        return None
    return default_for_recipe(recipe).replace(**values, source="marker", reason=marker.kwargs.get("reason"))


@pytest.fixture
def parity_recipe(request: pytest.FixtureRequest) -> str:
    """The recipe this test runs under (``fp32``, ``bf16``, …); parametrized from ``--parity-dtypes``."""
    return getattr(request, "param", "fp32")


@pytest.fixture
def parity_patches():
    """``(device) -> context manager`` applying a patch set to target runs; override it in a suite's
    conftest (the Aurora suite returns its NPU patch set). Default: no patches."""
    return None


@pytest.fixture
def parity_audit_budget():
    """What the target runs of this suite's checks may do under ``--parity-audit``: a dict
    (``{"h2d": 2, "host_sync": None}``), a spec string (``"h2d=2 # reason"``) or an
    ``audit.AuditBudget``, over the default (``audit.DEFAULT_AUDIT_BUDGET``). Override it in a
    suite's conftest; ``@pytest.mark.parity(audit_budget=...)`` and ``parity.check(audit_budget=...)``
    refine it per test and check. Default: None (the default budget)."""
    return None


@pytest.fixture(scope="session")
def parity_session(pytestconfig: pytest.Config):
    """The session-wide ``runner.ParitySession`` (target device, reference mode, records)."""
    if SESSION_KEY not in pytestconfig.stash:
        pytest.skip(_SKIP_REASON)
    return pytestconfig.stash[SESSION_KEY]


@pytest.fixture
def parity(request: pytest.FixtureRequest, parity_session, parity_recipe: str, parity_patches,
           parity_audit_budget) -> Iterator[Any]:
    """Run and compare computations on the reference and the target device.

    ``parity.check(name, module_or_fn, *args, **kwargs)`` runs on both sides and compares every
    output leaf; ``parity.train_step(name, module, inputs, labels=..., loss_fn=...)`` compares one
    optimizer step (``loss_fn(output, labels)``);
    ``parity.compare(name, actual, expected)`` judges outputs you computed. See ``runner.ParityCase``.
    """
    from .audit import parse_audit_budget
    from .runner import ParityCase

    marker = request.node.get_closest_marker("parity")
    try:
        budget = parse_audit_budget(parity_audit_budget, source="suite", base=parity_session.audit_budget)
    except ValueError as exc:
        raise pytest.UsageError(f"{request.node.nodeid}: the parity_audit_budget fixture: {exc}") from None
    try:
        if marker is not None and marker.kwargs.get("audit_budget") is not None:
            budget = parse_audit_budget(marker.kwargs["audit_budget"], source="marker", base=budget)
        case = ParityCase(parity_session, request.node.nodeid, parity_recipe,
                          marker_tolerance=_marker_tolerance(request.node, parity_recipe), patches=parity_patches,
                          vacuous_ok=marker.kwargs.get("vacuous_ok") if marker else None,
                          marker_policy=marker.kwargs.get("policy") if marker else None,
                          audit_budget=budget, audit_mode=marker.kwargs.get("audit") if marker else None,
                          marker_train_store=marker.kwargs.get("train_store") if marker else None,
                          marker_layers=marker.kwargs.get("layers") if marker else None)
    except (ValueError, TypeError) as exc:  # a bad policy= or train_store= in the marker
        raise pytest.UsageError(f"{request.node.nodeid}: @pytest.mark.parity: {exc}") from None
    request.config.stash[CASES_KEY].append(case)
    yield case
    # Only a test whose body ran to its end writes its baseline: a failure, pytest.skip() between
    # checks or Ctrl-C (no call report at all) leaves the old file as it was.
    case.finish(outcome=request.config.stash[OUTCOME_KEY].get(request.node.nodeid, "interrupted"))
    if case.records and getattr(request.config.option, "xmlpath", None):
        # JUnit <testcase><properties>: user_properties work under every junit_family (the
        # record_property fixture warns under the default xunit2) and travel across xdist workers.
        from .report import junit_properties

        request.node.user_properties.extend(junit_properties([row for r in case.records for row in r.rows()]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    # The call phase's report exists before fixture teardown, where the parity fixture writes baselines.
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.config.stash[OUTCOME_KEY][item.nodeid] = report.outcome  # passed, failed or skipped
        if report.failed:
            _shorten_baseline_failure(item, call, report)


def _shorten_baseline_failure(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> None:
    """Show a baseline error (missing, stale, corrupt: not a bug in the code under test) from the
    test's own frames down to its call into this plugin, without the store's internals.

    Only for ``--tb=auto/long/short``; ``--fulltrace`` and the other styles keep pytest's report.
    """
    if SESSION_KEY not in item.config.stash:  # parity off: not our failure (and no torch import for it)
        return
    from .baselines import BaselineError

    excinfo = call.excinfo
    style = item.config.getoption("tbstyle", "auto")
    if (excinfo is None or not isinstance(excinfo.value, BaselineError) or style not in ("auto", "long", "short")
            or item.config.getoption("fulltrace", False)):
        return
    package = Path(__file__).resolve().parent
    try:
        test_file = Path(str(item.path)).resolve()
        entries = list(excinfo.traceback)
        paths = [Path(str(entry.path)).resolve() for entry in entries]
        first = next(i for i, path in enumerate(paths) if path == test_file)
        last = next((i for i in range(first, len(paths)) if paths[i].is_relative_to(package)), len(paths))
        excinfo.traceback = type(excinfo.traceback)(entries[first:last])
        report.longrepr = excinfo.getrepr(
            funcargs=True, abspath=False, showlocals=item.config.getoption("showlocals", False),
            style="long" if style == "auto" else style, tbfilter=False, truncate_locals=True)
    except Exception:  # no frame in the test file, or a pytest whose traceback API differs: keep pytest's report
        pass


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if SESSION_KEY not in config.stash or getattr(config, "workeroutput", None) is not None:
        return
    session_ = config.stash[SESSION_KEY]
    store = session_.store
    unsafe = store.scan_unsafe()
    if unsafe:
        names = "\n  ".join(str(p) for p in unsafe)
        raise pytest.UsageError(
            f"refusing to run: pickle-format files in the baseline store (they are never loaded):\n  {names}\n"
            "baselines are safetensors files; delete these or move them out of the store")
    if session_.update_baselines:
        _lock_store(config, store)
        config.stash[TEMP_KEY] = ("removed", store.remove_temporary_files())
    else:
        config.stash[TEMP_KEY] = ("found", [(p, p.stat().st_size) for p in store.temporary_files() if p.exists()])


def _lock_store(config: pytest.Config, store: Any) -> None:
    """Hold the store's lock for the whole record session (pytest-xdist workers write under their
    controller's lock): a second record run on the same store waits for this one, then runs."""
    from .baselines import BaselineError

    lock = store.lock()
    reporter = config.pluginmanager.get_plugin("terminalreporter")

    def on_wait(message: str) -> None:
        if reporter is not None:
            reporter.write_line(f"npu-parity: {message}")
        else:
            print(f"npu-parity: {message}", file=sys.stderr, flush=True)

    try:
        lock.acquire(timeout=float(config.getini("parity_lock_timeout")), on_wait=on_wait)
    except BaselineError as exc:
        raise pytest.UsageError(str(exc)) from None
    except OSError as exc:
        raise pytest.UsageError(f"--update-baselines cannot lock the baseline store {store.root} ({exc}); "
                                "fix its permissions or record into another --baseline-dir=DIR") from None
    config.stash[LOCK_KEY] = lock


def _release_store(config: pytest.Config) -> None:
    lock = config.stash.get(LOCK_KEY, None)
    if lock is not None:
        lock.release()
        del config.stash[LOCK_KEY]


def _full_run(config: pytest.Config) -> bool:
    """True for an unfiltered run of whole directories (unused baselines are only judged then)."""
    option = config.option
    if getattr(option, "keyword", "") or getattr(option, "markexpr", "") or getattr(option, "deselect", None):
        return False
    if getattr(option, "lf", False):
        return False
    if config.getoption("parity_dtypes") is not None:  # a recipe subset leaves the others' files unused
        return False
    return all(Path(arg).is_dir() for arg in config.args)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if SESSION_KEY not in config.stash:
        return
    rows = [row for record in config.stash[SESSION_KEY].records for row in record.rows()]
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # pytest-xdist worker: ship rows to the controller
        for row in rows:
            row[col.WORKER] = _xdist_worker_id(config)
        workeroutput["parity_rows"] = json.dumps(rows, default=str)
        workeroutput["parity_writes"] = json.dumps(config.stash[SESSION_KEY].baseline_writes)
        workeroutput["parity_not_written"] = json.dumps(config.stash[SESSION_KEY].not_written)
        workeroutput["parity_used"] = json.dumps(sorted(map(str, config.stash[SESSION_KEY].baselines_used)))
        workeroutput["parity_collected"] = json.dumps(config.stash[COLLECTED_KEY])
        return
    config.stash[ROWS_KEY].extend(rows)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown (and never called) without xdist
def pytest_testnodedown(node: Any, error: Any) -> None:
    output = getattr(node, "workeroutput", {}) or {}
    config = node.config
    if "parity_rows" in output and SESSION_KEY in config.stash:
        config.stash[ROWS_KEY].extend(json.loads(output["parity_rows"]))
        config.stash[SESSION_KEY].baseline_writes.update(json.loads(output.get("parity_writes", "{}")))
        config.stash[SESSION_KEY].not_written.update(json.loads(output.get("parity_not_written", "{}")))
        config.stash[SESSION_KEY].baselines_used.update(Path(p) for p in json.loads(output.get("parity_used", "[]")))
        seen = set(config.stash[COLLECTED_KEY])  # every worker collects the same tests
        config.stash[COLLECTED_KEY].extend(i for i in json.loads(output.get("parity_collected", "[]")) if i not in seen)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if SESSION_KEY not in config.stash or getattr(config, "workeroutput", None) is not None:
        return
    session = config.stash[SESSION_KEY]
    rows = config.stash[ROWS_KEY]
    tr = terminalreporter
    tr.section("npu-parity")
    checks: dict[tuple, str] = {}
    for row in rows:  # one verdict per (test, check): fail if any leaf failed
        key = (row["test_id"], row["check"], row["recipe"], row.get("group") or row.get("submodule") or row["check"])
        if checks.get(key) not in ("fail", "error"):
            checks[key] = row["verdict"]
    counts: Counter = Counter()
    for (_, _, recipe, group), verdict in checks.items():
        counts[(group, recipe, verdict)] += 1
    groups = sorted({(g, r) for g, r, _ in counts})
    if groups:
        width = max([len("group")] + [len(g) for g, _ in groups])
        tr.write_line(f"{'group'.ljust(width)}  recipe  checks  pass  fail  recorded")
        for group, recipe in groups:
            n = {v: counts[(group, recipe, v)] for v in ("pass", "fail", "error", "recorded")}
            total = sum(n.values())
            tr.write_line(f"{group.ljust(width)}  {recipe:<6}  {total:>6}  {n['pass']:>4}  "
                          f"{n['fail'] + n['error']:>4}  {n['recorded']:>8}")
        ran = Counter(verdict for verdict in checks.values())
        tr.write_line(f"{len(checks)} checks: " + ", ".join(f"{v} {k}" for k, v in sorted(ran.items())))
    else:
        tr.write_line("no parity checks ran")
    _summarize_references(tr, rows)
    _summarize_audit(tr, rows)
    _summarize_policies(tr, rows)
    _summarize_teeth(tr, rows)
    _summarize_baseline_problems(tr, rows, session)
    _summarize_localization(tr, rows, session)
    _summarize_writes(tr, session)
    _summarize_temporary_files(tr, config)
    _summarize_unmatched_patterns(tr, session, rows)
    if _full_run(config) and (exitstatus == 0 or not session.update_baselines):
        unused = _unused_baselines(config, session)
        if unused and session.update_baselines:
            session.store.prune(unused)
            tr.write_line(f"baselines: pruned {len(unused)} unused (no collected test maps to them):")
        elif unused:
            tr.write_line(f"baselines: {len(unused)} unused (no collected test maps to them; "
                          "`pytest --update-baselines` on a full run prunes them):")
        for path in unused:
            tr.write_line(f"  {_shown(path)}")
    _write_outputs(config, session, rows)


def _shown(path: Path | str) -> str:
    """``path`` relative to the working directory when below it, else as given."""
    path = Path(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _per_check(rows: list[dict]) -> dict[tuple, dict]:
    """The first row of every (test, check, recipe): what the reference was does not vary by leaf."""
    first: dict[tuple, dict] = {}
    for row in rows:
        first.setdefault((row["test_id"], row["check"], row["recipe"]), row)
    return first


def _summarize_references(tr: Any, rows: list[dict]) -> None:
    """One line per reference the targets were compared with: a live CPU run or a baseline's provenance."""
    counts: Counter = Counter()
    for row in _per_check(rows).values():
        if row.get("verdict") in ("recorded", "error") or row.get("reference") == "recorded":
            continue
        if row.get("reference") == "baseline":
            # reference_provenance is Baseline.describe(): "<file> — <device · date · versions>"
            counts["baseline " + str(row.get("reference_provenance") or "").rpartition(" — ")[2]] += 1
        else:
            reference = row.get("reference")
            counts[{"cpu": "a live CPU run", "given": "the given expected output"}.get(reference, str(reference))] += 1
    for reference, n in sorted(counts.items()):
        tr.write_line(f"reference: {n} check{'s' * (n != 1)} vs {reference}")


def _summarize_audit(tr: Any, rows: list[dict]) -> None:
    """With any audited check: the events of the audited checks per kind (each check counted once,
    not once per output leaf), then every check with events beyond its audit budget, with those
    events (op, devices, dtype, source line) and whether they failed the check or warned."""
    audited = [row for row in _per_check(rows).values() if row.get("audit_mixed_device") is not None]
    if not audited:
        return
    from .audit import KINDS

    totals = {k: sum(int(row.get(f"audit_{k}") or 0) for row in audited) for k in KINDS}
    over = [row for row in audited if row.get("audit_problem")]
    tr.write_line(f"audit: {len(audited)} check{'s' * (len(audited) != 1)} audited, events "
                  + ", ".join(f"{k} {v}" for k, v in totals.items())
                  + (f"; {len(over)} beyond their audit budget" if over else "; none beyond the audit budgets"))
    for row in sorted(over, key=lambda r: (r["test_id"], r["check"], r["recipe"])):
        verdict = "failed" if row.get("audit_verdict") == "fail" else "warned"
        lines = str(row["audit_problem"]).splitlines()
        head = lines[0].partition(": ")[2] if ": " in lines[0] else lines[0]
        tr.write_line(f"  {verdict}: {row['test_id']} check {row['check']!r} ({row['recipe']}): {head}",
                      red=verdict == "failed", yellow=verdict == "warned")
        for line in lines[1:]:
            if line.startswith("  "):
                tr.write_line(f"  {line}")
    if over:
        failed = any(row.get("audit_verdict") == "fail" for row in over)
        tr.write_line("  fix those lines, or allow them per test or check with audit_budget={...} and a reason "
                      "(@pytest.mark.parity / parity.check)"
                      + (", or report without failing with --parity-audit-mode=warn" if failed else ""))


def _summarize_policies(tr: Any, rows: list[dict]) -> None:
    """When any check was judged by the golden policy: how many checks each verdict policy judged,
    then every check that asked for the golden and fell back to allclose (and why)."""
    judged = [row for row in _per_check(rows).values() if row.get("verdict") not in ("recorded", "error")]
    notes = [row for row in judged if row.get("policy_note") and row.get("policy") != "distribution"]
    distribution = [row for row in judged if row.get("policy") == "distribution"]
    if not any(row.get("policy") == "golden" for row in judged) and not notes and not distribution:
        return
    counts = Counter(row.get("golden_policy") or "allclose" for row in judged if row.get("policy") == "golden")
    counts.update(row.get("distribution_policy") or "distribution" for row in distribution)
    n_allclose = sum(1 for row in judged if row.get("policy") not in ("golden", "distribution"))
    tr.write_line("verdicts: " + ", ".join([f"{n} by {text}" for text, n in sorted(counts.items())]
                                           + [f"{n_allclose} by allclose"] * bool(n_allclose))
                  + (" (distribution: sampling checks whose sides drew their own noise, --parity-rng device)"
                     if distribution else ""))
    for row in sorted(notes, key=lambda r: (r["test_id"], r["check"], r["recipe"])):
        tr.write_line(f"  {row['test_id']} check {row['check']!r} ({row['recipe']}): {row['policy_note']}")


def _summarize_teeth(tr: Any, rows: list[dict]) -> None:
    """``--parity-selfcheck``: the share of checks with teeth, then every check without (and why)."""
    from .selfcheck import teeth_summary

    with_teeth, measured, without = teeth_summary(rows)
    if not measured:
        return
    share = 100 * with_teeth // measured  # rounded down: "100 %" only when every check has teeth
    tr.write_line(f"teeth: {with_teeth}/{measured} ({share} %) of the checks fail "
                  "when their output or a weight is perturbed beyond tolerance")
    for row in sorted(without, key=lambda r: (r["test_id"], r["check"], r["recipe"])):
        allowed = f" [vacuous_ok: {row['vacuous_ok']}]" if row.get("vacuous_ok") else ""
        tr.write_line(f"  no teeth: {row['test_id']} check {row['check']!r} ({row['recipe']}): "
                      f"{row.get('teeth_problem')}{allowed}")


def _summarize_baseline_problems(tr: Any, rows: list[dict], session: Any) -> None:
    """List the checks whose baseline was missing, stale, corrupt or unsafe, and how to re-record them
    (the checks of a suite-wide stale suite in one line: its section opens the summary)."""
    problems = [row for row in _per_check(rows).values() if row.get("baseline_error")]
    if not problems:
        return
    kinds = Counter(row["baseline_error"] for row in problems)
    tr.write_line("baselines not usable: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    width = max(len(k) for k in kinds)
    suites = _stale_suites(tr.config)
    covered = {check for suite in suites for check in suite.checks}
    for suite in suites:
        tr.write_line(f"  {'stale'.ljust(width)}  {len(suite.checks)} checks of suite {suite.suite!r}: "
                      f"{_cause_text(suite.cause)} (see the top of the summary)")
    problems = [row for row in problems if (row["test_id"], row["check"], row["recipe"]) not in covered]
    for row in sorted(problems, key=lambda r: (r["baseline_error"], r["test_id"], r["check"])):
        where = f" ({_shown(row['baseline_file'])})" if row.get("baseline_file") else ""
        tr.write_line(f"  {row['baseline_error'].ljust(width)}  {row['test_id']} check {row['check']!r}{where}")
    redo = sorted({row["test_id"] for row in problems if row["baseline_error"] in ("missing", "stale", "corrupt")})
    if redo:
        import shlex

        tr.write_line(f"re-record them on a trusted machine with: {session.store.update_command} "
                      + " ".join(shlex.quote(test_id) for test_id in redo))


def _localize_hint(session: Any, test_id: str) -> str:
    """The command that localizes ``test_id`` (the session's ``Localizer.hint``, with its options)."""
    import shlex

    hook = next((h for h in session.failure_hooks if getattr(h, "hint", None)), None)
    template = hook.hint if hook is not None else "pytest --npu-parity --parity-localize {test_id}"
    return template.format(test_id=shlex.quote(test_id))


def _summarize_localization(tr: Any, rows: list[dict], session: Any) -> None:
    """How many failing checks were localized (in how many seconds, how many answered by another
    check's descent), and how many were not, why, and the command that localizes one."""
    first = list(_per_check(rows).values())
    localized = [r for r in first if r.get("localization")]
    skipped = [r for r in first if r.get("localization_skipped") == "budget"]
    structure = [r for r in first if r.get("localization_skipped") == "structure"]
    if not (localized or skipped or structure):
        return
    if localized:
        seconds = sum(float(r.get("localization_s") or 0) for r in first)
        reused = sum(1 for r in localized if r.get("localization_reused"))
        stopped = sum(1 for r in localized if r.get("localization_stopped"))
        tr.write_line(f"localization: {len(localized)} failing check{'s' * (len(localized) != 1)} localized in "
                      f"{seconds:.1f} s ({reused} answered by an earlier check's descent"
                      + (f", {stopped} stopped at the budget" if stopped else "") + ")")
    if skipped:
        hook = next((h for h in session.failure_hooks if hasattr(h, "budget_s")), None)
        budget = f"{hook.budget_s:g} s" if hook is not None and hook.budget_s is not None else "spent"
        example = sorted(skipped, key=lambda r: r["test_id"])[0]["test_id"]
        tr.write_line(f"localization skipped for {len(skipped)} check{'s' * (len(skipped) != 1)}: budget ({budget}, "
                      f"--parity-localize-budget); run `{_localize_hint(session, example)}` (or -k NAME "
                      "--parity-localize) to see one")
    if structure:
        tr.write_line(f"localization not run for {len(structure)} check{'s' * (len(structure) != 1)}: their outputs "
                      "differ in structure, shape or dtype")


_CAUSE_PARTS = {"weights": "the model's weights", "config": "the model's configuration", "input": "the inputs"}


def _cause_text(cause: str) -> str:
    """``"the model's weights and the inputs changed"`` for a ``runner.stale_cause`` such as ``weights+input``."""
    parts = [_CAUSE_PARTS.get(c, c) for c in cause.split("+")]
    joined = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{joined} changed"


STALE_KEY = pytest.StashKey["list"]()  # runner.StaleSuite of this session, computed once at the summary


def _stale_suites(config: pytest.Config) -> list:
    """``runner.stale_suites`` of this session's rows (computed once)."""
    if STALE_KEY not in config.stash:
        from .runner import stale_suites

        config.stash[STALE_KEY] = stale_suites(config.stash[ROWS_KEY]) if ROWS_KEY in config.stash else []
    return config.stash[STALE_KEY]


class _StaleSuiteReport:
    """A suite whose model (or inputs) changed as a whole (``runner.stale_suites``): said once, before pytest's FAILURES,
    with the one command that fixes it; each of its tests' failures is cut to one line pointing there."""

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> Iterator[None]:
        if SESSION_KEY in config.stash and getattr(config, "workeroutput", None) is None:
            try:
                self._report(terminalreporter, config)
            except Exception as exc:  # noqa: BLE001 - a summary must never break the run's report
                terminalreporter.write_line(f"npu-parity: suite-wide stale check failed: {type(exc).__name__}: {exc}")
        yield

    @staticmethod
    def _report(tr: Any, config: pytest.Config) -> None:
        suites = _stale_suites(config)
        if not suites:
            return
        session = config.stash[SESSION_KEY]
        messages = {(r["test_id"], r["check"], r["recipe"]): r.get("problem") for r in config.stash[ROWS_KEY]
                    if r.get("baseline_error")}
        short: dict[str, str] = {}
        for suite in suites:
            fix = suite.fix(session.store.update_command)
            tests = sorted({t for t, _, _ in suite.checks})
            tr.section(f"npu-parity: every baseline of suite {suite.suite!r} is stale", sep="=", bold=True)
            recorded = f" (recorded on {suite.provenance})" if suite.provenance else ""
            tr.write_line(f"{_cause_text(suite.cause).capitalize()} since its baselines were recorded{recorded}: "
                          f"{len(suite.checks)} checks of {len(tests)} tests are stale"
                          + (f"; {suite.fresh} other checks still matched" if suite.fresh else "") + ".")
            tr.write_line(f"Fix it once, on a trusted machine: {fix}")
            example = messages.get(suite.checks[0])
            if example:
                tr.write_line(f"For example, {suite.checks[0][0]}: {example}")
            for test_id, check, recipe in suite.checks:
                short.setdefault(test_id, f"check {check!r} ({recipe}): baseline stale: {_cause_text(suite.cause)} for "
                                          f"the whole suite {suite.suite!r}; see 'every baseline of suite "
                                          f"{suite.suite!r} is stale' above the failures; fix: {fix}")
        failing = {(r["test_id"], r["check"], r["recipe"]) for r in config.stash[ROWS_KEY]
                   if r.get("verdict") in ("fail", "error")}
        covered = {c for suite in suites for c in suite.checks}
        explained = {t for t in short if all(c in covered for c in failing if c[0] == t)}
        for report in tr.stats.get("failed", []):
            if getattr(report, "when", None) == "call" and report.nodeid in explained:
                report.longrepr = short[report.nodeid]


_WRITE_ORDER = ("created", "changed", "unchanged", "not written")


def _summarize_writes(tr: Any, session: Any) -> None:
    """Counts of baseline files created/changed/unchanged/not written, then the files that changed on disk."""
    writes = session.baseline_writes
    if not writes:
        return
    status = Counter(writes.values())
    order = [s for s in _WRITE_ORDER if s in status] + sorted(set(status) - set(_WRITE_ORDER))
    tr.write_line("baselines: " + ", ".join(f"{status[s]} {s}" for s in order)
                  + f" ({len(writes)} file{'s' * (len(writes) != 1)} under {_shown(session.store.root)})")
    for test_id, what in sorted(writes.items(), key=lambda kv: (order.index(kv[1]), kv[0])):
        if what == "unchanged":
            continue
        why = session.not_written.get(test_id, "failed")
        note = {"failed": " (the test failed)", "skipped": " (the test was skipped before its end)",
                "interrupted": " (the test was interrupted)"}.get(why, f" (the test {why})") \
            if what == "not written" else ""
        try:
            path = _shown(session.store.path_for(test_id))
        except Exception:  # a node id no file can be named after: the test itself reported it
            path = "?"
        tr.write_line(f"  {what:<11}  {path}  <- {test_id}{note}")


def _summarize_temporary_files(tr: Any, config: pytest.Config) -> None:
    """Temporary files of writes a killed process left behind: removed by a record run (which holds
    the store lock, so no live writer owns them), listed by a compare run."""
    kind, files = config.stash.get(TEMP_KEY, ("found", []))
    if not files:
        return
    total = sum(size for _, size in files)
    if kind == "removed":
        tr.write_line(f"baselines: removed {len(files)} temporary file{'s' * (len(files) != 1)} "
                      f"({total} bytes) left by an interrupted record run:")
    else:
        tr.write_line(f"baselines: {len(files)} temporary file{'s' * (len(files) != 1)} ({total} bytes) left by "
                      "an interrupted record run; the next `pytest --update-baselines` removes them:")
    for path, size in files:
        tr.write_line(f"  {_shown(path)} ({size} bytes)")


def _summarize_unmatched_patterns(tr: Any, session: Any, rows: list[dict]) -> None:
    """ini ``parity_tolerances``/``parity_policies`` patterns that matched no check of this run
    (a typo leaves a tolerance unapplied without any other sign)."""
    if not rows:
        return
    for key, patterns in (("parity_tolerances", session.check_tolerances), ("parity_policies", session.check_policies)):
        for pattern in patterns:
            if pattern not in session.patterns_used:
                tr.write_line(f"ini {key}: pattern {pattern!r} matched no check of this run "
                              "(a typo? check names are the first argument of parity.check)")


def _unused_baselines(config: pytest.Config, session: Any) -> list[Path]:
    """Baseline files of this run's scope that no collected test maps to (sorted).

    In scope are the files whose recorded test id (file metadata ``test_id``) names a test file
    under one of the run's directories (``config.args``), so ``pytest --update-baselines
    parity_suites/aurora`` never touches another suite's files, and whose recorded recipe (the
    provenance's ``recipe``) is one this session runs: a default run (``fp32,bf16``) leaves the
    files of the opt-in ``fp16`` recipe alone. Kept are the files of every
    collected test (also deselected, skipped or failed ones, and with ``--parity-reference cpu``)
    and every file the run read or wrote. Files whose metadata cannot be read are left alone (the
    test that uses them reports them).
    """
    from .baselines import BaselineError

    store = session.store
    kept = {Path(p).resolve() for p in session.baselines_used}
    for node_id in config.stash[COLLECTED_KEY]:
        try:
            kept.add(store.path_for(node_id).resolve())
        except BaselineError:
            pass
    invocation = Path(config.invocation_params.dir)
    scope = [(invocation / arg).resolve() for arg in config.args]
    recipes = set(_recipe_names(config))
    unused = []
    for path in store.unused(kept):
        test_id, recipe = _recorded_test_id(path), _recorded_recipe(path)
        if not test_id or (recipe is not None and recipe not in recipes):
            continue
        test_file = (config.rootpath / test_id.partition("::")[0]).resolve()
        if any(test_file.is_relative_to(d) for d in scope):
            unused.append(path)
    return unused


def _recorded_test_id(path: Path) -> str | None:
    """The ``test_id`` metadata of a baseline file (its safetensors header only), or None if unreadable."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("test_id")
    except Exception:  # not a safetensors file, truncated header...: not judged here
        return None


def _recorded_recipe(path: Path) -> str | None:
    """The recipe in a baseline file's provenance (its safetensors header only), or None if unreadable."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            recipe = json.loads((handle.metadata() or {}).get("provenance") or "{}").get("recipe")
        return recipe if isinstance(recipe, str) else None
    except Exception:  # not a safetensors file, truncated header, no provenance: not judged here
        return None


def _write_outputs(config: pytest.Config, session: Any, rows: list[dict]) -> None:
    out_dir = config.getoption("parity_report")
    history = config.getoption("parity_history")
    if not (out_dir or history):
        return
    from . import report

    meta = session.metadata(_recipe_names(config), config.invocation_params.args)
    try:
        hist = report.append_history(rows, meta, history) if history else None
        if out_dir:
            report.write_report(rows, meta, out_dir, history=hist)
    except (OSError, ValueError, ImportError) as exc:  # checked at start-up; the disk can still fail
        config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"npu-parity: ERROR: the report/history could not be written ({type(exc).__name__}: {exc})", red=True)

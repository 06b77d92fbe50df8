"""The plugin's pytest hooks: configure (options parsed once, the session built), collection,
test reports, session start/finish (the store lock, xdist rows) and unconfigure.

The terminal summary is ``summary``, the report header ``header``, the fixtures ``fixtures``; engine
modules are imported inside the hooks that need them: they import torch, which a session that runs no
parity check never needs (and a broken torch_npu must fail with ``npu.explain_import_error``'s sentence).
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from . import header, summary
from ..report import columns as col
from .markers import MARKER_HELP, NIGHTLY_MARKER_HELP, marker_recipes, skip_nightly_unless_selected, validate_markers
from .config import ParityConfig, recipe_names
from .options import Raw, add_options
from .paths import record_parity_paths
from .state import (COLLECTED_KEY, CONFIG_KEY, DEEPSPEED_LINT_KEY, LOCK_KEY, OUTCOME_KEY, PROFILE_KEY,
                    ROWS_KEY, SELECTED_KEY, SESSION_KEY, SKIP_REASON, TEMP_KEY)
from .xdist import is_xdist_controller, xdist_worker_id


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def parity_enabled(config: pytest.Config) -> bool:
    """True when this session runs parity checks (``--npu-parity`` or ``--update-baselines``)."""
    return config.stash[CONFIG_KEY].enabled


def _hypothesis_profiles(config: pytest.Config) -> None:
    """Register the ``npu-parity-ci`` and ``nightly`` hypothesis profiles (``hypothesis_profiles.register_profiles``)
    and, in a parity session whose user chose no profile, load ``npu-parity-ci`` (bounded, derandomized).

    Runs before hypothesis' own ``pytest_configure`` (``tryfirst`` below), which loads
    ``--hypothesis-profile``: so ``--hypothesis-profile nightly`` finds the profile, and an explicit
    choice is never overridden.
    """
    try:
        from hypothesis import settings

        from .. import hypothesis_profiles
    except ImportError:  # hypothesis missing: nothing to configure (the property tests cannot run)
        return
    hypothesis_profiles.register_profiles()
    if parity_enabled(config):
        current = hypothesis_profiles.current_profile_name()
        name = hypothesis_profiles.profile_to_load(config.getoption("hypothesis_profile", default=None), current)
        if name:
            config.stash[PROFILE_KEY] = current  # restored at unconfigure (in-process pytester runs)
            settings.load_profile(name)


def _nightly_profile() -> bool:
    """The loaded hypothesis profile is the nightly one (False without hypothesis)."""
    try:
        from ..hypothesis_profiles import NIGHTLY_PROFILE, current_profile_name
    except ImportError:
        return False
    return current_profile_name() == NIGHTLY_PROFILE


def pytest_unconfigure(config: pytest.Config) -> None:
    _release_store(config)
    previous = config.stash.get(PROFILE_KEY, None)
    if previous is not None:
        from hypothesis import settings

        settings.load_profile(previous)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    raw = Raw.read(config)
    config.stash[CONFIG_KEY] = ParityConfig.unparsed(raw)
    _hypothesis_profiles(config)
    config.addinivalue_line("markers", MARKER_HELP)
    config.addinivalue_line("markers", NIGHTLY_MARKER_HELP)
    config.stash[ROWS_KEY] = []
    config.stash[COLLECTED_KEY] = []
    config.stash[SELECTED_KEY] = []
    config.stash[OUTCOME_KEY] = {}
    if raw.options["update_baselines"]:
        record_parity_paths(config, raw)
    if not parity_enabled(config):
        return
    cfg = ParityConfig.load(config, raw, prepare=_import_torch, target=functools.partial(_resolve_target, config))
    config.stash[CONFIG_KEY] = cfg
    _launch(config, cfg.target)
    config.stash[SESSION_KEY] = _make_session(cfg)
    _lint_deepspeed_config(config, cfg)
    config.pluginmanager.register(summary.StaleSuiteReport(), "npu-parity-stale-suites")


def _import_torch() -> None:
    """``import torch`` (a broken torch_npu can break it): a usage error saying why, in one sentence."""
    from ..runtime.npu import explain_import_error, import_torch

    try:
        import_torch()
    except Exception as exc:  # noqa: BLE001 - any import failure becomes a usage error
        raise pytest.UsageError(explain_import_error(exc)) from None


def _resolve_target(config: pytest.Config, raw: Raw) -> Any:
    """The target device of this process; under pytest-xdist each worker (gwK) pins its own
    (``devices.pinned_device``). A usage error when it is absent or the spec is bad."""
    from ..runtime.devices import DeviceUnavailableError, resolve_worker_target

    spec, where = raw.value("parity_device")  # the option, else the ini key: the error names the one given
    mapping, mapping_where = raw.value("parity_worker_devices")
    try:
        return resolve_worker_target(spec, xdist_worker_id(config), mapping or None, option=where,
                                     mapping_option=mapping_where)
    except (ValueError, DeviceUnavailableError) as exc:
        raise pytest.UsageError(str(exc)) from None


def _lint_deepspeed_config(config: pytest.Config, cfg: ParityConfig) -> None:
    """Lint ini ``parity_deepspeed_config`` (``deepspeed_config.lint_file``): findings are kept for the header
    and each is issued as a ``PytestConfigWarning`` (warnings summary; ``-W error`` makes them errors). They
    are advice on a training config, not parity results, so they never fail the run by themselves.

    Raises:
        pytest.UsageError: the file is missing or not a JSON object (one sentence naming it).
    """
    value = str(cfg.ini("parity_deepspeed_config") or "").strip()
    if not value:
        return
    from ..runtime.deepspeed_config import DeepSpeedConfigError, lint_config, load_config

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


def _make_session(cfg: ParityConfig) -> Any:
    """The session's ``runner.ParitySession``, from the parsed configuration."""
    from ..store.suites import SuiteStores
    from ..diagnose import localize, selfcheck
    from ..runner import ParitySession, target_audit

    session = ParitySession(
        cfg.target, reference=cfg.reference, update_baselines=cfg.update_baselines,
        store=SuiteStores(cfg.baseline_root, update_command=cfg.update_command), seed=cfg.seed,
        # Always available, so that @pytest.mark.parity(audit=...) can audit one test; a CPU target is
        # audited as a logical device. The session mode says whether the other tests are audited.
        audit_factory=target_audit, audit_mode=cfg.audit_mode,
        failure_hooks=[localize.Localizer(cfg.localize_budget, forced=cfg.option("parity_localize"),
                                          hint=cfg.localize_hint), *_repro_hooks(cfg)],
        check_hooks=[selfcheck.SelfCheck()] if cfg.option("parity_selfcheck") else [],
        rng=cfg.rng, settings=cfg.settings,
    )
    session.replay_limit = cfg.replay_limit
    session.store_goldens = bool(cfg.option("parity_store_goldens"))
    return session


def _repro_hooks(cfg: ParityConfig) -> list[Any]:
    """``--parity-repro DIR``: a ``repro.ReproWriter`` after the localizer (it reads the localization)."""
    if cfg.repro_dir is None:
        return []
    from ..diagnose.repro import ReproWriter

    return [ReproWriter(cfg.repro_dir, hint=cfg.localize_hint)]


def _launch(config: pytest.Config, target: Any) -> None:
    """On an NPU target, before any suite imports aurora: the launcher steps of the Ascend guide
    (``npu.launch``: transfer_to_npu, compile mode, ``torch.npu.set_device``), in every process that
    runs tests (each xdist worker with its own pinned device). A CPU/CUDA target: nothing."""
    if target.type != "npu" or is_xdist_controller(config):
        return
    from ..runtime.npu import LaunchOrderError, launch

    try:
        launch(target)
    except (LaunchOrderError, RuntimeError, ValueError, ImportError) as exc:  # ImportError: transfer_to_npu
        raise pytest.UsageError(f"--parity-device={target}: {exc}") from None


def pytest_report_header(config: pytest.Config) -> list[str]:
    return header.report_header(config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "parity_recipe" not in metafunc.fixturenames:
        return
    names = list(recipe_names(metafunc.config.stash[CONFIG_KEY]))
    marker = metafunc.definition.get_closest_marker("parity")
    allowed = marker_recipes(marker.kwargs.get("recipes")) if marker else None
    if allowed is not None:
        names = [n for n in names if n in allowed]  # whole names: "bf16-weights" never selects bf16
    if names:
        metafunc.parametrize("parity_recipe", names, ids=names)
    else:
        metafunc.parametrize("parity_recipe", [pytest.param(None, marks=pytest.mark.skip(
            reason=f"none of the recipes {allowed} is selected by --parity-dtypes"))], ids=["no-recipe"])


def pytest_collection_finish(session: pytest.Session) -> None:
    """The tests this run selected, after -k/-m deselection (a selection's stale summary, ``summary``)."""
    if parity_enabled(session.config):
        session.config.stash[SELECTED_KEY] = [item.nodeid for item in session.items]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if parity_enabled(config):
        validate_markers(items)
        skip_nightly_unless_selected(items, _nightly_profile())
        # Before -k/-m deselection: every collected test keeps its baseline (see _unused_baselines).
        config.stash[COLLECTED_KEY] = [item.nodeid for item in items]
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if "parity" in getattr(item, "fixturenames", ()) or item.get_closest_marker("parity"):
            item.add_marker(skip)


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
    from ..store.format import BaselineError

    excinfo = call.excinfo
    style = item.config.getoption("tbstyle", "auto")
    if (excinfo is None or not isinstance(excinfo.value, BaselineError) or style not in ("auto", "long", "short")
            or item.config.getoption("fulltrace", False)):
        return
    package = Path(__file__).resolve().parent.parent  # the pytest_npu_parity package
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
    elif session_.store_goldens:  # it writes baseline files too: not beside a record run
        _lock_store(config, store)
        config.stash[TEMP_KEY] = ("found", [(p, p.stat().st_size) for p in store.temporary_files() if p.exists()])
    else:
        config.stash[TEMP_KEY] = ("found", [(p, p.stat().st_size) for p in store.temporary_files() if p.exists()])


def _lock_store(config: pytest.Config, store: Any) -> None:
    """Hold the store's lock for the whole record session (pytest-xdist workers write under their
    controller's lock): a second record run on the same store waits for this one, then runs."""
    from ..store.format import BaselineError

    lock = store.lock()
    reporter = config.pluginmanager.get_plugin("terminalreporter")

    def on_wait(message: str) -> None:
        if reporter is not None:
            reporter.write_line(f"npu-parity: {message}")
        else:
            print(f"npu-parity: {message}", file=sys.stderr, flush=True)

    try:
        lock.acquire(timeout=config.stash[CONFIG_KEY].lock_timeout, on_wait=on_wait)
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


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if SESSION_KEY not in config.stash:
        return
    rows = [row for record in config.stash[SESSION_KEY].records for row in record.rows()]
    _repro_column(config.stash[SESSION_KEY], rows)
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # pytest-xdist worker: ship rows to the controller
        for row in rows:
            row[col.WORKER] = xdist_worker_id(config)
        workeroutput["parity_rows"] = json.dumps(rows, default=str)
        workeroutput["parity_writes"] = json.dumps(config.stash[SESSION_KEY].baseline_writes)
        workeroutput["parity_not_written"] = json.dumps(config.stash[SESSION_KEY].not_written)
        workeroutput["parity_used"] = json.dumps(sorted(map(str, config.stash[SESSION_KEY].baselines_used)))
        workeroutput["parity_collected"] = json.dumps(config.stash[COLLECTED_KEY])
        workeroutput["parity_selected"] = json.dumps(config.stash[SELECTED_KEY])
        return
    config.stash[ROWS_KEY].extend(rows)


def _repro_column(session: Any, rows: list[dict]) -> None:
    """The ``repro`` column: the folder ``--parity-repro`` wrote for the row's check (rows of checks
    without a repro get none)."""
    writer = next((h for h in session.failure_hooks if hasattr(h, "written")), None)
    if writer is None or not writer.written:
        return
    for row in rows:
        folder = writer.written.get((row.get(col.TEST_ID), row.get(col.CHECK)))
        if folder is not None:
            row[col.REPRO] = folder


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
        selected = set(config.stash[SELECTED_KEY])
        config.stash[SELECTED_KEY].extend(i for i in json.loads(output.get("parity_selected", "[]")) if i not in selected)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    summary.terminal_summary(terminalreporter, exitstatus, config)

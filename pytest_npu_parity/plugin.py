"""pytest glue for pytest-npu-parity: options, ini keys, markers, fixtures, header and summary.

Everything that judges numbers lives in the engine modules (``runner``, ``compare``, ``policy``,
``baselines`` …); this module only adapts them to pytest.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest


SESSION_KEY = pytest.StashKey["Any"]()
CASES_KEY = pytest.StashKey["list"]()
ROWS_KEY = pytest.StashKey["list"]()

_SKIP_REASON = "parity suites run only with --npu-parity (or --update-baselines)"


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
                    help="comma-separated recipes to run every parity test under: fp32, bf16, bf16-weights "
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
    group.addoption("--parity-audit", action="store_true", default=False,
                    help="record a device-propagation audit of every target run (costs time)")

    parser.addini("parity_device", "default for --parity-device", default="auto")
    parser.addini("parity_reference", "default for --parity-reference", default="auto")
    parser.addini("parity_dtypes", "default for --parity-dtypes", default="fp32,bf16")
    parser.addini("parity_baseline_dir", "default for --baseline-dir (relative to rootdir)", default="baselines")
    parser.addini("parity_seed", "default for --parity-seed", default="0")
    parser.addini("parity_paths", "what --update-baselines runs when given no path", type="linelist",
                  default=["parity_suites"])
    parser.addini("parity_tolerances", type="linelist", default=[],
                  help="per-check tolerance overrides, one per line: "
                       "'<check name or glob>: rtol=1e-4 atol=1e-4 budget=0 # reason'")
    for recipe in ("fp32", "bf16"):
        parser.addini(f"parity_{recipe}_tolerance", default="",
                      help=f"override of the {recipe} default tolerance, e.g. 'rtol=1e-5 atol=1e-5 # reason'")


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
        for recipe in ("fp32", "bf16"):
            spec = config.getini(f"parity_{recipe}_tolerance").strip()
            if spec:
                per_recipe[recipe] = parse_tolerance_spec(spec, source="ini", base=default_for_recipe(recipe))
        for line in config.getini("parity_tolerances"):
            pattern, sep, spec = line.partition(":")
            if not sep:
                raise ValueError(f"parity_tolerances line {line!r} needs '<check>: rtol=… atol=…'")
            parse_tolerance_spec(spec, source="ini", base=default_for_recipe("fp32"))  # validate now
            per_check[pattern.strip()] = spec  # parsed per recipe, over that recipe's default
    except ValueError as exc:
        raise pytest.UsageError(f"ini: {exc}") from None
    return per_check, per_recipe


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "parity(rtol=None, atol=None, budget=None, reason=None, recipes=None): tolerance override for every "
        "check of the test (shown in the report with its reason) and/or the recipes it runs under",
    )
    config.stash[CASES_KEY] = []
    config.stash[ROWS_KEY] = []
    _recipe_names(config)  # validate early
    if config.getoption("update_baselines") and getattr(config, "args_source", None) is not None:
        # `pytest --update-baselines` with no path records the parity suites, not the unit tests.
        if config.args_source != pytest.Config.ArgsSource.ARGS:
            paths = [str(Path(config.rootpath, p)) for p in config.getini("parity_paths")]
            config.args[:] = [p for p in paths if Path(p).exists()] or config.args
    if not parity_enabled(config):
        return
    config.stash[SESSION_KEY] = _make_session(config)


def _make_session(config: pytest.Config):
    from .devices import DeviceUnavailableError, resolve_target
    from .runner import ParitySession

    try:
        target = resolve_target(_opt(config, "parity_device", "parity_device"))
    except (ValueError, DeviceUnavailableError) as exc:
        raise pytest.UsageError(str(exc)) from None
    reference = _opt(config, "parity_reference", "parity_reference")
    if reference not in ("auto", "cpu", "baseline"):
        raise pytest.UsageError(f"ini parity_reference={reference!r}: use auto, cpu or baseline")
    per_check, per_recipe = _tolerance_overrides(config)
    seed = _opt(config, "parity_seed", "parity_seed")
    try:
        seed = int(seed)
    except ValueError:
        raise pytest.UsageError(f"ini parity_seed={seed!r} is not an integer") from None
    audit_factory = None
    if config.getoption("parity_audit"):
        from .audit import DeviceAudit

        audit_factory = DeviceAudit
    return ParitySession(
        target, reference=reference, update_baselines=config.getoption("update_baselines"),
        store=_make_store(config), check_tolerances=per_check, recipe_tolerances=per_recipe, seed=seed,
        audit_factory=audit_factory,
    )


def _make_store(config: pytest.Config):
    from .baselines import SuiteStores

    root = Path(_opt(config, "baseline_dir", "parity_baseline_dir"))
    if not root.is_absolute():
        root = config.rootpath / root
    return SuiteStores(root)


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
    return [
        f"npu-parity: target {session.target} ({session.target_name}) · {mode} · recipes "
        f"{','.join(_recipe_names(config))} · baselines {session.store.root}",
        f"npu-parity: torch {torch.__version__} · torch_npu {status.torch_npu_version or '-'} · "
        f"CANN {status.cann_version or '-'} · precision flags "
        + " ".join(f"{k}={v}" for k, v in flags.items()),
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "parity_recipe" not in metafunc.fixturenames:
        return
    names = _recipe_names(metafunc.config)
    marker = metafunc.definition.get_closest_marker("parity")
    allowed = marker.kwargs.get("recipes") if marker else None
    if allowed is not None:
        names = [n for n in names if n in allowed]
    if names:
        metafunc.parametrize("parity_recipe", names, ids=names)
    else:
        metafunc.parametrize("parity_recipe", [pytest.param(None, marks=pytest.mark.skip(
            reason=f"none of the recipes {allowed} is selected by --parity-dtypes"))], ids=["no-recipe"])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if parity_enabled(config):
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


@pytest.fixture(scope="session")
def parity_session(pytestconfig: pytest.Config):
    """The session-wide ``runner.ParitySession`` (target device, reference mode, records)."""
    if SESSION_KEY not in pytestconfig.stash:
        pytest.skip(_SKIP_REASON)
    return pytestconfig.stash[SESSION_KEY]


@pytest.fixture
def parity(request: pytest.FixtureRequest, parity_session, parity_recipe: str, parity_patches) -> Iterator[Any]:
    """Run and compare computations on the reference and the target device.

    ``parity.check(name, module_or_fn, *args, **kwargs)`` runs on both sides and compares every
    output leaf; ``parity.train_step(name, module, inputs)`` compares one optimizer step;
    ``parity.compare(name, actual, expected)`` judges outputs you computed. See ``runner.ParityCase``.
    """
    from .runner import ParityCase

    case = ParityCase(parity_session, request.node.nodeid, parity_recipe,
                      marker_tolerance=_marker_tolerance(request.node, parity_recipe), patches=parity_patches)
    request.config.stash[CASES_KEY].append(case)
    yield case
    case.finish()


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if SESSION_KEY not in config.stash or getattr(config, "workeroutput", None) is not None:
        return
    store = config.stash[SESSION_KEY].store
    unsafe = store.scan_unsafe()
    if unsafe:
        names = "\n  ".join(str(p) for p in unsafe)
        raise pytest.UsageError(
            f"refusing to run: pickle-format files in the baseline store (they are never loaded):\n  {names}\n"
            "baselines are safetensors files; delete these or move them out of the store")


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
        workeroutput["parity_rows"] = json.dumps(rows, default=str)
        workeroutput["parity_writes"] = json.dumps(config.stash[SESSION_KEY].baseline_writes)
        workeroutput["parity_used"] = json.dumps(sorted(map(str, config.stash[SESSION_KEY].baselines_used)))
        return
    config.stash[ROWS_KEY].extend(rows)


def pytest_testnodedown(node: Any, error: Any) -> None:
    output = getattr(node, "workeroutput", {}) or {}
    config = node.config
    if "parity_rows" in output and SESSION_KEY in config.stash:
        config.stash[ROWS_KEY].extend(json.loads(output["parity_rows"]))
        config.stash[SESSION_KEY].baseline_writes.update(json.loads(output.get("parity_writes", "{}")))
        config.stash[SESSION_KEY].baselines_used.update(Path(p) for p in json.loads(output.get("parity_used", "[]")))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if SESSION_KEY not in config.stash or getattr(config, "workeroutput", None) is not None:
        return
    session = config.stash[SESSION_KEY]
    rows = config.stash[ROWS_KEY]
    tr = terminalreporter
    tr.section("npu-parity")
    checks: dict[tuple, str] = {}
    for row in rows:  # one verdict per (test, check): fail if any leaf failed
        key = (row["test_id"], row["check"], row["recipe"], row.get("submodule") or row["check"])
        if checks.get(key) not in ("fail", "error"):
            checks[key] = row["verdict"]
    counts: Counter = Counter()
    for (_, _, recipe, group), verdict in checks.items():
        counts[(group, recipe, verdict)] += 1
    groups = sorted({(g, r) for g, r, _ in counts})
    if groups:
        width = max([len("submodule")] + [len(g) for g, _ in groups])
        tr.write_line(f"{'submodule'.ljust(width)}  recipe  checks  pass  fail  recorded")
        for group, recipe in groups:
            n = {v: counts[(group, recipe, v)] for v in ("pass", "fail", "error", "recorded")}
            total = sum(n.values())
            tr.write_line(f"{group.ljust(width)}  {recipe:<6}  {total:>6}  {n['pass']:>4}  "
                          f"{n['fail'] + n['error']:>4}  {n['recorded']:>8}")
        ran = Counter(verdict for verdict in checks.values())
        tr.write_line(f"{len(checks)} checks: " + ", ".join(f"{v} {k}" for k, v in sorted(ran.items())))
    else:
        tr.write_line("no parity checks ran")
    if session.baseline_writes:
        status = Counter(session.baseline_writes.values())
        tr.write_line("baselines: " + ", ".join(f"{n} {s}" for s, n in sorted(status.items()))
                      + f" under {session.store.root}")
    if _full_run(config) and (exitstatus == 0 or not session.update_baselines):
        unused = session.store.unused(session.baselines_used)
        if unused and session.update_baselines:
            session.store.prune(unused)
            tr.write_line(f"baselines: pruned {len(unused)} unused: " + ", ".join(map(str, unused)))
        elif unused:
            tr.write_line(f"baselines: {len(unused)} unused (no test used them; `pytest --update-baselines` "
                          "on a full run prunes them): " + ", ".join(map(str, unused)))
    _write_outputs(config, session, rows)


def _write_outputs(config: pytest.Config, session: Any, rows: list[dict]) -> None:
    out_dir = config.getoption("parity_report")
    history = config.getoption("parity_history")
    if not (out_dir or history):
        return
    from . import report

    meta = session.metadata(_recipe_names(config), config.invocation_params.args)
    hist = report.append_history(rows, meta, history) if history else None
    if out_dir:
        report.write_report(rows, meta, out_dir, history=hist)

"""Benchmark the parity suite's overhead against the computation it checks (Aurora suite).

Measures on one machine, in one run:

(a) **bare compute** — every check of the Aurora catalogue (``aurora.checks.CHECKS``) and the training
    step, per recipe, timed directly without the plugin: the target run exactly as the runner does it
    (recipe context — autocast for bf16 —, ``rng.same_randomness``, ``no_grad``/``enable_grad``,
    output leaves to the CPU) under the NPU patch set. The *patched* target run is the computation;
    the patch set is applied once around the whole loop, so applying it per run is counted as plugin
    overhead. With stored baselines (the suite's default) there is no reference run; with
    ``--reference cpu`` each check's unpatched reference run is timed too. Model construction and
    context capture (``build_context``) and each check's ``build`` are timed separately ("setup"):
    both the bare run and the suite need them. Each repetition runs in a fresh Python process, just
    before the repetition's pytest runs: cold, as a pytest run is, and under the same load as the run
    it is set against (``--bare-in-process``: every repetition in this process, the later ones warm).
(b) **plugin** — ``pytest --npu-parity <suite> -p no:cacheprovider`` in a subprocess; its cost is the
    run's time minus pytest's own startup and collection (the same command with ``--co``). Per test,
    ``--durations=0`` gives the call time (the check's ``build`` plus everything ``parity.check``
    does), compared with bare build + run per check group.
(c) ratio suite / bare, overall and per check group, on wall time and on CPU time (the CPU seconds
    of the process and its threads: on a shared machine wall time carries other users' load, CPU
    time much less): the fastest suite run against the fastest bare process, and the median of the
    repetitions' paired ratios (repetition i's suite run against repetition i's bare process, run
    back to back, the bare process first in even repetitions and second in odd ones, next to the
    green run when there are red ones); the checks'
    call times against the bare builds and runs, the same two ways (``calls_wall``,
    ``calls_paired_wall``).
(d) comparison throughput: ``compare.compare`` on a large float32 tensor pair vs a plain
    ``clone`` of the pair (the bytes a comparison must read; a clone of one tensor is reported too); baseline load throughput (``BaselineStore.load`` of every committed Aurora
    baseline, including the checksum) vs reading the same bytes.
(e) peak resident memory of the bare process and of the pytest subprocess, and the minor page faults of
    each whole process (median): fresh pages mapped in, where the C allocator could not reuse freed memory.
(f) red runs, in the same run as the green one: the suite with one fault everywhere (the first FFN
    weight of every decoder layer × (1 + 1e-3) on the target side only: every whole-model and
    decoder check fails and is diagnosed within the localization budget) and the suite with stale
    baselines (every weight of the model × (1 + 1e-3) before the session: the model changed for
    every check, as when another torch version draws the weights). Both are injected by a pytest
    plugin this script writes to a temporary directory (``-p npu_parity_bench_faults``), never by
    the shipped suite. Each is reported against the bare compute and against the green run. The
    scenario ``fault-undiagnosed`` is the same fault with ``--parity-localize-budget 0``: the red run
    without any diagnosis, so the diagnosis's own cost is the difference of the two.

Before anything is timed, the caches a user's second run finds are filled (``warm_caches``: Python's
bytecode of the project's sources, pytest's rewritten copies of this package, of hypothesis and of the
suite's test modules); ``--cold-caches`` skips that, to time a first run, or every run where Python may
not write bytecode and nothing filled the caches before.

Results are printed as a table and written as JSON (``benchmarks/results/bench_suite.json``;
``bench_suite_quick.json`` with ``--quick``). No timing is asserted anywhere.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_suite.py              # whole suite, fp32 + bf16
    python benchmarks/bench_suite.py --quick                         # 6 checks, fp32 only (development)
    python benchmarks/bench_suite.py --repeat 3 --recipes fp32       # min/median over 3 repetitions
    python benchmarks/bench_suite.py --skip-plugin --compare-mib 64  # bare compute and throughput only
    python benchmarks/bench_suite.py --scenarios green,fault         # green and one red run
    python benchmarks/bench_suite.py --scenarios green,fault,fault-undiagnosed  # the diagnosis's cost

Exit status 0 when the run finished (whatever the numbers), 1 when the pytest run failed, 2 on bad
arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SUITE_FILES = ["parity_suites/aurora/test_model.py", "parity_suites/aurora/test_submodules.py",
               "parity_suites/aurora/test_train_step.py", "parity_suites/aurora/test_trajectory.py"]
#: The ``--quick`` subset: a function, a small and a large submodule, a training-mode module, the
#: whole model, and the training step (covers every kind of check at a fraction of the cost).
QUICK_CHECKS = ["resample_24", "ffn", "decoder_layer_0", "encoder_layer_0_train", "aurora_model"]
TRAIN_STEP = "train_step"
#: The main job's training trajectory (parity_suites/aurora/test_trajectory.py::test_trajectory: 60 steps and
#: the held-out forecasts); its nightly 300-step form is skipped there and not timed.
TRAJECTORY = "trajectory"
#: The pytest runs of (b) and (f): name -> what is injected (``NPU_PARITY_BENCH_FAULT``).
SCENARIOS = {"green": None, "fault": "ffn", "stale": "weights", "fault-undiagnosed": "ffn"}
#: Extra pytest arguments of a scenario: the same fault with the localization budget at 0 (no
#: localization, op trace, program difference nor counterfactual re-run): the cost of the diagnosis.
SCENARIO_ARGS = {"fault-undiagnosed": ["--parity-localize-budget", "0"]}
#: Relative size of the injected fault and of the stale-weights change.
FAULT_FACTOR = 1 + 1e-3

#: The plugin the red runs load (written to a temporary directory; not part of the shipped suite).
FAULT_PLUGIN = '''"""Benchmark fault injection for the Aurora suite (written by benchmarks/bench_suite.py).

NPU_PARITY_BENCH_FAULT=ffn      target side only: decoder FFN first weights x FACTOR inside the patch
                                set (their .data swapped for scaled copies made once, swapped back on
                                exit: no copy per run, and the host model's fingerprint never changes,
                                as a device kernel fault leaves the host model alone)
NPU_PARITY_BENCH_FAULT=weights  every floating weight of the model x FACTOR before the session (stale)
"""
import contextlib
import os

import torch

FACTOR = float(os.environ.get("NPU_PARITY_BENCH_FACTOR", "1.001"))
MODE = os.environ.get("NPU_PARITY_BENCH_FAULT", "")


def pytest_configure(config):
    from pytest_npu_parity.aurora import checks, factory, patches

    def model():
        return factory.get_model("full", seed=int(os.environ.get("NPU_PARITY_AURORA_SEED", "0")))

    if MODE == "ffn":
        upstream = patches.patched
        faulty = {}

        @contextlib.contextmanager
        def patched(device=None, **kwargs):
            weights = [model().get_parameter(f"model.dec_layers.{i}.ffn_layer.ffn.0.weight")
                       for i in range(checks.DEC_LAYERS)]
            for w in weights:
                if id(w) not in faulty:
                    faulty[id(w)] = (w, w.data, w.data * FACTOR)
            with upstream(device, **kwargs) as applied:
                for w in weights:
                    w.data = faulty[id(w)][2]
                try:
                    yield applied
                finally:
                    for w in weights:
                        w.data = faulty[id(w)][1]

        patches.patched = patched
    elif MODE == "weights":
        upstream_get = factory.get_model
        changed = set()

        def get_model(size="full", *args, **kwargs):
            m = upstream_get(size, *args, **kwargs)
            if size == "full" and id(m) not in changed:
                with torch.no_grad():
                    for p in m.parameters():
                        if p.is_floating_point():
                            p.mul_(FACTOR)
                changed.add(id(m))
            return m

        factory.get_model = get_model
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a subset of checks, fp32 only (development)")
    parser.add_argument("--recipes", default=None, help="comma-separated recipes (default fp32,bf16; quick: fp32)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="repetitions of the bare loop and of the pytest run (min and median reported)")
    parser.add_argument("--reference", choices=("auto", "cpu"), default="auto",
                        help="auto: stored baselines (no reference run); cpu: live CPU reference on both sides")
    parser.add_argument("--skip-plugin", action="store_true", help="skip the pytest runs (b, c, f)")
    parser.add_argument("--scenarios", default="green,fault,stale",
                        help="pytest runs to time: green (the suite as shipped), fault (one fault everywhere on "
                             "the target), stale (the model's weights changed), fault-undiagnosed (the fault with the "
                             "localization budget at 0); default green,fault,stale")
    parser.add_argument("--pytest-args", default="",
                        help="extra arguments for every pytest run (e.g. '--parity-localize-budget 60')")
    parser.add_argument("--vs-msprobe", type=int, default=None, metavar="ELEMENTS",
                        help="only time compare.compare against msprobe's dump compare on a float32 pair of ELEMENTS "
                             "elements (e.g. 67108864) and write benchmarks/results/compare_vs_msprobe.json")
    parser.add_argument("--compare-mib", type=int, default=None,
                        help="size of the comparison tensor in MiB (default 256; quick: 64)")
    parser.add_argument("--bare-in-process", action="store_true",
                        help="run every repetition of the bare compute in this process, before the pytest runs "
                             "(later repetitions run warm; the minimum per check is reported). Default: each "
                             "repetition in a fresh process, cold like a pytest run, interleaved with the pytest runs")
    parser.add_argument("--cold-caches", action="store_true",
                        help="skip the warm-up that fills Python's bytecode cache and pytest's rewritten copies "
                             "before anything is timed (with PYTHONDONTWRITEBYTECODE=1 every pytest run then "
                             "rewrites this package and hypothesis again)")
    parser.add_argument("--bare-child", default=None, metavar="JSON", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    args.recipes = (args.recipes or ("fp32" if args.quick else "fp32,bf16")).split(",")
    from pytest_npu_parity.recipes import RECIPES

    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; known: {', '.join(RECIPES)}")
    args.scenarios = [x for x in args.scenarios.split(",") if x]
    bad = [x for x in args.scenarios if x not in SCENARIOS]
    if bad or "green" not in args.scenarios:
        parser.error(f"--scenarios: {bad or 'green is required (red runs are reported against it)'}; "
                     f"known: {', '.join(SCENARIOS)}")
    args.pytest_args = args.pytest_args.split()
    args.compare_mib = args.compare_mib or (64 if args.quick else 256)
    name = "bench_suite_quick.json" if args.quick else "bench_suite.json"
    args.out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / name
    return args


# --------------------------------------------------------------------------------------------
# clocks


class Clock:
    """Wall and CPU seconds of a block (CPU: this process, every thread: ``time.process_time``)."""

    def __enter__(self) -> "Clock":
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def _summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "n": len(values)}


def machine() -> dict[str, Any]:
    """CPU model, core count, load, versions and thread settings of this run."""
    import torch

    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
            "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
            "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "platform": platform.platform()}


def _maxrss_mib(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0  # Linux: KiB


# --------------------------------------------------------------------------------------------
# (a) bare compute


def _train_step_leaves(module, inputs: dict, recipe, device) -> dict:
    """One training step as ``ParityCase.train_step`` runs it (AdamW, clip 1.0), minus the plugin."""
    import torch

    from pytest_npu_parity.runtime.training import _default_loss, default_optimizer

    module.train()
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    opt = default_optimizer([p for _, p in params])
    opt.zero_grad(set_to_none=True)
    with recipe.context(device):
        output = module(**inputs)
        loss = _default_loss(output)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
    grads = {f"grad.{n}": p.grad.detach().clone() for n, p in params if p.grad is not None}
    opt.step()
    out = {"loss": loss.detach(), **grads}
    out.update({f"param.{n}": p.detach() for n, p in params})
    out.update({f"buffer.{n}": b.detach() for n, b in module.named_buffers()})
    return out


def _trajectory_loop():
    """The suite's short trajectory loop and its inputs (parity_suites/aurora/test_trajectory.py)."""
    from pytest_npu_parity.aurora import checks
    from pytest_npu_parity.runtime.trajectory import TrajectoryLoop

    held_out, _ = checks.forecast_held_out()
    return (TrajectoryLoop(steps=60, evaluate=checks.evaluate_forecasts),
            {"batches": checks.trajectory_batches(), "held_out": held_out})


def _timed_run(call: Callable[[], Any], recipe, device, *, seed: int, grad: bool, recipe_context: bool = True):
    """Time ``call()`` under the recipe, shared randomness and the grad mode; leaves moved to the CPU."""
    import torch

    from pytest_npu_parity.compare import flatten
    from pytest_npu_parity.recipes import strict_fp32_flags
    from pytest_npu_parity.rng import same_randomness

    with Clock() as clock:
        with (recipe.context(device) if recipe_context else strict_fp32_flags()), same_randomness(seed), \
                (torch.enable_grad() if grad else torch.no_grad()):
            output = call()
        leaves = {p: (t.detach().cpu() if t is not None else None) for p, t in flatten(output)}
    del leaves
    return clock


def bare(names: list[str], recipes: list[str], reference: str, repeat: int) -> dict[str, Any]:
    """(a): setup, per-check build and run times, per recipe, ``repeat`` times."""
    import torch

    from pytest_npu_parity.aurora import checks, factory, patches
    from pytest_npu_parity.recipes import RECIPES
    from pytest_npu_parity.runtime.side import _move

    device = torch.device("cpu")
    with Clock() as setup:
        model = factory.get_model("full", seed=int(os.environ.get("NPU_PARITY_AURORA_SEED", "0")))
        ctx = checks.build_context(model, checks.suite_batch())
        tiny = factory.get_model("tiny", seed=0)
        batch = checks.suite_batch()
    per_check: dict[str, dict[str, Any]] = {}
    for _ in range(repeat):
        for recipe_name in recipes:
            recipe = RECIPES[recipe_name]
            for name in names:
                key = f"{recipe_name}-{name}"
                entry = per_check.setdefault(key, {"check": name, "recipe": recipe_name, "build_wall": [],
                                                   "build_cpu": [], "run_wall": [], "run_cpu": [],
                                                   "reference_wall": [], "reference_cpu": []})
                if name == TRAJECTORY:
                    entry["group"] = "training trajectory"
                    with Clock() as build:
                        module = copy.deepcopy(tiny).train()
                        ref_module = copy.deepcopy(tiny).train() if reference == "cpu" else None
                        loop, batches = _trajectory_loop()
                    with patches.patched(device):
                        run = _timed_run(lambda: loop(module, batches, recipe), recipe, device, seed=0, grad=True,
                                         recipe_context=False)
                    if ref_module is not None:
                        ref = _timed_run(lambda: loop(ref_module, batches, recipe), recipe, device, seed=0, grad=True,
                                         recipe_context=False)
                elif name == TRAIN_STEP:
                    entry["group"] = "training step"
                    inputs = batch.forward_kwargs(checks.HORIZON, train=True)
                    with Clock() as build:
                        module = copy.deepcopy(tiny)
                        ref_module = copy.deepcopy(tiny) if reference == "cpu" else None
                    with patches.patched(device):
                        run = _timed_run(lambda: _train_step_leaves(module, inputs, recipe, device), recipe,
                                         device, seed=0, grad=True, recipe_context=False)
                    if ref_module is not None:
                        ref = _timed_run(lambda: _train_step_leaves(ref_module, inputs, recipe, device), recipe,
                                         device, seed=0, grad=True, recipe_context=False)
                else:
                    check = checks.BY_NAME[name]
                    entry["group"] = check.group
                    with Clock() as build:
                        fn, args, kwargs = check.build(ctx)
                        if recipe.weights_dtype is not None:  # the session's one-time placement
                            fn = copy.deepcopy(fn).to(dtype=recipe.weights_dtype) \
                                if isinstance(fn, torch.nn.Module) else fn
                            args, kwargs = _move(args, device, recipe.weights_dtype), \
                                _move(kwargs, device, recipe.weights_dtype)
                        ref_fn = copy.deepcopy(fn) if reference == "cpu" and check.train else fn
                    with patches.patched(device):
                        run = _timed_run(lambda: fn(*args, **kwargs), recipe, device, seed=0, grad=False)
                    if reference == "cpu":
                        ref = _timed_run(lambda: ref_fn(*args, **kwargs), recipe, device, seed=0, grad=False)
                entry["build_wall"].append(build.wall)
                entry["build_cpu"].append(build.cpu)
                entry["run_wall"].append(run.wall)
                entry["run_cpu"].append(run.cpu)
                if reference == "cpu":
                    entry["reference_wall"].append(ref.wall)
                    entry["reference_cpu"].append(ref.cpu)
    return {"setup_wall": setup.wall, "setup_cpu": setup.cpu, "checks": per_check,
            "peak_rss_mib": _maxrss_mib(resource.RUSAGE_SELF)}


def bare_process(quick: bool, recipes: list[str], reference: str) -> dict[str, Any]:
    """(a) once, in a fresh Python process: cold, as each pytest run is (no repetition runs warm on
    the caches, allocator and oneDNN primitives of an earlier one)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="npu-parity-bare-", suffix=".json")
    os.close(fd)
    try:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--bare-child", path, "--recipes", ",".join(recipes),
               "--reference", reference, *(["--quick"] if quick else [])]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"bare compute process failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        result = json.loads(Path(path).read_text())
        # the whole process, as the pytest run's is timed: interpreter start, imports, exit included
        result["process_wall"] = wall
        result["process_cpu"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        result["process_minflt"] = after.ru_minflt - before.ru_minflt
        return result
    finally:
        os.unlink(path)


def _bare_totals(res: dict[str, Any], i: int = 0) -> tuple[float, float]:
    """Wall and CPU seconds of repetition ``i`` of a bare result: setup + every build and run."""
    wall = res["setup_wall"] + sum(e[k][i] for e in res["checks"].values()
                                   for k in ("build_wall", "run_wall") + (("reference_wall",) if e["reference_wall"] else ()))
    cpu = res["setup_cpu"] + sum(e[k][i] for e in res["checks"].values()
                                 for k in ("build_cpu", "run_cpu") + (("reference_cpu",) if e["reference_cpu"] else ()))
    return wall, cpu


def merge_bare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The bare processes' results as one: each check's lists hold one value per process, in order;
    ``processes`` holds each process's totals and ``best`` the index of the fastest (the one the
    summary reports, whole: a sum of per-check minima over processes would be no run at all)."""
    checks_: dict[str, dict[str, Any]] = {}
    for run in runs:
        for key, entry in run["checks"].items():
            merged = checks_.setdefault(key, {k: ([] if isinstance(v, list) else v) for k, v in entry.items()})
            for k, v in entry.items():
                if isinstance(v, list):
                    merged[k].extend(v)
    processes = [dict(zip(("total_wall", "total_cpu"), _bare_totals(run)), setup_wall=run["setup_wall"],
                      setup_cpu=run["setup_cpu"], process_wall=run.get("process_wall"),
                      process_cpu=run.get("process_cpu"), process_minflt=run.get("process_minflt")) for run in runs]
    best = min(range(len(runs)), key=lambda i: processes[i]["total_wall"])
    return {"setup_wall": runs[best]["setup_wall"], "setup_cpu": runs[best]["setup_cpu"], "checks": checks_,
            "peak_rss_mib": max(run["peak_rss_mib"] for run in runs), "processes": processes, "best": best}


def _median_faults(result: dict[str, Any]) -> str | None:
    """The table's line of minor page faults (fresh pages the kernel maps in: the cost of memory the C
    allocator could not reuse), median per whole process of each side; None when either side lacks them."""
    bare_ = [p.get("process_minflt") for p in (result.get("bare") or {}).get("processes", [])]
    runs = [r.get("minflt") for r in ((result.get("plugin") or {}).get("runs") or [])]
    if not bare_ or not runs or None in bare_ or None in runs:
        return None
    return (f"minor page faults per process, median: bare program {statistics.median(bare_):,.0f}, "
            f"pytest run {statistics.median(runs):,.0f}")


# --------------------------------------------------------------------------------------------
# (b) plugin


_DURATION = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S+)\s*$")


def _node_ids(names: list[str], recipes: list[str], quick: bool) -> list[str]:
    if not quick:
        return list(SUITE_FILES)
    from pytest_npu_parity.aurora import checks

    ids = []
    for name in names:
        if name == TRAIN_STEP:
            ids.append("parity_suites/aurora/test_train_step.py")
            continue
        if name == TRAJECTORY:
            ids.append("parity_suites/aurora/test_trajectory.py::test_trajectory")
            continue
        test = ("parity_suites/aurora/test_model.py::test_model" if checks.BY_NAME[name] in checks.MODEL_CHECKS
                else "parity_suites/aurora/test_submodules.py::test_submodule")
        ids.extend(f"{test}[{recipe}-{name}]" for recipe in recipes)
    return ids


def _pytest_command(extra: list[str], node_ids: list[str], recipes: list[str], reference: str) -> list[str]:
    """The benchmark's ``pytest --npu-parity`` command line (``sys.executable -m pytest``)."""
    return [sys.executable, "-m", "pytest", "--npu-parity", "-p", "no:cacheprovider", "-q",
            "--parity-dtypes", ",".join(recipes), "--parity-reference", reference, *extra, *node_ids]


def _pytest(extra: list[str], node_ids: list[str], recipes: list[str], reference: str,
            fault: str | None = None, plugin_dir: str | None = None) -> dict[str, Any]:
    """One pytest subprocess: wall and CPU seconds (children's user+system), exit code, durations;
    ``fault``: the ``NPU_PARITY_BENCH_FAULT`` mode of the plugin in ``plugin_dir`` (red runs)."""
    cmd = _pytest_command(extra, node_ids, recipes, reference)
    env = dict(os.environ)
    if fault:
        cmd[3:3] = ["-p", "npu_parity_bench_faults"]
        env["PYTHONPATH"] = os.pathsep.join([plugin_dir, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else plugin_dir
        env["NPU_PARITY_BENCH_FAULT"] = fault
        env["NPU_PARITY_BENCH_FACTOR"] = repr(FAULT_FACTOR)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    minflt = after.ru_minflt - before.ru_minflt
    durations: dict[str, dict[str, float]] = {}
    for line in proc.stdout.splitlines():
        m = _DURATION.match(line)
        if m:
            durations.setdefault(m.group(3), {})[m.group(2)] = float(m.group(1))
    tail = "\n".join(proc.stdout.splitlines()[-3:])
    outcomes = {}
    for line in proc.stdout.splitlines()[-3:]:
        for n, what in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", line):
            outcomes[what.rstrip("s") if what == "errors" else what] = int(n)
    notes = [line for line in proc.stdout.splitlines()
             if line.startswith(("localization", "baselines not usable", "Fix it once", "npu-parity: every"))
             or "every baseline of suite" in line]
    return {"cmd": " ".join(cmd[1:]), "wall": wall, "cpu": cpu, "minflt": minflt, "rc": proc.returncode, "durations": durations,
            "tail": tail, "outcomes": outcomes, "notes": notes, "fault": fault,
            "stderr_tail": proc.stderr[-2000:] if proc.returncode not in (0, 1, 5) else ""}


#: The plugin of the cache warm-up: imports every module of the package inside a pytest process, where
#: pytest's assertion rewriter handles them (a ``pytest11`` plugin's package is rewritten).
WARM_PLUGIN = '''"""Benchmark cache warm-up (written by benchmarks/bench_suite.py)."""
import importlib
import pkgutil


def pytest_configure(config):
    import pytest_npu_parity

    for info in pkgutil.walk_packages(pytest_npu_parity.__path__, "pytest_npu_parity."):
        try:
            importlib.import_module(info.name)
        except Exception:  # an optional dependency missing: that module is never imported here either
            pass
'''


def _rewritten_copies() -> int:
    """Cached copies that pytest's assertion rewriter wrote (``*-pytest-<version>.pyc``) for this project
    and for hypothesis (both ``pytest11`` plugins, so pytest rewrites their whole packages)."""
    import hypothesis

    roots = [ROOT / "pytest_npu_parity", ROOT / "parity_suites", Path(hypothesis.__file__).parent]
    return sum(1 for root in roots for _ in root.rglob("*-pytest-*.pyc"))


def warm_caches(recipes: list[str], reference: str) -> dict[str, Any]:
    """Fill the caches a user's second run finds, before anything is timed: Python's bytecode of the
    project's sources (``compileall``) and pytest's rewritten copies of this package, of hypothesis and
    of the suite's test modules (one ``pytest --co`` of the suite that imports every module, with bytecode
    writing allowed). Without them, where Python may not write bytecode (``PYTHONDONTWRITEBYTECODE=1``),
    every pytest run rewrites and compiles them again, about 2 s more a run on a 2-core machine, which
    the bare program does not pay: see docs/explanation/performance.md."""
    import compileall
    import tempfile

    before = _rewritten_copies()
    for folder in ("pytest_npu_parity", "parity_suites", "benchmarks"):
        compileall.compile_dir(ROOT / folder, quiet=1)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory(prefix="npu-parity-bench-warm-") as warm_dir:
        Path(warm_dir, "npu_parity_bench_warm.py").write_text(WARM_PLUGIN)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [warm_dir, env.get("PYTHONPATH")]))
        cmd = _pytest_command(["-p", "npu_parity_bench_warm", "--co"], SUITE_FILES, recipes, reference)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"cache warm-up failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return {"rewritten_copies_before": before, "rewritten_copies_after": _rewritten_copies()}


def plugin(names: list[str], recipes: list[str], reference: str, repeat: int, quick: bool,
           scenarios: list[str] = ("green",), extra: list[str] = (),
           before_each: Callable[[], None] | None = None) -> dict[str, Any]:
    """(b), (f): pytest startup + collection (``--co``), then the suite run of each scenario, each
    ``repeat`` times, interleaved (green, fault, stale, green, …) so that a change of the machine's
    load falls on every scenario alike; ``before_each()`` (the bare compute's process, so that it is
    interleaved with the suite's runs too) runs just before the green run in the even repetitions (0,
    2, …) and just after it in the odd ones: the order within a pair alternates, so that a machine that speeds up or
    slows down through the benchmark favours neither side of the paired ratios (with a fixed order, the
    side that always runs second gains whatever the drift gives; measured: one run's bare processes took
    50.6, 45.7, 43.2, 39.8 and 40.4 s in turn)."""
    import tempfile

    node_ids = _node_ids(names, recipes, quick)
    pytest_ref = "cpu" if reference == "cpu" else "auto"
    collect = [_pytest(["--co", *extra], node_ids, recipes, pytest_ref) for _ in range(repeat)]
    runs: dict[str, list] = {name: [] for name in scenarios}
    with tempfile.TemporaryDirectory(prefix="npu-parity-bench-") as plugin_dir:
        Path(plugin_dir, "npu_parity_bench_faults.py").write_text(FAULT_PLUGIN)
        for i in range(repeat):
            for name in scenarios:
                # the bare process next to the green run it is paired with: just before it in even
                # repetitions, just after it in odd ones (the red runs are not paired)
                if before_each is not None and name == "green" and i % 2 == 0:
                    before_each()
                runs[name].append(_pytest(["--durations=0", "--durations-min=0", *extra, *SCENARIO_ARGS.get(name, [])],
                                          node_ids, recipes,
                                          pytest_ref, fault=SCENARIOS[name], plugin_dir=plugin_dir))
                if before_each is not None and name == "green" and i % 2 == 1:
                    before_each()
    return {"collect": collect, "runs": runs["green"], "scenarios": runs,
            "peak_rss_mib": _maxrss_mib(resource.RUSAGE_CHILDREN)}


def _test_key(node_id: str) -> str | None:
    """``fp32-ffn`` for ``...::test_submodule[fp32-ffn]``; ``fp32-train_step`` for the training step."""
    m = re.search(r"\[([^\]]+)\]$", node_id)
    if not m:
        return None
    inner = m.group(1)
    if "test_trajectory.py::test_trajectory[" in node_id:
        return f"{inner}-{TRAJECTORY}"
    return f"{inner}-{TRAIN_STEP}" if "test_train_step" in node_id else inner


# --------------------------------------------------------------------------------------------
# (d) throughput


def throughput(mib: int, repeat: int) -> dict[str, Any]:
    """Comparison of a ``mib``-MiB float32 pair vs a plain clone; baseline load vs a plain read."""
    import torch

    from pytest_npu_parity.compare import compare
    from pytest_npu_parity.policy import default_for_recipe

    n = mib * 1024 * 1024 // 4
    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(n, generator=gen)
    actual = expected + 1e-7 * torch.randn(n, generator=gen)  # differs: the full metric path
    tol = default_for_recipe("fp32")
    copies, singles, compares = [], [], []
    for _ in range(max(3, repeat)):
        with Clock() as c:
            expected.clone()
        singles.append(c.wall)
        with Clock() as c:  # the data a comparison must read: both tensors
            actual.clone(), expected.clone()
        copies.append(c.wall)
        with Clock() as c:
            result = compare({"out": actual}, {"out": expected}, tol)
        compares.append(c.wall)
    assert result.leaves, "comparison produced no leaf"
    files = sorted((ROOT / "baselines" / "aurora").rglob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    loads, reads = [], []
    for _ in range(max(3, repeat)):
        with Clock() as c:
            for f in files:
                f.read_bytes()
        reads.append(c.wall)
        with Clock() as c:
            for f in files:
                _load_file(f)
        loads.append(c.wall)
    mb = n * 4 / 1e6
    return {
        "compare_mib": mib, "copy_pair_s": _summary(copies), "copy_one_s": _summary(singles),
        "compare_s": _summary(compares),
        "copy_gb_s": 2 * mb / 1e3 / min(copies), "compare_gb_s": 2 * mb / 1e3 / min(compares),
        "compare_over_copy": min(compares) / min(copies), "compare_over_copy_one": min(compares) / min(singles),
        "baseline_files": len(files), "baseline_mb": total / 1e6, "read_s": _summary(reads), "load_s": _summary(loads),
        "read_gb_s": total / 1e9 / min(reads), "load_gb_s": total / 1e9 / min(loads),
        "load_over_read": min(loads) / min(reads),
    }


def vs_msprobe(elements: int, repeat: int) -> dict[str, Any]:
    """``compare.compare`` (every metric and the msprobe view) against msprobe 26.2.0's own dump compare
    of the same float32 pair (``ValidateTensor.check_tensor`` + ``compare_ops_apply`` on the NumPy
    arrays, as ``msprobe -f pytorch compare`` runs them after reading), minimum of ``repeat`` runs."""
    import numpy as np
    import torch

    from msprobe.core.compare.npy_compare import CompareResult, ValidateTensor, compare_ops_apply
    from msprobe.core.common.const import CompareConst

    from pytest_npu_parity.compare import compare
    from pytest_npu_parity.policy import default_for_recipe

    gen = torch.Generator().manual_seed(0)
    expected = torch.randn(elements, generator=gen)
    actual = expected + 1e-7 * torch.randn(elements, generator=gen)
    tol = default_for_recipe("fp32")
    columns = [CompareConst.COSINE, CompareConst.EUC_DIST, CompareConst.MAX_ABS_ERR, CompareConst.MAX_RELATIVE_ERR,
               CompareConst.ONE_THOUSANDTH_ERR_RATIO, CompareConst.FIVE_THOUSANDTHS_ERR_RATIO]
    ours, theirs = [], []
    for _ in range(max(1, repeat)):
        with Clock() as c:
            leaf = compare({"out": actual}, {"out": expected}, tol).leaves[0]
        ours.append(c.wall)
        n, b = np.array(actual.numpy()), np.array(expected.numpy())  # copies: msprobe zeroes NaN/Inf in place
        with Clock() as c:
            checked = ValidateTensor().check_tensor(CompareResult(n, b))
            values, _ = compare_ops_apply(checked.n_value, checked.b_value, checked.error_flag, checked.err_msg,
                                          column_names=columns)
        theirs.append(c.wall)
    return {"elements": elements, "ours_s": _summary(ours), "msprobe_s": _summary(theirs),
            "speedup": min(theirs) / min(ours), "ours_view": leaf.msprobe.as_dict(),
            "msprobe_columns": [float(v) if not isinstance(v, str) else v for v in values]}


def _load_file(path: Path) -> Any:
    """``BaselineStore.load``'s reading, validation and checksum of one file (``store.reading._read``), with
    the store's object pool (format 4: recorded inputs and goldens of 4 KiB or more, re-hashed on reading)."""
    from pytest_npu_parity.store.pool import ObjectPool
    from pytest_npu_parity.store.reading import _read

    return _read(path, pool=ObjectPool(ROOT / "baselines"))


# --------------------------------------------------------------------------------------------
# report


def summarize(bare_res: dict, plugin_res: dict | None, recipes: list[str]) -> dict[str, Any]:
    """Totals and ratios, overall and per check group."""
    groups: dict[str, dict[str, float]] = {}
    total = {"build_wall": 0.0, "build_cpu": 0.0, "run_wall": 0.0, "run_cpu": 0.0, "reference_wall": 0.0,
             "reference_cpu": 0.0}
    best = bare_res.get("best")  # one process per repetition: that process's values, whole

    def pick(values: list[float]) -> float:
        return (values[best] if best is not None else min(values)) if values else 0.0

    for key, entry in bare_res["checks"].items():
        g = groups.setdefault(entry["group"], {"checks": 0, **{k: 0.0 for k in total}, "plugin_call_wall": 0.0})
        g["checks"] += 1
        for k in total:
            v = pick(entry[k])
            g[k] += v
            total[k] += v
    out: dict[str, Any] = {"bare": {"setup_wall": bare_res["setup_wall"], "setup_cpu": bare_res["setup_cpu"],
                                    **total}}
    out["bare"]["compute_wall"] = total["run_wall"] + total["reference_wall"]
    out["bare"]["compute_cpu"] = total["run_cpu"] + total["reference_cpu"]
    out["bare"]["total_wall"] = bare_res["setup_wall"] + total["build_wall"] + out["bare"]["compute_wall"]
    out["bare"]["total_cpu"] = bare_res["setup_cpu"] + total["build_cpu"] + out["bare"]["compute_cpu"]
    if plugin_res:
        col_wall = [r["wall"] for r in plugin_res["collect"]]
        col_cpu = [r["cpu"] for r in plugin_res["collect"]]
        run_wall = [r["wall"] for r in plugin_res["runs"]]
        run_cpu = [r["cpu"] for r in plugin_res["runs"]]
        suite_wall = min(run_wall) - min(col_wall)
        suite_cpu = min(run_cpu) - min(col_cpu)
        out["plugin"] = {"collect_wall": _summary(col_wall), "collect_cpu": _summary(col_cpu),
                         "run_wall": _summary(run_wall), "run_cpu": _summary(run_cpu),
                         "suite_wall": suite_wall, "suite_cpu": suite_cpu,
                         "rc": [r["rc"] for r in plugin_res["runs"]], "tail": plugin_res["runs"][-1]["tail"]}
        out["ratio"] = {"wall": suite_wall / out["bare"]["total_wall"], "cpu": suite_cpu / out["bare"]["total_cpu"]}
        processes = bare_res.get("processes")
        if processes and len(processes) == len(plugin_res["runs"]):
            # repetition i's suite run against repetition i's bare process (run back to back: the same load;
            # the bare process first in even repetitions, second in odd ones: ``plugin``)
            paired = [((r["wall"] - min(col_wall)) / b["total_wall"], (r["cpu"] - min(col_cpu)) / b["total_cpu"])
                      for r, b in zip(plugin_res["runs"], processes)]
            out["ratio"]["paired_wall"] = [w for w, _ in paired]
            out["ratio"]["paired_cpu"] = [c for _, c in paired]
            out["ratio"]["paired_wall_median"] = statistics.median(w for w, _ in paired)
            out["ratio"]["paired_cpu_median"] = statistics.median(c for _, c in paired)
        if processes and all(b.get("process_wall") for b in processes):
            # Whole process against whole process: the pytest run against the bare program, each from
            # its interpreter's start to its exit. The in-process figures above leave out of the bare
            # side what they charge to the suite: the exit of an interpreter that has imported torch,
            # transformers and the aurora package (about 1.5 s on this machine, for any program) and the
            # imports and startup the collection run does not have.
            out["process"] = {"bare_wall": _summary([b["process_wall"] for b in processes]),
                              "bare_cpu": _summary([b["process_cpu"] for b in processes]),
                              "ratio_wall": min(run_wall) / min(b["process_wall"] for b in processes),
                              "ratio_cpu": min(run_cpu) / min(b["process_cpu"] for b in processes)}
            if len(processes) == len(plugin_res["runs"]):
                walls = [r["wall"] / b["process_wall"] for r, b in zip(plugin_res["runs"], processes)]
                cpus = [r["cpu"] / b["process_cpu"] for r, b in zip(plugin_res["runs"], processes)]
                out["process"].update(paired_wall=walls, paired_cpu=cpus, paired_wall_median=statistics.median(walls),
                                      paired_cpu_median=statistics.median(cpus))
        # per group: pytest call time (min over runs) vs bare build + compute of the same checks
        calls: dict[str, float] = {}
        for r in plugin_res["runs"]:
            for node, phases in r["durations"].items():
                key = _test_key(node)
                if key and "call" in phases:
                    calls[key] = min(calls.get(key, float("inf")), phases["call"])
        for key, entry in bare_res["checks"].items():
            if key in calls:
                groups[entry["group"]]["plugin_call_wall"] += calls[key]
        for g in groups.values():
            bare_wall = g["build_wall"] + g["run_wall"] + g["reference_wall"]
            g["ratio_wall"] = g["plugin_call_wall"] / bare_wall if bare_wall and g["plugin_call_wall"] else None
        processes = bare_res.get("processes")
        if processes and len(processes) == len(plugin_res["runs"]):
            # one bare process per repetition: repetition i's call times against bare process i's builds
            # and runs, over the checks that both ran (a check without a call phase in that pytest run,
            # as after a setup error or a deselection, is left out of both sides and counted in
            # ``calls_paired_missing``); the per-check minima above compare each check's fastest call
            # over every run with one process's values, which hides most of a cost that varies from
            # run to run
            paired_calls, missing = [], []
            for i, r in enumerate(plugin_res["runs"]):
                by_key = {_test_key(node): phases["call"] for node, phases in r["durations"].items()
                          if "call" in phases}
                keys = [k for k in bare_res["checks"] if k in by_key]
                bare_calls_i = sum(bare_res["checks"][k][f][i] for k in keys
                                   for f in ("build_wall", "run_wall", "reference_wall") if bare_res["checks"][k][f])
                paired_calls.append(sum(by_key[k] for k in keys) / bare_calls_i if bare_calls_i else None)
                missing.append(len(bare_res["checks"]) - len(keys))
            if None not in paired_calls:
                out["ratio"]["calls_paired_wall"] = paired_calls
                out["ratio"]["calls_paired_wall_median"] = statistics.median(paired_calls)
                out["ratio"]["calls_paired_missing"] = missing
        calls_total = sum(g["plugin_call_wall"] for g in groups.values())
        bare_calls = total["build_wall"] + total["run_wall"] + total["reference_wall"]
        out["ratio"]["calls_wall"] = calls_total / bare_calls if bare_calls else None
        out["plugin"]["calls_wall"] = calls_total
        scen: dict[str, Any] = {}
        for name, runs in plugin_res.get("scenarios", {}).items():
            wall = min(r["wall"] for r in runs) - min(col_wall)
            cpu = min(r["cpu"] for r in runs) - min(col_cpu)
            scen[name] = {"suite_wall": wall, "suite_cpu": cpu, "run_wall": _summary([r["wall"] for r in runs]),
                          "vs_bare_wall": wall / out["bare"]["total_wall"], "vs_bare_cpu": cpu / out["bare"]["total_cpu"],
                          "outcomes": runs[-1].get("outcomes", {}), "notes": runs[-1].get("notes", []),
                          "rc": [r["rc"] for r in runs]}
        for entry in scen.values():
            entry["vs_green_wall"] = entry["suite_wall"] / scen["green"]["suite_wall"] if "green" in scen else None
            entry["vs_green_cpu"] = entry["suite_cpu"] / scen["green"]["suite_cpu"] if "green" in scen else None
        out["scenarios"] = scen
    out["groups"] = groups
    return out


def table(result: dict[str, Any]) -> str:
    """The printed table (also docs/explanation/performance.md's)."""
    s, m = result["summary"], result["machine"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
             f"load average {result['load_before'][0]:.1f} → {result['load_after'][0]:.1f}",
             f"checks: {result['n_checks']} ({', '.join(result['recipes'])}), reference {result['reference']}, "
             f"repeat {result['repeat']}; bare compute: {result.get('bare_mode', 'in-process')}", ""]
    b = s["bare"]
    lines.append(f"{'':34}{'wall s':>10}{'CPU s':>10}")
    lines.append(f"{'bare: model + context (setup)':34}{b['setup_wall']:10.1f}{b['setup_cpu']:10.1f}")
    lines.append(f"{'bare: check builds':34}{b['build_wall']:10.1f}{b['build_cpu']:10.1f}")
    lines.append(f"{'bare: target runs':34}{b['run_wall']:10.1f}{b['run_cpu']:10.1f}")
    if b["reference_wall"]:
        lines.append(f"{'bare: reference runs':34}{b['reference_wall']:10.1f}{b['reference_cpu']:10.1f}")
    lines.append(f"{'bare: total':34}{b['total_wall']:10.1f}{b['total_cpu']:10.1f}")
    if "plugin" in s:
        p = s["plugin"]
        lines.append(f"{'pytest startup + collection (--co)':34}{p['collect_wall']['min']:10.1f}"
                     f"{p['collect_cpu']['min']:10.1f}")
        lines.append(f"{'pytest run':34}{p['run_wall']['min']:10.1f}{p['run_cpu']['min']:10.1f}")
        lines.append(f"{'suite = run - collection':34}{p['suite_wall']:10.1f}{p['suite_cpu']:10.1f}")
        lines.append(f"{'ratio suite / bare':34}{s['ratio']['wall']:10.3f}{s['ratio']['cpu']:10.3f}")
        if "paired_wall" in s["ratio"]:
            lines.append(f"{'paired runs, median ratio':34}{s['ratio']['paired_wall_median']:10.3f}"
                         f"{s['ratio']['paired_cpu_median']:10.3f}")
            lines.append("  per repetition (wall): " + ", ".join(f"{x:.3f}" for x in s["ratio"]["paired_wall"]))
        if "process" in s:
            pr = s["process"]
            lines.append(f"{'whole processes: bare program':34}{pr['bare_wall']['min']:10.1f}{pr['bare_cpu']['min']:10.1f}")
            lines.append(f"{'whole processes: pytest run':34}{p['run_wall']['min']:10.1f}{p['run_cpu']['min']:10.1f}")
            lines.append(f"{'ratio pytest run / bare program':34}{pr['ratio_wall']:10.3f}{pr['ratio_cpu']:10.3f}")
            if "paired_wall" in pr:
                lines.append(f"{'  paired, median':34}{pr['paired_wall_median']:10.3f}{pr['paired_cpu_median']:10.3f}")
                lines.append("  per repetition (wall): " + ", ".join(f"{x:.3f}" for x in pr["paired_wall"]))
        lines.append("")
        lines.append(f"{'group':32}{'checks':>7}{'bare s':>9}{'pytest s':>10}{'ratio':>8}")
        for name, g in sorted(s["groups"].items()):
            bare_wall = g["build_wall"] + g["run_wall"] + g["reference_wall"]
            ratio = f"{g['ratio_wall']:8.2f}" if g.get("ratio_wall") else f"{'-':>8}"
            lines.append(f"{name[:31]:32}{g['checks']:7d}{bare_wall:9.2f}{g['plugin_call_wall']:10.2f}{ratio}")
        lines.append(f"{'all (per-test call time)':32}{'':7}{'':9}{p['calls_wall']:10.2f}"
                     f"{s['ratio']['calls_wall']:8.2f}")
        if "calls_paired_wall" in s["ratio"]:
            lines.append(f"{'  the same, paired per repetition':32}{'':26}{s['ratio']['calls_paired_wall_median']:8.2f}"
                         "  (" + ", ".join(f"{x:.3f}" for x in s["ratio"]["calls_paired_wall"]) + ")")
    if s.get("scenarios"):
        lines.append("")
        lines.append(f"{'scenario (suite = run - collection)':38}{'wall s':>8}{'CPU s':>8}{'/bare':>7}{'/green':>8}"
                     f"{'  failed/passed':>16}")
        labels = {"green": "green (stored baselines)", "fault": f"fault: dec FFN weights x{FAULT_FACTOR:g}",
                  "stale": f"stale: model weights x{FAULT_FACTOR:g}",
                  "fault-undiagnosed": "fault, localization budget 0"}
        for name, e in s["scenarios"].items():
            o = e["outcomes"]
            lines.append(f"{labels.get(name, name):38}{e['suite_wall']:8.1f}{e['suite_cpu']:8.1f}"
                         f"{e['vs_bare_wall']:7.2f}{e['vs_green_wall']:8.2f}"
                         f"{str(o.get('failed', 0)) + '/' + str(o.get('passed', 0)):>16}")
        for name, e in s["scenarios"].items():
            for note in e["notes"]:
                lines.append(f"  {name}: {note[:150]}")
    t = result.get("throughput")
    if t:
        lines.append("")
        lines.append(f"compare a {t['compare_mib']} MiB float32 pair: {t['compare_gb_s']:.2f} GB/s vs cloning the pair "
                     f"{t['copy_gb_s']:.2f} GB/s: {t['compare_over_copy']:.2f}× the copy time "
                     f"({t['compare_over_copy_one']:.2f}× a clone of one tensor)")
        lines.append(f"baseline load {t['baseline_files']} files, {t['baseline_mb']:.1f} MB: {t['load_gb_s']:.2f} GB/s "
                     f"vs read {t['read_gb_s']:.2f} GB/s ({t['load_over_read']:.2f}×)")
    faults = _median_faults(result)
    if faults:
        lines.append(faults)
    lines.append(f"peak RSS: bare process {result['peak_rss_mib']['bare']:.0f} MiB"
                 + (f", pytest {result['peak_rss_mib']['pytest']:.0f} MiB" if result['peak_rss_mib'].get('pytest')
                    else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.vs_msprobe:
        res = {"machine": machine(), "load_before": list(os.getloadavg()), **vs_msprobe(args.vs_msprobe, args.repeat)}
        res["load_after"] = list(os.getloadavg())
        out = ROOT / "benchmarks" / "results" / "compare_vs_msprobe.json"
        out.write_text(json.dumps(res, indent=1, default=str))
        print(f"{args.vs_msprobe} float32 elements: ours {res['ours_s']['min']:.2f} s, msprobe {res['msprobe_s']['min']:.2f} s, "
              f"{res['speedup']:.1f}x; written {out.relative_to(ROOT)}")
        return 0
    from pytest_npu_parity.aurora import checks

    names = (QUICK_CHECKS if args.quick else [c.name for c in checks.CHECKS]) + [TRAIN_STEP, TRAJECTORY]
    if args.bare_child:  # one cold repetition of (a), for bare_process
        Path(args.bare_child).write_text(json.dumps(bare(names, args.recipes, args.reference, 1)))
        return 0
    result: dict[str, Any] = {"machine": machine(), "load_before": list(os.getloadavg()), "quick": args.quick,
                              "recipes": args.recipes, "reference": args.reference, "repeat": args.repeat,
                              "n_checks": len(names) * len(args.recipes)}
    if args.bare_in_process:
        result["bare_mode"] = "in-process, warm repetitions"
    elif args.skip_plugin:
        result["bare_mode"] = "a fresh process per repetition"
    else:
        result["bare_mode"] = ("a fresh process per repetition, just before the green pytest run in even "
                               "repetitions, just after it in odd ones")
    result["caches"] = {"warmed": False} if args.cold_caches else \
        {"warmed": True, **warm_caches(args.recipes, args.reference)}
    started = time.perf_counter()
    bare_runs: list[dict[str, Any]] = []

    def one_bare_process() -> None:
        bare_runs.append(bare_process(args.quick, args.recipes, args.reference))

    if args.bare_in_process:
        bare_res = bare(names, args.recipes, args.reference, args.repeat)
    elif args.skip_plugin:
        for _ in range(args.repeat):
            one_bare_process()
    plugin_res = None if args.skip_plugin else plugin(
        names, args.recipes, args.reference, args.repeat, args.quick, args.scenarios, args.pytest_args,
        before_each=None if args.bare_in_process else one_bare_process)
    if not args.bare_in_process:
        bare_res = merge_bare(bare_runs)
    throughput_res = throughput(args.compare_mib, args.repeat)
    result["load_after"] = list(os.getloadavg())
    result["elapsed_s"] = time.perf_counter() - started
    result["bare"] = bare_res
    result["throughput"] = throughput_res
    result["summary"] = summarize(bare_res, plugin_res, args.recipes)
    result["peak_rss_mib"] = {"bare": bare_res["peak_rss_mib"],
                              "pytest": plugin_res["peak_rss_mib"] if plugin_res else None}
    if plugin_res:
        result["plugin"] = {"collect": [{k: v for k, v in r.items() if k != "durations"} for r in plugin_res["collect"]],
                            "runs": plugin_res["runs"],
                            "scenarios": {name: [{k: v for k, v in r.items() if k != "durations"} for r in runs]
                                          for name, runs in plugin_res["scenarios"].items() if name != "green"}}
    text = table(result)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["table"] = text
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"\nwritten {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    red = [r for name, runs in (plugin_res or {}).get("scenarios", {}).items() if name != "green" for r in runs]
    if any(r["rc"] not in (0, 1) for r in red):  # a red run fails its tests (1); anything else broke
        print("a red pytest run did not finish:\n" + red[-1]["tail"] + red[-1]["stderr_tail"], file=sys.stderr)
        return 1
    if plugin_res and any(r["rc"] != 0 for r in plugin_res["runs"]):
        print("pytest run failed:\n" + plugin_res["runs"][-1]["tail"] + plugin_res["runs"][-1]["stderr_tail"],
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

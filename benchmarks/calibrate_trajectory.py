"""Calibration of the trajectory verdict: legitimate variants and planted faults against the committed baselines.

Runs the Aurora suite's trajectory check (``parity_suites/aurora/test_trajectory.py``: the tiny seeded Aurora,
upstream's AdamW recipe, 16 batches of 4 real CO2 windows, 8 held-out El Niño windows) the way the suite does,
against the committed baselines of ``baselines/aurora/test_trajectory/``, under each variant, and records what the
default verdict (``judge.trajectory.DEFAULT_LIMITS``) makes of it: the mean relative loss and grad-norm errors, the
largest per-module mean, the largest forecast-metric difference, the steps where the curves part, pass or fail.

A variant is either this process as it is (``clean``: the environment is the variant — run the script again under
``ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2``, or with another torch's interpreter, with ``--label``),
one intra-op thread (``threads1``), or a fault of ``pytest_npu_parity.aurora.training_faults`` planted on the
target. The WarmupLR fault (``schedule``) needs a warmup loop, which the committed baselines do not have: it is
judged against a live CPU run of the same loop. Each run merges its rows into ``--json`` (keyed by label, recipe,
variant and steps) and rewrites ``--md`` from all rows, so the three environments fill one table::

    python benchmarks/calibrate_trajectory.py --label "this CPU" --variants all
    ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/calibrate_trajectory.py \\
        --label "ATen default + AVX2" --variants clean
    /path/to/torch-2.5.1/bin/python benchmarks/calibrate_trajectory.py --label "torch 2.5.1" --variants clean

``--steps 300`` uses the nightly form's baselines (``test_trajectory_long``); bf16-weights and fp16 (both opt-in
recipes) have a 60-step baseline only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pytest_npu_parity.runtime import npu  # noqa: E402

npu.prepare_torch()  # before torch: a torch_npu wheel without CANN (torch 2.5.1's leg) must not break import torch

import torch  # noqa: E402

from pytest_npu_parity.aurora import checks, factory, patches  # noqa: E402
from pytest_npu_parity.aurora.training_faults import faulty_target  # noqa: E402
from pytest_npu_parity.compare import ParityError  # noqa: E402
from pytest_npu_parity.runner import ParityCase, ParitySession  # noqa: E402
from pytest_npu_parity.runtime.trajectory import TrajectoryLoop  # noqa: E402
from pytest_npu_parity.store.suites import SuiteStores  # noqa: E402

#: Expected verdict of a fault below what a recipe resolves: a 1e-4 weight fault moves a bf16 trajectory less
#: than the reduction order does (1 thread vs 2: 6.8e-4), so bf16 cannot tell it; that is the fp32 recipe's job.
#: Likewise the weight fault and AdamW eps × 10 under fp16 (8.9e-5 and 8.7e-5 against 7.2e-5 for 1 thread).
BELOW = "below resolution"
#: variant -> (recipes it runs under, expected verdict; a dict: per recipe)
VARIANTS = {
    "clean": (("fp32", "bf16", "bf16-weights", "fp16"), "pass"),
    "threads1": (("fp32", "bf16", "bf16-weights", "fp16"), "pass"),
    "weight": (("fp32", "bf16", "fp16"), {"fp32": "fail", "bf16": BELOW, "fp16": BELOW}),
    "eps": (("fp32", "fp16"), {"fp32": "fail", "fp16": BELOW}),
    "clip": (("fp32", "fp16"), "fail"),
    "dropout": (("fp32", "fp16"), "fail"),
    "schedule": (("fp32",), "fail"),
    "no_master_weights": (("bf16-weights",), "fail"),
    "fp16_unscale": (("fp16",), "fail"),
}
TEST = {60: "test_trajectory", 300: "test_trajectory_long"}


def _expected(variant: str, recipe: str) -> str:
    expected = VARIANTS[variant][1]
    return expected[recipe] if isinstance(expected, dict) else expected


def _wrong(row: dict) -> bool:
    return row["expected"] != BELOW and row["verdict"] != row["expected"]


def _runs(variant: str, recipe: str, steps: int) -> bool:
    """Whether ``variant`` has a row under ``recipe`` at ``steps`` (bf16-weights and fp16: 60-step baselines only)."""
    return recipe in VARIANTS[variant][0] and (recipe not in ("bf16-weights", "fp16") or steps == 60)


def _test_id(steps: int, recipe: str) -> str:
    return f"parity_suites/aurora/test_trajectory.py::{TEST[steps]}[{recipe}]"


def _reference_patches(recipe: str):
    return (lambda device: patches.patched(device)) if recipe == "bf16-weights" else None


def run_variant(variant: str, recipe: str, steps: int, model, batches, held_out) -> dict:
    """One row: the suite's trajectory check under ``variant`` and ``recipe``, judged by the default verdict."""
    schedule = variant == "schedule"
    loop = TrajectoryLoop(steps=steps, evaluate=checks.evaluate_forecasts,
                          schedule="warmup_log" if schedule else "constant")
    if schedule:  # judged against a live CPU run of the warmup loop (no committed baseline has one)
        session = ParitySession(torch.device("cpu"), reference="cpu")
    else:
        session = ParitySession(torch.device("cpu"), reference="baseline", store=SuiteStores(REPO / "baselines"))
    target = (lambda device: patches.patched(device)) if variant in ("clean", "threads1") else faulty_target(variant, model)
    case = ParityCase(session, _test_id(steps, recipe), recipe, patches=target,
                      reference_patches=_reference_patches(recipe))
    threads = torch.get_num_threads()
    if variant == "threads1":
        torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        result = case.trajectory("trajectory", model, batches, loop=loop, held_out=held_out[0],
                                 window_labels=held_out[1]).result
    except ParityError as failure:
        result = failure.result
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - start
    curves = {c.name: c for c in result.curves}
    layers = [c.mean_rel for name, c in curves.items() if name.startswith("layer_grad_norm.")]
    forecast = result.forecast.metrics if result.forecast is not None else []
    layer = result.first_parting_layer
    return {
        "recipe": recipe, "variant": variant, "steps": steps, "expected": _expected(variant, recipe),
        "verdict": "pass" if result.passed else "fail",
        "loss_mean_rel": result.mean_rel_loss_error, "loss_parted_at": result.loss_parted_at,
        "grad_norm_mean_rel": curves["grad_norm"].mean_rel if "grad_norm" in curves else math.nan,
        "grad_norm_parted_at": result.grad_norm_parted_at,
        "largest_module_mean_rel": max(layers) if layers else math.nan,
        "first_module": None if layer is None else f"{layer[0]} at step {layer[1]}",
        "forecast_max_rel_diff": max((m.rel_diff for m in forecast), default=math.nan),
        "reference": "live CPU, warmup loop" if schedule else "committed baseline",
        "problems": list(result.problems), "seconds": round(seconds, 1),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render(rows: list[dict], machine: str) -> str:
    """The calibration table as Markdown."""
    def num(x):
        return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2g}"

    def step(s):
        return "–" if s is None else str(s)

    lines = ["# Trajectory verdict calibration", "",
             "Written by `benchmarks/calibrate_trajectory.py` (see its docstring for how each label was run). The "
             "check is `parity_suites/aurora/test_trajectory.py` on the tiny seeded Aurora; the reference is the "
             "committed baseline (recorded with torch 2.14.1, 2 threads) except for the WarmupLR fault, judged "
             "against a live CPU run of the warmup loop. Limits: `judge.trajectory.DEFAULT_LIMITS` (fp32: loss "
             "1e-6, grad norm 2.5e-6, each module 1e-3, forecast 1e-4; bf16 and bf16-weights: 1e-2, 5e-2, 0.25, "
             "5e-2; fp16: 5e-4, 5e-3, 4e-2, 1e-3). A row is correct when a legitimate variant passes and a fault fails.", "",
             f"CPU: {machine}.", "",
             "| label | torch | recipe | variant | steps | expected | verdict | mean rel. loss error | loss parts at | "
             "mean rel. grad-norm error | grad norm parts at | largest module mean | forecast max rel. diff | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {v: i for i, v in enumerate(VARIANTS)}
    recipes = {"fp32": 0, "bf16": 1, "bf16-weights": 2, "fp16": 3}
    for r in sorted(rows, key=lambda r: (recipes.get(r["recipe"], 9), r["steps"], order.get(r["variant"], 99),
                                         r["label"])):
        ok = " ❌ wrong" if _wrong(r) else ""
        lines.append(f"| {r['label']} | {r['torch'].split('+')[0]} | {r['recipe']} | {r['variant']} | {r['steps']} | {r['expected']} | "
                     f"**{r['verdict']}**{ok} | {num(r['loss_mean_rel'])} | {step(r['loss_parted_at'])} | "
                     f"{num(r['grad_norm_mean_rel'])} | {step(r['grad_norm_parted_at'])} | "
                     f"{num(r['largest_module_mean_rel'])} | {num(r['forecast_max_rel_diff'])} | {r['seconds']} |")
    wrong = [r for r in rows if _wrong(r)]
    lines += ["", f"{len(rows)} rows, {len(wrong)} wrong verdicts ({BELOW!r}: a fault smaller than the recipe's "
              "legitimate variation, not counted)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the environment's name in the table, e.g. 'torch 2.5.1'")
    parser.add_argument("--variants", default="clean", help="comma-separated variants, 'all', or 'none' (rewrite --md only) "
                        f"({', '.join(VARIANTS)})")
    parser.add_argument("--recipes", default="fp32,bf16,bf16-weights,fp16")
    parser.add_argument("--steps", type=int, default=60, choices=sorted(TEST))
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks/results/calibration_trajectory.json")
    parser.add_argument("--md", type=Path, default=REPO / "benchmarks/results/calibration_trajectory.md")
    args = parser.parse_args(argv)
    variants = [] if args.variants == "none" else list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    recipes = args.recipes.split(",")
    known = sorted({r for runs_under, _ in VARIANTS.values() for r in runs_under})
    if [r for r in recipes if r not in known]:
        parser.error(f"unknown recipe(s) {', '.join(r for r in recipes if r not in known)}; known: {', '.join(known)}")
    if variants and not [(v, r) for v in variants for r in recipes if _runs(v, r, args.steps)]:
        parser.error(f"no row to run: variant(s) {', '.join(variants)} under recipe(s) {', '.join(recipes)} at "
                     f"{args.steps} steps (" + "; ".join(f"{v}: {', '.join(VARIANTS[v][0])}" for v in variants)
                     + "; bf16-weights and fp16 at 60 steps only)")

    model = factory.get_model("tiny", seed=0) if variants else None
    batches, held_out = (checks.trajectory_batches(), checks.forecast_held_out()) if variants else (None, None)
    rows = json.loads(args.json.read_text())["rows"] if args.json.exists() else []
    for variant in variants:
        for recipe in recipes:
            if not _runs(variant, recipe, args.steps):
                continue
            row = dict(run_variant(variant, recipe, args.steps, model, batches, held_out), label=args.label,
                       torch=torch.__version__,
                       env={k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ})
            print(f"{args.label:>22} {recipe:>12} {variant:>18} {row['verdict']:>4} (expected {row['expected']}) "
                  f"loss {row['loss_mean_rel']:.2g} grad norm {row['grad_norm_mean_rel']:.2g} {row['seconds']} s",
                  flush=True)
            key = (row["label"], recipe, variant, args.steps)
            rows = [r for r in rows if (r["label"], r["recipe"], r["variant"], r["steps"]) != key] + [row]
    machine = f"{_cpu_model()}, {os.cpu_count()} CPUs"
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rows": rows}, indent=1, default=str) + "\n")
    os.replace(tmp, args.json)
    tmp = args.md.with_suffix(".tmp")
    tmp.write_text(render(rows, machine))
    os.replace(tmp, args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Calibrate the distribution verdict: false failures of independent CPU runs, power against a wrong noise scale.

For each layout of Aurora's flow sampler (below) the script draws the reference's samples from torch's
CPU generator seeded ``s`` and the target's from seed ``rng.target_seed(s)`` (independent streams, as
``--parity-rng device`` draws them), judges them with ``distribution.compare_samples`` under the
default ``DistributionPolicy`` (alpha 1e-3, 1999 permutations), and counts

* **false failures**: clean target, ``--seeds`` seed pairs; with the share of p-values at or below
  0.05 and 0.01 (a calibrated test gives about 5 % and 1 %);
* **power**: the target's sampler noise scaled by each ``--factors`` value
  (``aurora.checks.scaled_sampler_noise``), ``--power-seeds`` seed pairs each;
* **time**: CPU seconds of one comparison and of one side's sampling (mean over the clean runs).

Layouts (``--layouts``):

``tiny-flow-16x64``   tiny model, ``FlowLoss.sample`` for 16 CO2 series (32 flow-head rows) × 64 samples
                      (the proof in ``tests/judge/test_distribution.py``)
``tiny-flow-4x32``    tiny model, the suite's 4 series × 32 samples
``full-flow-4x32``    full model, the suite's ``flow_loss_sample_multi`` layout (8 rows × 32 samples)
``full-generate-4x32`` full model, the suite's ``generate_samples`` (4 series × 32 samples × 96 steps)

Writes ``benchmarks/results/calibration_distribution.json`` and prints a Markdown table.

Usage::

    python benchmarks/calibrate_distribution.py                          # ≈ 15 min on 2 cores
    python benchmarks/calibrate_distribution.py --layouts tiny-flow-16x64 --seeds 500 --power-seeds 50

Exit status 0 when the run finished (whatever the rates), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = {  # name: (model size, series, samples, what)
    "tiny-flow-16x64": ("tiny", 16, 64, "flow"),
    "tiny-flow-4x32": ("tiny", 4, 32, "flow"),
    "full-flow-4x32": ("full", 4, 32, "flow"),
    "full-generate-4x32": ("full", 4, 32, "generate"),
}
DEFAULT_SEEDS = {"tiny-flow-16x64": 200, "tiny-flow-4x32": 200, "full-flow-4x32": 200, "full-generate-4x32": 100}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--seeds", type=int, default=None,
                        help="clean seed pairs per layout (default: 200, 100 for full-generate)")
    parser.add_argument("--power-seeds", type=int, default=20, help="seed pairs per noise-scale factor")
    parser.add_argument("--factors", default="1.02,1.05,1.1,1.2", help="noise-scale faults, comma-separated")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (default 1: steadier CPU times on a shared machine)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="directory for the JSON file")
    return parser.parse_args(argv)


def _sampler(size: str, series: int, samples: int, what: str):
    """``draw(seed, noise_scale) -> samples`` for one layout (the model is built once)."""
    import torch

    from pytest_npu_parity import rng
    from pytest_npu_parity.aurora import checks, factory, inputs

    model = factory.get_model(size, seed=0)
    batch = inputs.make_batch(batch=series).normalized()
    if what == "flow":
        z, prototypes = inputs.flow_head_inputs(model, batch)

        def run():
            return model.flow_match.sample(z, prototype=prototypes, num_samples=samples, inference_token_len=48)
    else:
        def run():
            return model.generate(inputs=batch.context, max_output_length=96, inference_token_len=48,
                                  num_samples=samples)

    def draw(seed: int, scale: float = 1.0) -> "torch.Tensor":
        with rng.own_randomness(seed), checks.scaled_sampler_noise(scale), torch.no_grad():
            return run()
    return draw


def calibrate(layout: str, seeds: int, power_seeds: int, factors: list[float]) -> dict:
    from pytest_npu_parity import distribution as D
    from pytest_npu_parity import rng

    draw = _sampler(*LAYOUTS[layout])
    references: dict[int, object] = {}

    def reference(seed: int):
        if seed not in references:
            references[seed] = draw(seed)
        return references[seed]

    pvalues, compare_s, sample_s = [], [], []
    for seed in range(seeds):
        ref = reference(seed)
        start = time.process_time()
        target = draw(rng.target_seed(seed))
        sample_s.append(time.process_time() - start)
        start = time.process_time()
        leaf = D.compare_samples(target, ref, 1)
        compare_s.append(time.process_time() - start)
        pvalues.append(leaf.pvalue)
    shape = tuple(reference(0).shape)
    alpha = D.DistributionPolicy().alpha
    power = {}
    for factor in factors:
        leaves = [D.compare_samples(draw(rng.target_seed(seed), factor), reference(seed), 1)
                  for seed in range(power_seeds)]
        power[str(factor)] = {"failed": sum(not leaf.passed for leaf in leaves), "runs": len(leaves),
                              "median_spread_ratio": sorted(leaf.spread_ratio for leaf in leaves)[len(leaves) // 2],
                              "median_pvalue": sorted(leaf.pvalue for leaf in leaves)[len(leaves) // 2]}
    references.clear()
    return {
        "layout": layout, "shape": shape, "alpha": alpha, "permutations": D.DistributionPolicy().permutations,
        "false_failures": sum(p <= alpha for p in pvalues), "runs": seeds,
        "share_p_le_0.05": sum(p <= 0.05 for p in pvalues) / seeds, "share_p_le_0.01": sum(p <= 0.01 for p in pvalues) / seeds,
        "min_pvalue": min(pvalues), "power": power,
        "compare_cpu_s": sum(compare_s) / seeds, "sample_cpu_s": sum(sample_s) / seeds,
    }


def _table(results: list[dict]) -> str:
    factors = list(results[0]["power"]) if results else []
    head = ("| layout (groups × samples × steps) | false failures (alpha 1e-3) | p ≤ 0.05 | p ≤ 0.01 | "
            + " | ".join(f"noise × {f} fails" for f in factors) + " | CPU s / comparison | CPU s / sampling |")
    lines = [head, "|" + " --- |" * (6 + len(factors))]
    for r in results:
        cells = [f"{r['layout']} ({'×'.join(map(str, r['shape']))})", f"{r['false_failures']}/{r['runs']}",
                 f"{100 * r['share_p_le_0.05']:.1f} %", f"{100 * r['share_p_le_0.01']:.1f} %"]
        cells += [f"{p['failed']}/{p['runs']}" for p in r["power"].values()]
        cells += [f"{r['compare_cpu_s']:.2f}", f"{r['sample_cpu_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [name for name in layouts if name not in LAYOUTS]
    try:
        factors = [float(f) for f in args.factors.split(",") if f]
    except ValueError:
        factors = []
    if unknown or not factors or args.power_seeds < 1 or (args.seeds is not None and args.seeds < 1):
        print(f"calibrate_distribution: bad arguments (unknown layouts {unknown}, factors {args.factors!r}, "
              f"seeds {args.seeds}, power seeds {args.power_seeds}); layouts: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(max(args.threads, 1))
    started = time.time()
    results = []
    for layout in layouts:
        result = calibrate(layout, args.seeds or DEFAULT_SEEDS[layout], args.power_seeds, factors)
        results.append(result)
        print(json.dumps(result), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.processor()
              or platform.machine(), "wall_s": round(time.time() - started, 1), "results": results}
    (out / "calibration_distribution.json").write_text(json.dumps(record, indent=2) + "\n")
    print(_table(results))
    print(f"wall {record['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

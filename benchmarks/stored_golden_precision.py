"""In which precision does a baseline store its goldens? The golden verdict judged both ways on the calibration.

A baseline entry judged by a golden verdict stores the golden leaves it needs
(``pytest_npu_parity.checks.stored_golden``). They come out of ``GoldenRunner.run`` in float64 (for bf16
work float32 where float64 cannot run). Stored rounded to float32 they would take half the bytes. This
script runs the calibration (``benchmarks/calibration.py``: its legitimate variants and real faults of
the Aurora checks, fp32 and bf16) and judges every case by every golden policy of
``calibration.default_policies()`` twice: with the golden as computed, and with each float64 golden leaf
rounded to float32 and read back as float64 (what a float32 store gives a compare run; the golden's
dtype stays float64, so ``judge_golden`` takes the same code path). A third way rounds only the leaves
whose reference output is coarser than float32 (bf16/fp16 leaves), keeping float64 for float32 leaves.

It reports, per way: cases whose pass/fail differs from the float64 golden's, and the largest relative
change of any judged ratio (``judge_golden``'s rmse / max_rel / mean_rel / small_share ratios of every
leaf). Writes ``<out>/stored_golden_precision.json`` and ``.md``.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/stored_golden_precision.py            # calibration's default subset
    python benchmarks/stored_golden_precision.py --checks decoder_layer_0 --recipes bf16 --scenarios split_k
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import calibration as C  # noqa: E402  (benchmarks/calibration.py)


def rounded(golden: dict, reference: dict, only_coarse: bool) -> dict:
    """``golden`` with each float64 leaf rounded to float32 and back (all, or with ``only_coarse`` only
    those whose reference leaf is coarser than float32)."""
    out = {}
    for path, g in golden.items():
        e = reference.get(path)
        coarse = e is not None and e.is_floating_point() and torch.finfo(e.dtype).bits < 32
        if g is not None and g.dtype == torch.float64 and (coarse or not only_coarse):
            g = g.to(torch.float32).to(torch.float64)
        out[path] = g
    return out


def _ratio_change(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if math.isinf(a) or math.isinf(b) or math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(abs(a), 1e-300)


WAYS = ("float32", "float32 for bf16/fp16 leaves")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", default=",".join(C.DEFAULT_CHECKS))
    parser.add_argument("--recipes", default=",".join(C.DEFAULT_RECIPES))
    parser.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    golden_policies = [p for p in C.default_policies() if p.kind == "golden"]
    scenarios = None
    if args.scenarios:
        by_name = {s.name: s for s in C.SCENARIOS}
        scenarios = [by_name[s] for s in args.scenarios.split(",") if s]
    rows: list[dict] = []
    original = C._judge

    def judged_both_ways(policies, recipe, target, reference, golden, name):
        verdicts, details = original(policies, recipe, target, reference, golden, name)
        if golden is None:
            return verdicts, details
        for way, only_coarse in zip(WAYS, (False, True)):
            v2, d2 = original(golden_policies, recipe, target, reference, rounded(golden, reference, only_coarse), name)
            for policy in golden_policies:
                worst = 0.0
                for leaf, ratios in details[policy.name]["leaves"].items():
                    for metric, r in ratios.items():
                        worst = max(worst, _ratio_change(r, d2[policy.name]["leaves"][leaf][metric]))
                rows.append({"check": name, "recipe": recipe, "way": way, "policy": policy.name,
                             "float64": verdicts[policy.name], "rounded": v2[policy.name],
                             "largest_ratio_change": worst})
        return verdicts, details

    C._judge = judged_both_ways
    try:
        report = C.run_calibration([c for c in args.checks.split(",") if c], [r for r in args.recipes.split(",") if r],
                                   scenarios=scenarios, policies=golden_policies,
                                   progress=lambda line: print(line, flush=True))
    finally:
        C._judge = original
    # rows are appended case by case in the order of report.cases that were judged with a golden
    judged = [c for c in report.cases if c.status == "judged" and any(v in ("pass", "fail") for v in c.verdicts.values())]
    per_case = len(WAYS) * len(golden_policies)
    for i, case in enumerate(judged):
        for row in rows[i * per_case:(i + 1) * per_case]:
            row.update(scenario=case.scenario, kind=case.kind)
    summary = []
    for way in WAYS:
        for policy in golden_policies:
            sel = [r for r in rows if r["way"] == way and r["policy"] == policy.name]
            flips = [r for r in sel if r["float64"] != r["rounded"]]
            finite = [r["largest_ratio_change"] for r in sel if math.isfinite(r["largest_ratio_change"])]
            summary.append({"way": way, "policy": policy.name, "cases": len(sel), "verdict_changes": len(flips),
                            "changed": [f"{r['check']} {r['recipe']} {r.get('scenario')}: {r['float64']} -> "
                                        f"{r['rounded']}" for r in flips],
                            "infinite_ratio_changes": len(sel) - len(finite),
                            "largest_ratio_change": max(finite, default=0.0)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stored_golden_precision.json").write_text(json.dumps(
        {"meta": report.meta, "summary": summary, "rows": rows}, indent=1, default=str) + "\n", encoding="utf-8")
    lines = ["# Stored golden precision", "",
             f"Calibration cases judged with a golden: {len(judged)} (checks {', '.join(report.meta['checks'])}; "
             f"recipes {', '.join(report.meta['recipes'])}; torch {report.meta['torch']}; "
             f"{report.meta['duration_s']:.0f} s). Each judged by the golden as computed (float64) and by the "
             "golden rounded to float32 and read back as float64.", "",
             "| stored as | policy | cases | verdict changes | largest relative ratio change (finite) | "
             "ratio changes to/from inf |", "|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['way']} | {s['policy']} | {s['cases']} | {s['verdict_changes']} | "
                     f"{s['largest_ratio_change']:.3g} | {s['infinite_ratio_changes']} |")
    for s in summary:
        for text in s["changed"]:
            lines.append(f"- {s['way']}, {s['policy']}: {text}")
    (out / "stored_golden_precision.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

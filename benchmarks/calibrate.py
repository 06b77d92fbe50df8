"""Calibrate the parity verdicts: false-failure and false-pass rates of every policy on Aurora.

Runs ``calibration.run_calibration`` (``benchmarks/calibration.py``, beside this file) (legitimate variants and real faults on the
target side of the Aurora checks, fp32 and bf16, judged by the allclose and golden policies) and
writes ``benchmarks/results/calibration.json`` (every case) and ``calibration.md`` (the tables).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/calibrate.py                 # default subset, ≈ 10 min on 2 cores
    python benchmarks/calibrate.py --all                              # every check of the catalogue
    python benchmarks/calibrate.py --checks decoder_layer_0,ffn --recipes bf16
    python benchmarks/calibrate.py --scenarios split_k,weight_x(1+1e-4) --out /tmp/cal

Exit status 0 when the run finished (whatever the rates), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import calibration  # benchmarks/calibration.py (this script's folder is first on sys.path)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checks", default=",".join(calibration.DEFAULT_CHECKS),
                        help="comma-separated check names (default: the representative subset)")
    parser.add_argument("--all", action="store_true", help="every check of the Aurora catalogue")
    parser.add_argument("--recipes", default=",".join(calibration.DEFAULT_RECIPES), help="fp32 and/or bf16")
    parser.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="shared randomness seed")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                        help="directory for calibration.json and calibration.md")
    parser.add_argument("--quiet", action="store_true", help="no line per case")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import calibration  # benchmarks/calibration.py (this script's folder is first on sys.path)
    from pytest_npu_parity.aurora import checks as catalogue

    args = parse_args(argv)
    names = [c.name for c in catalogue.CHECKS] if args.all else [c for c in args.checks.split(",") if c]
    recipes = [r for r in args.recipes.split(",") if r]
    scenarios = None
    if args.scenarios:
        by_name = {s.name: s for s in calibration.SCENARIOS}
        wanted = [s for s in args.scenarios.split(",") if s]
        unknown = [s for s in wanted if s not in by_name]
        if unknown:
            print(f"calibrate: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(by_name)}", file=sys.stderr)
            return 2
        scenarios = [by_name[s] for s in wanted]
    try:
        report = calibration.run_calibration(
            names, recipes, scenarios=scenarios, seed=args.seed,
            progress=None if args.quiet else lambda line: print(line, flush=True))
    except (KeyError, ValueError) as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n", encoding="utf-8")
    (out / "calibration.md").write_text(report.to_markdown(), encoding="utf-8")
    print(f"wrote {out / 'calibration.json'} and {out / 'calibration.md'} "
          f"({report.meta['duration_s']:.0f} s, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

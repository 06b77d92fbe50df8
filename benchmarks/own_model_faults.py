"""What the "Your own model" checks (docs/tutorial/own-model.md) resolve: each check with a fault of several sizes.

Runs the page's three examples (extracted from docs/tutorial/own-model.md, as ``tests/test_own_models.py`` does)
with a ``parity`` object that gives every check its own ``runner.ParityCase`` whose target side
scales every ``torch.nn.functional.linear`` output (GPT-2's ``lm_head``, resnet18's ``fc``, the
tagger's head) by 1 + s, against a live CPU reference, under each recipe's default verdict policy.
Writes ``benchmarks/results/own_model_faults.json`` (every case: verdict, worst leaf's err/tol) and
``own_model_faults.md`` (one table per recipe).

Usage::

    python benchmarks/own_model_faults.py                           # fp32 and bf16, s = 1e-4 … 0.5
    python benchmarks/own_model_faults.py --recipes fp32 --scales 1e-4,1e-2

Exit status 0 when the run finished (whatever the verdicts), 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCALES = (1e-4, 1e-3, 1e-2, 5e-2, 1e-1, 5e-1)


def readme_examples() -> dict[str, str]:
    """``{file name: source}`` of the "Your own model" page's examples."""
    text = "\n" + (ROOT / "docs" / "tutorial" / "own-model.md").read_text(encoding="utf-8")
    section = text.split("\n# Your own model\n", 1)[1].split("\n## ", 1)[0]
    return {block.splitlines()[0][2:]: block for block in re.findall(r"```python\n(.*?)```", section, flags=re.S)}


def linear_fault(scale: float):
    """``(device) -> context manager``: every ``F.linear`` output × (1 + scale) inside it."""
    import torch

    @contextlib.contextmanager
    def fault(device):
        original = torch.nn.functional.linear

        def faulty(input, weight, bias=None):
            return original(input, weight, bias) * (1 + scale)

        torch.nn.functional.linear = faulty
        try:
            yield
        finally:
            torch.nn.functional.linear = original

    return fault


class FaultedParity:
    """Stands in for the ``parity`` fixture: each ``check``/``train_step`` runs in a ParityCase of its
    own with the fault on its target side, and its verdict is kept instead of raised."""

    def __init__(self, session, test: str, recipe: str, scale: float, results: list):
        self.session, self.test, self.recipe, self.scale, self.results = session, test, recipe, scale, results

    def _run(self, method: str, name: str, *args, **kwargs):
        from pytest_npu_parity.compare import ParityError
        from pytest_npu_parity.runner import ParityCase

        case = ParityCase(self.session, f"{self.test}::{name}", self.recipe, patches=linear_fault(self.scale))
        start = time.perf_counter()
        try:
            record = getattr(case, method)(name, *args, **kwargs)
            result, verdict = record.result, "pass"
        except ParityError as exc:
            result, verdict = exc.result, "FAIL"
        ratios = [leaf.err_ratio for leaf in result.leaves if not math.isnan(leaf.err_ratio)]
        self.results.append({"test": self.test, "check": name, "recipe": self.recipe, "scale": self.scale,
                             "verdict": verdict, "worst_err_ratio": max(ratios, default=None),
                             "seconds": round(time.perf_counter() - start, 2)})
        r = self.results[-1]
        print(f"{r['recipe']} s={r['scale']:g} {r['test']} {r['check']}: {r['verdict']} "
              f"(err/tol {r['worst_err_ratio']:.3g}, {r['seconds']} s)", flush=True)

    def check(self, name: str, *args, **kwargs):
        self._run("check", name, *args, **kwargs)

    def train_step(self, name: str, *args, **kwargs):
        self._run("train_step", name, *args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="fp32,bf16")
    parser.add_argument("--scales", default=",".join(f"{s:g}" for s in SCALES))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    try:
        scales = [float(s) for s in args.scales.split(",")]
    except ValueError:
        parser.print_usage(sys.stderr)
        return 2
    import torch

    from pytest_npu_parity.runner import ParitySession

    torch.set_num_threads(min(2, torch.get_num_threads()))
    examples = readme_examples()
    session = ParitySession(torch.device("cpu"), reference="cpu")
    results: list[dict] = []
    for recipe in args.recipes.split(","):
        for scale in scales:
            for name, source in examples.items():
                namespace: dict = {}
                exec(compile(source, name, "exec"), namespace)  # noqa: S102 - the docs page's own example
                for test, fn in [(k, v) for k, v in namespace.items() if k.startswith("test_") and callable(v)]:
                    fn(FaultedParity(session, f"{name}::{test}", recipe, scale, results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "own_model_faults.json").write_text(json.dumps(
        {"torch": torch.__version__, "scales": scales, "cases": results}, indent=1) + "\n")
    lines = [f"Every nn.Linear output × (1 + s) on the target, one check at a time (torch {torch.__version__}); "
             "cells: verdict (worst err/tol).", ""]
    for recipe in args.recipes.split(","):
        rows = [r for r in results if r["recipe"] == recipe]
        checks = list(dict.fromkeys((r["test"], r["check"]) for r in rows))
        lines += [f"### {recipe}", "", "| check | " + " | ".join(f"s = {s:g}" for s in scales) + " |",
                  "| --- |" + " --- |" * len(scales)]
        for test, check in checks:
            cells = []
            for s in scales:
                r = next(r for r in rows if (r["test"], r["check"], r["scale"]) == (test, check, s))
                cells.append(f"{r['verdict']} ({r['worst_err_ratio']:.3g})")
            lines.append(f"| {test.split('::')[0]} `{check}` | " + " | ".join(cells) + " |")
        lines.append("")
    (out / "own_model_faults.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

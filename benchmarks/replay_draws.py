"""What seeded draws do on another CPU kernel path, and what recording them for replay costs.

    python benchmarks/replay_draws.py [--capability default]

1. **Draw differences.** Builds, under ``torch.manual_seed(0)``, the tensors a user's test draws
   (``nn.Linear``/``nn.LSTM`` weights, ``torch.randn``, ``normal_``, ``trunc_normal_``, ``xavier_normal_``)
   in two subprocesses — this machine's ATen kernel path and ``ATEN_CPU_CAPABILITY=<capability>`` — and
   prints, per tensor, the share of elements that differ, the largest difference relative to the tensor's
   largest magnitude, and ``checks.replay.draw_distance`` (each element against its own magnitude, floored
   at the tensor's median): the quantity ``checks.replay.DRAW_RTOL`` bounds.
2. **Cost.** Records the GPT-2 and tagger examples of docs/tutorial/own-model.md (fp32 and bf16) with
   replay on (ini ``parity_replay_limit`` 16) and off (0) and prints the baseline bytes (files and object
   pool, apparent and allocated) and the record and compare wall times; the compare runs under the other kernel path (with replay off those checks are
   stale there: the row says how many).

The figures are in docs/explanation/performance.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DRAWS = r"""
import json, sys, torch
torch.manual_seed(0)
out = {}
for k, v in torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 10)).state_dict().items():
    out["linear." + k] = v
for k, v in torch.nn.LSTM(16, 32, 2).state_dict().items():
    out["lstm." + k] = v
out["randn(4, 1000)"] = torch.randn(4, 1000)
out["normal_(4, 1000)"] = torch.empty(4, 1000).normal_()
out["trunc_normal_(64, 64)"] = torch.nn.init.trunc_normal_(torch.empty(64, 64))
out["xavier_normal_(64, 64)"] = torch.nn.init.xavier_normal_(torch.empty(64, 64))
from safetensors.torch import save_file
save_file({k: v.contiguous() for k, v in out.items()}, sys.argv[1])
"""


def draw_differences(capability: str) -> list[dict]:
    from safetensors.torch import load_file

    from pytest_npu_parity.checks.replay import draw_distance

    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for label, env in (("here", {}), (capability, {"ATEN_CPU_CAPABILITY": capability})):
            path = Path(tmp) / f"{label}.safetensors"
            subprocess.run([sys.executable, "-c", DRAWS, str(path)], check=True, env={**os.environ, **env})
            files[label] = load_file(path)
        rows = []
        for name, a in files["here"].items():
            b = files[capability][name]
            diff = (a.double() - b.double()).abs()
            rows.append({"tensor": name, "elements": a.numel(), "differ": int((diff > 0).sum()),
                         "max_diff_over_max_abs": float(diff.max() / a.double().abs().max()),
                         "draw_distance": draw_distance(a, b)})
        return rows


def _pytest(args: list[str], cwd: Path, env: dict | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *args],
                          cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    return time.perf_counter() - start, proc.stdout


def replay_cost(capability: str) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_own_models import EXAMPLES

    rows = []
    for limit in ("16", "0"):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "pytest.ini").write_text(f"[pytest]\nparity_dtypes = fp32,bf16\nparity_replay_limit = {limit}\n")
            for name in ("test_gpt2.py", "test_tagger.py"):
                (root / name).write_text(EXAMPLES[name])
            record_s, _ = _pytest(["--update-baselines", "test_gpt2.py", "test_tagger.py"], root)
            stored = sorted((root / "baselines").rglob("*.safetensors"))  # the files and the object pool
            pool = [p for p in stored if ".objects" in p.parts]
            size = sum(p.stat().st_size for p in stored)
            compare_s, out = _pytest(["--npu-parity", "--parity-reference", "baseline", "-rN"], root,
                                     {"ATEN_CPU_CAPABILITY": capability})
            summary = next((line for line in out.splitlines() if " checks: " in line), out.strip().splitlines()[-1])
            rows.append({"parity_replay_limit": limit, "baseline_bytes": size, "baseline_files": len(stored) - len(pool),
                         "pool_objects": len(pool), "pool_bytes": sum(p.stat().st_size for p in pool),
                         "allocated_bytes": sum(p.stat().st_blocks * 512 for p in stored), "record_s": round(record_s, 1),
                         f"compare_s ({capability})": round(compare_s, 1), "result": summary})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capability", default="default", help="ATEN_CPU_CAPABILITY of the other side")
    capability = parser.parse_args().capability
    print(json.dumps({"draws": draw_differences(capability), "cost": replay_cost(capability)}, indent=1))


if __name__ == "__main__":
    main()

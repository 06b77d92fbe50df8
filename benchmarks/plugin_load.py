"""What the plugin costs a project that never runs a parity check: a one-test project's ``pytest``
run with the plugin and with ``-p no:npu_parity``, median wall seconds of N runs each (alternating).

    python benchmarks/plugin_load.py [--runs 5]

Prints one line per variant and the difference; the figure is in docs/explanation/performance.md.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _time(args: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=cwd,
                   check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        (cwd / "test_one.py").write_text("def test_a():\n    assert 1\n")
        with_plugin, without = [], []
        for _ in range(runs):
            with_plugin.append(_time(["test_one.py"], cwd))
            without.append(_time(["-p", "no:npu_parity", "test_one.py"], cwd))
    a, b = statistics.median(with_plugin), statistics.median(without)
    print(f"with the plugin:      {a:.3f} s (median of {runs})")
    print(f"with -p no:npu_parity: {b:.3f} s")
    print(f"plugin load:          {a - b:+.3f} s")


if __name__ == "__main__":
    main()

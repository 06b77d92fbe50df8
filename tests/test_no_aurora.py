"""A project without Aurora never loads it: ``pytest --npu-parity`` on its own tiny model, and the doctor.

The engine reaches the Aurora adapter only through the adapter seam (``pytest_npu_parity.adapters``),
which the pytest plugin never opens; the doctor opens it, and without an installed or named adapter it
runs the engine's sections alone. Each run is a subprocess whose ``sys.modules`` at the end is written
to a file: no module ``aurora`` (aurora-model) or ``pytest_npu_parity.aurora`` may be among them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pytest_npu_parity import adapters
from pytest_npu_parity.doctor import ENGINE_SECTIONS

ROOT = Path(__file__).resolve().parent.parent

OWN_MODEL = """
import torch


def test_tiny_mlp(parity):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2)).eval()
    x = torch.randn(4, 8)
    parity.check("forward", model, x)
    parity.train_step("train_step", model, x, labels=torch.tensor([0, 1, 1, 0]),
                      loss_fn=torch.nn.CrossEntropyLoss())
"""

MODULES_CONFTEST = """
import json
import sys


def pytest_unconfigure(config):
    with open({path!r}, "w", encoding="utf-8") as fh:
        json.dump(sorted(sys.modules), fh)
"""

DOCTOR_PROBE = """
import json
import sys

from pytest_npu_parity import doctor

code = doctor.main(["--device", "cpu", "--json"])
with open(sys.argv[1], "w", encoding="utf-8") as fh:
    json.dump(sorted(sys.modules), fh)
sys.exit(code)
"""


def aurora_modules(names: list[str]) -> list[str]:
    """The names of aurora-model's and the Aurora adapter's modules among ``names``."""
    return [n for n in names
            if n == "aurora" or n.startswith("aurora.") or n.startswith("pytest_npu_parity.aurora")]


def _pythonpath() -> str:
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))


def test_a_parity_run_on_an_own_model_imports_no_aurora(pytester, monkeypatch):
    # The adapter is offered to the seam on purpose (named, besides any installed entry point):
    # the pytest plugin must not open the seam at all.
    monkeypatch.setenv(adapters.ENV_ADAPTERS, "pytest_npu_parity.aurora.adapter:ADAPTER")
    monkeypatch.setenv("PYTHONPATH", _pythonpath())
    modules_file = pytester.path / "modules.json"
    pytester.makeconftest(MODULES_CONFTEST.format(path=str(modules_file)))
    pytester.makepyfile(test_own=OWN_MODEL)
    result = pytester.runpytest_subprocess("--npu-parity", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)  # one test per recipe (fp32, bf16)
    loaded = json.loads(modules_file.read_text(encoding="utf-8"))
    assert "pytest_npu_parity.plugin" in loaded and "pytest_npu_parity.runner" in loaded  # the plugin did run
    assert aurora_modules(loaded) == []


def test_the_doctor_runs_without_an_adapter_and_imports_no_aurora(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != adapters.ENV_ADAPTERS}
    env.update({adapters.ENV_DISABLE_AUTOLOAD: "1", "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1"})
    modules_file = tmp_path / "modules.json"
    proc = subprocess.run([sys.executable, "-c", DOCTOR_PROBE, str(modules_file)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert proc.returncode == report["summary"]["exit_code"] == 0, report["summary"]
    assert [s["name"] for s in report["sections"]] == list(ENGINE_SECTIONS)
    environment = next(s for s in report["sections"] if s["name"] == "environment")
    assert not any("aurora" in line for line in environment["details"] + environment["fixes"])
    assert "aurora_model" not in environment["data"]
    assert aurora_modules(json.loads(modules_file.read_text(encoding="utf-8"))) == []

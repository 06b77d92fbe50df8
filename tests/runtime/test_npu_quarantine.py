"""Tests of npu.prepare_torch / quarantine_torch_npu: a torch_npu without CANN breaks no entry point.

Each scenario runs in a subprocess: against the stub torch_npu (tests/fakes, which behaves like the
real wheel of its generation, 2.5.1 or 2.14.0: autoload entry point, ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
left set after a failure, a torch pin) and, where a real wheel is installed in this environment (CI's
torch 2.5.1 and torch 2.14.0 legs), against it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from locations import TESTS

from pytest_npu_parity import npu

_FAKES_PATH = TESTS / "fakes" / "fake_env.py"
_spec = importlib.util.spec_from_file_location("npu_parity_fake_env_q", _FAKES_PATH)
fake_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_env)

TORCH_BASE = npu.base_version(torch.__version__)


def _real_wheel_installed() -> bool:
    """The real torch_npu wheel (not our stub) is installed in this environment and CANN is absent."""
    try:
        dist = importlib.metadata.distribution("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        return False
    files = [str(f) for f in (dist.files or [])]
    return any(f.endswith("libtorch_npu.so") for f in files) and npu.find_cann() is None


REAL_WHEEL = _real_wheel_installed()


def _stub_env(tmp_path, **extra):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    return fake_env.fake_env(site=site, FAKE_TORCH_NPU_MODE="libhccl", **extra)


def _real_env(**extra):
    return fake_env.fake_env(**extra)


SNIPPET = textwrap.dedent("""
    import importlib.util, json, os, sys
    from pytest_npu_parity import npu
    reason = npu.prepare_torch()
    import torch                                      # would raise 'Failed to load the backend extension'
    from transformers.utils import import_utils
    npu_seen = import_utils.is_torch_npu_available()  # find_spec, then an unguarded import torch_npu
    try:                                              # the usual probe (msprobe's pytorch/common/utils.py)
        import torch_npu
        probe = "imported"
    except ImportError as exc:
        probe = "ImportError"
    import aurora.modeling_aurora                     # reaches transformers' check too
    print(json.dumps({"reason": reason, "npu_seen": npu_seen, "probe": probe,
                      "spec": importlib.util.find_spec("torch_npu") is None,
                      "status": npu.npu_status().reason, "quarantined": npu.quarantined(),
                      "autoload": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD"),
                      "inherited": os.environ.get(npu.QUARANTINE_ENV), "has_npu": hasattr(torch, "npu")}))
""")


def _check_quarantine(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["reason"] and "libhccl.so not found" in out["reason"]
    assert out["npu_seen"] is False and out["has_npu"] is False
    assert out["probe"] == "ImportError" and out["spec"] is True
    assert out["status"] == out["quarantined"] == out["reason"]  # the reason is kept for the header/doctor
    assert out["autoload"] == "0" and out["inherited"] == out["reason"]


def test_bare_import_torch_fails_with_the_stub(tmp_path):
    """The premise: like the real wheel, the stub breaks a bare `import torch` through autoload."""
    proc = fake_env.run_python("import torch", env=_stub_env(tmp_path))
    assert proc.returncode != 0 and "Failed to load the backend extension: torch_npu" in proc.stderr


def test_prepare_torch_quarantines_the_stub(tmp_path):
    pytest.importorskip("aurora")
    _check_quarantine(fake_env.run_python(SNIPPET, env=_stub_env(tmp_path)))


@pytest.mark.skipif(not REAL_WHEEL, reason="the real torch_npu wheel is not installed here (CI's torch 2.5.1 and 2.14.0 legs have it)")
def test_prepare_torch_quarantines_the_real_wheel():
    pytest.importorskip("aurora")
    _check_quarantine(fake_env.run_python(SNIPPET, env=_real_env()))


def test_prepare_torch_is_a_no_op_without_torch_npu():
    if npu._dist_version("torch_npu") is not None:  # (find_spec says None once this process quarantined it)
        pytest.skip("torch_npu is installed in this environment")
    proc = fake_env.run_python(
        "import sys; from pytest_npu_parity import npu; r = npu.prepare_torch(); "
        "print(r, 'torch' in sys.modules)", env=fake_env.fake_env())
    assert proc.returncode == 0 and proc.stdout.split() == ["None", "False"]


def test_a_spawned_process_inherits_the_quarantine(tmp_path):
    """A rank started by the parent sees the reason in its environment and does not probe again."""
    env = _stub_env(tmp_path, NPU_PARITY_TORCH_NPU_UNUSABLE="inherited reason",
                    TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = fake_env.run_python(
        "from pytest_npu_parity import npu; print(npu.prepare_torch()); print(npu.npu_status().reason)", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["inherited reason", "inherited reason"]


def test_user_choice_of_autoload_is_respected(tmp_path):
    env = _stub_env(tmp_path, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    proc = fake_env.run_python(
        "import sys; from pytest_npu_parity import npu; print(npu.prepare_torch(), 'torch_npu' in sys.modules)", env=env)
    assert proc.returncode == 0 and proc.stdout.split() == ["None", "False"]


PARITY_TEST = textwrap.dedent("""
    import torch

    def test_double(parity):
        parity.check("double", lambda x: x * 2, torch.arange(6.0).reshape(2, 3))
""")


def _pytest_in(project: Path, env, *args):
    (project / "conftest.py").write_text("import torch  # a user's conftest that imports torch first\n")
    (project / "test_parity.py").write_text(PARITY_TEST)
    (project / "pytest.ini").write_text("[pytest]\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("which", ["stub", pytest.param("real", marks=pytest.mark.skipif(
    not REAL_WHEEL, reason="the real torch_npu wheel is not installed here"))])
def test_pytest_entry_points(tmp_path, which):
    project = tmp_path / "proj"
    project.mkdir()
    env = _stub_env(tmp_path) if which == "stub" else _real_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep) if p)
    plain = _pytest_in(project, env)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-2000:]
    assert "2 skipped" in plain.stdout and "Traceback" not in plain.stdout + plain.stderr
    auto = _pytest_in(project, env, "--npu-parity", "--parity-reference", "cpu")
    assert auto.returncode == 0, auto.stdout[-3000:] + auto.stderr[-2000:]
    assert "npu-parity: target cpu" in auto.stdout
    assert "torch_npu is installed but the NPU is not used: " in auto.stdout and "libhccl.so not found" in auto.stdout
    asked = _pytest_in(project, env, "--npu-parity", "--parity-device", "npu")
    assert asked.returncode == 4
    error = [line for line in asked.stderr.splitlines() if line.startswith("ERROR: ")]
    assert len(error) == 1 and error[0].startswith("ERROR: --parity-device=npu: ") and "libhccl.so" in error[0]
    assert "Traceback" not in asked.stdout + asked.stderr


@pytest.mark.parametrize("which", ["stub", pytest.param("real", marks=pytest.mark.skipif(
    not REAL_WHEEL, reason="the real torch_npu wheel is not installed here"))])
def test_doctor_names_the_cause_once(tmp_path, which):
    pytest.importorskip("aurora")
    env = _stub_env(tmp_path) if which == "stub" else _real_env()
    proc = fake_env.run_python(args=["-m", "pytest_npu_parity", "doctor", "--json"], env=env)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    sections = {s["name"]: s for s in report["sections"]}
    text = json.dumps(report)
    assert "libhccl.so not found" in json.dumps(sections["environment"])
    # the sections that import transformers/aurora report their own state, not torch_npu's failure
    for name in ("patch_set", "aurora_smoke"):
        assert sections[name]["status"] == "ok", sections[name]
    assert "aurora-model is not installed" not in text and "seed §5.3" not in text

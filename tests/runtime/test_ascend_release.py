"""Tests of the two CANN layouts, the torch_npu wheel generations (ascend_release), the newest version
matrix rows, the stub's generation switch and the guides' troubleshooting items (troubleshoot)."""
from __future__ import annotations

import importlib.util
import json
import textwrap
from pathlib import Path

import pytest
import torch
from locations import TESTS

from pytest_npu_parity import ascend_release, doctor, npu
from pytest_npu_parity.runtime.npu import troubleshoot  # its home: the doctor and npu's diagnosis read its names there
from pytest_npu_parity.runtime.npu import cann as npu_cann

_FAKES_PATH = TESTS / "fakes" / "fake_env.py"
_spec = importlib.util.spec_from_file_location("npu_parity_fake_env_release", _FAKES_PATH)
fake_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_env)

TORCH_BASE = npu.base_version(torch.__version__)
CANN_SET_ENV = "/usr/local/Ascend/cann/set_env.sh"
TOOLKIT_SET_ENV = "/usr/local/Ascend/ascend-toolkit/set_env.sh"


@pytest.fixture
def no_toolkit(monkeypatch, tmp_path):
    for var in npu.TOOLKIT_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(npu_cann, "DEFAULT_TOOLKIT_HOMES", (str(tmp_path / "no-such-toolkit"),))


# --- layouts -----------------------------------------------------------------------------------

def test_toolkit_found_under_both_layouts(no_toolkit, monkeypatch):
    old = npu.find_cann(fake_env.TOOLKIT_HOME)
    new = npu.find_cann(fake_env.CANN_HOME)
    assert (old.version, Path(old.source).name) == ("8.2.RC1", "version.cfg")
    assert new.version == "9.1.0"
    assert new.source == str(fake_env.CANN_HOME / "x86_64-linux" / "ascend_toolkit_install.info")
    monkeypatch.setattr(npu_cann, "DEFAULT_TOOLKIT_HOMES", ("/no/such/ascend-toolkit/latest", str(fake_env.CANN_HOME)))
    assert npu.cann_version() == "9.1.0"  # the default-path search reaches the cann layout
    monkeypatch.setattr(npu_cann, "DEFAULT_TOOLKIT_HOMES", ())
    monkeypatch.setenv("ASCEND_HOME_PATH", str(fake_env.CANN_HOME))  # what cann/set_env.sh exports
    assert npu.cann_version() == "9.1.0"


def test_other_install_info_names_are_read(no_toolkit, tmp_path):
    """torch_npu's own get_cann_version reads any ascend_*_install.info under ASCEND_HOME_PATH."""
    home = tmp_path / "Ascend" / "cann-9.1.0"
    (home / "aarch64-linux").mkdir(parents=True)
    (home / "aarch64-linux" / "ascend_cann_install.info").write_text("version=9.1.0\n")
    assert npu.cann_version(home) == "9.1.0"


def test_set_env_path_follows_the_installed_layout_then_the_wheel(tmp_path):
    assert ascend_release.set_env_path(fake_env.CANN_HOME, "2.5.1") == str(fake_env.CANN_HOME / "set_env.sh")
    assert ascend_release.set_env_path(fake_env.TOOLKIT_HOME, "2.14.0") == TOOLKIT_SET_ENV  # no file there
    assert ascend_release.set_env_path(tmp_path / "Ascend" / "cann", "2.5.1") == CANN_SET_ENV
    assert ascend_release.set_env_path(None, "2.14.0") == CANN_SET_ENV
    assert ascend_release.set_env_path(None, "2.13.0") == TOOLKIT_SET_ENV
    assert ascend_release.set_env_path(None, "2.5.1.post1") == TOOLKIT_SET_ENV
    assert ascend_release.set_env_path(None, None) == CANN_SET_ENV  # the newest documented layout


def test_every_message_names_the_installed_layouts_set_env(no_toolkit, monkeypatch):
    error = ImportError("libhccl.so: cannot open shared object file: No such file or directory")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(fake_env.CANN_HOME))
    assert npu.explain_import_error(error).endswith(
        f"— source CANN's set_env.sh (e.g. `source {fake_env.CANN_HOME / 'set_env.sh'}`)")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(fake_env.TOOLKIT_HOME))
    assert npu.explain_import_error(error).endswith(f"(e.g. `source {TOOLKIT_SET_ENV}`)")
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME")
    monkeypatch.setattr(npu_cann, "_dist_version", lambda name: "2.14.0" if name == "torch_npu" else None)
    assert npu.explain_import_error(error).endswith(f"(e.g. `source {CANN_SET_ENV}`)")
    sentence = npu.cann_missing_sentence("2.14.0")
    assert "install the CANN toolkit 9.1.0 matching torch_npu" in sentence and CANN_SET_ENV in sentence
    assert TOOLKIT_SET_ENV in npu.cann_missing_sentence("2.5.1")


# --- version matrix ----------------------------------------------------------------------------

def test_newest_rows_are_cited_from_the_wheels():
    (row,) = npu.documented_rows(torch_npu="2.14.0")
    assert (row.cann, row.torch) == ("9.1.0", "2.14.0") and "torch_npu 2.14.0 wheel METADATA" in row.source
    assert {r.cann for r in npu.documented_rows(torch_npu="2.12.0rc1")} == {"8.5.0"}
    assert npu.documented_rows(torch_npu="2.13.0") == []  # its wheel names no CANN release for it
    assert npu.check_version_matrix("2.14.0+cu130", "2.14.0", "9.1.0") == []


def test_torch_2_14_1_with_torch_npu_2_14_0_is_a_mismatch():
    (problem,) = npu.check_version_matrix("2.14.1", "2.14.0", None)
    assert problem.startswith("torch_npu 2.14.0 is built for torch 2.14.0, but torch 2.14.1 is installed")


@pytest.mark.skipif(TORCH_BASE == "2.14.0", reason="needs a torch other than 2.14.0 installed")
def test_doctor_flags_torch_npu_2_14_0_beside_another_torch(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version="2.14.0")
    skip = [arg for name in ("required_ops", "optional_ops", "patch_set", "aurora_smoke", "distributed",
                             "deepspeed") for arg in ("--skip", name)]
    proc = fake_env.run_python(args=["-m", "pytest_npu_parity", "doctor", "--json", *skip],
                               env=fake_env.fake_env(site=site))
    assert proc.returncode == 1, proc.stderr[-3000:]
    env_section = next(s for s in json.loads(proc.stdout)["sections"] if s["name"] == "environment")
    assert env_section["status"] == "fail"
    assert any(f.startswith(f"torch_npu 2.14.0 is built for torch 2.14.0, but torch {torch.__version__}")
               for f in env_section["fixes"]), env_section


# --- the stub, by wheel generation ---------------------------------------------------------------

_PROBE = textwrap.dedent("""
    import json, os
    try:
        import torch_npu
        out = {"error": None}
    except Exception as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["autoload"] = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
    print(json.dumps(out))
""")


def _stub(tmp_path, generation, mode, **extra):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE, generation=generation)
    env = fake_env.fake_env(site=site, FAKE_TORCH_NPU_MODE=mode, TORCH_DEVICE_BACKEND_AUTOLOAD="0", **extra)
    proc = fake_env.run_python(_PROBE, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), site


@pytest.mark.parametrize("generation", fake_env.GENERATIONS)
def test_stub_without_cann_behaves_like_its_wheel(tmp_path, generation):
    out, site = _stub(tmp_path, generation, "libhccl")
    assert out["error"].startswith("ImportError: libhccl.so: cannot open shared object file")
    assert ("Please check that the cann package is installed" in out["error"]) == (generation == "2.5")
    assert out["autoload"] == "0"  # both leave the switch off after a failed import
    metadata = next(site.glob("torch_npu-*.dist-info")).joinpath("METADATA").read_text()
    points = next(site.glob("torch_npu-*.dist-info")).joinpath("entry_points.txt").read_text()
    pin = f"torch=={TORCH_BASE}.*" if generation == "2.14" else f"torch (=={TORCH_BASE}+cpu)"
    assert f"Requires-Dist: {pin}" in metadata and "torch_npu_run" in points
    assert ("[torch_dynamo_backends]" in points) == (generation == "2.14")
    # whichever generation, the diagnosis is the same one sentence
    assert npu.explain_import_error(ImportError(out["error"][len("ImportError: "):])).startswith(
        "torch_npu is not importable: libhccl.so not found — ")


@pytest.mark.parametrize("generation", fake_env.GENERATIONS)
def test_stub_import_restores_autoload_only_like_2_14(tmp_path, generation):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE, generation=generation)
    env = fake_env.fake_env(site=site)
    proc = fake_env.run_python("import os, torch\nimport torch_npu\nprint(os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD'))",
                               env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "0"  # the caller's own 0 is restored as 0 by both
    direct = fake_env.run_python(
        "import os\nos.environ.pop('TORCH_DEVICE_BACKEND_AUTOLOAD', None)\nimport torch_npu\n"
        "print(os.environ.get('TORCH_DEVICE_BACKEND_AUTOLOAD'))", env=env)
    assert direct.returncode == 0, direct.stderr[-2000:]
    assert direct.stdout.split()[-1] == ("1" if generation == "2.14" else "0")


@pytest.mark.parametrize("generation", fake_env.GENERATIONS)
def test_stub_second_npu_registration(tmp_path, generation):
    out, _ = _stub(tmp_path, generation, "two_accelerators_npu")
    if generation == "2.5":
        assert "Two accelerators cannot be used at the same time in PyTorch: npu and npu" in out["error"]
    else:  # 2.14.0's _check_device_conflict accepts "npu"
        assert out["error"] is None


# --- the guides' troubleshooting items -----------------------------------------------------------

def test_rope_decoder_overwritten_file(tmp_path):
    planted = tmp_path / "util_functions.py"
    planted.write_text("import torch\n\ndef resample(old, new_patch_len):\n    return old\n")
    sentence = troubleshoot.rope_decoder_overwritten(planted)
    assert sentence.startswith(f"{planted} has no RoPE_decoder, so `import aurora` fails with "
                               "\"ImportError: cannot import name 'RoPE_decoder' from 'aurora.util_functions'\"")
    assert "overwritten by the patch module" in sentence and "restore upstream" in sentence
    assert "patch at run time" in sentence
    planted.write_text("def RoPE_decoder(query, key):\n    return query, key\n")
    assert troubleshoot.rope_decoder_overwritten(planted) is None
    error = ImportError("cannot import name 'RoPE_decoder' from 'aurora.util_functions' (/x/util_functions.py)")
    assert "overwritten by the patch module" in troubleshoot.explain_error(error)


def _versions(mapping):
    return lambda name: mapping.get(name)


def test_numpy_2_beside_torch_npu_gives_the_checklist_pin(monkeypatch):
    monkeypatch.setattr(troubleshoot, "_dist_version", _versions({"numpy": "2.2.6"}))
    assert troubleshoot.numpy_for_old_cann() is None  # no torch_npu
    monkeypatch.setattr(troubleshoot, "_dist_version", _versions({"numpy": "1.26.4", "torch_npu": "2.5.1"}))
    assert troubleshoot.numpy_for_old_cann() is None  # the pinned release
    monkeypatch.setattr(troubleshoot, "_dist_version", _versions({"numpy": "2.2.6", "torch_npu": "2.5.1"}))
    sentence = troubleshoot.numpy_for_old_cann()
    assert sentence.startswith("numpy 2.2.6 is installed beside torch_npu")
    assert sentence.endswith("pip install numpy==1.26.4")


def test_hccl_timeout_is_not_a_documented_variable():
    assert troubleshoot.hccl_timeout_set({}) is None
    assert troubleshoot.hccl_timeout_set({"HCCL_TIMEOUT": "1800", "HCCL_EXEC_TIMEOUT": "1800"}) is None
    sentence = troubleshoot.hccl_timeout_set({"HCCL_TIMEOUT": "1800"})
    assert sentence.startswith("HCCL_TIMEOUT=1800 is set (the adaptation guide's launcher exports it)")
    assert "HCCL_CONNECT_TIMEOUT" in sentence and "HCCL_EXEC_TIMEOUT" in sentence


def test_missing_torch_npu_runtime_deps(monkeypatch):
    present = {name: "1.0" for name in troubleshoot.TORCH_NPU_RUNTIME_DEPS}
    monkeypatch.setattr(troubleshoot, "_dist_version", _versions(present))
    assert troubleshoot.missing_torch_npu_deps() is None  # no torch_npu: not an Ascend install
    monkeypatch.setattr(troubleshoot, "_dist_version", _versions(
        {**present, "torch_npu": "2.14.0", "tornado": None, "ml-dtypes": None}))
    assert troubleshoot.missing_torch_npu_deps() == (
        "torch_npu's runtime dependencies ml-dtypes, tornado are not installed (its wheel does not declare "
        "them; migration checklist §0.3) — pip install ml-dtypes tornado")


def test_torchvision_not_matching_torch(monkeypatch):
    monkeypatch.setattr(troubleshoot, "_dist_version", _versions({"torch": "2.14.1", "torchvision": "0.20.1"}))
    monkeypatch.setattr(troubleshoot, "_requires", lambda name: ["numpy", "torch (==2.5.1)", "pillow"])
    assert troubleshoot.torchvision_mismatch().startswith(
        "torchvision 0.20.1 is built for torch 2.5.1, but torch 2.14.1 is installed — install the "
        "torchvision release built for torch 2.14.1")
    monkeypatch.setattr(troubleshoot, "_requires", lambda name: ["torch ==2.14.1"])
    assert troubleshoot.torchvision_mismatch() is None


def test_mem_get_info_unavailable_names_the_fallback():
    result = doctor.SectionResult("devices")
    doctor._mem_get_info_fallback(result, [{"npu": 0, "free_bytes": 1, "total_bytes": 2},
                                           {"npu": 1, "error": "RuntimeError: mem_get_info not supported"}])
    assert result.status == "warn"
    assert result.fixes == [
        "torch.npu.mem_get_info is unavailable on npu:1 (RuntimeError: mem_get_info not supported) — use "
        "the migration checklist's §3.4 fallback: total = torch.npu.get_device_properties(1).total_memory, "
        "free = total - torch.npu.memory_allocated(1) (or read HBM from `npu-smi info`)"]


def test_doctor_environment_reports_each_item(monkeypatch, tmp_path):
    planted = tmp_path / "util_functions.py"
    planted.write_text("def resample(old, new_patch_len):\n    return old\n")
    monkeypatch.setattr(troubleshoot, "_aurora_util_functions", lambda: [planted])
    monkeypatch.setattr(troubleshoot, "missing_torch_npu_deps", lambda: "DEPS SENTENCE")
    monkeypatch.setattr(troubleshoot, "torchvision_mismatch", lambda: "TORCHVISION SENTENCE")
    # numpy 2 beside a torch_npu wheel (as in CI's torch-npu 2.14.0 leg) is a detail line, not a fix
    monkeypatch.setattr(troubleshoot, "numpy_for_old_cann", lambda: "NUMPY SENTENCE")
    monkeypatch.setattr(troubleshoot, "hccl_timeout_set", lambda: None)
    result = doctor.SectionResult("environment")
    doctor._guide_troubleshooting(doctor._Context(requested="cpu"), result)
    assert result.status == "fail"
    assert set(result.data["troubleshooting"]) == {"rope_decoder", "torch_npu_deps", "torchvision", "numpy"}
    assert result.fixes[1:] == ["DEPS SENTENCE", "TORCHVISION SENTENCE"]
    assert "NUMPY SENTENCE" in result.details
    assert "RoPE_decoder" in result.fixes[0]


class _FakeTorch:
    def __init__(self, cuda_available):
        self.cuda = type("cuda", (), {"is_available": staticmethod(lambda: cuda_available)})


@pytest.mark.parametrize("cuda_visible", [False, True])
def test_cuda_build_beside_torch_npu_is_a_problem_only_with_a_cuda_device(cuda_visible):
    result = doctor.SectionResult("environment")
    ctx = doctor._Context(requested="cpu", torch=_FakeTorch(cuda_visible))
    doctor._cuda_build_beside_torch_npu(ctx, result, "2.14.0+cu130", "2.14.0")
    if cuda_visible:
        assert result.status == "warn" and "Two accelerators cannot be used at the same time" in result.fixes[0]
    else:
        assert result.status == "ok" and result.fixes == []
        assert "no CUDA device is visible, so torch_npu's accelerator check passes" in result.details[0]

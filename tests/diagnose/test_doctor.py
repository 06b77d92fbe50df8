"""Tests of ``python -m pytest_npu_parity doctor`` (pytest_npu_parity.doctor).

On this CPU-only machine the doctor runs for real (target cpu, "no NPU" reported plainly); the
NPU branches run against fakes from tests/fakes (stub torch_npu in a subprocess, fake CANN
toolkit, fake npu-smi).
"""
from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess

import pytest
import torch
from locations import TESTS

from pytest_npu_parity import doctor, npu
from pytest_npu_parity.diagnose.doctor import cli as doctor_run
from pytest_npu_parity.diagnose.doctor import distributed as doctor_distributed
from pytest_npu_parity.runtime import npu as npu_home

try:
    import jsonschema
except ImportError:  # dev extra not installed: validate with the subset the schema uses
    jsonschema = None

_FAKES_PATH = TESTS / "fakes" / "fake_env.py"
_spec = importlib.util.spec_from_file_location("npu_parity_fake_env", _FAKES_PATH)
fake_env = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_env)

TORCH_BASE = npu.base_version(torch.__version__)
NO_ACCELERATOR = npu._dist_version("torch_npu") is None and not torch.cuda.is_available()
HEAVY = ("patch_set", "aurora_smoke")
DEEPSPEED_INSTALLED = importlib.util.find_spec("deepspeed") is not None
ONLY = {name: tuple(s for s in doctor.SECTIONS if s != name) for name in doctor.SECTIONS}


class SchemaError(AssertionError):
    """A report violates DOCTOR_JSON_SCHEMA (raised by the fallback validator)."""


_JSON_TYPES = {"object": dict, "array": list, "string": str, "number": (int, float),
               "integer": int, "boolean": bool, "null": type(None)}


def _mini_validate(value, schema: dict, root: dict, path: str = "$") -> None:
    """The keywords DOCTOR_JSON_SCHEMA uses: $ref, type, const, enum, required, properties,
    additionalProperties (false), items, minItems, minimum."""
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(isinstance(value, _JSON_TYPES[t]) and not (
                t in ("number", "integer") and isinstance(value, bool)) for t in types):
            raise SchemaError(f"{path}: {value!r} is not of type {types}")
    if "const" in schema and value != schema["const"]:
        raise SchemaError(f"{path}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise SchemaError(f"{path}: {value!r} not in {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        raise SchemaError(f"{path}: {value!r} < {schema['minimum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise SchemaError(f"{path}: missing {key!r}")
        properties = schema.get("properties", {})
        for key, item in value.items():
            if key in properties:
                _mini_validate(item, properties[key], root, f"{path}.{key}")
            elif schema.get("additionalProperties") is False:
                raise SchemaError(f"{path}: unexpected {key!r}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise SchemaError(f"{path}: fewer than {schema['minItems']} items")
        for i, item in enumerate(value):
            _mini_validate(item, schema.get("items", {}), root, f"{path}[{i}]")


VALIDATION_ERRORS = (SchemaError,) + ((jsonschema.ValidationError,) if jsonschema else ())


def validate(report: dict) -> None:
    if jsonschema is not None:
        jsonschema.validate(report, doctor.DOCTOR_JSON_SCHEMA, cls=jsonschema.Draft202012Validator)
    else:
        _mini_validate(report, doctor.DOCTOR_JSON_SCHEMA, doctor.DOCTOR_JSON_SCHEMA)


def sections(report: dict) -> dict[str, dict]:
    return {s["name"]: s for s in report["sections"]}


def doctor_cli(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    proc = fake_env.run_python(args=["-m", "pytest_npu_parity", "doctor", *args],
                               env=env if env is not None else fake_env.fake_env())
    return proc.returncode, proc.stdout, proc.stderr


def test_schema_is_valid_draft_2020_12():
    assert doctor.DOCTOR_JSON_SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    if jsonschema is None:
        pytest.skip("jsonschema not installed (dev extra): meta-schema check needs it")
    jsonschema.Draft202012Validator.check_schema(doctor.DOCTOR_JSON_SCHEMA)


# --------------------------------------------------------------------------------------------
# The real run on this machine
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_run() -> tuple[int, dict]:
    code, out, err = doctor_cli("--json")
    assert out, err[-3000:]
    return code, json.loads(out)


@pytest.mark.skipif(not NO_ACCELERATOR, reason="this machine has an accelerator")
def test_cli_json_on_cpu_machine(cpu_run):
    code, report = cpu_run
    validate(report)
    assert code == report["summary"]["exit_code"] == 0, report["summary"]
    assert report["target"] == "cpu" and report["requested_device"] == "auto"
    by_name = sections(report)
    assert list(by_name) == list(doctor.SECTIONS)
    assert any(d.startswith("no NPU: torch_npu is not installed") for d in by_name["devices"]["details"])
    assert "torch_npu: not installed" in by_name["environment"]["details"]
    assert by_name["required_ops"]["status"] == "ok"
    assert by_name["required_ops"]["details"][0].startswith("target is the CPU (no NPU")
    assert by_name["distributed"]["data"]["backend"] == "gloo"
    assert by_name["distributed"]["data"]["init_ok"] is True
    assert by_name["patch_set"]["data"]["restored"] is True
    assert by_name["aurora_smoke"]["status"] == "ok"
    assert by_name["aurora_smoke"]["data"]["output_device"] == "cpu"
    assert report["summary"]["counts"] == {
        s: sum(x["status"] == s for x in report["sections"]) for s in doctor.STATUSES}


@pytest.mark.parametrize("use_fallback", [False, True])
def test_schema_rejects_broken_reports(cpu_run, use_fallback, monkeypatch):
    if use_fallback:
        monkeypatch.setitem(globals(), "jsonschema", None)
    elif jsonschema is None:
        pytest.skip("jsonschema not installed (dev extra)")
    _, report = cpu_run
    validate(report)
    broken = copy.deepcopy(report)
    broken["sections"][0]["status"] = "great"
    with pytest.raises(VALIDATION_ERRORS):
        validate(broken)
    broken = copy.deepcopy(report)
    del broken["summary"]["exit_code"]
    with pytest.raises(VALIDATION_ERRORS):
        validate(broken)
    broken = copy.deepcopy(report)
    broken["sections"][1]["name"] = "verify_npu"
    with pytest.raises(VALIDATION_ERRORS):
        validate(broken)


def test_cli_text_output():
    code, out, err = doctor_cli("--device", "cpu", "--skip", "patch_set", "--skip", "aurora_smoke")
    assert code == 0, out + err[-2000:]
    assert out.startswith("pytest-npu-parity doctor — target: cpu (requested: cpu)")
    assert "[SKIP] 5. Patch set self-test" in out and "skipped: --skip patch_set" in out
    assert "[ OK ] 3. Required ops" in out
    assert out.rstrip().splitlines()[-1].endswith("— exit 0")


# --------------------------------------------------------------------------------------------
# Usage and exit codes (in-process)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--device", "auto:1"], ["--bogus"],
                                  ["--skip", "nothing"], ["--device", "npu:x"]])
def test_usage_errors_exit_2(argv, capsys):
    assert doctor.main(argv) == doctor.EXIT_USAGE
    assert "error" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert doctor.main(["--help"]) == 0
    assert "exit codes: 0" in capsys.readouterr().out


@pytest.mark.skipif(npu._dist_version("torch_npu") is not None, reason="torch_npu installed")
def test_absent_npu_is_a_failure_with_the_sentence(capsys):
    report = doctor.run_doctor("npu:0", skip=HEAVY)
    validate(report)
    by_name = sections(report)
    assert report["target"] is None
    assert report["target_error"].startswith("--device=npu:0: torch_npu is not installed")
    assert by_name["devices"]["status"] == "fail"
    assert by_name["devices"]["fixes"] == [report["target_error"]]
    for name in ("required_ops", "optional_ops", "distributed"):
        assert by_name[name]["status"] == "skip", name
        assert any("skipped: target 'npu:0' is unavailable" in d for d in by_name[name]["details"])
    assert report["summary"]["failing_sections"] == ["devices"]
    assert report["summary"]["exit_code"] == doctor.EXIT_FAIL
    text = doctor.render_text(report)
    assert "[FAIL] 2. Device status" in text and "fix: --device=npu:0: torch_npu" in text
    assert doctor.main(["--device", "npu", "--skip", "patch_set", "--skip", "aurora_smoke"]) == 1


def test_a_crashing_section_is_reported_not_raised(monkeypatch):
    def boom(ctx, result):
        raise RuntimeError("probe exploded")

    monkeypatch.setitem(doctor._SECTION_FUNCS, "deepspeed", boom)
    report = doctor.run_doctor("cpu", skip=ONLY["deepspeed"])
    validate(report)
    section = sections(report)["deepspeed"]
    assert section["status"] == "fail"
    assert section["details"] == ["section raised RuntimeError: probe exploded"]
    assert report["summary"]["exit_code"] == 1


def test_required_op_failure_fails_the_section(monkeypatch):
    real = npu.probe_ops

    def one_broken(device, ops, **kwargs):
        results = real(device, ops, **kwargs)
        first = next(iter(results))
        results[first] = npu.OpProbe(first, False, False, None, 1e-3, 1e-3, None,
                                     "RuntimeError: op not implemented", 0.0)
        return results

    monkeypatch.setattr(npu_home, "probe_ops", one_broken)  # where the doctor reads it
    report = doctor.run_doctor("cpu", skip=ONLY["required_ops"])
    section = sections(report)["required_ops"]
    assert section["status"] == "fail"
    assert "linear: FAILED — RuntimeError: op not implemented" in section["details"]
    assert section["fixes"][0].startswith("linear fail on cpu: the Aurora forward cannot run")


def test_optional_fft_failure_warns_with_the_fallback_fix(monkeypatch):
    real = npu.probe_ops

    def no_fft(device, ops, **kwargs):
        results = real(device, ops, **kwargs)
        results["rfft"] = npu.OpProbe("rfft", False, False, None, 5e-3, 5e-3, None,
                                      "RuntimeError: rfft not implemented", 0.0)
        return results

    monkeypatch.setattr(npu_home, "probe_ops", no_fft)  # where the doctor reads it
    report = doctor.run_doctor("cpu", skip=ONLY["optional_ops"])
    section = sections(report)["optional_ops"]
    assert section["status"] == "warn" and section["data"]["fft_fallback_needed"] is True
    assert "the patch set computes them on the CPU" in section["fixes"][0]
    assert report["summary"]["exit_code"] == 0  # a warning does not fail the doctor


def test_precision_warns_for_tf32_on_a_cuda_target():
    ctx = doctor._Context(requested="cuda", torch=torch, target=torch.device("cuda", 0))
    result = doctor.SectionResult("precision")
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        doctor._section_precision(ctx, result)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert result.status == "warn"
    assert "cuda.matmul.allow_tf32" in result.data["reduced_precision_on_target"]
    assert "torch.backends.cuda.matmul.allow_tf32 = False" in result.fixes[0]


# --------------------------------------------------------------------------------------------
# Fake CANN and fake npu-smi (in-process: the doctor reads them, nothing is imported)
# --------------------------------------------------------------------------------------------

def test_environment_reads_cann_and_checks_the_matrix(monkeypatch, tmp_path):
    (tmp_path / "version.cfg").write_text(
        "# version: 1.0\ntoolkit_running_version=[6.3.0.1.241:7.0.0]\n", encoding="utf-8")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    report = doctor.run_doctor("cpu", skip=ONLY["environment"])
    section = sections(report)["environment"]
    assert f"CANN 7.0.0 (read from {tmp_path / 'version.cfg'})" in section["details"]
    assert section["status"] == "fail"  # no torch_npu release for this torch on CANN 7.0.0
    assert section["data"]["cann"] == "7.0.0"
    # without torch_npu the matrix is read by torch; with it (CI's torch 2.5.1 leg) by torch_npu
    expected = ("CANN 7.0.0 and torch_npu" if npu._dist_version("torch_npu") else "CANN 7.0.0 has no torch_npu release for torch")
    assert any(f.startswith(expected) for f in section["fixes"]), section["fixes"]


def test_environment_notes_where_the_guide_and_ascend_table_disagree(monkeypatch, tmp_path):
    (tmp_path / "version.cfg").write_text(
        "# version: 1.0\ntoolkit_running_version=[7.7.0.1.231:8.2.RC1]\n", encoding="utf-8")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    build = doctor._build_context

    def with_torch_npu_251(device):  # as on an Ascend box with the guide's pin (metadata only)
        ctx = build(device)
        ctx.status = npu.NpuStatus(available=False, reason="no NPU here", torch_npu_version="2.5.1",
                                   cann_version="8.2.RC1", device_count=0, device_name=None)
        return ctx

    monkeypatch.setattr(doctor_run, "_build_context", with_torch_npu_251)  # where run_doctor reads it
    report = doctor.run_doctor("cpu", skip=ONLY["environment"])
    section = sections(report)["environment"]
    notes = [d for d in section["details"] if d.startswith("version matrix note:")]
    assert len(notes) == 1 and "2.5.1.post1" in notes[0], section["details"]
    assert section["data"]["matrix_notes"] == [notes[0].removeprefix("version matrix note: ")]


def test_parse_npu_smi_real_formats():
    text = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 98.9        38                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3382 / 65536         |
+===========================+===============+====================================================+
| 1     910B4-1             | Warning       | 131.1       48                0    / 0             |
| 0                         | 0000:D9:00.0  | 28          0    / 0          57347/ 65536         |
+===========================+===============+====================================================+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
| 0       0                 | 19341         | python                   | 58472                   |
"""
    assert doctor.parse_npu_smi(text) == [
        {"npu": 0, "name": "910B3", "health": "OK", "hbm_used_mb": 3382, "hbm_total_mb": 65536},
        {"npu": 1, "name": "910B4-1", "health": "Warning", "hbm_used_mb": 57347,
         "hbm_total_mb": 65536},
    ]


def test_parse_fake_npu_smi_output():
    env = dict(os.environ, FAKE_NPU_DEVICE_COUNT="3", FAKE_NPU_SMI_HBM_USED="1234")
    out = subprocess.run([str(fake_env.BIN_DIR / "npu-smi"), "info"], capture_output=True,
                         text=True, env=env, check=True).stdout
    devices = doctor.parse_npu_smi(out)
    assert [d["npu"] for d in devices] == [0, 1, 2]
    assert {(d["name"], d["health"], d["hbm_used_mb"], d["hbm_total_mb"]) for d in devices} == {
        ("910B3", "OK", 1234, 65536)}


@pytest.mark.skipif(npu._dist_version("torch_npu") is not None, reason="torch_npu installed")
@pytest.mark.parametrize("health, expected_fix", [
    ("OK", "npu-smi sees 1 NPU(s) but torch cannot use them: torch_npu is not installed"),
    ("Warning", "npu-smi reports NPU 0 health Warning"),
])
def test_devices_with_fake_npu_smi(monkeypatch, health, expected_fix):
    monkeypatch.setenv("PATH", os.pathsep.join([str(fake_env.BIN_DIR), os.environ["PATH"]]))
    monkeypatch.setenv("FAKE_NPU_SMI_HEALTH", health)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0")
    section = sections(doctor.run_doctor("cpu", skip=ONLY["devices"]))["devices"]
    assert section["status"] == "warn"
    assert section["data"]["npu_smi"][0]["health"] == health
    assert f"npu-smi: NPU 0 910B3, health {health}, HBM 3400 / 65536 MB used" in section["details"]
    assert "ASCEND_RT_VISIBLE_DEVICES=0" in section["details"]
    assert any(f.startswith(expected_fix) for f in section["fixes"])


# --------------------------------------------------------------------------------------------
# Stub torch_npu (subprocess)
# --------------------------------------------------------------------------------------------

def test_stub_npu_target_exercises_the_npu_branches(tmp_path):
    """torch_npu imports and reports one NPU, but nothing can be allocated on it."""
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    (tmp_path / "toolkit").mkdir()
    (tmp_path / "toolkit" / "version.cfg").write_text(
        "# version: 1.0\ntoolkit_running_version=[9.9.0.1.1:9.9.RC1]\n", encoding="utf-8")
    env = fake_env.fake_env(site=site, toolkit=tmp_path / "toolkit", npu_smi=True,
                            ASCEND_RT_VISIBLE_DEVICES="0")
    code, out, err = doctor_cli("--device", "npu", "--json", "--skip", "aurora_smoke", env=env)
    assert out, err[-3000:]
    report = json.loads(out)
    validate(report)
    by_name = sections(report)
    assert report["target"] == "npu:0"
    assert f"torch_npu {TORCH_BASE}: imported" in by_name["environment"]["details"]
    assert by_name["environment"]["status"] == "warn"  # CANN 9.9.RC1 is not a documented row
    assert "not a documented row" in " ".join(by_name["environment"]["details"])
    devices = by_name["devices"]
    assert devices["status"] == "ok", devices
    assert "NPU: 1 × Ascend910B3 (torch_npu " + TORCH_BASE + ")" in devices["details"]
    assert "npu:0 memory: 60.0 GiB free of 64.0 GiB" in devices["details"]
    assert devices["data"]["npu_smi"][0]["name"] == "910B3"
    assert by_name["required_ops"]["status"] == "fail"  # the stub cannot allocate on "npu"
    assert by_name["optional_ops"]["data"]["fft_fallback_needed"] is True
    assert by_name["patch_set"]["status"] in ("fail", "skip")
    distributed = by_name["distributed"]
    assert distributed["status"] == "fail" and distributed["data"]["backend"] == "hccl"
    assert distributed["fixes"][0].startswith("HCCL backend not registered")
    precision = by_name["precision"]
    assert precision["status"] == "warn"
    assert precision["data"]["reduced_precision_on_target"] == ["npu.conv.allow_hf32"]
    assert "torch.npu.conv.allow_hf32 = False" in precision["fixes"][0]
    deepspeed = by_name["deepspeed"]
    if DEEPSPEED_INSTALLED:  # stock DeepSpeed picks its NPU accelerator once torch_npu imports: HCCL
        assert deepspeed["status"] == "ok", deepspeed
        assert (deepspeed["data"]["accelerator"], deepspeed["data"]["backend"]) == ("npu", "hccl")
        assert "DeepSpeed will use HCCL" in deepspeed["details"][-1]
    else:
        assert deepspeed["status"] == "skip"
        assert "pip install deepspeed" in deepspeed["fixes"][0]
    assert code == report["summary"]["exit_code"] == 1
    assert set(report["summary"]["failing_sections"]) >= {"required_ops", "distributed"}


def test_stub_autoload_failure_with_npu_target(tmp_path):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, FAKE_TORCH_NPU_MODE="libhccl")
    code, out, err = doctor_cli("--device", "npu", "--json", "--skip", "patch_set",
                                "--skip", "aurora_smoke", env=env)
    report = json.loads(out)
    validate(report)
    devices = sections(report)["devices"]
    assert code == 1 and devices["status"] == "fail"
    assert devices["fixes"][0] == (
        "--device=npu: Failed to load the backend extension: torch_npu (libhccl.so not found) — "
        "source CANN's set_env.sh (e.g. `source /usr/local/Ascend/ascend-toolkit/set_env.sh`), or "
        "set TORCH_DEVICE_BACKEND_AUTOLOAD=0 to use torch without the NPU")
    environment = sections(report)["environment"]
    assert "CANN 8.2.RC1 (read from " + str(fake_env.TOOLKIT_HOME / "version.cfg") + ")" \
        in environment["details"]


# --------------------------------------------------------------------------------------------
# DeepSpeed: which accelerator it picks, whether it will use HCCL
# --------------------------------------------------------------------------------------------

class _FakeTarget:
    type = "npu"
    index = 0

    def __str__(self):
        return "npu:0"


def _deepspeed_section(monkeypatch, info, *, target=_FakeTarget(), installed=True, env=None):
    """The deepspeed section with DeepSpeed's answer ``info`` (``doctor.deepspeed_accelerator``) faked."""
    import importlib.machinery

    spec = importlib.machinery.ModuleSpec("deepspeed", None, is_package=True)
    spec.submodule_search_locations = []
    monkeypatch.setattr(doctor_distributed, "_find_spec",  # where the section reads it
                        lambda name: spec if installed and name == "deepspeed" else None)
    monkeypatch.setattr(doctor_distributed, "deepspeed_accelerator", lambda: info)  # where the section reads it
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    ctx = doctor._Context(requested="npu", target=target)
    result = doctor.SectionResult("deepspeed")
    doctor._section_deepspeed(ctx, result)
    return result


def test_deepspeed_on_npu_with_the_npu_accelerator_uses_hccl(monkeypatch):
    r = _deepspeed_section(monkeypatch, {"accelerator": "npu", "backend": "hccl", "chosen_by": "auto-detect",
                                         "error": None})
    assert r.status == "ok" and r.fixes == [] and r.data["uses_hccl"] is True
    assert "accelerator: npu (auto-detected: torch_npu imports) → communication backend hccl: DeepSpeed will " \
           "use HCCL" in r.details


@pytest.mark.parametrize("env, cause", [({}, "torch_npu does not import in this process"),
                                        ({"DS_ACCELERATOR": "cpu"}, "DS_ACCELERATOR=cpu overrides the NPU")])
def test_deepspeed_on_npu_without_the_npu_accelerator_fails(monkeypatch, env, cause):
    info = {"accelerator": "cpu", "backend": "gloo", "error": None,
            "chosen_by": "DS_ACCELERATOR" if env else "auto-detect"}
    r = _deepspeed_section(monkeypatch, info, env=env)
    assert r.status == "fail" and r.data["uses_hccl"] is False
    (fix,) = r.fixes
    assert fix.startswith("DeepSpeed picked the cpu accelerator and will initialize gloo, not HCCL, on an NPU target: ")
    assert cause in fix


def test_deepspeed_on_the_cpu_is_reported_not_failed(monkeypatch):
    r = _deepspeed_section(monkeypatch, {"accelerator": "cpu", "backend": "gloo", "chosen_by": "auto-detect",
                                         "error": None}, target=torch.device("cpu"))
    assert r.status == "ok" and "DeepSpeed will not use HCCL" in r.details[-1]


def test_deepspeed_that_cannot_choose_its_accelerator_fails_on_npu(monkeypatch):
    info = {"accelerator": None, "backend": None, "chosen_by": "DS_ACCELERATOR",
            "error": "ValueError: NPU_Accelerator requires torch_npu, which is not installed on this system."}
    r = _deepspeed_section(monkeypatch, info, env={"DS_ACCELERATOR": "npu"})
    assert r.status == "fail"
    assert "DS_ACCELERATOR=npu needs an importable torch_npu" in r.fixes[0]


def test_deepspeed_not_installed_on_npu_says_how_to_install(monkeypatch):
    r = _deepspeed_section(monkeypatch, None, installed=False)
    assert r.status == "skip" and "pip install deepspeed" in r.fixes[0]


@pytest.mark.skipif(not DEEPSPEED_INSTALLED, reason="DeepSpeed is not installed (deepspeed extra)")
@pytest.mark.parametrize("env, expected", [
    ({}, ("npu", "hccl", "ok")),  # real DeepSpeed 0.19.8: torch_npu imports -> NPU_Accelerator -> hccl
    ({"DS_ACCELERATOR": "cpu"}, ("cpu", "gloo", "fail")),
])
def test_real_deepspeed_with_stub_torch_npu(tmp_path, env, expected):
    site = fake_env.build_site(tmp_path / "site", version=TORCH_BASE)
    run_env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, **env)
    skip = [arg for name in doctor.SECTIONS if name not in ("deepspeed",) for arg in ("--skip", name)]
    code, out, err = doctor_cli("--device", "npu", "--json", *skip, env=run_env)
    assert out, err[-3000:]
    section = sections(json.loads(out))["deepspeed"]
    assert (section["data"]["accelerator"], section["data"]["backend"], section["status"]) == expected, section


@pytest.mark.skipif(not DEEPSPEED_INSTALLED, reason="DeepSpeed is not installed (deepspeed extra)")
def test_real_deepspeed_on_this_machine_picks_the_cpu():
    code, out, err = doctor_cli("--device", "cpu", "--json",
                                *[a for n in doctor.SECTIONS if n != "deepspeed" for a in ("--skip", n)])
    section = sections(json.loads(out))["deepspeed"]
    # without a usable torch_npu (none, or the real wheel without CANN) DeepSpeed falls back to the CPU
    assert section["data"]["accelerator"] == "cpu" and section["data"]["backend"] in ("gloo", "ccl"), section
    assert section["status"] == "ok" and section["data"]["uses_hccl"] is False

"""Tests of the DeepSpeed config lint (pytest_npu_parity.deepspeed_config) and its doctor option."""
from __future__ import annotations

import json

import pytest

from pytest_npu_parity import doctor
from pytest_npu_parity.deepspeed_config import DeepSpeedConfigError, Finding, lint_config, lint_file, load_config

#: The guide's configs/deepspeed_npu.json change (§7.2) on top of a ZeRO-2 Trainer config.
CLEAN = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "zero_optimization": {"stage": 2, "overlap_comm": True},
         "bf16": {"enabled": True}, "fp16": {"enabled": False}}
#: The "previous version" the guide corrects: fp16, the communication_backend key and an aio section.
BROKEN = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
          "bf16": {"enabled": False}, "fp16": {"enabled": True}, "communication_backend": "hccl",
          "aio": {"block_size": 1048576, "queue_depth": 8}}
ALL_BUT_DEEPSPEED = [arg for name in doctor.SECTIONS if name != "deepspeed" for arg in ("--skip", name)]


def write(tmp_path, config, name="ds.json"):
    path = tmp_path / name
    path.write_text(config if isinstance(config, str) else json.dumps(config), encoding="utf-8")
    return path


def by_key(findings: list[Finding]) -> dict[str, Finding]:
    return {f.key: f for f in findings}


def test_a_clean_config_passes(tmp_path):
    assert lint_file(write(tmp_path, CLEAN)) == []
    assert lint_config({"bf16": {"enabled": True}}) == []  # fp16 absent is fine


def test_the_broken_config_gets_one_sentence_per_rule_naming_file_key_and_fix(tmp_path):
    path = write(tmp_path, BROKEN)
    findings = lint_file(path)
    assert [f.key for f in findings] == ["bf16.enabled", "fp16.enabled", "communication_backend", "aio"]
    assert [f.severity for f in findings] == ["error", "error", "error", "warning"]
    for f in findings:
        assert f.file == str(path) and str(f).startswith(f"{path}: {f.key}")
        assert f.message.count(". ") == 0 and "\n" not in f.message  # one sentence
    keys = by_key(findings)
    assert 'set "bf16": {"enabled": true}' in keys["bf16.enabled"].message
    assert 'set "fp16": {"enabled": false}' in keys["fp16.enabled"].message
    assert "GradScaler" in keys["fp16.enabled"].message
    assert "silently ignored" in keys["communication_backend"].message
    assert "delete it" in keys["communication_backend"].message
    assert "delete the aio section" in keys["aio"].message


@pytest.mark.parametrize("bf16, expected", [
    (None, "bf16.enabled is missing"), ({"enabled": False}, "bf16.enabled is false"),
    ({}, "bf16.enabled is false"),  # DeepSpeedBF16Config.enabled defaults to False
    ({"enabled": "true"}, 'bf16.enabled is "true"'),  # a string is not the JSON true
])
def test_bf16_must_be_enabled(bf16, expected):
    config = {"fp16": {"enabled": False}, **({} if bf16 is None else {"bf16": bf16})}
    (finding,) = lint_config(config, "c.json")
    assert finding.key == "bf16.enabled" and finding.severity == "error"
    assert finding.message.startswith(f"c.json: {expected} — ")


def test_legacy_bfloat16_section_is_read_like_deepspeed_does():
    # deepspeed/runtime/precision_config.py get_bfloat16_config: "bf16", else the legacy "bfloat16"
    assert lint_config({"bfloat16": {"enabled": True}}) == []
    (finding,) = lint_config({"bfloat16": {"enabled": False}}, "c.json")
    assert finding.key == "bfloat16.enabled"


def test_auto_precision_values_are_warnings():
    findings = by_key(lint_config({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}, "c.json"))
    assert findings["bf16.enabled"].severity == findings["fp16.enabled"].severity == "warning"
    assert "--bf16" in findings["bf16.enabled"].message
    assert "--fp16" in findings["fp16.enabled"].message


def test_communication_backend_is_found_at_any_depth():
    config = dict(CLEAN, comms_logger={"enabled": False, "communication_backend": "hccl"})
    (finding,) = lint_config(config, "c.json")
    assert finding.key == "comms_logger.communication_backend"


def test_aio_with_nvme_offload_names_the_offload_keys():
    config = dict(CLEAN, aio={"block_size": 1048576},
                  zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}})
    (finding,) = lint_config(config, "c.json")
    assert finding.key == "aio" and finding.severity == "warning"
    assert "zero_optimization.offload_param.device" in finding.message and "libaio" in finding.message


@pytest.mark.parametrize("text, expected", [
    ('{"bf16": {"enabled": true},}', "is not valid JSON (Expecting property name enclosed in double quotes at line 1"),
    ('// comment\n{"bf16": {"enabled": true}}', "is not valid JSON"),
    ('{"bf16": {"enabled": true}, "bf16": {"enabled": false}}', "has the key 'bf16' twice"),
    ('[{"bf16": {"enabled": true}}]', "holds a JSON list, not an object"),
    ('', "is not valid JSON"),
])
def test_unreadable_configs_raise_one_clear_error(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(DeepSpeedConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"DeepSpeed config {path} ") and expected in message
    assert "\n" not in message


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DeepSpeedConfigError, match=r"ds\.json does not exist: give the path"):
        lint_file(tmp_path / "ds.json")
    with pytest.raises(DeepSpeedConfigError, match="is a directory"):
        lint_file(tmp_path)


# --------------------------------------------------------------------------------------------
# python -m pytest_npu_parity doctor --deepspeed-config FILE


def test_doctor_cli_lint_fails_on_errors_and_passes_a_clean_config(tmp_path, capsys):
    bad = write(tmp_path, BROKEN, "bad.json")
    assert doctor.main(["--device", "cpu", "--deepspeed-config", str(bad), "--skip", "deepspeed",
                        *ALL_BUT_DEEPSPEED]) == doctor.EXIT_FAIL
    out = capsys.readouterr().out
    assert f"config {bad}: 3 error(s), 1 warning(s)" in out
    assert f"fix: {bad}: communication_backend is not a DeepSpeed config field" in out
    good = write(tmp_path, CLEAN, "good.json")
    assert doctor.main(["--device", "cpu", "--deepspeed-config", str(good), "--skip", "deepspeed",
                        *ALL_BUT_DEEPSPEED]) == doctor.EXIT_OK
    assert "follows the guide's rules" in capsys.readouterr().out


def test_doctor_cli_json_carries_the_findings(tmp_path, capsys):
    bad = write(tmp_path, {"bf16": {"enabled": True}, "aio": {}})
    code = doctor.main(["--device", "cpu", "--json", "--deepspeed-config", str(bad), "--skip", "deepspeed",
                        *ALL_BUT_DEEPSPEED])
    report = json.loads(capsys.readouterr().out)
    section = next(s for s in report["sections"] if s["name"] == "deepspeed")
    assert code == doctor.EXIT_OK and section["status"] == "warn"  # a warning alone does not fail
    assert [f["key"] for f in section["data"]["config_findings"]] == ["aio"]


@pytest.mark.parametrize("content", [None, "{not json"])
def test_doctor_cli_unreadable_config_is_a_usage_error(tmp_path, capsys, content):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    assert doctor.main(["--device", "cpu", "--deepspeed-config", str(path)]) == doctor.EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""  # stops before any section runs
    assert captured.err.startswith(f"error: DeepSpeed config {path} ") and captured.err.count("\n") == 1

"""``--parity-audit`` through pytester, on small user models (not Aurora): each device-propagation bug
fails its check with the op, devices, dtype and the user's source line, in the terminal and the
report; a clean dropout model reports nothing (the plugin's own random draws are not the model's);
``--parity-audit-mode warn``, ini ``parity_audit`` and the marker's ``audit``/``audit_budget``.

On this CPU-only machine the target is ``cpu``, audited as the logical device ``cuda:1`` (see
``pytest_npu_parity.audit``): what an accelerator would see, on real CPU data.
"""
from __future__ import annotations

import json
import sys

import pandas as pd  # imported before any in-process run, which restores sys.modules after itself
import pytest

# Warning counts below are the audit's: pytest's own "module already imported, cannot be rewritten"
# (the plugin is imported by the outer session) depends on what the outer run imported first.
QUIET = ("-W", "ignore::pytest.PytestAssertRewriteWarning")

# Every model computes the same on both sides (the numbers pass); only its device propagation is wrong.
USER_MODELS = """
import numpy as np
import pytest
import torch
from torch import nn


class HostConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + torch.ones(4)  # BUG host_constant


class RoundTrip(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y.cpu().to(x.device) * 2  # BUG round_trip


class Float64Constant(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * torch.as_tensor(np.hanning(4), device=x.device)  # BUG float64


class Clean(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("window", torch.hann_window(4, periodic=False))

    def forward(self, x):
        return self.lin(x) * self.window + torch.ones(4, device=x.device)


def make(name):
    torch.manual_seed(0)
    return {"host_constant": HostConstant, "round_trip": RoundTrip, "float64": Float64Constant, "clean": Clean}[name]()


@pytest.mark.parametrize("name", ["host_constant", "round_trip", "float64", "clean"])
def test_model(parity, name):
    parity.check("out", make(name), torch.linspace(-1, 1, 12).reshape(3, 4))
"""

DROPOUT_MODELS = """
import torch
from torch import nn


def test_dropout_mlp(parity):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4)).train()
    parity.check("mlp", model, torch.randn(4, 8))


def test_transformer_train_step(parity):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
    parity.train_step("encoder", nn.TransformerEncoder(layer, 2), {"src": torch.randn(2, 5, 16)},
                      loss_fn=lambda out: out.square().mean())
"""


def _line(source: str, tag: str) -> int:
    """The 1-based line number of the line of ``source`` that ends with ``# BUG <tag>``."""
    # pytester writes the source stripped of its leading newline
    (line,) = [i for i, text in enumerate(source.strip().splitlines(), 1) if text.rstrip().endswith(f"# BUG {tag}")]
    return line


def _run_user_models(pytester: pytest.Pytester, *args: str):
    pytester.makepyfile(test_user_models=USER_MODELS)
    return pytester.runpytest(*QUIET, "--npu-parity", "--parity-dtypes", "fp32", "--parity-report=rep", *args)


# (model, event lines each with the op, devices, dtype) - the source line is checked separately
EXPECTED = {
    "host_constant": ["mixed-device op aten::add.Tensor: cuda:1 + cpu float32",
                      "CPU op aten::ones: cpu float32 (ran on the CPU, target cuda:1)"],
    "round_trip": ["device-to-host copy Tensor.cpu: cuda:1 -> cpu float32",
                   "host-to-device copy Tensor.to: cpu -> cuda:1 float32"],
    "float64": ["float64 on the target torch.as_tensor: cuda:1 float64",
                "float64 on the target aten::mul.Tensor: cuda:1 float64"],
}


def test_each_bug_fails_its_check_with_op_devices_dtype_and_the_users_line(pytester: pytest.Pytester) -> None:
    result = _run_user_models(pytester, "--parity-audit")
    result.assert_outcomes(passed=1, failed=3)  # the clean model passes
    out = result.stdout.str()
    for name, events in EXPECTED.items():
        line = _line(USER_MODELS, name)
        for event in events:
            # in the failure message (E lines) and in the terminal summary of the npu-parity section
            hits = [text for text in out.splitlines() if event in text and f"at test_user_models.py:{line}" in text]
            assert len(hits) >= 2, (name, event, out)
        result.stdout.fnmatch_lines([f"*failed: test_user_models.py::test_model?fp32-{name}? check 'out' (fp32): "
                                     "* beyond its audit budget*"])
    result.stdout.fnmatch_lines(["test_user_models.py:*: ParityError"])  # raised at the test's own line
    assert "runner.py" not in out  # the plugin's own frames are hidden from the tracebacks
    result.stdout.fnmatch_lines(["audit: 4 checks audited, events mixed_device 1, h2d 1, d2h 1, host_sync 0, "
                                 "cpu_fallback 1, fp64 2; 3 beyond their audit budget"])
    summary = (pytester.path / "rep" / "summary.md").read_text()
    assert "Events on the target, each check counted once: mixed_device 1, h2d 1, d2h 1" in summary
    for name, events in EXPECTED.items():
        for event in events:
            assert f"`{event} at test_user_models.py:{_line(USER_MODELS, name)}" in summary, (event, summary)
    rows = pd.read_csv(pytester.path / "rep" / "results.csv")
    by_test = {r.test_id.split("-")[-1].rstrip("]"): r for r in rows.itertuples()}
    assert by_test["clean"].verdict == "pass" and pd.isna(by_test["clean"].audit_problem)
    assert by_test["float64"].verdict == "fail" and "aten::mul.Tensor" in by_test["float64"].audit_problem
    assert by_test["float64"].audit_verdict == "fail" and pd.isna(by_test["clean"].audit_verdict)
    assert by_test["round_trip"].audit_budget == "mixed_device 0, h2d 0, d2h 0, host_sync any, cpu_fallback 0, fp64 0"


def test_without_the_audit_the_same_models_pass(pytester: pytest.Pytester) -> None:
    result = _run_user_models(pytester)
    result.assert_outcomes(passed=4)
    assert "audit" not in result.stdout.str().split("= npu-parity =")[-1]


def test_warn_mode_passes_and_warns_at_the_users_line(pytester: pytest.Pytester) -> None:
    result = _run_user_models(pytester, "--parity-audit-mode=warn")
    result.assert_outcomes(passed=4, warnings=3)
    for name, events in EXPECTED.items():
        result.stdout.fnmatch_lines([f"*test_user_models.py:{_line(USER_MODELS, name)}: ParityAuditWarning: "
                                     f"test_user_models.py::test_model[[]fp32-{name}[]] (fp32): Device-propagation "
                                     "audit of check 'out' on the logical device cuda:1*"])
        result.stdout.fnmatch_lines([f"*warned: test_user_models.py::test_model?fp32-{name}?*"])
    assert "--parity-audit-mode=warn" not in result.stdout.str()  # no advice to do what is being done
    summary = (pytester.path / "rep" / "summary.md").read_text()
    assert "3 checks with events beyond their audit budget" in summary and "| ⚠️ warned |" in summary


def test_ini_mode_and_marker_budget_mode(pytester: pytest.Pytester) -> None:
    pytester.makeini("""
        [pytest]
        parity_audit = fail
    """)
    source = USER_MODELS + """

@pytest.mark.parity(audit_budget={"mixed_device": 1, "cpu_fallback": 1, "reason": "the constant is tiny"})
def test_allowed(parity):
    parity.check("out", make("host_constant"), torch.ones(3, 4))


@pytest.mark.parity(audit_budget="mixed_device=1")
def test_partly_allowed(parity):
    parity.check("out", make("host_constant"), torch.ones(3, 4))


@pytest.mark.parity(audit="warn")
def test_warned(parity):
    parity.check("out", make("round_trip"), torch.ones(3, 4))


@pytest.mark.parity(audit="off")
def test_not_audited(parity):
    parity.check("out", make("float64"), torch.ones(3, 4))


def test_check_budget(parity):
    parity.check("out", make("float64"), torch.ones(3, 4), audit_budget={"fp64": "any"})
"""
    pytester.makepyfile(test_user_models=source)
    result = pytester.runpytest(*QUIET, "--npu-parity", "--parity-dtypes", "fp32", "-k", "not test_model", "--parity-report=rep")
    result.assert_outcomes(passed=4, failed=1, warnings=1)
    result.stdout.fnmatch_lines(["*failed: test_user_models.py::test_partly_allowed?fp32? check 'out' (fp32): "
                                 "1 event beyond its audit budget: cpu_fallback 1 (allowed 0).*"])
    result.stdout.fnmatch_lines(["*warned: test_user_models.py::test_warned?fp32?*"])
    result.stdout.fnmatch_lines(["npu-parity: audit fail · default audit budget mixed_device 0, h2d 0, d2h 0, "
                                 "host_sync any, cpu_fallback 0, fp64 0 · a CPU target is audited as the logical "
                                 "device cuda:1"])
    result.stdout.fnmatch_lines(["audit: 4 checks audited*"])  # test_not_audited is not
    rows = pd.read_csv(pytester.path / "rep" / "results.csv").set_index("test_id")
    allowed = rows.loc["test_user_models.py::test_allowed[fp32]"]
    assert allowed.verdict == "pass" and allowed.audit_budget.endswith("# the constant is tiny")
    assert pd.isna(rows.loc["test_user_models.py::test_not_audited[fp32]"].audit_fp64)
    # an audit marker audits its test even when the session does not
    result = pytester.runpytest(*QUIET, "--npu-parity", "--parity-dtypes", "fp32", "-k", "test_warned", "-o", "parity_audit=off")
    result.assert_outcomes(passed=1, warnings=1)
    # --parity-audit takes its mode from the ini when it names one; --parity-audit-mode wins
    pytester.makeini("""
        [pytest]
        parity_audit = warn
    """)
    result = pytester.runpytest(*QUIET, "--npu-parity", "--parity-dtypes", "fp32", "--parity-audit", "-k", "partly")
    result.assert_outcomes(passed=1, warnings=1)
    result = pytester.runpytest(*QUIET, "--npu-parity", "--parity-dtypes", "fp32", "--parity-audit-mode", "fail", "-k", "partly")
    result.assert_outcomes(failed=1)
    result = pytester.runpytest(*QUIET, "--npu-parity", "--parity-dtypes", "fp32", "--parity-audit-mode", "off", "-k", "partly")
    result.assert_outcomes(passed=1)
    assert "audit:" not in result.stdout.str()


def test_clean_dropout_models_report_nothing(pytester: pytest.Pytester) -> None:
    """nn.Dropout and a transformer training step: the plugin draws the masks on the host (shared
    random stream) and clips/steps the optimizer itself; none of that is the model's."""
    pytester.makepyfile(test_dropout=DROPOUT_MODELS)
    result = pytester.runpytest(*QUIET, "--npu-parity", "--parity-dtypes", "fp32", "--parity-audit", "--parity-report=rep")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["audit: 2 checks audited, events mixed_device 0, h2d 0, d2h 0, host_sync 0, "
                                 "cpu_fallback 0, fp64 0; none beyond the audit budgets"])
    assert "Device-propagation audit" not in (pytester.path / "rep" / "summary.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--parity-audit-mode=sometimes"], "*argument --parity-audit-mode: invalid choice: 'sometimes'*"),
    (["-o", "parity_audit=loud"], "*ini parity_audit='loud': use off, fail or warn*"),
])
def test_bad_audit_modes_are_usage_errors(pytester: pytest.Pytester, args, message) -> None:
    pytester.makepyfile(test_bad="def test_x(parity):\n    pass\n")
    result = pytester.runpytest(*QUIET, "--npu-parity", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_bad_marker_budget_is_a_usage_error_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bad="""
        import pytest

        @pytest.mark.parity(audit_budget={"h2": 1}, audit="loud")
        def test_x(parity):
            pass
    """)
    result = pytester.runpytest(*QUIET, "--npu-parity")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_bad.py::test_x*audit='loud' must be 'fail', 'warn' or 'off'*",
                                 "*test_bad.py::test_x*audit_budget=: audit budget {'h2': 1}: unknown kind 'h2' "
                                 "(did you mean 'h2d'?)*"])


def test_report_meta_has_the_audit_columns_and_no_aurora_version(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "aurora", raising=False)  # other tests of this process may have imported it
    result = _run_user_models(pytester, "--parity-audit-mode", "warn", "-k", "clean")
    result.assert_outcomes(passed=1)
    meta = json.loads((pytester.path / "rep" / "meta.json").read_text())
    assert meta["aurora_model"] is None  # this project does not use Aurora
    assert isinstance(meta["threads"], int) and isinstance(meta["interop_threads"], int)
    summary = (pytester.path / "rep" / "summary.md").read_text()
    assert "aurora_model" not in summary and f"{meta['threads']} torch threads" in summary

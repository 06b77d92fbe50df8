"""Record on one machine, compare on another: the own-model examples on another CPU kernel path.

The baselines are recorded here (in-process); the compare runs in a subprocess with
``ATEN_CPU_CAPABILITY=default``, where ``torch.manual_seed(0)`` followed by ``nn.init``/``torch.randn``
draws other last bits, as a host CPU of another kind does. Without replay every check there was stale
("weights changed (… tensors differ …)"); with it each check replays the recorded inputs and weights and
is judged for real: a target fault still fails, and a real edit of the model is still stale.
"""
from __future__ import annotations

import json

import pytest
from pytester_helpers import edit_module
from test_own_models import EXAMPLES, FAULT_CONFTEST
from cpu_features import NO_BF16_LSTM, runs_bf16_lstm

OTHER_PATH = {"ATEN_CPU_CAPABILITY": "default"}
FILES = ["test_gpt2.py", "test_tagger.py"]


def _project(pytester: pytest.Pytester, recipes: str = "fp32") -> None:
    pytester.makeini(f"""
        [pytest]
        parity_dtypes = {recipes}
    """)
    pytester.makeconftest(FAULT_CONFTEST)
    for name in FILES:
        (pytester.path / name).write_text(EXAMPLES[name], encoding="utf-8")
    result = pytester.runpytest("--update-baselines", *FILES)
    assert result.ret == 0, result.stdout.str()


def _elsewhere(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str, **env: str):
    for key, value in {**OTHER_PATH, **env}.items():
        monkeypatch.setenv(key, value)
    return pytester.runpytest_subprocess("--npu-parity", "--parity-reference", "baseline", "-p", "no:randomly",
                                         "--parity-localize-budget=0", "-rN", *args)


@pytest.mark.skipif(not runs_bf16_lstm(), reason=NO_BF16_LSTM)  # the tagger's LSTM under bf16
def test_the_examples_compare_green_on_another_kernel_path_by_replaying_what_they_recorded(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    _project(pytester, "fp32,bf16")
    result = _elsewhere(pytester, monkeypatch)
    out = result.stdout.str()
    result.assert_outcomes(passed=4)
    assert "stale" not in out
    result.stdout.fnmatch_lines(["10 checks: 10 pass"])
    # the draws really differ there: GPT-2 replays its recorded weights (its token ids are integers, drawn
    # the same), the tagger its recorded input (its small LSTM and head are drawn by the scalar path anyway)
    assert out.count("replayed the recorded inputs (largest draw difference") >= 4, out
    assert out.count("replayed the recorded weights (largest draw difference") >= 6, out


def test_a_target_fault_still_fails_there(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    _project(pytester)
    result = _elsewhere(pytester, monkeypatch, OWN_MODEL_FAULT="eval:1e-4")
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "Parity check 'eval' failed" in out and "stale" not in out


def test_a_real_edit_of_the_model_is_still_stale_there(pytester: pytest.Pytester,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _project(pytester)
    edit_module(pytester.path / "test_tagger.py", "torch.randint(0, 5, (2, 6))",
                "torch.randint(0, 5, (2, 6))\n    with torch.no_grad():\n        model.head.weight.mul_(1 + 1e-4)")
    result = _elsewhere(pytester, monkeypatch, "test_tagger.py")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "is stale for check 'eval'" in out
    assert "not replayed: weight head.weight differs by up to 0.0001 of its own size (relative)" in out
    assert "Parity check 'eval' failed" not in out


def test_the_torchvision_example_compares_green_there(pytester: pytest.Pytester,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """resnet18 seeds with stable_init_: its 45 MiB of weights are not recorded (the same everywhere),
    its images are, and replay. (Its training step, 17-24 s per recipe, is left out here.)"""
    pytester.makeini("""
        [pytest]
        parity_dtypes = fp32,bf16
    """)
    source = EXAMPLES["test_resnet.py"]
    step = next(line for line in source.splitlines() if "parity.train_step(" in line)
    (pytester.path / "test_resnet.py").write_text(source.replace(step + "\n", ""), encoding="utf-8")
    result = pytester.runpytest("--update-baselines", "test_resnet.py")
    assert result.ret == 0, result.stdout.str()
    for path in (pytester.path / "baselines").rglob("*.safetensors"):
        assert path.stat().st_size < 200_000, path  # the images and logits, not the weights
    result = _elsewhere(pytester, monkeypatch)
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    assert "stale" not in out and out.count("replayed the recorded inputs") == 2, out


def test_parity_replay_limit_bounds_what_a_recording_carries(pytester: pytest.Pytester) -> None:
    pytester.makeini("""
        [pytest]
        parity_dtypes = fp32
        parity_replay_limit = 0
    """)
    (pytester.path / "test_tagger.py").write_text(EXAMPLES["test_tagger.py"], encoding="utf-8")
    result = pytester.runpytest("--update-baselines", "test_tagger.py")
    assert result.ret == 0, result.stdout.str()
    from safetensors import safe_open

    (path,) = [p for p in (pytester.path / "baselines").rglob("*.safetensors") if ".objects" not in p.parts]
    with safe_open(str(path), framework="pt") as fh:
        records = json.loads(fh.metadata()["checks"])
    extras = [name for record in records.values() for name in record.get("extras", {})]
    assert not [name for name in extras if name.startswith(("input:", "weight:"))], extras  # goldens may be there
    assert "over the 0 MiB replay limit" in json.dumps(records)
    pytester.makeini("""
        [pytest]
        parity_replay_limit = -1
    """)
    result = pytester.runpytest("--npu-parity", "test_tagger.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini parity_replay_limit='-1': give MiB, a finite number >= 0*"])


SPARSE = """
import torch
from torch import nn


class InverseWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(64))

    def forward(self, feats):
        return self.scale / (feats + 1e-3)


def test_sparse_input(parity):
    torch.manual_seed(0)
    feats = (torch.randn(16, 64) - 0.5).relu()  # about 69 % exact zeros
    parity.check("inverse", InverseWeight().eval(), feats)


def test_sparse_weight(parity):
    torch.manual_seed(0)
    layer = nn.Linear(256, 256).eval()
    nn.init.normal_(layer.weight, std=0.02)
    with torch.no_grad():
        layer.weight.sub_(0.01).clamp_(min=0)  # non-negative, about 69 % exact zeros
    parity.check("nonneg", layer, torch.randn(8, 256))
"""


def test_mostly_zero_inputs_and_weights_are_replayed_there(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """An input that is mostly exact zeros (a relu of a draw) failed there (the draws' last bits moved the
    elements the relu left just above zero, judged against a median of 0), and a non-negative sparse weight
    was stale; both are other draws of the same computation, so both are replayed."""
    pytester.makeini("""
        [pytest]
        parity_dtypes = fp32
    """)
    pytester.makepyfile(test_sparse=SPARSE)
    recorded = pytester.runpytest("--update-baselines", "test_sparse.py")
    assert recorded.ret == 0, recorded.stdout.str()
    result = _elsewhere(pytester, monkeypatch, "test_sparse.py")
    out = result.stdout.str()
    result.assert_outcomes(passed=2)
    assert "is stale for check" not in out and "Parity check" not in out, out
    assert "check 'inverse' (fp32): replayed the recorded inputs" in out, out
    assert "and the recorded weights (largest draw difference" in out, out

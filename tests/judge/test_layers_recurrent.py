"""Recurrent layers in the layer check: a 1e-4 fault of any weight of a 2-layer LSTM + bidirectional
GRU model fails, where the LSTM's gates damped the recurrent weight's fault below the fp32 limit
(a false pass), and a baseline recorded here passes on other CPU kernel paths and thread counts."""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from pytest_npu_parity.baselines import SuiteStores
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.layers import RECURRENT_SUFFIX, LayerPolicy, judge_layers
from pytest_npu_parity.runner import ParityCase, ParitySession

from pytester_helpers import edited_weight

CPU = torch.device("cpu")
TEST_ID = "parity_suites/demo/test_rnn.py::t"
MODEL = '''
import torch

class Recurrent(torch.nn.Module):
    """A 2-layer LSTM, a bidirectional GRU and a linear head, initialised as PyTorch does (uniform
    within 1/sqrt(fan)) but drawn from a CPU generator by torch.rand: the same numbers on every
    kernel path and torch release."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.gru = torch.nn.GRU(32, 24, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(48, 4)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in self.named_parameters():
                fan = {"lstm": 32, "gru": 24, "head": 48}[name.split(".")[0]]
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / fan ** 0.5)

    def forward(self, x):
        y, _ = self.lstm(x)
        z, _ = self.gru(y)
        return self.head(z)

X = (torch.rand(4, 20, 16, generator=torch.Generator().manual_seed(1)) - 0.5) * 2
'''
MODEL_DIR = Path(tempfile.mkdtemp(prefix="npu-parity-recurrent-"))
atexit.register(shutil.rmtree, MODEL_DIR, ignore_errors=True)  # made at import (collection): removed at exit
(MODEL_DIR / "recurrent_model.py").write_text(MODEL)
sys.path.insert(0, str(MODEL_DIR))  # one importable module: the same class fingerprint in the child processes
from recurrent_model import Recurrent, X  # noqa: E402

WEIGHTS = [n for n, p in Recurrent().named_parameters() if p.dim() == 2]


@pytest.mark.parametrize("name", WEIGHTS)
def test_a_1e4_fault_of_any_weight_fails(name):
    model = Recurrent().eval()
    with pytest.raises(ParityError):
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32",
                   patches=edited_weight(model, name, 1 + 1e-4)).check("rnn", model, X)


class DefaultInit(Recurrent):
    """The same model with PyTorch's own initialisation after ``torch.manual_seed(0)`` (as a user writes it)."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        torch.manual_seed(0)
        self.lstm = torch.nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.gru = torch.nn.GRU(32, 24, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(48, 4)


def test_the_recurrent_weight_fault_was_a_false_pass_at_the_plain_limit():
    # what the tighter limit is for: at the plain fp32 limit the layer check passed this fault
    # (the LSTM's output moved by ~9.5e-6, the model's output by ~7e-7: allclose 1e-5 passes it too)
    model = DefaultInit().eval()
    x = torch.randn(4, 20, 16, generator=torch.Generator().manual_seed(1))
    case = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32",
                      patches=edited_weight(model, "lstm.weight_hh_l0", 1 + 1e-4))
    with pytest.raises(ParityError, match="Layer check failed"):
        case.check("rnn", model, x)
    assert all(leaf.passed for leaf in case.records[-1].result.leaves)  # the outputs alone pass it
    actual, expected = case.records[-1].layer_records
    assert "layer:lstm" + RECURRENT_SUFFIX in actual
    plain = judge_layers({k: v for k, v in actual.items() if not k.endswith(RECURRENT_SUFFIX)}, expected,
                         LayerPolicy(1e-5))
    assert plain.passed and 1e-6 < plain.errors["lstm"] < 1e-5


def test_a_baseline_passes_on_other_cpu_kernel_paths_and_thread_counts(tmp_path):
    store = SuiteStores(tmp_path)
    recording = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    recording.check("rnn", Recurrent().eval(), X)
    assert recording.finish() == "created"
    child = textwrap.dedent(f"""
        import sys
        import torch
        sys.path.insert(0, {str(MODEL_DIR)!r})
        from recurrent_model import Recurrent, X
        from pytest_npu_parity.baselines import SuiteStores
        from pytest_npu_parity.runner import ParityCase, ParitySession
        torch.set_num_threads(int(sys.argv[1]))
        record = ParityCase(ParitySession(torch.device("cpu"), store=SuiteStores({str(tmp_path)!r})),
                            {TEST_ID!r}, "fp32").check("rnn", Recurrent().eval(), X)
        print(record.status, record.reference, record.extra["layers_judged"])
        """)
    variants = [({}, "1"), ({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}, "2")]
    for env, threads in variants:
        # autoload off: a torch_npu wheel without CANN must not break the child's import torch (tests/runtime/test_npu_quarantine.py)
        env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **env}
        out = subprocess.run([sys.executable, "-c", child, threads], env=env, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["pass", "baseline", "3"], (env, out.stdout)

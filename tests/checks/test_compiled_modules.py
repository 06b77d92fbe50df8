"""A torch.compile'd module: the layer check stays out of the compiled program (no graph break), says
so in the check's note, and the outputs still fail a planted fault."""
from __future__ import annotations

import pytest
import torch

from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.layers import compiled_modules
from pytest_npu_parity.runner import ParityCase, ParitySession

from pytester_helpers import edited_weight

dynamo = pytest.importorskip("torch._dynamo")
CPU = torch.device("cpu")
X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def mlp() -> torch.nn.Sequential:
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 4)
    return m


def run(model, patches=None, step=False):
    dynamo.reset()
    dynamo.utils.counters.clear()
    case = ParityCase(ParitySession(CPU, reference="cpu"), "tests/t.py::t", "fp32", patches=patches)
    if step:
        record = case.train_step("step", model, X, loss_fn=lambda out: out.square().mean())
    else:
        record = case.check("mlp", model, X)
    return record, sum(dynamo.utils.counters["graph_break"].values())


def compiled_in_place() -> torch.nn.Module:
    m = mlp()
    m.compile(backend="eager")
    return m


@pytest.mark.parametrize("make", [lambda: torch.compile(mlp(), backend="eager"), compiled_in_place],
                         ids=["wrapper", "in_place"])
def test_a_compiled_module_runs_without_graph_breaks_and_says_the_layer_check_is_off(make):
    record, breaks = run(make())
    assert record.status == "pass" and breaks == 0
    assert "layer check off" in record.extra["policy_note"] and "torch.compile" in record.extra["policy_note"]
    assert record.extra.get("layers_judged") is None
    eager, _ = run(mlp())  # the same model uncompiled keeps its layer check
    assert eager.extra["layers_judged"] == 2 and "layer check off" not in (eager.extra.get("policy_note") or "")


def test_a_compiled_submodule_is_found_by_its_path():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.compile(torch.nn.Linear(4, 4), backend="eager"))
    assert compiled_modules(model) == ["1"] and compiled_modules(mlp()) == []


def test_a_compiled_module_still_fails_a_planted_fault():
    model = torch.compile(mlp(), backend="eager")
    with pytest.raises(ParityError):
        run(model, patches=edited_weight(model, "_orig_mod.0.weight", 1 + 1e-4))


def test_a_compiled_train_step_passes_without_graph_breaks():
    record, breaks = run(torch.compile(mlp(), backend="eager"), step=True)
    assert record.status == "pass" and breaks == 0 and "layer check off" in record.extra["policy_note"]


COMPILED_TEST = '''
import torch

def test_compiled(parity):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    parity.check("compiled", torch.compile(model), torch.randn(8, 16))
'''


def test_a_compiled_check_recorded_here_passes_on_another_kernel_path(pytester: pytest.Pytester,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path) -> None:
    pytester.makeini("[pytest]\nparity_dtypes = fp32\n")
    pytester.makepyfile(test_compiled=COMPILED_TEST)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-here"))
    result = pytester.runpytest_subprocess("--update-baselines", "test_compiled.py")
    assert result.ret == 0, result.stdout.str()
    # another kernel path, with its own inductor cache (a shared one hands it code built for this one)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-there"))
    result = pytester.runpytest_subprocess("--npu-parity", "--parity-reference", "baseline", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    out = result.stdout.str()
    assert "stale" not in out and "layer check off" in out, out

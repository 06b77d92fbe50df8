"""Op trace: the op inside a diverging module whose own result is wrong, on the CPU as the target.

Faults are planted on the target side only, through the case's patch factory, as in
tests/diagnose/test_localize.py. A *kernel* fault is a dispatch mode entered by the patch set that replaces one
aten op's result (a softmax computed in float16 inside, a layer norm applying another eps than it is
given, a matmul off by 1e-4 relative): the op trace's own mode runs above it, so it sees the wrong
kernel as the target's op, and its golden runs with every mode off. A *code* fault changes what the
module's Python asks for (a softmax in float16 and back, a LayerNorm given another eps).
"""
from __future__ import annotations

import contextlib
import math
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from pytest_npu_parity.diagnose import op_trace
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.localize import Localizer, failure_hook
from pytest_npu_parity.op_trace import op_budget, relative_error, trace_ops
from pytest_npu_parity.recipes import RECIPES
from pytest_npu_parity.rng import same_randomness
from pytest_npu_parity.runner import ParityCase, ParitySession
from switches import attribute_set

aten = torch.ops.aten


class Attention(torch.nn.Module):
    """Single-head attention whose softmax and scores live in its own code (no submodule computes them)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.q = torch.nn.Linear(width, width)
        self.k = torch.nn.Linear(width, width)
        self.v = torch.nn.Linear(width, width)
        self.scale = 1 / math.sqrt(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-1, -2) * self.scale  # SCORES LINE
        weights = self.softmax(scores)
        return weights @ v

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1)


class Net(torch.nn.Module):
    """Linear -> LayerNorm -> Attention -> Linear."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.attn = Attention(width)
        self.out = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(self.norm(self.inp(x))))


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))


def _session(hook=failure_hook) -> ParitySession:
    return ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[hook],
                         recipe_policies={"fp32": "allclose", "bf16": "allclose"})


def _fail(case: ParityCase, *args, **kwargs) -> tuple[str, dict]:
    with pytest.raises(ParityError) as info:
        case.check(*args, **kwargs)
    return str(info.value), case.records[-1].extra


def _first_op(extra: dict) -> dict:
    rows = [r for r in extra["localization_ops"] if r["first_op"]]
    assert len(rows) == 1, extra["localization_ops"]
    assert extra["localization_ops"][0] is rows[0]  # the first culprit op comes first
    return rows[0]


class _Kernel(TorchDispatchMode):
    """A wrong kernel on the target: ``wrong(func, args, kwargs)`` computes the ops in ``ops`` (the
    other ops run as they are); it runs with the modes off, as a kernel would."""

    def __init__(self, ops, wrong):
        super().__init__()
        self.ops, self.wrong = set(ops), wrong

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.ops:
            with _disable_current_modes():
                return self.wrong(func, args, kwargs)
        return func(*args, **kwargs)


def _kernel(ops, wrong):
    """A patch factory planting ``_Kernel(ops, wrong)`` while the target runs."""
    return lambda device: _Kernel(ops, wrong)


def _softmax_in_half(func, args, kwargs):
    x, dim, _half_to_float = args
    return func(x.half(), dim, False).to(x.dtype)


def _other_eps(func, args, kwargs):
    x, shape, weight, bias, _eps = args
    return func(x, shape, weight, bias, 1e-2)


def _off_by_1e4(func, args, kwargs):
    return func(*args, **kwargs) * (1 + 1e-4)


# --------------------------------------------------------------------------------------------
# planted faults are named: op, module path, source line


def test_a_softmax_kernel_computing_in_half_is_named(net, x):
    case = ParityCase(_session(), "t::softmax", patches=_kernel({aten._softmax.default}, _softmax_in_half))
    message, extra = _fail(case, "net", net, x)
    assert "First divergence: attn (Attention), in its own code outside its submodules" in message
    first = _first_op(extra)
    assert first["op"] == "aten._softmax" and first["module"] == "attn" and first["verdict"] == "local"
    assert first["source"].startswith("tests/diagnose/test_op_trace.py:") and "torch.softmax(scores, dim=-1)" in first["source"]
    # float16's rounding (up to 2^-11 relative) is far beyond the float32 budget, and the op's inputs were exact
    assert first["local"] > 10 * first["budget"] and first["budget"] == op_budget(torch.float32)
    assert first["inherited"] < first["budget"]
    assert "first culprit op: aten._softmax (in attn, tests/diagnose/test_op_trace.py:" in message
    assert "LOCAL <- first culprit op" in message
    # The op table follows the module table in the message.
    assert message.index("LOCAL <- first divergence") < message.index("Op trace of attn (Attention)")


def test_a_layer_norm_kernel_with_another_eps_is_named_in_the_leaf(net, x):
    case = ParityCase(_session(), "t::eps", patches=_kernel({aten.native_layer_norm.default}, _other_eps))
    message, extra = _fail(case, "net", net, x)
    assert "First divergence: norm (LayerNorm)" in message
    first = _first_op(extra)
    assert first["op"] == "aten.native_layer_norm" and first["module"] == "norm" and first["verdict"] == "local"
    # nn.LayerNorm is torch's own module traced alone: its source line is torch's forward
    assert "torch/nn/modules/normalization.py:" in first["source"] and "F.layer_norm" in first["source"]


def test_a_matmul_kernel_off_by_1e4_is_named_with_its_line(net, x):
    case = ParityCase(_session(), "t::mm", patches=_kernel({aten.bmm.default}, _off_by_1e4))
    message, extra = _fail(case, "net", net, x)
    first = _first_op(extra)
    assert first["op"] == "aten.bmm" and first["module"] == "attn"
    assert "q @ k.transpose(-1, -2) * self.scale" in first["source"]
    assert first["local"] == pytest.approx(1e-4, rel=0.05)  # the planted error, measured
    rows = extra["localization_ops"]
    # the second bmm (weights @ v) runs the same wrong kernel, on inputs that already inherit the first's error
    second = rows[1]
    assert second["op"] == "aten.bmm" and second["verdict"] == "local" and "weights @ v" in second["source"]
    assert second["inherited"] > op_budget(torch.float32) > first["inherited"]
    assert all(r["verdict"] == "ok" for r in rows[2:])  # the other ops of the call compute correctly


def test_a_softmax_the_code_computes_in_half_is_named_as_a_precision_loss(x):
    def half_softmax(self, scores):
        return torch.softmax(scores.half(), dim=-1).float()  # the port's code change

    torch.manual_seed(0)
    model = Attention().eval()
    case = ParityCase(_session(), "t::half", patches=lambda device: attribute_set(Attention, "softmax", half_softmax))
    message, extra = _fail(case, "attn", model, x)
    assert "starts in <Attention> itself" in message  # the check's own module: its code
    first = _first_op(extra)
    assert first["op"] == "aten._softmax" and first["dtype"] == "float16" and first["verdict"] == "precision"
    assert first["module"] == "<Attention>" and "torch.softmax(scores.half(), dim=-1).float()" in first["source"]
    # within float16's own budget, beyond the fp32 recipe's: computed in a lower precision than the check
    assert op_budget(torch.float32) < first["local"] <= op_budget(torch.float16)
    assert first["inherited"] > op_budget(torch.float32)  # its input was already cast to float16
    assert "lower precision than the check" in message


def test_a_layer_norm_given_another_eps_has_no_culprit_op(net, x):
    """A code fault: every kernel computes what it is asked; the module-level localization names the norm."""
    @contextlib.contextmanager
    def wrong_eps(device):
        net.norm.eps = 1e-2
        try:
            yield
        finally:
            net.norm.eps = 1e-5
    message, extra = _fail(ParityCase(_session(), "t::code-eps", patches=wrong_eps), "net", net, x)
    assert "First divergence: norm (LayerNorm)" in message
    assert not any(r["first_op"] for r in extra["localization_ops"])
    assert [r["op"] for r in extra["localization_ops"]] == ["aten.native_layer_norm"]
    assert "every op compared is within its budget" in message and "an argument such as an eps" in message


def test_a_correct_module_gets_no_culprit_op(net, x):
    for recipe in ("fp32", "bf16"):
        with torch.no_grad():
            trace = trace_ops(net, (x,), device="cpu", recipe=RECIPES[recipe])
        assert trace.first is None, trace.format()
        compared = [r for r in trace.rows if r.verdict != "not compared"]
        assert compared and all(r.verdict == "ok" for r in compared)
        # measured margin on correct ops: well inside every budget
        assert max(r.ratio for r in compared) < 0.6, trace.format()


class _Float32Tail(torch.nn.Module):
    """A Linear (bf16 under a bf16 recipe's autocast), then an op the code computes in float32."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.exp(self.lin(x).float())


def test_a_float32_op_is_judged_at_the_checks_precision_where_that_is_coarser(x):
    # A float32 kernel 1e-4 off (its float64 golden exact): beyond float32's budget, so the culprit of an fp32
    # check; within what a bf16 check's precision rounds away, so no culprit there (with ATen's AVX2 kernels a
    # correct bf16 run of a tiny Llama has a float32 flash-attention op 2.3e-5 off: module doc).
    def off_in_float32(func, args, kwargs):
        out = func(*args, **kwargs)
        return out * (1 + 1e-4) if out.dtype == torch.float32 else out

    torch.manual_seed(0)
    model = _Float32Tail().eval()
    for recipe in ("fp32", "bf16"):
        with _Kernel({aten.exp.default}, off_in_float32), torch.no_grad():
            trace = trace_ops(model, (x,), device="cpu", recipe=RECIPES[recipe])
        row = next(r for r in trace.rows if r.op == "aten.exp")
        assert row.dtype == "float32" and op_budget(torch.float32) < row.local < op_budget(torch.bfloat16), row
        if recipe == "fp32":
            assert trace.first is row and row.verdict == "local", trace.format()
        else:
            assert trace.first is None and row.verdict == "ok", trace.format()
            assert row.budget == op_budget(torch.bfloat16) and row.ratio < 0.1


# --------------------------------------------------------------------------------------------
# a tiny transformers model


def _llama(attn: str = "eager"):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=attn)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    return model, ids


def test_tiny_llama_attention_softmax_kernel_is_named():
    model, ids = _llama()
    case = ParityCase(_session(Localizer(budget_s=None)), "t::llama",
                      patches=_kernel({aten._softmax.default}, _softmax_in_half))
    message, extra = _fail(case, "llama", model, input_ids=ids, use_cache=False)
    # Each decoder layer's output stays within the fp32 tolerance (the residual stream is much larger than
    # the attention's error), yet holds most of the model's difference: the module descent follows layer 0
    # down to the attention's own code (the softmax is called there, not in a submodule), and its op
    # trace reaches the op. (Before it stopped in LlamaModel's own code.)
    assert "First divergence: model.layers.0.self_attn (LlamaAttention), in its own code" in message, message
    first = _first_op(extra)
    assert first["op"] == "aten._softmax" and first["module"] == "model.layers.0.self_attn"
    assert "modeling_llama.py:" in first["source"] and "softmax" in first["source"]
    assert first["verdict"] == "local"


def test_tiny_llama_norm_kernel_is_named_in_the_norm():
    model, ids = _llama()

    def rsqrt_off(func, args, kwargs):
        return func(*args, **kwargs) * (1 + 1e-3)
    case = ParityCase(_session(), "t::llama-norm", patches=_kernel({aten.rsqrt.default}, rsqrt_off))
    message, extra = _fail(case, "llama", model, input_ids=ids, use_cache=False)
    assert "First divergence: model.layers.0.input_layernorm (LlamaRMSNorm)" in message
    first = _first_op(extra)
    assert first["op"] == "aten.rsqrt" and first["module"] == "model.layers.0.input_layernorm"
    assert "modeling_llama.py:" in first["source"] and "torch.rsqrt(" in first["source"]


def test_tiny_llama_without_fault_has_no_culprit_op():
    for attn in ("eager", "sdpa"):
        model, ids = _llama(attn)
        for recipe in ("fp32", "bf16"):
            with torch.no_grad():
                trace = trace_ops(model, kwargs={"input_ids": ids, "use_cache": False}, device="cpu",
                                  recipe=RECIPES[recipe])
            assert trace.first is None, trace.format()
            assert max(r.ratio for r in trace.rows) < 0.6, trace.format()  # measured margin (module doc)


# --------------------------------------------------------------------------------------------
# instrumentation changes nothing; what is not compared is listed


class Noisy(torch.nn.Module):
    """Dropout (random), in-place ops, a view, a factory and an ``.item()``."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        y = self.drop(self.lin(x))
        y.relu_()
        y = y.masked_fill(y > 1.5, 0.0)
        scale = float(y.abs().max().item()) + 1.0
        return (y.transpose(-1, -2) / scale + torch.randn_like(y.transpose(-1, -2))).sum(-1)


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_outputs_are_bitwise_unchanged_under_the_trace(recipe, x):
    torch.manual_seed(0)
    noisy = Noisy().train()
    model, ids = _llama()
    model.train()
    for module, args, kwargs in ((noisy, (x,), {}), (model, (), {"input_ids": ids, "use_cache": False})):
        with same_randomness(7), RECIPES[recipe].context(torch.device("cpu")):
            plain = module(*args, **kwargs)
        with same_randomness(7):
            traced = trace_ops(module, args, kwargs, device="cpu", recipe=RECIPES[recipe])
        plain_t = plain if isinstance(plain, torch.Tensor) else plain.logits
        traced_t = traced.output if isinstance(traced.output, torch.Tensor) else traced.output.logits
        assert plain_t.dtype == traced_t.dtype and torch.equal(plain_t, traced_t)


def test_ops_that_cannot_be_compared_are_listed_with_the_reason(x):
    torch.manual_seed(0)
    noisy = Noisy().train()
    torch.manual_seed(3)  # torch's own dropout and randn_like (same_randomness would replace them by torch.rand)
    trace = trace_ops(noisy, (x,), device="cpu", recipe=RECIPES["fp32"])
    why = {r.op: r.why for r in trace.rows if r.verdict == "not compared"}
    # CPU dropout in training: bernoulli_ on an empty_like mask
    assert why["aten.bernoulli_"] == "random" and why["aten.randn_like"] == "random"
    assert why["aten.empty_like"] == "uninitialized memory"
    assert why["aten.transpose"] == "view (computes nothing)"
    assert why["aten._local_scalar_dense"] == "no tensor output"
    assert {r.op for r in trace.rows if r.verdict == "ok"} >= {"aten.addmm", "aten.relu_", "aten.masked_fill"}
    not_compared = [r for r in trace.rows if r.verdict == "not compared"]
    assert sum(trace.not_compared.values()) == len(not_compared) and len(trace.rows) == trace.ops  # none dropped
    text = trace.format()
    assert "Not compared:" in text and "random (aten.bernoulli_, aten.randn_like)" in text


def test_an_op_whose_golden_fails_on_the_cpu_is_listed():
    @torch.library.custom_op("npu_parity_test::no_float64", mutates_args=())
    def no_float64(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float64:
            raise RuntimeError("no float64 kernel")
        return t * 2

    class Uses(torch.nn.Module):
        def forward(self, t):
            return no_float64(t) + 1

    trace = trace_ops(Uses(), (torch.ones(3),), device="cpu")
    rows = {r.op: r for r in trace.rows}
    assert rows["npu_parity_test.no_float64"].why == "fails on CPU (RuntimeError)"
    assert rows["aten.add"].verdict == "ok"  # the chain goes on from the target's result
    assert "fails on CPU (RuntimeError) (npu_parity_test.no_float64)" in trace.format()


def test_a_spent_deadline_compares_nothing_and_says_so(net, x):
    with torch.no_grad():
        plain = net(x)
        trace = trace_ops(net, (x,), device="cpu", deadline=time.perf_counter())
    assert torch.equal(trace.output, plain)
    assert trace.first is None and trace.rows == [] and trace.not_compared["past the localization budget"] == trace.ops
    assert any("budget ran out after 0 ops" in n for n in trace.notes)


def test_passing_checks_never_trace(net, x, monkeypatch):
    calls = []
    monkeypatch.setattr(op_trace, "trace_ops", lambda *a, **k: calls.append(1))
    ParityCase(_session(Localizer()), "t::green").check("net", net, x)
    assert calls == [] and not torch._C._dispatch_tls_local_include_set().has(torch._C.DispatchKey.Python)


# --------------------------------------------------------------------------------------------
# the error measure


def test_relative_error_matches_non_finite_values_and_overflow():
    golden = torch.tensor([1.0, float("nan"), -float("inf"), 2.0], dtype=torch.float64)
    assert relative_error(golden.float(), golden) == 0.0
    assert relative_error(torch.tensor([1.0, 0.0, -float("inf"), 2.0]), golden) == math.inf  # NaN lost
    # an overflow of float32 that float64 does not have is the same result
    big = torch.tensor([-3.0e38], dtype=torch.float32)
    assert relative_error(big + big, big.double() + big.double()) == 0.0
    assert relative_error(torch.tensor([1.0, 2.002]), torch.tensor([1.0, 2.0], dtype=torch.float64)) == \
        pytest.approx(1e-3, rel=1e-3)
    assert relative_error(torch.tensor([1, 2]), torch.tensor([1, 3])) == math.inf
    assert relative_error(torch.ones(2), torch.ones(3, dtype=torch.float64)) == math.inf


def test_budgets_follow_the_dtype():
    assert op_budget(torch.float32) == pytest.approx(1.0e-5, rel=0.01)
    assert op_budget(torch.bfloat16) == 2 ** -7 and op_budget(torch.float16) == 2 ** -10
    assert op_budget(torch.float64) == pytest.approx(84 * 2 ** -52)
    assert op_budget(torch.complex64) == op_budget(torch.float32) and op_budget(torch.int64) == 0.0
    with pytest.raises(ValueError, match="max_ops"):
        trace_ops(torch.nn.Identity(), (torch.ones(1),), device="cpu", max_ops=0)


def test_module_paths_without_module_tracker_come_from_forward_hooks(net, x, monkeypatch):
    with torch.no_grad():
        tracked = trace_ops(net, (x,), device="cpu", path="net")
        monkeypatch.setattr(op_trace, "ModuleTracker", None)  # a torch without torch.utils.module_tracker
        hooked = trace_ops(net, (x,), device="cpu", path="net")
    assert [r.module for r in hooked.rows] == [r.module for r in tracked.rows]
    assert {r.module for r in hooked.rows} >= {"net.inp", "net.norm", "net.attn", "net.attn.q", "net.out"}
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_a_spent_localization_budget_skips_the_op_trace_and_says_so(net, x, monkeypatch):
    import pytest_npu_parity.diagnose.localize.hook as localize_module

    monkeypatch.setattr(localize_module, "COST_FACTOR", 0.0)  # the descent may start; the budget ends in it
    localizer = Localizer(budget_s=1e-9)
    case = ParityCase(_session(localizer), "t::budget", patches=_kernel({aten.native_layer_norm.default}, _other_eps))
    message, extra = _fail(case, "net", net, x)
    assert "First divergence: norm (LayerNorm)" in message  # one pass answers it
    assert "no op trace of norm: the session's localization budget is spent" in message
    assert "localization_ops" not in extra and "Op trace of" not in message

"""What makes a failing check pass: counterfactual re-runs of its target, judged by its own verdict.

Faults are planted on the target side only, through the case's patch factory: a scaled weight (fp32,
allclose; a train step under its default golden verdict; a tiny Llama), and a fragile port under the
bf16 recipe (the moments of one normalization computed with matmuls, which autocast runs in bf16:
catastrophic cancellation; the check fails under the golden verdict). Each test requires the
diagnosis to name the planted piece, and the unmodified re-run to reproduce the check bitwise.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from counterfactual_models import (FRAGILE, fragile_moments, net, net_input, norm_input, norm_net,  # noqa: F401
                                   scaled)

import pytest_npu_parity
from pytest_npu_parity.checks.hooks import NO_LOCALIZATION_UNDER_GOLDEN
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.diagnose.counterfactual import (ROOT_CAUSE_SHARE, Rerunner, Suspect, attribute,
                                                       failing_paths, fp32_islands, reference_outputs)
from pytest_npu_parity.localize import Localizer
from pytest_npu_parity.runner import ParityCase, ParitySession

CPU = torch.device("cpu")


def _session(hooks: list, **kwargs) -> ParitySession:
    return ParitySession(CPU, reference="cpu", failure_hooks=hooks, **kwargs)


class _Captured:
    """A check hook keeping the target's leaves and a failure hook keeping what the hooks are given."""

    def __init__(self) -> None:
        self.actual = None
        self.args = None

    def check_hook(self, case, record, call, actual, expected):
        self.actual = actual
        return None

    def failure_hook(self, case, record, call, result):
        self.args = (case, record, call, result)
        return None

    failure_hook.runs_under_golden = True  # type: ignore[attr-defined]


def _fails(case: ParityCase, *args, **kwargs) -> str:
    with pytest.raises(ParityError) as info:
        case.check(*args, **kwargs)
    return str(info.value)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _worst(result) -> list:
    return [(leaf.path, leaf.err_ratio, dict(getattr(leaf, "ratios", {}) or {})) for leaf in result.leaves]


@pytest.mark.parametrize("kind", ["fp32 allclose", "bf16 golden"])
def test_an_unmodified_rerun_reproduces_the_outputs_bitwise_and_the_verdict(kind):
    captured = _Captured()
    if kind == "fp32 allclose":
        model, x = net(), net_input()
        session = _session([captured.failure_hook], check_hooks=[captured.check_hook],
                           recipe_policies={"fp32": "allclose"})
        case = ParityCase(session, "t::same", patches=scaled(model, "blocks.2.b.weight", 1.001))
    else:
        model, x = norm_net(), norm_input()
        session = _session([captured.failure_hook], check_hooks=[captured.check_hook])
        case = ParityCase(session, "t::same", "bf16", patches=fragile_moments)
    _fails(case, "m", model, x)
    case_, record, call, result = captured.args
    assert (record.golden_policy is not None) == (kind == "bf16 golden")
    again = call.rerun(case.target, True, call.args, call.kwargs)
    assert _equal(again, captured.actual)  # bitwise the check's own target outputs
    rejudged = call.rejudge(again)
    assert not rejudged.passed and _worst(rejudged) == _worst(result)  # the same verdict, the same numbers
    # the machinery with nothing to change: hooks registered, outputs bitwise the same
    runner = Rerunner(case, call, failing_paths(result))
    for modification in (None, lambda m: fp32_islands(m, []), lambda m: reference_outputs(m, [])):
        outcome = runner.run(modification)
        assert not outcome.passed and outcome.error == runner.run(None).error
    with fp32_islands(model, []), reference_outputs(model, []):
        assert _equal(call.rerun(case.target, True, call.args, call.kwargs), captured.actual)
    if kind == "fp32 allclose":  # float32 islands under the fp32 recipe change nothing either
        with fp32_islands(model, ["blocks.1", "head"]):
            assert _equal(call.rerun(case.target, True, call.args, call.kwargs), captured.actual)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # none stay behind


def test_the_scaled_layer_is_the_root_cause_and_another_layer_has_no_effect():
    model, x = net(), net_input()
    session = _session([Localizer(None)], recipe_policies={"fp32": "allclose"})
    case = ParityCase(session, "t::scaled", patches=scaled(model, "blocks.2.b.weight", 1.001))
    message = _fails(case, "m", model, x)
    record = case.records[-1]
    assert "First divergence: blocks.2.b (Linear)" in message  # the localization is still there, first
    assert "What makes it pass" in message
    line = next(s for s in message.splitlines() if s.strip().startswith("blocks.2.b (Linear) replaced by"))
    assert "ROOT CAUSE" in line and "[first divergence]" in line
    rows = {r["suspect"]: r for r in record.whatfix.counterfactual}
    assert rows["blocks.2.b (Linear)"]["verdict"] == "root cause" and rows["blocks.2.b (Linear)"]["passed"]
    assert rows["the patch set"]["verdict"] == "root cause"
    assert record.whatfix.fp32_islands is None  # an fp32 check gets no island search
    assert record.extra["counterfactual_s"] > 0 and '"root cause"' in record.rows()[0]["counterfactual"]
    # another layer replaced by its reference: the error stays
    captured = _Captured()
    case = ParityCase(_session([captured.failure_hook], recipe_policies={"fp32": "allclose"}), "t::again",
                      patches=scaled(model, "blocks.2.b.weight", 1.001))
    _fails(case, "m", model, x)
    case_, record, call, result = captured.args
    runner = Rerunner(case, call, failing_paths(result))
    found = {a.suspect.name: a for a in attribute(runner, [Suspect("module", "blocks.0.a", "test"),
                                                           Suspect("module", "blocks.2.b", "test")], result)}
    assert found["blocks.0.a"].verdict == "no effect" and abs(found["blocks.0.a"].share) < 0.2
    assert found["blocks.2.b"].verdict == "root cause" and found["blocks.2.b"].share >= ROOT_CAUSE_SHARE


def test_a_patch_of_the_suspects_class_never_reaches_its_reference():
    model, x = net(), net_input()
    for i, block in enumerate(model.blocks):
        block.index = i  # deep copies (the pristine reference) keep it: the patch would match them too
    original = type(model.blocks[0]).forward

    @contextlib.contextmanager
    def own_code_fault(device):  # block 2 scales its result in its own forward, a class-level patch
        def forward(self, x):
            y = original(self, x)
            return y * 1.001 if getattr(self, "index", None) == 2 else y
        type(model.blocks[0]).forward = forward
        try:
            yield
        finally:
            type(model.blocks[0]).forward = original

    case = ParityCase(_session([Localizer(None)], recipe_policies={"fp32": "allclose"}), "t::code",
                      patches=own_code_fault)
    message = _fails(case, "m", model, x)
    assert "First divergence: blocks.2 (Block)" in message
    rows = {r["suspect"]: r for r in case.records[-1].whatfix.counterfactual}
    assert rows["blocks.2 (Block)"]["verdict"] == "root cause" and rows["blocks.2 (Block)"]["passed"]


def test_a_train_step_under_its_golden_verdict_gets_a_counterfactual_not_the_not_localized_note():
    model, x = net(), net_input()
    session = _session([Localizer(None)])
    case = ParityCase(session, "t::step", patches=scaled(model, "blocks.2.b.weight", 1.01))
    with pytest.raises(ParityError) as info:
        case.train_step("step", model, {"x": x}, loss_fn=lambda out: out.square().mean())
    message, record = str(info.value), case.records[-1]
    assert record.golden_policy is not None
    assert NO_LOCALIZATION_UNDER_GOLDEN.strip() not in message
    assert "What makes it pass" in message
    rows = {r["suspect"]: r for r in record.whatfix.counterfactual}
    # Only forward values are replaced (the scaled weight still acts in the backward): the faulty block's
    # re-run changes the error, the others' leave it exactly as it was — so the copy the step trains kept
    # the hooks. How much of it goes depends on the CPU's kernels, since the largest error left is the
    # upstream gradients' that the backward through the scaled weight makes: 25 % removed on an AMD EPYC
    # (AVX512-BF16), 15 % on an Intel Xeon with AMX, -1 % on ATen's default kernels with oneDNN at AVX2;
    # so its verdict may be "no effect", which the message says does not clear it (asserted below).
    faulty = rows["blocks.2 (Block)"]
    assert faulty["error_after"] != faulty["error_before"] and faulty["verdict"] != "root cause"
    assert all(rows[f"blocks.{i} (Block)"]["verdict"] == "no effect" for i in (0, 1, 3))
    assert all(rows[f"blocks.{i} (Block)"]["error_after"] == rows[f"blocks.{i} (Block)"]["error_before"]
               for i in (0, 1, 3))
    assert rows["the patch set"]["verdict"] == "root cause"
    # ... and the message says that a backward fault is not removed by these re-runs, and where to look.
    assert "its backward stays the target's" in message and "--parity-policy allclose" in message


def test_a_forward_check_says_nothing_of_the_backward():
    model, x = net(), net_input()
    case = ParityCase(_session([Localizer(None)]), "t::fwd", patches=scaled(model, "blocks.2.b.weight", 1.01))
    with pytest.raises(ParityError) as info:
        case.check("fwd", model, x)
    assert "What makes it pass" in str(info.value) and "its backward stays" not in str(info.value)


def test_without_the_counterfactual_a_golden_failure_is_not_localized():
    model, x = norm_net(), norm_input()
    case = ParityCase(_session([Localizer(None, counterfactual=False)]), "t::off", "bf16", patches=fragile_moments)
    message = _fails(case, "m", model, x)
    assert "not run under the golden verdict" in message and "What makes it pass" not in message
    assert case.records[-1].whatfix.counterfactual is None


def test_the_fp32_island_of_a_fragile_bf16_port_is_that_submodule_and_its_fix_passes():
    model, x = norm_net(), norm_input()
    case = ParityCase(_session([Localizer(None)]), "t::island", "bf16", patches=fragile_moments)
    message = _fails(case, "m", model, x)
    record = case.records[-1]
    assert record.golden_policy is not None
    assert "not run under the golden verdict" not in message  # a diagnosis instead of "not localized"
    assert 'pytest_npu_parity.fp32_islands(model, ["blocks.1.norm"])' in message
    assert "verified by a re-run with exactly this fix" in message
    assert record.whatfix.fp32_islands == "blocks.1.norm"  # not its siblings (lin, blocks.0.norm)
    rows = {r["suspect"]: r for r in record.whatfix.counterfactual if r["kind"] == "counterfactual"}
    assert rows["blocks.1 (NormBlock)"]["verdict"] == "root cause"
    assert rows["blocks.0 (NormBlock)"]["verdict"] == "no effect" and rows["embed (Linear)"]["verdict"] == "no effect"
    # the printed fix, pasted around the check: it passes; without it the same check fails
    with pytest_npu_parity.fp32_islands(model, ["blocks.1.norm"]):
        ParityCase(_session([]), "t::fixed", "bf16", patches=fragile_moments).check("m", model, x)
    _fails(ParityCase(_session([]), "t::unfixed", "bf16", patches=fragile_moments), "m", model, x)
    with pytest_npu_parity.fp32_islands(model, ["blocks.0.norm", "blocks.1.lin"]):  # siblings do not fix it
        _fails(ParityCase(_session([]), "t::siblings", "bf16", patches=fragile_moments), "m", model, x)


def test_a_fault_that_float32_does_not_fix_says_precision_is_not_the_cause():
    model, x = norm_net(), norm_input()
    case = ParityCase(_session([Localizer(None)]), "t::weight", "bf16", patches=scaled(model, "head.weight", 1.5))
    message = _fails(case, "m", model, x)
    assert "precision is not the cause" in message and case.records[-1].whatfix.fp32_islands is None
    rows = {r["suspect"]: r for r in case.records[-1].whatfix.counterfactual if r["kind"] == "counterfactual"}
    assert rows["head (Linear)"]["verdict"] == "root cause" and rows["embed (Linear)"]["verdict"] == "no effect"


def test_fp32_islands_runs_the_named_submodule_in_float32_like_the_plain_torch_fix():
    model, x = norm_net(), norm_input()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        plain = model.blocks[0].lin(x)
        with pytest_npu_parity.fp32_islands(model, ["blocks.0.lin"]):
            island = model.blocks[0].lin(x)
        with torch.autocast("cpu", enabled=False):
            by_hand = model.blocks[0].lin(x.float())
    assert plain.dtype == torch.bfloat16 and island.dtype == torch.float32 and torch.equal(island, by_hand)
    with pytest.raises(ValueError, match="16-bit weights"):
        with pytest_npu_parity.fp32_islands(norm_net().to(torch.bfloat16), ["head"]):
            pass
    with pytest.raises(AttributeError):
        with pytest_npu_parity.fp32_islands(model, ["no.such"]):
            pass


def test_the_reference_replacement_uses_the_pristine_module_in_float64():
    model, x = net(), net_input()
    pristine = {"blocks.0": copy.deepcopy(model.blocks[0]).double()}  # before the target's patch edits a weight
    with torch.no_grad():
        expected = pristine["blocks.0"](x.double()).float()
        with scaled(model, "blocks.0.a.weight", 2.0)(CPU), reference_outputs(model, ["blocks.0"], pristine=pristine):
            got = model.blocks[0](x)
        faulty = model.blocks[0](x)
    assert got.dtype == torch.float32 and torch.equal(got, expected) and not torch.equal(faulty, got)


def test_a_planted_fault_in_a_tiny_llama_is_named_root_cause():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    session = _session([Localizer(None)], recipe_policies={"fp32": "allclose"})
    case = ParityCase(session, "t::llama", patches=scaled(model, "model.layers.1.mlp.down_proj.weight", 1.01))
    message = _fails(case, "llama", model, input_ids=ids)
    rows = {r["submodule"]: r for r in case.records[-1].whatfix.counterfactual if r["kind"] == "counterfactual"}
    assert rows["model.layers.1.mlp.down_proj"]["verdict"] == "root cause"
    assert "model.layers.1.mlp.down_proj (Linear) replaced by its float64 CPU reference" in message


def _counting(module: torch.nn.Module) -> list:
    calls: list = []
    module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_nothing_runs_for_a_passing_check_nor_past_the_budget():
    model, x = norm_net(), norm_input()
    calls = _counting(model.head)
    case = ParityCase(_session([Localizer(None)]), "t::clean", "bf16")
    case.check("m", model, x)  # no patch set: it passes
    own = len(calls)  # the check's own runs: reference, target, golden (a deep copy keeps the hook)
    assert own == 3 and case.records[-1].whatfix.counterfactual is None
    calls.clear()
    case = ParityCase(_session([Localizer(0)]), "t::spent", "bf16", patches=fragile_moments)
    message = _fails(case, "m", model, x)
    assert len(calls) == own and "What makes it pass: not run" in message
    assert case.records[-1].whatfix.counterfactual is None


def test_a_bounded_search_stops_and_says_so():
    captured = _Captured()
    model, x = norm_net(), norm_input()
    case = ParityCase(_session([captured.failure_hook]), "t::bounded", "bf16", patches=fragile_moments)
    _fails(case, "m", model, x)
    from pytest_npu_parity.diagnose.counterfactual import what_makes_it_pass

    case_, record, call, result = captured.args
    found = what_makes_it_pass(case, record, call, result, max_runs=4)
    assert found.runs == 4 and found.stopped and "the re-run budget ran out" in found.format()
    assert record.whatfix.fp32_islands is None  # nothing verified within 4 re-runs
    past = what_makes_it_pass(case, record, call, result, deadline=0.0)
    assert past.runs == 0 and "no suspect re-run: budget spent" in past.format()


class _SoftmaxInHalf(TorchDispatchMode):
    """A wrong softmax kernel on the target: computed in float16 (the other ops run as they are)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._softmax.default:
            x, dim, _ = args
            with _disable_current_modes():
                return func(x.half(), dim, False).to(x.dtype)
        return func(*args, **kwargs)


class _Attention(torch.nn.Module):
    """Single-head attention whose scores and softmax live in its own code."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        return torch.softmax(scores, dim=-1) @ self.v(x)


def test_the_op_traces_culprit_kernel_is_removed_with_its_module():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), _Attention(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    case = ParityCase(_session([Localizer(None)], recipe_policies={"fp32": "allclose"}), "t::kernel",
                      patches=lambda device: _SoftmaxInHalf())
    message = _fails(case, "m", model, x)
    assert "first culprit op: aten._softmax" in message
    rows = [r for r in case.records[-1].whatfix.counterfactual if r["kind"] == "counterfactual"]
    named = next(r for r in rows if r["submodule"] == "1")
    assert "module of the culprit op aten._softmax" in named["why"] and named["verdict"] == "root cause"


def test_a_rerun_that_passes_beyond_the_limit_says_what_forgave_it():
    from types import SimpleNamespace

    from pytest_npu_parity.diagnose.counterfactual import _passes

    # "error 639 -> 184 (71% removed, passes)" read as a contradiction: 184 is beyond the limit of 1, and the
    # golden floor passed it within its allclose floor
    assert _passes(SimpleNamespace(passed=True, error=184.0)) == (
        ", passes: beyond the limit, within the verdict's allclose floor or budget")
    assert _passes(SimpleNamespace(passed=True, error=0.4)) == ", passes"
    assert _passes(SimpleNamespace(passed=False, error=184.0)) == ""

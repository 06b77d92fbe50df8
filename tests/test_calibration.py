"""The calibration harness: its variants compute what they claim, its faults are real and restored,
its rates are counted right, and one small end-to-end run tells a variant from a fault."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pytest_npu_parity.rng import same_randomness

# The harness is a benchmark of the repository (benchmarks/calibration.py), not part of the package.
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
import calibration as C  # noqa: E402


# --------------------------------------------------------------------------------------------
# variants


def test_round_mantissa_by_hand():
    ulp = 2.0 ** -10  # with 10 explicit mantissa bits, the spacing just above 1
    x = torch.tensor([1 + ulp / 4, 1 + ulp / 2, 1 + 3 * ulp / 4, -(1 + ulp / 2), 1 + ulp, math.inf, -math.inf, 0.0])
    y = C.round_mantissa(x)
    assert y.tolist()[:5] == [1.0, 1 + ulp, 1 + ulp, -(1 + ulp), 1 + ulp]  # nearest, ties away from zero
    assert y[5] == math.inf and y[6] == -math.inf and y[7] == 0.0
    assert torch.isnan(C.round_mantissa(torch.tensor([math.nan]))).all()
    assert torch.equal(C.round_mantissa(x, bits=23), x)


def test_round_mantissa_keeps_shape_of_non_contiguous_tensors_and_other_dtypes():
    x = torch.randn(4, 3).T
    assert C.round_mantissa(x).shape == (3, 4)
    b = torch.ones(3, dtype=torch.bfloat16)
    assert C.round_mantissa(b) is b
    with pytest.raises(ValueError, match="bits=24"):
        C.round_mantissa(x, bits=24)


def test_split_k_linear_fp32_is_the_same_sum_in_another_order():
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 64), torch.randn(16, 64), torch.randn(16)
    got = C.split_k_linear(F.linear, chunks=4)(x, w, b)
    expected = sum(F.linear(xc, wc) for xc, wc in zip(x.split(16, -1), w.split(16, -1))) + b
    assert torch.equal(got, expected)
    assert torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_split_k_linear_under_autocast_rounds_operands_then_accumulates_in_fp32():
    torch.manual_seed(0)
    x, w = torch.randn(5, 64), torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = C.split_k_linear(F.linear, chunks=4)(x, w)
    assert got.dtype == torch.bfloat16
    # bf16 operands, exact products, fp32 sums: within one bf16 rounding (2**-8 relative) of the
    # exact sum of the bf16 products
    exact = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T
    assert ((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6).all()
    # the fp32 operands themselves were rounded: the result differs from the unrounded product
    assert not torch.equal(got.double(), (x.double() @ w.double().T).to(torch.bfloat16).double())


def test_split_k_leaves_small_k_to_the_original():
    calls = []

    def original(*args):
        calls.append(args)
        return F.linear(*args)

    C.split_k_linear(original, chunks=4)(torch.ones(2, 6), torch.ones(3, 6))
    assert len(calls) == 1


def test_split_k_scenario_replaces_and_restores_f_linear():
    before = F.linear
    with C.split_k():
        assert F.linear is not before
    assert F.linear is before


def test_reduced_mantissa_rounds_fp32_operands_only_outside_autocast():
    x = torch.full((1, 1), 1 + 2.0 ** -12)
    w = torch.ones(1, 1)
    with C.reduced_mantissa():
        assert F.linear(x, w).item() == 1.0  # rounded to 10 mantissa bits
        assert torch.matmul(x, w).item() == 1.0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.linear(x, w)  # left to autocast (no error, no rounding of its own)
    assert F.linear(x, w).item() == 1 + 2.0 ** -12


def test_thread_count_flips_and_restores():
    before = torch.get_num_threads()
    with C.thread_count():
        assert torch.get_num_threads() == (2 if before == 1 else 1)
    assert torch.get_num_threads() == before


@pytest.mark.skipif(C._fastpath_unavailable() is not None, reason="no fast-path switch in this torch")
def test_transformer_slow_path_switches_the_fast_path_off():
    assert torch.backends.mha.get_fastpath_enabled()
    with C.transformer_slow_path():
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mha.get_fastpath_enabled()


# --------------------------------------------------------------------------------------------
# faults


def test_shift_mask_by_hand():
    mask = torch.triu(torch.full((3, 3), -math.inf), diagonal=1)
    shifted = C._shift_mask(mask)
    expected = torch.triu(torch.full((3, 3), -math.inf), diagonal=2)
    assert torch.equal(shifted, expected)


def test_causal_mask_off_by_one_lets_each_position_see_the_next():
    import aurora.modeling_aurora as modeling
    import aurora.prototype_retriever as retriever

    before = (modeling.causal_attention_mask, retriever.causal_attention_mask)
    with C.causal_mask_off_by_one():
        mask = modeling.causal_attention_mask(4)[0, 0]
        assert mask[0, 1] == 0 and mask[0, 2] == -math.inf and mask[2, 3] == 0
        assert torch.equal(retriever.causal_attention_mask(4)[0, 0], mask)
    assert (modeling.causal_attention_mask, retriever.causal_attention_mask) == before
    assert modeling.causal_attention_mask(4)[0, 0, 0, 1] == -math.inf


def _attention():
    from aurora.configuration_aurora import AuroraConfig
    from aurora.modeling_aurora import AuroraAttention

    torch.manual_seed(0)
    return AuroraAttention(AuroraConfig(hidden_size=16, num_attention_heads=4)).eval()


def test_wrong_attention_scale_changes_the_scores_by_sqrt_heads():
    attention = _attention()
    x = torch.randn(1, 3, 16)
    with torch.no_grad():
        _, scores = attention(x, output_attentions=True)
        with C.wrong_attention_scale():
            _, wrong = attention(x, output_attentions=True)
        _, again = attention(x, output_attentions=True)
    assert torch.allclose(wrong, scores / 2, rtol=1e-5, atol=1e-6)  # sqrt(head_dim 4 / hidden 16)
    assert torch.equal(again, scores)


def test_norm_softmax_in_bf16_computes_in_bf16_and_keeps_the_dtype():
    x = torch.randn(4, 7) * 3
    with C.norm_softmax_in_bf16():
        got = F.softmax(x, dim=-1)
        ln = F.layer_norm(x, (7,))
    assert got.dtype == torch.float32
    assert torch.equal(got, F.softmax(x.to(torch.bfloat16), dim=-1).float())
    assert torch.equal(ln, F.layer_norm(x.to(torch.bfloat16), (7,)).float())
    assert not torch.equal(F.softmax(x, dim=-1), got)


def test_norm_in_bf16_keeps_batch_norm_running_statistics_updated():
    bn = torch.nn.BatchNorm1d(3).train()
    x = torch.randn(8, 3)
    with C.norm_softmax_in_bf16():
        bn(x)
    expected = torch.nn.BatchNorm1d(3).train()
    expected(x)
    assert torch.equal(bn.running_mean, expected.running_mean)


def test_device_rng_dropout_draws_another_mask_than_the_shared_stream():
    x = torch.ones(256)
    with same_randomness(3):
        shared = F.dropout(x, 0.5)
    with C.device_rng_dropout(), same_randomness(3):
        device = F.dropout(x, 0.5)
    with same_randomness(3):
        again = F.dropout(x, 0.5)
    assert not torch.equal(shared, device)
    assert torch.equal(shared, again)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.small = torch.nn.Linear(2, 2)
        self.big = torch.nn.Linear(8, 8, bias=False)
        self.other = torch.nn.Linear(8, 4)


def _sc(module):
    return C.ScenarioContext(check=type("Check", (), {"name": "demo"})(), aurora=None, fn=module, module=module,
                             recipe="fp32")


def test_fault_weight_and_bias_choice():
    block = _Block()
    assert C.fault_weight(_sc(block)) == "big.weight"  # the largest weight matrix
    assert C.fault_bias(_sc(block)) == "other.bias"   # big has no bias: the largest bias instead
    layer = torch.nn.Linear(3, 3)
    assert (C.fault_weight(_sc(layer)), C.fault_bias(_sc(layer))) == ("weight", "bias")


def test_scaled_weight_and_dropped_bias_are_restored():
    layer = torch.nn.Linear(3, 3)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    with C.scaled_weight(1 + 1e-3)(_sc(layer)):
        assert torch.equal(layer.weight, weight * (1 + 1e-3))
    with C.dropped_bias(_sc(layer)):
        assert not layer.bias.any()
    assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias)


def test_every_scenario_has_a_kind_and_a_unique_name():
    names = [s.name for s in C.SCENARIOS]
    assert len(names) == len(set(names))
    assert {s.kind for s in C.VARIANTS} == {"variant"} and {s.kind for s in C.FAULTS} == {"fault"}


# --------------------------------------------------------------------------------------------
# counting


def _case(kind, verdict, status="judged", resolvable=None, recipe="fp32", scenario="s"):
    return C.CaseOutcome(check="c", recipe=recipe, scenario=scenario, kind=kind, status=status,
                         effect_rel_l2=1e-3, resolvable=resolvable, verdicts={"p": verdict})


def _report(cases):
    policy = C.PolicySpec("p", "allclose", {"fp32": C.FP32, "bf16": C.LOW_PRECISION}, default=True, note="n")
    meta = {"checks": ["c"], "recipes": ["fp32", "bf16"], "size": "full", "machine": "m", "torch": "t",
            "threads": 1, "duration_s": 1.0}
    return C.CalibrationReport(cases=cases, policies=[policy], scenarios=C.SCENARIOS[:1],
                               golden={"fp32": {"c": {"golden_dtype": "float64", "unavailable": None,
                                                      "reference_rel_l2": 1e-7, "reference_max_rel": 1e-6}}},
                               meta=meta)


def test_rates_count_wrong_verdicts_over_judged_cases():
    cases = [
        _case("variant", "pass"), _case("variant", "fail"), _case("variant", "fail"), _case("variant", "pass"),
        _case("variant", "fail", status="no effect"),           # not counted
        _case("fault", "fail"), _case("fault", "pass", resolvable=False), _case("fault", "pass"),
        _case("fault", "n/a"),                                   # golden unavailable: not counted
    ]
    row = next(r for r in _report(cases).rates() if r["recipe"] == "fp32")
    assert (row["false_failure_count"], row["variants_judged"], row["false_failure_rate"]) == (2, 4, 0.5)
    assert (row["false_pass_count"], row["faults_judged"]) == (2, 3)
    assert row["false_pass_rate"] == pytest.approx(2 / 3)
    assert (row["false_pass_resolvable_count"], row["faults_resolvable_judged"]) == (1, 2)
    assert row["not_applicable"] == 1


def test_rates_split_by_recipe_and_all():
    cases = [_case("variant", "fail", recipe="fp32"), _case("variant", "pass", recipe="bf16")]
    rows = {r["recipe"]: r for r in _report(cases).rates()}
    assert rows["fp32"]["false_failure_rate"] == 1.0
    assert rows["bf16"]["false_failure_rate"] == 0.0
    assert rows["all"]["false_failure_rate"] == 0.5
    assert rows["all"]["false_pass_rate"] is None


def test_report_serialises_and_renders():
    report = _report([_case("variant", "fail", scenario="patch_set"), _case("fault", "pass", scenario="patch_set")])
    data = report.to_dict()
    text = json.dumps(data)
    assert json.loads(text)["rates"][0]["policy"] == "p"
    markdown = report.to_markdown()
    assert "| **p** | fp32 | 1/1 (100 %) | 1/1 (100 %) |" in markdown
    assert "| patch_set | variant |" in markdown
    assert "float64; ref. error 1e-07 / 1e-06" in markdown


def test_expected_verdicts():
    assert _case("variant", "fail").wrong("p") is True
    assert _case("fault", "fail").wrong("p") is False
    assert _case("fault", "fail", status="no effect").wrong("p") is None


def test_unknown_checks_and_recipes_are_refused():
    with pytest.raises(KeyError, match="unknown check"):
        C.run_calibration(["no_such_check"], aurora=object())
    with pytest.raises(ValueError, match="fp32 and/or bf16"):
        C.run_calibration(["ffn"], ["bf16-weights"], aurora=object())


# --------------------------------------------------------------------------------------------
# end to end on one real Aurora check


@pytest.fixture(scope="module")
def aurora():
    from pytest_npu_parity.aurora import checks, factory, inputs

    return checks.build_context(factory.get_model("full"), inputs.make_batch())


def test_end_to_end_split_k_passes_and_a_scaled_weight_fails(aurora):
    by_name = {s.name: s for s in C.SCENARIOS}
    report = C.run_calibration(["ffn"], ["fp32", "bf16"], aurora=aurora,
                               scenarios=[by_name["split_k"], by_name["weight_x(1+1e-3)"], by_name["thread_count"]])
    cases = {(c.recipe, c.scenario): c for c in report.cases}
    assert report.golden["fp32"]["ffn"]["golden_dtype"] == "float64"
    assert 0 < report.golden["fp32"]["ffn"]["reference_rel_l2"] < 1e-6
    split = cases[("fp32", "split_k")]
    assert split.status == "judged" and split.verdicts["golden"] == "pass" and split.verdicts["allclose"] == "pass"
    fault = cases[("fp32", "weight_x(1+1e-3)")]
    assert fault.verdicts["golden"] == "fail" and fault.verdicts["allclose"] == "fail" and fault.resolvable
    assert cases[("bf16", "split_k")].verdicts["golden"] == "pass"
    assert all(c.status in ("judged", "no effect") for c in report.cases)
    assert report.to_markdown().count("\n| ffn |") == 1


def test_aurora_golden_shim_computes_the_timestep_embedding_in_float64():
    from aurora.flow_loss import TimestepEmbedder

    t = torch.tensor([0.0, 125.0, 980.0])
    upstream = TimestepEmbedder.timestep_embedding(t, 7)  # odd dim: zero column appended
    with C.aurora_golden_shims(torch.float64):
        golden = TimestepEmbedder.timestep_embedding(t.double(), 7)
    assert golden.dtype == torch.float64 and golden.shape == upstream.shape == (3, 7)
    assert torch.allclose(golden.float(), upstream, rtol=0, atol=1e-4)  # fp32 phases of t up to 980
    assert torch.equal(golden[:, -1], torch.zeros(3, dtype=torch.float64))
    assert torch.equal(golden[0, :3], torch.ones(3, dtype=torch.float64))  # cos(0)
    assert TimestepEmbedder.timestep_embedding(t, 7).dtype == torch.float32  # restored
    with C.aurora_golden_shims(torch.float32):
        assert TimestepEmbedder.timestep_embedding(t, 7).dtype == torch.float32  # fp32 golden: upstream


def test_fault_weight_follows_the_catalogue_choice():
    layer = torch.nn.Linear(3, 3)
    sc = C.ScenarioContext(check=type("Check", (), {"name": "demo", "fault_weight": "bias"})(), aurora=None,
                           fn=layer, module=layer, recipe="fp32")
    assert C.fault_weight(sc) == "bias"


def test_child_process_variants_are_declared_with_their_environment(monkeypatch):
    by_name = {s.name: s for s in C.SCENARIOS}
    kernel, release = by_name["cpu_kernel_path"], by_name["torch_release"]
    assert kernel.kind == release.kind == "variant"
    assert dict(kernel.env) == {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    monkeypatch.delenv(C.OTHER_PYTHON_ENV, raising=False)
    assert C.OTHER_PYTHON_ENV in release.unavailable()
    monkeypatch.setenv(C.OTHER_PYTHON_ENV, "/nonexistent/python")
    assert "not an executable" in release.unavailable()
    monkeypatch.setenv(C.OTHER_PYTHON_ENV, __import__("sys").executable)
    assert release.unavailable() is None and release.python() == __import__("sys").executable


def test_child_targets_reports_a_failing_child(monkeypatch):
    scenario = C.Scenario("broken", "variant", "a child that cannot start", C._nothing,
                          env=(("X", "1"),), python=lambda: "/bin/false")
    with pytest.raises(RuntimeError, match="calibration child for broken failed"):
        C.child_targets(scenario, ["decoder_layer_0"], ["fp32"], 0)

"""checks/settings.py: one resolver, default < ini recipe < ini check pattern < marker < call, each spec parsed once."""
from __future__ import annotations

import pytest
import torch

from pytest_npu_parity.checks import settings as S
from pytest_npu_parity.layers import LayerPolicy
from pytest_npu_parity.policy import default_for_recipe
from pytest_npu_parity.runner import ParityCase, ParitySession

CPU = torch.device("cpu")


def test_tolerance_precedence_default_recipe_check_marker_call():
    ini = S.IniSettings.from_specs(recipe_tolerances={"fp32": default_for_recipe("fp32").replace(rtol=1e-4)},
                                   check_tolerances={"attn_*": "atol=1e-3 # fused"})
    resolver = S.CheckSettings(ini)
    assert resolver.tolerance("bf16", "x") == default_for_recipe("bf16")
    assert resolver.tolerance("fp32", "x").rtol == 1e-4
    per_check = resolver.tolerance("fp32", "attn_q")
    assert (per_check.rtol, per_check.atol, per_check.source, per_check.reason) == (1e-4, 1e-3, "ini", "fused")
    assert resolver.patterns_used == {"attn_*"}
    marker = S.marker_tolerance({"rtol": 1e-2, "reason": "why"}, "fp32")
    assert resolver.tolerance("fp32", "attn_q", marker) is marker
    call = resolver.tolerance("fp32", "attn_q", marker, {"atol": 0.5, "reason": None})
    assert (call.rtol, call.atol, call.source, call.reason) == (1e-2, 0.5, "check", "why")


def test_ini_and_marker_specs_are_parsed_once(monkeypatch):
    session = ParitySession(CPU, reference="cpu", check_tolerances={"a*": "rtol=1e-3"},
                            check_policies={"a*": "golden rmse=3"})
    calls = []
    real_items, real_policy = S.parse_spec_items, S.parse_policy_spec
    monkeypatch.setattr(S, "parse_spec_items", lambda *a, **k: calls.append("tolerance") or real_items(*a, **k))
    monkeypatch.setattr(S, "parse_policy_spec", lambda *a, **k: calls.append(a[0]) or real_policy(*a, **k))
    case = ParityCase(session, "t::t", "fp32", marker_policy="golden max_rel=20")
    for _ in range(3):
        assert session.tolerance("fp32", "ab").rtol == 1e-3
        assert case._settings().verdict_policy("ab", None).max_rel_ratio == 20
        assert session.verdict_policy("fp32", "ab").rmse_ratio == 3
    assert "tolerance" not in calls  # parsed when the session was built
    assert calls.count("golden max_rel=20") == 1 and calls.count("golden rmse=3") == 1


def test_layers_audit_budget_and_train_store_follow_the_same_order():
    session = ParitySession(CPU, reference="cpu", layers="2e-5", audit_budget="h2d=1", train_store="summary")
    resolver = session.settings
    assert resolver.layer_policy("fp32").limit == 2e-5 and resolver.layer_policy("bf16") is None
    case = ParityCase(session, "t::t", "bf16", marker_layers=1e-2, audit_budget="d2h=2", marker_train_store="full",
                      audit_mode="warn")
    assert case._settings().layer_policy("c", None).limit == 1e-2 and case._settings().layer_policy("c", False) is None
    assert isinstance(case._settings().layer_policy("c", "3e-3"), LayerPolicy)
    budget = case._settings().audit_budget("c", "cpu_fallback=1")
    assert (budget.allowed["h2d"], budget.allowed["d2h"], budget.allowed["cpu_fallback"]) == (1, 2, 1)
    assert resolver.train_store(case.marker).mode == "full" and resolver.train_store().mode == "summary"
    assert resolver.train_store(case.marker, "summary samples=8").samples == 8
    assert case._settings().audit_mode() == "off"  # no audit factory: nothing is audited
    assert S.audit_mode("record", case.marker, auditable=True) == "warn"


def test_settings_object_or_keywords_not_both():
    ini = S.IniSettings.from_specs(check_policies={"x": "allclose"})
    assert ParitySession(CPU, reference="cpu", settings=ini).check_policies == {"x": "allclose"}
    with pytest.raises(TypeError, match="not both"):
        ParitySession(CPU, reference="cpu", settings=ini, check_policies={"y": "allclose"})

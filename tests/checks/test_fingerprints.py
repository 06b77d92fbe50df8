"""checks.fingerprints: what a baseline records beyond tensors, weights and structure — non-tensor
arguments, module state outside the state_dict, a function's code and closure — so that changing one is
a stale baseline naming it, never a parity verdict; a real fault on the target still fails."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools

import pytest
import torch

from pytest_npu_parity.baselines import StaleBaselineError, SuiteStores
from pytest_npu_parity.checks.fingerprints import (argument_record, check_fingerprints, fingerprint_changes,
                                                   function_record, module_attributes)
from pytest_npu_parity.checks.reference import StaleSuite, stale_cause, stale_suites
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession

CPU = torch.device("cpu")
TEST_ID = "parity_suites/demo/test_m.py::t[fp32]"
X = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))


class Net(torch.nn.Module):
    """A Linear whose output goes through a non-persistent buffer, a tensor attribute, a private and a
    public scalar attribute: each changes what ``forward`` computes without changing the state_dict."""

    def __init__(self, eps: float = 1e-5, scale: float = 0.5) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(8, 8, generator=g) / 3)
            self.lin.bias.copy_(torch.randn(8, generator=g) / 3)
        self.register_buffer("shift", torch.linspace(-1, 1, 8), persistent=False)
        self.mask = torch.tril(torch.ones(8, 8))
        self.eps = eps
        self._scale = scale

    def forward(self, x, scale=1.0, opts=None):
        out = (self.lin(x) @ self.mask + self.shift) * self._scale / (1 + self.eps)
        if opts is not None and opts.get("mode") == "neg":
            out = -out
        return out * scale


@dataclasses.dataclass
class Options:
    mode: str = "pos"
    weights: tuple = (1.0, 2.0)


def _store(tmp_path):
    return SuiteStores(tmp_path)


def _record(store, check):
    case = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    check(case)
    assert case.finish() == "created"


def _compare(store, check, patches=None):
    return check(ParityCase(ParitySession(CPU, store=store), TEST_ID, "fp32", patches=patches))


def _stale(store, check) -> StaleBaselineError:
    with pytest.raises(StaleBaselineError) as info:
        _compare(store, check)
    return info.value


def _linear_fault(factor: float = 1 + 1e-3):
    """A target-only patch set: every ``F.linear`` on the target scales its weight by ``factor``."""
    @contextlib.contextmanager
    def patches(device):
        original = torch.nn.functional.linear

        def faulty(input, weight, bias=None):
            return original(input, weight * factor, bias)
        torch.nn.functional.linear = faulty
        try:
            yield
        finally:
            torch.nn.functional.linear = original
    return patches


# -- 1. non-tensor arguments ---------------------------------------------------------------------

@pytest.mark.parametrize("recorded, changed, named", [
    (dict(scale=2.0), dict(scale=3.0), "argument 'scale' changed (2.0 → 3.0)"),
    (dict(opts={"mode": "pos"}), dict(opts={"mode": "neg"}), "argument \"opts['mode']\" changed ('pos' → 'neg')"),
    (dict(opts=None), dict(opts={"mode": "pos"}), "argument 'opts' changed (gone, was None)"),
])
def test_a_changed_keyword_argument_is_stale_naming_it(tmp_path, recorded, changed, named):
    store = _store(tmp_path)
    _record(store, lambda c: c.check("m", Net(), X, **recorded))
    same = _compare(store, lambda c: c.check("m", Net(), X, **recorded))
    assert same.status == "pass" and same.reference == "baseline"
    error = _stale(store, lambda c: c.check("m", Net(), X, **changed))
    assert named in str(error) and error.stale_cause == "arguments"
    assert "input hash changed" not in str(error)  # the tensors are the same


def test_a_changed_positional_argument_is_stale_naming_its_position(tmp_path):
    store = _store(tmp_path)
    _record(store, lambda c: c.check("m", Net(), X, 2.0))
    assert _compare(store, lambda c: c.check("m", Net(), X, 2.0)).status == "pass"
    error = _stale(store, lambda c: c.check("m", Net(), X, 3.0))
    assert "argument 'args[1]' changed (2.0 → 3.0)" in str(error)


def test_nested_arguments_dataclasses_strings_and_none_are_recorded_by_path():
    record = argument_record(((X, [1, "a", None], Options()), {"cfg": {"lr": 0.1, "dev": "npu:0"},
                                                               "device": torch.device("cpu")}))
    assert record == {"args[0]": "<tensor>", "args[1][0]": 1, "args[1][1]": "a", "args[1][2]": None,
                      "args[2].mode": "pos", "args[2].weights[0]": 1.0, "args[2].weights[1]": 2.0,
                      "cfg['dev']": "<device>", "cfg['lr']": 0.1, "device": "<device>"}
    now = argument_record(((X, [1, "a", None], Options(weights=(1.0, 2.5))), {"cfg": {"lr": 0.1}}))
    lines = [line for _, line in fingerprint_changes({"format": 1, "arguments": record},
                                                     {"format": 1, "arguments": now})]
    assert lines == ["argument 'args[2].weights[1]' changed (2.0 → 2.5)",
                     "argument \"cfg['dev']\" changed (gone, was '<device>')",
                     "argument 'device' changed (gone, was '<device>')"]


def test_the_target_device_is_no_argument_change():
    # a test passing its device computes the same on either side: devices and device strings are "<device>"
    a = argument_record(((X,), {"device": torch.device("cpu"), "where": "cpu"}))
    b = argument_record(((X,), {"device": torch.device("meta"), "where": "npu:1"}))
    assert a == b


# -- 2. module state outside the state_dict --------------------------------------------------------

def _with(**edits):
    def build():
        net = Net()
        for name, edit in edits.items():
            edit(net)
        return net
    return build


@pytest.mark.parametrize("edit, named, cause", [
    (lambda n: n.shift.mul_(2), "module attribute 'shift' changed (its values", "attributes"),  # non-persistent
    (lambda n: setattr(n, "mask", torch.ones(8, 8)), "module attribute 'mask' changed (its values", "attributes"),
    (lambda n: setattr(n, "_scale", 0.25), "module attribute '_scale' changed (0.5 → 0.25)", "attributes"),
    (lambda n: setattr(n, "eps", 1e-6), "'<Net>': eps 1e-05 → 1e-06", "config"),  # public: the structure's
])
def test_changed_module_state_outside_the_state_dict_is_stale_naming_it(tmp_path, edit, named, cause):
    store = _store(tmp_path)
    _record(store, lambda c: c.check("m", Net(), X))
    assert _compare(store, lambda c: c.check("m", Net(), X)).status == "pass"
    changed = _with(e=edit)()
    assert changed.state_dict().keys() == Net().state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(changed.state_dict().values(), Net().state_dict().values()))
    error = _stale(store, lambda c: c.check("m", changed, X))
    assert named in str(error) and error.stale_cause == cause


def test_a_tensor_attribute_drawn_by_another_machine_is_the_same_attribute():
    net = Net()
    net.proj = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    recorded = check_fingerprints(net, ((X,), {}))
    other = copy.deepcopy(net)
    step = other.proj.abs().max() * torch.finfo(torch.float32).eps * 3  # last bits, as another kernel path
    other.proj.view(-1)[::2] += step
    assert fingerprint_changes(recorded, check_fingerprints(other, ((X,), {}))) == []
    other.proj.mul_(1 + 1e-3)  # a real edit
    ((kind, line),) = fingerprint_changes(recorded, check_fingerprints(other, ((X,), {})))
    assert kind == "attributes" and line.startswith("module attribute 'proj' changed (its values: sum of squares")


def test_module_attributes_leave_out_weights_library_bookkeeping_and_public_scalars():
    net = Net()
    net._is_hf_initialized = True  # transformers marks every module it initialized
    net.alias = net.lin.weight  # a parameter: the weights' business
    record = module_attributes(net)
    assert sorted(record) == ["_scale", "mask", "shift"]
    assert record["mask"]["layout"] == "float32|[8, 8]"
    assert module_attributes(torch.nn.MultiheadAttention(8, 2)) == {}  # torch's own privates are internals


def test_attributes_are_the_same_after_a_move_and_in_a_copy():
    net = Net()
    before = module_attributes(net)
    assert module_attributes(copy.deepcopy(net)) == before
    if torch.cuda.is_available():
        assert module_attributes(copy.deepcopy(net).cuda()) == before


# -- 3. a function's code, defaults and closure -------------------------------------------------

def _scaled(model, k):
    def f(x):
        return model(x) * k
    return f


def _with_default(model, k):
    def f(x, k=k):
        return model(x) * k
    return f


@pytest.mark.parametrize("build, named", [
    (_scaled, "function closure 'k' changed (2.0 → 3.0)"),
    (_with_default, "function default argument 'k' changed (2.0 → 3.0)"),
    (lambda model, k: functools.partial(Net.forward, model, scale=k), "function partial 'scale' changed (2.0 → 3.0)"),
])
def test_a_function_whose_closed_over_values_changed_is_stale_naming_them(tmp_path, build, named):
    store = _store(tmp_path)
    model = Net()
    _record(store, lambda c: c.check("f", build(model, 2.0), X))
    assert _compare(store, lambda c: c.check("f", build(model, 2.0), X)).status == "pass"
    error = _stale(store, lambda c: c.check("f", build(model, 3.0), X))
    assert named in str(error) and error.stale_cause == "function"


def test_a_lambda_with_another_body_or_constant_is_stale(tmp_path):
    store = _store(tmp_path)
    model = Net()
    _record(store, lambda c: c.check("f", lambda x: model(x) * 2.0, X))
    assert _compare(store, lambda c: c.check("f", lambda x: model(x) * 2.0, X)).status == "pass"
    error = _stale(store, lambda c: c.check("f", lambda x: model(x) * 3.0, X))
    assert "function constants changed ([2.0] → [3.0])" in str(error)
    error = _stale(store, lambda c: c.check("f", lambda x: model(x).tanh() * 2.0, X))
    assert "function code changed" in str(error)


def test_a_closed_over_module_is_recorded_by_structure_and_attributes_not_weights():
    model = Net()
    record = function_record(_scaled(model, 2.0))
    assert record["closure:k"] == 2.0 and record["closure:model"].startswith("Net ")
    assert "closure:model.mask" in record and "closure:model._scale" in record
    retrained = copy.deepcopy(model)
    with torch.no_grad():
        retrained.lin.weight.mul_(1.5)  # the weights of a closed-over module are not fingerprinted (a limit)
    assert function_record(_scaled(retrained, 2.0)) == record
    retrained.mask = torch.ones(8, 8)
    changed = fingerprint_changes({"format": 1, "function": record},
                                  {"format": 1, "function": function_record(_scaled(retrained, 2.0))})
    assert [kind for kind, _ in changed] == ["function"] and "'model.mask' changed" in changed[0][1]


def test_code_recorded_by_another_python_is_not_compared_but_its_closure_is():
    record = function_record(_scaled(Net(), 2.0))
    other_python = dict(record, python="2.7", code="0" * 32, constants=["x"])
    assert fingerprint_changes({"format": 1, "function": other_python}, {"format": 1, "function": record}) == []
    other_python["closure:k"] = 3.0
    assert [line for _, line in fingerprint_changes({"format": 1, "function": other_python},
                                                    {"format": 1, "function": record})] == [
        "function closure 'k' changed (3.0 → 2.0)"]


# -- 4. lazy modules ---------------------------------------------------------------------------------

def _lazy(out_features: int = 4) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.LazyLinear(out_features), torch.nn.Tanh())


def test_a_lazy_module_records_and_compares(tmp_path):
    store = _store(tmp_path)
    _record(store, lambda c: c.check("lazy", _lazy(), X))
    entry = store.load(TEST_ID).checks["lazy"]
    assert "lazy module" in entry.meta["replay"]["weights"]  # its weights are drawn in the check's run
    same = _compare(store, lambda c: c.check("lazy", _lazy(), X))
    assert same.status == "pass" and same.reference == "baseline"
    error = _stale(store, lambda c: c.check("lazy", _lazy(5), X))
    assert "out_features 4 → 5" in str(error)
    with pytest.raises(ParityError, match="Parity check 'lazy' failed"):
        _compare(store, lambda c: c.check("lazy", _lazy(), X), patches=_linear_fault())


# -- a real fault is still judged -------------------------------------------------------------------

@pytest.mark.parametrize("check", [
    lambda c: c.check("m", Net(), X, scale=2.0, opts={"mode": "neg"}),
    lambda c: c.check("f", _scaled(Net(), 2.0), X),
])
def test_a_real_fault_on_the_target_still_fails_against_a_fresh_baseline(tmp_path, check):
    store = _store(tmp_path)
    _record(store, check)
    assert _compare(store, check).status == "pass"
    with pytest.raises(ParityError, match="failed"):
        _compare(store, check, patches=_linear_fault())


def test_an_entry_recorded_before_the_fingerprints_makes_no_claim(tmp_path):
    store = _store(tmp_path)
    case = ParityCase(ParitySession(CPU, update_baselines=True, store=store), TEST_ID, "fp32")
    case.check("m", Net(), X, scale=2.0)
    case._pending["m"].meta.pop("fingerprints")  # as written before the field existed
    assert case.finish() == "created"
    assert _compare(store, lambda c: c.check("m", Net(), X, scale=2.0)).status == "pass"
    with pytest.raises(ParityError):  # judged as before: nothing was recorded to say it changed
        _compare(store, lambda c: c.check("m", Net(), X, scale=3.0))


def test_an_unknown_record_format_is_not_compared():
    assert fingerprint_changes({"format": 99, "arguments": {"a": 1}}, {"format": 1, "arguments": {"a": 2}}) == []
    assert fingerprint_changes(None, check_fingerprints(Net(), ((X,), {}))) == []


# -- 5. stale causes and the suite-wide header ---------------------------------------------------------

def test_an_input_whose_summary_agrees_is_no_stale_cause():
    meta = {"config_hash": "w", "input_hash": "i"}
    now = {"config_hash": "v", "input_hash": "j"}
    assert stale_cause(meta, now) == "weights+input"  # the hashes alone (callers without the flag)
    assert stale_cause(meta, now, input_changed=False) == "weights"  # other draws: not a change
    assert stale_cause(meta, dict(now, config_hash="w"), True, input_changed=False,
                       kinds=("function", "arguments")) == "config+arguments+function"


def _row(test, cause, weights="ab12"):
    return {"test_id": f"parity_suites/demo/test_m.py::{test}", "check": test, "recipe": "fp32",
            "reference": "baseline", "weights": weights, "baseline_error": "stale", "stale_cause": cause}


def test_separate_edits_on_another_machine_share_no_cause():
    # every input hash differs on another machine (its draws), the summaries agree: no "input" cause, so a
    # weights edit of one check and a configuration edit of another are not "the inputs changed"
    assert stale_suites([_row("a", "weights"), _row("b", "config"), _row("c", "attributes")]) == []


def test_the_suite_header_names_the_causes_some_checks_have_besides_the_shared_one():
    (suite,) = stale_suites([_row("a", "weights"), _row("b", "weights+input"), _row("c", "weights+arguments"),
                             _row("f", "function", weights=None)])
    assert isinstance(suite, StaleSuite) and suite.cause == "weights"
    assert suite.other_causes() == {"arguments": 1, "function": 1}  # input beside the weights: their consequence
    key = ("parity_suites/demo/test_m.py::f", "f", "fp32")
    assert suite.extra_causes(key) == {"function"}


def test_a_part_that_cannot_be_described_is_named_and_not_compared(tmp_path, monkeypatch):
    import pytest_npu_parity.checks.fingerprints as fingerprints

    def broken(module, state_dict=None):
        raise RuntimeError("no attributes today")
    monkeypatch.setattr(fingerprints, "module_attributes", broken)
    record = check_fingerprints(Net(), ((X,), {"scale": 2.0}))
    assert record["unavailable"] == {"attributes": "RuntimeError: no attributes today"}
    assert record["arguments"] == {"args[0]": "<tensor>", "scale": 2.0}
    store = _store(tmp_path)
    _record(store, lambda c: c.check("m", Net(), X, scale=2.0))  # the check records all the same
    monkeypatch.undo()
    changed = Net()
    changed.mask = torch.ones(8, 8)
    with pytest.raises(ParityError):  # the attributes were not recorded: judged, as before the field existed
        _compare(store, lambda c: c.check("m", changed, X, scale=2.0))
    assert "scale" in str(_stale(store, lambda c: c.check("m", Net(), X, scale=3.0)))  # the arguments still are


def test_a_live_reference_is_not_reused_after_the_module_attribute_changed():
    session = ParitySession(CPU, reference="cpu")
    net = Net()
    assert ParityCase(session, "t", "fp32").check("m", net, X).status == "pass"
    net.mask = torch.ones(8, 8)  # the same module object, another computation
    assert ParityCase(session, "t", "fp32").check("m", net, X).status == "pass"
    assert len(session._reference_memo) == 2


def test_check_hashes_takes_the_modules_state_dict_once(monkeypatch):
    from pytest_npu_parity.checks.reference import check_hashes

    net, calls = Net(), []
    real = torch.nn.Module.state_dict
    monkeypatch.setattr(torch.nn.Module, "state_dict", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    hashes = check_hashes(net, (X,), {})
    assert [c for c in calls if c is net] == [net]  # the fingerprint, the lazy check and the attributes share it
    monkeypatch.setattr(torch.nn.Module, "state_dict", real)
    assert hashes["config_hash"] == check_hashes(Net(), (X,), {})["config_hash"]
    assert hashes["fingerprints"] == check_hashes(Net(), (X,), {})["fingerprints"]


def test_module_attributes_leave_out_a_plain_tensor_in_a_parameter_slot_that_the_state_dict_drops():
    # torch.func.functional_call and parametrizations put plain tensors into ``_parameters``; a state_dict
    # hook may drop them from the state_dict. Such a tensor, also held as an attribute, is still a
    # weight: not recorded as module state outside the state_dict.
    net = Net()
    plain = torch.ones(3, 4)
    net.lin._parameters["weight"] = plain
    net.alias = plain

    def drop(module, state, prefix, meta):
        del state[prefix + "weight"]

    net.lin._register_state_dict_hook(drop)
    assert "lin.weight" not in net.state_dict(keep_vars=True)
    record = module_attributes(net)
    assert "alias" not in record
    assert sorted(record) == ["_scale", "mask", "shift"]


def test_a_generator_argument_or_attribute_is_recorded_by_its_state():
    def gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    record = argument_record(((X,), {"generator": gen(3)}))
    assert record == argument_record(((X,), {"generator": gen(3)}))
    lines = [line for _, line in fingerprint_changes({"format": 1, "arguments": record},
                                                     {"format": 1, "arguments": argument_record(((X,), {"generator": gen(4)}))})]
    assert len(lines) == 1 and lines[0].startswith("argument 'generator' changed ('<generator ")
    net = torch.nn.Linear(2, 2)
    net.gen = gen(3)
    attributes = module_attributes(net)
    assert attributes["gen"].startswith("<generator ")
    net.gen = gen(4)
    assert module_attributes(net)["gen"] != attributes["gen"]

"""First-divergence localization on small seeded models: which call, local vs inherited, the table.

Faults are injected on the target side only, through the case's patch factory, as a port bug would
be: a scaled weight (the divergence starts in that Linear), a change in a module's own code outside
its submodules, a fault in training mode with dropout (the shared random stream must replay exactly
for local re-runs), and in a train step.
"""
from __future__ import annotations

import contextlib
import json

import pytest
import torch

from pytest_npu_parity.baselines import BaselineStore
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.localize import Localization, Localizer, _Recorder, failure_hook, localize, output_leaves
from pytest_npu_parity.selfcheck import scaled_parameter
from pytest_npu_parity.runner import ParityCase, ParitySession


class Block(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(0.3)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.drop(self.a(x))))


class Net(torch.nn.Module):
    def __init__(self, depth: int = 4, width: int = 8):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def rollout(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        """A generate-like method: the model's forward called several times."""
        outs = []
        for _ in range(steps):
            y = self(x)
            outs.append(y)
            x = x + y.sum(-1, keepdim=True)
        return torch.stack(outs)


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def _session(**kwargs) -> ParitySession:
    # Localization judges by allclose; training checks would default to the golden floor (no localization).
    kwargs.setdefault("recipe_policies", {"fp32": "allclose", "bf16": "allclose"})
    return ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[failure_hook], **kwargs)


def _scaled(module: torch.nn.Module, name: str, factor: float = 1.001):
    """A patch factory scaling parameter ``name`` of ``module`` on the target side."""
    return lambda device: scaled_parameter(module, name, factor)


def _own_code_fault(index: int):
    """Block ``index`` scales its result in its own forward (none of its children changes)."""
    @contextlib.contextmanager
    def patch(device):
        original = Block.forward

        def forward(self, x):
            y = original(self, x)
            return y * 1.001 if getattr(self, "index", None) == index else y
        Block.forward = forward
        try:
            yield
        finally:
            Block.forward = original
    return patch


def _fail(case: ParityCase, *args, **kwargs) -> tuple[str, dict]:
    with pytest.raises(ParityError) as info:
        case.check(*args, **kwargs)
    return str(info.value), case.records[-1].extra


def _first(extra: dict) -> dict:
    rows = [r for r in extra["localization"] if r.get("first_divergence")]
    assert len(rows) == 1, extra["localization"]
    return rows[0]


def test_scaled_weight_is_the_first_divergence_with_local_error(net, x):
    case = ParityCase(_session(), "t::scaled", patches=_scaled(net, "blocks.2.b.weight"))
    message, extra = _fail(case, "net", net, x)
    assert "First divergence: blocks.2.b (Linear)" in message
    first = _first(extra)
    assert first["submodule"] == "blocks.2.b" and first["verdict"] == "local"
    assert first["local_err_ratio"] > 1 >= first["inherited_err_ratio"]
    assert first["local_rel_l2"] > first["inherited_rel_l2"]
    rows = {r["submodule"]: r for r in extra["localization"]}
    assert rows["blocks.1"]["verdict"] == "ok"  # the call before it still agrees
    assert rows["blocks.2"]["verdict"] == "local"  # its parent contains the fault
    assert rows["blocks.3"]["verdict"] == "inherited"  # later calls only inherit the error
    assert rows["blocks.3"]["inherited_err_ratio"] > 1 >= rows["blocks.3"]["local_err_ratio"]
    json.dumps(extra["localization"])  # JSON-able for the report
    # The failure table is in the message, below the usual comparison table.
    assert message.index("Greatest absolute difference") < message.index("LOCAL <- first divergence")


def test_fault_in_a_modules_own_code_names_that_module(net, x):
    for i, block in enumerate(net.blocks):
        block.index = i
    case = ParityCase(_session(), "t::own", patches=_own_code_fault(1))
    message, extra = _fail(case, "net", net, x)
    assert "First divergence: blocks.1 (Block), in its own code outside its submodules" in message
    first = _first(extra)
    assert first["submodule"] == "blocks.1" and first["local_err_ratio"] > 1


def test_training_mode_replays_dropout_for_local_reruns(net, x):
    net.train()  # dropout draws from the shared stream; a local re-run must see the same mask
    case = ParityCase(_session(), "t::train", patches=_scaled(net, "blocks.1.b.weight"))
    _, extra = _fail(case, "net", net, x)
    rows = {r["submodule"]: r for r in extra["localization"]}
    assert _first(extra)["submodule"] == "blocks.1.b"
    # blocks.2 runs dropout on inherited inputs: exactly zero local error means the mask replayed.
    assert rows["blocks.2"]["verdict"] == "inherited" and rows["blocks.2"]["local_max_abs"] == 0.0


def test_bound_method_names_repeated_calls(net, x):
    case = ParityCase(_session(), "t::rollout", patches=_scaled(net, "head.weight"))
    message, extra = _fail(case, "rollout", net.rollout, x)
    first = _first(extra)
    assert first["submodule"] == "head"  # inside the first forward call, <module>#0
    paths = [r["submodule"] for r in extra["localization"]]
    assert "<Net>#0" in paths  # the model's forward ran three times: calls are numbered
    assert "Localized against a live CPU run" in message


def test_baseline_reference_is_localized_against_a_live_cpu_run(net, x, tmp_path):
    store = BaselineStore(tmp_path, "toy")
    recorder = ParitySession(torch.device("cpu"), reference="cpu", update_baselines=True, store=store)
    case = ParityCase(recorder, "tests/test_toy.py::test_net")
    case.check("net", net, x)
    assert case.finish() == "created"
    session = ParitySession(torch.device("cpu"), reference="baseline", store=store, failure_hooks=[failure_hook])
    case = ParityCase(session, "tests/test_toy.py::test_net", patches=_scaled(net, "blocks.0.a.weight"))
    message, extra = _fail(case, "net", net, x)
    assert "Localized against a live CPU run (the check's reference was baseline" in message
    assert _first(extra)["submodule"] == "blocks.0.a"
    assert all("baseline" in row["reference"] for row in extra["localization"])
    assert "agrees with a live CPU run" not in message  # the target's fault: the live run disagrees with it too


def test_code_changed_since_the_baseline_is_named_as_the_baselines_difference(net, x, tmp_path, monkeypatch):
    store = BaselineStore(tmp_path, "toy")
    case = ParityCase(ParitySession(torch.device("cpu"), reference="cpu", update_baselines=True, store=store),
                      "tests/test_toy.py::test_net")
    case.check("net", net, x)
    assert case.finish() == "created"
    # the model's code changes after recording (no fingerprint covers a forward): both sides compute the new code
    original = Block.forward
    monkeypatch.setattr(Block, "forward", lambda self, x: original(self, x) * 1.01)
    session = ParitySession(torch.device("cpu"), reference="baseline", store=store, failure_hooks=[failure_hook])
    message, _ = _fail(ParityCase(session, "tests/test_toy.py::test_net"), "net", net, x)
    assert "The target agrees with a live CPU run of the same computation" in message
    assert "it is the baseline that differs" in message
    assert "re-record: pytest --update-baselines tests/test_toy.py::test_net" in message


def test_train_step_orders_gradients_by_backward_order(net, x):
    for i, block in enumerate(net.blocks):
        block.index = i
    case = ParityCase(_session(), "t::step", patches=_own_code_fault(2))
    with pytest.raises(ParityError) as info:
        case.train_step("step", net, {"x": x}, loss_fn=lambda out: out.square().mean())
    message, extra = str(info.value), case.records[-1].extra
    assert "First divergence: blocks.2 (Block), in its own code" in message
    grads = [r for r in extra["localization"] if r["kind"] == "gradient"]
    first = [r for r in grads if r["first_divergence"]]
    # Backward reaches the head first: its gradient is the first one computed, and out of tolerance.
    assert first and first[0]["leaf"] == "grad.head.bias"
    assert "Gradients in backward order" in message


def test_function_check_gets_no_localization():
    @contextlib.contextmanager
    def wrong(device):
        original = torch.nn.functional.gelu
        torch.nn.functional.gelu = lambda t, **kw: original(t, **kw) * 1.001
        try:
            yield
        finally:
            torch.nn.functional.gelu = original
    case = ParityCase(_session(), "t::fn", patches=wrong)
    message, extra = _fail(case, "gelu", lambda t: torch.nn.functional.gelu(t), torch.linspace(-2, 2, 9))
    assert "First divergence" not in message and "localization" not in extra


def test_no_hooks_stay_behind_and_passing_checks_never_localize(net, x):
    calls = []

    def counting(*args):
        calls.append(args)
        return failure_hook(*args)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[counting])
    ParityCase(session, "t::clean").check("net", net, x)  # passes
    assert calls == []
    with pytest.raises(ParityError):
        ParityCase(session, "t::bad", patches=_scaled(net, "head.weight")).check("net", net, x)
    assert len(calls) == 1
    for module in net.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_a_broken_failure_hook_never_hides_the_failure(net, x):
    def broken(*args):
        raise RuntimeError("diagnosis exploded")
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[broken])
    message, _ = _fail(ParityCase(session, "t::broken", patches=_scaled(net, "head.weight")), "net", net, x)
    assert "Mismatched elements" in message and "broken could not run: RuntimeError: diagnosis exploded" in message


def test_recorder_keeps_only_the_calls_of_its_scope(net, x):
    with _Recorder(net, ("", 0), "cpu", depth=1) as recorder, torch.no_grad():
        net(x)
    assert [c.name for c in recorder.calls] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert recorder.done == 1 + 4 * 4 + 1  # every call was seen (for ordering), few were kept
    with _Recorder(net, ("blocks.1", 0), "cpu", depth=1) as recorder, torch.no_grad():
        net(x)
    assert [c.name for c in recorder.calls] == ["blocks.1.a", "blocks.1.drop", "blocks.1.b"]
    assert all(c.inputs is not None and c.output for c in recorder.calls)


def test_recorder_records_two_levels_so_the_next_level_needs_no_pass(net, x):
    with _Recorder(net, ("", 0), "cpu") as recorder, torch.no_grad():
        net(x)
    assert len(recorder.calls) == 4 * 4 + 1  # blocks and head, and every call inside a block
    assert [c.name for c in recorder.view(("", 0)).calls] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert [c.name for c in recorder.view(("blocks.2", 0)).calls] == ["blocks.2.a", "blocks.2.drop", "blocks.2.b"]
    block = recorder.view(("", 0)).calls[2]
    recorder.release(block)  # what the next level needs stays, the rest goes
    assert all((c.output is not None) == (c is block or c.parent == block.key) for c in recorder.calls)


def test_a_whole_model_descent_makes_one_pass_per_two_levels(net, x):
    case = ParityCase(_session(), "t::passes", patches=_scaled(net, "blocks.2.b.weight"))
    message, _ = _fail(case, "net", net, x)
    assert "2 level(s) in 1 pass(es)" in message  # blocks.2, then its Linear, from the first pass


def test_output_leaves_walks_tuples_and_mappings():
    t = torch.ones(2)
    leaves = output_leaves((t, None, {"a": t, "n": 3}, [t]))
    assert sorted(leaves) == ["[0]", "[2].a", "[3][0]"]
    assert leaves["[0]"] is not t  # a copy: later in-place edits of the activation do not leak in


def test_localization_summary_without_any_local_divergence():
    loc = Localization(check="c", reference="a live CPU run", own_code="<Net>")
    assert "starts in <Net> itself" in loc.summary()
    assert loc.to_rows() == []


def test_localize_returns_none_for_functions():
    class Call:
        module = None
    assert localize(None, None, Call(), None) is None


class Gated(torch.nn.Module):
    """Runs an extra layer when ``gate`` is set: control flow that differs between the sides."""

    gate = False

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.extra = torch.nn.Linear(8, 8)
        self.last = torch.nn.Linear(8, 3)

    def forward(self, x):
        x = self.first(x)
        if self.gate:
            x = self.extra(x)
        return self.last(x)


def test_calls_made_on_one_side_only_are_named(x):
    torch.manual_seed(0)
    model = Gated().eval()

    @contextlib.contextmanager
    def open_gate(device):
        Gated.gate = True
        try:
            yield
        finally:
            Gated.gate = False
    message, extra = _fail(ParityCase(_session(), "t::gated", patches=open_gate), "gated", model, x)
    assert "Note: called on the target side only: extra" in message
    rows = {r["submodule"]: r for r in extra["localization"]}
    assert rows["first"]["verdict"] == "ok" and rows["last"]["verdict"] == "inherited"
    assert "starts in <Gated> itself" in message  # the gate is Gated's own code


class Noting(torch.nn.Module):
    """A submodule whose output holds no tensor (it only looks at its input)."""

    def forward(self, x):
        return None


class NotingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.note = Noting()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x):
        self.note(x)
        return self.lin(x)


def test_a_call_with_nothing_to_compare_is_not_compared_never_ok(x):
    torch.manual_seed(0)
    model = NotingNet().eval()
    message, extra = _fail(ParityCase(_session(), "t::noting", patches=_scaled(model, "lin.weight")), "noting", model, x)
    rows = {r["submodule"]: r for r in extra["localization"]}
    assert rows["note"]["verdict"] == "not compared" and not rows["note"]["first_divergence"]
    assert rows["note"]["max_abs"] is None and rows["note"]["local_err_ratio"] is None
    assert _first(extra)["submodule"] == "lin"


def test_a_difference_summed_from_calls_each_within_tolerance_is_followed_into_them(x):
    # Activations of magnitude 1e-2 (no biases, x × 1e-2) read through a head scaled ×1e2: atol 1e-5
    # dominates the blocks' tolerance, rtol the head's. blocks.1.a × (1 + 5e-4) moves each call's
    # output by less than its tolerance (blocks.1.a local err/tol 0.8) and the head's by 24×. The
    # first call whose own difference is of the model's size is followed (blocks.1, then its Linear
    # a), not the model's own code.
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.zero_()
        model.head.weight.mul_(1e2)
    x = x * 1e-2
    case = ParityCase(_session(), "t::summed", patches=_scaled(model, "blocks.1.a.weight", 1 + 5e-4))
    message, extra = _fail(case, "summed", model, x)
    assert "First divergence: blocks.1.a (Linear)" in message, message
    assert "no call inside the check's module is out of tolerance on its own" in message, message
    rows = {r["submodule"]: r for r in extra["localization"]}
    assert rows["blocks.1"]["verdict"] == "local" and rows["blocks.1"]["local_err_ratio"] < 1


# --------------------------------------------------------------------------------------------
# Localizer: sharing, budget, failures that are already explained


def _block_input(net: Net, x: torch.Tensor, index: int) -> torch.Tensor:
    """What block ``index`` receives in a clean eval forward of ``net`` (a suite's captured input)."""
    seen = []
    handle = net.blocks[index].register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    with torch.no_grad():
        net(x)
    handle.remove()
    return seen[0]


def _counting(module: torch.nn.Module) -> list:
    calls: list = []
    module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_a_submodule_check_is_answered_by_the_whole_model_localization(net, x):
    localizer = Localizer(budget_s=None)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[localizer])
    patch = _scaled(net, "blocks.2.b.weight")
    block_x = _block_input(net, x, 2)
    _, whole = _fail(ParityCase(session, "t::net", patches=patch), "net", net, x)
    assert _first(whole)["submodule"] == "blocks.2.b" and localizer.localized == 1
    calls = _counting(net.blocks[2].b)
    message, extra = _fail(ParityCase(session, "t::block", patches=patch), "block", net.blocks[2], block_x,
                           submodule="blocks.2")
    assert len(calls) == 2  # the check's own reference and target runs: the localization ran nothing
    assert localizer.reused == 1 and extra["localization_reused"] == "'net' (t::net)"
    assert "First divergence: blocks.2.b (Linear)" in message and "nothing re-run" in message
    # The shared answer is the one a localization of its own finds.
    _, alone = _fail(ParityCase(_session(), "t::alone", patches=patch), "block", net.blocks[2], block_x,
                     submodule="blocks.2")
    assert _first(extra)["submodule"] == _first(alone)["submodule"]
    assert _first(extra)["local_err_ratio"] == pytest.approx(_first(alone)["local_err_ratio"])


def test_other_inputs_weights_or_patch_sets_are_not_shared(net, x):
    localizer = Localizer(budget_s=None)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[localizer])
    block_x = _block_input(net, x, 2)
    _fail(ParityCase(session, "t::net", patches=_scaled(net, "blocks.2.b.weight")), "net", net, x)
    _, other_input = _fail(ParityCase(session, "t::in", patches=_scaled(net, "blocks.2.b.weight")), "block",
                           net.blocks[2], block_x * 1.5, submodule="blocks.2")
    _, other_fault = _fail(ParityCase(session, "t::fault", patches=_scaled(net, "blocks.2.a.weight")), "block",
                           net.blocks[2], block_x, submodule="blocks.2")
    assert "localization_reused" not in other_input and "localization_reused" not in other_fault
    assert _first(other_fault)["submodule"] == "blocks.2.a"
    assert localizer.localized == 3 and localizer.reused == 0


def test_a_spent_budget_skips_localization_and_names_the_command(net, x):
    hint = "pytest --npu-parity --parity-localize {test_id}"
    localizer = Localizer(budget_s=0, hint=hint)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[localizer])
    calls = _counting(net.head)
    message, extra = _fail(ParityCase(session, "t.py::test_net[fp32]", patches=_scaled(net, "head.weight")), "net",
                           net, x)
    assert len(calls) == 2  # the check's own runs only
    assert "localization" not in extra and extra["localization_skipped"] == "budget"
    assert "more than the 0 s left of this session's localization budget of 0 s" in message
    assert "pytest --npu-parity --parity-localize 't.py::test_net[fp32]'" in message
    assert localizer.skipped["budget"] == 1
    forced = Localizer(budget_s=0, forced=True)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[forced])
    _, extra = _fail(ParityCase(session, "t::forced", patches=_scaled(net, "head.weight")), "net", net, x)
    assert _first(extra)["submodule"] == "head"


class Outer(torch.nn.Module):
    """``Net`` one level deeper: its blocks' children are below what the first pass records."""

    def __init__(self, net: Net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


def test_a_descent_stops_between_passes_when_the_budget_runs_out(net, x, monkeypatch):
    import pytest_npu_parity.diagnose.localize.hook as localize_module

    monkeypatch.setattr(localize_module, "COST_FACTOR", 0.0)  # it may start; the budget ends after one pass
    localizer = Localizer(budget_s=1e-9)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[localizer])
    model = Outer(net).eval()
    message, extra = _fail(ParityCase(session, "t::outer", patches=_scaled(net, "blocks.2.b.weight")), "outer",
                           model, x)
    assert _first(extra)["submodule"] == "net.blocks.2"  # two levels from the first pass, not its Linear
    assert extra["localization_stopped"] == "budget"
    assert "the descent stopped at net.blocks.2" in message
    # Shared as far as it went: a check of the inner net (a scope of that descent) gets it for free.
    message, extra = _fail(ParityCase(session, "t::inner", patches=_scaled(net, "blocks.2.b.weight")), "inner",
                           net, x, submodule="net")
    assert extra["localization_reused"] == "'outer' (t::outer)" and extra["localization_stopped"] == "budget"
    assert _first(extra)["submodule"] == "net.blocks.2"


def test_a_localization_that_does_not_fit_the_budget_is_not_started(net, x):
    localizer = Localizer(budget_s=1e-9)  # nothing spent, but no check runs in a nanosecond
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[localizer])
    message, extra = _fail(ParityCase(session, "t::net", patches=_scaled(net, "head.weight")), "net", net, x)
    assert extra["localization_skipped"] == "budget" and "First-divergence localization skipped: it would take" in message


class Retyped(torch.nn.Module):
    """Returns float64 on the target side (a structure/dtype failure, not a numeric one)."""

    wrong = False

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x):
        y = self.lin(x)
        return y.double() if self.wrong else y


def test_a_dtype_mismatch_is_not_localized(x):
    torch.manual_seed(0)
    model = Retyped().eval()

    @contextlib.contextmanager
    def wrong(device):
        Retyped.wrong = True
        try:
            yield
        finally:
            Retyped.wrong = False
    localizer = Localizer(budget_s=None)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[localizer])
    calls = _counting(model.lin)
    message, extra = _fail(ParityCase(session, "t::dtype", patches=wrong), "retyped", model, x)
    assert len(calls) == 2
    assert extra["localization_skipped"] == "structure" and "localization" not in extra
    assert "localization not run: the outputs differ in structure, shape or dtype (<output>: dtype mismatch" in message


def test_localizer_refuses_a_bad_budget():
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="localization budget"):
            Localizer(budget_s=bad)


# --------------------------------------------------------------------------------------------
# models of one's own: nested tensors, buffers, the backward pass and the optimizer step


def _padded_encoder() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """nn.TransformerEncoder in eval with a padding mask: under no_grad its fast path hands nested
    tensors (no ``shape``) from layer to layer."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[1, 4:] = True
    mask[2, 2:] = True
    return encoder, x, mask


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_of_the_transformer_fast_path_are_localized_padded():
    encoder, x, mask = _padded_encoder()
    seen = []
    handle = encoder.layers[0].register_forward_hook(lambda _m, _a, out: seen.append(out.is_nested))
    with torch.no_grad():
        encoder(x, src_key_padding_mask=mask)
    handle.remove()
    assert seen == [True]  # the fast path is taken: the layers exchange nested tensors
    case = ParityCase(_session(), "t::nested", patches=_scaled(encoder, "layers.1.linear2.weight"))
    message, extra = _fail(case, "encoder", encoder, x, src_key_padding_mask=mask)
    assert "could not run" not in message
    assert "First divergence: layers.1.linear2 (Linear)" in message
    assert "compared as padded tensors (torch.nested.to_padded_tensor, padding 0): layers.0" in message
    rows = {r["submodule"]: r for r in extra["localization"]}
    assert rows["layers.0"]["verdict"] == "ok" and rows["layers.1"]["verdict"] == "local"


def test_output_leaves_pads_nested_and_densifies_sparse_tensors():
    nested = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(1, 3)])
    notes: dict = {}
    leaves = output_leaves((nested, torch.eye(3).to_sparse()), notes=notes, where="m")
    assert leaves["[0]"].shape == (2, 2, 3) and leaves["[0]"][1, 1].abs().sum() == 0  # padding is 0
    assert leaves["[1]"].layout == torch.strided and torch.equal(leaves["[1]"], torch.eye(3))
    assert notes == {"padded": {"m"}, "dense": {"m"}}


class BatchNormNet(torch.nn.Module):
    """A wrapper whose BatchNorm holds the only state a momentum change touches."""

    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x, labels):
        return torch.nn.functional.cross_entropy(self.head(self.features(x).mean((2, 3))), labels)


def _step_inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(4, 3, 6, 6, generator=g), "labels": torch.tensor([0, 1, 0, 1])}


@contextlib.contextmanager
def _patched(owner, name, make):
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def test_a_buffer_difference_names_the_module_owning_the_buffer():
    torch.manual_seed(0)
    model = BatchNormNet()

    def momentum(original):
        def forward(self, x):
            self.momentum = 0.2  # PyTorch's default is 0.1: running statistics move twice as far
            return original(self, x)
        return forward
    case = ParityCase(_session(), "t::bn", patches=lambda device: _patched(torch.nn.BatchNorm2d, "forward", momentum))
    with pytest.raises(ParityError) as info:
        case.train_step("step", model, _step_inputs())
    message, extra = str(info.value), case.records[-1].extra
    assert "First divergence: buffer.features.1.running_mean of features.1 (BatchNorm2d)" in message
    assert "<BatchNormNet> itself" not in message  # not the wrapper around it
    buffers = [r for r in extra["localization"] if r["kind"] == "buffer"]
    assert {r["leaf"] for r in buffers} == {"buffer.features.1.running_mean", "buffer.features.1.running_var"}
    assert all(r["submodule"] == "features.1" and r["module_type"] == "BatchNorm2d" for r in buffers)
    assert "Buffers out of tolerance, with the module that owns each:" in message


class _ScaledBackward(torch.autograd.Function):
    """Identity forward, gradient × (1 + 1e-3) backward: a port's wrong backward kernel."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.001


def test_a_backward_only_difference_names_the_first_gradient(net, x):
    def wrong_backward(original):
        def forward(self, t):
            y = original(self, t)
            return _ScaledBackward.apply(y) if self.out_features == 3 else y
        return forward
    case = ParityCase(_session(), "t::bwd", patches=lambda device: _patched(torch.nn.Linear, "forward", wrong_backward))
    with pytest.raises(ParityError) as info:
        # no clipping: clipping to norm 1 would undo a uniform scale of every gradient
        case.train_step("step", net.train(), {"x": x}, loss_fn=lambda out: out.square().mean(), max_grad_norm=None)
    message = str(info.value)
    assert "First divergence: gradient grad.head.bias" in message and "the backward pass differs" in message


def test_an_optimizer_only_difference_names_the_optimizer_step(net, x):
    def wrong_lr(original):
        def init(self, params, lr=1e-3, *args, **kwargs):
            original(self, params, lr * 2, *args, **kwargs)
        return init
    case = ParityCase(_session(), "t::opt", patches=lambda device: _patched(torch.optim.AdamW, "__init__", wrong_lr))
    with pytest.raises(ParityError) as info:
        case.train_step("step", net.train(), {"x": x}, loss_fn=lambda out: out.square().mean())
    message = str(info.value)
    assert "First divergence: the optimizer step — param." in message


def test_a_call_that_cannot_be_rerun_alone_keeps_the_localization_going(net, x):
    def needs_parent(original):
        def forward(self, t):
            if getattr(self, "needs_parent", False) and not getattr(self, "inside", False):
                raise RuntimeError("needs state set by its parent")  # a re-run alone, outside the Net
            return original(self, t)
        return forward

    def sets_state(original):
        def forward(self, t):
            self.blocks[3].inside = True
            try:
                return original(self, t)
            finally:
                self.blocks[3].inside = False
        return forward
    net.blocks[3].needs_parent = True
    with _patched(Block, "forward", needs_parent), _patched(Net, "forward", sets_state):
        message, _ = _fail(ParityCase(_session(), "t::alone", patches=_scaled(net, "blocks.2.b.weight")), "net",
                           net, x)
    assert "could not run" not in message
    # blocks.3 inherits the error and is re-run for the table; alone, it raises: a note, no crash
    assert "blocks.3 could not be re-run alone on the reference's inputs (RuntimeError: needs state" in message
    assert "First divergence: blocks.2.b (Linear)" in message


# --------------------------------------------------------------------------------------------
# stateful arguments: a re-run starts from the state the call began with


class Memory:
    """A plain object of one's own that each layer appends its input to (a cache without transformers)."""

    def __init__(self):
        self.seen: list[torch.Tensor] = []


class Remembering(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, memory: Memory) -> torch.Tensor:
        memory.seen.append(x)
        return self.lin(x) + torch.stack(memory.seen).mean(0)  # depends on what the earlier layers left


class MemoryNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Remembering() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = Memory()
        for layer in self.layers:
            x = layer(x, memory)
        return x


def test_a_stateful_argument_is_rerun_with_the_state_the_call_began_with(x):
    torch.manual_seed(0)
    model = MemoryNet().eval()
    message, extra = _fail(ParityCase(_session(), "t::memory", patches=_scaled(model, "layers.1.lin.weight")),
                           "memory", model, x)
    assert "did not reproduce its output bitwise" not in message and "could not be re-run" not in message
    assert _first(extra)["submodule"] == "layers.1.lin"
    rows = {r["submodule"]: r for r in extra["localization"]}
    # Re-run alone on the reference's input and the memory as layers.2 found it (two entries, not the
    # run's final three plus its own): exactly the reference's output, so its error is all inherited.
    assert rows["layers.2"]["verdict"] == "inherited" and rows["layers.2"]["local_max_abs"] == 0.0


def test_recorded_snapshots_share_unchanged_tensors_and_reruns_never_change_them(x):
    torch.manual_seed(0)
    model = MemoryNet().eval()
    with _Recorder(model, ("", 0), "cpu", depth=1) as recorder, torch.no_grad():
        model(x)
    states = [c.inputs[0][1] for c in recorder.calls]  # each layer's memory argument, as it began
    assert [len(s.copy.seen) for s in states] == [0, 1, 2]
    assert states[2].copy.seen[0] is states[1].copy.seen[0]  # the same unchanged tensor is held once
    fresh = states[2].fresh(torch.device("cpu"))
    fresh.seen.append(x)
    fresh.seen[0].add_(1.0)
    assert len(states[2].copy.seen) == 2 and not torch.equal(states[2].copy.seen[0], fresh.seen[0])


class _Logged(torch.nn.Module):
    """A linear that also returns a statistic as a Python float; ``_Logged.fault`` (the target) scales it."""

    fault = False

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor):
        y = self.lin(x)
        mean = y.mean().item()
        return y, mean * 1.5 if _Logged.fault else mean


def test_a_fault_in_a_number_output_is_not_blamed_on_the_baseline(x, tmp_path):
    # the localization compares tensors only: the target's tensors agree with the live run, its failing number is
    # not among them, so no claim that the baseline differs (nor a re-record command that would store the fault)
    store = BaselineStore(tmp_path, "toy")
    model = _Logged().eval()
    case = ParityCase(ParitySession(torch.device("cpu"), reference="cpu", update_baselines=True, store=store),
                      "tests/test_toy.py::test_logged")
    case.check("logged", model, x)
    assert case.finish() == "created"

    @contextlib.contextmanager
    def fault(device):
        _Logged.fault = True
        try:
            yield
        finally:
            _Logged.fault = False

    session = ParitySession(torch.device("cpu"), reference="baseline", store=store, failure_hooks=[failure_hook])
    message, _ = _fail(ParityCase(session, "tests/test_toy.py::test_logged", patches=fault), "logged", model, x)
    assert "[1]" in message and "baseline that differs" not in message

"""checks.replay: what a recording stores to replay, and when a compare run replays it.

The draws of another machine are emulated by moving every floating tensor by a few ULPs of its
largest value (what ``ATEN_CPU_CAPABILITY=default`` does to ``torch.randn`` and ``nn.init``; the real
kernel path is exercised end to end in tests/plugin/test_plugin_replay.py).
"""
from __future__ import annotations

import pytest
import torch

from pytest_npu_parity.baselines import BaselineStore, CheckBaseline, CorruptBaselineError
from pytest_npu_parity.checks.reference import check_hashes
from pytest_npu_parity.checks.replay import DRAW_RTOL, draw_distance, plan_replay, recorded_extras
from pytest_npu_parity.stable_init import stable_init_


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, scale=1.0):
        return self.b(torch.tanh(self.a(x))) * scale


def _other_draws(t: torch.Tensor, ulps: float = 3.0) -> torch.Tensor:
    """``t`` as another kernel path draws it: every other element moved by ``ulps`` float32 ULPs of
    the tensor's largest value."""
    step = t.abs().max() * torch.finfo(torch.float32).eps * ulps
    out = t.clone()
    out.view(-1)[::2] += step
    return out


def _recorded(model, x):
    extras, meta = recorded_extras(model, ((x,), {}))
    h = check_hashes(model, (x,), {})
    facts = {k: (v() if callable(v) else v) for k, v in h.items() if k in ("input_hash", "config_hash", "structure_hash")}
    return extras, {**facts, "replay": meta}


def _elsewhere(model, x):
    """The same model and input built on a machine whose draws differ in last bits."""
    other = Net()
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            q.copy_(_other_draws(p))
    return other, _other_draws(x)


def test_a_recording_holds_the_inputs_and_the_weights():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    extras, meta = recorded_extras(model, ((x,), {"scale": 2.0}))
    assert sorted(extras) == ["input:0", "weight:a.bias", "weight:a.weight", "weight:b.bias", "weight:b.weight"]
    assert torch.equal(extras["input:0"], x) and extras["input:0"] is not x
    assert meta == {"inputs": 1, "weights": 4}


def test_stable_weights_and_oversized_weights_are_not_recorded():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    stable_init_(model)
    extras, meta = recorded_extras(model, ((x,), {}))
    assert sorted(extras) == ["input:0"] and "stable_init_" in meta["weights"]
    extras, meta = recorded_extras(Net(), ((x,), {}), limit_bytes=200)
    assert sorted(extras) == ["input:0"]
    assert "MiB of weights beside 0.0 MiB of inputs, over the" in meta["weights"] and "stable_init_" in meta["weights"]
    extras, meta = recorded_extras(Net(), ((x,), {}), limit_bytes=0)
    assert extras == {} and "over the 0 MiB replay limit" in meta["inputs"]


def test_draw_distance():
    t = torch.tensor([1.0, -2.0, 0.5])
    assert draw_distance(t, t.clone()) == 0.0
    assert draw_distance(t, t * (1 + 1e-4)) == pytest.approx(1e-4, rel=1e-3)
    # each element against its own magnitude (floored at the median): one large column hides nothing
    stamps = torch.tensor([[1.7e9, 0.5, -0.3], [1.7e9, 0.2, 0.9]])
    other = stamps.clone()
    other[:, 1:] *= 1.001
    assert draw_distance(stamps, other) == pytest.approx(1e-3, rel=1e-2)
    assert draw_distance(torch.tensor([1, 2]), torch.tensor([1, 3])) == float("inf")
    assert draw_distance(t, torch.tensor([1.0, float("nan"), 0.5])) == float("inf")
    with pytest.raises(ValueError, match="float32"):
        draw_distance(t, t.double())


def test_draw_distance_of_a_mostly_zero_tensor_takes_the_typical_non_zero_magnitude():
    # relu/clamp of a draw: most values exactly 0, a few just above it. Another kernel path moves an element
    # by an ULP of the value it was drawn near (here 0.5), not of what the clamp left (1e-7): against the
    # plain median (0) that read as a relative change of ~1e-1, a "real change"; the typical non-zero
    # magnitude is the floor now
    recorded = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1e-7, 0.4, 0.6])
    drawn_elsewhere = recorded.clone()
    drawn_elsewhere[5] += 6e-8  # one ULP of 0.5 in float32
    assert draw_distance(recorded, drawn_elsewhere) == pytest.approx(6e-8 / 0.4, rel=1e-2)
    # an exact zero that the other draw leaves just above zero is judged the same way
    flipped = recorded.clone()
    flipped[0] = 3e-8
    assert draw_distance(recorded, flipped) < 8e-6
    # a real change of a value in a sparse tensor is still one
    edited = recorded.clone()
    edited[6] *= 1 + 1e-4
    assert draw_distance(recorded, edited) == pytest.approx(1e-4, rel=1e-3)
    # every value 0: any difference is a change (inf), and the stale message gives its size
    zeros = torch.zeros(4)
    assert draw_distance(zeros, zeros + 1e-9) == float("inf")


def test_a_change_of_an_all_zero_tensor_is_named_with_its_size():
    from pytest_npu_parity.checks.replay import _closest
    d, name, why = _closest({"bias": torch.zeros(3)}, {"bias": torch.tensor([0.0, 0.25, 0.0])}, "weight")
    assert d == float("inf") and name == "bias"
    assert "weight bias differs (by up to 0.25 where every recorded value is 0)" in why


def test_other_draws_are_replayed_on_a_copy_and_the_callers_objects_stay_as_they_are():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    extras, meta = _recorded(model, x)
    other, y = _elsewhere(model, x)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    replay, why = plan_replay(extras, meta, other, ((y,), {}), check_hashes(other, (y,), {}))
    assert why is None and replay is not None
    assert replay.fn is not other and isinstance(replay.fn, Net)
    assert all(torch.equal(replay.fn.state_dict()[k], extras[f"weight:{k}"]) for k in before)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())  # the caller's module
    assert torch.equal(replay.given[0][0], x) and not torch.equal(y, x)
    assert "replayed the recorded inputs" in replay.note and "and the recorded weights" in replay.note
    # the replayed computation is the recorded one, bit for bit: its fingerprints match the recording's
    again = check_hashes(replay.fn, *replay.given)
    assert again["input_hash"] == meta["input_hash"] and again["config_hash"] == meta["config_hash"]


def test_a_bound_method_is_replayed_on_the_copy():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    extras, meta = _recorded(model, x)
    other, _ = _elsewhere(model, x)
    replay, _ = plan_replay(extras, meta, other.forward, ((x,), {}), check_hashes(other.forward, (x,), {}))
    assert replay.fn.__self__ is not other and torch.equal(replay.fn(x), model(x))


@pytest.mark.parametrize("scale", [1e-4, 1e-5])
def test_a_real_weight_change_is_never_replayed(scale):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    extras, meta = _recorded(model, x)
    other, y = _elsewhere(model, x)
    with torch.no_grad():
        other.b.weight.mul_(1 + scale)
    replay, why = plan_replay(extras, meta, other, ((y,), {}), check_hashes(other, (y,), {}))
    assert replay is None
    assert why.startswith("weight b.weight differs by") and f"beyond the {DRAW_RTOL:g}" in why


def test_a_changed_structure_or_weight_set_is_never_replayed():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    extras, meta = _recorded(model, x)
    other, y = _elsewhere(model, x)
    other.a = torch.nn.Linear(8, 16, bias=False)
    with torch.no_grad():
        other.a.weight.copy_(model.a.weight)
    replay, why = plan_replay(extras, meta, other, ((y,), {}), check_hashes(other, (y,), {}))
    assert replay is None and why == "weights changed (recorded only: ['a.bias'], now only: [])"
    # a configuration change (here the structure record of a LayerNorm's eps) is a real change too
    meta = dict(meta, structure_hash="recorded-elsewhere")
    replay, why = plan_replay(extras, meta, model, ((y,), {}), dict(check_hashes(model, (y,), {}), config_hash="x"))
    assert replay is None and "structure or configuration changed" in why


def test_inputs_beyond_other_draws_are_left_to_the_summary_rule():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    extras, meta = _recorded(model, x)
    y = x * (1 + 1e-3)  # another data pipeline, not another draw
    replay, why = plan_replay(extras, meta, model, ((y,), {}), check_hashes(model, (y,), {}))
    assert replay is None and why is None
    ids = torch.tensor([1, 2, 3])
    extras, meta = recorded_extras(model.forward, ((ids,), {}))
    meta = {"input_hash": check_hashes(model.forward, (ids,), {})["input_hash"], "replay": meta}
    other_ids = torch.tensor([1, 2, 4])  # integer inputs replay only when equal: never
    replay, why = plan_replay(extras, meta, torch.nn.functional.relu, ((other_ids,), {}),
                              check_hashes(torch.nn.functional.relu, (other_ids,), {}))
    assert replay is None


def test_an_input_that_requires_grad_is_replayed_requiring_grad():
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 8, requires_grad=True)
    extras, meta = _recorded(model, x)
    y = _other_draws(x.detach()).requires_grad_()
    replay, _ = plan_replay(extras, meta, model, ((y,), {}), check_hashes(model, (y,), {}))
    assert replay.given[0][0].requires_grad and torch.equal(replay.given[0][0].detach(), x.detach())


def test_a_changed_non_tensor_argument_is_not_called_a_draw():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    extras, replay_meta = recorded_extras(model, ((x,), {"scale": 2.0}))
    h = check_hashes(model, (x,), {"scale": 2.0})
    meta = {"input_hash": h["input_hash"], "config_hash": h["config_hash"], "replay": replay_meta}
    replay, why = plan_replay(extras, meta, model, ((x,), {"scale": 3.0}), check_hashes(model, (x,), {"scale": 3.0}))
    assert replay is None and why is None  # the tensors are the recorded ones: nothing to replay


def test_a_module_that_cannot_be_copied_is_not_replayed_and_says_why():
    import threading

    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    extras, meta = _recorded(model, x)
    other, y = _elsewhere(model, x)
    other.lock = threading.Lock()
    replay, why = plan_replay(extras, meta, other, ((y,), {}), check_hashes(other, (y,), {}))
    assert replay is None and why.startswith("the module cannot be copied to replay its recorded weights (TypeError")


def test_a_wrapper_around_stable_weights_records_none():
    torch.manual_seed(0)
    model = Net()
    stable_init_(model)
    wrapper = torch.nn.Sequential(model)  # holds no tensors of its own, as a module collecting intermediates
    extras, meta = recorded_extras(wrapper, ((torch.randn(3, 8),), {}))
    assert "stable_init_" in meta["weights"]
    wrapper.extra = torch.nn.Linear(2, 2)  # an unmarked module with weights of its own: recorded
    assert recorded_extras(wrapper, ((torch.randn(3, 8),), {}))[1]["weights"] == 6


def test_weights_that_were_not_recorded_say_why_when_they_differ():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 8)
    extras, replay_meta = recorded_extras(model, ((x,), {}), limit_bytes=200)
    meta = {**{k: v for k, v in _recorded(model, x)[1].items() if k != "replay"}, "replay": replay_meta}
    other, _ = _elsewhere(model, x)
    replay, why = plan_replay(extras, meta, other, ((x,), {}), check_hashes(other, (x,), {}))
    assert replay is None and why.startswith("the recording holds no weights to replay (not recorded:")


def test_extras_are_stored_once_per_file_and_covered_by_the_checksum(tmp_path):
    torch.manual_seed(0)
    x, w = torch.randn(8, 8), torch.randn(64)  # under POOL_MIN_BYTES: in the file (larger: tests/store/test_replay_pool.py)
    store = BaselineStore(tmp_path, "s")
    checks = {name: CheckBaseline(name, {"": torch.zeros(2) + i}, extras={"input:0": x, "weight:w": w})
              for i, name in enumerate(("a", "b"))}
    store.write("t.py::t", checks, {"device": "cpu"})
    path = store.path_for("t.py::t")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        keys = sorted(fh.keys())
    assert len([k for k in keys if k.startswith("@")]) == 2  # x and w once, for both checks
    loaded = store.load("t.py::t")
    assert torch.equal(loaded.checks["b"].extras["input:0"], x)
    assert store.write("t.py::t", checks, {"device": "cpu"}) == "unchanged"
    # one flipped bit in a recorded input is corruption, never replayed
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBaselineError, match="checksum"):
        store.load("t.py::t")

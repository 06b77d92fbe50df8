"""Layer records (module ``layers``): capture, the rel-L2/amplification rule, and the runner's layer check."""
from __future__ import annotations

import math

import pytest
import torch

from pytest_npu_parity.baselines import BaselineStore
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.layers import (INPUT_SUFFIX, LAYER_PREFIX, LayerPolicy, capture_layers, judge_layers,
                                      parse_layer_spec, split_layers)
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytester_helpers import edited_weight

CPU = torch.device("cpu")


def damped() -> torch.nn.Module:
    """Linear (no bias) then LayerNorm without affine: the norm divides any scale of the Linear's
    weight away, so a weight x (1 + 1e-4) leaves the output within rounding."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.LayerNorm(64, elementwise_affine=False),
                               torch.nn.Linear(64, 8)).eval()


X = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))


def test_capture_records_first_call_of_weighted_submodules_with_inputs():
    model = damped()
    with capture_layers(model, samples=100) as records:
        model(X)
        model(X * 2)  # a second call does not overwrite the first
    assert list(records) == [f"{LAYER_PREFIX}0", f"{LAYER_PREFIX}0{INPUT_SUFFIX}",
                             f"{LAYER_PREFIX}2", f"{LAYER_PREFIX}2{INPUT_SUFFIX}"]  # LayerNorm has no weights
    assert records[f"{LAYER_PREFIX}0"].shape == (100,)
    assert records[f"{LAYER_PREFIX}2"].numel() == 100  # 16 x 8 = 128 > 100 sampled
    full = model[0](X).reshape(-1)
    assert set(records[f"{LAYER_PREFIX}0"].tolist()) <= set(full.tolist())
    assert not model[0]._forward_hooks  # hooks removed
    with capture_layers(model, samples=100) as again:
        model(X)
    assert torch.equal(again[f"{LAYER_PREFIX}0"], records[f"{LAYER_PREFIX}0"])  # same positions


def test_a_layer_runs_without_its_hook_once_its_first_call_is_recorded():
    # Each decoding step of a generate calls every layer again: after the first record the hook is
    # gone, so those calls take the hook-free path; the record is the first call's.
    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.hooks_seen: list[int] = []

        def forward(self, x):
            y = self.lin(x)
            self.hooks_seen.append(len(self.lin._forward_hooks))
            return self.lin(y)

    m = Twice()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(2))
    with capture_layers(m) as records:
        m(x)
        m(x)
    assert m.hooks_seen == [0, 0]
    assert torch.equal(records["layer:lin"], m.lin(x).detach().reshape(-1))
    assert torch.equal(records["layer:lin" + INPUT_SUFFIX], x.reshape(-1))
    assert not m.lin._forward_hooks


def test_judge_rule_limit_amplification_and_nonfinite():
    g = torch.Generator().manual_seed(2)
    e = torch.randn(256, generator=g)
    noise = torch.randn(256, generator=g)
    policy = LayerPolicy(1e-5)
    ok = judge_layers({"layer:a": e * (1 + 1e-7 * noise)}, {"layer:a": e}, policy)
    assert ok.passed and ok.errors["a"] < 1e-6
    bad = judge_layers({"layer:a": e * (1 + 1e-4)}, {"layer:a": e}, policy)
    assert not bad.passed and bad.failing == ["a"] and math.isclose(bad.errors["a"], 1e-4, rel_tol=1e-3)
    # the same output error over an input that already drifted by 2e-5 is drift received (x5 < x10)
    drifted = {"layer:a": e * (1 + 1e-4), "layer:a@in": e * (1 + 2e-5)}
    assert judge_layers(drifted, {"layer:a": e, "layer:a@in": e}, policy).passed
    # ... but not over an input that drifted by 2e-6 (x50)
    drifted["layer:a@in"] = e * (1 + 2e-6)
    assert not judge_layers(drifted, {"layer:a": e, "layer:a@in": e}, policy).passed
    masked = e.clone()
    masked[0] = -math.inf
    assert judge_layers({"layer:a": masked}, {"layer:a": masked}, policy).passed  # same -inf: equal
    nan = e.clone()
    nan[3] = math.nan
    assert not judge_layers({"layer:a": nan}, {"layer:a": e}, policy).passed
    zeros = torch.zeros(64)
    assert judge_layers({"layer:z": zeros + 1e-12}, {"layer:z": zeros}, policy).passed  # under the floor
    other = judge_layers({"layer:a": e, "layer:b": e[:10]}, {"layer:a": e, "layer:b": e[:20], "layer:c": e}, policy)
    assert other.judged == 1 and other.unmatched == ["b", "c"]


def test_parse_layer_spec():
    assert parse_layer_spec("off", source="ini") is None and parse_layer_spec(False, source="marker") is None
    assert parse_layer_spec("3e-5 # deep BatchNorm stack", source="ini").limit == 3e-5
    assert parse_layer_spec(True, source="marker").limit == 1e-5
    with pytest.raises(ValueError, match="give 'off' or a relative L2 limit"):
        parse_layer_spec("tight", source="ini")
    with pytest.raises(ValueError, match="limit=-1"):
        parse_layer_spec(-1, source="ini")


def test_split_layers_keeps_outputs_apart():
    leaves = {"": torch.ones(2), "layer:0": torch.ones(3), "layer:0@in": torch.ones(3)}
    outputs, layers = split_layers(leaves)
    assert list(outputs) == [""] and set(layers) == {"layer:0", "layer:0@in"}


def test_damped_fault_fails_the_layer_check_and_passes_outputs_only():
    model = damped()
    session = ParitySession(CPU, reference="cpu")
    fault = edited_weight(model, "0.weight", 1 + 1e-4, session)
    with pytest.raises(ParityError, match=r"Layer check failed: 1 of 2 .*'0' 0\.0001 \(input 0\)") as info:
        ParityCase(session, "t::fault", "fp32", patches=fault).check("m", model, X)
    assert "with every output leaf within tolerance" in str(info.value)
    # outputs alone cannot see it: the layer check off passes the same fault (what it is for)
    record = ParityCase(session, "t::off", "fp32", patches=fault).check("m", model, X, layers=False)
    assert record.status == "pass"
    clean = ParityCase(session, "t::clean", "fp32").check("m", model, X)
    assert clean.extra["layers_judged"] == 2 and clean.extra["layer_worst_rel_l2"] == 0.0
    assert {"layers_judged", "layer_worst", "layer_policy"} <= set(clean.rows()[0])


def test_bf16_records_no_layers_by_default_and_a_marker_turns_them_on():
    model = damped()
    session = ParitySession(CPU, reference="cpu")
    assert ParityCase(session, "t::b", "bf16").layer_policy is None
    assert ParityCase(session, "t::b2", "bf16", marker_layers=1e-2).layer_policy.limit == 1e-2
    assert ParitySession(CPU, reference="cpu", layers="off").layer_policy("fp32") is None
    record = ParityCase(session, "t::b3", "bf16").check("m", model, X)
    assert "layers_judged" not in record.extra


def test_layer_records_are_stored_in_baselines_and_judged_against_them(tmp_path):
    model = damped()
    recorder = ParitySession(CPU, update_baselines=True, store=BaselineStore(tmp_path, "suite"))
    case = ParityCase(recorder, "tests/test_x.py::t", "fp32")
    case.check("m", model, X)
    assert case.finish() == "created"
    stored = next(iter(case._pending.values())) if case._pending else None
    session = ParitySession(CPU, reference="baseline", store=BaselineStore(tmp_path, "suite"))
    record = ParityCase(session, "tests/test_x.py::t", "fp32").check("m", model, X)
    assert record.reference == "baseline" and record.extra["layers_judged"] == 2
    fault = edited_weight(model, "0.weight", 1 + 1e-4, session)
    with pytest.raises(ParityError, match="Layer check failed"):
        ParityCase(session, "tests/test_x.py::t", "fp32", patches=fault).check("m", model, X)
    del stored


def test_finish_releases_the_layer_records_and_keeps_their_verdict():
    """The session keeps every check record to its end; the sampled layer outputs of both sides
    are needed only while the test runs, so ``ParityCase.finish`` releases them."""
    session = ParitySession(CPU, reference="cpu")
    case = ParityCase(session, "tests/test_x.py::t", "fp32")
    record = case.check("m", damped(), X)
    actual, expected = record.layer_records
    assert actual and expected.keys() == actual.keys()
    case.finish()
    assert record.layer_records is None and session.records[-1] is record
    assert record.extra["layers_judged"] == 2


def test_baseline_without_layer_records_leaves_a_note(tmp_path):
    model = damped()
    recorder = ParitySession(CPU, update_baselines=True, store=BaselineStore(tmp_path, "suite"), layers="off")
    case = ParityCase(recorder, "tests/test_x.py::t", "fp32")
    case.check("m", model, X)
    case.finish()
    session = ParitySession(CPU, reference="baseline", store=BaselineStore(tmp_path, "suite"))
    record = ParityCase(session, "tests/test_x.py::t", "fp32").check("m", model, X)
    assert record.status == "pass" and "layer check not run" in record.extra["policy_note"]


def test_train_step_records_training_mode_layers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    session = ParitySession(CPU, reference="cpu")
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
    record = ParityCase(session, "t::train", "fp32").train_step("step", model, x, loss_fn=lambda out: out.square().mean())
    assert record.extra["layers_judged"] == 3


DAMPED_TEST = """
import contextlib
import pytest
import torch

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False),
                               torch.nn.LayerNorm(64, elementwise_affine=False), torch.nn.Linear(64, 8)).eval()

MODEL = model()

@pytest.fixture
def parity_patches(parity_session):
    @contextlib.contextmanager
    def fault(device):
        w = MODEL[0].weight
        saved = w.detach().clone()
        with torch.no_grad():
            w.mul_(1 + 1e-4)
        parity_session.forget(MODEL)
        try:
            yield
        finally:
            with torch.no_grad():
                w.copy_(saved)
            parity_session.forget(MODEL)
    return fault

X = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))

def test_damped(parity):
    parity.check("m", MODEL, X)

@pytest.mark.parity(layers=False)
def test_damped_outputs_only(parity):
    parity.check("m", MODEL, X)
"""


def test_plugin_layer_check_option_marker_and_header(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_damped=DAMPED_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes=fp32", "-p", "no:cacheprovider", "-rN")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["npu-parity: layer check fp32: rel-L2 <= 1e-05 per layer or <= 10x its input's*",
                                 "*Layer check failed: 1 of 2 weighted layers*'0' 0.0001 (input 0)*"])
    off = pytester.runpytest("--npu-parity", "--parity-dtypes=fp32", "--parity-layers=off", "-p", "no:cacheprovider")
    off.assert_outcomes(passed=2)
    off.stdout.fnmatch_lines(["npu-parity: layer check off (--parity-layers)"])
    bad = pytester.runpytest("--npu-parity", "--parity-layers=tight", "-p", "no:cacheprovider")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*--parity-layers='tight': layer check 'tight': give 'off' or a relative L2 limit*"])


def test_recording_never_changes_what_runs_transformer_encoder_layer_fast_path(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True).eval()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), layer, torch.nn.Linear(32, 4)).eval()
    x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(4))
    fast = torch._transformer_encoder_layer_fwd
    calls = []
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a, **k: calls.append(1) or fast(*a, **k))
    with torch.no_grad():
        plain = model(x)
        assert calls == [1]  # the fused fast path ran
        with capture_layers(model) as records:
            hooked = model(x)
    assert calls == [1, 1] and torch.equal(plain, hooked)  # recording kept it
    assert [k for k in records if not k.endswith(INPUT_SUFFIX)] == ["layer:0", "layer:2"]
    # what the exclusion is for: a hook inside the layer turns the fast path off
    handle = layer.linear1.register_forward_hook(lambda *a: None)
    try:
        with torch.no_grad():
            model(x)
    finally:
        handle.remove()
    assert calls == [1, 1]


def test_a_reference_without_layer_records_is_not_reused_by_a_check_with_them():
    # One session, one module, input and check name: a first test with layers=False must not leave
    # its reference (no layer records) to a later test that judges layers, or the later test judges
    # no layer at all and the damped 1e-4 weight fault passes.
    model = damped()
    session = ParitySession(CPU, reference="cpu")
    ParityCase(session, "tests/test_layers.py::a", "fp32").check("m", model, X, layers=False)
    later = ParityCase(session, "tests/test_layers.py::b", "fp32", patches=edited_weight(model, "0.weight", 1 + 1e-4, session))
    with pytest.raises(ParityError, match="Layer check failed"):
        later.check("m", model, X)
    assert later.records[-1].extra["layers_judged"] == 2


def test_a_non_contiguous_output_is_sampled_at_the_same_positions_without_a_whole_copy(monkeypatch):
    # A channels_last conv output (or a transpose) is gathered at the sample positions of its
    # row-major flattening: the same record as its contiguous copy, and no reshape of the whole output.
    from pytest_npu_parity.layers import _sampled

    x = torch.randn(4, 8, 16, 16, generator=torch.Generator().manual_seed(3))
    strided = x.to(memory_format=torch.channels_last)
    assert not strided.is_contiguous()
    for t in (strided, x.transpose(1, 3)):
        expected = _sampled("layer:conv", t.contiguous(), 64)
        monkeypatch.setattr(torch.Tensor, "reshape", lambda *a, **k: pytest.fail("whole output reshaped"))
        got = _sampled("layer:conv", t, 64)
        monkeypatch.undo()
        assert torch.equal(got, expected) and got.shape == (64,)
    small = x[:1, :1, :2, :2].transpose(2, 3)  # no more values than samples: all of them, in row-major order
    assert torch.equal(_sampled("layer:s", small, 64), small.contiguous().reshape(-1))


def test_a_view_with_an_offset_or_zero_strides_is_sampled_as_its_contiguous_copy():
    # The strided read starts at the view's own first element (storage_offset) and follows any
    # strides: a slice of a larger output, an expanded (stride 0) tensor, a permuted bf16 output,
    # into a new tensor or a preallocated row.
    from pytest_npu_parity.layers import _sampled

    x = torch.randn(6, 10, 12, 14, generator=torch.Generator().manual_seed(5))
    views = [x[2:, 1:9, 3:, ::2].permute(0, 2, 3, 1), x[1, 2:].transpose(0, 1),
             torch.randn(1, 7, 1, generator=torch.Generator().manual_seed(6)).expand(9, 7, 11),
             x.to(torch.bfloat16).permute(3, 1, 0, 2)[1:]]
    for t in views:
        assert not t.is_contiguous() and t.numel() > 64
        expected = _sampled("layer:v", t.contiguous(), 64)
        assert torch.equal(_sampled("layer:v", t, 64), expected)
        row = torch.full((80,), float("nan"), dtype=t.dtype)
        assert torch.equal(_sampled("layer:v", t, 64, out=row), expected) and torch.equal(row[:64], expected)


def test_records_written_into_preallocated_rows_are_each_layers_own_values():
    # capture_layers writes each record into a row of one buffer per dtype: every record must be the
    # values _sampled takes from that layer's first output and input (bf16 and fp32 layers side by side,
    # a channels_last conv, an output with fewer values than samples), each its own copy.
    from pytest_npu_parity.runtime.layer_capture import capture_layers, _sampled

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
            self.lin = torch.nn.Linear(36, 8)
            self.low = torch.nn.Linear(8, 2).to(torch.bfloat16)

        def forward(self, x):
            y = self.conv(x.to(memory_format=torch.channels_last))
            z = self.lin(y.flatten(2).mean(1).reshape(x.shape[0], -1)[:, :36])
            return self.low(z.to(torch.bfloat16))

    torch.manual_seed(0)
    model, x = Mixed(), torch.randn(2, 3, 8, 8)
    seen = {}

    def keep(name):
        def hook(_module, inputs, output):
            seen.setdefault(name, (inputs[0].detach().clone(), output.detach().clone()))
        return hook

    hooks = [m.register_forward_hook(keep(n)) for n, m in model.named_children()]
    with torch.no_grad(), capture_layers(model, samples=16) as records:
        model(x)
    for h in hooks:
        h.remove()
    assert set(records) == {f"layer:{n}{s}" for n in seen for s in ("", "@in")}
    for name, (given, output) in seen.items():
        for key, tensor in ((f"layer:{name}", output), (f"layer:{name}@in", given)):
            expected = _sampled(key, tensor, 16)
            assert records[key].dtype == tensor.dtype and torch.equal(records[key], expected), key
    assert records["layer:low"].numel() == 4  # 2 x 2 values: all of them
    pointers = [r.untyped_storage().data_ptr() for r in records.values()]
    assert len(set(pointers)) == len(pointers)  # no record is a view of a shared buffer


def _first_floating_by_flatten(output):
    """The generic answer of ``_first_floating``: the first dense floating leaf in ``flatten`` order,
    None when there is none or ``flatten`` refuses the output."""
    from pytest_npu_parity.leaves import flatten
    from pytest_npu_parity.runtime.layer_capture import _first_floating

    try:
        for _, leaf in flatten(output):
            if isinstance(leaf, torch.Tensor) and _first_floating(leaf) is not None:  # the tensor branch
                return leaf
    except (TypeError, ValueError):
        return None
    return None


def test_first_floating_of_a_plain_tuple_or_list_is_the_generic_paths_answer():
    # A plain tuple or list of tensors and None is walked without flatten; anything else in it (a
    # number, a string, a nested container) must leave the answer to flatten: a Python float before
    # the first floating tensor is itself the answer there (a float64 0-d tensor).
    import collections

    from pytest_npu_parity.runtime.layer_capture import _first_floating

    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 3, generator=gen), torch.randn(4, generator=gen)
    low, scalar = y.to(torch.bfloat16), torch.tensor(0.5)
    ints, empty, sparse = torch.arange(3), torch.empty(0, 5), torch.eye(3).to_sparse()
    Pair = collections.namedtuple("Pair", "first second")

    class Row(tuple):
        pass

    outputs = [
        (x,), [x], (x, y), [y, x], (low, x), (scalar,), (ints, x), (empty, x), (sparse, y), [ints, empty, low],
        (None, x), (x, None, 3), [None, None, y], (None,), (), [], (ints,), (ints, None, empty),
        (1.5, x), [None, 2.0, y], (3, x), (True, x), (1 + 2j, x), ("text", x), (x, 2.5), (2 ** 70, x), (x, 2 ** 70),
        ((y,), x), (ints, (y, 0.5)), [[None], [x]], (ints, [0.25], y), ({"a": y}, x), (object(), x), (x, object()),
        Pair(ints, x), Pair(0.75, x), Row((ints, y)), Row((1.0, y)), {"a": ints, "b": x}, {"a": 1.0, "b": x},
    ]
    for output in outputs:
        got, expected = _first_floating(output), _first_floating_by_flatten(output)
        if expected is None or any(expected is leaf for leaf in (x, y, low, scalar)):
            assert got is expected, output
        else:  # a Python float of the output, as flatten makes it
            assert got is not None and got.dtype == expected.dtype == torch.float64, output
            assert got.shape == () and got.item() == expected.item(), output
    assert _first_floating((1.5, x)).item() == 1.5 and _first_floating((2 ** 70, x)) is None


def test_a_tensor_subclass_that_refuses_numel_is_not_recorded_and_does_not_break_the_forward():
    # The generic path gives up (None) when a leaf raises TypeError/ValueError; the tuple fast path
    # must too, instead of raising out of the forward hook.
    from pytest_npu_parity.runtime.layer_capture import _first_floating

    class Refusing(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") == "numel":
                return NotImplemented
            return super().__torch_function__(func, types, args, kwargs or {})

    refusing = torch.randn(3).as_subclass(Refusing)
    assert _first_floating((refusing, torch.randn(2))) is None
    assert _first_floating([refusing]) is _first_floating_by_flatten([refusing]) is None


def test_sampled_records_are_the_values_at_the_sample_positions_whatever_the_destination():
    # The record is flat[sample_indices(...)] of the row-major flattening: into a new tensor, a row of
    # exactly ``samples`` values, or the head of a longer row; for a tensor in an autograd graph too
    # (with grad enabled, where writing into ``out`` needs the values detached).
    from pytest_npu_parity.runtime.layer_capture import _sampled
    from pytest_npu_parity.store.compact import sample_indices

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 96, 64, generator=gen)
    weight = torch.randn(2, 96, 64, generator=gen, requires_grad=True)
    graph = weight * 2  # a non-leaf with a grad_fn
    for t in (x, x.to(torch.bfloat16), x.transpose(1, 2), weight, graph, graph.transpose(0, 2)):
        expected = t.detach().contiguous().reshape(-1)[sample_indices("layer:p", t.numel(), 64)]
        fresh = _sampled("layer:p", t, 64)
        assert torch.equal(fresh, expected) and not fresh.requires_grad
        for width in (64, 70):
            row = torch.full((width,), float("nan"), dtype=t.dtype)
            written = _sampled("layer:p", t, 64, out=row)
            assert torch.equal(written, expected) and torch.equal(row[:64], expected)
            assert written.data_ptr() == row.data_ptr() and row.shape == (width,) and row[64:].isnan().all()


def test_cached_sample_positions_are_plain_arrays_the_hooks_view_without_a_copy():
    # The positions cache is filled during a forward and lives to the session's end: it keeps plain
    # ``array.array`` objects (Python's small-object allocator), never tensors, whose C-allocated blocks
    # between a forward's large intermediates kept their freed memory from being reused (tens of
    # thousands of page faults per full-model forward); the tensors the hooks index with are views of
    # those arrays, with the positions of ``sample_indices`` and the offsets of their unravelling.
    import array

    from pytest_npu_parity.runtime import layer_capture
    from pytest_npu_parity.store.compact import sample_indices

    layer_capture._position_array.cache_clear()
    layer_capture._offset_array.cache_clear()
    positions = layer_capture._positions("layer:cache", 10_000, 64)
    cached = layer_capture._position_array("layer:cache", 10_000, 64)
    assert isinstance(cached, array.array) and cached.typecode == "q"
    assert positions.dtype == torch.int64 and positions.data_ptr() == cached.buffer_info()[0]
    assert torch.equal(positions, sample_indices("layer:cache", 10_000, 64))
    assert layer_capture._positions("layer:cache", 10_000, 64).data_ptr() == positions.data_ptr()

    x = torch.randn(4, 50, 50, generator=torch.Generator().manual_seed(5)).transpose(0, 2)
    offsets, extent = layer_capture._offsets("layer:cache", tuple(x.shape), tuple(x.stride()), 64)
    stored, stored_extent = layer_capture._offset_array("layer:cache", tuple(x.shape), tuple(x.stride()), 64)
    assert isinstance(stored, array.array) and offsets.data_ptr() == stored.buffer_info()[0] and extent == stored_extent
    flat = x.as_strided((extent,), (1,))
    assert torch.equal(flat[offsets], x.contiguous().reshape(-1)[positions])
    assert all(not isinstance(v, torch.Tensor) for v in (cached, stored))


def _naive_norms(a: torch.Tensor, e: torch.Tensor):
    """(‖a − e‖, ‖e‖, n) over the positions finite on both sides, one pair at a time."""
    a64, e64 = a.double(), e.double()
    both = torch.isfinite(a64) & torch.isfinite(e64)
    if not bool(((a64 == e64) | both).all()):
        return None
    return (float(torch.linalg.vector_norm(a64[both] - e64[both])), float(torch.linalg.vector_norm(e64[both])),
            int(both.sum()))


def test_layer_norms_measured_together_equal_the_pair_by_pair_ones():
    from pytest_npu_parity.judge.layers import _l2_norms

    gen = torch.Generator().manual_seed(11)
    pairs = []
    for i in range(60):
        n = (64, 64, 10, 1, 0)[i % 5]
        e = torch.randn(n, generator=gen) * 10.0 ** (i % 7 - 3)
        a = e + 1e-6 * e.abs().mean().nan_to_num() * torch.randn(n, generator=gen)
        if i % 3 == 0 and n > 5:
            a[2] = e[2] = -math.inf  # the same -inf on both sides (a mask): equal, left out
        if i % 11 == 0 and n > 5:
            a[4] = math.nan  # on one side only
        if i % 4 == 1:
            a, e = a.to(torch.bfloat16), e.to(torch.bfloat16)
        elif i % 4 == 2:
            a = a.to(torch.bfloat16)  # another dtype on one side
        pairs.append((a, e))
    for (a, e), got in zip(pairs, _l2_norms(pairs)):
        want = _naive_norms(a, e)
        if want is None:
            assert got is None
            continue
        assert got is not None and got[2] == want[2]
        assert got[:2] == pytest.approx(want[:2], rel=1e-12, abs=0)


@pytest.mark.parametrize("planted", [0, 57, 119, 130])
def test_a_faulted_layer_among_many_of_its_size_is_the_one_named(planted):
    gen = torch.Generator().manual_seed(12)
    expected = {}
    for i in range(140):
        n = 64 if i < 120 else 20  # two sizes: two stacks
        expected[f"layer:m{i}"] = torch.randn(n, generator=gen)
        expected[f"layer:m{i}@in"] = torch.randn(n, generator=gen)
    actual = {k: v.clone() for k, v in expected.items()}
    actual[f"layer:m{planted}"] = actual[f"layer:m{planted}"] * (1 + 1e-4)  # a weight fault's size, its input exact
    verdict = judge_layers(actual, expected, LayerPolicy(limit=1e-5))
    assert verdict.judged == 140 and verdict.failing == [f"m{planted}"]
    assert verdict.errors[f"m{planted}"] == pytest.approx(1e-4, rel=1e-3)
    assert max(v for k, v in verdict.errors.items() if k != f"m{planted}") == 0.0


def test_layer_modules_are_the_submodules_with_a_parameter_of_their_own():
    # A parameter slot holding None (an nn.Linear built without bias registers "bias" as None), a module
    # with buffers only, a container and a module sharing another's parameter: only modules whose own
    # parameter table holds a tensor are layers, as ``parameters(recurse=False)`` yields them.
    from pytest_npu_parity.runtime.layer_capture import layer_modules

    class Slots(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_parameter("w", None)

    shared = torch.nn.Linear(4, 4)
    tied = torch.nn.Module()
    tied.weight = shared.weight
    root = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), Slots(), torch.nn.BatchNorm1d(4, affine=False),
                               torch.nn.Sequential(shared, torch.nn.ReLU()), tied, torch.nn.LayerNorm(4))
    found = [name for name, _ in layer_modules(root)]
    assert found == ["0", "3.0", "4", "5"]
    assert found == [n for n, m in root.named_modules() if n and next(m.parameters(recurse=False), None) is not None]

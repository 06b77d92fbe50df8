"""Tests of pytest_npu_parity.audit: each bug pattern in tests/bug_patterns is caught with its op,
devices and source line, the fixed versions are clean, logical mode is numerically a CPU run, and
the upstream Aurora host round trips show up (and the patch set removes the mask copies)."""
from __future__ import annotations

import importlib.util
import inspect
import json
import sys
import time
from pathlib import Path

import pytest
import torch
from locations import TESTS

from pytest_npu_parity.audit import (
    DEFAULT_LOGICAL_TARGET,
    KINDS,
    AuditRecord,
    DeviceAudit,
    DevicePropagationError,
    audit_call,
)

PATTERNS = TESTS / "bug_patterns"
TARGET = DEFAULT_LOGICAL_TARGET  # cuda:1, logical on this CPU-only machine


def load_pattern(name: str):
    """Import tests/bug_patterns/<name>.py by path (independent of how pytest set sys.path)."""
    qualified = f"bug_patterns_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, PATTERNS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module  # inspect.getsource looks the class's module up here
        spec.loader.exec_module(module)
    return sys.modules[qualified]


def bug_source(cls: type) -> str:
    """``file:line`` of the ``# BUG`` line in ``cls``'s source."""
    lines, start = inspect.getsourcelines(cls)
    hits = [start + i for i, line in enumerate(lines) if line.rstrip().endswith("# BUG")]
    assert len(hits) == 1, f"{cls.__name__} must have exactly one '# BUG' line"
    return f"{inspect.getsourcefile(cls)}:{hits[0]}"


def events_at(record: AuditRecord, kind: str, source: str):
    return [e for e in record.events if e.kind == kind and e.source == source]


# ---------------------------------------------------------------------------------------------
# Bug patterns
# ---------------------------------------------------------------------------------------------

# (pattern module, buggy class, kind, op in the message, devices in the message, extra kwargs)
CASES = [
    ("factory_without_device", "BuggyArange", "mixed_device", "aten::add.Tensor", "cuda:1 + cpu", {}),
    ("factory_without_device", "BuggyOnes", "mixed_device", "aten::mul.Tensor", "cuda:1 + cpu", {}),
    ("hardcoded_cuda", "Buggy", "mixed_device", "Tensor.cuda", "cuda:1 -> cuda:0", {}),
    ("device_index", "Buggy", "h2d", "Tensor.to", "cpu -> cuda:0", {}),
    ("float64_constant", "Buggy", "fp64", "torch.as_tensor", "cuda:1 float64", {}),
    ("item_in_loop", "Buggy", "host_sync", "aten::_local_scalar_dense", "cuda:1", {}),
    ("cpu_only_op", "Buggy", "cpu_fallback", "aten::linalg_pinv", "cuda:1",
     {"unsupported_ops": ("aten::linalg_pinv",)}),
]


@pytest.mark.parametrize("pattern, cls, kind, op, devices, options", CASES,
                         ids=[f"{c[0]}.{c[1]}" for c in CASES])
def test_bug_pattern_is_caught_with_op_devices_and_line(pattern, cls, kind, op, devices, options):
    mod = load_pattern(pattern)
    buggy = getattr(mod, cls)
    source = bug_source(buggy)
    _, record = audit_call(buggy(), (mod.make_input(),), target=TARGET, logical=True, **options)
    hits = events_at(record, kind, source)
    assert hits, f"no {kind} event at {source}:\n{record.format()}"
    message = hits[0].message()
    assert op in message and devices in message and source in message, message
    assert "# BUG" in message  # the code text of the line is shown
    with pytest.raises(DevicePropagationError) as info:
        record.assert_clean()
    assert source in str(info.value) and op in str(info.value)


@pytest.mark.parametrize("pattern", ["factory_without_device", "hardcoded_cuda", "device_index",
                                     "float64_constant", "item_in_loop", "cpu_only_op"])
def test_fixed_version_is_clean_and_computes_what_the_cpu_computes(pattern):
    mod = load_pattern(pattern)
    x = mod.make_input()
    out, record = audit_call(mod.Fixed(), (x,), target=TARGET, logical=True,
                             unsupported_ops=getattr(mod, "UNSUPPORTED_OPS", ()))
    record.assert_clean()
    assert record.counts() == dict.fromkeys(KINDS, 0)
    assert torch.equal(out, mod.Fixed()(x))


def test_arange_pattern_also_reports_the_cpu_factory():
    mod = load_pattern("factory_without_device")
    _, record = audit_call(mod.BuggyArange(), (mod.make_input(),), target=TARGET, logical=True)
    cpu_ops = events_at(record, "cpu_fallback", bug_source(mod.BuggyArange))
    assert [e.op for e in cpu_ops] == ["aten::arange"]
    assert "ran on the CPU, target cuda:1" in cpu_ops[0].message()


def test_hardcoded_cuda_mixes_two_devices_at_the_use():
    mod = load_pattern("hardcoded_cuda")
    _, record = audit_call(mod.Buggy(), (mod.make_input(),), target=TARGET, logical=True)
    mixed = {e.op: e.devices for e in record.of_kind("mixed_device")}
    assert mixed["aten::mul.Tensor"] == ("cuda:1", "cuda:0")


def test_device_index_mixes_at_the_use():
    mod = load_pattern("device_index")
    _, record = audit_call(mod.Buggy(), (mod.make_input(),), target=TARGET, logical=True)
    mixed = events_at(record, "mixed_device", bug_source(mod.Buggy))
    assert [(e.op, e.devices) for e in mixed] == [("aten::mul.Tensor", ("cuda:1", "cuda:0"))]


def test_item_in_loop_counts_every_sync():
    mod = load_pattern("item_in_loop")
    x = mod.make_input()
    _, record = audit_call(mod.Buggy(), (x,), target=TARGET, logical=True)
    (event,) = events_at(record, "host_sync", bug_source(mod.Buggy))
    assert event.count == x.shape[0]
    assert record.counts()["host_sync"] == x.shape[0]


def test_float64_constant_propagates_to_the_output():
    mod = load_pattern("float64_constant")
    out, record = audit_call(mod.Buggy(), (mod.make_input(),), target=TARGET, logical=True)
    assert out.dtype == torch.float64
    ops = {e.op for e in record.of_kind("fp64")}
    assert {"torch.as_tensor", "aten::mul.Tensor"} <= ops


def test_manual_cpu_fallback_shows_the_round_trip():
    mod = load_pattern("cpu_only_op")
    source = bug_source(mod.ManualFallback)
    _, record = audit_call(mod.ManualFallback(), (mod.make_input(),), target=TARGET, logical=True,
                           unsupported_ops=mod.UNSUPPORTED_OPS)
    kinds = {(e.kind, e.op) for e in record.events if e.source == source}
    assert ("d2h", "Tensor.cpu") in kinds and ("h2d", "Tensor.to") in kinds
    assert ("cpu_fallback", "aten::linalg_pinv.atol_rtol_tensor") in kinds
    # the pinv ran on the CPU here: not reported as "declared unsupported on the target"
    assert not [e for e in record.events if "declared unsupported" in e.note]


# ---------------------------------------------------------------------------------------------
# Logical mode: device reporting and numerics
# ---------------------------------------------------------------------------------------------

class _Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.seen = {}

    def forward(self, x):
        self.seen = {"device": x.device, "is_cuda": x.is_cuda, "is_cpu": x.is_cpu, "index": x.get_device(),
                     "weight": self.lin.weight.device, "made": torch.zeros(2, device=x.device).device,
                     "host": torch.zeros(2).device, "data": x.data.device, "cpu": x.cpu().device}
        return self.lin(x)


def test_logical_tensors_report_the_logical_device():
    probe = _Probe()
    out, record = audit_call(probe, (torch.ones(2, 4),), target="cuda:1", logical=True)
    assert probe.seen == {"device": torch.device("cuda:1"), "is_cuda": True, "is_cpu": False, "index": 1,
                          "weight": torch.device("cuda:1"), "made": torch.device("cuda:1"),
                          "host": torch.device("cpu"), "data": torch.device("cuda:1"), "cpu": torch.device("cpu")}
    assert out.device.type == "cpu"  # outside the audit it is a plain CPU tensor
    assert [(e.kind, e.op) for e in record.events] == [("cpu_fallback", "aten::zeros"), ("d2h", "Tensor.cpu")]


def test_logical_forward_and_backward_match_a_plain_cpu_run_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.GELU(), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 2))
    x = torch.randn(4, 5)
    ref_out = model(x)
    ref_out.square().mean().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    audit = DeviceAudit(TARGET, logical=True)
    audit.to_target(model)
    xa = audit.to_target(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with audit:
        out = model(xa)
        out.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(audit.device_of(p.grad) == torch.device(TARGET) for p in model.parameters())
    audit.record.assert_clean()


def test_transformer_encoder_matches_cpu_run_without_fast_path():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            ref = layer(x)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        out, record = audit_call(layer, (x,), target=TARGET, logical=True)
    assert torch.equal(out, ref)
    record.assert_clean()


MOVES = [
    ("h.to(x)", lambda x, h: h.to(x), [("h2d", "Tensor.to", ("cpu", "cuda:1"))], "cuda:1", torch.float32),
    ("h.to(dev, fp16)", lambda x, h: h.to(x.device, torch.float16), [("h2d", "Tensor.to", ("cpu", "cuda:1"))],
     "cuda:1", torch.float16),
    ("h.to(device=, non_blocking)", lambda x, h: h.to(device=x.device, non_blocking=True),
     [("h2d", "Tensor.to", ("cpu", "cuda:1"))], "cuda:1", torch.float32),
    ("x.to('cpu')", lambda x, h: x.to("cpu"), [("d2h", "Tensor.to", ("cuda:1", "cpu"))], "cpu", torch.float32),
    ("x.to(fp64)", lambda x, h: x.to(torch.float64), [("fp64", "aten::_to_copy", ("cuda:1",))], "cuda:1",
     torch.float64),
    ("x.double()", lambda x, h: x.double(), [("fp64", "aten::_to_copy", ("cuda:1",))], "cuda:1", torch.float64),
    ("h.cuda(1)", lambda x, h: h.cuda(1), [("h2d", "Tensor.cuda", ("cpu", "cuda:1"))], "cuda:1", torch.float32),
    ("x.cuda()", lambda x, h: x.cuda(), [("mixed_device", "Tensor.cuda", ("cuda:1", "cuda:0"))], "cuda:0",
     torch.float32),
    ("x.to(x.device)", lambda x, h: x.to(x.device), [], "cuda:1", torch.float32),
]


@pytest.mark.parametrize("call, expected, device, dtype", [m[1:] for m in MOVES], ids=[m[0] for m in MOVES])
def test_moves_between_host_and_logical_devices(call, expected, device, dtype):
    audit = DeviceAudit(TARGET, logical=True)
    xa, host = audit.to_target(torch.ones(3)), torch.arange(3.0)
    out = audit.run(call, xa, host)
    assert [(e.kind, e.op, e.devices) for e in audit.record.events] == expected
    assert audit.device_of(out) == torch.device(device) and out.dtype == dtype
    source = host if expected and expected[0][2][0] == "cpu" else xa
    assert torch.equal(out.double(), source.double())
    assert audit.device_of(host).type == "cpu"  # the host tensor itself never moves


def test_as_tensor_of_a_host_tensor_is_a_copy_not_a_relabel():
    host = torch.arange(4.0)

    def fn(x):
        moved = torch.as_tensor(host, device=x.device)
        return moved, x + moved

    audit = DeviceAudit(TARGET, logical=True)
    xa = audit.to_target(torch.ones(4))
    (moved, _), record = audit.run(fn, xa), audit.record
    assert moved is not host and audit.device_of(host).type == "cpu"
    assert [(e.kind, e.op) for e in record.events] == [("h2d", "torch.as_tensor")]


def test_copy_into_device_tensor_and_cpu_index_are_h2d():
    audit = DeviceAudit(TARGET, logical=True)
    xa = audit.to_target(torch.zeros(3, 4))
    idx = torch.tensor([0, 2])

    def fn(x):
        x[0].copy_(torch.ones(4))
        return x[idx]

    audit.run(fn, xa)
    ops = [(e.kind, e.op) for e in audit.record.events]
    assert ("h2d", "aten::copy_") in ops and ("h2d", "aten::index.Tensor") in ops
    assert not audit.record.of_kind("mixed_device") and not audit.record.of_kind("host_sync")


def test_boolean_mask_indexing_is_a_host_sync():
    audit = DeviceAudit(TARGET, logical=True)
    xa = audit.to_target(torch.tensor([1.0, -2.0, 3.0]))
    out = audit.run(lambda x: x[x > 0], xa)
    assert out.tolist() == [1.0, 3.0]
    assert [(e.kind, e.op) for e in audit.record.events] == [("host_sync", "aten::index.Tensor")]


def test_zero_dim_cpu_tensors_mix_freely():
    audit = DeviceAudit(TARGET, logical=True)
    xa = audit.to_target(torch.ones(3))
    audit.run(lambda x: x * torch.tensor(2.0) + 1, xa)
    audit.record.assert_clean()


# ---------------------------------------------------------------------------------------------
# Real-device mode (meta stands in for a device: it exists everywhere)
# ---------------------------------------------------------------------------------------------

def test_real_mode_records_a_mixed_op_before_it_raises():
    mod = load_pattern("factory_without_device")
    audit = DeviceAudit("meta", logical=False)
    assert not audit.logical
    model = audit.to_target(mod.BuggyOnes())
    x = audit.to_target(mod.make_input())
    assert x.device.type == "meta"
    with pytest.raises(RuntimeError):
        audit.run(model, x)
    (event,) = audit.record.of_kind("mixed_device")
    assert event.devices == ("meta", "cpu") and event.source == bug_source(mod.BuggyOnes)


def test_real_mode_records_host_syncs_and_copies_before_they_run():
    audit = DeviceAudit("meta", logical=False)
    x = audit.to_target(torch.ones(3))
    for call in (lambda t: t.tolist(), lambda t: t.cpu(), lambda t: t.sum().item()):
        with pytest.raises((RuntimeError, NotImplementedError)):  # meta tensors hold no data
            audit.run(call, x)
    assert [(e.kind, e.op, e.devices, e.count) for e in audit.record.events] == [
        ("d2h", "aten::_to_copy", ("meta", "cpu"), 2), ("host_sync", "aten::_local_scalar_dense", ("meta",), 1)]


def test_real_mode_float64_and_h2d():
    mod = load_pattern("float64_constant")
    audit = DeviceAudit("meta", logical=False)
    out = audit.run(mod.Buggy(), audit.to_target(mod.make_input()))
    assert out.device.type == "meta" and out.dtype == torch.float64
    source = bug_source(mod.Buggy)
    assert events_at(audit.record, "h2d", source)[0].devices == ("cpu", "meta")
    assert events_at(audit.record, "fp64", source)


def test_real_mode_clean_module_is_clean():
    mod = load_pattern("factory_without_device")
    audit = DeviceAudit("meta", logical=False)
    audit.run(audit.to_target(mod.Fixed()), audit.to_target(mod.make_input()))
    audit.record.assert_clean()


# ---------------------------------------------------------------------------------------------
# Record, options, errors
# ---------------------------------------------------------------------------------------------

def test_record_to_dict_is_json_and_format_lists_events():
    mod = load_pattern("item_in_loop")
    _, record = audit_call(mod.Buggy(), (mod.make_input(),), target=TARGET, logical=True)
    data = json.loads(json.dumps(record.to_dict()))
    assert data["target"] == "cuda:1" and data["logical"] is True and data["skipped"] is None
    assert data["counts"]["host_sync"] == 5
    assert data["events"][0]["source"] == bug_source(mod.Buggy)
    text = record.format()
    assert "host_sync 5" in text.splitlines()[0] and "aten::_local_scalar_dense" in text


def test_assert_clean_allowances():
    mod = load_pattern("item_in_loop")
    _, record = audit_call(mod.Buggy(), (mod.make_input(),), target=TARGET, logical=True)
    record.assert_clean({"host_sync": 5})
    with pytest.raises(DevicePropagationError, match=r"host_sync 5 \(allowed 4\)") as info:
        record.assert_clean({"host_sync": 4})
    assert info.value.record is record
    with pytest.raises(ValueError, match="not one of"):
        record.assert_clean({"host_syncs": 9})
    with pytest.raises(ValueError, match=">= 0"):
        record.assert_clean({"h2d": -1})


def test_cpu_target_is_inert_and_says_so():
    audit = DeviceAudit("cpu")
    out = audit.run(lambda x: x + torch.ones(2), torch.zeros(2))
    assert torch.equal(out, torch.ones(2))
    assert audit.record.skipped and "logical" in audit.record.skipped
    assert audit.to_dict()["counts"] == {} and audit.record.events == []


def test_auto_mode_picks_logical_without_the_device():
    if torch.cuda.is_available():
        pytest.skip("this machine has a real CUDA device")
    assert DeviceAudit("cuda").logical is True
    assert DeviceAudit("cuda").device == torch.device("cuda:0")
    with pytest.raises(ValueError, match="logical=True"):
        DeviceAudit("cuda:0", logical=False)


def test_bad_targets_and_options_are_named():
    if hasattr(torch, "npu"):
        pytest.skip("torch_npu is loaded: 'npu' parses here")
    with pytest.raises(ValueError, match=r"'npu:0'.*cuda:1"):
        DeviceAudit("npu:0")
    with pytest.raises(ValueError, match="not a device"):
        DeviceAudit("gpu7")
    with pytest.raises(ValueError, match="aten::linalg_pinv"):
        DeviceAudit(TARGET, unsupported_ops=["linalg_pinv"])


def test_audits_do_not_nest_and_leave_nothing_installed():
    audit = DeviceAudit(TARGET, logical=True)
    with audit:
        assert torch._C._is_torch_function_mode_enabled()
        with pytest.raises(RuntimeError, match="do not nest"):
            audit.__enter__()
    assert not torch._C._is_torch_function_mode_enabled()
    assert torch._C._len_torch_dispatch_stack() == 0
    x = torch.ones(2)
    audit.to_target(torch.nn.Linear(2, 2))
    assert (x + 1).device.type == "cpu" and audit.record.events == []


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_exception_carries_the_audit_as_a_note():
    mod = load_pattern("factory_without_device")
    audit = DeviceAudit("meta", logical=False)
    with pytest.raises(RuntimeError) as info:
        audit.run(audit.to_target(mod.BuggyOnes()), audit.to_target(mod.make_input()))
    assert any("mixed-device op aten::mul.Tensor: meta + cpu" in note for note in info.value.__notes__)


# ---------------------------------------------------------------------------------------------
# Aurora (the real upstream package, small config)
# ---------------------------------------------------------------------------------------------

def _line_of(module, needle: str) -> str:
    """``file:line`` of the single line of ``module``'s source that contains ``needle``."""
    path = inspect.getsourcefile(module)
    lines = Path(path).read_text().splitlines()
    hits = [i + 1 for i, line in enumerate(lines) if needle in line]
    assert len(hits) == 1, f"{needle!r} found {len(hits)} times in {path}"
    return f"{path}:{hits[0]}"


@pytest.fixture(scope="module")
def aurora_tiny():
    """The project's tiny Aurora (real upstream classes, seeded), or a small config of our own
    where the factory is not importable."""
    pytest.importorskip("aurora.modeling_aurora")
    try:
        from pytest_npu_parity.aurora.factory import build_model
    except ImportError:
        from aurora.configuration_aurora import AuroraConfig
        from aurora.modeling_aurora import AuroraForPrediction

        torch.manual_seed(0)
        model = AuroraForPrediction(AuroraConfig(
            token_len=48, hidden_size=64, intermediate_size=128, num_enc_layers=1, num_dec_layers=1,
            num_attention_heads=4, num_prototypes=32, num_sampling_steps=3, num_distill=4)).eval()
    else:
        model = build_model("tiny", seed=0)
    generator = torch.Generator().manual_seed(0)
    x = torch.sin(torch.arange(2 * 96, dtype=torch.float32).reshape(2, 96) * 0.3) \
        + 0.1 * torch.randn(2, 96, generator=generator)
    return model, x


def _aurora_forward(model, x):
    torch.manual_seed(1)
    with torch.no_grad():
        return model(input_ids=x, max_output_length=48, num_samples=2, inference_token_len=48).logits


def _audit_aurora(model, x):
    audit = DeviceAudit(TARGET, logical=True)
    audit.to_target(model)
    out = audit.run(_aurora_forward, model, audit.to_target(x))
    return out, audit.record


def test_aurora_upstream_host_round_trips_appear(aurora_tiny):
    import aurora.modality_connector as connector
    import aurora.modeling_aurora as modeling
    import aurora.prototype_retriever as retriever

    model, x = aurora_tiny
    out, record = _audit_aurora(model, x)
    period = _line_of(connector, "top_list = top_list.detach().cpu().numpy()")
    assert [(e.op, e.devices) for e in events_at(record, "d2h", period)] == [("Tensor.cpu", ("cuda:1", "cpu"))]
    mask_lines = [_line_of(modeling, "causal_attention_mask(num_token).to(hidden_states.device)"),
                  _line_of(retriever, "causal_attention_mask(x.shape[1]).to(x.device)"),
                  _line_of(retriever, "causal_attention_mask(output_token_len).to(x.device)")]
    for line in mask_lines:
        copies = [(e.op, e.devices) for e in events_at(record, "h2d", line)]
        assert copies == [("Tensor.to", ("cpu", "cuda:1"))], line
    decay = _line_of(modeling, "decay_weights = 0.5 ** torch.arange(predict_token_num)")
    assert {e.op for e in events_at(record, "cpu_fallback", decay)} == {"aten::arange", "aten::pow.Scalar"}
    # nn.TransformerEncoder's causal-mask check in the retriever waits for the device
    assert any(e.source.startswith(retriever.__file__) for e in record.of_kind("host_sync"))
    assert not record.of_kind("mixed_device") and not record.of_kind("fp64")

    torch.backends.mha.set_fastpath_enabled(False)
    try:
        reference = _aurora_forward(model, x)
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    assert torch.equal(out, reference)


def test_aurora_patch_set_removes_the_mask_copies(aurora_tiny):
    patches = pytest.importorskip("pytest_npu_parity.aurora.patches")
    import aurora.modeling_aurora as modeling
    import aurora.prototype_retriever as retriever

    model, x = aurora_tiny
    with patches.patched():
        out, record = _audit_aurora(model, x)
    h2d_code = [e.code for e in record.of_kind("h2d")]
    assert not [c for c in h2d_code if "causal_attention_mask" in c], record.format()
    decay = _line_of(modeling, "decay_weights = 0.5 ** torch.arange(predict_token_num)")
    assert not [e for e in record.events if e.source == decay]
    assert not [e for e in record.events if e.source.startswith(retriever.__file__) and e.kind == "h2d"
                and "causal_attention_mask" in e.code]
    # what the patch set leaves on purpose is still reported (period search, sinusoidal tables)
    assert record.of_kind("d2h") and record.of_kind("h2d")


def test_audit_overhead_is_bounded(aurora_tiny):
    """Logical audit vs plain CPU forward of the tiny Aurora, CPU time of this process (min of 3).
    Measured here: about 5.5x on a quiet machine (no-op dispatch + function modes alone: 2.5x), 12.1x
    once beside another pytest-xdist worker; the bound catches a cost that grows with the run (e.g. a
    record that is searched linearly per op), which is far larger. The figure itself is the benchmark's
    (benchmarks/bench_suite.py), not this test's."""
    model, x = aurora_tiny
    _aurora_forward(model, x)  # warm up
    _audit_aurora(model, x)
    plain, audited = [], []
    for _ in range(3):
        start = time.process_time()
        _aurora_forward(model, x)
        plain.append(time.process_time() - start)
        start = time.process_time()
        _audit_aurora(model, x)
        audited.append(time.process_time() - start)
    ratio = min(audited) / min(plain)
    print(f"tiny Aurora eval forward: plain {min(plain):.4f} s, audited {min(audited):.4f} s, ratio {ratio:.2f}")
    assert ratio < 25.0


# ---------------------------------------------------------------------------------------------
# Budgets (what --parity-audit judges), dtypes in messages, the plugin's own work
# ---------------------------------------------------------------------------------------------

def test_messages_name_the_dtype_of_mixed_device_and_cpu_ops():
    mod = load_pattern("factory_without_device")
    _, record = audit_call(mod.BuggyOnes(), (mod.make_input(),), target=TARGET, logical=True)
    (mixed,) = record.of_kind("mixed_device")
    assert mixed.dtype == "torch.float32"  # the stray CPU tensor's dtype
    assert "cuda:1 + cpu float32 at" in mixed.message()
    (cpu_op,) = record.of_kind("cpu_fallback")
    assert cpu_op.op == "aten::ones" and "cpu float32 (ran on the CPU" in cpu_op.message()


def test_default_budget_fails_every_kind_but_host_syncs():
    from pytest_npu_parity.audit import DEFAULT_AUDIT_BUDGET, AuditBudget

    assert DEFAULT_AUDIT_BUDGET == {"mixed_device": 0, "h2d": 0, "d2h": 0, "host_sync": None, "cpu_fallback": 0,
                                    "fp64": 0}
    budget = AuditBudget()
    for pattern, cls in (("factory_without_device", "BuggyOnes"), ("device_index", "Buggy"),
                         ("float64_constant", "Buggy"), ("hardcoded_cuda", "Buggy")):
        mod = load_pattern(pattern)
        buggy = getattr(mod, cls)
        _, record = audit_call(buggy(), (mod.make_input(),), target=TARGET, logical=True)
        text = budget.judge(record, "out")
        assert text and bug_source(buggy).rpartition(":")[2] in text and "# BUG" in text, text
        assert text.startswith("Device-propagation audit of check 'out' on the logical device cuda:1")
        _, clean = audit_call(mod.Fixed(), (mod.make_input(),), target=TARGET, logical=True)
        assert budget.judge(clean, "out") is None
    mod = load_pattern("item_in_loop")
    _, record = audit_call(mod.Buggy(), (mod.make_input(),), target=TARGET, logical=True)
    assert record.counts()["host_sync"] == 5 and budget.judge(record) is None  # counted, allowed
    assert budget.replace({"host_sync": 4}, source="check").excess(record) == {"host_sync": (5, 4)}


def test_judge_lists_only_the_kinds_over_budget_and_the_budget_that_would_pass():
    from pytest_npu_parity.audit import parse_audit_budget

    mod = load_pattern("cpu_only_op")
    _, record = audit_call(mod.ManualFallback(), (mod.make_input(),), target=TARGET, logical=True)
    counts = record.counts()
    assert counts["h2d"] == 1 and counts["d2h"] == 1 and counts["cpu_fallback"] >= 1
    budget = parse_audit_budget("h2d=1 d2h=1 # the manual pinv fallback", source="marker")
    text = budget.judge(record, "pinv")
    assert "cpu_fallback" in text and "h2d 1 (allowed" not in text
    assert all("CPU op" in line for line in text.splitlines()[1:-1]), text
    assert f"audit_budget={{'cpu_fallback': {counts['cpu_fallback']}}}" in text
    assert budget.reason == "the manual pinv fallback" and budget.source == "marker"
    assert parse_audit_budget({"cpu_fallback": "any"}, base=budget).judge(record) is None
    assert "--parity-audit-mode=warn" not in budget.judge(record, failing=False)


@pytest.mark.parametrize("spec, message", [
    ("h2=1", "unknown kind 'h2' (did you mean 'h2d'?)"),
    ({"h2d": -1}, "h2d=-1 must be a count >= 0 or 'any'"),
    ({"fp64": 1.5}, "fp64=1.5 must be a count"),
    ({"d2h": True}, "d2h=True must be a count"),
    ("h2d", "'h2d' is not kind=count"),
    (3, "must be a dict such as"),
    ({"h2d": 1, "reason": ""}, "reason must be a non-empty string"),
])
def test_bad_budget_specs_name_the_problem(spec, message):
    from pytest_npu_parity.audit import parse_audit_budget

    with pytest.raises(ValueError, match="audit budget") as info:
        parse_audit_budget(spec)
    assert message in str(info.value)


def test_budget_specs_merge_over_their_base():
    from pytest_npu_parity.audit import parse_audit_budget

    suite = parse_audit_budget({"h2d": 2, "reason": "cached table"}, source="suite")
    test = parse_audit_budget("d2h=1, host_sync=0", source="marker", base=suite)
    assert dict(test.allowed) == {"mixed_device": 0, "h2d": 2, "d2h": 1, "host_sync": 0, "cpu_fallback": 0, "fp64": 0}
    assert test.reason == "cached table" and test.source == "marker"
    assert test.describe() == "mixed_device 0, h2d 2, d2h 1, host_sync 0, cpu_fallback 0, fp64 0 # cached table"
    assert parse_audit_budget(None, base=test) is test and parse_audit_budget(test) is test


def test_record_round_trips_through_its_dict():
    mod = load_pattern("cpu_only_op")
    _, record = audit_call(mod.ManualFallback(), (mod.make_input(),), target=TARGET, logical=True)
    again = AuditRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert again.to_dict() == record.to_dict() and again.counts() == record.counts()


def test_not_audited_keeps_tracking_but_records_nothing():
    from pytest_npu_parity.audit import not_audited

    audit = DeviceAudit(TARGET, logical=True)
    x = audit.to_target(torch.ones(3))
    with audit:
        with not_audited():
            table = torch.arange(3.0).to(x.device)  # a host op and a copy: the plugin's, not counted
        y = x * table  # table is on the device now: no mixed-device op
        z = x + torch.ones(3)  # outside the block: counted
    assert torch.equal(y, torch.arange(3.0)) and torch.equal(z, torch.full((3,), 2.0))
    assert audit.device_of(table) == torch.device(TARGET)
    assert [(e.kind, e.op) for e in audit.record.events] == [("cpu_fallback", "aten::ones"),
                                                              ("mixed_device", "aten::add.Tensor")]


def test_backward_formulas_create_their_tensors_where_the_gradients_are():
    """Autograd's C++ backward passes the real (CPU) device to new_zeros/index_put in logical
    mode; inside a backward that means the gradients' device: no mixed-device op, no CPU op. The
    CPU index tensor of ``h[:, [0, 2]]`` is copied to the device in the forward and again in the
    backward (index_put), as on a real device."""
    audit = DeviceAudit(TARGET, logical=True)
    holder = torch.nn.ParameterList([torch.nn.Parameter(torch.linspace(-1.0, 1.0, 12).reshape(3, 4))])
    w = audit.to_target(holder)[0]  # a module's parameters are marked in place
    with audit:
        (w[:, [0, 2]] * 2).sum().backward()
    assert audit.device_of(w.grad) == torch.device(TARGET)
    kinds = sorted((e.kind, e.op) for e in audit.record.events)
    assert kinds == [("h2d", "aten::index.Tensor"), ("h2d", "aten::index_put")], audit.record.format()
    expected = torch.zeros(3, 4)
    expected[:, [0, 2]] = 2.0
    assert torch.equal(w.grad, expected)

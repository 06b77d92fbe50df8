"""Device propagation of every Aurora submodule and the whole model, over hypothesis-drawn shapes.

For each drawn example (``pytest_npu_parity.aurora.strategies``: batch sizes, context lengths including
non-multiples of the patch length, ``inference_token_len``, horizons, token counts, with and
without text, text lengths) the submodule runs once on the target under the NPU patch set and
under a device-propagation audit (``pytest_npu_parity.audit``), and the test asserts that

* every output is on the target, with the expected shape and dtype (float32);
* the audit's counts per kind equal what this file declares for that submodule and example
  (``EXPECTED`` costs below): no mixed-device op and no float64 anywhere, and exactly the known
  host round trips of upstream Aurora that the patch set leaves on purpose. A new host sync, CPU
  op or copy fails the test with the audit's table of events (op, devices, source line).

Targets: on a CPU target the run is audited on the *logical* device ``cuda:1`` over CPU tensors
(``DeviceAudit(DEFAULT_LOGICAL_TARGET, logical=True)``), so the tests do real work on a machine
without an accelerator; on an NPU/CUDA target the same tests run on the device (real-device mode).

Declared costs (measured with aurora-model 0.2.0, torch 2.14.1, transformers 4.57.6; each is an
upstream line the patch set does not change, see ``aurora/patches.py``):

* ``SINUSOIDAL_TABLE`` — ``sinusoidal_position_embedding`` builds the RoPE / position table with
  10 ops on the host and copies it (``.to(device)``): once per ``RoPE_decoder`` (every decoder
  layer's cross attention) and once per ``Retriever.forward``.
* ``TIMESTEP_TABLE`` — ``TimestepEmbedder.timestep_embedding``: 4 host ops (``arange``, ``mul``,
  ``div``, ``exp``) and a copy, once per flow-head call.
* ``SAMPLER_STEP`` — ``FlowLoss.sample`` builds ``t = ones(n) * i / steps`` on the host (3 ops, a
  copy) every sampling step, then calls the flow head (one ``TIMESTEP_TABLE``).
* ``SAMPLER_SETUP`` — ``FlowLoss.sample``'s ``randn(...).to`` and ``eye(...).to`` (2 host ops, 2 copies).
* ``PERIOD_SEARCH`` — ``UnifiedImageProcessor._period_search``: ``topk(...).cpu().numpy()`` (one
  device→host copy, the host sync docs/explanation/findings.md names).
* ``TEXT_SAMPLE`` — ``TextEncoder.extract_bert_features`` loops over the batch: per sample
  ``torch.where(mask == 1)`` (``nonzero``), the 0-dim index ``sep_pos`` read back (``.item()``) and a
  boolean-mask selection: 3 host syncs.
* ``BERT_MASK_CHECK`` — transformers' ``_prepare_4d_attention_mask_for_sdpa`` reads
  ``torch.all(mask == 1)``: 1 host sync per BERT call.
* ``CAUSAL_MASK_CHECK`` — ``nn.TransformerEncoder`` compares the given mask with a causal one
  (``_detect_is_causal_mask``, a ``bool`` of a device tensor): 1 host sync per encoder call (the
  retriever's encoder and decoder).
* ``LOSS_SELECTION`` — ``loss[loss < eps]`` (boolean-mask selection) in the training losses.
* ``REAL_IMAGE_UPLOAD`` — the real-image path (``vision_ids=``, ``generate(vision_inputs=...)``):
  ``ViTImageProcessor(..., return_tensors="pt")`` builds ``pixel_values`` on the host (NumPy/PIL) and
  the patch set's ``real_image_device`` copies them to the ViT's device: 1 host→device copy. Without
  the patch set upstream hands the host tensor to the ViT: a mixed-device ``aten::convolution``.
* ``SCALAR_SETITEM`` — ``t[i] = 0`` with a Python scalar: in logical mode PyTorch builds the
  scalar on the host and copies it (``aten::copy_``), on a real device it builds it on the device;
  so 1 host→device copy in logical mode only (``frequency_list[0] = 0``, ``valid_mask[i, sep_pos] = 0``).

Without the patch set the causal masks (decoder self-attention, retriever) and the decoder's
``decay_weights`` are host-built too (``tests/diagnose/test_audit.py`` shows them); under it they are built on
the target and appear nowhere here. Where the target lacks ``pinv`` or FFT (``npu``: pinv), the
patch set computes them on the host by design (``patches.resample``, ``patches.rfft``): events whose
source is the patch module are then allowed (host ops and copies only) and not counted.
"""
from __future__ import annotations

import copy
import contextlib
import math
import os
from dataclasses import dataclass, fields
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytest_npu_parity.runtime.audit import DEFAULT_LOGICAL_TARGET, KINDS, AuditRecord, DeviceAudit
from pytest_npu_parity.aurora import factory, inputs, patches
from pytest_npu_parity.aurora import strategies as aurora_st
from pytest_npu_parity.hypothesis_profiles import examples_for

#: Flow-head channels and ``num_distill`` come from the package config (same for tiny and full).
TOKEN_LEN = aurora_st.TOKEN_LEN
CLS_ID, SEP_ID, PAD_ID = 101, 102, 0  # BERT uncased (aurora-model's bert_config vocabulary)


# ------------------------------------------------------------------------------------------------
# Declared costs
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cost:
    """Expected audit events per kind (mixed-device ops and float64 are always expected to be 0)."""

    h2d: int = 0
    d2h: int = 0
    host_sync: int = 0
    cpu_fallback: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def __mul__(self, n: int) -> "Cost":
        return Cost(*(getattr(self, f.name) * n for f in fields(self)))

    __rmul__ = __mul__

    def counts(self) -> dict[str, int]:
        """Every kind of ``audit.KINDS``, as ``AuditRecord.counts()`` lists them."""
        return {kind: getattr(self, kind, 0) for kind in KINDS}


NOTHING = Cost()
SINUSOIDAL_TABLE = Cost(cpu_fallback=10, h2d=1)
TIMESTEP_TABLE = Cost(cpu_fallback=4, h2d=1)
SAMPLER_STEP = Cost(cpu_fallback=3, h2d=1) + TIMESTEP_TABLE
SAMPLER_SETUP = Cost(cpu_fallback=2, h2d=2)
PERIOD_SEARCH = Cost(d2h=1)
TEXT_SAMPLE = Cost(host_sync=3)
BERT_MASK_CHECK = Cost(host_sync=1)
CAUSAL_MASK_CHECK = Cost(host_sync=1)
LOSS_SELECTION = Cost(host_sync=1)
REAL_IMAGE_UPLOAD = Cost(h2d=1)
# Upstream without the patch set (what the patch set removes):
HOST_CAUSAL_MASK = Cost(cpu_fallback=3, h2d=1)  # causal_attention_mask(n).to(x.device): ones, mul, triu, copy
HOST_DECAY_WEIGHTS = Cost(cpu_fallback=2, h2d=1)  # 0.5 ** torch.arange(n), then .to(x_enc.device)


def scalar_setitem(logical: bool) -> Cost:
    """``t[i] = <Python scalar>``: a host→device copy in logical mode only (see module docstring)."""
    return Cost(h2d=1) if logical else NOTHING


def vision_cost(logical: bool) -> Cost:
    """``VisionEncoder`` (pseudo-image path): the period search and its ``frequency_list[0] = 0``."""
    return PERIOD_SEARCH + scalar_setitem(logical)


def text_cost(batch: int, logical: bool) -> Cost:
    """``TextEncoder`` on ``batch`` samples: the per-sample loop and BERT's mask check."""
    return batch * (TEXT_SAMPLE + scalar_setitem(logical)) + BERT_MASK_CHECK


def retriever_cost() -> Cost:
    """``PrototypeRetriever``: two ``nn.TransformerEncoder`` mask checks and one position table."""
    return 2 * CAUSAL_MASK_CHECK + SINUSOIDAL_TABLE


def sampler_cost(steps: int) -> Cost:
    """``FlowLoss.sample`` with ``steps`` sampling steps (``resample`` of the identity runs on the target)."""
    return SAMPLER_SETUP + steps * SAMPLER_STEP


def model_cost(model: torch.nn.Module, text: bool, batch: int, logical: bool, real_images: bool = False) -> Cost:
    """Encoders, decoder layers and retriever of one ``AuroraForPrediction`` forward (no flow head);
    ``real_images``: the vision encoder sees real images (``vision_ids``) instead of the pseudo-image."""
    vision = REAL_IMAGE_UPLOAD if real_images else vision_cost(logical)
    cost = vision + model.config.num_dec_layers * SINUSOIDAL_TABLE + retriever_cost()
    return cost + text_cost(batch, logical) if text else cost


# ------------------------------------------------------------------------------------------------
# The target and the audited run
# ------------------------------------------------------------------------------------------------

@dataclass
class AuditTarget:
    """Where the property tests run: the session's target, or the logical ``cuda:1`` for a CPU target.

    Attributes:
        device: the audited device (``cuda:1`` logical, or the real target).
        logical: True for the logical-device mode.
        pinv_on_target / fft_on_target: whether the patch set computes ``pinv`` / FFT on the target
            (otherwise on the host, by design).
    """

    device: torch.device
    logical: bool
    pinv_on_target: bool = True
    fft_on_target: bool = True

    def audit(self) -> DeviceAudit:
        """A fresh audit of this target."""
        return DeviceAudit(self.device, logical=self.logical)

    def patch_set(self) -> contextlib.AbstractContextManager:
        """The NPU patch set for this target; a logical device keeps FFT on the device (no probe)."""
        if self.logical:
            return patches.patched(self.device, fft_fallback=False)
        return patches.patched(self.device)

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``module`` on the target (logical: the copy's tensors are marked as living there)."""
        return self.audit().to_target(copy.deepcopy(module))

    def on_target(self, tensor: torch.Tensor, audit: DeviceAudit) -> bool:
        """Whether ``tensor`` lives on the target for ``audit``."""
        return audit.device_of(tensor) == self.device


@pytest.fixture(scope="module")
def audit_target(parity_session) -> AuditTarget:
    """The session's target as an :class:`AuditTarget` (skipped without ``--npu-parity``).

    The patch set probes once per process and device type whether the target has ``pinv`` / FFT
    (a tiny op and a ``.cpu()``). On a logical device the probe must run under an audit (a plain
    probe would try the real CUDA runtime and report "no FFT"), and a probe inside a measured run
    would add its copy to that run's record; so it runs here first.
    """
    target = parity_session.target
    if target.type == "cpu":
        device, logical = torch.device(DEFAULT_LOGICAL_TARGET), True
    else:
        device, logical = target, False
    with DeviceAudit(device, logical=logical):
        pinv = patches.device_supports_pinv(device)
        fft = patches.device_supports_fft(device)
    return AuditTarget(device, logical, pinv_on_target=pinv, fft_on_target=fft)


@pytest.fixture(scope="module")
def tiny(audit_target) -> torch.nn.Module:
    """The seeded tiny Aurora (eval) on the target."""
    return audit_target.place(factory.get_model("tiny", seed=0))


@pytest.fixture(scope="module")
def tiny_train(audit_target) -> torch.nn.Module:
    """The seeded tiny Aurora in training mode on the target (a copy; the cached model stays in eval)."""
    return audit_target.place(factory.get_model("tiny", seed=0)).train()


@pytest.fixture(scope="module")
def full(audit_target) -> torch.nn.Module:
    """The seeded full Aurora (eval; the suite's model, shared with the ``aurora`` fixture's cache).

    Logical mode marks the cached model's tensors in place (no 840 MB copy; marks only matter
    inside an audit); a real target gets a copy on the device.
    """
    model = factory.get_model("full", seed=int(os.environ.get("NPU_PARITY_AURORA_SEED", "0")),
                              checkpoint=os.environ.get("NPU_PARITY_AURORA_CHECKPOINT") or None)
    if audit_target.logical:
        return audit_target.audit().to_target(model)
    return audit_target.place(model)


def audited(target: AuditTarget, fn: Callable[..., Any], *args: Any, grad: bool = False, patched: bool = True,
            **kwargs: Any) -> tuple[Any, DeviceAudit]:
    """Run ``fn(*args, **kwargs)`` once on the target under the patch set (unless ``patched`` is
    False: upstream as shipped) and a fresh audit.

    Tensors in ``args``/``kwargs`` are put on the target first (``DeviceAudit.to_target``); the
    module ``fn`` belongs to must already be there. Returns ``(output, audit)``.
    """
    audit = target.audit()
    args, kwargs = audit.to_target(args), audit.to_target(kwargs)
    with target.patch_set() if patched else contextlib.nullcontext(), torch.set_grad_enabled(grad):
        output = audit.run(fn, *args, **kwargs)
    return output, audit


def _patch_module_fallbacks(target: AuditTarget, record: AuditRecord) -> list:
    """Events the patch set causes by design on a target without pinv/FFT (its host fallbacks)."""
    if target.pinv_on_target and target.fft_on_target:
        return []
    return [e for e in record.events if os.path.abspath(e.source.rpartition(":")[0]) == patches.__file__]


def assert_propagation(target: AuditTarget, audit: DeviceAudit, what: str, example: Any, outputs: dict,
                       cost: Cost) -> None:
    """Outputs on the target with the expected shapes/dtypes, and audit counts equal to ``cost``.

    Args:
        outputs: ``{name: (tensor, expected shape, expected dtype)}``.

    Raises:
        AssertionError: naming the submodule, the example and every event of the audit.
    """
    record = audit.record
    problems = []
    for name, (tensor, shape, dtype) in outputs.items():
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name}: expected a tensor, got {type(tensor).__name__}")
            continue
        if not target.on_target(tensor, audit):
            problems.append(f"{name}: on {audit.device_of(tensor)}, expected {target.device}")
        if tuple(tensor.shape) != tuple(shape):
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(shape)}")
        if tensor.dtype != dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, expected {dtype}")
    by_design = _patch_module_fallbacks(target, record)
    wrong_kind = [e for e in by_design if e.kind not in ("h2d", "d2h", "cpu_fallback")]
    counts = record.counts()
    for event in by_design:
        counts[event.kind] -= event.count
    expected = cost.counts()
    if counts != expected or wrong_kind:
        diff = ", ".join(f"{k} {counts[k]} (declared {expected[k]})" for k in KINDS if counts[k] != expected[k])
        problems.append(f"audit counts differ from the declared costs: {diff or 'patch-set events of a wrong kind'}")
    if problems:
        raise AssertionError(f"{what} on {target.device} ({'logical' if target.logical else 'real'}) for {example}:\n  "
                             + "\n  ".join(problems) + "\n" + record.format())


# ------------------------------------------------------------------------------------------------
# Inputs of a drawn shape
# ------------------------------------------------------------------------------------------------

def series(ex: aurora_st.AuroraShapes) -> inputs.AuroraBatch:
    """Real Mauna Loa CO2 windows of the example's batch, context and horizon, standardized per window."""
    return inputs.make_batch(ex.batch, ex.context, (ex.horizon,)).normalized()


def text_tokens(ex: aurora_st.AuroraShapes, batch: inputs.AuroraBatch) -> dict[str, torch.Tensor]:
    """BERT token ids ``[B, T]`` for the example's text layout, from the windows' real descriptions.

    Sample i holds ``[CLS]``, the first ``text_words[i]`` word pieces of its description (repeated
    when the description is shorter), ``[SEP]``, then padding; ``attention_mask`` marks the first
    ``text_words[i] + 2`` positions.
    """
    ids = torch.full((ex.batch, ex.text_seq_len), PAD_ID, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, words in enumerate(ex.text_words):
        row = batch.text_input_ids[i]
        pieces = row[1:int((row == SEP_ID).nonzero()[0, 0])]
        body = pieces.repeat(math.ceil(words / len(pieces)) if words else 0)[:words]
        ids[i, :words + 2] = torch.cat([torch.tensor([CLS_ID]), body, torch.tensor([SEP_ID])])
        mask[i, :words + 2] = 1
    return {"text_input_ids": ids, "text_attention_mask": mask, "text_token_type_ids": torch.zeros_like(ids)}


def bert_inputs(tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``TextEncoder``'s input dict from :func:`text_tokens`."""
    return {"input_ids": tokens["text_input_ids"], "attention_mask": tokens["text_attention_mask"],
            "token_type_ids": tokens["text_token_type_ids"]}


def noise(seed: int, *shape: int) -> torch.Tensor:
    """Seeded standard-normal float32 activations of ``shape`` (values do not matter here, shapes do)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


F32 = torch.float32


@st.composite
def layer_shapes(draw: Any, max_batch: int = 4, max_tokens: int = 32) -> dict[str, int]:
    """``batch``, query tokens ``q``, key tokens ``k`` and a ``seed`` for layer-level tests."""
    return {"batch": draw(aurora_st.batch_sizes(max_batch)), "q": draw(aurora_st.token_counts(max_tokens)),
            "k": draw(aurora_st.token_counts(max_tokens)), "seed": draw(st.integers(0, 2**16))}


# ------------------------------------------------------------------------------------------------
# Submodules of the tiny model
# ------------------------------------------------------------------------------------------------

@given(ex=aurora_st.aurora_shapes(text=False))
def test_patch_embedding_eval(audit_target, tiny, ex):
    embed = tiny.model.embed_layer
    (tokens, masked), audit = audited(audit_target, embed, series(ex).context, ex.inference_token_len)
    assert masked is None
    assert_propagation(audit_target, audit, "AuroraPatchEmbedding (eval)", ex, {
        "tokens": (tokens, (ex.batch, ex.input_tokens, tiny.config.hidden_size), F32)}, NOTHING)


@given(ex=aurora_st.training_shapes(text=False))
def test_patch_embedding_train(audit_target, tiny_train, ex):
    embed = tiny_train.model.embed_layer
    (origin, masked), audit = audited(audit_target, embed, series(ex).context)
    masks = len(tiny_train.config.threshold_ratio)
    hidden = tiny_train.config.hidden_size
    assert_propagation(audit_target, audit, "AuroraPatchEmbedding (train, frequency masking)", ex, {
        "tokens": (origin, (ex.batch, ex.train_input_tokens, hidden), F32),
        "masked": (masked, (masks * ex.batch, ex.train_input_tokens, hidden), F32)}, NOTHING)


@given(ex=layer_shapes())
def test_attention(audit_target, tiny, ex):
    import aurora.modeling_aurora as modeling

    layer = tiny.model.dec_layers[0]
    hidden, heads, distill = tiny.config.hidden_size, tiny.config.num_attention_heads, tiny.config.num_distill
    b, q, k = ex["batch"], ex["q"], ex["k"]
    x, ctx, feats = noise(ex["seed"], b, q, hidden), noise(ex["seed"] + 1, b, k, hidden), noise(ex["seed"] + 2, b, distill, hidden)

    def self_attention(x):  # the mask as the patched decoder layer builds it: on the input's device
        mask = modeling.causal_attention_mask(x.shape[1], device=x.device, dtype=x.dtype)
        return layer.self_attn(x, attention_mask=mask)[0]

    out, audit = audited(audit_target, self_attention, x)
    assert_propagation(audit_target, audit, "AuroraAttention (causal self-attention)", ex,
                       {"output": (out, (b, q, hidden), F32)}, NOTHING)
    (out, _), audit = audited(audit_target, layer.cross_attn, x, ctx, ctx)
    assert_propagation(audit_target, audit, "AuroraAttention (cross-attention with RoPE)", ex,
                       {"output": (out, (b, q, hidden), F32)}, SINUSOIDAL_TABLE)
    (out, scores), audit = audited(audit_target, tiny.model.VisionGuider, x, feats, feats, output_attentions=True)
    assert_propagation(audit_target, audit, "AuroraAttention (guider)", ex, {
        "output": (out, (b, q, hidden), F32), "scores": (scores, (b, heads, q, distill), F32)}, NOTHING)


@given(ex=layer_shapes(), guided=st.booleans())
def test_encoder_layer(audit_target, tiny, ex, guided):
    hidden, heads = tiny.config.hidden_size, tiny.config.num_attention_heads
    b, n = ex["batch"], ex["q"]
    x = noise(ex["seed"], b, n, hidden)
    bias = noise(ex["seed"] + 1, b, heads, n, n) if guided else None
    (out, _), audit = audited(audit_target, tiny.model.enc_layers[0], x, bias=bias)
    assert_propagation(audit_target, audit, "AuroraEncoderLayer", (ex, guided),
                       {"output": (out, (b, n, hidden), F32)}, NOTHING)


@given(ex=layer_shapes())
def test_decoder_layer(audit_target, tiny, ex):
    hidden = tiny.config.hidden_size
    b, q, k = ex["batch"], ex["q"], ex["k"]
    (out, _, _), audit = audited(audit_target, tiny.model.dec_layers[-1], noise(ex["seed"], b, q, hidden),
                                 noise(ex["seed"] + 1, b, k, hidden))
    assert_propagation(audit_target, audit, "AuroraDecoderLayer", ex,
                       {"output": (out, (b, q, hidden), F32)}, SINUSOIDAL_TABLE)


@given(ex=layer_shapes(), patch=aurora_st.inference_token_lens())
def test_predict_head(audit_target, tiny, ex, patch):
    b, n = ex["batch"], ex["q"]
    out, audit = audited(audit_target, tiny.linear_head, noise(ex["seed"], b, n, tiny.config.hidden_size),
                         inference_token_len=patch)
    assert_propagation(audit_target, audit, "AuroraPredictHead (eval)", (ex, patch),
                       {"forecast": (out, (b, n, patch), F32)}, NOTHING)


@given(ex=aurora_st.aurora_shapes(text=False))
def test_vision_encoder(audit_target, tiny, ex):
    out, audit = audited(audit_target, tiny.model.VisionEncoder, series(ex).context)
    assert_propagation(audit_target, audit, "VisionEncoder", ex, {
        "features": (out, (ex.batch, tiny.config.num_distill, tiny.config.hidden_size), F32)},
        vision_cost(audit_target.logical))


@given(batch=aurora_st.batch_sizes(3), crop=st.integers(16, 427))
def test_vision_encoder_real_images(audit_target, tiny, batch, crop):
    """Real photographs of any size (the processor resizes them to 224×224): the patch set's one
    host→device copy of ``pixel_values`` and nothing else."""
    out, audit = audited(audit_target, tiny.model.VisionEncoder, inputs.real_images(batch, crop), type="real")
    assert_propagation(audit_target, audit, "VisionEncoder (real images)", (batch, crop), {
        "features": (out, (batch, tiny.config.num_distill, tiny.config.hidden_size), F32)}, REAL_IMAGE_UPLOAD)


@settings(max_examples=examples_for(0.5))
@given(batch=aurora_st.batch_sizes(3), crop=st.integers(16, 427))
def test_without_the_patch_set_real_images_reach_the_vit_on_the_host(audit_target, logical_only, tiny, batch, crop):
    """Upstream as shipped: ``process_real_image`` returns the processor's host tensor and the ViT's
    patch convolution mixes it with the device weights (one mixed-device op), so the declared cost
    of the patched run fails; the patched run above passes it."""
    out, audit = audited(audit_target, tiny.model.VisionEncoder, inputs.real_images(batch, crop), type="real",
                         patched=False)
    mixed = audit.record.of_kind("mixed_device")
    assert [(e.op, e.count) for e in mixed] == [("aten::convolution", 1)], audit.record.format()
    assert "modeling_vit.py" in mixed[0].source and set(mixed[0].devices) == {str(audit_target.device), "cpu"}
    with pytest.raises(AssertionError, match=r"mixed_device 1 \(declared 0\)"):
        assert_propagation(audit_target, audit, "VisionEncoder (real images, no patch set)", (batch, crop), {
            "features": (out, (batch, tiny.config.num_distill, tiny.config.hidden_size), F32)}, REAL_IMAGE_UPLOAD)


@given(ex=aurora_st.aurora_shapes(text=True))
def test_text_encoder(audit_target, tiny, ex):
    tokens = bert_inputs(text_tokens(ex, series(ex)))
    out, audit = audited(audit_target, tiny.model.TextEncoder, tokens)
    assert_propagation(audit_target, audit, "TextEncoder", ex, {
        "features": (out, (ex.batch, tiny.config.num_distill, tiny.config.hidden_size), F32)},
        text_cost(ex.batch, audit_target.logical))


@given(ex=layer_shapes(), text=st.booleans())
def test_modality_connector(audit_target, tiny, ex, text):
    hidden, distill = tiny.config.hidden_size, tiny.config.num_distill
    b, n = ex["batch"], ex["q"]
    x = noise(ex["seed"], b, n, hidden)
    text_features = noise(ex["seed"] + 1, b, distill, hidden) if text else None
    (from_text, from_vision), audit = audited(audit_target, tiny.model.ModalityConnector, x, text_features,
                                              noise(ex["seed"] + 2, b, distill, hidden))
    outputs = {"from_vision": (from_vision, (b, n, hidden), F32)}
    if text:
        outputs["from_text"] = (from_text, (b, n, hidden), F32)
    else:
        assert from_text is None
    assert_propagation(audit_target, audit, "ModalityConnector", (ex, text), outputs, NOTHING)


@given(ex=layer_shapes(max_tokens=24))
def test_prototype_retriever(audit_target, tiny, ex):
    b, k, f = ex["batch"], ex["k"], ex["q"]
    out, audit = audited(audit_target, tiny.retriever, noise(ex["seed"], b, k, tiny.config.hidden_size), f)
    assert_propagation(audit_target, audit, "PrototypeRetriever", ex,
                       {"prototypes": (out, (b, f, TOKEN_LEN), F32)}, retriever_cost())


@given(ex=layer_shapes(max_tokens=16), patch=aurora_st.inference_token_lens(), samples=st.integers(1, 3),
       prototype=st.booleans())
def test_flow_sample(audit_target, tiny, ex, patch, samples, prototype):
    rows = ex["batch"] * ex["q"]
    z = noise(ex["seed"], rows, tiny.config.hidden_size)
    protos = noise(ex["seed"] + 1, rows, TOKEN_LEN) if prototype else None
    out, audit = audited(audit_target, tiny.flow_match.sample, z, prototype=protos, num_samples=samples,
                         inference_token_len=patch)
    assert_propagation(audit_target, audit, "FlowLoss.sample", (ex, patch, samples, prototype),
                       {"samples": (out, (rows, samples, patch), F32)}, sampler_cost(tiny.config.num_sampling_steps))


@given(ex=layer_shapes(max_tokens=16), prototype=st.booleans(), padded=st.integers(0, TOKEN_LEN - 1))
def test_flow_loss_train(audit_target, tiny_train, ex, prototype, padded):
    rows = ex["batch"] * ex["q"]
    target = noise(ex["seed"], rows, TOKEN_LEN)
    z = noise(ex["seed"] + 1, rows, tiny_train.config.hidden_size)
    protos = noise(ex["seed"] + 2, rows, TOKEN_LEN) if prototype else None
    mask = torch.tensor([[1.0] * (TOKEN_LEN - padded) + [0.0] * padded]) if padded else None
    loss, audit = audited(audit_target, tiny_train.flow_match, target, z, prototype=protos, mask=mask)
    assert_propagation(audit_target, audit, "FlowLoss (train)", (ex, prototype, padded),
                       {"loss": (loss, (), F32)}, TIMESTEP_TABLE + LOSS_SELECTION)


# ------------------------------------------------------------------------------------------------
# The whole tiny model
# ------------------------------------------------------------------------------------------------

@settings(max_examples=examples_for(0.5))
@given(ex=aurora_st.aurora_shapes())
def test_forward_eval(audit_target, tiny, ex):
    batch = series(ex)
    kwargs = {"input_ids": batch.context, "max_output_length": ex.horizon,
              "inference_token_len": ex.inference_token_len, "num_samples": ex.num_samples}
    if ex.text:
        kwargs.update(text_tokens(ex, batch))
    out, audit = audited(audit_target, tiny, **kwargs)
    cost = model_cost(tiny, ex.text, ex.batch, audit_target.logical) + sampler_cost(tiny.config.num_sampling_steps)
    assert_propagation(audit_target, audit, "AuroraForPrediction.forward (eval)", ex,
                       {"forecast": (out.logits, (ex.batch, ex.num_samples, ex.horizon), F32)}, cost)


@settings(max_examples=examples_for(0.5))
@given(ex=aurora_st.aurora_shapes())
def test_generate(audit_target, tiny, ex):
    batch = series(ex)
    kwargs = text_tokens(ex, batch) if ex.text else {}
    out, audit = audited(audit_target, tiny.generate, inputs=batch.context, max_output_length=ex.horizon,
                         inference_token_len=ex.inference_token_len, num_samples=ex.num_samples, **kwargs)
    cost = model_cost(tiny, ex.text, ex.batch, audit_target.logical) + sampler_cost(tiny.config.num_sampling_steps)
    assert_propagation(audit_target, audit, "AuroraForPrediction.generate", ex,
                       {"forecast": (out, (ex.batch, ex.num_samples, ex.horizon), F32)}, cost)


@settings(max_examples=examples_for(0.5))
@given(ex=aurora_st.aurora_shapes(), crop=st.integers(16, 427))
def test_generate_real_images(audit_target, tiny, ex, crop):
    """``generate(vision_inputs=<photographs>)``: the vision branch costs the one image upload instead
    of the period search."""
    batch = series(ex)
    kwargs = text_tokens(ex, batch) if ex.text else {}
    out, audit = audited(audit_target, tiny.generate, inputs=batch.context, vision_inputs=inputs.real_images(ex.batch, crop),
                         max_output_length=ex.horizon, inference_token_len=ex.inference_token_len,
                         num_samples=ex.num_samples, **kwargs)
    cost = (model_cost(tiny, ex.text, ex.batch, audit_target.logical, real_images=True)
            + sampler_cost(tiny.config.num_sampling_steps))
    assert_propagation(audit_target, audit, "AuroraForPrediction.generate (real images)", (ex, crop),
                       {"forecast": (out, (ex.batch, ex.num_samples, ex.horizon), F32)}, cost)


@settings(max_examples=examples_for(0.5))
@given(ex=aurora_st.training_shapes())
def test_forward_train(audit_target, tiny_train, ex):
    batch = series(ex)
    kwargs = {"input_ids": batch.context, "labels": batch.labels[ex.horizon]}
    if ex.text:
        kwargs.update(text_tokens(ex, batch))
    out, audit = audited(audit_target, tiny_train, **kwargs)
    cost = (model_cost(tiny_train, ex.text, ex.batch, audit_target.logical)
            + 2 * LOSS_SELECTION + TIMESTEP_TABLE + LOSS_SELECTION)  # point losses, then the flow loss
    assert_propagation(audit_target, audit, "AuroraForPrediction.forward (train loss)", ex,
                       {"loss": (out.loss, (), F32)}, cost)


@pytest.fixture(scope="module")
def logical_only(audit_target) -> None:
    """Upstream Aurora without the patch set may not run on a real NPU at all (that is why the patch
    set exists); its host round trips are measured on the logical device."""
    if not audit_target.logical:
        pytest.skip("unpatched upstream runs are audited on a CPU target (logical device) only")


@settings(max_examples=examples_for(0.5))
@given(ex=aurora_st.aurora_shapes(text=False))
def test_without_the_patch_set_masks_are_built_on_the_host(audit_target, logical_only, tiny, ex):
    """Upstream as shipped: every causal mask (decoder layers, retriever encoder and decoder) and the
    decay weights are built on the host and copied each forward; the patched runs above have none."""
    kwargs = {"input_ids": series(ex).context, "max_output_length": ex.horizon,
              "inference_token_len": ex.inference_token_len, "num_samples": ex.num_samples}
    out, audit = audited(audit_target, tiny, patched=False, **kwargs)
    upstream = ((tiny.config.num_dec_layers + 2) * HOST_CAUSAL_MASK + HOST_DECAY_WEIGHTS)
    cost = (model_cost(tiny, False, ex.batch, audit_target.logical) + sampler_cost(tiny.config.num_sampling_steps)
            + upstream)
    assert_propagation(audit_target, audit, "AuroraForPrediction.forward (eval, no patch set)", ex,
                       {"forecast": (out.logits, (ex.batch, ex.num_samples, ex.horizon), F32)}, cost)


def test_a_new_host_sync_fails_the_declared_cost(audit_target, tiny):
    """The check has teeth: a forward hook that reads a value back (``.item()``) inside a decoder
    layer is one host sync beyond the declared cost, and the failure names its source line."""
    layer = tiny.model.dec_layers[0]

    def read_back(module, args, output):
        output[0].sum().item()  # the new host sync

    handle = layer.register_forward_hook(read_back)
    try:
        (out, _, _), audit = audited(audit_target, layer, noise(0, 2, 3, tiny.config.hidden_size),
                                     noise(1, 2, 5, tiny.config.hidden_size))
    finally:
        handle.remove()
    with pytest.raises(AssertionError, match=r"host_sync 1 \(declared 0\)") as info:
        assert_propagation(audit_target, audit, "AuroraDecoderLayer with a read-back", "2x3 tokens",
                           {"output": (out, (2, 3, tiny.config.hidden_size), F32)}, SINUSOIDAL_TABLE)
    assert "test_device_propagation.py" in str(info.value) and "output[0].sum().item()" in str(info.value)


def test_parity_check_records_the_audit(parity_session, audit_target):
    """``--parity-audit`` glue: a check's record carries the audit of its target run, with the
    declared counts, while its numbers come from an unaudited run (on a CPU target the audited run
    is an extra, logical one: its function mode turns off the transformer fast path, so its output
    differs from the plain run's in the last bits; the check compares the plain run bitwise)."""
    from pytest_npu_parity.runner import ParityCase, ParitySession, target_audit

    session = ParitySession(parity_session.target, reference="cpu", audit_factory=target_audit)
    case = ParityCase(session, "test_device_propagation::glue", "fp32", patches=lambda device: patches.patched(device))
    model = factory.get_model("tiny", seed=0)
    ex = aurora_st.AuroraShapes(batch=2, context=150, horizon=96)
    batch = series(ex)
    record = case.check("vision_encoder", model.model.VisionEncoder, batch.context)
    assert record.audit["counts"] == vision_cost(audit_target.logical).counts(), record.audit
    assert record.audit["target"] == str(audit_target.device) and record.audit["logical"] is audit_target.logical
    assert record.rows()[0]["audit_d2h"] == PERIOD_SEARCH.d2h
    x = noise(0, 2, ex.input_tokens, model.config.hidden_size)
    record = case.check("prototype_retriever", model.retriever, x, ex.predict_tokens)
    assert record.audit["counts"] == retriever_cost().counts(), record.audit
    if parity_session.target.type == "cpu":  # the unaudited, patched CPU run: bitwise the upstream reference
        assert record.result.leaves[0].max_abs == 0.0


# ------------------------------------------------------------------------------------------------
# The full model's cheap parts (a few examples; nightly scales them with the profile)
# ------------------------------------------------------------------------------------------------

@settings(max_examples=examples_for(0.2))
@given(ex=aurora_st.aurora_shapes(max_batch=2, max_context=512, text=True, max_text_seq_len=64))
def test_full_model_parts(audit_target, full, ex):
    hidden, distill = full.config.hidden_size, full.config.num_distill
    batch = series(ex)
    (tokens, _), audit = audited(audit_target, full.model.embed_layer, batch.context, ex.inference_token_len)
    assert_propagation(audit_target, audit, "full AuroraPatchEmbedding", ex,
                       {"tokens": (tokens, (ex.batch, ex.input_tokens, hidden), F32)}, NOTHING)
    (x_dec, _, _), audit = audited(audit_target, full.model.dec_layers[0],
                                   noise(ex.seed, ex.batch, ex.predict_tokens, hidden), tokens)
    assert_propagation(audit_target, audit, "full AuroraDecoderLayer", ex,
                       {"output": (x_dec, (ex.batch, ex.predict_tokens, hidden), F32)}, SINUSOIDAL_TABLE)
    out, audit = audited(audit_target, full.linear_head, x_dec, inference_token_len=ex.inference_token_len)
    assert_propagation(audit_target, audit, "full AuroraPredictHead", ex,
                       {"forecast": (out, (ex.batch, ex.predict_tokens, ex.inference_token_len), F32)}, NOTHING)
    out, audit = audited(audit_target, full.model.VisionEncoder, batch.context)
    assert_propagation(audit_target, audit, "full VisionEncoder (ViT-base)", ex,
                       {"features": (out, (ex.batch, distill, hidden), F32)}, vision_cost(audit_target.logical))
    out, audit = audited(audit_target, full.model.TextEncoder, bert_inputs(text_tokens(ex, batch)))
    assert_propagation(audit_target, audit, "full TextEncoder (BERT-base)", ex,
                       {"features": (out, (ex.batch, distill, hidden), F32)}, text_cost(ex.batch, audit_target.logical))
    out, audit = audited(audit_target, full.retriever, tokens, ex.predict_tokens)
    assert_propagation(audit_target, audit, "full PrototypeRetriever", ex,
                       {"prototypes": (out, (ex.batch, ex.predict_tokens, TOKEN_LEN), F32)}, retriever_cost())

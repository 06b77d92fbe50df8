"""The Aurora check catalogue: every submodule, function and whole-model computation the suite compares.

Each ``AuroraCheck`` says how to call one computation of the real upstream model on real input
(Mauna Loa CO2 windows and their text descriptions, see ``inputs``): a name, the submodule's dotted
path inside ``AuroraForPrediction``, the group it is counted under in the summary, and a ``build``
function returning ``(callable, args, kwargs)``. The parity suite parametrizes over the catalogue;
the sensitivity tests and ``--parity-selfcheck`` use the same entries, so a check proven to have
teeth is exactly the check that runs.

Submodule inputs are the activations those submodules receive in one eval forward of the full model
on the batch (``inputs.capture_submodule_inputs``), so every layer sees realistic values.

Functions are called through their module attribute at call time (``aurora.modeling_aurora.resample``
and so on), so the target side runs the patched function and the reference side the upstream one.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..diagnose.selfcheck import scaled_parameter, sensitive_parameter  # noqa: F401 - re-exported
from ..judge.forecast import forecast_metrics
from . import inputs as aurora_inputs

#: Forecast horizon of the whole-model checks (two 48-step tokens) and a non-multiple of 48.
HORIZON = 96
ODD_HORIZON = 80
#: Number of decoder layers of the full config (config.json num_dec_layers).
DEC_LAYERS = 9
#: The weight whole-model faults scale (a decoder FFN's first linear, inside AuroraForPrediction).
DECODER_FAULT = "model.dec_layers.4.ffn_layer.ffn.0.weight"
#: The weight the training-step check's faults scale (in the tiny model).
TRAIN_STEP_FAULT = "model.dec_layers.0.ffn_layer.ffn.0.weight"
#: Samples per series of the sampling checks (``num_samples``): enough for a distribution-level
#: comparison (``distribution``; ``--parity-rng device``), small enough for a cheap check.
NUM_SAMPLES = 32
#: The sample axis of ``FlowLoss.sample`` (``[rows, num_samples, patch]``) and ``generate``
#: (``[batch, num_samples, horizon]``).
SAMPLE_DIM = 1


@dataclass(repr=False)
class AuroraContext:
    """What every check is built from: the model, the batch and captured submodule inputs.

    Attributes:
        model: the seeded ``AuroraForPrediction`` (eval mode, CPU, float32); never mutated.
        batch: the real input batch (``inputs.AuroraBatch``).
        captured: ``{submodule name: (args, kwargs)}`` from one eval forward (horizon ``HORIZON``).
        extras: derived tensors (``x_dec``, ``prototypes``, flow-loss inputs) and extra modules.
    """

    model: torch.nn.Module
    batch: Any
    captured: dict[str, tuple[tuple, dict]]
    extras: dict[str, Any]

    def __repr__(self) -> str:
        # Short: pytest shows a failing test's arguments, and the default repr formats the whole
        # model and every captured tensor (about 0.1 s per failure, for every red check).
        params = sum(p.numel() for p in self.model.parameters())
        return (f"AuroraContext(model={type(self.model).__name__} ({params / 1e6:.1f} M parameters), "
                f"batch={type(self.batch).__name__}, captured={len(self.captured)} submodule inputs, "
                f"extras={sorted(self.extras)})")

    def submodule(self, name: str) -> torch.nn.Module:
        """The submodule at dotted path ``name`` (``KeyError`` naming it if absent)."""
        return self.model.get_submodule(name)

    def inputs_of(self, name: str) -> tuple[tuple, dict]:
        """``(args, kwargs)`` the submodule ``name`` received in the eval forward."""
        return self.captured[name]


@dataclass(frozen=True)
class AuroraCheck:
    """One entry of the catalogue.

    Attributes:
        name: the check's name (unique; names the baseline entry).
        group: the class or function it exercises (summary and report grouping).
        submodule: dotted path in ``AuroraForPrediction`` of the module whose weights the check
            depends on, or ``None`` for free functions and modules outside the model.
        build: ``(AuroraContext) -> (callable, args, kwargs)``.
        train: the module runs in training mode (dropout, batch statistics, frequency masking),
            with randomness shared between both sides.
        fault_weight: the parameter (relative to the module the check runs) that sensitivity tests
            and self-checks scale; ``None`` means ``sensitive_weight``'s choice. Set where the generic
            choice sits in a position the output is invariant to by design (e.g. attention's query
            projection only changes the softmax temperature).
        sample_dim: the axis of i.i.d. samples of a sampling check (``num_samples`` > 1), or None.
            Passed to ``parity.check(sample_dim=...)``: sample by sample under the shared random
            stream, as distributions where the sides draw from their own streams.
    """

    name: str
    group: str
    submodule: str | None
    build: Callable[[AuroraContext], tuple[Callable[..., Any], tuple, dict]]
    train: bool = False
    fault_weight: str | None = None
    sample_dim: int | None = None

    def __str__(self) -> str:
        return self.name


# --------------------------------------------------------------------------------------------
# context


_CAPTURE = [
    "model", "model.embed_layer", "model.enc_layers.0", "model.enc_layers.0.self_attn",
    "model.VisionEncoder", "model.TextEncoder", "model.VisionGuider", "model.TextGuider",
    "model.ModalityConnector", "retriever", "flow_match.net",
    *(f"model.dec_layers.{i}" for i in range(DEC_LAYERS)),
    "model.dec_layers.0.self_attn", "model.dec_layers.0.cross_attn", "model.dec_layers.0.ffn_layer",
]


#: Environment variable that replaces the suite's CO2 batch by one held-out El Niño window
#: (``"elnino YYYY-MM"``, its first month): the drill-down of a forecast that differs there.
WINDOW_ENV = "NPU_PARITY_AURORA_WINDOW"
#: The drill-down command a trajectory check's message gives per held-out window (``{window}``).
DRILL_DOWN = (f"{WINDOW_ENV}='{{window}}' pytest --npu-parity --parity-reference cpu "
              "parity_suites/aurora/test_model.py parity_suites/aurora/test_submodules.py")


def suite_batch() -> Any:
    """The suite's input: the real CO2 windows standardized per window (``AuroraBatch.normalized``).

    Forecasts in ppm (≈ 330) would make a relative tolerance hide real faults (a 1e-4 weight error
    moves the ppm forecast by 1.8e-4, inside rtol 1e-5 × 330); standardized, the same fault fails.

    With ``NPU_PARITY_AURORA_WINDOW="elnino YYYY-MM"`` set (``DRILL_DOWN``), the batch is that
    held-out El Niño window instead, repeated to the suite's batch size so every check keeps its
    shapes; compare it against a live CPU run (the stored baselines hold the CO2 batch).

    Raises:
        ValueError: a window the variable names that is not ``elnino YYYY-MM`` within the record.
    """
    window = os.environ.get(WINDOW_ENV, "").strip()
    if window:
        series, _, month = window.partition(" ")
        if series != "elnino":
            raise ValueError(f"{WINDOW_ENV}={window!r}: give 'elnino YYYY-MM' (a held-out window a trajectory "
                             "check listed)")
        start = aurora_inputs.elnino_start(month)
        return aurora_inputs.make_elnino_batch(starts=[start] * aurora_inputs.BATCH,
                                               horizons=aurora_inputs.HORIZONS).normalized()
    return aurora_inputs.make_batch().normalized()


#: Windows and windows per step of the trajectory checks (``trajectory_batches``).
TRAJECTORY_WINDOWS, TRAJECTORY_BATCH = 64, 4


def trajectory_batches(windows: int = TRAJECTORY_WINDOWS, per_step: int = TRAJECTORY_BATCH) -> list[dict[str, Any]]:
    """The training batches of the trajectory checks: ``windows`` real CO2 windows (context 528,
    horizon ``HORIZON``, with their text; evenly spaced over the record, ``inputs.make_batch``),
    standardized per window (``suite_batch``'s reason), cut in order into batches of ``per_step``
    windows: ``AuroraForPrediction.forward`` keyword dicts (``input_ids`` ``[per_step, 528]``
    float32, ``labels`` ``[per_step, HORIZON]`` float32, the text tensors ``[per_step, 125]`` int64),
    one per step, cycled by ``runtime.trajectory.TrajectoryLoop``.

    Raises:
        ValueError: ``windows`` is not a positive multiple of ``per_step``.
    """
    if per_step < 1 or windows < per_step or windows % per_step:
        raise ValueError(f"trajectory_batches: windows ({windows}) must be a positive multiple of per_step "
                         f"({per_step})")
    kwargs = aurora_inputs.make_batch(windows, horizons=(HORIZON,)).normalized().forward_kwargs(HORIZON, train=True)
    return [{k: v[i:i + per_step] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            for i in range(0, windows, per_step)]


#: Held-out windows and samples per window of the trajectory checks' forecast evaluation.
FORECAST_WINDOWS, FORECAST_SAMPLES = 8, 16


def forecast_held_out(windows: int = FORECAST_WINDOWS) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The held-out windows the trained models forecast: ``windows`` El Niño windows
    (``inputs.make_elnino_batch``: context 528 months, horizon ``HORIZON``, their own text; a series
    the CO2 training windows never show), standardized per window like the training windows.

    Returns:
        ``(held_out, labels)``: ``held_out`` holds ``inputs`` ``[W, 528]`` float32, the three text
        tensors ``[W, 125]`` int64 and ``labels`` ``[W, HORIZON]`` float32 (the observed
        continuation); ``labels`` name each window (``"elnino 1955-02"``, its first month).
    """
    batch = aurora_inputs.make_elnino_batch(windows, horizons=(HORIZON,)).normalized()
    held_out = {"inputs": batch.context, **batch.text_kwargs(), "labels": batch.labels[HORIZON]}
    return held_out, [f"elnino {date[:7]}" for date in batch.start_dates]


def evaluate_forecasts(model: torch.nn.Module, held_out: dict[str, torch.Tensor],
                       num_samples: int = FORECAST_SAMPLES) -> dict[str, torch.Tensor]:
    """Per-window MSE, MAE and CRPS (``judge.forecast.forecast_metrics``) of ``num_samples``
    forecasts of ``model.generate`` (horizon: the labels' length, ``inference_token_len`` 48) on
    ``held_out`` (``forecast_held_out``): ``{metric: float32 [W]}``. A ``TrajectoryLoop``'s
    ``evaluate``."""
    kwargs = {k: v for k, v in held_out.items() if k != "labels"}
    samples = model.generate(**kwargs, max_output_length=held_out["labels"].shape[-1], inference_token_len=48,
                             num_samples=num_samples)
    return forecast_metrics(samples, held_out["labels"])


def build_context(model: torch.nn.Module, batch: Any) -> AuroraContext:
    """Capture submodule inputs and derive the extra tensors the catalogue needs (CPU, no grad)."""
    captured = aurora_inputs.capture_submodule_inputs(model, batch, _CAPTURE, horizon=HORIZON)
    extras: dict[str, Any] = {}
    with torch.no_grad():
        args, kwargs = captured[f"model.dec_layers.{DEC_LAYERS - 1}"]
        x_dec = model.get_submodule(f"model.dec_layers.{DEC_LAYERS - 1}")(*args, **kwargs)[0]
        extras["x_dec"] = x_dec  # [B, 2, hidden]
        r_args, r_kwargs = captured["retriever"]
        extras["prototypes"] = model.retriever(*r_args, **r_kwargs)  # [B, 2, 48]
        extras.update(_flow_loss_inputs(model, batch, x_dec, extras["prototypes"]))
        extras["dec_layer_layernorm"] = _layernorm_decoder_layer(model)
    extras["real_images"] = aurora_inputs.real_images(batch.batch_size)
    return AuroraContext(model=model, batch=batch, captured=captured, extras=extras)


def _flow_loss_inputs(model, batch, x_dec, prototypes) -> dict[str, torch.Tensor]:
    """Inputs of ``FlowLoss.forward`` exactly as ``AuroraForPrediction.forward`` builds them in training,
    and the padded variant: labels of ``ODD_HORIZON`` (80 weeks) zero-padded to two 48-step tokens
    (``F.pad`` as upstream does) with a padding mask that is 0 on the 16 padded steps of the second
    token (``flow_target_padded``, ``flow_mask``: ``[rows, 48]``, the per-step mask ``FlowLoss.forward``
    averages the loss under; upstream's own train path builds a ``[1, 96]`` mask that cannot broadcast
    against ``[rows, 48]``, see ``inputs.AuroraBatch.forward_kwargs``)."""
    cfg = model.config
    context = batch.context
    means = context.mean(1, keepdim=True)
    stdev = context.std(dim=1, keepdim=True, unbiased=False) + 1e-5
    mul = cfg.diffusion_batch_mul

    def tokens(labels: torch.Tensor) -> torch.Tensor:
        shift = labels.unfold(-1, cfg.token_len, cfg.token_len)
        return shift.reshape(-1, cfg.token_len).repeat(mul, 1)

    labels = (batch.labels[HORIZON] - means) / stdev
    bsz, n_tokens = labels.shape[0], labels.shape[1] // cfg.token_len
    padded = (batch.labels[ODD_HORIZON] - means) / stdev
    pad = n_tokens * cfg.token_len - padded.shape[1]
    valid = torch.nn.functional.pad(torch.ones_like(padded), (0, pad))
    return {
        "flow_target": tokens(labels),
        "flow_z": x_dec.reshape(bsz * n_tokens, -1).repeat(mul, 1),
        "flow_prototype": prototypes.reshape(bsz * n_tokens, -1).repeat(mul, 1),
        "flow_target_padded": tokens(torch.nn.functional.pad(padded, (0, pad))),
        "flow_mask": tokens(valid),
    }


def _layernorm_decoder_layer(model) -> torch.nn.Module:
    """An ``AuroraDecoderLayer`` with ``norm_mode='layer'``: decoder layer 0's attention and FFN weights,
    LayerNorm scales/shifts from the version-stable generator (``stable_init``: 1·(1 + ε) and a 0.1-std
    shift, so a kernel ignoring them would fail; ``torch.randn`` would draw other numbers on another
    CPU kernel path)."""
    from aurora.modeling_aurora import AuroraDecoderLayer

    from ..runtime.stable_init import stable_init_

    config = copy.deepcopy(model.config)
    config.norm_mode = "layer"
    layer = AuroraDecoderLayer(config, 0)
    stable_init_(layer, seed=1234)  # the norms are the tensors that keep these values
    source = model.model.dec_layers[0].state_dict()
    layer.load_state_dict({k: v for k, v in source.items() if not k.startswith("norm")}, strict=False)
    return layer.eval()


# --------------------------------------------------------------------------------------------
# call helpers: look the function up at call time, so the patch set applies on the target side


def resample(old: torch.Tensor, new_patch_len: int) -> torch.Tensor:
    """``aurora.modeling_aurora.resample`` as the model calls it (patched on the target)."""
    import aurora.modeling_aurora as modeling

    return modeling.resample(old, new_patch_len)


def rope_decoder(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``aurora.modeling_aurora.RoPE_decoder`` on ``[B, heads, len, head_dim]`` query and key."""
    import aurora.modeling_aurora as modeling

    return modeling.RoPE_decoder(query, key)


def sinusoidal_position_embedding(like: torch.Tensor, num_heads: int, max_len: int, dim: int) -> torch.Tensor:
    """``sinusoidal_position_embedding`` for ``like``'s batch, on ``like``'s device."""
    import aurora.util_functions as util

    return util.sinusoidal_position_embedding(like.shape[0], num_heads, max_len, dim, like.device)


def causal_attention_mask(like: torch.Tensor, seq_length: int) -> torch.Tensor:
    """The decoder's causal mask as its call site uses it (``causal_attention_mask(n).to(x.device)``)."""
    import aurora.modeling_aurora as modeling

    return modeling.causal_attention_mask(seq_length).to(like.device)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, d = x.shape
    return x.reshape(b, n, heads, d // heads).transpose(1, 2).contiguous()


def _module(name: str, *, train: bool = False, **call_kwargs: Any):
    """Build function for a check of submodule ``name`` on its captured inputs."""
    def build(ctx: AuroraContext):
        module = ctx.submodule(name)
        args, kwargs = ctx.inputs_of(name)
        return _maybe_train(module, train), args, {**kwargs, **call_kwargs}
    return build


class Intermediates(torch.nn.Module):
    """Run ``module`` and also return the outputs of some of its submodules.

    For computations whose final output contracts errors by design — the retriever's softmax over
    prototypes followed by a normalization, the flow loss's scalar mean — the check also compares
    the activations inside, so a fault there cannot hide below the output's tolerance.
    Returns ``{"output": module(...), "<name>": output of submodule name, ...}`` (first call of each).
    """

    def __init__(self, module: torch.nn.Module, names: list[str]):
        super().__init__()
        self.module = module
        self.names = list(names)

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        captured: dict[str, Any] = {}
        handles = [self.module.get_submodule(name).register_forward_hook(
            lambda _m, _a, out, name=name: captured.setdefault(name, out)) for name in self.names]
        try:
            output = self.module(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return {"output": output, **{name: captured[name] for name in self.names}}


def _maybe_train(module: torch.nn.Module, train: bool) -> torch.nn.Module:
    """``module`` itself, or (``train``) a training-mode copy that shares its weights
    (``runner.fresh_copy``): the shared model's mode and buffers never change."""
    if not train:
        return module
    from ..runner import fresh_copy

    return fresh_copy(module).train()


def _flow_sample(ctx: AuroraContext, num_samples: int, prototype: bool = True):
    """``FlowLoss.sample`` on the decoder output (and the retriever's prototypes) of the eval forward."""
    x_dec, prototypes = ctx.extras["x_dec"], ctx.extras["prototypes"]
    kwargs: dict[str, Any] = {"num_samples": num_samples, "inference_token_len": 48}
    if prototype:
        kwargs["prototype"] = prototypes.reshape(-1, prototypes.shape[-1])
    return ctx.model.flow_match.sample, (x_dec.reshape(-1, x_dec.shape[-1]),), kwargs


def _catalogue() -> list[AuroraCheck]:
    checks: list[AuroraCheck] = []
    add = checks.append

    # functions -----------------------------------------------------------------------------
    for n in (24, 32, 96, 100):
        add(AuroraCheck(f"resample_{n}", "resample", "model.embed_layer.proj_layer",
                        lambda ctx, n=n: (resample, (ctx.model.model.embed_layer.proj_layer.weight.detach(), n), {})))
    add(AuroraCheck("rope_decoder", "RoPE_decoder", None, lambda ctx: (
        rope_decoder, (_heads(ctx.extras["x_dec"], 8), _heads(ctx.inputs_of("model.dec_layers.0")[0][1], 8)), {})))
    add(AuroraCheck("sinusoidal_position_embedding", "sinusoidal_position_embedding", None,
                    lambda ctx: (sinusoidal_position_embedding, (ctx.batch.context, 1, 11, 256), {})))
    add(AuroraCheck("causal_attention_mask", "causal_attention_mask", None,
                    lambda ctx: (causal_attention_mask, (ctx.batch.context, 11), {})))

    # patch embedding -------------------------------------------------------------------------
    def embed(ctx, token_len):
        args, _ = ctx.inputs_of("model.embed_layer")
        return ctx.submodule("model.embed_layer"), (args[0], token_len), {}
    for n in (24, 48, 96):
        add(AuroraCheck(f"patch_embedding_eval_{n}", "AuroraPatchEmbedding", "model.embed_layer",
                        functools.partial(embed, token_len=n)))
    add(AuroraCheck("patch_embedding_train", "AuroraPatchEmbedding", "model.embed_layer",
                    lambda ctx: (_maybe_train(ctx.submodule("model.embed_layer"), True),
                                 (ctx.inputs_of("model.embed_layer")[0][0],), {}), train=True))

    # attention, FFN, layers ------------------------------------------------------------------
    add(AuroraCheck("attention_self_causal", "AuroraAttention", "model.dec_layers.0.self_attn",
                    _module("model.dec_layers.0.self_attn"), fault_weight="v_proj.weight"))
    add(AuroraCheck("attention_cross_rope", "AuroraAttention", "model.dec_layers.0.cross_attn",
                    _module("model.dec_layers.0.cross_attn"), fault_weight="v_proj.weight"))
    # o_proj (no bias): the output is linear in it, so (1 + 1e-4) moves it by exactly 1e-4·|y|; this
    # block's outputs are small (|y| <= 0.21), and through v_proj (biased) a 1e-4 scale reached only
    # 0.99 of the fp32 tolerance (o_proj: 1.7).
    add(AuroraCheck("attention_guided_bias", "AuroraAttention", "model.enc_layers.0.self_attn",
                    _module("model.enc_layers.0.self_attn"), fault_weight="o_proj.weight"))
    add(AuroraCheck("ffn", "AuroraFFN", "model.dec_layers.0.ffn_layer", _module("model.dec_layers.0.ffn_layer")))
    add(AuroraCheck("encoder_layer_0", "AuroraEncoderLayer", "model.enc_layers.0", _module("model.enc_layers.0")))
    add(AuroraCheck("encoder_layer_0_train", "AuroraEncoderLayer", "model.enc_layers.0",
                    _module("model.enc_layers.0", train=True), train=True))
    for i in range(DEC_LAYERS):
        add(AuroraCheck(f"decoder_layer_{i}", "AuroraDecoderLayer", f"model.dec_layers.{i}",
                        _module(f"model.dec_layers.{i}")))
    add(AuroraCheck("decoder_layer_0_train", "AuroraDecoderLayer", "model.dec_layers.0",
                    _module("model.dec_layers.0", train=True), train=True))
    add(AuroraCheck("decoder_layer_layernorm", "AuroraDecoderLayer", None, lambda ctx: (
        ctx.extras["dec_layer_layernorm"], ctx.inputs_of("model.dec_layers.0")[0],
        ctx.inputs_of("model.dec_layers.0")[1])))

    # prediction head -------------------------------------------------------------------------
    for n in (24, 48, 96):
        add(AuroraCheck(f"predict_head_eval_{n}", "AuroraPredictHead", "linear_head",
                        lambda ctx, n=n: (ctx.model.linear_head, (ctx.extras["x_dec"],), {"inference_token_len": n})))
    add(AuroraCheck("predict_head_train", "AuroraPredictHead", "linear_head",
                    lambda ctx: (_maybe_train(ctx.model.linear_head, True), (ctx.extras["x_dec"],), {}), train=True))

    # modalities, retriever, flow head ----------------------------------------------------------
    add(AuroraCheck("vision_encoder", "VisionEncoder", "model.VisionEncoder", _module("model.VisionEncoder")))
    # The real-image path (vision_ids=): ViTImageProcessor (resize, rescale, normalize) on real
    # photographs, then the ViT; the patch set moves the processor's host tensor to the device.
    add(AuroraCheck("vision_encoder_real_image", "VisionEncoder", "model.VisionEncoder", lambda ctx: (
        ctx.submodule("model.VisionEncoder"), (ctx.extras["real_images"],), {"type": "real"})))
    add(AuroraCheck("text_encoder", "TextEncoder", "model.TextEncoder", _module("model.TextEncoder")))
    add(AuroraCheck("modality_connector", "ModalityConnector", "model.ModalityConnector",
                    _module("model.ModalityConnector")))
    add(AuroraCheck("vision_guider", "AuroraAttention", "model.VisionGuider", _module("model.VisionGuider"),
                    fault_weight="v_proj.weight"))
    add(AuroraCheck("text_guider", "AuroraAttention", "model.TextGuider", _module("model.TextGuider"),
                    fault_weight="v_proj.weight"))
    # The retriever's output is a softmax-weighted prototype mix, standardized: a 1e-4 weight fault
    # moves it by at most 0.33x the fp32 tolerance (measured), so its encoder, decoder and logits are
    # compared too.
    add(AuroraCheck("prototype_retriever", "PrototypeRetriever", "retriever", lambda ctx: (
        Intermediates(ctx.model.retriever, ["retriever.encoder", "retriever.decoder", "retriever.head.4"]),
        *ctx.inputs_of("retriever")), fault_weight="module.retriever.head.4.weight"))
    add(AuroraCheck("simple_mlp_adaln", "SimpleMLPAdaLN", "flow_match.net", _module("flow_match.net")))
    # A scalar loss hides a 1e-4 weight fault (0.72x the tolerance, measured): the predicted velocity
    # of the flow network is compared too.
    add(AuroraCheck("flow_loss_train", "FlowLoss", "flow_match", lambda ctx: (
        Intermediates(_maybe_train(ctx.model.flow_match, True), ["net"]),
        (ctx.extras["flow_target"], ctx.extras["flow_z"]), {"prototype": ctx.extras["flow_prototype"]}),
        train=True, fault_weight="module.net.final_layer.linear.weight"))
    # The same with a padding mask (horizon 80 padded to two tokens) and without prototypes: the
    # mask changes only the loss, which the velocity does not show, so the loss is the leaf a broken
    # mask must move.
    add(AuroraCheck("flow_loss_train_masked", "FlowLoss", "flow_match", lambda ctx: (
        Intermediates(_maybe_train(ctx.model.flow_match, True), ["net"]),
        (ctx.extras["flow_target_padded"], ctx.extras["flow_z"]),
        {"prototype": ctx.extras["flow_prototype"], "mask": ctx.extras["flow_mask"]}),
        train=True, fault_weight="module.net.final_layer.linear.weight"))
    add(AuroraCheck("flow_loss_train_no_prototype", "FlowLoss", "flow_match", lambda ctx: (
        Intermediates(_maybe_train(ctx.model.flow_match, True), ["net"]),
        (ctx.extras["flow_target"], ctx.extras["flow_z"]), {}),
        train=True, fault_weight="module.net.final_layer.linear.weight"))
    add(AuroraCheck("flow_loss_sample", "FlowLoss", "flow_match", lambda ctx: _flow_sample(ctx, 1)))
    add(AuroraCheck("flow_loss_sample_no_prototype", "FlowLoss", "flow_match",
                    lambda ctx: _flow_sample(ctx, 1, prototype=False)))
    add(AuroraCheck("flow_loss_sample_multi", "FlowLoss", "flow_match",
                    lambda ctx: _flow_sample(ctx, NUM_SAMPLES), sample_dim=SAMPLE_DIM))

    # whole model -------------------------------------------------------------------------------
    # Whole-model checks: the generic largest weight is the retriever head, whose effect reaches
    # the forecast only through a softmax (0.14x the fp32 tolerance); a decoder FFN weight is a
    # fault the forecast must show.
    add(AuroraCheck("aurora_model", "AuroraModel", "model", _module("model"), fault_weight=DECODER_FAULT[6:]))
    add(AuroraCheck("forward_eval", "AuroraForPrediction", "", lambda ctx: (
        ctx.model, (), ctx.batch.forward_kwargs(HORIZON)), fault_weight=DECODER_FAULT))
    add(AuroraCheck("forward_eval_odd_horizon", "AuroraForPrediction", "", lambda ctx: (
        ctx.model, (), ctx.batch.forward_kwargs(ODD_HORIZON)), fault_weight=DECODER_FAULT))
    # Training forward: the loss alone is one number; the hidden states of every encoder and decoder
    # layer make the check see (and localize) a fault that moves the loss by less than its tolerance.
    add(AuroraCheck("forward_train_loss", "AuroraForPrediction", "", lambda ctx: (
        _maybe_train(ctx.model, True), (),
        {**ctx.batch.forward_kwargs(HORIZON, train=True), "output_hidden_states": True}), train=True,
        fault_weight=DECODER_FAULT))
    add(AuroraCheck("generate_text", "AuroraForPrediction.generate", "", lambda ctx: (
        ctx.model.generate, (), {"inputs": ctx.batch.context, **ctx.batch.text_kwargs(),
                                 "max_output_length": HORIZON, "inference_token_len": 48}),
        fault_weight=DECODER_FAULT))
    add(AuroraCheck("generate_no_text_odd_horizon", "AuroraForPrediction.generate", "", lambda ctx: (
        ctx.model.generate, (), {"inputs": ctx.batch.context, "max_output_length": ODD_HORIZON,
                                 "inference_token_len": 48}), fault_weight=DECODER_FAULT))
    # Real photographs instead of the series' pseudo-image (generate(vision_inputs=...) -> vision_ids).
    add(AuroraCheck("generate_real_image", "AuroraForPrediction.generate", "", lambda ctx: (
        ctx.model.generate, (), {"inputs": ctx.batch.context, **ctx.batch.text_kwargs(),
                                 "vision_inputs": ctx.extras["real_images"], "max_output_length": HORIZON,
                                 "inference_token_len": 48}), fault_weight=DECODER_FAULT))
    # NUM_SAMPLES forecasts per series: compared sample by sample under the shared stream, as
    # distributions (per series and step) where each side draws its own noise.
    add(AuroraCheck("generate_samples", "AuroraForPrediction.generate", "", lambda ctx: (
        ctx.model.generate, (), {"inputs": ctx.batch.context, "max_output_length": HORIZON,
                                 "inference_token_len": 48, "num_samples": NUM_SAMPLES}),
        fault_weight=DECODER_FAULT, sample_dim=SAMPLE_DIM))
    return checks


CHECKS: list[AuroraCheck] = _catalogue()
BY_NAME: dict[str, AuroraCheck] = {c.name: c for c in CHECKS}
assert len(BY_NAME) == len(CHECKS), "check names must be unique"

#: Checks of the whole model (the ones first-divergence localization explains).
MODEL_CHECKS = [c for c in CHECKS if c.submodule in ("", "model")]
#: Everything else: one submodule or function each.
SUBMODULE_CHECKS = [c for c in CHECKS if c not in MODEL_CHECKS]


# --------------------------------------------------------------------------------------------
# faults, for sensitivity tests and self-checks


def sensitive_weight(module: torch.nn.Module) -> str:
    """Name of the parameter a weight perturbation should scale (``selfcheck.sensitive_parameter``:
    the largest trainable weight matrix, the first of equals).

    Raises:
        ValueError: the module has no floating parameter to perturb.
    """
    name = sensitive_parameter(module)
    if name is None:
        raise ValueError(f"{type(module).__name__} has no weight to perturb")
    return name


@contextlib.contextmanager
def dropped_causal_mask() -> Iterator[None]:
    """Replace ``causal_attention_mask`` everywhere in aurora with an all-zero mask (a classic port bug)."""
    import aurora.modeling_aurora as modeling
    import aurora.prototype_retriever as retriever

    def no_mask(seq_length, *args, **kwargs):
        device = kwargs.get("device") or (args[0] if args else None)
        return torch.zeros(1, 1, seq_length, seq_length, device=device)

    saved = (modeling.causal_attention_mask, retriever.causal_attention_mask)
    modeling.causal_attention_mask = retriever.causal_attention_mask = no_mask
    try:
        yield
    finally:
        modeling.causal_attention_mask, retriever.causal_attention_mask = saved


@contextlib.contextmanager
def ignored_padding_mask() -> Iterator[None]:
    """``FlowLoss.forward`` averages over padded steps too (its ``mask`` replaced by ones), a port bug
    that drops the padding mask: the loss then counts the zero-padded labels."""
    import aurora.flow_loss as flow

    original = flow.FlowLoss.forward

    def forward(self, target, z, prototype=None, mask=None, eps=1e2):
        return original(self, target, z, prototype=prototype,
                        mask=None if mask is None else torch.ones_like(mask), eps=eps)

    flow.FlowLoss.forward = forward
    try:
        yield
    finally:
        flow.FlowLoss.forward = original


@contextlib.contextmanager
def scaled_sampler_noise(factor: float) -> Iterator[None]:
    """The flow sampler's noise scaled by ``factor`` (a wrong noise scale, e.g. ``1.05``): every
    ``torch.randn`` called from ``aurora.flow_loss`` (``FlowLoss.sample``'s starting noise) returns
    ``factor`` times its draw; other callers are unaffected."""
    import aurora.flow_loss as flow

    real_torch = flow.torch

    class _Torch:
        def __getattr__(self, name):
            return getattr(real_torch, name)

        @staticmethod
        def randn(*args, **kwargs):
            return real_torch.randn(*args, **kwargs) * factor

    flow.torch = _Torch()
    try:
        yield
    finally:
        flow.torch = real_torch

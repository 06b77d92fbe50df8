"""Seeded, deterministic construction of Aurora models (aurora-model 0.2.0) for parity checks.

Two sizes, same architecture (same classes, norm mode, token length, layer kinds):

``full``
    The package's own ``config.json`` (hidden 256, 1 encoder and 9 decoder layers, 1000
    prototypes, 50 sampling steps) with ViT-base and BERT-base built from the package's
    ``vit_config``/``bert_config`` (frozen). 210.8 M parameters (measured: see the module tests).
``tiny``
    :data:`TINY_OVERRIDES` on top of the same ``config.json`` (hidden 32, 4 heads, 1 encoder and
    2 decoder layers, 64 prototypes, 4 sampling steps) and a 1-layer, 32-wide ViT and BERT
    (:data:`TINY_VIT_OVERRIDES`, :data:`TINY_BERT_OVERRIDES`; the ViT keeps the 224-pixel image
    and 16-pixel patches that the pseudo-image processor produces, BERT keeps the shipped
    tokenizer's 30 522-token vocabulary). About 1.2 M parameters, built in ≈ 0.1 s.

How the encoders are shrunk without editing the package: ``VisionEncoder`` and ``TextEncoder``
read ``os.path.join(cls.config_path, "config.json")`` in ``__init__``; ``config_path`` is a
class attribute. During construction it points at a temporary directory holding the shrunken
JSON, and is restored afterwards (the pseudo-image processor has its own ``config_path`` and
keeps the package's ``preprocessor_config.json``). ``AuroraConfig`` itself has no field for
the encoders' sizes.

Determinism: construction runs under ``torch.random.fork_rng`` after ``torch.manual_seed(seed)``
(HF ``_init_weights`` of ViT/BERT, ``nn.Linear`` defaults and the ``torch.randn`` target tokens
all draw from it), with the default dtype pinned to float32, and with NumPy's global state
saved and restored (``PrototypeRetriever`` calls ``np.random.seed(42)``: the prototypes are the
same for every seed, and without the restore building a model would reset the caller's NumPy
stream). Same seed → bitwise-identical ``state_dict`` in any process.

Weights (issue "baselines that travel"): upstream's init draws from ``torch.nn.init`` and
Hugging Face ``_init_weights``, whose algorithms change between torch releases
(``trunc_normal_`` in the ViT: a different model on 2.5.1 and 2.14.1 for the same seed), and it
zero-initializes the flow head (docs/explanation/findings.md, "Vacuous full-model checks": a fresh flow head
predicts exactly 0). With ``init="stable"`` (default) every floating ``state_dict`` tensor is
overwritten by :func:`pytest_npu_parity.stable_init.stable_init_` — integer-only draws, bitwise
identical on every CPU and every torch ≥ 2.5.1, no tensor constant or zero. Upstream's own
construction still runs first (it defines shapes, frozen flags and which tensors start as
constants). ``init="upstream"`` keeps upstream's weights (for the vacuity demonstration).

The names written land in ``model.build_record.initialized``. User checkpoints are loaded as
they are.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..runtime.stable_init import stable_init_

__all__ = [
    "SIZES",
    "TINY_OVERRIDES",
    "TINY_VIT_OVERRIDES",
    "TINY_BERT_OVERRIDES",
    "BuildRecord",
    "CheckpointError",
    "build_model",
    "get_model",
    "clear_model_cache",
    "model_config",
    "encoder_configs",
    "INITS",
    "load_checkpoint",
    "model_fingerprint",
    "config_hash",
    "parameter_counts",
    "clone_model",
]

logger = logging.getLogger("pytest_npu_parity.aurora.factory")

SIZES = ("full", "tiny")

#: ``AuroraConfig`` fields changed for ``tiny`` (everything else is the package's config.json).
TINY_OVERRIDES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_enc_layers": 1,
    "num_dec_layers": 2,
    "num_prototypes": 64,
    "num_sampling_steps": 4,
}
#: ViT config fields changed for ``tiny`` (image 224 / patch 16 kept: 196 patch tokens as in full).
TINY_VIT_OVERRIDES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
}
#: BERT config fields changed for ``tiny`` (vocabulary and 512 positions kept for the tokenizer).
TINY_BERT_OVERRIDES: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
}

#: ``build_model(init=...)`` choices.
INITS = ("stable", "upstream")


class CheckpointError(ValueError):
    """A user checkpoint cannot be used (wrong format, missing/unexpected keys, shape mismatch)."""


@dataclass
class BuildRecord:
    """How a model was built (attached as ``model.build_record``; part of baseline provenance).

    Attributes:
        size: ``"full"`` or ``"tiny"``.
        seed: the torch seed of construction and the seed of the stable init.
        init: ``"stable"`` or ``"upstream"`` (module docstring); ``"checkpoint"`` with one.
        checkpoint: absolute path of the loaded ``.safetensors`` file, or None.
        initialized: names of the tensors written by the stable init.
        missing_keys / unexpected_keys: from a non-strict checkpoint load (else empty).
        build_seconds: wall time of construction (+ load), seconds.
        parameters / trainable_parameters: element counts.
    """

    size: str
    seed: int
    init: str = "stable"
    checkpoint: str | None = None
    initialized: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    build_seconds: float = 0.0
    parameters: int = 0
    trainable_parameters: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the initialized names are summarised by count)."""
        return {
            "size": self.size, "seed": self.seed, "init": self.init, "checkpoint": self.checkpoint,
            "initialized": len(self.initialized), "missing_keys": list(self.missing_keys),
            "unexpected_keys": list(self.unexpected_keys), "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
        }


# --------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------

def _check_size(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown Aurora model size {size!r}; choose one of {', '.join(SIZES)}")


def model_config(size: str = "full"):
    """The ``AuroraConfig`` of ``size``: the package's ``config.json`` (+ :data:`TINY_OVERRIDES`).

    Raises:
        ValueError: unknown size.
    """
    _check_size(size)
    from aurora.configuration_aurora import AuroraConfig
    from aurora.utils.path_utils import get_package_file_path

    config = AuroraConfig.from_json_file(get_package_file_path("config.json"))
    if size == "tiny":
        for key, value in TINY_OVERRIDES.items():
            setattr(config, key, value)
    return config


def encoder_configs(size: str = "full") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(vit, bert)`` config dicts: the package's ``vit_config``/``bert_config`` JSON (+ tiny overrides)."""
    _check_size(size)
    from aurora.modality_connector import TextEncoder, VisionEncoder

    with open(os.path.join(VisionEncoder.config_path, "config.json"), encoding="utf-8") as fh:
        vit = json.load(fh)
    with open(os.path.join(TextEncoder.config_path, "config.json"), encoding="utf-8") as fh:
        bert = json.load(fh)
    if size == "tiny":
        vit.update(TINY_VIT_OVERRIDES)
        bert.update(TINY_BERT_OVERRIDES)
    return vit, bert


_BUILD_LOCK = threading.RLock()


@contextlib.contextmanager
def _encoder_config_dirs(vit: dict[str, Any], bert: dict[str, Any]) -> Iterator[None]:
    """Point ``VisionEncoder``/``TextEncoder.config_path`` at temporary JSON files, then restore."""
    from aurora.modality_connector import TextEncoder, VisionEncoder

    saved = (VisionEncoder.__dict__["config_path"], TextEncoder.__dict__["config_path"])
    with tempfile.TemporaryDirectory(prefix="aurora-encoders-") as tmp:
        for sub, data in (("vit", vit), ("bert", bert)):
            os.makedirs(os.path.join(tmp, sub))
            with open(os.path.join(tmp, sub, "config.json"), "w", encoding="utf-8") as fh:
                json.dump(data, fh)
        VisionEncoder.config_path = os.path.join(tmp, "vit")
        TextEncoder.config_path = os.path.join(tmp, "bert")
        try:
            yield
        finally:
            VisionEncoder.config_path, TextEncoder.config_path = saved


@contextlib.contextmanager
def _isolated_construction(seed: int) -> Iterator[None]:
    """Seeded torch RNG, CPU default device, float32 default dtype, NumPy state restored."""
    numpy_state = np.random.get_state()
    default_dtype = torch.get_default_dtype()
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            torch.set_default_dtype(torch.float32)
            yield
    finally:
        torch.set_default_dtype(default_dtype)
        np.random.set_state(numpy_state)


# --------------------------------------------------------------------------------------------
# Checkpoints (safetensors only)
# --------------------------------------------------------------------------------------------

_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")


def _list(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", … ({len(keys) - limit} more)" if len(keys) > limit else "")


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike[str], *,
                    strict: bool = True) -> tuple[list[str], list[str]]:
    """Load a ``.safetensors`` state dict into ``model`` (never a pickle).

    Args:
        model: the model (parameters keep their dtype; stored tensors are cast on copy).
        path: a ``.safetensors`` file.
        strict: if True, any missing or unexpected key is an error; if False they are returned
            and missing tensors keep their current (seeded) values.
    Returns:
        ``(missing_keys, unexpected_keys)``, sorted.
    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: not a ``.safetensors`` file (``.pt``/``.bin``/pickle files are refused),
            unreadable, a shape mismatch, or (strict) missing/unexpected keys.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist (expected a .safetensors file)")
    if path.suffix.lower() != ".safetensors":
        kind = "a pickle archive" if path.suffix.lower() in _PICKLE_SUFFIXES else "not a .safetensors file"
        raise CheckpointError(
            f"refusing to load checkpoint {path}: it is {kind}. Only .safetensors checkpoints are "
            "accepted (loading a pickle can run arbitrary code). Convert it once where you trust "
            "it: safetensors.torch.save_file(torch.load(p, weights_only=True), 'model.safetensors')")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is not a readable safetensors file: {exc}") from exc
    own = model.state_dict()
    mismatched = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in sorted(state.items()) if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if mismatched:
        raise CheckpointError(f"checkpoint {path} does not fit this model (shape mismatch): "
                              f"{_list(mismatched)}; was it saved from another model size?")
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s): {_list(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {_list(unexpected)}")
        raise CheckpointError(f"checkpoint {path} does not match the model: {'; '.join(parts)}. "
                              "Pass strict=False to load the matching keys anyway (missing tensors "
                              "keep their seeded values).")
    model.load_state_dict(state, strict=False)
    if missing or unexpected:
        logger.warning("checkpoint %s: %d missing, %d unexpected key(s)", path, len(missing), len(unexpected))
    return missing, unexpected


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------

def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """``(total, trainable)`` parameter element counts."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def build_model(size: str = "full", *, seed: int = 0, checkpoint: str | os.PathLike[str] | None = None,
                init: str = "stable", strict: bool = True):
    """Build an ``AuroraForPrediction`` deterministically, in eval mode, on the CPU, in float32.

    Args:
        size: ``"full"`` (package config, 210.8 M parameters) or ``"tiny"`` (see module docstring).
        seed: torch seed of construction and seed of the stable init (int ≥ 0).
        checkpoint: optional ``.safetensors`` file with user weights (loaded as they are;
            ``init`` is then ignored).
        init: ``"stable"`` (default: :func:`pytest_npu_parity.stable_init.stable_init_`, the
            same weights on every machine and torch version) or ``"upstream"`` (upstream's own
            init: torch-version dependent, flow head zero).
        strict: checkpoint keys must match exactly (see :func:`load_checkpoint`).
    Returns:
        The model, with ``model.build_record``
        (:class:`BuildRecord`).
    Raises:
        ValueError: unknown size or init, or a negative seed.
        FileNotFoundError, CheckpointError: see :func:`load_checkpoint`.
        ImportError: aurora-model is not installed (``pip install 'pytest-npu-parity[aurora]'``).
    """
    _check_size(size)
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"build_model: seed must be a non-negative int, got {seed!r}")
    if init not in INITS:
        raise ValueError(f"build_model: unknown init {init!r}; choose one of {', '.join(INITS)}")
    from aurora.modeling_aurora import AuroraForPrediction

    config = model_config(size)
    vit, bert = encoder_configs(size)
    start = time.perf_counter()
    with _BUILD_LOCK, _isolated_construction(seed):
        encoder_dirs = _encoder_config_dirs(vit, bert) if size == "tiny" else contextlib.nullcontext()
        with encoder_dirs:
            model = AuroraForPrediction(config)
    record = BuildRecord(size=size, seed=seed, init=init)
    if checkpoint is not None:
        record.init = "checkpoint"
        record.checkpoint = str(Path(checkpoint).resolve())
        record.missing_keys, record.unexpected_keys = load_checkpoint(model, checkpoint, strict=strict)
    elif init == "stable":
        record.initialized = stable_init_(model, seed)
    model.eval()
    record.build_seconds = time.perf_counter() - start
    record.parameters, record.trainable_parameters = parameter_counts(model)
    model.build_record = record
    logger.info("built Aurora %s (seed %d, %s init): %d parameters (%d trainable), %d tensors written, %.2f s",
                size, seed, record.init, record.parameters, record.trainable_parameters, len(record.initialized),
                record.build_seconds)
    return model


_MODEL_CACHE: dict[tuple, torch.nn.Module] = {}


def _checkpoint_key(checkpoint: str | os.PathLike[str] | None) -> tuple | None:
    if checkpoint is None:
        return None
    path = Path(checkpoint).resolve()
    stat = path.stat() if path.exists() else None
    return (str(path), stat.st_mtime_ns if stat else None, stat.st_size if stat else None)


def get_model(size: str = "full", seed: int = 0, checkpoint: str | os.PathLike[str] | None = None):
    """The model of :func:`build_model` ``(size, seed=seed, checkpoint=checkpoint)``, built once per process.

    The same object is returned on every call: callers must not mutate it (no ``.to()``,
    ``.train()``, optimizer steps or ``load_state_dict``). A check that trains or moves the model
    takes ``copy.deepcopy(get_model(...))`` first. A checkpoint is keyed by path, mtime and size,
    so a rewritten file is rebuilt.
    """
    key = (size, seed, _checkpoint_key(checkpoint))
    with _BUILD_LOCK:
        model = _MODEL_CACHE.get(key)
        if model is None:
            model = build_model(size, seed=seed, checkpoint=checkpoint)
            _MODEL_CACHE[key] = model
        return model


def clear_model_cache() -> None:
    """Forget every model cached by :func:`get_model`."""
    with _BUILD_LOCK:
        _MODEL_CACHE.clear()


# --------------------------------------------------------------------------------------------
# Fingerprints (baseline provenance)
# --------------------------------------------------------------------------------------------

def _config_fields(config: Any) -> dict[str, Any]:
    """Architecture fields: the parameters of the config class's own ``__init__``.

    ``PretrainedConfig.to_dict()`` also carries library bookkeeping (``transformers_version``,
    generation defaults, ``dtype`` vs ``torch_dtype``) that changes between transformers
    releases without changing the model; the subclass's ``__init__`` parameters are its fields.
    """
    if isinstance(config, dict):
        return dict(config)
    data = config.to_dict()
    params = [name for name, p in inspect.signature(type(config).__init__).parameters.items()
              if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    fields = {name: data[name] for name in params if name in data}
    fields["__class__"] = type(config).__name__
    return fields


def config_hash(config: Any) -> str:
    """SHA-256 (hex) of a config's architecture fields, stable across processes and transformers versions.

    Args:
        config: a ``PretrainedConfig`` (e.g. ``AuroraConfig``, ``ViTConfig``) or a plain dict.
    Returns:
        64 hex characters.
    """
    canonical = json.dumps(_config_fields(config), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of every config in the model and every ``state_dict`` tensor.

    Covers the ``config`` of the root and of every nested HF ``PreTrainedModel`` (the ViT and
    BERT encoders), then each ``state_dict`` entry in sorted order: name, dtype, shape and raw
    bytes (so a one-ULP change, a dtype cast or a BatchNorm statistic changes it). Tensors are
    read from any device (copied to the CPU). About 1 s for the full model.
    """
    digest = hashlib.sha256()
    configs = {name or "<root>": config_hash(module.config) for name, module in model.named_modules()
               if hasattr(module, "config") and hasattr(module.config, "to_dict")}
    digest.update(json.dumps(configs, sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def clone_model(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy`` of a (cached) model, for checks that train or move it."""
    return copy.deepcopy(model)

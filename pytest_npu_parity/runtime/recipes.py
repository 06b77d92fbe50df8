"""Recipes: how a precision is run on a device.

* ``fp32`` — plain float32; TF32 (CUDA) and HF32 (Ascend) are switched off, and
  ``torch.set_float32_matmul_precision("highest")``, so a matmul is a true fp32 matmul everywhere.
* ``bf16`` — the module keeps its fp32 weights and runs under ``torch.autocast(device_type,
  dtype=torch.bfloat16)``: the way Hugging Face Trainer runs with ``bf16=True`` and the way the
  Ascend guide recommends training on a 910B. The reference is a bf16 run of the same recipe on its
  own device, never the fp32 output (docs/explanation/findings.md: bf16 vs fp32 fails allclose(1e-3) on 79 % of
  elements).
* ``bf16-weights`` — weights and floating inputs cast to bfloat16, no autocast.
* ``fp16`` — fp32 weights under ``torch.autocast(device_type, dtype=torch.float16)``, the way Hugging
  Face Trainer runs with ``fp16=True``; a training step scales its loss with a dynamic
  ``GradScaler`` (:func:`make_grad_scaler`: torch_npu's on an NPU, ``torch.amp.GradScaler`` elsewhere),
  because fp16's range (max 65504, smallest normal 2^-14) lets small gradients underflow. Opt-in
  (``--parity-dtypes fp16``): the Ascend guide recommends bf16 on a 910B (seed
  ``000_76a3155d974abf2f.txt`` §6.3, §9.1: native bf16, no loss scaling). Measured on the CPU with
  torch 2.5.1 and 2.14.1: autocast fp16 runs the tiny Aurora's forward and backward, and
  ``torch.amp.GradScaler("cpu")`` scales and unscales its gradients.

Every recipe runs with the strict fp32 flags, so the fp32 parts of a bf16 run are not silently
TF32/HF32 either.

Version shim (torch < 2.6 on the CPU): ``nn.TransformerEncoderLayer`` chooses its inference fast
path by ``torch.is_autocast_enabled()`` with no device argument, which is False under
``torch.autocast("cpu")`` on every torch from 2.5.1 to 2.14.1 (torch/nn/modules/transformer.py,
``TransformerEncoderLayer.forward``). From the 2.6 line on, ``torch._transformer_encoder_layer_fwd``
then runs in bf16 (its output equals the fast path of a bf16-weights copy bitwise, measured on
2.14.1); on 2.5.1 it raises "mat1 and mat2 must have the same dtype, but got BFloat16 and Float".
Where a probe shows that failure, the autocast recipes cast the op's floating arguments to the
autocast dtype, which reproduces the newer torch's numbers (bitwise equal on the probe layer). The
same failure happens under fp16 autocast ("got Half and Float" on 2.5.1), so the probe is per dtype.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


@dataclass(frozen=True)
class Recipe:
    """A named precision recipe.

    Attributes:
        name: ``fp32``, ``bf16``, ``bf16-weights`` or ``fp16``.
        autocast_dtype: dtype for ``torch.autocast`` on the device, or ``None``.
        weights_dtype: dtype the module's floating parameters and floating inputs are cast to, or
            ``None`` to keep them as they are.
        loss_scaling: a training step scales its loss with a dynamic ``GradScaler``
            (:func:`make_grad_scaler`; ``runner.ParityCase.train_step`` says how).
    """

    name: str
    autocast_dtype: torch.dtype | None = None
    weights_dtype: torch.dtype | None = None
    loss_scaling: bool = False

    @contextlib.contextmanager
    def context(self, device: torch.device) -> Iterator[None]:
        """Run the enclosed code under this recipe on ``device`` (precision flags + autocast)."""
        with strict_fp32_flags():
            if self.autocast_dtype is None:
                yield
            else:
                shim = (encoder_fast_path_autocast_shim(self.autocast_dtype) if device.type == "cpu"
                        else contextlib.nullcontext())
                with torch.autocast(device_type=device.type, dtype=self.autocast_dtype), shim:
                    yield


RECIPES: dict[str, Recipe] = {
    "fp32": Recipe("fp32"),
    "bf16": Recipe("bf16", autocast_dtype=torch.bfloat16),
    "bf16-weights": Recipe("bf16-weights", weights_dtype=torch.bfloat16),
    "fp16": Recipe("fp16", autocast_dtype=torch.float16, loss_scaling=True),
}

#: Recipes a session runs when neither ``--parity-dtypes`` nor ini ``parity_dtypes`` says otherwise.
#: ``fp16`` and ``bf16-weights`` are opt-in.
DEFAULT_RECIPES = "fp32,bf16"


class RecipeError(RuntimeError):
    """A recipe cannot run here (e.g. no GradScaler for the device); the message says why and the fix."""


RecipeError.__module__ = "pytest_npu_parity.recipes"  # printed as before the move


def make_grad_scaler(device: torch.device | str) -> object:
    """A fresh dynamic loss scaler for a training step on ``device`` (the ``fp16`` recipe).

    * ``npu``: ``torch_npu.npu.amp.GradScaler()`` — what the Ascend guide's ``amp_grad_scaler("fp16")``
      returns (seed ``000_76a3155d974abf2f.txt`` §6.3). In the torch_npu 2.5.1 wheel
      (``torch_npu/npu/amp/grad_scaler.py``, ``GradScaler.__init__``) it takes ``init_scale=2.**16,
      growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, dynamic=True, enabled=True`` and no
      ``device`` argument; it subclasses ``torch.amp.GradScaler``, and its ``scale`` raises
      ``"Device type of outputs should be npu"`` for any other tensor, so the CPU side never uses it.
    * ``cuda`` / ``cpu``: ``torch.amp.GradScaler(device.type)`` (torch >= 2.3; present in 2.5.1 and
      2.14.1, ``torch/amp/grad_scaler.py``: ``__init__(device="cuda", init_scale=65536.0,
      growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True)``). On an older
      torch: ``torch.cuda.amp.GradScaler()`` resp. ``torch.cpu.amp.GradScaler()``.

    Every scaler thus starts at 2^16 and backs off by 0.5 — the defaults Hugging Face Trainer
    (``fp16=True``) trains with.

    Raises:
        RecipeError: no GradScaler exists for the device type on this torch (the message names it).
    """
    # parsed by hand: torch.device("npu") is an error until torch_npu registers the type
    kind = device.type if isinstance(device, torch.device) else str(device).split(":", 1)[0].strip().lower()
    if kind == "npu":
        import importlib

        return importlib.import_module("torch_npu.npu.amp").GradScaler()
    scaler_cls = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler_cls is not None:
        return scaler_cls(kind)
    legacy = getattr(getattr(getattr(torch, kind, None), "amp", None), "GradScaler", None)
    if legacy is None:
        raise RecipeError(f"the fp16 recipe needs a GradScaler for {kind}, and torch {torch.__version__} "
                          f"has neither torch.amp.GradScaler nor torch.{kind}.amp.GradScaler; "
                          "run --parity-dtypes bf16 or install torch >= 2.3")
    return legacy()


_FAST_PATH_BROKEN: dict[torch.dtype, bool] = {}


def cpu_autocast_breaks_encoder_fast_path(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch's ``TransformerEncoderLayer`` fast path fails under CPU autocast to ``dtype``.

    Probed once per process and dtype on a 2-head, 8-wide layer (``torch._transformer_encoder_layer_fwd``
    with an input in ``dtype`` and fp32 weights): True on torch 2.5.1 for bf16 and fp16 ("mat1 and mat2
    must have the same dtype"), False on the torch releases that run it (2.14.1 measured).
    """
    if dtype not in _FAST_PATH_BROKEN:
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            try:
                _ENCODER_FAST_PATH[0](torch.zeros(1, 2, 8, dtype=dtype), *_fast_path_args(layer))
                _FAST_PATH_BROKEN[dtype] = False
            except RuntimeError as exc:
                _FAST_PATH_BROKEN[dtype] = "must have the same dtype" in str(exc)
    return _FAST_PATH_BROKEN[dtype]


def _fast_path_args(layer: torch.nn.TransformerEncoderLayer) -> tuple:
    attn = layer.self_attn
    return (attn.embed_dim, attn.num_heads, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight,
            attn.out_proj.bias, False, layer.norm_first, layer.norm1.eps, layer.norm1.weight, layer.norm1.bias,
            layer.norm2.weight, layer.norm2.bias, layer.linear1.weight, layer.linear1.bias, layer.linear2.weight,
            layer.linear2.bias, None, None)


#: The op as torch ships it (a one-element list, so a shim never wraps a shim).
_ENCODER_FAST_PATH = [torch._transformer_encoder_layer_fwd]


@contextlib.contextmanager
def encoder_fast_path_autocast_shim(dtype: torch.dtype) -> Iterator[None]:
    """Inside the block, cast the floating arguments of ``torch._transformer_encoder_layer_fwd`` to ``dtype``.

    Active only where :func:`cpu_autocast_breaks_encoder_fast_path` is True (module docstring);
    elsewhere a no-op. Restores the original op on exit, also on error.
    """
    if not cpu_autocast_breaks_encoder_fast_path(dtype):
        yield
        return
    original = _ENCODER_FAST_PATH[0]

    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    def shimmed(*args, **kwargs):
        if torch.is_autocast_enabled("cpu"):
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return original(*args, **kwargs)

    torch._transformer_encoder_layer_fwd = shimmed
    try:
        yield
    finally:
        torch._transformer_encoder_layer_fwd = original


class RecipeUnsupportedError(RuntimeError):
    """A computation that runs under ``fp32`` raised under another recipe on the same device: an op
    the backend cannot run in that precision (e.g. on torch 2.14.1 the CPU's nested-tensor fast
    path of ``nn.TransformerEncoderLayer`` with a ``src_key_padding_mask`` under bf16 autocast:
    "expected scalar type Float but found BFloat16"; ``torch.fft.rfft`` of a bfloat16 tensor:
    "Unsupported dtype BFloat16").

    The message is one sentence: the op (the ATen op when a re-run under a dispatch mode saw it
    raise, else the call on the innermost source line), the module it ran in, the recipe, the
    device and how to restrict the test's recipes. The backend's own error is ``__cause__``.
    When the run was the target's (under the patch set) and the same computation runs under the
    recipe without the patch set on the CPU (``reference_runs``), the sentence says the gap is the
    target's kernel's or the patch set's, not the model's, and what to change first.

    Attributes:
        recipe: the recipe name (``bf16``).
        device: the device the run was on.
        op: the ATen op (``aten::index_add_``) or the call on the innermost line, or None.
        module: ``"layers.0 (TransformerEncoderLayer)"``, or None when no module was running.
        where: ``"torch/nn/modules/transformer.py:921"``, the innermost source line of the error.
        reference_runs: the reference (no patch set, on the CPU) runs the computation under the recipe.
    """

    def __init__(self, recipe: str, device: Any, error: BaseException, *, op: str | None = None,
                 module: str | None = None, where: str | None = None, reference_runs: bool = False):
        self.recipe, self.device, self.op, self.module, self.where = recipe, str(device), op, module, where
        self.reference_runs = reference_runs
        first = (str(error).strip().splitlines() or [""])[0]
        if len(first) > 160:
            first = first[:157] + "..."
        what = op or "an op"
        if module:
            what += f" in {module}"
        if where:
            what += f" (at {where})"
        restrict = (f"@pytest.mark.parity(recipes=[\"fp32\"]) on it, or select them for the session with "
                    "--parity-dtypes fp32.")
        if reference_runs:
            super().__init__(
                f"{what} cannot run on {self.device} under recipe {recipe} with the patch set, though the reference "
                f"(no patch set, on the CPU) runs it under {recipe} and the target runs it under fp32 "
                f"({type(error).__name__}: {first}); this is a gap of the target's kernel or of the patch set, "
                f"not of the model: make the patch set run the op in a dtype the target supports and cast back, "
                f"or, to leave {recipe} unchecked, run the test only under fp32 with " + restrict)
            return
        super().__init__(
            f"{what} cannot run on {self.device} under recipe {recipe} — the same computation runs under fp32 — "
            f"({type(error).__name__}: {first}); run the test only under the recipes that work with " + restrict)


RecipeUnsupportedError.__module__ = "pytest_npu_parity.recipes"  # printed as before the move


def parse_recipes(text: str) -> list[Recipe]:
    """Parse ``--parity-dtypes`` (comma-separated recipe names, e.g. ``fp32,bf16``).

    Raises:
        ValueError: naming the unknown recipe and the known ones, or when the list is empty.
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError("--parity-dtypes is empty; give e.g. 'fp32,bf16'")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise ValueError(f"--parity-dtypes: unknown recipe(s) {', '.join(unknown)}; known: {', '.join(RECIPES)}")
    return [RECIPES[n] for n in dict.fromkeys(names)]


def _npu_flag_holders() -> list[tuple[str, object]]:
    npu = getattr(torch, "npu", None)  # present once torch_npu is imported
    holders = []
    for name in ("matmul", "conv"):
        holder = getattr(npu, name, None) if npu is not None else None
        if holder is not None and hasattr(holder, "allow_hf32"):
            holders.append((name, holder))
    return holders


#: The ``fp32_precision`` knobs of torch >= 2.9 (``torch.backends.<path>.fp32_precision``), parents
#: before children. Older torch has none of them and only the legacy flags.
_FP32_PRECISION_PATHS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn",
                         "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")


def _fp32_precision_holders() -> list[tuple[str, object]]:
    if not hasattr(torch.backends, "fp32_precision"):
        return []
    holders = []
    for path in _FP32_PRECISION_PATHS:
        holder: object = torch.backends
        for part in filter(None, path.split(".")):
            holder = getattr(holder, part, None)
        if holder is not None:
            holders.append((path, holder))
    return holders


def _read_legacy(getter: Callable[[], object]) -> object | None:
    """A legacy precision flag, or ``None`` where torch >= 2.9 refuses to answer because the new
    ``fp32_precision`` knobs were set to values the legacy flag cannot express."""
    try:
        return getter()
    except RuntimeError:
        return None


@contextlib.contextmanager
def strict_fp32_flags() -> Iterator[None]:
    """Run fp32 as true IEEE fp32 inside the block, restoring every flag after (also on error).

    Switched off: TF32 for CUDA matmul and cuDNN (``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.backends.cudnn.allow_tf32``), reduced-precision fp32 matmul
    (``torch.set_float32_matmul_precision("highest")``: "high"/"medium" also let oneDNN use bf16
    on the CPU), on torch >= 2.9 every ``fp32_precision`` knob (generic, CUDA matmul/conv/rnn,
    oneDNN matmul/conv/rnn) set to ``"ieee"``, and HF32 in torch_npu
    (``torch.npu.matmul.allow_hf32``, default False, and ``torch.npu.conv.allow_hf32``, default
    True: the ViT patch convolution would otherwise run in HF32 on a 910B).
    """
    legacy = (
        _read_legacy(torch.get_float32_matmul_precision),
        _read_legacy(lambda: torch.backends.cuda.matmul.allow_tf32),
        _read_legacy(lambda: torch.backends.cudnn.allow_tf32),
    )
    knobs = _fp32_precision_holders()
    saved_knobs = [holder.fp32_precision for _, holder in knobs]
    npu = _npu_flag_holders()
    saved_npu = [holder.allow_hf32 for _, holder in npu]
    try:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        for _, holder in knobs:
            holder.fp32_precision = "ieee"
        for _, holder in npu:
            holder.allow_hf32 = False
        yield
    finally:
        precision, cuda_tf32, cudnn_tf32 = legacy
        if precision is not None:
            torch.set_float32_matmul_precision(precision)
        if cuda_tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32 = cuda_tf32
        if cudnn_tf32 is not None:
            torch.backends.cudnn.allow_tf32 = cudnn_tf32
        for (_, holder), value in zip(knobs, saved_knobs):
            holder.fp32_precision = value
        for (_, holder), value in zip(npu, saved_npu):
            holder.allow_hf32 = value


def precision_flags() -> dict[str, object]:
    """The precision flags in force right now (for the report header and baseline provenance).

    Keys: ``float32_matmul_precision``, ``cuda.matmul.allow_tf32``, ``cudnn.allow_tf32`` (each
    ``None`` where torch >= 2.9 cannot express the state in the legacy flag), then on torch >= 2.9
    ``fp32_precision`` and ``<path>.fp32_precision`` per knob, and ``npu.matmul.allow_hf32`` /
    ``npu.conv.allow_hf32`` once torch_npu is imported.
    """
    flags: dict[str, object] = {
        "float32_matmul_precision": _read_legacy(torch.get_float32_matmul_precision),
        "cuda.matmul.allow_tf32": _read_legacy(lambda: torch.backends.cuda.matmul.allow_tf32),
        "cudnn.allow_tf32": _read_legacy(lambda: torch.backends.cudnn.allow_tf32),
    }
    for path, holder in _fp32_precision_holders():
        flags[f"{path}.fp32_precision" if path else "fp32_precision"] = holder.fp32_precision
    for name, holder in _npu_flag_holders():
        flags[f"npu.{name}.allow_hf32"] = holder.allow_hf32
    return flags

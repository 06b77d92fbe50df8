"""The mechanics of one training step, as ``ParityCase.train_step`` runs it on each side.

``training_step(spec)`` is the step a side runs: the module in training mode, the forward and the
loss under the recipe's context, the backward, gradient clipping and one optimizer step (through a
dynamic loss scaler under a loss-scaling recipe, ``scaled_backward_and_step``); it returns the
step's leaves (``loss``, ``grad.<p>``, ``amp.*``, ``param.<p>``, ``buffer.<b>``). Also here: the
default optimizer and loss, the optimizer replay from given gradients (``replay_optimizer_step``),
the parameters whose reference gradient is rounding noise (``rounding_level_params``), the golden
of a step (``golden_step``) and the step's description for its baseline (``train_recipe_of``);
``train_check`` puts them together into the runs, golden and ``CheckCall`` of one ``train_step``.
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch

from . import recipes
from .audit import not_audited
from ..store.compact import SAMPLE_SUFFIX, STATS_SUFFIX, base_leaf
from .recipes import Recipe, strict_fp32_flags
from ..leaves import without
from ..structure import train_recipe
from .golden_run import GoldenUnavailableError, golden_dtypes
from .side import RUN_RECIPE, CheckCall, RunSpec, Side, _CopyOnEntry, _Same, _move, run_side, trainable_copy

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def is_training(fn: Any) -> bool:
    """Whether ``fn`` is a module that computes differently in training mode: a dropout (p > 0) or a
    batch-norm layer in training mode. (A fresh ``nn.Linear`` is in training mode too but computes
    the same; such modules keep the eval default.)"""
    if not isinstance(fn, torch.nn.Module):
        return False
    for m in fn.modules():
        if not m.training:
            continue
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            return True
    return False


def default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1): Aurora's training setup."""
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None:
        loss = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("train_step: the output has no scalar loss; pass loss_fn=lambda out: ... , or "
                         "labels=... with loss_fn=torch.nn.CrossEntropyLoss() (called as loss_fn(output, labels))")
    return loss


def train_inputs(name: str, inputs: Any, labels: Any, loss_fn: Any) -> tuple[tuple, Any, Any]:
    """``(positional, keyword, labels)`` of train step ``name``'s forward (``_forward_inputs``).

    Raises:
        ValueError: ``labels`` without a ``loss_fn``.
    """
    if labels is not None and loss_fn is None:
        raise ValueError(f"train_step {name!r}: labels= needs a loss_fn(output, labels), e.g. "
                         "loss_fn=torch.nn.CrossEntropyLoss()")
    return (*_forward_inputs(inputs), labels)


def _forward_inputs(inputs: Any) -> tuple[tuple, Any]:
    """``(positional, keyword)`` forward arguments of ``train_step``'s ``inputs``: a mapping is the
    keywords (kept as given, so its fingerprint is what it was before positional inputs existed), a
    tuple or list the positional arguments, anything else the one positional argument."""
    if isinstance(inputs, Mapping):
        return (), inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _loss_on(loss_fn: Callable[..., torch.Tensor], m: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """``loss_fn``, or for a loss module holding tensors (``CrossEntropyLoss(weight=w)``) a copy on
    ``m``'s device with its floating tensors in the dtype of ``m``'s first floating parameter."""
    if not isinstance(loss_fn, torch.nn.Module) or not any(True for _ in loss_fn.state_dict()):
        return loss_fn
    dtype = next((p.dtype for p in m.parameters() if p.is_floating_point()), None)
    copied = copy.deepcopy(loss_fn).to(_device_of(m))
    return copied.to(dtype) if dtype is not None else copied


def _device_of(module: torch.nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


@dataclass(frozen=True)
class TrainSpec:
    """How a ``train_step`` trains (its arguments of the same names).

    Attributes:
        optimizer: ``(params) -> torch.optim.Optimizer``.
        loss_fn: ``loss_fn(output)``, ``loss_fn(output, labels)`` with labels, or None for ``_default_loss``.
        has_labels: the step was given ``labels``.
        max_grad_norm: clip value of the global gradient norm, or None.
        loop: a whole training loop instead of the single step (``hf_trainer.TrainerLoop``), or None.
    """

    optimizer: OptimizerFactory
    loss_fn: Callable[..., torch.Tensor] | None = None
    has_labels: bool = False
    max_grad_norm: float | None = 1.0
    loop: Callable[[torch.nn.Module, dict, Recipe | None], dict] | None = None


def training_step(spec: TrainSpec) -> Callable[..., dict[str, torch.Tensor]]:
    """The step a side runs: ``step(m, recipe, in_context, positional, labels, **batch) -> leaves``
    (its own parameters are named with a leading underscore, so that no batch key meets them).

    ``m`` is trained in place (a fresh copy of the side's); the forward and the loss run under
    ``recipe.context`` when ``in_context`` (not for the golden run), the backward outside it, as
    Hugging Face Trainer does; ``recipe.loss_scaling`` chooses ``scaled_backward_and_step``. A
    ``loop`` gets ``recipe`` when ``in_context``, else None. The optimizer's construction, the
    clipping and the step are not audited (``audit.not_audited``): they are the plugin's recipe.

    Raises:
        ValueError: no scalar loss in the output (``_default_loss``).
    """

    def step(m: torch.nn.Module, _recipe: Recipe, _in_context: bool, _positional: tuple = (), _labels: Any = None,
             **batch: Any) -> dict[str, torch.Tensor]:
        __tracebackhide__ = True
        m.train()
        if spec.loop is not None:
            return spec.loop(m, batch, _recipe if _in_context else None)
        params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        with not_audited():
            opt = spec.optimizer([p for _, p in params])
            opt.zero_grad(set_to_none=True)
        with _recipe.context(_device_of(m)) if _in_context else contextlib.nullcontext():
            output = m(*_positional, **batch)
            if spec.loss_fn is None:
                loss = _default_loss(output)
            elif not spec.has_labels:
                loss = spec.loss_fn(output)
            else:
                loss = _loss_on(spec.loss_fn, m)(output, _labels)
        out: dict[str, torch.Tensor] = {"loss": loss.detach()}
        out.update(_backward_and_step(loss, opt, params, _device_of(m), spec.max_grad_norm, _recipe.loss_scaling))
        out.update({f"param.{n}": p.detach() for n, p in params})
        out.update({f"buffer.{n}": b.detach() for n, b in m.named_buffers()})
        return out

    return step


def _backward_and_step(loss: torch.Tensor, opt: torch.optim.Optimizer, params: list[tuple[str, torch.nn.Parameter]],
                       device: torch.device, max_grad_norm: float | None,
                       loss_scaling: bool) -> dict[str, torch.Tensor]:
    """The backward, clipping and step of ``training_step``: ``grad.<p>`` leaves, then ``amp.*``
    leaves under loss scaling."""
    __tracebackhide__ = True
    if loss_scaling:
        # only the backward inside is audited (the scaler's ops are not the model's)
        amp = scaled_backward_and_step(loss, opt, params, device, max_grad_norm)
        grads = {k: v for k, v in amp.items() if k.startswith("grad.")}
        grads.update({k: v for k, v in amp.items() if k.startswith("amp.")})
        return grads
    loss.backward()
    with not_audited():  # the plugin's training recipe, not the model (audit.not_audited)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for _, p in params], max_grad_norm)
        grads = {f"grad.{n}": p.grad.detach().clone() for n, p in params if p.grad is not None}
        opt.step()
    return grads


def train_runs(side: Side, module: torch.nn.Module, step: Callable[..., dict], inputs: tuple[tuple, Any, Any],
               seed: int, layers: Any = None) -> tuple[Callable[..., tuple], Callable[..., dict]]:
    """``(run, rerun)`` of a ``ParityCase.train_step``: ``run(device, patched, audited=False,
    args=None, batch=None) -> (leaves, audit)`` trains a fresh copy of ``module`` one ``step`` on
    the device (with the layer records of ``layers`` for the step's own inputs);
    ``rerun(device, patched, args, batch) -> leaves`` with other inputs (``CheckCall.rerun``).

    Args:
        inputs: ``(positional, keyword, labels)`` of the forward.
    """
    positional, keywords, labels = inputs

    def run(device: torch.device, patched: bool, audited: bool = False, args: tuple | None = None,
            batch: dict | None = None) -> tuple:
        __tracebackhide__ = True
        # Copied inside the run, after the patch set is entered: a patch that edits the
        # module's weights (a fault, a port's weight conversion) must reach the copy that trains.
        forward = positional if args is None else tuple(args)
        spec = RunSpec(step, (_CopyOnEntry(module), RUN_RECIPE, True, forward, labels),
                       keywords if batch is None else batch, seed, True, recipe_context=False,
                       layers=layers if args is None and batch is None else None)
        return run_side(side, spec, device, patched, audited)

    def rerun(device: torch.device, patched: bool, args: tuple, batch: dict) -> dict:
        return run(device, patched, args=args, batch=batch)[0]

    return run, rerun


@dataclass(frozen=True)
class TrainCheck:
    """One ``train_step``'s computation (its arguments of the same names), as ``train_check`` needs it.

    Attributes:
        module: the module the step starts from.
        forward: ``(positional, keyword, labels)`` of the forward.
        seed: the seed of the shared random stream.
        spec: how it trains (``TrainSpec``).
        vacuous_ok, fault_weight: as ``train_step`` takes them.
    """

    module: torch.nn.Module
    forward: tuple[tuple, Any, Any]
    seed: int
    spec: TrainSpec
    vacuous_ok: str | None = None
    fault_weight: str | None = None

    def train_recipe(self) -> dict[str, Any]:
        """``train_recipe_of`` this step (its fingerprint ``train_recipe``: computed when recording, or
        comparing with a baseline that recorded one)."""
        spec = self.spec
        return train_recipe_of(self.module, spec.optimizer, spec.max_grad_norm, spec.loss_fn, spec.loop)


def train_check(check: TrainCheck, side: Side, recipe: Recipe, golden_runner: Any,
                layers: Any = None) -> tuple[Callable[..., tuple], Callable[[], dict], CheckCall]:
    """``(run, golden, call)`` of a ``ParityCase.train_step``: ``run`` as ``train_runs`` gives it (with
    the layer records of ``layers``), ``golden()`` the step's golden (``golden_step`` with
    ``golden_runner``), and its ``CheckCall``, whose optimizer replay (``replay_optimizer_step``, in
    ``recipe``'s weights dtype) is None with a ``loop``."""
    spec = check.spec
    step = training_step(spec)
    run, rerun = train_runs(side, check.module, step, check.forward, check.seed, layers)
    golden = partial(golden_step, golden_runner, step, check.module, recipe, check.forward, check.seed)
    replay = (partial(replay_optimizer_step, check.module, optimizer=spec.optimizer,
                      weights_dtype=recipe.weights_dtype) if spec.loop is None else None)
    positional, keywords, _ = check.forward
    call = CheckCall("train_step", check.module, positional, keywords, check.seed, True, rerun, check.vacuous_ok,
                     check.fault_weight, replay=replay,
                     memo=(getattr(layers, "samples", None), _Same(spec.optimizer), _Same(spec.loss_fn),
                           spec.max_grad_norm, _Same(spec.loop)), input_changes=side.input_changes,
                     stream_overrides=side.stream_overrides,
                     loss=None if spec.loop is not None else partial(step_loss, spec, check.forward[2]))
    return run, golden, call


def step_loss(spec: TrainSpec, labels: Any, output: Any, m: torch.nn.Module) -> torch.Tensor:
    """The loss ``training_step`` computes from the forward's ``output`` of ``m`` (``labels`` moved to
    ``m``'s device): ``CheckCall.loss`` of a train step.

    Raises:
        ValueError: no scalar loss in the output (``_default_loss``).
    """
    if spec.loss_fn is None:
        return _default_loss(output)
    if not spec.has_labels:
        return spec.loss_fn(output)
    return _loss_on(spec.loss_fn, m)(output, _move(labels, _device_of(m)))


def golden_step(golden_runner: Any, step: Callable[..., dict], module: torch.nn.Module, recipe: Recipe,
                inputs: tuple[tuple, Any, Any], seed: int) -> dict[str, torch.Tensor | None]:
    """The golden of a training step: ``step`` on a CPU copy of ``module`` in each golden dtype of
    ``recipe`` in turn (``golden.golden_dtypes``: fp64, else for bf16 work fp32), without autocast.
    Under a loss-scaling recipe (fp16) the step's ``amp.*`` leaves are float32 (the scaler's state,
    ``scaled_backward_and_step``), which the golden runner refuses below a float64 golden, so the
    golden starts at float32 there instead of running the float64 step to have it refused.

    Args:
        golden_runner: a ``golden.GoldenRunner``.
        step: the step (``training_step``).
        inputs: ``(positional, keyword, labels)`` of the forward.

    Raises:
        golden.GoldenUnavailableError: of the first dtype tried, when every dtype failed.
    """
    positional, keywords, labels = inputs
    first = None
    dtypes = golden_dtypes(recipe.name)  # fp64, else (bf16 work) fp32
    if recipe.loss_scaling:
        dtypes = tuple(d for d in dtypes if torch.finfo(d).bits <= torch.finfo(AMP_LEAF_DTYPE).bits)
    for dtype in dtypes:
        m = trainable_copy(module).to(dtype)
        try:
            return golden_runner.run(step, (m, recipe, False, positional, labels), keywords,
                                     recipe=recipe.name, seed=seed, grad=True, dtype=dtype)
        except GoldenUnavailableError as exc:
            first = first or exc
    raise first


def replay_optimizer_step(module: torch.nn.Module, leaves: dict[str, Any], optimizer: OptimizerFactory,
                          weights_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One ``optimizer`` step replayed on the CPU from given gradients (``train_step``'s optimizer replay).

    A CPU copy of each trainable parameter of ``module`` (with ``weights_dtype``: of a copy of the
    module cast by ``Module.to(weights_dtype)``, as the run casts it, so that a module that keeps some
    parameters in another dtype keeps them here too), in ``named_parameters`` order (a parameter shared
    by two submodules once, under its first name); ``optimizer`` (a factory, as ``train_step`` takes it)
    over them; each parameter's ``.grad`` set to ``leaves["grad.<p>"]`` cast to the
    parameter's dtype (left None where that leaf is missing, None, or of another shape: the
    optimizer then skips the parameter, as it does one without a gradient); one ``opt.step()`` under
    ``torch.no_grad()`` and ``recipes.strict_fp32_flags``. Nothing is clipped: the ``grad.<p>``
    leaves of a training step are the clipped gradients its optimizer consumed.

    Args:
        module: the module as the training step started from (not modified).
        leaves: a training step's leaves; only the full ``grad.<p>`` leaves are read (compacted
            ``@sample``/``@stats`` leaves cannot be replayed from).
        optimizer: ``(params) -> torch.optim.Optimizer``.
        weights_dtype: the recipe's weights dtype, or None to keep the module's dtypes.

    Returns:
        ``{"param.<p>": CPU tensor}`` after the step for every trainable parameter.
    """
    if weights_dtype is not None:
        # cast as the run casts its module (``Module.to``, which a module may override through
        # ``_apply``, e.g. to keep its norms in float32): a copy of the module, cast whole
        m = trainable_copy(module).cpu().to(weights_dtype)
        params = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
    else:
        # The optimizer sees only its parameters: copies of them, not of the whole module (a deep
        # copy of every submodule and buffer was most of the replay's time on Aurora's tiny model).
        params = [(n, torch.nn.Parameter(p.detach().to("cpu", copy=True)))
                  for n, p in module.named_parameters() if p.requires_grad]
    with strict_fp32_flags():
        opt = optimizer([p for _, p in params])
        opt.zero_grad(set_to_none=True)
        for n, p in params:
            g = leaves.get(f"grad.{n}")
            if isinstance(g, torch.Tensor) and g.shape == p.shape and g.is_floating_point():
                p.grad = g.detach().to(device=p.device, dtype=p.dtype).clone()
        with torch.no_grad():
            opt.step()
    return {f"param.{n}": p.detach() for n, p in params}


#: A parameter's gradient is rounding noise when its largest magnitude is at most this many fp32
#: epsilons (1.19e-7) of the largest gradient magnitude of the step (see ``rounding_level_params``).
ROUNDING_LEVEL_EPS = 100


def rounding_level_params(leaves: dict[str, Any]) -> set[str]:
    """The ``param.<name>`` leaves of a training step whose gradient is rounding noise (left out of
    the comparison where the optimizer replay is not used, see ``ParityCase.train_step``).

    A parameter the loss does not depend on analytically (the key projection's bias under softmax,
    a bias before a training-mode BatchNorm) gets a gradient of pure rounding noise, and AdamW,
    which divides by ``|g| + eps``, turns it into a step of up to ±lr in a random direction: its
    value after the step differs between two correct devices by up to 2·lr. Such a parameter has
    ``max|grad| <= ROUNDING_LEVEL_EPS · eps(fp32) · max over all grads`` in the *reference's* leaves
    (measured on Aurora's tiny training step: six such biases at <= 8.2e-9 against a largest
    gradient of 6.4e-2, the next smallest gradient at 2.0e-5).

    Args:
        leaves: a training step's leaves (``grad.<p>``, ``param.<p>`` …), as ``train_step`` records
            them, or as a compact baseline keeps them (``grad.<p>@stats`` holds ``max |g|``).
    Returns:
        The ``param.<p>`` names to leave out (their ``grad.<p>`` stays compared); for a compacted
        parameter its ``param.<p>@sample`` and ``param.<p>@stats``.
    """
    largest: dict[str, float] = {}
    for k, v in leaves.items():
        if not (k.startswith("grad.") and isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel()):
            continue
        if k.endswith(SAMPLE_SUFFIX):
            continue  # a compacted gradient (``compact``): its @stats leaf holds the exact max |g|
        largest[base_leaf(k)[len("grad."):]] = float(v[2]) if k.endswith(STATS_SUFFIX) else float(
            v.detach().abs().max())
    if not largest:
        return set()
    top = max(largest.values())
    if not top > 0:
        return set()
    limit = ROUNDING_LEVEL_EPS * torch.finfo(torch.float32).eps * top
    rounding = {p for p, m in largest.items() if m <= limit}
    return {k for k in leaves if k.startswith("param.") and base_leaf(k)[len("param."):] in rounding}


_without = without  # the old private name (runner re-exports it)


#: Most overflowing attempts ``scaled_backward_and_step`` backs off from (2^16 down to 2^-8 with
#: the default scaler) before it records the step as skipped.
MAX_SCALE_BACKOFFS = 24

#: The dtype of ``scaled_backward_and_step``'s ``amp.scale`` and ``amp.grad_norm`` leaves, whatever the
#: gradients' dtype (the scaler keeps its scale in float32; ``golden_step`` starts no golden above it).
AMP_LEAF_DTYPE = torch.float32


def scaled_backward_and_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer,
                             params: list[tuple[str, torch.nn.Parameter]], device: torch.device,
                             max_grad_norm: float | None) -> dict[str, torch.Tensor]:
    """Backward, clipping and one optimizer step through a dynamic loss scaler (the ``fp16`` recipe).

    The scaler is ``recipes.make_grad_scaler(device)`` (looked up when called, so a patch set can
    replace it on the target side). Each attempt follows PyTorch's AMP recipe for clipping
    (docs "Automatic Mixed Precision examples", "Gradient clipping"):
    ``scaler.scale(loss).backward()``, ``scaler.unscale_(optimizer)``, ``clip_grad_norm_``,
    ``scaler.step(optimizer)``, ``scaler.update()``. An attempt whose scaled gradients overflow is
    skipped by the scaler (no optimizer step; ``update`` multiplies the scale by its
    ``backoff_factor``, which both torch's and torch_npu's scalers require < 1, so a smaller scale
    after ``update`` means a skipped step); it is then retried from the same forward with the
    smaller scale, as the first iterations of an fp16 training run do (with the default 2^16 the
    tiny Aurora's first attempt overflows in ``embed_layer.proj_layer.weight``: measured on torch
    2.5.1 and 2.14.1). Retries stop at the first step taken, at a non-finite loss (no scale helps)
    or after ``MAX_SCALE_BACKOFFS``.

    Args:
        loss: the scalar loss of the forward (its graph is kept for the retries).
        optimizer: the step's optimizer over ``params``.
        params: ``(name, parameter)`` of every trainable parameter.
        device: where the step runs (chooses the scaler).
        max_grad_norm: clip value of ``torch.nn.utils.clip_grad_norm_`` on the unscaled gradients,
            or None.

    Returns:
        ``grad.<name>`` (the unscaled, clipped gradients of the attempt last run), ``amp.scale``
        (float32 0-d: the scale after the last ``update``), ``amp.skipped_steps`` (int64 0-d:
        attempts skipped for overflow) and ``amp.grad_norm`` (float32 0-d: the global 2-norm of
        the unscaled gradients before clipping; clipping makes the gradients blind to a wrong
        unscale factor, this leaf is not).

    Raises:
        recipes.RecipeError: no GradScaler for the device.
    """
    scaler = recipes.make_grad_scaler(device)
    tensors = [p for _, p in params]
    skipped = 0
    while True:
        with not_audited():  # the scaler, clipping and step are the plugin's recipe, not the model
            optimizer.zero_grad(set_to_none=True)
            scale_before = float(scaler.get_scale())
            scaled = scaler.scale(loss)
        scaled.backward(retain_graph=True)
        with not_audited():
            scaler.unscale_(optimizer)
            present = [p.grad for p in tensors if p.grad is not None]
            if max_grad_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(tensors, max_grad_norm)
            elif present:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in present]))
            else:
                norm = torch.zeros(())
            grads = {f"grad.{n}": p.grad.detach().clone() for n, p in params if p.grad is not None}
            scaler.step(optimizer)
            scaler.update()
            taken = float(scaler.get_scale()) >= scale_before
        if taken or skipped + 1 >= MAX_SCALE_BACKOFFS or not bool(torch.isfinite(loss.detach())):
            skipped += 0 if taken else 1
            break
        skipped += 1
    out: dict[str, torch.Tensor] = dict(grads)
    out["amp.scale"] = torch.tensor(float(scaler.get_scale()), dtype=AMP_LEAF_DTYPE)
    out["amp.skipped_steps"] = torch.tensor(skipped, dtype=torch.int64)
    out["amp.grad_norm"] = norm.detach().to(AMP_LEAF_DTYPE).reshape(())
    return out


def train_recipe_of(module: torch.nn.Module,
                    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                    max_grad_norm: float | None, loss_fn: Any, loop: Any = None) -> dict[str, Any]:
    """``structure.train_recipe`` of a ``train_step``: ``optimizer`` built once (never stepped) on the
    trainable parameters of a throwaway ``trainable_copy(module)``; with ``loop`` only the loop is
    described (it owns optimizer, clipping and loss).

    Raises:
        whatever ``optimizer(params)`` raises (the step itself would raise it too).
    """
    if loop is not None:
        return train_recipe(loop=loop)
    params = [p for p in trainable_copy(module).parameters() if p.requires_grad]
    return train_recipe(optimizer(params), max_grad_norm, loss_fn)

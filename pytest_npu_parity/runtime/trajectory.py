"""N training steps recorded as curves: what ``judge.trajectory`` judges (``ParityCase.trajectory``).

``TrajectoryLoop`` trains a module for ``steps`` optimizer steps the way upstream Aurora trains
(``runner.py`` ``AuroraRunner.train_model``: AdamW lr 1e-4, betas (0.9, 0.95), eps 1e-8, weight decay
0.1, ``max_grad_norm`` 1.0, ``lr_scheduler_type='constant'``; or, with ``schedule="warmup_log"``,
``deepspeed.json``'s ``WarmupLR`` from 0 to the lr, whose DeepSpeed defaults are 1000 steps and
``warmup_type='log'``: DeepSpeed 0.19.8 ``deepspeed/runtime/lr_schedules.py`` ``WarmupLR._get_gamma``
gives lr · ln(i + 1) / ln(warmup_steps) at scheduler iteration i, and ``engine.py``
``DeepSpeedEngine._take_model_step`` steps the scheduler after ``optimizer.step()``, so optimizer step
k >= 1 runs with iteration k - 1's lr and step 0 with the lr ``WarmupLR.__init__`` set, the minimum:
0, 0, 1.0e-5, 1.6e-5 … for lr 1e-4 — checked against DeepSpeed's own class), cycling through the
batches it is given.

Per step it records, without a host sync (rows of one preallocated tensor on the run's device, copied
to the CPU once at the end): the loss, the global gradient 2-norm before clipping, and the gradient
2-norm of every module that owns trainable parameters. Under a loss-scaling recipe (``fp16``) it
trains as PyTorch's AMP recipe does ("Automatic Mixed Precision examples", "Gradient clipping"): one
dynamic scaler for the run (``recipes.make_grad_scaler``, looked up when the run starts, so a patch
set can replace it), ``scaler.scale(loss).backward()``, ``scaler.unscale_(optimizer)``, the norms and
clipping on the unscaled gradients, ``scaler.step``, ``scaler.update()``; a step whose gradients
overflow is skipped by the scaler (its gradient norms are then inf or NaN on that step), and the
scale after each step is recorded as the ``amp_scale`` curve. The learning rate of each step, the
weight 2-norm of every such module and the 2-norm of every module's floating buffers (BatchNorm running
statistics) at ``checkpoints`` evenly spaced steps (the last included) come with them.

Low-precision weights (the ``bf16-weights`` recipe, upstream's ``torch_dtype=bfloat16`` under
``deepspeed.json``'s ``"bf16": {"enabled": true}``) train as DeepSpeed trains them: the optimizer holds a
float32 master copy of every bf16/fp16 parameter, the bf16 gradients are added into float32 gradients,
clipping and the AdamW step run on the float32 copies and the result is copied back into the bf16 weights
(DeepSpeed 0.19.8 ``deepspeed/runtime/bf16_optimizer.py`` ``BF16_Optimizer``: ``_update_hp_grad`` adds
``lp.grad.to(hp_grad.dtype)``, ``step`` clips and steps the fp32 partition, ``update_lp_params`` copies it
into the bf16 partition; ZeRO stages 1-2 keep fp32 master weights likewise unless
``bf16_master_weights_and_gradients`` is set). ``master_weights=False`` steps AdamW on the bf16 weights
themselves, as a loop without master weights does: at lr 1e-4 most updates are smaller than half a bf16
ULP of the weight and are lost.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

SCHEDULES = ("constant", "warmup_log", "warmup_linear")


def _norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The 2-norm of ``tensors`` taken together (float32 0-d on ``device``; 0 for none)."""
    if not tensors:
        return torch.zeros((), device=device)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.detach().float()) for t in tensors]))


def trainable_owners(module: torch.nn.Module) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """``(module name, its own trainable parameters)`` of every module that owns any (the root is
    ``<root>``): whose gradient norms the curves ``layer_grad_norm.<name>`` follow."""
    owners = [(name or "<root>", [p for p in m.parameters(recurse=False) if p.requires_grad])
              for name, m in module.named_modules()]
    return [(name, ps) for name, ps in owners if ps]


def owner_grad_norms(owners: Sequence[tuple[str, Sequence[torch.nn.Parameter]]], device: torch.device) -> torch.Tensor:
    """The gradient 2-norm of each owner's parameters (float32 ``[len(owners)]`` on ``device``; 0 for none)."""
    return torch.stack([_norm([p.grad for p in ps if p.grad is not None], device) for _, ps in owners])


def _master_copies(params: Sequence[torch.nn.Parameter]) -> dict[int, torch.Tensor]:
    """``{index in params: float32 master copy}`` of every bf16/fp16 parameter (a leaf that requires grad,
    on the parameter's device); float32 and float64 parameters get none."""
    return {i: p.detach().float().clone().requires_grad_(True) for i, p in enumerate(params)
            if p.dtype in (torch.bfloat16, torch.float16)}


def _scale_of(scaler: Any) -> torch.Tensor | float:
    """The scaler's current scale without a host sync where it keeps it as a tensor (``_scale`` of
    ``torch.amp.GradScaler``, which torch_npu's scaler subclasses), else ``get_scale()`` (a float)."""
    scale = getattr(scaler, "_scale", None)
    return scale.detach().float().reshape(()) if isinstance(scale, torch.Tensor) else float(scaler.get_scale())


@dataclass(frozen=True)
class TrajectoryLoop:
    """``steps`` optimizer steps over ``batches``, recorded as curves (module docstring).

    Attributes:
        steps: optimizer steps (>= 1).
        learning_rate, adam_betas, adam_epsilon, weight_decay, max_grad_norm: upstream Aurora's AdamW
            (``max_grad_norm`` None: no clipping).
        schedule: ``constant``, ``warmup_log`` or ``warmup_linear`` (DeepSpeed ``WarmupLR``, from 0).
        warmup_steps: DeepSpeed ``warmup_num_steps`` (its default 1000; at least 2, as DeepSpeed clamps).
        checkpoints: steps at which weight norms are recorded (evenly spaced, the last step included).
        loss_fn: ``loss_fn(output)`` for a dict batch, ``loss_fn(output, target)`` for a ``(inputs…,
            target)`` batch; None: ``output.loss`` (a dict batch only).
        evaluate: ``evaluate(module, held_out) -> {metric: tensor [W]}``, called once after the last
            step with the trained module in eval mode, without autograd, under the recipe's autocast,
            on the ``held_out`` inputs of the batch (``judge.forecast.forecast_metrics`` gives such
            per-window metrics); its tensors are returned as ``forecast.<metric>``. None: no evaluation.
        master_weights: for bf16/fp16 trainable parameters, keep float32 master weights and step the
            optimizer on them (DeepSpeed's bf16 scheme, module docstring); True by default. False: step
            on the low-precision weights. float32 parameters are stepped directly either way.
    """

    steps: int = 300
    learning_rate: float = 1e-4
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    schedule: str = "constant"
    warmup_steps: int = 1000
    checkpoints: int = 5
    loss_fn: Callable[..., torch.Tensor] | None = None
    evaluate: Callable[[torch.nn.Module, Any], Mapping[str, torch.Tensor]] | None = None
    master_weights: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 1:
            raise ValueError(f"TrajectoryLoop: steps must be a positive int, got {self.steps!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"TrajectoryLoop: schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        if not isinstance(self.checkpoints, int) or self.checkpoints < 1:
            raise ValueError(f"TrajectoryLoop: checkpoints must be a positive int, got {self.checkpoints!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if self.schedule == "constant":
            return self.learning_rate
        warmup = max(2, self.warmup_steps)
        iteration = step - 1  # DeepSpeed steps its scheduler after the optimizer (module docstring)
        if iteration < 0:
            return 0.0
        if iteration >= warmup:
            return self.learning_rate
        gamma = math.log(iteration + 1) / math.log(warmup) if self.schedule == "warmup_log" else iteration / warmup
        return self.learning_rate * gamma

    def checkpoint_steps(self) -> list[int]:
        """The steps whose weight norms are recorded (after that step's update), ascending."""
        k = min(self.checkpoints, self.steps)
        return sorted({round((i + 1) * self.steps / k) - 1 for i in range(k)})

    def __call__(self, module: torch.nn.Module, batch: Mapping[str, Any], recipe: Any = None) -> dict[str, torch.Tensor]:
        """Train ``module`` in place on ``batch["batches"]`` (cycled) and return its curves.

        Args:
            module: the model, in training mode, on its device. A parameter several modules share (tied
                weights, e.g. GPT-2's ``wte`` and ``lm_head``) is stepped and clipped once and counts once in
                ``grad_norm``; each of its owners' ``layer_grad_norm`` curves includes it.
            batch: ``{"batches": [b0, b1, …]}``, each a dict (``module(**b)``) or a tuple/list
                ``(inputs…, target)`` (``loss_fn(module(*inputs), target)``), already on the device;
                with ``evaluate``, also ``"held_out"``: what ``evaluate`` is given.
            recipe: the run's ``recipes.Recipe`` (its autocast context around forward and loss), or None.

        Returns:
            ``loss``, ``grad_norm`` (float32 ``[steps]``), ``lr`` (float64 ``[steps]``),
            ``layer_grad_norm.<module>`` (float32 ``[steps]``), ``weight_norm.<module>`` (float32
            ``[checkpoints]``), ``buffer_norm.<module>`` (float32 ``[checkpoints]``: the 2-norm of the
            module's own floating buffers, e.g. BatchNorm running statistics, for every module that has
            any), ``checkpoint_steps`` (int64 ``[checkpoints]``), under a loss-scaling
            recipe ``amp_scale`` (float32 ``[steps]``: the scale after each step), and with ``evaluate``
            ``forecast.<metric>`` (float32), all on the CPU.

        Raises:
            ValueError: no batches, no trainable parameter, a batch form the loss cannot be computed
                from, an output without a loss, a non-scalar loss, ``evaluate`` without ``held_out``
                inputs or returning something else than per-window values.
        """
        batches: Sequence[Any] = batch.get("batches") or ()
        if not batches:
            raise ValueError("TrajectoryLoop: give the batches as {'batches': [batch, …]} (at least one)")
        owners = trainable_owners(module)
        # a parameter two modules share (tied weights) is one parameter: stepped, clipped and counted once
        params = list({id(p): p for _, ps in owners for p in ps}.values())
        if not params:
            raise ValueError("TrajectoryLoop: the module has no trainable parameter (every requires_grad is False): "
                             "nothing to train")
        device = params[0].device
        buffered = [(name or "<root>", [b for b in m.buffers(recurse=False) if b.is_floating_point()])
                    for name, m in module.named_modules()]
        buffered = [(name, bs) for name, bs in buffered if bs]
        masters = _master_copies(params) if self.master_weights else {}
        stepped = [masters.get(i, p) for i, p in enumerate(params)]
        opt = torch.optim.AdamW(stepped, lr=self.lr_at(0), betas=self.adam_betas, eps=self.adam_epsilon,
                                weight_decay=self.weight_decay)
        scaler = None
        if recipe is not None and getattr(recipe, "loss_scaling", False):
            from .recipes import make_grad_scaler

            if any(p.dtype in (torch.bfloat16, torch.float16) for p in params):
                raise ValueError("TrajectoryLoop: a loss-scaling recipe (fp16 autocast) trains float32 weights; "
                                 "this module has bf16/fp16 parameters: use the bf16-weights recipe without loss "
                                 "scaling, or float32 weights")
            scaler = make_grad_scaler(device)
        rows = torch.zeros(self.steps, 3 + len(owners), dtype=torch.float32, device=device)
        marks = self.checkpoint_steps()
        weights = torch.zeros(len(marks), len(owners) + len(buffered), dtype=torch.float32, device=device)
        lrs = []
        for step in range(self.steps):
            lr = self.lr_at(step)
            for group in opt.param_groups:
                group["lr"] = lr
            lrs.append(lr)
            opt.zero_grad(set_to_none=True)
            for i in masters:
                params[i].grad = None
            with recipe.context(device) if recipe is not None else contextlib.nullcontext():
                loss = self._loss(module, batches[step % len(batches)])
            if scaler is None:
                loss.backward()
            else:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            with torch.no_grad():
                rows[step, 3:] = owner_grad_norms(owners, device)
                rows[step, 0] = loss.detach().float()
            for i, master in masters.items():  # bf16 gradients into the float32 master gradients
                grad = params[i].grad
                master.grad = None if grad is None else grad.detach().to(master.dtype)
            clip = self.max_grad_norm if self.max_grad_norm is not None else math.inf
            rows[step, 1] = torch.nn.utils.clip_grad_norm_(stepped, clip).detach().float()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
                rows[step, 2] = _scale_of(scaler)
            with torch.no_grad():
                for i, master in masters.items():  # the stepped master weights back into the model's dtype
                    params[i].copy_(master)
            if step in marks:
                with torch.no_grad():
                    weights[marks.index(step)] = torch.stack([_norm(ps, device) for _, ps in owners + buffered])
        rows, weights = rows.cpu(), weights.cpu()
        out = {"loss": rows[:, 0].clone(), "grad_norm": rows[:, 1].clone(),
               "lr": torch.tensor(lrs, dtype=torch.float64), "checkpoint_steps": torch.tensor(marks)}
        if scaler is not None:
            out["amp_scale"] = rows[:, 2].clone()
        for i, (name, _) in enumerate(owners):
            out[f"layer_grad_norm.{name}"] = rows[:, 3 + i].clone()
            out[f"weight_norm.{name}"] = weights[:, i].clone()
        for i, (name, _) in enumerate(buffered):
            out[f"buffer_norm.{name}"] = weights[:, len(owners) + i].clone()
        if self.evaluate is not None:
            out.update(self._evaluate(module, batch.get("held_out"), recipe, device))
        return out

    def _evaluate(self, module: torch.nn.Module, held_out: Any, recipe: Any, device: torch.device) -> dict:
        if held_out is None:
            raise ValueError("TrajectoryLoop: evaluate needs held-out inputs (parity.trajectory(..., held_out=…))")
        module.eval()
        with torch.no_grad(), recipe.context(device) if recipe is not None else contextlib.nullcontext():
            metrics = self.evaluate(module, held_out)
        try:
            return {f"forecast.{k}": torch.as_tensor(v).detach().float().cpu().reshape(-1) for k, v in metrics.items()}
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"TrajectoryLoop: evaluate must return {{metric: per-window values}} (tensors or lists "
                             f"of numbers); got {type(metrics).__name__} ({exc})") from None

    def _loss(self, module: torch.nn.Module, batch: Any) -> torch.Tensor:
        if isinstance(batch, Mapping):
            output = module(**batch)
            loss = self.loss_fn(output) if self.loss_fn is not None else getattr(output, "loss", None)
            if loss is None and self.loss_fn is None and isinstance(output, Mapping):
                loss = output.get("loss")
            if loss is None and self.loss_fn is None:
                raise ValueError(f"TrajectoryLoop: the output ({type(output).__name__}) has no loss (no .loss "
                                 "attribute or 'loss' key); pass loss_fn=")
        elif isinstance(batch, (tuple, list)) and len(batch) >= 2 and self.loss_fn is not None:
            loss = self.loss_fn(module(*batch[:-1]), batch[-1])
        else:
            raise ValueError("TrajectoryLoop: a batch is a dict (module(**batch), output.loss or loss_fn(output)) "
                             "or (inputs…, target) with loss_fn=…; got "
                             f"{type(batch).__name__}{' without loss_fn' if self.loss_fn is None else ''}")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("TrajectoryLoop: the loss is not a one-element tensor; pass loss_fn=…")
        return loss.reshape(())

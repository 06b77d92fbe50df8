"""N optimizer steps through Hugging Face ``Trainer`` (optionally under DeepSpeed) as a parity check's loop.

The Ascend guide's smoke run is upstream Aurora's ``trainer/hf_trainer.py`` with ``--max_steps 5`` (seed
``000_76a3155d974abf2f.txt`` §8.2); the guide says Trainer needs no change because transformers >= 4.40 runs on
NPUs through accelerate (§5.5). :class:`TrainerLoop` is that run made comparable: it is passed to
``ParityCase.train_step(..., loop=TrainerLoop(...))``, which calls it once per side (reference on the CPU
without the patch set, target on its device under the patch set, golden on the CPU in fp64) on a fresh copy of
the model, inside the check's shared random stream.

One call trains ``module`` for ``steps`` optimizer steps of ``batch_size`` rows each, taken in order from
``batch`` (a dict of tensors whose first dimension is the row), and returns, as CPU-comparable leaves:

* ``loss.step1`` … ``loss.step<N>``: the training loss of every step, as ``Trainer.training_step`` returns it;
* ``grad.<name>``: every trainable parameter's gradient of the last step as the optimizer step sees it
  (plain Trainer: after ``max_grad_norm`` clipping, read in ``TrainerCallback.on_pre_optimizer_step``;
  DeepSpeed: ``deepspeed.utils.safe_get_full_grad`` right before ``DeepSpeedEngine.step``, which clips inside);
* ``param.<name>``: every trainable parameter after the last step; ``buffer.<name>``: every buffer
  (BatchNorm running statistics and ``num_batches_tracked``).

Determinism, so that two correct devices and two torch releases can agree:

* rows are fed in order (``SequentialSampler`` instead of Trainer's ``RandomSampler``, whose permutation comes
  from the global torch generator), no dataloader workers, no pinned memory;
* the optimizer is pinned to ``adamw_torch``: Trainer's default is ``adamw_torch_fused`` from torch 2.8 on and
  ``adamw_torch`` before (``TrainingArguments.optim`` in transformers 4.57), another kernel on each release;
* ``Trainer.__init__`` reseeds Python, NumPy and torch with ``TrainingArguments.seed``
  (``transformers.trainer_utils.set_seed``); their states are put back right after, so every draw of the run
  (dropout, frequency masking, flow-matching noise) comes from the check's shared stream (``rng``).

Precision: the ``bf16`` recipe runs ``TrainingArguments(bf16=True)`` (Trainer's own autocast through
accelerate); the ``fp32`` recipe and the golden run without. Under DeepSpeed the config's ``bf16``/``fp16``
sections are set to the recipe (DeepSpeed's bf16 mode casts the weights to bf16 —
``DeepSpeedEngine._configure_distributed_model`` — which upstream Aurora's ``torch.fft.rfft`` cannot take;
and transformers refuses ``bf16=True`` on a machine without an accelerator unless ``use_cpu``, which bypasses
DeepSpeed: so on the CPU only the fp32 recipe can run DeepSpeed).

Devices: Trainer without a launcher trains on ``cpu`` (``use_cpu=True``), ``npu:0`` or ``cuda:0``
(``TrainingArguments._setup_devices``); a target with another index is refused with the fix. DeepSpeed runs as
one process (``RANK=0``, ``WORLD_SIZE=1``, ``MASTER_ADDR=127.0.0.1``, a free local port) with the collective
backend of its accelerator (``gloo`` on the CPU, ``hccl`` on NPUs); a CPU side switches DeepSpeed to its CPU
accelerator for the run, and the process group is destroyed afterwards.
"""
from __future__ import annotations

import contextlib
import copy
import os
import random
import socket
import tempfile
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from .process_group import destroy_process_groups
from .trajectory import owner_grad_norms, trainable_owners

__all__ = ["TrainerLoop", "deepspeed_unavailable", "DEFAULT_STEPS"]

#: The guide's smoke run: ``run_train_npu.sh --max_steps 5`` (§8.2).
DEFAULT_STEPS = 5


def deepspeed_unavailable() -> str | None:
    """Why DeepSpeed cannot run a Trainer loop here (one sentence), or None when it can be imported."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install 'pytest-npu-parity[deepspeed]')"
    try:
        with contextlib.redirect_stdout(None):  # DeepSpeed logs its accelerator choice on stdout
            import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"DeepSpeed does not import: {type(exc).__name__}: {exc}"
    return None


class _Rows(torch.utils.data.Dataset):
    """Row ``i`` of every tensor of ``batch`` (Trainer's ``default_data_collator`` stacks them back)."""

    def __init__(self, batch: Mapping[str, torch.Tensor]):
        self.batch = dict(batch)
        self.n = len(next(iter(self.batch.values())))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _deepspeed_process(device: torch.device) -> Iterator[None]:
    """One-process DeepSpeed on ``device``: its accelerator matched to the device type, a local rendezvous,
    the process group destroyed on exit."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator, set_accelerator

    with contextlib.redirect_stdout(None):
        previous = get_accelerator()
    name = previous.device_name()
    if device.type == "cpu" and name != "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    elif device.type != name:
        raise ValueError(f"DeepSpeed's accelerator is {name!r} but the check runs on {device}: set "
                         f"DS_ACCELERATOR={device.type} (for npu, torch_npu must import)")
    import deepspeed.ops

    already = dist.is_available() and dist.is_initialized()
    # deepspeed/comm/torch.py build_shm_op: every new CPU TorchBackend JIT-compiles the shared-memory
    # allreduce op (C++, ninja; seconds when cached, a compiler and much longer when not) if
    # __compatible_ops__ lists it. One process has no peer to share memory with: not listed for the run.
    compatible = deepspeed.ops.__compatible_ops__
    shm = compatible.get(SHM_COMM_OP, None)
    compatible[SHM_COMM_OP] = False
    try:
        with _environ(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_WORLD_SIZE="1"):
            yield
    finally:
        if not already and dist.is_available() and dist.is_initialized():
            import deepspeed.comm

            # deepspeed.comm's destroy also drops DeepSpeed's cached groups (deepspeed/comm/comm.py); through
            # destroy_process_groups because on torch 2.5.1 freeing a gloo group right after ZeRO's async
            # gathers can deadlock (process_group module docstring)
            destroy_process_groups(deepspeed.comm.destroy_process_group)
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # is_deepspeed_zero3_enabled() reads this global
        if shm is None:
            compatible.pop(SHM_COMM_OP, None)
        else:
            compatible[SHM_COMM_OP] = shm
        set_accelerator(previous)


#: DeepSpeed's CPU shared-memory allreduce op (``op_builder/cpu/comm.py`` ``ShareMemCommBuilder.NAME``).
SHM_COMM_OP = "deepspeed_shm_comm"


@contextlib.contextmanager
def _kept_environ() -> Iterator[None]:
    """Put ``os.environ`` back as it was: ``TrainingArguments.__post_init__`` sets ``ACCELERATE_USE_DEEPSPEED``
    and ``ACCELERATE_MIXED_PRECISION`` for good (transformers 4.57), which would turn the next run into a
    DeepSpeed or mixed-precision one."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


@dataclass(frozen=True)
class TrainerLoop:
    """``steps`` Trainer steps on ``module`` (see the module docstring); pass to ``ParityCase.train_step(loop=)``.

    Attributes:
        steps: optimizer steps (``TrainingArguments.max_steps``; default 5, the guide's smoke run).
        batch_size: rows per step (``per_device_train_batch_size``); the batch needs ``steps * batch_size`` rows.
        deepspeed_config: a DeepSpeed JSON config (path or dict) to train under, or None for plain Trainer. The
            ZeRO stage and every other field come from it; ``bf16``/``fp16`` are set to the recipe; batch sizes
            and ``gradient_clipping`` default to ``"auto"`` (filled by Trainer) when absent. ZeRO stages 0–2.
        learning_rate, adam_betas, adam_epsilon, weight_decay, max_grad_norm: upstream Aurora's AdamW setup
            (``runner.default_optimizer``); Trainer's linear decay schedule without warmup applies on top.
        seed: ``TrainingArguments.seed`` (its reseeding is undone, see the module docstring).
        curves: return the run's curves instead of the last step's leaves, for ``ParityCase.trajectory``:
            ``loss``, ``grad_norm`` (the global gradient 2-norm before Trainer clips it, read right after
            ``Trainer.training_step``'s backward), ``lr`` (the scheduler's rate the step's optimizer step
            uses) and ``layer_grad_norm.<module>`` per step. Plain Trainer only (under DeepSpeed the
            gradients live in the engine's partitions).
    """

    steps: int = DEFAULT_STEPS
    batch_size: int = 4
    deepspeed_config: str | os.PathLike[str] | dict | None = None
    learning_rate: float = 1e-4
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    extra_args: dict[str, Any] = field(default_factory=dict)
    curves: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"TrainerLoop: steps must be a positive int, got {self.steps!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"TrainerLoop: batch_size must be a positive int, got {self.batch_size!r}")

    @property
    def rows(self) -> int:
        """Rows the batch must have: ``steps * batch_size``."""
        return self.steps * self.batch_size

    def config(self, bf16: bool) -> dict[str, Any] | None:
        """The DeepSpeed config this loop trains under for a bf16 (or not) run, or None without DeepSpeed.

        Raises:
            deepspeed_config.DeepSpeedConfigError: a config file that is missing or not a JSON object.
            ValueError: ZeRO stage 3 (its parameters are partitioned and not read back here).
        """
        if self.deepspeed_config is None:
            return None
        from .deepspeed_config import load_config

        config = copy.deepcopy(self.deepspeed_config if isinstance(self.deepspeed_config, dict)
                               else load_config(self.deepspeed_config))
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        if stage not in (0, 1, 2):
            raise ValueError(f"TrainerLoop: ZeRO stage {stage!r} is not supported (0, 1 or 2)")
        config.pop("bfloat16", None)
        config["bf16"] = dict(config.get("bf16") or {}, enabled=bool(bf16))
        config["fp16"] = dict(config.get("fp16") or {}, enabled=False)
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                    "gradient_clipping"):
            config.setdefault(key, "auto")
        return config

    def __call__(self, module: torch.nn.Module, batch: Mapping[str, Any], recipe: Any = None) -> dict[str, torch.Tensor]:
        """Train ``module`` (in place, on the device its parameters are on) and return the leaves.

        Args:
            module: the model; its forward takes the keys of ``batch`` and returns an output with ``loss``.
            batch: tensors with ``rows`` (or more) rows each, already on the module's device; or
                ``{"batches": [b0, b1, …]}`` (``ParityCase.trajectory``), whose dicts are joined row-wise.
            recipe: the ``recipes.Recipe`` of the run (``bf16`` → ``TrainingArguments(bf16=True)``), or None
                (the golden run: no autocast).
        Raises:
            ValueError: too few rows, a recipe Trainer cannot express (``bf16-weights``), a device Trainer
                does not train on, or (DeepSpeed) an accelerator that does not match the device.
        """
        from transformers import Trainer, TrainerCallback, TrainingArguments

        if recipe is not None and getattr(recipe, "weights_dtype", None) is not None:
            raise ValueError(f"TrainerLoop: recipe {recipe.name!r} casts the weights; Trainer trains fp32 weights "
                             "(use fp32 or bf16)")
        bf16 = recipe is not None and getattr(recipe, "autocast_dtype", None) == torch.bfloat16
        if "batches" in batch:  # ParityCase.trajectory's form: the batches joined row by row
            batch = {k: torch.cat([b[k] for b in batch["batches"]]) for k in batch["batches"][0]}
        if self.curves and self.deepspeed_config is not None:
            raise ValueError("TrainerLoop: curves=True needs plain Trainer (under DeepSpeed the gradients are "
                             "partitioned inside the engine); drop deepspeed_config")
        sizes = {k: len(v) for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if not sizes or min(sizes.values()) < self.rows:
            raise ValueError(f"TrainerLoop: {self.steps} steps of {self.batch_size} rows need {self.rows} rows, the "
                             f"batch has {sizes}")
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        ds_config = self.config(bf16)
        rows = {k: v[:self.rows] for k, v in batch.items()}
        losses: list[torch.Tensor] = []
        grads: dict[str, torch.Tensor] = {}
        trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        owners = trainable_owners(module) if self.curves else []
        norms: list[torch.Tensor] = []  # per step: [global, per owner…], before Trainer clips
        lrs: list[float] = []
        curves = self.curves

        class Capture(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                if ds_config is None and state.global_step + 1 == args.max_steps:
                    grads.update({n: p.grad.detach().clone() for n, p in trainable if p.grad is not None})

        class ParityTrainer(Trainer):
            def _get_train_sampler(self, *args: Any, **kwargs: Any):
                return torch.utils.data.SequentialSampler(self.train_dataset)

            def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
                if ds_config is not None and self.state.global_step + 1 == self.args.max_steps:
                    _capture_before_step(self.model_wrapped, trainable, grads)
                loss = super().training_step(*args, **kwargs)
                losses.append(loss.detach().clone())
                if curves:  # after the backward, before Trainer's clipping and optimizer step
                    with torch.no_grad():
                        per_owner = owner_grad_norms(owners, device)
                        norms.append(torch.cat([torch.linalg.vector_norm(per_owner).reshape(1), per_owner]))
                    lrs.append(float(self.lr_scheduler.get_last_lr()[0]))
                return loss

        with contextlib.ExitStack() as stack:
            out_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="npu-parity-trainer-"))
            stack.enter_context(_kept_environ())
            if ds_config is not None:
                stack.enter_context(_deepspeed_process(device))
            args = TrainingArguments(
                output_dir=out_dir, max_steps=self.steps, per_device_train_batch_size=self.batch_size,
                gradient_accumulation_steps=1, learning_rate=self.learning_rate, adam_beta1=self.adam_betas[0],
                adam_beta2=self.adam_betas[1], adam_epsilon=self.adam_epsilon, weight_decay=self.weight_decay,
                max_grad_norm=self.max_grad_norm, optim="adamw_torch", bf16=bf16,
                use_cpu=device.type == "cpu" and ds_config is None, deepspeed=ds_config, seed=self.seed % 2**32,
                report_to=[], save_strategy="no", logging_strategy="no", eval_strategy="no",
                remove_unused_columns=False, dataloader_pin_memory=False, dataloader_num_workers=0,
                disable_tqdm=True, **self.extra_args)
            trained_on = args.device
            if (trained_on.type, trained_on.index or 0) != (device.type, device.index or 0):
                raise ValueError(f"TrainerLoop: Trainer trains on {trained_on}, the check runs on {device}: without "
                                 "a launcher Trainer uses device index 0 — run the target on index 0 (or make "
                                 "only that device visible: ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES)")
            args._n_gpu = 1 if device.type == "cuda" else args._n_gpu  # never nn.DataParallel over all GPUs
            states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
            trainer = ParityTrainer(model=module, args=args, train_dataset=_Rows(rows), callbacks=[Capture()])
            random.setstate(states[0])  # Trainer.__init__ reseeded everything with args.seed: undo it
            np.random.set_state(states[1])
            torch.random.set_rng_state(states[2])
            trainer.train()
            if len(losses) != self.steps:
                raise RuntimeError(f"TrainerLoop: Trainer ran {len(losses)} training steps, {self.steps} expected")
            if curves:
                rows = torch.stack(norms).float().cpu()
                out = {"loss": torch.stack(losses).float().cpu().reshape(-1), "grad_norm": rows[:, 0].clone(),
                       "lr": torch.tensor(lrs, dtype=torch.float64)}
                out.update({f"layer_grad_norm.{name}": rows[:, 1 + i].clone() for i, (name, _) in enumerate(owners)})
                del trainer
                return out
            out: dict[str, torch.Tensor] = {f"loss.step{i + 1}": loss for i, loss in enumerate(losses)}
            out.update({f"grad.{n}": grads[n] for n, _ in trainable if n in grads})
            out.update({f"param.{n}": p.detach().clone() for n, p in trainable})
            out.update({f"buffer.{n}": b.detach().clone() for n, b in module.named_buffers()})
            del trainer
        return out


def _capture_before_step(engine: Any, trainable: list, grads: dict) -> None:
    """Wrap ``engine.step`` once so that it stores every full gradient (``safe_get_full_grad``) first."""
    if getattr(engine, "_npu_parity_capture", False):
        return
    from deepspeed.utils import safe_get_full_grad

    step = engine.step

    def capturing_step(*args: Any, **kwargs: Any):
        for n, p in trainable:
            g = safe_get_full_grad(p)
            if g is not None:
                grads[n] = g.detach().clone()
        return step(*args, **kwargs)

    engine.step = capturing_step
    engine._npu_parity_capture = True

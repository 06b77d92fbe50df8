"""Data-parallel parity: one DDP training step on ``world_size`` ranks against a single-process reference.

Parity of one process says nothing about the gradient all-reduce that DDP (or DeepSpeed) performs over
HCCL on an Ascend machine. :func:`data_parallel_step` launches ``world_size`` ranks with
``torch.multiprocessing`` (``spawn``), wraps the model in ``DistributedDataParallel`` on the backend that
fits the device type (``npu.dist_backend_for``: gloo on the CPU, hccl on NPUs, nccl on CUDA), runs one
training step on each rank's shard of the batch and compares the result with a single-process reference.

What the reference is, and why it is not a full-batch step
    A DDP step on a split batch equals a full-batch step only when the loss is a mean of independent
    per-sample terms and every random draw of a sample is the same in both runs. Upstream Aurora's loss
    is neither: (1) its encoder and decoder layers use ``nn.BatchNorm1d`` (``norm_mode="batch"``), whose
    training-mode statistics are computed over the local batch, so a shard of 2 normalizes with other
    statistics than the full batch of 4 (``SyncBatchNorm`` would be needed for equality); (2) the
    reconstruction loss keeps only elements below a threshold (``reco_loss[reco_loss < eps].mean()``)
    and ``FlowLoss`` divides by the count of valid elements (``loss[mask].sum() / mask.sum()``): a mean
    of per-shard masked means is not the masked mean of the whole batch; (3) frequency masking draws one
    ``random.random()`` per call, and flow-matching noise and dropout masks are drawn per batch, so the
    draws a sample sees depend on which batch it is in.

    The reference is therefore what DDP is specified to compute: rank ``r``'s shard is run by a
    separate copy of the model under ``rng.same_randomness(seed + r)`` (the same random stream that
    rank ``r`` uses), the per-rank gradients are averaged (DDP's all-reduce is a sum divided by the
    world size), and the global-norm clipping and the optimizer step are applied once. This is a
    gradient-accumulation-equivalent single process: it isolates the distributed wrapper, the
    backend's all-reduce and the parameter broadcast, which is what this check exists for. Each rank's
    BatchNorm buffers are compared with those of the reference copy that ran its shard.

Compared leaves (for every rank ``r``): ``rank<r>.loss`` (the rank's local loss), ``rank<r>.grad.<p>``
(the all-reduced gradient of every trainable parameter, before clipping), ``rank<r>.param.<p>`` (every
trainable parameter after clipping and one optimizer step) and ``rank<r>.buffer.<b>`` (every buffer).
Every rank must hold the same gradients and parameters as the reference: a rank that diverges fails.

Tensors cross process boundaries only as safetensors files in a temporary directory (the initial state
dict and shards going out, every rank's results coming back); the spawn arguments are strings, numbers
and importable callables. A rank that hangs or dies never hangs the caller: the process group has a
timeout and the launcher kills the ranks after ``timeout_s``.
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import json
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

from .npu.loading import prepare_torch

prepare_torch()  # a spawned rank imports this module first: keep a torch_npu without CANN from breaking it

import torch  # noqa: E402

from .process_group import destroy_process_groups
from .recipes import RECIPES
from .rng import same_randomness

__all__ = [
    "DataParallelError",
    "NotEnoughDevicesError",
    "DataParallelResult",
    "data_parallel_step",
    "reference_step",
    "rank_devices",
    "shard_inputs",
    "free_port",
]

#: Seconds a whole launch may take before its ranks are killed (import + build + one step: ≈ 15 s for
#: the tiny Aurora on 2 busy CPU cores here).
DEFAULT_TIMEOUT_S = 300.0


class DataParallelError(RuntimeError):
    """A rank failed, hung past the timeout, or wrote no result; the message names the rank and why."""


DataParallelError.__module__ = "pytest_npu_parity.distributed"  # printed as before the move


class NotEnoughDevicesError(RuntimeError):
    """Fewer devices of the target's type are visible than the ranks need (two ranks never share one)."""


NotEnoughDevicesError.__module__ = "pytest_npu_parity.distributed"  # printed as before the move


@dataclass
class DataParallelResult:
    """The outcome of :func:`data_parallel_step`.

    Attributes:
        world_size: number of ranks.
        backend: the ``torch.distributed`` backend used (``gloo``, ``hccl``, ``nccl``).
        devices: the device of every rank, e.g. ``("cpu", "cpu")`` or ``("npu:0", "npu:1")``.
        reference_device: where the single-process reference ran.
        actual: ``{"rank<r>.<leaf>": tensor}`` from the ranks (CPU tensors; a gradient that is None
            on a rank is None here).
        expected: the same keys from the reference.
        seconds: wall time of the launch (spawn, import, build, step, write), seconds.
        reference_seconds: wall time of the reference, seconds.
    """

    world_size: int
    backend: str
    devices: tuple[str, ...]
    reference_device: str
    actual: dict[str, torch.Tensor | None] = field(default_factory=dict)
    expected: dict[str, torch.Tensor | None] = field(default_factory=dict)
    seconds: float = 0.0
    reference_seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------

def shard_inputs(inputs: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s contiguous shard of a batch: rows ``[rank·B/W, (rank+1)·B/W)`` of every tensor.

    Args:
        inputs: keyword inputs of the model; every value a tensor whose dim 0 is the batch B.
        rank: 0 ≤ rank < world_size.
        world_size: number of ranks W ≥ 1; B must be a multiple of W (what a ``DistributedSampler``
            with ``drop_last`` gives every rank: equal shards).

    Returns:
        ``{name: tensor[B/W, ...]}`` (views of the inputs).

    Raises:
        TypeError: a value is not a tensor (name it; non-tensor arguments cannot be sharded).
        ValueError: bad rank/world size, tensors with different batch sizes, or B not divisible by W.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    if not inputs:
        raise ValueError("inputs is empty: give the model's keyword inputs (tensors with the batch in dim 0)")
    sizes = {}
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"input {name!r} is a {type(value).__name__}, not a tensor: only tensors with the "
                            "batch in dim 0 can be split across ranks")
        if value.dim() == 0:
            raise ValueError(f"input {name!r} is a 0-d tensor: it has no batch dimension to split")
        sizes[name] = int(value.shape[0])
    if len(set(sizes.values())) != 1:
        raise ValueError(f"inputs have different batch sizes (dim 0): {sizes}")
    batch = next(iter(sizes.values()))
    if batch % world_size:
        raise ValueError(f"batch size {batch} is not a multiple of world_size {world_size}: every rank needs an "
                         "equal shard (use a batch of a multiple of the world size)")
    per_rank = batch // world_size
    return {name: value[rank * per_rank:(rank + 1) * per_rank] for name, value in inputs.items()}


def rank_devices(target: torch.device | str, world_size: int, device_count: int | None = None) -> list[torch.device]:
    """The device of every rank for a data-parallel check on ``target``.

    CPU: every rank on ``cpu``. NPU/CUDA: rank ``r`` on index ``(target.index + r) mod device_count``
    (collective backends need one device per rank: HCCL and NCCL refuse two ranks on one device).

    Args:
        target: the device under test (``npu:3``, ``cuda``, ``cpu``…).
        world_size: number of ranks ≥ 1.
        device_count: visible devices of the target's type; None asks torch (``torch.npu`` /
            ``torch.cuda``). Ignored for the CPU.

    Raises:
        ValueError: world_size < 1, or a device type other than cpu/cuda/npu.
        NotEnoughDevicesError: fewer visible devices than ranks (the message gives both numbers and
            the environment variable that limits visibility).
    """
    target = torch.device(target)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if target.type == "cpu":
        return [torch.device("cpu")] * world_size
    if target.type not in ("npu", "cuda"):
        raise ValueError(f"no data-parallel launch known for device type {target.type!r} (use cpu, cuda or npu)")
    if device_count is None:
        module = getattr(torch, target.type, None)
        device_count = int(module.device_count()) if module is not None else 0
    if device_count < world_size:
        env = "ASCEND_RT_VISIBLE_DEVICES" if target.type == "npu" else "CUDA_VISIBLE_DEVICES"
        raise NotEnoughDevicesError(
            f"a {world_size}-rank data-parallel check needs {world_size} {target.type} devices, "
            f"{device_count} visible (check {env})")
    base = target.index or 0
    return [torch.device(target.type, (base + r) % device_count) for r in range(world_size)]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0, read it, close).

    Raises:
        OSError: no socket can be bound on ``host``.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------------------------------------
# One step (shared by the ranks and the reference)
# ---------------------------------------------------------------------------------------------

def _default_loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if loss is None:
        loss = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ValueError("data_parallel_step: the model output has no scalar loss; pass loss_fn=")
    return loss


def _default_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    from .training import default_optimizer

    return default_optimizer(params)


def _forward_backward(call: Callable[..., Any], module: torch.nn.Module, batch: dict[str, torch.Tensor],
                      device: torch.device, seed: int, recipe: str,
                      loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    """Forward under the recipe (autocast for bf16) and backward outside it, as ``ParityCase.train_step``."""
    module.train()
    batch = {k: v.to(device) for k, v in batch.items()}
    with same_randomness(seed):
        with RECIPES[recipe].context(device):
            output = call(**batch)
            loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
        loss.backward()
    return loss.detach()


def _trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def _clip_and_step(module: torch.nn.Module, optimizer_fn: Callable[[list], torch.optim.Optimizer],
                   max_grad_norm: float | None) -> dict[str, torch.Tensor]:
    """Global-norm clipping then one optimizer step; returns ``param.*`` and ``buffer.*`` leaves (CPU)."""
    params = _trainable(module)
    optimizer = optimizer_fn([p for _, p in params])
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for _, p in params], max_grad_norm)
    optimizer.step()
    out = {f"param.{n}": p.detach().cpu().clone() for n, p in params}
    out.update({f"buffer.{n}": b.detach().cpu().clone() for n, b in module.named_buffers()})
    return out


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {f"grad.{n}": (p.grad.detach().cpu().clone() if p.grad is not None else None)
            for n, p in _trainable(module)}


@contextlib.contextmanager
def _maybe(setup: Callable[[torch.device], ContextManager[Any]] | None, device: torch.device) -> Iterator[None]:
    if setup is None:
        yield
    else:
        with setup(device):
            yield


def reference_step(module: torch.nn.Module, inputs: dict[str, torch.Tensor], *, world_size: int,
                   device: torch.device | str = "cpu", seed: int = 0, recipe: str = "fp32",
                   max_grad_norm: float | None = 1.0,
                   optimizer_fn: Callable[[list], torch.optim.Optimizer] | None = None,
                   loss_fn: Callable[[Any], torch.Tensor] | None = None,
                   setup: Callable[[torch.device], ContextManager[Any]] | None = None
                   ) -> dict[str, torch.Tensor | None]:
    """The single-process, gradient-accumulation-equivalent reference of a ``world_size``-rank DDP step.

    For every rank ``r``: a deep copy of ``module`` on ``device`` runs shard ``r`` (:func:`shard_inputs`)
    under ``same_randomness(seed + r)`` and the recipe, and back-propagates its loss. The gradients of
    the copies are averaged (``Σ_r g_r / W`` in rank order; a gradient that is None on every copy stays
    None, one that is None on some copies counts as zero there, as DDP with
    ``find_unused_parameters=True`` does). Copy 0 takes the average, clips the global norm to
    ``max_grad_norm`` and takes one ``optimizer_fn`` step. See the module docstring for why this and
    not a full-batch step.

    Args:
        module: the model (not modified; float32 weights on any device).
        inputs: the full batch (tensors, batch in dim 0, B a multiple of ``world_size``).
        world_size: number of ranks W.
        device: where the reference runs.
        seed: base seed; rank ``r`` draws from ``seed + r``.
        recipe: ``fp32``, ``bf16`` or ``bf16-weights`` (forward under ``RECIPES[recipe].context``).
        max_grad_norm: clip value of ``torch.nn.utils.clip_grad_norm_``, or None for no clipping.
        optimizer_fn: ``(params) -> optimizer``; default ``runner.default_optimizer`` (AdamW as
            upstream Aurora trains).
        loss_fn: ``(output) -> scalar loss``; default ``output.loss`` or ``output[0]``.
        setup: ``(device) -> context manager`` entered around each forward/backward (a patch set).

    Returns:
        ``{"rank<r>.loss", "rank<r>.grad.<p>", "rank<r>.param.<p>", "rank<r>.buffer.<b>"}`` for every
        rank (the averaged gradients and the stepped parameters are the same for every rank; the loss and
        the buffers are those of the copy that ran rank ``r``'s shard). CPU tensors.

    Raises:
        ValueError / TypeError: as :func:`shard_inputs`; unknown recipe, or a loss-scaling one (``fp16``,
            :func:`loss_scaling_unsupported`); a loss that is not scalar.
    """
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    if RECIPES[recipe].loss_scaling:
        raise ValueError(loss_scaling_unsupported(recipe))
    device = torch.device(device)
    optimizer_fn = optimizer_fn or _default_optimizer
    copies, losses = [], []
    for rank in range(world_size):
        shard = shard_inputs(inputs, rank, world_size)
        model = copy.deepcopy(module).to(device)
        with _maybe(setup, device):
            losses.append(_forward_backward(model, model, shard, device, seed + rank, recipe, loss_fn))
        copies.append(model)
    first = copies[0]
    per_copy = [dict(_trainable(m)) for m in copies]
    for name, param in _trainable(first):
        grads = [params[name].grad for params in per_copy]
        if all(g is None for g in grads):
            param.grad = None
            continue
        total = None
        for g in grads:
            if g is None:
                continue
            part = g / world_size  # divide first, as DDP's reducer does (exact for W a power of two)
            total = part if total is None else total + part
        param.grad = total
    averaged = _grads(first)
    stepped = _clip_and_step(first, optimizer_fn, max_grad_norm)
    out: dict[str, torch.Tensor | None] = {}
    for rank, model in enumerate(copies):
        out[f"rank{rank}.loss"] = losses[rank].cpu()
        out.update({f"rank{rank}.{k}": v for k, v in averaged.items()})
        out.update({f"rank{rank}.{k}": v for k, v in stepped.items() if k.startswith("param.")})
        out.update({f"rank{rank}.buffer.{n}": b.detach().cpu().clone() for n, b in model.named_buffers()})
    return out


# ---------------------------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------------------------

def _scaled_allreduce_hook(state, bucket):  # no annotations: DDP checks them against real classes
    """DDP comm hook: scale this rank's gradient bucket by ``state`` (a float), then the default
    all-reduce (``default_hooks.allreduce_hook``: divide by the world size, sum over ranks)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if state != 1.0:
        bucket.buffer().mul_(state)
    return default_hooks.allreduce_hook(None, bucket)


def _bind(device: torch.device) -> None:
    """A rank's device set-up, before its process group and before ``model_fn`` imports aurora: on an
    NPU the guide's launcher steps (``npu.launch``: transfer_to_npu, compile mode,
    ``torch.npu.set_device``, seed §4.2, §7.3 ③), on CUDA ``torch.cuda.set_device``, on the CPU nothing."""
    if device.type == "cpu":
        return
    from .npu.launcher import bind_device, launch

    if device.type == "npu":
        launch(device)
    else:
        bind_device(device.index or 0, device_type=device.type)


def loss_scaling_unsupported(recipe: str) -> str:
    """The sentence for a loss-scaling recipe (``fp16``) given to :func:`data_parallel_step`."""
    return (f"the data-parallel step has no {recipe} recipe: it would need a GradScaler whose overflow "
            "check agrees across ranks, which it does not implement; run it under fp32 or bf16")


def join_group(rank: int, spec: dict[str, Any]) -> torch.device:
    """A spawned rank's start, as torchrun sets it up: ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
    ``WORLD_SIZE``/``LOCAL_RANK``, its intra-op threads, its device bound (``_bind``), the process group
    joined (``spec``'s backend and timeout); its device."""
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": spec["master_addr"], "MASTER_PORT": str(spec["master_port"]),
                       "RANK": str(rank), "WORLD_SIZE": str(spec["world_size"]), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["devices"][rank])
    _bind(device)
    dist.init_process_group(spec["backend"], rank=rank, world_size=spec["world_size"],
                            timeout=datetime.timedelta(seconds=spec["timeout_s"]))
    return device


def _rank_main(rank: int, spec: dict[str, Any]) -> None:
    """Entry point of rank ``rank`` (spawned): init the group, DDP, one step, write results, tear down."""
    from safetensors.torch import load_file, save_file

    workdir = Path(spec["workdir"])
    device = join_group(rank, spec)
    try:
        model = spec["model_fn"]()
        model = copy.deepcopy(model)  # a factory may hand out a cached object: never mutate it
        model.load_state_dict(load_file(str(workdir / "state.safetensors")), strict=True)
        model.to(device)
        shard = load_file(str(workdir / f"shard{rank}.safetensors"))
        with _maybe(spec["setup"], device):
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=None if device.type == "cpu" else [device.index or 0],
                find_unused_parameters=True)
            scales = spec["grad_scales"]
            if scales:
                ddp.register_comm_hook(float(scales.get(rank, 1.0)), _scaled_allreduce_hook)
            loss = _forward_backward(ddp, model, shard, device, spec["seed"] + rank, spec["recipe"],
                                     spec["loss_fn"])
        grads = _grads(model)
        stepped = _clip_and_step(model, spec["optimizer_fn"] or _default_optimizer, spec["max_grad_norm"])
        tensors = {"loss": loss.cpu()}
        tensors.update({k: v for k, v in grads.items() if v is not None})
        tensors.update(stepped)
        none_grads = [k for k, v in grads.items() if v is None]
        tmp = workdir / f"rank{rank}.partial"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"none": json.dumps(none_grads), "device": str(device)})
        os.replace(tmp, workdir / f"rank{rank}.safetensors")  # a complete file or none
    finally:
        destroy_process_groups()  # not dist.destroy_process_group(): on torch 2.5.1 it can deadlock (process_group)


def _save_state(module: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    # clone(): safetensors refuses tensors that share storage (tied weights)
    state = {k: v.detach().cpu().clone().contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(path))


def _launch(spec: dict[str, Any], timeout_s: float, main: Callable[[int, dict[str, Any]], None] | None = None) -> None:
    """Spawn ``spec["world_size"]`` ranks running ``main(rank, spec)`` (default ``_rank_main``) and wait
    for them, killing them after ``timeout_s``; ``DataParallelError`` on a failure."""
    import torch.multiprocessing as mp

    context = mp.start_processes(main or _rank_main, args=(spec,), nprocs=spec["world_size"], join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise DataParallelError(
                    f"data-parallel step: the {spec['world_size']} ranks did not finish within {timeout_s:.0f} s "
                    f"(backend {spec['backend']}, devices {spec['devices']}); they were killed")
    except mp.ProcessRaisedException as exc:
        raise DataParallelError(f"data-parallel step: rank {exc.error_index} failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise DataParallelError(f"data-parallel step: rank {exc.error_index} exited with code {exc.exit_code} "
                                f"({exc})") from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
        for process in context.processes:
            process.join(5)


def data_parallel_step(model_fn: Callable[[], torch.nn.Module], inputs: dict[str, torch.Tensor], *,
                       world_size: int = 2, device: torch.device | str = "cpu", seed: int = 0,
                       recipe: str = "fp32", max_grad_norm: float | None = 1.0,
                       optimizer_fn: Callable[[list], torch.optim.Optimizer] | None = None,
                       loss_fn: Callable[[Any], torch.Tensor] | None = None,
                       setup: Callable[[torch.device], ContextManager[Any]] | None = None,
                       grad_scales: dict[int, float] | None = None,
                       timeout_s: float = DEFAULT_TIMEOUT_S, device_count: int | None = None,
                       threads: int | None = None) -> DataParallelResult:
    """One DDP training step on ``world_size`` spawned ranks and its single-process reference.

    The parent calls ``model_fn()`` once and writes its state dict to a temporary directory; every rank
    calls ``model_fn()`` for the architecture and loads that state (so all ranks and the reference start
    from identical weights even if the factory is not deterministic). Rank ``r`` binds its device
    (:func:`rank_devices`; on an NPU after the guide's launcher steps, ``npu.launch``, before its
    ``model_fn`` imports aurora), joins a process group (``MASTER_ADDR=127.0.0.1``, a free port,
    ``npu.dist_backend_for(device)``), wraps the model in ``DistributedDataParallel``
    (``find_unused_parameters=True``: upstream Aurora leaves some trainable parameters unused), runs
    shard ``r`` under ``same_randomness(seed + r)`` and the recipe, lets DDP all-reduce the gradients,
    clips and steps, and writes its leaves. The reference is :func:`reference_step` on ``device``.

    Args:
        model_fn: importable callable (a module-level function or ``functools.partial`` of one: it is
            sent to the spawned ranks) returning the model on the CPU, float32.
        inputs: the full batch of keyword inputs (tensors, batch in dim 0, a multiple of world_size).
        world_size: number of ranks (≥ 1).
        device: the target; the ranks use :func:`rank_devices`, the reference runs on ``device``.
        seed, recipe, max_grad_norm, optimizer_fn, loss_fn, setup: as :func:`reference_step`
            (callables must be importable).
        grad_scales: ``{rank: factor}``: that rank multiplies its local gradient buckets by ``factor``
            before the all-reduce (a DDP comm hook). For proving that the check catches a rank whose
            gradient is wrong; None for a normal run (DDP's built-in all-reduce).
        timeout_s: the ranks are killed and ``DataParallelError`` raised after this many seconds; also
            the process group's collective timeout.
        device_count: visible devices of the target's type (None: ask torch).
        threads: intra-op threads per rank (None: the caller's thread count divided by world_size, ≥ 1).

    Returns:
        A :class:`DataParallelResult`; compare ``result.actual`` with ``result.expected``.

    Raises:
        DataParallelError: a rank raised, exited, hung past ``timeout_s`` or wrote no result.
        NotEnoughDevicesError: fewer devices than ranks.
        ValueError / TypeError: bad inputs, world size or recipe (an unknown one, or ``fp16``:
            :func:`loss_scaling_unsupported`), before anything is launched.
    """
    from .npu.launcher import dist_backend_for

    device = torch.device(device)
    devices, shards = _checked_shards(inputs, device, world_size, device_count, recipe, timeout_s)
    backend = dist_backend_for(device)
    module = model_fn()
    result = DataParallelResult(world_size, backend, tuple(str(d) for d in devices), str(device))
    rank_threads = threads or max(1, torch.get_num_threads() // world_size)
    with tempfile.TemporaryDirectory(prefix="npu-parity-ddp-") as tmp:
        workdir = Path(tmp)
        _write_inputs(workdir, module, shards)
        spec = {
            "workdir": str(workdir), "world_size": world_size, "backend": backend,
            "devices": [str(d) for d in devices], "master_addr": "127.0.0.1", "master_port": free_port(),
            "timeout_s": float(timeout_s), "model_fn": model_fn, "seed": int(seed), "recipe": recipe,
            "max_grad_norm": max_grad_norm, "optimizer_fn": optimizer_fn, "loss_fn": loss_fn, "setup": setup,
            "grad_scales": dict(grad_scales or {}),
            "threads": rank_threads,
        }
        start = time.perf_counter()
        _launch(spec, timeout_s)
        result.seconds = time.perf_counter() - start
        _read_ranks(workdir, world_size, result)
    start = time.perf_counter()
    # The reference runs with each rank's intra-op thread count: bf16 CPU kernels block their
    # reductions by thread count, which alone moved a few LayerNorm gradients by 1.5e-3 (measured).
    result.expected = _with_threads(rank_threads, functools.partial(
        reference_step, module, inputs, world_size=world_size, device=device, seed=seed, recipe=recipe,
        max_grad_norm=max_grad_norm, optimizer_fn=optimizer_fn, loss_fn=loss_fn, setup=setup))
    result.reference_seconds = time.perf_counter() - start
    return result


def _checked_shards(inputs: dict[str, torch.Tensor], device: torch.device, world_size: int,
                    device_count: int | None, recipe: str,
                    timeout_s: float) -> tuple[list[torch.device], list[dict[str, torch.Tensor]]]:
    """The ranks' devices and input shards of :func:`data_parallel_step`, after checking its arguments
    (before anything is built or launched).

    Raises:
        NotEnoughDevicesError, ValueError, TypeError: as :func:`data_parallel_step`.
    """
    devices = rank_devices(device, world_size, device_count)
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(RECIPES)}")
    if RECIPES[recipe].loss_scaling:
        raise ValueError(loss_scaling_unsupported(recipe))
    shards = [shard_inputs(inputs, rank, world_size) for rank in range(world_size)]  # validates first
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    return devices, shards


def _write_inputs(workdir: Path, module: torch.nn.Module, shards: list[dict[str, torch.Tensor]]) -> None:
    """The model's state (``state.safetensors``) and each rank's shard (``shard<r>.safetensors``) for the ranks."""
    from safetensors.torch import save_file

    _save_state(module, workdir / "state.safetensors")
    for rank, shard in enumerate(shards):
        save_file({k: v.detach().cpu().contiguous() for k, v in shard.items()},
                  str(workdir / f"shard{rank}.safetensors"))


def _read_ranks(workdir: Path, world_size: int, result: DataParallelResult) -> None:
    """Every rank's leaves (``rank<r>.safetensors``) into ``result.actual`` as ``rank<r>.<leaf>``; a
    gradient a rank had none for (its ``none`` metadata) is None.

    Raises:
        DataParallelError: a rank wrote no result.
    """
    from safetensors import safe_open

    for rank in range(world_size):
        path = workdir / f"rank{rank}.safetensors"
        if not path.is_file():
            raise DataParallelError(f"data-parallel step: rank {rank} exited without writing {path.name}")
        with safe_open(str(path), framework="pt") as handle:
            none = json.loads((handle.metadata() or {}).get("none", "[]"))
            leaves: dict[str, torch.Tensor | None] = {k: handle.get_tensor(k) for k in handle.keys()}
        leaves.update({k: None for k in none})
        result.actual.update({f"rank{rank}.{k}": v for k, v in sorted(leaves.items())})


def _with_threads(threads: int, run: Callable[[], Any]) -> Any:
    """``run()`` with torch's intra-op thread count set to ``threads``, restored afterwards."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run()
    finally:
        torch.set_num_threads(saved_threads)

"""A training trajectory in two (or more) processes: N DDP steps on spawned ranks against one process.

``data_parallel_trajectory`` is ``distributed.data_parallel_step`` run for ``loop.steps`` steps: the ranks
launch as torchrun would (``torch.multiprocessing`` spawn, ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE``, one process group on the device's backend: gloo on the CPU, hccl on NPUs), wrap the model in
``DistributedDataParallel``, and train on their shards of each batch with one AdamW (the loop's settings and
lr schedule), clipping after the all-reduce. The reference is the gradient-accumulation-equivalent single
process of ``distributed.reference_step``, step after step with one optimizer: for each rank a copy of the
current model (its weights, and rank 0's buffers, as DDP's default ``broadcast_buffers`` gives every rank at
each forward) runs that rank's shard, the gradients are averaged, rank 0's buffers are kept, then clipping
and the step. Rank ``r``'s draws at step ``k`` come from ``same_randomness(seed + r + k·W)`` on both sides.

The curves (``judge.trajectory``): ``loss`` (the mean of the ranks' losses per step), ``grad_norm`` (the
global norm before clipping, after the all-reduce: the same on every rank), ``lr``, and ``rank<r>.loss``.
"""
from __future__ import annotations

import copy
import functools
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

from .distributed import (DataParallelError, DataParallelResult, _forward_backward, _launch, _maybe, _save_state,
                          _scaled_allreduce_hook, _trainable, _with_threads, free_port, join_group, rank_devices,
                          shard_inputs)
from .process_group import destroy_process_groups
from .recipes import RECIPES
from .trajectory import TrajectoryLoop

#: Seconds the ranks may take in all (spawn, import, build, every step, write).
DEFAULT_TIMEOUT_S = 600.0


def _optimizer(loop: TrajectoryLoop, params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=loop.lr_at(0), betas=loop.adam_betas, eps=loop.adam_epsilon,
                             weight_decay=loop.weight_decay)


def _clip_and_step(loop: TrajectoryLoop, module: torch.nn.Module, opt: torch.optim.Optimizer,
                   step: int) -> torch.Tensor:
    """Clip (``loop.max_grad_norm``) and step at the loop's lr of ``step``; the norm before clipping."""
    params = [p for _, p in _trainable(module)]
    for group in opt.param_groups:
        group["lr"] = loop.lr_at(step)
    clip = loop.max_grad_norm if loop.max_grad_norm is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, clip).detach().float()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm


def reference_trajectory(module: torch.nn.Module, batches: list[dict[str, torch.Tensor]], loop: TrajectoryLoop, *,
                         world_size: int, device: torch.device | str = "cpu", seed: int = 0, recipe: str = "fp32",
                         setup: Callable[[torch.device], ContextManager[Any]] | None = None) -> dict[str, torch.Tensor]:
    """The single-process reference of ``data_parallel_trajectory`` (module docstring).

    Args:
        module: the model (not modified; float32 weights).
        batches: the training batches (cycled), each a dict of tensors with a batch dimension 0 that
            ``world_size`` divides.
        loop: steps, AdamW settings, lr schedule and clipping (``loss_fn`` and ``evaluate`` are not used:
            the loss is ``output.loss``).
        world_size, device, seed, recipe, setup: as ``distributed.reference_step``.

    Returns:
        ``loss``, ``grad_norm`` (float32 ``[steps]``), ``lr`` (float64 ``[steps]``) and ``rank<r>.loss``, on the CPU.
    """
    device = torch.device(device)
    master = copy.deepcopy(module).to(device).train()
    opt = _optimizer(loop, [p for _, p in _trainable(master)])
    losses = torch.zeros(loop.steps, world_size)
    norms = torch.zeros(loop.steps)
    for step in range(loop.steps):
        batch = batches[step % len(batches)]
        copies = []
        for rank in range(world_size):
            replica = copy.deepcopy(master)
            with _maybe(setup, device):
                losses[step, rank] = _forward_backward(replica, replica, shard_inputs(batch, rank, world_size),
                                                       device, seed + rank + step * world_size, recipe, None).float().cpu()
            copies.append(replica)
        per_copy = [dict(_trainable(m)) for m in copies]
        for name, param in _trainable(master):
            total = None
            for params in per_copy:
                g = params[name].grad
                if g is None:
                    continue
                part = g / world_size  # divide first, as DDP's reducer does
                total = part if total is None else total + part
            param.grad = total
        for name, buffer in master.named_buffers():  # rank 0's buffers (DDP broadcast_buffers)
            buffer.copy_(dict(copies[0].named_buffers())[name])
        norms[step] = _clip_and_step(loop, master, opt, step).cpu()
    out = {"loss": losses.double().mean(1).float(), "grad_norm": norms,
           "lr": torch.tensor([loop.lr_at(k) for k in range(loop.steps)], dtype=torch.float64)}
    out.update({f"rank{r}.loss": losses[:, r].clone() for r in range(world_size)})
    return out


def _rank_main(rank: int, spec: dict[str, Any]) -> None:
    """Entry point of rank ``rank`` (spawned): init the group, DDP, every step, write the curves, tear down."""
    from safetensors.torch import load_file, save_file

    workdir = Path(spec["workdir"])
    world_size, loop = spec["world_size"], spec["loop"]
    device = join_group(rank, spec)
    try:
        model = copy.deepcopy(spec["model_fn"]())  # a factory may hand out a cached object: never mutate it
        model.load_state_dict(load_file(str(workdir / "state.safetensors")), strict=True)
        model.to(device).train()
        shards = [load_file(str(workdir / f"batch{i}.rank{rank}.safetensors")) for i in range(spec["batches"])]
        opt = _optimizer(loop, [p for _, p in _trainable(model)])
        losses, norms = torch.zeros(loop.steps), torch.zeros(loop.steps)
        with _maybe(spec["setup"], device):
            ddp = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=None if device.type == "cpu" else [device.index or 0], find_unused_parameters=True)
            if spec["grad_scales"]:
                ddp.register_comm_hook(float(spec["grad_scales"].get(rank, 1.0)), _scaled_allreduce_hook)
            for step in range(loop.steps):
                losses[step] = _forward_backward(ddp, model, shards[step % len(shards)], device,
                                                 spec["seed"] + rank + step * world_size, spec["recipe"],
                                                 None).float().cpu()
                norms[step] = _clip_and_step(loop, model, opt, step).cpu()
        tmp = workdir / f"rank{rank}.partial"
        save_file({"loss": losses, "grad_norm": norms}, str(tmp), metadata={"device": str(device)})
        os.replace(tmp, workdir / f"rank{rank}.safetensors")  # a complete file or none
    finally:
        destroy_process_groups()


def data_parallel_trajectory(model_fn: Callable[[], torch.nn.Module], batches: list[dict[str, torch.Tensor]],
                             loop: TrajectoryLoop, *, world_size: int = 2, device: torch.device | str = "cpu",
                             seed: int = 0, recipe: str = "fp32",
                             setup: Callable[[torch.device], ContextManager[Any]] | None = None,
                             grad_scales: dict[int, float] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, device_count: int | None = None,
                             threads: int | None = None) -> DataParallelResult:
    """``loop.steps`` DDP training steps on ``world_size`` spawned ranks and their single-process reference.

    Args:
        model_fn: importable callable returning the model on the CPU, float32 (sent to the ranks).
        batches: the training batches (cycled): dicts of tensors, batch dimension 0 divisible by ``world_size``.
        loop: steps, AdamW settings, lr schedule and clipping (``runtime.trajectory.TrajectoryLoop``; the loss
            is ``output.loss``; ``evaluate`` is not run).
        world_size, device, seed, recipe, setup, grad_scales, device_count, threads: as
            ``distributed.data_parallel_step`` (``grad_scales``: a rank whose gradient buckets are scaled before
            every all-reduce, to prove the check catches it).
        timeout_s: the ranks are killed and ``DataParallelError`` raised after this many seconds in all.

    Returns:
        A ``distributed.DataParallelResult`` whose ``actual`` and ``expected`` hold the curves (module
        docstring): judge them with ``judge.trajectory.judge_trajectory`` (``ParityCase.compare_trajectory``).

    Raises:
        DataParallelError: a rank raised, exited, hung past ``timeout_s`` or wrote no result.
        NotEnoughDevicesError: fewer devices than ranks.
        ValueError: no batches, a batch ``world_size`` does not divide, an unknown or loss-scaling recipe.
    """
    from safetensors.torch import load_file, save_file

    from .distributed import loss_scaling_unsupported
    from .npu.launcher import dist_backend_for

    device = torch.device(device)
    devices = rank_devices(device, world_size, device_count)
    if recipe not in RECIPES or RECIPES[recipe].loss_scaling:
        raise ValueError(loss_scaling_unsupported(recipe) if recipe in RECIPES else f"unknown recipe {recipe!r}")
    if not batches:
        raise ValueError("data_parallel_trajectory: no batches")
    shards = [[shard_inputs(b, r, world_size) for r in range(world_size)] for b in batches]  # validates
    module = model_fn()
    result = DataParallelResult(world_size, dist_backend_for(device), tuple(str(d) for d in devices), str(device))
    rank_threads = threads or max(1, torch.get_num_threads() // world_size)
    with tempfile.TemporaryDirectory(prefix="npu-parity-ddp-trajectory-") as tmp:
        workdir = Path(tmp)
        _save_state(module, workdir / "state.safetensors")
        for i, per_rank in enumerate(shards):
            for r, shard in enumerate(per_rank):
                save_file({k: v.detach().cpu().contiguous() for k, v in shard.items()},
                          str(workdir / f"batch{i}.rank{r}.safetensors"))
        spec = {"workdir": str(workdir), "world_size": world_size, "backend": result.backend,
                "devices": [str(d) for d in devices], "master_addr": "127.0.0.1", "master_port": free_port(),
                "timeout_s": float(timeout_s), "model_fn": model_fn, "seed": int(seed), "recipe": recipe,
                "setup": setup, "threads": rank_threads, "loop": loop, "batches": len(batches),
                "grad_scales": dict(grad_scales or {})}
        start = time.perf_counter()
        _launch(spec, timeout_s, _rank_main)
        result.seconds = time.perf_counter() - start
        ranks = []
        for r in range(world_size):
            path = workdir / f"rank{r}.safetensors"
            if not path.is_file():
                raise DataParallelError(f"data-parallel trajectory: rank {r} exited without writing {path.name}")
            ranks.append(load_file(str(path)))
    result.actual = {"loss": torch.stack([c["loss"] for c in ranks], 1).double().mean(1).float(),
                     "grad_norm": ranks[0]["grad_norm"],
                     "lr": torch.tensor([loop.lr_at(k) for k in range(loop.steps)], dtype=torch.float64)}
    result.actual.update({f"rank{r}.loss": c["loss"] for r, c in enumerate(ranks)})
    start = time.perf_counter()
    # the reference runs with each rank's intra-op thread count (distributed.data_parallel_step: why)
    result.expected = _with_threads(rank_threads, functools.partial(
        reference_trajectory, module, batches, loop, world_size=world_size, device=device, seed=seed, recipe=recipe,
        setup=setup))
    result.reference_seconds = time.perf_counter() - start
    return result

"""Tearing down ``torch.distributed`` process groups without the gloo destructor deadlock of older torch.

torch 2.5.1 (the Ascend users' release) frees a ``ProcessGroupGloo`` from Python with the GIL held, and its
destructor joins the group's worker threads (``ProcessGroupGloo::~ProcessGroupGloo``; the blocking destructor
is pytorch issue #56297, the binding that releases the GIL first is pytorch PR #154976). A worker that has just
finished an asynchronous collective (``async_op=True``: DDP's bucketed all-reduce, DeepSpeed ZeRO's gathers)
drops the last reference to that work's tensors, and freeing a tensor that once had a Python object takes the
GIL (``c10::impl::PyObjectSlot::maybe_destroy_pyobj``). So ``dist.destroy_process_group()`` called while a
worker is still there waits for the worker, which waits for the GIL: the process hangs for good.

Measured here (2-core x86 CPU, gloo, world size 1): an ``all_gather(async_op=True)`` of 1 M floats whose
tensors and work handle are dropped, then ``destroy_process_group()``, hangs on every run on torch 2.5.1 and
returns in 11 ms on torch 2.14.1; a loop of DeepSpeed ZeRO-2 Trainer runs (``hf_trainer``) hung in run 48 on
2.5.1, with the main thread in ``~ProcessGroupGloo`` → ``std::thread::join`` and a gloo worker in
``~AsyncAllgatherWork`` → ``take_gil``.

:func:`destroy_process_groups` destroys the groups (unregistered: ``dist.is_initialized()`` is False after)
while this module keeps their objects referenced, so no destructor runs inside the call; they are freed by
the next call, when their workers have long been idle, or at interpreter exit.
"""
from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["destroy_process_groups"]

#: Groups destroyed by the last :func:`destroy_process_groups` call, kept referenced until the next one.
_retired: list[Any] = []

#: Seconds the call then sleeps (the GIL released) so that a worker waiting for the GIL finishes now rather
#: than during interpreter shutdown (a process may exit right after tearing down).
SETTLE_S = 0.01


def _live_groups() -> list[Any]:
    """Every registered process group (the default one included), or just the default group."""
    import torch.distributed as dist

    try:  # torch.distributed.distributed_c10d._world.pg_map: every group, 2.5.1 to 2.14.1
        groups = list(dist.distributed_c10d._world.pg_map)
    except AttributeError:  # a torch without the private registry: the default group at least
        groups = []
    world = dist.group.WORLD
    if world is not None and all(world is not g for g in groups):
        groups.append(world)
    return groups


def destroy_process_groups(destroy: Callable[[], Any] | None = None) -> None:
    """Destroy every process group of this process without running their destructors in the call.

    Args:
        destroy: what destroys them; default ``torch.distributed.destroy_process_group`` (every group).
            DeepSpeed runs pass ``deepspeed.comm.destroy_process_group``, which also drops DeepSpeed's cached
            groups (``deepspeed/comm/comm.py``).

    The groups destroyed by the previous call are freed first (their workers have been idle since), then the
    live ones are referenced here, ``destroy()`` is called, and the GIL is released for ``SETTLE_S`` seconds.
    Nothing happens when no group is initialized. Any exception of ``destroy()`` propagates.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    previous = list(_retired)
    _retired.clear()
    del previous  # idle groups of the previous call: their destructors join idle threads
    _retired.extend(_live_groups())
    (destroy or dist.destroy_process_group)()
    time.sleep(SETTLE_S)

"""Tearing down ``torch.distributed`` process groups without the gloo destructor deadlock of older torch.

torch 2.5.1 (the Ascend users' release) frees a ``ProcessGroupGloo`` from Python with the GIL held, and its
destructor joins the group's worker threads (``ProcessGroupGloo::~ProcessGroupGloo``; the blocking destructor
is pytorch issue #56297, the binding that releases the GIL first is pytorch PR #154976). A worker that has just
finished an asynchronous collective (``async_op=True``: DeepSpeed ZeRO's gathers, a user's own)
drops the last reference to that work's tensors, and freeing a tensor that once had a Python object takes the
GIL (``c10::impl::PyObjectSlot::maybe_destroy_pyobj``). So ``dist.destroy_process_group()`` called while a
worker is still there waits for the worker, which waits for the GIL: the process hangs for good. DDP's own
bucketed all-reduce did not trigger it here (DDP waits for it in ``backward`` and its buckets have no Python
object: three DDP steps, the model deleted, then a plain destroy: 0 hangs in 10 world-size-1 runs on 2.5.1).

Measured here (2-core x86 CPU, gloo, world size 1): an ``all_gather(async_op=True)`` of 1 k or 1 M floats whose
tensors and work handle are dropped, then ``destroy_process_group()``, hangs on every run on torch 2.5.1 (8 of 8)
and returns in 6 to 11 ms on torch 2.14.1; a loop of DeepSpeed ZeRO-2 Trainer runs (``hf_trainer``) hung in run
48 on 2.5.1, with the main thread in ``~ProcessGroupGloo`` → ``std::thread::join`` and a gloo worker in
``~AsyncAllgatherWork`` → ``take_gil``.

:func:`destroy_process_groups` destroys the groups (unregistered: ``dist.is_initialized()`` is False after)
while this module keeps their objects referenced, so no destructor runs inside the call; they are freed by
the next call (one with no group initialized included: the way to free them on purpose), or at interpreter
exit. What a kept group still holds until then: its store (rank 0's ``TCPStore`` server keeps listening on the
rendezvous port), its gloo threads and sockets (rank 0 of a 2-rank group: 4 threads, 14 descriptors; one group's
worth: they do not grow from call to call). A group initialized on the same port in the same process while the
old one is kept gets the kept server, keys of the old group included (a key set through the first group's
store is read through the second's, torch 2.5.1 and 2.14.1). With more than one rank that mostly fails: the
init ("Gloo connectFullMesh failed ... Connect timeout") or its first collective times out (2 ranks,
``env://``, four inits in a row: 5 of 6 runs failed on torch 2.5.1, 2 of 2 on 2.14.1; with this module's call
repeated between teardown and init 0 of 6, with a plain destroy 0 of 2). So call :func:`destroy_process_groups`
once more, with no group initialized, before re-initializing on the same port.

Not covered: a process that exits while a collective of its own is still running (``async_op=True`` never
waited on, then teardown and exit) can abort in interpreter finalization (SIGABRT, "terminate called without
an active exception": the worker asks for the GIL of a finalizing interpreter) with either teardown: 5 of 20
spawned 2-rank runs with this module, 3 of 20 with a plain destroy, 0 of 20 when the rank slept 1 s after.
Wait for such works (``work.wait()``) before tearing down.
"""
from __future__ import annotations

import time
from typing import Any, Callable

__all__ = ["destroy_process_groups"]

#: Groups destroyed by the last :func:`destroy_process_groups` call, kept referenced until the next one.
_retired: list[Any] = []

#: Seconds the call then sleeps (the GIL released) so that a worker already freeing a finished work's tensors
#: (waiting for the GIL) finishes now rather than during interpreter shutdown (a process may exit right after
#: tearing down). A collective still running is not waited for (module docstring).
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

    The groups destroyed by the previous call are freed first (their workers have been idle since; their
    stores stop listening), then the live ones are referenced here, ``destroy()`` is called, and the GIL is
    released for ``SETTLE_S`` seconds. When no group is initialized only the first step runs (``destroy`` is
    not called): call it so before re-initializing a group on the port of a kept one. Any exception of
    ``destroy()`` propagates.
    """
    import torch.distributed as dist

    _retired.clear()  # the previous call's groups, idle since: their destructors join idle threads
    if not (dist.is_available() and dist.is_initialized()):
        return
    _retired.extend(_live_groups())
    (destroy or dist.destroy_process_group)()
    time.sleep(SETTLE_S)

"""A run leaves the module it ran as it found it: its buffers and its random generators.

A forward in eval mode may still change state of its own: a call counter or a cache kept in a
buffer (``self.calls += 1``, ``self.cache.copy_(x)``), or a ``torch.Generator`` kept as an
attribute and drawn from (``torch.randn(..., generator=self.gen)``). Where the sides run the same
module object (a CPU reference and a CPU target, or one cached device copy for every target run),
each run would then start from the state the run before it left: the target sees the reference's
counter, or draws the numbers after the reference's, and fails although it computes the same thing;
and the user's module is changed by the check.

``kept_state(module)`` restores, when the block ends (also on error), every buffer of ``module`` and
its submodules to the value it had on entry (a buffer changed in place is copied back; a buffer
replaced by another tensor is put back) and every ``torch.Generator`` held as a submodule attribute
to its state on entry. A module with a submodule in training mode is left alone: the session runs
such a module on a fresh copy each time (``side.fresh_copy``), so no run sees another's state.

Cost: one walk of the module tree and a copy of each buffer per run (Aurora, 893 submodules and
89 buffers of 68 KB together: about 1.5 ms on a 2-core CPU). Parameters are not copied: a forward
does not change them (a training step runs on its own copy, ``side.trainable_copy``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def kept_state(module: torch.nn.Module | None) -> Iterator[None]:
    """Inside the block, ``module`` may change its buffers and draw from its generators; on exit
    both are as they were on entry (see the module docstring). ``None`` or a module with any
    submodule in training mode: nothing is done.

    Raises:
        Nothing of its own; an error of the block propagates after the state is restored.
    """
    if module is None:
        yield
        return
    buffers: list[tuple[torch.nn.Module, str, torch.Tensor, int, torch.Tensor]] = []
    generators: list[tuple[torch.Generator, torch.Tensor]] = []
    for sub in module.modules():
        if sub.training:
            yield
            return
        for name, tensor in sub._buffers.items():
            # an inference tensor has no version counter, and outside inference mode (a run is under
            # no_grad) nothing can change it in place
            if tensor is not None and not tensor.is_inference():
                buffers.append((sub, name, tensor, tensor._version, tensor.detach().clone()))
        for value in sub.__dict__.values():
            if type(value) is torch.Generator:
                generators.append((value, value.get_state()))
    try:
        yield
    finally:
        with torch.no_grad():
            for sub, name, tensor, version, value in buffers:
                if tensor._version != version:
                    if tensor.shape == value.shape:
                        tensor.copy_(value)
                    else:  # resized in place
                        tensor.set_(value)
                if sub._buffers.get(name) is not tensor:
                    sub._buffers[name] = tensor
        for generator, state in generators:
            generator.set_state(state)

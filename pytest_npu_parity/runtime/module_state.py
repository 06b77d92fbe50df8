"""A run leaves the module it ran as it found it: its buffers, attributes and random generators.

A forward in eval mode may still change state of its own: a call counter or a cache kept in a
buffer (``self.calls += 1``, ``self.cache.copy_(x)``, a ``None`` buffer filled on first use), a plain
attribute (``self.n += 1``, ``self.table = ...``), or a ``torch.Generator`` kept as an attribute and
drawn from (``torch.randn(..., generator=self.gen)``). Where the sides run the same module object (a
CPU reference and a CPU target, or one cached device copy for every target run), each run would
then start from the state the run before it left: the target sees the reference's counter, reuses
the cache the reference filled (a fault in the target's fill passes), or draws the numbers after
the reference's; and the user's module is changed by the check.

``kept_state(*modules)`` puts back, when the block ends (also on error), for each module and each of
its submodules (each once, also when the modules share submodules or tensors):

* every buffer: its registered tensor (a buffer replaced, set to ``None``, deleted, or registered
  during the run is undone) and its values (a tensor changed in place, also through ``.data``,
  which no version counter sees, gets the values of a copy taken on entry, copied into it: the same
  tensor object, so a buffer shared by two modules stays shared and views of it stay views);
* every instance attribute (``__dict__``): one added during the run is removed, one rebound gets its
  old value back, a tensor attribute changed in place gets its old values back (as a buffer);
* every ``torch.Generator`` attribute: its state.

The run's output may be one of those tensors (``self.total.add_(x); return self.total``): the
caller takes the output's leaves before the block ends and passes each through
``KeptState.detach_output``, which copies a leaf that shares memory with a tensor about to be put
back, so the output keeps what the run computed. Modules in training mode are put back too (the
session runs a module it is given in training mode on a fresh copy each time, ``side.fresh_copy``,
but not one a function closes over).

``state_owners(fn)`` finds the modules of a call: the module, a bound method's module, the modules a
``functools.partial`` binds and those in a function's closure cells and default arguments.

Not covered: containers and numpy arrays changed in place (a list appended to), generators or tensors
inside containers or on other objects, module-level globals (a lambda that reads a global model),
hooks registered during the run, a buffer made under ``torch.inference_mode`` and changed inside an
inference-mode forward (it has no version counter and cannot be copied back outside inference mode),
parameters (a forward does not change them; a training step runs on its own copy,
``side.trainable_copy``).

Cost: one walk of the module tree, a shallow copy of each submodule's attribute and buffer dicts and
a copy of each buffer per run, and a comparison of each buffer with its copy at the end (Aurora, 893
submodules, 89 buffers of 68 KB: about 3 ms for the whole model; 121 runs in the main job took 0.1 s
in all). A module with large buffers pays a copy of them per run (host memory for host tensors,
device memory for device ones) and a comparison.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import operator
import types
from collections import OrderedDict
from typing import Any, Iterator

import torch


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values (NaN equal to NaN in the same place), shapes and dtypes."""
    if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
        return False
    if a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(torch.eq(a, b).logical_or_(a.isnan() & b.isnan()).all())
    return False


def _walk(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules, each once (what ``module.modules()`` yields, without building
    the dotted names: a third of its time on Aurora's 893 submodules)."""
    found, seen, i = [module], {id(module)}, 0
    while i < len(found):
        for child in found[i]._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                found.append(child)
        i += 1
    return found


#: Attribute value types that are no tensor and no generator (a module's hook and parameter dicts
#: among them): skipped without an ``isinstance`` test (``torch.Generator``'s takes a Python-level
#: ``__instancecheck__``: a third of a millisecond per thousand values).
_PLAIN = frozenset({bool, int, float, complex, str, bytes, type(None), dict, OrderedDict, set, frozenset, tuple, list})


def _values(dicts: list[dict[str, Any]]) -> list[Any]:
    return list(itertools.chain.from_iterable(map(dict.values, dicts)))


def _keys(dicts: list[dict[str, Any]]) -> list[str]:
    return list(itertools.chain.from_iterable(dicts))


def _unchanged(dicts: list[dict[str, Any]], keys: list[str], values: list[Any]) -> bool:
    """Whether ``dicts`` hold the same keys, in order, bound to the very objects ``values`` (identity)."""
    now = _values(dicts)
    return len(now) == len(values) and all(map(operator.is_, now, values)) and _keys(dicts) == keys


class KeptState:
    """What ``kept_state`` saved of some modules on entry, and puts back on exit."""

    def __init__(self, modules: tuple[torch.nn.Module | None, ...]) -> None:
        subs: list[torch.nn.Module] = []
        seen: set[int] = set()
        for module in modules:
            if module is not None:
                for sub in _walk(module):
                    if id(sub) not in seen:
                        seen.add(id(sub))
                        subs.append(sub)
        self._subs = subs
        self._dicts = [sub.__dict__ for sub in subs]
        self._buffer_dicts = [sub._buffers for sub in subs]
        # on entry: shallow copies, and their keys and values in one flat list each (identity checks)
        self._attributes = [d.copy() for d in self._dicts]
        self._buffers = [d.copy() for d in self._buffer_dicts]
        self._keys, self._values = _keys(self._attributes), _values(self._attributes)
        self._buffer_keys, self._buffer_values = _keys(self._buffers), _values(self._buffers)
        self._tensors: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id -> (tensor, version, copy)
        self._generators: list[tuple[torch.Generator, torch.Tensor]] = []
        self._changed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        for value in self._buffer_values:
            if value is not None:
                self._save(value)
        for value in self._values:
            kind = type(value)
            if kind in _PLAIN:
                continue
            if kind is torch.Generator:
                self._generators.append((value, value.get_state()))
            elif isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                self._save(value)

    def _save(self, tensor: torch.Tensor) -> None:
        # An inference tensor has no version counter and cannot be changed outside inference mode; a
        # meta tensor or a lazy module's uninitialized buffer has no values.
        if (id(tensor) in self._tensors or tensor.is_inference() or tensor.device.type == "meta"
                or isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin)):
            return
        self._tensors[id(tensor)] = (tensor, tensor._version, tensor.detach().clone())

    def changed(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(tensor, its values on entry)`` of the saved tensors the run changed in place (found once:
        by version counter, and by value for a change through ``.data``)."""
        if self._changed is None:
            self._changed = [(tensor, copy) for tensor, version, copy in self._tensors.values()
                             if tensor._version != version or not _equal(tensor.detach(), copy)]
        return self._changed

    def detach_output(self, leaf: torch.Tensor) -> torch.Tensor:
        """``leaf`` (an output leaf taken inside the block), copied when it shares memory with a tensor
        the run changed, which ``restore`` is about to put back."""
        if leaf.layout != torch.strided or not self._tensors or not self.changed():
            return leaf
        storage = leaf.untyped_storage().data_ptr()
        for tensor, _ in self.changed():
            if tensor.layout == torch.strided and tensor.untyped_storage().data_ptr() == storage:
                return leaf.clone()
        return leaf

    def restore(self) -> None:
        """Put back what was saved (see the module docstring)."""
        with torch.no_grad():
            for tensor, copy in self.changed():
                if tensor.shape == copy.shape and tensor.dtype == copy.dtype and tensor.layout == copy.layout:
                    tensor.copy_(copy)
                else:  # resized in place, or its .data rebound
                    tensor.data = copy
        if not _unchanged(self._buffer_dicts, self._buffer_keys, self._buffer_values):
            for current, saved in zip(self._buffer_dicts, self._buffers):
                if current.keys() != saved.keys() or any(current[k] is not v for k, v in saved.items()):
                    current.clear()
                    current.update(saved)
        if not _unchanged(self._dicts, self._keys, self._values):
            for state, saved in zip(self._dicts, self._attributes):
                if state.keys() != saved.keys() or any(state[k] is not v for k, v in saved.items()):
                    for key in [k for k in state if k not in saved]:
                        del state[key]
                    state.update(saved)
        for generator, state in self._generators:
            generator.set_state(state)


def state_owners(fn: Any) -> list[torch.nn.Module]:
    """The modules whose state a call of ``fn`` may change: ``fn`` itself (a module), the module of a
    bound method, the modules a ``functools.partial`` binds (and its function's), and the modules in a
    function's closure cells and default arguments (``lambda x: model(x)``), one level deep."""
    found: list[torch.nn.Module] = []

    def add(value: Any) -> None:
        owner = value if isinstance(value, torch.nn.Module) else (
            value.__self__ if inspect.ismethod(value) and isinstance(value.__self__, torch.nn.Module) else None)
        if owner is not None and all(owner is not f for f in found):
            found.append(owner)

    add(fn)
    if isinstance(fn, functools.partial):
        for value in (fn.func, *fn.args, *fn.keywords.values()):
            add(value)
        fn = fn.func
    if isinstance(fn, types.FunctionType):
        for cell in fn.__closure__ or ():
            try:
                add(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        for value in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
            add(value)
    return found


@contextlib.contextmanager
def kept_state(*modules: torch.nn.Module | None) -> Iterator[KeptState]:
    """Inside the block, ``modules`` may change their buffers, attributes and generators; on exit they
    are as they were on entry (see the module docstring). Yields the ``KeptState``: pass each output
    leaf taken inside the block through its ``detach_output``. ``None`` entries are skipped.

    Raises:
        Nothing of its own; an error of the block propagates after the state is put back.
    """
    kept = KeptState(modules)
    try:
        yield kept
    finally:
        kept.restore()

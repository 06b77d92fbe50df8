"""A run leaves the module it ran as it found it: its buffers, attributes and random generators.

A forward in eval mode may still change state of its own: a call counter or a cache kept in a
buffer (``self.calls += 1``, ``self.cache.copy_(x)``, a ``None`` buffer filled on first use), a plain
attribute (``self.n += 1``, ``self.table = ...``), or a ``torch.Generator`` kept as an attribute and
drawn from (``torch.randn(..., generator=self.gen)``). Where the sides run the same module object (a
CPU reference and a CPU target, or one cached device copy for every target run), each run would
then start from the state the run before it left: the target sees the reference's counter, reuses
the cache the reference filled (a fault in the target's fill passes), or draws the numbers after
the reference's; and the user's module is changed by the check.

``kept_state(module)`` puts back, when the block ends (also on error), for ``module`` and each of
its submodules:

* every buffer: its registered tensor (a buffer replaced, set to ``None``, deleted, or registered
  during the run is undone); a buffer whose values the run changed in place (also through ``.data``,
  which no version counter sees) is replaced by the copy of its values taken on entry, in every slot
  that held it — the changed tensor itself is left to the run's output, which may be that very
  buffer (``return self.total`` after ``self.total.add_(x)``) and must keep what the run computed;
* every instance attribute (``__dict__``): one added during the run is removed, one rebound gets its
  old value back, a tensor attribute changed in place is replaced like a buffer;
* every ``torch.Generator`` attribute: its state.

So after a run that changed a buffer, the module holds a new tensor object with the old values. A
module with a submodule in training mode is left alone: the session runs such a module on a fresh
copy each time (``side.fresh_copy``).

Not covered: containers changed in place (a list attribute appended to), generators or tensors
inside containers or on other objects, module-level globals, a buffer made under
``torch.inference_mode`` and changed inside an inference-mode forward (it has no version counter and
cannot be copied back outside inference mode), parameters (a forward does not change them; a
training step runs on its own copy, ``side.trainable_copy``).

Cost: one walk of the module tree, a shallow copy of each submodule's attribute dict and a copy of
each buffer per run, and a comparison of each buffer with its copy at the end (Aurora, 893
submodules, 89 buffers of 68 KB: 121 runs in the main job took 0.05 s in all). A module with large
buffers pays a copy of them per run (host memory for host tensors, device memory for device ones).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
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


def _same(current: dict[str, Any], saved: dict[str, Any]) -> bool:
    """Whether a submodule's ``__dict__`` or ``_buffers`` (``current``) still holds what ``saved``, its
    shallow copy, holds. CPython's dict comparison takes identical values as equal without calling
    their ``__eq__``, so this is one C-level pass when nothing was rebound; a rebound value is compared
    with ``==`` (an equal number counts as unchanged), and one whose ``==`` is not a plain bool (a
    tensor of several elements) counts as changed."""
    try:
        return bool(current == saved)
    except Exception:  # noqa: BLE001 - e.g. "Boolean value of Tensor with more than one value is ambiguous"
        return False


#: Per root module: its submodules' attribute dicts (shallow copies, ``_walk`` order) when last
#: scanned, and where the tensors (not parameters) and generators among them are. A model whose
#: attributes are the same objects is not scanned again (the scan is most of ``kept_state``'s cost on
#: a model of many submodules).
_SCANS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[list[dict[str, Any]], list[tuple[int, str]]]]" = \
    weakref.WeakKeyDictionary()


def _stateful(module: torch.nn.Module, attributes: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """``(submodule index, key)`` of the attributes (``attributes[i]``: a copy of submodule i's
    ``__dict__``) that hold a tensor that is not a parameter, or a ``torch.Generator``."""
    scanned = _SCANS.get(module)
    if scanned is not None and len(scanned[0]) == len(attributes) and all(map(_same, attributes, scanned[0])):
        return scanned[1]
    found = [(i, key) for i, state in enumerate(attributes) for key, value in state.items()
             if (isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter))
             or type(value) is torch.Generator]
    _SCANS[module] = (attributes, found)
    return found


class KeptState:
    """What ``kept_state`` saved of a module on entry, and puts back on exit."""

    def __init__(self, module: torch.nn.Module | None) -> None:
        self._subs: list[torch.nn.Module] = []
        self._attributes: list[dict[str, Any]] = []  # each submodule's __dict__ on entry (shallow copies)
        self._buffers: list[dict[str, Any]] = []  # and its _buffers
        self._tensors: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id -> (tensor, version, copy)
        self._generators: list[tuple[torch.Generator, torch.Tensor]] = []
        if module is None:
            return
        subs = _walk(module)
        if any(sub.training for sub in subs):
            return
        self._subs = subs
        self._attributes = [sub.__dict__.copy() for sub in subs]
        self._buffers = [sub._buffers.copy() for sub in subs]
        for buffers in self._buffers:
            for value in buffers.values():
                if value is not None:
                    self._save(value)
        for i, key in _stateful(module, self._attributes):
            value = self._attributes[i][key]
            if type(value) is torch.Generator:
                self._generators.append((value, value.get_state()))
            else:
                self._save(value)

    def _save(self, tensor: torch.Tensor) -> None:
        # An inference tensor has no version counter and cannot be changed outside inference mode; a
        # meta tensor or a lazy module's uninitialized buffer has no values.
        if (id(tensor) in self._tensors or tensor.is_inference() or tensor.device.type == "meta"
                or isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin)):
            return
        self._tensors[id(tensor)] = (tensor, tensor._version, tensor.detach().clone())

    def restore(self) -> None:
        """Put back what was saved (see the module docstring)."""
        changed = {ident: copy for ident, (tensor, version, copy) in self._tensors.items()
                   if tensor._version != version or not _equal(tensor.detach(), copy)}
        for sub, attributes, buffers in zip(self._subs, self._attributes, self._buffers):
            if changed:  # the copies take the changed tensors' places
                for saved in (buffers, attributes):
                    for key, value in saved.items():
                        if id(value) in changed:
                            saved[key] = changed[id(value)]
            current = sub._buffers
            if (current or buffers) and (changed or not _same(current, buffers)):
                current.clear()
                current.update(buffers)
            state = sub.__dict__
            if changed or not _same(state, attributes):
                for key in [k for k in state if k not in attributes]:
                    del state[key]
                state.update(attributes)
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
def kept_state(*modules: torch.nn.Module | None) -> Iterator[None]:
    """Inside the block, ``modules`` may change their buffers, attributes and generators; on exit they
    are as they were on entry (see the module docstring). ``None``, or a module with any submodule
    in training mode: nothing is saved or put back for it.

    Raises:
        Nothing of its own; an error of the block propagates after the state is put back.
    """
    kept = [KeptState(module) for module in modules]
    try:
        yield
    finally:
        for state in kept:
            state.restore()

"""Recording one pass and running one side: the call recorder (``_Recorder``), a side's runs
(``_Side``), snapshots and the leaves of an output.

Part of ``pytest_npu_parity.diagnose.localize`` (the package docstring describes the descent).
"""
from __future__ import annotations

import contextlib
import copy
import math
import random
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from ...judge.allclose import CompareResult, LeafResult
from ...leaves import cache_fields
from ...runtime.rng import same_randomness
from ...runtime.side import _move, copy_state, is_state

#: Levels of calls one pass records below its scope (children, grandchildren): the next level of
#: the descent comes from the same pass, without running the culprit again.
RECORD_DEPTH = 2


@dataclass
class _Call:
    """One submodule call recorded on one side (inputs and outputs as CPU copies)."""

    name: str
    index: int
    module_type: str
    inputs: tuple[tuple, dict] | None = None
    rng: tuple | None = None
    state: tuple | None = None
    output: dict[str, torch.Tensor] | None = None
    parent: tuple[str, int] | None = None
    rec_depth: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.index


@dataclass
class _View:
    """The recorded calls of one pass made directly inside one call (``_Recorder.view``)."""

    calls: list[_Call]
    counts: Counter


class _State:
    """A stateful argument of a recorded call as it was when the call began (``_snapshot``).

    ``copy`` is a copy of the object (``runtime.side.copy_state``) whose tensors are detached CPU
    copies and whose device attributes say ``cpu``; it is never run: each re-run gets its own
    ``fresh`` copy, so a re-run that adds to a cache changes neither the snapshot nor the next re-run.
    """

    __slots__ = ("copy",)

    def __init__(self, copy_: Any):
        self.copy = copy_

    def fresh(self, device: torch.device) -> Any:
        """A new copy of the snapshot with its tensors (and device attributes) on ``device``."""
        return copy_state(self.copy, lambda t: t.to(device, copy=True), device)


def _detached_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _rebuild(obj: Mapping, items: dict) -> Any:
    """``items`` as a mapping of ``obj``'s type where it can be built from a dict (a Hugging Face
    ``ModelOutput`` such as T5's ``encoder_outputs``, read by index as ``encoder_outputs[0]``), else
    the dict itself."""
    if type(obj) is dict:
        return items
    try:
        return type(obj)(items)
    except Exception:  # noqa: BLE001 - a mapping type without a dict constructor (defaultdict): a plain dict
        return items


def _snapshot(obj: Any, tensor: Any = _detached_cpu) -> Any:
    """What a recorded call is re-run on later: the inputs as they were when it began.

    Tensors become ``tensor(t)`` (detached CPU copies); tuples, lists and mappings are walked (a
    mapping keeps its type, ``_rebuild``); a stateful object (``runtime.side.is_state``: a Hugging
    Face ``Cache``, any other object with attributes) becomes a ``_State`` holding a copy of it as it
    is now, since the call and the rest of the run change it (a decoder layer adds its keys to the
    cache it is given). An object that cannot be copied is kept as it is (a re-run then sees its
    state at that time). Other objects (numbers, strings, modules, functions) are kept as they are.
    """
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, tuple):
        return tuple(_snapshot(v, tensor) for v in obj)
    if isinstance(obj, list):
        return [_snapshot(v, tensor) for v in obj]
    if isinstance(obj, Mapping):
        return _rebuild(obj, {k: _snapshot(v, tensor) for k, v in obj.items()})
    if is_state(obj):
        try:
            return _State(copy_state(obj, tensor, torch.device("cpu")))
        except Exception:  # noqa: BLE001 - cannot be copied (a lock, an open file): the live object
            return obj
    return obj


def _cpu_copy(obj: Any) -> Any:
    """Detached CPU copies of the tensors in a nested structure, stateful objects as snapshots (``_snapshot``)."""
    return _snapshot(obj)


def _to_device(obj: Any, device: torch.device) -> Any:
    """A recorded structure (``_snapshot``) ready to run on ``device``: tensors moved, each
    ``_State`` a fresh copy of its snapshot, mappings of their own type."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)  # a call that changes its input in place leaves the recording as it was
    if isinstance(obj, _State):
        return obj.fresh(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, Mapping):
        return _rebuild(obj, {k: _to_device(v, device) for k, v in obj.items()})
    return obj


def comparable(t: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """A detached CPU strided copy of ``t`` to compare, and what was done to get it.

    A nested tensor (PyTorch's transformer fast path turns a padded batch with a
    ``src_key_padding_mask`` into one between ``nn.TransformerEncoder``'s layers; it has no
    ``shape``) becomes ``torch.nested.to_padded_tensor(t, 0.0)``: both sides pad the same
    sequence lengths with zeros, so the padding compares equal and the real elements are compared.
    A sparse or other non-strided tensor becomes ``to_dense()``.

    Returns:
        ``(tensor, None)`` for a plain tensor; ``(tensor, "padded")`` / ``(tensor, "dense")`` after
        a conversion; ``(None, reason)`` when it cannot be made comparable (the leaf is skipped).
    """
    t = t.detach()
    try:
        if getattr(t, "is_nested", False):
            return torch.nested.to_padded_tensor(t, 0.0).to("cpu", copy=True), "padded"
        if t.layout != torch.strided:
            return t.to_dense().to("cpu", copy=True), "dense"
        return t.to("cpu", copy=True), None
    except Exception as exc:  # noqa: BLE001 - an exotic tensor must not stop the localization
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")


def output_leaves(output: Any, prefix: str = "", notes: dict[str, set[str]] | None = None,
                  where: str = "") -> dict[str, torch.Tensor]:
    """``{path: detached CPU copy}`` of every tensor in a module's output.

    Tuples, lists and mappings (also Hugging Face ``ModelOutput``) are walked (``[i]`` and ``.key``
    paths, as ``compare.flatten`` names them), a Hugging Face key/value cache as its
    ``compare.cache_fields`` (``past_key_values.layers[0].keys``); anything else (None, numbers,
    strings) is skipped.
    Nested and sparse tensors are converted by ``comparable`` (padded with zeros, densified); a
    tensor that cannot be converted is left out. With ``notes``, ``where`` (the module path) is
    added to ``notes["padded"]``/``notes["dense"]`` for a conversion and to
    ``notes["skipped: <reason>"]`` for a leaf left out.
    """
    leaves: dict[str, torch.Tensor] = {}
    if isinstance(output, torch.Tensor):
        tensor, how = comparable(output)
        if how is not None and notes is not None:
            notes.setdefault(how if tensor is not None else f"skipped: {how}", set()).add(where or "<output>")
        if tensor is not None:
            leaves[prefix] = tensor
    elif isinstance(output, (tuple, list)):
        for i, value in enumerate(output):
            leaves.update(output_leaves(value, f"{prefix}[{i}]", notes, where))
    elif isinstance(output, Mapping):
        for key, value in output.items():
            leaves.update(output_leaves(value, f"{prefix}.{key}" if prefix else str(key), notes, where))
    else:
        try:
            fields = cache_fields(output)  # a key/value cache: its layers' keys and values
        except TypeError:  # a cache of an unknown layout: not compared
            fields = None
        if fields is not None:
            leaves.update(output_leaves(fields, prefix, notes, where))
    return leaves


def _rng_state() -> tuple:
    """The shared random stream's state inside ``rng.same_randomness`` (its CPU generator, found as
    the owner of the installed ``torch.rand``), plus Python's, NumPy's and torch's global states."""
    generator = getattr(getattr(torch.rand, "__self__", None), "gen", None)
    return (generator.get_state() if isinstance(generator, torch.Generator) else None,
            random.getstate(), np.random.get_state(), torch.random.get_rng_state())


def _set_rng_state(state: tuple) -> None:
    shared, py_state, np_state, torch_state = state
    generator = getattr(getattr(torch.rand, "__self__", None), "gen", None)
    if shared is not None and isinstance(generator, torch.Generator):
        generator.set_state(shared)
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.random.set_rng_state(torch_state)


def _mode_state(device_type: str) -> tuple[bool, bool, torch.dtype]:
    """(grad enabled, autocast enabled on ``device_type``, its autocast dtype) right now (the
    device-type forms of these autocast queries exist since torch 2.4)."""
    return (torch.is_grad_enabled(), torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))


class _Recorder:
    """Forward hooks on every submodule of ``root`` for one pass; records the calls made inside
    ``scope`` (a call key ``(name, k)``, or None: calls made outside any hooked module) down to
    ``depth`` levels (1: directly inside it), in completion order."""

    def __init__(self, root: torch.nn.Module, scope: tuple[str, int] | None, device_type: str,
                 depth: int = RECORD_DEPTH, notes: dict[str, set[str]] | None = None):
        self.notes: dict[str, set[str]] = notes if notes is not None else {}  # see output_leaves
        self.names: dict[torch.nn.Module, str] = {}
        for name, module in root.named_modules():
            self.names.setdefault(module, name)
        self.scope = scope
        self.depth = depth
        self.device_type = device_type
        self.stack: list[tuple[_Call, int]] = []
        self.counts: Counter = Counter()
        self.calls: list[_Call] = []
        self.last_done: dict[str, int] = {}
        self.done = 0
        self._handles: list[Any] = []
        self._copied: dict[int, tuple[Any, int, Any]] = {}  # id -> (tensor weakref, version, copy weakref)

    def __enter__(self) -> "_Recorder":
        for module in self.names:
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        name = self.names[module]
        call = _Call(name, self.counts[name], type(module).__name__)
        self.counts[name] += 1
        parent, parent_depth = (self.stack[-1][0].key, self.stack[-1][1]) if self.stack else (None, 0)
        depth = 1 if parent == self.scope else parent_depth + 1 if 0 < parent_depth < self.depth else 0
        if depth:
            call.inputs = _snapshot((args, kwargs), self._cpu)
            call.rng = _rng_state()
            call.state = _mode_state(self.device_type)
            call.parent, call.rec_depth = parent, depth
        self.stack.append((call, depth))

    def _cpu(self, t: torch.Tensor) -> torch.Tensor:
        """A detached CPU copy of input tensor ``t``, shared with the earlier recorded calls of this
        pass that were given the same tensor unchanged (same object, same version counter): the
        snapshots of a cache taken at each decoder layer share the copies of the layers already
        filled, so recording N layers holds the cache about once, not N/2 times. Recorded tensors
        are never changed (``_to_device`` copies them for a re-run)."""
        try:
            version = t._version
            ref = weakref.ref(t)
        except (RuntimeError, TypeError):  # an inference tensor has no version counter
            return _detached_cpu(t)
        hit = self._copied.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == version:
            copied = hit[2]()
            if copied is not None:
                return copied
        copied = _detached_cpu(t)
        self._copied[id(t)] = (ref, version, weakref.ref(copied))
        return copied

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call, depth = self.stack.pop()
        self.done += 1
        self.last_done[call.name] = self.done
        if depth:
            call.output = output_leaves(output, notes=self.notes, where=call.name)
            self.calls.append(call)

    def view(self, parent: tuple[str, int] | None) -> _View:
        """The recorded calls made directly inside the call ``parent`` (the scope: ``self.scope``)."""
        calls = [c for c in self.calls if c.parent == parent and c.rec_depth]
        return _View(calls, Counter(c.name for c in calls))

    def release(self, keep: _Call) -> None:
        """Drop the tensors of every recorded call except ``keep`` and the calls made inside it."""
        for c in self.calls:
            if c is not keep and c.parent != keep.key:
                c.inputs = c.output = None


# --------------------------------------------------------------------------------------------
# one side: the reference (CPU, unpatched) or the target (its device, patched)


class _Side:
    """How one side runs: its device, whether the patch set applies, and its (stable) root module."""

    def __init__(self, case: Any, call: Any, device: torch.device, patched: bool):
        self.case, self.call, self.device, self.patched = case, call, device, patched
        self.notes: dict[str, set[str]] = {}  # outputs converted or left out (output_leaves)
        self._root: torch.nn.Module | None = None
        if call.kind == "train_step":  # as ParityCase.train_step: a fresh copy, made before patching
            self._root = copy.deepcopy(call.module).to(device).train()

    def root(self) -> torch.nn.Module:
        """The module this side runs (placed after the patch set is entered, as ``ParityCase._run``);
        one object for the whole localization even where placement copies afresh (training mode)."""
        if self._root is None:
            self._root = self.case.session.place(self.call.module, self.device, self.case.recipe.weights_dtype)
        return self._root

    @contextlib.contextmanager
    def running(self, rng: tuple | None = None, state: tuple | None = None) -> Iterator[torch.nn.Module]:
        """Patch set (target) or reference patches (reference: ``ParityCase.reference_patches``, what the
        reference needs to run at all), placement, recipe, shared randomness (restored to ``rng``), grad
        mode and autocast state ``state`` — the context of the check's own runs; yields the root module."""
        with contextlib.ExitStack() as stack:
            if self.patched and self.case.patches is not None:
                stack.enter_context(self.case.patches(self.device))
            elif not self.patched and getattr(self.case, "reference_patches", None) is not None:
                stack.enter_context(self.case.reference_patches(self.device))
            root = self.root()
            stack.enter_context(self.case.recipe.context(self.device))
            stack.enter_context(same_randomness(self.call.seed))
            if rng is not None:
                _set_rng_state(rng)
            grad = self.call.grad if state is None else state[0]
            stack.enter_context(torch.set_grad_enabled(grad))
            if state is not None and (state[1], state[2]) != _mode_state(self.device.type)[1:]:
                stack.enter_context(torch.autocast(self.device.type, dtype=state[2], enabled=state[1]))
            yield root

    def entry(self) -> tuple[tuple[tuple, dict], tuple, tuple]:
        """``(inputs, random state, mode state)`` the check's own module call starts from on this
        side, in the form a ``_Recorder`` records a scope's call (for ``LocalizationCache.key``)."""
        dtype = self.case.recipe.weights_dtype
        with self.running():
            inputs = (_cpu_copy(_move(tuple(self.call.args), self.device, dtype)),
                      _cpu_copy(_move(dict(self.call.kwargs), self.device, dtype)))
            return inputs, _rng_state(), _mode_state(self.device.type)

    def run_root(self, root: torch.nn.Module) -> Any:
        """The check's own call on this side (inputs placed as ``runtime.side.run_side`` places them)."""
        dtype = self.case.recipe.weights_dtype
        args, kwargs = _move(self.call.args, self.device, dtype), _move(self.call.kwargs, self.device, dtype)
        if self.call.kind == "train_step":
            return root(*args, **kwargs)
        if isinstance(self.call.fn, torch.nn.Module):
            return root(*args, **kwargs)
        return getattr(root, self.call.fn.__name__)(*args, **kwargs)

    def record(self, scope: _Call | None, scope_key: tuple[str, int] | None) -> tuple[_Recorder, dict]:
        """One pass with hooks: the check's call (``scope`` None) or the ``scope`` call alone, run
        again from this side's recorded inputs. Returns the recorder and the pass's output leaves."""
        with self.running(scope.rng if scope else None, scope.state if scope else None) as root:
            with _Recorder(root, scope_key, self.device.type, notes=self.notes) as recorder:
                if scope is None:
                    output = self.run_root(root)
                else:
                    args, kwargs = _to_device(scope.inputs, self.device)
                    output = root.get_submodule(scope.name)(*args, **kwargs)
        return recorder, output_leaves(output, notes=self.notes, where=scope.name if scope else "")

    def run_call(self, name: str, inputs: tuple[tuple, dict], rng: tuple, state: tuple) -> dict[str, torch.Tensor]:
        """Submodule ``name`` of this side on ``inputs`` (moved here), in a call's context."""
        with self.running(rng, state) as root:
            args, kwargs = _to_device(inputs, self.device)
            return output_leaves(root.get_submodule(name)(*args, **kwargs), notes=self.notes, where=name)


# --------------------------------------------------------------------------------------------
# comparing


def _worst(result: CompareResult) -> LeafResult | None:
    def severity(leaf: LeafResult) -> float:
        if leaf.problem is not None or math.isnan(leaf.err_ratio):
            return math.inf
        return leaf.err_ratio
    return max(result.leaves, key=severity, default=None)


def _plain(obj: Any, depth: int = 0) -> Any:
    """A snapshot's copy (``_State.copy``) as nested dicts and lists of its attributes, for ``_same``
    (its type and devices left out: the snapshots of both sides are compared by their contents)."""
    if isinstance(obj, torch.device):
        return None
    if isinstance(obj, torch.Tensor) or depth >= 32:
        return obj
    if isinstance(obj, (tuple, list)):
        return [_plain(v, depth + 1) for v in obj]
    if isinstance(obj, Mapping):
        return {k: _plain(v, depth + 1) for k, v in obj.items()}
    if is_state(obj) and hasattr(obj, "__dict__"):
        return {"": type(obj), **{k: _plain(v, depth + 1) for k, v in vars(obj).items()}}
    return obj


def _same(a: Any, b: Any) -> bool:
    """Bitwise-equal nested inputs (tensors by ``torch.equal``, snapshots of stateful arguments by
    their attributes, other objects by ``==``)."""
    if isinstance(a, _State) or isinstance(b, _State):
        return isinstance(a, _State) and isinstance(b, _State) and _same(_plain(a.copy), _plain(b.copy))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
            return False
        if getattr(a, "is_nested", False) or getattr(b, "is_nested", False):  # no .shape: compare components
            if not (getattr(a, "is_nested", False) and getattr(b, "is_nested", False)):
                return False
            try:
                parts_a, parts_b = a.unbind(), b.unbind()
            except Exception:  # noqa: BLE001 - cannot tell: treat as different (a local re-run follows)
                return False
            return len(parts_a) == len(parts_b) and all(_same(x, y) for x, y in zip(parts_a, parts_b))
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==: treat as different
        return False



"""Modifications of a module's run, as context managers: named submodules in float32, or replaced by
their float64 CPU reference.

Both work through forward hooks registered on the named submodules (``register_forward_pre_hook`` /
``register_forward_hook`` with ``with_kwargs=True``, torch >= 2.0). A module's hooks live in its own
``_forward_hooks`` dicts, which ``copy.deepcopy`` copies while it keeps the hook functions themselves (a
function is copied by reference): a copy made while a modification is active — a training step's
``trainable_copy``, ``fresh_copy`` of a module in training mode — carries the hooks, so they act on
the submodule of the same qualified name in the copy. Leaving the block removes them from the modules
they were registered on (copies made inside the block are the run's own and are dropped with it).

``fp32_islands(model, names)`` is public (``pytest_npu_parity.fp32_islands``): the fix that a
precision-island search prints, usable around any forward, inside or outside pytest.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ...leaves import is_cache
from ...runtime.side import copy_state, is_state


def _map_floats(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], depth: int = 0) -> Any:
    """``obj`` with every floating tensor ``t`` in it replaced by ``fn(t)``; tuples, lists and dicts
    are rebuilt (a dict subclass keeps its type where it can be built from items), anything else —
    a key/value cache, a module, a number — is kept as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.is_floating_point() else obj
    if depth > 16 or is_cache(obj):
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(_map_floats(v, fn, depth + 1) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_floats(v, fn, depth + 1) for v in obj)
    if isinstance(obj, dict):
        mapped = {k: _map_floats(v, fn, depth + 1) for k, v in obj.items()}
        try:
            return type(obj)(mapped)
        except Exception:  # noqa: BLE001 - a mapping type that cannot be built from a dict: a plain dict
            return mapped
    return obj


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 when it is a floating tensor of fewer bits, else ``t``."""
    return t.float() if torch.finfo(t.dtype).bits < 32 else t


def _device_type(args: Any, kwargs: Any, module: torch.nn.Module) -> str:
    """The device type of the first floating tensor among the inputs, else of the module's first
    parameter or buffer, else ``cpu``."""
    found: list[str] = []

    def seen(t: torch.Tensor) -> torch.Tensor:
        found.append(t.device.type)
        return t

    _map_floats((args, kwargs), seen)
    if found:
        return found[0]
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device.type
    return "cpu"


def _resolve(model: torch.nn.Module, names: Iterable[str]) -> list[tuple[str, torch.nn.Module]]:
    """``(name, submodule)`` of each name (``""`` the model itself), duplicates dropped.

    Raises:
        AttributeError: a name that is no submodule of ``model`` (``nn.Module.get_submodule``).
    """
    out, seen = [], set()
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        out.append((name, model.get_submodule(name) if name else model))
    return out


def called_children(model: torch.nn.Module, name: str = "") -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, module)`` of the children of ``model``'s submodule ``name`` that a forward
    calls: a ``ModuleList`` or ``ModuleDict`` (containers whose own ``forward`` never runs, so hooks
    on them never fire) is replaced by its children, recursively; in registration order."""
    sub = model.get_submodule(name) if name else model
    out = []
    for child_name, child in sub.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out += called_children(model, full)
        else:
            out.append((full, child))
    return out


def sixteen_bit_parameters(module: torch.nn.Module) -> list[str]:
    """Names of ``module``'s floating parameters and buffers of fewer than 32 bits (bf16, fp16)."""
    return [n for n, t in list(module.named_parameters()) + list(module.named_buffers())
            if t.is_floating_point() and torch.finfo(t.dtype).bits < 32]


@contextlib.contextmanager
def fp32_islands(model: torch.nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Run the named submodules of ``model`` in float32 inside the block: autocast is disabled for the
    device type of each call's inputs while the submodule runs, and its floating inputs (positional
    and keyword, nested in tuples, lists and dicts) of fewer than 32 bits are cast to float32, so its
    float32 weights compute in float32. Outputs are left as the submodule returns them (float32).

    The plain-torch equivalent, for one submodule ``m`` called as ``m(x)``::

        with torch.autocast(device_type=x.device.type, enabled=False):
            y = m(x.float())

    Args:
        model: the module the names are relative to (``""`` is ``model`` itself).
        names: dotted submodule names (``model.named_modules()``), e.g. ``["layers.0.attn"]``.

    Copies of ``model`` made inside the block (``copy.deepcopy``) run the same submodules in float32
    (module doc). Works under any torch from 2.5.1 on (hooks ``with_kwargs``, ``always_call``).

    Raises:
        AttributeError: a name that is not a submodule of ``model``.
        ValueError: a named submodule holds 16-bit parameters or buffers (a ``bf16-weights`` model):
            running it "in float32" would need upcast weights, which this fix does not make (upcast
            that submodule's weights with ``.float()`` yourself, then use this block).
    """
    targets = _resolve(model, names)
    for name, module in targets:
        low = sixteen_bit_parameters(module)
        if low:
            raise ValueError(f"fp32_islands: {name or '<model>'} holds 16-bit weights ({', '.join(low[:3])}"
                             f"{', …' if len(low) > 3 else ''}); upcast them with .float() first")
    with contextlib.ExitStack() as stack:
        for _, module in targets:
            entered: list[Any] = []  # one autocast-off context per running call (LIFO: nested calls)

            def pre(mod: torch.nn.Module, args: tuple, kwargs: dict, entered: list = entered) -> tuple:
                off = torch.autocast(device_type=_device_type(args, kwargs, mod), enabled=False)
                off.__enter__()
                entered.append(off)
                return _map_floats(args, _upcast), _map_floats(kwargs, _upcast)

            def post(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any, entered: list = entered) -> None:
                if entered:
                    entered.pop().__exit__(None, None, None)

            stack.callback(_unwind, entered)
            stack.enter_context(_hooked(module, pre, post))
        yield


def _unwind(entered: list) -> None:
    """Leave autocast-off contexts a raising call left entered (``always_call`` normally pops them)."""
    while entered:
        entered.pop().__exit__(None, None, None)


@contextlib.contextmanager
def _hooked(module: torch.nn.Module, pre: Callable | None, post: Callable | None) -> Iterator[None]:
    """``pre`` as a forward pre-hook and ``post`` as a forward hook (both ``with_kwargs``; ``post``
    also when the forward raises) on ``module`` inside the block, outermost (``prepend``)."""
    handles = []
    try:
        if pre is not None:
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        if post is not None:
            handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _like(ref: Any, out: Any) -> Any:
    """``ref`` (the float64 reference output) shaped as the target's ``out``: each floating tensor cast
    to the dtype and device of the target's tensor at the same place; where the target's tensor
    requires grad, its value is replaced but its gradient path kept (``out + (ref - out).detach()``)."""
    if isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor):
        if not out.is_floating_point() or ref.shape != out.shape:
            return out
        value = ref.to(device=out.device, dtype=out.dtype)
        return out + (value - out).detach() if out.requires_grad else value
    if isinstance(out, (tuple, list)) and isinstance(ref, (tuple, list)) and len(out) == len(ref):
        items = [_like(r, o) for r, o in zip(ref, out)]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, dict) and isinstance(ref, dict):
        mapped = {k: (_like(ref[k], v) if k in ref else v) for k, v in out.items()}
        try:
            return type(out)(mapped)
        except Exception:  # noqa: BLE001 - see _map_floats
            return mapped
    return out


def pristine_float64(model: torch.nn.Module, name: str) -> torch.nn.Module:
    """A float64 CPU deep copy of ``model``'s submodule ``name`` (``""``: the model), in its modes."""
    sub = model.get_submodule(name) if name else model
    with torch.no_grad():
        return copy.deepcopy(sub).to(device="cpu", dtype=torch.float64)


def _snapshot(obj: Any, depth: int = 0) -> Any:
    """A CPU copy of a call's inputs: every tensor detached and cloned to the CPU, a key/value cache or
    other stateful argument deep-copied with its tensors so (``runtime.side.copy_state``), so that
    neither the rest of the run nor the reference run changes what was recorded or what the target
    uses."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if depth > 16:
        return obj
    if is_state(obj):
        return copy_state(obj, lambda t: t.detach().to("cpu", copy=True), torch.device("cpu"))
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_snapshot(v, depth + 1) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_snapshot(v, depth + 1) for v in obj)
    if isinstance(obj, dict):
        mapped = {k: _snapshot(v, depth + 1) for k, v in obj.items()}
        try:
            return type(obj)(mapped)
        except Exception:  # noqa: BLE001 - see _map_floats
            return mapped
    return obj


def _to_float64(obj: Any) -> Any:
    """A fresh copy of a snapshot (``_snapshot``) with its floating tensors in float64, caches included."""
    if is_state(obj):
        return copy_state(obj, lambda t: t.to(torch.float64) if t.is_floating_point() else t.clone())
    return _map_floats(_snapshot(obj), lambda t: t.to(torch.float64))


@contextlib.contextmanager
def recorded_inputs(model: torch.nn.Module, names: Sequence[str], store: dict[str, list]) -> Iterator[None]:
    """Inside the block each call of a named submodule appends a CPU snapshot of its ``(args,
    kwargs)`` (``_snapshot``) to ``store[name]`` (a forward pre-hook that changes nothing).

    Raises:
        AttributeError: a name that is not a submodule of ``model``.
    """
    with contextlib.ExitStack() as stack:
        for name, module in _resolve(model, names):
            calls = store.setdefault(name, [])

            def pre(mod: torch.nn.Module, args: tuple, kwargs: dict, calls: list = calls) -> None:
                calls.append((_snapshot(args), _snapshot(kwargs)))

            stack.enter_context(_hooked(module, pre, None))
        yield


def reference_runs(pristine: torch.nn.Module, calls: list) -> list[Any]:
    """The outputs of ``pristine`` (a float64 CPU module, ``pristine_float64``) on each recorded call
    (``recorded_inputs``), in float64 on the CPU, without autocast or autograd, drawing nothing from
    the caller's random stream (``fork_rng``)."""
    outputs = []
    with torch.no_grad(), torch.autocast("cpu", enabled=False), torch.random.fork_rng(devices=[]):
        for args, kwargs in calls:
            outputs.append(pristine(*_to_float64(args), **_to_float64(kwargs)))
    return outputs


@contextlib.contextmanager
def replaced_outputs(model: torch.nn.Module, name: str, outputs: list) -> Iterator[None]:
    """Inside the block the k-th call of ``model``'s submodule ``name`` (counted from the block's
    start, copies of ``model`` made inside included) returns ``outputs[k]`` instead of its own
    output, each floating tensor cast to the dtype and device of the target's tensor at the same
    place (``_like``); calls past ``len(outputs)`` keep their own. The target's own submodule still
    runs (its outputs' structure and its random draws are kept).

    Raises:
        AttributeError: ``name`` is not a submodule of ``model``.
    """
    ((_, module),) = _resolve(model, [name])
    count = [0]

    def post(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        index = count[0]
        count[0] += 1
        if output is None or index >= len(outputs):
            return None
        return _like(outputs[index], output)

    with _hooked(module, None, post):
        yield


@contextlib.contextmanager
def reference_outputs(model: torch.nn.Module, names: Sequence[str],
                      pristine: dict[str, torch.nn.Module] | None = None) -> Iterator[None]:
    """Inside the block the named submodules' outputs are replaced by their reference behaviour, in
    one run: the *pristine* submodule (``pristine[name]``, by default a float64 CPU copy of
    ``model``'s submodule taken on entry) run on the CPU in float64 from a snapshot of the call's own
    inputs, cast back to the target output's dtype and device. It runs inside the call's forward
    hook, so whatever else is active then (a patch of the submodule's class or of a function it
    calls) acts on it too: the counterfactual attribution (``attribution.attribute``) therefore
    records the inputs in one run and computes the reference outside the patch set
    (``recorded_inputs``, ``reference_runs``, ``replaced_outputs``). Only forward values are replaced:
    an output that requires grad keeps the target's gradient path (``_like``), so in a train step a
    fault that also acts in the backward (a scaled weight) is only partly removed.

    Raises:
        AttributeError: a name that is not a submodule of ``model``.
    """
    targets = _resolve(model, names)
    copies = dict(pristine or {})
    for name, _ in targets:
        if name not in copies:
            copies[name] = pristine_float64(model, name)
    with contextlib.ExitStack() as stack:
        for name, module in targets:
            ref_module = copies[name]

            def post(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any,
                     ref_module: torch.nn.Module = ref_module) -> Any:
                if output is None:
                    return None
                (ref,) = reference_runs(ref_module, [(_snapshot(args), _snapshot(kwargs))])
                return _like(ref, output)

            stack.enter_context(_hooked(module, None, post))
        yield


MAX_TRACED_CALLS = 8  # calls of one module traced by ``op_traced`` before it gives up on a culprit op


@contextlib.contextmanager
def op_traced(model: torch.nn.Module, name: str, found: list, calls: list | None = None,
              **trace: Any) -> Iterator[None]:
    """Trace the ops of the calls of ``model``'s submodule ``name`` inside the block
    (``op_trace.trace_ops(submodule, args, kwargs, **trace)``, one ``OpTrace`` per call appended to
    ``found``, in call order): a forward pre-hook runs the traced call from the call's own inputs, in the
    run's own context (patch set, recipe, autocast, grad mode, random stream as the call would see it),
    before the call itself runs. Calls are traced until one has a culprit op (a module called twice may
    compute wrongly in its second call only), at most ``MAX_TRACED_CALLS``; the later calls run untraced.
    The run's outputs after the first traced call are not those of a plain run (the traced call drew from
    the random stream and updated any running statistics first): use the run for the trace only.

    With ``calls`` (a list), each traced call also records its op stream below the trace
    (``op_stream.OpRecorder``) and appends ``TracedCall`` (the trace, the stream, the call's inputs on the
    CPU, its random state, grad mode and training flag): what ``reference_stream`` needs to run the reference's
    same call.

    Raises:
        AttributeError: ``name`` is not a submodule of ``model``.
    """
    from ..op_stream import OpRecorder
    from ..op_trace import trace_ops

    module = model.get_submodule(name) if name else model
    busy: list[bool] = []

    def pre(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if busy or len(found) >= MAX_TRACED_CALLS or any(t.first is not None for t in found):
            return
        busy.append(True)
        try:
            if calls is None:
                found.append(trace_ops(mod, args, kwargs, enter_recipe=False, **trace))
                return
            inputs, rng = _to_cpu(_snapshot((args, kwargs))), torch.get_rng_state()
            with OpRecorder(mod, trace.get("path", "")) as recorder:
                found.append(trace_ops(mod, args, kwargs, enter_recipe=False, **trace))
            calls.append(TracedCall(found[-1], recorder.stream, inputs, rng, torch.is_grad_enabled(), mod.training))
        finally:
            busy.pop()

    with _hooked(module, pre, None):
        yield


@dataclass
class TracedCall:
    """One call traced by ``op_traced`` with ``calls``: its ``trace`` (``op_trace.OpTrace``, also in
    ``found``), the target's op ``stream`` (``op_stream.OpStream``), its ``inputs`` (``(args, kwargs)`` on
    the CPU, as the call got them), the CPU random state it started from, its grad mode and its module's
    training flag."""

    trace: Any
    stream: Any
    inputs: tuple
    rng: torch.Tensor
    grad: bool
    training: bool


def _to_cpu(obj: Any) -> Any:
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().to("cpu") if isinstance(x, torch.Tensor) else x, obj)


def reference_stream(module: torch.nn.Module, call: TracedCall, recipe: Any, path: str,
                     reference_patches: Callable[[torch.device], Any] | None = None) -> Any:
    """The reference's op stream of a traced call (``op_stream.record_ops``): a copy of the pristine
    ``module`` (the check's own submodule, in the recipe's weights dtype) run on the CPU from the call's
    inputs, in its training mode, grad mode and random state, under the recipe's context and the case's
    reference patches, outside any patch set. Raises whatever that run raises."""
    from ..op_stream import record_ops

    ref = copy.deepcopy(module).to("cpu")
    weights_dtype = getattr(recipe, "weights_dtype", None)
    if weights_dtype is not None:
        ref = ref.to(weights_dtype)
    ref.train(call.training)
    args, kwargs = call.inputs
    cpu = torch.device("cpu")
    with contextlib.ExitStack() as stack:
        if reference_patches is not None:
            stack.enter_context(reference_patches(cpu))
        if recipe is not None:
            stack.enter_context(recipe.context(cpu))
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.set_rng_state(call.rng)
        stack.enter_context(torch.set_grad_enabled(call.grad))
        return record_ops(ref, tuple(args), dict(kwargs), path=path)

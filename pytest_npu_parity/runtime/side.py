"""One side's run of a check: ``(side, spec, device, patched, audited) -> (CPU leaves, audit dict)``.

A ``Side`` is what a case lends every run: its recipe, its patch set, how modules are placed on a
device (``ParitySession.place``), the audit factory, and the set that collects the names of the
patches applied. A ``RunSpec`` is what one run computes: the function, its inputs, the seed, whether
autograd is on, the random stream and the layer policy. ``run_side`` runs it once on a device (the
target: ``patched`` under the patch set, ``audited`` under the device-propagation audit); a
``RuntimeError`` under a reduced-precision recipe that the same run does not raise under fp32 is
raised as ``recipes.RecipeUnsupportedError`` naming the op and the module (``_recipe_error``).

Also here: the placement helpers (``fresh_copy``, ``trainable_copy``, ``_move``), the check's
description for hooks that run it again (``CheckCall``), the audit of a target run (``target_audit``),
the patch factory that applies nothing (``no_patches``) and ``patches_suspended``, which turns single
patches of a patch set off inside the patched runs of a block (a counterfactual re-run).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import linecache
import os
import re
import types
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .audit import DEFAULT_LOGICAL_TARGET, DeviceAudit
from ..leaves import cpu_leaf, flatten, is_cache
from ..modules import owner_module
from .recipes import RECIPES, Recipe, RecipeUnsupportedError, strict_fp32_flags
from .rng import random_functions, randomness, target_seed
from .input_changes import changed_inputs, inplace_leaves
from .layer_capture import DEFAULT_SAMPLES, capture_layers
from .module_state import KeptState, kept_state, state_owners

PatchFactory = Callable[[torch.device], ContextManager[Any]]


@dataclass
class CheckCall:
    """How one check computes its output, for hooks that run it again (localization, self-check).

    Attributes:
        kind: ``check`` (``fn(*args, **kwargs)``) or ``train_step`` (``fn`` is the module; one
            training step on ``fn(**kwargs)``, ``args`` is empty).
        fn: a module, a bound method of one, or a function (``check``); the module (``train_step``).
        args, kwargs: the check's inputs as given (CPU tensors, before placement).
        seed: seed of the shared random stream both sides ran under.
        grad: autograd was on (always for a train step).
        rerun: ``(device, patched, args, kwargs) -> {leaf path: CPU tensor or None}``: the whole
            check on one side with other inputs (patched: under the case's patch set, as the target).
        vacuous_ok: why the check may be vacuous (``parity.check(..., vacuous_ok=...)`` or the
            ``parity`` marker), or None.
        fault_weight: the parameter of the check's module (a ``named_parameters`` name) that
            ``--parity-selfcheck`` perturbs, or None for ``selfcheck.sensitive_parameter``'s choice.
        sample_dim: the axis of i.i.d. samples of a sampling check, or None.
        replay: for a plain training step (``train_step`` without ``loop``; loss-scaled or not),
            ``(leaves) -> {param.<p>: CPU tensor}``: the optimizer step replayed on a fresh CPU copy
            of the module from the ``grad.<p>`` leaves in ``leaves`` (see ``ParityCase.train_step``,
            optimizer replay); None for other checks.
        memo: what else makes the run another computation, for the session's reference and golden
            memos (``checks.reference.memo_key``): the layer records' sample count (None without
            layer records); a train step's ``optimizer``, ``loss_fn``, ``max_grad_norm`` and
            ``loop`` (callables by identity, ``_Same``).
        input_changes: the ``Side.input_changes`` of the check's runs, or None.
        stream_overrides: the ``Side.stream_overrides`` of the check's runs, or None.
        rejudge: ``(target leaves as rerun returns them) -> CompareResult``: those leaves judged by
            the check's own verdict against the same expected leaves and golden as the check's
            comparison (``checks.verdict.rejudged``; nothing is computed again), or None (a check
            judged as distributions, a record-mode run).
        loss: for a train step without ``loop``, ``(output, module) -> scalar tensor``: the step's loss
            from its forward's ``output`` (``module`` the side's copy, for a loss module holding
            tensors), as the step computes it; None for other checks (the backward localization
            needs it).
    """

    kind: str
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    seed: int
    grad: bool
    rerun: Callable[..., dict]
    vacuous_ok: str | None = None
    fault_weight: str | None = None
    sample_dim: int | None = None
    replay: Callable[[dict], dict] | None = None
    memo: tuple = ()
    input_changes: dict | None = None
    stream_overrides: set | None = None
    rejudge: Callable[[dict], Any] | None = None
    loss: Callable[[Any, torch.nn.Module], torch.Tensor] | None = None

    @property
    def module(self) -> torch.nn.Module | None:
        """The module the computation belongs to (``owner_module(fn)``), or None for a function."""
        return owner_module(self.fn)


class _Same:
    """A memo-key part that equals only another ``_Same`` of the very same object (hashed by
    ``id``, which works for unhashable callables); it holds the object, so that no other object
    takes its ``id`` while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


class _CopyOnEntry:
    """A module argument of a run that is deep-copied to the run's device only once the run's patch
    set is entered (``train_step``: each side trains a fresh copy). Copying before the patches would
    hide from the target a patch that edits the module's weights, which ``_call`` otherwise applies
    before placing a module."""

    __slots__ = ("module",)

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def copy(self, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """``trainable_copy(module).to(device)``, its floating tensors in ``dtype`` when given (the
        recipe's ``weights_dtype``: a ``bf16-weights`` step trains bf16 weights, as its inputs are)."""
        copy = trainable_copy(self.module).to(device)
        return copy.to(dtype) if dtype is not None else copy


class _RunRecipe:
    """An argument of a run that ``_call`` replaces by the recipe the run is under (a training step
    enters the recipe's context around its forward only; the fp32 re-run of ``_recipe_error`` must
    reach it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "RUN_RECIPE"


#: The placeholder ``_call`` replaces by the run's ``Recipe``.
RUN_RECIPE = _RunRecipe()


#: Exact types of a module's attributes that ``module_copy_memo`` copies, when empty, by constructing
#: an empty one: the hook tables and ``_parameters``/``_buffers`` dicts ``nn.Module.__init__`` gives
#: every module (about a dozen per module, torch 2.5.1 and 2.14.1).
_EMPTY_CONTAINERS = (dict, OrderedDict, set)


def module_copy_memo(module: torch.nn.Module, shared: Iterable[torch.Tensor] = ()) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo for ``module``: each submodule's empty ``dict``, ``OrderedDict`` or
    ``set`` attribute already copied (a new empty one of the same type), and each tensor of ``shared``
    mapped to itself (shared by the copy, not copied).

    ``copy.deepcopy(module, memo=module_copy_memo(module))`` gives what ``copy.deepcopy(module)`` gives
    (an empty container's deep copy is a new empty container of its type; one object reached twice
    is still copied once), in about half the time: ``copy.deepcopy`` rebuilds each of those
    containers through ``__reduce_ex__``, and they are most of a module tree's objects (Aurora's 893
    modules: 11,639 objects rebuilt, 50 ms a copy; 26 ms with this memo, 2-core AMD EPYC, torch 2.14.1).
    """
    memo: dict[int, Any] = {id(t): t for t in shared}
    # The originals are kept alive in the memo, as ``copy.deepcopy`` keeps each object it copies
    # (``copy._keep_alive``, the list under ``id(memo)``): a container freed during the copy (a
    # ``__getstate__`` that replaces an attribute) would otherwise leave its id to a new object,
    # which the copy would then take for that container.
    originals: list[Any] = []
    for sub in module.modules():
        for value in vars(sub).values():
            if type(value) in _EMPTY_CONTAINERS and not value:
                memo[id(value)] = type(value)()
                originals.append(value)
    memo[id(memo)] = originals
    return memo


def trainable_copy(module: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(module)`` whose parameters are leaves with the original's ``requires_grad``.

    A plain deep copy of a module holding a ``torch.jit.script`` submodule gives that submodule's
    parameters a ``grad_fn`` (``CloneBackward0``; torch 2.5.1 and 2.14.1): they are no leaves, and
    an optimizer over them raises ``ValueError: can't optimize a non-leaf Tensor``. Copied under
    ``torch.no_grad()`` they are leaves (without ``requires_grad`` there), which is then restored.
    """
    with torch.no_grad():
        fresh = copy.deepcopy(module, memo=module_copy_memo(module))
    for (_, theirs), (_, ours) in zip(module.named_parameters(remove_duplicate=False),
                                      fresh.named_parameters(remove_duplicate=False)):
        if ours.requires_grad != theirs.requires_grad:
            ours.requires_grad_(theirs.requires_grad)
    return fresh


#: How deep ``copy_state`` looks for tensors inside an object's attributes and containers.
STATE_DEPTH = 32
#: Objects ``copy_state`` never looks into (nor ``is_state`` counts as state): code, classes, modules.
_NOT_STATE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              torch.nn.Module, torch.dtype, torch.device, torch.Generator)


def is_state(obj: Any) -> bool:
    """Whether ``obj``, an argument of a call that is not a tensor, number, string or container, is
    an object whose state the call may change: a Hugging Face cache (``compare.is_cache``, by class
    name) or any other object with attributes (``__dict__`` or ``__slots__``), except modules,
    classes, functions, methods, dtypes, devices and generators."""
    if obj is None or isinstance(obj, (torch.Tensor, str, bytes, bytearray, int, float, complex, tuple, list,
                                       Mapping, set, frozenset) + _NOT_STATE):
        return False
    return is_cache(obj) or hasattr(obj, "__dict__") or bool(getattr(type(obj), "__slots__", ()))


def copy_state(obj: Any, tensor: Callable[[torch.Tensor], torch.Tensor], device: torch.device | None = None) -> Any:
    """A deep copy of ``obj`` (a key/value cache, any object holding state) whose tensors are ``tensor(t)``.

    Every tensor found in ``obj``'s attributes (``__dict__``, ``__slots__``), lists, tuples, sets
    and mapping values, down to ``STATE_DEPTH`` levels, is replaced by ``tensor(t)`` (once per tensor
    object, so two references to one tensor stay one tensor); parameters and modules are kept as
    they are (shared with the original, never copied); everything else is ``copy.deepcopy``'d. With
    ``device``, every ``torch.device`` attribute equal to the device of one of ``obj``'s tensors
    becomes ``device`` (a cache layer records where its tensors live: ``DynamicLayer.device``).

    Raises:
        Whatever ``copy.deepcopy`` raises for a part of ``obj`` that cannot be copied (a lock, an
        open file), or ``tensor`` raises.
    """
    memo: dict[int, Any] = {}
    devices: list[torch.device] = []
    where: set[torch.device] = set()

    def walk(value: Any, depth: int) -> None:
        if id(value) in memo:
            return
        if isinstance(value, (torch.nn.Parameter, torch.nn.Module)):
            memo[id(value)] = value
        elif isinstance(value, torch.Tensor):
            memo[id(value)] = tensor(value)
            where.add(value.device)
        elif isinstance(value, torch.device):
            devices.append(value)
        elif depth < STATE_DEPTH and not isinstance(value, _NOT_STATE + (str, bytes, bytearray, int, float)):
            if isinstance(value, Mapping):
                children = list(value.values())
            elif isinstance(value, (list, tuple, set, frozenset)):
                children = list(value)
            else:
                children = list(vars(value).values()) if hasattr(value, "__dict__") else []
                children += [getattr(value, n) for n in getattr(type(value), "__slots__", ()) if hasattr(value, n)]
            for child in children:
                walk(child, depth + 1)

    walk(obj, 0)
    if device is not None:
        for found in devices:
            if found in where and id(found) not in memo:
                memo[id(found)] = torch.device(device)
    return copy.deepcopy(obj, memo)


def _move(obj: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """Copy every tensor in a nested structure to ``device`` (floating ones cast to ``float_dtype``).

    Always a new tensor, also where ``Tensor.to`` would return the caller's own (same device and
    dtype: a CPU reference, a CPU target): each side runs on its own copy of the caller's inputs,
    so a computation that changes an input in place (``x.sub_(mean)``, ``masked_fill_`` on a mask
    argument) changes neither the caller's tensor nor what the next side is given. A copy of a
    tensor that requires grad stays connected to it, as a copy to another device is. A Hugging
    Face key/value cache (``compare.is_cache``) is copied too (``copy_state``, its tensors moved
    this way): a forward given ``past_key_values`` adds to the cache, and each side must start from
    the caller's. A ``torch.Generator`` is copied in its state (each side draws the same numbers; the
    caller's generator does not advance).
    """
    if is_cache(obj):
        return copy_state(obj, lambda t: _move(t, device, float_dtype), device)
    if isinstance(obj, torch.Tensor):
        if float_dtype is not None and obj.is_floating_point():
            moved = obj.to(device=device, dtype=float_dtype)
        else:
            moved = obj.to(device)
        return obj.clone() if moved is obj else moved
    if isinstance(obj, dict) or hasattr(obj, "items") and hasattr(obj, "keys"):
        return type(obj)({k: _move(v, device, float_dtype) for k, v in obj.items()}) if isinstance(obj, dict) \
            else {k: _move(v, device, float_dtype) for k, v in obj.items()}
    if isinstance(obj, torch.Generator):  # each side draws from its own copy, in the caller's state
        return copy.deepcopy(obj)
    if isinstance(obj, tuple):
        return tuple(_move(v, device, float_dtype) for v in obj)
    if isinstance(obj, list):
        return [_move(v, device, float_dtype) for v in obj]
    return obj


def _changed_inputs(given: tuple[tuple, dict], ran: tuple[Any, Any]) -> list[str]:
    """Paths (``args[0]``, ``kwargs['mask']``, ``args[1][2]``) of the tensors in ``ran`` — one side's
    ``(args, kwargs)`` copies after its run (``_move``) — whose values differ from the caller's
    ``given``: inputs the computation changed in place (NaN equal to NaN; ``input_changes.changed_inputs``)."""
    return [path for path, _ in changed_inputs(given, ran)]


def _to_cpu_leaves(output: Any, kept: KeptState | None = None) -> dict[str, torch.Tensor | None]:
    """``output``'s leaves by path, on the CPU (``leaves.cpu_leaf``); with ``kept`` (inside its block),
    a leaf that shares memory with a tensor ``kept`` is about to put back is copied."""
    if kept is None:
        return {path: (cpu_leaf(t) if t is not None else None) for path, t in flatten(output)}
    return {path: (kept.detach_output(cpu_leaf(t)) if t is not None else None) for path, t in flatten(output)}


def _any_training(module: torch.nn.Module) -> bool:
    return any(m.training for m in module.modules())


def _sync_modes(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    for a, b in zip(src.modules(), dst.modules()):
        b.training = a.training


def _on_device(module: torch.nn.Module, device: torch.device, dtype: torch.dtype | None) -> bool:
    """Whether every parameter and buffer of ``module`` is on ``device`` (and, when ``dtype`` is given,
    every floating one in ``dtype``). One walk of the module tree over each submodule's own
    ``_parameters`` and ``_buffers``: the registered tensors, those ``Module.to`` moves and casts, which
    are what ``parameters()`` and ``buffers()`` yield unless a module overrides them (a shared one seen
    twice changes nothing). Those two methods walk the tree twice and build each tensor's dotted name:
    2.1 ms for Aurora's 893 submodules, against 1.9 ms for this walk."""
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for t in table.values():
                if t is None:
                    continue
                if t.device != device:
                    return False
                if dtype is not None and t.is_floating_point() and t.dtype != dtype:
                    return False
    return True


def fresh_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose buffers and submodule objects (their ``training`` flags, cached
    attributes) are new, sharing the parameter tensors with ``module``.

    For a forward in training mode: BatchNorm running statistics, ``num_batches_tracked`` and other
    buffers change in the copy only, while the weights — up to 210 M parameters for Aurora, which a
    forward does not modify — are not duplicated. Not for a training step: an optimizer updates
    the shared parameters in place (``ParityCase.train_step`` deep-copies).
    """
    return copy.deepcopy(module, memo=module_copy_memo(module, shared=module.parameters()))


@dataclass(frozen=True)
class Side:
    """What a case lends each run of a check.

    Attributes:
        recipe: the recipe the run is under (``recipes.Recipe``).
        place: ``(module, device, dtype) -> module`` on the device (``ParitySession.place``).
        patches: ``(device) -> context manager`` applying the suite's patch set (patched runs), or None.
        audit_factory: ``(device) -> audit context manager`` of audited runs, or None.
        patches_applied: receives the names of the patches a patched run applied.
        reference_patches: ``(device) -> context manager`` applying what the reference side needs to run
            the computation at all (unpatched runs: the live reference and a recording), or None. For
            dtype gaps the upstream code has on every device (Aurora's bf16 ``rfft`` under the
            ``bf16-weights`` recipe); never the port's device fixes, which the reference must not share.
        reference_patches_applied: receives the names of the patches a reference run applied.
        input_changes: receives, per side that ran (``"reference"``, ``"target"``: unpatched and
            patched runs), the paths of the inputs its runs changed in place (``_changed_inputs``).
        stream_overrides: receives the names of the random functions the patch set replaced
            (``torch.nn.functional.dropout``) that its runs called and got the shared random stream's
            instead (``rng.same_randomness``, ``rng.StandIns``).
    """

    recipe: Recipe
    place: Callable[[torch.nn.Module, torch.device, torch.dtype | None], torch.nn.Module]
    patches: PatchFactory | None = None
    audit_factory: Callable[[torch.device], ContextManager[Any]] | None = None
    patches_applied: set = field(default_factory=set)
    reference_patches: PatchFactory | None = None
    reference_patches_applied: set = field(default_factory=set)
    input_changes: dict = field(default_factory=dict)
    stream_overrides: set = field(default_factory=set)


@dataclass(frozen=True)
class RunSpec:
    """One computation of a check, as ``run_side`` runs it.

    Attributes:
        fn: a module, a bound method of one, or a function; called as ``fn(*args, **kwargs)``.
        args, kwargs: its inputs (CPU tensors; moved to the run's device in the recipe's weights
            dtype); a ``_CopyOnEntry`` argument is copied to the device inside the patch set,
            ``RUN_RECIPE`` is replaced by the run's recipe.
        seed: seed of the run's random stream.
        grad: run with autograd enabled (else under ``torch.no_grad()``).
        recipe_context: enter the recipe's context around the call (else ``strict_fp32_flags``: a
            training step enters it around its forward itself).
        stream: ``(rng mode, seed)`` of the run's randomness (default ``("shared", seed)``).
        layers: a ``layers.LayerPolicy`` to record the run's layer outputs by, or None.
    """

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict
    seed: int
    grad: bool
    recipe_context: bool = True
    stream: tuple[str, int] | None = None
    layers: Any = None


def run_side(side: Side, spec: RunSpec, device: torch.device, patched: bool,
             audited: bool = False) -> tuple[dict[str, torch.Tensor | None], dict | None]:
    """``(leaves on the CPU, audit dict or None)`` of one run of ``spec`` on ``device``; with a
    ``layers.LayerPolicy`` as ``spec.layers`` the leaves also hold the run's layer records
    (``layers.capture_layers`` on the computation's module, keys ``layer:<path>``).

    ``patched``: under ``side.patches``. ``audited``: record a device-propagation audit
    (``side.audit_factory(device)``). A real audit watches this very run. A *logical* one
    (``audit.logical``, a CPU target) watches an extra run whose output is dropped: the numbers
    come from a plain run, because the logical audit's function mode turns off PyTorch's transformer
    fast path (about 2.4e-7 apart on Aurora). Modules among ``args`` are deep-copied for the extra
    run (a train step mutates them).

    Raises:
        recipes.RecipeUnsupportedError: the run raised a ``RuntimeError`` under a recipe other
            than fp32 and the same run passes under fp32 (``_recipe_error``); the original
            error is its ``__cause__``. Any other error propagates as it is.
    """
    __tracebackhide__ = True
    try:
        return _run_once(side, spec, device, patched, audited)
    except RuntimeError as exc:
        if side.recipe.name == "fp32" or isinstance(exc, RecipeUnsupportedError):
            raise
        error = _recipe_error(side, spec, exc, device, patched)
        if error is None:
            raise
        raise error from exc


def check_runs(side: Side, spec: RunSpec, own_stream: bool) -> tuple[Callable[..., tuple], Callable[..., dict]]:
    """``(run, rerun)`` of a ``ParityCase.check``: ``run(device, patched, audited=False) -> (leaves,
    audit)`` runs ``spec`` (with its layer policy), ``rerun(device, patched, args, kwargs) -> leaves``
    with other inputs and no layer records (``CheckCall.rerun``). With ``own_stream`` (a sampling
    check under ``rng="device"``) each side draws from its own device's generators, the target's
    (patched runs) seeded with ``rng.target_seed``; else both from the shared stream."""

    def stream(patched: bool) -> tuple[str, int]:
        # device mode: each side its own generators; the target's stream independent of the
        # reference's (patched runs are the target's; a recording is the reference)
        if not own_stream:
            return "shared", spec.seed
        return "device", target_seed(spec.seed) if patched else spec.seed

    def run(device: torch.device, patched: bool, audited: bool = False) -> tuple:
        __tracebackhide__ = True
        return run_side(side, dataclasses.replace(spec, stream=stream(patched)), device, patched, audited)

    def rerun(device: torch.device, patched: bool, call_args: tuple, call_kwargs: dict) -> dict:
        again = dataclasses.replace(spec, args=call_args, kwargs=call_kwargs, stream=stream(patched), layers=None)
        return run_side(side, again, device, patched)[0]

    return run, rerun


def _fresh_args(args: tuple) -> tuple:
    return tuple(copy.deepcopy(a) if isinstance(a, torch.nn.Module) else a for a in args)


def _recipe_error(side: Side, spec: RunSpec, exc: BaseException, device: torch.device,
                  patched: bool) -> Exception | None:
    """A ``recipes.RecipeUnsupportedError`` for ``exc``, raised by a run under ``side.recipe``,
    when the same run passes under fp32; None when it fails under fp32 too (not the recipe's doing).

    Costs two extra runs, on this error path only: the fp32 run, and a re-run under the recipe with
    a dispatch mode that names the ATen op that raised (when the error is raised below PyTorch's
    Python dispatch key; a run under a dispatch mode may also take another path and pass, or the
    error may come from before dispatch: then the op is the call on the error's innermost line).
    A target's run (``patched``, with a patch set) costs a third: the run without the patch set on the
    CPU under the recipe, which tells a gap of the target's kernel or patch set from one of the recipe's.
    """
    try:
        fp32 = dataclasses.replace(side, recipe=RECIPES["fp32"])
        _call(fp32, dataclasses.replace(spec, args=_fresh_args(spec.args)), device, patched)
    except Exception:  # noqa: BLE001 - fails under fp32 too: the recipe is not the cause
        return None
    recorder = _RaisingOp()
    try:
        _call(side, dataclasses.replace(spec, args=_fresh_args(spec.args)), device, patched, audit=recorder)
    except Exception:  # noqa: BLE001 - expected: it raises again
        pass
    module, where, call = _error_site(exc)
    reference_runs = False
    if patched and side.patches is not None:  # the target's run: does the reference run it under the recipe?
        try:
            _call(side, dataclasses.replace(spec, args=_fresh_args(spec.args)), torch.device("cpu"), False)
            reference_runs = True
        except Exception:  # noqa: BLE001 - it does not: the recipe's gap, as said below
            pass
    return RecipeUnsupportedError(side.recipe.name, device, exc, op=recorder.op or call, module=module, where=where,
                                  reference_runs=reference_runs)


def _run_once(side: Side, spec: RunSpec, device: torch.device, patched: bool, audited: bool):
    """``run_side`` without the recipe diagnosis."""
    __tracebackhide__ = True
    audit = side.audit_factory(device) if audited else None
    if audit is not None and getattr(audit, "logical", False):
        leaves, _ = run_side(side, spec, device, patched)
        _call(side, dataclasses.replace(spec, args=_fresh_args(spec.args)), device, patched, audit=audit)
        return leaves, audit.to_dict()
    records: dict[str, torch.Tensor] | None = {} if spec.layers is not None else None
    leaves, entered = _call(side, spec, device, patched, audit=audit, layers=records, to_leaves=True)
    if records:
        leaves.update(records)
    return leaves, (entered.to_dict() if entered is not None and hasattr(entered, "to_dict") else None)


def _placed_call(side: Side, fn: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``fn`` with its module placed on ``device`` in the recipe's weights dtype (a function as it is)."""
    weights_dtype = side.recipe.weights_dtype
    module = owner_module(fn)
    if isinstance(fn, torch.nn.Module):
        return side.place(fn, device, weights_dtype)
    if module is not None:
        return getattr(side.place(module, device, weights_dtype), fn.__name__)
    return fn


def _call(side: Side, spec: RunSpec, device: torch.device, patched: bool, audit: Any = None,
          layers: dict | None = None, to_leaves: bool = False) -> tuple[Any, Any]:
    """Run ``spec.fn`` once on ``device`` under the recipe, the run's randomness and (if given)
    ``audit``; an audit with ``to_target`` (``audit.DeviceAudit``) places the module and inputs
    first. ``layers``: a dict that receives the run's layer records (``layers.capture_layers`` on
    the placed module, or on the first module among the arguments: a train step's copy).
    Returns ``(output, the entered audit or None)``; with ``to_leaves`` the output as CPU leaves by
    path (``_to_cpu_leaves``), taken before the modules' state is put back (``module_state.kept_state``)."""
    __tracebackhide__ = True
    weights_dtype = side.recipe.weights_dtype
    # the random functions before the patch set: those it replaces, the shared stream may stand in for
    before = random_functions() if patched and side.patches is not None else None
    with contextlib.ExitStack() as stack:
        # Patches first: a patch may edit weights or classes that placement then copies.
        if patched and side.patches is not None:
            applied = stack.enter_context(side.patches(device))
            names = getattr(applied, "applied", None)
            # A patch context that names no patches (a user's parity_patches override) is named
            # after its factory, so that the report never says "none" while patches ran.
            side.patches_applied.update(names if names is not None else (patch_factory_name(side.patches),))
            off = _SUSPENDED.get()
            if off:
                stack.enter_context(_suspend(applied, off, side.patches))
        elif not patched and side.reference_patches is not None:
            applied = stack.enter_context(side.reference_patches(device))
            names = getattr(applied, "applied", None)
            side.reference_patches_applied.update(
                names if names is not None else (patch_factory_name(side.reference_patches),))
        args = tuple(a.copy(device, weights_dtype) if isinstance(a, _CopyOnEntry) else side.recipe if a is RUN_RECIPE
                     else a for a in spec.args)
        call = _placed_call(side, spec.fn, device)
        args_d, kwargs_d = _move(args, device, weights_dtype), _move(spec.kwargs, device, weights_dtype)
        stack.enter_context(side.recipe.context(device) if spec.recipe_context else strict_fp32_flags())
        mode, stream_seed = spec.stream or ("shared", spec.seed)
        overridden = stack.enter_context(randomness(mode, stream_seed))
        stack.enter_context(torch.enable_grad() if spec.grad else torch.no_grad())
        if audit is not None and hasattr(audit, "to_target"):
            owner = owner_module(call)
            if owner is not None:
                audit.to_target(owner)
            args_d, kwargs_d = audit.to_target(args_d), audit.to_target(kwargs_d)
        # A module the next run is given again (not a fresh copy) starts it from the same buffers,
        # attributes and generators: put back after the audit has ended (the plugin's work, not the
        # computation's), and after the output's leaves are taken (a leaf may be a buffer the run changed).
        kept = stack.enter_context(kept_state(*state_owners(call)))
        with contextlib.ExitStack() as watched:
            if audit is not None:
                audit = watched.enter_context(audit)
            if layers is not None:
                root = owner_module(call) or next((a for a in args_d if isinstance(a, torch.nn.Module)), None)
                samples = getattr(spec.layers, "samples", None) or DEFAULT_SAMPLES
                captured = watched.enter_context(capture_layers(root, samples))
            output = call(*args_d, **kwargs_d)
        if to_leaves:
            output = _to_cpu_leaves(output, kept)
    if layers is not None:
        layers.update(captured)  # on the CPU once the capture has ended
    # after the audit: the comparison is not the computation's
    if before is not None and overridden is not None:  # the patch set's random functions the shared stream ran for
        side.stream_overrides.update(name for name in overridden.used if overridden.found.get(name) is not before[name])
    changed = side.input_changes.setdefault("target" if patched else "reference", set())
    found = changed_inputs((args, spec.kwargs), (args_d, kwargs_d))
    changed.update(path for path, _ in found)
    if to_leaves and found:  # what the run wrote into its inputs is compared like its outputs
        output = {**output, **inplace_leaves(found, output)}
    return output, audit


class _RaisingOp(TorchDispatchMode):
    """A dispatch mode that remembers the innermost ATen op that raised (``aten::index_add_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.op: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = True
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.op is None:
                schema = func._schema
                name = schema.name if "::" in schema.name else f"aten::{schema.name}"
                self.op = name + (f".{schema.overload_name}" if schema.overload_name else "")
            raise


def _error_module(exc: BaseException) -> tuple[str | None, Any]:
    """``(the innermost running module's label, the traceback's last entry)`` of ``exc``."""
    modules: list[torch.nn.Module] = []
    tb = exc.__traceback__
    last = None
    while tb is not None:
        frame = tb.tb_frame
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and (not modules or modules[-1] is not owner):
            modules.append(owner)
        last = tb
        tb = tb.tb_next
    module = None
    if modules:
        inner, root = modules[-1], modules[0]
        name = next((n for n, m in root.named_modules() if m is inner), None)
        label = type(inner).__name__
        module = f"{name} ({label})" if name else label
    return module, last


def _error_site(exc: BaseException) -> tuple[str | None, str | None, str | None]:
    """From ``exc``'s traceback: the innermost running module (``"layers.0 (TransformerEncoderLayer)"``,
    named inside the outermost module on the stack), the innermost source line (``torch/nn/...:921``,
    a path below site-packages shortened to the package) and the call on that line
    (``torch._transformer_encoder_layer_fwd``; the line's code in backticks when it holds several
    calls), each None when unknown."""
    module, last = _error_module(exc)
    if last is None:
        return module, None, None
    filename, line = last.tb_frame.f_code.co_filename, last.tb_lineno
    shown = filename
    marker = f"{os.sep}site-packages{os.sep}"
    if marker in filename:
        shown = filename.rsplit(marker, 1)[1]
    else:
        try:
            rel = os.path.relpath(filename)
            shown = filename if rel.startswith(os.pardir) else rel
        except ValueError:
            pass
    code = linecache.getline(filename, line).strip().split("  #")[0].rstrip()  # without an inline comment
    calls = [c for c in re.findall(r"([A-Za-z_][\w.]*)\s*\(", code) if c not in ("return", "print")]
    if len(calls) == 1:
        call = calls[0]
    else:  # several calls on the line (or none): which one raised is not known, show the line
        call = f"`{code if len(code) <= 80 else code[:77] + '...'}`" if code else None
    return module, f"{shown}:{line}", call


def patch_factory_name(factory: Any) -> str:
    """``module.qualname`` of a patch factory (``<locals>.`` left out), e.g.
    ``test_model.parity_patches.corrupt``: how the report names a patch set that names no patches."""
    qualname = getattr(factory, "__qualname__", None) or type(factory).__qualname__
    module = getattr(factory, "__module__", None) or type(factory).__module__
    name = qualname.replace("<locals>.", "")
    return f"{module}.{name}" if module else name


def target_audit(device: torch.device) -> Any:
    """The device-propagation audit of a target run (``--parity-audit``): an ``audit.DeviceAudit``.

    An accelerator target (``npu:0``, ``cuda:0``) is audited in real-device mode. A CPU target has no
    device boundary, so its runs are audited as the *logical* device ``audit.DEFAULT_LOGICAL_TARGET``
    (``cuda:1``) over CPU tensors: what an accelerator would see, measured on this machine.

    Raises:
        ValueError: as ``DeviceAudit`` (a device that is not available here).
    """
    if torch.device(device).type == "cpu":
        return DeviceAudit(DEFAULT_LOGICAL_TARGET, logical=True)
    return DeviceAudit(device, logical=False)


#: Names of the patches that patched runs turn off again inside ``patches_suspended`` (empty: none).
_SUSPENDED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("npu_parity_patches_suspended",
                                                                              default=())


@contextlib.contextmanager
def patches_suspended(names: Iterable[str]) -> Iterator[None]:
    """Inside the block, each patched run enters its patch set and then turns the patches ``names`` off
    again: the object the patch context returned must offer ``suspended(*names)``, a context manager
    (``aurora.patches.PatchSet.suspended``). Outside the block nothing changes.

    Raises (at the patched run, not here):
        TypeError: the patch context returned an object without ``suspended``; the message names the
            patch factory.
        Whatever ``suspended`` raises for a name it did not apply.
    """
    token = _SUSPENDED.set(tuple(names))
    try:
        yield
    finally:
        _SUSPENDED.reset(token)


def _suspend(applied: Any, names: tuple[str, ...], factory: Any) -> ContextManager[Any]:
    suspend = getattr(applied, "suspended", None)
    if suspend is None:
        raise TypeError(f"the patch set of {patch_factory_name(factory)} cannot turn single patches off: the object "
                        f"its context returns ({type(applied).__name__}) has no suspended(*names) context manager")
    return suspend(*names)


@contextlib.contextmanager
def no_patches(device: torch.device) -> Iterator[None]:
    """A patch factory that applies nothing."""
    yield

"""One more run of the check on the target that captures the culprit's inputs and outputs (and, for
the ``ops`` replay, every aten op it dispatched), and the reference run of the piece on those inputs."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
try:  # present in every supported torch (a private name, hence the fallback)
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError:  # pragma: no cover
    _disable_current_modes = contextlib.nullcontext

from ..localize.sides import _rng_state, _mode_state, _Side, _snapshot, _to_device
from .culprit import Culprit, MAX_OPS, ReproUnsupported


def _literal(value: Any) -> bool:
    """A constructor argument the script can write down: None, bool, int, str, finite float, or a
    tuple/list of those."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (tuple, list)):
        return all(_literal(v) for v in value)
    return False


def _encode_plain(value: Any, tensor: Callable[[torch.Tensor], Any]) -> Any:
    """JSON form of an argument; ``tensor(t)`` gives a tensor's reference (``{"$t": …}`` …).

    Raises:
        ReproUnsupported: a value the script cannot rebuild (an object, a complex number).
    """
    if isinstance(value, torch.Tensor):
        return tensor(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": 1}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"$mf": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"$tuple": [_encode_plain(v, tensor) for v in value]}
    if isinstance(value, list):
        return [_encode_plain(v, tensor) for v in value]
    if isinstance(value, Mapping):
        return {"$dict": {str(k): _encode_plain(v, tensor) for k, v in value.items()}}
    raise ReproUnsupported(f"an argument of type {type(value).__name__} ({str(value)[:60]}) cannot be written "
                           "into a standalone script")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _leaf_tensors(obj: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of a nested output, named as the script's ``leaves`` names them."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    found: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            found += _leaf_tensors(value, f"{prefix}[{i}]")
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            found += _leaf_tensors(value, f"{prefix}.{key}")
    return found


def _cpu(t: torch.Tensor) -> torch.Tensor:
    with _disable_current_modes():
        t = t.detach()
        if getattr(t, "is_nested", False) or t.layout != torch.strided:
            raise ReproUnsupported("a nested or sparse tensor cannot be stored in safetensors")
        return t.to("cpu", copy=True).contiguous()


class _OpRecorder(TorchDispatchMode):
    """Records the ops of one call (``want``: only op number ``want``; None: every op), each with its
    arguments encoded (``_encode_plain``) and the CPU copies of the tensors it did not get from an
    earlier recorded op (copied before it runs: an in-place op overwrites its input)."""

    def __init__(self, want: int | None, names: dict[int, str], weight_ids: dict[int, str]):
        super().__init__()
        self.want = want
        self.count = 0
        self.ops: list[dict[str, Any]] = []
        self.tensors: dict[str, torch.Tensor] = {}  # inputs.safetensors (args.*, kwargs.*, const.*, arg.*)
        self.weights_used: set[str] = set()
        self.names = names  # id -> args.<i> / kwargs.<k> of the call's input tensors
        self.weight_ids = weight_ids  # id -> state_dict name
        self.produced: dict[int, tuple[int, int]] = {}
        self.keep: list[torch.Tensor] = []  # holds every tensor seen, so no id is reused meanwhile
        self.actual: dict[str, torch.Tensor] = {}
        self.random = False
        self.error: str | None = None
        self.outputs: dict[str, Any] = {}  # the call's output leaves as references ($o, $t, $w)

    def _ref(self, t: torch.Tensor, single: bool) -> dict[str, Any]:
        self.keep.append(t)
        if single:
            key = f"arg.{len(self.tensors)}"
            self.tensors[key] = _cpu(t)
            return {"$t": key}
        hit = self.produced.get(id(t))
        if hit is not None:
            return {"$o": list(hit)}
        name = self.weight_ids.get(id(t))
        if name is not None:
            self.weights_used.add(name)
            return {"$w": name}
        key = self.names.get(id(t))
        if key is None:
            key = f"const.{sum(1 for k in self.tensors if k.startswith('const.'))}"
            self.names[id(t)] = key
        if key not in self.tensors:
            self.tensors[key] = _cpu(t)
        return {"$t": key}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        i = self.count
        self.count += 1
        record = self.error is None and (self.want is None or i == self.want)
        if record and self.want is None and len(self.ops) >= MAX_OPS:
            self.error = f"the call dispatches more than {MAX_OPS} ops"
            record = False
        entry = None
        if record:
            single = self.want is not None
            try:
                with _disable_current_modes():
                    entry = {"op": [func.namespace, func._schema.name.split("::")[-1], func._overloadname],
                             "args": _encode_plain(list(args), lambda t: self._ref(t, single)),
                             "kwargs": {"$dict": {k: _encode_plain(v, lambda t: self._ref(t, single))
                                                  for k, v in kwargs.items()}}}
            except ReproUnsupported as exc:
                self.error = f"op {func}: {exc}"
                entry = None
            if entry is not None and torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                self.random = True
        out = func(*args, **kwargs)
        if entry is not None:
            j = len(self.ops)
            self.ops.append(entry)
            for k, t in enumerate(_tensors(out)):
                self.keep.append(t)
                self.produced[id(t)] = (j, k)
            if self.want is not None:
                with _disable_current_modes():
                    self.actual = {f"output[{k}]" if len(_tensors(out)) > 1 else "output": _cpu(t)
                                   for k, t in enumerate(_tensors(out))}
        return out


class _OpNames(TorchDispatchMode):
    """The names of the ops dispatched while it is on (``aten._softmax.default`` …)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@dataclass
class _Capture:
    """What the target's run of the check gave the culprit's call."""

    inputs: Any = None  # (args, kwargs) snapshot (localize._snapshot)
    rng: tuple | None = None
    state: tuple | None = None
    actual: dict[str, torch.Tensor] = field(default_factory=dict)
    output: Any = None
    recorder: _OpRecorder | None = None
    calls: int = 0
    op_names: _OpNames | None = None  # the ops the call dispatched (a module culprit's probe)


def _input_names(args: tuple, kwargs: dict) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    """id -> name and name -> tensor of the call's tensor inputs (``args.<i>``, ``kwargs.<key>``,
    nested ones with ``.<j>`` appended)."""
    ids: dict[int, str] = {}
    named: dict[str, torch.Tensor] = {}

    def walk(obj: Any, name: str) -> None:
        if isinstance(obj, torch.Tensor):
            ids.setdefault(id(obj), name)
            named[name] = obj
        elif isinstance(obj, (tuple, list)):
            for j, v in enumerate(obj):
                walk(v, f"{name}.{j}")
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, f"{name}.{k}")

    for i, a in enumerate(args):
        walk(a, f"args.{i}")
    for k, v in kwargs.items():
        walk(v, f"kwargs.{k}")
    return ids, named


def _capture_target(case: Any, call: Any, culprit: Culprit, ops: bool) -> _Capture:
    """Run the check once on the target (``localize._Side``: patch set, recipe, shared random stream)
    and take the culprit call's inputs, random/mode state and outputs; with ``ops``, record its aten
    ops (all of them, or the culprit op alone)."""
    side = _Side(case, call, case.target, patched=True)
    got = _Capture()
    with side.running() as root:
        module = root.get_submodule(culprit.name) if culprit.name else root
        weight_ids = {id(t): n for n, t in list(module.named_parameters()) + list(module.named_buffers())}

        def pre(mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            got.calls += 1
            if got.calls - 1 != culprit.index:
                return
            got.inputs = _snapshot((args, kwargs))
            got.rng, got.state = _rng_state(), _mode_state(side.device.type)
            if ops:
                names, _ = _input_names(args, kwargs)
                got.recorder = _OpRecorder(culprit.op_index, names, weight_ids)
                got.recorder.__enter__()
            else:
                got.op_names = _OpNames()
                got.op_names.__enter__()

        def post(mod: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if got.calls - 1 != culprit.index or got.output is not None:
                return
            for mode in (got.recorder, got.op_names):
                if mode is not None:
                    mode.__exit__(None, None, None)
            got.output = output
            got.actual = {k: _cpu(t) for k, t in _leaf_tensors(output)}
            if ops and culprit.op_index is None and got.recorder.error is None:
                got.recorder.outputs = {k: _encode_plain(t, lambda x: got.recorder._ref(x, False))
                                        for k, t in _leaf_tensors(output)}

        handles = [module.register_forward_pre_hook(pre, with_kwargs=True),
                   module.register_forward_hook(post, with_kwargs=True)]
        try:
            side.run_root(root)
        finally:
            for h in handles:
                h.remove()
            for mode in (got.recorder, got.op_names):
                if mode is not None and got.output is None:
                    mode.__exit__(None, None, None)
    if got.inputs is None:
        raise ReproUnsupported(f"{culprit.display} was not called {culprit.index + 1} time(s) when the check ran "
                               "again on the target")
    return got


def _reference(case: Any, call: Any, culprit: Culprit, got: _Capture) -> tuple[dict, dict, dict, list[str]]:
    """(expected leaves, state_dict, every parameter and buffer by name, op names) of the culprit
    module: the reference side (CPU, no patch set) run on the target's inputs of the call, in the
    call's random and grad/autocast state. The third also holds non-persistent buffers (an op replay
    may use them); the last lists the ops the run dispatched."""
    side = _Side(case, call, torch.device("cpu"), patched=False)
    with side.running(got.rng, got.state) as root:
        module = root.get_submodule(culprit.name) if culprit.name else root
        args, kwargs = _to_device(got.inputs, torch.device("cpu"))
        with _OpNames() as names:
            out = module(*args, **kwargs)
        weights = {k: _cpu(v) for k, v in module.state_dict(keep_vars=False).items()}
        named = {k: _cpu(v) for k, v in list(module.named_parameters()) + list(module.named_buffers())}
    return {k: _cpu(t) for k, t in _leaf_tensors(out)}, weights, named, names.names


def _first_difference(target: list[str], reference: list[str]) -> str | None:
    """Where two op sequences part (``"op #7: aten._to_copy.default on the target, aten._softmax.default
    on the reference"``), or None when they are the same."""
    for i, (t, r) in enumerate(zip(target, reference)):
        if t != r:
            return f"op #{i}: {t} on the target, {r} on the reference"
    if len(target) != len(reference):
        return f"the target dispatched {len(target)} ops, the reference {len(reference)}"
    return None


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64) if value.is_floating_point() else value
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    if isinstance(value, (tuple, list)):
        return type(value)(_upcast(v) for v in value)
    return value


def _op_reference(culprit: Culprit, recorder: _OpRecorder) -> tuple[dict, dict]:
    """(expected, golden) of an op culprit: the op on the CPU from its stored inputs, in their dtype
    and in float64 (the op trace's golden; {} where float64 fails for it)."""
    entry = recorder.ops[0]
    namespace, name, overload = entry["op"]
    func = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    args = _decode(entry["args"], recorder.tensors)
    kwargs = _decode(entry["kwargs"], recorder.tensors)
    with _disable_current_modes():
        outs = _tensors(func(*args, **kwargs))
        names = [f"output[{k}]" if len(outs) > 1 else "output" for k in range(len(outs))]
        expected = {n: _cpu(t) for n, t in zip(names, outs)}
        try:
            golden = {f"golden.{n}": _cpu(t) for n, t in zip(names, _tensors(func(*_upcast(args), **_upcast(kwargs))))}
        except Exception:  # noqa: BLE001 - an op without a float64 kernel: no golden
            golden = {}
    return expected, golden


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The script's ``decode`` for one op's CPU arguments (``$t`` only; no earlier ops)."""
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "$t" in value:
        return tensors[value["$t"]].clone()
    if "$dtype" in value:
        return getattr(torch, value["$dtype"])
    if "$device" in value:
        return torch.device("cpu")
    if "$layout" in value:
        return getattr(torch, value["$layout"])
    if "$mf" in value:
        return getattr(torch, value["$mf"])
    if "$float" in value:
        return float(value["$float"])
    if "$tuple" in value:
        return tuple(_decode(v, tensors) for v in value["$tuple"])
    if "$dict" in value:
        return {k: _decode(v, tensors) for k, v in value["$dict"].items()}
    raise ReproUnsupported(f"cannot decode {value!r}")


# --------------------------------------------------------------------------------------------
# rebuilding a module



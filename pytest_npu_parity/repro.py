"""A repro to hand over to an op owner: the failing piece of a check, its inputs and expected outputs.

For a check out of tolerance, ``ReproWriter`` (a ``ParitySession`` failure hook placed after the
``localize.Localizer``; the plugin's ``--parity-repro DIR``) writes ``DIR/<test id>/<check>/``:

* ``inputs.safetensors`` — the inputs of the *culprit* exactly as the target received them (detached
  CPU copies taken in a run of the check on the target, under its patch set, recipe and random
  stream): the culprit is the op the op trace named (``Localization.op_trace``, a ``local`` verdict:
  a kernel that misses its dtype's accuracy), else the first diverging submodule of the localization,
  else the check's whole module;
* ``weights.safetensors`` — for a module culprit, its ``state_dict`` as the reference ran it (the
  model's own weights, not a target-side edit of them);
* ``expected.safetensors`` — the reference's outputs of that piece *on those same inputs* (a CPU run
  without the patch set: for a module, the module; for an op, the op in its own dtype) plus, for an
  op, its float64 golden (``golden.<leaf>``, the op re-run on float64 copies of its inputs, as the
  op trace judges it). Because the reference runs on the target's inputs, the repro measures the
  piece's own (local) error, not what it inherited from earlier layers;
* ``actual.safetensors`` — the target's own outputs of the piece in that run (the recorded verdict);
* ``repro.py`` — a standalone script (``repro_script.SCRIPT``; torch only) that replays the piece on
  ``--device`` and prints (a) the stored target outputs vs expected and (b) the piece re-run vs
  expected, with the project's metrics and the check's tolerance; exit code 1 on a mismatch of (b);
* ``README.md`` — what failed, the commands, the tolerance, the culprit and why it was chosen, the
  provenance (torch version, target, recipe), the verdict of the script's replay on the CPU while the
  repro was written (a FAIL there: the replayed computation itself differs, its code or what it asks
  for, not a device kernel), and anything the repro cannot reproduce.

How the piece is replayed (``spec["mode"]``):

* ``module`` — rebuilt from ``type(m).__module__`` and ``__qualname__`` with constructor arguments
  read off the instance (``_constructor_kwargs``: every ``__init__`` parameter found as an attribute
  of the same name holding a literal; a tensor-or-None attribute for a boolean parameter, such as
  ``Linear.bias``, becomes ``bias is not None``), ``load_state_dict(strict=True, assign=True)``, run
  under the recipe's autocast. The rebuild is accepted only when the target dispatched the same ops
  in its call as the reference module did (a patch set that swaps the module's code — a fused device
  attention, a softmax moved to float16 — makes the target run something the class does not), and
  when the generated script itself, run here on the CPU, reproduces the reference's outputs bitwise
  (``_verify``), so the arguments found are the ones it was built with;
* ``ops`` — otherwise (a class defined inside a function, a constructor argument that is not a
  literal, a patch set that changes the module's ops, a rebuild that computes something else, an op
  culprit): the aten ops of the piece's call
  recorded under a ``TorchDispatchMode`` and replayed one by one as
  ``torch.ops.<namespace>.<op>.<overload>``; tensors an op did not get from an earlier op are stored
  (the call's inputs as ``args.<i>``/``kwargs.<name>``, the module's parameters and buffers by name
  in ``weights.safetensors``, anything else as ``const.<n>``, copied before the op runs). This always
  replays what the target was asked to compute; the README of a module that could not be rebuilt
  says why.

Cost: one more run of the check on the target (hooks only on the culprit; the dispatch mode only
inside its call) and one CPU run of the culprit, plus writing the tensors; see
docs/how-to/localize-failure.md for the measured numbers. Checks that pass never reach it.

Not replayed: train steps, checks of free functions and of bound methods (``generate``) without a
diverging submodule, and pieces whose inputs or weights exceed ``max_bytes``; the failure message
then says why. Files are written to a temporary folder next to the final one and renamed into
place, so a reader never sees half a repro.
"""
from __future__ import annotations

import ast
import contextlib
import datetime
import hashlib
import importlib
import inspect
import json
import math
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:  # present in every supported torch (a private name, hence the fallback)
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError:  # pragma: no cover
    _disable_current_modes = contextlib.nullcontext  # type: ignore[assignment]

from .localize import _rng_state, _mode_state, _Side, _snapshot, _to_device, output_leaves
from .repro_script import SCRIPT

#: Inputs plus weights a repro may hold, bytes (a larger culprit gets a README saying so, no tensors).
DEFAULT_MAX_BYTES = 512 * 2**20
#: Ops one ``ops`` replay may record.
MAX_OPS = 20000
#: Longest folder name made from a test id or check name (longer ones are cut and get a hash).
MAX_NAME = 100


class ReproUnsupported(Exception):
    """The piece cannot be written as a repro (the message says why)."""


@dataclass
class Culprit:
    """The piece a repro replays.

    Attributes:
        name: its module's path inside the check's module (``""``: the module itself); ``index``:
            which call of it (0-based), as ``#k`` in the localization table.
        display: how the report names it (``blocks.2.b``, ``attn: aten._softmax.default``).
        why: the sentence saying why it was chosen.
        op: for an op culprit, ``(namespace, name, overload)``; ``op_index``: its place among the
            ops dispatched in the module call (the op trace's ``#``).
    """

    name: str
    index: int
    display: str
    why: str
    op: tuple[str, str, str] | None = None
    op_index: int | None = None


def sanitize(text: str) -> str:
    """A folder name from a test id or check name: characters other than ``[A-Za-z0-9._-]`` become
    ``_``; a name longer than ``MAX_NAME`` is cut and ends in 8 hex digits of its SHA-1."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "_"
    if len(name) > MAX_NAME:
        name = name[:MAX_NAME - 9] + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
    return name


def repro_dir(root: Path, test_id: str, check: str) -> Path:
    """``root/<sanitized test id>/<sanitized check>``."""
    return Path(root) / sanitize(test_id) / sanitize(check)


# --------------------------------------------------------------------------------------------
# which piece


def _split_site(path: str, prefix: str) -> tuple[str, int]:
    """(module path inside the check's module, call index) of a localization row's ``submodule``
    (``prefix.name#k``; ``<Type>`` for the module itself)."""
    index = 0
    match = re.fullmatch(r"(.*)#(\d+)", path)
    if match:
        path, index = match.group(1), int(match.group(2))
    if path.startswith("<"):
        return "", index
    if prefix and path == prefix:
        return "", index
    if prefix and path.startswith(prefix + "."):
        path = path[len(prefix) + 1:]
    return path, index


def choose_culprit(record: Any, call: Any) -> Culprit | None:
    """The piece to replay, from the localization the ``Localizer`` left in ``record.localized``:
    the first culprit op of the op trace with a ``local`` verdict (a kernel beyond its dtype's
    budget), else the first diverging submodule, else the check's whole module (None for a check of
    a function, or of a bound method without a diverging submodule)."""
    if call.module is None:
        return None
    prefix = record.submodule or ""
    rows = record.localized.localization or []
    first = next((r for r in rows if r.get("kind") == "activation" and r.get("first_divergence")), None)
    name, index = _split_site(first["submodule"], prefix) if first else ("", 0)
    where = first["submodule"] if first else (prefix or f"<{type(call.module).__name__}>")
    bound = not isinstance(call.fn, torch.nn.Module)
    op_row = next((r for r in record.localized.localization_ops or [] if r.get("first_op")), None)
    if op_row is not None and op_row.get("verdict") == "local" and not (bound and first is None):
        namespace, _, op = op_row["op"].partition(".")
        return Culprit(name, index, f"{where}: {op_row['op']}.{op_row['overload']}",
                       f"the op trace named {op_row['op']}.{op_row['overload']} (op #{op_row['op_index']} of "
                       f"{where}, in {op_row['module']}) as the first op whose own error is beyond its "
                       f"{op_row['dtype']} budget", (namespace, op, op_row["overload"]), int(op_row["op_index"]))
    if first is not None:
        return Culprit(name, index, where, f"the localization named {where} ({first.get('module_type')}) as the "
                                           f"first diverging submodule (verdict {first.get('verdict')})")
    if bound:
        return None
    why = ("no submodule diverges locally: the difference starts in the check's module itself"
           if record.localized.localization is not None
           else "no localization ran for this check: the whole checked module is replayed")
    return Culprit("", 0, where, why)


# --------------------------------------------------------------------------------------------
# encoding arguments (the script's ``decode`` reads them back)


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


def _class_path(module: torch.nn.Module) -> tuple[str, str]:
    """(import path, qualname) of ``module``'s class, checked to import back to that class.

    Raises:
        ReproUnsupported: defined inside a function, in ``__main__``, or not importable by that path.
    """
    cls = type(module)
    path, qual = cls.__module__, cls.__qualname__
    if "<locals>" in qual:
        raise ReproUnsupported(f"its class {qual} is defined inside a function, so no import path reaches it")
    if path == "__main__":
        raise ReproUnsupported(f"its class {qual} is defined in the __main__ script, which a repro cannot import")
    try:
        obj: Any = importlib.import_module(path)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 - any import problem means: not rebuildable by path
        raise ReproUnsupported(f"{path}.{qual} does not import ({type(exc).__name__}: {exc})") from None
    if obj is not cls:
        raise ReproUnsupported(f"{path}.{qual} imports another object than the module's class")
    return path, qual


def _constructor_kwargs(module: torch.nn.Module) -> dict[str, Any]:
    """The constructor arguments of ``module`` read off the instance (module doc).

    Raises:
        ReproUnsupported: a required parameter with no attribute of its name, or one holding
            something other than a literal.
    """
    try:
        params = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError) as exc:
        raise ReproUnsupported(f"its constructor has no signature to read ({exc})") from None
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        has_default = p.default is not inspect.Parameter.empty
        if p.name in ("device", "dtype") and has_default:
            continue  # the weights loaded with assign=True carry both
        if hasattr(module, p.name) and not isinstance(getattr(module, p.name), torch.nn.Module):
            value = getattr(module, p.name)
            if isinstance(p.default, bool) and (value is None or isinstance(value, torch.Tensor)):
                value = value is not None  # Linear(bias=True) keeps its bias Parameter (or None)
            if _literal(value) and ast.literal_eval(repr(value)) == value:
                kwargs[p.name] = value
                continue
            if not has_default:
                raise ReproUnsupported(f"its constructor argument {p.name!r} is a {type(value).__name__}, not a "
                                       "literal the script can write down")
        elif not has_default:
            raise ReproUnsupported(f"its constructor argument {p.name!r} is not kept as an attribute of the module, "
                                   "so its value cannot be found")
    return kwargs


# --------------------------------------------------------------------------------------------
# writing


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _nbytes(*groups: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for g in groups for t in g.values())


def _recorded_note(actual: dict, expected: dict, tol: Any) -> list[str]:
    """A note when the target's recorded outputs of the piece agree with the expected ones under the
    check's tolerance: the piece alone does not show the failure (the difference it inherited from
    earlier layers, or another call of a module that runs several times, carried it)."""
    from .compare import compare

    plain = {k: v for k, v in expected.items() if not k.startswith("golden.")}
    if not plain or compare(actual, plain, tol).passed:
        return ["the target's recorded outputs of this piece are within the check's tolerance of the expected "
                "ones: run alone on the inputs the target gave it, the piece does not show the failure (what it "
                "inherited from earlier layers, or another call of it, did); the localization table says more"]
    return []


def script_text(spec: dict[str, Any]) -> str:
    """``repro.py`` for ``spec``: ``repro_script.SCRIPT`` with the spec as a raw JSON string literal (JSON
    escapes every quote inside its strings and puts separators between tokens, so it never holds the
    three quotes that would end the literal)."""
    return SCRIPT.replace("__SPEC__", 'r"""' + json.dumps(spec, indent=1, ensure_ascii=True) + '"""')


def _failure_line(record: Any) -> str:
    """One sentence on the check's failure: its worst leaf's numbers."""
    text = f"Parity check `{record.check}` failed (recipe {record.recipe}, target {record.target} vs {record.reference})"
    failures = record.result.failures if record.result is not None else []
    if failures:
        worst = max(failures, key=lambda leaf: leaf.err_ratio if not math.isnan(leaf.err_ratio) else math.inf)
        text += (f": worst leaf `{worst.path or '<output>'}` max_abs {worst.max_abs:.3g}, rel_l2 {worst.rel_l2:.3g}, "
                 f"{worst.mismatched}/{worst.numel} elements out of tolerance, err/tol {worst.err_ratio:.3g}")
    return text


def _fmt_tol(tol: Any) -> str:
    return f"rtol={tol.rtol:g} atol={tol.atol:g} budget={tol.budget:g}"


def _script_namespace(path: Path) -> dict[str, Any]:
    """The generated script loaded as a module (its ``main`` not run), to replay it here."""
    namespace: dict[str, Any] = {"__name__": "parity_repro", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - our own generated script
    return namespace


def _verify(folder: Path, expected: dict[str, torch.Tensor], tol: Any) -> tuple[str | None, str]:
    """Run the script's replay on the CPU here: (None when it gives ``expected`` bitwise, else why not;
    a README note with its verdict under ``tol``)."""
    from .compare import compare

    try:
        outputs = _script_namespace(folder / "repro.py")["replay"]("cpu")
    except Exception as exc:  # noqa: BLE001 - a rebuild that does not run is not a rebuild
        why = f"the replay raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return why, f"replayed on the CPU while this repro was written: {why}"
    plain = {k: v for k, v in expected.items() if not k.startswith("golden.")}
    verdict = compare({k: outputs.get(k) for k in plain}, plain, tol).passed
    note = ("replayed on the CPU while this repro was written: " + ("PASS (a correct device matches the reference)"
            if verdict else "FAIL — the replayed computation itself differs from the reference's (its code or "
            "what it asks for, not a device kernel)"))
    for key, want in plain.items():
        got = outputs.get(key)
        if got is None or got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got.cpu(), want):
            return (f"the module rebuilt from the arguments found computes another {key} than the reference's "
                    "(its constructor arguments are not all kept as attributes)"), note
    return None, note


class ReproWriter:
    """The ``ParitySession`` failure hook that writes a repro of each failing check (module doc).

    Put it after the ``localize.Localizer`` in ``failure_hooks``: it reads the localization that hook
    left in ``record.localized`` (a check that was not localized replays its whole module).

    Args:
        root: the folder (created when missing); each check gets ``root/<test id>/<check>/``.
        hint: the command that reruns one check, with ``{test_id}`` (for the README), or None.
        max_bytes: inputs plus weights a repro may store (``DEFAULT_MAX_BYTES``).

    Attributes:
        written: ``{(test_id, check): folder}`` of the repros written (the report's ``repro`` column).
        seconds: wall seconds spent writing repros.

    Raises:
        ValueError: ``root`` exists and is not a folder.
    """

    def __init__(self, root: str | os.PathLike, *, hint: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"repro folder {self.root} is a file; give a folder (created when missing)")
        self.hint = hint
        self.max_bytes = max_bytes
        self.written: dict[tuple[str, str], str] = {}
        self.seconds = 0.0

    def __call__(self, case: Any, record: Any, call: Any, result: Any) -> str | None:
        start = time.perf_counter()
        try:
            folder = self.write(case, record, call)
        except ReproUnsupported as exc:
            return f"(No repro written: {exc}.)"
        finally:
            self.seconds += time.perf_counter() - start
        if folder is None:
            return None
        self.written[(record.test_id, record.check)] = str(folder)
        return (f"Repro for the op owner: {folder} (python {folder / 'repro.py'} --device <device>; "
                "README.md there says what it replays)")

    def write(self, case: Any, record: Any, call: Any) -> Path | None:
        """Write the repro of ``record``'s check; its folder, or None where there is nothing to replay.

        Raises:
            ReproUnsupported: a train step, a piece beyond ``max_bytes``, an argument that cannot
                be stored.
        """
        if call is None:
            return None
        if call.kind != "check":
            raise ReproUnsupported("train steps are not replayed as repros (the failure names the first "
                                   "diverging gradient or buffer)")
        culprit = choose_culprit(record, call)
        if culprit is None:
            if call.module is None:
                raise ReproUnsupported("the check runs a function, not a module, so there is no piece to replay")
            raise ReproUnsupported("the check runs a bound method and no submodule of it diverges, so there is "
                                   "no module call to replay")
        notes: list[str] = []
        module_note: str | None = None
        if culprit.op is not None:
            got = _capture_target(case, call, culprit, ops=True)
            rec = got.recorder
            if rec is None or not rec.ops:
                raise ReproUnsupported(f"op #{culprit.op_index} of {culprit.name or 'the module'} was not dispatched "
                                       "when the check ran again")
            if rec.error:
                raise ReproUnsupported(rec.error)
            recorded = tuple(rec.ops[0]["op"])
            if recorded != culprit.op:
                raise ReproUnsupported(f"op #{culprit.op_index} was {'.'.join(recorded)} when the check ran again, "
                                       f"not {'.'.join(culprit.op)}")
            expected, golden = _op_reference(culprit, rec)
            spec = {"mode": "ops", "ops": rec.ops,
                    "outputs": {k: {"$o": [0, i]} for i, k in enumerate(expected)}}
            inputs, weights, actual = rec.tensors, {}, rec.actual
            expected = {**expected, **golden}
        else:
            root = _Side(case, call, torch.device("cpu"), patched=False).root()
            module = root.get_submodule(culprit.name) if culprit.name else root
            held = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
            if held > self.max_bytes:  # before any run: a whole model's weights are known up front
                raise ReproUnsupported(f"the weights of {culprit.display} take {held / 2**20:.0f} MiB, more than the "
                                       f"{self.max_bytes / 2**20:.0f} MiB a repro may hold")
            probe = _capture_target(case, call, culprit, ops=False)
            expected, weights, named_weights, reference_ops = _reference(case, call, culprit, probe)
            parted = _first_difference(probe.op_names.names if probe.op_names else [], reference_ops)
            autocast = str(probe.state[2]).removeprefix("torch.") if probe.state and probe.state[1] else None
            args, kwargs = probe.inputs
            ids, named = _input_names(args, kwargs)
            inputs, actual = {k: _cpu(t) for k, t in named.items()}, probe.actual
            spec = None
            try:
                if parted is not None:
                    raise ReproUnsupported("the patch set changes what it computes on the target (its ops part at "
                                           f"{parted}), so the module's own class would not run what the target ran")
                path, qual = _class_path(module)
                ctor = _constructor_kwargs(module)
                encode = lambda t: {"$t": ids[id(t)]}  # noqa: E731
                spec = {"mode": "module", "module": {
                    "module": path, "qualname": qual, "kwargs": _encode_plain(ctor, encode),
                    "training": module.training, "autocast": autocast,
                    "eval_children": [n for n, m in module.named_modules() if n and not m.training],
                    "args": _encode_plain(list(args), encode), "kwargs_call": _encode_plain(dict(kwargs), encode)}}
            except ReproUnsupported as exc:
                module_note = f"{culprit.display} ({type(module).__name__}) cannot be rebuilt standalone: {exc}"
            if self._too_big(inputs, weights):
                raise ReproUnsupported(f"its inputs and weights take {_nbytes(inputs, weights) / 2**20:.0f} MiB, more "
                                       f"than the {self.max_bytes / 2**20:.0f} MiB a repro may hold")
            if spec is not None:
                spec["grad"] = bool(call.grad)
                folder = self._commit(record, case, culprit, spec, inputs, weights, expected, actual,
                                      notes + _recorded_note(actual, expected, record.tolerance), None, bitwise=True)
                if isinstance(folder, Path):
                    return folder
                module_note = f"{culprit.display} ({type(module).__name__}) cannot be rebuilt standalone: {folder}"
            got = _capture_target(case, call, culprit, ops=True)
            rec = got.recorder
            if rec.error:
                raise ReproUnsupported(f"{module_note}; and its ops cannot be replayed: {rec.error}")
            spec = {"mode": "ops", "ops": rec.ops, "outputs": rec.outputs}
            inputs = rec.tensors
            weights = {k: v for k, v in named_weights.items() if k in rec.weights_used}
            if rec.random:
                notes.append("the piece draws random numbers (dropout, sampling); the replayed ops draw from this "
                             "torch's own generator, so their outputs differ from the recorded ones")
        if self._too_big(inputs, weights):
            raise ReproUnsupported(f"its inputs and weights take {_nbytes(inputs, weights) / 2**20:.0f} MiB, more "
                                   f"than the {self.max_bytes / 2**20:.0f} MiB a repro may hold")
        spec["grad"] = bool(call.grad)
        notes += _recorded_note(actual, expected, record.tolerance)
        folder = self._commit(record, case, culprit, spec, inputs, weights, expected, actual, notes, module_note)
        assert isinstance(folder, Path)
        return folder

    def _too_big(self, inputs: dict, weights: dict) -> bool:
        return _nbytes(inputs, weights) > self.max_bytes

    def _commit(self, record: Any, case: Any, culprit: Culprit, spec: dict, inputs: dict, weights: dict,
                expected: dict, actual: dict, notes: list[str], module_note: str | None,
                bitwise: bool = False) -> Path | str:
        """Write the files into a temporary folder beside the final one, replay the script there on the
        CPU (its verdict goes into the README), then rename the folder into place. With ``bitwise`` (a
        module rebuild) a replay that does not give ``expected`` bitwise publishes nothing: the reason
        is returned instead of the folder."""
        final = repro_dir(self.root, record.test_id, record.check)
        final.parent.mkdir(parents=True, exist_ok=True)
        tol = record.tolerance
        spec = dict(spec, check=record.check, test_id=record.test_id, target=str(case.target),
                    piece=culprit.display, tolerance={"rtol": tol.rtol, "atol": tol.atol, "budget": tol.budget})
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        umask = os.umask(0)
        os.umask(umask)
        try:
            _save(tmp / "inputs.safetensors", inputs)
            if weights:
                _save(tmp / "weights.safetensors", weights)
            _save(tmp / "expected.safetensors", expected)
            _save(tmp / "actual.safetensors", actual)
            (tmp / "repro.py").write_text(script_text(spec))
            problem, replayed = _verify(tmp, expected, tol)
            if bitwise and problem is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                return problem
            (tmp / "README.md").write_text(self._readme(record, case, culprit, spec, inputs, weights, expected,
                                                        actual, notes + [replayed], module_note))
            for item in tmp.iterdir():  # mkdtemp's folder is private; a repro is meant to be handed over
                item.chmod(0o666 & ~umask)
            tmp.chmod(0o777 & ~umask)
            if final.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
                os.replace(final, old / final.name)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _readme(self, record: Any, case: Any, culprit: Culprit, spec: dict, inputs: dict, weights: dict,
                expected: dict, actual: dict, notes: list[str], module_note: str | None) -> str:
        from . import __version__

        tol = record.tolerance
        mode = ("the module rebuilt from its class (`%s.%s`) with the weights in `weights.safetensors`"
                % (spec["module"]["module"], spec["module"]["qualname"]) if spec["mode"] == "module"
                else f"{len(spec['ops'])} aten op(s) replayed in order (`torch.ops.<namespace>.<op>.<overload>`)")
        first_line = _failure_line(record)
        lines = [f"# Repro: {record.check} ({record.test_id})", "",
                 f"{first_line}.", "",
                 f"**Piece:** {culprit.display} — chosen because {culprit.why}.", "",
                 f"**Replayed as:** {mode}.", ""]
        if module_note:
            lines += [f"**Why not the module:** {module_note}; the repro replays its ops instead.", ""]
        lines += ["## Run it", "", "```", "python repro.py                  # on the CPU: (b) should PASS",
                  f"python repro.py --device {case.target if case.target.type != 'cpu' else 'npu:0'}"
                  "   # on the device under test", "python repro.py --recorded-only  # the recorded verdict only", "```",
                  "", "It prints (a) the target's recorded outputs (`actual.safetensors`) vs the expected ones and "
                  "(b) the piece re-run on `--device` vs the expected ones, each leaf with max_abs, max_rel, rel_l2, "
                  "cosine, mismatched elements and err/tol (max |a − e| / (atol + rtol·|e|)), and exits 1 when (b) "
                  "is out of tolerance (with `--recorded-only`: when (a) is).", ""]
        if self.hint:
            lines += ["The check itself: `" + self.hint.format(test_id=shlex.quote(record.test_id)) + "`", ""]
        lines += ["## Tolerance", "", f"{_fmt_tol(tol)} (source: {tol.source}"
                  + (f"; {tol.reason}" if tol.reason else "") + "): a leaf passes when at most floor(budget · numel) "
                  "elements have |a − e| > atol + rtol·|e|; integer and bool leaves must be equal.", "",
                  "## Files", "",
                  "| file | holds |", "|---|---|",
                  f"| inputs.safetensors | {', '.join(sorted(inputs)) or '-'} (as the target received them) |",
                  f"| weights.safetensors | {len(weights)} tensors (the reference's state_dict of the piece) |"
                  if weights else "| weights.safetensors | (none: the piece has no weights, or an op replay) |",
                  f"| expected.safetensors | {', '.join(sorted(expected))} (the reference run on these inputs"
                  + ("; golden.*: float64" if any(k.startswith("golden.") for k in expected) else "") + ") |",
                  f"| actual.safetensors | {', '.join(sorted(actual))} (the target's outputs) |", "",
                  "## Provenance", "",
                  f"- test: `{record.test_id}`, check `{record.check}`, recipe `{record.recipe}`",
                  f"- target: {record.target} ({record.target_name}); reference: {record.reference}"
                  + (f" ({record.reference_provenance})" if record.reference_provenance else "")
                  + "; the expected outputs are a live CPU run of the piece",
                  f"- torch {torch.__version__}, Python {sys.version.split()[0]}, pytest-npu-parity {__version__}",
                  f"- written {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}", ""]
        if notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
        return "\n".join(lines)

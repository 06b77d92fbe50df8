"""What a check's reference was computed from beyond its tensors, weights and structure.

A baseline entry's ``input_hash``, ``config_hash`` and ``structure`` (``checks.reference.check_hashes``)
leave three things out that change what a check computes, so that changing them once read as a
parity failure of the device instead of a stale baseline:

* **non-tensor arguments** — ``parity.check("m", module, x, scale=2.0)`` re-run with ``scale=3.0``: the
  input hash differs, but the input summary (tensors only) agrees, which the summary rule takes for
  the same activations recomputed on another machine;
* **module state outside the ``state_dict``** — a non-persistent buffer
  (``register_buffer(..., persistent=False)``), a plain tensor attribute (``self.mask =
  torch.tril(...)``) and private scalar attributes of the model's own classes (``self._scale``; public
  ones such as ``self.eps`` are in the structure record, ``structure.module_structure``);
* **a function's code and closure** — ``lambda x: model(x) * k`` with another ``k``, another default
  argument, another body.

``check_fingerprints(fn, given)`` records them as one JSON-ready dict, stored in the entry's metadata
under ``fingerprints`` (``META_KEY``) beside the older fields, which it never changes; an entry
recorded before it (no ``fingerprints``) is not checked, and says nothing.
``fingerprint_changes(recorded, now)`` names what differs (``argument 'scale' changed (2.0 → 3.0)``,
``module attribute 'mask' changed``, ``function closure 'k' changed (2.0 → 3.0)``) with the kind of each
change for the suite summary (``STALE_KINDS``).

**The rule.** Arguments: every leaf of ``(args, kwargs)`` (and a training step's labels) that is not a
tensor, by its path (``scale``, ``args[1]``, ``opts['mode']``, ``cfg.lr`` for a dataclass field):
``None``, bools, ints, floats (exactly), strings, dtypes, enums, functions and classes by name; a Hugging
Face config (a ``GenerationConfig``) by its ``structure.config_dict`` keys; a tensor, numpy array,
key/value cache or other object by its kind only (tensors are the input hash's and summary's business).
A ``torch.device`` or a device string (``"npu:0"``) counts as ``<device>``: the target's differs from the
reference's by design. A ``torch.Generator`` counts as ``<generator …>`` with a 64-bit digest of its
state (the numbers it will draw). Every path of either record is compared (an argument added or removed is a
change), except a config's keys, compared where both have them (a newer transformers adds keys).

Module attributes, for every submodule (``named_modules``): each non-persistent buffer and each tensor
in its ``__dict__`` (also in a list, tuple or dict there) that is not one of the model's parameters or
persistent buffers, as dtype, shape, a 64-bit digest of its bytes and its ``provenance.summarize_tensors``
row; each ``torch.Generator`` in its ``__dict__``, as ``<generator …>`` (above); and, of submodules whose class is the model's own (not defined by torch, transformers or another
of ``LIBRARY_PACKAGES``), the private (``_``) int/float/bool/str/None attributes, minus those every
``torch.nn.Module`` has and the bookkeeping marks libraries set (``LIBRARY_ATTRIBUTES``,
``_is_hf_initialized``; names starting ``_npu_parity``, ``_hf_``, ``_ds_``). A tensor whose bytes differ but whose summary
agrees within ``provenance.SUMMARY_RTOL`` is the same tensor drawn by another machine's kernels (a
``torch.randn`` projection made in ``__init__``) and no change; integer and bool tensors compare
bitwise. Compared where both records have the name: a cache a forward adds later is no change.

A function (``types.FunctionType``, also through ``functools.partial``): its code (bytecode, names and
constants of it and its nested functions, without file name and line numbers) and its literal
constants, compared only between recordings of the same Python minor version (bytecode changes
between releases); its default arguments and its closure cells, always: a cell holding a plain value
by that value, a tensor as above, a module by its class and ``structure.structure_hash`` and its
attributes as above, a function by its own record's digest, anything else by its type.

**Limits.** Not fingerprinted: the globals a function reads (a module-level constant of a test file),
the weights of a module a function closes over (another machine draws them differently; pass the module
or its bound method to the check instead), callable objects other than functions and modules, an
attribute object that is neither a tensor nor a plain value (a tokenizer), and tensor attributes
deeper than one container level. Every fingerprint is taken before the check's first run, on the
objects the test passes, so it does not depend on the device the target runs on.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import re
import sys
import types
from collections.abc import Mapping
from typing import Any

import torch

from ..leaves import is_cache
from ..modules import owner_module
from ..store.digests import _tensor_digest, uninitialized
from ..store.summaries import summaries_close, summarize_tensors
from ..structure import _SKIP, _plain, config_dict, module_structure, structure_hash

__all__ = ["META_KEY", "FINGERPRINT_FORMAT", "STALE_KINDS", "check_fingerprints", "argument_record",
           "module_attributes", "function_record", "fingerprint_changes"]

#: The baseline entry's metadata key the record is stored under.
META_KEY = "fingerprints"
#: Version of the record's layout (its ``format`` field).
FINGERPRINT_FORMAT = 1
#: The stale causes ``fingerprint_changes`` reports, for ``checks.reference.stale_cause``:
#: ``arguments`` (a non-tensor argument), ``attributes`` (module state outside the state_dict),
#: ``function`` (a function's code, defaults or closure).
STALE_KINDS = ("arguments", "attributes", "function")
#: Differences named per kind before "and N more".
SHOWN = 3
#: Nesting depth walked in arguments.
_DEPTH = 6
#: Instance attributes every ``torch.nn.Module`` has (hooks, ``_parameters``, ``_compiled_call_impl``, …).
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
#: Private attributes libraries set on the model's own modules as bookkeeping (transformers marks every
#: module it initialized, ``stable_init_`` the modules it seeded): not what the forward computes, and
#: their values may differ between releases of those libraries.
LIBRARY_ATTRIBUTES = frozenset({"_is_hf_initialized", "_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"})
_LIBRARY_PREFIXES = ("_npu_parity", "_hf_", "_ds_")
#: Top-level packages whose module classes are not the model's own: their private attributes are internals.
LIBRARY_PACKAGES = frozenset({"torch", "torch_npu", "transformers", "torchvision", "timm", "diffusers", "peft",
                              "accelerate", "deepspeed", "apex"})
_DEVICE_STRING = re.compile(r"^(cpu|cuda|npu|xpu|mps|meta|hpu|mtia|privateuseone)(:\d+)?$")
_TENSOR = "tensor"


def _library_class(obj: Any) -> bool:
    """Whether ``obj``'s class is defined by a library (``LIBRARY_PACKAGES``), not the model's own code."""
    return (type(obj).__module__ or "").partition(".")[0] in LIBRARY_PACKAGES


# -- arguments ---------------------------------------------------------------------------------

def _generator(generator: torch.Generator) -> str:
    """``<generator 0123456789abcdef>``: a 64-bit digest of the generator's state."""
    state = generator.get_state().numpy().tobytes()
    return f"<generator {hashlib.blake2b(state, digest_size=8, person=b'npu-parity-gen').hexdigest()}>"


def _argument_value(value: Any, path: str, out: dict[str, Any], depth: int) -> None:
    if isinstance(value, torch.Generator):
        out[path] = _generator(value)
        return
    if isinstance(value, torch.Tensor) or (type(value).__module__ == "numpy" and hasattr(value, "shape")
                                           and getattr(value, "ndim", 0) > 0):
        out[path] = "<tensor>"
        return
    if isinstance(value, torch.device) or (isinstance(value, str) and _DEVICE_STRING.match(value)):
        out[path] = "<device>"
        return
    if type(value).__module__ == "numpy" and hasattr(value, "item"):  # a numpy scalar
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, enum.Enum, type,
                                           types.FunctionType, types.BuiltinFunctionType)):
        plain = _plain(value)
        out[path] = plain if plain is not _SKIP else f"<{type(value).__name__}>"
        return
    if depth >= _DEPTH:
        out[path] = f"<{type(value).__name__}>"
        return
    if isinstance(value, Mapping):
        if not value:
            out[path] = "{}"
        for key in sorted(value, key=str):
            _argument_value(value[key], f"{path}[{str(key)!r}]" if path else str(key), out, depth + 1)
        return
    if isinstance(value, (list, tuple)):
        if not value:
            out[path] = "[]"
        for i, item in enumerate(value):
            _argument_value(item, f"{path}[{i}]", out, depth + 1)
        return
    if isinstance(value, (set, frozenset)):
        plain = _plain(value)
        out[path] = plain if plain is not _SKIP else f"<{type(value).__name__}>"
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _argument_value(getattr(value, field.name), f"{path}.{field.name}", out, depth + 1)
        return
    if not is_cache(value):
        flat = config_dict(value)
        if flat is not None:  # a GenerationConfig: compared key by key where both have the key
            out.update({f"{path}::{key}": v for key, v in flat.items()})
            return
    out[path] = f"<{type(value).__name__}>"


def argument_record(given: tuple) -> dict[str, Any]:
    """``{path: plain value}`` of every leaf of a check's ``given`` — ``(args, kwargs)`` or ``(args,
    kwargs, labels)`` — that is not a tensor (module docstring): positional arguments as ``args[<i>]``,
    keyword arguments by name, labels as ``labels``, nested leaves as ``scale[0]``, ``opts['mode']``,
    ``cfg.lr``; a config's keys as ``<path>::<key>``. Tensors appear as ``"<tensor>"``, devices as
    ``"<device>"``, other objects as ``"<ClassName>"``."""
    out: dict[str, Any] = {}
    args, kwargs = given[0], given[1]
    for i, value in enumerate(args):
        _argument_value(value, f"args[{i}]", out, 1)
    for key in sorted(kwargs, key=str):
        _argument_value(kwargs[key], str(key), out, 1)
    if len(given) > 2 and given[2] is not None:
        _argument_value(given[2], "labels", out, 1)
    return out


# -- module attributes -------------------------------------------------------------------------

def _tensor_record(tensor: torch.Tensor, name: str) -> dict[str, Any]:
    """``{"tensor": digest, "layout": "float32|[8, 8]", "summary": [...]}`` of one tensor (bytes digest of
    16 hex digits; summary: ``summarize_tensors``' row without its path, None for a lazy or meta tensor)."""
    if uninitialized(tensor):
        return {_TENSOR: "uninitialized", "layout": str(tensor.dtype).removeprefix("torch."), "summary": None}
    layout = f"{str(tensor.dtype).removeprefix('torch.')}|{list(tensor.shape)}"
    if tensor.device.type == "meta":
        return {_TENSOR: "meta", "layout": layout, "summary": None}
    summary = None
    if tensor.is_floating_point() or tensor.is_complex():
        dense = tensor.detach() if tensor.layout == torch.strided else tensor.detach().to_dense()
        summary = summarize_tensors(dense)[0][1:]
    return {_TENSOR: _tensor_digest(tensor.detach(), name).hex()[:16], "layout": layout, "summary": summary}


def _attribute_tensors(value: Any) -> list[tuple[str, torch.Tensor]]:
    """``(suffix, tensor)`` of ``value`` when it is a tensor, or of the tensors directly in a list, tuple
    or dict ``value``."""
    if isinstance(value, torch.Tensor):
        return [("", value)]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    if isinstance(value, dict):
        return [(f"[{str(k)!r}]", v) for k, v in value.items() if isinstance(v, torch.Tensor)]
    return []


def module_attributes(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """``{dotted name: value}`` of ``module``'s state outside its ``state_dict`` (module docstring): each
    non-persistent buffer and plain tensor attribute as ``_tensor_record``, each private scalar attribute
    of a submodule of the model's own classes as its plain value. ``state_dict``: the module's
    ``state_dict(keep_vars=True)`` when the caller has just taken it; taken here otherwise.

    Raises:
        TypeError: if ``module`` is not a ``torch.nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module_attributes expects a torch.nn.Module, got {type(module).__name__}")
    if state_dict is None:
        state_dict = module.state_dict(keep_vars=True)
    state = {id(t) for t in state_dict.values()}
    modules = list(module.named_modules())
    # every registered parameter, also one a state_dict hook leaves out (what module.parameters() yields
    # unless a module overrides it, without its second walk)
    state |= {id(p) for _, sub in modules for p in sub._parameters.values() if p is not None}
    out: dict[str, Any] = {}
    for path, sub in modules:
        prefix = f"{path}." if path else ""
        for name in sorted(getattr(sub, "_non_persistent_buffers_set", ())):
            buffer = sub._buffers.get(name)
            if isinstance(buffer, torch.Tensor):
                out[prefix + name] = _tensor_record(buffer, prefix + name)
        own = not _library_class(sub)
        for name, value in vars(sub).items():
            if name in _MODULE_INTERNALS or name == "training":
                continue
            if type(value) is torch.Generator:
                out[prefix + name] = _generator(value)
                continue
            for suffix, tensor in _attribute_tensors(value):
                if id(tensor) not in state and not isinstance(tensor, torch.nn.Parameter):
                    out[prefix + name + suffix] = _tensor_record(tensor, prefix + name + suffix)
            if (own and name.startswith("_") and name not in LIBRARY_ATTRIBUTES and not name.startswith(_LIBRARY_PREFIXES)
                    and (value is None or isinstance(value, (bool, int, float, str)))):
                out[prefix + name] = _plain(value)
    return out


# -- functions ---------------------------------------------------------------------------------

def _code_digest(code: types.CodeType, constants: list, doc: str | None = None) -> str:
    """BLAKE2b digest (32 hex digits) of a code object's bytecode, names and constants (nested code
    objects recursively), without its file name, line numbers and docstring ``doc``; its plain
    constants join ``constants``."""
    hasher = hashlib.blake2b(digest_size=16, person=b"npu-parity-code")
    for part in (code.co_code, repr(code.co_names).encode(), repr(code.co_varnames).encode(),
                 repr(code.co_freevars).encode(), str(code.co_argcount).encode()):
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            part = _code_digest(const, constants).encode()
        elif doc is not None and const == doc:
            continue
        else:
            part = repr(const).encode("utf-8", "surrogatepass")
            if isinstance(const, (int, float, str)) and not isinstance(const, bool):
                constants.append(_plain(const))
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.hexdigest()


def _cell_value(value: Any, key: str, out: dict[str, Any], depth: int) -> None:
    """A closure cell's or default argument's entries in a function record."""
    if isinstance(value, torch.nn.Module):
        out[key] = f"{type(value).__name__} {structure_hash(module_structure(value))[:16]}"
        out.update({f"{key}.{name}": v for name, v in module_attributes(value).items()})
    elif isinstance(value, torch.Tensor):
        out[key] = _tensor_record(value, key)
    elif isinstance(value, (types.FunctionType, functools.partial)) and depth < 2:
        inner = function_record(value, _depth=depth + 1) or {}
        text = repr(sorted((k, str(v)) for k, v in inner.items()))
        out[key] = "function " + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    elif isinstance(value, types.MethodType):
        out[key] = f"<method {value.__func__.__qualname__} of {type(value.__self__).__name__}>"
    else:
        found: dict[str, Any] = {}
        _argument_value(value, key, found, 1)
        out.update(found)


def function_record(fn: Any, *, _depth: int = 0) -> dict[str, Any] | None:
    """``{field: value}`` of a function (module docstring), or None for anything else: ``python`` (the
    minor version), ``code`` (digest), ``constants`` (its literal numbers and strings), ``default:<name>``
    per default argument, ``closure:<name>`` per closure cell (a module's attributes as
    ``closure:<name>.<attribute>``), ``partial:<i or name>`` per argument bound by ``functools.partial``."""
    out: dict[str, Any] = {}
    while isinstance(fn, functools.partial):
        for i, value in enumerate(fn.args):
            _cell_value(value, f"partial:{i}", out, _depth)
        for key in sorted(fn.keywords):
            _cell_value(fn.keywords[key], f"partial:{key}", out, _depth)
        fn = fn.func
    if isinstance(fn, types.MethodType) and not isinstance(fn.__self__, torch.nn.Module):
        fn = fn.__func__
    if not isinstance(fn, types.FunctionType):
        return out or None
    code = fn.__code__
    constants: list = []
    out["python"] = f"{sys.version_info[0]}.{sys.version_info[1]}"
    out["code"] = _code_digest(code, constants, fn.__doc__ if isinstance(fn.__doc__, str) else None)
    out["constants"] = constants
    positional = code.co_varnames[:code.co_argcount]
    for name, value in zip(positional[len(positional) - len(fn.__defaults__ or ()):], fn.__defaults__ or ()):
        _cell_value(value, f"default:{name}", out, _depth)
    for name, value in sorted((fn.__kwdefaults__ or {}).items()):
        _cell_value(value, f"default:{name}", out, _depth)
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not yet filled (a function that refers to itself before its def ends)
            out[f"closure:{name}"] = "<empty>"
            continue
        _cell_value(contents, f"closure:{name}", out, _depth)
    return out


# -- the record and its comparison ---------------------------------------------------------------

def check_fingerprints(fn: Any, given: tuple, state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The ``fingerprints`` record of a check (module docstring): ``{"format": 1, "arguments":
    argument_record(given)}`` with ``"attributes": module_attributes(module)`` for a module or a bound
    method of one (``modules.owner_module``), else ``"function": function_record(fn)`` when ``fn`` is a
    function. Taken before any run; JSON-ready. A part that raises (an object it cannot describe) is left
    out and named with its error under ``"unavailable"``: that part is then not compared. ``state_dict``: the
    module's ``state_dict(keep_vars=True)`` when the caller has just taken it (``module_attributes``)."""
    record: dict[str, Any] = {"format": FINGERPRINT_FORMAT}
    module = owner_module(fn)
    parts = [("arguments", lambda: argument_record(given))]
    parts.append(("attributes", lambda: module_attributes(module, state_dict)) if module is not None else
                 ("function", lambda: function_record(fn)))
    for key, part in parts:
        try:
            value = part()
        except Exception as exc:  # noqa: BLE001 - an object this cannot describe: that part is not checked
            record.setdefault("unavailable", {})[key] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        if value is not None:
            record[key] = value
    return record


def _same(a: Any, b: Any) -> bool:
    """Equal values; two tensor records whose bytes differ are the same when their layouts agree and
    their summaries agree within ``provenance.SUMMARY_RTOL`` (another machine's draws)."""
    if a == b:
        return True
    if not (isinstance(a, dict) and isinstance(b, dict) and _TENSOR in a and _TENSOR in b):
        return False
    if a.get("layout") != b.get("layout") or a.get("summary") is None or b.get("summary") is None:
        return False
    return summaries_close([["", *a["summary"]]], [["", *b["summary"]]]) is None


def _show(value: Any) -> str:
    if isinstance(value, dict) and _TENSOR in value:
        return f"tensor {value.get('layout')}"
    return repr(value)


def _how(a: Any, b: Any) -> str:
    if isinstance(a, dict) and _TENSOR in a and isinstance(b, dict) and _TENSOR in b:
        if a.get("layout") != b.get("layout"):
            return f"{_show(a)} → {_show(b)}"
        why = summaries_close([["", *a["summary"]]], [["", *b["summary"]]]) if a.get("summary") and b.get("summary") \
            else None
        return f"its values: {why.replace(' of <input>', '')}" if why else "its values"
    return f"{_show(a)} → {_show(b)}"


def _diffs(recorded: Mapping[str, Any], now: Mapping[str, Any], union: bool,
           both_only: Any = lambda key: False) -> list[tuple[str, str]]:
    """``(key, how)`` of each key whose value differs (of ``recorded`` and ``now``'s keys when ``union``,
    else of the keys both have; ``both_only(key)``: compared only where both have it)."""
    keys = list(now) + [k for k in recorded if k not in now] if union else [k for k in now if k in recorded]
    out = []
    for key in keys:
        if key not in recorded or key not in now:
            if both_only(key):
                continue
            out.append((key, f"new: {_show(now[key])}" if key not in recorded else f"gone, was {_show(recorded[key])}"))
        elif not _same(recorded[key], now[key]):
            out.append((key, _how(recorded[key], now[key])))
    return out


def _lines(diffs: list[tuple[str, str]], what: str) -> list[str]:
    lines = [f"{what} {key!r} changed ({how})" for key, how in diffs[:SHOWN]]
    if len(diffs) > SHOWN:
        lines.append(f"and {len(diffs) - SHOWN} more {what}s changed")
    return lines


def fingerprint_changes(recorded: Any, now: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """What differs between a recorded ``fingerprints`` record and the check's: ``(kind, line)`` pairs,
    ``kind`` one of ``STALE_KINDS``; empty when nothing differs, when nothing was recorded (an entry
    older than the record) or for a record of an unknown format.

    Lines: ``argument 'scale' changed (2.0 → 3.0)``, ``argument 'args[2]' changed (new: True)``,
    ``module attribute 'attn.mask' changed (its values: sum of squares differs: …)``, ``function code
    changed``, ``function constants changed ([2.0] → [3.0])``, ``function closure 'k' changed (2.0 → 3.0)``.
    """
    if not isinstance(recorded, Mapping) or recorded.get("format") != FINGERPRINT_FORMAT or not now:
        return []
    out: list[tuple[str, str]] = []
    a, b = recorded.get("arguments"), now.get("arguments")
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out += [("arguments", line) for line in _lines(_diffs(a, b, True, lambda k: "::" in k), "argument")]
    a, b = recorded.get("attributes"), now.get("attributes")
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        out += [("attributes", line) for line in _lines(_diffs(a, b, False), "module attribute")]
    a, b = recorded.get("function"), now.get("function")
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        same_python = a.get("python") == b.get("python")
        lines = []
        if same_python and a.get("code") != b.get("code"):
            if a.get("constants") != b.get("constants"):
                lines.append(f"function constants changed ({a.get('constants')} → {b.get('constants')})")
            else:
                lines.append("function code changed")
        values = _diffs({k: v for k, v in a.items() if ":" in k}, {k: v for k, v in b.items() if ":" in k}, True)
        for key, how in values[:SHOWN]:
            kind, _, name = key.partition(":")
            lines.append(f"function {'default argument' if kind == 'default' else kind} {name!r} changed ({how})")
        if len(values) > SHOWN:
            lines.append(f"and {len(values) - SHOWN} more function values changed")
        out += [("function", line) for line in lines]
    elif isinstance(a, Mapping) != isinstance(b, Mapping) and "arguments" in recorded:
        out.append(("function", "the checked function changed (a function then, now not, or the reverse)"))
    return out

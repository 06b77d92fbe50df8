"""The configuration and structure of a module: what its weights do not say about its computation.

Two models with bitwise the same ``state_dict`` can compute different things: GPT-2 with
``layer_norm_epsilon`` 1e-5 or 1e-3, a ``Dropout`` in training or eval mode, ``nn.GELU()`` or
``nn.GELU(approximate="tanh")``, a module replaced by one of another class without weights. A
baseline records this module's **structure** beside the weight digests
(``provenance.module_tensor_digests``), so that such a change is reported as a stale baseline
naming what changed, never as a parity failure of the device:

* ``module_structure(module)`` — a JSON-ready record: for every submodule (``named_modules``) its
  class name and its public plain attributes (``vars(module)``: numbers, strings, bools, ``None``,
  dtypes, enums, functions by name, tuples/lists/sets of them — e.g. ``eps``, ``in_features``,
  ``approximate``, ``p``, ``training``), and every Hugging Face config found on a submodule
  (``config``, ``generation_config``: ``to_dict()``, flattened to dotted keys, minus
  ``VOLATILE_CONFIG_KEYS`` and private ``_`` keys);
* ``structure_hash(record)`` — its BLAKE2b digest; ``pack_structure`` / ``unpack_structure`` — the
  compact form stored in a baseline (zlib-compressed JSON in base64: 7.7 kB for Aurora's 893
  modules, whose JSON is 114 kB);
* ``structure_changes(recorded, now)`` — what differs, as readable lines:
  ``config changed: layer_norm_epsilon 1e-05 → 0.001`` and ``structure changed (1 of 34 modules
  differ, e.g. 'transformer.h.0.mlp.act': NewGELUActivation → GELUActivation)``.

**What is left out, and why.** ``extra_repr()`` is not used: its text depends on the torch release
(torch 2.14.1 prints ``LayerNorm((256,), eps=1e-05, elementwise_affine=True, bias=True)``, 2.5.1
the same without ``bias=``) while the attributes behind it agree — measured on Aurora (893
modules), GPT-2, BERT, resnet18, LSTM, GRU, ``TransformerEncoder`` and ``MultiheadAttention`` under
torch 2.5.1 and 2.14.1: identical records. Private attributes (``_parameters``, hooks,
``_flat_weights``), dicts (runtime state such as transformers' ``warnings_issued``), devices
(placement is the runner's business) and objects of other types (tokenizers, processors) are left
out. Of a config: ``transformers_version`` (the package, not the model), ``torch_dtype`` /
``dtype`` (the dtype of the weights is already in their digests, and the key was renamed in
transformers 4.56) and keys starting with ``_`` (``_name_or_path``: where it was loaded from,
``_commit_hash``). Finally **only what both records have is compared**: an attribute or config key
present on one side only (a newer torch or transformers adding a field) is no change; a module
path or class name present on one side only is.

The record is computed before any run, on the module the test passes; nothing here imports
transformers (configs are recognized by their ``to_dict``/``to_json_string`` methods).

**A training step's recipe.** The weights and structure do not say how a training step trains:
``train_recipe`` records the optimizer (class and hyperparameters), ``max_grad_norm`` and the loss
of ``ParityCase.train_step`` (or the ``loop=`` object's settings) as a flat plain-JSON dict stored
beside the structure in the baseline; ``train_recipe_changes`` names what differs
(``train recipe changed: optimizer AdamW → SGD, lr 0.0001 → 0.01``), again only where both
records have a field, so a hyperparameter that one torch release adds to an optimizer's
``defaults`` is no change.
"""
from __future__ import annotations

import base64
import enum
import hashlib
import json
import os
import re
import types
import zlib
from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "VOLATILE_CONFIG_KEYS",
    "CONFIG_ATTRIBUTES",
    "config_dict",
    "module_structure",
    "structure_hash",
    "pack_structure",
    "unpack_structure",
    "structure_changes",
    "train_recipe",
    "train_recipe_changes",
]

#: Version of the record's layout (``module_structure``'s ``format`` field).
STRUCTURE_FORMAT = 1
#: Config keys that describe where or with which package a model was saved, not what it computes
#: (see the module docstring); left out at every nesting level, as is every key starting with ``_``.
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype"})
#: Module attributes read as configs (Hugging Face ``PreTrainedModel.config`` and
#: ``GenerationMixin``'s ``generation_config``, which ``generate`` reads its defaults from).
CONFIG_ATTRIBUTES = ("config", "generation_config")
#: Prefix of ``pack_structure``'s text.
_PACKED = "zlib+base64:"
#: Differences named per category in ``structure_changes`` before "…".
SHOWN = 3

_SKIP = object()


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-ready data, or ``_SKIP`` when it is not plain (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (tuple, list, set, frozenset)) and depth < 4:
        items = [_plain(v, depth + 1) for v in value]
        if any(v is _SKIP for v in items):
            return _SKIP
        if isinstance(value, (set, frozenset)):
            try:
                items = sorted(items)
            except TypeError:
                return _SKIP
        return items
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"<function {value.__name__}>"  # not __qualname__: torch.tanh's is an implementation detail
    if isinstance(value, type):
        return f"<class {value.__name__}>"
    return _SKIP


def config_dict(obj: Any) -> dict[str, Any] | None:
    """A Hugging Face config (``PretrainedConfig``, ``GenerationConfig``: anything with ``to_dict``
    and ``to_json_string`` methods) as ``{dotted key: plain value}``, or None for any other object.

    Nested dicts (``vision_config``, ``id2label``) become dotted keys (``vision_config.hidden_size``);
    ``VOLATILE_CONFIG_KEYS``, keys starting with ``_`` and values that are not plain (see
    ``module_structure``) are left out.
    """
    if not (callable(getattr(obj, "to_dict", None)) and callable(getattr(obj, "to_json_string", None))):
        return None
    try:
        raw = obj.to_dict()
    except Exception:  # noqa: BLE001 - a config that cannot describe itself is left out
        return None
    if not isinstance(raw, Mapping):
        return None
    flat: dict[str, Any] = {}

    def walk(mapping: Mapping, prefix: str) -> None:
        for key, value in mapping.items():
            key = str(key)
            if key.startswith("_") or key in VOLATILE_CONFIG_KEYS:
                continue
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
                continue
            nested = config_dict(value)
            if nested is not None:  # a sub-config object that to_dict left as it is
                flat.update({f"{prefix}{key}.{k}": v for k, v in nested.items()})
                continue
            plain = _plain(value)
            if plain is not _SKIP:
                flat[f"{prefix}{key}"] = plain

    walk(raw, "")
    return flat


def module_structure(module: torch.nn.Module, *, modes: bool = True) -> dict[str, Any]:
    """The structure record of ``module``: ``{"format": 1, "modules": {path: [class name, {attribute:
    value}]}, "configs": {path: {dotted key: value}}}``.

    ``modules`` has one entry per ``named_modules()`` path (``""`` for ``module`` itself) with its
    class's ``__name__`` and its public plain attributes (module docstring); ``configs`` one entry
    per distinct config object, under the path of the attribute it was first found at
    (``"config"``, ``"transformer.h.0.attn.config"`` only when that is another object,
    ``"generation_config"``).

    Args:
        module: any ``torch.nn.Module``.
        modes: include each submodule's ``training`` flag (a ``Dropout`` in training mode computes
            something else). ``ParityCase.train_step`` passes False: it puts its copy in training mode
            itself.

    Raises:
        TypeError: if ``module`` is not a ``torch.nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module_structure expects a torch.nn.Module, got {type(module).__name__}")
    modules: dict[str, list] = {}
    configs: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()
    for path, sub in module.named_modules():
        attributes: dict[str, Any] = {}
        for name, value in vars(sub).items():
            if name.startswith("_") or (name == "training" and not modes):
                continue
            if name in CONFIG_ATTRIBUTES:
                if id(value) in seen:  # the model's config, shared by its submodules: recorded once
                    continue
                flat = config_dict(value)
                if flat is not None:
                    seen.add(id(value))
                    configs[f"{path}.{name}" if path else name] = flat
                    continue
            plain = _plain(value)
            if plain is not _SKIP:
                attributes[name] = plain
        modules[path] = [type(sub).__name__, attributes]
    return {"format": STRUCTURE_FORMAT, "modules": modules, "configs": configs}


def _canonical(record: Mapping[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def structure_hash(record: Mapping[str, Any]) -> str:
    """BLAKE2b hex digest (64 characters) of a ``module_structure`` record (its canonical JSON)."""
    return hashlib.blake2b(_canonical(record).encode("utf-8", "surrogatepass"), digest_size=32,
                           person=b"npu-parity-str").hexdigest()


def pack_structure(record: Mapping[str, Any]) -> str:
    """The text a baseline stores: ``"zlib+base64:"`` and the zlib-compressed canonical JSON in base64."""
    data = zlib.compress(_canonical(record).encode("utf-8", "surrogatepass"), 9)
    return _PACKED + base64.b64encode(data).decode("ascii")


def unpack_structure(text: str) -> dict[str, Any]:
    """Inverse of ``pack_structure``.

    Raises:
        ValueError: ``text`` is not a packed record of a known format.
    """
    if not isinstance(text, str) or not text.startswith(_PACKED):
        raise ValueError("not a packed structure record")
    try:
        record = json.loads(zlib.decompress(base64.b64decode(text[len(_PACKED):], validate=True)))
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"unreadable structure record: {exc}") from None
    if not isinstance(record, dict) or record.get("format") != STRUCTURE_FORMAT:
        raise ValueError(f"structure record of unknown format {record.get('format') if isinstance(record, dict) else None!r}")
    return record


def _show(value: Any) -> str:
    return repr(value) if not isinstance(value, list) else json.dumps(value)


def _attribute_change(name: str, before: Any, after: Any) -> str:
    if name == "training":
        mode = {True: "train", False: "eval"}
        return f"{mode.get(before, before)} → {mode.get(after, after)} mode"
    return f"{name} {_show(before)} → {_show(after)}"


def _names(items: list[str], shown: int) -> str:
    head = ", ".join(items[:shown])
    return head + (", …" if len(items) > shown else "")


def structure_changes(recorded: Mapping[str, Any], now: Mapping[str, Any], *, prefix: str | None = None,
                      shown: int = SHOWN) -> list[str]:
    """What differs between two ``module_structure`` records, compared where both have the field.

    Returns up to two lines, empty when nothing comparable differs:
    ``"config changed: layer_norm_epsilon 1e-05 → 0.001"`` (every config key both have, several
    joined by ``", "``; a config that is not the model's own ``config`` is named by its path) and
    ``"structure changed (2 of 34 modules differ, e.g. 'h.0.ln_1': eps 1e-05 → 0.001, …; 1 new:
    'h.2'; 1 gone: 'drop')"`` (class names, attributes both have, modules added or removed).

    Args:
        recorded, now: ``module_structure`` records (the recorded one from ``unpack_structure``).
        prefix: dotted path of the checked module inside its model (a submodule check): module paths
            are shown as in the whole model.
        shown: differences named per category before "…".
    """
    lines: list[str] = []
    config_diffs: list[str] = []
    configs_a, configs_b = recorded.get("configs") or {}, now.get("configs") or {}
    for where in sorted(set(configs_a) & set(configs_b)):
        a, b = configs_a[where], configs_b[where]
        label = "" if where == "config" else f"{_full(where, prefix)}: "
        for key in sorted(set(a) & set(b)):
            if a[key] != b[key]:
                config_diffs.append(f"{label}{key} {_show(a[key])} → {_show(b[key])}")
    if config_diffs:
        more = f" (and {len(config_diffs) - shown} more)" if len(config_diffs) > shown else ""
        lines.append("config changed: " + ", ".join(config_diffs[:shown]) + more)
    modules_a, modules_b = recorded.get("modules") or {}, now.get("modules") or {}
    changed: list[str] = []
    for path in modules_b:
        if path not in modules_a:
            continue
        (class_a, attrs_a), (class_b, attrs_b) = modules_a[path], modules_b[path]
        name = repr(_full(path, prefix) or f"<{class_b}>")
        if class_a != class_b:
            changed.append(f"{name}: {class_a} → {class_b}")
            continue
        diffs = [_attribute_change(k, attrs_a[k], attrs_b[k]) for k in sorted(set(attrs_a) & set(attrs_b))
                 if attrs_a[k] != attrs_b[k]]
        if diffs:
            changed.append(f"{name}: {', '.join(diffs)}")
    added = [repr(_full(p, prefix)) for p in modules_b if p not in modules_a]
    removed = [repr(_full(p, prefix)) for p in modules_a if p not in modules_b]
    parts = []
    if changed:
        total = len(set(modules_a) | set(modules_b))
        parts.append(f"{len(changed)} of {total} modules differ, e.g. {_names(changed, shown)}")
    if added:
        parts.append(f"{len(added)} new: {_names(added, shown)}")
    if removed:
        parts.append(f"{len(removed)} gone: {_names(removed, shown)}")
    if parts:
        lines.append("structure changed (" + "; ".join(parts) + ")")
    return lines


def _full(path: str, prefix: str | None) -> str:
    if not prefix:
        return path
    return f"{prefix}.{path}" if path else prefix


#: Version of ``train_recipe``'s layout (its ``format`` field).
TRAIN_RECIPE_FORMAT = 1
#: ``train_recipe`` keys compared even when only one record has them (a loss or loop added or removed).
_RECIPE_ALWAYS = ("optimizer", "max_grad_norm", "loss", "loop")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _recipe_value(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON data for ``train_recipe``: plain values as ``_plain`` keeps them (tuples as
    lists), a path by its file name (an absolute path differs between machines), a mapping as a dict
    of such values, anything else as its ``repr`` without memory addresses."""
    if isinstance(value, os.PathLike) or (isinstance(value, str) and os.sep in value and os.path.isabs(value)):
        return os.path.basename(os.fspath(value))
    if isinstance(value, Mapping) and depth < 4:
        return {str(k): _recipe_value(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (tuple, list)) and depth < 4:
        return [_recipe_value(v, depth + 1) for v in value]
    plain = _plain(value, depth)
    return _ADDRESS.sub("", repr(value)) if plain is _SKIP else plain


def _public(obj: Any, prefix: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{prefix + name: _recipe_value}`` of ``obj``'s public instance attributes (``vars``)."""
    return {f"{prefix}{name}": _recipe_value(value) for name, value in sorted(getattr(obj, "__dict__", {}).items())
            if not name.startswith("_") and name not in skip}


def _callable_name(fn: Any) -> str:
    if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return f"{getattr(fn, '__module__', None) or ''}.{fn.__qualname__}".lstrip(".")
    return type(fn).__qualname__


def train_recipe(optimizer: torch.optim.Optimizer | None = None, max_grad_norm: float | None = None,
                 loss_fn: Any = None, loop: Any = None) -> dict[str, Any]:
    """The recipe of a training step as a flat plain-JSON dict (``ParityCase.train_step`` records it in
    the baseline; ``train_recipe_changes`` compares two).

    Keys: ``format``; without ``loop``: ``optimizer`` (the class's ``__qualname__``), ``optimizer.<k>``
    for every entry of its ``defaults``, ``optimizer.param_groups`` (the number of tensors of each
    param group), ``optimizer.group<i>.<k>`` for every setting of param group ``i`` but ``params``,
    ``max_grad_norm``, ``loss`` (``"output.loss"`` for None, the default loss; a loss module's class
    ``__qualname__`` with its public plain attributes as ``loss.<name>``, e.g. ``loss.reduction``,
    ``loss.label_smoothing``; a function's ``__module__.__qualname__``; another callable's class
    ``__qualname__`` and public attributes). With ``loop``: ``loop`` (its class's ``__qualname__``)
    and its public attributes as ``loop.<name>`` (``loop.steps``, ``loop.deepspeed_config``: a path
    by its file name). Values: numbers, strings, bools, None, lists (tuples) and dicts of them;
    anything else as its ``repr`` without memory addresses. A lambda is named, not its body.

    Args:
        optimizer: the step's optimizer, built on a copy of the module's trainable parameters
            (not stepped); ignored with ``loop``.
        max_grad_norm: the gradient clipping norm, or None.
        loss_fn: the step's loss (None: the output's own loss).
        loop: a training loop object (``hf_trainer.TrainerLoop``) that owns optimizer, clipping and loss.
    """
    record: dict[str, Any] = {"format": TRAIN_RECIPE_FORMAT}
    if loop is not None:
        record["loop"] = _callable_name(loop)
        if not isinstance(loop, (types.FunctionType, types.MethodType)):
            record.update(_public(loop, "loop."))
        return record
    if optimizer is not None:
        record["optimizer"] = type(optimizer).__qualname__
        record.update({f"optimizer.{k}": _recipe_value(v) for k, v in sorted(optimizer.defaults.items())})
        record["optimizer.param_groups"] = [len(group.get("params", ())) for group in optimizer.param_groups]
        for i, group in enumerate(optimizer.param_groups):
            record.update({f"optimizer.group{i}.{k}": _recipe_value(v) for k, v in sorted(group.items())
                           if k != "params"})
    record["max_grad_norm"] = _recipe_value(max_grad_norm)
    if loss_fn is None:
        record["loss"] = "output.loss"
    elif isinstance(loss_fn, torch.nn.Module):
        record["loss"] = type(loss_fn).__qualname__
        record.update(_public(loss_fn, "loss.", skip=("training",)))
    else:
        record["loss"] = _callable_name(loss_fn)
        if not isinstance(loss_fn, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            record.update(_public(loss_fn, "loss."))
    return record


def train_recipe_changes(recorded: Mapping[str, Any], now: Mapping[str, Any], *, shown: int = SHOWN) -> list[str]:
    """What differs between two ``train_recipe`` records: ``[]`` or one line
    ``"train recipe changed: optimizer AdamW → SGD, lr 0.0001 → 0.01, weight_decay 0.1 → 0 (and 1 more)"``.

    Compared: the keys both records have, and ``optimizer``, ``max_grad_norm``, ``loss`` and ``loop``
    always (a missing one as None). Optimizer keys are named without their ``optimizer.`` prefix; a
    param group's setting that changed exactly as the optimizer's default did is not named twice.
    """
    diffs: list[str] = []
    for key in [k for k in now if k in recorded or k in _RECIPE_ALWAYS] + \
               [k for k in _RECIPE_ALWAYS if k in recorded and k not in now]:
        if key == "format":
            continue
        a, b = recorded.get(key), now.get(key)
        if a == b:
            continue
        group = re.match(r"optimizer\.group\d+\.(.+)", key)
        default = f"optimizer.{group.group(1)}" if group else None
        if default in recorded and default in now and (recorded[default], now[default]) == (a, b):
            continue
        name = key.removeprefix("optimizer.") if key != "optimizer" else key
        named = key in ("optimizer", "loss", "loop")  # class or function names, shown bare
        diffs.append(f"{name} {a} → {b}" if named else f"{name} {_show(a)} → {_show(b)}")
    if not diffs:
        return []
    more = f" (and {len(diffs) - shown} more)" if len(diffs) > shown else ""
    return ["train recipe changed: " + ", ".join(diffs[:shown]) + more]

"""Outputs as named leaves: how a nested output becomes ``(path, leaf)`` pairs.

``flatten`` walks a computation's output (tensors, numbers, strings, ``None``, tuples, lists, dicts,
named tuples, dataclasses, Hugging Face ``ModelOutput``s and key/value caches) and names each leaf by
its path (``logits``, ``hidden_states[1]``, ``[0].loss``, ``past_key_values.layers[0].keys``);
``is_cache`` / ``cache_fields`` read a Hugging Face key/value cache without importing transformers;
``_leaves_by_path`` gives one side's ``{path: leaf}``, refusing two leaves of one path.

This is the ground floor of the engine: the judges (``judge/``) pair the two sides' leaves by these
paths, a side's run (``runtime/``) returns them, and a baseline stores them under them. So it
imports nothing of the package. (It was the "structure" part of ``compare.py``; the old names
``pytest_npu_parity.compare.flatten``, ``cache_fields``, ``is_cache`` keep working.)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Iterator

import torch


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every leaf of a nested output.

    Leaves are tensors, Python numbers, strings and ``None``. Numbers become 0-d tensors that hold
    them exactly: ``bool`` → bool, ``int`` → int64, ``float`` → float64, ``complex`` → complex128;
    a ``str`` becomes the 1-d uint8 tensor of its UTF-8 bytes (so it is compared exactly, and stored
    in a baseline like any leaf). Containers are mappings (including ``transformers``
    ``ModelOutput``, whose ``None`` fields are skipped as its ``to_tuple`` does), named tuples and
    dataclass instances (by field name), tuples, lists and Hugging Face key/value caches (see
    ``cache_fields``: ``GenerateDecoderOnlyOutput.past_key_values`` gives
    ``past_key_values.layers[0].keys``, ``…layers[0].values``, … per layer). Paths join mapping keys
    and field names with ``.`` and sequence positions as ``[i]``: ``{"a": (x, {"b": y})}`` gives
    ``a[0]`` and ``a[1].b``; a ``Forecast(mean, samples)`` dataclass or named tuple gives ``mean`` and
    ``samples``. ``torch.return_types`` values (``torch.max(x, 1)``) have no field names there and
    stay positional.

    Raises:
        TypeError: for any other object, naming its path and type.
    """
    if obj is None or isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, bool | int | float | complex):
        yield prefix, _number_tensor(obj, prefix)
    elif isinstance(obj, str):
        yield prefix, torch.tensor(list(obj.encode("utf-8")), dtype=torch.uint8)
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            if value is None and _is_model_output(obj):
                continue
            yield from flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif (named := _named_fields(obj)) is not None:
        for key, value in named:
            yield from flatten(value, f"{prefix}.{key}" if prefix else key)
    elif isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        for i, value in enumerate(obj):
            yield from flatten(value, f"{prefix}[{i}]")
    elif (fields := cache_fields(obj)) is not None:
        for key, value in fields.items():
            yield from flatten(value, f"{prefix}.{key}" if prefix else key)
    else:
        where = f"at {prefix!r}" if prefix else "at the top level"
        raise TypeError(
            f"cannot compare a {type(obj).__name__} {where}: outputs must be tensors, numbers, strings, None, "
            "or tuples/lists/dicts/named tuples/dataclasses/ModelOutputs/Hugging Face caches of them"
        )


def without(leaves: Any, paths: set[str]) -> Any:
    """``leaves`` (one side's ``{path: leaf}``) less the leaves named in ``paths``, as a new dict; anything
    other than a dict (None, a single leaf) is returned as it is."""
    return {k: v for k, v in leaves.items() if k not in paths} if isinstance(leaves, dict) else leaves


def cpu_leaf(tensor: torch.Tensor) -> torch.Tensor:
    """An output leaf as the judges take it: detached, on the CPU, dense (a sparse tensor becomes its
    values at every position, so that it is compared, stored and measured like any other leaf)."""
    tensor = tensor.detach().cpu()
    return tensor.to_dense() if tensor.layout != torch.strided else tensor


def _named_fields(obj: Any) -> list[tuple[str, Any]] | None:
    """``[(field name, value)]`` of a named tuple (``collections.namedtuple``, ``typing.NamedTuple``)
    or a dataclass instance, in declaration order; None for anything else."""
    fields = getattr(type(obj), "_fields", None)
    if isinstance(obj, tuple) and isinstance(fields, tuple) and all(isinstance(f, str) for f in fields):
        return list(zip(fields, obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


def is_cache(obj: Any) -> bool:
    """Whether ``obj`` is a Hugging Face key/value cache: an instance of a class named ``Cache`` or
    of a subclass (``transformers.cache_utils``: ``DynamicCache``, ``StaticCache``,
    ``EncoderDecoderCache``, …), recognized by its class names so that transformers is never
    imported here. A cache is state: a call given one adds its keys and values to it."""
    return any(cls.__name__ == "Cache" for cls in type(obj).__mro__)


def cache_fields(obj: Any) -> dict[str, Any] | None:
    """The contents of a Hugging Face key/value cache as a plain structure, or None for any other object.

    A cache is an instance of a class named ``Cache`` or of a subclass (``transformers.cache_utils``:
    ``DynamicCache``, ``StaticCache``, ``EncoderDecoderCache``, …), recognized by its class names so
    that transformers is never imported here. Read from transformers 4.57's classes
    (``cache_utils.Cache.__init__``, ``CacheLayerMixin.__init__``, ``EncoderDecoderCache.__init__``):

    * an encoder-decoder cache: ``{"self_attention_cache": …, "cross_attention_cache": …}``;
    * a cache of layers (``Cache.layers``, transformers >= 4.56): ``{"layers": [layer, …]}``, each
      layer as ``{"keys": …, "values": …}`` followed by its other tensor attributes in name order
      (``[batch, heads, tokens, head_dim]`` tensors; ``None`` for a layer not yet filled), so a
      quantized layer's stored tensors are compared too;
    * the older list layout (``key_cache`` / ``value_cache`` lists, transformers < 4.56):
      ``{"key_cache": [...], "value_cache": [...]}``.

    Raises:
        TypeError: a ``Cache`` with none of these layouts, naming its class.
    """
    if not is_cache(obj):
        return None
    if hasattr(obj, "self_attention_cache") and hasattr(obj, "cross_attention_cache"):
        return {"self_attention_cache": obj.self_attention_cache, "cross_attention_cache": obj.cross_attention_cache}
    layers = getattr(obj, "layers", None)
    if isinstance(layers, Sequence):
        return {"layers": [_cache_layer_fields(layer) for layer in layers]}
    keys, values = getattr(obj, "key_cache", None), getattr(obj, "value_cache", None)
    if isinstance(keys, Sequence) and isinstance(values, Sequence):
        return {"key_cache": list(keys), "value_cache": list(values)}
    raise TypeError(f"cannot compare a {type(obj).__name__}: a cache without layers or key_cache/value_cache "
                    "lists; compare its tensors yourself (parity.compare) or run with use_cache=False")


def _cache_layer_fields(layer: Any) -> Any:
    """``{"keys", "values", other tensor attributes in name order}`` of one cache layer (a layer
    that is itself a tuple or list, ``(keys, values)``, is returned as it is)."""
    if isinstance(layer, Sequence):
        return layer
    state = vars(layer) if hasattr(layer, "__dict__") else {}
    fields = {"keys": getattr(layer, "keys", None), "values": getattr(layer, "values", None)}
    for name in sorted(state):
        if name not in fields and isinstance(state[name], torch.Tensor):
            fields[name] = state[name]
    for name in ("keys", "values"):  # a layer class whose keys/values are not tensors: leave them out
        if fields[name] is not None and not isinstance(fields[name], torch.Tensor):
            del fields[name]
    return fields


def _number_tensor(value: bool | int | float | complex, path: str) -> torch.Tensor:
    for kind, dtype in ((bool, torch.bool), (int, torch.int64), (float, torch.float64), (complex, torch.complex128)):
        if isinstance(value, kind):
            break
    try:
        return torch.tensor(value, dtype=dtype)
    except (OverflowError, RuntimeError, ValueError) as exc:  # an int beyond int64
        raise ValueError(f"cannot compare the number {value!r} at {path or 'the top level'!r}: {exc}") from None


def _is_model_output(obj: Any) -> bool:
    return any(cls.__name__ == "ModelOutput" for cls in type(obj).__mro__)


def _leaves_by_path(obj: Any, side: str) -> dict[str, torch.Tensor | None]:
    leaves: dict[str, torch.Tensor | None] = {}
    for path, leaf in flatten(obj):
        if path in leaves:
            raise ValueError(f"two leaves of the {side} output have the same path {path!r}; rename a key")
        leaves[path] = leaf
    return leaves

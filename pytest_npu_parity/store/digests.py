"""Content fingerprints: whether a baseline still describes the current model and input.

* ``fingerprint_tensors(obj)`` — a BLAKE2b digest of a nested structure of tensors and scalars.
* ``fingerprint_module(module)`` — a BLAKE2b digest of a module's type and ``state_dict``,
  cached per module object and invalidated by in-place edits; ``module_tensor_digests`` the
  per-tensor digests behind it (a changed weight is named, never judged "close enough", see
  ``weights_changed``).
* ``tensor_bytes(tensor)`` — the raw C-order bytes every digest hashes; ``uninitialized(tensor)`` — a lazy
  module's parameter before its first forward.

The summaries that tell last-bit differences of recomputed inputs from a real change are in
:mod:`pytest_npu_parity.store.summaries`; the record of the run in :mod:`pytest_npu_parity.store.provenance`.
"""
from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..leaves import cache_fields
from ..structure import config_dict

__all__ = [
    "fingerprint_tensors",
    "fingerprint_module",
]

#: Digest size of every fingerprint, in bytes (BLAKE2b; 32 bytes = 64 hex characters).
DIGEST_SIZE = 32


def fingerprint_tensors(obj: Any) -> str:
    """Stable BLAKE2b hex digest (64 characters) of a nested structure.

    Leaves may be tensors (any device; hashed as dtype, shape and the raw bytes of a contiguous
    CPU copy — so ``-0.0`` and ``0.0``, or two NaN payloads, differ), numpy arrays (as tensors),
    ``None``, ``bool``/``int``/``float`` (floats exactly, via ``float.hex``), ``str``, ``bytes``,
    ``torch.dtype``, ``torch.device``, ``torch.Generator`` (its state: the numbers it will draw) and Hugging Face configs (a ``GenerationConfig`` passed to
    ``generate``: its ``structure.config_dict``, with the class name) and Hugging Face key/value
    caches (``past_key_values``: their ``compare.cache_fields``, with the class name). Containers are mappings (keys sorted by their string
    form, so insertion order does not matter), tuples and lists; every leaf's path
    (``["x"][0]``) is part of the digest, so the same numbers in a different structure differ.
    The device a tensor lives on is not part of the digest.

    The digest is the same across processes and machines of the same byte order (all supported
    platforms are little-endian).

    Raises:
        TypeError: for any other leaf type, naming its path.
    """
    hasher = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"npu-parity-in")
    _feed(hasher, obj, "")
    return hasher.hexdigest()


def _put(hasher: Any, *chunks: bytes) -> None:
    for chunk in chunks:
        hasher.update(len(chunk).to_bytes(8, "little"))
        hasher.update(chunk)


def _feed(hasher: Any, obj: Any, path: str) -> None:
    tag = path.encode("utf-8", "surrogatepass")
    if obj is None:
        _put(hasher, tag, b"none")
    elif isinstance(obj, torch.Tensor):
        _feed_tensor(hasher, tag, obj, path)
    elif isinstance(obj, bool):
        _put(hasher, tag, b"bool", b"1" if obj else b"0")
    elif isinstance(obj, int):
        _put(hasher, tag, b"int", str(obj).encode())
    elif isinstance(obj, float):
        text = obj.hex() if math.isfinite(obj) else repr(obj)
        _put(hasher, tag, b"float", text.encode())
    elif isinstance(obj, str):
        _put(hasher, tag, b"str", obj.encode("utf-8", "surrogatepass"))
    elif isinstance(obj, (bytes, bytearray)):
        _put(hasher, tag, b"bytes", bytes(obj))
    elif isinstance(obj, torch.dtype):
        _put(hasher, tag, b"dtype", str(obj).encode())
    elif isinstance(obj, torch.device):
        _put(hasher, tag, b"device", str(obj).encode())
    elif isinstance(obj, torch.Generator):  # a generator the computation draws from: its state decides the draws
        _put(hasher, tag, b"generator", obj.get_state().numpy().tobytes())
    elif type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "shape"):
        _feed_tensor(hasher, tag, torch.as_tensor(obj), path)
    elif isinstance(obj, Mapping):
        items = sorted(obj.items(), key=lambda kv: str(kv[0]))
        _put(hasher, tag, b"map", str(len(items)).encode())
        for key, value in items:
            _feed(hasher, value, f"{path}[{str(key)!r}]")
    elif isinstance(obj, Sequence):
        _put(hasher, tag, b"seq", str(len(obj)).encode())
        for i, value in enumerate(obj):
            _feed(hasher, value, f"{path}[{i}]")
    elif (fields := _cache_fields(obj)) is not None:  # past_key_values: a DynamicCache, an EncoderDecoderCache
        _put(hasher, tag, b"cache", type(obj).__name__.encode())
        _feed(hasher, fields, path)
    elif (config := _config_dict(obj)) is not None:  # a GenerationConfig passed to generate()
        _put(hasher, tag, b"config", type(obj).__name__.encode())
        _feed(hasher, config, path)
    else:
        where = repr(path) if path else "the top level"
        raise TypeError(
            f"cannot fingerprint a {type(obj).__name__} at {where}: use tensors, numbers, strings, "
            "None, Hugging Face configs, or tuples/lists/dicts of them"
        )


def _cache_fields(obj: Any) -> dict | None:
    return cache_fields(obj)


def _config_dict(obj: Any) -> dict | None:
    return config_dict(obj)


def _feed_tensor(hasher: Any, tag: bytes, tensor: torch.Tensor, path: str) -> None:
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    header = f"{tensor.dtype}|{tuple(tensor.shape)}".encode()
    if tensor.device.type == "meta":
        _put(hasher, tag, b"tensor-meta", header)
        return
    _put(hasher, tag, b"tensor", header)
    data = tensor_bytes(tensor)
    hasher.update(len(data).to_bytes(8, "little"))
    hasher.update(data)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw bytes of ``tensor`` in C order, as a read-only view of a contiguous CPU copy.

    Conjugate and negative views are materialized first, so the bytes are the values the tensor
    shows. Works for every dtype, including bfloat16, bool and complex.
    """
    flat = tensor.detach()
    if flat.is_complex():
        flat = flat.resolve_conj()
    flat = flat.resolve_neg().to("cpu").contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    raw = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    return memoryview(raw.numpy()).toreadonly()


_MODULE_CACHE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()


class _PerTensorCache:
    """Values cached per live tensor object (tensors compare elementwise, so no WeakKeyDictionary):
    keyed by ``id``, guarded by a weak reference that also drops the entry when the tensor dies."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[Any, tuple, Any]] = {}

    def get(self, tensor: torch.Tensor, key: tuple) -> Any:
        entry = self._data.get(id(tensor))
        if entry is not None and entry[0]() is tensor and entry[1] == key:
            return entry[2]
        return None

    def put(self, tensor: torch.Tensor, key: tuple, value: Any) -> None:
        ident = id(tensor)
        try:
            ref = weakref.ref(tensor, lambda _r, ident=ident: self._data.pop(ident, None))
        except TypeError:  # not weak-referenceable: do not cache
            return
        self._data[ident] = (ref, key, value)


_TENSOR_CACHE = _PerTensorCache()


def uninitialized(tensor: Any) -> bool:
    """Whether ``tensor`` is a lazy module's ``UninitializedParameter`` or ``UninitializedBuffer``
    (``nn.LazyLinear`` before its first forward): it has no shape, storage nor values yet."""
    return isinstance(tensor, torch.nn.parameter.UninitializedTensorMixin)


def _tensor_key(tensor: torch.Tensor) -> tuple:
    """What tells a tensor's bytes changed, cheaply: its storage pointer, autograd version counter,
    shape, strides, dtype and device (the torch objects themselves: ``Size``, ``dtype`` and ``device``
    compare by value, and building the key is a quarter cheaper than with their strings). A sparse
    tensor or an inference tensor gets a key equal to no other (it is hashed at every use)."""
    if uninitialized(tensor):
        return ("uninitialized", tensor.dtype)
    if tensor.layout != torch.strided or tensor.is_inference():
        # No storage pointer (sparse) or no version counter (made under torch.inference_mode): nothing
        # cheap tells its bytes changed, so a key equal to no other and the tensor hashed every time.
        return ("uncached", object())
    device = tensor.device
    return (tensor.data_ptr() if device.type != "meta" else 0, getattr(tensor, "_version", 0),
            tensor.shape, tensor.stride(), tensor.dtype, device)


def _tensor_digest(tensor: torch.Tensor, path: str) -> bytes:
    """SHA-256 digest of one tensor (dtype, shape, bytes; ``_hash_tensor``), cached per tensor object
    and version."""
    if uninitialized(tensor):  # a lazy module's parameter before its first forward: only its dtype
        return hashlib.sha256(b"npu-parity-uninit\0" + str(tensor.dtype).encode()).digest()
    key = _tensor_key(tensor)
    digest = _TENSOR_CACHE.get(tensor, key)
    if digest is None:
        digest = _hash_tensor(tensor, path)
        _TENSOR_CACHE.put(tensor, key, digest)
    return digest


#: Uncached tensor bytes above which ``fingerprint_module`` hashes tensors on several threads.
PARALLEL_HASH_BYTES = 32 * 2**20


def _digest_in_parallel(state: dict[str, torch.Tensor]) -> None:
    """Fill the per-tensor digest cache for ``state``'s uncached CPU tensors on up to
    ``torch.get_num_threads()`` threads (hashlib releases the GIL while it hashes a buffer), when
    there are more than ``PARALLEL_HASH_BYTES`` of them: the 0.8 GB of Aurora's weights hash in
    about half the time on two cores. The digests are the same as ``_tensor_digest``'s serially."""
    todo = [(name, t) for name, t in state.items()
            if not uninitialized(t) and t.device.type == "cpu" and t.layout == torch.strided and _TENSOR_CACHE.get(t, _tensor_key(t)) is None]
    workers = min(torch.get_num_threads(), 8, len(todo))
    if workers < 2 or sum(t.numel() * t.element_size() for _, t in todo) < PARALLEL_HASH_BYTES:
        return
    todo.sort(key=lambda item: -item[1].numel() * item[1].element_size())  # largest first: even shares
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="npu-parity-hash") as pool:
        digests = list(pool.map(lambda item: _hash_tensor(item[1], item[0]), todo))
    for (_, tensor), digest in zip(todo, digests):
        _TENSOR_CACHE.put(tensor, _tensor_key(tensor), digest)


def _hash_tensor(tensor: torch.Tensor, path: str) -> bytes:
    """SHA-256 of one tensor (dtype, shape, bytes). SHA-256 rather than BLAKE2b for weights: CPUs
    with SHA extensions (x86 since Ice Lake/Zen, Armv8.2 Kunpeng) hash it at 1.1 GB/s against
    BLAKE2b's 0.5 GB/s (measured on this project's Xeon), and a model's weights are the largest
    thing a session hashes."""
    hasher = hashlib.sha256(b"npu-parity-ten\0")
    _feed_tensor(hasher, b"", tensor, path)
    return hasher.digest()


def fingerprint_module(module: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> str:
    """BLAKE2b hex digest (64 characters) of a module's class and ``state_dict`` (each entry's name
    and the SHA-256 digest of its dtype, shape and bytes).

    Covers the class's qualified name and, for every ``state_dict`` entry (parameters and
    persistent buffers), its name, dtype, shape and bytes. The device is not part of it, so the
    same model on CPU and NPU has the same fingerprint. A lazy module's parameter that is not yet
    materialized (``nn.LazyLinear`` before its first forward, ``uninitialized``) counts by its name
    and dtype only: its values are drawn in the first forward, under the check's seed.

    The digest is cached per module object (weakly, so the cache never keeps a model alive) and
    recomputed when any entry's storage pointer, shape, dtype, device or autograd version counter
    (``tensor._version``) changes — i.e. after ``load_state_dict``, ``.to()``, or an in-place edit
    such as ``with torch.no_grad(): p.mul_(2)``. An edit through ``p.data`` bypasses the version
    counter (PyTorch gives ``.data`` its own counter) and is NOT seen; edit parameters under
    ``torch.no_grad()`` instead.

    ``state``: the module's ``state_dict(keep_vars=True)`` when the caller has just taken it (a check's
    fingerprints take it once for all their parts); taken here otherwise.

    Raises:
        TypeError: if ``module`` is not a ``torch.nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fingerprint_module expects a torch.nn.Module, got {type(module).__name__}")
    if state is None:
        state = module.state_dict(keep_vars=True)
    key = tuple((name, _tensor_key(t)) for name, t in state.items())
    cached = _MODULE_CACHE.get(module)
    if cached is not None and cached[0] == key:
        return cached[1]
    _digest_in_parallel(state)
    hasher = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"npu-parity-mod")
    kind = type(module)
    _put(hasher, f"{kind.__module__}.{kind.__qualname__}".encode())
    for name, tensor in state.items():
        # Per-tensor digests are cached on the tensor object: submodules that share weights with
        # their model (Aurora's ViT and BERT sit in VisionEncoder, TextEncoder, AuroraModel and
        # the full model) hash those bytes once, not once per module.
        _put(hasher, name.encode(), _tensor_digest(tensor, name))
    digest = hasher.hexdigest()
    _MODULE_CACHE[module] = (key, digest)
    return digest


#: Hex digits kept of each weight's digest in ``module_tensor_digests`` (64 bits: enough to name
#: the tensors that changed; the module's full fingerprint is ``fingerprint_module``).
TENSOR_DIGEST_HEX = 16


def module_tensor_digests(module: torch.nn.Module) -> dict[str, str]:
    """``{state_dict name: 16 hex digits of its SHA-256 digest}`` for every parameter and persistent
    buffer of ``module`` (digest over dtype, shape and bytes, as in ``fingerprint_module``; shared
    with it through the per-tensor cache, so after ``fingerprint_module`` this costs no hashing).

    Recorded in a baseline so that a change of weights names the tensors that changed: the seeded
    weights are bitwise reproducible, so any differing digest is a different model, never a last-bit
    difference.

    Raises:
        TypeError: if ``module`` is not a ``torch.nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module_tensor_digests expects a torch.nn.Module, got {type(module).__name__}")
    state = module.state_dict(keep_vars=True)
    _digest_in_parallel(state)
    return {name: _tensor_digest(t, name).hex()[:TENSOR_DIGEST_HEX] for name, t in state.items()}


def weights_changed(recorded: Mapping[str, str] | None, now: Mapping[str, str], shown: int = 3) -> str:
    """Describe how two ``module_tensor_digests`` differ: ``"weights changed (2 of 16 tensors, e.g.
    'fc1.weight', 'fc2.bias')"``, naming added and removed tensors too; ``"weights changed (no
    per-tensor digests recorded)"`` when ``recorded`` is None, ``"model class changed (same weights)"``
    when every digest agrees (the fingerprint also covers the class name)."""
    if recorded is None:
        return "weights changed (no per-tensor digests recorded)"
    changed = [n for n in now if n in recorded and recorded[n] != now[n]]
    added = [n for n in now if n not in recorded]
    removed = [n for n in recorded if n not in now]
    if not (changed or added or removed):
        return "model class changed (same weights)"
    total = len(set(now) | set(recorded))

    def names(items: list[str]) -> str:
        head = ", ".join(repr(n) for n in items[:shown])
        return head + (", …" if len(items) > shown else "")

    parts = []
    if changed:
        parts.append(f"{len(changed)} of {total} tensors differ, e.g. {names(changed)}")
    if added:
        parts.append(f"{len(added)} new: {names(added)}")
    if removed:
        parts.append(f"{len(removed)} gone: {names(removed)}")
    return "weights changed (" + "; ".join(parts) + ")"

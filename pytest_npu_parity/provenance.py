"""Provenance of a reference: where, when and with what software a baseline was recorded.

A stored baseline is only as trustworthy as what is known about the run that produced it. This
module gathers that record and computes the content fingerprints used to tell whether a baseline
still describes the current model and input:

* ``collect_provenance(device, recipe=..., seed=...)`` — a JSON-ready dict: plugin, torch,
  torch_npu, CANN, transformers and (when the run imported Aurora) aurora-model versions, Python
  and OS, torch's intra-op and inter-op thread counts, the device type and name, recipe, seed,
  precision flags, creation time (UTC) and the project's git revision; on an
  NPU also torch_npu's compile mode and the Ascend/HCCL environment (``ascend_environment``).
  The host name is deliberately left out (baselines are committed to git and shared).
* ``describe_provenance(prov)`` — the one-line summary that reports and failure messages print.
* ``fingerprint_tensors(obj)`` — a BLAKE2b digest of a nested structure of tensors and scalars.
* ``fingerprint_module(module)`` — a BLAKE2b digest of a module's type and ``state_dict``,
  cached per module object and invalidated by in-place edits; ``module_tensor_digests`` the
  per-tensor digests behind it (a changed weight is named, never judged "close enough").
* ``summarize_tensors(obj)`` / ``summaries_close`` — order-sensitive float64 summaries of inputs,
  which tell last-bit differences of recomputed activations from a real change.

Nothing here imports ``torch_npu``: on a machine without CANN that import can break ``import
torch`` itself (see docs/explanation/findings.md), so its version is read from package metadata unless the
module is already loaded.
"""
from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "collect_provenance",
    "describe_provenance",
    "fingerprint_tensors",
    "fingerprint_module",
]

#: Digest size of every fingerprint, in bytes (BLAKE2b; 32 bytes = 64 hex characters).
DIGEST_SIZE = 32

#: (implementer, part) codes from /proc/cpuinfo on Arm hosts -> marketing name. Ascend servers
#: usually run on HiSilicon Kunpeng 920 (implementer 0x48, part 0xd01), whose /proc/cpuinfo has no
#: "model name" line. Source: the Linux kernel's arch/arm64/include/asm/cputype.h.
_ARM_PARTS = {
    ("0x48", "0xd01"): "HiSilicon Kunpeng-920",
    ("0x41", "0xd0c"): "Arm Neoverse-N1",
    ("0x41", "0xd40"): "Arm Neoverse-V1",
    ("0x41", "0xd4f"): "Arm Neoverse-V2",
    ("0x41", "0xd49"): "Arm Neoverse-N2",
}


# --------------------------------------------------------------------------------------------
# provenance record


def collect_provenance(
    device: torch.device | str,
    *,
    recipe: str,
    seed: int | None,
    precision_flags: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """Describe the current run as a JSON-serializable provenance record.

    Args:
        device: the device the recorded outputs were computed on (``cpu``, ``cuda:0``, ``npu:1``).
        recipe: the precision recipe (``fp32``, ``bf16``, ...).
        seed: the seed the check ran under, or ``None``.
        precision_flags: device numerics switches in force (TF32/HF32 and the like), as
            ``name -> bool/str/number``.
        extra: further JSON-serializable fields (input specification, config hash, ...); they are
            merged at the top level and take precedence over the collected keys.

    Returns:
        A dict with the keys ``plugin_version, torch, cuda, torch_npu, cann, transformers,
        aurora_model, python, platform, threads, interop_threads, device_type, device_index,
        device_name, recipe, seed, precision_flags, created, git_revision, git_dirty``; for an NPU
        device also ``npu_compile_mode`` (:func:`npu_compile_mode`) and ``ascend_env``
        (:func:`ascend_environment`). Versions
        of absent packages and an unknown git revision are ``None``; ``aurora_model`` is None unless
        the ``aurora`` package is imported in this process (a project without Aurora does not
        depend on its version). ``threads``/``interop_threads`` are ``torch.get_num_threads()`` /
        ``torch.get_num_interop_threads()``: bf16 CPU kernels block their reductions by thread
        count, so a bf16 CPU baseline depends on it (docs/explanation/verdict-accuracy.md). ``created`` is UTC ISO-8601 to the second
        (``2026-11-30T09:27:05+00:00``). The host name is never included.

    Raises:
        TypeError: when ``precision_flags`` or ``extra`` hold a value JSON cannot encode; the
            message names the key.

    Never raises for missing packages, a missing ``git`` or an unreadable device name.
    """
    device = torch.device(device)
    revision, dirty = _git_state(os.getcwd())
    prov: dict[str, Any] = {
        "plugin_version": _plugin_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torch_npu": _torch_npu_version(),
        "cann": _cann_version(),
        "transformers": _dist_version("transformers"),
        "aurora_model": _dist_version("aurora-model") if "aurora" in sys.modules else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "device_type": device.type,
        "device_index": device.index,
        "device_name": device_name(device),
        "recipe": recipe,
        "seed": seed,
        "precision_flags": dict(precision_flags or {}),
        "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "git_revision": revision,
        "git_dirty": dirty,
    }
    if device.type == "npu":  # only there: on other targets torch_npu's runtime is not touched
        prov["npu_compile_mode"] = npu_compile_mode()
        prov["ascend_env"] = ascend_environment()
    for key, value in (extra or {}).items():
        prov[str(key)] = value
    for key, value in prov.items():
        try:
            json.dumps(value, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"provenance field {key!r} is not JSON-serializable ({type(value).__name__}): {exc}; "
                "pass strings, numbers, booleans, None, or lists/dicts of them"
            ) from None
    return prov


#: Environment variables that change what torch_npu, CANN or HCCL compute or how they behave, recorded
#: by name (``ascend_environment``) besides every ``ASCEND_*`` and ``HCCL_*`` variable. Sources: the seed
#: guides (000 §7.3/§9.2/§9.3: ``HCCL_TIMEOUT``, ``HCCL_BUFFSIZE``, ``PYTORCH_NPU_ALLOC_CONF``; 001 §0.1/§0.5:
#: ``ASCEND_RT_VISIBLE_DEVICES``, ``ASCEND_GLOBAL_LOG_LEVEL``, ``ASCEND_SLOG_PRINT_TO_STDOUT``,
#: ``ASCEND_AICPU_PATH``) and the variables the torch_npu 2.5.1 wheel reads (``torch_npu/lib/libtorch_npu.so``
#: strings and its Python sources): ``INF_NAN_MODE_ENABLE`` / ``INF_NAN_MODE_FORCE_DISABLE`` (inf/NaN vs
#: saturation mode of fp16 overflow, which the GradScaler's overflow check depends on), ``TASK_QUEUE_ENABLE``,
#: ``ASCEND_LAUNCH_BLOCKING``, ``MULTI_STREAM_MEMORY_REUSE``, ``COMBINED_ENABLE``, ``P2P_HCCL_BUFFSIZE``,
#: ``HCCL_DETERMINISTIC``, ``HCCL_ALGO``, ``HCCL_EXEC_TIMEOUT``, ``HCCL_CONNECT_TIMEOUT``, ``NPU_ASD_*``
#: (silent-data-corruption detection), ``ACLNN_CACHE_LIMIT``, ``ENABLE_ACLNN``, ``CPU_AFFINITY_CONF``,
#: ``NPU_FUZZY_COMPILE_BLACKLIST``, ``HOST_CACHE_CAPACITY``.
ASCEND_ENV_NAMES: tuple[str, ...] = (
    "PYTORCH_NPU_ALLOC_CONF", "INF_NAN_MODE_ENABLE", "INF_NAN_MODE_FORCE_DISABLE", "TASK_QUEUE_ENABLE",
    "MULTI_STREAM_MEMORY_REUSE", "COMBINED_ENABLE", "P2P_HCCL_BUFFSIZE", "NPU_ASD_ENABLE",
    "NPU_ASD_SIGMA_THRESH", "NPU_ASD_UPPER_THRESH", "ACLNN_CACHE_LIMIT", "ENABLE_ACLNN", "CPU_AFFINITY_CONF",
    "NPU_FUZZY_COMPILE_BLACKLIST", "HOST_CACHE_CAPACITY",
)
#: Prefixes of the recorded variables (CANN's ``ASCEND_*``, HCCL's ``HCCL_*``).
ASCEND_ENV_PREFIXES: tuple[str, ...] = ("ASCEND_", "HCCL_")
#: Value recorded for a location variable (name ending in ``_PATH`` or ``_HOME``): that it is set
#: counts (e.g. ``ASCEND_CUSTOM_OPP_PATH`` swaps kernels), the directory names a machine, not a
#: setting, and baselines are shared (CANN's version is recorded on its own).
LOCATION_SET = "<set>"


def ascend_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Ascend/HCCL environment variables of this run that change numerics or behaviour.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``{name: value}`` sorted by name, for every variable named in ``ASCEND_ENV_NAMES`` or starting
        with one of ``ASCEND_ENV_PREFIXES``; a location variable (``*_PATH``, ``*_HOME``) is recorded
        as ``LOCATION_SET``. Empty when none is set.
    """
    environ = os.environ if environ is None else environ
    found = {}
    for name in sorted(environ):
        if name in ASCEND_ENV_NAMES or name.startswith(ASCEND_ENV_PREFIXES):
            found[name] = LOCATION_SET if name.endswith(("_PATH", "_HOME")) else str(environ[name])
    return found


def npu_compile_mode() -> str | None:
    """torch_npu's operator compile mode in force: ``"jit_compile=False"`` (CANN's precompiled binary
    kernels, what the guide's launcher sets, seed §9.4) or ``"jit_compile=True"`` (online compilation,
    torch_npu's default), read with ``torch_npu.npu.is_jit_compile_false()`` (torch_npu 2.5.1
    ``torch_npu/npu/npu_config.py``); None when torch_npu is not loaded or cannot answer. Only
    called for an NPU device (the call initializes the NPU runtime)."""
    module = sys.modules.get("torch_npu")
    getter = getattr(getattr(module, "npu", None), "is_jit_compile_false", None)
    if getter is None:
        return None
    try:
        return f"jit_compile={not bool(getter())}"
    except Exception:  # a broken runtime must not stop a provenance record
        return None


def describe_provenance(prov: Mapping[str, Any] | None) -> str:
    """One line naming a baseline's device, date, versions and revision.

    Example: ``"cuda (NVIDIA H200) · 2026-11-30 · torch 2.14.1 · recipe bf16 · git ab12cd3"``;
    on an NPU the torch_npu and CANN versions follow the torch version; a CPU record names its
    intra-op thread count before the recipe (``· 2 threads · recipe bf16``). Missing fields are left
    out; an empty or ``None`` record gives ``"unknown provenance"``.
    """
    if not prov:
        return "unknown provenance"
    device_type = prov.get("device_type") or "unknown device"
    name = prov.get("device_name")
    parts = [f"{device_type} ({name})" if name and name != device_type else str(device_type)]
    created = prov.get("created")
    if created:
        parts.append(str(created)[:10])
    for key, label in (("torch", "torch"), ("torch_npu", "torch_npu"), ("cann", "CANN")):
        if prov.get(key):
            parts.append(f"{label} {prov[key]}")
    if device_type == "cpu" and prov.get("threads"):  # a CPU result's bf16 reductions depend on it
        parts.append(f"{prov['threads']} thread{'s' * (prov['threads'] != 1)}")
    if prov.get("recipe"):
        parts.append(f"recipe {prov['recipe']}")
    revision = prov.get("git_revision")
    if revision:
        parts.append(f"git {str(revision)[:7]}" + ("+dirty" if prov.get("git_dirty") else ""))
    return " · ".join(parts)


def device_name(device: torch.device | str) -> str:
    """Human-readable name of ``device``: CPU model, ``torch.cuda.get_device_name`` (e.g.
    ``"NVIDIA H200"``) or ``torch.npu.get_device_name`` (e.g. ``"Ascend910B"``).

    Falls back to ``str(device)`` when the name cannot be read; never raises.
    """
    device = torch.device(device)
    try:
        if device.type == "cpu":
            return _cpu_model()
        if device.type == "cuda":
            return str(torch.cuda.get_device_name(device))
        module = getattr(torch, device.type, None)
        getter = getattr(module, "get_device_name", None)
        if getter is not None:
            return str(getter(device.index if device.index is not None else 0))
    except Exception:  # a broken driver must not stop a provenance record
        pass
    return str(device)


@functools.lru_cache(maxsize=4)
def _cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """CPU model from ``cpuinfo`` (x86 "model name", or Arm implementer/part codes), else
    ``platform.processor()``/``platform.machine()``."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key.strip() not in fields:
                    fields[key.strip()] = value.strip()
    except OSError:
        pass
    for key in ("model name", "Model Name", "cpu model"):
        if fields.get(key):
            return " ".join(fields[key].split())
    implementer, part = fields.get("CPU implementer", "").lower(), fields.get("CPU part", "").lower()
    if implementer and part:
        return _ARM_PARTS.get((implementer, part), f"Arm CPU (implementer {implementer}, part {part})")
    if fields.get("Processor"):
        return " ".join(fields["Processor"].split())
    return platform.processor() or platform.machine() or "cpu"


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:
        return None


def _plugin_version() -> str | None:
    version = _dist_version("pytest-npu-parity")
    if version is None:
        package = sys.modules.get(__package__ or "pytest_npu_parity")
        version = getattr(package, "__version__", None)
    return version


def _torch_npu_version() -> str | None:
    module = sys.modules.get("torch_npu")
    version = getattr(module, "__version__", None)
    if version:
        return str(version)
    return _dist_version("torch-npu") or _dist_version("torch_npu")


def _cann_version() -> str | None:
    try:
        from . import npu  # optional engine module; reads CANN's version files without torch_npu
    except ImportError:
        return None
    getter = getattr(npu, "cann_version", None)
    if getter is None:
        return None
    try:
        version = getter()
    except Exception:
        return None
    return None if version is None else str(version)


def _git_state(cwd: str) -> tuple[str | None, bool | None]:
    """(``git rev-parse HEAD``, whether tracked files differ from it) in ``cwd``; never raises."""
    return _git_state_cached(cwd)


@functools.lru_cache(maxsize=8)
def _git_state_cached(cwd: str) -> tuple[str | None, bool | None]:
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    revision = git("rev-parse", "--verify", "--quiet", "HEAD")
    if not revision:
        return None, None
    status = git("status", "--porcelain", "--untracked-files=no")
    return revision, (None if status is None else bool(status))


# --------------------------------------------------------------------------------------------
# fingerprints


def fingerprint_tensors(obj: Any) -> str:
    """Stable BLAKE2b hex digest (64 characters) of a nested structure.

    Leaves may be tensors (any device; hashed as dtype, shape and the raw bytes of a contiguous
    CPU copy — so ``-0.0`` and ``0.0``, or two NaN payloads, differ), numpy arrays (as tensors),
    ``None``, ``bool``/``int``/``float`` (floats exactly, via ``float.hex``), ``str``, ``bytes``,
    ``torch.dtype``, ``torch.device`` and Hugging Face configs (a ``GenerationConfig`` passed to
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
    from .leaves import cache_fields

    return cache_fields(obj)


def _config_dict(obj: Any) -> dict | None:
    from .structure import config_dict

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
    if uninitialized(tensor):
        return ("uninitialized", str(tensor.dtype))
    return (tensor.data_ptr() if tensor.device.type != "meta" else 0, getattr(tensor, "_version", 0),
            tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype), str(tensor.device))


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
    from concurrent.futures import ThreadPoolExecutor

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


def fingerprint_module(module: torch.nn.Module) -> str:
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

    Raises:
        TypeError: if ``module`` is not a ``torch.nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fingerprint_module expects a torch.nn.Module, got {type(module).__name__}")
    state = module.state_dict(keep_vars=True)
    key = tuple(
        (name, "uninitialized", str(t.dtype)) if uninitialized(t) else
        (name, t.data_ptr() if t.device.type != "meta" else 0, getattr(t, "_version", 0),
         tuple(t.shape), str(t.dtype), str(t.device))
        for name, t in state.items()
    )
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


# --------------------------------------------------------------------------------------------
# summaries: staleness that survives last-bit differences between machines

#: Relative difference under which two input summaries describe the same data. Recomputing the
#: same activations on another CPU (x86-64 vs the Arm hosts of Ascend
#: servers, other SIMD paths or thread counts) changes last bits (~1e-7 relative); a different
#: input window, seed or checkpoint changes these sums at O(1e-2) or more.
SUMMARY_RTOL = 1e-4


#: Elements per block of the position-weighted sum (bounds the float64 temporaries it needs).
_PROJECTION_BLOCK = 1 << 20


def _position_weights(start: int, stop: int) -> torch.Tensor:
    """Weights in [-1, 1) of the flat positions ``start..stop-1``, float64: MurmurHash3's 32-bit
    finalizer of the position, scaled to [-1, 1). Integer arithmetic only (int64, low 32 bits), so
    every machine and torch version computes the same weights; a hash rather than a linear sequence,
    so that the weights of one row and of another are unrelated (a row swap always moves the sum)."""
    mask = 0xFFFFFFFF
    h = torch.arange(start, stop, dtype=torch.int64)
    h = (h ^ (h >> 32)) & mask
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & mask  # the product wraps in int64; its low 32 bits are exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & mask
    h = h ^ (h >> 16)
    return h.to(torch.float64) / float(1 << 31) - 1.0


def _position_weighted_sum(flat: torch.Tensor) -> float:
    """``sum_i w_i * x_i`` over a flat CPU tensor with ``_position_weights``, accumulated in float64."""
    total = 0.0
    for start in range(0, flat.numel(), _PROJECTION_BLOCK):
        block = flat[start:start + _PROJECTION_BLOCK].to(torch.float64)
        total += float((block * _position_weights(start, start + block.numel())).sum())
    return total


def _leaf_summary(name: str, tensor: torch.Tensor) -> list:
    t = tensor.detach()
    if t.device.type != "cpu":  # float64 reductions need the CPU (NPUs have no fp64)
        t = t.to("cpu")
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.numel() == 0:
        return [name, 0, 0.0, 0.0, 0.0, 0.0]
    if not t.is_floating_point():  # integer / bool leaves: small, exact in float64
        t = t.to(torch.float64)
    # Reductions accumulate in float64 without a float64 copy of the tensor (2.4x faster on a
    # 200 MB weight set than converting first; the totals agree to ~1e-12 relative).
    low, high = torch.aminmax(t)
    return [name, int(t.numel()), float(t.sum(dtype=torch.float64)),
            float(torch.linalg.vector_norm(t, dtype=torch.float64)) ** 2, max(-float(low), float(high)),
            _position_weighted_sum(t.reshape(-1))]


def summarize_tensors(obj: Any) -> list:
    """Per tensor leaf of a nested structure: ``[path, numel, sum, sum of squares, max |x|,
    position-weighted sum]`` (float64 numbers; ``path`` as ``.key``/``[i]``; a Hugging Face
    key/value cache is walked as its ``compare.cache_fields``).

    The position-weighted sum ``sum_i w_i x_i`` (``w_i`` in [-1, 1) a hash of the flat position
    ``i``) makes the summary order-sensitive: the same values in another order (rows swapped, a
    transposed copy) change it by about the norm of what moved, while the other four numbers do
    not change at all. Used with ``summaries_close`` to tell a real change of input (another
    window, another seed, another order) from last-bit differences of the same computation on
    another machine.
    """
    out: list = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            out.append(_leaf_summary(path, value))
        elif isinstance(value, Mapping):
            for k in sorted(value, key=str):
                walk(value[k], f"{path}.{k}")
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")
        elif (fields := _cache_fields(value)) is not None:  # a key/value cache: its layers' tensors
            walk(fields, path)

    walk(obj, "")
    return out


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


def summaries_close(recorded: list | None, now: list, rtol: float = SUMMARY_RTOL) -> str | None:
    """``None`` when two summaries (``summarize_tensors``) agree within ``rtol``, else a short
    description of the first difference.

    Sums are compared relative to the leaf's scale (``sqrt(numel * sum of squares)``, a bound of
    |sum|), so a sum that is near zero by cancellation is not over-sensitive. The position-weighted
    sum is compared relative to the leaf's L2 norm (its typical size): last-bit differences move it
    by ~1e-7 of the norm, two swapped rows of ``m`` elements out of ``n`` by about
    ``sqrt(2m/n)`` of it. A row of another length (a summary of an older layout) is a difference.
    """
    if recorded is None:
        return "no summary recorded"
    if len(recorded) != len(now):
        return f"{len(recorded)} tensors recorded, {len(now)} now"
    for row_a, row_b in zip(recorded, now):
        if len(row_a) != 6 or len(row_b) != 6:
            return f"summary of {row_a[0] if row_a else '?'} has an unknown layout; re-record"
        (name_a, n_a, s_a, q_a, m_a, p_a), (name_b, n_b, s_b, q_b, m_b, p_b) = row_a, row_b
        if name_a != name_b or n_a != n_b:
            return f"tensor {name_a or '<input>'} ({n_a} elements) vs {name_b or '<input>'} ({n_b} elements)"
        scale = math.sqrt(max(n_a, 1) * max(q_a, q_b)) or 1.0
        norm = math.sqrt(max(q_a, q_b)) or 1.0
        for label, a, b, ref in (("sum", s_a, s_b, scale), ("sum of squares", q_a, q_b, max(q_a, q_b) or 1.0),
                                 ("max |x|", m_a, m_b, max(m_a, m_b) or 1.0),
                                 ("position-weighted sum (the order of its values)", p_a, p_b, norm)):
            if abs(a - b) > rtol * ref:
                return f"{label} of {name_a or '<input>'} differs: recorded {a:.9g}, now {b:.9g}"
    return None

"""The store's object pool: content-addressed tensors shared by every baseline file of a store
(``<root>/.objects/``).

:class:`ObjectPool` writes (idempotently) and reads (re-hashing every object) the pool's objects, named by
:func:`object_digest`; :class:`PoolObjectError` says why an object cannot be used; :func:`_object_refs`
reads which objects a baseline file references from its header alone (what
:meth:`~pytest_npu_parity.store.suites.SuiteStores.orphan_objects` and ``baselines prune`` rely on).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from .files import _atomic_write, _fd_path, _kind
from .format import (OBJECT_FORMAT, OBJECTS_DIR, SUFFIX, _OBJECT_NAME, _OBJECT_REF_RE, CorruptBaselineError,
                     _cpu_copy, _dtype_name, _show)

__all__ = ["ObjectPool", "PoolObjectError", "object_digest"]


class PoolObjectError(Exception):
    """A pool object cannot be used: ``reason`` says why (missing, not a regular file, not a pool object,
    content that does not hash to its name); ``path`` is the object's file. :func:`_read` turns it into a
    :class:`CorruptBaselineError` naming the baseline file and the check that references it."""

    def __init__(self, reason: str, path: Path):
        super().__init__(f"{_show(path)} {reason}")
        self.reason = reason
        self.path = path


def object_digest(tensor: torch.Tensor) -> str:
    """The name of a tensor's pool object: BLAKE2b-256 (64 hex digits, personalization ``npu-parity-obj``)
    over its dtype name and shape (length-prefixed) and its raw C-order bytes.

    Args:
        tensor: a CPU tensor of any dtype (bfloat16 and bool included); non-contiguous, conjugate or
            negative views are hashed as the values they show.

    The digest depends on nothing but those values, so every file, process and machine (of the same byte
    order; all supported platforms are little-endian) names the same tensor alike.
    """
    t = _cpu_copy(tensor) if (not tensor.is_contiguous() or tensor.device.type != "cpu" or tensor.is_conj()
                              or tensor.is_neg() or tensor.layout != torch.strided) else tensor.detach()
    hasher = hashlib.blake2b(digest_size=32, person=b"npu-parity-obj")
    header = f"{_dtype_name(t.dtype)}|{','.join(str(int(d)) for d in t.shape)}".encode()
    hasher.update(len(header).to_bytes(8, "little"))
    hasher.update(header)
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    hasher.update(memoryview(flat.numpy()))
    return hasher.hexdigest()


class ObjectPool:
    """Content-addressed tensors shared by every baseline file of a store: ``<root>/.objects/`` (:data:`OBJECTS_DIR`).

    Each object is one safetensors file holding one tensor under the key ``"tensor"``, with metadata
    ``format`` (:data:`OBJECT_FORMAT`) and ``digest``, named by its :func:`object_digest` and fanned out by the
    first two hex digits, as git stores loose objects: ``<root>/.objects/3f/<62 hex digits>.safetensors``.
    A baseline file references an object from a check record (``extras: {"weight:h.0.attn.c_attn.weight":
    "object:<64 hex>"}``); that record is covered by the file's checksum, and the object by its name: it is
    re-hashed on every read.

    Writes are idempotent (:meth:`put`): the name is the content, so concurrent writers of one object
    (pytest-xdist workers recording the fp32 and the bf16 file of a test) write the same bytes, each through
    its own temporary file and ``os.replace``; whichever rename comes last leaves one complete, valid object.
    Objects are never loaded with pickle. Objects no file references any more are removed by
    :meth:`SuiteStores.prune_objects` (under the store's lock).

    Args:
        root: the baseline store root (``--baseline-dir``).
    """

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.dir = self.root / OBJECTS_DIR

    def path_for(self, digest: str) -> Path:
        """The file of the object ``digest`` (64 lower-case hex digits; the file need not exist).

        Raises:
            ValueError: ``digest`` is not 64 lower-case hex digits.
        """
        if not re.fullmatch(r"[0-9a-f]{64}", digest or ""):
            raise ValueError(f"a pool object's digest is 64 lower-case hex digits, got {digest!r}")
        return self.dir / digest[:2] / (digest[2:] + SUFFIX)

    def put(self, tensor: torch.Tensor) -> str:
        """Store ``tensor`` (detached, contiguous CPU copy in its own dtype) and return its digest.

        An existing object of that name is kept when it verifies (:meth:`get`), else replaced, so that a
        re-record repairs a corrupt or truncated object. Raises ``OSError`` when the pool cannot be written.
        """
        copy = _cpu_copy(tensor)
        digest = object_digest(copy)
        path = self.path_for(digest)
        if path.exists():
            try:
                self.get(digest)
                return digest
            except PoolObjectError:
                pass
        _atomic_write(path, save({"tensor": copy}, metadata={"format": OBJECT_FORMAT, "digest": digest}))
        return digest

    def get(self, digest: str) -> torch.Tensor:
        """The tensor of object ``digest``, verified: its content must hash to its name.

        Raises:
            PoolObjectError: the object is missing, is not a regular file, is a pickle/zip file (refused,
                never loaded), is not a pool object of this plugin, or its tensor does not hash to ``digest``.
        """
        path = self.path_for(digest)
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise PoolObjectError("is not a regular file", path)
        try:
            with open(path, "rb") as fh:
                kind = _kind(fh.read(9))
                if kind == "pickle":
                    raise PoolObjectError("is a pickle / torch.save file (refused, never loaded)", path)
                if kind != "safetensors":
                    raise PoolObjectError("is corrupt: truncated or not a safetensors file", path)
                try:
                    with safe_open(_fd_path(fh, path), framework="pt") as handle:
                        meta = handle.metadata() or {}
                        keys = list(handle.keys())
                        tensor = handle.get_tensor("tensor") if keys == ["tensor"] else None
                except Exception as exc:  # safetensors raises its own SafetensorError
                    raise PoolObjectError(f"is corrupt or truncated ({exc})", path) from None
        except FileNotFoundError:
            raise PoolObjectError("is missing", path) from None
        except OSError as exc:
            raise PoolObjectError(f"cannot be read ({exc})", path) from None
        if tensor is None or meta.get("format") != OBJECT_FORMAT:
            raise PoolObjectError(f"is not a {OBJECT_FORMAT} file (keys {keys[:3]})", path)
        actual = object_digest(tensor)
        if actual != digest:
            raise PoolObjectError(f"is corrupt: its tensor hashes to {actual[:12]}…, not to the digest its name "
                                  "gives (disk error, bad merge or hand edit)", path)
        return tensor

    def objects(self) -> list[tuple[str, Path]]:
        """``(digest, path)`` of every object file in the pool, sorted (temporary files excluded)."""
        found = []
        if not self.dir.is_dir():
            return found
        for fan in sorted(self.dir.iterdir()):
            if not (fan.is_dir() and re.fullmatch(r"[0-9a-f]{2}", fan.name)):
                continue
            for entry in sorted(fan.iterdir()):
                if _OBJECT_NAME.match(entry.name):
                    found.append((fan.name + entry.name[: -len(SUFFIX)], entry))
        return found


def _object_refs(path: Path) -> set[str]:
    """Digests of the pool objects the baseline file ``path`` references (its header only).

    Raises:
        CorruptBaselineError: the header cannot be read (then the caller cannot know what it references).
    """
    try:
        with open(path, "rb") as fh:
            if _kind(fh.read(9)) != "safetensors":
                raise CorruptBaselineError(f"baseline {_show(path)} is not a safetensors file", path)
            fh.seek(0)
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        records = json.loads((header.get("__metadata__") or {}).get("checks") or "{}")
        keys = [key for record in records.values() for key in (record.get("extras") or {}).values()]
    except CorruptBaselineError:
        raise
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise CorruptBaselineError(f"baseline {_show(path)} has an unreadable header ({exc})", path) from None
    return {m.group(1) for key in keys if isinstance(key, str) and (m := _OBJECT_REF_RE.match(key))}

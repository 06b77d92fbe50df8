"""Reading one baseline file: validated, decoded and verified against its checksum, never unpickled.

:func:`_read` opens the file once and :func:`_read_open` validates its header and memory-maps its tensors
through that same descriptor (so a concurrent replace cannot mix two versions); :func:`_read_pooled` then
fills each check's extras with the pool objects it references, each re-hashed.
"""
from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .encoding import _content_hash, _fingerprint_checks
from .files import _fd_path, _kind
from .format import (FORMAT, FORMAT_VERSION, OLDEST_READABLE, POOL_VERSION, POOLED_KINDS, UPDATE_COMMAND,
                     _OBJECT_REF_RE, Baseline, BaselineError, CheckBaseline, CorruptBaselineError,
                     StaleBaselineError, UnsafeBaselineError, _show)
from .pool import ObjectPool, PoolObjectError


def _read(path: Path, rerecord: str | None = None, pool: "ObjectPool | None" = None) -> Baseline:
    """Read, validate and decode one baseline file (see :meth:`BaselineStore.load`).

    The header is read and validated through one open file descriptor, and the tensors are
    memory-mapped by ``safetensors.safe_open`` through that same descriptor (``/proc/self/fd/N``,
    ``/dev/fd/N``), so a concurrent ``os.replace`` by another writer yields either the old or the
    new version, never a header of one and data of the other. Tensors are views of a private
    (copy-on-write) mapping of the file: pages are read when the checksum or a comparison touches
    them and can be dropped by the OS, instead of holding the file's bytes plus a decoded copy.

    Extras referenced as ``"object:<digest>"`` (format version 4) are read from ``pool`` after the file's
    checksum verified, each re-hashed (:meth:`ObjectPool.get`); a missing or corrupt object raises
    :class:`CorruptBaselineError` naming this file, the check, the object's path and the re-record command.
    """
    shown = _show(path)
    try:
        with open(path, "rb") as fh:
            return _read_open(path, shown, fh, rerecord, pool)
    except IsADirectoryError:
        raise CorruptBaselineError(f"baseline {shown} is a directory, not a file", path) from None
    except OSError as exc:
        raise CorruptBaselineError(f"baseline {shown} cannot be read: {exc}", path) from None


def _read_open(path: Path, shown: str, fh: Any, rerecord: str | None = None,
               pool: "ObjectPool | None" = None) -> Baseline:
    """Read the baseline file open as ``fh`` (see :func:`_read`): its header, format version and metadata,
    its tensors, its check records, its checksum, then the pool objects its checks reference."""
    metadata = _read_header(path, shown, fh)
    version = _format_version(path, shown, metadata, rerecord)
    test_id, provenance, records, stored_hash = _read_metadata(path, shown, metadata)
    try:
        with safe_open(_fd_path(fh, path), framework="pt") as handle:
            stored = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CorruptBaselineError(f"baseline {shown} is corrupt or truncated: {exc}; delete it and re-record", path) from None
    checks, referenced, hashed_extras = _decode_checks(path, shown, records, stored, version)
    tensor_hash = _fingerprint_checks({name: (c.tensors, hashed_extras[name]) for name, c in checks.items()})
    if _content_hash(metadata, tensor_hash) != stored_hash:
        raise CorruptBaselineError(
            f"baseline {shown} fails its checksum: its tensors or metadata (test id, provenance, check "
            "records) changed after it was written (disk error, bad merge or hand edit); its provenance "
            "cannot be trusted either. Delete it and re-record",
            path,
        )
    _read_pooled(path, shown, checks, referenced, pool, rerecord or f"{UPDATE_COMMAND} {shlex.quote(test_id)}")
    return Baseline(path=path, provenance=provenance, checks=checks, test_id=test_id, tensor_hash=tensor_hash)


def _read_header(path: Path, shown: str, fh: Any) -> dict:
    """The ``__metadata__`` of the safetensors header of ``fh``; a pickle, truncated or non-safetensors
    file is refused first, from its first bytes."""
    size = os.fstat(fh.fileno()).st_size
    kind = _kind(fh.read(9))
    if kind == "pickle":
        raise UnsafeBaselineError(
            f"refusing {shown}: it is a pickle / torch.save file, which can run code when loaded; "
            "baselines must be safetensors — delete it and re-record",
            path,
        )
    if kind != "safetensors":
        what = f"truncated ({size} bytes)" if kind == "short" else "not a safetensors file (bad header)"
        raise CorruptBaselineError(f"baseline {shown} is corrupt: {what}; delete it and re-record", path)
    fh.seek(0)
    header_len = int.from_bytes(fh.read(8), "little")
    if 8 + header_len > size:
        raise CorruptBaselineError(
            f"baseline {shown} is truncated: its header needs {8 + header_len} bytes, the file has "
            f"{size}; delete it and re-record",
            path,
        )
    try:
        header = json.loads(fh.read(header_len))
        return header.get("__metadata__") or {}
    except (ValueError, AttributeError) as exc:
        raise CorruptBaselineError(f"baseline {shown} has a corrupt header ({exc}); delete it and re-record", path) from None


def _format_version(path: Path, shown: str, metadata: dict, rerecord: str | None) -> int:
    """The file's format version, when it is a file of this plugin in a version it reads."""
    if metadata.get("format") != FORMAT:
        raise CorruptBaselineError(
            f"baseline {shown} is a safetensors file but not a {FORMAT} file "
            f"(format={metadata.get('format')!r}); delete it and re-record",
            path,
        )
    try:
        version = int(metadata.get("format_version", ""))
    except ValueError:
        raise CorruptBaselineError(f"baseline {shown} has an unreadable format_version", path) from None
    if version > FORMAT_VERSION:
        raise BaselineError(
            f"baseline {shown} uses format version {version}, newer than this plugin reads "
            f"({FORMAT_VERSION}); upgrade pytest-npu-parity",
            path,
        )
    if version < OLDEST_READABLE:
        raise StaleBaselineError(
            f"baseline {shown} uses format version {version}; this plugin reads versions {OLDEST_READABLE} to "
            f"{FORMAT_VERSION} "
            "(whose checksum also covers the test id, provenance and check records, and which records "
            "per-tensor weight digests and order-sensitive input summaries). Re-record it"
            + (f" with: {rerecord}" if rerecord else " with pytest --update-baselines"),
            path,
        )
    return version


def _read_metadata(path: Path, shown: str, metadata: dict) -> tuple[str, dict, dict, Any]:
    """``(test id, provenance, check records, stored content hash)`` of the file's metadata."""
    test_id = metadata.get("test_id")
    if not isinstance(test_id, str) or not test_id:
        raise CorruptBaselineError(f"baseline {shown} has no test_id in its metadata; delete it and re-record", path)
    try:
        provenance = json.loads(metadata["provenance"])
        records = json.loads(metadata["checks"])
        stored_hash = metadata["content_hash"]
    except (KeyError, ValueError) as exc:
        raise CorruptBaselineError(f"baseline {shown} has unreadable metadata ({exc!r}); re-record it", path) from None
    if not isinstance(records, dict) or not isinstance(provenance, dict):
        raise CorruptBaselineError(f"baseline {shown} has malformed metadata; re-record it", path)
    return test_id, provenance, records, stored_hash


def _decode_checks(path: Path, shown: str, records: dict, stored: dict[str, torch.Tensor], version: int,
                   ) -> tuple[dict[str, CheckBaseline], dict[str, dict[str, str]], dict[str, dict[str, Any]]]:
    """The checks of the file's records over its ``stored`` tensors, ``(checks, referenced, hashed extras)``:
    ``referenced`` maps each check to ``{extra name: digest}`` of the pool objects it references (filled
    later, by :func:`_read_pooled`), ``hashed extras`` to the extras as the checksum covers them (a pool
    object by its key). Every stored tensor must belong to a check."""
    used: set[str] = set()
    checks: dict[str, CheckBaseline] = {}
    referenced: dict[str, dict[str, str]] = {}  # check -> {extra name: digest} of pool objects
    hashed_extras: dict[str, dict[str, Any]] = {}
    for name, record in records.items():
        try:
            leaves = dict(record["leaves"])
            none_leaves = list(record["none_leaves"])
            meta = dict(record["meta"])
        except (KeyError, TypeError, ValueError):
            raise CorruptBaselineError(f"baseline {shown} has a malformed entry for check {name!r}", path) from None
        missing = [key for key in leaves.values() if key not in stored]
        if missing:
            raise CorruptBaselineError(f"baseline {shown} lacks tensor(s) {missing} of check {name!r}", path)
        extras = record.get("extras") or {}
        if not isinstance(extras, dict):
            raise CorruptBaselineError(f"baseline {shown} lacks the recorded inputs/weights of check {name!r}", path)
        pooled = {what: m.group(1) for what, key in extras.items()
                  if version >= POOL_VERSION and isinstance(key, str) and (m := _OBJECT_REF_RE.match(key))}
        if any(key not in stored for what, key in extras.items() if what not in pooled):
            raise CorruptBaselineError(f"baseline {shown} lacks the recorded inputs/weights of check {name!r}", path)
        inline = {what: stored[key] for what, key in extras.items() if what not in pooled}
        used.update(leaves.values())
        used.update(key for what, key in extras.items() if what not in pooled)
        referenced[name] = pooled
        hashed_extras[name] = {**inline, **{what: extras[what] for what in pooled}}
        checks[name] = CheckBaseline(name=name, tensors={leaf: stored[key] for leaf, key in leaves.items()},
                                     none_leaves=none_leaves, meta=meta, extras=inline)
    extra = set(stored) - used
    if extra:
        raise CorruptBaselineError(f"baseline {shown} holds tensors no check describes: {sorted(extra)}", path)
    return checks, referenced, hashed_extras


def _read_pooled(path: Path, shown: str, checks: dict[str, CheckBaseline], referenced: dict[str, dict[str, str]],
                 pool: "ObjectPool | None", rerecord: str) -> None:
    """Fill each check's extras with the verified pool objects it references (each object read once)."""
    loaded: dict[str, torch.Tensor] = {}
    for name, pooled in referenced.items():
        for what, digest in sorted(pooled.items()):
            if digest not in loaded:
                kind = what.partition(":")[0] if what.startswith(POOLED_KINDS) else "tensor"
                if pool is None:
                    raise CorruptBaselineError(
                        f"baseline {shown}: check {name!r} references its recorded {kind} {what!r} in an object pool, "
                        f"but it was read without one (read it through BaselineStore or SuiteStores); re-record with: "
                        f"{rerecord}", path)
                try:
                    loaded[digest] = pool.get(digest)
                except PoolObjectError as exc:
                    hint = (" (deleted, pruned, or not committed beside the baseline files: commit "
                            f"{_show(pool.dir)}/ with them)") if exc.reason == "is missing" else ""
                    raise CorruptBaselineError(
                        f"baseline {shown}: check {name!r} needs its recorded {kind} {what!r} from the object pool, "
                        f"but {_show(exc.path)} {exc.reason}{hint}; the check cannot be trusted without it. "
                        f"Re-record it with: {rerecord}",
                        path,
                    ) from None
            checks[name].extras[what] = loaded[digest]

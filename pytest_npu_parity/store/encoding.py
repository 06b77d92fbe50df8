"""How checks become a baseline file's tensors and records, and the checksum that covers them.

:func:`_encode_checks` flattens checks into safetensors tensors and JSON-ready records (an extra goes
under its content address, or to the object pool from :data:`~pytest_npu_parity.store.format.POOL_MIN_BYTES`
on); :func:`_tensor_hash`, :func:`_checks_hash` and :func:`_content_hash` compute the ``content_hash``
field a file is verified against on every load; :func:`_same_content` decides that a re-record leaves a
file untouched.
"""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

from .digests import fingerprint_tensors
from .format import OBJECT_REF, POOL_MIN_BYTES, POOLED_KINDS, Baseline, CheckBaseline, _cpu_copy, _dtype_name

if TYPE_CHECKING:
    from .pool import ObjectPool


def _encode_checks(checks: dict[str, CheckBaseline],
                   pool: "ObjectPool | None" = None) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Flatten checks into safetensors tensors (key -> CPU tensor) and JSON-ready records; with a ``pool``,
    extras of :data:`POOLED_KINDS` of at least :data:`POOL_MIN_BYTES` are written to it and referenced
    as ``"object:<digest>"``."""
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    for name, check in checks.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"check names must be non-empty strings, got {name!r}")
        if check.name != name:
            raise ValueError(f"check stored under {name!r} is named {check.name!r}; use the same name")
        leaves: dict[str, str] = {}
        shapes: dict[str, list[int]] = {}
        dtypes: dict[str, str] = {}
        for leaf, tensor in check.tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"check {name!r} leaf {leaf!r} is a {type(tensor).__name__}, not a tensor")
            key = f"{name}/{leaf}" if leaf else name
            n = 2
            base = key
            while key in tensors or key == "__metadata__":
                key = f"{base}#{n}"
                n += 1
            tensors[key] = _cpu_copy(tensor)
            leaves[leaf] = key
            shapes[leaf] = list(tensor.shape)
            dtypes[leaf] = _dtype_name(tensor.dtype)
        meta = _normalize(dict(check.meta), f"meta of check {name!r}")
        meta["shapes"] = shapes
        meta["dtypes"] = dtypes
        records[name] = {"leaves": leaves, "none_leaves": sorted(set(check.none_leaves)), "meta": meta}
        if check.extras:
            records[name]["extras"] = {what: _store_extra(tensors, what, tensor, name, pool)
                                       for what, tensor in sorted(check.extras.items())}
    return tensors, records


def _store_extra(tensors: dict[str, torch.Tensor], what: str, tensor: Any, check: str,
                 pool: "ObjectPool | None" = None) -> str:
    """Put one extra (a recorded input, weight or golden) into ``tensors`` under its content address
    ``"@<32 hex digits of its fingerprint>"`` — once, however many checks recorded the same tensor —
    and return that key; one of :data:`POOLED_KINDS` with at least :data:`POOL_MIN_BYTES` goes to ``pool``
    instead (key ``"object:<64 hex digits>"``, once per store)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"check {check!r} extra {what!r} is a {type(tensor).__name__}, not a tensor")
    if pool is not None and what.startswith(POOLED_KINDS) and tensor.numel() * tensor.element_size() >= POOL_MIN_BYTES:
        return OBJECT_REF + pool.put(tensor)
    copy = _cpu_copy(tensor)
    key = "@" + fingerprint_tensors(copy)[:32]
    tensors.setdefault(key, copy)
    return key


def _tensor_hash(tensors: dict[str, torch.Tensor], records: dict[str, dict]) -> str:
    """``_checks_hash`` of the encoded checks; an extra in the pool counts as its key (``"object:<digest>"``,
    a string): the file's checksum covers which object it references, the object's name covers its bytes."""
    return _fingerprint_checks({name: ({leaf: tensors[key] for leaf, key in rec["leaves"].items()},
                                       {what: tensors[key] if key in tensors else key
                                        for what, key in (rec.get("extras") or {}).items()})
                                for name, rec in records.items()})


def _checks_hash(checks: dict[str, CheckBaseline]) -> str:
    """The checksum's tensor part: ``fingerprint_tensors`` of every check's leaves
    (``{check: {leaf: tensor}}``), with its extras under ``"@extras/<check>"`` when it has any (so a
    file without extras hashes as format version 2 did)."""
    return _fingerprint_checks({name: (c.tensors, c.extras) for name, c in checks.items()})


def _fingerprint_checks(parts: dict[str, tuple[dict, dict]]) -> str:
    tree: dict[str, dict] = {name: leaves for name, (leaves, _) in parts.items()}
    tree.update({f"@extras/{name}": extras for name, (_, extras) in parts.items() if extras})
    return fingerprint_tensors(tree)


#: Metadata fields the checksum covers, in this order (``content_hash`` itself excluded).
_HASHED_FIELDS = ("format", "format_version", "test_id", "provenance", "checks")


def _content_hash(metadata: dict[str, Any], tensor_hash: str) -> str:
    """The ``content_hash`` field: BLAKE2b (64 hex digits) over the metadata fields
    :data:`_HASHED_FIELDS` (their stored strings, length-prefixed) and the tensors' fingerprint."""
    hasher = hashlib.blake2b(digest_size=32, person=b"npu-parity-base")
    for key in _HASHED_FIELDS:
        value = metadata.get(key)
        for chunk in (key.encode(), ("\0" if value is None else "s" + str(value)).encode("utf-8", "surrogatepass")):
            hasher.update(len(chunk).to_bytes(8, "little"))
            hasher.update(chunk)
    hasher.update(tensor_hash.encode())
    return hasher.hexdigest()


def _same_content(old: Baseline, records: dict[str, dict], tensor_hash: str) -> bool:
    old_records = {
        name: {"leaves": None, "none_leaves": sorted(set(c.none_leaves)), "meta": _normalize(c.meta, "stored meta"),
               "extras": sorted(c.extras)}
        for name, c in old.checks.items()
    }
    new_records = {name: {**rec, "leaves": None, "extras": sorted(rec.get("extras") or {})} for name, rec in records.items()}
    if old_records != new_records:
        return False
    old_hash = old.tensor_hash or _checks_hash(old.checks)
    return old_hash == tensor_hash


def _normalize(value: Any, what: str) -> Any:
    return json.loads(_dumps(value, what))


def _dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serializable: {exc}") from None

"""A store's files on disk: what kind of file a path is, how one is written atomically, and which
baseline files a directory tree holds.

* :func:`_kind` / :func:`_sniff` tell a safetensors file from a pickle or ``torch.save`` file by its
  first bytes (nothing is ever unpickled);
* :func:`_fd_path` names the very file behind an open descriptor, so a reader sees one version;
* :func:`_atomic_write` writes through a same-directory temporary file, fsync and ``os.replace``;
* :func:`_baseline_files`, :func:`_unused`, :func:`_prune` and :func:`_scan_unsafe` walk a store's tree
  (the housekeeping of :class:`~pytest_npu_parity.store.baselines.BaselineStore` and
  :class:`~pytest_npu_parity.store.suites.SuiteStores`).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .format import OBJECTS_DIR, SUFFIX, UNSAFE_SUFFIXES, _HEADER_LIMIT, BaselineError, _show


def _sniff(path: Path) -> str:
    """Kind of file at ``path`` from its first 9 bytes (see :func:`_kind`)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return "other"
    return _kind(head)


def _kind(head: bytes) -> str:
    """``"safetensors"``, ``"pickle"`` (pickle protocol 2+ or zip, i.e. ``torch.save``),
    ``"short"`` (fewer than 9 bytes) or ``"other"``, from a file's first bytes."""
    # A safetensors header is checked first: its 8-byte little-endian length can start with 0x80
    # (a 1408-byte header does), which alone would look like a pickle PROTO opcode. Nothing is ever
    # unpickled either way; a crafted file that passes as safetensors is then parsed (no code runs).
    if len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= _HEADER_LIMIT:
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        return "pickle"
    if len(head) < 9:
        return "short"
    return "other"


def _fd_path(fh: Any, path: Path) -> str:
    """A name that opens the very file behind ``fh`` (Linux ``/proc/self/fd``, BSD/macOS ``/dev/fd``);
    ``path`` itself where neither exists (then a concurrent replace can be seen as a checksum error)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        candidate = f"{folder}/{fh.fileno()}"
        if os.path.exists(candidate):
            return candidate
    return str(path)


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a same-directory temporary file, fsync and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable; not possible on every platform
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _baseline_files(top: Path) -> list[Path]:
    pool = top / OBJECTS_DIR
    return sorted(p for p in _walk(top) if p.name.endswith(SUFFIX) and not p.name.startswith(".")
                  and not p.is_relative_to(pool))


def _unused(top: Path, used_paths: set[Path]) -> list[Path]:
    used = {Path(p).resolve() for p in used_paths}
    return [p for p in _baseline_files(top) if p.resolve() not in used]


def _prune(top: Path, paths: list[Path]) -> None:
    top = top.resolve()
    resolved = []
    for p in paths:
        real = Path(p).resolve()
        if not real.is_relative_to(top) or real == top:
            raise BaselineError(f"refusing to prune {real}: it is outside the baseline directory {top}", real)
        if not real.name.endswith(SUFFIX):
            raise BaselineError(f"refusing to prune {_show(real)}: not a {SUFFIX} baseline", real)
        resolved.append(real)
    for real in resolved:
        real.unlink(missing_ok=True)
        parent = real.parent
        while parent != top and parent.is_relative_to(top):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


def _scan_unsafe(top: Path) -> list[Path]:
    return sorted(p for p in _walk(top) if p.suffix.lower() in UNSAFE_SUFFIXES or _sniff(p) == "pickle")


def _walk(top: Path):
    if not top.is_dir():
        return
    for dirpath, _dirnames, filenames in os.walk(top):
        for name in filenames:
            yield Path(dirpath) / name

"""The store lock: one record run at a time writes a baseline store.

A record run (and ``baselines prune``) takes :class:`StoreLock` on ``<root>/.npu-parity.lock`` before
it writes, so two runs never interleave their files and pool objects; pytest-xdist workers of one
run share their controller's lock. Kept apart from the reading and writing of files: the lock is
about processes, not about the format.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .format import LOCK_NAME, StoreLockedError, _show


class StoreLock:
    """An exclusive, inter-process lock on a baseline store: the file ``<root>/.npu-parity.lock``
    (:data:`LOCK_NAME`), locked with ``filelock`` (``flock`` on POSIX, so the operating system
    releases it when its holder dies, even by SIGKILL). Record runs hold it for their whole session,
    so two ``--update-baselines`` runs on one store run one after the other; readers never take it
    (every write is an atomic rename, a reader sees the old or the new file).

    Args:
        root: the store root; created (with parents) on :meth:`acquire`.

    Use ``acquire`` / ``release`` or ``with StoreLock(root):`` (waits forever).
    """

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.path = self.root / LOCK_NAME
        self._lock: Any = None

    def acquire(self, timeout: float = -1, on_wait: Callable[[str], None] | None = None) -> None:
        """Take the lock, waiting at most ``timeout`` seconds (negative: forever).

        ``on_wait(message)`` is called once when the lock is held by another process, before waiting.

        Raises:
            StoreLockedError: still held by another process after ``timeout`` seconds.
            OSError: the root or the lock file cannot be created (read-only store, a file in the way).
        """
        from filelock import FileLock, Timeout

        self.root.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            if on_wait is not None:
                on_wait(f"the baseline store {_show(self.root)} is being updated by another process "
                        f"(it holds {_show(self.path)}); waiting"
                        + (f" up to {timeout:g} s" if timeout >= 0 else "") + " for it to finish")
            try:
                lock.acquire(timeout=timeout)
            except Timeout:
                raise StoreLockedError(
                    f"the baseline store {_show(self.root)} is still being updated by another process after "
                    f"{timeout:g} s (it holds the lock {_show(self.path)}; the lock is released when that "
                    "process ends, also if it is killed). Wait for it, or record into another --baseline-dir",
                    self.path,
                ) from None
        self._lock = lock

    def release(self) -> None:
        """Release the lock (no-op when not held)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._lock is not None

    def __enter__(self) -> "StoreLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

"""All suites' baselines under one root: :class:`SuiteStores` routes each test id to its suite's
:class:`~pytest_npu_parity.store.baselines.BaselineStore`, and answers what spans the whole store — its
temporary files, its lock, its object pool and which pool objects no file references.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .baselines import BaselineStore, _digest, _sanitize
from .files import _baseline_files, _prune, _scan_unsafe, _unused, _walk
from .format import (ROOTDIR_SUITE, UPDATE_COMMAND, _DIR_UNSAFE, _TEMP_NAME, Baseline, CheckBaseline,
                     MissingBaselineError)
from .lock import StoreLock
from .pool import ObjectPool, _object_refs

__all__ = ["SuiteStores"]


class SuiteStores:
    """All suites' baselines under one root: routes each test id to its suite's
    :class:`BaselineStore` and offers the same methods.

    The suite of a node id is the directory after ``parity_suites/`` in its module path
    (``parity_suites/aurora/test_layers.py::t`` -> suite ``aurora``, files under
    ``<root>/aurora/test_layers/``; ``parity_suites`` must be the first directory of the id).
    Every other id keeps its whole module path under the suite
    :data:`ROOTDIR_SUITE` (``tests/test_x.py::t`` -> ``<root>/_rootdir/tests/test_x/``), so
    ``mini/test_top.py::t`` and ``parity_suites/mini/test_top.py::t`` never share a file; a parity
    suite that is itself named ``_rootdir`` is stored under a hashed name.

    Args:
        root: the baseline directory (``--baseline-dir``).
        update_command: as for :class:`BaselineStore`.
    """

    def __init__(self, root: Path | str, *, update_command: str = UPDATE_COMMAND):
        self.root = Path(root).resolve()
        self.update_command = update_command
        self._stores: dict[tuple[str, str], BaselineStore] = {}

    @staticmethod
    def suite_of(test_id: str) -> tuple[str, str]:
        """``(suite, module prefix)`` of a node id, as described in the class docstring."""
        module = test_id.partition("::")[0] if "::" in test_id else ""
        segments = [s for s in module.replace("\\", "/").split("/") if s not in ("", ".")]
        dirs = segments[:-1]
        if ".." in dirs or "\0" in module:
            return ROOTDIR_SUITE, ""
        if len(dirs) >= 2 and dirs[0] == "parity_suites":
            suite = _sanitize(dirs[1], _DIR_UNSAFE)
            if suite == ROOTDIR_SUITE:
                suite = f"{suite}-{_digest('parity_suites/' + suite)}"
            return suite, "/".join(dirs[:2])
        return ROOTDIR_SUITE, ""

    def store_for(self, test_id: str) -> BaselineStore:
        """The :class:`BaselineStore` that holds ``test_id``'s baseline."""
        key = self.suite_of(test_id)
        if key not in self._stores:
            suite, prefix = key
            self._stores[key] = BaselineStore(self.root, suite, update_command=self.update_command,
                                              module_prefix=prefix)
        return self._stores[key]

    def path_for(self, test_id: str) -> Path:
        """See :meth:`BaselineStore.path_for`."""
        return self.store_for(test_id).path_for(test_id)

    def load(self, test_id: str) -> Baseline | None:
        """See :meth:`BaselineStore.load`."""
        return self.store_for(test_id).load(test_id)

    def require(self, test_id: str) -> Baseline:
        """See :meth:`BaselineStore.require`."""
        return self.store_for(test_id).require(test_id)

    def command(self, test_id: str) -> str:
        """See :meth:`BaselineStore.command`."""
        return self.store_for(test_id).command(test_id)

    def missing_error(self, test_id: str) -> MissingBaselineError:
        """See :meth:`BaselineStore.missing_error`."""
        return self.store_for(test_id).missing_error(test_id)

    def check_fresh(self, baseline: Baseline, check: str, **kwargs: Any) -> CheckBaseline:
        """See :meth:`BaselineStore.check_fresh`."""
        store = self.store_for(baseline.test_id) if baseline.test_id else BaselineStore(
            self.root, "default", update_command=self.update_command)
        return store.check_fresh(baseline, check, **kwargs)

    def write(self, test_id: str, checks: dict[str, CheckBaseline], provenance: dict) -> str:
        """See :meth:`BaselineStore.write`."""
        return self.store_for(test_id).write(test_id, checks, provenance)

    def baseline_files(self) -> list[Path]:
        """Every ``*.safetensors`` file under ``root``, sorted."""
        return _baseline_files(self.root)

    def unused(self, used_paths: set[Path]) -> list[Path]:
        """Baseline files of every suite under ``root`` not in ``used_paths`` (sorted)."""
        return _unused(self.root, used_paths)

    def prune(self, paths: list[Path]) -> None:
        """Delete baseline files below ``root`` (see :meth:`BaselineStore.prune`)."""
        _prune(self.root, paths)

    def scan_unsafe(self) -> list[Path]:
        """Pickle-capable files below ``root`` (see :meth:`BaselineStore.scan_unsafe`)."""
        return _scan_unsafe(self.root)

    def temporary_files(self) -> list[Path]:
        """Temporary files of interrupted writes below ``root`` (``.<name>.safetensors.<random>.tmp``,
        left by a killed process), sorted. Only safe to delete while holding :meth:`lock`."""
        return sorted(p for p in _walk(self.root) if _TEMP_NAME.match(p.name))

    def remove_temporary_files(self) -> list[tuple[Path, int]]:
        """Delete :meth:`temporary_files`; returns ``(path, size in bytes)`` of each one removed.

        Call it only while holding :meth:`lock`: a live writer's temporary file would be lost
        (its ``os.replace`` then fails and that write raises ``OSError``).
        """
        removed = []
        for path in self.temporary_files():
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append((path, size))
        return removed

    def lock(self) -> "StoreLock":
        """The :class:`StoreLock` of this store (not yet acquired)."""
        return StoreLock(self.root)

    @property
    def pool(self) -> ObjectPool:
        """The store's :class:`ObjectPool` (``<root>/.objects/``), shared by every suite."""
        return ObjectPool(self.root)

    def referenced_objects(self) -> dict[str, list[Path]]:
        """Digest -> the baseline files under ``root`` that reference that pool object (headers only).

        Raises:
            CorruptBaselineError: a baseline file's header cannot be read (what it references is unknown).
        """
        refs: dict[str, list[Path]] = {}
        for path in _baseline_files(self.root):
            for digest in _object_refs(path):
                refs.setdefault(digest, []).append(path)
        return refs

    def orphan_objects(self) -> list[tuple[Path, int]]:
        """``(path, size in bytes)`` of the pool objects no baseline file under ``root`` references, sorted.

        Every file under the root counts, not only those of one run: a ``-k`` re-record or one xdist
        worker's files never make another test's objects orphans.

        Raises:
            CorruptBaselineError: as :meth:`referenced_objects` (then nothing is called an orphan).
        """
        refs = self.referenced_objects()
        orphans = []
        for digest, path in self.pool.objects():
            if digest not in refs:
                try:
                    orphans.append((path, path.stat().st_size))
                except FileNotFoundError:
                    continue
        return orphans

    def prune_objects(self) -> list[tuple[Path, int]]:
        """Delete :meth:`orphan_objects` (and then-empty fan-out directories); returns what was removed.

        Call it only while holding :meth:`lock` (a record run holds it for its session): a record run writes
        a test's objects before its file, and an object written but not yet referenced would be lost.

        Raises:
            CorruptBaselineError: a baseline file's header cannot be read; nothing is deleted then.
        """
        removed = []
        for path, size in self.orphan_objects():
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append((path, size))
            try:
                path.parent.rmdir()
            except OSError:
                pass
        return removed

    def unwritable(self) -> list[Path]:
        """``root`` (or its nearest existing ancestor) and the directories below it that this
        process cannot write to (``os.access``), sorted: a record run could not create or replace a
        baseline file in them."""
        top = self.root
        while not top.exists() and top.parent != top:
            top = top.parent
        if not top.is_dir():
            return [top]
        bad = [top] if not os.access(top, os.W_OK | os.X_OK) else []
        if top == self.root:
            for dirpath, dirnames, _files in os.walk(self.root):
                for name in dirnames:
                    path = Path(dirpath) / name
                    if not os.access(path, os.W_OK | os.X_OK):
                        bad.append(path)
        return sorted(bad)

"""Which source line caused an event: the innermost Python frame outside torch, einops,
``contextlib``/``functools`` and this package's engine modules (:func:`caller_source`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import linecache
import os
import sys


def _package_dir(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(os.path.abspath(list(spec.submodule_search_locations)[0]), "")


_SKIPPED_DIRS = tuple(d for d in (_package_dir("torch"), _package_dir("einops")) if d)
# This package's engine modules: its top-level files and the files of its rooms (checks/, runtime/
# with this very package, judge/, diagnose/ ...); its suites' subpackages (the Aurora patch set,
# aurora/) are model adaptation code whose lines are worth showing.
_ENGINE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # pytest_npu_parity
_ENGINE_PREFIX = os.path.join(_ENGINE_DIR, "")
_SUITE_DIRS = (os.path.join(_ENGINE_DIR, "aurora", ""),)
_SKIPPED_FILES = {os.path.abspath(contextlib.__file__), os.path.abspath(functools.__file__)}
_internal_cache: dict[str, bool] = {}


def _is_internal(filename: str) -> bool:
    hit = _internal_cache.get(filename)
    if hit is None:
        path = os.path.abspath(filename)
        hit = (path in _SKIPPED_FILES or path.startswith(_SKIPPED_DIRS)
               or (path.startswith(_ENGINE_PREFIX) and not path.startswith(_SUITE_DIRS)))
        _internal_cache[filename] = hit
    return hit


def caller_source() -> tuple[str, str]:
    """``("/path/file.py:LINE", code text)`` of the innermost frame outside torch, einops, this
    package's engine modules and ``contextlib``/``functools``; ``("<unknown>", "")`` if none."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_internal(filename):
            line = frame.f_lineno
            return f"{filename}:{line}", linecache.getline(filename, line).strip()
        frame = frame.f_back
    return "<unknown>", ""

"""Helpers shared by the pytester-based tests (imported as a plain module from the tests folder)."""
from __future__ import annotations

import os
from pathlib import Path


def edit_module(module: Path, old: str, new: str) -> None:
    """Replace ``old`` (which must occur) in ``module`` and move its mtime forward by 2 s, so a
    later in-process pytest run does not reuse the cached bytecode of the old text."""
    text = module.read_text()
    assert old in text, f"{old!r} not in {module}"
    stat = module.stat()
    module.write_text(text.replace(old, new))
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))

"""Where the project's tests find their files, whichever room's folder they live in.

``TESTS`` is the ``tests/`` folder (the shared helpers, ``fakes/``, ``data/``, ``bug_patterns/``); ``REPO`` is
the repository root (``pyproject.toml``, ``docs/``, ``parity_suites/``, ``benchmarks/``). ``tests/`` is on
``sys.path`` because ``tests/conftest.py`` lives there (pytest's default ``prepend`` import mode), so a test
in ``tests/judge/`` writes ``from locations import TESTS`` instead of counting its parents.
"""
from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

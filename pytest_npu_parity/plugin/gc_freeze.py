"""A parity session's long-lived objects kept out of Python's full garbage collections.

A parity session holds about 540,000 garbage-collector-tracked objects that live until it ends: the
modules, functions and classes of torch, transformers, the model's package, pytest and hypothesis, and the
session fixtures' model. Every full (generation-2) collection walks all of them, about 0.24 s at that size
on a 2-core AMD EPYC (measured with ``gc.collect()`` at the session's end: 0 objects unreachable, 0.24 s
each time). CPython starts one whenever the objects promoted since the last full collection exceed a quarter
of those that survived it (``Modules/gcmodule.c``, ``gc_collect_generations``: ``long_lived_pending <
long_lived_total / 4``), so the imports of the first check set off several, and pytest 9.2 runs two more
at the end (``_pytest/unraisableexception.py``: ``pytest_unconfigure`` and the config cleanup each call
``gc.collect()``). They collect almost nothing: the objects they walk are alive.

``gc.freeze()`` moves every tracked object to a permanent generation that collections skip (Python
documentation, ``gc.freeze``). ``LongLivedObjects`` freezes twice in a parity session: once collection is
done (the imported modules, pytest's objects, the collected tests), and once the first test has finished,
after a collection of the two young generations has freed its short-lived cycles (what the first check
imported and the session fixtures it built). At unconfigure (``trylast``: after pytest's first end-of-session
collection, which then walks only what came later) everything is unfrozen, so an in-process run (pytester)
leaves nothing frozen behind and pytest's second collection still finds every unreachable cycle, and its
unraisable exceptions, as before.

What it does not change: garbage made after a freeze is collected as before; an object is freed by its
reference count as before, frozen or not. A frozen object that later becomes part of an unreachable cycle
is freed at the unfreeze instead of at the next full collection (for objects alive after the first test,
which are meant to live for the session, there are few). Measured on the green main-job suite (112
checks, 2-core AMD EPYC, Python 3.11.7): generation-2 collection time 1.08-1.26 s -> 0.58-0.70 s per run,
the last test's teardown to exit 0.59-0.62 s -> 0.30-0.39 s, peak RSS unchanged (2.12 GB)
(``docs/explanation/performance.md``). A session with the collector disabled (``gc.disable()``) is left as
it is.
"""
from __future__ import annotations

import gc

import pytest


class LongLivedObjects:
    """The plugin object that freezes a parity session's long-lived objects (module docstring). Registered by
    ``hooks.pytest_configure`` in a parity session only; ``freezes`` counts the ``gc.freeze()`` calls made."""

    def __init__(self) -> None:
        self.freezes = 0
        self._after_first_test = False

    def _freeze(self) -> None:
        if gc.isenabled():
            gc.freeze()
            self.freezes += 1

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self._freeze()

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple) -> None:
        if self._after_first_test:
            return
        self._after_first_test = True
        if gc.isenabled():
            gc.collect(1)  # the first test's short-lived cycles are freed, not frozen
            self._freeze()

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self.freezes:
            gc.unfreeze()
            self.freezes = 0

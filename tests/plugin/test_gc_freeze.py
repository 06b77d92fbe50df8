"""plugin.gc_freeze: a parity session freezes its long-lived objects out of full garbage collections
after collection and after its first test, still collects the garbage its tests make (the first test's
short-lived cycles included), and leaves nothing frozen behind; a session without parity is left as is."""
from __future__ import annotations

import gc
import json

import pytest

INNER = """
import gc
import json
import weakref

class Node:
    pass

FIRST = []

def _cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

def test_first():
    FIRST.append(_cycle())  # unreachable once made: a short-lived cycle of the first test

def test_second():
    frozen = gc.get_freeze_count()
    later = _cycle()
    gc.collect()
    with open({path!r}, "w", encoding="utf-8") as fh:
        json.dump({{"frozen": frozen, "first_cycle_freed": FIRST[0]() is None,
                   "later_cycle_freed": later() is None}}, fh)
"""


@pytest.mark.parametrize("enabled", [True, False], ids=["parity", "no-parity"])
def test_long_lived_objects_are_frozen_in_a_parity_session_only(pytester: pytest.Pytester, enabled: bool) -> None:
    seen = pytester.path / "seen.json"
    pytester.makepyfile(test_gc=INNER.format(path=str(seen)))
    before = gc.get_freeze_count()
    args = ["--npu-parity", "--parity-device", "cpu"] if enabled else []
    result = pytester.runpytest("-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=2)
    observed = json.loads(seen.read_text(encoding="utf-8"))
    if enabled:
        assert observed["frozen"] > before + 10_000  # the imports and pytest's objects, at least
    else:
        assert observed["frozen"] == before
    assert observed["first_cycle_freed"] and observed["later_cycle_freed"]
    assert gc.get_freeze_count() == before  # unfrozen at unconfigure: nothing left behind


def test_a_disabled_collector_is_left_alone(pytester: pytest.Pytester) -> None:
    seen = pytester.path / "seen.json"
    pytester.makepyfile(test_gc=INNER.format(path=str(seen)))
    before = gc.get_freeze_count()
    gc.disable()
    try:
        result = pytester.runpytest("-p", "no:cacheprovider", "--npu-parity", "--parity-device", "cpu")
    finally:
        gc.enable()
    result.assert_outcomes(passed=2)
    assert json.loads(seen.read_text(encoding="utf-8"))["frozen"] == before

"""A parity session holds on to nothing its tests have let go: the garbage a test leaves, in reference
cycles, is freed by the next ``gc.collect()`` as in a session without parity. Cases where the plugin itself
could keep it: a failing first test's frame (pytest keeps it in ``sys.last_traceback`` until the next test
runs), a module-scoped fixture's cycle built in the first test and released when its module ends, and
cyclic garbage left by an import during collection."""
from __future__ import annotations

import json

import pytest

CONFTEST = """
import gc
import json
import weakref

class Node:
    def __init__(self):
        self.other = Node.__new__(Node)
        self.other.other = self  # a reference cycle: only the collector frees it

WATCHED = {}

def watch(name, node):
    WATCHED[name] = weakref.ref(node)

def report(path):
    gc.collect()
    with open(path, "w", encoding="utf-8") as fh:
        json.dump({name: ref() is None for name, ref in WATCHED.items()}, fh)
"""

IMPORTED = """
from conftest import Node, watch

_garbage = Node()
watch("import", _garbage)
del _garbage
"""

FIRST = """
import pytest
import helper_import  # cyclic garbage made during collection
from conftest import Node, watch

@pytest.fixture(scope="module")
def cyclic():
    node = Node()
    watch("module_fixture", node)
    return node

def test_first_fails(cyclic):
    frame_local = Node()
    watch("failing_frame", frame_local)
    assert frame_local is None
"""

SECOND = """
from conftest import report

def test_second():
    report({path!r})
"""


@pytest.mark.parametrize("enabled", [True, False], ids=["parity", "no-parity"])
def test_garbage_left_by_tests_is_collected(pytester: pytest.Pytester, enabled: bool) -> None:
    freed = pytester.path / "freed.json"
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(helper_import=IMPORTED, test_a_first=FIRST, test_b_second=SECOND.format(path=str(freed)))
    args = ["--npu-parity", "--parity-device", "cpu"] if enabled else []
    # a subprocess: an inline run's hook recorder keeps every call's exception info, and with it the frame
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=1, failed=1)
    assert json.loads(freed.read_text(encoding="utf-8")) == {
        "import": True, "module_fixture": True, "failing_frame": True}

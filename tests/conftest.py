"""Fixtures shared by the project's own tests.

The full seeded Aurora (210.8 M parameters) and its captured submodule inputs are built once per
process and shared by every test module that needs them (the sensitivity, localization and factory
proofs); no test may mutate them (faults are applied inside context managers and restored).
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def aurora_full():
    """The full seeded Aurora (``factory.get_model("full")``: eval, CPU, float32), shared by the session."""
    from pytest_npu_parity.aurora import factory

    return factory.get_model("full")


@pytest.fixture(scope="session")
def aurora_ctx(aurora_full):
    """``checks.build_context`` of the full model on the suite's batch, as the Aurora suite builds it."""
    from pytest_npu_parity.aurora import checks

    return checks.build_context(aurora_full, checks.suite_batch())


_LAZY_IMPORTED: list[bool] = []


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the first test using pytester (and before its fixture snapshots ``sys.modules``):
    import the modules that cannot be imported twice in one process
    (``pytester_helpers.import_lazy_modules``). Each in-process run drops the modules it imported,
    so whichever run imported them first would break every later one."""
    if _LAZY_IMPORTED or "pytester" not in getattr(item, "fixturenames", ()):
        return
    import tempfile

    from pytester_helpers import import_lazy_modules

    with tempfile.TemporaryDirectory() as tmp:
        import_lazy_modules(tmp)
    _LAZY_IMPORTED.append(True)

"""The plugin's fixtures: ``parity`` (one test's ``runner.ParityCase``), ``parity_session``,
``parity_recipe``, and the suite seams ``parity_patches``, ``parity_reference_patches`` and
``parity_audit_budget``."""
from __future__ import annotations

from typing import Any, Iterator

import pytest

from .state import OUTCOME_KEY, SESSION_KEY, SKIP_REASON


@pytest.fixture
def parity_recipe(request: pytest.FixtureRequest) -> str:
    """The recipe this test runs under (``fp32``, ``bf16``, …); parametrized from ``--parity-dtypes``."""
    return getattr(request, "param", "fp32")


@pytest.fixture
def parity_patches():
    """``(device) -> context manager`` applying a patch set to target runs; override it in a suite's
    conftest (the Aurora suite returns its NPU patch set). Default: no patches."""
    return None


@pytest.fixture
def parity_reference_patches():
    """``(device) -> context manager`` applying what the *reference* side needs to run this test's
    recipe at all, or None (the default: the reference runs the model as it is). For gaps the model has
    on every device, e.g. upstream Aurora's ``torch.fft.rfft`` of bf16 weights (``bf16-weights``
    recipe), never for the port's device fixes: what both sides share is not judged. Override it in a
    suite's conftest (it may depend on ``parity_recipe``); the names applied are the report's
    ``reference_patch_set``."""
    return None


@pytest.fixture
def parity_audit_budget():
    """What the target runs of this suite's checks may do under ``--parity-audit``: a dict
    (``{"h2d": 2, "host_sync": None}``), a spec string (``"h2d=2 # reason"``) or an
    ``audit.AuditBudget``, over the default (``audit.DEFAULT_AUDIT_BUDGET``). Override it in a
    suite's conftest; ``@pytest.mark.parity(audit_budget=...)`` and ``parity.check(audit_budget=...)``
    refine it per test and check. Default: None (the default budget)."""
    return None


@pytest.fixture(scope="session")
def parity_session(pytestconfig: pytest.Config):
    """The session-wide ``runner.ParitySession`` (target device, reference mode, records)."""
    if SESSION_KEY not in pytestconfig.stash:
        pytest.skip(SKIP_REASON)
    return pytestconfig.stash[SESSION_KEY]


def _check_patch_factory(nodeid: str, fixture: str, factory: Any) -> None:
    """A patch fixture's value is None or a ``(device) -> context manager`` factory.

    Raises:
        pytest.UsageError: a context manager itself (its ``__enter__`` would run once, not around each run), or
            anything else that cannot be called; the message names the fixture and the fix.
    """
    __tracebackhide__ = True
    import contextlib

    if factory is None:
        return
    if isinstance(factory, contextlib.AbstractContextManager):
        raise pytest.UsageError(f"{nodeid}: the {fixture} fixture returned a context manager "
                                f"({type(factory).__name__}); return a factory instead, called with the device "
                                f"around each run: `return lambda device: your_context_manager()`")
    if not callable(factory):
        raise pytest.UsageError(f"{nodeid}: the {fixture} fixture returned {type(factory).__name__} "
                                f"{factory!r:.60}; return None or a `(device) -> context manager` factory")


@pytest.fixture
def parity(request: pytest.FixtureRequest, parity_session, parity_recipe: str, parity_patches,
           parity_audit_budget, parity_reference_patches) -> Iterator[Any]:
    """Run and compare computations on the reference and the target device.

    ``parity.check(name, module_or_fn, *args, **kwargs)`` runs on both sides and compares every
    output leaf; ``parity.train_step(name, module, inputs, labels=..., loss_fn=...)`` compares one
    optimizer step (``loss_fn(output, labels)``);
    ``parity.compare(name, actual, expected)`` judges outputs you computed. See ``runner.ParityCase``.
    """
    from ..runtime.audit import parse_audit_budget  # engine modules import torch: only when a parity test runs
    from ..checks.settings import marker_tolerance
    from ..runner import ParityCase

    for fixture, factory in (("parity_patches", parity_patches), ("parity_reference_patches", parity_reference_patches)):
        _check_patch_factory(request.node.nodeid, fixture, factory)
    marker = request.node.get_closest_marker("parity")
    try:
        budget = parse_audit_budget(parity_audit_budget, source="suite", base=parity_session.audit_budget)
    except ValueError as exc:
        raise pytest.UsageError(f"{request.node.nodeid}: the parity_audit_budget fixture: {exc}") from None
    try:
        if marker is not None and marker.kwargs.get("audit_budget") is not None:
            budget = parse_audit_budget(marker.kwargs["audit_budget"], source="marker", base=budget)
        case = ParityCase(parity_session, request.node.nodeid, parity_recipe,
                          marker_tolerance=marker_tolerance(marker.kwargs, parity_recipe) if marker else None,
                          patches=parity_patches,
                          vacuous_ok=marker.kwargs.get("vacuous_ok") if marker else None,
                          marker_policy=marker.kwargs.get("policy") if marker else None,
                          audit_budget=budget, audit_mode=marker.kwargs.get("audit") if marker else None,
                          marker_train_store=marker.kwargs.get("train_store") if marker else None,
                          marker_layers=marker.kwargs.get("layers") if marker else None,
                          reference_patches=parity_reference_patches)
    except (ValueError, TypeError) as exc:  # a bad policy= or train_store= in the marker
        raise pytest.UsageError(f"{request.node.nodeid}: @pytest.mark.parity: {exc}") from None
    yield case
    # Only a test whose body ran to its end writes its baseline: a failure, pytest.skip() between
    # checks or Ctrl-C (no call report at all) leaves the old file as it was.
    case.finish(outcome=request.config.stash[OUTCOME_KEY].get(request.node.nodeid, "interrupted"))
    if case.records and getattr(request.config.option, "xmlpath", None):
        # JUnit <testcase><properties>: user_properties work under every junit_family (the
        # record_property fixture warns under the default xunit2) and travel across xdist workers.
        from ..report import junit_properties

        request.node.user_properties.extend(junit_properties([row for r in case.records for row in r.rows()]))

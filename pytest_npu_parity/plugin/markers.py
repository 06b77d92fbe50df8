"""``@pytest.mark.parity(...)``: its help line, its keywords' validation at collection, its recipes."""
from __future__ import annotations

import difflib
import numbers
from typing import Any

import pytest

from .options import MARKER_KEYS

NIGHTLY_MARKER_HELP = ("parity_nightly: a long parity check (a 300-step training trajectory) that runs only "
                       "under the nightly job's --hypothesis-profile nightly; skipped otherwise, saying so")

MARKER_HELP = (
    "parity(rtol=None, atol=None, budget=None, reason=None, recipes=None, vacuous_ok=None, policy=None, "
    "audit=None, audit_budget=None, train_store=None, layers=None): "
    "tolerance override for every check of the test (shown in the report with its reason), the recipes it "
    "runs under, why its checks may be vacuous (constant reference output, no teeth under "
    "--parity-selfcheck), their verdict policy ('allclose' or 'golden [rmse=… # reason]'), the test's "
    "device-propagation audit mode ('fail', 'warn', 'off') and what its target runs may do "
    "(audit_budget={'h2d': 2} or 'h2d=2 host_sync=any # reason') and how its training steps are recorded "
    "('full' or 'summary [min_numel=N samples=K]') and the layer check of its checks (False, or a relative "
    "L2 limit per weighted layer)"
)


def marker_recipes(value: Any) -> list[str] | None:
    """The ``recipes=`` of a parity marker as a list of names: a string is one name or a
    comma-separated list (``"bf16-weights"``, ``"fp32,bf16"``), a list/tuple/set its items; None for
    None. Items that are not strings are kept (``marker_problems`` reports them)."""
    if value is None:
        return None
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [v.strip() if isinstance(v, str) else v for v in value]
    return [value]


def marker_problems(marker: Any) -> list[str]:
    """What is wrong with one ``@pytest.mark.parity(...)``: unknown keywords, positional arguments,
    values of the wrong type or range, unknown recipe or policy names."""
    # engine modules import torch: imported here, in a parity session's collection
    from ..runtime.audit import parse_audit_budget
    from ..store.compact import parse_train_store
    from ..judge.golden_policy import parse_policy_spec
    from ..judge.layers import parse_layer_spec
    from ..runtime.recipes import RECIPES

    problems = []
    if marker.args:
        problems.append(f"positional arguments {marker.args!r}; use keywords ({', '.join(MARKER_KEYS)})")
    for key in marker.kwargs:
        if key not in MARKER_KEYS:
            close = difflib.get_close_matches(key, MARKER_KEYS, n=1)
            problems.append(f"unknown keyword {key}=" + (f" (did you mean {close[0]}=?)" if close else "")
                            + f"; known: {', '.join(MARKER_KEYS)}")
    for key in ("rtol", "atol", "budget"):
        value = marker.kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0):
            problems.append(f"{key}={value!r} must be a number >= 0")
    for key in ("reason", "vacuous_ok", "policy", "train_store"):
        value = marker.kwargs.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            problems.append(f"{key}={value!r} must be a non-empty string")
    recipes = marker_recipes(marker.kwargs.get("recipes"))
    if recipes is not None:
        unknown = [r for r in recipes if r not in RECIPES]
        if unknown or not recipes:
            problems.append(f"recipes={marker.kwargs['recipes']!r}: "
                            + (f"unknown recipe(s) {', '.join(map(repr, unknown))}" if unknown else "no recipe")
                            + f"; known: {', '.join(RECIPES)}")
    audit = marker.kwargs.get("audit")
    if audit is not None and audit not in ("off", "fail", "warn"):
        problems.append(f"audit={audit!r} must be 'fail', 'warn' or 'off'")
    # Keywords whose value an engine parser judges; a policy or train store that is not a non-empty
    # string is reported above, and their own text is repeated in the message.
    parsers = {"audit_budget": lambda v: parse_audit_budget(v, source="marker"),
               "policy": lambda v: parse_policy_spec(v, source="marker", recipe="fp32"),
               "layers": lambda v: parse_layer_spec(v, source="marker"),
               "train_store": lambda v: parse_train_store(v, source="marker")}
    for key, parse in parsers.items():
        value = marker.kwargs.get(key)
        quoted = key in ("policy", "train_store")
        if value is None or (quoted and not (isinstance(value, str) and value.strip())):
            continue
        try:
            parse(value)
        except (ValueError, TypeError) as exc:
            problems.append(f"{key}={value!r}: {exc}" if quoted else f"{key}=: {exc}")
    return problems


def validate_markers(items: list[pytest.Item]) -> None:
    """One usage error listing every bad ``@pytest.mark.parity`` among the collected tests."""
    seen: dict[int, list[str]] = {}
    lines = []
    for item in items:
        for marker in item.iter_markers("parity"):
            key = id(marker.mark) if hasattr(marker, "mark") else id(marker)
            problems = seen.get(key)
            if problems is None:
                problems = seen[key] = marker_problems(marker)
                lines += [f"  {item.nodeid}: {p}" for p in problems]
    if lines:
        raise pytest.UsageError("@pytest.mark.parity: bad arguments\n" + "\n".join(lines))


def skip_nightly_unless_selected(items: list[pytest.Item], nightly: bool) -> None:
    """Mark every ``parity_nightly`` item skipped unless ``nightly`` (the hypothesis profile loaded is
    the nightly one: ``--hypothesis-profile nightly``, ``hypothesis_profiles.NIGHTLY_PROFILE``)."""
    if nightly:
        return
    skip = pytest.mark.skip(reason="parity_nightly: runs in the nightly job (--hypothesis-profile nightly)")
    for item in items:
        if item.get_closest_marker("parity_nightly") is not None:
            item.add_marker(skip)

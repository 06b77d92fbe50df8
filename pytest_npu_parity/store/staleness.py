"""What makes a stored check stale: the structure, shape and dtype differences
:meth:`~pytest_npu_parity.store.baselines.BaselineStore.check_fresh` lists, recorded vs now.
"""
from __future__ import annotations

from typing import Any, Callable

from ..structure import structure_changes, unpack_structure
from .encoding import _dtype_name
from .format import CheckBaseline


def _short(value: Any) -> str:
    if value is None:
        return "none"
    text = str(value)
    return text[:12] + "…" if len(text) > 12 else text


def _structure_changes(packed: Any, structure: dict | Callable[[], dict] | None, prefix: Any) -> list[str]:
    """``structure.structure_changes`` of a recorded (packed) and the current record; a recorded
    record that cannot be read is itself a change (the checksum covers it, so only a writer of another
    layout can have produced it)."""
    now = structure() if callable(structure) else structure
    if now is None:
        return []
    try:
        recorded = unpack_structure(packed)
    except ValueError as exc:
        return [f"structure changed (the recorded structure cannot be compared: {exc})"]
    return structure_changes(recorded, now, prefix=prefix if isinstance(prefix, str) else None)


def _recorded_shapes(check: CheckBaseline) -> dict[str, list[int]]:
    shapes = check.meta.get("shapes")
    if isinstance(shapes, dict):
        return shapes
    return {leaf: list(t.shape) for leaf, t in check.tensors.items()}


def _recorded_dtypes(check: CheckBaseline) -> dict[str, str]:
    dtypes = check.meta.get("dtypes")
    if isinstance(dtypes, dict):
        return dtypes
    return {leaf: _dtype_name(t.dtype) for leaf, t in check.tensors.items()}


def _diff_leaves(what: str, was: dict[str, Any], now: dict[str, Any], report_sets: bool = True) -> list[str]:
    changes = []
    for leaf in sorted(set(was) | set(now), key=str):
        label = f"output {leaf!r}" if leaf else "the output"
        if leaf not in now:
            if report_sets:
                changes.append(f"{label} was recorded but is no longer produced")
        elif leaf not in was:
            if report_sets:
                changes.append(f"{label} is new (not in the baseline)")
        elif was[leaf] != now[leaf]:
            fmt = (lambda v: "None" if v is None else str(tuple(v))) if what == "shape" else str
            changes.append(f"{what} of {label} changed (recorded {fmt(was[leaf])}, now {fmt(now[leaf])})")
    return changes

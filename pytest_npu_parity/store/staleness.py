"""What makes a stored check stale: the differences between what a baseline entry recorded and what
this run has, recorded vs now, as :meth:`~pytest_npu_parity.store.baselines.BaselineStore.check_fresh`
lists them.

:class:`CheckNow` holds what the run has (the arguments of ``check_fresh``); :func:`staleness` compares it
with the entry, one question per helper — the recipe and seed, the input, the weights, the configuration
and structure, the train recipe, the output leaves' shapes and dtypes — and returns a :class:`Staleness`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..structure import structure_changes, train_recipe_changes, unpack_structure
from .digests import weights_changed
from .format import CheckBaseline, _dtype_name
from .summaries import summaries_close

__all__ = ["CheckNow", "Staleness", "staleness"]


@dataclass(frozen=True)
class CheckNow:
    """What this run has for a check, to compare with its baseline entry: the arguments of
    :meth:`~pytest_npu_parity.store.baselines.BaselineStore.check_fresh` of the same names (see there)."""

    input_hash: str
    config_hash: str
    shapes: dict[str, tuple] | None = None
    dtypes: dict[str, torch.dtype | str] | None = None
    input_summary: list | Callable[[], list] | None = None
    config_tensors: dict[str, str] | Callable[[], dict[str, str]] | None = None
    recipe: str | None = None
    seed: int | None = None
    structure_hash: str | None = None
    structure: dict | Callable[[], dict] | None = None
    train_recipe: dict | Callable[[], dict] | None = None


@dataclass
class Staleness:
    """What :func:`staleness` found: ``meta`` (the entry's meta with ``bitwise_input``, ``bitwise_config``
    and, when both sides have one, ``bitwise_structure`` set), ``changes`` (each difference, recorded vs
    now, in the order ``check_fresh`` lists them; none: fresh), and whether the structure or the input is
    among them (``StaleBaselineError.structure_changed`` / ``input_changed``)."""

    meta: dict[str, Any]
    changes: list[str] = field(default_factory=list)
    structure_changed: bool = False
    input_changed: bool = False


def staleness(recorded: CheckBaseline, now: CheckNow) -> Staleness:
    """Compare a baseline entry with what this run has (the rules are ``check_fresh``'s). Each callable of
    ``now`` is called only when its hash differs, as ``check_fresh`` documents."""
    meta = dict(recorded.meta)
    changes = _run_changes(meta, now)
    input_change = _input_change(meta, now)
    changes += [input_change] if input_change else []
    config_change = _config_change(meta, now)
    changes += [config_change] if config_change else []
    structure = _structure_lines(meta, now)
    changes += structure
    changes += _train_recipe_lines(meta, now)
    changes += _leaf_changes(recorded, now)
    return Staleness(meta=meta, changes=changes, structure_changed=bool(structure),
                     input_changed=input_change is not None)


def _run_changes(meta: dict[str, Any], now: CheckNow) -> list[str]:
    """A recipe or seed other than the recorded one."""
    changes = []
    if now.recipe is not None and meta.get("recipe") != now.recipe:
        changes.append(f"recorded under recipe {meta.get('recipe')!r}, this run uses {now.recipe!r}")
    if now.seed is not None and meta.get("seed") != now.seed:
        changes.append(f"recorded with seed {meta.get('seed')!r}, this run uses seed {now.seed!r} "
                       "(--parity-seed, ini parity_seed or the check's seed=)")
    return changes


def _input_change(meta: dict[str, Any], now: CheckNow) -> str | None:
    """An input whose hash and summary differ from the recorded ones; sets ``meta["bitwise_input"]``."""
    before = meta.get("input_hash")
    meta["bitwise_input"] = before == now.input_hash
    if before == now.input_hash:
        return None
    change = f"input hash changed (recorded {_short(before)}, now {_short(now.input_hash)})"
    summary = now.input_summary() if callable(now.input_summary) else now.input_summary
    why = "no summary given" if summary is None else summaries_close(meta.get("input_summary"), summary)
    return None if why is None else f"{change}: {why}"


def _config_change(meta: dict[str, Any], now: CheckNow) -> str | None:
    """Weights whose digests differ from the recorded ones (named as in the whole model); sets
    ``meta["bitwise_config"]``. A function's differing name alone is no change."""
    before = meta.get("config_hash")
    meta["bitwise_config"] = before == now.config_hash
    if before == now.config_hash:
        return None
    digests = now.config_tensors() if callable(now.config_tensors) else now.config_tensors
    recorded_digests = meta.get("config_tensors")
    if not (digests or recorded_digests or now.config_tensors is None):
        return None
    what = weights_changed(recorded_digests if isinstance(recorded_digests, dict) else None, digests or {})
    prefix = meta.get("submodule")
    if prefix:  # name the tensors as in the whole model
        what = re.sub(r"'([^']+)'", lambda m: repr(f"{prefix}.{m.group(1)}"), what)
    return f"{what}; model fingerprint recorded {_short(before)}, now {_short(now.config_hash)}"


def _structure_lines(meta: dict[str, Any], now: CheckNow) -> list[str]:
    """The configuration and structure differences, when the entry recorded a structure hash and it
    differs; sets ``meta["bitwise_structure"]`` when both sides have one."""
    before = meta.get("structure_hash")
    if before is None or now.structure_hash is None:
        return []
    meta["bitwise_structure"] = before == now.structure_hash
    if before == now.structure_hash:
        return []
    return _structure_changes(meta.get("structure"), now.structure, meta.get("submodule"))


def _train_recipe_lines(meta: dict[str, Any], now: CheckNow) -> list[str]:
    """A training step's train recipe differences, when the entry recorded one."""
    before = meta.get("train_recipe")
    if not isinstance(before, dict) or now.train_recipe is None:
        return []
    return train_recipe_changes(before, now.train_recipe() if callable(now.train_recipe) else now.train_recipe)


def _leaf_changes(recorded: CheckBaseline, now: CheckNow) -> list[str]:
    """Output leaves added, removed, reshaped or of another dtype (the leaf set is reported once)."""
    changes: list[str] = []
    if now.shapes is not None:
        was = {leaf: tuple(s) for leaf, s in _recorded_shapes(recorded).items()}
        was.update({leaf: None for leaf in recorded.none_leaves})
        now_shapes = {leaf: (None if s is None else tuple(int(d) for d in s)) for leaf, s in now.shapes.items()}
        changes += _diff_leaves("shape", was, now_shapes)
    if now.dtypes is not None:
        was_d = _recorded_dtypes(recorded)
        now_d = {leaf: _dtype_name(d) for leaf, d in now.dtypes.items() if d is not None}
        changes += _diff_leaves("dtype", was_d, now_d, report_sets=now.shapes is None)
    return changes


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

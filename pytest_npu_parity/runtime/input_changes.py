"""Inputs a computation changes in place: which, and their values after the run.

A check's sides each run on their own copy of the caller's inputs (``runtime.side._move``; the golden run
on its float64 copies, ``runtime.golden_run._cast_floats``). Comparing each copy after the run with the
caller's tensor tells which inputs the computation changed in place (``changed_inputs``: a key/value cache
filled by the forward, a mask edited, a counter advanced), by paths such as ``args[1]``,
``kwargs['mask']`` or ``args[0][2]``.
"""
from __future__ import annotations

from typing import Any

import torch


def changed_inputs(given: tuple[tuple, dict], ran: tuple[Any, Any]) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor after the run)`` of each tensor in ``ran`` — one side's ``(args, kwargs)`` copies
    after its run — whose values differ from the caller's ``given`` (compared in the copy's dtype and on
    its device; NaN equal to NaN; a sparse tensor by its values; another shape counts as changed).
    Containers are walked as tuples, lists and dicts of the same length and keys on both."""
    return _changed(given[0], ran[0], "args") + _changed(given[1], ran[1], "kwargs")


def _changed(given: Any, ran: Any, path: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(given, torch.Tensor) and isinstance(ran, torch.Tensor):
        if ran.shape != given.shape:
            return [(path, ran)]
        before, after = given.detach().to(device=ran.device, dtype=ran.dtype), ran.detach()
        if after.layout != torch.strided or before.layout != torch.strided:  # a sparse input: by its values
            before, after = before.to_dense(), after.to_dense()
        if after.is_floating_point() or after.is_complex():
            same = bool(torch.eq(after, before).logical_or_(after.isnan() & before.isnan()).all())
        else:
            same = torch.equal(after, before)
        return [] if same else [(path, ran)]
    if isinstance(given, (tuple, list)) and isinstance(ran, (tuple, list)) and len(given) == len(ran):
        return [p for i, (g, r) in enumerate(zip(given, ran)) for p in _changed(g, r, f"{path}[{i}]")]
    if isinstance(given, dict) and isinstance(ran, dict):
        return [p for k, g in given.items() if k in ran for p in _changed(g, ran[k], f"{path}[{k!r}]")]
    return []

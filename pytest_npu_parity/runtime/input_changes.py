"""Inputs a computation changes in place: which, and their values after the run.

A check's sides each run on their own copy of the caller's inputs (``runtime.side._move``; the golden run
on its float64 copies, ``runtime.golden_run._cast_floats``). Comparing each copy after the run with the
caller's tensor tells which inputs the computation changed in place (``changed_inputs``: a key/value cache
filled by the forward, a mask edited, a counter advanced), by paths such as ``args[1]``,
``kwargs['mask']`` or ``args[0][2]``. What the run wrote there is a result of the computation like its
return value, so each side's leaves carry it (``inplace_leaves``) under the path with :data:`INPLACE_PREFIX`
(``inplace:args[1]``): it is compared, recorded in a baseline and judged like any output leaf, by the
check's verdict (the golden run, on its own copies, carries its own).
"""
from __future__ import annotations

from typing import Any

import torch

from ..leaves import cpu_leaf

#: Leaf-path prefix of an input's value after a run that changed it in place (``inplace_leaves``).
INPLACE_PREFIX = "inplace:"


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


def inplace_leaves(changed: list[tuple[str, torch.Tensor]], outputs: dict) -> dict[str, torch.Tensor]:
    """The leaves of the inputs a run changed in place: ``{"inplace:<path>": CPU copy of the tensor after the
    run}`` for each of ``changed`` (``changed_inputs``), to be added to the run's output ``outputs``
    (``{path: leaf}``).

    Raises:
        ValueError: an output leaf already has such a path (an output dict keyed ``"inplace:args[0]"``),
            naming it.
    """
    found = {INPLACE_PREFIX + path: cpu_leaf(tensor).clone() for path, tensor in changed}
    taken = sorted(set(found) & set(outputs))
    if taken:
        raise ValueError(f"the computation returns an output leaf named {taken[0]!r}, the name under which the "
                         f"value it writes into its input {input_path(taken[0])} is compared; rename that "
                         "output key")
    return found


def is_inplace_leaf(path: str) -> bool:
    """Whether leaf ``path`` is an input's value after the run (``inplace_leaves``)."""
    return isinstance(path, str) and path.startswith(INPLACE_PREFIX)


def input_path(path: str) -> str:
    """The argument path (``args[1]``) of an ``inplace:`` leaf path (``inplace:args[1]``)."""
    return path[len(INPLACE_PREFIX):] if is_inplace_leaf(path) else path

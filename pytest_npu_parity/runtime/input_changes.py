"""Inputs a computation changes in place: which, and their values after the run.

A check's sides each run on their own copy of the caller's inputs (``runtime.side._move``; the golden run
on its float64 copies, ``runtime.golden_run._cast_floats``). Comparing each copy after the run with the
caller's tensor tells which inputs the computation changed in place (``changed_inputs``: a key/value cache
filled by the forward, a mask edited, a counter advanced), by paths such as ``args[1]``,
``kwargs['mask']`` or ``args[0][2]``. What the run wrote there is a result of the computation like its
return value, so each side's leaves carry it (``inplace_leaves``) under the path with :data:`INPLACE_PREFIX`
(``inplace:args[1]``): it is compared, recorded in a baseline and judged like any output leaf, by the
check's verdict (the golden run, on its own copies, carries its own).

A module's own state is written the same way: a training-mode forward updates BatchNorm's running
statistics, a decoder writes its key/value cache buffer. Every run puts the module's buffers back
(``runtime.module_state.kept_state``), and what it wrote there is compared like an input's value, under
:data:`STATE_PREFIX` (``inplace:buffer:1.running_mean``; ``state_leaves``). A baseline entry recorded
before these were stored says so by lacking :data:`STATE_META_KEY`.
"""
from __future__ import annotations

from typing import Any

import torch

from ..leaves import cpu_leaf

#: Leaf-path prefix of an input's value after a run that changed it in place (``inplace_leaves``).
INPLACE_PREFIX = "inplace:"

#: The input path of a module's buffer the run changed in place (``state_leaves``):
#: leaf ``inplace:buffer:<its path in the module>``.
STATE_PREFIX = "buffer:"

#: Baseline entry meta key set on recordings that store the ``inplace:buffer:`` leaves (``state_leaves``):
#: an entry without it says nothing of the module state its reference run changed.
STATE_META_KEY = "state_changes_stored"


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
                         f"value it writes in place into {input_path(taken[0])} is compared; rename that "
                         "output key")
    return found


def state_leaves(kept: Any, owners: list[torch.nn.Module], outputs: dict) -> dict[str, torch.Tensor]:
    """The leaves of the module state a run changed in place: ``{"inplace:buffer:<path>": CPU copy}`` for each
    registered buffer of ``owners`` that ``kept`` (the run's ``module_state.KeptState``, inside its block:
    before the state is put back) found written (``KeptState.changed_named``), to be added to the run's
    ``outputs``.

    Raises:
        ValueError: an output leaf already has such a path, naming it (as ``inplace_leaves``).
    """
    return inplace_leaves([(STATE_PREFIX + name, tensor) for name, tensor in kept.changed_named(owners)], outputs)


def is_state_leaf(path: str) -> bool:
    """Whether leaf ``path`` is a module buffer's value after the run (``state_leaves``)."""
    return isinstance(path, str) and path.startswith(INPLACE_PREFIX + STATE_PREFIX)


def is_inplace_leaf(path: str) -> bool:
    """Whether leaf ``path`` is an input's value after the run (``inplace_leaves``)."""
    return isinstance(path, str) and path.startswith(INPLACE_PREFIX)


def input_path(path: str) -> str:
    """The argument path (``args[1]``) of an ``inplace:`` leaf path (``inplace:args[1]``)."""
    return path[len(INPLACE_PREFIX):] if is_inplace_leaf(path) else path

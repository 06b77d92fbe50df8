"""Baselines that carry what they were computed from: recorded inputs and weights, replayed elsewhere.

A user's own test builds its model and input the way PyTorch teaches (``torch.manual_seed(0)``,
``MyModel()``, ``torch.randn(...)``). Those numbers are not the same on every machine: ``uniform_``
and ``normal_`` (and the ``nn.init`` functions built on them) take vectorized code paths on the CPU
whose rounding depends on the instruction set, so on another CPU kernel path the same seed draws
other last bits. Measured between ``ATEN_CPU_CAPABILITY=avx512`` and ``default`` on torch 2.14.1
(``benchmarks/replay_draws.py``): 40–60 % of the elements of ``nn.Linear``/``nn.LSTM`` weights,
``torch.randn`` inputs and ``trunc_normal_``/``xavier_normal_`` draws differ, by at most 7.2e-7 of the
tensor's largest magnitude (about 6 float32 ULPs of it). A baseline that stored only fingerprints then
reports "weights changed" there and can never be compared.

So a recording stores, beside the reference outputs, the check's tensor inputs and — unless the module's
weights are version-stable (:func:`pytest_npu_parity.stable_init.stable_init_` marks them) or too large —
its ``state_dict`` (``CheckBaseline.extras``; content-addressed, so a batch or model recorded by several
checks is stored once per file, and from 4 KiB on once per store: ``baselines.ObjectPool``). A compare run whose fingerprints differ from the recording's then decides
per tensor (:func:`plan_replay`, :func:`draw_distance`):

* **same computation, other draws** — same structure (``structure.structure_hash``), the same tensor
  names, shapes and dtypes, integer/bool tensors bitwise equal, and every floating tensor within
  :data:`DRAW_RTOL` of the recorded one, each element against its own magnitude floored at the median of the
  tensor's non-zero magnitudes (so one large column cannot hide a change of the others, and a tensor
  that is mostly exact zeros is not judged by the few values a draw left just above zero): the check
  runs on the *recorded* inputs and on a copy of the module holding the *recorded* weights, and its note
  says so (the user's module and inputs are never changed);
* **a real change** — anything else (the user edited the model, its config, its init, the data
  pipeline, a planted ``weight × (1 + 1e-4)`` fault): the baseline stays stale as before, and the stale
  message says which tensor moved by how much, beyond what another machine's draws explain.

Inputs that differ beyond :data:`DRAW_RTOL` but agree in their summary (activations captured from a model
recomputed on another machine, ``provenance.SUMMARY_RTOL``) keep the summary rule of
``BaselineStore.check_fresh``: the check runs on the current inputs.
"""
from __future__ import annotations

import copy
import types
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..modules import owner_module
from ..runtime.stable_init import STABLE_MARK  # set by stable_init_: weights the same on every machine
from ..store.digests import uninitialized
from ..store.format import BaselineError

__all__ = ["DRAW_RTOL", "REPLAY_LIMIT_BYTES", "STABLE_MARK", "Replay", "recorded_extras", "plan_replay",
           "draw_distance", "replayed"]

#: Largest ``draw_distance`` a tensor may have from the recorded one and still count as the same draw
#: recomputed on another machine. Measured between ATen's avx512 and default kernel paths (torch 2.14.1,
#: ``benchmarks/replay_draws.py``): up to 2.3e-6 for ``randn``/``normal_``/``trunc_normal_``/``xavier_normal_``
#: (an element near zero carries the rounding error of the values around it) and 2.2e-7 for uniform draws.
#: 8e-6 leaves a margin of 3.4× and still refuses a weight or input edit of 1e-5.
DRAW_RTOL = 8e-6
#: Default bound on the bytes one check records for replay (inputs and weights together, before the
#: per-file deduplication; ini ``parity_replay_limit``, in MiB). 16 MiB holds a 4 M-parameter fp32 model; a
#: resnet18 (45 MiB) is better seeded with ``stable_init_``, which every machine draws the same. Above it the weights are not recorded (and the inputs too, if they alone
#: exceed it); the entry's ``replay`` meta says why, and a stale message on another machine repeats it.
REPLAY_LIMIT_BYTES = 16 * 2**20

_INPUT = "input:"
_WEIGHT = "weight:"


@dataclass
class Replay:
    """What a compare run replays for one check.

    Attributes:
        fn: the computation to run (a copy of the module with the recorded weights, or a bound method of
            that copy, when weights are replayed; else the caller's ``fn``).
        given: ``(args, kwargs)`` or ``(args, kwargs, labels)`` with recorded tensors in place of the
            caller's where inputs are replayed (fresh CPU tensors; the caller's are untouched).
        note: one line for the check's notes: what was replayed and the largest draw difference.
    """

    fn: Any
    given: tuple
    note: str


def _input_leaves(given: Any) -> tuple[list, Any]:
    leaves, spec = tree_flatten(given)
    return leaves, spec


def _stable(module: torch.nn.Module) -> bool:
    """Every submodule that holds tensors of its own carries ``stable_init_``'s mark (a wrapper around a
    stable-initialized model, such as a module collecting intermediates, holds none of its own)."""
    owners = [m for m in module.modules()
              if next(m.parameters(recurse=False), None) is not None or next(m.buffers(recurse=False), None) is not None]
    return bool(owners) and all(getattr(m, STABLE_MARK, None) is not None for m in owners)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def recorded_extras(fn: Any, given: tuple, limit_bytes: int = REPLAY_LIMIT_BYTES) -> tuple[dict[str, torch.Tensor], dict]:
    """What a recording stores for replay: ``(extras, meta)``.

    Args:
        fn: the check's module, bound method of a module, or function.
        given: ``(args, kwargs)`` (or with labels) as the caller passed them, before any run.
        limit_bytes: the bound on the recorded bytes (:data:`REPLAY_LIMIT_BYTES`).

    Returns:
        ``extras``: ``{"input:<i>": tensor}`` for the i-th leaf of ``torch.utils._pytree.tree_flatten(given)``
        that is a tensor, and ``{"weight:<name>": tensor}`` for the module's ``state_dict``; detached CPU
        copies. ``meta``: ``{"inputs": n, "weights": n | "<why not>"}`` for the entry's ``replay`` meta.
    """
    leaves, _ = _input_leaves(given)
    inputs = {f"{_INPUT}{i}": t for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
    in_bytes = sum(_nbytes(t) for t in inputs.values())
    meta: dict[str, Any] = {}
    if in_bytes > limit_bytes:
        meta["inputs"] = (f"not recorded: {in_bytes / 2**20:.1f} MiB of inputs, over the {limit_bytes / 2**20:g} MiB "
                          "replay limit (ini parity_replay_limit)")
        inputs = {}
    else:
        meta["inputs"] = len(inputs)
    module = owner_module(fn)
    weights: dict[str, torch.Tensor] = {}
    if module is None:
        meta["weights"] = "a function: no weights"
    elif _stable(module):
        meta["weights"] = "not recorded: stable_init_ weights are the same on every machine"
    elif any(uninitialized(t) for t in module.state_dict(keep_vars=True).values()):
        meta["weights"] = ("not recorded: a lazy module's parameters are not materialized before the check "
                           "(they are drawn in its first forward, under the check's seed)")
    else:
        state = {f"{_WEIGHT}{k}": v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
        w_bytes = sum(_nbytes(t) for t in state.values())
        kept_in = sum(_nbytes(t) for t in inputs.values())
        if kept_in + w_bytes > limit_bytes:
            beside = f" beside {kept_in / 2**20:.1f} MiB of inputs" if kept_in else ""
            meta["weights"] = (f"not recorded: {w_bytes / 2**20:.1f} MiB of weights{beside}, over the "
                               f"{limit_bytes / 2**20:g} MiB replay limit (ini parity_replay_limit); seed them with "
                               "pytest_npu_parity.stable_init.stable_init_ or load a checkpoint, so that "
                               "every machine builds the same model")
        else:
            weights = state
            meta["weights"] = len(state)
    extras = {k: v.detach().to("cpu", copy=True) for k, v in {**inputs, **weights}.items()}
    return extras, meta


def draw_distance(recorded: torch.Tensor, now: torch.Tensor) -> float:
    """How far ``now`` is from ``recorded``: ``max_i |now_i - recorded_i| / max(|recorded_i|, m)`` (float64)
    for floating tensors, where ``m`` is the median of the recorded tensor's *non-zero* magnitudes — each
    element against its own magnitude, floored at the tensor's typical one (a draw's rounding error is
    about an ULP of the values around it, so elements near zero are not held to their own tiny magnitude,
    while one large column cannot hide a change of the others). Exact zeros are left out of the typical
    magnitude: in a tensor that is mostly zeros (``relu``/``clamp`` of a draw, pruned or non-negative
    weights, padding) the plain median is 0, and an element that the draw left just above zero would be
    held to its own size. 0.0 when equal, ``inf`` when a value is not finite or an element differs where
    the floor is 0 (every recorded value is zero); 0.0 or ``inf`` (equal or not) for integer and bool
    tensors.

    Raises:
        ValueError: shapes or dtypes differ (the caller reports that as a change).
    """
    if recorded.shape != now.shape or recorded.dtype != now.dtype:
        raise ValueError(f"{tuple(recorded.shape)} {recorded.dtype} vs {tuple(now.shape)} {now.dtype}")
    now = now.detach().to("cpu")
    if torch.equal(recorded, now):
        return 0.0
    if not (recorded.is_floating_point() or recorded.is_complex()):
        return float("inf")
    diff = (now.to(torch.complex128 if now.is_complex() else torch.float64)
            - recorded.to(torch.complex128 if recorded.is_complex() else torch.float64)).abs()
    magnitude = recorded.abs().double().flatten()
    nonzero = magnitude[magnitude != 0]
    floor = nonzero.median().item() if nonzero.numel() else 0.0
    ratio = diff.flatten() / magnitude.clamp_min(floor)
    ratio = torch.where(diff.flatten() == 0, torch.zeros_like(ratio), ratio)  # 0/0 where both are 0
    worst = ratio.max().item() if ratio.numel() else 0.0
    return worst if worst == worst else float("inf")


def _all_zero(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and not bool(tensor.any())


def _largest_change(recorded: torch.Tensor, now: torch.Tensor) -> float:
    """``max |now - recorded|`` (float64) of two floating tensors of one shape."""
    return (now.detach().to("cpu", torch.float64) - recorded.to(torch.float64)).abs().max().item()


def _closest(recorded: dict[str, torch.Tensor], now: dict[str, Any], what: str) -> tuple[float, str | None, str | None]:
    """``(largest draw distance, its name, why not replayable)`` over the names of ``recorded``."""
    if set(recorded) != set(now):
        gone, new = sorted(set(recorded) - set(now)), sorted(set(now) - set(recorded))
        return float("inf"), None, f"{what}s changed (recorded only: {gone[:3]}, now only: {new[:3]})"
    worst, name = 0.0, None
    for key, rec in recorded.items():
        cur = now[key]
        if not isinstance(cur, torch.Tensor):
            return float("inf"), key, f"{what} {key} is a {type(cur).__name__} now, a tensor when recorded"
        try:
            d = draw_distance(rec, cur)
        except ValueError as exc:
            return float("inf"), key, f"{what} {key} changed ({exc})"
        if d > DRAW_RTOL:
            how = (f"differs (by up to {_largest_change(rec, cur):.3g} where every recorded value is 0)"
                   if d == float("inf") and _all_zero(rec) else
                   "differs" if d == float("inf") else f"differs by up to {d:.2g} of its own size (relative)")
            return d, key, (f"{what} {key} {how}, beyond the {DRAW_RTOL:g} that another machine's random "
                            "draws explain: a real change")
        if d > worst:
            worst, name = d, key
    return worst, name, None


def plan_replay(extras: dict[str, torch.Tensor], meta: dict, fn: Any, given: tuple,
                hashes: dict[str, Any]) -> tuple[Replay | None, str | None]:
    """Whether and what to replay for a check whose baseline entry recorded ``extras``.

    Args:
        extras: the entry's ``CheckBaseline.extras``.
        meta: the entry's ``CheckBaseline.meta`` (``input_hash``, ``config_hash``, ``structure_hash``,
            ``replay``).
        fn: the caller's computation; ``given``: its ``(args, kwargs[, labels])``.
        hashes: the check's current fingerprints (``checks.reference.check_hashes``).

    Returns:
        ``(Replay, None)`` when the inputs and/or weights differ from the recording by no more than other
        draws explain (module docstring); ``(None, why)`` when the weights are a real change or were not
        recorded (``why`` joins the stale message); ``(None, None)`` when nothing needs replaying or the
        inputs are left to the summary rule.
    """
    module = owner_module(fn)
    inputs_differ = meta.get("input_hash") != hashes.get("input_hash")
    weights_differ = module is not None and meta.get("config_hash") != hashes.get("config_hash")
    if not (inputs_differ or weights_differ):
        return None, None
    notes = []
    new_given = given
    if inputs_differ:
        recorded_in = {k[len(_INPUT):]: v for k, v in extras.items() if k.startswith(_INPUT)}
        leaves, spec = _input_leaves(given)
        now_in = {str(i): t for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
        if recorded_in:
            worst, _, why = _closest(recorded_in, now_in, "input leaf")
            if why is None and worst > 0.0:  # equal tensors: a non-tensor argument changed, not a draw
                replaced = [recorded_in[str(i)].clone().requires_grad_(leaf.requires_grad)
                            if str(i) in recorded_in else leaf for i, leaf in enumerate(leaves)]
                new_given = tree_unflatten(replaced, spec)
                notes.append(f"the recorded inputs (largest draw difference {worst:.2g} of their values)")
    replay_fn = fn
    if weights_differ:
        recorded_w = {k[len(_WEIGHT):]: v for k, v in extras.items() if k.startswith(_WEIGHT)}
        if not recorded_w:
            reason = (meta.get("replay") or {}).get("weights")
            return None, (f"the recording holds no weights to replay ({reason})" if isinstance(reason, str) else None)
        if meta.get("structure_hash") is not None and meta.get("structure_hash") != hashes.get("structure_hash"):
            return None, "the module's structure or configuration changed: a real change, not replayed"
        state = module.state_dict()
        worst, name, why = _closest(recorded_w, dict(state), "weight")
        if why is not None:
            return None, why
        try:
            clone = copy.deepcopy(module)
        except Exception as exc:  # a lock, an open file, a process group
            return None, (f"the module cannot be copied to replay its recorded weights ({type(exc).__name__}: "
                          f"{exc}); seed it with stable_init_ or load a checkpoint")
        clone.load_state_dict({k: v.clone() for k, v in recorded_w.items()}, strict=True)
        replay_fn = clone if fn is module else types.MethodType(fn.__func__, clone)
        notes.append(f"the recorded weights (largest draw difference {worst:.2g}, in {name!r})")
    if not notes:
        return None, None
    return Replay(replay_fn, new_given,
                  "replayed " + " and ".join(notes) + ": this machine's random draws differ from the "
                  "recording's in last bits only"), None


def replayed(load: Callable[[], Any] | None, plan: Any, fn: Any, given: tuple, hashes: dict[str, Any],
             rehash: Callable[[Any, tuple], dict[str, Any]]) -> tuple[Any, tuple, dict[str, Any], Any]:
    """``(fn, given, hashes, plan)`` to run a check (its ``CheckPlan``) with, against the entry it has in
    the test's baseline file (``load()``: the file or None; None in record mode or without baselines):
    the recorded ones where this machine's differ from them by no more than other random draws explain
    (``plan_replay``; the plan's notes say so, ``rehash(fn, given)`` fingerprints them), else as given
    (a real change then stays stale, and ``hashes["replay_refused"]`` says why; so also without an
    entry, with one that predates replay, or a file that cannot be loaded: the check reports that)."""
    if load is None:
        return fn, given, hashes, plan
    try:
        baseline = load()
    except BaselineError:
        return fn, given, hashes, plan  # the check reports it
    entry = baseline.checks.get(plan.name) if baseline is not None else None
    if entry is None or not (entry.extras or entry.meta.get("replay")):  # a recording that predates replay
        return fn, given, hashes, plan
    replay, refused = plan_replay(entry.extras, entry.meta, fn, given, hashes)
    if replay is None:
        if refused:
            hashes = dict(hashes, replay_refused=refused)
        return fn, given, hashes, plan
    return replay.fn, replay.given, rehash(replay.fn, replay.given), replace(plan, notes=plan.notes + (replay.note,))

"""First-divergence localization: which submodule of a failing check first computes something else.

"Full forward differs by 3e-2" says that a port is wrong, not where. When a check of a module (a
full forward, ``generate``, a train step) is out of tolerance, ``localize`` runs both sides again
with forward hooks, compares the outputs of the submodule calls in execution order and separates
each call's *local* error from the error it *inherited* from its inputs:

* total     — the target's output of the call vs the reference's output;
* local     — the target's submodule run on the *reference's* inputs of that call (moved to the
  target; same recipe, patch set, shared random stream — its state restored to what it was when
  the call began — and the grad/autocast state the call ran under) vs the reference's output;
* inherited — the target's output vs that local re-run: what the call's different inputs caused.

The first divergence is the earliest call, in completion order, whose *local* comparison fails
under the check's tolerance (the ``compare`` rule: more than ``budget`` of the elements outside
``atol + rtol·|expected|``). A call whose inputs are bitwise the reference's needs no re-run: its
local error is its total error.

Memory stays bounded by descending level by level instead of storing every activation of the
model: a pass records only the calls made inside one *scope* (at first the check's module call, or
the check's function for a bound method such as ``generate``) down to ``RECORD_DEPTH`` levels (its
children and their children); the earliest child with a local error becomes the next scope, whose
own calls that pass already recorded; below those, only the culprit is run again, on each side from
its own recorded inputs. A full Aurora forward holds ≈ 2 900 submodule calls and ≈ 1.2 GB of
outputs; two levels of it hold a few MB, and a whole-model descent needs two passes of the model
instead of four. The descent stops at a module without submodules, or at a scope none of
whose children diverges locally: then the divergence starts in that module's own code (e.g. a mask
its ``forward`` builds and hands to a child), and the table shows which child first inherits it.

One step further down, the op trace (``op_trace.trace_ops``): where the descent ended at such a
module (also the check's own module, when none of its submodules diverges), that module's call is
run once more on the target, from the reference's recorded inputs of the call, under a dispatch
mode that re-runs every op in float64 on the CPU from the target op's own inputs; the message then
names the first op whose own (local) error is beyond its dtype's budget, with its module path and
source line (``Localization.op_trace``; the report's ``localization_ops``). It is not run where the
descent stopped at the budget, where the levels came from another check's localization, or for a
train step whose forward agrees.

The hooks exist only inside ``localize``: a passing check never runs it (``failure_hook`` is a
``ParitySession`` failure hook), so a passing run pays nothing. Computation done outside
``nn.Module.__call__`` (a free function, a direct ``.forward`` call) belongs to the calling module.

Where the check's reference was a stored baseline there is nothing live to hook: the reference side
is then a live CPU run of the upstream computation, and the message says so.

Train steps: the forward of ``module(**inputs)`` in training mode is localized as above (dropout,
masking and noise replay exactly: the shared random stream is restored per call). Gradients are not
hooked (no ``register_full_backward_hook``): the step already compares every parameter's gradient,
so those leaves are ordered by backward order — the reverse of the forward completion order of the
modules owning them — and the first gradient out of tolerance is named. Buffers out of tolerance
(``buffer.<name>``) are listed with the module that owns each; when every submodule call's output
and the loss agree, the first divergence is the first gradient out of tolerance (the backward
pass), else the first buffer — named by its owner, e.g. the BatchNorm whose momentum differs, not
the model around it —, else the first parameter after the step (the optimizer step).

Outputs that are not plain strided tensors are made comparable (``comparable``): a nested tensor
(``nn.TransformerEncoder``'s fast path in eval with a ``src_key_padding_mask`` passes them between
its layers; they have no ``shape``) is compared as ``torch.nested.to_padded_tensor(t, 0.0)``, a
sparse one densified, and one that cannot be converted is left out; the table's notes say which.
A submodule call that raises when re-run alone on the reference's inputs keeps its total error
and a note; the descent goes on.

Stateful arguments: a call's inputs are recorded as they were when the call began (``_snapshot``,
at its forward pre-hook). Tensors are copied (as before); so is every argument that holds state the
call or the rest of the run changes — a Hugging Face key/value cache (``DynamicCache``,
``EncoderDecoderCache``, … recognized by class name, transformers is not imported) that each
decoder layer adds its keys to and that ``generate`` hands to every step, or any other object with
attributes (``runtime.side.is_state``): a deep copy with its tensors on the CPU
(``runtime.side.copy_state``; modules and parameters it refers to are shared, not copied). Each
re-run gets its own fresh copy of that snapshot on its device, so a re-run starts from the cache the
call began with (not the one the whole run filled: "The size of tensor a (20) must match the size
of tensor b (10)") and never changes the snapshot or the next re-run. Within one pass the snapshots
share the CPU copy of a tensor that has not changed since an earlier recorded call (same object,
same version counter): recording every decoder layer's cache holds the cache about once, not once
per layer. Mappings keep their type (T5's ``encoder_outputs`` stays a ``BaseModelOutput``, read as
``encoder_outputs[0]``), and a cache a call returns is compared by its layers' keys and values
(``compare.cache_fields``). Scopes whose inputs hold such a snapshot are not shared
(``LocalizationCache``: the snapshot has no fingerprint).

Within a budget (``Localizer``, the session's failure hook in the plugin): a red run often fails
everywhere at once, and every failing check of one model would otherwise re-run both sides level by
level. The ``Localizer`` therefore

* shares what it computed: every scope a descent entered (a module, its weights, the reference's
  inputs to it, the random stream's state, grad/autocast mode, recipe, target, patch set and
  tolerance) keeps the levels found below it, so a later check whose module and inputs are the same
  — a submodule check on the activations its model handed that module, a whole-model check whose
  inner ``AuroraModel`` call is the same — gets its answer without running anything;
* runs only where a run can tell something: not for a check whose outputs differ in structure,
  shape or dtype (that is the difference), and — as before — never for a failure raised before a
  comparison (a stale, missing or corrupt baseline, an exception);
* keeps to a time budget per session (``budget_s``, wall seconds; the plugin's
  ``--parity-localize-budget``): a localization starts only when its expected cost
  (``COST_FACTOR`` × its check's own duration) fits in what is left, so cheap submodule checks are
  still localized after an expensive whole-model one; a check that does not fit is not localized
  (unless an earlier descent answers it for free) and says so with the command that localizes it;
  a descent running past the budget stops between levels and says where. ``forced`` lifts the
  budget.
"""
from __future__ import annotations

import contextlib
import copy
import math
import random
import shlex
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from .budgets import DEFAULT_BUDGET_S  # noqa: F401  (the default of Localizer; also localize.DEFAULT_BUDGET_S)
from .judge.allclose import CompareResult, LeafResult, compare
from .leaves import cache_fields
from .judge.tolerance import Tolerance
from .report import columns as col
from .rng import same_randomness
from .runtime.side import _move, copy_state, is_state

#: Deepest scope the descent enters (a safety bound; Aurora's deepest module path has 8 parts).
MAX_LEVELS = 16
#: Local re-runs per level, at most (each is one submodule run on the target).
MAX_LOCAL_RUNS = 64
#: Levels of calls one pass records below its scope (children, grandchildren): the next level of
#: the descent comes from the same pass, without running the culprit again.
RECORD_DEPTH = 2
#: Calls shown after the first divergence in its level, and gradients after the first failing one.
CONTEXT_ROWS = 2
#: A localization's expected cost in units of its check's own duration (``CheckRecord.duration_s``):
#: two hooked passes, a few local re-runs and smaller passes below (measured on Aurora: 2–3×).
COST_FACTOR = 3.0


# --------------------------------------------------------------------------------------------
# results


@dataclass
class Site:
    """One submodule call, compared between the sides.

    ``path`` is the dotted module path (prefixed with the check's ``submodule``) plus ``#k`` for the
    k-th call (from 0) when the module ran more than once in its pass; ``depth`` is the level of the
    descent (0: called directly by the check's module or function). ``total``/``local``/``inherited``
    are the worst leaves (largest ``err_ratio``) of the three comparisons (module doc); ``local`` and
    ``inherited`` are None where no local re-run was made. ``verdict``: ``ok``, ``local``,
    ``inherited``, ``fail`` (out of tolerance, not separated) or ``missing`` (the call happened on one
    side only).
    """

    path: str
    module_type: str
    depth: int
    order: tuple
    total: LeafResult | None
    local: LeafResult | None = None
    inherited: LeafResult | None = None
    verdict: str = "ok"
    first: bool = False

    @property
    def failed(self) -> bool:
        return self.verdict != "ok"

    def to_row(self) -> dict[str, Any]:
        """A JSON-able dict (the report's ``localization`` entries)."""
        row: dict[str, Any] = {"kind": "activation", "submodule": self.path, "module_type": self.module_type,
                               "depth": self.depth, "verdict": self.verdict, "first_divergence": self.first}
        for prefix, leaf in (("", self.total), ("local_", self.local), ("inherited_", self.inherited)):
            for metric in ("max_abs", "rel_l2", "cosine", "err_ratio"):
                row[prefix + metric] = _num(getattr(leaf, metric)) if leaf is not None else None
        row["leaf"] = self.total.path if self.total is not None else None
        return row


@dataclass
class Localization:
    """The outcome of ``localize`` for one failing check.

    Attributes:
        check: the check's name.
        reference: what the reference side was (``"a live CPU run"``; with a note when the check's
            own reference was a stored baseline).
        sites: the calls shown in the table, in completion order (descendants before their parent).
        first: the first divergence (a ``Site``), or None when no submodule call diverges locally.
        own_code: the module (path) whose own code, outside its submodules, starts the divergence;
            None when a module without submodules diverges (``first`` itself).
        gradients: train steps: the gradient rows shown, in backward order (JSON-able dicts).
        first_gradient: the first gradient leaf out of tolerance in backward order, or None.
        notes: remarks (non-reproducible re-runs, calls on one side only, limits reached, levels
            reused from another check's localization).
        calls_hooked: submodule calls seen in the first pass; levels: levels compared here (not
            reused); passes: hooked runs made on each side; local_runs: local re-runs made.
        reused_from: ``"<check> (<test id>)"`` whose localization answered the levels below some
            scope of this one (nothing was run for them), or None.
        stopped: ``"budget"`` when the descent stopped between levels because the time budget was
            spent (``first`` is then the deepest divergence found so far), else None.
        buffers: train steps: the rows of the buffers out of tolerance (``buffer.<name>`` leaves), each
            naming the module that owns the buffer (JSON-able dicts, in module order).
        first_buffer: the first such buffer leaf, or None; ``buffer_owner``: its module as
            ``"<path> (<type>)"`` (a BatchNorm whose running statistics differ, not the model
            around it).
        first_param: train steps: the first ``param.<name>`` leaf (after the optimizer step) out of
            tolerance while every gradient is within it (the optimizer step differs), or None.
        loss_agrees: train steps: the ``loss`` leaf is within tolerance (then a difference no
            submodule call explains lies in the backward pass, a buffer update or the optimizer
            step, not in the module's own forward code).
        op_trace: the ``op_trace.OpTrace`` of the module where the descent ended (a module without
            submodules, or the one whose own code diverges), naming the first op beyond its budget;
            None where the descent did not end at a module (a bound method's own code, a budget
            stop, levels reused from another check, a train step whose forward agrees).
    """

    check: str
    reference: str
    sites: list[Site] = field(default_factory=list)
    first: Site | None = None
    own_code: str | None = None
    gradients: list[dict[str, Any]] = field(default_factory=list)
    first_gradient: str | None = None
    notes: list[str] = field(default_factory=list)
    calls_hooked: int = 0
    levels: int = 0
    passes: int = 0
    local_runs: int = 0
    reused_from: str | None = None
    stopped: str | None = None
    buffers: list[dict[str, Any]] = field(default_factory=list)
    first_buffer: str | None = None
    buffer_owner: str | None = None
    first_param: str | None = None
    loss_agrees: bool = False
    op_trace: Any = None

    def to_rows(self) -> list[dict[str, Any]]:
        """The table as JSON-able dicts (``record.localized.localization``): activation rows, then
        gradient rows; each row also names the reference side."""
        rows = [dict(site.to_row(), reference=self.reference) for site in self.sites]
        rows += [dict(row, reference=self.reference) for row in self.gradients]
        rows += [dict(row, reference=self.reference) for row in self.buffers]
        return rows

    def op_rows(self) -> list[dict[str, Any]] | None:
        """The op table (``op_trace.OpTrace.to_rows``: the first culprit op first) as JSON-able dicts
        (``record.localized.localization_ops``), or None without an op trace."""
        return None if self.op_trace is None else self.op_trace.to_rows()

    def summary(self) -> str:
        """One line naming the first divergence and its local vs inherited error."""
        if self.first is None and self.loss_agrees:
            # Every submodule call's output and the loss agree: say which state of the step differs
            # (a train step also compares gradients, parameters after the step and buffers).
            if self.first_gradient is not None:
                return (f"First divergence: gradient {self.first_gradient} (the first out of tolerance in backward "
                        "order); every submodule call's output agrees, so the backward pass differs")
            if self.first_buffer is not None:
                return (f"First divergence: {self.first_buffer} of {self.buffer_owner} — every submodule call's "
                        "output and every gradient agrees, so that module updates its buffer differently during "
                        "the forward (for a BatchNorm: its momentum or running statistics)")
            if self.first_param is not None:
                return (f"First divergence: the optimizer step — {self.first_param} after the step differs while "
                        "every gradient and submodule call's output agrees")
        if self.first is None:
            return (f"First divergence: none of the submodule calls diverges locally; the difference starts in "
                    f"{self.own_code} itself (outside its submodules)")
        site = self.first
        what = f"{site.path} ({site.module_type})"
        if self.own_code is not None:
            what += ", in its own code outside its submodules"
        local, inherited = site.local, site.inherited
        return (f"First divergence: {what} — local err/tol {_fmt(local.err_ratio if local else None)} "
                f"(rel-L2 {_fmt(local.rel_l2 if local else None)}) vs inherited err/tol "
                f"{_fmt(inherited.err_ratio if inherited else None)} "
                f"(rel-L2 {_fmt(inherited.rel_l2 if inherited else None)})")

    def format(self) -> str:
        """The text appended to the failure message: summary, how it was measured, the short table."""
        if self.levels:
            how = (f"forward hooks on {self.calls_hooked} submodule calls, {self.levels} level(s) in "
                   f"{self.passes} pass(es), {self.local_runs} local re-run(s)")
        else:
            how = "nothing re-run (answered by an earlier localization, see the note)"
        lines = [self.summary(), f"Localized against {self.reference}: {how}.",
                 "(local: the target's submodule on the reference's inputs vs the reference; inherited: the "
                 "target's output vs that re-run; err/tol: max |diff| / (atol + rtol·|reference|), > 1 fails)"]
        lines += [f"Note: {note}" for note in self.notes]
        if self.sites:
            lines.append("")
            lines += _site_table(self.sites)
        if self.gradients:
            lines.append("")
            lines.append("Gradients in backward order (reverse forward completion of their modules; no backward "
                         "hooks): first out of tolerance: " + (self.first_gradient or "none"))
            lines += _gradient_table(self.gradients)
        if self.buffers:
            lines.append("")
            lines.append("Buffers out of tolerance, with the module that owns each:")
            lines += _buffer_table(self.buffers)
        if self.op_trace is not None:
            lines.append("")
            lines.append(self.op_trace.format())
        return "\n".join(lines)


def _num(value: float) -> float | None:
    return None if value is None else float(value)


def _fmt(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3g}"


def _site_table(sites: list[Site]) -> list[str]:
    header = ("submodule", "max_abs", "rel_l2", "cosine", "local err/tol", "inherited err/tol", "verdict")
    rows = [header]
    for site in sites:
        verdict = site.verdict.upper() + " <- first divergence" if site.first else site.verdict
        total = site.total
        rows.append(("  " * site.depth + site.path,
                     _fmt(total.max_abs) if total else "-", _fmt(total.rel_l2) if total else "-",
                     f"{total.cosine:.7f}" if total and not math.isnan(total.cosine) else "-",
                     _fmt(site.local.err_ratio) if site.local else "-",
                     _fmt(site.inherited.err_ratio) if site.inherited else "-", verdict))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _buffer_table(buffers: list[dict[str, Any]]) -> list[str]:
    header = ("buffer", "module", "max_abs", "rel_l2", "err/tol", "verdict")
    rows = [header] + [(b["leaf"], f"{b['submodule']} ({b['module_type']})", _fmt(b["max_abs"]), _fmt(b["rel_l2"]),
                        _fmt(b["err_ratio"]), b["verdict"] + (" <- first" if b.get("first_divergence") else ""))
                       for b in buffers]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _gradient_table(gradients: list[dict[str, Any]]) -> list[str]:
    header = ("gradient", "max_abs", "rel_l2", "cosine", "err/tol", "verdict")
    rows = [header] + [(g["leaf"], _fmt(g["max_abs"]), _fmt(g["rel_l2"]), _fmt(g["cosine"]), _fmt(g["err_ratio"]),
                        g["verdict"] + (" <- first" if g.get("first_divergence") else "")) for g in gradients]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# --------------------------------------------------------------------------------------------
# recording one pass


@dataclass
class _Call:
    """One submodule call recorded on one side (inputs and outputs as CPU copies)."""

    name: str
    index: int
    module_type: str
    inputs: tuple[tuple, dict] | None = None
    rng: tuple | None = None
    state: tuple | None = None
    output: dict[str, torch.Tensor] | None = None
    parent: tuple[str, int] | None = None
    rec_depth: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.index


@dataclass
class _View:
    """The recorded calls of one pass made directly inside one call (``_Recorder.view``)."""

    calls: list[_Call]
    counts: Counter


class _State:
    """A stateful argument of a recorded call as it was when the call began (``_snapshot``).

    ``copy`` is a copy of the object (``runtime.side.copy_state``) whose tensors are detached CPU
    copies and whose device attributes say ``cpu``; it is never run: each re-run gets its own
    ``fresh`` copy, so a re-run that adds to a cache changes neither the snapshot nor the next re-run.
    """

    __slots__ = ("copy",)

    def __init__(self, copy_: Any):
        self.copy = copy_

    def fresh(self, device: torch.device) -> Any:
        """A new copy of the snapshot with its tensors (and device attributes) on ``device``."""
        return copy_state(self.copy, lambda t: t.to(device, copy=True), device)


def _detached_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _rebuild(obj: Mapping, items: dict) -> Any:
    """``items`` as a mapping of ``obj``'s type where it can be built from a dict (a Hugging Face
    ``ModelOutput`` such as T5's ``encoder_outputs``, read by index as ``encoder_outputs[0]``), else
    the dict itself."""
    if type(obj) is dict:
        return items
    try:
        return type(obj)(items)
    except Exception:  # noqa: BLE001 - a mapping type without a dict constructor (defaultdict): a plain dict
        return items


def _snapshot(obj: Any, tensor: Any = _detached_cpu) -> Any:
    """What a recorded call is re-run on later: the inputs as they were when it began.

    Tensors become ``tensor(t)`` (detached CPU copies); tuples, lists and mappings are walked (a
    mapping keeps its type, ``_rebuild``); a stateful object (``runtime.side.is_state``: a Hugging
    Face ``Cache``, any other object with attributes) becomes a ``_State`` holding a copy of it as it
    is now, since the call and the rest of the run change it (a decoder layer adds its keys to the
    cache it is given). An object that cannot be copied is kept as it is (a re-run then sees its
    state at that time). Other objects (numbers, strings, modules, functions) are kept as they are.
    """
    if isinstance(obj, torch.Tensor):
        return tensor(obj)
    if isinstance(obj, tuple):
        return tuple(_snapshot(v, tensor) for v in obj)
    if isinstance(obj, list):
        return [_snapshot(v, tensor) for v in obj]
    if isinstance(obj, Mapping):
        return _rebuild(obj, {k: _snapshot(v, tensor) for k, v in obj.items()})
    if is_state(obj):
        try:
            return _State(copy_state(obj, tensor, torch.device("cpu")))
        except Exception:  # noqa: BLE001 - cannot be copied (a lock, an open file): the live object
            return obj
    return obj


def _cpu_copy(obj: Any) -> Any:
    """Detached CPU copies of the tensors in a nested structure, stateful objects as snapshots (``_snapshot``)."""
    return _snapshot(obj)


def _to_device(obj: Any, device: torch.device) -> Any:
    """A recorded structure (``_snapshot``) ready to run on ``device``: tensors moved, each
    ``_State`` a fresh copy of its snapshot, mappings of their own type."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, copy=True)  # a call that changes its input in place leaves the recording as it was
    if isinstance(obj, _State):
        return obj.fresh(device)
    if isinstance(obj, tuple):
        return tuple(_to_device(v, device) for v in obj)
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    if isinstance(obj, Mapping):
        return _rebuild(obj, {k: _to_device(v, device) for k, v in obj.items()})
    return obj


def comparable(t: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """A detached CPU strided copy of ``t`` to compare, and what was done to get it.

    A nested tensor (PyTorch's transformer fast path turns a padded batch with a
    ``src_key_padding_mask`` into one between ``nn.TransformerEncoder``'s layers; it has no
    ``shape``) becomes ``torch.nested.to_padded_tensor(t, 0.0)``: both sides pad the same
    sequence lengths with zeros, so the padding compares equal and the real elements are compared.
    A sparse or other non-strided tensor becomes ``to_dense()``.

    Returns:
        ``(tensor, None)`` for a plain tensor; ``(tensor, "padded")`` / ``(tensor, "dense")`` after
        a conversion; ``(None, reason)`` when it cannot be made comparable (the leaf is skipped).
    """
    t = t.detach()
    try:
        if getattr(t, "is_nested", False):
            return torch.nested.to_padded_tensor(t, 0.0).to("cpu", copy=True), "padded"
        if t.layout != torch.strided:
            return t.to_dense().to("cpu", copy=True), "dense"
        return t.to("cpu", copy=True), None
    except Exception as exc:  # noqa: BLE001 - an exotic tensor must not stop the localization
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")


def output_leaves(output: Any, prefix: str = "", notes: dict[str, set[str]] | None = None,
                  where: str = "") -> dict[str, torch.Tensor]:
    """``{path: detached CPU copy}`` of every tensor in a module's output.

    Tuples, lists and mappings (also Hugging Face ``ModelOutput``) are walked (``[i]`` and ``.key``
    paths, as ``compare.flatten`` names them), a Hugging Face key/value cache as its
    ``compare.cache_fields`` (``past_key_values.layers[0].keys``); anything else (None, numbers,
    strings) is skipped.
    Nested and sparse tensors are converted by ``comparable`` (padded with zeros, densified); a
    tensor that cannot be converted is left out. With ``notes``, ``where`` (the module path) is
    added to ``notes["padded"]``/``notes["dense"]`` for a conversion and to
    ``notes["skipped: <reason>"]`` for a leaf left out.
    """
    leaves: dict[str, torch.Tensor] = {}
    if isinstance(output, torch.Tensor):
        tensor, how = comparable(output)
        if how is not None and notes is not None:
            notes.setdefault(how if tensor is not None else f"skipped: {how}", set()).add(where or "<output>")
        if tensor is not None:
            leaves[prefix] = tensor
    elif isinstance(output, (tuple, list)):
        for i, value in enumerate(output):
            leaves.update(output_leaves(value, f"{prefix}[{i}]", notes, where))
    elif isinstance(output, Mapping):
        for key, value in output.items():
            leaves.update(output_leaves(value, f"{prefix}.{key}" if prefix else str(key), notes, where))
    else:
        try:
            fields = cache_fields(output)  # a key/value cache: its layers' keys and values
        except TypeError:  # a cache of an unknown layout: not compared
            fields = None
        if fields is not None:
            leaves.update(output_leaves(fields, prefix, notes, where))
    return leaves


def _rng_state() -> tuple:
    """The shared random stream's state inside ``rng.same_randomness`` (its CPU generator, found as
    the owner of the installed ``torch.rand``), plus Python's, NumPy's and torch's global states."""
    generator = getattr(getattr(torch.rand, "__self__", None), "gen", None)
    return (generator.get_state() if isinstance(generator, torch.Generator) else None,
            random.getstate(), np.random.get_state(), torch.random.get_rng_state())


def _set_rng_state(state: tuple) -> None:
    shared, py_state, np_state, torch_state = state
    generator = getattr(getattr(torch.rand, "__self__", None), "gen", None)
    if shared is not None and isinstance(generator, torch.Generator):
        generator.set_state(shared)
    random.setstate(py_state)
    np.random.set_state(np_state)
    torch.random.set_rng_state(torch_state)


def _mode_state(device_type: str) -> tuple[bool, bool, torch.dtype]:
    """(grad enabled, autocast enabled on ``device_type``, its autocast dtype) right now (the
    device-type forms of these autocast queries exist since torch 2.4)."""
    return (torch.is_grad_enabled(), torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))


class _Recorder:
    """Forward hooks on every submodule of ``root`` for one pass; records the calls made inside
    ``scope`` (a call key ``(name, k)``, or None: calls made outside any hooked module) down to
    ``depth`` levels (1: directly inside it), in completion order."""

    def __init__(self, root: torch.nn.Module, scope: tuple[str, int] | None, device_type: str,
                 depth: int = RECORD_DEPTH, notes: dict[str, set[str]] | None = None):
        self.notes: dict[str, set[str]] = notes if notes is not None else {}  # see output_leaves
        self.names: dict[torch.nn.Module, str] = {}
        for name, module in root.named_modules():
            self.names.setdefault(module, name)
        self.scope = scope
        self.depth = depth
        self.device_type = device_type
        self.stack: list[tuple[_Call, int]] = []
        self.counts: Counter = Counter()
        self.calls: list[_Call] = []
        self.last_done: dict[str, int] = {}
        self.done = 0
        self._handles: list[Any] = []
        self._copied: dict[int, tuple[Any, int, Any]] = {}  # id -> (tensor weakref, version, copy weakref)

    def __enter__(self) -> "_Recorder":
        for module in self.names:
            self._handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post, with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        name = self.names[module]
        call = _Call(name, self.counts[name], type(module).__name__)
        self.counts[name] += 1
        parent, parent_depth = (self.stack[-1][0].key, self.stack[-1][1]) if self.stack else (None, 0)
        depth = 1 if parent == self.scope else parent_depth + 1 if 0 < parent_depth < self.depth else 0
        if depth:
            call.inputs = _snapshot((args, kwargs), self._cpu)
            call.rng = _rng_state()
            call.state = _mode_state(self.device_type)
            call.parent, call.rec_depth = parent, depth
        self.stack.append((call, depth))

    def _cpu(self, t: torch.Tensor) -> torch.Tensor:
        """A detached CPU copy of input tensor ``t``, shared with the earlier recorded calls of this
        pass that were given the same tensor unchanged (same object, same version counter): the
        snapshots of a cache taken at each decoder layer share the copies of the layers already
        filled, so recording N layers holds the cache about once, not N/2 times. Recorded tensors
        are never changed (``_to_device`` copies them for a re-run)."""
        try:
            version = t._version
            ref = weakref.ref(t)
        except (RuntimeError, TypeError):  # an inference tensor has no version counter
            return _detached_cpu(t)
        hit = self._copied.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == version:
            copied = hit[2]()
            if copied is not None:
                return copied
        copied = _detached_cpu(t)
        self._copied[id(t)] = (ref, version, weakref.ref(copied))
        return copied

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call, depth = self.stack.pop()
        self.done += 1
        self.last_done[call.name] = self.done
        if depth:
            call.output = output_leaves(output, notes=self.notes, where=call.name)
            self.calls.append(call)

    def view(self, parent: tuple[str, int] | None) -> _View:
        """The recorded calls made directly inside the call ``parent`` (the scope: ``self.scope``)."""
        calls = [c for c in self.calls if c.parent == parent and c.rec_depth]
        return _View(calls, Counter(c.name for c in calls))

    def release(self, keep: _Call) -> None:
        """Drop the tensors of every recorded call except ``keep`` and the calls made inside it."""
        for c in self.calls:
            if c is not keep and c.parent != keep.key:
                c.inputs = c.output = None


# --------------------------------------------------------------------------------------------
# one side: the reference (CPU, unpatched) or the target (its device, patched)


class _Side:
    """How one side runs: its device, whether the patch set applies, and its (stable) root module."""

    def __init__(self, case: Any, call: Any, device: torch.device, patched: bool):
        self.case, self.call, self.device, self.patched = case, call, device, patched
        self.notes: dict[str, set[str]] = {}  # outputs converted or left out (output_leaves)
        self._root: torch.nn.Module | None = None
        if call.kind == "train_step":  # as ParityCase.train_step: a fresh copy, made before patching
            self._root = copy.deepcopy(call.module).to(device).train()

    def root(self) -> torch.nn.Module:
        """The module this side runs (placed after the patch set is entered, as ``ParityCase._run``);
        one object for the whole localization even where placement copies afresh (training mode)."""
        if self._root is None:
            self._root = self.case.session.place(self.call.module, self.device, self.case.recipe.weights_dtype)
        return self._root

    @contextlib.contextmanager
    def running(self, rng: tuple | None = None, state: tuple | None = None) -> Iterator[torch.nn.Module]:
        """Patch set (target), placement, recipe, shared randomness (restored to ``rng``), grad mode
        and autocast state ``state`` — the context of the check's own runs; yields the root module."""
        with contextlib.ExitStack() as stack:
            if self.patched and self.case.patches is not None:
                stack.enter_context(self.case.patches(self.device))
            root = self.root()
            stack.enter_context(self.case.recipe.context(self.device))
            stack.enter_context(same_randomness(self.call.seed))
            if rng is not None:
                _set_rng_state(rng)
            grad = self.call.grad if state is None else state[0]
            stack.enter_context(torch.set_grad_enabled(grad))
            if state is not None and (state[1], state[2]) != _mode_state(self.device.type)[1:]:
                stack.enter_context(torch.autocast(self.device.type, dtype=state[2], enabled=state[1]))
            yield root

    def entry(self) -> tuple[tuple[tuple, dict], tuple, tuple]:
        """``(inputs, random state, mode state)`` the check's own module call starts from on this
        side, in the form a ``_Recorder`` records a scope's call (for ``LocalizationCache.key``)."""
        dtype = self.case.recipe.weights_dtype
        with self.running():
            inputs = (_cpu_copy(_move(tuple(self.call.args), self.device, dtype)),
                      _cpu_copy(_move(dict(self.call.kwargs), self.device, dtype)))
            return inputs, _rng_state(), _mode_state(self.device.type)

    def run_root(self, root: torch.nn.Module) -> Any:
        """The check's own call on this side (inputs placed as ``runtime.side.run_side`` places them)."""
        dtype = self.case.recipe.weights_dtype
        args, kwargs = _move(self.call.args, self.device, dtype), _move(self.call.kwargs, self.device, dtype)
        if self.call.kind == "train_step":
            return root(*args, **kwargs)
        if isinstance(self.call.fn, torch.nn.Module):
            return root(*args, **kwargs)
        return getattr(root, self.call.fn.__name__)(*args, **kwargs)

    def record(self, scope: _Call | None, scope_key: tuple[str, int] | None) -> tuple[_Recorder, dict]:
        """One pass with hooks: the check's call (``scope`` None) or the ``scope`` call alone, run
        again from this side's recorded inputs. Returns the recorder and the pass's output leaves."""
        with self.running(scope.rng if scope else None, scope.state if scope else None) as root:
            with _Recorder(root, scope_key, self.device.type, notes=self.notes) as recorder:
                if scope is None:
                    output = self.run_root(root)
                else:
                    args, kwargs = _to_device(scope.inputs, self.device)
                    output = root.get_submodule(scope.name)(*args, **kwargs)
        return recorder, output_leaves(output, notes=self.notes, where=scope.name if scope else "")

    def run_call(self, name: str, inputs: tuple[tuple, dict], rng: tuple, state: tuple) -> dict[str, torch.Tensor]:
        """Submodule ``name`` of this side on ``inputs`` (moved here), in a call's context."""
        with self.running(rng, state) as root:
            args, kwargs = _to_device(inputs, self.device)
            return output_leaves(root.get_submodule(name)(*args, **kwargs), notes=self.notes, where=name)


# --------------------------------------------------------------------------------------------
# comparing


def _worst(result: CompareResult) -> LeafResult | None:
    def severity(leaf: LeafResult) -> float:
        if leaf.problem is not None or math.isnan(leaf.err_ratio):
            return math.inf
        return leaf.err_ratio
    return max(result.leaves, key=severity, default=None)


def _plain(obj: Any, depth: int = 0) -> Any:
    """A snapshot's copy (``_State.copy``) as nested dicts and lists of its attributes, for ``_same``
    (its type and devices left out: the snapshots of both sides are compared by their contents)."""
    if isinstance(obj, torch.device):
        return None
    if isinstance(obj, torch.Tensor) or depth >= 32:
        return obj
    if isinstance(obj, (tuple, list)):
        return [_plain(v, depth + 1) for v in obj]
    if isinstance(obj, Mapping):
        return {k: _plain(v, depth + 1) for k, v in obj.items()}
    if is_state(obj) and hasattr(obj, "__dict__"):
        return {"": type(obj), **{k: _plain(v, depth + 1) for k, v in vars(obj).items()}}
    return obj


def _same(a: Any, b: Any) -> bool:
    """Bitwise-equal nested inputs (tensors by ``torch.equal``, snapshots of stateful arguments by
    their attributes, other objects by ``==``)."""
    if isinstance(a, _State) or isinstance(b, _State):
        return isinstance(a, _State) and isinstance(b, _State) and _same(_plain(a.copy), _plain(b.copy))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype:
            return False
        if getattr(a, "is_nested", False) or getattr(b, "is_nested", False):  # no .shape: compare components
            if not (getattr(a, "is_nested", False) and getattr(b, "is_nested", False)):
                return False
            try:
                parts_a, parts_b = a.unbind(), b.unbind()
            except Exception:  # noqa: BLE001 - cannot tell: treat as different (a local re-run follows)
                return False
            return len(parts_a) == len(parts_b) and all(_same(x, y) for x, y in zip(parts_a, parts_b))
        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==: treat as different
        return False


class _Level:
    """The calls of one scope on both sides, compared, with local re-runs where needed."""

    def __init__(self, depth: int, order_prefix: tuple, ref_rec: _View, tgt_rec: _View, base: str = ""):
        self.depth = depth
        self.order_prefix = order_prefix
        self.base = base  # display path of the scope ("" for the check's own module without a prefix)
        self.ref_rec, self.tgt_rec = ref_rec, tgt_rec
        tgt_by_key = {c.key: c for c in tgt_rec.calls}
        ref_keys = {c.key for c in ref_rec.calls}
        self.pairs: list[tuple[_Call, _Call | None]] = [(r, tgt_by_key.get(r.key)) for r in ref_rec.calls]
        self.only_target = [c for c in tgt_rec.calls if c.key not in ref_keys]
        self.sites: list[Site] = []
        self.culprit: int | None = None

    def path(self, prefix: str, call: _Call) -> str:
        """Display path of ``call``: ``prefix.name`` (``<Type>`` for the root), ``#k`` when repeated."""
        path = ".".join(p for p in (prefix, call.name) if p) or f"<{call.module_type}>"
        return f"{path}#{call.index}" if self.ref_rec.counts[call.name] > 1 else path


@dataclass
class _LevelView:
    """A level taken from an earlier localization (``_Answer.rebuild``): its sites and culprit."""

    depth: int
    order_prefix: tuple
    base: str
    sites: list[Site]
    culprit: int | None


def _join(base: str, rel: str) -> str:
    return f"{base}.{rel}" if base and rel else base or rel


def _relative(path: str, base: str) -> str | None:
    """``path`` below ``base`` (``"a.b.c"`` below ``"a"`` is ``"b.c"``), or None if it is not below."""
    if not base:
        return path
    return path[len(base) + 1:] if path.startswith(base + ".") else None


@dataclass
class _Answer:
    """The levels a descent found below one scope, relative to it (paths, depths, orders).

    ``levels``: per level ``(depth, order_prefix, base, sites, culprit)`` relative to the scope;
    ``origin``: ``"'<check>' (<test id>)"`` of the localization that computed them; ``stopped``:
    that descent stopped at the budget (its deepest level is where it stopped).
    """

    origin: str
    levels: list[tuple[int, tuple, str, list[Site], int | None]]
    stopped: str | None = None

    @classmethod
    def of(cls, origin: str, levels: list[Any], stopped: str | None = None) -> "_Answer | None":
        """The answer of ``levels[0]``'s scope: ``levels`` from that scope down (None when a path
        does not lie below the scope's, which sharing cannot rebase)."""
        top = levels[0]
        cut, base = len(top.order_prefix), top.base
        out = []
        for lv in levels:
            rel_base = _relative(lv.base, base) if lv is not top else ""
            if rel_base is None:
                return None
            sites = []
            for site in lv.sites:
                rel = _relative(site.path, base)
                if rel is None:
                    return None
                sites.append(Site(rel, site.module_type, site.depth - top.depth, site.order[cut:], site.total,
                                  site.local, site.inherited, site.verdict))
            out.append((lv.depth - top.depth, lv.order_prefix[cut:], rel_base, sites, lv.culprit))
        return cls(origin, out, stopped)

    def rebuild(self, depth: int, order_prefix: tuple, base: str) -> list[_LevelView]:
        """The levels placed below a scope at ``depth`` with ``order_prefix`` and display path ``base``."""
        views = []
        for rel_depth, rel_prefix, rel_base, sites, culprit in self.levels:
            views.append(_LevelView(depth + rel_depth, order_prefix + rel_prefix, _join(base, rel_base), [
                Site(_join(base, site.path), site.module_type, depth + site.depth, order_prefix + site.order,
                     site.total, site.local, site.inherited, site.verdict) for site in sites], culprit))
        return views


def _patch_key(patches: Any) -> Any:
    """What identifies a patch factory across checks: a function's code, closure values and
    defaults (the suite's ``lambda device: patches.patched(device)`` is a new object per test, the
    same code every time), else the object itself."""
    code = getattr(patches, "__code__", None)
    if patches is None or code is None:
        return patches
    try:
        key = (code, tuple(c.cell_contents for c in patches.__closure__ or ()), patches.__defaults__)
        hash(key)
    except (TypeError, ValueError):  # an unhashable closure value, an empty cell
        return patches
    return key


class LocalizationCache:
    """What localizations of one session share: the levels found below every scope a descent entered.

    Keyed by the scope's module object (kept alive by the key, so its ``id`` is never reused), the
    fingerprint of its weights (``provenance.fingerprint_module``: an edited weight is a new key),
    the fingerprints of the reference's inputs to it and of the random stream's state when it was
    called, the grad/autocast mode it ran under, the recipe, the target, the patch set
    (``_patch_key``), the tolerance and the table's limits. The *first divergence* below a scope is
    decided by local comparisons (the target's module on the reference's inputs), so it depends on
    these alone; the total and inherited columns of a shared row are those of the check that
    computed it. Modules with a submodule in training mode, train steps, bound methods' own
    scopes and scopes entered with a stateful argument (a key/value cache: ``_State``, which has no
    fingerprint) are not shared.
    """

    def __init__(self) -> None:
        self._answers: dict[tuple, _Answer] = {}

    def __len__(self) -> int:
        return len(self._answers)

    def key(self, case: Any, call: Any, name: str, inputs: Any, rng: tuple, state: tuple, tol: Tolerance,
            limits: tuple) -> tuple | None:
        """The key of the scope ``name`` (a module path in ``call.module``; ``""`` for the module
        itself) entered with reference ``inputs`` (``(args, kwargs)``), random state ``rng`` and mode
        ``state``; None where it cannot be shared."""
        from .provenance import fingerprint_module, fingerprint_tensors

        if call.kind != "check":
            return None
        try:
            module = call.module.get_submodule(name) if name else call.module
            if any(m.training for m in module.modules()):
                return None
            return (module, fingerprint_module(module), fingerprint_tensors(inputs), fingerprint_tensors(rng),
                    tuple(state), case.recipe.name, str(case.target), _patch_key(case.patches),
                    (tol.rtol, tol.atol, tol.budget), limits)
        except Exception:  # noqa: BLE001 - no such submodule, an input that cannot be hashed (a nested tensor)
            return None

    def get(self, key: tuple | None) -> _Answer | None:
        """The levels stored for ``key`` (``key()``'s tuple), or None (also for a None key)."""
        return None if key is None else self._answers.get(key)

    def put(self, key: tuple, answer: _Answer | None) -> None:
        """Keep ``answer`` for ``key``; the first answer stored for a key stays (None is ignored)."""
        if answer is not None:
            self._answers.setdefault(key, answer)


def _scope_key(call: Any) -> tuple[str, int] | None:
    """The first scope: the module's own call (a module check, a train step's forward), or None for
    a bound method such as ``generate`` (the calls it makes outside any hooked module)."""
    return None if call.kind == "check" and not isinstance(call.fn, torch.nn.Module) else ("", 0)


def localize(case: Any, record: Any, call: Any, result: CompareResult, *,
             context_rows: int = CONTEXT_ROWS, max_local_runs: int = MAX_LOCAL_RUNS,
             cache: LocalizationCache | None = None, deadline: float | None = None,
             cached_only: bool = False) -> Localization | None:
    """Find the first submodule call whose own computation differs between the sides.

    Args:
        case: the ``runner.ParityCase`` of the failing check (patch set, recipe, session).
        record: its ``runner.CheckRecord`` (name, tolerance, reference kind, ``submodule`` prefix).
        call: its ``runner.CheckCall``.
        result: the failing ``CompareResult`` (a train step's gradient leaves are ordered from it).
        context_rows: calls shown after the first divergence (and gradients after the first failing).
        max_local_runs: local re-runs per level, at most.
        cache: levels shared with other localizations of the session (``LocalizationCache``): a
            scope found there is answered without running; every scope entered is stored.
        deadline: ``time.perf_counter()`` value after which no further level is started (the
            descent stops, ``Localization.stopped`` is ``"budget"``); None: no limit.
        cached_only: answer only from ``cache`` (return None when the check's own scope is not there).

    Returns:
        A ``Localization``, or None for a check of a free function (no module to hook), or with
        ``cached_only`` when the cache does not answer.

    Raises:
        Whatever the computation raises when run again (the failure hook reports it).
    """
    if call.module is None:
        return None
    tol: Tolerance = record.tolerance
    reference = "a live CPU run"
    if record.reference == "baseline":
        reference += (f" (the check's reference was baseline {record.reference_provenance}; baselines store no "
                      "per-submodule outputs)")
    loc = Localization(check=record.check, reference=reference)
    ref = _Side(case, call, torch.device("cpu"), patched=False)
    tgt = _Side(case, call, case.target, patched=True)
    prefix = record.submodule or ""
    limits = (context_rows, max_local_runs)

    scope_pair: tuple[_Call, _Call] | None = None
    scope_key = _scope_key(call)
    scope_name: str | None = "" if scope_key is not None else None  # None: a bound method's own calls
    order_prefix: tuple = ()
    levels: list[Any] = []
    shared: list[tuple[int, tuple]] = []  # (level index, cache key) of the scopes that can be shared
    first_pass: _Recorder | None = None
    views: tuple[_View, _View] | None = None  # the next level's calls, when the last pass recorded them
    ended: _Call | str | None = None  # where the descent ended at a module's own code: its call, or "root"
    while len(levels) < MAX_LEVELS:
        base = _join(prefix, scope_name or "")
        key = None
        if cache is not None and scope_name is not None:
            if scope_pair is None:
                inputs, rng, state = ref.entry()
            else:
                inputs, rng, state = scope_pair[0].inputs, scope_pair[0].rng, scope_pair[0].state
            key = cache.key(case, call, scope_name, inputs, rng, state, tol, limits)
            answer = cache.get(key)
            if answer is not None:
                levels += answer.rebuild(len(levels), order_prefix, base)
                loc.reused_from = answer.origin
                loc.stopped = loc.stopped or answer.stopped
                loc.notes.append(f"the levels from {base or '<' + type(call.module).__name__ + '>'} down are those "
                                 f"of the localization of check {answer.origin}: the same module and weights, "
                                 "reference inputs, random state, recipe and patch set, so nothing was re-run "
                                 "for them (their total and inherited columns are that check's)")
                break
        if cached_only:
            return None
        if views is None and levels and deadline is not None and time.perf_counter() >= deadline:
            loc.stopped = "budget"
            loc.notes.append(f"the descent stopped at {levels[-1].sites[levels[-1].culprit].path}: the session's "
                             "localization budget is spent (localize with the budget lifted to go deeper)")
            break
        if key is not None:
            shared.append((len(levels), key))
        if views is None:  # a pass of the scope on each side (the first, or below what a pass recorded)
            tgt_rec, tgt_out = tgt.record(scope_pair[1] if scope_pair else None, scope_key)
            ref_rec, ref_out = ref.record(scope_pair[0] if scope_pair else None, scope_key)
            loc.passes += 1
            if scope_pair is not None:
                for side, out, rec in (("reference", ref_out, scope_pair[0]), ("target", tgt_out, scope_pair[1])):
                    if not _same(out, rec.output):
                        loc.notes.append(f"running {rec.name} again on the {side} side from its recorded inputs did "
                                         "not reproduce its output bitwise; the rows below it may be inexact")
            if first_pass is None:
                first_pass = ref_rec
                loc.calls_hooked = ref_rec.done
            views = (ref_rec.view(scope_key), tgt_rec.view(scope_key))
        level = _Level(len(levels), order_prefix, views[0], views[1], base)
        views = None
        levels.append(level)
        loc.levels += 1
        loc.local_runs += _judge_level(level, ref, tgt, tol, prefix, context_rows, max_local_runs, loc)
        if level.culprit is None:
            ended = scope_pair[0] if scope_pair is not None else ("root" if scope_key is not None else None)
            break
        ref_call, tgt_call = level.pairs[level.culprit]
        module = ref.root().get_submodule(ref_call.name)
        if not any(True for _ in module.children()):
            ended = ref_call
            break  # a module without submodules: the divergence is in its own computation
        scope_pair = (ref_call, tgt_call)
        scope_key = (ref_call.name, 0)  # in a pass of the scope alone, its call is the first
        scope_name = ref_call.name
        order_prefix = order_prefix + (level.sites[level.culprit].order[-1] - 0.5,)
        if ref_call.rec_depth < ref_rec.depth and tgt_call.rec_depth < tgt_rec.depth:
            views = (ref_rec.view(ref_call.key), tgt_rec.view(tgt_call.key))  # recorded by this pass
        # Keep only what the next level needs; the rest of this pass's tensors can go.
        ref_rec.release(ref_call)
        tgt_rec.release(tgt_call)
    root_name = prefix or f"<{type(call.module).__name__}>"
    if _scope_key(call) is None:
        root_name = f"{root_name}.{getattr(call.fn, '__name__', 'fn')}()"
    if cache is not None:  # also a descent stopped at the budget: later checks get as far for free
        origin = f"{record.check!r} ({record.test_id})"
        for index, key in shared:
            cache.put(key, _Answer.of(origin, levels[index:], loc.stopped))
    _conclude(loc, levels, root_name, context_rows)
    if ended is not None and loc.stopped is None and (loc.first is not None or call.kind == "check"):
        _trace_culprit(loc, case, ref, tgt, ended, prefix, deadline)
    if call.kind == "train_step" and first_pass is not None:
        _gradients(loc, result, first_pass.last_done, context_rows)
    if call.kind == "train_step":
        _state(loc, result, call.module)
    _conversion_notes(loc, ref.notes, tgt.notes, prefix=prefix)
    return loc


def _trace_culprit(loc: Localization, case: Any, ref: _Side, tgt: _Side, ended: _Call | str, prefix: str,
                   deadline: float | None) -> None:
    """The op trace (``op_trace.trace_ops``) of the module where the descent ended: ``ended`` is its
    reference call (a leaf module, or the scope whose own code diverges) or ``"root"`` (the check's
    module itself). It runs on the target from the *reference's* inputs of that call (moved to the
    target), in the call's context (patch set, recipe, random stream restored, grad/autocast mode), as
    the local re-run did; it is kept in ``loc.op_trace``, or a note says why not."""
    from .op_trace import trace_ops

    if ended == "root":
        inputs, rng, state = ref.entry()
        name, path = "", loc.own_code or prefix
    else:
        inputs, rng, state = ended.inputs, ended.rng, ended.state
        name = ended.name
        path = _join(prefix, name)
    if inputs is None:
        return
    if deadline is not None and time.perf_counter() >= deadline:
        loc.notes.append(f"no op trace of {path}: the session's localization budget is spent")
        return
    try:
        with tgt.running(rng, state) as root:
            args, kwargs = _to_device(inputs, tgt.device)
            module = root.get_submodule(name) if name else root
            loc.op_trace = trace_ops(module, args, kwargs, device=tgt.device, recipe=case.recipe,
                                     path=path if name or prefix else "", enter_recipe=False, deadline=deadline)
    except Exception as exc:  # noqa: BLE001 - the module-level localization stands without it
        loc.notes.append(f"no op trace of {path}: its traced forward raised ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})")


def _conversion_notes(loc: Localization, *notes: dict[str, set[str]], prefix: str = "") -> None:
    """Say which submodule outputs were compared after a conversion or left out (``output_leaves``)."""
    merged: dict[str, set[str]] = {}
    for side in notes:
        for how, where in side.items():
            merged.setdefault(how, set()).update(where)
    texts = {"padded": "nested-tensor outputs (PyTorch's transformer fast path with a padding mask) compared as "
                       "padded tensors (torch.nested.to_padded_tensor, padding 0)",
             "dense": "sparse outputs compared as dense tensors"}
    for how in sorted(merged):
        names = sorted(_join(prefix, w) if w != "<output>" else w for w in merged[how])
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        text = texts.get(how) or f"outputs not compared ({how.removeprefix('skipped: ')})"
        loc.notes.append(f"{text}: {shown}")


def _owner(root: torch.nn.Module | None, name: str) -> tuple[str, str]:
    """(module path, type name) of the module owning state ``name`` (``"layer1.0.bn1.running_mean"``)."""
    path = name.rpartition(".")[0]
    try:
        module = root.get_submodule(path) if root is not None else None
    except AttributeError:
        module = None
    return path or f"<{type(root).__name__}>", type(module).__name__ if module is not None else "?"


def _state(loc: Localization, result: CompareResult, root: torch.nn.Module | None) -> None:
    """A train step's buffers and parameters after the step: name the module owning each failing
    ``buffer.<name>`` leaf (the BatchNorm whose running statistics differ, not the wrapper around it)
    and, when every gradient agrees, the first failing ``param.<name>`` leaf (the optimizer step).
    At most ``1 + CONTEXT_ROWS`` buffer rows are kept when a submodule call diverges (later buffers
    then only follow it); a note counts the rest."""
    loc.loss_agrees = all(leaf.passed for leaf in result.leaves if leaf.path == "loss")
    failing = [leaf for leaf in result.leaves if leaf.path.startswith("buffer.") and not leaf.passed]
    keep = len(failing) if loc.first is None else 1 + CONTEXT_ROWS
    if len(failing) > keep:
        loc.notes.append(f"{len(failing)} buffers are out of tolerance; the table shows the first {keep}")
    for leaf in failing[:keep]:
        name = leaf.path[len("buffer."):]
        owner, kind = _owner(root, name)
        first = loc.first_buffer is None
        if first:
            loc.first_buffer, loc.buffer_owner = leaf.path, f"{owner} ({kind})"
        loc.buffers.append({"kind": "buffer", "leaf": leaf.path, "submodule": owner, "module_type": kind,
                            "max_abs": _num(leaf.max_abs), "rel_l2": _num(leaf.rel_l2), "cosine": _num(leaf.cosine),
                            "err_ratio": _num(leaf.err_ratio), "verdict": "fail", "first_divergence": first})
    grads_pass = all(leaf.passed for leaf in result.leaves if leaf.path.startswith("grad."))
    if grads_pass:
        loc.first_param = next((leaf.path for leaf in result.leaves
                                if leaf.path.startswith("param.") and not leaf.passed), None)


def _judge_level(level: _Level, ref: _Side, tgt: _Side, tol: Tolerance, prefix: str, context_rows: int,
                 max_local_runs: int, loc: Localization) -> int:
    """Compare every call of ``level``; re-run failing calls locally until the first local failure
    and ``context_rows`` failing calls after it. Returns the number of local re-runs made."""
    runs = 0
    after = 0
    missing = []
    for i, (r, t) in enumerate(level.pairs):
        order = level.order_prefix + (i,)
        path = level.path(prefix, r)
        if t is None:
            level.sites.append(Site(path, r.module_type, level.depth, order, None, verdict="missing"))
            missing.append(path)
            continue
        total_result = compare(t.output, r.output, tol)
        site = Site(path, r.module_type, level.depth, order, _worst(total_result))
        level.sites.append(site)
        if total_result.passed:
            continue
        site.verdict = "fail"
        if level.culprit is not None and after >= context_rows:
            continue
        if _same(r.inputs, t.inputs):
            local_out = t.output  # same inputs: the target's own output is its local output
        elif runs < max_local_runs:
            runs += 1
            try:
                local_out = tgt.run_call(r.name, r.inputs, r.rng, t.state)
            except Exception as exc:  # noqa: BLE001 - a call that cannot run alone: its row shows the total only
                loc.notes.append(f"{path} could not be re-run alone on the reference's inputs "
                                 f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                                 "its row shows the total error only")
                continue
        else:
            loc.notes.append(f"stopped re-running calls locally after {max_local_runs} in one level")
            continue
        local = compare(local_out, r.output, tol)
        site.local = _worst(local)
        site.inherited = _worst(compare(t.output, local_out, tol))
        site.verdict = "inherited" if local.passed else "local"
        if level.culprit is None and not local.passed:
            level.culprit = i
        elif level.culprit is not None:
            after += 1
    for side, paths in (("reference", missing), ("target", [level.path(prefix, c) for c in level.only_target])):
        if paths:
            more = f" and {len(paths) - 3} more" if len(paths) > 3 else ""
            loc.notes.append(f"called on the {side} side only: {', '.join(paths[:3])}{more}")
    return runs


def _conclude(loc: Localization, levels: list[_Level], root_name: str, context_rows: int) -> None:
    """Name the first divergence and pick the rows of the short table (``root_name``: the check's
    module or method, named where the divergence starts in its own code)."""
    last = levels[-1]
    culprits = [lv.sites[lv.culprit] for lv in levels if lv.culprit is not None]
    if last.culprit is not None:
        loc.first = last.sites[last.culprit]
        loc.first.first = True
        loc.own_code = None
    elif culprits:  # the deepest scope diverges, none of its children does: its own code
        loc.first = culprits[-1]
        loc.first.first = True
        loc.own_code = loc.first.path
    else:
        loc.first = None
        loc.own_code = root_name

    shown: dict[int, Site] = {}
    for lv in levels:
        sites = lv.sites
        if not sites:
            continue
        final = lv is last
        if lv.culprit is not None:
            center = lv.culprit
        else:
            failing = [i for i, s in enumerate(sites) if s.failed]
            center = failing[0] if failing else None
        if center is None:
            continue
        start = max(0, center - 1)
        stop = center + 1 + (context_rows if final else 1)
        for site in sites[start:stop]:
            shown[id(site)] = site
    everything = [s for lv in levels for s in lv.sites if s.total is not None]
    if everything:
        worst = max(everything, key=lambda s: s.total.err_ratio if not math.isnan(s.total.err_ratio) else math.inf)
        if worst.failed:
            shown[id(worst)] = worst
    loc.sites = sorted(shown.values(), key=lambda s: s.order)


def _gradients(loc: Localization, result: CompareResult, last_done: dict[str, int], context_rows: int) -> None:
    """Order a train step's ``grad.<param>`` leaves by backward order and name the first failing one."""
    grads = [leaf for leaf in result.leaves if leaf.path.startswith("grad.")]
    if not grads:
        return

    def done(leaf: LeafResult) -> int:
        owner = leaf.path[len("grad."):].rpartition(".")[0]
        return last_done.get(owner, -1)

    ordered = sorted(grads, key=lambda leaf: (-done(leaf), leaf.path))
    failing = [i for i, leaf in enumerate(ordered) if not leaf.passed]
    if not failing:
        return
    first = failing[0]
    loc.first_gradient = ordered[first].path
    picked = list(range(max(0, first - 1), min(len(ordered), first + 1 + context_rows)))
    worst = max(failing, key=lambda i: ordered[i].err_ratio if not math.isnan(ordered[i].err_ratio) else math.inf)
    if worst not in picked:
        picked.append(worst)
    for i in picked:
        leaf = ordered[i]
        loc.gradients.append({"kind": "gradient", "leaf": leaf.path, "backward_rank": i,
                              "max_abs": _num(leaf.max_abs), "rel_l2": _num(leaf.rel_l2),
                              "cosine": _num(leaf.cosine), "err_ratio": _num(leaf.err_ratio),
                              "verdict": "pass" if leaf.passed else "fail", "first_divergence": i == first})


def failure_hook(case: Any, record: Any, call: Any, result: CompareResult) -> str | None:
    """``ParitySession`` failure hook without budget or sharing: localize, keep the table in
    ``record.localized.localization`` and return the text for the failure message (None for a check
    of a free function). The plugin uses a ``Localizer`` instead."""
    loc = localize(case, record, call, result)
    if loc is None:
        return None
    record.localized.localization = loc.to_rows()
    record.localized.localization_ops = loc.op_rows()
    return loc.format()


def structural_problem(result: CompareResult) -> str | None:
    """``"<leaf>: <problem>"`` of the first leaf whose outputs differ in structure, shape or dtype
    (``LeafResult.problem``), or None when every leaf was compared by value."""
    for leaf in result.leaves:
        if leaf.problem is not None:
            return f"{leaf.path or '<output>'}: {leaf.problem}"
    return None


class Localizer:
    """The ``ParitySession`` failure hook of a session: localization within a time budget, shared
    across the failing checks (module doc).

    Args:
        budget_s: wall seconds the session may spend localizing (``DEFAULT_BUDGET_S``); None: no
            limit. Localizations answered from the cache cost nothing and run even when it is spent.
        forced: localize every failing check whatever the budget (``--parity-localize``).
        hint: the command that localizes one check despite the budget, with ``{test_id}`` for its
            shell-quoted test id (the plugin gives ``pytest --npu-parity --parity-localize {test_id}``).

    Attributes:
        spent_s: wall seconds spent localizing so far; ``cache``: the ``LocalizationCache``;
        localized / reused / skipped: checks localized by running, answered from the cache, and not
            localized (a ``Counter`` by reason: ``budget``, ``structure``).

    Per failing check it sets ``record.localized`` (``checks.record.LocalizationOutcome``):
    ``localization`` (the table, as ``failure_hook``), ``localization_s`` (seconds this check
    spent), ``localization_reused`` (the check whose localization answered it),
    ``localization_skipped`` (``budget`` or ``structure``) and ``localization_stopped`` (``budget``: the descent stopped between levels).

    Raises:
        ValueError: ``budget_s`` negative or not finite.
    """

    def __init__(self, budget_s: float | None = DEFAULT_BUDGET_S, *, forced: bool = False, hint: str | None = None):
        if budget_s is not None and not (math.isfinite(budget_s) and budget_s >= 0):
            raise ValueError(f"localization budget {budget_s!r}: give a number of seconds >= 0")
        self.budget_s = budget_s
        self.forced = forced
        self.hint = hint
        self.spent_s = 0.0
        self.cache = LocalizationCache()
        self.localized = 0
        self.reused = 0
        self.skipped: Counter = Counter()

    @property
    def over_budget(self) -> bool:
        """True once the budget is spent (never when ``forced`` or without a budget)."""
        return not self.forced and self.budget_s is not None and self.spent_s >= self.budget_s

    def fits(self, record: Any) -> bool:
        """Whether a localization of ``record``'s check may start: its expected cost
        (``COST_FACTOR`` × the check's own duration) fits in what is left of the budget."""
        if self.forced or self.budget_s is None:
            return True
        return self.spent_s + COST_FACTOR * float(getattr(record, "duration_s", 0.0) or 0.0) <= self.budget_s

    def __call__(self, case: Any, record: Any, call: Any, result: CompareResult) -> str | None:
        if call.module is None:
            return None
        problem = structural_problem(result)
        if problem is not None:
            record.localized.localization_skipped = "structure"
            self.skipped["structure"] += 1
            return (f"(First-divergence localization not run: the outputs differ in structure, shape or dtype "
                    f"({problem}); that difference is the finding, no submodule run would add to it.)")
        over = not self.fits(record)
        start = time.perf_counter()
        deadline = None if self.forced or self.budget_s is None else start + self.budget_s - self.spent_s
        try:
            loc = localize(case, record, call, result, cache=self.cache, deadline=deadline, cached_only=over)
        finally:
            elapsed = time.perf_counter() - start
            self.spent_s += elapsed
            record.localized.localization_s = elapsed
        if loc is None:
            if not over:
                return None
            record.localized.localization_skipped = "budget"
            self.skipped["budget"] += 1
            command = (self.hint.format(test_id=shlex.quote(record.test_id)) if self.hint
                       else "a Localizer with forced=True")
            left = max(0.0, self.budget_s - self.spent_s)
            return (f"(First-divergence localization skipped: it would take about "
                    f"{COST_FACTOR * record.duration_s:.2g} s, more than the {left:.2g} s left of this session's "
                    f"localization budget of {self.budget_s:g} s ({self.spent_s:.2g} s went to earlier failures). "
                    f"To localize this check: {command})")
        record.localized.localization = loc.to_rows()
        record.localized.localization_ops = loc.op_rows()
        if loc.reused_from is not None:
            record.localized.localization_reused = loc.reused_from
        if loc.levels:
            self.localized += 1
        else:
            self.reused += 1
        if loc.stopped is not None:
            record.localized.localization_stopped = loc.stopped
        return loc.format()

"""The descent: the levels (``_Level``), ``localize`` (first divergence from the check's module down)
and the failure hook's helpers.

Part of ``pytest_npu_parity.diagnose.localize`` (the package docstring describes the descent).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any

import torch

from ...judge.allclose import CompareResult, LeafResult, compare
from ...judge.tolerance import Tolerance
from .cache import LocalizationCache, _Answer, _join
from .record import Localization, Site, _num
from .sides import _Call, _Recorder, _Side, _View, _same, _to_device, _worst

#: Deepest scope the descent enters (a safety bound; Aurora's deepest module path has 8 parts).
MAX_LEVELS = 16
#: Local re-runs per level, at most (each is one submodule run on the target).
MAX_LOCAL_RUNS = 64
#: Calls shown after the first divergence in its level, and gradients after the first failing one.
CONTEXT_ROWS = 2
#: A scope out of tolerance none of whose calls is out of tolerance alone: its difference may be the
#: sum of its calls' own differences, each within the check's tolerance (whose ``atol`` hides a
#: relative error on small activations: a decoder layer's output of magnitude 0.1 next to the
#: logits); the earliest call whose own (local) rel-L2 is at least this share of the scope's local
#: rel-L2 is followed before the scope's own code is named (``_follow_within_tolerance``).
ACCUMULATED_SHARE = 0.5


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
    loc = Localization(check=record.check, reference=_reference(record))
    ref = _Side(case, call, torch.device("cpu"), patched=False)
    tgt = _Side(case, call, case.target, patched=True)
    prefix = record.submodule or ""
    d = _Descent(case, call, tol, ref, tgt, prefix, context_rows, max_local_runs, cache, deadline, result)
    descent = _descend(d, loc, cached_only)
    if descent is None:
        return None
    levels, shared, first_pass, ended = descent
    root_name = prefix or f"<{type(call.module).__name__}>"
    if _scope_key(call) is None:
        root_name = f"{root_name}.{getattr(call.fn, '__name__', 'fn')}()"
    if cache is not None:  # also a descent stopped at the budget: later checks get as far for free
        origin = f"{record.check!r} ({record.test_id})"
        for index, key in shared:
            cache.put(key, _Answer.of(origin, levels[index:], loc.stopped))
    _conclude(loc, levels, root_name, context_rows)
    if record.reference == "baseline" and call.kind == "check" and loc.root_outputs is not None:
        _live_agrees(loc, case, record, result, tol)
    if ended is not None and loc.stopped is None and (loc.first is not None or call.kind == "check"):
        _trace_culprit(loc, case, ref, tgt, ended, prefix, deadline)
        if loc.op_stream is not None and record.reference == "baseline":
            loc.notes.append("the program difference compares the target's op stream with that of the live CPU run "
                             "this localization uses as its reference: a stored baseline holds no op stream")
    if call.kind == "train_step" and first_pass is not None:
        _gradients(loc, result, first_pass.last_done, context_rows)
    if call.kind == "train_step":
        _state(loc, result, call.module)
    if call.kind == "train_step" and not cached_only and _gradients_fail(result):
        from .backward import backward_table

        backward_table(loc, case, call, tol, prefix, deadline)
    _conversion_notes(loc, ref.notes, tgt.notes, prefix=prefix)
    return loc


#: How far (worst err/tol) the target must be from the baseline for ``_live_agrees`` to say the baseline
#: differs: with the target within tolerance of the live run (err/tol ≤ 1), the live run is then at least
#: about 2 from the baseline, out of tolerance too (|l − b| ≥ |t − b| − |t − l|, elementwise).
LIVE_AGREES_MIN_ERR = 3.0


def _live_agrees(loc: Localization, case: Any, record: Any, result: CompareResult, tol: Tolerance) -> None:
    """Against a baseline: when the target's output agrees with the live CPU run's (``tol``) on every leaf the
    check failed, and the target is at least ``LIVE_AGREES_MIN_ERR`` from the baseline there (so the live run
    is out of tolerance of it too), the difference is between this machine's computation and the recording,
    not in the target: set ``loc.live_agrees`` to the command that re-records the test (``""`` without a
    store). A failing leaf the live comparison does not hold (a number or string output: the localization
    compares tensors) makes no claim."""
    ref_out, tgt_out = loc.root_outputs
    try:
        live = compare(tgt_out, ref_out, tol)
    except Exception:  # noqa: BLE001 - outputs this cannot compare: no claim either way
        return
    failing = result.failures
    compared = {leaf.path for leaf in live.leaves}
    if not (live.leaves and live.passed and failing and all(leaf.path in compared for leaf in failing)):
        return
    if not all(leaf.err_ratio >= LIVE_AGREES_MIN_ERR for leaf in failing):
        return
    store = getattr(case.session, "store", None)
    loc.live_agrees = store.command(record.test_id) if store is not None else ""


def _reference(record: Any) -> str:
    """What the localization's reference side is: a live CPU run (also for a baseline check)."""
    reference = "a live CPU run"
    if record.reference == "baseline":
        reference += (f" (the check's reference was baseline {record.reference_provenance}; baselines store no "
                      "per-submodule outputs)")
    return reference


@dataclasses.dataclass
class _Descent:
    """What one descent works with: the failing check (``case``, ``call``, tolerance), its two sides,
    the check's submodule prefix, ``localize``'s limits and the check's failing comparison."""

    case: Any
    call: Any
    tol: Tolerance
    ref: _Side
    tgt: _Side
    prefix: str
    context_rows: int
    max_local_runs: int
    cache: LocalizationCache | None
    deadline: float | None
    result: CompareResult | None = None

    def root_rel_l2(self) -> float | None:
        """The rel-L2 of the check's worst leaf: the first scope's own difference, for
        ``_follow_within_tolerance`` (None for a train step, whose leaves include gradients and
        parameters after the step: not what its forward computes)."""
        worst = _worst(self.result) if self.result is not None and self.call.kind == "check" else None
        return None if worst is None else worst.rel_l2


def _descend(d: _Descent, loc: Localization, cached_only: bool) -> tuple[list, list, _Recorder | None, Any] | None:
    """The levels from the check's module down, each scope the earliest child with a local error of
    the level above, until a module without submodules, a scope none of whose children diverges
    locally, ``MAX_LEVELS``, the deadline or a scope the cache answers.

    Returns:
        ``(levels, shared, first pass, ended)``: ``shared`` the (level index, cache key) of the scopes
        that can be shared, the reference's recorder of the first pass (None when the cache answered
        at once), and where the descent ended at a module's own code (its reference call, ``"root"``,
        or None); None with ``cached_only`` when the cache does not answer.
    """
    ref, tgt, call = d.ref, d.tgt, d.call
    limits = (d.context_rows, d.max_local_runs)
    scope_pair: tuple[_Call, _Call] | None = None
    scope_key = _scope_key(call)
    scope_name: str | None = "" if scope_key is not None else None  # None: a bound method's own calls
    order_prefix: tuple = ()
    levels: list[Any] = []
    shared: list[tuple[int, tuple]] = []  # (level index, cache key) of the scopes that can be shared
    first_pass: _Recorder | None = None
    views: tuple[_View, _View] | None = None  # the next level's calls, when the last pass recorded them
    ended: _Call | str | None = None  # where the descent ended at a module's own code: its call, or "root"
    scope_rel_l2 = d.root_rel_l2()  # the scope's own (local) difference
    while len(levels) < MAX_LEVELS:
        base = _join(d.prefix, scope_name or "")
        key = None
        if d.cache is not None and scope_name is not None:
            key = d.cache.key(d.case, call, scope_name, *_scope_entry(ref, scope_pair), d.tol, limits)
            answer = d.cache.get(key)
            if answer is not None:
                levels += _reuse(loc, answer, len(levels), order_prefix, base, call)
                break
        if cached_only:
            return None
        if views is None and levels and d.deadline is not None and time.perf_counter() >= d.deadline:
            loc.stopped = "budget"
            loc.notes.append(f"the descent stopped at {levels[-1].sites[levels[-1].culprit].path}: the session's "
                             "localization budget is spent (localize with the budget lifted to go deeper)")
            break
        if key is not None:
            shared.append((len(levels), key))
        if views is None:  # a pass of the scope on each side (the first, or below what a pass recorded)
            ref_rec, tgt_rec = _pass(loc, ref, tgt, scope_pair, scope_key)
            if first_pass is None:
                first_pass = ref_rec
                loc.calls_hooked = ref_rec.done
            views = (ref_rec.view(scope_key), tgt_rec.view(scope_key))
        level = _Level(len(levels), order_prefix, views[0], views[1], base)
        views = None
        levels.append(level)
        loc.levels += 1
        loc.local_runs += _judge_level(level, ref, tgt, d.tol, d.prefix, d.context_rows, d.max_local_runs, loc)
        if level.culprit is None:
            loc.local_runs += _follow_within_tolerance(level, d, scope_rel_l2, loc)
        if level.culprit is None:
            ended = scope_pair[0] if scope_pair is not None else ("root" if scope_key is not None else None)
            break
        ref_call, tgt_call = level.pairs[level.culprit]
        module = ref.root().get_submodule(ref_call.name)
        if not any(True for _ in module.children()):
            ended = ref_call
            break  # a module without submodules: the divergence is in its own computation
        scope_pair = (ref_call, tgt_call)
        scope_rel_l2 = level.sites[level.culprit].local.rel_l2
        scope_key = (ref_call.name, 0)  # in a pass of the scope alone, its call is the first
        scope_name = ref_call.name
        order_prefix = order_prefix + (level.sites[level.culprit].order[-1] - 0.5,)
        if ref_call.rec_depth < ref_rec.depth and tgt_call.rec_depth < tgt_rec.depth:
            views = (ref_rec.view(ref_call.key), tgt_rec.view(tgt_call.key))  # recorded by this pass
        # Keep only what the next level needs; the rest of this pass's tensors can go.
        ref_rec.release(ref_call)
        tgt_rec.release(tgt_call)
    return levels, shared, first_pass, ended


def _scope_entry(ref: _Side, scope_pair: tuple[_Call, _Call] | None) -> tuple:
    """``(inputs, rng, state)`` the scope's call began with on the reference side (the check's own
    entry for the first scope)."""
    if scope_pair is None:
        return ref.entry()
    return scope_pair[0].inputs, scope_pair[0].rng, scope_pair[0].state


def _reuse(loc: Localization, answer: _Answer, depth: int, order_prefix: tuple, base: str, call: Any) -> list:
    """The levels an earlier localization found below this scope, rebuilt at ``depth``; ``loc`` says
    whose they are."""
    levels = answer.rebuild(depth, order_prefix, base)
    loc.reused_from = answer.origin
    loc.stopped = loc.stopped or answer.stopped
    loc.notes.append(f"the levels from {base or '<' + type(call.module).__name__ + '>'} down are those "
                     f"of the localization of check {answer.origin}: the same module and weights, "
                     "reference inputs, random state, recipe and patch set, so nothing was re-run "
                     "for them (their total and inherited columns are that check's)")
    return levels


def _pass(loc: Localization, ref: _Side, tgt: _Side, scope_pair: tuple[_Call, _Call] | None,
          scope_key: tuple[str, int] | None) -> tuple[_Recorder, _Recorder]:
    """One pass of the scope on each side (target first), recorded; a note when a scope's call run
    again from its recorded inputs does not reproduce its output bitwise."""
    tgt_rec, tgt_out = tgt.record(scope_pair[1] if scope_pair else None, scope_key)
    ref_rec, ref_out = ref.record(scope_pair[0] if scope_pair else None, scope_key)
    loc.passes += 1
    if scope_pair is None:  # the check's own call: the live reference's output and the target's
        loc.root_outputs = (ref_out, tgt_out)
    if scope_pair is not None:
        for side, out, rec in (("reference", ref_out, scope_pair[0]), ("target", tgt_out, scope_pair[1])):
            if not _same(out, rec.output):
                loc.notes.append(f"running {rec.name} again on the {side} side from its recorded inputs did "
                                 "not reproduce its output bitwise; the rows below it may be inexact")
    return ref_rec, tgt_rec


def _trace_culprit(loc: Localization, case: Any, ref: _Side, tgt: _Side, ended: _Call | str, prefix: str,
                   deadline: float | None) -> None:
    """The op trace (``op_trace.trace_ops``) of the module where the descent ended: ``ended`` is its
    reference call (a leaf module, or the scope whose own code diverges) or ``"root"`` (the check's
    module itself). It runs on the target from the *reference's* inputs of that call (moved to the
    target), in the call's context (patch set, recipe, random stream restored, grad/autocast mode), as
    the local re-run did; it is kept in ``loc.op_trace``, or a note says why not.

    The same traced call records the target's op stream (``op_stream.OpRecorder``, entered below the
    trace's mode: it sees the ops the target runs under its patch set, not the trace's float64
    goldens), and ``_program_difference`` compares it with the reference's (``loc.op_stream``)."""
    from ..op_stream import OpRecorder
    from ..op_trace import trace_ops

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
    shown = path if name or prefix else ""
    recorder: OpRecorder | None = None
    try:
        with tgt.running(rng, state) as root:
            args, kwargs = _to_device(inputs, tgt.device)
            module = root.get_submodule(name) if name else root
            with contextlib.ExitStack() as stack:
                try:
                    recorder = stack.enter_context(OpRecorder(module, shown))
                except Exception as exc:  # noqa: BLE001 - the trace runs without it
                    loc.notes.append(f"no program difference of {path}: the op recorder could not start "
                                     f"({_error(exc)})")
                loc.op_trace = trace_ops(module, args, kwargs, device=tgt.device, recipe=case.recipe,
                                         path=shown, enter_recipe=False, deadline=deadline)
    except Exception as exc:  # noqa: BLE001 - the module-level localization stands without it
        loc.notes.append(f"no op trace of {path}: its traced forward raised ({_error(exc)})")
        return
    if recorder is not None:
        _program_difference(loc, ref, recorder.stream, (inputs, rng, state), name, shown, path, deadline)


def _program_difference(loc: Localization, ref: _Side, target: Any, entry: tuple, name: str, shown: str,
                        path: str, deadline: float | None) -> None:
    """Record the reference's op stream of the same call (``ref``'s module ``name``, from the call's
    ``entry``: inputs, random state, mode state) and align it with the ``target`` stream
    (``op_stream.compare_streams``); the result goes to ``loc.op_stream``, or a note says why not.
    Nothing here can fail the localization: errors become notes."""
    from ..op_stream import compare_streams, record_ops

    if deadline is not None and time.perf_counter() >= deadline:
        loc.notes.append(f"no program difference of {path}: the session's localization budget is spent")
        return
    if target.failed is not None:
        loc.notes.append(f"no program difference of {path}: recording the target's op stream failed ({target.failed})")
        return
    inputs, rng, state = entry
    try:
        with ref.running(rng, state) as root:
            args, kwargs = _to_device(inputs, ref.device)
            module = root.get_submodule(name) if name else root
            reference = record_ops(module, args, kwargs, path=shown)
        if reference.failed is not None:
            loc.notes.append(f"no program difference of {path}: recording the reference's op stream failed "
                             f"({reference.failed})")
            return
        loc.op_stream = compare_streams(reference, target)
    except Exception as exc:  # noqa: BLE001 - the localization stands without it
        loc.notes.append(f"no program difference of {path}: recording the reference's op stream raised "
                         f"({_error(exc)})")
        return
    loc.notes += loc.op_stream.notes


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


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
        if not total_result.leaves:  # no tensor compared: not evidence that the call agrees
            site.verdict = "not compared"
            continue
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


def _follow_within_tolerance(level: _Level, d: _Descent, scope_rel_l2: float | None, loc: Localization) -> int:
    """A scope out of tolerance none of whose calls is out of tolerance alone: make the earliest call
    whose own (local) rel-L2 is at least ``ACCUMULATED_SHARE`` of the scope's (``scope_rel_l2``) the
    level's culprit, so the descent goes on into it instead of naming the scope's own code (which
    is named only where no call's own difference comes near the scope's). Calls within tolerance
    get their local comparison here (a re-run where their inputs differ). Returns the re-runs made."""
    if scope_rel_l2 is None or not math.isfinite(scope_rel_l2) or scope_rel_l2 <= 0:
        return 0
    runs = 0
    for i, ((r, t), site) in enumerate(zip(level.pairs, level.sites)):
        if t is None or site.total is None or site.verdict == "not compared":
            continue
        if site.local is None:
            if site.total.max_abs == 0:
                continue  # the same output: no difference of its own to follow
            if _same(r.inputs, t.inputs):
                local_out = t.output
            elif runs < d.max_local_runs:
                runs += 1
                try:
                    local_out = d.tgt.run_call(r.name, r.inputs, r.rng, t.state)
                except Exception:  # noqa: BLE001 - a call that cannot run alone is not followed
                    continue
            else:
                break
            site.local = _worst(compare(local_out, r.output, d.tol))
            site.inherited = _worst(compare(t.output, local_out, d.tol))
        own = site.local.rel_l2 if site.local is not None else math.nan
        if math.isfinite(own) and own > 0 and own >= ACCUMULATED_SHARE * scope_rel_l2:
            level.culprit = i
            site.verdict = "local"
            scope = level.base or "the check's module"
            loc.notes.append(
                f"no call inside {scope} is out of tolerance on its own; its difference is the sum of differences "
                f"each within tolerance (atol hides a relative error on small activations), so the descent "
                f"followed the first call whose own (local) rel-L2, {own:.3g}, is at least "
                f"{ACCUMULATED_SHARE:g}× that of {scope} ({scope_rel_l2:.3g}): {site.path}")
            break
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


def _gradients_fail(result: CompareResult) -> bool:
    """Whether a train step's ``grad.<p>`` leaves include one out of tolerance."""
    return any(leaf.path.startswith("grad.") and not leaf.passed for leaf in result.leaves)


def failure_hook(case: Any, record: Any, call: Any, result: CompareResult) -> str | None:
    """``ParitySession`` failure hook without budget or sharing: localize, keep the table in
    ``record.localized.localization`` and return the text for the failure message (None for a check
    of a free function). The plugin uses a ``Localizer`` instead."""
    loc = localize(case, record, call, result)
    if loc is None:
        return None
    record.localized.localization = loc.to_rows()
    record.localized.localization_ops = loc.op_rows()
    record.localized.localization_backward = loc.backward_rows()
    return loc.format()


def structural_problem(result: CompareResult) -> str | None:
    """``"<leaf>: <problem>"`` of the first leaf whose outputs differ in structure, shape or dtype
    (``LeafResult.problem``), or None when every leaf was compared by value."""
    for leaf in result.leaves:
        if leaf.problem is not None:
            return f"{leaf.path or '<output>'}: {leaf.problem}"
    return None



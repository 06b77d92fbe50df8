"""The program difference of one module call: which ops the target runs that the reference does not.

``op_trace.trace_ops`` names a *wrong kernel*: an op whose own result is wrong for its own inputs.
A port can also be wrong without any wrong kernel: it runs *other ops* than the reference — a cast
inserted before a softmax, a fused op (``aten.native_layer_norm``) replaced by several small ones,
an op added or moved to another device by a runtime patch, an op left out. Each op then computes
correctly what it is asked, and the op trace finds no culprit. This module records what each side
runs and names the first place where the two programs part.

**Recording** (``OpRecorder``, ``record_ops``): a ``TorchDispatchMode`` that, for every op that
reaches the dispatcher (aten ops after autograd and the composite decompositions; a device's own
ops such as ``npu.*``), calls the op, returns exactly its result (nothing is copied, cast or re-run:
``tests/diagnose/test_op_stream.py`` checks outputs bitwise against a plain run) and keeps a
``StreamOp``: the op's name without overload (``aten._softmax``), its overload, the dtypes of its
tensor inputs and outputs, its output shapes and device type, the module it ran in and the user's
source line (``op_trace``'s ``_Tracker`` and ``_user_frame``: ``torch.utils.module_tracker`` where
torch has it, the innermost frame outside torch, the standard library and this package). Ops run
by a dispatch mode below the recorder with the modes off (a patch set that replaces a kernel) are
not seen: they are that kernel's implementation, which the op trace judges.

**Alignment** (``compare_streams``): ``difflib.SequenceMatcher`` (``autojunk`` off) over the two
sequences of keys ``(op name, input dtypes, output dtypes)``; shapes are compared separately, pair
by pair, within the runs of equal keys. The first block that is not equal is the *first program
difference*:

* ``inserted``: ops the target runs where the reference runs nothing (a ``.half()`` cast:
  ``aten._to_copy float32->float16``);
* ``removed``: ops the reference runs that the target leaves out (a scale multiplication);
* ``replaced``: ops of the reference replaced by others on the target (``aten.native_layer_norm``
  by ``aten.mean``, ``aten.sub``, …); a replaced block is aligned again by op name alone, so a
  cast inserted before an op whose dtype it changes is named as the inserted cast, and the same
  op with other dtypes as ``dtype``;
* ``dtype``: the same op with other input or output dtypes;
* ``shape``: the same op and dtypes with another output shape.

Pure view and metadata ops (``IGNORED``: ``aten.view``, ``t``, ``transpose``, ``expand``,
``detach``, ``alias``, ``_unsafe_view``, ``unsqueeze``, ``squeeze``, ``permute``, ``as_strided``,
``lift_fresh``) are recorded but left out of the alignment: they compute nothing, and which of them
runs moves with implementation details (a ``matmul`` of a contiguous or a transposed operand, a
``reshape`` that is or is not a view). Op indices (``#k``) count every dispatched op, views
included, as the op trace's do.

The idea of logging every dispatched op of a run and comparing the logs of two runs is that of
PyTorch's ``DebugMode`` (``torch.utils._debug_mode``, in ``torch/utils/_debug_mode/_mode.py`` of
torch 2.14.1: a ``TorchDispatchMode`` that logs each op with its arguments' dtypes and shapes, and
``DebugMode.check_hash_mismatches``, which compares the tensor hashes of two runs' logs). That
comparison requires the two logs to have the same ops (it raises on different lengths or op names);
here the logs are *expected* to differ, and the alignment says where. Nothing of DebugMode is used
or imported.

What it cannot tell apart: the reference runs on the CPU and the target on its device, so an op the
device's backend picks differently for the same Python code (an attention backend, a fused kernel
registered for that device only) is a program difference too; the source lines of both sides say
whether the model's code or the backend chose it.

Cost: per op, a walk of the Python stack for the source line and the dtypes of its tensors: no
tensor is copied. Measured on a shared 2-core CPU (torch 2.14.1), the whole forward of a 2-layer
Llama (hidden 32, 255 ops): 0.005 s plain, 0.019 s under ``record_ops``; 0.079 s under
``op_trace.trace_ops`` and 0.10 s with the recorder below it. At most ``MAX_OPS`` ops are kept per
side (later ones still run; a note says so); that also bounds the alignment, quadratic in the worst
case: two streams of 20 000 ops made of a 40-op pattern repeated (one insertion in the middle) align
in 1.7 s, of 2 000 ops in 18 ms.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .op_trace import _exotic, _tensors, _Tracker, _user_frame

#: Pure view and metadata ops, left out of the alignment key (module doc).
IGNORED = frozenset({"aten.view", "aten.t", "aten.transpose", "aten.expand", "aten.detach", "aten.alias",
                     "aten._unsafe_view", "aten.unsqueeze", "aten.squeeze", "aten.permute", "aten.as_strided",
                     "aten.lift_fresh"})
#: Ops kept per side at most; later ops still run, unrecorded (a note says so).
MAX_OPS = 20000
#: Ops of one side of the first difference listed in the message and the report at most.
SHOWN_OPS = 5


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class StreamOp:
    """One dispatched op of a recorded call.

    Attributes:
        index: its place among every op dispatched in the call (0-based, views included).
        op: name without overload (``aten._to_copy``); ``overload``: ``default``, ``Tensor``, …
        module: dotted path of the innermost module it ran in.
        source: ``"<file>:<line>: <code>"`` of the user's line that issued it, or None.
        inputs: dtypes of its tensor inputs in argument order (``("float32", "float32")``).
        outputs: dtypes of its tensor outputs; ``shapes``: their shapes (None for a nested tensor).
        device: device type of its first tensor output (``cpu``, ``npu``), or None without one.
    """

    index: int
    op: str
    overload: str
    module: str
    source: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    shapes: tuple[tuple[int, ...] | None, ...]
    device: str | None = None

    @property
    def key(self) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
        """What the alignment compares: ``(op, inputs, outputs)``."""
        return self.op, self.inputs, self.outputs

    def dtypes(self) -> str:
        """``"<inputs>-><outputs>"``, each a comma-separated list of distinct dtypes in order
        (``float32->float16``; ``->float32`` for a factory op)."""
        return f"{','.join(dict.fromkeys(self.inputs))}->{','.join(dict.fromkeys(self.outputs))}"

    def describe(self, home: str | None = None) -> str:
        """``"aten._to_copy float32->float16"``, plus ``on <device>`` where its output lands on
        another device type than ``home`` (the side's own device type)."""
        where = f" on {self.device}" if home is not None and self.device not in (None, home) else ""
        return f"{self.op} {self.dtypes()}{where}"

    def to_row(self, side: str, change: str) -> dict[str, Any]:
        """A JSON-able dict: a ``kind: "op_stream"`` row of the report's ``localization_ops``, with the
        keys an op trace's row has where they apply (``first_op`` is False: that names a culprit kernel)."""
        return {"kind": "op_stream", "side": side, "change": change, "op": self.op, "overload": self.overload,
                "op_index": self.index, "module": self.module, "source": self.source,
                "input_dtypes": list(self.inputs), "dtype": ",".join(self.outputs) or None,
                "shape": [list(s) if s is not None else None for s in self.shapes], "device": self.device,
                "first_op": False}


@dataclass
class OpStream:
    """The ops of one recorded module call (``OpRecorder``).

    Attributes:
        module: display path of the recorded module; ``device``: the device type it ran on (the
            side's own device type), or None before the first op.
        ops: one ``StreamOp`` per op, up to ``MAX_OPS`` (execution order); ``dispatched``: every op
            dispatched (also those past the limit).
        failed: ``"<Error>: <message>"`` where recording an op raised (recording stopped there; the
            call itself went on unchanged), else None.
        output: what the module returned (``record_ops``); ``seconds``: wall time of the recorded call.
    """

    module: str
    device: str | None = None
    ops: list[StreamOp] = field(default_factory=list)
    dispatched: int = 0
    failed: str | None = None
    output: Any = None
    seconds: float = 0.0

    @property
    def compared(self) -> list[StreamOp]:
        """The ops the alignment compares: every recorded op but the pure views (``IGNORED``)."""
        return [o for o in self.ops if o.op not in IGNORED]


class OpRecorder(TorchDispatchMode):
    """A dispatch mode recording the op stream of a module call (module doc); it changes nothing.

    Use as a context manager around the call of ``root`` (``with OpRecorder(module, path) as rec:
    module(x)``); ``rec.stream`` is the ``OpStream``. Entered *below* another mode (before it: an
    ``op_trace`` trace), it sees the ops that mode runs on the call's behalf, not the ones it runs
    with the modes off (its goldens). An error while recording an op stops the recording
    (``OpStream.failed``) and never reaches the call.

    Args:
        root: the module whose call is recorded (for module paths).
        path: its display path (``blocks.2.attn``); "" names it ``<Type>``.
        stop: a code object at which the source-line walk stops (``record_ops`` passes its own).
        max_ops: ops kept at most (``MAX_OPS``).
    """

    def __init__(self, root: torch.nn.Module, path: str = "", *, stop: Any = None, max_ops: int = MAX_OPS):
        super().__init__()
        self.stream = OpStream(path or f"<{type(root).__name__}>")
        self.tracker = _Tracker(root, path)
        self.stop, self.max_ops = stop, max_ops

    def __enter__(self) -> "OpRecorder":
        self.tracker.__enter__()
        try:
            super().__enter__()
        except BaseException:
            self.tracker.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.tracker.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        stream = self.stream
        index = stream.dispatched
        stream.dispatched += 1
        inputs = None
        if stream.failed is None and len(stream.ops) < self.max_ops:
            try:
                inputs = tuple(_dtype(t) for t in _tensors((args, kwargs)))
            except Exception as exc:  # noqa: BLE001 - recording stops; the call goes on
                stream.failed = f"{type(exc).__name__}: {exc}"
        out = func(*args, **kwargs)
        if inputs is not None and stream.failed is None:
            try:
                self._keep(func, index, inputs, out)
            except Exception as exc:  # noqa: BLE001 - recording stops; the call goes on
                stream.failed = f"{type(exc).__name__}: {exc}"
        return out

    def _keep(self, func: Any, index: int, inputs: tuple[str, ...], out: Any) -> None:
        outputs = _tensors(out)
        device = outputs[0].device.type if outputs else None
        if self.stream.device is None and device is not None:
            self.stream.device = device
        self.stream.ops.append(StreamOp(
            index, str(func.overloadpacket), func._overloadname, self.tracker.innermost(), _user_frame(self.stop),
            inputs, tuple(_dtype(t) for t in outputs),
            tuple(None if _exotic(t) else tuple(t.shape) for t in outputs), device))


def record_ops(module: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, *, path: str = "",
               max_ops: int = MAX_OPS) -> OpStream:
    """Run ``module(*args, **kwargs)`` once under an ``OpRecorder``; return its ``OpStream``
    (``output``: exactly what the module returned).

    It runs in the caller's context (device placement, recipe, autocast, grad mode, patch set are the
    caller's). Raises whatever the module's forward raises; an error of the recording itself is kept
    in ``OpStream.failed``.
    """
    start = time.perf_counter()
    with OpRecorder(module, path, stop=_RECORD_CODE, max_ops=max_ops) as recorder:
        recorder.stream.output = module(*args, **dict(kwargs or {}))
    recorder.stream.seconds = time.perf_counter() - start
    return recorder.stream


_RECORD_CODE = record_ops.__code__  # where the source-line walk of a recording stops


# --------------------------------------------------------------------------------------------
# alignment


@dataclass
class ProgramDifference:
    """The outcome of ``compare_streams``.

    Attributes:
        reference_ops, target_ops: ops compared on each side (views left out, ``IGNORED``).
        change: the first difference: ``inserted``, ``removed``, ``replaced``, ``dtype`` or
            ``shape``; None where the streams are the same (names, dtypes and shapes).
        reference, target: the ops of each side in that first difference (at most ``SHOWN_OPS``;
            ``inserted`` has no reference op, ``removed`` no target op); ``after``: for an
            ``inserted``/``removed`` block, the op of the other side it comes before (or None at the end).
        count_reference, count_target: how many ops each side has in that block (may exceed those kept).
        blocks: differing blocks in all (each counted once; shape pairs one by one).
        home: device type of each side (``(reference, target)``), for naming an op moved elsewhere.
        notes: what limited the comparison (an op limit, a recording that failed).
    """

    reference_ops: int
    target_ops: int
    change: str | None = None
    reference: list[StreamOp] = field(default_factory=list)
    target: list[StreamOp] = field(default_factory=list)
    after: StreamOp | None = None
    count_reference: int = 0
    count_target: int = 0
    blocks: int = 0
    home: tuple[str | None, str | None] = (None, None)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: the first difference with both sides' ops (name, module path, source line), or
        that the op streams are the same."""
        head = f"Program difference (reference vs target op streams, {self.reference_ops} vs {self.target_ops} ops)"
        if self.change is None:
            return (f"{head}: same op stream (names and dtypes): the difference is in the values, not in which "
                    "ops run")
        ref_home, tgt_home = self.home
        more = f"; {self.blocks - 1} more differing block(s) after it" if self.blocks > 1 else ""
        if self.change == "removed":
            first = self.reference[0]
            where = (f"before target op #{self.after.index} ({self.after.op})" if self.after is not None
                     else "at the end of the target's stream")
            return (f"{head}: first at reference op #{first.index}: removed {_ops(self.reference, self.count_reference, ref_home)}"
                    f" ({_at(first)}) — the target runs nothing {where}{more}")
        first = self.target[0]
        text = f"{head}: first at target op #{first.index}: "
        if self.change == "inserted":
            where = (f" before reference op #{self.after.index} ({self.after.op})" if self.after is not None else "")
            text += f"inserted {_ops(self.target, self.count_target, tgt_home)} ({_at(first)}){where}"
        elif self.change == "replaced":
            ref = self.reference[0]
            text += (f"{_ops(self.reference, self.count_reference, ref_home)} of the reference ({_at(ref)}) replaced "
                     f"by {_ops(self.target, self.count_target, tgt_home)} ({_at(first)})")
        elif self.change == "dtype":
            ref = self.reference[0]
            text += (f"{first.op} runs {first.dtypes()} where the reference runs {ref.dtypes()} "
                     f"(target {_at(first)}; reference {_at(ref)})")
        else:  # shape
            ref = self.reference[0]
            text += (f"{first.op} {first.dtypes()} gives shape {_shapes(first)} where the reference gives "
                     f"{_shapes(ref)} ({_at(first)})")
        return text + more

    def to_rows(self) -> list[dict[str, Any]]:
        """The ops of the first difference as JSON-able ``kind: "op_stream"`` rows (``StreamOp.to_row``;
        reference ops first), each with the op counts of both sides; none where the streams are the same."""
        if self.change is None:
            return []
        rows = [o.to_row("reference", self.change) for o in self.reference]
        rows += [o.to_row("target", self.change) for o in self.target]
        for row in rows:
            row.update(reference_ops=self.reference_ops, target_ops=self.target_ops)
        return rows


def _at(op: StreamOp) -> str:
    return f"in {op.module}" + (f", {op.source}" if op.source else "")


def _ops(ops: list[StreamOp], count: int, home: str | None) -> str:
    """``aten.x float32->float32`` for one op; ``N ops: aten.a, aten.b, …`` for several."""
    if count == 1:
        return ops[0].describe(home)
    names = ", ".join(o.describe(home) for o in ops[:3]) + (", …" if count > 3 else "")
    return f"{count} ops: {names}"


def _shapes(op: StreamOp) -> str:
    return ", ".join(str(list(s)) if s is not None else "nested" for s in op.shapes) or "-"


def compare_streams(reference: OpStream, target: OpStream) -> ProgramDifference:
    """Align two op streams of the same module call (module doc) and name their first difference.

    Args:
        reference: the reference side's stream (``record_ops`` on the reference module).
        target: the target side's stream, recorded from the same inputs.

    Returns:
        A ``ProgramDifference`` (``change`` None where names, dtypes and shapes all agree).
    """
    ref, tgt = reference.compared, target.compared
    diff = ProgramDifference(len(ref), len(tgt), home=(reference.device, target.device))
    for side, stream in (("reference", reference), ("target", target)):
        if stream.failed is not None:
            diff.notes.append(f"recording the {side}'s op stream stopped at op #{len(stream.ops)} ({stream.failed}): "
                              "only the ops before it are compared")
        elif stream.dispatched > len(stream.ops):
            diff.notes.append(f"the {side}'s stream has {stream.dispatched} ops; the first {len(stream.ops)} are "
                              "compared")
    matcher = SequenceMatcher(None, [o.key for o in ref], [o.key for o in tgt], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            for a, b in zip(ref[i1:i2], tgt[j1:j2]):
                if a.shapes != b.shapes:
                    diff.blocks += 1
                    if diff.change is None:
                        _first(diff, "shape", [a], [b], None)
            continue
        diff.blocks += 1
        if diff.change is None:
            _refine(diff, ref[i1:i2], tgt[j1:j2], ref[i2] if i2 < len(ref) else None,
                    tgt[j2] if j2 < len(tgt) else None)
    return diff


def _first(diff: ProgramDifference, change: str, ref: list[StreamOp], tgt: list[StreamOp],
           after: StreamOp | None) -> None:
    diff.change, diff.after = change, after
    diff.reference, diff.target = ref[:SHOWN_OPS], tgt[:SHOWN_OPS]
    diff.count_reference, diff.count_target = len(ref), len(tgt)


def _refine(diff: ProgramDifference, ref: list[StreamOp], tgt: list[StreamOp], next_ref: StreamOp | None,
            next_tgt: StreamOp | None) -> None:
    """The first difference inside a non-equal block (``next_ref``/``next_tgt``: the op after the block
    on each side): aligned again by op name, so that an inserted cast is named before the op whose
    dtype it changes, and the same op with other dtypes is ``dtype``."""
    names = SequenceMatcher(None, [o.op for o in ref], [o.op for o in tgt], autojunk=False)
    for tag, i1, i2, j1, j2 in names.get_opcodes():
        if tag == "equal":
            for a, b in zip(ref[i1:i2], tgt[j1:j2]):
                if a.key != b.key:
                    _first(diff, "dtype", [a], [b], None)
                    return
            continue
        if tag == "insert":
            _first(diff, "inserted", [], tgt[j1:j2], ref[i1] if i1 < len(ref) else next_ref)
        elif tag == "delete":
            _first(diff, "removed", ref[i1:i2], [], tgt[j1] if j1 < len(tgt) else next_tgt)
        else:
            _first(diff, "replaced", ref[i1:i2], tgt[j1:j2], None)
        return

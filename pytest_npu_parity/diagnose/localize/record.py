"""What a localization found: its sites (``Site``), the result (``Localization``) and the tables it prints.

Part of ``pytest_npu_parity.diagnose.localize`` (the package docstring describes the descent).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...judge.allclose import LeafResult

#: Rows of the backward table shown in the failure message at most (the report's
#: ``localization_backward`` has every row).
BACKWARD_SHOWN_ROWS = 16


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
    ``inherited``, ``fail`` (out of tolerance, not separated), ``missing`` (the call happened on one
    side only) or ``not compared`` (its output holds no tensor both sides could compare: nothing
    says that it agrees, and it is never taken for a call that does). A ``local`` verdict whose
    local err/tol is within 1 is a call followed because none of its scope's calls is out of
    tolerance alone (``descent.ACCUMULATED_SHARE``; a note says so).
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
        return self.verdict not in ("ok", "not compared")

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
        op_stream: the ``op_stream.ProgramDifference`` of that module's call: the reference's and the
            target's op streams aligned, naming the first op the target inserts, removes, replaces or
            runs with other dtypes or shapes; None where there is no op trace or a recording failed (a
            note says why).
        backward: train steps whose gradients fail: the backward table (``backward.backward_table``),
            one JSON-able row per module call in backward order: inherited (grad_output), total
            (param grads, grad_input) and local error, and the verdict.
        first_backward: ``"<path> (<type>)"`` of the first call in backward order whose own backward
            (local) is out of tolerance, or None.
        live_agrees: a check judged against a baseline whose target output agrees with the live CPU
            run's (the check's tolerance): the command that re-records the test (``""`` when there is
            none); the message then says the baseline, not the target, differs. None otherwise.
        root_outputs: ``(live reference's, target's)`` outputs of the check's own call in the first
            pass (kept for ``live_agrees``), or None.
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
    op_stream: Any = None
    backward: list[dict[str, Any]] = field(default_factory=list)
    first_backward: str | None = None
    live_agrees: str | None = None
    root_outputs: Any = field(default=None, repr=False)

    def to_rows(self) -> list[dict[str, Any]]:
        """The table as JSON-able dicts (``record.localized.localization``): activation rows, then
        gradient rows; each row also names the reference side."""
        rows = [dict(site.to_row(), reference=self.reference) for site in self.sites]
        rows += [dict(row, reference=self.reference) for row in self.gradients]
        rows += [dict(row, reference=self.reference) for row in self.buffers]
        return rows

    def op_rows(self) -> list[dict[str, Any]] | None:
        """The op table (``op_trace.OpTrace.to_rows``: the first culprit op first), then the ops of the
        first program difference (``op_stream.ProgramDifference.to_rows``: ``kind: "op_stream"`` rows,
        none where the op streams are the same) as JSON-able dicts (``record.localized.localization_ops``),
        or None without an op trace."""
        if self.op_trace is None:
            return None
        return self.op_trace.to_rows() + (self.op_stream.to_rows() if self.op_stream is not None else [])

    def backward_rows(self) -> list[dict[str, Any]] | None:
        """The backward table (``backward``, in backward order) as JSON-able dicts
        (``record.localized.localization_backward``), or None without one."""
        return [dict(row, reference=self.reference) for row in self.backward] if self.backward else None

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
        lines = [self.summary()]
        if self.live_agrees is not None:
            rerecord = f": {self.live_agrees}" if self.live_agrees else ""
            lines.insert(0, "The target agrees with a live CPU run of the same computation on this machine (within the "
                            "check's tolerance); it is the baseline that differs. The computation changed since it was "
                            "recorded (code its fingerprints do not cover, such as a forward or a function it calls; an "
                            "input within the summary rule), or the recording machine computes it otherwise. If the "
                            f"change is intended, re-record{rerecord}")
        if self.first_backward is not None:
            row = next(r for r in self.backward if r.get("first_divergence"))
            lines.append(f"Backward: {self.first_backward} computes its own gradients differently (local err/tol "
                         f"{_fmt(row.get('local_err_ratio'))} on the reference's inputs and grad_output); the "
                         "gradients before it in the forward inherit that (backward table below)")
        lines += [f"Localized against {self.reference}: {how}.",
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
        if self.backward:
            lines.append("")
            lines += _backward_lines(self.backward, self.first_backward)
        if self.buffers:
            lines.append("")
            lines.append("Buffers out of tolerance, with the module that owns each:")
            lines += _buffer_table(self.buffers)
        if self.op_trace is not None:
            lines.append("")
            lines.append(self.op_trace.format())
        if self.op_stream is not None:
            lines.append(self.op_stream.summary())
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


def _backward_lines(rows: list[dict[str, Any]], first: str | None) -> list[str]:
    """The backward table of the failure message: a heading naming the first local row, then the
    rows in backward order (at most ``BACKWARD_SHOWN_ROWS``, kept around the first local row)."""
    if first is not None:
        row = next(r for r in rows if r.get("first_divergence"))
        head = (f"Backward pass, layer by layer: the layer whose backward differs is {first} — local err/tol "
                f"{_fmt(row.get('local_err_ratio'))} on the reference's inputs and grad_output (grad_output "
                f"inherited err/tol {_fmt(row.get('grad_output_err_ratio'))})")
    else:
        head = "Backward pass, layer by layer: no layer's own backward is out of tolerance"
    lines = [head, "(grad_output: inherited from the layers after it; param grad, grad_input: total; local: the "
                   "target's layer backward on the reference's inputs and grad_output vs the reference; err/tol)"]
    index = next((i for i, r in enumerate(rows) if r.get("first_divergence")), 0)
    start = max(0, min(index - BACKWARD_SHOWN_ROWS // 2, len(rows) - BACKWARD_SHOWN_ROWS))
    shown = rows[start:start + BACKWARD_SHOWN_ROWS]
    header = ("module (backward order)", "grad_output err", "param grad err", "grad_input err", "local err", "verdict")
    table = [header] + [(r["submodule"], _fmt(r.get("grad_output_err_ratio")), _fmt(r.get("param_grad_err_ratio")),
                         _fmt(r.get("grad_input_err_ratio")), _fmt(r.get("local_err_ratio")),
                         r["verdict"] + (" <- first" if r.get("first_divergence") else
                                         " (holds the first)" if r.get("holds_first") else "")) for r in shown]
    widths = [max(len(str(t[i])) for t in table) for i in range(len(header))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
    if len(shown) < len(rows):
        lines.append(f"({len(rows) - len(shown)} more rows in the report's localization_backward column)")
    return lines


def _gradient_table(gradients: list[dict[str, Any]]) -> list[str]:
    header = ("gradient", "max_abs", "rel_l2", "cosine", "err/tol", "verdict")
    rows = [header] + [(g["leaf"], _fmt(g["max_abs"]), _fmt(g["rel_l2"]), _fmt(g["cosine"]), _fmt(g["err_ratio"]),
                        g["verdict"] + (" <- first" if g.get("first_divergence") else "")) for g in gradients]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# --------------------------------------------------------------------------------------------
# recording one pass


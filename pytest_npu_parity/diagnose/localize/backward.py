"""The backward pass of a failing train step, layer by layer: local vs inherited gradient error.

A train step compares every parameter's gradient, but a wrong backward in one layer makes every
gradient computed after it (every layer before it in the forward) wrong too: "layer 0's gradient
is 50 % off while the loss is within 1 %" names the end of the chain, not the layer whose backward
differs. ``backward_table`` separates, per module call (the check's module and its calls down to
``BACKWARD_DEPTH`` levels of nesting), in backward order:

* inherited — the gradient w.r.t. the call's output (its *grad_output*) on the target vs the
  reference's: what the layers after it (in the forward) handed it;
* total     — the gradients the call computes on each side from its own inputs and grad_output: its
  parameters' gradients and the gradient w.r.t. its floating inputs that required grad (its
  *grad_input*, this call's share only), target vs reference;
* local     — the target's call re-run (forward with the random stream restored to the reference
  call's, then ``torch.autograd.grad``) on the *reference's* inputs with the *reference's*
  grad_output, vs the reference's param grads and grad_input: what this layer's own backward adds.

The first call in backward order (the reverse of the order in which the calls began in the forward:
a module's children come before it) whose local comparison is out of the check's tolerance (the
``compare`` rule, as ``descent._judge_level``) is the layer whose backward differs.

Capture: one forward (under the side's recorder, ``sides._Recorder``, which snapshots each call's
inputs, random state and grad/autocast mode) and one backward (``torch.autograd.grad`` of the
step's loss, ``CheckCall.loss``, w.r.t. the parameters: no ``.grad`` is written) per side. The
grad_output of a call is caught by a *tensor* hook registered, in the call's forward hook, on every
floating output tensor that requires grad; it copies the gradient to the CPU and returns None (the
gradient flowing on is unchanged). Not ``register_full_backward_hook``: it wraps a module's inputs
and outputs in an identity autograd Function (``BackwardHookFunction``), so an in-place op on an
output or input afterwards raises ("a view ... is being modified inplace"), and it cannot be
registered on modules that return non-tensor structures holding tensors the way several Hugging
Face modules do. A tensor hook changes no tensor; a hook registered before an in-place change of
the tensor still receives the gradient w.r.t. the tensor as the module returned it (PyTorch's
autograd notes, "Behavior of Tensor hooks when Tensor is modified in-place", since 2.0). A tensor
hook on an *input* would see the gradient summed over every consumer of that tensor (a residual
branch included), not the call's own share, so grad_input and the param grads come from re-running
the call alone (three re-runs per call: each side on its own inputs and grad_output, and the
target on the reference's).

Limits: an output of a call that is an autograd ancestor of another output of the same call (the
logits next to a Hugging Face model's ``loss``) is left out of the re-run's ``grad_outputs`` (its
captured gradient already holds the share that flows through the other output); a share of it
used outside the call is then not counted. A call whose output got no gradient on one side (a
``.detach()`` after it) is ``missing``. A step with a training ``loop`` (``hf_trainer``) has no
``CheckCall.loss``: no table.
"""
from __future__ import annotations

import time
from typing import Any, Iterator, Mapping

import torch

from ...judge.allclose import CompareResult, LeafResult, compare
from ...judge.tolerance import Tolerance
from .record import Localization, _num
from .sides import _Call, _Recorder, _same, _Side, _to_device, _worst

#: Levels of module calls in the table: the check's module (1), its children (2) and theirs (3)
#: (a tiny Llama: the model, ``model`` and ``lm_head``, the embedding, each decoder layer, the norm).
BACKWARD_DEPTH = 3
#: Calls judged at most (each costs three forward+backward re-runs of the call).
MAX_BACKWARD_CALLS = 48


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of every tensor in a nested tuple/list/mapping, in a fixed order (the same
    for a live structure and its ``sides._snapshot``, which keeps the containers)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}[{i}]")
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}.{key}")


def _differentiable(t: torch.Tensor) -> bool:
    return t.requires_grad and t.is_floating_point() and t.layout == torch.strided and not t.is_nested


class _GradRecorder(_Recorder):
    """A ``_Recorder`` of the check's module call and its calls down to ``BACKWARD_DEPTH`` levels
    that also notes, per call, the order it began in, which floating inputs required grad, and (with
    ``capture``) the gradients w.r.t. its outputs (tensor hooks, module doc)."""

    def __init__(self, root: torch.nn.Module, device_type: str, notes: dict, capture: bool = True):
        super().__init__(root, None, device_type, depth=BACKWARD_DEPTH, notes=notes)
        self.capture = capture
        self.started: dict[tuple[str, int], int] = {}
        self.needs: dict[tuple[str, int], list[str]] = {}
        self.grad_out: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def _pre(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        super()._pre(module, args, kwargs)
        call, depth = self.stack[-1]
        if depth:
            self.started[call.key] = len(self.started)
            self.needs[call.key] = [p for p, t in _tensors((args, kwargs)) if _differentiable(t)]

    def _post(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        call, depth = self.stack.pop()  # as _Recorder._post, without copying the outputs (not compared here)
        self.done += 1
        self.last_done[call.name] = self.done
        if depth:
            self.calls.append(call)
        if depth and self.capture:
            grads = self.grad_out.setdefault(call.key, {})
            for path, t in _tensors(output):
                if _differentiable(t):
                    t.register_hook(_keeper(grads, path))


def _keeper(grads: dict[str, torch.Tensor], path: str) -> Any:
    def keep(grad: torch.Tensor) -> None:
        grads[path] = grad.detach().to("cpu", copy=True)  # returns None: the gradient flows on unchanged
    return keep


def grad_pass(side: _Side, capture: bool = True) -> tuple[_GradRecorder | None, dict, dict[str, torch.Tensor]]:
    """The step's forward, loss and backward on ``side`` (its context: patch set, recipe, shared
    random stream), with the recorder (``capture``) or without any hook (``capture`` False).

    Returns:
        ``(recorder or None, {output path: CPU copy} with "loss", {"grad.<p>": CPU gradient})``;
        the gradients are those of the loss, before clipping and the optimizer step.

    Raises:
        ValueError: the check has no ``CheckCall.loss`` (a training loop).
    """
    loss_of = getattr(side.call, "loss", None)
    if loss_of is None:
        raise ValueError("the train step has no loss function to run its backward with (a training loop)")
    recorder = None
    with side.running() as root:
        if capture:
            recorder = _GradRecorder(root, side.device.type, side.notes)
            with recorder:
                output = side.run_root(root)
        else:
            output = side.run_root(root)
        loss = loss_of(output, root)
        params = [(n, p) for n, p in root.named_parameters() if p.requires_grad]
        with _no_autocast(side):  # the step runs its backward outside the recipe's context
            grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    outs = {path or "<output>": t.detach().to("cpu", copy=True) for path, t in _tensors(output)}
    outs["loss"] = loss.detach().to("cpu", copy=True)
    return recorder, outs, {f"grad.{n}": g.detach().to("cpu", copy=True) for (n, _), g in zip(params, grads)
                            if g is not None}


def _no_autocast(side: _Side) -> Any:
    """Autocast off on ``side``'s device type: the backward runs as ``training_step`` runs it, outside
    the recipe's context (an autocast-enabled backward would cast its matmuls too)."""
    return torch.autocast(side.device.type, enabled=False)


def _ancestors(outputs: list[torch.Tensor]) -> set[int]:
    """Indices of ``outputs`` from which another of them is computed (autograd graph edges)."""
    edges = {(t.grad_fn, t.output_nr): i for i, t in enumerate(outputs) if t.grad_fn is not None}
    found: set[int] = set()
    for j, t in enumerate(outputs):
        stack, seen = [t.grad_fn] if t.grad_fn is not None else [], set()
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            for nxt, nr in node.next_functions:
                i = edges.get((nxt, nr))
                if i is not None and i != j:
                    found.add(i)
                if nxt is not None:
                    stack.append(nxt)
    return found


def call_gradients(side: _Side, call: _Call, inputs: tuple, rng: tuple, needs: list[str],
                   grad_out: dict[str, torch.Tensor], traced: list | None = None,
                   **trace: Any) -> dict[str, torch.Tensor]:
    """Re-run call ``call`` of ``side`` on ``inputs`` (a recorded snapshot) with the random stream at
    ``rng`` and the call's grad/autocast mode, and backpropagate ``grad_out`` (``{output path: CPU
    gradient}``) through it alone. With ``traced`` (a list), the forward and the backward run under
    ``op_trace.trace_ops(..., backward=...)`` (``trace``: its keyword arguments), appended to ``traced``:
    the same gradients, each op of the call's backward compared with its float64 golden.

    Returns:
        ``{"grad_input<path>": ..., "grad.<param>": ...}`` CPU tensors: the gradients w.r.t. the inputs
        at ``needs`` (each input a fresh leaf, handed to the module as a clone so in-place ops on it
        work) and the module's parameters that require grad (zeros where none flows: a cut branch).
    """
    with side.running(rng, call.state) as root:
        module = root.get_submodule(call.name)
        leaves: dict[str, torch.Tensor] = {}
        wanted = set(needs)

        def prepare(obj: Any, prefix: str) -> Any:
            if isinstance(obj, torch.Tensor):
                if prefix in wanted and obj.is_floating_point():
                    leaves[prefix] = obj.detach().requires_grad_(True)
                    return leaves[prefix].clone()
                return obj
            if isinstance(obj, tuple):
                return tuple(prepare(v, f"{prefix}[{i}]") for i, v in enumerate(obj))
            if isinstance(obj, list):
                return [prepare(v, f"{prefix}[{i}]") for i, v in enumerate(obj)]
            if isinstance(obj, dict) and type(obj) is dict:
                return {k: prepare(v, f"{prefix}.{k}") for k, v in obj.items()}
            return obj

        args, kwargs = _to_device(inputs, side.device)
        args, kwargs = prepare(args, "[0]"), prepare(kwargs, "[1]")
        params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        wrt = list(leaves.values()) + [p for _, p in params]

        def backward(output: Any) -> Any:
            pairs, seen = [], set()
            for path, t in _tensors(output):
                if path in grad_out and _differentiable(t) and id(t) not in seen:
                    seen.add(id(t))
                    pairs.append((t, grad_out[path].to(side.device)))
            for i in sorted(_ancestors([t for t, _ in pairs]), reverse=True):
                del pairs[i]
            with _no_autocast(side):
                return (torch.autograd.grad([t for t, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                        if pairs and wrt else [None] * len(wrt))

        if traced is None:
            grads = backward(module(*args, **kwargs))
        else:
            from ..op_trace import trace_ops

            traced.append(trace_ops(module, args, kwargs, device=side.device, enter_recipe=False, backward=backward,
                                    **trace))
            grads = traced[-1].backward_output
    names = [f"grad_input{p}" for p in leaves] + [f"grad.{n}" for n, _ in params]
    return {name: (g if g is not None else torch.zeros_like(x)).detach().to("cpu", copy=True)
            for name, g, x in zip(names, grads, wrt)}


def _split(result: CompareResult) -> tuple[LeafResult | None, LeafResult | None]:
    """The worst parameter-gradient leaf and the worst grad_input leaf of ``result``."""
    params = CompareResult(name=result.name, leaves=[x for x in result.leaves if x.path.startswith("grad.")])
    inputs = CompareResult(name=result.name, leaves=[x for x in result.leaves if x.path.startswith("grad_input")])
    return _worst(params), _worst(inputs)


def _metrics(prefix: str, leaf: LeafResult | None) -> dict[str, Any]:
    return {prefix + "err_ratio": _num(leaf.err_ratio) if leaf is not None else None,
            prefix + "rel_l2": _num(leaf.rel_l2) if leaf is not None else None,
            prefix + "leaf": leaf.path if leaf is not None else None}


def _judge_call(ref: _Side, tgt: _Side, r: _Call, t: _Call, recs: tuple[_GradRecorder, _GradRecorder],
                tol: Tolerance) -> dict[str, Any]:
    """One row of the table: inherited, total and local comparisons of a call present on both sides."""
    ref_rec, tgt_rec = recs
    r_out, t_out = ref_rec.grad_out.get(r.key) or {}, tgt_rec.grad_out.get(t.key) or {}
    row: dict[str, Any] = {}
    if not r_out and not t_out:
        row["verdict"] = "no gradient"  # e.g. rotary embeddings: nothing to compare, nothing differs
        return row
    if not r_out or not t_out:
        row["verdict"] = "missing"
        row["note"] = f"no gradient reached its output on the {'target' if r_out else 'reference'} side"
        return row
    inherited = compare(t_out, r_out, tol)
    ref_grads = call_gradients(ref, r, r.inputs, r.rng, ref_rec.needs[r.key], r_out)
    tgt_grads = call_gradients(tgt, t, t.inputs, t.rng, tgt_rec.needs[t.key], t_out)
    total = compare(tgt_grads, ref_grads, tol)
    if ref_rec.needs[r.key] == tgt_rec.needs[t.key] and _same(r.inputs, t.inputs) and _same(r_out, t_out):
        local = total  # the same inputs (requiring grad alike) and grad_output: its own result is its local one
    else:
        local = compare(call_gradients(tgt, t, r.inputs, r.rng, ref_rec.needs[r.key], r_out), ref_grads, tol)
    param, grad_input = _split(total)
    row.update(_metrics("grad_output_", _worst(inherited)))
    row.update(_metrics("param_grad_", param))
    row.update(_metrics("grad_input_", grad_input))
    row.update(_metrics("local_", _worst(local)))
    if not local.passed:
        row["verdict"] = "local"
    elif not total.passed or not inherited.passed:
        row["verdict"] = "inherited"
    else:
        row["verdict"] = "ok"
    return row


def backward_table(loc: Localization, case: Any, call: Any, tol: Tolerance, prefix: str = "",
                   deadline: float | None = None) -> None:
    """The backward pass of a failing train step, layer by layer (module doc): fills
    ``loc.backward`` (rows in backward order: ``submodule``, ``module_type``, ``backward_rank``,
    ``grad_output_*`` (inherited), ``param_grad_*``, ``grad_input_*`` (total), ``local_*`` (each
    ``err_ratio``, ``rel_l2`` and the worst ``leaf``), ``verdict`` (``ok``, ``inherited``, ``local``,
    ``missing``), ``first_divergence``) and ``loc.first_backward`` (``"<path> (<type>)"`` of the first
    ``local`` row), or a note saying why not.

    Args:
        loc: the step's ``Localization`` (its ``first`` says whether the forward already diverges).
        case, call: the failing check's ``runner.ParityCase`` and ``CheckCall`` (``kind`` train_step).
        tol: the check's tolerance.
        prefix: the check's ``submodule`` prefix of the rows' paths.
        deadline: ``time.perf_counter()`` value after which no further call is judged (a note says so).
    """
    if getattr(call, "loss", None) is None:
        loc.notes.append("no backward table: the step trains through a loop, whose loss is not known here")
        return
    if deadline is not None and time.perf_counter() >= deadline:
        loc.notes.append("no backward table: the session's localization budget is spent")
        return
    ref = _Side(case, call, torch.device("cpu"), patched=False)
    tgt = _Side(case, call, case.target, patched=True)
    try:
        tgt_rec = grad_pass(tgt)[0]
        ref_rec = grad_pass(ref)[0]
    except Exception as exc:  # noqa: BLE001 - the forward localization stands without it
        loc.notes.append(f"no backward table: the step's backward raised when run again ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})")
        return
    tgt_calls = {c.key: c for c in tgt_rec.calls}
    order = sorted(ref_rec.calls, key=lambda c: -ref_rec.started[c.key])  # backward order
    root_type = type(call.module).__name__
    for rank, r in enumerate(order):
        if rank >= MAX_BACKWARD_CALLS or (deadline is not None and time.perf_counter() >= deadline):
            why = "the session's localization budget is spent" if rank < MAX_BACKWARD_CALLS else \
                f"{MAX_BACKWARD_CALLS} calls judged"
            loc.notes.append(f"the backward table stops after {rank} of {len(order)} calls: {why}")
            break
        name = ".".join(p for p in (prefix, r.name) if p) or f"<{root_type}>"
        path = f"{name}#{r.index}" if ref_rec.counts[r.name] > 1 else name
        row: dict[str, Any] = {"kind": "backward", "submodule": path, "module_type": r.module_type,
                               "backward_rank": rank}
        t = tgt_calls.get(r.key)
        if t is None:
            row["verdict"] = "missing"
        else:
            try:
                row.update(_judge_call(ref, tgt, r, t, (ref_rec, tgt_rec), tol))
            except Exception as exc:  # noqa: BLE001 - a call that cannot be re-run alone: no row values
                row["verdict"] = "not compared"
                row["note"] = f"re-run raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        row["first_divergence"] = row["verdict"] == "local" and loc.first_backward is None
        if row["first_divergence"]:
            loc.first_backward = f"{path} ({r.module_type})"
        loc.backward.append(row)
    _mark_holders(loc.backward, order)
    first = next((c for row, c in zip(loc.backward, order) if row.get("first_divergence")), None)
    if first is not None and loc.op_trace is None:
        _trace_backward(loc, case, ref, tgt, first, tgt_calls.get(first.key), (ref_rec, tgt_rec), prefix, deadline)
    if loc.first is not None and loc.backward:
        loc.notes.append(f"the forward already diverges ({loc.first.path}): the backward table's inputs differ "
                         "between the sides from there on; its local column re-runs each call on the "
                         "reference's inputs and grad_output")


def _trace_backward(loc: Localization, case: Any, ref: _Side, tgt: _Side, r: _Call, t: _Call | None,
                    recs: tuple[_GradRecorder, _GradRecorder], prefix: str, deadline: float | None) -> None:
    """The op trace of the first local call's backward (``call_gradients`` with ``traced``): the target's
    call re-run on the reference's inputs and grad_output, as its local column does, each forward and
    backward op compared with its float64 golden; kept in ``loc.op_trace`` (the message's op table and
    the report's ``localization_ops``), or a note says why not."""
    ref_rec, _ = recs
    name = ".".join(p for p in (prefix, r.name) if p)
    if t is None or (deadline is not None and time.perf_counter() >= deadline):
        return
    traced: list = []
    try:
        call_gradients(tgt, t, r.inputs, r.rng, ref_rec.needs[r.key], ref_rec.grad_out.get(r.key) or {}, traced,
                       recipe=case.recipe, path=name, deadline=deadline)
    except Exception as exc:  # noqa: BLE001 - the table stands without it
        loc.notes.append(f"no op trace of {name or 'the module'}'s backward: its re-run raised ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})")
        return
    if traced:
        loc.op_trace = traced[0]


def _mark_holders(rows: list[dict[str, Any]], order: list[_Call]) -> None:
    """``holds_first``: a ``local`` row whose call holds the first local call (its parent, the check's
    module): its own backward includes the first's, so it is local through it."""
    first = next((c for row, c in zip(rows, order) if row.get("first_divergence")), None)
    if first is None:
        return
    for row, c in zip(rows, order):
        if row["verdict"] == "local" and c is not first and (c.name == "" or first.name.startswith(c.name + ".")):
            row["holds_first"] = True

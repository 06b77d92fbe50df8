"""Op-level diagnosis of one module call: which aten op computes its own result wrongly.

``localize`` ends at a module: a leaf (a Linear, a norm) or one whose own code, outside its
submodules, starts the divergence (an attention's softmax and mask, an FFT filter). ``trace_ops``
goes one step further down: it runs that module's forward once on the target under a
``TorchDispatchMode`` and, for every op that reaches the dispatcher (aten ops, and a device's own
ops such as ``npu.*``),

* runs the op itself and returns exactly what it returned (the target's outputs are unchanged:
  ``tests/diagnose/test_op_trace.py`` checks them bitwise against a plain run);
* re-runs the same op on the CPU in float64 — the *golden* — from the target op's own inputs
  (copied to the CPU before the op runs, floating ones upcast to float64; a device argument becomes
  the CPU; every dispatch mode is off for it, so a mode that patches kernels on the target side is
  not in the golden);
* records its aten name, the module it ran in (``torch.utils.module_tracker.ModuleTracker``, in
  torch since 2.3; a forward-hook stack where it is missing), the user's source line (the innermost
  frame outside torch, the standard library and this package) and two errors:

  - *local*: ``max|target − golden| / max|golden|`` over the finite elements (a non-finite element
    must be the same non-finite value as the golden rounded to the output's dtype, else the error is
    infinite; integer and bool outputs must be equal). This is the op's own error, whatever its
    inputs were;
  - *inherited*: how far the op's inputs are from a float64 *chain* — every op of the call re-run
    in float64 on the float64 results of the ops before it (casts to a floating dtype stay float64),
    starting from the call's inputs and the module's weights: ``max|input − chain| / max|chain|``,
    the worst floating input. Where an op's golden fails, the chain goes on from the target's
    (upcast) result. It costs one more float64 op per op whose inputs differ from their chain.

**Budgets** (``op_budget``): an op's local error is judged against its output dtype,
``max(eps(dtype), ACCUMULATION_EPS · eps(accumulation dtype))``, with float32 as the accumulation
dtype of 16-bit floats (their kernels accumulate in float32) and the dtype itself otherwise:

* float32: ``84 · 2⁻²³ = 1.0e-5``. A correctly rounded float32 op is within ``eps/2 = 6e-8`` of the
  golden relative to its largest element; a reduction over ``K`` terms adds roughly ``√K · eps/2``
  (random-sign rounding errors), so the budget allows ``K`` up to about 28 000 terms. Measured on
  the CPU (torch 2.14.1): every op of a 2-layer Llama forward (hidden 32, eager and sdpa attention)
  stays below 2.6e-7, and a float32 matmul with ``K`` from 64 to 16 384 below 4.7e-7;
* bfloat16: ``eps = 2⁻⁷ = 7.8e-3``: the output's rounding alone is up to ``eps/2 = 3.9e-3``
  (measured under CPU autocast: at most 3.4e-3 on every op of the same Llama), so one eps leaves a
  factor 2;
* float16: ``eps = 2⁻¹⁰ = 9.8e-4``, by the same argument;
* float64: ``84 · 2⁻⁵² = 1.9e-14``; integer and bool outputs: 0 (they must be equal).

An op whose output dtype is finer than the check's precision (a float32 op inside a ``bf16`` check) is
judged by the precision's budget instead: an error within what the check's precision rounds away
cannot explain its failure. Measured: with ATen's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``, what
a CPU without AVX-512 runs), ``aten._scaled_dot_product_flash_attention_for_cpu`` of the same Llama
under the ``bf16`` recipe computes its float32 output 2.3e-5 from the golden (2.3× the float32
budget), where the AVX-512 and default kernels stay within 3.1e-7; judged by its own dtype, a
correct bf16 run named it as the culprit op on such a CPU.

Beyond its budget an op is ``local`` (a kernel that misses the accuracy its dtype
allows: a wrong kernel, a wrong internal precision, an eps other than the one it was given). An op
within its own dtype's budget but beyond the budget of the check's precision (the recipe: float32
for ``fp32``, bfloat16 for ``bf16`` and ``bf16-weights``, float16 for ``fp16``) is ``precision``:
it is computed in a lower precision than the check runs in (a softmax computed in float16 inside an
fp32 check). The *first culprit op* is the first ``local`` op in execution order, else the first
``precision`` op.

**Not compared** (listed with the reason, never dropped): random ops (tagged
``nondeterministic_seeded``, except attention with ``dropout_p = 0``; their golden is not run, so the
random stream is not consumed twice), ops that return uninitialized memory (``empty``), views (they
compute nothing; the chain follows them), ops without a tensor output (``.item()``), ops whose golden
fails on the CPU (a device-only op, a dtype the CPU lacks) and ops past ``max_ops`` or the deadline.
In-place ops are compared: their inputs are copied before they run.

An argument that is wrong in the module's own code (a LayerNorm given another eps, a wrong scale)
is not an op error: every op then computes what it was asked, and the trace says so (no culprit
op); the module-level localization above it has already named the module.

Cost: one target forward of the module plus, per op, a copy of its inputs to the CPU and one or two
float64 CPU runs of it (``OpTrace.seconds``), and the chain holds a float64 CPU copy of every live
intermediate of the call. Measured on a shared 2-core CPU: the whole forward of that Llama (224–287
ops) takes 0.7–1.5 s traced against 0.07–0.5 s plain; a leaf module's trace takes milliseconds.
``localize`` runs it only after a failure, within the localization's deadline.
"""
from __future__ import annotations

import contextlib
import linecache
import math
import os
import re
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from .node_modules import NodeModules, current_module

try:  # present from torch 1.13 on; a private name, hence the fallback
    from torch.utils._python_dispatch import _disable_current_modes
except ImportError:  # pragma: no cover - every supported torch has it
    _disable_current_modes = contextlib.nullcontext  # type: ignore[assignment]

try:  # torch >= 2.3
    from torch.utils.module_tracker import ModuleTracker
except ImportError:  # pragma: no cover - every supported torch (>= 2.5.1) has it
    ModuleTracker = None  # type: ignore[assignment,misc]

#: Accumulation allowance of a kernel, in eps of its accumulation dtype (module doc): 84 · 2⁻²³ = 1e-5 for float32.
ACCUMULATION_EPS = 84
#: Ops compared per trace at most; later ops still run (unchanged) and are counted as not compared.
MAX_OPS = 4000
#: Rows of the op table in a failure message (the first culprit op first).
TABLE_ROWS = 5

_VERDICT_ORDER = {"local": 0, "precision": 1}
_UNINITIALIZED = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
                  "aten.empty_permuted"}
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # pytest_npu_parity/
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_TORCH_NN_MODULES = os.path.join(_TORCH_DIR, "nn", "modules") + os.sep
_TORCH_MODULE_PY = _TORCH_NN_MODULES + "module.py"


def op_budget(dtype: torch.dtype) -> float:
    """The local-error budget of an op whose output has ``dtype`` (relative to the golden's largest
    element; module doc): ``max(eps(dtype), ACCUMULATION_EPS · eps(acc))``, ``acc`` float32 for floats of
    16 bits or fewer, else ``dtype`` (a complex dtype: its real dtype); 0.0 for integer and bool dtypes."""
    if not (dtype.is_floating_point or dtype.is_complex):
        return 0.0
    info = torch.finfo(dtype)
    acc = torch.finfo(torch.float32) if info.bits <= 16 else info
    return max(float(info.eps), ACCUMULATION_EPS * float(acc.eps))


def recipe_precision(recipe: Any) -> torch.dtype | None:
    """The precision a check runs in: the recipe's autocast or weights dtype, float32 for a recipe with
    neither (``fp32``), None without a recipe (then no op is judged ``precision``)."""
    if recipe is None:
        return None
    return getattr(recipe, "autocast_dtype", None) or getattr(recipe, "weights_dtype", None) or torch.float32


# --------------------------------------------------------------------------------------------
# results


@dataclass
class OpRow:
    """One op of the traced call.

    Attributes:
        index: its place in the call's ops (0-based, every dispatched op counted).
        op: the op's name without overload (``aten._softmax``); ``overload``: the overload
            (``default``, ``Tensor``).
        module: dotted path of the innermost module it ran in (the traced module's own path for its
            own code).
        source: ``"<file>:<line>: <code>"`` of the innermost frame outside torch, the standard library
            and this package, or None.
        dtype: its (worst) output's dtype, e.g. ``float32``, or None.
        local: local relative error (module doc), or None where not compared; ``budget``: the budget
            of ``dtype`` (``op_budget``), or of the check's precision where that is coarser (module
            doc); ``inherited``: the inputs' relative distance from the float64
            chain, or None (no floating input, or the chain was not kept).
        verdict: ``ok``, ``local`` (beyond ``budget``), ``precision`` (beyond the recipe's
            budget only) or ``not compared``; ``why``: the reason it was not compared.
        first: it is the first culprit op.
    """

    index: int
    op: str
    overload: str
    module: str
    source: str | None
    dtype: str | None = None
    local: float | None = None
    budget: float | None = None
    inherited: float | None = None
    verdict: str = "not compared"
    why: str | None = None
    first: bool = False
    precision_budget: float | None = None
    phase: str = "forward"

    @property
    def ratio(self) -> float:
        """local / budget (infinite for a mismatch where the budget is 0; 0 where not compared)."""
        if self.local is None:
            return 0.0
        if not self.budget:
            return 0.0 if self.local == 0 else math.inf
        return self.local / self.budget

    def to_row(self) -> dict[str, Any]:
        """A JSON-able dict (``kind`` ``op``: a row of the report's ``localization`` table)."""
        return {"kind": "op", "op": self.op, "overload": self.overload, "op_index": self.index,
                "module": self.module, "source": self.source, "dtype": self.dtype,
                "local": _num(self.local), "budget": _num(self.budget), "inherited": _num(self.inherited),
                "verdict": self.verdict, "why": self.why, "first_op": self.first, "phase": self.phase}


@dataclass
class OpTrace:
    """The outcome of ``trace_ops``.

    Attributes:
        module: display path of the traced module; ``module_type``: its class name.
        device: the target device (``str``); ``precision``: the recipe's dtype name, or None.
        rows: one row per op up to ``max_ops`` (execution order).
        first: the first culprit op (``local``, else ``precision``), or None.
        ops: every op dispatched in the call (also those past the limit).
        not_compared: ``Counter`` of reasons over the ops not compared (also those past the limit),
            with ``examples``: up to three op names per reason.
        seconds: wall time of the traced call (target run, copies, goldens, chain).
        output: what the module returned (the target's own result).
        notes: remarks (the op limit or the deadline was reached, the module tracker in use).
    """

    module: str
    module_type: str
    device: str
    precision: str | None
    rows: list[OpRow] = field(default_factory=list)
    first: OpRow | None = None
    ops: int = 0
    not_compared: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    seconds: float = 0.0
    output: Any = None
    notes: list[str] = field(default_factory=list)
    backward_output: Any = None

    def summary(self) -> str:
        """One line naming the first culprit op, or saying that every op is within its budget."""
        head = (f"Op trace of {self.module} ({self.module_type}) on {self.device}: {self.ops} ops in "
                f"{self.seconds:.2g} s")
        op = self.first
        if op is None:
            return (f"{head}; every op compared is within its budget: each kernel computed what its own inputs "
                    "ask for, so the difference lies in what the module asks for (its weights, an argument such as "
                    "an eps or a scale, a dtype, control flow), not in a kernel")
        where = f"in {op.module}" + (f", {op.source}" if op.source else "")
        if op.verdict == "local":
            what = (f"local error {_fmt(op.local)} beyond its {op.dtype} budget {_fmt(op.budget)}: the kernel "
                    "misses the accuracy its dtype allows")
        else:
            what = (f"local error {_fmt(op.local)} within its {op.dtype} budget {_fmt(op.budget)} but beyond the "
                    f"{self.precision} budget {_fmt(op.precision_budget)} of the check's recipe: it computes in a "
                    "lower precision than the check")
        return f"{head}; first culprit op: {op.op} ({where}) — {what}, inherited {_fmt(op.inherited)}"

    def shown(self, rows: int = TABLE_ROWS) -> list[OpRow]:
        """The rows of the short table: the first culprit op first, then the ops with the largest
        local error relative to their budget (compared ops only)."""
        compared = [r for r in self.rows if r.verdict != "not compared" and r is not self.first]
        compared.sort(key=lambda r: (-_severity(r), r.index))
        head = [self.first] if self.first is not None else []
        return head + compared[:max(0, rows - len(head))]

    def format(self, rows: int = TABLE_ROWS) -> str:
        """Summary, what the columns mean, the short table and the ops not compared."""
        lines = [self.summary(),
                 "(local: the op's output vs the same op in float64 on the CPU from its own inputs, "
                 "max|diff|/max|golden|; inherited: how far its inputs are from a float64 chain of the call's ops; "
                 "budget: of its output dtype, or of the check's precision where coarser)"]
        lines += _table(self.shown(rows))
        if self.not_compared:
            parts = [f"{n} {why} ({', '.join(self.examples.get(why, []))})" for why, n in
                     self.not_compared.most_common()]
            lines.append("Not compared: " + "; ".join(parts))
        lines += [f"Note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_rows(self, rows: int = TABLE_ROWS) -> list[dict[str, Any]]:
        """The shown rows as JSON-able dicts (``OpRow.to_row``)."""
        return [r.to_row() for r in self.shown(rows)]


def _severity(row: OpRow) -> float:
    ratio = row.ratio
    return math.inf if math.isnan(ratio) else ratio


def _num(value: float | None) -> float | None:
    return None if value is None else float(value)


def _fmt(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2g}"


def _table(rows: list[OpRow]) -> list[str]:
    header = ("#", "op", "module", "source", "dtype", "local", "budget", "inherited", "verdict")
    out = [header]
    for r in rows:
        verdict = r.verdict.upper() + " <- first culprit op" if r.first else r.verdict
        source = r.source or ("backward" if r.phase == "backward" else "-")
        out.append((str(r.index), r.op, r.module, source, r.dtype or "-", _fmt(r.local), _fmt(r.budget),
                    _fmt(r.inherited), verdict))
    widths = [max(len(str(r[i])) for r in out) for i in range(len(header))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in out]


# --------------------------------------------------------------------------------------------
# where an op runs: module and source line


class _HookStack:
    """Module paths by forward hooks (the fallback of ``ModuleTracker``): a stack of the modules of
    ``root`` whose forward is running."""

    def __init__(self, root: torch.nn.Module, path: str):
        self.names = {m: _join(path, n) for n, m in root.named_modules()}
        self.stack: list[str] = []
        self.handles: list[Any] = []

    def __enter__(self) -> "_HookStack":
        for module, name in self.names.items():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave))
        return self

    def _enter(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self.stack.append(name)
        return hook

    def _leave(self, module: torch.nn.Module, args: tuple, output: Any) -> None:  # returns None: output unchanged
        if self.stack:
            self.stack.pop()

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def innermost(self) -> str | None:
        return self.stack[-1] if self.stack else None


class _Tracker:
    """The innermost running module's dotted path, from ``ModuleTracker`` where torch has it.

    ``ModuleTracker.parents`` holds the fully qualified names of the running modules, rooted at the
    class name of the first module it sees (the traced module: ``"LlamaAttention.q_proj"``); the
    innermost is the longest (they nest), rebased here on the traced module's display ``path``."""

    def __init__(self, root: torch.nn.Module, path: str):
        self.path = path
        self.root_name = type(root).__name__
        self.impl: Any = ModuleTracker() if ModuleTracker is not None else _HookStack(root, path)

    def __enter__(self) -> "_Tracker":
        self.impl.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.impl.__exit__(*exc)

    def innermost(self) -> str:
        if isinstance(self.impl, _HookStack):
            return self.impl.innermost() or self.path or f"<{self.root_name}>"
        running = [p for p in self.impl.parents if p != "Global"]
        inner = max(running, key=lambda p: p.count("."), default="")
        rel = inner.split(".", 1)[1] if "." in inner else ""
        return _join(self.path, rel) or f"<{self.root_name}>"


def _join(base: str, rel: str) -> str:
    return f"{base}.{rel}" if base and rel else base or rel


def _user_frame(stop: Any = None) -> str | None:
    """``"<file>:<line>: <code>"`` of the innermost Python frame outside torch, the standard library and
    this package (the model's line that issued the op). Where the op comes from a torch module's own
    forward called directly by the trace (an ``nn.LayerNorm`` traced alone), there is no such frame
    inside the call: then the innermost frame of ``torch/nn/modules`` other than ``module.py`` (the torch
    module's ``forward``: ``torch/nn/modules/normalization.py:…``).
    None when there is neither. The walk stops at ``trace_ops``'s frame, and at a frame running the
    code object ``stop`` (another recorder's entry point: ``op_stream.record_ops``)."""
    frame = sys._getframe(2)
    fallback = None
    while frame is not None and frame.f_code is not _TRACE_CODE and frame.f_code is not stop:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not (filename.startswith((_TORCH_DIR, _PACKAGE_DIR, _STDLIB_DIR)) or filename.startswith("<")):
            return _where(frame, filename)
        if fallback is None and filename.startswith(_TORCH_NN_MODULES) and filename != _TORCH_MODULE_PY:
            fallback = frame  # the torch module's forward (not functional.py below it, not Module.__call__)
        frame = frame.f_back
    return _where(fallback, os.path.abspath(fallback.f_code.co_filename)) if fallback is not None else None


@contextlib.contextmanager
def _anomaly_stacks() -> Iterator[None]:
    """``torch.autograd.detect_anomaly(check_nan=False)`` without its warning: each autograd node keeps
    the forward stack that created it (``Node.metadata["traceback_"]``); no value changes."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly(check_nan=False):
            yield


def _node_source() -> str | None:
    """``"backward of <file>:<line>: <code>"``: the forward line (outside torch, the standard library and
    this package) that created the autograd node whose backward is running, from its anomaly-mode stack;
    None where there is none (no current node, anomaly mode off, a torch without
    ``torch._C._current_autograd_node``). As in ``_user_frame``, the walk stops at ``trace_ops``'s frame:
    the frames above it are the caller's (the test's ``train_step`` line), not the traced call's."""
    current = getattr(torch._C, "_current_autograd_node", None)
    node = current() if current is not None else None
    stack = node.metadata.get("traceback_") if node is not None else None
    fallback = None
    for entry in reversed(stack or []):
        m = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', entry)
        if m is None:
            continue
        filename = os.path.abspath(m.group(1))
        if filename == _TRACE_FILE and m.group(3) == _TRACE_CODE.co_name:
            break
        if filename.startswith((_TORCH_DIR, _PACKAGE_DIR, _STDLIB_DIR)) or m.group(1).startswith("<"):
            if fallback is None and filename.startswith(_TORCH_NN_MODULES) and filename != _TORCH_MODULE_PY:
                fallback = (m.group(1), int(m.group(2)), filename)  # a torch module's forward (as _user_frame)
            continue
        return "backward of " + _where(_FrameLike(m.group(1), int(m.group(2))), filename)
    return "backward of " + _where(_FrameLike(*fallback[:2]), fallback[2]) if fallback is not None else None


@dataclass
class _FrameLike:
    """What ``_where`` reads of a frame, for a line of a recorded stack."""

    co_filename: str
    f_lineno: int

    @property
    def f_code(self) -> Any:
        return self


def _where(frame: Any, filename: str) -> str:
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    if filename.startswith(_TORCH_DIR):
        shown = "torch" + os.sep + filename[len(_TORCH_DIR):]
    elif filename.startswith(os.getcwd() + os.sep):
        shown = os.path.relpath(filename)
    else:
        shown = os.sep.join(filename.split(os.sep)[-3:])
    code = code if len(code) <= 70 else code[:67] + "..."
    return f"{shown}:{frame.f_lineno}: {code}"


# --------------------------------------------------------------------------------------------
# the golden and the chain


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t`` (a fresh tensor, never ``t`` itself), floating ones in float64, complex in complex128."""
    t = t.detach()
    if t.is_complex():
        return t.to("cpu", torch.complex128, copy=True)
    if t.is_floating_point():
        return t.to("cpu", torch.float64, copy=True)
    return t.to("cpu", copy=True)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype.is_complex else torch.float64


def _cpu_args(obj: Any, tensors: dict[int, torch.Tensor], widen: bool) -> Any:
    """``obj`` (an op's args/kwargs) for a CPU float64 run: each tensor replaced by ``tensors[id]``,
    a device by the CPU and, with ``widen`` (the chain), a floating dtype argument by float64."""
    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return tensors[id(x)]
        if isinstance(x, torch.device):
            return torch.device("cpu")
        if widen and isinstance(x, torch.dtype) and (x.is_floating_point or x.is_complex):
            return _wide(x)
        return x
    return tree_map(convert, obj)


def _unhalve(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``half_to_float`` (``_softmax``, ``_log_softmax``) is for a half input only: off for float64."""
    names = [a.name for a in func._schema.arguments]
    if "half_to_float" not in names:
        return args, kwargs
    i = names.index("half_to_float")
    if i < len(args):
        args = args[:i] + (False,) + args[i + 1:]
    elif "half_to_float" in kwargs:
        kwargs = dict(kwargs, half_to_float=False)
    return args, kwargs


def _exotic(t: torch.Tensor) -> bool:
    """A nested or non-strided (sparse) tensor: no plain elementwise comparison."""
    return bool(getattr(t, "is_nested", False)) or t.layout != torch.strided


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]


def relative_error(target: torch.Tensor, golden: torch.Tensor) -> float:
    """``max|target − golden| / max|golden|`` over the ordinary elements, with the exceptions below.

    * Non-finite elements (the golden rounded to the target's dtype decides, so an overflow in the
      target's dtype matches): a non-finite element must be the same value on both sides (NaN matches
      NaN), else the error is infinite.
    * Elements at the dtype's extremes, ``|golden| ≥ finfo(dtype).max / 2`` (masking sentinels such
      as ``finfo(float32).min`` added to attention scores), are judged elementwise,
      ``|target − golden| / |golden|``, and left out of the scale, which they would otherwise set to
      ~3e38 and so hide every other error.
    * Integer and bool tensors: 0.0 when equal, else infinite; other shapes: infinite.

    The denominator is at least the dtype's smallest normal number (an all-zero golden).

    Args:
        target: the op's output (any device, any dtype).
        golden: the float64 (complex128) CPU result, or an integer/bool one.
    """
    t = target.detach().to("cpu")
    if tuple(t.shape) != tuple(golden.shape):
        return math.inf
    if not (t.is_floating_point() or t.is_complex()):
        try:
            return 0.0 if torch.equal(t, golden.to(t.dtype)) else math.inf
        except (RuntimeError, TypeError):
            return math.inf
    if t.numel() == 0:
        return 0.0
    wide = _wide(t.dtype)
    g = golden.to(wide)
    rounded = g.to(t.dtype)
    bad_t, bad_g = ~torch.isfinite(t), ~torch.isfinite(rounded)
    if bool((bad_t | bad_g).any()):
        same = bad_t & bad_g & ((t == rounded) | (torch.isnan(t) & torch.isnan(rounded)))
        if bool(((bad_t | bad_g) & ~same).any()):
            return math.inf
        finite = ~(bad_t | bad_g)
        if not bool(finite.any()):
            return 0.0
        t, g = t[finite], g[finite]
    return _scaled_error(t.to(wide), g, float(torch.finfo(t.dtype).max) / 2, float(torch.finfo(t.dtype).tiny))


def _scaled_error(value: torch.Tensor, reference: torch.Tensor, extreme: float, tiny: float) -> float:
    """``max|value − reference| / max|reference|`` over the elements with ``|reference| < extreme``,
    and ``|value − reference| / |reference|`` for the others (``relative_error``)."""
    diff = (value - reference).abs()
    size = reference.abs()
    big = size >= extreme
    if bool(big.any()):
        worst_big = float((diff[big] / size[big]).max())
        diff, size = diff[~big], size[~big]
    else:
        worst_big = 0.0
    if diff.numel() == 0:
        return worst_big
    return max(worst_big, float(diff.max()) / max(float(size.max()), tiny))


def _distance(value: torch.Tensor, chain: torch.Tensor, dtype: torch.dtype) -> float | None:
    """Relative distance of an (upcast) input from its chain value (as ``relative_error``, finite
    elements only; ``dtype``: the input's own dtype, for its extremes), or None for a non-floating one."""
    if not (value.is_floating_point() or value.is_complex()) or value.shape != chain.shape:
        return None
    if value.numel() == 0:
        return 0.0
    both = torch.isfinite(value) & torch.isfinite(chain)
    if not bool(both.any()):
        return 0.0
    info = torch.finfo(dtype)
    return _scaled_error(value[both], chain[both].to(value.dtype), float(info.max) / 2, float(info.tiny))


@contextlib.contextmanager
def _plain_cpu() -> Iterator[None]:
    """What a golden runs under: no dispatch mode, no autocast on the CPU, no autograd."""
    with _disable_current_modes(), torch.autocast("cpu", enabled=False), torch.no_grad():
        yield


def _why_not(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why an op is not compared before it runs (random, uninitialized, view), or None."""
    name = str(func.overloadpacket)
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        names = [a.name for a in func._schema.arguments]
        dropout = (args[names.index("dropout_p")] if "dropout_p" in names and names.index("dropout_p") < len(args)
                   else kwargs.get("dropout_p", None if "dropout_p" not in names else 0.0))
        if dropout is None or dropout != 0:  # attention with dropout_p = 0 draws nothing
            return "random"
    if name in _UNINITIALIZED:
        return "uninitialized memory"
    if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        return "view (computes nothing)"
    return None


class _State:
    """What one trace accumulates (shared by its dispatch mode)."""

    def __init__(self, tracker: _Tracker, trace: OpTrace, precision: torch.dtype | None, deadline: float | None,
                 max_ops: int):
        self.tracker, self.trace, self.precision = tracker, trace, precision
        self.deadline, self.max_ops = deadline, max_ops
        self.chain: WeakIdKeyDictionary = WeakIdKeyDictionary()  # target tensor -> its float64 chain value
        self.stopped: str | None = None
        self.backward = False  # inside trace_ops' ``backward`` call

    def skip(self, name: str, why: str) -> None:
        self.trace.not_compared[why] += 1
        examples = self.trace.examples.setdefault(why, [])
        if name not in examples and len(examples) < 3:
            examples.append(name)


class _OpTracer(TorchDispatchMode):
    """The dispatch mode of ``trace_ops``: runs each op, then its golden and its chain (module doc)."""

    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        st = self.state
        st.trace.ops += 1
        name = str(func.overloadpacket)
        if st.stopped is None:
            if len(st.trace.rows) >= st.max_ops:
                st.stopped = f"past the limit of {st.max_ops} ops"
                st.trace.notes.append(f"ops after the first {st.max_ops} were run but not compared")
            elif st.deadline is not None and time.perf_counter() >= st.deadline:
                st.stopped = "past the localization budget"
                st.trace.notes.append(f"the localization budget ran out after {len(st.trace.rows)} ops: the later "
                                      "ops were run but not compared")
        if st.stopped is not None:
            st.skip(name, st.stopped)
            return func(*args, **kwargs)
        if st.backward:
            row = OpRow(len(st.trace.rows), name, func._overloadname, current_module() or st.tracker.innermost(),
                        _node_source(), phase="backward")
        else:
            row = OpRow(len(st.trace.rows), name, func._overloadname, st.tracker.innermost(), _user_frame())
        st.trace.rows.append(row)
        inputs = _tensors((args, kwargs))
        why = "nested or sparse tensor" if any(_exotic(t) for t in inputs) else _why_not(func, args, kwargs)
        copies: dict[int, torch.Tensor] = {}
        if why is None:
            with _plain_cpu():
                for t in inputs:  # before the op runs: an in-place op overwrites its input
                    if id(t) not in copies:
                        copies[id(t)] = _upcast(t)
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        if why is None and not outputs:
            why = "no tensor output"
        elif why is None and any(_exotic(t) for t in outputs):
            why = "nested or sparse tensor"
        with _plain_cpu():
            if why is not None:
                row.why = why
                st.skip(name, why)
                self._follow(func, args, kwargs, out, copies, view=why.startswith("view"))
                return out
            try:
                gargs, gkwargs = _unhalve(func, *_cpu_args((args, kwargs), copies, widen=False))
                golden = func(*gargs, **gkwargs)
            except Exception as exc:  # noqa: BLE001 - a device-only op, a dtype the CPU lacks: listed, not compared
                row.why = why = f"fails on CPU ({type(exc).__name__})"
                st.skip(name, why)
                self._follow(func, args, kwargs, out, copies, view=False)
                return out
            self._judge(row, outputs, _tensors(golden))
            row.inherited = self._chain(func, args, kwargs, out, copies, golden)
        return out

    def _judge(self, row: OpRow, outputs: list[torch.Tensor], goldens: list[torch.Tensor]) -> None:
        """Local error of the worst output (largest error relative to its dtype's budget)."""
        worst: tuple[float, float, float, torch.dtype] | None = None
        for t, g in zip(outputs, goldens):
            err = relative_error(t, g) if len(outputs) == len(goldens) else math.inf
            budget = op_budget(t.dtype)
            ratio = (0.0 if err == 0 else math.inf) if budget == 0 else err / budget
            if math.isnan(ratio):
                ratio = math.inf
            if worst is None or ratio > worst[0]:
                worst = (ratio, err, budget, t.dtype)
        assert worst is not None
        _, row.local, row.budget, dtype = worst
        row.dtype = str(dtype).removeprefix("torch.")
        st = self.state
        precision_budget = op_budget(st.precision) if st.precision is not None else None
        row.precision_budget = precision_budget
        if precision_budget is not None and precision_budget > row.budget:
            row.budget = precision_budget  # a float32 op in a bf16 check: judged at the check's precision
        if row.local > row.budget or math.isnan(row.local):
            row.verdict = "local"
        elif precision_budget is not None and precision_budget < row.budget and row.local > precision_budget:
            row.verdict = "precision"
        else:
            row.verdict = "ok"

    def _chain(self, func: Any, args: tuple, kwargs: dict, out: Any, copies: dict[int, torch.Tensor],
               golden: Any) -> float | None:
        """Run the op on its inputs' chain values (float64 throughout); keep the chain values of its
        outputs; return the inputs' worst distance from their chain (None: no floating input)."""
        chain_inputs = dict(copies)
        distance: float | None = None
        moved = False
        for t in _tensors((args, kwargs)):
            value = self.state.chain.get(t)
            if value is not None and id(t) in copies:
                chain_inputs[id(t)] = value
                moved = True
                d = _distance(copies[id(t)], value, t.dtype)
                if d is not None:
                    distance = d if distance is None else max(distance, d)
            elif distance is None and id(t) in copies and (t.is_floating_point() or t.is_complex()):
                distance = 0.0
        widens = any(isinstance(x, torch.dtype) and (x.is_floating_point or x.is_complex) and x not in (
            torch.float64, torch.complex128) for x in tree_flatten((args, kwargs))[0])
        if moved or widens:
            try:
                cargs, ckwargs = _unhalve(func, *_cpu_args((args, kwargs), chain_inputs, widen=True))
                chained = func(*cargs, **ckwargs)
            except Exception:  # noqa: BLE001 - the chain goes on from the target's result
                chained = None
        else:
            chained = golden
        self._keep(out, chained)
        return distance

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any, copies: dict[int, torch.Tensor],
                view: bool) -> None:
        """Carry the chain past an op that is not compared: a view is applied to its input's chain
        value; anything else continues from the target's result (a random op: the same draws)."""
        chained = None
        tensors = _tensors((args, kwargs))
        if view and not any(_exotic(t) for t in tensors) and any(self.state.chain.get(t) is not None for t in tensors):
            inputs = {}
            for t in tensors:
                value = self.state.chain.get(t)
                inputs[id(t)] = value if value is not None else _upcast(t)
            try:
                chained = func(*_cpu_args(args, inputs, widen=False), **_cpu_args(kwargs, inputs, widen=False))
            except Exception:  # noqa: BLE001 - e.g. a bitcast view of a float64 value: continue from the target
                chained = None
        self._keep(out, chained)

    def _keep(self, out: Any, chained: Any) -> None:
        outputs = _tensors(out)
        values = _tensors(chained) if chained is not None else []
        for i, t in enumerate(outputs):
            if _exotic(t):
                continue
            value = values[i] if len(values) == len(outputs) else None
            if value is None or _exotic(value) or tuple(value.shape) != tuple(t.shape):
                value = _upcast(t)
            self.state.chain[t] = value


def trace_ops(module: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, *,
              device: torch.device | str, recipe: Any = None, path: str = "", enter_recipe: bool = True,
              deadline: float | None = None, max_ops: int = MAX_OPS,
              backward: Callable[[Any], Any] | None = None) -> OpTrace:
    """Run ``module(*args, **kwargs)`` once on ``device`` with every op compared to its float64 golden
    (module doc) and name the first culprit op.

    With ``backward``, ``backward(output)`` is called next inside the same trace (e.g. a
    ``torch.autograd.grad`` through the call): its ops — the call's backward kernels — are compared the
    same way, with ``phase`` ``backward``, the module whose forward created the op's autograd node
    (``node_modules``; else the path ``ModuleTracker`` gives in the backward), and
    as source the forward line that created the op's autograd node (``_node_source``: the forward and
    the backward run under ``torch.autograd.detect_anomaly(check_nan=False)``, which records each node's
    forward stack; it changes no value). Its result is ``OpTrace.backward_output``.

    Args:
        module: the module to trace, already on ``device`` (a target's placed copy).
        args, kwargs: the inputs of the call (tensors on ``device``; any nesting).
        device: the target device the module runs on (for the recipe and the message).
        recipe: the check's ``recipes.Recipe`` (its precision decides the ``precision`` verdict), or None.
        path: the module's display path (``blocks.2.attn``); "" names it ``<Type>``.
        enter_recipe: run under ``recipe.context(device)``; False where the caller already runs under
            it (``localize``: the target's patch set, random stream and grad/autocast state).
        deadline: ``time.perf_counter()`` value after which ops are no longer compared (they still run).
        max_ops: ops compared at most (``MAX_OPS``).

    Returns:
        An ``OpTrace``: ``output`` is exactly what the module returned.

    Raises:
        ValueError: ``max_ops`` below 1.
        Whatever the module's forward raises.
    """
    if max_ops < 1:
        raise ValueError(f"max_ops={max_ops!r}: give at least 1 op to compare")
    kwargs = dict(kwargs or {})
    device = torch.device(device)
    precision = recipe_precision(recipe)
    trace = OpTrace(path or f"<{type(module).__name__}>", type(module).__name__, str(device),
                    str(precision).removeprefix("torch.") if precision is not None else None)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if recipe is not None and enter_recipe:
            stack.enter_context(recipe.context(device))
        tracker = stack.enter_context(_Tracker(module, path))
        state = _State(tracker, trace, precision, deadline, max_ops)
        if backward is not None:
            stack.enter_context(_anomaly_stacks())
            stack.enter_context(NodeModules(tracker.innermost))
        stack.enter_context(_OpTracer(state))
        trace.output = module(*args, **kwargs)
        if backward is not None:
            state.backward = True
            trace.backward_output = backward(trace.output)
    trace.seconds = time.perf_counter() - start
    culprits = [r for r in trace.rows if r.verdict in _VERDICT_ORDER]
    if culprits:
        trace.first = min(culprits, key=lambda r: (_VERDICT_ORDER[r.verdict], r.index))
        trace.first.first = True
    return trace


_TRACE_CODE = trace_ops.__code__  # where the frame walk of ``_user_frame`` stops: the traced call's caller
_TRACE_FILE = os.path.abspath(_TRACE_CODE.co_filename)  # and that of ``_node_source`` (a recorded stack's file)

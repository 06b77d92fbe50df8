"""Device-propagation audit: what one run on the target did across the host/device boundary.

A port to an accelerator rarely fails with a wrong number; it fails with a tensor on the wrong
device: a mask or constant built on the CPU inside ``forward``, a hard-coded ``.cuda()`` or
``.to(0)``, a float64 constant reaching a device without fp64, an op that runs on the CPU, a host
sync in a hot path. :class:`DeviceAudit` records, for one run, every

==================  ===========================================================================
kind                what is recorded
==================  ===========================================================================
``mixed_device``    an op whose tensor arguments span two devices (0-dim CPU tensors aside, as
                    PyTorch allows them anywhere); also a copy between two different
                    accelerator devices (``cuda:1`` → ``cuda:0``)
``h2d``             a host→device copy (``.to(device)``, ``.cuda()``, ``copy_``, a CPU index
                    tensor used to index a device tensor)
``d2h``             a device→host copy (``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``.numpy()``);
                    a blocking copy is a host sync too, it is counted here only
``host_sync``       an op whose result the host must wait for: ``.item()``/``bool()``/``int()``
                    (``aten::_local_scalar_dense``), ``torch.equal``, and ops with a
                    data-dependent output shape (``nonzero``, ``masked_select``, boolean-mask
                    indexing, ``unique`` …) — PyTorch's own op tags ``data_dependent_output`` and
                    ``dynamic_output_shape`` (``native_functions.yaml``) select them
``cpu_fallback``    an op that ran on the CPU while the module runs on the target (all its
                    tensors on the host, at least one not 0-dim: a constant built on the host
                    inside ``forward``); an op with target inputs and a CPU output; an op the
                    caller declared unsupported on the target (``unsupported_ops``) running on
                    target tensors
``fp64``            an op with a float64/complex128 tensor on the target (NPUs have no fp64:
                    ``transfer_to_npu`` downcasts it to fp32 silently)
==================  ===========================================================================

Each event carries the op, the devices, the dtype, a count, and the source line that caused it:
the innermost Python frame outside ``torch``, ``einops`` and this package's engine modules
(``file:line`` and the code text), so a message reads::

    mixed-device op aten::add.Tensor: cuda:1 + cpu at /path/model.py:42  return x + torch.ones(n)

Budgets: what a check may do
----------------------------
:class:`AuditBudget` says how many events of each kind a run may have (:data:`DEFAULT_AUDIT_BUDGET`:
no mixed-device op, no host<->device copy, no CPU op, no float64 on the target; host syncs counted
but allowed); :meth:`AuditBudget.judge` turns a record into the message of the events beyond it,
with the budget that would pass. The plugin's ``--parity-audit`` judges every audited check by its
budget (``parse_audit_budget`` specs from a suite's ``parity_audit_budget`` fixture,
``@pytest.mark.parity(audit_budget=...)`` and ``parity.check(audit_budget=...)``) and fails it or
warns (:class:`ParityAuditWarning`). The plugin's own work inside a run is never the model's:
:func:`not_audited` keeps tensors tracked and records nothing (the shared random stream's CPU
draws of dropout masks and their copy to the device, a training step's gradient clipping and
optimizer step).

Two modes behind one API
------------------------
*Real-device mode* (the target exists here, e.g. ``npu:0`` with torch_npu or ``cuda:0``): the
module runs on the target under a ``TorchDispatchMode`` that sees every ATen op with its real
tensors and devices. Python-level host syncs reach dispatch as ATen ops too (``.item()`` is
``_local_scalar_dense``, ``.cpu()``/``.tolist()`` are ``_to_copy``; ``.numpy()`` of a device
tensor raises by itself), so no ``TorchFunctionMode`` is needed. A dispatch mode leaves PyTorch's
``has_torch_function`` guards alone, so the audited run takes the same kernels (for example the
``nn.TransformerEncoderLayer`` fast path) as an unaudited one. A mixed-device op is recorded before
it runs, so it is in the record even though the real op then raises.

*Logical-device mode* (CPU-only machines): the target is a *logical* device such as ``cuda:1`` while
every tensor stays a real CPU tensor, so the run is numerically a CPU run on real data, including
the data-dependent parts. A side table keyed by tensor identity (weak references, so it keeps
no tensor alive) records which tensors live on which logical device; tensors absent from it
are on the host. The dispatch mode propagates the marks (an op's outputs live where its inputs
live) and classifies ops with the same rules as real-device mode. A ``TorchFunctionMode`` handles
what happens before dispatch: ``tensor.device``/``is_cuda``/``get_device()`` report the logical
device (upstream code such as ``causal_attention_mask(n).to(x.device)`` or
``torch.arange(n, device=x.device)`` must see it); a factory call with ``device=<accelerator>``
runs on the CPU and its result is marked (the call must be rewritten before PyTorch's Python
binding, which initializes CUDA for ``device="cuda"`` and fails without a driver);
``.to()``/``.cuda()``/``.cpu()`` copy between host and logical devices; ``.numpy()``/``.tolist()``
of a logical tensor are recorded as device→host copies (``.numpy()`` of a device tensor raises on
a real target: call ``.cpu()`` first).

Why not the alternatives:

* ``FakeTensorMode`` (docs/explanation/findings.md, "Devices without hardware") runs a model on a fake ``cuda``
  device on this CPU-only machine, but shape-only: it stops at the first data-dependent op
  (``DataDependentOutputException`` in the retriever's ``TransformerEncoder`` mask check;
  ``.numpy() is not supported for tensor subclasses`` in ``_period_search``) — exactly the host
  syncs this audit must report — and it raises at the first mixed-device op instead of recording
  all of them.
* A wrapper tensor subclass (``_make_wrapper_subclass`` reporting the logical device) needs the
  same function mode for factories and ``.cuda()`` (CUDA is initialized before dispatch), needs
  care for in-place metadata ops (``unsqueeze_`` on a wrapper must also resize the wrapper) and
  refuses ``.numpy()``; the side table keeps plain CPU tensors, so every kernel and every view is
  the CPU's own.

Numerics: real-device mode changes nothing. In logical mode the active ``TorchFunctionMode``
makes ``torch.overrides.has_torch_function`` true, so ``nn.MultiheadAttention`` and
``nn.TransformerEncoderLayer`` skip their inference fast path (as they do under any function mode
or tensor subclass); outputs are bitwise those of a plain CPU run with
``torch.backends.mha.set_fastpath_enabled(False)`` and otherwise of a plain CPU run (the fast path
differs by about 2e-7 on Aurora's retriever, measured).

Backward in logical mode: autograd's backward formulas run in C++ and pass the tensors' *real*
device (the CPU) to the ops they call (``grad.new_zeros(sizes, self.options())``); inside a
backward (``torch._C._current_autograd_node()`` set) an explicit CPU device means the device of the
op's tensor arguments, or the target for a factory, so a clean model's training step reports nothing.

Model of devices in logical mode: ``device="cuda"`` without an index and ``.cuda()`` mean index 0
(PyTorch's default current device); ``.to(i)`` with an integer means index ``i`` of the target's
device type. Pick a logical target with a non-zero index (:data:`DEFAULT_LOGICAL_TARGET` is
``cuda:1``) and hard-coded devices show up as a second device in mixed-device ops. ``npu`` cannot
be a logical target without torch_npu (``torch.device("npu")`` does not parse then); the rules
are device-type independent, so ``cuda:1`` stands in for it. "CPU fallback" in logical mode means
host-side ops during the run and ops named in ``unsupported_ops`` on target tensors (a logical
device cannot fall back by itself). Not modelled: ``torch.cuda.*`` runtime calls
(``torch.cuda.is_available()`` stays False inside the run), ``torch.Generator(device=...)``,
legacy typed constructors (``torch.cuda.FloatTensor``) — they behave as without the audit — and
``torch.autocast`` for the logical device type, which does not touch the CPU tensors (use CPU
autocast for a bf16 recipe in logical mode).

Cost: nothing unless an audit runs (no hook stays installed). The audit adds Python work per op,
so the ratio depends on op size. Logical mode, eval forward, 2-core CPU, one thread, measured: an
Aurora with ViT-base/BERT-base-sized encoders (hidden 64) 1.3–1.5× a plain CPU forward; the
project's tiny Aurora (1.2 M parameters, ~1 200 small ops) about 5.5×, of which PyTorch's own
mode dispatch (a no-op dispatch mode plus a no-op function mode) is 2.5×
(``tests/diagnose/test_audit.py::test_audit_overhead_is_bounded`` prints the ratio).

Usage::

    audit = DeviceAudit("cuda:1")            # logical on a CPU-only machine, real where it exists
    model, x = audit.to_target(model), audit.to_target(x)
    out = audit.run(model, x)                # or: with audit: out = model(x)
    print(audit.record.format())
    audit.record.assert_clean({"h2d": 2})    # DevicePropagationError lists what is unexpected

    out, record = audit_call(model, (x,), target="cuda:1")   # the same in one call

Where things are: ``events`` (the kinds, ``AuditEvent``, ``AuditRecord``), ``budget``
(``AuditBudget``, ``parse_audit_budget``, the modes and hints), ``source`` (``caller_source`` and
which frames are the engine's own), ``state`` (``not_audited`` and the logical devices' table, the
only home of that state), ``devices`` (a target's parsing and the op arguments' tensors), ``tracker``
(op facts, the tracker, the handlers and the dispatch/function modes) and ``run`` (``DeviceAudit``,
``audit_call``).
"""
from __future__ import annotations

from .budget import (  # noqa: F401
    _ANY, _FIX_HINTS, AUDIT_MODES, DEFAULT_AUDIT_BUDGET, AuditBudget, ParityAuditWarning, _budget_limit,
    _with_short_source, parse_audit_budget,
)
from .devices import (  # noqa: F401
    _FP64, _HOST, _current_autograd_node, _device_available, _main_dtype, _parse_device, _tensors, _with_index,
)
from .events import (  # noqa: F401
    _COPY_NOTE, _PHRASES, DEFAULT_LOGICAL_TARGET, KINDS, AuditEvent, AuditRecord, DevicePropagationError,
    _devices_text,
)
from .run import DeviceAudit, audit_call  # noqa: F401
from .source import (  # noqa: F401
    _ENGINE_DIR, _SKIPPED_DIRS, _SKIPPED_FILES, _internal_cache, _is_internal, _package_dir, caller_source,
)
from .state import _LOGICAL, _QUIET, _DeviceTable, not_audited  # noqa: F401
from .tracker import (  # noqa: F401
    _COPY_OPS, _INDEX_OPS, _NOT_COMPUTE, _SPECIAL, _SYNC_TAGS, _api_name, _AuditDispatchMode,
    _LogicalFunctionMode, _op_cache, _op_info, _OpInfo, _Tracker,
)

__all__ = [
    "AUDIT_MODES", "DEFAULT_AUDIT_BUDGET", "DEFAULT_LOGICAL_TARGET", "KINDS", "AuditBudget", "AuditEvent",
    "AuditRecord", "DeviceAudit", "DevicePropagationError", "ParityAuditWarning", "audit_call", "caller_source",
    "not_audited", "parse_audit_budget",
]

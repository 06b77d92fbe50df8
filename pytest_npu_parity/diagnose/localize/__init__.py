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
train step whose forward agrees. The same traced call records the target's op stream, the module's
call runs once more on the reference side from the same inputs to record its stream, and the two are
aligned (``op_stream.compare_streams``): the message names the first op the target inserts, removes,
replaces or runs with other dtypes (``Localization.op_stream``; ``kind: "op_stream"`` rows of
``localization_ops``), or says that the same ops run and the difference is in their values.

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

The backward pass, layer by layer (``backward.backward_table``; ``Localization.backward``, the
report's ``localization_backward``): where a train step's gradients are out of tolerance, both sides
run the step's forward and backward once more, tensor hooks catching the gradient w.r.t. each module
call's output, and each call (the step's module and two levels below) is re-run alone to get its
parameter gradients and the gradient it passes on: *inherited* (its grad_output, target vs
reference), *total* (its param grads and grad_input) and *local* (the target's call on the
reference's inputs and grad_output). The first call in backward order with a local error is the
layer whose backward differs, not the first layer whose gradient inherits it.

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

from ...budgets import DEFAULT_BUDGET_S  # noqa: F401  (the default of Localizer; also localize.DEFAULT_BUDGET_S)
from .cache import LocalizationCache, _Answer, _LevelView, _join, _patch_key, _relative  # noqa: F401
from .descent import (  # noqa: F401
    CONTEXT_ROWS, MAX_LEVELS, MAX_LOCAL_RUNS, _conclude, _conversion_notes, _gradients, _judge_level, _Level,
    _owner, _scope_key, _state, _trace_culprit, failure_hook, localize, structural_problem,
)
from .backward import BACKWARD_DEPTH, MAX_BACKWARD_CALLS, backward_table, grad_pass  # noqa: F401
from .hook import COST_FACTOR, Localizer  # noqa: F401
from .record import Localization, Site, _buffer_table, _fmt, _gradient_table, _num, _site_table  # noqa: F401
from .sides import (  # noqa: F401
    RECORD_DEPTH, _Call, _cpu_copy, _detached_cpu, _mode_state, _plain, _rebuild, _Recorder, _rng_state, _same,
    _set_rng_state, _Side, _snapshot, _State, _to_device, _View, _worst, comparable, output_leaves,
)

__all__ = [
    "BACKWARD_DEPTH", "COST_FACTOR", "CONTEXT_ROWS", "DEFAULT_BUDGET_S", "MAX_LEVELS", "MAX_LOCAL_RUNS", "RECORD_DEPTH",
    "Localization", "LocalizationCache", "Localizer", "Site", "comparable", "failure_hook", "localize",
    "output_leaves", "structural_problem",
]

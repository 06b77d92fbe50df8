"""A repro to hand over to an op owner: the failing piece of a check, its inputs and expected outputs.

For a check out of tolerance, ``ReproWriter`` (a ``ParitySession`` failure hook placed after the
``localize.Localizer``; the plugin's ``--parity-repro DIR``) writes ``DIR/<test id>/<check>/``:

* ``inputs.safetensors`` — the inputs of the *culprit* exactly as the target received them (detached
  CPU copies taken in a run of the check on the target, under its patch set, recipe and random
  stream): the culprit is the op the op trace named (``Localization.op_trace``, a ``local`` verdict:
  a kernel that misses its dtype's accuracy), else the first diverging submodule of the localization,
  else the check's whole module;
* ``weights.safetensors`` — for a module culprit, its ``state_dict`` as the reference ran it (the
  model's own weights, not a target-side edit of them);
* ``expected.safetensors`` — the reference's outputs of that piece *on those same inputs* (a CPU run
  without the patch set: for a module, the module; for an op, the op in its own dtype) plus, for an
  op, its float64 golden (``golden.<leaf>``, the op re-run on float64 copies of its inputs, as the
  op trace judges it). Because the reference runs on the target's inputs, the repro measures the
  piece's own (local) error, not what it inherited from earlier layers;
* ``actual.safetensors`` — the target's own outputs of the piece in that run (the recorded verdict);
* ``repro.py`` — a standalone script (``repro.script.SCRIPT``; torch only) that replays the piece on
  ``--device`` and prints (a) the stored target outputs vs expected and (b) the piece re-run vs
  expected, with the project's metrics and the check's tolerance; exit code 1 on a mismatch of (b);
* ``README.md`` — what failed, the commands, the tolerance, the culprit and why it was chosen, the
  provenance (torch version, target, recipe), the verdict of the script's replay on the CPU while the
  repro was written (a FAIL there: the replayed computation itself differs, its code or what it asks
  for, not a device kernel), and anything the repro cannot reproduce.

How the piece is replayed (``spec["mode"]``):

* ``module`` — rebuilt from ``type(m).__module__`` and ``__qualname__`` with constructor arguments
  read off the instance (``_constructor_kwargs``: every ``__init__`` parameter found as an attribute
  of the same name holding a literal; a tensor-or-None attribute for a boolean parameter, such as
  ``Linear.bias``, becomes ``bias is not None``), ``load_state_dict(strict=True, assign=True)``, run
  under the recipe's autocast. The rebuild is accepted only when the target dispatched the same ops
  in its call as the reference module did (a patch set that swaps the module's code — a fused device
  attention, a softmax moved to float16 — makes the target run something the class does not), and
  when the generated script itself, run here on the CPU, reproduces the reference's outputs bitwise
  (``_verify``), so the arguments found are the ones it was built with;
* ``ops`` — otherwise (a class defined inside a function, a constructor argument that is not a
  literal, a patch set that changes the module's ops, a rebuild that computes something else, an op
  culprit): the aten ops of the piece's call
  recorded under a ``TorchDispatchMode`` and replayed one by one as
  ``torch.ops.<namespace>.<op>.<overload>``; tensors an op did not get from an earlier op are stored
  (the call's inputs as ``args.<i>``/``kwargs.<name>``, the module's parameters and buffers by name
  in ``weights.safetensors``, anything else as ``const.<n>``, copied before the op runs). This always
  replays what the target was asked to compute; the README of a module that could not be rebuilt
  says why.

Cost: one more run of the check on the target (hooks only on the culprit; the dispatch mode only
inside its call) and one CPU run of the culprit, plus writing the tensors; see
docs/how-to/localize-failure.md for the measured numbers. Checks that pass never reach it.

Not replayed: train steps, checks of free functions and of bound methods (``generate``) without a
diverging submodule, and pieces whose inputs or weights exceed ``max_bytes``; the failure message
then says why. Files are written to a temporary folder next to the final one and renamed into
place, so a reader never sees half a repro.
"""
from __future__ import annotations

from .culprit import DEFAULT_MAX_BYTES, MAX_NAME, MAX_OPS, Culprit, ReproUnsupported, choose_culprit, repro_dir, sanitize
from .writer import ReproWriter, _script_namespace, script_text

__all__ = ["DEFAULT_MAX_BYTES", "MAX_NAME", "MAX_OPS", "Culprit", "ReproUnsupported", "ReproWriter", "choose_culprit",
           "repro_dir", "sanitize", "script_text"]

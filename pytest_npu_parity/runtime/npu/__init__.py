"""Safe detection of torch_npu and CANN, and the NPU compat layer.

Half of a failed NPU port is the environment. This package finds out, without crashing, whether the
Ascend stack (CANN toolkit + torch_npu + a visible NPU) is usable in this process, and turns every
known failure into one sentence that names the fix. The plugin's ``--parity-device npu`` error and
the ``doctor`` command print the same sentences.

Nothing here imports ``torch_npu`` unless it is installed (``importlib.util.find_spec``), and
``torch`` itself is imported lazily: installing torch_npu on a machine without CANN breaks
``import torch`` (device-backend autoload), and this package must still be able to say so.

One module per question:

* ``versions`` — the documented CANN ↔ torch ↔ torch_npu triples (``VERSION_MATRIX``) and what
  contradicts them (``check_version_matrix``, ``matrix_notes``);
* ``cann`` — where the CANN toolkit is and its release (``find_cann``), and the ``set_env.sh`` clause
  of every fix (``set_env_fix``); ``release`` — the two CANN layouts and torch_npu wheel generations;
* ``diagnosis`` — one sentence for a failed ``import torch`` / ``import torch_npu``
  (``explain_import_error``); ``troubleshoot`` — the guides' troubleshooting items, each recognised
  from distribution metadata and files (the diagnosis and the doctor report them);
* ``loading`` — ``import_torch``, the quarantine, ``prepare_torch`` and ``npu_status`` (the
  process-wide state: the cached status, the autoload switch, the quarantine's reason);
* ``launcher`` — the compat layer (``register_transfer_to_npu``, ``set_npu_options``,
  ``bind_device``, and ``launch``, which runs those three in the launcher's order;
  ``precision_flags``, ``dist_backend_for``), following the Aurora→Ascend adaptation guide (seed
  ``000_76a3155d974abf2f.txt``, §4.2 launcher steps ①–②, §7.3 HCCL, §9.4 compile mode);
* ``ops`` — ``probe_ops`` runs small ops on a device and compares them with the CPU; the doctor uses
  it, and ``needs_fft_fallback`` uses it to decide whether the patch set must run FFTs on the CPU.

The old module ``pytest_npu_parity.npu`` re-exports every name. To patch a name the code looks up,
patch it in the module above that reads it.
"""
from __future__ import annotations

from .cann import (
    DEFAULT_TOOLKIT_HOMES, SET_ENV_FIX, TOOLKIT_ENV_VARS, CannInfo, cann_missing_sentence, cann_version, find_cann,
    set_env_fix,
)
from .diagnosis import AUTOLOAD_ENV, explain_import_error, not_installed_sentence
from .launcher import (
    FP16_NPU_WARNING, LAUNCH_BEFORE, LaunchOrderError, LaunchRecord, bind_device, dist_backend_for, fp16_warning,
    launch, launched, precision_flags, register_transfer_to_npu, set_npu_options,
)
from .loading import (
    QUARANTINE_ENV, NpuStatus, import_torch, npu_status, prepare_torch, quarantine_torch_npu, quarantined,
)
from .ops import OPTIONAL_OPS, REQUIRED_OPS, OpProbe, OpSpec, needs_fft_fallback, probe_ops
from .versions import (
    SEED_ROW, VERSION_MATRIX, VersionRow, base_version, cann_release, check_version_matrix, documented_rows,
    matrix_notes, version_mismatch_sentence,
)

__all__ = [
    "AUTOLOAD_ENV", "DEFAULT_TOOLKIT_HOMES", "FP16_NPU_WARNING", "LAUNCH_BEFORE", "OPTIONAL_OPS", "QUARANTINE_ENV",
    "REQUIRED_OPS", "SEED_ROW", "SET_ENV_FIX", "TOOLKIT_ENV_VARS", "VERSION_MATRIX",
    "CannInfo", "LaunchOrderError", "LaunchRecord", "NpuStatus", "OpProbe", "OpSpec", "VersionRow",
    "base_version", "bind_device", "cann_missing_sentence", "cann_release", "cann_version", "check_version_matrix",
    "dist_backend_for", "documented_rows", "explain_import_error", "find_cann", "fp16_warning", "import_torch",
    "launch", "launched", "matrix_notes", "needs_fft_fallback", "not_installed_sentence", "npu_status",
    "precision_flags", "prepare_torch", "probe_ops", "quarantine_torch_npu", "quarantined",
    "register_transfer_to_npu", "set_env_fix", "set_npu_options", "version_mismatch_sentence",
]

"""Old import path of the NPU detection and compat layer. The code lives in
``pytest_npu_parity.runtime.npu``: ``versions`` (the version matrix), ``cann`` (the toolkit and
``set_env_fix``), ``diagnosis`` (the sentence for a failed import), ``loading`` (``import_torch``, the
quarantine, ``prepare_torch``, ``npu_status``), ``launcher`` (``launch``, ``bind_device``,
``precision_flags``, ``dist_backend_for``) and ``ops`` (``probe_ops``).

``from pytest_npu_parity.npu import launch, npu_status`` (and every other name this module had,
private helpers included) keeps working. The process-wide state (``_STATUS``, ``_AUTOLOAD_SUPPRESSED``,
``_QUARANTINED``, ``_LAUNCHED``) is read from its home when asked, so its value here is the current
one. To patch a name the code looks up (``DEFAULT_TOOLKIT_HOMES``, ``_dist_version``, ``npu_status``
…), patch it in the module that reads it: a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .runtime.npu import *  # noqa: F401,F403  (re-exported)
from .runtime.npu import cann as _cann
from .runtime.npu import diagnosis as _diagnosis
from .runtime.npu import launcher as _launcher
from .runtime.npu import loading as _loading
from .runtime.npu import ops as _ops
from .runtime.npu import release as ascend_release  # noqa: F401  (the name this module had)
from .runtime.npu import versions as _versions
from .runtime.npu.cann import (  # noqa: F401  (re-exported: the private names this module had)
    _looked_in, _read_install_info, _read_version_cfg, _toolkit_candidates, _version_files, _wanted_cann, logger,
)
from .runtime.npu.diagnosis import (  # noqa: F401
    _aarch64, _CANN_LIBS, _cpu_build_fix, _diagnose, _Diagnosis, _exception_chain, _first_line, _MATRIX_FIX,
    _SHARED_LIB, _torch_pin_of_torch_npu,
)
from .runtime.npu.launcher import _device_index, _DIST_BACKENDS, _parse_device_type  # noqa: F401
from .runtime.npu.loading import _autoload_enabled, _probe_status, _STATUS_LOCK, _torch_npu_autoloads  # noqa: F401
from .runtime.npu.ops import _as_real, _op_specs, _TOL_BF16, _TOL_ELEMENTWISE, _TOL_REDUCTION  # noqa: F401
from .runtime.npu.versions import (  # noqa: F401
    _ASCEND, _ASCEND_TABLE, _CANN_RELEASE, _dist_version, _find_spec, _plain_version, _RELEASE, _SEED, _suggest,
    _WHEEL_213, _WHEEL_214,
)
from . import troubleshoot  # noqa: F401  (the name this module had)


def __getattr__(name: str) -> Any:
    """Any other name of the modules above, looked up when asked, so a module-level value such as
    ``_STATUS`` or ``_LAUNCHED`` is the current one."""
    for module in (_loading, _launcher, _versions, _cann, _diagnosis, _ops):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

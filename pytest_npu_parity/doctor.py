"""Old import path of ``python -m pytest_npu_parity doctor``. The code lives in
``pytest_npu_parity.diagnose.doctor``: ``report`` (the sections' order, the JSON Schema,
``SectionResult``, ``DoctorContext``, ``render_text``), ``environment``, ``devices``
(``parse_npu_smi``), ``ops``, ``distributed`` (with the DeepSpeed section), ``precision`` and
``cli`` (``run_doctor``, ``main``).

``from pytest_npu_parity.doctor import run_doctor, SectionResult`` (and every other name this
module had, private helpers included) keeps working; ``SECTIONS`` and ``DOCTOR_JSON_SCHEMA`` are
still computed when read, and ``_SECTION_FUNCS`` is the very table ``run_doctor`` reads. To patch a
name the code looks up (``_build_context``, ``deepspeed_accelerator`` …), patch it in its new home:
a name set on this module is not seen there.
"""
from __future__ import annotations

from typing import Any

from .diagnose.doctor import cli as _cli
from .diagnose.doctor import devices as _devices
from .diagnose.doctor import distributed as _distributed
from .diagnose.doctor import environment as _environment
from .diagnose.doctor import ops as _ops
from .diagnose.doctor import precision as _precision
from .diagnose.doctor import report as _report
from .diagnose.doctor.cli import *  # noqa: F401,F403  (re-exported)
from .diagnose.doctor.devices import *  # noqa: F401,F403  (re-exported)
from .diagnose.doctor.distributed import *  # noqa: F401,F403  (re-exported)
from .diagnose.doctor.environment import *  # noqa: F401,F403  (re-exported)
from .diagnose.doctor.ops import *  # noqa: F401,F403  (re-exported)
from .diagnose.doctor.precision import *  # noqa: F401,F403  (re-exported)
from .diagnose.doctor.report import *  # noqa: F401,F403  (re-exported)
from .diagnose.doctor.cli import _SECTION_FUNCS, _build_context, _parser  # noqa: F401  (re-exported)
from .diagnose.doctor.report import _Context  # noqa: F401  (re-exported)


def __getattr__(name: str) -> Any:
    """``SECTIONS`` and ``DOCTOR_JSON_SCHEMA`` (computed when read, as ``report`` computes them) and any
    other name of the modules above (e.g. their private helpers)."""
    for module in (_report, _environment, _devices, _ops, _distributed, _precision, _cli):
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

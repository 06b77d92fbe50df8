"""``python -m pytest_npu_parity doctor`` (also ``npu-parity doctor``): check the environment first.

Half of a failed NPU port is the environment. Before any parity number is trusted, the doctor
runs the self-check of the Aurora→Ascend adaptation guide's ``verify_npu`` script (seed
``000_76a3155d974abf2f.txt`` §8.1: nine sections) plus the precision flags, against the target
device. Sections marked *adapter* come from the installed model adapters (``pytest_npu_parity.adapters``:
the Aurora adapter's are ``pytest_npu_parity.aurora.doctor_sections``); without one they are absent:

==================  ================================================================================
section             checks
==================  ================================================================================
``environment``     Python, torch, torch_npu, CANN (``version.cfg``), the adapters' lines (Aurora:
                    transformers, aurora-model); the CANN ↔ torch ↔ torch_npu version matrix
                    (``npu.VERSION_MATRIX``)
``devices``         the target (``--device``) and, for an NPU, the launcher steps done before any
                    import of aurora (``npu.launch``); visible NPUs / CUDA devices, ``ASCEND_RT_
                    VISIBLE_DEVICES``, ``npu-smi info`` (health, HBM), device memory
``required_ops``    linear, matmul, SDPA, layer_norm, softmax, … on the target vs the CPU
``optional_ops``    rfft/irfft, pinv, bf16 linear — the patch set can move FFT/pinv to the CPU
``patch_set``       *adapter* (Aurora): self-test of the patch set on a mini patch embedding
``aurora_smoke``    *adapter* (Aurora): the tiny Aurora config runs a forward on the target under
                    the patch set
``distributed``     gloo / nccl / hccl available; a 1-process ``init_process_group`` + all_reduce
``deepspeed``       installed? which build; the accelerator DeepSpeed picks and whether it will use
                    HCCL; ``--deepspeed-config FILE``: lint of the config (``deepspeed_config``)
``precision``       TF32 (CUDA) and HF32 (torch_npu) switches in force
==================  ================================================================================

Each section reports a status — ``ok``, ``warn`` (works, but read the note), ``fail`` or
``skip`` (not applicable here, e.g. "no NPU") — with details and fix sentences.

Exit codes: **0** no section failed (warn/skip allowed), **1** at least one section failed,
**2** usage error (bad option or device spec, a ``--deepspeed-config`` file that is missing or not
JSON).

Output: text for people, ``--json`` for CI; the JSON document validates against
``DOCTOR_JSON_SCHEMA`` (JSON Schema draft 2020-12).

Where things are: ``report`` (the sections' order, the JSON Schema, ``SectionResult``,
``DoctorContext``, ``render_text``), one module per group of sections (``environment``, ``devices``
with ``parse_npu_smi``, ``ops``, ``distributed`` with the DeepSpeed section, ``precision``), ``cli``
(``run_doctor``, ``main``); the guides' troubleshooting items it reports live low, in
``runtime.npu.troubleshoot`` (npu's import diagnosis reads them too).

Importing this package loads none of them: a name is looked up in its module when first read.
"""
from __future__ import annotations

import importlib
from typing import Any

#: The doctor's modules, searched in this order for a name read from the package.
_MODULES = ("report", "environment", "devices", "ops", "distributed", "precision", "cli")

__all__ = [
    "DEEPSPEED_NPU_ADAPTER", "ENGINE_SECTIONS", "EXIT_FAIL", "EXIT_OK", "EXIT_USAGE", "SCHEMA_VERSION", "STATUSES",
    "DoctorContext", "SectionResult", "deepspeed_accelerator", "doctor_json_schema", "main", "parse_npu_smi",
    "render_text", "run_doctor", "sections", "version_of",
]


def __getattr__(name: str) -> Any:
    """A name of the doctor's modules (``run_doctor``, ``SectionResult`` …), or one of them
    (``doctor.cli``), loaded when first read; ``SECTIONS`` and ``DOCTOR_JSON_SCHEMA`` are computed
    when read (``report``), so importing the doctor loads no adapter."""
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    for module_name in _MODULES:
        module = importlib.import_module(f"{__name__}.{module_name}")
        try:
            return getattr(module, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

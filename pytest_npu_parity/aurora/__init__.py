"""Aurora (PyPI ``aurora-model`` 0.2.0) adapter: NPU patch set, seeded model factory, real inputs.

Importing this package does not import ``aurora`` itself; each function imports it when called.

* :mod:`.patches` — the NPU adaptation patch set (``apply_all_patches``, ``patched``).
* :mod:`.factory` — deterministic ``full``/``tiny`` models (``build_model``, ``get_model``,
  ``model_fingerprint``).
* :mod:`.inputs` — Mauna Loa CO2 windows, text tokens and submodule inputs (``make_batch``).
* :mod:`.checks` — the catalogue of checks the suite and the calibration benchmark run.
* :mod:`.strategies` — hypothesis strategies of valid Aurora input shapes.
* :mod:`.golden_shims` — what a float64 golden run of aurora-model needs changed.
* :mod:`.adapter` — the adapter object the engine's seam loads (``pytest_npu_parity.adapters``):
  the doctor's Aurora lines and sections (:mod:`.doctor_sections`).

The engine never imports this package (an import contract in pyproject.toml says so); the Aurora
suite imports it from its conftest and test modules.
"""
from pytest_npu_parity.runtime.npu import prepare_torch

# aurora imports transformers, whose is_torch_npu_available() imports torch_npu: a torch_npu that
# cannot load (no CANN) is quarantined first, so a plain script can build models too.
prepare_torch()

from pytest_npu_parity.aurora.factory import (  # noqa: E402
    BuildRecord, CheckpointError, build_model, clear_model_cache, config_hash, get_model, model_fingerprint,
)
from pytest_npu_parity.aurora.inputs import AuroraBatch  # noqa: E402, load_co2_series, make_batch
from pytest_npu_parity.aurora.patches import PatchError  # noqa: E402, PatchSet, apply_all_patches, patched

__all__ = [
    "AuroraBatch",
    "BuildRecord",
    "CheckpointError",
    "PatchError",
    "PatchSet",
    "apply_all_patches",
    "build_model",
    "clear_model_cache",
    "config_hash",
    "get_model",
    "load_co2_series",
    "make_batch",
    "model_fingerprint",
    "patched",
]

"""The Aurora adapter object, as the engine's adapter seam loads it (``pytest_npu_parity.adapters``).

Declared in pyproject.toml::

    [project.entry-points."pytest_npu_parity.adapters"]
    aurora = "pytest_npu_parity.aurora.adapter:ADAPTER"

so ``python -m pytest_npu_parity doctor`` prints the Aurora lines of its environment section and the
``patch_set`` and ``aurora_smoke`` sections (:mod:`pytest_npu_parity.aurora.doctor_sections`). Without
reinstalling, ``NPU_PARITY_ADAPTERS=pytest_npu_parity.aurora.adapter:ADAPTER`` names it too. The
Aurora suite needs no registration: its conftest imports the factory, patch set and golden shims.
"""
from __future__ import annotations

from pytest_npu_parity.adapters import Adapter, DoctorSection
from pytest_npu_parity.aurora import doctor_sections

__all__ = ["ADAPTER"]

#: The Aurora adapter: its doctor sections (after the op probes) and environment lines.
ADAPTER = Adapter(
    name="aurora",
    doctor_sections=(
        DoctorSection("patch_set", "Patch set self-test", doctor_sections.section_patch_set),
        DoctorSection("aurora_smoke", "Aurora smoke test", doctor_sections.section_aurora_smoke),
    ),
    doctor_environment=doctor_sections.environment_facts,
)

"""Provenance of a reference: the one-line description of where, when and with what software a
baseline was recorded.

* ``describe_provenance(prov)`` — the one-line summary that reports and failure messages print.

The record itself is collected by the run that produced the baseline
(:func:`pytest_npu_parity.runtime.machine.collect_provenance`: it reads the machine, CANN included);
the store keeps it as given. The content fingerprints that tell whether a baseline still describes the
current model and input are in :mod:`pytest_npu_parity.store.digests` (``fingerprint_tensors``,
``fingerprint_module``, ``module_tensor_digests``) and :mod:`pytest_npu_parity.store.summaries`
(``summarize_tensors``, ``summaries_close``); the old import path ``pytest_npu_parity.provenance``
re-exports all of them.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "describe_provenance",
]


def describe_provenance(prov: Mapping[str, Any] | None) -> str:
    """One line naming a baseline's device, date, versions and revision.

    Example: ``"cuda (NVIDIA H200) · 2026-11-30 · torch 2.14.1 · recipe bf16 · git ab12cd3"``;
    on an NPU the torch_npu and CANN versions follow the torch version; a CPU record names its
    intra-op thread count before the recipe (``· 2 threads · recipe bf16``). Missing fields are left
    out; an empty or ``None`` record gives ``"unknown provenance"``.
    """
    if not prov:
        return "unknown provenance"
    device_type = prov.get("device_type") or "unknown device"
    name = prov.get("device_name")
    parts = [f"{device_type} ({name})" if name and name != device_type else str(device_type)]
    created = prov.get("created")
    if created:
        parts.append(str(created)[:10])
    for key, label in (("torch", "torch"), ("torch_npu", "torch_npu"), ("cann", "CANN")):
        if prov.get(key):
            parts.append(f"{label} {prov[key]}")
    if device_type == "cpu" and prov.get("threads"):  # a CPU result's bf16 reductions depend on it
        parts.append(f"{prov['threads']} thread{'s' * (prov['threads'] != 1)}")
    if prov.get("recipe"):
        parts.append(f"recipe {prov['recipe']}")
    revision = prov.get("git_revision")
    if revision:
        parts.append(f"git {str(revision)[:7]}" + ("+dirty" if prov.get("git_dirty") else ""))
    return " · ".join(parts)

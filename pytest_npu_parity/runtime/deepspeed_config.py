"""Lint a DeepSpeed JSON config by the Ascend adaptation guide's rules (seed ``000_76a3155d974abf2f.txt``
§3.1, §7.1, §7.2, §9.1).

The guide's only required code change is to replace the DeepSpeed config with ``configs/deepspeed_npu.json``:
bf16 on, fp16 off, no ``communication_backend`` key and no ``aio`` section. :func:`lint_file` checks a
config file for exactly that and returns one :class:`Finding` per problem, each one sentence naming the file,
the key and the fix. Used by ``python -m pytest_npu_parity doctor --deepspeed-config FILE`` and by the
plugin's ini key ``parity_deepspeed_config``.

Rules, each checked against DeepSpeed 0.19.8's own source and transformers 4.57's Trainer integration:

``bf16.enabled`` must be ``true`` (error; ``"auto"`` is a warning)
    DeepSpeed reads ``bf16`` (or the legacy ``bfloat16``) in ``deepspeed/runtime/precision_config.py``
    ``get_bfloat16_config``; ``enabled`` defaults to False. ``"auto"`` is replaced by transformers'
    ``HfTrainerDeepSpeedConfig.trainer_config_process`` with ``TrainingArguments.bf16``, so it is bf16 only
    when the launcher passes ``--bf16``. The guide: the 910B runs bf16 natively without loss scaling (§9.1).
``fp16.enabled`` must be false or absent (error when ``true``; ``"auto"`` is a warning)
    fp16 on Ascend needs a GradScaler (guide §6.3: ``torch_npu.npu.amp.GradScaler``); bf16 is preferred.
    Where neither ``bf16.enabled`` is true nor ``fp16.enabled`` false, transformers' Trainer treats the run as
    fp16 (``HfTrainerDeepSpeedConfig.trainer_config_process``: "deepspeed's default mode is fp16") and
    casts every floating input to float16 (``Trainer._prepare_input``).
``communication_backend`` is not a DeepSpeed field (error)
    ``DeepSpeedConfig._initialize_params`` (``deepspeed/runtime/config.py``) never reads it, and nothing
    validates unknown top-level keys, so it is silently ignored. The backend comes from the accelerator:
    ``deepspeed.initialize`` and ``DeepSpeedEngine.__init__`` call
    ``get_accelerator().communication_backend_name()``, which is ``'hccl'`` for the NPU accelerator
    (``deepspeed/accelerator/npu_accelerator.py``), chosen when ``torch_npu`` imports or
    ``DS_ACCELERATOR=npu`` (``deepspeed/accelerator/real_accelerator.py`` ``get_accelerator``).
``aio`` section (warning)
    ``aio`` *is* a DeepSpeed field (``deepspeed/runtime/swap_tensor/aio_config.py`` ``get_aio_config``), read
    only by ZeRO-Infinity's NVMe swapping (``offload_optimizer``/``offload_param`` ``device: "nvme"``), which
    needs the ``async_io`` op built against libaio (``op_builder/npu/async_io.py`` on NPU). The guide calls the
    section misleading and removes it from its NPU config (§7.2): without NVMe offload it does nothing.

Parsing follows the loaders: transformers' Trainer reads the file with ``json.load``
(``accelerate.utils.deepspeed.HfDeepSpeedConfig``), DeepSpeed with a duplicate-key check
(``deepspeed.runtime.config_utils.dict_raise_error_on_duplicate_keys``): invalid JSON, a duplicate key, a
top level that is not an object or a missing file raise :class:`DeepSpeedConfigError` with one sentence.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

__all__ = ["DeepSpeedConfigError", "Finding", "lint_config", "lint_file", "load_config", "SEVERITIES"]

#: Finding severities: an ``error`` breaks the guide's rules, a ``warning`` depends on how it is launched.
SEVERITIES = ("error", "warning")


class DeepSpeedConfigError(ValueError):
    """The config file cannot be read as a DeepSpeed config (missing, unreadable, not a JSON object)."""


DeepSpeedConfigError.__module__ = "pytest_npu_parity.deepspeed_config"  # printed as before the move


@dataclass(frozen=True)
class Finding:
    """One problem of a DeepSpeed config.

    Attributes:
        file: the config file as given.
        key: the dotted key (``bf16.enabled``, ``communication_backend``, ``aio``).
        severity: ``error`` or ``warning``.
        message: one sentence naming the file, the key and the fix.
    """

    file: str
    key: str
    severity: str
    message: str

    def __str__(self) -> str:
        return self.message

    def as_dict(self) -> dict[str, str]:
        """JSON-ready dict."""
        return {"file": self.file, "key": self.key, "severity": self.severity, "message": self.message}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


class _DuplicateKey(ValueError):
    pass


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config at ``path`` as a dict, parsed as strict JSON with duplicate keys refused.

    Raises:
        DeepSpeedConfigError: the file does not exist or cannot be read, is not valid JSON (line and column
            named), has a duplicate key, or its top level is not a JSON object.
    """
    file = str(path)
    p = Path(path)
    if not p.is_file():
        why = "is a directory" if p.is_dir() else "does not exist"
        raise DeepSpeedConfigError(f"DeepSpeed config {file} {why}: give the path of the JSON file passed to "
                                   "the Trainer's --deepspeed (e.g. configs/deepspeed_npu.json)")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DeepSpeedConfigError(f"DeepSpeed config {file} cannot be read ({exc}): fix its permissions or "
                                   "encoding (UTF-8 JSON)") from None
    try:
        config = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as exc:
        raise DeepSpeedConfigError(f"DeepSpeed config {file} has the key {exc.args[0]!r} twice (DeepSpeed refuses "
                                   "duplicate keys): keep one") from None
    except json.JSONDecodeError as exc:
        raise DeepSpeedConfigError(f"DeepSpeed config {file} is not valid JSON ({exc.msg} at line {exc.lineno}, "
                                   f"column {exc.colno}): fix it there (transformers' Trainer reads it with "
                                   "json.load, so no comments or trailing commas)") from None
    if not isinstance(config, dict):
        raise DeepSpeedConfigError(f"DeepSpeed config {file} holds a JSON {type(config).__name__}, not an object: "
                                   "its top level must be {...}")
    return config


def _enabled(config: dict[str, Any], *sections: str) -> tuple[str | None, Any]:
    """``(dotted key, value)`` of ``<section>.enabled`` for the first section present, else ``(None, None)``."""
    for section in sections:
        if section in config:
            value = config[section]
            return f"{section}.enabled", (value.get("enabled", False) if isinstance(value, dict) else value)
    return None, None


def _find_keys(value: Any, name: str, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every key ``name`` in a nested dict (lists are walked by index)."""
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if key == name:
                yield path
            yield from _find_keys(item, name, path)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _find_keys(item, name, f"{prefix}[{i}]")


def _nvme_offload(config: dict[str, Any]) -> list[str]:
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return []
    return [f"zero_optimization.{part}.device" for part in ("offload_optimizer", "offload_param")
            if isinstance(zero.get(part), dict) and zero[part].get("device") == "nvme"]


def lint_config(config: dict[str, Any], file: str = "<config>") -> list[Finding]:
    """Findings of the guide's rules for a parsed DeepSpeed config (module docstring), errors first.

    Args:
        config: the parsed config (a dict).
        file: the file name the findings name.
    Returns:
        A list of :class:`Finding` (empty for a clean config).
    """
    findings: list[Finding] = []
    key, bf16 = _enabled(config, "bf16", "bfloat16")
    if bf16 == "auto":
        findings.append(Finding(file, key, "warning", (
            f"{file}: {key} is \"auto\", so transformers' Trainer makes it bf16 only when launched with --bf16 "
            "(HfTrainerDeepSpeedConfig fills it from TrainingArguments.bf16) — set \"bf16\": {\"enabled\": true}, "
            "the precision the guide trains Ascend 910B with (§7.2, §9.1)")))
    elif bf16 is not True:
        shown = "missing" if key is None else f"{json.dumps(bf16)}"
        findings.append(Finding(file, key or "bf16.enabled", "error", (
            f"{file}: bf16.enabled is {shown} — set \"bf16\": {{\"enabled\": true}}: the 910B trains in bf16 "
            "natively without loss scaling (guide §7.2, §9.1), and with neither bf16 on nor fp16 off transformers' "
            "Trainer runs DeepSpeed in fp16")))
    fkey, fp16 = _enabled(config, "fp16")
    if fp16 is True:
        findings.append(Finding(file, fkey, "error", (
            f"{file}: fp16.enabled is true — set \"fp16\": {{\"enabled\": false}} (or drop the section): fp16 on "
            "Ascend needs a GradScaler (torch_npu.npu.amp.GradScaler, guide §6.3) and bf16 is the preferred "
            "precision (§9.1)")))
    elif fp16 == "auto":
        findings.append(Finding(file, fkey, "warning", (
            f"{file}: fp16.enabled is \"auto\", so launching with --fp16 turns on fp16, which on Ascend needs a "
            "GradScaler (guide §6.3) — set \"fp16\": {\"enabled\": false}")))
    for path in _find_keys(config, "communication_backend"):
        findings.append(Finding(file, path, "error", (
            f"{file}: {path} is not a DeepSpeed config field and is silently ignored (DeepSpeedConfig never "
            "reads it) — delete it; DeepSpeed uses HCCL when its accelerator is the NPU one (torch_npu importable "
            "or DS_ACCELERATOR=npu; check with `python -m pytest_npu_parity doctor`)")))
    if "aio" in config:
        nvme = _nvme_offload(config)
        if nvme:
            message = (f"{file}: aio configures the NVMe swapping that {' and '.join(nvme)} = \"nvme\" asks for, "
                       "which needs DeepSpeed's async_io op built against libaio on the NPU host — the guide's NPU "
                       "config drops the aio section and NVMe offload (§7.2); offload to \"cpu\" or remove both")
        else:
            message = (f"{file}: aio does nothing without NVMe offload (DeepSpeed reads it only for ZeRO-Infinity "
                       "NVMe swapping) and the guide removes it as misleading (§7.2) — delete the aio section")
        findings.append(Finding(file, "aio", "warning", message))
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def lint_file(path: str | os.PathLike[str]) -> list[Finding]:
    """:func:`lint_config` of the file at ``path`` (findings name ``path`` as given).

    Raises:
        DeepSpeedConfigError: as :func:`load_config`.
    """
    return lint_config(load_config(path), str(path))

"""The report header of a parity session: target, reference, versions, verdicts, audit, launcher, workers."""
from __future__ import annotations

from typing import Any

import pytest

from ..runtime import npu as _npu
from .state import CONFIG_KEY, DEEPSPEED_LINT_KEY, SESSION_KEY
from .xdist import is_xdist_controller


def deepspeed_header(config: pytest.Config) -> str | None:
    linted = config.stash.get(DEEPSPEED_LINT_KEY, None)
    if linted is None:
        return None
    shown, findings = linted
    if not findings:
        return f"npu-parity: DeepSpeed config {shown}: follows the guide's rules (bf16 on, fp16 off, no " \
               "communication_backend, no aio)"
    errors = sum(f.severity == "error" for f in findings)
    keys = ", ".join(f.key for f in findings)
    return (f"npu-parity: DeepSpeed config {shown}: {errors} error(s), {len(findings) - errors} warning(s) ({keys}); "
            "see the warnings summary")


def worker_pinning_line(config: pytest.Config) -> str | None:
    """Header line naming each xdist worker's device (the controller's own target is worker 0's)."""
    workers = getattr(config.option, "numprocesses", None)
    if not isinstance(workers, int) or workers < 1 or getattr(config.option, "dist", "no") == "no":
        return None
    from ..runtime.devices import resolve_worker_target  # imports torch: a parity session's header only

    raw = config.stash[CONFIG_KEY].raw
    spec = raw.value("parity_device")[0]
    mapping = raw.value("parity_worker_devices")[0] or None
    pins = [f"gw{k}→{resolve_worker_target(spec, f'gw{k}', mapping)}" for k in range(min(workers, 8))]
    return "npu-parity: xdist workers " + ", ".join(pins) + (" …" if workers > 8 else "")


def report_header(config: pytest.Config) -> list[str]:
    """``pytest_report_header``: one line when parity is off, else the session's lines."""
    cfg = config.stash[CONFIG_KEY]
    if not cfg.enabled:
        return ["npu-parity: off (parity suites are skipped; run with --npu-parity)"]
    import torch

    from ..runtime.npu import npu_status
    from ..runtime.recipes import precision_flags, strict_fp32_flags

    session = config.stash[SESSION_KEY]
    status = npu_status()
    mode = "recording baselines" if session.update_baselines else f"reference {session.reference}"
    with strict_fp32_flags():
        flags = precision_flags()
    lines = [
        f"npu-parity: target {session.target} ({session.target_name}) · {mode} · recipes "
        f"{','.join(cfg.recipes)} · baselines {session.store.root}",
        f"npu-parity: torch {torch.__version__} · torch_npu {status.torch_npu_version or '-'} · "
        f"CANN {status.cann_version or '-'} · precision flags "
        + " ".join(f"{k}={v}" for k, v in flags.items()),
    ]
    def verdict(recipe: str) -> str:
        text = _policy_text(session.verdict_policy(recipe, ''), session.tolerance(recipe, ''))
        training = _policy_text(session.verdict_policy(recipe, '', training=True), session.tolerance(recipe, ''))
        return f"{recipe} {text}" + (f" (training checks: {training})" if training != text else "")

    audit = cfg.audit_mode
    if audit != "off":
        from ..runtime.audit import DEFAULT_LOGICAL_TARGET

        lines.append(f"npu-parity: audit {audit} · default audit budget {session.audit_budget.describe()}"
                     + (f" · a CPU target is audited as the logical device {DEFAULT_LOGICAL_TARGET}"
                        if session.target.type == "cpu" else ""))
    if session.rng == "device":
        lines.append("npu-parity: random streams: sampling checks draw from each side's own device generator and "
                     f"are judged as distributions ({session.distribution_policy.describe()}); other checks share "
                     "one seeded CPU stream")
    lines.append("npu-parity: verdicts " + " · ".join(verdict(recipe) for recipe in cfg.recipes) + (" (per-check choices in parity_policies)" if session.check_policies else ""))
    layered = [(r, session.layer_policy(r)) for r in cfg.recipes]
    lines.append("npu-parity: layer check " + (" · ".join(f"{r}: {p.describe()}" for r, p in layered if p is not None)
                                               or "off") + " (--parity-layers)")
    if session.target.type != "npu" and not status.available and (status.torch_npu_version or _npu.quarantined()):
        lines.append(f"npu-parity: torch_npu is installed but the NPU is not used: {status.reason}")
    deepspeed = deepspeed_header(config)
    if deepspeed:
        lines.append(deepspeed)
    record = _npu.launched() if session.target.type == "npu" else None
    if record is not None:
        lines.append(f"npu-parity: launcher (before any import of aurora): {record.describe()}")
    elif session.target.type == "npu" and is_xdist_controller(config):
        lines.append("npu-parity: launcher (before any import of aurora): in every xdist worker, transfer_to_npu → "
                     "set_compile_mode(jit_compile=False) → set_device(<the worker's device>)")
    warning = _npu.fp16_warning(session.target, list(cfg.recipes))
    if warning:
        lines.append(f"npu-parity: {warning}")
    pinning = worker_pinning_line(config)
    return lines + [pinning] if pinning else lines


def _policy_text(golden_policy: Any, tolerance: Any) -> str:
    """``allclose rtol=1e-05 atol=1e-05 budget=0`` or the golden policy's description."""
    if golden_policy is not None:
        return golden_policy.describe()
    return f"allclose rtol={tolerance.rtol:g} atol={tolerance.atol:g} budget={tolerance.budget:g}"

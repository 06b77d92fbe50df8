"""The ``distributed`` section (gloo / nccl / hccl, a 1-process ``init_process_group``) and the
``deepspeed`` section (the build, the accelerator DeepSpeed picks, the ``--deepspeed-config`` lint).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any

from ...runtime import npu
from ...runtime.npu.diagnosis import _first_line
from ...runtime.npu.versions import _find_spec
from ...runtime.process_group import destroy_process_groups
from .report import SectionResult, _Context, _version

def _backend_available(dist: Any, name: str) -> bool:
    check = getattr(dist, "is_backend_available", None)  # torch >= 2.3
    if check is not None:
        try:
            return bool(check(name))
        except Exception:
            return False
    legacy = getattr(dist, f"is_{name}_available", None)
    return bool(legacy()) if legacy is not None else name in getattr(dist.Backend, "backend_list", [])


def _section_distributed(ctx: _Context, r: SectionResult) -> None:
    if ctx.torch is None:
        ctx.no_target(r)
        return
    import datetime

    import torch.distributed as dist

    if not dist.is_available():
        r.worse("fail")
        r.details.append("torch.distributed is not available in this torch build")
        r.fixes.append("install a torch build with distributed support")
        return
    available = {name: _backend_available(dist, name) for name in ("gloo", "nccl", "hccl")}
    r.data["backends"] = available
    r.details.append("backends: " + ", ".join(f"{k} {'yes' if v else 'no'}"
                                              for k, v in available.items()))
    if ctx.no_target(r):
        return
    backend = npu.dist_backend_for(ctx.target)
    r.data["backend"] = backend
    if not available[backend]:
        r.worse("fail")
        r.details.append(f"{backend} (for {ctx.target.type}) is not available")
        r.fixes.append({
            "hccl": "HCCL backend not registered — `import torch_npu` before "
                    "init_process_group(backend='hccl') (seed §7.3, §10.2)",
            "nccl": "NCCL backend missing — install a CUDA build of torch with NCCL",
            "gloo": "gloo backend missing — install a standard torch build",
        }[backend])
        return
    if dist.is_initialized():
        r.details.append(f"a process group is already initialized ({dist.get_backend()}): "
                         "1-process init skipped")
        return
    with tempfile.TemporaryDirectory(prefix="npu-parity-doctor-") as tmp:
        start = time.perf_counter()
        try:
            if ctx.target.type in ("npu", "cuda"):
                getattr(ctx.torch, ctx.target.type).set_device(ctx.target.index or 0)
            dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0,
                                    world_size=1, timeout=datetime.timedelta(seconds=60))
            try:
                value = ctx.torch.ones(4, device=ctx.target)
                dist.all_reduce(value)
                ok = bool((value.cpu() == 1).all())
            finally:
                destroy_process_groups()  # torch 2.5.1's gloo destructor can deadlock (process_group)
        except Exception as exc:
            r.worse("fail")
            r.details.append(f"1-process {backend} init on {ctx.target}: FAILED — "
                             f"{_first_line(exc)}")
            r.fixes.append(f"init_process_group('{backend}') fails on {ctx.target}: "
                           f"{_first_line(exc)} — check the version matrix and, for hccl, "
                           "HCCL_* environment variables")
            return
        seconds = time.perf_counter() - start
    r.data.update(init_ok=ok, init_s=seconds)
    if ok:
        r.details.append(f"1-process {backend} init + all_reduce on {ctx.target}: ok ({seconds:.2f} s)")
    else:
        r.worse("fail")
        r.details.append(f"1-process {backend} all_reduce on {ctx.target} returned a wrong value")
        r.fixes.append(f"{backend} all_reduce with world size 1 changed its input — the "
                       "collective library is broken")


#: The Ascend adapter package of Gitee's ``ascend/DeepSpeed`` (imported as ``deepspeed_npu`` beside a stock
#: DeepSpeed); stock DeepSpeed ships its own ``accelerator/npu_accelerator.py``.
DEEPSPEED_NPU_ADAPTER = "deepspeed_npu"


def deepspeed_accelerator() -> dict[str, Any]:
    """Which accelerator DeepSpeed picks in this process and the collective backend it will use.

    Calls ``deepspeed.accelerator.get_accelerator()`` (importing DeepSpeed). In DeepSpeed 0.19.8
    (``deepspeed/accelerator/real_accelerator.py``) the choice is ``DS_ACCELERATOR`` when set (``npu``
    requires ``import torch_npu`` to succeed, else ``ValueError``), otherwise auto-detection in the order
    xpu, **npu (``import torch_npu`` succeeds)**, sdaa, mps, hpu, mlu, supa, klxpu, cuda, cpu. The backend is
    ``communication_backend_name()`` — what ``deepspeed.initialize`` and ``DeepSpeedEngine`` pass to
    ``init_distributed``: ``hccl`` for ``NPU_Accelerator``, ``nccl`` for CUDA, ``ccl`` or ``gloo`` for the CPU
    (``ccl`` only with oneCCL's ``oneccl_bindings_for_pytorch``). A ``communication_backend`` key in the JSON
    config plays no part (see ``deepspeed_config``).

    Returns:
        ``{"accelerator": "npu", "backend": "hccl", "chosen_by": "auto-detect" | "DS_ACCELERATOR",
        "error": None}``; on failure ``accelerator``/``backend`` are None and ``error`` is one line.
    """
    import contextlib

    chosen_by = "DS_ACCELERATOR" if "DS_ACCELERATOR" in os.environ else "auto-detect"
    try:
        # DeepSpeed's logger (deepspeed/utils/logging.py) writes to the sys.stdout of its import time and
        # get_accelerator() logs its choice: stdout is kept for the report (``--json``), the log goes to stderr.
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.accelerator import get_accelerator

            accelerator = get_accelerator()
        return {"accelerator": str(accelerator.device_name()), "backend": str(accelerator.communication_backend_name()),
                "chosen_by": chosen_by, "error": None}
    except Exception as exc:  # noqa: BLE001 - an import or detection failure is the finding itself
        return {"accelerator": None, "backend": None, "chosen_by": chosen_by, "error": _first_line(exc)}


def _section_deepspeed(ctx: _Context, r: SectionResult) -> None:
    spec = _find_spec("deepspeed")
    adapter = _find_spec(DEEPSPEED_NPU_ADAPTER) is not None
    ds_env = os.environ.get("DS_ACCELERATOR")
    r.data.update(installed=spec is not None, deepspeed_npu=adapter, ds_accelerator=ds_env)
    if ctx.deepspeed_findings is not None:
        _deepspeed_lint(ctx, r)
    on_npu = ctx.target is not None and ctx.target.type == "npu"
    if spec is None:
        if ctx.deepspeed_findings is None:  # nothing checked at all (a clean lint stays ok)
            r.status = "skip"
        r.details.append("DeepSpeed not installed (needed only for DeepSpeed training)")
        if on_npu:
            r.fixes.append("for DeepSpeed on Ascend: pip install deepspeed (its NPU accelerator uses HCCL when "
                           "torch_npu imports), then rerun the doctor")
        return
    version = _version("deepspeed")
    locations = list(spec.submodule_search_locations or [])
    npu_accelerator = any(os.path.isfile(os.path.join(loc, "accelerator", "npu_accelerator.py"))
                          for loc in locations)
    build = (f"stock DeepSpeed with Ascend's {DEEPSPEED_NPU_ADAPTER} adapter" if adapter
             else "stock DeepSpeed" + (" (ships accelerator/npu_accelerator.py)" if npu_accelerator
                                       else " without an NPU accelerator"))
    r.data.update(version=version, npu_accelerator=npu_accelerator, build=build)
    r.details.append(f"deepspeed {version} ({locations[0] if locations else spec.origin}): {build}")
    info = deepspeed_accelerator()
    r.data.update(info)
    r.data["uses_hccl"] = info["backend"] == "hccl"
    if info["error"]:
        r.worse("fail" if on_npu or ds_env else "warn")
        r.details.append(f"deepspeed.accelerator.get_accelerator() failed: {info['error']}")
        r.fixes.append(f"DeepSpeed cannot choose its accelerator ({info['error']})"
                       + (" — DS_ACCELERATOR=npu needs an importable torch_npu: fix torch_npu (environment "
                          "section) or unset DS_ACCELERATOR" if ds_env == "npu" else
                          " — fix the DeepSpeed installation (pip install --force-reinstall deepspeed)"))
        return
    why = (f"DS_ACCELERATOR={ds_env}" if info["chosen_by"] == "DS_ACCELERATOR" else
           "auto-detected: torch_npu imports" if info["accelerator"] == "npu" else
           "auto-detected" + ("" if not (ctx.status and ctx.status.torch_npu_version) else
                              ": torch_npu is installed but does not import"))
    r.details.append(f"accelerator: {info['accelerator']} ({why}) → communication backend {info['backend']}: "
                     + ("DeepSpeed will use HCCL" if info["backend"] == "hccl" else "DeepSpeed will not use HCCL"))
    if on_npu and info["accelerator"] != "npu":
        r.worse("fail")
        cause = (f"DS_ACCELERATOR={ds_env} overrides the NPU — set DS_ACCELERATOR=npu or unset it"
                 if ds_env else "torch_npu does not import in this process — see the environment section, or "
                 "set DS_ACCELERATOR=npu to see the import error")
        r.fixes.append(f"DeepSpeed picked the {info['accelerator']} accelerator and will initialize "
                       f"{info['backend']}, not HCCL, on an NPU target: {cause}")


def _deepspeed_lint(ctx: _Context, r: SectionResult) -> None:
    """The ``--deepspeed-config`` findings (``deepspeed_config.lint_file``) as details and fixes."""
    findings = ctx.deepspeed_findings or []
    r.data["config"] = ctx.deepspeed_config
    r.data["config_findings"] = [f.as_dict() for f in findings]
    if not findings:
        r.details.append(f"config {ctx.deepspeed_config}: follows the guide's rules (bf16 on, fp16 off, no "
                         "communication_backend, no aio)")
        return
    errors = sum(f.severity == "error" for f in findings)
    r.details.append(f"config {ctx.deepspeed_config}: {errors} error(s), {len(findings) - errors} warning(s)")
    r.worse("fail" if errors else "warn")
    r.fixes.extend(f.message for f in findings)

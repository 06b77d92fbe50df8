"""The ``precision`` section: the TF32 (CUDA) and HF32 (torch_npu) switches in force."""
from __future__ import annotations

from ...runtime import npu
from .report import SectionResult, _Context

def _section_precision(ctx: _Context, r: SectionResult) -> None:
    if ctx.torch is None:
        ctx.no_target(r)
        return
    flags = npu.precision_flags()
    r.data["flags"] = flags
    r.details.extend(f"{k} = {v}" for k, v in flags.items())
    kind = ctx.target.type if ctx.target is not None else None
    reduced: list[str] = []
    if kind == "cuda":
        reduced = [k for k in ("cuda.matmul.allow_tf32", "cudnn.allow_tf32") if flags.get(k)]
        if flags.get("float32_matmul_precision") != "highest":
            reduced.append(f"float32_matmul_precision={flags['float32_matmul_precision']}")
    elif kind == "npu":
        reduced = [k for k in ("npu.matmul.allow_hf32", "npu.conv.allow_hf32") if flags.get(k)]
    elif kind == "cpu":
        r.details.append("target is the CPU: TF32/HF32 switches have no effect there"
                         + ("" if "npu.conv.allow_hf32" in flags else "; no NPU: HF32 flags absent"))
    r.data["reduced_precision_on_target"] = reduced
    if reduced:
        r.worse("warn")
        off = {"npu.conv.allow_hf32": "torch.npu.conv.allow_hf32 = False",
               "npu.matmul.allow_hf32": "torch.npu.matmul.allow_hf32 = False",
               "cuda.matmul.allow_tf32": "torch.backends.cuda.matmul.allow_tf32 = False",
               "cudnn.allow_tf32": "torch.backends.cudnn.allow_tf32 = False"}
        fixes = [off.get(k, "torch.set_float32_matmul_precision('highest')") for k in reduced]
        r.fixes.append(f"{', '.join(reduced)} on {ctx.target}: fp32 runs with 10-bit mantissas "
                       f"there — parity checks of the fp32 recipe switch this off for their "
                       f"duration; for your own fp32 runs set {'; '.join(fixes)}")

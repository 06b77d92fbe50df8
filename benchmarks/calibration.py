"""Calibration of verdicts: how often does each policy fail a legitimate difference or pass a real fault?

For every selected Aurora check (``aurora.checks.CHECKS``) and recipe (``fp32``, ``bf16``) the harness
runs, through the suite's own ``ParitySession``/``ParityCase`` machinery (placement, recipe context,
shared seeded randomness, NPU patch set on the target side):

* the **reference** — the upstream computation on the CPU, as the suite's live reference;
* the **golden** — the same computation on the CPU at higher precision (``golden.GoldenRunner``:
  fp64, for bf16 work fp32 where fp64 cannot run);
* one **target** run per **scenario**, the scenario entered on the target side after the patch set:

  - *legitimate variants* (a correct port may differ this way): the patch set alone; PyTorch's
    transformer slow path instead of its fast path; a split-K linear (K in ``SPLIT_K_CHUNKS``
    chunks, fp32 accumulation); another intra-op thread count; another CPU kernel path (ATen's
    default kernels, oneDNN capped at AVX2) and another torch release (``NPU_PARITY_OTHER_PYTHON``),
    both computed by a child process (``child_targets``); TF32/HF32-like reduced-mantissa
    matmul/linear/conv inputs (10 explicit mantissa bits, rounded to nearest); the target on CUDA
    when a GPU is present;
  - *real faults* (a port bug): one weight scaled by (1 + 1e-4) and (1 + 1e-3); the causal mask
    off by one (one future token visible) or dropped; a wrong attention scale (1/√hidden instead of
    1/√head_dim); a bias dropped (zeroed); softmax and normalisation run in bf16 where fp32 was
    expected; dropout noise drawn from the device RNG stream instead of the shared one.

Each target output is then judged by every policy of ``default_policies()`` (allclose tolerances and
golden policies); a case whose target is bitwise equal to the reference ("no effect": the scenario
does not touch this computation) is reported but left out of the rates. The report gives, per
policy and recipe, the **false-failure rate** (effective variants that fail) and the **false-pass
rate** (effective faults that pass).

``run_calibration`` is the engine; ``benchmarks/calibrate.py`` is its command line and writes
``benchmarks/results/calibration.json`` and ``.md``. No pytest here.

This harness is a benchmark of the repository, not part of the installed package (it used to be
``pytest_npu_parity.calibration``): import it with ``benchmarks/`` on ``sys.path`` (``calibrate.py``
runs from there; ``tests/test_calibration.py`` puts it there). The golden shim it shares with the
Aurora suite lives in the adapter: ``pytest_npu_parity.aurora.golden_shims``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

from pytest_npu_parity.aurora.golden_shims import aurora_golden_shims
from pytest_npu_parity.compare import compare
from pytest_npu_parity.golden import MSPROBE_GOLDEN, WORK_DTYPES, GoldenPolicy, GoldenRunner, GoldenUnavailableError, default_golden_for_recipe, \
    golden_dtype, judge_golden
from pytest_npu_parity.policy import FP32, LOW_PRECISION, Tolerance

#: The repository root (this file is ``<root>/benchmarks/calibration.py``).
_REPO_ROOT = Path(__file__).resolve().parent.parent

#: Checks of the default run (≈ 10 min on 2 shared cores): attention, a decoder layer in eval and
#: training mode, the retriever (nn.TransformerEncoder: fast path), the vision encoder (ViT conv
#: + linear, nn.TransformerDecoder) and the whole eval forward (trunk, flow head, sampling).
#: ``aurora_model`` (the trunk alone) and every other check run with ``checks=`` / ``--all``.
DEFAULT_CHECKS = ("attention_self_causal", "decoder_layer_0", "decoder_layer_0_train", "prototype_retriever",
                  "vision_encoder", "forward_eval")

#: Recipes calibrated by default.
DEFAULT_RECIPES = ("fp32", "bf16")

#: Number of K-chunks of the split-K linear variant.
SPLIT_K_CHUNKS = 4

#: Explicit mantissa bits kept by the reduced-mantissa variant (TF32 keeps 10 of fp32's 23).
REDUCED_MANTISSA_BITS = 10


# --------------------------------------------------------------------------------------------
# scenarios


@dataclass
class ScenarioContext:
    """What a scenario may need to apply itself to one check's target run.

    Attributes:
        check: the ``AuroraCheck``.
        aurora: the ``AuroraContext`` (model, batch, captured inputs).
        fn: the callable the check runs (a module, a bound method, a function).
        module: the module whose weights the check depends on (``None`` for free functions).
        recipe: the recipe name.
    """

    check: Any
    aurora: Any
    fn: Callable[..., Any]
    module: torch.nn.Module | None
    recipe: str


@dataclass(frozen=True)
class Scenario:
    """A legitimate variant or a real fault, applied on the target side.

    Attributes:
        name: short identifier (table row).
        kind: ``variant`` (should pass) or ``fault`` (should fail).
        description: one line for the report.
        apply: ``(ScenarioContext) -> context manager`` entered inside the patch set on the target.
        unavailable: ``() -> reason or None``: why the scenario cannot run on this machine.
        applies: ``(ScenarioContext) -> reason or None``: why the scenario cannot touch this
            check's computation (the run is skipped, status ``not applicable``), e.g. a causal-mask
            fault on the vision encoder.
        violates: recipes whose contract the variant breaks: under them a failing verdict is
            right, and the case is counted as a recipe violation, not as a false failure (the
            ``fp32`` recipe switches TF32/HF32 off, so a reduced-mantissa target violates it).
        device: target device type for the scenario (``None``: the CPU, as the reference).
        env: environment variables of a child process that computes the target side instead (for
            settings read once at process start, such as ATen's and oneDNN's CPU kernel paths);
            the child builds the same seeded model and batch and runs every check under the recipe
            and the patch set (:func:`child_targets`).
        python: ``() -> interpreter path or None`` of that child (another torch release in another
            virtual environment); None: this interpreter.
    """

    name: str
    kind: str
    description: str
    apply: Callable[[ScenarioContext], ContextManager[Any]]
    unavailable: Callable[[], str | None] = lambda: None
    applies: Callable[[ScenarioContext], str | None] = lambda sc: None
    violates: tuple[str, ...] = ()
    device: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    python: Callable[[], str | None] | None = None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for ``device_type``, or None when autocast is off there.

    ``torch.is_autocast_enabled(device_type)`` / ``torch.get_autocast_dtype`` exist from torch 2.4;
    older releases only have the CPU/CUDA-specific getters.
    """
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4
        enabled = torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()
    if not enabled:
        return None
    getter = getattr(torch, "get_autocast_dtype", None)
    if getter is not None:
        return getter(device_type)
    return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


@contextlib.contextmanager
def _replaced(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """``owner.name = make(current)`` inside the block; the current binding is restored on exit."""
    current = getattr(owner, name)
    setattr(owner, name, make(current))
    try:
        yield
    finally:
        setattr(owner, name, current)


@contextlib.contextmanager
def transformer_slow_path(_: ScenarioContext | None = None) -> Iterator[None]:
    """PyTorch's nn.TransformerEncoderLayer/MultiheadAttention fast path switched off
    (``torch.backends.mha.set_fastpath_enabled(False)``): the reference runs the fast path
    wherever its conditions hold (eval, no grad, no autocast)."""
    mha = torch.backends.mha
    previous = mha.get_fastpath_enabled()
    mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        mha.set_fastpath_enabled(previous)


def _fastpath_unavailable() -> str | None:
    mha = getattr(torch.backends, "mha", None)
    if mha is None or not hasattr(mha, "set_fastpath_enabled"):
        return f"torch {torch.__version__} has no torch.backends.mha.set_fastpath_enabled"
    return None


def split_k_linear(original: Callable[..., torch.Tensor], chunks: int = SPLIT_K_CHUNKS) -> Callable[..., torch.Tensor]:
    """``F.linear`` computed as a sum of ``chunks`` partial products over K, accumulated in fp32.

    Under autocast the operands are first rounded to the autocast dtype (as autocast's own
    ``linear`` does), each partial product is an exact-input fp32 matmul, the fp32 partial sums
    are added and the result is rounded once to the autocast dtype: what a split-K kernel with
    fp32 accumulation computes. Without autocast (fp32 work) the partial products and the sum are
    fp32: the same values, summed in another order. Inputs with K < 2·chunks use ``original``.
    """
    def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        k = weight.shape[-1]
        if k < 2 * chunks or not input.is_floating_point():
            return original(input, weight, bias)
        low = _autocast_dtype(input.device.type)
        out_dtype = low if low is not None else torch.promote_types(input.dtype, weight.dtype)
        if low is not None:
            input, weight = input.to(low), weight.to(low)
            bias = bias.to(low) if bias is not None else None
        acc_dtype = torch.promote_types(out_dtype, torch.float32)
        with torch.autocast(input.device.type, enabled=False):
            parts = zip(input.tensor_split(chunks, dim=-1), weight.tensor_split(chunks, dim=-1))
            total = None
            for x_part, w_part in parts:
                partial = original(x_part.to(acc_dtype), w_part.to(acc_dtype))
                total = partial if total is None else total + partial
            if bias is not None:
                total = total + bias.to(acc_dtype)
        return total.to(out_dtype)
    return linear


@contextlib.contextmanager
def split_k(_: ScenarioContext | None = None, chunks: int = SPLIT_K_CHUNKS) -> Iterator[None]:
    """Every ``F.linear`` (``nn.Linear``, ``nn.MultiheadAttention``'s slow path) split over K."""
    import torch.nn.functional as F

    with _replaced(F, "linear", lambda original: split_k_linear(original, chunks)):
        yield


@contextlib.contextmanager
def thread_count(_: ScenarioContext | None = None) -> Iterator[None]:
    """Another intra-op thread count on the target: 2 when the reference ran with 1, else 1."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2 if previous == 1 else 1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def round_mantissa(t: torch.Tensor, bits: int = REDUCED_MANTISSA_BITS) -> torch.Tensor:
    """``t`` (float32) with its mantissa rounded to ``bits`` explicit bits, to nearest (ties away
    from zero), as TF32/HF32 matmul units read fp32 operands. NaN and ±Inf are kept; other dtypes
    are returned unchanged.

    Raises:
        ValueError: when ``bits`` is not in 0..23.
    """
    if not 0 <= bits <= 23:
        raise ValueError(f"round_mantissa: bits={bits} must be in 0..23 (fp32 has 23 explicit mantissa bits)")
    if t.dtype != torch.float32 or bits == 23:
        return t
    drop = 23 - bits
    raw = t.contiguous().view(torch.int32)
    rounded = ((raw + (1 << (drop - 1))) & ~((1 << drop) - 1)).view(torch.float32)
    return torch.where(torch.isfinite(t), rounded.view(t.shape), t)


def _rounding_inputs(original: Callable[..., torch.Tensor], n_inputs: int, bits: int) -> Callable[..., torch.Tensor]:
    def op(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensors = [a for a in args[:n_inputs] if isinstance(a, torch.Tensor)]
        if tensors and _autocast_dtype(tensors[0].device.type) is None:
            args = tuple(round_mantissa(a, bits) if i < n_inputs and isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(args))
        return original(*args, **kwargs)
    return op


@contextlib.contextmanager
def reduced_mantissa(_: ScenarioContext | None = None, bits: int = REDUCED_MANTISSA_BITS) -> Iterator[None]:
    """fp32 operands of ``F.linear``, ``torch.matmul``, ``torch.bmm``, ``F.conv1d`` and ``F.conv2d``
    rounded to ``bits`` mantissa bits (TF32 on CUDA, HF32 on Ascend, emulated on the CPU); ops under
    autocast are left alone (they already run in the autocast dtype)."""
    import torch.nn.functional as F

    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(F, "linear", lambda o: _rounding_inputs(o, 2, bits)))
        stack.enter_context(_replaced(torch, "matmul", lambda o: _rounding_inputs(o, 2, bits)))
        stack.enter_context(_replaced(torch, "bmm", lambda o: _rounding_inputs(o, 2, bits)))
        stack.enter_context(_replaced(F, "conv1d", lambda o: _rounding_inputs(o, 2, bits)))
        stack.enter_context(_replaced(F, "conv2d", lambda o: _rounding_inputs(o, 2, bits)))
        yield


def _cuda_unavailable() -> str | None:
    return None if torch.cuda.is_available() else "no CUDA device on this machine"


# faults ----------------------------------------------------------------------------------------

#: The decoder FFN weight the whole-model checks perturb (as tests/aurora/test_sensitivity.py).
MODEL_WEIGHT = "dec_layers.4.ffn_layer.ffn.0.weight"


def fault_weight(sc: ScenarioContext) -> str:
    """The weight a scale fault perturbs: the check's own ``fault_weight`` when the catalogue names
    one (the weight the sensitivity tests scale), decoder layer 4's first FFN weight for the
    whole-model checks, else ``checks.sensitive_weight`` (the largest trainable weight matrix).

    Raises:
        ValueError: the check has no module with a weight matrix.
    """
    from pytest_npu_parity.aurora import checks

    if sc.module is None:
        raise ValueError(f"check {sc.check.name!r} has no module to perturb")
    explicit = getattr(sc.check, "fault_weight", None)
    if explicit:
        return explicit
    names = dict(sc.module.named_parameters())
    for candidate in (MODEL_WEIGHT, f"model.{MODEL_WEIGHT}"):
        if candidate in names:
            return candidate
    return checks.sensitive_weight(sc.module)


def fault_bias(sc: ScenarioContext) -> str:
    """The bias a dropped-bias fault zeroes: the bias of ``fault_weight``'s layer when it has one,
    else the largest trainable 1-D ``bias`` parameter.

    Raises:
        ValueError: the module has no bias.
    """
    weight = fault_weight(sc)
    names = dict(sc.module.named_parameters())
    paired = weight.rsplit(".", 1)[0] + ".bias"
    if paired in names:
        return paired
    biases = [(p.requires_grad, p.numel(), n) for n, p in names.items() if n.endswith("bias") and p.dim() == 1]
    if not biases:
        raise ValueError(f"{type(sc.module).__name__} has no bias to drop")
    return max(biases)[2]


def scaled_weight(factor: float) -> Callable[[ScenarioContext], ContextManager[Any]]:
    """Fault: ``fault_weight`` multiplied by ``factor`` on the target side."""
    def apply(sc: ScenarioContext) -> ContextManager[Any]:
        from pytest_npu_parity.aurora import checks

        return checks.scaled_parameter(sc.module, fault_weight(sc), factor)
    return apply


def dropped_bias(sc: ScenarioContext) -> ContextManager[Any]:
    """Fault: ``fault_bias`` zeroed on the target side (a kernel that ignores the bias)."""
    from pytest_npu_parity.aurora import checks

    return checks.scaled_parameter(sc.module, fault_bias(sc), 0.0)


def _shift_mask(mask: torch.Tensor) -> torch.Tensor:
    """A causal mask shifted one column right: position i also sees position i + 1."""
    shifted = torch.zeros_like(mask)
    shifted[..., :, 1:] = mask[..., :, :-1]
    return shifted


@contextlib.contextmanager
def causal_mask_off_by_one(_: ScenarioContext | None = None) -> Iterator[None]:
    """Fault: every ``causal_attention_mask`` of aurora (decoder layers, retriever) lets each
    position see one future position (``triu(diagonal=2)`` instead of ``diagonal=1``)."""
    import aurora.modeling_aurora as modeling
    import aurora.prototype_retriever as retriever

    def wrap(current: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def off_by_one(seq_length: int, *args: Any, **kwargs: Any) -> torch.Tensor:
            return _shift_mask(current(seq_length, *args, **kwargs))
        return off_by_one

    with _replaced(modeling, "causal_attention_mask", wrap), _replaced(retriever, "causal_attention_mask", wrap):
        yield


@contextlib.contextmanager
def causal_mask_dropped(_: ScenarioContext | None = None) -> Iterator[None]:
    """Fault: the causal mask replaced by zeros (``checks.dropped_causal_mask``)."""
    from pytest_npu_parity.aurora import checks

    with checks.dropped_causal_mask():
        yield


@contextlib.contextmanager
def wrong_attention_scale(_: ScenarioContext | None = None) -> Iterator[None]:
    """Fault: ``AuroraAttention`` scales scores by 1/√hidden_size instead of 1/√head_dim (the
    query is multiplied by √(head_dim / hidden_size) before the upstream scaled dot product)."""
    from aurora.modeling_aurora import AuroraAttention

    def wrap(original):
        def attention(self, Q, K, V, bias=None, attn_mask=None):
            return original(self, Q * math.sqrt(Q.size(-1) / self.hidden_size), K, V, bias=bias, attn_mask=attn_mask)
        return attention

    with _replaced(AuroraAttention, "_scaled_dot_product_attention", wrap):
        yield


def _in_bf16(original: Callable[..., torch.Tensor], n_tensors: int) -> Callable[..., torch.Tensor]:
    """``original`` computed with its first ``n_tensors`` tensor arguments (and tensor keyword
    arguments) in bf16, autocast off, the result cast to the dtype ``original`` returns."""
    def op(*args: Any, **kwargs: Any) -> torch.Tensor:
        expected = original(*args, **kwargs)  # also performs in-place updates (BatchNorm running stats)
        if not expected.is_floating_point():
            return expected
        low_args = tuple(a.detach().clone().to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point()
                         and i < n_tensors else a for i, a in enumerate(args))
        low_kwargs = {k: v.detach().clone().to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point()
                      else v for k, v in kwargs.items() if k != "dtype"}
        with torch.autocast(expected.device.type, enabled=False):
            low = original(*low_args, **low_kwargs)
        return low.to(expected.dtype)
    return op


@contextlib.contextmanager
def norm_softmax_in_bf16(_: ScenarioContext | None = None) -> Iterator[None]:
    """Fault: ``F.softmax``, ``F.layer_norm`` and ``F.batch_norm`` computed in bf16 where fp32 is
    expected (fp32 work, or the ops autocast keeps in fp32), the result cast back."""
    import torch.nn.functional as F

    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(F, "softmax", lambda o: _in_bf16(o, 1)))
        stack.enter_context(_replaced(F, "layer_norm", lambda o: _in_bf16(o, 4)))
        stack.enter_context(_replaced(F, "batch_norm", lambda o: _in_bf16(o, 5)))
        yield


@contextlib.contextmanager
def device_rng_dropout(_: ScenarioContext | None = None) -> Iterator[None]:
    """Fault: dropout draws its mask from torch's default (device) generator instead of the shared
    seeded CPU stream of ``rng.same_randomness`` (as a port that bypasses the shared stream does)."""
    from pytest_npu_parity import rng

    device_dropout = rng._ORIGINALS[(torch.nn.functional, "dropout")]

    def wrap(_shared):
        def dropout(self, input, p=0.5, training=True, inplace=False):
            return device_dropout(input, p, training, inplace)
        return dropout

    with _replaced(rng._CpuDraws, "dropout", wrap):
        yield


def _rng_unavailable() -> str | None:
    from pytest_npu_parity import rng

    if not hasattr(getattr(rng, "_CpuDraws", None), "dropout") or not hasattr(rng, "_ORIGINALS"):
        return "rng.same_randomness has no shared dropout stream to bypass"
    return None


def _contains(*class_names: str) -> Callable[[ScenarioContext], str | None]:
    """Applicability: the check's module contains one of ``class_names`` (by class name)."""
    def applies(sc: ScenarioContext) -> str | None:
        if sc.module is not None and any(type(m).__name__ in class_names for m in sc.module.modules()):
            return None
        return f"no {' or '.join(class_names)} in this computation"
    return applies


def _training(sc: ScenarioContext) -> str | None:
    if sc.module is not None and any(m.training for m in sc.module.modules()):
        return None
    return "no module in training mode (no dropout)"


#: Environment of the ``cpu_kernel_path`` variant's child: the kernel choice of a CPU without
#: AVX-512 and AMX (e.g. an AMD EPYC of the Zen 2/3 lines) on any x86 machine. ATen reads
#: ``ATEN_CPU_CAPABILITY`` and oneDNN ``ONEDNN_MAX_CPU_ISA`` once, at first use.
CPU_KERNEL_PATH_ENV = (("ATEN_CPU_CAPABILITY", "default"), ("ONEDNN_MAX_CPU_ISA", "AVX2"))
#: Environment variable naming the interpreter of the ``torch_release`` variant.
OTHER_PYTHON_ENV = "NPU_PARITY_OTHER_PYTHON"


def _other_python_unavailable() -> str | None:
    path = os.environ.get(OTHER_PYTHON_ENV)
    if not path:
        return f"set {OTHER_PYTHON_ENV} to the python of a venv with another torch release (and this project)"
    return None if os.access(path, os.X_OK) else f"{OTHER_PYTHON_ENV}={path} is not an executable"


def child_targets(scenario: "Scenario", checks: Sequence[str], recipes: Sequence[str], seed: int,
                  timeout_s: float = 3600) -> dict[tuple[str, str], Any]:
    """Target outputs of every (check, recipe) computed in a child process with ``scenario.env``.

    The child (``python benchmarks/calibration.py --child-targets FILE …``) builds the seeded
    full model and the CO2 batch, captures the submodule inputs on its own kernels (as a target
    machine does), and runs each check's target side under the recipe and the patch set. Leaves
    come back through one safetensors file (no pickle).

    Returns:
        ``{(check, recipe): {leaf: tensor or None}}``, or an error string for a case that raised.

    Raises:
        RuntimeError: the child failed as a whole (its stderr's last lines in the message).
    """
    import json as _json
    import subprocess
    import sys
    import tempfile

    from safetensors import safe_open

    python = (scenario.python() if scenario.python else None) or sys.executable
    env = {**os.environ, **dict(scenario.env)}
    env.pop("NPU_PARITY_TORCH_NPU_UNUSABLE", None)
    # This file runs as a script there: the repository root goes first on its path, as the root was with
    # ``python -m`` from it.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="npu-parity-cal-") as tmp:
        out = os.path.join(tmp, "targets.safetensors")
        proc = subprocess.run([python, str(Path(__file__).resolve()), "--child-targets", out,
                               "--checks", ",".join(checks), "--recipes", ",".join(recipes), "--seed", str(seed)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"calibration child for {scenario.name} failed ({proc.returncode}): "
                               + "\n".join(proc.stderr.strip().splitlines()[-5:]))
        results: dict[tuple[str, str], Any] = {}
        with safe_open(out, framework="pt") as fh:
            meta = _json.loads(fh.metadata()["cases"])
            for key, info in meta.items():
                check, recipe = key.split("|")
                if "error" in info:
                    results[(check, recipe)] = info["error"]
                    continue
                results[(check, recipe)] = {leaf: (fh.get_tensor(f"{key}|{leaf}") if present else None)
                                            for leaf, present in info["leaves"].items()}
    return results


def _child_main(argv: Sequence[str]) -> int:
    """Entry of :func:`child_targets`'s child: compute and save the target side of every case."""
    import argparse
    import json as _json

    from safetensors.torch import save_file

    from pytest_npu_parity.aurora import checks as catalogue
    from pytest_npu_parity.aurora import factory, inputs, patches
    from pytest_npu_parity.runner import ParityCase, ParitySession

    parser = argparse.ArgumentParser(prog="python benchmarks/calibration.py")
    parser.add_argument("--child-targets", required=True)
    parser.add_argument("--checks", required=True)
    parser.add_argument("--recipes", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(list(argv))
    aurora = catalogue.build_context(factory.get_model("full", seed=0), inputs.make_batch())
    session = ParitySession(torch.device("cpu"), reference="cpu", seed=args.seed)
    tensors: dict[str, torch.Tensor] = {}
    cases: dict[str, Any] = {}
    for check_name in filter(None, args.checks.split(",")):
        fn, fargs, fkwargs = catalogue.BY_NAME[check_name].build(aurora)
        for recipe in filter(None, args.recipes.split(",")):
            key = f"{check_name}|{recipe}"
            case = ParityCase(session, f"calibration-child::{check_name}", recipe, patches=patches.patched)
            try:
                leaves, _ = case._run(fn, fargs, fkwargs, torch.device("cpu"), seed=args.seed, patched=True, grad=False)
            except (ValueError, RuntimeError, TypeError, KeyError) as exc:
                cases[key] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            cases[key] = {"leaves": {leaf: t is not None for leaf, t in leaves.items()}}
            for leaf, t in leaves.items():
                if t is not None:
                    tensors[f"{key}|{leaf}"] = t.detach().to("cpu").contiguous()
    save_file(tensors, args.child_targets, metadata={"cases": _json.dumps(cases), "torch": torch.__version__})
    return 0


@contextlib.contextmanager
def _nothing(_: ScenarioContext | None = None) -> Iterator[None]:
    yield


VARIANTS: list[Scenario] = [
    Scenario("patch_set", "variant", "the NPU adaptation patch set alone", _nothing),
    Scenario("transformer_slow_path", "variant", "nn.Transformer*/MultiheadAttention fast path off on the target",
             transformer_slow_path, _fastpath_unavailable,
             applies=_contains("TransformerEncoderLayer", "TransformerDecoderLayer", "MultiheadAttention")),
    Scenario("split_k", "variant", f"F.linear as {SPLIT_K_CHUNKS} K-chunks, fp32 accumulation", split_k),
    Scenario("thread_count", "variant", "other intra-op thread count (1 <-> 2)", thread_count),
    Scenario("reduced_mantissa", "variant",
             f"TF32/HF32-like fp32 linear/matmul/conv operands ({REDUCED_MANTISSA_BITS}-bit mantissa)",
             reduced_mantissa, violates=("fp32",)),
    Scenario("cpu_kernel_path", "variant",
             "another x86 CPU: ATen's default kernels, oneDNN capped at AVX2 (no AVX-512/AMX), in a child process",
             _nothing, env=CPU_KERNEL_PATH_ENV),
    Scenario("torch_release", "variant",
             f"another torch release in a child process (the interpreter in ${OTHER_PYTHON_ENV}, e.g. torch 2.5.1)",
             _nothing, _other_python_unavailable, env=(("TORCH_DEVICE_BACKEND_AUTOLOAD", "0"),),
             python=lambda: os.environ.get(OTHER_PYTHON_ENV)),
    Scenario("cuda", "variant", "the target on CUDA (patch set, no other change)", _nothing, _cuda_unavailable,
             device="cuda"),
]

FAULTS: list[Scenario] = [
    Scenario("weight_x(1+1e-4)", "fault", "one weight matrix scaled by (1 + 1e-4)", scaled_weight(1 + 1e-4)),
    Scenario("weight_x(1+1e-3)", "fault", "one weight matrix scaled by (1 + 1e-3)", scaled_weight(1 + 1e-3)),
    Scenario("causal_mask_off_by_one", "fault", "causal mask lets each position see the next one",
             causal_mask_off_by_one, applies=_contains("AuroraDecoderLayer", "Retriever")),
    Scenario("causal_mask_dropped", "fault", "causal mask replaced by zeros", causal_mask_dropped,
             applies=_contains("AuroraDecoderLayer", "Retriever")),
    Scenario("attention_scale", "fault", "attention scores scaled by 1/sqrt(hidden) instead of 1/sqrt(head_dim)",
             wrong_attention_scale, applies=_contains("AuroraAttention")),
    Scenario("bias_dropped", "fault", "one bias zeroed", dropped_bias),
    Scenario("norm_softmax_bf16", "fault", "softmax/layer_norm/batch_norm computed in bf16 where fp32 is expected",
             norm_softmax_in_bf16),
    Scenario("device_rng_dropout", "fault", "dropout mask from the device RNG stream, not the shared one",
             device_rng_dropout, _rng_unavailable, applies=_training),
]

SCENARIOS: list[Scenario] = VARIANTS + FAULTS


# --------------------------------------------------------------------------------------------
# policies


@dataclass(frozen=True)
class PolicySpec:
    """One policy to calibrate: an allclose tolerance or a golden policy per recipe.

    Attributes:
        name: table column name.
        kind: ``allclose`` or ``golden``.
        per_recipe: ``{recipe: Tolerance | GoldenPolicy}``.
        default: True for the policy the suite uses by default.
        note: one line for the report.
    """

    name: str
    kind: str
    per_recipe: dict[str, Tolerance | GoldenPolicy]
    default: bool = False
    note: str = ""

    def for_recipe(self, recipe: str) -> Tolerance | GoldenPolicy:
        """The policy under ``recipe`` (``KeyError`` naming the policy if it has none)."""
        try:
            return self.per_recipe[recipe]
        except KeyError:
            raise KeyError(f"policy {self.name!r} has no setting for recipe {recipe!r}") from None

    def describe(self, recipe: str) -> str:
        return self.for_recipe(recipe).describe()


def _golden(recipe: str, factor: float = 1.0) -> GoldenPolicy:
    base = default_golden_for_recipe(recipe)
    return base.replace(rmse_ratio=base.rmse_ratio * factor, max_rel_ratio=base.max_rel_ratio * factor,
                        mean_rel_ratio=base.mean_rel_ratio * factor, small_value_ratio=base.small_value_ratio * factor)


def default_policies() -> list[PolicySpec]:
    """The policies the harness judges every case by: the allclose defaults and alternatives for
    bf16 (larger budgets, a looser tolerance, ``torch.testing.assert_close``'s defaults) and
    our golden limits (2/10/2/2) at ×0.75, ×1 and ×2, and msprobe 26.2.0's benchmark standard
    (``golden msprobe``, op level L0: the checks are whole submodules, not single ops)."""
    fp32 = FP32
    return [
        PolicySpec("allclose", "allclose", {"fp32": fp32, "bf16": LOW_PRECISION}, default=True,
                   note="suite default: fp32 rtol=atol=1e-5 budget 0; bf16 rtol=atol=1e-3 budget 1e-3"),
        PolicySpec("allclose_bf16_budget1e-2", "allclose",
                   {"fp32": fp32, "bf16": LOW_PRECISION.replace(budget=1e-2)},
                   note="bf16 rtol=atol=1e-3, 1 % of elements may be out of tolerance"),
        PolicySpec("allclose_bf16_budget1e-1", "allclose",
                   {"fp32": fp32, "bf16": LOW_PRECISION.replace(budget=1e-1)},
                   note="bf16 rtol=atol=1e-3, 10 % of elements may be out of tolerance"),
        PolicySpec("allclose_bf16_1e-2", "allclose",
                   {"fp32": fp32, "bf16": LOW_PRECISION.replace(rtol=1e-2, atol=1e-2)},
                   note="bf16 rtol=atol=1e-2, budget 1e-3"),
        PolicySpec("assert_close", "allclose",
                   {"fp32": Tolerance(rtol=1.3e-6, atol=1e-5), "bf16": Tolerance(rtol=1.6e-2, atol=1e-5)},
                   note="torch.testing.assert_close defaults (fp32 1.3e-6/1e-5, bf16 1.6e-2/1e-5)"),
        PolicySpec("golden", "golden", {"fp32": _golden("fp32"), "bf16": _golden("bf16")}, default=True,
                   note="our golden limits: ratios rmse 2, max_rel 10, mean_rel 2, small 2 (msprobe's L0 values)"),
        PolicySpec("golden_floor", "golden", {"fp32": _golden("fp32").replace(allclose_floor=True),
                                              "bf16": _golden("bf16").replace(allclose_floor=True)}, default=True,
                   note="golden limits with the allclose floor (golden floor): a leaf within allclose passes; "
                        "the suite default for bf16 and fp32 training checks"),
        PolicySpec("golden_msprobe", "golden", {"fp32": MSPROBE_GOLDEN, "bf16": MSPROBE_GOLDEN},
                   note="msprobe 26.2.0 benchmark standard, L0: its metrics, floors 2^-14/2^-8, limits 2/10/2/2"),
        PolicySpec("golden_x0.75", "golden", {"fp32": _golden("fp32", 0.75), "bf16": _golden("bf16", 0.75)},
                   note="golden, every limit x0.75 (rmse 1.5, max_rel 7.5, mean_rel 1.5, small 1.5)"),
        PolicySpec("golden_x2", "golden", {"fp32": _golden("fp32", 2.0), "bf16": _golden("bf16", 2.0)},
                   note="golden, every limit x2 (rmse 4, max_rel 20, mean_rel 4, small 4)"),
    ]


# --------------------------------------------------------------------------------------------
# results


@dataclass
class CaseOutcome:
    """One (check, recipe, scenario) run and every policy's verdict on it.

    Attributes:
        status: ``judged`` (target differs from the reference), ``no effect`` (bitwise equal: not
            counted in the rates), ``not applicable`` (the scenario cannot touch this computation:
            not run), ``unavailable`` (scenario cannot run here) or ``error``.
        effect_max_abs, effect_rel_l2: target vs reference, worst leaf (tensor units / dimensionless).
        fault_size_rel_l2: for a fault, how far it moves the output at the golden's precision: the
            target-vs-reference rel_l2 of the same fault under ``fp32`` (for a bf16 case, its
            fp32 twin; 0 when the fault had no effect there); None when unknown.
        resolvable: for a fault, whether ``fault_size_rel_l2`` exceeds the reference's own error
            against the golden (reference-vs-golden rel_l2); None when either is unknown. A fault
            below that level is under the resolution of the recipe: no comparison of outputs can
            be expected to see it. (The bf16 target-vs-reference difference itself is no measure
            of the fault: it also holds the re-rounding noise of the changed computation.)
        recipe_violation: the variant breaks the recipe's contract (``Scenario.violates``): a
            failing verdict is right and the case is not counted as a false failure.
        verdicts: ``{policy name: "pass" | "fail" | "n/a"}`` (``n/a``: golden unavailable).
        details: ``{policy name: {...}}`` — allclose: worst leaf's mismatched share and err/tol;
            golden: the ratios of the worst leaf.
    """

    check: str
    recipe: str
    scenario: str
    kind: str
    status: str
    message: str | None = None
    effect_max_abs: float | None = None
    effect_rel_l2: float | None = None
    fault_size_rel_l2: float | None = None
    resolvable: bool | None = None
    recipe_violation: bool = False
    verdicts: dict[str, str] = field(default_factory=dict)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)
    duration_s: float = 0.0

    def expected_verdict(self) -> str:
        """``pass`` for a variant, ``fail`` for a fault or a recipe violation."""
        return "pass" if self.kind == "variant" and not self.recipe_violation else "fail"

    def wrong(self, policy: str) -> bool | None:
        """True when ``policy``'s verdict is wrong, None when it has none (not judged or n/a)."""
        verdict = self.verdicts.get(policy)
        if self.status != "judged" or verdict not in ("pass", "fail"):
            return None
        return verdict != self.expected_verdict()


@dataclass
class CalibrationReport:
    """Every case, the policies judged, the golden availability per check and run metadata."""

    cases: list[CaseOutcome]
    policies: list[PolicySpec]
    scenarios: list[Scenario]
    golden: dict[str, dict[str, dict[str, Any]]]  # recipe -> check -> golden_info()
    meta: dict[str, Any]

    def rates(self) -> list[dict[str, Any]]:
        """Per policy and recipe (and ``all``): false failures / judged variants and false passes /
        judged faults, with the rates (None when nothing was judged) and the n/a count."""
        rows = []
        recipes = sorted({c.recipe for c in self.cases}, key=lambda r: (r != "fp32", r))
        for policy in self.policies:
            for recipe in recipes + ["all"]:
                cases = [c for c in self.cases if recipe == "all" or c.recipe == recipe]
                row: dict[str, Any] = {"policy": policy.name, "recipe": recipe, "default": policy.default}
                for kind, label in (("variant", "false_failure"), ("fault", "false_pass")):
                    judged = [c for c in cases if c.kind == kind and not c.recipe_violation
                              and c.wrong(policy.name) is not None]
                    wrong = [c for c in judged if c.wrong(policy.name)]
                    row[f"{label}_count"] = len(wrong)
                    row[f"{kind}s_judged"] = len(judged)
                    row[f"{label}_rate"] = len(wrong) / len(judged) if judged else None
                resolvable = [c for c in cases if c.kind == "fault" and c.resolvable is not False
                              and c.wrong(policy.name) is not None]
                row["false_pass_resolvable_count"] = sum(1 for c in resolvable if c.wrong(policy.name))
                row["faults_resolvable_judged"] = len(resolvable)
                row["false_pass_resolvable_rate"] = (row["false_pass_resolvable_count"] / len(resolvable)
                                                     if resolvable else None)
                violations = [c for c in cases if c.recipe_violation and c.wrong(policy.name) is not None]
                row["recipe_violations_flagged"] = sum(1 for c in violations if not c.wrong(policy.name))
                row["recipe_violations_judged"] = len(violations)
                row["not_applicable"] = sum(1 for c in cases
                                            if c.status == "judged" and c.verdicts.get(policy.name) == "n/a")
                rows.append(row)
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict: meta, policies (per recipe text), scenarios, golden availability, rates, cases."""
        return {
            "meta": self.meta,
            "policies": [{"name": p.name, "kind": p.kind, "default": p.default, "note": p.note,
                          "per_recipe": {r: p.describe(r) for r in p.per_recipe}} for p in self.policies],
            "scenarios": [{"name": s.name, "kind": s.kind, "description": s.description} for s in self.scenarios],
            "golden": self.golden,
            "rates": self.rates(),
            "cases": [_jsonable(dataclasses.asdict(c)) for c in self.cases],
        }

    def to_markdown(self) -> str:
        """The Markdown report: rates table, scenario × policy table per recipe, effect sizes, golden availability."""
        return format_markdown(self)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _pct(k: int, n: int) -> str:
    return f"{k}/{n} ({100.0 * k / n:.0f} %)" if n else "–"


def _golden_cell(info: dict[str, Any] | None) -> str:
    if not info:
        return "–"
    if info.get("unavailable"):
        return "unavailable: " + info["unavailable"].replace("|", "/")
    return f"{info['golden_dtype']}; ref. error {info['reference_rel_l2']:.2g} / {info['reference_max_rel']:.2g}"


def format_markdown(report: CalibrationReport) -> str:
    """Render ``report`` as Markdown (see ``CalibrationReport.to_markdown``)."""
    meta = report.meta
    lines = ["# Verdict calibration", ""]
    lines.append(f"Checks: {', '.join(meta['checks'])}; recipes: {', '.join(meta['recipes'])}; model "
                 f"`{meta['size']}`; {meta['machine']}; torch {meta['torch']}; {meta['threads']} intra-op "
                 f"thread(s); {meta['duration_s']:.0f} s"
                 + (f" (load average at the end {meta['load_average'][0]:g})" if meta.get("load_average") else "")
                 + ".")
    lines.append("")
    lines.append("A case is one check × recipe × scenario whose target output differs from the reference "
                 "(cases where the scenario leaves the output bitwise unchanged, or cannot touch the "
                 "computation, are not counted). False failure: a legitimate variant fails. False pass: a "
                 "real fault passes. A fault is *above the reference's own error* when, measured at the "
                 "golden's precision (its fp32 twin), it moves the output by more (relative L2) than the "
                 "reference differs from the golden; below that, the recipe cannot resolve it. A recipe "
                 "violation (a TF32/HF32-like target under the strict fp32 recipe) should fail.")
    lines += ["", "## Rates per policy", "",
              "| policy | recipe | false failures (variants) | false passes (faults) | false passes (faults above "
              "the reference's own error) | recipe violations flagged | golden n/a | settings |",
              "|---|---|---|---|---|---|---|---|"]
    for row in report.rates():
        policy = next(p for p in report.policies if p.name == row["policy"])
        name = f"**{policy.name}**" if policy.default else policy.name
        settings = policy.describe(row["recipe"]) if row["recipe"] in policy.per_recipe else policy.note
        lines.append(f"| {name} | {row['recipe']} | {_pct(row['false_failure_count'], row['variants_judged'])} | "
                     f"{_pct(row['false_pass_count'], row['faults_judged'])} | "
                     f"{_pct(row['false_pass_resolvable_count'], row['faults_resolvable_judged'])} | "
                     f"{_pct(row['recipe_violations_flagged'], row['recipe_violations_judged'])} | "
                     f"{row['not_applicable'] or ''} | "
                     f"{settings} |")
    for recipe in meta["recipes"]:
        lines += ["", f"## {recipe}: checks passing per scenario", "",
                  "Cell: checks that pass / checks where the scenario changed the output. Variants should "
                  "pass everywhere, faults nowhere. `rel_l2`: the smallest and largest target-vs-reference "
                  "relative L2 difference among those checks; `below ref. error`: faults that moved the "
                  "output less than the reference's own error against the golden.", ""]
        header = ("| scenario | kind | rel_l2 | below ref. error | "
                  + " | ".join(p.name for p in report.policies) + " |")
        lines += [header, "|" + "---|" * (4 + len(report.policies))]
        for scenario in report.scenarios:
            cases = [c for c in report.cases if c.recipe == recipe and c.scenario == scenario.name]
            judged = [c for c in cases if c.status == "judged"]
            if not judged:
                lines.append(f"| {scenario.name} | {scenario.kind} | – | – | "
                             + " | ".join("–" for _ in report.policies) + " |")
                continue
            effects = [c.effect_rel_l2 or 0.0 for c in judged]
            effect = f"{min(effects):.2g}–{max(effects):.2g}" if len(effects) > 1 else f"{effects[0]:.2g}"
            below = sum(1 for c in judged if c.resolvable is False) if scenario.kind == "fault" else None
            if scenario.kind == "variant" and recipe in scenario.violates:
                below = "recipe violation"
            cells = []
            for policy in report.policies:
                verdicts = [c.verdicts.get(policy.name) for c in judged]
                passed = sum(v == "pass" for v in verdicts)
                counted = sum(v in ("pass", "fail") for v in verdicts)
                cells.append(f"{passed}/{counted}" if counted else "n/a")
            lines.append(f"| {scenario.name} | {scenario.kind} | {effect} | {'' if below is None else below} | "
                         + " | ".join(cells) + " |")
    skipped = sorted({(c.scenario, c.status, c.message or "") for c in report.cases
                      if c.status in ("unavailable", "error")})
    if skipped:
        lines += ["", "## Not run", ""]
        lines += [f"- `{s}` ({status}): {msg}" for s, status, msg in skipped]
    lines += ["", "## Golden per check", "",
              "The golden each check got, and the reference's own error against it (relative L2 / max "
              "relative error over elements with |golden| >= the small-value threshold).", "",
              "| check | " + " | ".join(meta["recipes"]) + " |", "|---|" + "---|" * len(meta["recipes"])]
    for check in meta["checks"]:
        lines.append(f"| {check} | " + " | ".join(_golden_cell(report.golden.get(r, {}).get(check))
                                                  for r in meta["recipes"]) + " |")
    lines += ["", "## Policies", ""]
    lines += [f"- `{p.name}`{' (default)' if p.default else ''}: {p.note}" for p in report.policies]
    lines += ["", "## Scenarios", ""]
    lines += [f"- `{s.name}` ({s.kind}): {s.description}" for s in report.scenarios]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# the harness


def _leaves_equal(a: dict[str, torch.Tensor | None], b: dict[str, torch.Tensor | None]) -> bool:
    if a.keys() != b.keys():
        return False
    for path, x in a.items():
        y = b[path]
        if (x is None) != (y is None):
            return False
        if x is not None and (x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y)):
            # NaN never equals itself: equal NaN positions still count as equal outputs
            if not (x.shape == y.shape and x.dtype == y.dtype and x.is_floating_point()
                    and torch.equal(torch.isnan(x), torch.isnan(y))
                    and torch.equal(torch.nan_to_num(x), torch.nan_to_num(y))):
                return False
    return True


def _judge(policies: Sequence[PolicySpec], recipe: str, target: dict, reference: dict,
           golden: dict | None, name: str) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    verdicts: dict[str, str] = {}
    details: dict[str, dict[str, Any]] = {}
    for policy in policies:
        setting = policy.for_recipe(recipe)
        if policy.kind == "allclose":
            result = compare(target, reference, setting, name=name)
            worst = max(result.leaves, key=lambda leaf: (leaf.mismatched_frac, leaf.err_ratio), default=None)
            verdicts[policy.name] = "pass" if result.passed else "fail"
            if worst is not None:
                details[policy.name] = {"leaf": worst.path, "mismatched_frac": worst.mismatched_frac,
                                        "err_ratio": worst.err_ratio, "problem": worst.problem}
                if len(result.leaves) > 1:
                    details[policy.name]["leaves"] = {leaf.path: leaf.mismatched_frac for leaf in result.leaves}
        else:
            if golden is None:
                verdicts[policy.name] = "n/a"
                continue
            result = judge_golden(target, reference, golden, setting, name=name, work_dtype=WORK_DTYPES.get(recipe))
            verdicts[policy.name] = "pass" if result.passed else "fail"
            worst = max(result.leaves, key=_golden_margin, default=None)
            if worst is not None:
                details[policy.name] = {"leaf": worst.path, "ratios": dict(getattr(worst, "ratios", {})),
                                        "nonfinite_mismatched": worst.nonfinite_mismatched, "problem": worst.problem,
                                        "leaves": {leaf.path: dict(getattr(leaf, "ratios", {}))
                                                   for leaf in result.leaves}}
    return verdicts, details


def _golden_margin(leaf: Any) -> tuple[bool, float]:
    """Sort key: failing leaves first, then by the worst ratio / limit (NaN counts as worst)."""
    margin = leaf.worst_ratio[1] if hasattr(leaf, "worst_ratio") else 0.0
    return (not leaf.passed, math.inf if math.isnan(margin) else margin)


def _load_average() -> list[float] | None:
    """The 1/5/15-minute load averages (the machine may be shared), or None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _fault_sizes(cases: list[CaseOutcome], golden_info: dict[str, dict[str, dict[str, Any]]]) -> None:
    """Fill ``fault_size_rel_l2`` and ``resolvable`` of every judged fault (see ``CaseOutcome``)."""
    fp32 = {(c.check, c.scenario): c for c in cases if c.recipe == "fp32"}
    for case in cases:
        if case.kind != "fault" or case.status != "judged":
            continue
        twin = fp32.get((case.check, case.scenario))
        if twin is None or twin.status not in ("judged", "no effect"):
            continue
        case.fault_size_rel_l2 = twin.effect_rel_l2 if twin.status == "judged" else 0.0
        noise = golden_info.get(case.recipe, {}).get(case.check, {}).get("reference_rel_l2")
        if noise is not None and case.fault_size_rel_l2 is not None:
            case.resolvable = case.fault_size_rel_l2 > noise


def reference_error(reference: dict, golden: dict, recipe: str) -> dict[str, Any]:
    """The reference's own error against the golden: ``{"golden_dtype", "unavailable": None,
    "reference_rel_l2", "reference_max_rel"}``, worst over floating leaves (max relative error
    over golden elements at or above the recipe's small-value threshold)."""
    threshold = default_golden_for_recipe(recipe).small_value_threshold
    rel_l2 = max_rel = 0.0
    for path, e in reference.items():
        g = golden.get(path)
        if e is None or g is None or not e.is_floating_point() or e.shape != g.shape:
            continue
        e64, g64 = e.to(torch.float64), g.to(torch.float64)
        finite = torch.isfinite(e64) & torch.isfinite(g64)
        diff = (e64 - g64)[finite]
        norm = float(g64[finite].norm())
        if norm > 0:
            rel_l2 = max(rel_l2, float(diff.norm()) / norm)
        normal = finite & (g64.abs() >= threshold)
        if normal.any():
            max_rel = max(max_rel, float(((e64 - g64).abs()[normal] / g64.abs()[normal]).max()))
    return {"golden_dtype": str(golden_dtype(recipe)).removeprefix("torch."), "unavailable": None,
            "reference_rel_l2": rel_l2, "reference_max_rel": max_rel}


def _effect(target: dict, reference: dict) -> tuple[float | None, float | None]:
    result = compare(target, reference, FP32)
    finite = [leaf for leaf in result.leaves if leaf.problem is None]
    if not finite:
        return None, None
    return max(leaf.max_abs for leaf in finite), max(leaf.rel_l2 for leaf in finite)


def run_calibration(checks: Sequence[str] = DEFAULT_CHECKS, recipes: Sequence[str] = DEFAULT_RECIPES, *,
                    scenarios: Sequence[Scenario] | None = None, policies: Sequence[PolicySpec] | None = None,
                    seed: int = 0, aurora: Any = None,
                    progress: Callable[[str], None] | None = None) -> CalibrationReport:
    """Run the calibration (see the module docstring).

    Args:
        checks: names from ``aurora.checks.BY_NAME``.
        recipes: recipe names (``fp32``, ``bf16``).
        scenarios: the variants and faults (default ``SCENARIOS``).
        policies: the policies to judge by (default ``default_policies()``).
        seed: the shared randomness seed of every run.
        aurora: a prebuilt ``checks.AuroraContext`` (default: the seeded full model, seed 0, on the
            real CO2 batch; the catalogue's context needs the full config's nine decoder layers).
        progress: called with one line per finished case (e.g. ``print``).

    Returns:
        A ``CalibrationReport``.

    Raises:
        KeyError: an unknown check name (the message lists the known ones).
        ValueError: an unknown recipe.
    """
    from pytest_npu_parity.aurora import checks as catalogue
    from pytest_npu_parity.aurora import factory, inputs, patches
    from pytest_npu_parity.recipes import RECIPES
    from pytest_npu_parity.runner import ParityCase, ParitySession, owner_module

    unknown = [c for c in checks if c not in catalogue.BY_NAME]
    if unknown:
        raise KeyError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(catalogue.BY_NAME)}")
    bad = [r for r in recipes if r not in RECIPES or r not in ("fp32", "bf16")]
    if bad:
        raise ValueError(f"calibration recipes must be fp32 and/or bf16, got {', '.join(bad)}")
    scenarios = list(SCENARIOS if scenarios is None else scenarios)
    policies = list(default_policies() if policies is None else policies)
    say = progress or (lambda line: None)
    start = time.perf_counter()

    if aurora is None:
        aurora = catalogue.build_context(factory.get_model("full", seed=0), inputs.make_batch())
    session = ParitySession(torch.device("cpu"), reference="cpu", seed=seed)
    golden_runner = GoldenRunner(root=aurora.model, shims=aurora_golden_shims)
    cases: list[CaseOutcome] = []
    golden_info: dict[str, dict[str, dict[str, Any]]] = {r: {} for r in recipes}

    precomputed: dict[str, dict[tuple[str, str], Any]] = {}
    for scenario in scenarios:
        if scenario.env and not scenario.unavailable():
            say(f"{scenario.name}: target side in a child process ({' '.join(f'{k}={v}' for k, v in scenario.env)})")
            precomputed[scenario.name] = child_targets(scenario, checks, recipes, seed)

    for check_name in checks:
        check = catalogue.BY_NAME[check_name]
        fn, args, kwargs = check.build(aurora)
        module = owner_module(fn)
        if module is None and check.submodule:
            module = aurora.model.get_submodule(check.submodule)
        for recipe in recipes:
            reference_case = ParityCase(session, f"calibration::{check_name}", recipe)
            reference, _ = reference_case._run(fn, args, kwargs, torch.device("cpu"), seed=seed, patched=False,
                                               grad=False)
            try:
                golden = golden_runner.run(fn, args, kwargs, recipe=recipe, seed=seed)
            except GoldenUnavailableError as exc:
                golden = None
                golden_info[recipe][check_name] = {"golden_dtype": None, "unavailable": str(exc)}
            else:
                golden_info[recipe][check_name] = reference_error(reference, golden, recipe)
            sc = ScenarioContext(check=check, aurora=aurora, fn=fn, module=module, recipe=recipe)
            for scenario in scenarios:
                cases.append(_run_case(session, sc, scenario, fn, args, kwargs, reference, golden, policies,
                                       seed, patches.patched, precomputed.get(scenario.name)))
                case = cases[-1]

                say(f"{check_name:24s} {recipe:5s} {scenario.name:24s} {case.status:11s} "
                    + ("" if case.status != "judged" else
                       f"rel_l2={case.effect_rel_l2:.2g} "
                       + " ".join(f"{p.name}={case.verdicts.get(p.name)}" for p in policies if p.default))
                    + (f" ({case.message})" if case.message and case.status != "judged" else ""))

    _fault_sizes(cases, golden_info)
    meta = {
        "checks": list(checks), "recipes": list(recipes), "size": "full", "seed": seed,
        "torch": torch.__version__, "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        "threads": torch.get_num_threads(), "load_average": _load_average(),
        "duration_s": time.perf_counter() - start,
    }
    return CalibrationReport(cases=cases, policies=policies, scenarios=scenarios, golden=golden_info, meta=meta)


def _run_case(session, sc: ScenarioContext, scenario: Scenario, fn, args, kwargs, reference, golden,
              policies, seed: int, patch_set: Callable[[torch.device], ContextManager[Any]],
              precomputed: dict[tuple[str, str], Any] | None = None) -> CaseOutcome:
    from pytest_npu_parity.runner import ParityCase

    outcome = CaseOutcome(check=sc.check.name, recipe=sc.recipe, scenario=scenario.name, kind=scenario.kind,
                          status="judged")
    why = scenario.unavailable()
    if why:
        outcome.status, outcome.message = "unavailable", why
        return outcome
    why = scenario.applies(sc)
    if why:
        outcome.status, outcome.message = "not applicable", why
        return outcome
    outcome.recipe_violation = sc.recipe in scenario.violates
    device = torch.device(scenario.device or "cpu")
    started = time.perf_counter()

    @contextlib.contextmanager
    def target_side(dev: torch.device) -> Iterator[None]:
        with patch_set(dev), scenario.apply(sc):
            yield

    case = ParityCase(session, f"calibration::{sc.check.name}::{scenario.name}", sc.recipe, patches=target_side)
    try:
        if precomputed is not None:  # computed by a child process (Scenario.env)
            target = precomputed[(sc.check.name, sc.recipe)]
            if isinstance(target, str):
                raise RuntimeError(target)
        else:
            target, _ = case._run(fn, args, kwargs, device, seed=seed, patched=True, grad=False)
    except (ValueError, RuntimeError, TypeError, KeyError) as exc:
        outcome.status, outcome.message = "error", f"{type(exc).__name__}: {exc}"
        outcome.duration_s = time.perf_counter() - started
        return outcome
    outcome.duration_s = time.perf_counter() - started
    if _leaves_equal(target, reference):
        outcome.status = "no effect"
        return outcome
    outcome.effect_max_abs, outcome.effect_rel_l2 = _effect(target, reference)
    outcome.verdicts, outcome.details = _judge(policies, sc.recipe, target, reference, golden, sc.check.name)
    return outcome


if __name__ == "__main__":  # the child of child_targets
    import sys

    sys.exit(_child_main(sys.argv[1:]))

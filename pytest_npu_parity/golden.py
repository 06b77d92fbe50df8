"""The golden policy: judge the target by how far it strays from a higher-precision golden run,
relative to how far the reference strays from the same golden.

An allclose tolerance asks "is the target within ``atol + rtol·|e|`` of the reference?". Between two
legitimate implementations of a bf16 computation the answer is often "no" for many elements (both
carry bf16 rounding error, in different places), and for a fp32 computation a real fault can hide
below the tolerance. The golden policy asks instead: "is the target's error no worse than the
reference's error, within a documented multiple?", both errors measured against a **golden**: the
same computation on the CPU at higher precision.

=============================  ============================  ================================
work (recipe)                  golden                        ``golden_dtypes(recipe)``
=============================  ============================  ================================
``fp32``                       fp64 run on the CPU           ``(torch.float64,)``
``bf16``, ``bf16-weights``     fp64 run on the CPU, else     ``(torch.float64, torch.float32)``
                               fp32 where fp64 cannot run
=============================  ============================  ================================

For bf16 work the golden is fp64 as well where the computation runs in fp64: under bf16 autocast
some outputs stay fp32 (layer_norm, softmax, sums; the fp32 op list), and an fp32 golden is no finer
than those outputs — the CPU reference would equal it exactly and any other correct fp32 kernel
would look infinitely worse. Where only an fp32 golden is possible, outputs at least as fine as
the golden are floored at the work dtype's rounding (``judge_golden_tensors``' ``work_dtype``).

The idea is msprobe's "benchmark" comparison (标杆比对法, PyPI ``mindstudio-probe``): NPU and GPU
outputs are each compared with a high-precision CPU golden and the verdict is taken on the ratios
NPU-error / GPU-error. Here the target plays msprobe's NPU and the reference its GPU. Two limit sets
are available:

``golden`` (``limit_set="default"``) — our metrics and limits, as documented since this policy
exists. Metrics of one side ``x`` (target ``a`` or reference ``e``) against the golden ``g``, per
leaf, in float64 over the positions finite on all three tensors (``F``); a golden element is
*small* when ``|g| < small_value_threshold`` and *normal* otherwise:

* ``rmse``       — sqrt(mean over F of (x − g)²)             (tensor units; small values included)
* ``max_rel``    — max over normal of |x − g| / |g|           (dimensionless, no eps)
* ``mean_rel``   — mean over normal of |x − g| / |g|          (dimensionless, no eps)
* ``small_share`` — share of small elements with |x − g| > ``small_value_atol``
* ``balance``    — |#(x > g) − #(x < g)| / #F (reported, not judged)

Ratios are target metric / max(reference metric, floor); 0/0 is 1 (neither side has the error).
The floors are ours: the reference's metric is never taken below the metric of the golden rounded
to the leaf's own dtype (no target can beat correct rounding of its output), and a share never
below one element's worth (1 / number of small elements). Limits: RMSE ratio 2, max relative error
ratio 10, mean relative error ratio 2, small-value share ratio 2 (msprobe's default "L0" limits for
the first three; the small-value limit is msprobe's too). Small-value thresholds (``SMALL_VALUE``):
``|g| < 1e-6``, error ``> 1e-9`` for fp32 work, ``|g| < 1e-3``, error ``> 1e-5`` for fp16/bf16
work — the values msprobe 1.0.3 documented, kept as our own; msprobe 26.2.0 uses others (below).

``golden msprobe [op=NAME]`` (``limit_set="msprobe"``) — msprobe 26.2.0's benchmark standard,
reproduced from its source (paths under ``msprobe/pytorch/api_accuracy_checker/`` of
mindstudio-probe 26.2.0) so that the verdict equals msprobe's on the same tensors:

* per side, ``compare/compare.py::Comparator._compare_torch_tensor`` (a bf16 output and its golden
  are both converted to float32 first) and ``precision_standard/benchmark_compare.py::BenchmarkCompare``
  with ``compare/algorithm.py``: ``abs_err = |x − g|``; small where ``|g| <= 2^-10`` (fp16/bf16) or
  ``2^-20`` (fp32) among positions finite on both (the golden cast to the output's dtype)
  (``standard_config.py::StandardConfig._small_value``); ``small_value_err_ratio`` = share of small
  elements with ``abs_err > 1e-16`` (fp16/bf16) or ``2^-30`` (fp32) (``_benchmark_small_value_atol``);
  relative error ``abs_err / (|g| + eps)`` over the other finite positions, eps ``2^-8`` for bf16,
  else ``finfo(golden).eps`` (``get_abs_bench_with_eps``), giving ``max_rel_error`` and
  ``mean_rel_error``; ``rmse`` over the same positions with msprobe's correction
  ``sqrt(mean(masked²) · (n / (n − k + 1e-4) + 1e-4))`` (``get_rmse``, k = masked count); ``eb``
  (``get_error_balance``, reported only);
* the verdict, ``benchmark_compare.py::BenchmarkPrecisionCompare``: ratio ``|t| / max(|r|, floor)``
  with floor ``2^-8`` (bf16), ``2^-11`` (fp16), ``2^-14`` (fp32) by the target's dtype
  (``algorithm.py::calc_ratio``, ``StandardConfig._minmum_err``); a metric that is NaN/Inf on one
  side only is an error, on both sides alike a pass (``compare_utils.py::check_inf_or_nan``); a
  ratio above its limit is an error, otherwise pass — 26.2.0 has no warning state here. Limits
  (``StandardConfig.get_benchmark_ratio_threshold``): rmse / max_rel / mean_rel ratio 2 / 10 / 2 by
  default ("L0"), 1.5 / 5 / 1.5 for the ops of ``L1_API_LIST`` (embedding, npu_fusion_attention,
  scatter_, …) and 1.2 / 2 / 1.2 for ``L2_API_LIST`` (matmul, mm, addmm, layer_norm, GELU, sum,
  index, npu_rms_norm, …): name the op class with ``op=``; small-value ratio 2 always.
  Thresholds follow each output's own dtype, as in msprobe (an fp32 output of a bf16 recipe is
  judged as fp32). float64 outputs, which msprobe skips, get its "default" (fp32) values.

Both limit sets add our own NaN/Inf rule: NaN/±Inf positions of the target must equal the
reference's (NaN/Inf on one side only fails, and so does −Inf against +Inf). msprobe's benchmark
metrics leave such positions out, so msprobe alone would pass them; ``GoldenLeafResult.msprobe_verdict``
is msprobe's verdict without our rule. An empty tensor passes (msprobe skips it).

A leaf passes when the structure matches (two floating dtypes may differ: autocast's op lists
differ between devices and kernels), the NaN/Inf rule holds and every ratio is within its limit.
Integer and bool leaves are compared exactly (the golden is not used).

Which Aurora checks get an fp64 golden (aurora-model 0.2.0, all 47 of ``aurora.checks.CHECKS``
measured): 38 as they are. The 8 through the flow head (``simple_mlp_adaln``, ``flow_loss_*``,
``forward_*``, ``generate_*``) raise "mat1 and mat2 must have the same dtype" in float64, because
``TimestepEmbedder.timestep_embedding`` hard-codes float32; with the golden shim
``pytest_npu_parity.aurora.golden_shims.aurora_golden_shims`` (the same embedding computed in float64) they get one too.
``sinusoidal_position_embedding`` builds its table in float32 whatever the input, so its output is
float32 and ``GoldenRunner`` refuses it (``GoldenUnavailableError``) for fp32 work; for bf16 work it
gets an fp32 golden, the others the same fp64 one.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch

from .compare import CompareResult, LeafResult, _leaves_by_path, compare_tensors, flatten, float64_blocks, format_table
from .modules import owner_module
from .policy import EXACT, SOURCES, Tolerance, default_for_dtype, parse_spec_items
from .recipes import strict_fp32_flags
from .rng import same_randomness

#: Golden dtypes per recipe, tried in order (fp64; for bf16/fp16 work fp32 where fp64 cannot run).
GOLDEN_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "fp32": (torch.float64,),
    "bf16": (torch.float64, torch.float32),
    "bf16-weights": (torch.float64, torch.float32),
    "fp16": (torch.float64, torch.float32),
}

#: Our small-value thresholds per work dtype (the ``golden`` limit set): (|golden| below which an
#: element is "small", absolute error above which a small element is wrong). These are the values
#: msprobe 1.0.3 documented (api_accuracy_checker.md, "小值域阈值"); msprobe 26.2.0 uses
#: ``MSPROBE_SMALL_VALUE`` / ``MSPROBE_SMALL_VALUE_ATOL`` instead (the ``golden msprobe`` limit set).
SMALL_VALUE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-6, 1e-9),
    torch.float64: (1e-6, 1e-9),
    torch.bfloat16: (1e-3, 1e-5),
    torch.float16: (1e-3, 1e-5),
}

# msprobe 26.2.0's benchmark standard (``golden msprobe``), from
# msprobe/pytorch/api_accuracy_checker/precision_standard/standard_config.py::StandardConfig.

#: ``_small_value``: |golden| at or below which an element is small, by the output's dtype.
MSPROBE_SMALL_VALUE: dict[torch.dtype, float] = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -10,
                                                 torch.float32: 2.0 ** -20}
#: ``_benchmark_small_value_atol``: absolute error above which a small element is wrong.
MSPROBE_SMALL_VALUE_ATOL: dict[torch.dtype, float] = {torch.float16: 1e-16, torch.bfloat16: 1e-16,
                                                      torch.float32: 2.0 ** -30}
#: ``_minmum_err``: the floor of the reference metric in every ratio (``algorithm.py::calc_ratio``).
MSPROBE_MIN_ERR: dict[torch.dtype, float] = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8,
                                             torch.float32: 2.0 ** -14}
#: ``CompareConst.BFLOAT16_EPS``: the eps of the relative error's denominator for bf16 outputs.
MSPROBE_BF16_EPS = 2.0 ** -8
#: ``get_benchmark_ratio_threshold``: (rmse, max_rel, mean_rel) ratio limits per op level.
MSPROBE_LEVEL_LIMITS: dict[str, tuple[float, float, float]] = {
    "L0": (2.0, 10.0, 2.0), "L1": (1.5, 5.0, 1.5), "L2": (1.2, 2.0, 1.2)}
#: ``_small_value_threshold['error_threshold']``: the small-value ratio limit, every level.
MSPROBE_SMALL_LIMIT = 2.0
#: ``L1_API_LIST`` and ``L2_API_LIST``: op names (msprobe's API names, case as there) of levels L1/L2.
MSPROBE_L1_OPS = frozenset({"embedding", "npu_fusion_attention_grad", "npu_fusion_attention", "scatter_",
                            "scatter_add_"})
MSPROBE_L2_OPS = frozenset({"addmm", "npu_cross_entropy_loss", "npu_cross_entropy_loss_backward", "GELU",
                            "layer_norm", "matmul", "mm", "index", "one_hot", "sum", "npu_rms_norm",
                            "npu_rms_norm_backward", "nonzero"})

#: The limit sets a ``GoldenPolicy`` can use.
LIMIT_SETS = ("default", "msprobe")


def msprobe_level(op: str | None) -> str:
    """msprobe's level of an op name (``StandardConfig.get_api_level``): ``"L2"``, ``"L1"`` or ``"L0"``
    (also for None and names msprobe does not list)."""
    if op in MSPROBE_L2_OPS:
        return "L2"
    if op in MSPROBE_L1_OPS:
        return "L1"
    return "L0"


#: The work dtype of each recipe (what the small-value thresholds are chosen by).
WORK_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "bf16-weights": torch.bfloat16,
    "fp16": torch.float16,
}

#: The judged metrics, in report order.
METRICS = ("rmse", "max_rel", "mean_rel", "small_share")


def golden_dtypes(recipe: str) -> tuple[torch.dtype, ...]:
    """The golden dtypes for work under ``recipe``, in the order ``GoldenRunner.run`` tries them.

    Raises:
        ValueError: for an unknown recipe, naming the known ones.
    """
    try:
        return GOLDEN_DTYPES[recipe]
    except KeyError:
        raise ValueError(f"unknown recipe {recipe!r}; expected one of {sorted(GOLDEN_DTYPES)}") from None


def golden_dtype(recipe: str) -> torch.dtype:
    """The preferred golden dtype for work under ``recipe`` (float64 for every recipe).

    Raises:
        ValueError: for an unknown recipe, naming the known ones.
    """
    return golden_dtypes(recipe)[0]


@dataclass(frozen=True)
class GoldenPolicy:
    """Limits on target-error / reference-error ratios, both errors measured against a golden.

    Attributes:
        rmse_ratio: largest allowed ratio of root-mean-square errors (default 2, msprobe's L0 limit).
        max_rel_ratio: largest allowed ratio of maximum relative errors over normal values (default 10).
        mean_rel_ratio: largest allowed ratio of mean relative errors over normal values (default 2).
        small_value_ratio: largest allowed ratio of small-value error shares (default 2).
        small_value_threshold: |golden| below which an element is small; ``None`` picks our value
            for the leaf's dtype (``SMALL_VALUE``).
        small_value_atol: absolute error above which a small element counts as wrong (tensor
            units); ``None`` picks our value for the leaf's dtype.
        source: where the values came from: one of ``policy.SOURCES``.
        reason: why a non-default policy is justified (shown in the report).
        limit_set: ``"default"`` (the fields above) or ``"msprobe"`` (msprobe 26.2.0's benchmark
            standard: its metrics, floors and per-op limits; the ratio and small-value fields are
            then unused, see the module docstring).
        op: with ``limit_set="msprobe"``, the op class msprobe names the API by (``"matmul"``,
            ``"layer_norm"``, ``"embedding"`` …), which picks its limits (``msprobe_level``); None: L0.
        allclose_floor: when True (spec word ``floor``: ``"golden floor"``), a leaf that is within
            the check's allclose tolerance of the reference passes without the ratio test. Ours, not
            msprobe's: the ratio test divides by the reference's own error, which is near zero where
            the reference happens to round like the golden (a training step's loss, parameters
            after AdamW, whose first step moves every element by about ±lr whatever the gradient's
            size), so a difference far inside the recipe's tolerance can fail it. Measured on the
            Aurora suite across torch 2.5.1/2.14.1 and CPU kernel paths (docs/explanation/verdict-accuracy.md).

    Raises:
        ValueError: on a ratio limit below 1 or NaN (a target may always be as good as the
            reference), a negative threshold, an unknown source or limit set, or ``op`` without
            the msprobe limit set.
    """

    rmse_ratio: float = 2.0
    max_rel_ratio: float = 10.0
    mean_rel_ratio: float = 2.0
    small_value_ratio: float = 2.0
    small_value_threshold: float | None = None
    small_value_atol: float | None = None
    source: str = "default"
    reason: str | None = None
    limit_set: str = "default"
    op: str | None = None
    allclose_floor: bool = False

    def __post_init__(self) -> None:
        if self.limit_set not in LIMIT_SETS:
            raise ValueError(f"unknown golden limit set {self.limit_set!r}; expected one of {LIMIT_SETS}")
        if self.op is not None and self.limit_set != "msprobe":
            raise ValueError(f"golden policy op={self.op!r} names an msprobe op class: use it with "
                             "limit_set='msprobe' ('golden msprobe op=…')")
        for name in ("rmse_ratio", "max_rel_ratio", "mean_rel_ratio", "small_value_ratio"):
            value = getattr(self, name)
            if not value >= 1.0:  # also rejects NaN
                raise ValueError(f"golden policy {name}={value!r}: a ratio limit must be >= 1 "
                                 "(the target may always be as accurate as the reference)")
        for name in ("small_value_threshold", "small_value_atol"):
            value = getattr(self, name)
            if value is not None and not value >= 0.0:
                raise ValueError(f"golden policy {name}={value!r} must be >= 0 (or None for the dtype's default)")
        if self.source not in SOURCES:
            raise ValueError(f"unknown golden policy source {self.source!r}; expected one of {SOURCES}")

    @property
    def msprobe(self) -> bool:
        """True for msprobe 26.2.0's benchmark standard (``limit_set="msprobe"``)."""
        return self.limit_set == "msprobe"

    @property
    def limits(self) -> dict[str, float]:
        """``{metric: limit}`` for the judged metrics (``METRICS``); for the msprobe limit set the
        limits of ``op``'s level (``MSPROBE_LEVEL_LIMITS``, ``MSPROBE_SMALL_LIMIT``)."""
        if self.msprobe:
            rmse, max_rel, mean_rel = MSPROBE_LEVEL_LIMITS[msprobe_level(self.op)]
            return {"rmse": rmse, "max_rel": max_rel, "mean_rel": mean_rel, "small_share": MSPROBE_SMALL_LIMIT}
        return {"rmse": self.rmse_ratio, "max_rel": self.max_rel_ratio,
                "mean_rel": self.mean_rel_ratio, "small_share": self.small_value_ratio}

    @property
    def is_override(self) -> bool:
        """True when the values did not come from the built-in defaults."""
        return self.source != "default"

    def small_values_for(self, dtype: torch.dtype) -> tuple[float, float]:
        """``(threshold, atol)`` of the small-value criterion for work in ``dtype``."""
        threshold, atol = SMALL_VALUE.get(dtype, SMALL_VALUE[torch.float32])
        return (threshold if self.small_value_threshold is None else self.small_value_threshold,
                atol if self.small_value_atol is None else self.small_value_atol)

    def replace(self, **changes: Any) -> "GoldenPolicy":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """Short text such as ``golden rmse<=2 max_rel<=10 mean_rel<=2 small<=2`` or
        ``golden msprobe op=matmul (L2) rmse<=1.2 max_rel<=2 mean_rel<=1.2 small<=2`` (+ source/reason)."""
        lim = self.limits
        head = "golden"
        if self.msprobe:
            head += " msprobe" + (f" op={self.op}" if self.op else "") + f" ({msprobe_level(self.op)})"
        if self.allclose_floor:
            head += " floor"
        text = (f"{head} rmse<={lim['rmse']:g} max_rel<={lim['max_rel']:g} "
                f"mean_rel<={lim['mean_rel']:g} small<={lim['small_share']:g}")
        if (self.is_override and not self.msprobe
                and (self.small_value_threshold is not None or self.small_value_atol is not None)):
            text += f" small_thr={self.small_value_threshold} small_atol={self.small_value_atol}"
        if self.is_override:
            text += f" [{self.source}" + (f": {self.reason}]" if self.reason else "]")
        return text


#: Our default golden limits (ratios 2 / 10 / 2 / 2).
DEFAULT_GOLDEN = GoldenPolicy()

#: msprobe 26.2.0's benchmark standard for ops of level L0 (name an op: ``MSPROBE_GOLDEN.replace(op="matmul")``).
MSPROBE_GOLDEN = GoldenPolicy(limit_set="msprobe")

#: Keys accepted by ``parse_golden_spec`` and the field each sets.
_SPEC_KEYS = {
    "rmse": "rmse_ratio", "rmse_ratio": "rmse_ratio",
    "max_rel": "max_rel_ratio", "max_rel_ratio": "max_rel_ratio",
    "mean_rel": "mean_rel_ratio", "mean_rel_ratio": "mean_rel_ratio",
    "small": "small_value_ratio", "small_value_ratio": "small_value_ratio",
    "small_value_threshold": "small_value_threshold", "small_value_atol": "small_value_atol",
}


def parse_golden_spec(text: str, *, source: str, base: GoldenPolicy = DEFAULT_GOLDEN) -> GoldenPolicy:
    """Parse ``"rmse=3 max_rel=10 mean_rel=2 small=2 # reason"`` into a ``GoldenPolicy`` over ``base``.

    A leading word ``golden`` is allowed (``"golden rmse=3"``). Keys: ``rmse``/``rmse_ratio``,
    ``max_rel``/``max_rel_ratio``, ``mean_rel``/``mean_rel_ratio``, ``small``/``small_value_ratio``,
    ``small_value_threshold``, ``small_value_atol``. Keys not given keep ``base``'s values; the
    text after ``#`` is the reason.

    The word ``floor`` anywhere after ``golden`` sets ``allclose_floor`` (``"golden floor"``,
    ``"golden msprobe floor op=matmul"``).

    ``"golden msprobe [op=NAME] [# reason]"`` selects msprobe 26.2.0's benchmark standard
    (``MSPROBE_GOLDEN``, ``base`` unused); ``op`` names msprobe's op class (``matmul``,
    ``layer_norm``, ``embedding`` …, see ``msprobe_level``). Its limits are msprobe's, so no other key
    is accepted there.

    Raises:
        ValueError: on an unknown key, a key given twice, a value that is not a number, or an
            invalid limit, naming the offending text (``policy.parse_spec_items``).
    """
    body, _, reason_text = text.partition("#")
    words = re.sub(r"\s*=\s*", "=", body).replace(",", " ").split()
    if words[:1] == ["golden"]:
        words = words[1:]
    if "floor" in words:  # "golden [msprobe] floor …": the allclose floor (GoldenPolicy.allclose_floor)
        if words.count("floor") > 1:
            raise ValueError(f"floor is given twice in {text!r}")
        words.remove("floor")
        rest = " ".join(["golden", *words]) + (f" #{reason_text}" if reason_text else "")
        return parse_golden_spec(rest, source=source, base=base).replace(allclose_floor=True)
    if words[:1] == ["msprobe"]:
        op = None
        for word in words[1:]:
            key, sep, value = word.partition("=")
            if key != "op" or not sep or not value:
                raise ValueError(f"bad golden msprobe item {word!r} in {text!r}: expected only op=NAME "
                                 "(msprobe's limits are fixed; for other limits write 'golden rmse=… max_rel=…')")
            if op is not None:
                raise ValueError(f"op is given twice in {text!r}")
            op = value
        return MSPROBE_GOLDEN.replace(op=op, source=source, reason=reason_text.strip() or None)
    values, reason = parse_spec_items(text, _SPEC_KEYS, what="golden policy", leading_word="golden",
                                      expected="one of " + ", ".join(sorted(k + "=" for k in _SPEC_KEYS)))
    try:
        return base.replace(**values, source=source, reason=reason or base.reason)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {text!r})") from None


#: The verdict policies a check can be judged by (see ``parse_policy_spec``).
POLICIES = ("allclose", "golden")


def parse_policy_spec(text: "str | GoldenPolicy", *, source: str, recipe: str) -> GoldenPolicy | None:
    """Parse a verdict-policy choice: ``"allclose"``, ``"golden [rmse=3 max_rel=10 …] [# reason]"`` or
    ``"golden msprobe [op=matmul] [# reason]"`` (msprobe 26.2.0's benchmark standard).

    This is what ``--parity-policy``, the ini keys ``parity_<recipe>_policy`` and ``parity_policies``,
    the marker's ``policy=`` and ``parity.check(..., policy=...)`` accept. Golden limits not given
    keep ``default_golden_for_recipe(recipe)``'s (our default limits, small-value thresholds of the
    recipe's work dtype).

    Returns:
        None for ``allclose`` (judge by the tolerance), else the ``GoldenPolicy``.

    A ``GoldenPolicy`` is returned as it is.

    Raises:
        ValueError: on anything else (naming the text and the accepted forms), or bad limits (as
            ``parse_golden_spec``), or an unknown recipe.
        TypeError: ``text`` is neither a string nor a ``GoldenPolicy``.
    """
    if isinstance(text, GoldenPolicy):
        return text
    if not isinstance(text, str):
        raise TypeError(f"verdict policy {text!r} is a {type(text).__name__}: give 'allclose', 'golden', "
                        "'golden rmse=… # reason' or 'golden msprobe op=…' (or a golden.GoldenPolicy)")
    body = text.partition("#")[0].strip()
    word = body.split()[0] if body else ""
    if word == "allclose" and body == "allclose":
        return None
    if word != "golden":
        raise ValueError(f"verdict policy {text!r}: expected 'allclose', 'golden [rmse=… max_rel=… "
                         "mean_rel=… small=…] [# reason]' or 'golden msprobe [op=NAME] [# reason]'")
    base = default_golden_for_recipe(recipe)
    if body == "golden" and not text.partition("#")[2].strip():
        return base  # the default limits: nothing overridden, nothing to attribute
    return parse_golden_spec(text, source=source, base=base)


def default_golden_for_recipe(recipe: str) -> GoldenPolicy:
    """The default golden policy of a recipe, with small-value thresholds of its work dtype filled in
    (a bf16 recipe's fp32 outputs carry bf16 error, so they are judged by bf16's thresholds).

    Raises:
        ValueError: for an unknown recipe.
    """
    golden_dtype(recipe)  # validates the name
    threshold, atol = SMALL_VALUE[WORK_DTYPES[recipe]]
    return DEFAULT_GOLDEN.replace(small_value_threshold=threshold, small_value_atol=atol)


# --------------------------------------------------------------------------------------------
# results


@dataclass
class SideMetrics:
    """Errors of one side (target, reference, or the golden rounded to the leaf dtype) against the golden.

    ``rmse`` is in tensor units, the others dimensionless; ``small``/``normal`` count the golden's
    small and normal elements among positions finite on all three tensors.
    """

    rmse: float = 0.0
    max_rel: float = 0.0
    mean_rel: float = 0.0
    small_share: float = 0.0
    balance: float = 0.0
    small: int = 0
    normal: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass
class GoldenLeafResult(LeafResult):
    """A ``LeafResult`` judged by a ``GoldenPolicy``.

    The inherited metrics (``max_abs``, ``rel_l2``, ``cosine``, ``mismatched`` …) are the target
    vs reference ones under ``tolerance`` (informative only: they do not decide the verdict).
    Added fields: ``policy``; ``golden_dtype``; ``target``/``reference``/``floor`` —
    ``SideMetrics`` against the golden (``floor`` is the golden rounded to the leaf's dtype);
    ``ratios`` — ``{metric: target / max(reference, floor)}`` for ``METRICS``;
    ``exact`` — an integer/bool leaf, judged by equality; ``note`` — e.g. that the target's
    floating dtype differs from the reference's (allowed under the golden policy).
    """

    policy: GoldenPolicy | None = None
    golden_dtype: str | None = None
    target: SideMetrics | None = None
    reference: SideMetrics | None = None
    floor: SideMetrics | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    exact: bool = False
    note: str | None = None

    @property
    def over_limit(self) -> dict[str, float]:
        """``{metric: ratio}`` of the ratios above the policy's limits."""
        if self.policy is None:
            return {}
        limits = self.policy.limits
        if self.policy.msprobe:  # msprobe: a NaN ratio (both sides NaN, or the same Inf) passes
            return {m: r for m, r in self.ratios.items() if r > limits[m]}
        return {m: r for m, r in self.ratios.items() if not r <= limits[m]}

    @property
    def msprobe_verdict(self) -> str | None:
        """msprobe's own benchmark verdict (``"pass"``/``"error"``) under the msprobe limit set,
        without our NaN/Inf rule (None for the default limit set, structural problems, integer
        leaves, and empty tensors, which msprobe skips)."""
        if self.policy is None or not self.policy.msprobe or self.problem is not None or self.exact or not self.numel:
            return None
        return "error" if self.over_limit else "pass"

    @property
    def within_floor(self) -> bool:
        """Under ``allclose_floor``: the target is within the allclose tolerance of the reference."""
        return (self.policy is not None and self.policy.allclose_floor and self.problem is None
                and self.nonfinite_mismatched == 0 and self.mismatched <= self.allowed)

    @property
    def passed(self) -> bool:
        """No structural problem, no NaN/Inf on one side only, and every ratio within its limit or
        (``allclose_floor``) the leaf within the allclose tolerance (integer/bool leaves: no
        differing element)."""
        if self.problem is not None:
            return False
        if self.exact:
            return self.mismatched == 0
        return self.nonfinite_mismatched == 0 and (self.within_floor or not self.over_limit)

    @property
    def worst_ratio(self) -> tuple[str | None, float]:
        """``(metric, ratio / limit)`` of the ratio closest to (or furthest over) its limit."""
        if self.policy is None or not self.ratios:
            return None, math.nan
        limits = self.policy.limits
        metric = max(self.ratios, key=lambda m: -math.inf if math.isnan(self.ratios[m]) else self.ratios[m] / limits[m])
        return metric, self.ratios[metric] / limits[metric]

    def to_row(self) -> dict[str, Any]:
        """``LeafResult.to_row()`` plus ``policy``, ``golden_*`` columns and this verdict."""
        row = super().to_row()
        row["policy"] = "golden"
        row["golden_policy"] = self.policy.describe() if self.policy is not None else None
        row["golden_policy_source"] = self.policy.source if self.policy is not None else None
        row["golden_policy_reason"] = self.policy.reason if self.policy is not None else None
        row["golden_dtype"] = self.golden_dtype
        row["golden_note"] = self.note
        for metric in METRICS:
            row[f"golden_{metric}_ratio"] = self.ratios.get(metric)
            row[f"golden_{metric}_target"] = getattr(self.target, metric) if self.target else None
            row[f"golden_{metric}_reference"] = getattr(self.reference, metric) if self.reference else None
        metric, margin = self.worst_ratio
        row["golden_worst_metric"] = metric
        row["golden_worst_margin"] = margin
        row["golden_msprobe_verdict"] = self.msprobe_verdict
        row["verdict"] = "pass" if self.passed else "fail"
        return row


class GoldenCompareResult(CompareResult):
    """``CompareResult`` of ``GoldenLeafResult`` leaves; its message shows the golden ratios."""

    def __init__(self, name: str, policy: GoldenPolicy, leaves: list[LeafResult] | None = None):
        super().__init__(name=name, leaves=list(leaves or []))
        self.policy = policy

    def format(self, context: str = "") -> str:
        """The failure message: a header naming the worst golden ratio, the ratio table, then the
        usual target-vs-reference metrics table (informative)."""
        failures = self.failures
        verdict = "failed" if failures else "passed"
        lines = [f"Parity check {self.name!r} {verdict} under the golden policy"
                 + (f" ({context})" if context else "")]
        lines.append(f"policy: {self.policy.describe()}")
        if failures:
            worst = max(failures, key=_golden_severity)
            lines.append(_golden_header(worst))
        lines.append("")
        lines += format_golden_table(failures or self.leaves)
        lines += ["", "target vs reference (informative):"]
        lines += format_table(failures or self.leaves)
        return "\n".join(lines)


def _golden_severity(leaf: LeafResult) -> float:
    if leaf.problem is not None or leaf.nonfinite_mismatched:
        return math.inf
    if isinstance(leaf, GoldenLeafResult) and not leaf.exact:
        margin = leaf.worst_ratio[1]
        return margin if not math.isnan(margin) else math.inf
    return math.inf if leaf.mismatched else 0.0


def _golden_header(leaf: LeafResult) -> str:
    where = f"output {leaf.path!r}: " if leaf.path else ""
    if leaf.problem is not None:
        return where + leaf.problem
    if leaf.nonfinite_mismatched:
        return (f"{where}NaN/Inf on one side only at {leaf.nonfinite_mismatched} element(s), first at index "
                f"{leaf.nonfinite_index} (target {leaf.actual_at_nonfinite}, reference {leaf.expected_at_nonfinite})")
    if isinstance(leaf, GoldenLeafResult) and not leaf.exact:
        parts = [f"{m} ratio {r:.3g} > {leaf.policy.limits[m]:g}" for m, r in leaf.over_limit.items()]
        return (f"{where}target error vs the {leaf.golden_dtype} golden exceeds the reference's: "
                + ", ".join(parts))
    return f"{where}{leaf.mismatched} integer/bool element(s) differ"


_GOLDEN_COLUMNS = ("leaf", "golden", "rmse t/r (ratio)", "max_rel t/r (ratio)", "mean_rel t/r (ratio)",
                   "small t/r (ratio)", "verdict")


def format_golden_table(leaves: list[LeafResult]) -> list[str]:
    """Fixed-width table of golden metrics: target / reference error and their ratio per metric."""
    rows = [_GOLDEN_COLUMNS]
    for leaf in leaves:
        name = leaf.path or "<output>"
        verdict = "pass" if leaf.passed else "FAIL"
        if not isinstance(leaf, GoldenLeafResult) or leaf.exact or leaf.target is None:
            rows.append((name, "-", "-", "-", "-", "-", leaf.problem or verdict))
            continue
        cells = []
        for metric in METRICS:
            t, r = getattr(leaf.target, metric), getattr(leaf.reference, metric)
            cells.append(f"{t:.3g}/{r:.3g} ({leaf.ratios[metric]:.3g})")
        rows.append((name, leaf.golden_dtype or "-", *cells, verdict))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(_GOLDEN_COLUMNS))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]


# --------------------------------------------------------------------------------------------
# arithmetic


class _SideSums:
    """Blockwise sums behind ``SideMetrics`` (our ``golden`` limit set): fold blocks with ``add``,
    read the metrics with ``result``."""

    def __init__(self) -> None:
        self.n = self.normal = self.small = self.small_wrong = self.above = self.below = 0
        self.sum_sq = self.sum_rel = 0.0
        self.max_rel = 0.0

    def add(self, x: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, small: torch.Tensor, small_atol: float) -> None:
        """Fold one block: 1-D float64 ``x`` and golden ``g``, positions ``mask``, small positions ``small``."""
        n = int(mask.sum())
        if n == 0:
            return
        if n == mask.numel():  # every position finite (the usual block): no boolean indexing, same sums
            self._add_all(x, g, small, small_atol)
            return
        self.n += n
        diff = (x - g)[mask]
        err = diff.abs()
        self.sum_sq += float(err.square().sum())
        normal = mask & ~small
        k = int(normal.sum())
        if k:
            rel = (x[normal] - g[normal]).abs_().div_(g[normal].abs())
            self.normal += k
            self.sum_rel += float(rel.sum())
            self.max_rel = max(self.max_rel, float(rel.max()))
        k = int(small.sum())
        if k:
            self.small += k
            self.small_wrong += int(((x[small] - g[small]).abs_() > small_atol).sum())
        self.above += int((diff > 0).sum())
        self.below += int((diff < 0).sum())

    def _add_all(self, x: torch.Tensor, g: torch.Tensor, small: torch.Tensor, small_atol: float) -> None:
        """``add`` for a block whose positions are all in the mask: the same elements in the same
        order enter every sum (bitwise the same metrics), without the copies boolean indexing makes
        (about twice as fast on 1 M-element blocks)."""
        n = x.numel()
        self.n += n
        diff = x - g
        err = diff.abs()
        self.sum_sq += float(err.square().sum())
        k_small = int(small.sum())
        if k_small < n:
            if k_small:
                normal = ~small
                rel = err[normal].div_(g[normal].abs())
            else:
                rel = err / g.abs()
            self.normal += n - k_small
            self.sum_rel += float(rel.sum())
            self.max_rel = max(self.max_rel, float(rel.max()))
        if k_small:
            self.small += k_small
            self.small_wrong += int((err[small] > small_atol).sum())
        self.above += int((diff > 0).sum())
        self.below += int((diff < 0).sum())

    def result(self) -> SideMetrics:
        out = SideMetrics(small=self.small, normal=self.normal)
        if self.n == 0:
            return out
        out.rmse = math.sqrt(self.sum_sq / self.n)
        if self.normal:
            out.max_rel, out.mean_rel = self.max_rel, self.sum_rel / self.normal
        if self.small:
            out.small_share = self.small_wrong / self.small
        out.balance = abs(self.above - self.below) / self.n
        return out


def side_metrics(x: torch.Tensor, g: torch.Tensor, mask: torch.Tensor, small: torch.Tensor,
                 small_atol: float) -> SideMetrics:
    """Errors of ``x`` against the golden ``g`` (1-D float64 tensors of equal length), our definitions.

    Args:
        x: one side's values.
        g: the golden values.
        mask: positions to measure (finite on every tensor of the comparison).
        small: positions (within ``mask``) where the golden is small.
        small_atol: absolute error above which a small element is wrong.

    Returns:
        ``SideMetrics`` (see the module docstring for the formulas; empty sets give 0).
    """
    sums = _SideSums()
    sums.add(x, g, mask, small, small_atol)
    return sums.result()


class _MsprobeSums:
    """Blockwise sums behind msprobe 26.2.0's benchmark metrics of one side (``golden msprobe``).

    ``dtype`` is the side's output dtype (what msprobe's ``BenchmarkCompare`` is given) and
    ``golden_dtype`` the golden's. Per element, as ``Comparator._compare_torch_tensor`` and
    ``BenchmarkCompare._pre_compare`` do it: for bf16 the output and the golden are float32 (the
    golden rounded), ``abs_err = |x − g|`` in the promoted type (float32 for bf16), finite where the
    output and the golden cast to the output's dtype are, small where ``|g| <= MSPROBE_SMALL_VALUE``,
    relative error ``abs_err / (|g| + eps)`` elsewhere (eps ``MSPROBE_BF16_EPS`` for bf16, else
    ``finfo(golden).eps``). Sums are float64 (msprobe's NumPy means run in the array's type, so an
    RMSE of a bf16 output can differ from msprobe's in its 7th digit).
    """

    def __init__(self, dtype: torch.dtype, golden_dtype: torch.dtype):
        self.dtype = dtype
        self.bf16 = dtype == torch.bfloat16
        self.side_dtype = torch.float32 if self.bf16 else dtype  # what msprobe's NumPy array holds
        self.golden_dtype = torch.float32 if self.bf16 else golden_dtype
        self.arith = torch.promote_types(self.side_dtype, self.golden_dtype)  # NumPy's x - g
        self.threshold = MSPROBE_SMALL_VALUE.get(dtype, MSPROBE_SMALL_VALUE[torch.float32])
        self.atol = MSPROBE_SMALL_VALUE_ATOL.get(dtype, MSPROBE_SMALL_VALUE_ATOL[torch.float32])
        self.eps = MSPROBE_BF16_EPS if self.bf16 else torch.finfo(self.golden_dtype).eps
        self.size = self.masked = self.normal = self.small = self.small_wrong = self.above = self.below = 0
        self.sum_sq = self.sum_rel = self.max_rel = 0.0

    def add(self, x64: torch.Tensor, g64: torch.Tensor) -> None:
        """Fold one block of the side ``x64`` and the golden ``g64`` (float64 holding the exact values)."""
        x, g = x64.to(self.side_dtype), g64.to(self.golden_dtype)
        g_side = _round_like_numpy(g64, self.side_dtype)  # NumPy's bench.astype(device.dtype)
        finite = torch.isfinite(x) & torch.isfinite(g_side)
        abs_err = (x.to(self.arith) - g.to(self.arith)).abs()
        abs_g = g.abs()
        small = (abs_g <= self.threshold) & finite
        normal = finite & ~small
        self.size += x.numel()
        self.masked += x.numel() - int(normal.sum())
        err_n = abs_err[normal]
        self.sum_sq += float(err_n.to(torch.float64).square().sum())
        k = int(normal.sum())
        if k:
            rel = err_n / (abs_g[normal] + self.eps)
            self.normal += k
            self.sum_rel += float(rel.to(torch.float64).sum())
            self.max_rel = max(self.max_rel, float(rel.max()))
        k = int(small.sum())
        if k:
            self.small += k
            self.small_wrong += int((abs_err[small] > self.atol).sum())
        # get_error_balance compares in the output's dtype
        self.above += int((x > g_side).sum())
        self.below += int((x < g_side).sum())

    def result(self) -> SideMetrics:
        out = SideMetrics(small=self.small, normal=self.normal)
        if self.size == 0:
            return out
        # algorithm.py::get_rmse: mean over all elements of the masked squares, times msprobe's correction
        mse = self.sum_sq / self.size * (self.size / (self.size - self.masked + 0.0001) + 0.0001)
        out.rmse = math.sqrt(mse)
        if self.normal:
            out.max_rel, out.mean_rel = self.max_rel, self.sum_rel / self.normal
        if self.small:
            out.small_share = self.small_wrong / self.small
        out.balance = abs(self.above - self.below) / self.size
        return out


def _round_like_numpy(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x64`` (float64) rounded once to ``dtype``, as NumPy's ``astype`` does. torch converts float64
    to float16 through float32 (two roundings, which differ from one at ties); rounding to float32
    *to odd* first makes the second rounding exact."""
    if dtype != torch.float16:
        return x64.to(dtype)
    f = x64.to(torch.float32)
    inexact = f.to(torch.float64) != x64
    if bool(inexact.any()):
        # round to odd: the float32 next to x64 towards zero, with its last mantissa bit set
        away = inexact & (f.to(torch.float64).abs() > x64.abs())
        f = torch.where(away, torch.nextafter(f, torch.zeros_like(f)), f)
        bits = f.view(torch.int32)
        f = torch.where(inexact & torch.isfinite(f), (bits | 1).view(torch.float32), f)
    return f.to(torch.float16)


def msprobe_ratio(target: float, reference: float, dtype: torch.dtype) -> float:
    """msprobe 26.2.0's ratio of one metric (``benchmark_compare.py::BenchmarkPrecisionCompare._calc_ratio``):
    ``|t| / max(|r|, MSPROBE_MIN_ERR[dtype])`` (``algorithm.py::calc_ratio``) for finite metrics; NaN
    (a pass) when both are NaN or both the same Inf; ``inf`` (an error) when only one is NaN/Inf or
    the Infs differ (``compare_utils.py::check_inf_or_nan``). ``dtype`` is the target's."""
    if not (math.isfinite(target) and math.isfinite(reference)):
        same = (math.isnan(target) and math.isnan(reference)) or (math.isinf(target) and target == reference)
        return math.nan if same else math.inf
    floor = MSPROBE_MIN_ERR.get(dtype, MSPROBE_MIN_ERR[torch.float32])
    return abs(target) / max(abs(reference), floor)


def ratio(target: float, reference: float, floor: float = 0.0) -> float:
    """``target / max(reference, floor)`` (our ``golden`` limit set); 1 when both are 0 (neither side
    has the error), ``inf`` when only the denominator is 0, NaN when an input is NaN."""
    denominator = max(reference, floor)
    if math.isnan(target) or math.isnan(denominator):
        return math.nan
    if denominator == 0:
        return 1.0 if target == 0 else math.inf
    return target / denominator


def _same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    """Both real floating or both complex."""
    return (a.is_floating_point and b.is_floating_point) or (a.is_complex and b.is_complex)


def judge_golden_tensors(actual: torch.Tensor, expected: torch.Tensor, golden: torch.Tensor,
                         policy: GoldenPolicy, *, tolerance: Tolerance | None = None,
                         path: str = "", work_dtype: torch.dtype | None = None) -> GoldenLeafResult:
    """Judge one leaf: the target ``actual`` and the reference ``expected`` against ``golden``.

    Args:
        actual: the target's tensor (any device).
        expected: the reference's tensor; same shape and dtype as ``actual``.
        golden: the golden tensor (usually float64 or float32), same shape.
        policy: the ratio limits and small-value criterion.
        tolerance: allclose tolerance for the informative target-vs-reference metrics
            (default: ``policy.default_for_dtype`` of ``expected``).
        path: the leaf's name.
        work_dtype: the precision the recipe computes in (``WORK_DTYPES[recipe]``: bfloat16 for
            bf16 work), or None to judge by the leaf's own dtype. Under a 16-bit work dtype, when
            the golden is no finer than the leaf (an fp32 golden for an fp32 output, where no fp64
            golden could run), the rounding floor is the golden rounded to the work dtype: the
            reference can then equal the golden exactly, and a correct target with another kernel
            is only exact to the work dtype.

    Returns:
        A ``GoldenLeafResult`` (its ``passed`` is the verdict). A shape mismatch between target and
        reference, a dtype mismatch of another kind (float vs integer, real vs complex), or a golden
        of another shape fail with ``problem`` set. Two floating dtypes may differ (``note`` says
        so) under a 16-bit work dtype (or none given): the golden judges accuracy, and autocast's op
        lists differ between devices and kernels. Under fp32/fp64 work a dtype change is a failure
        (a target that returns bf16 where fp32 was computed lost precision). Integer and bool
        leaves are judged exactly.
    """
    tol = tolerance if tolerance is not None else default_for_dtype(expected.dtype)
    exact = not (expected.dtype.is_floating_point or expected.dtype.is_complex)
    coarse = expected.dtype
    note = None
    lenient = work_dtype is None or (work_dtype.is_floating_point and torch.finfo(work_dtype).bits <= 16)
    if actual.dtype != expected.dtype and _same_kind(actual.dtype, expected.dtype) and not exact and lenient:
        # Autocast op lists differ between devices and kernels (measured: under CPU bf16 autocast
        # nn.TransformerEncoder's fast path returns bf16, its slow path fp32): the golden judges
        # accuracy, not the dtype. Informative metrics are taken in the finer dtype, the rounding
        # floor in the coarser one.
        common = torch.promote_types(actual.dtype, expected.dtype)
        coarse = actual.dtype if common == expected.dtype else expected.dtype
        base = compare_tensors(actual.to(common), expected.to(common), tol, path)
        base.dtype = str(actual.dtype).removeprefix("torch.")
        base.expected_dtype = str(expected.dtype).removeprefix("torch.")
        note = f"dtype differs: target {base.dtype}, reference {base.expected_dtype} (judged against the golden)"
    else:
        base = compare_tensors(actual, expected, EXACT if exact else tol, path)
    leaf = GoldenLeafResult(**{f.name: getattr(base, f.name) for f in dataclasses.fields(LeafResult)})
    leaf.policy = policy
    leaf.exact = exact
    leaf.note = note
    leaf.golden_dtype = str(golden.dtype).removeprefix("torch.")
    if leaf.problem is not None or exact:
        return leaf
    if tuple(golden.shape) != tuple(expected.shape):
        leaf.problem = f"golden shape {tuple(golden.shape)} differs from the outputs' {tuple(expected.shape)}"
        return leaf

    if (lenient and work_dtype is not None and coarse.is_floating_point and golden.is_floating_point()
            and torch.finfo(golden.dtype).bits <= torch.finfo(coarse).bits
            and torch.finfo(work_dtype).eps > torch.finfo(coarse).eps):
        coarse = work_dtype  # a golden no finer than the output: see work_dtype above
    if policy.msprobe:
        _judge_msprobe(leaf, actual, expected, golden)
        return leaf
    threshold, small_atol = policy.small_values_for(coarse)
    sides = (_SideSums(), _SideSums(), _SideSums())  # target, reference, golden rounded to the dtype
    with _one_intra_op_thread():
        for a, e, g, rounded in float64_blocks(actual, expected, golden, golden.detach().to("cpu").to(coarse)):
            mask = torch.isfinite(a) & torch.isfinite(e) & torch.isfinite(g)
            small = mask & (g.abs() < threshold)
            mask_floor = mask & torch.isfinite(rounded)  # a golden beyond the dtype's range rounds to inf
            sides[0].add(a, g, mask, small, small_atol)
            sides[1].add(e, g, mask, small, small_atol)
            sides[2].add(rounded, g, mask_floor, small & mask_floor, small_atol)
    leaf.target, leaf.reference, leaf.floor = (side.result() for side in sides)
    share_floor = 1.0 / leaf.reference.small if leaf.reference.small else 0.0
    leaf.ratios = {
        "rmse": ratio(leaf.target.rmse, leaf.reference.rmse, leaf.floor.rmse),
        "max_rel": ratio(leaf.target.max_rel, leaf.reference.max_rel, leaf.floor.max_rel),
        "mean_rel": ratio(leaf.target.mean_rel, leaf.reference.mean_rel, leaf.floor.mean_rel),
        "small_share": ratio(leaf.target.small_share, leaf.reference.small_share,
                             max(share_floor, leaf.floor.small_share)),
    }
    return leaf


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Torch ops of the block loops on one intra-op thread (restored on exit). Each block
    (``compare.WORKER_BLOCK`` elements) is a few dozen small elementwise ops and masked copies; with
    two threads each op opens an OpenMP parallel region, which on a loaded machine costs more than
    the op: judging a 2 M-element fp32 leaf took 11.8 s with 2 threads and 0.23 s with one (2-core
    machine, load average 6–8), 11 M elements 75 s before this (a resnet18 training step judges
    three such sets of leaves)."""
    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1:
            torch.set_num_threads(before)


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.empty(0, dtype=dtype).real.dtype if dtype.is_complex else dtype


def _judge_msprobe(leaf: GoldenLeafResult, actual: torch.Tensor, expected: torch.Tensor, golden: torch.Tensor) -> None:
    """msprobe 26.2.0's benchmark metrics of both sides and their ratios into ``leaf`` (see ``_MsprobeSums``)."""
    golden_dtype = _real_dtype(golden.dtype)
    target = _MsprobeSums(_real_dtype(actual.dtype), golden_dtype)
    reference = _MsprobeSums(_real_dtype(expected.dtype), golden_dtype)
    with _one_intra_op_thread():
        for a, e, g in float64_blocks(actual, expected, golden):
            target.add(a, g)
            reference.add(e, g)
    leaf.target, leaf.reference = target.result(), reference.result()
    dtype = target.dtype  # the floor is chosen by the NPU (target) row's dtype
    leaf.ratios = {m: msprobe_ratio(getattr(leaf.target, m), getattr(leaf.reference, m), dtype) for m in METRICS}
    if dtype == torch.float64:
        leaf.note = ((leaf.note + "; ") if leaf.note else "") + "msprobe skips float64; judged with its fp32 values"


def judge_golden(actual: Any, expected: Any, golden: Any, policy: GoldenPolicy = DEFAULT_GOLDEN, *,
                 tolerance: Tolerance | None = None, name: str = "",
                 work_dtype: torch.dtype | None = None) -> GoldenCompareResult:
    """Judge nested outputs under the golden policy, leaf by leaf.

    Args:
        actual: the target's output (tensors or nested tuples/lists/dicts/ModelOutputs of them).
        expected: the reference's output, same structure.
        golden: the golden output, same structure (float leaves in the golden dtype).
        policy: the ratio limits (see ``GoldenPolicy``; ``default_golden_for_recipe`` for a recipe's).
        tolerance: allclose tolerance for the informative metrics (default: by dtype).
        name: the check's name, for messages.
        work_dtype: the recipe's work dtype (``WORK_DTYPES``), see ``judge_golden_tensors``.

    Returns:
        A ``GoldenCompareResult``: passed when every leaf passes. A leaf missing on either side, a
        ``None`` against a tensor, or a leaf without a golden counterpart fails with ``problem``.

    Raises:
        TypeError, ValueError: as ``compare.compare`` for structures it cannot walk.
    """
    result = GoldenCompareResult(name=name, policy=policy)
    got, want = _leaves_by_path(actual, "actual"), _leaves_by_path(expected, "expected")
    gold = _leaves_by_path(golden, "golden")
    for path in list(want) + [p for p in got if p not in want]:
        a, e, g = got.get(path), want.get(path), gold.get(path)
        tol = tolerance or default_for_dtype(e.dtype if e is not None else torch.float32)
        problem = None
        if path not in got:
            problem = "missing in actual output"
        elif path not in want:
            problem = "not in expected output"
        elif a is None or e is None:
            if a is e:
                continue
            problem = f"{'actual' if a is None else 'expected'} is None, the other is a tensor"
        elif path not in gold or (g is None and (e.dtype.is_floating_point or e.dtype.is_complex)):
            problem = "the golden run has no such output"
        if problem is not None:
            result.leaves.append(GoldenLeafResult(path=path, tolerance=tol, problem=problem, policy=policy))
            continue
        if g is None:  # integer leaf without golden: exact comparison needs none
            g = e
        result.leaves.append(judge_golden_tensors(a, e, g, policy, tolerance=tol, path=path, work_dtype=work_dtype))
    return result


# --------------------------------------------------------------------------------------------
# running the golden


class GoldenUnavailableError(RuntimeError):
    """The computation cannot run in the golden dtype (e.g. a hard-coded float32 inside)."""


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor in a nested structure cast to ``dtype`` on the CPU (others moved only);
    always copies, so a computation that changes an input in place never changes the caller's."""
    if isinstance(obj, torch.Tensor):
        cast = obj.detach().to("cpu")
        cast = cast.to(dtype) if cast.is_floating_point() else cast
        return cast.clone() if cast.data_ptr() == obj.data_ptr() else cast
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_cast_floats(v, dtype) for v in obj)
    if isinstance(obj, list):
        return [_cast_floats(v, dtype) for v in obj]
    return obj


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """``torch.set_default_dtype(dtype)`` inside the block (restored on exit, also on error), so
    factory calls without a dtype (``torch.zeros``, ``torch.ones``, Python floats) follow the golden."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class GoldenRunner:
    """Runs computations on the CPU in a golden dtype, with the same seeded randomness as the sides.

    Args:
        root: a model whose submodules are judged; its golden copy is made once and submodules
            are taken from it by name (one fp64 copy of a 210 M-parameter model, 1.7 GB, instead of
            one per submodule). Modules outside ``root`` get their own cached copy.
        shims: ``(dtype) -> context manager`` entered around every golden run to make code that
            hard-codes float32 follow the golden dtype (see the module docstring), or None.

    A module with any submodule in training mode is copied afresh for every run (BatchNorm
    running statistics change in training). Copies are made at the first run: call ``forget()``
    after editing weights.
    """

    def __init__(self, root: torch.nn.Module | None = None,
                 shims: Callable[[torch.dtype], ContextManager[Any]] | None = None):
        self.root = root
        self.shims = shims
        self._root_copies: dict[torch.dtype, torch.nn.Module] = {}
        self._names: dict[int, str] | None = None
        self._copies: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()

    def forget(self) -> None:
        """Drop every cached golden copy (after editing weights)."""
        self._root_copies.clear()
        self._copies = weakref.WeakKeyDictionary()
        self._names = None

    def _copy(self, module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
        if any(m.training for m in module.modules()):
            return copy.deepcopy(module).to(dtype)
        if all(t.dtype == dtype for t in list(module.parameters()) + list(module.buffers()) if t.is_floating_point()) \
                and all(t.device.type == "cpu" for t in list(module.parameters()) + list(module.buffers())):
            return module  # already a CPU module in the golden dtype: no copy
        if self.root is not None:
            if self._names is None:
                self._names = {id(m): name for name, m in self.root.named_modules()}
            name = self._names.get(id(module))
            if name is not None:
                root_copy = self._root_copies.get(dtype)
                if root_copy is None:
                    root_copy = self._root_copies[dtype] = copy.deepcopy(self.root).to(dtype)
                return root_copy.get_submodule(name) if name else root_copy
        per_module = self._copies.setdefault(module, {})
        if dtype not in per_module:
            per_module[dtype] = copy.deepcopy(module).to(dtype)
        return per_module[dtype]

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
            recipe: str = "fp32", seed: int = 0, grad: bool = False,
            dtype: torch.dtype | None = None) -> dict[str, torch.Tensor | None]:
        """The golden output of ``fn(*args, **kwargs)`` for work under ``recipe``, as CPU leaves by path.

        ``fn`` is a module, a bound method of one, or a function; its module (copied) and every
        floating input are cast to the golden dtype: ``dtype``, else each of
        ``golden_dtypes(recipe)`` in turn until one runs. Runs with strict fp32 flags, no
        autocast, ``rng.same_randomness(seed)``, the default dtype set to the golden dtype, and the
        shims.

        Raises:
            GoldenUnavailableError: the computation raised in every golden dtype, or a floating
                output came back in a lower precision than it; the message names the cause (of
                the first dtype tried).
            ValueError: for an unknown recipe.
        """
        if dtype is None:
            first: GoldenUnavailableError | None = None
            for candidate in golden_dtypes(recipe):
                try:
                    return self.run(fn, args, kwargs, recipe=recipe, seed=seed, grad=grad, dtype=candidate)
                except GoldenUnavailableError as exc:
                    first = first or exc
            raise first  # type: ignore[misc]
        module = owner_module(fn)
        if isinstance(fn, torch.nn.Module):
            call = self._copy(fn, dtype)
        elif module is not None:
            call = getattr(self._copy(module, dtype), fn.__name__)
        else:
            call = fn
        args_g, kwargs_g = _cast_floats(args, dtype), _cast_floats(kwargs or {}, dtype)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(strict_fp32_flags())
                stack.enter_context(default_dtype(dtype) if dtype.is_floating_point else contextlib.nullcontext())
                if self.shims is not None:
                    stack.enter_context(self.shims(dtype))
                stack.enter_context(same_randomness(seed))
                stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
                output = call(*args_g, **kwargs_g)
        except Exception as exc:  # noqa: BLE001 - whatever the golden dtype breaks, the check falls back
            raise GoldenUnavailableError(f"the {str(dtype).removeprefix('torch.')} golden run failed: "
                                         f"{type(exc).__name__}: {exc}") from exc
        leaves = {p: (t.detach().to("cpu") if t is not None else None) for p, t in flatten(output)}
        lower = [p for p, t in leaves.items() if t is not None and t.is_floating_point()
                 and torch.finfo(t.dtype).bits < torch.finfo(dtype).bits]
        if lower:
            kinds = sorted({str(leaves[p].dtype).removeprefix("torch.") for p in lower})
            raise GoldenUnavailableError(
                f"the golden run returned {', '.join(kinds)} for {', '.join(repr(p or '<output>') for p in lower[:3])}"
                f" instead of {str(dtype).removeprefix('torch.')}: the computation hard-codes a lower precision")
        return leaves

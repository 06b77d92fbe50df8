"""Layer records: every weighted layer's output, sampled, judged by its relative L2 error.

A fault inside a model can be invisible at its output. Measured on small Hugging Face
``BertModel`` configurations (``benchmarks/damped_faults.py``): the first layer's query weight
scaled by (1 + 1e-4) moves ``pooler_output`` by a relative L2 error of 1.3e-7, the same as another
CPU kernel path of a correct run, because the softmax and LayerNorm after it damp it; no
comparison of outputs can tell the two apart. The query projection's own output moved by 1e-4.

So every check of a module also records, on each side, the output of each of its submodules
that holds parameters of its own (``Linear``, ``Conv2d``, ``LayerNorm``, ``Embedding``,
``BatchNorm2d``, an ``LSTM`` inside a larger model …; the checked module itself is left out: its
output is the check's; so are modules whose forward changes path when hooked, ``HOOK_SENSITIVE``),
at the first call of that submodule in the run:

* the first dense floating tensor of the output (in ``compare.flatten`` order) and of the
  positional inputs, flattened;
* of each, the values at ``samples`` positions (``compact.sample_indices``: the same positions for
  a layer of that name and size on every machine), or all of them when it has no more.

The records travel with the check's leaves as ``layer:<submodule path>`` (output) and
``layer:<submodule path>@in`` (input) — a baseline stores them beside the outputs, 512 bytes per layer
at the default 64 samples — and are taken out before the outputs are compared
(``split_layers``). ``judge_layers`` then judges each layer both sides recorded by the relative L2
error of its output, ``||a - e||_2 / ||e||_2`` over the recorded values (independent of the
layer's scale; ``floor``, an RMS below which an output counts as zero, for zero-initialised
layers), against the same error of its input. A layer fails when its output error is beyond
``limit`` **and** beyond ``amplification`` times its input's error:

* a weight fault of relative size r moves its layer's output by about r while the layer's input
  carries only the rounding of the layers before it: measured (``benchmarks/damped_faults.py``)
  1e-4 at the faulted layer over inputs within 2e-5;
* two correct runs differ at rounding level, a few 1e-7 per layer in fp32, but drift accumulates
  through ill-conditioned layers: resnet18's training-mode BatchNorms over 1x1 feature maps of a
  batch of 4 carried it to 1.8e-5 on another CPU kernel path, each layer amplifying what it
  received by less than 3.

So the fp32 defaults (``DEFAULT_LIMITS``, ``DEFAULT_AMPLIFICATION``) are a limit of 1e-5 and an
amplification of 10. bf16 work differs by ~4e-3 per layer between correct runs, far above a 1e-4
fault, so no bf16 limit is set by default. A layer without a floating positional input (an
``Embedding``, a layer called with keyword arguments only) is judged by the limit alone.

Positions where both sides hold the same non-finite value (``-inf`` of a mask) count as equal; a
non-finite value on one side only fails its layer. A layer whose records differ in size (another
output shape) or that only one side recorded (a fast path that fuses its submodules) is not
judged; the verdict says how many were left out.

A recurrent layer (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) is judged at a tenth of the limit
(``RECURRENT_FACTOR``): its gates damp a fault of its recurrent weights below the fp32 limit at
its output, while correct runs agree there to rounding (measured; see the constant). Its record
carries a marker (``layer:<path>@recurrent``), so a baseline recorded before it is judged at the
plain limit.

The records are taken by ``runtime.layer_capture`` (``capture_layers``, the ``layer:`` key format,
``split_layers``), as part of a side's run; this module judges them. ``pytest_npu_parity.layers``
is the old import path of both and re-exports every name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..runtime.layer_capture import _SUFFIXES, DEFAULT_SAMPLES, INPUT_SUFFIX, LAYER_PREFIX, RECURRENT_SUFFIX


#: Default relative L2 limit per recipe; a recipe not named records no layers.
DEFAULT_LIMITS = {"fp32": 1e-5}
#: RMS below which a layer output counts as zero (default ``floor``).
DEFAULT_FLOOR = 1e-9
#: How many times its input's relative error a layer's output error may be (default).
DEFAULT_AMPLIFICATION = 10.0
#: A recurrent layer (``nn.RNNBase``: LSTM, GRU, RNN) is judged at this fraction of the limit.
#: Measured on a 2-layer LSTM + bidirectional GRU (tests/judge/test_layers_recurrent.py): a 1e-4 fault of
#: the LSTM's ``weight_hh_l0`` moves the LSTM's output by a relative L2 error of 9.5e-6 — the
#: gates damp a recurrent weight, and the first step does not see it — just under the fp32 limit
#: of 1e-5, while correct runs agree bitwise there across thread counts, ATen's ``default``
#: kernel path, oneDNN capped at AVX2 and torch 2.5.1 vs 2.14.1, and within 8.8e-8 for a GRU on
#: another kernel path (benchmarks/results/damped_faults.md, gru_eval).
RECURRENT_FACTOR = 0.1


@dataclass(frozen=True)
class LayerPolicy:
    """How layer records are judged.

    Attributes:
        limit: largest relative L2 error ``||a - e|| / ||e||`` of a layer's recorded values (fp32
            default 1e-5, module doc).
        floor: RMS of an output that counts as zero (default 1e-9): the allowed L2 error is
            ``limit * ||e|| + floor * sqrt(n)``.
        amplification: a layer's output error within this many times its input's error is drift
            it received, not its own (default 10; module doc).
        samples: values recorded per layer output (default ``DEFAULT_SAMPLES``, 64).
        source: where the limit came from (``default``, ``ini``, ``option``, ``marker``, ``check``).

    Raises:
        ValueError: a limit or floor that is not a finite number >= 0, or samples < 1.
    """

    limit: float
    floor: float = DEFAULT_FLOOR
    samples: int = DEFAULT_SAMPLES
    source: str = "default"
    amplification: float = DEFAULT_AMPLIFICATION

    def __post_init__(self) -> None:
        for name in ("limit", "floor", "amplification"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"layer check {name}={value!r}: give a finite number >= 0")
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"layer check samples={self.samples!r}: give a positive integer")

    def describe(self) -> str:
        return f"rel-L2 <= {self.limit:g} per layer or <= {self.amplification:g}x its input's ({self.source})"


def parse_layer_spec(spec: Any, *, source: str) -> LayerPolicy | None:
    """``"off"`` (None: no layer records), a limit (``"1e-5"``, ``1e-5``), ``True`` (the default
    limit of fp32) or a ``LayerPolicy`` as a policy.

    Raises:
        ValueError: anything else, naming the value and the accepted forms.
    """
    if spec is None or isinstance(spec, LayerPolicy):
        return spec
    if spec is False:
        return None
    if spec is True:
        return LayerPolicy(DEFAULT_LIMITS["fp32"], source=source)
    text = str(spec).partition("#")[0].strip()
    if text.lower() in ("off", "none", "false"):
        return None
    try:
        limit = float(text)
    except ValueError:
        raise ValueError(f"layer check {spec!r}: give 'off' or a relative L2 limit such as 1e-5") from None
    return LayerPolicy(limit, source=source)


def default_layer_policy(recipe: str) -> LayerPolicy | None:
    """The default ``LayerPolicy`` of ``recipe`` (``DEFAULT_LIMITS``), None when it records no layers."""
    limit = DEFAULT_LIMITS.get(recipe)
    return None if limit is None else LayerPolicy(limit)


@dataclass
class LayerVerdict:
    """What ``judge_layers`` found.

    Attributes:
        policy: the ``LayerPolicy`` applied.
        judged: layers judged (recorded by both sides with the same size).
        errors: ``{layer path: relative L2 error of its output}`` of every judged layer, in the
            target's call order (``inf`` where one side alone is non-finite, or the reference is
            zero and the target not).
        input_errors: ``{layer path: relative L2 error of its input}`` where both sides recorded one.
        failing: the judged layers beyond the limit and beyond ``amplification`` times their
            input's error, in call order.
        unmatched: layers recorded by one side only or with other sizes.
    """

    policy: LayerPolicy
    judged: int = 0
    errors: dict[str, float] = field(default_factory=dict)
    input_errors: dict[str, float] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    unmatched: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failing

    def worst(self) -> tuple[str, float] | None:
        """``(layer, relative L2 error)`` of the judged layer with the largest error, or None."""
        if not self.errors:
            return None
        name = max(self.errors, key=lambda k: self.errors[k])
        return name, self.errors[name]

    def format(self) -> str:
        """One paragraph for a failure message (empty when it passed)."""
        if self.passed:
            return ""
        def one(k: str) -> str:
            given = self.input_errors.get(k)
            return f"{k!r} {self.errors[k]:.2g}" + (f" (input {given:.2g})" if given is not None else "")

        shown = ", ".join(one(k) for k in self.failing[:4])
        more = f", … ({len(self.failing) - 4} more)" if len(self.failing) > 4 else ""
        return (f"Layer check failed: {len(self.failing)} of {self.judged} weighted layers moved their output "
                f"beyond rel-L2 {self.policy.limit:g} and beyond {self.policy.amplification:g}x their input's "
                f"({self.policy.source} limits), first in call order: {shown}{more}. "
                f"The first is where the computations part: inspect that layer (its weights, its op on the "
                f"target). Set the limit with --parity-layers or @pytest.mark.parity(layers=...); "
                f"layers=False turns the layer check off for a test.")


def judge_layers(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                 policy: LayerPolicy) -> LayerVerdict:
    """Judge the layer records ``actual`` (target) against ``expected`` (reference) by ``policy``.

    Both are ``{"layer:<path>": 1-D tensor}`` as ``capture_layers`` records them; errors are
    computed in float64. See the module doc for the rule.
    """
    verdict = LayerVerdict(policy)
    judged = []  # (key, name) of the layers both sides recorded with the same size, in the target's order
    for key, a in actual.items():
        if key.endswith(_SUFFIXES):
            continue
        name = key[len(LAYER_PREFIX):]
        e = expected.get(key)
        if e is None or e.shape != a.shape:
            verdict.unmatched.append(name)
            continue
        judged.append((key, name))
    measured = _l2_norms([(actual[key], expected[key]) for key, _ in judged])
    for (key, name), norms in zip(judged, measured):
        error, within = _rel_l2_of(norms, policy.floor)
        verdict.judged += 1
        verdict.errors[name] = error
        limit = policy.limit * (RECURRENT_FACTOR if key + RECURRENT_SUFFIX in actual else 1.0)
        if within(limit):
            continue
        a_in, e_in = actual.get(key + INPUT_SUFFIX), expected.get(key + INPUT_SUFFIX)
        if a_in is not None and e_in is not None and a_in.shape == e_in.shape:
            given, _ = _rel_l2(a_in, e_in, policy.floor)
            verdict.input_errors[name] = given
            if error <= policy.amplification * given:
                continue  # the drift it received, amplified within the limit
        verdict.failing.append(name)
    verdict.unmatched.extend(k[len(LAYER_PREFIX):] for k in expected
                             if not k.endswith(_SUFFIXES) and k not in actual)
    return verdict


def _rel_l2(a: torch.Tensor, e: torch.Tensor, floor: float):
    """``(relative L2 error of a vs e, within(limit) -> bool)`` in float64 (module doc's rule)."""
    return _rel_l2_of(_l2_norms([(a, e)])[0], floor)


def _rel_l2_of(norms: tuple[float, float, int] | None, floor: float):
    """``_rel_l2`` from ``_l2_norms``' ``(‖a − e‖, ‖e‖, n)`` (None: a non-finite value on one side only)."""
    if norms is None:
        return math.inf, lambda limit: False
    diff, scale, n = norms
    error = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return error, lambda limit: diff <= limit * scale + floor * math.sqrt(n)


def _l2_norms(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[float, float, int] | None]:
    """Per pair of 1-D records ``(a, e)`` of one size: ``(‖a − e‖_2, ‖e‖_2, n)`` in float64 over the
    ``n`` positions finite on both sides, or None where a position is non-finite on one side only
    (the same non-finite value on both sides is equal and left out). The pairs of one size and dtypes
    are stacked and measured together: a check records a hundred layers or more, and measured one by
    one each took a dozen small tensor operations."""
    out: list[tuple[float, float, int] | None] = [None] * len(pairs)
    groups: dict[tuple, list[int]] = {}
    for i, (a, e) in enumerate(pairs):
        groups.setdefault((a.numel(), a.dtype, e.dtype), []).append(i)
    zero = torch.zeros((), dtype=torch.float64)
    for rows in groups.values():
        a64 = torch.stack([pairs[i][0].reshape(-1) for i in rows]).double()  # [layers, values]
        e64 = torch.stack([pairs[i][1].reshape(-1) for i in rows]).double()
        both = torch.isfinite(a64) & torch.isfinite(e64)
        agree = ((a64 == e64) | both).all(dim=1)
        diff = torch.linalg.vector_norm(torch.where(both, a64 - e64, zero), dim=1)
        scale = torch.linalg.vector_norm(torch.where(both, e64, zero), dim=1)
        finite = both.sum(dim=1)
        for i, ok, d, s, n in zip(rows, agree.tolist(), diff.tolist(), scale.tolist(), finite.tolist()):
            out[i] = (d, s, n) if ok else None
    return out

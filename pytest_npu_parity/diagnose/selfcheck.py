"""Can a check fail at all? The vacuity guard and the self-check mode (``--parity-selfcheck``).

A parity check that cannot fail is worse than none: it reports parity for a port it never tested.
Two cases are common. The reference output does not depend on the network (fresh Aurora weights:
``SimpleMLPAdaLN`` zero-initializes its output layers, so the forecast collapses to the input mean;
docs/explanation/findings.md, "Vacuous full-model checks"), or the tolerance is so loose that no error
would exceed it. This module finds both.

Vacuity guard (always on, cheap: one pass over the reference leaves; ``vacuity_problem``)
    A check whose reference output is constant — every floating leaf with more than one element holds
    one value (all zero included) — fails as *vacuous*, unless allowed with a reason
    (``parity.check(..., vacuous_ok="...")`` or ``@pytest.mark.parity(vacuous_ok="...")``).

Self-check (``SelfCheck``, registered by ``--parity-selfcheck``; costs about two extra runs per check)
    After a check passed its normal comparison:

    a. *output teeth*: each output leaf of the target is perturbed — one element more than the budget
       allows (``Tolerance.allowed_mismatches + 1``), each moved from the reference value by twice its
       allowed error ``2·(atol + rtol·|expected|)`` (further, by doubling, where the leaf's dtype
       cannot represent that step) — and the comparison must fail (``output_teeth``);
    b. *weight teeth* (checks of a module, and train steps): the check's ``fault_weight``, else the
       module's largest trainable weight matrix (``sensitive_parameter``), is scaled by
       ``1 + 10·rtol`` on the target side only — on the very module object the target runs
       (``target_module``) — the target is run again and the comparison must fail
       (``weight_teeth``). For a train step the scaled parameter's own ``param.<name>`` leaf is left
       out: it only echoes the perturbation;
    c. *input sensitivity* (the costly part of the vacuity guard): every floating input tensor is
       moved by 1 % of its RMS (seeded Gaussian noise) and the reference computation (a live CPU
       run) is repeated; an output that does not change at all is *input-insensitive*
       (``input_sensitivity``). For a check of a module that makes the check vacuous (the network
       ignores its data); for a free function it is only noted (``causal_attention_mask(n)`` builds a
       fixed mask from a size: its tensor argument only names the device).

    A check has *teeth* when (a) and (b) both caught their perturbation. The result goes into
    ``record.self_check``: ``teeth`` (bool), ``teeth_problem`` (text, when without teeth) and
    ``selfcheck`` (a JSON-able dict of what was measured). A check without teeth, or a vacuous
    one, fails in self-check mode unless it carries ``vacuous_ok``. ``teeth_summary`` counts the
    share of checks with teeth over report rows (the plugin prints it: ``teeth: 96/96 (100 %)``).

This module never imports pytest.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from ..judge.allclose import compare
from ..judge.tolerance import Tolerance, default_for_dtype

#: The weight is scaled by 1 + WEIGHT_RTOLS·rtol of the check (1 + 1e-4 under fp32's rtol 1e-5:
#: the fault the Aurora sensitivity tests prove every fp32 check catches).
WEIGHT_RTOLS = 10.0
#: Output perturbation: each perturbed element lies this many allowed errors from the reference.
OUTPUT_FACTOR = 2.0
#: Input perturbation: Gaussian noise of this fraction of each floating input's RMS.
INPUT_NOISE = 1e-2


# --------------------------------------------------------------------------------------------
# vacuity guard


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _constant_value(t: torch.Tensor) -> Any:
    """The single value of ``t`` if every element holds it (all-NaN counts), else ``None``."""
    flat = t.detach().reshape(-1)
    first = flat[0]
    if bool(torch.isnan(first)) if not flat.is_complex() else bool(torch.isnan(first.real) | torch.isnan(first.imag)):
        return first.item() if bool(torch.isnan(flat).all()) else None
    if not bool((flat[:64] == first).all()):  # a varying output almost always shows it at once
        return None
    return first.item() if bool((flat == first).all()) else None


def vacuity_problem(expected: Mapping[str, torch.Tensor | None]) -> str | None:
    """Why the reference output ``expected`` makes a check vacuous, or None.

    Args:
        expected: the reference leaves ``{path: CPU tensor or None}`` (``runner._to_cpu_leaves``).

    Returns:
        A sentence such as ``"its reference output is constant: 'logits' is all 0 (4x96)"`` when
        every floating/complex leaf with more than one element holds a single value (all zero, all
        NaN and any other constant); ``"its output holds no tensor: ..."`` when no leaf is a
        non-empty tensor (a function that returns ``None``, an empty tuple or only empty tensors
        compares nothing); else None — also when no leaf has more than one element (a lone loss
        value is not judged) or the only tensors are integer/bool ones (compared exactly).
    """
    if not any(isinstance(t, torch.Tensor) and t.numel() > 0 for t in expected.values()):
        if not expected:
            what = "it is empty"
        elif all(t is None for t in expected.values()):
            what = "it is None" if list(expected) == [""] else f"all {len(expected)} leaves are None"
        else:
            what = "its tensors are empty"
        return f"its output holds no tensor: {what}, so there is nothing to compare"
    judged = {path: t for path, t in expected.items() if _floating(t) and t.numel() > 1}
    if not judged:
        return None
    values = {}
    for path, t in judged.items():
        value = _constant_value(t)
        if value is None:
            return None
        values[path] = (value + 0 if not isinstance(value, bool) else value, "x".join(map(str, t.shape)))
    shown = [f"{(path or '<output>')!r} is all {value:g} ({shape})" if not isinstance(value, complex)
             else f"{(path or '<output>')!r} is all {value} ({shape})" for path, (value, shape) in list(values.items())[:3]]
    more = f" and {len(values) - 3} more leaves" if len(values) > 3 else ""
    return "its reference output is constant: " + ", ".join(shown) + more


class ParityVacuityWarning(UserWarning):
    """A check's reference output is so small that its tolerance cannot see a change of the
    output's own size (``below_tolerance``): the check passes whatever the target computes there."""


ParityVacuityWarning.__module__ = "pytest_npu_parity.selfcheck"  # its printed name (and -W filters) stay those of the old path


def below_tolerance(expected: Mapping[str, torch.Tensor | None], tol: Tolerance) -> str | None:
    """Why ``tol`` cannot see a change of ``expected``'s own size, or None.

    Args:
        expected: the reference leaves ``{path: CPU tensor or None}``.
        tol: the check's allclose tolerance.

    Returns:
        A sentence such as ``"every element of its reference output is within atol of zero
        (largest |'logits'| 2.7e-10, atol 1e-05): a target that returns zeros, or twice the
        reference, passes"`` when every floating leaf with more than one element (the leaves
        ``vacuity_problem`` judges; at least one) satisfies ``|e| <= atol + rtol·|e|`` everywhere —
        then replacing the output by 0 or by ``2·e`` stays within ``atol + rtol·|e|`` (the allclose
        test of ``torch.isclose``) — else None. A constant output is ``vacuity_problem``'s case.
    """
    judged = {path: t for path, t in expected.items() if _floating(t) and t.numel() > 1}
    if not judged or tol.rtol >= 1.0:
        return None
    limit = tol.atol / (1.0 - tol.rtol)
    largest = {}
    for path, t in judged.items():
        top = float(t.detach().abs().nan_to_num(nan=math.inf).max())
        if not top <= limit:
            return None
        largest[path] = top
    path, top = max(largest.items(), key=lambda kv: kv[1])
    return (f"every element of its reference output is within atol of zero (largest |{(path or '<output>')!r}| "
            f"{top:.2g}, atol {tol.atol:g}): a target that returns zeros, or twice the reference, passes")


# --------------------------------------------------------------------------------------------
# (a) output teeth


def perturb_leaf(actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance,
                 factor: float = OUTPUT_FACTOR) -> torch.Tensor | None:
    """``actual`` with ``allowed + 1`` elements moved ``factor`` allowed errors away from ``expected``.

    The elements are spread evenly over the positions finite on both sides; each becomes
    ``expected + factor·(atol + rtol·|expected|)`` (the real part for complex tensors). Bool elements
    are flipped, integer ones moved by one. The result has ``actual``'s dtype; a step the dtype rounds
    away is not enlarged here (``output_teeth`` doubles ``factor`` until the comparison can see it).

    Args:
        actual, expected: CPU tensors of the same shape and dtype (one output leaf of each side).
        tolerance: the leaf's tolerance (``budget`` decides how many elements are moved).
        factor: distance from ``expected`` in allowed errors (> 1).

    Returns:
        The perturbed copy, or None when it cannot be made: an empty leaf, a budget that allows every
        element to be out of tolerance, or fewer finite positions than elements to move.
    """
    numel = expected.numel()
    n = tolerance.allowed_mismatches(numel) + 1
    if numel == 0 or n > numel:
        return None
    a = actual.detach().reshape(-1).clone()
    e = expected.detach().reshape(-1)
    if a.dtype == torch.bool:
        finite = torch.arange(numel)
    elif a.is_floating_point() or a.is_complex():
        finite = torch.nonzero(torch.isfinite(a) & torch.isfinite(e)).reshape(-1)
    else:
        finite = torch.arange(numel)
    if finite.numel() < n:
        return None
    where = finite[torch.linspace(0, finite.numel() - 1, n, dtype=torch.float64).round().long()]
    if a.dtype == torch.bool:
        a[where] = ~e[where]
    elif a.is_floating_point() or a.is_complex():
        base = (e[where].real if e.is_complex() else e[where]).to(torch.float64)
        step = factor * (tolerance.atol + tolerance.rtol * e[where].abs().to(torch.float64))
        # A zero tolerance (exact comparison of floats) still needs a visible step: a few ulps.
        step = torch.maximum(step, 4 * torch.finfo(a.real.dtype if a.is_complex() else a.dtype).eps * base.abs()
                             + torch.finfo(torch.float32).tiny)
        moved = (base + step).to(a.real.dtype if a.is_complex() else a.dtype)
        a[where] = torch.complex(moved, e[where].imag) if a.is_complex() else moved
    else:
        info = torch.iinfo(a.dtype)
        ew = e[where].to(torch.int64)
        a[where] = torch.where(ew == info.max, ew - 1, ew + 1).to(a.dtype)
    return a.reshape(actual.shape)


def output_teeth(actual: Mapping[str, torch.Tensor | None], expected: Mapping[str, torch.Tensor | None],
                 tolerance: Tolerance, factor: float = OUTPUT_FACTOR) -> dict[str, str]:
    """The output leaves whose out-of-tolerance perturbation the comparison does *not* catch.

    Each leaf present on both sides with equal shapes and dtypes is perturbed alone
    (``perturb_leaf``) and compared under the check's tolerance (``compare.compare``: integer leaves
    exactly); if the perturbed element rounds back into tolerance in the leaf's dtype the distance
    is doubled (up to 2**20·``factor``) before the leaf is declared toothless.

    Returns:
        ``{leaf path: why it has no teeth}``; empty when every leaf has teeth.
    """
    toothless: dict[str, str] = {}
    for path, e in expected.items():
        a = actual.get(path)
        if not isinstance(a, torch.Tensor) or not isinstance(e, torch.Tensor) or a.shape != e.shape \
                or a.dtype != e.dtype or e.numel() == 0:
            continue
        # As compare() judges it: the check's tolerance for floating leaves, exact for integer/bool.
        leaf_tol = tolerance if _floating(e) else default_for_dtype(e.dtype)
        k = factor
        perturbed = perturb_leaf(a, e, leaf_tol, k)
        if perturbed is None:
            toothless[path] = (f"budget {leaf_tol.budget:g} allows all {e.numel()} elements to be out of tolerance"
                               if leaf_tol.allowed_mismatches(e.numel()) >= e.numel()
                               else "too few finite elements to perturb")
            continue
        while compare({"x": perturbed}, {"x": e}, tolerance).passed:
            k *= 2
            if k > factor * 2 ** 20:
                toothless[path] = (f"{leaf_tol.allowed_mismatches(e.numel()) + 1} elements moved "
                                   f"{factor:g}..{k / 2:g}x their allowed error still pass ({leaf_tol.describe()})")
                break
            perturbed = perturb_leaf(a, e, leaf_tol, k)
    return toothless


# --------------------------------------------------------------------------------------------
# (b) weight teeth


def sensitive_parameter(module: torch.nn.Module) -> str | None:
    """Name of the parameter a weight perturbation should scale, or None when there is none.

    The largest trainable floating weight matrix (two or more dimensions) of ``module``; frozen
    matrices only when nothing is trainable (a frozen ViT/BERT still computes the output); a
    floating vector (bias, norm scale) only when the module has no matrix. Among equals the first
    registered one (as ``aurora.checks.sensitive_weight``): an FFN's *last* linear often feeds a
    normalization with batch statistics, which makes a uniform scale of it invisible by design.
    A check whose generic choice is such a weight names another with ``fault_weight``.
    """
    candidates = [(p.dim() >= 2, p.requires_grad, p.numel(), -i, n)
                  for i, (n, p) in enumerate(module.named_parameters()) if p.is_floating_point() and p.numel() > 0]
    return max(candidates)[4] if candidates else None


@contextlib.contextmanager
def scaled_parameter(module: torch.nn.Module, name: str, factor: float) -> Iterator[None]:
    """Multiply parameter ``name`` of ``module`` by ``factor`` inside the block (restored bit-exactly).

    Raises:
        AttributeError: ``module`` has no parameter ``name`` (``nn.Module.get_parameter``).
    """
    param = module.get_parameter(name)
    saved = param.detach().clone()
    with torch.no_grad():
        param.mul_(factor)
    try:
        yield
    finally:
        with torch.no_grad():
            param.copy_(saved)


def target_module(case: Any, module: torch.nn.Module, kind: str = "check") -> torch.nn.Module:
    """The module object whose weights the target side actually computes with.

    A module in training mode, and a train step's module, are copied for every run
    (``ParitySession.place``: ``runner.fresh_copy``, which shares the weights; ``ParityCase.train_step``:
    a deep copy): the copy is made from ``module`` itself, so editing ``module``'s weights reaches it.
    An eval module on a CPU target is run as it is; on another device (or in another weights dtype)
    the session's cached copy runs (``session.place``), so that copy is what a fault must edit.
    """
    if kind == "train_step" or any(m.training for m in module.modules()):
        return module
    return case.session.place(module, case.target, case.recipe.weights_dtype)


def weight_teeth(case: Any, call: Any, expected: Mapping[str, torch.Tensor | None], tolerance: Tolerance,
                 rtols: float = WEIGHT_RTOLS) -> dict[str, Any] | None:
    """Scale the check's sensitive weight on the target side, run the target again, compare.

    Args:
        case: the ``runner.ParityCase`` the check ran in (its patch set and recipe apply).
        call: the check's ``runner.CheckCall``.
        expected: the reference leaves the check was judged against.
        tolerance: the check's tolerance; the factor is ``1 + rtols·max(rtol, 1e-6)``.

    Returns:
        None for a check of a free function (nothing to scale), else a JSON-able dict:
        ``weight`` (parameter name: ``call.fault_weight``, else ``sensitive_parameter``'s choice),
        ``factor``, ``caught`` (the comparison failed), ``worst_leaf`` and ``worst_err_ratio``
        (max |a−e|/(atol+rtol·|e|) over leaves; > 1 is out of tolerance).

    Raises:
        ValueError: ``call.fault_weight`` is not a floating parameter of the check's module.
    """
    module = call.module
    if module is None:
        return None
    name = getattr(call, "fault_weight", None) or sensitive_parameter(module)
    params = dict(module.named_parameters())
    if name is not None and (name not in params or not params[name].is_floating_point()):
        raise ValueError(f"fault_weight={name!r} is not a floating parameter of {type(module).__name__}; "
                         f"some of its parameters: {', '.join(list(params)[:5])}")
    if name is None:
        return {"weight": None, "factor": None, "caught": False, "worst_leaf": None, "worst_err_ratio": None}
    factor = 1.0 + rtols * max(tolerance.rtol, 1e-6)
    # Scaled around the whole run: placement (inside the run, after the patch set) copies the
    # scaled weights where it copies at all, and a train step copies its module before patching.
    with scaled_parameter(target_module(case, module, call.kind), name, factor):
        leaves = call.rerun(case.target, True, call.args, call.kwargs)
    if call.kind == "train_step":  # the scaled parameter after the step only echoes the perturbation
        from ..store.compact import base_leaf  # (also its @sample/@stats leaves in a compact baseline)

        leaves = {p: t for p, t in leaves.items() if base_leaf(p) != f"param.{name}"}
        expected = {p: t for p, t in expected.items() if base_leaf(p) != f"param.{name}"}
    result = compare(leaves, expected, tolerance)
    worst = max(result.leaves, key=lambda leaf: -1.0 if math.isnan(leaf.err_ratio) else leaf.err_ratio, default=None)
    return {"weight": name, "factor": factor, "caught": not result.passed,
            "worst_leaf": worst.path if worst is not None else None,
            "worst_err_ratio": worst.err_ratio if worst is not None else None}


# --------------------------------------------------------------------------------------------
# (c) input sensitivity


def perturb_inputs(obj: Any, seed: int = 0, noise: float = INPUT_NOISE) -> tuple[Any, int]:
    """A copy of the nested inputs ``obj`` with every floating tensor moved by seeded Gaussian noise
    of ``noise`` times its RMS (1 where the tensor is all zero); returns ``(copy, tensors moved)``.

    Non-floating tensors, numbers and other objects are kept as they are; tuples, lists and dicts
    (also ``ModelOutput``-like mappings, rebuilt as dicts) are walked.
    """
    gen = torch.Generator().manual_seed(seed)
    moved = 0

    def walk(x: Any) -> Any:
        nonlocal moved
        if isinstance(x, torch.Tensor):
            if not x.is_floating_point() or x.numel() == 0:
                return x
            moved += 1
            x64 = x.detach().to("cpu", torch.float64)
            rms = float(x64.square().mean().sqrt()) or 1.0
            delta = torch.randn(x.shape, generator=gen, dtype=torch.float64) * (noise * rms)
            return (x64 + delta).to(device=x.device, dtype=x.dtype)
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, Mapping):
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(obj), moved


def input_sensitivity(case: Any, call: Any, reference: Mapping[str, torch.Tensor | None] | None,
                      noise: float = INPUT_NOISE) -> bool | None:
    """Does the reference output change when the floating inputs change (``perturb_inputs``)?

    Args:
        case: the ``runner.ParityCase``.
        call: the check's ``runner.CheckCall``; its reference computation is run live on the CPU
            (unpatched) with the perturbed inputs.
        reference: the live CPU reference leaves for the unperturbed inputs, or None to run them too
            (the check's reference was a stored baseline).
        noise: relative size of the input perturbation (``perturb_inputs``).

    Returns:
        True when some output leaf changed, False when every leaf is bit-identical, None when the
        check has no floating input tensor to perturb.
    """
    (args, kwargs), moved = perturb_inputs((call.args, call.kwargs), seed=call.seed, noise=noise)
    if not moved:
        return None
    cpu = torch.device("cpu")
    if reference is None:
        reference = call.rerun(cpu, False, call.args, call.kwargs)
    changed = call.rerun(cpu, False, args, kwargs)
    for path, t in reference.items():
        other = changed.get(path)
        if (t is None) != (other is None):
            return True
        if t is not None and (t.shape != other.shape or t.dtype != other.dtype or not torch.equal(t, other)):
            return True
    return set(changed) != set(reference)


# --------------------------------------------------------------------------------------------
# the check hook


class SelfCheck:
    """``ParitySession`` check hook of ``--parity-selfcheck``: measures every passing check's teeth.

    Called as ``hook(case, record, call, actual, expected)`` after each comparison (see module doc
    for a–c). Fills ``record.self_check`` (``teeth``, ``teeth_problem``, ``selfcheck``) and returns a
    problem text — which fails the check — when the check has no teeth or is input-insensitive as a
    module, unless ``call.vacuous_ok`` gives a reason. A check that already failed its comparison
    evidently can fail: it is counted with teeth and not perturbed.

    Args:
        weight_rtols: the weight is scaled by ``1 + weight_rtols·rtol``.
        output_factor: perturbed output elements lie this many allowed errors off.
        input_noise: relative size of the input perturbation (0 turns part c off).
    """

    def __init__(self, weight_rtols: float = WEIGHT_RTOLS, output_factor: float = OUTPUT_FACTOR,
                 input_noise: float = INPUT_NOISE):
        self.weight_rtols = weight_rtols
        self.output_factor = output_factor
        self.input_noise = input_noise

    def __call__(self, case: Any, record: Any, call: Any, actual: Mapping[str, Any],
                 expected: Mapping[str, Any]) -> str | None:
        if record.result is not None and not record.result.passed:
            record.self_check.teeth, record.self_check.selfcheck = True, {"note": "the check failed its own comparison"}
            return None
        tol = record.tolerance
        report: dict[str, Any] = {}
        toothless = output_teeth(actual, expected, tol, self.output_factor)
        report["output_leaves_without_teeth"] = toothless
        weight = weight_teeth(case, call, expected, tol, self.weight_rtols)
        report["weight"] = weight
        problems = []
        if not any(isinstance(e, torch.Tensor) and e.numel() > 0 and isinstance(actual.get(p), torch.Tensor)
                   for p, e in expected.items()):
            problems.append("its output holds no tensor to perturb")
        if toothless:
            first = next(iter(toothless))
            problems.append(f"output leaf {first or '<output>'!r}: {toothless[first]}"
                            + (f" (and {len(toothless) - 1} more leaves)" if len(toothless) > 1 else ""))
        if weight is not None and not weight["caught"]:
            if weight["weight"] is None:
                problems.append("the module has no floating parameter to perturb")
            else:
                problems.append(f"scaling weight {weight['weight']!r} by {weight['factor']:.6g} on the target "
                                f"still passes (worst err/tol {weight['worst_err_ratio']:.3g} at "
                                f"{(weight['worst_leaf'] or '<output>')!r})")
        sensitive = None
        if self.input_noise > 0:
            live = dict(expected) if record.reference == "cpu" else None
            sensitive = input_sensitivity(case, call, live, self.input_noise)
            report["input_sensitive"] = sensitive
        record.self_check.teeth = not problems
        record.self_check.selfcheck = report
        messages = []
        if problems:
            record.self_check.teeth_problem = "; ".join(problems)
            messages.append(f"Self-check: parity check {record.check!r} has no teeth: " + "; ".join(problems) + ".")
        if sensitive is False:
            if call.module is not None:
                record.vacuity.vacuous = (f"its reference output does not change when its floating inputs move by "
                                          f"{self.input_noise:g} of their RMS")
                messages.append(f"Self-check: parity check {record.check!r} is vacuous: "
                                f"{record.vacuity.vacuous} (the module ignores its data).")
            else:
                report["note"] = "the output does not depend on the input values (a fixed table or mask)"
        if not messages:
            return None
        if call.vacuous_ok:
            record.vacuity.vacuous_ok = call.vacuous_ok
            return None
        return "\n".join(messages) + " Allow it with vacuous_ok='<reason>' if that is intended."


def teeth_summary(rows: list[Mapping[str, Any]]) -> tuple[int, int, list[dict[str, Any]]]:
    """``(checks with teeth, checks measured, rows of those without)`` over report rows.

    One verdict per (test_id, check, recipe): the first row carrying a ``teeth`` value. Rows without
    one (self-check off, a check that errored or was recorded) are not counted.
    """
    seen: dict[tuple, Mapping[str, Any]] = {}
    for row in rows:
        teeth = row.get("teeth")
        if teeth is None or (isinstance(teeth, float) and math.isnan(teeth)):
            continue
        seen.setdefault((row.get("test_id"), row.get("check"), row.get("recipe")), row)
    without = [dict(row) for row in seen.values() if not bool(row.get("teeth"))]
    return len(seen) - len(without), len(seen), without

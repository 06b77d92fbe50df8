"""Damped weight faults on models of one's own: which fp32 verdict catches a 1e-4 weight fault
everywhere without failing a legitimate variant?

A weight scaled by (1 + 1e-4) on the target side is a real port fault, but many models damp it: a
BatchNorm after the scaled conv normalizes the scale away in training mode (only that conv's
gradient, its BatchNorm's running statistics and the parameters after the step move), an LSTM's
gates squash it. The fp32 allclose tolerance (rtol = atol = 1e-5) then passes leaves whose values
are far below atol. This script measures, on small configurations of common models, every fp32
verdict on the same target outputs:

* models (``CASES``): torchvision ``resnet18`` in eval and one training step (AdamW, and SGD); ``nn.LSTM`` and
  ``nn.GRU`` in eval (2 layers) and an LSTM training step; Hugging Face ``BertModel`` and
  ``GPT2Model`` from small configs in eval with a padding mask and a ``GPT2LMHeadModel`` training
  step (dropout 0.1); ``nn.TransformerEncoder`` in eval with a ``src_key_padding_mask`` (its fast
  path: nested tensors); an MLP with dropout checked in training mode;
* target scenarios (``SCENARIOS``): legitimate variants — another intra-op thread count, PyTorch's
  transformer slow path (``torch.backends.mha.set_fastpath_enabled(False)``), another CPU kernel
  path (``ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2`` in a child process, as
  ``calibration.CPU_KERNEL_PATH_ENV``) and, when ``NPU_PARITY_OTHER_PYTHON`` names the python of
  another torch release, that release in a child process — and faults: each of a case's
  ``faults`` weights × (1 + 1e-4), the first also × (1 + 1e-3) (a conv before a BatchNorm in
  resnet18, input and recurrent weights, FFN, query and embedding weights);
* verdicts (``POLICIES``): the default — allclose plus the layer check (``layers``: every weighted
  layer's sampled output within rel-L2 1e-5, or within 10x its input's) — and the layer check at
  1e-6; outputs only: allclose at the current default and tighter, ``torch.testing``'s defaults,
  allclose plus a per-leaf relative-L2 limit, the golden verdict (fp64 CPU golden) and the golden
  floor with the default and a tighter floor. Training steps' parameters after the step are judged
  against the optimizer replay from each target's gradients, as the runner judges them.

Every check runs through the plugin's own ``ParitySession``/``ParityCase`` (placement, shared
random stream, optimizer replay of train steps); the target and reference leaves (and layer
records) are captured with a check hook and the golden with the session's memo, then judged by each
verdict with ``compare.compare`` and ``golden.judge_golden``. Children get the parent's weights and
inputs through a safetensors file (no pickle) and send their leaves back the same way.

Usage::

    python benchmarks/damped_faults.py                      # ≈ 1 min on 2 cores
    NPU_PARITY_OTHER_PYTHON=/path/to/other/venv/bin/python python benchmarks/damped_faults.py
    python benchmarks/damped_faults.py --cases lstm_eval,gru_eval --no-child

Writes ``benchmarks/results/damped_faults.json`` (every case, scenario, metric and verdict) and
``damped_faults.md`` (the tables). Exit status 0 when the run finished, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pytest_npu_parity import npu  # noqa: E402  (before torch: a torch_npu without CANN must not break it)

npu.prepare_torch()

import torch  # noqa: E402
import warnings  # noqa: E402

# nn.TransformerEncoder's fast path warns that nested tensors are a prototype, on every call.
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")

from calibration import CPU_KERNEL_PATH_ENV, OTHER_PYTHON_ENV  # noqa: E402  (benchmarks/calibration.py, beside this file)
from pytest_npu_parity.compare import ParityError, compare  # noqa: E402
from pytest_npu_parity.golden import GoldenPolicy, default_golden_for_recipe, judge_golden  # noqa: E402
from pytest_npu_parity.layers import LayerPolicy, judge_layers, split_layers  # noqa: E402
from pytest_npu_parity.policy import Tolerance  # noqa: E402
from pytest_npu_parity.runner import ParityCase, ParitySession  # noqa: E402

SEED = 0


# --------------------------------------------------------------------------------------------
# models


@dataclass
class Built:
    """One model with its inputs: ``module(**inputs)``; ``extra`` holds tensors the loss needs."""

    module: torch.nn.Module
    inputs: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Case:
    """A check (``kind`` ``check``: ``parity.check``; ``train_step``: ``parity.train_step``)."""

    name: str
    kind: str
    build: Callable[[], Built]
    faults: tuple[str, ...]  # parameters scaled one at a time by (1 + 1e-4); the first also by (1 + 1e-3)
    loss: Callable[[Any, dict], torch.Tensor] | None = None
    note: str = ""
    coarse: bool = True  # also the first fault weight x (1 + 1e-3) (off where each run costs minutes)
    optimizer: Callable[[list], Any] | None = None  # train steps: None is the runner's AdamW


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _resnet18(train: bool) -> Built:
    import torchvision

    torch.manual_seed(SEED)
    model = torchvision.models.resnet18(num_classes=10)
    model.train(train)
    batch = 4 if train else 2
    return Built(model, {"x": torch.randn(batch, 3, 32, 32, generator=_gen(1))},
                 {"labels": torch.arange(batch) % 10})


def _rnn(cls: type, train: bool = False) -> Built:
    torch.manual_seed(SEED)
    model = cls(32, 64, num_layers=2, batch_first=True)
    model.train(train)
    return Built(model, {"input": torch.randn(4, 24, 32, generator=_gen(2))})


def _padding_mask(batch: int, length: int) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - 5:] = 0  # the second sequence is padded
    return mask


def _bert() -> Built:
    from transformers import BertConfig, BertModel

    torch.manual_seed(SEED)
    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    model = BertModel(config).eval()
    return Built(model, {"input_ids": torch.randint(0, 1000, (2, 16), generator=_gen(3)),
                         "attention_mask": _padding_mask(2, 16)})


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False)


def _gpt2() -> Built:
    from transformers import GPT2Model

    torch.manual_seed(SEED)
    model = GPT2Model(_gpt2_config()).eval()
    return Built(model, {"input_ids": torch.randint(0, 1000, (2, 16), generator=_gen(4)),
                         "attention_mask": _padding_mask(2, 16)})


def _gpt2_lm_train() -> Built:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(_gpt2_config()).train()  # dropout 0.1 (resid, embd, attn)
    ids = torch.randint(0, 1000, (2, 16), generator=_gen(5))
    return Built(model, {"input_ids": ids, "labels": ids})


class MaskedEncoder(torch.nn.Module):
    """``nn.TransformerEncoder`` with a padding mask, its padded positions zeroed: PyTorch's fast
    path (eval, no grad: nested tensors) returns 0 there and its slow path whatever attention over
    the valid keys gives, so only the valid positions are a parity question (measured: slow vs
    fast path differ by max-abs 3.3 at the padded positions, ~1e-7 elsewhere)."""

    def __init__(self, encoder: torch.nn.TransformerEncoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, src: torch.Tensor, src_key_padding_mask: torch.Tensor) -> torch.Tensor:
        out = self.encoder(src, src_key_padding_mask=src_key_padding_mask)
        return out.masked_fill(src_key_padding_mask.unsqueeze(-1), 0.0)


def _encoder() -> Built:
    torch.manual_seed(SEED)
    layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, batch_first=True)
    model = MaskedEncoder(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)).eval()
    mask = torch.zeros(3, 12, dtype=torch.bool)
    mask[1, 8:] = True
    mask[2, 4:] = True
    return Built(model, {"src": torch.randn(3, 12, 64, generator=_gen(6)), "src_key_padding_mask": mask})


def _mlp_dropout() -> Built:
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(256, 64)).train()
    return Built(model, {"input": torch.randn(8, 64, generator=_gen(7))})


def _ce(out: Any, extra: dict) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, extra["labels"])


def _sq(out: Any, extra: dict) -> torch.Tensor:
    return out[0].square().mean()


CASES: list[Case] = [
    Case("resnet18_eval", "check", lambda: _resnet18(False),
         ("layer2.0.conv1.weight", "conv1.weight", "fc.weight"),
         note="torchvision resnet18 (num_classes 10), eval, 2x3x32x32"),
    Case("resnet18_train_step", "train_step", lambda: _resnet18(True), ("layer2.0.conv1.weight",),
         loss=_ce, note="one AdamW step, cross-entropy, batch 4x3x32x32; the fault is a conv before a BatchNorm",
         coarse=False),
    Case("resnet18_train_step_sgd", "train_step", lambda: _resnet18(True), ("layer2.0.conv1.weight",), loss=_ce,
         note="the same step with SGD(lr=0.01): an update linear in the gradient", coarse=False,
         optimizer=lambda params: torch.optim.SGD(params, lr=0.01)),
    Case("lstm_eval", "check", lambda: _rnn(torch.nn.LSTM), ("weight_ih_l0", "weight_hh_l0", "weight_ih_l1"),
         note="nn.LSTM(32, 64, 2 layers), 4x24"),
    Case("gru_eval", "check", lambda: _rnn(torch.nn.GRU), ("weight_ih_l0", "weight_hh_l0", "weight_ih_l1"),
         note="nn.GRU(32, 64, 2 layers), 4x24"),
    Case("lstm_train_step", "train_step", lambda: _rnn(torch.nn.LSTM, train=True), ("weight_ih_l0", "weight_hh_l1"),
         loss=_sq, note="one AdamW step, loss mean(output^2)"),
    Case("bert_eval", "check", _bert, ("encoder.layer.0.intermediate.dense.weight",
                                       "encoder.layer.0.attention.self.query.weight", "embeddings.word_embeddings.weight"),
         note="transformers BertModel, hidden 64, 2 layers, 4 heads, padding mask"),
    Case("gpt2_eval", "check", _gpt2, ("h.0.mlp.c_fc.weight", "h.1.attn.c_attn.weight", "wte.weight"),
         note="transformers GPT2Model, n_embd 64, 2 layers, 4 heads, padding mask"),
    Case("gpt2_lm_train_step", "train_step", _gpt2_lm_train, ("transformer.h.0.mlp.c_fc.weight",
                                                              "transformer.h.1.attn.c_attn.weight"),
         note="GPT2LMHeadModel, one AdamW step on its LM loss, dropout 0.1"),
    Case("transformer_encoder_eval", "check", _encoder,
         ("encoder.layers.0.linear1.weight", "encoder.layers.1.self_attn.in_proj_weight"),
         note="nn.TransformerEncoder(d 64, 4 heads, 2 layers), src_key_padding_mask (fast path: nested tensors), "
              "padded positions zeroed"),
    Case("mlp_dropout_train", "check", _mlp_dropout, ("0.weight", "3.weight"),
         note="Linear-GELU-Dropout(0.1)-Linear checked in training mode"),
]
BY_NAME = {c.name: c for c in CASES}


# --------------------------------------------------------------------------------------------
# scenarios


_FAULT_ATTR = "_damped_fault"


@contextlib.contextmanager
def scaled_weight(factor: float) -> Iterator[None]:
    """Scale the fault parameter of every tagged root module (``_FAULT_ATTR`` = parameter name) by
    ``factor`` before its first forward inside the block, and restore it at exit. The tag travels
    with the deep copies a train step makes, so the copy the target side trains is the one scaled."""
    done: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}

    def pre_hook(module: torch.nn.Module, _args: Any) -> None:
        name = getattr(module, _FAULT_ATTR, None)
        if name is None or id(module) in done:
            return
        param = module.get_parameter(name)
        done[id(module)] = (param, param.detach().clone())
        with torch.no_grad():
            param.mul_(factor)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()
        with torch.no_grad():
            for param, saved in done.values():
                # rebind, not copy_: a train step's param.* leaf on the CPU shares the stepped
                # parameter's storage, and copying the saved weight into it would undo the step
                param.data = saved


@contextlib.contextmanager
def other_thread_count() -> Iterator[None]:
    """The target with another intra-op thread count (1, or 2 when the reference used 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def mha_slow_path() -> Iterator[None]:
    """PyTorch's transformer fast path off on the target side."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # "variant" or "fault"
    description: str
    apply: Callable[[], Any] | None = None  # a context manager factory (in-process)
    env: tuple[tuple[str, str], ...] = ()  # a child process computes the target
    python: str | None = None  # that child's interpreter (another torch release)
    factor: float | None = None


def variants(other_python: str | None, child: bool = True) -> list[Scenario]:
    """The legitimate variants (every case)."""
    found = [
        Scenario("threads", "variant", "another intra-op thread count (1 vs the reference's)", other_thread_count),
        Scenario("mha_slow_path", "variant", "torch.backends.mha fast path off", mha_slow_path),
    ]
    if child:
        found.append(Scenario("cpu_kernel_path", "variant",
                              "child process with " + " ".join(f"{k}={v}" for k, v in CPU_KERNEL_PATH_ENV),
                              env=CPU_KERNEL_PATH_ENV))
        if other_python:
            found.append(Scenario("torch_release", "variant", f"child process with {other_python}",
                                  python=other_python))
    return found


def faults(case: Case) -> list[tuple[str, Scenario]]:
    """``(parameter, scenario)`` of each fault of ``case``: every fault weight x (1 + 1e-4), the
    first also x (1 + 1e-3) (unless ``case.coarse`` is off)."""
    found = []
    for i, param in enumerate(case.faults):
        for factor, label in ((1 + 1e-4, "1e-4"), (1 + 1e-3, "1e-3"))[: 2 if i == 0 and case.coarse else 1]:
            found.append((param, Scenario(f"{param} x(1+{label})", "fault", f"{param} x (1 + {label})",
                                          lambda f=factor: scaled_weight(f), factor=factor)))
    return found


# --------------------------------------------------------------------------------------------
# verdicts


@dataclass(frozen=True)
class Verdict:
    """One fp32 verdict: allclose ``tol`` (plus a per-leaf rel-L2 limit), or golden."""

    name: str
    tol: Tolerance
    golden: GoldenPolicy | None = None
    rel_l2: float | None = None
    note: str = ""
    layers: float | None = None  # plus the layer check at this rel-L2 limit (module layers)


def _golden_policy(floor: bool) -> GoldenPolicy:
    return default_golden_for_recipe("fp32").replace(allclose_floor=floor)


POLICIES = [
    Verdict("allclose 1e-5/1e-5 + layers 1e-5", Tolerance(rtol=1e-5, atol=1e-5), layers=1e-5,
            note="fp32 default: outputs and every weighted layer"),
    Verdict("allclose 1e-5/1e-5 + layers 1e-6", Tolerance(rtol=1e-5, atol=1e-5), layers=1e-6),
    Verdict("allclose 1e-5/1e-5", Tolerance(rtol=1e-5, atol=1e-5), note="outputs only"),
    Verdict("allclose 1e-5/1e-6", Tolerance(rtol=1e-5, atol=1e-6)),
    Verdict("allclose 1e-5/1e-7", Tolerance(rtol=1e-5, atol=1e-7)),
    Verdict("allclose 1e-6/1e-8", Tolerance(rtol=1e-6, atol=1e-8)),
    Verdict("assert_close 1.3e-6/1e-5", Tolerance(rtol=1.3e-6, atol=1e-5), note="torch.testing defaults"),
    Verdict("allclose 1e-5/1e-5 + rel-L2 1e-6", Tolerance(rtol=1e-5, atol=1e-5), rel_l2=1e-6),
    Verdict("allclose 1e-5/1e-5 + rel-L2 1e-5", Tolerance(rtol=1e-5, atol=1e-5), rel_l2=1e-5),
    Verdict("golden", Tolerance(rtol=1e-5, atol=1e-5), golden=_golden_policy(False), note="limits 2/10/2/2"),
    Verdict("golden floor 1e-5/1e-5", Tolerance(rtol=1e-5, atol=1e-5), golden=_golden_policy(True),
            note="fp32 training default"),
    Verdict("golden floor 1e-5/1e-7", Tolerance(rtol=1e-5, atol=1e-7), golden=_golden_policy(True)),
]


def judge_all(actual: dict, expected: dict, golden: dict | None,
              layers: tuple[dict, dict] | None = None) -> tuple[dict[str, str], dict[str, dict]]:
    """Every verdict of ``POLICIES`` on one target: ``({verdict: "pass" | "fail" | "n/a"}, details)``.

    The golden ratio test is computed once (``judge_golden`` without the floor: it is what costs,
    ≈ 1 µs per element and side here) and each golden floor takes its leaves within its own allclose
    tolerance as passing, exactly as ``GoldenLeafResult.passed`` does with ``allclose_floor``."""
    allclose = {}
    for tol in {v.tol for v in POLICIES}:
        result = compare(actual, expected, tol, name="case")
        allclose[tol] = {leaf.path: leaf for leaf in result.leaves}
    ratio_test = None
    if golden is not None:
        ratio_test = judge_golden(actual, expected, golden, _golden_policy(False), tolerance=Tolerance(rtol=1e-5, atol=1e-5),
                                  name="case", work_dtype=torch.float32)
    verdicts: dict[str, str] = {}
    details: dict[str, dict] = {}
    for verdict in POLICIES:
        leaves = allclose[verdict.tol]
        if verdict.golden is None:
            failing = [p for p, leaf in leaves.items() if not leaf.passed]
            if verdict.rel_l2 is not None:
                failing += [p for p, leaf in leaves.items() if p not in failing
                            and (leaf.rel_l2 > verdict.rel_l2 or math.isnan(leaf.rel_l2))]
        elif ratio_test is None:
            verdicts[verdict.name] = "n/a"
            continue
        else:
            floor = verdict.golden.allclose_floor
            failing = [leaf.path for leaf in ratio_test.leaves
                       if not leaf.passed and not (floor and leaves[leaf.path].passed and leaf.problem is None
                                                   and leaf.nonfinite_mismatched == 0)]
        if verdict.layers is not None and layers and layers[1]:  # no weighted submodules: outputs only
            judged = judge_layers(layers[0], layers[1], LayerPolicy(verdict.layers))
            failing += [f"layer:{k}" for k in judged.failing]
        verdicts[verdict.name] = "fail" if failing else "pass"
        details[verdict.name] = {"failing": failing[:4], "failing_count": len(failing)}
    return verdicts, details


def layer_worst(layers: tuple[dict, dict] | None) -> dict[str, Any]:
    """The judged layer with the largest relative L2 error of target vs reference, and how many were judged."""
    if not layers or not layers[1]:
        return {}
    judged = judge_layers(layers[0], layers[1], LayerPolicy(1e-5))
    worst = judged.worst()
    return {"layers_judged": judged.judged, "layer_worst": worst[0] if worst else None,
            "layer_worst_rel_l2": worst[1] if worst else None, "layers_unmatched": len(judged.unmatched)}


# --------------------------------------------------------------------------------------------
# running


@dataclass
class Captured:
    actual: dict | None = None
    expected: dict | None = None
    golden: dict | None = None
    error: str | None = None
    layers: tuple[dict, dict] | None = None  # (target's, reference's) layer records
    #: a train step judged by optimizer replay: ``(leaves) -> param.* leaves`` (``CheckCall.replay``)
    replay: Callable[[dict], dict] | None = None


def run_case(session: ParitySession, case: Case, built: Built, patches: Callable | None,
             golden: bool = False) -> Captured:
    """One check of ``case`` under the plugin's machinery with ``patches`` on the target side;
    returns the captured leaves. With ``golden`` the check runs under the golden policy, so that the
    session computes (and memoizes) the golden, which is captured too; otherwise it is judged by
    allclose (the verdicts are taken afterwards by ``judge_all``)."""
    captured = Captured()

    def hook(_case, record, call, actual, expected):
        captured.actual, captured.expected = actual, expected
        captured.layers = record.layer_records
        if "(optimizer replay)" in (record.extra.get("policy_note") or ""):
            captured.replay = call.replay
        return None

    original = session.golden

    def golden(key, owner, run):
        captured.golden = original(key, owner, run)
        return captured.golden

    session.check_hooks[:] = [hook]
    session.golden = golden  # type: ignore[method-assign]
    parity = ParityCase(session, f"damped::{case.name}", "fp32", patches=patches)
    policy = "golden" if golden else "allclose"
    try:
        if case.kind == "check":
            parity.check(case.name, built.module, policy=policy, **built.inputs)
        else:
            loss = (lambda out: case.loss(out, built.extra)) if case.loss is not None else None
            parity.train_step(case.name, built.module, built.inputs, loss_fn=loss, policy=policy,
                              optimizer=case.optimizer)
    except ParityError:
        pass
    except Exception as exc:  # noqa: BLE001 - one case must not stop the benchmark
        captured.error = f"{type(exc).__name__}: {exc}"
    finally:
        session.golden = original  # type: ignore[method-assign]
    if captured.golden is not None and captured.expected is not None:
        captured.golden = {k: v for k, v in captured.golden.items() if k in captured.expected}
    return captured


def _patch(scenario_apply: Callable[[], Any] | None) -> Callable | None:
    if scenario_apply is None:
        return None
    return lambda device: scenario_apply()


def _equal(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if (x is None) != (y is None):
            return False
        if x is not None and not (x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)):
            return False
    return True


def _worst(actual: dict, expected: dict) -> dict[str, Any]:
    """The leaf with the largest rel-L2 and the largest max-abs of ``actual`` vs ``expected``
    (floating leaves compared in float64, so a float64 golden can be the expected side)."""
    def wide(leaves: dict) -> dict:
        return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in leaves.items()}
    result = compare(wide(actual), wide(expected), Tolerance(rtol=1e-5, atol=1e-5))
    leaves = [leaf for leaf in result.leaves if leaf.problem is None]
    if not leaves:
        return {}
    by_rel = max(leaves, key=lambda leaf: leaf.rel_l2 if not math.isnan(leaf.rel_l2) else math.inf)
    by_abs = max(leaves, key=lambda leaf: leaf.max_abs)
    return {"rel_l2": by_rel.rel_l2, "rel_l2_leaf": by_rel.path, "max_abs": by_abs.max_abs,
            "max_abs_leaf": by_abs.path, "leaves": len(leaves),
            "leaves_changed": sum(1 for leaf in leaves if leaf.max_abs > 0)}


# --------------------------------------------------------------------------------------------
# children: the same cases on another CPU kernel path or torch release


def _save_inputs(path: str, built: dict[str, Built]) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, b in built.items():
        for k, v in b.module.state_dict().items():
            tensors[f"{name}|state|{k}"] = v.detach().clone().contiguous()
        for k, v in b.inputs.items():
            tensors[f"{name}|input|{k}"] = v.clone().contiguous()
        for k, v in b.extra.items():
            tensors[f"{name}|extra|{k}"] = v.clone().contiguous()
    save_file(tensors, path)


def _load_built(path: str, names: list[str]) -> dict[str, Built]:
    from safetensors import safe_open

    with safe_open(path, framework="pt") as fh:
        keys = list(fh.keys())
        tensors = {k: fh.get_tensor(k) for k in keys}
    built = {}
    for name in names:
        b = BY_NAME[name].build()
        state = {k.split("|", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{name}|state|")}
        b.module.load_state_dict(state)
        b.inputs = {k.split("|", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{name}|input|")}
        b.extra = {k.split("|", 2)[2]: v for k, v in tensors.items() if k.startswith(f"{name}|extra|")}
        built[name] = b
    return built


def child_main(path_in: str, path_out: str, names: list[str]) -> int:
    """Compute every case's target leaves here (another kernel path / torch) and save them."""
    from safetensors.torch import save_file

    from pytest_npu_parity.baselines import BaselineStore

    built = _load_built(path_in, names)
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="damped-faults-child-") as tmp:
        # Record mode runs each computation once, on this process's kernels (a target machine's
        # run); the recording is taken from the case before any file would be written.
        session = ParitySession(torch.device("cpu"), update_baselines=True, store=BaselineStore(tmp, "child"),
                                seed=SEED)
        for name in names:
            case, b = BY_NAME[name], built[name]
            parity = ParityCase(session, f"damped::{name}", "fp32")
            try:
                if case.kind == "check":
                    parity.check(name, b.module, **b.inputs)
                else:
                    loss = (lambda out, c=case, e=b.extra: c.loss(out, e)) if case.loss is not None else None
                    parity.train_step(name, b.module, b.inputs, loss_fn=loss, optimizer=case.optimizer)
            except Exception as exc:  # noqa: BLE001 - reported per case
                meta[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            recorded = parity._pending[name]  # the CheckBaseline a record run would write
            leaves = dict(recorded.tensors, **{p: None for p in recorded.none_leaves})
            meta[name] = {"leaves": {k: v is not None for k, v in leaves.items()}}
            for k, v in leaves.items():
                if v is not None:
                    tensors[f"{name}|{k}"] = v.contiguous()
    save_file(tensors, path_out, metadata={"cases": json.dumps(meta), "torch": torch.__version__})
    return 0


def child_targets(scenario: Scenario, path_in: str, names: list[str]) -> dict[str, Any]:
    """``{case: leaves or error text}`` computed by a child process with ``scenario``'s env/python."""
    from safetensors import safe_open

    env = {**os.environ, **dict(scenario.env), "PYTHONPATH": str(ROOT)}
    python = scenario.python or sys.executable
    with tempfile.TemporaryDirectory(prefix="damped-faults-") as tmp:
        out = os.path.join(tmp, "targets.safetensors")
        proc = subprocess.run([python, __file__, "--child", path_in, out, "--cases", ",".join(names)], env=env,
                              capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            return {name: f"child failed ({proc.returncode}): {tail}" for name in names}
        found: dict[str, Any] = {}
        with safe_open(out, framework="pt") as fh:
            meta = json.loads(fh.metadata()["cases"])
            child_torch = fh.metadata().get("torch")
            for name, info in meta.items():
                if "error" in info:
                    found[name] = info["error"]
                else:
                    found[name] = {k: fh.get_tensor(f"{name}|{k}") if present else None
                                   for k, present in info["leaves"].items()}
        found["__torch__"] = child_torch
    return found


# --------------------------------------------------------------------------------------------
# the benchmark


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--no-child", action="store_true", help="skip the child-process variants")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="directory for the results")
    parser.add_argument("--child", nargs=2, metavar=("IN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [n for n in args.cases.split(",") if n] or [c.name for c in CASES]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        print(f"damped_faults: unknown case(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    if args.child:
        return child_main(args.child[0], args.child[1], names)

    start = time.perf_counter()
    other = os.environ.get(OTHER_PYTHON_ENV) or None
    chosen = variants(other, child=not args.no_child)
    built = {name: BY_NAME[name].build() for name in names}
    children: dict[str, dict[str, Any]] = {}
    child_torch: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="damped-faults-") as tmp:
        path_in = os.path.join(tmp, "cases.safetensors")
        _save_inputs(path_in, built)
        for scenario in chosen:
            if scenario.env or scenario.python:
                t0 = time.perf_counter()
                children[scenario.name] = child_targets(scenario, path_in, names)
                child_torch[scenario.name] = children[scenario.name].pop("__torch__", None)
                print(f"child {scenario.name}: {time.perf_counter() - t0:.1f} s (torch {child_torch[scenario.name]})",
                      flush=True)

    session = ParitySession(torch.device("cpu"), reference="cpu", seed=SEED)
    rows: list[dict[str, Any]] = []
    references: dict[str, dict[str, Any]] = {}
    for name in names:
        case = BY_NAME[name]
        t0 = time.perf_counter()
        clean = run_case(session, case, built[name], None, golden=True)  # reference and golden, memoized
        if clean.expected is None:
            rows.append({"case": name, "scenario": "-", "status": "error", "message": clean.error})
            print(f"{name}: error {clean.error}", flush=True)
            continue
        ref_err = _worst(clean.expected, clean.golden) if clean.golden is not None else {}
        references[name] = {"reference_vs_golden": ref_err, "clean_equal": _equal(clean.actual, clean.expected),
                            "golden": clean.golden is not None, "optimizer_replay": clean.replay is not None,
                            "seconds": time.perf_counter() - t0,
                            "leaves": len(clean.expected), "note": case.note, "faults": list(case.faults),
                            "kind": case.kind}
        for param, scenario in [(None, v) for v in chosen] + faults(case):
            setattr(built[name].module, _FAULT_ATTR, param)  # which weight scaled_weight scales
            row: dict[str, Any] = {"case": name, "kind": case.kind, "scenario": scenario.name,
                                   "scenario_kind": scenario.kind, "factor": scenario.factor}
            t1 = time.perf_counter()
            if scenario.name in children:
                got = children[scenario.name].get(name)
                if isinstance(got, str) or got is None:
                    rows.append(dict(row, status="error", message=got))
                    continue
                actual, child_layers = split_layers(got)
                layers = (child_layers, clean.layers[1] if clean.layers else {})
            else:
                captured = run_case(session, case, built[name], _patch(scenario.apply))
                if captured.error or captured.actual is None:
                    rows.append(dict(row, status="error", message=captured.error))
                    continue
                actual, layers = captured.actual, captured.layers
            if set(actual) != set(clean.expected):  # a train step drops the same rounding-noise params
                actual = {k: v for k, v in actual.items() if k in clean.expected}
            # A train step judged by optimizer replay (as the runner judges it): param.* expected
            # after the CPU optimizer's step from this target's gradients.
            expected = clean.expected if clean.replay is None else {**clean.expected, **clean.replay(actual)}
            if _equal(actual, expected) and (not layers or _equal(layers[0], layers[1])):
                rows.append(dict(row, status="no effect"))
                continue
            verdicts, details = judge_all(actual, expected, clean.golden, layers)
            row.update(status="judged", effect=dict(_worst(actual, expected), **layer_worst(layers)),
                       verdicts=verdicts, details=details)
            row["seconds"] = time.perf_counter() - t1
            print(f"  {name} {scenario.name}: {row['seconds']:.1f} s", flush=True)
            rows.append(row)
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    report = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.processor()
              or platform.machine(), "threads": torch.get_num_threads(), "child_torch": child_torch,
              "seconds": round(time.perf_counter() - start, 1), "cases": references, "rows": rows,
              "scenarios": [{"name": s.name, "kind": s.kind, "description": s.description} for s in chosen]
              + [{"name": "<weight> x(1+1e-4)", "kind": "fault", "description": "each fault weight of the case"},
                 {"name": "<weight> x(1+1e-3)", "kind": "fault", "description": "the case's first fault weight"}],
              "policies": [{"name": p.name, "note": p.note} for p in POLICIES]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "damped_faults.json").write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
    (out / "damped_faults.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, tuple):
        return list(obj)
    return str(obj)


def _g(x: Any) -> str:
    return "-" if x is None else f"{x:.2g}" if isinstance(x, float) else str(x)


def markdown(report: dict) -> str:
    """The tables: verdict rates, then per case the effect of every scenario and each verdict."""
    rows = [r for r in report["rows"] if r.get("status") == "judged"]
    lines = [f"# Damped faults (torch {report['torch']}, {report['threads']} threads, {report['seconds']} s)", ""]
    lines += ["| verdict | false failures (variants) | misses, faults 1e-4 | misses, faults 1e-3 |",
              "| --- | --- | --- | --- |"]
    for policy in report["policies"]:
        name = policy["name"]
        var_rows = [r for r in rows if r["scenario_kind"] == "variant"]
        f4 = [r for r in rows if r["scenario_kind"] == "fault" and r["factor"] < 1 + 5e-4]
        f3 = [r for r in rows if r["scenario_kind"] == "fault" and r["factor"] > 1 + 5e-4]
        ff = [f"{r['case']} {r['scenario']}" for r in var_rows if r["verdicts"][name] == "fail"]
        m4 = [f"{r['case']} {r['scenario'].split()[0]}" for r in f4 if r["verdicts"][name] == "pass"]
        m3 = [f"{r['case']} {r['scenario'].split()[0]}" for r in f3 if r["verdicts"][name] == "pass"]
        label = name + (f" ({policy['note']})" if policy["note"] else "")
        lines.append(f"| {label} | {len(ff)}/{len(var_rows)}" + (f" ({', '.join(ff)})" if ff else "")
                     + f" | {len(m4)}/{len(f4)}"
                     + (f" ({', '.join(m4)})" if m4 else "") + f" | {len(m3)}/{len(f3)}"
                     + (f" ({', '.join(m3)})" if m3 else "") + " |")
    lines += ["", "Per case: worst leaf of target vs reference (rel-L2 / max-abs) and which verdicts fail "
              "(F = fail, . = pass); variants should pass, faults fail.", ""]
    short = [p["name"] for p in report["policies"]]
    lines.append("| case | scenario | rel-L2 (leaf) | max-abs | worst layer rel-L2 (layer, of judged) | "
                 + " | ".join(short) + " |")
    lines.append("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in short) + " |")
    for r in report["rows"]:
        if r.get("status") != "judged":
            lines.append(f"| {r['case']} | {r['scenario']} | {r.get('status')} {r.get('message') or ''} | | | "
                         + " | ".join("" for _ in short) + " |")
            continue
        e = r["effect"]
        marks = ["F" if r["verdicts"][n] == "fail" else "." if r["verdicts"][n] == "pass" else "n/a" for n in short]
        lines.append(f"| {r['case']} | {r['scenario']} | {_g(e.get('rel_l2'))} ({e.get('rel_l2_leaf')}) | "
                     f"{_g(e.get('max_abs'))} | {_g(e.get('layer_worst_rel_l2'))} ({e.get('layer_worst')}, "
                     f"{e.get('layers_judged')}) | " + " | ".join(marks) + " |")
    lines += ["", "Reference vs fp64 golden (the reference's own rounding error), worst leaf:", ""]
    for name, info in report["cases"].items():
        e = info["reference_vs_golden"]
        lines.append(f"- {name} ({info['kind']}, {info['leaves']} leaves; faults {', '.join(info['faults'])}): rel-L2 "
                     f"{_g(e.get('rel_l2'))} ({e.get('rel_l2_leaf')}), max-abs {_g(e.get('max_abs'))}; {info['note']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

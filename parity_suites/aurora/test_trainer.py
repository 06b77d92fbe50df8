"""The guide's smoke run — Hugging Face Trainer, ``--max_steps 5`` (seed §8.2) — on the tiny seeded Aurora.

``hf_trainer.TrainerLoop`` trains a fresh copy of the model for 5 steps of 4 real CO2 windows each (20 windows,
in order) through ``transformers.Trainer`` on each side: the target on its device under the NPU patch set, the
reference a stored baseline or a live CPU run. Compared: the loss of every step, every trainable gradient of the
last step, every parameter after it and every BatchNorm buffer. Dropout, frequency masking and flow-matching
noise are active and drawn from the shared random stream on both sides.

``test_trainer_steps_deepspeed`` runs the same loop under DeepSpeed with ``deepspeed_zero2.json`` (the guide's
rules: bf16 on, fp16 off, no ``communication_backend``, no ``aio``; ZeRO stage 2), fp32 recipe only (see
``hf_trainer``: DeepSpeed's bf16 casts the weights, which upstream Aurora's rfft cannot take, and transformers
refuses bf16 without an accelerator unless DeepSpeed is bypassed). It is skipped where DeepSpeed is not installed.
"""
from pathlib import Path

import pytest

from pytest_npu_parity.runtime import hf_trainer
from pytest_npu_parity.aurora.checks import HORIZON, TRAIN_STEP_FAULT
from pytest_npu_parity.aurora.inputs import make_batch

STEPS = hf_trainer.DEFAULT_STEPS
BATCH = 4
DEEPSPEED_CONFIG = Path(__file__).with_name("deepspeed_zero2.json")


def trainer_inputs() -> dict:
    """``STEPS * BATCH`` real CO2 windows (standardized, with text and 96-week labels) as one batch dict."""
    return make_batch(batch=STEPS * BATCH).normalized().forward_kwargs(HORIZON, train=True)


#: bf16 allclose floor of the Trainer check (the golden ratio test still judges leaves beyond it). Measured
#: against the baseline recorded with torch 2.14.1: on torch 2.5.1 five bf16 Trainer steps move the last decoder
#: layer's BatchNorm running_mean by max-abs 1.35e-3 (3 of 32 elements beyond 1e-3, cosine 0.99998; err/tol
#: 1.32 at the default 1e-3, golden rmse ratio 2.1): the batch statistics of five bf16 forwards accumulate
#: there. fp32 keeps the default (1e-5 floor), where the weight-fault proof lives.
BF16_FLOOR = dict(rtol=2e-3, atol=2e-3, reason="5 bf16 Trainer steps, another torch release: BatchNorm "
                                               "running_mean moves by up to 1.35e-3 (measured, 2.5.1 vs 2.14.1)")


#: fp32 allclose tolerance of the DeepSpeed Trainer check, which has no golden (DeepSpeed casts the inputs to fp32)
#: and so no ratio test to tell accumulated rounding from a fault. Measured against the baseline recorded with
#: torch 2.14.1's default CPU kernels: on another CPU kernel path (ATEN_CPU_CAPABILITY=default
#: ONEDNN_MAX_CPU_ISA=AVX2) five AdamW steps move the first decoder layer's BatchNorm running_mean by max-abs
#: 2.1e-5 (err/tol 1.86 at the default 1e-5). A weight fault still fails the check through its layer check (the
#: first forward runs on the recorded weights: a 1e-4 weight scale moves its layer by 1e-4).
FP32_DEEPSPEED = dict(rtol=1e-4, atol=1e-4, reason="5 fp32 AdamW steps through DeepSpeed, no golden: BatchNorm "
                                                   "running_mean moves by up to 2.1e-5 on another CPU kernel path "
                                                   "(measured)")


@pytest.mark.parity(recipes=["fp32", "bf16"])
def test_trainer_steps(parity, aurora_tiny):
    tolerance = BF16_FLOOR if parity.recipe.name == "bf16" else {}
    parity.train_step(f"trainer_{STEPS}_steps", aurora_tiny, trainer_inputs(),
                      loop=hf_trainer.TrainerLoop(steps=STEPS, batch_size=BATCH), group="Trainer smoke run",
                      fault_weight=TRAIN_STEP_FAULT, **tolerance)


@pytest.mark.parity(recipes=["fp32"])
def test_trainer_steps_deepspeed(parity, aurora_tiny):
    why = hf_trainer.deepspeed_unavailable()
    if why:
        pytest.skip(why)
    parity.train_step(f"trainer_deepspeed_zero2_{STEPS}_steps", aurora_tiny, trainer_inputs(),
                      loop=hf_trainer.TrainerLoop(steps=STEPS, batch_size=BATCH, deepspeed_config=DEEPSPEED_CONFIG),
                      group="Trainer smoke run (DeepSpeed ZeRO-2)", fault_weight=TRAIN_STEP_FAULT, **FP32_DEEPSPEED)

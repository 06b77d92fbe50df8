"""One training step as upstream trains (AdamW betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clip 1.0).

Runs on the tiny seeded Aurora (same classes as the full model, small dims) so that the stored
baseline — loss, every trainable gradient, every parameter after the step and every BatchNorm
buffer — stays small enough for git. Dropout, frequency masking and flow-matching noise are active
and identical on both sides.
"""
from pytest_npu_parity.aurora.checks import HORIZON, TRAIN_STEP_FAULT, suite_batch


def test_train_step(parity, aurora_tiny):
    batch = suite_batch()
    parity.train_step("train_step", aurora_tiny, batch.forward_kwargs(HORIZON, train=True),
                      group="training step", fault_weight=TRAIN_STEP_FAULT)

"""Training trajectories as upstream Aurora trains: loss and gradient-norm curves over many steps, then the
trained model's forecasts on held-out windows.

Runs on the tiny seeded Aurora (same classes as the full model, small dims): AdamW lr 1e-4, betas
(0.9, 0.95), eps 1e-8, weight decay 0.1, gradient clipping at 1.0, constant lr (upstream ``runner.py``
``AuroraRunner.train_model``), over 16 batches of 4 real, standardized CO2 windows (context 528,
horizon 96, with text), cycled. Dropout, frequency masking and flow-matching noise are active and drawn
from the same stream on both sides. After the last step each side's trained model forecasts 8 held-out
El Niño windows (16 samples each; MSE, MAE, CRPS). The baseline stores the curves and the per-window
metrics; the verdict is the mean relative loss error with the step where the curves part
(``judge.trajectory``) and the relative difference of each forecast metric (``judge.forecast``).

Under ``--parity-dtypes bf16-weights`` (opt-in, as the recipe is) ``test_trajectory`` trains as upstream does with
``precision='bf16'`` under the guide's DeepSpeed ``"bf16": {"enabled": true}``: bf16 weights and bf16 inputs
(Trainer's cast for DeepSpeed), float32 master weights in the optimizer (``TrajectoryLoop``); the reference side
runs under the patch set's dtype fixes too (``parity_reference_patches`` in conftest.py), since upstream cannot
run bf16 weights on any device. Its baseline is committed (``test_trajectory.bf16-weights.safetensors``).
"""
import pytest

from pytest_npu_parity.aurora.checks import DRILL_DOWN, evaluate_forecasts, forecast_held_out, trajectory_batches
from pytest_npu_parity.runtime.trajectory import TrajectoryLoop

#: The main job's short form: the first 60 steps.
SHORT = TrajectoryLoop(steps=60, evaluate=evaluate_forecasts)
#: The nightly job's long form: 300 steps, the length the default limits were measured over.
LONG = TrajectoryLoop(steps=300, evaluate=evaluate_forecasts)


def _trajectory(parity, model, loop):
    held_out, labels = forecast_held_out()
    parity.trajectory("trajectory", model, trajectory_batches(), loop=loop, held_out=held_out, window_labels=labels,
                      drill_down=DRILL_DOWN, group="training trajectory")


def test_trajectory(parity, aurora_tiny):
    _trajectory(parity, aurora_tiny, SHORT)


@pytest.mark.parity_nightly
def test_trajectory_long(parity, aurora_tiny):
    _trajectory(parity, aurora_tiny, LONG)


"""hf_trainer.TrainerLoop(curves=True): a transformers model trained by Hugging Face Trainer itself, judged by
``parity.trajectory``'s curves (loss, grad norm before Trainer's clipping, lr, per-module grad norms)."""
import contextlib

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from pytest_npu_parity.judge.allclose import ParityError  # noqa: E402
from pytest_npu_parity.runner import ParityCase, ParitySession  # noqa: E402
from pytest_npu_parity.runtime.hf_trainer import TrainerLoop  # noqa: E402

LOOP = TrainerLoop(steps=12, batch_size=4, curves=True, learning_rate=5e-4)


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32))


def batches():
    ids = torch.randint(0, 128, (48, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids[i:i + 8], "labels": ids[i:i + 8]} for i in range(0, 48, 8)]


MODEL = gpt2()


def case(patches=None):
    return ParityCase(ParitySession(torch.device("cpu"), reference="cpu"), "tests/t.py::t", "fp32", patches=patches)


def test_trainer_curves_pass_and_hold_every_curve():
    record = case().trajectory("trainer", MODEL, batches(), loop=LOOP)
    assert record.status == "pass" and record.result.curves[0].steps == 12
    leaves = {r["leaf"] for r in record.rows()}
    assert {"loss", "grad_norm", "layer_grad_norm.transformer.h.0.attn.c_attn"} <= leaves
    # Trainer's default schedule (linear decay, no warmup) is what the lr curve follows
    lrs = LOOP(gpt2().train(), {"batches": batches()}, None)["lr"]
    assert lrs[0] == pytest.approx(5e-4) and lrs[-1] < lrs[0]


def test_another_dropout_on_the_target_parts_the_curves_at_step_0():
    @contextlib.contextmanager
    def dropout_02(device):  # a port whose config carries another dropout probability
        changed = [m for m in MODEL.modules() if isinstance(m, torch.nn.Dropout) and m.p == 0.1]
        for m in changed:
            m.p = 0.2
        try:
            yield
        finally:
            for m in changed:
                m.p = 0.1

    with pytest.raises(ParityError) as failure:
        case(dropout_02).trajectory("trainer", MODEL, batches(), loop=LOOP)
    assert failure.value.result.loss_parted_at == 0


def test_curves_under_deepspeed_are_refused_with_the_fix():
    loop = TrainerLoop(steps=2, curves=True, deepspeed_config={"zero_optimization": {"stage": 0}})
    with pytest.raises(ValueError, match="curves=True needs plain Trainer"):
        loop(gpt2(), {"batches": batches()}, None)

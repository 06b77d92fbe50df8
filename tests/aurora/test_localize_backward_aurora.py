"""The backward table on the tiny seeded Aurora: a gradient cut inside one decoder layer is named.

The target runs the one-step training check (as ``parity_suites/aurora/test_train_step.py`` does, without
clipping so that the gradients keep their scale) with decoder layer 1's feed-forward input detached, as a
port's fallback that computes a piece outside autograd would (every value of the forward is unchanged, the
loss agrees). The check fails on the gradients of the layers before it, and the backward table must name
decoder layer 1 (its grad_output agrees, the gradient it passes on does not), not the first layer that only
inherits the cut. Judged by allclose (the table's policy, docs/how-to/localize-failure.md).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from pytest_npu_parity.aurora import checks, factory, patches
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.diagnose.localize import failure_hook
from pytest_npu_parity.runner import ParityCase, ParitySession

LAYER = "model.dec_layers.1"


def test_a_gradient_cut_in_one_decoder_layer_is_named_by_the_backward_table():
    model = factory.get_model("tiny", seed=0)
    ffn = model.model.dec_layers[1].ffn_layer

    on_target = {"cut": False}
    # on every copy of the model; it cuts only while the target side runs (the patch factory sets the flag)
    ffn.register_forward_pre_hook(lambda module, args: tuple(a.detach() for a in args) if on_target["cut"] else None)

    @contextlib.contextmanager
    def cut_on_the_target(device):
        with patches.patched(device):
            on_target["cut"] = True
            try:
                yield
            finally:
                on_target["cut"] = False

    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[failure_hook],
                            recipe_policies={"fp32": "allclose"})
    case = ParityCase(session, "tests/aurora/test_localize_backward_aurora.py::t", "fp32", patches=cut_on_the_target)
    inputs = checks.suite_batch().forward_kwargs(checks.HORIZON, train=True)
    with pytest.raises(ParityError) as info:
        case.train_step("train_step", model, inputs, max_grad_norm=None)
    message, extra = str(info.value), case.records[-1].extra
    rows = {row["submodule"]: row for row in extra["localization_backward"]}
    first = [name for name, row in rows.items() if row["first_divergence"]]
    assert first == [LAYER], message
    assert rows[LAYER]["grad_output_err_ratio"] <= 1 < rows[LAYER]["grad_input_err_ratio"], rows[LAYER]
    assert rows["model.dec_layers.0"]["verdict"] == "inherited", rows["model.dec_layers.0"]
    assert f"the layer whose backward differs is {LAYER}" in message

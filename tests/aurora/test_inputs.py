"""Tests for pytest_npu_parity.aurora.inputs: real CO2 windows, text tokens, submodule inputs."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("aurora")
pytest.importorskip("statsmodels")

from pytest_npu_parity.aurora import inputs  # noqa: E402
from pytest_npu_parity.aurora.factory import build_model  # noqa: E402
from pytest_npu_parity.aurora.inputs import (  # noqa: E402
    capture_submodule_inputs, decoder_layer_inputs, embedded_tokens, load_co2_series, make_batch, pseudo_image,
    revin_normalize, text_features, tokenize, vision_features,
)


@pytest.fixture(scope="module")
def batch():
    return make_batch()


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", seed=0)


def test_co2_record_gaps_filled_linearly():
    import statsmodels.datasets.co2 as co2

    raw = co2.load_pandas().data["co2"].to_numpy()
    values, dates, gaps = load_co2_series()
    assert len(values) == len(raw) == len(dates) == 2284
    assert gaps == int(np.isnan(raw).sum()) == 59
    assert not np.isnan(values).any() and not values.flags.writeable
    known = ~np.isnan(raw)
    assert np.array_equal(values[known], raw[known])
    positions = np.arange(len(raw))
    expected = np.interp(positions[~known], positions[known], raw[known])
    np.testing.assert_allclose(values[~known], expected, rtol=0, atol=1e-9)
    assert dates[0] == "1958-03-29" and dates[-1] == "2001-12-29"


def test_batch_shapes_and_windows(batch):
    values, dates, _ = load_co2_series()
    assert batch.context.shape == (4, 528) and batch.context.dtype == torch.float32
    assert batch.horizons == (80, 96)
    for horizon in (80, 96):
        assert batch.labels[horizon].shape == (4, horizon) and batch.labels[horizon].dtype == torch.float32
    for name in ("text_input_ids", "text_attention_mask", "text_token_type_ids"):
        tensor = getattr(batch, name)
        assert tensor.shape == (4, 125) and tensor.dtype == torch.int64
    assert batch.starts == [0, 553, 1106, 1660]
    for row, start in enumerate(batch.starts):
        window = values[start:start + 528 + 96].astype(np.float32)
        assert np.array_equal(batch.context[row].numpy(), window[:528])
        assert np.array_equal(batch.labels[96][row].numpy(), window[528:])
        assert np.array_equal(batch.labels[80][row].numpy(), window[528:608])
        assert batch.start_dates[row] == dates[start] and batch.end_dates[row] == dates[start + 527]
        assert batch.start_dates[row][:4] in batch.texts[row] and batch.end_dates[row][:4] in batch.texts[row]
    assert len(set(batch.texts)) == 4


def test_batch_is_deterministic_and_fingerprinted(batch):
    again = make_batch()
    assert again.fingerprint() == batch.fingerprint()
    assert make_batch(batch=3).fingerprint() != batch.fingerprint()
    nudged = make_batch()
    nudged.context[2, 100] = torch.nextafter(nudged.context[2, 100], torch.tensor(float("inf")))
    assert nudged.fingerprint() != batch.fingerprint()
    description = json.loads(json.dumps(batch.describe()))
    assert description["fingerprint"] == batch.fingerprint()
    assert description["gaps_interpolated"] == 59 and description["window_starts"] == batch.starts
    assert description["context"] == 528 and description["horizons"] == [80, 96]


def test_make_batch_rejects_bad_sizes():
    with pytest.raises(ValueError, match="exceeds"):
        make_batch(context=2200, horizons=(96,))
    with pytest.raises(ValueError, match="positive"):
        make_batch(batch=0)
    with pytest.raises(ValueError, match="positive"):
        make_batch(horizons=())


def test_tokenization_matches_the_shipped_bert_tokenizer(batch):
    import aurora.modality_connector as connector
    from transformers import BertTokenizer

    tokenizer = BertTokenizer.from_pretrained(connector.TextEncoder.config_path, local_files_only=True)
    expected = tokenizer(batch.texts, padding="max_length", truncation=True, max_length=125, return_tensors="pt")
    assert torch.equal(batch.text_input_ids, expected["input_ids"])
    assert torch.equal(batch.text_attention_mask, expected["attention_mask"])
    assert torch.equal(batch.text_token_type_ids, expected["token_type_ids"])
    assert int(batch.text_attention_mask.sum(dim=1).min()) > 10  # real sentences, not just [CLS] [SEP]
    with pytest.raises(ValueError, match="empty"):
        tokenize([])


def test_forward_kwargs(batch):
    eval_kwargs = batch.forward_kwargs(80)
    assert eval_kwargs["max_output_length"] == 80 and eval_kwargs["inference_token_len"] == 48
    assert "labels" not in eval_kwargs and eval_kwargs["text_input_ids"] is batch.text_input_ids
    train_kwargs = batch.forward_kwargs(96, train=True, text=False)
    assert train_kwargs["labels"] is batch.labels[96] and "text_input_ids" not in train_kwargs
    with pytest.raises(KeyError, match="no labels for horizon 48"):
        batch.forward_kwargs(48)
    with pytest.raises(ValueError, match="not a multiple of 48"):
        batch.forward_kwargs(80, train=True)


def test_upstream_train_path_rejects_horizon_80(tiny, batch):
    """Why forward_kwargs refuses it: upstream FlowLoss multiplies [N, 48] by a [1, 96] mask."""
    import copy

    model = copy.deepcopy(tiny).train()
    with pytest.raises(RuntimeError, match="must match the size"):
        model(input_ids=batch.context, labels=batch.labels[80])


def test_batch_to_dtype_changes_only_series(batch):
    bf16 = batch.to(dtype=torch.bfloat16)
    assert bf16.context.dtype == torch.bfloat16 and bf16.labels[96].dtype == torch.bfloat16
    assert bf16.text_input_ids.dtype == torch.int64
    assert batch.context.dtype == torch.float32  # the original is untouched


def test_pseudo_image_is_what_the_vision_encoder_sees(tiny, batch):
    normalized = revin_normalize(batch.context)
    image = pseudo_image(normalized)
    assert image.shape == (4, 3, 224, 224) and image.dtype == torch.float32
    with torch.no_grad():
        expected = tiny.model.VisionEncoder.processor(normalized, type="pseudo")
    assert torch.equal(image, expected)
    assert not torch.equal(image[0], image[1])


def test_embedded_tokens_are_the_encoder_input(tiny, batch):
    tokens = embedded_tokens(tiny, batch)
    assert tokens.shape == (4, 11, 32)
    with torch.no_grad():
        torch.manual_seed(0)
        out = tiny(**batch.forward_kwargs(96), output_hidden_states=True)
    assert torch.equal(tokens, out.hidden_states[0])


def test_decoder_layer_inputs_reproduce_the_forward(tiny, batch):
    hidden, cross = decoder_layer_inputs(tiny, batch, 0)
    assert hidden.shape == (4, 2, 32) and cross.shape == (4, 11, 32)
    with torch.no_grad():
        torch.manual_seed(0)
        out = tiny(**batch.forward_kwargs(96), output_hidden_states=True)
        next_input = tiny.model.dec_layers[0](hidden, cross)[0]
    n_enc = len(tiny.model.enc_layers)
    assert torch.equal(hidden, out.hidden_states[n_enc])
    assert torch.equal(next_input, out.hidden_states[n_enc + 1])


def test_modality_features(tiny, batch):
    vision = vision_features(tiny, batch)
    text = text_features(tiny, batch)
    assert vision.shape == text.shape == (4, tiny.config.num_distill, 32)
    assert not torch.equal(text[0], text[1])  # the descriptions differ per window
    captured = capture_submodule_inputs(tiny, batch, ["model.ModalityConnector"])
    args, _ = captured["model.ModalityConnector"]
    assert torch.equal(args[1], text) and torch.equal(args[2], vision)


def test_capture_errors(tiny, batch):
    with pytest.raises(KeyError, match="no submodule named"):
        capture_submodule_inputs(tiny, batch, ["model.nope"])
    with pytest.raises(KeyError, match="not called"):
        # linear_head only runs when labels are given (train path)
        capture_submodule_inputs(tiny, batch, ["model.VisionEncoder.processor.pseudo_resizer", "linear_head"])
    assert not tiny.training


def test_co2_loads_offline_quickly(monkeypatch):
    import socket
    import time

    def no_network(*args, **kwargs):
        raise OSError("network access attempted while loading the CO2 record")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    inputs._co2.cache_clear()
    start = time.perf_counter()
    values, _, _ = load_co2_series()
    elapsed = time.perf_counter() - start
    assert len(values) == 2284 and elapsed < 5.0


def test_normalized_batch(batch):
    normalized = batch.normalized()
    assert normalized.scale != batch.scale and normalized.describe()["scale"] == normalized.scale
    assert normalized.fingerprint() != batch.fingerprint()
    assert normalized.context.dtype == torch.float32
    torch.testing.assert_close(normalized.context.mean(dim=1), torch.zeros(4), rtol=0, atol=1e-5)
    torch.testing.assert_close(normalized.context.std(dim=1, unbiased=False), torch.ones(4), rtol=0, atol=1e-5)
    context = batch.context.double()
    means, stdev = context.mean(dim=1, keepdim=True), context.std(dim=1, keepdim=True, unbiased=False)
    for horizon in batch.horizons:
        expected = ((batch.labels[horizon].double() - means) / stdev).float()
        assert torch.equal(normalized.labels[horizon], expected)
    assert torch.equal(normalized.text_input_ids, batch.text_input_ids) and normalized.texts == batch.texts
    assert batch.context.mean() > 300  # the original stays in ppm
    assert normalized.to(dtype=torch.bfloat16).scale == normalized.scale


def test_normalized_batch_makes_relative_metrics_see_a_fault(tiny):
    """In ppm the forecast carries a ≈ 330 ppm offset that dilutes any relative error."""
    raw = make_batch(batch=2)
    weight = tiny.model.dec_layers[1].ffn_layer.ffn[0].weight
    rel_l2 = {}
    for candidate in (raw, raw.normalized()):
        outputs = []
        for factor in (1.0, 1 + 1e-4):
            saved = weight.detach().clone()
            with torch.no_grad():
                weight.mul_(factor)
                torch.manual_seed(0)
                outputs.append(tiny(**candidate.forward_kwargs(96)).logits)
                weight.copy_(saved)
        rel_l2[candidate.scale] = float((outputs[1] - outputs[0]).norm() / outputs[0].norm())
    assert rel_l2[raw.normalized().scale] > 50 * rel_l2["ppm"] > 0

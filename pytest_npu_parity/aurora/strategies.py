"""Hypothesis strategies for valid Aurora input shapes, and the project's hypothesis profiles.

Device-propagation bugs hide in shapes: a context length that is not a multiple of the patch
length takes the padding path, an ``inference_token_len`` other than 48 resamples the patch
projection (``pinv``), a horizon that is not a multiple of it truncates the forecast, a text that
fills the whole token window has no padding, an empty text leaves nothing to select. The strategies
here draw those shapes; the property tests (``parity_suites/aurora/test_device_propagation.py``)
build real inputs of these shapes and audit the run on the target.

What "valid" means (aurora-model 0.2.0, read from its source and measured):

=========================  ========================================================================
field                      range and why
=========================  ========================================================================
``batch``                  1 … ``max_batch`` (default 4)
``context``                2 … ``max_context`` (default 1 024) weeks; any length: the patch embedding
                           left-pads to a multiple of ``inference_token_len`` (``_predict``).
                           One point is excluded: the period search divides by the top frequency
                           index, which is 0 for a one-point series (NumPy division by zero).
``inference_token_len``    4 … 128, with 48 (the trained patch length: ``resample`` returns the
                           weight unchanged) drawn often; any positive length resamples.
``horizon``                1 … ``MAX_PREDICT_TOKENS`` × ``inference_token_len`` (at most 1 024);
                           ``ceil(horizon / inference_token_len)`` decoder tokens, the forecast is cut
                           to ``horizon``. Training horizons are multiples of 48 (upstream's train
                           path raises otherwise: ``FlowLoss`` multiplies the per-token loss
                           ``[N, 48]`` by a ``[1, padded horizon]`` mask), and a batch of one
                           trains on two tokens or more (BatchNorm needs two values per channel).
``num_samples``            1 … 3 flow-matching samples per forecast.
``text``                   with or without the text branch.
``text_seq_len``           2 … 160 BERT positions (upstream pads to 125; longer texts take
                           ``TextEncoder``'s truncation path, BERT allows 512).
``text_words``             per sample 0 … ``text_seq_len − 2`` word pieces between ``[CLS]`` and
                           ``[SEP]``; the maximum leaves no padding at all.
=========================  ========================================================================

``context + horizon`` never exceeds 2 048, so real Mauna Loa CO2 windows (2 284 weeks) exist for
every example (``pytest_npu_parity.aurora.inputs.make_batch``).

The hypothesis profiles these property tests run under (``npu-parity-ci``, ``nightly``) belong to
every parity session, not to Aurora: they live in :mod:`pytest_npu_parity.hypothesis_profiles`.
Hypothesis prints the falsifying example (an :class:`AuroraShapes` with every field) under every
profile.

Part of the Aurora adapter (it used to be ``pytest_npu_parity.strategies``, which still re-exports it).
Its own imports are hypothesis only (never pytest, torch or ``aurora``; the adapter package's
``__init__`` imports torch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

__all__ = [
    "TOKEN_LEN",
    "MIN_CONTEXT",
    "MAX_CONTEXT",
    "MAX_PREDICT_TOKENS",
    "MAX_TEXT_SEQ_LEN",
    "AuroraShapes",
    "batch_sizes",
    "context_lengths",
    "inference_token_lens",
    "horizons",
    "token_counts",
    "text_layouts",
    "aurora_shapes",
    "training_shapes",
]

#: Aurora's trained patch length (config.json ``token_len``).
TOKEN_LEN = 48
#: Shortest context: a one-point series makes the period search divide by zero (see module doc).
MIN_CONTEXT = 2
#: Longest context drawn by default (weeks); keeps an example under a second on two CPU cores.
MAX_CONTEXT = 1024
#: Most decoder tokens (``ceil(horizon / inference_token_len)``) drawn.
MAX_PREDICT_TOKENS = 16
#: Longest horizon drawn (weeks); with :data:`MAX_CONTEXT` a CO2 window always exists.
MAX_HORIZON = 1024
#: Inference patch lengths drawn: 4 … 128.
MIN_INFERENCE_TOKEN_LEN, MAX_INFERENCE_TOKEN_LEN = 4, 128
#: Upstream's text window (``TSGenerationMixin.generate(max_text_token_length=125)``).
TEXT_MAX_LENGTH = 125
#: Longest BERT input drawn: beyond 125 + [CLS] + [SEP] the TextEncoder truncates (BERT allows 512).
MAX_TEXT_SEQ_LEN = 160


@dataclass(frozen=True)
class AuroraShapes:
    """One drawn set of Aurora input shapes (hypothesis prints it as the falsifying example).

    Attributes:
        batch: B, series per batch.
        context: L, context length in time steps (weeks for the CO2 data).
        inference_token_len: P, patch length of the eval path (``inference_token_len``).
        horizon: H, forecast length in time steps.
        num_samples: flow-matching samples per forecast.
        text: whether the text branch runs (token ids given).
        text_seq_len: T, BERT positions of the token ids (``[CLS]``, words, ``[SEP]``, padding).
        text_words: per sample, the number of word pieces (0 … T − 2); empty without text.
        seed: seed for the values that fill these shapes (noise, word ids).
    """

    batch: int
    context: int
    inference_token_len: int = TOKEN_LEN
    horizon: int = TOKEN_LEN
    num_samples: int = 1
    text: bool = False
    text_seq_len: int = 0
    text_words: tuple[int, ...] = ()
    seed: int = 0

    @property
    def input_tokens(self) -> int:
        """Patch tokens of the context: ``ceil(L / P)`` (``_predict`` left-pads to a multiple of P)."""
        return math.ceil(self.context / self.inference_token_len)

    @property
    def train_input_tokens(self) -> int:
        """Patch tokens of the training path: ``ceil(L / 48)`` (it always uses the trained length)."""
        return math.ceil(self.context / TOKEN_LEN)

    @property
    def predict_tokens(self) -> int:
        """Decoder tokens of the eval path: ``ceil(H / P)`` (``AuroraForPrediction.forward``)."""
        return math.ceil(self.horizon / self.inference_token_len)

    @property
    def train_predict_tokens(self) -> int:
        """Decoder tokens of the training path: ``ceil(H / 48)``."""
        return math.ceil(self.horizon / TOKEN_LEN)


def batch_sizes(max_batch: int = 4) -> st.SearchStrategy[int]:
    """Batch sizes 1 … ``max_batch``.

    Raises:
        ValueError: ``max_batch`` < 1.
    """
    if max_batch < 1:
        raise ValueError(f"batch_sizes: max_batch must be >= 1, got {max_batch}")
    return st.integers(1, max_batch)


def context_lengths(inference_token_len: int = TOKEN_LEN, max_context: int = MAX_CONTEXT) -> st.SearchStrategy[int]:
    """Context lengths :data:`MIN_CONTEXT` … ``max_context``, with the edges of the padding path
    (``k·P − 1``, ``k·P``, ``k·P + 1`` for the patch length P) drawn as often as the rest.

    Raises:
        ValueError: ``max_context`` < :data:`MIN_CONTEXT` or ``inference_token_len`` < 1.
    """
    if max_context < MIN_CONTEXT or inference_token_len < 1:
        raise ValueError(f"context_lengths: need max_context >= {MIN_CONTEXT} and inference_token_len >= 1, "
                         f"got {max_context} and {inference_token_len}")
    edges = sorted({n for k in range(1, max_context // inference_token_len + 2)
                    for n in (k * inference_token_len - 1, k * inference_token_len, k * inference_token_len + 1)
                    if MIN_CONTEXT <= n <= max_context})
    anywhere = st.integers(MIN_CONTEXT, max_context)
    return st.one_of(anywhere, st.sampled_from(edges)) if edges else anywhere


def inference_token_lens() -> st.SearchStrategy[int]:
    """Inference patch lengths 4 … 128, the trained length 48 drawn about a third of the time."""
    return st.one_of(st.just(TOKEN_LEN), st.integers(MIN_INFERENCE_TOKEN_LEN, MAX_INFERENCE_TOKEN_LEN))


def horizons(inference_token_len: int = TOKEN_LEN, *, train: bool = False,
             min_train_tokens: int = 1) -> st.SearchStrategy[int]:
    """Forecast horizons for patch length P: 1 … min(16·P, 1 024) (eval), or 48 · (``min_train_tokens``
    … 4) (``train``).

    Eval horizons include the multiples of P and their neighbours (the truncation edges).

    Raises:
        ValueError: ``inference_token_len`` < 1, or ``min_train_tokens`` not in 1 … 4.
    """
    if not 1 <= min_train_tokens <= 4:
        raise ValueError(f"horizons: min_train_tokens must be in 1 … 4, got {min_train_tokens}")
    if train:
        return st.integers(min_train_tokens, 4).map(lambda k: k * TOKEN_LEN)
    if inference_token_len < 1:
        raise ValueError(f"horizons: inference_token_len must be >= 1, got {inference_token_len}")
    top = min(MAX_PREDICT_TOKENS * inference_token_len, MAX_HORIZON)
    edges = sorted({n for k in range(1, top // inference_token_len + 1)
                    for n in (k * inference_token_len - 1, k * inference_token_len, k * inference_token_len + 1)
                    if 1 <= n <= top})
    return st.one_of(st.integers(1, top), st.sampled_from(edges))


def token_counts(max_tokens: int = 32) -> st.SearchStrategy[int]:
    """Token counts 1 … ``max_tokens`` (sequence lengths inside attention and transformer layers).

    Raises:
        ValueError: ``max_tokens`` < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"token_counts: max_tokens must be >= 1, got {max_tokens}")
    return st.integers(1, max_tokens)


@st.composite
def text_layouts(draw: Any, batch: int, max_seq_len: int = MAX_TEXT_SEQ_LEN) -> tuple[int, tuple[int, ...]]:
    """``(text_seq_len, words per sample)`` for ``batch`` samples: T in 2 … ``max_seq_len`` (upstream's
    125 drawn often) and 0 … T − 2 word pieces per sample (T − 2 often: no padding at all)."""
    if batch < 1 or max_seq_len < 2:
        raise ValueError(f"text_layouts: need batch >= 1 and max_seq_len >= 2, got {batch} and {max_seq_len}")
    seq_len = draw(st.one_of(st.just(min(TEXT_MAX_LENGTH, max_seq_len)), st.integers(2, max_seq_len)))
    words = draw(st.lists(st.one_of(st.just(seq_len - 2), st.integers(0, seq_len - 2)),
                          min_size=batch, max_size=batch))
    return seq_len, tuple(words)


@st.composite
def aurora_shapes(draw: Any, *, max_batch: int = 4, max_context: int = MAX_CONTEXT, text: bool | None = None,
                  max_text_seq_len: int = MAX_TEXT_SEQ_LEN, max_samples: int = 3) -> AuroraShapes:
    """Shapes of one eval forward / ``generate`` call (see the module table for the ranges).

    Args:
        max_batch, max_context: upper bounds of B and L.
        text: force the text branch on (True) or off (False); None draws it.
        max_text_seq_len: upper bound of T.
        max_samples: upper bound of ``num_samples``.
    """
    patch = draw(inference_token_lens())
    batch = draw(batch_sizes(max_batch))
    context = draw(context_lengths(patch, max_context))
    horizon = draw(horizons(patch))
    with_text = draw(st.booleans()) if text is None else text
    seq_len, words = draw(text_layouts(batch, max_text_seq_len)) if with_text else (0, ())
    return AuroraShapes(batch=batch, context=context, inference_token_len=patch, horizon=horizon,
                        num_samples=draw(st.integers(1, max_samples)), text=with_text, text_seq_len=seq_len,
                        text_words=words, seed=draw(st.integers(0, 2**16)))


@st.composite
def training_shapes(draw: Any, *, max_batch: int = 4, max_context: int = MAX_CONTEXT, text: bool | None = None,
                    max_text_seq_len: int = MAX_TEXT_SEQ_LEN) -> AuroraShapes:
    """Shapes of one training forward (labels given): ``inference_token_len`` 48, horizon a multiple of 48.

    A batch of one has at least two decoder tokens: the decoder layers' BatchNorm (``norm_mode``
    ``batch``) needs more than one value per channel in training ("Expected more than 1 value per
    channel when training" for one series and one token).
    """
    batch = draw(batch_sizes(max_batch))
    context = draw(context_lengths(TOKEN_LEN, max_context))
    with_text = draw(st.booleans()) if text is None else text
    seq_len, words = draw(text_layouts(batch, max_text_seq_len)) if with_text else (0, ())
    horizon = draw(horizons(train=True, min_train_tokens=2 if batch == 1 else 1))
    return AuroraShapes(batch=batch, context=context, inference_token_len=TOKEN_LEN,
                        horizon=horizon, num_samples=1, text=with_text, text_seq_len=seq_len,
                        text_words=words, seed=draw(st.integers(0, 2**16)))

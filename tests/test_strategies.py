"""The Aurora shape strategies draw only valid shapes and do reach the edges; the hypothesis profiles
are registered as documented and a parity session loads the bounded one unless the user chose."""
from __future__ import annotations

import hypothesis
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

import pytest_npu_parity.npu  # noqa: F401 - imported once here: pytester forgets modules first imported
import pytest_npu_parity.runner  # noqa: F401 - during an in-process run, and torch extensions do not re-import
from pytest_npu_parity import hypothesis_profiles as profiles
from pytest_npu_parity.aurora import strategies as aurora_st
from pytest_npu_parity.aurora.strategies import MAX_CONTEXT, MAX_PREDICT_TOKENS, MIN_CONTEXT, TOKEN_LEN, AuroraShapes
from pytest_npu_parity.hypothesis_profiles import CI_MAX_EXAMPLES, CI_PROFILE, NIGHTLY_MAX_EXAMPLES, NIGHTLY_PROFILE

CO2_WEEKS = 2284  # statsmodels' Mauna Loa record: every drawn context + horizon must fit in it


# ---------------------------------------------------------------------------------------------
# Valid shapes
# ---------------------------------------------------------------------------------------------

def _check_text(ex: AuroraShapes) -> None:
    if ex.text:
        assert 2 <= ex.text_seq_len <= aurora_st.MAX_TEXT_SEQ_LEN
        assert len(ex.text_words) == ex.batch
        assert all(0 <= w <= ex.text_seq_len - 2 for w in ex.text_words)  # [CLS] + words + [SEP] fit
    else:
        assert ex.text_seq_len == 0 and ex.text_words == ()


@given(ex=aurora_st.aurora_shapes())
def test_eval_shapes_are_valid(ex):
    assert 1 <= ex.batch <= 4
    assert MIN_CONTEXT <= ex.context <= MAX_CONTEXT
    assert 4 <= ex.inference_token_len <= 128
    assert 1 <= ex.predict_tokens <= MAX_PREDICT_TOKENS
    assert ex.context + ex.horizon <= CO2_WEEKS
    assert 1 <= ex.num_samples <= 3
    assert ex.input_tokens == -(-ex.context // ex.inference_token_len)
    _check_text(ex)


@given(ex=aurora_st.training_shapes())
def test_training_shapes_are_valid(ex):
    assert ex.inference_token_len == TOKEN_LEN
    assert ex.horizon % TOKEN_LEN == 0 and 1 <= ex.train_predict_tokens <= 4
    assert ex.batch * ex.train_predict_tokens >= 2  # BatchNorm in training needs two values per channel
    assert ex.context + ex.horizon <= CO2_WEEKS
    _check_text(ex)


@given(ex=aurora_st.aurora_shapes(max_batch=2, max_context=64, text=True, max_text_seq_len=20, max_samples=1))
def test_bounds_and_forced_text_are_respected(ex):
    assert ex.batch <= 2 and ex.context <= 64 and ex.text and ex.text_seq_len <= 20 and ex.num_samples == 1


@given(patch=st.integers(1, 128), data=st.data())
def test_horizons_stay_within_the_decoder_token_budget(patch, data):
    horizon = data.draw(aurora_st.horizons(patch))
    assert 1 <= horizon <= min(MAX_PREDICT_TOKENS * patch, 1024)


def test_derived_token_counts():
    ex = AuroraShapes(batch=2, context=100, inference_token_len=48, horizon=97)
    assert (ex.input_tokens, ex.predict_tokens, ex.train_input_tokens) == (3, 3, 3)
    ex = AuroraShapes(batch=2, context=96, inference_token_len=32, horizon=96)
    assert (ex.input_tokens, ex.predict_tokens, ex.train_input_tokens, ex.train_predict_tokens) == (3, 3, 2, 2)


# ---------------------------------------------------------------------------------------------
# The edges are drawn (each search fails with NoSuchExample if the strategy cannot reach it)
# ---------------------------------------------------------------------------------------------

SEARCH = settings(max_examples=1000, database=None, derandomize=True, phases=[Phase.generate])  # no shrinking


@pytest.mark.parametrize("name, strategy, condition", [
    ("context not a multiple of the patch length", aurora_st.aurora_shapes(),
     lambda ex: ex.context % ex.inference_token_len != 0),
    ("context a multiple of the patch length", aurora_st.aurora_shapes(),
     lambda ex: ex.context % ex.inference_token_len == 0 and ex.context > ex.inference_token_len),
    ("context one past a multiple", aurora_st.aurora_shapes(),
     lambda ex: ex.context % ex.inference_token_len == 1),
    ("the trained patch length", aurora_st.aurora_shapes(), lambda ex: ex.inference_token_len == TOKEN_LEN),
    ("a resampled patch length", aurora_st.aurora_shapes(), lambda ex: ex.inference_token_len != TOKEN_LEN),
    ("horizon truncated", aurora_st.aurora_shapes(), lambda ex: ex.horizon % ex.inference_token_len != 0),
    ("batch of one", aurora_st.aurora_shapes(), lambda ex: ex.batch == 1),
    ("without text", aurora_st.aurora_shapes(), lambda ex: not ex.text),
    ("text filling the window (no padding)", aurora_st.aurora_shapes(),
     lambda ex: ex.text and ex.text_words[0] == ex.text_seq_len - 2),
    ("text with padding", aurora_st.aurora_shapes(), lambda ex: ex.text and ex.text_words[0] < ex.text_seq_len - 2),
    ("upstream's 125-token text window", aurora_st.aurora_shapes(), lambda ex: ex.text and ex.text_seq_len == 125),
    ("a text longer than the encoder keeps", aurora_st.aurora_shapes(),
     lambda ex: ex.text and max(ex.text_words) > 125),
    ("an empty text", aurora_st.aurora_shapes(), lambda ex: ex.text and min(ex.text_words) == 0),
    ("several samples", aurora_st.aurora_shapes(), lambda ex: ex.num_samples > 1),
    ("training on one series", aurora_st.training_shapes(), lambda ex: ex.batch == 1),
    ("training on several tokens", aurora_st.training_shapes(), lambda ex: ex.train_predict_tokens >= 3),
])
def test_strategy_reaches(name, strategy, condition):
    example = find(strategy, condition, settings=SEARCH)
    assert condition(example), name


def test_a_one_point_context_is_never_drawn():
    with pytest.raises(NoSuchExample):
        find(aurora_st.context_lengths(), lambda n: n < MIN_CONTEXT, settings=SEARCH)


@pytest.mark.parametrize("call", [
    lambda: aurora_st.batch_sizes(0),
    lambda: aurora_st.context_lengths(max_context=1),
    lambda: aurora_st.context_lengths(inference_token_len=0),
    lambda: aurora_st.horizons(0),
    lambda: aurora_st.horizons(train=True, min_train_tokens=5),
    lambda: aurora_st.token_counts(0),
    lambda: profiles.examples_for(0),
    lambda: profiles.examples_for(1.5),
])
def test_bad_bounds_are_rejected(call):
    with pytest.raises(ValueError):
        call()


def test_bad_text_bounds_are_rejected_when_drawn():
    with pytest.raises(ValueError, match="max_seq_len"):
        find(aurora_st.text_layouts(2, max_seq_len=1), lambda _: True, settings=SEARCH)


# ---------------------------------------------------------------------------------------------
# Profiles
# ---------------------------------------------------------------------------------------------

def test_profiles_extend_the_builtin_ci_profile():
    profiles.register_profiles()
    ci = settings.get_profile(CI_PROFILE)
    assert ci.max_examples == CI_MAX_EXAMPLES and 10 <= CI_MAX_EXAMPLES <= 20
    assert ci.derandomize and ci.deadline is None and ci.print_blob and ci.database is None
    assert hypothesis.HealthCheck.too_slow in ci.suppress_health_check
    nightly = settings.get_profile(NIGHTLY_PROFILE)
    assert nightly.max_examples == NIGHTLY_MAX_EXAMPLES >= 10 * CI_MAX_EXAMPLES
    assert not nightly.derandomize and nightly.deadline is None and nightly.print_blob
    # hypothesis' own ci profile is left as it was (100 examples)
    assert settings.get_profile("ci").max_examples == settings.get_profile("default").max_examples


def test_register_profiles_is_idempotent_and_keeps_a_users_nightly(monkeypatch):
    first = profiles.register_profiles()
    assert profiles.register_profiles() == first
    mine = settings(max_examples=7)
    saved = settings.get_profile(NIGHTLY_PROFILE)
    monkeypatch.setattr(profiles, "_REGISTERED", {})
    settings.register_profile(NIGHTLY_PROFILE, mine)
    try:
        registered = profiles.register_profiles()
        assert NIGHTLY_PROFILE not in registered and settings.get_profile(NIGHTLY_PROFILE).max_examples == 7
    finally:
        settings.register_profile(NIGHTLY_PROFILE, saved)


def test_current_profile_name_without_the_getter(monkeypatch):
    """Hypothesis releases without ``get_current_profile_name``: read its record of the loaded profile."""
    import types

    monkeypatch.setattr(profiles, "settings", types.SimpleNamespace(_current_profile="dev"))
    assert profiles.current_profile_name() == "dev"
    monkeypatch.setattr(profiles, "settings", types.SimpleNamespace())
    assert profiles.current_profile_name() == "default"


@pytest.mark.parametrize("explicit, current, expected", [
    (None, "default", CI_PROFILE),
    (None, "ci", CI_PROFILE),
    ("", "default", CI_PROFILE),
    ("nightly", "default", None),   # --hypothesis-profile nightly
    ("ci", "ci", None),             # the user asked for hypothesis' own ci profile
    (None, "dev", None),            # a conftest loaded its own profile
])
def test_profile_to_load(explicit, current, expected):
    assert profiles.profile_to_load(explicit, current) == expected


def test_examples_for_scales_the_active_profile():
    with _profile(max_examples=40):
        assert profiles.examples_for(0.25) == 10
        assert profiles.examples_for(0.01) == 2
        assert profiles.examples_for(0.01, minimum=3) == 3
        assert profiles.examples_for(1.0) == 40


def _profile(**kwargs):
    """Load a throwaway profile inside the block, then the previous one again."""
    import contextlib

    @contextlib.contextmanager
    def block():
        previous = profiles.current_profile_name()
        settings.register_profile("npu-parity-test-scratch", **kwargs)
        settings.load_profile("npu-parity-test-scratch")
        try:
            yield
        finally:
            settings.load_profile(previous)

    return block()


PROFILE_PROBE = """
from hypothesis import settings

from pytest_npu_parity.hypothesis_profiles import current_profile_name

def test_profile():
    print("PROFILE", current_profile_name(), settings.default.max_examples)
"""


@pytest.mark.parametrize("args, expected", [
    ((), "PROFILE default 100"),                                      # parity off: hypothesis untouched
    (("--npu-parity",), f"PROFILE {CI_PROFILE} {CI_MAX_EXAMPLES}"),    # parity on, no choice: bounded
    (("--npu-parity", "--hypothesis-profile", "nightly"), f"PROFILE nightly {NIGHTLY_MAX_EXAMPLES}"),
    (("--npu-parity", "--hypothesis-profile", "default"), "PROFILE default 100"),  # explicit choice kept
])
def test_parity_session_loads_the_bounded_profile_unless_the_user_chose(pytester, args, expected):
    pytester.makepyfile(PROFILE_PROBE)
    before = profiles.current_profile_name()
    settings.load_profile("default")  # what a session without CI environment variables starts from
    try:
        result = pytester.runpytest("-s", "-p", "no:cacheprovider", "--parity-device", "cpu", *args)
        after = profiles.current_profile_name()
    finally:
        settings.load_profile(before)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"*{expected}"])
    if "--hypothesis-profile" not in args:  # the plugin puts back what it replaced (in-process runs)
        assert after == "default"

"""Plugin behaviour through pytester: options, skipping, recipes, verdicts, messages, device errors."""
from __future__ import annotations

import sys

import pytest
import torch

LINEAR_TEST = """
import contextlib
import pytest
import torch

@pytest.fixture
def layer():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4).eval()

def test_linear(parity, layer):
    x = torch.linspace(-1, 1, 24).reshape(3, 8)
    parity.check("linear", layer, x)

def test_plain():
    assert 1 + 1 == 2
"""

# The target side runs under `parity_patches`: a "patch set" that corrupts one output element
# by 2x the fp32 tolerance, so the check must fail and name that element.
BROKEN_TARGET = """
import contextlib
import pytest
import torch

class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2

@pytest.fixture
def parity_patches():
    @contextlib.contextmanager
    def corrupt(device):
        original = Doubler.forward
        def forward(self, x):
            y = original(self, x)
            y[1, 2] += 2 * (1e-5 + 1e-5 * abs(float(y[1, 2])))
            return y
        Doubler.forward = forward
        try:
            yield
        finally:
            Doubler.forward = original
    return corrupt

def test_broken(parity):
    parity.check("doubler", Doubler(), torch.linspace(1, 2, 12).reshape(3, 4))

@pytest.mark.parity(rtol=1e-3, atol=1e-3, reason="documented: tolerance widened on purpose")
def test_broken_but_widened(parity):
    record = parity.check("doubler", Doubler(), torch.linspace(1, 2, 12).reshape(3, 4))
    assert record.tolerance.source == "marker"
    assert record.tolerance.reason == "documented: tolerance widened on purpose"
"""


def test_help_lists_every_option(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    for option in ("--npu-parity", "--parity-device", "--parity-reference", "--parity-dtypes",
                   "--update-baselines", "--baseline-dir", "--parity-report", "--parity-history",
                   "--parity-seed", "--parity-audit", "--parity-rng"):
        result.stdout.fnmatch_lines([f"*{option}*"])


def test_parity_tests_are_skipped_without_the_flag(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*parity suites run only with --npu-parity*"])


def test_check_passes_under_each_recipe(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-device", "cpu", "-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*test_linear?fp32? PASSED*", "*test_linear?bf16? PASSED*"])
    result.stdout.fnmatch_lines(["*npu-parity*", "*linear*fp32*1*1*", "*2 checks: 2 pass*"])


def test_recipes_follow_parity_dtypes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32", "-v")
    result.assert_outcomes(passed=2)
    assert "test_linear[bf16]" not in result.stdout.str()


def test_unknown_recipe_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32,fp8")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown recipe(s) fp8*"])


def test_a_bad_ini_recipe_or_device_is_named_by_its_ini_key(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    pytester.makeini("[pytest]\nparity_dtypes = fp32,fp8\n")
    result = pytester.runpytest("--npu-parity")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini parity_dtypes: unknown recipe(s) fp8; known: *"])
    if torch.cuda.is_available():
        return
    pytester.makeini("[pytest]\nparity_device = cuda:0\n")
    result = pytester.runpytest("--npu-parity")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini parity_device=cuda:0: *CUDA*"])
    assert "--parity-device" not in result.stderr.str().split("CUDA")[0]
    pytester.makeini("[pytest]\nparity_worker_devices = 0,x\n")
    result = pytester.runpytest("--npu-parity", "--parity-device", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: ini parity_worker_devices='0,x': 'x' is not a device index*"])


def test_header_names_target_reference_and_versions(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-device", "cpu", "--co")
    result.stdout.fnmatch_lines([
        "npu-parity: target cpu (*) * reference auto * recipes fp32,bf16 *",
        f"npu-parity: torch {torch.__version__} * torch_npu * CANN * precision flags *allow_tf32=False*",
    ])


@pytest.mark.parametrize("device", ["npu", "npu:1"])
def test_absent_npu_is_a_usage_error_naming_the_cause(pytester: pytest.Pytester, device: str) -> None:
    from pytest_npu_parity.npu import npu_status

    if npu_status().available:
        pytest.skip("an NPU is present")
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-device", device)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--parity-device={device}: *torch_npu*"])


def test_absent_cuda_is_a_usage_error(pytester: pytest.Pytester) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-device", "cuda:0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--parity-device=cuda:0: *CUDA*"])


def test_bad_device_spec_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-device", "tpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--parity-device='tpu' is not a device*"])


def test_failure_names_the_element_and_marker_override_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(BROKEN_TARGET)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*Parity check 'doubler' failed (recipe fp32, target cpu (*) vs a live CPU run)*",
        "*Mismatched elements: 1 / 12 (8.3%)*",
        "*Greatest absolute difference: * at index (1, 2) (up to 1e-05 allowed*",
        "*leaf*shape*dtype*max_abs*max_rel*rel_l2*cosine*mismatched*",
    ])


def test_compare_of_user_outputs_with_nan_in_different_places_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
        import torch
        def test_nan(parity):
            a = torch.zeros(5); a[1] = float("nan")
            b = torch.zeros(5); b[3] = float("nan")
            parity.compare("nan", a, b)
        def test_same_nan(parity):
            a = torch.zeros(5); a[1] = float("nan")
            parity.compare("nan", a, a.clone())
    """)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*NaN/Inf positions differ at 2 elements*"])


def test_ini_per_check_tolerance_applies_with_its_reason(pytester: pytest.Pytester) -> None:
    pytester.makeini("""
        [pytest]
        parity_tolerances =
            doub*: rtol=1e-3 atol=1e-3 # widened in ini for the test
    """)
    pytester.makepyfile(BROKEN_TARGET.replace("@pytest.mark.parity(", "@pytest.mark.skip(reason='n/a')\n@pytest.mark.parity("))
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32")
    result.assert_outcomes(passed=1, skipped=1)


def test_bad_ini_tolerance_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("""
        [pytest]
        parity_tolerances =
            linear: rtol=abc
    """)
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*bad number 'abc' for rtol*"])


def test_junit_xml_carries_parity_metrics_per_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32", "--junitxml", "junit.xml")
    result.assert_outcomes(passed=2)
    xml = (pytester.path / "junit.xml").read_text()
    assert '<property name="parity.linear.verdict" value="pass"' in xml
    assert 'name="parity.linear.max_abs"' in xml and 'name="parity.linear.cosine"' in xml


CASE_LIFETIME_TEST = """
import gc
import weakref

import pytest
import torch

CASES = []

def test_first(parity):
    CASES.append(weakref.ref(parity))
    torch.manual_seed(0)
    parity.check("linear", torch.nn.Linear(8, 4).eval(), torch.linspace(-1, 1, 24).reshape(3, 8))

def test_second(parity):
    gc.collect()
    assert CASES[0]() is None, "the first test's ParityCase outlived its test"
"""


def test_a_finished_tests_case_is_not_kept_by_the_plugin(pytester: pytest.Pytester) -> None:
    """The ``parity`` fixture's ``ParityCase`` (its module copies, inputs, pending recordings) is
    freed when its test ends; the session keeps only the check records."""
    pytester.makepyfile(CASE_LIFETIME_TEST)
    pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32").assert_outcomes(passed=2)


def test_per_check_override_with_reason(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(BROKEN_TARGET.replace(
        'parity.check("doubler", Doubler(), torch.linspace(1, 2, 12).reshape(3, 4))\n\n@pytest.mark.parity',
        'parity.check("doubler", Doubler(), torch.linspace(1, 2, 12).reshape(3, 4), rtol=1e-3, atol=1e-3, reason="why")\n'
        '    assert parity.records[-1].tolerance.reason == "why"\n'
        '    assert parity.records[-1].tolerance.source == "check"\n\n@pytest.mark.parity'))
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32")
    result.assert_outcomes(passed=2)


# A legitimate bf16 variant on the target: the K=256 product computed as two half-K products
# (a reordered reduction). bf16 allclose 1e-3 fails it; the golden verdict passes it.
SPLIT_K = """
import contextlib
import pytest
import torch

class Proj(torch.nn.Module):
    split = False
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) / 16)
    def forward(self, x):
        if Proj.split:
            return x[:, :128] @ self.w[:128] + x[:, 128:] @ self.w[128:]
        return x @ self.w

@pytest.fixture
def parity_patches():
    @contextlib.contextmanager
    def split(device):
        Proj.split = True
        try:
            yield
        finally:
            Proj.split = False
    return split

X = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))

def test_proj(parity):
    parity.check("proj", Proj(), X)
"""


def test_parity_policy_golden_passes_a_legitimate_bf16_variant(pytester: pytest.Pytester) -> None:
    import pandas as pd

    pytester.makepyfile(SPLIT_K)
    failed = pytester.runpytest("--npu-parity", "--parity-dtypes", "bf16", "--parity-policy", "allclose")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*verdicts bf16 allclose rtol=0.001 atol=0.001 budget=0.001*"])
    default = pytester.runpytest("--npu-parity", "--parity-dtypes", "bf16")  # the default: golden floor
    default.assert_outcomes(passed=1)
    default.stdout.fnmatch_lines(["*verdicts bf16 golden floor rmse<=2 max_rel<=10 mean_rel<=2 small<=2*"])
    # In a subprocess: pytester drops the modules first imported by an in-process run, and pandas
    # imported again would register its pyarrow extension types twice (ArrowKeyError).
    result = pytester.runpytest_subprocess("--npu-parity", "--parity-dtypes", "bf16", "--parity-policy", "golden",
                                           "--parity-report", "out", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*verdicts bf16 golden rmse<=2 max_rel<=10 mean_rel<=2 small<=2*",
                                 "verdicts: 1 by golden rmse<=2 max_rel<=10*"])
    rows = pd.read_csv(pytester.path / "out" / "results.csv")
    assert list(rows["policy"]) == ["golden"] and rows["golden_worst_margin"].iloc[0] <= 1


def test_ini_recipe_and_per_check_policies_and_marker(pytester: pytest.Pytester) -> None:
    pytester.makeini("""
        [pytest]
        parity_bf16_policy = golden
        parity_policies =
            pro*: golden rmse=3 # per-check in ini
    """)
    pytester.makepyfile(SPLIT_K + """
def test_recipe_level(parity):
    record = parity.check("other", Proj(), X)
    assert record.golden_policy.rmse_ratio == 2 and record.golden_policy.source == "default"

def test_per_check(parity):
    record = parity.check("proj", Proj(), X)
    assert (record.golden_policy.rmse_ratio, record.golden_policy.reason) == (3, "per-check in ini")

@pytest.mark.parity(policy="allclose")
def test_marker_wins(parity):
    with pytest.raises(AssertionError, match="Mismatched elements"):
        parity.check("proj", Proj(), X)

def test_argument_wins(parity):
    assert parity.check("proj", Proj(), X, policy="golden max_rel=20 # arg").golden_policy.source == "check"
""")
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "bf16")
    result.assert_outcomes(passed=5)


def test_fp16_recipe_is_opt_in_with_its_own_ini_keys_and_no_npu_header_on_the_cpu(pytester: pytest.Pytester) -> None:
    pytester.makeini("""
        [pytest]
        parity_fp16_tolerance = rtol=2e-3 atol=2e-3 # fp16 override
    """)
    pytester.makepyfile(SPLIT_K.replace("def parity_patches():", "def _unused_patches():") + """
def test_step(parity):
    record = parity.train_step("step", torch.nn.Sequential(Proj(), torch.nn.Linear(64, 1)), {"input": X},
                               loss_fn=lambda out: out.square().mean())
    amp = {"amp.scale", "amp.skipped_steps", "amp.grad_norm"} & {leaf.path for leaf in record.result.leaves}
    if record.recipe == "fp16":
        assert record.tolerance.rtol == 2e-3 and len(amp) == 3
    else:
        assert record.tolerance.rtol != 2e-3 and not amp
""")
    default = pytester.runpytest("--npu-parity", "--collect-only", "-q")  # one in-process run trains (torch._dynamo)
    default.stdout.fnmatch_lines(["*test_proj[[]fp32[]]", "*test_proj[[]bf16[]]", "*test_step[[]fp32[]]",
                                  "*test_step[[]bf16[]]", "4 tests collected*"])  # fp16 is opt-in
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp16", "--parity-policy", "golden")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*recipes fp16*", "*verdicts fp16 golden rmse<=2*"])
    assert "WARNING [NPU]" not in result.stdout.str() and "launcher" not in result.stdout.str()  # a CPU target


@pytest.mark.parametrize("ini, message", [
    ("parity_fp32_policy = goldne", "*ini parity_fp32_policy: verdict policy 'goldne'*expected 'allclose', 'golden*"),
    ("parity_policies =\n    proj golden", "*ini parity_policies: line 'proj golden' needs*"),
    ("parity_policies =\n    proj: golden rmse=0.5", "*ini parity_policies:*rmse_ratio=0.5*must be >= 1*"),
])
def test_bad_policy_ini_is_a_usage_error(pytester: pytest.Pytester, ini: str, message: str) -> None:
    pytester.makeini("[pytest]\n" + ini + "\n")
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_golden_fallback_is_listed_in_the_summary(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
import torch

def test_f(parity):
    parity.check("f", lambda x: (x * 2).to(torch.float32), torch.linspace(-1, 1, 10))
""")
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32", "--parity-policy", "golden")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["verdicts: 1 by allclose",
                                 "*check 'f' (fp32): golden unavailable, judged by allclose: the golden run returned float32*"])


def test_ini_bf16_policy_also_covers_bf16_weights(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nparity_bf16_policy = golden\n")
    pytester.makepyfile(LINEAR_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32,bf16,bf16-weights")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*verdicts fp32 allclose rtol=1e-05 atol=1e-05 budget=0 (training checks: golden floor*) · bf16 golden rmse<=2 "
                                 "max_rel<=10 mean_rel<=2 small<=2 · bf16-weights golden rmse<=2*"])


def test_marker_policy_of_the_wrong_type_is_an_error_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("""
import pytest, torch

@pytest.mark.parity(policy=True)
def test_x(parity):
    parity.check("x", lambda t: t * 2, torch.ones(3))
""")
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32")
    # Caught at collection, before any test runs, naming the test and the keyword.
    result.stderr.fnmatch_lines(["ERROR: @pytest.mark.parity: bad arguments",
                                 "  test_marker_policy_of_the_wrong_type_is_an_error_naming_the_test.py::test_x[[]fp32]: "
                                 "policy=True must be a non-empty string"])
    assert result.ret == pytest.ExitCode.USAGE_ERROR


# ini parity_deepspeed_config: the DeepSpeed config lint at start-up


def test_deepspeed_config_findings_are_in_the_header_and_warnings(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    pytester.makefile(".json", ds='{"bf16": {"enabled": false}, "fp16": {"enabled": true}, '
                                  '"communication_backend": "hccl"}')
    pytester.makeini("[pytest]\nparity_deepspeed_config = ds.json\n")
    result = pytester.runpytest("--npu-parity", "--parity-device", "cpu", "--parity-dtypes", "fp32")
    result.stdout.fnmatch_lines([
        "npu-parity: DeepSpeed config ds.json: 3 error(s), 0 warning(s) (bf16.enabled, fp16.enabled, "
        "communication_backend); see the warnings summary",
        "*PytestConfigWarning: parity_deepspeed_config error: ds.json: communication_backend is not a DeepSpeed "
        "config field and is silently ignored*",
    ])
    assert result.ret == pytest.ExitCode.OK  # advice on a training config, not a parity failure


def test_clean_deepspeed_config_says_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(LINEAR_TEST)
    pytester.makefile(".json", ds='{"bf16": {"enabled": true}, "fp16": {"enabled": false}}')
    pytester.makeini("[pytest]\nparity_deepspeed_config = ds.json\n")
    result = pytester.runpytest("--npu-parity", "--parity-device", "cpu", "--co")
    result.stdout.fnmatch_lines(["npu-parity: DeepSpeed config ds.json: follows the guide's rules*"])
    assert "PytestConfigWarning" not in result.stdout.str()


@pytest.mark.parametrize("content", [None, "{oops"])
def test_unreadable_deepspeed_config_is_a_usage_error(pytester: pytest.Pytester, content) -> None:
    pytester.makepyfile(LINEAR_TEST)
    if content is not None:
        pytester.makefile(".json", ds=content)
    pytester.makeini("[pytest]\nparity_deepspeed_config = ds.json\n")
    result = pytester.runpytest("--npu-parity", "--parity-device", "cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini parity_deepspeed_config: DeepSpeed config *ds.json *"])


RECIPE_MODELS = """
import pytest
import torch
from torch import nn


def test_lstm(parity):
    torch.manual_seed(0)
    parity.check("lstm", nn.LSTM(8, 16, batch_first=True).eval(), torch.randn(2, 5, 8))


def test_masked_encoder(parity):
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2).eval()
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    parity.check("encoder", encoder, torch.randn(2, 5, 16), src_key_padding_mask=mask)


@pytest.mark.parity(recipes=["fp32"])
def test_masked_encoder_fp32_only(parity):
    test_masked_encoder(parity)
"""


def test_an_op_a_recipe_cannot_run_is_one_sentence_and_the_marker_fixes_it(pytester: pytest.Pytester) -> None:
    """nn.LSTM runs under CPU bf16 autocast (torch 2.5.1 and 2.14.1 measured); the masked
    nn.TransformerEncoder's nested-tensor fast path raises under it on torch 2.14.1 ("expected scalar
    type Float but found BFloat16") and is shimmed on 2.5.1 (see recipes.py)."""
    from cpu_features import runs_bf16_lstm
    from pytest_npu_parity.recipes import cpu_autocast_breaks_encoder_fast_path

    pytester.makepyfile(test_user_recipes=RECIPE_MODELS)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32,bf16")
    lstm_fails = not runs_bf16_lstm()  # a CPU without oneDNN's bf16 RNN (tests/cpu_features.py)
    if lstm_fails:
        result.stdout.fnmatch_lines(["FAILED test_user_recipes.py::test_lstm[[]bf16[]] - pytest_npu_parity.recipes.Reci*"])
    if cpu_autocast_breaks_encoder_fast_path():  # torch 2.5.1: the shim runs it
        result.assert_outcomes(passed=5 - lstm_fails, failed=int(lstm_fails))
        return
    result.assert_outcomes(passed=4 - lstm_fails, failed=1 + lstm_fails)
    result.stdout.fnmatch_lines([
        "E * pytest_npu_parity.recipes.RecipeUnsupportedError: torch._transformer_encoder_layer_fwd in layers.0 "
        "(TransformerEncoderLayer) (at torch/nn/modules/transformer.py:*) cannot run on cpu under recipe bf16 *"
        "(RuntimeError: expected scalar type Float but found BFloat16); run the test only under the recipes that "
        "work with @pytest.mark.parity(recipes=[[]\"fp32\"[]]) on it, or select them for the session with "
        "--parity-dtypes fp32.",
    ])
    result.stdout.fnmatch_lines(["FAILED test_user_recipes.py::test_masked_encoder[[]bf16[]]*"])
    # the backend's own error is kept as the cause, shown above it
    result.stdout.fnmatch_lines(["*RuntimeError: expected scalar type Float but found BFloat16",
                                 "*The above exception was the direct cause of the following exception:*"])


def test_tracebacks_show_the_model_not_the_plugins_runner(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_broken_model="""
        import torch

        class Broken(torch.nn.Module):
            def forward(self, x):
                return x @ torch.ones(3, 3, device=x.device)  # shapes do not match

        def test_broken(parity):
            parity.check("broken", Broken(), torch.ones(2, 4))
    """)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32")
    result.assert_outcomes(failed=1)
    failures = result.stdout.str().split("= FAILURES =")[1].split("= npu-parity")[0]
    assert "runner.py:" not in failures and "pytest_npu_parity/" not in failures, failures  # no frame of the plugin
    result.stdout.fnmatch_lines(['>       parity.check("broken", Broken(), torch.ones(2, 4))',
                                 ">       return x @ torch.ones(3, 3, device=x.device)  # shapes do not match",
                                 "E       RuntimeError: mat1 and mat2 shapes cannot be multiplied (2x4 and 3x3)"])


def test_summary_names_a_patch_override_and_no_aurora_version(pytester: pytest.Pytester, monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "aurora", raising=False)  # other tests of this process may have imported it
    pytester.makepyfile(BROKEN_TARGET.replace("y[1, 2] += 2 * (1e-5 + 1e-5 * abs(float(y[1, 2])))", "pass"))
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32", "--parity-report=rep")
    result.assert_outcomes(passed=2)
    summary = (pytester.path / "rep" / "summary.md").read_text()
    assert "Patch set: `test_summary_names_a_patch_override_and_no_aurora_version.parity_patches.corrupt`." in summary
    assert "aurora_model" not in summary and " torch threads" in summary


SAMPLER_TEST = """
import pytest
import torch

SCALE = 1.0


class Sampler(torch.nn.Module):
    def forward(self, x, num_samples=48):
        noise = torch.randn(x.shape[0], num_samples, x.shape[1], device=x.device)
        return torch.tanh(x.unsqueeze(1) + SCALE * noise)


@pytest.fixture
def parity_patches():
    import contextlib

    @contextlib.contextmanager
    def patches(device):
        global SCALE
        SCALE = float(__import__("os").environ.get("SAMPLER_FAULT", "1.0"))
        try:
            yield
        finally:
            SCALE = 1.0
    return patches


def test_draws(parity):
    x = torch.linspace(-1, 1, 24).reshape(4, 6)
    parity.check("draws", Sampler(), x, sample_dim=1)
"""


def test_parity_rng_device_judges_sampling_checks_as_distributions(pytester: pytest.Pytester, monkeypatch) -> None:
    pytester.makepyfile(SAMPLER_TEST)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32", "--parity-rng", "device")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "npu-parity: random streams: sampling checks draw from each side's own device generator *distribution "
        "alpha=0.001 permutations=1999*",
        "verdicts: 1 by distribution alpha=0.001 permutations=1999 (distribution: sampling checks *)",
    ])
    monkeypatch.setenv("SAMPLER_FAULT", "1.5")
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32", "--parity-rng", "device")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Parity check 'draws' failed as a distribution*", "*most significant: spread*"])
    # the default shared stream: the same test compares the draws one by one
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Mismatched elements*"])


def test_bad_ini_parity_rng_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nparity_rng = cpu\n")
    pytester.makepyfile(SAMPLER_TEST)
    result = pytester.runpytest("--npu-parity")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini parity_rng='cpu': use shared or device*"])


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_bad_ini_parity_lock_timeout_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    pytester.makeini(f"[pytest]\nparity_lock_timeout = {value}\n")
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest("--npu-parity")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*ini parity_lock_timeout='{value}': give seconds, a finite number >= 0*"])

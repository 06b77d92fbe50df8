"""Failure diagnosis through pytest: the localization budget and its options, and a suite whose
model changed for every check reported once, before the failures, with the one command that fixes it."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pytester_helpers import edit_module

# pytester forgets modules first imported during an in-process run; import what every run needs once.
import hypothesis  # noqa: F401
import pytest_npu_parity.npu  # noqa: F401
import pytest_npu_parity.runner  # noqa: F401

# A seeded two-layer net. SEED draws its weights (changing it makes every module baseline stale);
# FAULT scales the first layer's weight on the target side only (a port bug).
SUITE = """
import contextlib

import pytest
import torch

SEED = 0
FAULT = 1.0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.fixture
def net():
    torch.manual_seed(SEED)
    return Net().eval()


@pytest.fixture
def parity_patches(net):
    @contextlib.contextmanager
    def fault(device):
        saved = net.a.weight.detach().clone()
        with torch.no_grad():
            net.a.weight.mul_(FAULT)
        try:
            yield
        finally:
            with torch.no_grad():
                net.a.weight.copy_(saved)
    return fault


X = torch.linspace(-1, 1, 40).reshape(5, 8)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_net(parity, net, k):
    parity.check("net", net, X * k)


def test_layer_a(parity, net):
    parity.check("layer_a", net.a, X, submodule="a")


def test_layer_b(parity, net):
    with torch.no_grad():
        h = torch.tanh(net.a(X))
    parity.check("layer_b", net.b, h, submodule="b")


def test_tanh(parity):
    parity.check("tanh", torch.tanh, X)
"""


def _project(pytester: pytest.Pytester) -> Path:
    pytester.makeini("""
        [pytest]
        parity_dtypes = fp32
    """)
    suite = pytester.path / "parity_suites" / "demo"
    suite.mkdir(parents=True)
    module = suite / "test_diag.py"
    module.write_text(textwrap.dedent(SUITE))
    return module




FIRST_ID = "parity_suites/demo/test_diag.py::test_layer_a[fp32]"


def test_a_spent_budget_is_said_once_in_the_summary_with_the_command(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    edit_module(module, "FAULT = 1.0", "FAULT = 1.001")
    result = pytester.runpytest("--npu-parity", "--parity-reference=cpu", "--parity-localize-budget=0", "parity_suites")
    result.assert_outcomes(failed=4, passed=2)  # test_net x3 and test_layer_a; layer_b and tanh are clean
    result.stdout.fnmatch_lines([
        "*First-divergence localization skipped: it would take about * s, more than the 0 s left of this session's "
        "localization budget of 0 s*",
        f"*localization skipped for 4 checks: budget (0 s, --parity-localize-budget); run `pytest --npu-parity "
        f"--parity-localize --parity-reference=cpu '{FIRST_ID.replace('[', '[[]')}'` (or -k NAME --parity-localize) "
        "to see one",
    ])
    assert "First divergence:" not in result.stdout.str()

    forced = pytester.runpytest("--npu-parity", "--parity-reference=cpu", "--parity-localize-budget=0",
                                "--parity-localize", "parity_suites/demo/test_diag.py::test_net[fp32-2]")
    forced.assert_outcomes(failed=1)
    forced.stdout.fnmatch_lines(["*First divergence: a (Linear)*",
                                 "localization: 1 failing check localized in * s (0 answered by an earlier check's descent)"])
    assert "localization skipped" not in forced.stdout.str()


def test_the_default_budget_localizes_and_the_summary_counts(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    edit_module(module, "FAULT = 1.0", "FAULT = 1.001")
    # -rN: with CI set, pytest's short summary repeats each failure's whole message
    result = pytester.runpytest("--npu-parity", "--parity-reference=cpu", "-rN", "parity_suites")
    result.assert_outcomes(failed=4, passed=2)
    out = result.stdout.str()
    assert out.count("First divergence: a (Linear)") == 3  # test_net x3
    assert "the difference starts in a itself" in out  # test_layer_a: a Linear has no submodule calls
    result.stdout.fnmatch_lines(["localization: 4 failing checks localized in * s (* answered by an earlier check's descent)"])


@pytest.mark.parametrize("args, ini, message", [
    (["--parity-localize-budget=abc"], "", "*--parity-localize-budget='abc': give the seconds localization may take*"),
    (["--parity-localize-budget=-1"], "", "*--parity-localize-budget='-1': give the seconds*"),
    ([], "parity_localize_budget = soon", "*ini parity_localize_budget='soon': give the seconds*"),
])
def test_a_bad_budget_is_a_usage_error_naming_the_option(pytester: pytest.Pytester, args, ini, message) -> None:
    pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest("--npu-parity", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_a_model_changed_for_the_whole_suite_is_said_once_with_the_fix(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    assert pytester.runpytest("--update-baselines", "parity_suites").ret == 0
    edit_module(module, "SEED = 0", "SEED = 1")
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(failed=5, passed=1)  # every check of the net is stale; tanh still matches
    out = result.stdout.str()
    # Once, above pytest's failures, with the command that fixes it.
    head = out.index("npu-parity: every baseline of suite 'demo' is stale")
    assert head < out.index("= FAILURES =")
    result.stdout.fnmatch_lines([
        "*= npu-parity: every baseline of suite 'demo' is stale =*",
        "The model's weights changed since its baselines were recorded (recorded on cpu *): 5 checks of 5 tests are "
        "stale; 1 other checks still matched.",
        "Fix it once, on a trusted machine: pytest --update-baselines parity_suites/demo",
    ])
    assert out.count("is stale for check") == 1  # the one example; each failure is one line
    for test in ("test_net[[]fp32-1]", "test_layer_a", "test_layer_b"):
        result.stdout.fnmatch_lines([f"*_ {test}* _*",
                                     "check * (fp32): baseline stale: the model's weights changed for the whole suite "
                                     "'demo'; see 'every baseline of suite 'demo' is stale' above the failures; fix: "
                                     "pytest --update-baselines parity_suites/demo"])
    result.stdout.fnmatch_lines(["baselines not usable: 5 stale",
                                 "  stale  5 checks of suite 'demo': the model's weights changed (see the top of the summary)"])
    assert "re-record them on a trusted machine" not in out


def test_one_stale_check_among_fresh_ones_is_not_suite_wide(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    assert pytester.runpytest("--update-baselines", "parity_suites").ret == 0
    edit_module(module, "X * k)", "X * k * (1.5 if k == 3 else 1))")  # one check's input changes
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(failed=1, passed=5)
    out = result.stdout.str()
    assert "every baseline of suite" not in out and "StaleBaselineError: baseline" in out
    result.stdout.fnmatch_lines(["  stale  parity_suites/demo/test_diag.py::test_net[[]fp32-3] check 'net' *"])


def test_a_configuration_changed_for_the_whole_suite_is_said_once(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    assert pytester.runpytest("--update-baselines", "parity_suites").ret == 0
    # Linear computes the same in training mode, so this is no parity failure; the recorded
    # structure says the model is another one (every module left eval mode)
    edit_module(module, "return Net().eval()", "return Net().train()")
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(failed=5, passed=1)
    result.stdout.fnmatch_lines([
        "*= npu-parity: every baseline of suite 'demo' is stale =*",
        "The model's configuration changed since its baselines were recorded (recorded on cpu *): 5 checks of 5 "
        "tests are stale; 1 other checks still matched.",
        "Fix it once, on a trusted machine: pytest --update-baselines parity_suites/demo",
        "For example, *: baseline * is stale for check *: structure changed (* modules differ, e.g. *eval → train mode*",
    ])
    result.stdout.fnmatch_lines(["  stale  5 checks of suite 'demo': the model's configuration changed (see the top "
                                 "of the summary)"])


def test_a_check_stale_for_its_own_cause_besides_the_suites_is_named_so(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    assert pytester.runpytest("--update-baselines", "parity_suites").ret == 0
    edit_module(module, "SEED = 0", "SEED = 1")  # every check of the net: the weights
    edit_module(module, 'parity.check("tanh", torch.tanh, X)', 'parity.check("tanh", lambda x: torch.tanh(x), X)')
    result = pytester.runpytest("--npu-parity", "parity_suites")
    result.assert_outcomes(failed=6)
    result.stdout.fnmatch_lines([
        "*= npu-parity: every baseline of suite 'demo' is stale =*",
        "The model's weights changed since its baselines were recorded (recorded on cpu *): 6 checks of 6 tests are "
        "stale.",
        "Besides, the checked function's code or closure changed for 1 check.",
        "Fix it once, on a trusted machine: pytest --update-baselines parity_suites/demo",
    ])
    result.stdout.fnmatch_lines(["*_ test_tanh* _*",
                                 "check 'tanh' (fp32): baseline stale: the checked function's code or closure changed "
                                 "(and the whole suite 'demo' is stale: the model's weights changed); see *"])
    # the submodule whose captured input changed with the weights is stale for the suite's cause
    result.stdout.fnmatch_lines(["*_ test_layer_b* _*",
                                 "check 'layer_b' (fp32): baseline stale: the model's weights changed for the whole "
                                 "suite 'demo'; see *"])


def test_a_selection_whose_checked_baselines_are_all_stale_says_only_what_it_checked(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    assert pytester.runpytest("--update-baselines", "parity_suites").ret == 0
    edit_module(module, "SEED = 0", "SEED = 1")
    # -k selects two of the suite's six tests: it said every baseline of the suite was stale and re-recorded it all
    result = pytester.runpytest("--npu-parity", "parity_suites", "-k", "test_layer")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "every baseline of suite 'demo' is stale" not in out
    ids = ("'parity_suites/demo/test_diag.py::test_layer_a[[]fp32]' "
           "'parity_suites/demo/test_diag.py::test_layer_b[[]fp32]'")  # [[] is fnmatch's literal [, quoted by shlex
    result.stdout.fnmatch_lines([
        "*= npu-parity: every baseline of suite 'demo' this run checked is stale =*",
        "The model's weights changed since its baselines were recorded (recorded on cpu *): 2 checks of 2 tests are "
        "stale.",
        "This run did not check * of the suite's * baseline files (a selection): whether they are stale too is not "
        "known.",
        f"Fix it once, on a trusted machine: pytest --update-baselines {ids}",
    ])
    result.stdout.fnmatch_lines(["check * (fp32): baseline stale: the model's weights changed for every checked "
                                 "baseline of suite 'demo'; see 'every baseline of suite 'demo' this run checked is "
                                 f"stale' above the failures; fix: pytest --update-baselines {ids}"])


def test_a_whole_suite_run_is_no_selection_despite_other_recipes_files_and_a_skipped_test(
        pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    assert pytester.runpytest("--update-baselines", "parity_suites").ret == 0
    # the opt-in fp16 recipe's files sit beside them; a default run leaves them alone
    assert pytester.runpytest("--update-baselines", "--parity-dtypes=fp16", "parity_suites").ret == 0
    edit_module(module, "SEED = 0", "SEED = 1")
    edit_module(module, "def test_tanh(parity):\n", "def test_tanh(parity):\n    pytest.skip('needs an NPU')\n")
    result = pytester.runpytest("--npu-parity", "parity_suites")
    out = result.stdout.str()
    assert "this run checked" not in out and "(a selection)" not in out
    result.stdout.fnmatch_lines(["*= npu-parity: every baseline of suite 'demo' is stale =*",
                                 "Fix it once, on a trusted machine: pytest --update-baselines parity_suites/demo"])


def test_a_deleted_tests_leftover_baseline_does_not_make_the_whole_suite_a_selection(pytester: pytest.Pytester) -> None:
    module = _project(pytester)
    assert pytester.runpytest("--update-baselines", "parity_suites").ret == 0
    edit_module(module, "SEED = 0", "SEED = 1")
    edit_module(module, 'def test_tanh(parity):\n    parity.check("tanh", torch.tanh, X)\n', "")  # its file stays
    result = pytester.runpytest("--npu-parity", "parity_suites")
    out = result.stdout.str()
    assert "this run checked" not in out and "(a selection)" not in out
    result.stdout.fnmatch_lines(["*= npu-parity: every baseline of suite 'demo' is stale =*",
                                 "Fix it once, on a trusted machine: pytest --update-baselines parity_suites/demo",
                                 "*1 unused*"])

"""The ``parity_reference_patches`` fixture: what the reference side runs under (and only it), per recipe, named
in the report."""
import pytest

#: The reference patch of both suites below: the reference side's Doubler triples instead of doubling.
TRIPLE = """    @contextlib.contextmanager
    def triple_on_the_reference(device):
        Doubler.factor = 3.0
        try:
            yield
        finally:
            Doubler.factor = 2.0
    return triple_on_the_reference
"""

SUITE = """
import contextlib
import pytest
import torch

class Doubler(torch.nn.Module):
    factor = 2.0
    def forward(self, x):
        return x * Doubler.factor

@pytest.fixture
def parity_reference_patches(parity_recipe):
    if parity_recipe != "bf16":
        return None
""" + TRIPLE + """
@pytest.mark.parity(policy="allclose")  # the golden floor would measure both sides against a float64 run instead
def test_doubler(parity):
    parity.check("doubler", Doubler(), torch.linspace(1, 2, 12).reshape(3, 4))
"""


def test_reference_patches_apply_to_the_reference_side_only_under_their_recipe(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(SUITE)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32,bf16", "--parity-report", "out",
                                "-p", "no:cacheprovider")
    # fp32: no reference patch, both sides double; bf16: the reference triples, the target doubles
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_doubler?bf16?*"])
    assert "test_doubler[fp32]" not in "\n".join(line for line in result.outlines if line.startswith("FAILED"))
    summary = (pytester.path / "out" / "summary.md").read_text()
    assert "Reference side also under: `" in summary and "triple_on_the_reference`." in summary, summary


SHARED = """
import torch

class Doubler(torch.nn.Module):
    factor = 2.0
    def forward(self, x):
        return x * Doubler.factor

MODEL = Doubler()
X = torch.linspace(1, 2, 12).reshape(3, 4)
"""

PLAIN = """
from shared import MODEL, X

def test_plain(parity):
    parity.check("doubler", MODEL, X)
"""

TRIPLED = """
import contextlib
import pytest
from shared import MODEL, X, Doubler

@pytest.fixture
def parity_reference_patches():
""" + TRIPLE + """
def test_tripled_reference(parity):
    parity.check("doubler", MODEL, X)
"""


@pytest.mark.parametrize("order", [("test_plain.py", "test_tripled.py"), ("test_tripled.py", "test_plain.py")])
def test_a_live_reference_is_not_shared_across_reference_patches(pytester: pytest.Pytester, order) -> None:
    """One module, input and check name in two tests, one of them with reference patches: each test's reference
    runs under its own patches, in either order (the session's live-reference memo must not hand the first
    test's reference to the second)."""
    pytester.makepyfile(shared=SHARED, test_plain=PLAIN, test_tripled=TRIPLED)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32", "-p", "no:cacheprovider", *order)
    result.assert_outcomes(passed=1, failed=1)
    failed = [line for line in result.outlines if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_tripled.py::test_tripled_reference" in failed[0], failed


def test_one_factory_definition_over_the_same_values_is_one_memo_key() -> None:
    """The suite's fixture returns a fresh ``lambda device: ...`` per test: those are one patch set in the memo
    key; a factory over other values is another."""
    from pytest_npu_parity.checks.reference import reference_patches_key

    def fixture(value):
        return lambda device: value

    shared = object()
    assert reference_patches_key(fixture(shared)) == reference_patches_key(fixture(shared))
    assert reference_patches_key(fixture(shared)) != reference_patches_key(fixture(object()))
    assert reference_patches_key(None) == ()


ODD = """
import contextlib
import pytest
import torch

@contextlib.contextmanager
def nothing():
    yield

@pytest.fixture
def {fixture}():
    return {value}

def test_linear(parity):
    parity.check("linear", torch.nn.Linear(4, 3), torch.ones(2, 4))
"""


@pytest.mark.parametrize("fixture", ["parity_patches", "parity_reference_patches"])
@pytest.mark.parametrize("value, says", [("nothing()", "returned a context manager (_GeneratorContextManager)"),
                                         ("'fft_bf16_upcast'", "returned str 'fft_bf16_upcast'")])
def test_a_patch_fixture_that_is_no_factory_is_named(pytester: pytest.Pytester, fixture, value, says) -> None:
    """A patch fixture returning a context manager or a name, not a ``(device) -> context manager`` factory: the
    error names the fixture and what it returned, not a bare TypeError from inside a run."""
    pytester.makepyfile(ODD.format(fixture=fixture, value=value))
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "fp32", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*UsageError: *test_linear?fp32?: the {fixture} fixture {says}*"])


def test_a_baseline_recorded_under_reference_patches_says_so_where_it_is_compared(pytester: pytest.Pytester) -> None:
    # bf16 records the tripled reference; against that baseline the doubling target fails, and the report of the
    # compare run names the reference patches the baseline was recorded under (its entry's meta)
    pytester.makepyfile(SUITE)
    record = pytester.runpytest("--npu-parity", "--update-baselines", "--parity-dtypes", "bf16", "-p", "no:cacheprovider")
    record.assert_outcomes(passed=1)
    from safetensors import safe_open
    import json

    [path] = (pytester.path / "baselines").rglob("*.bf16.safetensors")
    with safe_open(str(path), "pt") as f:
        assert "triple_on_the_reference" in json.dumps(f.metadata())
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", "bf16", "--parity-reference", "baseline",
                                "--parity-report", "out", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    summary = (pytester.path / "out" / "summary.md").read_text()
    assert "Reference side also under: `" in summary and "triple_on_the_reference`." in summary, summary

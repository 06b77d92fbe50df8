"""The ``parity_reference_patches`` fixture: what the reference side runs under (and only it), per recipe, named
in the report."""
import pytest

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
    @contextlib.contextmanager
    def triple_on_the_reference(device):
        Doubler.factor = 3.0
        try:
            yield
        finally:
            Doubler.factor = 2.0
    return triple_on_the_reference

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

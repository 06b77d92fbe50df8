"""The session's live-reference and golden memos stay within a test: what a computation reads outside its
fingerprints (a class attribute, a module-level global) can differ between two tests of one module, input
and check name."""
import pytest

SUITE = """
import contextlib
import pytest
import torch
import torch.nn.functional as F

class Attn(torch.nn.Module):
    causal = False  # a class-level switch, set per test

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=type(self).causal)

@pytest.fixture(scope="module")
def model():
    return Attn().eval()

@pytest.fixture
def parity_patches():
    @contextlib.contextmanager
    def drops_is_causal(device):  # the port's bug: the fused kernel ignores is_causal
        original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = lambda q, k, v, is_causal=False, **kw: original(q, k, v, **kw)
        try:
            yield
        finally:
            F.scaled_dot_product_attention = original
    return drops_is_causal

@pytest.mark.parametrize("causal", [False, True])
def test_attn(parity, model, causal):
    Attn.causal = causal
    parity.check("attn", model, torch.ones(1, 5, 8).cumsum(1))
"""


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
def test_a_class_attribute_set_per_test_gets_its_own_reference(pytester: pytest.Pytester, recipe) -> None:
    """The causal test fails whether or not the non-causal one ran before it in the session (it passed
    after it: its reference, and under bf16 its golden, were the non-causal test's, memoized)."""
    pytester.makepyfile(test_attn=SUITE)
    result = pytester.runpytest("--npu-parity", "--parity-dtypes", recipe, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    failed = [line for line in result.outlines if line.startswith("FAILED")]
    assert len(failed) == 1 and f"test_attn[{recipe}-True]" in failed[0], failed
    alone = pytester.runpytest("--npu-parity", "--parity-dtypes", recipe, "-p", "no:cacheprovider", "-k", "True")
    alone.assert_outcomes(failed=1)

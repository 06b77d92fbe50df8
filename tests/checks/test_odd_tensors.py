"""Tensors without a version counter or a storage: a buffer made under ``torch.inference_mode``, a
sparse buffer and a sparse output are fingerprinted, run and compared (they raised a RuntimeError
from the fingerprinting or the judge), and a planted fault in such a model still fails."""
from __future__ import annotations

import pytest
import torch

from pytest_npu_parity.compare import ParityError, compare_tensors
from pytest_npu_parity.judge.tolerance import Tolerance
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytest_npu_parity.store.digests import fingerprint_module
from switches import switched

CPU = torch.device("cpu")
TEST_ID = "parity_suites/demo/test_m.py::t"


class Tabled(torch.nn.Module):
    """A linear layer plus a table buffer (made in inference mode, or sparse); optionally a sparse output."""

    scale = 1.0

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = torch.nn.Linear(4, 4)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g))
        table = torch.arange(4.0)
        if kind == "inference":
            with torch.inference_mode():
                table = table.clone()
        elif kind == "sparse_buffer":
            table = table.to_sparse()
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.table.to_dense() if self.table.is_sparse else self.table
        y = (self.lin(x) + table) * Tabled.scale
        return y.relu().to_sparse() if self.kind == "sparse_output" else y


def target(scale: float):
    return switched(Tabled, "scale", scale)


KINDS = ["inference", "sparse_buffer", "sparse_output"]


def x() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_the_model_is_checked_and_passes(kind, recipe):
    record = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe).check("m", Tabled(kind).eval(), x())
    assert record.status == "pass"


@pytest.mark.parametrize("recipe", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_fault_fails(kind, recipe):
    case = ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, recipe, patches=target(1.01))
    with pytest.raises(ParityError):
        case.check("m", Tabled(kind).eval(), x())


@pytest.mark.parametrize("kind", ["inference", "sparse_buffer"])
def test_the_fingerprint_follows_an_edit_of_such_a_buffer(kind):
    model = Tabled(kind)
    before = fingerprint_module(model)
    assert fingerprint_module(model) == before
    with torch.inference_mode():  # an inference tensor can be changed in place only in inference mode
        if kind == "inference":
            model.table.add_(1)
        else:
            model.table.values().add_(1)
    assert fingerprint_module(model) != before


def test_compare_tensors_takes_a_sparse_tensor_by_its_values_and_names_a_layout_mismatch():
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    tol = Tolerance(rtol=1e-5, atol=1e-5)
    assert compare_tensors(dense.to_sparse(), dense.to_sparse(), tol).passed
    assert not compare_tensors((dense * 1.1).to_sparse(), dense.to_sparse(), tol).passed
    assert compare_tensors(dense.to_sparse(), dense, tol).problem == "layout mismatch: actual sparse_coo vs expected strided"


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_input_is_run_and_compared(layout):
    class SparseMatmul(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.sparse.mm(a, b) * Tabled.scale

    dense = torch.eye(4) * torch.arange(1.0, 5.0)
    a = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    b = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    assert ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32").check("mm", SparseMatmul(), a, b).status == "pass"
    with pytest.raises(ParityError):
        ParityCase(ParitySession(CPU, reference="cpu"), TEST_ID, "fp32", patches=target(1.01)).check("mm", SparseMatmul(), a, b)

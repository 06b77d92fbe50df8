"""Whether a module is already where a run needs it (``runtime.side._on_device``): every parameter and
buffer on the device, and every floating one in the recipe's dtype when one is given."""
from __future__ import annotations

import pytest
import torch

from pytest_npu_parity.runtime.side import _on_device

CPU = torch.device("cpu")


def _net() -> torch.nn.Module:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.BatchNorm1d(4))
    net.register_parameter("unused", None)  # an empty parameter slot
    net.extra = torch.nn.Module()
    net.extra.tied = net[0].weight  # a parameter shared by two modules
    return net


def test_a_module_on_the_device_in_the_dtype_is_there():
    net = _net()
    assert _on_device(net, CPU, None)
    assert _on_device(net, CPU, torch.float32)  # the integer num_batches_tracked buffer has no say
    assert not _on_device(net, CPU, torch.bfloat16)


@pytest.mark.parametrize("where", ["parameter", "buffer", "nested buffer"])
def test_one_tensor_elsewhere_or_in_another_dtype_is_seen(where):
    net = _net()
    if where == "parameter":
        net[0].weight = torch.nn.Parameter(net[0].weight.detach().to("meta"))
    elif where == "buffer":
        net.register_buffer("scale", torch.ones(1, device="meta"))
    else:
        net[1].running_var = net[1].running_var.to("meta")
    assert not _on_device(net, CPU, None)

    net = _net()
    if where == "parameter":
        net[0].weight = torch.nn.Parameter(net[0].weight.detach().double())
    elif where == "buffer":
        net.register_buffer("scale", torch.ones(1, dtype=torch.float64))
    else:
        net[1].running_var = net[1].running_var.double()
    assert _on_device(net, CPU, None)
    assert not _on_device(net, CPU, torch.float32)

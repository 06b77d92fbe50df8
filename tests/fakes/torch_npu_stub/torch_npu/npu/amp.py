"""Stand-in for ``torch_npu.npu.amp``: ``GradScaler`` as in the torch_npu 2.5.1 wheel
(``torch_npu/npu/amp/grad_scaler.py``): a subclass of ``torch.amp.GradScaler`` whose constructor takes
no ``device`` (``init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
dynamic=True, enabled=True``) and whose ``scale`` refuses tensors that are not on the NPU."""
import torch
from torch.amp.grad_scaler import GradScaler as _BaseGradScaler

CREATED = []


class GradScaler(_BaseGradScaler):
    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 dynamic=True, enabled=True):
        super().__init__("npu", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self._dynamic = dynamic
        CREATED.append(self)

    def scale(self, outputs):
        if isinstance(outputs, torch.Tensor) and outputs.device.type != "npu":
            raise ValueError("Device type of outputs should be npu.")
        return super().scale(outputs)

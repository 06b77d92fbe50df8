"""Stand-in for ``torch_npu.contrib.transfer_to_npu``: importing it is the registration (logged)."""
from torch_npu import _events

APPLIED = True
_events.record("transfer_to_npu")

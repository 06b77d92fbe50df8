"""Stand-in for ``torch_npu.contrib.transfer_to_npu``: importing it is the registration."""
APPLIED = True

"""Stand-in for ``torch_npu.contrib``."""

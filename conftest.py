"""Repository-level pytest configuration for pytest-npu-parity's own runs.

The plugin itself is loaded through its ``pytest11`` entry point (``pip install -e .``); nothing
here is needed by users of the plugin.
"""
import os

# Benchmarks are scripts with their own command line, not tests.
collect_ignore = ["benchmarks"]

# This repository's own runs use the Aurora adapter: named here (as PYTEST_PLUGINS names a plugin), the
# doctor and its tests find it whether or not the installed entry-point metadata is current (an
# editable install's entry points are only rewritten by `pip install -e .`). The pytest plugin itself
# loads no adapter (pytest_npu_parity.adapters).
os.environ.setdefault("NPU_PARITY_ADAPTERS", "pytest_npu_parity.aurora.adapter:ADAPTER")

# Parity checks compare bit-for-bit reproducible CPU runs; one intra-op thread count for the whole
# session keeps reductions in one order (results were identical with 1 and 2 threads here, but the
# thread count is part of a CPU baseline's recipe).
os.environ.setdefault("OMP_NUM_THREADS", str(min(2, os.cpu_count() or 1)))

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
# thread count is part of a CPU baseline's recipe). Under pytest-xdist the cores are shared out among the
# workers (`pytest -n 2` on 2 cores: 1 thread each): two workers of 2 OpenMP threads each on 2 cores spin
# against each other, and the tests took 3.3x as long (tests/aurora/test_trajectory_faults.py: 70 s against 22 s).
# A thread count the user set is kept; the marker variable tells a worker that the count came from here.
if "OMP_NUM_THREADS" not in os.environ or os.environ.get("NPU_PARITY_TESTS_THREADS") == os.environ["OMP_NUM_THREADS"]:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    os.environ["OMP_NUM_THREADS"] = os.environ["NPU_PARITY_TESTS_THREADS"] = str(
        max(1, min(2, os.cpu_count() or 1) // _workers))

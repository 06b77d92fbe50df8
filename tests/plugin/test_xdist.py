"""One device per pytest-xdist worker: the pinning rules (pure functions in ``devices``) and ``pytest -n 2``
runs through pytester subprocesses — the merged report of both workers on the CPU, and the pinning of
``--parity-device cuda`` / ``--parity-worker-devices`` on a project whose conftest fakes two CUDA devices.
"""
from __future__ import annotations

import csv
import textwrap

import pytest
import torch

from pytest_npu_parity import devices
from pytest_npu_parity.devices import parse_worker_devices, pinned_device, xdist_worker_index

pytest.importorskip("xdist")


# -- pure rules ----------------------------------------------------------------------------------

@pytest.mark.parametrize("worker_id, index", [("gw0", 0), ("gw7", 7), ("gw12", 12), (None, None), ("", None),
                                              ("master", None)])
def test_xdist_worker_index(worker_id, index):
    assert xdist_worker_index(worker_id) == index


def test_xdist_worker_index_rejects_other_ids():
    with pytest.raises(ValueError, match="worker id 'w3' is not of the form gwN"):
        xdist_worker_index("w3")


def test_parse_worker_devices():
    assert parse_worker_devices("0,2,4,6") == (0, 2, 4, 6)
    assert parse_worker_devices(" 3 ") == (3,)
    assert parse_worker_devices(None) is None and parse_worker_devices("  ") is None
    with pytest.raises(ValueError, match=r"--parity-worker-devices='0,x': 'x' is not a device index"):
        parse_worker_devices("0,x")
    with pytest.raises(ValueError, match="'-1' is not a device index"):
        parse_worker_devices("-1")


@pytest.mark.parametrize("worker, expected", [(0, "npu:0"), (3, "npu:3"), (7, "npu:7"), (8, "npu:0"), (13, "npu:5"),
                                              (None, "npu:0")])
def test_worker_k_runs_on_index_k_mod_device_count(worker, expected):
    assert pinned_device("npu", None, worker, 8) == expected


@pytest.mark.parametrize("worker, expected", [(0, "cuda:0"), (1, "cuda:2"), (3, "cuda:6"), (4, "cuda:0"), (5, "cuda:2")])
def test_a_user_mapping_assigns_entry_k_mod_n(worker, expected):
    assert pinned_device("cuda", None, worker, 8, (0, 2, 4, 6)) == expected


def test_an_explicit_index_and_the_cpu_are_kept_by_every_worker():
    assert [pinned_device("npu", 3, k, 8) for k in range(4)] == ["npu:3"] * 4
    assert [pinned_device("cpu", None, k, 1, (0, 1)) for k in range(3)] == ["cpu"] * 3


def test_bad_pinning_requests_name_the_option():
    with pytest.raises(ValueError, match="cannot be combined with an explicit device index"):
        pinned_device("npu", 3, 1, 8, (0, 1))
    with pytest.raises(ValueError, match="npu index 9 is not visible .only 8 npu device"):
        pinned_device("npu", None, 0, 8, (0, 9))
    with pytest.raises(ValueError, match="no cuda device is visible"):
        pinned_device("cuda", None, 0, 0)


def test_resolve_worker_target_pins_a_fake_cuda_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert devices.resolve_worker_target("cuda", "gw5") == torch.device("cuda", 1)
    assert devices.resolve_worker_target("cuda", None) == torch.device("cuda", 0)
    assert devices.resolve_worker_target("cuda:2", "gw5") == torch.device("cuda", 2)
    assert devices.resolve_worker_target("cuda", "gw1", "3,2") == torch.device("cuda", 2)
    assert devices.resolve_worker_target("cpu", "gw3", "3,2") == torch.device("cpu")
    with pytest.raises(devices.DeviceUnavailableError, match="only 4 cuda"):
        devices.resolve_worker_target("cuda:4", "gw0")


def test_resolve_worker_target_keeps_the_cpu_here():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: auto would not resolve to the CPU")
    assert devices.resolve_worker_target("auto", "gw1") == torch.device("cpu")
    assert devices.resolve_worker_target("cpu", "gw1") == torch.device("cpu")


# -- pytest -n 2 through pytester subprocesses -------------------------------------------------------

SUITE = """
import pytest
import torch

@pytest.mark.parametrize("k", range(6))
def test_scaled_tanh(parity, k):
    parity.check("tanh", torch.tanh, torch.linspace(-2, 2, 10) * (k + 1))
"""


def _project(pytester: pytest.Pytester, conftest: str = "") -> None:
    pytester.makeini("""
        [pytest]
        parity_dtypes = fp32
    """)
    suite = pytester.path / "parity_suites" / "demo"
    suite.mkdir(parents=True)
    (suite / "test_demo.py").write_text(textwrap.dedent(SUITE))
    if conftest:
        (pytester.path / "conftest.py").write_text(textwrap.dedent(conftest))


def test_two_cpu_workers_merge_their_results_into_one_report(pytester: pytest.Pytester):
    _project(pytester)
    report = pytester.path / "report"
    result = pytester.runpytest_subprocess("-n", "2", "--npu-parity", "--parity-device", "cpu", "parity_suites",
                                           "--parity-report", str(report), "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["npu-parity: xdist workers gw0→cpu, gw1→cpu", "*6 checks: 6 pass*",
                                 "*6 passed*"])
    with open(report / "results.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 6 and {row["verdict"] for row in rows} == {"pass"}
    assert {row["worker"] for row in rows} == {"gw0", "gw1"}  # both workers' rows in the one report
    assert {row["target"] for row in rows} == {"cpu"}


FAKE_TWO_GPUS = """
import torch

# Two visible CUDA devices for device selection only: the tests below never run a computation there.
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 2
torch.cuda.get_device_name = lambda device=None: "Fake GPU"
"""

WHERE = """
import os

def test_where_a(parity_session, worker_id):
    with open(os.environ["PINNING_LOG"], "a") as fh:
        fh.write(f"{worker_id} {parity_session.target}\\n")

test_where_b = test_where_c = test_where_d = test_where_a
"""


@pytest.mark.parametrize("args, expected", [
    (["--parity-device", "cuda"], {"gw0 cuda:0", "gw1 cuda:1"}),
    (["--parity-device", "cuda", "--parity-worker-devices", "1,0"], {"gw0 cuda:1", "gw1 cuda:0"}),
    (["--parity-device", "cuda:1"], {"gw0 cuda:1", "gw1 cuda:1"}),
])
def test_each_worker_is_pinned_to_its_device(pytester: pytest.Pytester, monkeypatch, args, expected):
    _project(pytester, conftest=FAKE_TWO_GPUS)
    (pytester.path / "parity_suites" / "demo" / "test_demo.py").write_text(textwrap.dedent(WHERE))
    log = pytester.path / "pinning.log"
    monkeypatch.setenv("PINNING_LOG", str(log))
    # xdist's "load" scheduling hands each of 2 workers 2 of the 4 tests first: both workers report.
    result = pytester.runpytest_subprocess("-n", "2", "--npu-parity", *args, "parity_suites", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    header = ", ".join(sorted(f"{w}→{d}" for w, d in (e.split() for e in expected)))
    result.stdout.fnmatch_lines([f"npu-parity: xdist workers {header}"])
    seen = set(log.read_text().split("\n")) - {""}
    assert seen == expected


def test_a_mapping_beyond_the_visible_devices_is_a_usage_error(pytester: pytest.Pytester):
    _project(pytester, conftest=FAKE_TWO_GPUS)
    result = pytester.runpytest_subprocess("--npu-parity", "--parity-device", "cuda",
                                           "--parity-worker-devices", "0,5", "parity_suites", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--parity-worker-devices=0,5: cuda index 5 is not visible (only 2 cuda device(s)*"])

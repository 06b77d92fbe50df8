"""Tests for pytest_npu_parity.provenance: the provenance record and content fingerprints."""
from __future__ import annotations

import datetime as dt
import gc
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from locations import REPO, TESTS

import pytest_npu_parity
from pytest_npu_parity import provenance as prov_mod
from pytest_npu_parity.store import digests
from pytest_npu_parity.provenance import (
    collect_provenance,
    describe_provenance,
    device_name,
    fingerprint_module,
    fingerprint_tensors,
)


EXPECTED_KEYS = {
    "plugin_version", "torch", "torch_npu", "cann", "transformers", "aurora_model", "python",
    "platform", "threads", "interop_threads", "device_type", "device_name", "recipe", "seed", "precision_flags",
    "created", "git_revision",
}


# --------------------------------------------------------------------------------------------
# collect_provenance


def test_record_has_every_field_and_is_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    prov = collect_provenance(torch.device("cpu"), recipe="bf16", seed=1234,
                              precision_flags={"allow_tf32": False}, extra={"input_spec": {"batch": 2}})
    assert EXPECTED_KEYS <= set(prov)
    assert prov["torch"] == torch.__version__
    assert prov["plugin_version"] == pytest_npu_parity.__version__
    assert prov["device_type"] == "cpu"
    assert prov["recipe"] == "bf16" and prov["seed"] == 1234
    assert prov["precision_flags"] == {"allow_tf32": False}
    assert prov["input_spec"] == {"batch": 2}
    assert json.loads(json.dumps(prov)) == prov


def test_created_is_utc_iso8601_now():
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    prov = collect_provenance("cpu", recipe="fp32", seed=None)
    after = dt.datetime.now(dt.timezone.utc)
    created = dt.datetime.fromisoformat(prov["created"])
    assert created.utcoffset() == dt.timedelta(0)
    assert before <= created <= after


def test_hostname_is_not_recorded():
    host = socket.gethostname()
    prov = collect_provenance("cpu", recipe="fp32", seed=0)
    assert "hostname" not in prov and "host" not in prov
    if len(host) >= 4:
        assert host not in json.dumps(prov)


def test_versions_of_installed_and_absent_packages(monkeypatch):
    import importlib.metadata as md

    real = md.version

    def fake_version(name):
        if name in ("torch-npu", "torch_npu"):
            raise md.PackageNotFoundError(name)
        if name == "aurora-model":
            return "0.2.0-test"
        return real(name)

    monkeypatch.setattr(prov_mod.importlib.metadata, "version", fake_version)
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setitem(sys.modules, "aurora", types.ModuleType("aurora"))  # the run uses Aurora
    prov = collect_provenance("cpu", recipe="fp32", seed=0)
    assert prov["aurora_model"] == "0.2.0-test"
    assert prov["torch_npu"] is None
    assert "torch_npu" not in sys.modules  # never imported to read the version


def test_aurora_version_only_when_the_run_imported_aurora(monkeypatch):
    """A project without Aurora gets no aurora-model version, even with the package installed."""
    import importlib.metadata as md

    real = md.version
    monkeypatch.setattr(prov_mod.importlib.metadata, "version",
                        lambda name: "0.2.0-test" if name == "aurora-model" else real(name))
    monkeypatch.delitem(sys.modules, "aurora", raising=False)
    assert collect_provenance("cpu", recipe="fp32", seed=0)["aurora_model"] is None
    monkeypatch.setitem(sys.modules, "aurora", types.ModuleType("aurora"))
    assert collect_provenance("cpu", recipe="fp32", seed=0)["aurora_model"] == "0.2.0-test"


def test_thread_counts_are_recorded_and_named_for_a_cpu_record():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prov = collect_provenance("cpu", recipe="bf16", seed=0)
    finally:
        torch.set_num_threads(previous)
    assert prov["threads"] == 1 and prov["interop_threads"] == torch.get_num_interop_threads()
    assert "· 1 thread · recipe bf16" in describe_provenance(prov)
    assert "thread" not in describe_provenance({**prov, "device_type": "cuda", "threads": 2})


def test_torch_npu_version_from_loaded_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(__version__="2.5.1.post1"))
    assert collect_provenance("cpu", recipe="fp32", seed=0)["torch_npu"] == "2.5.1.post1"


def test_cann_version_comes_from_npu_module(monkeypatch):
    fake = types.ModuleType("pytest_npu_parity.runtime.npu")
    fake.cann_version = lambda: "8.2.RC1"
    monkeypatch.setitem(sys.modules, "pytest_npu_parity.runtime.npu", fake)
    monkeypatch.setattr(pytest_npu_parity.runtime, "npu", fake, raising=False)  # where runtime.machine reads it
    assert collect_provenance("cpu", recipe="fp32", seed=0)["cann"] == "8.2.RC1"

    def broken():
        raise RuntimeError("no CANN here")

    fake.cann_version = broken
    assert collect_provenance("cpu", recipe="fp32", seed=0)["cann"] is None


def test_extra_that_is_not_json_is_refused_naming_the_key():
    with pytest.raises(TypeError, match="'input_spec'"):
        collect_provenance("cpu", recipe="fp32", seed=0, extra={"input_spec": object()})


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_revision_in_a_repo_and_none_outside(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, env=env)
    (repo / "f.txt").write_text("x")
    subprocess.run(["git", "add", "f.txt"], cwd=repo, check=True, env=env)
    subprocess.run(["git", "commit", "-q", "-m", "init"], cwd=repo, check=True, env=env)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()
    prov_mod._git_state_cached.cache_clear()
    monkeypatch.chdir(repo)
    prov = collect_provenance("cpu", recipe="fp32", seed=0)
    assert prov["git_revision"] == head and prov["git_dirty"] is False
    assert f"git {head[:7]}" in describe_provenance(prov)

    outside = tmp_path / "not_a_repo"
    outside.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    prov_mod._git_state_cached.cache_clear()
    monkeypatch.chdir(outside)
    assert collect_provenance("cpu", recipe="fp32", seed=0)["git_revision"] is None


def test_missing_git_binary_gives_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on PATH
    monkeypatch.chdir(tmp_path)
    prov_mod._git_state_cached.cache_clear()
    try:
        assert collect_provenance("cpu", recipe="fp32", seed=0)["git_revision"] is None
    finally:
        prov_mod._git_state_cached.cache_clear()


# --------------------------------------------------------------------------------------------
# device names


def test_cpu_model_from_x86_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R)  Xeon(R) Platinum 8480+\n\n"
                    "processor\t: 1\nmodel name\t: something else\n")
    assert prov_mod._cpu_model(str(info)) == "Intel(R) Xeon(R) Platinum 8480+"


def test_cpu_model_from_kunpeng_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nBogoMIPS\t: 200.00\nCPU implementer\t: 0x48\nCPU architecture: 8\n"
                    "CPU variant\t: 0x1\nCPU part\t: 0xd01\nCPU revision\t: 0\n")
    assert prov_mod._cpu_model(str(info)) == "HiSilicon Kunpeng-920"


def test_cpu_model_without_cpuinfo_falls_back(tmp_path):
    name = prov_mod._cpu_model(str(tmp_path / "absent"))
    assert isinstance(name, str) and name


def test_cuda_and_backend_device_names(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    assert device_name(torch.device("cuda", 0)) == "NVIDIA H200"
    prov = collect_provenance(torch.device("cuda", 0), recipe="bf16", seed=0)
    assert (prov["device_type"], prov["device_index"], prov["device_name"]) == ("cuda", 0, "NVIDIA H200")
    # other backends (torch.npu once torch_npu is loaded) are read through torch.<type>.get_device_name
    seen = []
    monkeypatch.setattr(torch.xpu, "get_device_name", lambda i: seen.append(i) or "Ascend910B", raising=False)
    assert device_name(torch.device("xpu", 1)) == "Ascend910B" and seen == [1]


def test_unreadable_device_name_never_raises(monkeypatch):
    def broken(_=None):
        raise RuntimeError("driver not loaded")

    monkeypatch.setattr(torch.cuda, "get_device_name", broken)
    assert device_name("cuda:0") == "cuda:0"


def test_ascend_environment_records_numerics_variables_and_only_the_presence_of_locations():
    environ = {"HCCL_TIMEOUT": "1800", "HCCL_BUFFSIZE": "200", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
               "ASCEND_LAUNCH_BLOCKING": "1", "INF_NAN_MODE_ENABLE": "0", "TASK_QUEUE_ENABLE": "2",
               "ASCEND_RT_VISIBLE_DEVICES": "0,1", "ASCEND_HOME_PATH": "/home/alice/Ascend/latest",
               "ASCEND_TOOLKIT_HOME": "/usr/local/Ascend/ascend-toolkit/latest",
               "ASCEND_CUSTOM_OPP_PATH": "/opt/my_ops", "HOME": "/home/alice", "PATH": "/usr/bin",
               "CUDA_VISIBLE_DEVICES": "0", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    recorded = prov_mod.ascend_environment(environ)
    assert recorded == {
        "ASCEND_CUSTOM_OPP_PATH": "<set>", "ASCEND_HOME_PATH": "<set>", "ASCEND_LAUNCH_BLOCKING": "1",
        "ASCEND_RT_VISIBLE_DEVICES": "0,1", "ASCEND_TOOLKIT_HOME": "<set>", "HCCL_BUFFSIZE": "200",
        "HCCL_TIMEOUT": "1800", "INF_NAN_MODE_ENABLE": "0", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "TASK_QUEUE_ENABLE": "2"}
    assert list(recorded) == sorted(recorded) and "alice" not in json.dumps(recorded)
    assert prov_mod.ascend_environment({}) == {}


def test_cpu_and_cuda_records_have_no_npu_fields(monkeypatch):
    monkeypatch.setenv("HCCL_TIMEOUT", "1800")
    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(
        npu=types.SimpleNamespace(is_jit_compile_false=lambda: pytest.fail("the NPU runtime was touched"))))
    for device in ("cpu", "cuda:0"):
        prov = collect_provenance(device, recipe="fp16", seed=0)
        assert "npu_compile_mode" not in prov and "ascend_env" not in prov


def test_npu_compile_mode_reads_torch_npu(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    assert prov_mod.npu_compile_mode() is None
    for jit_false, text in ((True, "jit_compile=False"), (False, "jit_compile=True")):
        monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(
            npu=types.SimpleNamespace(is_jit_compile_false=lambda v=jit_false: v)))
        assert prov_mod.npu_compile_mode() == text

    def broken():
        raise RuntimeError("NPU runtime failed")

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu=types.SimpleNamespace(
        is_jit_compile_false=broken)))
    assert prov_mod.npu_compile_mode() is None


def test_stub_npu_record_has_the_launchers_compile_mode_and_the_ascend_environment(tmp_path):
    spec = importlib.util.spec_from_file_location("npu_parity_fake_env", TESTS / "fakes" / "fake_env.py")
    fake_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake_env)
    site = fake_env.build_site(tmp_path / "site", version=".".join(torch.__version__.split("+")[0].split(".")[:3]))
    code = """
import json, torch
from pytest_npu_parity import npu, provenance
before = provenance.collect_provenance(torch.device("npu", 0), recipe="fp32", seed=0)["npu_compile_mode"]
npu.launch("npu:0")
prov = provenance.collect_provenance(torch.device("npu", 0), recipe="fp16", seed=0)
print(json.dumps({"before": before, "mode": prov["npu_compile_mode"], "env": prov["ascend_env"]}))
"""
    env = fake_env.fake_env(site=site, toolkit=fake_env.TOOLKIT_HOME, HCCL_TIMEOUT="1800",
                            PYTORCH_NPU_ALLOC_CONF="expandable_segments:True", INF_NAN_MODE_ENABLE="1")
    proc = fake_env.run_python(code, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] == "jit_compile=True" and out["mode"] == "jit_compile=False"  # torch_npu's default, then ours
    assert out["env"] == {"ASCEND_TOOLKIT_HOME": "<set>", "HCCL_TIMEOUT": "1800", "INF_NAN_MODE_ENABLE": "1",
                          "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}


# --------------------------------------------------------------------------------------------
# describe_provenance


def test_describe_one_line():
    prov = {"device_type": "npu", "device_name": "Ascend910B", "created": "2026-11-30T09:27:05+00:00",
            "torch": "2.5.1", "torch_npu": "2.5.1.post1", "cann": "8.2.RC1", "recipe": "bf16",
            "git_revision": "ab12cd34ef", "git_dirty": False}
    text = describe_provenance(prov)
    assert text == "npu (Ascend910B) · 2026-11-30 · torch 2.5.1 · torch_npu 2.5.1.post1 · CANN 8.2.RC1 · recipe bf16 · git ab12cd3"
    assert "\n" not in text
    assert describe_provenance({**prov, "git_dirty": True}).endswith("git ab12cd3+dirty")
    assert describe_provenance(None) == "unknown provenance"


def test_describe_cpu_record_names_the_cpu():
    prov = collect_provenance("cpu", recipe="fp32", seed=0)
    text = describe_provenance(prov)
    assert text.startswith(f"cpu ({prov['device_name']}) · {prov['created'][:10]} · torch {torch.__version__}")


# --------------------------------------------------------------------------------------------
# fingerprint_tensors


def _sample():
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(2, 3, generator=g), "mask": torch.tensor([True, False]),
            "h": torch.randn(4, generator=g).to(torch.bfloat16), "n": 3, "scale": 0.5, "name": "co2",
            "none": None, "seq": (torch.arange(3), [1.5, None])}


def test_fingerprint_same_across_processes():
    here = fingerprint_tensors(_sample())
    code = (
        "import sys, torch; sys.path.insert(0, %r); sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
        "from test_provenance import _sample\n"
        "from pytest_npu_parity.provenance import fingerprint_tensors\n"
        "print(fingerprint_tensors(_sample()))\n" % (str(REPO), str(TESTS), str(Path(__file__).resolve().parent))
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=REPO)
    assert out.stdout.strip() == here
    assert len(here) == 64


def test_fingerprint_sees_values_dtype_shape_and_structure():
    t = torch.arange(6, dtype=torch.float32)
    base = fingerprint_tensors([t])
    changed = t.clone()
    changed[3] = torch.nextafter(changed[3], torch.tensor(10.0))
    assert fingerprint_tensors([changed]) != base               # one ulp
    assert fingerprint_tensors([t.to(torch.float64)]) != base    # dtype
    assert fingerprint_tensors([t.reshape(2, 3)]) != base        # shape, same bytes
    assert fingerprint_tensors((t,)) == base                    # tuple and list are both sequences
    assert fingerprint_tensors({"a": t}) != base                # structure
    assert fingerprint_tensors([t, None]) != fingerprint_tensors([None, t])
    assert fingerprint_tensors(torch.tensor(0.0)) != fingerprint_tensors(torch.tensor(-0.0))
    assert fingerprint_tensors(1) != fingerprint_tensors(1.0) != fingerprint_tensors(True)
    assert fingerprint_tensors("1") != fingerprint_tensors(1)


def test_fingerprint_ignores_dict_order_layout_and_autograd():
    a, b = torch.randn(3, 4), torch.randn(2)
    assert fingerprint_tensors({"a": a, "b": b}) == fingerprint_tensors({"b": b, "a": a})
    wide = torch.randn(4, 3)
    assert fingerprint_tensors(wide.t()) == fingerprint_tensors(wide.t().contiguous())
    leaf = a.clone().requires_grad_(True)
    assert fingerprint_tensors(leaf * 1) == fingerprint_tensors(a)
    assert fingerprint_tensors(torch.tensor([1 + 2j]).conj()) == fingerprint_tensors(torch.tensor([1 - 2j]))


def test_fingerprint_bf16_and_numpy():
    import numpy as np

    h = torch.tensor([1.0, 1.0078125, -2.0], dtype=torch.bfloat16)
    assert fingerprint_tensors(h) != fingerprint_tensors(h.float())
    arr = np.arange(5, dtype=np.float32)
    assert fingerprint_tensors(arr) == fingerprint_tensors(torch.from_numpy(arr))


def test_fingerprint_rejects_unknown_objects_naming_the_path():
    with pytest.raises(TypeError, match=r"\['cfg'\]\[1\]"):
        fingerprint_tensors({"cfg": [1, object()]})


def test_fingerprint_and_summary_of_a_key_value_cache_follow_its_tensors():
    cache_utils = pytest.importorskip("transformers.cache_utils")

    def cache(keys: torch.Tensor):
        made = cache_utils.DynamicCache()
        made.update(keys, keys * 2, 0)
        return made

    keys = torch.arange(16.0).reshape(1, 2, 2, 4)
    digest = fingerprint_tensors({"past_key_values": cache(keys)})
    assert digest == fingerprint_tensors({"past_key_values": cache(keys.clone())})  # the contents, not the object
    changed = keys.clone()
    changed[0, 1, 1, 3] += 1
    assert fingerprint_tensors({"past_key_values": cache(changed)}) != digest
    assert fingerprint_tensors({"past_key_values": [keys, keys * 2]}) != digest  # the class name is part of it
    summary = prov_mod.summarize_tensors({"past_key_values": cache(keys)})
    assert [row[0] for row in summary] == [".past_key_values.layers[0].keys", ".past_key_values.layers[0].values"]


# --------------------------------------------------------------------------------------------
# fingerprint_module


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))


def test_module_fingerprint_equal_for_equal_weights_and_differs_otherwise():
    assert fingerprint_module(_mlp(0)) == fingerprint_module(_mlp(0))
    assert fingerprint_module(_mlp(0)) != fingerprint_module(_mlp(1))


def test_module_fingerprint_includes_type_name():
    class MyLinear(torch.nn.Linear):
        pass

    torch.manual_seed(0)
    a = torch.nn.Linear(3, 3)
    b = MyLinear(3, 3)
    b.load_state_dict(a.state_dict())
    assert fingerprint_module(a) != fingerprint_module(b)


def test_module_fingerprint_is_cached_and_invalidated_by_inplace_edits(monkeypatch):
    model = _mlp()
    first = fingerprint_module(model)
    calls = []
    real = digests._feed_tensor
    monkeypatch.setattr(digests, "_feed_tensor", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    assert fingerprint_module(model) == first
    assert calls == []  # served from the cache

    with torch.no_grad():
        model[0].weight[0, 0] += 1.0
    edited = fingerprint_module(model)
    assert edited != first and calls  # recomputed

    calls.clear()
    model.train()
    model(torch.randn(5, 4))  # BatchNorm updates its running stats in place
    assert fingerprint_module(model) != edited and calls

    model.load_state_dict(_mlp().state_dict())
    assert fingerprint_module(model) == first


def test_module_fingerprint_of_meta_module_uses_shapes_only():
    with torch.device("meta"):
        small, also_small, wide = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8), torch.nn.Linear(4, 9)
    assert fingerprint_module(small) == fingerprint_module(also_small)  # no data to read
    assert fingerprint_module(small) != fingerprint_module(wide)


def test_module_cache_does_not_keep_models_alive():
    import weakref

    model = _mlp()
    fingerprint_module(model)
    assert model in prov_mod._MODULE_CACHE
    alive = weakref.ref(model)
    del model
    gc.collect()  # (other tests' dead modules may leave the cache here too: only this one is judged)
    assert alive() is None


def test_module_fingerprint_rejects_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        fingerprint_module({"weight": torch.ones(1)})


def test_parallel_module_hashing_gives_the_serial_digest(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
    monkeypatch.setattr(digests, "PARALLEL_HASH_BYTES", 1)  # force the thread pool
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    parallel = fingerprint_module(model)
    prov_mod._TENSOR_CACHE._data.clear()
    prov_mod._MODULE_CACHE.pop(model)
    monkeypatch.setattr(digests, "PARALLEL_HASH_BYTES", 1 << 60)  # serial
    assert fingerprint_module(model) == parallel
    with torch.no_grad():
        model[3].weight[0, 0] += 1
    assert fingerprint_module(model) != parallel


def test_input_summaries_see_a_row_swap_but_not_last_bit_differences():
    """The order-sensitive component: two swapped rows of 100 in a million elements are a change;
    every element moved by one ULP (activations recomputed on another CPU) is not."""
    from pytest_npu_parity.provenance import summaries_close, summarize_tensors

    x = torch.randn(10_000, 100, generator=torch.Generator().manual_seed(0))
    swapped = x.clone()
    swapped[[17, 9000]] = x[[9000, 17]]
    ulp = torch.nextafter(x, torch.full_like(x, float("inf")))
    recorded = summarize_tensors({"x": x})
    assert summaries_close(recorded, summarize_tensors({"x": ulp})) is None
    why = summaries_close(recorded, summarize_tensors({"x": swapped}))
    assert why is not None and why.startswith("position-weighted sum (the order of its values) of .x differs")
    assert summaries_close(recorded, summarize_tensors({"x": x.flip(0)})) is not None


def test_module_tensor_digests_name_each_weight_and_see_a_row_permutation():
    from pytest_npu_parity.provenance import module_tensor_digests, weights_changed

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    before = module_tensor_digests(layer)
    assert set(before) == {"weight", "bias"} and all(len(d) == 16 for d in before.values())
    with torch.no_grad():
        layer.weight.copy_(layer.weight[[2, 1, 0]])
    now = module_tensor_digests(layer)
    assert now["bias"] == before["bias"] and now["weight"] != before["weight"]
    assert weights_changed(before, now) == "weights changed (1 of 2 tensors differ, e.g. 'weight')"


def test_module_fingerprint_of_a_given_state_dict_is_the_modules_own(monkeypatch):
    model = _mlp()
    assert fingerprint_module(model, model.state_dict(keep_vars=True)) == fingerprint_module(_mlp())
    with torch.no_grad():
        model[0].weight[0, 0] += 1.0  # the cache key (pointer, version, shape, dtype, device) sees the edit
    assert fingerprint_module(model, model.state_dict(keep_vars=True)) != fingerprint_module(_mlp())
    assert fingerprint_module(model.to(torch.float64)) != fingerprint_module(_mlp().to(torch.float64))

"""Repros for an op owner (``--parity-repro DIR``): the culprit's inputs, weights, expected and actual
outputs and a torch-only ``repro.py`` that reproduces the verdict.

Faults are planted on the target side only, through the case's patch factory, as in
tests/diagnose/test_localize.py and tests/diagnose/test_op_trace.py: a Linear weight scaled by 1.001 (the localization
names that Linear; the repro rebuilds ``torch.nn.Linear``), a softmax kernel computing in float16 (the
op trace names ``aten._softmax``; the repro replays that op), and a weight fault in a module that
cannot be rebuilt (its ops are replayed). On this CPU-only machine the faulty target behaviour exists
only under the patch, so each repro is judged twice: (a) the target's stored outputs vs expected (the
recorded verdict: FAIL) and (b) the piece re-run on the CPU, a correct device, vs expected (PASS); a
subprocess with the same fault planted on ``torch.nn.functional.linear`` shows (b) failing, exit 1.
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from pytest_npu_parity.compare import ParityError, compare_tensors
from pytest_npu_parity.localize import Localizer
from pytest_npu_parity.repro import ReproWriter, _script_namespace, repro_dir, sanitize
from pytest_npu_parity.runner import ParityCase, ParitySession
from pytest_npu_parity.selfcheck import scaled_parameter

aten = torch.ops.aten


class Block(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Net(torch.nn.Module):
    def __init__(self, depth: int = 3, width: int = 8):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Attention(torch.nn.Module):
    """Single-head attention: its softmax lives in its own code."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.q = torch.nn.Linear(width, width)
        self.k = torch.nn.Linear(width, width)
        self.v = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(x.shape[-1])
        return self.softmax(scores) @ self.v(x)

    def softmax(self, scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax(scores, dim=-1)


class Scaled(torch.nn.Module):
    """Importable, but its constructor argument ``factor`` is kept under another name."""

    def __init__(self, width: int = 8, factor: float = 1.0):
        super().__init__()
        self.width = width
        self.gain = factor
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w * self.gain)


class _SoftmaxInHalf(TorchDispatchMode):
    """A wrong softmax kernel on the target: computes in float16 inside."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._softmax.default:
            with _disable_current_modes():
                x, dim, _ = args
                return func(x.half(), dim, False).to(x.dtype)
        return func(*args, **kwargs)


def _session(writer: ReproWriter) -> ParitySession:
    return ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[Localizer(None), writer],
                         recipe_policies={"fp32": "allclose"})


def _fail(case: ParityCase, *args) -> str:
    with pytest.raises(ParityError) as info:
        case.check(*args)
    return str(info.value)


def _run_script(folder: Path, *argv: str) -> tuple[int, str]:
    """``main(argv)`` of the folder's repro.py, loaded in this process (no new interpreter): (exit code, output)."""
    import contextlib as _c
    import io

    out = io.StringIO()
    with _c.redirect_stdout(out):
        code = _script_namespace(folder / "repro.py")["main"](list(argv))
    return code, out.getvalue()


def _verdicts(output: str) -> list[str]:
    return re.findall(r"verdict: (PASS|FAIL)", output)


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


# Run in a fresh interpreter (-I: no PYTHONPATH, no user site) where importing pytest_npu_parity or
# safetensors fails: repro.py once as it is, then once more with the weight fault planted on
# torch.nn.functional.linear (the faulty device); the process exits with the second run's code.
GUARD = """
import runpy, sys
sys.modules["pytest_npu_parity"] = None  # any import of it raises ImportError
sys.modules["safetensors"] = None
script = sys.argv[1]


def run():
    sys.argv = [script]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        return exc.code
    return None


print("CLEAN EXIT", run())
import torch.nn.functional as F
linear = F.linear
F.linear = lambda x, w, b=None: linear(x, w * 1.001, b)
code = run()
print("IMPORTED", sorted(m for m in sys.modules if m.startswith(("pytest_npu_parity", "safetensors"))
                         and sys.modules[m] is not None))
sys.exit(code)
"""


def test_a_scaled_linear_weight_gives_a_repro_that_reproduces_the_verdict(tmp_path, net, x):
    writer = ReproWriter(tmp_path / "repros")
    case = ParityCase(_session(writer), "tests/t.py::test_net[fp32]",
                      patches=lambda device: scaled_parameter(net, "blocks.1.b.weight", 1.001))
    message = _fail(case, "net", net, x)
    folder = repro_dir(tmp_path / "repros", "tests/t.py::test_net[fp32]", "net")
    assert folder == tmp_path / "repros" / "tests_t.py_test_net_fp32" / "net"
    assert f"Repro for the op owner: {folder}" in message
    assert writer.written == {("tests/t.py::test_net[fp32]", "net"): str(folder)}
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "actual.safetensors", "expected.safetensors",
                                                        "inputs.safetensors", "repro.py", "weights.safetensors"]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # the temporary folder is gone

    # The culprit is the planted Linear, rebuilt from torch.nn with its reference (unscaled) weights.
    readme = (folder / "README.md").read_text()
    assert "**Piece:** blocks.1.b" in readme and "`torch.nn.modules.linear.Linear`" in readme
    assert "rtol=1e-05 atol=1e-05 budget=0" in readme and f"torch {torch.__version__}" in readme
    assert "replayed on the CPU while this repro was written: PASS" in readme
    weights = load_file(folder / "weights.safetensors")
    assert torch.equal(weights["weight"], net.blocks[1].b.weight.detach())  # not the target's scaled copy
    # Its input is what the target gave blocks.1.b: tanh(blocks.1.a(blocks.0(x))), before the fault.
    with torch.no_grad():
        h = torch.tanh(net.blocks[1].a(net.blocks[0](x)))
    assert torch.equal(load_file(folder / "inputs.safetensors")["args.0"], h)
    expected, actual = load_file(folder / "expected.safetensors"), load_file(folder / "actual.safetensors")
    with torch.no_grad():
        assert torch.equal(expected["output"], net.blocks[1].b(h))
        assert torch.equal(actual["output"], torch.nn.functional.linear(h, net.blocks[1].b.weight * 1.001,
                                                                        net.blocks[1].b.bias))

    # A fresh interpreter with torch only: (a) the recorded verdict FAILs, (b) the replay on the CPU PASSes
    # (exit 0); with the fault planted on the replaying device (b) FAILs too and the exit code is 1.
    guard = tmp_path / "guard.py"
    guard.write_text(GUARD)
    run = subprocess.run([sys.executable, "-I", str(guard), str(folder / "repro.py")], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    clean, faulty = run.stdout.split("CLEAN EXIT")
    assert _verdicts(clean) == ["FAIL", "PASS"] and faulty.startswith(" 0\n")
    assert _verdicts(faulty) == ["FAIL", "FAIL"] and "IMPORTED []" in faulty
    # The script's metrics are the project's (compare.compare_tensors) on the stored tensors.
    leaf = compare_tensors(actual["output"], expected["output"], case.records[-1].tolerance)
    line = next(l for l in clean.splitlines() if "FAIL  max_abs" in l)
    assert f"max_abs={leaf.max_abs:.6g} " in line and f"rel_l2={leaf.rel_l2:.6g} " in line
    assert f"mismatched={leaf.mismatched}/{leaf.numel} " in line and f"err/tol={leaf.err_ratio:.3g}" in line
    assert _run_script(folder, "--recorded-only")[0] == 1


def _spec(folder: Path) -> dict:
    return json.loads(re.search(r'SPEC = json.loads\(r"""(.*?)"""\)', (folder / "repro.py").read_text(), re.S)[1])


def test_a_bf16_check_rebuilds_its_module_under_the_recipe_autocast(tmp_path, net, x):
    writer = ReproWriter(tmp_path)
    session = ParitySession(torch.device("cpu"), reference="cpu", failure_hooks=[Localizer(None), writer],
                            recipe_policies={"bf16": "allclose"})
    case = ParityCase(session, "t::bf16", "bf16",
                      patches=lambda device: scaled_parameter(net, "blocks.1.b.weight", 1.05))
    _fail(case, "net", net, x)
    folder = repro_dir(tmp_path, "t::bf16", "net")
    spec = _spec(folder)
    # Without the autocast the rebuilt Linear would compute in float32, not reproduce the reference
    # bitwise, and the repro would fall back to an op replay.
    assert spec["mode"] == "module" and spec["module"]["autocast"] == "bfloat16"
    assert load_file(folder / "expected.safetensors")["output"].dtype == torch.bfloat16
    code, out = _run_script(folder)
    assert code == 0 and _verdicts(out) == ["FAIL", "PASS"] and "rtol=0.001 atol=0.001" in out


def test_a_wrong_softmax_kernel_gives_an_op_repro_with_its_golden(tmp_path):
    torch.manual_seed(0)
    attn = Attention().eval()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    writer = ReproWriter(tmp_path)
    case = ParityCase(_session(writer), "t::softmax", patches=lambda device: _SoftmaxInHalf())
    _fail(case, "attn", attn, x)
    folder = repro_dir(tmp_path, "t::softmax", "attn")
    spec = _spec(folder)
    assert spec["mode"] == "ops" and [op["op"] for op in spec["ops"]] == [["aten", "_softmax", "default"]]
    assert "the op trace named aten._softmax.default" in (folder / "README.md").read_text()
    assert not (folder / "weights.safetensors").exists()
    inputs, expected = load_file(folder / "inputs.safetensors"), load_file(folder / "expected.safetensors")
    with torch.no_grad():  # the softmax's input as the target computed it
        scores = attn.q(x) @ attn.k(x).transpose(-1, -2) / 4.0
    torch.testing.assert_close(inputs["arg.0"], scores, rtol=0, atol=1e-6)
    assert torch.equal(expected["output"], torch.softmax(inputs["arg.0"], -1))
    assert expected["golden.output"].dtype == torch.float64
    code, out = _run_script(folder)
    assert code == 0 and _verdicts(out) == ["FAIL", "PASS"] and "float64 golden of the op" in out
    assert _run_script(folder, "--recorded-only")[0] == 1


@contextlib.contextmanager
def _half_softmax_code():
    """A code fault on the target: Attention's own code computes its softmax in float16 and back."""
    original = Attention.softmax
    Attention.softmax = lambda self, scores: torch.softmax(scores.half(), dim=-1).to(scores.dtype)
    try:
        yield
    finally:
        Attention.softmax = original


def test_a_code_fault_replayed_as_ops_fails_on_a_correct_device_too(tmp_path):
    torch.manual_seed(0)
    attn = Attention().eval()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    writer = ReproWriter(tmp_path)
    _fail(ParityCase(_session(writer), "t::code", patches=lambda device: _half_softmax_code()), "attn", attn, x)
    folder = repro_dir(tmp_path, "t::code", "attn")
    readme = (folder / "README.md").read_text()
    # Attention would rebuild from its class, but that class's code is not what the target ran.
    assert ("cannot be rebuilt standalone: the patch set changes what it computes on the target (its ops part "
            "at op #") in readme and "aten._to_copy.default on the target" in readme
    ops = [tuple(op["op"][1:]) for op in _spec(folder)["ops"]]
    assert ops.count(("_to_copy", "default")) == 2 and ("_softmax", "default") in ops  # the half round trip
    # The recorded ops ask for the float16 softmax: the CPU replays the fault, so the cause is the
    # piece's code, not a device kernel, and the README says so.
    assert "FAIL — the replayed computation itself differs from the reference's" in readme
    code, out = _run_script(folder)
    assert code == 1 and _verdicts(out) == ["FAIL", "FAIL"]


def test_a_module_that_cannot_be_rebuilt_falls_back_to_its_ops_and_says_why(tmp_path, x):
    class Local(torch.nn.Module):  # defined in a function: no import path reaches it
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))

        def forward(self, h):
            return torch.tanh(h * self.w + 1)

    torch.manual_seed(0)
    for culprit, why in ((Local(), "is defined inside a function, so no import path reaches it"),
                         (Scaled(factor=2.0), "computes another output than the reference's")):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), culprit, torch.nn.Linear(8, 2)).eval()
        writer = ReproWriter(tmp_path)
        test_id = f"t::{type(culprit).__name__}"
        case = ParityCase(_session(writer), test_id, patches=lambda device: scaled_parameter(model, "1.w", 1.001))
        _fail(case, "model", model, x)
        folder = repro_dir(tmp_path, test_id, "model")
        readme = (folder / "README.md").read_text()
        assert "**Piece:** 1 " in readme
        assert f"cannot be rebuilt standalone: " in readme and why in readme, readme
        assert "aten op(s) replayed in order" in readme
        assert set(load_file(folder / "weights.safetensors")) == {"w"}
        code, out = _run_script(folder)
        assert code == 0 and _verdicts(out) == ["FAIL", "PASS"], out
        assert _run_script(folder, "--recorded-only")[0] == 1


def test_a_passing_check_writes_no_repro(tmp_path, net, x):
    writer = ReproWriter(tmp_path / "repros")
    ParityCase(_session(writer), "t::clean").check("net", net, x)
    assert not (tmp_path / "repros").exists() and writer.written == {}


def test_a_function_check_says_why_it_has_no_repro(tmp_path, x):
    writer = ReproWriter(tmp_path)
    case = ParityCase(_session(writer), "t::fn", patches=lambda device: _SoftmaxInHalf())
    message = _fail(case, "softmax", torch.softmax, x, -1)
    assert "No repro written: the check runs a function, not a module" in message
    assert writer.written == {}


def test_folder_names_are_safe_and_a_file_is_refused(tmp_path):
    assert sanitize("a/b.py::test_x[fp32-1]") == "a_b.py_test_x_fp32-1"
    long = sanitize("t::" + "x" * 300)
    assert len(long) == 100 and re.fullmatch(r"t_x+-[0-9a-f]{8}", long)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file; give a folder"):
        ReproWriter(tmp_path / "file")


SUITE = """
import contextlib

import pytest
import torch

FAULT = 1.001


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.fixture
def net():
    torch.manual_seed(0)
    return Net().eval()


@pytest.fixture
def parity_patches(net):
    @contextlib.contextmanager
    def fault(device):
        saved = net.a.weight.detach().clone()
        with torch.no_grad():
            net.a.weight.mul_(FAULT)
        try:
            yield
        finally:
            with torch.no_grad():
                net.a.weight.copy_(saved)
    return fault


X = torch.linspace(-1, 1, 40).reshape(5, 8)


def test_net(parity, net):
    parity.check("net", net, X)


def test_tanh(parity):
    parity.check("tanh", torch.tanh, X)
"""


def test_the_plugin_writes_repros_and_the_report_names_them(pytester: pytest.Pytester) -> None:
    import pandas as pd

    pytester.makeini("[pytest]\nparity_dtypes = fp32\n")
    pytester.makepyfile(test_suite=textwrap.dedent(SUITE))
    result = pytester.runpytest("--npu-parity", "--parity-reference=cpu", "--parity-repro=repros",
                                "--parity-report=rep", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1)
    folder = pytester.path / "repros" / "test_suite.py_test_net_fp32" / "net"
    result.stdout.fnmatch_lines([f"*Repro for the op owner: {folder} (python {folder / 'repro.py'} --device*"])
    assert (folder / "repro.py").exists() and "**Piece:** a " in (folder / "README.md").read_text()
    assert "--parity-localize" in (folder / "README.md").read_text()  # the command that reruns the check
    assert [p.name for p in (pytester.path / "repros").iterdir()] == ["test_suite.py_test_net_fp32"]
    rows = pd.read_csv(pytester.path / "rep" / "results.csv")
    by_check = {check: set(group["repro"].dropna()) for check, group in rows.groupby("check")}
    assert by_check == {"net": {str(folder)}, "tanh": set()}


def test_a_file_as_repro_folder_is_a_usage_error_naming_the_option(pytester: pytest.Pytester) -> None:
    (pytester.path / "taken").write_text("")
    result = pytester.runpytest("--npu-parity", "--parity-repro=taken")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--parity-repro=taken: is a file, not a directory; pick another path*"])

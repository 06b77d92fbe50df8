"""Goldens stored with the baseline (``checks.stored_golden``): a recording under a golden verdict stores
its golden, a compare run against it runs none and reaches the live golden's verdict; an entry without
one falls back to the live golden with a note; a damaged one is an error."""
from __future__ import annotations

import contextlib
import json

import pytest
import torch
from safetensors import safe_open

from pytest_npu_parity import golden as G
from pytest_npu_parity.baselines import CheckBaseline, CorruptBaselineError, SuiteStores
from pytest_npu_parity.checks import stored_golden as S
from pytest_npu_parity.compare import ParityError
from pytest_npu_parity.runner import ParityCase, ParitySession
from test_runner import X, Proj, TinyNet, target_patch

CPU = torch.device("cpu")
TEST_ID = "tests/test_stored_golden.py::t"
TRAIN_INPUTS = {"x": X, "y": torch.linspace(-1, 1, 32)}


class Counting(G.GoldenRunner):
    """A golden runner that counts its golden runs, or raises on one (``forbid``)."""

    def __init__(self, forbid: bool = False):
        super().__init__()
        self.forbid = forbid
        self.runs = 0
        self._depth = 0

    def run(self, fn, args=(), kwargs=None, **kw):
        if self.forbid:
            raise AssertionError("a golden computation ran")
        self.runs += self._depth == 0  # the dtype tries inside one run are not counted again
        self._depth += 1
        try:
            return super().run(fn, args, kwargs, **kw)
        finally:
            self._depth -= 1


def record(baselines, recipe: str, what: str, module, inputs, **kwargs) -> dict:
    """Record one check (``check`` or ``train_step``) into ``baselines``; the stored baseline."""
    session = ParitySession(CPU, update_baselines=True, store=baselines, **kwargs.pop("session", {}))
    case = ParityCase(session, TEST_ID, recipe)
    if what == "train_step":
        case.train_step("step", module, inputs, **kwargs)
    else:
        case.check("proj", module, inputs, **kwargs)
    assert case.finish() in ("created", "changed")
    return baselines.load(TEST_ID)


def compare_run(baselines, recipe: str, what: str, module, inputs, runner=None, patches=None, **kwargs):
    """A compare run of the recorded check against ``baselines``; the record, or the ParityError."""
    session = ParitySession(CPU, store=baselines, golden_runner=runner or Counting(forbid=True),
                            **kwargs.pop("session", {}))
    case = ParityCase(session, TEST_ID, recipe, patches=patches)
    try:
        if what == "train_step":
            return case.train_step("step", module, inputs, **kwargs)
        return case.check("proj", module, inputs, **kwargs)
    except ParityError as exc:
        exc.record = case.records[-1]
        return exc


def without_stored_golden(baselines) -> None:
    """Rewrite the test's baseline as a recording made before goldens were stored."""
    baseline = baselines.load(TEST_ID)
    for entry in baseline.checks.values():
        entry.meta.pop(S.META_KEY, None)
        entry.extras = {k: v for k, v in entry.extras.items() if not k.startswith(S.GOLDEN_PREFIX)}
    baselines.write(TEST_ID, baseline.checks, baseline.provenance)


def ratios(result) -> dict:
    return {leaf.path: (leaf.passed, dict(getattr(leaf, "ratios", {}) or {})) for leaf in result.result.leaves}


# --------------------------------------------------------------------------------------------------


def test_a_recording_stores_the_golden_it_computed_and_a_compare_run_runs_none(tmp_path):
    store = SuiteStores(tmp_path)
    module = Proj()
    entry = record(store, "bf16", "check", module, X).checks["proj"]
    live = G.GoldenRunner().run(module, (X,), {}, recipe="bf16")
    assert entry.meta["golden"]["dtype"] == "float64" and entry.meta["golden"]["leaves"] == [""]
    assert entry.meta["golden"]["policy"].startswith("golden floor")  # provenance: the policy it was recorded under
    assert torch.equal(entry.extras["golden:"], live[""]) and entry.extras["golden:"].dtype == torch.float64
    runner = Counting(forbid=True)
    result = compare_run(store, "bf16", "check", module, X, runner)
    assert not isinstance(result, Exception), result
    assert result.status == "pass" and result.policy == "golden" and result.reference == "baseline"
    assert {leaf.golden_dtype for leaf in result.result.leaves} == {"float64"}
    assert not result.extra.get("policy_note")


class Spectrum(torch.nn.Module):
    """``rfft(x @ w)``: a complex output, whose float64 golden is complex128 (safetensors has no such dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = Proj()

    def forward(self, x):
        return torch.fft.rfft(self.proj(x), dim=-1)


def test_a_complex_golden_is_stored_as_its_real_view_and_read_back_bitwise(tmp_path):
    # recording a bf16 check with a complex output raised KeyError: torch.complex128 in safetensors' save,
    # so its baseline was never written
    store = SuiteStores(tmp_path)
    module = Spectrum()
    entry = record(store, "bf16", "check", module, X).checks["proj"]
    live = G.GoldenRunner().run(module, (X,), {}, recipe="bf16")
    assert live[""].dtype == torch.complex128
    assert entry.meta["golden"][S.AS_REAL_KEY] == [""]
    source = S.golden_source(store.load(TEST_ID).checks["proj"])
    assert source.kind == "stored" and source.leaves[""].dtype == torch.complex128
    assert torch.equal(source.leaves[""], live[""])
    result = compare_run(store, "bf16", "check", module, X)
    assert not isinstance(result, Exception), result
    assert result.status == "pass" and result.policy == "golden" and not result.extra.get("policy_note")
    # the stored golden keeps its teeth: a 3e-2 weight scale on the target fails as against the live golden
    failed = compare_run(store, "bf16", "check", module, X, patches=target_patch(scale=1 + 3e-2))
    assert isinstance(failed, ParityError), failed


def test_a_complex_golden_stored_as_something_else_is_an_error():
    entry = CheckBaseline("c", {"": torch.zeros(2)}, extras={"golden:": torch.zeros(3)},
                          meta={"golden": {"dtype": None, "leaves": [""], S.AS_REAL_KEY: [""]}})
    with pytest.raises(CorruptBaselineError, match="float64 real view"):
        S.golden_source(entry)


def test_an_allclose_check_stores_no_golden(tmp_path):
    store = SuiteStores(tmp_path)
    entry = record(store, "fp32", "check", Proj(), X).checks["proj"]  # fp32 eval: allclose
    assert "golden" not in entry.meta and not any(k.startswith("golden:") for k in entry.extras)


@pytest.mark.parametrize("what, recipe, scale", [("check", "bf16", 1 + 3e-2), ("train_step", "fp32", 1 + 1e-4)])
def test_the_stored_golden_reaches_the_live_goldens_verdict_on_a_planted_fault(tmp_path, what, recipe, scale):
    # bf16: a 3e-2 weight scale the golden floor fails; fp32 training (golden floor by default): a 1e-4 one.
    store = SuiteStores(tmp_path)
    module = TinyNet() if what == "train_step" else Proj()
    inputs = TRAIN_INPUTS if what == "train_step" else X
    record(store, recipe, what, module, inputs)
    clean = compare_run(store, recipe, what, module, inputs)
    assert not isinstance(clean, Exception) and clean.status == "pass" and clean.policy == "golden"
    stored = compare_run(store, recipe, what, module, inputs, patches=target_patch(scale=scale))
    assert isinstance(stored, ParityError) and "golden policy" in str(stored)
    # the same fault against a live CPU reference and live golden: the same leaves fail with the same ratios
    live = compare_run(store, recipe, what, module, inputs, Counting(), target_patch(scale=scale),
                       session={"reference": "cpu"})
    assert isinstance(live, ParityError)
    assert ratios(stored.record) == ratios(live.record)
    assert not all(passed for passed, _ in ratios(stored.record).values())


def test_a_compact_training_baseline_stores_the_golden_reduced_as_its_leaves(tmp_path):
    store = SuiteStores(tmp_path)
    module = TinyNet()
    entry = record(store, "fp32", "train_step", module, TRAIN_INPUTS, store="summary min_numel=1000 samples=100")
    entry = entry.checks["step"]
    assert "grad.proj.w" in entry.meta["compact"]
    assert {"golden:grad.proj.w@sample", "golden:grad.proj.w@stats"} <= set(entry.extras)
    assert "golden:grad.proj.w" not in entry.extras
    stored = compare_run(store, "fp32", "train_step", module, TRAIN_INPUTS, patches=target_patch(scale=1 + 1e-4))
    without_stored_golden(store)
    live = compare_run(store, "fp32", "train_step", module, TRAIN_INPUTS, Counting(), target_patch(scale=1 + 1e-4))
    assert isinstance(stored, ParityError) and isinstance(live, ParityError)
    assert ratios(stored.record) == ratios(live.record)
    assert S.NOT_STORED in live.record.extra["policy_note"]


def test_an_entry_without_a_stored_golden_runs_the_live_golden_and_says_so(tmp_path):
    store = SuiteStores(tmp_path)
    module = Proj()
    record(store, "bf16", "check", module, X)
    without_stored_golden(store)
    runner = Counting()
    result = compare_run(store, "bf16", "check", module, X, runner)
    assert result.status == "pass" and result.policy == "golden" and runner.runs == 1
    assert result.extra["policy_note"] == S.NOT_STORED


def test_a_live_cpu_reference_runs_the_live_golden_without_a_note(tmp_path):
    runner = Counting()
    session = ParitySession(CPU, reference="cpu", golden_runner=runner)
    result = ParityCase(session, TEST_ID, "bf16").check("proj", Proj(), X)
    assert result.policy == "golden" and runner.runs == 1 and not result.extra.get("policy_note")


def test_a_golden_unavailable_at_recording_is_recorded_and_judged_by_allclose_without_a_run(tmp_path):
    def hard_coded_float32(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).to(torch.float32)

    store = SuiteStores(tmp_path)
    session = ParitySession(CPU, update_baselines=True, store=store, recipe_policies={"fp32": "golden"})
    case = ParityCase(session, TEST_ID, "fp32")
    case.check("f", hard_coded_float32, X)
    case.finish()
    meta = store.load(TEST_ID).checks["f"].meta["golden"]
    assert "float32" in meta["unavailable"] and "leaves" not in meta
    compare = ParitySession(CPU, store=store, recipe_policies={"fp32": "golden"}, golden_runner=Counting(forbid=True))
    result = ParityCase(compare, TEST_ID, "fp32").check("f", hard_coded_float32, X)
    assert result.policy == "allclose" and result.status == "pass"
    assert result.extra["policy_note"].startswith("golden unavailable, judged by allclose:")
    assert "float32" in result.extra["policy_note"]


def test_replayed_inputs_use_the_stored_golden_inputs_beyond_the_draws_run_the_live_one(tmp_path):
    store = SuiteStores(tmp_path)
    module = Proj()
    record(store, "bf16", "check", module, X)
    # another machine's draws (1e-7 of the largest value): the recorded inputs are replayed, the stored golden applies
    drawn = X.clone()
    drawn[0, 0] += 1e-7 * X.abs().max()
    result = compare_run(store, "bf16", "check", module, drawn)
    assert result.status == "pass" and "replayed the recorded inputs" in result.extra["policy_note"]
    # beyond the draws but within the summary rule: run on the current inputs, with a live golden of them
    moved = X.clone()
    moved[0, 0] += 1e-5 * X.abs().max()
    runner = Counting()
    result = compare_run(store, "bf16", "check", module, moved, runner)
    assert result.status == "pass" and runner.runs == 1 and S.OTHER_INPUTS in result.extra["policy_note"]


def test_a_golden_leaf_missing_from_the_entry_is_an_error(tmp_path):
    store = SuiteStores(tmp_path)
    module = Proj()
    baseline = record(store, "bf16", "check", module, X)
    entry = baseline.checks["proj"]
    entry.extras = {k: v for k, v in entry.extras.items() if not k.startswith("golden:")}  # meta still names it
    store.write(TEST_ID, baseline.checks, baseline.provenance)  # a valid checksum: only the golden is gone
    session = ParitySession(CPU, store=store, golden_runner=Counting(forbid=True))
    case = ParityCase(session, TEST_ID, "bf16")
    with pytest.raises(CorruptBaselineError, match="lacks the stored golden of output '' of check 'proj'"):
        case.check("proj", module, X)
    assert case.records[-1].status == "error" and case.records[-1].extra["baseline_error"] == "corrupt"


def test_a_flipped_bit_in_a_stored_golden_fails_the_checksum(tmp_path):
    store = SuiteStores(tmp_path)
    module = Proj()
    record(store, "bf16", "check", module, X)
    path = store.path_for(TEST_ID)
    with safe_open(str(path), framework="pt") as fh:
        key = json.loads(fh.metadata()["checks"])["proj"]["extras"]["golden:"]
    if key.startswith("object:"):  # 4 KiB or more: in the store's object pool, verified by its name
        path, match = store.pool.path_for(key[len("object:"):]), "golden 'golden:' from the object pool, but .* is corrupt"
        key = "tensor"
    else:
        match = "fails its checksum"
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    start = header[key]["data_offsets"][0]
    data[8 + header_len + start + 3] ^= 0x10
    path.write_bytes(bytes(data))
    session = ParitySession(CPU, store=store, golden_runner=Counting(forbid=True))
    with pytest.raises(CorruptBaselineError, match=match):
        ParityCase(session, TEST_ID, "bf16").check("proj", module, X)


def test_golden_source_refuses_a_malformed_record():
    from pytest_npu_parity.baselines import CheckBaseline

    entry = CheckBaseline("c", {"": torch.zeros(2)}, meta={"golden": {"dtype": "float64", "leaves": ["x"]}},
                          extras={"golden:": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(CorruptBaselineError, match="lacks the stored golden of output 'x'"):
        S.golden_source(entry)
    entry.meta["golden"] = "float64"
    with pytest.raises(CorruptBaselineError, match="malformed golden record"):
        S.golden_source(entry)
    assert S.golden_source(None).kind == "live"


def test_the_terminal_summary_counts_the_live_goldens_in_one_line():
    from pytest_npu_parity.plugin.summary import _summarize_policies

    class Lines:
        def __init__(self):
            self.lines = []

        def write_line(self, text):
            self.lines.append(text)

    def row(check, note):
        return {"test_id": "t", "check": check, "recipe": "bf16", "verdict": "pass", "policy": "golden",
                "golden_policy": "golden floor", "policy_note": note}

    tr = Lines()
    _summarize_policies(tr, [row("a", S.NOT_STORED), row("b", S.NOT_STORED), row("c", f"{S.NOT_STORED}; other note"),
                             row("d", None)])
    assert tr.lines[0] == "verdicts: 4 by golden floor"
    assert tr.lines[1] == "  t check 'c' (bf16): other note"
    assert tr.lines[2].startswith("  3 checks computed the golden live: the baseline stores none")
    assert "--parity-store-goldens" in tr.lines[2]
    assert len(tr.lines) == 3
    tr = Lines()  # inputs that are not the recorded bits: the option cannot help, and the line says so
    _summarize_policies(tr, [row("a", S.NOT_STORED), row("b", S.NOT_STORED_OTHER_INPUTS)])
    assert tr.lines[1].startswith("  1 check computed the golden live: the baseline stores none for them (add it")
    assert tr.lines[2].startswith("  1 check computed the golden live: the baseline stores none, and their inputs")
    assert "cannot add it" in tr.lines[2] and len(tr.lines) == 3
    tr = Lines()  # a --parity-store-goldens run stored them
    _summarize_policies(tr, [row("a", S.NOT_STORED)], stored_now=True)
    assert tr.lines[1] == ("  1 check computed the golden live, and it is now stored in their baselines "
                           "(--parity-store-goldens): later compare runs run none")
    tr = Lines()  # one golden the run refused to add (reference_mismatch): its own line, not counted as stored
    refused = f"{S.NOT_ADDED}: the stored reference fails the golden verdict against a live CPU run"
    _summarize_policies(tr, [row("a", S.NOT_STORED), row("b", f"{S.NOT_STORED}; {refused}")], stored_now=True)
    assert tr.lines[1] == f"  t check 'b' (bf16): {refused}"
    assert tr.lines[2].startswith("  1 check computed the golden live, and it is now stored") and len(tr.lines) == 3


# -- --parity-store-goldens: a compare run adds the goldens it computed live ----------------------------


def store_run(baselines, recipe: str, what: str, module, inputs, runner=None, patches=None):
    """A compare run with ``store_goldens`` on, ended as the plugin ends a test; (record or error, status)."""
    session = ParitySession(CPU, store=baselines, golden_runner=runner or Counting())
    session.store_goldens = True
    case = ParityCase(session, TEST_ID, recipe, patches=patches)
    try:
        result = (case.train_step("step", module, inputs) if what == "train_step"
                  else case.check("proj", module, inputs))
    except ParityError as exc:
        exc.record = case.records[-1]
        result = exc
    return result, case.finish(outcome="failed" if isinstance(result, Exception) else "passed")


def reference_bits(baseline) -> dict:
    return {(name, leaf): (t.dtype, tuple(t.shape), bytes(t.contiguous().view(-1).view(torch.uint8).numpy()))
            for name, entry in baseline.checks.items() for leaf, t in entry.tensors.items()}


@pytest.mark.parametrize("what, recipe, scale", [("check", "bf16", 1 + 3e-2), ("train_step", "fp32", 1 + 1e-4)])
def test_store_goldens_adds_the_live_golden_and_keeps_every_reference_bit(tmp_path, what, recipe, scale):
    store = SuiteStores(tmp_path)
    module = TinyNet() if what == "train_step" else Proj()
    inputs = TRAIN_INPUTS if what == "train_step" else X
    recorded = record(store, recipe, what, module, inputs)
    name = next(iter(recorded.checks))
    without_stored_golden(store)
    before = store.load(TEST_ID)
    runner = Counting()
    result, status = store_run(store, recipe, what, module, inputs, runner)
    assert not isinstance(result, Exception) and result.status == "pass" and runner.runs == 1
    assert status == "changed"
    after = store.load(TEST_ID)
    assert reference_bits(after) == reference_bits(before) and reference_bits(after)  # every reference bit kept
    for key in ("input_hash", "config_hash"):
        assert after.checks[name].meta.get(key) == before.checks[name].meta.get(key)
    assert after.provenance["goldens_added"]["recipe"] == recipe
    assert {k: v for k, v in after.provenance.items() if k != "goldens_added"} == before.provenance
    # what was added is what a recording stores
    assert after.checks[name].meta["golden"] == recorded.checks[name].meta["golden"]
    for key, tensor in recorded.checks[name].extras.items():
        if key.startswith(S.GOLDEN_PREFIX):
            assert torch.equal(after.checks[name].extras[key], tensor), key
    # a later compare run runs no golden, and the planted fault still fails with the live golden's ratios
    clean = compare_run(store, recipe, what, module, inputs)
    assert not isinstance(clean, Exception) and clean.status == "pass"
    stored = compare_run(store, recipe, what, module, inputs, patches=target_patch(scale=scale))
    live = compare_run(store, recipe, what, module, inputs, Counting(), target_patch(scale=scale),
                       session={"reference": "cpu"})
    assert isinstance(stored, ParityError) and isinstance(live, ParityError)
    assert ratios(stored.record) == ratios(live.record)
    # a second store run has nothing to add
    assert store_run(store, recipe, what, module, inputs, Counting(forbid=True))[1] is None


def test_store_goldens_stores_a_failing_targets_golden_too(tmp_path):
    store = SuiteStores(tmp_path)
    module = Proj()
    record(store, "bf16", "check", module, X)
    without_stored_golden(store)
    result, status = store_run(store, "bf16", "check", module, X, patches=target_patch(scale=1 + 3e-2))
    assert isinstance(result, ParityError) and status == "changed"  # the golden does not depend on the target
    assert "golden" in store.load(TEST_ID).checks["proj"].meta


def test_store_goldens_adds_nothing_computed_from_other_inputs(tmp_path):
    store = SuiteStores(tmp_path)
    module = Proj()
    record(store, "bf16", "check", module, X)
    without_stored_golden(store)
    moved = X.clone()
    moved[0, 0] += 1e-5 * X.abs().max()  # within the summary rule, beyond the draws: a live golden of other inputs
    result, status = store_run(store, "bf16", "check", module, moved)
    assert not isinstance(result, Exception) and S.NOT_STORED_OTHER_INPUTS in result.extra["policy_note"]
    assert status is None and "golden" not in store.load(TEST_ID).checks["proj"].meta


@pytest.mark.parametrize("what, recipe, changed", [("check", "bf16", 1 + 5e-1), ("train_step", "fp32", 1 + 1e-4)])
def test_store_goldens_adds_no_golden_beside_a_reference_of_another_computation(tmp_path, monkeypatch, what, recipe,
                                                                                changed):
    # The computation changed after the recording where no fingerprint looks (a class attribute its forward
    # reads): the live golden is the new computation's, the stored reference the old one's. Stored together,
    # the golden verdict would let a target differ by the change from then on, with no note.
    store = SuiteStores(tmp_path)
    module = TinyNet() if what == "train_step" else Proj()
    inputs = TRAIN_INPUTS if what == "train_step" else X
    name = next(iter(record(store, recipe, what, module, inputs).checks))
    without_stored_golden(store)
    monkeypatch.setattr(Proj, "scale", changed)  # on both sides, as a code change would be
    result, status = store_run(store, recipe, what, module, inputs)
    record_ = result.record if isinstance(result, ParityError) else result
    assert status is None and S.META_KEY not in store.load(TEST_ID).checks[name].meta  # nothing added
    note = record_.extra["policy_note"]
    assert S.NOT_ADDED in note and "times beyond the golden verdict's" in note and "--update-baselines" in note


def test_store_goldens_adds_the_golden_beside_a_reference_another_machine_computed(tmp_path, monkeypatch):
    # The same computation recorded with another summation order (as another CPU's kernels sum): the stored
    # reference passes against the live run, and the golden is added.
    store = SuiteStores(tmp_path)
    module = Proj()
    with monkeypatch.context() as m:
        m.setattr(Proj, "split", True)
        record(store, "bf16", "check", module, X)
    without_stored_golden(store)
    result, status = store_run(store, "bf16", "check", module, X)
    assert not isinstance(result, Exception) and status == "changed"
    assert S.META_KEY in store.load(TEST_ID).checks["proj"].meta
    assert S.NOT_ADDED not in (result.extra.get("policy_note") or "")


class RunsOnlyPatched(Proj):
    """``Proj`` whose unpatched bf16 (autocast) run raises once ``RunsOnlyPatched.unpatched_ok`` is off (the
    target's patch set turns it back on; the float64 golden still runs): a live CPU run that cannot run, as
    where the recording machine had a bf16 kernel this CPU lacks."""

    unpatched_ok = True

    def forward(self, x):
        if not RunsOnlyPatched.unpatched_ok and torch.is_autocast_enabled("cpu"):  # the bf16 recipe's autocast
            raise RuntimeError("no CPU kernel")
        return super().forward(x)


def test_store_goldens_adds_no_golden_when_the_live_cpu_run_raises(tmp_path, monkeypatch):
    store = SuiteStores(tmp_path)
    module = RunsOnlyPatched()
    record(store, "bf16", "check", module, X)
    without_stored_golden(store)
    monkeypatch.setattr(RunsOnlyPatched, "unpatched_ok", False)

    @contextlib.contextmanager
    def patches(device):
        RunsOnlyPatched.unpatched_ok = True
        try:
            yield
        finally:
            RunsOnlyPatched.unpatched_ok = False

    result, status = store_run(store, "bf16", "check", module, X, patches=patches)
    assert not isinstance(result, Exception) and status is None  # the check is judged; nothing added
    assert f"{S.NOT_ADDED}: checking the stored reference against a live CPU run" in result.extra["policy_note"]
    assert "no CPU kernel" in result.extra["policy_note"]


def test_reference_mismatch_names_the_leaf_and_ratio_and_passes_the_same_computation():
    policy = G.default_golden_for_recipe("fp32")
    x, w = X.double(), Proj().w.detach().double()
    golden = {"": x @ w}
    live = {"": (X @ Proj().w.detach())}
    assert S.reference_mismatch(dict(live), live, golden, None, policy, None, "proj", torch.float32) is None
    stale = {"": X @ (Proj().w.detach() * (1 + 1e-3))}
    why = S.reference_mismatch(stale, live, golden, None, policy, None, "proj", torch.float32)
    assert why.startswith(S.NOT_ADDED) and "limit on leaf '<output>'" in why
    # within the factor: a reference of the same computation accumulated otherwise (in float64, rounded)
    other = {"": golden[""].float()}
    assert not torch.equal(other[""], live[""])
    assert S.reference_mismatch(other, live, golden, None, policy, None, "proj", torch.float32) is None
    # a stored leaf the live run does not have (another output structure): a mismatch whatever the ratios
    why = S.reference_mismatch({"a": live[""]}, live, golden, None, policy, None, "proj", torch.float32)
    assert why is not None and why.startswith(S.NOT_ADDED) and "does not match" in why
    # a NaN the live run does not have: a mismatch (the ratios leave non-finite elements out)
    nan = live[""].clone()
    nan[0, 0] = float("nan")
    why = S.reference_mismatch({"": nan}, live, golden, None, policy, None, "proj", torch.float32)
    assert why is not None and "non-finite" in why
    # an exact output (integers): the live run and the rounded golden have no error, so a last-bit
    # difference of the stored reference is an infinite ratio; within the allclose floor it is left out
    exact = torch.arange(64.0).reshape(8, 8)
    off = exact.clone()
    off[1, 1] = torch.nextafter(off[1, 1], torch.tensor(100.0))
    floor_policy = policy.replace(allclose_floor=True)
    args = ({"": off}, {"": exact}, {"": exact.double()}, None)
    assert S.reference_mismatch(*args, floor_policy, None, "exact", torch.float32) is None
    assert S.reference_multiple(G.judge_golden({"": off}, {"": exact}, {"": exact.double()}, policy,
                                               work_dtype=torch.float32))[0] == float("inf")
    assert S.reference_mismatch(*args, policy, None, "exact", torch.float32) is not None  # no floor: refused
    # a golden of another length (a value-dependent shape, judged by the floor alone): no ratio measures the
    # stored reference, so it is no evidence of the same computation: refused, as a golden of another shape was
    selected = torch.arange(1.0, 9.0)
    multiple, _, where, problem = S.reference_multiple(G.judge_golden(
        {"": selected}, {"": selected}, {"": torch.arange(1.0, 10.0, dtype=torch.float64)}, floor_policy,
        work_dtype=torch.float32))
    assert multiple == float("inf") and problem == "golden shape (9,) differs from the outputs' (8,)"


def test_store_goldens_records_a_golden_that_could_not_run(tmp_path, monkeypatch):
    store = SuiteStores(tmp_path)
    module = Proj()
    record(store, "bf16", "check", module, X)
    without_stored_golden(store)

    class Unavailable(Counting):
        def run(self, *args, **kwargs):
            raise G.GoldenUnavailableError("no float64 kernel for this op")

    result, status = store_run(store, "bf16", "check", module, X, Unavailable())
    assert status == "changed"
    assert store.load(TEST_ID).checks["proj"].meta["golden"]["unavailable"] == "no float64 kernel for this op"
    later = compare_run(store, "bf16", "check", module, X)  # judged by allclose, no golden run
    assert "golden unavailable, judged by allclose: no float64 kernel" in later.extra["policy_note"]

"""How far beyond its verdict's limits is a stored reference, judged against a live run of the same check?

``--parity-store-goldens`` adds a compare run's live golden to a baseline entry that stores none, but not
beside a reference of another computation (``pytest_npu_parity.checks.stored_golden.reference_mismatch``):
the stored reference, as the side under test, is judged against a live CPU run of the check under the
check's golden verdict and the new golden, and the golden is refused when a leaf is more than
``MISMATCH_FACTOR`` times beyond a limit. This script measures that multiple ("times the limit": the
largest ratio / limit over the entry's leaves, a training step's parameters after the step left out, as
the guard leaves them out) for

* references of the **same computation** recorded with another summation order (the first layer's weight
  product computed as four products over K/4 each, summed, as another CPU's kernels would: it differs from
  the single product in the last bits, in fp32 as in bf16): what the factor must leave room for;
* references of a **changed computation**: the first layer's weight scaled by ``1 + change`` after the
  recording, on both sides (a class attribute its forward reads: no fingerprint sees it).

Models: a projection check (``x @ w``, K = 256, bf16 golden verdict) and the training steps of three small
models (tanh MLP, with BatchNorm1d, with MultiheadAttention), fp32 and bf16, over ``--seeds`` input seeds
(inputs scaled by 3). Prints the min / median / max multiple per model, recipe and change.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/store_goldens_guard.py            # about 2 minutes on 2 cores
    python benchmarks/store_goldens_guard.py --seeds 4 --changes 0,1e-3
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pytest_npu_parity.baselines import SuiteStores  # noqa: E402
from pytest_npu_parity.checks import stored_golden as S  # noqa: E402
from pytest_npu_parity.compare import ParityError  # noqa: E402
from pytest_npu_parity.judge import golden as JG  # noqa: E402
from pytest_npu_parity.runner import ParityCase, ParitySession  # noqa: E402

CPU = torch.device("cpu")
TEST_ID = "benchmarks/store_goldens_guard.py::t"


class Proj(torch.nn.Module):
    """``x @ (w * scale)`` (K = 256); ``split`` sums it as four products over 64 of K each."""

    split = False
    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(256, 64, generator=torch.Generator().manual_seed(0)) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w * Proj.scale
        if Proj.split:
            return sum(x[:, i:i + 64] @ w[i:i + 64] for i in range(0, 256, 64))
        return x @ w


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.head = Proj(), torch.nn.Linear(64, 1)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.head(torch.tanh(self.proj(x))).squeeze(-1), y)


class WithBatchNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.lin, self.bn, self.head = Proj(), torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), \
            torch.nn.Linear(64, 1)

    def forward(self, x, y):
        h = self.bn(self.lin(torch.tanh(self.proj(x))))
        return torch.nn.functional.mse_loss(self.head(torch.relu(h)).reshape(-1), y)


class WithAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.mha, self.head = Proj(), torch.nn.MultiheadAttention(64, 4, batch_first=True), \
            torch.nn.Linear(64, 1)

    def forward(self, x, y):
        h = self.proj(x).view(4, 8, 64)
        a, _ = self.mha(h, h, h)
        return torch.nn.functional.mse_loss(self.head(a).reshape(-1), y)


MODELS = {"projection check": Proj, "MLP step": Mlp, "BatchNorm step": WithBatchNorm, "attention step": WithAttention}


def _run(store, recipe: str, model, inputs, *, record: bool):
    session = ParitySession(CPU, update_baselines=record, store=store)
    session.store_goldens = not record
    case = ParityCase(session, TEST_ID, recipe)
    try:
        if isinstance(model, Proj):
            case.check("proj", model, inputs)
        else:
            case.train_step("step", model, inputs)
    except ParityError:
        pass
    case.finish()


def multiple(model_cls, recipe: str, change: float, seed: int, where: Path) -> tuple[float, bool]:
    """``(the stored reference's largest ratio / limit against the live run, whether the golden was refused)``,
    as the store run's guard measures and decides them."""
    g = torch.Generator().manual_seed(300 + seed)
    x = torch.randn(32, 256, generator=g) * 3
    inputs = x if model_cls is Proj else {"x": x, "y": torch.randn(32, generator=g)}
    store = SuiteStores(where)
    Proj.split = True  # the recording machine sums otherwise
    try:
        _run(store, recipe, model_cls(), inputs, record=True)
    finally:
        Proj.split = False
    baseline = store.load(TEST_ID)
    for entry in baseline.checks.values():  # as recorded before goldens were stored
        entry.meta.pop(S.META_KEY, None)
        entry.extras = {k: v for k, v in entry.extras.items() if not k.startswith(S.GOLDEN_PREFIX)}
    store.write(TEST_ID, baseline.checks, baseline.provenance)
    judged = []
    original = JG.judge_golden

    def capture(*args, **kwargs):  # reference_mismatch imports judge_golden when it runs: only it is seen here
        result = original(*args, **kwargs)
        judged.append(result)
        return result

    Proj.scale, JG.judge_golden = 1 + change, capture
    try:
        _run(store, recipe, model_cls(), inputs, record=False)
    finally:
        Proj.scale, JG.judge_golden = 1.0, original
    if not judged:
        raise RuntimeError(f"{model_cls.__name__} ({recipe}): the store run judged no stored reference")
    worst = S.reference_multiple(judged[-1])[0]
    refused = S.META_KEY not in next(iter(store.load(TEST_ID).checks.values())).meta
    return worst, refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--changes", default="0,1e-4,1e-3,1e-2,1e-1")
    args = parser.parse_args(argv)
    changes = [float(c) for c in args.changes.split(",")]
    print(f"MISMATCH_FACTOR = {S.MISMATCH_FACTOR:g}; {args.seeds} seeds; torch {torch.__version__}")
    print(f"{'model':18} {'recipe':6} {'change':>7}  times the limit: min / median / max   refused")
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(sys.stdout):
        for change in changes:
            for name, model_cls in MODELS.items():
                for recipe in ("fp32", "bf16"):
                    if model_cls is Proj and recipe == "fp32":
                        continue  # an fp32 eval check is judged by allclose, not a golden
                    runs = [multiple(model_cls, recipe, change, seed, Path(tmp) / f"{name}-{recipe}-{change}-{seed}")
                            for seed in range(args.seeds)]
                    values, refused = [v for v, _ in runs], sum(r for _, r in runs)
                    print(f"{name:18} {recipe:6} {change:7g}  {min(values):10.3g} / {statistics.median(values):8.3g} / "
                          f"{max(values):8.3g}   {refused}/{len(values)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

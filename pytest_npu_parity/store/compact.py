"""Compact baselines of training steps: large gradient and parameter leaves stored as a sample.

A training step compares every trainable parameter's gradient and value after the step
(``runner.ParityCase.train_step``), so its baseline holds two copies of the model's weights:
torchvision's resnet18 (11.7 M parameters) takes about 90 MB per recipe, more than a repository
wants per test. With the train store ``summary`` (ini ``parity_train_store``, the ``parity``
marker's ``train_store=``, ``train_step(..., store=...)``) each ``grad.<p>`` and ``param.<p>`` leaf
with at least ``min_numel`` elements is recorded as two leaves:

* ``<leaf>@sample`` — the values at ``samples`` flat positions (``sample_indices``): the same
  positions for a leaf of that name and size on every machine, so the target's values at those
  positions are compared element by element under the check's verdict, as a full leaf would be;
* ``<leaf>@stats`` — ``[sum, L2 norm, max |x|, position-weighted sum]`` of the whole leaf
  (``provenance.summarize_tensors``: accumulated in float64, stored as float32 — float64 for a
  float64 leaf; the position-weighted sum ``sum_i w_i x_i`` with ``w_i`` in [-1, 1) a hash of the
  position makes it order-sensitive), so a change anywhere in the leaf, also outside the sample,
  moves the norm or the weighted sum.

The target's (and the golden's) full leaves are reduced the same way before the comparison
(``apply_recorded``), from what the baseline's check record says was compacted (the leaf names,
sizes, shapes and sample size under the metadata key ``compact``), so a baseline recorded with
other settings is compared as it was recorded. Smaller leaves, the loss and the buffers stay
whole. Sample positions: the first ``samples`` distinct values of ``r mod numel`` over the raw
64-bit outputs ``r`` of NumPy's PCG64 bit generator seeded with the first 8 bytes of
SHA-256(``"<leaf>|<numel>"``), sorted ascending (NumPy keeps bit-generator streams stable across
releases; no floating point is involved). With the defaults a resnet18 training-step baseline
drops from about 90 MB to under 2 MB.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: Train stores: ``full`` keeps every leaf whole (the default), ``summary`` compacts large ones.
TRAIN_STORES = ("full", "summary")
#: Leaves with at least this many elements are compacted in ``summary`` mode (default).
DEFAULT_MIN_NUMEL = 65536
#: Sampled positions per compacted leaf (default).
DEFAULT_SAMPLES = 4096
#: Leaf prefixes a train step's compaction applies to.
PREFIXES = ("grad.", "param.")
SAMPLE_SUFFIX = "@sample"
STATS_SUFFIX = "@stats"


@dataclass(frozen=True)
class TrainStore:
    """How a training step's baseline stores its leaves.

    Attributes:
        mode: ``full`` or ``summary`` (module doc).
        min_numel: leaves with at least this many elements are compacted (``summary`` only).
        samples: positions sampled per compacted leaf; must be < ``min_numel``.
        source: where the setting came from (``default``, ``ini``, ``marker``, ``check``).

    Raises:
        ValueError: an unknown mode, or sizes that are not positive integers with
            ``samples < min_numel``.
    """

    mode: str = "full"
    min_numel: int = DEFAULT_MIN_NUMEL
    samples: int = DEFAULT_SAMPLES
    source: str = "default"

    def __post_init__(self) -> None:
        if self.mode not in TRAIN_STORES:
            raise ValueError(f"train store {self.mode!r}: use one of {', '.join(TRAIN_STORES)}")
        for name in ("min_numel", "samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"train store {name}={value!r}: give a positive integer")
        if self.samples >= self.min_numel:
            raise ValueError(f"train store samples={self.samples} must be smaller than min_numel={self.min_numel}")

    def describe(self) -> str:
        if self.mode == "full":
            return "full"
        return f"summary min_numel={self.min_numel} samples={self.samples}"


def parse_train_store(spec: "str | TrainStore | None", *, source: str) -> TrainStore:
    """``"full"``, ``"summary"`` or ``"summary min_numel=65536 samples=4096"`` (a ``# reason`` is
    ignored) as a ``TrainStore``; None or ``""`` is the default (``full``).

    Raises:
        ValueError: an unknown word, key or value (the message names it and the allowed ones).
    """
    if isinstance(spec, TrainStore):
        return spec
    text = (spec or "").partition("#")[0].strip()
    if not text:
        return TrainStore(source="default")
    words = text.split()
    mode, options = words[0], {}
    for word in words[1:]:
        key, eq, value = word.partition("=")
        if not eq or key not in ("min_numel", "samples"):
            raise ValueError(f"train store {text!r}: unknown setting {word!r}; use 'full' or "
                             "'summary [min_numel=N] [samples=K]'")
        try:
            options[key] = int(value)
        except ValueError:
            raise ValueError(f"train store {text!r}: {key}={value!r} is not an integer") from None
    if mode == "full" and options:
        raise ValueError(f"train store {text!r}: 'full' takes no settings")
    return TrainStore(mode, source=source, **options)


def sample_indices(path: str, numel: int, samples: int) -> torch.Tensor:
    """The sorted flat positions (int64, ``samples`` distinct values in ``[0, numel)``) sampled
    from a leaf named ``path`` with ``numel`` elements (module doc: PCG64 raw outputs mod numel).

    Raises:
        ValueError: ``samples`` not in ``[1, numel)``.
    """
    if not 0 < samples < numel:
        raise ValueError(f"cannot sample {samples} of {numel} elements of {path!r}")
    seed = int.from_bytes(hashlib.sha256(f"{path}|{numel}".encode()).digest()[:8], "little")
    bits = np.random.PCG64(seed)
    values = bits.random_raw(2 * samples) % np.uint64(numel)
    head = np.sort(values[:samples])
    if (head[1:] != head[:-1]).all():  # the first ``samples`` draws are distinct: they are the sample
        return torch.from_numpy(head.astype(np.int64))
    _, first = np.unique(values, return_index=True)
    if len(first) >= samples:  # a repeat among them, but the 2 * samples draws hold enough distinct values
        chosen_first = values[np.sort(first)[:samples]]  # the first ``samples`` distinct, in draw order
        return torch.from_numpy(np.sort(chosen_first).astype(np.int64))
    chosen: dict[int, None] = dict.fromkeys(values.tolist())  # all of them: fewer than ``samples``
    while len(chosen) < samples:
        for value in (bits.random_raw(2 * samples) % np.uint64(numel)).tolist():
            chosen.setdefault(int(value))
            if len(chosen) == samples:
                break
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def leaf_stats(tensor: torch.Tensor) -> torch.Tensor:
    """``[sum, L2 norm, max |x|, position-weighted sum]`` of ``tensor`` (float64 accumulation;
    float32 result, float64 for a float64 tensor). See ``provenance.summarize_tensors``."""
    from .summaries import summarize_tensors

    _, _, total, squares, largest, weighted = summarize_tensors(tensor)[0]
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return torch.tensor([total, squares ** 0.5, largest, weighted], dtype=dtype)


def _compact_one(path: str, tensor: torch.Tensor, samples: int) -> dict[str, torch.Tensor]:
    flat = tensor.detach().reshape(-1)
    index = sample_indices(path, flat.numel(), samples)
    return {path + SAMPLE_SUFFIX: flat.index_select(0, index.to(flat.device)).cpu().contiguous(),
            path + STATS_SUFFIX: leaf_stats(tensor)}


def compact_leaves(leaves: dict[str, Any], store: TrainStore) -> tuple[dict[str, Any], dict[str, dict]]:
    """A training step's leaves as ``store`` keeps them in a baseline.

    Args:
        leaves: ``{leaf path: CPU tensor or None}`` (``grad.<p>``, ``param.<p>``, ``buffer.<b>``, ``loss``).
        store: the ``TrainStore``; ``full`` returns ``leaves`` unchanged.

    Returns:
        ``(leaves, compact)``: floating ``grad.*``/``param.*`` leaves with at least
        ``store.min_numel`` elements replaced by their ``@sample`` and ``@stats`` leaves (in place,
        keeping the order), and ``{leaf: {"numel", "shape", "dtype", "samples"}}`` of those leaves —
        the record the baseline's check metadata keeps under ``compact``.
    """
    if store.mode == "full":
        return leaves, {}
    out: dict[str, Any] = {}
    compact: dict[str, dict] = {}
    for path, tensor in leaves.items():
        if (isinstance(tensor, torch.Tensor) and path.startswith(PREFIXES) and tensor.is_floating_point()
                and tensor.numel() >= store.min_numel):
            out.update(_compact_one(path, tensor, store.samples))
            compact[path] = {"numel": int(tensor.numel()), "shape": list(tensor.shape),
                             "dtype": str(tensor.dtype).removeprefix("torch."), "samples": store.samples}
        else:
            out[path] = tensor
    return out, compact


def apply_recorded(leaves: dict[str, Any] | None, compact: dict[str, dict] | None) -> dict[str, Any] | None:
    """Reduce full leaves (the target's, the golden's) the way a baseline recorded them.

    Args:
        leaves: ``{leaf path: tensor or None}`` of a full run, or None.
        compact: the baseline check's ``compact`` record (``compact_leaves``), or None/empty.

    Returns:
        ``leaves`` with every recorded leaf replaced by its ``@sample`` and ``@stats`` leaves. A leaf
        whose size differs from the recorded one is left whole, so the comparison reports it as
        missing/unexpected (the shape changed).
    """
    if not leaves or not compact:
        return leaves
    out: dict[str, Any] = {}
    for path, tensor in leaves.items():
        info = compact.get(path)
        if info is not None and isinstance(tensor, torch.Tensor) and tensor.numel() == info.get("numel"):
            out.update(_compact_one(path, tensor, int(info["samples"])))
        else:
            out[path] = tensor
    return out


def base_leaf(path: str) -> str:
    """The leaf a compacted leaf stands for (``grad.w@sample`` -> ``grad.w``); others unchanged."""
    for suffix in (SAMPLE_SUFFIX, STATS_SUFFIX):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path

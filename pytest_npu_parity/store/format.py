"""The baseline file format's constants, the store's errors and the data classes of a baseline.

Everything the other modules of the store (and the rest of the engine) name when they speak of a
baseline: the format's identity and versions (:data:`FORMAT`, :data:`FORMAT_VERSION`), the layout's
limits and separators, the object pool's constants, the errors (:class:`BaselineError` and its kinds)
and what a loaded baseline is (:class:`CheckBaseline`, :class:`Baseline`). It reads and writes nothing;
the layout and the format are described in :mod:`pytest_npu_parity.store.baselines`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .provenance import describe_provenance

#: Value of the ``format`` metadata field of every baseline file.
FORMAT = "pytest-npu-parity-baseline"
#: Newest version of the layout described in this module's docstring; files with a newer version are
#: refused, files older than :data:`OLDEST_READABLE` are stale (re-record them). Version 2: the checksum covers
#: the metadata. Version 3: a check may hold *extras* (recorded inputs and weights for replay, see
#: ``CheckBaseline.extras``); a version-2 file reads as one without extras. Version 4: extras may live in the
#: store's object pool (:class:`ObjectPool`), referenced as ``"object:<64 hex digits>"``; a version-3 file
#: holds all of them itself and reads unchanged.
FORMAT_VERSION = 4
#: Oldest format version whose check records may reference the object pool.
POOL_VERSION = 4
#: Oldest format version this plugin still reads.
OLDEST_READABLE = 2
#: File suffix of a baseline.
SUFFIX = ".safetensors"
#: Suffixes of files that may hold a pickle; such files are refused, never loaded.
UNSAFE_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".joblib"})
#: Longest path component (characters) before it is shortened and given a hash suffix; leaves
#: room for the temporary-file prefix and suffix within the usual 255-byte name limit.
MAX_COMPONENT = 120
#: Default command suggested to (re-)record a baseline; the test id is appended, shell-quoted.
UPDATE_COMMAND = "pytest --update-baselines"

#: Directory of the object pool under the store root (:class:`ObjectPool`). A dot name: every sanitized
#: suite and module directory starts with another character, so no baseline path can meet it.
OBJECTS_DIR = ".objects"
#: ``format`` metadata of a pool object file.
OBJECT_FORMAT = "pytest-npu-parity-object"
#: Extras (by name prefix) that go to the pool: the replay inputs and weights, which the other recipe's file
#: of the same test and other tests on the same model record again, and the stored goldens: a golden is the
#: float64 run of the check's computation from the same inputs and weights whatever the recipe, so the fp32
#: and bf16 files of a training step hold the same one (gradients and parameters: twice the model).
POOLED_KINDS = ("input:", "weight:", "golden:")
#: A replay extra of fewer bytes stays in the file (deduplicated within it): a pool object costs a file of
#: its own (about 130 bytes of safetensors header, a filesystem block, a git blob), more than it saves.
POOL_MIN_BYTES = 4096
#: Prefix of an extra's key in a check record when the tensor lives in the pool.
OBJECT_REF = "object:"

#: Name of the lock file at the store root that serializes record runs (see :class:`StoreLock`).
LOCK_NAME = ".npu-parity.lock"
#: Suite directory of test ids outside ``parity_suites/`` (:class:`SuiteStores`); a parity suite of
#: that name is stored under a hashed name, so the two never share a file.
ROOTDIR_SUITE = "_rootdir"
#: Separator of test classes and the test name in a file stem (no sanitized name contains it).
CLASS_SEPARATOR = "+"

_TEMP_NAME = re.compile(r"^\..+\.safetensors\.[A-Za-z0-9_]+\.tmp$")
_OBJECT_REF_RE = re.compile(r"^object:([0-9a-f]{64})$")
_OBJECT_NAME = re.compile(r"^[0-9a-f]{62}\.safetensors$")
_DIR_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own upper bound on the JSON header


# --------------------------------------------------------------------------------------------
# errors


class BaselineError(Exception):
    """A baseline cannot be used. ``path`` is the file concerned (also named in the message)."""

    def __init__(self, message: str, path: Path | str | None = None):
        super().__init__(message)
        self.path = Path(path) if path is not None else None


class MissingBaselineError(BaselineError):
    """No baseline file, or no entry for a check in it; the message gives the record command."""


class StaleBaselineError(BaselineError):
    """The baseline was recorded for a different input, model configuration, shape or dtype.

    ``structure_changed`` is True when the module's recorded configuration or structure differs
    (``BaselineStore.check_fresh``; the runner reports that cause as ``config``), ``input_changed``
    when the input is a change (its hash differs and its summary does not agree: not the same
    activations recomputed on another machine).
    """

    structure_changed: bool = False
    input_changed: bool = False


class CorruptBaselineError(BaselineError):
    """The file is truncated, has a bad header, is not safetensors or fails its checksum."""


class UnsafeBaselineError(BaselineError):
    """A pickle-capable file (``.pt``, ``.pth``, ``.bin``, ``.pkl``, ...) or a symbolic link sits
    where a baseline is looked up; it is refused and never loaded."""


class StoreLockedError(BaselineError):
    """Another process holds the store's lock (:class:`StoreLock`) beyond the timeout."""


# --------------------------------------------------------------------------------------------
# data


@dataclass
class CheckBaseline:
    """The stored reference of one check.

    Attributes:
        name: the check name (``"dec_layer_0"``).
        tensors: leaf path (``"logits"``, ``"[0]"``, ``"last_hidden_state[1]"``, ``""`` for a
            bare tensor) -> CPU tensor, any dtype (bfloat16 round-trips bit for bit).
        none_leaves: leaf paths whose reference value was ``None``.
        meta: JSON-serializable facts about the check: ``input_hash`` and ``config_hash`` (see
            :func:`~pytest_npu_parity.store.digests.fingerprint_tensors` /
            :func:`~pytest_npu_parity.store.digests.fingerprint_module`), ``submodule`` and anything
            else the runner records. On write the store sets ``shapes`` (leaf -> list of ints)
            and ``dtypes`` (leaf -> ``"bfloat16"``...) from ``tensors``.
        extras: what the check was computed from, for replay on a machine whose own draws differ
            (``checks.replay``): ``"input:<i>"`` (the i-th tensor leaf of the call's inputs) and
            ``"weight:<state_dict name>"`` -> CPU tensor; and its golden, ``"golden:<leaf path>"``
            (``checks.stored_golden``, described by ``meta["golden"]``). Stored content-addressed (``"@<digest>"``
            keys, one copy per distinct tensor in the file) and covered by the checksum; never
            compared as outputs. Empty in files recorded before format version 3.
    """

    name: str
    tensors: dict[str, torch.Tensor]
    none_leaves: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Baseline:
    """One baseline file as loaded: its path, provenance record and checks by name.

    ``test_id`` is the pytest node id it was recorded for (:meth:`BaselineStore.load` refuses a file
    recorded for another id); ``tensor_hash`` the fingerprint of its tensors, as verified on load.
    """

    path: Path
    provenance: dict
    checks: dict[str, CheckBaseline]
    test_id: str | None = None
    tensor_hash: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        """``"<file> — <device, date, versions>"``, for reports and failure messages."""
        return f"{_show(self.path)} — {describe_provenance(self.provenance)}"


def _show(path: Path | str) -> str:
    """``path`` relative to the working directory when below it, else absolute."""
    path = Path(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------------------
# how a tensor and its dtype are written (the encoding, the object pool and the staleness check share them)


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = t.resolve_conj()
    return t.resolve_neg().to("cpu", copy=True).contiguous()


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")

"""Where baselines live and how they are written, read and judged fresh.

A **baseline** is the reference output of one test, recorded once on a trusted machine (a CUDA
box or the CPU) and compared against the target (the NPU) later, possibly for months. A stale,
corrupt, foreign or silently overwritten baseline is worse than none, so this store refuses to
guess.

Layout
------
One safetensors file per test, named after the pytest node id. :class:`SuiteStores` (what the
plugin uses) puts each test under ``<root>/<suite>/``, the suite being the directory after
``parity_suites/`` (else the first directory of the module path), and drops that prefix::

    parity_suites/aurora/test_layers.py::test_decoder_layer[bf16-batch]
    -> <root>/aurora/test_layers/test_decoder_layer.bf16-batch.safetensors

    parity_suites/aurora/test_model.py::TestTrain::test_step[fp32]
    -> <root>/aurora/test_model/TestTrain/test_step.fp32.safetensors

A plain :class:`BaselineStore` (one suite) keeps the whole module path below ``<root>/<suite>/``
unless given ``module_prefix``. The module path becomes directories (``.py`` dropped), a test class
becomes a directory, and the parametrization (which carries the recipe) follows the test name
after a dot. Every component is sanitized to ``[A-Za-z0-9._-]`` (the test name to
``[A-Za-z0-9_-]``, so the first dot always separates name and parameters); a component that had to
be changed, starts with a dot, or is longer than :data:`MAX_COMPONENT` characters (name and
parameters together, for the file name) gets ``-<10 hex digits of its BLAKE2b>`` appended, so two
different ids never share a file. Ids with a
NUL byte, an absolute module path or a ``..`` segment are rejected, and every path is resolved and
verified to lie under ``<root>/<suite>``.

File format
-----------
Plain safetensors (never pickle), readable with ``safetensors.safe_open`` alone:

* tensors under the key ``"<check>/<leaf path>"`` (``"dec_layer_0/[0]"``,
  ``"model/last_hidden_state"``; the check name alone for a bare-tensor output; ``#2``, ``#3``
  appended on the rare clash) — the authoritative leaf → key map is in the metadata;
* string metadata: ``format`` (:data:`FORMAT`), ``format_version`` (:data:`FORMAT_VERSION`),
  ``test_id``, ``provenance`` (JSON, see :mod:`pytest_npu_parity.provenance`), ``checks`` (JSON:
  ``{check: {"leaves": {leaf: key}, "none_leaves": [...], "meta": {...}}}``, where ``meta``
  holds ``input_hash``, ``config_hash``, ``shapes``, ``dtypes`` and whatever the runner records)
  and ``content_hash`` (BLAKE2b of every tensor's dtype, shape and bytes, checked on every load,
  so a flipped bit in the data region is reported as corruption rather than compared against).

Guarantees
----------
* **Never unpickles.** ``.pt``/``.pth``/``.bin``/``.pkl``/``.pickle``/``.ckpt`` files, and any
  file whose first bytes are a pickle or zip (``torch.save``) header, raise
  :class:`UnsafeBaselineError` without being opened by a loader.
* **Atomic writes.** :meth:`BaselineStore.write` writes a temporary file in the same directory,
  fsyncs it and ``os.replace``-s it over the target. A crash before the rename leaves the old
  baseline intact (and the temporary file is removed on any Python-level error; a killed
  process can leave a ``.<name>.<random>.tmp`` file, ignored by :meth:`~BaselineStore.unused`
  and by the project's ``.gitignore``). Concurrent writers (pytest-xdist workers) each write
  their own temporary file, so the result is always one writer's complete file.
* **No churn.** Writing tensors and check metadata identical to what is stored (bit for bit)
  leaves the file untouched, so provenance dates do not change in git.
* **Loud failures.** Every :class:`BaselineError` names the file; stale and missing baselines
  say what changed and give the exact command to re-record.

Size and speed: a baseline holds only the leaves its checks compare. Loading validates the header
through one descriptor and memory-maps the tensors through the same descriptor with
``safetensors.safe_open`` (so a concurrent replace cannot mix two versions, see :func:`_read`), then
verifies the checksum, which touches every byte once: ``benchmarks/bench_suite.py`` measures the load
throughput of the committed Aurora baselines against reading the same bytes (README, Performance).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .provenance import describe_provenance, summaries_close, fingerprint_tensors

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "SUFFIX",
    "UNSAFE_SUFFIXES",
    "BaselineError",
    "MissingBaselineError",
    "StaleBaselineError",
    "CorruptBaselineError",
    "UnsafeBaselineError",
    "CheckBaseline",
    "Baseline",
    "BaselineStore",
    "SuiteStores",
]

#: Value of the ``format`` metadata field of every baseline file.
FORMAT = "pytest-npu-parity-baseline"
#: Version of the layout described in this module's docstring; files with a newer version are refused.
FORMAT_VERSION = 1
#: File suffix of a baseline.
SUFFIX = ".safetensors"
#: Suffixes of files that may hold a pickle; such files are refused, never loaded.
UNSAFE_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".joblib"})
#: Longest path component (characters) before it is shortened and given a hash suffix; leaves
#: room for the temporary-file prefix and suffix within the usual 255-byte name limit.
MAX_COMPONENT = 120
#: Default command suggested to (re-)record a baseline; the test id is appended, shell-quoted.
UPDATE_COMMAND = "pytest --update-baselines"

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
    """The baseline was recorded for a different input, model configuration, shape or dtype."""


class CorruptBaselineError(BaselineError):
    """The file is truncated, has a bad header, is not safetensors or fails its checksum."""


class UnsafeBaselineError(BaselineError):
    """A pickle-capable file (``.pt``, ``.pth``, ``.bin``, ``.pkl``, ...) sits where a baseline is
    looked up; it is refused and never loaded."""


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
            :func:`~pytest_npu_parity.provenance.fingerprint_tensors` /
            :func:`~pytest_npu_parity.provenance.fingerprint_module`), ``submodule`` and anything
            else the runner records. On write the store sets ``shapes`` (leaf -> list of ints)
            and ``dtypes`` (leaf -> ``"bfloat16"``...) from ``tensors``.
    """

    name: str
    tensors: dict[str, torch.Tensor]
    none_leaves: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


@dataclass
class Baseline:
    """One baseline file as loaded: its path, provenance record and checks by name.

    ``test_id`` is the pytest node id it was looked up by (or recorded for).
    """

    path: Path
    provenance: dict
    checks: dict[str, CheckBaseline]
    test_id: str | None = None

    def describe(self) -> str:
        """``"<file> — <device, date, versions>"``, for reports and failure messages."""
        return f"{_show(self.path)} — {describe_provenance(self.provenance)}"


# --------------------------------------------------------------------------------------------
# store


class BaselineStore:
    """Baselines of one suite under ``<root>/<suite>/`` (layout in the module docstring).

    Args:
        root: the baseline directory (``--baseline-dir``); created on first write.
        suite: the suite name, one path component (``"aurora"``).
        update_command: the command, without the test id, that records a baseline; quoted in
            missing/stale messages (default :data:`UPDATE_COMMAND`).
        module_prefix: leading module-path directories dropped from the file path when a test id
            starts with them (``"parity_suites/aurora"`` gives
            ``<root>/aurora/test_layers/...`` instead of ``<root>/aurora/parity_suites/aurora/
            test_layers/...``); ids without the prefix keep their full module path.

    Raises:
        ValueError: if ``suite`` is empty, ``.``/``..`` or contains a path separator or NUL.
    """

    def __init__(self, root: Path | str, suite: str, *, update_command: str = UPDATE_COMMAND,
                 module_prefix: str = ""):
        if not suite or suite in (".", "..") or any(c in suite for c in "/\\\0"):
            raise ValueError(f"suite name {suite!r} must be a single, plain path component")
        self.root = Path(root).resolve()
        self.suite = suite
        self.suite_dir = self.root / suite
        self.update_command = update_command
        self.module_prefix = [s for s in module_prefix.replace("\\", "/").split("/") if s not in ("", ".")]

    # ---- paths -----------------------------------------------------------------------------

    def path_for(self, test_id: str) -> Path:
        """The baseline file of a pytest node id (absolute; the file need not exist).

        Raises:
            BaselineError: for a NUL byte, an absolute module path or a ``..`` segment in the id,
                or when the resolved path (following symlinks) leaves ``<root>/<suite>``.
        """
        if not isinstance(test_id, str) or not test_id:
            raise BaselineError(f"a baseline needs a non-empty test id, got {test_id!r}")
        if "\0" in test_id:
            raise BaselineError(f"test id {test_id!r} contains a NUL byte; no baseline file can be named after it")
        module, sep, rest = test_id.partition("::")
        if not sep:  # not a pytest node id: one plain name
            module, rest = "", test_id
        module = module.replace("\\", "/")
        if module.startswith("/") or re.match(r"^[A-Za-z]:", module):
            raise BaselineError(
                f"test id {test_id!r} has an absolute module path; baselines are keyed by node ids "
                "relative to the pytest rootdir"
            )
        segments = [s for s in module.split("/") if s not in ("", ".")]
        if ".." in segments:
            raise BaselineError(
                f"test id {test_id!r} has a '..' segment; run pytest from a rootdir that contains "
                "the test files so node ids stay inside it"
            )
        n = len(self.module_prefix)
        if n and segments[:n] == self.module_prefix and len(segments) > n:
            segments = segments[n:]
        if segments and segments[-1].endswith(".py"):
            segments[-1] = segments[-1][: -len(".py")]
        parts = rest.split("::")
        *classes, leaf = parts
        name, param = leaf, None
        bracket = leaf.find("[")
        if bracket > 0 and leaf.endswith("]"):
            name, param = leaf[:bracket], leaf[bracket + 1 : -1]
        dirs = [_sanitize(s, _DIR_UNSAFE) for s in [*segments, *classes]]
        stem = _sanitize(name, _NAME_UNSAFE)
        if param is not None:
            stem += "." + _sanitize(param, _DIR_UNSAFE)
        if len(stem) > MAX_COMPONENT:  # name and parameters together: shorten, keep them apart by hash
            stem = stem[: MAX_COMPONENT - 11] + "-" + _digest(leaf)
        path = self.suite_dir.joinpath(*dirs, stem + SUFFIX)
        self._check_inside(path, f"test id {test_id!r}")
        return path

    def _check_inside(self, path: Path, what: str) -> Path:
        resolved = path.resolve()
        if not resolved.is_relative_to(self.suite_dir.resolve()):
            raise BaselineError(
                f"{what} maps to {resolved}, outside the baseline directory {self.suite_dir}; "
                "remove the symlink or pick another --baseline-dir",
                path,
            )
        return resolved

    # ---- reading ---------------------------------------------------------------------------

    def load(self, test_id: str) -> Baseline | None:
        """Load the baseline of ``test_id``; ``None`` if it has none.

        All tensors are read at once (CPU tensors owning their memory; no file stays open) and
        verified against the stored checksum.

        Raises:
            UnsafeBaselineError: the file, or a file with the same stem and a pickle suffix
                (``test_x.fp32.pt``), is pickle-capable. Nothing is unpickled.
            CorruptBaselineError: truncated, bad header, not safetensors, not a baseline of this
                plugin, or checksum mismatch.
            BaselineError: the file uses a newer format version than this plugin reads.
        """
        path = self.path_for(test_id)
        for suffix in sorted(UNSAFE_SUFFIXES):
            twin = path.with_suffix(suffix)
            if twin.exists():
                raise UnsafeBaselineError(
                    f"refusing {_show(twin)}: pickle-based files can run code when loaded and are "
                    f"never read as baselines; delete it and record a safetensors baseline with: "
                    f"{self.command(test_id)}",
                    twin,
                )
        if not path.exists():
            return None
        baseline = _read(path)
        baseline.test_id = test_id
        return baseline

    def require(self, test_id: str) -> Baseline:
        """Like :meth:`load`, but a missing file raises :class:`MissingBaselineError`."""
        baseline = self.load(test_id)
        if baseline is None:
            raise self.missing_error(test_id)
        return baseline

    def command(self, test_id: str) -> str:
        """The shell command that records the baseline of ``test_id``."""
        return f"{self.update_command} {shlex.quote(test_id)}"

    def missing_error(self, test_id: str) -> MissingBaselineError:
        """The error for a test without a baseline file (for the runner to raise)."""
        path = self.path_for(test_id)
        return MissingBaselineError(
            f"no baseline for {test_id} (looked for {_show(path)}); record it on a trusted "
            f"machine with: {self.command(test_id)}",
            path,
        )

    def check_fresh(
        self,
        baseline: Baseline,
        check: str,
        *,
        input_hash: str,
        config_hash: str,
        shapes: dict[str, tuple] | None = None,
        dtypes: dict[str, torch.dtype | str] | None = None,
        input_summary: list | Callable[[], list] | None = None,
        config_summary: list | Callable[[], list] | None = None,
    ) -> CheckBaseline:
        """Return the stored check if it was recorded for this input and configuration.

        Args:
            baseline: a loaded baseline.
            check: the check name.
            input_hash: fingerprint of the current input (``fingerprint_tensors``).
            config_hash: fingerprint of the current model/config (``fingerprint_module``).
            shapes: optional current output leaf -> shape (``None`` for a ``None`` leaf); any
                added, removed or reshaped leaf makes the baseline stale.
            dtypes: optional current output leaf -> dtype (``torch.bfloat16`` or its name).
            input_summary, config_summary: ``provenance.summarize_tensors``/``summarize_module`` of
                the current input and model. When a hash differs but the recorded summary agrees
                within ``provenance.SUMMARY_RTOL`` (the same data recomputed on another machine,
                differing in last bits), the baseline is fresh and ``meta["bitwise_input"]`` /
                ``meta["bitwise_config"]`` of the returned entry say it was not bit-identical.
                Either may be a callable returning the summary: it is called only when its hash differs.

        Raises:
            MissingBaselineError: the file has no entry for ``check``.
            StaleBaselineError: a hash, leaf set, shape or dtype differs; the message lists each
                difference as recorded vs now, the baseline's provenance and the re-record command.
        """
        test_id = baseline.test_id or str(baseline.path)
        recorded = baseline.checks.get(check)
        if recorded is None:
            have = ", ".join(sorted(baseline.checks)) or "none"
            raise MissingBaselineError(
                f"baseline {baseline.describe()} has no check {check!r} (it has: {have}); "
                f"record it with: {self.command(test_id)}",
                baseline.path,
            )
        meta = dict(recorded.meta)
        changes: list[str] = []
        for key, label, now, summary in (("input_hash", "input", input_hash, input_summary),
                                         ("config_hash", "model config", config_hash, config_summary)):
            before = meta.get(key)
            bitwise_key = "bitwise_" + key.split("_")[0]
            meta[bitwise_key] = before == now
            if before == now:
                continue
            change = f"{label} hash changed (recorded {_short(before)}, now {_short(now)})"
            if callable(summary):
                summary = summary()
            if summary is None:
                changes.append(change)
                continue
            why = summaries_close(meta.get(key.replace("_hash", "_summary")), summary)
            if why is not None:
                changes.append(f"{change}: {why}")
        if shapes is not None:
            was = {leaf: tuple(s) for leaf, s in _recorded_shapes(recorded).items()}
            was.update({leaf: None for leaf in recorded.none_leaves})
            now_shapes = {leaf: (None if s is None else tuple(int(d) for d in s)) for leaf, s in shapes.items()}
            changes += _diff_leaves("shape", was, now_shapes)
        if dtypes is not None:
            was_d = _recorded_dtypes(recorded)
            now_d = {leaf: _dtype_name(d) for leaf, d in dtypes.items() if d is not None}
            changes += _diff_leaves("dtype", was_d, now_d, report_sets=shapes is None)
        if changes:
            raise StaleBaselineError(
                f"baseline {_show(baseline.path)} is stale for check {check!r}: " + "; ".join(changes)
                + f". It was recorded on {describe_provenance(baseline.provenance)}. "
                f"Re-record it on a trusted machine with: {self.command(test_id)}",
                baseline.path,
            )
        return CheckBaseline(name=recorded.name, tensors=recorded.tensors, none_leaves=recorded.none_leaves,
                             meta=meta)

    # ---- writing ---------------------------------------------------------------------------

    def write(self, test_id: str, checks: dict[str, CheckBaseline], provenance: dict) -> str:
        """Record every check of ``test_id`` in its one baseline file.

        The file then holds exactly ``checks`` (a check no longer passed is dropped). Tensors are
        stored as detached, contiguous CPU copies in their own dtype.

        Returns:
            ``"created"`` (no file before), ``"changed"`` (rewritten; also when the old file was
            corrupt or unsafe) or ``"unchanged"`` (identical tensors bit for bit, identical
            ``none_leaves`` and metas: the file is not touched).

        Raises:
            ValueError: a check's ``name`` differs from its key, or a name is empty.
            TypeError: a meta/provenance value is not JSON-serializable, or a leaf is not a tensor.
            BaselineError: the test id cannot be mapped to a file (see :meth:`path_for`).
            OSError: the file cannot be written; the old baseline is then left intact.
        """
        path = self.path_for(test_id)
        tensors, records = _encode_checks(checks)
        content_hash = _content_hash(tensors, records)
        status = "created"
        if path.exists() or path.is_symlink():
            status = "changed"
            try:
                old = _read(path)
            except BaselineError:
                old = None
            if old is not None and _same_content(old, records, content_hash):
                return "unchanged"
        metadata = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "test_id": test_id,
            "provenance": _dumps(provenance, "provenance"),
            "checks": _dumps(records, "check metadata"),
            "content_hash": content_hash,
        }
        from safetensors.torch import save

        data = save(tensors, metadata=metadata)
        _atomic_write(path, data)
        return status

    # ---- housekeeping ----------------------------------------------------------------------

    def baseline_files(self) -> list[Path]:
        """Every ``*.safetensors`` file under ``<root>/<suite>``, sorted."""
        return _baseline_files(self.suite_dir)

    def unused(self, used_paths: set[Path]) -> list[Path]:
        """Baseline files under ``<root>/<suite>`` that are not in ``used_paths`` (sorted).

        Only meaningful after a full, unfiltered run; temporary files are never listed.
        """
        return _unused(self.suite_dir, used_paths)

    def prune(self, paths: list[Path]) -> None:
        """Delete the given baseline files and then-empty directories below ``<root>/<suite>``.

        Raises:
            BaselineError: a path is outside ``<root>/<suite>`` or is not a ``.safetensors``
                file; nothing is deleted then.
        """
        _prune(self.suite_dir, paths)

    def scan_unsafe(self) -> list[Path]:
        """Pickle-capable files under ``<root>/<suite>``: a pickle suffix (:data:`UNSAFE_SUFFIXES`)
        or pickle/zip magic bytes whatever the suffix. Only the first bytes are read."""
        return _scan_unsafe(self.suite_dir)


class SuiteStores:
    """All suites' baselines under one root: routes each test id to its suite's
    :class:`BaselineStore` and offers the same methods.

    The suite of a node id is the directory after ``parity_suites/`` in its module path
    (``parity_suites/aurora/test_layers.py::t`` -> suite ``aurora``, files under
    ``<root>/aurora/test_layers/``); otherwise the first directory of the module path
    (``tests/test_x.py::t`` -> ``<root>/tests/test_x/``); otherwise ``default``.

    Args:
        root: the baseline directory (``--baseline-dir``).
        update_command: as for :class:`BaselineStore`.
    """

    def __init__(self, root: Path | str, *, update_command: str = UPDATE_COMMAND):
        self.root = Path(root).resolve()
        self.update_command = update_command
        self._stores: dict[tuple[str, str], BaselineStore] = {}

    @staticmethod
    def suite_of(test_id: str) -> tuple[str, str]:
        """``(suite, module prefix)`` of a node id, as described in the class docstring."""
        module = test_id.partition("::")[0] if "::" in test_id else ""
        segments = [s for s in module.replace("\\", "/").split("/") if s not in ("", ".")]
        dirs = segments[:-1]
        if ".." in dirs or "\0" in module:
            return "default", ""
        if "parity_suites" in dirs:
            i = dirs.index("parity_suites")
            if i + 1 < len(dirs):
                return _sanitize(dirs[i + 1], _DIR_UNSAFE), "/".join(dirs[: i + 2])
        if dirs:
            return _sanitize(dirs[0], _DIR_UNSAFE), dirs[0]
        return "default", ""

    def store_for(self, test_id: str) -> BaselineStore:
        """The :class:`BaselineStore` that holds ``test_id``'s baseline."""
        key = self.suite_of(test_id)
        if key not in self._stores:
            suite, prefix = key
            self._stores[key] = BaselineStore(self.root, suite, update_command=self.update_command,
                                              module_prefix=prefix)
        return self._stores[key]

    def path_for(self, test_id: str) -> Path:
        """See :meth:`BaselineStore.path_for`."""
        return self.store_for(test_id).path_for(test_id)

    def load(self, test_id: str) -> Baseline | None:
        """See :meth:`BaselineStore.load`."""
        return self.store_for(test_id).load(test_id)

    def require(self, test_id: str) -> Baseline:
        """See :meth:`BaselineStore.require`."""
        return self.store_for(test_id).require(test_id)

    def command(self, test_id: str) -> str:
        """See :meth:`BaselineStore.command`."""
        return self.store_for(test_id).command(test_id)

    def missing_error(self, test_id: str) -> MissingBaselineError:
        """See :meth:`BaselineStore.missing_error`."""
        return self.store_for(test_id).missing_error(test_id)

    def check_fresh(self, baseline: Baseline, check: str, **kwargs: Any) -> CheckBaseline:
        """See :meth:`BaselineStore.check_fresh`."""
        store = self.store_for(baseline.test_id) if baseline.test_id else BaselineStore(
            self.root, "default", update_command=self.update_command)
        return store.check_fresh(baseline, check, **kwargs)

    def write(self, test_id: str, checks: dict[str, CheckBaseline], provenance: dict) -> str:
        """See :meth:`BaselineStore.write`."""
        return self.store_for(test_id).write(test_id, checks, provenance)

    def baseline_files(self) -> list[Path]:
        """Every ``*.safetensors`` file under ``root``, sorted."""
        return _baseline_files(self.root)

    def unused(self, used_paths: set[Path]) -> list[Path]:
        """Baseline files of every suite under ``root`` not in ``used_paths`` (sorted)."""
        return _unused(self.root, used_paths)

    def prune(self, paths: list[Path]) -> None:
        """Delete baseline files below ``root`` (see :meth:`BaselineStore.prune`)."""
        _prune(self.root, paths)

    def scan_unsafe(self) -> list[Path]:
        """Pickle-capable files below ``root`` (see :meth:`BaselineStore.scan_unsafe`)."""
        return _scan_unsafe(self.root)


# --------------------------------------------------------------------------------------------
# helpers


def _show(path: Path | str) -> str:
    """``path`` relative to the working directory when below it, else absolute."""
    path = Path(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _short(value: Any) -> str:
    if value is None:
        return "none"
    text = str(value)
    return text[:12] + "…" if len(text) > 12 else text


def _sanitize(component: str, unsafe: re.Pattern) -> str:
    clean = unsafe.sub("_", component) or "_"
    if clean.startswith("."):
        clean = "_" + clean[1:]
    if clean != component or len(clean) > MAX_COMPONENT:
        clean = clean[: MAX_COMPONENT - 11] + "-" + _digest(component)
    return clean


def _digest(text: str) -> str:
    """10 hex digits of BLAKE2b over ``text``: the suffix that keeps sanitized names distinct."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=5).hexdigest()



def _baseline_files(top: Path) -> list[Path]:
    return sorted(p for p in _walk(top) if p.name.endswith(SUFFIX) and not p.name.startswith("."))


def _unused(top: Path, used_paths: set[Path]) -> list[Path]:
    used = {Path(p).resolve() for p in used_paths}
    return [p for p in _baseline_files(top) if p.resolve() not in used]


def _prune(top: Path, paths: list[Path]) -> None:
    top = top.resolve()
    resolved = []
    for p in paths:
        real = Path(p).resolve()
        if not real.is_relative_to(top) or real == top:
            raise BaselineError(f"refusing to prune {real}: it is outside the baseline directory {top}", real)
        if not real.name.endswith(SUFFIX):
            raise BaselineError(f"refusing to prune {_show(real)}: not a {SUFFIX} baseline", real)
        resolved.append(real)
    for real in resolved:
        real.unlink(missing_ok=True)
        parent = real.parent
        while parent != top and parent.is_relative_to(top):
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


def _scan_unsafe(top: Path) -> list[Path]:
    return sorted(p for p in _walk(top) if p.suffix.lower() in UNSAFE_SUFFIXES or _sniff(p) == "pickle")


def _walk(top: Path):
    if not top.is_dir():
        return
    for dirpath, _dirnames, filenames in os.walk(top):
        for name in filenames:
            yield Path(dirpath) / name


def _sniff(path: Path) -> str:
    """Kind of file at ``path`` from its first 9 bytes (see :func:`_kind`)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return "other"
    return _kind(head)


def _kind(head: bytes) -> str:
    """``"safetensors"``, ``"pickle"`` (pickle protocol 2+ or zip, i.e. ``torch.save``),
    ``"short"`` (fewer than 9 bytes) or ``"other"``, from a file's first bytes."""
    # A safetensors header is checked first: its 8-byte little-endian length can start with 0x80
    # (a 1408-byte header does), which alone would look like a pickle PROTO opcode. Nothing is ever
    # unpickled either way; a crafted file that passes as safetensors is then parsed (no code runs).
    if len(head) >= 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= _HEADER_LIMIT:
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")):
        return "pickle"
    if len(head) < 9:
        return "short"
    return "other"


def _read(path: Path) -> Baseline:
    """Read, validate and decode one baseline file (see :meth:`BaselineStore.load`).

    The header is read and validated through one open file descriptor, and the tensors are
    memory-mapped by ``safetensors.safe_open`` through that same descriptor (``/proc/self/fd/N``,
    ``/dev/fd/N``), so a concurrent ``os.replace`` by another writer yields either the old or the
    new version, never a header of one and data of the other. Tensors are views of a private
    (copy-on-write) mapping of the file: pages are read when the checksum or a comparison touches
    them and can be dropped by the OS, instead of holding the file's bytes plus a decoded copy.
    """
    shown = _show(path)
    try:
        with open(path, "rb") as fh:
            return _read_open(path, shown, fh)
    except IsADirectoryError:
        raise CorruptBaselineError(f"baseline {shown} is a directory, not a file", path) from None
    except OSError as exc:
        raise CorruptBaselineError(f"baseline {shown} cannot be read: {exc}", path) from None


def _fd_path(fh: Any, path: Path) -> str:
    """A name that opens the very file behind ``fh`` (Linux ``/proc/self/fd``, BSD/macOS ``/dev/fd``);
    ``path`` itself where neither exists (then a concurrent replace can be seen as a checksum error)."""
    for folder in ("/proc/self/fd", "/dev/fd"):
        candidate = f"{folder}/{fh.fileno()}"
        if os.path.exists(candidate):
            return candidate
    return str(path)


def _read_open(path: Path, shown: str, fh: Any) -> Baseline:
    size = os.fstat(fh.fileno()).st_size
    kind = _kind(fh.read(9))
    if kind == "pickle":
        raise UnsafeBaselineError(
            f"refusing {shown}: it is a pickle / torch.save file, which can run code when loaded; "
            "baselines must be safetensors — delete it and re-record",
            path,
        )
    if kind != "safetensors":
        what = f"truncated ({size} bytes)" if kind == "short" else "not a safetensors file (bad header)"
        raise CorruptBaselineError(f"baseline {shown} is corrupt: {what}; delete it and re-record", path)
    fh.seek(0)
    header_len = int.from_bytes(fh.read(8), "little")
    if 8 + header_len > size:
        raise CorruptBaselineError(
            f"baseline {shown} is truncated: its header needs {8 + header_len} bytes, the file has "
            f"{size}; delete it and re-record",
            path,
        )
    try:
        header = json.loads(fh.read(header_len))
        metadata = header.get("__metadata__") or {}
    except (ValueError, AttributeError) as exc:
        raise CorruptBaselineError(f"baseline {shown} has a corrupt header ({exc}); delete it and re-record", path) from None
    if metadata.get("format") != FORMAT:
        raise CorruptBaselineError(
            f"baseline {shown} is a safetensors file but not a {FORMAT} file "
            f"(format={metadata.get('format')!r}); delete it and re-record",
            path,
        )
    try:
        version = int(metadata.get("format_version", ""))
    except ValueError:
        raise CorruptBaselineError(f"baseline {shown} has an unreadable format_version", path) from None
    if version > FORMAT_VERSION:
        raise BaselineError(
            f"baseline {shown} uses format version {version}, newer than this plugin reads "
            f"({FORMAT_VERSION}); upgrade pytest-npu-parity",
            path,
        )
    try:
        provenance = json.loads(metadata["provenance"])
        records = json.loads(metadata["checks"])
        stored_hash = metadata["content_hash"]
    except (KeyError, ValueError) as exc:
        raise CorruptBaselineError(f"baseline {shown} has unreadable metadata ({exc!r}); re-record it", path) from None
    if not isinstance(records, dict) or not isinstance(provenance, dict):
        raise CorruptBaselineError(f"baseline {shown} has malformed metadata; re-record it", path)
    from safetensors import safe_open

    try:
        with safe_open(_fd_path(fh, path), framework="pt") as handle:
            stored = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CorruptBaselineError(f"baseline {shown} is corrupt or truncated: {exc}; delete it and re-record", path) from None
    used: set[str] = set()
    checks: dict[str, CheckBaseline] = {}
    for name, record in records.items():
        try:
            leaves = dict(record["leaves"])
            none_leaves = list(record["none_leaves"])
            meta = dict(record["meta"])
        except (KeyError, TypeError, ValueError):
            raise CorruptBaselineError(f"baseline {shown} has a malformed entry for check {name!r}", path) from None
        missing = [key for key in leaves.values() if key not in stored]
        if missing:
            raise CorruptBaselineError(f"baseline {shown} lacks tensor(s) {missing} of check {name!r}", path)
        used.update(leaves.values())
        checks[name] = CheckBaseline(name=name, tensors={leaf: stored[key] for leaf, key in leaves.items()},
                                     none_leaves=none_leaves, meta=meta)
    extra = set(stored) - used
    if extra:
        raise CorruptBaselineError(f"baseline {shown} holds tensors no check describes: {sorted(extra)}", path)
    if fingerprint_tensors({name: c.tensors for name, c in checks.items()}) != stored_hash:
        raise CorruptBaselineError(
            f"baseline {shown} fails its checksum: the tensor data changed after it was written "
            "(disk error, bad merge or hand edit); delete it and re-record",
            path,
        )
    return Baseline(path=path, provenance=provenance, checks=checks, test_id=metadata.get("test_id"))


def _encode_checks(checks: dict[str, CheckBaseline]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Flatten checks into safetensors tensors (key -> CPU tensor) and JSON-ready records."""
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    for name, check in checks.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"check names must be non-empty strings, got {name!r}")
        if check.name != name:
            raise ValueError(f"check stored under {name!r} is named {check.name!r}; use the same name")
        leaves: dict[str, str] = {}
        shapes: dict[str, list[int]] = {}
        dtypes: dict[str, str] = {}
        for leaf, tensor in check.tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"check {name!r} leaf {leaf!r} is a {type(tensor).__name__}, not a tensor")
            key = f"{name}/{leaf}" if leaf else name
            n = 2
            base = key
            while key in tensors or key == "__metadata__":
                key = f"{base}#{n}"
                n += 1
            tensors[key] = _cpu_copy(tensor)
            leaves[leaf] = key
            shapes[leaf] = list(tensor.shape)
            dtypes[leaf] = _dtype_name(tensor.dtype)
        meta = _normalize(dict(check.meta), f"meta of check {name!r}")
        meta["shapes"] = shapes
        meta["dtypes"] = dtypes
        records[name] = {"leaves": leaves, "none_leaves": sorted(set(check.none_leaves)), "meta": meta}
    return tensors, records


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = t.resolve_conj()
    return t.resolve_neg().to("cpu", copy=True).contiguous()


def _content_hash(tensors: dict[str, torch.Tensor], records: dict[str, dict]) -> str:
    by_check = {name: {leaf: tensors[key] for leaf, key in rec["leaves"].items()} for name, rec in records.items()}
    return fingerprint_tensors(by_check)


def _same_content(old: Baseline, records: dict[str, dict], content_hash: str) -> bool:
    old_records = {
        name: {"leaves": None, "none_leaves": sorted(set(c.none_leaves)), "meta": _normalize(c.meta, "stored meta")}
        for name, c in old.checks.items()
    }
    new_records = {name: {**rec, "leaves": None} for name, rec in records.items()}
    if old_records != new_records:
        return False
    old_hash = fingerprint_tensors({name: c.tensors for name, c in old.checks.items()})
    return old_hash == content_hash


def _normalize(value: Any, what: str) -> Any:
    return json.loads(_dumps(value, what))


def _dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serializable: {exc}") from None


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _recorded_shapes(check: CheckBaseline) -> dict[str, list[int]]:
    shapes = check.meta.get("shapes")
    if isinstance(shapes, dict):
        return shapes
    return {leaf: list(t.shape) for leaf, t in check.tensors.items()}


def _recorded_dtypes(check: CheckBaseline) -> dict[str, str]:
    dtypes = check.meta.get("dtypes")
    if isinstance(dtypes, dict):
        return dtypes
    return {leaf: _dtype_name(t.dtype) for leaf, t in check.tensors.items()}


def _diff_leaves(what: str, was: dict[str, Any], now: dict[str, Any], report_sets: bool = True) -> list[str]:
    changes = []
    for leaf in sorted(set(was) | set(now), key=str):
        label = f"output {leaf!r}" if leaf else "the output"
        if leaf not in now:
            if report_sets:
                changes.append(f"{label} was recorded but is no longer produced")
        elif leaf not in was:
            if report_sets:
                changes.append(f"{label} is new (not in the baseline)")
        elif was[leaf] != now[leaf]:
            fmt = (lambda v: "None" if v is None else str(tuple(v))) if what == "shape" else str
            changes.append(f"{what} of {label} changed (recorded {fmt(was[leaf])}, now {fmt(now[leaf])})")
    return changes


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a same-directory temporary file, fsync and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable; not possible on every platform
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)

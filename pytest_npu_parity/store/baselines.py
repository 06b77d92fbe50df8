"""Where baselines live and how they are written, read and judged fresh.

A **baseline** is the reference output of one test, recorded once on a trusted machine (a CUDA
box or the CPU) and compared against the target (the NPU) later, possibly for months. A stale,
corrupt, foreign or silently overwritten baseline is worse than none, so this store refuses to
guess.

Layout
------
One safetensors file per test, named after the pytest node id. :class:`SuiteStores` (what the
plugin uses) puts each test of ``parity_suites/<suite>/`` under ``<root>/<suite>/`` and drops that
prefix; every other id keeps its whole module path under ``<root>/_rootdir/``
(:data:`ROOTDIR_SUITE`)::

    parity_suites/aurora/test_layers.py::test_decoder_layer[bf16-batch]
    -> <root>/aurora/test_layers/test_decoder_layer.bf16-batch.safetensors

    parity_suites/aurora/test_model.py::TestTrain::test_step[fp32]
    -> <root>/aurora/test_model/TestTrain+test_step.fp32.safetensors

    tests/test_x.py::test_y  ->  <root>/_rootdir/tests/test_x/test_y.safetensors

A plain :class:`BaselineStore` (one suite) keeps the whole module path below ``<root>/<suite>/``
unless given ``module_prefix`` (then ids outside that prefix are refused). The module path
becomes directories (``.py`` dropped); test classes join the test name in the file name with
``+`` (:data:`CLASS_SEPARATOR`), so ``test_a.py::TestB::test_c`` and ``test_a/TestB.py::test_c``
get different files; the parametrization (which carries the recipe) follows after a dot. Every
component is sanitized to ``[A-Za-z0-9._-]`` (test and class names to ``[A-Za-z0-9_-]``, so the
first dot always separates name and parameters); a component that had to be changed, starts with
a dot, or is longer than :data:`MAX_COMPONENT` characters (classes, name and parameters together,
for the file name) gets ``-<10 hex digits of its BLAKE2b>`` appended, so two different ids never
share a file. Ids with a NUL byte, an absolute module path or a ``..`` segment are rejected, and
every path is resolved and verified to lie under ``<root>/<suite>``.

File format (version 4; version 3 reads unchanged, version 2 as a file without extras)
-------------------------------------------------------------------------------------
Plain safetensors (never pickle), readable with ``safetensors.safe_open`` alone:

* tensors under the key ``"<check>/<leaf path>"`` (``"dec_layer_0/[0]"``,
  ``"model/last_hidden_state"``; the check name alone for a bare-tensor output; ``#2``, ``#3``
  appended on the rare clash) — the authoritative leaf → key map is in the metadata;
* a check's *extras* (the inputs and weights it was computed from, recorded for replay on a machine
  whose own random draws differ, :mod:`pytest_npu_parity.checks.replay`) under content addresses
  ``"@<32 hex digits>"``: a tensor that several checks recorded (the same weights, the same batch)
  is stored once; from :data:`POOL_MIN_BYTES` (4 KiB) on, an extra goes to the store's object pool instead
  (:class:`ObjectPool`, ``<root>/.objects/``: one copy for every file of the store, key ``"object:<64 hex>"``,
  re-hashed on every read); each check's record maps ``extras: {"input:<i>" | "weight:<name>": key}``; a check judged
  by a golden verdict also stores its golden leaves there, ``"golden:<leaf path>": key``
  (:mod:`pytest_npu_parity.checks.stored_golden`: a compare run against the entry runs no golden);
* string metadata: ``format`` (:data:`FORMAT`), ``format_version`` (:data:`FORMAT_VERSION`),
  ``test_id``, ``provenance`` (JSON, see :mod:`pytest_npu_parity.store.provenance`), ``checks`` (JSON:
  ``{check: {"leaves": {leaf: key}, "none_leaves": [...], "meta": {...}}}``, where ``meta``
  holds ``input_hash``, ``input_summary`` (order-sensitive, see ``provenance.summarize_tensors``),
  ``config_hash``, ``config_tensors`` (per-weight digests, ``provenance.module_tensor_digests``),
  ``structure_hash`` and ``structure`` (the module's configuration and structure,
  ``structure.module_structure``, packed by ``structure.pack_structure``; absent for a function and
  in files recorded before they existed), ``recipe``, ``seed``, ``shapes``, ``dtypes`` and whatever
  the runner records) and
  ``content_hash``: BLAKE2b over the other five fields and every tensor's dtype, shape and bytes,
  checked on every load — a flipped bit in the data region or an edited provenance, test id or
  check record is reported as corruption, never compared against or printed as fact.

A version-1 file (whose checksum covered the tensors only) is stale: re-record it.

Guarantees
----------
* **Never unpickles.** ``.pt``/``.pth``/``.bin``/``.pkl``/``.pickle``/``.ckpt`` files, and any
  file whose first bytes are a pickle or zip (``torch.save``) header, raise
  :class:`UnsafeBaselineError` without being opened by a loader.
* **Bound to its test.** :meth:`BaselineStore.load` refuses a symbolic link (the file or a
  directory on the way) and treats a file recorded for another test id as stale;
  :meth:`BaselineStore.check_fresh` treats another recipe, seed, input or model as stale.
* **Atomic writes.** :meth:`BaselineStore.write` writes a temporary file in the same directory,
  fsyncs it and ``os.replace``-s it over the target. A crash before the rename leaves the old
  baseline intact (and the temporary file is removed on any Python-level error; a killed
  process can leave a ``.<name>.<random>.tmp`` file: :meth:`SuiteStores.temporary_files` lists
  them, :meth:`SuiteStores.remove_temporary_files` deletes them under the lock). Concurrent
  writers (pytest-xdist workers) each write their own temporary file, so the result is always one
  writer's complete file; separate record runs serialize on :class:`StoreLock`.
* **No churn.** Writing tensors and check metadata identical to what is stored (bit for bit)
  leaves the file untouched, so provenance dates do not change in git.
* **Loud failures.** Every :class:`BaselineError` names the file; stale and missing baselines
  say what changed and give the exact command to re-record.

Size and speed: a baseline holds only the leaves its checks compare. Loading validates the header
through one descriptor and memory-maps the tensors through the same descriptor with
``safetensors.safe_open`` (so a concurrent replace cannot mix two versions, see :func:`_read`), then
verifies the checksum, which touches every byte once: ``benchmarks/bench_suite.py`` measures the load
throughput of the committed Aurora baselines against reading the same bytes (docs/explanation/performance.md).
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save

from .encoding import _content_hash, _dumps, _encode_checks, _same_content, _tensor_hash
from .files import _atomic_write, _baseline_files, _prune, _scan_unsafe, _unused
from .format import (CLASS_SEPARATOR, FORMAT, FORMAT_VERSION, MAX_COMPONENT, SUFFIX, UNSAFE_SUFFIXES,
                     UPDATE_COMMAND, _DIR_UNSAFE, _NAME_UNSAFE, Baseline, BaselineError, CheckBaseline,
                     MissingBaselineError, StaleBaselineError, UnsafeBaselineError, _show)
from .pool import ObjectPool
from .provenance import describe_provenance
from .reading import _read
from .staleness import CheckNow, Staleness, staleness

__all__ = ["BaselineStore"]


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
        self.pool = ObjectPool(self.root)

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
        if n:
            if segments[:n] != self.module_prefix or len(segments) <= n:
                raise BaselineError(
                    f"test id {test_id!r} is not under {'/'.join(self.module_prefix)}/, the module prefix of "
                    f"the store {self.suite_dir}; use SuiteStores, which routes every id to its suite")
            segments = segments[n:]
        if segments and segments[-1].endswith(".py"):
            segments[-1] = segments[-1][: -len(".py")]
        parts = rest.split("::")
        *classes, leaf = parts
        name, param = leaf, None
        bracket = leaf.find("[")
        if bracket > 0 and leaf.endswith("]"):
            name, param = leaf[:bracket], leaf[bracket + 1 : -1]
        dirs = [_sanitize(s, _DIR_UNSAFE) for s in segments]
        # Classes go into the file name, not into directories: `test_a.py::TestB::test_c` and
        # `test_a/TestB.py::test_c` must not share a file.
        stem = CLASS_SEPARATOR.join(_sanitize(c, _NAME_UNSAFE) for c in [*classes, name])
        if param is not None:
            stem += "." + _sanitize(param, _DIR_UNSAFE)
        if len(stem) > MAX_COMPONENT:  # name and parameters together: shorten, keep them apart by hash
            stem = stem[: MAX_COMPONENT - 11] + "-" + _digest(rest)
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
            UnsafeBaselineError: the file, or a directory between it and ``<root>/<suite>``, is a
                symbolic link (a link can make a test compare with another test's baseline).
            CorruptBaselineError: truncated, bad header, not safetensors, not a baseline of this
                plugin, or checksum mismatch (the checksum covers the metadata — test id,
                provenance, check records — and every tensor).
            StaleBaselineError: the file was recorded for another test id (a copied, renamed or
                hard-linked file), or in an older format version.
            BaselineError: the file uses a newer format version than this plugin reads.
        """
        path = self.path_for(test_id)
        self._refuse_links(path, test_id)
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
        baseline = _read(path, rerecord=self.command(test_id), pool=self.pool)
        if baseline.test_id != test_id:
            raise StaleBaselineError(
                f"baseline {_show(path)} was recorded for test {baseline.test_id!r}, not for {test_id!r} "
                "(a copied, renamed or linked file); it is not used for this test. Re-record it with: "
                f"{self.command(test_id)}",
                path,
            )
        return baseline

    def _refuse_links(self, path: Path, test_id: str, *, file: bool = True) -> None:
        """Raise :class:`UnsafeBaselineError` when ``path`` (unless ``file`` is False) or a directory
        between it and ``<root>/<suite>`` (that one included) is a symbolic link."""
        top = self.root
        current = path if file else path.parent
        while current != top and current.is_relative_to(top):
            if current.is_symlink():
                what = "is a symbolic link" if current == path else f"lies under the symbolic link {_show(current)}"
                try:
                    target = f" to {os.readlink(current)}"
                except OSError:
                    target = ""
                raise UnsafeBaselineError(
                    f"refusing {_show(path)}: it {what}{target}; a link can make "
                    f"one test compare with another's baseline. Replace it with a regular file recorded for "
                    f"this test: {self.command(test_id)}",
                    path,
                )
            current = current.parent

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

    def check_fresh(self, baseline: Baseline, check: str, *, input_hash: str, config_hash: str,
                    shapes: dict[str, tuple] | None = None, dtypes: dict[str, torch.dtype | str] | None = None,
                    input_summary: list | Callable[[], list] | None = None,
                    config_tensors: dict[str, str] | Callable[[], dict[str, str]] | None = None,
                    recipe: str | None = None, seed: int | None = None, structure_hash: str | None = None,
                    structure: dict | Callable[[], dict] | None = None,
                    train_recipe: dict | Callable[[], dict] | None = None, replay_refused: str | None = None,
                    more_changes: list[str] | None = None) -> CheckBaseline:
        """Return the stored check if it was recorded for this input and configuration.

        Args:
            baseline: a loaded baseline.
            check: the check name.
            input_hash: fingerprint of the current input (``fingerprint_tensors``).
            config_hash: fingerprint of the current model/config (``fingerprint_module``).
            shapes: optional current output leaf -> shape (``None`` for a ``None`` leaf); any
                added, removed or reshaped leaf makes the baseline stale.
            dtypes: optional current output leaf -> dtype (``torch.bfloat16`` or its name).
            input_summary: ``provenance.summarize_tensors`` of the current input (or a callable
                returning it, called only when the input hash differs). When the input hash differs
                but the recorded summary agrees within ``provenance.SUMMARY_RTOL`` — the same
                activations recomputed on another machine, differing in last bits; the summary is
                order-sensitive, so permuted rows do not agree — the baseline is fresh and
                ``meta["bitwise_input"]`` of the returned entry is False.
            config_tensors: ``provenance.module_tensor_digests`` of the current module (or a
                callable returning it, called only when the config hash differs); None or empty
                for a function. Weights are bitwise reproducible, so a differing module fingerprint
                is always stale, naming the tensors that changed. For a function the config hash
                only names it (``module.qualname``), which may change with the import mode: a
                differing one is noted in ``meta["bitwise_config"]`` only.
            recipe, seed: the recipe name and seed of this run; a baseline recorded under another
                recipe (a bf16 recording in the fp32 file) or seed is stale.
            structure_hash, structure: ``structure.structure_hash`` of the current module's
                ``structure.module_structure`` record, and that record (or a callable returning it,
                called only when the hashes differ); None for a function. When the entry recorded
                one and the hashes differ, the two records are compared where both have a field
                (``structure.structure_changes``): a difference (``config changed: layer_norm_epsilon
                1e-05 → 0.001``, ``structure changed (…)``) is stale; none (a field only one side
                has, e.g. added by another torch release) is fresh, with ``meta["bitwise_structure"]``
                False. An entry without a recorded structure (an older file) makes no claim.
            train_recipe: a training step's ``structure.train_recipe`` (optimizer, clipping, loss or
                loop; or a callable returning it, called only when the entry recorded one); None
                otherwise. A difference from the recorded one (``structure.train_recipe_changes``:
                ``train recipe changed: optimizer AdamW → SGD, lr 0.0001 → 0.01``) is stale; an entry
                recorded without one (an older file) makes no claim.
            replay_refused: why the entry's recorded inputs/weights were not replayed
                (``checks.replay.plan_replay``); joins the message when the entry is stale.
            more_changes: further differences the caller found between the entry's metadata and
                the check (``checks.fingerprints.fingerprint_changes``: a non-tensor argument, a
                module attribute, a function's closure); any makes the entry stale, listed after
                the differences found here.

        Raises:
            MissingBaselineError: the file has no entry for ``check``.
            StaleBaselineError: the recipe, seed, input, weights, configuration or structure, train
                recipe, leaf set, shape or dtype differs;
                the message lists each difference as recorded vs now, the baseline's provenance and
                the re-record command.
        """
        recorded = baseline.checks.get(check)
        if recorded is None:
            raise self._no_check_error(baseline, check)
        now = CheckNow(input_hash=input_hash, config_hash=config_hash, shapes=shapes, dtypes=dtypes,
                       input_summary=input_summary, config_tensors=config_tensors, recipe=recipe, seed=seed,
                       structure_hash=structure_hash, structure=structure, train_recipe=train_recipe)
        found = staleness(recorded, now)
        found.changes += more_changes or []
        if found.changes:
            raise self._stale_error(baseline, check, found, replay_refused)
        return CheckBaseline(name=recorded.name, tensors=recorded.tensors, none_leaves=recorded.none_leaves,
                             meta=found.meta, extras=recorded.extras)

    def _no_check_error(self, baseline: Baseline, check: str) -> MissingBaselineError:
        """The error for a baseline file without an entry for ``check``."""
        have = ", ".join(sorted(baseline.checks)) or "none"
        return MissingBaselineError(
            f"baseline {baseline.describe()} has no check {check!r} (it has: {have}); "
            f"record it with: {self.command(baseline.test_id or str(baseline.path))}",
            baseline.path,
        )

    def _stale_error(self, baseline: Baseline, check: str, found: Staleness,
                     replay_refused: str | None) -> StaleBaselineError:
        """The error for a stale entry: each difference, why it was not replayed, the provenance and the
        re-record command; ``structure_changed`` and ``input_changed`` set from ``found``."""
        changes = list(found.changes)
        if replay_refused:
            changes.append(f"not replayed: {replay_refused}")
        error = StaleBaselineError(
            f"baseline {_show(baseline.path)} is stale for check {check!r}: " + "; ".join(changes)
            + f". It was recorded on {describe_provenance(baseline.provenance)}. "
            f"Re-record it on a trusted machine with: {self.command(baseline.test_id or str(baseline.path))}",
            baseline.path,
        )
        error.structure_changed = found.structure_changed
        error.input_changed = found.input_changed
        return error

    # ---- writing ---------------------------------------------------------------------------

    def write(self, test_id: str, checks: dict[str, CheckBaseline], provenance: dict) -> str:
        """Record every check of ``test_id`` in its one baseline file.

        The file then holds exactly ``checks`` (a check no longer passed is dropped). Tensors are
        stored as detached, contiguous CPU copies in their own dtype.

        Returns:
            ``"created"`` (no file before), ``"changed"`` (rewritten; also when the old file was
            corrupt, unsafe, of an older format, recorded for another test id or a symbolic link,
            which is replaced by a regular file) or ``"unchanged"`` (identical tensors bit for bit, identical
            ``none_leaves`` and metas: the file is not touched).

        Raises:
            ValueError: a check's ``name`` differs from its key, or a name is empty.
            TypeError: a meta/provenance value is not JSON-serializable, or a leaf is not a tensor.
            BaselineError: the test id cannot be mapped to a file (see :meth:`path_for`).
            UnsafeBaselineError: a directory on the way to the file is a symbolic link.
            OSError: the file cannot be written; the old baseline is then left intact.
        """
        path = self.path_for(test_id)
        self._refuse_links(path, test_id, file=False)
        tensors, records = _encode_checks(checks, self.pool)  # pool objects first: a file never precedes them
        tensor_hash = _tensor_hash(tensors, records)
        status = "created"
        if path.exists() or path.is_symlink():
            status = "changed"
            try:
                old = None if path.is_symlink() else _read(path, pool=self.pool)  # a link: replaced by a file
            except BaselineError:
                old = None
            if old is not None and old.test_id == test_id and _same_content(old, records, tensor_hash):
                return "unchanged"
        metadata = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "test_id": test_id,
            "provenance": _dumps(provenance, "provenance"),
            "checks": _dumps(records, "check metadata"),
        }
        metadata["content_hash"] = _content_hash(metadata, tensor_hash)
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

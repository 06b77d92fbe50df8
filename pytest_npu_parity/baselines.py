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
  ``test_id``, ``provenance`` (JSON, see :mod:`pytest_npu_parity.provenance`), ``checks`` (JSON:
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
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from .provenance import describe_provenance, fingerprint_tensors, summaries_close, weights_changed
from .store.lock import StoreLock  # noqa: F401  (re-exported: the lock lives in store.lock)
from .store.format import (  # noqa: F401  (re-exported: the format's names live in store.format)
    FORMAT,
    FORMAT_VERSION,
    POOL_VERSION,
    OLDEST_READABLE,
    SUFFIX,
    UNSAFE_SUFFIXES,
    MAX_COMPONENT,
    UPDATE_COMMAND,
    OBJECTS_DIR,
    OBJECT_FORMAT,
    POOLED_KINDS,
    POOL_MIN_BYTES,
    OBJECT_REF,
    LOCK_NAME,
    ROOTDIR_SUITE,
    CLASS_SEPARATOR,
    _TEMP_NAME,
    _OBJECT_REF_RE,
    _OBJECT_NAME,
    _DIR_UNSAFE,
    _NAME_UNSAFE,
    _HEADER_LIMIT,
    BaselineError,
    MissingBaselineError,
    StaleBaselineError,
    CorruptBaselineError,
    UnsafeBaselineError,
    StoreLockedError,
    CheckBaseline,
    Baseline,
    _show,
)

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
    "StoreLock",
    "StoreLockedError",
    "LOCK_NAME",
    "ObjectPool",
    "PoolObjectError",
    "object_digest",
    "OBJECTS_DIR",
    "POOLED_KINDS",
    "POOL_MIN_BYTES",
    "POOL_VERSION",
]


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
        config_tensors: dict[str, str] | Callable[[], dict[str, str]] | None = None,
        recipe: str | None = None,
        seed: int | None = None,
        structure_hash: str | None = None,
        structure: dict | Callable[[], dict] | None = None,
        train_recipe: dict | Callable[[], dict] | None = None,
        replay_refused: str | None = None,
        more_changes: list[str] | None = None,
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
        if recipe is not None and meta.get("recipe") != recipe:
            changes.append(f"recorded under recipe {meta.get('recipe')!r}, this run uses {recipe!r}")
        if seed is not None and meta.get("seed") != seed:
            changes.append(f"recorded with seed {meta.get('seed')!r}, this run uses seed {seed!r} "
                           "(--parity-seed, ini parity_seed or the check's seed=)")
        input_changed = False
        before = meta.get("input_hash")
        meta["bitwise_input"] = before == input_hash
        if before != input_hash:
            change = f"input hash changed (recorded {_short(before)}, now {_short(input_hash)})"
            summary = input_summary() if callable(input_summary) else input_summary
            why = "no summary given" if summary is None else summaries_close(meta.get("input_summary"), summary)
            if why is not None:
                changes.append(f"{change}: {why}")
                input_changed = True
        before = meta.get("config_hash")
        meta["bitwise_config"] = before == config_hash
        if before != config_hash:
            digests = config_tensors() if callable(config_tensors) else config_tensors
            recorded_digests = meta.get("config_tensors")
            if digests or recorded_digests or config_tensors is None:
                what = weights_changed(recorded_digests if isinstance(recorded_digests, dict) else None,
                                       digests or {})
                prefix = meta.get("submodule")
                if prefix:  # name the tensors as in the whole model
                    what = re.sub(r"'([^']+)'", lambda m: repr(f"{prefix}.{m.group(1)}"), what)
                changes.append(f"{what}; model fingerprint recorded {_short(before)}, now {_short(config_hash)}")
        structure_changed = False
        before = meta.get("structure_hash")
        if before is not None and structure_hash is not None:
            meta["bitwise_structure"] = before == structure_hash
            if before != structure_hash:
                lines = _structure_changes(meta.get("structure"), structure, meta.get("submodule"))
                structure_changed = bool(lines)
                changes += lines
        before = meta.get("train_recipe")
        if isinstance(before, dict) and train_recipe is not None:
            from .structure import train_recipe_changes

            changes += train_recipe_changes(before, train_recipe() if callable(train_recipe) else train_recipe)
        if shapes is not None:
            was = {leaf: tuple(s) for leaf, s in _recorded_shapes(recorded).items()}
            was.update({leaf: None for leaf in recorded.none_leaves})
            now_shapes = {leaf: (None if s is None else tuple(int(d) for d in s)) for leaf, s in shapes.items()}
            changes += _diff_leaves("shape", was, now_shapes)
        if dtypes is not None:
            was_d = _recorded_dtypes(recorded)
            now_d = {leaf: _dtype_name(d) for leaf, d in dtypes.items() if d is not None}
            changes += _diff_leaves("dtype", was_d, now_d, report_sets=shapes is None)
        changes += more_changes or []
        if changes:
            if replay_refused:
                changes.append(f"not replayed: {replay_refused}")
            error = StaleBaselineError(
                f"baseline {_show(baseline.path)} is stale for check {check!r}: " + "; ".join(changes)
                + f". It was recorded on {describe_provenance(baseline.provenance)}. "
                f"Re-record it on a trusted machine with: {self.command(test_id)}",
                baseline.path,
            )
            error.structure_changed = structure_changed
            error.input_changed = input_changed
            raise error
        return CheckBaseline(name=recorded.name, tensors=recorded.tensors, none_leaves=recorded.none_leaves,
                             meta=meta, extras=recorded.extras)

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
    ``<root>/aurora/test_layers/``; ``parity_suites`` must be the first directory of the id).
    Every other id keeps its whole module path under the suite
    :data:`ROOTDIR_SUITE` (``tests/test_x.py::t`` -> ``<root>/_rootdir/tests/test_x/``), so
    ``mini/test_top.py::t`` and ``parity_suites/mini/test_top.py::t`` never share a file; a parity
    suite that is itself named ``_rootdir`` is stored under a hashed name.

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
            return ROOTDIR_SUITE, ""
        if len(dirs) >= 2 and dirs[0] == "parity_suites":
            suite = _sanitize(dirs[1], _DIR_UNSAFE)
            if suite == ROOTDIR_SUITE:
                suite = f"{suite}-{_digest('parity_suites/' + suite)}"
            return suite, "/".join(dirs[:2])
        return ROOTDIR_SUITE, ""

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

    def temporary_files(self) -> list[Path]:
        """Temporary files of interrupted writes below ``root`` (``.<name>.safetensors.<random>.tmp``,
        left by a killed process), sorted. Only safe to delete while holding :meth:`lock`."""
        return sorted(p for p in _walk(self.root) if _TEMP_NAME.match(p.name))

    def remove_temporary_files(self) -> list[tuple[Path, int]]:
        """Delete :meth:`temporary_files`; returns ``(path, size in bytes)`` of each one removed.

        Call it only while holding :meth:`lock`: a live writer's temporary file would be lost
        (its ``os.replace`` then fails and that write raises ``OSError``).
        """
        removed = []
        for path in self.temporary_files():
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append((path, size))
        return removed

    def lock(self) -> "StoreLock":
        """The :class:`StoreLock` of this store (not yet acquired)."""
        return StoreLock(self.root)

    @property
    def pool(self) -> ObjectPool:
        """The store's :class:`ObjectPool` (``<root>/.objects/``), shared by every suite."""
        return ObjectPool(self.root)

    def referenced_objects(self) -> dict[str, list[Path]]:
        """Digest -> the baseline files under ``root`` that reference that pool object (headers only).

        Raises:
            CorruptBaselineError: a baseline file's header cannot be read (what it references is unknown).
        """
        refs: dict[str, list[Path]] = {}
        for path in _baseline_files(self.root):
            for digest in _object_refs(path):
                refs.setdefault(digest, []).append(path)
        return refs

    def orphan_objects(self) -> list[tuple[Path, int]]:
        """``(path, size in bytes)`` of the pool objects no baseline file under ``root`` references, sorted.

        Every file under the root counts, not only those of one run: a ``-k`` re-record or one xdist
        worker's files never make another test's objects orphans.

        Raises:
            CorruptBaselineError: as :meth:`referenced_objects` (then nothing is called an orphan).
        """
        refs = self.referenced_objects()
        orphans = []
        for digest, path in self.pool.objects():
            if digest not in refs:
                try:
                    orphans.append((path, path.stat().st_size))
                except FileNotFoundError:
                    continue
        return orphans

    def prune_objects(self) -> list[tuple[Path, int]]:
        """Delete :meth:`orphan_objects` (and then-empty fan-out directories); returns what was removed.

        Call it only while holding :meth:`lock` (a record run holds it for its session): a record run writes
        a test's objects before its file, and an object written but not yet referenced would be lost.

        Raises:
            CorruptBaselineError: a baseline file's header cannot be read; nothing is deleted then.
        """
        removed = []
        for path, size in self.orphan_objects():
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            removed.append((path, size))
            try:
                path.parent.rmdir()
            except OSError:
                pass
        return removed

    def unwritable(self) -> list[Path]:
        """``root`` (or its nearest existing ancestor) and the directories below it that this
        process cannot write to (``os.access``), sorted: a record run could not create or replace a
        baseline file in them."""
        top = self.root
        while not top.exists() and top.parent != top:
            top = top.parent
        if not top.is_dir():
            return [top]
        bad = [top] if not os.access(top, os.W_OK | os.X_OK) else []
        if top == self.root:
            for dirpath, dirnames, _files in os.walk(self.root):
                for name in dirnames:
                    path = Path(dirpath) / name
                    if not os.access(path, os.W_OK | os.X_OK):
                        bad.append(path)
        return sorted(bad)


# --------------------------------------------------------------------------------------------
# object pool


class PoolObjectError(Exception):
    """A pool object cannot be used: ``reason`` says why (missing, not a regular file, not a pool object,
    content that does not hash to its name); ``path`` is the object's file. :func:`_read` turns it into a
    :class:`CorruptBaselineError` naming the baseline file and the check that references it."""

    def __init__(self, reason: str, path: Path):
        super().__init__(f"{_show(path)} {reason}")
        self.reason = reason
        self.path = path


def object_digest(tensor: torch.Tensor) -> str:
    """The name of a tensor's pool object: BLAKE2b-256 (64 hex digits, personalization ``npu-parity-obj``)
    over its dtype name and shape (length-prefixed) and its raw C-order bytes.

    Args:
        tensor: a CPU tensor of any dtype (bfloat16 and bool included); non-contiguous, conjugate or
            negative views are hashed as the values they show.

    The digest depends on nothing but those values, so every file, process and machine (of the same byte
    order; all supported platforms are little-endian) names the same tensor alike.
    """
    t = _cpu_copy(tensor) if (not tensor.is_contiguous() or tensor.device.type != "cpu" or tensor.is_conj()
                              or tensor.is_neg() or tensor.layout != torch.strided) else tensor.detach()
    hasher = hashlib.blake2b(digest_size=32, person=b"npu-parity-obj")
    header = f"{_dtype_name(t.dtype)}|{','.join(str(int(d)) for d in t.shape)}".encode()
    hasher.update(len(header).to_bytes(8, "little"))
    hasher.update(header)
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    hasher.update(memoryview(flat.numpy()))
    return hasher.hexdigest()


class ObjectPool:
    """Content-addressed tensors shared by every baseline file of a store: ``<root>/.objects/`` (:data:`OBJECTS_DIR`).

    Each object is one safetensors file holding one tensor under the key ``"tensor"``, with metadata
    ``format`` (:data:`OBJECT_FORMAT`) and ``digest``, named by its :func:`object_digest` and fanned out by the
    first two hex digits, as git stores loose objects: ``<root>/.objects/3f/<62 hex digits>.safetensors``.
    A baseline file references an object from a check record (``extras: {"weight:h.0.attn.c_attn.weight":
    "object:<64 hex>"}``); that record is covered by the file's checksum, and the object by its name: it is
    re-hashed on every read.

    Writes are idempotent (:meth:`put`): the name is the content, so concurrent writers of one object
    (pytest-xdist workers recording the fp32 and the bf16 file of a test) write the same bytes, each through
    its own temporary file and ``os.replace``; whichever rename comes last leaves one complete, valid object.
    Objects are never loaded with pickle. Objects no file references any more are removed by
    :meth:`SuiteStores.prune_objects` (under the store's lock).

    Args:
        root: the baseline store root (``--baseline-dir``).
    """

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.dir = self.root / OBJECTS_DIR

    def path_for(self, digest: str) -> Path:
        """The file of the object ``digest`` (64 lower-case hex digits; the file need not exist).

        Raises:
            ValueError: ``digest`` is not 64 lower-case hex digits.
        """
        if not re.fullmatch(r"[0-9a-f]{64}", digest or ""):
            raise ValueError(f"a pool object's digest is 64 lower-case hex digits, got {digest!r}")
        return self.dir / digest[:2] / (digest[2:] + SUFFIX)

    def put(self, tensor: torch.Tensor) -> str:
        """Store ``tensor`` (detached, contiguous CPU copy in its own dtype) and return its digest.

        An existing object of that name is kept when it verifies (:meth:`get`), else replaced, so that a
        re-record repairs a corrupt or truncated object. Raises ``OSError`` when the pool cannot be written.
        """
        copy = _cpu_copy(tensor)
        digest = object_digest(copy)
        path = self.path_for(digest)
        if path.exists():
            try:
                self.get(digest)
                return digest
            except PoolObjectError:
                pass
        from safetensors.torch import save

        _atomic_write(path, save({"tensor": copy}, metadata={"format": OBJECT_FORMAT, "digest": digest}))
        return digest

    def get(self, digest: str) -> torch.Tensor:
        """The tensor of object ``digest``, verified: its content must hash to its name.

        Raises:
            PoolObjectError: the object is missing, is not a regular file, is a pickle/zip file (refused,
                never loaded), is not a pool object of this plugin, or its tensor does not hash to ``digest``.
        """
        path = self.path_for(digest)
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise PoolObjectError("is not a regular file", path)
        try:
            with open(path, "rb") as fh:
                kind = _kind(fh.read(9))
                if kind == "pickle":
                    raise PoolObjectError("is a pickle / torch.save file (refused, never loaded)", path)
                if kind != "safetensors":
                    raise PoolObjectError("is corrupt: truncated or not a safetensors file", path)
                from safetensors import safe_open

                try:
                    with safe_open(_fd_path(fh, path), framework="pt") as handle:
                        meta = handle.metadata() or {}
                        keys = list(handle.keys())
                        tensor = handle.get_tensor("tensor") if keys == ["tensor"] else None
                except Exception as exc:  # safetensors raises its own SafetensorError
                    raise PoolObjectError(f"is corrupt or truncated ({exc})", path) from None
        except FileNotFoundError:
            raise PoolObjectError("is missing", path) from None
        except OSError as exc:
            raise PoolObjectError(f"cannot be read ({exc})", path) from None
        if tensor is None or meta.get("format") != OBJECT_FORMAT:
            raise PoolObjectError(f"is not a {OBJECT_FORMAT} file (keys {keys[:3]})", path)
        actual = object_digest(tensor)
        if actual != digest:
            raise PoolObjectError(f"is corrupt: its tensor hashes to {actual[:12]}…, not to the digest its name "
                                  "gives (disk error, bad merge or hand edit)", path)
        return tensor

    def objects(self) -> list[tuple[str, Path]]:
        """``(digest, path)`` of every object file in the pool, sorted (temporary files excluded)."""
        found = []
        if not self.dir.is_dir():
            return found
        for fan in sorted(self.dir.iterdir()):
            if not (fan.is_dir() and re.fullmatch(r"[0-9a-f]{2}", fan.name)):
                continue
            for entry in sorted(fan.iterdir()):
                if _OBJECT_NAME.match(entry.name):
                    found.append((fan.name + entry.name[: -len(SUFFIX)], entry))
        return found


def _object_refs(path: Path) -> set[str]:
    """Digests of the pool objects the baseline file ``path`` references (its header only).

    Raises:
        CorruptBaselineError: the header cannot be read (then the caller cannot know what it references).
    """
    try:
        with open(path, "rb") as fh:
            if _kind(fh.read(9)) != "safetensors":
                raise CorruptBaselineError(f"baseline {_show(path)} is not a safetensors file", path)
            fh.seek(0)
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        records = json.loads((header.get("__metadata__") or {}).get("checks") or "{}")
        keys = [key for record in records.values() for key in (record.get("extras") or {}).values()]
    except CorruptBaselineError:
        raise
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise CorruptBaselineError(f"baseline {_show(path)} has an unreadable header ({exc})", path) from None
    return {m.group(1) for key in keys if isinstance(key, str) and (m := _OBJECT_REF_RE.match(key))}


# --------------------------------------------------------------------------------------------
# helpers



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
    pool = top / OBJECTS_DIR
    return sorted(p for p in _walk(top) if p.name.endswith(SUFFIX) and not p.name.startswith(".")
                  and not p.is_relative_to(pool))


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


def _read(path: Path, rerecord: str | None = None, pool: "ObjectPool | None" = None) -> Baseline:
    """Read, validate and decode one baseline file (see :meth:`BaselineStore.load`).

    The header is read and validated through one open file descriptor, and the tensors are
    memory-mapped by ``safetensors.safe_open`` through that same descriptor (``/proc/self/fd/N``,
    ``/dev/fd/N``), so a concurrent ``os.replace`` by another writer yields either the old or the
    new version, never a header of one and data of the other. Tensors are views of a private
    (copy-on-write) mapping of the file: pages are read when the checksum or a comparison touches
    them and can be dropped by the OS, instead of holding the file's bytes plus a decoded copy.

    Extras referenced as ``"object:<digest>"`` (format version 4) are read from ``pool`` after the file's
    checksum verified, each re-hashed (:meth:`ObjectPool.get`); a missing or corrupt object raises
    :class:`CorruptBaselineError` naming this file, the check, the object's path and the re-record command.
    """
    shown = _show(path)
    try:
        with open(path, "rb") as fh:
            return _read_open(path, shown, fh, rerecord, pool)
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


def _read_open(path: Path, shown: str, fh: Any, rerecord: str | None = None,
               pool: "ObjectPool | None" = None) -> Baseline:
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
    if version < OLDEST_READABLE:
        raise StaleBaselineError(
            f"baseline {shown} uses format version {version}; this plugin reads versions {OLDEST_READABLE} to "
            f"{FORMAT_VERSION} "
            "(whose checksum also covers the test id, provenance and check records, and which records "
            "per-tensor weight digests and order-sensitive input summaries). Re-record it"
            + (f" with: {rerecord}" if rerecord else " with pytest --update-baselines"),
            path,
        )
    test_id = metadata.get("test_id")
    if not isinstance(test_id, str) or not test_id:
        raise CorruptBaselineError(f"baseline {shown} has no test_id in its metadata; delete it and re-record", path)
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
    referenced: dict[str, dict[str, str]] = {}  # check -> {extra name: digest} of pool objects
    hashed_extras: dict[str, dict[str, Any]] = {}
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
        extras = record.get("extras") or {}
        if not isinstance(extras, dict):
            raise CorruptBaselineError(f"baseline {shown} lacks the recorded inputs/weights of check {name!r}", path)
        pooled = {what: m.group(1) for what, key in extras.items()
                  if version >= POOL_VERSION and isinstance(key, str) and (m := _OBJECT_REF_RE.match(key))}
        if any(key not in stored for what, key in extras.items() if what not in pooled):
            raise CorruptBaselineError(f"baseline {shown} lacks the recorded inputs/weights of check {name!r}", path)
        inline = {what: stored[key] for what, key in extras.items() if what not in pooled}
        used.update(leaves.values())
        used.update(key for what, key in extras.items() if what not in pooled)
        referenced[name] = pooled
        hashed_extras[name] = {**inline, **{what: extras[what] for what in pooled}}
        checks[name] = CheckBaseline(name=name, tensors={leaf: stored[key] for leaf, key in leaves.items()},
                                     none_leaves=none_leaves, meta=meta, extras=inline)
    extra = set(stored) - used
    if extra:
        raise CorruptBaselineError(f"baseline {shown} holds tensors no check describes: {sorted(extra)}", path)
    tensor_hash = _fingerprint_checks({name: (c.tensors, hashed_extras[name]) for name, c in checks.items()})
    if _content_hash(metadata, tensor_hash) != stored_hash:
        raise CorruptBaselineError(
            f"baseline {shown} fails its checksum: its tensors or metadata (test id, provenance, check "
            "records) changed after it was written (disk error, bad merge or hand edit); its provenance "
            "cannot be trusted either. Delete it and re-record",
            path,
        )
    _read_pooled(path, shown, checks, referenced, pool, rerecord or f"{UPDATE_COMMAND} {shlex.quote(test_id)}")
    return Baseline(path=path, provenance=provenance, checks=checks, test_id=test_id, tensor_hash=tensor_hash)


def _read_pooled(path: Path, shown: str, checks: dict[str, CheckBaseline], referenced: dict[str, dict[str, str]],
                 pool: "ObjectPool | None", rerecord: str) -> None:
    """Fill each check's extras with the verified pool objects it references (each object read once)."""
    loaded: dict[str, torch.Tensor] = {}
    for name, pooled in referenced.items():
        for what, digest in sorted(pooled.items()):
            if digest not in loaded:
                kind = what.partition(":")[0] if what.startswith(POOLED_KINDS) else "tensor"
                if pool is None:
                    raise CorruptBaselineError(
                        f"baseline {shown}: check {name!r} references its recorded {kind} {what!r} in an object pool, "
                        f"but it was read without one (read it through BaselineStore or SuiteStores); re-record with: "
                        f"{rerecord}", path)
                try:
                    loaded[digest] = pool.get(digest)
                except PoolObjectError as exc:
                    hint = (" (deleted, pruned, or not committed beside the baseline files: commit "
                            f"{_show(pool.dir)}/ with them)") if exc.reason == "is missing" else ""
                    raise CorruptBaselineError(
                        f"baseline {shown}: check {name!r} needs its recorded {kind} {what!r} from the object pool, "
                        f"but {_show(exc.path)} {exc.reason}{hint}; the check cannot be trusted without it. "
                        f"Re-record it with: {rerecord}",
                        path,
                    ) from None
            checks[name].extras[what] = loaded[digest]


def _encode_checks(checks: dict[str, CheckBaseline],
                   pool: "ObjectPool | None" = None) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Flatten checks into safetensors tensors (key -> CPU tensor) and JSON-ready records; with a ``pool``,
    extras of :data:`POOLED_KINDS` of at least :data:`POOL_MIN_BYTES` are written to it and referenced
    as ``"object:<digest>"``."""
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
        if check.extras:
            records[name]["extras"] = {what: _store_extra(tensors, what, tensor, name, pool)
                                       for what, tensor in sorted(check.extras.items())}
    return tensors, records


def _store_extra(tensors: dict[str, torch.Tensor], what: str, tensor: Any, check: str,
                 pool: "ObjectPool | None" = None) -> str:
    """Put one extra (a recorded input, weight or golden) into ``tensors`` under its content address
    ``"@<32 hex digits of its fingerprint>"`` — once, however many checks recorded the same tensor —
    and return that key; one of :data:`POOLED_KINDS` with at least :data:`POOL_MIN_BYTES` goes to ``pool``
    instead (key ``"object:<64 hex digits>"``, once per store)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"check {check!r} extra {what!r} is a {type(tensor).__name__}, not a tensor")
    if pool is not None and what.startswith(POOLED_KINDS) and tensor.numel() * tensor.element_size() >= POOL_MIN_BYTES:
        return OBJECT_REF + pool.put(tensor)
    copy = _cpu_copy(tensor)
    key = "@" + fingerprint_tensors(copy)[:32]
    tensors.setdefault(key, copy)
    return key


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_complex():
        t = t.resolve_conj()
    return t.resolve_neg().to("cpu", copy=True).contiguous()


def _tensor_hash(tensors: dict[str, torch.Tensor], records: dict[str, dict]) -> str:
    """``_checks_hash`` of the encoded checks; an extra in the pool counts as its key (``"object:<digest>"``,
    a string): the file's checksum covers which object it references, the object's name covers its bytes."""
    return _fingerprint_checks({name: ({leaf: tensors[key] for leaf, key in rec["leaves"].items()},
                                       {what: tensors[key] if key in tensors else key
                                        for what, key in (rec.get("extras") or {}).items()})
                                for name, rec in records.items()})


def _checks_hash(checks: dict[str, CheckBaseline]) -> str:
    """The checksum's tensor part: ``fingerprint_tensors`` of every check's leaves
    (``{check: {leaf: tensor}}``), with its extras under ``"@extras/<check>"`` when it has any (so a
    file without extras hashes as format version 2 did)."""
    return _fingerprint_checks({name: (c.tensors, c.extras) for name, c in checks.items()})


def _fingerprint_checks(parts: dict[str, tuple[dict, dict]]) -> str:
    tree: dict[str, dict] = {name: leaves for name, (leaves, _) in parts.items()}
    tree.update({f"@extras/{name}": extras for name, (_, extras) in parts.items() if extras})
    return fingerprint_tensors(tree)


#: Metadata fields the checksum covers, in this order (``content_hash`` itself excluded).
_HASHED_FIELDS = ("format", "format_version", "test_id", "provenance", "checks")


def _content_hash(metadata: dict[str, Any], tensor_hash: str) -> str:
    """The ``content_hash`` field: BLAKE2b (64 hex digits) over the metadata fields
    :data:`_HASHED_FIELDS` (their stored strings, length-prefixed) and the tensors' fingerprint."""
    hasher = hashlib.blake2b(digest_size=32, person=b"npu-parity-base")
    for key in _HASHED_FIELDS:
        value = metadata.get(key)
        for chunk in (key.encode(), ("\0" if value is None else "s" + str(value)).encode("utf-8", "surrogatepass")):
            hasher.update(len(chunk).to_bytes(8, "little"))
            hasher.update(chunk)
    hasher.update(tensor_hash.encode())
    return hasher.hexdigest()


def _same_content(old: Baseline, records: dict[str, dict], tensor_hash: str) -> bool:
    old_records = {
        name: {"leaves": None, "none_leaves": sorted(set(c.none_leaves)), "meta": _normalize(c.meta, "stored meta"),
               "extras": sorted(c.extras)}
        for name, c in old.checks.items()
    }
    new_records = {name: {**rec, "leaves": None, "extras": sorted(rec.get("extras") or {})} for name, rec in records.items()}
    if old_records != new_records:
        return False
    old_hash = old.tensor_hash or _checks_hash(old.checks)
    return old_hash == tensor_hash


def _normalize(value: Any, what: str) -> Any:
    return json.loads(_dumps(value, what))


def _dumps(value: Any, what: str) -> str:
    try:
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serializable: {exc}") from None


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def _structure_changes(packed: Any, structure: dict | Callable[[], dict] | None, prefix: Any) -> list[str]:
    """``structure.structure_changes`` of a recorded (packed) and the current record; a recorded
    record that cannot be read is itself a change (the checksum covers it, so only a writer of another
    layout can have produced it)."""
    from .structure import structure_changes, unpack_structure

    now = structure() if callable(structure) else structure
    if now is None:
        return []
    try:
        recorded = unpack_structure(packed)
    except ValueError as exc:
        return [f"structure changed (the recorded structure cannot be compared: {exc})"]
    return structure_changes(recorded, now, prefix=prefix if isinstance(prefix, str) else None)


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


# --------------------------------------------------------------------------------------------
# command line: python -m pytest_npu_parity baselines {prune,verify}


def _cli_parser() -> Any:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m pytest_npu_parity baselines",
        description="Housekeeping of a baseline store and its object pool (<baseline dir>/.objects/).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("prune", "delete the pool objects that no baseline file of the store references"),
                        ("verify", "read every baseline file of the store as a compare run does (checksum, and "
                                   "every pool object it references re-hashed) and list unreferenced objects")):
        cmd = sub.add_parser(name, help=help_, description=help_)
        cmd.add_argument("--baseline-dir", default="baselines", metavar="DIR",
                         help="the store root (default: ./baselines, the plugin's <rootdir>/baselines)")
        if name == "prune":
            cmd.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
            cmd.add_argument("--lock-timeout", type=float, default=60.0, metavar="S",
                             help="seconds to wait for a running --update-baselines to finish (default 60)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m pytest_npu_parity baselines {prune,verify} [--baseline-dir DIR]``; returns the exit code.

    * ``prune`` takes the store's :class:`StoreLock` (waiting up to ``--lock-timeout`` s for a record run),
      then deletes :meth:`SuiteStores.orphan_objects`; a baseline file whose header cannot be read stops it
      before anything is deleted (exit 1). ``--dry-run`` lists them only.
    * ``verify`` loads every baseline file and prints each problem (exit 1 if any).

    Exit codes: 0 done, 1 a problem named on stderr, 2 usage (argparse, or no such directory).
    """
    try:
        args = _cli_parser().parse_args(argv)
    except SystemExit as exc:  # --help -> 0, a bad option -> 2
        return int(exc.code or 0)
    stores = SuiteStores(args.baseline_dir)
    if not stores.root.is_dir():
        print(f"error: no baseline store at {_show(stores.root)} (give --baseline-dir DIR)", file=sys.stderr)
        return 2
    if args.command == "verify":
        bad = 0
        files = stores.baseline_files()
        for path in files:
            try:
                _read(path, pool=stores.pool)
            except BaselineError as exc:
                print(f"FAIL {exc}", file=sys.stderr)
                bad += 1
        try:
            orphans = stores.orphan_objects()
        except BaselineError:
            orphans = []
        print(f"{len(files)} baseline files, {len(files) - bad} read and verified, {bad} failed; "
              f"{len(stores.pool.objects())} pool objects, {len(orphans)} referenced by no file"
              + (" (python -m pytest_npu_parity baselines prune removes them)" if orphans else ""))
        return 1 if bad else 0
    lock = stores.lock()
    if not args.dry_run:
        try:
            lock.acquire(timeout=args.lock_timeout,
                         on_wait=lambda message: print(f"npu-parity: {message}", file=sys.stderr, flush=True))
        except (StoreLockedError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    try:
        found = stores.orphan_objects() if args.dry_run else stores.prune_objects()
    except BaselineError as exc:
        print(f"error: {exc}; nothing was deleted: fix or re-record that file, then prune again", file=sys.stderr)
        return 1
    finally:
        lock.release()
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(found)} unreferenced pool objects ({sum(size for _, size in found):,} bytes)")
    for path, size in found:
        print(f"  {_show(path)}  {size:,} bytes")
    return 0

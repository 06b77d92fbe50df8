"""The report's columns: the one place a report column is named and described.

Every column of ``results.parquet`` / ``results.csv`` / the history file is declared here once, as a
constant holding its name (``VERDICT = "verdict"``) and a ``Column`` row (name, value kind, one-line
description) in one of three ordered tables:

* ``ROW_TABLE`` — the row contract: one row per compared output leaf (``COLUMNS``);
* ``META_TABLE`` — the run metadata, repeated on every row (``META_COLUMNS``); ``run_id``,
  ``target``, ``target_name`` and ``reference`` are shared with the row contract;
* ``EXTRA_TABLE`` — further columns the check pipeline writes (group, weights, baseline errors,
  self-check, localization, layer check, xdist worker); the report keeps them after the table
  columns, in the order the rows give them, and never adds them to a table whose rows lack them.

Code that writes a row or a ``CheckRecord.extra`` key uses the constants (``columns.POLICY_NOTE``),
not a string literal. This module imports nothing beyond the standard library, so the check pipeline
can use it without loading pandas.

The reference page ``docs/reference/report-columns.md`` is generated from these tables::

    python -m pytest_npu_parity.report.columns > docs/reference/report-columns.md

(``tests/report/test_report.py`` fails when the page and the tables disagree.)
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

#: Value kinds: float64 metric, nullable Int64 count, text (``str`` or missing), JSON text, and (extra
#: columns only) a boolean.
FLOAT, INT, TEXT, JSON, BOOL = "float", "int", "text", "json", "bool"


@dataclass(frozen=True)
class Column:
    """One report column.

    Attributes:
        name: the column name (a key of a result row).
        kind: ``FLOAT`` (float64), ``INT`` (nullable ``Int64``), ``TEXT`` (``str`` or missing),
            ``JSON`` (a dict or list stored as JSON text) or ``BOOL``. ``to_frame`` converts the
            columns of ``ROW_TABLE`` and ``META_TABLE`` to their kind; an extra column keeps the
            values its rows give, so its kind documents what the writer puts there.
        description: one line, no newline.
    """

    name: str
    kind: str
    description: str


# --- names (one constant per column) ---

RUN_ID = "run_id"
TEST_ID = "test_id"
CHECK = "check"
LEAF = "leaf"
SUBMODULE = "submodule"
SUITE = "suite"
RECIPE = "recipe"
DTYPE = "dtype"
SHAPE = "shape"
NUMEL = "numel"
TARGET = "target"
TARGET_NAME = "target_name"
REFERENCE = "reference"
REFERENCE_PROVENANCE = "reference_provenance"
MAX_ABS = "max_abs"
MAX_REL = "max_rel"
REL_L2 = "rel_l2"
COSINE = "cosine"
ERR_RATIO = "err_ratio"
MISMATCHED = "mismatched"
MISMATCHED_FRAC = "mismatched_frac"
NONFINITE_MISMATCHED = "nonfinite_mismatched"
RTOL = "rtol"
ATOL = "atol"
BUDGET = "budget"
TOLERANCE_SOURCE = "tolerance_source"
TOLERANCE_REASON = "tolerance_reason"
POLICY = "policy"
GOLDEN_POLICY = "golden_policy"
POLICY_NOTE = "policy_note"
GOLDEN_DTYPE = "golden_dtype"
GOLDEN_WORST_METRIC = "golden_worst_metric"
GOLDEN_WORST_MARGIN = "golden_worst_margin"
MSPROBE_COSINE = "msprobe_cosine"
MSPROBE_EUC_DIST = "msprobe_euc_dist"
MSPROBE_MAX_ABS_ERR = "msprobe_max_abs_err"
MSPROBE_MAX_REL_ERR = "msprobe_max_rel_err"
MSPROBE_ONE_THOUSANDTH = "msprobe_one_thousandth"
MSPROBE_FIVE_THOUSANDTHS = "msprobe_five_thousandths"
MSPROBE_NOTE = "msprobe_note"
GOLDEN_MSPROBE_VERDICT = "golden_msprobe_verdict"
DISTRIBUTION_POLICY = "distribution_policy"
DIST_SAMPLE_DIM = "dist_sample_dim"
DIST_GROUPS = "dist_groups"
DIST_SAMPLES = "dist_samples"
DIST_EXPECTED_SAMPLES = "dist_expected_samples"
DIST_FEATURES = "dist_features"
DIST_PVALUE = "dist_pvalue"
DIST_ALPHA = "dist_alpha"
DIST_PERMUTATIONS = "dist_permutations"
DIST_MEAN_SHIFT = "dist_mean_shift"
DIST_QUANTILE_SHIFT = "dist_quantile_shift"
DIST_SPREAD_RATIO = "dist_spread_ratio"
DIST_MEAN = "dist_mean"
DIST_MEAN_PVALUE = "dist_mean_pvalue"
DIST_SPREAD = "dist_spread"
DIST_SPREAD_PVALUE = "dist_spread_pvalue"
DIST_QUANTILES = "dist_quantiles"
DIST_QUANTILES_PVALUE = "dist_quantiles_pvalue"
DIST_ENERGY = "dist_energy"
DIST_ENERGY_PVALUE = "dist_energy_pvalue"
PROBLEM = "problem"
VERDICT = "verdict"
AUDIT_MIXED_DEVICE = "audit_mixed_device"
AUDIT_H2D = "audit_h2d"
AUDIT_D2H = "audit_d2h"
AUDIT_HOST_SYNC = "audit_host_sync"
AUDIT_CPU_FALLBACK = "audit_cpu_fallback"
AUDIT_FP64 = "audit_fp64"
AUDIT_BUDGET = "audit_budget"
AUDIT_PROBLEM = "audit_problem"
AUDIT_VERDICT = "audit_verdict"
DURATION_S = "duration_s"
CREATED = "created"
GIT_REVISION = "git_revision"
MACHINE = "machine"
PYTHON = "python"
TORCH = "torch"
TORCH_NPU = "torch_npu"
CANN = "cann"
TRANSFORMERS = "transformers"
AURORA_MODEL = "aurora_model"
PLUGIN_VERSION = "plugin_version"
THREADS = "threads"
INTEROP_THREADS = "interop_threads"
RNG = "rng"
RECIPES = "recipes"
PRECISION_FLAGS = "precision_flags"
PATCH_SET = "patch_set"
REFERENCE_PATCH_SET = "reference_patch_set"
PYTEST_ARGS = "pytest_args"
GROUP = "group"
WEIGHTS = "weights"
LAYER_POLICY = "layer_policy"
LAYERS_JUDGED = "layers_judged"
LAYER_WORST = "layer_worst"
LAYER_WORST_REL_L2 = "layer_worst_rel_l2"
LAYERS_FAILING = "layers_failing"
BASELINE_ERROR = "baseline_error"
BASELINE_FILE = "baseline_file"
STALE_CAUSE = "stale_cause"
VACUOUS = "vacuous"
VACUOUS_OK = "vacuous_ok"
TEETH = "teeth"
TEETH_PROBLEM = "teeth_problem"
LOCALIZATION = "localization"
LOCALIZATION_S = "localization_s"
LOCALIZATION_REUSED = "localization_reused"
LOCALIZATION_SKIPPED = "localization_skipped"
LOCALIZATION_STOPPED = "localization_stopped"
LOCALIZATION_OPS = "localization_ops"
COUNTERFACTUAL = "counterfactual"
FP32_ISLANDS = "fp32_islands"
COUNTERFACTUAL_S = "counterfactual_s"
LOCALIZATION_BACKWARD = "localization_backward"
REPRO = "repro"
WORKER = "worker"
TRAJ_MEAN_REL = "traj_mean_rel"
TRAJ_LIMIT = "traj_limit"
TRAJ_PARTED_AT = "traj_parted_at"
TRAJ_MAX_STEP = "traj_max_step"
TRAJ_MEAN_REL_LOSS = "traj_mean_rel_loss"
TRAJ_LOSS_PARTED_AT = "traj_loss_parted_at"
TRAJ_GRAD_NORM_PARTED_AT = "traj_grad_norm_parted_at"
TRAJ_FIRST_LAYER = "traj_first_layer"
TRAJECTORY_SERIES = "trajectory_series"


#: The row contract: one row per compared output leaf, in table order.
ROW_TABLE: tuple[Column, ...] = (
    Column(RUN_ID, TEXT, "identifier of the parity run (one pytest session) the row belongs to"),
    Column(TEST_ID, TEXT, "pytest node id of the test that made the comparison"),
    Column(CHECK, TEXT, "name of the check (parity.check's first argument)"),
    Column(LEAF, TEXT, "path of the output leaf inside the check's output ('' for a bare tensor)"),
    Column(SUBMODULE, TEXT, "dotted name of the submodule under test ('' or missing for the whole model)"),
    Column(SUITE, TEXT, "parity suite of the test (e.g. 'aurora'); default: the folder under parity_suites/ or the test file"),
    Column(RECIPE, TEXT, "precision recipe the check ran under: fp32, bf16, bf16-weights, fp16"),
    Column(DTYPE, TEXT, "dtype of the target's output leaf (e.g. 'float32', 'bfloat16')"),
    Column(SHAPE, TEXT, "shape of the target's output leaf as 'AxBxC' ('' for 0-d)"),
    Column(NUMEL, INT, "number of elements of the leaf"),
    Column(TARGET, TEXT, "device under test (npu:0, cuda:0, cpu)"),
    Column(TARGET_NAME, TEXT, "human-readable target name (e.g. 'Ascend910B3')"),
    Column(REFERENCE, TEXT, "what the target was compared with: 'cpu' (live run) or 'baseline' ('recorded' when writing one)"),
    Column(REFERENCE_PROVENANCE, TEXT, "one line: where the reference came from (device, versions, date, file)"),
    Column(MAX_ABS, FLOAT, "max |actual - expected| in the tensor's units"),
    Column(MAX_REL, FLOAT, "max |actual - expected| / (|expected| + 1e-10), ours (not msprobe's: see msprobe_max_rel_err)"),
    Column(REL_L2, FLOAT, "||actual - expected||_2 / ||expected||_2"),
    Column(COSINE, FLOAT, "cosine similarity of actual and expected (1 = same direction; unrounded, 1 when both are all zero, 0 when one is)"),
    Column(ERR_RATIO, FLOAT, "max |a - e| / (atol + rtol*|e|) over elements; > 1 means out of tolerance"),
    Column(MISMATCHED, INT, "number of elements outside atol + rtol*|expected| (plus NaN/Inf position mismatches)"),
    Column(MISMATCHED_FRAC, FLOAT, "mismatched / numel"),
    Column(NONFINITE_MISMATCHED, INT, "elements where NaN/Inf positions or kinds differ between the sides"),
    Column(RTOL, FLOAT, "relative tolerance in force"),
    Column(ATOL, FLOAT, "absolute tolerance in force (tensor units)"),
    Column(BUDGET, FLOAT, "allowed fraction of mismatched elements"),
    Column(TOLERANCE_SOURCE, TEXT, "where the tolerance came from: default, ini, marker or check"),
    Column(TOLERANCE_REASON, TEXT, "why a non-default tolerance is justified (empty for defaults)"),
    Column(POLICY, TEXT, "verdict policy the check was judged by: allclose (rtol/atol/budget), golden or distribution"),
    Column(GOLDEN_POLICY, TEXT, "the golden policy's ratio limits (+ [source: reason] when not the default); empty for allclose"),
    Column(POLICY_NOTE, TEXT, "why a check that asked for the golden verdict was judged by allclose (no golden run possible)"),
    Column(GOLDEN_DTYPE, TEXT, "dtype of the golden run (float64 for fp32 work, float32 for bf16)"),
    Column(GOLDEN_WORST_METRIC, TEXT, "golden policy: the metric (rmse, max_rel, mean_rel, small_share, max_abs) nearest its limit"),
    Column(GOLDEN_WORST_MARGIN, FLOAT, "golden policy: that metric's target/reference error ratio divided by its limit; > 1 fails"),
    Column(MSPROBE_COSINE, FLOAT, "msprobe 26.2.0 dump compare's Cosine (empty where msprobe writes no number, see msprobe_note)"),
    Column(MSPROBE_EUC_DIST, FLOAT, "msprobe's EucDist: ||actual - expected||_2 after zeroing matched NaN/Inf"),
    Column(MSPROBE_MAX_ABS_ERR, FLOAT, "msprobe's MaxAbsErr (rounded to 12 decimals as msprobe does)"),
    Column(MSPROBE_MAX_REL_ERR, FLOAT, "msprobe's MaxRelativeErr: max |(a - e) / e| in float32 (fp64: float64), eps added to both where e = 0"),
    Column(MSPROBE_ONE_THOUSANDTH, FLOAT, "msprobe's One Thousandth Err Ratio: share of elements with msprobe relative error < 0.001"),
    Column(MSPROBE_FIVE_THOUSANDTHS, FLOAT, "msprobe's Five Thousandths Err Ratio: share with msprobe relative error < 0.005"),
    Column(MSPROBE_NOTE, TEXT, "msprobe's marker for cells without a number (unsupported, N/A, Nan) and why"),
    Column(GOLDEN_MSPROBE_VERDICT, TEXT, "golden msprobe policy: msprobe's own benchmark verdict (pass/error), without our NaN/Inf rule"),
    Column(DISTRIBUTION_POLICY, TEXT, "distribution verdict of a sampling check whose sides drew their own noise (alpha, permutations); empty otherwise"),
    Column(DIST_SAMPLE_DIM, INT, "distribution verdict: the sample axis of the leaf"),
    Column(DIST_GROUPS, INT, "distribution verdict: groups (conditioning inputs) compared, each with its own distribution"),
    Column(DIST_SAMPLES, INT, "distribution verdict: target samples per group"),
    Column(DIST_EXPECTED_SAMPLES, INT, "distribution verdict: reference samples per group"),
    Column(DIST_FEATURES, INT, "distribution verdict: features (steps) per sample"),
    Column(DIST_PVALUE, FLOAT, "distribution verdict: combined permutation p-value (maxT over the four statistics); <= dist_alpha fails"),
    Column(DIST_ALPHA, FLOAT, "distribution verdict: the false-failure rate the check allows"),
    Column(DIST_PERMUTATIONS, INT, "distribution verdict: permutations of the test"),
    Column(DIST_MEAN_SHIFT, FLOAT, "distribution verdict: largest |difference of per-step means| in pooled standard deviations"),
    Column(DIST_QUANTILE_SHIFT, FLOAT, "distribution verdict: largest |difference of per-step quantiles| in pooled standard deviations"),
    Column(DIST_SPREAD_RATIO, FLOAT, "distribution verdict: geometric mean over steps of std(target) / std(reference)"),
    Column(DIST_MEAN, FLOAT, "distribution statistic: mean squared difference of standardized per-step means"),
    Column(DIST_MEAN_PVALUE, FLOAT, "its marginal permutation p-value"),
    Column(DIST_SPREAD, FLOAT, "distribution statistic: |mean log ratio of per-step standard deviations|"),
    Column(DIST_SPREAD_PVALUE, FLOAT, "its marginal permutation p-value"),
    Column(DIST_QUANTILES, FLOAT, "distribution statistic: mean squared difference of the two empirical CDFs at the pooled quantiles"),
    Column(DIST_QUANTILES_PVALUE, FLOAT, "its marginal permutation p-value"),
    Column(DIST_ENERGY, FLOAT, "distribution statistic: energy distance of the standardized samples (Szekely & Rizzo), mean over groups"),
    Column(DIST_ENERGY_PVALUE, FLOAT, "its marginal permutation p-value"),
    Column(PROBLEM, TEXT, "structural failure (missing leaf, shape or dtype mismatch, exception); metrics NaN then"),
    Column(VERDICT, TEXT, "pass, fail (out of tolerance or structural problem), error (the check did not run) or recorded"),
    Column(AUDIT_MIXED_DEVICE, INT, "ops on the target that mixed devices (per check: repeated on each of its leaf rows)"),
    Column(AUDIT_H2D, INT, "host-to-device copies during the target run (per check)"),
    Column(AUDIT_D2H, INT, "device-to-host copies during the target run (per check)"),
    Column(AUDIT_HOST_SYNC, INT, "host syncs (.item(), .cpu(), .numpy(), ...) during the target run (per check)"),
    Column(AUDIT_CPU_FALLBACK, INT, "ops that fell back to the CPU during the target run (per check)"),
    Column(AUDIT_FP64, INT, "fp64 tensors created on the target (NPUs downcast fp64 to fp32) (per check)"),
    Column(AUDIT_BUDGET, TEXT, "the audit budget the check was judged by (--parity-audit, --parity-audit-mode fail|warn), e.g. 'h2d 0, host_sync any, …'"),
    Column(AUDIT_PROBLEM, TEXT, "the audit events beyond the check's budget: op, devices, dtype and source line, one per line"),
    Column(AUDIT_VERDICT, TEXT, "what the events beyond the audit budget did: fail (failed the check) or warn; empty within budget"),
    Column(DURATION_S, FLOAT, "wall time of the check in seconds (reference + target + compare)"),
)

#: Run metadata (one dict per run), repeated as columns on every row of results and history tables.
META_TABLE: tuple[Column, ...] = (
    Column(RUN_ID, TEXT, "identifier of the run"),
    Column(CREATED, TEXT, "UTC time the run started, ISO 8601"),
    Column(GIT_REVISION, TEXT, "revision of the code under test"),
    Column(MACHINE, TEXT, "host name / machine description of the runner"),
    Column(PYTHON, TEXT, "Python version"),
    Column(TORCH, TEXT, "torch version"),
    Column(TORCH_NPU, TEXT, "torch_npu version ('' when not installed)"),
    Column(CANN, TEXT, "CANN toolkit version ('' off Ascend)"),
    Column(TRANSFORMERS, TEXT, "transformers version"),
    Column(AURORA_MODEL, TEXT, "aurora-model version"),
    Column(PLUGIN_VERSION, TEXT, "pytest-npu-parity version"),
    Column(THREADS, TEXT, "torch intra-op threads of the run (torch.get_num_threads(); bf16 CPU results depend on it)"),
    Column(INTEROP_THREADS, TEXT, "torch inter-op threads of the run (torch.get_num_interop_threads())"),
    Column(TARGET, TEXT, "device under test of the run"),
    Column(TARGET_NAME, TEXT, "human-readable target name"),
    Column(REFERENCE, TEXT, "cpu (live) or baseline"),
    Column(RNG, TEXT, "random streams of sampling checks: shared (one CPU stream) or device (each side its own; distribution verdicts)"),
    Column(RECIPES, JSON, "recipes of the run (JSON list)"),
    Column(PRECISION_FLAGS, JSON, "precision flags in force (JSON object: TF32/HF32 switches, matmul precision)"),
    Column(PATCH_SET, JSON, "names of the adaptation patches applied (JSON list)"),
    Column(REFERENCE_PATCH_SET, JSON, "names of the patches the reference side ran under (JSON list; the suite's "
                                      "parity_reference_patches, e.g. bf16 weights upstream cannot run)"),
    Column(PYTEST_ARGS, JSON, "the pytest command line arguments (JSON list, or one string)"),
)

#: Further columns the check pipeline writes (empty where their feature did not run); a report table keeps
#: them after the table columns, in the rows' order, values as given.
EXTRA_TABLE: tuple[Column, ...] = (
    Column(GROUP, TEXT, "what the check is counted under in the terminal summary: its group=, else its submodule, else its name"),
    Column(WEIGHTS, TEXT, "first 16 hex digits of the fingerprint of the module the check ran (provenance.fingerprint_module); empty for a function"),
    Column(LAYER_POLICY, TEXT, "layer check: the layer policy the check's weighted submodules were judged by (layers)"),
    Column(LAYERS_JUDGED, INT, "layer check: how many layers were judged"),
    Column(LAYER_WORST, TEXT, "layer check: the layer nearest its limit"),
    Column(LAYER_WORST_REL_L2, FLOAT, "layer check: that layer's rel_l2"),
    Column(LAYERS_FAILING, TEXT, "layer check: the layers beyond the policy's limit, comma-separated (failing checks only)"),
    Column(BASELINE_ERROR, TEXT, "why the stored baseline could not be used: missing, stale, corrupt, unsafe or unreadable (error rows)"),
    Column(BASELINE_FILE, TEXT, "the baseline file that could not be used"),
    Column(STALE_CAUSE, TEXT, "what a stale baseline's recorded fingerprints say changed: weights, config, input joined by '+', or other"),
    Column(VACUOUS, TEXT, "why the check is vacuous: its reference output does not react to its inputs (selfcheck.vacuity_problem)"),
    Column(VACUOUS_OK, TEXT, "the reason given (vacuous_ok=) for accepting a vacuous check"),
    Column(TEETH, BOOL, "--parity-selfcheck: whether the check catches a perturbed target output (True) or not"),
    Column(TEETH_PROBLEM, TEXT, "--parity-selfcheck: what the check failed to catch (checks without teeth)"),
    Column(LOCALIZATION, JSON, "first-divergence table of a failing check (JSON list of rows; on the check's first row only)"),
    Column(LOCALIZATION_S, FLOAT, "seconds the check's localization took (first row only)"),
    Column(LOCALIZATION_REUSED, TEXT, "the check whose localization answered this one (first row only)"),
    Column(LOCALIZATION_SKIPPED, TEXT, "why localization did not run: budget (spent) or structure (outputs do not match) (first row only)"),
    Column(LOCALIZATION_STOPPED, TEXT, "budget: the localization descent stopped between levels (first row only)"),
    Column(LOCALIZATION_OPS, JSON, "op table of the module where the localization ended (under a golden verdict: of "
           "the counterfactual's root-cause module): each op's local error vs its float64 CPU golden, the first "
           "culprit op first; then, where the reference and target op streams differ, the ops of their first "
           "difference (kind op_stream: side, change inserted/removed/replaced/dtype/shape) (JSON list of rows; "
           "first row only)"),
    Column(COUNTERFACTUAL, JSON, "what makes a failing check pass: one row per counterfactual re-run of its target "
           "(suspect: a submodule, the patch set, or some of its patches turned off (`patches`, the bisection's "
           "groups marked `split`); modification, error before/after, share of the error that disappears, root "
           "cause/contributing/no effect; precision-island runs last) (JSON list of rows; first row only)"),
    Column(FP32_ISLANDS, TEXT, "the verified precision-island fix of a failing 16-bit check: submodules, comma-separated, "
           "whose float32 run makes it pass (pytest_npu_parity.fp32_islands; first row only)"),
    Column(COUNTERFACTUAL_S, FLOAT, "seconds the counterfactual re-runs and the precision-island search took (first row only)"),
    Column(LOCALIZATION_BACKWARD, JSON, "backward table of a failing train step, layer by layer in backward order: "
           "grad_output (inherited), param grad and grad_input (total) and local error, verdict (JSON list of rows; "
           "first row only)"),
    Column(REPRO, TEXT, "--parity-repro: the folder holding the check's standalone repro (inputs, weights, expected and actual outputs, repro.py)"),
    Column(WORKER, TEXT, "pytest-xdist worker that ran the check (gw0, gw1, ...); absent without xdist"),
    Column(TRAJ_MEAN_REL, FLOAT, "trajectory check: the curve's mean relative error over all steps (leaf = the curve: "
           "loss, grad_norm, layer_grad_norm.<module>)"),
    Column(TRAJ_LIMIT, FLOAT, "trajectory check: the curve's limit on that mean (empty: reported, not judged)"),
    Column(TRAJ_PARTED_AT, INT, "trajectory check: first step whose 10-step trailing mean relative error exceeds the "
           "limit (empty: none)"),
    Column(TRAJ_MAX_STEP, INT, "trajectory check: the step of the curve's largest relative error (max_rel)"),
    Column(TRAJ_MEAN_REL_LOSS, FLOAT, "trajectory check: mean relative loss error, the verdict's number (first row only)"),
    Column(TRAJ_LOSS_PARTED_AT, INT, "trajectory check: step where the loss curves part (first row only)"),
    Column(TRAJ_GRAD_NORM_PARTED_AT, INT, "trajectory check: step where the global grad-norm curves part (first row only)"),
    Column(TRAJ_FIRST_LAYER, TEXT, "trajectory check: the module whose gradient-norm curve parts first, and the step "
           "(first row only)"),
    Column(TRAJECTORY_SERIES, JSON, "trajectory check: the loss and grad_norm curves of both sides, "
           "{curve: [target, reference]} (first row only; the report plots them)"),
)


#: Row contract: name -> one-line description, in table order.
COLUMNS: dict[str, str] = {c.name: c.description for c in ROW_TABLE}
#: Run metadata: name -> one-line description.
META_COLUMNS: dict[str, str] = {c.name: c.description for c in META_TABLE}
#: Further pipeline columns: name -> one-line description.
EXTRA_COLUMNS: dict[str, str] = {c.name: c.description for c in EXTRA_TABLE}

#: Columns every row must have.
REQUIRED = (TEST_ID, CHECK, LEAF, VERDICT)
#: Allowed verdicts; ``fail`` and ``error`` count as failing. ``recorded``: a baseline was written
#: (``--update-baselines``), nothing was compared.
VERDICTS = ("pass", "fail", "error", "recorded")
FAILING = ("fail", "error")
#: A leaf is "the same comparison" across runs when these match (plus the target's device type).
HISTORY_KEY = (TEST_ID, CHECK, LEAF, RECIPE)

#: Row columns by value kind (``to_frame`` converts them), and the metadata stored as JSON text.
FLOAT_COLUMNS = frozenset(c.name for c in ROW_TABLE if c.kind == FLOAT)
INT_COLUMNS = frozenset(c.name for c in ROW_TABLE if c.kind == INT)
JSON_META = frozenset(c.name for c in META_TABLE if c.kind == JSON)
#: The audit's per-check event counts.
AUDIT_COLUMNS = (AUDIT_MIXED_DEVICE, AUDIT_H2D, AUDIT_D2H, AUDIT_HOST_SYNC, AUDIT_CPU_FALLBACK, AUDIT_FP64)


def all_columns() -> list[str]:
    """The columns of a normalized report table, in order: ``COLUMNS``, then the ``META_COLUMNS``
    not among them (extra columns follow in a table, but are not listed here)."""
    return list(COLUMNS) + [c for c in META_COLUMNS if c not in COLUMNS]


def _check_tables() -> None:
    """Fail at import when a table names a column twice or a description spans lines."""
    for table in (ROW_TABLE, META_TABLE, EXTRA_TABLE):
        names = [c.name for c in table]
        if len(names) != len(set(names)):
            raise AssertionError(f"a report column table names a column twice: {names}")
        for c in table:
            if not c.description or "\n" in c.description:
                raise AssertionError(f"report column {c.name!r} needs a one-line description")
    shared = set(EXTRA_COLUMNS) & (set(COLUMNS) | set(META_COLUMNS))
    if shared:
        raise AssertionError(f"extra columns {sorted(shared)} are also table columns")


_check_tables()

_KIND_TEXT = {FLOAT: "float", INT: "int", TEXT: "text", JSON: "JSON text", BOOL: "bool"}


def _md_rows(table: tuple[Column, ...]) -> list[str]:
    lines = ["| column | type | description |", "|---|---|---|"]
    for c in table:
        text = c.description.replace("|", "\\|")  # a pipe would end the Markdown cell
        lines.append(f"| `{c.name}` | {_KIND_TEXT[c.kind]} | {text} |")
    return lines


def reference_markdown() -> str:
    """The reference page of the report's columns (``docs/reference/report-columns.md``) as
    Markdown text ending in a newline: one table per column table, in table order."""
    lines = [
        "# Report columns",
        "",
        "<!-- Generated from pytest_npu_parity/report/columns.py; do not edit by hand. Regenerate with:",
        "     python -m pytest_npu_parity.report.columns > docs/reference/report-columns.md -->",
        "",
        "The columns of `results.parquet`, `results.csv` and the history file written by `--parity-report`",
        "and `--parity-history`. Types: float (float64, NaN when missing), int (nullable integer),",
        "text (missing when empty), JSON text (a list or object written as JSON).",
        "",
        "## One row per compared output leaf",
        "",
        *_md_rows(ROW_TABLE),
        "",
        "## Run metadata (repeated on every row)",
        "",
        "`run_id`, `target`, `target_name` and `reference` are also row columns (above).",
        "",
        *_md_rows(META_TABLE),
        "",
        "## Further columns written by the check pipeline",
        "",
        "Rows made by the plugin carry these after the columns above, in the order the rows give them and",
        "with the values the rows give (no conversion). A column is empty where its feature did not run,",
        "and absent from a table whose rows never had it.",
        "",
        *_md_rows(EXTRA_TABLE),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    """``python -m pytest_npu_parity.report.columns``: print the reference page to stdout."""
    sys.stdout.write(reference_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every command-line option and ini key of the plugin: ONE declarative table, parsed once.

``table()`` lists each setting with its flag, dest, ini key, default and help; ``pytest_addoption``
(``add_options``) is generated from it, and so is the options reference (``markdown()``;
``python -m pytest_npu_parity.plugin.options_md > docs/reference/options.md``); ``Raw`` holds the values
as pytest read them. At ``pytest_configure`` ``config.ParityConfig.load`` reads every value once and
validates it (a bad value is a ``pytest.UsageError`` naming the option or ini key); the frozen result
sits in ``config.stash[state.CONFIG_KEY]`` and every other part of the plugin reads it instead of
calling ``getoption``/``getini``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import pytest

from ..budgets import DEFAULT_BUDGET_S

#: Keyword arguments of ``@pytest.mark.parity``.
MARKER_KEYS = ("rtol", "atol", "budget", "reason", "recipes", "vacuous_ok", "policy", "audit", "audit_budget",
               "train_store", "layers")
#: Largest seed (``--parity-seed``, ini ``parity_seed``): torch generators take 64-bit seeds, numpy
#: and the shared random stream signed 64-bit ones.
MAX_SEED = 2**63 - 1
#: Recipes with their own ini ``parity_<recipe>_tolerance`` / ``parity_<recipe>_policy`` keys
#: (``bf16-weights`` follows ``bf16``).
OVERRIDABLE_RECIPES = ("fp32", "bf16", "fp16")
#: Each overridable recipe's default verdict policy, as ``--help`` words it (``checks.settings.DEFAULT_POLICIES`` and
#: ``TRAINING_DEFAULT_POLICIES`` decide; a test holds the two together: this module does not import torch).
POLICY_DEFAULTS = {"fp32": "allclose, golden floor for training checks", "bf16": "golden floor",
                   "fp16": "golden floor"}
#: The command that writes the options reference from ``table()``.
REGENERATE = "python -m pytest_npu_parity.plugin.options_md > docs/reference/options.md"
#: The order ``pytest --help`` lists the ini keys in (the options follow ``table()``'s order).
INI_ORDER = ("parity_device", "parity_audit", "parity_reference", "parity_dtypes", "parity_baseline_dir",
             "parity_seed", "parity_rng", "parity_lock_timeout", "parity_replay_limit", "parity_worker_devices", "parity_localize_budget",
             "parity_paths", "parity_tolerances", *(f"parity_{r}_{k}" for r in OVERRIDABLE_RECIPES
                                                   for k in ("tolerance", "policy")),
             "parity_deepspeed_config", "parity_layers", "parity_train_store", "parity_policies")
GROUP = ("npu-parity", "numerical parity of a target device (NPU/CUDA/CPU) with a reference")


@dataclass(frozen=True)
class Setting:
    """One row of the table: a command-line option, an ini key, or both (the option wins).

    Attributes:
        flag: the option (``--parity-device``), or None for an ini key only.
        dest: the option's dest (``config.getoption`` name), or None.
        ini: the ini key, or None for an option only.
        help: the option's help (or the ini key's, without an option).
        ini_help: the ini key's help when it has an option too.
        default: the option's default (``store_true`` options: False).
        ini_default: the ini key's default (a string, or a list for ``linelist``).
        ini_type: pytest's ini type (``linelist``), or None for a string.
        kwargs: further ``addoption`` arguments (``action``, ``choices``, ``type``, ``metavar``).
        parse: the validator ``(value, where) -> parsed`` of a setting parsed on its own (``where``: the
            flag or ``ini <key>`` the value came from, as the error message names it), or None for the
            settings ``config.ParityConfig.load`` combines with others (policies, tolerances, audit, paths).
    """

    flag: str | None = None
    dest: str | None = None
    ini: str | None = None
    help: str = ""
    ini_help: str | None = None
    default: Any = None
    ini_default: Any = None
    ini_type: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    parse: Callable[[Any, str], Any] | None = None


# -- validators of single settings (each raises pytest.UsageError with the sentence users see) -----------


def _parse_reference(value: Any, where: str) -> str:
    if value not in ("auto", "cpu", "baseline"):
        raise pytest.UsageError(f"ini parity_reference={value!r}: use auto, cpu or baseline")
    return value


def _parse_rng(value: Any, where: str) -> str:
    if value not in ("shared", "device"):
        raise pytest.UsageError(f"ini parity_rng={value!r}: use shared or device")
    return value


def _parse_seed(value: Any, where: str) -> int:
    try:
        seed = int(str(value).strip())
    except ValueError:
        raise pytest.UsageError(f"{where}={value!r} is not an integer; use an integer from 0 to {MAX_SEED}") from None
    if not 0 <= seed <= MAX_SEED:
        raise pytest.UsageError(f"{where}={seed} is out of range; use an integer from 0 to 2**63-1 ({MAX_SEED})")
    return seed


def _parse_localize_budget(value: Any, where: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not (seconds >= 0 and seconds != float("inf")):
        raise pytest.UsageError(f"{where}={value!r}: give the seconds localization may take in this session, a "
                                "number >= 0 (0 turns it off); --parity-localize localizes the selected tests "
                                "whatever the budget")
    return seconds


def _parse_lock_timeout(value: Any, where: str) -> float:
    try:
        seconds = float(value)
        if not 0 <= seconds < float("inf"):  # also refuses nan
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"ini parity_lock_timeout={value!r}: give seconds, a finite number >= 0") from None
    return seconds


def _parse_replay_limit(value: Any, where: str) -> int:
    """``parity_replay_limit``: MiB (a number >= 0) -> bytes."""
    try:
        mib = float(value)
        if not mib >= 0 or mib == float("inf"):
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"ini parity_replay_limit={value!r}: give MiB, a finite number >= 0 "
                                "(0 records nothing for replay)") from None
    return int(mib * 2**20)


def _parse_audit_ini(value: Any, where: str) -> str:
    value = str(value or "off").strip().lower()
    if value not in ("off", "fail", "warn"):
        raise pytest.UsageError(f"ini parity_audit={value!r}: use off, fail or warn")
    return value


def _parse_recipes(value: Any, where: str) -> tuple[str, ...]:
    from ..runtime.recipes import parse_recipes  # engine modules import torch: only when a value is parsed

    try:
        return tuple(r.name for r in parse_recipes(value))
    except ValueError as exc:  # the engine names the option; an ini value is named by its key
        message = str(exc)
        if where.startswith("ini ") and message.startswith("--parity-dtypes"):
            message = where + message[len("--parity-dtypes"):]
        raise pytest.UsageError(message) from None


def _parse_layers(value: Any, where: str) -> Any:
    from ..judge.layers import parse_layer_spec

    if value is None or not str(value).strip():
        return "default"
    try:
        return parse_layer_spec(value, source="option" if where.startswith("--") else "ini")
    except ValueError as exc:
        raise pytest.UsageError(f"{where}={value!r}: {exc}") from None


def _parse_train_store(value: Any, where: str) -> Any:
    from ..store.compact import parse_train_store

    try:
        return parse_train_store(value, source="ini")
    except ValueError as exc:
        raise pytest.UsageError(f"ini parity_train_store={value!r}: {exc}") from None


def _default_budget() -> float:
    return DEFAULT_BUDGET_S


_POLICY_HELP = (
    "verdict policy of every recipe and check: allclose (rtol/atol/budget), golden (target and "
    "reference errors against a higher-precision CPU golden run, ratio limits 2/10/2/2) or "
    "golden-floor (golden, a leaf within allclose passes, no element over 100x its bound; the default of bf16, "
    "fp16 and fp32 training checks; fp32 eval checks default to allclose; "
    "'golden msprobe op=…' in ini or the marker for msprobe 26.2.0's standard); replaces ini parity_<recipe>_policy, "
    "while ini parity_policies lines, the marker's policy= and parity.check(policy=...) still choose per check")


@functools.cache
def table() -> tuple[Setting, ...]:
    """Every option and ini key, in ``--help`` order (options first, then ini keys only).

    Built on first use; nothing it needs imports torch (``budgets``).
    """
    budget = _default_budget()
    rows = [
        Setting("--npu-parity", "npu_parity", None, kwargs={"action": "store_true"}, default=False,
                help="run the parity suites (tests using the 'parity' fixture); they are skipped otherwise"),
        Setting("--parity-device", "parity_device", "parity_device", kwargs={"metavar": "DEVICE"},
                help="target device: auto (npu > cuda > cpu), npu, npu:N, cuda, cuda:N or cpu "
                     "(default: ini parity_device or auto); an absent device is an error",
                ini_help="default for --parity-device", ini_default="auto"),
        Setting("--parity-reference", "parity_reference", "parity_reference",
                kwargs={"choices": ("auto", "cpu", "baseline")}, parse=_parse_reference,
                help="what the target is compared with: auto (stored baseline when one exists for the "
                     "check, else a live CPU run), cpu (always a live CPU run) or baseline (a missing "
                     "baseline fails). Default: ini parity_reference or auto",
                ini_help="default for --parity-reference", ini_default="auto"),
        Setting("--parity-dtypes", "parity_dtypes", "parity_dtypes", kwargs={"metavar": "RECIPES"},
                parse=_parse_recipes,
                help="comma-separated recipes to run every parity test under: fp32, bf16, bf16-weights, "
                     "fp16 (autocast fp16; training steps with a dynamic GradScaler) "
                     "(default: ini parity_dtypes or fp32,bf16)",
                ini_help="default for --parity-dtypes", ini_default="fp32,bf16"),
        Setting("--update-baselines", "update_baselines", None, kwargs={"action": "store_true"}, default=False,
                help="record mode: run each check's reference computation on --parity-device and write "
                     "it to the baseline store (implies --npu-parity)"),
        Setting("--parity-store-goldens", "parity_store_goldens", None, kwargs={"action": "store_true"},
                default=False,
                help="compare run: add the golden that each golden-judged check computes live (its baseline "
                     "entry stores none, e.g. recorded before goldens were stored) to that entry, its reference "
                     "leaves untouched, so later compare runs run no golden; not where the stored reference, "
                     "judged against a live CPU run of the check, is far beyond the verdict's limits (a sign the "
                     "computation changed since the recording) or that run fails: the check's note says why"),
        Setting("--baseline-dir", "baseline_dir", "parity_baseline_dir", kwargs={"metavar": "DIR"},
                help="baseline store root (default: ini parity_baseline_dir or <rootdir>/baselines)",
                ini_help="default for --baseline-dir (relative to rootdir)", ini_default="baselines"),
        Setting("--parity-report", "parity_report", None, kwargs={"metavar": "DIR"},
                help="write results.parquet/csv, summary.md and report.html for this session to DIR"),
        Setting("--parity-repro", "parity_repro", None, kwargs={"metavar": "DIR"},
                help="write a standalone repro of every failing check to DIR/<test id>/<check>/: the culprit's "
                     "inputs as the target received them, its weights, the expected and the target's outputs "
                     "(safetensors) and repro.py, which replays the culprit (the op or module the localization "
                     "named) on --device with torch alone and prints the check's metrics and verdict"),
        Setting("--parity-history", "parity_history", None, kwargs={"metavar": "PATH"},
                help="append this run's results to the history file PATH (trends, new failures)"),
        Setting("--parity-seed", "parity_seed", "parity_seed", kwargs={"type": int, "metavar": "N"},
                parse=_parse_seed,
                help="seed of the shared random stream of every check (default: ini parity_seed or 0)",
                ini_help="default for --parity-seed", ini_default="0"),
        Setting("--parity-rng", "parity_rng", "parity_rng", kwargs={"choices": ("shared", "device")},
                parse=_parse_rng,
                help="randomness of sampling checks (parity.check(..., sample_dim=...)): shared (one seeded "
                     "CPU stream for both sides, samples compared one by one; the default) or device (each "
                     "side draws from its own device's generator; the samples are judged as distributions: "
                     "per-step mean and spread, quantiles and energy distance in one permutation test). "
                     "Other checks always share the stream. Default: ini parity_rng or shared",
                ini_help="default for --parity-rng (shared or device)", ini_default="shared"),
        Setting("--parity-layers", "parity_layers", "parity_layers", kwargs={"metavar": "LIMIT"}, parse=_parse_layers,
                help="layer check of fp32 checks: every weighted submodule's output (sampled) within this "
                     "relative L2 error of the reference's, besides the outputs' tolerance; 'off' to judge "
                     "outputs only (default: ini parity_layers or 1e-5). Other recipes: "
                     "@pytest.mark.parity(layers=LIMIT)",
                ini_help="default for --parity-layers: the layer check's relative L2 limit of fp32 checks, or "
                         "'off' (default 1e-5)", ini_default=""),
        Setting("--parity-worker-devices", "parity_worker_devices", "parity_worker_devices",
                kwargs={"metavar": "INDICES"},
                help="pytest-xdist: comma-separated device indices, worker gwK runs on entry K mod n "
                     "(default: ini parity_worker_devices, else gwK runs on index K mod device count)",
                ini_help="default for --parity-worker-devices", ini_default=""),
        Setting("--parity-policy", "parity_policy", None,
                kwargs={"choices": ("allclose", "golden", "golden-floor")}, help=_POLICY_HELP),
        Setting("--parity-audit", "parity_audit", "parity_audit", kwargs={"action": "store_true"}, default=False,
                help="audit device propagation of every target run (an extra run on a CPU target): events "
                     "beyond a check's audit budget (default: no mixed-device op, host<->device copy, CPU op "
                     "or float64 on the target; host syncs allowed) fail it, or warn with --parity-audit-mode "
                     "warn (default: ini parity_audit, off)",
                ini_help="device-propagation audit of every target run: off (default), fail or warn "
                         "(see --parity-audit, --parity-audit-mode)", ini_default="off"),
        Setting("--parity-audit-mode", "parity_audit_mode", None, kwargs={"choices": ("fail", "warn", "off")},
                help="what the audit does with events beyond a check's budget: fail the check or warn; off "
                     "turns the audit off (a mode other than off implies --parity-audit)"),
        Setting("--parity-localize", "parity_localize", None, kwargs={"action": "store_true"}, default=False,
                help="localize the first divergence of every failing check of the selected tests, and run "
                     "its counterfactual re-runs, whatever the localization budget (e.g. with -k NAME or a node id)"),
        Setting("--parity-localize-budget", "parity_localize_budget", "parity_localize_budget",
                kwargs={"metavar": "SECONDS"}, parse=_parse_localize_budget,
                help="wall seconds a session may spend localizing failing checks (first-divergence tables, "
                     "and the counterfactual re-runs and fp32 precision islands of 'what makes it pass'); "
                     "later failures say they were not localized and how to localize one; 0 turns "
                     f"localization off (default: ini parity_localize_budget or {budget:g})",
                ini_help="default for --parity-localize-budget (seconds)", ini_default=str(budget)),
        Setting("--parity-selfcheck", "parity_selfcheck", None, kwargs={"action": "store_true"}, default=False,
                help="prove every check has teeth: after it passes, perturb the target's output (and, for a "
                     "module, one weight) beyond the tolerance and require a failure; also require the "
                     "reference to react to its inputs (about two extra runs per check; see selfcheck)"),
        Setting(ini="parity_lock_timeout", ini_default="1800", parse=_parse_lock_timeout,
                help="seconds a record run waits for another record run on the same baseline store to finish "
                     "(default 1800)"),
        Setting(ini="parity_replay_limit", ini_default="16", parse=_parse_replay_limit,
                help="MiB of inputs and weights a recorded check may store for replay on a machine whose random "
                     "draws differ (checks.replay; default 16, 0 records none); larger weights are not recorded "
                     "and the recording says to seed them with stable_init_ or load a checkpoint"),
        Setting(ini="parity_paths", ini_type="linelist", ini_default=["parity_suites"],
                help="what --update-baselines runs when given no path"),
        Setting(ini="parity_tolerances", ini_type="linelist", ini_default=[],
                help="per-check tolerance overrides, one per line: "
                     "'<check name or glob>: rtol=1e-4 atol=1e-4 budget=0 # reason'"),
    ]
    for recipe in OVERRIDABLE_RECIPES:
        rows.append(Setting(ini=f"parity_{recipe}_tolerance", ini_default="",
                            help=f"override of the {recipe} default tolerance, e.g. 'rtol=1e-5 atol=1e-5 # reason'"))
        rows.append(Setting(ini=f"parity_{recipe}_policy", ini_default="",
                            help=f"verdict policy of {recipe} checks{' (and bf16-weights)' if recipe == 'bf16' else ''}: "
                                 "'allclose', 'golden [rmse=2 max_rel=10 mean_rel=2 small=2] [# reason]' or "
                                 f"'golden floor [...]'; default {POLICY_DEFAULTS[recipe]}"))
    rows += [
        Setting(ini="parity_deepspeed_config", ini_default="",
                help="a DeepSpeed JSON config (relative to rootdir) to lint by the Ascend guide's rules at start-up "
                     "(bf16 on, fp16 off, no communication_backend, no aio): a summary in the header, each "
                     "finding a PytestConfigWarning; a missing or non-JSON file is a usage error"),
        Setting(ini="parity_train_store", ini_default="full", parse=_parse_train_store,
                help="how training-step baselines keep gradients and parameters: 'full' (default) or 'summary "
                     "[min_numel=65536] [samples=4096]' (leaves with at least min_numel elements stored as that "
                     "many sampled elements plus sum, L2 norm, max |x| and a position-weighted sum)"),
        Setting(ini="parity_policies", ini_type="linelist", ini_default=[],
                help="per-check verdict policy, one per line: '<check name or glob>: golden [rmse=3 …] # reason' "
                     "or '<check name or glob>: allclose'"),
    ]
    return tuple(rows)


def add_options(parser: pytest.Parser) -> None:
    """``pytest_addoption``: every row of ``table()`` as an option of the npu-parity group and/or an ini key."""
    group = parser.getgroup(*GROUP)
    rows = table()
    for row in rows:
        if row.flag is not None:
            group.addoption(row.flag, dest=row.dest, default=row.default, help=row.help, **row.kwargs)
    by_key = {row.ini: row for row in rows if row.ini is not None}
    for row in (by_key[key] for key in INI_ORDER):
        parser.addini(row.ini, row.ini_help if row.flag is not None else row.help,
                      **({"type": row.ini_type} if row.ini_type else {}), default=row.ini_default)


# -- reading and combining ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Raw:
    """Every option's and ini key's value as pytest holds it (read once, not validated)."""

    options: Mapping[str, Any]
    ini: Mapping[str, Any]

    @classmethod
    def read(cls, config: pytest.Config) -> "Raw":
        rows = table()
        return cls(MappingProxyType({r.dest: config.getoption(r.dest) for r in rows if r.dest is not None}),
                   MappingProxyType({r.ini: config.getini(r.ini) for r in rows if r.ini is not None}))

    def value(self, dest: str) -> tuple[Any, str]:
        """``(value, where)`` of a setting: the option when given, else its ini key."""
        row = next(r for r in table() if r.dest == dest or r.ini == dest)
        option = self.options.get(row.dest) if row.dest is not None else None
        if row.flag is not None and option is not None and not (row.kwargs.get("action") == "store_true"):
            return option, row.flag
        if row.ini is None:
            return option, row.flag
        return self.ini[row.ini], f"ini {row.ini}"

    def parsed(self, dest: str) -> Any:
        """The value of ``dest`` through its row's validator (a usage error names where it came from)."""
        value, where = self.value(dest)
        row = next(r for r in table() if r.dest == dest or r.ini == dest)
        return row.parse(value, where)


def baseline_root(raw: Raw, config: pytest.Config) -> tuple[Path, str]:
    """(the store root, the option or ini key that named it)."""
    option = raw.options["baseline_dir"]
    root = Path(option if option is not None else raw.ini["parity_baseline_dir"]).expanduser()
    if not root.is_absolute():  # a command-line path is relative to where pytest runs, an ini one to rootdir
        root = (Path(config.invocation_params.dir) if option is not None else config.rootpath) / root
    return root, ("--baseline-dir" if option is not None else "ini parity_baseline_dir")


# -- the options reference ------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _shown_default(row: Setting) -> str:
    """The default as the reference shows it: the ini key's, else off for a flag, else none."""
    if row.ini is not None:
        value = row.ini_default
        if isinstance(value, list):
            value = ", ".join(value)
        return value if value != "" else "(none)"
    return "off" if row.kwargs.get("action") == "store_true" else "(none)"


def markdown() -> str:
    """The options reference page (markdown): one row per option or ini key, from ``table()``."""
    lines = ["# Options and ini keys", "",
             f"<!-- generated from pytest_npu_parity/plugin/options.py; regenerate with: {REGENERATE} -->", "",
             "Every command-line option of the npu-parity group and every ini key (`[pytest]` section, "
             "`pyproject.toml` `[tool.pytest.ini_options]`). An option given on the command line wins over "
             "its ini key.", "",
             "| option | ini key | default | help |", "|---|---|---|---|"]
    for row in table():
        flag = f"`{row.flag}`" if row.flag else "–"
        ini = f"`{row.ini}`" if row.ini else "–"
        text = row.help if row.flag is not None or row.ini_help is None else row.ini_help
        lines.append(f"| {flag} | {ini} | `{_cell(_shown_default(row))}` | {_cell(text)} |")
    return "\n".join(lines) + "\n"

"""The plugin's frozen configuration: ``ParityConfig.load`` reads every option and ini key of the table
(``options.table()``, read as ``options.Raw``) once at ``pytest_configure`` and validates it (a bad value is a
``pytest.UsageError`` naming the option or ini key, the path options checked by ``paths.validate_paths``);
the frozen result sits in ``config.stash[state.CONFIG_KEY]`` and every other part of the plugin reads it
instead of calling ``getoption``/``getini``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

import pytest

from .options import OVERRIDABLE_RECIPES, Raw, _parse_audit_ini, _parse_recipes
from .paths import localize_command, rerun_command, validate_paths


def _tolerance_overrides(raw: Raw, config: pytest.Config) -> tuple[tuple, dict]:
    """``(per check patches in order, per recipe Tolerance)`` from the ini keys, each parsed once."""
    from ..checks.settings import TolerancePatch
    from ..judge.tolerance import default_for_recipe, parse_tolerance_spec

    per_check: dict = {}
    per_recipe: dict = {}
    try:
        for recipe in OVERRIDABLE_RECIPES:
            spec = raw.ini[f"parity_{recipe}_tolerance"].strip()
            if spec:
                per_recipe[recipe] = parse_tolerance_spec(spec, source="ini", base=default_for_recipe(recipe))
        for line in raw.ini["parity_tolerances"]:
            pattern, sep, spec = line.partition(":")
            if not sep:
                raise ValueError(f"parity_tolerances line {line!r} needs '<check>: rtol=… atol=…'")
            patch = TolerancePatch.parse(spec)  # applied per recipe, over that recipe's tolerance
            if not pattern.strip():
                config.issue_config_time_warning(pytest.PytestConfigWarning(
                    f"ini parity_tolerances line {line!r} has an empty check pattern and is ignored; "
                    "write '<check name or glob>: rtol=… atol=…'"), stacklevel=2)
                continue
            per_check[pattern.strip()] = patch
    except ValueError as exc:
        raise pytest.UsageError(f"ini: {exc}") from None
    return tuple(per_check.items()), per_recipe


def _policy_overrides(raw: Raw) -> tuple[dict, tuple]:
    """``(per recipe, per check)`` verdict policies from ``--parity-policy`` and the ini keys, validated
    now (a bad spec is a usage error naming the key)."""
    from ..judge.golden_policy import parse_policy_spec

    per_recipe: dict = {}
    per_check: dict = {}
    option = (raw.options["parity_policy"] or "").replace("golden-floor", "golden floor") or None
    for recipe in OVERRIDABLE_RECIPES:
        key = f"parity_{recipe}_policy"
        spec = option or raw.ini[key].strip()
        if spec:
            where = "--parity-policy" if option else f"ini {key}"
            try:
                per_recipe[recipe] = parse_policy_spec(spec, source="ini", recipe=recipe)
            except ValueError as exc:
                raise pytest.UsageError(f"{where}: {exc}") from None
    if "bf16" in per_recipe:  # bf16-weights is bf16 work too
        per_recipe.setdefault("bf16-weights", per_recipe["bf16"])
    for line in raw.ini["parity_policies"]:
        pattern, sep, spec = line.partition(":")
        try:
            if not sep or not pattern.strip():
                raise ValueError(f"line {line!r} needs '<check or glob>: golden …' or '<check or glob>: allclose'")
            parse_policy_spec(spec.strip(), source="ini", recipe="fp32")  # the resolver parses it once per recipe
        except ValueError as exc:
            raise pytest.UsageError(f"ini parity_policies: {exc}") from None
        per_check[pattern.strip()] = spec.strip()
    return per_recipe, tuple(per_check.items())


def _audit_mode(raw: Raw) -> str:
    """The session's audit mode (off, fail, warn): ``--parity-audit-mode``; else with ``--parity-audit``
    ini ``parity_audit`` when it names fail or warn, else fail; else ini ``parity_audit`` (default off)."""
    value = _parse_audit_ini(raw.ini["parity_audit"], "ini parity_audit")
    option = raw.options["parity_audit_mode"]
    if option is not None:
        return option
    if raw.options["parity_audit"]:
        return value if value != "off" else "fail"
    return value


def _repro_dir(raw: Raw, config: pytest.Config) -> Path | None:
    """``--parity-repro DIR`` from the invocation directory (``paths.validate_paths`` refused a file), or None."""
    value = raw.options["parity_repro"]
    return None if value is None else Path(config.invocation_params.dir) / Path(value).expanduser()


def recipe_names(cfg: "ParityConfig") -> tuple[str, ...]:
    """The session's recipes: parsed at configure in a parity session, else now (a usage error when bad)."""
    return cfg.recipes if cfg.recipes is not None else _parse_recipes(cfg.raw.value("parity_dtypes")[0], "")


@dataclass(frozen=True)
class ParityConfig:
    """The plugin's configuration, parsed once at ``pytest_configure`` (frozen).

    Without ``--npu-parity``/``--update-baselines`` (``enabled`` False) only the raw values and the flags
    are set (``unparsed``); nothing is validated (the suites are skipped).

    Attributes:
        raw: every option's and ini key's value as given.
        enabled: a parity session (``--npu-parity`` or ``--update-baselines``).
        update_baselines: record mode.
        recipes: the recipe names of ``--parity-dtypes`` (None until parsed).
        target: the ``torch.device`` under test (this xdist worker's pinned one).
        reference, seed, rng, audit_mode, localize_budget, lock_timeout: the parsed session values.
        replay_limit: bytes a recorded check may store for replay (ini ``parity_replay_limit``, MiB).
        settings: ``checks.settings.IniSettings``: tolerances, verdict policies, train store, layer limit.
        baseline_root, baseline_where: the store root and the option or ini key that named it.
        update_command, localize_hint: the commands that re-record / localize (``paths.rerun_command``).
        repro_dir: where ``--parity-repro`` writes the repros of failing checks (``repro.ReproWriter``),
            relative paths taken from the invocation directory; None without the option.
    """

    raw: Raw
    enabled: bool
    update_baselines: bool
    recipes: tuple[str, ...] | None = None
    target: Any = None
    reference: str = "auto"
    seed: int = 0
    rng: str = "shared"
    audit_mode: str = "off"
    localize_budget: float = 0.0
    lock_timeout: float = 1800.0
    replay_limit: int = 16 * 2**20
    settings: Any = None
    baseline_root: Path | None = None
    baseline_where: str = ""
    update_command: str = ""
    localize_hint: str = ""
    repro_dir: Path | None = None

    def option(self, dest: str) -> Any:
        """The raw command-line value of ``dest`` (None when not given)."""
        return self.raw.options[dest]

    def ini(self, key: str) -> Any:
        """The raw ini value of ``key``."""
        return self.raw.ini[key]

    @classmethod
    def unparsed(cls, raw: Raw) -> "ParityConfig":
        """The raw values and the two flags only: what a session that runs no parity check keeps
        (nothing is validated there), and every session's configuration until ``load``."""
        update = bool(raw.options["update_baselines"])
        return cls(raw=raw, enabled=bool(raw.options["npu_parity"]) or update, update_baselines=update)

    @classmethod
    def load(cls, config: pytest.Config, raw: Raw, *, prepare: Callable[[], None],
             target: Callable[[Raw], Any]) -> "ParityConfig":
        """Validate every value once, in the order the start-up errors have always come in.

        Args:
            config: the pytest config (rootdir, invocation directory, config-time warnings).
            raw: its values (``Raw.read``).
            prepare: called after the path checks, before any engine value is parsed (imports torch).
            target: ``(raw) -> torch.device``: resolves the target device (a usage error when absent).

        Raises:
            pytest.UsageError: the first bad value, in one sentence naming its option or ini key.
        """
        root, where = validate_paths(config, raw)
        lock_timeout = raw.parsed("parity_lock_timeout")
        replay_limit = raw.parsed("parity_replay_limit")
        prepare()
        from ..checks.settings import IniSettings  # imports torch: after prepare()

        recipes = raw.parsed("parity_dtypes")
        device = target(raw)
        reference = raw.parsed("parity_reference")
        if raw.options["parity_store_goldens"] and raw.options["update_baselines"]:
            raise pytest.UsageError("--parity-store-goldens adds goldens to existing baselines in a compare run; "
                                    "--update-baselines stores them already: give one of the two")
        if raw.options["parity_store_goldens"] and reference == "cpu":
            raise pytest.UsageError("--parity-store-goldens adds goldens to the stored baselines, which "
                                    "--parity-reference=cpu does not use: use --parity-reference=auto or baseline")
        check_tolerances, recipe_tolerances = _tolerance_overrides(raw, config)
        recipe_policies, check_policies = _policy_overrides(raw)
        seed, rng = raw.parsed("parity_seed"), raw.parsed("parity_rng")
        audit_mode = _audit_mode(raw)
        budget = raw.parsed("parity_localize_budget")
        train_store, layers = raw.parsed("parity_train_store"), raw.parsed("parity_layers")
        settings = IniSettings(recipe_tolerances=MappingProxyType(recipe_tolerances), check_tolerances=check_tolerances,
                               recipe_policies=MappingProxyType(recipe_policies), check_policies=check_policies,
                               train_store=train_store, layers=layers)
        return cls(raw=raw, enabled=True, update_baselines=bool(raw.options["update_baselines"]), recipes=recipes,
                   target=device, reference=reference, seed=seed, rng=rng, audit_mode=audit_mode,
                   localize_budget=budget, lock_timeout=lock_timeout, replay_limit=replay_limit, settings=settings,
                   baseline_root=root, baseline_where=where, repro_dir=_repro_dir(raw, config),
                   update_command=rerun_command(config, "--update-baselines"), localize_hint=localize_command(config))

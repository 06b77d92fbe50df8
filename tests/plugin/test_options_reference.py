"""docs/reference/options.md is generated from the options table (plugin/options.py)."""
from locations import REPO

from pytest_npu_parity.plugin import options

PAGE = REPO / "docs" / "reference" / "options.md"


def test_options_page_matches_the_table():
    assert PAGE.exists() and PAGE.read_text(encoding="utf-8") == options.markdown(), (
        f"docs/reference/options.md is out of date with the options table; regenerate it with: {options.REGENERATE}")


def test_every_ini_key_has_its_place_in_the_help_order():
    keys = [row.ini for row in options.table() if row.ini is not None]
    assert sorted(keys) == sorted(options.INI_ORDER) and len(set(keys)) == len(keys)


def test_every_row_is_an_option_or_an_ini_key_with_help():
    for row in options.table():
        assert (row.flag or row.ini) and row.help, row
        assert (row.flag is None) == (row.dest is None), row


def test_each_policy_key_states_the_default_the_settings_apply():
    # --help once said "'allclose' (default)" for every recipe while bf16 (and later fp16) defaulted to the golden floor
    from pytest_npu_parity.checks.settings import DEFAULT_POLICIES, TRAINING_DEFAULT_POLICIES

    for recipe in options.OVERRIDABLE_RECIPES:
        stated = options.POLICY_DEFAULTS[recipe]
        eval_default, _, training = stated.partition(", ")
        assert eval_default == DEFAULT_POLICIES[recipe], recipe
        assert training == (f"{TRAINING_DEFAULT_POLICIES[recipe]} for training checks"
                            if recipe in TRAINING_DEFAULT_POLICIES else ""), recipe
        row = next(r for r in options.table() if r.ini == f"parity_{recipe}_policy")
        assert row.help.endswith(f"default {stated}"), row.help

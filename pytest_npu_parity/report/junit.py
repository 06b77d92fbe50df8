"""JUnit XML properties of one test (``junit_properties``) and of the run (``junit_suite_properties``).

JUnit properties under the default ``junit_family=xunit2`` (measured with pytest 9.2): pytest writes
every ``(name, value)`` of ``item.user_properties`` as ``<properties>`` inside that ``<testcase>``
whatever the family, and the pairs travel with the test report across pytest-xdist workers. Only the
``record_property`` *fixture* warns ("record_property is incompatible with junit_family 'xunit2'").
So the plugin appends ``junit_properties(rows)`` to ``item.user_properties`` directly (no warning,
works under xunit1/xunit2/legacy and xdist), and run-level metadata (``junit_suite_properties``) goes
to ``<testsuite><properties>`` through ``LogXML.add_global_property`` on the controller — the
``record_testsuite_property`` fixture does not work under xdist (pytest issue 7767).

"""
from __future__ import annotations

from typing import Any, Mapping

import pandas as pd

from .columns import META_COLUMNS
from .summary import _num, _reference_text, check_table
from .table import _meta_cell, _txt, to_frame


def junit_properties(rows_for_one_test: "list[Mapping[str, Any]] | pd.DataFrame") -> list[tuple[str, str]]:
    """Key metrics of one test for its JUnit ``<testcase><properties>``.

    For each check of the test (and recipe, when the test ran more than one) the properties are
    ``parity.<check>.verdict``, ``.err_ratio`` (worst leaf), ``.worst_leaf``, ``.max_abs``,
    ``.max_rel``, ``.rel_l2`` (max over leaves), ``.cosine`` (min over leaves), ``.mismatched`` and
    ``.numel`` (sums), ``.tolerance`` and ``.reference``. Numbers are written with 6 significant
    digits.

    Append the pairs to ``item.user_properties`` (not the ``record_property`` fixture, which warns
    under the default ``junit_family=xunit2``); pytest writes them inside the ``<testcase>`` under
    every family and carries them across xdist workers (see the module docstring).

    Returns:
        ``[(name, value), ...]`` with ``str`` values; ``[]`` for no rows.
    """
    if isinstance(rows_for_one_test, pd.DataFrame) and rows_for_one_test.empty:
        return []
    if not isinstance(rows_for_one_test, pd.DataFrame) and not rows_for_one_test:
        return []
    checks = check_table(to_frame(rows_for_one_test))
    several_recipes = checks.groupby("check")["recipe"].nunique(dropna=False).gt(1)
    props: list[tuple[str, str]] = []
    for r in checks.itertuples():
        name = f"parity.{r.check}"
        if several_recipes.get(r.check, False):
            name += f".{r.recipe}"
        props += [
            (f"{name}.verdict", r.verdict),
            (f"{name}.err_ratio", _num(r.err_ratio, 6)),
            (f"{name}.worst_leaf", _txt(r.worst_leaf)),
            (f"{name}.max_abs", _num(r.max_abs, 6)),
            (f"{name}.max_rel", _num(r.max_rel, 6)),
            (f"{name}.rel_l2", _num(r.rel_l2, 6)),
            (f"{name}.cosine", _num(r.cosine, 9)),
            (f"{name}.mismatched", str(r.mismatched)),
            (f"{name}.numel", str(r.numel)),
            (f"{name}.tolerance", r.tolerance),
            (f"{name}.reference", _reference_text(r.reference, r.reference_provenance)),
        ]
    return props


def junit_suite_properties(meta: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Run metadata for ``<testsuite><properties>`` (``LogXML.add_global_property`` on the controller).

    Returns:
        ``[("parity.run_id", ...), ("parity.target", ...), ...]`` for the non-empty ``META_COLUMNS``;
        dicts and lists as JSON text.
    """
    return [(f"parity.{k}", _meta_cell(k, meta[k])) for k in META_COLUMNS if meta.get(k) not in (None, "", [], {})]

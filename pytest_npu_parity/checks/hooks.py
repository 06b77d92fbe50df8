"""The session's hooks on one check's verdict: check hooks after every comparison, failure hooks on a failure.

Hooks are called with the check's case, which they may use to run the check again
(``selfcheck.SelfCheck``: ``--parity-selfcheck``; ``localize.Localizer``: first-divergence
localization); they write their outcome into the record's typed fields.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from .record import CheckRecord
from .verdict import Sides

#: Added to a failure under a golden verdict instead of the localization it would mislead.
NO_LOCALIZATION_UNDER_GOLDEN = ("\n\n(First-divergence localization is by allclose tolerance and is not run "
                                "under the golden verdict; rerun with --parity-policy allclose to localize.)")


def check_hook_problems(hooks: Iterable[Callable[..., str | None]], case: Any, record: CheckRecord, call: Any,
                        sides: Sides) -> list[str]:
    """The texts of ``hook(case, record, call, actual, expected)`` for each hook that returns one
    (each fails the check)."""


    __tracebackhide__ = True
    problems = []
    for hook in hooks:  # e.g. --parity-selfcheck
        text = hook(case, record, call, sides.actual, sides.expected.leaves)
        if text:
            problems.append(text)
    return problems


def failure_diagnosis(hooks: Iterable[Callable[..., str | None]], case: Any, record: CheckRecord,
                      call: Any) -> str:
    """What the failure hooks (``hook(case, record, call, result)``) add to a failure message, each
    text after a blank line; a hook that raises says so instead (a diagnosis must never hide the
    failure itself). Under a golden verdict only the hooks whose ``runs_under_golden`` is true run
    (``localize.Localizer``: the counterfactual re-runs, judged by the check's own golden verdict,
    instead of a localization); without one, ``NO_LOCALIZATION_UNDER_GOLDEN``: first-divergence
    localization judges submodule outputs by the allclose tolerance, which says nothing about a golden
    verdict."""


    __tracebackhide__ = True
    hooks = tuple(hooks)
    text = ""
    if record.golden_policy is not None and hooks:
        hooks = tuple(hook for hook in hooks if getattr(hook, "runs_under_golden", False))
        if not hooks:
            return NO_LOCALIZATION_UNDER_GOLDEN
    for hook in hooks:
        try:
            extra = hook(case, record, call, record.result)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never hide the failure itself
            extra = f"({getattr(hook, '__name__', type(hook).__name__)} could not run: {type(exc).__name__}: {exc})"
        if extra:
            text += "\n\n" + extra
    return text

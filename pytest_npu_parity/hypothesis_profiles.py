"""The project's hypothesis profiles, and which one a parity session loads.

Property tests that run real models are expensive: hypothesis' default of 100 examples with a 200 ms
deadline would make them take tens of minutes. Every parity session therefore gets two profiles of
its own (:func:`register_profiles`, called by the pytest plugin at configure time, before hypothesis
loads ``--hypothesis-profile``):

* ``npu-parity-ci`` extends hypothesis' built-in ``ci`` profile (derandomized, no deadline, no
  example database, ``print_blob=True`` so a failure prints ``@reproduce_failure``) with a bounded
  :data:`CI_MAX_EXAMPLES`;
* ``nightly`` draws :data:`NIGHTLY_MAX_EXAMPLES` fresh (not derandomized) examples per test.

:func:`profile_to_load` says which profile a parity session loads when the user chose none;
:func:`examples_for` scales an expensive test's examples to the active profile.

These are properties of a parity session, whatever model it checks, so they are the engine's; the
shape strategies of a model live with its adapter (``pytest_npu_parity.aurora.strategies``). This
module imports hypothesis only; it never imports pytest.
"""
from __future__ import annotations

import math

from hypothesis import HealthCheck, settings
from hypothesis.errors import InvalidArgument

__all__ = [
    "CI_MAX_EXAMPLES",
    "NIGHTLY_MAX_EXAMPLES",
    "CI_PROFILE",
    "NIGHTLY_PROFILE",
    "register_profiles",
    "current_profile_name",
    "profile_to_load",
    "examples_for",
]

#: Examples per property test under ``npu-parity-ci`` (and in a parity session without a profile).
CI_MAX_EXAMPLES = 10
#: Examples per property test under ``nightly``.
NIGHTLY_MAX_EXAMPLES = 300
CI_PROFILE = "npu-parity-ci"
NIGHTLY_PROFILE = "nightly"



def _builtin_ci() -> settings:
    """Hypothesis' own ``ci`` profile, or the same values where this hypothesis has none."""
    try:
        return settings.get_profile("ci")
    except InvalidArgument:
        return settings(derandomize=True, deadline=None, database=None, print_blob=True,
                        suppress_health_check=[HealthCheck.too_slow])


_REGISTERED: dict[str, settings] = {}


def register_profiles() -> dict[str, settings]:
    """Register :data:`CI_PROFILE` and :data:`NIGHTLY_PROFILE` (idempotent; loads nothing).

    * ``npu-parity-ci``: the built-in ``ci`` profile (derandomize, deadline None, database None,
      ``print_blob``, ``too_slow`` suppressed) with ``max_examples`` = :data:`CI_MAX_EXAMPLES`.
    * ``nightly``: the same base with ``max_examples`` = :data:`NIGHTLY_MAX_EXAMPLES` and
      ``derandomize=False`` (each night explores new examples; a failure still prints the
      falsifying example and the ``@reproduce_failure`` blob). A ``nightly`` profile the user
      registered before is left alone.

    Built-in ``ci`` itself is not changed: other hypothesis tests of the session keep it.

    Returns:
        ``{name: settings}`` of the profiles this project registered.
    """
    if _REGISTERED:
        return dict(_REGISTERED)
    base = _builtin_ci()
    ci = settings(base, max_examples=CI_MAX_EXAMPLES)
    settings.register_profile(CI_PROFILE, ci)
    _REGISTERED[CI_PROFILE] = ci
    try:
        settings.get_profile(NIGHTLY_PROFILE)
    except InvalidArgument:
        nightly = settings(base, max_examples=NIGHTLY_MAX_EXAMPLES, derandomize=False)
        settings.register_profile(NIGHTLY_PROFILE, nightly)
        _REGISTERED[NIGHTLY_PROFILE] = nightly
    return dict(_REGISTERED)


def current_profile_name() -> str:
    """The active hypothesis profile's name (``settings.get_current_profile_name()``, with a fallback
    for hypothesis releases that predate it)."""
    getter = getattr(settings, "get_current_profile_name", None)
    if getter is not None:
        return getter()
    return getattr(settings, "_current_profile", None) or "default"


def profile_to_load(explicit: str | None, current: str) -> str | None:
    """The profile a parity session should load, or None to leave hypothesis' choice alone.

    Args:
        explicit: the ``--hypothesis-profile`` value (None when not given).
        current: :func:`current_profile_name` (``"default"``, or ``"ci"`` when hypothesis
            auto-loaded it because a CI environment variable is set, or one a conftest loaded).

    Returns:
        :data:`CI_PROFILE` when nobody chose a profile (``default``, or the auto-loaded ``ci``:
        hypothesis' default of 100 examples with a 200 ms deadline would make the property tests
        take tens of minutes); None when the user named one on the command line or a conftest
        loaded another.
    """
    if explicit:
        return None
    return CI_PROFILE if current in ("default", "ci") else None


def examples_for(share: float, minimum: int = 2) -> int:
    """``max_examples`` for an expensive test that runs a ``share`` of the active profile's examples:
    ``ceil(share × max_examples)``, at least ``minimum``.

    For the expensive full-model property tests: read when the test module is imported, i.e. after
    the session's profile is loaded, so ``nightly`` scales them up too.

    Raises:
        ValueError: ``share`` not in (0, 1] or ``minimum`` < 1.
    """
    if not 0 < share <= 1 or minimum < 1:
        raise ValueError(f"examples_for: need 0 < share <= 1 and minimum >= 1, got {share} and {minimum}")
    return max(minimum, math.ceil(settings.default.max_examples * share))

"""Model adapters: how a model-specific package plugs into the engine without the engine knowing it.

The engine (every module of ``pytest_npu_parity`` outside an adapter package) checks any PyTorch
model; what belongs to one model — its factory, inputs, patch set, check catalogue, shape
strategies, golden shims and its own doctor sections — lives in an adapter (the Aurora one:
``pytest_npu_parity/aurora/``). The adapter may import the engine, never the reverse; an import
contract (``[tool.importlinter]`` in pyproject.toml, ``lint-imports`` in CI) holds the engine to it.

Which way in, and why
=====================

* **pytest runs: the suite's own conftest and test modules.** A suite imports its adapter's
  factory, patch set, strategies and golden shims itself (``parity_suites/aurora/conftest.py``),
  as any pytest project imports its helpers. The pytest plugin loads no adapter, so a project that
  checks its own model never imports Aurora (``tests/test_no_aurora.py`` proves it).
* **The doctor: installed adapters, found by entry point.** ``python -m pytest_npu_parity doctor``
  has no conftest to ask, so it loads every :class:`Adapter` declared in the entry-point group
  :data:`ENTRY_POINT_GROUP`, the way pytest finds its ``pytest11`` plugins and torch its
  ``torch.backends`` device backends (torch_npu among them)::

      [project.entry-points."pytest_npu_parity.adapters"]
      aurora = "pytest_npu_parity.aurora.adapter:ADAPTER"

  :data:`ENV_DISABLE_AUTOLOAD` ``=1`` skips them (as ``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` and
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` do); :data:`ENV_ADAPTERS` names more, ``module:attribute``
  separated by commas (as ``PYTEST_PLUGINS`` does), which works without reinstalling; a script may
  call :func:`register`.

What an adapter gives the engine is what the engine must *call*: doctor sections (placed after the
op probes, before the distributed section) and facts for the doctor's environment section. The
hypothesis profiles are not an adapter's: every parity session gets the same ones
(:mod:`pytest_npu_parity.hypothesis_profiles`); a model's shape strategies are imported by its
suite's property tests.

This module imports neither pytest nor any adapter at import time.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ENTRY_POINT_GROUP", "ENV_ADAPTERS", "ENV_DISABLE_AUTOLOAD", "Adapter", "AdapterError",
           "DoctorSection", "discover", "load_errors", "load_reference", "register"]

#: The entry-point group of installed adapters.
ENTRY_POINT_GROUP = "pytest_npu_parity.adapters"
#: Adapters to load besides the installed ones: ``module:attribute[,module:attribute…]``.
ENV_ADAPTERS = "NPU_PARITY_ADAPTERS"
#: ``1`` (or ``true``/``yes``): load no installed adapter (the entry points); named ones still load.
ENV_DISABLE_AUTOLOAD = "NPU_PARITY_DISABLE_ADAPTER_AUTOLOAD"


class AdapterError(ValueError):
    """An adapter reference that does not name an :class:`Adapter`, or two adapters of one name."""


@dataclass(frozen=True)
class DoctorSection:
    """One doctor section an adapter adds.

    Attributes:
        name: its key (``--skip NAME``, the JSON ``name``); unique across the engine and adapters.
        title: the heading people read (``"Patch set self-test"``).
        run: ``run(ctx, result)`` with the doctor's ``DoctorContext`` (requested device, torch, the
            resolved target or why there is none) and the ``SectionResult`` to fill (status, details,
            fixes, data); an exception it raises is reported as a failed section.
    """

    name: str
    title: str
    run: Callable[[Any, Any], None]


@dataclass(frozen=True)
class Adapter:
    """What a model adapter registers with the engine.

    Attributes:
        name: the adapter's name (``"aurora"``); one adapter per name.
        doctor_sections: its doctor sections, in order.
        doctor_environment: ``f(result) -> dict`` called inside the doctor's environment section
            after the CANN line: appends the adapter's lines (versions of what it needs) and fix
            sentences to ``result`` and returns JSON facts for the section's ``data``; None for none.
    """

    name: str
    doctor_sections: tuple[DoctorSection, ...] = ()
    doctor_environment: Callable[[Any], dict[str, Any]] | None = None


_REGISTERED: list[Adapter] = []
_CACHE: dict[str, Any] = {}


def register(adapter: Adapter) -> None:
    """Register ``adapter`` for this process (besides the installed and the named ones).

    Registering the same object twice does nothing.

    Raises:
        AdapterError: ``adapter`` is not an :class:`Adapter`, or another adapter has its name.
    """
    if not isinstance(adapter, Adapter):
        raise AdapterError(f"register: expected a pytest_npu_parity.adapters.Adapter, got {type(adapter).__name__}")
    for known in _REGISTERED:
        if known.name == adapter.name:
            if known is adapter:
                return
            raise AdapterError(f"register: an adapter named {adapter.name!r} is registered already")
    _REGISTERED.append(adapter)
    _CACHE.clear()


def load_reference(reference: str) -> Adapter:
    """The :class:`Adapter` that ``"module:attribute"`` names (an entry point's value; the
    attribute may be dotted).

    Raises:
        AdapterError: no ``:``, or the object is not an :class:`Adapter`.
        ImportError: the module does not import.
        AttributeError: the module has no such attribute.
    """
    module_name, sep, attr = reference.strip().partition(":")
    if not sep or not module_name or not attr:
        raise AdapterError(f"adapter reference {reference!r}: expected 'module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, Adapter):
        raise AdapterError(f"adapter reference {reference!r} names a {type(obj).__name__}, not an Adapter")
    return obj


def _autoload_disabled() -> bool:
    return os.environ.get(ENV_DISABLE_AUTOLOAD, "").strip().lower() in ("1", "true", "yes")


def _references() -> list[tuple[str, str]]:
    """``(label, "module:attribute")`` of every adapter to load: installed ones (by entry-point name),
    then those :data:`ENV_ADAPTERS` names, in its order."""
    found: list[tuple[str, str]] = []
    if not _autoload_disabled():
        points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        found += [(f"entry point {ep.name}", ep.value) for ep in sorted(points, key=lambda ep: ep.name)]
    named = os.environ.get(ENV_ADAPTERS, "")
    found += [(f"{ENV_ADAPTERS} {ref.strip()}", ref.strip()) for ref in named.split(",") if ref.strip()]
    return found


def _load_all() -> dict[str, Any]:
    adapters: list[Adapter] = []
    errors: dict[str, str] = {}
    for label, reference in _references():
        try:
            adapter = load_reference(reference)
        except Exception as exc:  # noqa: BLE001 - a broken adapter must not stop the engine; reported instead
            lines = str(exc).strip().splitlines()
            errors[label] = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
            continue
        if all(known is not adapter for known in adapters):
            adapters.append(adapter)
    adapters += [a for a in _REGISTERED if all(known is not a for known in adapters)]
    names = [a.name for a in adapters]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise AdapterError(f"two different adapters are named {', '.join(map(repr, clashes))}")
    return {"adapters": tuple(adapters), "errors": errors}


def discover(*, refresh: bool = False) -> tuple[Adapter, ...]:
    """Every adapter of this process: the installed ones (unless :data:`ENV_DISABLE_AUTOLOAD`), those
    :data:`ENV_ADAPTERS` names, then the :func:`register` ed ones; each once. Loaded on the first call
    and remembered (``refresh=True`` loads again).

    An adapter that fails to load is left out; :func:`load_errors` says why.

    Raises:
        AdapterError: two different adapters have one name.
    """
    if refresh or "adapters" not in _CACHE:
        _CACHE.clear()
        _CACHE.update(_load_all())
    return _CACHE["adapters"]


def load_errors() -> dict[str, str]:
    """``{where it was declared: "ExceptionType: first line"}`` for each adapter that failed to load in
    the last :func:`discover`."""
    discover()
    return dict(_CACHE["errors"])

"""Answers shared across checks: ``LocalizationCache``, the answer it keeps (``_Answer``: levels
relative to their scope, ``_LevelView``) and the key of a patch set.

Part of ``pytest_npu_parity.diagnose.localize`` (the package docstring describes the descent).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...judge.tolerance import Tolerance
from .record import Site


@dataclass
class _LevelView:
    """A level taken from an earlier localization (``_Answer.rebuild``): its sites and culprit."""

    depth: int
    order_prefix: tuple
    base: str
    sites: list[Site]
    culprit: int | None


def _join(base: str, rel: str) -> str:
    return f"{base}.{rel}" if base and rel else base or rel


def _relative(path: str, base: str) -> str | None:
    """``path`` below ``base`` (``"a.b.c"`` below ``"a"`` is ``"b.c"``), or None if it is not below."""
    if not base:
        return path
    return path[len(base) + 1:] if path.startswith(base + ".") else None


@dataclass
class _Answer:
    """The levels a descent found below one scope, relative to it (paths, depths, orders).

    ``levels``: per level ``(depth, order_prefix, base, sites, culprit)`` relative to the scope;
    ``origin``: ``"'<check>' (<test id>)"`` of the localization that computed them; ``stopped``:
    that descent stopped at the budget (its deepest level is where it stopped).
    """

    origin: str
    levels: list[tuple[int, tuple, str, list[Site], int | None]]
    stopped: str | None = None

    @classmethod
    def of(cls, origin: str, levels: list[Any], stopped: str | None = None) -> "_Answer | None":
        """The answer of ``levels[0]``'s scope: ``levels`` from that scope down (None when a path
        does not lie below the scope's, which sharing cannot rebase)."""
        top = levels[0]
        cut, base = len(top.order_prefix), top.base
        out = []
        for lv in levels:
            rel_base = _relative(lv.base, base) if lv is not top else ""
            if rel_base is None:
                return None
            sites = []
            for site in lv.sites:
                rel = _relative(site.path, base)
                if rel is None:
                    return None
                sites.append(Site(rel, site.module_type, site.depth - top.depth, site.order[cut:], site.total,
                                  site.local, site.inherited, site.verdict))
            out.append((lv.depth - top.depth, lv.order_prefix[cut:], rel_base, sites, lv.culprit))
        return cls(origin, out, stopped)

    def rebuild(self, depth: int, order_prefix: tuple, base: str) -> list[_LevelView]:
        """The levels placed below a scope at ``depth`` with ``order_prefix`` and display path ``base``."""
        views = []
        for rel_depth, rel_prefix, rel_base, sites, culprit in self.levels:
            views.append(_LevelView(depth + rel_depth, order_prefix + rel_prefix, _join(base, rel_base), [
                Site(_join(base, site.path), site.module_type, depth + site.depth, order_prefix + site.order,
                     site.total, site.local, site.inherited, site.verdict) for site in sites], culprit))
        return views


def _patch_key(patches: Any) -> Any:
    """What identifies a patch factory across checks: a function's code, closure values and
    defaults (the suite's ``lambda device: patches.patched(device)`` is a new object per test, the
    same code every time), else the object itself."""
    code = getattr(patches, "__code__", None)
    if patches is None or code is None:
        return patches
    try:
        key = (code, tuple(c.cell_contents for c in patches.__closure__ or ()), patches.__defaults__)
        hash(key)
    except (TypeError, ValueError):  # an unhashable closure value, an empty cell
        return patches
    return key


class LocalizationCache:
    """What localizations of one session share: the levels found below every scope a descent entered.

    Keyed by the scope's module object (kept alive by the key, so its ``id`` is never reused), the
    fingerprint of its weights (``provenance.fingerprint_module``: an edited weight is a new key),
    the fingerprints of the reference's inputs to it and of the random stream's state when it was
    called, the grad/autocast mode it ran under, the recipe, the target, the patch set
    (``_patch_key``), the tolerance and the table's limits. The *first divergence* below a scope is
    decided by local comparisons (the target's module on the reference's inputs), so it depends on
    these alone; the total and inherited columns of a shared row are those of the check that
    computed it. Modules with a submodule in training mode, train steps, bound methods' own
    scopes and scopes entered with a stateful argument (a key/value cache: ``_State``, which has no
    fingerprint) are not shared.
    """

    def __init__(self) -> None:
        self._answers: dict[tuple, _Answer] = {}

    def __len__(self) -> int:
        return len(self._answers)

    def key(self, case: Any, call: Any, name: str, inputs: Any, rng: tuple, state: tuple, tol: Tolerance,
            limits: tuple) -> tuple | None:
        """The key of the scope ``name`` (a module path in ``call.module``; ``""`` for the module
        itself) entered with reference ``inputs`` (``(args, kwargs)``), random state ``rng`` and mode
        ``state``; None where it cannot be shared."""
        from ...store.digests import fingerprint_module, fingerprint_tensors

        if call.kind != "check":
            return None
        try:
            module = call.module.get_submodule(name) if name else call.module
            if any(m.training for m in module.modules()):
                return None
            return (module, fingerprint_module(module), fingerprint_tensors(inputs), fingerprint_tensors(rng),
                    tuple(state), case.recipe.name, str(case.target), _patch_key(case.patches),
                    (tol.rtol, tol.atol, tol.budget), limits)
        except Exception:  # noqa: BLE001 - no such submodule, an input that cannot be hashed (a nested tensor)
            return None

    def get(self, key: tuple | None) -> _Answer | None:
        """The levels stored for ``key`` (``key()``'s tuple), or None (also for a None key)."""
        return None if key is None else self._answers.get(key)

    def put(self, key: tuple, answer: _Answer | None) -> None:
        """Keep ``answer`` for ``key``; the first answer stored for a key stays (None is ignored)."""
        if answer is not None:
            self._answers.setdefault(key, answer)



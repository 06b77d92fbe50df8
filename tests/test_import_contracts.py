"""The import contracts of pyproject.toml ([tool.importlinter], checked by ``lint-imports`` in CI) cover
every engine module: each module of the package is the pytest glue, the Aurora adapter, or listed as
engine in both forbidden contracts; and every room (a subpackage other than the Aurora adapter and the
re-export shims of old import paths) is one of the layers of the layers contract."""
from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pytest_npu_parity"
NOT_ENGINE = {"pytest_npu_parity.plugin", "pytest_npu_parity.aurora"}


def package_modules() -> set[str]:
    """Top-level modules and subpackages of pytest_npu_parity (the package's own __init__ excluded)."""
    names = {f"pytest_npu_parity.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    names |= {f"pytest_npu_parity.{p.parent.name}" for p in PACKAGE.glob("*/__init__.py")}
    return names


def contracts_of_type(kind: str) -> dict[str, dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    return {c["name"]: c for c in config["contracts"] if c["type"] == kind}


def is_shim(path: Path) -> bool:
    """A re-export module or package kept for an old import path (its docstring says so)."""
    source = path.read_text(encoding="utf-8")
    return source.lstrip().startswith('"""Old import path')


def rooms() -> set[str]:
    """The subpackages of pytest_npu_parity that hold code: all but the Aurora adapter and the shims."""
    return {p.parent.name for p in PACKAGE.glob("*/__init__.py")
            if p.parent.name != "aurora" and not is_shim(p)}


def test_every_engine_module_is_under_both_contracts():
    contracts = contracts_of_type("forbidden")
    assert len(contracts) == 2
    engine = package_modules() - NOT_ENGINE
    for name, contract in contracts.items():
        listed = set(contract["source_modules"])
        assert listed == engine, (f"{name}: add new engine modules to source_modules in pyproject.toml "
                                  f"(missing {sorted(engine - listed)}, gone {sorted(listed - engine)})")
    forbidden = sorted(tuple(c["forbidden_modules"]) for c in contracts.values())
    assert forbidden == [("pytest", "_pytest"), ("pytest_npu_parity.aurora", "aurora")]


def test_every_room_is_a_layer():
    (contract,) = contracts_of_type("layers").values()
    assert contract["containers"] == ["pytest_npu_parity"]
    layers = [{name.strip() for name in layer.replace(":", "|").split("|")} for layer in contract["layers"]]
    named = set().union(*layers)
    assert sum(map(len, layers)) == len(named), "a module is named in two layers"
    missing = rooms() - named
    assert not missing, f"add the rooms {sorted(missing)} to the layers contract in pyproject.toml"
    assert {"plugin", "runner", "checks", "judge", "runtime", "store"} <= named
    # the order of the house: the pytest glue on top, the store below everything that runs a check
    order = [next(i for i, layer in enumerate(layers) if room in layer) for room in
             ("plugin", "runner", "checks", "diagnose", "judge", "runtime", "store")]
    assert order == sorted(order)


def test_every_other_module_is_a_layer_or_a_named_exception():
    """The contract is exhaustive: a new top-level module is a layer, the adapter, the dispatch or a shim."""
    (contract,) = contracts_of_type("layers").values()
    assert contract["exhaustive"] is True
    ignored = set(contract["exhaustive_ignores"])
    shims = {p.stem for p in PACKAGE.glob("*.py") if is_shim(p)} | {
        p.parent.name for p in PACKAGE.glob("*/__init__.py") if is_shim(p)}
    assert ignored == shims | {"aurora", "__main__"}, "exhaustive_ignores names exactly the shims, aurora and __main__"

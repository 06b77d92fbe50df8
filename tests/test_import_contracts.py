"""The import contracts of pyproject.toml ([tool.importlinter], checked by ``lint-imports`` in CI) cover
every engine module: each module of the package is the pytest glue, the Aurora adapter, or listed as
engine in both contracts."""
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


def test_every_engine_module_is_under_both_contracts():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    contracts = {c["name"]: c for c in config["contracts"]}
    assert len(contracts) == 2
    engine = package_modules() - NOT_ENGINE
    for name, contract in contracts.items():
        assert contract["type"] == "forbidden"
        listed = set(contract["source_modules"])
        assert listed == engine, (f"{name}: add new engine modules to source_modules in pyproject.toml "
                                  f"(missing {sorted(engine - listed)}, gone {sorted(listed - engine)})")
    forbidden = sorted(tuple(c["forbidden_modules"]) for c in contracts.values())
    assert forbidden == [("pytest", "_pytest"), ("pytest_npu_parity.aurora", "aurora")]

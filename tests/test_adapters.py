"""The adapter seam (pytest_npu_parity.adapters): the entry point pyproject.toml declares names the Aurora
adapter, discovery finds installed, named and registered adapters once each, a broken adapter is
reported by the doctor instead of stopping it, and section names cannot clash.

The entry point is read from this checkout's pyproject.toml, not from the installed metadata (an
editable install's entry points are rewritten only by ``pip install -e .``).
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from pytest_npu_parity import adapters, doctor
from pytest_npu_parity.aurora.adapter import ADAPTER

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
AURORA_REF = "pytest_npu_parity.aurora.adapter:ADAPTER"


@pytest.fixture
def seam(monkeypatch):
    """A clean seam: nothing named, nothing registered, no installed entry point; fresh afterwards."""
    monkeypatch.delenv(adapters.ENV_ADAPTERS, raising=False)
    monkeypatch.delenv(adapters.ENV_DISABLE_AUTOLOAD, raising=False)
    monkeypatch.setattr(adapters, "_REGISTERED", [])
    monkeypatch.setattr(adapters.importlib.metadata, "entry_points", lambda group: [])
    adapters._CACHE.clear()
    yield monkeypatch
    adapters._CACHE.clear()


def declared_entry_points() -> list[importlib.metadata.EntryPoint]:
    table = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["entry-points"]
    return [importlib.metadata.EntryPoint(name, value, adapters.ENTRY_POINT_GROUP)
            for name, value in table[adapters.ENTRY_POINT_GROUP].items()]


def test_pyproject_declares_the_aurora_adapter():
    points = declared_entry_points()
    assert [(ep.name, ep.value) for ep in points] == [("aurora", AURORA_REF)]
    assert points[0].load() is ADAPTER is adapters.load_reference(points[0].value)
    assert ADAPTER.name == "aurora"
    assert [(s.name, s.title) for s in ADAPTER.doctor_sections] == [
        ("patch_set", "Patch set self-test"), ("aurora_smoke", "Aurora smoke test")]


def test_installed_entry_points_are_discovered_unless_autoload_is_off(seam):
    seam.setattr(adapters.importlib.metadata, "entry_points",
                 lambda group: declared_entry_points() if group == adapters.ENTRY_POINT_GROUP else [])
    assert adapters.discover(refresh=True) == (ADAPTER,)
    assert list(doctor.sections()) == ["environment", "devices", "required_ops", "optional_ops", "patch_set",
                                       "aurora_smoke", "distributed", "deepspeed", "precision"]
    seam.setenv(adapters.ENV_DISABLE_AUTOLOAD, "1")
    assert adapters.discover(refresh=True) == ()
    assert doctor.sections() == doctor.ENGINE_SECTIONS
    seam.setenv(adapters.ENV_ADAPTERS, AURORA_REF)  # a named adapter still loads
    assert adapters.discover(refresh=True) == (ADAPTER,)


def test_each_adapter_once_and_registration(seam):
    seam.setenv(adapters.ENV_ADAPTERS, f"{AURORA_REF}, {AURORA_REF}")
    adapters.register(ADAPTER)
    adapters.register(ADAPTER)  # the same object again: nothing
    assert adapters.discover(refresh=True) == (ADAPTER,)
    with pytest.raises(adapters.AdapterError, match="named 'aurora' is registered already"):
        adapters.register(adapters.Adapter(name="aurora"))
    with pytest.raises(adapters.AdapterError, match="expected a pytest_npu_parity.adapters.Adapter"):
        adapters.register("aurora")


def test_bad_references_are_refused():
    with pytest.raises(adapters.AdapterError, match="expected 'module:attribute'"):
        adapters.load_reference("pytest_npu_parity.aurora.adapter")
    with pytest.raises(adapters.AdapterError, match="names a module, not an Adapter"):
        adapters.load_reference("pytest_npu_parity:adapters")


def test_a_broken_adapter_is_reported_by_the_doctor_not_raised(seam):
    seam.setenv(adapters.ENV_ADAPTERS, "no_such_module_for_npu_parity:ADAPTER")
    assert adapters.discover(refresh=True) == ()
    assert adapters.load_errors() == {
        f"{adapters.ENV_ADAPTERS} no_such_module_for_npu_parity:ADAPTER":
            "ModuleNotFoundError: No module named 'no_such_module_for_npu_parity'"}
    report = doctor.run_doctor("cpu", skip=tuple(n for n in doctor.ENGINE_SECTIONS if n != "environment"))
    environment = report["sections"][0]
    assert environment["status"] in ("warn", "fail")
    assert any(line.startswith("adapter (NPU_PARITY_ADAPTERS no_such_module_for_npu_parity:ADAPTER): failed to "
                               "load — ModuleNotFoundError") for line in environment["details"])
    assert [s["name"] for s in report["sections"]] == list(doctor.ENGINE_SECTIONS)


def test_a_section_name_taken_twice_is_refused(seam):
    adapters.register(adapters.Adapter(name="mine", doctor_sections=(
        adapters.DoctorSection("precision", "Mine", lambda ctx, r: None),)))
    with pytest.raises(adapters.AdapterError, match="precision"):
        doctor.sections()


def test_an_adapter_section_runs_in_its_slot(seam):
    def mine(ctx, result):
        result.details.append(f"my section saw target {ctx.target}")

    adapters.register(adapters.Adapter(name="mine", doctor_sections=(adapters.DoctorSection("mine", "Mine", mine),),
                                       doctor_environment=lambda r: r.details.append("mine 1.0") or {"mine": "1.0"}))
    skip = tuple(n for n in doctor.ENGINE_SECTIONS if n != "environment")
    report = doctor.run_doctor("cpu", skip=skip)
    by_name = {s["name"]: s for s in report["sections"]}
    assert list(by_name) == [*list(doctor.ENGINE_SECTIONS)[:4], "mine", *list(doctor.ENGINE_SECTIONS)[4:]]
    assert by_name["mine"]["title"] == "Mine" and by_name["mine"]["details"] == ["my section saw target cpu"]
    assert "mine 1.0" in by_name["environment"]["details"] and by_name["environment"]["data"]["mine"] == "1.0"
    assert doctor.DOCTOR_JSON_SCHEMA["$defs"]["section"]["properties"]["name"]["enum"] == list(by_name)

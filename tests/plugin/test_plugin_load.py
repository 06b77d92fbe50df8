"""The plugin is free for a project that never runs a parity check: with torch_npu absent, a plain
``pytest`` run imports neither torch nor the engine (benchmarks/plugin_load.py times it)."""
from __future__ import annotations

import json
import os

import pytest
from locations import REPO


CONFTEST = """
import json
import sys


def pytest_unconfigure(config):
    with open({path!r}, "w", encoding="utf-8") as fh:
        json.dump(sorted(sys.modules), fh)
"""


@pytest.mark.parametrize("args", [(), ("--help",)], ids=["run", "help"])
def test_a_project_without_parity_checks_imports_no_torch(pytester, monkeypatch, args):
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed: the plugin imports torch at start-up to guard `import torch` "
                    "(npu.prepare_torch)")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    modules_file = pytester.path / "modules.json"
    pytester.makeconftest(CONFTEST.format(path=str(modules_file)))
    pytester.makepyfile(test_plain="def test_a():\n    assert 1 + 1 == 2\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    assert result.ret == 0
    loaded = json.loads(modules_file.read_text(encoding="utf-8"))
    assert "pytest_npu_parity.plugin" in loaded  # the plugin was loaded
    assert [m for m in loaded if m == "torch" or m.startswith("torch.")] == []
    assert "pytest_npu_parity.runner" not in loaded and "pytest_npu_parity.localize" not in loaded


def test_the_projects_profiles_are_registered_in_a_session_without_parity_checks(pytester):
    """A test module may name the project's profiles whatever the session: they are registered at
    configure time, before any test module is imported (nothing else need import hypothesis first)."""
    pytester.makepyfile(test_profile="""
from hypothesis import given, settings, strategies as st


@settings(settings.get_profile("npu-parity-ci"))
@given(st.integers())
def test_profile(x):
    assert settings.get_profile("nightly").max_examples == 300
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_nightly_profile_can_be_chosen_in_a_session_without_parity_checks(pytester):
    """``--hypothesis-profile nightly`` finds the project's profile without ``--npu-parity``: it is
    registered before hypothesis' own ``pytest_configure`` loads the chosen profile."""
    pytester.makepyfile(test_profile="""
from hypothesis import settings


def test_profile():
    assert settings.default.max_examples == 300
    assert settings.get_current_profile_name() == "nightly"
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--hypothesis-profile", "nightly")
    result.assert_outcomes(passed=1)

"""README.md stays short, keeps the two set-up commands that .ci/run mirrors, and links only to
files that exist (the docs site's strict build checks the links of docs/, not README's)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

#: The two commands of "Set up on a fresh machine (Python 3.11)", byte for byte (.ci/run runs them).
MAIN_JOB = ('python3.11 -m venv .venv && . .venv/bin/activate && pip install -e ".[aurora]" && '
            "pytest --npu-parity parity_suites/aurora")
TESTS = 'python3.11 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]" && pytest -n 2'


def test_readme_is_short() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 150


def test_readme_keeps_the_two_set_up_commands() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert "## Set up on a fresh machine (Python 3.11)" in lines
    assert MAIN_JOB in lines and TESTS in lines
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip_install -q -e ".[dev]"' in ci and "run_pytest_step tests 1800 pytest -p no:cacheprovider -n 2" in ci
    assert "--npu-parity parity_suites/aurora" in ci


def test_readme_links_resolve() -> None:
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "README links nowhere into the docs"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"

""".ci/run's pip_install: a download cut off mid-file is tried again instead of failing CI, and a
package that cannot be installed still fails it after the third try."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pip_install_function() -> str:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    match = re.search(r"^pip_install\(\) \{.*?^\}$", text, re.S | re.M)
    assert match, ".ci/run defines no pip_install function"
    return match.group(0)


def _run(tmp_path: Path, failures: int) -> tuple[int, int]:
    """Run pip_install against a fake `pip` that fails its first `failures` calls; returns the exit
    status and the number of calls."""
    counter = tmp_path / "calls"
    counter.write_text("0")
    fake = tmp_path / "pip"
    fake.write_text(f"#!/usr/bin/env bash\nn=$(( $(cat {counter}) + 1 )); echo $n > {counter}\n"
                    f"[ $n -gt {failures} ]\n")
    fake.chmod(0o755)
    script = (f"export PATH={tmp_path}:$PATH\nsleep() {{ :; }}\n{_pip_install_function()}\n"
              'pip_install -q -e ".[dev]"\n')
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    return done.returncode, int(counter.read_text())


def test_a_failed_download_is_tried_again(tmp_path: Path) -> None:
    assert _run(tmp_path, failures=2) == (0, 3)


def test_a_lasting_failure_still_fails_after_three_tries(tmp_path: Path) -> None:
    assert _run(tmp_path, failures=3) == (1, 3)


def test_every_install_in_ci_goes_through_the_retry() -> None:
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    bare = [line for line in lines if line.startswith("pip install")]
    assert not bare, f".ci/run installs without the retry: {bare}"
    assert sum(line.startswith("pip_install ") for line in lines) == 5

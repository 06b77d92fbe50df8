""".ci/run's pip_install: a download cut off mid-file is tried again instead of failing CI, and a
package that cannot be installed still fails it after the third try. Its disk: each leg removes its
venv and pip's cache before the next leg installs (three legs' venvs and wheels filled a CI box)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _function(name: str) -> str:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    match = re.search(rf"^{name}\(\) \{{.*?^\}}$", text, re.S | re.M)
    assert match, f".ci/run defines no {name} function"
    return match.group(0)


def _pip_install_function() -> str:
    return _function("pip_install")


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


def test_a_finished_leg_removes_its_venv_and_pips_cache_only(tmp_path: Path) -> None:
    venv, cache, other = tmp_path / ".venv-ci", tmp_path / ".venv-pip-cache", tmp_path / ".venv-ci-torch251"
    for folder in (venv, cache, other):
        (folder / "lib").mkdir(parents=True)
        (folder / "lib" / "wheel").write_bytes(b"x")
    script = (f"cd {tmp_path}\nexport PIP_CACHE_DIR={cache}\ndeactivate() {{ echo left; }}\n"
              f"{_function('leg_done')}\nleg_done .venv-ci\n")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "left\n"
    assert not venv.exists() and not cache.exists()
    assert (other / "lib" / "wheel").exists()


def test_each_leg_is_removed_before_the_next_installs() -> None:
    text = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r'^export PIP_CACHE_DIR="\$PWD/\.venv-', text, re.M), \
        "pip's cache is not a folder of the checkout that leg_done removes"
    events = re.findall(r'^(?:"\$python" -m venv "\$(\w+)"|leg_done "\$(\w+)")$', text, re.M)
    created = [made for made, _ in events if made]
    assert len(created) == 3
    expected = [pair for name in created for pair in ((name, ""), ("", name))]
    assert events == expected, f"a leg's venv is not removed before the next one is made: {events}"

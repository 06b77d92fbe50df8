"""Every ```python block of README.md and of the tutorial and how-to pages runs as it is written.

A block whose first line names a file (``# test_gpt2.py``, ``# conftest.py``) is a file of a test
project: each test file runs in its own pytester project with ``pytest --npu-parity`` (plus the
page's other named non-test files written before it, e.g. its ``conftest.py``), and must pass unless
the page says otherwise. Any other block is executed as a script in a fresh namespace.

HTML comments right before a block (invisible on the rendered page) steer it:

* ``<!-- snippet: skip (why) -->`` — not run; reported as skipped with that reason
  (e.g. needs an Ascend NPU);
* ``<!-- snippet: args --parity-dtypes fp32 -->`` — extra pytest arguments for a test file;
* ``<!-- snippet: expect failed=1 -->`` — the outcomes the run must have (``assert_outcomes``
  keywords), for a block that shows a failure.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# pytester forgets modules first imported during an in-process run; importing what the examples
# need once here saves seconds per run (as tests/test_own_models.py does).
import hypothesis  # noqa: F401
import torch  # noqa: F401

import pytest_npu_parity.golden  # noqa: F401
import pytest_npu_parity.runner  # noqa: F401
from cpu_features import NO_BF16_LSTM, runs_bf16_lstm

try:  # the examples of "Your own model" need them (the dev extra installs both)
    import torchvision  # noqa: F401
    import transformers  # noqa: F401
    from transformers import GPT2LMHeadModel  # noqa: F401
except ImportError:  # pragma: no cover - reported by the snippet that needs them
    pass

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted((DOCS / "tutorial").glob("*.md")), *sorted((DOCS / "how-to").glob("*.md"))]
DIRECTIVE = re.compile(r"<!--\s*snippet:\s*(skip|args|expect)\b\s*(.*?)\s*-->")
FILE_NAME = re.compile(r"#\s*([\w./-]+\.py)\b")


@dataclass
class Snippet:
    """One ```python block of a page, with the directives written right before it."""

    page: Path
    line: int  # 1-based line of the opening fence
    source: str
    skip: str | None = None
    args: list[str] = field(default_factory=list)
    expect: dict[str, int] = field(default_factory=dict)

    @property
    def file_name(self) -> str | None:
        """The file the block is (``test_gpt2.py``), from its first line; None for a script."""
        first = self.source.splitlines()[0] if self.source.strip() else ""
        match = FILE_NAME.match(first)
        return match.group(1) if match else None

    @property
    def is_test_file(self) -> bool:
        name = self.file_name
        return name is not None and Path(name).name.startswith("test_")

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def page_snippets(page: Path) -> list[Snippet]:
    """The ```python blocks of ``page`` in order, each with the directives of the comment lines
    right before its fence (blank lines between them allowed).

    Raises:
        ValueError: on a malformed directive (``expect`` not ``key=int``) or an unclosed block.
    """
    lines = page.read_text(encoding="utf-8").splitlines()
    snippets, i = [], 0
    while i < len(lines):
        if lines[i].strip() != "```python":
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a ```python block is never closed")
        snippet = Snippet(page, i + 1, "\n".join(lines[i + 1:end]) + "\n")
        j = i - 1
        while j >= 0 and (not lines[j].strip() or DIRECTIVE.fullmatch(lines[j].strip())):
            match = DIRECTIVE.fullmatch(lines[j].strip())
            if match:
                kind, value = match.groups()
                if kind == "skip":
                    snippet.skip = value.strip("() ") or "marked skip"
                elif kind == "args":
                    snippet.args = shlex.split(value) + snippet.args
                else:
                    try:
                        snippet.expect.update({k: int(v) for k, v in (kv.split("=") for kv in value.split())})
                    except ValueError:
                        raise ValueError(f"{page}:{j + 1}: 'expect' takes outcome=count pairs, not {value!r}") from None
            j -= 1
        snippets.append(snippet)
        i = end + 1
    return snippets


SNIPPETS = [s for page in PAGES for s in page_snippets(page)]
RUNNABLE = [s for s in SNIPPETS if s.is_test_file or s.file_name is None]


def test_the_pages_have_snippets() -> None:
    # the two tutorial pages hold at least the first check, its failure and the three own-model files
    names = {s.file_name for s in SNIPPETS}
    assert "test_block.py" in names, "README's example is gone"
    assert {"test_my_model.py", "test_mlp.py", "conftest.py", "test_gpt2.py", "test_resnet.py", "test_tagger.py"} <= names
    assert any(s.file_name is None for s in SNIPPETS), "no script block: the exec path is untested"


def test_directives_are_read(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- snippet: skip (needs an Ascend NPU) -->\n```python\nimport torch_npu\n```\n\n"
                    "<!-- snippet: args --parity-dtypes fp32 -->\n\n<!-- snippet: expect failed=1 passed=0 -->\n"
                    "```python\n# test_x.py\n```\n\nprose\n```python\nx = 1\n```\n", encoding="utf-8")
    skip, test, script = page_snippets(page)
    assert skip.skip == "needs an Ascend NPU" and skip.file_name is None
    assert test.args == ["--parity-dtypes", "fp32"] and test.expect == {"failed": 1, "passed": 0} and test.is_test_file
    assert script.skip is None and script.args == [] and script.expect == {} and script.line == 14


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.id for s in RUNNABLE])
def test_snippet_runs(snippet: Snippet, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    if snippet.skip:
        pytest.skip(f"{snippet.id}: {snippet.skip}")
    if "nn.LSTM" in snippet.source and "--parity-dtypes" not in " ".join(snippet.args) and not runs_bf16_lstm():
        pytest.skip(f"{snippet.id}: {NO_BF16_LSTM}")
    if snippet.file_name is None:
        monkeypatch.chdir(pytester.path)
        exec(compile(snippet.source, snippet.id, "exec"), {"__name__": "__snippet__"})  # noqa: S102 - the page's own code
        return
    # the page's helper files (conftest.py, modules) written before this test file
    for other in SNIPPETS:
        if other.page == snippet.page and other.line < snippet.line and other.file_name and not other.is_test_file:
            target = pytester.path / other.file_name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(other.source, encoding="utf-8")
    (pytester.path / snippet.file_name).write_text(snippet.source, encoding="utf-8")
    result = pytester.runpytest("--npu-parity", "-p", "no:randomly", *snippet.args, snippet.file_name)
    if snippet.expect:
        result.assert_outcomes(**snippet.expect)
    else:
        outcomes = result.parseoutcomes()
        assert result.ret == 0 and outcomes.get("passed", 0) > 0, result.stdout.str()

"""Print the options reference (``options.markdown()``): ``python -m pytest_npu_parity.plugin.options_md >
docs/reference/options.md`` (tests/plugin/test_options_reference.py fails when the page and the table disagree)."""
from __future__ import annotations

from .options import markdown

if __name__ == "__main__":
    print(markdown(), end="")

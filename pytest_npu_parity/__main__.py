"""Command line: ``python -m pytest_npu_parity {doctor,report,baselines} ...`` (also ``npu-parity``).

Each sub-command lives in its own engine module and exposes ``main(argv) -> int``; this file only
dispatches, so ``python -m pytest_npu_parity doctor`` never imports the report stack and vice versa.
"""
from __future__ import annotations

import importlib
import sys

_COMMANDS = {
    "doctor": ("pytest_npu_parity.diagnose.doctor", "check the NPU/CUDA environment before trusting a parity number"),
    "report": ("pytest_npu_parity.report", "re-render a parity report from results or a history file"),
    "baselines": ("pytest_npu_parity.store.cli", "prune or verify a baseline store and its object pool"),
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv[0]`` to its sub-command's ``main``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in _COMMANDS:
        lines = ["usage: python -m pytest_npu_parity {%s} [options]" % ",".join(_COMMANDS), ""]
        lines += [f"  {name:<10}{help_}" for name, (_, help_) in _COMMANDS.items()]
        stream = sys.stdout if argv[:1] in ([], ["-h"], ["--help"]) else sys.stderr
        print("\n".join(lines), file=stream)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(_COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())

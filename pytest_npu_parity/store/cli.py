"""Command line: ``python -m pytest_npu_parity baselines {prune,verify}`` — housekeeping of a baseline
store and its object pool (``pytest_npu_parity.__main__`` dispatches here through the old import path
``pytest_npu_parity.baselines``).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from .format import BaselineError, StoreLockedError, _show
from .reading import _read
from .suites import SuiteStores

__all__ = ["main"]


def _cli_parser() -> Any:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_npu_parity baselines",
        description="Housekeeping of a baseline store and its object pool (<baseline dir>/.objects/).")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("prune", "delete the pool objects that no baseline file of the store references"),
                        ("verify", "read every baseline file of the store as a compare run does (checksum, and "
                                   "every pool object it references re-hashed) and list unreferenced objects")):
        cmd = sub.add_parser(name, help=help_, description=help_)
        cmd.add_argument("--baseline-dir", default="baselines", metavar="DIR",
                         help="the store root (default: ./baselines, the plugin's <rootdir>/baselines)")
        if name == "prune":
            cmd.add_argument("--dry-run", action="store_true", help="list what would be deleted, delete nothing")
            cmd.add_argument("--lock-timeout", type=float, default=60.0, metavar="S",
                             help="seconds to wait for a running --update-baselines to finish (default 60)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m pytest_npu_parity baselines {prune,verify} [--baseline-dir DIR]``; returns the exit code.

    * ``prune`` takes the store's :class:`StoreLock` (waiting up to ``--lock-timeout`` s for a record run),
      then deletes :meth:`SuiteStores.orphan_objects`; a baseline file whose header cannot be read stops it
      before anything is deleted (exit 1). ``--dry-run`` lists them only.
    * ``verify`` loads every baseline file and prints each problem (exit 1 if any).

    Exit codes: 0 done, 1 a problem named on stderr, 2 usage (argparse, or no such directory).
    """
    try:
        args = _cli_parser().parse_args(argv)
    except SystemExit as exc:  # --help -> 0, a bad option -> 2
        return int(exc.code or 0)
    stores = SuiteStores(args.baseline_dir)
    if not stores.root.is_dir():
        print(f"error: no baseline store at {_show(stores.root)} (give --baseline-dir DIR)", file=sys.stderr)
        return 2
    if args.command == "verify":
        bad = 0
        files = stores.baseline_files()
        for path in files:
            try:
                _read(path, pool=stores.pool)
            except BaselineError as exc:
                print(f"FAIL {exc}", file=sys.stderr)
                bad += 1
        try:
            orphans = stores.orphan_objects()
        except BaselineError:
            orphans = []
        print(f"{len(files)} baseline files, {len(files) - bad} read and verified, {bad} failed; "
              f"{len(stores.pool.objects())} pool objects, {len(orphans)} referenced by no file"
              + (" (python -m pytest_npu_parity baselines prune removes them)" if orphans else ""))
        return 1 if bad else 0
    lock = stores.lock()
    if not args.dry_run:
        try:
            lock.acquire(timeout=args.lock_timeout,
                         on_wait=lambda message: print(f"npu-parity: {message}", file=sys.stderr, flush=True))
        except (StoreLockedError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    try:
        found = stores.orphan_objects() if args.dry_run else stores.prune_objects()
    except BaselineError as exc:
        print(f"error: {exc}; nothing was deleted: fix or re-record that file, then prune again", file=sys.stderr)
        return 1
    finally:
        lock.release()
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{verb} {len(found)} unreferenced pool objects ({sum(size for _, size in found):,} bytes)")
    for path, size in found:
        print(f"  {_show(path)}  {size:,} bytes")
    return 0

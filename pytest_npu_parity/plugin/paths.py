"""Start-up checks of the path options, the record paths, and the commands a run's hints repeat.

``validate_paths`` refuses a separate path value that moved pytest's rootdir, report/history paths
that cannot be created and baseline stores that cannot be used; ``rerun_command`` builds the
``pytest --update-baselines …`` / ``--parity-localize`` commands with the options this run was given.
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from .options import Raw, baseline_root

#: Path options whose separate value (``--baseline-dir DIR``) pytest reads as a test path while it
#: chooses its rootdir and ini file, before this plugin's options are known.
PATH_OPTIONS = ("--baseline-dir", "--parity-report", "--parity-history", "--parity-repro")
#: Options a record command depends on (which file, which recipes, which seed, which ini and
#: rootdir), as (dest, flag); ``rerun_command`` repeats those given on the command line or in
#: PYTEST_ADDOPTS/addopts. The target device is not one of them: a baseline is recorded on the
#: trusted machine's device, whatever the failing run's target was.
RECORD_OPTIONS = (("inifilename", "-c"), ("rootdir", "--rootdir"), ("baseline_dir", "--baseline-dir"),
                  ("parity_dtypes", "--parity-dtypes"), ("parity_seed", "--parity-seed"))
#: Options a localizing re-run depends on besides those: the same target, reference and verdict.
LOCALIZE_OPTIONS = RECORD_OPTIONS + (("parity_device", "--parity-device"), ("parity_reference", "--parity-reference"),
                                     ("parity_policy", "--parity-policy"))


def record_parity_paths(config: pytest.Config, raw: Raw) -> None:
    """Make ``pytest --update-baselines`` with no path record the parity suites (ini ``parity_paths``).

    Without paths pytest runs ``testpaths`` (usually the unit tests) or the invocation directory;
    ``config.args_source`` (pytest >= 7.2) tells these apart from paths the user typed, which are
    kept as they are. A run started inside one of the parity paths keeps its directory (it records
    that suite only). Parity paths that do not exist are ignored; with none left the args stay.
    """
    source = getattr(config, "args_source", None)
    if source is None or source == pytest.Config.ArgsSource.ARGS:
        return
    paths = [Path(config.rootpath, p).resolve() for p in raw.ini["parity_paths"]]
    paths = [p for p in paths if p.exists()]
    invocation = Path(config.invocation_params.dir).resolve()
    if not paths or any(invocation.is_relative_to(p) for p in paths):
        return
    config.args[:] = [str(p) for p in paths]


def rerun_command(config: pytest.Config, mode: str, options: tuple = RECORD_OPTIONS) -> str:
    """The command, without test ids, that re-runs this session's parity tests in ``mode``
    (``--update-baselines``, or ``--npu-parity --parity-localize``), repeating every option of
    ``options`` this run was given (``--baseline-dir=DIR``, ``--parity-dtypes=…``, ``-c FILE`` …):
    without them the hint would look for another store or run other recipes. Test ids are relative
    to the rootdir, so when pytest was started elsewhere the command starts with ``cd <rootdir> &&``
    and path values are made absolute.
    """
    invocation = Path(config.invocation_params.dir)
    elsewhere = invocation.resolve() != Path(config.rootpath).resolve()
    words = ["pytest", *mode.split()]
    for dest, flag in options:
        value = getattr(config.option, dest, None)
        if value is None or value == "":
            continue
        if dest in ("inifilename", "rootdir", "baseline_dir") and elsewhere:
            value = str((invocation / Path(str(value)).expanduser()).resolve())
        words.append(f"{flag}={value}" if flag.startswith("--") else flag)
        if not flag.startswith("--"):
            words.append(str(value))
    command = " ".join(shlex.quote(w) for w in words)
    return f"cd {shlex.quote(str(config.rootpath))} && {command}" if elsewhere else command


def localize_command(config: pytest.Config) -> str:
    """``rerun_command`` for localizing one failing check (``{test_id}`` stands for its test id)."""
    return rerun_command(config, "--npu-parity --parity-localize", LOCALIZE_OPTIONS).replace(
        "{", "{{").replace("}", "}}") + " {test_id}"


def _creatable(path: Path, kind: str) -> str | None:
    """Why ``path`` cannot be (or be written as) a ``kind`` (``"directory"``/``"file"``), or None."""
    if path.exists():
        if kind == "directory" and not path.is_dir():
            return "is a file, not a directory"
        if kind == "file" and path.is_dir():
            return "is a directory, not a file"
        target = path if kind == "directory" else path.parent
        return None if os.access(target, os.W_OK | os.X_OK) else f"{'is' if target == path else 'lies in'} " \
            "a directory this process cannot write to"
    ancestor = path.parent
    while not ancestor.exists() and ancestor.parent != ancestor:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"cannot be created: {ancestor} is a file"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot be created: {ancestor} is not writable"
    return None


def _validate_outputs(config: pytest.Config, raw: Raw) -> None:
    """``--parity-report`` / ``--parity-history`` / ``--parity-repro``: given, creatable, the history a
    .parquet or .csv file."""
    invocation = Path(config.invocation_params.dir)
    for option, name, kind in (("parity_report", "--parity-report", "directory"),
                               ("parity_history", "--parity-history", "file"),
                               ("parity_repro", "--parity-repro", "directory")):
        value = raw.options[option]
        if value is None:
            continue
        if not str(value).strip():
            raise pytest.UsageError(f"{name} is empty; give a {kind} path")
        why = _creatable(invocation / Path(value).expanduser(), kind)
        if why:
            raise pytest.UsageError(f"{name}={value}: {why}; pick another path")
        if name == "--parity-history" and Path(value).suffix.lower() not in (".parquet", ".csv"):
            raise pytest.UsageError(f"{name}={value}: the history file must end in .parquet or .csv")


def validate_paths(config: pytest.Config, raw: Raw) -> tuple[Path, str]:
    """Start-up checks of the path options (a usage error naming the option and the fix):
    a separate value that moved pytest's rootdir, a report/history path that cannot be created,
    a baseline store that is a file, or (record mode) one this process cannot write to.

    Returns:
        ``(store root, the option or ini key that named it)``.
    """
    for name in PATH_OPTIONS:
        _refuse_rootdir_move(config, name)
    _validate_outputs(config, raw)
    root, where = baseline_root(raw, config)
    if root.exists() and not root.is_dir():
        raise pytest.UsageError(f"{where}={root} is a file, not a directory; point it at the baseline "
                                "directory (created on the first --update-baselines run)")
    if raw.options["update_baselines"]:
        from ..store.suites import SuiteStores  # engine modules import torch: only in a record session

        bad = SuiteStores(root).unwritable()
        if bad:
            shown = ", ".join(str(p) for p in bad[:5]) + (" …" if len(bad) > 5 else "")
            raise pytest.UsageError(
                f"--update-baselines cannot write to the baseline store {root} ({where}): not writable: {shown}; "
                "fix its permissions or record into another --baseline-dir=DIR")
    return root, where


def _refuse_rootdir_move(config: pytest.Config, name: str) -> None:
    """Usage error when ``name DIR`` (separate value) was given, ``DIR`` exists and pytest, which
    reads it as a test path before this plugin's options are known, chose another rootdir or ini
    file than without it.

    Why this cannot be repaired here: ``Config.parse`` (``_pytest/config/__init__.py``, pytest 7.4
    to 9.x) calls ``determine_setup(args=ns.file_or_dir, …)`` on the command line and
    ``PYTEST_ADDOPTS`` *before* it loads the ``pytest11`` entry points that register this plugin's
    options, so ``--parity-report DIR`` is an unknown option followed by a free argument, and
    ``findpaths.get_dirs_from_args`` takes every existing free argument as a test path for the
    rootdir and ini-file search. Rootdir, ini file, ``addopts`` and the node ids are fixed by the
    time any plugin hook runs; a run on the moved rootdir would look for baselines, ini keys and
    test ids elsewhere. Ini ``addopts`` are read after that search and cannot move it.
    """
    sources = [(list(config.invocation_params.args), "")]
    env = os.environ.get("PYTEST_ADDOPTS", "")
    if env.strip():
        try:
            sources.append((shlex.split(env), " (in PYTEST_ADDOPTS)"))
        except ValueError:
            pass  # pytest itself reports an unparsable PYTEST_ADDOPTS
    invocation = Path(config.invocation_params.dir)
    for args, where in sources:
        values = [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == name]
        for value in values:
            if not (invocation / value).exists():
                continue
            moved = _setup_without(config, value)
            if moved:
                raise pytest.UsageError(
                    f"{name} {value}{where}: pytest took the separate value for a test path while choosing its "
                    f"rootdir and ini file ({moved}); write {name}={value} with '='")


def _setup_without(config: pytest.Config, value: str) -> str | None:
    """How pytest's rootdir/ini file differ from those it would pick if ``value`` were no test path
    (text), or None when they are the same. Unknown pytest internals count as different."""
    try:
        from _pytest.config.findpaths import determine_setup
    except ImportError:
        return "it may have moved"
    args = [str(a) for a in (config.option.file_or_dir or [])]
    kwargs = dict(inifile=config.option.inifilename, args=args, rootdir_cmd_arg=config.option.rootdir or None)
    try:
        try:
            found = determine_setup(**kwargs, override_ini=config.option.override_ini,
                                    invocation_dir=config.invocation_params.dir)
        except TypeError:  # pytest 7: (inifile, args, rootdir_cmd_arg, config)
            found = determine_setup(kwargs["inifile"], args, kwargs["rootdir_cmd_arg"], config=config)
    except Exception:  # noqa: BLE001 - be safe: report it
        return "it may have moved"
    rootpath, inipath = Path(found[0]), found[1]
    if (rootpath, inipath and Path(inipath)) == (config.rootpath, config.inipath):
        return None
    return (f"rootdir {config.rootpath} instead of {rootpath}, ini file {config.inipath or 'none'} "
            f"instead of {inipath or 'none'}")

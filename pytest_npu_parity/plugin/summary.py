"""The terminal summary of a parity session (the ``npu-parity`` section), the suite-wide stale report
before pytest's FAILURES, the unused baselines of a full run, and the report/history files.

It reads rows (``runner.CheckRecord.rows``) and the session's counters only; engine modules are
imported where they are needed.
"""
from __future__ import annotations

import json
import shlex
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest

from ..report import columns
from .state import COLLECTED_KEY, CONFIG_KEY, LOCK_KEY, ROWS_KEY, SELECTED_KEY, SESSION_KEY, STALE_KEY, TEMP_KEY


def terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """``pytest_terminal_summary``: the npu-parity section (nothing in an xdist worker or without parity)."""
    if SESSION_KEY not in config.stash or getattr(config, "workeroutput", None) is not None:
        return
    session = config.stash[SESSION_KEY]
    rows = config.stash[ROWS_KEY]
    tr = terminalreporter
    tr.section("npu-parity")
    checks: dict[tuple, str] = {}
    for row in rows:  # one verdict per (test, check): fail if any leaf failed
        key = (row["test_id"], row["check"], row["recipe"], row.get("group") or row.get("submodule") or row["check"])
        if checks.get(key) not in ("fail", "error"):
            checks[key] = row["verdict"]
    counts: Counter = Counter()
    for (_, _, recipe, group), verdict in checks.items():
        counts[(group, recipe, verdict)] += 1
    groups = sorted({(g, r) for g, r, _ in counts})
    if groups:
        width = max([len("group")] + [len(g) for g, _ in groups])
        tr.write_line(f"{'group'.ljust(width)}  recipe  checks  pass  fail  recorded")
        for group, recipe in groups:
            n = {v: counts[(group, recipe, v)] for v in ("pass", "fail", "error", "recorded")}
            total = sum(n.values())
            tr.write_line(f"{group.ljust(width)}  {recipe:<6}  {total:>6}  {n['pass']:>4}  "
                          f"{n['fail'] + n['error']:>4}  {n['recorded']:>8}")
        ran = Counter(verdict for verdict in checks.values())
        tr.write_line(f"{len(checks)} checks: " + ", ".join(f"{v} {k}" for k, v in sorted(ran.items())))
    else:
        tr.write_line("no parity checks ran")
    _summarize_references(tr, rows)
    _summarize_audit(tr, rows)
    _summarize_policies(tr, rows, stored_now=getattr(session, "store_goldens", False))
    _summarize_teeth(tr, rows)
    _summarize_baseline_problems(tr, rows, session)
    _summarize_localization(tr, rows, session)
    _summarize_counterfactual(tr, rows)
    _summarize_writes(tr, session)
    _summarize_temporary_files(tr, config)
    _summarize_unmatched_patterns(tr, session, rows)
    if _full_run(config) and (exitstatus == 0 or not session.update_baselines):
        unused = _unused_baselines(config, session)
        if unused and session.update_baselines:
            session.store.prune(unused)
            tr.write_line(f"baselines: pruned {len(unused)} unused (no collected test maps to them):")
        elif unused:
            tr.write_line(f"baselines: {len(unused)} unused (no collected test maps to them; "
                          "`pytest --update-baselines` on a full run prunes them):")
        for path in unused:
            tr.write_line(f"  {_shown(path)}")
    if session.update_baselines and config.stash.get(LOCK_KEY, None) is not None:
        _prune_objects(tr, session.store)
    _write_outputs(config, session, rows)


def _prune_objects(tr: Any, store: Any) -> None:
    """End of a record run, on the controller and under its store lock (no other record run is writing):
    delete the pool objects that no baseline file under the store references any more (every file counts,
    not only this run's, so a ``-k`` re-record keeps the other tests' objects)."""
    from ..store.format import BaselineError

    prune = getattr(store, "prune_objects", None)
    if prune is None:
        return
    try:
        removed = prune()
    except BaselineError as exc:
        tr.write_line(f"baselines: pool objects not pruned: {exc}")
        return
    if removed:
        tr.write_line(f"baselines: pruned {len(removed)} pool objects no baseline file references "
                      f"({sum(size for _, size in removed):,} bytes)")


def _full_run(config: pytest.Config) -> bool:
    """True for an unfiltered run of whole directories (unused baselines are only judged then)."""
    option = config.option
    if getattr(option, "keyword", "") or getattr(option, "markexpr", "") or getattr(option, "deselect", None):
        return False
    if getattr(option, "lf", False):
        return False
    if config.stash[CONFIG_KEY].option("parity_dtypes") is not None:  # a recipe subset leaves the others' files unused
        return False
    return all(Path(arg).is_dir() for arg in config.args)


def _shown(path: Path | str) -> str:
    """``path`` relative to the working directory when below it, else as given."""
    path = Path(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _per_check(rows: list[dict]) -> dict[tuple, dict]:
    """The first row of every (test, check, recipe): what the reference was does not vary by leaf."""
    first: dict[tuple, dict] = {}
    for row in rows:
        first.setdefault((row["test_id"], row["check"], row["recipe"]), row)
    return first


def _summarize_references(tr: Any, rows: list[dict]) -> None:
    """One line per reference the targets were compared with: a live CPU run or a baseline's provenance."""
    counts: Counter = Counter()
    for row in _per_check(rows).values():
        if row.get("verdict") in ("recorded", "error") or row.get("reference") == "recorded":
            continue
        if row.get("reference") == "baseline":
            # reference_provenance is Baseline.describe(): "<file> — <device · date · versions>"
            counts["baseline " + str(row.get("reference_provenance") or "").rpartition(" — ")[2]] += 1
        else:
            reference = row.get("reference")
            counts[{"cpu": "a live CPU run", "given": "the given expected output"}.get(reference, str(reference))] += 1
    for reference, n in sorted(counts.items()):
        tr.write_line(f"reference: {n} check{'s' * (n != 1)} vs {reference}")


def _summarize_audit(tr: Any, rows: list[dict]) -> None:
    """With any audited check: the events of the audited checks per kind (each check counted once,
    not once per output leaf), then every check with events beyond its audit budget, with those
    events (op, devices, dtype, source line) and whether they failed the check or warned."""
    audited = [row for row in _per_check(rows).values() if row.get("audit_mixed_device") is not None]
    if not audited:
        return
    from ..runtime.audit import KINDS

    totals = {k: sum(int(row.get(f"audit_{k}") or 0) for row in audited) for k in KINDS}
    over = [row for row in audited if row.get("audit_problem")]
    tr.write_line(f"audit: {len(audited)} check{'s' * (len(audited) != 1)} audited, events "
                  + ", ".join(f"{k} {v}" for k, v in totals.items())
                  + (f"; {len(over)} beyond their audit budget" if over else "; none beyond the audit budgets"))
    for row in sorted(over, key=lambda r: (r["test_id"], r["check"], r["recipe"])):
        verdict = "failed" if row.get("audit_verdict") == "fail" else "warned"
        lines = str(row["audit_problem"]).splitlines()
        head = lines[0].partition(": ")[2] if ": " in lines[0] else lines[0]
        tr.write_line(f"  {verdict}: {row['test_id']} check {row['check']!r} ({row['recipe']}): {head}",
                      red=verdict == "failed", yellow=verdict == "warned")
        for line in lines[1:]:
            if line.startswith("  "):
                tr.write_line(f"  {line}")
    if over:
        failed = any(row.get("audit_verdict") == "fail" for row in over)
        tr.write_line("  fix those lines, or allow them per test or check with audit_budget={...} and a reason "
                      "(@pytest.mark.parity / parity.check)"
                      + (", or report without failing with --parity-audit-mode=warn" if failed else ""))


def _summarize_policies(tr: Any, rows: list[dict], stored_now: bool = False) -> None:
    """When any check was judged by the golden policy: how many checks each verdict policy judged,
    then every check that asked for the golden and fell back to allclose (and why). ``stored_now``: a
    ``--parity-store-goldens`` run, which stored the goldens it computed live."""
    judged = [row for row in _per_check(rows).values() if row.get("verdict") not in ("recorded", "error")]
    notes = [row for row in judged if row.get("policy_note") and row.get("policy") != "distribution"]
    distribution = [row for row in judged if row.get("policy") == "distribution"]
    if not any(row.get("policy") == "golden" for row in judged) and not notes and not distribution:
        return
    counts = Counter(row.get("golden_policy") or "allclose" for row in judged if row.get("policy") == "golden")
    counts.update(row.get("distribution_policy") or "distribution" for row in distribution)
    counts.update("trajectory" for row in judged if row.get("policy") == "trajectory")
    n_allclose = sum(1 for row in judged if row.get("policy") not in ("golden", "distribution", "trajectory"))
    tr.write_line("verdicts: " + ", ".join([f"{n} by {text}" for text, n in sorted(counts.items())]
                                           + [f"{n_allclose} by allclose"] * bool(n_allclose))
                  + (" (distribution: sampling checks whose sides drew their own noise, --parity-rng device)"
                     if distribution else ""))
    # Checks whose baseline stores no golden (recorded before goldens were stored): one line for each kind.
    from ..checks.stored_golden import NOT_ADDED, NOT_STORED, NOT_STORED_OTHER_INPUTS

    live = other = 0
    for row in sorted(notes, key=lambda r: (r["test_id"], r["check"], r["recipe"])):
        parts = str(row["policy_note"]).split("; ")
        # a --parity-store-goldens run did not store a golden it refused (its own line below says why)
        live += NOT_STORED in parts and not (stored_now and any(part.startswith(NOT_ADDED) for part in parts))
        other += NOT_STORED_OTHER_INPUTS in parts
        rest = "; ".join(part for part in parts if part not in (NOT_STORED, NOT_STORED_OTHER_INPUTS))
        if rest:
            tr.write_line(f"  {row['test_id']} check {row['check']!r} ({row['recipe']}): {rest}")
    if live and stored_now:
        tr.write_line(f"  {live} check{'s' * (live != 1)} computed the golden live, and it is now stored in "
                      "their baselines (--parity-store-goldens): later compare runs run none")
    elif live:
        tr.write_line(f"  {live} check{'s' * (live != 1)} computed the golden live: the baseline stores none for "
                      "them (add it with --parity-store-goldens: the reference stays as recorded; or re-record "
                      "with --update-baselines)")
    if other:
        tr.write_line(f"  {other} check{'s' * (other != 1)} computed the golden live: the baseline stores none, "
                      "and their inputs are not the recorded bits (activations this machine computed), so "
                      "--parity-store-goldens cannot add it (a re-record stores the inputs with their golden)")


def _summarize_teeth(tr: Any, rows: list[dict]) -> None:
    """``--parity-selfcheck``: the share of checks with teeth, then every check without (and why)."""
    from ..diagnose.selfcheck import teeth_summary

    with_teeth, measured, without = teeth_summary(rows)
    if not measured:
        return
    share = 100 * with_teeth // measured  # rounded down: "100 %" only when every check has teeth
    tr.write_line(f"teeth: {with_teeth}/{measured} ({share} %) of the checks fail "
                  "when their output or a weight is perturbed beyond tolerance")
    for row in sorted(without, key=lambda r: (r["test_id"], r["check"], r["recipe"])):
        allowed = f" [vacuous_ok: {row['vacuous_ok']}]" if row.get("vacuous_ok") else ""
        tr.write_line(f"  no teeth: {row['test_id']} check {row['check']!r} ({row['recipe']}): "
                      f"{row.get('teeth_problem')}{allowed}")


def _summarize_baseline_problems(tr: Any, rows: list[dict], session: Any) -> None:
    """List the checks whose baseline was missing, stale, corrupt or unsafe, and how to re-record them
    (the checks of a suite-wide stale suite in one line: its section opens the summary)."""
    problems = [row for row in _per_check(rows).values() if row.get("baseline_error")]
    if not problems:
        return
    kinds = Counter(row["baseline_error"] for row in problems)
    tr.write_line("baselines not usable: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    width = max(len(k) for k in kinds)
    suites = _stale_suites(tr.config)
    covered = {check for suite in suites for check in suite.checks}
    for suite in suites:
        tr.write_line(f"  {'stale'.ljust(width)}  {len(suite.checks)} checks of suite {suite.suite!r}: "
                      f"{_cause_text(suite.cause)} (see the top of the summary)")
    problems = [row for row in problems if (row["test_id"], row["check"], row["recipe"]) not in covered]
    for row in sorted(problems, key=lambda r: (r["baseline_error"], r["test_id"], r["check"])):
        where = f" ({_shown(row['baseline_file'])})" if row.get("baseline_file") else ""
        tr.write_line(f"  {row['baseline_error'].ljust(width)}  {row['test_id']} check {row['check']!r}{where}")
    redo = sorted({row["test_id"] for row in problems if row["baseline_error"] in ("missing", "stale", "corrupt")})
    if redo:
        tr.write_line(f"re-record them on a trusted machine with: {session.store.update_command} "
                      + " ".join(shlex.quote(test_id) for test_id in redo))


def _localize_hint(session: Any, test_id: str) -> str:
    """The command that localizes ``test_id`` (the session's ``Localizer.hint``, with its options)."""
    hook = next((h for h in session.failure_hooks if getattr(h, "hint", None)), None)
    template = hook.hint if hook is not None else "pytest --npu-parity --parity-localize {test_id}"
    return template.format(test_id=shlex.quote(test_id))


def _summarize_localization(tr: Any, rows: list[dict], session: Any) -> None:
    """How many failing checks were localized (in how many seconds, how many answered by another
    check's descent), and how many were not, why, and the command that localizes one."""
    first = list(_per_check(rows).values())
    localized = [r for r in first if r.get("localization")]
    skipped = [r for r in first if r.get("localization_skipped") == "budget"]
    structure = [r for r in first if r.get("localization_skipped") == "structure"]
    if not (localized or skipped or structure):
        return
    if localized:
        seconds = sum(float(r.get("localization_s") or 0) for r in first)
        reused = sum(1 for r in localized if r.get("localization_reused"))
        stopped = sum(1 for r in localized if r.get("localization_stopped"))
        tr.write_line(f"localization: {len(localized)} failing check{'s' * (len(localized) != 1)} localized in "
                      f"{seconds:.1f} s ({reused} answered by an earlier check's descent"
                      + (f", {stopped} stopped at the budget" if stopped else "") + ")")
    if skipped:
        hook = next((h for h in session.failure_hooks if hasattr(h, "budget_s")), None)
        budget = f"{hook.budget_s:g} s" if hook is not None and hook.budget_s is not None else "spent"
        example = sorted(skipped, key=lambda r: r["test_id"])[0]["test_id"]
        tr.write_line(f"localization skipped for {len(skipped)} check{'s' * (len(skipped) != 1)}: budget ({budget}, "
                      f"--parity-localize-budget); run `{_localize_hint(session, example)}` (or -k NAME "
                      "--parity-localize) to see one")
    if structure:
        tr.write_line(f"localization not run for {len(structure)} check{'s' * (len(structure) != 1)}: their outputs "
                      "differ in structure, shape or dtype")


def _summarize_counterfactual(tr: Any, rows: list[dict]) -> None:
    """How many failing checks got counterfactual re-runs (``diagnose.counterfactual``), in how many
    seconds, and how many verified fp32-island fixes were found."""
    first = [r for r in _per_check(rows).values() if r.get(columns.COUNTERFACTUAL_S) is not None]
    if not first:
        return
    seconds = sum(float(r[columns.COUNTERFACTUAL_S] or 0) for r in first)
    islands = sum(1 for r in first if r.get(columns.FP32_ISLANDS) is not None)
    tr.write_line(f"what makes it pass: {len(first)} failing check{'s' * (len(first) != 1)} re-run counterfactually "
                  f"in {seconds:.1f} s" + (f", {islands} verified fp32-island fix{'es' * (islands != 1)}"
                                           if islands else ""))


_CAUSE_PARTS = {"weights": "the model's weights", "config": "the model's configuration", "input": "the inputs",
                "arguments": "the non-tensor arguments", "attributes": "the model's attributes outside its weights",
                "function": "the checked function's code or closure"}


def _cause_text(cause: str) -> str:
    """``"the model's weights and the inputs changed"`` for a ``runner.stale_cause`` such as ``weights+input``."""
    parts = [_CAUSE_PARTS.get(c, c) for c in cause.split("+")]
    joined = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{joined} changed"


def _stale_suites(config: pytest.Config) -> list:
    """``runner.stale_suites`` of this session's rows (computed once)."""
    if STALE_KEY not in config.stash:
        from ..runner import stale_suites

        config.stash[STALE_KEY] = stale_suites(config.stash[ROWS_KEY]) if ROWS_KEY in config.stash else []
    return config.stash[STALE_KEY]


class StaleSuiteReport:
    """A suite whose model (or inputs) changed as a whole (``runner.stale_suites``): said once, before pytest's FAILURES,
    with the one command that fixes it; each of its tests' failures is cut to one line pointing there."""

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> Iterator[None]:
        if SESSION_KEY in config.stash and getattr(config, "workeroutput", None) is None:
            try:
                self._report(terminalreporter, config)
            except Exception as exc:  # noqa: BLE001 - a summary must never break the run's report
                terminalreporter.write_line(f"npu-parity: suite-wide stale check failed: {type(exc).__name__}: {exc}")
        yield

    @staticmethod
    def _report(tr: Any, config: pytest.Config) -> None:
        suites = _stale_suites(config)
        if not suites:
            return
        session = config.stash[SESSION_KEY]
        messages = {(r["test_id"], r["check"], r["recipe"]): r.get("problem") for r in config.stash[ROWS_KEY]
                    if r.get("baseline_error")}
        short: dict[str, str] = {}
        selected = _selected_files(config)
        recipes = set(config.stash[CONFIG_KEY].recipes or ())
        for suite in suites:
            fix = suite.fix(session.store.update_command)
            tests = sorted({t for t, _, _ in suite.checks})
            files = [f for f in _suite_files(session.store, tests[0]) if _recorded_recipe(f) in recipes]
            unchecked = _not_selected(config, files, selected)
            title = f"every baseline of suite {suite.suite!r} is stale"
            if unchecked:  # a selection (-k, node ids, one file, one recipe): say no more than it saw
                title = f"every baseline of suite {suite.suite!r} this run checked is stale"
                fix = " ".join([session.store.update_command, *map(shlex.quote, tests)])
            tr.section(f"npu-parity: {title}", sep="=", bold=True)
            recorded = f" (recorded on {suite.provenance})" if suite.provenance else ""
            tr.write_line(f"{_cause_text(suite.cause).capitalize()} since its baselines were recorded{recorded}: "
                          f"{len(suite.checks)} checks of {len(tests)} tests are stale"
                          + (f"; {suite.fresh} other checks still matched" if suite.fresh else "") + ".")
            if unchecked:
                tr.write_line(f"This run did not check {len(unchecked)} of the suite's {len(files)} baseline files "
                              "(a selection): whether they are stale too is not known.")
            others = suite.other_causes()
            if others:  # what some checks found besides the shared cause, each check kind by its own
                tr.write_line("Besides, " + "; ".join(
                    f"{_cause_text(cause)} for {n} check{'s' * (n != 1)}" for cause, n in others.items()) + ".")
            tr.write_line(f"Fix it once, on a trusted machine: {fix}")
            shared = set(suite.cause.split("+"))
            first = next((c for c in suite.checks if shared <= set(suite.causes.get(c, suite.cause).split("+"))),
                         suite.checks[0])
            example = messages.get(first)
            if example:
                tr.write_line(f"For example, {first[0]}: {example}")
            for key in suite.checks:
                test_id, check, recipe = key
                own = suite.causes.get(key, suite.cause)
                scope = (f"every checked baseline of suite {suite.suite!r}" if unchecked
                         else f"the whole suite {suite.suite!r}")
                whole = (f"{_cause_text(suite.cause)} for {scope}" if not suite.extra_causes(key) else
                         f"{_cause_text(own)} (and {scope} is stale: {_cause_text(suite.cause)})")
                short.setdefault(test_id, f"check {check!r} ({recipe}): baseline stale: {whole}; see '{title}' above "
                                          f"the failures; fix: {fix}")
        failing = {(r["test_id"], r["check"], r["recipe"]) for r in config.stash[ROWS_KEY]
                   if r.get("verdict") in ("fail", "error")}
        covered = {c for suite in suites for c in suite.checks}
        explained = {t for t in short if all(c in covered for c in failing if c[0] == t)}
        for report in tr.stats.get("failed", []):
            if getattr(report, "when", None) == "call" and report.nodeid in explained:
                report.longrepr = short[report.nodeid]


_WRITE_ORDER = ("created", "changed", "unchanged", "not written")


def _summarize_writes(tr: Any, session: Any) -> None:
    """Counts of baseline files created/changed/unchanged/not written, then the files that changed on disk."""
    writes = session.baseline_writes
    if not writes:
        return
    status = Counter(writes.values())
    order = [s for s in _WRITE_ORDER if s in status] + sorted(set(status) - set(_WRITE_ORDER))
    tr.write_line("baselines: " + ", ".join(f"{status[s]} {s}" for s in order)
                  + f" ({len(writes)} file{'s' * (len(writes) != 1)} under {_shown(session.store.root)})")
    for test_id, what in sorted(writes.items(), key=lambda kv: (order.index(kv[1]), kv[0])):
        if what == "unchanged":
            continue
        why = session.not_written.get(test_id, "failed")
        note = {"failed": " (the test failed)", "skipped": " (the test was skipped before its end)",
                "interrupted": " (the test was interrupted)"}.get(why, f" (the test {why})") \
            if what == "not written" else ""
        try:
            path = _shown(session.store.path_for(test_id))
        except Exception:  # a node id no file can be named after: the test itself reported it
            path = "?"
        tr.write_line(f"  {what:<11}  {path}  <- {test_id}{note}")


def _summarize_temporary_files(tr: Any, config: pytest.Config) -> None:
    """Temporary files of writes a killed process left behind: removed by a record run (which holds
    the store lock, so no live writer owns them), listed by a compare run."""
    kind, files = config.stash.get(TEMP_KEY, ("found", []))
    if not files:
        return
    total = sum(size for _, size in files)
    if kind == "removed":
        tr.write_line(f"baselines: removed {len(files)} temporary file{'s' * (len(files) != 1)} "
                      f"({total} bytes) left by an interrupted record run:")
    else:
        tr.write_line(f"baselines: {len(files)} temporary file{'s' * (len(files) != 1)} ({total} bytes) left by "
                      "an interrupted record run; the next `pytest --update-baselines` removes them:")
    for path, size in files:
        tr.write_line(f"  {_shown(path)} ({size} bytes)")


def _summarize_unmatched_patterns(tr: Any, session: Any, rows: list[dict]) -> None:
    """ini ``parity_tolerances``/``parity_policies`` patterns that matched no check of this run
    (a typo leaves a tolerance unapplied without any other sign)."""
    if not rows:
        return
    for key, patterns in (("parity_tolerances", session.check_tolerances), ("parity_policies", session.check_policies)):
        for pattern in patterns:
            if pattern not in session.patterns_used:
                tr.write_line(f"ini {key}: pattern {pattern!r} matched no check of this run "
                              "(a typo? check names are the first argument of parity.check)")


def _unused_baselines(config: pytest.Config, session: Any) -> list[Path]:
    """Baseline files of this run's scope that no collected test maps to (sorted).

    In scope are the files whose recorded test id (file metadata ``test_id``) names a test file
    under one of the run's directories (``config.args``), so ``pytest --update-baselines
    parity_suites/aurora`` never touches another suite's files, and whose recorded recipe (the
    provenance's ``recipe``) is one this session runs: a default run (``fp32,bf16``) leaves the
    files of the opt-in ``fp16`` recipe alone. Kept are the files of every
    collected test (also deselected, skipped or failed ones, and with ``--parity-reference cpu``)
    and every file the run read or wrote. Files whose metadata cannot be read are left alone (the
    test that uses them reports them).
    """
    from ..store.format import BaselineError

    store = session.store
    kept = {Path(p).resolve() for p in session.baselines_used}
    for node_id in config.stash[COLLECTED_KEY]:
        try:
            kept.add(store.path_for(node_id).resolve())
        except BaselineError:
            pass
    invocation = Path(config.invocation_params.dir)
    scope = [(invocation / arg).resolve() for arg in config.args]
    recipes = set(config.stash[CONFIG_KEY].recipes)
    unused = []
    for path in store.unused(kept):
        test_id, recipe = _recorded_test_id(path), _recorded_recipe(path)
        if not test_id or (recipe is not None and recipe not in recipes):
            continue
        test_file = (config.rootpath / test_id.partition("::")[0]).resolve()
        if any(test_file.is_relative_to(d) for d in scope):
            unused.append(path)
    return unused


def _selected_files(config: pytest.Config) -> set[Path]:
    """The baseline files (resolved) of the tests this run selected (``SELECTED_KEY``)."""
    from ..store.format import BaselineError

    store, found = config.stash[SESSION_KEY].store, set()
    for node_id in config.stash.get(SELECTED_KEY, []):
        try:
            found.add(store.path_for(node_id).resolve())
        except BaselineError:
            pass
    return found


def _not_selected(config: pytest.Config, files: list[Path], selected: set[Path]) -> list[Path]:
    """The baseline ``files`` (of this run's recipes) whose test the run left out: deselected (``-k``, ``-m``),
    or outside the paths and node ids it was given. A selected test that skipped is part of the run; a file of
    a test no longer in the run's paths (a deleted test's leftover, reported as unused) is no selection."""
    collected = set(config.stash[COLLECTED_KEY])
    invocation = Path(config.invocation_params.dir)
    scope = [(invocation / arg).resolve() for arg in config.args]
    left_out = []
    for path in files:
        if path.resolve() in selected:
            continue
        test_id = _recorded_test_id(path)
        if test_id is None:
            continue
        test_file = (config.rootpath / test_id.partition("::")[0]).resolve()
        if test_id in collected or not any(test_file.is_relative_to(d) for d in scope):
            left_out.append(path)
    return left_out


def _suite_files(store: Any, test_id: str) -> list[Path]:
    """The baseline files of the suite that holds ``test_id`` (``BaselineStore.baseline_files``), or none
    when no store maps it."""
    from ..store.format import BaselineError

    try:
        return store.store_for(test_id).baseline_files()
    except (BaselineError, OSError, AttributeError):
        return []


def _recorded_test_id(path: Path) -> str | None:
    """The ``test_id`` metadata of a baseline file (its safetensors header only), or None if unreadable."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            return (handle.metadata() or {}).get("test_id")
    except Exception:  # not a safetensors file, truncated header...: not judged here
        return None


def _recorded_recipe(path: Path) -> str | None:
    """The recipe in a baseline file's provenance (its safetensors header only), or None if unreadable."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            recipe = json.loads((handle.metadata() or {}).get("provenance") or "{}").get("recipe")
        return recipe if isinstance(recipe, str) else None
    except Exception:  # not a safetensors file, truncated header, no provenance: not judged here
        return None


def _write_outputs(config: pytest.Config, session: Any, rows: list[dict]) -> None:
    cfg = config.stash[CONFIG_KEY]
    out_dir = cfg.option("parity_report")
    history = cfg.option("parity_history")
    if not (out_dir or history):
        return
    from .. import report

    meta = session.metadata(list(cfg.recipes), config.invocation_params.args)
    try:
        hist = report.append_history(rows, meta, history) if history else None
        if out_dir:
            report.write_report(rows, meta, out_dir, history=hist)
    except (OSError, ValueError, ImportError) as exc:  # checked at start-up; the disk can still fail
        config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"npu-parity: ERROR: the report/history could not be written ({type(exc).__name__}: {exc})", red=True)

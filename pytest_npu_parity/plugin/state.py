"""Where the plugin keeps its state: the ``config.stash`` keys (pytest's ``Stash``), nothing else."""
from __future__ import annotations

from typing import Any

import pytest

CONFIG_KEY = pytest.StashKey["Any"]()  # config.ParityConfig: every option and ini key, parsed once at configure
SESSION_KEY = pytest.StashKey["Any"]()  # runner.ParitySession of a parity session
ROWS_KEY = pytest.StashKey["list"]()
COLLECTED_KEY = pytest.StashKey["list"]()  # node ids of every collected test (they keep their baselines)
SELECTED_KEY = pytest.StashKey["list"]()  # node ids of the tests this run selected (after -k/-m deselection)
OUTCOME_KEY = pytest.StashKey["dict"]()  # node id -> outcome of its call phase (only "passed" writes a baseline)
LOCK_KEY = pytest.StashKey["Any"]()  # the store lock a record run holds for its whole session
TEMP_KEY = pytest.StashKey["tuple"]()  # ("removed" | "found", [(path, bytes)]) temporary files of killed writes
DEEPSPEED_LINT_KEY = pytest.StashKey[tuple]()  # (config as named in ini, [deepspeed_config.Finding])
PROFILE_KEY = pytest.StashKey[str]()  # the hypothesis profile in force before this session loaded its own
STALE_KEY = pytest.StashKey["list"]()  # runner.StaleSuite of this session, computed once at the summary

SKIP_REASON = "parity suites run only with --npu-parity (or --update-baselines)"


def parity_config(config: pytest.Config) -> Any:
    """This session's ``config.ParityConfig`` (stashed by ``pytest_configure``)."""
    return config.stash[CONFIG_KEY]

"""Test-only import hook (on PYTHONPATH via ``fake_env.fake_env(event_log=...)``): logs every first
``import aurora`` of every interpreter — pytest, xdist workers, spawned ranks — into the stub's event
log (``FAKE_NPU_EVENT_LOG``, see ``torch_npu/_events.py``) with the running test
(``PYTEST_CURRENT_TEST``), so a test can tell whether the launcher steps came before it.
``FAKE_BLOCK_AURORA_IMPORT=1`` then refuses the import (ImportError), which stops a fixture before
it builds a model."""
import json
import os
import sys


class _AuroraImportLog:
    def find_spec(self, name, path=None, target=None):
        if name != "aurora":
            return None
        log = os.environ.get("FAKE_NPU_EVENT_LOG")
        if log:
            entry = {"pid": os.getpid(), "event": "import aurora", "test": os.environ.get("PYTEST_CURRENT_TEST")}
            with open(log, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(entry) + "\n")
        if os.environ.get("FAKE_BLOCK_AURORA_IMPORT") == "1":
            raise ImportError("import of aurora blocked by the test's import hook (FAKE_BLOCK_AURORA_IMPORT=1)",
                              name="aurora")
        return None


sys.meta_path.insert(0, _AuroraImportLog())

"""The stub's event log: when ``FAKE_NPU_EVENT_LOG`` names a file, every launcher-relevant call
(``transfer_to_npu`` registration, ``set_compile_mode``, ``set_device``) appends one JSON line
``{"pid": …, "event": …, …}`` to it, so a test can read the order of calls across processes (pytest
itself, xdist workers, spawned data-parallel ranks). ``tests/fakes/import_hook`` logs ``import aurora``
into the same file."""
import json
import os


def record(event, **data):
    path = os.environ.get("FAKE_NPU_EVENT_LOG")
    if not path:
        return
    line = json.dumps({"pid": os.getpid(), "event": event, **data}) + "\n"
    with open(path, "a", encoding="utf-8") as handle:  # one short append per line: whole lines
        handle.write(line)

"""Diagnosis of a red check: where it first diverges (``localize``), which op computes its own
result wrongly (``op_trace``), a standalone reproduction (``repro``) and whether a check has teeth
(``selfcheck``); and whether the environment can be trusted at all (``doctor``). (What a run did
across the host/device boundary, the audit, is measured by the run itself: ``runtime/audit``.)"""

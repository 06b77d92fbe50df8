"""Diagnosis of a red check: where it first diverges (``localize``), which op computes its own
result wrongly (``op_trace``), a standalone reproduction (``repro``) and whether a check has teeth
(``selfcheck``)."""

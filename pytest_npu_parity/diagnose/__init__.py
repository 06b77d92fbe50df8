"""Diagnosis of a red check: where it first diverges (``localize``), which op computes its own
result wrongly (``op_trace``), a standalone reproduction (``repro``) and whether a check has teeth
(``selfcheck``); what a run did across the host/device boundary (``audit``) and whether the
environment can be trusted at all (``doctor``, with the guides' ``troubleshoot`` items)."""

"""Running computations: how a check runs on a device.

One side's run of a check (``side``, ``golden_run``, ``layer_capture``) and the mechanics of one
training step (``training``); what a run did across the host/device boundary (``audit/``, the
device-propagation audit); the recipes, the shared random stream and the machine-independent
weights (``recipes``, ``rng``, ``stable_init``); the target devices and the Ascend stack (``devices``,
``npu/``) and what the run is (``machine``: the provenance record a baseline stores); data-parallel
and Trainer runs (``distributed``, ``process_group``, ``hf_trainer``, ``deepspeed_config``); N training
steps recorded as curves for ``judge.trajectory`` (``trajectory``, not yet called by a check).
"""

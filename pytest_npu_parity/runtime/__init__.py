"""Running computations: one side's run of a check, and the mechanics of one training step."""

"""Time budgets of the diagnoses, in a module that imports nothing: the plugin's option table shows
their defaults in ``--help`` at every pytest start, where importing the engine (and so torch) would
cost a project that never runs a parity check several seconds.
"""
from __future__ import annotations

#: Default localization budget of one session, wall seconds (``localize.Localizer``). Measured on the
#: Aurora main job (docs/explanation/performance.md): a fault failing every whole-model and decoder
#: check keeps the red run within about twice the green one on 2 cores.
DEFAULT_BUDGET_S = 10.0

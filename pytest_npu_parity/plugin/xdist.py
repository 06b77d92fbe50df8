"""pytest-xdist: is this process the controller (runs no test), and which worker is it."""
from __future__ import annotations

import pytest


def is_xdist_controller(config: pytest.Config) -> bool:
    """True in the pytest-xdist controller of a distributed run: it runs no test (its workers do),
    so it binds no device. xdist's own test (``plugin._is_distribution_mode``): ``--dist`` not ``no``
    and test environments (``--tx``, set from ``-n``), and not ``--collect-only``."""
    if getattr(config, "workerinput", None) is not None:
        return False
    option = config.option
    return (getattr(option, "dist", "no") != "no" and bool(getattr(option, "tx", None))
            and not getattr(option, "collectonly", False))


def xdist_worker_id(config: pytest.Config) -> str | None:
    """``gwK`` inside a pytest-xdist worker, else None."""
    return (getattr(config, "workerinput", None) or {}).get("workerid")

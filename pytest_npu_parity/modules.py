"""Which ``torch.nn.Module`` a computation belongs to.

A check's computation is a module, a bound method of one (``model.generate``) or a plain function.
The runner moves and copies that module, the golden runner casts a copy of it; both ask this module,
so neither imports the other.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch


def owner_module(fn: Any) -> torch.nn.Module | None:
    """The module that ``fn`` is (a module) or belongs to (a bound method of a module), else None."""
    if isinstance(fn, torch.nn.Module):
        return fn
    if inspect.ismethod(fn) and isinstance(fn.__self__, torch.nn.Module):
        return fn.__self__
    return None

"""Attribute switches: how tests plant a fault (in the target only, or around a block)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch


@contextlib.contextmanager
def attribute_set(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.<name> = value`` inside the block; the value it had is put back on exit (also on error)."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def switched(cls: type, attribute: str, value: Any) -> Callable[[torch.device], ContextManager[None]]:
    """A patch set (``(device) -> context manager``, a case's ``patches=``) that sets ``cls.<attribute>``
    to ``value`` inside the target's runs only (``attribute_set``)."""
    return lambda device: attribute_set(cls, attribute, value)

"""Helpers shared by the tests (imported as a plain module from the tests folder): pytester projects and patch sets."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path


def edit_module(module: Path, old: str, new: str) -> None:
    """Replace ``old`` (which must occur) in ``module`` and move its mtime forward by 2 s, so a
    later in-process pytest run does not reuse the cached bytecode of the old text."""
    text = module.read_text()
    assert old in text, f"{old!r} not in {module}"
    stat = module.stat()
    module.write_text(text.replace(old, new))
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


def import_lazy_modules(tmp_dir: Path) -> None:
    """Import, in this process, the modules that cannot be imported twice in one process, before
    in-process pytester runs (each drops the modules it imported): torch._inductor ("Only a single
    TORCH_LIBRARY can be used to register the namespace _inductor_test"; torch imports
    torch._dynamo lazily at the first op under an audit's function mode and at the first optimizer
    step) and pandas' parquet support ("A type extension with name pandas.period already defined",
    at a report's first parquet file)."""
    import pandas as pd
    import torch

    from pytest_npu_parity.audit import audit_call

    audit_call(torch.nn.Linear(2, 2), (torch.ones(1, 2),), logical=True)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).step()
    try:
        pd.DataFrame({"a": [1]}).to_parquet(Path(tmp_dir) / "a.parquet")
    except ImportError:  # no parquet engine: reports write csv only
        pass


def edited_weight(model, name: str, factor: float, session=None):
    """A patch set (``ParityCase(patches=...)``) that scales ``model``'s parameter ``name`` in place by
    ``factor`` while the target runs and restores it after: a port's weight fault. With ``session``
    the session's placed copies of ``model`` are dropped on entry and exit (``ParitySession.forget``),
    as a check of a module needs; a train step copies the module inside each run."""
    import torch

    @contextlib.contextmanager
    def patches(device):
        weight = model.get_parameter(name)
        saved = weight.detach().clone()
        with torch.no_grad():
            weight.mul_(factor)
        if session is not None:
            session.forget(model)
        try:
            yield
        finally:
            with torch.no_grad():
                weight.copy_(saved)
            if session is not None:
                session.forget(model)
    return patches

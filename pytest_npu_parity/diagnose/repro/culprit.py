"""Which piece of a failing check a repro replays (``Culprit``), and the folder it goes to."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


#: Inputs plus weights a repro may hold, bytes (a larger culprit gets a README saying so, no tensors).
DEFAULT_MAX_BYTES = 512 * 2**20
#: Ops one ``ops`` replay may record.
MAX_OPS = 20000
#: Longest folder name made from a test id or check name (longer ones are cut and get a hash).
MAX_NAME = 100


class ReproUnsupported(Exception):
    """The piece cannot be written as a repro (the message says why)."""


@dataclass
class Culprit:
    """The piece a repro replays.

    Attributes:
        name: its module's path inside the check's module (``""``: the module itself); ``index``:
            which call of it (0-based), as ``#k`` in the localization table.
        display: how the report names it (``blocks.2.b``, ``attn: aten._softmax.default``).
        why: the sentence saying why it was chosen.
        op: for an op culprit, ``(namespace, name, overload)``; ``op_index``: its place among the
            ops dispatched in the module call (the op trace's ``#``).
    """

    name: str
    index: int
    display: str
    why: str
    op: tuple[str, str, str] | None = None
    op_index: int | None = None


def sanitize(text: str) -> str:
    """A folder name from a test id or check name: characters other than ``[A-Za-z0-9._-]`` become
    ``_``; a name longer than ``MAX_NAME`` is cut and ends in 8 hex digits of its SHA-1."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "_"
    if len(name) > MAX_NAME:
        name = name[:MAX_NAME - 9] + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
    return name


def repro_dir(root: Path, test_id: str, check: str) -> Path:
    """``root/<sanitized test id>/<sanitized check>``."""
    return Path(root) / sanitize(test_id) / sanitize(check)


# --------------------------------------------------------------------------------------------
# which piece


def _split_site(path: str, prefix: str) -> tuple[str, int]:
    """(module path inside the check's module, call index) of a localization row's ``submodule``
    (``prefix.name#k``; ``<Type>`` for the module itself)."""
    index = 0
    match = re.fullmatch(r"(.*)#(\d+)", path)
    if match:
        path, index = match.group(1), int(match.group(2))
    if path.startswith("<"):
        return "", index
    if prefix and path == prefix:
        return "", index
    if prefix and path.startswith(prefix + "."):
        path = path[len(prefix) + 1:]
    return path, index


def choose_culprit(record: Any, call: Any) -> Culprit | None:
    """The piece to replay, from the localization the ``Localizer`` left in ``record.localized``:
    the first culprit op of the op trace with a ``local`` verdict (a kernel beyond its dtype's
    budget), else the first diverging submodule, else the check's whole module (None for a check of
    a function, or of a bound method without a diverging submodule)."""
    if call.module is None:
        return None
    prefix = record.submodule or ""
    rows = record.localized.localization or []
    first = next((r for r in rows if r.get("kind") == "activation" and r.get("first_divergence")), None)
    name, index = _split_site(first["submodule"], prefix) if first else ("", 0)
    where = first["submodule"] if first else (prefix or f"<{type(call.module).__name__}>")
    bound = not isinstance(call.fn, torch.nn.Module)
    op_row = next((r for r in record.localized.localization_ops or [] if r.get("first_op")), None)
    if op_row is not None and op_row.get("verdict") == "local" and not (bound and first is None):
        namespace, _, op = op_row["op"].partition(".")
        return Culprit(name, index, f"{where}: {op_row['op']}.{op_row['overload']}",
                       f"the op trace named {op_row['op']}.{op_row['overload']} (op #{op_row['op_index']} of "
                       f"{where}, in {op_row['module']}) as the first op whose own error is beyond its "
                       f"{op_row['dtype']} budget", (namespace, op, op_row["overload"]), int(op_row["op_index"]))
    if first is not None:
        return Culprit(name, index, where, f"the localization named {where} ({first.get('module_type')}) as the "
                                           f"first diverging submodule (verdict {first.get('verdict')})")
    if bound:
        return None
    why = ("no submodule diverges locally: the difference starts in the check's module itself"
           if record.localized.localization is not None
           else "no localization ran for this check: the whole checked module is replayed")
    return Culprit("", 0, where, why)


# --------------------------------------------------------------------------------------------
# encoding arguments (the script's ``decode`` reads them back)



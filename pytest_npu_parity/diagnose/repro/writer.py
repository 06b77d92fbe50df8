"""The repro folder: rebuilding the culprit module standalone, the generated script, its verification
on the CPU, and ``ReproWriter``, the failure hook that writes it all."""
from __future__ import annotations

import ast
import datetime
import importlib
import inspect
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..localize.sides import _Side
from .capture import (_capture_target, _cpu, _encode_plain, _first_difference, _input_names, _literal, _op_reference,
                      _reference)
from .culprit import DEFAULT_MAX_BYTES, Culprit, ReproUnsupported, choose_culprit, repro_dir
from .script import SCRIPT


def _class_path(module: torch.nn.Module) -> tuple[str, str]:
    """(import path, qualname) of ``module``'s class, checked to import back to that class.

    Raises:
        ReproUnsupported: defined inside a function, in ``__main__``, or not importable by that path.
    """
    cls = type(module)
    path, qual = cls.__module__, cls.__qualname__
    if "<locals>" in qual:
        raise ReproUnsupported(f"its class {qual} is defined inside a function, so no import path reaches it")
    if path == "__main__":
        raise ReproUnsupported(f"its class {qual} is defined in the __main__ script, which a repro cannot import")
    try:
        obj: Any = importlib.import_module(path)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # noqa: BLE001 - any import problem means: not rebuildable by path
        raise ReproUnsupported(f"{path}.{qual} does not import ({type(exc).__name__}: {exc})") from None
    if obj is not cls:
        raise ReproUnsupported(f"{path}.{qual} imports another object than the module's class")
    return path, qual


def _constructor_kwargs(module: torch.nn.Module) -> dict[str, Any]:
    """The constructor arguments of ``module`` read off the instance (module doc).

    Raises:
        ReproUnsupported: a required parameter with no attribute of its name, or one holding
            something other than a literal.
    """
    try:
        params = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError) as exc:
        raise ReproUnsupported(f"its constructor has no signature to read ({exc})") from None
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        has_default = p.default is not inspect.Parameter.empty
        if p.name in ("device", "dtype") and has_default:
            continue  # the weights loaded with assign=True carry both
        if hasattr(module, p.name) and not isinstance(getattr(module, p.name), torch.nn.Module):
            value = getattr(module, p.name)
            if isinstance(p.default, bool) and (value is None or isinstance(value, torch.Tensor)):
                value = value is not None  # Linear(bias=True) keeps its bias Parameter (or None)
            if _literal(value) and ast.literal_eval(repr(value)) == value:
                kwargs[p.name] = value
                continue
            if not has_default:
                raise ReproUnsupported(f"its constructor argument {p.name!r} is a {type(value).__name__}, not a "
                                       "literal the script can write down")
        elif not has_default:
            raise ReproUnsupported(f"its constructor argument {p.name!r} is not kept as an attribute of the module, "
                                   "so its value cannot be found")
    return kwargs


# --------------------------------------------------------------------------------------------
# writing


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def _nbytes(*groups: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for g in groups for t in g.values())


def _recorded_note(actual: dict, expected: dict, tol: Any) -> list[str]:
    """A note when the target's recorded outputs of the piece agree with the expected ones under the
    check's tolerance: the piece alone does not show the failure (the difference it inherited from
    earlier layers, or another call of a module that runs several times, carried it)."""
    from ...judge.allclose import compare

    plain = {k: v for k, v in expected.items() if not k.startswith("golden.")}
    if not plain or compare(actual, plain, tol).passed:
        return ["the target's recorded outputs of this piece are within the check's tolerance of the expected "
                "ones: run alone on the inputs the target gave it, the piece does not show the failure (what it "
                "inherited from earlier layers, or another call of it, did); the localization table says more"]
    return []


def script_text(spec: dict[str, Any]) -> str:
    """``repro.py`` for ``spec``: ``repro.script.SCRIPT`` with the spec as a raw JSON string literal (JSON
    escapes every quote inside its strings and puts separators between tokens, so it never holds the
    three quotes that would end the literal)."""
    return SCRIPT.replace("__SPEC__", 'r"""' + json.dumps(spec, indent=1, ensure_ascii=True) + '"""')


def _failure_line(record: Any) -> str:
    """One sentence on the check's failure: its worst leaf's numbers."""
    text = f"Parity check `{record.check}` failed (recipe {record.recipe}, target {record.target} vs {record.reference})"
    failures = record.result.failures if record.result is not None else []
    if failures:
        worst = max(failures, key=lambda leaf: leaf.err_ratio if not math.isnan(leaf.err_ratio) else math.inf)
        text += (f": worst leaf `{worst.path or '<output>'}` max_abs {worst.max_abs:.3g}, rel_l2 {worst.rel_l2:.3g}, "
                 f"{worst.mismatched}/{worst.numel} elements out of tolerance, err/tol {worst.err_ratio:.3g}")
    return text


def _fmt_tol(tol: Any) -> str:
    return f"rtol={tol.rtol:g} atol={tol.atol:g} budget={tol.budget:g}"


def _script_namespace(path: Path) -> dict[str, Any]:
    """The generated script loaded as a module (its ``main`` not run), to replay it here."""
    namespace: dict[str, Any] = {"__name__": "parity_repro", "__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - our own generated script
    return namespace


def _verify(folder: Path, expected: dict[str, torch.Tensor], tol: Any) -> tuple[str | None, str]:
    """Run the script's replay on the CPU here: (None when it gives ``expected`` bitwise, else why not;
    a README note with its verdict under ``tol``)."""
    from ...judge.allclose import compare

    try:
        outputs = _script_namespace(folder / "repro.py")["replay"]("cpu")
    except Exception as exc:  # noqa: BLE001 - a rebuild that does not run is not a rebuild
        why = f"the replay raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return why, f"replayed on the CPU while this repro was written: {why}"
    plain = {k: v for k, v in expected.items() if not k.startswith("golden.")}
    verdict = compare({k: outputs.get(k) for k in plain}, plain, tol).passed
    note = ("replayed on the CPU while this repro was written: " + ("PASS (a correct device matches the reference)"
            if verdict else "FAIL — the replayed computation itself differs from the reference's (its code or "
            "what it asks for, not a device kernel)"))
    for key, want in plain.items():
        got = outputs.get(key)
        if got is None or got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got.cpu(), want):
            return (f"the module rebuilt from the arguments found computes another {key} than the reference's "
                    "(its constructor arguments are not all kept as attributes)"), note
    return None, note


def _op_piece(case: Any, call: Any, culprit: Culprit) -> tuple[dict, dict, dict, dict, dict]:
    """``(spec, inputs, weights, expected, actual)`` of a repro of the one op the op trace named: the
    op recorded on the target when the check runs again, its reference (and golden) outputs.

    Raises:
        ReproUnsupported: the op was not dispatched again, its record failed, or another op came first.
    """
    got = _capture_target(case, call, culprit, ops=True)
    rec = got.recorder
    if rec is None or not rec.ops:
        raise ReproUnsupported(f"op #{culprit.op_index} of {culprit.name or 'the module'} was not dispatched "
                               "when the check ran again")
    if rec.error:
        raise ReproUnsupported(rec.error)
    recorded = tuple(rec.ops[0]["op"])
    if recorded != culprit.op:
        raise ReproUnsupported(f"op #{culprit.op_index} was {'.'.join(recorded)} when the check ran again, "
                               f"not {'.'.join(culprit.op)}")
    expected, golden = _op_reference(culprit, rec)
    spec = {"mode": "ops", "ops": rec.ops,
            "outputs": {k: {"$o": [0, i]} for i, k in enumerate(expected)}}
    inputs, weights, actual = rec.tensors, {}, rec.actual
    expected = {**expected, **golden}
    return spec, inputs, weights, expected, actual


def _module_spec(module: torch.nn.Module, parted: Any, autocast: str | None, ids: dict, args: Any,
                 kwargs: Any) -> dict:
    """The script's spec that rebuilds ``module`` from its class and constructor arguments and calls it
    on the recorded inputs (``ids``: tensor id -> input name).

    Raises:
        ReproUnsupported: the patch set changes what the module computes on the target (``parted``: where
            its ops part), or the module cannot be rebuilt from its class.
    """
    if parted is not None:
        raise ReproUnsupported("the patch set changes what it computes on the target (its ops part at "
                               f"{parted}), so the module's own class would not run what the target ran")
    path, qual = _class_path(module)
    ctor = _constructor_kwargs(module)
    encode = lambda t: {"$t": ids[id(t)]}  # noqa: E731
    return {"mode": "module", "module": {
        "module": path, "qualname": qual, "kwargs": _encode_plain(ctor, encode),
        "training": module.training, "autocast": autocast,
        "eval_children": [n for n, m in module.named_modules() if n and not m.training],
        "args": _encode_plain(list(args), encode), "kwargs_call": _encode_plain(dict(kwargs), encode)}}


@dataclass
class _Piece:
    """What one repro folder holds: the culprit, the script's spec, its tensors (``{name: CPU tensor}``)
    and the README's notes (``module_note``: why the module could not be rebuilt, or None)."""

    culprit: Culprit
    spec: dict
    inputs: dict
    weights: dict
    expected: dict
    actual: dict
    notes: list = field(default_factory=list)
    module_note: str | None = None


class ReproWriter:
    """The ``ParitySession`` failure hook that writes a repro of each failing check (module doc).

    Put it after the ``localize.Localizer`` in ``failure_hooks``: it reads the localization that hook
    left in ``record.localized`` (a check that was not localized replays its whole module).

    Args:
        root: the folder (created when missing); each check gets ``root/<test id>/<check>/``.
        hint: the command that reruns one check, with ``{test_id}`` (for the README), or None.
        max_bytes: inputs plus weights a repro may store (``DEFAULT_MAX_BYTES``).

    Attributes:
        written: ``{(test_id, check): folder}`` of the repros written (the report's ``repro`` column).
        seconds: wall seconds spent writing repros.

    Raises:
        ValueError: ``root`` exists and is not a folder.
    """

    def __init__(self, root: str | os.PathLike, *, hint: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"repro folder {self.root} is a file; give a folder (created when missing)")
        self.hint = hint
        self.max_bytes = max_bytes
        self.written: dict[tuple[str, str], str] = {}
        self.seconds = 0.0

    def __call__(self, case: Any, record: Any, call: Any, result: Any) -> str | None:
        start = time.perf_counter()
        try:
            folder = self.write(case, record, call)
        except ReproUnsupported as exc:
            return f"(No repro written: {exc}.)"
        finally:
            self.seconds += time.perf_counter() - start
        if folder is None:
            return None
        self.written[(record.test_id, record.check)] = str(folder)
        return (f"Repro for the op owner: {folder} (python {folder / 'repro.py'} --device <device>; "
                "README.md there says what it replays)")

    def write(self, case: Any, record: Any, call: Any) -> Path | None:
        """Write the repro of ``record``'s check; its folder, or None where there is nothing to replay.

        Raises:
            ReproUnsupported: a train step, a piece beyond ``max_bytes``, an argument that cannot
                be stored.
        """
        if call is None:
            return None
        if call.kind != "check":
            raise ReproUnsupported("train steps are not replayed as repros (the failure names the first "
                                   "diverging gradient or buffer)")
        culprit = choose_culprit(record, call)
        if culprit is None:
            if call.module is None:
                raise ReproUnsupported("the check runs a function, not a module, so there is no piece to replay")
            raise ReproUnsupported("the check runs a bound method and no submodule of it diverges, so there is "
                                   "no module call to replay")
        notes: list[str] = []
        module_note: str | None = None
        if culprit.op is not None:
            spec, inputs, weights, expected, actual = _op_piece(case, call, culprit)
        else:
            root = _Side(case, call, torch.device("cpu"), patched=False).root()
            module = root.get_submodule(culprit.name) if culprit.name else root
            held = sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
            if held > self.max_bytes:  # before any run: a whole model's weights are known up front
                raise ReproUnsupported(f"the weights of {culprit.display} take {held / 2**20:.0f} MiB, more than the "
                                       f"{self.max_bytes / 2**20:.0f} MiB a repro may hold")
            probe = _capture_target(case, call, culprit, ops=False)
            expected, weights, named_weights, reference_ops = _reference(case, call, culprit, probe)
            parted = _first_difference(probe.op_names.names if probe.op_names else [], reference_ops)
            autocast = str(probe.state[2]).removeprefix("torch.") if probe.state and probe.state[1] else None
            args, kwargs = probe.inputs
            ids, named = _input_names(args, kwargs)
            inputs, actual = {k: _cpu(t) for k, t in named.items()}, probe.actual
            spec = None
            try:
                spec = _module_spec(module, parted, autocast, ids, args, kwargs)
            except ReproUnsupported as exc:
                module_note = f"{culprit.display} ({type(module).__name__}) cannot be rebuilt standalone: {exc}"
            self._fits(inputs, weights)
            if spec is not None:
                spec["grad"] = bool(call.grad)
                folder = self._commit(record, case, _Piece(culprit, spec, inputs, weights, expected, actual,
                                                           notes + _recorded_note(actual, expected, record.tolerance)),
                                      bitwise=True)
                if isinstance(folder, Path):
                    return folder
                module_note = f"{culprit.display} ({type(module).__name__}) cannot be rebuilt standalone: {folder}"
            got = _capture_target(case, call, culprit, ops=True)
            rec = got.recorder
            if rec.error:
                raise ReproUnsupported(f"{module_note}; and its ops cannot be replayed: {rec.error}")
            spec = {"mode": "ops", "ops": rec.ops, "outputs": rec.outputs}
            inputs = rec.tensors
            weights = {k: v for k, v in named_weights.items() if k in rec.weights_used}
            if rec.random:
                notes.append("the piece draws random numbers (dropout, sampling); the replayed ops draw from this "
                             "torch's own generator, so their outputs differ from the recorded ones")
        self._fits(inputs, weights)
        spec["grad"] = bool(call.grad)
        notes += _recorded_note(actual, expected, record.tolerance)
        folder = self._commit(record, case, _Piece(culprit, spec, inputs, weights, expected, actual, notes, module_note))
        assert isinstance(folder, Path)
        return folder

    def _too_big(self, inputs: dict, weights: dict) -> bool:
        return _nbytes(inputs, weights) > self.max_bytes

    def _fits(self, inputs: dict, weights: dict) -> None:
        """Raise ``ReproUnsupported`` when the inputs and weights take more than ``max_bytes``."""
        if self._too_big(inputs, weights):
            raise ReproUnsupported(f"its inputs and weights take {_nbytes(inputs, weights) / 2**20:.0f} MiB, more "
                                   f"than the {self.max_bytes / 2**20:.0f} MiB a repro may hold")

    def _commit(self, record: Any, case: Any, piece: _Piece, bitwise: bool = False) -> Path | str:
        """Write the files into a temporary folder beside the final one, replay the script there on the
        CPU (its verdict goes into the README), then rename the folder into place. With ``bitwise`` (a
        module rebuild) a replay that does not give ``expected`` bitwise publishes nothing: the reason
        is returned instead of the folder."""
        final = repro_dir(self.root, record.test_id, record.check)
        final.parent.mkdir(parents=True, exist_ok=True)
        tol = record.tolerance
        spec = dict(piece.spec, check=record.check, test_id=record.test_id, target=str(case.target),
                    piece=piece.culprit.display, tolerance={"rtol": tol.rtol, "atol": tol.atol, "budget": tol.budget})
        inputs, weights, expected, actual = piece.inputs, piece.weights, piece.expected, piece.actual
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        umask = os.umask(0)
        os.umask(umask)
        try:
            _save(tmp / "inputs.safetensors", inputs)
            if weights:
                _save(tmp / "weights.safetensors", weights)
            _save(tmp / "expected.safetensors", expected)
            _save(tmp / "actual.safetensors", actual)
            (tmp / "repro.py").write_text(script_text(spec))
            problem, replayed = _verify(tmp, expected, tol)
            if bitwise and problem is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                return problem
            readme = replace(piece, spec=spec, notes=list(piece.notes) + [replayed])
            (tmp / "README.md").write_text(self._readme(record, case, readme))
            for item in tmp.iterdir():  # mkdtemp's folder is private; a repro is meant to be handed over
                item.chmod(0o666 & ~umask)
            tmp.chmod(0o777 & ~umask)
            if final.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
                os.replace(final, old / final.name)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def _readme(self, record: Any, case: Any, piece: _Piece) -> str:
        from ... import __version__

        culprit, spec, notes, module_note = piece.culprit, piece.spec, piece.notes, piece.module_note
        inputs, weights, expected, actual = piece.inputs, piece.weights, piece.expected, piece.actual

        tol = record.tolerance
        mode = ("the module rebuilt from its class (`%s.%s`) with the weights in `weights.safetensors`"
                % (spec["module"]["module"], spec["module"]["qualname"]) if spec["mode"] == "module"
                else f"{len(spec['ops'])} aten op(s) replayed in order (`torch.ops.<namespace>.<op>.<overload>`)")
        first_line = _failure_line(record)
        lines = [f"# Repro: {record.check} ({record.test_id})", "",
                 f"{first_line}.", "",
                 f"**Piece:** {culprit.display} — chosen because {culprit.why}.", "",
                 f"**Replayed as:** {mode}.", ""]
        if module_note:
            lines += [f"**Why not the module:** {module_note}; the repro replays its ops instead.", ""]
        lines += ["## Run it", "", "```", "python repro.py                  # on the CPU: (b) should PASS",
                  f"python repro.py --device {case.target if case.target.type != 'cpu' else 'npu:0'}"
                  "   # on the device under test", "python repro.py --recorded-only  # the recorded verdict only", "```",
                  "", "It prints (a) the target's recorded outputs (`actual.safetensors`) vs the expected ones and "
                  "(b) the piece re-run on `--device` vs the expected ones, each leaf with max_abs, max_rel, rel_l2, "
                  "cosine, mismatched elements and err/tol (max |a − e| / (atol + rtol·|e|)), and exits 1 when (b) "
                  "is out of tolerance (with `--recorded-only`: when (a) is).", ""]
        if self.hint:
            lines += ["The check itself: `" + self.hint.format(test_id=shlex.quote(record.test_id)) + "`", ""]
        lines += ["## Tolerance", "", f"{_fmt_tol(tol)} (source: {tol.source}"
                  + (f"; {tol.reason}" if tol.reason else "") + "): a leaf passes when at most floor(budget · numel) "
                  "elements have |a − e| > atol + rtol·|e|; integer and bool leaves must be equal.", "",
                  "## Files", "",
                  "| file | holds |", "|---|---|",
                  f"| inputs.safetensors | {', '.join(sorted(inputs)) or '-'} (as the target received them) |",
                  f"| weights.safetensors | {len(weights)} tensors (the reference's state_dict of the piece) |"
                  if weights else "| weights.safetensors | (none: the piece has no weights, or an op replay) |",
                  f"| expected.safetensors | {', '.join(sorted(expected))} (the reference run on these inputs"
                  + ("; golden.*: float64" if any(k.startswith("golden.") for k in expected) else "") + ") |",
                  f"| actual.safetensors | {', '.join(sorted(actual))} (the target's outputs) |", "",
                  "## Provenance", "",
                  f"- test: `{record.test_id}`, check `{record.check}`, recipe `{record.recipe}`",
                  f"- target: {record.target} ({record.target_name}); reference: {record.reference}"
                  + (f" ({record.reference_provenance})" if record.reference_provenance else "")
                  + "; the expected outputs are a live CPU run of the piece",
                  f"- torch {torch.__version__}, Python {sys.version.split()[0]}, pytest-npu-parity {__version__}",
                  f"- written {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}", ""]
        if notes:
            lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
        return "\n".join(lines)

"""Layer capture: record every weighted layer's first output (and input), sampled, while a side runs.

Every check of a module also records, on each side, the output of each of its submodules
that holds parameters of its own (``Linear``, ``Conv2d``, ``LayerNorm``, ``Embedding``,
``BatchNorm2d``, an ``LSTM`` inside a larger model …; the checked module itself is left out: its
output is the check's; so are modules whose forward changes path when hooked, ``HOOK_SENSITIVE``),
at the first call of that submodule in the run:

* the first dense floating tensor of the output (in ``compare.flatten`` order) and of the
  positional inputs, flattened;
* of each, the values at ``samples`` positions (``compact.sample_indices``: the same positions for
  a layer of that name and size on every machine), or all of them when it has no more.

The records travel with the check's leaves as ``layer:<submodule path>`` (output) and
``layer:<submodule path>@in`` (input) — a baseline stores them beside the outputs, 512 bytes per layer
at the default 64 samples — and are taken out before the outputs are compared
(``split_layers``). Why layers are recorded, and how the records are judged, is
``judge.layers`` (``judge_layers``; its module docstring gives the measurements and the rule): this
module only takes them, as part of a side's run (``runtime.side``). (Split from ``layers.py``, which
held the capture and the verdict; ``pytest_npu_parity.layers`` re-exports every name.)
"""
from __future__ import annotations

import array
import contextlib
import functools
import math
from typing import Any, Iterator

import torch

#: Key prefix of a layer record among a check's leaves.
LAYER_PREFIX = "layer:"
#: Values recorded per layer output (default).
DEFAULT_SAMPLES = 64
#: Key suffix of a layer's input record.
INPUT_SUFFIX = "@in"
#: Key suffix of the marker a recurrent layer's record carries (``capture_layers``): judged at
#: ``RECURRENT_FACTOR`` times the limit.
RECURRENT_SUFFIX = "@recurrent"
_SUFFIXES = (INPUT_SUFFIX, RECURRENT_SUFFIX)


def _first_floating(output: Any) -> torch.Tensor | None:
    """The first dense floating tensor of ``output``: ``output`` itself when it is one, else the first
    such leaf in ``leaves.flatten`` order (that very tensor, not a copy). A dense floating tensor is a
    strided, non-nested tensor of a floating dtype with at least one element. None when there is no
    such leaf, or when ``flatten`` refuses ``output`` (``TypeError``/``ValueError``: an object it cannot
    walk, an int beyond int64).

    A plain ``tuple`` or ``list`` of tensors and ``None`` (a layer's positional inputs, most layers'
    outputs) is walked here directly instead of through ``flatten``'s generators: ``flatten`` yields
    such a container's elements in order, each tensor as itself and each ``None`` as a leaf that is
    never a record, so the walk finds the same tensor. Any other element (a number, a string, a nested
    container) sends the whole output down the generic path: ``flatten`` turns a Python float into a
    float64 0-d tensor, which is then the answer."""
    if isinstance(output, torch.Tensor):
        ok = (output.is_floating_point() and output.layout == torch.strided and not output.is_nested
              and output.numel() > 0)
        return output if ok else None
    if type(output) is tuple or type(output) is list:  # not a named tuple or another subclass
        try:
            for item in output:
                if isinstance(item, torch.Tensor):
                    if _first_floating(item) is not None:
                        return item
                elif item is not None:
                    break  # not a tensor or None: the generic path below decides
            else:
                return None
        except (TypeError, ValueError):  # a tensor subclass that refuses an op: as the generic path does
            return None
    from ..leaves import flatten

    try:
        for _, leaf in flatten(output):
            found = _first_floating(leaf) if isinstance(leaf, torch.Tensor) else None
            if found is not None:
                return found
    except (TypeError, ValueError):
        return None
    return None


@functools.lru_cache(maxsize=4096)
def _position_array(path: str, numel: int, samples: int) -> array.array:
    """``compact.sample_indices(path, numel, samples)`` as a plain ``array.array`` of int64, cached.

    Why not cache the tensor: the cache is filled during a forward, at each layer size's first record,
    and what it keeps lives to the session's end. A tensor's bytes and its C++ objects come from the C
    allocator, between the forward's large intermediates, and ~1,200 such small blocks kept alive there
    stop the freed intermediates' memory from being reused: the full Aurora model's first fp32
    forwards under the hooks took 72,000–84,000 and 62,000–64,000 fresh pages (minor page faults) against
    2,000–5,000 without hooks, and 0.2–0.25 s more over five full-model checks. An array of up to 512
    bytes (64 int64 samples) comes from Python's small-object allocator, outside that heap: 400–700
    and 800 (measured on a 2-core AMD EPYC, glibc 2.36, torch 2.14.1; see
    docs/explanation/performance.md)."""
    from ..store.compact import sample_indices

    return array.array("q", sample_indices(path, numel, samples).tolist())


def _positions(path: str, numel: int, samples: int) -> torch.Tensor:
    """The sample positions of a layer record (int64, ``samples`` sorted flat positions in
    ``[0, numel)``): a tensor over the cached ``_position_array``, sharing its memory (never written)."""
    return torch.frombuffer(_position_array(path, numel, samples), dtype=torch.int64)


@functools.lru_cache(maxsize=4096)
def _offset_array(path: str, shape: tuple[int, ...], stride: tuple[int, ...], samples: int) -> tuple[array.array, int]:
    """``_offsets``' values as a plain ``array.array`` of int64 and the extent, cached (why an array:
    ``_position_array``)."""
    index = _positions(path, math.prod(shape), samples).clone()
    offsets = torch.zeros_like(index)
    for size, step in zip(reversed(shape), reversed(stride)):
        offsets += (index % size) * step
        index //= size
    return array.array("q", offsets.tolist()), int(offsets.max()) + 1


def _offsets(path: str, shape: tuple[int, ...], stride: tuple[int, ...], samples: int) -> tuple[torch.Tensor, int]:
    """``(offsets, extent)``: where ``_positions(path, numel, samples)`` lie in the storage of a tensor
    of ``shape`` and ``stride``, counted from its ``storage_offset`` (each position unravelled in
    row-major order and dotted with the strides), and one more than the largest offset."""
    offsets, extent = _offset_array(path, shape, stride, samples)
    return torch.frombuffer(offsets, dtype=torch.int64), extent


def _sampled(key: str, tensor: torch.Tensor, samples: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The values of ``tensor`` at ``samples`` positions of its row-major flattening (all of them when
    it has no more), as a 1-D tensor: a new one, or the first values of ``out`` (a contiguous 1-D tensor
    of ``tensor``'s dtype and device with at least ``samples`` elements) written in place. A
    non-contiguous tensor (a ``channels_last`` conv output, a transpose, an expanded tensor) is read at
    those positions' storage offsets (``_offsets``, cached per layer, shape and strides) instead of
    being copied whole by ``reshape``: the same values, without a copy of the layer's output, and
    without ``torch.unravel_index``'s per-call work (0.26 ms a record, 20× the contiguous path)."""
    if tensor.requires_grad:  # a training step's output; detaching any other tensor changes nothing
        tensor = tensor.detach()
    numel = tensor.numel()
    if numel <= samples:
        values = tensor.reshape(-1)
        return values.clone() if out is None else out[:numel].copy_(values)
    if tensor.is_contiguous():
        flat = tensor.reshape(-1)
        positions = _positions(key, numel, samples)
    else:
        positions, extent = _offsets(key, tuple(tensor.shape), tuple(tensor.stride()), samples)
        flat = tensor.as_strided((extent,), (1,))  # the storage from the tensor's first element on
    if not tensor.is_cpu:  # the cached positions live on the CPU
        positions = positions.to(tensor.device)
    if out is None:
        return flat.index_select(0, positions)
    if out.numel() != samples:  # a longer row: write its first ``samples`` values
        out = out[:samples]
    return torch.index_select(flat, 0, positions, out=out)


class _Rows:
    """Preallocated storage of one run's layer records: per (device, dtype) one ``[rows, samples]``
    tensor, allocated at its first record; each record is written into a row of it.

    Why not a new tensor per record: holding ~1,200 small tensors alive through a forward of the full
    Aurora model made that forward 0.5–0.65 s slower (1.9–2.1 s instead of 1.4 s, fp32, 2-core AMD
    EPYC, torch 2.14.1), with 47,000–61,000 more minor page faults, while the model's large
    intermediates were allocated and freed around them; the same records written into rows of one
    buffer cost 0–0.05 s and no extra faults (measured by timing that forward with forward hooks that
    keep ``torch.zeros(64)`` per module vs rows of one preallocated tensor)."""

    def __init__(self, rows: int, samples: int) -> None:
        self.rows, self.samples = rows, samples
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.written: dict[str, tuple[tuple[torch.device, torch.dtype], int, int]] = {}
        self._next: dict[tuple[torch.device, torch.dtype], int] = {}

    def take(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``key``'s record of ``tensor`` (``_sampled``) into the next free row of its buffer."""
        where = (tensor.device, tensor.dtype)
        if where not in self.buffers:
            self.buffers[where] = torch.empty(self.rows, self.samples, dtype=tensor.dtype, device=tensor.device)
        row = self._next.get(where, 0)
        self._next[where] = row + 1
        values = _sampled(key, tensor, self.samples, out=self.buffers[where][row])
        self.written[key] = (where, row, values.numel())

    def records(self) -> dict[str, torch.Tensor]:
        """``{key: 1-D CPU tensor}`` of every record written: each buffer copied to the CPU once, each
        record a copy of its row's values (never a view that would share the buffer's storage)."""
        on_cpu = {where: buffer.cpu() for where, buffer in self.buffers.items()}
        return {key: on_cpu[where][row, :n].clone() for key, (where, row, n) in self.written.items()}


#: Modules whose forward looks at the hooks of itself and its submodules and takes another path
#: when there are any: ``nn.TransformerEncoderLayer`` turns off its fast path
#: (``torch/nn/modules/transformer.py``, ``TransformerEncoderLayer.forward``: "forward pre-/hooks are
#: attached to the module", torch 2.5.1 and 2.14.1). Neither they nor their submodules are hooked, so
#: the layer check never changes what runs.
HOOK_SENSITIVE = (torch.nn.TransformerEncoderLayer,)


def layer_modules(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``(path, module)`` of every submodule of ``root`` with registered parameters of its own
    (``_parameters``; not ``root``), except ``HOOK_SENSITIVE`` modules and everything inside them, and
    script modules."""
    skipped: list[str] = []
    found = []
    for name, m in root.named_modules():
        if any(name == s or name.startswith(s + ".") for s in skipped):
            continue
        if isinstance(m, HOOK_SENSITIVE) or isinstance(m, torch.jit.ScriptModule):
            skipped.append(name)
            continue
        # a registered parameter of its own: what parameters(recurse=False) yields unless the module overrides it
        if name and any(p is not None for p in m._parameters.values()):
            found.append((name, m))
    return found


def compiled_modules(root: torch.nn.Module) -> list[str]:
    """Paths (``""`` for ``root`` itself) of the modules in ``root`` that ``torch.compile`` compiled:
    an ``OptimizedModule`` wrapper (``torch.compile(module)``) or a module compiled in place
    (``module.compile()``, which sets ``_compiled_call_impl``; torch/nn/modules/module.py,
    ``Module.compile``, 2.5.1 and 2.14.1)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch build without dynamo compiles nothing
        return []
    return [name for name, m in root.named_modules()
            if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None]


@contextlib.contextmanager
def capture_layers(root: torch.nn.Module | None, samples: int = DEFAULT_SAMPLES) -> Iterator[dict[str, torch.Tensor]]:
    """Record the first output of every weighted submodule of ``root`` while the block runs.

    Yields a dict that holds ``{"layer:<path>": 1-D tensor}`` in call order once the block ends:
    ``samples`` values of the output (module doc), detached, in the output's dtype, on the CPU. While
    the block runs they are written on the output's device into preallocated rows (``_Rows``), copied
    to the CPU once per buffer at its end. The hooks' own work is not audited (``audit.not_audited``).
    ``root`` None records nothing.
    """
    from .audit import not_audited

    records: dict[str, torch.Tensor] = {}
    handles: dict[str, Any] = {}
    modules = layer_modules(root) if root is not None else []
    rows = _Rows(2 * len(modules), samples)  # at most an output and an input record per layer
    for name, module in modules:
        key = LAYER_PREFIX + name

        def hook(_module, inputs, output, key=key):
            if key in rows.written:
                return
            with not_audited(), torch.no_grad():
                tensor = _first_floating(output)
                if tensor is None:
                    return
                rows.take(key, tensor)
                given = _first_floating(tuple(inputs))
                if given is not None:
                    rows.take(key + INPUT_SUFFIX, given)
            # Only the first call is recorded: the later calls (each decoding step of a generate, a
            # layer applied twice) run without the hook, on the module's hook-free fast path.
            # Removing it here is safe: Module._call_impl calls the hooks from a copy of the table
            # (torch/nn/modules/module.py, 2.5.1 and 2.14.1).
            handles[key].remove()

        handles[key] = module.register_forward_hook(hook)
        if isinstance(module, torch.nn.RNNBase):
            records[key + RECURRENT_SUFFIX] = torch.ones(1)
    try:
        yield records
    finally:
        for handle in handles.values():
            handle.remove()  # again for a hook that already removed itself: a no-op
        with not_audited():
            records.update(rows.records())


def split_layers(leaves: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """``(leaves without layer records, the layer records)`` of a check's leaves."""
    if not isinstance(leaves, dict):
        return leaves, {}
    layers = {k: v for k, v in leaves.items() if k.startswith(LAYER_PREFIX) and isinstance(v, torch.Tensor)}
    if not layers:
        return leaves, {}
    return {k: v for k, v in leaves.items() if k not in layers}, layers

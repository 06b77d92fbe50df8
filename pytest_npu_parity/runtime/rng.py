"""Identical randomness on the reference and the target.

Device random streams differ between devices for the same seed (PyTorch's RNGs are per device and
per backend, by design), so a check that draws dropout masks or noise on the device can never match.
Inside ``same_randomness(seed)``:

* Python ``random``, NumPy's global state and torch's generators are seeded with ``seed``;
* every draw made through ``torch.rand``, ``torch.randn``, ``torch.rand_like``, ``torch.randn_like``,
  ``torch.randint`` and ``torch.nn.functional.dropout`` (what ``nn.Dropout`` calls) is taken from one
  seeded CPU ``torch.Generator`` and then moved to the requested device and dtype (a float sample is
  drawn in float32 and then cast, so every dtype and device sees the same numbers);
* ``torch.nn.functional.scaled_dot_product_attention`` with ``dropout_p > 0`` (what
  ``nn.MultiheadAttention`` uses in training) is computed by its reference formula from the PyTorch
  documentation — softmax(QKᵀ·scale + mask) with a CPU-drawn dropout mask, then ·V — instead of the
  fused kernel's device RNG. With ``dropout_p == 0`` the kernel that was installed when the block
  started runs (torch's own, or a patch set's fused replacement entered before the block).

So both sides see the same numbers in the same order. That is the ``shared`` mode (``RNG_MODES``,
``--parity-rng shared``, the default). In ``device`` mode (:func:`own_randomness`) nothing is
replaced: each side draws from its own device's generators, seeded — the target's with
:func:`target_seed` ``(seed)``, an independent stream even on a CPU target, as two devices' streams
are — so the target's own random kernels run; its samples then match the reference's only in
distribution (``distribution``), and only checks that declare a sample axis run so. A draw for a device tensor is the plugin's
work, not the model's: under a device-propagation audit (``audit.not_audited``) its host ops and
its copy to the device are not recorded (a draw the model asks for on the host, ``torch.rand(n)``
without ``device=``, still is). The replacements are installed on entry;
on exit (also on error) the functions that were there before are put back and the Python, NumPy
and torch CPU RNG states (and those of CUDA / the ``privateuse1`` backend such as ``npu``, when
already initialized) are restored. The scope wraps one run of one check; it is not thread-safe.

Not covered (they keep drawing from the device stream): ``Tensor.uniform_/normal_/bernoulli_/
random_``, ``torch.bernoulli``, ``torch.normal``, ``torch.randperm``, ``torch.multinomial``,
``F.dropout1d/2d/3d``, ``F.alpha_dropout``, and functions bound by ``from torch import rand``
before the block starts.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import operator
import random
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from .audit import not_audited

#: The functions replaced inside ``same_randomness``; the CPU draws use these import-time objects.
_ORIGINALS = {
    (torch, "rand"): torch.rand,
    (torch, "randn"): torch.randn,
    (torch, "rand_like"): torch.rand_like,
    (torch, "randn_like"): torch.randn_like,
    (torch, "randint"): torch.randint,
    (F, "dropout"): F.dropout,
    (F, "scaled_dot_product_attention"): F.scaled_dot_product_attention,
}


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # int, NumPy integer, 0-d integer tensor
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r}") from None


def _size(args: tuple, size: Any, fn: str) -> tuple[int, ...]:
    """The size of ``fn(*args)`` / ``fn(size=...)`` as torch accepts it: ``f(2, 3)``,
    ``f((2, 3))``, ``f([2, 3])``, ``f(torch.Size([2, 3]))`` or ``f(size=(2, 3))``."""
    if size is not None:
        if args:
            raise TypeError(f"torch.{fn}() got the size both positionally and as size=")
        args = (size,)
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    return tuple(_as_int(s, f"torch.{fn}() size") for s in args)


def _plugin_draw(device: Any):
    """``audit.not_audited()`` for a draw placed on an accelerator (the plugin draws it on the host
    so that both sides see the same numbers); nothing for a draw the caller placed on the host."""
    if device is None:
        return contextlib.nullcontext()
    try:
        on_host = torch.device(device).type == "cpu"
    except (RuntimeError, TypeError, ValueError):  # torch itself rejects it when the sample is placed
        on_host = False
    return contextlib.nullcontext() if on_host else not_audited()


def _cpu_generator(generator: torch.Generator | None, default: torch.Generator) -> torch.Generator:
    # A caller's CPU generator is honoured; a device generator cannot feed a CPU draw and would
    # differ between the sides anyway, so the shared stream replaces it.
    if generator is not None and generator.device.type == "cpu":
        return generator
    return default


def _check_factory_kwargs(fn: str, kwargs: dict) -> None:
    layout = kwargs.pop("layout", None)
    pin_memory = kwargs.pop("pin_memory", False)
    if layout not in (None, torch.strided) or pin_memory or kwargs:
        extra = sorted(kwargs) + (["layout"] if layout not in (None, torch.strided) else []) + (
            ["pin_memory"] if pin_memory else [])
        raise TypeError(f"torch.{fn}() inside same_randomness does not support {', '.join(extra)}")


class _CpuDraws:
    """Random functions that draw on the CPU from one generator and move the result.

    ``sdpa_kernel`` is the ``scaled_dot_product_attention`` in place when the block started (a patch
    set's replacement, if one is active), run whenever no dropout is asked for.
    """

    def __init__(self, seed: int, sdpa_kernel=None):
        self.gen = torch.Generator(device="cpu")
        self.gen.manual_seed(seed)
        self.sdpa_kernel = sdpa_kernel or _ORIGINALS[(F, "scaled_dot_product_attention")]
        self.used: set[str] = set()  # the stand-ins called (SDPA: asked for dropout), by their torch names

    @staticmethod
    def _place(t: torch.Tensor, device, dtype, requires_grad=False, out=None) -> torch.Tensor:
        if out is not None:
            return out.copy_(t)
        t = t.to(device=device if device is not None else "cpu", dtype=dtype if dtype is not None else t.dtype)
        return t.requires_grad_(requires_grad) if requires_grad else t

    def _float_draw(self, fn: str, args: tuple, size=None, *, generator=None, out=None, dtype=None, device=None,
                    requires_grad=False, **kwargs) -> torch.Tensor:
        __tracebackhide__ = True  # pytest shows the model's frames, not the plugin's
        _check_factory_kwargs(fn, kwargs)
        shape = _size(args, size, fn)
        with _plugin_draw(out.device if out is not None else device):
            sample = _ORIGINALS[(torch, fn)](shape, generator=_cpu_generator(generator, self.gen), dtype=torch.float32)
            return self._place(sample, device, dtype or torch.get_default_dtype(), requires_grad, out)

    def rand(self, *args, **kwargs) -> torch.Tensor:
        self.used.add("torch.rand")
        return self._float_draw("rand", args, **kwargs)

    def randn(self, *args, **kwargs) -> torch.Tensor:
        self.used.add("torch.randn")
        return self._float_draw("randn", args, **kwargs)

    def _like(self, fn: str, x: torch.Tensor, dtype=None, device=None, requires_grad=False, memory_format=None,
              generator=None, **kwargs) -> torch.Tensor:
        _check_factory_kwargs(f"{fn}_like", kwargs)
        device = device or x.device
        with _plugin_draw(device):
            sample = _ORIGINALS[(torch, fn)](tuple(x.shape), generator=_cpu_generator(generator, self.gen),
                                             dtype=torch.float32)
            return self._place(sample, device, dtype or x.dtype, requires_grad)

    def rand_like(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        self.used.add("torch.rand_like")
        return self._like("rand", x, **kwargs)

    def randn_like(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        self.used.add("torch.randn_like")
        return self._like("randn", x, **kwargs)

    def randint(self, *args, low=None, high=None, size=None, generator=None, out=None, dtype=None, device=None,
                requires_grad=False, **kwargs) -> torch.Tensor:
        """``torch.randint(high, size)``, ``torch.randint(low, high, size)``, any of them as keywords."""
        self.used.add("torch.randint")
        _check_factory_kwargs("randint", kwargs)
        positional = list(args)
        if size is None and positional and isinstance(positional[-1], (tuple, list, torch.Size)):
            size = positional.pop()
        if len(positional) == 2 and low is None and high is None:
            low, high = positional
        elif len(positional) == 1 and high is None:
            high = positional[0]
        elif len(positional) == 1 and low is None:
            low = positional[0]
        elif positional:
            raise TypeError(f"torch.randint() got unexpected positional arguments {tuple(args)!r}")
        if high is None or size is None:
            raise TypeError("torch.randint() needs high and size: randint(high, size) or randint(low, high, size)")
        low = 0 if low is None else _as_int(low, "torch.randint() low")
        shape = _size((), size, "randint")
        with _plugin_draw(out.device if out is not None else device):
            sample = _ORIGINALS[(torch, "randint")](low, _as_int(high, "torch.randint() high"), shape,
                                                    generator=_cpu_generator(generator, self.gen))
            return self._place(sample, device, dtype or torch.int64, requires_grad, out)

    def dropout_mask(self, shape, p: float, device, dtype) -> torch.Tensor:
        """Keep-mask scaled by 1/(1-p), as ``F.dropout`` applies it: each element is kept with
        probability 1 - p (a CPU float32 uniform draw >= p, whatever the default dtype, so a
        float64 golden run draws the same mask)."""
        with _plugin_draw(device):
            keep = _ORIGINALS[(torch, "rand")](tuple(shape), generator=self.gen, dtype=torch.float32) >= p
            return (keep.to(dtype=dtype) / (1.0 - p)).to(device)

    def dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        __tracebackhide__ = True  # pytest shows the model's frames, not the plugin's
        if p < 0.0 or p > 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0.0:
            return input
        self.used.add("torch.nn.functional.dropout")  # a dropout drawn (eval mode or p = 0 draws none)
        if p == 1.0:
            return input.mul_(0) if inplace else input * 0
        mask = self.dropout_mask(input.shape, p, input.device, input.dtype)
        return input.mul_(mask) if inplace else input * mask

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False, **kwargs) -> torch.Tensor:
        """``F.scaled_dot_product_attention``; with ``dropout_p > 0`` its reference formula."""
        __tracebackhide__ = True
        if dropout_p == 0.0:
            if enable_gqa:
                kwargs["enable_gqa"] = True  # only passed when set: torch < 2.5 has no such argument
            return self.sdpa_kernel(
                query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale, **kwargs)
        self.used.add("torch.nn.functional.scaled_dot_product_attention")
        if kwargs:
            raise TypeError(f"scaled_dot_product_attention() got unexpected arguments {sorted(kwargs)}")
        # Reference implementation in the PyTorch documentation of F.scaled_dot_product_attention.
        L, S = query.size(-2), key.size(-2)
        scale_factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
        if enable_gqa:
            key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
            value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
        scores = query @ key.transpose(-2, -1) * scale_factor
        if is_causal:
            causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                scores = scores.masked_fill(~attn_mask, float("-inf"))
            else:
                scores = scores + attn_mask
        weights = torch.softmax(scores, dim=-1)
        # A fully masked row attends to nothing (0, not NaN), as torch's own math backend does.
        weights = weights.masked_fill(torch.isneginf(scores).all(dim=-1, keepdim=True), 0.0)
        weights = self.dropout(weights, p=dropout_p, training=True)
        return weights @ value


def seed_everything(seed: int) -> None:
    """Seed Python ``random``, NumPy's global RNG and torch (CPU and every device) with ``seed``.

    Raises:
        TypeError: when ``seed`` is not an integer.
    """
    seed = _as_int(seed, "seed")
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _initialized_device_modules() -> list[Any]:
    """``torch.cuda`` and the ``privateuse1`` backend module (``torch.npu`` once torch_npu is
    imported) when they are initialized and can save/restore all their RNG states."""
    names = ["cuda"]
    try:
        names.append(torch._C._get_privateuse1_backend_name())
    except (AttributeError, RuntimeError):
        pass
    modules = []
    for name in dict.fromkeys(names):
        module = getattr(torch, name, None)
        is_initialized = getattr(module, "is_initialized", None)
        if (callable(is_initialized) and is_initialized()
                and hasattr(module, "get_rng_state_all") and hasattr(module, "set_rng_state_all")):
            modules.append(module)
    return modules


@dataclass(frozen=True)
class StandIns:
    """What a ``same_randomness`` block stood in for.

    Attributes:
        found: ``{torch name: function}`` in place of each function the block replaces when it started
            (``"torch.nn.functional.dropout"``, ``"torch.rand"``, …): the originals, or what a patch set
            or an outer block had put there.
        used: the torch names of the stand-ins called inside the block (``dropout`` and
            ``scaled_dot_product_attention`` only when asked for a dropout that draws: without, the function
            found in place runs, or nothing is drawn).
    """

    found: dict
    used: set


def random_functions() -> dict[str, Any]:
    """``{torch name: function}`` in place now of each function ``same_randomness`` stands in for."""
    return {f"{owner.__name__}.{name}": getattr(owner, name) for owner, name in _ORIGINALS}


@contextlib.contextmanager
def same_randomness(seed: int = 0) -> Iterator["StandIns"]:
    """Make every random draw inside the block come from a seeded CPU stream (see module doc).

    Yields a ``StandIns``: what was in place of each function the block stands in for when it started,
    and (filled as the block runs) which stand-ins were called, so that a caller can tell which functions a
    patch set installed did not run (``runtime.side.Side.stream_overrides``).

    Args:
        seed: the seed (an integer); the reference and target runs of one check must use the same.

    Raises:
        TypeError: when ``seed`` is not an integer, or a replaced function is called with an
            argument it cannot honour with CPU draws (``layout``, ``pin_memory``).
    """
    seed = _as_int(seed, "seed")
    previous = {(owner, name): getattr(owner, name) for owner, name in _ORIGINALS}
    draws = _CpuDraws(seed, sdpa_kernel=previous[(F, "scaled_dot_product_attention")])
    replacements = {
        (torch, "rand"): draws.rand,
        (torch, "randn"): draws.randn,
        (torch, "rand_like"): draws.rand_like,
        (torch, "randn_like"): draws.randn_like,
        (torch, "randint"): draws.randint,
        (F, "dropout"): draws.dropout,
        (F, "scaled_dot_product_attention"): draws.sdpa,
    }
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    devices = [(module, module.get_rng_state_all()) for module in _initialized_device_modules()]
    try:
        seed_everything(seed)
        for (owner, name), fn in replacements.items():
            setattr(owner, name, fn)
        yield StandIns({f"{owner.__name__}.{name}": fn for (owner, name), fn in previous.items()}, draws.used)
    finally:
        for (owner, name), fn in previous.items():
            setattr(owner, name, fn)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
        for module, states in devices:
            module.set_rng_state_all(states)


#: How the two sides of a sampling check draw randomness: ``shared`` (one seeded CPU stream,
#: :func:`same_randomness`; samples compared one by one) or ``device`` (each side its own device's
#: generators, :func:`own_randomness`; samples compared as distributions).
RNG_MODES = ("shared", "device")


def target_seed(seed: int) -> int:
    """The target side's seed in ``device`` mode: the first 63 bits of SHA-256 of ``"target:<seed>"``.

    Independent of the reference's stream (another seed of the same generator gives a statistically
    independent stream), reproducible, and never another session's ``seed`` by a simple offset.

    Raises:
        TypeError: when ``seed`` is not an integer.
    """
    seed = _as_int(seed, "seed")
    return int.from_bytes(hashlib.sha256(f"target:{seed}".encode()).digest()[:8], "little") >> 1


@contextlib.contextmanager
def own_randomness(seed: int = 0) -> Iterator[None]:
    """Seed Python ``random``, NumPy and torch (CPU and every device) with ``seed`` and let every draw
    come from its device's own generator; on exit restore the states as ``same_randomness`` does.

    Raises:
        TypeError: when ``seed`` is not an integer.
    """
    seed = _as_int(seed, "seed")
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    devices = [(module, module.get_rng_state_all()) for module in _initialized_device_modules()]
    try:
        seed_everything(seed)
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)
        for module, states in devices:
            module.set_rng_state_all(states)


def randomness(mode: str, seed: int = 0) -> contextlib.AbstractContextManager:
    """``same_randomness(seed)`` for ``mode="shared"``, ``own_randomness(seed)`` for ``"device"``.

    Raises:
        ValueError: ``mode`` is not one of :data:`RNG_MODES`.
    """
    if mode == "shared":
        return same_randomness(seed)
    if mode == "device":
        return own_randomness(seed)
    raise ValueError(f"random stream mode {mode!r}: use one of {', '.join(RNG_MODES)}")

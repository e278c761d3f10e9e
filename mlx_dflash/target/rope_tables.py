"""RoPE with its cosines and sines computed once per forward (mlx-cpu).

On the CPU `mx.fast.rope` has no kernel: each call builds its fallback graph,
which computes the positions, the frequencies, their cosines and sines, then
the rotation (about 20 operations). Every attention layer of a forward rotates
its queries and its keys at the same positions, so a verify of the target (12
calls on a 6-layer model) and a draft (3 per drafter layer) recompute the same
tables over and over; at a few rows per forward those small operations cost as
much as the matrix products (bench/reference_loop/README.md).

`Tables` keeps, for one forward, the cosines and sines of each distinct call
(rope settings, offset, rows), and rotates each input from them with the
fallback's own operations in the fallback's order: the result is bit for bit
`mx.fast.rope`'s. The tables themselves come from the real `mx.fast.rope`
applied once to a probe whose first half holds ones and second half zeros
(x1 = 1, x2 = 0: the rotation returns exactly cos and sin), so nothing of the
frequency computation is re-implemented. A rope module (any class whose forward
calls `mx.fast.rope`, mlx-lm's scaled variants included) runs its own forward
with that one call routed to the forward's `Tables` (`shared`).

Where mlx has a rope kernel (a GPU), or for inputs the tables do not cover,
it is `mx.fast.rope` itself."""

from __future__ import annotations

import copy
import threading
import types
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .rebind import forward_with

_local = threading.local()  # this thread's current Tables (None: every call is mx.fast.rope's)


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


class Tables:
    """The cosines and sines of one forward's rope calls; use as a context
    manager around the forward (`with Tables(): ...`), on the forward's thread."""

    def __init__(self):
        self._memo = {}
        self._prev = None

    def __enter__(self):
        self._prev = getattr(_local, "tables", None)
        _local.tables = self
        return self

    def __exit__(self, *exc):
        _local.tables = self._prev
        self._memo = {}

    def rope(self, x, dims: int, *, traditional: bool, base, scale: float, offset, freqs=None, stream=None,
             known=None):
        """`mx.fast.rope`'s signature and result. `known`: {id(array): its contents}
        for the caller's constant frequency arrays, so that layers whose rope
        modules hold equal ones share a table."""
        shape = x.shape
        if stream is not None or len(shape) != 4:
            return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset,
                                freqs=freqs, stream=stream)
        # else offsets and freqs are keyed by identity (the memo holds them: an id is not reused meanwhile)
        key = (dims, traditional, base, scale, offset if type(offset) is int else id(offset),
               None if freqs is None else (known or {}).get(id(freqs), id(freqs)), shape[0], shape[2], x.dtype)
        hit = self._memo.get(key)
        if hit is None:
            args = dict(traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs)
            hit = (_table(x, dims, args), offset, freqs)
            self._memo[key] = hit
        whole, cos, sin = hit[0]
        if whole:  # [cos, cos] and [-sin, sin] over the whole head: x * c + roll(x) * s
            return x * cos + mx.roll(x, dims // 2, axis=-1) * sin
        return _rotate(x, dims, traditional, cos, sin)


def _table(x, dims: int, args: dict):
    """(False, cos, sin) [B or 1, 1, T, dims / 2] in x's dtype, as mx.fast.rope computes them;
    for a rotation over the whole head (not interleaved) instead (True, [cos, cos], [-sin, sin])
    [.., dims]: then x1 * cos - x2 * sin is computed as x1 * cos + x2 * (-sin) and
    x1 * sin + x2 * cos as x2 * cos + x1 * sin, equal bit for bit (a negation is exact,
    a sum commutes) in three operations instead of the fallback's slices and concatenate."""
    B, _, T, D = x.shape
    half = dims // 2
    B = B if isinstance(args["offset"], mx.array) and args["offset"].size > 1 else 1
    one, zero = mx.ones((B, 1, T, half), x.dtype), mx.zeros((B, 1, T, half), x.dtype)
    if args["traditional"]:  # pairs (x1, x2) interleaved
        probe = mx.stack([one, zero], axis=-1).reshape(B, 1, T, dims)
        r = mx.fast.rope(probe, dims, **args).reshape(B, 1, T, half, 2)
        return False, r[..., 0], r[..., 1]
    r = mx.fast.rope(mx.concatenate([one, zero], axis=-1), dims, **args)
    cos, sin = r[..., :half], r[..., half:]
    if dims == D:
        return True, mx.concatenate([cos, cos], axis=-1), mx.concatenate([-sin, sin], axis=-1)
    return False, cos, sin


def _rotate(x, dims: int, traditional: bool, cos, sin):
    """The fallback's rotation (mlx/fast.cpp), operation for operation."""
    half = dims // 2
    if traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
    o1 = x1 * cos - x2 * sin
    o2 = x1 * sin + x2 * cos
    if traditional:
        out = mx.concatenate([o1[..., None], o2[..., None]], axis=-1).reshape(*x.shape[:3], dims)
        return mx.concatenate([out, x[..., dims:]], axis=-1) if dims < x.shape[-1] else out
    return mx.concatenate([o1, o2, x[..., dims:]] if dims < x.shape[-1] else [o1, o2], axis=-1)


class _Fast:
    def __init__(self, known: dict):
        self._known = known

    def rope(self, x, dims, *, traditional, base, scale, offset=0, freqs=None, stream=None):
        t = getattr(_local, "tables", None)
        if t is None or not on_cpu():
            return mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset,
                                freqs=freqs, stream=stream)
        return t.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset, freqs=freqs,
                      stream=stream, known=self._known)

    def __getattr__(self, name):
        return getattr(mx.fast, name)


class _MX:
    """`mx` as a rope module's code sees it: mlx.core, with fast.rope routed to the forward's Tables."""

    def __init__(self, known: dict):
        self.fast = _Fast(known)

    def __getattr__(self, name):
        return getattr(mx, name)


def calls_fast_rope(module) -> bool:
    """Whether a method of `module`'s class calls mx.fast.rope (by those names)."""
    for klass in type(module).__mro__:
        if klass in (nn.Module, dict, object):
            return False
        for fn in vars(klass).values():
            if isinstance(fn, types.FunctionType) and {"fast", "rope"} <= set(fn.__code__.co_names):
                return True
    return False


class Shared:
    """Stands in for a rope module: its own forward, whose mx.fast.rope call
    takes the current forward's Tables where one is open (else it is the
    module's forward exactly)."""

    def __init__(self, module):
        self._module = module
        # its constant arrays (frequencies), read once: equal ones in other layers share a table
        arrays = [v for v in list(module.values()) + list(vars(module).values()) if isinstance(v, mx.array)]
        known = {id(v): (str(v.dtype), tuple(v.shape), np.array(v.astype(mx.float32)).tobytes()) for v in arrays}
        self._forward = forward_with(copy.copy(module), {"mx": _MX(known)})

    def __call__(self, *args, **kwargs):
        return self._forward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._module, name)


def shared(module) -> Optional[Shared]:
    """`module` (a rope) sharing its tables within a forward, or None where its class does not call mx.fast.rope."""
    return Shared(module) if isinstance(module, nn.Module) and calls_fast_rope(module) else None

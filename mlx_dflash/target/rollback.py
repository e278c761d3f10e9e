"""Roll a target's cache back by the last n tokens after a verify forward, for
every cache kind mlx-lm uses, alone or mixed per layer (CacheList included).

- KVCache / QuantizedKVCache / ConcatenateKVCache / ChunkedKVCache: drop rows
  (their own `trim`).
- RotatingKVCache (sliding windows): a multi-token forward goes through
  mlx-lm's concatenating update, which keeps the last max_size-1 old rows plus
  all L new ones in temporal order, so dropping the last n <= L rows is exact
  even after the window wrapped; the arrays are cut to the kept rows so the next
  in-place update rotates over valid rows only. After a 1-token forward a
  wrapped window has overwritten a row: that trim is refused (`can_trim`).
- Recurrent state (ArraysCache, MambaCache: gated-delta, Mamba2, short-conv):
  before a forward the state arrays are kept (references: mlx-lm's mixers
  rebind `cache[i]`, they never write into the old arrays). During a verify
  the sub-module that owns the state (found once per model by a lazy probe)
  runs as a session's copy (`Mixer`) that keeps what restores its state at any
  accepted row, and rollback is a selection: a conv state is a slice of the
  conv's input window; a gated-delta state is the one mlx-lm's step produced
  after that row (kept per row where mlx-lm runs its step-by-step ops, i.e.
  off Metal); a Mamba2 state is mlx-lm's SSD state of the verify's own scan
  inputs cut at that row (a few small ops, no projection, no convolution).
  Where neither applies (the fused Metal gated-delta kernel, masked or padded
  batches) the mixer runs again on the kept rows with its projections and
  convolutions handed back from the verify, so only its scan is recomputed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as gd
from mlx_lm.models import ssm
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from .rebind import forward_with

# caches whose own trim drops the last rows exactly
ROW_CACHES = (KVCache, QuantizedKVCache, ConcatenateKVCache, ChunkedKVCache)


class RollbackError(RuntimeError):
    """The cache cannot be rolled back by that many tokens now."""


def leaves(cache) -> List[Any]:
    """The per-kind caches of one layer's cache (CacheList flattened)."""
    if isinstance(cache, CacheList):
        return [x for c in cache.caches for x in leaves(c)]
    return [cache]


def row_trim(x, n: int) -> None:
    x.trim(n)
    if isinstance(x, ConcatenateKVCache) and x.keys is not None:  # its trim keeps the rows
        x.keys, x.values = x.keys[..., : x.offset, :], x.values[..., : x.offset, :]


def unsupported_kind(cache_list) -> Optional[str]:
    """The name of a cache kind this module cannot roll back, if any."""
    for c in cache_list:
        for x in leaves(c):
            if x is None or isinstance(x, ROW_CACHES + (RotatingKVCache, ArraysCache)):
                continue
            return type(x).__name__
    return None


def recurrent(cache_list) -> List[ArraysCache]:
    return [x for c in cache_list for x in leaves(c) if isinstance(x, ArraysCache)]


# -- sliding windows -----------------------------------------------------------------
def rotating_can_trim(c: RotatingKVCache, n: int) -> bool:
    if n <= 0 or c.keys is None:
        return True
    if n > c.offset:
        return False
    rows = c.keys.shape[2]
    if c._idx == rows:  # temporal order (last update concatenated, or not full yet)
        return rows - n >= min(c.offset - n, c.max_size - 1)
    return c.offset < c.max_size  # still growing in place: nothing overwritten


def rotating_trim(c: RotatingKVCache, n: int) -> None:
    if n <= 0 or c.keys is None:
        return
    if not rotating_can_trim(c, n):
        raise RollbackError(
            f"sliding-window cache (window {c.max_size}) cannot drop {n} tokens after a 1-token step")
    rows = c.keys.shape[2]
    if c._idx == rows:
        r = rows - n
        c.keys, c.values = c.keys[..., :r, :], c.values[..., :r, :]
        c._idx = r
        c.offset -= n
        if c.offset >= c.max_size and r < c.max_size:
            # a full window is max_size rows: one free row at the end, where the
            # next in-place write goes (a concatenating update drops it first)
            pad = [(0, 0)] * 2 + [(0, c.max_size - r), (0, 0)]
            c.keys, c.values = mx.pad(c.keys, pad), mx.pad(c.values, pad)
    else:
        c.trim(n)


# -- exact checkpoints (O(1): mx.array(x) is a shallow copy that in-place writes do not reach)
def checkpoint(cache_list):
    """A function that puts every cache of `cache_list` back as it is now,
    whatever ran in between (timing probes that must leave the cache untouched)."""
    saved = []
    for x in (x for c in cache_list for x in leaves(c)):
        if isinstance(x, ArraysCache):
            fields = {"cache": list(x.cache), "lengths": x.lengths, "left_padding": x.left_padding}
        elif isinstance(x, ROW_CACHES) and not isinstance(x, ConcatenateKVCache):
            # rows below the offset are never written again: the offset is the state,
            # and holding no array keeps mlx's in-place row writes copy-free
            fields = {k: getattr(x, k) for k in ("offset", "start_position") if hasattr(x, k)}
        elif x is not None:  # sliding windows overwrite rows in place: keep (shallow) copies
            fields = {k: _copy(getattr(x, k)) for k in ("keys", "values", "offset", "_idx") if hasattr(x, k)}
        else:
            continue
        saved.append((x, fields))

    def restore():
        for x, fields in saved:
            for k, v in fields.items():  # fresh shallow copies: restore() can run again
                setattr(x, k, _copy(v))
    return restore


def _copy(v):
    """A shallow copy that later in-place writes to the original do not reach."""
    if isinstance(v, mx.array):
        return mx.array(v)
    if isinstance(v, (list, tuple)):
        return type(v)(_copy(x) for x in v)
    return v


# -- recurrent state -------------------------------------------------------------------
@dataclass
class Call:
    """One recorded call of a recurrent mixer: its arguments and, per child
    module (projections, conv, norms), the outputs it gave, in call order."""

    mixer: "Mixer"
    args: tuple
    kwargs: dict
    outs: Dict[int, list] = field(default_factory=dict)  # id(Tape) -> outputs
    keep: Optional[int] = None  # set while the call is played back on the kept rows
    length: int = 0
    used: Dict[int, int] = field(default_factory=dict)
    ins: List[Tuple[mx.array, int]] = field(default_factory=list)  # (a conv's input window, its kernel size)
    scans: List[Tuple[mx.array, Callable]] = field(default_factory=list)  # (final state, state after k rows)
    picks: Optional[list] = None  # per state slot: how to select it at any kept length, or None

    def settle(self) -> None:
        """After the call: for each state slot of its recurrent cache, how the
        slot at any kept length is selected from what was recorded: the scan's
        state after that row, or the rows of the conv's input window (the slot
        holds its last rows). A slot neither explains: rollback replays."""
        caches = [c for c in caches_in(self.args, self.kwargs) if isinstance(c, ArraysCache)]
        if len(caches) != 1 or caches[0].lengths is not None or caches[0].left_padding is not None:
            return
        cache, picks = caches[0], []
        for v in cache.cache:
            pick = None
            for final, at in self.scans:
                if v is final:
                    pick = ("scan", at)
            for x, size in self.ins:  # the slot holds the window's last size-1 rows
                if (pick is None and isinstance(v, mx.array) and v.ndim == 3 and x.ndim == 3
                        and v.shape == (x.shape[0], size - 1, x.shape[2]) and x.shape[1] == size - 1 + self.length):
                    pick = ("window", x)
            if v is not None and pick is None:
                return
            picks.append(pick)
        self.picks = (cache, picks)

    def select(self, keep: int) -> bool:
        """Put the state after the first `keep` rows into the cache, if every
        slot can be selected (a reference, a slice, or the SSD state's few ops)."""
        if self.picks is None:
            return False
        cache, picks = self.picks
        for j, pick in enumerate(picks):
            if pick is None:
                continue
            kind, x = pick
            if kind == "scan":
                cache[j] = x(keep)
            else:
                n = x.shape[1] - self.length
                cache[j] = x[:, keep: keep + n]
        return True

    def select_rows(self, keeps: List[int], before: list) -> bool:
        """Per batch row b, the state after its first keeps[b] rows (0: `before`,
        the slots as they were before the call): each distinct count's state,
        then one gather over the batch axis; never a replay. False where a slot
        cannot be selected (then the caller refuses the batch)."""
        if self.picks is None:
            return False
        cache, picks = self.picks
        B = len(keeps)
        ks = sorted(set(keeps))
        pos = mx.array([ks.index(k) for k in keeps], mx.int32)
        rows = mx.arange(B)
        for j, pick in enumerate(picks):
            if pick is None:
                continue
            kind, x = pick
            if kind == "scan":
                vals = [before[j] if k == 0 else (cache[j] if k == self.length else x(k)) for k in ks]
                if any(v is None for v in vals):
                    return False
                cache[j] = vals[0] if len(vals) == 1 else mx.stack(vals)[pos, rows]
            else:  # the window's rows keeps[b] .. keeps[b] + n - 1, per row
                n = x.shape[1] - self.length
                idx = mx.array(keeps, mx.int32)[:, None] + mx.arange(n)[None]
                cache[j] = mx.take_along_axis(x, idx[:, :, None], axis=1)
        return True


@dataclass
class Record:
    """What the last forward over `cache` needs to be rolled back."""

    cache: list
    length: int
    saved: Dict[int, Tuple[ArraysCache, list, Any, Any]] = field(default_factory=dict)
    calls: List[Call] = field(default_factory=list)


def snapshot(cache_list, length: int) -> Record:
    rec = Record(cache_list, length)
    for a in recurrent(cache_list):
        rec.saved[id(a)] = (a, list(a.cache), a.lengths, a.left_padding)
    return rec


def _restore(rec: Record) -> None:
    for a, state, lengths, left in rec.saved.values():
        a.cache, a.lengths, a.left_padding = list(state), lengths, left


def _cut(x, length: int, keep: int):
    """Slice a recorded array to the first `keep` sequence rows."""
    if isinstance(x, mx.array) and x.ndim >= 2 and x.shape[1] == length:
        return x[:, :keep]
    return x


def caches_in(args, kwargs) -> List[Any]:
    out = []
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, (CacheList, ArraysCache) + ROW_CACHES + (RotatingKVCache,)):
            out += leaves(v)
    return out


def replay(rec: Record, n: int) -> None:
    """Restore the recurrent states of `rec`, then per recorded mixer call:
    select the state after the first length-n rows where the verify kept it
    (gated-delta states, conv windows), else run the mixer again on those rows
    with its projections and convolutions handed back from the verify, so only
    its scan runs."""
    keep = rec.length - n
    _restore(rec)
    if keep <= 0:
        return
    for call in rec.calls:
        for c in caches_in(call.args, call.kwargs):  # a row cache the call also fills
            if isinstance(c, ROW_CACHES):
                row_trim(c, keep)
        if not call.select(keep):
            call.mixer.play(call, rec.length, keep)


def selectable(rec: Record) -> bool:
    """Whether every recurrent state of the last forward can be selected per row
    (each recorded mixer call explains all its slots); not with the fused Metal
    gated-delta kernel, or padded / masked calls, which keep no per-row states."""
    covered = set()
    for call in rec.calls:
        if call.picks is None:
            return False
        covered.add(id(call.picks[0]))
    return covered >= set(rec.saved)


def select_rows(rec: Record, keeps: List[int]) -> None:
    """After a batched verify of rec.length rows: batch row b keeps its first
    keeps[b] rows of every recurrent state (per-row selection, no replay)."""
    if all(k == rec.length for k in keeps):
        return
    if all(k == 0 for k in keeps):
        _restore(rec)
        return
    if not selectable(rec):
        raise RollbackError("a recurrent state of this batch cannot be selected per row")
    for call in rec.calls:
        cache = call.picks[0]
        if not call.select_rows(keeps, rec.saved[id(cache)][1]):
            raise RollbackError("a recurrent state of this batch cannot be selected per row")


class Tape:
    """Stands in for one child module of a recurrent mixer (in a session's copy
    of that mixer): while a call is recorded it keeps the child's output; while
    the call is played back it hands back that output's first kept rows instead
    of computing it again (the rows of a causal projection or convolution over
    a prefix are the prefix of its rows)."""

    def __init__(self, module, mixer: "Mixer"):
        self._module, self._mixer = module, mixer

    def __call__(self, *args, **kwargs):
        call = self._mixer.call
        if call is None:
            return self._module(*args, **kwargs)
        outs = call.outs.setdefault(id(self), [])
        if call.keep is None:
            y = self._module(*args, **kwargs)
            outs.append(y)
            if isinstance(self._module, nn.Conv1d) and args and isinstance(args[0], mx.array):
                call.ins.append((args[0], self._module.weight.shape[1]))
            return y
        k = call.used.get(id(self), 0)
        call.used[id(self)] = k + 1
        y = outs[k] if k < len(outs) else None
        if isinstance(y, mx.array) and y.ndim >= 2 and y.shape[1] == call.length:
            return y[:, : call.keep]
        return self._module(*args, **kwargs)  # not row-aligned: computed on the kept rows

    def __getattr__(self, name):
        return getattr(self._module, name)


class Mixer:
    """Stands in for the sub-module of a decoder layer that owns a recurrent
    state, in a session's copy of that layer (the loaded instance is never
    changed): a shallow copy of the mixer whose child modules are Tapes. While
    `sink` is a list, each call carrying a recurrent state is recorded there."""

    def __init__(self, module):
        self.module = copy.copy(module)  # same arrays, own dict of children
        for name, child in module.children().items():
            if isinstance(child, nn.Module):
                self.module[name] = Tape(child, self)
        self.sink: Optional[list] = None
        self.call: Optional[Call] = None
        self._forward = forward_with(self.module, {"gated_delta_update": self._gated_delta_update,
                                                  "ssm_update": self._ssm_update})

    def __call__(self, *args, **kwargs):
        if self.sink is None or not any(isinstance(c, ArraysCache) for c in caches_in(args, kwargs)):
            return self._forward(*args, **kwargs)
        call = Call(self, args, kwargs, length=_rows(args, kwargs))
        self.call = call
        try:
            y = self._forward(*args, **kwargs)
        finally:
            self.call = None
        call.settle()
        self.sink.append(call)
        return y

    def _gated_delta_update(self, q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True,
                            lower_bound=None, allow_neg_eigval=False):
        """mlx-lm's gated_delta_update, keeping the state after every row where
        mlx-lm runs its step-by-step ops (the same compiled step on the same
        inputs, so the same bits); where it runs its fused kernel, unchanged."""
        kernel = (use_kernel and mx.default_device() == mx.gpu and mx.metal.is_available()
                  and k.shape[-1] >= 32 and k.shape[-1] % 32 == 0)
        if kernel or self.call is None or self.call.keep is not None:
            return gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, use_kernel=use_kernel,
                                         lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
        beta = mx.sigmoid(b)
        if allow_neg_eigval:
            beta = beta * 2.0
        g = gd.compute_g(A_log, a, dt_bias) if lower_bound is None else \
            gd.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        if state is None:
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        if Hv // Hk > 1:  # (gated_delta_ops repeats them the same way)
            q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
        ys, states = [], []
        for t in range(T):
            y, state = gd.gated_delta_ops(q[:, t: t + 1], k[:, t: t + 1], v[:, t: t + 1], g[:, t: t + 1],
                                          beta[:, t: t + 1], state, None if mask is None else mask[:, t: t + 1])
            ys.append(y)
            states.append(state)
        self.call.scans.append((state, lambda keep: states[keep - 1]))
        return mx.concatenate(ys, axis=1), state

    def _ssm_update(self, hidden_states, A_log, B, C, D, dt, dt_bias, state=None, time_step_limit=(0.001, 100.0),
                    mask=None, lengths=None):
        """mlx-lm's ssm_update; its inputs are kept, so the state after the first
        k rows is mlx-lm's own SSD scan over those rows alone (a few small ops on
        what the verify computed: no projection, no convolution)."""
        y, new = ssm.ssm_update(hidden_states, A_log, B, C, D, dt, dt_bias, state, time_step_limit, mask, lengths)
        if self.call is not None and self.call.keep is None and mask is None and lengths is None:
            def at(keep):
                return _ssd_state(hidden_states[:, :keep], dt[:, :keep], B[:, :keep], A_log, dt_bias, state,
                                  time_step_limit)
            self.call.scans.append((new, at))
        return y, new

    def play(self, call: Call, length: int, keep: int) -> None:
        """The recorded call again on its first `keep` rows (the output is not used)."""
        call.length, call.keep, call.used = length, keep, {}
        self.call = call
        try:
            self._forward(*(_cut(a, length, keep) for a in call.args),
                          **{k: _cut(v, length, keep) for k, v in call.kwargs.items()})
        finally:
            self.call = None
            call.keep = None

    def __getattr__(self, name):
        return getattr(self.module, name)


@partial(mx.compile, shapeless=False)
def _ssd_state(x, dt, B, A_log, dt_bias, state, time_step_limit):
    """The state mlx-lm's ssm_attn returns for one chunk (its ops, in its order,
    without the outputs it also computes), compiled: the same bits, fewer kernels."""
    b, k, h, _ = x.shape
    dt = ssm.compute_dt(dt, dt_bias, time_step_limit)
    dtA = dt * (-mx.exp(A_log).astype(dt.dtype)).reshape(1, 1, -1)
    dtx = dt.reshape(b, k, h, 1) * x
    decay = mx.exp(ssm.segsum(dtA.swapaxes(1, 2)))[:, :, -1:, :].transpose(0, 3, 1, 2)
    Bh = mx.repeat(mx.transpose(B, (0, 2, 3, 1)), h // B.shape[2], axis=1).swapaxes(2, 3)
    new = (dtx * decay).swapaxes(1, 2).swapaxes(2, 3) @ Bh
    if state is None:
        return new
    return new + mx.exp(mx.cumsum(dtA, axis=-2))[:, -1, :, None, None] * state


def _rows(args, kwargs) -> int:
    """The sequence length of a mixer call (its first array argument's axis 1)."""
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, mx.array) and v.ndim >= 2:
            return v.shape[1]
    return 0

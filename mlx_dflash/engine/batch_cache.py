"""The target's cache for a batch of rows: mlx-lm's BatchKVCache /
BatchRotatingKVCache (left padding, every row's newest token in the same
slot), plus what speculation needs on top: joining a row prefilled alone, and
the ragged rollback after a batched verify.

Ragged rollback: row b drops its last r_b verified tokens. All rows drop
min(r) (the caches' own trim); a row that drops e_b = r_b - min(r) more is
rolled right by e_b inside the buffer, so its rejected slots wrap to its left
end and become left padding (its offset, the RoPE position of its next token,
drops by e_b; the positions baked into its kept keys stay right). Rows stay
right-aligned, which is what mlx-lm's masks assume. One gather over the
buffer per layer, only in cycles where the rows disagree.

Recurrent layers (mlx-lm's ArraysCache: gated-delta, Mamba2, short-conv
states) batch as they are: rows are prefilled alone and joined, so no row has
padding there and in a [B, w] verify every row runs w real tokens. After it,
row b's state becomes the one after its kept rows: a per-row selection from
what the Target's recording mixers kept during the verify (target.select_rows,
rollback.Call.select_rows), never a replay. A target whose mixers keep no
per-row states here (the fused Metal gated-delta kernel) is refused."""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    RotatingKVCache,
    dynamic_roll,
)

from ..target.adapter import Target

PROBE_IDS = [5, 6, 7]  # a short prompt, then a 2-token verify: whether per-row states are kept


def unsupported(target: Target) -> Optional[str]:
    """Why this target cannot be batched, or None."""
    cache = target.make_cache()
    for c in cache:
        if type(c) not in (KVCache, RotatingKVCache, ArraysCache):  # exactly: subclasses batch differently
            return (f"its {type(c).__name__} layers cannot join a batch yet "
                    "(KV, sliding-window and recurrent caches can)")
    if any(isinstance(c, ArraysCache) for c in cache):
        target(mx.array(PROBE_IDS)[None], cache)
        target(mx.array(PROBE_IDS[:2])[None], cache)
        if not target.rows_selectable(cache):
            return ("its recurrent layers keep no per-row states on this device (the fused gated-delta "
                    "kernel), so a batch could not roll rows back")
    return None


def to_batch(cache: list) -> list:
    """A row's own per-layer cache (prefilled alone) as a one-row batch cache."""
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out.append(ArraysCache.merge([c]))
        else:
            out.append((BatchRotatingKVCache if isinstance(c, RotatingKVCache) else BatchKVCache).merge([c]))
    return out


def paddable(target: Target) -> bool:
    """Whether several new prompts can be prefilled together, left-padded (only
    plain KV layers: sliding windows and recurrent states are prefilled alone)."""
    return all(type(c) is KVCache for c in target.make_cache())


def padded(target: Target, left_padding: List[int]) -> list:
    """An empty batch cache for prompts left-padded by `left_padding` (paddable targets)."""
    return [BatchKVCache(left_padding) for _ in target.make_cache()]


def join(batch: Optional[list], rows: list) -> list:
    """`rows` (a batch cache) appended to `batch` (None: none yet); returns the batch."""
    if not batch:
        return rows
    for a, b in zip(batch, rows):
        a.extend(b)
    return batch


def keep(batch: list, idx: List[int]) -> Optional[list]:
    """The rows `idx` only (None when no row is left)."""
    if not idx:
        return None
    ix = mx.array(idx, mx.int32)
    for c in batch:
        c.filter(ix)
    return batch


def rollback(target: Target, batch: list, length: int, drop: List[int]) -> None:
    """After a batched forward of `length` tokens through `target`: row b loses
    its last drop[b] tokens, in every layer kind."""
    if not batch:
        return
    ragged_trim(batch, drop)
    if any(isinstance(c, ArraysCache) for c in batch):
        target.select_rows(batch, [length - d for d in drop])


def ragged_trim(batch: list, drop: List[int]) -> None:
    """Row b loses its last drop[b] tokens (<= the last forward's length) in
    the KV and sliding-window layers (recurrent layers: `rollback`)."""
    if not batch or not any(drop):
        return
    m = min(drop)
    extra = [d - m for d in drop]
    e = mx.array(extra, mx.int32) if any(extra) else None
    for c in batch:
        if isinstance(c, ArraysCache):
            continue
        if m:
            c._idx -= m  # noqa: SLF001 - mlx-lm's own trim, which BatchRotatingKVCache refuses once full
            c.offset = c.offset - m
            if isinstance(c, BatchRotatingKVCache):
                c._offset -= m
        if isinstance(c, BatchRotatingKVCache) and c.keys is not None and c.keys.shape[2] > c._idx:
            # after a multi-token update the buffer is in temporal order: drop the tail
            c.keys, c.values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
        if e is None or c.keys is None:
            continue
        n = c._idx
        k = dynamic_roll(c.keys[..., :n, :], e[:, None], axis=2)
        v = dynamic_roll(c.values[..., :n, :], e[:, None], axis=2)
        if c.keys.shape[2] > n:  # (a BatchKVCache keeps spare slots past _idx for the next writes)
            k = mx.concatenate([k, c.keys[..., n:, :]], axis=2)
            v = mx.concatenate([v, c.values[..., n:, :]], axis=2)
        c.keys, c.values = k, v
        c.offset = c.offset - e
        c.left_padding = c.left_padding + e


def size(batch: Optional[list]) -> int:
    """Slots per row (the longest row plus its padding)."""
    return 0 if not batch else max([c._idx for c in batch if not isinstance(c, ArraysCache)] or [0])

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
buffer per layer, only in cycles where the rows disagree."""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache, dynamic_roll


def unsupported(cache: list) -> Optional[str]:
    """Why a target with this (single-stream) cache cannot be batched, or None."""
    for c in cache:
        if type(c) not in (KVCache, RotatingKVCache):  # exactly: subclasses batch differently
            return f"its {type(c).__name__} layers cannot join a batch yet (only KV and sliding-window caches can)"
    return None


def to_batch(cache: list) -> list:
    """A row's own per-layer cache (prefilled alone) as a one-row batch cache."""
    return [(BatchRotatingKVCache if isinstance(c, RotatingKVCache) else BatchKVCache).merge([c]) for c in cache]


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


def ragged_trim(batch: list, drop: List[int]) -> None:
    """Row b loses its last drop[b] tokens (<= the last forward's length)."""
    if not batch or not any(drop):
        return
    m = min(drop)
    extra = [d - m for d in drop]
    e = mx.array(extra, mx.int32) if any(extra) else None
    for c in batch:
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
    return 0 if not batch else max(c._idx for c in batch)

"""Target-side sampling and the lossless speculative acceptance rule
(DFLASH2.md section 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        # below this, logits / T overflows float32; sampling's T -> 0 limit is argmax
        return self.temperature < 1e-5


def probs(logits: mx.array, sp: SamplingParams) -> mx.array:
    """Rows of logits [..., V] -> the target distribution p after temperature,
    top-k, top-p and min-p (all applied to p, the target side)."""
    logits = logits.astype(mx.float32) / sp.temperature
    neg = mx.array(-float("inf"), mx.float32)
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = mx.sort(logits, axis=-1)[..., -sp.top_k][..., None]
        logits = mx.where(logits < kth, neg, logits)
    p = mx.softmax(logits, axis=-1)
    if sp.top_p < 1.0:
        # keep the smallest set of top tokens whose mass reaches top_p
        order = mx.argsort(-p, axis=-1)
        sp_sorted = mx.take_along_axis(p, order, axis=-1)
        before = mx.cumsum(sp_sorted, axis=-1) - sp_sorted
        keep_sorted = before < sp.top_p
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        p = mx.where(keep, p, 0.0)
    if sp.min_p > 0:
        p = mx.where(p < sp.min_p * p.max(axis=-1, keepdims=True), 0.0, p)
    return p / p.sum(axis=-1, keepdims=True)


def sample(p: mx.array) -> mx.array:
    """Draw one token per row of a probability matrix."""
    return mx.random.categorical(mx.log(p), axis=-1)


def accept_speculative(p, drafts, q):
    """Lossless rejection sampling over one verified block.

    p: [n+1, V] target distributions at the anchor and each draft position
    (row i scores the token after i accepted drafts); drafts: n proposed ids;
    q: [n, V] proposal distributions, or None for a deterministic (one-hot)
    proposal. Returns (accepted count, the next token)."""
    import numpy as np

    n = len(drafts)
    if n == 0:
        return 0, int(sample(p[0]).item())
    p_np = np.array(p[:n].astype(mx.float32))
    q_np = None if q is None else np.array(q.astype(mx.float32))
    u = np.array(mx.random.uniform(shape=(n,)))
    for i, x in enumerate(drafts):
        px = p_np[i, x]
        qx = 1.0 if q_np is None else q_np[i, x]
        if qx > 0 and u[i] < min(1.0, px / qx):
            continue
        # rejected: sample from normalize(max(p - q, 0)); one-hot q removes x from p
        resid = p_np[i].copy()
        if q_np is None:
            resid[x] = 0.0
        else:
            resid = np.maximum(resid - q_np[i], 0.0)
        s = resid.sum()
        if s <= 0:  # p == q exactly: any draw from p is correct
            resid, s = p_np[i], p_np[i].sum()
        r = mx.array(resid / s)
        return i, int(mx.random.categorical(mx.log(r)).item())
    return n, int(sample(p[n]).item())

"""Target-side sampling and the lossless speculative acceptance rule
(DFLASH2.md section 5)."""

from __future__ import annotations

import mlx.core as mx

from .sampling_params import SamplingParams


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


def sample(p: mx.array, key=None) -> mx.array:
    """Draw one token per row of a probability matrix (`key`: a PRNG key of
    its own, e.g. one batch row's, instead of the global random state)."""
    return mx.random.categorical(mx.log(p), axis=-1, key=key)


def accept_greedy(logits: mx.array, drafts: mx.array):
    """Greedy verify on the device. logits [n+1, V] at the anchor and each draft;
    drafts [n]. Returns lazy (accepted count a, the target's argmax [n+1]): the
    emitted tokens are argmax[:a+1] (accepted drafts equal the target's picks)."""
    tgt = mx.argmax(logits, axis=-1).astype(mx.int32)
    n = drafts.shape[0]
    if n == 0:
        return mx.array(0, mx.int32), tgt
    ok = (drafts.astype(mx.int32) == tgt[:n]).astype(mx.int32)
    return mx.cumprod(ok).sum().astype(mx.int32), tgt


def accept_sampled(p: mx.array, drafts: mx.array, q=None, key=None):
    """Lossless rejection sampling over one verified block, on the device.

    p: [n+1, V] target distributions at the anchor and each draft position
    (row i scores the token after i accepted drafts); drafts: [n] proposed ids;
    q: [n, V] proposal distributions, or None for a deterministic (one-hot)
    proposal. Draft i is kept with probability min(1, p(x)/q(x)); at the first
    rejection the next token comes from normalize(max(p - q, 0)) (one-hot q:
    p without x), after n acceptances from p[n]. Returns lazy (accepted count a,
    the next token). `key`: a PRNG key of its own (else the global random state)."""
    n = drafts.shape[0]
    k_u = k_s = None
    if key is not None:
        k_u, k_s = mx.random.split(key)
    if n == 0:
        return mx.array(0, mx.int32), sample(p[0], k_s)
    d = drafts.astype(mx.int32)[:, None]
    pn = p[:n].astype(mx.float32)
    px = mx.take_along_axis(pn, d, axis=-1)[:, 0]
    if q is None:
        qx = mx.ones_like(px)
        resid = mx.put_along_axis(pn, d, mx.zeros_like(px)[:, None], axis=-1)
    else:
        q = q.astype(mx.float32)
        qx = mx.take_along_axis(q, d, axis=-1)[:, 0]
        resid = mx.maximum(pn - q, 0.0)
    u = mx.random.uniform(shape=(n,), key=k_u)
    ok = (qx > 0) & (u * qx < px)  # u < min(1, px / qx) without dividing by zero
    a = mx.cumprod(ok.astype(mx.int32)).sum().astype(mx.int32)
    s = resid.sum(axis=-1, keepdims=True)
    resid = mx.where(s > 0, resid / mx.where(s > 0, s, 1.0), pn)  # p == q exactly: any draw from p is right
    rows = mx.concatenate([resid, p[n:n + 1].astype(mx.float32)])  # row a: where the block ends
    return a, sample(mx.take(rows, a[None], axis=0), k_s)[0]


def accept_speculative(p, drafts, q):
    """`accept_sampled` read back: (accepted count, next token) as ints; drafts
    may be a list."""
    a, nxt = accept_sampled(p, mx.array(list(drafts) if not isinstance(drafts, mx.array) else drafts,
                                        mx.int32).reshape(-1), q)
    return tuple(mx.stack([a, nxt.astype(mx.int32)]).tolist())

"""DFlash 2 path selector (`candidate_selector`, DFLASH2.md 3.2).

For each draft position t the drafter's top-K tokens are candidates, scored

    S_t(a, b) = U_t(b) + <A[a] * (W_h h_t), B[b]>

where a is a candidate of position t-1 (the anchor for t = 0), U_t the drafter
logits. The [P, K, K] lattice is one batched matmul; the walk over it (greedy, or
sampling at T > 0) is <= 16 tiny steps, lazy on the device (`walk`), so it is
evaluated with the verify that consumes it.

A and B are [ours] projections of the target's embedding rows (3*H*r params, no
[V, r] table); checkpoints with materialised `*_codebook` tables load as well.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def selector_param_count(hidden_size: int, rank: int) -> int:
    return 3 * hidden_size * rank


def top_k_ids(logits: mx.array, k: int, chunk: int = 64) -> mx.array:
    """Ids [P, k] (unordered) of the k largest logits per row of [P, V].

    mlx-cpu's argpartition over a 150k vocabulary costs milliseconds a row; but the
    top-k entries all lie in the k chunks with the largest maxima, so select
    chunks first, then entries among k * chunk: ~10x faster, one graph."""
    P, V = logits.shape
    if V < 4 * k * chunk:
        return mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
    x = mx.pad(logits, [(0, 0), (0, -V % chunk)], constant_values=-float("inf")) if V % chunk else logits
    x = x.reshape(P, -1, chunk)
    chunks = mx.argpartition(-x.max(-1), k - 1, axis=-1)[:, :k]  # [P, k]
    sub = mx.take_along_axis(x, chunks[..., None], axis=1).reshape(P, k * chunk)
    ids = (chunks[..., None] * chunk + mx.arange(chunk)).reshape(P, k * chunk)
    return mx.take_along_axis(ids, mx.argpartition(-sub, k - 1, axis=-1)[:, :k], axis=-1)


class PathSelector(nn.Module):
    def __init__(self, hidden_size: int, rank: int = 256, top_k: int = 16, codebook_vocab: int | None = None):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.codebooks = codebook_vocab is not None
        # Successor side zero: S_t(a, b) = U_t(b), so a fresh selector keeps the drafter's top-1.
        if self.codebooks:
            self.predecessor_codebook = mx.random.normal((codebook_vocab, rank)) * rank**-0.5
            self.successor_codebook = mx.zeros((codebook_vocab, rank))
        else:
            self.predecessor_projection = nn.Linear(hidden_size, rank, bias=False)
            self.successor_projection = nn.Linear(hidden_size, rank, bias=False)
            self.successor_projection.weight = mx.zeros_like(self.successor_projection.weight)

    def _vectors(self, pred_ids, succ_ids, embed):
        """A rows for pred_ids and B rows for succ_ids (any shapes), one gather."""
        if self.codebooks:
            return self.predecessor_codebook[pred_ids], self.successor_codebook[succ_ids]
        ids = mx.concatenate([pred_ids.reshape(-1), succ_ids.reshape(-1)])
        e = embed(ids)
        n = pred_ids.size
        a = self.predecessor_projection(e[:n]).reshape(*pred_ids.shape, -1)
        b = self.successor_projection(e[n:]).reshape(*succ_ids.shape, -1)
        return a, b

    def pair_scores(self, prev_ids, cand_ids, cand_logits, h, embed) -> mx.array:
        """prev_ids [..., P], cand_ids/cand_logits [..., P, K], h [..., P, H] -> S [..., P, K]."""
        a, b = self._vectors(prev_ids, cand_ids, embed)
        q = (a * self.hidden_projection(h)).astype(mx.float32)  # [..., P, r]
        return cand_logits.astype(mx.float32) + (b.astype(mx.float32) @ q[..., None])[..., 0]

    def lattice(self, anchor: int, cand_ids, cand_logits, h, embed) -> mx.array:
        """cand_ids/cand_logits [P, K], h [P, H] -> S [P, K, K] (t, candidate a of t-1, candidate b of t)."""
        P, K = cand_ids.shape
        # Predecessors: the anchor for t = 0 (same for every row a), else the candidates of t-1.
        prev = mx.concatenate([mx.full((1, K), anchor, dtype=cand_ids.dtype), cand_ids[:-1]])
        a, b = self._vectors(prev, cand_ids, embed)
        q = (a * self.hidden_projection(h)[:, None, :]).astype(mx.float32)  # [P, K, r]
        return cand_logits.astype(mx.float32)[:, None, :] + q @ b.astype(mx.float32).swapaxes(1, 2)

    def candidates(self, logits):
        """Top-K token ids [P, K] (unordered) and their logits."""
        ids = top_k_ids(logits, min(self.top_k, logits.shape[-1]))
        return ids, mx.take_along_axis(logits, ids, axis=-1)

    def walk(self, logits, h, anchor: int, embed, temperature: float = 0.0, key=None):
        """Walk the lattice from the anchor, on the device: P sequential argmax
        (or inverse-CDF) picks over [K] rows, all lazy, so the walk joins the
        verify's graph and its one readback. Returns lazy (tokens [P] int32, q,
        conf [P]); conf (each pick's path score as a probability, softmax over
        the candidates of S_t(prev, .)) costs nothing unless evaluated.

        q is None when greedy; at temperature > 0 it is the proposal actually
        sampled from, dense [P, V] float32 (zero outside each row's candidates)."""
        P, V = logits.shape
        if P == 0:
            return mx.zeros((0,), mx.int32), (None if temperature <= 0 else mx.zeros((0, V), mx.float32)), \
                mx.zeros((0,), mx.float32)
        ids, u = self.candidates(logits)
        S = self.lattice(anchor, ids, u, h, embed)  # row 0 of S[0] already holds the anchor's scores
        i, picks = mx.array(0, mx.int32), []
        if temperature <= 0:
            for t in range(P):  # (argmax's uint32 index is taken as it is: one cast, after the walk)
                i = mx.argmax(mx.take(S[t], i, axis=0))
                picks.append(i)
            probs = None
        else:
            probs = mx.softmax(S / temperature, axis=-1)  # [P, K, K]
            r = mx.random.uniform(shape=(P,), key=key)
            K = S.shape[-1]
            for t in range(P):
                c = mx.cumsum(mx.take(probs[t], i, axis=0))
                i = mx.minimum((c <= r[t] * c[-1]).astype(mx.int32).sum(), K - 1)
                picks.append(i)
        picks = mx.stack(picks).astype(mx.int32)
        used = mx.concatenate([mx.zeros((1,), mx.int32), picks[:-1]])  # the row each pick came from
        rows = S[mx.arange(P), used]  # [P, K]
        tokens = mx.take_along_axis(ids, picks[:, None], axis=1)[:, 0].astype(mx.int32)
        conf = mx.take_along_axis(mx.softmax(rows, axis=-1), picks[:, None], axis=1)[:, 0]
        q = None
        if probs is not None:
            q = mx.put_along_axis(mx.zeros((P, V), mx.float32), ids, probs[mx.arange(P), used], axis=-1)
        return tokens, q, conf

    def propose(self, logits, h, anchor: int, embed, temperature: float = 0.0, key=None,
                with_conf: bool = False):
        """`walk`, read back: (tokens: list[int] of length P, q), plus conf (a
        list) when `with_conf`."""
        tokens, q, conf = self.walk(logits, h, anchor, embed, temperature, key)
        mx.eval(tokens, conf)
        out = (tokens.tolist(), q)
        return out + (conf.tolist(),) if with_conf else out

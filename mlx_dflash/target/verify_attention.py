"""Attention for a verify: a few new rows over a long cached prefix.

On mlx-cpu, `mx.fast.scaled_dot_product_attention` has no kernel: it runs its
fallback (scores = q @ k.T, a mask, softmax, @ v) with the key/value heads
broadcast over each query group, so a w-row verify pays w times the scores of
a one-row step in full-size temporaries, a mask over all of them, and mlx's
scalar `exp` (x86 builds have no SIMD for it). Its cost relative to a one-row
step grows with the context (bench/verify_attention.md).

`attention` is what a Target's verify runs in place of mlx-lm's
`scaled_dot_product_attention` (adapter.py swaps it into its own copies of the
attention modules): where it pays (`pays`), the softmax is computed over pieces
of the key axis and the pieces merged with their log-sum-exp (the usual
flash-attention merge), which is the same sum in another order:
- the query heads of a key/value group are folded into the row axis, so each
  product is one [rows, D] x [D, chunk] per group and nothing is broadcast;
- the prefix (every key before the w new ones) is seen by every new row: no
  mask there, only the w x w causal block takes one;
- the prefix is taken in chunks whose scores stay in cache;
- exp runs as a polynomial in plain arithmetic that mlx compiles into one
  loop (`exp_shifted`, within 1 ulp of mx.exp, ~4x faster on x86);
- the probabilities are normalised after the product with the values (w x D
  divisions instead of w x context).
Elsewhere (a one-row step, a short context, quantized caches, additive
masks, a GPU) it is mlx-lm's own function, unchanged."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention

# Where the split form is used, measured on mlx-cpu (bench/verify_attention.md):
# it pays once a layer's prefix scores (query heads x cached keys) outnumber
# what its extra operations cost; sooner for half types, whose products mlx-cpu
# runs outside BLAS (the split form computes in float32)
MIN_SCORES = 8192
MIN_SCORES_HALF = 2048
MAX_ROWS = 64  # new rows; a longer forward is a prefill chunk: mlx-lm's path
CHUNK_ELEMS = 1 << 16  # scores per chunk (all groups and rows): small enough to stay in cache


def pays(rows: int, prefix: int, heads: int, dtype) -> bool:
    """Whether the split form is faster: a verify's few rows (2..MAX_ROWS) over
    a long prefix, on the CPU (on a GPU mlx's fused kernels are the fast path)."""
    least = MIN_SCORES if dtype == mx.float32 else MIN_SCORES_HALF
    return (1 < rows <= MAX_ROWS and heads * prefix >= least
            and mx.default_device() == mx.cpu)


def attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention(queries, keys, values, cache,
    scale, mask, sinks)`, computed by `split_attention` where that pays."""
    rows = queries.shape[2]
    plain = (hasattr(cache, "bits")  # quantized keys: mlx-lm's own products
             or not (mask is None or isinstance(mask, str) and mask == "causal"
                     or isinstance(mask, mx.array) and mask.dtype == mx.bool_)
             or not pays(rows, keys.shape[2] - rows, queries.shape[1], queries.dtype))
    if plain:
        return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    return split_attention(queries, keys, values, scale, mask, sinks)


LOG2E = 1.4426950408889634
ROUND = 12582912.0  # 1.5 * 2**23: (y + ROUND) - ROUND is y rounded to an integer (|y| < 2**22)
LOW = -87.0  # exp(LOW) ~ 1.6e-38: what a softmax's sum (>= 1) cannot see


@mx.compile
def _exp_parts(s, m):
    # exp(x) = 2**n * p(f) with x * log2(e) = n + f, |f| <= 1/2: mlx's own
    # range reduction and Cephes polynomial (mlx/backend/cpu/simd/math.h), here
    # in plain float arithmetic shallow enough (Estrin's scheme, no floor, no
    # casts but the last) that mlx compiles it into ONE loop; mx.exp on an x86
    # build calls floor and fma per element and runs ~4x slower
    y = mx.maximum(s - m, LOW) * LOG2E
    n = (y + ROUND) - ROUND
    f = y - n
    f2 = f * f
    p = (1.0 + 6.931472028550421e-1 * f) + f2 * ((2.402264791363012e-1 + 5.550332471162809e-2 * f)
                                                + f2 * ((9.618437357674640e-3 + 1.339887440266574e-3 * f)
                                                        + f2 * 1.535336188319500e-4))
    return ((n + 127.0) * 8388608.0).astype(mx.int32), p  # the bits of the float 2**n, and p(f)


def exp_shifted(s: mx.array, m: mx.array) -> mx.array:
    """exp(max(s - m, -87)) for float32 s <= m (a softmax's shifted scores):
    within 1 ulp of mx.exp(s - m), ~1.6e-38 where that is below -87."""
    bits, p = _exp_parts(s, m)
    return bits.view(mx.float32) * p


def _chunk(rows: int, groups: int, batch: int) -> int:
    """Keys per chunk: CHUNK_ELEMS scores over every group and row, a power of 2."""
    c = max(256, CHUNK_ELEMS // max(1, rows * groups * batch))
    return 1 << (c.bit_length() - 1)


def _part(q, k, v, mask, rows: int):
    """(row max, sum of exp, exp @ v) over one piece of the key axis, in float32:
    q [B, G, R, D] (R = the group's query heads x `rows` new rows), k and v
    [B, G, n, D], mask None or boolean, broadcastable to [B, G, R // rows, rows, n]."""
    k, v = k.astype(mx.float32), v.astype(mx.float32)  # half types: BLAS products, not mlx-cpu's own
    s = q @ k.swapaxes(-1, -2)
    if mask is not None:
        B, G, R, n = s.shape
        s = mx.where(mask, s.reshape(B, G, R // rows, rows, n), mx.finfo(mx.float32).min).reshape(B, G, R, n)
    m = s.max(axis=-1, keepdims=True)
    e = exp_shifted(s, m)
    return m, e.sum(axis=-1, keepdims=True), e @ v


def split_attention(queries, keys, values, scale: float, mask=None, sinks=None) -> mx.array:
    """softmax(scale * q @ k.T, masked) @ v for queries [B, H, L, D] over keys
    and values [B, G, K, D] (G divides H), the last L keys being the new rows'.
    mask: None, "causal" (new row i sees the prefix and new rows 0..i) or a
    boolean array broadcastable to [B, H, L, K]; sinks: None or [H], a logit
    per head that takes part in the softmax and carries no value (gpt-oss)."""
    B, H, L, D = queries.shape
    G, K = keys.shape[1], keys.shape[2]
    rep = H // G
    S = K - L
    # row r of group g: query head g * rep + r // L, new row r % L
    q = (queries.astype(mx.float32) * scale).reshape(B, G, rep * L, D)
    full = None
    if isinstance(mask, mx.array):  # as [b, G or 1, rep or 1, L, K]
        m = mask.reshape((1,) * (4 - mask.ndim) + mask.shape) if mask.ndim < 4 else mask
        full = m.reshape(m.shape[0], G, rep, *m.shape[2:]) if m.shape[1] == H else mx.expand_dims(m, 2)
    parts = []
    step = _chunk(rep * L, G, B)
    for a in range(0, S, step):
        b = min(S, a + step)
        parts.append(_part(q, keys[:, :, a:b], values[:, :, a:b], None if full is None else full[..., a:b], L))
    if isinstance(mask, str):  # causal: new row i sees new rows 0..i
        block = mx.tril(mx.ones((L, L), mx.bool_))
    else:
        block = None if full is None else full[..., S:]
    parts.append(_part(q, keys[:, :, S:], values[:, :, S:], block, L))
    if sinks is not None:  # a column of its own: exp(sink - max) in the sum, nothing in the product
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(G, rep, 1), (G, rep, L)).reshape(1, G, rep * L, 1)
        parts.append((sink, 1.0, 0.0))
    top = parts[0][0]
    for m, _, _ in parts[1:]:
        top = mx.maximum(top, m)
    den, out = 0, 0
    for m, s, o in parts:
        w = mx.exp(m - top)
        den = den + w * s
        out = out + w * o
    return (out / den).astype(queries.dtype).reshape(B, H, L, values.shape[-1])

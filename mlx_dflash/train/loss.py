"""The drafter training loss: a frozen, no-grad target forward gives the tapped
features; many anchors per row become a batch of blocks `[token_p, MASK ...]` at
positions p..p+B-1 that see the context rows before p (the same as at inference),
decay-weighted cross-entropy on positions 1..B-1, plus the DFlash 2 selector loss
(teacher-forced pair scores over the top-K candidates)."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from ..drafting.drafter import Drafter
from ..target.adapter import Target
from .init import target_features


def default_gamma(block_size: int) -> float:
    """gamma 4 at B=8, 7 at B=16 (published), linear in between and beyond."""
    return max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0)


def position_weights(block_size: int, gamma: Optional[float] = None) -> mx.array:
    g = gamma or default_gamma(block_size)
    return mx.exp(-mx.arange(block_size - 1, dtype=mx.float32) / g)


# mlx-cpu's exp (and so softmax, sigmoid, logsumexp) is scalar code, ~100x numpy's;
# `power(2, x * log2(e))` is several times faster and accurate to float32 rounding.
# Training spends most of its time in these three, so they get fast versions here
# (inference keeps mlx's own; the tests check the two forwards agree).
# exp(x) below e^-30 (and sigmoid below x = -30) is taken as exactly 0: once a
# drafter is trained, such terms times small cotangents are subnormal floats in the
# backward, which x86 handles ~100x slower -- it tripled the step time of a run
# within a few dozen steps.
_LOG2E = 1.4426950408889634
_FLOOR = -30.0


@mx.custom_function
def fast_exp(x):
    return mx.where(x > _FLOOR, mx.power(2.0, mx.maximum(x, _FLOOR) * _LOG2E), 0.0)


@fast_exp.vjp
def _fast_exp_vjp(primals, cotangent, output):
    return (cotangent * output,)


def fast_softmax(x, axis=-1):
    e = fast_exp(x - mx.stop_gradient(x.max(axis=axis, keepdims=True)))
    return e / e.sum(axis=axis, keepdims=True)


def fast_cross_entropy(logits, labels):
    """Per-row CE of [..., V] logits against int labels [...]."""
    z = logits - mx.stop_gradient(logits.max(axis=-1, keepdims=True))
    return mx.log(fast_exp(z).sum(axis=-1)) - mx.take_along_axis(z, labels[..., None], axis=-1)[..., 0]


def _sigmoid(x):
    return mx.where(x > _FLOOR, 1.0 / (1.0 + fast_exp(mx.minimum(-x, -_FLOOR))), 0.0)


@mx.custom_function
def fast_silu(x):
    return x * _sigmoid(x)


@fast_silu.vjp
def _fast_silu_vjp(primals, cotangent, output):
    x = primals[0] if isinstance(primals, (list, tuple)) else primals
    sg = _sigmoid(x)
    return (cotangent * sg * (1.0 + x * (1.0 - sg)),)


def block_forward(drafter: Drafter, target: Target, tokens: mx.array, anchors: mx.array, feats=None):
    """Teacher-forced forward of many blocks.

    tokens [S, L], anchors [S, n] -> (h [N, B, H] final-normed, true block tokens [N, B]),
    N = S*n. Block i is `[token_p, MASK ...]` at positions p..p+B-1, sees the context
    rows j < p of its own row and itself (bidirectionally), nothing else. `feats`:
    precomputed target features of `tokens` (else a no-grad target forward)."""
    c = drafter.config
    B = c.block_size
    S, L = tokens.shape
    n = anchors.shape[1]
    if feats is None:
        feats = target_features(target, tokens, c.target_layer_ids)
    feats = mx.stop_gradient(feats.astype(mx.float32))
    p = anchors.reshape(-1)
    row = mx.repeat(mx.arange(S), n)
    truth = tokens[row[:, None], p[:, None] + mx.arange(B)]  # [N, B]
    inp = mx.concatenate([truth[:, :1], mx.full((p.size, B - 1), c.mask_token_id, dtype=truth.dtype)], axis=1)
    x = target.embed(inp)
    ctx = drafter.context(feats)  # [S, L, H]
    visible = (mx.arange(L) < anchors[..., None])[:, None, :, None, None, :]  # [S, 1, n, 1, 1, L]
    for layer in drafter.layers:
        k, v = layer.self_attn._kv(ctx, 0)  # context K/V once per row, shared by its n blocks
        x = _layer(layer, x, k, v, p, B, visible)
    return drafter.norm(x), truth


def _layer(layer, x, ctx_k, ctx_v, p, B, visible):
    """DraftLayer.__call__ with `_packed_attention` and the fast SiLU (tests check it is the same function)."""
    a = layer.input_layernorm(x)
    if layer.v2:
        d = layer.attention_conv.coefficients(a)
        a = layer.attention_conv(a, d, 0, B)
        x = x + layer.attention_conv(_packed_attention(layer.self_attn, a, ctx_k, ctx_v, p, visible), d, 1, B)
        a = layer.post_attention_layernorm(x)
        d = layer.mlp_conv.coefficients(a)
        return x + layer.mlp_conv(_mlp(layer.mlp, layer.mlp_conv(a, d, 0, B)), d, 1, B)
    x = x + _packed_attention(layer.self_attn, a, ctx_k, ctx_v, p, visible)
    return x + _mlp(layer.mlp, layer.post_attention_layernorm(x))


def _mlp(mlp, x):
    return mlp.down_proj(fast_silu(mlp.gate_proj(x)) * mlp.up_proj(x))


def _packed_attention(attn, x, ctx_k, ctx_v, p, visible):
    """DraftAttention for N = S*n blocks whose context is their row's K/V [S, kv, L, D].

    The blocks of a row meet the row's context in ONE matmul per (row, kv head)
    instead of N small ones against gathered copies of K/V: on mlx-cpu that is
    several times faster, forward and backward."""
    N, B, _ = x.shape
    S, kv, L, D = ctx_k.shape
    n, rep = N // S, attn.n_heads // kv
    q = attn.q_norm(attn.q_proj(x).reshape(N, B, attn.n_heads, D)).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=p) * attn.scale  # [N, heads, B, D]
    kb, vb = attn._kv(x, p)  # the blocks' own K/V [N, kv, B, D]
    qg = q.reshape(N, kv, rep * B, D)  # heads grouped by their KV head
    # context scores: [S, kv, n*rep*B, L]
    qs = qg.reshape(S, n, kv, rep * B, D).transpose(0, 2, 1, 3, 4).reshape(S, kv, n * rep * B, D)
    s_ctx = (qs @ ctx_k.swapaxes(-1, -2)).reshape(S, kv, n, rep, B, L)
    s_ctx = mx.where(visible, s_ctx, -mx.inf)
    s_blk = (qg @ kb.swapaxes(-1, -2)).reshape(S, n, kv, rep, B, B).transpose(0, 2, 1, 3, 4, 5)
    w = fast_softmax(mx.concatenate([s_ctx, s_blk], axis=-1).astype(mx.float32), axis=-1).astype(q.dtype)
    w_ctx, w_blk = w[..., :L], w[..., L:]
    o_ctx = (w_ctx.reshape(S, kv, n * rep * B, L) @ ctx_v).reshape(S, kv, n, rep * B, D).transpose(0, 2, 1, 3, 4)
    o_blk = w_blk.transpose(0, 2, 1, 3, 4, 5).reshape(N, kv, rep * B, B) @ vb
    o = (o_ctx.reshape(N, kv, rep * B, D) + o_blk).reshape(N, attn.n_heads, B, D)
    return attn.o_proj(o.transpose(0, 2, 1, 3).reshape(N, B, -1))


def losses(drafter: Drafter, target: Target, tokens, anchors, weights, selector_weight: float, feats=None):
    """-> (total loss, (ce, selector ce, per-position correctness [N, B-1], logits, h, truth))."""
    h, truth = block_forward(drafter, target, tokens, anchors, feats)
    hd, labels = h[:, 1:], truth[:, 1:]
    logits = target.head(hd).astype(mx.float32)  # [N, B-1, V]
    ce = fast_cross_entropy(logits, labels)  # [N, B-1]
    ce = (ce * weights).sum() / (weights.sum() * ce.shape[0])
    correct = mx.argmax(logits, axis=-1) == labels
    sel = mx.array(0.0)
    if drafter.config.version == 2:
        sel = selector_loss(drafter, target, logits, hd, truth, weights)
    return ce + selector_weight * sel, (ce, sel, correct, logits, hd, truth)


def selector_loss(drafter, target, logits, hd, truth, weights):
    """CE over each position's top-K candidates scored with the TRUE predecessor;
    positions whose true token is not a candidate are skipped."""
    from ..drafting.selector import top_k_ids

    N, P, V = logits.shape
    K = min(drafter.candidate_selector.top_k, V)
    ids = top_k_ids(mx.stop_gradient(logits).reshape(-1, V), K).reshape(N, P, K)
    cand_logits = mx.take_along_axis(logits, ids, axis=-1)
    prev, labels = truth[:, :-1], truth[:, 1:]  # predecessor of position k: the anchor for k=1
    s = drafter.candidate_selector.pair_scores(prev, ids, cand_logits, hd, target.embed_tokens)
    hit = ids == labels[..., None]
    valid = hit.any(axis=-1).astype(mx.float32) * weights
    ce = fast_cross_entropy(s, mx.argmax(hit, axis=-1))
    return (ce * valid).sum() / mx.maximum(valid.sum(), 1.0)


def selector_walk(drafter, target, logits, hd, anchors_tok) -> mx.array:
    """The selector's greedy path per block (batched over blocks): [N, B-1] token ids."""
    from ..drafting.selector import top_k_ids

    N, P, V = logits.shape
    K = min(drafter.candidate_selector.top_k, V)
    ids = top_k_ids(logits.reshape(-1, V), K).reshape(N, P, K)
    cl = mx.take_along_axis(logits, ids, axis=-1)
    prev, out = anchors_tok, []
    for t in range(P):
        s = drafter.candidate_selector.pair_scores(prev[:, None], ids[:, t: t + 1], cl[:, t: t + 1],
                                                   hd[:, t: t + 1], target.embed_tokens)[:, 0]
        prev = mx.take_along_axis(ids[:, t], mx.argmax(s, axis=-1)[:, None], axis=-1)[:, 0]
        out.append(prev)
    return mx.stack(out, axis=1)


def tau_estimate(correct: np.ndarray, width: int) -> float:
    """1 + mean leading run of correct drafts, capped at width-1 (greedy acceptance)."""
    c = np.asarray(correct, dtype=bool)[:, : width - 1]
    lead = np.where(c.all(axis=1), c.shape[1], np.argmin(c, axis=1))
    return float(1.0 + lead.mean())


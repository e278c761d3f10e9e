"""One drafter forward for every row of a batch (DFLASH2.md section 2, batched).

Each row keeps its own drafter context cache (its length, window and positions
are its own); the rows' context K/V are left-padded to one length per layer,
with a mask that hides the padding and applies each layer's own visibility
(windows, causal blocks: DraftAttention.visible). The block of row b sits at
its own positions (RoPE offsets per row). Drafts never decide what is emitted
(the verify does), so padding only has to be right for acceptance."""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

from ..target import rope_tables



def _layer_inputs(attn, ctxs, offsets: List[int], w: int):
    """Padded context K/V [B, kv, N, D] and the boolean mask [B, 1, w, N + w]
    for one drafter layer, from each row's (ctx_k, ctx_v, first)."""
    kept, masks = [], []
    for (k, v, first), off in zip(ctxs, offsets):
        n = 0 if k is None else k.shape[2]
        lo, m = attn.visible(w, n, off, first)
        if k is not None and lo:
            k, v = k[..., lo:, :], v[..., lo:, :]
        n -= lo
        kept.append((k, v, n))
        masks.append(m if m is not None else mx.ones((w, n + w), dtype=mx.bool_))
    N = max(n for _, _, n in kept)
    if N == 0:
        return None, None, mx.stack(masks)[:, None]
    ref = next(k for k, _, n in kept if n)
    ks, vs, ms = [], [], []
    for (k, v, n), m in zip(kept, masks):
        pad = N - n
        if n == 0:
            k = mx.zeros(ref.shape[:2] + (N, ref.shape[3]), ref.dtype)
            v = mx.zeros(ref.shape[:2] + (N, v.shape[3] if v is not None else ref.shape[3]), ref.dtype)
        elif pad:
            k = mx.pad(k, [(0, 0), (0, 0), (pad, 0), (0, 0)])
            v = mx.pad(v, [(0, 0), (0, 0), (pad, 0), (0, 0)])
        ks.append(k)
        vs.append(v)
        ms.append(mx.concatenate([mx.zeros((w, pad), dtype=mx.bool_), m], axis=1) if pad else m)
    return mx.concatenate(ks), mx.concatenate(vs), mx.stack(ms)[:, None]


def propose_batch(drafter, target, anchors: List[int], feats: List[Optional[mx.array]],
                  caches: List[Optional[list]], width: int, temperatures: List[float],
                  keys: List[Optional[mx.array]]):
    """Draft `width - 1` tokens after each row's anchor, all rows in one forward
    (lazy). Row b's context takes feats[b] (features of its rows not yet in
    caches[b]); a row whose cache is None does not draft (its drafts are
    filler, never verified). Returns (tokens [B, width - 1] int32, per row its
    proposal distribution q [width - 1, V] when it samples from a DFlash 2
    selector, else None). `drafter`: a drafting.drafter.Drafter."""
    with rope_tables.Tables():  # (the layers rotate at the same positions: one table each)
        return _propose_batch(drafter, target, anchors, feats, caches, width, temperatures, keys)


def _propose_batch(drafter, target, anchors, feats, caches, width, temperatures, keys):
    B, w = len(anchors), width
    caches = [c if c is not None else drafter.make_cache(1, 0) for c in caches]  # (filler rows: a throwaway context)
    ctxs = [drafter.feed(f, c) for f, c in zip(feats, caches)]  # per row, per layer
    offsets = [c[0].offset for c in caches]
    mask_id = drafter.config.mask_token_id
    block = mx.array([[a] + [mask_id] * (w - 1) for a in anchors], mx.int32)
    x = drafter.embed_block(target, block)
    pos = mx.array(offsets, mx.int32)
    for i, layer in enumerate(drafter.layers):
        k, v, m = _layer_inputs(layer.self_attn, [ctx[i] for ctx in ctxs], offsets, w)
        x = layer(x, k, v, pos, w, mask=m)
    h = drafter.norm(x)[:, 1:]
    logits = drafter.logits(target, h)  # [B, w-1, V]
    if drafter.config.version == 1:
        return mx.argmax(logits, axis=-1).astype(mx.int32), [None] * B
    toks, qs = [], []
    for b in range(B):
        t, q, _ = drafter.candidate_selector.walk(logits[b], h[b], anchors[b], target.embed_tokens,
                                                  temperatures[b], keys[b])
        toks.append(t)
        qs.append(q)
    return mx.stack(toks).astype(mx.int32), qs


"""Greedy-decoding loops of the embedded target: how they are measured (evaluation,
model card) and the unlikelihood data and loss that train them away (`train --ul-data`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def repeated_ngram_loop(ids, window=64, n=8):
    """True iff the last `window` generated tokens contain some 8-gram twice."""
    tail = list(ids[-window:])
    seen = set()
    for i in range(len(tail) - n + 1):
        g = tuple(tail[i:i + n])
        if g in seen:
            return True
        seen.add(g)
    return False


def stuck_in_loop(ids, finished, window=48, max_period=24):
    """True iff the output never ended (hit max tokens) and its last `window` tokens are
    one cycle of at most `max_period` tokens repeated exactly: decoding that fell into a
    loop and would never stop. (The 8-gram measure above also counts the repeated phrases
    of a finished GSM8K answer, which gold answers have too.)"""
    return not finished and loop_region(list(ids), max_period, window) is not None


def loop_region(ids, max_period=24, min_len=48):
    """(start, period) of the exact periodic tail of `ids` -- the loop a response fell into --
    or None when its tail is not one cycle of at most `max_period` tokens repeated over at
    least `min_len` tokens. The earliest start over all periods wins."""
    n, best = len(ids), None
    for p in range(1, max_period + 1):
        j = n - p  # ids[i] == ids[i + p] for every i >= j
        while j > 0 and ids[j - 1] == ids[j - 1 + p]:
            j -= 1
        if n - j >= max(min_len, 2 * p) and (best is None or j < best[0]):
            best = (j, p)
    return best


def repeat_positions(ids, n):
    """Indices t at which ids[t-n+1..t] is an n-gram seen earlier in ids."""
    seen, out = set(), []
    for t in range(n - 1, len(ids)):
        g = tuple(ids[t - n + 1:t + 1])
        if g in seen:
            out.append(t)
        seen.add(g)
    return out


def unlikelihood_rows(paths, pad_id, max_len, ngram=0):
    """Sequence-level unlikelihood data (Welleck et al. 2019, "Neural text generation with
    unlikelihood training"): the model's own greedy responses that never ended and fell into
    a loop. Each row is (prompt + response ids, mask over next-token targets): the mask marks
    every token that repeats an earlier cycle of the loop, whose probability the loss pushes
    down; with `ngram` > 0 also every token that completes a repeated n-gram of the response
    (near-loops whose cycles differ a little). Rows are cut to `max_len` tokens (the first
    penalized token kept in view) and padded."""
    xs, ms = [], []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if r.get("finish") != "length":
                continue
            resp, off = r["response"], len(r["prompt"])
            marked = set(repeat_positions(resp, ngram)) if ngram else set()
            loop = loop_region(resp)
            if loop is not None:
                marked.update(range(loop[0] + loop[1], len(resp)))  # the tokens that copy the cycle
            if not marked:
                continue
            ids = r["prompt"] + resp
            start = off + min(marked)
            cut = max(0, min(start - max_len // 2, len(ids) - max_len - 1))
            ids = ids[cut:cut + max_len + 1]
            mask = [0.0] * (len(ids) - 1)
            for t in marked:
                if 1 <= off + t - cut < len(ids):
                    mask[off + t - cut - 1] = 1.0  # target position t-1 predicts ids[t]
            pad = max_len + 1 - len(ids)
            xs.append(ids + [pad_id] * pad)
            ms.append(mask + [0.0] * pad)
    return np.array(xs, dtype=np.int32).reshape(-1, max_len + 1), np.array(ms, dtype=np.float32).reshape(-1, max_len)


def unlikelihood_loss(logits, y, mask):
    """mean over masked targets of -log(1 - p(target))."""
    import mlx.core as mx

    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    p = mx.exp(mx.take_along_axis(logp, y[..., None], axis=-1)[..., 0])
    ul = -mx.log(mx.maximum(1.0 - p, 1e-5))
    return (ul * mask).sum() / mx.maximum(mask.sum(), 1.0)

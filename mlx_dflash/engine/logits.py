"""mlx-lm logits processors (logit_bias, penalties, a constrained format) where
DFlash verifies: each row of a verify forward is processed with the history
plain decoding would have given it, had it emitted the drafts before that row.
A row is only used when those drafts are accepted, i.e. when they are what
plain decoding emits, so the accepted tokens are plain decoding's (greedy:
token for token; sampled: the same distribution)."""

from __future__ import annotations

from typing import Callable, List, Sequence

import mlx.core as mx


def process(processors: Sequence[Callable], history: mx.array, logits: mx.array) -> mx.array:
    """One position's logits [V] through the processors (mlx-lm's contract:
    `p(tokens so far, logits [1, V]) -> logits`), then the log-softmax: what
    mlx-lm's generate_step samples from (so greedy ties break the same way)."""
    x = logits[None]
    for p in processors:
        x = p(history, x)
    x = x[0]
    return x - mx.logsumexp(x, keepdims=True)


def process_rows(processors: Sequence[Callable], history: mx.array, fed: List[int], logits: mx.array) -> mx.array:
    """The rows [n+1, V] of one verify (at the anchor and each of n drafts),
    processed: row i after `history` (the ids before the anchor) + `fed[:i+1]`
    (fed = [anchor] + drafts, read to the host). Rows past a draft the
    processors forbid get whatever the processors make of that history: the
    acceptance never reaches them."""
    rows = []
    for i in range(logits.shape[0]):
        h = mx.concatenate([history, mx.array(fed[: i + 1], mx.int32)])
        rows.append(process(processors, h, logits[i]))
    return mx.stack(rows)

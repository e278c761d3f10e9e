"""What a batched cycle costs, c(w, B): measured once per model, drafter,
machine and batch size (then cached with the single-stream curves: costs.py's
CostBook, under the tag "batch<B>"), through the batch engine's own steps (a
batched verify with feature capture, its ragged rollback, the batched draft).

The unit is one plain batched step at B rows (a [B, 1] verify: what plain
batched decoding runs per token), so k(w, B) = c(w) + d(w) is a cycle's cost
in plain batched steps, the number the batch guard divides by."""

from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

import mlx.core as mx

from . import batch_cache as bc
from .batch_draft import propose_batch
from .calibrate import Calibration
from .costs import Costs
from .drafter import Drafter
from .target import Target

BATCH_WIDTHS = (1, 2, 3, 5, 8)  # measured (capped at the drafter's block size); between: interpolated
MEASURED_B = (1, 2, 4, 8, 16, 32)  # batch sizes measured; between: linear in B


def measure(model, drafter, B: int, widths: Sequence[int], context: int = 128, rounds: int = 3) -> Costs:
    """Time [B, w] verifies (capture on, rolled back) and B-row drafts of w positions."""
    target = Target(model)
    capture = list(drafter.config.target_layer_ids) if drafter is not None else []
    ids = ((mx.arange(context) * 7919 + 11) % target.vocab_size).tolist()
    cache, feats = None, None
    for _ in range(B):  # B rows of the same context, each prefilled alone as the engine does
        c = target.make_cache()
        _, f = target(mx.array(ids)[None], c, capture)
        mx.eval([x.state for x in c])
        feats = f
        cache = bc.join(cache, bc.to_batch(c))
    real = isinstance(drafter, Drafter)
    dcaches = [drafter.make_cache() for _ in range(B)] if real else []
    if real:
        t, _ = propose_batch(drafter, target, [ids[-1]] * B, [feats] * B, dcaches, 2, [0.0] * B, [None] * B)
        mx.eval(t)

    def verify(w):
        t0 = time.perf_counter()
        logits, f = target(mx.zeros((B, w), mx.int32), cache, capture)
        mx.eval(mx.argmax(logits, axis=-1), *([f] if f is not None else []))
        bc.rollback(target, cache, w, [w] * B)
        return time.perf_counter() - t0

    def draft(w):
        t0 = time.perf_counter()
        t, _ = propose_batch(drafter, target, [ids[-1]] * B, [None] * B, dcaches, w, [0.0] * B, [None] * B)
        mx.eval(t)
        return time.perf_counter() - t0

    widths = sorted(set(widths) | {1})
    dw = [w for w in widths if w > 1] if real else []
    for w in widths:  # warm-up: first calls at a new shape are slow
        verify(w)
    for w in dw:
        draft(w)
    tv = {w: [] for w in widths}
    td = {w: [] for w in dw}
    for _ in range(rounds):
        for w in widths:
            tv[w].append(verify(w))
        for w in dw:
            td[w].append(draft(w))
    # ratios within a round, then the median: the machine's load drifts between rounds
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    c = {w: med([a / b for a, b in zip(tv[w], tv[1])]) for w in widths}
    d = {1: 0.0}
    d.update({w: med([a / b for a, b in zip(td[w], tv[1])]) if real else 0.0 for w in widths if w > 1})
    t1 = med(tv[1])
    return Costs(t1, c, d, context, time.time(), t1)


class BatchCosts:
    """k(w, B) for one model + drafter: cached curves at MEASURED_B (measured
    when first needed), linear in B between them."""

    def __init__(self, model, drafter, calibration: Calibration, widest: int):
        self.model, self.drafter, self.cal = model, drafter, calibration
        self.widths = sorted({w for w in BATCH_WIDTHS if w <= widest} | {widest, 1})
        self._held: Dict[int, Dict[int, float]] = {}

    def curve(self, B: int) -> Dict[int, float]:
        """{w: cost of a cycle at width w in plain batched steps} at B rows."""
        lo = max([b for b in MEASURED_B if b <= B] or [1])
        hi = min([b for b in MEASURED_B if b >= B] or [MEASURED_B[-1]])
        a, b = self._at(lo), self._at(hi)
        f = 0.0 if hi == lo else (B - lo) / (hi - lo)
        return {w: a[w] + f * (b[w] - a[w]) for w in self.widths}

    def _at(self, B: int) -> Dict[int, float]:
        if B not in self._held:
            book, tag = self.cal.book, f"batch{B}"
            got: Optional[Costs] = book.curve(self.model, self.drafter, widths=self.widths, context=tag)
            if got is None:
                got = measure(self.model, self.drafter, B, self.widths)
                book.keep(self.model, self.drafter, got, context=tag)
            self._held[B] = {w: got.c[w] + got.d.get(w, 0.0) for w in self.widths}
        return self._held[B]

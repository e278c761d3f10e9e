"""Width policies for a batch (batch.py): one width per cycle for all rows.

- `FixedBatchWidth`: always w (tests, explicit widths).
- `BatchGuard`: never slower than plain batched decoding, by prediction. At
  batch size B a cycle of width w costs k(w, B) plain batched steps (measured
  once per model, drafter, machine and B: batch_costs.py); the batch emits
  sum_b tau_b(w) tokens per cycle, tau_b(w) = 1 + sum_k prod_{i<=k} p_b,i from
  row b's live per-position acceptance p_b. Each cycle takes the w that
  maximises sum_b tau_b(w) / k(w, B) over B (plain: 1); below break-even the
  batch decodes plainly and probes again after a while."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from .policy import Guard, monotone


class BatchPolicy:
    reason: str = ""

    def next(self, rows) -> int:
        raise NotImplementedError

    def observe(self, rows, drafted: List[int], accepted: List[int]) -> None:
        """After a cycle: per row, drafts verified and accepted."""


class FixedBatchWidth(BatchPolicy):
    def __init__(self, width: int):
        self.w = width
        self.reason = f"batch: fixed width {width}"

    def next(self, rows) -> int:
        return self.w


class BatchGuard(BatchPolicy):
    """`costs(B) -> {w: k(w, B)}` (k(1, B) = 1: a plain batched step).

    Per row and draft position, acceptance is a running mean that starts from
    `prior` with PSEUDO pseudo-tries and forgets old evidence at rate FORGET, so
    a row's first cycles move it fast. Below break-even the batch decodes
    plainly for `backoff` cycles (doubling), then probes one cycle where a
    drafter accepting 90% per position could pay."""

    MARGIN = 1.1  # a width must predict this much over plain to be drafted
    PRIOR_P = 0.6  # a new row's per-position acceptance before any evidence
    PSEUDO = 2.0  # weight of the prior, in tries
    FORGET = 0.1  # share of old evidence forgotten per observation
    OPTIMIST = 0.9  # a probe is tried only where a drafter this good could pay
    BACKOFF0, BACKOFF_MAX = 16, 256  # plain cycles before the next probe

    def __init__(self, costs: Callable[[int], Dict[int, float]], widest: int, prior: Optional[List[float]] = None):
        self.costs, self.widest = costs, widest
        # a new row's per-position acceptance before its own evidence
        self.prior = [min(0.95, max(0.05, x)) for x in prior[: widest - 1]] if prior else []
        self.prior += [self.PRIOR_P] * (widest - 1 - len(self.prior))
        self.ev: Dict[int, List[List[float]]] = {}  # uid -> per position [hits, tries] (decayed)
        self.wait = 0  # plain cycles before the next probe
        self.backoff = self.BACKOFF0
        self.probing = False
        self.reason = "batch: guard"
        self._k: Dict[int, Dict[int, float]] = {}

    def _kw(self, B: int) -> Dict[int, float]:
        if B not in self._k:
            k = self.costs(B)
            ws = sorted(x for x in k if x <= self.widest)
            self._k[B] = dict(zip(ws, monotone([k[x] for x in ws])))
        return self._k[B]

    def p(self, row) -> List[float]:
        ev = self.ev.get(row.uid)
        if ev is None:
            return list(self.prior)
        return [(self.PSEUDO * q + h) / (self.PSEUDO + n) for q, (h, n) in zip(self.prior, ev)]

    def predict(self, rows, optimistic: bool = False) -> tuple:
        """(best width, predicted speedup over plain batched decoding)."""
        kw = self._kw(len(rows))
        best = (1, 1.0)
        for w, k in kw.items():
            if w < 2:
                continue
            tok = 0.0
            for r in rows:
                p = [self.OPTIMIST] * (self.widest - 1) if optimistic else self.p(r)
                tok += Guard.expected(p, min(w, r.cap)) if r.drafts else 1.0
            s = tok / len(rows) / k
            if s > best[1]:
                best = (w, s)
        return best

    def next(self, rows) -> int:
        B = len(rows)
        if not any(r.drafts for r in rows):
            self.reason = "batch: plain (no row drafts)"
            return 1
        if self.wait > 0:
            self.wait -= 1
            self.reason = f"batch: plain at {B} rows; probe in {self.wait}"
            return 1
        w, s = self.predict(rows)
        if w > 1 and s >= self.MARGIN:
            self.backoff, self.probing = self.BACKOFF0, False
            self.reason = f"batch: width {w} at {B} rows, {s:.2f}x predicted"
            return w
        if not self.probing:  # the estimates say plain: one probe where a good drafter could pay
            wo, so = self.predict(rows, optimistic=True)
            if wo > 1 and so >= self.MARGIN:
                self.probing = True
                self.reason = f"batch: probing width {wo} at {B} rows ({s:.2f}x predicted)"
                return wo
        self.probing = False
        self.wait, self.backoff = self.backoff, min(self.backoff * 2, self.BACKOFF_MAX)
        self.reason = f"batch: plain at {B} rows (DFlash {s:.2f}x predicted)"
        return 1

    def observe(self, rows, drafted: List[int], accepted: List[int]) -> None:
        for r, n, a in zip(rows, drafted, accepted):
            if not n:
                continue
            ev = self.ev.setdefault(r.uid, [[0.0, 0.0] for _ in range(self.widest - 1)])
            for i in range(min(n, len(ev))):  # position i was tried iff all before it were accepted
                if i > a:
                    break
                h, t = ev[i]
                ev[i] = [h * (1 - self.FORGET) + (i < a), t * (1 - self.FORGET) + 1]
        live = {r.uid for r in rows}
        for uid in [u for u in self.ev if u not in live]:
            del self.ev[uid]

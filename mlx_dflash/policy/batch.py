"""Width policies for a batch (batch.py): one width per cycle for all rows,
and where each row's drafts come from.

- `FixedBatchWidth`: always w (tests, explicit widths).
- `BatchGuard`: never slower than plain batched decoding, by prediction. At
  batch size B a cycle of width w costs k(w, B) plain batched steps (measured
  once per model, drafter, machine and B: batch_costs.py); the batch emits
  sum_b tau_b(w) tokens per cycle, tau_b(w) = 1 + sum_k prod_{i<=k} p_b,i from
  row b's live per-position acceptance p_b. Each cycle takes the w that
  maximises sum_b tau_b(w) / k(w, B) over B (plain: 1); below break-even the
  batch decodes plainly and probes again after a while.

Prompt lookup per row (lookup.py, as the single-stream guard verifies it): a
row whose context ends in an n-gram seen before may verify that n-gram's
continuation instead of the drafter's block. Each row keeps its own lookup
gate (policy.LookupGate: the share of its lookup drafts accepted, alpha); a
row takes lookup when its expected tokens 1 + alpha * n reach the drafter's
tau_b(w), or whenever the batch verifies at w > 1 without drafting it from
the drafter (its verify rows are paid for already). A cycle in which no row
drafts from the drafter runs no drafter forward and costs the verify alone,
c(w, B): the guard weighs those cycles too, so lookup rows are drafted where
the drafter does not pay; while the batch decodes plainly, every GAP-th match
of a row is verified anyway (as the single-stream gate does), so a text that
starts repeating itself is noticed."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from .base import DFLASH, LOOKUP
from .guard import Guard, LookupGate, monotone


class BatchPolicy:
    """`next(rows, offers)` -> the cycle's width (offers[b]: how many lookup
    drafts row b's context offers now); `sources(rows, w, offers)` -> per row
    DFLASH, LOOKUP or "" (no drafts); `observe` after the cycle. Per row it
    keeps the statistics both rules read: the drafter's per-position
    acceptance (a running mean from `prior` with PSEUDO pseudo-tries that
    forgets old evidence at rate FORGET, so a row's first cycles move it fast)
    and its lookup gate (from `lookup_alpha`, e.g. the single-stream guard's)."""

    reason: str = ""
    PRIOR_P = 0.6  # a new row's per-position acceptance before any evidence
    PSEUDO = 2.0  # weight of the prior, in tries
    FORGET = 0.1  # share of old evidence forgotten per observation

    def __init__(self, widest: int, prior: Optional[List[float]] = None, lookup_alpha: Optional[float] = None):
        self.widest = widest
        # a new row's per-position acceptance before its own evidence
        self.prior = [min(0.95, max(0.05, x)) for x in prior[: widest - 1]] if prior else []
        self.prior += [self.PRIOR_P] * (widest - 1 - len(self.prior))
        self.lookup_alpha = lookup_alpha
        self.ev: Dict[int, List[List[float]]] = {}  # uid -> per position [hits, tries] (decayed)
        self.gates: Dict[int, LookupGate] = {}  # uid -> its lookup gate
        self.dflash = True  # the last `next` drafts from the drafter (else: lookup rows alone)

    def next(self, rows, offers: Optional[List[int]] = None) -> int:
        raise NotImplementedError

    def p(self, row) -> List[float]:
        ev = self.ev.get(row.uid)
        if ev is None:
            return list(self.prior)
        return [(self.PSEUDO * q + h) / (self.PSEUDO + n) for q, (h, n) in zip(self.prior, ev)]

    def gate(self, row) -> LookupGate:
        g = self.gates.get(row.uid)
        if g is None:
            g = self.gates[row.uid] = LookupGate(None, row.cap, self.lookup_alpha)
        return g

    def row_tokens(self, row, w: int, offer: int, dflash: bool) -> float:
        """Row's expected tokens in a cycle at width w, from the source `sources` would give it."""
        n = min(offer, w - 1)
        look = self.gate(row).tokens(n) if n > 0 else 1.0
        if row.drafts and dflash:
            return max(look, Guard.expected(self.p(row), min(w, row.cap)))
        return look

    def sources(self, rows, w: int, offers: List[int]) -> List[str]:
        """Each row's draft source this cycle, at width w (the drafter only where `self.dflash`)."""
        out = []
        for r, m in zip(rows, offers):
            dflash = r.drafts and (self.dflash or r.fixed) and w > 1
            n = min(m, w - 1)
            src = DFLASH if dflash else ""
            if n > 0 and not r.fixed:
                g = self.gate(r)
                if not dflash or g.tokens(n) >= Guard.expected(self.p(r), min(w, r.cap)):
                    src = LOOKUP
            out.append(src)
        return out

    def observe(self, rows, drafted: List[int], accepted: List[int], sources: Optional[List[str]] = None) -> None:
        """After a cycle: per row, drafts verified and accepted, and their source."""
        sources = sources or [DFLASH] * len(rows)
        for r, n, a, src in zip(rows, drafted, accepted, sources):
            if not n:
                continue
            if src == LOOKUP:
                self.gate(r).observe(a, n)
                continue
            ev = self.ev.setdefault(r.uid, [[0.0, 0.0] for _ in range(self.widest - 1)])
            for i in range(min(n, len(ev))):  # position i was tried iff all before it were accepted
                if i > a:
                    break
                h, t = ev[i]
                ev[i] = [h * (1 - self.FORGET) + (i < a), t * (1 - self.FORGET) + 1]
        live = {r.uid for r in rows}
        for d in (self.ev, self.gates):
            for uid in [u for u in d if u not in live]:
                del d[uid]

    def row_reason(self, row) -> str:
        """The reason a row's stats show: the batch's, and its own lookup gate's."""
        g = self.gates.get(row.uid)
        return self.reason + (g.tail() if g is not None else "")


class FixedBatchWidth(BatchPolicy):
    def __init__(self, width: int):
        super().__init__(width)
        self.w = width
        self.reason = f"batch: fixed width {width}"

    def next(self, rows, offers: Optional[List[int]] = None) -> int:
        return self.w


class BatchGuard(BatchPolicy):
    """`costs(B) -> {w: k(w, B)}` (k(1, B) = 1: a plain batched step);
    `verify(B)`: the same for a cycle without a drafter forward (lookup rows
    alone; None: priced as `costs`). Below break-even the batch decodes
    plainly (lookup rows still verify where they pay) for `backoff` cycles
    (doubling), then probes one cycle where a drafter accepting 90% per
    position could pay."""

    MARGIN = 1.1  # a width must predict this much over plain to be drafted
    OPTIMIST = 0.9  # a probe is tried only where a drafter this good could pay
    BACKOFF0, BACKOFF_MAX = 16, 256  # plain cycles before the next probe

    def __init__(self, costs: Callable[[int], Dict[int, float]], widest: int, prior: Optional[List[float]] = None,
                 verify: Optional[Callable[[int], Dict[int, float]]] = None, lookup_alpha: Optional[float] = None):
        super().__init__(widest, prior, lookup_alpha)
        self.costs, self.verify = costs, verify or costs
        self.wait = 0  # plain cycles before the next probe
        self.backoff = self.BACKOFF0
        self.probing = False
        self.reason = "batch: guard"
        self._k: Dict[tuple, Dict[int, float]] = {}

    def _kw(self, B: int, verify: bool = False) -> Dict[int, float]:
        if (B, verify) not in self._k:
            k = (self.verify if verify else self.costs)(B)
            ws = sorted(x for x in k if x <= self.widest)
            self._k[B, verify] = dict(zip(ws, monotone([k[x] for x in ws])))
        return self._k[B, verify]

    def predict(self, rows, optimistic: bool = False, offers: Optional[List[int]] = None,
                dflash: bool = True) -> tuple:
        """(best width, predicted speedup over plain batched decoding); `dflash`
        False: lookup rows alone (no drafter forward)."""
        offers = offers or [0] * len(rows)
        kw, kv = self._kw(len(rows)), self._kw(len(rows), verify=True)
        best = (1, 1.0)
        for w in kw:
            if w < 2:
                continue
            tok, drafter = 0.0, False
            for r, m in zip(rows, offers):
                if optimistic and r.drafts:
                    tok += Guard.expected([self.OPTIMIST] * (self.widest - 1), min(w, r.cap))
                    drafter = True
                    continue
                t = self.row_tokens(r, w, m if not r.fixed else 0, dflash)
                # the row drafts from the drafter unless its lookup drafts promise as much
                drafter |= dflash and r.drafts and (m == 0 or r.fixed or t > self.gate(r).tokens(min(m, w - 1)))
                tok += t
            s = tok / len(rows) / (kw[w] if drafter else kv.get(w, kw[w]))
            if s > best[1]:
                best = (w, s)
        return best

    def next(self, rows, offers: Optional[List[int]] = None) -> int:
        B = len(rows)
        self.dflash = True
        if not any(r.drafts for r in rows):
            self.reason = "batch: plain (no row drafts)"
            return 1
        wl, sl = self.predict(rows, offers=offers, dflash=False)  # lookup rows alone
        look = wl > 1 and sl >= self.MARGIN
        if self.wait > 0:
            self.wait -= 1
            return self._lookup_only(B, wl, sl, f"probe in {self.wait}") if look else self._plain(
                rows, offers, f"batch: plain at {B} rows; probe in {self.wait}")
        w, s = self.predict(rows, offers=offers)
        if w > 1 and s >= self.MARGIN:
            self.backoff, self.probing = self.BACKOFF0, False
            if look and sl > s:
                return self._lookup_only(B, wl, sl, f"DFlash {s:.2f}x")
            self.reason = f"batch: width {w} at {B} rows, {s:.2f}x predicted"
            return w
        if not self.probing:  # the estimates say plain: one probe where a good drafter could pay
            wo, so = self.predict(rows, optimistic=True, offers=offers)
            if wo > 1 and so >= self.MARGIN:
                self.probing = True
                self.reason = f"batch: probing width {wo} at {B} rows ({s:.2f}x predicted)"
                return wo
        self.probing = False
        self.wait, self.backoff = self.backoff, min(self.backoff * 2, self.BACKOFF_MAX)
        if look:
            return self._lookup_only(B, wl, sl, f"DFlash {s:.2f}x")
        return self._plain(rows, offers, f"batch: plain at {B} rows (DFlash {s:.2f}x predicted)")

    def _plain(self, rows, offers: Optional[List[int]], reason: str) -> int:
        """A plain cycle, unless a row's gate verifies its match anyway (every GAP-th)."""
        due = [m for r, m in zip(rows, offers or [0] * len(rows)) if m and not r.fixed and self.gate(r).skip()]
        if due:
            return self._lookup_only(len(rows), min(max(due), self.widest - 1) + 1, 0.0, "a periodic check")
        self.reason = reason
        return 1

    def _lookup_only(self, B: int, w: int, s: float, why: str) -> int:
        self.dflash = False
        self.reason = f"batch: lookup rows at width {w}, {B} rows, {s:.2f}x predicted ({why})"
        return w

"""Verify mode `adaptive` (`AdaptiveWidth`): a per-cycle width and cut from
the measured cost curve c(w), d(w) and the drafts' confidences:

    E[emitted | verify n drafts] = 1 + sum_{k=1..n} prod_{i<=k} a_i
    cost(draft width W, n)       = c(n + 1) + d(W)          (in 1-token target steps)

a_i, the chance that draft i is accepted given drafts < i were, comes from the
selector's path score of the draft (DFlash 1: the drafter's probability),
calibrated by recent acceptance. When recent cycles emit fewer tokens per unit
of cost than plain decoding would, it falls back to plain steps and re-probes
after 8, 16, 32 (at most 64) of them. Pure: no model in here (policy.py holds
the other policies)."""

from __future__ import annotations

from typing import Dict, List, Optional

from .base import DFLASH, Decision, Policy, Row
from .costs import Costs


class _Calibration:
    """P(draft accepted | its drafter probability), in probability bins, from
    recent verifies. Counts decay every cycle, so a bin that has not been seen
    for a while drifts back to the prior (the drafter's own probability)."""

    def __init__(self, bins: int = 10, prior_weight: float = 1.0, decay: float = 0.98):
        self.bins, self.m, self.decay = bins, prior_weight, decay
        self.hits = [0.0] * bins
        self.n = [0.0] * bins

    def _bin(self, p: float) -> int:
        return min(self.bins - 1, max(0, int(p * self.bins)))

    def __call__(self, p: float) -> float:
        b = self._bin(p)
        return (self.hits[b] + self.m * p) / (self.n[b] + self.m)

    def update(self, p: float, hit: bool) -> None:
        b = self._bin(p)
        self.hits[b] += hit
        self.n[b] += 1

    def step(self) -> None:
        self.hits = [h * self.decay for h in self.hits]
        self.n = [n * self.decay for n in self.n]


class _Scale:
    """Observed time / start-up estimate, as a running average: the start-up
    curve keeps its shape, its level follows the machine (load, context). One
    outlier (a page fault, another process) moves it by at most a bounded step."""

    def __init__(self, alpha: float = 0.1):
        self.alpha, self.value, self.seen = alpha, 1.0, False

    def update(self, observed: float, predicted: float) -> bool:
        if predicted <= 0 or observed <= 0:
            return False
        r = observed / predicted
        if not self.seen:
            self.value, self.seen = r, True
        else:
            r = min(max(r, self.value / 4), self.value * 4)
            self.value += self.alpha * (r - self.value)
        return True


class AdaptiveWidth(Policy):
    """Per-cycle verify width for `stream_generate(verify_mode="adaptive")`.

    The decode session asks `next(state)` (a plain run while falling back, else
    a draft at the planned width), `trim(drafts, conf)` after the draft (the cut:
    it reads the drafts' confidences), and reports `observe(result)`."""

    reads_confidence = True

    PATIENCE = 4  # cycles below break-even before falling back to plain steps
    BACKOFF0, BACKOFF_MAX = 8, 64  # plain steps before the next re-probe (a probe costs ~1 step)
    ALPHA, ALPHA_PROBE = 0.1, 0.5  # acceptance running-mean rates (a probe counts more)
    RATE_ALPHA = 0.05  # realized-speedup running mean: ~20 cycles, so luck does not trigger a fallback

    def __init__(self, costs: Costs, max_width: int, *, prior: float = 0.7, online: bool = True):
        if not 1 <= max_width <= costs.max_width:
            raise ValueError(f"max_width {max_width} outside the measured cost curve 1..{costs.max_width}")
        self.costs = costs
        self.max_width = self.widest = max_width
        self.online = online  # rescale costs with observed timings
        self.prior = prior
        self.p = [prior] * max_width  # p[k-1]: P(draft k accepted | drafts < k accepted)
        self.calib = _Calibration()
        self.sv, self.sd = _Scale(), _Scale()  # observed / start-up verify and draft times
        self.book = 0.0  # seconds of bookkeeping per cycle, observed
        self.d_seen = 0.0  # seconds per draft, observed (for drafters with no measured d)
        self.state = "dflash"  # "dflash" | "fallback"
        self.probing = False  # this cycle is a re-probe from fallback
        self.below = 0  # consecutive cycles whose recent speedup < 1
        self._rt = self._rc = None  # running means of tokens and cost per cycle
        self.backoff = self.BACKOFF0
        self.wait = 0
        self.fallbacks = 0
        self.probes = 0
        self.widths: Dict[int, int] = {}  # verify width -> cycles
        self._dw: Optional[int] = None  # draft width of the current cycle (None: plain)
        self._conf = None  # this cycle's per-draft confidences (Proposal.conf)
        self._refresh()

    # -- the cost model ----------------------------------------------------------
    def _refresh(self) -> None:
        """Seconds per verify width (never cheaper than a narrower one: timing
        noise must not make width look free) and per draft width, as now scaled."""
        t1, sv, sd = self.costs.t1, self.sv.value, self.sd.value
        self._v, run = [0.0], 0.0
        for w in range(1, self.max_width + 1):
            run = max(run, self.costs.c[w] * t1 * sv)
            self._v.append(run)
        # a drafter whose cost was not measured (d = 0): its observed time, any width
        self._d = [0.0, 0.0] + [self.costs.d[w] * t1 * sd or self.d_seen for w in range(2, self.max_width + 1)]

    def verify_cost(self, w: int) -> float:
        return self._v[w]

    def draft_cost(self, w: int) -> float:
        return self._d[w]

    def cost(self, draft_width: int, n: int) -> float:
        """Seconds of a cycle that drafts `draft_width` positions and verifies n drafts."""
        return self._d[draft_width] + self._v[n + 1] + self.book

    @staticmethod
    def expected(a: List[float]) -> List[float]:
        """E[emitted] when verifying the first n drafts, n = 0..len(a)."""
        out, run = [1.0], 1.0
        for x in a:
            run *= x
            out.append(out[-1] + run)
        return out

    def speedup(self, e: float, draft_width: int, n: int) -> float:
        """Expected tokens/s relative to plain decoding (pipelined, when measured)."""
        base = self.costs.t_plain * self.sv.value if self.costs.t_plain else self.cost(1, 0)
        return e / self.cost(draft_width, n) * base

    def plan(self, p=None):
        """(draft width, expected speedup) from the per-position estimates."""
        if self.max_width < 2:
            return 1, 1.0
        e = self.expected(self.p if p is None else p)
        return max(((w, self.speedup(e[w - 1], w, w - 1)) for w in range(2, self.max_width + 1)),
                   key=lambda x: x[1])

    def realized(self, cyc) -> float:
        """Recent tokens per second (accepted + bonus over modelled cycle cost),
        relative to plain decoding."""
        tok, cost = cyc.accepted + 1, self.cost(self._dw or 1, cyc.width - 1)
        if self._rt is None:  # start from the plan's expectation: a few hard first tokens
            w = self.plan()[0]  # are no evidence that drafting does not pay
            self._rt, self._rc = self.expected(self.p)[w - 1], self.cost(w, w - 1)
        self._rt += self.RATE_ALPHA * (tok - self._rt)
        self._rc += self.RATE_ALPHA * (cost - self._rc)
        return self._rt / self._rc * self.cost(1, 0)

    # -- the interface -----------------------------------------------------------
    def decide(self, rows) -> Decision:
        """A set of one (verify mode adaptive runs alone)."""
        if self.state == "fallback" and self.wait > 0:
            self._dw, self._conf = None, None
            return Decision.plain(rows, self.wait)
        return Decision((min(self.width(), rows[0].left + 1),), (DFLASH,))

    def width(self) -> int:
        self._dw, self._conf = None, None
        if self.state == "fallback" and self.wait > 0:
            return 1
        if self.state == "fallback":  # re-probe, verifying every draft, at a fresh policy's width
            self.probing = True
            return self.plan([self.prior] * self.max_width)[0]
        return self.plan()[0]

    def _acceptance(self, conf, n: int) -> List[float]:
        """Calibrated acceptance of the first n drafts (per-position rates without conf)."""
        if conf:
            return [self.calib(float(x)) for x in conf[:n]]
        return self.p[:n]

    def best_cut(self, conf, n_drafts: int, draft_width: int):
        """(n, expected speedup): the number of drafts to verify that maximises
        E[emitted] / cost, given the draft cost already paid."""
        e = self.expected(self._acceptance(conf, n_drafts))
        n = max(range(n_drafts + 1), key=lambda i: (e[i] / self.cost(draft_width, i), i))
        return n, self.speedup(e[n], draft_width, n)

    def trim(self, row: Row, tokens: list, conf: list) -> int:
        """How many of the drafts to verify (all of them when probing)."""
        self._dw, self._conf = len(tokens) + 1, conf
        return len(tokens) if self.probing else self.best_cut(conf, len(tokens), self._dw)[0]

    def observe(self, rows, results) -> None:
        cyc = results[0]
        conf = cyc.conf
        n = cyc.width - 1  # drafts verified
        self.widths[cyc.width] = self.widths.get(cyc.width, 0) + 1
        alpha = self.ALPHA_PROBE if self.probing else self.ALPHA
        # Evidence: the accepted drafts and the first rejected one. Drafts cut
        # before the verify move p towards their calibrated estimate, so the
        # width plan does not keep a stale optimism about positions never verified.
        self.calib.step()
        tested = min(cyc.accepted + 1, n)
        for k in range(1, tested + 1):
            hit = k <= cyc.accepted
            self.p[k - 1] += alpha * (hit - self.p[k - 1])
            if conf and k <= len(conf):
                self.calib.update(float(conf[k - 1]), hit)
        if self._conf and n == cyc.accepted:  # all verified drafts accepted: the cut ones are unknown
            for k in range(n + 1, min(len(self._conf), self.max_width - 1) + 1):
                self.p[k - 1] += alpha * (self.calib(float(self._conf[k - 1])) - self.p[k - 1])
        if self.online:
            c = self.costs
            self.sv.update(cyc.t_verify, c.c[cyc.width] * c.t1)
            if self._dw is not None:
                td = cyc.t_draft
                if not self.sd.update(td, c.d[self._dw] * c.t1):
                    self.d_seen += 0.2 * (td - self.d_seen)
            self.book += 0.1 * (cyc.t_book - self.book)
            self._refresh()
        if self._dw is None:  # a plain step: fallback's wait, or the token read out after a probe
            if self.state == "fallback":  # was decided (the engine asks between two tokens)
                self.wait = max(0, self.wait - 1)
            return
        if self.probing:  # judge the probe with its own evidence included
            self.probing = False
            self.probes += 1
            s = self.plan()[1]
            if self._conf:
                s = min(s, self.best_cut(self._conf, len(self._conf), self._dw)[1])
            if s >= 1.0:
                self.state, self.below, self.backoff, self._rt = "dflash", 0, self.BACKOFF0, None
            else:  # still not worth it: wait twice as long before the next probe
                self.backoff = min(2 * self.backoff, self.BACKOFF_MAX)
                self.wait = self.backoff
            return
        # break-even on what recent cycles really emitted per unit of cost: one
        # cycle whose drafts all look doubtful is no reason to stop drafting
        self.below = self.below + 1 if self.realized(cyc) < 1.0 else 0
        if self.below >= self.PATIENCE:
            self.state, self.wait, self.below = "fallback", self.backoff, 0
            self.fallbacks += 1

    def reason(self, row: Row = None) -> str:
        if self.state == "fallback":
            return f"adaptive: plain, drafting did not pay (probe in {self.wait})"
        return f"adaptive: drafting, width {self.plan()[0]}"

    def summary(self, row: Row = None) -> dict:
        """For the stats (cheap: called every cycle)."""
        return {"state": self.state, "fallbacks": self.fallbacks, "probes": self.probes,
                "widths": dict(self.widths)}

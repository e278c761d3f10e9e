"""Speculation policies: pure functions of numbers (costs, live acceptance,
timings) -> draft at width w, or run plain steps. No model in here; the decode
loop (generate.py) hands each policy what it measured, calibrate.py supplies
the costs.

- `Fixed`: always width w (an explicit block size).
- `Guard`: the default mode (verify mode `dflash`, default width): drafts at
  width w while tau / k(w) >= 1, where k(w) is a cycle's calibrated cost in
  plain tokens and tau the live acceptance, else runs plain decoding,
  re-probing after 64, 128, ... 1024 plain tokens. Reversible, and it says why
  (`reason`).
- `AdaptiveWidth`: verify mode `adaptive`, per-cycle width and cut from the
  measured cost curve c(w), d(w) and the drafts' confidences:

      E[emitted | verify n drafts] = 1 + sum_{k=1..n} prod_{i<=k} a_i
      cost(draft width W, n)       = c(n + 1) + d(W)          (in 1-token target steps)

  a_i, the chance that draft i is accepted given drafts < i were, comes from
  the selector's path score of the draft (DFlash 1: the drafter's probability),
  calibrated by recent acceptance. When recent cycles emit fewer tokens per unit
  of cost than plain decoding would, it falls back to plain steps and re-probes
  after 8, 16, 32 (at most 64) of them."""

from __future__ import annotations

from typing import Dict, List, Optional

from .calibrate import Costs, Observed


class Fixed:
    """Verify width w on every cycle: what the user set, exactly."""

    def __init__(self, width: int):
        self.w = width
        self.reason = f"fixed width {width}"

    def plain_steps(self) -> int:
        return 0

    def width(self) -> int:
        return self.w

    def observe(self, tokens: int) -> None:
        pass

    def observe_plain(self, steps: int) -> None:
        pass


class _Ema:
    """Running mean that starts at its first value; one outlier (a page fault,
    another process) moves it by a bounded step."""

    def __init__(self, alpha: float, value: Optional[float] = None):
        self.alpha, self.value = alpha, value

    def update(self, x: float, alpha: Optional[float] = None) -> None:
        if self.value is None:
            self.value = x
            return
        x = min(max(x, self.value / 4), self.value * 4)
        self.value += (alpha or self.alpha) * (x - self.value)


class Guard:
    """Never slower than plain decoding, by prediction from calibrated costs.

    Predicted speedup = tau / k: tau = tokens per draft + verify cycle (live
    acceptance), k = a cycle's cost in plain tokens, (c(w) + d(w)) * t1 /
    t_plain, from the calibrated curve (calibrate.py: ratios measured within a
    round, so the machine's load drift cancels; live wall times on a shared
    machine do not). States:

    - probe: drafting on trial (a fresh start, or after a plain run). tau is the
      probe's own mean with two pseudo-cycles halfway between break-even and
      the width, judged after every cycle: on a text that does not draft well
      the probe costs one to three cycles; PROBE cycles that pay by MARGIN (10%) switch to draft.
    - draft: tau is a running mean; below break-even -> plain.
    - plain: `wait` plain tokens (64, 128, ... 1024, doubling per failed probe), then probe.

    The loop asks `plain_steps()` (> 0: run that many plain tokens, pipelined)
    and otherwise drafts at `width()`; it reports back with `observe(tokens)`
    (accepted + 1) and `observe_plain(steps)`."""

    PROBE = 3  # cycles that end a probe that pays
    MARGIN = 1.1  # a probe must predict this much to switch to drafting (k itself is measured, with noise)
    BACKOFF0, BACKOFF_MAX = 64, 1024  # plain tokens before the next probe
    ALPHA_TAU = 0.15

    def __init__(self, width: int, costs: Costs, prior: Optional[Observed] = None):
        self.w = width
        self.k = (costs.c[width] + costs.d.get(width, 0.0)) * costs.t1 / (costs.t_plain or costs.t1)
        prior = prior or Observed()
        self.tau = _Ema(self.ALPHA_TAU, prior.tau.get(width))
        self.backoff = prior.backoff or self.BACKOFF0
        self.state = "probe"  # "probe" | "draft" | "plain"
        self.trial = []  # tokens of this probe's cycles
        self.wait = 0  # plain tokens due
        self.fallbacks = self.probes = 0
        if self.ceiling() < 1.0:  # not even every draft accepted would pay
            self._to_plain(self.BACKOFF_MAX)
        elif prior.wait:  # the last request on these objects ended plain: so does this one begin
            self._to_plain(prior.wait)
        elif self.tau.value is not None and self.tau.value >= self.k:  # it was drafting, and paying
            self.state = "draft"
        self.reason = self._reason()

    # -- the prediction --------------------------------------------------------
    def _tau(self) -> Optional[float]:
        if self.state == "probe":
            prior = (self.k + self.w) / 2
            return (2 * prior + sum(self.trial)) / (2 + len(self.trial)) if self.trial else None
        return self.tau.value

    def speedup(self) -> Optional[float]:
        t = self._tau()
        return None if t is None else t / self.k

    def ceiling(self) -> float:
        return self.w / self.k

    def _reason(self) -> str:
        s, tau = self.speedup(), self._tau()
        if self.ceiling() < 1.0:
            return f"plain: width {self.w} cannot pay here (a cycle costs {self.k:.2f} plain tokens)"
        why = f"{s:.2f}x predicted (tau {tau:.2f}, cycle = {self.k:.2f} plain tokens)" if s is not None else ""
        if self.state == "plain":
            last = self.tau.value
            s = None if last is None else last / self.k
            return (f"plain: DFlash {s:.2f}x predicted (tau {last:.2f}, cycle = {self.k:.2f} plain tokens); "
                    f"probe in {self.wait}") if s is not None else f"plain: probe in {self.wait}"
        if self.state == "probe":
            return f"dflash: probing, {why}" if s is not None else f"dflash: probing (cycle = {self.k:.2f} plain tokens)"
        return f"dflash: {why}"

    def _to_plain(self, n: int) -> None:
        self.state, self.wait, self.trial = "plain", n, []

    # -- the hooks -----------------------------------------------------------------
    def plain_steps(self) -> int:
        return self.wait if self.state == "plain" else 0

    def width(self) -> int:
        return self.w

    def observe(self, tokens: int) -> None:
        """One draft + verify cycle emitted `tokens` (accepted + 1)."""
        if self.state == "probe":
            self.trial.append(tokens)
            s = self.speedup()
            seen = sum(self.trial) / len(self.trial)  # what the probe saw, without the prior
            if s < 1.0 or (len(self.trial) >= self.PROBE and s < self.MARGIN):
                self.tau.value = seen
                self._fall_back()
            elif len(self.trial) >= self.PROBE:
                self.tau.value, self.state, self.trial = max(seen, self.k), "draft", []
                self.backoff = self.BACKOFF0  # drafting pays: a later fallback probes again soon
        elif self.state == "draft":
            self.tau.update(tokens)
            if self.speedup() < 1.0:
                self._fall_back()
        self.reason = self._reason()

    def observe_plain(self, steps: int) -> None:
        """A run of `steps` plain tokens ended."""
        self.wait = max(0, self.wait - max(steps, 0))
        if self.state == "plain" and self.wait == 0:
            self.state, self.trial = "probe", []
            self.probes += 1
        self.reason = self._reason()

    def _fall_back(self) -> None:
        self.fallbacks += 1
        self._to_plain(self.backoff)
        self.backoff = min(2 * self.backoff, self.BACKOFF_MAX)

    def observed(self) -> Observed:
        """What to carry to the next request (calibrate.save_observed)."""
        o = Observed(backoff=self.backoff)
        if self.tau.value is not None:
            o.tau[self.w] = self.tau.value
        o.wait = self.wait if self.state == "plain" and self.ceiling() >= 1.0 else 0
        return o

    def summary(self) -> dict:
        return {"state": self.state, "fallbacks": self.fallbacks, "probes": self.probes,
                "speedup": self.speedup(), "cycle_cost": self.k, "tau": self._tau()}


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


class AdaptiveWidth:
    """Per-cycle verify width for `stream_generate(verify_mode="adaptive")`.

    The decode loop calls `width()` before drafting, `cut(proposal)` after, and
    `observe(cycle_stats, conf)` after the verify."""

    PATIENCE = 4  # cycles below break-even before falling back to plain steps
    BACKOFF0, BACKOFF_MAX = 8, 64  # plain steps before the next re-probe (a probe costs ~1 step)
    ALPHA, ALPHA_PROBE = 0.1, 0.5  # acceptance running-mean rates (a probe counts more)
    RATE_ALPHA = 0.05  # realized-speedup running mean: ~20 cycles, so luck does not trigger a fallback

    def __init__(self, costs: Costs, max_width: int, *, prior: float = 0.7, online: bool = True):
        if not 1 <= max_width <= costs.max_width:
            raise ValueError(f"max_width {max_width} outside the measured cost curve 1..{costs.max_width}")
        self.costs = costs
        self.max_width = max_width
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

    # -- the hooks ---------------------------------------------------------------
    def plain_steps(self) -> int:
        """Plain steps due before the next re-probe (0 when drafting): the loop
        runs them as one pipelined burst, observing each."""
        if self.state == "fallback" and self.wait > 0:
            self._dw, self._conf = None, None  # what width() does for a plain step
            return self.wait
        return 0

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

    def cut(self, prop) -> int:
        """How many of the drafts to verify (all of them when probing)."""
        drafts = prop.tokens
        self._dw, self._conf = len(drafts) + 1, prop.conf
        return len(drafts) if self.probing else self.best_cut(prop.conf, len(drafts), self._dw)[0]

    def observe(self, cyc, conf=None) -> None:
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
                td = cyc.t_draft + cyc.t_select
                if not self.sd.update(td, c.d[self._dw] * c.t1):
                    self.d_seen += 0.2 * (td - self.d_seen)
            self.book += 0.1 * (cyc.t_book - self.book)
            self._refresh()
        if self.state == "fallback" and not self.probing:
            self.wait -= 1
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

    @property
    def reason(self) -> str:
        if self.state == "fallback":
            return f"adaptive: plain, drafting did not pay (probe in {self.wait})"
        return f"adaptive: drafting, width {self.plan()[0]}"

    def summary(self) -> dict:
        """For the stats (cheap: called every cycle)."""
        return {"state": self.state, "fallbacks": self.fallbacks, "probes": self.probes,
                "widths": dict(self.widths)}

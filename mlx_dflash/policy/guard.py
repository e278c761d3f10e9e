"""Speculation policies behind one declared interface, and the registry from
verify mode to policy.

Each cycle the decode session (decoder.py) asks its policy `next(state)` and
gets `Plain(n)` (decode n tokens plainly, then ask again; asked again after
each of them) or `Draft(width, source)` (draft from `source`, verify `width`
rows); after every cycle or plain token it reports `observe(CycleResult)`.
Policies are pure: numbers in (costs, live acceptance, what a draft source
offers now), decisions out; no model in here.

- `Fixed`: always width w from the DFlash drafter (an explicit block size).
- `Guard`: the default mode (verify mode `dflash`, default width): drafts at
  width w while tau / k(w) >= 1, where k(w) is a cycle's calibrated cost in
  plain tokens and tau the live acceptance, else runs plain decoding,
  re-probing after 64, 128, ... 1024 plain tokens. Reversible, and it says why
  (`reason`). Inside it, prompt lookup (lookup.py): whenever the context ends
  in an n-gram seen before, its continuation is verified as free drafts if
  1 + alpha * n >= 1.1 k_lookup(n + 1) + 0.5 (alpha: the live share of lookup
  drafts accepted; k_lookup: the verify alone, in plain tokens), in any state,
  plain included.
- `LookupFirst`: verify mode `lookup`, prompt-lookup drafts at a fixed width
  (with a drafter: DFlash where the context has no full-width match).
- `PlainOnly`: verify mode `off`.
- `AdaptiveWidth` (adaptive.py): verify mode `adaptive`.

A new verify mode is one `Policy` subclass and one `POLICIES` line."""

from __future__ import annotations

from typing import Dict, List, Optional

from .base import DFLASH, LOOKUP, CycleResult, Draft, LoopState, Plain, Policy
from .costs import Costs, Observed, interpolate


def _seconds(costs: Costs, ws: List[int]):
    """(context, {w: seconds of a cycle at width w}, seconds per plain token) of a curve;
    a wider verify or draft is never cheaper: timing noise must not make a width look free."""
    c, d = monotone([interpolate(costs.c, x) for x in ws]), monotone([interpolate(costs.d, x) for x in ws])
    return costs.context, {x: (cx + dx) * costs.t1 for x, cx, dx in zip(ws, c, d)}, costs.t_plain or costs.t1


def monotone(ys: List[float]) -> List[float]:
    """The closest non-decreasing sequence (least squares: pool adjacent violators)."""
    blocks = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return [s / n for s, n in blocks for _ in range(n)]


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


class Guard(Policy):
    """Never slower than plain decoding, by prediction from calibrated costs,
    and at the width that pays best.

    Predicted speedup at width w = tau(w) / k(w): tau(w) = tokens per draft +
    verify cycle at w (live acceptance), k(w) = a cycle's cost in plain tokens,
    (c(w) + d(w)) * t1 / t_plain, from the calibrated curve (calibrate.py:
    ratios measured within a round, so the machine's load drift cancels; live
    wall times on a shared machine do not). With costs measured at one width
    (besides 1), tau is a running mean of the tokens per cycle; with several,
    tau(w) = 1 + sum_k prod_{i<=k} p_i from per-position acceptance estimates
    p_i, and each cycle drafts at the w (up to `width`) that maximises tau(w) / k(w).
    States:

    - probe: drafting on trial (a fresh start, or after a plain run). The
      estimates start from two pseudo-cycles halfway between break-even and
      the widest width, judged after every cycle: on a text that does not draft
      well the probe costs one to three cycles; PROBE cycles that pay by MARGIN
      (10%) switch to draft.
    - draft: running means; below break-even -> plain.
    - plain: `wait` plain tokens (64, 128, ... 1024, doubling per failed probe), then probe.

    `next(state)` says Plain(wait) in the plain state, else Draft at the best
    width, unless the lookup gate takes what the context repeats; `observe`
    takes draft cycles, lookup cycles and plain tokens alike."""

    PROBE = 3  # cycles that end a probe that pays
    MARGIN = 1.1  # a probe must predict this much to switch to drafting (k itself is measured, with noise)
    BACKOFF0, BACKOFF_MAX = 64, 1024  # plain tokens before the next probe
    # DFlash is never tried where even a drafter accepting 90% of drafts per position
    # could not pay: tau(w) / w <= 0.82 at w = 5 for such a drafter, so a cycle must
    # cost at most 0.8 w plain tokens (ceiling w / k >= 1.25) to be worth a probe
    CEILING_MIN = 1.25
    ALPHA_TAU = 0.15
    PSEUDO = 2  # pseudo-cycles of the probe's prior

    def __init__(self, width: int, costs: Costs, prior: Optional[Observed] = None, lookup: bool = False,
                 long: Optional[Costs] = None, context: int = 0):
        self.w = self.widest = width  # the widest width it drafts at
        prior = prior or Observed()
        self.lookup = LookupGate(costs, width, prior.lookup_alpha) if lookup else None  # prompt-lookup drafts, gated
        self.ws = sorted({x for x in costs.c if 2 <= x <= width} | {width})
        # seconds per cycle at each width and per plain token, at each measured context
        # length: linear in the length between (and past) them, as attention's reads are
        self.curves = [_seconds(cv, self.ws) for cv in ([costs] + ([long] if long is not None else []))
                       if cv is not None]
        self.curves = sorted({cv[0]: cv for cv in self.curves}.values())
        self.at = None  # the context length the costs below are for
        self.set_context(context or costs.context)
        self.multi = len(self.ws) > 1  # choose the width (else: drafts at `width`, tau a running mean)
        self.tau = _Ema(self.ALPHA_TAU, prior.tau.get(width))
        self.p: Optional[List[float]] = None  # per-position acceptance (multi)
        if self.multi and prior.p and len(prior.p) >= width - 1:
            self.p = list(prior.p[: width - 1])
        self.backoff = prior.backoff or self.BACKOFF0
        self.state = "probe"  # "probe" | "draft" | "plain"
        self.trial = []  # tokens of this probe's cycles (one width)
        self.counts = None  # per position [hits, tries] of this probe's cycles (multi)
        self.wait = 0  # plain tokens due
        self.fallbacks = self.probes = 0
        self.widths: Dict[int, int] = {}  # width -> DFlash cycles
        # at the request's length: then plain (and lookup) for good
        self.hopeless = self.ceiling() < self.CEILING_MIN
        self.uses_drafter, self.uses_lookup = not self.hopeless, self.lookup is not None
        if self.hopeless:
            self._to_plain(self.BACKOFF_MAX)
        elif prior.wait:  # the last request on these objects ended plain: so does this one begin
            self._to_plain(prior.wait)
        elif self._was_paying():  # it was drafting, and paying
            self.state = "draft"
        if self.state == "probe":
            self._start_probe()
        self.reason = self._reason()

    def set_context(self, n: int) -> None:
        """The cycle costs k(w) in plain tokens with `n` tokens cached."""
        if self.at is not None and abs(n - self.at) <= max(64, self.at // 8):
            return  # (costs move slowly with the length)
        self.at = n
        if len(self.curves) == 1:
            _, cyc, plain = self.curves[0]
        else:
            (l0, c0, p0), (l1, c1, p1) = self.curves[0], self.curves[-1]
            f = (n - l0) / (l1 - l0)
            cyc = {x: max(c0[x] + f * (c1[x] - c0[x]), 1e-9) for x in self.ws}
            plain = max(p0 + f * (p1 - p0), 1e-9)
        self.kw = {x: cyc[x] / plain for x in self.ws}
        self.k = self.kw[self.w]
        self.p_mid = _p_mid(self.k, self.w)  # the probe's prior moves with k

    def _was_paying(self) -> bool:
        if self.multi:
            return self.p is not None and self.best(self.p)[1] >= 1.0
        return self.tau.value is not None and self.tau.value >= self.k

    # -- the prediction --------------------------------------------------------
    @staticmethod
    def expected(p: List[float], w: int) -> float:
        """Tokens per cycle at width w: 1 + sum_k prod_{i<=k} p_i over w - 1 drafts."""
        out, run = 1.0, 1.0
        for x in p[: w - 1]:
            run *= x
            out += run
        return out

    def best(self, p: List[float]):
        """(width, predicted speedup) that maximises tau(w) / k(w)."""
        return max(((x, self.expected(p, x) / k) for x, k in self.kw.items()), key=lambda ws: (ws[1], -ws[0]))

    def _probe_p(self) -> List[float]:
        pm = self.p_mid
        return [(self.PSEUDO * pm + h) / (self.PSEUDO + n) for h, n in self.counts]

    def _estimate(self):
        """(width, tau at it) as now predicted, or (width, None) before any evidence."""
        if self.multi:
            if self.state == "probe":
                p = self._probe_p()
                x = self.best(p)[0]
                return x, self.expected(p, x)
            if self.p is None:
                return self.w, None
            x = self.best(self.p)[0]
            return x, self.expected(self.p, x)
        if self.state == "probe":
            prior = (self.k + self.w) / 2
            return self.w, ((self.PSEUDO * prior + sum(self.trial)) / (self.PSEUDO + len(self.trial))
                            if self.trial else None)
        return self.w, self.tau.value

    def _tau(self) -> Optional[float]:
        return self._estimate()[1]

    def width(self) -> int:
        return self._estimate()[0]

    def speedup(self) -> Optional[float]:
        x, t = self._estimate()
        return None if t is None else t / self.kw[x]

    def ceiling(self) -> float:
        return max(x / k for x, k in self.kw.items())

    def _reason(self) -> str:
        return self._dflash_reason() + (self.lookup.tail() if self.lookup is not None else "")

    def _dflash_reason(self) -> str:
        if self.hopeless:
            return f"plain: width {self.w} cannot pay here (a cycle costs {self.k:.2f} plain tokens)"
        x, tau = self._estimate()
        s = self.speedup()
        at = f"width {x}, " if self.multi else ""
        why = f"{s:.2f}x predicted ({at}tau {tau:.2f}, cycle = {self.kw[x]:.2f} plain tokens)" if s is not None else ""
        if self.state == "plain":
            return f"plain: DFlash {why}; probe in {self.wait}" if s is not None else f"plain: probe in {self.wait}"
        if self.state == "probe":
            return f"dflash: probing, {why}" if s is not None else f"dflash: probing (cycle = {self.k:.2f} plain tokens)"
        return f"dflash: {why}"

    def _to_plain(self, n: int) -> None:
        self.state, self.wait, self.trial, self.counts = "plain", n, [], None

    def _start_probe(self) -> None:
        self.state, self.trial = "probe", []
        self.counts = [[0, 0] for _ in range(self.w - 1)]

    # -- the interface ------------------------------------------------------------
    def next(self, state: LoopState):
        if state.context:
            self.set_context(state.context)
        if self.lookup is not None:  # the context repeats itself: verify its continuation if it pays
            n = state.offers(LOOKUP, min(self.w, state.left + 1) - 1)
            if n and self.lookup.take(n):
                return Draft(n + 1, LOOKUP)
        return Plain(self.wait) if self.state == "plain" else Draft(self.width(), DFLASH)

    def observe(self, result: CycleResult) -> None:
        if result.source == LOOKUP:  # DFlash's own acceptance and state are untouched
            self.lookup.observe(result.accepted, result.width - 1)
        elif result.width == 1:
            self._plain_token()
        elif self.multi:
            self._cycle_at(result.width - 1, result.accepted)
        else:
            self._cycle(result.accepted + 1)
        self.reason = self._reason()

    def _cycle(self, tokens: int) -> None:
        """One draft + verify cycle (one width) emitted `tokens` (accepted + 1)."""
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

    def _cycle_at(self, n: int, a: int) -> None:
        """One cycle verified n drafts and accepted a: evidence on positions 1..min(a + 1, n)."""
        self.widths[n + 1] = self.widths.get(n + 1, 0) + 1
        tested = range(min(a + 1, n))
        if self.state == "probe":
            if self.counts is None:
                self._start_probe()
            for i in tested:
                self.counts[i][0] += i < a
                self.counts[i][1] += 1
            self.trial.append(a + 1)
            s = self.speedup()
            if s < 1.0 or (len(self.trial) >= self.PROBE and s < self.MARGIN):
                self.p = self._probe_p()
                self._fall_back()
            elif len(self.trial) >= self.PROBE:
                self.p, self.state, self.trial, self.counts = self._probe_p(), "draft", [], None
                self.backoff = self.BACKOFF0  # drafting pays: a later fallback probes again soon
        elif self.state == "draft":
            for i in tested:
                self.p[i] += self.ALPHA_TAU * ((i < a) - self.p[i])
            if self.speedup() < 1.0:
                self._fall_back()

    def _plain_token(self) -> None:
        self.wait = max(0, self.wait - 1)
        if self.hopeless:
            self.wait = self.wait or self.BACKOFF_MAX
        elif self.state == "plain" and self.wait == 0:
            self._start_probe()
            self.probes += 1

    def _fall_back(self) -> None:
        self.fallbacks += 1
        self._to_plain(self.backoff)
        self.backoff = min(2 * self.backoff, self.BACKOFF_MAX)

    def observed(self) -> Observed:
        """What to carry to the next request (Calibration.keep)."""
        o = Observed(backoff=self.backoff)
        if self.tau.value is not None:
            o.tau[self.w] = self.tau.value
        o.p = list(self.p) if self.p is not None else None
        o.wait = self.wait if self.state == "plain" and not self.hopeless else 0
        o.lookup_alpha = self.lookup.alpha if self.lookup is not None else None
        return o

    def summary(self) -> dict:
        return {"state": self.state, "fallbacks": self.fallbacks, "probes": self.probes,
                "speedup": self.speedup(), "cycle_cost": self.k, "tau": self._tau(), "widths": dict(self.widths)}


def _p_mid(k: float, w: int) -> float:
    """The constant per-position acceptance whose tau at width w is halfway between
    break-even (k) and w: the probe's prior (by bisection)."""
    want, lo, hi = (k + w) / 2, 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if Guard.expected([mid] * (w - 1), w) < want else (lo, mid)
    return (lo + hi) / 2


class LookupGate:
    """The guard's prompt-lookup gate. A lookup proposal of n drafts costs a
    verify of n + 1 rows and nothing to draft; it pays when the expected tokens
    1 + alpha * n reach that cost in plain tokens, by MARGIN, plus SWITCH (the
    plain run it cuts short drains its pipeline and starts a new one). alpha
    starts at ALPHA0 and follows the live acceptance; while lookup does not pay,
    every GAP-th match is verified anyway, so a text that starts repeating
    itself is noticed. The batch engine keeps one per row (batch_policy.py,
    costs None: the batch prices its cycles itself)."""

    ALPHA0, RATE, GAP = 0.5, 0.2, 16
    MARGIN, SWITCH = 1.1, 0.5  # measured: bf16 on mlx-cpu, where a verify of 5 costs ~2.6 plain
    # tokens, lookup at 40% acceptance cost 3-5% without them

    def __init__(self, costs: Optional[Costs], width: int, alpha: Optional[float] = None):
        self.w, self.skipped, self.cycles = width, 0, 0
        self.alpha = self.ALPHA0 if alpha is None else alpha  # the last request's, when there was one
        scale = costs.t1 / (costs.t_plain or costs.t1) if costs is not None else 0.0
        self.k = {w: interpolate(costs.c, w) * scale for w in range(2, width + 1)} if costs is not None else {}

    def tokens(self, n: int) -> float:
        """Expected tokens of a cycle verifying n lookup drafts (the bonus included)."""
        return 1 + self.alpha * n

    def tail(self) -> str:
        """Its part of a policy's reason."""
        return f"; lookup: {self.cycles} cycles, {self.alpha:.0%} accepted" if self.cycles else ""

    def pays(self, n: int) -> bool:
        n = min(n, self.w - 1)
        return n >= 1 and 1 + self.alpha * n >= self.MARGIN * self.k[n + 1] + self.SWITCH

    def take(self, n: int) -> bool:
        """Verify this n-draft proposal? (Counts the skips of a gate that does not pay.)"""
        if n < 1:
            return False
        return self.pays(n) or self.skip()

    def skip(self) -> bool:
        """A match not verified; True on every GAP-th (verify it anyway)."""
        self.skipped += 1
        if self.skipped >= self.GAP:
            self.skipped = 0
            return True
        return False

    def observe(self, accepted: int, n: int) -> None:
        self.cycles += 1
        self.alpha += self.RATE * (accepted / n - self.alpha)

"""The guard: the default policy (verify mode `dflash`, the guard on), for a set
of one sequence or many. Never slower than plain decoding, by prediction from
measured costs, and at the width that pays best.

A cycle of width w with B rows of L tokens costs k(w, B, L) plain steps
(costs.CostModel: measured curves by context length and batch size). A row
drafting from the drafter emits tau_b(w) = 1 + sum_k prod_{i<=k} p_b,i tokens
per cycle, from its per-position acceptance estimates p_b; the set's predicted
speedup at w is mean_b tau_b(w) / k(w, B, L), and each cycle drafts at the w
that maximises it. States (of the set):

- probe: drafting on trial (a fresh start, or after a plain run), started only
  where the rows' room left could repay its worst case PAYBACK times over (its
  cycles, and the drafter's catch-up: its first draft takes in every context
  row captured since the drafter's last one, a whole prompt's window at a
  request's start), at
  the widest width up to the predicted one where it can (short answers probe
  narrower; a few tokens left, or a dear cycle: many rows, a long context, do
  not probe, and the plain steps they wait count as room for the next probe,
  so short answers one after another still probe now and then). It starts each
  row's evidence afresh and is judged after every
  cycle: on text that does not draft well a probe costs one to three cycles;
  PROBE cycles that pay by MARGIN switch to draft.
- draft: the evidence goes on, fading by 1 - ALPHA per cycle; below
  break-even -> plain.
- plain: `wait` plain steps (64, 128, ... 1024, doubling per failed probe),
  then probe. Where even a drafter right 90% of the time could not pay (the
  ceiling w / k(w) below CEILING_MIN at this B and L) DFlash is not tried.
- an answer's last block, in any state: no wider than the tokens left of the
  answer (a row past them yields nothing), and drafted only where the width it
  is cut to still pays; else plain, as its last token always is.

A row's estimate at a position is its hits over its tries there, shrunk
(PSEUDO pseudo-tries) toward the row's pooled rate over every position tried,
which is shrunk (POOL pseudo-tries) toward p_mid: the constant acceptance whose
tau at the widest width is halfway between break-even and that width. So one
bad cycle does not end a probe, the positions a narrow width never reaches are
priced from the ones it does (never held at a stale value, nor at an optimism
the evidence belies: a drafter right half the time is not probed for long), and
a wider width is still tried now and then (bench/guard_sim: the width chosen
against the best fixed one, under many acceptance laws and cost curves).

Prompt lookup (drafting/lookup.py), per row: whenever a row's context ends in
an n-gram seen before, its continuation is verified as free drafts if
1 + alpha * n >= MARGIN * k_verify(n + 1) + SWITCH (alpha: the row's live share
of lookup drafts accepted after a match of that length, lookup_gate.py; k_verify:
the verify alone) while the set steps plainly, and while it drafts if it yields
more per unit of time than the DFlash cycle it replaces: (1 + alpha * n) /
k_verify(n + 1) > tau_b(w) / k(w). While it does not pay, a match is verified
anyway now and then (every GAP x k_verify-th, times the DFlash rate it
displaces: about 1/GAP of the time at any length).

Prices as paid: the curves are measured apart from the requests (a set of
one through the engine's own steps; several rows as bare forwards), so a set
also times its own steps (CycleResult.t_step) and, where its cycles take longer
than k(w) x its plain step, adds the median excess (in plain steps) to every
price at that set size; what was paid carries to the next request
(Observed.paid). An excess, not a ratio: what the curves miss is work per
cycle (host work, syncs, the drafter's context update), not a share of it
(bench/guard_sim/README.md: on the realistic bench, cycles of widths 5 and 8
took about the same 0.15-0.6 plain steps beyond their price, width 16 less,
while the ratio fell with the width), and a ratio learned at a wide width
prices a narrow one below what it costs. The unit is the set's own plain step:
a set that drafts from its first cycle has none timed, so it steps plainly
once (three steps, once per set size) to learn what its cycles pay.

Unpriced (the engine defers measuring and a curve this set needs, at its
length or its number of rows, is not measured yet): the guarded rows decode
plain, lookup included, until it is; the state and estimates wait as they are.

Rows that do not follow the guard keep their own rule inside the same cycle:
an unguarded width (verify mode dflash with the guard off, or a seeded sampled
row beside others) drafts exactly its width; verify mode lookup drafts lookup
first at its width; verify mode off verifies its anchor alone."""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Union

from .base import DFLASH, LOOKUP, CycleResult, Decision, Plan, Policy, Row
from .costs import CostModel, Observed, Unpriced, median
from .lookup_gate import LookupGate


def expected(p: Sequence[float], w: int) -> float:
    """Tokens per cycle at width w: 1 + sum_k prod_{i<=k} p_i over w - 1 drafts."""
    out, run = 1.0, 1.0
    for x in p[: w - 1]:
        run *= x
        out += run
    return out


@lru_cache(maxsize=256)  # (asked for every row's estimates, every cycle; k changes only with the price)
def p_mid(k: float, w: int) -> float:
    """The constant per-position acceptance whose tau at width w is halfway
    between break-even (k) and w: the probe's prior (by bisection)."""
    want, lo, hi = (k + w) / 2, 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected([mid] * (w - 1), w) < want else (lo, mid)
    return (lo + hi) / 2


class _RowState:
    """A guarded row's evidence: per-position hits and tries, decayed while it
    drafts so that old evidence fades. It starts from the last request's
    (Observed.p and .tries; a prior without its tries counts `weight` tries
    at each position); and its lookup gate."""

    def __init__(self, widest: int, prior: Observed, lookup: bool, weight: float):
        m = widest - 1
        self.carried = bool(prior.p) and len(prior.p) >= m
        if self.carried:
            self.tries = list(prior.tries[:m]) if prior.tries and len(prior.tries) >= m else [float(weight)] * m
            self.hits = [x * n for x, n in zip(prior.p, self.tries)]
        else:
            self.hits, self.tries = [0.0] * m, [0.0] * m
        self.gate = LookupGate(prior.lookup_alpha) if lookup else None
        self.grade = 0  # the grade of its lookup proposal this cycle (LookupGate)

    def forget(self, keep: float) -> None:
        self.hits = [h * keep for h in self.hits]
        self.tries = [n * keep for n in self.tries]

    def reset(self) -> None:
        self.hits = [0.0] * len(self.hits)
        self.tries = [0.0] * len(self.tries)

    @property
    def tried(self) -> bool:
        return any(self.tries)


class Guard(Policy):
    """See the module docstring. `costs`: the model's CostModel, or what makes it
    (measuring: called when a guarded row first needs it, so sets of fixed widths
    and plain rows measure nothing); `prior`: what the last request on the same
    model objects left (Observed)."""

    PROBE = 3  # cycles that end a probe that pays
    # a probe's worst case is PROBE cycles that find nothing (each k(w) plain steps for one token a
    # row); one is started only where the rows' room left repays that PAYBACK times over
    PAYBACK = 8
    MARGIN = 1.1  # a probe must predict this much to switch to drafting (k itself is measured, with noise)
    BACKOFF0, BACKOFF_MAX = 64, 1024  # plain steps before the next probe
    # DFlash is never tried where even a drafter accepting 90% of drafts per position
    # could not pay: tau(w) / w <= 0.82 at w = 5 for such a drafter, so a cycle must
    # cost at most 0.8 w plain steps (ceiling w / k >= 1.25) to be worth a probe
    CEILING_MIN = 1.25
    ALPHA = 0.05  # while drafting, evidence fades by 1 - ALPHA per cycle (about the last 1 / ALPHA cycles count)
    # prices as paid: a set of B rows keeps what its cycles took beyond their price, in plain steps (its
    # cycle's seconds over its plain step's, less k(w); the median of the last PAID_SAMPLES cycles, this
    # request's and those before it (one request times few cycles, and one noisy cycle must not set it), the
    # plain step the median of the last PLAIN_SAMPLES), and where that is more than nothing it is added
    # to every price at B (the costs measured apart miss work per cycle: host work per row, syncs, the
    # drafter's context update)
    PAID_SAMPLES, PLAIN_SAMPLES, PLAIN_MIN = 8, 16, 3  # (PLAIN_MIN: plain steps timed before they are the unit)
    PAID_TRUSTED = 3  # samples behind what was paid before it may end a probe at its first (untimed) cycle
    # the unit of what was paid, the set's timed plain step, is held within this factor of the plain step
    # measured apart: a few steps whose compute was done before they were timed (pipelined) must not set
    # it (one run priced a width-2 cycle at 20.8 plain steps for good, bench/guard_sim/: the unit
    # trap); where the curves are right, timed units read 0.66-1.88x the measured one (unit_bound/)
    UNIT_BOUND = 2.0
    UNTIMED = 3  # cycles drafted before a set with no plain step timed at its size steps plainly to time one
    PSEUDO = 2  # pseudo-tries of a position's prior, the row's pooled rate
    POOL = 8  # pseudo-tries of the pooled rate's prior, p_mid
    CARRIED = 4  # tries a prior given without its evidence (Observed.tries) counts for at each position

    def __init__(self, costs: Union[CostModel, Callable[[], CostModel]], prior: Optional[Observed] = None):
        self._costs = costs
        self._model: Optional[CostModel] = costs if isinstance(costs, CostModel) else None
        self._ws: Optional[List[int]] = None
        self.prior = prior or Observed()
        self.rows: Dict[int, _RowState] = {}
        self.backoff = self.prior.backoff or self.BACKOFF0
        self.state, self.wait, self.trial = "probe", 0, 0
        self.fallbacks = self.probes = 0
        self.widths: Dict[int, int] = {}  # width -> DFlash cycles
        self.kd = self.kv = {1: 1.0}  # k(w) drafting / verify alone, at the last set's B and L (as paid)
        self.catch = 0.0  # plain steps the drafter's catch-up costs per context row, at the last set's B and L
        self.priced = ({1: 1.0}, {1: 1.0})  # the same, as measured
        self.paid = dict(self.prior.paid)  # (B, drafting) -> plain steps a cycle takes beyond its price
        self.plain_s: Dict[int, List[float]] = {}  # B -> the last plain steps' seconds
        self.step_s: Dict[int, float] = {}  # B -> a plain step's seconds as measured apart, at the last set's L
        # (B, drafting) -> the last cycles' plain steps beyond their price (the samples behind paid)
        self.excess: Dict[tuple, List[float]] = {k: list(v) for k, v in self.prior.excess.items()}
        self.unmatched: List[tuple] = []  # ((B, drafting), seconds, k): cycles before B's plain steps were timed
        self.timing = 0  # plain steps taken to time one (_untimed)
        self.last_step: Optional[tuple] = None  # the rows of the last step observed
        self.after_plain = True  # the last step observed was no DFlash cycle (the next one catches the drafter up)
        self.hopeless = False
        self.unpriced: Optional[str] = None  # what the last set's price lacks (not measured yet)
        self.short = False  # the last probe due was not started: the rows' room left could not repay it
        self.deferred = self.prior.deferred  # plain steps since a probe fell due and was refused (short)
        self.probe_w: Optional[int] = None  # the probe under way drafts at most this wide (its worst case repaid)
        self.catch_due = 0.0  # plain steps the drafter's catch-up would have cost the probe last due
        self.est = (0, None, None)  # (width, tau, speedup) as last predicted
        self.started = False
        if self.prior.wait:  # the last request on these objects ended plain: so does this one begin
            self._to_plain(self.prior.wait)

    @property
    def model(self) -> CostModel:
        if self._model is None:
            self._model = self._costs()
        if self._ws is None:
            self._ws = [x for x in self._model.widths if x >= 2]
        return self._model

    @property
    def ws(self) -> List[int]:
        """The widths it chooses among."""
        return self._ws if self._ws is not None else (self.model and self._ws)

    @property
    def w(self) -> int:
        """The widest width it drafts at."""
        return max(self.ws, default=1)

    # -- the prediction --------------------------------------------------------------------
    def _price(self, rows: Sequence[Row]) -> bool:
        """Price this set's cycles; False (why: self.unpriced) while a curve it needs is not measured yet."""
        B, L = len(rows), max((r.context for r in rows), default=0)
        try:
            self.priced = (self.model.k(B, L, True), self.model.k(B, L, False))
            self.step_s[B] = self.model.plain_seconds(B, L)
            self.catch = self.model.catch_up(B, L)
        except Unpriced as e:
            self.unpriced = str(e)
            return False
        self.unpriced = None
        raised = []
        for ks, drafting in zip(self.priced, (True, False)):
            h = max(0.0, self.paid.get((B, drafting), 0.0))  # (never below what was measured)
            raised.append({x: k + h if x > 1 else 1.0 for x, k in ks.items()})
        self.kd, self.kv = raised
        # by the price measured, not as paid: what was paid is learnt only while drafting, and
        # one slow cycle's excess must not stop drafting for good (the probes after a fallback
        # bring what is paid back down, where it was an outlier)
        self.hopeless = not self.ws or max(x / self.priced[0][x] for x in self.ws) < self.CEILING_MIN
        return True

    def _p(self, s: _RowState) -> List[float]:
        """A row's per-position estimates now (see the module docstring). The
        pool's POOL pseudo-tries at p_mid do not fade: a little optimism keeps
        a wider width tried now and then."""
        pm = p_mid(self.kd[self.w], self.w)
        pool = (self.POOL * pm + sum(s.hits)) / (self.POOL + sum(s.tries))
        return [(self.PSEUDO * pool + h) / (self.PSEUDO + n) for h, n in zip(s.hits, s.tries)]

    def best(self, ps: List[List[float]], k: Optional[Dict[int, float]] = None):
        """(width, mean tau, predicted speedup) that maximises mean tau(w) / k(w) (k: kd, as paid)."""
        out, k = (self.w, None, None), k or self.kd
        if not ps:
            return out
        for x in self.ws:
            tau = sum(expected(p, x) for p in ps) / len(ps)
            s = tau / k[x]
            if out[2] is None or s > out[2]:
                out = (x, tau, s)
        return out

    def _guarded(self, rows: Sequence[Row]) -> List[_RowState]:
        return [self.rows[r.uid] for r in rows if r.uid in self.rows]

    # -- the interface ---------------------------------------------------------------------
    def decide(self, rows: Sequence[Row]) -> Decision:
        mine = [r for r in rows if r.plan.guarded]
        priced = bool(mine) and self._price(rows)
        for r in mine if priced else ():
            if r.uid not in self.rows:
                self.rows[r.uid] = _RowState(self.w, self.prior if r.plan.carry else Observed(), r.plan.lookup,
                                             self.CARRIED)
        guarded = self._guarded(rows) if priced else []
        if guarded and not self.started:  # the first rows: drafting if what they carry pays, else a fresh probe
            self.started = True
            if self.state == "probe" and all(s.carried for s in guarded) and \
                    self.best([self._p(s) for s in guarded])[2] >= self.MARGIN:
                self.state = "draft"
            elif self.state == "probe":
                for s in guarded:
                    s.reset()
        if guarded and self.state != "plain":
            self.est = self.best([self._p(s) for s in guarded])
        # (None: unpriced, or timing the plain step prices as paid are in: the guarded rows step plainly)
        drafting = (guarded and self.state != "plain" and not self.hopeless and self._probe_pays(rows)) \
            if priced else None
        if drafting and self._untimed(rows):
            drafting, self.timing = None, self.timing + 1
        srcs, widths = [], []
        for r in rows:
            src, w = self._row(r, drafting)
            srcs.append(src if w > 1 else "")
            widths.append(w)
        if drafting is False:
            self._judge_lookups(rows, srcs, widths)
        if max(widths) == 1:
            return Decision.plain(rows, self.wait if guarded and self.state == "plain" else None)
        return Decision(tuple(widths), tuple(srcs))

    def _probe_pays(self, rows: Sequence[Row]) -> bool:
        """Whether a probe about to start (its first cycle) could repay its worst
        case (see PAYBACK: PROBE cycles of one token, and the drafter's catch-up
        over the rows' unseen context) within the guarded rows' room left (mean
        tokens before max_tokens), at the widest width up to the predicted one
        that can: a short answer probes narrower (probe_w). Where none can (near
        an answer's end; a dear cycle: many rows, a long context; a whole prompt
        to catch up for a short answer) the rows step plainly."""
        if self.state != "probe" or self.trial > 0:
            return True
        mine = [r for r in rows if r.uid in self.rows]
        # plain steps a probe may lose; the steps already refused count as room, so short answers one
        # after another still probe now and then (else what was paid, learnt only while drafting, could
        # keep every later answer plain)
        room = (sum(r.left for r in mine) / len(mine) + self.deferred) / self.PAYBACK
        # (paid whatever the probe finds: part of its worst case)
        self.catch_due = self.catch * sum(r.unseen for r in mine) / len(mine)
        fits = [x for x in self.ws if x <= self.est[0] and self.PROBE * (self.kd[x] - 1) + self.catch_due <= room]
        self.probe_w = max(fits, default=None)
        self.short = self.probe_w is None
        return not self.short

    def _untimed(self, rows: Sequence[Row]) -> bool:
        """Whether this set steps plainly to time a plain step at its size B: it
        has drafted UNTIMED cycles that wait for one (prices as paid are in
        plain steps) and nothing was paid at B before. Else a set whose cycles
        cost more than priced, and so never falls back, would never learn it
        (a 1.5-token cycle priced at 0.86 plain steps that costs 1.86: 0.80x plain,
        bench/guard_sim). Once per B: what was paid carries on (and never more than
        3 x UNTIMED plain steps in all, should the set's rows keep changing)."""
        B = len(rows)
        return (B, True) not in self.paid and not self._timed(B) and self.timing < 3 * self.UNTIMED \
            and sum(u[0][0] == B for u in self.unmatched) >= self.UNTIMED and all(r.plan.guarded for r in rows)

    def _row(self, r: Row, drafting: Optional[bool]) -> tuple:
        """(source, verify width) of one row this cycle."""
        plan = r.plan
        if not plan.drafts:
            return "", 1
        room = min(plan.cap, r.left + 1)  # the published loops' last block: one row past max_tokens
        if plan.fixed:
            if plan.lookup:  # verify mode lookup: lookup first, at its width
                m = r.offers(LOOKUP, room - 1)
                if m and (not plan.drafter or m == plan.cap - 1):
                    return LOOKUP, m + 1
                return (DFLASH, room) if plan.drafter else ("", 1)
            return DFLASH, room
        s = self.rows.get(r.uid) if drafting is not None else None
        if s is None:  # unpriced, or timing a plain step: plain
            return "", 1
        # the answer's last block: a cycle yields at most what is left of it (the row past it that
        # fixed widths verify, as the published loops do, yields nothing), so it is no wider, and
        # drafts only where it still pays at the width it is cut to (else plain, the last token too)
        room = min(plan.cap, r.left)
        want = min(self.est[0], self.probe_w or self.est[0])
        w = max(1, min(want, room))
        if 1 < w < want and expected(self._p(s), w) < self.kd[w]:
            w = 1
        if s.gate is not None and room > 1:  # the context repeats itself: verify its continuation if it
            m = r.offers(LOOKUP, min(self.w, room) - 1)  # beats what the row would do instead
            s.grade = r.grade(LOOKUP) if m else 0
            if m and (not drafting or s.gate.take(m, s.grade, self.kv,  # (rate None: instead, plain steps)
                                                  expected(self._p(s), w) / self.kd[w] if w > 1 else None)):
                return LOOKUP, m + 1  # (not drafting: a proposal, judged with the set's in _judge_lookups)
        return (DFLASH, w) if drafting and w > 1 else ("", 1)

    def _judge_lookups(self, rows: Sequence[Row], srcs: list, widths: list) -> None:
        """Between DFlash cycles, a cycle is made for the rows' lookup proposals
        alone: it costs every row of the set a verify as wide as the widest, so it
        is taken when the set's expected tokens pay for it (a row alone: its
        gate's rule), or when a gate's turn to explore comes; else each row steps plainly."""
        idx = [i for i, src in enumerate(srcs) if src == LOOKUP and not rows[i].plan.fixed]  # (fixed: its mode's)
        if not idx:
            return
        states = [self.rows[rows[i].uid] for i in idx]
        gates = [s.gate for s in states]
        tokens = len(rows) + sum(s.gate.rate(s.grade) * (widths[i] - 1) for s, i in zip(states, idx))
        if LookupGate.cycle_pays(tokens, len(rows), self.kv[max(widths[i] for i in idx)]):
            return
        cost = self.kv[max(widths[i] for i in idx)]
        if any([g.explore(len(rows), cost) for g in gates]):  # (a list: every gate counts its skip)
            return
        for i in idx:
            srcs[i], widths[i] = "", 1

    def observe(self, rows: Sequence[Row], results: List[CycleResult]) -> None:
        cycle = False
        for r, res in zip(rows, results):
            s = self.rows.get(r.uid)
            if s is None or res.width == 1:
                continue
            if res.source == LOOKUP:  # DFlash's own acceptance and state are untouched
                s.gate.observe(res.accepted, res.width - 1, s.grade)
                continue
            cycle = True
            n, a = res.width - 1, res.accepted
            if self.state == "draft":  # (a probe judges its own few cycles, none faded)
                s.forget(1 - self.ALPHA)
            for i in range(min(a + 1, n)):  # position i was tried iff all before it were accepted
                s.hits[i] += i < a
                s.tries[i] += 1
        self._time(rows, results, cycle)
        if cycle:
            w = max(res.width for res in results if res.source == DFLASH)
            self.widths[w] = self.widths.get(w, 0) + 1
            self._judge(rows)
        elif all(res.width == 1 for res in results):
            self._plain_step()

    def _time(self, rows: Sequence[Row], results: List[CycleResult], drafted: bool) -> None:
        """What this step took against its price (see PAID_SAMPLES): its wall
        time since the engine's previous step (CycleResult.t_step: everything a
        step costs, its tokens' handing out included), when that step had the
        same rows. Medians over the last few: a pipelined plain step before a
        cycle is short (its compute was done) and the one after long (two
        steps' compute). A DFlash cycle right after a plain step or a lookup
        cycle is left out: it also brings the drafter's context up to date with
        the tokens those made, once."""
        uids, B, secs, w = tuple(r.uid for r in rows), len(rows), results[0].t_step, max(r.width for r in results)
        last, self.last_step = self.last_step, uids
        after_plain, self.after_plain = self.after_plain, not drafted  # (a plain step, or a lookup cycle)
        if secs <= 0 or last != uids or not any(u in self.rows for u in uids) or (drafted and after_plain):
            return
        if w == 1:
            plain = self.plain_s.setdefault(B, [])
            plain[:] = plain[-(self.PLAIN_SAMPLES - 1):] + [secs]
            if self._timed(B):
                for u in [u for u in self.unmatched if u[0][0] == B]:
                    self._paid(*u, self._unit(B))
                self.unmatched = [u for u in self.unmatched if u[0][0] != B]
            return
        price = self.priced[0 if drafted else 1].get(w)
        if price:
            self.unmatched = self.unmatched[-(self.PAID_SAMPLES - 1):] + [((B, drafted), secs, price)]
            if self._timed(B):
                self._paid(*self.unmatched.pop(), self._unit(B))

    def _timed(self, B: int) -> bool:
        """Whether enough plain steps at B are timed (PLAIN_MIN) to be the unit of its prices as paid."""
        return len(self.plain_s.get(B, ())) >= self.PLAIN_MIN

    def _unit(self, B: int) -> float:
        """The plain step at B rows: the median of the timed ones, within UNIT_BOUND of the one measured
        apart (at the length last priced; never priced at B: unbounded)."""
        t, apart = median(self.plain_s[B]), self.step_s.get(B)
        return t if apart is None else min(max(t, apart / self.UNIT_BOUND), apart * self.UNIT_BOUND)

    def _paid(self, key: tuple, secs: float, price: float, unit: float) -> None:
        """One cycle's plain steps beyond its k(w), in units of its set's plain step
        (DFlash cycles and lookup-only ones apart: the drafter's share is priced apart)."""
        excess = self.excess.setdefault(key, [])
        excess[:] = excess[-(self.PAID_SAMPLES - 1):] + [secs / unit - price]
        self.paid[key] = median(excess)

    def _judge(self, rows: Sequence[Row]) -> None:
        guarded = self._guarded(rows)
        if not guarded:
            return
        ps = [self._p(g) for g in guarded]
        self.est = self.best(ps)  # (the estimates do not depend on the state)
        s = self.est[2]
        if self.state == "probe":
            self.trial += 1
            self.deferred = 0
            if self.trial == 1 and len(self.excess.get((len(rows), True), ())) < self.PAID_TRUSTED:
                # its one cycle so far caught the drafter up and was not timed, and what was paid rests on
                # too few cycles to tell an outlier: judged at the price measured, so the probe times one
                s = self.best(ps, self.priced[0])[2]
            if s < 1.0 or (self.trial >= self.PROBE and s < self.MARGIN):
                self._fall_back()
                self.probe_w = None
            elif self.trial >= self.PROBE:
                self.state, self.trial, self.probe_w = "draft", 0, None
                self.backoff = self.BACKOFF0  # drafting pays: a later fallback probes again soon
        elif self.state == "draft" and s < 1.0:
            self._fall_back()

    def _plain_step(self) -> None:
        self.wait = max(0, self.wait - 1)
        if self.state == "probe" and self.short:
            self.deferred += 1
        if self.hopeless:
            self.wait = self.wait or self.BACKOFF_MAX
        elif self.state == "plain" and self.wait == 0:
            self._start_probe()
            self.probes += 1

    def _to_plain(self, n: int) -> None:
        self.state, self.wait, self.trial = "plain", n, 0

    def _start_probe(self) -> None:
        self.state, self.trial = "probe", 0
        for s in self.rows.values():
            s.reset()

    def _fall_back(self) -> None:
        self.fallbacks += 1
        self._to_plain(self.backoff)
        self.backoff = min(2 * self.backoff, self.BACKOFF_MAX)

    def uses_drafter(self, plan: Plan, context: int) -> bool:
        if not plan.drafter:
            return False
        if plan.fixed:
            return True
        try:
            kd = self.model.k(1, context, True)  # alone, at its length: then plain (and lookup) for good
        except Unpriced:
            return True  # not measured yet: its features are kept, so it may draft once it is
        return bool(self.ws) and max(x / kd[x] for x in self.ws) >= self.CEILING_MIN

    def leave(self, row: Row) -> Optional[Observed]:
        s = self.rows.pop(row.uid, None)
        if s is None:
            return None
        # the rates seen (estimates where a position was never tried) and the tries behind them; a row
        # with no evidence hands on the prior as it came (never its estimates, which would pass for evidence),
        # and so does a row without lookup its lookup rate (else one such request resets the next one's)
        p, tries = self.prior.p, self.prior.tries
        if s.tried:
            p = [h / n if n else e for h, n, e in zip(s.hits, s.tries, self._p(s))]
            tries = list(s.tries)
        o = Observed(backoff=self.backoff, deferred=self.deferred, p=list(p) if p is not None else None, tries=tries,
                     wait=self.wait if self.state == "plain" and not self.hopeless else 0,
                     lookup_alpha=dict(s.gate.alpha) if s.gate is not None else self.prior.lookup_alpha,
                     paid=dict(self.paid), excess={k: list(v) for k, v in self.excess.items()})
        if row.plan.carry:
            self.prior = o  # rows that join later start from it
        return o if row.plan.carry else None

    # -- what the stats say ----------------------------------------------------------------
    def speedup(self) -> Optional[float]:
        return self.est[2]

    def reason(self, row: Row) -> str:
        plan = row.plan
        if plan.mode == "off":
            return f"plain: {plan.fallback or 'verify mode off'}"
        if plan.fixed:
            if plan.lookup:
                return f"lookup width {plan.cap}" + (" (else DFlash)" if plan.drafter else "")
            return f"fixed width {plan.cap}"
        if self.unpriced:
            return f"plain: {self.unpriced} are not measured yet (measured while the server is idle)"
        s = self.rows.get(row.uid)
        tail = s.gate.tail() if s is not None and s.gate is not None else ""
        return self._dflash_reason() + tail

    def _dflash_reason(self) -> str:
        k = self.kd.get(self.w, 0.0)
        if self.hopeless:
            return f"plain: width {self.w} cannot pay here (a cycle costs {self.priced[0].get(self.w, 0.0):.2f} " \
                   "plain tokens)"
        x, tau, s = self.est
        # (rounded down: a prediction just below break-even never reads 1.00x)
        as_paid = f", {self.kd[x] - self.priced[0][x]:.2f} more than measured, as paid" \
            if x in self.priced[0] and self.kd[x] > self.priced[0][x] else ""
        why = (f"{int(s * 100) / 100:.2f}x predicted (width {x}, tau {tau:.2f}, cycle = {self.kd[x]:.2f} plain "
               f"tokens{as_paid})" if s is not None else "")
        if self.state == "plain":
            return f"plain: DFlash {why}; probe in {self.wait}" if why else f"plain: probe in {self.wait}"
        if self.state == "probe" and self.short:  # (a probe due starts afresh: est is its prior, no evidence)
            n = min(self.ws)
            catch = f", the drafter's catch-up {self.catch_due:.2f}" if self.catch_due > 0 else ""
            return f"plain: too few tokens left to repay a probe (a width-{n} cycle costs {self.kd[n]:.2f} " \
                   f"plain tokens{catch})"
        if self.state == "probe":
            return f"dflash: probing, {why}" if why else f"dflash: probing (cycle = {k:.2f} plain tokens)"
        return f"dflash: {why}"

    def summary(self, row: Row) -> Optional[dict]:
        if not row.plan.guarded:
            return None
        x, tau, s = self.est
        return {"state": "unpriced" if self.unpriced else self.state, "fallbacks": self.fallbacks, "probes": self.probes, "speedup": s,
                "cycle_cost": self.kd.get(x), "tau": tau, "width": x, "widths": dict(self.widths)}

"""Runs one of this folder's scripts on the guard with one rule changed, for
tried.md (none of these is in the product):

    ALPHA=a  evidence fades by 1 - a per drafted cycle (the guard's: 0.05)
    KEEP=f   a probe keeps f of each row's evidence, where the guard starts it afresh
    PW=w     a probe drafts at most w wide (ONLY1=1: in its first cycle only)
    RAMP=r   the width chosen is at most r x the positions tried so far (a probe's own width at least)
    RAMPW=r  as RAMP, for the width drafted only (the decision to draft still prices every width)
    GRACE=n  a draft does not fall back in its first n cycles after a probe
    DEPTH=d  a fallback waits backoff x min(1, (1 - s) / d) plain steps (s: the speedup it fell back at)
    UCB=z    a fallback only where the speedup at each position's estimate plus z standard errors
             is below 1 (the evidence's spread, not its mean alone); a probe still needs MARGIN
    EVID=e   a draft's fallback waits at most e plain steps per cycle drafted since its probe
    PSEUDO=n, POOL=n  the guard's constants of those names (its estimates' pseudo-tries)
    CAPC=c   a request's carried evidence counts at most c tries at each position (switch.py)
    CHANGE=o a row's carried evidence is dropped once its own cycles favour a new text by odds o: each
             cycle's chance under Laplace's rule on its own evidence over its chance under the row's
             estimates (carried and own) it was drafted on (switch.py)

    GRADED=1 the lookup gate's prior share by the match's length (2, 3, 4 tokens: 0.17, 0.28, 0.79, the
             shares of bench/short_answers/ngram_shares.log) where the gate's is 0.5 for every length

    ALPHA=0.02 PYTHONPATH=. python bench/guard_sim/variants.py short_answers.py 0.3 0 48

A script is one of this folder's, else a path (a real bench: bench/short_answers/bench.py), or `cli`
and a command of `mlx-dflash` (`cli bench --realistic ...`).
"""

import math
import os
import runpy
import sys
from pathlib import Path

from mlx_dflash.policy import guard as guard_module
from mlx_dflash.policy.base import DFLASH
from mlx_dflash.policy.guard import Guard
from mlx_dflash.policy.lookup_gate import LookupGate
from app.cli import main

HERE = Path(__file__).parent  # (on sys.path as the script's folder: the scripts it runs import sim from it)

if "ALPHA" in os.environ:
    Guard.ALPHA = float(os.environ["ALPHA"])

for name in ("PSEUDO", "POOL"):
    if name in os.environ:
        setattr(Guard, name, float(os.environ[name]))

if "KEEP" in os.environ:
    keep = float(os.environ["KEEP"])

    def _start_probe(self):
        self.state, self.trial = "probe", 0
        for s in self.rows.values():
            s.forget(keep)
    Guard._start_probe = _start_probe

if "PW" in os.environ:
    pw, only1, probe_pays = int(os.environ["PW"]), os.environ.get("ONLY1") == "1", Guard._probe_pays

    def _probe_pays(self, rows):
        ok = probe_pays(self, rows)
        if ok and self.state == "probe" and self.trial == 0 and self.probe_w is not None:
            self._pw0, self.probe_w = self.probe_w, min(self.probe_w, pw)
        elif only1 and self.state == "probe" and self.trial == 1 and getattr(self, "_pw0", None):
            self.probe_w, self._pw0 = self._pw0, None
        return ok
    Guard._probe_pays = _probe_pays

if "DEPTH" in os.environ:
    depth = float(os.environ["DEPTH"])

    def _fall_back(self):
        self.fallbacks += 1
        s = self.est[2] if self.est[2] is not None else 0.0
        self._to_plain(max(1, round(self.backoff * min(1.0, (1.0 - s) / depth))))
        self.backoff = min(2 * self.backoff, self.BACKOFF_MAX)
    Guard._fall_back = _fall_back

def ramp_cap(g, r: float) -> float:
    """RAMP's and RAMPW's bound: r x (1 + the positions with evidence), a probe's own width at least."""
    reach = max((1 + sum(n > 0.5 for n in s.tries) for s in g.rows.values()), default=1)
    return max(g.probe_w or 2, r * reach)


if "RAMP" in os.environ:
    ramp, best = float(os.environ["RAMP"]), Guard.best

    def best_ramped(self, ps):
        cap = ramp_cap(self, ramp)
        ws, self._ws = self._ws, [x for x in self.ws if x <= cap] or [min(self.ws)]
        try:
            return best(self, ps)
        finally:
            self._ws = ws
    Guard.best = best_ramped

if "RAMPW" in os.environ:
    rampw, row = float(os.environ["RAMPW"]), Guard._row

    def row_ramped(self, r, drafting):
        cap = ramp_cap(self, rampw)
        est = self.est
        if est[0] and est[0] > cap:
            self.est = (max([x for x in self.ws if x <= cap] or [min(self.ws)]),) + tuple(est[1:])
        try:
            return row(self, r, drafting)
        finally:
            self.est = est
    Guard._row = row_ramped

if "GRACE" in os.environ:
    grace, judge = int(os.environ["GRACE"]), Guard._judge

    def _judge(self, rows):
        if self.state == "draft":
            self._since = getattr(self, "_since", 0) + 1
            if self._since <= grace and self._guarded(rows):
                self.est = self.best([self._p(g) for g in self._guarded(rows)])
                return  # (its first cycles after a probe: no fallback yet)
        was = self.state
        judge(self, rows)
        if self.state == "draft" and was != "draft":
            self._since = 0
    Guard._judge = _judge

if "EVID" in os.environ:
    evid, judge, fall = float(os.environ["EVID"]), Guard._judge, Guard._fall_back

    def _judge(self, rows):
        was = self.state
        if was == "draft":
            self._drafted = getattr(self, "_drafted", 0) + 1
        judge(self, rows)
        if self.state == "draft" and was != "draft":
            self._drafted = 0

    def _fall_back(self):
        was = self.state
        fall(self)
        if was == "draft":
            self.wait = max(1, min(self.wait, round(evid * getattr(self, "_drafted", 0))))
    Guard._judge, Guard._fall_back = _judge, _fall_back

if "UCB" in os.environ:
    z, judge_u, fall_u = float(os.environ["UCB"]), Guard._judge, Guard._fall_back

    def _judge_ucb(self, rows):
        up = [[min(1.0, x + z * (x * (1 - x) / (self.PSEUDO + n)) ** 0.5) for x, n in zip(self._p(st), st.tries)]
              for st in self._guarded(rows)]
        self._spread_pays = bool(up) and self.best(up)[2] >= 1.0
        judge_u(self, rows)

    def _fall_back_ucb(self):
        # (the spread still allows a gain: no fallback, but at a probe's end it still needs MARGIN)
        if not self._spread_pays or (self.state == "probe" and self.trial >= self.PROBE):
            fall_u(self)
    Guard._judge, Guard._fall_back = _judge_ucb, _fall_back_ucb

if "CAPC" in os.environ:
    capc, row_init = float(os.environ["CAPC"]), guard_module._RowState.__init__

    def _capped(self, widest, prior, lookup, weight):
        row_init(self, widest, prior, lookup, weight)
        for i, n in enumerate(self.tries):
            if n > capc:
                self.hits[i], self.tries[i] = self.hits[i] * capc / n, capc
    guard_module._RowState.__init__ = _capped

if "CHANGE" in os.environ:
    odds, row_init2, observe = math.log(float(os.environ["CHANGE"])), guard_module._RowState.__init__, Guard.observe

    def _chance(p, n, a):  # exactly a of n drafts accepted, position i right with chance p[i]
        out = math.prod(p[:a])
        return max(out * (1 - p[a]) if a < n else out, 1e-9)

    def _with_own(self, widest, prior, lookup, weight):
        row_init2(self, widest, prior, lookup, weight)
        self.own = ([0.0] * (widest - 1), [0.0] * (widest - 1))
        self.log_bf = 0.0 if self.carried else None

    def observe_change(self, rows, results):
        seen = []
        for r, res in zip(rows, results):
            s = self.rows.get(r.uid)
            if s is not None and res.width > 1 and res.source == DFLASH:
                seen.append((s, res.width - 1, res.accepted, self._p(s)))
        observe(self, rows, results)
        for s, n, a, p in seen:
            h, t = s.own
            if s.log_bf is not None and any(s.tries):  # (None: nothing carried, or a probe reset it)
                fresh = [(x + 1) / (y + 2) for x, y in zip(h, t)]
                s.log_bf += math.log(_chance(fresh, n, a)) - math.log(_chance(p, n, a))
            for i in range(min(a + 1, n)):
                h[i] += i < a
                t[i] += 1
            if s.log_bf is not None and s.log_bf >= odds:
                s.hits, s.tries, s.log_bf = list(h), list(t), None
                self._judge(rows)
    guard_module._RowState.__init__, Guard.observe = _with_own, observe_change

if "GRADED" in os.environ:
    graded = {1: 0.10, 2: 0.17, 3: 0.28, 4: 0.79}

    def rate_graded(self, grade):
        longer = [a for g, a in self.alpha.items() if g > grade]
        return min([self.alpha.get(grade, graded.get(grade, self.ALPHA0))] + longer)
    LookupGate.rate = rate_graded

script, sys.argv = sys.argv[1], sys.argv[1:]
if script == "cli":
    sys.argv = ["mlx-dflash"] + sys.argv[1:]
    main()
else:
    runpy.run_path(str(HERE / script if (HERE / script).exists() else Path(script)), run_name="__main__")

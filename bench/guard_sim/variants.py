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

    ALPHA=0.02 PYTHONPATH=. python bench/guard_sim/variants.py short_answers.py 0.3 0 48
"""

import os
import runpy
import sys
from pathlib import Path

from mlx_dflash.policy.guard import Guard

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

script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(str(HERE / script), run_name="__main__")

"""Any `mlx-dflash` command with the guard's state logged at each decision,
each judgement of a cycle (its estimates), each cycle's price as paid, each
fallback and each request's start and end (to GUARD_TRACE, default
/tmp/guard_trace.log): how tried.md's hybrid 4k answer was traced.

    MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. python bench/guard_sim/trace.py \
        bench --realistic --contexts 1024,4096 --targets hybrid-small --num-prompts 6 --max-tokens 48 --out /tmp/tr
"""

import os
import sys

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from app.cli import main
from mlx_dflash.policy.guard import Guard

LOG = open(os.environ.get("GUARD_TRACE", "/tmp/guard_trace.log"), "w")
init, decide, leave, fall_back = Guard.__init__, Guard.decide, Guard.leave, Guard._fall_back
judge, paid = Guard._judge, Guard._paid


def _init(self, costs, prior=None):
    init(self, costs, prior)
    print(f"NEW prior wait={getattr(prior, 'wait', None)} backoff={getattr(prior, 'backoff', None)} "
          f"paid={getattr(prior, 'paid', None)} state={self.state}", file=LOG, flush=True)


def _decide(self, rows):
    d = decide(self, rows)
    r, (w, _, s) = rows[0], self.est
    print(f"  left={r.left} ctx={r.context} state={self.state} wait={self.wait} trial={self.trial} "
          f"short={self.short} probe_w={self.probe_w} est=({w}, {s and round(s, 3)}) widths={d.widths}"
          + (f" unpriced: {self.unpriced}" if self.unpriced else ""),
          file=LOG, flush=True)
    return d


def _leave(self, row):
    o = leave(self, row)
    print(f"LEAVE wait={o and o.wait} backoff={o and o.backoff} fallbacks={self.fallbacks}", file=LOG, flush=True)
    return o


def _fall_back(self):
    print(f"  FALLBACK est={self.est} backoff={self.backoff}", file=LOG, flush=True)
    fall_back(self)


def _judge(self, rows):
    """After each DFlash cycle: the estimates it was judged on (prices as measured, what was paid)."""
    judge(self, rows)
    s, (w, tau, x), pr = self.rows.get(rows[0].uid), self.est, self.priced[0]
    if s is not None:
        print(f"  JUDGE state={self.state} trial={self.trial} est=({w}, {tau and round(tau, 2)}, {x and round(x, 3)}) "
              f"priced 5/8/12={pr.get(5, 0):.2f}/{pr.get(8, 0):.2f}/{pr.get(12, 0):.2f} "
              f"paid={ {k: round(v, 2) for k, v in self.paid.items()} } p={[round(v, 2) for v in self._p(s)[:8]]} "
              f"tries={[round(v, 1) for v in s.tries[:8]]}", file=LOG, flush=True)


def _paid(self, key, secs, price, unit):
    paid(self, key, secs, price, unit)
    print(f"  PAID {key} {secs * 1e3:.1f} ms, unit {unit * 1e3:.2f} ms, price {price:.2f}: "
          f"excess {self.excess[key][-1]:.2f}", file=LOG, flush=True)


Guard.__init__, Guard.decide, Guard.leave, Guard._fall_back = _init, _decide, _leave, _fall_back
Guard._judge, Guard._paid = _judge, _paid
sys.argv = ["mlx-dflash"] + sys.argv[1:]
main()

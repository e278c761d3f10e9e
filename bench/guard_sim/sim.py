"""The guard's width choice against the best fixed width, with no model: a
stream's accept lengths drawn from a per-position acceptance law, each cycle
priced by a cost curve k(w) (plain steps), the guard (policy.guard.Guard, as
the engine drives it) deciding every cycle. Reported per (curve, law): the
guard's tokens per plain step's time over the best fixed width's expectation
and over plain decoding, mean over seeds.

    PYTHONPATH=. python bench/guard_sim/sim.py [--tokens 400] [--seeds 20] [--overhead 1.0]

--overhead H: every cycle truly costs k(w) + H plain steps (work per cycle the
curves miss), as its step time tells the guard (prices as paid).

--catch-up C: each answer starts with a prompt whose window (ROWS context rows)
the drafter has not taken in; its first draft costs C plain steps more, and each
context row after (a plain step's, a cycle's accepted ones) C / ROWS. Fixed widths
pay it too. The guard is told (Costs.u), unless --unpriced (the code before).
"""

import argparse
import random
import statistics

from mlx_dflash.policy.base import DFLASH, CycleResult, Plan
from mlx_dflash.policy.costs import CostModel, Costs, interpolate
from mlx_dflash.policy.guard import Guard, expected

# k(w) = c(w) + d(w) in 1-token steps, measured (bench/long_context/realistic/before_a8edb85/results.json)
CURVES = {
    "qwen3-small 1k": {2: 2.24, 3: 2.63, 5: 2.67, 8: 3.22, 12: 3.93, 16: 4.82},
    "qwen3-small 32k": {2: 0.86, 3: 1.18, 5: 1.68, 8: 2.12, 12: 2.87, 16: 3.57},
    "hybrid-small 1k": {2: 2.14, 3: 2.56, 5: 2.8, 8: 3.4, 12: 4.35, 16: 5.38},
    "hybrid-small 16k": {2: 1.56, 3: 1.93, 5: 2.23, 8: 2.81, 12: 3.69, 16: 4.5},
    "embedded short": {2: 1.88, 3: 1.98, 5: 2.07, 8: 2.48, 12: 3.0, 16: 3.6},
    # in plain tokens, as the guard priced it in the realistic bench (hybrid-small at 4k, 64-token answers)
    "hybrid-small 4k as priced": {2: 2.25, 3: 2.73, 5: 3.03, 8: 3.72, 12: 4.77, 16: 5.84},
}


def geometric(a):
    return lambda i, t: a


def falling(a0, a1, n=15):  # acceptance falls with the position, linearly from a0 to a1
    return lambda i, t: a0 + (a1 - a0) * i / (n - 1)


def regimes(hi, lo, every):  # the text alternates: predictable stretches and hard ones, `every` tokens each
    return lambda i, t: hi(i, t) if (t // every) % 2 == 0 else lo(i, t)


LAWS = {
    "geometric 0.86 (tau16 6.5)": geometric(0.86),
    "geometric 0.7": geometric(0.7),
    "geometric 0.5": geometric(0.5),
    "falling 0.95 -> 0.4": falling(0.95, 0.4),
    "falling 0.8 -> 0.2": falling(0.8, 0.2),
    "regimes 0.9 / 0.3, 100 tokens": regimes(geometric(0.9), geometric(0.3), 100),
    "regimes falling / 0.5, 200 tokens": regimes(falling(0.95, 0.5), geometric(0.5), 200),
}


class Row:
    def __init__(self, cap, left):
        self.uid, self.context, self.left, self.unseen = 1, 0, left, 0
        self.plan = Plan("dflash", cap, False, True, False)

    def offers(self, source, n):
        return n if source == DFLASH else 0

    def grade(self, source):
        return 0


ROWS = 1088  # a prompt's window: the drafter's context window and sink (DecodeConfig)


def model_of(k, u=0.0):
    ws = sorted(k)
    curve = Costs(1.0, {1: 1.0, **{w: k[w] for w in ws}}, {1: 0.0, **{w: 0.0 for w in ws}}, t_plain=1.0, u=u)
    return CostModel(lambda at: curve, [1] + ws)


def accept(law, w, t, rng):
    """Drafts accepted of w - 1 (position i right with probability law(i, t), t: the answer's tokens so far)."""
    a = 0
    while a < w - 1 and rng.random() < law(a, t):
        a += 1
    return a


def run_guard(k, law, tokens, seed, cap=16, prior=None, overhead=0.0, catch=0.0, priced=True):
    """One answer of `tokens` tokens decoded under the guard: (tokens per plain step's time, what it hands on).
    Each cycle truly costs k(w) + `overhead` plain steps (host work the curves miss), and the drafter's
    catch-up over the rows it has not taken in (`catch` plain steps a prompt's window: see --catch-up), and
    says so in its t_step, as the engine's wall clock does (a plain step: 1.0)."""
    rng = random.Random(seed)
    g = Guard(model_of(k, catch / ROWS if priced else 0.0), prior)
    row = Row(cap, tokens)
    row.unseen = ROWS if catch else 0
    made = cost = 0
    while made < tokens:
        row.left = tokens - made
        w = g.decide([row]).widths[0]
        if w == 1:
            res, c = CycleResult(1, 0, 1, t_step=1.0), 1.0
            row.unseen += bool(catch)
        else:  # (its width is within what is left of the answer, plus the bonus row; a stop cuts the rest)
            a = accept(law, w, made, rng)
            c = interpolate(k, w) + overhead + catch / ROWS * row.unseen
            row.unseen = (a + 1) * bool(catch)
            res = CycleResult(w, a, min(a + 1, row.left), source=DFLASH, t_step=c)
        made += res.emitted
        cost += c
        g.observe([row], [res])
    return made / cost, g.leave(row)


def fixed_rate(k, law, tokens, requests, seed, w, overhead=0.0, catch=0.0):
    """A fixed width over `requests` answers of `tokens` each (the last block of an
    answer no wider than what is left of it, as the engine cuts it), each answer's
    first cycle catching the drafter up over its prompt's window."""
    rng = random.Random(seed)
    made = cost = 0
    for _ in range(requests):
        got, unseen = 0, ROWS
        while got < tokens:
            x = min(w, tokens - got + 1)
            a = min(accept(law, x, got, rng), tokens - got - 1)
            got += a + 1
            cost += interpolate(k, x) + overhead + catch / ROWS * unseen if x > 1 else 1.0
            unseen = a + 1 if x > 1 else unseen + 1
        made += got
    return made / cost


def fixed_rates(k, law, tokens, requests, seeds, overhead=0.0, catch=0.0) -> dict:
    """Each fixed width's (2-16) mean rate over `seeds` runs of `requests` answers."""
    return {w: statistics.mean(fixed_rate(k, law, tokens, requests, s, w, overhead, catch) for s in range(seeds))
            for w in range(2, 17)}


def guard_rate(k, law, tokens, requests, seeds, overhead=0.0, warm=0, catch=0.0, priced=True) -> float:
    """The guard's mean rate over `seeds` runs of `requests` answers, its state
    carried from answer to answer (after a warm-up answer of `warm` tokens, not counted)."""
    got = []
    for s in range(seeds):
        prior, rates = None, []
        if warm:
            _, prior = run_guard(k, law, warm, 7777 + s, overhead=overhead)
        for r in range(requests):
            x, prior = run_guard(k, law, tokens, 1000 * s + r, prior=prior, overhead=overhead, catch=catch,
                                 priced=priced)
            rates.append(x)
        got.append(statistics.mean(rates))
    return statistics.mean(got)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--requests", type=int, default=3, help="requests in a row, the guard's state carried")
    ap.add_argument("--overhead", type=float, default=0.0,
                    help="plain steps each cycle costs beyond its curve (what the guard learns as paid)")
    ap.add_argument("--catch-up", type=float, default=0.0,
                    help="plain steps the drafter's first draft of an answer pays to take in its prompt's window")
    ap.add_argument("--unpriced", action="store_true", help="the guard is not told the catch-up's cost")
    args = ap.parse_args()
    print(f"| curve | law | best fixed (x plain) | guard x plain | guard / best fixed |")
    print("|---|---|---|---|---|")
    worst = []
    for cname, k in CURVES.items():
        for lname, law in LAWS.items():
            fixed = fixed_rates(k, law, args.tokens, args.requests, args.seeds, args.overhead, args.catch_up)
            bw = max(fixed, key=fixed.get)
            best = max(1.0, fixed[bw])
            m = guard_rate(k, law, args.tokens, args.requests, args.seeds, args.overhead, catch=args.catch_up,
                           priced=not args.unpriced)
            worst.append(m / best)
            print(f"| {cname} | {lname} | w{bw if fixed[bw] > 1 else 1} {best:.2f}x | {m:.2f}x | **{m / best:.3f}** |",
                  flush=True)
    print(f"\nmean guard / best fixed {statistics.mean(worst):.3f}, min {min(worst):.3f}")


if __name__ == "__main__":
    main()

"""Requests whose text changes from one to the next: the guard's state carried
from a request the drafter predicts well into one it cannot predict at all
(bench/short_answers: random hex words after "The capital of France"), and
back. 40 seeds; each sequence of answers of N tokens on one curve, every cycle
H plain steps dearer than its curve. Prints, per sequence, the guard x plain on
the answers the drafter cannot predict and guard / best fixed width on the
others (each against its own law's best fixed width), then the worst of each.

    PYTHONPATH=. python bench/guard_sim/switch.py H N   # e.g. 0.5 48
"""

import statistics
import sys

import sim  # (bench/guard_sim, this script's folder)

GOOD = {"good 0.86": sim.geometric(0.86), "good 0.75": sim.geometric(0.75)}
BAD = sim.geometric(0.03)  # hex: 0-3 of 35-42 drafts a probe accepted
CURVES = ["embedded short", "hybrid-small 1k", "qwen3-small 32k"]
SEQUENCES = {"good, bad x3": "GBGBGB", "5 good, then bad": "GGGGGB", "3 bad, then 3 good": "BBBGGG"}


def run(k, good, seq, n, o, seeds=40):
    """Per answer position, the guard's rate over the seeds (tokens per plain step's time)."""
    rates = [[] for _ in seq]
    for s in range(seeds):
        prior = None
        for j, c in enumerate(seq):
            x, prior = sim.run_guard(k, good if c == "G" else BAD, n, 1000 * s + j, prior=prior, overhead=o)
            rates[j].append(x)
    return [statistics.mean(r) for r in rates]


def main():
    o, n = float(sys.argv[1]), int(sys.argv[2])
    worst_bad, worst_good = [], []
    for cname in CURVES:
        k = sim.CURVES[cname]
        for gname, good in GOOD.items():
            best = max(1.0, max(sim.fixed_rates(k, good, n, 1, 40, o).values()))
            for sname, seq in SEQUENCES.items():
                r = run(k, good, seq, n, o)
                bad = [x for x, c in zip(r, seq) if c == "B"]
                ok = [x / best for x, c in zip(r, seq) if c == "G"]
                worst_bad.append(min(bad))
                worst_good.append(statistics.mean(ok))
                print(f"  {cname:16s} {gname:10s} {sname:18s} bad x plain {' '.join(f'{x:.2f}' for x in bad)}   "
                      f"good / best fixed {' '.join(f'{x:.2f}' for x in ok)}", flush=True)
    print(f"bad x plain: mean {statistics.mean(worst_bad):.3f} min {min(worst_bad):.3f}; "
          f"good / best fixed: mean {statistics.mean(worst_good):.3f} min {min(worst_good):.3f}")


if __name__ == "__main__":
    main()

"""Near break-even, short answers: the drafter's acceptance a constant per
position (geometric a) around where drafting starts to pay on three measured
curves; 40 seeds x 6 answers of N tokens, the guard's state carried, every
cycle H plain steps dearer than its curve. Prints the best fixed width (x plain),
the guard (x plain) and guard / best fixed (the best of plain and the fixed
widths) per case.

    PYTHONPATH=. python bench/guard_sim/marginal.py H N   # e.g. 0.3 48
"""

import statistics
import sys

import sim  # (bench/guard_sim, this script's folder)

CURVES = ["hybrid-small 4k as priced", "hybrid-small 1k", "qwen3-small 1k"]
RATES = [0.65, 0.75, 0.78, 0.8, 0.82]


def main():
    o, n = float(sys.argv[1]), int(sys.argv[2])
    out = []
    for cname in CURVES:
        k = sim.CURVES[cname]
        for a in RATES:
            law = sim.geometric(a)
            fixed = sim.fixed_rates(k, law, n, 6, 40, o)
            bw = max(fixed, key=fixed.get)
            m = sim.guard_rate(k, law, n, 6, 40, o)
            out.append(m / max(1.0, fixed[bw]))
            print(f"  {cname:27s} geometric {a:.2f}  best fixed w{bw} {fixed[bw]:.3f}x  guard {m:.3f}x  "
                  f"guard / best {out[-1]:.3f}", flush=True)
    print(f"mean {statistics.mean(out):.3f} min {min(out):.3f}")


if __name__ == "__main__":
    main()

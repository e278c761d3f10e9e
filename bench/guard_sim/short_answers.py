"""Short answers, for rules the full grid cannot tell apart: 9 (curve, law)
cases, 40 seeds x 6 answers of N tokens, after an optional warm-up answer of W
tokens (its state carried, not counted); every cycle H plain steps dearer than
its curve. Prints guard / best fixed width per case, then the mean and worst.

    PYTHONPATH=. python bench/guard_sim/short_answers.py H W N   # e.g. 0.3 0 48, 0.3 8 64
"""

import statistics
import sys

import sim  # (bench/guard_sim, this script's folder)

cases = [("hybrid-small 1k","geometric 0.86 (tau16 6.5)"),("hybrid-small 4k as priced","geometric 0.86 (tau16 6.5)"),
         ("qwen3-small 1k","geometric 0.86 (tau16 6.5)"),("embedded short","geometric 0.7"),
         ("hybrid-small 1k","geometric 0.7"),("hybrid-small 4k as priced","geometric 0.5"),("qwen3-small 1k","geometric 0.5"),
         ("qwen3-small 32k","geometric 0.7"), ("hybrid-small 16k", "falling 0.8 -> 0.2")]
o = float(sys.argv[1]); warm = int(sys.argv[2]); n = int(sys.argv[3])
tot=[]
for cname, lname in cases:
    k=sim.CURVES[cname]; law=sim.LAWS[lname]
    fixed = max(1.0, max(sim.fixed_rates(k, law, n, 6, 40, o).values()))
    m = sim.guard_rate(k, law, n, 6, 40, o, warm) / fixed; tot.append(m)
    print(f"  {cname:26s} {lname:28s} {m:.3f}")
print(f"mean {statistics.mean(tot):.3f} min {min(tot):.3f}")

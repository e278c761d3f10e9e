"""Several runs of `mlx-dflash bench --realistic` side by side: per target and
context, each method's x mlx-lm as the median over the runs, the default
against the best fixed width by those medians, and run by run (with the
default's plain steps in brackets).

    python bench/long_context/realistic/medians.py RUN1/results.json RUN2/results.json ...
"""

import json
import statistics
import sys


def main(paths):
    cells = {}
    for p in paths:
        for t in json.load(open(p))["targets"]:
            for L in t["lengths"]:
                cell = cells.setdefault((t["target"], L["context"]), {})
                for m in L["methods"]:
                    cell.setdefault(m["method"], []).append(m)
    print("| target | context | default | best fixed | default / best (medians) | run by run (plain steps) |")
    print("|---|---|---|---|---|---|")
    for (target, ctx), ms in cells.items():
        med = {k: statistics.median(m["ratio"] for m in v) for k, v in ms.items()}
        fixed = [k for k in med if k.startswith("dflash2-w")]
        best = max(fixed, key=med.get)
        default = ms["default (guard)"]
        runs = " ".join(f"{d['ratio'] / max(ms[k][i]['ratio'] for k in fixed):.2f} ({d.get('plain_cycles', '-')})"
                        for i, d in enumerate(default))
        print(f"| {target} | {ctx} | {med['default (guard)']:.2f}x | {best[len('dflash2-'):]} {med[best]:.2f}x | "
              f"{med['default (guard)'] / med[best]:.2f} | {runs} |")


if __name__ == "__main__":
    main(sys.argv[1:])

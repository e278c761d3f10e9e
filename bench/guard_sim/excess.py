"""What a fixed-width cycle cost on `bench --realistic` beyond its price, by
width: per target, length and width, the cycle's seconds (tau / tok/s) in the
price's unit, the bench's 1-token step t1, against its price c(w) + d(w) (the
bench's sampled curve), as an excess (paid - priced) and as a ratio (paid /
priced). An excess about the
same at every width, where the ratio falls with the width, is work per cycle
that the curves miss (what the guard adds to its prices as paid).

    python bench/guard_sim/excess.py bench/guard_sim/realistic/*/results.json
"""

import json
import sys


def main(paths):
    for path in paths:
        res = json.load(open(path))
        print(f"{path} ({res['meta'].get('date_utc')})")
        print("| target | context | width | tau | paid | priced | excess | ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for t in res["targets"]:
            for L in t["lengths"]:
                cv = L["costs"]
                for m in L["methods"]:
                    if m["kind"] != "dflash2" or not m["tok_s"]:
                        continue
                    w = str(m["width"])
                    paid, priced = m["tau"] / m["tok_s"] / cv["t1"], cv["c"][w] + cv["d"][w]
                    print(f"| {t['target']} | {L['context']} | {w} | {m['tau']:.2f} | {paid:.2f} | {priced:.2f} "
                          f"| {paid - priced:+.2f} | {paid / priced:.2f} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])

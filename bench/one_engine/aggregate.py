"""The median tok/s and ratio to mlx-lm per method, old main vs ours, over the runs
quick_side_by_side.sh wrote (OUT); run 1 of each home is left out (it calibrates)."""
import glob, json, os, statistics as st
rows = {}
for who in ("old", "new"):
    for f in sorted(glob.glob(os.environ.get("OUT", "/tmp/one_engine") + f"/{who}_*/results.json")):
        i = int(f.split("_")[-1].split("/")[0])
        if i < 2: continue  # run 1: each home's first run (calibrations)
        r = json.load(open(f))
        for m in r["methods"]:
            rows.setdefault((m["method"], who), []).append((m["tok_s"], m["ratio"]))
methods = []
for (m, w) in rows:
    if m not in methods: methods.append(m)
print("| method | old main tok/s (median) | ours tok/s (median) | ours / old | old x mlx-lm (median) | ours x mlx-lm (median) | runs |")
print("|---|---|---|---|---|---|---|")
for m in methods:
    o, n = rows.get((m, "old"), []), rows.get((m, "new"), [])
    if not o or not n: continue
    mo, mn = st.median(x[0] for x in o), st.median(x[0] for x in n)
    print(f"| {m} | {mo:.1f} | {mn:.1f} | {mn/mo:.3f} | {st.median(x[1] for x in o):.2f}x | {st.median(x[1] for x in n):.2f}x | {len(o)} / {len(n)} |")

"""The default mode (the guard, choosing its width) against plain decoding and
fixed widths, side by side in one run on the embedded pair: methods in turn per
prompt (order rotating), tokens per second after the first token by wall clock
and by process CPU time (less sensitive to other jobs on a shared machine).
Every method's tokens are checked equal to plain decoding's.

    PYTHONPATH=. python bench/guard_widths/guard_widths.py gsm8k-dev 10 128 [--dtype float32] [--widths 3,5,8] [--reps 1]
"""

import argparse
import sys
import time

import mlx_dflash  # noqa: E402,F401  (fast BLAS before mlx)
from app.bench.prompts import load_prompts  # noqa: E402
from mlx_dflash import load, stream_generate  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("prompts")
ap.add_argument("n", type=int)
ap.add_argument("max_tokens", type=int)
ap.add_argument("--dtype", default=None)
ap.add_argument("--widths", default="3,5,8")
ap.add_argument("--reps", type=int, default=1)
args = ap.parse_args()

model, tok, d2 = load("models/target", "models/dflash2", dtype=args.dtype)
ps = [p["prompt"] for p in load_prompts(args.prompts, tok, args.n)]


def run(**kw):
    def go(p):
        t0 = c0 = last = None
        toks = []
        for r in stream_generate(model, tok, p, d2, max_tokens=args.max_tokens, **kw):
            if t0 is None:
                t0, c0 = time.perf_counter(), time.process_time()
            toks.append(r.token)
            last = r
        return toks, time.perf_counter() - t0, time.process_time() - c0, last.stats
    return go


methods = {"off": run(verify_mode="off"), "default": run()}
for w in [int(x) for x in args.widths.split(",")]:
    methods[f"w{w}"] = run(block_size=w, guard=False)
t = time.perf_counter()
methods["default"](ps[0])
print(f"first default call (calibration included if not cached): {time.perf_counter() - t:.2f} s")
for f in methods.values():
    f(ps[0])  # warm-up
tot = {k: [0, 0.0, 0.0, 0, 0] for k in methods}  # tokens, wall, cpu, cycle tokens, cycles
widths = {}
for rep in range(args.reps):
    for i, p in enumerate(ps):
        ks = list(methods)
        ks = ks[i % len(ks):] + ks[:i % len(ks)]
        want = None
        for k in ks:
            toks, w, c, st = methods[k](p)
            if k == "off":
                want = toks
            tot[k][0] += len(toks) - 1
            tot[k][1] += w
            tot[k][2] += c
            tot[k][3] += st.cycle_tokens
            tot[k][4] += st.cycles
            if k == "default":
                for x, n in ((st.adaptive or {}).get("widths") or {}).items():
                    widths[x] = widths.get(x, 0) + n
            methods[k].toks = toks
        base = methods["off"].toks
        for k in methods:
            assert methods[k].toks == base, f"{k} differs from plain decoding on prompt {i}"
b = tot["off"]
print(f"{args.prompts} x{args.n} prompts, {args.max_tokens} tokens, dtype {args.dtype or 'checkpoint'}; "
      f"plain {b[0] / b[1]:.1f} tok/s wall; all outputs identical to plain decoding")
print("| method | wall x plain | CPU x plain | tau (tokens per cycle, plain steps included) |")
print("|---|---|---|---|")
for k, v in tot.items():
    print(f"| {k} | {(v[0] / v[1]) / (b[0] / b[1]):.3f} | {(v[0] / v[2]) / (b[0] / b[2]):.3f} | {v[3] / max(v[4], 1):.2f} |")
print("default mode's DFlash cycles by width:", dict(sorted(widths.items())))
print("command: python " + " ".join(sys.argv))

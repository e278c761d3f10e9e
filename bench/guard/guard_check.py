"""The default mode (verify mode dflash, default width: policy.Guard) against
plain mlx-lm, our plain decoding and fixed width 5, side by side in one run on
the embedded pair: tokens per second after the first token, wall clock and
process CPU time (CPU time is less sensitive to other jobs on a shared machine).

    MLX_DFLASH_BLAS_THREADS=1 PYTHONPATH=. python bench/guard/guard_check.py gsm8k-dev 16 128 [--reps 2]
"""

import sys
import time

import mlx_dflash  # noqa: E402,F401
import mlx_lm  # noqa: E402

from app.bench.prompts import load_prompts  # noqa: E402
from mlx_dflash import load, stream_generate  # noqa: E402

model, tok, d2 = load("models/target", "models/dflash2")
spec, N, MT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
REPS = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 2
ps = [p["prompt"] for p in load_prompts(spec, tok, N)]
def run(gen):
    t0 = c0 = None; n = 0
    for r in gen:
        if t0 is None: t0, c0 = time.perf_counter(), time.process_time()
        n += 1; last = r
    return (n - 1), time.perf_counter() - t0, time.process_time() - c0, last
fns = {
 "mlx-lm": lambda p: run(mlx_lm.stream_generate(model, tok, p, max_tokens=MT)),
 "off": lambda p: run(stream_generate(model, tok, p, None, max_tokens=MT, verify_mode="off")),
 "default": lambda p: run(stream_generate(model, tok, p, d2, max_tokens=MT)),
 "w5": lambda p: run(stream_generate(model, tok, p, d2, max_tokens=MT, guard=False)),
}
t = time.perf_counter()
fns["default"](ps[0])
print("first default request (incl. calibration if not cached):", round(time.perf_counter() - t, 2), "s")
for f in fns.values(): f(ps[0])
tot = {k: [0, 0.0, 0.0] for k in fns}
last_reason = [""]
pol = []
for rep in range(REPS):
    for i, p in enumerate(ps):
        ks = list(fns); ks = ks[i % 4:] + ks[:i % 4]
        for k in ks:
            n, w, c, last = fns[k](p)
            tot[k][0] += n; tot[k][1] += w; tot[k][2] += c
            if k == "default":
                last_reason[0] = last.stats.policy
                if rep == 0:
                    pol.append((last.stats.plain_cycles, last.stats.cycles, round(last.stats.tau, 2)))
b = tot["mlx-lm"]
print(spec, "wall x mlx-lm:", {k: round((v[0] / v[1]) / (b[0] / b[1]), 3) for k, v in tot.items()})
print(spec, "cpu  x mlx-lm:", {k: round((v[0] / v[2]) / (b[0] / b[2]), 3) for k, v in tot.items()}, f"mlx-lm {b[0]/b[1]:.1f} tok/s wall")
print("default mode per prompt (plain cycles, cycles, tau), first pass:", pol)
print("guard's last reason:", stream_generate.__module__ and last_reason[0])
print("command:", " ".join(sys.argv), "| machine shared with other jobs; MLX_DFLASH_BLAS_THREADS =",
      __import__("os").environ.get("MLX_DFLASH_BLAS_THREADS"))

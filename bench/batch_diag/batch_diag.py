"""8 streams, one process: mlx-lm's BatchGenerator, our batch engine in the default mode (its guard's state carried
from run to run as a server carries it) and with verify mode off; wall time, the time until every stream
has its first token, and the decode phase's tok/s.

    MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. python bench/batch_diag/batch_diag.py 8 [DTYPE] [ROUNDS]
"""
import sys
import time

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from app.bench.batch import run_plain_batched
from app.bench.prompts import load_prompts
from mlx_dflash import DecodeConfig, load
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.engine.calibrate import Calibration
from mlx_dflash.models.discovery import default_pair

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
T = 64
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
t, d = default_pair()
model, tok, drafter = load(str(t), str(d), dtype=sys.argv[2] if len(sys.argv) > 2 else "float32")
ps = [p["prompt"] if isinstance(p["prompt"], list) else tok.encode(p["prompt"]) for p in load_prompts("gsm8k-dev", tok, N)]
print("prompt lens", [len(p) for p in ps])
CAL = Calibration()  # one for every run: the guard's state carries from run to run, as in a server

def eng_run(drafter_, mode):
    eng = BatchEngine(model, tok, drafter_, max_batch=len(ps), calibration=CAL)
    t0 = time.perf_counter(); times = {}; last = {}
    uids = [eng.submit(p, DecodeConfig(max_tokens=T, verify_mode=mode)) for p in ps]
    def got(u, r):
        times.setdefault(u, []).append(time.perf_counter()); last[u] = r.stats
    steps = 0
    while len(eng):
        eng.step(got); steps += 1
    return [times[u] for u in uids], t0, time.perf_counter() - t0, last[uids[-1]].policy, steps

def split(times, t0, wall):
    first = max(ts[0] for ts in times) - t0
    ntok = sum(len(ts) for ts in times)
    return f"wall {wall:.2f}s  all-first {first:.2f}s  agg {ntok/wall:.1f} tok/s  decode-phase {(ntok-len(times))/(wall-first):.1f} tok/s"

for rep in range(ROUNDS):
    tm, ids, t0, wall = run_plain_batched(model, tok, ps, T)
    print("mlx-lm BatchGenerator:", split(tm, t0, wall), flush=True)
    for name, dr, mode in [("ours default", drafter, "dflash"), ("ours off+drafter", drafter, "off")]:
        tm, t0, wall, why, steps = eng_run(dr, mode)
        print(f"{name}:", split(tm, t0, wall), "steps", steps, "|", why, flush=True)

"""Where the default's plain steps at 8 rows go beside verify mode off's: the
same 8 GSM8K-dev prompts as batch_diag.py, 64 tokens, the guard warmed into
plain by 3 runs, then ROUNDS runs of each mode, alternating, with the engine's
and the guard's calls timed in place (ms per run; nested: _feed runs inside
_plain, inside step; the guard's decide inside _plain, its observe, reason and
summary inside _account; the lookup index inside _emit).

    MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. python bench/batch_diag/parts.py [ROUNDS]
"""
import functools
import statistics
import sys
import time

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from app.bench.prompts import load_prompts
from mlx_dflash import DecodeConfig, load
from mlx_dflash.drafting.lookup import NgramIndex
from mlx_dflash.engine.batch import BatchEngine
from mlx_dflash.engine.calibrate import Calibration
from mlx_dflash.engine.engine import Engine
from mlx_dflash.models.discovery import default_pair
from mlx_dflash.policy.guard import Guard

T, ROUNDS = 64, int(sys.argv[1]) if len(sys.argv) > 1 else 12
CALLS = [(Engine, m) for m in ("step", "_prefill", "_plain", "_feed", "_account", "_emit")] + \
    [(Guard, m) for m in ("decide", "observe", "reason", "summary")] + [(NgramIndex, m) for m in ("append", "match")]
spent = {}


def timed(cls, name):
    f = getattr(cls, name)

    @functools.wraps(f)
    def call(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            key = f"{cls.__name__}.{name}"
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t
    setattr(cls, name, call)


def run(mode):
    eng = BatchEngine(model, tok, drafter, max_batch=len(ps), calibration=CAL)
    t0 = time.perf_counter()
    for p in ps:
        eng.submit(p, DecodeConfig(max_tokens=T, verify_mode=mode))
    while len(eng):
        eng.step(lambda uid, r: None)
    return time.perf_counter() - t0


t, d = default_pair()
model, tok, drafter = load(str(t), str(d), dtype="float32")
ps = [p["prompt"] if isinstance(p["prompt"], list) else tok.encode(p["prompt"]) for p in load_prompts("gsm8k-dev", tok, 8)]
CAL = Calibration()  # one for every run: the guard's state carries from run to run, as in a server
for _ in range(3):
    run("dflash")
for cls, name in CALLS:
    timed(cls, name)
walls, parts = {"dflash": [], "off": []}, {"dflash": {}, "off": {}}
for _ in range(ROUNDS):
    for mode in walls:
        spent.clear()
        walls[mode].append(run(mode))
        for k, v in spent.items():
            parts[mode][k] = parts[mode].get(k, 0.0) + v / ROUNDS
for mode, w in walls.items():
    print(f"{mode}: wall median {statistics.median(w) * 1000:.1f} ms a run; in place, mean ms a run:",
          {k: round(v * 1000, 1) for k, v in sorted(parts[mode].items())})
print(f"off / default, medians: {statistics.median(walls['off']) / statistics.median(walls['dflash']):.3f}")

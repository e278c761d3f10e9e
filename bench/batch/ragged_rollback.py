"""The ragged rollback's price (bench/batch.md, "The ragged rollback's price"): a
[B, w] verify, its rollback and the next 1-token step on the embedded pair, when
every row drops the same count (the caches' own trim) vs when rows drop
different counts (rows rolled right by the difference), median of 5.

    PYTHONPATH=. python bench/batch/ragged_rollback.py"""

from __future__ import annotations

import argparse
import json
import random
import time

import mlx_dflash  # noqa: F401  (fast BLAS before mlx)
import mlx.core as mx
from mlx_dflash.engine import batch_cache as bc
from mlx_dflash.models.loader import load
from mlx_dflash.target.adapter import Target


def rollback_cost(model, B: int, context: int, w: int, rounds: int = 5) -> dict:
    t = Target(model)
    ids = ((mx.arange(context) * 7919 + 11) % t.vocab_size).tolist()
    cache = None
    for _ in range(B):
        c = t.make_cache()
        t(mx.array(ids)[None], c)
        mx.eval([x.state for x in c])
        cache = bc.join(cache, bc.to_batch(c))
    rng = random.Random(0)

    def one(ragged):
        drop = [rng.randrange(w) for _ in range(B)] if ragged else [w // 2] * B
        t0 = time.perf_counter()
        logits, _ = t(mx.zeros((B, w), mx.int32), cache)
        mx.eval(logits)
        bc.ragged_trim(cache, drop)
        logits, _ = t(mx.zeros((B, 1), mx.int32), cache)
        mx.eval(logits)
        dt = time.perf_counter() - t0
        bc.ragged_trim(cache, [w - d for d in drop])  # back to the same length (keeps the test stationary)
        bc.ragged_trim(cache, [1] * B)
        return dt

    one(False), one(True)
    same, ragged = [], []
    for _ in range(rounds):
        same.append(one(False))
        ragged.append(one(True))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"B": B, "context": context, "w": w, "uniform_ms": 1000 * med(same), "ragged_ms": 1000 * med(ragged),
            "slots": bc.size(cache)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    model, _, _ = load(dtype=a.dtype)
    for ctx in (256, 1024, 4096):
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                          for k, v in rollback_cost(model, 8, ctx, 5).items()}), flush=True)


if __name__ == "__main__":
    main()

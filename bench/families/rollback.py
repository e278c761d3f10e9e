"""Recurrent rollback cost at hidden 512 (issue 23 item 5): dropping the
rejected rows of a verify (evaluated) as a share of that verify (evaluated),
for gated-delta, Mamba2 and short-conv hybrids, median of --rounds rounds.

    MLX_DFLASH_BLAS_THREADS=1 PYTHONPATH=. python bench/families/rollback.py [--rounds 15] [--families a,b] [--verify-cpu]

--verify-cpu: instead, the median CPU time (process_time, less sensitive to a
shared machine than wall time) of the 8- and 16-row verify forward alone.
--in-loop: instead, the rollback's marginal cost where the decode loop pays it:
left lazy (as decoder.py leaves it) and evaluated with the next 1-token step,
against the same step after the same verify without a rollback (paired per
round), as a share of the verify.

Uses bench_families' models (MEDIUM) and timing (rollback_cost)."""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
import mlx_dflash  # noqa: E402  (fast BLAS before mlx)
import mlx.core as mx  # noqa: E402
from families import MEDIUM, eval_cache, kinds, prefilled, rollback_cost, timed_verify  # noqa: E402
from tests.tiny_families import build  # noqa: E402

SHAPES = [(8, 4), (16, 8), (16, 1), (16, 15)]


def verify_cpu(model, rounds: int, width: int, context: int = 256) -> float:
    """Median CPU seconds of one evaluated verify forward of `width` rows."""
    t, cache = prefilled(model, context)
    block = mx.arange(100, 100 + width)[None]
    ts = []
    for _ in range(rounds):
        restore = t.checkpoint(cache)
        c0 = time.process_time()
        logits, _ = t(block, cache, [0])
        mx.eval(logits)
        eval_cache(cache)
        ts.append(time.process_time() - c0)
        restore()
    return sorted(ts)[len(ts) // 2]


def in_loop_cost(model, rounds: int, width: int, keep: int, context: int = 256):
    """(median paired marginal seconds of a lazy rollback evaluated with the next
    1-token step, median verify seconds)."""
    t, cache = prefilled(model, context)
    block = mx.arange(100, 100 + width)[None]
    diffs, tv = [], []
    for r in range(rounds + 3):
        step = {}
        for rollback in (False, True):
            restore = t.checkpoint(cache)
            v = timed_verify(t, block, cache)
            t1 = time.perf_counter()
            if rollback:
                t.trim(cache, width - keep)
            nxt, _ = t(mx.array([[7]]), cache, [0])
            mx.eval(nxt)
            eval_cache(cache)
            step[rollback] = time.perf_counter() - t1
            restore()
            if r >= 3:
                tv.append(v)
        if r >= 3:
            diffs.append(step[True] - step[False])
    diffs.sort()
    tv.sort()
    return diffs[len(diffs) // 2], tv[len(tv) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--families", default="qwen3_next,nemotron_h,falcon_h1,lfm2")
    ap.add_argument("--verify-cpu", action="store_true")
    ap.add_argument("--in-loop", action="store_true")
    a = ap.parse_args(argv)
    print(f"# mlx_dflash from {Path(mlx_dflash.__file__).parent}; mlx {mx.__version__}, {platform.machine()}, "
          f"{mx.default_device()}")
    if a.verify_cpu:
        for fam in a.families.split(","):
            model = build(fam, **MEDIUM[fam])
            cells = [f"{w} rows {1e3 * verify_cpu(model, a.rounds, w):.1f} ms" for w in (8, 16)]
            print(f"{fam} verify CPU: " + ", ".join(cells), flush=True)
        return
    cost = (lambda m, w, k: in_loop_cost(m, a.rounds, w, k)) if a.in_loop else \
        (lambda m, w, k: rollback_cost(m, a.rounds, w, k, context=256))
    print("| family | cache kinds | " + " | ".join(f"{w} verified, {k} kept" for w, k in SHAPES) + " |")
    print("|---|---|" + "---|" * len(SHAPES))
    for fam in a.families.split(","):
        model = build(fam, **MEDIUM[fam])
        cells = []
        for w, k in SHAPES:
            got, tv = cost(model, w, k)
            share = got / tv if a.in_loop else got
            cells.append(f"{100 * share:.1f}% (verify {tv * 1e3:.1f} ms)")
        print(f"| {fam} | {kinds(model)} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""Draft cost d against context length, with the drafter's context unbounded
and bounded to a sink + window (issue 23; bench/long_context.md).

A DFlash 2 drafter of the published shape for a Qwen3-0.6B-shaped target
(app/bench/realistic.py's build_target / build_drafter: random weights, cost
does not depend on them) gets `n` context rows (random target features), then
each timed draft takes `new` fresh rows into its context and runs the drafter's
forward over a block of `width` (the context update and the layers: the part of
a draft that depends on the context; the target head and the DFlash 2 selector
after it do not), evaluated. Median of `reps` drafts after a warm-up.

    PYTHONPATH=. python bench/long_context/long_context.py [--contexts 1024,8192,32768] [--window 1024 --sink 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


import mlx_dflash  # noqa: E402,F401 (first: it binds mlx-cpu to the fast BLAS, fastblas.py)
import mlx.core as mx  # noqa: E402

from app.bench.realistic import build_drafter, build_target  # noqa: E402
from mlx_dflash.target.adapter import Target  # noqa: E402


def fill(drafter, target, cache, n: int, feat_dim: int, chunk: int = 4096) -> None:
    """`n` context rows into `cache`, a chunk at a time (as a long prefill hands them over)."""
    done = 0
    while done < n:
        k = min(chunk, n - done)
        feats = mx.random.normal((1, k, feat_dim), key=mx.random.key(done))
        mx.eval(drafter(target.embed(mx.array([[1, 2]])), feats, cache))
        done += k


def draft_cost(drafter, target, cache, width: int, new: int, reps: int, feat_dim: int) -> float:
    """Seconds of the drafter's forward: the context update and the layers, the
    part of a draft that depends on the context (the target head and the
    selector that follow it do not)."""
    times = []
    block = target.embed(mx.array([[7] + [drafter.config.mask_token_id] * (width - 1)]))
    mx.eval(block)
    for i in range(reps + 2):
        feats = mx.random.normal((1, new, feat_dim), key=mx.random.key(10_000 + i))
        mx.eval(feats)
        t = time.perf_counter()
        mx.eval(drafter(block, feats, cache))
        if i >= 2:  # warm-up: the first calls at a new shape compile
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen3-0.6b")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--new", type=int, default=6, help="context rows each draft takes in (accepted + anchor)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--bounded-only", action="store_true",
                    help="skip the unbounded runs (minutes at 64k on a CPU)")
    a = ap.parse_args(argv)
    model = build_target(a.target, a.dtype)
    target = Target(model)
    drafter = build_drafter(model, a.layers, a.dtype)
    feat_dim = len(drafter.config.target_layer_ids) * target.hidden_size
    print(f"target {a.target} shape, drafter {a.layers} layers, width {a.width}, {a.new} new rows per draft, "
          f"{a.dtype}, device {mx.default_device()}")
    print("| context | drafter forward, unbounded (ms) | window {} + sink {} (ms) | context cache MB unbounded / bounded |"
          .format(a.window, a.sink))
    print("|---|---|---|---|")
    for n in [int(x) for x in a.contexts.split(",")]:
        row = []
        sizes = []
        for layout in ((None, 0), (a.window, a.sink))[a.bounded_only:]:
            cache = drafter.make_cache(*layout)
            fill(drafter, target, cache, n, feat_dim)
            row.append(draft_cost(drafter, target, cache, a.width, a.new, a.reps, feat_dim) * 1e3)
            sizes.append(sum(c.nbytes for c in cache) / 2**20)
            del cache
        if a.bounded_only:
            row, sizes = [float("nan")] + row, [float("nan")] + sizes
        print(f"| {n} | {row[0]:.1f} | {row[1]:.1f} | {sizes[0]:.0f} / {sizes[1]:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What the drafter's catch-up costs: a draft that first takes in n context rows
(a prompt's window, or the rows plain steps captured since its last draft) against
one that takes in none, in plain steps of the target, on the realistic bench's
targets and drafters (random weights, the published layouts at hidden 512).

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \
        python bench/guard_sim/catch_up/catch_up.py qwen3-small
"""
from mlx_dflash.platform import fastblas  # noqa: F401  (before mlx: the BLAS shim binds)

import statistics
import sys
import time

import mlx.core as mx

from app.bench.realistic import build_drafter, build_target
from app.bench.runs import fastest_plain
from mlx_dflash import DecodeConfig
from mlx_dflash.target.adapter import Target


def main(name: str) -> None:
    model = build_target(name, "float32")
    dr = build_drafter(model, 5, "float32")
    fastest_plain(model)
    t, cap = Target(model), list(dr.config.target_layer_ids)
    cache = t.make_cache()
    ids = (mx.arange(1024) * 7919 + 11) % t.vocab_size
    _, feats = t(ids[None], cache, cap)
    mx.eval(feats)

    def step():
        t0 = time.perf_counter()
        mx.eval(*t(mx.array([[5]]), cache, cap))
        dt = time.perf_counter() - t0
        t.trim(cache, 1)
        return dt

    for _ in range(3):
        step()
    t1 = statistics.median(step() for _ in range(15))
    layout = DecodeConfig().drafter_layout
    print(f"{name}: plain step {t1 * 1e3:.2f} ms; drafter context (window, sink) {layout}")
    for n in (1, 16, 64, 256, sum(layout)):
        xs = []
        for _ in range(7):
            c = dr.make_cache(*layout)
            mx.eval(dr.propose(t, 1, feats[:, :64], c, 2).tokens)  # a context of 64 rows first
            f = mx.random.normal((1, n, feats.shape[2])).astype(feats.dtype)
            mx.eval(f)
            t0 = time.perf_counter()
            mx.eval(dr.propose(t, 1, f, c, 8).tokens)
            xs.append(time.perf_counter() - t0)
        d = statistics.median(xs[2:])
        print(f"  a width-8 draft taking in {n:5d} rows first: {d * 1e3:7.2f} ms = {d / t1:5.2f} plain steps")


if __name__ == "__main__":
    main(sys.argv[1])

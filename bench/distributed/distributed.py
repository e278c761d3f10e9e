"""Per-cycle cost of DFlash on a target split over two ranks, against the same
target in one process: the session's own verify (+ readback) at widths 1, 5, 8,
a draft, a pipelined plain token (calibrate.measure_costs, timed on all ranks
together), and the all_sum of [1, w, H] rows the forwards run (measured alone).

    PYTHONPATH=. python bench/distributed/distributed.py OUT.json                 # one process (the reference)
    mlx.launch --backend ring -n 2 --python $(which python) \\
        bench/distributed/distributed.py OUT.json --split tensor     # (or pipeline) two ranks; rank 0 writes

A random-weight Qwen2-shaped target (mlx-lm ModelArgs; qwen2 has both splits) and a random
DFlash 2 drafter; the numbers are costs, not acceptance."""

import argparse
import json
import platform
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import mlx_dflash  # noqa: E402,F401  (fast BLAS before mlx)
import mlx.core as mx  # noqa: E402
from tests.make_test_pair import make_drafter  # noqa: E402
from tests.tiny_families import build, config  # noqa: E402

from mlx_dflash.engine.calibrate import measure_costs  # noqa: E402
from mlx_dflash.engine.distributed import DistributedCalibration, ShardedTarget, forward_ops, measure_comm, split_model, world

SHAPE = dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=3072, num_attention_heads=16,
             num_key_value_heads=8, head_dim=64, vocab_size=16384)
WIDTHS = [1, 5, 8]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--split", default="tensor", choices=("tensor", "pipeline"))
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    cfg = config("qwen2", **SHAPE)
    model = build("qwen2", seed=0, dtype=mx.float32, **SHAPE)
    d = make_drafter(Path(tempfile.mkdtemp()) / "drafter", cfg, 4, version=2, block_size=8, layers=1, n_taps=4)
    d.config.target_layer_ids = [1, 3, 5, 6]
    d.set_dtype(mx.float32)
    group = world()
    res = {"machine": platform.platform(), "processor": platform.processor() or platform.machine(),
           "shape": SHAPE, "dtype": "float32", "drafter_taps": d.config.target_layer_ids}
    if group is None:
        c = measure_costs(model, d, max(WIDTHS), widths=WIDTHS, budget_s=float("inf"), min_rounds=a.rounds,
                          max_rounds=a.rounds)
        res.update(ranks=1, split=None, costs=c.to_json())
    else:
        split = split_model(model, group, a.split, seed=0)
        mx.eval(model.parameters())
        t = ShardedTarget(model, split)
        comm = measure_comm(split, t.hidden_size, t.dtype, widths=WIDTHS, reps=25)
        taps = measure_comm(split, t.hidden_size * len(d.config.target_layer_ids), t.dtype, widths=WIDTHS, reps=25)
        c = DistributedCalibration(split, rounds=a.rounds).costs(model, d, max(WIDTHS), widths=WIDTHS)
        res.update(ranks=split.size, split=split.mode, layers=[split.start, split.end], costs=c.to_json(),
                   all_sum_s={str(k): v for k, v in comm.per_op.items()},
                   taps_all_sum_s={str(k): v for k, v in taps.per_op.items()},
                   ops_per_forward=forward_ops(split))
        if group.rank() != 0:
            return
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()

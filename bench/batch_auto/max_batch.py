"""What `max_batch auto` picks for a model on this machine, and from what: the
plain batched step's seconds at 1, 2, 4, 8, 16 rows (the batch guard's curves,
mlx_dflash/engine/batch_costs.py), the aggregate gain of each doubling, the memory
budget. Measures in a scratch home (nothing cached is reused); --rounds N
repeats the whole measurement N times (the machine's load drifts)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile

os.environ["MLX_DFLASH_HOME"] = tempfile.mkdtemp(prefix="mlx-dflash-bench-")  # measure, never reuse

import mlx_dflash  # noqa: E402,F401  (fast BLAS before mlx)
from mlx_dflash import load  # noqa: E402
from mlx_dflash.engine.batch_costs import AUTO_B, BatchCosts, free_memory, pick_max_batch, row_bytes  # noqa: E402
from mlx_dflash.engine.calibrate import Calibration  # noqa: E402
from mlx_dflash.drafting.drafter import Drafter  # noqa: E402
from mlx_dflash.target.adapter import Target  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    model, tok, drafter = load(dtype=a.dtype)
    real = drafter if isinstance(drafter, Drafter) else None
    rb, free = row_bytes(Target(model)), free_memory()
    for r in range(a.rounds):
        os.environ["MLX_DFLASH_HOME"] = tempfile.mkdtemp(prefix="mlx-dflash-bench-")
        costs = BatchCosts(model, real, Calibration().book, real.block_size if real is not None else 1)
        steps = {B: costs.step_s(B) for B in AUTO_B}  # all of them, for the table (auto stops early)
        B, why = pick_max_batch(steps.__getitem__, rb, free)
        gains = {b: round((b / steps[b]) / ((b // 2) / steps[b // 2]), 3) for b in AUTO_B[1:]}
        print(json.dumps({"round": r, "step_ms": {b: round(1000 * t, 2) for b, t in steps.items()},
                          "gain_over_half": gains, "row_bytes": rb, "free_bytes": free, "picked": B, "why": why}),
              flush=True)


if __name__ == "__main__":
    main()

"""Recurrent rollback cost at hidden 512 (issue 23 item 5): dropping the
rejected rows of a verify (evaluated) as a share of that verify (evaluated),
for gated-delta, Mamba2 and short-conv hybrids, median of --rounds rounds.

    MLX_DFLASH_BLAS_THREADS=1 python scripts/bench_rollback.py [--rounds 15] [--families a,b]

Uses bench_families' models (MEDIUM) and timing (rollback_cost)."""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
import mlx_dflash  # noqa: E402  (fast BLAS before mlx)
import mlx.core as mx  # noqa: E402
from bench_families import MEDIUM, kinds, rollback_cost  # noqa: E402
from tiny_families import build  # noqa: E402

SHAPES = [(8, 4), (16, 8), (16, 1), (16, 15)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--families", default="qwen3_next,nemotron_h,falcon_h1,lfm2")
    a = ap.parse_args(argv)
    print(f"# mlx_dflash from {Path(mlx_dflash.__file__).parent}; mlx {mx.__version__}, {platform.machine()}, "
          f"{mx.default_device()}")
    print("| family | cache kinds | " + " | ".join(f"{w} verified, {k} kept" for w, k in SHAPES) + " |")
    print("|---|---|" + "---|" * len(SHAPES))
    for fam in a.families.split(","):
        model = build(fam, **MEDIUM[fam])
        cells = []
        for w, k in SHAPES:
            share, tv = rollback_cost(model, a.rounds, w, k, context=256)
            cells.append(f"{100 * share:.1f}% (verify {tv * 1e3:.1f} ms)")
        print(f"| {fam} | {kinds(model)} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

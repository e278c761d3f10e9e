"""A bench script, or any `mlx-dflash` command (first argument `cli`), with
every sample of what the guard's cycles paid logged (to UNIT_TRACE): the
cycle's seconds and price, the unit it was divided by (the set's timed plain
step, as bounded), the median of the timed steps, the plain step measured
apart at that length, and their ratio. How unit_bound/README.md's ranges
were read.

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \\
        python bench/guard_sim/unit_bound/unit_trace.py bench/short_answers/bench.py --passes 6
"""

import os
import runpy
import sys

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from mlx_dflash.policy.costs import median
from mlx_dflash.policy.guard import Guard

LOG = open(os.environ.get("UNIT_TRACE", "/tmp/unit_trace.log"), "w")
paid = Guard._paid


def _paid(self, key, secs, price, unit):
    B = key[0]
    timed, apart = median(self.plain_s[B]), self.step_s[B]
    paid(self, key, secs, price, unit)
    print(f"PAID B={B} drafting={key[1]} secs={secs * 1e3:.2f}ms price={price:.2f} "
          f"unit={unit * 1e3:.2f}ms timed={timed * 1e3:.2f}ms apart={apart * 1e3:.2f}ms "
          f"ratio={timed / apart:.2f} excess={self.excess[key][-1]:.2f} paid={self.paid[key]:.2f}",
          file=LOG, flush=True)


Guard._paid = _paid
if sys.argv[1] == "cli":
    from app.cli import main
    sys.argv = ["mlx-dflash"] + sys.argv[2:]
    main()
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")

"""The guard's curve at one length, measured as `measure_costs` measures it now
(the drafter's context bounded as a decode bounds it by default: a sink and a
window) and as it did before 2026-12-07 (the drafter attending to every
context row), on the embedded pair: a 1-token step, a pipelined plain token,
verifies and drafts in milliseconds.

    MLX_DFLASH_DTYPE=float32 MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=. \\
        python bench/long_context/curve_window.py 16384
"""

import dataclasses
import sys

import mlx_dflash  # noqa: F401  (first: it loads the fast BLAS, which must precede any import of mlx)
from mlx_dflash.engine import calibrate
from mlx_dflash.engine.decode_config import DecodeConfig
from mlx_dflash.models.manager import load_model
from mlx_dflash.models.settings_checks import settings_store


def whole_context(**kw):
    """DecodeConfig as calibrate built it before: the drafter over every context row."""
    return dataclasses.replace(DecodeConfig(**kw), drafter_window=None)


def main():
    n = int(sys.argv[1])
    lm = load_model(None, settings_store())
    for label, make in (("bounded (now)", DecodeConfig), ("whole context (before)", whole_context)):
        calibrate.DecodeConfig = make
        c = calibrate.measure_costs(lm.model, lm.drafter, context=n, widths=[1, 2, 3, 5, 8])
        ms = lambda curve: ", ".join(f"{w}: {v * c.t1 * 1e3:.1f}" for w, v in curve.items() if w > 1)  # noqa: E731
        print(f"{n} tokens, drafter context {label}: 1-token step {c.t1 * 1e3:.1f} ms, plain token "
              f"{c.t_plain * 1e3:.1f} ms; verify ms {ms(c.c)}; draft ms {ms(c.d)}", flush=True)


if __name__ == "__main__":
    main()

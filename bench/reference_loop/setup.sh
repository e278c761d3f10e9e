#!/usr/bin/env bash
# A bench environment of its own for bench/reference_loop/bench.py: the same mlx,
# mlx-lm and OpenBLAS as the project's venv, z-lab's `dflash` 0.1.0 from PyPI
# (--no-deps, as scripts/bootstrap.sh installs it: its pins on datasets/requests
# serve its own benchmark script, not dflash.model_mlx), and the project's runtime
# dependencies. The project's code is NOT installed: bench.py runs it from the
# checkout (PYTHONPATH), so one process times the checkout's loop and the
# reference's on the same model objects and the same BLAS shim.
#   usage: bench/reference_loop/setup.sh [ENV_DIR]   (default /work/benchenv/refloop)
set -euo pipefail
ENV=${1:-/work/benchenv/refloop}
python3.11 -m venv "$ENV"
"$ENV/bin/python" -m pip install -q --upgrade pip
"$ENV/bin/python" -m pip install -q "mlx[cpu]==0.32.4" mlx-lm==0.32.2 scipy-openblas32==0.3.34.481.3 \
  numpy==2.4.6 transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface_hub==2.4.0 \
  platformdirs filelock
"$ENV/bin/python" -m pip install -q --no-deps dflash==0.1.0
"$ENV/bin/python" -m pip freeze > "$(dirname "$0")/freeze.txt"
# The BLAS shim for this env's OpenBLAS (its own key: the library path), built and
# measured once at the thread counts bench.py runs with; both loops use it.
cd "$(dirname "$0")/../.."
MLX_DFLASH_BLAS_THREADS=1 MLX_DFLASH_KERNEL_THREADS=2 PYTHONPATH=$PWD "$ENV/bin/python" -m mlx_dflash.platform.fastblas

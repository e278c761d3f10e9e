#!/usr/bin/env bash
# One command for a fresh machine: make .venv, install the project (and, on
# Linux, the fast BLAS), then run the main job or the test suite.
#   scripts/bootstrap.sh          -> install, then `mlx-dflash chat`
#   scripts/bootstrap.sh test     -> install, then the whole test suite
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[dev]"
# Test-only: the z-lab reference (tests/test_reference.py). --no-deps: its pins on
# torch / datasets / requests are for its other backends, not the MLX model we check against.
.venv/bin/python -m pip install -q --no-deps dflash==0.1.0
.venv/bin/mlx-dflash doctor --quick >/dev/null  # builds the BLAS shim once (Linux)
case "${1:-run}" in
  test) shift; exec .venv/bin/python -m pytest -q "$@" ;;
  run)  shift || true; exec .venv/bin/mlx-dflash chat "$@" ;;
  *)    exec .venv/bin/mlx-dflash "$@" ;;
esac

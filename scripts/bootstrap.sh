#!/usr/bin/env bash
# One command for a fresh machine: make .venv, install the project (and, on
# Linux, the fast BLAS), then run the chat, the test suite or any mlx-dflash command.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: scripts/bootstrap.sh [MODE] [ARGS...]

Sets up .venv in this checkout (made and installed on the first run), then:

  scripts/bootstrap.sh                  install if needed, then `mlx-dflash chat`
  scripts/bootstrap.sh run [ARGS]       the same, ARGS passed to `mlx-dflash chat`
  scripts/bootstrap.sh test [ARGS]      install if needed, then the test suite (ARGS go to pytest)
  scripts/bootstrap.sh COMMAND [ARGS]   install if needed, then `mlx-dflash COMMAND ARGS`
                                        (e.g. `scripts/bootstrap.sh doctor`)
  scripts/bootstrap.sh install          install (again, even if nothing changed), then stop
  scripts/bootstrap.sh -h | --help      this help (`mlx-dflash --help` for the commands)

The install (pip install -e ".[dev]", ~1-2 minutes the first time) is skipped when
pyproject.toml and the installed version are what the last install recorded in
.venv/.bootstrap-stamp; editing code needs no reinstall (the install is editable).
Environment: PYTHON (the interpreter that makes .venv, default python3).
EOF
}

case "${1:-run}" in
  -h|--help|help) usage; exit 0 ;;
esac

PY=${PYTHON:-python3}
STAMP=.venv/.bootstrap-stamp

stamp() {  # what the install depends on: pyproject.toml, the installed version, the interpreter
  local hash
  hash=$("$PY" -c 'import hashlib,sys; print(hashlib.sha256(open("pyproject.toml","rb").read()).hexdigest())')
  local ver
  ver=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("mlx-dflash"))' 2>/dev/null || echo none)
  echo "$hash $ver $(.venv/bin/python -c 'import sys; print(sys.version.split()[0])')"
}

install() {
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  .venv/bin/python -m pip install -q -e ".[dev]"
  # Test-only: the z-lab reference (tests/test_reference.py). --no-deps: its pins on
  # torch / datasets / requests are for its other backends, not the MLX model we check against.
  .venv/bin/python -m pip install -q --no-deps dflash==0.1.0
  .venv/bin/mlx-dflash doctor --quick >/dev/null  # builds the BLAS shim once (Linux)
  stamp >"$STAMP"
}

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ "${1:-run}" = install ]; then
  install
  echo "installed; .venv is ready"
  exit 0
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$(stamp)" ]; then
  install
fi
case "${1:-run}" in
  test) shift; exec .venv/bin/python -m pytest -q "$@" ;;
  run)  shift || true; exec .venv/bin/mlx-dflash chat "$@" ;;
  *)    exec .venv/bin/mlx-dflash "$@" ;;
esac

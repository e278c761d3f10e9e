#!/usr/bin/env bash
# The GPU paths on a real GPU, in one run: on a Linux machine with an NVIDIA GPU
# it installs MLX's CUDA backend into the venv; on a Mac it uses Metal as it is.
# Then: the conv kernel's parity tests on the GPU (fused kernel vs MLX ops, every
# shape class the drafters use, fp32 / bf16 / fp16), the lossless test subset,
# `mlx-dflash doctor`, and the realistic-regime bench at Qwen3-4B and Qwen3-8B
# shapes in bf16 (c(w), d, speedup, efficiency). Writes bench/gpu/<machine>/ and
# prints a one-screen summary. Budget: under 8 minutes on an H200 (each step has a
# time limit; a step past it is reported as TIMEOUT and the next one runs).
#
#   scripts/gpu_check.sh                  # the whole check (Mac, or Linux + NVIDIA)
#   scripts/gpu_check.sh --skip-install   # the CUDA backend is installed already
#   scripts/gpu_check.sh --cpu            # the same steps on the CPU (no install, small bench):
#                                         # checks the script itself where there is no GPU
# Environment: PYTHON (default .venv/bin/python), OUT (default bench/gpu/<machine>).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

INSTALL=1
CPU=0
for a in "$@"; do
  case "$a" in
    --skip-install) INSTALL=0 ;;
    --cpu) CPU=1; INSTALL=0 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option '$a' (--skip-install, --cpu)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-.venv/bin/python}
if [[ ! -x "$PY" ]]; then
  echo "gpu_check.sh: no $PY; run scripts/bootstrap.sh first (or set PYTHON)" >&2
  exit 2
fi
export HF_HUB_OFFLINE=1
export MLX_DFLASH_HOME="${MLX_DFLASH_HOME:-$(mktemp -d -t mlx-dflash-gpu-XXXXXX)}"  # costs, settings: scratch

OS=$(uname -s)
if [[ $CPU == 1 ]]; then
  KIND=cpu
  MACHINE="cpu-$(uname -m)-$(nproc 2>/dev/null || sysctl -n hw.ncpu)cores"
elif [[ $OS == Darwin ]]; then
  KIND=metal
  MACHINE=$(sysctl -n machdep.cpu.brand_string 2>/dev/null || echo "mac")
elif command -v nvidia-smi >/dev/null 2>&1; then
  KIND=cuda
  MACHINE=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  export MLX_DFLASH_REFERENCE_BLAS=1  # the CPU BLAS shim is for mlx-cpu; the CUDA build brings its own
else
  echo "gpu_check.sh: no GPU found (not a Mac, no nvidia-smi); --cpu runs the steps on the CPU" >&2
  exit 2
fi
SLUG=$(echo "$MACHINE" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/^-//; s/-$//')
OUT=${OUT:-bench/gpu/$SLUG}
mkdir -p "$OUT"
START=$(date +%s)
declare -a ROWS=()

step() {  # step NAME SECONDS CMD... : run with a time limit, log to $OUT/NAME.log, record the result
  local name=$1 limit=$2
  shift 2
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local verdict=PASS
  if [[ $rc == 124 ]]; then verdict="TIMEOUT (${limit}s)"; elif [[ $rc != 0 ]]; then verdict="FAIL (rc $rc)"; fi
  ROWS+=("$(printf '%-10s %-16s %4ss  %s' "$name" "$verdict" "$dt" "$(tail -1 "$OUT/$name.log" | cut -c1-70)")")
  return $rc
}

if [[ $KIND == cuda && $INSTALL == 1 ]]; then
  # the driver's CUDA (nvidia-smi header) picks the wheel: mlx[cuda13] or mlx[cuda12], same version as mlx
  CU=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
  [[ ${CU:-12} -ge 13 ]] && CU=13 || CU=12
  VER=$("$PY" -c 'import importlib.metadata as m; print(m.version("mlx"))')
  # (mlx-cpu's CPU-only library would shadow the CUDA one); `timeout` runs commands, not functions
  step install 150 bash -c "'$PY' -m pip uninstall -y mlx-cpu >/dev/null 2>&1;
    '$PY' -m pip install 'mlx[cuda$CU]==$VER' || '$PY' -m pip install 'mlx-cuda-$CU==$VER'"
fi

case $KIND in
  cuda) want='mx.cuda.is_available()' ;;
  metal) want='mx.metal.is_available()' ;;
  *) want='True' ;;
esac
if ! step backend 30 "$PY" -c "import mlx_dflash, mlx.core as mx; from mlx_dflash.drafting.conv import kernel_backend
assert $want, 'the $KIND backend is not available'
print('mlx', mx.__version__, mx.default_device(), 'conv kernel:', kernel_backend())"; then
  printf '%s\n' "${ROWS[@]}"
  echo "gpu_check.sh: the $KIND backend does not load; see $OUT/backend.log" >&2
  exit 1
fi

# 1. the conv kernel against the ops path on this device (tests/test_conv.py's CPU-path assertion excluded)
step conv 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_conv_gpu.py tests/test_conv.py \
  -k "not ops_path_is_the_cpu_path"
# 2. lossless: greedy token for token with mlx-lm, rejection sampling's distribution
if [[ $KIND == cpu ]]; then  # (a CPU is slow at this: the plumbing, not the GPU paths)
  step lossless 900 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_lossless.py
  step doctor 300 bash -c "'$PY' -m app.cli doctor --json --quick >'$OUT/doctor.json'"
else
  step lossless 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_lossless.py tests/test_sampling.py
  # 3. doctor
  step doctor 60 bash -c "'$PY' -m app.cli doctor --json >'$OUT/doctor.json'"
fi
# 4. the realistic regime at published shapes
if [[ $KIND == cpu ]]; then
  step bench 900 "$PY" -m app.cli bench --realistic --targets qwen3-0.6b --dtype float32 --quick \
    --realistic-widths 5 --out "$OUT/realistic"
else
  step bench 210 "$PY" -m app.cli bench --realistic --targets qwen3-4b,qwen3-8b --dtype bfloat16 \
    --num-prompts 2 --max-tokens 96 --realistic-widths 5,8,16 --out "$OUT/realistic"
fi

TOTAL=$(( $(date +%s) - START ))
{
  echo "# gpu_check: $MACHINE ($KIND), $(date -u '+%Y-%m-%d %H:%M UTC'), ${TOTAL}s"
  echo
  echo '```'
  head -1 "$OUT/backend.log"
  printf '%s\n' "${ROWS[@]}"
  echo '```'
  if [[ -f $OUT/realistic/results.md ]]; then
    echo
    grep -E '^\|' "$OUT/realistic/results.md" | head -24
  fi
} >"$OUT/summary.md"
cat "$OUT/summary.md"
echo
echo "logs and results: $OUT/"
grep -q -E 'FAIL|TIMEOUT' <(printf '%s\n' "${ROWS[@]}") && exit 1
exit 0

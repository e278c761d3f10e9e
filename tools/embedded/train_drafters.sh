#!/usr/bin/env bash
# The exact commands that made the embedded DFlash 1 and DFlash 2 drafters
# (models/dflash1, models/dflash2) for models/target, and their benchmark.
# An honest ablation: both drafters share the layers, block size, data, step
# cap, time budget, seed and initial weights (DFlash 2 starts as the DFlash 1
# function). The defaults are the shipped run's (session 4, models/*/README.md;
# there DFlash 2 stopped on the time budget and was continued with --resume
# --time-budget 60 to DFlash 1's 3000 steps: the same step budget).
#
#   python -m tools.embedded train-drafters            # everything
#   STAGE=train python -m tools.embedded train-drafters # from a stage: data | gen | train | export | bench
#                                               (UNTIL=stage: up to and including it)
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. OPENBLAS_NUM_THREADS=1   # mlx-cpu elementwise ops are single-threaded anyway
PY=${PY:-python}
TARGET=${TARGET:-models/target}
RUN=${RUN:-runs/drafters}
STEPS=${STEPS:-3000}
BUDGET=${BUDGET:-50}            # minutes per drafter: whichever of STEPS and BUDGET comes first ends it
STAGE=${STAGE:-data} UNTIL=${UNTIL:-bench}
GSM=${GSM:-5000} CODE=${CODE:-1500} GEN_TOKENS=${GEN_TOKENS:-256} GEN_TIMEOUT=${GEN_TIMEOUT:-900}
MODELS=${MODELS:-models} BENCH=${BENCH:-bench/tau_ablation}
mkdir -p "$RUN"
stages=(data gen train export bench)
idx() { for i in "${!stages[@]}"; do [[ ${stages[$i]} == "$1" ]] && echo "$i"; done; }
at() { local i; i=$(idx "$1"); (( i >= $(idx "$STAGE") && i <= $(idx "$UNTIL") )); }

# 1. prompts (GSM8K train questions, stdlib function headers) and a corpus of the
#    target's own training text; the GSM8K dev split is never used.
if at data; then
  $PY -m tools.embedded drafter-data "$RUN/data" --gsm "$GSM" --code "$CODE" --corpus-gsm 150 --corpus-code 60
fi

# 2. on-policy responses: the target answers greedily (<= 256 tokens), batched;
#    two processes (one per prompt file), then one prompt file + one response cache.
if at gen; then
  for s in gsm code; do   # time-boxed; the caches are resumable (rerun STAGE=gen to complete them)
    timeout "$GEN_TIMEOUT" $PY -m app.cli train-drafter --target "$TARGET" --out "$RUN/gen" --generate-only --quiet \
      --prompts "$RUN/data/prompts_$s.jsonl" --responses "$RUN/data/responses_$s.jsonl" \
      --gen-max-tokens "$GEN_TOKENS" --gen-batch 32 > "$RUN/gen_$s.log" 2>&1 &
  done
  wait || true
  $PY -m tools.embedded merge-responses "$RUN/data" gsm code
fi

# 3. both drafters at once (one core each), same everything but --version; the
#    target features of every row are computed once into a shared cache.
COMMON=(--target "$TARGET" --responses "$RUN/data/responses.jsonl"
        --corpus "$RUN/data/corpus.jsonl" --feature-cache "$RUN/features.npy"
        --block-size 8 --layers 2 --seq-len 256 --batch 4 --anchors 48 --steps "$STEPS" --lr 2e-3
        --selector-weight 0.5 --seed 0 --log-every 10 --eval-every 100 --ckpt-every 100
        --time-budget "$BUDGET" --quiet)
if at train; then
  for v in 1 2; do
    nohup $PY -m app.cli train-drafter "${COMMON[@]}" --version $v --out "$RUN/dflash$v" \
      > "$RUN/dflash$v.log" 2>&1 &
  done
  wait
fi

# 4. export (bf16 weights + config, metrics log, loss curve) into models/
if at export; then
  for v in 1 2; do
    mkdir -p "$MODELS/dflash$v"
    cp "$RUN/dflash$v/"{config.json,model.safetensors,train_log.jsonl,loss.png} "$MODELS/dflash$v/"
  done
fi

# 5. greedy tau of both drafters and tok/s against plain decoding, then the model cards
if at bench; then
  # two processes: plain + DFlash 2 together (their tok/s are compared), DFlash 1 beside them
  BARGS=(--target "$TARGET" --dflash1 "$MODELS/dflash1" --dflash2 "$MODELS/dflash2"
         --gsm 30 --humaneval 20 --max-tokens 128 --widths 5 8)
  $PY -m tools.embedded tau "${BARGS[@]}" --configs plain dflash2 --out "$RUN/bench_a" > "$RUN/bench_a.log" 2>&1 &
  $PY -m tools.embedded tau "${BARGS[@]}" --configs dflash1 --out "$RUN/bench_b" > "$RUN/bench_b.log" 2>&1 &
  wait
  $PY -m tools.embedded tau --merge "$RUN/bench_a.json" "$RUN/bench_b.json" --out "$BENCH"
  note=(); [[ -n ${NOTE:-} ]] && note=(--note "$NOTE")   # NOTE: how the run went, for the cards
  for v in 1 2; do
    $PY -m tools.embedded drafter-card "$MODELS/dflash$v" --run "$RUN/dflash$v" --bench "$BENCH.json" ${note[@]+"${note[@]}"}
  done
fi

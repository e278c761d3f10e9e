#!/usr/bin/env bash
# Refresh the embedded DFlash 2 drafter after its target changed (issue 22 item 6):
# fine-tune the published drafter (`--init models/dflash2`) on the NEW
# target's own greedy responses, at a lower lr, for a time budget. Sized for a
# busy 2-core machine: one process at a time throughout.
#
#   python -m tools.embedded refresh-drafter             # data, gen, train, bench (export is by hand, below)
#   STAGE=train python -m tools.embedded refresh-drafter # from a stage: data | gen | train | bench | export
#                                                (UNTIL=stage: up to and including it)
#
# The bench runs the OLD drafter (a copy in $RUN/old) and the NEW one on the same
# prompts (tau.py's dflash1 slot holds the old DFlash 2 drafter), in two parts
# merged into one result: plain + old (it may run while the training does), then new.
# Export (STAGE=export UNTIL=export) only once the bench shows HumanEval tau up and
# GSM8K tau not down; the card is then written by tools/embedded/drafter_card.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. OPENBLAS_NUM_THREADS=1
PY=${PY:-python}
TARGET=${TARGET:-models/target}
INIT=${INIT:-models/dflash2}
RUN=${RUN:-runs/refresh}
STEPS=${STEPS:-3000} BUDGET=${BUDGET:-25} LR=${LR:-7e-4}   # minutes of training; whichever of STEPS/BUDGET first
STAGE=${STAGE:-data} UNTIL=${UNTIL:-bench}
GSM=${GSM:-1500} CODE=${CODE:-600} TOOLS=${TOOLS:-150} GEN_TOKENS=${GEN_TOKENS:-256}
# seconds per prompt set, in order (the session-9 run's: a second code box after GSM8K)
GEN_BOXES=${GEN_BOXES:-"code=780 tools=260 gsm=540 code=300"}
MODELS=${MODELS:-models} BENCH=${BENCH:-bench/tau_embedded_tools_refresh.json}
mkdir -p "$RUN"
stages=(data gen train bench export)
idx() { for i in "${!stages[@]}"; do [[ ${stages[$i]} == "$1" ]] && echo "$i"; done; }
at() { local i; i=$(idx "$1"); (( i >= $(idx "$STAGE") && i <= $(idx "$UNTIL") )); }

# 1. prompts: GSM8K train questions, stdlib function headers, tool conversations cut
#    before an assistant turn (rendered with the target's own tool chat template),
#    and a small corpus of the target's training text. The GSM8K dev split is never used.
if at data; then
  $PY -m tools.embedded drafter-data "$RUN/data" --gsm "$GSM" --code "$CODE" --corpus-gsm 150 --corpus-code 60 \
    --tools "$TOOLS" --tool-tokenizer "$TARGET" --tool-max-chars 3000
  cp -r "$INIT" "$RUN/old"   # the weights before the refresh, for the bench and the card
fi

# 2. on-policy responses of the NEW target, greedy (<= 256 tokens), batched, ONE process
#    at a time: code first (its acceptance fell most), then tools, then GSM8K, each in its
#    own time box (seconds). The caches are resumable: rerun STAGE=gen UNTIL=gen to extend them.
if at gen; then
  for box in $GEN_BOXES; do
    s=${box%%=*} secs=${box#*=}
    timeout "$secs" $PY -m app.cli train-drafter --target "$TARGET" --out "$RUN/gen" --generate-only --quiet \
      --prompts "$RUN/data/prompts_$s.jsonl" --responses "$RUN/data/responses_$s.jsonl" \
      --gen-max-tokens "$GEN_TOKENS" --gen-batch 32 >> "$RUN/gen_$s.log" 2>&1 || true
  done
  $PY -m tools.embedded merge-responses "$RUN/data" gsm code tools
fi

# 3. fine-tune from the published drafter: same architecture (checked by --init),
#    the shipped run's settings but a lower peak lr and a time budget.
if at train; then
  $PY -m app.cli train-drafter --target "$TARGET" --init "$INIT" --version 2 --out "$RUN/dflash2" \
    --responses "$RUN/data/responses.jsonl" --corpus "$RUN/data/corpus.jsonl" --feature-cache "$RUN/features.npy" \
    --block-size 8 --layers 2 --seq-len 256 --batch 4 --anchors 48 --steps "$STEPS" --lr "$LR" \
    --selector-weight 0.5 --seed 0 --log-every 10 --eval-every 100 --ckpt-every 100 \
    --time-budget "$BUDGET" --quiet ${RESUME:+--resume} >> "$RUN/dflash2.log" 2>&1
fi

# 4. greedy tau, old (dflash1 slot) vs refreshed (dflash2 slot), same prompts; the merge
#    checks every output against plain decoding's.
BARGS=(--target "$TARGET" --gsm 10 --humaneval 10 --max-tokens 128 --widths 5 8)
if at bench; then
  [[ -f $RUN/bench_old.json ]] || $PY -m tools.embedded tau "${BARGS[@]}" --dflash1 "$RUN/old" --dflash2 "$RUN/old" \
    --configs plain dflash1 --out "$RUN/bench_old" > "$RUN/bench_old.log" 2>&1
  $PY -m tools.embedded tau "${BARGS[@]}" --dflash1 "$RUN/old" --dflash2 "$RUN/dflash2" \
    --configs dflash2 --out "$RUN/bench_new" > "$RUN/bench_new.log" 2>&1
  $PY -m tools.embedded tau --merge "$RUN/bench_new.json" "$RUN/bench_old.json" --out "$RUN/bench"
fi

# 5. export (bf16 weights + config, metrics log, loss curve), the bench result and the card
if at export; then
  cp "$RUN/dflash2/"{config.json,model.safetensors,train_log.jsonl,loss.png} "$MODELS/dflash2/"
  cp "$RUN/bench.json" "$BENCH"
  note=(); [[ -n ${NOTE:-} ]] && note=(--note "$NOTE")   # NOTE: how the run went, for the card
  $PY -m tools.embedded drafter-card "$MODELS/dflash2" --run "$RUN/dflash2" --bench "$BENCH" --before-after "$BENCH" \
    --commands tools/embedded/refresh_drafter.sh ${note[@]+"${note[@]}"}
fi

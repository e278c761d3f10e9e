#!/usr/bin/env bash
# Phase 4 of the embedded target (session 4): sequence-level unlikelihood
# (Welleck et al. 2019) on the loops its own greedy decoding falls into, mixed
# with the usual next-token loss on the training text. A round penalizes the
# model's own looping responses to training prompts (never the GSM8K dev split):
#   round 1 (shipped): the phase-3 target's responses made by
#            tools/embedded/train_drafters.sh (stage gen, session 3): exact loops only;
#   round 2 (ROUNDS=2; tried, not shipped: models/target/README.md): fresh
#            responses of the round-1 model to other training prompts, plus round
#            1's: exact loops and every token completing a repeated 8-gram.
# Starts from the phase-3 checkpoint in runs/target/ckpt; ends with models/target.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=. OPENBLAS_NUM_THREADS=1
PY=${PY:-python}
RUN=${RUN:-runs/unlearn}
R1=${R1:-runs/drafters-phase3/data/responses.jsonl}   # session 3's runs/drafters/data/responses.jsonl
PROMPTS=${PROMPTS:-runs/drafters-phase3/data}        # its prompts_gsm.jsonl / prompts_code.jsonl
mkdir -p "$RUN"
COMMON=(--preset target --resume --new-phase --steps 100000 --warmup 10 --seq 256 --batch 8
        --p-gsm 0.6 --eval-every 50 --ul-weight 1.0 --ul-batch 8)

# round 1 (phase 4)
$PY -m tools.embedded target train "${COMMON[@]}" --lr 3e-4 --time-budget 25 --ul-data "$R1"
if [[ ${ROUNDS:-1} == 1 ]]; then
  $PY -m tools.embedded target export --preset target
  exit 0
fi
$PY -m tools.embedded target export --preset target --out "$RUN/r1"

# round 2 data: prompts the phase-3 responses did not cover (GSM8K 2017-2616, code
# 1185-1500) and 284 code prompts again, answered greedily by the round-1 model
sed -n 2017,2616p "$PROMPTS/prompts_gsm.jsonl" > "$RUN/r2_gsm.jsonl"
{ sed -n 1185,1500p "$PROMPTS/prompts_code.jsonl"; sed -n 1,284p "$PROMPTS/prompts_code.jsonl"; } > "$RUN/r2_code.jsonl"
for s in gsm code; do
  $PY -m app.cli train-drafter --target "$RUN/r1" --out "$RUN/gen" --generate-only --quiet \
    --prompts "$RUN/r2_$s.jsonl" --responses "$RUN/r2_resp_$s.jsonl" --gen-max-tokens 256 --gen-batch 32 &
done
wait

# round 2 (phase 5)
$PY -m tools.embedded target train "${COMMON[@]}" --lr 2e-4 --time-budget 20 --ul-ngram 8 \
  --ul-data "$RUN/r2_resp_gsm.jsonl" --ul-data "$RUN/r2_resp_code.jsonl" --ul-data "$R1"
$PY -m tools.embedded target export --preset target

#!/bin/bash
# One prepared call on a lent GPU: the issue-14 measurements in order of
# priority, each in a fresh process, each bounded by the time left, so that
# a short lease still returns the first rows. Run from the repository root:
#
#   OUT=/tmp/gpu BUDGET=500 bash benchmarks/gpu_session.sh
#
# BUDGET: seconds for all of it (default 500). BASE: a copy of an earlier
# tree (e.g. `git archive REV | tar -x -C .gpu/base`), the same-machine
# baseline, run before and again after the new tree's train row. TRIAL: a
# copy of this tree with a change under test, and/or TRIAL_ENV: variables
# for it (e.g. 'XLA_FLAGS=--xla_gpu_enable_cublaslt=true'; the trial runs
# this tree when only TRIAL_ENV is set); its train rows alternate with
# this tree's, twice, and an infer row follows this tree's. TRIALS:
# several flag sets, '|' between them (e.g. 'XLA_FLAGS=--a=true --c=1|
# XLA_FLAGS=--b=2'): one train row each after this tree's, this tree's
# again, then the fastest trial once more (instead of TRIAL/TRIAL_ENV).
# A flag set (and TRIAL_ENV) is NAME=VALUE, the value whole, spaces and
# all, up to the next '|'; ';' between several variables ('A=1;B=2').
# Every row logs the XLA_FLAGS it ran with. Writes $OUT/log.txt (the
# summary lines), $OUT/all.txt (every command's full output),
# $OUT/json.txt (JSON lines, one per bench row in the order run:
# {"name", "env", "result": the bench's JSON or null}) and $OUT/clocks.csv
# (the GPU's SM clock, power and temperature twice a second throughout,
# to tell a card that slows under load from a slower program): four files,
# as a lent machine returns a few. Needs bash and python3 only (no
# TensorFlow, tfds, clu or ml_collections: the GPU machines lack them).
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
START=$(date +%s); BUDGET=${BUDGET:-500}; OUT=${OUT:?set OUT to a folder}
ROOT=$PWD; LOG=$OUT/log.txt; TMP=$(mktemp -d); mkdir -p "$OUT"
STEP_ENV=  # Per row: `STEP_ENV=... step ...` (see set_env).
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
set_env() {  # 'NAME=VALUE[;NAME=VALUE...]': exports each, the value whole
  local item name items=()
  IFS=';' read -r -a items <<< "$1"
  for item in "${items[@]}"; do
    item=${item#"${item%%[![:space:]]*}"}  # Leading blanks (after a '|').
    [ -z "$item" ] && continue
    name=${item%%=*}
    if [[ $item != *=* || ! $name =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]]; then
      echo "bad variable '$item': expected NAME=VALUE" >&2; return 2
    fi
    export "$name=${item#*=}"
  done
}
step() {  # name min_seconds max_seconds dir command...; STEP_ENV: set_env's
  local name=$1 min=$2 max=$3 dir=$4; shift 4
  local l; l=$(left)
  if (( l < min )); then echo "SKIP $name (left $l s)" | tee -a "$LOG"; return; fi
  local t=$(( l - 5 < max ? l - 5 : max ))
  echo "=== $name (limit $t s, at $(( $(date +%s) - START )) s)" | tee -a "$LOG"
  rm -f "$TMP/$name.json" "$TMP/$name.out"  # A same-named earlier row's.
  # The XLA_FLAGS the row runs with (or why its variables are wrong).
  { set_env "$STEP_ENV" && echo "XLA_FLAGS=${XLA_FLAGS-(unset)}"; } 2>&1 \
    | tee -a "$LOG" "$TMP/$name.out"
  (cd "$dir" && set_env "$STEP_ENV" 2> /dev/null \
     && PYTHONPATH=$dir timeout "$t" "$@") >> "$TMP/$name.out" 2>&1
  echo "rc=$?" >> "$TMP/$name.out"
  { echo "=== $name"; cat "$TMP/$name.out"; } >> "$OUT/all.txt"
  grep -E "img_per_s |mfu_nominal|img_per_s_pipelined|peak_device|img/s|rc=|Error" \
    "$TMP/$name.out" | tail -8 | tee -a "$LOG"
  # The row's bench JSON (--json="$TMP/$name.json"), as one line.
  if [[ " $* " == *" --json=$TMP/$name.json "* ]]; then
    python3 - "$name" "$STEP_ENV" "$TMP/$name.json" >> "$OUT/json.txt" <<'PY'
import json, sys
name, env, path = sys.argv[1:]
try:
  with open(path) as f:
    result = json.load(f)
except (OSError, ValueError):  # The row failed or ran out of time.
  result = None
print(json.dumps({'name': name, 'env': env, 'result': result}))
PY
  fi
}
# GPU: the rows of fixed large sizes (profile, timm, ViT-H/14) run only
# where nvidia-smi is (HEAVY=1 forces them, HEAVY=0 skips them): on a CPU,
# trying the script with a tiny BENCH, they would run to their limits.
if command -v nvidia-smi > /dev/null; then
  HEAVY=${HEAVY:-1}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv \
    | tee -a "$LOG"
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \
    --format=csv -lms 500 > "$OUT/clocks.csv" 2>&1 &
  CLOCKS=$!
else
  HEAVY=${HEAVY:-0}; CLOCKS=
  echo "no nvidia-smi: no GPU rows (HEAVY=$HEAVY)" | tee -a "$LOG"
fi
heavy() { [ "$HEAVY" = 1 ] || { echo "SKIP $1 (HEAVY=$HEAVY)" | tee -a "$LOG"; false; }; }
# BENCH: the bench command of every bench row (default: ViT-B/16, batch 256).
B=${BENCH:-"python3 -m vit_jax.bench --model=ViT-B/16 --batch=256 --dtype=bfloat16 --steps=12 --warmup=2 --nomatmul_peak --pipelined"}
# The first process on a fresh machine runs 3-6% slower than the rest,
# whatever it runs (docs/performance.md, fourth GPU session): a short
# throwaway run first, so that no measured row pays for it.
step warm 30 90 "$ROOT" $B --steps=2 --warmup=1
# Each bench row writes its JSON to $TMP/<its name>.json (step's json.txt
# line).
if [ -n "$BASE" ]; then
  step base_train 60 90 "$BASE" $B --json="$TMP/base_train.json"
fi
TRIAL_DIR=${TRIAL:-$ROOT}
trial() {  # name min max extra-args...: the trial's row, if there is one.
  if [ -n "$TRIAL$TRIAL_ENV" ]; then
    local name=$1 min=$2 max=$3; shift 3
    STEP_ENV=$TRIAL_ENV step "$name" "$min" "$max" "$TRIAL_DIR" $B "$@" \
      --json="$TMP/$name.json"
  fi
}
step train 60 90 "$ROOT" $B --json="$TMP/train.json"
trial trial_train 60 90
if [ -n "$TRIAL$TRIAL_ENV" ]; then  # The pair again, for the spread.
  step train_b 60 90 "$ROOT" $B --json="$TMP/train_b.json"
  trial trial_train_b 60 90
fi
if [ -n "$TRIALS" ]; then
  IFS='|' read -r -a ENVS <<< "$TRIALS"
  for i in "${!ENVS[@]}"; do
    echo "trial_$i: ${ENVS[$i]}" | tee -a "$LOG"
    STEP_ENV=${ENVS[$i]} step "trial_$i" 60 150 "$ROOT" $B \
      --json="$TMP/trial_$i.json"
  done
  step train_b 60 90 "$ROOT" $B --json="$TMP/train_b.json"
  best=$(python3 - "$TMP" "${#ENVS[@]}" <<'PY'
import json, sys
rows = []
for i in range(int(sys.argv[2])):
  try:
    with open(f'{sys.argv[1]}/trial_{i}.json') as f:
      rows.append((json.load(f)['img_per_s'], i))
  except Exception:  # A row that failed or ran out of time.
    pass
print(max(rows)[1] if rows else '')
PY
)
  if [ -n "$best" ]; then
    echo "fastest: trial_$best again" | tee -a "$LOG"
    STEP_ENV=${ENVS[$best]} step "trial_${best}_b" 60 150 "$ROOT" $B \
      --json="$TMP/trial_${best}_b.json"
  fi
fi
step infer 40 60 "$ROOT" $B --mode=infer --json="$TMP/infer.json"
trial trial_infer 40 60 --mode=infer
heavy profile && step profile 70 110 "$ROOT" python3 -m benchmarks.op_profile \
  --model=ViT-B/16 --batch=256 --dtype=bfloat16 --steps=3 --top=30
heavy timm && step timm 120 150 "$ROOT" python3 -m benchmarks.peers \
  --model=ViT-B/16 --batch=256 --dtypes=bfloat16 --peers=timm_compile \
  --modes=train --rounds=1 --steps=10 --warmup=3
if [ -n "$BASE" ]; then  # The pair again, the other way round.
  step train_2 60 90 "$ROOT" $B --json="$TMP/train_2.json"
  step base_train_2 60 90 "$BASE" $B --json="$TMP/base_train_2.json"
fi
heavy h14 && step h14 150 170 "$ROOT" python3 -m benchmarks.max_batch --model=ViT-H/14 \
  --batches=1792,1920 --model_option=remat=nothing_saveable \
  --model_option=scan_layers=True --timeout=80 --json="$TMP/h14.json"
[ -n "$CLOCKS" ] && kill $CLOCKS 2>/dev/null
echo "done at $(( $(date +%s) - START )) s" | tee -a "$LOG"

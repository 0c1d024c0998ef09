#!/usr/bin/env bash
# Greedy GSM8K accuracy of SmolLM2-135M-Instruct on the first N test problems, once per precision.
# Resumable: a precision whose JSON already exists is skipped. Usage: scripts/eval_smollm2_gsm8k.sh [N] [QARL_BIN]
# MODEL_DIR (default models/smollm2-135m-instruct, scripts/fetch_smollm2.sh's) and OUT_DIR (default
# experiments/results/smollm2) choose the model and where the results go.
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-100}"
bin="${2:-${CARGO_TARGET_DIR:-target}/release/qarl}"
model="${MODEL_DIR:-models/smollm2-135m-instruct}"
out="${OUT_DIR:-experiments/results/smollm2}"
[ -d "$model" ] || { echo "no $model: run scripts/fetch_smollm2.sh first"; exit 1; }
[ -n "${QARL_GSM8K_DIR:-}" ] || { echo "set QARL_GSM8K_DIR to a directory with GSM8K's test.jsonl (github.com/openai/grade-school-math, grade_school_math/data)"; exit 1; }
mkdir -p "$out"
for s in f32 int4-g128 int8-pc fp8-b128; do
  f="$out/gsm8k_test${n}_${s}.json"
  if [ -f "$f" ]; then echo "skip $s ($f exists)"; continue; fi
  q=(); [ "$s" = f32 ] || q=(--quant "$s")
  "$bin" eval --model "$model" --data gsm8k-test --limit "$n" --batch 20 "${q[@]}" --output "$f.partial" --quiet
  mv "$f.partial" "$f"
done

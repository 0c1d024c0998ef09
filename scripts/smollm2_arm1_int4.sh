#!/usr/bin/env bash
# Arm 1 of the SmolLM2 study (f32 rollout, f32 training) evaluated quantized to int4-g32, against the
# quantized-rollout arms' own int4 evaluations: does f32 RL followed by quantization serve the deployed int4
# model as well as RL on int4 rollouts does? Prints experiments/results/smollm2_paper/heldout_int4_1-f32.txt:
#   scripts/smollm2_arm1_int4.sh [QARL] > experiments/results/smollm2_paper/heldout_int4_1-f32.txt
# QARL: a qarl binary (default: `cargo run --release`). Run from anywhere; paths are the repository's.
#
# Inputs (experiments/results/smollm2_paper/):
#   heldout_int4_1-f32_seed{1,2,3}.json  `qarl eval --model <arm 1 seed N step_000039> --quant int4-g32` on the
#                                        study's held-out problems, pinned learner c9234d4
#   heldout_int4_warm_start.json         the same command on the warm start, which must reproduce the study's
#                                        own step-0 int4 evaluation problem by problem (checked first), so the
#                                        protocol (problems, template, greedy decode, scoring) is the study's
#   <arm>/seed<N>                        the study's runs: their final int4 evaluations
# The held-out problems: experiments/data/word_problems_addsub_small_test.jsonl without its repeated questions
# (193 of 200, first occurrence kept, the order the study evaluates them in). The eval command:
#   qarl eval --model M --data HELDOUT --limit 193 --quant int4-g32 --max-new-tokens 64 --batch 193 \
#     --system "You are a helpful assistant. Solve the math problem in one short sentence and end with the number."
# Statistics: `qarl compare` (report.md's, src/train/paired.rs); the warm start is one model and adds no seed
# spread (--fixed-b).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ge 1 ]; then qarl=("$1"); else qarl=(cargo run -q --release --bin qarl --); fi
r=experiments/results/smollm2_paper
arm1=("$r"/heldout_int4_1-f32_seed{1,2,3}.json)
"${qarl[@]}" compare --require-identical --a "$r/heldout_int4_warm_start.json" --name-a "warm start (qarl eval)" \
  --b "$r/2-int4-rollout/seed1@first" --name-b "the study's step-0 evaluation" > /dev/null
echo "The warm start's \`qarl eval\` reproduces the study's step-0 int4 evaluation on all 193 problems."
echo
"${qarl[@]}" compare --a "${arm1[@]}" --name-a "arm 1 in int4" --b "$r/heldout_int4_warm_start.json" \
  --name-b "warm start in int4" --fixed-b
for arm in 2-int4-rollout 3-int4-rollout-tis 4-int4-rollout-tbpo 5-qarl-gspo 6-qarl-tbpo; do
  runs=()
  for s in 1 2 3; do [ -f "$r/$arm/seed$s/finished.json" ] && runs+=("$r/$arm/seed$s"); done
  echo
  "${qarl[@]}" compare --a "${runs[@]}" --name-a "$arm" --b "${arm1[@]}" --name-b "arm 1 in int4"
done

#!/usr/bin/env bash
# The regime probe of probe.md repeated on a warm-started model (issue 26): step-0 evaluation (mean@4 at
# T = 1 on the first 32 TRAINING problems, in the rollout precision and f32, plus greedy) and the RL step-0
# reward, then the run is stopped. Usage: probe.sh LABEL MODEL_DIR [--set k=v ...]; writes LABEL.* here.
set -euo pipefail
label=$1; model=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd)
Q=${QARL_BIN:-qarl}
run=runs/probe_sft_$label
eval_file=runs/probe_sft_eval32.jsonl
mkdir -p runs
head -32 experiments/data/word_problems_addsub_small_train.jsonl > "$eval_file"
cmd=("$Q" train --quiet --overwrite --config experiments/results/smollm2_paper/probe_base.toml
  --set "run_dir=$run" --set "model.dir=$model" --set train.steps=1 --set eval.every=1
  --set eval.problems=32 --set eval.k=4
  --set task.path=experiments/data/word_problems_addsub_small_train.jsonl
  --set "task.eval_path=$eval_file" "$@")
printf '%q ' "${cmd[@]}" > "$here/$label.cmd.txt"; echo >> "$here/$label.cmd.txt"
"${cmd[@]}" > "$here/$label.log" 2>&1 &
pid=$!
# Stop after the RL step-0 row (the final evaluation is not part of the probe).
while kill -0 $pid 2>/dev/null; do
  if grep -q '"phase":"rl"' "$run/metrics.jsonl" 2>/dev/null; then kill $pid; break; fi
  sleep 5
done
wait $pid || true
cp "$run/metrics.jsonl" "$here/$label.metrics.jsonl"
python3 - "$here/$label.metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    keep = {k: v for k, v in r.items() if k.startswith(("eval/", "critic/rewards", "actor/loss_seq", "actor/kept", "rollout_corr/k3", "perf/step_s", "response_length/mean")) or k in ("phase", "step")}
    print(json.dumps(keep))
PY

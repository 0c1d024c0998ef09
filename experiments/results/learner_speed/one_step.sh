#!/usr/bin/env bash
# one RL step of experiments/smollm2_wp_base.toml with binary $1 into run dir $2
bin=$1; run=$2
rm -rf "$run"
/usr/bin/time -v "$bin" train --config experiments/smollm2_wp_base.toml \
  --set model.dir=/tmp/smollm2 --set 'task.template={kind="chat", model_dir="/tmp/smollm2", system="You are a helpful assistant. Solve the math problem in one short sentence and end with the number."}' \
  --set run_dir="$run" --set train.steps=1 --set eval.every=100 --set eval.problems=2 --set checkpoint_every=100 \
  > "$run.log" 2>&1
grep -E "Maximum resident|Elapsed" "$run.log"
python3 - "$run/metrics.jsonl" <<'PY'
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l)
    if r.get("phase")=="rl":
        print({k:v for k,v in r.items() if k.startswith("perf/") or k in ("rollout_corr/k3_kl","actor/grad_norm","actor/entropy")})
PY

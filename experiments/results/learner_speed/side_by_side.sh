#!/usr/bin/env bash
# One script run, old binary vs new, same machine and config: the SmolLM2-135M RL step of
# experiments/smollm2_wp_base.toml (8 prompts x 8 samples, int4-g32 rollout, aligned TBPO).
#   side_by_side.sh OLD_BIN NEW_BIN MODEL_DIR OUT_DIR [STEPS]
# The old binary (before the learner-speed work) has no `bench step`: it runs `qarl train` for 1 + STEPS
# RL steps (no evaluation or checkpoint inside them) and its metrics.jsonl gives perf/step_s per step; the
# new one runs `qarl bench step --warmup 1 --steps STEPS` on the same config. The first step of each is a
# warm-up; the medians of the others are compared. Peak memory: /usr/bin/time's maximum resident size.
set -euo pipefail
old=$1; new=$2; model=$3; out=$4; steps=${5:-2}
mkdir -p "$out"
template="task.template={kind=\"chat\", model_dir=\"$model\", system=\"You are a helpful assistant. Solve the math problem in one short sentence and end with the number.\"}"
common=(--config experiments/smollm2_wp_base.toml --set "model.dir=$model" --set "$template")
lscpu | grep -E "Model name|^CPU\(s\)" > "$out/machine.txt"
rm -rf "$out/old_run"
/usr/bin/time -v "$old" train "${common[@]}" --set "run_dir=$out/old_run" --set "train.steps=$((steps + 1))" \
  --set eval.every=1000 --set eval.problems=1 --set checkpoint_every=1000 --quiet > "$out/old.log" 2>&1
/usr/bin/time -v "$new" bench step "${common[@]}" --set "run_dir=$out/new_run" --warmup 1 --steps "$steps" \
  --json "$out/new.json" --quiet > "$out/new.md" 2> "$out/new.log"
python3 - "$out" <<'PY'
import json, re, statistics, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/old_run/metrics.jsonl")]
old = [r for r in rows if r.get("phase") == "rl"][1:]
new = json.load(open(f"{out}/new.json"))["variants"][0]["steps"]
rss = lambda f: int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f).read()).group(1)) / 1e6
med = lambda rs, k: statistics.median(r[k] for r in rs if k in r)
lines = ["| | old | new | old / new |", "|---|---:|---:|---:|"]
for key in ["perf/step_s", "perf/rollout_s", "perf/update_s"]:
    o, n = med(old, key), med(new, key)
    lines.append(f"| {key} (median of {len(old)} / {len(new)} steps) | {o:.1f} | {n:.1f} | {o / n:.2f}x |")
lines.append(f"| peak resident memory (GB, whole process) | {rss(out + '/old.log'):.2f} | {rss(out + '/new.log'):.2f} | |")
for k in ["rollout_corr/k3_kl", "train/accuracy"]:
    lines.append(f"| {k} (per step) | {[r.get(k) for r in old]} | {[r.get(k) for r in new]} | |")
open(f"{out}/summary.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY

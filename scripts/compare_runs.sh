#!/usr/bin/env bash
# Runs the same short training config with two qarl binaries and compares their metrics.jsonl row by row,
# bit for bit, ignoring wall-clock keys (perf/*, *_s, time). Used to show that a refactor left the arithmetic
# of the default run unchanged.
#
#   scripts/compare_runs.sh OLD_QARL NEW_QARL [--set k=v ...]
#
# Default overrides keep it short: 30 SFT steps, 3 RL steps, 20 evaluation problems.
set -euo pipefail
old=$1 new=$2
shift 2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for side in old new; do
  bin=$old; [ "$side" = new ] && bin=$new
  "$bin" train --set run_dir="$work/$side" --set model.dir="$work/$side/model-sft" \
    --set sft.steps=30 --set train.steps=3 --set eval.problems=20 --set eval.every=3 \
    --set checkpoint_every=3 "$@" >"$work/$side.log" 2>&1 ||
    { echo "$side run failed:"; tail -20 "$work/$side.log"; exit 1; }
done
python3 - "$work/old/metrics.jsonl" "$work/new/metrics.jsonl" <<'PY'
import json, sys
def rows(path):
    out = []
    for line in open(path):
        row = json.loads(line)
        out.append({k: v for k, v in row.items()
                    if not (k.startswith("perf/") or k.endswith("_s") or k in ("time", "elapsed_s"))})
    return out
a, b = rows(sys.argv[1]), rows(sys.argv[2])
diffs = []
if len(a) != len(b):
    diffs.append(f"row count {len(a)} vs {len(b)}")
added = set()
for i, (x, y) in enumerate(zip(a, b)):
    added |= set(y) - set(x)
    for k in sorted(x):
        if x[k] != y.get(k):
            diffs.append(f"row {i} ({x.get('phase')} step {x.get('step')}): {k}: {x[k]!r} vs {y.get(k)!r}")
print(f"{len(a)} rows compared, {sum(len(r) for r in a)} values of the old run")
if added:
    print("keys only the new run writes:", ", ".join(sorted(added)))
if diffs:
    print("DIFFERENT:"); print("\n".join(diffs[:40])); sys.exit(1)
print("bitwise identical (wall-clock keys excluded)")
PY

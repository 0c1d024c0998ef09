#!/usr/bin/env bash
# Lays out a two-file CUDA toolkit in DIR (default $CARGO_TARGET_DIR/cuda-tools), from PyPI's CUDA 13
# wheels, once: bin/ptxas (`nvidia-cuda-nvcc`: assembles PTX without a GPU; CUDA 13 because the H200
# image's driver takes PTX ISA 9.0, which CUDA 12's ptxas refuses) and nvvm/libdevice/libdevice.10.bc
# (`nvidia-nvvm`: cubecl-cuda's LLVM backend links it for math functions without an instruction, such
# as SwiGLU's exp, and finds it through CUDA_PATH or /usr/local/cuda). Prints DIR. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="$(realpath -m "${1:-${CARGO_TARGET_DIR:-target}/cuda-tools}")"
fetch() { # fetch PACKAGE FILE DEST: one file out of PyPI's wheel of PACKAGE (CUDA 13)
  [ -f "$3" ] && return 0
  local tmp
  tmp="$(mktemp -d)"
  pip download "$1==13.*" --no-deps -d "$tmp" >/dev/null
  python3 -m zipfile -e "$tmp"/*.whl "$tmp/x"
  install -D -m 755 "$(find "$tmp/x" -name "$2" -type f | head -1)" "$3"
  rm -rf "$tmp"
}
fetch nvidia-cuda-nvcc ptxas "$dir/bin/ptxas" >&2
fetch nvidia-nvvm libdevice.10.bc "$dir/nvvm/libdevice/libdevice.10.bc" >&2
echo "$dir"

#!/usr/bin/env bash
# Compiles the CUDA tensor-core tiles for sm_90 (H100/H200) on this CPU machine and assembles the PTX with
# NVIDIA's ptxas, no GPU needed: `cube_kernels/tests/cuda_codegen.rs`. Run it before a GPU session so a
# code-generation failure costs a build here rather than device time.
#
# A two-file CUDA toolkit from PyPI, unpacked once into $target/cuda-tools: ptxas (`nvidia-cuda-nvcc`; CUDA
# 13: the H200 image's driver takes PTX ISA 9.0, which CUDA 12's ptxas refuses) and libdevice
# (`nvidia-nvvm`: the LLVM backend links it for math functions without an instruction, such as SwiGLU's
# exp; it finds it through CUDA_PATH as on a GPU machine with the toolkit). The CUDA build needs LLVM
# (scripts/offline_llvm.sh where the distribution has LLVM >= 22, else, as root, the Debian trixie chroot
# of scripts/cuda_build_chroot.sh). The PTX and cubins land in $target/cuda-codegen. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
target="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
tools="$target/cuda-tools"
fetch() { # fetch PACKAGE FILE DEST: one file out of PyPI's wheel of PACKAGE (CUDA 13)
  [ -f "$3" ] && return 0
  local tmp
  tmp="$(mktemp -d)"
  pip download "$1==13.*" --no-deps -d "$tmp" >/dev/null
  python3 -m zipfile -e "$tmp"/*.whl "$tmp/x"
  install -D -m 755 "$(find "$tmp/x" -name "$2" -type f | head -1)" "$3"
  rm -rf "$tmp"
}
fetch nvidia-cuda-nvcc ptxas "$tools/bin/ptxas"
fetch nvidia-nvvm libdevice.10.bc "$tools/nvvm/libdevice/libdevice.10.bc"
"$tools/bin/ptxas" --version | tail -1
test=(env CUDA_PATH="$tools" QARL_PTXAS="$tools/bin/ptxas" QARL_PTX_DIR="$target/cuda-codegen"
  cargo test -p cube_kernels --no-default-features --features cuda --locked --test cuda_codegen -- --nocapture)
if [ -f "${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed" ]; then
  "${test[@]}"
elif [ "$(id -u)" = 0 ]; then
  CARGO_TARGET_DIR="$target" bash scripts/cuda_build_chroot.sh "${test[@]}"
else
  echo "no LLVM bundle (scripts/offline_llvm.sh) and not root for the chroot: cannot build the cuda feature"
  exit 1
fi

#!/usr/bin/env bash
# Compiles the CUDA tensor-core tiles and the GPU training kernels for sm_90 (H100/H200) on this CPU
# machine and assembles the PTX with NVIDIA's ptxas, no GPU needed: `cube_kernels/tests/cuda_codegen.rs`. Run it before a GPU session so a
# code-generation failure costs a build here rather than device time.
#
# ptxas and libdevice come from scripts/cuda_tools.sh ($target/cuda-tools). The CUDA build needs LLVM
# (scripts/offline_llvm.sh where the distribution has LLVM >= 22, else, as root, the Debian trixie chroot
# of scripts/cuda_build_chroot.sh). The PTX and cubins land in $target/cuda-codegen. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
target="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
tools="$(bash scripts/cuda_tools.sh "$target/cuda-tools")"
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

#!/usr/bin/env bash
# Prepares, on this (CPU) machine, what scripts/gpu_check.sh needs on a lent GPU machine, which has no
# registries: stripped release binaries in .gpu/ (wgpu always; cuda when the offline LLVM bundle of
# scripts/offline_llvm.sh is in place) and the Vulkan loader packages in .gl/. Both folders are ignored by
# git and travel with `carry`. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
grep -qx '/.gl/' .git/info/exclude 2>/dev/null || echo '/.gl/' >> .git/info/exclude
mkdir -p .gpu .gl
cargo build --release --features wgpu --bin qarl
cp target/release/qarl .gpu/qarl-wgpu && strip .gpu/qarl-wgpu
if [ -f "${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed" ]; then
  cargo build --release --features cuda --bin qarl --target-dir target/cuda
  cp target/cuda/release/qarl .gpu/qarl-cuda && strip .gpu/qarl-cuda
else
  echo "no offline LLVM bundle (scripts/offline_llvm.sh): the GPU check runs the wgpu (Vulkan) build only"
fi
if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  mkdir -p /tmp/amd64/partial
  # shellcheck disable=SC2086
  apt-get $o update -qq && (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
fi
du -sh .gpu .gl

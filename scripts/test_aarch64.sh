#!/usr/bin/env bash
# The CPU kernels' NEON path on an x86_64 machine: cross-compiles test targets for aarch64 Linux and runs
# them under qemu-user. Installs the cross toolchain and qemu with apt when they are missing, and the Rust
# target with rustup.
#
#   scripts/test_aarch64.sh                        # tests/cpu_kernels.rs (every path bitwise the reference)
#   scripts/test_aarch64.sh cpu_kernels quant_layer
#
# A cold build of the dependencies for aarch64 took 15 min on 2 cores; later runs reuse
# $CARGO_TARGET_DIR (default: ~/.cache/qarl-target-aarch64). CI does not run this (its budget is the
# x86_64 build); run it after changing `src/ops/cpu/kernel/neon.rs` or the kernel layout. Tests that
# spawn the `qarl` binary fail here unless qemu is registered with binfmt_misc (qemu-user-binfmt).
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(cpu_kernels)
if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross
fi
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/qarl-target-aarch64}"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
args=()
for t in "${tests[@]}"; do args+=(--test "$t"); done
cargo test --target "$target" "${args[@]}" -- --nocapture

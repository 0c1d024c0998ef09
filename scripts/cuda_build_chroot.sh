#!/usr/bin/env bash
# Builds the `cuda` binary (`cargo build --release --features cuda --bin qarl`) on a host whose distribution
# has no LLVM >= 22, such as Debian bookworm (LLVM <= 19; sid's and trixie's LLVM 22 need glibc >= 2.38).
#
# cubecl-cuda 0.11 always links cubecl-llvm (its `nvptx` feature is not optional), whose bundler downloads
# LLVM 23.1 from GitHub unless a bundle is "installed" (scripts/offline_llvm.sh). Here that bundle is
# Debian trixie's llvm-22-dev inside a trixie chroot (debootstrap from the Debian mirror, which is the one
# registry this machine reaches besides crates.io). The chroot shares the host's rustup, cargo registry,
# repository and target directory at the same paths, so every crate the `cuda` feature does not change is
# reused from the host's release build. CUDARC_CUDA_VERSION (default 13000, the H200 image's CUDA 13.0)
# replaces cudarc's `nvcc --version` probe: there is no CUDA toolkit here; libcuda and NVRTC are loaded at
# run time on the GPU machine.
#
# Usage: CARGO_TARGET_DIR=/path/to/target scripts/cuda_build_chroot.sh [COMMAND...]   (root; idempotent)
# Without a command the binary lands in $CARGO_TARGET_DIR/release/qarl (it replaces a host build of the
# same profile there). With one, that command runs in the repository inside the chroot instead, with the
# same environment: e.g. `cargo test -p cube_kernels --features cuda --test cuda_codegen` (the CUDA
# kernels compiled to PTX without a GPU) or `cargo clippy --features cuda`.
set -euo pipefail
root="${QARL_CHROOT:-/work/trixie}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$repo/target}"
mkdir -p "$target"
command="cargo build --release --features cuda --bin qarl"
if [ "$#" -gt 0 ]; then command="$(printf '%q ' "$@")"; fi
if [ ! -x "$root/usr/lib/llvm-22/bin/llvm-config" ]; then
  command -v debootstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y debootstrap
  debootstrap --variant=minbase \
    --include=build-essential,pkg-config,llvm-22-dev,libpolly-22-dev,zlib1g-dev,libzstd-dev,libxml2-dev,libz3-dev,ca-certificates \
    trixie "$root" http://deb.debian.org/debian
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
# The crates come from the host's cargo (its registry folder is shared below): the chroot's CA bundle
# may lack a certificate the host's network needs (an egress proxy's), so nothing is downloaded inside.
(cd "$repo" && cargo fetch --locked >/dev/null)
mounted=()
cleanup() {
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
bind() {
  mkdir -p "$root$1"
  if ! mountpoint -q "$root$1"; then
    mount --bind "$1" "$root$1"
    mounted+=("$root$1")
  fi
}
for d in /proc /sys /dev /dev/pts "$HOME/.cargo" "$HOME/.rustup" "$repo" "$target"; do bind "$d"; done
chroot "$root" /usr/bin/env HOME="$HOME" PATH="$HOME/.cargo/bin:/usr/bin:/bin" \
  CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}" CARGO_TARGET_DIR="$target" \
  CARGO_NET_OFFLINE=true /bin/bash -c "cd '$repo' && bash scripts/offline_llvm.sh && $command"

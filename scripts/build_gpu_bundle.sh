#!/usr/bin/env bash
# Prepares, on this (CPU) machine, what scripts/gpu_check.sh needs on a lent GPU machine, which has no
# registries: stripped, xz-compressed release binaries in .gpu/ (wgpu always; cuda where it can be built:
# with the offline LLVM bundle of scripts/offline_llvm.sh on this host, else, as root, in the Debian trixie
# chroot of scripts/cuda_build_chroot.sh, whose C/C++ runtime libraries then travel in .gpu/libs so the
# binary runs whatever the GPU machine's glibc) and the Vulkan loader packages in .gl/. Both folders are
# ignored by git and travel with `carry` (the device tool sends at most 64 MiB in all, so the binaries go
# compressed). Idempotent. QARL_GPU_BUNDLE=wgpu or =cuda builds one runtime only.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
grep -qx '/.gl/' .git/info/exclude 2>/dev/null || echo '/.gl/' >> .git/info/exclude
mkdir -p .gpu .gl
target="${CARGO_TARGET_DIR:-target}"
only="${QARL_GPU_BUNDLE:-wgpu,cuda}"
# What the binaries are built from, read before the build (commits made while it runs are not in it).
built_from="$(git rev-parse HEAD; git status --porcelain --untracked-files=no | sed 's/^/modified: /'; date -u +%FT%TZ)"
pack() { # pack BINARY NAME: strip, compress into .gpu/NAME.xz, and say what it was built from in .gpu/NAME.built
  strip -o ".gpu/$2" "$1" && xz -T0 -6 -f ".gpu/$2"
  echo "$built_from" > ".gpu/$2.built"
}
# Both builds write $target/release/qarl: each is packed before the next one starts.
if [[ ",$only," == *,wgpu,* ]]; then
  cargo build --release --features wgpu --bin qarl
  pack "$target/release/qarl" qarl-wgpu
fi
if [[ ",$only," == *,cuda,* ]]; then
  if [ -f "${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed" ]; then
    CUDARC_CUDA_VERSION="${CUDARC_CUDA_VERSION:-13000}" cargo build --release --features cuda --bin qarl
    pack "$target/release/qarl" qarl-cuda
  elif [ "$(id -u)" = 0 ]; then
    CARGO_TARGET_DIR="$target" bash scripts/cuda_build_chroot.sh
    pack "$target/release/qarl" qarl-cuda
    # The chroot's loader and the libraries the binary links (glibc, libstdc++, LLVM's system libraries).
    root="${QARL_CHROOT:-/work/trixie}"
    rm -rf .gpu/libs && mkdir -p .gpu/libs
    cp "$target/release/qarl" "$root/tmp/qarl-cuda"
    chroot "$root" /usr/bin/ldd /tmp/qarl-cuda | awk '/=> \// {print $3} /^[ \t]*\/.*ld-linux/ {print $1}' |
      while read -r lib; do cp -L "$root$lib" .gpu/libs/; done
  else
    echo "no offline LLVM bundle (scripts/offline_llvm.sh) and not root for the chroot: wgpu only"
  fi
fi
if [[ ",$only," == *,cuda,* ]]; then
  # libdevice (500 KB), for a GPU machine without the CUDA toolkit: gpu_check.sh points CUDA_PATH here
  # when it finds none (the LLVM backend links it for SwiGLU's exp and softmax's).
  tools="$(bash scripts/cuda_tools.sh)"
  install -D -m 644 "$tools/nvvm/libdevice/libdevice.10.bc" .gpu/cuda/nvvm/libdevice/libdevice.10.bc
fi
if ! ls .gl/libvulkan1_*.deb >/dev/null 2>&1; then
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  mkdir -p /tmp/amd64/partial
  # shellcheck disable=SC2086
  apt-get $o update -qq && (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
fi
du -sh .gpu .gl

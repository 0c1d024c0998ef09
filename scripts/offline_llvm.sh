#!/usr/bin/env bash
# Makes `cargo build --features cuda` (and cubecl's `cpu` runtime) work offline.
#
# cubecl-cuda 0.11 depends on cubecl-llvm, whose `tracel-llvm-bundler` build script downloads an LLVM 23.1
# bundle unless it finds one already "installed" under $XDG_DATA_HOME/tracel/tracel-llvm-23.1.0-4 (marked by
# an empty `.tracel-llvm-installed` file). This lays out Debian's LLVM 22 there instead: a *copy* of
# llvm-config in bin/ (llvm-sys derives the prefix from its own location), links to the libraries in lib/,
# the headers in include/. LLVM 22 is what compiled and linked here (BURN_NOTES); older ones may not. Unsupported by tracel; it is what compiled and linked here. Idempotent.
set -euo pipefail
# Debian trixie / apt.llvm.org have llvm-22 (what was seen to work); otherwise take the newest llvm-N-dev.
ver="${LLVM_VERSION:-}"
if [ -z "$ver" ]; then
  for v in 23 22 21 20 19; do
    if [ -x "/usr/lib/llvm-$v/bin/llvm-config" ] || apt-cache show "llvm-$v-dev" >/dev/null 2>&1; then ver=$v; break; fi
  done
fi
[ -n "$ver" ] || { echo "no llvm-N-dev (N >= 19) package found; set LLVM_VERSION"; exit 1; }
bundle="${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4"
if [ -f "$bundle/.tracel-llvm-installed" ]; then
  echo "LLVM bundle already in place: $bundle"
  exit 0
fi
if [ ! -x "/usr/lib/llvm-$ver/bin/llvm-config" ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y "llvm-$ver-dev" "libpolly-$ver-dev" ||
    { echo "install llvm-$ver-dev and libpolly-$ver-dev (Debian/apt.llvm.org) first"; exit 1; }
fi
src="/usr/lib/llvm-$ver"
tmp="$bundle.partial"
rm -rf "$tmp"
mkdir -p "$tmp/bin" "$tmp/lib"
cp "$src/bin/llvm-config" "$tmp/bin/llvm-config"
for f in "$src"/lib/*; do ln -s "$f" "$tmp/lib/$(basename "$f")"; done
# Names the bundle's link line asks for that Debian spells differently.
z3=$(ls /usr/lib/x86_64-linux-gnu/libz3.so* 2>/dev/null | head -1 || true)
[ -n "$z3" ] && ln -sf "$z3" "$tmp/lib/liblibz3.so"
zstd=$(ls /usr/lib/x86_64-linux-gnu/libzstd.so.1* 2>/dev/null | head -1 || true)
[ -n "$zstd" ] && ln -sf "$zstd" "$tmp/lib/libzstd.so"
ln -s "$src/include" "$tmp/include"
touch "$tmp/.tracel-llvm-installed"
mv "$tmp" "$bundle"
echo "LLVM $ver laid out as the tracel bundle at $bundle"

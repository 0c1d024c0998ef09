#!/usr/bin/env bash
# One call on a lent GPU machine (H200): the CubeCL kernels checked against the host reference, then timed
# on Qwen3-30B-A3B expert shapes against burn's bf16 matmul, next to the measured copy bandwidth.
#
# Here first: scripts/build_gpu_bundle.sh. Then, with the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu", ".gl"], timeout_s=540)
# Results come back under $OUT: gpu.txt, kernels_<runtime>.txt and .json. Activations run in f32 and bf16
# (QARL_GPU_CHECK_DTYPES, default "f32,bf16"; a type the runtime lacks, bf16 on wgpu, is skipped with a
# message), each checked against the host reference under the kernels' rounding contract. QARL_GPU_CHECK_ARGS adds
# arguments to `qarl bench kernels` and QARL_GPU_CHECK_ITERS sets the timed iterations (a smoke test on a
# CPU: QARL_GPU_CHECK_ITERS=2 QARL_GPU_CHECK_ARGS="--experts 8 --tokens 1,16 --matmul-size 256 --copy-mib 16").
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
for f in .gl/*.deb; do [ -f "$f" ] && dpkg -x "$f" /; done
command -v ldconfig >/dev/null && ldconfig
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES="$icd"
export XDG_RUNTIME_DIR=/tmp/xdg && mkdir -p /tmp/xdg && chmod 700 /tmp/xdg
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/gpu.txt"
fi
# shellcheck disable=SC2206
extra=(${QARL_GPU_CHECK_ARGS:-})
status=0
for rt in cuda wgpu; do
  bin=".gpu/qarl-$rt"
  [ -x "$bin" ] || { echo "no $bin: skipping the $rt runtime"; continue; }
  echo "== $rt =="
  timeout 240 "$bin" bench kernels --runtime "$rt" --check --iters "${QARL_GPU_CHECK_ITERS:-50}" \
    --act-dtype "${QARL_GPU_CHECK_DTYPES:-f32,bf16}" "${extra[@]}" \
    --json "$out/kernels_$rt.json" 2>&1 | tee "$out/kernels_$rt.txt" || status=1
done
exit $status

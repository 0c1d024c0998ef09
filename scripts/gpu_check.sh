#!/usr/bin/env bash
# One call on a lent GPU machine (H200): the CubeCL kernels checked against the host reference, then timed
# on Qwen3-30B-A3B expert shapes against burn's bf16 matmul, next to the measured copy bandwidth.
#
# Here first: scripts/build_gpu_bundle.sh (it leaves .gpu/qarl-{cuda,wgpu}.xz, .gpu/libs and .gl/). The
# device tool sends at most 64 MiB: check `git ls-files | xargs du -ch` plus .gpu and .gl, and move large
# tracked results out of the working tree for the call (`git ls-files experiments/results | xargs rm`, then
# `git checkout -- experiments/results` after; never while an experiment writes under experiments/results: the
# files it holds open are replaced, and its rows then go to a deleted file). Then, with the device tool:
#   run(command="bash scripts/gpu_check.sh", carry=[".gpu", ".gl"], timeout_s=480)
# On an H200 (2026-11-30) a whole call took 160-230 s of command time plus about 40 s to start the machine,
# before the RL steps were added (estimated 250-400 s more: two models; deterministic on and off, each with
# f32 and bf16 activations, on CUDA; and the CPU). With a 15-minute device budget, run the CUDA runtime alone first
# (QARL_GPU_CHECK_RUNTIMES=cuda, timeout_s=590) and the wgpu one only if time is left.
# Results come back under $OUT: gpu.txt (machine, libraries), kernels_moe_cuda.txt and .json (the MoE block
# at 1-4096 tokens, int4-g128, bf16: moe/mma against the bf16 baseline), kernels_<runtime>.txt and .json, and
# rollout_cuda.txt and .json (`qarl bench rollout --backend cuda` on a 195M Qwen3-MoE, f32 against each
# quantized format; QARL_GPU_CHECK_ROLLOUT=0 skips it), and step_<model>_<backend>.txt and .json (the RL step
# on CUDA and on the CPU, see step_rl below). Activations run in f32
# and bf16 (QARL_GPU_CHECK_DTYPES, default "f32,bf16"; a type the runtime lacks, bf16 on wgpu, is skipped
# with a message), each checked against the host reference under the kernels' rounding contract.
# QARL_GPU_CHECK_ARGS adds arguments to `qarl bench kernels` (QARL_GPU_CHECK_ARGS_CUDA / _WGPU for one
# runtime), QARL_GPU_CHECK_ITERS sets the timed iterations, QARL_GPU_CHECK_TIMEOUT (_CUDA / _WGPU) the
# seconds per runtime and QARL_GPU_CHECK_RUNTIMES the runtimes (default "cuda wgpu"). A smoke test on a CPU:
#   QARL_GPU_CHECK_ITERS=2 QARL_GPU_CHECK_ARGS="--experts 8 --tokens 1,16 --matmul-size 256 --copy-mib 16"
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
bins=/tmp/qarl-gpu-bins
mkdir -p "$bins"
for f in .gpu/qarl-*; do
  [[ "$f" == *.built ]] && continue
  name=$(basename "$f" .xz)
  if [[ "$f" == *.xz ]]; then xz -dc "$f" > "$bins/$name"; else cp "$f" "$bins/$name"; fi
  chmod +x "$bins/$name"
done
for f in .gl/*.deb; do [ -f "$f" ] && dpkg -x "$f" /; done
command -v ldconfig >/dev/null && ldconfig
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] && export VK_DRIVER_FILES="$icd"
export XDG_RUNTIME_DIR=/tmp/xdg && mkdir -p /tmp/xdg && chmod 700 /tmp/xdg
# The CUDA driver and NVRTC (cubecl-cuda loads both at run time): the driver's folder, the toolkit, and
# wherever the image keeps a libnvrtc (the CUDA toolkit or a Python wheel).
libdirs=(/usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
while read -r lib; do libdirs+=("$(dirname "$lib")"); done < <(find /usr/local /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -5)
for d in "${libdirs[@]}"; do [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"; done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
# libdevice for the LLVM backend's math functions: the toolkit's (CUDA_PATH or where cubecl-llvm looks),
# else the copy scripts/build_gpu_bundle.sh put in .gpu/cuda.
has_libdevice() { [ -f "$1/nvvm/libdevice/libdevice.10.bc" ]; }
if ! { [ -n "${CUDA_PATH:-}" ] && has_libdevice "$CUDA_PATH"; }; then
  found=""
  for root in /usr/local/cuda /opt/cuda /usr/lib/cuda /usr; do has_libdevice "$root" && found=$root && break; done
  if [ -n "$found" ]; then export CUDA_PATH="$found"; elif has_libdevice "$PWD/.gpu/cuda"; then export CUDA_PATH="$PWD/.gpu/cuda"; fi
fi
{
  # What each binary was built from (scripts/build_gpu_bundle.sh): the results belong to that commit.
  for f in .gpu/*.built; do [ -f "$f" ] && { echo "== $(basename "$f" .built) built from"; cat "$f"; }; done
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "CUDA_PATH=${CUDA_PATH:-} (libdevice: $(has_libdevice "${CUDA_PATH:-/nonexistent}" && echo found || echo missing))"
  ldd --version | head -1
  find /usr/local /opt /usr/lib -name 'libnvrtc.so*' 2>/dev/null | head -5
  for b in "$bins"/*; do echo "== ldd $b"; ldd "$b" 2>&1 | grep -E "not found|GLIBC|libc.so|stdc" ; done
  command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv
} > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
# The RL step (`qarl bench step`) of a model with random weights on `backend` (CUDA, right after the MoE
# table; the runtimes in QARL_GPU_CHECK_STEP_RUNTIMES, default "cuda", "" skips them; the CPU, flex, at the
# end of the call, QARL_GPU_CHECK_STEP_FLEX=0 skips it, and a call that runs out of time loses only these): a model of SmolLM2-135M's shape (configs/models/smollm2-135m.json), then the tiny
# Qwen3-MoE of the tests (configs/models/qwen3-moe-arith.json). Random weights never stop early, so every step generates
# prompts x samples x QARL_GPU_CHECK_STEP_TOKENS tokens: the same work on both backends. int4-g32 rollout,
# aligned training forward, TBPO; on the GPU with bf16 activations: `train.deterministic = false`, deterministic
# mode on the tensor-core tiles (`train.tensor_cores`) and in the canonical order, side by side (f32 too
# with QARL_GPU_CHECK_STEP_F32=1).
# QARL_GPU_CHECK_STEP_MODELS chooses the models (default "smollm2-135m qwen3-moe-arith").
# Results: step_<model>_<backend>.txt and .json.
step_rl() {
  local backend=$1 model failed=0
  shift
  local launch=("$@")
  for model in ${QARL_GPU_CHECK_STEP_MODELS:-smollm2-135m qwen3-moe-arith}; do
    cat > "/tmp/step_$model.toml" <<TOML
run_dir = "/tmp/step-run-$model"
seed = 1
[model]
dir = "/tmp/step-model-$model"
init_config = "configs/models/$model.json"
[task]
kind = "arithmetic"
max_digits = 1
ops = ["add", "sub"]
min_terms = 3
max_terms = 4
[rollout]
precision = "int4-g32"
prompts_per_step = ${QARL_GPU_CHECK_STEP_PROMPTS:-8}
samples_per_prompt = 4
max_new_tokens = ${QARL_GPU_CHECK_STEP_TOKENS:-32}
[train]
steps = 3
forward = "aligned"
lr = 3e-5
[train.loss]
objective = "tbpo"
[eval]
every = 1000
problems = 4
max_new_tokens = 16
TOML
      echo "== RL step: $model on $backend =="
      # A GPU runtime compiles its kernels in the first step: one untimed step first. The CPU has nothing to
      # warm up, so one timed step.
      # On the GPU, with bf16 activations (mixed precision): `off` (burn's bf16 matmul from 64 rows),
      # deterministic on the tensor-core tiles (`train.tensor_cores`; also on the fragment tiles,
      # `train.tensor_core_kernel = "fragments"`, and with its scale groups split where the cubes are few,
      # `train.fragment_group_splits = 4`) and in the canonical order: what
      # exactness costs (issue 28's target: within 1.3x). Each variant is its own process (it compiles its kernels again), so the bf16 ones the target is
      # about come by default and the f32 pair with QARL_GPU_CHECK_STEP_F32=1.
      local steps=(--steps 2 --warmup 1 --variant off-bf16:train.deterministic=false,train.activations=bf16
        --variant det-bf16-tc:train.deterministic=true,train.activations=bf16,train.tensor_cores=true
        --variant det-bf16-frag:train.deterministic=true,train.activations=bf16,train.tensor_cores=true,train.tensor_core_kernel=fragments
        --variant det-bf16-frag-s4:train.deterministic=true,train.activations=bf16,train.tensor_cores=true,train.tensor_core_kernel=fragments,train.fragment_group_splits=4
        --variant det-bf16:train.deterministic=true,train.activations=bf16)
      [ "${QARL_GPU_CHECK_STEP_F32:-0}" = 1 ] &&
        steps+=(--variant det:train.deterministic=true --variant off:train.deterministic=false)
      [ "$backend" = flex ] && steps=(--steps 1 --warmup 0)
      timeout "${QARL_GPU_CHECK_STEP_TIMEOUT:-300}" "${launch[@]}" bench step --config "/tmp/step_$model.toml" \
        --backend "$backend" "${steps[@]}" --quiet --json "$out/step_${model}_$backend.json" 2>&1 |
        tee "$out/step_${model}_$backend.txt" || failed=1
  done
  return $failed
}

# shellcheck disable=SC2206
extra=(${QARL_GPU_CHECK_ARGS:-})
status=0
for rt in ${QARL_GPU_CHECK_RUNTIMES:-cuda wgpu}; do
  bin="$bins/qarl-$rt"
  [ -x "$bin" ] || { echo "no $bin: skipping the $rt runtime"; continue; }
  launch=("$bin")
  # A binary built against a newer glibc than this machine's runs under the loader it was built with.
  if ! "$bin" --version >/dev/null 2>&1 && [ -x .gpu/libs/ld-linux-x86-64.so.2 ]; then
    echo "$rt: running under .gpu/libs' loader"
    launch=(.gpu/libs/ld-linux-x86-64.so.2 --library-path ".gpu/libs:$LD_LIBRARY_PATH" "$bin")
  fi
  echo "== $rt =="
  # QARL_GPU_CHECK_ARGS_CUDA / _WGPU: arguments for one runtime only (e.g. a shorter second run).
  per_rt="QARL_GPU_CHECK_ARGS_${rt^^}"
  # shellcheck disable=SC2206
  extra_rt=(${!per_rt:-})
  # Issue 28's MoE target first (`--parts moe`: the block's rows alone): the Qwen3-30B-A3B block with
  # int4-g128 weights and bf16 activations at
  # prefill and training sizes, every kernel (moe/mma: the tensor-core tiles) checked, each tiles order
  # also bitwise against the same tokens one at a time, and timed against burn's bf16 matmul on the same
  # FLOPs (moe/mma-frag, -frag-c2: the same order on the fragment tiles, and their other layouts
  # -frag-pairs, -frag-ldm, -frag-m2, -frag-m2x64, -frag-m4, -frag-m4-db, -frag-m4-ldm, each with the
  # count of values that differ from moe/mma's); at 1-64 tokens moe/decode-fused, moe/decode-split,
  # -split-p4, -split-r and -split-p4-r (a tile's weights held in registers) and
  # moe/decode-graph (the split launches recorded once as a CUDA graph and replayed), and in the tensor-core
  # order moe/decode-mma, -mma-frag(-graph) and -mma-frag-s4(-graph) (the scale groups split among sets
  # of planes) are the decode target (% of copy, from ids on the device as a rollout routes them).
  # QARL_GPU_CHECK_MOE=0 skips it;
  # QARL_GPU_CHECK_MOE_TIMEOUT (default 300) bounds it; QARL_GPU_CHECK_MOE_TOKENS and _ITERS set the
  # token counts and the timed iterations.
  if [ "$rt" = cuda ] && [ "${QARL_GPU_CHECK_MOE:-1}" = 1 ]; then
    echo "== MoE block at prefill and training sizes on cuda =="
    timeout "${QARL_GPU_CHECK_MOE_TIMEOUT:-300}" "${launch[@]}" bench kernels --runtime cuda --check --parts moe \
      --formats int4-g128 --tokens "${QARL_GPU_CHECK_MOE_TOKENS:-1,16,64,256,1024,4096}" --act-dtype bf16 \
      --iters "${QARL_GPU_CHECK_MOE_ITERS:-20}" \
      --json "$out/kernels_moe_cuda.json" 2>&1 | tee "$out/kernels_moe_cuda.txt" || status=1
  fi
  # Optional (QARL_GPU_CHECK_PROFILE=1): Nsight Compute's view of the MoE block's tiles at 4096 tokens
  # (QARL_GPU_CHECK_PROFILE_TOKENS) where the image has `ncu` (speed of light, occupancy, memory, warp
  # states, launch): the bench times only the rows QARL_GPU_CHECK_PROFILE_ONLY names (default
  # "moe/mma-frag"; `qarl bench kernels --only`), and ncu takes the first 4 launches whose name matches
  # QARL_GPU_CHECK_PROFILE_KERNELS (default "grouped_fragments"; the decode: tokens 16, only
  # moe/decode-split, kernels grouped_gemv), into profile_moe.txt: what the kernel waits on, before
  # another rewrite. Without `ncu` (or without counter permissions) the file says so.
  if [ "$rt" = cuda ] && [ "${QARL_GPU_CHECK_PROFILE:-0}" = 1 ]; then
    ncu_bin="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)"
    if [ -n "$ncu_bin" ]; then
      echo "== Nsight Compute: $ncu_bin =="
      timeout "${QARL_GPU_CHECK_PROFILE_TIMEOUT:-120}" "$ncu_bin" --target-processes all \
        --kernel-name "regex:${QARL_GPU_CHECK_PROFILE_KERNELS:-grouped_fragments}" --launch-count 4 \
        --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section LaunchStats \
        "${launch[@]}" bench kernels --runtime cuda --parts moe --formats int4-g128 \
        --tokens "${QARL_GPU_CHECK_PROFILE_TOKENS:-4096}" --act-dtype bf16 \
        --only "${QARL_GPU_CHECK_PROFILE_ONLY:-moe/mma-frag}" \
        --iters 1 > "$out/profile_moe.txt" 2>&1 || echo "ncu ended with an error (see profile_moe.txt)"
      tail -40 "$out/profile_moe.txt"
    else
      echo "no ncu on this machine: no profile" | tee "$out/profile_moe.txt"
    fi
  fi
  # Then the RL step on the GPU (issue 28's det-vs-off target), before the general kernel tables.
  if [[ " ${QARL_GPU_CHECK_STEP_RUNTIMES-cuda} " == *" $rt "* ]]; then
    step_rl "$rt" "${launch[@]}" || status=1
  fi
  flex_launch=("${launch[@]}")
  # QARL_GPU_CHECK_TIMEOUT_CUDA / _WGPU: seconds for one runtime (else QARL_GPU_CHECK_TIMEOUT, 200).
  per_rt_timeout="QARL_GPU_CHECK_TIMEOUT_${rt^^}"
  # The general kernel tables (every format, dense and MoE); QARL_GPU_CHECK_KERNELS=0 skips them.
  if [ "${QARL_GPU_CHECK_KERNELS:-1}" = 1 ]; then
    timeout "${!per_rt_timeout:-${QARL_GPU_CHECK_TIMEOUT:-200}}" "${launch[@]}" bench kernels --runtime "$rt" --check \
      --iters "${QARL_GPU_CHECK_ITERS:-50}" --act-dtype "${QARL_GPU_CHECK_DTYPES:-f32,bf16}" "${extra[@]}" "${extra_rt[@]}" \
      --json "$out/kernels_$rt.json" 2>&1 | tee "$out/kernels_$rt.txt" || status=1
  fi
  if [ "$rt" = cuda ] && [ "${QARL_GPU_CHECK_ROLLOUT:-1}" = 1 ]; then
    echo "== rollout on cuda =="
    { rm -rf /tmp/moe200m && "${launch[@]}" init-model --config configs/models/qwen3-moe-200m.json --output /tmp/moe200m &&
      timeout "${QARL_GPU_CHECK_ROLLOUT_TIMEOUT:-100}" "${launch[@]}" bench rollout --backend cuda \
        --model /tmp/moe200m --batch 8 --prompt-len 64 --new-tokens 32 --repeats 1 \
        --schemes f32,int4-g128,int8-pc,fp8-b128 --json "$out/rollout_cuda.json"; } 2>&1 |
      tee "$out/rollout_cuda.txt" || status=1
  fi
done
# The same RL steps on the CPU (flex) for scale, last: they compete for nothing on the GPU but take
# minutes. QARL_GPU_CHECK_STEP_FLEX=0 skips them.
if [ "${QARL_GPU_CHECK_STEP_FLEX:-1}" = 1 ] && [ -n "${flex_launch+x}" ]; then
  step_rl flex "${flex_launch[@]}" || status=1
fi
exit $status

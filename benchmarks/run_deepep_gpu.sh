#!/usr/bin/env bash
# Issue 28's run on two H200s of one host (the device tool's nvidia-h200-x2), one call:
#   bash benchmarks/run_deepep_gpu.sh "kernel groups dispatch" [CONFIGS...]
# with carry [".deepep"], which holds:
#   gpu-site-engine.tar.xz  ENGINE_ONLY=1 bash benchmarks/gpu_site.sh (flashinfer, pydantic, ...)
#   deepep-src.tar.gz       DeepEP v1.2.1's source (git archive of the `fetch` snapshot)
#   deep_ep-*.whl           optional: a wheel an earlier call built (else built here, ~75 s,
#                           in the background, and written to $OUT for the next call)
# Stages:
#   kernel   : tests/moe/test_masked_moe_gpu.py (full width: 128 local experts, e4m3 rows)
#   groups   : benchmarks/deepep_full_width.py run for each config (default: deepep-auto
#              gather); a config that fails is run again small with CUDA_LAUNCH_BLOCKING=1
#              to name the failing kernel; then the report
#   (GROUP_S_<config with _ for -> overrides GROUP_S, the seconds one config may take)
#   dispatch : benchmarks/bench_dispatch.py at DeepSeek-V3's width (7168, 256 experts, top-8)
# Results go to $OUT (fw.tar.gz holds the per-config JSON and logs).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$OUT/fw"
START=$(date +%s)
elapsed() { echo "$(($(date +%s) - START))"; }
mkdir -p /tmp/site && tar -xJf .deepep/gpu-site-engine.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN
export DSV3SERVE_CACHE=/tmp/dsv3serve_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if ls .deepep/deep_ep-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps .deepep/deep_ep-*.whl
else
  (bash benchmarks/deepep/build.sh build .deepep "$OUT" > "$OUT/deepep_build.log" 2>&1
   echo "deepep build rc=$? ($(elapsed) s)" >> "$OUT/deepep_build.log") &
  DEEPEP_PID=$!
fi

stage_kernel() {
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/moe/test_masked_moe_gpu.py > "$OUT/kernel.log" 2>&1
  echo "kernel tests rc=$? ($(elapsed) s)"; tail -3 "$OUT/kernel.log"
}

group() {  # group CONFIG TIMEOUT_S [extra args]: one config's run, diagnosed when it fails
  local name=$1 t=$2; shift 2
  timeout -k 10 "$t" python3 benchmarks/deepep_full_width.py run "$OUT/fw" "$name" "$@" \
    > "$OUT/fw/$name.log" 2>&1
  local rc=$?; echo "$name rc=$rc ($(elapsed) s)"
  grep -E "built in|^\{" "$OUT/fw/$name.log" | cut -c1-300
  if [ "$rc" -ne 0 ]; then
    grep -E "Error|error|illegal|Traceback" "$OUT/fw/$name.log" | head -8
    CUDA_LAUNCH_BLOCKING=1 timeout -k 10 "${DIAG_S:-150}" python3 benchmarks/deepep_full_width.py \
      run "$OUT/fw/diag" "$name" --layers 4 --per-rank 4 --prefill-per-rank 0 \
      > "$OUT/fw/$name.diag.log" 2>&1
    echo "$name diag (CUDA_LAUNCH_BLOCKING=1, 4 layers) rc=$? ($(elapsed) s)"
    grep -B2 -A12 -E "illegal|Error" "$OUT/fw/$name.diag.log" | head -40
  fi
}

stage_groups() {
  if [ -n "${DEEPEP_PID:-}" ]; then wait "$DEEPEP_PID"; tail -2 "$OUT/deepep_build.log"; fi
  local name
  for name in ${CONFIGS:-deepep-auto gather}; do
    if [ "$(elapsed)" -gt "${GROUPS_UNTIL_S:-420}" ]; then echo "skip $name: time"; continue; fi
    local var="GROUP_S_${name//-/_}"
    group "$name" "${!var:-${GROUP_S:-200}}" ${GROUP_ARGS:-}
  done
  python3 benchmarks/deepep_full_width.py report "$OUT/fw" 2>&1 | tee "$OUT/fw/report.txt"
}

stage_dispatch() {
  if [ -n "${DEEPEP_PID:-}" ]; then wait "$DEEPEP_PID"; fi
  if [ "$(elapsed)" -gt "${DISPATCH_UNTIL_S:-480}" ]; then echo "skip dispatch: time"; return; fi
  timeout -k 5 "${DISPATCH_S:-120}" python3 benchmarks/bench_dispatch.py --device cuda --ranks 2 \
    --tokens 16 64 128 256 --hidden 7168 --experts 256 --topk 8 \
    --out "$OUT/fw/dispatch_2xh200.json" > "$OUT/fw/dispatch.log" 2>&1
  echo "dispatch rc=$? ($(elapsed) s)"; tail -22 "$OUT/fw/dispatch.log"
}

for s in ${1:-kernel groups dispatch}; do "stage_$s"; done
tar -czf "$OUT/fw.tar.gz" -C "$OUT" fw && rm -rf "$OUT/fw"
echo "done ($(elapsed) s)"

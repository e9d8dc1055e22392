#!/usr/bin/env bash
# DeepGEMM on one H100 / H200 (issue 46, items 2-3), one device call of at most ~9 minutes:
#   bash benchmarks/run_deepgemm_gpu.sh ["build check tests warm bench"]
# with carry [".deepgemm"], which holds (docs/deepgemm.md):
#   deepgemm-src.tar.gz, cutlass-headers.tar.xz, fmt-headers.tar.gz, PACKED.txt
#                             benchmarks/deepgemm/build.sh pack .deepgemm <DeepGEMM git> ...
#   gpu-site-engine.tar.xz    ENGINE_ONLY=1 bash benchmarks/gpu_site.sh (pydantic for the CLI)
#   deep_gemm-*.whl           optional: the wheel an earlier call built (else built here)
#   deepgemm-jit-cache.tar.gz optional: an earlier call's compiled kernels
# Stages, in order (time guards skip a stage that would not finish):
#   build : the wheel (benchmarks/deepgemm/build.sh build), or the carried one, unpacked
#   check : benchmarks/deepgemm/check.py             } in the background, their kernels
#   tests : the DeepGEMM GPU tests + the glue's CPU tests } compiling beside the warm-up
#   warm  : the bench's DeepGEMM calls once each, in parallel processes (nvcc JIT into the cache)
#   bench : dsv3serve bench kernels --only deepgemm, alone on the GPU, writing the table
# $OUT gets at most 8 files: summary.log, logs.tar.gz (every log), deep_gemm-*.whl,
# deepgemm-jit-cache.tar.gz, deepgemm_build.json, deepgemm_check.json, bench_deepgemm.json,
# deepgemm_table.json (copy it to dsv3serve/kernels/configs/deepgemm,device=<GPU>.json).
set -u
OUT=${OUT:-/tmp/out}; LOGS=/tmp/deepgemm_logs; SITE=/tmp/deepgemm_site
mkdir -p "$OUT" "$LOGS" "$SITE" /tmp/site
START=$(date +%s)
elapsed() { echo "$(($(date +%s) - START))"; }
say() { echo "[$(elapsed) s] $*" | tee -a "$OUT/summary.log"; }
SITE_TAR=$(ls .deepgemm/gpu-site-engine.tar.xz .whl/gpu-site-engine.tar.xz 2>/dev/null | head -1)
[ -n "$SITE_TAR" ] && tar -xJf "$SITE_TAR" -C /tmp/site
export PYTHONPATH=$SITE:/tmp/site:. PYTHONUNBUFFERED=1
export DSV3SERVE_CACHE=/tmp/dsv3serve_cache DG_JIT_CACHE_DIR=/tmp/dsv3serve_cache/deep_gemm
# DeepGEMM runs nvcc and cuobjdump from $CUDA_HOME/bin (else from `which nvcc`'s parent's parent)
[ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && export CUDA_HOME=/usr/local/cuda
mkdir -p "$DG_JIT_CACHE_DIR"
if [ -f .deepgemm/deepgemm-jit-cache.tar.gz ]; then
  tar -xzf .deepgemm/deepgemm-jit-cache.tar.gz -C "$DG_JIT_CACHE_DIR"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
  nvcc --version | grep release; g++ --version | head -1; echo "cpus $(nproc)"; date -u
  cat .deepgemm/PACKED.txt; echo "site: ${SITE_TAR:-none}"; } >> "$OUT/summary.log" 2>&1
cat "$OUT/summary.log"
BACKGROUND=()

stage_build() {
  local wheel
  wheel=$(ls .deepgemm/deep_gemm-*.whl 2>/dev/null | head -1)
  if [ -n "$wheel" ]; then
    bash benchmarks/deepgemm/build.sh install .deepgemm "$wheel" "$SITE" > "$LOGS/build.log" 2>&1
    say "carried wheel $(basename "$wheel"): install rc=$?"; cp "$wheel" "$OUT/"
  else
    DG_NO_CHECK=1 timeout -k 10 "${BUILD_S:-400}" bash benchmarks/deepgemm/build.sh build \
      .deepgemm "$OUT" "$SITE" > "$LOGS/build.log" 2>&1
    local rc=$?
    say "build rc=$rc ($(grep -o '"build_seconds": [0-9.]*' "$OUT/deepgemm_build.json" 2>/dev/null))"
    grep -E "error|Error" "$LOGS/build.log" | head -8 | cut -c1-300 | tee -a "$OUT/summary.log"
    [ "$rc" -eq 0 ] || tail -4 "$LOGS/build.log" | cut -c1-300 | tee -a "$OUT/summary.log"
  fi
  python3 -c 'import torch, deep_gemm; print(deep_gemm.__file__)' > "$LOGS/import.log" 2>&1 ||
    { say "deep_gemm does not import: $(tail -1 "$LOGS/import.log")"; return 1; }
}

stage_check() {
  (timeout -k 5 "${CHECK_S:-300}" python3 benchmarks/deepgemm/check.py \
     "$OUT/deepgemm_check.json" > "$LOGS/check.log" 2>&1
   say "check rc=$?"; grep -E '^\{"case"|probe' "$LOGS/check.log" | cut -c1-240 |
     tee -a "$OUT/summary.log") &
  BACKGROUND+=($!)
}

stage_tests() {
  (timeout -k 5 "${TESTS_S:-330}" python3 -m pytest -q -p no:cacheprovider -rfE \
     tests/kernels/test_deepgemm_gpu.py tests/moe/test_deepgemm_moe_gpu.py \
     tests/kernels/test_deepgemm_backend.py tests/kernels/test_gemm_table.py \
     tests/moe/test_deepgemm_moe.py tests/bench/test_bench_deepgemm.py \
     > "$LOGS/tests.log" 2>&1
   say "tests rc=$?: $(tail -1 "$LOGS/tests.log")") &
  BACKGROUND+=($!)
}

stage_warm() {  # one process per dense shape, one per MoE layout, all compiling at once
  local pids=() shape part p fails=0
  for shape in $(python3 -c 'from dsv3serve.bench.kernels.deepgemm import dense_shapes
print(" ".join(dense_shapes(1)))'); do
    timeout -k 5 "${WARM_S:-240}" python3 -m dsv3serve.bench.kernels.deepgemm_run warm \
      --deepgemm-parts dense --deepgemm-shapes "$shape" > "$LOGS/warm_$shape.log" 2>&1 &
    pids+=($!)
  done
  for part in contiguous masked; do
    timeout -k 5 "${WARM_S:-240}" python3 -m dsv3serve.bench.kernels.deepgemm_run warm \
      --deepgemm-parts $part > "$LOGS/warm_$part.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || fails=$((fails + 1)); done
  say "warm: ${#pids[@]} processes, $fails failed;" \
    "$(find "$DG_JIT_CACHE_DIR" -name '*.cubin' | wc -l) kernels cached"
  if [ "$fails" -gt 0 ]; then
    grep -h -E "Error|error" "$LOGS"/warm_*.log | sort | uniq -c | head -5 | cut -c1-300 |
      tee -a "$OUT/summary.log"
  fi
}

stage_bench() {
  local p
  for p in "${BACKGROUND[@]}"; do wait "$p"; done  # the GPU to itself
  BACKGROUND=()
  if [ "$(elapsed)" -gt "${BENCH_UNTIL_S:-400}" ]; then say "skip bench: time"; return; fi
  timeout -k 5 "${BENCH_S:-$((535 - $(elapsed)))}" python3 -m dsv3serve.cli bench kernels \
    --only deepgemm --replays "${REPLAYS:-10}" --json "$OUT/bench_deepgemm.json" \
    --write-deepgemm-table "$OUT/deepgemm_table.json" ${BENCH_ARGS:-} > "$LOGS/bench.log" 2>&1
  say "bench rc=$?"
  grep -v '^{' "$LOGS/bench.log" | tail -50 | tee -a "$OUT/summary.log"
}

for s in ${1:-build check tests warm bench}; do
  "stage_$s" || break
done
for p in "${BACKGROUND[@]}"; do wait "$p"; done
grep -E "passed|failed|FAILED|ERROR" "$LOGS/tests.log" 2>/dev/null | tail -12 >> "$OUT/summary.log"
tar -czf "$OUT/deepgemm-jit-cache.tar.gz" -C "$DG_JIT_CACHE_DIR" . 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null
say "done; OUT: $(ls "$OUT" | tr '\n' ' ')"

#!/usr/bin/env bash
# Issue 16's run on two GPUs of one host (the device tool's nvidia-h100-x2), one call:
#   stage pd       : the KV connectors cuda:0 -> cuda:1 (tests/transfer/test_kv_transfer_gpu.py)
#   stage deepep   : installs the DeepEP wheel carried in .deepep/, or builds it there in the
#                    background (benchmarks/deepep/build.sh, from the source tarball in .deepep/,
#                    the image's NVSHMEM) into $OUT; the groups stage waits for it
#   stage jit      : compiles flashinfer's and Triton's JIT modules on GPU 1 in the background
#                    (`dsv3serve warmup`, DeepSeek-V3 attention shapes), so the graphed
#                    layouts later find them in the shared cache
#   stage groups   : benchmarks/two_gpu_groups.py: tp2, tp2+ep2, dp2+ep2 (+ DP lm head), the
#                    bench model's layers at full width, DeepEP auto / low_latency / normal,
#                    greedy tokens vs one GPU, graphs and overlap on; a layout that stalls
#                    leaves every rank's stacks in groups.log and the script goes on
#   stage dispatch : benchmarks/bench_dispatch.py: all-to-all vs DeepEP normal vs low-latency,
#                    bf16 and fp8, 1..4096 tokens per rank, vs an NVLink p2p copy
# Needs a wheels dir ($WHEELS, default .whl/): the pydantic stack, flashinfer-python and
# apache-tvm-ffi, and site/ (the tokenizer package). Results go to $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s)
W=${WHEELS:-.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $W/*.whl || exit 1
export PYTHONPATH=/tmp/site:$W/site:. PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN
export DSV3SERVE_CACHE=/tmp/dsv3serve_cache  # one compile cache for every process
export DSV3SERVE_RANK_STACKS_S=${RANK_STACKS_S:-100}  # spawned ranks: stacks every 100 s
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
  nvidia-smi topo -m; date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
elapsed() { echo "$(($(date +%s) - START)) s"; }
stage_pd() {
  timeout -k 5 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/transfer/test_kv_transfer_gpu.py > "$OUT/pd.log" 2>&1
  echo "pd rc=$? ($(elapsed))"; tail -3 "$OUT/pd.log"
}
stage_deepep() {  # the wheel benchmarks/deepep/build.sh made (carried in .deepep/), else build it
  if ls .deepep/deep_ep-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps .deepep/deep_ep-*.whl
    python3 -c 'import deep_ep; print("deep_ep", deep_ep.__file__)'
  else
    (bash benchmarks/deepep/build.sh build .deepep "$OUT" > "$OUT/deepep_build.log" 2>&1
     echo "deepep build rc=$? ($(elapsed))" >> "$OUT/deepep_build.log") &
    DEEPEP_PID=$!
  fi
}
stage_jit() {  # flashinfer's and Triton's JIT on GPU 1, in the background, into the shared cache
  (CUDA_VISIBLE_DEVICES=1 timeout 300 python3 -m dsv3serve.cli warmup --device cuda \
     --attention-backend flashinfer --moe-backend triton --model deepseek-v3 --load-format dummy \
     --hf-overrides '{"num_hidden_layers": 1, "num_nextn_predict_layers": 0}' \
     --cuda-graph-max-bs 4 > "$OUT/jit.log" 2>&1; echo "jit warmup rc=$? ($(elapsed))" >> "$OUT/jit.log") &
}
# groups BUDGET_S LAYOUTS...: two_gpu_groups.py until every layout has a row (restarted after
# a stall) or BUDGET_S is spent
groups() {
  local budget=$1 t0; t0=$(date +%s); shift
  while :; do
    local left=$((budget - ($(date +%s) - t0)))
    [ "$left" -lt 30 ] && { echo "groups: budget spent"; break; }
    timeout -k 5 "$left" python3 benchmarks/two_gpu_groups.py "$OUT" --budget-s $((left - 20)) \
      --stall-s "${STALL_S:-150}" --layouts "$@" >> "$OUT/groups.log" 2>&1
    local rc=$?; echo "groups rc=$rc ($(elapsed))"; [ "$rc" -eq 3 ] || break
  done
}
stage_groups() {  # DeepEP and float32 layouts need no flashinfer: they run while it compiles
  if [ -n "${DEEPEP_PID:-}" ]; then wait "$DEEPEP_PID"; tail -2 "$OUT/deepep_build.log"; fi
  local all="tp2-ep2-fp32 dp2-ep2-fp32 dp2-ep2-a2a-bf16 dp2-ep2-deepep-low-latency
    dp2-ep2-deepep-normal dp2-ep2-deepep-auto tp2-graphs tp2-ep2-graphs dp2-ep2-graphs
    dp2-ep2-dp-lm-head-graphs full-width-tp2-ep2-graphs full-width-dp2-ep2-graphs"
  # shellcheck disable=SC2086  # the layout names are words
  groups "${GROUPS_S:-540}" ${GROUPS_LAYOUTS:-$all}
  tail -3 "$OUT/jit.log" 2>/dev/null
  grep -E "^[a-z0-9-]+ \{|stalled|checkpoint" "$OUT/groups.log" | cut -c1-400
}
stage_dispatch() {
  timeout -k 5 "${DISPATCH_S:-150}" python3 benchmarks/bench_dispatch.py ${DISPATCH_ARGS:-} \
    --out "$OUT/dispatch_2xh100.json" > "$OUT/dispatch.log" 2>&1
  echo "dispatch rc=$? ($(elapsed))"; tail -25 "$OUT/dispatch.log"
}
for s in "${@:-pd groups dispatch}"; do for t in $s; do "stage_$t"; done; done

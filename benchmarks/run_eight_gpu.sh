#!/usr/bin/env bash
# Issue 17's run on eight GPUs of one host (the device tool's nvidia-h200-x8, or nvidia-h100-x8
# with a layout that fits 80 GB: the planner decides): the published DeepSeek-V3 config at full
# size (61 layers, 256 experts; NextN for the MTP rows), dummy FP8 weights, one worker group
# over the eight GPUs. PREPARED, NOT RUN: no eight-GPU kind has been lent to this project yet.
#   bash benchmarks/run_eight_gpu.sh                  (all stages, in this order)
#   bash benchmarks/run_eight_gpu.sh plan ceilings    (some of them)
# Stages (each writes a log and JSON under $OUT; copy them to docs/perf/ to commit):
#   plan      : `dsv3serve plan` for the three layouts below (refused layouts end the run early)
#   ceilings  : this machine's copy bandwidth and bf16 / FP8 GEMM peaks (`bench kernels`),
#               the denominators of every ratio
#   decode    : DP8 + DP attention + EP8, DeepEP low-latency ($A2A, default deepep; "none" for
#               the NCCL all-to-all), overlap on, CUDA graphs on ($GRAPHS, default on: set
#               GRAPHS=off while issue 16 has not compared graphed groups), 2K-token contexts,
#               batch per rank swept ($DECODE_BS, total over the 8 ranks): output tok/s per GPU
#               and inter-token latency from `bench one-batch`
#   latency   : batch 1 on TP8 attention + EP8, without and with MTP (NEXTN, 3 steps)
#   prefill   : 4K-token prompts on TP8 + EP8: input tok/s per GPU
# Anchors (issue 17): SGLang 2.8k tok/s per H100 decode, vLLM/llm-d 2.2k and Ray Serve LLM 2.4k
# per H200; TensorRT-LLM 158 tok/s/user on 8x H200; SGLang 52.3k input tok/s per 8x H100 node.
# Needs the wheels of run_two_gpu.sh in .whl/ (and the DeepEP wheel in .deepep/).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
if ls .deepep/deep_ep-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps .deepep/deep_ep-*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:.whl/site:. PYTHONUNBUFFERED=1 DSV3SERVE_CACHE=/tmp/dsv3serve_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
  nvidia-smi topo -m; date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
elapsed() { echo "$(($(date +%s) - START)) s"; }

MODEL="--model deepseek-v3 --load-format dummy --device cuda --attention-backend flashinfer --moe-backend triton"
DP8="--tp-size 8 --dp-size 8 --enable-dp-attention --ep-size 8 --moe-a2a-backend ${A2A:-deepep} --deepep-mode low_latency"
TP8="--tp-size 8 --ep-size 8"
MTP="--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
GRAPH_FLAG=""; [ "${GRAPHS:-on}" = off ] && GRAPH_FLAG="--disable-cuda-graph"

# run NAME MAX_S CMD...: one measurement under a time limit, log and rc recorded
run() {
  local name=$1 max=$2; shift 2
  timeout -k 10 "$max" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? ($(elapsed))"; grep -v '^{' "$OUT/$name.log" | tail -12
}
stage_plan() {
  for layout in "$DP8" "$TP8"; do
    # shellcheck disable=SC2086  # flags are words
    python3 -m dsv3serve.cli plan --model deepseek-v3 $layout --gpu-memory-gb "${GPU_GB:-141}" \
      || exit 1
  done > "$OUT/plan.log" 2>&1
  echo "plan ($(elapsed))"; tail -20 "$OUT/plan.log"
}
stage_ceilings() {
  run ceilings 300 python3 -m dsv3serve.cli bench kernels --only fp8 --json "$OUT/ceilings.json"
}
stage_decode() {
  # shellcheck disable=SC2086
  run decode 900 python3 -m dsv3serve.cli bench one-batch $MODEL $DP8 $GRAPH_FLAG \
    --batch-size ${DECODE_BS:-8 64 256 1024} --input-len 2048 --output-len 64 \
    --json "$OUT/decode_dp8_ep8.json"
}
stage_latency() {
  # shellcheck disable=SC2086
  run latency 600 python3 -m dsv3serve.cli bench one-batch $MODEL $TP8 $GRAPH_FLAG \
    --batch-size 1 --input-len 2048 --output-len 64 --json "$OUT/latency_tp8_ep8.json"
  # shellcheck disable=SC2086
  run latency_mtp 600 python3 -m dsv3serve.cli bench one-batch $MODEL $TP8 $MTP $GRAPH_FLAG \
    --batch-size 1 --input-len 2048 --output-len 64 --json "$OUT/latency_tp8_ep8_mtp.json"
}
stage_prefill() {
  # shellcheck disable=SC2086
  run prefill 600 python3 -m dsv3serve.cli bench one-batch $MODEL $TP8 $GRAPH_FLAG \
    --batch-size 1 8 --input-len 4096 --output-len 1 --json "$OUT/prefill_tp8_ep8.json"
}
for s in "${@:-plan ceilings decode latency prefill}"; do for t in $s; do "stage_$t"; done; done

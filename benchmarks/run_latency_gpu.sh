#!/usr/bin/env bash
# Issue 34 (one-GPU latency) on one H200, one device call, from the repo root, with carry
# [".deepep"]:
#   bash benchmarks/run_latency_gpu.sh            (stages: bench mla)
#   bash benchmarks/run_latency_gpu.sh tests bench (some of them, in this order)
# Stages:
#   tests : GPU tests of the paths this issue changes (spec graphs, fused paths, MLA kernels)
#   (BENCH_FLAGS: more `bench model` flags, e.g. "--mtp-steps 3 --iters 10" for a shorter run)
#   bench : `bench model` (1 dense + 2 MoE layers at DeepSeek-V3 width, dummy FP8, flashinfer +
#           Triton MoE, ctx 1024): graphed decode at batch 1 against the same run's roofline,
#           the MTP costs (k = 1..3) through graphs, and --profile-graphs: device ops, the
#           op timeline and the host functions (cProfile) of the decode step, one draft
#           step, the k = 3 chain and the k = 3 verify
#   benchfp8: the same with an fp8 KV pool (decode attention through our Triton kernel, whose
#           plan is lighter than flashinfer's)
#   fp8probe: flashinfer's FP8-KV MLA decode against its bf16 decode, with its errors
#   layoutprobe: where the FP8 tensor-core MLA kernel's time goes (QK^T only, PV only) and
#           whether a token-major copy of V helps, beside flashinfer bf16
#   mla   : `bench kernels --only mla` at 64 x 4K and 128 x 4K: flashinfer bf16 beside our
#           kernels on bf16 and fp8 pools
# .deepep/gpu-site-engine.tar.xz holds the engine's packages the image lacks (flashinfer,
# pydantic, ...: ENGINE_ONLY=1 bash benchmarks/gpu_site.sh). Logs and JSON go to $OUT; each
# stage gets at most what is left of BUDGET_S (default 540 s).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); BUDGET_S=${BUDGET_S:-540}
mkdir -p /tmp/site && tar -xJf .deepep/gpu-site-engine.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
export DSV3SERVE_CACHE=/tmp/dsv3serve_cache
mkdir -p "$DSV3SERVE_CACHE"
FAST="--device cuda --attention-backend flashinfer --moe-backend triton"

. benchmarks/stage_budget.sh  # left, run

stage_tests() {
  run gpu_tests "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -rfE -m gpu \
    ${GPU_TESTS:-tests/engine/speculative/test_spec_graphs_gpu.py tests/engine/test_cuda_graph_gpu.py \
    tests/attention/test_attention_flashinfer_gpu.py tests/kernels/test_argmax_gpu.py}
  grep -E "passed|failed|Error" "$OUT/gpu_tests.log" | tail -15
}
bench_model() {  # bench_model NAME [FLAGS...]
  local name=$1; shift
  run "$name" "${BENCH_S:-300}" python3 -m dsv3serve.cli bench model $FAST --profile-graphs \
    --num-moe-layers 2 --prefill-lens --decode-batch-sizes 1 --decode-contexts 1024 \
    --mtp-batch-sizes 1 --mtp-steps 1 2 3 --warmup 3 --iters 20 --out "$OUT/$name.json" "$@" \
    ${BENCH_FLAGS:-}
  python3 benchmarks/latency_summary.py "$OUT/$name.json" 2>&1 | head -40
}
stage_bench() { bench_model bench_model; }
stage_benchfp8() { bench_model bench_model_fp8kv --kv-cache-dtype fp8_e4m3; }
stage_fp8probe() {
  run fp8probe "${PROBE_S:-120}" python3 benchmarks/mla_fp8_flashinfer_probe.py "$OUT/fp8probe.json"
  cat "$OUT/fp8probe.log" | tail -8
}
stage_layoutprobe() {
  run layoutprobe "${PROBE_S:-240}" python3 benchmarks/mla_fp8_layout_probe.py "$OUT/layoutprobe.json"
  tail -80 "$OUT/layoutprobe.log"
}
stage_mla() {
  run mla "${MLA_S:-150}" python3 -m dsv3serve.cli bench kernels --only mla --mla-batch 64 128 \
    --mla-context 4096 --mla-index page --json "$OUT/mla.json"
  grep -v "^{" "$OUT/mla.log" | tail -25
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
  date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(bench mla)
for s in "${stages[@]}"; do "stage_$s"; done
ls -la "$OUT"; echo "total $(($(date +%s) - START)) s"

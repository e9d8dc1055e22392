#!/usr/bin/env bash
# One-GPU speed run (issue 20), one call of under 8 minutes on an H100, from the repo root:
#   bash benchmarks/run_speed_gpu.sh            (all stages, in this order)
#   bash benchmarks/run_speed_gpu.sh ttft ops   (some of them)
# Stages:
#   tests  : the fused kernels' GPU tests (add + RMSNorm + FP8 quant; the MLA q/kv norms and
#            RoPE inside the KV-cache write; the FP8 GEMM), and the model's fused paths
#            against their reference ops; then those fused kernels' times beside their
#            reference ops (`bench kernels --only fused`)
#   bench  : `bench model` graphed decode at batch 1, ctx 1024, 1 dense + 2 MoE layers, in
#            three states: fusions off, the fused add + norm + quant alone, every fusion on
#            (DSV3SERVE_FUSED_NORM_QUANT / DSV3SERVE_FUSED_MLA = 0 0, 1 0, 1 1): ms and ratio
#            to the same run's roofline, and (--profile-graphs) the device ops of the whole
#            graphed step
#   ttft   : process start to first token of `dsv3serve warmup` (DeepSeek-V3 width, dummy FP8
#            weights, 4 layers: 3 dense + 1 MoE, flashinfer + Triton MoE, CUDA graphs), cold
#            (an empty cache dir of its own) then warm (the same cache dir, a second process)
#   ops    : device ops per dense / MoE decoder layer in the same three states
#            (count_layer_ops.py)
# Needs flashinfer-python 0.6.18.post1, apache-tvm-ffi and the pydantic stack: installed by
# the caller, or carried as wheels in .whl/ (with .whl/site), as benchmarks/run_groups_gpu.sh. Logs and JSON go to $OUT. Each stage gets
# at most what is left of BUDGET_S (default 450 s) and is skipped when too little is left.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); BUDGET_S=${BUDGET_S:-440}
if ls .whl/*.whl > /dev/null 2>&1; then  # carried wheels; else the caller installed them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:.whl/site:. PYTHONUNBUFFERED=1
WARM_CACHE=/tmp/dsv3serve_ttft_cache  # cold: emptied first; the other stages use their own
export DSV3SERVE_CACHE=/tmp/dsv3serve_cache
FAST="--device cuda --attention-backend flashinfer --moe-backend triton"

. benchmarks/stage_budget.sh  # left, run

ttft_one() {  # ttft_one cold|warm: process start to first token, from the warmup's JSON
  local kind=$1 t0; t0=$(date +%s.%N)
  run "ttft_$kind" "$2" python3 -m dsv3serve.cli warmup $FAST --model deepseek-v3 \
    --load-format dummy --hf-overrides '{"num_hidden_layers": 4}' --cache-dir "$WARM_CACHE" \
    --prompt-len 256 --max-new-tokens 4
  python3 - "$OUT/ttft_$kind.log" "$t0" "$OUT/ttft_$kind.json" <<'EOF'
import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("{")]
if not lines:
    sys.exit(f"no result in {sys.argv[1]}")
r = json.loads(lines[-1])
r["process_start_to_first_token_s"] = r["first_token_unix"] - float(sys.argv[2])
open(sys.argv[3], "w").write(json.dumps(r, indent=1))
print({k: round(r[k], 2) for k in ("process_start_to_first_token_s", "engine_build_s",
                                   "prefill_to_first_token_s")})
EOF
  grep -E "captured in" "$OUT/ttft_$kind.log" | tail -3
}
stage_ttft() {
  rm -rf "$WARM_CACHE"
  ttft_one cold 170
  du -sh "$WARM_CACHE"/* 2>/dev/null
  ttft_one warm 90
}
stage_tests() {
  run gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -rfE -s -m gpu \
    tests/kernels/test_norm_quant_gpu.py tests/model/test_fused_norm_quant_gpu.py \
    tests/kernels/test_mla_fusion_gpu.py tests/model/test_fused_mla_gpu.py \
    tests/kernels/test_fp8_kernels_gpu.py tests/moe/test_router_logits_gpu.py
  grep -E "relative|passed|failed|Error" "$OUT/gpu_tests.log" | tail -25
  run fused_kernels 60 python3 -m dsv3serve.cli bench kernels --only fused \
    --json "$OUT/fused_kernels.json"
  tail -8 "$OUT/fused_kernels.log"
}
stage_ops() {
  run layer_ops 160 python3 benchmarks/count_layer_ops.py --out "$OUT/layer_ops.json"
  tail -9 "$OUT/layer_ops.log"
}
stage_bench() {
  for fused in 00 10 11; do  # DSV3SERVE_FUSED_NORM_QUANT, DSV3SERVE_FUSED_MLA
    export DSV3SERVE_FUSED_NORM_QUANT=${fused:0:1} DSV3SERVE_FUSED_MLA=${fused:1:1}
    run "bench_model_fused$fused" 120 python3 -m dsv3serve.cli \
      bench model --attention-backend flashinfer --moe-backend triton --no-mtp --profile-graphs \
      --num-moe-layers 2 --quick --prefill-lens --decode-batch-sizes 1 --decode-contexts 1024 \
      --out "$OUT/bench_model_fused$fused.json"
    grep -v "^{" "$OUT/bench_model_fused$fused.log" | grep -A3 -E "^decode step" | tail -8
    python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['profile_graphs']['decode']; \
print('graphed step: ops/call', d['ops_per_call'], 'kernel ms', round(d['kernel_ms'], 3))" \
      "$OUT/bench_model_fused$fused.json" 2>&1 | tail -1
  done
  unset DSV3SERVE_FUSED_NORM_QUANT DSV3SERVE_FUSED_MLA
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
  date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(tests bench ttft ops)
for s in "${stages[@]}"; do "stage_$s"; done
echo "total $(($(date +%s) - START)) s"

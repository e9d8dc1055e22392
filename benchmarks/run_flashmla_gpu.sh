#!/usr/bin/env bash
# FlashMLA decode and MTP verify (issue 46 item 1, `--attention-backend flashmla`) on one
# H100/H200, one device call from the repo root with carry [".whl"]. .whl/ holds these cp312
# wheels (pip download --no-deps --only-binary=:all: --python-version 3.12 ...), 34.4 MB:
#   flashinfer_python-0.6.18.post1-py3-none-any.whl
#   apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
#   pydantic-2.14.4-py3-none-any.whl
#   pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
#   annotated_types-0.8.0-py3-none-any.whl
#   typing_inspection-0.4.5-py3-none-any.whl
#   typing_extensions-4.16.0-py3-none-any.whl
#   sgl_flash_mla-1.0.0-cp310-abi3-manylinux2014_x86_64.whl
# All are installed --no-deps: sgl-flash-mla's metadata asks for torch>=2.14.1, but it is
# built on torch's stable ABI and runs under the image's torch 2.11.
#   bash benchmarks/run_flashmla_gpu.sh              (stages: tests mla model)
#   bash benchmarks/run_flashmla_gpu.sh mla model    (some of them, in this order)
# Stages (each under at most what is left of BUDGET_S, default 540 s):
#   tests : the FlashMLA GPU tests (bf16 and FP8 decode, the MTP verify shape, mixed query
#           lengths, CUDA-graph replay after a new plan, all against the torch reference on
#           NaN-poisoned pools; the engine through FlashMLA against flashinfer, graphs on),
#           then the RoPE-into-cache kernel tests (a per-layer-scale fp8 mode is new)
#   mla   : `bench kernels --only mla` at 64 x 4K and 128 x 4K: flashinfer bf16, flashmla-bf16
#           and flashmla-fp8 in one run, with each row's time ratio to flashinfer bf16
#   model : `bench model` at full width (dummy FP8, 1 dense + 3 MoE layers, no MTP layer),
#           decode at batch 64 and 256 over 4K contexts: a bf16 pool through flashinfer,
#           then an fp8 pool through FlashMLA; benchmarks/flashmla_summary.py prints both
#   modelbf16: the same through FlashMLA over a bf16 pool (not in the default stages)
# Logs and JSON go to $OUT. Should the tests stage leave too little for the model stage (its
# kernels JIT-compile on a fresh machine), run `... run_flashmla_gpu.sh mla model` in a second
# call on the same warm machine.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); BUDGET_S=${BUDGET_S:-540}
ls .whl/*.whl > "$OUT/wheels.txt" || { echo "no wheels in .whl/ (carry [\".whl\"])"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
export DSV3SERVE_CACHE=/tmp/dsv3serve_cache
mkdir -p "$DSV3SERVE_CACHE"

. benchmarks/stage_budget.sh  # left, run

stage_tests() {
  run gpu_tests "${TESTS_S:-220}" python3 -m pytest -q -p no:cacheprovider -rfE -s -m gpu \
    --junitxml="$OUT/gpu_tests.xml" tests/attention/test_attention_flashmla_gpu.py \
    tests/kernels/test_mla_fusion_gpu.py
  grep -E "^(FAILED|ERROR)|passed|failed|fp8 \(relative|bit-identical|vs flashinfer" \
    "$OUT/gpu_tests.log" | tail -30
}
stage_mla() {
  run mla "${MLA_S:-80}" python3 -m dsv3serve.cli bench kernels --only mla --mla-batch 64 128 \
    --mla-context 4096 --mla-index page --mla-kernels flashinfer flashmla-bf16 flashmla-fp8 \
    --json "$OUT/mla.json"
  grep -v "^{" "$OUT/mla.log" | tail -12
}
bench_model() {  # bench_model NAME [FLAGS...]
  local name=$1; shift
  run "$name" "${MODEL_S:-120}" python3 -m dsv3serve.cli bench model --device cuda \
    --moe-backend triton --num-moe-layers 3 --no-mtp --prefill-lens --decode-batch-sizes 64 256 \
    --decode-contexts 4096 --warmup 1 --iters 3 --out "$OUT/$name.json" "$@"
  tail -4 "$OUT/$name.log"
}
summary() {
  python3 benchmarks/flashmla_summary.py flashinfer-bf16="$OUT/model_flashinfer_bf16.json" \
    flashmla-fp8="$OUT/model_flashmla_fp8.json" flashmla-bf16="$OUT/model_flashmla_bf16.json" \
    | tee "$OUT/model_summary.txt"
}
stage_model() {
  bench_model model_flashinfer_bf16 --attention-backend flashinfer
  bench_model model_flashmla_fp8 --attention-backend flashmla --kv-cache-dtype fp8_e4m3
  summary
}
stage_modelbf16() {
  bench_model model_flashmla_bf16 --attention-backend flashmla
  summary
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
  python3 -c "import flashinfer, flash_mla; print('flashinfer', flashinfer.__version__, \
'flash_mla', flash_mla.__version__, 'legacy', flash_mla.has_legacy())"
  date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(tests mla model)
for s in "${stages[@]}"; do "stage_$s"; done
ls -la "$OUT"; echo "total $(($(date +%s) - START)) s"

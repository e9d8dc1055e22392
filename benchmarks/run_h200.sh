#!/usr/bin/env bash
# Device runs on an H200 for the kernels and MTP issues. Usage: bash benchmarks/run_h200.sh STAGE...
# Stages: tests (every `-m gpu` test), kernels (bench kernels, all sections), model (bench model,
# fast backends), tune (MoE tuner, fp8, one table per token count; the first T compiles for
# over a minute, later ones reuse Triton's cache; merge the tables into dsv3serve/moe/configs/). Needs the wheels in .whl/
# (pydantic stack, flashinfer-python 0.6.18.post1, apache-tvm-ffi) and .whl/site (tokenizer data).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.whl/site:. PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, flashinfer; print(torch.__version__, triton.__version__, flashinfer.__version__)"
  date -u; } >> "$OUT/env.txt" 2>&1
stage_tests() {
  timeout -k 5 "${T_TESTS:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -n "${NPROC:-4}" -rfE \
    --junitxml="$OUT/gpu_tests.xml" ${TEST_FILES:-tests} > "$OUT/gpu_tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/env.txt"; tail -15 "$OUT/gpu_tests.log"
}
stage_kernels() {
  timeout -k 5 "${T_KERNELS:-220}" python3 -m dsv3serve.cli bench kernels --only "${ONLY:-fp8,moe,gate,mla}" \
    --json "$OUT/bench_kernels.json" > "$OUT/bench_kernels.log" 2>&1
  echo "kernels rc=$?" >> "$OUT/env.txt"; tail -60 "$OUT/bench_kernels.log"
}
stage_model() {
  timeout -k 5 "${T_MODEL:-300}" python3 -m dsv3serve.cli bench model --attention-backend flashinfer \
    --moe-backend triton ${MODEL_ARGS:-} --out "$OUT/bench_model.json" > "$OUT/bench_model.log" 2>&1
  echo "model rc=$?" >> "$OUT/env.txt"; tail -60 "$OUT/bench_model.log"
}
stage_tune() {
  for t in ${TUNE_TOKENS:-1 8 32 128 512 4096}; do
    timeout -k 5 "${T_TUNE:-60}" python3 -m dsv3serve.bench.kernels.moe_tune --dtype fp8 --tokens "$t" \
      --out "/tmp/tune/t$t" > "/tmp/tune_t$t.log" 2>&1
    echo "tune t=$t rc=$?" >> "$OUT/env.txt"
    cp /tmp/tune/t"$t"/*.json "$OUT/table_t$t.json"  # '=' and ',' in the name do not come back
  done
}
for s in "$@"; do "stage_$s"; done
cat "$OUT/env.txt"

#!/usr/bin/env bash
# The final device runs on an H200 (two calls while the machine stays warm):
#   bash benchmarks/run_h200_final.sh tests kernels   then   bash benchmarks/run_h200_final.sh model onebatch
# Needs the wheels in .whl/ (see run_h200.sh). Logs and JSON go to $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.whl/site:. PYTHONUNBUFFERED=1
PYT="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
HEAVY="tests/model/test_full_width_fp8_gpu.py tests/moe/test_moe_kernels_gpu.py tests/engine/test_overlap_gpu.py tests/engine/test_gpu_engine_vs_cpu.py"
stage_tests() {  # light files in parallel; the ones holding 45+ GB, or printing numbers, one at a time
  light=$(grep -l "mark.gpu" tests/*/test_*.py | grep -v -e full_width -e moe_kernels_gpu -e overlap_gpu -e engine_vs_cpu)
  timeout -k 5 260 $PYT -n 3 $light > "$OUT/gpu_tests_light.log" 2>&1; echo "light rc=$?"
  tail -3 "$OUT/gpu_tests_light.log"
  timeout -k 5 200 $PYT -s $HEAVY > "$OUT/gpu_tests_heavy.log" 2>&1; echo "heavy rc=$?"
  grep -E "rel_err|margin|identical|replays|passed|failed" "$OUT/gpu_tests_heavy.log" | tail -12
  timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider tests/moe/test_moe_kernels_sm90.py \
    > "$OUT/sm90.log" 2>&1; echo "sm90 rc=$?"; tail -1 "$OUT/sm90.log"
}
stage_kernels() {
  timeout -k 5 200 python3 -m dsv3serve.cli bench kernels --only fp8,moe,gate,mla \
    --json "$OUT/bench_kernels.json" > "$OUT/bench_kernels.log" 2>&1; echo "kernels rc=$?"
  grep -v "^{" "$OUT/bench_kernels.log" | tail -75
}
stage_model() {
  timeout -k 5 400 python3 -m dsv3serve.cli bench model --attention-backend flashinfer \
    --moe-backend triton --profile-graphs --out "$OUT/bench_model.json" > "$OUT/bench_model.log" 2>&1
  echo "model rc=$?"; grep -v "^{" "$OUT/bench_model.log" | tail -100
}
stage_onebatch() {
  for mode in overlap no-overlap; do
    flag=""; [ "$mode" = no-overlap ] && flag="--disable-overlap-schedule"
    timeout -k 5 100 python3 -m dsv3serve.cli bench one-batch --device cuda --attention-backend flashinfer \
      --moe-backend triton --model deepseek-v3 --load-format dummy --hf-overrides '{"num_hidden_layers": 4}' \
      --batch-size 1 8 32 64 --input-len 512 --output-len 64 $flag --json "$OUT/one_batch_$mode.json" \
      > "$OUT/one_batch_$mode.log" 2>&1; echo "one-batch $mode rc=$?"; grep -v "^{" "$OUT/one_batch_$mode.log" | tail -8
  done
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; } > "$OUT/env.txt"
for s in "$@"; do "stage_$s"; done

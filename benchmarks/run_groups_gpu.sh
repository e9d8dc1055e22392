#!/usr/bin/env bash
# One device run after the engine restructure and the sharded groups (2026-11-25):
#   stage tests : every GPU-marked test (the restructured engine, backends' capabilities,
#                 graphs, kernels), light files in parallel, heavy ones one at a time
#   stage ep    : the EP rank-share benchmark (benchmarks/run_ep_rank.sh)
# Needs the wheels in .whl/ (pydantic stack, flashinfer-python 0.6.18.post1, apache-tvm-ffi,
# hypothesis, pytest-xdist) and .whl/site (tokenizer data). Logs and JSON go to $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.whl/site:. PYTHONUNBUFFERED=1
PYT="python3 -m pytest -q -p no:cacheprovider -rfE -m gpu"
HEAVY="full_width|moe_kernels_gpu|overlap_gpu|engine_vs_cpu"
stage_tests() {
  files=$(grep -rl "mark.gpu" tests --include='test_*.py')
  light=$(echo "$files" | grep -v -E "$HEAVY"); heavy=$(echo "$files" | grep -E "$HEAVY")
  timeout -k 5 300 $PYT -n 4 $light > "$OUT/gpu_tests_light.log" 2>&1; echo "light rc=$?"
  tail -15 "$OUT/gpu_tests_light.log"
  timeout -k 5 240 $PYT $heavy > "$OUT/gpu_tests_heavy.log" 2>&1; echo "heavy rc=$?"
  tail -15 "$OUT/gpu_tests_heavy.log"
}
stage_ep() { bash benchmarks/run_ep_rank.sh "$@"; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; } \
  > "$OUT/env.txt"
cat "$OUT/env.txt"
for s in "$@"; do "stage_$s"; done

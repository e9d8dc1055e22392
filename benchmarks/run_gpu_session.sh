#!/usr/bin/env bash
# One device run (H100/H200) for the Hopper kernels and the bench model: GPU tests, then
# `bench kernels --only moe,gate,mla`, then `bench model` with the fast backends.
# Needs the wheels in .whl/ (pydantic stack, flashinfer-python 0.6.18.post1, apache-tvm-ffi).
# Each stage has its own time limit; results and logs go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.whl/site:.
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, flashinfer; print(torch.__version__, triton.__version__, flashinfer.__version__)"
  date -u; } > "$OUT/env.txt" 2>&1
T_TESTS=${T_TESTS:-170} T_KERNELS=${T_KERNELS:-130} T_MODEL=${T_MODEL:-230}
timeout -k 5 "$T_TESTS" python3 -m pytest -q -p no:cacheprovider -n 6 -rfE \
  --junitxml="$OUT/gpu_tests.xml" tests/moe/test_moe_kernels_gpu.py \
  tests/attention/test_attention_flashinfer_gpu.py tests/moe/test_moe_kernels_sm90.py > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/env.txt"
timeout -k 5 "$T_KERNELS" python3 -m dsv3serve.cli bench kernels --only moe,gate,mla \
  --json "$OUT/bench_kernels.json" > "$OUT/bench_kernels.log" 2>&1
echo "kernels rc=$?" >> "$OUT/env.txt"
timeout -k 5 "$T_MODEL" python3 -m dsv3serve.cli bench model --attention-backend flashinfer \
  --moe-backend triton --out "$OUT/bench_model.json" > "$OUT/bench_model.log" 2>&1
echo "model rc=$?" >> "$OUT/env.txt"
tail -5 "$OUT/gpu_tests.log"; tail -30 "$OUT/bench_kernels.log"; tail -40 "$OUT/bench_model.log"
cat "$OUT/env.txt"

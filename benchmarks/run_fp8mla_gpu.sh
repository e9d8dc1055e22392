#!/usr/bin/env bash
# FP8 MLA decode (issue 20 item 3) on one H100/H200: the kernel's GPU tests (every bench config
# against the float32 oracle, errors printed), the older kernel's GPU tests (fp8_kernel pinned),
# then bench kernels --only mla: flashinfer bf16, Triton bf16-dot on bf16/fp8 pools, and the FP8
# kernel's configs side by side, with the same run's copy ceiling. Logs and JSON land in $OUT.
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:.whl/site:. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -k 5 240 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/kernels/test_mla_decode_fp8_gpu.py > $OUT/fp8mla_test.log 2>&1; echo "fp8mla tests rc=$?"; grep -o "relative error [0-9.]*.*" $OUT/fp8mla_test.log | sort -k3 -g | tail -3; tail -3 $OUT/fp8mla_test.log
timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_mla_decode_gpu.py > $OUT/mla_old_test.log 2>&1; echo "old mla tests rc=$?"; tail -3 $OUT/mla_old_test.log
timeout -k 5 300 python3 -m dsv3serve.cli bench kernels --only mla --mla-batch 1 32 64 128 --mla-context 1024 4096 --mla-index page --json $OUT/mla_fp8mma.json > $OUT/mla_bench.log 2>&1; echo "bench rc=$?"; grep -v "^{" $OUT/mla_bench.log | tail -60

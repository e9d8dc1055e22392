#!/usr/bin/env bash
# Check run on an H200: speculative graphs (with extend), the GPU-vs-CPU greedy test and the
# full-width FP8 test (serially, each prints its numbers), then a Triton MLA decode tile sweep.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.whl/site:. PYTHONUNBUFFERED=1
timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/engine/speculative/test_spec_graphs_gpu.py > $OUT/spec.log 2>&1; echo "spec rc=$?"; grep -E "replays|identical|passed|failed" $OUT/spec.log | tail -5
timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/model/test_full_width_fp8_gpu.py > $OUT/fullwidth.log 2>&1; echo "fullwidth rc=$?"; grep -E "rel_err|top1|row_std|gap|calls|passed|failed" $OUT/fullwidth.log | tail -12
timeout -k 5 200 python3 -m pytest -q -p no:cacheprovider -rfE -s tests/engine/test_gpu_engine_vs_cpu.py > $OUT/margin.log 2>&1; echo "margin rc=$?"; grep -E "margin|passed|failed|Error" $OUT/margin.log | tail -6
timeout -k 5 150 python3 -m dsv3serve.cli bench kernels --only mla --mla-kernels triton-bf16 triton-fp8 --mla-batch 32 128 --mla-context 4096 --mla-triton-block-h 32 64 --mla-triton-block-n 32 64 --mla-triton-warps 4 8 --json $OUT/mla_sweep.json > $OUT/mla_sweep.log 2>&1; echo "sweep rc=$?"; grep -v "^{" $OUT/mla_sweep.log | tail -40

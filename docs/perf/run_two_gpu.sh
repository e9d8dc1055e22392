#!/usr/bin/env bash
# Issue 16's run on two GPUs of one host (the device tool's nvidia-h100-x2), one call:
#   stage pd       : the KV connectors cuda:0 -> cuda:1 (tests/transfer/test_kv_transfer_gpu.py)
#   stage groups   : docs/perf/two_gpu_groups.py: tp2, tp2+ep2, dp2+ep2 (+ DP lm head),
#                    DeepEP auto / low_latency / normal, greedy tokens vs one GPU, graphs and
#                    overlap on
#   stage dispatch : docs/perf/bench_dispatch.py: all-to-all vs DeepEP normal vs low-latency,
#                    bf16 and fp8, 1..4096 tokens per rank, vs an NVLink p2p copy
# Needs a wheels dir ($WHEELS, default .twogpu/): the pydantic stack and site/ (the tokenizer
# package) always; flashinfer-python + apache-tvm-ffi for the graphed (flashinfer) layouts;
# deep_ep 1.2.1 (docs/deepep/build.sh) + nvidia-nvshmem-cu13 3.4.5 (its runtime libraries
# only) for DeepEP. Both sets together exceed the device tool's 64 MiB carry, so the run was
# two calls, one per wheels dir (docs/perf/two_gpu.md). Results go to $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s)
W=${WHEELS:-.twogpu}  # wheels dir: pydantic stack and site/ always; flashinfer and/or DeepEP
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $(ls $W/*.whl | grep -v -E "nvshmem|deep_ep") || exit 1
if ls $W/deep_ep*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps $W/nvidia_nvshmem*.whl $W/deep_ep*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$W/site:. PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
  nvidia-smi topo -m; date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
elapsed() { echo "$(($(date +%s) - START)) s"; }
stage_pd() {
  timeout -k 5 90 python3 -m pytest -q -p no:cacheprovider -m gpu -rfE \
    tests/transfer/test_kv_transfer_gpu.py > "$OUT/pd.log" 2>&1
  echo "pd rc=$? ($(elapsed))"; tail -3 "$OUT/pd.log"
}
stage_groups() {
  timeout -k 5 "${GROUPS_S:-300}" python3 docs/perf/two_gpu_groups.py "$OUT" \
    --budget-s "$(( ${GROUPS_S:-300} - 60 ))" ${GROUPS_LAYOUTS:+--layouts $GROUPS_LAYOUTS} \
    > "$OUT/groups.log" 2>&1
  echo "groups rc=$? ($(elapsed))"; grep -v -i warn "$OUT/groups.log" | tail -12
}
stage_dispatch() {
  timeout -k 5 "${DISPATCH_S:-150}" python3 docs/perf/bench_dispatch.py ${DISPATCH_ARGS:-} \
    --out "$OUT/dispatch_2xh100.json" > "$OUT/dispatch.log" 2>&1
  echo "dispatch rc=$? ($(elapsed))"; tail -25 "$OUT/dispatch.log"
}
for s in "${@:-pd groups dispatch}"; do for t in $s; do "stage_$t"; done; done

#!/usr/bin/env bash
# The one device command for issue 14's one-GPU benchmark of one EP rank's share of the full
# 61-layer model (benchmarks/bench_ep_rank.py; timing only: same-rank loopback dispatch/combine):
#   bash benchmarks/run_ep_rank.sh            # layout from the GPU: ep8 on an H200, ep16 on an H100
#   LAYOUT=ep16 bash benchmarks/run_ep_rank.sh
# Needs the wheels in .whl/ (see run_h200.sh). Log and JSON go to $OUT (ep_rank_<gpu>.json);
# copy the JSON to docs/perf/ to commit it.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.whl/site:. PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u; } > "$OUT/env.txt"
cat "$OUT/env.txt"
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ -z "${LAYOUT:-}" ]; then
  if [ "${mem_mib:-0}" -ge 120000 ]; then LAYOUT=ep8; else LAYOUT=ep16; fi
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | grep -o -E 'h200|h100' | head -1)
json="$OUT/ep_rank_${gpu:-gpu}.json"
echo "layout $LAYOUT (GPU memory ${mem_mib} MiB) -> $json"
timeout -k 10 "${T_BENCH:-540}" python3 benchmarks/bench_ep_rank.py --layout "$LAYOUT" \
  ${BENCH_ARGS:-} --out "$json" > "$OUT/ep_rank.log" 2>&1
echo "bench rc=$?"
grep -v '^{' "$OUT/ep_rank.log" | tail -40

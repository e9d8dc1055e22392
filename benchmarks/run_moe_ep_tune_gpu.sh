#!/usr/bin/env bash
# Issue 35 item 3 on one H200: tune the fused MoE's launch configs for an expert-parallel
# rank's stack (E / N local experts, the other ranks' choices arriving as -1), for EP 2, 8
# and 4 (E = 128, 32, 64), and time the default rule's config beside each tuned one. Carry
# [".deepep"] (the engine's packages). Results: $OUT/moe_ep_tune.tar.gz (the tables and the
# logs), $OUT/summary.txt.
#   EP_SIZES="2 8 4" TUNE_BUDGET_S=140 bash benchmarks/run_moe_ep_tune_gpu.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s)
mkdir -p /tmp/site && tar -xJf .deepep/gpu-site-engine.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
RES=/tmp/moe_ep_tune; mkdir -p "$RES/configs"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
  date -u; } > "$RES/env.txt" 2>&1
cat "$RES/env.txt"
cat > "$RES/summary.py" <<'PY'
import json, sys
for line in sys.stdin:
    if not line.startswith("{"):
        print(line.strip())
        continue
    r = json.loads(line)
    if "best_us" in r:
        print("  T=%5d tuned %8.1f us  default %8.1f us  x%.2f"
              % (r["T"], r["best_us"], r["default_us"], r["default_over_best"]))
    else:
        print("  T=%5d budget spent: the default written" % r["T"])
PY
for ep in ${EP_SIZES:-2 8 4}; do
  timeout -k 5 "${TABLE_S:-240}" python3 -m dsv3serve.bench.kernels.moe_tune --ep-size "$ep" \
    --quick --tokens ${TOKENS:-128 512 2048 8192 64 256 1024 4096} \
    --budget-s "${TUNE_BUDGET_S:-140}" --out "$RES/configs" > "$RES/ep$ep.log" 2>&1
  echo "ep $ep rc=$? ($(($(date +%s) - START)) s)"
  grep '"best_us"\|budget_spent\|wrote' "$RES/ep$ep.log" | python3 "$RES/summary.py" | tee -a "$OUT/summary.txt"
done
tar -czf "$OUT/moe_ep_tune.tar.gz" -C "$RES" .
ls -la "$OUT"; echo "total $(($(date +%s) - START)) s"

#!/usr/bin/env bash
# Issue 27's GPU serving run on one host of two H200s (the device tool's nvidia-h200-x2):
# `dsv3serve serve --config deploy/h200x2-pd.yaml` as a user starts it (cold, then warm),
# greedy text over HTTP against the offline engine on the decode GPU, `bench serve` at
# ISL 1024 / OSL 256 for concurrency 1..256, a decode kill under load, and the engine's own
# one-batch decode rates; benchmarks/serve_gpu.py does the stages.
#   bash benchmarks/run_serve_gpu.sh "cold,greedy,bench,stop" [engine]
# $1: the app stages (serve_gpu.py --stages); $2: "engine" to run the offline stage after
# them on GPU 1 (the decode replica's GPU when Ray hands out GPUs 0, 1 in order; the record
# notes which GPU each replica had). Needs .whl/gpu-site.tar.xz (benchmarks/gpu_site.sh).
# Results: $OUT/serve_gpu.json, $OUT/logs.tar.gz (app, bench and Ray logs), $OUT/env.txt.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s)
if [ ! -f /tmp/site/.unpacked ]; then
  mkdir -p /tmp/site && tar -xJf .whl/gpu-site.tar.xz -C /tmp/site && touch /tmp/site/.unpacked || exit 1
fi
echo "site ready after $(($(date +%s) - START)) s"
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m; date -u; python3 -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)'
  git log -1 --format='%H %s' 2>/dev/null; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# the run's own copy of the result, so a later call adds to it
[ -f /tmp/serve_gpu/serve_gpu.json ] || mkdir -p /tmp/serve_gpu/logs
RUN=/tmp/serve_gpu
timeout -k 10 "${APP_S:-480}" python3 benchmarks/serve_gpu.py "$RUN" --stages "${1:-cold,greedy,bench,stop}" \
  ${SERVE_GPU_ARGS:-}
echo "app stages rc=$? after $(($(date +%s) - START)) s"
if [ "${2:-}" = engine ]; then
  python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout -k 10 "${ENGINE_S:-240}" python3 benchmarks/serve_gpu.py "$RUN" \
    --stages engine ${SERVE_GPU_ARGS:-}
  echo "engine stage rc=$? after $(($(date +%s) - START)) s"
fi
python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
cp "$RUN/serve_gpu.json" "$OUT/" 2>/dev/null
mkdir -p "$RUN/logs/ray" && cp -r /tmp/ray/session_latest/logs/*.err /tmp/ray/session_latest/logs/*.out \
  "$RUN/logs/ray/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$RUN" logs
rm -rf "$RUN/logs/ray"
ls -la "$OUT"

#!/usr/bin/env bash
# The CPU serving benchmarks of issues 29 (admission, 600 streams against two routers) and
# 33 (SLO autoscaling ramp) on the device machine's 16-core host, tiny model on CPU, no GPU
# use: on the 2-core dev VM the client, Serve's proxy, both routers and the engines share
# two cores, which is what their records say limits them. Carry [".whl"] (gpu-site.tar.xz:
# Ray, the HTTP stack, openai; benchmarks/gpu_site.sh).
#   bash benchmarks/run_cpu_benches_gpu_host.sh [admission] [autoscale]
# Results: $OUT/cpu_benches.tar.gz (each bench's JSON and log), $OUT/env.txt.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s)
mkdir -p /tmp/site && tar -xJf .whl/gpu-site.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
export CUDA_VISIBLE_DEVICES=""  # CPU only
RES=/tmp/cpu_benches; mkdir -p "$RES"
{ nproc; free -g | head -2; python3 -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)'
  date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"; echo "site ready after $(($(date +%s) - START)) s"
stage_admission() {
  for q in ${QUEUES:-16 1024}; do
    mkdir -p "$RES/admission_q$q"
    timeout -k 10 "${ADMISSION_S:-150}" python3 benchmarks/run_admission_cpu.py "$RES/admission_q$q" "$q" \
      > "$RES/admission_q$q/log.txt" 2>&1
    echo "admission q$q rc=$? ($(($(date +%s) - START)) s)"
    python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
    grep -A40 '"rejections"' "$RES/admission_q$q/admission_two_routers_cpu.json" 2>/dev/null | head -40
  done
}
stage_autoscale() {
  mkdir -p "$RES/autoscale"
  timeout -k 10 "${AUTOSCALE_S:-330}" python3 benchmarks/run_autoscale_cpu.py "$RES/autoscale" \
    ${AUTOSCALE_ARGS:---num-cpus 16} > "$RES/autoscale/log.txt" 2>&1
  echo "autoscale rc=$? ($(($(date +%s) - START)) s)"
  python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
  tail -12 "$RES/autoscale/log.txt"
}
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(admission autoscale)
for s in "${stages[@]}"; do "stage_$s"; done
tar -czf "$OUT/cpu_benches.tar.gz" -C "$RES" .
ls -la "$OUT"; echo "total $(($(date +%s) - START)) s"

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
# admission: one run per proxy queue in QUEUES and client-process count in CLIENTS (the
# burst split over that many processes; 1: one process, as the earlier records), each
# within ADMISSION_S seconds; ADMISSION_ARGS go to every run (e.g. "--streams 300").
# Each run's directory admission_q<Q>_c<C> holds admission_two_routers_cpu.json (the
# summary and the time-to-429 decomposition), admission_requests.json (every request's
# stamps) and log.txt.
stage_admission() {
  for q in ${QUEUES:-16 1024}; do
    for c in ${CLIENTS:-1}; do
      dir="$RES/admission_q${q}_c$c"; mkdir -p "$dir"
      # shellcheck disable=SC2086  # ADMISSION_ARGS is a list of arguments
      timeout -k 10 "${ADMISSION_S:-240}" python3 benchmarks/run_admission_cpu.py "$dir" "$q" \
        --clients "$c" ${ADMISSION_ARGS:-} > "$dir/log.txt" 2>&1
      echo "admission q$q c$c rc=$? ($(($(date +%s) - START)) s)"
      python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1
      python3 benchmarks/admission_report.py "$dir/admission_two_routers_cpu.json" 2>&1 | tail -30
    done
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

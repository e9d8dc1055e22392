#!/usr/bin/env bash
# The two-H200 must-holds of issues 35, 34 (TP2 + MTP) and 32 (EPLB), on one host (kind
# nvidia-h200-x2), carry [".deepep"] (the engine's packages: ENGINE_ONLY=1 bash
# benchmarks/gpu_site.sh); one call for the default stages, a second for mtp and eplb:
#   bash benchmarks/run_group_step_gpu.sh [wire] [one] [group] [check] [mtp] [eplb]
#   (default: wire one group check)
# Stages (each under what is left of BUDGET_S, default 560 s):
#   wire  : benchmarks/control_group_check.py: two ranks' command wire (gloo control group
#           beside NCCL) carries commands and device tensors, and one command's round trip
#   one   : `dsv3serve bench group` on one GPU (tp 1): decode at 64 and 256 sequences, 1K
#           context, graphs on, and the prefill of 4K prompts: the per-GPU baseline
#   group : the same through a DP2 + DP attention + EP2 group (gather dispatcher): decode
#           at 64 and 256 per rank against the rank's roofline (copy bandwidth measured in
#           the run), prefill tok/s per GPU, 61-layer / EP8 projections
#   check : benchmarks/two_gpu_groups.py: DP2 + EP2 greedy tokens against one GPU (bf16 graphed,
#           full-width graphed, float32 eager): the vocab-parallel logits all-to-all over NCCL
#   mtp   : benchmarks/two_gpu_groups.py tp2-mtp-graphs tp2-mtp-fp32 (issue 34): a TP2 group
#           with MTP (NextN, 2 draft steps) against the one-GPU engine with the same MTP, bf16
#           with graphs (within the one-GPU spread) and float32 eager (token for token)
#   eplb  : benchmarks/bench_eplb.py on both GPUs (issue 32): a full-width FP8 MoE layer's
#           step with EPLB (32 redundant slots) vs without under a router bias that makes 8
#           experts hot, and the pause of a live rebalance
# Full width (hidden 7168, 256 experts, top-8), dummy FP8 weights, LAYERS layers (default 12:
# 3 dense + 9 MoE), flashinfer attention, Triton MoE. JSON and logs go to $OUT.
# Each decode batch and the prefill end with PROFILE (default 3) profiled steps on rank 0:
# device time by kind of op, device span and host time (bench group --profile-steps). PER_RANK (default
# "64 256"), STEPS (20) and PREFILL_PER_RANK (4) size a shorter run.
# SMOKE_CPU=1 PY=.venv/bin/python: every stage's plumbing on the CPU (tiny model, gloo, small
# sizes), no result.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); BUDGET_S=${BUDGET_S:-560}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 NCCL_DEBUG=WARN
export DSV3SERVE_CACHE=/tmp/dsv3serve_cache; mkdir -p "$DSV3SERVE_CACHE"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
LAYERS=${LAYERS:-12}
MODEL="--model deepseek-v3 --load-format dummy --device cuda --attention-backend flashinfer
  --moe-backend triton --hf-overrides {\"num_hidden_layers\":$LAYERS} --ctx 1024
  --steps ${STEPS:-20} --prefill-len 4096 --profile-steps ${PROFILE:-3}
  --per-rank ${PER_RANK:-64 256} --prefill-per-rank ${PREFILL_PER_RANK:-4}"
DEV=cuda; EPLB_SIZES=""; CHECKS="dp2-ep2-graphs full-width-dp2-ep2-graphs dp2-ep2-fp32"
if [ "${SMOKE_CPU:-0}" = 1 ]; then
  export PYTHONPATH=.
  MODEL="--model tiny --ctx 16 --steps 3 --prefill-len 32 --profile-steps 3 --per-rank 1 3
    --prefill-per-rank 1 --chunked-prefill-size 64 --max-num-batched-tokens 64"
  DEV=cpu; EPLB_SIZES="--experts 16 --groups 4 --topk-groups 2 --topk 4 --hidden 128
    --inter 128 --redundant 4 --tokens 32 --iters 3 --hot 2"
  CHECKS="dp2-ep2-graphs dp2-ep2-fp32"  # full width: a 6 GB checkpoint, too big for the CPU
else
  mkdir -p /tmp/site && tar -xJf .deepep/gpu-site-engine.tar.xz -C /tmp/site || exit 1
  export PYTHONPATH=/tmp/site:.
fi
. benchmarks/stage_budget.sh  # left, run
# shellcheck disable=SC2086  # MODEL, CHECKS and EPLB_SIZES are lists of arguments
stage_wire() {
  run wire 60 $PY benchmarks/control_group_check.py --device $DEV
  run wire_commands 60 $PY benchmarks/control_group_check.py --device $DEV --commands-only
  tail -qn1 "$OUT/wire.log" "$OUT/wire_commands.log"
}
stage_one() {
  run one "${ONE_S:-240}" $PY -m dsv3serve.cli bench group $MODEL \
    --json "$OUT/group_one_gpu.json"
  grep -v "^{" "$OUT/one.log" | tail -15
}
stage_group() {
  run group "${GROUP_S:-260}" $PY -m dsv3serve.cli bench group $MODEL --tp-size 2 \
    --dp-size 2 --enable-dp-attention --ep-size 2 --json "$OUT/group_dp2ep2.json"
  grep -v "^{" "$OUT/group.log" | tail -20
  [ -f "$OUT/group_one_gpu.json" ] && [ -f "$OUT/group_dp2ep2.json" ] &&
    $PY benchmarks/group_step_report.py "$OUT/group_one_gpu.json" \
      "$OUT/group_dp2ep2.json" | tee "$OUT/group_step_tables.md"
}
stage_check() {
  run check "${CHECK_S:-150}" $PY benchmarks/two_gpu_groups.py "$OUT/check" --device $DEV \
    --layouts $CHECKS
  tail -8 "$OUT/check.log"
}
stage_mtp() {
  run mtp "${MTP_S:-480}" $PY benchmarks/two_gpu_groups.py "$OUT/mtp" --device $DEV \
    --layouts tp2-mtp-graphs tp2-mtp-fp32 --budget-s 300
  tail -8 "$OUT/mtp.log"
}
stage_eplb() {
  run eplb "${EPLB_S:-150}" $PY benchmarks/bench_eplb.py --device $DEV --ranks 2 \
    --redundant 32 --fp8 $EPLB_SIZES --out "$OUT/eplb_2xh200.json"
  tail -12 "$OUT/eplb.log"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print(torch.__version__, triton.__version__)"
  date -u; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(wire one group check)
for s in "${stages[@]}"; do "stage_$s"; done
ls -la "$OUT"; echo "total $(($(date +%s) - START)) s"

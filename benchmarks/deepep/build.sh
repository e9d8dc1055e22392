#!/usr/bin/env bash
# Build a DeepEP wheel for dsv3serve's `moe_a2a_backend: deepep` (no official wheel exists).
#
# Run on 2026-11-25 on one H100 (torch 2.11.0+cu130, nvcc 13.0): the wheel builds in about
# 80 s and imports (docs/deepep.md). DeepEP v1.2.1's setup.py finds NVSHMEM through the
# `nvidia.nvshmem` package of the nvidia-nvshmem-cu13 wheel (or NVSHMEM_DIR). DeepEP's code
# is never copied into this repository.
#
# Two steps, because the GPU machine cannot reach the network:
#
#   1. where the network is reachable (a developer machine):
#        benchmarks/deepep/build.sh pack DIR [DEEPEP_GIT_DIR]
#      writes DIR/deepep-src.tar.gz (the v1.2.1 tag, from DEEPEP_GIT_DIR: a clone or the bare
#      snapshot the session's `fetch github:deepseek-ai/DeepEP` tool leaves under
#      /work/.mirror/deepseek-ai+DeepEP/repo; default: clone upstream) and the NVSHMEM wheel
#      (pip download, for the GPU machine's Python version, PY_VER, default 3.11).
#      Carry DIR to the GPU machine (an ignored path named in `carry`, or shared/).
#   2. on the GPU machine:
#        benchmarks/deepep/build.sh build DIR OUT
#      installs the NVSHMEM wheel from DIR (no index; without one there, it uses the NVSHMEM
#      the GPU image already has, as torch's dependency), builds DeepEP against the installed
#      torch and CUDA (TORCH_CUDA_ARCH_LIST, default 9.0 for H100 / H200), writes the wheel to
#      OUT, installs it and imports it. Carry OUT's wheel between device calls and install
#      it with `pip install --no-index OUT/deep_ep-*.whl DIR/nvidia_nvshmem_cu13-*.whl`.
#
# Then dsv3serve runs its self-check when a config asks for moe_a2a_backend 'deepep'
# (dsv3serve/parallel/deepep_check.py). Low-latency mode needs NVSHMEM with IBGDA or NVLink
# between the ranks; one GPU can only import the package and build a one-rank buffer.
set -euo pipefail

DEEPEP_TAG="${DEEPEP_TAG:-v1.2.1}"
NVSHMEM_PKG="${NVSHMEM_PKG:-nvidia-nvshmem-cu13==3.4.5}"
PY_VER="${PY_VER:-3.11}"

pack() {
  local dir="$1" src="${2:-}"
  mkdir -p "$dir"
  if [[ -z "$src" ]]; then
    src="$(mktemp -d)/DeepEP"
    git clone --quiet --branch "$DEEPEP_TAG" https://github.com/deepseek-ai/DeepEP.git "$src"
  fi
  git -C "$src" archive --format=tar.gz --prefix=DeepEP/ "$DEEPEP_TAG" >"$dir/deepep-src.tar.gz"
  "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version "$PY_VER" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$dir" "$NVSHMEM_PKG"
  ls -l "$dir"
}

check_torch_cuda() {
  local cuda
  cuda="$("${PYTHON:-python3}" -c 'import torch; print(torch.version.cuda or "")')"
  if [[ "${cuda%%.*}" != "13" && -z "${ALLOW_CUDA_MISMATCH:-}" ]]; then
    echo "torch is built for CUDA '${cuda}', the NVSHMEM wheel for CUDA 13: pack with" \
      "NVSHMEM_PKG=nvidia-nvshmem-cu12 for CUDA 12 (or set ALLOW_CUDA_MISMATCH=1)" >&2
    exit 1
  fi
}

build() {
  local dir="$1" out="$2" work
  check_torch_cuda
  if ls "$dir"/nvidia_nvshmem_cu13-*.whl > /dev/null 2>&1; then
    "${PYTHON:-python3}" -m pip install --no-index --no-deps "$dir"/nvidia_nvshmem_cu13-*.whl
  else  # the GPU image's own (torch's dependency); its version is printed
    "${PYTHON:-python3}" -m pip show nvidia-nvshmem-cu13 | grep -E "^(Name|Version)" || {
      echo "no NVSHMEM wheel in $dir and none installed" >&2; exit 1; }
  fi
  work="$(mktemp -d)"
  tar -xzf "$dir/deepep-src.tar.gz" -C "$work"
  mkdir -p "$out"
  (
    cd "$work/DeepEP"
    export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
    # CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which NVSHMEM's headers need
    local cccl="${CUDA_HOME:-/usr/local/cuda}/include/cccl"
    if [[ -d "$cccl" ]]; then
      export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -I$cccl"
      export CPLUS_INCLUDE_PATH="$cccl${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
    fi
    "${PYTHON:-python3}" setup.py bdist_wheel
    cp dist/*.whl "$out"/
  )
  "${PYTHON:-python3}" -m pip install --no-index --no-deps "$out"/deep_ep-*.whl
  "${PYTHON:-python3}" -c 'import deep_ep; print("deep_ep imports:", deep_ep.Buffer)'
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  build) shift; build "$@" ;;
  *) echo "usage: $0 pack DIR [DEEPEP_GIT_DIR] | build DIR OUT" >&2; exit 2 ;;
esac

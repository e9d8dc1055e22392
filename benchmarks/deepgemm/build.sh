#!/usr/bin/env bash
# Build DeepGEMM (deepseek-ai/DeepGEMM) for dsv3serve's optional FP8 GEMM backend
# (dsv3serve/kernels/deepgemm.py). There is no wheel for torch 2.11 + CUDA 13 (sgl-deep-gemm
# 0.2.5's prebuilt _C.so does not load under torch 2.11), so it is built from the upstream
# source on the GPU machine, against the image's torch. DeepGEMM's code is never copied into
# this repository; the pack lives in an ignored folder.
#
# Tag: v2.1.1.post3 (2025-10-15), the newest release tag. It has the SM90 kernels dsv3serve
# needs (fp8_gemm_nt, m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked with
# the 1x128 / 128x128 float32 scale recipe), CUDA 13 support (#174, 2025-08) and a pybind
# extension built by torch's CUDAExtension with -std=c++17, which torch 2.11's headers still
# accept (torch >= 2.12 wants C++20: the build then switches the flag). Its submodules are
# CUTLASS f3fde58 (= v4.2.1) and fmt 553ec11 (11.2.0 + 57).
#
# Two steps, because the GPU machine cannot reach the network:
#
#   1. here:
#        benchmarks/deepgemm/build.sh pack DIR DEEPGEMM_GIT_DIR [CUTLASS_SRC] [FMT_GIT_DIR]
#      DEEPGEMM_GIT_DIR: a clone, or the bare snapshot `fetch github:deepseek-ai/DeepGEMM`
#      leaves (/work/.mirror/deepseek-ai+DeepGEMM/repo). CUTLASS_SRC: a CUTLASS git dir
#      (`fetch github:NVIDIA/cutlass`) holding the commit the tag pins (used exactly), or an
#      sgl-deep-gemm wheel whose deep_gemm/include ships CUTLASS headers (0.2.5: CUTLASS 4.8.1,
#      not the pinned 4.2.1: 117 cute and ~720 cutlass headers differ, so only a fallback);
#      default: the mirror's CUTLASS. FMT_GIT_DIR: fmt's git dir (`fetch github:fmtlib/fmt`,
#      the pinned commit's include/); without one the build uses the fmt headers torch ships.
#      Writes DIR/deepgemm-src.tar.gz, DIR/cutlass-headers.tar.xz, DIR/fmt-headers.tar.gz and
#      DIR/PACKED.txt (what came from where), about 1.3 MB in all.
#   2. on the GPU machine (torch, nvcc, g++):
#        benchmarks/deepgemm/build.sh build DIR OUT [SITE]
#      builds the wheel (deep_gemm + the deep_gemm_cpp extension + the headers its JIT
#      compiles against) into OUT, unpacks it into SITE (default /tmp/deepgemm_site: put it
#      on PYTHONPATH), runs benchmarks/deepgemm/check.py (fp8_gemm_nt on DeepSeek-V3 shapes,
#      the m-grouped contiguous and masked GEMMs, each against a torch reference) and writes
#      OUT/deepgemm_build.json (seconds, versions) and OUT/deepgemm_check.json (DG_NO_CHECK=1:
#      no check).
#      Later calls (a fresh machine): `benchmarks/deepgemm/build.sh install DIR WHEEL [SITE]`
#      (cuobjdump where missing, the wheel unpacked) instead of building.
#   At run time: torch imported before deep_gemm (the extension links libtorch), SITE on
#   PYTHONPATH, and CUDA_HOME set where `which nvcc` is a wrapper outside the toolkit.
#
# The kernels JIT-compile with nvcc on first use (one kernel per shape and tile, ~5-9 s each:
# nvcc 13.0.88 compiled v2.1.1.post3's sm90 1d2d normal / m-grouped contiguous / masked kernels
# against the packed CUTLASS v4.2.1 for sm_90a on a CPU box); the cubins go to
# DG_JIT_CACHE_DIR (dsv3serve points it into its cache dir, settings.py). DeepGEMM finds each
# cubin's kernel with $CUDA_HOME/bin/cuobjdump, which a CUDA assembled from pip wheels (nvcc,
# runtime, cccl: the CPU box's /usr/local/cuda-13.0) lacks: the pack brings it
# (nvidia-cuda-cuobjdump, 0.3 MB) and the build installs it beside nvcc when missing. The host
# build needs nvrtc.h, cublasLt.h, and (through torch's ATen/cuda/CUDAContext.h) cusparse.h and
# cusolverDn.h, and links -lcuda -lnvrtc: looked up in $CUDA_HOME, else in torch's nvidia/*/
# wheels (nvidia/cu13/include, .../lib) and the driver's libcuda.so.1 (unversioned links made
# in a temporary dir). csrc/python_api.cpp passed `g++ -fsyntax-only` on the CPU box against
# torch 2.13's headers (C++17 and C++20), CUDA 13.0's, the pip 13.0 wheels' nvrtc / cublas /
# cusparse / cusolver headers and the packed CUTLASS and fmt; not built or linked there.
set -euo pipefail

DEEPGEMM_REF="${DEEPGEMM_REF:-v2.1.1.post3}"
CUOBJDUMP_PKG="${CUOBJDUMP_PKG:-nvidia-cuda-cuobjdump==13.2.51}"  # the oldest 13.x wheel
PYTHON="${PYTHON:-python3}"
HERE="$(cd "$(dirname "$0")" && pwd)"

cutlass_from_git() {  # cutlass_from_git GIT_DIR COMMIT TARBALL
  local git="$1" commit="$2" tarball="$3" tmp want got
  git --git-dir="$git" cat-file -e "$commit^{commit}" || {
    echo "CUTLASS $commit (pinned by DeepGEMM $DEEPGEMM_REF) is not in $git" >&2; exit 1; }
  tmp="$(mktemp -d)"
  # a partial snapshot may lack blobs outside include/; git archive then warns, harmlessly
  git --git-dir="$git" archive --format=tar "$commit" include/cute include/cutlass LICENSE.txt \
    2>/dev/null | tar -x -C "$tmp"
  want="$(git --git-dir="$git" ls-tree -r --name-only "$commit" -- include/cute include/cutlass | wc -l)"
  got="$(find "$tmp/include" -type f | wc -l)"
  [[ "$want" == "$got" ]] || { echo "CUTLASS headers: $got of $want files extracted" >&2; exit 1; }
  tar -C "$tmp" -cf - include LICENSE.txt | xz -T0 -9 >"$tarball"
  rm -rf "$tmp"
  echo "cutlass: $commit from $git (exact pin)"
}

cutlass_from_wheel() {  # cutlass_from_wheel WHEEL COMMIT TARBALL
  local wheel="$1" commit="$2" tarball="$3" tmp version
  tmp="$(mktemp -d)"
  "$PYTHON" - "$wheel" "$tmp" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    for name in zf.namelist():
        for lib in ("cute", "cutlass"):
            prefix = f"deep_gemm/include/{lib}/"
            if name.startswith(prefix) and not name.endswith("/"):
                zf.extract(name, out)
PY
  mkdir -p "$tmp/include"
  mv "$tmp/deep_gemm/include/cute" "$tmp/deep_gemm/include/cutlass" "$tmp/include/"
  version="$(grep -E '#define CUTLASS_(MAJOR|MINOR|PATCH) ' "$tmp/include/cutlass/version.h" |
    awk '{print $3}' | paste -sd.)"
  tar -C "$tmp" -cf - include | xz -T0 -9 >"$tarball"
  rm -rf "$tmp"
  echo "cutlass: headers of CUTLASS $version from $(basename "$wheel")" \
    "(NOT the pinned $commit = v4.2.1: kernels may fail to JIT-compile)"
  echo "warning: CUTLASS $version from a wheel stands in for the pinned v4.2.1" >&2
}

pack() {
  local dir="$1" dg="$2" cutlass="${3:-/work/.mirror/NVIDIA+cutlass/repo}" fmt="${4:-}"
  local commit cl_pin fmt_pin
  mkdir -p "$dir"
  commit="$(git --git-dir="$dg" rev-parse "$DEEPGEMM_REF^{commit}")"
  cl_pin="$(git --git-dir="$dg" rev-parse "$DEEPGEMM_REF:third-party/cutlass")"
  fmt_pin="$(git --git-dir="$dg" rev-parse "$DEEPGEMM_REF:third-party/fmt")"
  git --git-dir="$dg" archive --format=tar.gz --prefix=DeepGEMM/ "$DEEPGEMM_REF" \
    >"$dir/deepgemm-src.tar.gz"
  rm -f "$dir/fmt-headers.tar.gz"
  {
    echo "deepgemm: $DEEPGEMM_REF = $commit from $dg"
    if [[ "$cutlass" == *.whl ]]; then
      cutlass_from_wheel "$cutlass" "$cl_pin" "$dir/cutlass-headers.tar.xz"
    else
      cutlass_from_git "$cutlass" "$cl_pin" "$dir/cutlass-headers.tar.xz"
    fi
    if [[ -n "$fmt" ]]; then
      git --git-dir="$fmt" archive --format=tar.gz "$fmt_pin" include >"$dir/fmt-headers.tar.gz"
      echo "fmt: $fmt_pin from $fmt (exact pin)"
    else
      echo "fmt: none packed; the build uses the fmt headers torch ships (pinned: $fmt_pin)"
    fi
    rm -f "$dir"/nvidia_cuda_cuobjdump-*.whl
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d "$dir" "$CUOBJDUMP_PKG"
    echo "cuobjdump: $CUOBJDUMP_PKG"
    echo "packed: $(date -u +%FT%TZ)"
  } | tee "$dir/PACKED.txt"
  ls -l "$dir"
  du -sh "$dir"
}

cxx_std_for_torch() {  # torch >= 2.12 refuses C++17 in its headers
  "$PYTHON" -c 'import torch; v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]); print(20 if v >= (2, 12) else 17)'
}

unpack_source() {  # unpack_source DIR WORK -> prints the source dir
  local dir="$1" work="$2" src
  tar -xzf "$dir/deepgemm-src.tar.gz" -C "$work"
  src="$work/DeepGEMM"
  mkdir -p "$src/third-party/cutlass" "$src/third-party/fmt"
  tar -xJf "$dir/cutlass-headers.tar.xz" -C "$src/third-party/cutlass"
  if [[ -f "$dir/fmt-headers.tar.gz" ]]; then
    tar -xzf "$dir/fmt-headers.tar.gz" -C "$src/third-party/fmt"
  fi  # else torch's include dir (on every extension's include path) provides fmt/
  if ! "$PYTHON" -c 'import wheel.bdist_wheel' 2>/dev/null; then  # wheel >= 0.46 without it
    sed -i 's/from wheel.bdist_wheel import/from setuptools.command.bdist_wheel import/' \
      "$src/setup.py"
  fi
  local std
  std="$(cxx_std_for_torch)"
  if [[ "$std" != 17 ]]; then
    sed -i "s/'-std=c++17'/'-std=c++$std'/" "$src/setup.py"
  fi
  echo "$src"
}

record_build() {  # record_build OUT SECONDS WHEEL
  "$PYTHON" - "$@" "$DEEPGEMM_REF" <<'PY'
import json, subprocess, sys, torch
out, seconds, wheel, ref = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
def version_line(cmd, needle):
    try:
        lines = subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return next((s for s in lines if needle in s), lines[0] if lines else "")
info = {
    "ref": ref, "build_seconds": round(seconds, 1), "wheel": wheel,
    "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "nvcc": version_line(["nvcc", "--version"], "release"),
    "gxx": version_line(["g++", "--version"], "g++"),
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
}
with open(f"{out}/deepgemm_build.json", "w") as f:
    json.dump(info, f, indent=1)
print(json.dumps(info))
PY
}

find_cuda_home() {  # the toolkit with bin/nvcc and include/cuda.h (a wrapper nvcc on PATH
  # would make torch guess its parent's parent, e.g. /usr/local)
  local c
  for c in "${CUDA_HOME:-}" /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$(type -P nvcc)")")")"; do
    if [[ -n "$c" && -x "$c/bin/nvcc" && -f "$c/include/cuda.h" ]]; then echo "$c"; return; fi
  done
  echo "no CUDA toolkit with bin/nvcc and include/cuda.h (set CUDA_HOME)" >&2; exit 1
}

in_site() {  # in_site GLOB: the first match under a sys.path entry (torch's nvidia wheels)
  "$PYTHON" - "$1" <<'PY'
import glob, os, sys
for base in sys.path:
    hits = sorted(glob.glob(os.path.join(base or ".", sys.argv[1])))
    if hits:
        print(hits[0])
        break
PY
}

cuda_env() {  # cuda_env DIR WORK: headers, link names and cuobjdump for the build and the JIT
  local dir="$1" work="$2" h found lib
  CUDA_HOME="$(find_cuda_home)"; export CUDA_HOME
  echo "CUDA_HOME=$CUDA_HOME"
  for h in nvrtc.h cublasLt.h cusparse.h cusolverDn.h; do  # the last two: torch's CUDAContext.h
    if [[ ! -f "$CUDA_HOME/include/$h" ]]; then
      found="$(in_site "nvidia/*/include/$h")"
      [[ -n "$found" ]] || { echo "no $h in $CUDA_HOME/include nor torch's nvidia wheels" >&2; exit 1; }
      case ":${CPATH:-}:" in *":$(dirname "$found"):"*) ;;
        *) export CPATH="$(dirname "$found")${CPATH:+:$CPATH}" ;; esac
      echo "$h: $found"
    fi
  done
  mkdir -p "$work/lib"
  for lib in cuda nvrtc; do
    if [[ ! -e "$CUDA_HOME/lib64/lib$lib.so" && ! -e "$CUDA_HOME/lib64/stubs/lib$lib.so" ]]; then
      if [[ "$lib" == cuda ]]; then
        found="$(ldconfig -p | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')"
      else
        found="$(in_site "nvidia/*/lib/libnvrtc.so.*[0-9]")"
        [[ -n "$found" ]] || found="$(ldconfig -p | awk '/libnvrtc\.so\.[0-9]+ .*x86-64/ {print $NF; exit}')"
      fi
      [[ -n "$found" ]] || { echo "no lib$lib.so to link" >&2; exit 1; }
      ln -sf "$found" "$work/lib/lib$lib.so"
      echo "lib$lib.so -> $found"
    fi
  done
  export LIBRARY_PATH="$work/lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  install_cuobjdump "$dir" "$work"
}

install_cuobjdump() {  # beside nvcc (and beside the nvcc on PATH, where DeepGEMM may look)
  local dir="$1" work="$2" bin target
  if [[ -x "$CUDA_HOME/bin/cuobjdump" ]]; then bin="$CUDA_HOME/bin/cuobjdump"; else
    ls "$dir"/nvidia_cuda_cuobjdump-*.whl >/dev/null 2>&1 ||
      { echo "no cuobjdump in $CUDA_HOME/bin and none packed" >&2; exit 1; }
    "$PYTHON" -m zipfile -e "$dir"/nvidia_cuda_cuobjdump-*.whl "$work/cuobjdump"
    bin="$(find "$work/cuobjdump" -name cuobjdump -type f | head -1)"
    chmod +x "$bin"
  fi
  local on_path
  on_path="$(type -P nvcc || true)"
  for target in "$CUDA_HOME/bin" ${on_path:+"$(dirname "$on_path")"}; do
    if [[ ! -x "$target/cuobjdump" ]]; then
      cp "$bin" "$target/cuobjdump" && echo "installed cuobjdump into $target"
    fi
  done
}

build() {
  local dir="$1" out="$2" site="${3:-/tmp/deepgemm_site}" work src t0 wheel
  t0="$(date +%s)"
  work="$(mktemp -d)"
  mkdir -p "$out" "$site"
  cat "$dir/PACKED.txt" 2>/dev/null || true
  cuda_env "$dir" "$work"
  src="$(unpack_source "$dir" "$work")"
  (
    cd "$src"
    export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
    # no download of a prebuilt wheel, version without a git checkout: 2.1.1
    DG_FORCE_BUILD=1 DG_USE_LOCAL_VERSION=0 "$PYTHON" setup.py bdist_wheel
  )
  wheel="$(ls "$src"/dist/deep_gemm-*.whl)"
  cp "$wheel" "$out/"
  wheel="$out/$(basename "$wheel")"
  "$PYTHON" -m zipfile -e "$wheel" "$site"
  record_build "$out" "$(($(date +%s) - t0))" "$(basename "$wheel")"
  rm -rf "$work"
  echo "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) into $site"
  if [[ -z "${DG_NO_CHECK:-}" ]]; then  # the device script runs it beside other work
    PYTHONPATH="$site:$HERE/../..${PYTHONPATH:+:$PYTHONPATH}" \
      "$PYTHON" "$HERE/check.py" "$out/deepgemm_check.json"
  fi
}

install_wheel() {  # a wheel built earlier, on a fresh machine: cuobjdump where missing, then unpack
  local dir="$1" wheel="$2" site="${3:-/tmp/deepgemm_site}" work
  work="$(mktemp -d)"
  CUDA_HOME="$(find_cuda_home)"; export CUDA_HOME
  install_cuobjdump "$dir" "$work"
  mkdir -p "$site"
  "$PYTHON" -m zipfile -e "$wheel" "$site"
  rm -rf "$work"
  echo "unpacked $(basename "$wheel") into $site (CUDA_HOME=$CUDA_HOME)"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  build) shift; build "$@" ;;
  install) shift; install_wheel "$@" ;;
  *) echo "usage: $0 pack DIR DEEPGEMM_GIT_DIR [CUTLASS_SRC] [FMT_GIT_DIR]" \
       "| build DIR OUT [SITE] | install DIR WHEEL [SITE]" >&2; exit 2 ;;
esac

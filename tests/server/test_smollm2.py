"""The one real-model server test of the default run: ``kvpilot serve`` on the bundled SmolLM2-135M answers a
chat question through the official client, the same text streamed and not, and tokenizes chat exactly as
the shared prompt renderer does."""

from __future__ import annotations

import pytest

from kvpilot.engine.prompt_render import chat_prompt_ids
from kvpilot.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_server_answers_a_chat_question(start_process, smollm2_dir):
    server = start_process(
        [
            "--model",
            "smollm2-135m",
            "--served-model-name",
            "smollm2",
            "--warmup-buckets",
            "1x16",
            "--max-model-len",
            "2048",
            # float32 activations: HF's tokens (int8 activations, the default on AVX2 / AVX-512 VNNI CPUs,
            # answer otherwise, as llama.cpp does on this file; tests/engine/test_real_model_equivalence.py)
            "--activation-quantization",
            "none",
        ]
    )
    client = server.client()
    out = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0.0)
    assert out.choices[0].message.content == "The capital of France is Paris."
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == len(chat_prompt_ids(Tokenizer.from_dir(smollm2_dir), QUESTION))
    streamed = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=24, temperature=0.0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == out.choices[0].message.content

"""The two tiny quantized GGUF models the quantized-weights tests serve: every 32-weight format the kernels
run (with one F16 tensor, which has none and stays float), and llama.cpp's Q4_K_M mix of K-quants."""

from __future__ import annotations

from pathlib import Path

from gguf_files import write_llama_gguf

from kvpilot.engine.model.tiny import write_tiny_llama

_MIXED = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1"}
_MIXED |= {"ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_1"}
_Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K"}
_Q4_K_M |= {"ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}


def q4_k_m_types(layers: int) -> dict[str, str]:
    """llama.cpp's Q4_K_M mix (simplified: every layer alike) for a llama of ``layers`` layers: Q4_K, with
    Q6_K value and down projections and a Q6_K embedding (the tied head)."""
    types = {f"blk.{i}.{part}.weight": t for i in range(layers) for part, t in _Q4_K_M.items()}
    return types | {"token_embd.weight": "Q6_K"}


def write_mixed_gguf(root: Path) -> Path:
    """A tiny llama: Q4_0 q/k/v, Q4_1 output and down projections, Q8_0 gate/up and the tied embedding,
    layer 1's down projection in F16."""
    source = write_tiny_llama(root / "hf", seed=4)
    path = root / "tiny-mixed.gguf"
    types = {f"blk.{i}.{part}.weight": t for i in range(2) for part, t in _MIXED.items()}
    types |= {"token_embd.weight": "Q8_0", "blk.1.ffn_down.weight": "F16"}
    write_llama_gguf(path, source, types=types)
    return path


def write_k_quant_gguf(root: Path) -> Path:
    """A tiny llama whose every input width is a multiple of 256 (what K-quant super-blocks need), its
    projections in llama.cpp's Q4_K_M mix: Q4_K, with Q6_K value and down projections and embedding."""
    source = write_tiny_llama(root / "hf", seed=6, hidden_size=256, intermediate_size=512, head_dim=64)
    path = root / "tiny-q4_k_m.gguf"
    write_llama_gguf(path, source, types=q4_k_m_types(2))
    return path

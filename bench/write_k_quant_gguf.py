"""Write a random-weight llama GGUF in llama.cpp's Q4_K_M mix (Q4_K, with Q6_K value/down projections and
embedding) for ``bench/gpu_check.sh``'s ``quant`` step; prints its path (written once per directory).

    python bench/write_k_quant_gguf.py DIR [DEVICE]     # 1024 hidden, 8 layers; DEVICE cpu: 256, 2

The K-quant blocks come from the tests' writers (``tests/support/k_quants.py``: simple rounding, valid
blocks), so the figures are about the kernels' speed and agreement, not a real model's quality.
"""

from __future__ import annotations

import sys
from pathlib import Path

# the GGUF writers the tests use (gguf-py cannot write K-quants)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from gguf_files import write_llama_gguf
from quantized_ggufs import q4_k_m_types

from kvpilot.engine.model.tiny import write_tiny_llama


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    width, inter, layers = (256, 512, 2) if argv[1:] == ["cpu"] else (1024, 2816, 8)
    path = root / f"q4_k_m-{width}x{layers}.gguf"
    if not path.exists():
        source = write_tiny_llama(
            root / f"{path.stem}-hf",
            seed=0,
            max_position_embeddings=4096,
            hidden_size=width,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=width // 64,
            num_key_value_heads=max(1, width // 256),
            head_dim=64,
        )
        write_llama_gguf(path, source, types=q4_k_m_types(layers))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

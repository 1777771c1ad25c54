"""SentencePiece GGUF vocabularies (``tokenizer.ggml.model = llama``: Gemma, Phi-3) tokenize as HF's own
conversion of the same SentencePiece model does (docs/models.md#gguf).

The vocabulary is a small SentencePiece-style BPE model: control tokens, ``<unk>``, the 256 byte-fallback
pieces, then the pieces a BPE trainer merged (scores falling in merge order) and the single characters,
laid out as a ``tokenizer.model`` lists them. HF's reference is transformers' ``SpmConverter``
building a tokenizer from that model's proto (its pieces, scores, types and normalizer spec), with the
control tokens added as special tokens as its extractor adds them; ours is built from the GGUF metadata
llama.cpp writes for the same model. Strings cover whitespace runs, tabs and newlines, accents, characters
outside the vocabulary (byte fallback), special tokens inside text and a leading space; Gemma's files say
``add_space_prefix = false``, Llama/Phi-3's leave llama.cpp's default (true). A Gemma 2 GGUF carrying the
vocabulary then serves HF's greedy tokens for a text prompt, tokenized by the converted tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_family_files import write_family_gguf
from hf_families import build_family, hf_reference, load_hf
from tokenizers import AddedToken, Tokenizer, models, normalizers, trainers
from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.gguf_tokenizer import tokenizer_files_from_gguf
from kvpilot.engine.model.registry import resolve_model
from kvpilot.engine.tokenizer import Tokenizer as EngineTokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "  indented  code  with   runs    of     spaces",
    "\tif value:\n\t\treturn  value\n\n",
    "héllo wörld, ça va? naïve café",
    "the theory of everything is the thing",
]
CONTROL = ["<pad>", "<eos>", "<bos>"]
TURNS = ["<start_of_turn>", "<end_of_turn>"]
STRINGS = [
    "the quick brown fox",
    "  leading spaces and   runs   of      spaces",
    "tabs\tand\nnewlines\n\n  indented\t\t",
    "héllo wörld, ça va?",
    "emoji 🙂, Ω and 日本 fall back to bytes",
    "<start_of_turn>user\nthe thing<end_of_turn>\n<start_of_turn>model\n",
    " a leading space",
    "trailing space ",
    "",
]


def spm_model() -> dict:
    """Pieces, scores and types as a SentencePiece BPE ``tokenizer.model`` lists them (merged pieces by
    merge order, then the characters), and the special ids."""
    trainer = Tokenizer(models.BPE())
    trainer.normalizer = normalizers.Replace(" ", "▁")
    trainer.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=160, show_progress=False))
    merges = json.loads(trainer.to_str())["model"]["merges"]
    merged = ["".join(pair) for pair in merges]
    chars = sorted({c for line in CORPUS for c in line.replace(" ", "▁")})
    pieces = [*CONTROL, "<unk>", *TURNS, *[f"<0x{b:02X}>" for b in range(256)]]
    types = [3, 3, 3, 2, 3, 3, *[6] * 256]
    scores = [0.0] * len(pieces)
    for rank, piece in enumerate([*merged, *chars]):
        pieces.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return {"tokens": pieces, "scores": scores, "types": types, "bos": 2, "eos": 1, "unk": 3, "pad": 0}


def hf_tokenizer(model: dict, add_dummy_prefix: bool) -> Tokenizer:
    """transformers' tokenizer for the SentencePiece model ``model`` (its proto built here)."""
    proto = import_protobuf().ModelProto()
    for piece, score, kind in zip(model["tokens"], model["scores"], model["types"], strict=True):
        entry = proto.pieces.add()
        entry.piece, entry.score, entry.type = piece, score, kind
    proto.trainer_spec.model_type = 2  # BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_piece = "<unk>"
    proto.normalizer_spec.add_dummy_prefix = add_dummy_prefix
    proto.normalizer_spec.escape_whitespaces = True
    proto.normalizer_spec.remove_extra_whitespaces = False
    vocab = {piece: index for index, piece in enumerate(model["tokens"])}
    tokenizer = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    controls = [p for p, kind in zip(model["tokens"], model["types"], strict=True) if kind == 3]
    tokenizer.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in controls])
    return tokenizer


def gguf_metadata(model: dict, add_space_prefix: bool | None) -> dict:
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": model["tokens"],
        "tokenizer.ggml.scores": model["scores"],
        "tokenizer.ggml.token_type": model["types"],
        "tokenizer.ggml.bos_token_id": model["bos"],
        "tokenizer.ggml.eos_token_id": model["eos"],
        "tokenizer.ggml.unknown_token_id": model["unk"],
    }
    if add_space_prefix is not None:  # None: llama.cpp's default for SentencePiece files (true)
        metadata["tokenizer.ggml.add_space_prefix"] = add_space_prefix
    return metadata


@pytest.mark.parametrize("add_space_prefix", [False, None], ids=["gemma", "llama-phi3"])
def test_spm_gguf_tokenizes_as_hf(tmp_path: Path, add_space_prefix: bool | None) -> None:
    model = spm_model()
    hf = hf_tokenizer(model, add_dummy_prefix=add_space_prefix is None)
    files = tokenizer_files_from_gguf(gguf_metadata(model, add_space_prefix), model_max_length=64)
    files.write(tmp_path)
    ours = EngineTokenizer.from_dir(tmp_path)
    fallbacks = 0
    for text in STRINGS:
        want = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == want, text
        assert ours.encode(text) == [model["bos"], *want]  # llama.cpp's SPM default: BOS added
        assert ours.decode(want, skip_special_tokens=False) == hf.decode(want, skip_special_tokens=False)
        fallbacks += sum(6 <= i < 262 for i in want)
    assert fallbacks >= 10  # the emoji, Ω and 日本 really fell back to bytes
    merged = ours.encode("the thing", add_special_tokens=False)
    assert len(merged) < len("the thing") // 2  # merges happened, not one piece per character
    leading = ours.convert_ids_to_tokens(ours.encode(" a", add_special_tokens=False))
    assert leading[0] == ("▁" if add_space_prefix is False else "▁▁")  # llama.cpp prefixes even a space


def test_a_gemma_gguf_with_a_sentencepiece_vocabulary_serves_hf_tokens(tmp_path: Path) -> None:
    model = spm_model()
    source = build_family(
        "gemma2", tmp_path / "source", seed=3, query_pre_attn_scalar=16, vocab_size=len(model["tokens"])
    )
    gguf_path = tmp_path / "gemma2-spm.gguf"
    write_family_gguf(gguf_path, source, tokens={**model, "add_space_prefix": False})
    converted = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache", progress=False)
    text = "<start_of_turn>user\n  the quick brown fox 🙂<end_of_turn>\n"
    prompt = [model["bos"], *hf_tokenizer(model, add_dummy_prefix=False).encode(text).ids]
    assert EngineTokenizer.from_dir(converted).encode(text) == prompt
    want, _ = hf_reference(load_hf(source), prompt, 16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(gguf_path), dtype="float32", num_kv_blocks=32, block_size=8, quantization="none")
    assert llm.generate([text], params)[0].outputs[0].token_ids == want

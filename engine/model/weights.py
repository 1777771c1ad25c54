"""Copy an HF-named checkpoint into the decoder, fusing q/k/v and gate/up (docs/models.md).

Every parameter must be covered and every checkpoint tensor used. Phi-3 checkpoints store the fused
``qkv_proj`` / ``gate_up_proj`` already (in the same q, k, v and gate, up order); the other families store
them apart. The text model of a vision-language checkpoint (``arch.text_only``: Gemma 3) is read from under
``language_model.`` (either nesting transformers writes); its vision tower and projector are skipped. A
projection or embedding already replaced by a quantized layer
(``quantization.install_gguf_weights``) holds its weight: its tensors are checked present but never read
(their biases still load).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvpilot.engine.kv.checkpoint_scales import is_kv_scale
from kvpilot.engine.model.layers import MLP, RMSNorm
from kvpilot.engine.model.moe import SparseMoeBlock

if TYPE_CHECKING:
    from kvpilot.engine.model.llama import LlamaForCausalLM


class _Loader:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.loaded: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        self.loaded.add(name)
        return self.tensors[name]

    def put(self, param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value)

    def norm(self, module: RMSNorm | None, name: str) -> None:
        if module is not None:
            self.put(module.weight, self.take(name), name)

    def weight(self, module: nn.Module, names: list[str], label: str) -> None:
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            for name in names:
                self.take(name)  # present, held by the quantized layer
            return
        value = self.take(names[0]) if len(names) == 1 else torch.cat([self.take(n) for n in names])
        self.put(module.weight, value, label)

    def bias(self, module: nn.Module, names: list[str], label: str) -> None:
        """The bias of ``module``: an ``nn.Linear``'s, or a quantized layer's buffer."""
        value = self.take(names[0]) if len(names) == 1 else torch.cat([self.take(n) for n in names])
        bias = module.bias
        assert isinstance(bias, torch.Tensor), f"{label}: the layer was built without a bias"
        self.put(bias, value, label)


#: name prefixes of a vision-language checkpoint's text model (transformers 4.5x, and 5's nesting)
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."))
_TEXT_HEADS = ("language_model.lm_head.", "lm_head.")
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


class _TextModelTensors(Mapping[str, torch.Tensor]):
    """The text model's tensors of a vision-language checkpoint, under the dense model's names."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self._names: dict[str, str] = {}
        for name in tensors:
            if any(part in name for part in _VISION_PARTS):
                continue  # the vision tower: not served
            self._names[_text_name(name)] = name

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[self._names[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _text_name(name: str) -> str:
    for prefix, replacement in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix) :]
    if name.startswith(_TEXT_HEADS[0]):
        return _TEXT_HEADS[1] + name[len(_TEXT_HEADS[0]) :]
    return name


def load_hf_weights(model: LlamaForCausalLM, tensors: Mapping[str, torch.Tensor]) -> None:
    """Fill ``model`` (a ``llama.LlamaForCausalLM``) from ``tensors``; raises ``ValueError`` naming the first
    missing, misshapen or unused tensor."""
    arch = model.arch
    if arch.text_only:
        tensors = _TextModelTensors(tensors)
    w = _Loader(tensors)
    w.weight(model.embed_tokens, ["model.embed_tokens.weight"], "model.embed_tokens.weight")
    w.norm(model.norm, "model.norm.weight")
    if model.lm_head is not None:
        w.weight(model.lm_head, ["lm_head.weight"], "lm_head.weight")
    for i, layer in enumerate(model.decoder_layers):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w.norm(getattr(layer, norm), p + norm + ".weight")
        w.norm(layer.pre_feedforward_layernorm, p + "pre_feedforward_layernorm.weight")
        w.norm(layer.post_feedforward_layernorm, p + "post_feedforward_layernorm.weight")
        a, attn = p + "self_attn.", layer.self_attn
        qkv = [a + "qkv_proj.weight"] if arch.fused_checkpoint else [a + f"{n}_proj.weight" for n in "qkv"]
        w.weight(attn.qkv_proj, qkv, a + "qkv_proj.weight")
        if arch.qkv_bias:
            w.bias(attn.qkv_proj, [a + f"{n}_proj.bias" for n in "qkv"], a + "qkv_proj.bias")
        w.norm(attn.q_norm, a + "q_norm.weight")
        w.norm(attn.k_norm, a + "k_norm.weight")
        w.weight(attn.o_proj, [a + "o_proj.weight"], a + "o_proj.weight")
        if arch.o_bias:
            w.bias(attn.o_proj, [a + "o_proj.bias"], a + "o_proj.bias")
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.load_hf_weights(w.take, p)
            continue
        m, mlp = p + "mlp.", layer.mlp
        assert isinstance(mlp, MLP), "a dense layer's MLP"
        gate_up = (
            [m + "gate_up_proj.weight"]
            if arch.fused_checkpoint
            else [m + "gate_proj.weight", m + "up_proj.weight"]
        )
        w.weight(mlp.gate_up_proj, gate_up, m + "gate_up_proj.weight")
        w.weight(mlp.down_proj, [m + "down_proj.weight"], m + "down_proj.weight")
        if arch.mlp_bias:
            w.bias(mlp.gate_up_proj, [m + "gate_proj.bias", m + "up_proj.bias"], m + "gate_up_proj.bias")
            w.bias(mlp.down_proj, [m + "down_proj.bias"], m + "down_proj.bias")
    # tied checkpoints sometimes carry a duplicate lm_head; anything else unknown is a mismatch
    # KV-cache scales belong to the cache (kv/checkpoint_scales.py), not to a parameter
    skipped = {k for k in tensors if "rotary_emb" in k or is_kv_scale(k)}
    unused = sorted(set(tensors) - w.loaded - {"lm_head.weight"} - skipped)
    if unused:
        raise ValueError(f"checkpoint has tensors this architecture does not use: {unused[:5]}")

"""ctypes mirror of ``decode_step.c``: its structs (field for field, in the C order) and the two entry
points. ``kvpilot.engine.model.native_decode`` fills the structs from a model and checks each step."""

from __future__ import annotations

import ctypes

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


#: parts of a split projection (decode_step.c's MAX_PARTS)
MAX_PARTS = 3


class PartView(ctypes.Structure):
    _fields_ = [
        ("weight", _P),
        ("scales", _P),
        ("out_features", _I),
        ("format", _I),
        ("packed", _P),
        ("packed_kind", _I),
    ]


class LinearView(ctypes.Structure):
    _fields_ = [
        ("parts", PartView * MAX_PARTS),
        ("num_parts", _I),
        ("bias", _P),
        ("out_features", _I),
        ("in_features", _I),
    ]


class LayerView(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_attention_norm", _P),
        ("qkv", LinearView),
        ("o", LinearView),
        ("gate_up", LinearView),
        ("down", LinearView),
        ("cos", _P),
        ("sin", _P),
        ("rotary_dims", _I),
        ("key_cache", _P),
        ("value_cache", _P),
        ("k_rows", _P),
        ("v_rows", _P),
        ("k_scale", _F),
        ("v_scale", _F),
        ("kv_kind", _I),
        ("attn_scale", _F),
        ("softcap", _F),
        ("window", _I),
    ]


class ModelView(ctypes.Structure):
    _fields_ = [
        ("num_layers", _I),
        ("hidden", _I),
        ("num_heads", _I),
        ("num_kv_heads", _I),
        ("head_dim", _I),
        ("intermediate", _I),
        ("block_size", _I),
        ("eps", _F),
        ("final_norm", _P),
    ]


class DecodeStepKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.scratch = lib.kvp_decode_step_scratch
        self.scratch.argtypes = (ctypes.POINTER(ModelView), _I)
        self.scratch.restype = _I
        #: (dims, layers, T, residual, positions, slots, block_tables, bts, seq_lens, scratch, out, threads)
        self.step = lib.kvp_decode_step
        self.step.argtypes = (
            ctypes.POINTER(ModelView),
            ctypes.POINTER(LayerView),
            _I,
            _P,
            _P,
            _P,
            _P,
            _I,
            _P,
            _P,
            _P,
            ctypes.c_int,
        )
        self.step.restype = ctypes.c_int

"""llama.cpp's K-quant blocks (Q4_K, Q6_K) written from float weights, for tests: gguf-py reads them
(``gguf.quants.dequantize``) but cannot write them. The rounding is simple (per sub-block min/max or
absmax, no search), so the blocks are valid and close to the weights, not llama.cpp's best choice; the
tests check them with gguf's own dequantization."""

from __future__ import annotations

import numpy as np

QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def _pack_q4k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[B, 8] 6-bit scales and mins → [B, 12] bytes (the inverse of llama.cpp's get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)
    return out


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float (K a multiple of 256) → [N, K / 256 * 144] uint8 Q4_K blocks."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 8, 32)  # [B, sub-block, weight]
    lo = np.minimum(x.min(axis=-1), 0.0)
    scale = (x.max(axis=-1) - lo) / 15.0
    mins = -lo
    d = np.maximum(scale.max(axis=-1), 1e-8) / 63.0
    dmin = np.maximum(mins.max(axis=-1), 1e-8) / 63.0
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d16[:, None]), 0, 63).astype(np.uint8)
    mq = np.clip(np.round(mins / dmin16[:, None]), 0, 63).astype(np.uint8)
    step = np.maximum(d16[:, None] * sc, 1e-12)[..., None]
    q = np.clip(np.round((x + (dmin16[:, None] * mq)[..., None]) / step), 0, 15).astype(np.uint8)
    # bytes 32 p + j: sub-block 2p's weight j in the low nibble, sub-block 2p + 1's in the high one
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_f16(d16), _f16(dmin16), _pack_q4k_scales(sc, mq), qs], axis=1)
    return blocks.reshape(n, k // QK_K * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float (K a multiple of 256) → [N, K / 256 * 210] uint8 Q6_K blocks."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(-1, 16, 16)  # [B, 16-weight group, weight]
    scale = np.abs(x).max(axis=-1) / 31.0
    d = np.maximum(np.abs(scale).max(axis=-1), 1e-8) / 127.0
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / d16[:, None]), -128, 127).astype(np.int8)
    step = d16[:, None] * sc.astype(np.float32)
    step = np.where(step == 0, 1.0, step)[..., None]
    q = (np.clip(np.round(x / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [B, half, g, j]
    ql = np.concatenate(
        [(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4), (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)],
        axis=2,
    ).reshape(-1, 128)
    qh = (
        (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    ).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d16)], axis=1)
    return blocks.reshape(n, k // QK_K * 210)

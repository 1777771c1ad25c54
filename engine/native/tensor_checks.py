"""The input checks every native kernel wrapper shares: what the C side reads by row stride or as one
contiguous array, refused with a ``ValueError`` that names the tensor."""

from __future__ import annotations

import torch


def check_float_rows(x: torch.Tensor, name: str, width: int | None = None) -> None:
    """``x`` must be a 2-D float32 CPU tensor with contiguous rows (``width`` columns if given): what every
    native kernel reads by row stride ."""
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.dim() != 2
        or (x.shape[1] > 1 and x.stride(1) != 1)
    ):
        raise ValueError(
            f"{name} must be a 2-D float32 CPU tensor with contiguous rows, got "
            f"{x.dtype} {tuple(x.shape)} strides {x.stride()} on {x.device}"
        )
    if width is not None and x.shape[1] != width:
        raise ValueError(f"{name} must have {width} columns, got {x.shape[1]}")


def row_stride(x: torch.Tensor, name: str, width: int | None = None) -> int:
    """Row stride of a 2-D float32 CPU tensor whose rows are contiguous."""
    check_float_rows(x, name, width)
    return x.stride(0)


def check_contiguous(x: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if x.dtype != dtype or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor, got {x.dtype} {tuple(x.shape)}")

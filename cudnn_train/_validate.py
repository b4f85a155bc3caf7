"""Argument checks shared by every op: bad input is a ValueError naming the argument."""

from __future__ import annotations

from typing import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # float64: references and gradcheck
HALF_DTYPES = (torch.float16, torch.bfloat16)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 math for every input dtype, float64 for float64 inputs (gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | Iterable[int] | None = None,
    min_ndim: int | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with an allowed dtype and rank; return it."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} is not supported (expected {allowed})")
    if ndim is not None:
        allowed_ndim = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed_ndim:
            raise ValueError(f"{name}: expected rank {' or '.join(map(str, allowed_ndim))}, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} dims, got shape {tuple(t.shape)}")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given (non-None) tensors must live on one device; return it."""
    device = None
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name}: is on {t.device} but {first} is on {device}")
    if device is None:
        raise ValueError("no tensor given")
    return device


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")

"""Norm modules."""

from __future__ import annotations

import torch
from torch import nn

from ..fused.rms_norm_gated import ACTIVATIONS, rms_norm_gated


class RMSNormGated(nn.Module):
    """``rmsnorm(x) * weight * act(g)``; same constructor and state_dict as FLA's ``FusedRMSNormGated``."""

    def __init__(
        self,
        hidden_size: int,
        elementwise_affine: bool = True,
        eps: float = 1e-5,
        activation: str = "swish",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
        if hidden_size < 1:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size}")
        self.hidden_size = hidden_size
        self.elementwise_affine = elementwise_affine
        self.eps = eps
        self.activation = activation
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        s = f"{self.hidden_size}, eps={self.eps}, activation={self.activation}"
        if not self.elementwise_affine:
            s += ", elementwise_affine=False"
        return s

    def forward(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return rms_norm_gated(x, g, self.weight, eps=self.eps, activation=self.activation)

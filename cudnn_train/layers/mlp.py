"""SwiGLU MLP module."""

from __future__ import annotations

import torch
from torch import nn

from ..fused.swiglu_mlp import swiglu_mlp

__all__ = ["SwiGLUMLP"]


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` through the fused ``swiglu_mlp`` op.

    Parameters are three bias-free ``nn.Linear`` submodules, ``gate_proj`` ``[I, H]``,
    ``up_proj`` ``[I, H]`` and ``down_proj`` ``[H, I]``: the state_dict keys
    (``gate_proj.weight``, ``up_proj.weight``, ``down_proj.weight``) and the default
    initialization are those of FLA's ``GatedMLP`` (``hidden_act='swish'``, which keeps
    gate and up as two separate weights), so its state_dict loads unchanged.

    ``bias=True`` is rejected with a ValueError: the fused op has no bias terms (nor do FLA's
    ``GatedMLP`` or the Qwen3-Next MLP), and a silently unfused path would be a trap.
    ``recompute=True`` saves only the input for the backward and recomputes gate and up there.
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        bias: bool = False,
        recompute: bool = False,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected a positive int, got {hidden_size!r}")
        if not isinstance(ffn_hidden_size, int) or isinstance(ffn_hidden_size, bool) or ffn_hidden_size < 1:
            raise ValueError(f"ffn_hidden_size: expected a positive int, got {ffn_hidden_size!r}")
        if bias:
            raise ValueError("bias: SwiGLUMLP has no bias terms (the fused swiglu_mlp op has none); use bias=False")
        if not isinstance(recompute, bool):
            raise ValueError(f"recompute: expected a bool, got {recompute!r}")
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.recompute = recompute
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, ffn_hidden_size, **kw)
        self.up_proj = nn.Linear(hidden_size, ffn_hidden_size, **kw)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, **kw)

    @property
    def intermediate_size(self) -> int:
        """FLA's name for ``ffn_hidden_size``."""
        return self.ffn_hidden_size

    def extra_repr(self) -> str:
        s = f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}"
        return s + (", recompute=True" if self.recompute else "")

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """``x [..., hidden_size]`` -> same shape. Extra keyword arguments (FLA passes some) are ignored."""
        return swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight, recompute=self.recompute)

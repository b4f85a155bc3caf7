"""CSA compressor module (DeepSeek-V4 style compressed KV for compressed sparse attention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import compute_dtype
from ..fused.csa import COFFS, csa_comp_positions, csa_compress, csa_cu_seqlens_comp

__all__ = ["CSACompressor", "apply_interleaved_rope"]


def apply_interleaved_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate consecutive channel pairs ``(x[2i], x[2i+1])`` of ``x [N, R]`` by ``positions * theta**(-2i/R)``.

    The interleaved (complex-pair, GPT-J) convention DeepSeek uses: pair i is the complex
    number ``x[2i] + 1j*x[2i+1]``, multiplied by ``exp(1j * pos * theta**(-2i/R))``.
    Math in x's dtype (callers pass float32 or float64).
    """
    r = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, r, 2, device=x.device, dtype=x.dtype) / r)
    angle = positions.to(x.dtype)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos(), angle.sin()
    pairs = x.unflatten(-1, (r // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


class CSACompressor(nn.Module):
    """Compress each block of ``ratio`` tokens into one KV row for compressed sparse attention.

    ``kv = wkv(x)``, ``score = wgate(x)`` (both ``[T, coff*head_dim]``), then
    :func:`cudnn_train.fused.csa.csa_compress` pools each block (the window spans the
    previous block too when ``coff == 2``; see that module for the column and APE
    layout), then RMSNorm over ``head_dim`` (learned weight) and RoPE on the last
    ``rope_dim`` channels.

    RoPE convention: interleaved channel pairs (DeepSeek's complex-pair form, see
    :func:`apply_interleaved_rope`), base ``rope_theta``; the position of compressed row
    ``b`` of a sequence is ``b * ratio``, the in-sequence position of the block's first
    token (DeepSeek-V4 rotates its compressed KV with ``freqs_cis[:cutoff:ratio]``).
    Positions restart at 0 for every sequence of ``cu_seqlens``.

    Parameters and state_dict keys follow DeepSeek-V4's ``Compressor``: ``wkv.weight``,
    ``wgate.weight`` (``[coff*head_dim, hidden_size]``), ``ape`` (``[ratio,
    coff*head_dim]``, initialized to zeros: no positional preference) and ``norm.weight``
    (``[head_dim]``, ones).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        ratio: int,
        coff: int,
        rope_dim: int,
        rope_theta: float = 10000.0,
        eps: float = 1e-6,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
            raise ValueError(f"ratio: expected an int >= 1, got {ratio!r}")
        if isinstance(coff, bool) or coff not in COFFS:
            raise ValueError(f"coff: expected 1 or 2, got {coff!r}")
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 0 or rope_dim > head_dim or rope_dim % 2:
            raise ValueError(f"rope_dim: expected an even int in [0, head_dim={head_dim}], got {rope_dim!r}")
        if not rope_theta > 0:
            raise ValueError(f"rope_theta: expected a positive float, got {rope_theta!r}")
        if not eps >= 0:
            raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size, self.head_dim, self.ratio, self.coff = hidden_size, head_dim, ratio, coff
        self.rope_dim, self.rope_theta, self.eps = rope_dim, float(rope_theta), float(eps)
        self.wkv = nn.Linear(hidden_size, coff * head_dim, bias=False, **factory)
        self.wgate = nn.Linear(hidden_size, coff * head_dim, bias=False, **factory)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, **factory))
        self.norm = nn.RMSNorm(head_dim, eps=eps, **factory)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, head_dim={self.head_dim}, ratio={self.ratio}, coff={self.coff}, "
            f"rope_dim={self.rope_dim}, rope_theta={self.rope_theta}, eps={self.eps}"
        )

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        total_comp: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compress ``x``; returns ``(kv_comp, cu_seqlens_comp)``.

        ``x [T, hidden_size]`` with ``cu_seqlens [B + 1]`` (packed sequences) gives
        ``kv_comp [total_comp, head_dim]``; ``x [B, S, hidden_size]`` without
        ``cu_seqlens`` gives ``kv_comp [B, S // ratio, head_dim]`` (B sequences of S
        tokens, no host sync). ``kv_comp`` has x's dtype.
        """
        if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
            raise ValueError(f"x: expected a [T, hidden] or [B, S, hidden] tensor, got {getattr(x, 'shape', type(x))}")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"x: expected last dim hidden_size={self.hidden_size}, got {x.shape[-1]}")
        batched = x.dim() == 3
        if batched:
            if cu_seqlens is not None:
                raise ValueError("cu_seqlens: only for packed [T, hidden] input; got a [B, S, hidden] x")
            b, s, _ = x.shape
            cu_seqlens = torch.arange(b + 1, device=x.device, dtype=torch.int64) * s
            total_comp = b * (s // self.ratio)
            x = x.reshape(b * s, self.hidden_size)
        elif cu_seqlens is None:
            raise ValueError("cu_seqlens: required for packed [T, hidden] input")
        kv = self.wkv(x)
        score = self.wgate(x)
        cu_comp = csa_cu_seqlens_comp(cu_seqlens, self.ratio)
        comp = csa_compress(kv, score, self.ape, cu_seqlens, self.ratio, self.coff,
                            cu_seqlens_comp=cu_comp, total_comp=total_comp)
        ct = compute_dtype(comp)
        y = F.rms_norm(comp.to(ct), (self.head_dim,), self.norm.weight.to(ct), self.eps)
        if self.rope_dim:
            pos = csa_comp_positions(cu_comp, comp.shape[0], self.ratio)
            nope, rope = y[:, : self.head_dim - self.rope_dim], y[:, self.head_dim - self.rope_dim :]
            y = torch.cat([nope, apply_interleaved_rope(rope, pos, self.rope_theta)], dim=-1)
        y = y.to(x.dtype)
        if batched:
            y = y.view(b, s // self.ratio, self.head_dim)
        return y, cu_comp

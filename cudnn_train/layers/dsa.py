"""DeepSeek-V3.2's lightning indexer (``DSAIndexer``) and the hook that trains it.

The indexer picks, for every query token, the ``topk`` past tokens that the sparse MLA
attention will attend to (``cudnn_train.fused.dsa.sparse_mla_attention``). It is trained by
its own KL loss (``cudnn_train.fused.dsa.indexer_loss``) against the main attention's
distribution; its inputs are detached from the main model, so that loss only updates the
indexer, and the top-k selection is not differentiable. ``attach_indexer_loss`` ties the loss
to the attention output so that one ``backward()`` of the main loss also trains the indexer
(Megatron-core's ``DSAIndexerLossAutoScaler``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor, compute_dtype
from ..fused.dsa import indexer_logits, indexer_loss, indexer_topk

__all__ = ["DSAIndexer", "attach_indexer_loss", "apply_partial_rope"]

ROPE_POSITIONS = ("first", "last")


def apply_partial_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    rope_dim: int,
    base: float = 10000.0,
    interleaved: bool = False,
    rope_position: str = "first",
) -> torch.Tensor:
    """RoPE on ``rope_dim`` channels of ``x [B, S, ..., D]`` (the first or the last ones), positions ``[B, S]``.

    Megatron-core's convention (``_apply_rotary_pos_emb_bshd``): with ``inv_freq[i] =
    base**(-2i/rope_dim)`` and ``a = pos * inv_freq``, the rotated part ``r = [r1, r2]`` (halves)
    becomes ``[r1 cos a - r2 sin a, r2 cos a + r1 sin a]``. ``interleaved=True`` (MLA style) first
    regroups ``r`` as ``[r[0::2], r[1::2]]``, so channel pairs ``(2i, 2i+1)`` rotate together and
    come out de-interleaved, as Megatron does; applied to both q and k it gives the same dot
    products as DeepSeek's complex-pair form. Math in float32 (float64 for float64 x); x's dtype out.
    """
    if rope_dim == 0:
        return x
    ct = compute_dtype(x)
    d = x.shape[-1]
    lo = 0 if rope_position == "first" else d - rope_dim
    part = x[..., lo:lo + rope_dim].to(ct)
    if interleaved:
        part = torch.cat([part[..., 0::2], part[..., 1::2]], dim=-1)
    inv_freq = base ** (-torch.arange(0, rope_dim, 2, device=x.device, dtype=ct) / rope_dim)
    angle = positions.to(ct)[..., None] * inv_freq  # [B, S, rope_dim/2]
    angle = angle.view(*angle.shape[:2], *([1] * (x.dim() - 3)), -1)
    cos, sin = angle.cos(), angle.sin()
    r1, r2 = part.chunk(2, dim=-1)
    rotated = torch.cat([r1 * cos - r2 * sin, r2 * cos + r1 * sin], dim=-1).to(x.dtype)
    pieces = [x[..., :lo], rotated, x[..., lo + rope_dim:]]
    return torch.cat([p for p in pieces if p.shape[-1] > 0], dim=-1)


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


def attach_indexer_loss(output: torch.Tensor, loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Return ``output`` unchanged; its backward also backpropagates ``scale * loss``.

    So ``attach_indexer_loss(attn_out, indexer_loss)`` makes the main loss's ``backward()`` train
    the indexer with d(scale * loss), whatever the main loss is (Megatron's
    ``DSAIndexerLossAutoScaler``; pass the main loss's scale, e.g. ``1 / num_microbatches``).
    """
    check_tensor("output", output, dtypes=FLOAT_DTYPES)
    check_tensor("loss", loss, dtypes=FLOAT_DTYPES, ndim=0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    return _AttachLoss.apply(output, loss, float(scale))


def _check_pos_int(name: str, v: object, lo: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")


class DSAIndexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer, with Megatron-core's ``DSAIndexer`` parameter names.

    Given the hidden states ``x [B, S, hidden_size]`` and the query latent ``qr [B, S, q_lora_rank]``
    (the output of the MLA's q_a projection and norm), batch first:

        index_q = rope(linear_wq_b(qr).view(B, S, n_heads, head_dim))
        index_k = rope(k_norm(linear_wk(x)))                        one shared key per token
        weights = linear_weights_proj(x) * n_heads**-0.5 * head_dim**-0.5

    ``k_norm`` is a LayerNorm (weight and bias, eps ``k_norm_eps``) computed in float32; RoPE
    (:func:`apply_partial_rope`) rotates ``rope_dim`` channels, the first ones by default (DeepSeek
    and Megatron put the rotary part in front), non-interleaved by default (Megatron's
    ``dsa_indexer_rope_interleaved=False``). weights are float32 (float64 in a float64 module).
    The index scores are then ``indexer_logits(index_q, index_k, weights)`` (causal) and the
    selection ``indexer_topk(scores, min(topk, S))``. DeepSeek's Hadamard rotation of q and k is
    omitted: it is orthogonal, so it leaves every score unchanged (it only matters for FP8).

    With ``detach_inputs`` (default, as DeepSeek-V3.2 and Megatron train it) x and qr are
    detached: gradients of the indexer loss reach the indexer's parameters only.

    Parameters (state_dict keys): ``linear_wq_b.weight [n_heads*head_dim, q_lora_rank]``,
    ``linear_wk.weight [head_dim, hidden_size]``, ``k_norm.weight``, ``k_norm.bias [head_dim]``,
    ``linear_weights_proj.weight [n_heads, hidden_size]``. Linear weights are initialized from
    N(0, init_std**2) (Megatron's default init_method), k_norm to ones and zeros.
    Layout note: Megatron's tensors are sequence first ``[S, B, ...]``; these are ``[B, S, ...]``.
    """

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int = 64,
        head_dim: int = 128,
        rope_dim: int = 64,
        topk: int = 2048,
        *,
        rope_base: float = 10000.0,
        rope_interleaved: bool = False,
        rope_position: str = "first",
        k_norm_eps: float = 1e-6,
        init_std: float = 0.02,
        detach_inputs: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("q_lora_rank", q_lora_rank), ("n_heads", n_heads),
                        ("head_dim", head_dim), ("topk", topk)):
            _check_pos_int(name, v)
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or not 0 <= rope_dim <= head_dim or rope_dim % 2:
            raise ValueError(f"rope_dim: expected an even int in [0, head_dim={head_dim}], got {rope_dim!r}")
        if rope_position not in ROPE_POSITIONS:
            raise ValueError(f"rope_position: expected one of {ROPE_POSITIONS}, got {rope_position!r}")
        if not (isinstance(rope_base, (int, float)) and rope_base > 0):
            raise ValueError(f"rope_base: expected a positive float, got {rope_base!r}")
        if not (isinstance(k_norm_eps, (int, float)) and k_norm_eps >= 0):
            raise ValueError(f"k_norm_eps: expected a non-negative float, got {k_norm_eps!r}")
        if not (isinstance(init_std, (int, float)) and init_std >= 0):
            raise ValueError(f"init_std: expected a non-negative float, got {init_std!r}")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size, self.q_lora_rank = hidden_size, q_lora_rank
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.rope_base, self.rope_interleaved, self.rope_position = float(rope_base), bool(rope_interleaved), rope_position
        self.init_std, self.detach_inputs = float(init_std), bool(detach_inputs)
        self.softmax_scale = head_dim**-0.5
        self.linear_wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False, **factory)
        self.linear_wk = nn.Linear(hidden_size, head_dim, bias=False, **factory)
        self.k_norm = nn.LayerNorm(head_dim, eps=k_norm_eps, **factory)
        self.linear_weights_proj = nn.Linear(hidden_size, n_heads, bias=False, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.linear_wq_b, self.linear_wk, self.linear_weights_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=self.init_std)
        self.k_norm.reset_parameters()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, q_lora_rank={self.q_lora_rank}, n_heads={self.n_heads}, "
                f"head_dim={self.head_dim}, rope_dim={self.rope_dim}, topk={self.topk}")

    # ------------------------------------------------------------ pieces

    def _check_inputs(self, x, qr, position_ids):
        check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3)
        check_tensor("qr", qr, dtypes=FLOAT_DTYPES, ndim=3)
        b, s, hid = x.shape
        if hid != self.hidden_size:
            raise ValueError(f"x: expected last dim hidden_size = {self.hidden_size}, got shape {tuple(x.shape)}")
        if tuple(qr.shape) != (b, s, self.q_lora_rank):
            raise ValueError(f"qr: expected shape {(b, s, self.q_lora_rank)}, got {tuple(qr.shape)}")
        if position_ids is not None:
            check_tensor("position_ids", position_ids, dtypes=(torch.int32, torch.int64), ndim=(1, 2))
            if tuple(position_ids.shape) not in ((s,), (b, s), (1, s)):
                raise ValueError(f"position_ids: expected shape ({s},) or ({b}, {s}), got {tuple(position_ids.shape)}")
        check_same_device(x=x, qr=qr, position_ids=position_ids)

    def project(
        self, x: torch.Tensor, qr: torch.Tensor, *, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(index_q ``[B, S, n_heads, head_dim]``, index_k ``[B, S, head_dim]``, weights ``[B, S, n_heads]``)."""
        self._check_inputs(x, qr, position_ids)
        if self.detach_inputs:
            x, qr = x.detach(), qr.detach()
        b, s, _ = x.shape
        if position_ids is None:
            pos = torch.arange(s, device=x.device).expand(b, s)
        else:
            pos = position_ids.reshape(-1, s).expand(b, s)
        rope = dict(rope_dim=self.rope_dim, base=self.rope_base, interleaved=self.rope_interleaved,
                    rope_position=self.rope_position)
        q = self.linear_wq_b(qr).view(b, s, self.n_heads, self.head_dim)
        q = apply_partial_rope(q, pos, **rope)
        k = self.linear_wk(x)
        ct = compute_dtype(k)
        kn = self.k_norm
        k = F.layer_norm(k.to(ct), (self.head_dim,), kn.weight.to(ct), kn.bias.to(ct), kn.eps).to(k.dtype)
        k = apply_partial_rope(k, pos, **rope)
        w = self.linear_weights_proj(x).to(compute_dtype(x)) * (self.n_heads**-0.5 * self.softmax_scale)
        return q, k, w

    def scores(self, x: torch.Tensor, qr: torch.Tensor, *, position_ids: torch.Tensor | None = None,
               causal: bool = True) -> torch.Tensor:
        """Index scores ``[B, S, S]`` float32, -inf at the future keys (all visible if not causal)."""
        q, k, w = self.project(x, qr, position_ids=position_ids)
        return indexer_logits(q, k, w, causal=causal)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                causal: bool = True) -> torch.Tensor:
        """Top-k key indices ``[B, S, min(topk, S)]`` int32, -1 where fewer keys are visible."""
        with torch.no_grad():
            logits = self.scores(x, qr, position_ids=position_ids, causal=causal)
        return indexer_topk(logits, min(self.topk, logits.shape[-1]))

    def forward_with_loss(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        softmax_scale: float,
        *,
        sparse_loss: bool = False,
        loss_coeff: float = 1.0,
        position_ids: torch.Tensor | None = None,
        causal: bool = True,
        attn_lse: torch.Tensor | None = None,
        query_valid_rows: torch.Tensor | None = None,
        calculate_per_token_loss: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k indices as ``forward``, the indexer loss): one projection serves both.

        query ``[B, S, Hm, Dm]`` and key ``[B, S, Dm]`` (or ``[B, S, Hk, Dm]``) are the main
        attention's, softmax_scale its scale; they are detached. ``sparse_loss`` restricts the
        loss to the selected keys (DeepSeek-V3.2's sparse stage); otherwise it covers every
        visible key (the dense warm-up). See ``fused.dsa.indexer_loss`` for the formula.
        """
        if not isinstance(sparse_loss, bool):
            raise ValueError(f"sparse_loss: expected a bool, got {sparse_loss!r}")
        q, k, w = self.project(x, qr, position_ids=position_ids)
        with torch.no_grad():
            logits = indexer_logits(q, k, w, causal=causal)
            topk_indices = indexer_topk(logits, min(self.topk, logits.shape[-1]))
        loss = indexer_loss(
            q, k, w, query, key, softmax_scale, topk_indices=topk_indices if sparse_loss else None,
            loss_coeff=loss_coeff, causal=causal, attn_lse=attn_lse, query_valid_rows=query_valid_rows,
            calculate_per_token_loss=calculate_per_token_loss,
        )
        return topk_indices, loss

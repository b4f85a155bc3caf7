"""Kimi Delta Attention layer, interchangeable with FLA 0.6's ``fla.layers.KimiDeltaAttention``.

Same constructor arguments and defaults, parameter names, shapes and initialization (one
RNG seed gives both bitwise identical parameters), so a ``state_dict`` moves between the
two with ``strict=True``. Numerics go through cudnn_train's ``causal_conv1d``,
``chunk_kda`` / ``fused_recurrent_kda`` and ``rms_norm_gated`` ops; padding, packing and
the FLA-style inference cache work as in :mod:`.gated_deltanet`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..fused.kda import chunk_kda, fused_recurrent_kda
from .gated_deltanet import (
    ShortConvolution,
    check_heads,
    delta_layer_inputs,
    delta_layer_output,
    heads,
    inv_softplus_dt,
)
from .norm import RMSNormGated

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention (arXiv 2510.26692), FLA 0.6's ``KimiDeltaAttention`` layer.

    Parameters (FLA's names): ``q_proj``, ``k_proj`` ``[H*K, hidden]``, ``v_proj``
    ``[HV*Vd, hidden]``; ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` (with ``use_short_conv``);
    ``f_proj`` (``Linear(hidden, Vd)`` then ``Linear(Vd, HV*K)``: the low-rank gate input);
    ``b_proj`` ``[HV, hidden]``; ``A_log`` ``[HV]`` and ``dt_bias`` ``[HV*K]`` (float32);
    ``g_proj`` (``Linear(hidden, Vd)`` then ``Linear(Vd, HV*Vd)`` with bias: the output gate);
    ``o_norm`` (:class:`RMSNormGated`, sigmoid gate); ``o_proj``.

    The op computes the per-channel decay ``-exp(A_log) * softplus(f_proj x + dt_bias)``
    (with ``lower_bound`` set: ``lower_bound * sigmoid(exp(A_log) * (f_proj x + dt_bias))``),
    ``beta = sigmoid(b_proj x)`` (doubled with ``allow_neg_eigval``) and l2-normalized q, k.
    ``safe_gate`` (FLA: a faster kernel for bounded gates) sets ``A_log`` to zeros at init;
    the op then needs ``lower_bound`` in [-5, 0) (a ValueError at the first forward, as in FLA).

    ``forward`` is :class:`~cudnn_train.layers.gated_deltanet.GatedDeltaNet`'s: returns
    ``(out [B, T, hidden], None, past_key_values)``, ``cu_seqlens`` keyword for packed
    sequences, ``attention_mask`` ``[B, T]`` for padding.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim, key_dim, value_dim = check_heads(hidden_size, head_dim, num_heads, num_v_heads, expand_v, mode)
        self.mode = mode
        self.allow_neg_eigval = allow_neg_eigval
        self.safe_gate = safe_gate
        self.lower_bound = lower_bound
        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_dim
        self.head_v_dim = head_v_dim
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.layer_idx = layer_idx

        # construction order = FLA's, so one seed gives both layers the same parameters
        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        if use_short_conv:
            self.q_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, activation="silu")
            self.k_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, activation="silu")
            self.v_conv1d = ShortConvolution(value_dim, conv_size, bias=conv_bias, activation="silu")

        self.gate_dim = num_v_heads * head_dim  # one decay per value head and key channel
        self.f_proj = nn.Sequential(
            nn.Linear(hidden_size, head_v_dim, bias=False),
            nn.Linear(head_v_dim, self.gate_dim, bias=False),
        )
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)

        if safe_gate:
            self.A_log = nn.Parameter(torch.zeros(num_v_heads, dtype=torch.float32))
        else:  # decay rates A ~ U(1, 16)
            self.A_log = nn.Parameter(torch.log(torch.empty(num_v_heads, dtype=torch.float32).uniform_(1, 16)))
        self.A_log._no_weight_decay = True
        self.dt_bias = nn.Parameter(inv_softplus_dt(self.gate_dim, dtype=torch.float32))
        self.dt_bias._no_weight_decay = True

        self.g_proj = nn.Sequential(
            nn.Linear(hidden_size, head_v_dim, bias=False),
            nn.Linear(head_v_dim, value_dim, bias=True),
        )
        self.o_norm = RMSNormGated(head_v_dim, activation="sigmoid", eps=norm_eps)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None, Any]:
        st = delta_layer_inputs(self, hidden_states, attention_mask, past_key_values, bool(use_cache), kwargs)
        g = heads(self.f_proj(st.x), self.head_k_dim)  # [.., HV, K]
        beta = self.b_proj(st.x)
        common = dict(
            initial_state=st.recurrent_state, output_final_state=bool(use_cache), use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval, lower_bound=self.lower_bound, state_v_first=True,
            cu_seqlens=st.cu_seqlens,
        )
        if st.mode == "chunk":
            o, recurrent_state = chunk_kda(st.q, st.k, st.v, g, beta, safe_gate=self.safe_gate, **common)
        else:
            o, recurrent_state = fused_recurrent_kda(st.q, st.k, st.v, g, beta, **common)
        return delta_layer_output(self, st, o, recurrent_state, past_key_values, self.g_proj(st.x))

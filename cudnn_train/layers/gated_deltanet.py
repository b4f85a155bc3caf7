"""Gated DeltaNet layer, interchangeable with FLA 0.6's ``fla.layers.GatedDeltaNet``.

Same constructor arguments and defaults, parameter names, shapes and initialization (with
the same RNG seed both build bitwise identical parameters), so a ``state_dict`` moves
between the two with ``strict=True``. The numerics go through cudnn_train's ops:
``causal_conv1d`` (short convolutions), ``chunk_gated_delta_rule`` /
``fused_recurrent_gated_delta_rule`` (the recurrence, gate and beta computed in the op),
``rms_norm_gated`` (output norm), so the layer runs on any device.

Also here, shared with :mod:`.kda`: :class:`ShortConvolution` (FLA's module of that
name: an ``nn.Conv1d`` holding ``weight [D, 1, W]`` and ``bias [D]``) and the
padding helpers that turn an ``attention_mask`` into packed sequences.

Inference cache: ``past_key_values`` follows FLA's cache protocol (``len(cache)``,
``cache[layer_idx]`` -> dict with ``recurrent_state`` and ``conv_state``,
``cache.update(recurrent_state=..., conv_state=..., layer_idx=..., offset=...)``), so
FLA's ``fla.models.utils.Cache`` works, and the states have FLA's layouts (recurrent
``[N, HV, V, K]`` float32, convolution ``[N, D, W]``): a cache filled by FLA's layer
continues in ours (checked in the GPU tier), and one filled by ours has what FLA reads.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..fused.causal_conv1d import causal_conv1d
from ..fused.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .norm import RMSNormGated

__all__ = ["GatedDeltaNet", "ShortConvolution", "RMSNorm"]

OUTPUT_GATE_ACTIVATIONS = ("swish", "silu", "sigmoid")


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution (FLA's ``ShortConvolution``): ``act(conv(x) + bias) + residual``.

    Parameters ``weight [D, 1, W]`` and ``bias [D]`` (``nn.Conv1d`` layout and init).
    ``forward(x [B, T, D], residual=None, mask=None, cache=None, output_final_state=False,
    cu_seqlens=None)`` returns ``(y [B, T, D], final_state [N, D, W] or None)`` as FLA's
    does: ``mask`` ``[B, T]`` zeroes padded inputs first (not with ``cu_seqlens``),
    ``cache`` is the state ``[N, D, W]`` left by a previous call. FLA's kernel-choice
    keywords (``backend``, ``chunk_indices``) are accepted and ignored.
    """

    def __init__(
        self,
        hidden_size: int,
        kernel_size: int,
        bias: bool = False,
        activation: str | None = "silu",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            in_channels=hidden_size, out_channels=hidden_size, kernel_size=kernel_size,
            padding=kernel_size - 1, groups=hidden_size, bias=bias, device=device, dtype=dtype,
        )
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation: expected 'silu', 'swish' or None, got {activation!r}")
        self.hidden_size = hidden_size
        self.activation = activation

    def extra_repr(self) -> str:
        s = f"{self.hidden_size}, kernel_size={self.kernel_size[0]}"
        if self.bias is None:
            s += ", bias=False"
        return s + f", activation={self.activation}"

    @property
    def state_size(self) -> int:
        return self.hidden_size * self.kernel_size[0]

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mask is not None:
            if cu_seqlens is not None:
                raise ValueError("mask: cannot be combined with cu_seqlens")
            x = x * mask.unsqueeze(-1).to(x.dtype)
        y, final = causal_conv1d(
            x, self.weight.squeeze(1), bias=self.bias, activation=self.activation, cu_seqlens=cu_seqlens,
            initial_state=cache, output_final_state=output_final_state,
        )
        if residual is not None:
            y = y + residual
        return y, final


class RMSNorm(nn.Module):
    """Plain RMSNorm over the last dim (FLA's ``RMSNorm`` state_dict: ``weight``); float32 math."""

    def __init__(
        self,
        hidden_size: int,
        elementwise_affine: bool = True,
        eps: float = 1e-5,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.register_parameter("bias", None)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(ct)
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.to(ct)
        return y.to(x.dtype)


# ---------------------------------------------------------------------- shared by GDN and KDA


def check_inputs(hidden_states: torch.Tensor, hidden_size: int, attention_mask: torch.Tensor | None) -> None:
    """hidden_states [B, T, hidden_size]; attention_mask None or a [B, S >= T] padding mask."""
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        raise ValueError(f"hidden_states: expected [B, T, hidden_size], got {getattr(hidden_states, 'shape', None)}")
    if hidden_states.shape[-1] != hidden_size:
        raise ValueError(f"hidden_states: last dim {hidden_states.shape[-1]} is not hidden_size={hidden_size}")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(
            "attention_mask: expected a [batch_size, seq_len] 0/1 padding mask (0 marks padding), "
            f"got {shape}; arbitrary [B, T, T] attention masks are not supported"
        )
    B, T = hidden_states.shape[:2]
    if attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(
            f"attention_mask: expected shape [B={B}, S>={T}] for hidden_states {tuple(hidden_states.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )


def unpad(
    hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Pack the real tokens of a padded batch into one sequence row, as FLA's layers do.

    Explicit ``cu_seqlens`` win (the input is already packed); otherwise a mask ``[B, S]``
    (its last T columns, S >= T for decoding with a cache) selects the tokens. Returns
    ``(hidden [1, total, D] or unchanged, indices or None, cu_seqlens or None)``.
    """
    if cu_seqlens is not None:
        if hidden_states.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens: packed sequences need batch size 1, got hidden_states {tuple(hidden_states.shape)}"
            )
        return hidden_states, None, cu_seqlens
    if attention_mask is None:
        return hidden_states, None, None
    B, T = hidden_states.shape[:2]
    mask = attention_mask[:, -T:].bool()
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    lens = mask.sum(dim=-1, dtype=torch.int32)
    cu = F.pad(lens.cumsum(dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(B * T, *hidden_states.shape[2:])
    return flat.index_select(0, indices).unsqueeze(0), indices, cu


def repad(o: torch.Tensor, indices: torch.Tensor | None, batch_size: int, q_len: int) -> torch.Tensor:
    """Inverse of :func:`unpad`: scatter the packed rows back, zeros at the padding."""
    if indices is None:
        return o
    rows = o.squeeze(0)
    out = rows.new_zeros(batch_size * q_len, *rows.shape[1:]).index_copy(0, indices, rows)
    return out.view(batch_size, q_len, *rows.shape[1:])


def layer_cache(module: nn.Module, past_key_values: Any) -> dict | None:
    """This layer's entry of an FLA-style cache, or None."""
    if past_key_values is None:
        return None
    if module.layer_idx is None:
        raise ValueError(f"layer_idx: {type(module).__name__} needs layer_idx when past_key_values is given")
    if len(past_key_values) > module.layer_idx:
        return past_key_values[module.layer_idx]
    return None


def pick_mode(module: nn.Module, q_len: int) -> str:
    """FLA's choice: chunked with autograd, recurrent for short inference calls, else ``mode``."""
    if torch.is_grad_enabled():
        return "chunk"
    if q_len <= 64 and not module.training:
        return "fused_recurrent"
    return module.mode


def check_heads(
    hidden_size: int, head_dim: int, num_heads: int, num_v_heads: int, expand_v: float, mode: str
) -> tuple[int, int, int]:
    """FLA's constructor checks; returns (head_v_dim, key_dim, value_dim)."""
    for name, val in (("hidden_size", hidden_size), ("head_dim", head_dim), ("num_heads", num_heads),
                      ("num_v_heads", num_v_heads)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}: expected a positive int, got {val!r}")
    head_v_dim = int(head_dim * expand_v)
    value_dim = int(num_v_heads * head_v_dim)
    if not math.isclose(num_v_heads * head_dim * expand_v, value_dim, rel_tol=1e-5) or not math.isclose(
        head_dim * expand_v, head_v_dim, rel_tol=1e-5
    ) or head_v_dim < 1:
        raise ValueError(f"expand_v: head_dim * expand_v = {head_dim * expand_v} must be a positive integer")
    if num_v_heads % num_heads != 0:
        raise ValueError(f"num_v_heads: {num_v_heads} must be a multiple of num_heads={num_heads} (GVA)")
    if mode not in ("chunk", "fused_recurrent"):
        raise ValueError(f"mode: expected 'chunk' or 'fused_recurrent', got {mode!r}")
    return head_v_dim, num_heads * head_dim, value_dim


def inv_softplus_dt(n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """dt ~ log-uniform on [1e-3, 1e-1] (floored at 1e-4), returned as softplus^-1(dt) (Mamba's init)."""
    dt_min, dt_max = 0.001, 0.1
    dt = torch.exp(torch.rand(n, dtype=dtype) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = torch.clamp(dt, min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


def short_convs(module: nn.Module, hidden_states: torch.Tensor, last_state: dict | None, use_cache: bool,
                cu_seqlens: torch.Tensor | None):
    """q, k, v after the projections and short convolutions (or SiLU without them), and the conv states."""
    if not module.use_short_conv:
        q = F.silu(module.q_proj(hidden_states))
        k = F.silu(module.k_proj(hidden_states))
        v = F.silu(module.v_proj(hidden_states))
        return q, k, v, None
    cq = ck = cv = None
    if last_state is not None and last_state.get("conv_state") is not None:
        cq, ck, cv = last_state["conv_state"]
    q, cq = module.q_conv1d(module.q_proj(hidden_states), cache=cq, output_final_state=use_cache,
                            cu_seqlens=cu_seqlens)
    k, ck = module.k_conv1d(module.k_proj(hidden_states), cache=ck, output_final_state=use_cache,
                            cu_seqlens=cu_seqlens)
    v, cv = module.v_conv1d(module.v_proj(hidden_states), cache=cv, output_final_state=use_cache,
                            cu_seqlens=cu_seqlens)
    return q, k, v, (cq, ck, cv)


def heads(x: torch.Tensor, d: int) -> torch.Tensor:
    """``[..., H * d] -> [..., H, d]``."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // d, d)

class _Step:
    """What both delta-rule layers compute before and after their op (FLA's layer skeleton)."""

    __slots__ = ("x", "indices", "cu_seqlens", "q", "k", "v", "conv_state", "recurrent_state", "mode",
                 "batch_size", "q_len")


def delta_layer_inputs(module: nn.Module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                       past_key_values: Any, use_cache: bool, kwargs: dict) -> _Step:
    """Validate, pick the mode, unpad, run the short convolutions and split heads."""
    st = _Step()
    cu_seqlens = kwargs.get("cu_seqlens")
    check_inputs(hidden_states, module.hidden_size, attention_mask if cu_seqlens is None else None)
    st.batch_size, st.q_len, _ = hidden_states.shape
    st.mode = pick_mode(module, st.q_len)
    if module.training and st.mode != "chunk":
        raise ValueError(f"mode: only 'chunk' trains (got {st.mode!r} in training mode)")
    last_state = layer_cache(module, past_key_values)
    st.x, st.indices, st.cu_seqlens = unpad(hidden_states, attention_mask, cu_seqlens)
    q, k, v, st.conv_state = short_convs(module, st.x, last_state, use_cache, st.cu_seqlens)
    st.q, st.k = heads(q, module.head_k_dim), heads(k, module.head_k_dim)
    st.v = heads(v, module.head_v_dim)
    st.recurrent_state = last_state.get("recurrent_state") if last_state is not None else None
    return st


def delta_layer_output(module: nn.Module, st: _Step, o: torch.Tensor, recurrent_state: torch.Tensor | None,
                       past_key_values: Any, gate: torch.Tensor | None) -> tuple[torch.Tensor, None, Any]:
    """Update the cache, apply the output norm (gated when ``gate`` is given), project and re-pad."""
    if past_key_values is not None:
        past_key_values.update(
            recurrent_state=recurrent_state, conv_state=st.conv_state, layer_idx=module.layer_idx, offset=st.q_len
        )
    o = module.o_norm(o) if gate is None else module.o_norm(o, heads(gate, module.head_v_dim))
    o = module.o_proj(o.reshape(*o.shape[:2], module.value_dim))
    return repad(o, st.indices, st.batch_size, st.q_len), None, past_key_values



class GatedDeltaNet(nn.Module):
    """Gated DeltaNet (arXiv 2412.06464), FLA 0.6's ``GatedDeltaNet`` layer.

    Parameters (FLA's names): ``q_proj``, ``k_proj`` ``[H*K, hidden]``; ``v_proj``
    ``[HV*Vd, hidden]``; ``a_proj``, ``b_proj`` ``[HV, hidden]``; ``A_log``, ``dt_bias``
    ``[HV]`` (float32); ``q_conv1d``, ``k_conv1d``, ``v_conv1d`` (with ``use_short_conv``);
    ``g_proj`` and ``o_norm`` (:class:`RMSNormGated`) with ``use_gate``, else ``o_norm``
    a plain float32 :class:`RMSNorm`; ``o_proj``. K = ``head_dim``, Vd = ``head_dim * expand_v``,
    HV = ``num_v_heads`` (default ``num_heads``; GVA when larger).

    Per token: q, k, v = silu(shortconv(proj(x))); the op l2-normalizes q and k, takes
    ``beta = sigmoid(b_proj x)`` (doubled with ``allow_neg_eigval``) and the decay
    ``-exp(A_log) * softplus(a_proj x + dt_bias)``; o = o_norm(o, g_proj x); out = o_proj(o).

    ``forward(hidden_states [B, T, hidden], attention_mask=None, past_key_values=None,
    use_cache=False, output_attentions=False, cu_seqlens=None)`` returns
    ``(out [B, T, hidden], None, past_key_values)``. ``cu_seqlens`` (keyword, B == 1) packs
    sequences; ``attention_mask`` ``[B, T]`` (1 = token, 0 = padding) packs the real tokens,
    runs them as varlen sequences and puts zeros at the padding. Unknown keyword arguments
    are ignored, as in FLA.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        output_gate_activation: str = "swish",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim, key_dim, value_dim = check_heads(hidden_size, head_dim, num_heads, num_v_heads, expand_v, mode)
        if output_gate_activation not in OUTPUT_GATE_ACTIVATIONS:
            raise ValueError(
                f"output_gate_activation: expected one of {OUTPUT_GATE_ACTIVATIONS}, got {output_gate_activation!r}"
            )
        self.mode = mode
        self.allow_neg_eigval = allow_neg_eigval
        self.hidden_size = hidden_size
        self.expand_v = expand_v
        self.use_gate = use_gate
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
        self.a_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)

        A = torch.empty(num_v_heads, dtype=torch.float32).uniform_(0, 16)  # decay rates A ~ U(0, 16)
        self.A_log = nn.Parameter(torch.log(A))
        self.A_log._no_weight_decay = True
        self.dt_bias = nn.Parameter(inv_softplus_dt(num_v_heads))
        self.dt_bias._no_weight_decay = True

        if use_short_conv:
            self.q_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, activation="silu")
            self.k_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, activation="silu")
            self.v_conv1d = ShortConvolution(value_dim, conv_size, bias=conv_bias, activation="silu")
        else:
            warnings.warn(
                "GatedDeltaNet: use_short_conv=False; the short convolutions matter for quality, "
                "turn them off only on purpose",
                stacklevel=2,
            )
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
            self.o_norm = RMSNormGated(head_v_dim, eps=norm_eps, activation=output_gate_activation)
        else:
            self.o_norm = RMSNorm(head_v_dim, eps=norm_eps, dtype=torch.float32)
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
        delta_rule = chunk_gated_delta_rule if st.mode == "chunk" else fused_recurrent_gated_delta_rule
        o, recurrent_state = delta_rule(
            st.q, st.k, st.v, g=self.a_proj(st.x), beta=self.b_proj(st.x), initial_state=st.recurrent_state,
            output_final_state=bool(use_cache), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval, state_v_first=True, cu_seqlens=st.cu_seqlens,
        )
        gate = self.g_proj(st.x) if self.use_gate else None
        return delta_layer_output(self, st, o, recurrent_state, past_key_values, gate)

"""Causal depthwise short convolution (the ``ShortConvolution`` of GDN and KDA), FLA 0.6 layout.

Per sequence and channel ``d``, with kernel width W (2..4 in the layers; any W >= 1 here)::

    y[t, d] = act(bias[d] + sum_{w < W} weight[d, w] * x[t - (W - 1) + w, d])

``weight[:, W - 1]`` multiplies the current token. Before a sequence's first token the
input is read from its ``initial_state`` (the cache): ``x[-j] = initial_state[n, :, W - j]``
for ``j = 1 .. W - 1`` (zeros without one; ``initial_state[..., 0]`` is kept only as the
oldest cache entry). ``act`` is silu (``"silu"``/``"swish"``) or None.

Shapes (FLA's ``fla.modules.causal_conv1d.causal_conv1d``): x ``[B, T, D]``, weight
``[D, W]`` (``ShortConvolution.weight`` is ``[D, 1, W]``: squeeze dim 1), bias ``[D]``,
initial and final state ``[N, D, W]``. The final state holds the last W inputs of the
sequence including the history, ``final[n, :, j] = x[len_n - W + j]`` (so short
sequences keep the tail of their initial state). Varlen: ``cu_seqlens`` ``[N + 1]`` with
B == 1; no tap crosses a sequence boundary. Math in float32 (float64 for float64 x);
y and the final state have x's dtype.

Backends (op ``causal_conv1d``), in order: ``cutedsl`` (kernels to come, registered with
``@conv_op.register("cutedsl")``, same keyword arguments as :func:`_torch_backend`),
``fla`` (FLA's Triton ``causal_conv1d``: CUDA tensors only; declines float64) and
``torch`` (vectorized gathers, differentiable in x, weight, bias and initial_state,
and free of host synchronization even for varlen inputs). :func:`causal_conv1d_ref`
is the readable per-sequence reference.
"""

from __future__ import annotations

import torch

from .. import backend
from .._validate import FLOAT_DTYPES, check_same_device, check_tensor, compute_dtype
from .gated_delta_rule import call_fla, check_cu_seqlens, fla_original, host_cu_seqlens

__all__ = ["causal_conv1d", "causal_conv1d_ref", "CONV_ACTIVATIONS"]

CONV_ACTIVATIONS = ("silu", "swish", None)

conv_op = backend.Op("causal_conv1d", ["cutedsl", "fla", "torch"])


def _check(x, weight, bias, activation, cu_seqlens, initial_state, cu_seqlens_cpu):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3)
    B, T, D = x.shape
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if weight.shape[0] != D or weight.shape[1] < 1:
        raise ValueError(f"weight: expected [D, W] with D={D} and W >= 1, got {tuple(weight.shape)}")
    W = weight.shape[1]
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, ndim=1)
        if bias.shape[0] != D:
            raise ValueError(f"bias: expected shape ({D},), got {tuple(bias.shape)}")
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation: expected one of {CONV_ACTIVATIONS}, got {activation!r}")
    device = check_same_device(x=x, weight=weight, bias=bias, initial_state=initial_state)
    n, cu_vals = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, device)
    N = B if n is None else n
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=FLOAT_DTYPES, ndim=3)
        if tuple(initial_state.shape) != (N, D, W):
            raise ValueError(f"initial_state: expected shape {(N, D, W)} [N, D, W], got {tuple(initial_state.shape)}")
    return B, T, D, W, N, cu_vals


def _act(y, activation):
    return y * torch.sigmoid(y) if activation is not None else y


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The readable reference: one sequence at a time, history prepended, taps summed."""
    B, T, D, W, N, cu_vals = _check(x, weight, bias, activation, cu_seqlens, initial_state, None)
    if cu_seqlens is not None and cu_vals is None:
        cu_vals = host_cu_seqlens(cu_seqlens, None, T)
    ct = compute_dtype(x)
    wf = weight.to(ct)
    ys, finals = [], []
    for n in range(N):
        xs = x[n].to(ct) if cu_vals is None else x[0, cu_vals[n] : cu_vals[n + 1]].to(ct)  # [L, D]
        L = xs.shape[0]
        hist = initial_state[n].to(ct).t() if initial_state is not None else xs.new_zeros(W, D)  # [W, D]
        comb = torch.cat([hist, xs], dim=0)  # comb[W + t] = x[t]
        y = xs.new_zeros(L, D)
        for w in range(W):  # tap w reads x[t - (W - 1) + w] = comb[t + 1 + w]
            y = y + wf[:, w] * comb[1 + w : 1 + w + L]
        if bias is not None:
            y = y + bias.to(ct)
        ys.append(_act(y, activation))
        finals.append(comb[-W:].t())
    y = torch.stack(ys) if cu_vals is None else torch.cat(ys, dim=0).unsqueeze(0)
    final = torch.stack(finals).to(x.dtype) if output_final_state else None
    return y.to(x.dtype), final


@conv_op.register("torch")
def _torch_backend(x, weight, *, bias, activation, cu_seqlens, initial_state, output_final_state, cu_seqlens_cpu):
    B, T, D = x.shape
    W = weight.shape[1]
    ct = compute_dtype(x)
    dev = x.device
    M = B * T
    X = torch.cat([x.reshape(M, D).to(ct), x.new_zeros(1, D, dtype=ct)], dim=0)  # row M: zeros
    m = torch.arange(M, device=dev)
    if cu_seqlens is None:
        seq, pos = m // max(T, 1), m % max(T, 1)
        starts = torch.arange(B, device=dev) * T
        lens = torch.full((B,), T, device=dev, dtype=torch.long)
    else:  # sequence ids from the device offsets: no host read
        cu = cu_seqlens.to(torch.long)
        seq = torch.searchsorted(cu[1:], m, right=True)
        pos = m - cu[seq]
        starts, lens = cu[:-1], cu[1:] - cu[:-1]
    hT = None if initial_state is None else initial_state.to(ct).transpose(1, 2)  # [N, W, D]
    wf = weight.to(ct)
    y = X.new_zeros(M, D) if bias is None else bias.to(ct).expand(M, D)
    for w in range(W):
        s = W - 1 - w  # tap w looks s tokens back
        inside = pos >= s
        val = X[torch.where(inside, m - s, M)]
        if hT is not None and s > 0:  # before the start: history entry W + pos - s
            hist = hT[seq, (W + pos - s).clamp(0, W - 1)]
            val = torch.where(inside[:, None], val, hist)
        y = y + val * wf[:, w]
    y = _act(y, activation).reshape(B, T, D).to(x.dtype)
    final = None
    if output_final_state:
        c = lens[:, None] - W + torch.arange(W, device=dev)  # [N, W]: position of final entry j
        inside = c >= 0
        val = X[torch.where(inside, starts[:, None] + c, M)]  # [N, W, D]
        if hT is not None:
            idx = (W + c).clamp(0, W - 1)
            hist = torch.gather(hT, 1, idx[..., None].expand(*idx.shape, D))
            val = torch.where(inside[..., None], val, hist)
        final = val.transpose(1, 2).contiguous().to(x.dtype)
    return y, final


@conv_op.register("fla")
def _fla_backend(x, weight, *, bias, activation, cu_seqlens, initial_state, output_final_state, cu_seqlens_cpu):
    if x.device.type != "cuda":
        raise backend.Unsupported("no GPU")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise backend.Unsupported(f"dtype {str(x.dtype).replace('torch.', '')}")
    if x.shape[1] == 0:
        raise backend.Unsupported("empty input")
    fn = fla_original("fla.modules.causal_conv1d.ops", "causal_conv1d")
    cu_cpu = None
    if cu_seqlens is not None:
        cu_cpu = torch.tensor(host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, x.shape[1]), dtype=torch.long)
    return call_fla(
        fn, x=x, weight=weight, bias=bias, initial_state=initial_state, output_final_state=output_final_state,
        activation=activation, backend="triton", cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_cpu,
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal depthwise convolution; returns ``(y [B, T, D], final_state [N, D, W] or None)``.

    See the module docstring for the layout. ``cu_seqlens_cpu`` is an optional host copy
    of ``cu_seqlens`` (only checked, never needed by the torch backend).
    """
    _check(x, weight, bias, activation, cu_seqlens, initial_state, cu_seqlens_cpu)
    return conv_op(
        x, weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens, initial_state=initial_state,
        output_final_state=bool(output_final_state), cu_seqlens_cpu=cu_seqlens_cpu,
    )

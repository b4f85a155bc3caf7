"""Gated RMSNorm: ``y = rmsnorm(x) * weight * act(gate)``, the output norm of GDN and KDA.

Per row of the last dimension D (one head):

    rstd = 1 / sqrt(mean(x**2) + eps)
    y    = x * rstd * weight * act(gate)        act = swish (g * sigmoid(g)) or sigmoid

Backends, in order: ``cutedsl`` (SM90 kernels, ``kernels/rms_norm_gated_sm90.py``)
then ``torch`` (the float32 reference below). Forward and backward are separate
dispatch points (``rms_norm_gated`` and ``rms_norm_gated_bwd``).

Math is float32 whatever the input dtype; y has x's dtype; the gradients have
the dtypes of their inputs. dweight is reduced from per-CTA partial sums in a
fixed order (never float atomics), so the backward is bitwise reproducible in
every mode: ``deterministic(True)`` costs nothing here.
"""

from __future__ import annotations

import torch

from .. import backend
from .._validate import FLOAT_DTYPES, check_same_device, check_tensor, compute_dtype

__all__ = ["rms_norm_gated", "rms_norm_gated_ref", "ACTIVATIONS"]

ACTIVATIONS = ("swish", "silu", "sigmoid")

fwd_op = backend.Op("rms_norm_gated", ["cutedsl", "torch"])
bwd_op = backend.Op("rms_norm_gated_bwd", ["cutedsl", "torch"])


def _canon_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    return "sigmoid" if activation == "sigmoid" else "swish"


# ---------------------------------------------------------------- reference


def rms_norm_gated_ref(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-5,
    activation: str = "swish",
) -> torch.Tensor:
    """The oracle: float32 math (float64 if given float64), output in x's dtype."""
    act = _canon_activation(activation)
    ct = compute_dtype(x)
    xf, gf = x.to(ct), gate.to(ct)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = xf * rstd
    if weight is not None:
        y = y * weight.to(ct)
    s = torch.sigmoid(gf)
    y = y * (gf * s if act == "swish" else s)
    return y.to(x.dtype)


def _torch_fwd(x2, g2, w, eps, act):
    ct = compute_dtype(x2)
    xf, gf = x2.to(ct), g2.to(ct)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1) + eps)
    n = xf * rstd[:, None]
    s = torch.sigmoid(gf)
    a = gf * s if act == "swish" else s
    y = n * a if w is None else n * w.to(ct) * a
    return y.to(x2.dtype), rstd


def _torch_bwd(dy2, x2, g2, w, rstd, eps, act):
    """Closed-form backward of ``_torch_fwd`` (float32)."""
    ct = compute_dtype(x2)
    dyf, xf, gf = dy2.to(ct), x2.to(ct), g2.to(ct)
    n = xf * rstd[:, None]
    s = torch.sigmoid(gf)
    if act == "swish":
        a = gf * s
        da = s * (1.0 + gf * (1.0 - s))
    else:
        a = s
        da = s * (1.0 - s)
    wf = None if w is None else w.to(ct)
    nw = n if wf is None else n * wf
    dg = dyf * nw * da
    dn = dyf * a if wf is None else dyf * a * wf
    dx = rstd[:, None] * (dn - n * (dn * n).mean(dim=-1, keepdim=True))
    dw = None if w is None else (dyf * n * a).sum(dim=0).to(w.dtype)
    return dx.to(x2.dtype), dg.to(g2.dtype), dw


@fwd_op.register("torch")
def _fwd_torch(x2, g2, w, eps, act):
    return _torch_fwd(x2, g2, w, eps, act)


@bwd_op.register("torch")
def _bwd_torch(dy2, x2, g2, w, rstd, eps, act):
    return _torch_bwd(dy2, x2, g2, w, rstd, eps, act)


@fwd_op.register("cutedsl")
def _fwd_cutedsl(x2, g2, w, eps, act):
    from ..kernels import rms_norm_gated_sm90 as k

    return k.forward(x2, g2, w, eps, act)


@bwd_op.register("cutedsl")
def _bwd_cutedsl(dy2, x2, g2, w, rstd, eps, act):
    from ..kernels import rms_norm_gated_sm90 as k

    return k.backward(dy2, x2, g2, w, rstd, act)


# ---------------------------------------------------------------- custom ops (torch.compile)


@torch.library.custom_op("cudnn_train::rms_norm_gated_fwd", mutates_args=())
def _fwd_custom(x2: torch.Tensor, g2: torch.Tensor, w: torch.Tensor | None, eps: float, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = fwd_op(x2, g2, w, eps, act)
    return y, rstd


@_fwd_custom.register_fake
def _(x2, g2, w, eps, act):
    return torch.empty_like(x2), x2.new_empty(x2.shape[0], dtype=torch.float32)


@torch.library.custom_op("cudnn_train::rms_norm_gated_bwd", mutates_args=())
def _bwd_custom(
    dy2: torch.Tensor, x2: torch.Tensor, g2: torch.Tensor, w: torch.Tensor | None, rstd: torch.Tensor, eps: float, act: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dg, dw = bwd_op(dy2, x2, g2, w, rstd, eps, act)
    if dw is None:  # custom ops cannot return None: an empty placeholder
        dw = x2.new_empty(0)
    return dx, dg, dw


@_bwd_custom.register_fake
def _(dy2, x2, g2, w, rstd, eps, act):
    dw = x2.new_empty(0) if w is None else torch.empty_like(w)
    return torch.empty_like(x2), torch.empty_like(g2), dw


# ---------------------------------------------------------------- autograd


class _RMSNormGatedFn(torch.autograd.Function):
    # Inputs arrive in their own shape and are viewed as [rows, D] here, where autograd
    # records nothing: a view outside would cost an autograd node per tensor and call.
    @staticmethod
    def forward(ctx, x, gate, w, eps, act):
        d = x.shape[-1]
        x2, g2 = _rows(x, d), _rows(gate, d)
        if torch.compiler.is_compiling():
            y, rstd = _fwd_custom(x2, g2, w, eps, act)
        else:  # eager: skip the custom-op dispatcher (tens of microseconds)
            y, rstd = fwd_op(x2, g2, w, eps, act)
        ctx.save_for_backward(x2, g2, w, rstd)
        ctx.eps, ctx.act, ctx.shape = eps, act, x.shape
        return y if x.dim() == 2 else y.view(x.shape)  # a view costs several us: only when needed

    @staticmethod
    def backward(ctx, dy):
        x2, g2, w, rstd = ctx.saved_tensors
        dy2 = _rows(dy, x2.shape[1])
        if torch.compiler.is_compiling():
            dx, dg, dw = _bwd_custom(dy2, x2, g2, w, rstd, ctx.eps, ctx.act)
            dw = None if w is None else dw
        else:
            dx, dg, dw = bwd_op(dy2, x2, g2, w, rstd, ctx.eps, ctx.act)
        if len(ctx.shape) != 2:
            dx, dg = dx.view(ctx.shape), dg.view(ctx.shape)
        return dx, dg, dw, None, None


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """View ``t`` as [rows, D]; copy only when its rows cannot be strided uniformly."""
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, d)
    except RuntimeError:
        return t.reshape(-1, d)


def rms_norm_gated(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    activation: str = "swish",
) -> torch.Tensor:
    """``rmsnorm(x) * weight * act(gate)`` over the last dim; x and gate ``[..., D]``, weight ``[D]``."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES)
    if gate.shape != x.shape:
        raise ValueError(f"gate: expected the shape of x {tuple(x.shape)}, got {tuple(gate.shape)}")
    if gate.dtype != x.dtype:
        raise ValueError(f"gate: expected x's dtype {x.dtype}, got {gate.dtype}")
    d = x.shape[-1]
    if d == 0:
        raise ValueError("x: the last dim (D) must be at least 1")
    if weight is not None:
        check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=1)
        if weight.shape[0] != d:
            raise ValueError(f"weight: expected shape ({d},) to match x's last dim, got {tuple(weight.shape)}")
    check_same_device(x=x, gate=gate, weight=weight)
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps: expected a non-negative float, got {eps!r}")
    act = _canon_activation(activation)
    return _RMSNormGatedFn.apply(x, gate, weight, float(eps), act)

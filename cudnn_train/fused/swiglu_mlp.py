"""SwiGLU MLP: ``out = (silu(x w_gate^T) * (x w_up^T)) w_down^T``, with an explicit backward.

Shapes: x ``[..., H]``, w_gate and w_up ``[I, H]``, w_down ``[H, I]`` (nn.Linear layout),
out ``[..., H]``. With ``M`` the number of rows of x:

forward::

    gate = x @ w_gate^T                  [M, I]
    up   = x @ w_up^T                    [M, I]
    h    = silu(gate) * up               [M, I]   (the SwiGLU epilogue of the gate/up GEMM)
    out  = h @ w_down^T                  [M, H]

backward (``s = sigmoid(gate)``)::

    dh      = dout @ w_down              [M, I]
    dgate   = dh * up * s * (1 + gate * (1 - s))      (the dSwiGLU epilogue of the dh GEMM)
    dup     = dh * silu(gate)
    dx      = dgate @ w_gate + dup @ w_up
    dw_gate = dgate^T @ x,   dw_up = dup^T @ x,   dw_down = dout^T @ h

Saved for backward: x, gate, up and h (three ``[M, I]`` tensors, all written by the forward
anyway; eager PyTorch keeps four: gate, silu(gate), up and h), or only x with
``recompute=True`` (gate, up and h are recomputed in the backward by the gate/up GEMM).

Backends, in order: ``cutedsl`` (the SM90 GEMM of ``kernels/gemm_sm90.py`` with its SwiGLU and
dSwiGLU epilogues, below) then ``torch``. Forward and backward are separate
dispatch points (``swiglu_mlp`` and ``swiglu_mlp_bwd``). The torch backend multiplies in the
input dtype (float32 accumulation on every device torch supports) and does the elementwise
SwiGLU / dSwiGLU math in float32, rounding gate, up, h, dh, dgate and dup to the input dtype
where a kernel would store them. ``swiglu_mlp_ref`` is the float32 oracle.

Under ``torch.autocast`` the inputs are cast to the autocast dtype first, as ``F.linear`` does,
so an MLP with float32 master weights runs in bf16 inside an autocast region.
"""

from __future__ import annotations

import torch

from .. import backend
from .._validate import FLOAT_DTYPES, check_same_device, check_tensor, compute_dtype

__all__ = ["swiglu", "swiglu_mlp", "swiglu_mlp_ref"]

fwd_op = backend.Op("swiglu_mlp", ["cutedsl", "torch"])
bwd_op = backend.Op("swiglu_mlp_bwd", ["cutedsl", "torch"])

# ---------------------------------------------------------------- elementwise helpers


def _swiglu_math(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in the compute dtype of gate (float32, or float64 for float64)."""
    ct = compute_dtype(gate)
    g, u = gate.to(ct), up.to(ct)
    return g * torch.sigmoid(g) * u


def _dswiglu_math(dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgate, dup, h) in the compute dtype, from dh and the saved gate / up."""
    ct = compute_dtype(gate)
    d, g, u = dh.to(ct), gate.to(ct), up.to(ct)
    s = torch.sigmoid(g)
    silu = g * s
    dgate = d * u * s * (1.0 + g * (1.0 - s))
    dup = d * silu
    return dgate, dup, silu * u


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Elementwise ``silu(gate) * up`` in float32 math, output in gate's dtype (differentiable)."""
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES)
    check_tensor("up", up, dtypes=FLOAT_DTYPES)
    if up.shape != gate.shape:
        raise ValueError(f"up: expected the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.dtype != gate.dtype:
        raise ValueError(f"up: expected gate's dtype {gate.dtype}, got {up.dtype}")
    check_same_device(gate=gate, up=up)
    return _swiglu_math(gate, up).to(gate.dtype)


# ---------------------------------------------------------------- reference


def swiglu_mlp_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The oracle: float32 math (float64 if x is float64), output in x's dtype; autograd gives its gradients."""
    ct = compute_dtype(x)
    xf = x.to(ct)
    gate = xf @ w_gate.to(ct).t()
    up = xf @ w_up.to(ct).t()
    h = torch.nn.functional.silu(gate) * up
    return (h @ w_down.to(ct).t()).to(x.dtype)


# ---------------------------------------------------------------- torch backend


def _torch_fwd(x2, wg, wu, wd, store_gate_up: bool):
    gate = x2 @ wg.t()
    up = x2 @ wu.t()
    h = _swiglu_math(gate, up).to(x2.dtype)
    out = h @ wd.t()
    if not store_gate_up:  # distinct placeholders: custom-op outputs may not alias
        gate, up, h = x2.new_empty(0), x2.new_empty(0), x2.new_empty(0)
    return out, gate, up, h


def _torch_bwd(dout2, x2, wg, wu, wd, gate, up, h):
    if gate is None:  # recompute=True: only x was saved
        gate = x2 @ wg.t()
        up = x2 @ wu.t()
    dh = dout2 @ wd
    dgate, dup, h_ = _dswiglu_math(dh, gate, up)
    dt = x2.dtype
    dgate, dup = dgate.to(dt), dup.to(dt)
    h = h_.to(dt) if h is None else h
    dx = dgate @ wg
    dx.addmm_(dup, wu)
    dwg = dgate.t() @ x2
    dwu = dup.t() @ x2
    dwd = dout2.t() @ h
    return dx, dwg, dwu, dwd


@fwd_op.register("torch")
def _fwd_torch(x2, wg, wu, wd, store_gate_up):
    return _torch_fwd(x2, wg, wu, wd, store_gate_up)


@bwd_op.register("torch")
def _bwd_torch(dout2, x2, wg, wu, wd, gate, up, h):
    return _torch_bwd(dout2, x2, wg, wu, wd, gate, up, h)


# ---------------------------------------------------------------- cutedsl backend (SM90 GEMM)
#
# forward:  h, gate, up = gemm_swiglu(x, wg^T, wu^T)        gate/up stored only when saved
#           out = gemm(h, wd^T)
# backward: gate, up recomputed by gemm_swiglu when only x was saved
#           dgate, dup = gemm_dswiglu(dout, wd, gate, up)   dh never reaches memory
#           h saved by the forward, or recomputed with gate and up by gemm_swiglu
#           dgate | dup written side by side into one [M, 2I] buffer when I is a multiple of 64:
#             dx = [dgate | dup] @ [wg; wu]   (one GEMM, wu continues wg along K: b_tail)
#             [dwg; dwu] = [dgate | dup]^T @ x  (one GEMM, column-major A)
#           else: dx = dgate @ wg, then += dup @ wu (accumulating epilogue, beta = 1),
#             dwg = dgate^T @ x, dwu = dup^T @ x
#           dwd = dout^T @ h (column-major A, no copies)
# Every GEMM is checked with ``can_implement`` before anything is written, so a decline
# (no SM90 GPU, a dim not a multiple of 8 -- M included, as the wgrad GEMMs reduce over M --
# misaligned operands) hands the whole call to the torch backend untouched.


def _gemm():
    from ..kernels import gemm_sm90

    return gemm_sm90


def _check_device_cutedsl(x2) -> None:
    if not x2.is_cuda:  # said first: on a CPU the dtype is not the reason
        raise backend.Unsupported("no GPU" if not torch.cuda.is_available() else f"tensors on {x2.device}")


def _check_weights_cutedsl(g, x2, wg, wu, wd) -> None:
    m, i = x2.shape[0], wg.shape[0]
    probe_i = x2.new_empty(0, i)  # stands for h / dgate / dup ([M, I], row-major, ours)
    g.can_implement(probe_i, wd.t())  # out = h @ wd^T
    g.can_implement(probe_i, wg)  # dx = dgate @ wg (and dup @ wu)
    g.can_implement(probe_i, wu)
    if m == 0:
        raise backend.Unsupported("M == 0")


@fwd_op.register("cutedsl")
def _fwd_cutedsl(x2, wg, wu, wd, store_gate_up):
    _check_device_cutedsl(x2)
    g = _gemm()
    g.can_implement(x2, wg.t(), epilogue="swiglu", b_up=wu.t(), store_preact=store_gate_up)
    _check_weights_cutedsl(g, x2, wg, wu, wd)
    if store_gate_up:
        h, gate, up = g.gemm_swiglu(x2, wg.t(), wu.t(), store_preact=True)
    else:
        h = g.gemm_swiglu(x2, wg.t(), wu.t())
    out = g.gemm(h, wd.t())
    if not store_gate_up:
        gate, up, h = x2.new_empty(0), x2.new_empty(0), x2.new_empty(0)
    return backend.Served((out, gate, up, h), "sm90")


@bwd_op.register("cutedsl")
def _bwd_cutedsl(dout2, x2, wg, wu, wd, gate, up, h):
    _check_device_cutedsl(x2)
    g = _gemm()
    recompute = gate is None
    g.can_implement(x2, wg.t(), epilogue="swiglu", b_up=wu.t(), store_preact=True)
    _check_weights_cutedsl(g, x2, wg, wu, wd)
    if recompute:
        g.can_implement(dout2, wd)
    else:
        g.can_implement(dout2, wd, epilogue="dswiglu", gate=gate, up=up)
    g.can_implement(dout2.t(), x2)  # wgrad: [I or H, M] column-major A times x / h, K = M
    if recompute:
        h, gate, up = g.gemm_swiglu(x2, wg.t(), wu.t(), store_preact=True)
    elif h is None:  # a forward that did not keep h (not ours)
        h = _swiglu_math(gate, up).to(x2.dtype)
    m, i = x2.shape[0], wg.shape[0]
    if _stacked_grads(g, x2, wg, wu):
        # dgate | dup side by side in one [M, 2I] buffer: dx is one GEMM over K = 2I (w_up continues
        # w_gate along K) and both weight gradients one [2I, H] GEMM
        dgu = x2.new_empty(m, 2 * i)
        g.gemm_dswiglu(dout2, wd, gate, up, out_dgate=dgu[:, :i], out_dup=dgu[:, i:])
        dx = g.gemm(dgu, wg, b_tail=wu)
        dwgu = g.gemm(dgu.t(), x2)
        dwg, dwu = dwgu[:i], dwgu[i:]
    else:
        dgate, dup = g.gemm_dswiglu(dout2, wd, gate, up)
        dx = g.gemm(dgate, wg)
        g.gemm(dup, wu, out=dx, beta=1.0)
        dwg = g.gemm(dgate.t(), x2)
        dwu = g.gemm(dup.t(), x2)
    dwd = g.gemm(dout2.t(), h)
    return backend.Served((dx, dwg, dwu, dwd), "sm90")


def _stacked_grads(g, x2, wg, wu) -> bool:
    """Whether the backward can keep dgate and dup in one [M, 2I] buffer: I a multiple of the GEMM's
    k-block (so a k-block never spans w_gate and w_up) and the [2I, M] wgrad operand within 32-bit
    indexing. Otherwise two dx GEMMs (the second accumulating) and two wgrad GEMMs."""
    m, i = x2.shape[0], wg.shape[0]
    if i % g.BK or 2 * i * m > 2**31 - 1:
        return False
    try:
        g.can_implement(x2.new_empty(0, 2 * i), wg, b_tail=wu)
    except backend.Unsupported:
        return False
    return True


# ---------------------------------------------------------------- custom ops (torch.compile)


@torch.library.custom_op("cudnn_train::swiglu_mlp_fwd", mutates_args=())
def _fwd_custom(
    x2: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, store_gate_up: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out, gate, up, h = fwd_op(x2, wg, wu, wd, store_gate_up)
    return out, gate, up, h


@_fwd_custom.register_fake
def _(x2, wg, wu, wd, store_gate_up):
    m, i = x2.shape[0], wg.shape[0]
    out = x2.new_empty(m, wd.shape[0])
    if store_gate_up:
        return out, x2.new_empty(m, i), x2.new_empty(m, i), x2.new_empty(m, i)
    return out, x2.new_empty(0), x2.new_empty(0), x2.new_empty(0)


@torch.library.custom_op("cudnn_train::swiglu_mlp_bwd", mutates_args=())
def _bwd_custom(
    dout2: torch.Tensor,
    x2: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    gate: torch.Tensor | None,
    up: torch.Tensor | None,
    h: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dwg, dwu, dwd = bwd_op(dout2, x2, wg, wu, wd, gate, up, h)
    return dx, dwg, dwu, dwd


@_bwd_custom.register_fake
def _(dout2, x2, wg, wu, wd, gate, up, h):
    return torch.empty_like(x2), torch.empty_like(wg), torch.empty_like(wu), torch.empty_like(wd)


# ---------------------------------------------------------------- autograd


class _SwiGLUMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, wg, wu, wd, recompute):
        store = not recompute
        if torch.compiler.is_compiling():
            out, gate, up, h = _fwd_custom(x2, wg, wu, wd, store)
        else:  # eager: skip the custom-op dispatcher (tens of microseconds)
            out, gate, up, h = fwd_op(x2, wg, wu, wd, store)
        if recompute:
            ctx.save_for_backward(x2, wg, wu, wd)
        else:
            ctx.save_for_backward(x2, wg, wu, wd, gate, up, h)
        ctx.recompute = recompute
        return out

    @staticmethod
    def backward(ctx, dout):
        if ctx.recompute:
            x2, wg, wu, wd = ctx.saved_tensors
            gate = up = h = None
        else:
            x2, wg, wu, wd, gate, up, h = ctx.saved_tensors
        dout = dout.contiguous()
        if torch.compiler.is_compiling():
            dx, dwg, dwu, dwd = _bwd_custom(dout, x2, wg, wu, wd, gate, up, h)
        else:
            dx, dwg, dwu, dwd = bwd_op(dout, x2, wg, wu, wd, gate, up, h)
        return dx, dwg, dwu, dwd, None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        return None
    return None


def swiglu_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    recompute: bool = False,
) -> torch.Tensor:
    """``(silu(x w_gate^T) * (x w_up^T)) w_down^T``; x ``[..., H]``, w_gate/w_up ``[I, H]``, w_down ``[H, I]``.

    ``recompute=True`` saves only x for the backward and recomputes gate and up there.
    All four tensors must share one dtype and device (under ``torch.autocast`` they are
    cast to the autocast dtype first). Returns a tensor of x's shape and dtype.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, min_ndim=1)
    check_tensor("w_gate", w_gate, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("w_up", w_up, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("w_down", w_down, dtypes=FLOAT_DTYPES, ndim=2)
    h = x.shape[-1]
    i = w_gate.shape[0]
    if h == 0:
        raise ValueError("x: the last dim (H) must be at least 1")
    if i == 0:
        raise ValueError("w_gate: the intermediate size (dim 0) must be at least 1")
    if w_gate.shape[1] != h:
        raise ValueError(f"w_gate: expected shape (I, {h}) to match x's last dim, got {tuple(w_gate.shape)}")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"w_up: expected the shape of w_gate {tuple(w_gate.shape)}, got {tuple(w_up.shape)}")
    if tuple(w_down.shape) != (h, i):
        raise ValueError(f"w_down: expected shape ({h}, {i}), got {tuple(w_down.shape)}")
    check_same_device(x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    if not isinstance(recompute, bool):
        raise ValueError(f"recompute: expected a bool, got {recompute!r}")
    ac = _autocast_dtype(x.device.type)
    if ac is not None:  # as F.linear under autocast: float64 is left alone
        x, w_gate, w_up, w_down = (t if t.dtype == torch.float64 else t.to(ac) for t in (x, w_gate, w_up, w_down))
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if t.dtype != x.dtype:
            raise ValueError(f"{name}: expected x's dtype {x.dtype}, got {t.dtype}")
    shape = x.shape
    x2 = x.reshape(-1, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = _SwiGLUMLPFn.apply(x2, w_gate, w_up, w_down, recompute)
    return out.view(*shape[:-1], h)

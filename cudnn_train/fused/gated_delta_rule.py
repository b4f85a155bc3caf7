"""Gated DeltaNet (GDN): the gated delta rule with FLA 0.6's interface.

Per sequence and value head ``hv`` (reading q/k head ``h = hv // (HV // H)``), with the
state ``S`` ``[K, V]`` in float32::

    S_t = exp(g_t) S_{t-1}                                  decay (g: log space, <= 0)
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T            delta-rule write
    o_t = scale * S_t^T q_t

This is token for token what FLA's ``naive_recurrent_gated_delta_rule`` computes.

Inputs (FLA 0.6 names and shapes)::

    q, k            [B, T, H, K]       K <= 256
    v               [B, T, HV, V]      HV % H == 0 (GVA when HV > H)
    g, beta         [B, T, HV]
    initial_state   [N, HV, K, V]      ([N, HV, V, K] with state_v_first), any float dtype
    cu_seqlens      [N + 1]            int32/int64, B == 1 (packed sequences); else N == B
    A_log, dt_bias  [HV]               with use_gate_in_kernel

In-kernel flags (all applied in float32 before the recurrence):

* ``use_qk_l2norm_in_kernel``: ``x / sqrt(sum(x**2) + 1e-6)`` on q and k.
* ``use_gate_in_kernel``: ``g`` is the raw input; the decay is
  ``-exp(A_log) * softplus(g + dt_bias)`` (``dt_bias`` optional; softplus is linear above 20).
* ``use_beta_sigmoid_in_kernel``: ``beta`` holds logits; the op uses ``sigmoid(beta)``,
  or ``2 * sigmoid(beta)`` with ``allow_neg_eigval`` (which, as in FLA, is a ValueError
  without the sigmoid flag).
* ``state_v_first``: initial and final states are ``[N, HV, V, K]`` (the transpose).

``scale`` defaults to ``K ** -0.5``. The output has q's dtype; the final state is float32
(float64 for float64 inputs) and None unless ``output_final_state``.

Backends (op ``chunk_gated_delta_rule``), in order:

* ``cutedsl``: the SM90 kernels (``kernels/gated_delta_rule_*_sm90.py``): calls without
  gradients (path ``cutedsl:sm90``) and with them (``cutedsl:sm90-train``: see
  ``kernels/gated_delta_rule_train_sm90.py``), except those the next backend is faster for: FLA
  when it would hand the call to FlashQLA; ``CUDNN_TRAIN_GDN_SM90_FWD`` / ``CUDNN_TRAIN_GDN_SM90_TRAIN``
  = 1 / 0 force it (``kernels/gated_delta_rule_fwd_sm90.cutedsl_backend``). A backend receives
  exactly the keyword arguments of :func:`_torch_backend` and returns ``(o, final_state)``
  carrying its own autograd.
* ``fla``: FLA's Triton ``chunk_gated_delta_rule`` (only for CUDA tensors, when ``fla``
  imports; declines float64, chunk sizes other than 16/32/64, non-float32 initial states,
  empty inputs).
* ``torch``: the chunked float32 implementation below (WY/UT form, autograd through
  it); runs on any device and dtype.

:func:`naive_gated_delta_rule_ref` is the readable token-by-token recurrence, the oracle
checked against FLA's naive function; :func:`fused_recurrent_gated_delta_rule` serves the
same math in recurrent form (FLA's inference path; op ``fused_recurrent_gated_delta_rule``).

Host synchronization: the values of ``cu_seqlens`` are checked (``cu[0] == 0``,
non-decreasing, ``cu[-1] == T``) when they are free to read: a CPU tensor, or a host copy
passed as ``cu_seqlens_cpu``. Otherwise (a CUDA tensor alone) the checks run in the
backend that reads the values anyway: the torch backend (which needs them to lay out the
sequences) and the fla backend (which copies them once and hands FLA the host copy, so
FLA does not copy again).
"""

from __future__ import annotations

import importlib
import math
import threading
from typing import Any

import torch
import torch.nn.functional as F

from .. import backend
from .._validate import FLOAT_DTYPES, check_same_device, check_tensor, compute_dtype

__all__ = [
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "naive_gated_delta_rule_ref",
    "gdn_gate",
    "L2NORM_EPS",
    "MAX_HEAD_DIM",
]

L2NORM_EPS = 1e-6  # inside the sqrt, as FLA's l2norm
MAX_HEAD_DIM = 256  # K limit of FLA's kernels (and of this op)
_INT_DTYPES = (torch.int32, torch.int64)

chunk_op = backend.Op("chunk_gated_delta_rule", ["cutedsl", "fla", "torch"])
recurrent_op = backend.Op("fused_recurrent_gated_delta_rule", ["cutedsl", "fla", "torch"])


# ====================================================================== shared helpers
# (kda.py imports these: one implementation of the checks, the flags and the two cores)


def _name(t: torch.dtype) -> str:
    return str(t).replace("torch.", "")


def cu_seqlens_values(cu_host: torch.Tensor, T: int, name: str = "cu_seqlens") -> list[int]:
    """Validate host-side cumulative lengths against the total length T; return them as ints."""
    vals = [int(x) for x in cu_host.tolist()]
    if vals[0] != 0:
        raise ValueError(f"{name}: the first entry must be 0, got {vals[0]}")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(f"{name}: must be non-decreasing, got {vals[i - 1]} then {vals[i]} at index {i}")
    if vals[-1] != T:
        raise ValueError(f"{name}: the last entry must equal the total length T={T}, got {vals[-1]}")
    return vals


def check_cu_seqlens(
    cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None, B: int, T: int, device: torch.device
) -> tuple[int | None, list[int] | None]:
    """Check the varlen arguments; return (N or None, the validated values if free to read)."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu: given without cu_seqlens")
        return None, None
    check_tensor("cu_seqlens", cu_seqlens, dtypes=_INT_DTYPES, ndim=1)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected [N + 1] offsets with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: is on {cu_seqlens.device} but q is on {device}")
    if B != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size B == 1, got B={B}")
    n = cu_seqlens.numel() - 1
    if cu_seqlens_cpu is not None:
        check_tensor("cu_seqlens_cpu", cu_seqlens_cpu, dtypes=_INT_DTYPES, ndim=1)
        if cu_seqlens_cpu.device.type != "cpu":
            raise ValueError(f"cu_seqlens_cpu: expected a CPU tensor, got one on {cu_seqlens_cpu.device}")
        if cu_seqlens_cpu.numel() != n + 1:
            raise ValueError(f"cu_seqlens_cpu: expected {n + 1} entries like cu_seqlens, got {cu_seqlens_cpu.numel()}")
        return n, cu_seqlens_values(cu_seqlens_cpu, T, "cu_seqlens_cpu")
    if cu_seqlens.device.type == "cpu":
        return n, cu_seqlens_values(cu_seqlens, T)
    return n, None  # a device tensor: checked by the backend that reads it (no sync here)


def host_cu_seqlens(cu_seqlens: torch.Tensor, cu_seqlens_cpu: torch.Tensor | None, T: int) -> list[int]:
    """The validated offsets as ints, copying from the device once if no host copy was given."""
    if cu_seqlens_cpu is not None:
        return cu_seqlens_values(cu_seqlens_cpu, T, "cu_seqlens_cpu")
    return cu_seqlens_values(cu_seqlens.cpu(), T)


def check_delta_inputs(
    q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first, chunk_size, g_shape_tail: str,
    g_required: bool = True,
) -> dict[str, Any]:
    """Shape, dtype and device checks common to GDN and KDA; ``g_shape_tail`` is "HV" or "HV,K"."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("k", k, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("v", v, dtypes=FLOAT_DTYPES, ndim=4)
    B, T, H, K = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: expected q's shape {tuple(q.shape)} [B, T, H, K], got {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise ValueError(f"k: dtype {_name(k.dtype)} differs from q's {_name(q.dtype)}")
    if v.dtype != q.dtype:
        raise ValueError(f"v: dtype {_name(v.dtype)} differs from q's {_name(q.dtype)}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v: expected [B, T, HV, V] with B={B}, T={T}, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or K == 0 or V == 0:
        raise ValueError(f"q: heads and head dims must be >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    if HV % H != 0:
        raise ValueError(f"v: its HV={HV} value heads must be a multiple of the H={H} q/k heads (GVA)")
    if K > MAX_HEAD_DIM:
        raise ValueError(f"q: head dim K={K} exceeds the supported {MAX_HEAD_DIM}")
    want_g = (B, T, HV) if g_shape_tail == "HV" else (B, T, HV, K)
    if g is not None or g_required:
        check_tensor("g", g, dtypes=FLOAT_DTYPES)
        if tuple(g.shape) != want_g:
            raise ValueError(f"g: expected shape {want_g} [B, T, {g_shape_tail}], got {tuple(g.shape)}")
    check_tensor("beta", beta, dtypes=FLOAT_DTYPES)
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta: expected shape {(B, T, HV)} [B, T, HV], got {tuple(beta.shape)}")
    device = check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    if not (isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size >= 1):
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    n, cu_vals = check_cu_seqlens(cu_seqlens, cu_seqlens_cpu, B, T, device)
    N = B if n is None else n
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=FLOAT_DTYPES, ndim=4)
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            if initial_state.shape[0] != N:
                per = "sequence in cu_seqlens" if n is not None else "batch row"
                raise ValueError(
                    f"initial_state: expected N={N} states (one per {per}), got shape {tuple(initial_state.shape)}"
                )
            layout = "[N, HV, V, K] (state_v_first=True)" if state_v_first else "[N, HV, K, V] (state_v_first=False)"
            raise ValueError(
                f"initial_state: expected shape {want} in the {layout} layout, got {tuple(initial_state.shape)}"
            )
    return dict(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, cu_vals=cu_vals, device=device)


def check_param(name: str, t: torch.Tensor | None, numel: int, device: torch.device, what: str) -> None:
    """A per-head parameter (A_log, dt_bias): a float tensor of ``numel`` elements on ``device``."""
    if t is None:
        return
    check_tensor(name, t, dtypes=FLOAT_DTYPES)
    if t.numel() != numel:
        raise ValueError(f"{name}: expected {numel} elements ({what}), got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name}: is on {t.device} but q is on {device}")


def check_scale(scale: float | None, K: int) -> float:
    if scale is None:
        return K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite float or None, got {scale!r}")
    return float(scale)


def check_beta_flags(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval: requires use_beta_sigmoid_in_kernel=True (it doubles sigmoid(beta))")


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x**2, -1) + eps)`` (FLA's l2norm; eps inside the sqrt)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """The gradient of :func:`l2norm` at ``x`` for ``dy``: with ``r = 1 / sqrt(sum(x**2) + eps)`` and
    ``y = x r``, ``dx = r (dy - y sum(y * dy))`` (row-wise over the last dim; linear in ``dy``)."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * r
    return r * (dy - y * (y * dy).sum(-1, keepdim=True))


def beta_in_kernel(beta: torch.Tensor, ct: torch.dtype, sigmoid: bool, neg_eigval: bool) -> torch.Tensor:
    """beta as the recurrence uses it: as given, or ``sigmoid`` (doubled with allow_neg_eigval)."""
    b = beta.to(ct)
    if sigmoid:
        b = torch.sigmoid(b)
        if neg_eigval:
            b = 2.0 * b
    return b


def gdn_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GDN decay from the raw gate input: ``-exp(A_log) * softplus(g + dt_bias)``, float32.

    g ``[..., HV]``; A_log and dt_bias ``[HV]``. float64 in, float64 out.
    """
    ct = compute_dtype(g)
    x = g.to(ct)
    if dt_bias is not None:
        x = x + dt_bias.reshape(-1).to(ct)
    return -torch.exp(A_log.reshape(-1).to(ct)) * F.softplus(x)


def prepare_qkv(q, k, v, beta, initial_state, *, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                allow_neg_eigval, state_v_first):
    """float32 (float64) q, k expanded to the value heads, v, beta, and the K-first initial state."""
    ct = compute_dtype(q)
    qf, kf = q.to(ct), k.to(ct)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    G = v.shape[2] // q.shape[2]
    if G > 1:  # value head hv reads q/k head hv // G
        qf = qf.repeat_interleave(G, dim=2)
        kf = kf.repeat_interleave(G, dim=2)
    bf = beta_in_kernel(beta, ct, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    h0 = None
    if initial_state is not None:
        h0 = initial_state.to(ct)
        if state_v_first:
            h0 = h0.transpose(-1, -2)
    return qf, kf, v.to(ct), bf, h0


# ---------------------------------------------------------------------- the two cores


def recurrent_core(q, k, v, gk, beta, scale, S):
    """Token-by-token recurrence over [B, T, HV, *] float tensors (the readable oracle form).

    gk: log decay ``[B, T, HV, 1]`` (one per head, GDN) or ``[B, T, HV, K]`` (per key
    channel, KDA) or None (no decay); beta ``[B, T, HV]``; S ``[B, HV, K, V]`` K-first.
    Returns o ``[B, T, HV, V]`` and the final state.
    """
    outs = []
    for t in range(q.shape[1]):
        if gk is not None:
            S = S * torch.exp(gk[:, t]).unsqueeze(-1)  # [B, HV, K or 1, 1]
        k_t = k[:, t]  # [B, HV, K]
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)  # S^T k
        delta = beta[:, t].unsqueeze(-1) * (v[:, t] - pred)  # [B, HV, V]
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    if not outs:
        return v.new_zeros(v.shape), S
    return torch.stack(outs, dim=1), S


def _pair_decay_scalar(a, b, gc, strict):
    """``M_ij = (a_i . b_j) exp(gc_i - gc_j)`` for j <= i (j < i if strict), 0 above; gc [..., C, 1]."""
    C = a.shape[-2]
    keep = torch.ones(C, C, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    diff = gc - gc.transpose(-1, -2)  # [..., C, C]
    decay = torch.exp(diff.masked_fill(~keep, -math.inf)).to(a.dtype)
    return (a @ b.transpose(-1, -2)) * decay


def _pair_decay_vector(a, b, gc, strict, sub=16):
    """``M_ij = sum_d a_id b_jd exp(gc_id - gc_jd)`` for j <= i (j < i if strict); gc [..., C, K].

    Never forms a growing exponential: blocks of ``sub`` rows below the diagonal use the
    last gate row r of the column block as reference, ``(a_i e^(gc_i - r)) . (b_j e^(r - gc_j))``
    with both exponents <= 0; the diagonal blocks take the exact pairwise difference.
    """
    C, K = a.shape[-2], a.shape[-1]
    if C % sub != 0 or C <= sub:
        sub = C
    nb = C // sub
    lead = a.shape[:-2]
    ab, bb, gb = (x.reshape(*lead, nb, sub, K) for x in (a, b, gc))
    keep = torch.ones(sub, sub, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    diff = gb.unsqueeze(-2) - gb.unsqueeze(-3)  # [..., nb, i, j, K]
    decay = torch.exp(diff.masked_fill(~keep[:, :, None], -math.inf)).to(a.dtype)
    diag = torch.einsum("...nik,...njk,...nijk->...nij", ab, bb, decay)  # [..., nb, sub, sub]
    cols = []
    for J in range(nb):
        parts = []
        if J > 0:
            parts.append(a.new_zeros(*lead, J * sub, sub))
        parts.append(diag[..., J, :, :])
        if J < nb - 1:
            lo, hi = J * sub, (J + 1) * sub
            r = gc[..., hi - 1 : hi, :]  # the last gate row of column block J
            left = a[..., hi:, :] * torch.exp(gc[..., hi:, :] - r).to(a.dtype)
            right = b[..., lo:hi, :] * torch.exp(r - gc[..., lo:hi, :]).to(a.dtype)
            parts.append(left @ right.transpose(-1, -2))
        cols.append(torch.cat(parts, dim=-2) if len(parts) > 1 else parts[0])
    return torch.cat(cols, dim=-1) if nb > 1 else cols[0]


def chunked_core(q, k, v, g, beta, scale, S, chunk_size):
    """The chunked (WY/UT) form of :func:`recurrent_core`, vectorized over batch, heads, chunks.

    Same arguments (gk here ``g``: ``[B, T, HV, 1]`` or ``[B, T, HV, K]``). With ``gc`` the
    in-chunk cumulative log decay, per chunk of C tokens starting from the state S::

        A  = strictly_lower(beta_i M(k, k)_ij)          M_ij = sum_d k_id k_jd e^(gc_id - gc_jd)
        w  = (I + A)^-1 (beta e^gc k)     u = (I + A)^-1 (beta v)
        vn = u - w S                                     (the delta-rule innovations)
        o  = scale (q e^gc) S + scale lower(M(q, k)) vn  (diagonal kept)
        S' = e^(gc_C) S + (k e^(gc_C - gc))^T vn

    Only the state recurrence loops (over chunks); the tail is padded with zero tokens
    (beta = 0, g = 0), which leave the state unchanged.
    """
    B, T, HV, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    NC = -(-T // C)
    if NC == 0:
        return v.new_zeros(B, 0, HV, V), S
    pad = NC * C - T

    def chunks(x):  # [B, T, HV, D] -> [B, HV, NC, C, D]
        if pad:
            x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, NC, C, HV, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = chunks(beta.unsqueeze(-1))  # [B, HV, NC, C, 1]
    # The cumulative log decay and every difference of it are taken in float64: in float32
    # gc reaches hundreds within a chunk, and gc_i - gc_j (and the reverse cumsum of the
    # backward) would lose digits that the token-by-token recurrence keeps.
    gc = g.to(torch.float64).cumsum(dim=-2)
    if gc.shape[-1] == 1:
        A = _pair_decay_scalar(k, k, gc, strict=True)
        P = _pair_decay_scalar(q, k, gc, strict=False)
    else:
        A = _pair_decay_vector(k, k, gc, strict=True)
        P = _pair_decay_vector(q, k, gc, strict=False)
    A = beta * A  # row i scaled by beta_i
    eg = torch.exp(gc).to(q.dtype)
    rhs = torch.cat([beta * eg * k, beta * v], dim=-1)
    wu = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # (I + A) x = rhs
    w, u = wu[..., :K], wu[..., K:]
    qg = q * eg * scale
    P = P * scale
    glast = gc[..., -1:, :]  # [B, HV, NC, 1, Kg]
    kd = (k * torch.exp(glast - gc).to(q.dtype)).transpose(-1, -2)  # [B, HV, NC, K, C]
    dec = torch.exp(glast).to(q.dtype).transpose(-1, -2)  # [B, HV, NC, Kg, 1]
    starts, vns = [], []
    for c in range(NC):
        starts.append(S)
        vn = u[:, :, c] - w[:, :, c] @ S
        vns.append(vn)
        S = S * dec[:, :, c] + kd[:, :, c] @ vn
    Sc = torch.stack(starts, dim=2)  # [B, HV, NC, K, V]
    vn = torch.stack(vns, dim=2)  # [B, HV, NC, C, V]
    o = qg @ Sc + P @ vn
    o = o.permute(0, 2, 3, 1, 4).reshape(B, NC * C, HV, V)
    return o[:, :T], S


def run_delta_rule(qf, kf, vf, gf, bf, h0, *, scale, N, cu_vals, output_final_state, state_v_first,
                   out_dtype, chunk_size=None):
    """Drive a core over batch rows or packed sequences; chunk_size None = the recurrent core.

    All tensors are already float (``prepare_qkv``); gf is the log decay ``[B, T, HV, 1 or K]``
    or None. Returns ``(o in out_dtype, final state or None)`` in the caller's state layout.
    """
    B, T, HV, K = qf.shape
    V = vf.shape[-1]
    S0 = h0 if h0 is not None else qf.new_zeros(N, HV, K, V)

    def core(q, k, v, g, b, S):
        if chunk_size is None:
            return recurrent_core(q, k, v, g, b, scale, S)
        return chunked_core(q, k, v, g if g is not None else q.new_zeros(*q.shape[:3], 1), b, scale, S, chunk_size)

    if cu_vals is None:
        o, S = core(qf, kf, vf, gf, bf, S0)
    elif chunk_size is None:  # recurrent: one sequence at a time
        outs, finals = [], []
        for n in range(N):
            s, e = cu_vals[n], cu_vals[n + 1]
            sl = lambda x: None if x is None else x[:, s:e]  # noqa: E731
            o_n, S_n = core(sl(qf), sl(kf), sl(vf), sl(gf), sl(bf), S0[n : n + 1])
            outs.append(o_n)
            finals.append(S_n)
        o, S = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    else:  # chunked: lay the sequences out as N padded rows, run them as one batch
        lens = [cu_vals[n + 1] - cu_vals[n] for n in range(N)]
        L = max(lens)
        rows = torch.full((N, L), T, dtype=torch.long)  # index T: an appended zero token
        for n in range(N):
            rows[n, : lens[n]] = torch.arange(cu_vals[n], cu_vals[n + 1])
        rows = rows.to(qf.device).reshape(-1)

        def pad(x):
            if x is None:
                return None
            x = x[0]
            x = torch.cat([x, x.new_zeros(1, *x.shape[1:])], dim=0)
            return x.index_select(0, rows).reshape(N, L, *x.shape[1:])

        o_pad, S = core(pad(qf), pad(kf), pad(vf), pad(gf), pad(bf), S0)
        back = torch.cat([torch.arange(lens[n]) + n * L for n in range(N)]).to(qf.device)
        o = o_pad.reshape(N * L, HV, V).index_select(0, back).unsqueeze(0)
    final = None
    if output_final_state:
        final = S.transpose(-1, -2).contiguous() if state_v_first else S
    return o.to(out_dtype), final


# ---------------------------------------------------------------------- FLA peer


_fla_guard = threading.local()


def fla_original(module: str, attr: str):
    """FLA's own function ``module.attr``; Unsupported if FLA does not import.

    When ``cudnn_train.accelerate_fla`` has rebound the attribute, its wrapper carries
    FLA's function as ``_cudnn_train_original``, which is what this returns.
    """
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or triton failing to initialise
        raise backend.Unsupported(f"fla does not import ({type(e).__name__})") from None
    fn = getattr(mod, attr, None)
    if fn is None:
        raise backend.Unsupported(f"fla has no {module}.{attr}")
    return getattr(fn, "_cudnn_train_original", fn)


def call_fla(fn, **kwargs):
    """Call an FLA function, refusing re-entry (a patched FLA attribute calling back into us)."""
    if getattr(_fla_guard, "active", False):
        raise RuntimeError(
            "fla backend re-entered: FLA's function is patched to cudnn_train without "
            "`_cudnn_train_original` pointing at FLA's own function"
        )
    _fla_guard.active = True
    try:
        return fn(**kwargs)
    finally:
        _fla_guard.active = False


def fla_argument_declines(q, initial_state, chunk_sizes, chunk_size):
    """The FLA chunk backends' declines that depend on the arguments alone (no device, no host read)."""
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise backend.Unsupported(f"dtype {_name(q.dtype)}")
    if chunk_size not in chunk_sizes:
        raise backend.Unsupported(f"chunk_size={chunk_size}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise backend.Unsupported(f"initial_state dtype {_name(initial_state.dtype)}")
    if q.shape[1] == 0:
        raise backend.Unsupported("empty input")


def fla_common_declines(q, initial_state, cu_seqlens, cu_seqlens_cpu, chunk_sizes, chunk_size):
    """Decline reasons shared by the FLA chunk backends; returns the host offsets for FLA."""
    if q.device.type != "cuda":
        raise backend.Unsupported("no GPU")
    fla_argument_declines(q, initial_state, chunk_sizes, chunk_size)
    if cu_seqlens is not None:
        return torch.tensor(host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.shape[1]), dtype=torch.long)
    return None


# ====================================================================== GDN


def _gdn_log_decay(g, A_log, dt_bias, use_gate_in_kernel, ct):
    if g is None:
        return None
    x = gdn_gate(g.to(ct), A_log, dt_bias) if use_gate_in_kernel else g.to(ct)
    return x.unsqueeze(-1)  # [B, T, HV, 1]


def _check_gdn(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
               use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, chunk_size, cu_seqlens_cpu,
               g_required=True):
    info = check_delta_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first,
                              chunk_size, "HV", g_required)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError("A_log: required with use_gate_in_kernel=True")
        if g is None:
            raise ValueError("g: the raw gate input is required with use_gate_in_kernel=True")
        check_param("A_log", A_log, info["HV"], info["device"], "one per value head")
        check_param("dt_bias", dt_bias, info["HV"], info["device"], "one per value head")
    check_beta_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    info["scale"] = check_scale(scale, info["K"])
    return info


def delta_torch_math(q, k, v, beta, initial_state, log_decay, *, scale, output_final_state,
                     use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                     cu_seqlens, cu_seqlens_cpu, chunk_size):
    """The torch math shared by GDN and KDA: prepare q/k/v/beta/state, then run a core
    (``chunk_size`` None = the recurrent oracle). ``log_decay(ct)`` gives the float log decay
    ``[B, T, HV, 1 or K]`` (or None) in the compute dtype ``ct``: the one place the ops differ."""
    T, N = q.shape[1], (q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1)
    cu_vals = None if cu_seqlens is None else host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    qf, kf, vf, bf, h0 = prepare_qkv(
        q, k, v, beta, initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
    )
    return run_delta_rule(qf, kf, vf, log_decay(qf.dtype), bf, h0, scale=scale, N=N, cu_vals=cu_vals,
                          output_final_state=output_final_state, state_v_first=state_v_first,
                          out_dtype=q.dtype, chunk_size=chunk_size)


def _gdn_torch_math(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                    state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_size):
    return delta_torch_math(
        q, k, v, beta, initial_state, lambda ct: _gdn_log_decay(g, A_log, dt_bias, use_gate_in_kernel, ct),
        scale=scale, output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size,
    )


def naive_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The oracle: the token-by-token recurrence in float32 (float64 for float64 inputs).

    Same arguments and result as :func:`chunk_gated_delta_rule`; differentiable.
    """
    info = _check_gdn(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, 64, None)
    return _gdn_torch_math(q, k, v, g, beta, info["scale"], initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval, state_v_first, cu_seqlens, None, chunk_size=None)


@chunk_op.register("torch")
def _torch_backend(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                   cu_seqlens, chunk_size, cu_seqlens_cpu):
    return _gdn_torch_math(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                           state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_size=chunk_size)


FLA_CHUNK_SIZES = (16, 32, 64)  # the chunk sizes FLA's GDN kernels take


@chunk_op.register("fla")
def _fla_backend(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                 cu_seqlens, chunk_size, cu_seqlens_cpu):
    cu_cpu = fla_common_declines(q, initial_state, cu_seqlens, cu_seqlens_cpu, FLA_CHUNK_SIZES, chunk_size)
    fn = fla_original("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule")
    extra = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias) if use_gate_in_kernel else {}
    return call_fla(
        fn, q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_cpu, chunk_size=chunk_size, **extra,
    )


@chunk_op.register("cutedsl")
def _cutedsl_backend(q, k, v, g, beta, **kw):
    """The SM90 kernels, inference and training, unless the next backend is faster for the call
    (``kernels.gated_delta_rule_fwd_sm90.cutedsl_backend``); then the call declines to it."""
    from ..kernels import gated_delta_rule_fwd_sm90 as k90

    return k90.cutedsl_backend(q, k, v, g, beta, **kw)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule, chunked; FLA 0.6's ``chunk_gated_delta_rule`` semantics (module docstring).

    Returns ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] float32 or None)``.
    ``cu_seqlens_cpu`` (keyword-only, as in FLA) is an optional host copy of ``cu_seqlens``
    that spares a device-to-host copy; it must hold the same values.
    Gradients flow to q, k, v, g, beta, initial_state, A_log and dt_bias.
    """
    info = _check_gdn(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, chunk_size,
                      cu_seqlens_cpu)
    if not use_gate_in_kernel:
        A_log, dt_bias = None, None  # ignored, as in FLA
    return chunk_op(
        q, k, v, g, beta, scale=info["scale"], initial_state=initial_state,
        output_final_state=bool(output_final_state), use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel), A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel), allow_neg_eigval=bool(allow_neg_eigval),
        state_v_first=bool(state_v_first), cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )


# ====================================================================== recurrent form


def _recurrent_decay(g, gk, A_log, dt_bias, use_gate_in_kernel, ct):
    parts = []
    if g is not None:
        parts.append(_gdn_log_decay(g, A_log, dt_bias, use_gate_in_kernel, ct))
    if gk is not None:
        parts.append(gk.to(ct))
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


@recurrent_op.register("torch")
def _recurrent_torch(q, k, v, g, gk, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                     cu_seqlens, cu_seqlens_cpu):
    T, N = q.shape[1], (q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1)
    cu_vals = None if cu_seqlens is None else host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, T)
    qf, kf, vf, bf, h0 = prepare_qkv(
        q, k, v, beta, initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first,
    )
    gf = _recurrent_decay(g, gk, A_log, dt_bias, use_gate_in_kernel, qf.dtype)
    return run_delta_rule(qf, kf, vf, gf, bf, h0, scale=scale, N=N, cu_vals=cu_vals,
                          output_final_state=output_final_state, state_v_first=state_v_first,
                          out_dtype=q.dtype, chunk_size=None)


def needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@recurrent_op.register("fla")
def _recurrent_fla(q, k, v, g, gk, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                   cu_seqlens, cu_seqlens_cpu):
    if q.device.type != "cuda":
        raise backend.Unsupported("no GPU")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise backend.Unsupported(f"dtype {_name(q.dtype)}")
    if needs_grad(q, k, v, g, gk, beta, initial_state, A_log, dt_bias):
        raise backend.Unsupported("FLA's fused_recurrent has no backward")
    if q.shape[1] == 0:
        raise backend.Unsupported("empty input")
    if cu_seqlens is not None:
        host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.shape[1])  # FLA does not check the values
    fn = fla_original("fla.ops.gated_delta_rule.fused_recurrent", "fused_recurrent_gated_delta_rule")
    return call_fla(
        fn, q=q, k=k, v=v, g=g, gk=gk, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens,
    )


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule in recurrent form (FLA 0.6's ``fused_recurrent_gated_delta_rule``).

    Same math as :func:`chunk_gated_delta_rule`, one token at a time (the inference path
    of FLA's layers). ``g`` ``[B, T, HV]`` (raw with use_gate_in_kernel) and ``gk``
    ``[B, T, HV, K]`` (per key channel, log space) are optional and multiply; beta
    defaults to ones. ``gv`` (per value channel decay) is not supported here: ValueError.
    The torch backend is differentiable; FLA's kernel has no backward, so the fla backend
    only serves calls that need no gradient.
    """
    if gv is not None:
        raise ValueError("gv: per-value-channel decay is not supported by cudnn_train")
    if beta is None:
        check_tensor("v", v, dtypes=FLOAT_DTYPES, ndim=4)
        beta = v.new_ones(v.shape[:3])
    info = _check_gdn(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, 64, cu_seqlens_cpu,
                      g_required=False)
    if gk is not None:
        check_tensor("gk", gk, dtypes=FLOAT_DTYPES)
        want = (info["B"], info["T"], info["HV"], info["K"])
        if tuple(gk.shape) != want:
            raise ValueError(f"gk: expected shape {want} [B, T, HV, K], got {tuple(gk.shape)}")
        check_same_device(q=q, gk=gk)
    if not use_gate_in_kernel:
        A_log, dt_bias = None, None
    return recurrent_op(
        q, k, v, g, gk, beta, scale=info["scale"], initial_state=initial_state,
        output_final_state=bool(output_final_state), use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel), A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel), allow_neg_eigval=bool(allow_neg_eigval),
        state_v_first=bool(state_v_first), cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )

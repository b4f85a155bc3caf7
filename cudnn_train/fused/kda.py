"""Kimi Delta Attention (KDA): the delta rule with a per-key-channel gate, FLA 0.6's interface.

Per sequence and value head ``hv`` (reading q/k head ``hv // (HV // H)``), state ``S``
``[K, V]`` in float32::

    S_t = diag(exp(g_t)) S_{t-1}                            g_t [K]: log space, per key channel
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T
    o_t = scale * S_t^T q_t

token for token what FLA's ``naive_recurrent_kda`` computes. Shapes are GDN's
(:mod:`cudnn_train.fused.gated_delta_rule`) except ``g`` ``[B, T, HV, K]`` and, with
``use_gate_in_kernel``, ``A_log`` ``[HV]`` and ``dt_bias`` ``[HV * K]`` (viewed ``[HV, K]``).

The gate with ``use_gate_in_kernel`` (FLA 0.6's ``kda_gate_chunk_cumsum``):

* ``lower_bound`` None: ``-exp(A_log) * softplus(g + dt_bias)`` (A_log required);
* ``lower_bound`` set:  ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``, or
  ``lower_bound * sigmoid(g + dt_bias)`` when A_log is None; the decay then lies in
  ``(lower_bound, 0)``.

Without ``use_gate_in_kernel``, ``g`` is the log decay itself and ``lower_bound`` changes
nothing (as in FLA). ``safe_gate`` is accepted for FLA compatibility: it selects a faster
FLA kernel for bounded gates and does not change the math; as in FLA, with
``use_gate_in_kernel`` it requires ``lower_bound`` in ``[-5, 0)``. The l2norm, beta,
scale, state-layout and varlen conventions are GDN's.

Backends (op ``chunk_kda``), in order: ``cutedsl`` (kernels to come, registered with
``@chunk_op.register("cutedsl")``, same keyword arguments as :func:`_torch_backend`),
``fla`` (FLA's Triton ``chunk_kda``: CUDA tensors only; declines float64, chunk sizes
other than 32/64, non-float32 initial states, empty inputs) and ``torch`` (the chunked
float32 implementation shared with GDN, whose intra-chunk decay products never form a
growing exponential). :func:`naive_kda_ref` is the token-by-token oracle;
:func:`fused_recurrent_kda` the recurrent form (op ``fused_recurrent_kda``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import backend
from .._validate import compute_dtype
from .gated_delta_rule import (
    call_fla,
    check_beta_flags,
    check_delta_inputs,
    check_param,
    check_scale,
    delta_torch_math,
    fla_common_declines,
    fla_original,
    host_cu_seqlens,
    needs_grad,
)

__all__ = ["chunk_kda", "fused_recurrent_kda", "naive_kda_ref", "kda_gate"]

chunk_op = backend.Op("chunk_kda", ["cutedsl", "fla", "torch"])
recurrent_op = backend.Op("fused_recurrent_kda", ["cutedsl", "fla", "torch"])


def kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """The KDA log decay from the raw gate input ``g`` ``[..., HV, K]``, float32 (float64 in, out).

    ``-exp(A_log) * softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (A_log optional there).
    A_log ``[HV]``, dt_bias ``[HV * K]``.
    """
    ct = compute_dtype(g)
    HV, K = g.shape[-2], g.shape[-1]
    x = g.to(ct)
    if dt_bias is not None:
        x = x + dt_bias.reshape(HV, K).to(ct)
    if lower_bound is None:
        return -torch.exp(A_log.reshape(HV, 1).to(ct)) * F.softplus(x)
    if A_log is not None:
        x = torch.exp(A_log.reshape(HV, 1).to(ct)) * x
    return lower_bound * torch.sigmoid(x)


def _check_kda(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
               allow_neg_eigval, lower_bound, safe_gate, state_v_first, cu_seqlens, chunk_size, cu_seqlens_cpu):
    info = check_delta_inputs(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, state_v_first,
                              chunk_size, "HV,K")
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not math.isfinite(lower_bound):
            raise ValueError(f"lower_bound: expected a finite float or None, got {lower_bound!r}")
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("A_log: required with use_gate_in_kernel=True unless lower_bound is set")
        if safe_gate:
            if lower_bound is None:
                raise ValueError("lower_bound: required with safe_gate=True and use_gate_in_kernel=True")
            if not (-5 <= lower_bound < 0):
                raise ValueError(f"lower_bound: must be in [-5, 0) with safe_gate=True, got {lower_bound}")
        HV, K = info["HV"], info["K"]
        check_param("A_log", A_log, HV, info["device"], "one per value head")
        check_param("dt_bias", dt_bias, HV * K, info["device"], "HV * K, one per value head and key channel")
    check_beta_flags(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    info["scale"] = check_scale(scale, info["K"])
    return info


def _kda_torch_math(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                    state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_size):
    def log_decay(ct):
        return kda_gate(g.to(ct), A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.to(ct)

    return delta_torch_math(
        q, k, v, beta, initial_state, log_decay, scale=scale, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=chunk_size,
    )


def naive_kda_ref(
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
    lower_bound: float | None = None,
    safe_gate: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The oracle: the token-by-token KDA recurrence in float32 (float64 for float64 inputs).

    Same arguments and result as :func:`chunk_kda`; differentiable.
    """
    info = _check_kda(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, safe_gate, state_v_first, cu_seqlens,
                      64, None)
    return _kda_torch_math(q, k, v, g, beta, info["scale"], initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                           allow_neg_eigval, lower_bound, state_v_first, cu_seqlens, None, chunk_size=None)


@chunk_op.register("torch")
def _torch_backend(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                   safe_gate, state_v_first, cu_seqlens, chunk_size, cu_seqlens_cpu):
    return _kda_torch_math(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                           lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_size=chunk_size)


@chunk_op.register("fla")
def _fla_backend(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                 use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                 safe_gate, state_v_first, cu_seqlens, chunk_size, cu_seqlens_cpu):
    cu_cpu = fla_common_declines(q, initial_state, cu_seqlens, cu_seqlens_cpu, (32, 64), chunk_size)
    fn = fla_original("fla.ops.kda.chunk", "chunk_kda")
    return call_fla(
        fn, q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_cpu,
        A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size,
    )


def chunk_kda(
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
    lower_bound: float | None = None,
    safe_gate: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA, chunked; FLA 0.6's ``chunk_kda`` semantics (module docstring).

    Returns ``(o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] float32 or None)``.
    Gradients flow to q, k, v, g, beta, initial_state, A_log and dt_bias.
    """
    info = _check_kda(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, safe_gate, state_v_first, cu_seqlens,
                      chunk_size, cu_seqlens_cpu)
    if not use_gate_in_kernel:
        A_log, dt_bias = None, None  # ignored, as in FLA
    return chunk_op(
        q, k, v, g, beta, scale=info["scale"], initial_state=initial_state,
        output_final_state=bool(output_final_state), use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel), A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel), allow_neg_eigval=bool(allow_neg_eigval),
        lower_bound=None if lower_bound is None else float(lower_bound), safe_gate=bool(safe_gate),
        state_v_first=bool(state_v_first), cu_seqlens=cu_seqlens, chunk_size=chunk_size,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )


# ---------------------------------------------------------------------- recurrent form


@recurrent_op.register("torch")
def _recurrent_torch(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                     state_v_first, cu_seqlens, cu_seqlens_cpu):
    return _kda_torch_math(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                           use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                           lower_bound, state_v_first, cu_seqlens, cu_seqlens_cpu, chunk_size=None)


@recurrent_op.register("fla")
def _recurrent_fla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound,
                   state_v_first, cu_seqlens, cu_seqlens_cpu):
    if q.device.type != "cuda":
        raise backend.Unsupported("no GPU")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise backend.Unsupported(f"dtype {str(q.dtype).replace('torch.', '')}")
    if needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        raise backend.Unsupported("FLA's fused_recurrent_kda has no backward")
    if q.shape[1] == 0:
        raise backend.Unsupported("empty input")
    if cu_seqlens is not None:
        host_cu_seqlens(cu_seqlens, cu_seqlens_cpu, q.shape[1])  # FLA does not check the values
    fn = fla_original("fla.ops.kda.fused_recurrent", "fused_recurrent_kda")
    return call_fla(
        fn, q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
        cu_seqlens=cu_seqlens,
    )


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    cu_seqlens_cpu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA in recurrent form, FLA 0.6's ``fused_recurrent_kda`` (argument order included).

    Same math as :func:`chunk_kda`, one token at a time. The torch backend is
    differentiable; FLA's kernel has no backward, so the fla backend only serves calls
    that need no gradient. FLA's inference-only extras (``ssm_state_indices``,
    in-place states) are not offered.
    """
    info = _check_kda(q, k, v, g, beta, scale, initial_state, use_gate_in_kernel, A_log, dt_bias,
                      use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, False, state_v_first, cu_seqlens,
                      64, cu_seqlens_cpu)
    if not use_gate_in_kernel:
        A_log, dt_bias = None, None
    return recurrent_op(
        q, k, v, g, beta, scale=info["scale"], initial_state=initial_state,
        output_final_state=bool(output_final_state), use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        use_gate_in_kernel=bool(use_gate_in_kernel), A_log=A_log, dt_bias=dt_bias,
        use_beta_sigmoid_in_kernel=bool(use_beta_sigmoid_in_kernel), allow_neg_eigval=bool(allow_neg_eigval),
        lower_bound=None if lower_bound is None else float(lower_bound), state_v_first=bool(state_v_first),
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )

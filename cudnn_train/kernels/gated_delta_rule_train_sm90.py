"""Training path of the SM90 Gated DeltaNet kernels: forward and backward with autograd.

Forward: the two forward kernels (``gated_delta_rule_fwd_sm90``), the state kernel also
writing the state entering every chunk. Backward, the three stages of
``fused/delta_rule_bwd.py``:

1. nothing to recompute on the state side: the chunk-start states come from the forward;
2. the reverse state sweep kernel (``gated_delta_rule_bwd_sm90.reverse_sweep``): dvn, the
   gradient of the state leaving every chunk, and the initial state's gradient;
3. the per-chunk gradients on the stage-3 kernel (``gated_delta_rule_bwd_chunk_sm90``; with
   ``CUDNN_TRAIN_GDN_SM90_STAGE3=torch`` in torch, ``delta_rule_bwd.chunk_grads``: batched matrix
   products over every chunk at once, float32), dq and dk summed over each GVA group, then
   autograd through the op's own preprocessing (l2norm, the in-kernel gate, the beta sigmoid)
   at the q/k heads, recomputed from the inputs.

The chunk-start states (forward), dvn and dH (sweep) are kept in the input dtype: the stage-3
kernel reads them in that precision, as FLA's backward does.

No host read of ``cu_seqlens`` anywhere (the chunk maps are built on the device), so a varlen
forward+backward can be captured in a CUDA graph. No float atomics: deterministic.

Status: **opt-in** (``CUDNN_TRAIN_GDN_SM90_TRAIN=1``) until its GPU tier
(``tests/kernels/test_gated_delta_rule_train_sm90.py``) has passed on the H200 and it has been
timed against FLA; without the variable the cutedsl backend declines calls that need
gradients, as before. The composition is checked on the CPU with reference implementations
of the kernel steps (``tests/fused/test_gdn_train_path.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .._validate import compute_dtype
from ..backend import Unsupported, env_flag
from ..fused import delta_rule_bwd as db
from ..fused.gated_delta_rule import _gdn_log_decay, beta_in_kernel, l2norm

OPT_IN = "CUDNN_TRAIN_GDN_SM90_TRAIN"
STAGE3_ENV = "CUDNN_TRAIN_GDN_SM90_STAGE3"  # "kernel" (default) or "torch"
CHUNK = 64


def opted_in() -> bool:
    return env_flag(OPT_IN)


@dataclass(frozen=True)
class Config:
    scale: float
    output_final_state: bool
    l2norm: bool
    gate: bool
    beta_sigmoid: bool
    neg_eigval: bool
    state_v_first: bool


def kernel_forward(q, k, v, g, beta, A_log, dt_bias, h0, cu, cfg: Config):
    """``(o, final_state, saved)``: the forward kernels; ``saved = (w, gc, chunk_states)``, the
    chunk-start states in the input dtype."""
    from . import gated_delta_rule_fwd_sm90 as fwd

    o, ht, (w, _u, gc, hs) = fwd.forward(
        q, k, v, g, beta, scale=cfg.scale, initial_state=h0, output_final_state=cfg.output_final_state,
        use_qk_l2norm_in_kernel=cfg.l2norm, cu_seqlens=cu, use_gate_in_kernel=cfg.gate,
        A_log=A_log if cfg.gate else None, dt_bias=dt_bias if cfg.gate else None,
        use_beta_sigmoid_in_kernel=cfg.beta_sigmoid, allow_neg_eigval=cfg.neg_eigval,
        state_v_first=cfg.state_v_first, store_states=True,
    ).value
    return o, ht, (w, gc, hs)


def kernel_sweep(q, k, v, g, beta, A_log, dt_bias, saved, do, dht, cu, cfg: Config):
    """``(dvn [B, T, HV, V], dH [rows, HV, K, V], dh0)``: the reverse-sweep kernel; dvn and dH in
    the input dtype (what the stage-3 kernel reads), dh0 float32."""
    from . import gated_delta_rule_bwd_sm90 as bwd

    w, gc, _ = saved
    return bwd.reverse_sweep(q, k, w, gc, do.contiguous(), None if dht is None else dht.contiguous(),
                             scale=cfg.scale, use_qk_l2norm_in_kernel=cfg.l2norm, cu_seqlens=cu,
                             state_v_first=cfg.state_v_first, out_dtype=q.dtype)


# the kernel steps; the CPU tests put reference implementations of the same contracts here
IMPL = {"forward": kernel_forward, "sweep": kernel_sweep, "stage3": None}  # stage3 None: chosen by STAGE3_ENV


def prepared(q, k, v, g, beta, A_log, dt_bias, cfg: Config):
    """The op's preprocessing in float32 (float64 for float64 inputs), differentiable:
    ``(qf, kf, vf, gf [B, T, HV, 1], bf)`` with q, k at their own heads (l2-normalized when asked;
    value head hv reads head ``hv // (HV // H)``, see :func:`expand_heads`)."""
    ct = compute_dtype(q)
    qf, kf = q.to(ct), k.to(ct)
    if cfg.l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    bf = beta_in_kernel(beta, ct, cfg.beta_sigmoid, cfg.neg_eigval)
    gf = _gdn_log_decay(g, A_log, dt_bias, cfg.gate, ct)
    return qf, kf, v.to(ct), gf, bf


def expand_heads(x, HV: int):
    """``[B, T, H, D]`` -> ``[B, T, HV, D]``: value head hv gets head hv // (HV // H)."""
    G = HV // x.shape[2]
    return x if G == 1 else x.repeat_interleave(G, dim=2)


def stage3_torch(outs, inputs, saved, dH, dvn, do, cu, cfg: Config):
    """Stage 3 in torch over every chunk at once: gradients of the prepared ``outs``, dq and dk
    per value head."""
    B, T, HV = outs[2].shape[:3]
    ct = outs[0].dtype
    lay = db.ChunkLayout(B, T, CHUNK, cu)
    qf, kf = (expand_heads(x, HV) for x in outs[:2])
    qc, kc, vc, gc, doc = (lay.to_chunks(x) for x in (qf, kf, *outs[2:4], do.to(ct)))
    bc = lay.to_chunks(outs[4].unsqueeze(-1))
    r = db._recompute(qc, kc, vc, gc, bc, cfg.scale, CHUNK)
    Sc, dHc = lay.rows_to_chunks(saved[-1].to(ct)), lay.rows_to_chunks(dH.to(ct))
    dq, dk, dv, dg, dbeta = db.chunk_grads(qc, kc, vc, bc, Sc, dHc, lay.to_chunks(dvn.to(ct)), doc, r)
    return [lay.from_chunks(x) for x in (dq, dk, dv, dg)] + [lay.from_chunks(dbeta.unsqueeze(-1)).squeeze(-1)]


def stage3_kernel(outs, inputs, saved, dH, dvn, do, cu, cfg: Config):
    """Stage 3 on the SM90 kernel (``gated_delta_rule_bwd_chunk_sm90``): the prepared q, k in the
    input dtype at their own heads, the forward's in-chunk cumulative gate and chunk-start states,
    the sweep's dvn and dH."""
    from . import gated_delta_rule_bwd_chunk_sm90 as b3

    dt = inputs[0].dtype
    qn, kn = (x.to(dt).contiguous() for x in outs[:2])
    _w, gc, hs = saved
    dq, dk, dv, dg, dbeta = b3.chunk_grads(qn, kn, inputs[2], gc, outs[4].float().contiguous(), do.contiguous(), dvn,
                                           hs, dH, scale=cfg.scale, cu_seqlens=cu)
    return [dq, dk, dv, dg.unsqueeze(-1), dbeta]


def _stage3():
    return stage3_torch if os.environ.get(STAGE3_ENV, "kernel").strip() == "torch" else stage3_kernel


def input_grads(inputs, saved, dH, dvn, do, cu, cfg: Config):
    """Stage 3 and the preprocessing's backward: gradients of ``inputs = (q, k, v, g, beta,
    A_log, dt_bias)`` (None where an input is absent or needs none)."""
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
    with torch.enable_grad():
        outs = prepared(*leaves, cfg)
    with torch.no_grad():
        stage3 = IMPL.get("stage3") or _stage3()
        grads = stage3([o.detach() for o in outs], inputs, saved, dH, dvn, do, cu, cfg)
        H, HV = outs[0].shape[2], outs[2].shape[2]
        if HV != H:  # per value head -> per q/k head: the sum over each GVA group
            grads[:2] = [x.unflatten(2, (H, HV // H)).sum(3) for x in grads[:2]]
    pairs = [(o, d) for o, d in zip(outs, grads) if o.requires_grad]
    need = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad]
    res = [None] * len(inputs)
    if pairs and need:
        got = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in need], [d for _, d in pairs],
                                  allow_unused=True)
        for i, gr in zip(need, got):
            res[i] = gr
    return res


class _Train(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, h0, cu, cfg):
        o, ht, saved = IMPL["forward"](q, k, v, g, beta, A_log, dt_bias, h0, cu, cfg)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, h0, cu, *saved)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, A_log, dt_bias, h0, cu, *saved = ctx.saved_tensors
        cfg = ctx.cfg
        dvn, dH, dh0 = IMPL["sweep"](q, k, v, g, beta, A_log, dt_bias, saved, do, dht, cu, cfg)
        grads = input_grads((q, k, v, g, beta, A_log, dt_bias), saved, dH, dvn, do, cu, cfg)
        dh0 = dh0 if (h0 is not None and ctx.needs_input_grad[7]) else None
        return (*grads, dh0, None, None)


def train(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
          use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
          cu_seqlens):
    """``(o, final_state)`` with autograd; the caller has checked that the kernels serve the call."""
    cfg = Config(float(scale), bool(output_final_state), bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel),
                 bool(use_beta_sigmoid_in_kernel), bool(allow_neg_eigval), bool(state_v_first))
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    return _Train.apply(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, cfg)


def check_train_serve() -> None:
    """What the training path adds to the forward's declines (``check_serve``)."""
    if not opted_in():
        raise Unsupported(f"the SM90 GDN training path is opt-in until measured ({OPT_IN}=1)")

"""Training path of the SM90 Gated DeltaNet kernels: forward and backward with autograd.

Forward: the two forward kernels (``gated_delta_rule_fwd_sm90``), the state kernel also
writing the state entering every chunk. Backward, the three stages of
``fused/delta_rule_bwd.py``:

1. nothing to recompute on the state side: the chunk-start states come from the forward;
2. the reverse state sweep kernel (``gated_delta_rule_bwd_sm90.reverse_sweep``): dvn, the
   gradient of the state leaving every chunk, and the initial state's gradient;
3. the per-chunk gradients, for now in torch (``delta_rule_bwd.chunk_grads``: batched matrix
   products over every chunk at once, float32), then autograd through the op's own
   preprocessing (l2norm, the in-kernel gate, the beta sigmoid, the GVA head expansion), which
   is recomputed from the inputs.

No host read of ``cu_seqlens`` anywhere (the chunk maps are built on the device), so a varlen
forward+backward can be captured in a CUDA graph. No float atomics: deterministic.

Status: **opt-in** (``CUDNN_TRAIN_GDN_SM90_TRAIN=1``) until its GPU tier
(``tests/kernels/test_gated_delta_rule_train_sm90.py``) has passed on the H200 and it has been
timed against FLA; without the variable the cutedsl backend declines calls that need
gradients, as before. The composition is checked on the CPU with reference implementations
of the two kernel steps (``tests/fused/test_delta_rule_bwd.py``). Stage 3 as a kernel is next.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..backend import Unsupported, env_flag
from ..fused import delta_rule_bwd as db
from ..fused.gated_delta_rule import _gdn_log_decay, prepare_qkv

OPT_IN = "CUDNN_TRAIN_GDN_SM90_TRAIN"
STAGE3_ENV = "CUDNN_TRAIN_GDN_SM90_STAGE3"  # "torch" (default) or "kernel"
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
    """``(o, final_state, saved)``: the forward kernels; ``saved = (w, gc, chunk_states)``."""
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
    """``(dvn [B, T, HV, V], dH [rows, HV, K, V], dh0)``: the reverse-sweep kernel."""
    from . import gated_delta_rule_bwd_sm90 as bwd

    w, gc, _ = saved
    return bwd.reverse_sweep(q, k, w, gc, do.contiguous(), None if dht is None else dht.contiguous(),
                             scale=cfg.scale, use_qk_l2norm_in_kernel=cfg.l2norm, cu_seqlens=cu,
                             state_v_first=cfg.state_v_first)


# the kernel steps; the CPU tests put reference implementations of the same contracts here
IMPL = {"forward": kernel_forward, "sweep": kernel_sweep, "stage3": None}  # stage3 None: chosen by STAGE3_ENV


def prepared(q, k, v, g, beta, A_log, dt_bias, cfg: Config):
    """The op's preprocessing in float32: ``(qf, kf, vf, gf [B, T, HV, 1], bf)``, differentiable."""
    qf, kf, vf, bf, _ = prepare_qkv(q, k, v, beta, None, use_qk_l2norm_in_kernel=cfg.l2norm,
                                    use_beta_sigmoid_in_kernel=cfg.beta_sigmoid, allow_neg_eigval=cfg.neg_eigval,
                                    state_v_first=False)
    gf = _gdn_log_decay(g, A_log, dt_bias, cfg.gate, qf.dtype)
    return qf, kf, vf, gf, bf


def stage3_torch(outs, inputs, saved, dH, dvn, do, cu, cfg: Config):
    """Stage 3 in torch over every chunk at once: gradients of the prepared ``outs``."""
    B, T = outs[0].shape[:2]
    lay = db.ChunkLayout(B, T, CHUNK, cu)
    qc, kc, vc, gc, doc = (lay.to_chunks(x) for x in (*outs[:4], do.to(outs[0].dtype)))
    bc = lay.to_chunks(outs[4].unsqueeze(-1))
    r = db._recompute(qc, kc, vc, gc, bc, cfg.scale, CHUNK)
    Sc, dHc = lay.rows_to_chunks(saved[-1]), lay.rows_to_chunks(dH)
    dq, dk, dv, dg, dbeta = db.chunk_grads(qc, kc, vc, bc, Sc, dHc, lay.to_chunks(dvn.to(qc.dtype)), doc, r)
    return [lay.from_chunks(x) for x in (dq, dk, dv, dg)] + [lay.from_chunks(dbeta.unsqueeze(-1)).squeeze(-1)]


def stage3_kernel(outs, inputs, saved, dH, dvn, do, cu, cfg: Config):
    """Stage 3 on the SM90 kernel (``gated_delta_rule_bwd_chunk_sm90``): the prepared q, k in the
    input dtype, the forward's in-chunk cumulative gate."""
    from . import gated_delta_rule_bwd_chunk_sm90 as b3

    dt = inputs[0].dtype
    qn, kn = (x.to(dt).contiguous() for x in outs[:2])
    _w, gc, hs = saved
    dq, dk, dv, dg, dbeta = b3.chunk_grads(qn, kn, inputs[2], gc, outs[4].float().contiguous(), do.contiguous(), dvn,
                                           hs, dH, scale=cfg.scale, cu_seqlens=cu)
    return [dq, dk, dv, dg.unsqueeze(-1), dbeta]


def _stage3():
    return stage3_kernel if os.environ.get(STAGE3_ENV, "torch").strip() == "kernel" else stage3_torch


def input_grads(inputs, saved, dH, dvn, do, cu, cfg: Config):
    """Stage 3 and the preprocessing's backward: gradients of ``inputs = (q, k, v, g, beta,
    A_log, dt_bias)`` (None where an input is absent or needs none)."""
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
    with torch.enable_grad():
        outs = prepared(*leaves, cfg)
    with torch.no_grad():
        stage3 = IMPL.get("stage3") or _stage3()
        grads = stage3([o.detach() for o in outs], inputs, saved, dH, dvn, do, cu, cfg)
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

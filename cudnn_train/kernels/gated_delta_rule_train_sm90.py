"""Training path of the SM90 Gated DeltaNet kernels: forward and backward with autograd.

Forward: the two forward kernels (``gated_delta_rule_fwd_sm90``), the state kernel also
writing the state entering every chunk. Backward, the three stages of
``fused/delta_rule_bwd.py``:

1. nothing to recompute on the state side: the chunk-start states come from the forward;
2. the reverse state sweep kernel (``gated_delta_rule_bwd_sm90.reverse_sweep``): dvn, the
   gradient of the state leaving every chunk, and the initial state's gradient;
3. the per-chunk gradients on the stage-3 kernel (``gated_delta_rule_bwd_chunk_sm90``; with
   ``CUDNN_TRAIN_GDN_SM90_STAGE3=torch`` in torch, ``delta_rule_bwd.chunk_grads``: batched matrix
   products over every chunk at once, float32), the l2norm's backward included; dq and dk
   summed over each GVA group, then autograd through the rest of the op's preprocessing (the
   in-kernel gate, the beta sigmoid), recomputed from the inputs.

The chunk-start states (forward), dvn and dH (sweep) are kept in the input dtype: the stage-3
kernel reads them in that precision, as FLA's backward does.

No host read of ``cu_seqlens`` anywhere (the chunk maps are built on the device), so a varlen
forward+backward can be captured in a CUDA graph. No float atomics: deterministic.

Status: served by default where the op's dispatch picks it (``fwd.cutedsl_backend``: unless FLA
would hand the call to FlashQLA, faster on the H200); ``CUDNN_TRAIN_GDN_SM90_TRAIN=1`` serves every call
it can, ``=0`` none. GPU tier:
``tests/kernels/test_gated_delta_rule_train_sm90.py``; the composition is also checked on the CPU
with reference implementations of the kernel steps (``tests/fused/test_gdn_train_path.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .._validate import compute_dtype
from ..fused import delta_rule_bwd as db
from ..fused.gated_delta_rule import L2NORM_EPS, _gdn_log_decay, beta_in_kernel, l2norm, l2norm_bwd

OPT_IN = "CUDNN_TRAIN_GDN_SM90_TRAIN"
STAGE3_ENV = "CUDNN_TRAIN_GDN_SM90_STAGE3"  # "kernel" (default) or "torch"
CHUNK = 64


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
    chunk-start states (always last) in the input dtype; with the stage-3 kernel
    ``(w, gc, vn, tm, chunk_states)``: the forward's ``vn`` (input dtype ``[B, T, HV, V]``, with
    :func:`vn_from_forward`) and its chunk inverses ``tm`` (``[B, T, HV, 64]``, with :func:`tm_from_forward`),
    each None when not kept, for stage 3 to read instead of recomputing them. Where the forward formed w and u in
    its chain (``fwd.TRAIN_ONFLY``, asked for only where the sweep can take Tm instead of w:
    ``bwd.sweep_takes_tm``), ``(tm, gc, vn, tm, beta_eff, chunk_states)``: Tm in w's place and the effective beta
    (float32 ``[B, T, HV]``) for the sweep."""
    from . import gated_delta_rule_bwd_sm90 as bwd
    from . import gated_delta_rule_fwd_sm90 as fwd

    kernel3 = _stage3() is stage3_kernel  # the torch stage 3 recomputes both
    keep_vn, keep_tm = kernel3 and vn_from_forward(), kernel3 and tm_from_forward()
    B, T = v.shape[:2]
    nseq = B if cu is None else cu.numel() - 1
    onfly = (fwd.TRAIN_ONFLY and keep_vn and keep_tm
             and bwd.sweep_takes_tm(nseq, v.shape[2], q.shape[-1], v.shape[-1], B * T, cfg.l2norm, v.device))
    o, ht, (w, u, gc, hs, vn, tm) = fwd.forward(
        q, k, v, g, beta, scale=cfg.scale, initial_state=h0, output_final_state=cfg.output_final_state,
        use_qk_l2norm_in_kernel=cfg.l2norm, cu_seqlens=cu, use_gate_in_kernel=cfg.gate,
        A_log=A_log if cfg.gate else None, dt_bias=dt_bias if cfg.gate else None,
        use_beta_sigmoid_in_kernel=cfg.beta_sigmoid, allow_neg_eigval=cfg.neg_eigval,
        state_v_first=cfg.state_v_first, store_states=True, keep_vn=keep_vn, keep_tm=keep_tm, train_onfly=onfly,
    ).value
    if w is None:  # w and u formed in the forward's chain: the sweep takes Tm and the effective beta (u's slot)
        return o, ht, (tm, gc, vn, tm, u, hs)
    if not kernel3:
        return o, ht, (w, gc, hs)
    return o, ht, (w, gc, vn, tm, hs)


def kernel_sweep(q, k, v, g, beta, A_log, dt_bias, saved, do, dht, cu, cfg: Config):
    """``(dvn [B, T, HV, V], dH [rows, HV, K, V], dh0)``: the reverse-sweep kernel; dvn and dH in
    the input dtype (what the stage-3 kernel reads), dh0 float32. With the forward's chain-formed w (six saved
    tensors, :func:`kernel_forward`) the sweep on Tm and the effective beta."""
    from . import gated_delta_rule_bwd_sm90 as bwd

    w, gc = saved[:2]
    beta_eff = saved[4] if len(saved) == 6 else None
    if beta_eff is not None and not bwd.serves_tm(q.shape[-1], v.shape[-1]):  # its switches moved since the forward
        w, beta_eff = w_from_tm(k, w, gc, beta_eff, cu, cfg.l2norm), None
    return bwd.reverse_sweep(q, k, w, gc, do.contiguous(), None if dht is None else dht.contiguous(),
                             scale=cfg.scale, use_qk_l2norm_in_kernel=cfg.l2norm, cu_seqlens=cu,
                             state_v_first=cfg.state_v_first, out_dtype=q.dtype, beta=beta_eff)


def w_from_tm(k, tm, gc, beta_eff, cu, use_l2norm: bool):
    """w ``[B, T, HV, K]`` in k's dtype from the forward's gated chunk inverses ``tm`` ``[B, T, HV, 64]``, gc and
    the effective beta (float32 ``[B, T, HV]``): ``w = Tm diag(beta exp(gc)) k`` per chunk, k l2-normalized when
    asked and expanded over each GVA group; in float32 (float64 for float64 inputs), rounded once. For a sweep that
    cannot take Tm itself."""
    B, T, HV = tm.shape[:3]
    ct = compute_dtype(k)
    lay = db.ChunkLayout(B, T, CHUNK, cu)
    kx = expand_heads(k.to(ct), HV)
    if use_l2norm:
        kx = l2norm(kx)
    x = kx * (beta_eff.to(ct) * gc.to(ct).exp()).unsqueeze(-1)
    return lay.from_chunks(lay.to_chunks(tm.to(ct)) @ lay.to_chunks(x)).to(k.dtype)


def kernel_fused(outs, inputs, saved, do, dht, cu, cfg: Config):
    """Stages 2 and 3 on the fused backward kernel (``gated_delta_rule_bwd_fused_sm90``, :func:`fused_serves`):
    ``([dq, dk, dv, dg, dbeta], dh0)``, the first five as the stage-3 steps return them (dq, dk the gradients of
    q and k before the l2norm, per value head, float32), dh0 float32 in the state layout. q and k are normalized
    here (float32, rounded once to their dtype, as the stage-3 kernel rounds its normalized rows), their factors
    passed along: the kernel applies the l2norm's backward to dq, dk."""
    from . import gated_delta_rule_bwd_fused_sm90 as bf

    q, k, v = inputs[:3]
    qn, kn, rq, rk = q.contiguous(), k.contiguous(), None, None
    if cfg.l2norm:  # the rows and their factors; the kernel applies the l2norm's backward to dq, dk
        (qn, rq), (kn, rk) = (_normalized(x) for x in (q, k))
    dq, dk, dv, dg, dbeta, dh0 = bf.fused_backward(
        qn, kn, v.contiguous(), saved[1], outs[1].float().contiguous(), do.contiguous(), saved[2], saved[3],
        saved[-1], None if dht is None else dht.float().contiguous(), scale=cfg.scale,
        state_v_first=cfg.state_v_first, rq=rq, rk=rk)
    return [dq, dk, dv, dg.unsqueeze(-1), dbeta], dh0


def _normalized(x):
    """``(rows l2-normalized in x's dtype, their float32 factors [B, T, H])``, as :func:`l2norm` computes them."""
    xf = x.float()
    r = torch.rsqrt((xf * xf).sum(-1) + L2NORM_EPS)
    return (xf * r.unsqueeze(-1)).to(x.dtype).contiguous(), r.contiguous()


FUSED_ENV = "CUDNN_TRAIN_GDN_FUSED_BWD"


def fused_serves(q, v, saved, cu) -> bool:
    """Whether the backward runs on the fused kernel (``kernel_fused``): asked for (``CUDNN_TRAIN_GDN_FUSED_BWD=1``;
    off by default: the first build, not yet measured faster than the sweep + stage 3), a dense batch, one
    half-precision dtype, K = V = 128, and the forward's vn and Tm kept (the stage-3 kernel's defaults)."""
    from . import gated_delta_rule_common_sm90 as cm

    if not cm.env_switch(FUSED_ENV, False):
        return False
    return (cu is None and q.dtype in (torch.bfloat16, torch.float16) and v.dtype == q.dtype
            and q.shape[-1] == v.shape[-1] == 128 and len(saved) >= 5
            and saved[2] is not None and saved[3] is not None)


# the kernel steps; the CPU tests put reference implementations of the same contracts here
IMPL = {"forward": kernel_forward, "sweep": kernel_sweep, "stage3": None,  # stage3 None: chosen by STAGE3_ENV
        "fused": kernel_fused, "fused_serves": fused_serves}


def prepared(g, beta, A_log, dt_bias, cfg: Config, ct):
    """The op's preprocessing that stage 3 leaves to autograd, in ``ct`` (float32, float64 for
    float64 inputs), differentiable: ``(gf [B, T, HV, 1], bf)``, the effective log decay and beta.
    q, k and v need none: the l2norm (when asked) and the GVA head expansion
    (:func:`expand_heads`) are stage 3's, whose dq, dk (summed over each group) and dv are their
    gradients as they are."""
    return _gdn_log_decay(g, A_log, dt_bias, cfg.gate, ct), beta_in_kernel(beta, ct, cfg.beta_sigmoid, cfg.neg_eigval)


def expand_heads(x, HV: int):
    """``[B, T, H, D]`` -> ``[B, T, HV, D]``: value head hv gets head hv // (HV // H)."""
    G = HV // x.shape[2]
    return x if G == 1 else x.repeat_interleave(G, dim=2)


def stage3_torch(outs, inputs, saved, dH, dvn, do, cu, cfg: Config):
    """Stage 3 in torch over every chunk at once: ``(dq, dk, dv, dg, dbeta)``, dq and dk the
    gradients of q and k before the l2norm, per value head (the caller sums each GVA group)."""
    v = inputs[2]
    B, T, HV = v.shape[:3]
    ct = outs[0].dtype
    lay = db.ChunkLayout(B, T, CHUNK, cu)
    qx, kx = (expand_heads(x.to(ct), HV) for x in inputs[:2])
    qf, kf = (l2norm(qx), l2norm(kx)) if cfg.l2norm else (qx, kx)
    qc, kc, vc, gc, doc = (lay.to_chunks(x) for x in (qf, kf, v.to(ct), outs[0], do.to(ct)))
    bc = lay.to_chunks(outs[1].unsqueeze(-1))
    r = db._recompute(qc, kc, vc, gc, bc, cfg.scale, CHUNK)
    Sc, dHc = lay.rows_to_chunks(saved[-1].to(ct)), lay.rows_to_chunks(dH.to(ct))
    dq, dk, dv, dg, dbeta = db.chunk_grads(qc, kc, vc, bc, Sc, dHc, lay.to_chunks(dvn.to(ct)), doc, r)
    dq, dk, dv, dg = (lay.from_chunks(x) for x in (dq, dk, dv, dg))
    if cfg.l2norm:
        dq, dk = l2norm_bwd(qx, dq), l2norm_bwd(kx, dk)
    return [dq, dk, dv, dg, lay.from_chunks(dbeta.unsqueeze(-1)).squeeze(-1)]


def stage3_kernel(outs, inputs, saved, dH, dvn, do, cu, cfg: Config):
    """Stage 3 on the SM90 kernel (``gated_delta_rule_bwd_chunk_sm90``): q and k as the op got them
    (the kernel applies the l2norm and its backward), the forward's in-chunk cumulative gate and
    chunk-start states (and its vn, when kept: :func:`vn_from_forward`), the sweep's dvn and dH."""
    from . import gated_delta_rule_bwd_chunk_sm90 as b3

    q, k, v = (x.contiguous() for x in inputs[:3])
    gc, hs = saved[1], saved[-1]
    vn, tm = saved[2:4] if len(saved) >= 5 else (None, None)
    # without GVA, or with pairs of value heads summed in the kernel (GROUP_SUM_ENV), dq and dk leave the
    # kernel in the input dtype (no sum over value heads follows)
    gsum = group_sum_in_kernel() and v.shape[2] == 2 * q.shape[2]
    dqk = q.dtype if (q.shape[2] == v.shape[2] or gsum) and q.dtype == v.dtype else torch.float32
    dq, dk, dv, dg, dbeta = b3.chunk_grads(q, k, v, gc, outs[1].float().contiguous(), do.contiguous(), dvn, hs, dH,
                                           scale=cfg.scale, cu_seqlens=cu, l2norm=cfg.l2norm, dqk_dtype=dqk,
                                           sum_groups=gsum, vn=vn, tm=tm)
    return [dq, dk, dv, dg.unsqueeze(-1), dbeta]


VN_ENV = "CUDNN_TRAIN_GDN_DCHUNK_VN_FROM_FWD"


def vn_from_forward() -> bool:
    """Whether the training forward keeps ``vn = u - w S`` for the stage-3 kernel, which then reads it
    instead of recomputing it (no ``k Sc``, ``Z``, ``Tm Z``; ``do vn^T`` in flight during the solve). The
    split pass's chain writes vn for its out kernel anyway; keeping it saves one more tensor of v's size
    (half the chunk-start states' size at K = V = 128, a third more saved bytes than w, gc and those
    states). The default with the stage-3 kernel (H200, stage 3 alone, B4 T4096 H16 HV32, pair sum:
    1.420 against 1.491 ms); ``CUDNN_TRAIN_GDN_DCHUNK_VN_FROM_FWD=0`` turns it off (less memory)."""
    from . import gated_delta_rule_common_sm90 as cm

    return cm.env_switch(VN_ENV, True)


TM_ENV = "CUDNN_TRAIN_GDN_DCHUNK_TM_FROM_FWD"


def tm_from_forward() -> bool:
    """Whether the training forward's wy kernel also writes each chunk's ``Tm = (I + A)^-1`` (input dtype,
    ``[B, T, HV, 64]``: a quarter of v's size at V = 128) and the stage-3 kernel reads it instead of building
    A and solving again (the solve was 14% of its cycles). The default with the stage-3 kernel (H200, stage 3
    alone, B4 T4096 H16 HV32, pair sum, vn read: 1.258 against 1.427 ms);
    ``CUDNN_TRAIN_GDN_DCHUNK_TM_FROM_FWD=0`` turns it off (less memory)."""
    from . import gated_delta_rule_common_sm90 as cm

    return cm.env_switch(TM_ENV, True)


GROUP_SUM_ENV = "CUDNN_TRAIN_GDN_DCHUNK_GROUP_SUM"


def group_sum_in_kernel() -> bool:
    """``CUDNN_TRAIN_GDN_DCHUNK_GROUP_SUM=1``: with groups of two value heads the stage-3 kernel sums dq,
    dk over each pair itself (the pair's two CTAs are one cluster and exchange half of their float32
    accumulators through distributed shared memory; ``chunk_grads(sum_groups=True)``) instead of returning
    them per value head for a float32 sum pass here. Larger groups keep the sum pass. The default
    (H200, stage 3 alone, B4 T4096 H16 HV32: 1.56 ms against 1.80 for the per-value-head kernel plus the
    sum pass, bitwise equal; the whole forward+backward 3.26 against 3.50 ms); ``=0`` turns it off."""
    from . import gated_delta_rule_common_sm90 as cm

    return cm.env_switch(GROUP_SUM_ENV, True)


def _stage3():
    return stage3_torch if os.environ.get(STAGE3_ENV, "kernel").strip() == "torch" else stage3_kernel


def _group_sum(x, H: int, dtype):
    """``[B, T, HV, D]`` (float32, per value head) -> ``[B, T, H, D]`` in ``dtype``: the sum over each
    GVA group of ``HV // H`` value heads, rounded once. Groups of two (the common GVA) take one
    kernel, an add whose float32 result is written in ``dtype``, instead of a reduction and a cast."""
    xs = x.unflatten(2, (H, x.shape[2] // H))
    if xs.shape[3] != 2:
        return xs.sum(3).to(dtype)
    out = torch.empty(*xs.shape[:3], xs.shape[4], dtype=dtype, device=x.device)
    return torch.add(xs[:, :, :, 0], xs[:, :, :, 1], out=out)


def input_grads(inputs, saved, dH, dvn, do, cu, cfg: Config, dht=None, fused: bool = False):
    """Stage 3 (with ``fused``: stages 2 and 3 on the fused kernel step, from ``dht``; dH and dvn unused) and the
    preprocessing's backward: ``(grads, dh0)``, the gradients of ``inputs = (q, k, v, g, beta, A_log, dt_bias)``
    (None where an input is absent or needs none) and, with ``fused``, the initial state's (else None)."""
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs]
    with torch.enable_grad():
        outs = prepared(*leaves[3:], cfg, compute_dtype(inputs[0]))
    dh0 = None
    with torch.no_grad():
        if fused:
            (dq, dk, dv, dg, dbeta), dh0 = IMPL["fused"]([o.detach() for o in outs], inputs, saved, do, dht, cu, cfg)
        else:
            stage3 = IMPL.get("stage3") or _stage3()
            dq, dk, dv, dg, dbeta = stage3([o.detach() for o in outs], inputs, saved, dH, dvn, do, cu, cfg)
        H, HV = inputs[0].shape[2], inputs[2].shape[2]
        if HV != H and dq.shape[2] != H:  # per value head -> per q/k head: the sum over each GVA group
            dq, dk = (_group_sum(x, H, t.dtype) for x, t in zip((dq, dk), inputs[:2]))
    res = [None] * len(inputs)
    for i, d in enumerate((dq, dk, dv)):
        if inputs[i].requires_grad:
            res[i] = d.to(inputs[i].dtype)
    pairs = [(o, d) for o, d in zip(outs, (dg, dbeta)) if o.requires_grad]
    need = [i for i, t in enumerate(leaves) if t is not None and t.requires_grad and i > 2]
    if pairs and need:
        got = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in need], [d for _, d in pairs],
                                  allow_unused=True)
        for i, gr in zip(need, got):
            res[i] = gr
    return res, dh0


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
        inputs = (q, k, v, g, beta, A_log, dt_bias)
        serves = IMPL.get("fused_serves")  # (absent: the two-step backward)
        if serves is not None and serves(q, v, saved, cu):
            grads, dh0 = input_grads(inputs, saved, None, None, do, cu, cfg, dht=dht, fused=True)
        else:
            dvn, dH, dh0 = IMPL["sweep"](q, k, v, g, beta, A_log, dt_bias, saved, do, dht, cu, cfg)
            grads, _ = input_grads(inputs, saved, dH, dvn, do, cu, cfg)
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

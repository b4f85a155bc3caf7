"""The SM90 GDN training path's composition, on the CPU: the kernels' chunk-row layout, the
restarting sweeps, and the autograd Function of ``kernels/gated_delta_rule_train_sm90.py``
with reference implementations of its two kernel steps, against autograd of the torch op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cudnn_train.fused import delta_rule_bwd as db
from cudnn_train.fused.gated_delta_rule import _gdn_torch_math, l2norm
from cudnn_train.kernels import gated_delta_rule_train_sm90 as tr
from tests.utils import cu_seqlens, rel_l2

C = 64
LENS = [0, 1, 63, 64, 65, 130, 0, 7]



@pytest.mark.parametrize("lens", [None, LENS])
def test_w_from_tm_is_the_forwards_w(lens):
    """``w_from_tm`` (the training path's fallback where the forward formed w in its chain and the sweep cannot take
    Tm): the forward's w = Tm diag(beta e^gc) k of the chunk quantities, from the token-row Tm, in-chunk gc and
    effective beta the forward keeps; GVA 2, l2norm, dense with a partial last chunk and varlen with empty, one-token
    and partial sequences (float64 reference)."""
    torch.manual_seed(0)
    B, T, cu = (2, 150, None) if lens is None else (1, sum(lens), cu_seqlens(lens))
    H, HV, K = 1, 2, 16
    k = torch.randn(B, T, H, K)
    g = F.logsigmoid(torch.rand(B, T, HV))
    beta = torch.rand(B, T, HV)
    lay = db.ChunkLayout(B, T, C, cu)
    kc = lay.to_chunks(l2norm(tr.expand_heads(k.double(), HV)))
    gch = lay.to_chunks(g.double().unsqueeze(-1))
    r = db._recompute(kc, kc, None, gch, lay.to_chunks(beta.double().unsqueeze(-1)), 1.0, C)
    tm, gc = lay.from_chunks(r["Tm"]).float(), lay.from_chunks(gch.cumsum(-2)).squeeze(-1).float()
    w = tr.w_from_tm(k, tm, gc, beta, cu, True)
    assert w.dtype == k.dtype and w.shape == (B, T, HV, K)
    assert rel_l2(w.double(), lay.from_chunks(r["w"])) < 1e-5


@pytest.mark.parametrize("lens", [None, LENS, [0, 0]])
def test_chunk_layout_round_trip_and_zero_padding(lens):
    torch.manual_seed(0)
    if lens is None:
        B, T, cu = 2, 130, None
    else:
        B, T, cu = 1, sum(lens), cu_seqlens(lens)
    x = torch.randn(B, T, 3, 5, dtype=torch.float64)
    lay = db.ChunkLayout(B, T, C, cu)
    xc = lay.to_chunks(x)
    assert xc.shape[:2] == (B, 3) and xc.shape[3:] == (C, 5)
    assert torch.equal(lay.from_chunks(xc), x)
    # every token lands once; the rest are zeros
    assert torch.isclose(xc.abs().sum(), x.abs().sum())
    if lens is not None:
        assert xc.shape[2] == T // C + len(lens)
        starts = cu_seqlens(lens)
        c0 = 0
        for n, ln in enumerate(lens):  # chunk c0 + j of sequence n starts at token cu[n] + 64 j
            for j in range(-(-ln // C)):
                tok = starts[n] + j * C
                m = min(C, ln - j * C)
                assert torch.equal(xc[0, :, c0 + j, :m], x[0, tok:tok + m].transpose(0, 1))
                assert not xc[0, :, c0 + j, m:].any()
            c0 += -(-ln // C)
    rows = torch.randn(B * xc.shape[2], 3, 4, 2, dtype=torch.float64)
    back = lay.chunks_to_rows(lay.rows_to_chunks(rows))
    valid = torch.ones(rows.shape[0], dtype=torch.bool) if lens is None else lay.valid_chunk
    assert torch.equal(back[valid], rows[valid]) and not back[~valid].any()


def _prep(q, k, v, g, beta, A_log, dt_bias, cu, cfg):
    gf, bf = tr.prepared(g, beta, A_log, dt_bias, cfg, q.dtype)
    qf, kf = q, k
    if cfg.l2norm:
        qf, kf = l2norm(qf), l2norm(kf)
    qf, kf = (tr.expand_heads(x, v.shape[2]) for x in (qf, kf))
    vf = v.to(qf.dtype)
    lay = db.ChunkLayout(q.shape[0], q.shape[1], C, cu)
    r = db._recompute(*(lay.to_chunks(x) for x in (qf, kf, vf, gf)), lay.to_chunks(bf.unsqueeze(-1)), cfg.scale, C)
    return lay, r


def _k_first(s, cfg):
    return None if s is None else (s.transpose(-1, -2) if cfg.state_v_first else s)


def ref_forward(q, k, v, g, beta, A_log, dt_bias, h0, cu, cfg):
    """The forward kernels' contract, in torch: o, the final state and the chunk-start rows."""
    with torch.no_grad():
        lay, r = _prep(q, k, v, g, beta, A_log, dt_bias, cu, cfg)
        Sc, ht = db.sweeps_ref(r, lay, _k_first(h0, cfg), None, None)
        o = lay.from_chunks(r["qg"] @ Sc + r["P"] @ db.new_values(r, Sc)).to(q.dtype)
    return o, (_k_first(ht, cfg) if cfg.output_final_state else None), (lay.chunks_to_rows(Sc),)


def ref_sweep(q, k, v, g, beta, A_log, dt_bias, saved, do, dht, cu, cfg, w=None):
    """The reverse-sweep kernel's contract, in torch: dvn, the dH rows and dh0 (on ``w`` ``[B, T, HV, K]`` when
    given, else the recomputed w)."""
    with torch.no_grad():
        lay, r = _prep(q, k, v, g, beta, A_log, dt_bias, cu, cfg)
        if w is not None:
            r = dict(r, w=lay.to_chunks(w))
        _, _, dHc, dvn, dh0 = db.sweeps_ref(r, lay, None, _k_first(dht, cfg), lay.to_chunks(do.to(r["w"].dtype)))
    return lay.from_chunks(dvn), lay.chunks_to_rows(dHc), _k_first(dh0, cfg)


def ref_forward_tm(q, k, v, g, beta, A_log, dt_bias, h0, cu, cfg):
    """The forward's contract where it forms w and u in its chain (``CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY``), in torch:
    saved ``(Tm, gc, vn, Tm, effective beta, chunk-start rows)``, no w."""
    o, ht, (rows,) = ref_forward(q, k, v, g, beta, A_log, dt_bias, h0, cu, cfg)
    with torch.no_grad():
        lay, r = _prep(q, k, v, g, beta, A_log, dt_bias, cu, cfg)
        gf, bf = tr.prepared(g, beta, A_log, dt_bias, cfg, q.dtype)
        gc = lay.from_chunks(lay.to_chunks(gf).cumsum(-2)).squeeze(-1)
        tm = lay.from_chunks(r["Tm"])
        vn = lay.from_chunks(db.new_values(r, lay.rows_to_chunks(rows)))
    return o, ht, (tm, gc, vn, tm, bf, rows)


def ref_sweep_tm(q, k, v, g, beta, A_log, dt_bias, saved, do, dht, cu, cfg):
    """The reverse sweep's contract on the forward's Tm and effective beta (``reverse_sweep(beta=)``), in torch:
    w from the saved Tm, gc and beta alone (``tr.w_from_tm``), then the sweep."""
    assert len(saved) == 6, "the forward that forms w in its chain saves six tensors"
    with torch.no_grad():
        w = tr.w_from_tm(k, saved[0], saved[1], saved[4], cu, cfg.l2norm)
    return ref_sweep(q, k, v, g, beta, A_log, dt_bias, saved, do, dht, cu, cfg, w=w)


FLAGS = {
    "plain": {},
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "gate": dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True),
    "sigmoid_neg": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "v_first": dict(state_v_first=True, use_beta_sigmoid_in_kernel=True),
}


def ref_fused(outs, inputs, saved, do, dht, cu, cfg):
    """The fused backward step's contract (``kernel_fused``), in torch: the reverse sweep's and stage 3's contracts
    composed, ``([dq, dk, dv, dg, dbeta], dh0)``."""
    assert len(saved) == 6, "the fused step reads the forward's vn and Tm (the forward that forms w in its chain)"
    dvn, dH, dh0 = ref_sweep(*inputs, saved, do, dht, cu, cfg)
    return tr.stage3_torch(outs, inputs, saved, dH, dvn, do, cu, cfg), dh0


@pytest.mark.parametrize("name", list(FLAGS))
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("h0, final", [(True, True), (False, False)])
@pytest.mark.parametrize("saved_w", [True, False, "fused"], ids=["w", "tm", "fused"])
def test_training_path_matches_autograd_of_the_torch_op(monkeypatch, name, varlen, h0, final, saved_w):
    """``tm``: the forward that forms w in its chain saves Tm, gc and the effective beta instead, and the sweep
    forms w from them (the contract of ``CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY`` and ``reverse_sweep(beta=)``).
    ``fused``: that forward, then the backward's fused step (``kernel_fused``'s contract) in place of the sweep
    and stage 3 (``fused_serves`` answering yes), its dh0 returned as the initial state's gradient."""
    impl = {"forward": ref_forward, "sweep": ref_sweep} if saved_w is True else {"forward": ref_forward_tm,
                                                                                 "sweep": ref_sweep_tm}
    if saved_w == "fused":
        impl = {**impl, "sweep": None, "fused": ref_fused, "fused_serves": lambda *a: True}
    monkeypatch.setattr(tr, "IMPL", {**impl, "stage3": tr.stage3_torch})
    torch.manual_seed(1)
    flags = {**dict(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                    allow_neg_eigval=False, state_v_first=False), **FLAGS[name]}
    H, HV, K, V = 1, 2, 16, 8
    if varlen:
        B, T, cu = 1, sum(LENS), cu_seqlens(LENS)
        N = len(LENS)
    else:
        B, T, cu, N = 2, 130, None, 2
    dt = torch.float64
    q = torch.randn(B, T, H, K, dtype=dt)
    k = torch.randn(B, T, H, K, dtype=dt)
    if not flags["use_qk_l2norm_in_kernel"]:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, dtype=dt)
    g = torch.randn(B, T, HV, dtype=dt) if flags["use_gate_in_kernel"] else F.logsigmoid(torch.randn(B, T, HV, dtype=dt))
    beta = torch.randn(B, T, HV, dtype=dt) if flags["use_beta_sigmoid_in_kernel"] else torch.rand(B, T, HV, dtype=dt)
    A_log = torch.randn(HV, dtype=dt) * 0.5 if flags["use_gate_in_kernel"] else None
    dt_bias = torch.randn(HV, dtype=dt) if flags["use_gate_in_kernel"] else None
    shape0 = (N, HV, V, K) if flags["state_v_first"] else (N, HV, K, V)
    s0 = torch.randn(*shape0, dtype=dt) if h0 else None
    inputs = [t for t in (q, k, v, g, beta, A_log, dt_bias, s0)]
    leaves_a = [None if t is None else t.clone().requires_grad_() for t in inputs]
    leaves_b = [None if t is None else t.clone().requires_grad_() for t in inputs]
    scale = 0.3
    do = torch.randn(B, T, HV, V, dtype=dt)
    dS = torch.randn(*shape0, dtype=dt)

    def call_ours(qq, kk, vv, gg, bb, al, db_, ss):
        return tr.train(qq, kk, vv, gg, bb, scale=scale, initial_state=ss, output_final_state=final,
                        A_log=al, dt_bias=db_, cu_seqlens=cu, **flags)

    def call_torch(qq, kk, vv, gg, bb, al, db_, ss):
        return _gdn_torch_math(qq, kk, vv, gg, bb, scale, ss, final, flags["use_qk_l2norm_in_kernel"],
                               flags["use_gate_in_kernel"], al, db_, flags["use_beta_sigmoid_in_kernel"],
                               flags["allow_neg_eigval"], flags["state_v_first"], cu, None, chunk_size=C)

    o_a, ht_a = call_ours(*leaves_a)
    o_b, ht_b = call_torch(*leaves_b)
    assert rel_l2(o_a, o_b) <= 1e-12
    outs_a, outs_b, cot = [o_a], [o_b], [do]
    if final:
        assert rel_l2(ht_a, ht_b) <= 1e-12
        outs_a.append(ht_a)
        outs_b.append(ht_b)
        cot.append(dS)
    else:
        assert ht_a is None and ht_b is None
    want_leaves = [t for t in leaves_b if t is not None]
    got = torch.autograd.grad(outs_a, [t for t in leaves_a if t is not None], cot)
    want = torch.autograd.grad(outs_b, want_leaves, cot)
    names = [n for n, t in zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"), inputs) if t is not None]
    for n, a, b in zip(names, got, want):
        assert a.shape == b.shape, n
        assert rel_l2(a, b) <= 1e-10, (n, rel_l2(a, b))


def test_the_serve_switches_and_the_peer_rule(monkeypatch):
    """CUDNN_TRAIN_GDN_SM90_TRAIN / _FWD: unset leaves the call to the peer rule, 1 / true serve, anything else
    does not; the rule declines only to FLA, only where FLA comes next and would take the call (no host
    read of cu_seqlens during a graph capture), and only when FLA would hand it to FlashQLA."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    for name in (tr.OPT_IN, F90.FWD_OPT_IN):
        monkeypatch.delenv(name, raising=False)
        assert F90.serve_switch(name) is None
        for val, want in (("1", True), ("true", True), ("0", False), ("off", False), (" ", None)):
            monkeypatch.setenv(name, val)
            assert F90.serve_switch(name) is want, (name, val)
    rule = dict(fla_next=True, fla_ok=True, flash_qla=True, host_read=False)
    assert "FlashQLA" in F90.peer_is_faster(**rule)
    for off in ({"fla_next": False}, {"fla_ok": False}, {"host_read": True}, {"flash_qla": False}):
        assert F90.peer_is_faster(**{**rule, **off}) is None, off


def test_fla_takes_mirrors_the_fla_backends_declines(monkeypatch):
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q = torch.zeros(1, 2, 1, 128, dtype=torch.bfloat16)
    h32, h16 = torch.zeros(1, 2, 128, 128), torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(F90, "_fla_serves", lambda: True)
    assert F90.fla_takes(q, None, 64) and F90.fla_takes(q, h32, 64) and F90.fla_takes(q.float(), None, 16)
    assert not F90.fla_takes(q, h16, 64)  # FLA declines half-precision states: ours serve them
    assert not F90.fla_takes(q, None, 128) and not F90.fla_takes(q.double(), None, 64)
    assert not F90.fla_takes(q[:, :0], None, 64)
    monkeypatch.setattr(F90, "_fla_serves", lambda: False)
    assert not F90.fla_takes(q, None, 64)


def test_the_rule_follows_a_forced_backend_list(monkeypatch):
    """Op.after: the backends a call would try after one, under a forced list too."""
    from cudnn_train import backend
    from cudnn_train.fused import gated_delta_rule  # noqa: F401  (registers the op)

    op = backend.get_op("chunk_gated_delta_rule")
    monkeypatch.delenv("CUDNN_TRAIN_BACKEND", raising=False)
    assert op.after("cutedsl") == ("fla", "torch")
    with backend.use_backend("cutedsl"):
        assert op.after("cutedsl") == ()
    with backend.use_backend("cutedsl,torch"):
        assert op.after("cutedsl") == ("torch",)
    with backend.use_backend("torch"):
        assert op.after("cutedsl") == ()
    monkeypatch.setenv("CUDNN_TRAIN_BACKEND", "cutedsl,fla")
    assert op.after("cutedsl") == ("fla",)


def _flash_qla_flags(**kw):
    return dict(dict(initial_state=None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                     scale=None), **kw)


def test_flash_qla_takes_asks_flas_own_backend(monkeypatch):
    """flash_qla_takes asks FLA's FlashQLA backend (installed, enabled, dispatch on, its real verifier with
    the GPU generation set to Hopper); False where it cannot be asked."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, v = torch.zeros(1, 2, 1, 128, dtype=torch.bfloat16), torch.zeros(1, 2, 2, 128, dtype=torch.bfloat16)
    g, beta = torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)
    try:
        import fla.backends as fla_backends
        from fla.ops.gated_delta_rule.backends import flash_qla as fq
    except Exception:
        assert not F90.flash_qla_takes(q, q, v, g, beta, **_flash_qla_flags())
        pytest.skip("FLA without its FlashQLA backend: flash_qla_takes says False")
    monkeypatch.setattr(fq.FlashQLABackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(fq, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(fla_backends, "_DISPATCH_DISABLED", False)
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    assert F90.flash_qla_takes(q, q, v, g, beta, **_flash_qla_flags())
    assert F90.flash_qla_takes(q, q, v, g, beta, **_flash_qla_flags(initial_state=torch.zeros(1, 2, 128, 128)))
    for bad in (dict(use_gate_in_kernel=True), dict(use_beta_sigmoid_in_kernel=True),
                dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), dict(allow_neg_eigval=True)):
        assert not F90.flash_qla_takes(q, q, v, g, beta, **_flash_qla_flags(**bad)), bad
    assert not F90.flash_qla_takes(q.float(), q.float(), v.float(), g, beta, **_flash_qla_flags())
    assert not F90.flash_qla_takes(q[..., :64], q[..., :64], v, g, beta, **_flash_qla_flags())
    assert not F90.flash_qla_takes(q, q, v[..., :64], g, beta, **_flash_qla_flags())
    monkeypatch.setenv("FLA_FLASH_QLA", "0")  # FLA's own switch: then FLA keeps the call on its kernels
    assert not F90.flash_qla_takes(q, q, v, g, beta, **_flash_qla_flags())
    monkeypatch.delenv("FLA_FLASH_QLA")
    monkeypatch.setattr(fla_backends, "_DISPATCH_DISABLED", True)  # FLA_DISABLE_BACKEND_DISPATCH=1
    assert not F90.flash_qla_takes(q, q, v, g, beta, **_flash_qla_flags())
    monkeypatch.setattr(fla_backends, "_DISPATCH_DISABLED", False)
    monkeypatch.setattr(fq, "IS_NVIDIA_HOPPER", False)  # a GPU FlashQLA does not serve (the CPU here)
    assert not F90.flash_qla_takes(q, q, v, g, beta, **_flash_qla_flags())
    monkeypatch.setattr(fq, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(fq.FlashQLABackend, "is_available", classmethod(lambda cls: False))
    assert not F90.flash_qla_takes(q, q, v, g, beta, **_flash_qla_flags())


def test_flash_qla_takes_agrees_with_flas_dispatch(monkeypatch):
    """Over a grid of calls, flash_qla_takes says True exactly where FLA's own dispatched
    chunk_gated_delta_rule runs FlashQLA's implementation (a sentinel here; GPU generation set to Hopper)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    try:
        import fla.backends as fla_backends
        from fla.ops.gated_delta_rule import chunk as fla_chunk
        from fla.ops.gated_delta_rule.backends import flash_qla as fq
    except Exception:
        pytest.skip("FLA without its FlashQLA backend")
    sentinel = object()
    monkeypatch.setattr(fq.FlashQLABackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(fq.FlashQLABackend, "chunk_gated_delta_rule", lambda self, *a, **kw: sentinel)
    monkeypatch.setattr(fq, "IS_NVIDIA_HOPPER", True)
    monkeypatch.setattr(fla_backends, "_DISPATCH_DISABLED", False)
    fla_fn = getattr(fla_chunk.chunk_gated_delta_rule, "_cudnn_train_original", fla_chunk.chunk_gated_delta_rule)
    seen = set()
    for dt in (torch.bfloat16, torch.float32):
        for K, V in ((128, 128), (64, 128), (128, 64)):
            for flags in ({}, dict(use_gate_in_kernel=True), dict(use_beta_sigmoid_in_kernel=True),
                          dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True), dict(state_v_first=True)):
                for env in (None, "0"):
                    if env is None:
                        monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
                    else:
                        monkeypatch.setenv("FLA_FLASH_QLA", env)
                    q, v = torch.randn(1, 64, 1, K, dtype=dt), torch.randn(1, 64, 2, V, dtype=dt)
                    g, beta = torch.randn(1, 64, 2), torch.rand(1, 64, 2)
                    gate = flags.get("use_gate_in_kernel")
                    extra = dict(A_log=torch.zeros(2), dt_bias=torch.zeros(2)) if gate else {}
                    try:
                        routed = fla_fn(q=q, k=q, v=v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, **flags,
                                        **extra) is sentinel
                    except Exception:  # FLA's own kernels, which cannot run here
                        routed = False
                    ours = F90.flash_qla_takes(q, q, v, g, beta, **_flash_qla_flags(**flags))
                    assert ours == routed, (dt, K, V, flags, env, ours, routed)
                    seen.add(routed)
    assert seen == {True, False}


def test_the_stage3_group_sum_knob(monkeypatch):
    """CUDNN_TRAIN_GDN_DCHUNK_GROUP_SUM: on unless 0, and a bad value is a ValueError naming it."""
    monkeypatch.delenv(tr.GROUP_SUM_ENV, raising=False)
    assert tr.group_sum_in_kernel()
    monkeypatch.setenv(tr.GROUP_SUM_ENV, "0")
    assert not tr.group_sum_in_kernel()
    monkeypatch.setenv(tr.GROUP_SUM_ENV, "yes")
    with pytest.raises(ValueError, match=tr.GROUP_SUM_ENV):
        tr.group_sum_in_kernel()


@pytest.mark.parametrize("lens", [None, LENS])
def test_the_kernels_chunk_rows_agree_with_chunk_layout(lens):
    """The launchers' chunk map (``fwd.chunk_map``) and the torch side's ``ChunkLayout`` number
    the chunk rows the same way."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    B, T, cu = (3, 130, None) if lens is None else (1, sum(LENS), cu_seqlens(LENS))
    _, cu_chunks, rows, NT = F90.chunk_map(cu, B, T, torch.device("cpu"))
    lay = db.ChunkLayout(B, T, C, cu)
    assert rows == B * lay.NC if lens is None else rows == lay.NC
    if lens is not None:
        assert NT == 0
        first = torch.nonzero(lay.first).flatten()
        nonempty = [n for n, ln in enumerate(LENS) if ln > 0]
        assert first.tolist() == cu_chunks[nonempty].tolist()
        assert int(lay.valid_chunk.sum()) == int(cu_chunks[-1])
    else:
        assert NT == lay.NC

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
from tests.utils import rel_l2

C = 64
LENS = [0, 1, 63, 64, 65, 130, 0, 7]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("lens", [None, LENS, [0, 0]])
def test_chunk_layout_round_trip_and_zero_padding(lens):
    torch.manual_seed(0)
    if lens is None:
        B, T, cu = 2, 130, None
    else:
        B, T, cu = 1, sum(lens), _cu(lens)
    x = torch.randn(B, T, 3, 5, dtype=torch.float64)
    lay = db.ChunkLayout(B, T, C, cu)
    xc = lay.to_chunks(x)
    assert xc.shape[:2] == (B, 3) and xc.shape[3:] == (C, 5)
    assert torch.equal(lay.from_chunks(xc), x)
    # every token lands once; the rest are zeros
    assert torch.isclose(xc.abs().sum(), x.abs().sum())
    if lens is not None:
        assert xc.shape[2] == T // C + len(lens)
        starts = _cu(lens)
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
        o = lay.from_chunks(r["qg"] @ Sc + r["P"] @ (r["u"] - r["w"] @ Sc)).to(q.dtype)
    return o, (_k_first(ht, cfg) if cfg.output_final_state else None), (lay.chunks_to_rows(Sc),)


def ref_sweep(q, k, v, g, beta, A_log, dt_bias, saved, do, dht, cu, cfg):
    """The reverse-sweep kernel's contract, in torch: dvn, the dH rows and dh0."""
    with torch.no_grad():
        lay, r = _prep(q, k, v, g, beta, A_log, dt_bias, cu, cfg)
        _, _, dHc, dvn, dh0 = db.sweeps_ref(r, lay, None, _k_first(dht, cfg), lay.to_chunks(do.to(r["w"].dtype)))
    return lay.from_chunks(dvn), lay.chunks_to_rows(dHc), _k_first(dh0, cfg)


FLAGS = {
    "plain": {},
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "gate": dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True),
    "sigmoid_neg": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "v_first": dict(state_v_first=True, use_beta_sigmoid_in_kernel=True),
}


@pytest.mark.parametrize("name", list(FLAGS))
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("h0, final", [(True, True), (False, False)])
def test_training_path_matches_autograd_of_the_torch_op(monkeypatch, name, varlen, h0, final):
    monkeypatch.setattr(tr, "IMPL", {"forward": ref_forward, "sweep": ref_sweep, "stage3": tr.stage3_torch})
    torch.manual_seed(1)
    flags = {**dict(use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                    allow_neg_eigval=False, state_v_first=False), **FLAGS[name]}
    H, HV, K, V = 1, 2, 16, 8
    if varlen:
        B, T, cu = 1, sum(LENS), _cu(LENS)
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
    does not; the rule declines only to a faster peer: FLA when it would hand the call to FlashQLA (its
    float32 initial state), or at head dims not timed against FLA; without FLA, never."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    for name in (tr.OPT_IN, F90.FWD_OPT_IN):
        monkeypatch.delenv(name, raising=False)
        assert F90.serve_switch(name) is None
        for val, want in (("1", True), ("true", True), ("0", False), ("off", False), (" ", None)):
            monkeypatch.setenv(name, val)
            assert F90.serve_switch(name) is want, (name, val)
    q, v = torch.zeros(1, 2, 1, 128), torch.zeros(1, 2, 2, 128)
    h32, h16 = torch.zeros(1, 2, 128, 128), torch.zeros(1, 2, 128, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(F90, "_fla_serves", lambda: True)
    assert "FlashQLA" in F90.peer_is_faster(q, v, None, True)
    assert "FlashQLA" in F90.peer_is_faster(q, v, h32, True)
    assert F90.peer_is_faster(q, v, h16, True) is None  # FLA declines half-precision states: we serve
    assert F90.peer_is_faster(q, v, None, False) is None
    assert "K=64" in F90.peer_is_faster(q[..., :64], v, None, False)
    assert "V=64" in F90.peer_is_faster(q, v[..., :64], None, False)
    monkeypatch.setattr(F90, "_fla_serves", lambda: False)
    assert F90.peer_is_faster(q, v, None, True) is None and F90.peer_is_faster(q[..., :64], v, None, False) is None


def test_flash_qla_takes_asks_flas_own_backend(monkeypatch):
    """flash_qla_takes asks FLA's FlashQLA backend (installed, enabled, its verifier); False where it cannot."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, v = torch.zeros(1, 2, 1, 128, dtype=torch.bfloat16), torch.zeros(1, 2, 2, 128, dtype=torch.bfloat16)
    g, beta = torch.zeros(1, 2, 2), torch.zeros(1, 2, 2)
    flags = dict(initial_state=None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                 use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                 scale=None)
    try:
        from fla.ops.gated_delta_rule.backends.flash_qla import FlashQLABackend
    except Exception:
        assert not F90.flash_qla_takes(q, q, v, g, beta, **flags)
        return
    seen = []

    def verify(self, name, *args, **kw):
        seen.append((name, kw))
        return (not kw.get("use_gate_in_kernel") and not kw["use_beta_sigmoid_in_kernel"]), None

    monkeypatch.setattr(FlashQLABackend, "is_available", classmethod(lambda cls: True))
    monkeypatch.setattr(FlashQLABackend, "verify", verify)
    monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
    assert F90.flash_qla_takes(q, q, v, g, beta, **flags)
    assert seen[-1][0] == "chunk_gated_delta_rule" and seen[-1][1]["use_qk_l2norm_in_kernel"]
    assert not F90.flash_qla_takes(q, q, v, g, beta, **{**flags, "use_gate_in_kernel": True})
    assert not F90.flash_qla_takes(q, q, v, g, beta, **{**flags, "use_beta_sigmoid_in_kernel": True})
    monkeypatch.setenv("FLA_FLASH_QLA", "0")  # FLA's own switch: then FLA keeps the call on its kernels
    n = len(seen)
    assert not F90.flash_qla_takes(q, q, v, g, beta, **flags) and len(seen) == n
    monkeypatch.delenv("FLA_FLASH_QLA")
    monkeypatch.setattr(FlashQLABackend, "is_available", classmethod(lambda cls: False))
    assert not F90.flash_qla_takes(q, q, v, g, beta, **flags)


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

    B, T, cu = (3, 130, None) if lens is None else (1, sum(LENS), _cu(LENS))
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

"""SM90 Gated DeltaNet fused backward (stages 2 and 3 in one kernel): compiled for sm_90a on any machine; on a GPU,
checked against the float64 stages of ``fused/delta_rule_bwd.py`` (the reverse sweep and ``chunk_grads``) on the
same inputs, every output."""

import pytest
import torch
import torch.nn.functional as F

from tests.utils import rel_l2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.compile
def test_fused_backward_compiles_for_sm90a(kernel_cache):
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF

    assert callable(BF.get_fused_bwd_kernel(torch.bfloat16, 128, 128, True, False))
    assert callable(BF.get_fused_bwd_kernel(torch.float16, 128, 128, False, True))  # no dht, [V, K] states
    # two k buffers, dvb over do (CUDNN_TRAIN_GDN_FUSED_KDB)
    assert callable(BF.get_fused_bwd_kernel(torch.bfloat16, 128, 128, True, False, kdb=True))
    # the debug variant (dvn and the dH rows out); the l2norm's backward in the kernel
    assert callable(BF.get_fused_bwd_kernel(torch.bfloat16, 128, 128, True, False, debug=True))
    assert callable(BF.get_fused_bwd_kernel(torch.bfloat16, 128, 128, True, False, l2bwd=True))
    # the profile variant (per-warpgroup phase cycles out); dk's late terms on W2, with the l2norm backward
    assert callable(BF.get_fused_bwd_kernel(torch.bfloat16, 128, 128, True, False, prof=True))
    assert callable(BF.get_fused_bwd_kernel(torch.bfloat16, 128, 128, True, False, l2bwd=True, splitdk=True))
    # dq on W1 too
    assert callable(BF.get_fused_bwd_kernel(torch.bfloat16, 128, 128, True, False, splitdk=True, dq1=True))
    assert len(list(kernel_cache.rglob("*.o"))) == 8


@pytest.mark.parametrize("switch", ["KDB", "SPLITDK", "DQ1"])
def test_the_variant_switches_are_off_by_default_and_parse(monkeypatch, switch):
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF
    from tests.utils import assert_env_override

    name = "CUDNN_TRAIN_GDN_FUSED_" + switch
    default = getattr(BF, switch.lower() + "_default")
    monkeypatch.delenv(name, raising=False)
    assert default() is False
    assert_env_override(monkeypatch, name, default, "1", True, ("2", "on"))


def test_dq_on_w1_declines_two_k_buffers_and_needs_split_dk():
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF

    for kw in (dict(kdb=True, splitdk=True), dict(kdb=False, splitdk=False)):
        with pytest.raises(Unsupported, match="dq1"):
            BF.get_fused_bwd_kernel(torch.bfloat16, 128, 128, True, False, dq1=True, **kw)


def test_fused_backward_declines_what_it_does_not_serve():
    """Head dims other than 128 and CPU tensors are declined (Unsupported) before anything is built or launched."""
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF

    with pytest.raises(Unsupported, match="K = V = 128"):
        BF.get_fused_bwd_kernel(torch.bfloat16, 64, 64, True, False)
    if torch.cuda.is_available():
        return
    x = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    s = torch.zeros(1, 8, 1)
    with pytest.raises(Unsupported):
        BF.fused_backward(x, x, x, s, s, x, x, x[..., :64], torch.zeros(1, 1, 128, 128, dtype=torch.bfloat16),
                          scale=0.1)


# ------------------------------------------------------------------ GPU tier


def _case(B, T, H, HV, dtype, with_dht=True, state_vk=False, seed=0):
    """Random inputs, the float64 forward quantities the training forward saves (vn, Tm, the chunk-start states;
    rounded to ``dtype`` for the kernel), and the float64 backward of stages 2 and 3 on them."""
    from cudnn_train.fused import delta_rule_bwd as db
    from cudnn_train.kernels import gated_delta_rule_train_sm90 as tr

    torch.manual_seed(seed)
    dev, K, V, C = "cuda", 128, 128, 64
    q, k = (F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype) for _ in range(2))
    v = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    do = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.rand(B, T, HV, device=dev) * 4 - 1)  # some strong decays
    beta = torch.rand(B, T, HV, device=dev)
    h0 = torch.randn(B, HV, K, V, device=dev, dtype=torch.float64) * 0.5
    dht = torch.randn(B, HV, K, V, device=dev) if with_dht else None
    scale = K**-0.5
    lay = db.ChunkLayout(B, T, C)
    d64 = torch.float64
    qc, kc = (lay.to_chunks(tr.expand_heads(x.to(d64), HV)) for x in (q, k))
    vc, doc = lay.to_chunks(v.to(d64)), lay.to_chunks(do.to(d64))
    gch, bc = lay.to_chunks(g.to(d64).unsqueeze(-1)), lay.to_chunks(beta.to(d64).unsqueeze(-1))
    r = db._recompute(qc, kc, vc, gch, bc, scale, C)
    Sc, _, dHc, dvn, dh0 = db.sweeps_ref(r, lay, h0, None if dht is None else dht.to(d64), doc)
    vn = db.new_values(r, Sc)
    want = db.chunk_grads(qc, kc, vc, bc, Sc, dHc, dvn, doc, r, vn=vn)
    dq, dk, dv, dg = (lay.from_chunks(x) for x in want[:4])
    dbeta = lay.from_chunks(want[4].unsqueeze(-1)).squeeze(-1)
    gc = lay.from_chunks(gch.cumsum(-2)).squeeze(-1).float().contiguous()  # the in-chunk cumulative log decay
    ins = dict(q=q, k=k, v=v, gc=gc, beta=beta, do=do, vn=lay.from_chunks(vn).to(dtype).contiguous(),
               tm=lay.from_chunks(r["Tm"]).to(dtype).contiguous(), hs=lay.chunks_to_rows(Sc).to(dtype).contiguous(),
               dht=None if dht is None else (dht.transpose(-1, -2).contiguous() if state_vk else dht))
    if state_vk:
        dh0 = dh0.transpose(-1, -2)
    return ins, scale, dict(dq=dq, dk=dk, dv=dv, dg=dg.squeeze(-1), dbeta=dbeta, dh0=dh0,
                            dvn=lay.from_chunks(dvn), dH=lay.chunks_to_rows(dHc))


@pytest.mark.gpu
def test_fused_backward_chain_intermediates_match_the_reverse_sweep():
    """The debug variant's dvn and dH rows (the chain's intermediates, float32) against ``sweeps_ref``'s, then its
    six outputs bitwise the plain kernel's: where an output diverges, this says whether the chain (W0 and the first
    half of W1) or the per-chunk gradients do."""
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF

    ins, scale, want = _case(2, 200, 2, 4, torch.bfloat16, True, False)
    args = [ins[x] for x in ("q", "k", "v", "gc", "beta", "do", "vn", "tm", "hs", "dht")]
    got = BF.fused_backward(*args, scale=scale, debug=True, kdb=False)
    plain = BF.fused_backward(*args, scale=scale, kdb=False)
    torch.cuda.synchronize()
    errs = {name: rel_l2(a, want[name]) for name, a in zip(("dvn", "dH"), got[6:])}
    assert max(errs.values()) <= 2e-2, errs
    for a, b in zip(got[:6], plain):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["plain", "splitdk", "dq1"])
def test_fused_backward_l2norm_backward_in_the_kernel(variant):
    """With the rows' l2norm factors given (``rq``, ``rk``, as the training path computes them from the raw rows),
    dq and dk leave through the l2norm's backward ``r (dy - y rowsum(y dy))``, y the normalized rows given: the
    kernel's against the plain kernel's dq, dk put through that formula in float32 (another summation order), the
    rest bitwise. With ``splitdk`` W2 applies it to dk's sum, with ``dq1`` W1 to dq."""
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF
    from cudnn_train.kernels import gated_delta_rule_train_sm90 as tr

    ins, scale, _ = _case(2, 150, 2, 4, torch.bfloat16, True, False)
    for x in ("q", "k"):  # raw rows of assorted norms, normalized as the training path does
        raw = ins[x].float() * (0.5 + torch.rand_like(ins[x].float()[..., :1]) * 3)
        ins[x], ins["r" + x] = tr._normalized(raw.to(torch.bfloat16))
    args = [ins[x] for x in ("q", "k", "v", "gc", "beta", "do", "vn", "tm", "hs", "dht")]
    kw = dict(kdb=False, splitdk=variant != "plain", dq1=variant == "dq1")
    plain = BF.fused_backward(*args, scale=scale, **kw)
    got = BF.fused_backward(*args, scale=scale, rq=ins["rq"], rk=ins["rk"], **kw)
    torch.cuda.synchronize()
    for i, x in enumerate(("q", "k")):
        y = tr.expand_heads(ins[x].float(), 4)
        r = tr.expand_heads(ins["r" + x].unsqueeze(-1), 4)
        want = r * (plain[i] - y * (y * plain[i]).sum(-1, keepdim=True))
        assert rel_l2(got[i], want) <= 1e-5, (x, rel_l2(got[i], want))
    for a, b in zip(got[2:], plain[2:]):
        assert torch.equal(a, b)


CASES = [  # (B, T, H, HV, dtype, with_dht, state_vk)
    (2, 200, 2, 4, torch.bfloat16, True, False),  # GVA, a partial last chunk
    (1, 1000, 1, 2, torch.bfloat16, True, False),  # a long chain of chunks
    (3, 37, 1, 1, torch.float16, False, True),  # one partial chunk, no dht, [V, K] states
    (1, 128, 2, 2, torch.bfloat16, False, False),  # whole chunks only
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}HV{c[3]}")
def test_fused_backward_matches_the_stagewise_float64_backward(case):
    """Every output within 2e-2 relative L2 of the float64 stages; the two-k-buffer variant bitwise the same."""
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF

    B, T, H, HV, dtype, with_dht, state_vk = case
    ins, scale, want = _case(B, T, H, HV, dtype, with_dht, state_vk)
    args = [ins[x] for x in ("q", "k", "v", "gc", "beta", "do", "vn", "tm", "hs", "dht")]
    got = BF.fused_backward(*args, scale=scale, state_v_first=state_vk, kdb=False)
    torch.cuda.synchronize()
    for name, a in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got):
        b = want[name]
        assert tuple(a.shape) == tuple(b.shape), (name, tuple(a.shape), tuple(b.shape))
        err = rel_l2(a.float(), b.float())
        assert err <= 2e-2, (case, name, err)
    if dtype == torch.bfloat16 and with_dht:  # (the variants are compiled for this pair)
        def same_but(variant, ref, apart, **kw):
            # every output bitwise ref's but `apart` (summed in another order: within 1e-5 of ref's, 2e-2 of want)
            out = BF.fused_backward(*args, scale=scale, state_v_first=state_vk, **kw)
            for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), out, ref):
                if name == apart:
                    assert rel_l2(a, want[name]) <= 2e-2 and rel_l2(a, b) <= 1e-5, (case, variant, rel_l2(a, b))
                else:
                    assert torch.equal(a, b), (case, name, variant, rel_l2(a.float(), b.float()))
            return out

        same_but("kdb", got, None, kdb=True)
        # dk's late terms on W2 (SPLITDK): dk summed in another order
        split = same_but("splitdk", got, "dk", kdb=False, splitdk=True)
        # dq on W1 too (DQ1): split-dk's bits but for dg (its row sums joined in another order)
        same_but("dq1", split, "dg", kdb=False, dq1=True)


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_the_training_path_on_the_fused_backward_matches_autograd_of_the_torch_op(monkeypatch, state_v_first):
    """The op's training path (``gated_delta_rule_train_sm90.train``: the forward kernels, then with
    ``CUDNN_TRAIN_GDN_FUSED_BWD=1`` the fused backward, the l2norm's backward and the GVA sum after it) against
    autograd of the torch op in float32 on the same inputs, and against the two-kernel backward: every gradient."""
    from cudnn_train.fused.gated_delta_rule import _gdn_torch_math
    from cudnn_train.kernels import gated_delta_rule_train_sm90 as tr

    torch.manual_seed(3)
    dev, B, T, H, HV, K = "cuda", 2, 300, 2, 4, 128
    q, k = (torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, HV, K, device=dev, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.rand(B, T, HV, device=dev) * 4 - 1)
    beta = torch.rand(B, T, HV, device=dev)
    shape0 = (B, HV, K, K)
    h0 = torch.randn(*shape0, device=dev) * 0.5
    do = torch.randn(B, T, HV, K, device=dev, dtype=torch.bfloat16)
    dht = torch.randn(*shape0, device=dev)
    scale = K**-0.5
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                 allow_neg_eigval=False, state_v_first=state_v_first)

    def grads(fn, cast):
        leaves = [(t.detach() if cast is None else t.detach().to(cast)).requires_grad_()
                  for t in (q, k, v, g, beta, h0)]
        o, ht = fn(*leaves)
        return torch.autograd.grad([o, ht], leaves, [do.to(o.dtype), dht])

    def ours(qq, kk, vv, gg, bb, ss):
        return tr.train(qq, kk, vv, gg, bb, scale=scale, initial_state=ss, output_final_state=True, A_log=None,
                        dt_bias=None, cu_seqlens=None, **flags)

    def torch_op(qq, kk, vv, gg, bb, ss):
        return _gdn_torch_math(qq, kk, vv, gg, bb, scale, ss, True, True, False, None, None, False, False,
                               state_v_first, None, None, chunk_size=64)

    want = grads(torch_op, torch.float32)
    monkeypatch.setenv("CUDNN_TRAIN_GDN_FUSED_BWD", "0")
    two = grads(ours, None)
    monkeypatch.setenv("CUDNN_TRAIN_GDN_FUSED_BWD", "1")
    assert tr.fused_serves(q, v, (None, None, q, q, None), None)
    fused = grads(ours, None)
    for name, a, b, w in zip(("q", "k", "v", "g", "beta", "h0"), fused, two, want):
        assert rel_l2(a.float(), w.float()) <= 2e-2, (name, rel_l2(a.float(), w.float()), rel_l2(b.float(), w.float()))
        assert rel_l2(a.float(), b.float()) <= 2e-2, (name, rel_l2(a.float(), b.float()))


# ------------------------------------------------------------------ the kernel's algorithm, on the CPU


def _kernel_steps(q, k, v, gc, beta, do, vn, Tm, Sc, dht, scale, rnd):
    """The fused kernel's per-chunk steps for one (sequence, value head), in torch, float64, chunks in reverse: the
    warpgroups' products and passes in its order and regrouping (dH updated with dvb, not w; rowsum(k * dkb) as the
    column sums of Tm * (dw k^T); dk's dkb term through diag(beta eg) Tm^T; kdt scaled by kdec), with ``rnd`` at
    each place the kernel rounds to the input dtype (the dH tile, dvn, -beta eg dvb, do_s, P, dQK, dw, dTm^T,
    Tm^T dTm, dKK, the register A operand). q, k, v, do, vn [T, D]; gc, beta [T]; Tm [T, 64]; Sc [NT, K, V]."""
    C = 64
    T = q.shape[0]
    NT = -(-T // C)
    pad = NT * C - T

    def chunks(x, fill=0.0):
        return torch.cat([x, x.new_full((pad, *x.shape[1:]), fill)]).view(NT, C, *x.shape[1:])

    qc, kc, vc, doc, vnc, tmc, bc = (chunks(x) for x in (q, k, v, do, vn, Tm, beta))
    gcc = torch.cat([gc.view(-1), gc.new_zeros(pad)]).view(NT, C).clone()
    for c in range(NT):  # past the end: the last row's
        ln = min(C, T - c * C)
        gcc[c, ln:] = gcc[c, ln - 1]
    dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
    dg, dbeta = torch.zeros(NT, C, dtype=q.dtype), torch.zeros(NT, C, dtype=q.dtype)
    dH = dht.clone() if dht is not None else q.new_zeros(q.shape[1], v.shape[1])
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    strict = lower.tril(-1)
    for c in reversed(range(NT)):
        q_, k_, v_, do_, vn_, Tm_, b_, g_, S = qc[c], kc[c], vc[c], doc[c], vnc[c], tmc[c], bc[c], gcc[c], Sc[c]
        eg, gl = g_.exp(), g_[-1]
        kdec = (gl - g_).exp()
        E = (g_[:, None] - g_[None, :]).masked_fill(~lower, float("-inf")).exp()
        # W0: the dH tile, the tail
        sH = rnd(dH)
        tail = (S * dH).sum()
        # W2: P, dP, dQK, dq
        P = scale * (q_ @ k_.T) * E
        dP = do_ @ vn_.T
        pair = dP * P
        dQK = rnd(scale * dP * E)
        dqg = do_ @ S.T
        dq_ = scale * eg[:, None] * dqg
        rowg = pair.sum(-1) + (q_ * dq_).sum(-1)
        dq[c] = dq_ + dQK @ k_
        # W1: dvn, dvb, dv, the hand-over to W0, dk
        dvn = kdec[:, None] * (k_ @ sH) + rnd(P).T @ do_
        sDvn = rnd(dvn)
        dvb = Tm_.T @ sDvn
        rows_v = (v_ * dvb).sum(-1)
        dv[c] = b_[:, None] * dvb
        sDvb = rnd(-(b_ * eg)[:, None] * dvb)
        dkd = vn_ @ sH.T
        kdt = kdec * (k_ * dkd).sum(-1)
        dk_ = kdec[:, None] * dkd + dQK.T @ q_
        # W0: the update
        do_s = rnd(scale * eg[:, None] * do_)
        dH = gl.exp() * dH + q_.T @ do_s + k_.T @ sDvb
        # W2: dw, dTm, M1, dA, dKK
        dw = rnd(-(sDvn @ S.T))
        X1, X2 = dw @ k_.T, sDvn @ v_.T
        cs = (Tm_ * X1).sum(0)  # rowsum(k * dkb)
        dTmT = rnd((X1 * (b_ * eg)[None, :] + X2 * b_[None, :]).T)
        M1 = rnd(Tm_.T @ dTmT.T)
        dA = -(M1 @ Tm_.T) * strict
        KK = k_ @ k_.T
        dAE = dA * E * strict
        rowb = (dAE * KK).sum(-1)
        pairA = b_[:, None] * dAE * KK
        dKK = rnd(b_[:, None] * dAE)
        # W1: dk's last terms
        rA = rnd((b_ * eg)[:, None] * Tm_.T)
        dk[c] = dk_ + rA @ dw + dKK @ k_ + dKK.T @ k_
        # W2: dg, dbeta
        dgc = rowg + pairA.sum(-1) - pair.sum(0) - pairA.sum(0) + b_ * eg * cs - kdt
        dgc[-1] = dgc[-1] + kdt.sum() + tail * gl.exp()
        dg[c] = dgc.flip(0).cumsum(0).flip(0)
        dbeta[c] = rowb + eg * cs + rows_v
    flat = [x.reshape(NT * C, *x.shape[2:])[:T] for x in (dq, dk, dv, dg, dbeta)]
    return (*flat, dH)


def _cpu_case(T, K, seed, with_dht=True):
    from cudnn_train.fused import delta_rule_bwd as db

    torch.manual_seed(seed)
    d64, C = torch.float64, 64
    q, k = (F.normalize(torch.randn(1, T, 1, K, dtype=d64), dim=-1) for _ in range(2))
    v, do = (torch.randn(1, T, 1, K, dtype=d64) for _ in range(2))
    g = F.logsigmoid(torch.rand(1, T, 1, dtype=d64) * 4 - 1)
    beta = torch.rand(1, T, 1, dtype=d64)
    h0 = torch.randn(1, 1, K, K, dtype=d64) * 0.5
    dht = torch.randn(1, 1, K, K, dtype=d64) if with_dht else None
    lay = db.ChunkLayout(1, T, C)
    qc, kc, vc, doc = (lay.to_chunks(x) for x in (q, k, v, do))
    gch, bc = lay.to_chunks(g.unsqueeze(-1)), lay.to_chunks(beta.unsqueeze(-1))
    r = db._recompute(qc, kc, vc, gch, bc, K**-0.5, C)
    Sc, _, dHc, dvn, dh0 = db.sweeps_ref(r, lay, h0, dht, doc)
    vn = db.new_values(r, Sc)
    want = db.chunk_grads(qc, kc, vc, bc, Sc, dHc, dvn, doc, r, vn=vn)
    tok = [lay.from_chunks(x)[0, :, 0] for x in want[:3]]
    want = tok + [lay.from_chunks(want[3])[0, :, 0, 0], lay.from_chunks(want[4].unsqueeze(-1))[0, :, 0, 0], dh0[0, 0]]
    gc = lay.from_chunks(gch.cumsum(-2))[0, :, 0, 0]
    ins = (q[0, :, 0], k[0, :, 0], v[0, :, 0], gc, beta[0, :, 0], do[0, :, 0], lay.from_chunks(vn)[0, :, 0],
           lay.from_chunks(r["Tm"])[0, :, 0], Sc[0, 0], None if dht is None else dht[0, 0])
    return ins, want


@pytest.mark.parametrize("T, with_dht", [(200, True), (64, False), (37, True)])
def test_the_kernels_steps_are_the_stagewise_backward(T, with_dht):
    """The kernel's regrouping, step by step (``_kernel_steps``, no rounding), equals the float64 stages
    (``sweeps_ref`` then ``chunk_grads``): every output and dh0, partial chunks included."""
    ins, want = _cpu_case(T, 16, 5, with_dht)
    got = _kernel_steps(*ins, 16**-0.5, lambda x: x)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert rel_l2(a, b) <= 1e-10, (name, rel_l2(a, b))


def test_the_kernels_rounding_stays_inside_the_gpu_tolerance():
    """With bf16 inputs and the kernel's bf16 rounding points, over T = 1000 at K = V = 128 (16 chunks of the
    chain), every output stays within half of the GPU cases' 2e-2 relative L2 of the float64 stages (dbeta is the
    largest, 6.6e-3 at this seed; the rest 2.6e-3 to 3.8e-3), so that tolerance separates rounding from a
    defect."""
    def bf(x):
        return x.to(torch.bfloat16).to(torch.float64)

    ins, want = _cpu_case(1000, 128, 2)
    ins = tuple(bf(x) if i in (0, 1, 2, 5, 6, 7, 8) else x for i, x in enumerate(ins))
    got = _kernel_steps(*ins, 128**-0.5, bf)
    errs = {name: rel_l2(a, b) for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want)}
    assert max(errs.values()) <= 1e-2, errs

"""SM90 Gated DeltaNet backward, the reverse state sweep: compiled for sm_90a on any machine; on a
GPU, checked against the float32 stage-2 reference ``fused.delta_rule_bwd.reverse_sweep_ref``."""

import pytest
import torch
import torch.nn.functional as F

from tests.utils import SEG_VARLEN, assert_env_override, cu_seqlens, gdn_seg_gates, rel_l2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# (dtype, K, V, l2norm, varlen, has dht, state [V, K])
VARIANTS = [
    (torch.bfloat16, 128, 128, True, False, True, False),
    (torch.float16, 64, 64, False, True, False, True),
    (torch.bfloat16, 128, 128, True, True, False, False, torch.bfloat16),  # the training path: dvn, dH in bf16
]


@pytest.mark.compile
def test_reverse_sweep_kernel_compiles_for_sm90a(kernel_cache):
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    for v in VARIANTS:  # as served (the prefetch by TMA: CUDNN_TRAIN_GDN_SWEEP_TMA, on unless 0)
        assert callable(B90.get_dstate_kernel(*v))
    # two warpgroups splitting N (chosen where the grid leaves SMs idle); the synchronous loads
    # (CUDNN_TRAIN_GDN_SWEEP_PREFETCH=0)
    assert callable(B90.get_dstate_kernel(*VARIANTS[2], wgs=2))
    assert callable(B90.get_dstate_kernel(*VARIANTS[2], prefetch=not B90.prefetch_default()))
    # the training path's call, profile variant (tools/time_gdn_sweep.py --profile)
    assert callable(B90.get_dstate_kernel(*VARIANTS[2], profile=True))
    # the next chunk's q, k issued right after this chunk's products on them (CUDNN_TRAIN_GDN_SWEEP_EARLY_QK, the other
    # side of its default), with the cp.async prefetch
    assert callable(B90.get_dstate_kernel(*VARIANTS[2], prefetch=True, early_qk=not B90.early_qk_default(1),
                                          tma=False))
    # the other side of CUDNN_TRAIN_GDN_SWEEP_TMA: one warpgroup, two, K = 64 varlen, the profile variant
    # (time_gdn_sweep.py --tma times both)
    alt = not B90.tma_default()
    assert callable(B90.get_dstate_kernel(*VARIANTS[2], prefetch=True, tma=alt))
    assert callable(B90.get_dstate_kernel(*VARIANTS[2], wgs=2, prefetch=True, tma=alt))
    assert callable(B90.get_dstate_kernel(*VARIANTS[1], prefetch=True, tma=alt))
    assert callable(B90.get_dstate_kernel(*VARIANTS[2], prefetch=True, tma=alt, profile=True))
    assert len(list(kernel_cache.rglob("*.o"))) == len(VARIANTS) + 8


@pytest.mark.compile
def test_reverse_sweep_two_v_halves_compile_for_sm90a(kernel_cache):
    """Both V halves in one CTA, one warpgroup each (CUDNN_TRAIN_GDN_SWEEP_VH2): TMA and cp.async prefetch, K = 64
    varlen fp16 with [V, K] states and float32 outputs, the profile variant, synchronous loads, the l2norm rows eight
    threads a row (CUDNN_TRAIN_GDN_SWEEP_NORM8); not with two
    warpgroups a half or at V = 64 (a ValueError naming vh)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    k64 = (torch.float16, 64, 128, False, True, False, True)
    for v, kw in ((VARIANTS[2], dict(tma=True)), (VARIANTS[2], dict(tma=False)), (k64, dict(tma=True)),
                  (VARIANTS[2], dict(tma=True, profile=True)), (VARIANTS[2], dict(prefetch=False)),
                  (VARIANTS[2], dict(tma=True, norm8=True))):  # the l2norm rows eight threads a row (NORM8)
        assert callable(B90.get_dstate_kernel(*v, **{"prefetch": True, **kw}, vh=2))
    assert len(list(kernel_cache.rglob("*.o"))) == 6
    for v, wgs in ((VARIANTS[2], 2), (VARIANTS[1], 1)):
        with pytest.raises(ValueError, match="vh"):
            B90.get_dstate_kernel(*v, wgs=wgs, vh=2)


@pytest.mark.compile
def test_reverse_sweep_segments_compile_for_sm90a(kernel_cache):
    """The fused sweep split into segments (CUDNN_TRAIN_GDN_SWEEP_SEG): both V halves a CTA on the
    training path's outputs, one half a CTA dense with the final state's gradient; not without l2norm or the
    prefetch (a ValueError naming nseg)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    assert callable(B90.get_dstate_kernel(*VARIANTS[2], prefetch=True, vh=2, nseg=4))
    assert callable(B90.get_dstate_kernel(*VARIANTS[0], prefetch=True, nseg=16))
    assert len(list(kernel_cache.rglob("*.o"))) == 2
    for v, kw in ((VARIANTS[1], dict(prefetch=True)), (VARIANTS[0], dict(prefetch=False))):
        with pytest.raises(ValueError, match="nseg"):
            B90.get_dstate_kernel(*v, **kw, nseg=4)


def test_reverse_sweep_segments_switch(monkeypatch):
    """CUDNN_TRAIN_GDN_SWEEP_SEG: one segment unless asked (1 or unset); auto takes the fewest segments whose grid of
    both-V-halves CTAs reaches 90% of the SMs, with segments of at least 16 chunks; never without l2norm;
    a bad value is a ValueError naming it."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    monkeypatch.setattr(kc, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    monkeypatch.delenv("CUDNN_TRAIN_GDN_SWEEP_SEG", raising=False)
    assert B90.sweep_segments(1, 32, 128, 16384, True, dev) == 1
    monkeypatch.setenv("CUDNN_TRAIN_GDN_SWEEP_SEG", "1")
    assert B90.sweep_segments(1, 32, 128, 16384, True, dev) == 1
    monkeypatch.setenv("CUDNN_TRAIN_GDN_SWEEP_SEG", "auto")
    # (nseq, HV, tokens): B1 T16384 HV32 -> 4 (128 CTAs, 97% of the SMs); B4 T4096 -> 1; B1 T2048 -> 2 (4 would make
    # segments of 8 chunks)
    got = [B90.sweep_segments(n, hv, 128, t, True, dev) for n, hv, t in ((1, 32, 16384), (4, 32, 16384), (1, 32, 2048))]
    assert got == [4, 1, 2], got
    assert B90.sweep_segments(1, 32, 128, 16384, False, dev) == 1
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_SWEEP_SEG",
                        lambda: B90.sweep_segments(1, 32, 128, 16384, True, dev), "2", 2, ("0", "5", "x"))


def _sweep_segment_inputs(case):
    """The sweep's segment cases' inputs (H2 HV4 K = V = 128 bf16, gdn_seg_gates): dense B2 T2000 or varlen
    SEG_VARLEN, w and gc from the forward, do, and the final state's gradient unless ``no_dht``: ``(q, k, w, gc, do,
    dht, g, beta, cu, scale)``."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    dev, dtype, H, HV, K, V = "cuda", torch.bfloat16, 2, 4, 128, 128
    lens = SEG_VARLEN if case == "varlen" else None
    B, T = (1, sum(lens)) if lens else (2, 2000)
    nseq = len(lens) if lens else B
    q = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    k = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    v = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    beta = torch.rand(B, T, HV, device=dev, dtype=dtype)
    g = gdn_seg_gates(B, T, dev)
    cu = None if lens is None else cu_seqlens(lens, dev)
    scale = K**-0.5
    _, _, (w, _, gc) = F90.forward(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                   return_intermediates=True).value
    do = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    dht = None if case == "no_dht" else torch.randn(nseq, HV, K, V, device=dev)
    return q, k, w, gc, do, dht, g, beta, cu, scale


@pytest.mark.gpu
@pytest.mark.parametrize("case, nseg", [("dense", 4), ("dense_vh1", 4), ("varlen", 4), ("no_dht", 16)])
def test_reverse_sweep_segments(case, nseg, monkeypatch):
    """The fused sweep split into ``nseg`` segments a sequence, each after a warm-up from a zero dH reaching forward
    until the chunks' decay is below e^-20, against the unsplit fused sweep: the value head that never decays that
    far (head 0 of gdn_seg_gates, tests/utils.py) bitwise in dvn, every dH row and dh0; every head within 1e-4
    relative L2 (1e-5 for the float32 dh0; a warm-up a chunk too short is no warm-up at all for head 2, an O(1)
    error, and a search off by a chunk starts head 3 from a zero dH before a spike instead of after one); dense also
    against the float32 reference. B2 T2000 (32 chunks, a partial last one that is a warm-up chunk of the segments
    before it) with both V halves a CTA and one, varlen (SEG_VARLEN: empty, one-token and partial sequences, and
    sequences of 2 and 3 chunks, whose dh0 the second segment owns), 16 segments of 2 chunks without the final
    state's gradient."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, k, w, gc, do, dht, g, beta, cu, scale = _sweep_segment_inputs(case)
    B, T, K, (HV, V) = q.shape[0], q.shape[1], q.shape[3], do.shape[2:]
    dev, dtype = q.device, q.dtype
    monkeypatch.setattr(F90, "POISON", True)  # dense dvn, dH and dh0 start as NaN: every one must be written
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, out_dtype=dtype, wgs=1, prefetch=True,
              split=False, ws=False, vh2=case != "dense_vh1")
    outs = [B90.reverse_sweep(q, k, w, gc, do, dht, nseg=n, **kw) for n in (1, nseg)]
    rows = None if cu is None else int(F90.chunk_map(cu, 1, T, q.device)[1][-1])
    head = (lambda x: x[:, :, 0], lambda x: x[:, 0], lambda x: x[:, 0])
    for i, name in enumerate(("dvn", "dH", "dh0")):
        a, base = outs[1][i], outs[0][i]
        if name == "dH" and rows is not None:
            a, base = a[:rows], base[:rows]
        assert torch.isfinite(a).all(), f"{case}: {name} is not finite"
        assert torch.equal(head[i](a), head[i](base)), f"{case}: {name} of the slow head differs"
        err = rel_l2(a.float(), base.float())
        assert err <= (1e-5 if name == "dh0" else 1e-4), f"{case}: {name} {err:.2e} from the unsplit sweep's"
    if cu is None:
        ref = _reference(q, k, g, beta, do, torch.zeros(B, HV, K, V, device=dev) if dht is None else dht, scale, HV,
                         True)
        ref_dH = ref[1].permute(0, 2, 1, 3, 4).reshape(outs[1][1].shape)  # chunk index b * NT + c
        for name, a, b in (("dvn", outs[1][0], ref[0]), ("dH", outs[1][1], ref_dH), ("dh0", outs[1][2], ref[2])):
            assert rel_l2(a.float(), b) <= 2e-2, (name, rel_l2(a.float(), b))


@pytest.mark.compile
def test_sweep_carry_prepare_compiles_for_sm90a(kernel_cache):
    """The carried split's prepare step for the sweep (CUDNN_TRAIN_GDN_SWEEP_CARRY, prepared): the fused sweep
    walking into each boundary, L's and M's columns in one grid; both V halves a CTA at K = V = 128 in 4 segments,
    one half varlen fp16 K = V = 64 in 16; a ValueError naming prep_cap for what it does not take."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    assert callable(B90.get_dstate_kernel(torch.bfloat16, 128, 128, True, False, False, False, torch.bfloat16, 1, True,
                                          tma=True, vh=2, nseg=4, prep_cap=16))
    assert callable(B90.get_dstate_kernel(torch.float16, 64, 64, True, True, False, False, torch.float16, 1, True,
                                          tma=True, nseg=16, prep_cap=4))
    assert len(list(kernel_cache.rglob("*.o"))) == 2
    for nseg, has_dht, cap in ((1, False, 16), (4, True, 16), (4, False, -1)):
        with pytest.raises(ValueError, match="prep_cap"):
            B90.get_dstate_kernel(torch.bfloat16, 128, 128, True, False, has_dht, False, torch.bfloat16, 1, True,
                                  vh=2, nseg=nseg, prep_cap=cap)


def test_sweep_carry_switch_and_combine(monkeypatch):
    """CUDNN_TRAIN_GDN_SWEEP_CARRY: off unless asked, auto as the segments' count (B1 T16384 HV32: 4), a bad value
    names it; the combine against its recurrence written out (from the sequence's end, the final state's gradient
    last)."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90
    from cudnn_train.kernels import gated_delta_rule_common_sm90 as cm

    monkeypatch.setattr(kc, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    monkeypatch.delenv("CUDNN_TRAIN_GDN_SWEEP_CARRY", raising=False)
    assert B90.carry_segments(1, 32, 128, 128, 16384, True, dev) == 1
    monkeypatch.setenv("CUDNN_TRAIN_GDN_SWEEP_CARRY", "auto")
    assert [B90.carry_segments(n, 32, 128, 128, 16384, True, dev) for n in (1, 4)] == [4, 1]
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_SWEEP_CARRY",
                        lambda: B90.carry_segments(1, 32, 128, 128, 16384, True, dev), "8", 8, ("3", "x"))

    gen = torch.Generator().manual_seed(0)
    nseq, nseg, HV, K, V = 3, 4, 2, 8, 16
    LM = torch.randn(nseq * (nseg - 1), HV, K, V + K, generator=gen)
    dht = torch.randn(nseq, HV, K, V, generator=gen)
    ends = cm.combine_carries(LM, dht, nseq, nseg, V, reverse=True).view(nseq, nseg, HV, K, V)
    for n in range(nseq):
        E = dht[n].double()
        assert torch.equal(ends[n, nseg - 1], dht[n])
        for s in range(nseg - 2, -1, -1):
            row = LM[n * (nseg - 1) + s].double()
            E = row[..., V:] @ E + row[..., :V]
            assert torch.allclose(ends[n, s].double(), E, rtol=1e-6, atol=1e-6), (n, s)


@pytest.mark.gpu
@pytest.mark.parametrize("case, nseg", [("dense", 4), ("varlen", 4), ("no_dht", 16)])
def test_carried_sweep(case, nseg, monkeypatch):
    """The reverse sweep with its carried split (CUDNN_TRAIN_GDN_SWEEP_CARRY: prepare, combine, the sweep over the
    segments as sequences from their end gradients) against the unsplit sweep and, dense, the float32 reference:
    dvn, every dH row and dh0 finite, dense within 1.25x the unsplit sweep's error against the reference (the
    carry's products round differently: not the unsplit bits) and varlen within 1e-2 of the unsplit sweep (an O(1)
    error where a transition is missing or wrong: head 0 of gdn_seg_gates never decays, so every boundary is
    carried). B2 T2000 with the final state's gradient, varlen (SEG_VARLEN: empty, one-token and partial
    sequences, sequences of fewer chunks than segments), 16 segments of 2 chunks without it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, k, w, gc, do, dht, g, beta, cu, scale = _sweep_segment_inputs(case)
    B, T, K, (HV, V) = q.shape[0], q.shape[1], q.shape[3], do.shape[2:]
    dev, dtype = q.device, q.dtype
    monkeypatch.setattr(F90, "POISON", True)  # dense outputs start as NaN: every one must be written
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, out_dtype=dtype)
    outs = [B90.reverse_sweep(q, k, w, gc, do, dht, carry=n, **kw) for n in (1, nseg)]
    rows = None if cu is None else int(F90.chunk_map(cu, 1, T, q.device)[1][-1])
    for i, name in enumerate(("dvn", "dH", "dh0")):
        a, base = outs[1][i], outs[0][i]
        if name == "dH" and rows is not None:
            a, base = a[:rows], base[:rows]
        assert a.shape == base.shape, (name, a.shape, base.shape)
        assert torch.isfinite(a).all(), f"{case}: {name} is not finite"
        if cu is not None:
            assert rel_l2(a.float(), base.float()) <= 1e-2, (name, rel_l2(a.float(), base.float()))
    if cu is None:
        ref = _reference(q, k, g, beta, do, torch.zeros(B, HV, K, V, device=dev) if dht is None else dht, scale, HV,
                         True)
        ref_dH = ref[1].permute(0, 2, 1, 3, 4).reshape(outs[1][1].shape)  # chunk index b * NT + c
        for i, (name, r) in enumerate((("dvn", ref[0]), ("dH", ref_dH), ("dh0", ref[2]))):
            err, err_base = rel_l2(outs[1][i].float(), r), rel_l2(outs[0][i].float(), r)
            assert err <= 1.25 * err_base, f"{case}: {name} {err:.3e} from the reference against {err_base:.3e}"


@pytest.mark.compile
def test_reverse_sweep_on_tm_compiles_for_sm90a(kernel_cache):
    """The fused sweep on the forward's chunk inverses Tm and the effective beta instead of w (``tw``, for the
    training forward that forms w and u in its chain, CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY): both V halves a CTA with
    the dH / dvn TMA stores (the B4 call), one warpgroup a 64-column half varlen with the final state's gradient,
    K = V = 64 fp16 without l2norm with [V, K] states; it takes the TMA loads, one warpgroup a V half, no segments."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    b4 = (torch.bfloat16, 128, 128, True, False, False, False, torch.bfloat16)
    k64 = (torch.float16, 64, 64, False, True, True, True, torch.float16)
    assert callable(B90.get_dstate_kernel(*b4, prefetch=True, tma=True, vh=2, tw=True))
    assert callable(B90.get_dstate_kernel(torch.bfloat16, 128, 128, True, True, True, False, torch.bfloat16,
                                          prefetch=True, tma=True, tw=True))
    assert callable(B90.get_dstate_kernel(*k64, prefetch=True, tma=True, tw=True))
    assert len(list(kernel_cache.rglob("*.o"))) == 3
    for bad in (dict(tma=False), dict(wgs=2), dict(vh=2, nseg=4), dict(profile=True)):
        with pytest.raises(ValueError, match="tw"):
            B90.get_dstate_kernel(*b4, **{"prefetch": True, "tma": True, **bad}, tw=True)


def test_sweep_takes_tm_only_where_the_fused_kernel_runs(monkeypatch):
    """``sweep_takes_tm`` (whether the training forward may leave w out): the fused kernel with its TMA loads and
    the prefetch, not where the split pair, the segments, the carried split or the specialized warpgroups take the
    call (B1 T16384's grid: the split pair); the switches that move it read at the call."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    monkeypatch.setattr(kc, "num_sms", lambda device=None: 132)
    for env in ("CUDNN_TRAIN_GDN_SWEEP_SPLIT", "CUDNN_TRAIN_GDN_SWEEP_SEG", "CUDNN_TRAIN_GDN_SWEEP_CARRY",
                "CUDNN_TRAIN_GDN_SWEEP_WS", "CUDNN_TRAIN_GDN_SWEEP_TMA", "CUDNN_TRAIN_GDN_SWEEP_PREFETCH"):
        monkeypatch.delenv(env, raising=False)
    b4 = (4, 32, 128, 128, 4 * 4096, True, "cpu")
    assert B90.sweep_takes_tm(*b4)
    assert not B90.sweep_takes_tm(1, 32, 128, 128, 16384, True, "cpu")  # the split pair's grid
    for env, val in (("CUDNN_TRAIN_GDN_SWEEP_SPLIT", "1"), ("CUDNN_TRAIN_GDN_SWEEP_SEG", "4"),
                     ("CUDNN_TRAIN_GDN_SWEEP_TMA", "0"), ("CUDNN_TRAIN_GDN_SWEEP_PREFETCH", "0")):
        monkeypatch.setenv(env, val)
        assert not B90.sweep_takes_tm(*b4), env
        monkeypatch.delenv(env)
    assert B90.sweep_takes_tm(*b4)


@pytest.mark.compile
def test_reverse_sweep_dh_tma_store_compiles_for_sm90a(kernel_cache):
    """dH by stmatrix and TMA stores (CUDNN_TRAIN_GDN_SWEEP_DHTMA, on by default; its stmatrix value order is
    asserted for every thread while tracing): both V halves in one CTA, two warpgroups splitting N, K = V = 64
    varlen fp16 with [V, K] states, and the element stores of the switch's other side; float32 dH (the op's own
    backward) takes the element stores, one kernel with the switch on or off."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    k64 = (torch.float16, 64, 64, False, True, False, True, torch.float16)
    for v, kw in ((VARIANTS[2], dict(vh=2)), (VARIANTS[2], dict(wgs=2)), (k64, {})):
        assert callable(B90.get_dstate_kernel(*v, prefetch=True, tma=True, dh_tma=True, **kw))
    assert callable(B90.get_dstate_kernel(*VARIANTS[2], prefetch=True, tma=True, dh_tma=False, vh=2))
    # dvn's TMA stores (CUDNN_TRAIN_GDN_SWEEP_DVNTMA) are on by default with dH's: the other side, dvn by elements
    assert callable(B90.get_dstate_kernel(*VARIANTS[2], prefetch=True, tma=True, dh_tma=True, dvn_tma=False, vh=2))
    assert len(list(kernel_cache.rglob("*.o"))) == 5
    B90.get_dstate_kernel(*VARIANTS[0], prefetch=True, tma=True, dh_tma=True)
    B90.get_dstate_kernel(*VARIANTS[0], prefetch=True, tma=True, dh_tma=False)
    assert len(list(kernel_cache.rglob("*.o"))) == 6


def test_dh_and_dvn_tma_store_switches_parse(monkeypatch):
    """dH's and dvn's TMA stores on by default; each switch takes 1 / 0, anything else names it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    for name, pick, default in (("CUDNN_TRAIN_GDN_SWEEP_DHTMA", B90.dh_tma_default, True),
                                ("CUDNN_TRAIN_GDN_SWEEP_DVNTMA", B90.dvn_tma_default, True)):
        monkeypatch.delenv(name, raising=False)
        assert pick() is default
        assert_env_override(monkeypatch, name, pick, "0" if default else "1", not default, ("2", "off"))


def test_sweep_norm8_switch_is_off_by_default_and_parses(monkeypatch):
    """CUDNN_TRAIN_GDN_SWEEP_NORM8 is off by default (GPU-run: within noise), 1 turns it on, a typo names it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    monkeypatch.delenv("CUDNN_TRAIN_GDN_SWEEP_NORM8", raising=False)
    assert B90.norm8_default() is False
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_SWEEP_NORM8", B90.norm8_default, "1", True, ("2", "on"))


@pytest.mark.compile
def test_specialized_warpgroup_sweep_compiles_for_sm90a(kernel_cache):
    """The reverse sweep on two specialized warpgroups (CUDNN_TRAIN_GDN_SWEEP_WS), the training path's call and a
    varlen K = 64 one."""
    from cudnn_train.kernels import gated_delta_rule_bwd_ws_sm90 as SW

    assert callable(SW.get_kernel(*VARIANTS[2]))
    assert callable(SW.get_kernel(torch.float16, 64, 128, False, True, True, True))
    # its loads by TMA (CUDNN_TRAIN_GDN_SWEEP_WS_TMA)
    assert callable(SW.get_kernel(*VARIANTS[2], tma=True))
    assert callable(SW.get_kernel(torch.float16, 64, 128, False, True, True, True, tma=True))
    assert len(list(kernel_cache.rglob("*.o"))) == 4
    with pytest.raises(ValueError, match="K=96"):
        SW.get_kernel(torch.bfloat16, 96, 128, True, False, False, False)


@pytest.mark.compile
def test_split_sweep_kernels_compile_for_sm90a(kernel_cache):
    """The split sweep (``gated_delta_rule_bwd_split_sm90``, opt-in): ``dvl`` and ``dchain`` at both V blocks,
    dense and varlen, both state layouts, K = 128 and 64."""
    from cudnn_train.kernels import gated_delta_rule_bwd_split_sm90 as S

    assert callable(S.get_dvl_kernel(torch.bfloat16, 128, 128, True, False))
    assert callable(S.get_dvl_kernel(torch.float16, 64, 128, False, True))
    for vb in S.VBLOCKS:
        assert callable(S.get_dchain_kernel(torch.bfloat16, 128, 128, vb, True, False, True, False))
    assert callable(S.get_dchain_kernel(torch.float16, 64, 128, 32, False, True, False, True))
    # dvl with P in two passes (CUDNN_TRAIN_GDN_DVL_P2)
    assert callable(S.get_dvl_kernel(torch.bfloat16, 128, 128, True, False, p2=not S.dvl_p_two_pass()))
    # the other side of dchain's loads (CUDNN_TRAIN_GDN_DCHAIN_TMA: by TMA unless 0): both V blocks at K = 128,
    # K = 64 varlen
    alt = not S.dchain_tma()
    for vb in S.VBLOCKS:
        assert callable(S.get_dchain_kernel(torch.bfloat16, 128, 128, vb, True, False, True, False, tma=alt))
    assert callable(S.get_dchain_kernel(torch.float16, 64, 128, 32, False, True, False, True, tma=alt))
    # the other side of dchain's stores (CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA: dH rows and dvn by TMA unless 0): every V
    # block at K = 128, K = 64 varlen with [V, K] states, and with the cp.async loads
    st = not S.dchain_store_tma()
    for vb in S.VBLOCKS:
        assert callable(S.get_dchain_kernel(torch.bfloat16, 128, 128, vb, True, False, True, False, store_tma=st))
    assert callable(S.get_dchain_kernel(torch.float16, 64, 128, 32, False, True, False, True, store_tma=st))
    assert callable(S.get_dchain_kernel(torch.bfloat16, 128, 128, 32, True, False, True, False, tma=alt, store_tma=st))
    assert len(list(kernel_cache.rglob("*.o"))) == 3 * len(S.VBLOCKS) + 7


def test_dchain_store_tma_switch_parses(monkeypatch):
    """dchain's TMA stores are on by default; the switch takes 1 / 0, anything else names it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_split_sm90 as S

    monkeypatch.delenv("CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA", raising=False)
    assert S.dchain_store_tma() is True
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA", S.dchain_store_tma, "0", False, ("2", "off"))


def test_split_sweep_v_block_default(monkeypatch):
    """dchain's V columns a CTA: 64 where N HV V/64 CTAs fill the SMs, else 32 where N HV V/32 do, else 16 (B1
    T16384 HV32 measured 0.886 ms at 16 against 0.931 at 32), but 32 at K = 64 (16 not GPU-run there);
    CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB overrides, a bad value a ValueError naming it."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_bwd_split_sm90 as BS

    monkeypatch.setattr(kc, "num_sms", lambda device: 132)
    monkeypatch.delenv("CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB", raising=False)
    dev = torch.device("cpu")
    shapes = ((4, 32, 128), (1, 32, 128), (2, 32, 128), (1, 66, 128), (2, 33, 64), (1, 32, 64), (3, 44, 64))
    assert [BS.vblock(n, hv, V, dev) for n, hv, V in shapes] == [64, 16, 32, 64, 32, 16, 64]
    assert [BS.vblock(n, hv, V, dev, K=64) for n, hv, V in shapes] == [64, 32, 32, 64, 32, 32, 64]
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB", lambda: BS.vblock(1, 32, 128, dev), "32", 32,
                        ("8", "abc", "128"))


def test_two_v_halves_default_by_the_grid(monkeypatch):
    """The fused sweep's two V halves a CTA where the N x HV x V/64 CTAs a half exceed one wave (B4 T4096 HV32: 256
    CTAs, measured 0.495 against 0.586 ms), a CTA a half at one wave or less (halving the grid would leave SMs idle)
    and at V = 64 (one half);
    CUDNN_TRAIN_GDN_SWEEP_VH2 = 1 / 0 forces it, a bad value a ValueError naming it."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    monkeypatch.setattr(kc, "num_sms", lambda device: 132)
    monkeypatch.delenv("CUDNN_TRAIN_GDN_SWEEP_VH2", raising=False)
    dev = torch.device("cpu")
    shapes = ((4, 32, 128), (1, 32, 128), (2, 33, 128), (1, 67, 128), (5, 32, 64))
    assert [B90.vh2_default(n, hv, V, dev) for n, hv, V in shapes] == [True, False, False, True, False]
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_SWEEP_VH2", lambda: B90.vh2_default(1, 32, 128, dev), "1", True,
                        ("2", "yes please"))
    monkeypatch.setenv("CUDNN_TRAIN_GDN_SWEEP_VH2", "0")
    assert not B90.vh2_default(4, 32, 128, dev)


def test_reverse_sweep_declines_without_gpu_before_touching_memory():
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU decline")
    q = torch.randn(1, 8, 1, 64, dtype=torch.bfloat16)
    with pytest.raises(Unsupported):
        B90.reverse_sweep(q, q, q, torch.zeros(1, 8, 1), q, scale=0.125)


# ------------------------------------------------------------------ GPU tier


def _l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _case_inputs(B, T, H, HV, K, V, dtype, l2norm, lens=None):
    """A sweep case's forward inputs ``(q, k, v, g, beta, cu, scale)`` on the GPU (q, k unit rows without l2norm)."""
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    k = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    if not l2norm:
        q, k = _l2n(q.float()).to(dtype), _l2n(k.float()).to(dtype)
    v = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.rand(B, T, HV, device=dev))
    beta = torch.rand(B, T, HV, device=dev, dtype=dtype)
    return q, k, v, g, beta, None if lens is None else cu_seqlens(lens, dev), K**-0.5


def _case(B, T, H, HV, K, V, dtype, l2norm, lens=None):
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, k, v, g, beta, cu, scale = _case_inputs(B, T, H, HV, K, V, dtype, l2norm, lens)
    o, _, (w, u, gc) = F90.forward(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu,
                                   return_intermediates=True).value
    return q, k, g, beta, w, gc, cu, scale


def _reference(q, k, g, beta, do, dht, scale, HV, l2norm):
    from cudnn_train.fused.delta_rule_bwd import reverse_sweep_ref

    rep = HV // q.shape[2]
    qf, kf = (_l2n(x.float()) if l2norm else x.float() for x in (q, k))
    qf, kf = qf.repeat_interleave(rep, dim=2), kf.repeat_interleave(rep, dim=2)
    return reverse_sweep_ref(qf, kf, g.float().unsqueeze(-1), beta.float(), scale, do.float(), dht, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reverse_sweep_matches_reference(T, dtype):
    _check_dense(T, dtype, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 65, 300])
def test_reverse_sweep_two_warpgroups_matches_reference(T):
    _check_dense(T, torch.bfloat16, 2)


def _check_dense(T, dtype, wgs):
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    Bn, H, HV, K, V = 2, 2, 4, 128, 128
    q, k, g, beta, w, gc, _, scale = _case(Bn, T, H, HV, K, V, dtype, l2norm=True)
    do = torch.randn(Bn, T, HV, V, device="cuda", dtype=dtype)
    dht = torch.randn(Bn, HV, K, V, device="cuda")
    outs = B90.reverse_sweep(q, k, w, gc, do, dht, scale=scale, use_qk_l2norm_in_kernel=True, wgs=wgs)
    _assert_dense_matches_reference(outs, q, k, g, beta, do, dht, scale)


def _assert_dense_matches_reference(outs, q, k, g, beta, do, dht, scale):
    """A dense l2norm sweep's (dvn, dH, dh0) finite and within 2e-2 relative L2 of :func:`_reference`."""
    ref_dvn, ref_dH, ref_dh0 = _reference(q, k, g, beta, do, dht, scale, do.shape[2], True)
    Bn, HV, NC = ref_dH.shape[:3]
    ref_dH = ref_dH.permute(0, 2, 1, 3, 4).reshape(Bn * NC, HV, *ref_dH.shape[3:])  # chunk index b * NT + c
    for name, a, b in zip(("dvn", "dH", "dh0"), outs, (ref_dvn, ref_dH, ref_dh0)):
        assert torch.isfinite(a).all(), name
        assert rel_l2(a, b) <= 2e-2, (name, rel_l2(a, b))


VARLEN_LENS = [1, 63, 130, 64, 0, 7]  # empty, one-token and odd sequences; GVA 4, K = 64, no l2norm


def _varlen_case(state_v_first):
    """``(q, k, g, beta, w, gc, cu, scale, do, dht, dht_in)``: the varlen case, dht ``[N, HV, K, V]`` and as
    the sweep takes it (``[N, HV, V, K]`` with ``state_v_first``)."""
    T, H, HV, K, V = sum(VARLEN_LENS), 1, 4, 64, 128
    q, k, g, beta, w, gc, cu, scale = _case(1, T, H, HV, K, V, torch.bfloat16, l2norm=False, lens=VARLEN_LENS)
    do = torch.randn(1, T, HV, V, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(len(VARLEN_LENS), HV, K, V, device="cuda")
    return q, k, g, beta, w, gc, cu, scale, do, dht, dht.transpose(-1, -2).contiguous() if state_v_first else dht


def _check_varlen(dvn, dh0, case, state_v_first):
    """dvn and dh0 of the varlen case, sequence by sequence, against the reference (an empty sequence's
    dh0 is its dht as it is)."""
    q, k, g, beta, _w, _gc, cu, scale, do, dht, _ = case
    if state_v_first:
        dh0 = dh0.transpose(-1, -2)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if e == s:
            assert torch.equal(dh0[n], dht[n])
            continue
        sl = slice(s, e)
        ref_dvn, _, ref_dh0 = _reference(q[:, sl], k[:, sl], g[:, sl], beta[:, sl], do[:, sl], dht[n : n + 1],
                                         scale, do.shape[2], False)
        assert rel_l2(dvn[:, sl].float(), ref_dvn) <= 2e-2, (n, rel_l2(dvn[:, sl].float(), ref_dvn))
        assert rel_l2(dh0[n : n + 1], ref_dh0) <= 2e-2, (n, rel_l2(dh0[n : n + 1], ref_dh0))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 65, 300])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_reverse_sweep_specialized_warpgroups_match_reference_and_fused(T, out_dtype):
    """The sweep on two specialized warpgroups (CUDNN_TRAIN_GDN_SWEEP_WS): dvn, every chunk's dH and dh0 against
    the reference, and close to the fused kernel's (dvn's two terms summed in another order)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    Bn, H, HV, K, V = 2, 2, 4, 128, 128
    q, k, g, beta, w, gc, _, scale = _case(Bn, T, H, HV, K, V, torch.bfloat16, l2norm=True)
    do = torch.randn(Bn, T, HV, V, device="cuda", dtype=torch.bfloat16)
    dht = torch.randn(Bn, HV, K, V, device="cuda")
    args = dict(scale=scale, use_qk_l2norm_in_kernel=True, out_dtype=out_dtype, split=False)
    got = B90.reverse_sweep(q, k, w, gc, do, dht, ws=True, **args)
    ref_dvn, ref_dH, ref_dh0 = _reference(q, k, g, beta, do, dht, scale, HV, True)
    NC = ref_dH.shape[2]
    ref_dH = ref_dH.permute(0, 2, 1, 3, 4).reshape(Bn * NC, HV, K, V)
    fused = B90.reverse_sweep(q, k, w, gc, do, dht, ws=False, **args)
    for name, a, r, f in zip(("dvn", "dH", "dh0"), got, (ref_dvn, ref_dH, ref_dh0), fused):
        assert torch.isfinite(a).all(), name
        assert rel_l2(a.float(), r) <= 2e-2, (name, rel_l2(a.float(), r))
        assert rel_l2(a.float(), f.float()) <= 2e-3, (name, "vs fused", rel_l2(a.float(), f.float()))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["T300", "T900", "T65_fp32_out", "varlen", "varlen_vk", "varlen_nan_tail"])
def test_reverse_sweep_specialized_warpgroups_tma_is_bitwise_cp_async(case):
    """The specialized-warpgroup sweep with its loads by TMA (CUDNN_TRAIN_GDN_SWEEP_WS_TMA: one thread issues a
    chunk's q, k, w, do on the chunk's mbarrier; the first chunk taken, a sequence's last, has its rows past the
    end zeroed once landed) brings the same bytes as cp.async: dvn, every dH row and dh0 bitwise equal. Dense T
    300 and 65 (rows past the tensor's end), 900 (15 chunks: every one of the six mbarriers armed again, both
    phases waited), varlen GVA 4 at K = 64 with empty, one-token and odd sequences in both state layouts, and NaN
    in the rows past the last sequence."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    if case.startswith("varlen"):
        q, k, _g, _beta, w, gc, cu, scale, do, _dht, dht = _varlen_case(case == "varlen_vk")
        args = dict(scale=scale, cu_seqlens=cu, state_v_first=case == "varlen_vk", out_dtype=torch.bfloat16)
        if case == "varlen_nan_tail":  # 37 more rows past the last sequence, NaN
            q, k, w, gc, do = (torch.cat([x, torch.full((1, 37, *x.shape[2:]), float("nan"), device=x.device,
                                                        dtype=x.dtype)], 1) for x in (q, k, w, gc, do))
    else:
        T = {"T300": 300, "T900": 900}.get(case, 65)
        q, k, _g, _beta, w, gc, _, scale = _case(2, T, 2, 4, 128, 128, torch.bfloat16, l2norm=True)
        do = torch.randn(2, T, 4, 128, device="cuda", dtype=torch.bfloat16)
        dht = torch.randn(2, 4, 128, 128, device="cuda")
        args = dict(scale=scale, use_qk_l2norm_in_kernel=True,
                    out_dtype=torch.float32 if case.endswith("fp32_out") else torch.bfloat16)
    want = B90.reverse_sweep(q, k, w, gc, do, dht, split=False, ws=True, ws_tma=False, **args)
    got = B90.reverse_sweep(q, k, w, gc, do, dht, split=False, ws=True, ws_tma=True, **args)
    rows = None
    if case.startswith("varlen"):  # dH rows past the varlen chunk count are never written: compare the written ones
        rows = int(cu.new_tensor([(n + 63) // 64 for n in VARLEN_LENS]).sum())
    for name, a, b in zip(("dvn", "dH", "dh0"), got, want):
        if name == "dH" and rows is not None:
            a, b = a[:rows], b[:rows]
        if name == "dvn" and case == "varlen_nan_tail":
            a, b = a[:, : int(cu[-1])], b[:, : int(cu[-1])]
        assert torch.isfinite(a).all(), f"{case}: {name} is not finite"
        assert torch.equal(a, b), f"{case}: {name} differs with the TMA loads"


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_reverse_sweep_specialized_warpgroups_varlen_gva_k64(state_v_first):
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    case = _varlen_case(state_v_first)
    q, k, _g, _beta, w, gc, cu, scale, do, _dht, dht_in = case
    dvn, _, dh0 = B90.reverse_sweep(q, k, w, gc, do, dht_in, scale=scale, cu_seqlens=cu, state_v_first=state_v_first,
                                    split=False, ws=True)
    _check_varlen(dvn, dh0, case, state_v_first)


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_reverse_sweep_varlen_gva_and_state_layouts(state_v_first):
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    case = _varlen_case(state_v_first)
    q, k, _g, _beta, w, gc, cu, scale, do, _dht, dht_in = case
    dvn, _, dh0 = B90.reverse_sweep(q, k, w, gc, do, dht_in, scale=scale, cu_seqlens=cu, state_v_first=state_v_first)
    _check_varlen(dvn, dh0, case, state_v_first)


@pytest.mark.gpu
@pytest.mark.parametrize("wgs", [1, 2])
@pytest.mark.parametrize("case", ["dense", "varlen_gva_64"])
def test_reverse_sweep_prefetch_is_bitwise_the_synchronous_loads(case, wgs):
    """The next chunk's loads in flight during this one (cp.async, the default; also with q and k issued
    early, ``early_qk``) change no product and no order: dvn, every dH and dh0 bitwise equal to the
    synchronous loads', and against the reference."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    if case == "dense":
        lens, Bn, T, H, HV, K, dt = None, 2, 300, 2, 4, 128, torch.bfloat16
    else:
        if wgs == 2:
            pytest.skip("two warpgroups serve K = 128 only")
        lens, Bn, H, HV, K, dt = [1, 63, 130, 64, 0, 7, 200], 1, 1, 4, 64, torch.float16
        T = sum(lens)
    q, k, g, beta, w, gc, cu, scale = _case(Bn, T, H, HV, K, K, dt, l2norm=True, lens=lens)
    do = torch.randn(Bn, T, HV, K, device="cuda", dtype=dt)
    dht = torch.randn(Bn if lens is None else len(lens), HV, K, K, device="cuda")
    outs = [B90.reverse_sweep(q, k, w, gc, do, dht, scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                              out_dtype=dt, wgs=wgs, prefetch=pf, split=False, early_qk=eq)
            for pf, eq in ((True, False), (False, False), (True, True))]
    if lens is not None:  # dH rows past the varlen chunk count are never written: compare the written ones
        from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

        rows = int(F90.chunk_map(cu, 1, T, q.device)[1][-1])
        outs = [(dvn, dH[:rows], dh0) for dvn, dH, dh0 in outs]
    for name, a, b, c in zip(("dvn", "dH", "dh0"), *outs):
        assert torch.isfinite(a).all(), f"{name}: not every element written"
        assert torch.equal(a, b), f"{case}, wgs {wgs}: {name} differs with the prefetch"
        assert torch.equal(c, b), f"{case}, wgs {wgs}: {name} differs with q, k prefetched early"
    if lens is None:
        ref_dvn, _, ref_dh0 = _reference(q, k, g, beta, do, dht, scale, HV, True)
        assert rel_l2(outs[0][0].float(), ref_dvn) <= 2e-2
        assert rel_l2(outs[0][2], ref_dh0) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense_vh2", "dense_vh1", "T65_fp16", "varlen_k64_no_l2norm_vk"])
def test_reverse_sweep_on_tm_matches_the_sweep_on_w(case, monkeypatch):
    """The sweep on the forward's chunk inverses Tm and the effective beta (``reverse_sweep(beta=)``, for the
    training forward that forms w and u in its chain): dvn, dH and dh0 within 1e-2 relative L2 of the sweep on the
    same forward's w (the bf16 rounding point moves from w to Y = dvn^T Tm), the dense ones within 2e-2 of the
    reference, every element the sweep on w writes written and nothing else; both V halves a CTA and one (B2 T300
    bf16), fp16 T65 (a partial chunk, rows past the tensor's end), varlen K = V = 64 without l2norm with [V, K]
    states (empty, one-token, partial sequences; dH's surplus chunk rows unwritten by both). Outputs NaN-filled
    first. A bad beta is a ValueError naming it; a sweep form that cannot take Tm (the split pair) declines."""
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setattr(F90, "POISON", True)

    varlen = case.startswith("varlen")
    if varlen:
        lens, Bn, H, HV, K, dt, l2norm, vk = [1, 63, 130, 64, 0, 7, 200], 1, 1, 4, 64, torch.float16, False, True
        T = sum(lens)
    else:
        lens, Bn, H, HV, K, l2norm, vk = None, 2, 2, 4, 128, True, False
        T, dt = (65, torch.float16) if case.startswith("T65") else (300, torch.bfloat16)
    q, k, v, g, beta, cu, scale = _case_inputs(Bn, T, H, HV, K, K, dt, l2norm, lens)
    _, _, (w, _, gc, _, _, tm) = F90.forward(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=l2norm,
                                             cu_seqlens=cu, store_states=True, keep_vn=True, keep_tm=True).value
    do = torch.randn(Bn, T, HV, K, device="cuda", dtype=dt)
    N = Bn if lens is None else len(lens)
    dht = torch.randn(N, HV, K, K, device="cuda")
    kw = dict(scale=scale, use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu, state_v_first=vk, out_dtype=dt,
              vh2=case != "dense_vh1" if K == 128 else None)
    base = B90.reverse_sweep(q, k, w, gc, do, dht, **kw)
    new = B90.reverse_sweep(q, k, tm, gc, do, dht, beta=beta.float(), **kw)
    for name, a, b in zip(("dvn", "dH", "dh0"), new, base):
        written = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), written), f"{name}: written elements differ"
        err = rel_l2(a[written].float(), b[written].float())
        assert err <= 1e-2, (name, err)
    if not varlen:
        _assert_dense_matches_reference([x.float() for x in new], q, k, g, beta, do, dht, scale)
    with pytest.raises(ValueError, match="beta"):
        B90.reverse_sweep(q, k, tm, gc, do, dht, beta=beta, **kw)  # not float32
    with pytest.raises(Unsupported, match="Tm"):
        B90.reverse_sweep(q, k, tm, gc, do, dht, beta=beta.float(), split=True, **kw)


def _bitwise_case(case, V=None):
    """Inputs of the fused sweep's bitwise cases: ``(q, k, g, beta, w, gc, cu, scale, do, dht, T, lens, rows)``.
    ``varlen...``: GVA 4 at K = 64, fp16, with empty, one-token and odd sequences (``varlen_nan_tail``: 37 NaN
    rows past the last sequence); ``T65...``: fp16, rows past the tensor's end; else dense T 300 bf16 at K = 128.
    V defaults to K; ``no_dht``: no final state's gradient. ``rows``: the varlen chunk count (None if dense)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    if case.startswith("varlen"):
        lens, Bn, H, HV, K, dt = [1, 63, 130, 64, 0, 7, 200], 1, 1, 4, 64, torch.float16
        T = sum(lens)
    else:
        lens, Bn, H, HV, K = None, 2, 2, 4, 128
        T, dt = (65, torch.float16) if case.startswith("T65") else (300, torch.bfloat16)
    V = K if V is None else V
    q, k, g, beta, w, gc, cu, scale = _case(Bn, T, H, HV, K, V, dt, l2norm=True, lens=lens)
    do = torch.randn(Bn, T, HV, V, device="cuda", dtype=dt)
    dht = None if case == "no_dht" else torch.randn(Bn if lens is None else len(lens), HV, K, V, device="cuda")
    rows = None if lens is None else int(F90.chunk_map(cu, 1, T, q.device)[1][-1])
    if case == "varlen_nan_tail":  # 37 more rows past the last sequence, NaN
        q, k, w, gc, do = (torch.cat([x, torch.full((1, 37, *x.shape[2:]), float("nan"), device=x.device,
                                                    dtype=x.dtype)], 1) for x in (q, k, w, gc, do))
    return q, k, g, beta, w, gc, cu, scale, do, dht, T, lens, rows


@pytest.mark.gpu
@pytest.mark.parametrize("case, vh2, wgs", [("dense", True, None), ("dense", False, 1), ("dense", False, 2),
                                            ("T65_fp16", True, None), ("varlen_gva_64", False, 1)])
def test_reverse_sweep_norm8_matches_the_thread_a_row_norms(case, vh2, wgs, monkeypatch):
    """The fused sweep's l2norm factors by every thread, eight a row (CUDNN_TRAIN_GDN_SWEEP_NORM8), against a thread a
    row: the same sums in another order, so dvn, dH (input dtype) within 1e-3 relative L2 and dh0 (float32) within
    1e-4 where the kernel writes them, every element finite, and the switched sweep within 2e-2 of the reference
    (dense): both V halves a CTA, one warpgroup a half, two splitting N, fp16 at T 65, varlen GVA 4 at K = 64 with
    empty, one-token and odd sequences. A row summed wrongly would move dvn and dH by O(1)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    q, k, g, beta, w, gc, cu, scale, do, dht, T, lens, rows = _bitwise_case(case)
    outs = []
    for on in ("0", "1"):
        monkeypatch.setenv("CUDNN_TRAIN_GDN_SWEEP_NORM8", on)
        outs.append(B90.reverse_sweep(q, k, w, gc, do, dht, scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                      out_dtype=q.dtype, wgs=wgs, vh2=vh2, split=False, nseg=1, carry=1))
    for name, a, b in _written(outs, T, lens, rows):
        assert torch.isfinite(b).all(), f"{case}: {name} is not finite with NORM8"
        bound = 1e-4 if b.dtype == torch.float32 else 1e-3
        assert rel_l2(b, a) <= bound, f"{case}: {name} rel L2 {rel_l2(b, a):.1e} with NORM8"
    if lens is None:
        _assert_dense_matches_reference(outs[1], q, k, g, beta, do, dht, scale)


def _written(outs, T, lens, rows):
    """``(name, a, b)`` for dvn, dH and dh0 of two sweeps' outputs, cut to where the kernels write them (not the dH
    rows past the varlen chunk count, nor dvn's rows past the last sequence)."""
    for name, a, b in zip(("dvn", "dH", "dh0"), *outs):
        if name == "dH" and rows is not None:
            a, b = a[:rows], b[:rows]
        if name == "dvn" and lens is not None:
            a, b = a[:, :T], b[:, :T]
        yield name, a, b


def _assert_written_bitwise(outs, T, lens, rows, what):
    """dvn, dH and dh0 of two sweeps bitwise equal where the kernels write them, and finite."""
    for name, a, b in _written(outs, T, lens, rows):
        assert torch.isfinite(b).all(), f"{what}: {name} is not finite"
        assert torch.equal(a, b), f"{what}: {name} differs"


@pytest.mark.gpu
@pytest.mark.parametrize("case, wgs, early_qk", [("dense", 1, True), ("dense", 2, False), ("dense", 1, False),
                                                 ("T65_fp16", 1, True), ("T65_fp16", 2, False),
                                                 ("varlen_gva_64", 1, True), ("varlen_nan_tail", 1, True)])
def test_reverse_sweep_tma_prefetch_is_bitwise_cp_async(case, wgs, early_qk):
    """The fused sweep's prefetch by TMA (CUDNN_TRAIN_GDN_SWEEP_TMA: one thread issues w, do on the buffer's
    mbarrier and q, k on theirs; the first chunk taken has its rows past the end zeroed once landed) brings the
    same bytes as cp.async: dvn, every written dH row and dh0 bitwise equal; one warpgroup and two, q and k issued
    early or after P, rows past the tensor's end (T 65), varlen GVA 4 at K = 64 with empty, one-token and odd
    sequences, NaN past the last sequence."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    q, k, _g, _beta, w, gc, cu, scale, do, dht, T, lens, rows = _bitwise_case(case)
    outs = [B90.reverse_sweep(q, k, w, gc, do, dht, scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                              out_dtype=do.dtype, wgs=wgs, prefetch=True, split=False, ws=False, early_qk=early_qk,
                              tma=t)
            for t in (False, True)]
    _assert_written_bitwise(outs, T, lens, rows, f"{case}, wgs {wgs}, early q, k {early_qk}, the TMA loads")


@pytest.mark.gpu
@pytest.mark.parametrize("case, wgs, vh2", [("dense", 1, True), ("dense", 1, False), ("dense", 2, False),
                                            ("T65_fp16", 1, True), ("varlen_gva_k64_vk", 1, True),
                                            ("varlen_nan_tail", 1, False), ("no_dht", 1, True)])
def test_reverse_sweep_dh_tma_store_is_bitwise(case, wgs, vh2):
    """dH by stmatrix and TMA stores (CUDNN_TRAIN_GDN_SWEEP_DHTMA: the chunk's accumulator rounded once into a
    [K, columns] tile, one bulk store a chunk) writes the bits the per-element stores write: dvn, every written dH
    row and dh0 bitwise equal, both V halves in one CTA and one, one warpgroup and two, rows past the tensor's end
    (T 65, fp16), varlen GVA 4 at K = 64 with [V, K] states and empty, one-token and odd sequences, NaN past the
    last sequence, no final state's gradient; and against the float32 reference."""
    _check_tma_stores(case, wgs, vh2, dict(dh_tma=True, dvn_tma=False))


@pytest.mark.gpu
@pytest.mark.parametrize("case, wgs, vh2", [("dense", 1, True), ("dense", 2, False), ("T65_fp16", 1, True),
                                            ("varlen_gva_k64_vk", 1, True), ("varlen_nan_tail", 1, False),
                                            ("no_dht", 1, True)])
def test_reverse_sweep_dvn_tma_store_is_bitwise(case, wgs, vh2):
    """dvn by stmatrix and TMA stores too (CUDNN_TRAIN_GDN_SWEEP_DVNTMA: a full chunk's dvn stored at the next
    chunk's top, a partial one by elements): the same bits as the element stores of both, in the dH cases' shapes
    (T 65 and the varlen sequences end in partial chunks; NaN rows past the last sequence must stay unwritten)."""
    _check_tma_stores(case, wgs, vh2, dict(dh_tma=True, dvn_tma=True))


def _check_tma_stores(case, wgs, vh2, on):
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    q, k, g, beta, w, gc, cu, scale, do, dht, T, lens, rows = _bitwise_case(case, V=128 if vh2 else None)
    vk = case.endswith("_vk")
    dht_in = dht.transpose(-1, -2).contiguous() if (vk and dht is not None) else dht
    outs = [B90.reverse_sweep(q, k, w, gc, do, dht_in, scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                              state_v_first=vk, out_dtype=do.dtype, wgs=wgs, prefetch=True, split=False, ws=False,
                              tma=True, vh2=vh2, **kw)
            for kw in (dict(dh_tma=False, dvn_tma=False), on)]
    _assert_written_bitwise(outs, T, lens, rows, f"{case}, wgs {wgs}, vh2 {vh2}, TMA stores {on}")
    if lens is not None:  # dvn's rows past the last sequence stay as allocated (zeros)
        assert not outs[1][0][:, T:].any(), "dvn written past the last sequence"
    if lens is None:
        ref_dvn, ref_dH, ref_dh0 = _reference(q, k, g, beta, do, dht, scale, w.shape[2], True)
        ref_dH = ref_dH.permute(0, 2, 1, 3, 4).reshape(outs[1][1].shape)  # chunk index b * NT + c
        for name, a, b in (("dvn", outs[1][0], ref_dvn), ("dH", outs[1][1], ref_dH), ("dh0", outs[1][2], ref_dh0)):
            assert rel_l2(a.float(), b) <= 2e-2, (name, rel_l2(a.float(), b))


@pytest.mark.gpu
@pytest.mark.parametrize("case, tma", [("dense", True), ("dense", False), ("T65_fp16_f32out", True),
                                       ("varlen_gva_k64_vk", True), ("varlen_nan_tail", True), ("no_dht", True)])
def test_reverse_sweep_two_v_halves_is_bitwise_one_warpgroup(case, tma):
    """Both 64-column halves of V in one CTA, one warpgroup each (CUDNN_TRAIN_GDN_SWEEP_VH2), sharing q, k, w, the
    l2norm rows, do_s and P: every product of a half is the one-warpgroup kernel's instruction for instruction, so
    dvn, every written dH row and dh0 are bitwise its results; by TMA and by cp.async, rows past the tensor's end
    (T 65, fp16, float32 outputs), varlen GVA 4 at K = 64 with [V, K] states and empty, one-token and odd
    sequences, NaN past the last sequence, no final state's gradient; and against the float32 reference."""
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    q, k, g, beta, w, gc, cu, scale, do, dht, T, lens, rows = _bitwise_case(case, V=128)
    vk = case.endswith("_vk")
    odt = torch.float32 if case.endswith("f32out") else do.dtype
    dht_in = dht.transpose(-1, -2).contiguous() if (vk and dht is not None) else dht
    outs = [B90.reverse_sweep(q, k, w, gc, do, dht_in, scale=scale, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                              state_v_first=vk, out_dtype=odt, wgs=1, prefetch=True, split=False, ws=False, tma=tma,
                              vh2=vh2)
            for vh2 in (False, True)]
    _assert_written_bitwise(outs, T, lens, rows, f"{case}, TMA {tma}, both V halves in one CTA")
    if lens is None:
        ref_dvn, _, ref_dh0 = _reference(q, k, g, beta, do, dht, scale, w.shape[2], True)
        assert rel_l2(outs[1][0].float(), ref_dvn) <= 2e-2
        assert rel_l2(outs[1][2], ref_dh0) <= 2e-2
    if q.shape[-1] == 128:  # two warpgroups a half: not served, before any launch (K = 64 takes no wgs=2 at all)
        with pytest.raises(Unsupported, match="vh2"):
            B90.reverse_sweep(q, k, w, gc, do, dht_in, scale=scale, cu_seqlens=cu, state_v_first=vk, wgs=2,
                              split=False, ws=False, vh2=True)


@pytest.mark.gpu
@pytest.mark.parametrize("vb", [16, 32, 64])
@pytest.mark.parametrize("T, dtype, has_dht", [(1, torch.bfloat16, True), (65, torch.float16, True),
                                               (300, torch.bfloat16, True), (300, torch.bfloat16, False)])
def test_split_sweep_matches_reference_and_the_fused_kernel(T, dtype, has_dht, vb, monkeypatch):
    """The split sweep (``dvl`` then ``dchain``, CUDNN_TRAIN_GDN_SWEEP_SPLIT; dvn and dH in the input dtype, as
    the training path asks): dvn, every chunk's dH and dh0 against the float32 reference, and against the
    fused kernel with the same output dtype (same rounding points, other summation order); with and
    without the final state's gradient; three more calls bitwise the first (no race between the chunks'
    shared tiles shows as a changed bit)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    monkeypatch.setenv("CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB", str(vb))
    Bn, H, HV, K, V = 2, 2, 4, 128, 128
    q, k, g, beta, w, gc, _, scale = _case(Bn, T, H, HV, K, V, dtype, l2norm=True)
    do = torch.randn(Bn, T, HV, V, device="cuda", dtype=dtype)
    dht = torch.randn(Bn, HV, K, V, device="cuda") if has_dht else None
    args = dict(scale=scale, use_qk_l2norm_in_kernel=True, out_dtype=dtype)
    got = [t.clone() for t in B90.reverse_sweep(q, k, w, gc, do, dht, split=True, **args)]
    for _ in range(3):
        for name, a, b in zip(("dvn", "dH", "dh0"), got, B90.reverse_sweep(q, k, w, gc, do, dht, split=True, **args)):
            assert torch.equal(a, b), f"{name}: a second call differs"
    fused = B90.reverse_sweep(q, k, w, gc, do, dht, split=False, **args)
    ref_dvn, ref_dH, ref_dh0 = _reference(q, k, g, beta, do, dht, scale, HV, True)
    NC = ref_dH.shape[2]
    ref_dH = ref_dH.permute(0, 2, 1, 3, 4).reshape(Bn * NC, HV, K, V)
    for name, a, f, r in zip(("dvn", "dH", "dh0"), got, fused, (ref_dvn, ref_dH, ref_dh0)):
        assert torch.isfinite(a).all(), name
        assert a.dtype == f.dtype, (name, a.dtype, f.dtype)
        assert rel_l2(a.float(), r) <= 2e-2, (name, rel_l2(a.float(), r))
        assert rel_l2(a.float(), f.float()) <= 5e-3, (name, "vs fused", rel_l2(a.float(), f.float()))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["T300_vb32", "T300_vb64_no_dht", "T65_fp16_vb32", "T300_vb16", "varlen", "varlen_vk",
                                  "varlen_nan_tail"])
def test_split_sweep_dchain_tma_is_bitwise_cp_async(case, monkeypatch):
    """``dchain`` with its loads by TMA (CUDNN_TRAIN_GDN_DCHAIN_TMA: one thread issues a chunk's k, q, w, do on
    the buffer's mbarrier; the first chunk taken, a sequence's last, has its rows past the end zeroed once landed)
    brings the same bytes as cp.async: the split sweep's dvn, every written dH row and dh0 bitwise equal. Dense
    T 300 at both V blocks (with and without the final state's gradient), fp16 T 65 (rows past the tensor's end),
    varlen GVA 4 at K = 64 in both state layouts, NaN in the rows past the last sequence."""
    _check_dchain_switch(case, monkeypatch, "CUDNN_TRAIN_GDN_DCHAIN_TMA", "the TMA loads")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["T300_vb32", "T300_vb64_no_dht", "T65_fp16_vb32", "T300_vb16", "varlen", "varlen_vk",
                                  "varlen_nan_tail"])
def test_split_sweep_dchain_tma_stores_are_bitwise(case, monkeypatch):
    """``dchain``'s stores by TMA (CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA: each chunk's dH row from its shared tile, a
    full chunk's dvn from a tile of its own, a partial chunk's dvn by pairs) write the bytes the 16-byte rows and
    4-byte pairs write: dvn, every written dH row and dh0 bitwise equal, in the TMA loads' cases (dense T 300 at
    every V block, with and without the final state's gradient, fp16 T 65, varlen GVA 4 at K = 64 in both state
    layouts, NaN in the rows past the last sequence)."""
    _check_dchain_switch(case, monkeypatch, "CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA", "the TMA stores")


def _check_dchain_switch(case, monkeypatch, switch, label):
    """The split sweep's outputs with ``switch`` at 0 and at 1, bitwise equal where written (the dchain cases)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    monkeypatch.setenv("CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB", "64" if "vb64" in case else "16" if "vb16" in case else "32")
    rows = None
    if case.startswith("varlen"):
        q, k, _g, _beta, w, gc, cu, scale, do, _dht, dht = _varlen_case(case == "varlen_vk")
        args = dict(scale=scale, cu_seqlens=cu, state_v_first=case == "varlen_vk", out_dtype=torch.bfloat16)
        rows = int(cu.new_tensor([(n + 63) // 64 for n in VARLEN_LENS]).sum())
        if case == "varlen_nan_tail":  # 37 more rows past the last sequence, NaN
            q, k, w, gc, do = (torch.cat([x, torch.full((1, 37, *x.shape[2:]), float("nan"), device=x.device,
                                                        dtype=x.dtype)], 1) for x in (q, k, w, gc, do))
    else:
        T, dt = (65, torch.float16) if case.startswith("T65") else (300, torch.bfloat16)
        q, k, _g, _beta, w, gc, _, scale = _case(2, T, 2, 4, 128, 128, dt, l2norm=True)
        do = torch.randn(2, T, 4, 128, device="cuda", dtype=dt)
        dht = None if case.endswith("no_dht") else torch.randn(2, 4, 128, 128, device="cuda")
        args = dict(scale=scale, use_qk_l2norm_in_kernel=True, out_dtype=dt)
    monkeypatch.setenv(switch, "0")
    want = [t.clone() for t in B90.reverse_sweep(q, k, w, gc, do, dht, split=True, **args)]
    monkeypatch.setenv(switch, "1")
    got = B90.reverse_sweep(q, k, w, gc, do, dht, split=True, **args)
    for name, a, b in zip(("dvn", "dH", "dh0"), got, want):
        if name == "dH" and rows is not None:  # rows past the varlen chunk count are never written
            a, b = a[:rows], b[:rows]
        if name == "dvn" and case == "varlen_nan_tail":
            a, b = a[:, : int(cu[-1])], b[:, : int(cu[-1])]
        assert torch.isfinite(a).all(), f"{case}: {name} is not finite"
        assert torch.equal(a, b), f"{case}: {name} differs with {label}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen_gva_64"])
def test_split_sweep_p_in_two_passes_is_bitwise_the_one_pass(case, monkeypatch):
    """``dvl`` with P built in two passes (CUDNN_TRAIN_GDN_DVL_P2=1) makes the same operations on the same
    values as the one pass: dvn, every written dH row and dh0 of the split sweep bitwise equal."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    if case == "dense":
        q, k, _g, _beta, w, gc, cu, scale = _case(2, 300, 2, 4, 128, 128, torch.bfloat16, l2norm=True)
        do = torch.randn(2, 300, 4, 128, device="cuda", dtype=torch.bfloat16)
        dht, args, rows = None, dict(scale=scale, use_qk_l2norm_in_kernel=True), None
    else:
        q, k, _g, _beta, w, gc, cu, scale, do, _dht, dht = _varlen_case(False)
        args = dict(scale=scale, cu_seqlens=cu)
        rows = int(cu.new_tensor([(n + 63) // 64 for n in VARLEN_LENS]).sum())
    outs = []
    for p2 in ("0", "1"):
        monkeypatch.setenv("CUDNN_TRAIN_GDN_DVL_P2", p2)
        outs.append([t.clone() for t in B90.reverse_sweep(q, k, w, gc, do, dht, split=True, out_dtype=q.dtype,
                                                          **args)])
    for name, a, b in zip(("dvn", "dH", "dh0"), *outs):
        if name == "dH" and rows is not None:
            a, b = a[:rows], b[:rows]
        assert torch.isfinite(a).all(), f"{case}: {name}: not every element written"
        assert torch.equal(a, b), f"{case}: {name} differs with P in two passes"


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [False, True])
def test_split_sweep_varlen_gva_k64(state_v_first):
    """The split sweep with varlen (empty, one-token and odd sequences), GVA 4, K = 64, no l2norm, both state
    layouts: per sequence against the reference, and against the fused kernel."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    case = _varlen_case(state_v_first)
    q, k, _g, _beta, w, gc, cu, scale, do, _dht, dht_in = case
    args = dict(scale=scale, cu_seqlens=cu, state_v_first=state_v_first, out_dtype=q.dtype)
    dvn, dH, dh0 = B90.reverse_sweep(q, k, w, gc, do, dht_in, split=True, **args)
    fdvn, fdH, fdh0 = B90.reverse_sweep(q, k, w, gc, do, dht_in, split=False, **args)
    rows = int(cu.new_tensor([(n + 63) // 64 for n in VARLEN_LENS]).sum())
    assert rel_l2(dvn.float(), fdvn.float()) <= 5e-3, rel_l2(dvn.float(), fdvn.float())
    assert rel_l2(dH[:rows].float(), fdH[:rows].float()) <= 5e-3, rel_l2(dH[:rows].float(), fdH[:rows].float())
    assert rel_l2(dh0, fdh0) <= 5e-3, rel_l2(dh0, fdh0)
    _check_varlen(dvn, dh0, case, state_v_first)

"""SM90 Gated DeltaNet kernels: compiled for sm_90a on any machine; on a GPU, checked against
FLA's float32 naive recurrence (the oracle) under the FLA-compat rule, with FLA's chunk
kernels as the peer."""

import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.utils import SEG_VARLEN, assert_env_override, cu_seqlens, fla_compat_ok, gdn_seg_gates, rel_l2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ------------------------------------------------------------------ compile tier (CPU, sm_90a)

# (q dtype, g dtype, beta dtype, K, V, l2norm, gate, dt_bias, beta sigmoid, beta scale, varlen)
WY_VARIANTS = [
    (torch.bfloat16, torch.float32, torch.bfloat16, 128, 128, True, True, True, True, 2.0, True),
    (torch.float16, torch.float16, torch.float32, 64, 64, False, False, False, False, 1.0, False),
]
def _wy_kernel(variant, **kw):
    """The wy kernel of a ``WY_VARIANTS`` row (float32 A_log / dt_bias where the row has them), ``kw`` its options."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    dt, gdt, bdt, K, V, l2, gate, dtb, sig, bscale, varlen = variant
    return F90.get_wy_kernel(dt, gdt, bdt, torch.float32 if gate else None, torch.float32 if dtb else None, K, V, l2,
                             gate, dtb, sig, bscale, varlen, **kw)


# (q dtype, K, V, l2norm, varlen, has h0, final state, state [V, K], store chunk states)
STATE_VARIANTS = [
    (torch.bfloat16, 128, 128, True, False, True, True, False, False),
    (torch.float16, 64, 128, False, True, False, True, True, False),
    (torch.bfloat16, 128, 128, True, True, True, False, False, True),  # the training forward
]


@pytest.mark.compile
def test_forward_kernels_compile_for_sm90a(kernel_cache, monkeypatch):
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setattr(F90, "WY_SCAN", True)  # the defaults, whatever the environment says
    monkeypatch.setattr(F90, "WY_ASYNC", True)
    monkeypatch.setattr(F90, "WY_A2", True)
    monkeypatch.setattr(F90, "STATE_PSEL", False)
    if not torch.cuda.is_available():
        assert kc.target_arch() == "sm_90a"
    for v in WY_VARIANTS:
        assert callable(_wy_kernel(v))
    for v in STATE_VARIANTS:  # each with and without the cp.async prefetch of the next chunk
        for pf in (True, False):
            assert callable(F90.get_state_kernel(*v, prefetch=pf))
    # the state kernel's P by a select (CUDNN_TRAIN_GDN_FWD_PSEL)
    assert callable(F90.get_state_kernel(*STATE_VARIANTS[0], prefetch=True, p_select=True))
    # the training forward's wy kernel that also writes each chunk's Tm (CUDNN_TRAIN_GDN_DCHUNK_TM_FROM_FWD)
    assert callable(_wy_kernel(WY_VARIANTS[0], store_t=True))
    # its serial preparation (CUDNN_TRAIN_GDN_WY_SCAN=0) and its synchronous tile loads (CUDNN_TRAIN_GDN_WY_ASYNC=0)
    # and the A matrix in one pass (CUDNN_TRAIN_GDN_WY_A2=0)
    for extra in (dict(scan=False), dict(async_loads=False), dict(a2=False)):
        assert callable(_wy_kernel(WY_VARIANTS[0], **extra))
    objs = sorted(p.name for p in kernel_cache.rglob("*.o"))
    assert len(objs) == len(WY_VARIANTS) + 5 + 2 * len(STATE_VARIANTS), objs
    # another process loads them from disk without compiling
    kc.clear_memory_cache()
    assert callable(F90.get_state_kernel(*STATE_VARIANTS[0]))
    assert len(list(kernel_cache.rglob("*.o"))) == len(objs)


# chain: (q dtype, K, V, VB, l2norm, varlen, has h0, final state, state [V, K]); out: (q dtype, K, V, l2norm, varlen)
CHAIN_VARIANTS = [
    (torch.bfloat16, 128, 128, 32, True, False, True, True, False),
    (torch.float16, 64, 128, 64, False, True, False, True, True),
    (torch.bfloat16, 128, 128, 16, True, True, False, False, False),  # VB 16: CUDNN_TRAIN_GDN_CHAIN_VB=16 only
]
OUT_VARIANTS = [(torch.bfloat16, 128, 128, True, False), (torch.float16, 64, 64, False, True)]


@pytest.mark.compile
def test_split_state_kernels_compile_for_sm90a(kernel_cache):
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP

    for v in CHAIN_VARIANTS:
        assert callable(SP.get_chain_kernel(*v))
    for v in OUT_VARIANTS:
        assert callable(SP.get_out_kernel(*v))
    # the out kernel with P's factors read unconditionally (CUDNN_TRAIN_GDN_OUT_PSEL)
    assert callable(SP.get_out_kernel(*OUT_VARIANTS[0], p_select=not SP.out_p_select()))
    # the other side of the chain's loads (CUDNN_TRAIN_GDN_CHAIN_TMA: by TMA unless 0)
    for v in CHAIN_VARIANTS:
        assert callable(SP.get_chain_kernel(*v, tma=not SP.chain_tma()))
    # the other side of the out kernel's loads (CUDNN_TRAIN_GDN_OUT_TMA), also at K = 64 with V = 128
    for v in OUT_VARIANTS:
        assert callable(SP.get_out_kernel(*v, tma=not SP.out_tma()))
    assert callable(SP.get_out_kernel(torch.bfloat16, 64, 128, True, True, tma=not SP.out_tma()))
    assert len(list(kernel_cache.rglob("*.o"))) == 2 * len(CHAIN_VARIANTS) + 2 * len(OUT_VARIANTS) + 2
    with pytest.raises(ValueError, match="VB=48"):
        SP.get_chain_kernel(torch.bfloat16, 128, 128, 48, True, False, False, False, False)


def test_chain_tma_store_switches_parse(monkeypatch):
    """The chain's TMA stores and the out kernel's o TMA store are on by default; each switch takes 1 / 0, anything
    else names it."""
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP

    for name, pick in (("CUDNN_TRAIN_GDN_CHAIN_HSTMA", SP.chain_hs_tma),
                       ("CUDNN_TRAIN_GDN_CHAIN_VNTMA", SP.chain_vn_tma), ("CUDNN_TRAIN_GDN_OUT_OTMA", SP.out_o_tma)):
        monkeypatch.delenv(name, raising=False)
        assert pick() is True
        assert_env_override(monkeypatch, name, pick, "0", False, ("2", "off"))


@pytest.mark.compile
def test_split_tma_stores_compile_for_sm90a(kernel_cache):
    """The chain's hs and vn stores by TMA (CUDNN_TRAIN_GDN_CHAIN_HSTMA / _VNTMA, on by default) and the default's
    other side: the element stores at every chain variant, each TMA store alone, and both with the other side of
    the chain's loads; the out kernel's o by one TMA store (CUDNN_TRAIN_GDN_OUT_OTMA, on by default) and its
    other side, the pair stores."""
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP

    for v in CHAIN_VARIANTS:
        assert callable(SP.get_chain_kernel(*v, hs_tma=False, vn_tma=False))
    v = CHAIN_VARIANTS[0]
    for kw in (dict(hs_tma=True, vn_tma=False), dict(hs_tma=False, vn_tma=True),
               dict(hs_tma=True, vn_tma=True, tma=not SP.chain_tma())):
        assert callable(SP.get_chain_kernel(*v, **kw))
    assert len(list(kernel_cache.rglob("*.o"))) == len(CHAIN_VARIANTS) + 3
    # the out kernel's o by one TMA store (CUDNN_TRAIN_GDN_OUT_OTMA, on by default) and the pair stores: K = V = 128,
    # K = V = 64 varlen fp16, and with the cp.async loads
    for v in OUT_VARIANTS:
        assert callable(SP.get_out_kernel(*v, o_tma=not SP.out_o_tma()))
    assert callable(SP.get_out_kernel(*OUT_VARIANTS[0], o_tma=not SP.out_o_tma(), tma=not SP.out_tma()))
    assert len(list(kernel_cache.rglob("*.o"))) == len(CHAIN_VARIANTS) + 3 + len(OUT_VARIANTS) + 1


@pytest.mark.compile
def test_profile_variants_compile_for_sm90a(kernel_cache):
    """The clock64 phase-timing variants that tools/time_gdn_fwd.py --profile launches."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    assert callable(_wy_kernel(WY_VARIANTS[0], profile=True))
    assert callable(F90.get_state_kernel(*STATE_VARIANTS[0], prefetch=True, profile=True))
    assert len(list(kernel_cache.rglob("*.o"))) == 2


@pytest.mark.compile
def test_two_warpgroup_state_kernels_compile_for_sm90a(kernel_cache):
    """The other side of each warpgroup default at K = 128 (the defaults are built by
    test_forward_kernels_compile_for_sm90a): the inference state kernel on two warpgroups with the
    prefetch, the training forward's chunk-state kernel on one, the wy kernel on one."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    assert callable(F90.get_state_kernel(*STATE_VARIANTS[0], prefetch=True, wgs=2))
    assert callable(F90.get_state_kernel(*STATE_VARIANTS[2], wgs=1))
    assert WY_VARIANTS[0][3] == WY_VARIANTS[0][4] == 128  # K = V = 128
    assert callable(_wy_kernel(WY_VARIANTS[0], wgs=1))
    assert len(list(kernel_cache.rglob("*.o"))) == 3
    with pytest.raises(ValueError, match="wgs"):
        F90.get_state_kernel(*STATE_VARIANTS[1], wgs=2)  # K = 64


# (q dtype, K, V, l2norm, varlen, has h0, final state, state [V, K])
WS_VARIANTS = [
    (torch.bfloat16, 128, 128, True, False, False, False, False),  # the benchmark's call
    (torch.float16, 64, 64, False, True, True, True, True),
    (torch.bfloat16, 128, 64, True, True, True, True, False),
]


@pytest.mark.compile
def test_specialized_warpgroup_state_kernel_compiles_for_sm90a(kernel_cache):
    """The fused state pass on two specialized warpgroups (CUDNN_TRAIN_GDN_FWD_WS): chain and output."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    # as served (since the sixteenth session): loads by TMA (CUDNN_TRAIN_GDN_FWD_WS_TMA), at 64 columns a CTA two
    # output warpgroups (CUDNN_TRAIN_GDN_FWD_WS_WG3); every call below names its variant, whatever the env says
    served = dict(tma=True, wg3=True)
    for v in WS_VARIANTS:
        assert callable(WS.get_kernel(*v, **served))
    # the training forward's: the chunk-start states (and vn) written too (one output warpgroup)
    assert callable(WS.get_kernel(*WS_VARIANTS[2], store_states=True, keep_vn=True, tma=True))
    assert callable(WS.get_kernel(*WS_VARIANTS[1], store_states=True, tma=True))
    assert len(list(kernel_cache.rglob("*.o"))) == len(WS_VARIANTS) + 2
    with pytest.raises(ValueError, match="K=96"):
        WS.get_kernel(torch.bfloat16, 96, 128, True, False, False, False, False)
    with pytest.raises(ValueError, match="keep_vn"):
        WS.get_kernel(*WS_VARIANTS[0], keep_vn=True)
    # w and u formed in the chain (CUDNN_TRAIN_GDN_FWD_ONFLY), and the wy kernel's gate-free inverse variant
    for v in WS_VARIANTS:
        assert callable(WS.get_kernel(*v, onfly=True, **served))
    for v in WY_VARIANTS:
        assert callable(_wy_kernel(v, inv=True))
    n_onfly = len(WS_VARIANTS) + len(WY_VARIANTS)
    # the cp.async loads (CUDNN_TRAIN_GDN_FWD_WS_TMA=0; one output warpgroup then): plain, training, w, u in the chain
    for v in WS_VARIANTS:
        assert callable(WS.get_kernel(*v, tma=False))
    assert callable(WS.get_kernel(*WS_VARIANTS[2], store_states=True, keep_vn=True, tma=False))
    assert callable(WS.get_kernel(*WS_VARIANTS[2], onfly=True, tma=False))
    # TMA with one output warpgroup (CUDNN_TRAIN_GDN_FWD_WS_WG3=0), with and without w, u in the chain
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=True, wg3=False))
    assert callable(WS.get_kernel(*WS_VARIANTS[1], tma=True, wg3=False, onfly=True))
    assert len(list(kernel_cache.rglob("*.o"))) == 2 * len(WS_VARIANTS) + 6 + n_onfly
    # all 128 columns of V in one CTA (CUDNN_TRAIN_GDN_FWD_WS_VB, auto: B4 T4096 HV32's): as served there (TMA, one
    # output warpgroup), with cp.async, the training forward's, TMA with w and u formed in the chain (K = 64 at
    # V = 128), and with two output warpgroups
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=True, wg3=False, vb=128))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=False, vb=128))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], store_states=True, keep_vn=True, tma=False, vb=128))
    k64 = (torch.bfloat16, 64, 128) + WS_VARIANTS[2][3:]
    assert callable(WS.get_kernel(*k64, onfly=True, tma=True, wg3=False, vb=128))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=True, wg3=True, vb=128))
    # the inference forward's state pass at B4 T4096 HV32 by default (w, u formed in the chain: onfly_default)
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=True, wg3=False, onfly=True, vb=128))
    assert len(list(kernel_cache.rglob("*.o"))) == 2 * len(WS_VARIANTS) + 12 + n_onfly
    with pytest.raises(ValueError, match="vb=128"):
        WS.get_kernel(*WS_VARIANTS[2], vb=128)  # V = 64
    with pytest.raises(ValueError, match="vb=128"):
        WS.get_kernel(*WS_VARIANTS[0], tma=True, wg3=True, onfly=True, vb=128)


@pytest.mark.compile
def test_specialized_warpgroups_transposed_stores_compile_for_sm90a(kernel_cache):
    """The training forward's stores by TMA from transposed tiles (CUDNN_TRAIN_GDN_FWD_WS_TSTORE): at 64 and 128
    columns with the TMA loads (the B4 T4096 call), cp.async at K = V = 64 fp16 with [V, K] states, and K = 128 with
    V = 64 without vn; two output warpgroups refuse it (w and u formed in the chain take it since the thirty-fifth
    session: test_training_forward_with_w_u_in_the_chain_compiles_for_sm90a)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    train = dict(store_states=True, keep_vn=True, tstore=True)
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=True, vb=64, **train))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=True, vb=128, **train))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=False, vb=128, **train))
    assert callable(WS.get_kernel(*WS_VARIANTS[1], tma=False, **train))
    assert callable(WS.get_kernel(*WS_VARIANTS[2], store_states=True, tma=True, tstore=True))
    assert len(list(kernel_cache.rglob("*.o"))) == 5
    with pytest.raises(ValueError, match="tstore"):
        WS.get_kernel(*WS_VARIANTS[0], store_states=True, tstore=True, tma=True, wg3=True)


@pytest.mark.compile
def test_transposed_tiles_and_ldmatrix_compile_for_sm90a(kernel_cache, monkeypatch):
    """The inference forward on the transposed S / vn tiles (CUDNN_TRAIN_GDN_FWD_WS_TLAYOUT) and the chain's u^T by
    ldmatrix (CUDNN_TRAIN_GDN_FWD_WS_ULDM), prepared: the B4 T4096 inference call (128 columns, TMA, w and u formed in
    the chain) with each and both, 64 columns with two output warpgroups and both, cp.async at 128 columns (u's tile
    swizzled there too) with both, K = V = 64 fp16 with [V, K] states with both, and the training forward's call
    with ULDM; o by TMA stores (CUDNN_TRAIN_GDN_FWD_WS_OTMA) at the B4 inference and training calls and at
    K = V = 64, and with the output on the chain's k factors too (CUDNN_TRAIN_GDN_FWD_WS_KSHARE). TLAYOUT is ignored with store_states (the training tiles are transposed already), ULDM where u's
    tile is padded and OTMA with cp.async loads (cp.async at 64 columns): those calls take the kernels compiled
    without them. OTMA (on by default since the thirty-fifth session), KSHARE and CLOADS (since the thirty-sixth) off
    unless asked for, as when it was written (the kernel counts below count distinct variants)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    for name in ("OTMA", "KSHARE", "CLOADS"):
        monkeypatch.setattr(WS, name, False)
    infer = dict(tma=True, wg3=False, onfly=True, vb=128)
    for tl, ul in ((True, False), (False, True), (True, True)):
        assert callable(WS.get_kernel(*WS_VARIANTS[0], tlayout=tl, uldm=ul, **infer))
    both = dict(tlayout=True, uldm=True)
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=True, wg3=True, vb=64, **both))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=False, vb=128, **both))
    assert callable(WS.get_kernel(*WS_VARIANTS[1], tma=True, wg3=True, **both))
    train = dict(store_states=True, keep_vn=True, tstore=True, tma=True, vb=128)
    assert callable(WS.get_kernel(*WS_VARIANTS[0], uldm=True, **train))
    # o by TMA stores (CUDNN_TRAIN_GDN_FWD_WS_OTMA): the B4 inference and training calls, K = V = 64
    assert callable(WS.get_kernel(*WS_VARIANTS[0], otma=True, **both, **infer))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], otma=True, uldm=True, **train))
    assert callable(WS.get_kernel(*WS_VARIANTS[1], tma=True, wg3=False, otma=True, **both))
    # the output warpgroup on the chain's k factors (CUDNN_TRAIN_GDN_FWD_WS_KSHARE, off here), with OTMA
    assert callable(WS.get_kernel(*WS_VARIANTS[0], otma=True, kshare=True, **both, **infer))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], otma=True, kshare=True, uldm=True, **train))
    assert len(list(kernel_cache.rglob("*.o"))) == 12
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tlayout=False, uldm=False, **train))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=False, vb=64, uldm=False, otma=False))
    assert len(list(kernel_cache.rglob("*.o"))) == 14
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tlayout=True, uldm=False, **train))  # the kernel without TLAYOUT
    assert callable(WS.get_kernel(*WS_VARIANTS[0], tma=False, vb=64, uldm=True, otma=True))  # without ULDM, OTMA
    assert len(list(kernel_cache.rglob("*.o"))) == 14


def test_specialized_warpgroups_v_block_choice(monkeypatch):
    """CUDNN_TRAIN_GDN_FWD_WS_VB: auto (the default) takes 128 where two CTAs a (sequence, value head) would not all
    be resident (2 N HV > SMs), not for the training forward's call (store_states) unless its stores go by TMA from
    transposed tiles (tstore); 64 and 128 force either; 128 only at V = 128."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    monkeypatch.setattr(kc, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    shapes = [(128, 4, 32), (128, 1, 32), (128, 3, 23), (128, 2, 33), (64, 8, 32)]
    want = {"64": [64, 64, 64, 64, 64], "128": [128, 128, 128, 128, 64], "auto": [128, 64, 128, 64, 64]}
    for mode, vbs in want.items():
        monkeypatch.setattr(WS, "VB_MODE", mode)
        assert [WS.v_block(V, n, hv, dev) for V, n, hv in shapes] == vbs, mode
        want_store = [64] * len(shapes) if mode == "auto" else vbs
        assert [WS.v_block(V, n, hv, dev, store_states=True) for V, n, hv in shapes] == want_store, mode
        # with the stores by TMA (tstore) the training forward's call takes what inference takes
        assert [WS.v_block(V, n, hv, dev, store_states=True, tstore=True) for V, n, hv in shapes] == vbs, mode
    monkeypatch.undo()
    assert WS.VB_MODE == "auto" or os.environ.get("CUDNN_TRAIN_GDN_FWD_WS_VB", "").strip(), "the default is auto"


def test_split_chain_v_block_and_onfly_defaults(monkeypatch):
    """The training forward's chain takes 64 columns a CTA where N HV V/64 CTAs fill the SMs, else 32 (16, slower
    at every measured grid, only by CUDNN_TRAIN_GDN_CHAIN_VB; a bad value is a ValueError naming it). w and u are
    formed in the specialized warpgroups' chain (CUDNN_TRAIN_GDN_FWD_ONFLY unset) only where one CTA holds all
    128 columns of V at K == V (onfly_default; forward() asks it only when the switch is unset)."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP

    monkeypatch.setattr(kc, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    monkeypatch.delenv("CUDNN_TRAIN_GDN_CHAIN_VB", raising=False)
    assert [SP.chain_vblock(n, hv, 128, dev) for n, hv in ((4, 32), (1, 32), (2, 33), (2, 32))] == [64, 32, 64, 32]
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_CHAIN_VB", lambda: SP.chain_vblock(4, 32, 128, dev), "16", 16,
                        ("48", "x", "128"))
    assert [F90.onfly_default(K, V, vb) for K, V, vb in ((128, 128, 128), (128, 128, 64), (64, 64, 64),
                                                         (64, 128, 128))] == [True, False, False, False]
    assert os.environ.get("CUDNN_TRAIN_GDN_FWD_ONFLY", "").strip() or F90.ONFLY is None, "the default is unset"


def test_split_chain_segments_switch(monkeypatch):
    """The chain's sequence split (CUDNN_TRAIN_GDN_CHAIN_SEG): one segment unless asked (1 or unset); auto takes the
    fewest segments that give every SM a CTA of 64 columns, keeping segments of at least 16 chunks of a sequence's average; a number
    forces it (1: unsplit); never without l2norm; a bad value is a ValueError naming it."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP

    monkeypatch.setattr(kc, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    monkeypatch.delenv("CUDNN_TRAIN_GDN_CHAIN_SEG", raising=False)
    assert SP.chain_segments(1, 32, 128, 16384, True, dev) == 1
    monkeypatch.setenv("CUDNN_TRAIN_GDN_CHAIN_SEG", "1")
    assert SP.chain_segments(1, 32, 128, 16384, True, dev) == 1
    monkeypatch.setenv("CUDNN_TRAIN_GDN_CHAIN_SEG", "auto")
    # (nseq, HV, tokens) -> segments: B1 T16384 HV32 -> 4 (256 CTAs); B4 T4096 -> 1 (256 already); B1 T4096 -> 4
    # (segments of 16 chunks); B1 T2048 -> 2 (4 would make segments of 8); 3 sequences of 6000 tokens in all at HV 8
    # -> 1 (31 chunks on average: halves would be under 16)
    got = [SP.chain_segments(n, hv, 128, t, True, dev) for n, hv, t in
           ((1, 32, 16384), (4, 32, 16384), (1, 32, 4096), (1, 32, 2048), (3, 8, 6000))]
    assert got == [4, 1, 4, 2, 1], got
    assert SP.chain_segments(1, 32, 128, 16384, False, dev) == 1  # no l2norm: never split
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_CHAIN_SEG",
                        lambda: SP.chain_segments(1, 32, 128, 16384, True, dev), "8", 8, ("3", "x", "32"))
    with pytest.raises(ValueError, match="nseg=4"):
        SP.get_chain_kernel(torch.bfloat16, 128, 128, 64, False, False, True, True, False, nseg=4)


def test_specialized_warpgroups_load_and_output_defaults(monkeypatch):
    """CUDNN_TRAIN_GDN_FWD_WS_TMA / _WG3 unset: TMA loads where K == V (the configurations their GPU cases ran),
    two output warpgroups with them at 64 columns a CTA, never for the training forward's call or the profile
    variant; set to 1 / 0: always (where it can serve) / never. Read off the kernel's cache key, nothing built."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    monkeypatch.setattr(kc, "get_kernel", lambda name, key, build, sources: key)

    def picked(K, V, **kw):
        key = WS.get_kernel(torch.bfloat16, K, V, True, False, False, False, False, **kw)
        return "tma" in key, "wg3" in key

    monkeypatch.setattr(WS, "TMA", None)
    monkeypatch.setattr(WS, "WG3", None)
    assert picked(128, 128) == (True, True)
    assert picked(64, 64) == (True, True)
    assert picked(128, 128, vb=128) == (True, False)
    assert picked(128, 64) == (False, False)
    assert picked(64, 128) == (False, False)
    assert picked(128, 128, store_states=True) == (True, False)
    assert picked(128, 128, profile=True) == (True, False)
    assert picked(128, 128, tma=False) == (False, False)
    monkeypatch.setattr(WS, "TMA", True)
    monkeypatch.setattr(WS, "WG3", True)
    assert picked(128, 64) == (True, True)
    assert picked(128, 128, vb=128) == (True, True)
    assert picked(128, 128, vb=128, onfly=True) == (True, False)  # not both at 128 columns
    monkeypatch.setattr(WS, "TMA", False)
    assert picked(128, 128) == (False, False)  # two output warpgroups need the TMA loads
    monkeypatch.setattr(WS, "TMA", None)
    monkeypatch.setattr(WS, "WG3", False)
    assert picked(128, 128) == (True, False)


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_w_u_in_the_chain_use_an_exact_identity(beta_scale):
    """The algebra of CUDNN_TRAIN_GDN_FWD_ONFLY, in float64 on the CPU: the gated chunk inverse is the gate-free
    one's similarity transform, T = tril(A0 exp(gc_i - gc_j)), and vn = u - w S = T diag(beta) (v - diag(exp(gc) rk)
    k S) with the module docstring's w, u (l2norm folded in as the row factors rk of raw keys)."""
    g64 = torch.Generator().manual_seed(7)
    C, K, V, dt = 64, 32, 16, torch.float64
    k = torch.randn(C, K, dtype=dt, generator=g64)
    rk = 1.0 / k.norm(dim=-1)
    kn = k * rk[:, None]
    v = torch.randn(C, V, dtype=dt, generator=g64)
    beta = beta_scale * torch.rand(C, dtype=dt, generator=g64)
    gc = (F.logsigmoid(torch.rand(C, dtype=dt, generator=g64)) * 3).cumsum(0)
    S = torch.randn(K, V, dtype=dt, generator=g64)
    gam = torch.exp(gc[:, None] - gc[None, :])
    eye = torch.eye(C, dtype=dt)
    T = torch.linalg.inv(eye + torch.tril(beta[:, None] * (kn @ kn.T) * gam, -1))
    w = T @ (beta[:, None] * torch.exp(gc)[:, None] * kn)
    u = T @ (beta[:, None] * v)
    A0 = torch.linalg.inv(eye + torch.tril(beta[:, None] * (kn @ kn.T), -1))
    T2 = torch.tril(A0 * gam)
    R = beta[:, None] * (v - (torch.exp(gc) * rk)[:, None] * (k @ S))
    assert torch.allclose(T2, T, rtol=0, atol=1e-12)
    assert torch.allclose(T2 @ R, u - w @ S, rtol=1e-12, atol=1e-12)


@pytest.mark.compile
def test_layout_facts_the_kernels_rely_on():
    """The register and shared-memory layout facts, checked for more threads than at trace time."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_common_sm90 as cm

    cutlass, cute = kc.import_cute()
    # every bit of the thread index and a spread of others (all 128 take minutes to trace)
    threads = tuple(sorted(set(range(0, 128, 9)) | {1, 2, 4, 8, 16, 32, 64, 127}))
    seen = {}

    @cute.jit
    def check():
        # the register layouts are those of any 16-bit type; the swizzled tile is checked for both
        cm.check_mn_major_view(cutlass.Float16, 64, 128)
        for dt, K in ((cutlass.BFloat16, 128), (cutlass.BFloat16, 64)):
            cm.check_mn_major_view(dt, 64, K)
            mma_s = cm.make_mma(dt, K, a_regs=True, b_mn_major=True)
            mma_x = cm.make_mma(dt, 64, a_regs=True, b_mn_major=False)
            m1 = cm.acc_to_frag_map(mma_s, (64, K), mma_x, (64, K), threads=threads)
            m2 = cm.acc_to_frag_map(mma_x, (64, 64), mma_x, (64, 64), threads=threads)
            m3 = cm.acc_to_frag_map(mma_x, (64, 64), mma_s, (64, 64), threads=threads)
            cm.check_acc_pairs(cm.make_mma(dt, K, a_regs=False, b_mn_major=True), (64, K), threads=threads)
            seen[(str(dt), K)] = (m1, m2, m3)

    check()
    assert len(seen) == 2
    for m1, m2, m3 in seen.values():
        # each map is a permutation of the fragment
        assert sorted(m1) == list(range(len(m1))) and sorted(m2) == list(range(len(m2)))
        assert sorted(m3) == list(range(len(m3)))


def test_row_check_ignores_the_strides_of_size1_dims():
    """A [B, 1, H, K] tensor may carry any stride on its size-1 dim (torch calls it contiguous): the row check
    serves it with that stride set as a contiguous tensor has it; a real misaligned stride still declines."""
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_common_sm90 as cm

    t = torch.randn(2, 4, 64, 1, dtype=torch.bfloat16).permute(0, 3, 1, 2)  # [2, 1, 4, 64], strides (256, 1, 64, 1)
    assert t.is_contiguous() and t.stride(1) == 1
    got = cm.check_rows_aligned("q", t)
    assert got.stride() == (256, 256, 64, 1) and got.data_ptr() == t.data_ptr() and torch.equal(got, t)
    same = torch.randn(2, 3, 4, 64, dtype=torch.bfloat16)
    assert cm.check_rows_aligned("q", same) is same
    odd = torch.randn(2, 3, 4, 72, dtype=torch.bfloat16)[..., :64]  # rows 144 bytes apart: 16-aligned
    assert cm.check_rows_aligned("q", odd) is odd
    with pytest.raises(Unsupported, match="q: stride"):
        cm.check_rows_aligned("q", torch.randn(2, 3, 4, 68, dtype=torch.bfloat16)[..., :64])


def test_forward_declines_before_touching_memory():
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    v = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    g = torch.randn(1, 8, 2)
    with pytest.raises(Unsupported, match="no GPU|tensor on cpu|not SM90"):
        F90.forward(q, q, v, g, g.sigmoid())


# ------------------------------------------------------------------ GPU tier


def _l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def oracle(q, k, v, g, beta, scale, h0, cu, *, l2norm, A_log=None, dt_bias=None, beta_sigmoid=False, neg=False,
           state_v_first=False):
    """FLA's naive float32 recurrence per sequence, with the op's pre-processing done in float32 here."""
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule as naive

    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if l2norm:
        q, k = _l2n(q), _l2n(k)
    if A_log is not None:
        x = g + (0.0 if dt_bias is None else dt_bias.float())
        g = -A_log.float().exp() * F.softplus(x)
    if beta_sigmoid:
        beta = beta.sigmoid() * (2.0 if neg else 1.0)
    H, HV = q.shape[2], v.shape[2]
    q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    if cu is None:
        o, ht = naive(q, k, v, beta, g, scale=scale, initial_state=None if h0 is None else h0.float(),
                      output_final_state=True)
    else:
        bounds = cu.tolist()
        outs, states = [], []
        for n in range(len(bounds) - 1):
            a, b = bounds[n], bounds[n + 1]
            s0 = None if h0 is None else h0[n : n + 1].float()
            if b == a:  # an empty sequence keeps its initial state
                states.append(v.new_zeros(1, HV, q.shape[-1], v.shape[-1]) if s0 is None else s0)
                continue
            o_n, h_n = naive(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], g[:, a:b], scale=scale, initial_state=s0,
                             output_final_state=True)
            outs.append(o_n)
            states.append(h_n)
        o, ht = torch.cat(outs, 1), torch.cat(states, 0)
    if state_v_first:
        ht = ht.transpose(-1, -2)
    return o, ht


def peer(q, k, v, g, beta, scale, h0, cu, **kw):
    """FLA's Triton chunk kernels on the same inputs, or None (with the reason printed)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        return fla_chunk(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                         cu_seqlens=None if cu is None else cu.long(), **kw)
    except Exception as e:  # the comparison then uses the floor alone
        print(f"FLA peer unavailable ({type(e).__name__}: {e}); FLA-compat rule uses its floor")
        return None


def _inputs(B, T, H, HV, K, V, dtype, *, l2norm=True, raw_gate=False, beta_logits=False, h0=True, nseq=None,
            state_v_first=False):
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    k = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    if not l2norm:  # the recurrence is only stable for unit-norm keys
        q, k = _l2n(q.float()).to(dtype), _l2n(k.float()).to(dtype)
    v = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    if raw_gate:
        g = torch.randn(B, T, HV, device=dev, dtype=torch.float32)
    else:
        g = F.logsigmoid(torch.rand(B, T, HV, device=dev, dtype=torch.float32))
    beta = torch.randn(B, T, HV, device=dev, dtype=dtype) if beta_logits else torch.rand(B, T, HV, device=dev, dtype=dtype)
    n = B if nseq is None else nseq
    s = (n, HV, V, K) if state_v_first else (n, HV, K, V)
    state = torch.randn(*s, device=dev, dtype=torch.float32) * 0.5 if h0 else None
    return q, k, v, g, beta, state


def _assert_bitwise(label, new, base, variant):
    """Every output of a variant (``new``: name -> tensor) written (finite: the forward's outputs start as NaN
    under ``poisoned``) and bitwise equal to the same output of the base run (``base``)."""
    for name, a in new.items():
        assert torch.isfinite(a).all(), f"{label}: {name} has elements {variant} did not write"
        assert torch.equal(a, base[name]), f"{label}: {name} differs with {variant}"


VARLEN_LENGTHS = [0, 1, 63, 130, 1, 257, 64, 0, 5]  # empty, one-token, partial, multi-chunk sequences


def _ws_inputs(case, K, V, dtype, **kw):
    """The specialized-warpgroup cases' inputs, ``(q, k, v, g, beta, h0, cu)``: ``varlen*`` nine sequences of
    VARLEN_LENGTHS (H2 HV4), ``dense`` B2 T333 H2 HV4, any other case B2 T333 H1 HV2 with ``kw`` for _inputs."""
    if case.startswith("varlen"):
        cu = cu_seqlens(VARLEN_LENGTHS, "cuda")
        return (*_inputs(1, sum(VARLEN_LENGTHS), 2, 4, K, V, dtype, nseq=len(VARLEN_LENGTHS)), cu)
    if case == "dense":
        return (*_inputs(2, 333, 2, 4, K, V, dtype), None)
    return (*_inputs(2, 333, 1, 2, K, V, dtype, **kw), None)


def _check(name, ours, ref, fla):
    assert ours.shape == ref.shape, name
    assert torch.isfinite(ours).all(), f"{name}: non-finite values (an element the kernel did not write?)"
    e_ours = rel_l2(ours, ref)
    e_peer = 0.0 if fla is None else rel_l2(fla, ref)
    assert fla_compat_ok(e_ours, e_peer), f"{name}: ours {e_ours:.2e} vs FLA {e_peer:.2e}"


def _run_and_compare(q, k, v, g, beta, h0, cu=None, *, l2norm=True, A_log=None, dt_bias=None, beta_sigmoid=False,
                     neg=False, state_v_first=False):
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    K = q.shape[-1]
    scale = K**-0.5
    res = F90.forward(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu, use_gate_in_kernel=A_log is not None,
                      A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=neg,
                      state_v_first=state_v_first)
    assert res.tag == "sm90"
    o, ht = res.value
    assert o.dtype == q.dtype and ht.dtype == torch.float32
    ref_o, ref_h = oracle(q, k, v, g, beta, scale, h0, cu, l2norm=l2norm, A_log=A_log, dt_bias=dt_bias,
                          beta_sigmoid=beta_sigmoid, neg=neg, state_v_first=state_v_first)
    kw = dict(use_qk_l2norm_in_kernel=l2norm, state_v_first=state_v_first)
    if A_log is not None:
        kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    if beta_sigmoid:
        kw.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    fla = peer(q, k, v, g, beta, scale, h0, cu, **kw)
    _check("o", o.float(), ref_o, None if fla is None else fla[0].float())
    _check("final_state", ht, ref_h, None if fla is None else fla[1].float())


@pytest.fixture
def poisoned(monkeypatch):
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setattr(F90, "POISON", True)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_matches_oracle(poisoned, T, dtype):
    q, k, v, g, beta, h0 = _inputs(2, T, 2, 4, 128, 128, dtype)
    _run_and_compare(q, k, v, g, beta, h0)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_gva(poisoned, ratio, dtype):
    q, k, v, g, beta, h0 = _inputs(2, 200, 2, 2 * ratio, 128, 128, dtype)
    _run_and_compare(q, k, v, g, beta, h0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths", [[0, 1, 63, 130, 1, 257, 64, 0], [1000], [5, 0, 0, 77]])
def test_forward_varlen(poisoned, dtype, lengths):
    cu = cu_seqlens(lengths, "cuda")
    q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, 128, 128, dtype, nseq=len(lengths))
    _run_and_compare(q, k, v, g, beta, h0, cu)


@pytest.mark.gpu
@pytest.mark.parametrize("state_v_first", [False, True])
@pytest.mark.parametrize("with_h0", [False, True])
def test_forward_state_layouts(poisoned, state_v_first, with_h0):
    q, k, v, g, beta, h0 = _inputs(3, 150, 1, 2, 128, 128, torch.bfloat16, h0=with_h0, state_v_first=state_v_first)
    _run_and_compare(q, k, v, g, beta, h0, state_v_first=state_v_first)


@pytest.mark.gpu
@pytest.mark.parametrize("K, V", [(64, 64), (64, 128), (128, 64)])
def test_forward_head_dims(poisoned, K, V):
    q, k, v, g, beta, h0 = _inputs(2, 131, 2, 4, K, V, torch.bfloat16)
    _run_and_compare(q, k, v, g, beta, h0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_dt_bias", [False, True])
@pytest.mark.parametrize("neg", [False, True])
def test_forward_in_kernel_gate_and_beta(poisoned, dtype, with_dt_bias, neg):
    q, k, v, g, beta, h0 = _inputs(2, 97, 2, 4, 128, 128, dtype, raw_gate=True, beta_logits=True)
    # FLA's GatedDeltaNet initialization: A ~ U(1, 16), dt ~ logU(1e-3, 1e-1), dt_bias = softplus^-1(dt)
    A_log = torch.log(torch.empty(4, device="cuda").uniform_(1, 16))
    dt = torch.exp(torch.empty(4, device="cuda").uniform_(math.log(1e-3), math.log(1e-1)))
    dt_bias = dt + torch.log(-torch.expm1(-dt)) if with_dt_bias else None
    _run_and_compare(q, k, v, g, beta, h0, A_log=A_log, dt_bias=dt_bias, beta_sigmoid=True, neg=neg)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_without_in_kernel_l2norm(poisoned, dtype):
    q, k, v, g, beta, h0 = _inputs(2, 300, 2, 4, 128, 128, dtype, l2norm=False)
    _run_and_compare(q, k, v, g, beta, h0, l2norm=False)


@pytest.mark.gpu
def test_forward_strided_inputs_and_bf16_gate(poisoned):
    # q, k, v as views into one packed projection, as a layer's fused projection produces them
    B, T, H, HV, K, V = 2, 77, 2, 4, 128, 128
    packed = torch.randn(B, T, 2 * H * K + HV * V, device="cuda", dtype=torch.bfloat16)
    q = packed[..., : H * K].view(B, T, H, K)
    k = packed[..., H * K : 2 * H * K].view(B, T, H, K)
    v = packed[..., 2 * H * K :].view(B, T, HV, V)
    g = F.logsigmoid(torch.randn(B, T, HV, device="cuda")).to(torch.bfloat16)
    beta = torch.rand(B, T, 2 * HV, device="cuda", dtype=torch.bfloat16)[..., ::2]
    h0 = torch.randn(B, HV, K, V, device="cuda")
    _run_and_compare(q, k, v, g, beta, h0)


@pytest.mark.gpu
def test_forward_one_token_with_unit_dim_strides(poisoned):
    # T = 1 tensors whose size-1 dim has stride 1 (a permute of [B, H, K, 1]): served as contiguous ones
    B, H, HV, K = 2, 2, 4, 128
    q, k = (torch.randn(B, H, K, 1, device="cuda", dtype=torch.bfloat16).permute(0, 3, 1, 2) for _ in range(2))
    v = torch.randn(B, HV, K, 1, device="cuda", dtype=torch.bfloat16).permute(0, 3, 1, 2)
    assert q.stride(1) == 1 and v.stride(1) == 1
    g = F.logsigmoid(torch.randn(B, 1, HV, device="cuda"))
    beta = torch.rand(B, 1, HV, device="cuda")
    _run_and_compare(q, k, v, g, beta, torch.randn(B, HV, K, K, device="cuda"))


@pytest.mark.gpu
def test_forward_no_final_state_and_empty_batch(poisoned):
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, k, v, g, beta, h0 = _inputs(1, 70, 1, 1, 128, 128, torch.bfloat16)
    o, ht = F90.forward(q, k, v, g, beta, initial_state=h0, use_qk_l2norm_in_kernel=True).value
    assert ht is None
    ref_o, _ = oracle(q, k, v, g, beta, 128**-0.5, h0, None, l2norm=True)
    fla = peer(q, k, v, g, beta, 128**-0.5, h0, None, use_qk_l2norm_in_kernel=True)
    _check("o", o.float(), ref_o, None if fla is None else fla[0].float())
    # zero tokens: no launch; the final state is the initial one
    e = [t[:, :0] for t in (q, k, v, g, beta)]
    o, ht = F90.forward(*e, initial_state=h0, output_final_state=True).value
    assert o.shape == (1, 0, 1, 128) and torch.equal(ht, h0)


@pytest.mark.gpu
def test_forward_declines_unserved_head_dim():
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, k, v, g, beta, _ = _inputs(1, 10, 1, 1, 96, 128, torch.bfloat16)
    with pytest.raises(Unsupported, match="head dims"):
        F90.forward(q, k, v, g, beta)
    q, k, v, g, beta, _ = _inputs(1, 10, 1, 1, 128, 128, torch.float32)
    with pytest.raises(Unsupported, match="dtype"):
        F90.forward(q, k, v, g, beta)


@pytest.mark.gpu
def test_forward_varlen_is_graph_capturable(poisoned):
    """Varlen needs no device-to-host read: the forward replays inside a CUDA graph."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    lengths = [3, 0, 200, 64, 1]
    cu = cu_seqlens(lengths, "cuda")
    q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, nseq=len(lengths))
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    F90.forward(q, k, v, g, beta, **args)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = F90.forward(q, k, v, g, beta, **args).value
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        v.copy_(torch.randn_like(v))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, ref_h = oracle(q, k, v, g, beta, 128**-0.5, h0, cu, l2norm=True)
        fla = peer(q, k, v, g, beta, 128**-0.5, h0, cu, use_qk_l2norm_in_kernel=True)
        _check("o", o.float(), ref_o, None if fla is None else fla[0].float())
        _check("final_state", ht, ref_h, None if fla is None else fla[1].float())


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "k64_state_vk", "store_states"])
def test_state_prefetch_matches_synchronous_loads_bitwise(case, monkeypatch, poisoned):
    """The cp.async prefetch only changes how chunk tiles reach shared memory: the same math in
    the same order, so o, the final state and the chunk-start states are bitwise those of the
    synchronous loads (both layouts, GVA, tails, empty and one-token sequences)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    K, V, vk, cu, store = 128, 128, False, None, case == "store_states"
    if case == "k64_state_vk":
        K, vk = 64, True
    if case in ("varlen", "store_states"):
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, K, V, torch.bfloat16, nseq=len(lengths),
                                       state_v_first=vk)
    else:
        q, k, v, g, beta, h0 = _inputs(2, 333, 2, 4, K, V, torch.bfloat16, state_v_first=vk)
    monkeypatch.setattr(F90, "SPLIT", False)  # the fused state kernel, where the prefetch lives
    monkeypatch.setattr(F90, "STATE_WS", False)  # the fused kernel, not the specialized warpgroups
    orig = F90.get_state_kernel
    outs = []
    for pf in (True, False):
        monkeypatch.setattr(F90, "get_state_kernel", lambda *a, pf=pf, **kw: orig(*a, **{**kw, "prefetch": pf}))
        res = F90.forward(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                          cu_seqlens=cu, state_v_first=vk, store_states=store)
        o, ht = res.value[:2]
        outs.append((o, ht) + ((res.value[2][3],) if store else ()))
    if store:  # rows past the varlen chunk count are never written: compare the written ones
        cu_chunks = F90.chunk_map(cu, 1, q.shape[1], q.device)[1]
        rows = int(cu_chunks[-1])
        outs = [(o, ht, hs[:rows]) for o, ht, hs in outs]
    names = ("o", "final_state", "chunk_states")
    _assert_bitwise(case, dict(zip(names, outs[0])), dict(zip(names, outs[1])), "the cp.async prefetch")


@pytest.mark.gpu
@pytest.mark.parametrize("vb", [16, 32, 64])
@pytest.mark.parametrize("case", ["dense", "varlen", "k64_state_vk", "fp16_no_l2norm"])
def test_split_state_pass_matches_oracle_and_fused_kernel(case, vb, monkeypatch, poisoned):
    """The chain + out kernels (the inference forward's default) at both V blocks of the chain: o and
    the final state against the oracle under the FLA-compat rule, and against the fused state kernel
    (same rounding points, only the WGMMA summation order differs)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setenv("CUDNN_TRAIN_GDN_CHAIN_VB", str(vb))
    K, V, vk, cu, l2, dtype = 128, 128, False, None, True, torch.bfloat16
    if case == "k64_state_vk":
        K, vk = 64, True
    if case == "fp16_no_l2norm":
        l2, dtype = False, torch.float16
    if case == "varlen":
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, K, V, dtype, nseq=len(lengths))
    else:
        q, k, v, g, beta, h0 = _inputs(2, 333, 2, 4, K, V, dtype, l2norm=l2, state_v_first=vk)
    _run_and_compare(q, k, v, g, beta, h0, cu, l2norm=l2, state_v_first=vk)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                state_v_first=vk)
    split = F90.forward(q, k, v, g, beta, **args).value
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", False)  # the fused kernel, not the specialized warpgroups
    fused = F90.forward(q, k, v, g, beta, **args).value
    for name, a, b in zip(("o", "final_state"), split, fused):
        err = rel_l2(a.float(), b.float())
        assert err < 2e-3, f"{case}, VB {vb}: {name} differs from the fused kernel's by {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("vb", [16, 32, 64])
@pytest.mark.parametrize("case", ["dense", "varlen", "varlen_tail", "k64_state_vk_fp16"])
def test_split_chain_tma_is_bitwise_cp_async(case, vb, monkeypatch, poisoned):
    """The training forward's chain with its loads by TMA (CUDNN_TRAIN_GDN_CHAIN_TMA: one thread issues a chunk's
    w, k and u on the buffer's mbarrier; a sequence's last chunk has its rows past the end zeroed once landed)
    brings the same bytes as cp.async: o, the final state and every written chunk-start state bitwise equal, at
    both V blocks; dense T 333 (rows past the tensor's end), varlen with empty and one-token sequences, varlen
    with 37 rows past the last sequence (w and u there are never written: poisoned memory), K = 64 fp16 with [V,
    K] states."""
    F90, (q, k, v, g, beta), args = _chain_case(case, vb, monkeypatch)
    cu = args["cu_seqlens"]
    outs = []
    for tma in ("0", "1"):
        monkeypatch.setenv("CUDNN_TRAIN_GDN_CHAIN_TMA", tma)
        res = F90.forward(q, k, v, g, beta, **args).value
        outs.append((res[0], res[1], res[2][3]))
    if cu is not None:  # rows past the varlen chunk count are never written; o past the last sequence neither
        rows = int(F90.chunk_map(cu, 1, q.shape[1], q.device)[1][-1])
        end = int(cu[-1])
        outs = [(o[:, :end], ht, hs[:rows]) for o, ht, hs in outs]
    names = ("o", "final_state", "chunk_states")
    _assert_bitwise(f"{case}, VB {vb}", dict(zip(names, outs[1])), dict(zip(names, outs[0])), "the chain's TMA loads")


@pytest.mark.compile
def test_split_chain_segments_compile_for_sm90a(kernel_cache):
    """The chain split into segments (CUDNN_TRAIN_GDN_CHAIN_SEG): dense with the initial and final states
    at VB 32, varlen without them at VB 16, the most segments."""
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP

    assert callable(SP.get_chain_kernel(*CHAIN_VARIANTS[0], nseg=4))
    assert callable(SP.get_chain_kernel(*CHAIN_VARIANTS[2], nseg=16))
    assert len(list(kernel_cache.rglob("*.o"))) == 2


def _segment_inputs(varlen: bool):
    """The segment cases' inputs, ``(K, (q, k, v, g, beta, h0), cu)``: H2 HV4 K = V = 128 bf16, dense B2 T2000 or
    varlen (SEG_VARLEN: empty, one-token and partial sequences, some of fewer chunks than segments), the gates of
    gdn_seg_gates (tests/utils.py: three steady rates, one with random spikes)."""
    H, HV, K, V, dtype, cu = 2, 4, 128, 128, torch.bfloat16, None
    if varlen:
        lengths = SEG_VARLEN
        cu = cu_seqlens(lengths, "cuda")
        q, k, v, g, beta, h0 = _inputs(1, sum(lengths), H, HV, K, V, dtype, nseq=len(lengths))
    else:
        q, k, v, g, beta, h0 = _inputs(2, 2000, H, HV, K, V, dtype)
    g = gdn_seg_gates(*g.shape[:2], "cuda")
    return K, (q, k, v, g, beta, h0), cu


@pytest.mark.gpu
@pytest.mark.parametrize("case, nseg", [("dense", 4), ("dense_inference", 4), ("varlen", 4), ("vb32", 16)])
def test_split_chain_segments(case, nseg, monkeypatch, poisoned):
    """The chain split into ``nseg`` segments a sequence, each after a warm-up from a zero state reaching back until the
    chunks' decay is below e^-20 (CUDNN_TRAIN_GDN_CHAIN_SEG), against the unsplit chain: the value head that never
    decays that far (head 0 of gdn_seg_gates, tests/utils.py) bitwise in o, the final state, every chunk-start state
    and vn; all heads within 1e-4 relative L2 of the unsplit outputs (a warm-up a chunk too short is no warm-up
    at all for head 2, an O(1) error, and a search off by a chunk starts head 3 from zero
    before a spike instead of after one), and o and the final state against the float32 oracle under the FLA-compat
    rule and no more than 2% farther from it than the unsplit chain's (see ``_check_segments``). Dense B2 T2000
    (32 chunks: segments of 8, a partial last chunk), the inference forward's call, varlen with
    empty, one-token and partial sequences and some of fewer chunks than segments, 16 segments of 2 chunks at VB
    32."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setattr(F90, "SPLIT", True)  # the split pass, whatever CUDNN_TRAIN_GDN_FWD_SPLIT / _WS say
    monkeypatch.setenv("CUDNN_TRAIN_GDN_CHAIN_VB", "32" if case == "vb32" else "64")
    _check_segments(case, "CUDNN_TRAIN_GDN_CHAIN_SEG", nseg, monkeypatch, training=case != "dense_inference")


@pytest.mark.compile
def test_ws_segments_compile_for_sm90a(kernel_cache):
    """The inference forward's specialized warpgroups split into segments (CUDNN_TRAIN_GDN_FWD_WS_SEG): 128
    columns with w and u formed in the chain, 64 columns varlen with the initial and final states (two output
    warpgroups); not for the training forward or without l2norm (a ValueError naming nseg)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    assert callable(WS.get_kernel(torch.bfloat16, 128, 128, True, False, False, False, False, onfly=True, vb=128,
                                  nseg=4))
    assert callable(WS.get_kernel(torch.bfloat16, 128, 128, True, True, True, True, False, vb=64, nseg=16))
    assert len(list(kernel_cache.rglob("*.o"))) == 2
    for kw in (dict(l2norm=False), dict(store_states=True)):
        args = dict(l2norm=True, store_states=False) | kw
        with pytest.raises(ValueError, match="nseg"):
            WS.get_kernel(torch.bfloat16, 128, 128, args["l2norm"], False, False, False, False,
                          store_states=args["store_states"], nseg=4)


def test_ws_segments_switch(monkeypatch):
    """CUDNN_TRAIN_GDN_FWD_WS_SEG: one segment unless asked (1 or unset); auto, the fewest segments whose grid of
    128-column CTAs reaches 90% of the SMs, with segments of at least 16 chunks; a bad value is a ValueError naming
    it."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    monkeypatch.setattr(kc, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    monkeypatch.delenv("CUDNN_TRAIN_GDN_FWD_WS_SEG", raising=False)
    assert WS.segments(1, 32, 128, 16384, True, dev) == 1
    monkeypatch.setenv("CUDNN_TRAIN_GDN_FWD_WS_SEG", "1")
    assert WS.segments(1, 32, 128, 16384, True, dev) == 1
    monkeypatch.setenv("CUDNN_TRAIN_GDN_FWD_WS_SEG", "auto")
    assert [WS.segments(n, 32, 128, t, True, dev) for n, t in ((1, 16384), (4, 16384))] == [4, 1]
    assert WS.segments(1, 32, 128, 16384, False, dev) == 1
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_FWD_WS_SEG", lambda: WS.segments(1, 32, 128, 16384, True, dev),
                        "16", 16, ("3", "x"))


@pytest.mark.gpu
@pytest.mark.parametrize("case, nseg", [("dense", 4), ("dense_vb128", 4), ("varlen", 4), ("vb128", 16)])
def test_ws_segments(case, nseg, monkeypatch, poisoned):
    """The inference forward's specialized warpgroups split into ``nseg`` segments a sequence (CUDNN_TRAIN_GDN_FWD_
    WS_SEG), each after a decay-truncated warm-up, against the unsplit kernel of the same columns: the head that
    never decays by e^-20 bitwise in o and the final state, all heads within 1e-4 relative L2, and against the
    float32 oracle (no more than 2% farther than the unsplit kernel). 64 columns (two output warpgroups) dense
    and varlen with
    empty, one-token and partial sequences; 128 columns with w and u formed in the chain, also in 16 segments."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    monkeypatch.setattr(F90, "SPLIT", False)  # the specialized warpgroups, whatever the grid would pick
    monkeypatch.setattr(F90, "STATE_WS", True)
    monkeypatch.setattr(WS, "VB_MODE", "128" if "vb128" in case else "64")
    _check_segments(case, "CUDNN_TRAIN_GDN_FWD_WS_SEG", nseg, monkeypatch, training=False)


@pytest.mark.compile
def test_carry_prepare_compiles_for_sm90a(kernel_cache):
    """The carried split's prepare step (CUDNN_TRAIN_GDN_FWD_CARRY, prepared): the chain walking into each boundary,
    L's and M's columns in one grid; dense bf16 K = V = 128 in 4 segments, varlen fp16 K = V = 64 in 16; a
    ValueError naming prep_cap for what it does not take (one segment, an initial state, a negative cap)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP

    assert callable(SP.get_chain_kernel(torch.bfloat16, 128, 128, 32, True, False, False, False, False, nseg=4,
                                        prep_cap=16))
    assert callable(SP.get_chain_kernel(torch.float16, 64, 64, 32, True, True, False, False, False, nseg=16,
                                        prep_cap=4))
    assert len(list(kernel_cache.rglob("*.o"))) == 2
    for nseg, has_h0, cap in ((1, False, 16), (4, True, 16), (4, False, -1)):
        with pytest.raises(ValueError, match="prep_cap"):
            SP.get_chain_kernel(torch.bfloat16, 128, 128, 32, True, False, has_h0, False, False, nseg=nseg,
                                prep_cap=cap)


def test_carry_switch(monkeypatch):
    """CUDNN_TRAIN_GDN_FWD_CARRY: auto, the specialized warpgroups' segment count (B1 T16384 HV32: 4; B4: 1); unset,
    auto for bf16 at K = V = 128 (the default since the twenty-seventh session) and off otherwise; 1, off; never
    without l2norm; a bad value is a ValueError naming it."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP

    monkeypatch.setattr(kc, "num_sms", lambda device: 132)
    dev = torch.device("cpu")
    monkeypatch.delenv("CUDNN_TRAIN_GDN_FWD_CARRY", raising=False)
    bf = torch.bfloat16
    assert [SP.carry_segments(n, 32, 128, 128, 16384, True, dev, bf) for n in (1, 4)] == [4, 1]
    # unset and outside what the GPU cases cover (fp16, K = V = 64): off
    assert SP.carry_segments(1, 32, 128, 128, 16384, True, dev, torch.float16) == 1
    assert SP.carry_segments(1, 32, 64, 64, 16384, True, dev, bf) == 1
    monkeypatch.setenv("CUDNN_TRAIN_GDN_FWD_CARRY", "1")
    assert SP.carry_segments(1, 32, 128, 128, 16384, True, dev) == 1
    monkeypatch.setenv("CUDNN_TRAIN_GDN_FWD_CARRY", "auto")
    assert [SP.carry_segments(n, 32, 128, 128, 16384, True, dev) for n in (1, 4)] == [4, 1]
    assert SP.carry_segments(1, 32, 128, 128, 16384, False, dev) == 1
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_FWD_CARRY",
                        lambda: SP.carry_segments(1, 32, 128, 128, 16384, True, dev), "16", 16, ("3", "x"))


def test_carry_virtual_sequences_and_combine():
    """The carried split's host steps on the CPU: the segments as sequences (dense on the host and varlen by tensor
    ops give the same bounds; segment s of n chunks starts at chunk n s // nseg, the prepare kernel's plan; empty,
    one-token and partial sequences), and the combine against its recurrence written out in float64."""
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP
    from cudnn_train.kernels import gated_delta_rule_common_sm90 as cm

    dev = torch.device("cpu")
    dense = SP.virtual_cu(None, 2, 2000, 4, dev)
    assert dense.tolist() == [0, 512, 1024, 1536, 2000, 2512, 3024, 3536, 4000]
    assert torch.equal(SP.virtual_cu(cu_seqlens([2000, 2000]), 2, 2000, 4, dev), dense)
    lengths = SEG_VARLEN
    got = SP.virtual_cu(cu_seqlens(lengths), 1, sum(lengths), 4, dev).tolist()
    want, start = [], 0
    for length in lengths:
        n = -(-length // 64)
        want += [start + (n * s // 4) * 64 for s in range(4)]
        start += length
    assert got == want + [start]

    gen = torch.Generator().manual_seed(0)
    nseq, nseg, HV, K, V = 3, 4, 2, 8, 16
    LM = torch.randn(nseq * (nseg - 1), HV, K, V + K, generator=gen)
    h0 = torch.randn(nseq, HV, K, V, generator=gen)
    starts = cm.combine_carries(LM, h0, nseq, nseg, V).view(nseq, nseg, HV, K, V)
    for n in range(nseq):
        S = h0[n].double()
        assert torch.equal(starts[n, 0], h0[n])
        for s in range(nseg - 1):
            row = LM[n * (nseg - 1) + s].double()
            S = row[..., V:] @ S + row[..., :V]
            assert torch.allclose(starts[n, s + 1].double(), S, rtol=1e-6, atol=1e-6), (n, s)
    assert torch.equal(cm.combine_carries(LM, None, nseq, nseg, V).view(nseq, nseg, HV, K, V)[:, 0],
                       torch.zeros(nseq, HV, K, V))


@pytest.mark.gpu
@pytest.mark.parametrize("case, nseg", [("dense", 4), ("varlen", 4), ("dense_16", 16)])
def test_carried_forward(case, nseg, monkeypatch, poisoned):
    """The inference forward with its carried split (CUDNN_TRAIN_GDN_FWD_CARRY: prepare, combine, the specialized
    warpgroups over the segments as sequences) against the float32 oracle and the same forward unsplit on the same
    kernel (w and u from the wy kernel): every element written, o and the final state under the FLA-compat rule
    and within 1.25x the unsplit forward's error (the carry's products round differently from the walk they
    replace: not the unsplit bits, unlike the warm-up split's slow head), for every gate regime of gdn_seg_gates:
    head 0 never decays, so every boundary is carried exactly (a missing or wrong transition is an O(1) error),
    heads 2 and 3 warm up. Dense with the initial and final states, varlen with empty, one-token and partial
    sequences, 16 segments of 2 chunks."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setattr(F90, "SPLIT", False)  # the unsplit call on the main pass's kernel
    monkeypatch.setattr(F90, "STATE_WS", True)
    monkeypatch.setattr(F90, "ONFLY", False)
    K, (q, k, v, g, beta, h0), cu = _segment_inputs(case == "varlen")
    args = dict(scale=K**-0.5, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu)
    outs = []
    for n in ("1", str(nseg)):
        monkeypatch.setenv("CUDNN_TRAIN_GDN_FWD_CARRY", n)
        o, ht = F90.forward(q, k, v, g, beta, **args).value
        end = q.shape[1] if cu is None else int(cu[-1])  # o past the last sequence is never written
        outs.append(dict(o=o[:, :end].float(), final_state=ht))
    ref_o, ref_h = oracle(q, k, v, g, beta, K**-0.5, h0, cu, l2norm=True)
    for name, ref in (("o", ref_o[:, :outs[0]["o"].shape[1]]), ("final_state", ref_h)):
        base, split = outs[0][name], outs[1][name]
        _check(name, split, ref, None)  # also: every element written
        err, err_base = rel_l2(split, ref), rel_l2(base, ref)
        assert err <= 1.25 * err_base, f"{case}: {name} {err:.3e} from the oracle against the unsplit {err_base:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case, nseg", [("dense", 4), ("varlen", 4)])
def test_carried_training_forward_with_tstore(case, nseg, monkeypatch, poisoned):
    """The training forward carried (CUDNN_TRAIN_GDN_FWD_CARRY with CUDNN_TRAIN_GDN_FWD_WS_TSTORE: prepare, combine,
    the specialized warpgroups over the segments as sequences, writing the chunk states and vn of their chunks)
    against the same forward unsplit on the same kernel: o and the final state under the FLA-compat rule, and o, the
    final state, the chunk states and vn (every row written) each within 1.25x the unsplit forward's error from
    their oracle (the float32 recurrence; for the chunk states and vn the float64 chunked forward of
    ``fused/delta_rule_bwd``), as the inference forward's carried cases. (The first GPU run, on the H200, held the
    chunk states to 1e-3 relative L2 of the unsplit ones and found 2.95e-3 and 2.67e-3: the segments' start states
    are not the unsplit chain's to the last float32 bits, since the prepare step builds each segment's transition
    through the chain's bf16 products, so they differ at the chain's own rounding; o and the final state passed.)"""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", True)
    monkeypatch.setattr(WS, "TSTORE", True)
    K, (q, k, v, g, beta, h0), cu = _segment_inputs(case == "varlen")
    args = dict(scale=K**-0.5, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu, store_states=True, keep_vn=True)
    rows = int(F90.chunk_map(cu, q.shape[0], q.shape[1], q.device)[1][-1]) if cu is not None else None
    end = q.shape[1] if cu is None else int(cu[-1])
    outs = []
    for n in ("1", str(nseg)):
        monkeypatch.setenv("CUDNN_TRAIN_GDN_FWD_CARRY", n)
        o, ht, (_, _, _, hs, vn, _) = F90.forward(q, k, v, g, beta, **args).value
        outs.append(dict(o=o[:, :end].float(), final_state=ht, chunk_states=hs[:rows].float(),
                         vn=vn[:, :end].float()))
    ref_o, ref_h = oracle(q, k, v, g, beta, K**-0.5, h0, cu, l2norm=True)
    ref_hs, ref_vn = _chunk_oracle(q, k, v, g, beta, K**-0.5, h0, cu)
    refs = dict(o=ref_o[:, :end], final_state=ref_h, chunk_states=ref_hs[:rows].float(), vn=ref_vn[:, :end].float())
    for name, ref in refs.items():
        base, split = outs[0][name], outs[1][name]
        assert torch.isfinite(split).all(), f"{case}: {name} has elements the carried pass did not write"
        if name in ("o", "final_state"):
            _check(name, split, ref, None)
        err, err_base = rel_l2(split, ref), rel_l2(base, ref)
        assert err <= 1.25 * err_base, (f"{case}: {name} {err:.3e} from the oracle against the unsplit {err_base:.3e} "
                                        f"({rel_l2(split, base):.2e} from the unsplit)")


def _chunk_oracle(q, k, v, g, beta, scale, h0, cu):
    """The float64 chunk-start states (kernel rows ``[rows, HV, K, V]``) and vn (``[B, T, HV, V]``) of the chunked
    forward with q and k l2-normalized: ``fused/delta_rule_bwd``'s stage 1 (``_recompute``) and forward sweep
    (``sweeps_ref``), vn = u - w S per chunk."""
    from cudnn_train.fused.delta_rule_bwd import ChunkLayout, _recompute, new_values, sweeps_ref

    B, T, H, _ = q.shape
    HV = v.shape[2]
    lay = ChunkLayout(B, T, 64, cu)
    qc, kc = (lay.to_chunks(_l2n(t.double()).repeat_interleave(HV // H, dim=2)) for t in (q, k))
    r = _recompute(qc, kc, lay.to_chunks(v.double()), lay.to_chunks(g.double().unsqueeze(-1)),
                   lay.to_chunks(beta.double().unsqueeze(-1)), scale, 64)
    Sc, _ = sweeps_ref(r, lay, None if h0 is None else h0.double(), None, None)
    return lay.chunks_to_rows(Sc), lay.from_chunks(new_values(r, Sc))


def _check_segments(case, switch, nseg, monkeypatch, training):
    """The segment cases' check: the forward with ``switch`` at 1 and at ``nseg`` (with ``training``, also the
    chunk-start states and vn): the slow head (head 0) bitwise, all heads within 1e-4 relative L2, every output
    written, and o and the final state against the float32 oracle, the split no more than 2% farther from it
    than the unsplit kernel. (The float32 final state was held to 1e-5 of the unsplit one until the twenty-sixth
    session's H100 run: in 16 segments the head with an 8-chunk warm-up differed by 9.3e-5 and 1.4e-4, all
    heads' state by 2.2e-5 and 2.9e-5, with split and unsplit both 3.39e-3 and 3.07e-3 from the oracle: a state that
    differs in its last float32 bits after the warm-up rounds differently to bf16 for the chunk products, 2^-8 of
    an element where it flips, so the float32 output is as close as the bf16 products make it, not closer.)"""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    K, (q, k, v, g, beta, h0), cu = _segment_inputs(case == "varlen")
    args = dict(scale=K**-0.5, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu, store_states=training, keep_vn=training)
    outs = []
    for n in ("1", str(nseg)):
        monkeypatch.setenv(switch, n)
        res = F90.forward(q, k, v, g, beta, **args).value
        out = dict(o=res[0], final_state=res[1])
        if training:
            out.update(chunk_states=res[2][3], vn=res[2][4])
        outs.append(out)
    if cu is not None:  # rows past the varlen chunk count are never written, nor o and vn past the last sequence
        rows = int(F90.chunk_map(cu, 1, q.shape[1], q.device)[1][-1])
        end = int(cu[-1])
        for out in outs:
            out["o"] = out["o"][:, :end]
            if training:
                out["chunk_states"], out["vn"] = out["chunk_states"][:rows], out["vn"][:, :end]
    base, split = outs
    hdim = dict(o=2, final_state=1, chunk_states=1, vn=2)  # the value-head dimension of each output
    ref_o, ref_h = oracle(q, k, v, g, beta, K**-0.5, h0, cu, l2norm=True)
    ref = dict(o=ref_o, final_state=ref_h)
    for name, a in split.items():
        assert torch.isfinite(a).all(), f"{case}: {name} has elements the split kernel did not write"
        assert torch.equal(a.select(hdim[name], 0), base[name].select(hdim[name], 0)), \
            f"{case}: {name} of the slow head differs"
        tol = 1e-4
        err = rel_l2(a.float(), base[name].float())
        if err > tol:  # to tell rounding from a wrong warm-up: each head's part, and both kernels' against the oracle
            heads = [rel_l2(a.select(hdim[name], i).float(), base[name].select(hdim[name], i).float())
                     for i in range(a.shape[hdim[name]])]
            vs_ref = "" if name not in ref else (
                f"; against the float32 oracle: split {rel_l2(a.float(), ref[name]):.2e}, "
                f"unsplit {rel_l2(base[name].float(), ref[name]):.2e}")
            raise AssertionError(f"{case}: {name} {err:.2e} from the unsplit kernel's (tolerance {tol:.0e}); by head "
                                 + ", ".join(f"{e:.1e}" for e in heads) + vs_ref)
    for name, r in ref.items():
        _check(name, split[name].float(), r, None)
        err, err_base = rel_l2(split[name].float(), r), rel_l2(base[name].float(), r)
        assert err <= 1.02 * err_base, f"{case}: {name} {err:.3e} from the oracle against the unsplit {err_base:.3e}"


def _chain_case(case, vb, monkeypatch):
    """The chain cases' inputs (the split pass at V block ``vb``): ``(F90, (q, k, v, g, beta), forward's kwargs)``
    for the training forward's call (chunk-start states stored)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setenv("CUDNN_TRAIN_GDN_CHAIN_VB", str(vb))
    monkeypatch.setattr(F90, "SPLIT", True)  # the split pass, whatever CUDNN_TRAIN_GDN_FWD_SPLIT / _WS say
    K, vk, cu, dtype = 128, False, None, torch.bfloat16
    if case.startswith("k64"):
        K, vk, dtype = 64, True, torch.float16
    if case.startswith("varlen"):  # the last sequence (5 tokens) is one partial chunk
        lengths = VARLEN_LENGTHS
        cu = cu_seqlens(lengths, "cuda")
        T = sum(lengths) + (37 if case == "varlen_tail" else 0)
        q, k, v, g, beta, h0 = _inputs(1, T, 2, 4, K, 128, dtype, nseq=len(lengths))
    else:
        q, k, v, g, beta, h0 = _inputs(2, 333, 2, 4, K, 128, dtype, state_v_first=vk)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                state_v_first=vk, store_states=True)
    return F90, (q, k, v, g, beta), args


@pytest.mark.gpu
@pytest.mark.parametrize("case, vb, which", [("dense", 64, "hs"), ("dense", 64, "vn"), ("dense", 64, "both"),
                                             ("dense", 32, "both"), ("varlen", 64, "both"),
                                             ("varlen_tail", 64, "both"), ("varlen_tail", 32, "both"),
                                             ("k64_state_vk_fp16", 64, "both"), ("k64_state_vk_fp16", 16, "both")])
def test_split_chain_tma_stores_are_bitwise(case, vb, which, monkeypatch, poisoned):
    """The chain's stores by TMA (CUDNN_TRAIN_GDN_CHAIN_HSTMA: the chunk-start state from its shared tile;
    CUDNN_TRAIN_GDN_CHAIN_VNTMA: a full chunk's vn from a tile of its own, a partial chunk's by pairs) write the
    bytes the default's stores write: o, the final state, every written chunk-start state and vn bitwise equal;
    dense T 333 (a partial last chunk), varlen with empty and one-token sequences, varlen with 37 rows past the last
    sequence (never written: poisoned memory), K = 64 fp16 with [V, K] states, V blocks 64, 32 and 16."""
    F90, (q, k, v, g, beta), args = _chain_case(case, vb, monkeypatch)
    cu = args["cu_seqlens"]
    args["keep_vn"] = True
    outs = []
    for on in (False, True):
        monkeypatch.setenv("CUDNN_TRAIN_GDN_CHAIN_HSTMA", "1" if on and which in ("hs", "both") else "0")
        monkeypatch.setenv("CUDNN_TRAIN_GDN_CHAIN_VNTMA", "1" if on and which in ("vn", "both") else "0")
        res = F90.forward(q, k, v, g, beta, **args).value
        outs.append((res[0], res[1], res[2][3], res[2][4]))
    end = q.shape[1]
    if cu is not None:  # rows past the varlen chunk count are never written; o and vn past the last sequence neither
        rows = int(F90.chunk_map(cu, 1, q.shape[1], q.device)[1][-1])
        end = int(cu[-1])
        outs = [(o[:, :end], ht, hs[:rows], vn[:, :end]) for o, ht, hs, vn in outs]
    names = ("o", "final_state", "chunk_states", "vn")
    _assert_bitwise(f"{case}, VB {vb}, {which}", dict(zip(names, outs[1])), dict(zip(names, outs[0])),
                    "the chain's TMA stores")
    if case == "varlen_tail":  # vn rows past the last sequence: still the poison
        vn_full = F90.forward(q, k, v, g, beta, **args).value[2][4]
        assert torch.isnan(vn_full[:, end:]).all(), f"{case}, VB {vb}: vn written past the last sequence"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "varlen_tail", "k64_fp16_vk", "k64_v128_gva4", "training"])
def test_split_out_tma_is_bitwise_cp_async(case, monkeypatch, poisoned):
    """The split pass's out kernel with its loads by TMA (CUDNN_TRAIN_GDN_OUT_TMA: q, k and the chunk-start state
    on one mbarrier, vn on another waited for only before P vn; rows past a sequence's end zeroed once landed)
    writes the same o as with cp.async, bitwise: dense T 333 (rows past the tensor's end), varlen with empty and
    one-token sequences, varlen with 37 rows past the last sequence (vn there is never written: poisoned memory),
    K = V = 64 fp16 with [V, K] states, K = 64 with V = 128 and GVA 4, and the training forward's call."""
    _check_out_switch(case, monkeypatch, "CUDNN_TRAIN_GDN_OUT_TMA", "the out kernel's TMA loads")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "varlen_tail", "k64_fp16_vk", "k64_v128_gva4", "training"])
def test_split_out_o_tma_store_is_bitwise(case, monkeypatch, poisoned):
    """The out kernel's o by one TMA store (CUDNN_TRAIN_GDN_OUT_OTMA: a full chunk's o through vn's shared tile; a
    partial chunk's by pairs) writes the bytes the pair stores write, in the TMA loads' cases; o's rows past the
    last sequence (varlen_tail) stay the poison."""
    _check_out_switch(case, monkeypatch, "CUDNN_TRAIN_GDN_OUT_OTMA", "the out kernel's o TMA store")


def _check_out_switch(case, monkeypatch, switch, label):
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setattr(F90, "SPLIT", True)  # the split pass, whatever CUDNN_TRAIN_GDN_FWD_SPLIT / _WS say
    K, V, vk, cu, dtype, H, HV = 128, 128, False, None, torch.bfloat16, 2, 4
    if case == "k64_fp16_vk":
        K, V, vk, dtype = 64, 64, True, torch.float16
    if case == "k64_v128_gva4":
        K, H = 64, 1
    if case.startswith("varlen"):  # the last sequence (5 tokens) is one partial chunk
        lengths = VARLEN_LENGTHS
        cu = cu_seqlens(lengths, "cuda")
        T = sum(lengths) + (37 if case == "varlen_tail" else 0)
        q, k, v, g, beta, h0 = _inputs(1, T, H, HV, K, V, dtype, nseq=len(lengths))
    else:
        q, k, v, g, beta, h0 = _inputs(2, 333, H, HV, K, V, dtype, state_v_first=vk)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                state_v_first=vk, store_states=case == "training")
    outs = []
    for on in ("0", "1"):
        monkeypatch.setenv(switch, on)
        res = F90.forward(q, k, v, g, beta, **args).value
        outs.append((res[0], res[1]))
    if cu is not None:  # o past the last sequence is never written
        end = int(cu[-1])
        if case == "varlen_tail":
            assert torch.isnan(outs[1][0][:, end:]).all(), f"{case}: o written past the last sequence ({label})"
        outs = [(o[:, :end], ht) for o, ht in outs]
    names = ("o", "final_state")
    _assert_bitwise(case, dict(zip(names, outs[1])), dict(zip(names, outs[0])), label)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "k64_state_vk", "fp16_no_l2norm", "v64_gva"])
def test_specialized_warpgroups_match_oracle_and_fused_kernel(case, monkeypatch, poisoned):
    """The fused state pass on two specialized warpgroups (CUDNN_TRAIN_GDN_FWD_WS): o and the final state
    against the oracle under the FLA-compat rule; against the fused kernel, without the l2norm, the final
    state bitwise (the chain runs the fused kernel's instructions on the same values), with it close (the
    norms are summed in another order), and o close (its two products have their operand roles swapped)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    K, V, vk, cu, l2, dtype, H, HV = 128, 128, False, None, True, torch.bfloat16, 2, 4
    if case == "k64_state_vk":
        K, vk = 64, True
    if case == "fp16_no_l2norm":
        l2, dtype = False, torch.float16
    if case == "v64_gva":
        V, H, HV = 64, 1, 4
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", True)
    monkeypatch.setattr(F90, "ONFLY", False)  # w, u from the wy kernel (the onfly test covers the other)
    if case == "varlen":
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        q, k, v, g, beta, h0 = _inputs(1, sum(lengths), H, HV, K, V, dtype, nseq=len(lengths))
    else:
        q, k, v, g, beta, h0 = _inputs(2, 333, H, HV, K, V, dtype, l2norm=l2, state_v_first=vk)
    _run_and_compare(q, k, v, g, beta, h0, cu, l2norm=l2, state_v_first=vk)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                state_v_first=vk)
    ws = F90.forward(q, k, v, g, beta, **args).value
    monkeypatch.setattr(F90, "STATE_WS", False)
    fused = F90.forward(q, k, v, g, beta, **args).value
    assert torch.isfinite(ws[0]).all(), f"{case}: o has elements the kernel did not write"
    if not l2:
        assert torch.equal(ws[1], fused[1]), f"{case}: the final state differs from the fused kernel's"
    for name, a, b in zip(("o", "final_state"), ws, fused):
        err = rel_l2(a.float(), b.float())
        assert err < 2e-3, f"{case}: {name} differs from the fused kernel's by {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["varlen", "k64_fp16_no_l2norm"])
def test_specialized_warpgroups_training_forward(case, monkeypatch, poisoned):
    """The training forward (``store_states``, ``keep_vn``) on the specialized warpgroups: o and the final
    state against the oracle; the chunk-start states and the final state against the one-warpgroup fused
    kernel's (the same chain): bitwise without the l2norm, close with it (norms summed in another order);
    vn close to the split pass's chain's (other summation order)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    K, V, l2, dtype, cu = 128, 128, True, torch.bfloat16, None
    if case == "varlen":
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, K, V, dtype, nseq=len(lengths))
    else:
        K, V, l2, dtype = 64, 64, False, torch.float16
        q, k, v, g, beta, h0 = _inputs(2, 333, 1, 2, K, V, dtype, l2norm=False)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                store_states=True, keep_vn=True)
    rows = int(F90.chunk_map(cu, q.shape[0], q.shape[1], q.device)[1][-1]) if cu is not None else None
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", True)
    o, ht, (_, _, _, hs, vn, _) = F90.forward(q, k, v, g, beta, **args).value
    ref_o, ref_h = oracle(q, k, v, g, beta, K**-0.5, h0, cu, l2norm=l2)
    _check("o", o.float(), ref_o, None)
    _check("final_state", ht, ref_h, None)
    monkeypatch.setattr(F90, "STATE_WS", False)
    orig = F90.get_state_kernel
    monkeypatch.setattr(F90, "get_state_kernel", lambda *a, **kw: orig(*a, **{**kw, "wgs": 1}))
    _, f_ht, (_, _, _, f_hs, _, _) = F90.forward(q, k, v, g, beta, **args).value
    assert torch.isfinite(hs[:rows]).all(), f"{case}: chunk-state rows the kernel did not write"
    if not l2:
        assert torch.equal(hs[:rows], f_hs[:rows]), f"{case}: chunk-start states differ from the fused kernel's"
        assert torch.equal(ht, f_ht), f"{case}: the final state differs from the fused kernel's"
    for name, a, b in (("chunk_states", hs[:rows], f_hs[:rows]), ("final_state", ht, f_ht)):
        err = rel_l2(a.float(), b.float())
        assert err < 2e-3, f"{case}: {name} differs from the fused kernel's by {err:.2e}"
    monkeypatch.setattr(F90, "SPLIT", True)
    s_vn = F90.forward(q, k, v, g, beta, **args).value[2][4]
    assert torch.isfinite(vn).all(), f"{case}: vn has elements the kernel did not write"
    err = rel_l2(vn.float(), s_vn.float())
    assert err < 2e-3, f"{case}: vn differs from the split chain's by {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "k64_fp16_no_l2norm", "v64_varlen", "varlen_training",
                                  "onfly_dense", "onfly_varlen"])
def test_specialized_warpgroups_tma_loads_are_bitwise_the_cp_async_ones(case, monkeypatch, poisoned):
    """The specialized-warpgroup state pass with q, k, w, u by TMA (CUDNN_TRAIN_GDN_FWD_WS_TMA): rows past a
    varlen sequence's end arrive as the next sequence's, where cp.async zero-fills them, and the chain masks
    their vn; everything it writes is bitwise what the cp.async loads give (tails at T = 333 and in every
    varlen sequence; the training forward's chunk states and vn too; and with w, u formed in the chain, where the
    next sequence's k, v and chunk inverse are masked out of R and vn)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    K, V, l2, dtype, train = 128, 128, True, torch.bfloat16, case == "varlen_training"
    monkeypatch.setattr(F90, "ONFLY", case.startswith("onfly"))  # w, u formed in the chain: k, v, A0 by TMA
    case = case.removeprefix("onfly_")
    if case.startswith("k64"):
        K, V, l2, dtype = 64, 64, False, torch.float16
    if case.startswith("v64"):  # K = 128 with V = 64: w's and u's tiles of different widths
        V = 64
        case = case.removeprefix("v64_")
    q, k, v, g, beta, h0, cu = _ws_inputs(case, K, V, dtype, l2norm=False)
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", True)
    monkeypatch.setattr(WS, "WG3", False)  # one output warpgroup both times, 64 columns a CTA
    monkeypatch.setattr(WS, "VB_MODE", "64")
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu)
    if train:
        args.update(store_states=True, keep_vn=True)
    outs = []
    for tma in (False, True):
        monkeypatch.setattr(WS, "TMA", tma)
        o, ht, *inter = F90.forward(q, k, v, g, beta, **args).value
        outs.append({"o": o, "final_state": ht} if not train else {"o": o, "final_state": ht, "vn": inter[0][4]})
    if train:
        rows = int(F90.chunk_map(cu, 1, q.shape[1], q.device)[1][-1])
        for tma in (False, True):
            monkeypatch.setattr(WS, "TMA", tma)
            outs[int(tma)]["chunk_states"] = F90.forward(q, k, v, g, beta, **args).value[2][3][:rows]
    _assert_bitwise(case, outs[1], outs[0], "the TMA loads")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "k64_fp16_no_l2norm_vk", "varlen_training", "tma_dense",
                                  "onfly_varlen", "onfly_tma_dense"])
def test_specialized_warpgroups_v_block_128_is_bitwise_64(case, monkeypatch, poisoned):
    """All 128 columns of V in one CTA (CUDNN_TRAIN_GDN_FWD_WS_VB=128): the same operations on the same values as
    two CTAs of 64 (the chain's S^T read as the A operand from its shared tile instead of a register copy of the
    same bf16 values, M = 128 for the chain's products, N = 128 for the output's), so o, the final state (and in
    the training forward the chunk-start states and vn) bitwise equal; with the TMA loads, and with w and u formed
    in the chain. Also against the oracle (FLA-compat rule) in the dense case."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    K, V, vk, l2, dtype, train = 128, 128, False, True, torch.bfloat16, case == "varlen_training"
    monkeypatch.setattr(F90, "ONFLY", case.startswith("onfly"))
    case = case.removeprefix("onfly_")
    monkeypatch.setattr(WS, "TMA", case.startswith("tma"))
    monkeypatch.setattr(WS, "WG3", False)  # one output warpgroup at both widths
    case = case.removeprefix("tma_")
    if case.startswith("k64"):  # K = 64 at V = 128, fp16, [V, K] states
        K, vk, l2, dtype = 64, True, False, torch.float16
    q, k, v, g, beta, h0, cu = _ws_inputs(case, K, V, dtype, l2norm=False, state_v_first=True)
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", True)
    if case == "dense":
        monkeypatch.setattr(WS, "VB_MODE", "128")
        _run_and_compare(q, k, v, g, beta, h0, cu, l2norm=l2, state_v_first=vk)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                state_v_first=vk)
    if train:
        args.update(store_states=True, keep_vn=True)
    outs = []
    for mode in ("64", "128"):
        monkeypatch.setattr(WS, "VB_MODE", mode)
        o, ht, *inter = F90.forward(q, k, v, g, beta, **args).value
        out = {"o": o, "final_state": ht}
        if train:
            rows = int(F90.chunk_map(cu, 1, q.shape[1], q.device)[1][-1])
            out.update(vn=inter[0][4], chunk_states=inter[0][3][:rows])
        outs.append(out)
    _assert_bitwise(case, outs[1], outs[0], "128 columns a CTA")


def _ws_switch_case(case, monkeypatch, *, tma, vb128, train):
    """A specialized-warpgroup switch case: ``case`` is ``dense`` (B2 T333), ``varlen``, ``k64_fp16_no_l2norm_vk``
    (K = V = 64 fp16, [V, K] states, no l2norm) or ``v64_`` + one of those (V = 64); the forward forced onto the
    specialized warpgroups with TMA (``tma``) or cp.async loads at 128 (``vb128``) or 64 columns a CTA. Returns
    ``run``: the forward now (inference or ``train``ing), its outputs by name (training: also the chunk states and
    vn), to be compared bitwise across a switch."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    K, V, vk, l2, dtype = 128, 128, False, True, torch.bfloat16
    monkeypatch.setattr(WS, "TMA", tma)
    monkeypatch.setattr(WS, "VB_MODE", "128" if vb128 else "64")
    if case.startswith("k64"):
        K, V, vk, l2, dtype = 64, 64, True, False, torch.float16
    if case.startswith("v64"):
        V = 64
        case = case.removeprefix("v64_")
    q, k, v, g, beta, h0, cu = _ws_inputs(case, K, V, dtype, l2norm=False, state_v_first=vk)
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", True)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                state_v_first=vk)
    if train:
        args.update(store_states=True, keep_vn=True)
    rows = int(F90.chunk_map(cu, q.shape[0], q.shape[1], q.device)[1][-1]) if cu is not None else None

    def run():
        o, ht, *inter = F90.forward(q, k, v, g, beta, **args).value
        out = {"o": o, "final_state": ht}
        if train:
            out.update(chunk_states=inter[0][3][:rows], vn=inter[0][4])
        return out

    return run


def _assert_switches_bitwise(case, run, monkeypatch, module, a: str, b: str, first_off: bool = False):
    """``run()`` with the module switches ``a`` and ``b`` each on alone and both on (``first_off``: ``a`` stays
    off, where it does not reach the call), every output bitwise the run with both off."""
    outs = {}
    for on_a, on_b in ((False, False), (True, False), (False, True), (True, True)):
        if first_off and on_a:
            continue
        monkeypatch.setattr(module, a, on_a)
        monkeypatch.setattr(module, b, on_b)
        outs[on_a, on_b] = run()
    for key, out in outs.items():
        if key != (False, False):
            _assert_bitwise(case, out, outs[False, False], f"{a}={int(key[0])} {b}={int(key[1])}")


def _assert_ws_pair_bitwise(case, monkeypatch, a: str, b: str):
    """``case`` = ``infer_`` or ``train_`` + a :func:`_ws_switch_case` case (``_vb128``: 128 columns a CTA), TMA
    loads, one output warpgroup: the specialized-warpgroup module's switches ``a`` and ``b`` each alone and both,
    every output bitwise both off (:func:`_assert_switches_bitwise`)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    train = case.startswith("train")
    case = case.split("_", 1)[1]
    monkeypatch.setattr(WS, "WG3", False)
    run = _ws_switch_case(case.removesuffix("_vb128"), monkeypatch, train=train, tma=True,
                          vb128=case.endswith("vb128"))
    _assert_switches_bitwise(case, run, monkeypatch, WS, a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["varlen", "varlen_vb128", "tma_dense_vb128", "tma_varlen", "k64_fp16_no_l2norm_vk",
                                  "v64_tma_varlen"])
def test_specialized_warpgroups_transposed_stores_are_bitwise(case, monkeypatch, poisoned):
    """The training forward on the specialized warpgroups with its chunk states and vn leaving by TMA stores from
    tiles the chain writes transposed (CUDNN_TRAIN_GDN_FWD_WS_TSTORE): the same values through the same products
    (their operands read MN-major), so o, the final state, the chunk-start states and vn are bitwise those of the
    gathered stores, at 64 and 128 columns a CTA, with cp.async and TMA loads (varlen: empty, one-token and partial
    sequences, whose vn rows go by vectors; dense T 333: a partial last chunk), K = V = 64 fp16 with [V, K] states,
    and K = 128 with V = 64."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    run = _ws_switch_case(case.replace("tma_", "").removesuffix("_vb128"), monkeypatch, train=True,
                          tma="tma" in case, vb128=case.endswith("vb128"))
    outs = []
    for on in (False, True):
        monkeypatch.setattr(WS, "TSTORE", on)
        outs.append(run())
    _assert_bitwise(case, outs[1], outs[0], "the transposed tiles' stores")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["infer_dense_vb128", "infer_varlen_vb128", "infer_async_dense_vb128",
                                  "infer_varlen", "infer_k64_fp16_no_l2norm_vk", "train_varlen_vb128", "train_dense",
                                  "train_v64_varlen"])
def test_transposed_tiles_and_ldmatrix_are_bitwise(case, monkeypatch, poisoned):
    """The inference forward on the training forward's transposed S / vn tiles (CUDNN_TRAIN_GDN_FWD_WS_TLAYOUT) and the
    chain's u^T (v^T with w and u formed in the chain) by transposed ldmatrix (CUDNN_TRAIN_GDN_FWD_WS_ULDM), each
    alone and both: the same values through the same products, so o and the final state (training: also the chunk
    states and vn) are bitwise those with both off. Inference at 128 columns (w and u formed in the chain; TMA and
    cp.async loads; varlen with empty, one-token and partial sequences; dense T 333) and at 64 (two output
    warpgroups; K = V = 64 fp16 with [V, K] states); training (TLAYOUT does not reach it: its tiles are transposed
    already) at 128 and 64 columns and with V = 64."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    train = case.startswith("train")
    case = case.split("_", 1)[1]
    run = _ws_switch_case(case.removeprefix("async_").removesuffix("_vb128"), monkeypatch, train=train,
                          tma=not case.startswith("async"), vb128=case.endswith("vb128"))
    _assert_switches_bitwise(case, run, monkeypatch, WS, "TLAYOUT", "ULDM", first_off=train)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["infer_dense_vb128", "train_varlen_vb128", "train_dense_vb128",
                                  "train_k64_fp16_no_l2norm_vk"])
def test_chain_issued_loads_are_bitwise(case, monkeypatch, poisoned):
    """The next chunk's TMA loads issued by the chain's first warp (CUDNN_TRAIN_GDN_FWD_WS_CLOADS, the default) alone,
    o by TMA stores (OTMA, whose q tile the loads refill) alone and both: o, the final state (training: the chunk
    states and vn) bitwise both off; inference at 128 columns (w and u formed in the chain), training at 128 columns
    dense T 333 and varlen (empty, one-token, partial sequences), K = V = 64 fp16 with [V, K] states."""
    _assert_ws_pair_bitwise(case, monkeypatch, "CLOADS", "OTMA")


@pytest.mark.compile
def test_chain_issued_loads_compile_for_sm90a(kernel_cache):
    """CUDNN_TRAIN_GDN_FWD_WS_CLOADS (the default): the B4 training and inference calls with the chain's first warp
    issuing the TMA loads; without the TMA loads the switch is ignored (the cp.async kernel's cache entry)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    assert callable(WS.get_kernel(*WS_VARIANTS[0], store_states=True, keep_vn=True, tstore=True, tma=True, vb=128,
                                  cloads=True))
    assert callable(WS.get_kernel(*WS_VARIANTS[0], onfly=True, tma=True, wg3=False, vb=128, cloads=True))
    assert len(list(kernel_cache.rglob("*.o"))) == 2
    assert callable(WS.get_kernel(*WS_VARIANTS[1], tma=False, vb=64, cloads=True))
    assert callable(WS.get_kernel(*WS_VARIANTS[1], tma=False, vb=64, cloads=False))
    assert len(list(kernel_cache.rglob("*.o"))) == 3


@pytest.mark.compile
def test_training_forward_with_w_u_in_the_chain_compiles_for_sm90a(kernel_cache):
    """The training forward with w and u formed in the chain (CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY, the default): the
    specialized warpgroups' onfly chain also storing the chunk states, vn (TMA stores from the transposed tiles)
    and the gated inverses T; the B4 call (128 columns, l2norm) and K = V = 64 fp16 varlen with [V, K] states,
    initial and final states, at 64 columns."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    train = dict(store_states=True, keep_vn=True, onfly=True, tma=True, tstore=True)
    assert callable(WS.get_kernel(*WS_VARIANTS[0], vb=128, **train))
    assert callable(WS.get_kernel(*WS_VARIANTS[1], vb=64, **train))
    assert len(list(kernel_cache.rglob("*.o"))) == 2
    with pytest.raises(ValueError, match="tstore"):  # two output warpgroups store nothing
        WS.get_kernel(*WS_VARIANTS[0], vb=64, wg3=True, **train)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "gate_sigmoid_no_l2norm"])
def test_training_forward_with_w_u_in_the_chain(case, monkeypatch, poisoned):
    """CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY (the default): the training forward asked with ``train_onfly`` at 128 columns a
    CTA (the specialized warpgroups forced at these small grids) takes the wy kernel's INV variant and the onfly
    chain: w None, u's slot the effective beta; o and the final state against the oracle (FLA-compat rule), the
    chunk states, vn and Tm within 2e-2 relative L2 of the default training forward's on the same call (other
    rounding points: T from the rounded gate-free inverse, vn one product), every element the default writes
    written (over NaN-poisoned outputs). Dense B2 T333 with a partial last chunk; varlen with empty, one-token and
    partial sequences; the in-kernel gate and beta sigmoid without the l2norm."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(WS, "VB_MODE", "128")
    gate = case.startswith("gate")
    q, k, v, g, beta, h0, cu = _ws_inputs("dense" if gate else case, 128, 128, torch.bfloat16)
    flags = dict(use_qk_l2norm_in_kernel=not gate)
    if gate:
        q, k = _l2n(q.float()).to(q.dtype), _l2n(k.float()).to(k.dtype)
        g = torch.randn_like(g)
        beta = torch.randn_like(beta)
        flags.update(use_gate_in_kernel=True, A_log=torch.rand(4, device="cuda") * 0.5,
                     dt_bias=torch.randn(4, device="cuda") * 0.5, use_beta_sigmoid_in_kernel=True)
    scale = 128**-0.5
    args = dict(scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu, store_states=True,
                keep_vn=True, keep_tm=True, train_onfly=True, **flags)
    monkeypatch.setattr(F90, "TRAIN_ONFLY", False)
    _, _, (w0, _, gc0, hs0, vn0, tm0) = F90.forward(q, k, v, g, beta, **args).value
    monkeypatch.setattr(F90, "TRAIN_ONFLY", True)
    o, ht, (w, u, gc, hs, vn, tm) = F90.forward(q, k, v, g, beta, **args).value
    assert w0 is not None and w is None, "the switch did not change the forward's path"
    beta_eff = torch.sigmoid(beta.float()) if gate else beta.float()
    assert u.dtype == torch.float32 and rel_l2(u, beta_eff) < 1e-5
    assert rel_l2(gc, gc0) < 1e-6
    ref_o, ref_h = oracle(q, k, v, g, beta, scale, h0, cu, l2norm=not gate, A_log=flags.get("A_log"),
                          dt_bias=flags.get("dt_bias"), beta_sigmoid=gate)
    _check("o", o.float(), ref_o, None)
    _check("final_state", ht, ref_h, None)
    for name, a, b in (("chunk states", hs, hs0), ("vn", vn, vn0), ("Tm", tm, tm0)):
        written = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a), written), f"{name}: written elements differ"
        assert rel_l2(a[written].float(), b[written].float()) <= 2e-2, (name, rel_l2(a[written].float(),
                                                                                     b[written].float()))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["infer_dense_vb128", "infer_varlen_vb128", "infer_k64_fp16_no_l2norm_vk",
                                  "train_varlen_vb128", "train_dense_vb128", "train_k64_fp16_no_l2norm_vk"])
def test_o_tma_stores_and_shared_k_factors_are_bitwise(case, monkeypatch, poisoned):
    """o by stmatrix into the chunk's q tile and one TMA store (CUDNN_TRAIN_GDN_FWD_WS_OTMA; a partial chunk's rows
    by pairs as before) and the output warpgroup on the chain's k factors (CUDNN_TRAIN_GDN_FWD_WS_KSHARE), each alone
    and both: o, the final state (training: also the chunk states and vn) bitwise both off, at 128 columns (inference
    with w and u formed in the chain, training; dense T 333 with its partial last chunk, varlen with empty,
    one-token and partial sequences) and at K = V = 64 fp16 with [V, K] states (one output warpgroup; no l2norm,
    which KSHARE needs)."""
    _assert_ws_pair_bitwise(case, monkeypatch, "OTMA", "KSHARE")


@pytest.mark.gpu
def test_training_forward_takes_the_specialized_warpgroups_with_tstore(monkeypatch, poisoned):
    """With CUDNN_TRAIN_GDN_FWD_WS_TSTORE the training forward takes the specialized warpgroups wherever the grid
    does not leave SMs idle (here: a card of 4 SMs), at the V block inference would take, and its o, chunk states
    and vn agree with the split pass's (another summation order: within float32 rounding of bf16 values)."""
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    q, k, v, g, beta, h0, cu = _ws_inputs("varlen", 128, 128, torch.bfloat16)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                store_states=True, keep_vn=True)
    rows = int(F90.chunk_map(cu, 1, q.shape[1], q.device)[1][-1])
    monkeypatch.setattr(F90, "SPLIT", None)
    monkeypatch.setattr(F90, "STATE_WS", None)
    monkeypatch.setattr(WS, "VB_MODE", "auto")
    monkeypatch.setattr(kc, "num_sms", lambda device: 4)
    ran = []  # the V block of every specialized-warpgroup kernel the forward asks for
    orig = WS.get_kernel
    monkeypatch.setattr(WS, "get_kernel", lambda *a, **kw: ran.append(kw.get("vb")) or orig(*a, **kw))
    monkeypatch.setattr(WS, "TSTORE", False)
    o_s, ht_s, (_, _, _, hs_s, vn_s, _) = F90.forward(q, k, v, g, beta, **args).value
    assert ran == [], "without tstore the training forward takes the split pass"
    monkeypatch.setattr(WS, "TSTORE", True)
    o, ht, (_, _, _, hs, vn, _) = F90.forward(q, k, v, g, beta, **args).value
    assert ran == [128], f"with tstore the training forward takes the specialized warpgroups at 128 columns: {ran}"
    for name, a, b in (("o", o, o_s), ("final_state", ht, ht_s), ("chunk_states", hs[:rows], hs_s[:rows]),
                       ("vn", vn, vn_s)):
        assert torch.isfinite(a).all(), f"{name}: elements the kernel did not write"
        err = rel_l2(a.float(), b.float())
        assert err < 2e-3, f"{name} differs from the split pass's by {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["cp_async", "tma", "onfly_tma", "tma_vb128"])
def test_specialized_warpgroups_ignore_rows_past_the_last_sequence(case, monkeypatch, poisoned):
    """A varlen tensor longer than its sequences (T > cu_seqlens[-1]) with NaN in the rows past the last one: the
    TMA loads bring those rows in with a partial last chunk (cp.async zero-fills them), and the kernel must keep them
    out of every product (k's tail rows are zeroed in shared memory: the state update meets them with zero vn
    columns). o's rows and the final state bitwise those of the same call on the tensor cut at cu_seqlens[-1]."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", True)
    monkeypatch.setattr(F90, "ONFLY", case.startswith("onfly"))
    monkeypatch.setattr(WS, "TMA", "tma" in case)
    monkeypatch.setattr(WS, "WG3", False)  # one output warpgroup (its own test covers two)
    monkeypatch.setattr(WS, "VB_MODE", "128" if case.endswith("vb128") else "64")
    lengths = [63, 130, 5]
    n = sum(lengths)
    cu = cu_seqlens(lengths, "cuda")
    q, k, v, g, beta, h0 = _inputs(1, n + 40, 2, 4, 128, 128, torch.bfloat16, nseq=len(lengths))
    for x in (q, k, v, g, beta):
        x[:, n:] = float("nan")
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o, ht = F90.forward(q, k, v, g, beta, **args).value
    o_cut, ht_cut = F90.forward(*(x[:, :n].contiguous() for x in (q, k, v, g, beta)), **args).value
    assert torch.isfinite(ht).all() and torch.isfinite(o[:, :n]).all(), f"{case}: NaN from the rows past the end"
    assert torch.equal(ht, ht_cut), f"{case}: the final state differs from the cut tensor's"
    assert torch.equal(o[:, :n], o_cut), f"{case}: o differs from the cut tensor's"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen", "k64_fp16_no_l2norm", "v64_varlen", "onfly_varlen",
                                  "vb128_dense", "vb128_varlen"])
def test_two_output_warpgroups_are_bitwise_one(case, monkeypatch, poisoned):
    """Two output warpgroups taking alternate chunks (CUDNN_TRAIN_GDN_FWD_WS_WG3, with the TMA loads) make the same
    operations on the same values as one: o and the final state bitwise equal (and with w, u formed in the
    chain; and at 128 columns a CTA)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    K, V, l2, dtype = 128, 128, True, torch.bfloat16
    monkeypatch.setattr(F90, "ONFLY", case.startswith("onfly"))
    case = case.removeprefix("onfly_")
    monkeypatch.setattr(WS, "VB_MODE", "128" if case.startswith("vb128") else "64")
    case = case.removeprefix("vb128_")
    if case.startswith("k64"):
        K, V, l2, dtype = 64, 64, False, torch.float16
    if case.startswith("v64"):  # K = 128 with V = 64
        V = 64
        case = case.removeprefix("v64_")
    q, k, v, g, beta, h0, cu = _ws_inputs(case, K, V, dtype, l2norm=False)
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", True)
    monkeypatch.setattr(WS, "TMA", True)
    outs = []
    for wg3 in (False, True):
        monkeypatch.setattr(WS, "WG3", wg3)
        outs.append(F90.forward(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=l2, cu_seqlens=cu).value)
    names = ("o", "final_state")
    _assert_bitwise(case, dict(zip(names, outs[1])), dict(zip(names, outs[0])), "two output warpgroups")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense_h0", "dense_fp16_t1000", "varlen", "gate_sigmoid_neg", "k64_fp16_no_l2norm_vk",
                                  "v64_gva"])
def test_w_u_formed_in_the_chain_match_oracle(case, monkeypatch, poisoned):
    """The inference forward with w and u never materialized (CUDNN_TRAIN_GDN_FWD_ONFLY): the wy kernel's INV
    variant (the gate-free chunk inverse in the input dtype, gc, the effective beta), then the specialized
    warpgroups forming vn = T diag(beta) (v - diag(exp(gc) rk) k S) with T = A0 exp(gc_i - gc_j). o and the
    final state against the oracle under the FLA-compat rule, and close to the default path's."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    K, V, vk, cu, l2, dtype, H, HV, T = 128, 128, False, None, True, torch.bfloat16, 2, 4, 333
    flags = {}
    if case == "dense_fp16_t1000":
        dtype, T = torch.float16, 1000
    if case == "k64_fp16_no_l2norm_vk":
        K, V, vk, l2, dtype = 64, 64, True, False, torch.float16
    if case == "v64_gva":
        V, H, HV = 64, 1, 4
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", True)
    monkeypatch.setattr(F90, "ONFLY", True)
    if case == "varlen":
        q, k, v, g, beta, h0, cu = _ws_inputs(case, K, V, dtype)
    elif case == "gate_sigmoid_neg":
        q, k, v, g, beta, h0 = _inputs(2, 97, H, HV, K, V, dtype, raw_gate=True, beta_logits=True)
        A_log = torch.log(torch.empty(HV, device="cuda").uniform_(1, 16))
        dt = torch.exp(torch.empty(HV, device="cuda").uniform_(math.log(1e-3), math.log(1e-1)))
        flags = dict(A_log=A_log, dt_bias=dt + torch.log(-torch.expm1(-dt)), beta_sigmoid=True, neg=True)
    else:
        q, k, v, g, beta, h0 = _inputs(2, T, H, HV, K, V, dtype, l2norm=l2, state_v_first=vk)
    _run_and_compare(q, k, v, g, beta, h0, cu, l2norm=l2, state_v_first=vk, **flags)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                state_v_first=vk)
    if flags:
        args.update(use_gate_in_kernel=True, A_log=flags["A_log"], dt_bias=flags["dt_bias"],
                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    onfly = F90.forward(q, k, v, g, beta, **args).value
    monkeypatch.setattr(F90, "ONFLY", False)
    base = F90.forward(q, k, v, g, beta, **args).value
    for name, a, b in zip(("o", "final_state"), onfly, base):
        assert torch.isfinite(a).all(), f"{case}: {name} has elements the kernels did not write"
        err = rel_l2(a.float(), b.float())
        assert err < 1e-2, f"{case}: {name} differs from the w, u path's by {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["out", "state"])
@pytest.mark.parametrize("case", ["dense", "varlen", "fp16_no_l2norm"])
def test_p_select_is_bitwise_the_branches(kernel, case, monkeypatch, poisoned):
    """P's factors read unconditionally and its lower triangle kept by a select, in the split pass's out
    kernel (CUDNN_TRAIN_GDN_OUT_PSEL=1) or the fused state kernel (CUDNN_TRAIN_GDN_FWD_PSEL=1), make the
    same operations on the same values as with a branch per element: o and the final state bitwise equal."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setattr(F90, "SPLIT", kernel == "out")
    monkeypatch.setattr(F90, "STATE_WS", False)  # the fused kernel, not the specialized warpgroups
    l2, dtype, cu = case != "fp16_no_l2norm", (torch.float16 if case == "fp16_no_l2norm" else torch.bfloat16), None
    if case == "varlen":
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, 128, 128, dtype, nseq=len(lengths))
    else:
        q, k, v, g, beta, h0 = _inputs(2, 333, 2, 4, 128, 128, dtype, l2norm=l2)
    outs = []
    for sel in (False, True):
        if kernel == "out":
            monkeypatch.setenv("CUDNN_TRAIN_GDN_OUT_PSEL", str(int(sel)))
        else:
            monkeypatch.setattr(F90, "STATE_PSEL", sel)
        outs.append(F90.forward(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                use_qk_l2norm_in_kernel=l2, cu_seqlens=cu).value)
    names = ("o", "final_state")
    _assert_bitwise(f"{kernel}, {case}", dict(zip(names, outs[1])), dict(zip(names, outs[0])), "P's select")


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("case", ["dense", "varlen", "store_states", "fp16_no_l2norm"])
def test_two_warpgroup_state_kernel_matches_oracle_and_one_warpgroup(case, prefetch, monkeypatch, poisoned):
    """The fused state kernel with two warpgroups splitting every product's N (K = 128; the default
    for the training forward's chunk states, opt-in for inference):
    o, the final state (and the chunk-start states) against the oracle under the FLA-compat rule
    and against the one-warpgroup kernel (same rounding points, other summation order)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    store = case == "store_states"
    l2, dtype, cu = case != "fp16_no_l2norm", (torch.float16 if case == "fp16_no_l2norm" else torch.bfloat16), None
    if case in ("varlen", "store_states"):
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, 128, 128, dtype, nseq=len(lengths))
    else:
        q, k, v, g, beta, h0 = _inputs(2, 333, 2, 4, 128, 128, dtype, l2norm=l2)
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(F90, "STATE_WS", False)  # the fused kernel, not the specialized warpgroups
    orig = F90.get_state_kernel
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                store_states=store)
    outs = []
    for wgs in (1, 2):
        monkeypatch.setattr(F90, "get_state_kernel",
                            lambda *a, wgs=wgs, **kw: orig(*a, **{**kw, "prefetch": prefetch, "wgs": wgs}))
        res = F90.forward(q, k, v, g, beta, **args).value
        outs.append((res[0], res[1]) + ((res[2][3],) if store else ()))
    ref_o, ref_h = oracle(q, k, v, g, beta, 128**-0.5, h0, cu, l2norm=l2)
    _check("o", outs[1][0].float(), ref_o, None)
    _check("final_state", outs[1][1], ref_h, None)
    if store:  # rows past the varlen chunk count are never written: compare the written ones
        rows = int(F90.chunk_map(cu, 1, q.shape[1], q.device)[1][-1])
        outs = [(o, ht, hs[:rows]) for o, ht, hs in outs]
    for name, a, b in zip(("o", "final_state", "chunk_states"), outs[1], outs[0]):
        assert torch.isfinite(a).all(), f"{case}: {name} has elements the two-warpgroup kernel did not write"
        err = rel_l2(a.float(), b.float())
        assert err < 2e-3, f"{case}: {name} differs from the one-warpgroup kernel's by {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("wgs", [1, 2])
def test_store_states_fused_kernel_matches_the_split_chain(wgs, monkeypatch, poisoned):
    """The chunk-start states of the training forward (``store_states``), written by the fused state
    kernel while the chunk's first products run, against those of the split pass's chain kernel (an
    independent kernel, other summation order): varlen with empty and one-token sequences, GVA."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    lengths = [0, 1, 63, 130, 1, 257, 64, 0]
    cu = cu_seqlens(lengths, "cuda")
    q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, nseq=len(lengths))
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                store_states=True)
    orig = F90.get_state_kernel
    monkeypatch.setattr(F90, "get_state_kernel", lambda *a, **kw: orig(*a, **{**kw, "wgs": wgs}))
    rows = int(F90.chunk_map(cu, 1, q.shape[1], q.device)[1][-1])
    hs = {}
    for split in (False, True):
        monkeypatch.setattr(F90, "SPLIT", split)
        hs[split] = F90.forward(q, k, v, g, beta, **args).value[2][3][:rows].float()
    assert torch.isfinite(hs[False]).all(), "chunk rows the fused kernel did not write"
    err = rel_l2(hs[False], hs[True])
    assert err < 2e-3, f"fused vs split chunk states: rel L2 {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen_gate_sigmoid"])
def test_two_warpgroup_wy_kernel_matches_one_warpgroup(case, monkeypatch, poisoned):
    """The wy kernel with two warpgroups splitting every product's N (K = V = 128, the default): each
    output element is reduced in the same order as with one warpgroup, so w, u, gc and o agree to
    rounding noise (asserted 1e-5), and o meets the oracle under the FLA-compat rule."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    cu, extra = None, {}
    if case == "varlen_gate_sigmoid":
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        # raw gate and beta logits: the kernel applies -exp(A_log) softplus(g + dt_bias) and the sigmoid
        q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, nseq=len(lengths),
                                       raw_gate=True, beta_logits=True)
        extra = dict(use_gate_in_kernel=True, A_log=torch.log(torch.empty(4, device="cuda").uniform_(1, 16)),
                     dt_bias=torch.randn(4, device="cuda"), use_beta_sigmoid_in_kernel=True)
    else:
        q, k, v, g, beta, h0 = _inputs(2, 333, 2, 4, 128, 128, torch.bfloat16)
    orig = F90.get_wy_kernel
    outs = []
    for wgs in (1, 2):
        monkeypatch.setattr(F90, "get_wy_kernel", lambda *a, wgs=wgs, **kw: orig(*a, **{**kw, "wgs": wgs}))
        o, ht, (w, u, gc) = F90.forward(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu, return_intermediates=True,
                                        **extra).value
        outs.append((o, ht, w, u, gc))
    for name, a, b in zip(("o", "final_state", "w", "u", "gc"), outs[1], outs[0]):
        assert torch.isfinite(a).all(), f"{case}: {name} has elements the two-warpgroup kernel did not write"
        err = rel_l2(a.float(), b.float())
        assert err < 1e-5, f"{case}: {name} differs from the one-warpgroup kernel's by {err:.2e}"
    if not extra:
        ref_o, ref_h = oracle(q, k, v, g, beta, 128**-0.5, h0, cu, l2norm=True)
        _check("o", outs[1][0].float(), ref_o, None)
        _check("final_state", outs[1][1], ref_h, None)


def _wy_case(case):
    """Inputs of the wy-variant cases: ``(q, k, v, g, beta, h0, cu, flags, l2norm)``. ``varlen_gate_sigmoid_k64``:
    K = V = 64, sequences of 0, 1 and odd lengths, raw gate and beta logits with the in-kernel gate and
    sigmoid; otherwise K = V = 128, B 2, T 333, fp16 for ``*_fp16``, no l2norm for ``no_l2norm_*``."""
    if case == "varlen_gate_sigmoid_k64":
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        flags = dict(use_gate_in_kernel=True, A_log=torch.log(torch.empty(4, device="cuda").uniform_(1, 16)),
                     dt_bias=torch.randn(4, device="cuda"), use_beta_sigmoid_in_kernel=True)
        return (*_inputs(1, sum(lengths), 2, 4, 64, 64, torch.bfloat16, nseq=len(lengths), raw_gate=True,
                         beta_logits=True), cu, flags, True)
    l2 = not case.startswith("no_l2norm")
    dtype = torch.float16 if case.endswith("fp16") else torch.bfloat16
    return (*_inputs(2, 333, 2, 4, 128, 128, dtype, l2norm=l2), None, {}, l2)


def _per_wy_variant(monkeypatch, variants, run):
    """``run()`` once with each dict of ``get_wy_kernel`` overrides; asserts the runs took different kernels."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    orig = F90.get_wy_kernel
    outs, fns = [], []
    for over in variants:
        monkeypatch.setattr(F90, "get_wy_kernel",
                            lambda *a, over=over, **kw: fns.append(orig(*a, **{**kw, **over})) or fns[-1])
        outs.append(run())
    assert fns[0] is not fns[-1], "the runs took the same wy kernel"
    return outs


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen_gate_sigmoid_k64", "no_l2norm_fp16"])
def test_wy_scan_preparation_matches_the_serial_one(case, monkeypatch, poisoned):
    """The wy kernel's default preparation (one warp: g, beta, the in-chunk cumsum by a shuffle scan; the k
    l2norm factors from the k k^T diagonal) against the serial one (CUDNN_TRAIN_GDN_WY_SCAN=0): the sums
    differ only in order, so gc agrees to float32 rounding and w, u, o to a few input-dtype roundings; o
    and the final state meet the oracle under the FLA-compat rule."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, k, v, g, beta, h0, cu, flags, l2 = _wy_case(case)

    def run():
        o, ht, (w, u, gc) = F90.forward(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, return_intermediates=True,
                                        **flags).value
        return o, ht, w, u, gc

    outs = _per_wy_variant(monkeypatch, [dict(scan=False), dict(scan=True)], run)
    for name, a, b in zip(("o", "final_state", "w", "u", "gc"), outs[1], outs[0]):
        assert torch.isfinite(a).all(), f"{case}: {name} has elements the scan variant did not write"
        err = rel_l2(a.float(), b.float())
        assert err < (1e-6 if name == "gc" else 2e-3), f"{case}: {name} differs from the serial prep's by {err:.2e}"
    if not flags:
        K = q.shape[-1]
        ref_o, ref_h = oracle(q, k, v, g, beta, K**-0.5, h0, cu, l2norm=l2)
        _check("o", outs[1][0].float(), ref_o, None)
        _check("final_state", outs[1][1], ref_h, None)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen_gate_sigmoid_k64", "store_t_fp16"])
def test_wy_async_loads_are_bitwise_the_synchronous_ones(case, monkeypatch, poisoned):
    """The wy kernel's k and v tiles by cp.async (CUDNN_TRAIN_GDN_WY_ASYNC, the default) land in the same shared tiles
    as the synchronous loads before any product reads them: w, u, gc (and the stored Tm) bitwise equal,
    over NaN-filled outputs (a missing wait shows as stale tiles; rows past a sequence's end only ever meet
    beta = 0, so their zero fill is not what this checks)."""
    _check_wy_variants_bitwise(case, monkeypatch, dict(scan=True, async_loads=False),
                               dict(scan=True, async_loads=True), "cp.async loads")


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense", "varlen_gate_sigmoid_k64", "store_t_fp16"])
def test_wy_two_pass_A_is_bitwise_the_one_pass(case, monkeypatch, poisoned):
    """The A matrix built in two passes (CUDNN_TRAIN_GDN_WY_A2: every element's value in registers with its
    factors read unconditionally, then the stores) makes the same operations on the same values as the one
    pass: w, u, gc, o, the final state (and the stored Tm) bitwise equal, over NaN-filled outputs."""
    _check_wy_variants_bitwise(case, monkeypatch, dict(a2=False), dict(a2=True), "A in two passes")


def _check_wy_variants_bitwise(case, monkeypatch, base, other, what):
    """The forward (with its intermediates; with the stored chunk states and Tm for ``store_t*`` cases) on
    the wy kernel with ``base`` overrides, then with ``other``: every output bitwise equal."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, k, v, g, beta, h0, cu, flags, l2 = _wy_case(case)
    store = case.startswith("store_t")

    def run():
        o, ht, inter = F90.forward(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2, cu_seqlens=cu, return_intermediates=True,
                                   store_states=store, keep_tm=store, **flags).value
        return {"o": o, "final_state": ht, "w": inter[0], "u": inter[1], "gc": inter[2],
                **({"Tm": inter[5]} if store else {})}

    outs = _per_wy_variant(monkeypatch, [base, other], run)
    _assert_bitwise(case, outs[1], outs[0], what)


@pytest.mark.gpu
def test_forward_is_bitwise_reproducible():
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    q, k, v, g, beta, h0 = _inputs(2, 777, 2, 4, 128, 128, torch.bfloat16)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    first = [t.clone() for t in F90.forward(q, k, v, g, beta, **args).value]
    second = F90.forward(q, k, v, g, beta, **args).value
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True])
def test_op_dispatch_leaves_a_call_to_flashqla_only(grad, monkeypatch):
    """Unset switches: the op serves a call on these kernels unless FLA would hand it to FlashQLA (faster;
    FlashQLABackend spied on); FLA_FLASH_QLA=0 or the in-kernel gate flags (FlashQLA rejects them) bring it
    here, as does K = V = 64; the switch at 1 serves it here, at 0 sends it on. Outputs (and gradients) of
    the plain call against the oracle and the next backend's each time."""
    import importlib.util

    from cudnn_train import last_path
    from cudnn_train.fused import chunk_gated_delta_rule
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    env = "CUDNN_TRAIN_GDN_SM90_TRAIN" if grad else "CUDNN_TRAIN_GDN_SM90_FWD"
    ours = "cutedsl:sm90-train" if grad else "cutedsl:sm90"
    q, k, v, g, beta, _ = _inputs(1, 100, 2, 4, 128, 128, torch.bfloat16)
    leaves = [t.requires_grad_(grad) for t in (q, k, v)]
    do = torch.randn_like(v)

    def run(flags=None):
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        if grad:
            o.backward(do)
            grads = [t.grad.clone() for t in leaves]
            for t in leaves:
                t.grad = None
            return o.detach(), grads
        return o.detach(), []

    with torch.set_grad_enabled(grad):
        monkeypatch.delenv(env, raising=False)
        monkeypatch.delenv("FLA_FLASH_QLA", raising=False)
        fla = importlib.util.find_spec("fla") is not None
        flashqla = fla and importlib.util.find_spec("flash_qla") is not None  # FLA 0.6 then routes this call there
        ran = []
        if flashqla:  # FLA's FlashQLA backend, spied on: it must be what served the call we declined
            from fla.ops.gated_delta_rule.backends.flash_qla import FlashQLABackend

            real = FlashQLABackend.chunk_gated_delta_rule
            monkeypatch.setattr(FlashQLABackend, "chunk_gated_delta_rule",
                                lambda self, *a, **kw: ran.append(1) or real(self, *a, **kw))
        outs = [run()]
        path = last_path("chunk_gated_delta_rule")
        assert path.startswith("fla:fallback(FlashQLA") if flashqla else path == ours, path
        assert len(ran) == (1 if flashqla else 0)
        # the layers' call (in-kernel gate and beta sigmoid): FlashQLA rejects it, ours serves it
        A_log, dt_bias = torch.zeros(4, device="cuda"), torch.zeros(4, device="cuda")
        chunk_gated_delta_rule(q, k, v, g, torch.randn_like(beta), use_qk_l2norm_in_kernel=True,
                               use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
        assert last_path("chunk_gated_delta_rule") == ours and len(ran) == (1 if flashqla else 0)
        # K = V = 64: FlashQLA does not take it, FLA's own kernels are slower (eleventh session): ours
        chunk_gated_delta_rule(*(t[..., :64].contiguous() for t in (q, k, v)), g, beta, use_qk_l2norm_in_kernel=True)
        assert last_path("chunk_gated_delta_rule") == ours and len(ran) == (1 if flashqla else 0)
        monkeypatch.setenv("FLA_FLASH_QLA", "0")  # FLA keeps the call on its own kernels: slower than ours
        outs.append(run())
        assert last_path("chunk_gated_delta_rule") == ours
        monkeypatch.delenv("FLA_FLASH_QLA")
        monkeypatch.setenv(env, "1")
        outs.append(run())
        assert last_path("chunk_gated_delta_rule") == ours
        monkeypatch.setenv(env, "0")
        try:
            outs.append(run())
        except RuntimeError as e:  # FLA 0.6 declines its own backward on Triton 3.4-3.7.0 on Hopper without TileLang
            if grad and fla and "#640" in str(e):
                pytest.skip(f"every dispatch check passed; the next backend (FLA) refuses its backward here: {e}")
            raise
        assert last_path("chunk_gated_delta_rule").startswith(f"fla:fallback({env}=0)" if fla else "torch:"), \
            last_path("chunk_gated_delta_rule")
    # the last call went to the next backend (FLA, else torch): the peer of the FLA-compat rule
    ref_o, _ = oracle(q.detach(), k.detach(), v.detach(), g, beta, 128**-0.5, None, None, l2norm=True)
    peer_o, peer_grads = outs[3]
    for o, grads in outs:
        _check("o", o.float(), ref_o, peer_o.float())
        for a, b in zip(grads, peer_grads):  # every path's gradients near the peer's (each vs the oracle below)
            assert rel_l2(a.float(), b.float()) < 2e-2
    if grad:
        qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
        of, _ = oracle(qf, kf, vf, g, beta, 128**-0.5, None, None, l2norm=True)
        want = torch.autograd.grad(of, [qf, kf, vf], do.float())
        for name, a, b, p in zip("qkv", outs[2][1], want, peer_grads):
            _check(f"d{name}", a.float(), b, p.float())


@pytest.mark.gpu
def test_backend_function_serves_inference_and_declines_training(poisoned, monkeypatch):
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    monkeypatch.setenv("CUDNN_TRAIN_GDN_SM90_FWD", "1")  # serve inference even with FLA installed

    q, k, v, g, beta, h0 = _inputs(1, 100, 2, 4, 128, 128, torch.bfloat16)
    kw = dict(scale=128**-0.5, initial_state=h0.to(torch.bfloat16), output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, A_log=None, dt_bias=None,
              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
              chunk_size=64, cu_seqlens_cpu=None)
    res = F90.cutedsl_backend(q, k, v, g, beta, **kw)
    assert res.tag == "sm90"
    o, ht = res.value
    ref_o, ref_h = oracle(q, k, v, g, beta, 128**-0.5, h0.to(torch.bfloat16).float(), None, l2norm=True)
    fla = peer(q, k, v, g, beta, 128**-0.5, h0.to(torch.bfloat16).float(), None, use_qk_l2norm_in_kernel=True)
    _check("o", o.float(), ref_o, None if fla is None else fla[0].float())
    _check("final_state", ht, ref_h, None if fla is None else fla[1].float())
    monkeypatch.setenv("CUDNN_TRAIN_GDN_SM90_TRAIN", "0")
    with pytest.raises(Unsupported, match="CUDNN_TRAIN_GDN_SM90_TRAIN=0"):  # the training path switched off
        F90.cutedsl_backend(q.requires_grad_(), k, v, g, beta, **kw)
    with torch.no_grad():
        assert F90.cutedsl_backend(q, k, v, g, beta, **kw).tag == "sm90"
    with pytest.raises(Unsupported, match="chunk_size"):
        F90.cutedsl_backend(q.detach(), k, v, g, beta, **{**kw, "chunk_size": 32})


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense_128", "varlen_64_fp16", "no_l2norm_gva4"])
def test_training_forward_keeps_the_chunk_inverses(case, poisoned):
    """``forward(store_states=True, keep_tm=True)``: the wy kernel also writes every chunk's
    ``Tm = (I + A)^-1`` (the training path's CUDNN_TRAIN_GDN_DCHUNK_TM_FROM_FWD), every row of every
    sequence (outputs poisoned first), against the float32 torch recompute of the same matrices
    (zeros above the diagonal included); o bitwise the forward's without the store."""
    from cudnn_train.fused import delta_rule_bwd as db
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels.gated_delta_rule_train_sm90 import expand_heads

    K, dtype, l2, cu, H, HV = 128, torch.bfloat16, True, None, 2, 4
    if case == "varlen_64_fp16":
        K, dtype = 64, torch.float16
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        q, k, v, g, beta, h0 = _inputs(1, sum(lengths), H, HV, K, K, dtype, nseq=len(lengths))
    else:
        if case == "no_l2norm_gva4":
            l2, H, HV = False, 1, 4
        q, k, v, g, beta, h0 = _inputs(2, 333, H, HV, K, K, dtype, l2norm=l2)
    args = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2, cu_seqlens=cu,
                store_states=True)
    got = F90.forward(q, k, v, g, beta, keep_tm=True, **args).value
    plain = F90.forward(q, k, v, g, beta, **args).value
    tm = got[2][-1]
    assert tm.shape == (*v.shape[:3], 64) and tm.dtype == dtype
    assert torch.equal(got[0], plain[0]), "o changed by the Tm store"
    qf, kf = (expand_heads((_l2n(x.float()) if l2 else x.float()), HV) for x in (q, k))
    lay = db.ChunkLayout(q.shape[0], q.shape[1], 64, cu)
    r = db._recompute(lay.to_chunks(qf), lay.to_chunks(kf), lay.to_chunks(v.float()), lay.to_chunks(g.unsqueeze(-1)),
                      lay.to_chunks(beta.float().unsqueeze(-1)), K**-0.5, 64)
    ref = lay.from_chunks(r["Tm"])
    assert torch.isfinite(tm).all(), f"{case}: Tm rows the wy kernel did not write"
    assert rel_l2(tm.float(), ref) <= 1e-2, (case, rel_l2(tm.float(), ref))

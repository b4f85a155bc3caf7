"""SM90 Gated DeltaNet backward, the per-chunk gradients (stage 3): compiled for sm_90a on any
machine; on a GPU, checked against the float32 torch stage 3 (``delta_rule_bwd.chunk_grads``
through ``gated_delta_rule_train_sm90.stage3_torch``) on the same inputs."""

import pytest
import torch
import torch.nn.functional as F

from tests.utils import cu_seqlens, rel_l2

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# (dtype, K, V, varlen, l2norm)
VARIANTS = [(torch.bfloat16, 128, 128, False, True), (torch.float16, 64, 64, True, False)]


@pytest.mark.compile
def test_chunk_gradient_kernel_compiles_for_sm90a(kernel_cache):
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    for v in VARIANTS:
        assert callable(B3.get_dchunk_kernel(*v))
    # the other side of CUDNN_TRAIN_GDN_DCHUNK_OVERLAP (the default at K = 128 on two warpgroups)
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], overlap=not B3.overlap_default(VARIANTS[0][1], 2)))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], dqk_dtype=torch.bfloat16))  # dq, dk in bf16 (no GVA)
    assert callable(B3.get_dchunk_kernel(*VARIANTS[1], wgs=1))  # K = 64 on one warpgroup (two are the default)
    # the GVA pair sum in the kernel (CUDNN_TRAIN_GDN_DCHUNK_GROUP_SUM): a cluster of two CTAs per q/k head
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], dqk_dtype=torch.bfloat16, pair=True))
    assert callable(B3.get_dchunk_kernel(torch.bfloat16, 128, 128, True, False, 4, dqk_dtype=torch.bfloat16, pair=True))
    assert callable(B3.get_dchunk_kernel(torch.float16, 64, 64, True, False, dqk_dtype=torch.float16, pair=True))
    # the profile variant (tools/time_gdn_dchunk.py --profile)
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], dqk_dtype=torch.bfloat16, pair=True, profile=True))
    # the synchronous loads (CUDNN_TRAIN_GDN_DCHUNK_ASYNC_LOADS=0), for comparison
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], async_loads=not B3.async_loads_default()))
    # the forward's vn read instead of recomputed (CUDNN_TRAIN_GDN_DCHUNK_VN_FROM_FWD): with the overlap and the
    # pair sum at K = 128, without the overlap at K = 64
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], dqk_dtype=torch.bfloat16, pair=True, vn_in=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[1], vn_in=True))
    # and the forward's chunk inverses read instead of solved (CUDNN_TRAIN_GDN_DCHUNK_TM_FROM_FWD)
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], dqk_dtype=torch.bfloat16, pair=True, vn_in=True, tm_in=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[1], tm_in=True))
    # the persistent variant (CUDNN_TRAIN_GDN_DCHUNK_PERSIST): the training path's call, K = 64 varlen, plain
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], dqk_dtype=torch.bfloat16, pair=True, vn_in=True, tm_in=True,
                                         persist=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[1], vn_in=True, tm_in=True, persist=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], persist=True))
    # the TMA loads (CUDNN_TRAIN_GDN_DCHUNK_TMA): the training path's call per tile, persistent, on four warpgroups
    # (64-byte swizzles), and K = 64 varlen
    train = dict(dqk_dtype=torch.bfloat16, pair=True, vn_in=True, tm_in=True, tma=True)
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, persist=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], 4, **train))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[1], vn_in=True, tm_in=True, tma=True))
    with pytest.raises(ValueError, match="TMA loads"):
        B3.get_dchunk_kernel(*VARIANTS[0], tma=True)  # vn and Tm recomputed: no TMA variant
    # the persistent variant's profile (sums over each CTA's tiles), with cp.async and with TMA
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **{**train, "tma": False}, persist=True, profile=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, persist=True, profile=True))
    # the two-chain kernel (CUDNN_TRAIN_GDN_DCHUNK_CHAINS): the training path's call with the pair sum, and fp16
    # varlen without the l2norm, dq and dk per value head
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, chains=True))
    assert callable(B3.get_dchunk_kernel(torch.float16, 128, 128, True, False, vn_in=True, tm_in=True, tma=True,
                                         chains=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, chains=True, profile=True))  # its profile variant
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, chains=2))  # dvb and dv on the q side
    for bad in (dict(train, chains=True, persist=True), dict(train, tma=False, chains=True)):
        with pytest.raises(ValueError, match="two-chain"):
            B3.get_dchunk_kernel(*VARIANTS[0], **bad)
    with pytest.raises(ValueError, match="two-chain"):
        B3.get_dchunk_kernel(*VARIANTS[1], vn_in=True, tm_in=True, tma=True, chains=True)  # K = 64
    # the relaxed first cluster arrive (CUDNN_TRAIN_GDN_DCHUNK_RELAXED): the pair sum per tile with Tm read only
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, relaxed=True))
    with pytest.raises(ValueError, match="relaxed"):
        B3.get_dchunk_kernel(*VARIANTS[0], **train, persist=True, relaxed=True)
    # E exponentiated once into registers (CUDNN_TRAIN_GDN_DCHUNK_EREG): the training path's call per tile and
    # persistent, and with the chunk inverses solved (k k^T then computed at the top and again for dA)
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, ereg=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, persist=True, ereg=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[1], ereg=True))
    with pytest.raises(ValueError, match="EREG"):
        B3.get_dchunk_kernel(*VARIANTS[0], **train, chains=True, ereg=True)
    # dKK + dKK^T formed in dA's terms (CUDNN_TRAIN_GDN_DCHUNK_DKKSYM): per tile, persistent with E in registers,
    # and with the chunk inverses solved at K = 64
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, dkk_sym=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, persist=True, ereg=True, dkk_sym=True))
    assert callable(B3.get_dchunk_kernel(*VARIANTS[1], dkk_sym=True))
    with pytest.raises(ValueError, match="DKKSYM"):
        B3.get_dchunk_kernel(*VARIANTS[0], **train, chains=True, dkk_sym=True)
    # the l2norm rows eight threads a row (CUDNN_TRAIN_GDN_DCHUNK_NORM8): the training path's default call
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, persist=True, ereg=True, norm8=True))
    # the next tile's k issued early (CUDNN_TRAIN_GDN_DCHUNK_EARLYK): persistent only
    assert callable(B3.get_dchunk_kernel(*VARIANTS[0], **train, persist=True, ereg=True, early_k=True))
    with pytest.raises(ValueError, match="EARLYK"):
        B3.get_dchunk_kernel(*VARIANTS[0], **train, early_k=True)
    assert len(list(kernel_cache.rglob("*.o"))) == len(VARIANTS) + 34


def test_two_chain_switch_is_off_by_default_and_parses(monkeypatch):
    """CUDNN_TRAIN_GDN_DCHUNK_CHAINS is off (0) by default (prepared, not yet timed), 1 turns it on, 2 the variant
    with dv on the q side, a typo is a ValueError naming it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3
    from tests.utils import assert_env_override

    monkeypatch.delenv("CUDNN_TRAIN_GDN_DCHUNK_CHAINS", raising=False)
    assert B3.chains_default() == 0
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_DCHUNK_CHAINS", B3.chains_default, "1", 1, ("3", "yes"))
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_DCHUNK_CHAINS", B3.chains_default, "2", 2, ())


def test_relaxed_arrive_switch_is_off_by_default_and_parses(monkeypatch):
    """CUDNN_TRAIN_GDN_DCHUNK_RELAXED is off by default (GPU-run: bitwise, but slower), 1 turns it on, a typo is a
    ValueError naming it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3
    from tests.utils import assert_env_override

    monkeypatch.delenv("CUDNN_TRAIN_GDN_DCHUNK_RELAXED", raising=False)
    assert B3.relaxed_default() is False
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_DCHUNK_RELAXED", B3.relaxed_default, "1", True, ("2", "on"))


def test_persist_and_ereg_switches_are_on_by_default_and_parse(monkeypatch):
    """CUDNN_TRAIN_GDN_DCHUNK_PERSIST and _EREG are on by default (twenty-eighth session: persistent with E in
    registers is the fast pair, both tiers green with it), 0 turns each off, a typo is a ValueError naming it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3
    from tests.utils import assert_env_override

    for name, fn in (("CUDNN_TRAIN_GDN_DCHUNK_EREG", B3.ereg_default), ("CUDNN_TRAIN_GDN_DCHUNK_PERSIST",
                                                                         B3.persist_default)):
        monkeypatch.delenv(name, raising=False)
        assert fn() is True
        assert_env_override(monkeypatch, name, fn, "0", False, ("2", "off"))


def test_launch_choice_persistent_default_steps_aside_for_the_two_chains(monkeypatch):
    """chunk_grads' choice of loads and kernel form (``launch_choice``) on the default switches: persistent with TMA
    loads where vn and Tm are given; the two-chain kernel, asked for by ``chains`` or by its switch where it would
    serve (vn and Tm given, K = V = 128, two warpgroups), is per tile, the persistent default stepping aside for it
    (under it the switch had been ignored); where the switch cannot be served the persistent default stays; asked
    for by ``chains`` where it cannot serve, or with ``persist=True``, a ValueError; a profile keeps it per tile."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    for name in ("ASYNC_LOADS", "PERSIST", "TMA", "CHAINS"):
        monkeypatch.delenv(f"CUDNN_TRAIN_GDN_DCHUNK_{name}", raising=False)

    def choice(K=128, V=128, wgs=None, kept=True, profiled=False, **kw):
        args = dict(async_loads=None, persist=None, tma=None, chains=None) | kw
        return B3.launch_choice(K, V, wgs, kept, profiled, args["async_loads"], args["persist"], args["tma"],
                                args["chains"])

    assert choice() == (True, True, True, 0)  # the training path's call: persistent, TMA loads
    assert choice(kept=False) == (True, True, False, 0)  # cp.async loads, persistent
    assert choice(profiled=True) == (True, False, True, 0)  # the profile variant per tile
    for c in (1, 2, True):
        assert choice(chains=c) == (True, False, True, int(c))  # per tile, TMA loads whatever their switch says
        with pytest.raises(ValueError, match="chains"):
            choice(chains=c, tma=False)
        with pytest.raises(ValueError, match="chains"):
            choice(chains=c, persist=True)
        with pytest.raises(ValueError, match="chains"):
            choice(chains=c, kept=False)
        with pytest.raises(ValueError, match="chains"):
            choice(chains=c, K=64, V=64)
    assert choice(chains=False) == choice(chains=0) == (True, True, True, 0)
    with pytest.raises(ValueError, match="chains=3"):
        choice(chains=3)
    for env in ("1", "2"):
        monkeypatch.setenv("CUDNN_TRAIN_GDN_DCHUNK_CHAINS", env)
        assert choice() == (True, False, True, int(env))  # the switch: per tile, two chains
        assert choice(chains=0) == (True, True, True, 0)  # chains named: the switch does not apply
        assert choice(kept=False) == (True, True, False, 0)  # it cannot serve: the persistent default stays
        assert choice(K=64, V=64) == (True, True, True, 0)
        assert choice(wgs=4) == (True, True, True, 0)
        assert choice(tma=False) == (True, True, False, 0)
        assert choice(persist=True) == (True, True, True, 0)  # persistent asked for: the switch gives way
    monkeypatch.setenv("CUDNN_TRAIN_GDN_DCHUNK_CHAINS", "3")
    with pytest.raises(ValueError, match="CUDNN_TRAIN_GDN_DCHUNK_CHAINS"):
        choice(chains=1)  # a typo in the switch is an error wherever it is read
    monkeypatch.delenv("CUDNN_TRAIN_GDN_DCHUNK_CHAINS")
    with pytest.raises(ValueError, match="persist"):
        choice(async_loads=False, persist=True)
    assert choice(async_loads=False) == (False, False, False, 0)  # synchronous loads: per tile


def test_dkk_sym_switch_is_off_by_default_and_parses(monkeypatch):
    """CUDNN_TRAIN_GDN_DCHUNK_DKKSYM is off by default (GPU-run: slower with the default's E in registers), 1 turns it on, a typo is a
    ValueError naming it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3
    from tests.utils import assert_env_override

    monkeypatch.delenv("CUDNN_TRAIN_GDN_DCHUNK_DKKSYM", raising=False)
    assert B3.dkk_sym_default() is False
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_DCHUNK_DKKSYM", B3.dkk_sym_default, "1", True, ("2", "on"))


def test_norm8_switch_is_off_by_default_and_parses(monkeypatch):
    """CUDNN_TRAIN_GDN_DCHUNK_NORM8 is off by default (GPU-run: no gain), 1 turns it on, a typo is a ValueError
    naming it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3
    from tests.utils import assert_env_override

    monkeypatch.delenv("CUDNN_TRAIN_GDN_DCHUNK_NORM8", raising=False)
    assert B3.norm8_default() is False
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_DCHUNK_NORM8", B3.norm8_default, "1", True, ("2", "on"))


def test_early_k_switch_is_off_by_default_and_parses(monkeypatch):
    """CUDNN_TRAIN_GDN_DCHUNK_EARLYK is off by default (GPU-timed: no gain), 1 turns it on, a typo is a ValueError
    naming it."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3
    from tests.utils import assert_env_override

    monkeypatch.delenv("CUDNN_TRAIN_GDN_DCHUNK_EARLYK", raising=False)
    assert B3.early_k_default() is False
    assert_env_override(monkeypatch, "CUDNN_TRAIN_GDN_DCHUNK_EARLYK", B3.early_k_default, "1", True, ("2", "on"))


def test_chunk_gradient_kernel_declines_without_gpu_before_touching_memory():
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU decline")
    x = torch.randn(1, 8, 1, 64, dtype=torch.bfloat16)
    s = torch.zeros(1, 8, 1)
    rows = torch.zeros(1, 1, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(Unsupported):
        B3.chunk_grads(x, x, x, s, s, x, x, rows, rows, scale=0.125)


# ------------------------------------------------------------------ GPU tier


def _case(B, T, HV, K, V, dtype, lens=None, H=None, l2norm=False, with_vn=False):
    from cudnn_train.fused import delta_rule_bwd as db
    from cudnn_train.fused.gated_delta_rule import l2norm as l2n
    from cudnn_train.kernels import gated_delta_rule_train_sm90 as tr

    dev = "cuda"
    H = HV if H is None else H
    # q, k as the op gets them: unit rows, or (l2norm) any rows that the kernel normalizes
    qx, kx = (torch.randn(B, T, H, K, device=dev) for _ in range(2))
    if not l2norm:
        qx, kx = F.normalize(qx, dim=-1), F.normalize(kx, dim=-1)
    qx, kx = qx.to(dtype), kx.to(dtype)
    qn, kn = (l2n(x.float()) if l2norm else x.float() for x in (qx, kx))
    v = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    do = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.rand(B, T, HV, device=dev))
    beta = torch.rand(B, T, HV, device=dev)
    cu = None if lens is None else cu_seqlens(lens, dev)
    N = B if cu is None else len(lens)
    h0 = torch.randn(N, HV, K, V, device=dev) * 0.5
    dht = torch.randn(N, HV, K, V, device=dev)
    scale = K**-0.5
    outs = (g.unsqueeze(-1), beta)  # as gated_delta_rule_train_sm90.prepared gives them
    lay = db.ChunkLayout(B, T, 64, cu)
    r = db._recompute(*(lay.to_chunks(tr.expand_heads(x, HV)) for x in (qn, kn)), lay.to_chunks(v.float()),
                      lay.to_chunks(g.unsqueeze(-1)), lay.to_chunks(beta.unsqueeze(-1)), scale, 64)
    Sc, _, dHc, dvn, _ = db.sweeps_ref(r, lay, h0, dht, lay.to_chunks(do.float()))
    hs, dH, dvn = lay.chunks_to_rows(Sc).contiguous(), lay.chunks_to_rows(dHc).contiguous(), lay.from_chunks(dvn)
    gc = lay.from_chunks(lay.to_chunks(g.unsqueeze(-1)).cumsum(-2)).squeeze(-1).contiguous()  # in-chunk cumsum
    cfg = tr.Config(scale, True, l2norm, False, False, False, False)
    want = tr.stage3_torch(outs, (qx, kx, v), (hs,), dH, dvn, do, cu, cfg)
    # the kernel reads the states and dvn in the input dtype (as the forward and the sweep store them)
    args = (qx, kx, v, gc, beta, do, dvn.to(dtype).contiguous(), hs.to(dtype).contiguous(), dH.to(dtype).contiguous(),
            scale, cu, l2norm)
    if with_vn:  # vn = u - w Sc of every chunk, as the forward's split pass writes it, and Tm (input dtype)
        return args, want, lay.from_chunks(db.new_values(r, Sc)).to(dtype).contiguous(), \
            lay.from_chunks(r["Tm"]).to(dtype).contiguous()
    return args, want


def _run(args, want, wgs=None, overlap=None):
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    got = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, scale=scale, cu_seqlens=cu, l2norm=l2, wgs=wgs,
                         overlap=overlap)
    got = list(got)
    got[3] = got[3].unsqueeze(-1)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.isfinite(a).all(), name
        assert rel_l2(a, b) <= 2e-2, (name, rel_l2(a, b))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunk_gradients_match_the_torch_stage(T, dtype):
    _run(*_case(2, T, 4, 128, 128, dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("wgs", [1, 2, 4])
@pytest.mark.parametrize("T", [65, 300])
def test_chunk_gradients_every_warpgroup_count_at_128(T, wgs):
    """One, two and four warpgroups splitting N at K = 128 (one is the default at K = 64)."""
    _run(*_case(2, T, 4, 128, 128, torch.bfloat16, l2norm=True), wgs=wgs)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("wgs", [2, 4])
@pytest.mark.parametrize("T", [65, 300])
def test_chunk_gradients_overlap_variant(T, wgs, overlap):
    """With and without the variant that keeps products in flight during independent CUDA-core work
    and prefetches dH into L2 (the default at K = 128 on two or four warpgroups;
    CUDNN_TRAIN_GDN_DCHUNK_OVERLAP=0 turns it off)."""
    _run(*_case(2, T, 4, 128, 128, torch.bfloat16, l2norm=True), wgs=wgs, overlap=overlap)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [None, [1, 63, 130, 64, 0, 7]])
def test_chunk_gradients_one_warpgroup_at_64(lens):
    """K = V = 64 on one warpgroup (two, with 64-byte swizzles, are the default there since the twelfth session)."""
    T = 300 if lens is None else sum(lens)
    _run(*_case(2 if lens is None else 1, T, 4, 64, 64, torch.float16, lens=lens, H=2, l2norm=True), wgs=1)


@pytest.mark.gpu
def test_chunk_gradients_overlap_variant_varlen_gva():
    _run(*_case(1, 1 + 63 + 130 + 64 + 0 + 7, 4, 128, 128, torch.float16, lens=[1, 63, 130, 64, 0, 7], H=2),
         overlap=True)


@pytest.mark.gpu
def test_chunk_gradients_four_warpgroups_varlen_gva():
    _run(*_case(1, 1 + 63 + 130 + 64 + 0 + 7, 4, 128, 128, torch.float16, lens=[1, 63, 130, 64, 0, 7], H=2), wgs=4)


@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 128])
def test_chunk_gradients_varlen(K):
    _run(*_case(1, 1 + 63 + 130 + 64 + 0 + 7, 2, K, K, torch.bfloat16, lens=[1, 63, 130, 64, 0, 7]))


@pytest.mark.gpu
@pytest.mark.parametrize("H", [1, 2])
def test_chunk_gradients_gva(H):
    """q and k at their own heads: value head hv reads head hv // (HV // H); dq, dk per value head."""
    _run(*_case(2, 200, 4, 128, 128, torch.bfloat16, H=H))


@pytest.mark.gpu
@pytest.mark.parametrize("K, H, dtype", [(128, 2, torch.bfloat16), (64, 4, torch.float16)])
def test_chunk_gradients_with_the_l2norm_in_kernel(K, H, dtype):
    """Rows normalized in the kernel; dq and dk through the l2norm's backward."""
    _run(*_case(2, 130, 4, K, K, dtype, H=H, l2norm=True))


@pytest.mark.gpu
def test_chunk_gradients_dq_dk_in_the_input_dtype_are_the_float32_ones_rounded():
    """Without GVA the training path takes dq, dk in the input dtype straight from the kernel: the
    float32 results rounded once, bitwise."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    args, _ = _case(2, 300, 4, 128, 128, torch.bfloat16, l2norm=True)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    f32 = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, scale=scale, l2norm=l2)
    bf = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, scale=scale, l2norm=l2, dqk_dtype=torch.bfloat16)
    assert bf[0].dtype == bf[1].dtype == torch.bfloat16
    for name, a, b in (("dq", bf[0], f32[0]), ("dk", bf[1], f32[1])):
        assert torch.equal(a, b.to(torch.bfloat16)), name
    for a, b in zip(bf[2:], f32[2:]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["dense_wgs2", "dense_wgs1_fp16", "varlen_64", "pair_wgs4"])
def test_chunk_gradients_async_loads_are_bitwise_the_synchronous_loads(case):
    """The loads by cp.async in three groups, each waited for where it is first read (the default),
    change no product and no order: every output bitwise equal to the synchronous loads', and the
    default's against the float32 torch stage."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    if case == "varlen_64":
        args, want = _case(1, sum([1, 63, 130, 64, 0, 7]), 4, 64, 64, torch.float16, lens=[1, 63, 130, 64, 0, 7], H=2)
    else:
        dt = torch.float16 if case.endswith("fp16") else torch.bfloat16
        args, want = _case(2, 300, 4, 128, 128, dt, H=2 if case.startswith("pair") else None, l2norm=True)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    kw = dict(scale=scale, cu_seqlens=cu, l2norm=l2, wgs={"dense_wgs1_fp16": 1, "pair_wgs4": 4}.get(case))
    if case.startswith("pair"):
        kw.update(dqk_dtype=dt, sum_groups=True)
    got = [B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, async_loads=a, **kw) for a in (True, False)]
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), *got):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"{case}: {name} differs with the cp.async loads"
    if not case.startswith("pair"):
        _run(args, want, wgs=kw["wgs"])


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["pair_vn_tm", "varlen_64_vn_tm", "dense", "dense_one_tile_a_cta", "wgs4_vn",
                                  "wgs1_tm"])
def test_persistent_chunk_gradients_are_bitwise_the_per_tile_kernels(case):
    """The persistent variant (a CTA per SM, or here a few, walking the tiles; the next tile's inputs loaded
    during the current one's last three phases) computes every tile as the per-tile
    kernel does: every output bitwise equal, outputs allocated over NaN-filled memory. Several tiles a CTA
    (``persist_ctas``), varlen with empty and one-token sequences, the pair sum, vn and / or Tm read, one,
    two and four warpgroups (with and without the overlap variant)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    lens = [1, 63, 130, 64, 0, 7] if case.startswith("varlen") else None
    pair = case.startswith("pair")
    K = 64 if lens else 128
    dt = torch.float16 if lens else torch.bfloat16
    args, _, vn, tm = _case(1 if lens else 2, sum(lens) if lens else 300, 4, K, K, dt, lens=lens,
                            H=2 if pair or lens else None, l2norm=lens is None, with_vn=True)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    kw = dict(scale=scale, cu_seqlens=cu, l2norm=l2, wgs={"wgs4_vn": 4, "wgs1_tm": 1}.get(case))
    if pair:
        kw.update(dqk_dtype=dt, sum_groups=True)
    kw.update(vn=vn if case.endswith("vn_tm") or case.endswith("_vn") else None,
              tm=tm if case.endswith("_tm") else None)
    want = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, persist=False, **kw)
    poison = torch.full((8 * v.numel(),), float("nan"), device=v.device)  # the caching allocator reuses it
    del poison
    ctas = None if case == "dense_one_tile_a_cta" else {"pair_vn_tm": 3, "varlen_64_vn_tm": 5, "wgs1_tm": 6}.get(case, 7)
    got = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, persist=True, persist_ctas=ctas, **kw)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert torch.isfinite(a).all(), f"{case}: {name} has unwritten elements"
        assert torch.equal(a, b), f"{case}: {name} differs in the persistent variant"


def _pad_rows(args, vn, tm, extra):
    """A varlen case's token tensors ``extra`` rows longer than its sequences, NaN there (what a varlen tensor
    may hold past ``cu_seqlens[-1]``), and the chunk-row tensors grown to the longer tensor's grid."""
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    T = qn.shape[1]

    def pad(x):
        return torch.cat([x, torch.full((1, extra, *x.shape[2:]), float("nan"), device=x.device, dtype=x.dtype)], 1)

    def grow(x):
        rows = (T + extra) // 64 + cu.numel() - 1
        return torch.cat([x, x.new_zeros(max(rows - x.shape[0], 0), *x.shape[1:])]).contiguous()

    qn, kn, v, gc, beta, do, dvn, vn, tm = (pad(x) for x in (qn, kn, v, gc, beta, do, dvn, vn, tm))
    return (qn, kn, v, gc, beta, do, dvn, grow(hs), grow(dH), scale, cu, l2), vn, tm


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["pair", "pair_persistent", "varlen_64", "varlen_64_persistent", "varlen_nan_tail",
                                  "wgs4", "fp16_T65"])
def test_tma_chunk_gradients_are_bitwise_the_cp_async_loads(case):
    """The TMA loads (CUDNN_TRAIN_GDN_DCHUNK_TMA: one thread issues each group's bulk copies on an mbarrier; rows
    past a varlen sequence's end zeroed once landed) bring the same bytes as the cp.async loads: every output
    bitwise equal, per tile and persistent (several tiles a CTA), on the training path's call (vn and Tm read):
    the pair sum, varlen with empty, one-token and odd sequences at K = 64, NaN past the last sequence, four
    warpgroups (64-byte swizzles), fp16 at T = 65 (a partial last chunk: rows past the tensor's end)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    lens = [1, 63, 130, 64, 0, 7] if case.startswith("varlen") else None
    pair = case.startswith("pair")
    K = 64 if lens else 128
    dt = torch.float16 if lens or case.startswith("fp16") else torch.bfloat16
    T = sum(lens) if lens else (65 if case == "fp16_T65" else 300)
    args, _, vn, tm = _case(1 if lens else 2, T, 4, K, K, dt, lens=lens, H=2 if pair or lens else None,
                            l2norm=lens is None, with_vn=True)
    if case == "varlen_nan_tail":
        args, vn, tm = _pad_rows(args, vn, tm, 37)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    kw = dict(scale=scale, cu_seqlens=cu, l2norm=l2, wgs=4 if case == "wgs4" else None, vn=vn, tm=tm)
    if pair:
        kw.update(dqk_dtype=dt, sum_groups=True)
    if case.endswith("persistent"):
        kw.update(persist=True, persist_ctas=5)
    want = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, tma=False, **kw)
    got = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, tma=True, **kw)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert torch.isfinite(a).all(), f"{case}: {name} is not finite"
        assert torch.equal(a, b), f"{case}: {name} differs with the TMA loads"


def _off_then_on(args, kw, switch):
    """``chunk_grads`` on a case's ``args`` (:func:`_case`) with the keyword ``switch`` False, then True over memory
    poisoned with NaN (the caching allocator hands the freed block to the second call's outputs)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    qn, kn, v, gc, beta, do, dvn, hs, dH = args[:9]
    want = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, **kw, **{switch: False})
    poison = torch.full((8 * v.numel(),), float("nan"), device=v.device)
    del poison
    return want, B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, **kw, **{switch: True})


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["pair", "pair_T65_fp16", "pair_varlen"])
def test_relaxed_first_arrive_is_bitwise_the_release_form(case):
    """The relaxed first cluster arrive (CUDNN_TRAIN_GDN_DCHUNK_RELAXED) on the training path's call with the pair sum
    (vn and Tm read, TMA loads) gives every output bit for bit as the release form, over memory poisoned with NaN:
    bf16 at T 300, fp16 at T 65 (a partial last chunk), varlen with empty and one-token sequences at K = 64."""
    lens = [1, 63, 130, 64, 0, 7] if case.endswith("varlen") else None
    K = 64 if lens else 128
    dt = torch.float16 if lens or case.endswith("fp16") else torch.bfloat16
    T = sum(lens) if lens else (65 if "T65" in case else 300)
    args, _, vn, tm = _case(1 if lens else 2, T, 4, K, K, dt, lens=lens, H=2, l2norm=lens is None, with_vn=True)
    scale, cu, l2 = args[9:]
    kw = dict(scale=scale, cu_seqlens=cu, l2norm=l2, vn=vn, tm=tm, dqk_dtype=dt, sum_groups=True, persist=False)
    want, got = _off_then_on(args, kw, "relaxed")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert torch.isfinite(a).all(), f"{case}: {name} has unwritten elements"
        assert torch.equal(a, b), f"{case}: {name} differs with the relaxed arrive"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["pair", "pair_T65_fp16", "pair_persistent", "varlen_64", "solve", "wgs4_vn",
                                  "wgs1_T65"])
def test_ereg_chunk_gradients_match_the_default(case):
    """E = exp(gc_i - gc_j) exponentiated once into registers (CUDNN_TRAIN_GDN_DCHUNK_EREG; dQK's tile and dA's terms
    read it, Ae formed from k k^T's accumulator instead of the sM tile; the default since the twenty-eighth session)
    gives dq, dk, dv and dg bit for bit as the kernel without it and dbeta within float32 rounding (its row sums of
    dA * Ae contract into FMAs where the other kernel's do not:
    with no load or exp2 left in the branch LLVM if-converts it; measured rel L2 4.7e-10, max 1.5e-8 of 18 on the
    first GPU run; a wrong E or Ae would be O(1)), over memory poisoned with NaN: the training path's call (pair sum,
    vn and Tm read, TMA loads) in bf16 at T 300, fp16 at T 65, persistent with several tiles a CTA; K = 64 varlen
    with empty and one-token sequences (vn and Tm read); Tm solved in the kernel (k k^T then both at the top and for
    dA); four warpgroups with vn read; one warpgroup at T 65."""
    _check_switch_case(case, "ereg", "E in registers", loose_dbeta=True)


def _check_switch_case(case, switch, label, loose_dbeta, reordered=(), **extra):
    """A stage-3 switch's case (the parametrizations of the E-in-registers and dKK tests): the call the case names
    off, then on over memory poisoned with NaN (:func:`_off_then_on`); every output finite and bitwise the same,
    except dbeta within 1e-6 relative L2 where ``loose_dbeta``, and the outputs named in ``reordered`` (sums of the
    same products in another order) within 1e-4 relative L2 in float32, 1e-3 in half precision (a rounding may
    flip), the two-chain kernel's bounds (``extra``: more keywords of the call)."""
    lens = [1, 63, 130, 64, 0, 7] if case.startswith("varlen") else None
    pair = case.startswith("pair")
    K = 64 if lens else 128
    dt = torch.float16 if lens or case.endswith("fp16") else torch.bfloat16
    T = sum(lens) if lens else (65 if "T65" in case else 300)
    args, _, vn, tm = _case(1 if lens else 2, T, 4, K, K, dt, lens=lens, H=2 if pair or lens else None,
                            l2norm=lens is None, with_vn=True)
    scale, cu, l2 = args[9:]
    persist = "persistent" in case
    kw = dict(scale=scale, cu_seqlens=cu, l2norm=l2, wgs={"wgs4_vn": 4, "wgs1_T65": 1}.get(case),
              vn=None if case in ("solve", "wgs1_T65") else vn,
              tm=None if case in ("solve", "wgs4_vn", "wgs1_T65") else tm, persist=persist, **extra)
    if pair:
        kw.update(dqk_dtype=dt, sum_groups=True)
    if persist:
        kw.update(persist_ctas=3)
    want, got = _off_then_on(args, kw, switch)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert torch.isfinite(a).all(), f"{case}: {name} has unwritten elements"
        what = (f"{case}: {name} differs with {label}: rel L2 {rel_l2(a, b):.1e}, "
                f"max abs {(a.float() - b.float()).abs().max().item():.1e} of {b.abs().max().item():.1e}")
        if name == "dbeta" and loose_dbeta:
            assert rel_l2(a, b) <= 1e-6, what
        elif name in reordered:
            assert rel_l2(a, b) <= (1e-4 if a.dtype == torch.float32 else 1e-3), what
        else:
            assert torch.equal(a, b), what


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["pair", "pair_T65_fp16", "pair_persistent_ereg", "varlen_64", "solve", "wgs4_vn",
                                  "wgs1_T65"])
def test_dkk_sym_chunk_gradients_match_the_round_trip(case):
    """dKK written from dA's terms into an input-dtype tile and dk's ``dKK k + dKK^T k`` as two products on it
    (CUDNN_TRAIN_GDN_DCHUNK_DKKSYM), against the float32 round trip through sT and the ``dKK + dKK^T`` tile: dq, dv,
    dg, dbeta bit for bit, dk the same products summed in another order (within 1e-4 relative L2 in float32, 1e-3
    where the pair sum rounds it to half precision), over memory poisoned with NaN: the training path's call (pair
    sum, vn and Tm read, TMA loads) in bf16 at T 300, fp16 at T 65, persistent with E in registers and several tiles
    a CTA; K = 64 varlen with empty and one-token sequences; Tm solved in the kernel; four warpgroups with vn read;
    one warpgroup at T 65. A missing or misplaced dKK element would change dk by O(1). With E in registers dbeta is
    held to 1e-6 relative L2 (its row sums of dA * Ae contract into FMAs differently once the branch changes: 4.7e-10
    on the first form's GPU run, the same figure E in registers gives against the kernel without it)."""
    ereg = case.endswith("ereg")
    _check_switch_case(case, "dkk_sym", "dKK in dA's terms", loose_dbeta=ereg, reordered=("dk",), ereg=ereg)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["pair", "pair_T65_fp16", "pair_persistent_ereg", "solve", "wgs4_vn", "wgs1_T65",
                                  "pair_chains"])
def test_norm8_chunk_gradients_match_the_thread_a_row_norms(case):
    """The l2norm factors of q's and k's rows by every thread, eight a row (CUDNN_TRAIN_GDN_DCHUNK_NORM8), against a
    thread a row: the same sums in another order, so a factor may differ in its last bit and a normalized element's
    rounding may flip; every output within 1e-4 relative L2 in float32, 1e-3 in half precision, over memory
    poisoned with NaN (every element written). A row summed wrongly or by too few threads would move its gradients
    by O(1). The training path's call (pair sum, vn and Tm read, TMA loads) in bf16 at T 300, fp16 at T 65,
    persistent with E in registers and several tiles a CTA, Tm solved in the kernel, four warpgroups with vn read,
    one warpgroup at T 65 (16 rows a pass), and the two-chain kernel."""
    extra = dict(chains=1) if case.endswith("chains") else dict(ereg=case.endswith("ereg"))
    _check_switch_case(case, "norm8", "the l2norm rows eight threads a row", loose_dbeta=False,
                       reordered=("dq", "dk", "dv", "dg", "dbeta"), **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["pair_persistent", "pair_persistent_ereg", "pair_T65_persistent_fp16",
                                  "varlen_64_persistent"])
def test_early_k_is_bitwise_the_late_issue(case):
    """The persistent kernel issuing the next tile's k right after this tile's dk products and l2norm
    (CUDNN_TRAIN_GDN_DCHUNK_EARLYK) gives every output bit for bit as issuing it after the pair sums, over memory
    poisoned with NaN, with three CTAs walking several tiles each (so a k overwritten while still read would change
    dk, dg or the next tile's everything): the training path's call (pair sum, vn and Tm read, TMA loads) in bf16 at
    T 300, with E in registers, fp16 at T 65 (partial last chunks), and K = 64 varlen without the l2norm (its k last
    read by the dk products) with empty and one-token sequences."""
    _check_switch_case(case, "early_k", "the next tile's k issued early", loose_dbeta=False,
                       ereg=case.endswith("ereg"))


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["pair", "pair_T65", "pair_fp16", "pair_varlen", "gva4_f32", "fp16_T1", "no_l2norm",
                                  "varlen_nan_tail"])
def test_two_chain_chunk_gradients_match_the_per_tile_kernel(case, monkeypatch):
    """The two-chain kernel (CUDNN_TRAIN_GDN_DCHUNK_CHAINS: a warpgroup for the q side and dk, one for the w side,
    whole products each) on the training path's call (vn and Tm read, TMA loads) against the per-tile kernel: the
    same products and rounding points, only the row sums' order (and the products' N per instruction) differ, so
    the float32 outputs within 1e-4 relative L2 of it and the half-precision ones (dv, the pair-summed dq, dk) within
    1e-3 (a rounding may flip); every output within the usual 2e-2 of the float32 torch stage (the pair sum's dq,
    dk against its per-head values summed over the pair); two calls give the same bits over memory poisoned with
    NaN, and so does the profile variant (pair case); all of it for both forms (``chains`` 1, and 2: dvb and dv on
    the q side); asked for without vn and Tm (no TMA loads) it is a ValueError; asked for by its switch
    (``CUDNN_TRAIN_GDN_DCHUNK_CHAINS``, no ``chains``), the persistent default steps aside and the same bits come
    (pair case). Cases: the pair sum (dq, dk exchanged between the cluster's warpgroups 0) in bf16, at T 65 (a
    partial last chunk), in fp16, and varlen with empty and one-token sequences (CTAs of length 0 exchanging too);
    GVA 4 with float32 dq, dk per value head; fp16 T 1; no l2norm; varlen fp16 with empty, one-token and odd
    sequences and NaN past the last sequence."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    lens = [1, 63, 130, 64, 0, 7] if "varlen" in case else None
    pair = case.startswith("pair")
    dt = torch.float16 if (lens and not pair) or "fp16" in case else torch.bfloat16
    T = sum(lens) if lens else {"pair_T65": 65, "fp16_T1": 1}.get(case, 300)
    H = {"gva4_f32": 1}.get(case, 2 if pair or lens else None)
    l2norm = case != "no_l2norm" and case != "varlen_nan_tail"
    args, want, vn, tm = _case(1 if lens else 2, T, 4, 128, 128, dt, lens=lens, H=H, l2norm=l2norm, with_vn=True)
    if case == "varlen_nan_tail":
        args, vn, tm = _pad_rows(args, vn, tm, 37)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    # the two-chain kernel has no persistent form: asked for, the persistent default steps aside (its calls name no
    # persist); the per-tile kernel it is checked against is asked for by name
    kw = dict(scale=scale, cu_seqlens=cu, l2norm=l2, vn=vn, tm=tm, tma=True)
    if pair:
        kw.update(dqk_dtype=dt, sum_groups=True)
    base = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, chains=False, persist=False, **kw)
    names = ("dq", "dk", "dv", "dg", "dbeta")
    B, HV = want[2].shape[0], want[2].shape[2]
    for chains in (1, 2):  # 2: dvb and dv on the q side
        runs = []
        for _ in range(2):
            poison = torch.full((8 * v.numel(),), float("nan"), device=v.device)  # the caching allocator reuses it
            del poison
            runs.append(B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, chains=chains, **kw))
        got, again = runs
        for name, a, b, c in zip(names, got, base, again):
            if lens is not None:  # rows past the last sequence: zeros in both (their outputs are zero-filled)
                a, b, c = a[:, :T], b[:, :T], c[:, :T]
            assert torch.isfinite(a).all(), f"{case}, chains={chains}: {name} has unwritten or non-finite elements"
            assert torch.equal(a, c), f"{case}, chains={chains}: {name} differs between two calls"
            tol = 1e-4 if a.dtype == torch.float32 else 1e-3
            assert rel_l2(a.float(), b.float()) <= tol, (case, chains, name, rel_l2(a.float(), b.float()))
        got = [x[:, :T] for x in got]
        got[3] = got[3].unsqueeze(-1)
        for name, a, b in zip(names, got, want):
            if pair and name in ("dq", "dk"):  # the torch stage's per value head, summed over each pair
                b = b.view(B, T, HV // 2, 2, -1).sum(3)
            assert a.shape == b.shape, (case, chains, name, a.shape, b.shape)
            assert rel_l2(a.float(), b.float()) <= 2e-2, (case, chains, name, rel_l2(a.float(), b.float()))
        if case == "pair":  # the profile variant: the same bits, a positive total and w-side phases in every row
            n = len(B3.CHAIN_PHASES) + 1
            buf = torch.zeros(2 * 5 * 4 * n, dtype=torch.int64, device="cuda")  # chunks x HV rows
            prof = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, chains=chains, profile=buf, **kw)
            for name, a, b in zip(names, prof, again):
                assert torch.equal(a, b), f"{name} differs in the profile variant (chains={chains})"
            rows = buf.view(-1, n)
            w = [i for i, p in enumerate(B3.CHAIN_PHASES) if p.startswith("w:")]
            assert (rows[:, -1] > 0).all() and (rows[:, w].sum(1) > 0).all()
            monkeypatch.setenv("CUDNN_TRAIN_GDN_DCHUNK_CHAINS", str(chains))  # the switch, no chains named
            by_env = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, **kw)
            monkeypatch.delenv("CUDNN_TRAIN_GDN_DCHUNK_CHAINS")
            for name, a, b in zip(names, by_env, again):
                assert torch.equal(a, b), f"{name} differs when the switch asks for chains={chains}"
    if case == "no_l2norm":
        with pytest.raises(ValueError, match="chains"):
            B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, scale=scale, cu_seqlens=cu, l2norm=l2, chains=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
def test_persistent_profile_variant_is_bitwise_the_per_tile_kernel(tma):
    """The persistent variant's profile (clock64 sums over each CTA's tiles, a row per CTA) changes no result:
    bitwise the per-tile kernel, several tiles a CTA, the training path's call with the pair sum; its rows hold a
    positive total for every CTA and nothing past them."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    args, _, vn, tm = _case(2, 300, 4, 128, 128, torch.bfloat16, H=2, l2norm=True, with_vn=True)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    kw = dict(scale=scale, cu_seqlens=cu, l2norm=l2, vn=vn, tm=tm, dqk_dtype=torch.bfloat16, sum_groups=True, tma=tma)
    n = len(B3.DCHUNK_PHASES) + 1
    buf = torch.zeros(2 * 5 * 4 * n, dtype=torch.int64, device="cuda")  # chunks x HV rows, at least
    want = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, persist=False, **kw)
    got = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, persist=True, persist_ctas=3, profile=buf, **kw)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert torch.equal(a, b), f"{name} differs in the persistent profile variant"
    rows = buf.view(-1, n)
    assert (rows[:6, -1] > 0).all() and (rows[6:] == 0).all()  # three clusters of two CTAs


# (case, what is read): the forward's vn (the training path's default), its chunk inverses Tm, or both
FORWARD_VALUE_CASES = [("T300", "vn"), ("T65", "vn"), ("T1_fp16", "vn"), ("wgs1", "vn"), ("wgs4", "vn"),
                       ("varlen_64", "vn"), ("pair", "vn"), ("T300", "vn_tm"), ("T65", "tm"), ("T1_fp16", "vn_tm"),
                       ("wgs1_sync", "vn_tm"), ("wgs4", "tm"), ("varlen_64", "vn_tm"), ("pair", "vn_tm"),
                       # K = 64 on two warpgroups, as the training path would call it there (not yet the default)
                       ("varlen_64_wgs2", "vn_tm"), ("pair64_wgs2", "vn_tm")]


@pytest.mark.gpu
@pytest.mark.parametrize("case, reads", FORWARD_VALUE_CASES)
def test_chunk_gradients_with_the_forwards_values(case, reads):
    """Stage 3 reading what the training forward kept instead of recomputing it: vn (``chunk_grads(vn=...)``,
    CUDNN_TRAIN_GDN_DCHUNK_VN_FROM_FWD) and / or the chunk inverses Tm (``tm=``, CUDNN_TRAIN_GDN_DCHUNK_TM_FROM_FWD),
    here the torch recompute's values rounded to the input dtype: against the float32 torch stage, the pair
    sum's against the recomputing kernel's (the values differ by their rounding only); ``wgs1_sync``:
    synchronous loads; at T300 with Tm, a Tm off by a factor of two must show (the kernel does read it)."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    lens = [1, 63, 130, 64, 0, 7] if case.startswith("varlen_64") else None
    T = {"T65": 65, "T1_fp16": 1}.get(case, 300) if lens is None else sum(lens)
    K = 64 if lens or case.startswith("pair64") else 128
    dt = torch.float16 if case.endswith("fp16") or lens else torch.bfloat16
    pair = case.startswith("pair")
    args, want, vn, tm = _case(1 if lens else 2, T, 4, K, K, dt, lens=lens, H=2 if pair or lens else None,
                               l2norm=lens is None, with_vn=True)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    wgs = 1 if case.startswith("wgs1") else (4 if case == "wgs4" else (2 if case.endswith("_wgs2") else None))
    kw = dict(scale=scale, cu_seqlens=cu, l2norm=l2, wgs=wgs)
    if pair:  # against the recomputing kernel (pair64_wgs2: on one warpgroup)
        kw.update(dqk_dtype=dt, sum_groups=True)
        want = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, **{**kw, "wgs": 1 if wgs == 2 else wgs})
    if case == "wgs1_sync":
        kw.update(async_loads=False)
    kw.update(vn=vn if "vn" in reads else None, tm=tm if "tm" in reads else None)
    got = list(B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, **kw))
    if not pair:
        got[3] = got[3].unsqueeze(-1)
    if case == "T300" and kw["tm"] is not None:  # the negative control
        bad = list(B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, **{**kw, "tm": 2 * tm}))
        bad[3] = bad[3].unsqueeze(-1)
        assert max(rel_l2(a.float(), b.float()) for a, b in zip(bad, want)) > 2e-2, "a wrong Tm went unnoticed"
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert torch.isfinite(a).all(), name
        assert rel_l2(a.float(), b.float()) <= 2e-2, (case, reads, name, rel_l2(a.float(), b.float()))


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [False, True])
def test_chunk_gradients_are_bitwise_reproducible(pair):
    """Two calls, the same bits; with the GVA pair sum (the cluster's shared-memory exchange) five calls."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    args, _ = _case(2, 300, 4, 128, 128, torch.bfloat16, H=2 if pair else None)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, _ = args
    kw = dict(scale=scale, l2norm=True, dqk_dtype=torch.bfloat16, sum_groups=True) if pair else dict(
        scale=scale, l2norm=True)
    first = [t.clone() for t in B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, **kw)]
    for _ in range(4 if pair else 1):
        again = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, **kw)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("l2norm, lens, wgs", [(False, [1, 63, 130, 64, 0, 7], 2), (False, None, 1), (True, None, 2),
                                               (True, [1, 63, 130, 64, 0, 7], 4), (True, None, 1)])
def test_chunk_gradients_group_sum_in_kernel(l2norm, lens, wgs):
    """``sum_groups=True`` (through the training path's CUDNN_TRAIN_GDN_DCHUNK_GROUP_SUM) with groups of
    two value heads: the pair's CTAs (one cluster) exchange half of their float32 dq, dk accumulators
    through distributed shared memory and each writes the other half, the two heads' values summed in
    float32 and rounded once. Without the l2norm the values are WGMMA accumulators as they are, so the
    result is bitwise the per-value-head kernel's float32 results summed and rounded; with it, ptxas may
    fuse the l2norm backward's last multiply with the sum's add (plain mul.f32 / add.f32 in the PTX), so
    there the result may sit one bf16 step from that rounding (bounded elementwise by 2^-7 relative). dv,
    dg and dbeta bitwise the per-value-head kernel's; dq, dk also against the float32 torch stage."""
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    G = 2
    T = 300 if lens is None else sum(lens)
    args, want = _case(2 if lens is None else 1, T, 2 * G, 128, 128, torch.bfloat16, lens=lens, H=2, l2norm=l2norm)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    kw = dict(scale=scale, cu_seqlens=cu, l2norm=l2, wgs=wgs)
    per = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, **kw)
    got = B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, dqk_dtype=torch.bfloat16, sum_groups=True, **kw)
    for name, x, y, ref in zip(("dq", "dk"), per[:2], got[:2], want[:2]):
        xs = x.unflatten(2, (2, G))
        acc = xs[:, :, :, 0]
        for gi in range(1, G):
            acc = acc + xs[:, :, :, gi]
        assert y.shape == (*x.shape[:2], 2, x.shape[3]) and y.dtype == torch.bfloat16, (name, y.shape, y.dtype)
        if l2norm:
            step = (y.float() - acc).abs() <= acc.abs() * 2.0**-7 + 1e-30
            assert step.all(), f"{name}: further than one bf16 step from the per-head float32 sum"
        else:
            assert torch.equal(y, acc.to(torch.bfloat16)), f"{name}: not the per-head float32 sum rounded once"
        refs = ref.unflatten(2, (2, G)).sum(3)
        assert rel_l2(y.float(), refs) <= 2e-2, (name, rel_l2(y.float(), refs))
    for name, x, y in zip(("dv", "dg", "dbeta"), per[2:], got[2:]):
        assert torch.equal(x, y), f"{name} differs with the group sum in the kernel"


@pytest.mark.gpu
def test_chunk_gradients_group_sum_declines_groups_of_four():
    """Only pairs are summed in the kernel: groups of four are declined (Unsupported, nothing launched)."""
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    args, _ = _case(1, 70, 8, 128, 128, torch.bfloat16, H=2, l2norm=False)
    qn, kn, v, gc, beta, do, dvn, hs, dH, scale, cu, l2 = args
    with pytest.raises(Unsupported, match="two only"):
        B3.chunk_grads(qn, kn, v, gc, beta, do, dvn, hs, dH, scale=scale, dqk_dtype=torch.bfloat16, sum_groups=True)

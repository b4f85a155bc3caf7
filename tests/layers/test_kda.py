"""layers.KimiDeltaAttention against FLA 0.6's KimiDeltaAttention: checkpoints, init, outputs, gradients.

Oracles: FLA's layer (constructor and state_dict on CPU; forward on CPU through accelerate_fla,
on the GPU with its Triton kernels) and an unfused float32 forward built from torch primitives
and FLA's ``naive_recurrent_kda``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cudnn_train.layers.kda import KimiDeltaAttention
from tests.layers.test_gated_deltanet import (
    KS_CRIT,
    DictCache,
    assert_close,
    assert_runs_close,
    build,
    check_decode_matches_full,
    check_packed_and_padded,
    fla_on_cpu,  # noqa: F401  (fixture)
    gpu_compare,
    gpu_decode_interop,
    ks_uniform,
    one_cpu_thread,  # noqa: F401  (fixture)
    pair,
    qkv_oracle,
    rmsnorm,
    run,
    run_oracle,
)

fla_layers = pytest.importorskip("fla.layers", reason="flash-linear-attention (fla) is not installed")
fla_naive = pytest.importorskip("fla.ops.kda.naive", reason="fla has no naive KDA")

CFGS = {
    "base": dict(hidden_size=32, head_dim=8, num_heads=2),
    "gva": dict(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, expand_v=2),
    "bounded": dict(hidden_size=24, head_dim=4, num_heads=3, expand_v=1.5, conv_size=2, conv_bias=True,
                    lower_bound=-3.0, allow_neg_eigval=True, norm_eps=1e-6),
    "safe_gate": dict(hidden_size=32, head_dim=8, num_heads=2, safe_gate=True, lower_bound=-5.0),
    "no_conv": dict(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, use_short_conv=False),
}


def kda_oracle(m, x):
    """KimiDeltaAttention written out: every row of x [B, T, hidden] one sequence, float32."""
    B, T = x.shape[:2]
    HV, K = m.num_v_heads, m.head_k_dim
    q, k, v = qkv_oracle(m, x)
    G = HV // m.num_heads
    q, k = q[:, :, ::G], k[:, :, ::G]  # naive_recurrent_kda does the GVA expansion itself
    beta = torch.sigmoid(m.b_proj(x)) * (2.0 if m.allow_neg_eigval else 1.0)
    raw = m.f_proj(x).view(B, T, HV, K) + m.dt_bias.view(HV, K)
    A = torch.exp(m.A_log).view(HV, 1)
    if m.lower_bound is None:
        g = -A * F.softplus(raw)
    else:
        g = m.lower_bound * torch.sigmoid(A * raw)
    o, _ = fla_naive.naive_recurrent_kda(q, k, v, g, beta)
    gate = m.g_proj(x).view(B, T, HV, m.head_v_dim)
    o = rmsnorm(o, m.o_norm.weight, m.o_norm.eps) * torch.sigmoid(gate)
    return m.o_proj(o.reshape(B, T, -1))


@pytest.mark.parametrize("name", list(CFGS))
def test_state_dict_loads_strict_both_ways(name):
    cfg = CFGS[name]
    theirs, ours = build(fla_layers.KimiDeltaAttention, cfg), build(KimiDeltaAttention, cfg)
    sd_t, sd_o = theirs.state_dict(), ours.state_dict()
    assert list(sd_t) == list(sd_o)
    for key in sd_t:
        assert sd_t[key].shape == sd_o[key].shape and sd_t[key].dtype == sd_o[key].dtype, key
    ours.load_state_dict(sd_t, strict=True)
    for key, val in ours.state_dict().items():
        assert torch.equal(val, sd_t[key]), key
    build(fla_layers.KimiDeltaAttention, cfg).load_state_dict(build(KimiDeltaAttention, cfg).state_dict(), strict=True)
    for attr in ("head_k_dim", "head_v_dim", "key_dim", "value_dim", "gate_dim", "num_v_heads", "use_short_conv",
                 "safe_gate", "lower_bound", "allow_neg_eigval", "mode"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr


@pytest.mark.parametrize("name", ["base", "bounded", "safe_gate"])
def test_same_seed_gives_fla_parameters(name):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    theirs = build(fla_layers.KimiDeltaAttention, CFGS[name], seed)
    ours = build(KimiDeltaAttention, CFGS[name], seed)
    for (kt, vt), (ko, vo) in zip(theirs.state_dict().items(), ours.state_dict().items()):
        assert kt == ko and torch.equal(vt, vo), kt
    assert ours.A_log._no_weight_decay and ours.dt_bias._no_weight_decay


def test_init_statistics_match_fla():
    cfg = dict(hidden_size=4, head_dim=4, num_heads=1024, expand_v=1)
    for layer in (build(KimiDeltaAttention, cfg), build(fla_layers.KimiDeltaAttention, cfg)):
        A = torch.exp(layer.A_log.detach())
        assert layer.A_log.shape == (1024,) and A.min() >= 1 and A.max() <= 16
        assert ks_uniform(A, 1.0, 16.0) < KS_CRIT / math.sqrt(A.numel())
        dt = F.softplus(layer.dt_bias.detach().double())
        assert layer.dt_bias.shape == (4096,)
        assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
        assert ks_uniform(torch.log(dt), math.log(1e-3), math.log(0.1)) < KS_CRIT / math.sqrt(dt.numel())
        for name in ("q_proj", "b_proj", "f_proj.0", "f_proj.1", "g_proj.0", "g_proj.1", "o_proj"):
            w = layer.get_submodule(name).weight.detach()
            bound = 1 / math.sqrt(w.shape[1])
            assert w.abs().max() <= bound and ks_uniform(w, -bound, bound) < KS_CRIT / math.sqrt(w.numel()), name
        b = layer.g_proj[1].bias.detach()
        bound = 1 / math.sqrt(layer.g_proj[1].in_features)
        assert b.abs().max() <= bound
        assert torch.equal(layer.o_norm.weight.detach(), torch.ones(layer.head_v_dim))
    safe = build(KimiDeltaAttention, CFGS["safe_gate"])
    assert torch.equal(safe.A_log.detach(), torch.zeros(safe.num_v_heads))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_v_heads"):
        KimiDeltaAttention(hidden_size=16, head_dim=4, num_heads=2, num_v_heads=5)
    with pytest.raises(ValueError, match="expand_v"):
        KimiDeltaAttention(hidden_size=16, head_dim=4, num_heads=2, expand_v=0.3)
    m = KimiDeltaAttention(hidden_size=16, head_dim=4, num_heads=2)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="attention_mask"):
        m(x, attention_mask=torch.ones(2, 5, 5))
    with pytest.raises(ValueError, match="layer_idx"):
        m(x, past_key_values=DictCache())
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, cu_seqlens=torch.tensor([0, 3, 5]))
    # as in FLA, safe_gate without lower_bound constructs, and the op refuses it at the first forward
    bad = KimiDeltaAttention(hidden_size=16, head_dim=4, num_heads=2, safe_gate=True)
    with pytest.raises(ValueError, match="lower_bound"):
        bad(x)


@pytest.mark.parametrize("name", list(CFGS))
def test_matches_unfused_oracle(name):
    _, m = pair(fla_layers.KimiDeltaAttention, KimiDeltaAttention, CFGS[name])
    x = torch.randn(2, 19, m.hidden_size)
    dy = torch.randn(2, 19, m.hidden_size)
    assert_runs_close(run(m, x, dy), run_oracle(m, kda_oracle, x, dy), 1e-5, name)


def test_grads_reach_every_parameter():
    m = build(KimiDeltaAttention, CFGS["bounded"])
    x = torch.randn(2, 9, m.hidden_size)
    out, dx, grads = run(m, x, torch.randn(2, 9, m.hidden_size))
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert set(grads) == {n for n, _ in m.named_parameters()}
    for n, g in grads.items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, n


@pytest.mark.parametrize("name", ["gva", "bounded"])
def test_cu_seqlens_and_attention_mask_equal_separate_runs(name):
    check_packed_and_padded(fla_layers.KimiDeltaAttention, KimiDeltaAttention, CFGS[name])


@pytest.mark.parametrize("cache_kind", ["dict", "fla"])
def test_decode_with_cache_matches_full_forward(cache_kind):
    check_decode_matches_full(KimiDeltaAttention, CFGS["bounded"], cache_kind)


FLA_CPU_CASES = [(n, "dense") for n in CFGS] + [("gva", "cu_seqlens"), ("safe_gate", "cu_seqlens"),
                                                 ("base", "mask"), ("bounded", "mask")]


@pytest.mark.parametrize("name, packing", FLA_CPU_CASES)
def test_matches_fla_layer_on_cpu(fla_on_cpu, name, packing):
    theirs, ours = pair(fla_layers.KimiDeltaAttention, KimiDeltaAttention, CFGS[name])
    D = ours.hidden_size
    if packing == "cu_seqlens":
        x, kw = torch.randn(1, 17, D), dict(cu_seqlens=torch.tensor([0, 6, 7, 17]))
    elif packing == "mask":
        mask = torch.ones(2, 11, dtype=torch.long)
        mask[1, 8:] = 0
        x, kw = torch.randn(2, 11, D), dict(attention_mask=mask)
    else:
        x, kw = torch.randn(2, 13, D), {}
    dy = torch.randn(*x.shape)
    assert_runs_close(run(ours, x, dy, **kw), run(theirs, x, dy, **kw), 1e-6, f"{name}/{packing}")
    assert fla_on_cpu.last_path("kda").startswith("cudnn_train:")
    ours.eval()
    theirs.eval()
    with torch.no_grad():  # FLA's inference path: fused_recurrent_kda
        assert_close(ours(x, **kw)[0], theirs(x, **kw)[0], 1e-6, "eval")


def kda_slack(what: str) -> float:
    """KDA's FLA-compat slack: 5, and 8 for the gradients of the gate path (f_proj, A_log, dt_bias)."""
    return 8.0 if what.startswith(("d f_proj", "d A_log", "d dt_bias")) else 5.0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packing", ["dense", "cu_seqlens", "mask"])
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_gpu_matches_fla_layer(dtype, packing, gate):
    cfg = dict(hidden_size=256, head_dim=64, num_heads=2, num_v_heads=4, expand_v=1, conv_bias=True)
    if gate == "lower_bound":
        cfg.update(safe_gate=True, lower_bound=-5.0)
    gpu_compare(fla_layers.KimiDeltaAttention, KimiDeltaAttention, cfg, dtype, packing, kda_slack)


@pytest.mark.gpu
def test_gpu_decode_continues_fla_cache():
    cfg = dict(hidden_size=256, head_dim=64, num_heads=2, num_v_heads=4, expand_v=1)
    gpu_decode_interop(fla_layers.KimiDeltaAttention, KimiDeltaAttention, cfg, torch.bfloat16, 5.0)

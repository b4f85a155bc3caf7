"""layers.GatedDeltaNet against FLA 0.6's GatedDeltaNet: checkpoints, init, outputs, gradients.

Oracles: FLA's layer itself (its constructor and state_dict on CPU; its forward on CPU through
accelerate_fla, on the GPU with its Triton kernels) and an unfused float32 forward built here
from torch primitives and FLA's ``naive_recurrent_gated_delta_rule``.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from cudnn_train.backend import use_backend
from cudnn_train.layers.gated_deltanet import GatedDeltaNet, ShortConvolution
from tests.utils import cu_seqlens, fla_compat_ok, rel_l2

fla_layers = pytest.importorskip("fla.layers", reason="flash-linear-attention (fla) is not installed")
fla_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive", reason="fla has no naive gated delta rule")

CFGS = {
    "base": dict(hidden_size=32, head_dim=8, num_heads=2),
    "gva": dict(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, expand_v=1),
    "odd": dict(hidden_size=24, head_dim=4, num_heads=3, expand_v=1.5, conv_size=3, conv_bias=True,
                allow_neg_eigval=True, output_gate_activation="sigmoid", norm_eps=1e-6),
    "no_gate": dict(hidden_size=32, head_dim=8, num_heads=2, use_gate=False),
    "no_conv": dict(hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, use_short_conv=False),
}
GATED = ["base", "gva", "odd", "no_conv"]  # FLA's plain RMSNorm (use_gate=False) has no CPU path


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """These tensors are tiny: intra-op threads only add contention on a small CI machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build(cls, cfg, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_short_conv=False warns, as in FLA
        return cls(**cfg)


def pair(fla_cls, our_cls, cfg, perturb=True):
    """FLA's layer and ours holding the same parameters (norm weights and conv bias moved off their init)."""
    theirs = build(fla_cls, cfg)
    if perturb:
        with torch.no_grad():
            for name, p in theirs.named_parameters():
                if name.startswith("o_norm") or name.endswith("bias"):
                    p.add_(0.3 * torch.randn_like(p))
    ours = build(our_cls, cfg)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return theirs, ours


def run(layer, x, dy, **kwargs):
    """Forward, then backward of <out, dy>: (out, x.grad, {param: grad})."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = layer(x, **kwargs)[0]
    (out.float() * dy).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


def assert_close(a, b, tol, what):
    err = rel_l2(a, b)
    assert err <= tol, f"{what}: relL2 {err:.3e} > {tol:.1e}"


def assert_runs_close(got, want, tol, what=""):
    out_a, dx_a, g_a = got
    out_b, dx_b, g_b = want
    assert_close(out_a, out_b, tol, f"{what} output")
    assert_close(dx_a, dx_b, tol, f"{what} d hidden_states")
    assert g_a.keys() == g_b.keys(), f"{what}: parameters with gradients differ: {sorted(g_a.keys() ^ g_b.keys())}"
    for n in g_a:
        assert_close(g_a[n], g_b[n], tol, f"{what} d {n}")


# ---------------------------------------------------------------------- the unfused oracle


def l2n(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def rmsnorm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def causal_conv_silu(x, conv):
    """Depthwise causal convolution by nn.functional.conv1d with left padding, then SiLU."""
    T, W = x.shape[1], conv.weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), conv.weight, conv.bias, padding=W - 1, groups=x.shape[-1])[..., :T]
    return F.silu(y.transpose(1, 2))


def qkv_oracle(m, x):
    if m.use_short_conv:
        q = causal_conv_silu(m.q_proj(x), m.q_conv1d)
        k = causal_conv_silu(m.k_proj(x), m.k_conv1d)
        v = causal_conv_silu(m.v_proj(x), m.v_conv1d)
    else:
        q, k, v = F.silu(m.q_proj(x)), F.silu(m.k_proj(x)), F.silu(m.v_proj(x))
    B, T = x.shape[:2]
    G = m.num_v_heads // m.num_heads
    q = l2n(q.view(B, T, m.num_heads, m.head_k_dim)).repeat_interleave(G, dim=2)
    k = l2n(k.view(B, T, m.num_heads, m.head_k_dim)).repeat_interleave(G, dim=2)
    return q, k, v.view(B, T, m.num_v_heads, m.head_v_dim)


def gdn_oracle(m, x):
    """GatedDeltaNet written out: every row of x [B, T, hidden] one sequence, float32."""
    B, T = x.shape[:2]
    q, k, v = qkv_oracle(m, x)
    beta = torch.sigmoid(m.b_proj(x)) * (2.0 if m.allow_neg_eigval else 1.0)
    g = -torch.exp(m.A_log) * F.softplus(m.a_proj(x) + m.dt_bias)
    o, _ = fla_naive.naive_recurrent_gated_delta_rule(q, k, v, beta, g)
    if m.use_gate:
        gate = m.g_proj(x).view(B, T, m.num_v_heads, m.head_v_dim)
        act = torch.sigmoid(gate) if m.o_norm.activation == "sigmoid" else F.silu(gate)
        o = rmsnorm(o, m.o_norm.weight, m.o_norm.eps) * act
    else:
        o = rmsnorm(o, m.o_norm.weight, m.o_norm.eps)
    return m.o_proj(o.reshape(B, T, -1))


def run_oracle(m, oracle, x, dy):
    m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = oracle(m, x)
    (out * dy).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach(), grads


# ---------------------------------------------------------------------- checkpoints and init


@pytest.mark.parametrize("name", list(CFGS))
def test_state_dict_loads_strict_both_ways(name):
    cfg = CFGS[name]
    theirs, ours = build(fla_layers.GatedDeltaNet, cfg), build(GatedDeltaNet, cfg)
    sd_t, sd_o = theirs.state_dict(), ours.state_dict()
    assert list(sd_t) == list(sd_o)
    for key in sd_t:
        assert sd_t[key].shape == sd_o[key].shape and sd_t[key].dtype == sd_o[key].dtype, key
    ours.load_state_dict(sd_t, strict=True)
    for key, val in ours.state_dict().items():
        assert torch.equal(val, sd_t[key]), key
    theirs2 = build(fla_layers.GatedDeltaNet, cfg)
    theirs2.load_state_dict(build(GatedDeltaNet, cfg).state_dict(), strict=True)
    for attr in ("head_k_dim", "head_v_dim", "key_dim", "value_dim", "num_v_heads", "use_gate", "use_short_conv",
                 "conv_size", "allow_neg_eigval", "mode", "layer_idx"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr


@pytest.mark.parametrize("name", ["base", "odd", "no_gate"])
def test_same_seed_gives_fla_parameters(name):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    theirs = build(fla_layers.GatedDeltaNet, CFGS[name], seed)
    ours = build(GatedDeltaNet, CFGS[name], seed)
    for (kt, vt), (ko, vo) in zip(theirs.state_dict().items(), ours.state_dict().items()):
        assert kt == ko and torch.equal(vt, vo), kt
    assert ours.A_log._no_weight_decay and ours.dt_bias._no_weight_decay


KS_CRIT = 2.7  # Kolmogorov-Smirnov: a distance above 2.7 / sqrt(n) has probability ~1e-6 under the null


def ks_uniform(samples, lo, hi):
    """Kolmogorov-Smirnov distance between samples and U(lo, hi)."""
    x, _ = torch.sort(samples.double().flatten())
    n = x.numel()
    cdf = ((x - lo) / (hi - lo)).clamp(0, 1)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - cdf).max().item(), (cdf - (i - 1) / n).max().item())


def test_init_statistics_match_fla():
    cfg = dict(hidden_size=4, head_dim=2, num_heads=2048, num_v_heads=4096, expand_v=1)
    n = 4096
    crit = KS_CRIT / math.sqrt(n)
    for layer in (build(GatedDeltaNet, cfg), build(fla_layers.GatedDeltaNet, cfg)):
        A = torch.exp(layer.A_log.detach())
        assert layer.A_log.dtype == torch.float32 and A.min() >= 0 and A.max() <= 16
        assert ks_uniform(A, 0.0, 16.0) < crit
        dt = F.softplus(layer.dt_bias.detach().double())
        assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
        assert ks_uniform(torch.log(dt), math.log(1e-3), math.log(0.1)) < crit
        for proj in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj"):
            w = getattr(layer, proj).weight.detach()
            bound = 1 / math.sqrt(w.shape[1])
            assert w.abs().max() <= bound and ks_uniform(w, -bound, bound) < KS_CRIT / math.sqrt(w.numel())
        w = layer.v_conv1d.weight.detach()
        bound = 1 / math.sqrt(w.shape[-1])  # fan_in of a depthwise conv: the kernel width
        assert w.abs().max() <= bound and ks_uniform(w, -bound, bound) < KS_CRIT / math.sqrt(w.numel())
        assert torch.equal(layer.o_norm.weight.detach(), torch.ones(layer.head_v_dim))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(hidden_size=16, head_dim=4, num_heads=2, num_v_heads=3)
    with pytest.raises(ValueError, match="expand_v"):
        GatedDeltaNet(hidden_size=16, head_dim=4, num_heads=2, expand_v=1.3)
    with pytest.raises(ValueError, match="mode"):
        GatedDeltaNet(hidden_size=16, head_dim=4, num_heads=2, mode="parallel")
    with pytest.raises(ValueError, match="output_gate_activation"):
        GatedDeltaNet(hidden_size=16, head_dim=4, num_heads=2, output_gate_activation="relu")
    m = GatedDeltaNet(hidden_size=16, head_dim=4, num_heads=2)
    x = torch.randn(2, 5, 16)
    with pytest.raises(ValueError, match="attention_mask"):
        m(x, attention_mask=torch.ones(2, 5, 5))
    with pytest.raises(ValueError, match="attention_mask"):
        m(x, attention_mask=torch.ones(3, 5))
    with pytest.raises(ValueError, match="hidden_states"):
        m(torch.randn(2, 5, 12))
    with pytest.raises(ValueError, match="layer_idx"):
        m(x, past_key_values=DictCache())
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(x, cu_seqlens=torch.tensor([0, 3, 5]))  # packed sequences need B == 1


@pytest.mark.parametrize("W, bias", [(4, False), (3, True), (2, True)])
def test_short_convolution_is_fla_module_and_causal_conv(W, bias):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    torch.manual_seed(seed)
    theirs = fla_layers.gated_deltanet.ShortConvolution(12, W, bias=bias, activation="silu")
    torch.manual_seed(seed)
    ours = ShortConvolution(12, W, bias=bias, activation="silu")
    assert isinstance(ours, torch.nn.Conv1d) and list(ours.state_dict()) == list(theirs.state_dict())
    for key, val in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], val), key
    assert ours.state_size == theirs.state_size
    x, res = torch.randn(2, 11, 12), torch.randn(2, 11, 12)
    mask = (torch.rand(2, 11) > 0.3).long()
    y, _ = ours(x, residual=res, mask=mask)
    # nn.Conv1d with W - 1 zeros of padding on each side: its first T outputs are the causal ones
    want = F.silu(torch.nn.Conv1d.forward(ours, (x * mask[..., None]).transpose(1, 2))[..., :11].transpose(1, 2)) + res
    assert_close(y, want, 1e-6, "short conv")
    # the state carries a sequence across calls
    y_all, _ = ours(x)
    y0, state = ours(x[:, :5], output_final_state=True)
    assert state.shape == (2, 12, W) and torch.equal(state, x[:, 5 - W:5].transpose(1, 2))
    y1, _ = ours(x[:, 5:], cache=state)
    assert_close(torch.cat([y0, y1], dim=1), y_all, 1e-6, "short conv with cache")


# ---------------------------------------------------------------------- forward and backward on CPU


@pytest.mark.parametrize("name", list(CFGS))
def test_matches_unfused_oracle(name):
    _, m = pair(fla_layers.GatedDeltaNet, GatedDeltaNet, CFGS[name])
    x = torch.randn(2, 21, m.hidden_size)
    dy = torch.randn(2, 21, m.hidden_size)
    assert_runs_close(run(m, x, dy), run_oracle(m, gdn_oracle, x, dy), 1e-5, name)


def test_grads_reach_every_parameter():
    m = build(GatedDeltaNet, CFGS["odd"])
    x = torch.randn(2, 9, m.hidden_size)
    out, dx, grads = run(m, x, torch.randn(2, 9, m.hidden_size))
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert set(grads) == {n for n, _ in m.named_parameters()}
    for n, g in grads.items():
        assert torch.isfinite(g).all() and g.abs().sum() > 0, n


def check_packed_and_padded(fla_cls, cls, cfg):
    """cu_seqlens and attention_mask runs equal separate per-sequence runs (outputs and gradients)."""
    _, m = pair(fla_cls, cls, cfg)
    D = m.hidden_size
    lens = [5, 0, 1, 9]
    xs = [torch.randn(1, L, D) for L in lens]
    dys = [torch.randn(1, L, D) for L in lens]
    sep = [run(m, x, dy) for x, dy in zip(xs, dys) if x.shape[1] > 0]
    want_out = torch.cat([s[0] for s in sep], dim=1)
    want_dx = torch.cat([s[1] for s in sep], dim=1)
    want_g = {n: sum(s[2][n] for s in sep) for n in sep[0][2]}

    cu = cu_seqlens(lens)
    got = run(m, torch.cat(xs, 1), torch.cat(dys, 1), cu_seqlens=cu)
    assert_runs_close(got, (want_out, want_dx, want_g), 1e-5, "cu_seqlens")

    # padding: left-padded, right-padded and full rows of one batch
    T = 9
    rows = [(3, "left"), (6, "right"), (9, "full")]
    x = torch.randn(len(rows), T, D)
    dy = torch.randn(len(rows), T, D)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    sep = []
    for b, (L, side) in enumerate(rows):
        sl = slice(T - L, T) if side == "left" else slice(0, L)
        mask[b, sl] = 1
        sep.append((sl, run(m, x[b:b + 1, sl], dy[b:b + 1, sl])))
    out, dx, grads = run(m, x, dy, attention_mask=mask)
    pad = mask == 0
    assert torch.equal(out[pad], torch.zeros_like(out[pad])) and torch.equal(dx[pad], torch.zeros_like(dx[pad]))
    for b, (sl, (o_b, dx_b, _)) in enumerate(sep):
        assert_close(out[b:b + 1, sl], o_b, 1e-5, f"masked output row {b}")
        assert_close(dx[b:b + 1, sl], dx_b, 1e-5, f"masked d hidden row {b}")
    for n in grads:
        assert_close(grads[n], sum(s[1][2][n] for s in sep), 1e-5, f"masked d {n}")
    # a mask longer than the input (decoding after a cache): its last T columns count, as in FLA
    longer = torch.cat([torch.zeros(len(rows), 4, dtype=torch.long), mask], dim=1)
    assert torch.equal(run(m, x, dy, attention_mask=longer)[0], out)


@pytest.mark.parametrize("name", ["gva", "no_gate"])
def test_cu_seqlens_and_attention_mask_equal_separate_runs(name):
    check_packed_and_padded(fla_layers.GatedDeltaNet, GatedDeltaNet, CFGS[name])


class DictCache:
    """The cache protocol FLA's layers use: len(), [layer_idx] -> dict, update(..., layer_idx, offset)."""

    def __init__(self):
        self.states: list[dict] = []

    def __len__(self):
        return len(self.states)

    def __getitem__(self, i):
        return self.states[i]

    def update(self, recurrent_state=None, conv_state=None, layer_idx=0, offset=1, **_):
        while len(self.states) <= layer_idx:
            self.states.append({"recurrent_state": None, "conv_state": None})
        if recurrent_state is not None:
            self.states[layer_idx]["recurrent_state"] = recurrent_state
        if conv_state is not None:
            self.states[layer_idx]["conv_state"] = conv_state
        return self.states[layer_idx]


def make_cache(kind):
    if kind == "dict":
        return DictCache()
    models_utils = pytest.importorskip("fla.models.utils", reason="fla.models (needs transformers) does not import")
    return models_utils.Cache()


def check_decode_matches_full(cls, cfg, cache_kind):
    """Prefill with use_cache, then one token at a time; equals one pass over the whole sequence."""
    m = build(cls, dict(cfg, layer_idx=0)).eval()
    B, T0, steps = 2, 7, 4
    x = torch.randn(B, T0 + steps, m.hidden_size)
    with torch.no_grad():
        full = m(x)[0]
        cache = make_cache(cache_kind)
        outs = [m(x[:, :T0], past_key_values=cache, use_cache=True)[0]]
        for t in range(T0, T0 + steps):
            outs.append(m(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
    st = cache[0]
    assert st["recurrent_state"].shape == (B, m.num_v_heads, m.head_v_dim, m.head_k_dim)  # FLA's V-first
    assert st["conv_state"][2].shape == (B, m.value_dim, m.conv_size)  # FLA's [N, D, W]
    assert_close(torch.cat(outs, dim=1), full, 1e-5, "prefill + decode")
    chunked = m.train()(x)[0].detach()  # autograd on: the chunked path
    assert_close(chunked, full, 1e-5, "chunk vs recurrent")


@pytest.mark.parametrize("cache_kind", ["dict", "fla"])
def test_decode_with_cache_matches_full_forward(cache_kind):
    check_decode_matches_full(GatedDeltaNet, CFGS["gva"], cache_kind)


# ---------------------------------------------------------------------- FLA's own layer on CPU


@pytest.fixture
def fla_on_cpu():
    """FLA's layer runs on CPU once its ops are routed through cudnn_train."""
    import cudnn_train.fla as ctf

    ctf.accelerate_fla(["gated_delta_rule", "kda", "causal_conv1d", "rms_norm_gated"])
    try:
        yield ctf
    finally:
        ctf.restore_fla()


FLA_CPU_CASES = [(n, "dense") for n in GATED] + [("gva", "cu_seqlens"), ("no_conv", "cu_seqlens"),
                                                  ("base", "mask"), ("odd", "mask")]


@pytest.mark.parametrize("name, packing", FLA_CPU_CASES)
def test_matches_fla_layer_on_cpu(fla_on_cpu, name, packing):
    theirs, ours = pair(fla_layers.GatedDeltaNet, GatedDeltaNet, CFGS[name])
    D = ours.hidden_size
    if packing == "cu_seqlens":
        x, kw = torch.randn(1, 17, D), dict(cu_seqlens=torch.tensor([0, 6, 7, 17]))
    elif packing == "mask":
        mask = torch.ones(2, 11, dtype=torch.long)
        mask[0, :4] = 0
        x, kw = torch.randn(2, 11, D), dict(attention_mask=mask)
    else:
        x, kw = torch.randn(2, 13, D), {}
    dy = torch.randn(*x.shape)
    assert_runs_close(run(ours, x, dy, **kw), run(theirs, x, dy, **kw), 1e-6, f"{name}/{packing}")
    assert fla_on_cpu.last_path("gated_delta_rule").startswith("cudnn_train:")
    ours.eval()
    theirs.eval()
    with torch.no_grad():  # FLA's inference path: fused_recurrent
        assert_close(ours(x, **kw)[0], theirs(x, **kw)[0], 1e-6, "eval")
    assert fla_on_cpu.last_path("gated_delta_rule").startswith("cudnn_train:")


# ---------------------------------------------------------------------- GPU: against FLA's Triton layer


def gpu_compare(fla_cls, our_cls, cfg, dtype, packing, slack_for):
    import cudnn_train.fla as ctf

    ctf.restore_fla()  # FLA's layer must run FLA's kernels
    dev = "cuda"
    theirs = build(fla_cls, cfg).to(dev)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.startswith("o_norm") or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    theirs = theirs.to(dtype)
    ours = build(our_cls, cfg).to(dev).to(dtype)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ref = build(our_cls, cfg).to(dev)
    ref.load_state_dict({k: v.float() for k, v in theirs.state_dict().items()}, strict=True)
    D = cfg["hidden_size"]
    if packing == "cu_seqlens":
        lens = [1, 63, 64, 65, 7]  # lengths around FLA's chunk size
        x = torch.randn(1, sum(lens), D, device=dev)
        kw = dict(cu_seqlens=cu_seqlens(lens, dev, torch.long))
    elif packing == "mask":
        x = torch.randn(3, 100, D, device=dev)
        mask = torch.ones(3, 100, dtype=torch.long, device=dev)
        mask[0, :37] = 0
        mask[1, 70:] = 0
        kw = dict(attention_mask=mask)
    else:
        x, kw = torch.randn(2, 200, D, device=dev), {}
    dy = torch.randn(*x.shape, device=dev)
    got_f = run(theirs, x.to(dtype), dy, **kw)
    got_o = run(ours, x.to(dtype), dy, **kw)
    with use_backend("torch"):
        want = run(ref, x, dy, **kw)
    checks = [("output", got_o[0], got_f[0], want[0]), ("d hidden_states", got_o[1], got_f[1], want[1])]
    checks += [(f"d {n}", got_o[2][n], got_f[2][n], want[2][n]) for n in want[2]]
    for what, o, f, r in checks:
        e_o, e_f = rel_l2(o, r), rel_l2(f, r)
        slack = slack_for(what)
        assert fla_compat_ok(e_o, e_f, slack), f"{what}: ours {e_o:.3e} vs fla {e_f:.3e} (slack {slack})"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("packing", ["dense", "cu_seqlens", "mask"])
def test_gpu_matches_fla_layer(dtype, packing):
    cfg = dict(hidden_size=256, head_dim=64, num_heads=2, num_v_heads=4, expand_v=2, conv_bias=True)
    gpu_compare(fla_layers.GatedDeltaNet, GatedDeltaNet, cfg, dtype, packing, lambda what: 3.0)


def gpu_decode_interop(fla_cls, our_cls, cfg, dtype, slack):
    """FLA prefills a cache; our layer and FLA's each decode from a copy of it."""
    import cudnn_train.fla as ctf

    models_utils = pytest.importorskip("fla.models.utils", reason="fla.models (transformers) does not import")
    ctf.restore_fla()
    dev = "cuda"
    cfg = dict(cfg, layer_idx=0)
    theirs = build(fla_cls, cfg).to(dev).to(dtype).eval()
    ours = build(our_cls, cfg).to(dev).to(dtype).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ref = build(our_cls, cfg).to(dev).eval()
    ref.load_state_dict({k: v.float() for k, v in theirs.state_dict().items()}, strict=True)
    T0, steps = 37, 3
    x = torch.randn(2, T0 + steps, cfg["hidden_size"], device=dev)
    with torch.no_grad():
        with use_backend("torch"):
            want = ref(x)[0][:, T0:]
        cache = models_utils.Cache()
        theirs(x[:, :T0].to(dtype), past_key_values=cache, use_cache=True)
        cache_ours = copy.deepcopy(cache)
        got_f, got_o = [], []
        for t in range(T0, T0 + steps):
            xt = x[:, t:t + 1].to(dtype)
            got_f.append(theirs(xt, past_key_values=cache, use_cache=True)[0])
            got_o.append(ours(xt, past_key_values=cache_ours, use_cache=True)[0])
    e_o, e_f = rel_l2(torch.cat(got_o, 1), want), rel_l2(torch.cat(got_f, 1), want)
    assert fla_compat_ok(e_o, e_f, slack), f"decode: ours {e_o:.3e} vs fla {e_f:.3e}"


@pytest.mark.gpu
def test_gpu_decode_continues_fla_cache():
    cfg = dict(hidden_size=256, head_dim=64, num_heads=2, num_v_heads=4, expand_v=2)
    gpu_decode_interop(fla_layers.GatedDeltaNet, GatedDeltaNet, cfg, torch.bfloat16, 3.0)

"""fused.kda: reference vs FLA's naive_recurrent_kda (CPU), chunked torch backend vs reference
(CPU), gradcheck, bad input; GPU tier: our op and FLA's Triton chunk_kda vs the float32
reference under the FLA-compat rule (slack 5, 8 for the gate gradients)."""

import pytest
import torch

import cudnn_train
from cudnn_train.fused.gated_delta_rule import fla_original
from cudnn_train.fused.kda import chunk_kda, fused_recurrent_kda, kda_gate, naive_kda_ref
from tests.fused.test_gated_delta_rule import (  # noqa: F401  (_single_thread: autouse fixture)
    GVA,
    T_LIST,
    _single_thread,
    assert_close,
    l2n64,
    leaf,
    make_inputs,
    outputs_and_grads,
    run_gpu_compat,
    split_varlen,
)
from tests.utils import cu_seqlens, rel_l2

fla_naive = pytest.importorskip("fla.ops.kda.naive", reason="FLA 0.6 (the oracle) is not installed")


def fla_kda_oracle(q, k, v, g, beta, initial_state=None, A_log=None, dt_bias=None, *, output_final_state=True,
                   scale=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                   allow_neg_eigval=False, lower_bound=None, safe_gate=False, state_v_first=False, cu_seqlens=None):
    """FLA's naive_recurrent_kda (which has GVA but no flags and no varlen) with each flag's
    preprocessing done here by hand in float64."""
    assert output_final_state
    HV, K = v.shape[2], q.shape[3]
    q64, k64 = (l2n64(q), l2n64(k)) if use_qk_l2norm_in_kernel else (q.double(), k.double())
    g64 = g.double()
    if use_gate_in_kernel:
        x = g64 + (dt_bias.double().view(HV, K) if dt_bias is not None else 0.0)
        if lower_bound is None:
            g64 = -torch.exp(A_log.double())[:, None] * torch.log1p(torch.exp(x))
        else:
            if A_log is not None:
                x = torch.exp(A_log.double())[:, None] * x
            g64 = lower_bound / (1.0 + torch.exp(-x))
    b64 = beta.double()
    if use_beta_sigmoid_in_kernel:
        b64 = (2.0 if allow_neg_eigval else 1.0) / (1.0 + torch.exp(-b64))
    h64 = None
    if initial_state is not None:
        h64 = initial_state.double()
        if state_v_first:
            h64 = h64.transpose(-1, -2)

    def one(q_, k_, v_, g_, b_, h_):
        return fla_naive.naive_recurrent_kda(q_, k_, v_, g_, b_, scale=scale, initial_state=h_, output_final_state=True)

    if cu_seqlens is None:
        o, ht = one(q64, k64, v, g64, b64, h64)
    else:
        o, ht = split_varlen(cu_seqlens.diff().tolist(), [q64, k64, v, g64, b64], h64, one)
    if state_v_first:
        ht = ht.transpose(-1, -2)
    return o, ht


FLAG_SETS = {
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "gate": dict(use_gate_in_kernel=True),
    "gate_no_dt_bias": dict(use_gate_in_kernel=True),
    "lower_bound": dict(use_gate_in_kernel=True, lower_bound=-5.0),
    "lower_bound_no_A_log": dict(use_gate_in_kernel=True, lower_bound=-3.0),
    "safe_gate": dict(use_gate_in_kernel=True, lower_bound=-5.0, safe_gate=True),
    "lower_bound_unused": dict(lower_bound=-1.0),  # without use_gate_in_kernel it changes nothing
    "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "neg_eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "state_v_first": dict(state_v_first=True),
    "scale": dict(scale=0.37),
    "layer": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=True, state_v_first=True),
}


def kda_inputs(flags, name, **kw):
    inp = make_inputs(kda=True, gate=flags.get("use_gate_in_kernel", False), dt_bias=name != "gate_no_dt_bias",
                      beta_logits=flags.get("use_beta_sigmoid_in_kernel", False),
                      state_v_first=flags.get("state_v_first", False),
                      l2norm=flags.get("use_qk_l2norm_in_kernel", False), **kw)
    if name == "lower_bound_no_A_log":
        del inp["A_log"]
    return inp


def check_ref_fla_chunked(inp, chunk_size=64, what="", **flags):
    ref = outputs_and_grads(naive_kda_ref, inp, **flags)
    theirs = outputs_and_grads(fla_kda_oracle, inp, cot=ref[3], **flags)
    assert_close(ref, theirs, what=f"reference vs FLA naive {what}")
    with cudnn_train.use_backend("torch"):
        chunked = outputs_and_grads(chunk_kda, inp, cot=ref[3], chunk_size=chunk_size, **flags)
    assert cudnn_train.last_path("chunk_kda") == "torch:forced"
    assert_close(chunked, ref, what=f"chunked vs reference {what}")


# ------------------------------------------------------------------ CPU tier


@pytest.mark.parametrize("T", T_LIST)
@pytest.mark.parametrize("G", GVA)
def test_matches_fla_naive(T, G):
    check_ref_fla_chunked(make_inputs(B=2, T=T, H=2, G=G, K=32, kda=True), what=f"T={T} G={G}")


@pytest.mark.parametrize("name", list(FLAG_SETS))
def test_flags_match_fla_naive(name):
    flags = FLAG_SETS[name]
    check_ref_fla_chunked(kda_inputs(flags, name, B=2, T=130, H=2, G=2, K=32), what=name, **flags)


@pytest.mark.parametrize("h0,name,chunk_size", [(True, "gate", 64), (False, "layer", 32), (True, "lower_bound", 16)])
def test_varlen_matches_fla_naive(h0, name, chunk_size):
    flags = FLAG_SETS[name]
    lens = [0, 1, 63, 0, 65, 7]
    inp = kda_inputs(flags, name, H=2, G=2, K=32, lens=lens, h0=h0)
    check_ref_fla_chunked(inp, chunk_size, what=f"varlen {name}", cu_seqlens=cu_seqlens(lens, dtype=torch.long), **flags)


@pytest.mark.parametrize("chunk_size", [64, 48, 7])
def test_strong_per_channel_decay_is_stable(chunk_size):
    """Decays of up to e^-30 a token per channel: the chunked form must not overflow."""
    inp = make_inputs(B=1, T=150, H=1, G=2, K=32, kda=True)
    inp["g"] = leaf(-30.0 * torch.rand(1, 150, 2, 32) * (torch.rand(1, 150, 2, 32) < 0.3))
    ours = outputs_and_grads(chunk_kda, inp, chunk_size=chunk_size)
    ref = outputs_and_grads(naive_kda_ref, inp, cot=ours[3])
    assert all(torch.isfinite(t).all() for t in ours[2].values())
    assert_close(ours, ref, what="strong decay")


def test_gate_helper_forms():
    g = torch.randn(3, 2, 4, dtype=torch.float64)
    A, dt = torch.randn(2, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    x = g + dt.view(2, 4)
    assert torch.allclose(kda_gate(g, A, dt), -A.exp()[:, None] * torch.log1p(x.exp()))
    assert torch.allclose(kda_gate(g, A, dt, lower_bound=-5.0), -5.0 * torch.sigmoid(A.exp()[:, None] * x))
    assert torch.allclose(kda_gate(g, None, dt, lower_bound=-2.0), -2.0 * torch.sigmoid(x))
    assert kda_gate(g.float(), A.float()).dtype == torch.float32


@pytest.mark.parametrize("lb", [None, -4.0])
def test_gradcheck(lb):
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 state_v_first=True, lower_bound=lb)
    lens = [0, 1, 3]
    inp = make_inputs(H=1, G=2, K=3, V=2, lens=lens, gate=True, beta_logits=True, state_v_first=True, l2norm=True,
                      kda=True)
    inp = {n: leaf(t.double()) for n, t in inp.items()}
    names = list(inp)

    def f(*ts):
        return chunk_kda(**dict(zip(names, ts)), output_final_state=True, chunk_size=2,
                         cu_seqlens=cu_seqlens(lens, dtype=torch.long), **flags)

    assert torch.autograd.gradcheck(f, tuple(inp[n] for n in names))


def test_fused_recurrent_matches_reference():
    flags = dict(FLAG_SETS["layer"], lower_bound=-5.0)
    lens = [0, 1, 30, 9]
    inp = kda_inputs(flags, "layer", H=2, G=2, K=32, lens=lens)
    cu = cu_seqlens(lens, dtype=torch.long)
    ours = outputs_and_grads(fused_recurrent_kda, inp, cu_seqlens=cu, **flags)
    ref = outputs_and_grads(naive_kda_ref, inp, cot=ours[3], cu_seqlens=cu, **flags)
    assert_close(ours, ref, what="fused_recurrent")
    assert cudnn_train.last_path("fused_recurrent_kda") == "torch:fallback(no GPU)"


def test_half_inputs_on_cpu():
    inp = make_inputs(B=1, T=20, G=2, kda=True, dtype=torch.float16)
    o, ht = chunk_kda(**inp, output_final_state=True)
    assert o.dtype == torch.float16 and ht.dtype == torch.float32
    (o.float().sum() + ht.sum()).backward()
    assert inp["k"].grad.dtype == torch.float16 and inp["initial_state"].grad.dtype == torch.float32


def _bad_cases():
    def base(**kw):
        d = make_inputs(B=1, T=8, H=2, G=2, kda=True)
        d.update(kw)
        return d

    yield "g_shape", base(g=torch.randn(1, 8, 4)), {}, "g"
    yield "v", base(v=torch.randn(1, 8, 3, 16)), {}, "v"
    yield "A_log", base(), dict(use_gate_in_kernel=True), "A_log"
    yield "dt_bias", base(), dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4)), "dt_bias"
    yield "safe_gate", base(), dict(use_gate_in_kernel=True, A_log=torch.zeros(4), safe_gate=True), "lower_bound"
    yield "safe_range", base(), dict(use_gate_in_kernel=True, lower_bound=-6.0, safe_gate=True), "lower_bound"
    yield "lb_type", base(), dict(lower_bound="x"), "lower_bound"
    yield "neg_eig", base(), dict(allow_neg_eigval=True), "allow_neg_eigval"
    yield "cu", base(initial_state=None), dict(cu_seqlens=torch.tensor([0, 9])), "cu_seqlens"
    yield "h0_N", base(initial_state=torch.randn(2, 4, 16, 16)), dict(cu_seqlens=torch.tensor([0, 8])), "initial_state"
    yield "K", base(q=torch.randn(1, 8, 2, 300), k=torch.randn(1, 8, 2, 300), initial_state=None), {}, "q"
    yield "k_dtype", base(k=torch.randn(1, 8, 2, 16).half()), {}, "k"


@pytest.mark.parametrize("case", list(_bad_cases()), ids=lambda c: c[0])
@pytest.mark.parametrize("fn", [chunk_kda, naive_kda_ref], ids=["chunk", "ref"])
def test_bad_input(case, fn):
    _, inp, kwargs, arg = case
    with pytest.raises(ValueError, match=rf"^{arg}"):
        fn(**inp, **kwargs)


# ------------------------------------------------------------------ GPU tier


def _fla_kda(**kw):
    return fla_original("fla.ops.kda.chunk", "chunk_kda")(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["layer", "layer_lower_bound_varlen", "plain_G1"])
def test_gpu_matches_reference_like_fla(dtype, shape):
    pytest.importorskip("fla.ops.kda.chunk")
    lens = None
    if shape == "layer":
        flags = FLAG_SETS["layer"]
    elif shape == "layer_lower_bound_varlen":
        flags, lens = dict(FLAG_SETS["layer"], lower_bound=-5.0, safe_gate=True), [1, 63, 130, 64]
    else:
        flags = {}
    inp = kda_inputs(flags, "layer", B=2, T=256, H=2, G=1 if shape == "plain_G1" else 2, K=64, V=64, lens=lens,
                     dtype=dtype, device="cuda")
    extra = dict(flags)
    if lens is not None:
        extra["cu_seqlens"] = cu_seqlens(lens, "cuda", torch.long)
    run_gpu_compat(chunk_kda, naive_kda_ref, _fla_kda, inp, extra, slack=5.0, slack_grad=8.0)


@pytest.mark.gpu
def test_gpu_torch_backend_empty_and_short_sequences():
    flags = FLAG_SETS["layer"]
    lens = [0, 1, 2, 0, 100]
    inp = kda_inputs(flags, "layer", H=2, G=2, K=64, V=64, lens=lens, dtype=torch.bfloat16, device="cuda")
    extra = dict(flags, cu_seqlens=cu_seqlens(lens, "cuda", torch.long))
    with cudnn_train.use_backend("torch"):
        ours = outputs_and_grads(chunk_kda, inp, **extra)
    ref = outputs_and_grads(naive_kda_ref, {n: leaf(t.float()) for n, t in inp.items()}, cot=ours[3], **extra)
    assert rel_l2(ours[0], ref[0]) <= 1e-2 and rel_l2(ours[1], ref[1]) <= 1e-4
    for n in ref[2]:
        assert rel_l2(ours[2][n], ref[2][n]) <= 1e-2, n

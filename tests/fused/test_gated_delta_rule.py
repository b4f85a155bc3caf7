"""fused.gated_delta_rule: reference vs FLA's naive recurrence (CPU), chunked torch backend vs
reference (CPU), gradcheck, bad input; GPU tier: our op and FLA's Triton op vs the float32
reference under the FLA-compat rule."""


import pytest
import torch
import torch.nn.functional as F

import cudnn_train
from cudnn_train import backend
from cudnn_train.fused.gated_delta_rule import (
    chunk_gated_delta_rule,
    fla_original,
    fused_recurrent_gated_delta_rule,
    naive_gated_delta_rule_ref,
)
from tests.utils import cu_seqlens, fla_compat_ok, rel_l2

fla_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive", reason="FLA 0.6 (the oracle) is not installed")

TOL = 1e-5
T_LIST = [1, 63, 64, 65, 200]
GVA = [1, 2, 4]


# ------------------------------------------------------------------ shared helpers (test_kda imports them)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """These tests run thousands of tiny ops; intra-op threads only add overhead (and thrash on
    a loaded machine). Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def leaf(t):
    return t.detach().requires_grad_(True)


def make_inputs(*, B=2, T=16, H=2, G=1, K=16, V=16, lens=None, h0=True, gate=False, dt_bias=True,
                beta_logits=False, state_v_first=False, l2norm=False, kda=False, dtype=torch.float32,
                device="cpu"):
    """Fresh random leaves. Keys are unit-norm unless the l2norm flag normalizes them."""
    HV = H * G
    if lens is not None:
        B, T = 1, sum(lens)
    N = B if lens is None else len(lens)
    kw = dict(dtype=torch.float32, device=device)
    q = torch.randn(B, T, H, K, **kw)
    k = torch.randn(B, T, H, K, **kw)
    if not l2norm:
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, **kw)
    gshape = (B, T, HV, K) if kda else (B, T, HV)
    out = dict(q=q, k=k, v=v)
    if gate:
        out["g"] = torch.randn(gshape, **kw)
        out["A_log"] = torch.log(torch.empty(HV, **kw).uniform_(0.5, 4.0))
        if dt_bias:
            out["dt_bias"] = 0.5 * torch.randn(HV * K if kda else HV, **kw)
    else:
        out["g"] = F.logsigmoid(torch.randn(gshape, **kw) + 2.0)
    out["beta"] = torch.randn(B, T, HV, **kw) if beta_logits else torch.rand(B, T, HV, **kw)
    if h0:
        out["initial_state"] = 0.5 * torch.randn((N, HV, V, K) if state_v_first else (N, HV, K, V), **kw)
    for name in ("q", "k", "v", "g", "beta"):  # as in the layers: activations in the input dtype
        out[name] = out[name].to(dtype)
    return {n: leaf(t) for n, t in out.items()}



def outputs_and_grads(fn, inputs, cot=None, **kwargs):
    """Run fn(**inputs, output_final_state=True, **kwargs); grads of <o, do> + <ht, dht> on every leaf."""
    o, ht = fn(**inputs, output_final_state=True, **kwargs)
    if cot is None:
        cot = (torch.randn_like(o, dtype=torch.float32), torch.randn_like(ht, dtype=torch.float32))
    loss = (o.float() * cot[0]).sum() + (ht.float() * cot[1]).sum()
    names = list(inputs)
    grads = torch.autograd.grad(loss, [inputs[n] for n in names], allow_unused=True)
    return o, ht, dict(zip(names, grads)), cot


def assert_close(ours, theirs, tol=TOL, what=""):
    o1, h1, g1, _ = ours
    o2, h2, g2, _ = theirs
    assert rel_l2(o1, o2) <= tol, f"{what} o: {rel_l2(o1, o2)}"
    assert rel_l2(h1, h2) <= tol, f"{what} final_state: {rel_l2(h1, h2)}"
    assert set(g1) == set(g2)
    for n in g1:
        assert g1[n] is not None and g2[n] is not None, f"{what} d{n} missing"
        assert rel_l2(g1[n], g2[n]) <= tol, f"{what} d{n}: {rel_l2(g1[n], g2[n])}"


def l2n64(x):
    x = x.double()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def split_varlen(lens, tensors, h0, per_seq):
    """Run an oracle one packed sequence at a time (it has no cu_seqlens); concat o, stack states."""
    outs, finals, start = [], [], 0
    for n, L in enumerate(lens):
        sl = [t[:, start : start + L] for t in tensors]
        o, ht = per_seq(*sl, None if h0 is None else h0[n : n + 1])
        outs.append(o)
        finals.append(ht)
        start += L
    return torch.cat(outs, dim=1), torch.cat(finals, dim=0)


def fla_gdn_oracle(q, k, v, g, beta, initial_state=None, A_log=None, dt_bias=None, *, output_final_state=True,
                   scale=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                   allow_neg_eigval=False, state_v_first=False, cu_seqlens=None):
    """FLA's naive_recurrent_gated_delta_rule with every flag's preprocessing done here by hand
    in float64 (FLA's naive has none of them, nor GVA or varlen)."""
    assert output_final_state
    H, HV = q.shape[2], v.shape[2]
    q64, k64 = (l2n64(q), l2n64(k)) if use_qk_l2norm_in_kernel else (q.double(), k.double())
    q64, k64 = q64.repeat_interleave(HV // H, 2), k64.repeat_interleave(HV // H, 2)
    g64 = g.double()
    if use_gate_in_kernel:
        x = g64 + (dt_bias.double() if dt_bias is not None else 0.0)
        g64 = -torch.exp(A_log.double()) * torch.log1p(torch.exp(x))
    b64 = beta.double()
    if use_beta_sigmoid_in_kernel:
        b64 = (2.0 if allow_neg_eigval else 1.0) / (1.0 + torch.exp(-b64))
    h64 = None
    if initial_state is not None:
        h64 = initial_state.double()
        if state_v_first:
            h64 = h64.transpose(-1, -2)

    def one(q_, k_, v_, b_, g_, h_):
        return fla_naive.naive_recurrent_gated_delta_rule(q_, k_, v_, b_, g_, scale=scale, initial_state=h_,
                                                          output_final_state=True)

    if cu_seqlens is None:
        o, ht = one(q64, k64, v, b64, g64, h64)
    else:
        lens = cu_seqlens.diff().tolist()
        o, ht = split_varlen(lens, [q64, k64, v, b64, g64], h64, one)
    if state_v_first:
        ht = ht.transpose(-1, -2)
    return o, ht


# ------------------------------------------------------------------ CPU tier: reference vs FLA's naive,
# and the chunked torch backend vs the reference (on the same inputs, sharing the reference run)


def check_ref_fla_chunked(inp, chunk_size=64, what="", **flags):
    ref = outputs_and_grads(naive_gated_delta_rule_ref, inp, **flags)
    theirs = outputs_and_grads(fla_gdn_oracle, inp, cot=ref[3], **flags)
    assert_close(ref, theirs, what=f"reference vs FLA naive {what}")
    with cudnn_train.use_backend("torch"):
        chunked = outputs_and_grads(chunk_gated_delta_rule, inp, cot=ref[3], chunk_size=chunk_size, **flags)
    assert cudnn_train.last_path("chunk_gated_delta_rule") == "torch:forced"
    assert_close(chunked, ref, what=f"chunked vs reference {what}")


@pytest.mark.parametrize("T", T_LIST)
@pytest.mark.parametrize("G", GVA)
def test_matches_fla_naive(T, G):
    check_ref_fla_chunked(make_inputs(B=2, T=T, H=2, G=G), what=f"T={T} G={G}")


FLAG_SETS = {
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "gate": dict(use_gate_in_kernel=True),
    "gate_no_dt_bias": dict(use_gate_in_kernel=True),
    "beta_sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "neg_eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "state_v_first": dict(state_v_first=True),
    "scale": dict(scale=0.37),
    "layer": dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                  allow_neg_eigval=True, state_v_first=True),
}


def _inputs_for(flags, name, **kw):
    return make_inputs(gate=flags.get("use_gate_in_kernel", False), dt_bias=name != "gate_no_dt_bias",
                       beta_logits=flags.get("use_beta_sigmoid_in_kernel", False),
                       state_v_first=flags.get("state_v_first", False),
                       l2norm=flags.get("use_qk_l2norm_in_kernel", False), **kw)


@pytest.mark.parametrize("name", list(FLAG_SETS))
def test_flags_match_fla_naive(name):
    flags = FLAG_SETS[name]
    check_ref_fla_chunked(_inputs_for(flags, name, B=2, T=130, H=2, G=2), what=name, **flags)


@pytest.mark.parametrize("h0,name,chunk_size", [(True, "plain", 64), (False, "plain", 16), (True, "layer", 32),
                                                (False, "layer", 64)])
def test_varlen_matches_fla_naive(h0, name, chunk_size):
    flags = FLAG_SETS.get(name, {})
    lens = [0, 1, 63, 0, 65, 7]
    inp = _inputs_for(flags, name, H=2, G=2, lens=lens, h0=h0)
    check_ref_fla_chunked(inp, chunk_size, what=f"varlen {name}", cu_seqlens=cu_seqlens(lens, dtype=torch.long), **flags)


@pytest.mark.parametrize("chunk_size", [16, 32, 5])
def test_chunk_sizes(chunk_size):
    inp = make_inputs(B=1, T=37, H=1, G=2)
    ours = outputs_and_grads(chunk_gated_delta_rule, inp, chunk_size=chunk_size)
    ref = outputs_and_grads(naive_gated_delta_rule_ref, inp, cot=ours[3])
    assert_close(ours, ref, what=f"C={chunk_size}")


def test_varlen_equals_separate_calls():
    """No leakage across sequences: each packed sequence equals its own unpacked call."""
    lens = [5, 0, 1, 9]
    inp = make_inputs(H=1, G=2, lens=lens)
    o, ht = chunk_gated_delta_rule(**inp, output_final_state=True, cu_seqlens=cu_seqlens(lens, dtype=torch.long), chunk_size=4)
    start = 0
    for n, L in enumerate(lens):
        parts = {key: val[:, start : start + L] for key, val in inp.items() if key != "initial_state"}
        o_n, h_n = chunk_gated_delta_rule(**parts, initial_state=inp["initial_state"][n : n + 1],
                                          output_final_state=True, chunk_size=4)
        if L:
            assert rel_l2(o[:, start : start + L], o_n) <= TOL
        else:
            assert o_n.numel() == 0
        assert rel_l2(ht[n : n + 1], h_n) <= TOL
        start += L
    assert torch.equal(ht[1], inp["initial_state"][1].detach())  # an empty sequence keeps its state


def test_no_final_state_and_defaults():
    inp = make_inputs(B=1, T=10, h0=False)
    o, ht = chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"])
    assert ht is None and o.shape == (1, 10, 2, 16) and o.dtype == torch.float32
    o2, ht2 = naive_gated_delta_rule_ref(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], scale=16 ** -0.5,
                                         output_final_state=True)
    assert rel_l2(o, o2) <= TOL and ht2.dtype == torch.float32 and ht2.shape == (1, 2, 16, 16)


def test_cu_seqlens_cpu_copy_and_int32():
    lens = [3, 0, 4]
    inp = make_inputs(H=1, lens=lens)
    cu = cu_seqlens(lens, dtype=torch.long)
    o1, h1 = chunk_gated_delta_rule(**inp, output_final_state=True, cu_seqlens=cu.int(), cu_seqlens_cpu=cu)
    o2, h2 = naive_gated_delta_rule_ref(**inp, output_final_state=True, cu_seqlens=cu)
    assert rel_l2(o1, o2) <= TOL and rel_l2(h1, h2) <= TOL


def test_half_inputs_on_cpu():
    inp = make_inputs(B=1, T=20, G=2, dtype=torch.bfloat16)
    o, ht = chunk_gated_delta_rule(**inp, output_final_state=True)
    assert o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert cudnn_train.last_path("chunk_gated_delta_rule") == "torch:fallback(no GPU)"
    (o.float().sum() + ht.sum()).backward()
    assert inp["q"].grad.dtype == torch.bfloat16 and inp["g"].grad.dtype == torch.bfloat16
    assert inp["initial_state"].grad.dtype == torch.float32
    ref = naive_gated_delta_rule_ref(**{n: t.float() for n, t in inp.items()}, output_final_state=True)
    assert rel_l2(o, ref[0]) <= 1e-2 and rel_l2(ht, ref[1]) <= 1e-5


def test_float64_chunked_matches_reference_tightly():
    inp = {n: leaf(t.double()) for n, t in make_inputs(B=2, T=70, G=2, gate=True, beta_logits=True).items()}
    flags = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
    ours = outputs_and_grads(chunk_gated_delta_rule, inp, chunk_size=16, **flags)
    ref = outputs_and_grads(naive_gated_delta_rule_ref, inp, cot=ours[3], **flags)
    assert ours[0].dtype == torch.float64 and ours[1].dtype == torch.float64
    assert_close(ours, ref, tol=1e-11, what="float64")


# ------------------------------------------------------------------ CPU tier: gradcheck (float64, tiny)


@pytest.mark.parametrize("varlen", [False, True])
def test_gradcheck(varlen):
    flags = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                 allow_neg_eigval=True, state_v_first=True)
    lens = [0, 1, 3] if varlen else None
    inp = make_inputs(B=1, T=4, H=1, G=2, K=3, V=2, lens=lens, gate=True, beta_logits=True, state_v_first=True,
                      l2norm=True)
    inp = {n: leaf(t.double()) for n, t in inp.items()}
    names = list(inp)
    extra = dict(cu_seqlens=cu_seqlens(lens, dtype=torch.long)) if varlen else {}

    def f(*ts):
        o, ht = chunk_gated_delta_rule(**dict(zip(names, ts)), output_final_state=True, chunk_size=2, **flags, **extra)
        return o, ht

    assert torch.autograd.gradcheck(f, tuple(inp[n] for n in names))


def test_gradcheck_reference():
    inp = {n: leaf(t.double()) for n, t in make_inputs(B=1, T=3, H=1, G=2, K=3, V=2).items()}
    names = list(inp)

    def f(*ts):
        return naive_gated_delta_rule_ref(**dict(zip(names, ts)), output_final_state=True)

    assert torch.autograd.gradcheck(f, tuple(inp[n] for n in names))


# ------------------------------------------------------------------ CPU tier: recurrent form


def test_fused_recurrent_matches_reference():
    flags = FLAG_SETS["layer"]
    lens = [0, 1, 30, 9]
    inp = _inputs_for(flags, "layer", H=2, G=2, lens=lens)
    cu = cu_seqlens(lens, dtype=torch.long)
    ours = outputs_and_grads(fused_recurrent_gated_delta_rule, inp, cu_seqlens=cu, **flags)
    ref = outputs_and_grads(naive_gated_delta_rule_ref, inp, cot=ours[3], cu_seqlens=cu, **flags)
    assert_close(ours, ref, what="fused_recurrent")
    assert cudnn_train.last_path("fused_recurrent_gated_delta_rule") == "torch:fallback(no GPU)"


def test_fused_recurrent_gk_matches_fla_naive_kda():
    fla_kda = pytest.importorskip("fla.ops.kda.naive")
    inp = make_inputs(B=2, T=20, H=2, G=2, kda=True)
    inp["gk"] = inp.pop("g")
    ours = outputs_and_grads(fused_recurrent_gated_delta_rule, inp)

    def theirs_fn(q, k, v, gk, beta, initial_state, output_final_state):
        return fla_kda.naive_recurrent_kda(q, k, v, gk, beta, initial_state=initial_state,
                                           output_final_state=output_final_state)

    theirs = outputs_and_grads(theirs_fn, inp, cot=ours[3])
    assert_close(ours, theirs, what="gk")


def test_fused_recurrent_g_and_gk_multiply():
    inp = make_inputs(B=1, T=12, H=1, G=1, kda=True)
    g_head = F.logsigmoid(torch.randn(1, 12, 1) + 2)
    o1, h1 = fused_recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], g=g_head, gk=inp["g"], beta=inp["beta"],
                                              initial_state=inp["initial_state"], output_final_state=True)
    from cudnn_train.fused.kda import naive_kda_ref

    o2, h2 = naive_kda_ref(inp["q"], inp["k"], inp["v"], inp["g"] + g_head[..., None], inp["beta"],
                           initial_state=inp["initial_state"], output_final_state=True)
    assert rel_l2(o1, o2) <= TOL and rel_l2(h1, h2) <= TOL
    o3, _ = fused_recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], g=g_head)  # beta defaults to ones
    o4, _ = naive_gated_delta_rule_ref(inp["q"], inp["k"], inp["v"], g_head, torch.ones(1, 12, 1))
    assert rel_l2(o3, o4) <= TOL


# ------------------------------------------------------------------ CPU tier: bad input


def _bad_cases():
    def base(**kw):
        d = make_inputs(B=2, T=8, H=2, G=2)
        d.update(kw)
        return d

    one = lambda **kw: {**make_inputs(B=1, T=8, H=2, G=1, h0=False), **kw}  # noqa: E731
    yield "v", base(v=torch.randn(2, 8, 3, 16)), "v"  # HV % H != 0
    yield "cu_B", base(initial_state=None), dict(cu_seqlens=torch.tensor([0, 8])), "cu_seqlens"
    yield "cu_order", one(), dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), "cu_seqlens"
    yield "cu_range", one(), dict(cu_seqlens=torch.tensor([0, 4, 9])), "cu_seqlens"
    yield "cu_first", one(), dict(cu_seqlens=torch.tensor([1, 4, 8])), "cu_seqlens"
    yield "cu_float", one(), dict(cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens"
    yield "h0_N", one(initial_state=torch.randn(3, 2, 16, 16)), dict(cu_seqlens=torch.tensor([0, 4, 8])), "initial_state"
    yield "h0_layout", base(initial_state=torch.randn(2, 4, 16, 8)), "initial_state"
    yield "h0_vfirst", base(initial_state=torch.randn(2, 4, 16, 8)), dict(state_v_first=True), "initial_state"
    yield "K", base(q=torch.randn(2, 8, 2, 257), k=torch.randn(2, 8, 2, 257), initial_state=None), "q"
    yield "k_dtype", base(k=torch.randn(2, 8, 2, 16, dtype=torch.float64)), "k"
    yield "v_dtype", base(v=torch.randn(2, 8, 4, 16, dtype=torch.bfloat16)), "v"
    yield "k_shape", base(k=torch.randn(2, 8, 1, 16)), "k"
    yield "g_shape", base(g=torch.randn(2, 8, 2)), "g"
    yield "beta_shape", base(beta=torch.rand(2, 8, 4, 1)), "beta"
    yield "A_log", base(g=torch.randn(2, 8, 4)), dict(use_gate_in_kernel=True), "A_log"
    yield "A_log_n", base(g=torch.randn(2, 8, 4)), dict(use_gate_in_kernel=True, A_log=torch.zeros(3)), "A_log"
    yield "dt_bias_n", base(), dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(5)), "dt_bias"
    yield "neg_eig", base(), dict(allow_neg_eigval=True), "allow_neg_eigval"
    yield "chunk", base(), dict(chunk_size=0), "chunk_size"
    yield "scale", base(), dict(scale=float("nan")), "scale"
    if torch.cuda.is_available():
        yield "device", base(v=torch.randn(2, 8, 4, 16, device="cuda")), "v"


def _bad_params():
    for case in _bad_cases():
        yield pytest.param(case, chunk_gated_delta_rule, id=f"chunk-{case[0]}")
        if case[0] != "chunk":  # the reference has no chunk_size argument
            yield pytest.param(case, naive_gated_delta_rule_ref, id=f"ref-{case[0]}")


@pytest.mark.parametrize("case,fn", list(_bad_params()))
def test_bad_input(case, fn):
    name, inp, *rest = case
    kwargs, arg = (rest[0], rest[1]) if len(rest) == 2 else ({}, rest[0])
    with pytest.raises(ValueError, match=rf"^{arg}"):
        fn(**inp, **kwargs)


def test_fused_recurrent_bad_input():
    inp = make_inputs(B=1, T=4)
    with pytest.raises(ValueError, match="^gv"):
        fused_recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], g=inp["g"], gv=torch.zeros(1, 4, 2, 16))
    with pytest.raises(ValueError, match="^gk"):
        fused_recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"], gk=torch.zeros(1, 4, 2, 3))


def test_fla_backend_declines_on_cpu_without_touching_inputs():
    inp = make_inputs(B=1, T=4)
    with cudnn_train.use_backend("fla"), pytest.raises(backend.Unsupported, match="no GPU"):
        chunk_gated_delta_rule(**inp)


def test_fla_original_sees_through_accelerate_fla_wrappers(monkeypatch):
    chunk_mod = pytest.importorskip("fla.ops.gated_delta_rule.chunk")
    orig = chunk_mod.chunk_gated_delta_rule

    def wrapper(*args, **kwargs):
        return chunk_gated_delta_rule(*args, **kwargs)

    wrapper._cudnn_train_original = orig
    monkeypatch.setattr(chunk_mod, "chunk_gated_delta_rule", wrapper)
    assert fla_original("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule") is orig
    with pytest.raises(backend.Unsupported, match="fla has no"):
        fla_original("fla.ops.gated_delta_rule.chunk", "no_such_function")


def test_call_fla_refuses_reentry():
    from cudnn_train.fused.gated_delta_rule import call_fla

    def reenter(**kw):
        return call_fla(lambda **k: 1)

    with pytest.raises(RuntimeError, match="re-entered"):
        call_fla(reenter)
    assert call_fla(lambda **k: k["x"], x=3) == 3  # the guard is released after an error


# ------------------------------------------------------------------ GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("force", [None, "torch"])
def test_gpu_bad_cu_seqlens_values_are_caught_by_the_backend(force):
    inp = make_inputs(lens=[4, 4], device="cuda")
    bad = torch.tensor([0, 5, 3, 8], device="cuda")
    inp["initial_state"] = leaf(torch.randn(3, 2, 16, 16, device="cuda"))
    with cudnn_train.use_backend(force or "cutedsl,fla,torch"), pytest.raises(ValueError, match="^cu_seqlens"):
        chunk_gated_delta_rule(**inp, cu_seqlens=bad)


def _gpu_case(dtype, *, lens=None, G=2, T=256, flags=None, K=64, V=64):
    flags = FLAG_SETS["layer"] if flags is None else flags
    inp = _inputs_for(flags, "layer", B=2, T=T, H=2, G=G, K=K, V=V, lens=lens, dtype=dtype, device="cuda")
    extra = dict(flags)
    if lens is not None:
        extra["cu_seqlens"] = cu_seqlens(lens, "cuda", torch.long)
    return inp, extra


def _fla_gdn(**kw):
    return fla_original("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule")(**kw)


def _check_compat(ours, peer, ref, slack=3.0, slack_grad=None):
    slack_grad = slack if slack_grad is None else slack_grad
    for what, a, b, c in [("o", ours[0], peer[0], ref[0]), ("final_state", ours[1], peer[1], ref[1])]:
        assert fla_compat_ok(rel_l2(a, c), rel_l2(b, c), slack), f"{what}: ours {rel_l2(a, c)} fla {rel_l2(b, c)}"
    for n in ref[2]:
        s = slack_grad if n in ("g", "A_log", "dt_bias") else slack
        e_ours, e_fla = rel_l2(ours[2][n], ref[2][n]), rel_l2(peer[2][n], ref[2][n])
        assert fla_compat_ok(e_ours, e_fla, s), f"d{n}: ours {e_ours} fla {e_fla}"


def run_gpu_compat(op, ref_fn, fla_fn, inp, extra, slack=3.0, slack_grad=None):
    """ours (default dispatch and forced torch) and FLA vs the float32 reference on float32 copies."""
    ref_inp = {n: leaf(t.float()) for n, t in inp.items()}
    peer = outputs_and_grads(fla_fn, inp, **extra)
    ref = outputs_and_grads(ref_fn, ref_inp, cot=peer[3], **extra)
    ours = outputs_and_grads(op, inp, cot=peer[3], **extra)
    _check_compat(ours, peer, ref, slack, slack_grad)
    with cudnn_train.use_backend("torch"):
        ours_torch = outputs_and_grads(op, inp, cot=peer[3], **extra)
    _check_compat(ours_torch, peer, ref, slack, slack_grad)
    assert ours[0].dtype == inp["q"].dtype and ours[1].dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ["dense", "varlen", "plain_G1"])
def test_gpu_matches_reference_like_fla(dtype, shape):
    pytest.importorskip("fla.ops.gated_delta_rule.chunk")
    if shape == "dense":
        inp, extra = _gpu_case(dtype)
    elif shape == "varlen":
        inp, extra = _gpu_case(dtype, lens=[1, 63, 130, 64])
    else:
        inp, extra = _gpu_case(dtype, G=1, T=200, flags={})
    run_gpu_compat(chunk_gated_delta_rule, naive_gated_delta_rule_ref, _fla_gdn, inp, extra)


@pytest.mark.gpu
def test_gpu_torch_backend_empty_and_short_sequences():
    lens = [0, 1, 2, 0, 100]
    inp, extra = _gpu_case(torch.bfloat16, lens=lens)
    ref_inp = {n: leaf(t.float()) for n, t in inp.items()}
    with cudnn_train.use_backend("torch"):
        ours = outputs_and_grads(chunk_gated_delta_rule, inp, **extra)
    ref = outputs_and_grads(naive_gated_delta_rule_ref, ref_inp, cot=ours[3], **extra)
    assert rel_l2(ours[0], ref[0]) <= 1e-2 and rel_l2(ours[1], ref[1]) <= 1e-4
    for n in ref[2]:
        assert rel_l2(ours[2][n], ref[2][n]) <= 1e-2, n


@pytest.mark.gpu
def test_gpu_fused_recurrent_inference_matches_reference():
    pytest.importorskip("fla.ops.gated_delta_rule.fused_recurrent")
    inp, extra = _gpu_case(torch.bfloat16, T=32)
    with torch.no_grad():
        o, ht = fused_recurrent_gated_delta_rule(**inp, output_final_state=True, **extra)
        ref = naive_gated_delta_rule_ref(**{n: t.float() for n, t in inp.items()}, output_final_state=True, **extra)
    assert cudnn_train.last_path("fused_recurrent_gated_delta_rule").startswith("fla")
    assert rel_l2(o, ref[0]) <= 1e-2 and rel_l2(ht, ref[1]) <= 1e-2

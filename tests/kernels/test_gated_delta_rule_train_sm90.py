"""The SM90 GDN training path (forward kernels, reverse-sweep kernel, stage 3 on its kernel and in
torch) through the op, on the H200: output, final state and every gradient against FLA's float32 naive recurrence
(the oracle, differentiated by autograd) under the FLA-compat rule, FLA's chunk kernels as the
peer. The composition itself is checked on the CPU in tests/fused/test_gdn_train_path.py."""

import os

import pytest
import torch

from tests.kernels.test_gated_delta_rule_sm90 import _check, _inputs, oracle
from tests.utils import cu_seqlens

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

NAMES = ("q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias")


@pytest.fixture(autouse=True, params=["torch", "kernel"])
def opted_in(monkeypatch, request):
    """The training path on, its stage 3 in torch and on the SM90 kernel."""
    monkeypatch.setenv("CUDNN_TRAIN_GDN_SM90_TRAIN", "1")
    monkeypatch.setenv("CUDNN_TRAIN_GDN_SM90_STAGE3", request.param)


def _grads(fn, tensors, do, dht):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    o, ht = fn(*leaves)
    want = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad((o, ht), want, (do.to(o.dtype), dht), allow_unused=True))
    return o.detach(), ht.detach(), [None if t is None else next(grads) for t in leaves]


def _compare(q, k, v, g, beta, h0, cu=None, *, l2norm=True, A_log=None, dt_bias=None, beta_sigmoid=False, neg=False,
             state_v_first=False):
    from cudnn_train import last_path
    from cudnn_train.fused.gated_delta_rule import chunk_gated_delta_rule

    K = q.shape[-1]
    scale = K**-0.5
    gate = A_log is not None
    flags = dict(use_qk_l2norm_in_kernel=l2norm, state_v_first=state_v_first)
    if gate:
        flags.update(use_gate_in_kernel=True)
    if beta_sigmoid:
        flags.update(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    do = torch.randn(*v.shape, device="cuda", dtype=torch.float32)
    N = q.shape[0] if cu is None else cu.numel() - 1
    dht = torch.randn(N, v.shape[2], *((v.shape[3], K) if state_v_first else (K, v.shape[3])), device="cuda")
    inputs = [q, k, v, g, beta, h0, A_log, dt_bias]

    def ours(q_, k_, v_, g_, b_, h_, a_, d_):
        return chunk_gated_delta_rule(q_, k_, v_, g_, b_, scale=scale, initial_state=h_, output_final_state=True,
                                      A_log=a_, dt_bias=d_, cu_seqlens=cu, **flags)

    o, ht, got = _grads(ours, inputs, do, dht)
    assert last_path("chunk_gated_delta_rule") == "cutedsl:sm90-train"

    def ref(q_, k_, v_, g_, b_, h_, a_, d_):
        return oracle(q_, k_, v_, g_, b_, scale, h_, cu, l2norm=l2norm, A_log=a_, dt_bias=d_, beta_sigmoid=beta_sigmoid,
                      neg=neg, state_v_first=state_v_first)

    f32 = [None if t is None else t.float() for t in inputs]
    ref_o, ref_h, want = _grads(ref, f32, do, dht)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        def fla(q_, k_, v_, g_, b_, h_, a_, d_):
            kw = dict(flags)
            if gate:
                kw.update(A_log=a_, dt_bias=d_)
            return fla_chunk(q_, k_, v_, g_, b_, scale=scale, initial_state=h_, output_final_state=True,
                             cu_seqlens=None if cu is None else cu.long(), **kw)

        fo, fh, fg = _grads(fla, inputs, do, dht)
    except Exception as e:  # noqa: BLE001 - the rule then uses its floor alone
        print(f"FLA peer unavailable ({type(e).__name__}: {e}); FLA-compat rule uses its floor")
        fo = fh = None
        fg = [None] * len(inputs)
    _check("o", o.float(), ref_o, None if fo is None else fo.float())
    _check("final_state", ht, ref_h, fh)
    for name, a, b, c in zip(NAMES, got, want, fg):
        if b is None:
            continue
        assert a is not None, f"d{name} missing"
        _check(f"d{name}", a.float(), b, None if c is None else c.float())


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_train_matches_oracle(T, dtype):
    _compare(*_inputs(2, T, 2, 4, 128, 128, dtype))


@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_train_gva(ratio):
    _compare(*_inputs(2, 200, 2, 2 * ratio, 128, 128, torch.bfloat16))


@pytest.mark.parametrize("ratio", [2, 4])
def test_train_gva_group_sum_in_the_stage3_kernel(ratio, monkeypatch):
    """CUDNN_TRAIN_GDN_DCHUNK_GROUP_SUM=1: dq, dk summed over each pair of value heads inside the kernel
    (groups of four: the per-value-head kernel and the sum pass, as without it)."""
    if os.environ["CUDNN_TRAIN_GDN_SM90_STAGE3"] != "kernel":
        pytest.skip("the stage-3 kernel's variant")
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    monkeypatch.setenv("CUDNN_TRAIN_GDN_DCHUNK_GROUP_SUM", "1")
    calls = []
    orig = B3.chunk_grads
    monkeypatch.setattr(B3, "chunk_grads", lambda *a, **kw: calls.append(kw.get("sum_groups")) or orig(*a, **kw))
    _compare(*_inputs(2, 200, 2, 2 * ratio, 128, 128, torch.bfloat16))
    assert calls and all(c == (ratio == 2) for c in calls), f"group sum asked for: {calls}"


@pytest.mark.parametrize("case", ["dense_gva2", "varlen", "gate_no_l2norm", "dense_gva2_recomputed", "dense_gva2_tm",
                                  "varlen_tm", "gate_no_l2norm_tm"])
def test_train_stage3_reads_the_forwards_vn(case, monkeypatch):
    """CUDNN_TRAIN_GDN_DCHUNK_VN_FROM_FWD=1: the training forward keeps vn and the stage-3 kernel reads it
    (``chunk_grads(vn=...)``) instead of recomputing it; =0 (``_recomputed``): it does not; ``_tm``: also
    CUDNN_TRAIN_GDN_DCHUNK_TM_FROM_FWD=1 (both are the defaults), the wy kernel's chunk inverses read instead
    of solved again, else =0; against the oracle and FLA as every case here."""
    if os.environ["CUDNN_TRAIN_GDN_SM90_STAGE3"] != "kernel":
        pytest.skip("the stage-3 kernel's variant")
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3

    keep = not case.endswith("_recomputed")
    with_tm = case.endswith("_tm")
    monkeypatch.setenv("CUDNN_TRAIN_GDN_DCHUNK_VN_FROM_FWD", "1" if keep else "0")
    monkeypatch.setenv("CUDNN_TRAIN_GDN_DCHUNK_TM_FROM_FWD", "1" if with_tm else "0")
    case = case.removesuffix("_tm")
    calls = []
    orig = B3.chunk_grads
    monkeypatch.setattr(B3, "chunk_grads", lambda *a, **kw: calls.append(
        (kw.get("vn") is not None, kw.get("tm") is not None)) or orig(*a, **kw))
    if case == "varlen":
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        _compare(*_inputs(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, nseq=len(lengths)), cu)
    elif case == "gate_no_l2norm":
        q, k, v, g, beta, h0 = _inputs(2, 150, 2, 4, 128, 128, torch.bfloat16, raw_gate=True, beta_logits=True,
                                       l2norm=False)
        A_log = torch.rand(4, device="cuda") * 0.5
        dt_bias = torch.randn(4, device="cuda") * 0.5
        _compare(q, k, v, g, beta, h0, l2norm=False, A_log=A_log, dt_bias=dt_bias, beta_sigmoid=True)
    else:
        _compare(*_inputs(2, 200, 2, 4, 128, 128, torch.bfloat16))
    assert calls and all(c == (keep, with_tm) for c in calls), f"(vn, tm) passed to stage 3: {calls}"


@pytest.mark.parametrize("case", ["dense_gva2", "varlen"])
def test_train_with_w_and_u_formed_in_the_forwards_chain(case, monkeypatch):
    """CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY (the default): the training forward forms w and u in the specialized
    warpgroups' chain (forced here where these small grids would take the split passes: the specialized warpgroups
    at 128 columns, the fused sweep) and keeps no w; the sweep then runs on the forward's Tm and the effective beta
    (spied on); output, final state and every gradient against the oracle and FLA as every case here."""
    if os.environ["CUDNN_TRAIN_GDN_SM90_STAGE3"] != "kernel":
        pytest.skip("with the stage-3 kernel, which reads the forward's vn and Tm")
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    monkeypatch.setattr(F90, "TRAIN_ONFLY", True)
    monkeypatch.setattr(F90, "SPLIT", False)
    monkeypatch.setattr(WS, "VB_MODE", "128")
    monkeypatch.setenv("CUDNN_TRAIN_GDN_SWEEP_SPLIT", "0")
    calls = []
    orig = B90.reverse_sweep
    monkeypatch.setattr(B90, "reverse_sweep", lambda *a, **kw: calls.append(kw.get("beta") is not None)
                        or orig(*a, **kw))
    if case == "varlen":
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        _compare(*_inputs(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, nseq=len(lengths)),
                 cu_seqlens(lengths, "cuda"))
    else:
        _compare(*_inputs(2, 200, 2, 4, 128, 128, torch.bfloat16))
    assert calls == [True], f"the sweep on Tm: {calls}"


@pytest.mark.parametrize("lengths", [[0, 1, 63, 130, 1, 257, 64, 0], [5, 0, 0, 77]])
def test_train_varlen(lengths):
    cu = cu_seqlens(lengths, "cuda")
    _compare(*_inputs(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, nseq=len(lengths)), cu)


@pytest.mark.parametrize("case", ["dense_gva2", "varlen_fp16"])
def test_train_head_dim_64(case):
    """K = V = 64 (served by our kernels by default; stage 3 there on two warpgroups with 64-byte swizzles)."""
    if case == "dense_gva2":
        _compare(*_inputs(2, 200, 2, 4, 64, 64, torch.bfloat16))
    else:
        lengths = [0, 1, 63, 130, 1, 257, 64, 0]
        cu = cu_seqlens(lengths, "cuda")
        _compare(*_inputs(1, sum(lengths), 2, 4, 64, 64, torch.float16, nseq=len(lengths)), cu)


@pytest.mark.parametrize("neg", [False, True])
def test_train_in_kernel_gate_and_beta(neg):
    q, k, v, g, beta, h0 = _inputs(2, 150, 2, 4, 128, 128, torch.bfloat16, raw_gate=True, beta_logits=True)
    A_log = torch.rand(4, device="cuda") * 0.5
    dt_bias = torch.randn(4, device="cuda") * 0.5
    _compare(q, k, v, g, beta, h0, A_log=A_log, dt_bias=dt_bias, beta_sigmoid=True, neg=neg)


@pytest.mark.parametrize("state_v_first", [False, True])
def test_train_state_layouts_and_no_l2norm(state_v_first):
    q, k, v, g, beta, h0 = _inputs(2, 130, 1, 2, 128, 128, torch.bfloat16, l2norm=False, state_v_first=state_v_first)
    _compare(q, k, v, g, beta, h0, l2norm=False, state_v_first=state_v_first)


def test_train_backward_is_bitwise_reproducible():
    from cudnn_train.fused.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, g, beta, h0 = _inputs(2, 777, 2, 4, 128, 128, torch.bfloat16)
    do = torch.randn_like(v)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta, h0)]
        o, _ = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], use_qk_l2norm_in_kernel=True)
        runs.append(torch.autograd.grad(o, leaves, do))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_train_varlen_forward_backward_replays_in_a_cuda_graph():
    from cudnn_train.fused.gated_delta_rule import chunk_gated_delta_rule

    lengths = [3, 0, 200, 64, 1]
    cu = cu_seqlens(lengths, "cuda")
    q, k, v, g, beta, h0 = _inputs(1, sum(lengths), 2, 4, 128, 128, torch.bfloat16, nseq=len(lengths))
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    do = torch.randn_like(v)

    def step():
        o, _ = chunk_gated_delta_rule(*leaves, initial_state=h0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        return torch.autograd.grad(o, leaves, do)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)

"""fused.delta_rule_bwd: the explicit stage-wise backward (the GDN backward kernels' specification) vs autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cudnn_train.fused.delta_rule_bwd import chunked_core_bwd
from cudnn_train.fused.gated_delta_rule import chunked_core, recurrent_core
from tests.utils import rel_l2

NAMES = ("q", "k", "v", "g", "beta", "S0")


def _inputs(B, T, HV, K, V, dtype):
    return [
        torch.randn(B, T, HV, K, dtype=dtype),
        F.normalize(torch.randn(B, T, HV, K, dtype=dtype), dim=-1),
        torch.randn(B, T, HV, V, dtype=dtype),
        F.logsigmoid(torch.randn(B, T, HV, 1, dtype=dtype)),
        torch.rand(B, T, HV, dtype=dtype),
        torch.randn(B, HV, K, V, dtype=dtype),
    ]


def _autograd(core, inputs, do, dS, scale, *extra):
    leaves = [t.clone().requires_grad_() for t in inputs]
    q, k, v, g, beta, S0 = leaves
    o, S = core(q, k, v, g, beta, scale, S0, *extra)
    return torch.autograd.grad((o, S), leaves, (do, dS))


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("C", [16, 64])
def test_matches_autograd_of_the_chunked_forward(dtype, tol, T, C):
    inputs = _inputs(2, T, 3, 16, 8, dtype)
    do = torch.randn(2, T, 3, 8, dtype=dtype)
    dS = torch.randn(2, 3, 16, 8, dtype=dtype)
    want = _autograd(chunked_core, inputs, do, dS, 0.25, C)
    got = chunked_core_bwd(*inputs[:5], 0.25, inputs[5], do, dS, C)
    for name, a, b in zip(NAMES, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_l2(a, b) <= tol, (name, rel_l2(a, b))


def test_matches_the_token_by_token_oracle_and_strong_decay():
    # strong decay (g down to about -8 per token) and a large state: the float64 gate path holds
    inputs = _inputs(1, 130, 2, 16, 16, torch.float64)
    inputs[3] = inputs[3] * 8
    do = torch.randn(1, 130, 2, 16, dtype=torch.float64)
    dS = torch.randn(1, 2, 16, 16, dtype=torch.float64)
    want = _autograd(recurrent_core, inputs, do, dS, 0.5)
    got = chunked_core_bwd(*inputs[:5], 0.5, inputs[5], do, dS, 64)
    for name, a, b in zip(NAMES, got, want):
        assert rel_l2(a, b) <= 1e-10, (name, rel_l2(a, b))


def test_empty_sequence_passes_the_state_gradient_through():
    inputs = _inputs(2, 0, 3, 16, 8, torch.float32)
    dS = torch.randn(2, 3, 16, 8)
    got = chunked_core_bwd(*inputs[:5], 0.25, inputs[5], torch.zeros(2, 0, 3, 8), dS, 64)
    assert all(t.numel() == 0 for t in got[:5]) and torch.equal(got[5], dS)


def test_reverse_sweep_stage_alone_gives_the_initial_state_gradient():
    from cudnn_train.fused.delta_rule_bwd import reverse_sweep_ref

    inputs = _inputs(2, 150, 3, 16, 8, torch.float64)
    do = torch.randn(2, 150, 3, 8, dtype=torch.float64)
    dS = torch.randn(2, 3, 16, 8, dtype=torch.float64)
    want = _autograd(chunked_core, inputs, do, dS, 0.25, 64)
    q, k, _, g, beta, _ = inputs
    dvn, dH, dS0 = reverse_sweep_ref(q, k, g, beta, 0.25, do, dS, 64)
    assert dvn.shape == do.shape and dH.shape == (2, 3, 3, 16, 8)
    assert torch.equal(dH[:, :, -1], dS)  # the last chunk's leaving-state gradient is the final state's
    assert rel_l2(dS0, want[5]) <= 1e-12


def _kernel_algebra(q, k, v, gc, b, scale, Sc, dH, dvn, do):
    """Stage 3 in the order and form the SM90 chunk-gradient kernel computes it
    (``kernels/gated_delta_rule_bwd_chunk_sm90.py``), one chunk of [C, *] tensors."""
    C = q.shape[0]
    lower = torch.ones(C, C, dtype=torch.bool).tril()
    strict = lower.tril(-1)
    Ediff = gc[:, None] - gc[None, :]
    E = torch.where(lower, Ediff.exp(), torch.zeros(()).to(q))
    Es = E * strict
    eg, glast = gc.exp(), gc[-1]
    Ae = (k @ k.T) * Es
    A = b[:, None] * Ae
    Tm = torch.linalg.inv(torch.eye(C, dtype=q.dtype) + A)
    Z = b[:, None] * v - (b * eg)[:, None] * (k @ Sc)
    vn = Tm @ Z
    QK = q @ k.T
    dP = do @ vn.T
    dQK = scale * dP * E
    pair = dQK * QK  # dP * P
    dqg = (do @ Sc.T) * (scale * eg)[:, None]
    dgc = (dqg * q).sum(-1)
    dq = dqg + dQK @ k
    dw = -(dvn @ Sc.T)
    tail_s = (Sc * dH).sum()
    dk = (vn @ dH.T) * (glast - gc).exp()[:, None]
    kdt = (dk * k).sum(-1)
    dk = dk + dQK.T @ q
    dkb = Tm.T @ dw
    dk = dk + (b * eg)[:, None] * dkb
    dbeta = (dkb * k * eg[:, None]).sum(-1)
    dgc = dgc + b * (dkb * k * eg[:, None]).sum(-1)
    dvb = Tm.T @ dvn
    dbeta = dbeta + (dvb * v).sum(-1)
    dv = b[:, None] * dvb
    dTm = (dw @ k.T) * (b * eg)[None, :] + (dvn @ v.T) * b[None, :]
    dA = -(Tm.T @ dTm @ Tm.T) * strict
    dbeta = dbeta + (dA * Ae).sum(-1)
    pair = pair + b[:, None] * dA * Ae
    dKK = b[:, None] * dA * Es
    dk = dk + (dKK + dKK.T) @ k
    dgc = dgc + pair.sum(-1) - pair.sum(-2) - kdt
    dgc[-1] = dgc[-1] + kdt.sum() + tail_s * glast.exp()
    dg = dgc.flip(0).cumsum(0).flip(0)
    return dq, dk, dv, dg, dbeta


@pytest.mark.parametrize("length", [64, 37, 1])
def test_the_chunk_gradient_kernels_algebra_matches_chunk_grads(length):
    """The SM90 stage-3 kernel regroups stage 3 (vn from Z, dTm from two products, dKK + dKK^T,
    dgc from row and pair sums): the same numbers as ``chunk_grads``, padded rows included."""
    from cudnn_train.fused.delta_rule_bwd import _recompute, chunk_grads

    torch.manual_seed(3)
    C, K, V, dt = 64, 16, 8, torch.float64
    pad = torch.arange(C) < length
    q = torch.randn(C, K, dtype=dt) * pad[:, None]
    k = F.normalize(torch.randn(C, K, dtype=dt), dim=-1) * pad[:, None]
    v = torch.randn(C, V, dtype=dt) * pad[:, None]
    g = F.logsigmoid(torch.randn(C, dtype=dt)) * pad
    b = torch.rand(C, dtype=dt) * pad
    do = torch.randn(C, V, dtype=dt) * pad[:, None]
    dvn = torch.randn(C, V, dtype=dt) * pad[:, None]
    Sc, dH = torch.randn(K, V, dtype=dt), torch.randn(K, V, dtype=dt)
    one = lambda x: x.reshape(1, 1, 1, *x.shape)  # noqa: E731
    r = _recompute(one(q), one(k), one(v), one(g[:, None]), one(b[:, None]), 0.3, C)
    want = chunk_grads(one(q), one(k), one(v), one(b[:, None]), one(Sc), one(dH), one(dvn), one(do), r)
    got = _kernel_algebra(q, k, v, g.cumsum(0), b, 0.3, Sc, dH, dvn, do)
    for name, a, w in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        w = w.reshape(a.shape)
        assert rel_l2(a, w) <= 1e-12, (name, rel_l2(a, w))

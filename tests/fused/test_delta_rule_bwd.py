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

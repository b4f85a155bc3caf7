"""layers.SwiGLUMLP: parameters and state_dict of FLA's GatedMLP, values vs float64 math (CPU); vs FLA (GPU)."""

import pytest
import torch

import cudnn_train
from cudnn_train.layers.mlp import SwiGLUMLP
from tests.utils import rel_l2


def oracle64(x, wg, wu, wd):
    x, wg, wu, wd = x.double(), wg.double(), wu.double(), wd.double()
    g, u = x @ wg.t(), x @ wu.t()
    return (g * torch.sigmoid(g) * u) @ wd.t()


@pytest.mark.parametrize("recompute", [False, True])
def test_forward_and_backward_match_float64_math(recompute):
    m = SwiGLUMLP(24, 40, recompute=recompute)
    x = torch.randn(3, 5, 24, requires_grad=True)
    dy = torch.randn(3, 5, 24)
    y = m(x)
    assert y.shape == x.shape
    params = (m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
    grads = torch.autograd.grad(y, (x, *params), dy)
    x64 = x.detach().double().requires_grad_()
    p64 = [p.detach().double().requires_grad_() for p in params]
    ref = oracle64(x64, *p64)
    ref_grads = torch.autograd.grad(ref, (x64, *p64), dy.double())
    assert rel_l2(y, ref) <= 1e-6
    for a, b in zip(grads, ref_grads):
        assert rel_l2(a, b) <= 1e-6
    assert cudnn_train.last_path("swiglu_mlp_bwd") is not None


def test_parameters_names_shapes_and_repr():
    m = SwiGLUMLP(16, 48, dtype=torch.float64)
    sd = m.state_dict()
    assert list(sd) == ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    assert sd["gate_proj.weight"].shape == (48, 16) and sd["up_proj.weight"].shape == (48, 16)
    assert sd["down_proj.weight"].shape == (16, 48)
    assert all(t.dtype == torch.float64 for t in sd.values())
    assert m.intermediate_size == 48 and "ffn_hidden_size=48" in repr(m)
    # nn.Linear's init: bound 1/sqrt(fan_in), not zeros
    assert 0 < m.gate_proj.weight.abs().max() <= 16**-0.5 and 0 < m.down_proj.weight.abs().max() <= 48**-0.5


def test_loads_fla_gated_mlp_state_dict_and_matches_its_math():
    fla_mlp = pytest.importorskip("fla.modules.mlp")
    theirs = fla_mlp.GatedMLP(hidden_size=32, intermediate_size=64, hidden_act="swish")
    ours = SwiGLUMLP(32, 64)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(ours, name).weight, getattr(theirs, name).weight)
    # FLA's forward needs Triton (no CPU driver): compare with its own projections and torch's silu
    x = torch.randn(2, 7, 32)
    theirs_math = theirs.down_proj(torch.nn.functional.silu(theirs.gate_proj(x)) * theirs.up_proj(x))
    assert rel_l2(ours(x), theirs_math) <= 1e-6


def test_recompute_equal_and_extra_kwargs_ignored():
    a = SwiGLUMLP(16, 32)
    b = SwiGLUMLP(16, 32, recompute=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(9, 16)
    ya, yb = a(x), b(x, attention_mask=None)
    assert torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa.grad, pb.grad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(hidden_size=0, ffn_hidden_size=8), "hidden_size"),
        (dict(hidden_size=8, ffn_hidden_size=-1), "ffn_hidden_size"),
        (dict(hidden_size=8.0, ffn_hidden_size=8), "hidden_size"),
        (dict(hidden_size=8, ffn_hidden_size=8, bias=True), "bias"),
        (dict(hidden_size=8, ffn_hidden_size=8, recompute="yes"), "recompute"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SwiGLUMLP(**kwargs)


def test_bad_input_shape_names_x():
    with pytest.raises(ValueError, match="w_gate: expected shape"):
        SwiGLUMLP(8, 16)(torch.randn(3, 9))


# ------------------------------------------------------------------ GPU tier


@pytest.mark.gpu
def test_gpu_matches_fla_gated_mlp_bf16():
    fla_mlp = pytest.importorskip("fla.modules.mlp")
    theirs = fla_mlp.GatedMLP(hidden_size=512, intermediate_size=1536, hidden_act="swish").cuda()
    ours = SwiGLUMLP(512, 1536, device="cuda")
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(4, 257, 512, device="cuda")
    dy = torch.randn(4, 257, 512, device="cuda")
    p64 = [getattr(ours, n).weight.detach().double().requires_grad_() for n in ("gate_proj", "up_proj", "down_proj")]
    ref = oracle64(x, *p64)
    ref_grads = torch.autograd.grad(ref, p64, dy.double())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = ours(x)
        y_fla = theirs(x)
    assert y.dtype == torch.bfloat16
    err, err_fla = rel_l2(y, ref), rel_l2(y_fla, ref)
    assert err <= max(2e-3, 1.25 * err_fla), (err, err_fla)
    y.backward(dy.to(y.dtype))
    y_fla.backward(dy.to(y_fla.dtype))
    for name, r in zip(("gate_proj", "up_proj", "down_proj"), ref_grads):
        g, g_fla = getattr(ours, name).weight.grad, getattr(theirs, name).weight.grad
        assert g.dtype == torch.float32
        err, err_fla = rel_l2(g, r), rel_l2(g_fla, r)
        assert err <= max(2e-3, 1.25 * err_fla), (name, err, err_fla)

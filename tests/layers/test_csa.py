"""layers.CSACompressor vs a float64 oracle: projections, per-block pooling, RMSNorm, complex RoPE."""

import pytest
import torch

from cudnn_train.layers.csa import CSACompressor
from tests.fused.test_csa import oracle64 as compress_oracle64
from tests.utils import rel_l2


def layer_oracle64(m, x, cu, theta):
    """DeepSeek-style: project, pool each block, RMSNorm with weight, rotate pairs as complex numbers."""
    x = x.double()
    kv = x @ m.wkv.weight.double().t()
    score = x @ m.wgate.weight.double().t()
    comp = compress_oracle64(kv, score, m.ape.double(), cu, m.ratio, m.coff)
    y = comp / torch.sqrt(comp.pow(2).mean(-1, keepdim=True) + m.eps) * m.norm.weight.double()
    if m.rope_dim == 0:
        return y
    # position of compressed row b of a sequence: b * ratio
    cu_l = [int(c) for c in cu]
    pos = [b * m.ratio for a, e in zip(cu_l, cu_l[1:]) for b in range((e - a) // m.ratio)]
    pos = torch.tensor(pos, dtype=torch.float64)
    r = m.rope_dim
    freqs = 1.0 / theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    rot = torch.polar(torch.ones(len(pos), r // 2, dtype=torch.float64), torch.outer(pos, freqs))
    tail = torch.view_as_complex(y[:, -r:].reshape(-1, r // 2, 2).contiguous()) * rot
    return torch.cat([y[:, :-r], torch.view_as_real(tail).reshape(-1, r)], dim=-1)


def _module(hidden, head_dim, ratio, coff, rope_dim, theta=10000.0):
    m = CSACompressor(hidden, head_dim, ratio, coff, rope_dim, rope_theta=theta).double()
    with torch.no_grad():
        m.ape.normal_()
        m.norm.weight.normal_(1.0, 0.3)
    return m


@pytest.mark.parametrize("coff, ratio, rope_dim", [(2, 4, 4), (1, 3, 6), (2, 1, 0), (1, 128, 2)])
def test_layer_matches_float64_oracle(coff, ratio, rope_dim):
    m = _module(12, 8, ratio, coff, rope_dim, theta=500.0)
    cu_list = [0, 0, 2, 19, 20, 31] if ratio != 128 else [0, 100, 390]
    cu = torch.tensor(cu_list)
    x = torch.randn(cu_list[-1], 12, dtype=torch.float64, requires_grad=True)
    out, cu_comp = m(x, cu)
    ref = layer_oracle64(m, x, cu, 500.0)
    assert out.shape == ref.shape
    assert cu_comp.tolist() == [0] + torch.tensor([(b - a) // ratio for a, b in zip(cu_list, cu_list[1:])]).cumsum(0).tolist()
    assert rel_l2(out, ref) <= 1e-6
    dout = torch.randn_like(ref)
    leaves = (x, m.wkv.weight, m.wgate.weight, m.ape, m.norm.weight)
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, leaves, dout)):
        assert rel_l2(a, b) <= 1e-6


def test_batched_input_matches_packed():
    m = _module(16, 8, 4, 2, 4)
    x = torch.randn(3, 10, 16, dtype=torch.float64)
    out, cu_comp = m(x)
    assert out.shape == (3, 2, 8)
    packed, cu_comp_p = m(x.reshape(30, 16), torch.tensor([0, 10, 20, 30]))
    assert torch.equal(cu_comp, cu_comp_p)
    assert rel_l2(out.reshape(6, 8), packed) <= 1e-12


def test_float32_module_and_bfloat16_input_dtypes():
    m = CSACompressor(16, 8, 4, 2, 4)
    x = torch.randn(2, 9, 16)
    out, _ = m(x)
    assert out.dtype == torch.float32 and out.shape == (2, 2, 8)
    mb = CSACompressor(16, 8, 4, 2, 4, dtype=torch.bfloat16)
    outb, _ = mb(x.bfloat16())
    assert outb.dtype == torch.bfloat16
    outb.float().sum().backward()
    assert mb.ape.grad is not None and mb.wkv.weight.grad.dtype == torch.bfloat16


def test_state_dict_and_repr():
    m = CSACompressor(32, 16, 4, 2, 8)
    assert sorted(m.state_dict()) == ["ape", "norm.weight", "wgate.weight", "wkv.weight"]
    assert m.wkv.weight.shape == (32, 32) and m.ape.shape == (4, 32) and m.norm.weight.shape == (16,)
    assert "ratio=4" in repr(m) and "coff=2" in repr(m)


def test_torch_compile_layer_traces_without_graph_breaks():
    m = _module(8, 4, 2, 2, 2).float()
    x = torch.randn(2, 6, 8, requires_grad=True)
    compiled = torch.compile(lambda x: m(x)[0].square().sum(), fullgraph=True, backend="aot_eager")
    out = compiled(x)
    (gx,) = torch.autograd.grad(out, (x,))
    ref = m(x)[0].square().sum()
    (rx,) = torch.autograd.grad(ref, (x,))
    assert torch.allclose(out, ref) and torch.allclose(gx, rx)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ratio=0), "ratio"),
        (dict(coff=3), "coff"),
        (dict(rope_dim=3), "rope_dim"),
        (dict(rope_dim=10), "rope_dim"),
        (dict(head_dim=0), "head_dim"),
        (dict(hidden_size=-1), "hidden_size"),
        (dict(rope_theta=0.0), "rope_theta"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    args = dict(hidden_size=8, head_dim=8, ratio=4, coff=2, rope_dim=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CSACompressor(**args)


def test_bad_forward_arguments():
    m = CSACompressor(8, 4, 2, 1, 2)
    with pytest.raises(ValueError, match="x: expected last dim hidden_size=8"):
        m(torch.randn(4, 7), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens: required"):
        m(torch.randn(4, 8))
    with pytest.raises(ValueError, match="cu_seqlens: only for packed"):
        m(torch.randn(1, 4, 8), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens: must end"):
        m(torch.randn(4, 8), torch.tensor([0, 3]))


# ------------------------------------------------------------------ GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("coff, ratio", [(2, 4), (1, 128)])
def test_layer_on_cuda_matches_cpu_float64(coff, ratio):
    m = _module(64, 128, ratio, coff, 64)
    cu_list = [0, 3, 3 + 9 * ratio + 1, 3 + 12 * ratio]
    cu = torch.tensor(cu_list)
    x = torch.randn(cu_list[-1], 64, dtype=torch.float64)
    ref, _ = m(x, cu)
    mc = _module(64, 128, ratio, coff, 64).float().cuda()
    mc.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    out, cu_comp = mc(x.float().cuda(), cu.cuda())
    assert cu_comp.device.type == "cuda"
    assert rel_l2(out.cpu(), ref) <= 1e-5

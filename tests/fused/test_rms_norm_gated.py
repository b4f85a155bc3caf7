"""fused.rms_norm_gated: reference vs oracles (CPU), kernels compiled for sm_90a (CPU), kernels vs reference (GPU)."""

import pytest
import torch

import cudnn_train
from cudnn_train.fused.rms_norm_gated import rms_norm_gated, rms_norm_gated_ref
from cudnn_train.layers import RMSNormGated
from tests.utils import fla_compat_ok, rel_l2


def oracle64(x, g, w, eps, act):
    """Direct float64 math, written independently of the package."""
    x, g = x.double(), g.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.double()
    return y * (g * torch.sigmoid(g) if act in ("swish", "silu") else torch.sigmoid(g))


# ------------------------------------------------------------------ CPU tier


@pytest.mark.parametrize("act", ["swish", "silu", "sigmoid"])
@pytest.mark.parametrize("affine", [True, False])
def test_reference_matches_float64_oracle(act, affine):
    x = torch.randn(3, 7, 64)
    g = torch.randn(3, 7, 64)
    w = torch.randn(64) if affine else None
    out = rms_norm_gated(x, g, w, eps=1e-5, activation=act)
    ref = oracle64(x, g, w, 1e-5, act)
    assert rel_l2(out, ref) <= 1e-6
    assert rel_l2(rms_norm_gated_ref(x, g, w, 1e-5, act), ref) <= 1e-6


def test_reference_matches_fla_rms_norm_ref():
    fla_norm = pytest.importorskip("fla.modules.norm.layernorm_gated")
    x, g, w = torch.randn(5, 128), torch.randn(5, 128), torch.randn(128)
    theirs = fla_norm.rms_norm_ref(x, w, None, z=g, eps=1e-6, norm_before_gate=True)
    assert rel_l2(rms_norm_gated(x, g, w, eps=1e-6), theirs) <= 1e-6


@pytest.mark.parametrize("act", ["swish", "sigmoid"])
def test_backward_matches_autograd_of_oracle(act):
    x = torch.randn(4, 33, 96, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x, requires_grad=True)
    w = torch.randn(96, dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    grads = torch.autograd.grad(rms_norm_gated(x, g, w, 1e-5, act), (x, g, w), dy)
    refs = torch.autograd.grad(oracle64(x, g, w, 1e-5, act), (x, g, w), dy)
    for a, b in zip(grads, refs):
        assert rel_l2(a, b) <= 1e-10


@pytest.mark.parametrize("act", ["swish", "sigmoid"])
def test_gradcheck(act):
    x = torch.randn(3, 2, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn_like(x, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: rms_norm_gated(a, b, c, 1e-5, act), (x, g, w))
    assert torch.autograd.gradcheck(lambda a, b: rms_norm_gated(a, b, None, 1e-5, act), (x, g))


def test_half_inputs_keep_dtype_and_path_on_cpu():
    x = torch.randn(6, 64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(6, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    y = rms_norm_gated(x, g, w)
    assert y.dtype == torch.bfloat16
    expect = "tensor on cpu" if torch.cuda.is_available() else "no GPU"
    assert cudnn_train.last_path("rms_norm_gated") == f"torch:fallback({expect})"
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and g.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert rel_l2(y, oracle64(x, g, w, 1e-5, "swish")) <= 1e-2


def test_non_contiguous_inputs():
    base = torch.randn(8, 2, 64)
    x = base[:, 0]  # rows strided by 128
    g = torch.randn(64, 8).t()  # inner stride != 1
    out = rms_norm_gated(x, g, None)
    assert rel_l2(out, oracle64(x, g, None, 1e-5, "swish")) <= 1e-6


def test_empty_rows():
    x = torch.randn(0, 64, requires_grad=True)
    g = torch.randn(0, 64, requires_grad=True)
    y = rms_norm_gated(x, g, torch.ones(64))
    assert y.shape == (0, 64)
    y.sum().backward()
    assert x.grad.shape == (0, 64)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=torch.randn(4, 8), gate=torch.randn(4, 9)), "gate: expected the shape"),
        (dict(x=torch.randn(4, 8), gate=torch.randn(4, 8, dtype=torch.float64)), "gate: expected x's dtype"),
        (dict(x=torch.randn(4, 8).int(), gate=torch.randn(4, 8).int()), "x: dtype int32"),
        (dict(x=torch.randn(4, 8), gate=torch.randn(4, 8), weight=torch.randn(9)), r"weight: expected shape \(8,\)"),
        (dict(x=torch.randn(4, 8), gate=torch.randn(4, 8), weight=torch.randn(2, 4)), "weight: expected rank 1"),
        (dict(x=torch.randn(4, 8), gate=torch.randn(4, 8), activation="relu"), "activation"),
        (dict(x=torch.randn(4, 8), gate=torch.randn(4, 8), eps=-1.0), "eps"),
        (dict(x=torch.randn(4, 0), gate=torch.randn(4, 0)), "x: the last dim"),
        (dict(x=torch.randn(4, 8), gate=torch.randn(4, 8), weight=torch.randn(8, device="meta")), "weight: is on meta"),
        (dict(x=[1.0], gate=torch.randn(1)), "x: expected a torch.Tensor"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rms_norm_gated(**kwargs)


def test_module_matches_fla_state_dict_and_repr():
    m = RMSNormGated(64, eps=1e-6)
    assert list(m.state_dict()) == ["weight"] and torch.equal(m.weight.data, torch.ones(64))
    fla_norm = pytest.importorskip("fla.modules.norm.fused_norm_gate")
    theirs = fla_norm.FusedRMSNormGated(64, eps=1e-6)
    theirs.weight.data.normal_()
    m.load_state_dict(theirs.state_dict(), strict=True)
    assert torch.equal(m.weight, theirs.weight)
    assert RMSNormGated(8, elementwise_affine=False).weight is None
    with pytest.raises(ValueError, match="activation"):
        RMSNormGated(8, activation="gelu")


def test_torch_compile_traces_without_graph_breaks():
    x = torch.randn(4, 32, requires_grad=True)
    g = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)

    def f(x, g, w):
        return rms_norm_gated(x, g, w).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out = compiled(x, g, w)
    out.backward()
    gx = x.grad.clone()
    x.grad = None
    f(x, g, w).backward()
    assert torch.allclose(out, f(x, g, w)) and torch.allclose(gx, x.grad)


# ------------------------------------------------------------------ compile tier (CPU, sm_90a)


@pytest.mark.compile
@pytest.mark.parametrize(
    "dtype, wdtype, d, act",
    [(torch.bfloat16, torch.float32, 256, "swish"), (torch.float16, None, 64, "sigmoid")],
)
def test_kernels_compile_for_sm90a(tmp_path, monkeypatch, dtype, wdtype, d, act):
    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels import rms_norm_gated_sm90 as k

    monkeypatch.setenv("CUDNN_TRAIN_CACHE_DIR", str(tmp_path))
    if not torch.cuda.is_available():
        assert kc.target_arch() == "sm_90a"
    kc.clear_memory_cache()
    for kind in ("fwd", "bwd"):
        fn = k.get_compiled(kind, dtype, wdtype, d, act)
        assert callable(fn)
    objs = sorted(p.name for p in tmp_path.rglob("*.o"))
    assert len(objs) == 2, objs
    # a second process would load them from disk: drop the memory cache and reload
    kc.clear_memory_cache()
    assert callable(k.get_compiled("fwd", dtype, wdtype, d, act))
    assert len(list(tmp_path.rglob("*.o"))) == 2


def test_kernel_declines_without_gpu_before_touching_memory():
    from cudnn_train.backend import Unsupported
    from cudnn_train.kernels import rms_norm_gated_sm90 as k

    x = torch.randn(4, 64)
    with pytest.raises(Unsupported, match="no GPU|tensor on cpu"):
        k.forward(x, x, None, 1e-5, "swish")
    with pytest.raises(Unsupported):
        k._plan(96, 2)  # 12 vectors per row: not a power of two
    assert k._plan(128, 2) == (8, 16, 1) and k._plan(1024, 2) == (8, 32, 4)


# ------------------------------------------------------------------ GPU tier


def _run(x, g, w, act, dy):
    for t in (x, g, w):
        if t is not None:
            t.grad = None
    y = rms_norm_gated(x, g, w, 1e-5, act)
    y.backward(dy)
    return y.detach(), x.grad, g.grad, None if w is None else w.grad


def _leaves(m, d, dtype, wdtype):
    x = torch.randn(m, d, device="cuda", dtype=dtype, requires_grad=True)
    g = (2 * torch.randn(m, d, device="cuda", dtype=dtype)).requires_grad_()
    w = None if wdtype is None else (1 + 0.5 * torch.randn(d, device="cuda", dtype=wdtype)).requires_grad_()
    return x, g, w


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256, 512])
@pytest.mark.parametrize("m", [1, 7, 127, 1000, 4099])
@pytest.mark.parametrize("dtype, wdtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, None)])
@pytest.mark.parametrize("act", ["swish", "sigmoid"])
def test_kernel_matches_reference(monkeypatch, m, d, dtype, wdtype, act):
    from cudnn_train.kernels import rms_norm_gated_sm90 as k

    monkeypatch.setattr(k, "POISON", True)
    x, g, w = _leaves(m, d, dtype, wdtype)
    dy = torch.randn(m, d, device="cuda", dtype=dtype)
    ours = _run(x, g, w, act, dy)
    assert cudnn_train.last_path("rms_norm_gated") == "cutedsl:sm90"
    assert cudnn_train.last_path("rms_norm_gated_bwd") == "cutedsl:sm90"
    with cudnn_train.use_backend("torch"):
        peer = _run(x, g, w, act, dy)
    # float32 reference on upcast leaves
    xr, gr = x.detach().float().requires_grad_(), g.detach().float().requires_grad_()
    wr = None if w is None else w.detach().float().requires_grad_()
    ref = _run(xr, gr, wr, act, dy.float())
    for name, a, p, r in zip(("y", "dx", "dgate", "dweight"), ours, peer, ref):
        if r is None:
            assert a is None
            continue
        assert torch.isfinite(a).all(), name
        assert a.dtype == p.dtype, name
        e_ours, e_peer = rel_l2(a, r), rel_l2(p, r)
        assert fla_compat_ok(e_ours, e_peer), f"{name}: ours {e_ours:.2e} vs torch {e_peer:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 256])
def test_kernel_float32_inputs_are_exact(d):
    x, g, w = _leaves(333, d, torch.float32, torch.float32)
    dy = torch.randn(333, d, device="cuda")
    ours = _run(x, g, w, "swish", dy)
    assert cudnn_train.last_path("rms_norm_gated") == "cutedsl:sm90"
    xr, gr, wr = (t.detach().double().requires_grad_() for t in (x, g, w))
    ref = _run(xr, gr, wr, "swish", dy.double())
    for a, r in zip(ours, ref):
        assert rel_l2(a, r) <= 1e-5


@pytest.mark.gpu
def test_kernel_backward_is_bitwise_deterministic():
    x, g, w = _leaves(65536, 256, torch.bfloat16, torch.float32)
    dy = torch.randn(65536, 256, device="cuda", dtype=torch.bfloat16)
    with cudnn_train.deterministic(True):
        first = _run(x, g, w, "swish", dy)
        first = [t.clone() for t in first]
        second = _run(x, g, w, "swish", dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_unsupported_head_dim_falls_back_to_torch():
    x, g, w = _leaves(64, 96, torch.bfloat16, torch.float32)
    y = rms_norm_gated(x, g, w)
    assert cudnn_train.last_path("rms_norm_gated").startswith("torch:fallback(D=96")
    assert rel_l2(y, oracle64(x, g, w, 1e-5, "swish")) <= 1e-2


@pytest.mark.gpu
def test_kernel_serves_strided_rows_and_3d_views():
    base = torch.randn(4, 50, 2, 128, device="cuda", dtype=torch.bfloat16)
    x = base[:, :, 0]  # rows strided by 256 elements: served without a copy
    g = torch.randn(4, 50, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, device="cuda")
    y = rms_norm_gated(x, g, w)
    assert cudnn_train.last_path("rms_norm_gated") == "cutedsl:sm90"
    assert rel_l2(y, oracle64(x, g, w, 1e-5, "swish")) <= 1e-2

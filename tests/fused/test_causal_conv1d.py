"""fused.causal_conv1d: reference and torch backend vs a float64 F.conv1d oracle (CPU), gradcheck,
bad input; GPU tier: our op and FLA's Triton causal_conv1d vs the float32 reference."""

import pytest
import torch
import torch.nn.functional as F

import cudnn_train
from cudnn_train.fused.causal_conv1d import causal_conv1d, causal_conv1d_ref
from cudnn_train.fused.gated_delta_rule import fla_original
from tests.fused.test_gated_delta_rule import _single_thread, leaf  # noqa: F401  (autouse fixture)
from tests.utils import cu_seqlens, fla_compat_ok, rel_l2


def oracle64(x, weight, bias, activation, lens, initial_state):
    """torch's F.conv1d per sequence in float64, the history (or zeros) prepended by hand."""
    D, W = weight.shape
    xs = [x[b] for b in range(x.shape[0])] if lens is None else list(x[0].split(lens))
    ys, finals = [], []
    for n, seq in enumerate(xs):
        hist = initial_state[n].double() if initial_state is not None else seq.new_zeros(D, W, dtype=torch.float64)
        comb = torch.cat([hist, seq.double().t()], dim=1)  # [D, W + L]
        if seq.shape[0]:
            y = F.conv1d(comb[None, :, 1:], weight.double()[:, None, :], None if bias is None else bias.double(),
                         groups=D)[0].t()
        else:
            y = comb.new_zeros(0, D)
        ys.append(F.silu(y) if activation in ("silu", "swish") else y)
        finals.append(comb[:, -W:])
    y = torch.stack(ys) if lens is None else torch.cat(ys)[None]
    return y, torch.stack(finals)


def _inputs(B, T, D, W, lens, bias, h0, dtype=torch.float32, device="cpu"):
    if lens is not None:
        B, T = 1, sum(lens)
    N = B if lens is None else len(lens)
    kw = dict(dtype=dtype, device=device)  # all in x's dtype, as ShortConvolution under half precision
    out = dict(x=torch.randn(B, T, D, **kw), weight=torch.randn(D, W, **kw))
    if bias:
        out["bias"] = torch.randn(D, **kw)
    if h0:
        out["initial_state"] = torch.randn(N, D, W, **kw)
    return {n: leaf(t) for n, t in out.items()}


def _run(fn, inp, cot=None, **kw):
    y, ht = fn(**inp, output_final_state=True, **kw)
    if cot is None:
        cot = (torch.randn_like(y, dtype=torch.float32), torch.randn_like(ht, dtype=torch.float32))
    loss = (y.double() * cot[0].double()).sum() + (ht.double() * cot[1].double()).sum()
    grads = torch.autograd.grad(loss, list(inp.values()))
    return y, ht, dict(zip(inp, grads)), cot


CASES = [
    dict(B=2, T=17, W=4, lens=None, bias=True, h0=True, activation="silu"),
    dict(B=3, T=1, W=4, lens=None, bias=False, h0=True, activation="swish"),
    dict(B=2, T=9, W=2, lens=None, bias=True, h0=False, activation=None),
    dict(B=1, T=0, W=3, lens=[0, 1, 2, 7, 0, 3], bias=True, h0=True, activation="silu"),
    dict(B=1, T=0, W=4, lens=[1, 0, 12, 2], bias=False, h0=False, activation=None),
    dict(B=1, T=0, W=1, lens=[3, 0, 4], bias=True, h0=True, activation="silu"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"W{c['W']}-{'varlen' if c['lens'] else 'dense'}-{c['activation']}")
@pytest.mark.parametrize("fn", [causal_conv1d, causal_conv1d_ref], ids=["op", "ref"])
def test_matches_float64_conv1d(case, fn):
    c = dict(case)
    act, lens = c.pop("activation"), c["lens"]
    inp = _inputs(D=6, **c)
    kw = dict(activation=act)
    if lens is not None:
        kw["cu_seqlens"] = cu_seqlens(lens, dtype=torch.long)
    ours = _run(fn, inp, **kw)
    oracle = _run(lambda **a: oracle64(a["x"], a["weight"], a.get("bias"), act, lens, a.get("initial_state")), inp,
                  cot=ours[3])
    assert ours[0].dtype == torch.float32 and ours[1].shape == (oracle[1].shape)
    assert rel_l2(ours[0], oracle[0]) <= 1e-6
    assert rel_l2(ours[1], oracle[1]) <= 1e-6
    for n in inp:
        assert rel_l2(ours[2][n], oracle[2][n]) <= 1e-6, n
    if fn is causal_conv1d:
        assert cudnn_train.last_path("causal_conv1d") == "torch:fallback(no GPU)"


def test_short_sequence_keeps_initial_state_tail():
    x = torch.randn(1, 3, 2)
    h0 = torch.randn(2, 2, 4)
    _, ht = causal_conv1d(x, torch.randn(2, 4), cu_seqlens=torch.tensor([0, 1, 3]), initial_state=h0,
                          output_final_state=True)
    assert torch.equal(ht[0], torch.cat([h0[0, :, 1:], x[0, :1].t()], dim=1))
    assert torch.equal(ht[1], torch.cat([h0[1, :, 2:], x[0, 1:3].t()], dim=1))


def test_no_leakage_across_sequences():
    inp = _inputs(1, 0, 5, 4, [6, 3, 7], True, True)
    y, ht = causal_conv1d(**inp, cu_seqlens=cu_seqlens([6, 3, 7], dtype=torch.long), output_final_state=True)
    y2, ht2 = causal_conv1d(inp["x"][:, 6:9], inp["weight"], inp["bias"], initial_state=inp["initial_state"][1:2],
                            output_final_state=True)
    assert rel_l2(y[:, 6:9], y2) <= 1e-7 and rel_l2(ht[1:2], ht2) <= 1e-7


def test_half_and_float64_dtypes():
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16)
    w = torch.randn(8, 4)
    y, ht = causal_conv1d(x, w, output_final_state=True)
    assert y.dtype == torch.bfloat16 and ht.dtype == torch.bfloat16
    ref = oracle64(x, w, None, "silu", None, None)[0]
    assert rel_l2(y, ref) <= 1e-2
    y64, _ = causal_conv1d(x.double(), w.double())
    assert y64.dtype == torch.float64 and rel_l2(y64, ref) <= 1e-12


@pytest.mark.parametrize("varlen", [False, True])
def test_gradcheck(varlen):
    lens = [0, 2, 1, 3] if varlen else None
    inp = _inputs(2, 3, 2, 3, lens, True, True)
    inp = {n: leaf(t.double()) for n, t in inp.items()}
    names = list(inp)
    kw = dict(cu_seqlens=cu_seqlens(lens, dtype=torch.long)) if varlen else {}

    def f(*ts):
        return causal_conv1d(**dict(zip(names, ts)), output_final_state=True, **kw)

    assert torch.autograd.gradcheck(f, tuple(inp[n] for n in names))


def _bad():
    x, w = torch.randn(1, 6, 4), torch.randn(4, 3)
    yield "x", dict(x=torch.randn(6, 4), weight=w), "x"
    yield "weight", dict(x=x, weight=torch.randn(5, 3)), "weight"
    yield "weight_rank", dict(x=x, weight=torch.randn(4, 1, 3)), "weight"
    yield "bias", dict(x=x, weight=w, bias=torch.randn(3)), "bias"
    yield "activation", dict(x=x, weight=w, activation="gelu"), "activation"
    yield "cu_B", dict(x=torch.randn(2, 6, 4), weight=w, cu_seqlens=torch.tensor([0, 6])), "cu_seqlens"
    yield "cu_order", dict(x=x, weight=w, cu_seqlens=torch.tensor([0, 4, 2, 6])), "cu_seqlens"
    yield "cu_range", dict(x=x, weight=w, cu_seqlens=torch.tensor([0, 7])), "cu_seqlens"
    yield "h0_N", dict(x=x, weight=w, cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.randn(3, 4, 3)), \
        "initial_state"
    yield "h0_W", dict(x=x, weight=w, initial_state=torch.randn(1, 4, 2)), "initial_state"
    yield "x_int", dict(x=torch.ones(1, 6, 4, dtype=torch.int32), weight=w), "x"


@pytest.mark.parametrize("case", list(_bad()), ids=lambda c: c[0])
@pytest.mark.parametrize("fn", [causal_conv1d, causal_conv1d_ref], ids=["op", "ref"])
def test_bad_input(case, fn):
    _, kw, arg = case
    with pytest.raises(ValueError, match=rf"^{arg}"):
        fn(**kw)


# ------------------------------------------------------------------ GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("varlen", [False, True])
def test_gpu_matches_reference_like_fla(dtype, varlen):
    pytest.importorskip("fla.modules.causal_conv1d.ops")
    fla_conv = fla_original("fla.modules.causal_conv1d.ops", "causal_conv1d")
    lens = [1, 63, 130, 3] if varlen else None
    inp = _inputs(2, 300, 256, 4, lens, True, True, dtype=dtype, device="cuda")
    kw = dict(activation="silu")
    if varlen:
        kw["cu_seqlens"] = cu_seqlens(lens, "cuda", torch.long)
    peer = _run(lambda **a: fla_conv(**a), inp, **kw)
    ref = _run(causal_conv1d_ref, {n: leaf(t.float()) for n, t in inp.items()}, cot=peer[3], **kw)
    for force in (None, "torch"):
        if force:
            with cudnn_train.use_backend(force):
                ours = _run(causal_conv1d, inp, cot=peer[3], **kw)
        else:
            ours = _run(causal_conv1d, inp, cot=peer[3], **kw)
        for what, a, b, c in [("y", ours[0], peer[0], ref[0]), ("final_state", ours[1], peer[1], ref[1])]:
            assert fla_compat_ok(rel_l2(a, c), rel_l2(b, c)), f"{force} {what}: {rel_l2(a, c)} vs {rel_l2(b, c)}"
        for n in inp:
            e1, e2 = rel_l2(ours[2][n], ref[2][n]), rel_l2(peer[2][n], ref[2][n])
            assert fla_compat_ok(e1, e2), f"{force} d{n}: ours {e1} fla {e2}"

"""fused.csa: csa_compress vs a per-block float64 loop (CPU), the same op on CUDA (GPU)."""

import pytest
import torch

import cudnn_train
from cudnn_train.fused.csa import csa_comp_positions, csa_compress, csa_compress_ref, csa_cu_seqlens_comp
from tests.utils import fla_compat_ok, rel_l2


def oracle64(kv, score, ape, cu_seqlens, ratio, coff):
    """One block at a time, one window slot at a time, in float64 (differentiable)."""
    kv, score, ape = kv.double(), score.double(), ape.double()
    d = kv.shape[1] // coff
    cu = [int(c) for c in cu_seqlens]
    rows = []
    for s in range(len(cu) - 1):
        start, end = cu[s], cu[s + 1]
        for b in range((end - start) // ratio):
            t0 = start + b * ratio
            zs, vs = [], []
            if coff == 2 and b > 0:  # previous block's tokens, first column half, APE row k
                for k in range(ratio):
                    zs.append(score[t0 - ratio + k, :d] + ape[k, :d])
                    vs.append(kv[t0 - ratio + k, :d])
            for k in range(ratio):  # own block's tokens, last column half, APE row k
                zs.append(score[t0 + k, (coff - 1) * d :] + ape[k, (coff - 1) * d :])
                vs.append(kv[t0 + k, (coff - 1) * d :])
            z, v = torch.stack(zs), torch.stack(vs)  # [slots, d]
            p = torch.exp(z - z.max(dim=0).values)
            rows.append((p / p.sum(dim=0) * v).sum(dim=0))
    return torch.stack(rows) if rows else kv.new_zeros(0, d)


# sequences: empty, shorter than ratio, exact multiples and ragged tails
CU_SEQLENS = {
    1: [0, 0, 1, 4, 4, 9],
    2: [0, 0, 1, 6, 6, 13, 14],
    3: [0, 2, 2, 11, 18],
    4: [0, 0, 3, 12, 13, 25],
    128: [0, 100, 100, 400, 656],
}


def _leaves(cu, ratio, coff, d, dtype=torch.float64, device="cpu"):
    t = cu[-1]
    kv = torch.randn(t, coff * d, dtype=dtype, device=device, requires_grad=True)
    score = (2 * torch.randn(t, coff * d, dtype=dtype, device=device)).requires_grad_()
    ape = torch.randn(ratio, coff * d, dtype=torch.float32 if dtype != torch.float64 else dtype, device=device)
    return kv, score, ape.requires_grad_()


def _grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


# ------------------------------------------------------------------ CPU tier


@pytest.mark.parametrize("coff", [1, 2])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 128])
def test_matches_loop_oracle_float64(ratio, coff):
    cu_list = CU_SEQLENS[ratio]
    d = 3 if ratio == 128 else 5
    cu = torch.tensor(cu_list)
    kv, score, ape = _leaves(cu_list, ratio, coff, d)
    out = csa_compress(kv, score, ape, cu, ratio, coff)
    ref = oracle64(kv, score, ape, cu, ratio, coff)
    assert out.shape == ref.shape == (sum((b - a) // ratio for a, b in zip(cu_list, cu_list[1:])), d)
    assert cudnn_train.last_path("csa_compress") == "torch"
    assert rel_l2(out, ref) <= 1e-6
    dout = torch.randn_like(ref)
    for name, a, b in zip(("dkv", "dscore", "dape"), _grads(out, (kv, score, ape), dout), _grads(ref, (kv, score, ape), dout)):
        assert rel_l2(a, b) <= 1e-6, name
    assert cudnn_train.last_path("csa_compress_bwd") == "torch"


@pytest.mark.parametrize("coff", [1, 2])
def test_reference_matches_loop_oracle(coff):
    cu_list = CU_SEQLENS[4]
    cu = torch.tensor(cu_list)
    kv, score, ape = _leaves(cu_list, 4, coff, 6)
    out = csa_compress_ref(kv, score, ape, cu, 4, coff)
    ref = oracle64(kv, score, ape, cu, 4, coff)
    assert rel_l2(out, ref) <= 1e-6
    dout = torch.randn_like(ref)
    for a, b in zip(_grads(out, (kv, score, ape), dout), _grads(ref, (kv, score, ape), dout)):
        assert rel_l2(a, b) <= 1e-6


@pytest.mark.parametrize("coff", [1, 2])
def test_float32_inputs_match_float64_oracle(coff):
    cu_list = CU_SEQLENS[2]
    cu = torch.tensor(cu_list, dtype=torch.int32)
    kv, score, ape = _leaves(cu_list, 2, coff, 16, dtype=torch.float32)
    out = csa_compress(kv, score, ape, cu, 2, coff)
    assert out.dtype == torch.float32
    ref = oracle64(kv, score, ape, cu, 2, coff)
    assert rel_l2(out, ref) <= 1e-5
    dout = torch.randn(ref.shape, dtype=torch.float64)
    for a, b in zip(_grads(out, (kv, score, ape), dout.float()), _grads(ref, (kv, score, ape), dout)):
        assert a.dtype == torch.float32
        assert rel_l2(a, b) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_keep_dtypes(dtype):
    cu_list = CU_SEQLENS[4]
    cu = torch.tensor(cu_list)
    kv, score, ape = _leaves(cu_list, 4, 2, 8, dtype=dtype)
    out = csa_compress(kv, score, ape, cu, 4, 2)
    assert out.dtype == dtype
    ref = oracle64(kv, score, ape, cu, 4, 2)
    assert rel_l2(out, ref) <= 1e-2
    dkv, dscore, dape = _grads(out, (kv, score, ape), torch.randn_like(out))
    assert dkv.dtype == dtype and dscore.dtype == dtype and dape.dtype == torch.float32


@pytest.mark.parametrize("coff", [1, 2])
def test_gradcheck(coff):
    cu = torch.tensor([0, 2, 7, 7, 13])
    kv, score, ape = _leaves([0, 13], 2, coff, 2)
    assert torch.autograd.gradcheck(lambda a, b, c: csa_compress(a, b, c, cu, 2, coff), (kv, score, ape))


def test_tokens_outside_every_window_get_zero_gradient():
    # ratio 4, coff 2: seq 0 = tokens 0..9 (blocks 0..3, 4..7; tail 8, 9); seq 1 = 10..12 (too short)
    cu = torch.tensor([0, 10, 13])
    kv, score, ape = _leaves([0, 13], 4, 2, 3)
    dkv, dscore, _ = _grads(csa_compress(kv, score, ape, cu, 4, 2), (kv, score, ape), torch.randn(2, 3, dtype=torch.float64))
    for g in (dkv, dscore):
        assert (g[8:] == 0).all()  # dropped tail and the short sequence
        assert (g[4:8, :3] == 0).all()  # last block's overlap half feeds no next block
        assert (g[:8, 3:] != 0).all() and (g[:4, :3] != 0).all()


def test_total_comp_padding_rows_are_zero_and_get_no_gradient():
    cu_list = CU_SEQLENS[4]
    cu = torch.tensor(cu_list)
    kv, score, ape = _leaves(cu_list, 4, 2, 4)
    out = csa_compress(kv, score, ape, cu, 4, 2)
    n = out.shape[0]
    padded = csa_compress(kv, score, ape, cu, 4, 2, total_comp=n + 3, cu_seqlens_comp=csa_cu_seqlens_comp(cu, 4))
    assert padded.shape == (n + 3, 4)
    assert rel_l2(padded[:n], out) <= 1e-12 and (padded[n:] == 0).all()
    dout = torch.randn(n + 3, 4, dtype=torch.float64)
    for a, b in zip(_grads(padded, (kv, score, ape), dout), _grads(out, (kv, score, ape), dout[:n])):
        assert rel_l2(a, b) <= 1e-12


def test_no_complete_block_gives_empty_output():
    for cu_list in ([0, 3, 3, 6], [0], [0, 0]):
        cu = torch.tensor(cu_list)
        kv, score, ape = _leaves(cu_list, 4, 2, 4)
        out = csa_compress(kv, score, ape, cu, 4, 2)
        assert out.shape == (0, 4)
        if kv.shape[0]:
            out.sum().backward()
            assert (kv.grad == 0).all() and (score.grad == 0).all() and (ape.grad == 0).all()


def test_cu_seqlens_comp_and_positions():
    cu = torch.tensor([0, 0, 3, 12, 13, 25], dtype=torch.int32)
    comp = csa_cu_seqlens_comp(cu, 4)
    assert comp.dtype == torch.int32 and comp.tolist() == [0, 0, 0, 2, 2, 5]
    assert csa_cu_seqlens_comp(cu, 1).tolist() == cu.tolist()
    assert csa_comp_positions(comp, 5, 4).tolist() == [0, 4, 0, 4, 8]
    assert csa_comp_positions(comp, 7, 4).tolist() == [0, 4, 0, 4, 8, 0, 0]  # padding rows: 0


def test_backward_is_reproducible_in_deterministic_mode():
    cu_list = CU_SEQLENS[4]
    cu = torch.tensor(cu_list)
    kv, score, ape = _leaves(cu_list, 4, 2, 8, dtype=torch.float32)
    dout = torch.randn(5, 8)
    with cudnn_train.deterministic(True):
        first = _grads(csa_compress(kv, score, ape, cu, 4, 2), (kv, score, ape), dout)
        second = _grads(csa_compress(kv, score, ape, cu, 4, 2), (kv, score, ape), dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_torch_compile_traces_without_graph_breaks():
    cu = torch.tensor([0, 5, 5, 13])
    kv, score, ape = _leaves([0, 13], 4, 2, 4, dtype=torch.float32)

    def f(kv, score, ape, cu):  # output size read from cu_seqlens inside the op (unbacked)
        return (csa_compress(kv, score, ape, cu, 4, 2) ** 2).sum()

    def g(kv, score, ape, cu):  # static output size
        return (csa_compress(kv, score, ape, cu, 4, 2, total_comp=3) ** 2).sum()

    for fn in (f, g):
        out = torch.compile(fn, fullgraph=True, backend="aot_eager")(kv, score, ape, cu)
        grads = torch.autograd.grad(out, (kv, score, ape))
        ref = fn(kv, score, ape, cu)
        refs = torch.autograd.grad(ref, (kv, score, ape))
        assert torch.allclose(out, ref)
        for a, b in zip(grads, refs):
            assert torch.allclose(a, b)


def _bad(**over):
    args = dict(
        kv=torch.randn(8, 6), score=torch.randn(8, 6), ape=torch.randn(4, 6),
        cu_seqlens=torch.tensor([0, 3, 8]), ratio=4, coff=2,
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (_bad(ratio=0), "ratio: expected an int >= 1"),
        (_bad(ratio=2.0), "ratio"),
        (_bad(coff=3), "coff: expected 1 or 2"),
        (_bad(coff=True), "coff"),
        (_bad(kv=torch.randn(8, 5), score=torch.randn(8, 5)), "kv: the last dim must be coff"),
        (_bad(kv=torch.randn(8, 6, 1)), "kv: expected rank 2"),
        (_bad(kv=torch.randn(8, 6).int()), "kv: dtype int32"),
        (_bad(score=torch.randn(8, 4)), "score: expected the shape of kv"),
        (_bad(score=torch.randn(8, 6, dtype=torch.float64)), "score: expected kv's dtype"),
        (_bad(ape=torch.randn(2, 6)), r"ape: expected shape \(ratio, coff\*d\) = \(4, 6\)"),
        (_bad(cu_seqlens=torch.tensor([0.0, 8.0])), "cu_seqlens: dtype float32"),
        (_bad(cu_seqlens=torch.tensor([[0, 8]])), "cu_seqlens: expected rank 1"),
        (_bad(cu_seqlens=torch.tensor([0, 5, 3, 8])), "cu_seqlens: must be non-decreasing"),
        (_bad(cu_seqlens=torch.tensor([1, 8])), "cu_seqlens: must start at 0"),
        (_bad(cu_seqlens=torch.tensor([0, 7])), "cu_seqlens: must end at the number of tokens"),
        (_bad(cu_seqlens=torch.tensor([], dtype=torch.int64)), "cu_seqlens: expected B \\+ 1 >= 1"),
        (_bad(ape=torch.randn(4, 6, device="meta")), "ape: is on meta"),
        (_bad(kv=[[1.0]]), "kv: expected a torch.Tensor"),
        (_bad(total_comp=-1), "total_comp: expected a non-negative int"),
        (_bad(total_comp=0), "total_comp: 0 is less than the 1 blocks"),
        (_bad(cu_seqlens_comp=torch.tensor([0, 1])), "cu_seqlens_comp: expected the shape of cu_seqlens"),
        (_bad(cu_seqlens_comp=torch.tensor([0, 0, 2])), "cu_seqlens_comp: does not match"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        csa_compress(
            kwargs.pop("kv"), kwargs.pop("score"), kwargs.pop("ape"), kwargs.pop("cu_seqlens"),
            kwargs.pop("ratio"), kwargs.pop("coff"), **kwargs,
        )


def test_cu_seqlens_comp_bad_input():
    with pytest.raises(ValueError, match="ratio"):
        csa_cu_seqlens_comp(torch.tensor([0, 4]), 0)
    with pytest.raises(ValueError, match="cu_seqlens: dtype float32"):
        csa_cu_seqlens_comp(torch.tensor([0.0, 4.0]), 2)


# ------------------------------------------------------------------ GPU tier


def _run_cuda(kv, score, ape, cu, ratio, coff, dout, **kw):
    for t in (kv, score, ape):
        t.grad = None
    out = csa_compress(kv, score, ape, cu, ratio, coff, **kw)
    out.backward(dout)
    return out.detach(), kv.grad, score.grad, ape.grad


@pytest.mark.gpu
@pytest.mark.parametrize("coff", [1, 2])
@pytest.mark.parametrize("ratio", [2, 4, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_matches_reference(ratio, coff, dtype):
    d = 128
    lens = [0, ratio - 1, 5 * ratio + 1, 1, 40 * ratio // 4 + 3, 3 * ratio]
    cu_list = [0]
    for n in lens:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, device="cuda", dtype=torch.int32)
    kv, score, ape = _leaves(cu_list, ratio, coff, d, dtype=dtype, device="cuda")
    n = sum(x // ratio for x in lens)
    dout = torch.randn(n, d, device="cuda", dtype=dtype)
    ours = _run_cuda(kv, score, ape, cu, ratio, coff, dout)
    # float64 oracle on the same (upcast) values, on the CPU
    leaves64 = [t.detach().cpu().double().requires_grad_() for t in (kv, score, ape)]
    ref_out = oracle64(*leaves64, cu.cpu(), ratio, coff)
    refs = (ref_out.detach(), *_grads(ref_out, leaves64, dout.cpu().double()))
    if dtype == torch.float32:
        for name, a, r in zip(("out", "dkv", "dscore", "dape"), ours, refs):
            assert rel_l2(a.cpu(), r) <= 1e-5, name
    else:
        # peer: the readable reference on the same device and dtype
        peer_leaves = [t.detach().clone().requires_grad_() for t in (kv, score, ape)]
        peer_out = csa_compress_ref(*peer_leaves, cu, ratio, coff)
        peer = (peer_out.detach(), *_grads(peer_out, peer_leaves, dout))
        for name, a, p, r in zip(("out", "dkv", "dscore", "dape"), ours, peer, refs):
            assert torch.isfinite(a).all(), name
            e_ours, e_peer = rel_l2(a.cpu(), r), rel_l2(p.cpu(), r)
            assert fla_compat_ok(e_ours, e_peer), f"{name}: ours {e_ours:.2e} vs reference {e_peer:.2e}"


@pytest.mark.gpu
def test_cuda_total_comp_without_host_read_and_deterministic_backward():
    ratio, coff, d = 4, 2, 128
    cu_list = [0, 8190, 8192, 8192]
    cu = torch.tensor(cu_list, device="cuda", dtype=torch.int32)
    kv, score, ape = _leaves(cu_list, ratio, coff, d, dtype=torch.bfloat16, device="cuda")
    n = 2047 + 0 + 0
    dout = torch.randn(n + 1, d, device="cuda", dtype=torch.bfloat16)
    with cudnn_train.deterministic(True):
        first = [t.clone() for t in _run_cuda(kv, score, ape, cu, ratio, coff, dout, total_comp=n + 1)]
        second = _run_cuda(kv, score, ape, cu, ratio, coff, dout, total_comp=n + 1)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert (first[0][n:] == 0).all()
    plain = csa_compress(kv.detach(), score.detach(), ape.detach(), cu, ratio, coff)
    assert plain.shape[0] == n and rel_l2(plain, first[0][:n]) <= 1e-3

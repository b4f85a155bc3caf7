"""layers.DSAIndexer: projections vs float64 math with Megatron-core's RoPE, top-k and loss vs
Megatron-core's DSA functions and the float64 oracles of tests/fused/test_dsa.py, gradients to
the indexer's parameters only, the loss hook, bad input; GPU tier: CUDA vs the CPU oracle."""

import pytest
import torch
import torch.nn.functional as F

from cudnn_train.layers.dsa import DSAIndexer, apply_partial_rope, attach_indexer_loss
from tests.fused.test_dsa import _PG, megatron_dsa, oracle_logits, oracle_loss, oracle_topk  # noqa: F401
from tests.utils import rel_l2

F64, F32 = torch.float64, torch.float32


def make(dtype=F64, device="cpu", **kw):
    cfg = dict(hidden_size=24, q_lora_rank=16, n_heads=4, head_dim=16, rope_dim=8, topk=5)
    cfg.update(kw)
    m = DSAIndexer(**cfg, init_std=0.2, device=device, dtype=dtype)
    with torch.no_grad():  # non-trivial norm affine parameters
        m.k_norm.weight.uniform_(0.5, 1.5)
        m.k_norm.bias.normal_(0, 0.1)
    return m


def inputs(m, b=2, s=9, dtype=F64, device="cpu"):
    x = torch.randn(b, s, m.hidden_size, dtype=F64).to(device=device, dtype=dtype)
    qr = torch.randn(b, s, m.q_lora_rank, dtype=F64).to(device=device, dtype=dtype)
    return x, qr


@pytest.fixture(scope="module")
def mrope():
    try:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"megatron-core RoPE not importable: {type(e).__name__}: {e}")
    return _apply_rotary_pos_emb_bshd


def oracle_project(m, x, qr, rope_fn, positions=None):
    """float64: the indexer's projections written out, RoPE by Megatron-core's function ([S, B, ...])."""
    x, qr = x.double(), qr.double()
    b, s, _ = x.shape
    h, d, r = m.n_heads, m.head_dim, m.rope_dim
    wq, wk, ww = (p.detach().double() for p in (m.linear_wq_b.weight, m.linear_wk.weight, m.linear_weights_proj.weight))
    q = (qr @ wq.T).view(b, s, h, d)
    k = x @ wk.T
    mu, var = k.mean(-1, keepdim=True), k.var(-1, unbiased=False, keepdim=True)
    k = (k - mu) / torch.sqrt(var + m.k_norm.eps) * m.k_norm.weight.detach().double() + m.k_norm.bias.detach().double()
    pos = torch.arange(s, dtype=F64) if positions is None else positions.double()
    inv_freq = 1.0 / (m.rope_base ** (torch.arange(0, r, 2, dtype=F64) / r))
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], -1)[:, None, None, :]  # [S, 1, 1, r]

    def rope(t):  # t [B, S, H, D]; Megatron rotates the first r channels of [S, B, H, r]
        lo = 0 if m.rope_position == "first" else d - r
        part = t[..., lo:lo + r].transpose(0, 1)
        part = rope_fn(part, emb, rotary_interleaved=False, mla_rotary_interleaved=m.rope_interleaved).transpose(0, 1)
        return torch.cat([t[..., :lo], part, t[..., lo + r:]], -1)

    q = rope(q)
    k = rope(k.unsqueeze(2)).squeeze(2)
    w = (x @ ww.T) * h**-0.5 * d**-0.5
    return q, k, w


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rope_position", ["first", "last"])
def test_project_matches_float64_math_with_megatron_rope(mrope, interleaved, rope_position):
    m = make(rope_interleaved=interleaved, rope_position=rope_position)
    x, qr = inputs(m)
    q, k, w = m.project(x, qr)
    rq, rk, rw = oracle_project(m, x, qr, mrope)
    assert q.shape == (2, 9, 4, 16) and k.shape == (2, 9, 16) and w.shape == (2, 9, 4)
    for a, r in ((q, rq), (k, rk), (w, rw)):
        assert rel_l2(a, r) <= 1e-6
    pos = torch.tensor([3, 4, 5, 9, 10, 11, 12, 20, 21])
    q2, k2, _ = m.project(x, qr, position_ids=pos)
    rq2, rk2, _ = oracle_project(m, x, qr, mrope, positions=pos)
    assert rel_l2(q2, rq2) <= 1e-6 and rel_l2(k2, rk2) <= 1e-6


def test_interleaved_rope_scores_match_deepseek_complex_pairs():
    """DeepSeek's form: pair (2i, 2i+1) is a complex number times exp(i pos theta_i); dot products agree."""
    b, s, h, d, r = 2, 6, 3, 12, 8
    q, k = torch.randn(b, s, h, d, dtype=F64), torch.randn(b, s, d, dtype=F64)
    pos = torch.arange(s).expand(b, s)

    def complex_rope(t):
        inv = 10000.0 ** (-torch.arange(0, r, 2, dtype=F64) / r)
        ang = pos.double()[..., None] * inv
        ang = ang.view(b, s, *([1] * (t.dim() - 3)), r // 2)
        z = torch.view_as_complex(t[..., :r].reshape(*t.shape[:-1], r // 2, 2).contiguous()) * torch.polar(
            torch.ones_like(ang), ang)
        return torch.cat([torch.view_as_real(z).flatten(-2), t[..., r:]], -1)

    ours = torch.einsum("bthd,bsd->bths", apply_partial_rope(q, pos, r, interleaved=True),
                        apply_partial_rope(k, pos, r, interleaved=True))
    ref = torch.einsum("bthd,bsd->bths", complex_rope(q), complex_rope(k))
    assert rel_l2(ours, ref) <= 1e-12


def test_forward_topk_matches_oracle_and_megatron(megatron_dsa):  # noqa: F811
    m = make(topk=5)
    x, qr = inputs(m, s=9)
    idx = m(x, qr)
    q, k, w = m.project(x, qr)
    logits64 = oracle_logits(q, k, w)
    assert idx.dtype == torch.int32 and idx.shape == (2, 9, 5)
    assert torch.equal(idx, oracle_topk(logits64, 5))
    mask = torch.triu(torch.full((9, 9), float("-inf"), dtype=F64), diagonal=1)
    scores, m_idx = megatron_dsa.fused_qk_topk_naive(
        *(t.detach().float().transpose(0, 1) for t in (q, k, w)), 5, mask.float())
    # Megatron scores in float32; its selection agrees wherever no two candidates tie
    assert rel_l2(torch.where(torch.isinf(scores), 0, scores), torch.where(torch.isinf(logits64), 0, logits64)) <= 1e-5
    assert torch.equal((m_idx >= 0), (idx >= 0))
    # topk larger than S: min(topk, S) keys
    small = m(x[:, :3], qr[:, :3])
    assert small.shape == (2, 3, 3) and torch.equal(small, oracle_topk(oracle_logits(*m.project(x[:, :3], qr[:, :3])), 3))


@pytest.mark.parametrize("sparse", [False, True])
def test_forward_with_loss_matches_oracles(megatron_dsa, sparse):  # noqa: F811
    m = make()
    x, qr = inputs(m, s=9)
    x.requires_grad_()
    qr.requires_grad_()
    query, key = torch.randn(2, 9, 3, 10, dtype=F64), torch.randn(2, 9, 10, dtype=F64)
    idx, loss = m.forward_with_loss(x, qr, query, key, 0.3, sparse_loss=sparse, loss_coeff=0.7)
    assert torch.equal(idx, m(x, qr))
    params = [m.linear_wq_b.weight, m.linear_wk.weight, m.k_norm.weight, m.k_norm.bias, m.linear_weights_proj.weight]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    # the oracle: the whole pipeline in float64, autograd to the parameters
    q, k, w = m.project(x, qr)
    ref = oracle_loss(q, k, w, query, key, 0.3, idx if sparse else None, 0.7)
    assert rel_l2(loss, ref) <= 1e-6
    for a, r in zip(grads, torch.autograd.grad(ref, params)):
        assert a is not None and rel_l2(a, r) <= 1e-6
    # Megatron-core on the same projections (float32 internally)
    mq, mk, mw = q.detach().float().transpose(0, 1), k.detach().float().transpose(0, 1), w.detach().float().transpose(0, 1)
    m_loss = megatron_dsa.compute_dsa_indexer_loss(
        megatron_dsa._compute_index_scores(mq, mw, mk), idx, query.float().transpose(0, 1),
        key.float()[:, :, None].expand(-1, -1, 3, -1).transpose(0, 1).contiguous(), 0.3, 0.7, sparse, _PG)
    assert rel_l2(loss, m_loss) <= 1e-5


def test_loss_reaches_only_the_indexer_and_the_hook_trains_it():
    m = make(dtype=F32)
    x, qr = inputs(m, s=7, dtype=F32)
    x.requires_grad_()
    qr.requires_grad_()
    query, key = torch.randn(2, 7, 2, 8), torch.randn(2, 7, 8)
    _, loss = m.forward_with_loss(x, qr, query, key, 0.4, sparse_loss=True)
    expected = torch.autograd.grad(loss, list(m.parameters()), retain_graph=True)
    attn_out = (x * 2.0).sum(-1)  # stands in for the attention output
    out = attach_indexer_loss(attn_out, loss, scale=0.5)
    assert torch.equal(out, attn_out)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))  # the main path only: the indexer saw detached x
    assert qr.grad is None
    for p, e in zip(m.parameters(), expected):
        assert rel_l2(p.grad, 0.5 * e) <= 1e-6


def test_bf16_module_runs_with_float32_scores():
    m = make(dtype=torch.bfloat16)
    x, qr = inputs(m, s=6, dtype=torch.bfloat16)
    q, k, w = m.project(x, qr)
    assert q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and w.dtype == F32
    scores = m.scores(x, qr)
    assert scores.dtype == F32
    ref = oracle_logits(q, k, w)  # float64 math on the same bf16 q, k and float32 w
    assert torch.equal(torch.isinf(scores), torch.isinf(ref))
    assert rel_l2(torch.where(torch.isinf(scores), 0, scores), torch.where(torch.isinf(ref), 0, ref)) <= 1e-5
    assert torch.equal(m(x, qr), oracle_topk(scores, 5))  # the selection of exactly these scores


def test_bad_input():
    m = make()
    x, qr = inputs(m, s=4)
    cases = [
        ("x", lambda: m(x[0], qr)),
        ("x", lambda: m(torch.randn(2, 4, 7, dtype=F64), qr)),
        ("qr", lambda: m(x, qr[:, :3])),
        ("position_ids", lambda: m(x, qr, position_ids=torch.arange(5))),
        ("position_ids", lambda: m(x, qr, position_ids=torch.arange(4.0))),
        ("rope_dim", lambda: DSAIndexer(8, 8, 2, 16, rope_dim=7)),
        ("rope_dim", lambda: DSAIndexer(8, 8, 2, 16, rope_dim=18)),
        ("rope_position", lambda: DSAIndexer(8, 8, 2, 16, rope_dim=8, rope_position="middle")),
        ("topk", lambda: DSAIndexer(8, 8, 2, 16, rope_dim=8, topk=0)),
        ("n_heads", lambda: DSAIndexer(8, 8, 0, 16, rope_dim=8)),
        ("sparse_loss", lambda: m.forward_with_loss(x, qr, torch.randn(2, 4, 2, 3, dtype=F64),
                                                    torch.randn(2, 4, 3, dtype=F64), 0.3, sparse_loss=1)),
        ("key", lambda: m.forward_with_loss(x, qr, torch.randn(2, 4, 2, 3, dtype=F64),
                                            torch.randn(2, 4, 4, dtype=F64), 0.3)),
        ("loss", lambda: attach_indexer_loss(x, torch.ones(2))),
        ("scale", lambda: attach_indexer_loss(x, torch.ones(()), scale=float("inf"))),
    ]
    for name, fn in cases:
        with pytest.raises(ValueError, match=name):
            fn()


def test_k_norm_matches_torch_layernorm_in_float32():
    m = make(dtype=F32, rope_dim=0)
    x, qr = inputs(m, dtype=F32)
    _, k, _ = m.project(x, qr)
    assert rel_l2(k, F.layer_norm(x.double() @ m.linear_wk.weight.double().T, (16,), m.k_norm.weight.double(),
                                  m.k_norm.bias.double(), m.k_norm.eps)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True])
def test_gpu_layer_matches_cpu_oracle(sparse):
    m = make(dtype=F32, device="cuda")
    x, qr = inputs(m, s=33, dtype=F32, device="cuda")
    query, key = torch.randn(2, 33, 4, 12, device="cuda"), torch.randn(2, 33, 12, device="cuda")
    idx, loss = m.forward_with_loss(x, qr, query, key, 0.25, sparse_loss=sparse)
    grads = torch.autograd.grad(loss, list(m.parameters()))
    mc = make(dtype=F64)
    mc.load_state_dict({k_: v.double().cpu() for k_, v in m.state_dict().items()})
    q, k, w = mc.project(x.double().cpu(), qr.double().cpu())
    scores, ref = m.scores(x, qr).cpu(), oracle_logits(q, k, w)
    assert torch.equal(torch.isinf(scores), torch.isinf(ref))
    assert rel_l2(torch.where(torch.isinf(scores), 0, scores), torch.where(torch.isinf(ref), 0, ref)) <= 1e-5
    assert torch.equal(idx.cpu(), oracle_topk(scores, 5))
    ref = oracle_loss(q, k, w, query.cpu(), key.cpu(), 0.25, idx.cpu() if sparse else None)
    assert rel_l2(loss.cpu(), ref) <= 1e-5
    for a, r in zip(grads, torch.autograd.grad(ref, list(mc.parameters()))):
        assert rel_l2(a.cpu(), r) <= 1e-5

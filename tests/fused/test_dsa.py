"""fused.dsa: indexer logits, top-k, indexer loss and sparse MLA attention.

CPU tier: every op and every gradient against float64 math written here (per-row loops and dense
masked attention), and the indexer loss against Megatron-core's ``compute_dsa_indexer_loss`` and
its naive backward; gradcheck; torch.compile(fullgraph=True); bad input. GPU tier: the same ops
on CUDA tensors against the same oracles.
"""

from types import SimpleNamespace

import pytest
import torch

from cudnn_train import backend
from cudnn_train.fused import dsa
from cudnn_train.fused.dsa import (
    indexer_logits,
    indexer_logits_ref,
    indexer_loss,
    indexer_loss_ref,
    indexer_topk,
    indexer_topk_ref,
    sparse_mla_attention,
    sparse_mla_attention_ref,
)
from tests.utils import rel_l2

F64, F32 = torch.float64, torch.float32
TOL = {F64: 1e-6, F32: 1e-5}


def rnd(*shape, dtype=F64, device="cpu", scale=1.0):
    return (torch.randn(*shape, dtype=F64) * scale).to(device=device, dtype=dtype)


def visible(t, s, causal, ratio, q_offset):
    return (s < (q_offset + t + 1) // ratio) if causal else True


# ------------------------------------------------------------------ float64 oracles (written here)


def oracle_logits(q, k, w, causal=True, ratio=1, q_offset=0):
    """Direct per-(t, s) float64 sums."""
    q, k, w = q.double(), k.double(), w.double()
    b, s_, h, _ = q.shape
    sk = k.shape[1]
    out = torch.full((b, s_, sk), float("-inf"), dtype=F64)
    rows = []
    for bi in range(b):
        for t in range(s_):
            row = []
            for s in range(sk):
                if visible(t, s, causal, ratio, q_offset):
                    row.append(sum(w[bi, t, j] * torch.relu(q[bi, t, j] @ k[bi, s]) for j in range(h)))
                else:
                    row.append(out[bi, t, s])
            rows.append(torch.stack(row))
    return torch.stack(rows).view(b, s_, sk)


def oracle_topk(logits, k):
    out = []
    for row in logits.reshape(-1, logits.shape[-1]).tolist():
        order = sorted(range(len(row)), key=lambda s: (-row[s], s))[:k]
        out.append([s if row[s] != float("-inf") else -1 for s in order])
    return torch.tensor(out, dtype=torch.int32).view(*logits.shape[:-1], k)


def oracle_loss(q, k, w, query, key, scale, topk=None, coeff=1.0, causal=True, ratio=1, q_offset=0,
                lse=None, rows=None, per_token=False):
    """Per-query loop in float64 over the key set K_t (visible, and selected if topk)."""
    q, k, w = q.double(), k.double(), w.double()
    query, key = query.double(), key.double()
    if key.dim() == 3:
        key = key.unsqueeze(2)
    b, s_, h, _ = q.shape
    sk = k.shape[1]
    hm = query.shape[2]
    grp = hm // key.shape[2]
    total = torch.zeros((), dtype=F64)
    nrows = 0.0
    for bi in range(b):
        for t in range(s_):
            r = 1.0 if rows is None else float(rows[bi, t])
            nrows += r
            keys = [s for s in range(sk) if visible(t, s, causal, ratio, q_offset)]
            if topk is not None:
                chosen = set(int(x) for x in topk[bi, t] if x >= 0)
                keys = [s for s in keys if s in chosen]
            if not keys:
                continue
            ki = torch.tensor(keys)
            tgt = torch.zeros(len(keys), dtype=F64)
            for j in range(hm):
                lg = scale * (key[bi, ki, j // grp] @ query[bi, t, j])
                tgt = tgt + (torch.softmax(lg, 0) if lse is None else torch.exp(lg - lse[bi, t, j].double()))
            tgt = tgt / tgt.sum().clamp_min(1e-10)
            ind = torch.relu(torch.einsum("hd,sd->hs", q[bi, t], k[bi, ki]))
            logit = (w[bi, t][:, None] * ind).sum(0)
            logp = torch.log_softmax(logit, 0)
            total = total + r * (tgt * (torch.log(tgt.clamp_min(1e-10)) - logp)).sum()
    if not per_token:
        total = total / max(nrows, 1.0)
    return total * coeff


def oracle_smla(q, kv, idx, scale, d_v, sink=None):
    """Dense masked attention in float64; a key named c times in a row has weight c."""
    q, kv = q.double(), kv.double()
    t, h, _ = q.shape
    tk = kv.shape[0]
    count = torch.zeros(t, tk, dtype=F64)
    for ti in range(t):
        for x in idx[ti].tolist():
            if x >= 0:
                count[ti, x] += 1
    logits = scale * torch.einsum("thd,sd->ths", q, kv)
    m = logits.detach().amax(-1)
    if sink is not None:
        m = torch.maximum(m, sink.detach().double())
    e = count[:, None, :] * torch.exp(logits - m[..., None])
    den = e.sum(-1) + (0 if sink is None else torch.exp(sink.double() - m))
    den_safe = torch.where(den > 0, den, torch.ones_like(den))  # empty rows: keep NaN out of the gradient
    lse = torch.where(den > 0, torch.log(den_safe) + m, torch.full_like(den, float("-inf")))
    o = torch.einsum("ths,sd->thd", e / den_safe[..., None], kv[:, :d_v])
    return o, lse


def finite0(x):
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


# ------------------------------------------------------------------ indexer_logits

LOGIT_CASES = [  # (S, Sk, causal, ratio, q_offset)
    (9, 9, True, 1, 0),
    (5, 11, True, 1, 6),
    (9, 3, True, 3, 0),
    (6, 4, True, 2, 3),
    (7, 5, False, 1, 0),
]


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("case", LOGIT_CASES)
@pytest.mark.parametrize("chunk", [None, 40])
def test_indexer_logits_matches_oracle(dtype, case, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(dsa, "_CHUNK_ELEMS", chunk)  # several query chunks
    s, sk, causal, ratio, q_offset = case
    b, h, d = 2, 3, 8
    q = rnd(b, s, h, d, dtype=dtype).requires_grad_()
    k = rnd(b, sk, d, dtype=dtype).requires_grad_()
    w = rnd(b, s, h, dtype=dtype).requires_grad_()
    kw = dict(causal=causal, ratio=ratio, q_offset=q_offset)
    out = indexer_logits(q, k, w, **kw)
    ref = oracle_logits(q, k, w, **kw)
    assert out.dtype == dtype and out.shape == (b, s, sk)
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), "mask differs"
    assert rel_l2(finite0(out), finite0(ref)) <= TOL[dtype]
    assert rel_l2(finite0(indexer_logits_ref(q, k, w, **kw)), finite0(ref)) <= TOL[dtype]
    g = rnd(b, s, sk, dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, w), g)
    grads_ref = torch.autograd.grad(finite0(ref), (q, k, w), g.double())
    for name, a, r in zip("q k w".split(), grads, grads_ref):
        assert a.dtype == dtype
        assert rel_l2(a, r) <= TOL[dtype], name


def test_indexer_logits_bf16_inputs_with_float32_weights():
    q, k = rnd(1, 6, 2, 16, dtype=torch.bfloat16), rnd(1, 6, 16, dtype=torch.bfloat16)
    w = rnd(1, 6, 2, dtype=F32)
    out = indexer_logits(q, k, w)
    assert out.dtype == F32
    assert rel_l2(finite0(out), finite0(oracle_logits(q, k, w))) <= 1e-5  # float32 math on bf16 values


def test_indexer_logits_ignores_gradient_at_masked_entries():
    q, k, w = rnd(1, 4, 2, 3).requires_grad_(), rnd(1, 4, 3).requires_grad_(), rnd(1, 4, 2).requires_grad_()
    out = indexer_logits(q, k, w)
    g = torch.where(torch.isinf(out), torch.full_like(out, float("nan")), torch.ones_like(out))
    grads = torch.autograd.grad(out, (q, k, w), g)
    ref = torch.autograd.grad(finite0(oracle_logits(q, k, w)), (q, k, w), torch.ones_like(out))
    for a, r in zip(grads, ref):
        assert rel_l2(a, r) <= 1e-6


def test_indexer_logits_gradcheck():
    q, k, w = rnd(1, 4, 2, 3).requires_grad_(), rnd(1, 5, 3).requires_grad_(), rnd(1, 4, 2).requires_grad_()
    vis = ~torch.isinf(indexer_logits(q, k, w, ratio=1, q_offset=1)).detach()
    f = lambda q, k, w: indexer_logits(q, k, w, q_offset=1).masked_fill(~vis, 0.0)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, w))


# ------------------------------------------------------------------ indexer_topk


@pytest.mark.parametrize("case", LOGIT_CASES)
@pytest.mark.parametrize("chunk", [None, 7])
def test_indexer_topk_matches_sorted_oracle(case, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(dsa, "_CHUNK_ELEMS", chunk)
    s, sk, causal, ratio, q_offset = case
    logits = indexer_logits(rnd(2, s, 2, 4), rnd(2, sk, 4), rnd(2, s, 2), causal=causal, ratio=ratio, q_offset=q_offset)
    for k in sorted({1, min(3, sk), sk}):
        out = indexer_topk(logits, k)
        assert out.dtype == torch.int32 and out.shape == (2, s, k)
        assert torch.equal(out, oracle_topk(logits, k))
        assert torch.equal(indexer_topk_ref(logits, k), out)


def test_indexer_topk_ties_go_to_the_lower_index_and_fewer_visible_give_minus_one():
    x = torch.randint(0, 3, (3, 6, 10)).double()  # many ties
    x[:, :, 7:] = float("-inf")
    x[0, 0] = float("-inf")  # a row with no visible key
    out = indexer_topk(x, 9)
    assert torch.equal(out, oracle_topk(x, 9))
    assert (out[:, :, 7:] == -1).all() and (out[0, 0] == -1).all()
    assert torch.equal(indexer_topk(x.float(), 4), oracle_topk(x, 4))


# ------------------------------------------------------------------ indexer_loss


def _loss_inputs(b, s, sk, h=3, d=8, hm=4, dm=6, hk=None, dtype=F64, device="cpu"):
    q = rnd(b, s, h, d, dtype=dtype, device=device).requires_grad_()
    k = rnd(b, sk, d, dtype=dtype, device=device).requires_grad_()
    w = rnd(b, s, h, dtype=dtype, device=device).requires_grad_()
    query = rnd(b, s, hm, dm, dtype=dtype, device=device)
    key = rnd(b, sk, dm, dtype=dtype, device=device) if hk is None else rnd(b, sk, hk, dm, dtype=dtype, device=device)
    return q, k, w, query, key


LOSS_CASES = [  # (S, Sk, causal, ratio, q_offset, topk)
    (9, 9, True, 1, 0, None),
    (9, 9, True, 1, 0, 4),
    (5, 11, True, 1, 6, 3),
    (9, 3, True, 3, 0, None),
    (9, 3, True, 3, 0, 2),
    (6, 4, True, 2, 3, 3),
    (7, 5, False, 1, 0, 2),
]


def _topk_for(q, k, w, topk, **kw):
    if topk is None:
        return None
    return indexer_topk(indexer_logits(q.detach(), k.detach(), w.detach(), **kw), topk)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("case", LOSS_CASES)
@pytest.mark.parametrize("chunk", [None, 100])
def test_indexer_loss_matches_oracle(dtype, case, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(dsa, "_CHUNK_ELEMS", chunk)
    s, sk, causal, ratio, q_offset, topk = case
    q, k, w, query, key = _loss_inputs(2, s, sk, dtype=dtype)
    kw = dict(causal=causal, ratio=ratio, q_offset=q_offset)
    idx = _topk_for(q, k, w, topk, **kw)
    loss = indexer_loss(q, k, w, query, key, 0.35, topk_indices=idx, loss_coeff=0.6, **kw)
    ref = oracle_loss(q, k, w, query, key, 0.35, idx, 0.6, **kw)
    assert loss.dtype == dtype and loss.dim() == 0
    assert rel_l2(loss, ref) <= TOL[dtype]
    assert rel_l2(indexer_loss_ref(q, k, w, query, key, 0.35, topk_indices=idx, loss_coeff=0.6, **kw), ref) <= TOL[dtype]
    grads = torch.autograd.grad(loss, (q, k, w))
    grads_ref = torch.autograd.grad(ref, (q, k, w))
    for name, a, r in zip("q k w".split(), grads, grads_ref):
        assert a.dtype == dtype
        assert rel_l2(a, r) <= TOL[dtype], name


def test_indexer_loss_gqa_key_lse_rows_and_per_token():
    q, k, w, query, key = _loss_inputs(2, 7, 7, hm=4, hk=2)
    rows = torch.rand(2, 7) > 0.3
    idx = _topk_for(q, k, w, 3)
    for tk in (None, idx):
        for per_token in (False, True):
            loss = indexer_loss(q, k, w, query, key, 0.5, topk_indices=tk, loss_coeff=1.3, query_valid_rows=rows,
                                calculate_per_token_loss=per_token)
            ref = oracle_loss(q, k, w, query, key, 0.5, tk, 1.3, rows=rows, per_token=per_token)
            assert rel_l2(loss, ref) <= 1e-6
            for a, r in zip(torch.autograd.grad(loss, (q, k, w)), torch.autograd.grad(ref, (q, k, w))):
                assert rel_l2(a, r) <= 1e-6
    # rows given as [S] broadcast over the batch
    loss = indexer_loss(q, k, w, query, key, 0.5, query_valid_rows=rows[0])
    assert rel_l2(loss, oracle_loss(q, k, w, query, key, 0.5, rows=rows[0].expand(2, 7))) <= 1e-6


def test_indexer_loss_attn_lse_from_sparse_mla_matches_renormalized_target():
    """Sparse variant: the main attention's LSE (from sparse_mla_attention) gives the same loss."""
    s, hm, dm = 8, 4, 6
    q, k, w, query, _ = _loss_inputs(1, s, s, hm=hm, dm=dm)
    kv = rnd(1, s, dm)
    idx = _topk_for(q, k, w, 3)  # only visible keys, no duplicates
    _, lse = sparse_mla_attention(query[0], kv[0], idx[0], 0.4, dm)
    with_lse = indexer_loss(q, k, w, query, kv, 0.4, topk_indices=idx, attn_lse=lse.unsqueeze(0))
    without = indexer_loss(q, k, w, query, kv, 0.4, topk_indices=idx)
    assert rel_l2(with_lse, without) <= 1e-6
    ref = oracle_loss(q, k, w, query, kv, 0.4, idx, lse=lse.unsqueeze(0))
    assert rel_l2(with_lse, ref) <= 1e-6
    for a, r in zip(torch.autograd.grad(with_lse, (q, k, w)), torch.autograd.grad(ref, (q, k, w))):
        assert rel_l2(a, r) <= 1e-6


def test_indexer_loss_sparse_duplicates_invisible_and_minus_one_indices():
    s = 7
    q, k, w, query, key = _loss_inputs(2, s, s)
    idx = torch.randint(-1, s, (2, s, 5))
    idx[0, 3] = torch.tensor([2, 2, 2, -1, 0])  # duplicates count once
    idx[1, 0] = -1  # empty row
    idx[1, 1] = torch.tensor([6, 5, 4, 3, 2])  # none visible to t=1: empty row
    loss = indexer_loss(q, k, w, query, key, 0.3, topk_indices=idx)
    ref = oracle_loss(q, k, w, query, key, 0.3, idx)
    assert rel_l2(loss, ref) <= 1e-6
    for a, r in zip(torch.autograd.grad(loss, (q, k, w)), torch.autograd.grad(ref, (q, k, w))):
        assert rel_l2(a, r) <= 1e-6


def test_indexer_loss_has_no_gradient_for_the_main_attention():
    q, k, w, query, key = _loss_inputs(1, 5, 5)
    query.requires_grad_()
    key.requires_grad_()
    loss = indexer_loss(q, k, w, query, key, 0.3)
    assert loss.grad_fn is not None
    loss.backward()
    assert query.grad is None and key.grad is None and q.grad is not None


def test_indexer_loss_gradcheck():
    q, k, w, query, key = _loss_inputs(1, 4, 4, h=2, d=3, hm=2, dm=3)
    idx = torch.tensor([[[0, -1], [1, 0], [2, 1], [0, 3]]])
    for tk in (None, idx):
        f = lambda q, k, w: indexer_loss(q, k, w, query, key, 0.7, topk_indices=tk, loss_coeff=0.9)  # noqa: E731
        assert torch.autograd.gradcheck(f, (q, k, w))


# ------------------------------------------------------------------ Megatron-core oracle


@pytest.fixture(scope="module")
def megatron_dsa():
    try:
        from megatron.core.transformer.experimental_attention_variant import dsa as mdsa
    except Exception as e:  # noqa: BLE001 - any import failure means no oracle
        pytest.skip(f"megatron-core DSA not importable: {type(e).__name__}: {e}")
    return mdsa


def _megatron_args(q, k, w, query, key, causal, ratio, q_offset):
    """Our [B, S, ...] tensors in Megatron's [S, B, ...] layout, plus its additive mask."""
    s, sk = q.shape[1], k.shape[1]
    mask = torch.zeros(s, sk, dtype=F32)
    for t in range(s):
        for j in range(sk):
            if not visible(t, j, causal, ratio, q_offset):
                mask[t, j] = float("-inf")
    hm = query.shape[2]
    key4 = key.unsqueeze(2).expand(-1, -1, hm, -1) if key.dim() == 3 else key
    return (q.detach().transpose(0, 1), w.detach().transpose(0, 1), k.detach().transpose(0, 1),
            query.transpose(0, 1), key4.transpose(0, 1).contiguous(), mask)


# no tensor parallelism: Megatron only asks the group for its size
_PG = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))


@pytest.mark.parametrize("case", LOSS_CASES)
def test_indexer_loss_matches_megatron(megatron_dsa, case):
    s, sk, causal, ratio, q_offset, topk = case
    q, k, w, query, key = _loss_inputs(2, s, sk, dtype=F32)
    kw = dict(causal=causal, ratio=ratio, q_offset=q_offset)
    sparse = topk is not None
    idx = _topk_for(q, k, w, topk if sparse else min(2, sk), **kw)
    rows = torch.rand(2, s) > 0.25
    mq, mw, mk, mquery, mkey, mask = _megatron_args(q, k, w, query, key, **kw)
    for per_token in (False, True):
        scores = megatron_dsa._compute_index_scores(mq, mw, mk)  # [b, sq, sk], unmasked
        m_loss = megatron_dsa.compute_dsa_indexer_loss(
            scores, idx, mquery, mkey, 0.45, 0.8, sparse, _PG, mask=mask, query_valid_rows=rows,
            calculate_per_token_loss=per_token)
        loss = indexer_loss(q, k, w, query, key, 0.45, topk_indices=idx if sparse else None, loss_coeff=0.8,
                            query_valid_rows=rows, calculate_per_token_loss=per_token, **kw)
        assert rel_l2(loss, m_loss) <= 1e-5
        gq, gw, gk = megatron_dsa.bwd_fused_indexer_loss_naive(
            mq, mw, mk, mquery, mkey, idx, 0.45, 0.8, sparse, mask, torch.tensor(1.0), _PG,
            query_valid_rows=rows, calculate_per_token_loss=per_token)
        dq, dk, dw = torch.autograd.grad(loss, (q, k, w))
        assert rel_l2(dq, gq.transpose(0, 1)) <= 1e-5
        assert rel_l2(dk, gk.transpose(0, 1)) <= 1e-5
        assert rel_l2(dw, gw.transpose(0, 1)) <= 1e-5


def test_indexer_loss_duplicates_match_megatron_set_semantics(megatron_dsa):
    q, k, w, query, key = _loss_inputs(1, 6, 6, dtype=F32)
    idx = torch.randint(-1, 6, (1, 6, 4))
    idx[0, 5] = torch.tensor([1, 1, 4, 4])
    mq, mw, mk, mquery, mkey, mask = _megatron_args(q, k, w, query, key, True, 1, 0)
    m_loss = megatron_dsa.compute_dsa_indexer_loss(
        megatron_dsa._compute_index_scores(mq, mw, mk), idx, mquery, mkey, 0.5, 1.0, True, _PG, mask=mask)
    assert rel_l2(indexer_loss(q, k, w, query, key, 0.5, topk_indices=idx), m_loss) <= 1e-5


def test_indexer_topk_matches_megatron(megatron_dsa):
    # positive inputs: every score is > 0 and distinct, so torch.topk's unspecified tie order
    # (Megatron's) cannot differ from ours (ties to the lower index)
    q, k, w = (rnd(*shape, dtype=F32).abs() + 0.1 for shape in ((2, 8, 3, 4), (2, 8, 4), (2, 8, 3)))
    mask = torch.triu(torch.full((8, 8), float("-inf")), diagonal=1)
    _, m_idx = megatron_dsa.fused_qk_topk_naive(q.transpose(0, 1), k.transpose(0, 1), w.transpose(0, 1), 5, mask)
    assert torch.equal(indexer_topk(indexer_logits(q, k, w), 5).long(), m_idx)


def test_sparse_mla_matches_megatron_unfused_absorbed(megatron_dsa):
    t, h, dqk, d_v, topk = 7, 4, 12, 8, 4
    q, kv = rnd(t, h, dqk, dtype=F32), rnd(t, dqk, dtype=F32)
    idx = torch.stack([torch.randperm(t)[:topk] for _ in range(t)])  # distinct keys per row
    idx[2, 1:] = -1
    m_out = megatron_dsa._unfused_absorbed_dsa_fn(
        q.unsqueeze(1), kv[:, None, None, :], idx.unsqueeze(0), 0.3, d_v, mask=torch.zeros(t, t))
    out, _ = sparse_mla_attention(q, kv, idx, 0.3, d_v)
    assert rel_l2(out, m_out[:, 0]) <= 1e-5


# ------------------------------------------------------------------ sparse_mla_attention

SMLA_CASES = [  # (T, Tk, H, Dqk, d_v, topk)
    (6, 9, 3, 16, 12, 4),
    (5, 5, 2, 8, 8, 5),
    (7, 20, 4, 24, 16, 6),
]


def _smla_indices(t, tk, topk):
    idx = torch.randint(-1, tk, (t, topk))
    idx[0] = -1  # an empty row
    idx[1, : min(3, topk)] = 0  # duplicates count with multiplicity
    return idx


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("case", SMLA_CASES)
@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("chunk", [None, 300])
def test_sparse_mla_matches_dense_oracle(dtype, case, with_sink, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(dsa, "_CHUNK_ELEMS", chunk)
    t, tk, h, dqk, d_v, topk = case
    q = rnd(t, h, dqk, dtype=dtype).requires_grad_()
    kv = rnd(tk, dqk, dtype=dtype).requires_grad_()
    sink = rnd(h, dtype=dtype).requires_grad_() if with_sink else None
    idx = _smla_indices(t, tk, topk)
    out, lse = sparse_mla_attention(q, kv, idx, 0.37, d_v, sink)
    o_ref, lse_ref = oracle_smla(q, kv, idx, 0.37, d_v, sink)
    assert out.dtype == dtype and lse.dtype == dtype and out.shape == (t, h, d_v) and lse.shape == (t, h)
    assert (out[0] == 0).all()
    if with_sink:
        assert torch.equal(lse[0], sink.detach())
    else:
        assert torch.isneginf(lse[0]).all()
    assert rel_l2(out, o_ref) <= TOL[dtype]
    assert rel_l2(finite0(lse), finite0(lse_ref)) <= TOL[dtype]
    o_r2, lse_r2 = sparse_mla_attention_ref(q, kv, idx, 0.37, d_v, sink)
    assert rel_l2(o_r2, o_ref) <= TOL[dtype] and rel_l2(finite0(lse_r2), finite0(lse_ref)) <= TOL[dtype]
    do, dl = rnd(t, h, d_v, dtype=dtype), rnd(t, h, dtype=dtype)
    ins = (q, kv) if sink is None else (q, kv, sink)
    grads = torch.autograd.grad((out * do).sum() + (finite0(lse) * dl).sum(), ins)
    grads_ref = torch.autograd.grad((o_ref * do.double()).sum() + (finite0(lse_ref) * dl.double()).sum(), ins)
    for name, a, r in zip(["q", "kv", "sink"], grads, grads_ref):
        assert a.dtype == dtype
        assert rel_l2(a, r) <= TOL[dtype], name


def test_sparse_mla_bf16_and_int32_indices():
    t, tk, h, dqk, d_v = 6, 8, 2, 32, 16
    q, kv = rnd(t, h, dqk, dtype=torch.bfloat16), rnd(tk, dqk, dtype=torch.bfloat16)
    sink = rnd(h, dtype=F32)
    idx = _smla_indices(t, tk, 4).int()
    out, lse = sparse_mla_attention(q, kv, idx, 0.2, d_v, sink)
    o_ref, lse_ref = oracle_smla(q, kv, idx, 0.2, d_v, sink)
    assert out.dtype == torch.bfloat16 and lse.dtype == F32
    assert rel_l2(lse, lse_ref) <= 1e-5
    assert rel_l2(out, o_ref) <= 8e-3  # float32 math, output rounded to bf16


def test_sparse_mla_deterministic_backward(monkeypatch):
    monkeypatch.setattr(dsa, "_CHUNK_ELEMS", 500)
    t, tk, h, dqk, d_v = 9, 6, 3, 8, 6
    q, kv, sink = rnd(t, h, dqk, dtype=F32), rnd(tk, dqk, dtype=F32), rnd(h, dtype=F32)
    idx = torch.randint(-1, tk, (t, 5))
    do, dl = rnd(t, h, d_v, dtype=F32), rnd(t, h, dtype=F32)

    def grads():
        qq, kk, ss = (x.clone().requires_grad_() for x in (q, kv, sink))
        o, lse = sparse_mla_attention(qq, kk, idx, 0.5, d_v, ss)
        return torch.autograd.grad((o * do).sum() + (finite0(lse) * dl).sum(), (qq, kk, ss))

    plain = grads()
    with backend.deterministic(True):
        det1, det2 = grads(), grads()
    for a, b_, c in zip(plain, det1, det2):
        assert torch.equal(b_, c)
        assert rel_l2(b_, a) <= 1e-6


def test_sparse_indexer_loss_deterministic_backward():
    q, k, w, query, key = _loss_inputs(2, 8, 8, dtype=F32)
    idx = _topk_for(q, k, w, 3)

    def grads():
        return torch.autograd.grad(indexer_loss(q, k, w, query, key, 0.3, topk_indices=idx), (q, k, w))

    plain = grads()
    with backend.deterministic(True):
        det1, det2 = grads(), grads()
    for a, b_, c in zip(plain, det1, det2):
        assert torch.equal(b_, c)
        assert rel_l2(b_, a) <= 1e-6


def test_sparse_mla_gradcheck():
    q, kv, sink = rnd(4, 2, 5).requires_grad_(), rnd(6, 5).requires_grad_(), rnd(2).requires_grad_()
    idx = torch.tensor([[0, 3, -1], [5, 5, 1], [-1, -1, -1], [2, 4, 0]])

    def f(q, kv, sink):
        o, lse = sparse_mla_attention(q, kv, idx, 0.6, 3, sink)
        return o, lse

    def g(q, kv):
        o, lse = sparse_mla_attention(q, kv, idx, 0.6, 4)
        return o, finite0(lse)

    assert torch.autograd.gradcheck(f, (q, kv, sink))
    assert torch.autograd.gradcheck(g, (q, kv))


# ------------------------------------------------------------------ torch.compile


def _compiled_matches(fn, inputs):
    eager_out = fn(*inputs)
    eager_g = torch.autograd.grad(eager_out, [x for x in inputs if x.requires_grad])
    comp = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out = comp(*inputs)
    g = torch.autograd.grad(out, [x for x in inputs if x.requires_grad])
    assert torch.allclose(out, eager_out)
    for a, b_ in zip(g, eager_g):
        assert torch.allclose(a, b_)


def test_compile_indexer_logits_and_topk():
    q, k, w = rnd(1, 5, 2, 4, dtype=F32).requires_grad_(), rnd(1, 5, 4, dtype=F32).requires_grad_(), \
        rnd(1, 5, 2, dtype=F32).requires_grad_()

    def f(q, k, w):
        logits = indexer_logits(q, k, w, ratio=1, q_offset=0)
        idx = indexer_topk(logits, 3)
        sel = torch.gather(finite0(logits), -1, idx.long().clamp_min(0)) * (idx >= 0)
        return sel.sum()

    _compiled_matches(f, (q, k, w))


def test_compile_indexer_loss():
    q, k, w, query, key = _loss_inputs(1, 5, 5, dtype=F32)
    idx = _topk_for(q, k, w, 3)

    def f(q, k, w):
        return indexer_loss(q, k, w, query, key, 0.3, topk_indices=idx, loss_coeff=0.5) + \
            indexer_loss(q, k, w, query, key, 0.3)

    _compiled_matches(f, (q, k, w))


def test_compile_sparse_mla_attention():
    q, kv, sink = rnd(4, 2, 8, dtype=F32).requires_grad_(), rnd(6, 8, dtype=F32).requires_grad_(), \
        rnd(2, dtype=F32).requires_grad_()
    idx = torch.randint(-1, 6, (4, 3))

    def f(q, kv, sink):
        o, lse = sparse_mla_attention(q, kv, idx, 0.3, 6, sink)
        return o.square().sum() + lse.sum()

    _compiled_matches(f, (q, kv, sink))


# ------------------------------------------------------------------ bad input


def test_bad_input_raises_value_error_naming_the_argument():
    q, k, w = rnd(1, 4, 2, 3), rnd(1, 4, 3), rnd(1, 4, 2)
    query, key = rnd(1, 4, 2, 5), rnd(1, 4, 5)
    cases = [
        ("index_q", lambda: indexer_logits(q[0], k, w)),
        ("index_k", lambda: indexer_logits(q, k.float(), w)),
        ("index_k", lambda: indexer_logits(q, rnd(1, 4, 4), w)),
        ("weights", lambda: indexer_logits(q, k, rnd(1, 4, 3))),
        ("weights", lambda: indexer_logits(q, k, w.float())),
        ("ratio", lambda: indexer_logits(q, k, w, ratio=0)),
        ("q_offset", lambda: indexer_logits(q, k, w, q_offset=-1)),
        ("causal", lambda: indexer_logits(q, k, w, causal=1)),
        ("weights", lambda: indexer_logits(q, k, w.to("meta"))),
        ("logits", lambda: indexer_topk(torch.zeros(4, 4), 2)),
        ("k", lambda: indexer_topk(torch.zeros(1, 4, 4), 5)),
        ("k", lambda: indexer_topk(torch.zeros(1, 4, 4), 0)),
        ("query", lambda: indexer_loss(q, k, w, rnd(1, 3, 2, 5), key, 0.3)),
        ("key", lambda: indexer_loss(q, k, w, query, rnd(1, 4, 6), 0.3)),
        ("key", lambda: indexer_loss(q, k, w, query, rnd(1, 4, 3, 5), 0.3)),
        ("key", lambda: indexer_loss(q, k, w, query, key.float(), 0.3)),
        ("softmax_scale", lambda: indexer_loss(q, k, w, query, key, 0.0)),
        ("topk_indices", lambda: indexer_loss(q, k, w, query, key, 0.3, topk_indices=torch.zeros(1, 4, 2))),
        ("topk_indices", lambda: indexer_loss(q, k, w, query, key, 0.3,
                                              topk_indices=torch.zeros(1, 4, 5, dtype=torch.long))),
        ("topk_indices", lambda: indexer_loss(q, k, w, query, key, 0.3,
                                              topk_indices=torch.full((1, 4, 2), 4, dtype=torch.long))),
        ("topk_indices", lambda: indexer_loss(q, k, w, query, key, 0.3,
                                              topk_indices=torch.full((1, 4, 2), -2, dtype=torch.long))),
        ("attn_lse", lambda: indexer_loss(q, k, w, query, key, 0.3, attn_lse=rnd(1, 4, 3))),
        ("query_valid_rows", lambda: indexer_loss(q, k, w, query, key, 0.3, query_valid_rows=torch.ones(4))),
        ("ratio", lambda: indexer_loss(q, k, w, query, key, 0.3, ratio=0)),
        ("loss_coeff", lambda: indexer_loss(q, k, w, query, key, 0.3, loss_coeff=float("nan"))),
    ]
    sq, skv, idx = rnd(4, 2, 6), rnd(5, 6), torch.zeros(4, 3, dtype=torch.long)
    cases += [
        ("q", lambda: sparse_mla_attention(sq[0], skv, idx, 0.3, 4)),
        ("kv", lambda: sparse_mla_attention(sq, skv.float(), idx, 0.3, 4)),
        ("kv", lambda: sparse_mla_attention(sq, rnd(5, 7), idx, 0.3, 4)),
        ("indices", lambda: sparse_mla_attention(sq, skv, idx.float(), 0.3, 4)),
        ("indices", lambda: sparse_mla_attention(sq, skv, idx[:3], 0.3, 4)),
        ("indices", lambda: sparse_mla_attention(sq, skv, torch.zeros(4, 6, dtype=torch.long), 0.3, 4)),
        ("indices", lambda: sparse_mla_attention(sq, skv, idx + 5, 0.3, 4)),
        ("indices", lambda: sparse_mla_attention(sq, skv, idx - 3, 0.3, 4)),
        ("softmax_scale", lambda: sparse_mla_attention(sq, skv, idx, -1.0, 4)),
        ("d_v", lambda: sparse_mla_attention(sq, skv, idx, 0.3, 7)),
        ("d_v", lambda: sparse_mla_attention(sq, skv, idx, 0.3, 0)),
        ("attn_sink", lambda: sparse_mla_attention(sq, skv, idx, 0.3, 4, rnd(3))),
        ("attn_sink", lambda: sparse_mla_attention(sq, skv, idx, 0.3, 4, rnd(2, dtype=F32))),
        ("attn_sink", lambda: sparse_mla_attention(sq, skv, idx, 0.3, 4, rnd(2).to("meta"))),
    ]
    for name, fn in cases:
        with pytest.raises(ValueError, match=name):
            fn()


# ------------------------------------------------------------------ GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("case", LOSS_CASES)
def test_gpu_indexer_ops_match_oracle(case):
    s, sk, causal, ratio, q_offset, topk = case
    kw = dict(causal=causal, ratio=ratio, q_offset=q_offset)
    q, k, w, query, key = _loss_inputs(2, s, sk, dtype=F32, device="cuda")
    logits = indexer_logits(q, k, w, **kw)
    ref = oracle_logits(q.cpu(), k.cpu(), w.cpu(), **kw)
    assert logits.is_cuda and torch.equal(torch.isinf(logits).cpu(), torch.isinf(ref))
    assert rel_l2(finite0(logits).cpu(), finite0(ref)) <= 1e-5
    g = rnd(*logits.shape, dtype=F32, device="cuda")
    qc, kc, wc = (x.detach().cpu().requires_grad_() for x in (q, k, w))
    for a, r in zip(torch.autograd.grad(logits, (q, k, w), g),
                    torch.autograd.grad(finite0(oracle_logits(qc, kc, wc, **kw)), (qc, kc, wc), g.cpu().double())):
        assert rel_l2(a.cpu(), r) <= 1e-5
    idx = indexer_topk(logits, topk or min(2, sk))
    assert torch.equal(idx.cpu(), oracle_topk(logits.cpu(), topk or min(2, sk)))
    tk = idx if topk else None
    loss = indexer_loss(q, k, w, query, key, 0.4, topk_indices=tk, loss_coeff=0.7, **kw)
    ref = oracle_loss(qc, kc, wc, query.cpu(), key.cpu(), 0.4, None if tk is None else tk.cpu(), 0.7, **kw)
    assert rel_l2(loss.cpu(), ref) <= 1e-5
    for a, r in zip(torch.autograd.grad(loss, (q, k, w)), torch.autograd.grad(ref, (qc, kc, wc))):
        assert rel_l2(a.cpu(), r) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("case", SMLA_CASES + [(33, 70, 16, 576, 512, 64)])
@pytest.mark.parametrize("with_sink", [False, True])
def test_gpu_sparse_mla_matches_oracle(case, with_sink):
    t, tk, h, dqk, d_v, topk = case
    q = rnd(t, h, dqk, dtype=F32, device="cuda", scale=dqk**-0.25).requires_grad_()
    kv = rnd(tk, dqk, dtype=F32, device="cuda", scale=dqk**-0.25).requires_grad_()
    sink = rnd(h, dtype=F32, device="cuda").requires_grad_() if with_sink else None
    idx = _smla_indices(t, tk, topk).cuda()
    out, lse = sparse_mla_attention(q, kv, idx, dqk**-0.5, d_v, sink)
    qc, kvc = q.detach().cpu().requires_grad_(), kv.detach().cpu().requires_grad_()
    sc = None if sink is None else sink.detach().cpu().requires_grad_()
    o_ref, lse_ref = oracle_smla(qc, kvc, idx.cpu(), dqk**-0.5, d_v, sc)
    assert rel_l2(out.cpu(), o_ref) <= 1e-5 and rel_l2(finite0(lse).cpu(), finite0(lse_ref)) <= 1e-5
    do, dl = rnd(t, h, d_v, dtype=F32, device="cuda"), rnd(t, h, dtype=F32, device="cuda")
    ins = (q, kv) if sink is None else (q, kv, sink)
    ins_c = (qc, kvc) if sink is None else (qc, kvc, sc)
    grads = torch.autograd.grad((out * do).sum() + (finite0(lse) * dl).sum(), ins)
    grads_ref = torch.autograd.grad((o_ref * do.cpu().double()).sum() + (finite0(lse_ref) * dl.cpu().double()).sum(),
                                    ins_c)
    for a, r in zip(grads, grads_ref):
        assert rel_l2(a.cpu(), r) <= 1e-5


@pytest.mark.gpu
def test_gpu_sparse_mla_bf16_matches_float32_reference():
    t, tk, h, dqk, d_v, topk = 64, 128, 16, 576, 512, 32
    q = rnd(t, h, dqk, dtype=torch.bfloat16, device="cuda").requires_grad_()
    kv = rnd(tk, dqk, dtype=torch.bfloat16, device="cuda").requires_grad_()
    idx = _smla_indices(t, tk, topk).cuda()
    out, lse = sparse_mla_attention(q, kv, idx, dqk**-0.5, d_v)
    qf, kvf = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    o_ref, lse_ref = sparse_mla_attention_ref(qf, kvf, idx, dqk**-0.5, d_v)
    assert rel_l2(finite0(lse), finite0(lse_ref)) <= 1e-5
    assert rel_l2(out, o_ref) <= 8e-3  # bf16 output rounding only
    do = torch.randn_like(o_ref)
    for a, r in zip(torch.autograd.grad(out, (q, kv), do.bfloat16()), torch.autograd.grad(o_ref, (qf, kvf), do)):
        assert rel_l2(a, r) <= 8e-3


@pytest.mark.gpu
def test_gpu_deterministic_mode_is_bitwise_reproducible():
    t, tk, h, dqk, d_v = 256, 64, 16, 576, 512
    q, kv = rnd(t, h, dqk, dtype=F32, device="cuda"), rnd(tk, dqk, dtype=F32, device="cuda")
    idx = torch.randint(-1, tk, (t, 48), device="cuda")  # many queries per key: contended scatter
    do = rnd(t, h, d_v, dtype=F32, device="cuda")

    def grads():
        qq, kk = q.clone().requires_grad_(), kv.clone().requires_grad_()
        o, _ = sparse_mla_attention(qq, kk, idx, 0.05, d_v)
        return torch.autograd.grad(o, (qq, kk), do)

    with backend.deterministic(True):
        a, b_ = grads(), grads()
    assert all(torch.equal(x, y) for x, y in zip(a, b_))
    iq, ik, iw, query, key = _loss_inputs(1, 64, 64, h=8, d=32, hm=4, dm=16, dtype=F32, device="cuda")
    tk_idx = _topk_for(iq, ik, iw, 16)
    with backend.deterministic(True):
        g1 = torch.autograd.grad(indexer_loss(iq, ik, iw, query, key, 0.2, topk_indices=tk_idx), (iq, ik, iw))
        g2 = torch.autograd.grad(indexer_loss(iq, ik, iw, query, key, 0.2, topk_indices=tk_idx), (iq, ik, iw))
    assert all(torch.equal(x, y) for x, y in zip(g1, g2))

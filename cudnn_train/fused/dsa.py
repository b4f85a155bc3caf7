"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): lightning-indexer scores, top-k selection,
the indexer KL loss, and sparse MLA attention over the selected keys.

Notation: B batch, S queries, Sk keys, H index heads of dim D; the main attention has Hm heads.

Visibility (``causal=True``): query t sees key s iff ``s < (q_offset + t + 1) // ratio``; with
``ratio = 1`` and ``q_offset = 0`` that is plain causal (s <= t). ``ratio > 1`` is for keys that
each summarize ``ratio`` tokens (key s covers tokens ``[s*ratio, (s+1)*ratio)`` and is visible once
all of them are); ``q_offset`` is the position of query 0 (a query chunk in a longer sequence).
With ``causal=False`` every key is visible.

    indexer_logits   I[t, s] = sum_h weights[t, h] * relu(index_q[t, h] . index_k[s]);
                     -inf where s is not visible. Output float32 [B, S, Sk].
    indexer_topk     the k keys of largest I per query, int32 [B, S, k]: descending score,
                     ties to the lower key index; -1 for the slots beyond the visible keys.
    indexer_loss     KL(target || softmax(I)) over the visible keys (dense) or over the visible
                     selected keys (sparse), target = main-attention probabilities summed over
                     heads and L1-normalized; Megatron-core's ``compute_dsa_indexer_loss``
                     conventions (mean over rows, times loss_coeff). Gradients reach index_q,
                     index_k and weights only.
    sparse_mla_attention
                     MQA over the selected keys: K = V = kv (V the first d_v columns), optional
                     per-head attention sink; returns o and the natural-log LSE.

Every op: a readable reference ``<name>_ref`` (float32 math, float64 when given float64), a
``backend.Op`` (``cutedsl`` reserved for Hopper kernels, then ``torch``: the memory-frugal
chunked implementation here), a ``torch.library`` custom op with a fake implementation (so
``torch.compile(fullgraph=True)`` traces it) and an ``autograd.Function`` around it.
Formulas, conventions and what declines: docs/ops/dsa.md.

Memory: the torch backends process the queries in chunks so that no temporary exceeds about
``_CHUNK_ELEMS`` elements (plus the outputs and one float32 copy of the keys): e.g. sparse MLA
at T=4096, topk=2048, H=16, Dqk=576 never materializes the [T, topk, Dqk] gathered keys.

Determinism: every reduction of the torch backends runs in a fixed order except the scatter-add
of per-slot key gradients (sparse MLA dkv, sparse indexer-loss d index_k). That uses
``index_add_`` (atomics on CUDA) unless ``backend.is_deterministic()``, where it sorts the slots by
key, reduces each key's run with ``torch.segment_reduce`` (one thread per output element, in
order) and adds the per-key sums with unique indices: bitwise reproducible, at the cost of a
sort and a host sync per query chunk.
"""

from __future__ import annotations

import math

import torch

from .. import backend
from .._validate import FLOAT_DTYPES, HALF_DTYPES, check_same_device, check_tensor, compute_dtype

__all__ = [
    "indexer_logits",
    "indexer_logits_ref",
    "indexer_topk",
    "indexer_topk_ref",
    "indexer_loss",
    "indexer_loss_ref",
    "sparse_mla_attention",
    "sparse_mla_attention_ref",
    "INDEXER_LOSS_EPS",
]

INDEXER_LOSS_EPS = 1e-10  # Megatron-core's clamp for the target's L1 norm and for log(target)
INDEX_DTYPES = (torch.int32, torch.int64)
_CHUNK_ELEMS = 1 << 26  # bound on a chunk's largest temporary, in elements (256 MiB of float32)
_NEG_INF = float("-inf")

logits_fwd_op = backend.Op("dsa_indexer_logits", ["cutedsl", "torch"])
logits_bwd_op = backend.Op("dsa_indexer_logits_bwd", ["cutedsl", "torch"])
topk_op = backend.Op("dsa_indexer_topk", ["cutedsl", "torch"])
loss_fwd_op = backend.Op("dsa_indexer_loss", ["cutedsl", "torch"])
loss_bwd_op = backend.Op("dsa_indexer_loss_bwd", ["cutedsl", "torch"])
smla_fwd_op = backend.Op("sparse_mla_attention", ["cutedsl", "torch"])
smla_bwd_op = backend.Op("sparse_mla_attention_bwd", ["cutedsl", "torch"])


# ---------------------------------------------------------------- argument checks


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)) or v < lo:
        raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    return v


def _check_bool(name: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{name}: expected a bool, got {v!r}")
    return v


def _check_scale(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name}: expected a finite positive float, got {v!r}")
    return float(v)


def _check_side_dtype(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    """A side tensor (weights, attn_sink) has ref's dtype, or float32 when ref is 16-bit."""
    ok = t.dtype == ref.dtype or (ref.dtype in HALF_DTYPES and t.dtype == torch.float32)
    if not ok:
        raise ValueError(
            f"{name}: dtype {str(t.dtype).replace('torch.', '')} must be {ref_name}'s dtype "
            f"{str(ref.dtype).replace('torch.', '')}" + (" or float32" if ref.dtype in HALF_DTYPES else "")
        )


def _check_visibility(causal, ratio, q_offset) -> None:
    _check_bool("causal", causal)
    _check_int("ratio", ratio, 1)
    _check_int("q_offset", q_offset, 0)


def _check_indexer_inputs(index_q, index_k, weights) -> None:
    check_tensor("index_q", index_q, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("index_k", index_k, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("weights", weights, dtypes=FLOAT_DTYPES, ndim=3)
    b, s, h, d = index_q.shape
    if h < 1 or d < 1:
        raise ValueError(f"index_q: expected at least one head of dim >= 1, got shape {tuple(index_q.shape)}")
    if index_k.dtype != index_q.dtype:
        raise ValueError(f"index_k: expected index_q's dtype {index_q.dtype}, got {index_k.dtype}")
    if index_k.shape[0] != b or index_k.shape[2] != d:
        raise ValueError(f"index_k: expected shape ({b}, Sk, {d}) to match index_q, got {tuple(index_k.shape)}")
    if tuple(weights.shape) != (b, s, h):
        raise ValueError(f"weights: expected shape {(b, s, h)} to match index_q, got {tuple(weights.shape)}")
    _check_side_dtype("weights", weights, index_q, "index_q")
    check_same_device(index_q=index_q, index_k=index_k, weights=weights)


def _check_index_values(name: str, idx: torch.Tensor, n: int) -> None:
    """Data check (a host sync): every index is -1 (no key) or in [0, n)."""
    if idx.numel() == 0:
        return
    lo, hi = torch.aminmax(idx)
    lo, hi = int(lo), int(hi)
    if lo < -1 or hi >= n:
        raise ValueError(f"{name}: values must be -1 (no key) or in [0, {n}), got values in [{lo}, {hi}]")


# ---------------------------------------------------------------- shared helpers


def _n_visible(t0: int, t1: int, sk: int, causal: bool, ratio: int, q_offset: int, device) -> torch.Tensor:
    """Number of visible keys of queries t0..t1-1 (the visible keys are 0..n-1), int64."""
    t = torch.arange(t0, t1, device=device, dtype=torch.int64)
    if not causal:
        return torch.full_like(t, sk)
    return torch.clamp((q_offset + t + 1) // ratio, max=sk)


def _kmax(t1: int, sk: int, causal: bool, ratio: int, q_offset: int) -> int:
    """Keys visible to the last query of a chunk ending at t1 (so to every query of it)."""
    return min(sk, (q_offset + t1) // ratio) if causal else sk


def _rows_per_chunk(elems_per_row: int) -> int:
    return max(1, _CHUNK_ELEMS // max(1, elems_per_row))


def _first_occurrence(idx: torch.Tensor) -> torch.Tensor:
    """[R, k] bool: True at the first slot holding each value of its row (duplicates after it False)."""
    if idx.shape[-1] <= 1:
        return torch.ones_like(idx, dtype=torch.bool)
    sorted_idx, order = torch.sort(idx, dim=-1, stable=True)
    dup_sorted = torch.zeros_like(idx, dtype=torch.bool)
    dup_sorted[..., 1:] = sorted_idx[..., 1:] == sorted_idx[..., :-1]
    return ~torch.empty_like(dup_sorted).scatter_(-1, order, dup_sorted)


def _scatter_add_rows_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index[i]] += src[i]``; without float atomics when ``backend.is_deterministic()``."""
    if index.numel() == 0:
        return
    if backend.is_deterministic():
        order = torch.argsort(index, stable=True)
        keys, counts = torch.unique_consecutive(index[order], return_counts=True)
        sums = torch.segment_reduce(src[order], "sum", lengths=counts, axis=0)
        dst.index_add_(0, keys, sums)  # unique keys: one add per element, no race
    else:
        dst.index_add_(0, index, src)


def _masked_log_softmax(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log softmax over the valid entries of the last dim; 0 at invalid entries (and empty rows)."""
    m = x.masked_fill(~valid, _NEG_INF).amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    z = torch.where(valid, x - m, torch.full_like(x, _NEG_INF))
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    return torch.where(valid, z - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)), torch.zeros_like(x))


def _masked_softmax(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """softmax over the valid entries of the last dim; 0 at invalid entries (all 0 in empty rows)."""
    m = x.masked_fill(~valid, _NEG_INF).amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(valid, torch.exp(x - m), torch.zeros_like(x))
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


# ================================================================ indexer_logits


def indexer_logits_ref(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    *,
    causal: bool = True,
    ratio: int = 1,
    q_offset: int = 0,
) -> torch.Tensor:
    """Oracle: ``I[b,t,s] = sum_h w[b,t,h] relu(q[b,t,h] . k[b,s])``, -inf where s is not visible."""
    _check_indexer_inputs(index_q, index_k, weights)
    _check_visibility(causal, ratio, q_offset)
    ct = compute_dtype(index_q)
    scores = torch.einsum("bthd,bsd->bths", index_q.to(ct), index_k.to(ct))
    logits = torch.einsum("bth,bths->bts", weights.to(ct), torch.relu(scores))
    s, sk = index_q.shape[1], index_k.shape[1]
    n_vis = _n_visible(0, s, sk, causal, ratio, q_offset, index_q.device)
    visible = torch.arange(sk, device=index_q.device)[None, :] < n_vis[:, None]
    return logits.masked_fill(~visible, _NEG_INF)


@logits_fwd_op.register("torch")
def _logits_fwd_torch(q, k, w, causal, ratio, q_offset):
    b, s, h, d = q.shape
    sk = k.shape[1]
    ct = compute_dtype(q)
    out = torch.full((b, s, sk), _NEG_INF, dtype=ct, device=q.device)
    rows = _rows_per_chunk(2 * h * sk)
    for bi in range(b):
        kf = k[bi].to(ct)
        for t0 in range(0, s, rows):
            t1 = min(s, t0 + rows)
            kmax = _kmax(t1, sk, causal, ratio, q_offset)
            if kmax == 0:
                continue
            c = t1 - t0
            qf = q[bi, t0:t1].to(ct)  # [C, H, D]
            sc = (qf.reshape(c * h, d) @ kf[:kmax].T).view(c, h, kmax).clamp_min_(0)
            logit = (w[bi, t0:t1].to(ct).unsqueeze(1) @ sc).squeeze(1)  # [C, kmax]
            n_vis = _n_visible(t0, t1, sk, causal, ratio, q_offset, q.device)
            visible = torch.arange(kmax, device=q.device)[None, :] < n_vis[:, None]
            out[bi, t0:t1, :kmax] = logit.masked_fill_(~visible, _NEG_INF)
    return out


@logits_bwd_op.register("torch")
def _logits_bwd_torch(dlogits, q, k, w, causal, ratio, q_offset):
    b, s, h, d = q.shape
    sk = k.shape[1]
    ct = compute_dtype(q)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk = torch.zeros(k.shape, dtype=ct, device=q.device)
    dw = torch.zeros(w.shape, dtype=ct, device=q.device)
    rows = _rows_per_chunk(3 * h * sk)
    for bi in range(b):
        kf = k[bi].to(ct)
        for t0 in range(0, s, rows):
            t1 = min(s, t0 + rows)
            kmax = _kmax(t1, sk, causal, ratio, q_offset)
            if kmax == 0:
                continue
            c = t1 - t0
            qf = q[bi, t0:t1].to(ct)
            wf = w[bi, t0:t1].to(ct)
            sc = (qf.reshape(c * h, d) @ kf[:kmax].T).view(c, h, kmax)
            n_vis = _n_visible(t0, t1, sk, causal, ratio, q_offset, q.device)
            visible = torch.arange(kmax, device=q.device)[None, :] < n_vis[:, None]
            g = torch.where(visible, dlogits[bi, t0:t1, :kmax].to(ct), torch.zeros((), dtype=ct, device=q.device))
            dw[bi, t0:t1] = (sc.clamp_min(0) @ g.unsqueeze(-1)).squeeze(-1)
            gs = g.unsqueeze(1) * wf.unsqueeze(-1) * (sc > 0)  # d(q.k) [C, H, kmax]
            dq[bi, t0:t1] = gs @ kf[:kmax]
            dk[bi, :kmax] += gs.reshape(c * h, kmax).T @ qf.reshape(c * h, d)
    return dq.to(q.dtype), dk.to(k.dtype), dw.to(w.dtype)


@torch.library.custom_op("cudnn_train::dsa_indexer_logits_fwd", mutates_args=())
def _logits_fwd_custom(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, causal: bool, ratio: int, q_offset: int
) -> torch.Tensor:
    return logits_fwd_op(q, k, w, causal, ratio, q_offset)


@_logits_fwd_custom.register_fake
def _(q, k, w, causal, ratio, q_offset):
    return q.new_empty((q.shape[0], q.shape[1], k.shape[1]), dtype=compute_dtype(q))


@torch.library.custom_op("cudnn_train::dsa_indexer_logits_bwd", mutates_args=())
def _logits_bwd_custom(
    dlogits: torch.Tensor, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, causal: bool, ratio: int, q_offset: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return logits_bwd_op(dlogits, q, k, w, causal, ratio, q_offset)


@_logits_bwd_custom.register_fake
def _(dlogits, q, k, w, causal, ratio, q_offset):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(w)


class _IndexerLogitsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, w, causal, ratio, q_offset):
        if torch.compiler.is_compiling():
            out = _logits_fwd_custom(q, k, w, causal, ratio, q_offset)
        else:
            out = logits_fwd_op(q, k, w, causal, ratio, q_offset)
        ctx.save_for_backward(q, k, w)
        ctx.args = (causal, ratio, q_offset)
        return out

    @staticmethod
    def backward(ctx, dlogits):
        q, k, w = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dq, dk, dw = _logits_bwd_custom(dlogits, q, k, w, *ctx.args)
        else:
            dq, dk, dw = logits_bwd_op(dlogits, q, k, w, *ctx.args)
        return dq, dk, dw, None, None, None


def indexer_logits(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    *,
    causal: bool = True,
    ratio: int = 1,
    q_offset: int = 0,
) -> torch.Tensor:
    """Lightning-indexer scores ``I[b,t,s] = sum_h weights[b,t,h] * relu(index_q[b,t,h] . index_k[b,s])``.

    index_q ``[B, S, H, D]``, index_k ``[B, Sk, D]`` (same dtype), weights ``[B, S, H]`` (index_q's
    dtype, or float32 with 16-bit index_q). Returns float32 ``[B, S, Sk]`` (float64 for float64
    inputs), ``-inf`` where key s is not visible to query t (``causal``: visible iff
    ``s < (q_offset + t + 1) // ratio``). Differentiable in index_q, index_k and weights; the
    incoming gradient at masked entries is ignored (they are constants).
    """
    _check_indexer_inputs(index_q, index_k, weights)
    _check_visibility(causal, ratio, q_offset)
    return _IndexerLogitsFn.apply(index_q, index_k, weights, causal, int(ratio), int(q_offset))


# ================================================================ indexer_topk


def _check_topk_args(logits, k) -> None:
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=3)
    _check_int("k", k, 1)
    if k > logits.shape[2]:
        raise ValueError(f"k: {k} is larger than the number of keys Sk = {logits.shape[2]}")


def indexer_topk_ref(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Oracle: a stable descending sort of each row, the first k, -1 where the score is -inf."""
    _check_topk_args(logits, k)
    vals, idx = torch.sort(logits, dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :k], idx[..., :k]
    return idx.masked_fill(vals == _NEG_INF, -1).to(torch.int32)


@topk_op.register("torch")
def _topk_torch(logits, k):
    b, s, sk = logits.shape
    out = torch.empty((b * s, k), dtype=torch.int32, device=logits.device)
    flat = logits.reshape(b * s, sk)
    rows = _rows_per_chunk(4 * sk)
    for r0 in range(0, b * s, rows):
        r1 = min(b * s, r0 + rows)
        vals, idx = torch.sort(flat[r0:r1], dim=-1, descending=True, stable=True)
        out[r0:r1] = idx[:, :k].masked_fill(vals[:, :k] == _NEG_INF, -1)
    return out.view(b, s, k)


@torch.library.custom_op("cudnn_train::dsa_indexer_topk", mutates_args=())
def _topk_custom(logits: torch.Tensor, k: int) -> torch.Tensor:
    return topk_op(logits, k)


@_topk_custom.register_fake
def _(logits, k):
    return logits.new_empty((logits.shape[0], logits.shape[1], k), dtype=torch.int32)


def indexer_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The k best keys of each query: int32 ``[B, S, k]`` from logits ``[B, S, Sk]`` (``1 <= k <= Sk``).

    Order: descending score, equal scores by ascending key index (a stable sort). Keys scored
    ``-inf`` (not visible) are never selected: when a row has fewer than k finite scores its
    remaining slots are -1, after the valid ones. NaN sorts above every number (torch's order).
    Not differentiable.
    """
    _check_topk_args(logits, k)
    if torch.compiler.is_compiling():
        return _topk_custom(logits, int(k))
    return topk_op(logits, int(k))


# ================================================================ indexer_loss


def _check_loss_inputs(index_q, index_k, weights, query, key, softmax_scale, topk_indices, attn_lse, query_valid_rows,
                       loss_coeff, calculate_per_token_loss):
    _check_indexer_inputs(index_q, index_k, weights)
    b, s = index_q.shape[:2]
    sk = index_k.shape[1]
    check_tensor("query", query, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("key", key, dtypes=FLOAT_DTYPES, ndim=(3, 4))
    if query.shape[0] != b or query.shape[1] != s:
        raise ValueError(f"query: expected shape ({b}, {s}, Hm, Dm) to match index_q, got {tuple(query.shape)}")
    hm, dm = query.shape[2], query.shape[3]
    if hm < 1 or dm < 1:
        raise ValueError(f"query: expected at least one head of dim >= 1, got shape {tuple(query.shape)}")
    if key.dtype != query.dtype:
        raise ValueError(f"key: expected query's dtype {query.dtype}, got {key.dtype}")
    if key.shape[0] != b or key.shape[1] != sk or key.shape[-1] != dm:
        want = f"({b}, {sk}, {dm}) or ({b}, {sk}, Hk, {dm})"
        raise ValueError(f"key: expected shape {want} to match index_k and query, got {tuple(key.shape)}")
    if key.dim() == 4 and (key.shape[2] < 1 or hm % key.shape[2] != 0):
        raise ValueError(f"key: its head count {key.shape[2]} must divide query's {hm}")
    _check_scale("softmax_scale", softmax_scale)
    if isinstance(loss_coeff, bool) or not isinstance(loss_coeff, (int, float)) or not math.isfinite(loss_coeff):
        raise ValueError(f"loss_coeff: expected a finite float, got {loss_coeff!r}")
    _check_bool("calculate_per_token_loss", calculate_per_token_loss)
    if topk_indices is not None:
        check_tensor("topk_indices", topk_indices, dtypes=INDEX_DTYPES, ndim=3)
        if topk_indices.shape[0] != b or topk_indices.shape[1] != s:
            raise ValueError(f"topk_indices: expected shape ({b}, {s}, topk), got {tuple(topk_indices.shape)}")
        if topk_indices.shape[2] < 1 or topk_indices.shape[2] > sk:
            raise ValueError(f"topk_indices: topk = {topk_indices.shape[2]} must be in [1, Sk = {sk}]")
    if attn_lse is not None:
        check_tensor("attn_lse", attn_lse, dtypes=FLOAT_DTYPES, ndim=3)
        if tuple(attn_lse.shape) != (b, s, hm):
            raise ValueError(f"attn_lse: expected shape {(b, s, hm)}, got {tuple(attn_lse.shape)}")
    if query_valid_rows is not None:
        check_tensor("query_valid_rows", query_valid_rows, dtypes=(torch.bool,), ndim=(1, 2))
        if tuple(query_valid_rows.shape) not in ((s,), (b, s), (1, s)):
            raise ValueError(f"query_valid_rows: expected shape ({s},) or ({b}, {s}), got {tuple(query_valid_rows.shape)}")
    check_same_device(index_q=index_q, query=query, key=key, topk_indices=topk_indices, attn_lse=attn_lse,
                      query_valid_rows=query_valid_rows)


def indexer_loss_ref(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    softmax_scale: float,
    *,
    topk_indices: torch.Tensor | None = None,
    loss_coeff: float = 1.0,
    causal: bool = True,
    ratio: int = 1,
    q_offset: int = 0,
    attn_lse: torch.Tensor | None = None,
    query_valid_rows: torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
) -> torch.Tensor:
    """Oracle: the whole [B, S, Sk] computation at once (see ``indexer_loss`` for the formula)."""
    _check_loss_inputs(index_q, index_k, weights, query, key, softmax_scale, topk_indices, attn_lse, query_valid_rows,
                       loss_coeff, calculate_per_token_loss)
    _check_visibility(causal, ratio, q_offset)
    ct = compute_dtype(index_q)
    b, s, h, d = index_q.shape
    sk = index_k.shape[1]
    hm = query.shape[2]
    dev = index_q.device

    # which keys take part: visible, and (sparse) selected
    n_vis = _n_visible(0, s, sk, causal, ratio, q_offset, dev)
    valid = (torch.arange(sk, device=dev)[None, :] < n_vis[:, None]).expand(b, s, sk)
    if topk_indices is not None:
        _check_index_values("topk_indices", topk_indices, sk)
        idx = topk_indices.long()
        chosen = torch.zeros(b, s, sk + 1, dtype=torch.bool, device=dev)
        chosen.scatter_(-1, torch.where(idx >= 0, idx, sk), True)
        valid = valid & chosen[..., :sk]

    # target: main-attention probabilities over those keys, summed over heads, L1-normalized
    qm = query.detach().to(ct)
    km = key.detach().to(ct)
    if km.dim() == 3:
        km = km.unsqueeze(2)
    hk = km.shape[2]
    main = torch.einsum("btgjd,bsgd->btgjs", qm.view(b, s, hk, hm // hk, -1), km).reshape(b, s, hm, sk)
    main = main * softmax_scale
    vh = valid.unsqueeze(2).expand(b, s, hm, sk)
    if attn_lse is None:
        probs = _masked_softmax(main, vh)
    else:
        lse = attn_lse.detach().to(ct).unsqueeze(-1)
        probs = torch.where(vh, torch.exp(main - lse), torch.zeros_like(main))
    target = probs.sum(dim=2)
    target = target / target.sum(dim=-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)

    # prediction: log softmax of the indexer scores over the same keys
    scores = torch.einsum("bthd,bsd->bths", index_q.to(ct), index_k.to(ct))
    logits = torch.einsum("bth,bths->bts", weights.to(ct), torch.relu(scores))
    logp = _masked_log_softmax(logits, valid)

    kl = torch.where(valid, target * (torch.log(target.clamp_min(INDEXER_LOSS_EPS)) - logp), torch.zeros_like(logp))
    kl_rows = kl.sum(dim=-1)  # [B, S]
    if query_valid_rows is None:
        rows = torch.ones(b, s, dtype=ct, device=dev)
    else:
        rows = query_valid_rows.expand(b, s).to(ct)
    total = (kl_rows * rows).sum()
    if not calculate_per_token_loss:
        total = total / rows.sum().clamp_min(1.0)
    return total * loss_coeff


def _loss_torch(q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token, grad):
    """Chunked loss; with ``grad`` (the incoming scalar gradient) also (dq, dk, dw) in float32."""
    b, s, h, d = q.shape
    sk = k.shape[1]
    hm, dm = query.shape[2], query.shape[3]
    ct = compute_dtype(q)
    dev = q.device
    zero = torch.zeros((), dtype=ct, device=dev)
    km_all = key.unsqueeze(2) if key.dim() == 3 else key  # [B, Sk, Hk, Dm]
    hk = km_all.shape[2]
    rows_f = torch.ones(b, s, dtype=ct, device=dev) if rows_mask is None else rows_mask.expand(b, s).to(ct)
    denom = 1.0 if per_token else float(max(float(rows_f.sum()), 1.0))
    sparse = topk is not None
    n_sel = topk.shape[2] if sparse else sk
    per_row = n_sel * (3 * h + 3 * hm) + (n_sel * (d + hk * dm) if sparse else 0)
    rows = _rows_per_chunk(per_row)
    total = torch.zeros((), dtype=ct, device=dev)
    if grad is not None:
        gscale = grad.to(ct) * coeff / denom
        dq = torch.zeros(q.shape, dtype=ct, device=dev)
        dk = torch.zeros(k.shape, dtype=ct, device=dev)
        dw = torch.zeros(w.shape, dtype=ct, device=dev)
    for bi in range(b):
        kf = k[bi].to(ct)
        kmf = km_all[bi].to(ct)
        for t0 in range(0, s, rows):
            t1 = min(s, t0 + rows)
            c = t1 - t0
            n_vis = _n_visible(t0, t1, sk, causal, ratio, q_offset, dev)
            qf = q[bi, t0:t1].to(ct)  # [C, H, D]
            wf = w[bi, t0:t1].to(ct)  # [C, H]
            qm = query[bi, t0:t1].to(ct).view(c, hk, hm // hk, dm)
            if sparse:
                idx = topk[bi, t0:t1].long()  # [C, k]
                valid = (idx >= 0) & (idx < n_vis[:, None]) & _first_occurrence(idx)
                idc = idx.clamp_min(0)
                kg = kf[idc]  # [C, k, D]
                sc = qf @ kg.transpose(1, 2)  # [C, H, k]
                main = torch.einsum("tgjd,tngd->tgjn", qm, kmf[idc]).reshape(c, hm, n_sel)
            else:
                kmax = _kmax(t1, sk, causal, ratio, q_offset)
                if kmax == 0:
                    continue
                valid = torch.arange(kmax, device=dev)[None, :] < n_vis[:, None]
                sc = (qf.reshape(c * h, d) @ kf[:kmax].T).view(c, h, kmax)
                main = torch.einsum("tgjd,sgd->tgjs", qm, kmf[:kmax]).reshape(c, hm, kmax)
            main = main * scale
            vh = valid.unsqueeze(1).expand_as(main)
            if lse is None:
                probs = _masked_softmax(main, vh)
            else:
                lsec = lse[bi, t0:t1].to(ct).unsqueeze(-1)
                probs = torch.where(vh, torch.exp(main - lsec), zero)
            target = probs.sum(dim=1)
            target = target / target.sum(dim=-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)
            logit = (wf.unsqueeze(1) @ sc.clamp_min(0)).squeeze(1)  # [C, n]
            logp = _masked_log_softmax(logit, valid)
            kl = torch.where(valid, target * (torch.log(target.clamp_min(INDEXER_LOSS_EPS)) - logp), zero).sum(-1)
            total = total + (kl * rows_f[bi, t0:t1]).sum()
            if grad is None:
                continue
            # d loss / d logit = scale * row_mask * (softmax * sum(target) - target) on the valid keys
            p = torch.where(valid, torch.exp(logp), zero)
            g = (p * target.sum(dim=-1, keepdim=True) - target) * (gscale * rows_f[bi, t0:t1]).unsqueeze(-1)
            g = torch.where(valid, g, zero)
            dw[bi, t0:t1] = (sc.clamp_min(0) @ g.unsqueeze(-1)).squeeze(-1)
            gs = g.unsqueeze(1) * wf.unsqueeze(-1) * (sc > 0)  # [C, H, n]
            if sparse:
                dq[bi, t0:t1] = gs @ kg
                contrib = gs.transpose(1, 2) @ qf  # [C, k, D]
                _scatter_add_rows_(dk[bi], idc[valid], contrib[valid])
            else:
                dq[bi, t0:t1] = gs @ kf[:kmax]
                dk[bi, :kmax] += gs.reshape(c * h, kmax).T @ qf.reshape(c * h, d)
    loss = total * (coeff / denom)
    if grad is None:
        return loss
    return dq.to(q.dtype), dk.to(k.dtype), dw.to(w.dtype)


@loss_fwd_op.register("torch")
def _loss_fwd_torch(q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token):
    return _loss_torch(q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token, None)


@loss_bwd_op.register("torch")
def _loss_bwd_torch(grad, q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token):
    return _loss_torch(q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token, grad)


def _loss_fwd_impl(q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token):
    if topk is not None:
        _check_index_values("topk_indices", topk, k.shape[1])
    return loss_fwd_op(q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token)


@torch.library.custom_op("cudnn_train::dsa_indexer_loss_fwd", mutates_args=())
def _loss_fwd_custom(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, query: torch.Tensor, key: torch.Tensor, scale: float,
    topk: torch.Tensor | None, coeff: float, causal: bool, ratio: int, q_offset: int, lse: torch.Tensor | None,
    rows_mask: torch.Tensor | None, per_token: bool,
) -> torch.Tensor:
    return _loss_fwd_impl(q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token)


@_loss_fwd_custom.register_fake
def _(q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token):
    return q.new_empty((), dtype=compute_dtype(q))


@torch.library.custom_op("cudnn_train::dsa_indexer_loss_bwd", mutates_args=())
def _loss_bwd_custom(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
    scale: float, topk: torch.Tensor | None, coeff: float, causal: bool, ratio: int, q_offset: int,
    lse: torch.Tensor | None, rows_mask: torch.Tensor | None, per_token: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return loss_bwd_op(grad, q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token)


@_loss_bwd_custom.register_fake
def _(grad, q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(w)


class _IndexerLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token):
        args = (scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token)
        if torch.compiler.is_compiling():
            loss = _loss_fwd_custom(q, k, w, query, key, *args)
        else:
            loss = _loss_fwd_impl(q, k, w, query, key, *args)
        ctx.save_for_backward(q, k, w, query, key, topk, lse, rows_mask)
        ctx.scalars = (scale, coeff, causal, ratio, q_offset, per_token)
        return loss

    @staticmethod
    def backward(ctx, grad):
        q, k, w, query, key, topk, lse, rows_mask = ctx.saved_tensors
        scale, coeff, causal, ratio, q_offset, per_token = ctx.scalars
        args = (grad, q, k, w, query, key, scale, topk, coeff, causal, ratio, q_offset, lse, rows_mask, per_token)
        if torch.compiler.is_compiling():
            dq, dk, dw = _loss_bwd_custom(*args)
        else:
            dq, dk, dw = loss_bwd_op(*args)
        return dq, dk, dw, *([None] * 11)


def indexer_loss(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    weights: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    softmax_scale: float,
    *,
    topk_indices: torch.Tensor | None = None,
    loss_coeff: float = 1.0,
    causal: bool = True,
    ratio: int = 1,
    q_offset: int = 0,
    attn_lse: torch.Tensor | None = None,
    query_valid_rows: torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
) -> torch.Tensor:
    """The DSA indexer's KL loss (a scalar), Megatron-core ``compute_dsa_indexer_loss`` semantics.

    Indexer side: index_q ``[B, S, H, D]``, index_k ``[B, Sk, D]``, weights ``[B, S, H]`` as in
    ``indexer_logits``; gradients flow to these three only. Main-attention side (treated as
    constants, never differentiated): query ``[B, S, Hm, Dm]``, key ``[B, Sk, Dm]`` (one shared key,
    MLA / MQA) or ``[B, Sk, Hk, Dm]`` (Hk divides Hm; query head j uses key head j // (Hm/Hk)),
    softmax_scale its logit scale.

    Per query t, the key set K_t: the visible keys (``causal``, ``ratio``, ``q_offset`` as in
    ``indexer_logits``); with ``topk_indices`` ``[B, S, topk]`` (int32/int64, -1 = empty slot; the
    sparse variant) only the visible keys it names, each counted once however often it appears.

        P_j[t, s] = softmax_{s in K_t}(softmax_scale * query[t, j] . key[s])     or, given attn_lse
                    [B, S, Hm] (the main attention's natural-log LSE over K_t): exp(logit - lse)
        target    = sum_j P_j / max(sum_s sum_j P_j, 1e-10)
        KL_t      = sum_{s in K_t} target * (log(max(target, 1e-10)) - log_softmax_{K_t}(I)[t, s])
        loss      = loss_coeff * sum_t r_t KL_t / max(sum_t r_t, 1)     (r_t = query_valid_rows, or 1)
                    loss_coeff * sum_t r_t KL_t                          if calculate_per_token_loss

    query_valid_rows: bool ``[S]`` or ``[B, S]`` (padding rows False). A row with an empty K_t
    contributes 0 but is still counted in the mean (as in Megatron). Returns a float32 scalar
    (float64 for float64 index_q). The backward recomputes everything (nothing [S, Sk] is saved).
    """
    _check_loss_inputs(index_q, index_k, weights, query, key, softmax_scale, topk_indices, attn_lse, query_valid_rows,
                       loss_coeff, calculate_per_token_loss)
    _check_visibility(causal, ratio, q_offset)
    if query_valid_rows is not None and query_valid_rows.dim() == 1:
        query_valid_rows = query_valid_rows.unsqueeze(0)
    return _IndexerLossFn.apply(
        index_q, index_k, weights, query.detach(), key.detach(), float(softmax_scale),
        None if topk_indices is None else topk_indices.detach(), float(loss_coeff), causal, int(ratio),
        int(q_offset), None if attn_lse is None else attn_lse.detach(), query_valid_rows, calculate_per_token_loss,
    )


# ================================================================ sparse_mla_attention


def _check_smla_inputs(q, kv, indices, softmax_scale, d_v, attn_sink) -> None:
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("kv", kv, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("indices", indices, dtypes=INDEX_DTYPES, ndim=2)
    t, h, dqk = q.shape
    if h < 1 or dqk < 1:
        raise ValueError(f"q: expected at least one head of dim >= 1, got shape {tuple(q.shape)}")
    if kv.dtype != q.dtype:
        raise ValueError(f"kv: expected q's dtype {q.dtype}, got {kv.dtype}")
    if kv.shape[1] != dqk:
        raise ValueError(f"kv: expected shape (Tk, {dqk}) to match q's last dim, got {tuple(kv.shape)}")
    if indices.shape[0] != t:
        raise ValueError(f"indices: expected shape ({t}, topk) to match q, got {tuple(indices.shape)}")
    if indices.shape[1] < 1 or indices.shape[1] > kv.shape[0]:
        raise ValueError(f"indices: topk = {indices.shape[1]} must be in [1, Tk = {kv.shape[0]}]")
    _check_scale("softmax_scale", softmax_scale)
    _check_int("d_v", d_v, 1)
    if d_v > dqk:
        raise ValueError(f"d_v: {d_v} is larger than the key dim Dqk = {dqk}")
    if attn_sink is not None:
        check_tensor("attn_sink", attn_sink, dtypes=FLOAT_DTYPES, ndim=1)
        if attn_sink.shape[0] != h:
            raise ValueError(f"attn_sink: expected shape ({h},), got {tuple(attn_sink.shape)}")
        _check_side_dtype("attn_sink", attn_sink, q, "q")
    check_same_device(q=q, kv=kv, indices=indices, attn_sink=attn_sink)


def _lse_with_sink(logits: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """log(sum_k exp(logits[..., k]) + exp(sink)) over the last dim; -inf when everything is -inf."""
    m = logits.amax(dim=-1)
    if sink is not None:
        m = torch.maximum(m, sink.expand_as(m))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    tot = torch.exp(logits - m.unsqueeze(-1)).sum(dim=-1)
    if sink is not None:
        tot = tot + torch.exp(sink - m)
    return torch.log(tot) + m


def sparse_mla_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle: gather every selected key at once, softmax with the sink as one more logit."""
    _check_smla_inputs(q, kv, indices, softmax_scale, d_v, attn_sink)
    _check_index_values("indices", indices, kv.shape[0])
    ct = compute_dtype(q)
    idx = indices.long()
    valid = idx >= 0
    keys = kv.to(ct)[idx.clamp_min(0)]  # [T, topk, Dqk]
    logits = torch.einsum("thd,tkd->thk", q.to(ct), keys) * softmax_scale
    logits = logits.masked_fill(~valid.unsqueeze(1), _NEG_INF)
    sink = None if attn_sink is None else attn_sink.to(ct)
    lse = _lse_with_sink(logits, sink)  # [T, H]
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(logits - safe_lse.unsqueeze(-1))  # 0 at skipped slots
    out = torch.einsum("thk,tkd->thd", probs, keys[..., :d_v])
    return out.to(q.dtype), lse


@smla_fwd_op.register("torch")
def _smla_fwd_torch(q, kv, idx, scale, d_v, sink):
    t, h, dqk = q.shape
    topk = idx.shape[1]
    ct = compute_dtype(q)
    out = torch.empty((t, h, d_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((t, h), dtype=ct, device=q.device)
    kvf = kv.to(ct)
    sinkf = None if sink is None else sink.to(ct)
    rows = _rows_per_chunk(topk * (dqk + 3 * h))
    for t0 in range(0, t, rows):
        t1 = min(t, t0 + rows)
        ic = idx[t0:t1].long()
        keys = kvf[ic.clamp_min(0)]  # [C, topk, Dqk]
        logit = (q[t0:t1].to(ct) @ keys.transpose(1, 2)) * scale  # [C, H, topk]
        logit.masked_fill_((ic < 0).unsqueeze(1), _NEG_INF)
        lse_c = _lse_with_sink(logit, sinkf)
        safe = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
        p = torch.exp(logit - safe.unsqueeze(-1))
        out[t0:t1] = p @ keys[..., :d_v]
        lse[t0:t1] = lse_c
    return out, lse


@smla_bwd_op.register("torch")
def _smla_bwd_torch(do, dlse, q, kv, idx, lse, scale, d_v, sink):
    t, h, dqk = q.shape
    topk = idx.shape[1]
    ct = compute_dtype(q)
    dev = q.device
    dq = torch.empty((t, h, dqk), dtype=ct, device=dev)
    dkv = torch.zeros(kv.shape, dtype=ct, device=dev)
    kvf = kv.to(ct)
    sinkf = None if sink is None else sink.to(ct)
    dsink = None if sink is None else torch.zeros(h, dtype=ct, device=dev)
    rows = _rows_per_chunk(topk * (2 * dqk + 4 * h))
    for t0 in range(0, t, rows):
        t1 = min(t, t0 + rows)
        ic = idx[t0:t1].long()
        valid = ic >= 0
        icc = ic.clamp_min(0)
        keys = kvf[icc]
        qc = q[t0:t1].to(ct)
        doc = do[t0:t1].to(ct)
        dlc = dlse[t0:t1].to(ct)
        logit = (qc @ keys.transpose(1, 2)) * scale
        logit.masked_fill_(~valid.unsqueeze(1), _NEG_INF)
        lse_c = lse[t0:t1].to(ct)
        finite = torch.isfinite(lse_c)
        safe = torch.where(finite, lse_c, torch.zeros_like(lse_c))
        p = torch.exp(logit - safe.unsqueeze(-1))  # [C, H, topk]
        dp = doc @ keys[..., :d_v].transpose(1, 2)  # do . v  [C, H, topk]
        delta = (p * dp).sum(dim=-1)  # do . o  [C, H]
        ds = p * (dp - (delta - dlc).unsqueeze(-1))  # d logit
        if sinkf is not None:
            p_sink = torch.where(finite, torch.exp(sinkf - safe), torch.zeros_like(safe))
            dsink += (p_sink * (dlc - delta)).sum(dim=0)
        dq[t0:t1] = (ds @ keys) * scale
        contrib = (ds.transpose(1, 2) @ qc) * scale  # [C, topk, Dqk]
        contrib[..., :d_v] += p.transpose(1, 2) @ doc
        _scatter_add_rows_(dkv, icc[valid], contrib[valid])
    return dq.to(q.dtype), dkv.to(kv.dtype), None if sink is None else dsink.to(sink.dtype)


def _smla_fwd_impl(q, kv, idx, scale, d_v, sink):
    _check_index_values("indices", idx, kv.shape[0])
    return smla_fwd_op(q, kv, idx, scale, d_v, sink)


@torch.library.custom_op("cudnn_train::sparse_mla_attention_fwd", mutates_args=())
def _smla_fwd_custom(
    q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float, d_v: int, sink: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _smla_fwd_impl(q, kv, idx, scale, d_v, sink)
    return out, lse


@_smla_fwd_custom.register_fake
def _(q, kv, idx, scale, d_v, sink):
    t, h, _ = q.shape
    return q.new_empty((t, h, d_v)), q.new_empty((t, h), dtype=compute_dtype(q))


@torch.library.custom_op("cudnn_train::sparse_mla_attention_bwd", mutates_args=())
def _smla_bwd_custom(
    do: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, lse: torch.Tensor,
    scale: float, d_v: int, sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dkv, dsink = smla_bwd_op(do, dlse, q, kv, idx, lse, scale, d_v, sink)
    if dsink is None:  # custom ops cannot return None: an empty placeholder
        dsink = q.new_empty(0)
    return dq, dkv, dsink


@_smla_bwd_custom.register_fake
def _(do, dlse, q, kv, idx, lse, scale, d_v, sink):
    dsink = q.new_empty(0) if sink is None else torch.empty_like(sink)
    return torch.empty_like(q), torch.empty_like(kv), dsink


class _SparseMLAFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, scale, d_v, sink):
        if torch.compiler.is_compiling():
            out, lse = _smla_fwd_custom(q, kv, idx, scale, d_v, sink)
        else:
            out, lse = _smla_fwd_impl(q, kv, idx, scale, d_v, sink)
        ctx.save_for_backward(q, kv, idx, lse, sink)
        ctx.scale, ctx.d_v = scale, d_v
        return out, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, kv, idx, lse, sink = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dq, dkv, dsink = _smla_bwd_custom(do, dlse, q, kv, idx, lse, ctx.scale, ctx.d_v, sink)
            dsink = None if sink is None else dsink
        else:
            dq, dkv, dsink = smla_bwd_op(do, dlse, q, kv, idx, lse, ctx.scale, ctx.d_v, sink)
        return dq, dkv, None, None, None, dsink


def sparse_mla_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MQA over selected keys (DeepSeek-V3.2 MLA in its absorbed form).

    q ``[T, H, Dqk]``, kv ``[Tk, Dqk]`` (same dtype; K = kv, V = kv[:, :d_v]), indices ``[T, topk]``
    int32/int64 into kv's rows, -1 = empty slot (``1 <= topk <= Tk``; every other value in
    ``[0, Tk)``; a batch is flattened by the caller: row ``b*Sk + s``). attn_sink ``[H]`` (q's
    dtype, or float32 for 16-bit q): a per-head logit that joins the softmax denominator only.

        l[t,h,j] = softmax_scale * q[t,h] . kv[indices[t,j]]          (slots with -1 skipped)
        lse[t,h] = log(sum_j exp(l[t,h,j]) + exp(attn_sink[h]))       (natural log)
        o[t,h]   = sum_j exp(l[t,h,j] - lse[t,h]) * kv[indices[t,j], :d_v]

    Each slot counts: a key named twice weighs twice. A row with no valid slot gives o = 0 and
    lse = -inf (lse = attn_sink[h] with a sink). Returns (o in q's dtype, lse float32 [T, H];
    float64 for float64 q). Differentiable in q, kv (scatter-add over the selected keys), attn_sink,
    through both o and lse.
    """
    _check_smla_inputs(q, kv, indices, softmax_scale, d_v, attn_sink)
    return _SparseMLAFn.apply(q, kv, indices.detach(), float(softmax_scale), int(d_v), attn_sink)

"""CSA compressor: gated-softmax pooling of blocks of ``ratio`` tokens (DeepSeek-V4 style).

Packed (THD) layout: ``kv`` and ``score`` are ``[T, coff*d]``, ``cu_seqlens`` holds the
``B + 1`` token offsets of the sequences. Each sequence ``s`` is cut into
``n_s = len_s // ratio`` blocks of ``ratio`` tokens (the tail ``len_s % ratio`` tokens are
dropped) and every block gives one output row; rows are ordered by sequence, then block,
so the output is ``[total_comp, d]`` with ``total_comp = sum_s n_s`` and the compressed
offsets ``cu_seqlens_comp = [0, cumsum(n_s)]`` (:func:`csa_cu_seqlens_comp`).

For block ``b`` of sequence ``s`` (first token ``t0 = cu_seqlens[s] + b*ratio``) the window
has ``W = coff*ratio`` slots ``k``, each with a token row ``tok(k)``, a column half and an
APE row; per channel ``j`` in ``[0, d)``::

    coff == 1:  k in [0, ratio):        tok = t0 + k,            columns [0, d),  APE row k
    coff == 2:  k in [0, ratio):        tok = t0 - ratio + k,    columns [0, d),  APE row k
                                        (the previous block; invalid for b == 0)
                k in [ratio, 2*ratio):  tok = t0 + k - ratio,    columns [d, 2d), APE row k - ratio

    z[k, j]  = score[tok(k), col(k, j)] + ape[k % ratio, col(k, j)]     (-inf where invalid)
    out[j]   = sum_k softmax_k(z[:, j])[k] * kv[tok(k), col(k, j)]        (kv is 0 where invalid)

so with ``coff == 2`` the first ``d`` columns of ``kv``/``score``/``ape`` are the
"overlap" projection a token contributes to the *next* block and the last ``d`` columns
the one it contributes to its own block. This is the mapping of DeepSeek-V4's reference
``Compressor`` (``score.unflatten(...) + ape`` and then ``overlap_transform``: APE is added
per token slot before the window is assembled) and of cuDNN frontend's CSA compressor
("k in [0, ratio): previous block's token, first-half projection column, APE row k;
k in [ratio, 2*ratio): own block's token, second-half projection column, APE row
k - ratio").

Backends, in order: ``cutedsl`` (Hopper kernels, to come) then ``torch`` (closed-form
forward and backward below, vectorized over blocks: no per-block Python loop). Forward
and backward are separate dispatch points (``csa_compress`` and ``csa_compress_bwd``).
Math is float32 whatever the input dtype (float64 for float64 inputs); the output has
kv's dtype and each gradient the dtype of its input. The torch backward writes every
``dkv``/``dscore`` element exactly once (no accumulation: each token sits in at most one
own slot and one previous-block slot) and ``dape`` is a plain reduction over the rows, so
it is bitwise reproducible in every mode: ``deterministic(True)`` costs nothing here.

Host synchronization: the output size ``total_comp`` depends on the values of
``cu_seqlens``. Eager calls without ``total_comp`` read ``cu_seqlens`` once (one host
copy of ``B + 1`` integers) to validate it and size the output; pass ``total_comp`` (an
int; rows past the true count are zero padding, e.g. for a static CUDA-graph capacity)
to avoid that copy, in which case ``cu_seqlens`` values on a GPU are trusted (they are
still checked when ``cu_seqlens`` lives on the CPU). Under ``torch.compile`` an omitted
``total_comp`` becomes a data-dependent (unbacked) size and no value checks run.
"""

from __future__ import annotations

import torch

from .. import backend
from .._validate import FLOAT_DTYPES, check_same_device, check_tensor, compute_dtype

__all__ = [
    "csa_compress",
    "csa_compress_ref",
    "csa_cu_seqlens_comp",
    "csa_comp_positions",
    "COFFS",
]

COFFS = (1, 2)
INDEX_DTYPES = (torch.int32, torch.int64)

fwd_op = backend.Op("csa_compress", ["cutedsl", "torch"])
bwd_op = backend.Op("csa_compress_bwd", ["cutedsl", "torch"])


# ---------------------------------------------------------------- block bookkeeping


def csa_cu_seqlens_comp(cu_seqlens: torch.Tensor, ratio: int) -> torch.Tensor:
    """Compressed offsets ``[0, cumsum(len_s // ratio)]``, same dtype and device, no host sync."""
    _check_ratio(ratio)
    check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
    if cu_seqlens.numel() == 0:
        raise ValueError("cu_seqlens: expected B + 1 >= 1 offsets, got an empty tensor")
    return _cu_comp(cu_seqlens, ratio)


def _cu_comp(cu_seqlens: torch.Tensor, ratio: int) -> torch.Tensor:
    n = torch.div(cu_seqlens[1:] - cu_seqlens[:-1], ratio, rounding_mode="floor")
    return torch.cat([cu_seqlens.new_zeros(1), n.cumsum(0).to(cu_seqlens.dtype)])


def _rows(cu_seqlens: torch.Tensor, cu_comp: torch.Tensor, total_comp: int, ratio: int):
    """Per output row: its first token ``t0``, its block index ``b`` and whether it is real.

    Rows at or past ``cu_comp[-1]`` are padding (``real`` False, clamped onto row 0's
    sequence so every index stays in range).
    """
    device = cu_seqlens.device
    cu = cu_seqlens.long()
    cc = cu_comp.long()
    rows = torch.arange(total_comp, device=device)
    nseq = cu.numel() - 1
    seq = torch.searchsorted(cc[1:], rows, right=True).clamp_max(max(nseq - 1, 0))
    real = rows < cc[-1]
    blk = torch.where(real, rows - cc[seq], 0)
    t0 = torch.where(real, cu[seq] + blk * ratio, 0)
    return t0, blk, real


def csa_comp_positions(cu_seqlens_comp: torch.Tensor, total_comp: int, ratio: int) -> torch.Tensor:
    """Position (within its sequence) of the first token of each compressed row: ``b * ratio``.

    int64 ``[total_comp]``; padding rows (past ``cu_seqlens_comp[-1]``) get 0.
    """
    cc = cu_seqlens_comp.long()
    rows = torch.arange(total_comp, device=cc.device)
    seq = torch.searchsorted(cc[1:], rows, right=True).clamp_max(max(cc.numel() - 2, 0))
    return torch.where(rows < cc[-1], (rows - cc[seq]) * ratio, 0)


# ---------------------------------------------------------------- reference


def csa_compress_ref(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ratio: int,
    coff: int,
) -> torch.Tensor:
    """The readable reference (autograd-differentiable): assemble every window, softmax, sum.

    float32 math (float64 for float64 kv), output in kv's dtype, exactly ``total_comp`` rows.
    """
    _check_ratio(ratio)
    _check_coff(coff)
    ct = compute_dtype(kv)
    t, width = kv.shape
    d = width // coff
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    starts = cu_seqlens[:-1].tolist()
    kv3 = kv.to(ct).reshape(t, coff, d)
    z3 = (score.to(ct)).reshape(t, coff, d)
    ape3 = ape.to(ct).reshape(ratio, coff, d)
    rows = []
    for s0, n in zip(starts, lens):
        nb = n // ratio
        if nb == 0:
            continue
        own = s0 + torch.arange(nb * ratio, device=kv.device).view(nb, ratio)  # [nb, ratio]
        kv_w = kv3[own, coff - 1]  # [nb, ratio, d]
        z_w = z3[own, coff - 1] + ape3[:, coff - 1]
        if coff == 2:
            # the previous block's tokens, first column half; the first block has none
            kv_prev = torch.cat([torch.zeros_like(kv_w[:1]), kv3[own[:-1], 0]], dim=0)
            z_prev = torch.cat([torch.full_like(z_w[:1], float("-inf")), z3[own[:-1], 0] + ape3[:, 0]], dim=0)
            kv_w = torch.cat([kv_prev, kv_w], dim=1)
            z_w = torch.cat([z_prev, z_w], dim=1)
        rows.append((torch.softmax(z_w, dim=1) * kv_w).sum(dim=1))
    if not rows:
        return kv.new_zeros(0, d)
    return torch.cat(rows, dim=0).to(kv.dtype)


# ---------------------------------------------------------------- torch backend (closed form)


def _windows(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff):
    """Gather the windows ``kv_w``, ``z_w``: ``[C, coff*ratio, d]`` in the compute dtype.

    Also returns each row's own token rows ``own`` ``[C, ratio]`` (padding rows point at
    the row ``T``, one past the end, so that a backward can write them into a spare row),
    the block index and the real-row mask. Needs T >= 1.
    """
    ct = compute_dtype(kv)
    t, width = kv.shape
    d = width // coff
    t0, blk, real = _rows(cu_seqlens, cu_comp, total_comp, ratio)
    own = t0[:, None] + torch.arange(ratio, device=kv.device)  # [C, ratio]
    own_read = torch.where(real[:, None], own, 0)  # padding rows read token 0, then get weight 0
    kv3 = kv.reshape(t, coff, d)
    z3 = score.reshape(t, coff, d)
    ape3 = ape.to(ct).reshape(ratio, coff, d)
    kv_own = kv3[own_read, coff - 1].to(ct)
    z_own = z3[own_read, coff - 1].to(ct) + ape3[:, coff - 1]
    if coff == 1:
        kv_w, z_w = kv_own, z_own
    else:
        valid = (blk > 0)[:, None, None]  # padding rows have blk 0
        prev = (own_read - ratio).clamp_min(0)
        kv_prev = torch.where(valid, kv3[prev, 0].to(ct), 0.0)
        z_prev = torch.where(valid, z3[prev, 0].to(ct) + ape3[:, 0], float("-inf"))
        kv_w = torch.cat([kv_prev, kv_own], dim=1)
        z_w = torch.cat([z_prev, z_own], dim=1)
    own_write = torch.where(real[:, None], own, t)
    return kv_w, z_w, own_write, blk, real


def _softmax_pool(kv_w, z_w, real):
    w = torch.softmax(z_w, dim=1)
    w = torch.where(real[:, None, None], w, 0.0)  # padding rows are zero
    return w, (w * kv_w).sum(dim=1)


def _torch_fwd(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff):
    if kv.shape[0] == 0:  # no tokens: every row is padding
        return kv.new_zeros(total_comp, kv.shape[1] // coff)
    kv_w, z_w, _, _, real = _windows(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff)
    _, out = _softmax_pool(kv_w, z_w, real)
    return out.to(kv.dtype)


def _torch_bwd(dout, kv, score, ape, cu_seqlens, cu_comp, ratio, coff):
    """dkv, dscore, dape of ``_torch_fwd`` (recomputes the windows; float32 math).

    With w = softmax(z) and out = sum_k w_k kv_k:  dkv_k = w_k * dout and
    dz_k = w_k * dout * (kv_k - out). Each token owns one slot per column half, so the
    gradients are gathered per own slot (the previous-block half from the next row) and
    written once; dape sums dz over the rows.
    """
    ct = compute_dtype(kv)
    t, width = kv.shape
    d = width // coff
    if t == 0:
        return torch.zeros_like(kv), torch.zeros_like(score), torch.zeros_like(ape)
    total_comp = dout.shape[0]
    kv_w, z_w, own, blk, real = _windows(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff)
    w, out = _softmax_pool(kv_w, z_w, real)
    g = dout.to(ct)[:, None, :]
    dkv_w = w * g
    dz_w = w * g * (kv_w - out[:, None, :])
    if coff == 1:
        dkv_slots = dkv_w[:, :, None, :]  # [C, ratio, 1, d]
        dz_slots = dz_w[:, :, None, :]
        dape = dz_w.sum(dim=0)
    else:
        # Row c's own tokens fill the previous-block slots of row c + 1 when that row is
        # the next block of the same sequence: shift the first half of the window up a row.
        nxt = torch.cat([(blk[1:] > 0) & real[1:], torch.zeros_like(real[:1])])[:, None, None]

        def shift_up(x):
            return torch.where(nxt, torch.cat([x[1:], torch.zeros_like(x[:1])]), 0.0)

        dkv_slots = torch.stack([shift_up(dkv_w[:, :ratio]), dkv_w[:, ratio:]], dim=2)  # [C, ratio, 2, d]
        dz_slots = torch.stack([shift_up(dz_w[:, :ratio]), dz_w[:, ratio:]], dim=2)
        dape = torch.cat([dz_w[:, :ratio].sum(dim=0), dz_w[:, ratio:].sum(dim=0)], dim=1)
    # one write per token (padding rows land in the spare row T); tokens in no block stay 0
    dkv = torch.zeros(t + 1, coff, d, dtype=ct, device=kv.device)
    dscore = torch.zeros(t + 1, coff, d, dtype=ct, device=kv.device)
    idx = own.reshape(-1)
    dkv[idx] = dkv_slots.reshape(-1, coff, d)
    dscore[idx] = dz_slots.reshape(-1, coff, d)
    dkv = dkv[:t].reshape(t, width).to(kv.dtype)
    dscore = dscore[:t].reshape(t, width).to(score.dtype)
    return dkv, dscore, dape.to(ape.dtype)


@fwd_op.register("torch")
def _fwd_torch(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff):
    return _torch_fwd(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff)


@bwd_op.register("torch")
def _bwd_torch(dout, kv, score, ape, cu_seqlens, cu_comp, ratio, coff):
    return _torch_bwd(dout, kv, score, ape, cu_seqlens, cu_comp, ratio, coff)


# ---------------------------------------------------------------- custom ops (torch.compile)


@torch.library.custom_op("cudnn_train::csa_compress_fwd", mutates_args=())
def _fwd_custom(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_comp: torch.Tensor,
    total_comp: int,
    ratio: int,
    coff: int,
) -> torch.Tensor:
    if total_comp < 0:  # traced without a static size: read it now
        total_comp = int(cu_comp[-1].item())
    return fwd_op(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff)


@_fwd_custom.register_fake
def _(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff):
    rows = total_comp if total_comp >= 0 else torch.library.get_ctx().new_dynamic_size()
    return kv.new_empty(rows, kv.shape[1] // coff)


@torch.library.custom_op("cudnn_train::csa_compress_bwd", mutates_args=())
def _bwd_custom(
    dout: torch.Tensor,
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_comp: torch.Tensor,
    ratio: int,
    coff: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return bwd_op(dout, kv, score, ape, cu_seqlens, cu_comp, ratio, coff)


@_bwd_custom.register_fake
def _(dout, kv, score, ape, cu_seqlens, cu_comp, ratio, coff):
    return torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)


# ---------------------------------------------------------------- autograd


class _CSACompressFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff):
        if torch.compiler.is_compiling():
            out = _fwd_custom(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff)
        else:  # eager: skip the custom-op dispatcher
            out = fwd_op(kv, score, ape, cu_seqlens, cu_comp, total_comp, ratio, coff)
        ctx.save_for_backward(kv, score, ape, cu_seqlens, cu_comp)
        ctx.ratio, ctx.coff = ratio, coff
        return out

    @staticmethod
    def backward(ctx, dout):
        kv, score, ape, cu_seqlens, cu_comp = ctx.saved_tensors
        dout = dout.contiguous()
        if torch.compiler.is_compiling():
            dkv, dscore, dape = _bwd_custom(dout, kv, score, ape, cu_seqlens, cu_comp, ctx.ratio, ctx.coff)
        else:
            dkv, dscore, dape = bwd_op(dout, kv, score, ape, cu_seqlens, cu_comp, ctx.ratio, ctx.coff)
        return dkv, dscore, dape, None, None, None, None, None


# ---------------------------------------------------------------- public function


def _check_ratio(ratio: object) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio: expected an int >= 1, got {ratio!r}")


def _check_coff(coff: object) -> None:
    if isinstance(coff, bool) or coff not in COFFS:
        raise ValueError(f"coff: expected 1 or 2, got {coff!r}")


def _check_cu_values(cu: list[int], t: int) -> None:
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: must start at 0, got {cu[0]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: must be non-decreasing, got {cu}")
    if cu[-1] != t:
        raise ValueError(f"cu_seqlens: must end at the number of tokens T={t} (kv's rows), got {cu[-1]}")


def csa_compress(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ratio: int,
    coff: int,
    *,
    cu_seqlens_comp: torch.Tensor | None = None,
    total_comp: int | None = None,
) -> torch.Tensor:
    """Gated-softmax pooling of each sequence's blocks of ``ratio`` tokens: ``[total_comp, d]``.

    Args:
        kv, score: ``[T, coff*d]`` (float32, float16, bfloat16 or float64, the same dtype).
        ape: ``[ratio, coff*d]`` positional bias added to the scores (any float dtype).
        cu_seqlens: int32/int64 ``[B + 1]`` token offsets (0, non-decreasing, ends at T);
            empty sequences and sequences shorter than ``ratio`` give no rows.
        ratio: tokens per block, >= 1. coff: 1 (own block) or 2 (window = previous and own
            block; see the module docstring for the exact slot, column and APE mapping).
        cu_seqlens_comp: the compressed offsets if the caller has them already
            (:func:`csa_cu_seqlens_comp`); computed on the device otherwise.
        total_comp: number of output rows; omitted: ``cu_seqlens_comp[-1]``, read with one
            host sync (eager). Rows past the true count are zeros and get no gradient.

    Returns ``out`` in kv's dtype; gradients flow to kv, score and ape.
    """
    _check_ratio(ratio)
    _check_coff(coff)
    check_tensor("kv", kv, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("score", score, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("ape", ape, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
    t, width = kv.shape
    if width == 0 or width % coff:
        raise ValueError(f"kv: the last dim must be coff * d = {coff} * d with d >= 1, got {width}")
    d = width // coff
    if score.shape != kv.shape:
        raise ValueError(f"score: expected the shape of kv {tuple(kv.shape)}, got {tuple(score.shape)}")
    if score.dtype != kv.dtype:
        raise ValueError(f"score: expected kv's dtype {kv.dtype}, got {score.dtype}")
    if tuple(ape.shape) != (ratio, width):
        raise ValueError(f"ape: expected shape (ratio, coff*d) = ({ratio}, {width}), got {tuple(ape.shape)}")
    if cu_seqlens.numel() == 0:
        raise ValueError("cu_seqlens: expected B + 1 >= 1 offsets, got an empty tensor")
    if cu_seqlens_comp is not None:
        check_tensor("cu_seqlens_comp", cu_seqlens_comp, dtypes=INDEX_DTYPES, ndim=1)
        if cu_seqlens_comp.shape != cu_seqlens.shape:
            raise ValueError(
                f"cu_seqlens_comp: expected the shape of cu_seqlens {tuple(cu_seqlens.shape)}, got {tuple(cu_seqlens_comp.shape)}"
            )
    check_same_device(kv=kv, score=score, ape=ape, cu_seqlens=cu_seqlens, cu_seqlens_comp=cu_seqlens_comp)
    if total_comp is not None and (isinstance(total_comp, bool) or not isinstance(total_comp, int) or total_comp < 0):
        raise ValueError(f"total_comp: expected a non-negative int or None, got {total_comp!r}")

    cu_comp = _cu_comp(cu_seqlens, ratio) if cu_seqlens_comp is None else cu_seqlens_comp
    if not torch.compiler.is_compiling():
        if total_comp is None or cu_seqlens.device.type == "cpu":
            cu = cu_seqlens.tolist()  # the one host read (free for CPU tensors)
            _check_cu_values(cu, t)
            true_comp = sum((b - a) // ratio for a, b in zip(cu, cu[1:]))
            if cu_seqlens_comp is not None and cu_seqlens_comp.device.type == "cpu":
                if cu_seqlens_comp.tolist() != _cu_comp(cu_seqlens, ratio).tolist():
                    raise ValueError("cu_seqlens_comp: does not match cu_seqlens and ratio")
            if total_comp is None:
                total_comp = true_comp
            elif total_comp < true_comp:
                raise ValueError(f"total_comp: {total_comp} is less than the {true_comp} blocks in cu_seqlens")
    rows = -1 if total_comp is None else total_comp
    return _CSACompressFn.apply(kv, score, ape, cu_seqlens, cu_comp, rows, ratio, coff)

"""Chunked Gated DeltaNet forward for SM90 (CuTeDSL, WGMMA): two kernels.

The op (per sequence, value head ``hv`` reading q/k head ``h = hv // (HV // H)``)::

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T      S: [K, V], float32
    o_t = scale * S_t^T q_t

with q, k optionally l2-normalized (``x / sqrt(sum x^2 + 1e-6)``). Chunks of C = 64
tokens use the WY/UT form: with ``gc`` the in-chunk cumulative sum of g,

    A    = strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))            [C, C]
    T    = (I + A)^-1
    w    = T diag(beta exp(gc)) k          u = T diag(beta) v          [C, K], [C, V]
    vn   = u - w S                                                       (S at chunk start)
    o    = scale (q exp(gc)) S + scale tril(q k^T exp(gc_i - gc_j)) vn   (diagonal kept)
    S'   = exp(gc_C) S + (k exp(gc_C - gc))^T vn

Kernel 1, ``wy`` (grid: chunk x HV, one warpgroup): loads the chunk's k, v, g,
beta; fuses the gate (``-exp(A_log) softplus(g + dt_bias)``), the beta sigmoid,
the in-chunk cumsum (one warp, two rows a lane, a shuffle scan) and the k l2norm
(as per-row scale factors taken from the diagonal of ``k k^T``, so k stays as
loaded); ``k k^T`` on WGMMA; the triangular solve in float32 on CUDA cores
(16x16 diagonal blocks by forward substitution, merged 16 -> 32 -> 64 with
``X = -T2 A21 T1``); then ``w`` and ``u`` as two WGMMAs whose A operands are T
with its columns scaled (the k and v tiles serve as MN-major B operands as
loaded). Writes w, u (input dtype) and gc (float32).
At K = V = 128 two warpgroups split every product's N (and the solve's work) and the launch asks
for two CTAs an SM: 120 registers a thread against 225, 2.5K instructions against 3.7K, 16 warps an
SM against 8; 0.341 ms against 0.356 on one warpgroup (H200, B4 T4096 H16 HV32), the default there
(``CUDNN_TRAIN_GDN_WY_WGS=1``: one warpgroup).

Kernel 2, ``state`` (grid: N x HV x V/64, one warpgroup): walks the chunks of
one sequence in order with the state held transposed, ``S^T`` [64 (V block),
K], in float32 WGMMA accumulators. ``S^T`` in the input dtype is the register
A operand of ``S^T w^T`` and ``S^T q^T``; ``vn^T = u^T - S^T w^T`` stays in
registers and is the register A operand both of ``o^T += vn^T P^T`` (P in
shared memory) and of the state update ``S^T += vn^T diag(...) k``. The q/k
l2norm is again folded in as row/column factors. Writes o and, when asked,
the final state. A variant (``CUDNN_TRAIN_GDN_FWD_WGS=2``, K = 128) splits every
product's N between two warpgroups: S^T, then vn^T and its scaled copy, are A operands from one
[64, 128] shared tile instead of registers (one more barrier a chunk), launched asking for two
CTAs an SM (128 registers a thread, about 107 KB of shared memory each), so 16 warps an SM where
the one-warpgroup kernel runs 8; GPU-checked, but slower where the fused kernel is chosen (H200, B4
T4096 H16 HV32: 0.528 ms against 0.477), so it is the default only for kernel 2's
``store_states`` variant (0.715 ms there against 0.792 on one warpgroup with the prefetch), which the
training forward reaches only with ``CUDNN_TRAIN_GDN_FWD_SPLIT=0``.

Tails: rows past a chunk's end (T not a multiple of 64, varlen boundaries) are
loaded as zeros and never stored; the gate is 0 there so ``gc`` stays flat.
Varlen needs no host read: kernel 1 is launched on an upper bound of the
chunk count (``T_total // 64 + N``) and each CTA finds its sequence by
bisection in a device-side cumulative chunk count; surplus CTAs exit.

Loads: kernel 1 uses synchronous 16-byte vector copies, all of a group (and the g, beta
loads) in flight before the first smem store; it stages w and u through the k and v tiles and
stores them as 16-byte rows. Kernel 2 (``STATE_PREFETCH``; by default at K = 128, not for the
training forward's ``store_states`` variant, which runs on two warpgroups with synchronous loads,
the faster of the two measured there) fetches chunk c + 1 by ``cp.async`` while it computes
chunk c: k, u and gc have two buffers; q and w are refilled in place once
chunk c's first three products are done (~90 KiB of smem, two CTAs per SM). With
``CUDNN_TRAIN_GDN_FWD_PREFETCH=0`` it loads every chunk synchronously at its start.

Where N x HV x V/64 (kernel 2's grid) leaves SMs idle, the forward replaces kernel 2
by the split pass of ``gated_delta_rule_fwd_split_sm90`` (a chain over the chunks that only
carries the state, V split into blocks of 32, then the outputs of all chunks in parallel); the
training forward (``store_states``) takes it at every grid: its chain writes the chunk-start
states in the input dtype (the precision the backward reads them in) as 16-byte rows of its
shared state tile, cheaper than kernel 2's element-wise stores from its accumulators. Where the inference
forward would take kernel 2, it runs its warp-specialized variant instead (``gated_delta_rule_fwd_ws_sm90``:
the chain on one warpgroup, the outputs on another; ``STATE_WS``; its loads by TMA where K == V), with a
switch for w, u formed in the chain after kernel 1's gate-free inverse variant (``ONFLY``; on by default where
one CTA holds all 128 columns of V). Not
yet: splitting one sequence across CTAs. The backward lives in
``gated_delta_rule_bwd_sm90.py`` / ``gated_delta_rule_bwd_chunk_sm90.py`` and the
training path in ``gated_delta_rule_train_sm90.py``.

Layout: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``
(any strides, last dim of q/k/v contiguous with 16-byte aligned rows); states
``[N, HV, K, V]`` or ``[N, HV, V, K]`` float32. Served: bf16/fp16 q/k/v,
K and V in {64, 128}, an SM90 GPU, every tensor under 2**31 elements.
"""


import os

import torch

from ..backend import Served, Unsupported, env_flag, get_op
from . import compile as kc
from . import gated_delta_rule_common_sm90 as cm

CHUNK = cm.CHUNK
THREADS = cm.THREADS
VBLOCK = 64  # V columns per CTA of the state kernel
# The state kernel fetches chunk c + 1 with cp.async while it computes chunk c (two buffers of
# k, u and gc; q and w refilled once the chunk's first products are done). 0: the earlier
# synchronous loads at the top of every chunk.
STATE_PREFETCH = env_flag("CUDNN_TRAIN_GDN_FWD_PREFETCH", default=True)
# Warpgroups of the fused state kernel at K = 128 (CUDNN_TRAIN_GDN_FWD_WGS): 1, or 2 splitting every
# product's N (two CTAs an SM, 16 warps). Unset: 1 for inference (H200, B4 T4096 HV32: 0.477 ms against
# 0.528 on two), 2 for the training forward's store_states variant (in the training path's profile:
# 0.715 ms on two with synchronous loads against 0.792 on one with the prefetch).
STATE_WGS = os.environ.get("CUDNN_TRAIN_GDN_FWD_WGS", "").strip()
# The same for the wy kernel (CUDNN_TRAIN_GDN_WY_WGS), at K = V = 128: 2 by default there (H200, B4 T4096
# H16 HV32: 0.341 ms against 0.356 on one warpgroup, w, u, gc bitwise equal; tools/time_gdn_fwd.py).
WY_WGS = os.environ.get("CUDNN_TRAIN_GDN_WY_WGS", "2").strip() or "2"
# The wy kernel's preparation (CUDNN_TRAIN_GDN_WY_SCAN, default 1): one warp takes g and beta two rows a lane
# (gate, sigmoid) and forms the in-chunk cumsum by a shuffle scan, and the k l2norm factors come from the
# diagonal of the k k^T product the kernel makes anyway, instead of 64 threads each summing up to 64 g values
# and 64 more each reducing a k row (28% of a CTA's cycles in the eleventh session's profile). 0: the old way.
WY_SCAN = env_flag("CUDNN_TRAIN_GDN_WY_SCAN", True)
# With the scan preparation, the k and v tiles by cp.async (CUDNN_TRAIN_GDN_WY_ASYNC, default 1), in flight
# while warp 0 forms g, beta and the cumsum, instead of through registers before it (bitwise the same
# outputs; H200 B4 T4096 and B1 T16384: 0.288 ms against 0.311, twelfth session). 0: the synchronous loads.
WY_ASYNC = env_flag("CUDNN_TRAIN_GDN_WY_ASYNC", True)
# The A matrix built in two passes (CUDNN_TRAIN_GDN_WY_A2, default 1): every element's value in registers first,
# then the stores, so that the per-row and per-column factors are read once a thread instead of once an element
# (the one-pass loop reloads five shared values per element: 80 loads a thread where 22 are distinct). The same
# bits (w, u, gc bitwise equal; GPU cases passed); H200 B4 T4096 H16 HV32: 0.261 ms against 0.288 (thirteenth
# session). 0: the one-pass loop.
WY_A2 = env_flag("CUDNN_TRAIN_GDN_WY_A2", True)
# The fused state kernel's P with its factors read unconditionally and the triangle kept by a select
# (CUDNN_TRAIN_GDN_FWD_PSEL=1): the same bits; in its PTX 246 branches against 302 and no spill against 16
# bytes (255 registers either way). Prepared in the twelfth session, compiled, not yet GPU-run: off.
STATE_PSEL = env_flag("CUDNN_TRAIN_GDN_FWD_PSEL", False)
# The fused state pass on two specialized warpgroups (gated_delta_rule_fwd_ws_sm90: the chain on one, the
# outputs on the other, handed over in shared memory). None (CUDNN_TRAIN_GDN_FWD_WS unset): the inference
# forward's fused state pass runs on it (H200, B4 T4096 H16 HV32: 0.432 ms against 0.474 for the fused kernel,
# whole forward 0.720 against 0.762; thirteenth session), the training forward (store_states) keeps its pass (the
# split one: 0.80 ms whole training forward against 1.01 with this kernel's chunk-state stores). True (=1): also
# the training forward's, instead of the split pass unless the grid leaves SMs idle; False (=0): never.
_ws_env = os.environ.get("CUDNN_TRAIN_GDN_FWD_WS", "").strip()
STATE_WS = None if not _ws_env else env_flag("CUDNN_TRAIN_GDN_FWD_WS")
# Where the inference forward takes the specialized warpgroups: w and u never materialized
# (CUDNN_TRAIN_GDN_FWD_ONFLY=1): the wy kernel's INV variant writes only the gate-free chunk inverses, gc and the
# effective beta, and the state pass's chain forms vn = T diag(beta) (v - diag(exp(gc) rk) k S) itself
# (FlashQLA's structure). Prepared in the thirteenth session; its GPU cases passed in the sixteenth; timed in the
# seventeenth (tools/time_gdn_fwd.py --onfly, H200): whole forward at B4 T4096 H16 HV32, 128 columns a CTA, 0.550
# against 0.574 ms; with 64 columns a CTA (B1 T16384 forced onto these warpgroups) slower, 1.195 against 1.076 (two
# CTAs a (sequence, value head) each form the whole vn product again). None (unset): on where one CTA holds all of
# V at K == V == 128 (onfly_default); 1: wherever the specialized warpgroups serve the inference forward; 0: never.
ONFLY = cm.env_switch("CUDNN_TRAIN_GDN_FWD_ONFLY", None)


# The training forward with w and u formed in the specialized warpgroups' chain (CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY,
# thirty-fifth session; the default since the thirty-sixth): the training forward's chain waited about a quarter of
# its cycles for the output warpgroup (B4 T4096, H100, profile), so the inference forward's w / u formation costs it
# little there, while the wy kernel that writes w, u and Tm shrinks to its INV variant. Nothing then holds w for the
# reverse sweep, which takes the chain's gated inverses (Tm) and the effective beta instead
# (``gated_delta_rule_bwd_sm90.reverse_sweep(beta=)``); w is not saved (33 MB a layer at B4 T4096 HV32). Where the
# training path asks for it (``forward(train_onfly=True)``: its backward's sweep takes Tm) and the specialized
# warpgroups serve the training forward at 128 columns a CTA, unsegmented; other numerics than the split forward (T
# is rounded from the rounded gate-free inverse, vn is one product on T), the same as the inference forward's. H200,
# B4 T4096 (with CLOADS and KSHARE): the training forward 0.535 / 0.537 -> 0.514 / 0.515 ms, the sweep 0.380 ->
# 0.394; through the op (graphed forward+backward) 2.091 / 2.085 -> 2.077 / 2.069. Unset or 1: on; 0: off.
TRAIN_ONFLY = cm.env_switch("CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY", True)


def onfly_default(K: int, V: int, vb: int) -> bool:
    """Whether w and u are formed in the chain when ``CUDNN_TRAIN_GDN_FWD_ONFLY`` is unset: only in the measured
    configuration where it is faster, one CTA holding all 128 columns of V (no CTA repeats another's vn work)."""
    return K == V == vb == 128


# The inference forward's state pass as two kernels (a sequential chain that stores the chunk-start
# states and vn, then the outputs in parallel; gated_delta_rule_fwd_split_sm90): None picks by the grid
# (split_sm90.preferred), True / False (CUDNN_TRAIN_GDN_FWD_SPLIT=1 / 0) always / never.
_split_env = os.environ.get("CUDNN_TRAIN_GDN_FWD_SPLIT", "").strip()
SPLIT = None if not _split_env else env_flag("CUDNN_TRAIN_GDN_FWD_SPLIT")
HEAD_DIMS = (64, 128)
L2NORM_EPS = 1e-6
_SOURCES = (__file__, cm.__file__)

# Tests set this to fill every output with NaN before the kernels write it.
POISON = os.environ.get("CUDNN_TRAIN_POISON", "0") == "1"


def _empty(*shape, dtype, device):
    t = torch.empty(*shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if POISON else t


# ------------------------------------------------------------------ shared device code

# Phases timed by the kernels' profile variants (``tools/time_gdn_fwd.py --profile``)
WY_PHASES = (("k, v tiles + g, beta loads, cumsum", "k k^T + norms from its diagonal", "A") if WY_SCAN else
             ("k, v tiles + g, beta loads", "cumsum + k norms", "k k^T + A")) + (
    "triangular solve", "scaled T copies", "w, u products", "w, u stores")
STATE_PHASES = ("chunk loads (wait)", "S w, S q, q k^T (+ norms)", "vn, P, scalings", "o, state products",
                "o stores")


def make_profile(on: bool, nphase: int):
    """``(start, mark, finish)``, trace-time helpers of the kernels' profile variants.

    ``acc = start()`` keeps, in registers, per-phase sums of ``clock64`` differences (every
    thread its own); ``mark(acc, p)`` ends phase ``p`` (adds the time since the previous mark;
    ``p = -1`` only restarts the clock); ``finish(acc, mProf, cta, tidx)`` has thread 0 write
    ``[phase sums..., kernel total]`` to ``mProf[cta * (nphase + 1):]``. With ``on`` False all
    three emit nothing."""
    if not on:
        return (lambda: None), (lambda acc, p: None), (lambda acc, mProf, cta, tidx: None)
    cutlass, cute = kc.import_cute()

    def start():
        acc = cute.make_rmem_tensor((nphase + 2,), cutlass.Int64)  # phases, kernel start, last mark
        acc.fill(0)
        now = cute.arch.clock64()
        acc[nphase] = now
        acc[nphase + 1] = now
        return acc

    def mark(acc, phase):
        now = cute.arch.clock64()
        if phase >= 0:
            acc[phase] = acc[phase] + (now - acc[nphase + 1])
        acc[nphase + 1] = now

    @cute.jit
    def finish(acc: cute.Tensor, mProf: cute.Tensor, cta: cutlass.Int32, tidx: cutlass.Int32):
        acc[nphase] = cute.arch.clock64() - acc[nphase]
        if tidx == 0:
            for p in cutlass.range_constexpr(nphase + 1):
                mProf[cta * (nphase + 1) + p] = acc[p]

    return start, mark, finish


def _make_load_tiles(rows: int, threads: int = THREADS):
    """``load_tiles(((gX, sX, cols), ...), nvalid, tidx)``: copy ``rows x cols`` tiles global -> shared.

    ``threads`` threads (the CTA) move 16-byte vectors; rows >= nvalid are zero-filled and never read from
    memory. Every load of the group is issued before the first shared-memory store, so the
    loads are in flight together."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    @cute.jit
    def load_tiles(tiles: cutlass.Constexpr, nvalid: Int32, tidx: Int32):
        frags = []
        for ti in cutlass.range_constexpr(len(tiles)):
            gX, sX, cols = tiles[ti]
            VPR = cols // 8
            RPP = threads // VPR
            for p in cutlass.range_constexpr(rows // RPP):
                r = p * RPP + tidx // VPR
                frag = cute.make_rmem_tensor((1, 8), gX.element_type)
                frag.fill(0.0)
                if r < nvalid:
                    cute.autovec_copy(cute.local_tile(gX, (1, 8), (r, tidx % VPR)), frag)
                frags.append(frag)
        f = 0
        for ti in cutlass.range_constexpr(len(tiles)):
            gX, sX, cols = tiles[ti]
            VPR = cols // 8
            RPP = threads // VPR
            for p in cutlass.range_constexpr(rows // RPP):
                r = p * RPP + tidx // VPR
                cute.autovec_copy(frags[f], cute.local_tile(sX, (1, 8), (r, tidx % VPR)))
                f += 1

    return load_tiles


def _make_load_chunk(K: int, VB: int, threads: int = THREADS):
    """``load_chunk(mQ, mK, mW, mX, mGc, sQ, sK, sW, sX, sGc, b, h, hv, t0, v0, length, tidx)``:
    one chunk's q, k (head h), w (value head hv), the ``[t0:, v0 : v0 + VB]`` tile of mX (u in the
    forward, do in the backward) and gc (last valid row repeated past the end) into smem, by the
    CTA's ``threads`` threads."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    C = CHUNK
    load_tiles = _make_load_tiles(C, threads)

    @cute.jit
    def load_chunk(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mX: cute.Tensor, mGc: cute.Tensor,
                   sQ: cute.Tensor, sK: cute.Tensor, sW: cute.Tensor, sX: cute.Tensor, sGc: cute.Tensor,
                   b: Int32, h: Int32, hv: Int32, t0: Int32, v0: Int32, length: Int32, tidx: Int32):
        load_tiles(((cute.domain_offset((t0, 0), mQ[b, None, h, None]), sQ, K),
                    (cute.domain_offset((t0, 0), mK[b, None, h, None]), sK, K)), length, tidx)
        load_tiles(((cute.domain_offset((t0, 0), mW[b, None, hv, None]), sW, K),
                    (cute.domain_offset((t0, v0), mX[b, None, hv, None]), sX, VB)), length, tidx)
        if tidx < C:
            sGc[tidx] = mGc[b, t0 + cutlass.min(tidx, length - 1), hv]

    return load_chunk


def make_issue_tiles(dtype, rows: int, threads: int = THREADS):
    """``issue_tiles(((gX, sX, cols, c0), ...), nvalid, tidx)``: ``rows x cols`` tiles global -> shared by
    ``cp.async`` (16-byte copies by ``threads`` threads) without waiting, the columns from the 8-element tile ``c0``
    of ``gX`` on (keeps 16-byte alignment); rows >= nvalid are zeroed by plain shared stores and never
    read from memory. The caller commits the group and, before reading, waits for it, fences to the
    async proxy and syncs."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32
    from cutlass.cute.nvgpu import cpasync

    @cute.jit
    def issue_tiles(tiles: cutlass.Constexpr, nvalid: Int32, tidx: Int32):
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                                   num_bits_per_copy=128)
        for ti in cutlass.range_constexpr(len(tiles)):
            gX, sX, cols, c0 = tiles[ti]
            VPR = cols // 8
            RPP = threads // VPR
            for p in cutlass.range_constexpr(rows // RPP):
                r = p * RPP + tidx // VPR
                dst = cute.local_tile(sX[r, None], (8,), (tidx % VPR,))
                if r < nvalid:
                    cute.copy(atom, cute.local_tile(gX[r, None], (8,), (c0 + tidx % VPR,)), dst)
                else:
                    zero = cute.make_rmem_tensor((8,), dtype)
                    zero.fill(0.0)
                    cute.autovec_copy(zero, dst)

    return issue_tiles


def make_issue_gc():
    """``issue_gc(mGc, sGc, b, hv, t0, length, tidx)``: a chunk's gc (value head hv) into smem by 4-byte
    ``cp.async`` from the first 64 threads, the last valid row repeated past the end."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import cpasync

    @cute.jit
    def issue_gc(mGc: cute.Tensor, sGc: cute.Tensor, b: Int32, hv: Int32, t0: Int32, length: Int32, tidx: Int32):
        if tidx < CHUNK:
            atom4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
            row = t0 + cutlass.min(tidx, length - 1)
            cute.copy(atom4, cute.local_tile(mGc[b, None, hv], (1,), (row,)), cute.local_tile(sGc, (1,), (tidx,)))

    return issue_gc


def make_issue_parts(dtype, K: int, VB: int, threads: int = THREADS):
    """``(issue_qk, issue_wxg)``: the loads of :func:`_make_issue_chunk` in two parts that a kernel may
    issue at different times: ``issue_qk(mQ, mK, sQ, sK, b, h, t0, length, tidx)``, the q and k tiles of
    head h; ``issue_wxg(mW, mX, mGc, sW, sX, sGc, b, hv, t0, v0, length, tidx)``, the w tile, the
    ``[t0:, v0 : v0 + VB]`` tile of mX and gc of value head hv. Same waiting rules."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    issue_tiles = make_issue_tiles(dtype, CHUNK, threads)
    issue_gc = make_issue_gc()

    @cute.jit
    def issue_qk(mQ: cute.Tensor, mK: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, b: Int32, h: Int32, t0: Int32,
                 length: Int32, tidx: Int32):
        issue_tiles(((cute.domain_offset((t0, 0), mQ[b, None, h, None]), sQ, K, 0),
                     (cute.domain_offset((t0, 0), mK[b, None, h, None]), sK, K, 0)), length, tidx)

    @cute.jit
    def issue_wxg(mW: cute.Tensor, mX: cute.Tensor, mGc: cute.Tensor, sW: cute.Tensor, sX: cute.Tensor,
                  sGc: cute.Tensor, b: Int32, hv: Int32, t0: Int32, v0: Int32, length: Int32, tidx: Int32):
        issue_tiles(((cute.domain_offset((t0, 0), mW[b, None, hv, None]), sW, K, 0),
                     (cute.domain_offset((t0, 0), mX[b, None, hv, None]), sX, VB, v0 // 8)), length, tidx)
        issue_gc(mGc, sGc, b, hv, t0, length, tidx)

    return issue_qk, issue_wxg


def _make_issue_chunk(dtype, K: int, VB: int, threads: int = THREADS):
    """``issue_chunk(...)``, with :func:`_make_load_chunk`'s arguments: the same tiles and gc, by
    ``cp.async`` (:func:`make_issue_tiles`; 4 bytes for gc) without waiting, every tile in one group of
    copies. The caller commits the group and, before reading, waits for it, fences to the async proxy
    and syncs."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    issue_tiles = make_issue_tiles(dtype, CHUNK, threads)
    issue_gc = make_issue_gc()

    @cute.jit
    def issue_chunk(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mX: cute.Tensor, mGc: cute.Tensor,
                    sQ: cute.Tensor, sK: cute.Tensor, sW: cute.Tensor, sX: cute.Tensor, sGc: cute.Tensor,
                    b: Int32, h: Int32, hv: Int32, t0: Int32, v0: Int32, length: Int32, tidx: Int32):
        issue_tiles(((cute.domain_offset((t0, 0), mQ[b, None, h, None]), sQ, K, 0),
                     (cute.domain_offset((t0, 0), mK[b, None, h, None]), sK, K, 0),
                     (cute.domain_offset((t0, 0), mW[b, None, hv, None]), sW, K, 0),
                     (cute.domain_offset((t0, 0), mX[b, None, hv, None]), sX, VB, v0 // 8)), length, tidx)
        issue_gc(mGc, sGc, b, hv, t0, length, tidx)

    return issue_chunk


# ------------------------------------------------------------------ kernel 1: w, u, gc


def _build_wy(dtype, g_dtype, beta_dtype, alog_dtype, dtb_dtype, K: int, V: int, l2norm: bool, gate: bool,
              has_dt_bias: bool, beta_sigmoid: bool, beta_scale: float, varlen: bool, profile: bool = False,
              WGS: int = 1, STORE_T: bool = False, SCAN: bool = True, ASYNC: bool = False, A2: bool = False,
              INV: bool = False):
    # INV: the gate-free chunk inverse only (gated_delta_rule_fwd_ws_sm90's forward that forms w and u in its
    # chain): A without the exp(gc_i - gc_j) factor, T = (I + A)^-1 rounded once to the input dtype into mTm,
    # gc and the effective beta (float32) out; no v tile, no w, u
    assert not INV or (SCAN and STORE_T), "INV needs the scan preparation and writes T"
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import warpgroup

    C = CHUNK
    THREADS = 128 * WGS  # WGS = 2 (K = V = 128): the warpgroups split every product's N; two CTAs an SM
    LOG2E = cm.LOG2E
    A_STRIDE = cm.A_STRIDE

    load_tiles = _make_load_tiles(C, THREADS)
    issue_tiles = make_issue_tiles(dtype, C, THREADS)
    gemm = cm.make_gemm()
    wy_row_inv_norm = cm.make_row_inv_norm(dtype, K, L2NORM_EPS)

    @cute.jit
    def stage_pairs(acc: cute.Tensor, cAcc: cute.Tensor, sX: cute.Tensor):
        # accumulator element pairs (e, e+1) are columns (n, n+1) of one row (checked at trace time)
        for e in cutlass.range_constexpr(cute.size(acc) // 2):
            i, d = cAcc[2 * e]
            frag = cute.make_rmem_tensor((1, 2), sX.element_type)
            frag[0] = acc[2 * e].to(sX.element_type)
            frag[1] = acc[2 * e + 1].to(sX.element_type)
            cute.autovec_copy(frag, cute.local_tile(sX, (1, 2), (i, d // 2)))

    @cute.jit
    def store_tile(sX: cute.Tensor, gX: cute.Tensor, cols: cutlass.Constexpr, nvalid: Int32, tidx: Int32):
        # rows < nvalid of a C x cols smem tile to global, 16-byte vectors
        VPR = cols // 8
        RPP = THREADS // VPR
        for p in cutlass.range_constexpr(C // RPP):
            r = p * RPP + tidx // VPR
            if r < nvalid:
                vec = cute.make_rmem_tensor((1, 8), sX.element_type)
                cute.autovec_copy(cute.local_tile(sX, (1, 8), (r, tidx % VPR)), vec)
                cute.autovec_copy(vec, cute.local_tile(gX, (1, 8), (r, tidx % VPR)))

    solve = cm.make_solve(THREADS)
    locate = cm.make_chunk_locator(varlen)

    @cute.jit
    def a_coef(i, j, sB: cute.Tensor, sGc: cute.Tensor, sRk: cute.Tensor):
        """A's factor of the k k^T element (i, j): beta_i exp(gc_i - gc_j) rk_i rk_j (INV: without the gate)."""
        coef = sB[i]
        if cutlass.const_expr(not INV):
            coef = coef * cute.math.exp2((sGc[i] - sGc[j]) * LOG2E, fastmath=True)
        if cutlass.const_expr(l2norm):
            coef = coef * sRk[i] * sRk[j]
        return coef

    @cute.jit
    def gate_beta(gval: Float32, bval: Float32, mAlog: cute.Tensor, mDtb: cute.Tensor, hv: Int32):
        # the in-kernel gate (FLA's: -exp(A_log) softplus(g + dt_bias), softplus = x for x >= 20) and beta sigmoid
        if cutlass.const_expr(gate):
            x = gval
            if cutlass.const_expr(has_dt_bias):
                x = x + mDtb[hv].to(Float32)
            sp = x
            if x < 20.0:
                sp = cute.math.log1p(cute.math.exp(x))
            gval = -cute.math.exp(mAlog[hv].to(Float32)) * sp
        if cutlass.const_expr(beta_sigmoid):
            bval = beta_scale / (1.0 + cute.math.exp(-bval))
        return gval, bval

    @cute.kernel
    def kernel(
        mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mAlog: cute.Tensor, mDtb: cute.Tensor,
        mCu: cute.Tensor, mCuC: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor, mTm: cute.Tensor,
        T: Int32, NT: Int32, nseq: Int32, group: Int32, mProf: cute.Tensor, mBe: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cid, hv, _ = cute.arch.block_idx()
        h = hv // group
        pstart, pmark, pfinish = make_profile(profile, len(WY_PHASES))
        prof = pstart()

        mma_kk = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False, wgs=WGS)
        mma_w = cm.make_mma(dtype, K, a_regs=False, b_mn_major=True, wgs=WGS)
        mma_u = cm.make_mma(dtype, V, a_regs=False, b_mn_major=True, wgs=WGS)
        cm.check_acc_pairs(mma_w, (C, K), cm.sample_threads(WGS))
        cm.check_acc_pairs(mma_u, (C, V), cm.sample_threads(WGS))

        smem = cutlass.utils.SmemAllocator()
        lk = cm.smem_tile_layout(dtype, C, K)
        lv = cm.smem_tile_layout(dtype, C, V)
        lt = cm.smem_tile_layout(dtype, C, C)
        sK = smem.allocate_tensor(dtype, lk.outer, 1024, lk.inner)
        sV = sTw = sTu = sK  # unused with INV
        if cutlass.const_expr(not INV):
            sV = smem.allocate_tensor(dtype, lv.outer, 1024, lv.inner)
            sTw = smem.allocate_tensor(dtype, lt.outer, 1024, lt.inner)
            sTu = smem.allocate_tensor(dtype, lt.outer, 1024, lt.inner)
        sA = smem.allocate_tensor(Float32, cute.make_layout((C, C), stride=(A_STRIDE, 1)), 16)
        sT = smem.allocate_tensor(Float32, cute.make_layout((C, C), stride=(A_STRIDE, 1)), 16)
        sM = smem.allocate_tensor(Float32, cute.make_layout((C, C), stride=(A_STRIDE, 1)), 16)
        sG = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sGc = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sB = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)

        # ---- which chunk: (batch row b, first token t0, valid rows)
        b, t0, tend, valid = locate(cid, mCu, mCuC, T, NT, nseq)
        length = cutlass.min(tend - t0, C)

        if valid:
            gK = cute.domain_offset((t0, 0), mK[b, None, h, None])
            gV = cute.domain_offset((t0, 0), mV[b, None, hv, None])
            gW = cute.domain_offset((t0, 0), mW[b, None, hv, None])
            gU = cute.domain_offset((t0, 0), mU[b, None, hv, None])
            gTm = cute.domain_offset((t0, 0), mTm[b, None, hv, None])
            if cutlass.const_expr(SCAN):
                # g and beta of rows 2l, 2l + 1 in lane l of warp 0, first, so that their loads are in
                # flight with the tiles'; padded rows keep g = beta = 0 (their gc, flat up to rounding,
                # only ever meets beta = 0 here, and the state pass repeats the last valid row's)
                r0 = 2 * tidx
                g0, g1, b0, b1 = Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)
                if tidx < C // 2:
                    if r0 < length:
                        g0 = mG[b, t0 + r0, hv].to(Float32)
                        b0 = mBeta[b, t0 + r0, hv].to(Float32)
                    if r0 + 1 < length:
                        g1 = mG[b, t0 + r0 + 1, hv].to(Float32)
                        b1 = mBeta[b, t0 + r0 + 1, hv].to(Float32)
                if cutlass.const_expr(INV and ASYNC):
                    issue_tiles(((gK, sK, K, 0),), length, tidx)
                    cute.arch.cp_async_commit_group()
                elif cutlass.const_expr(INV):
                    load_tiles(((gK, sK, K),), length, tidx)
                elif cutlass.const_expr(ASYNC):
                    issue_tiles(((gK, sK, K, 0), (gV, sV, V, 0)), length, tidx)
                    cute.arch.cp_async_commit_group()
                else:
                    load_tiles(((gK, sK, K), (gV, sV, V)), length, tidx)
                if tidx < C // 2:
                    if r0 < length:
                        g0, b0 = gate_beta(g0, b0, mAlog, mDtb, hv)
                    if r0 + 1 < length:
                        g1, b1 = gate_beta(g1, b1, mAlog, mDtb, hv)
                    # in-chunk inclusive cumsum: the lanes' pair sums scanned across the warp
                    incl = g0 + g1
                    for o in cutlass.range_constexpr(5):
                        prev = cute.arch.shuffle_sync_up(incl, offset=1 << o)
                        if tidx >= (1 << o):
                            incl = incl + prev
                    before = cute.arch.shuffle_sync_up(incl, offset=1)  # the pairs of the lanes before this one
                    if tidx == 0:
                        before = Float32(0.0)
                    gc0 = before + g0
                    gc1 = gc0 + g1
                    sGc[r0] = gc0
                    sGc[r0 + 1] = gc1
                    sB[r0] = b0
                    sB[r0 + 1] = b1
                    if r0 < length:
                        mGc[b, t0 + r0, hv] = gc0
                        if cutlass.const_expr(INV):
                            mBe[b, t0 + r0, hv] = b0
                    if r0 + 1 < length:
                        mGc[b, t0 + r0 + 1, hv] = gc1
                        if cutlass.const_expr(INV):
                            mBe[b, t0 + r0 + 1, hv] = b1
                if cutlass.const_expr(ASYNC):
                    cute.arch.cp_async_wait_group(0)
                cute.arch.fence_view_async_shared()  # the k tile's stores, before the k k^T product reads it
                cute.arch.sync_threads()
                pmark(prof, 0)
            else:
                # g and beta first, so that their loads are in flight with the tiles'
                gval = Float32(0.0)
                bval = Float32(0.0)
                if tidx < length:
                    gval = mG[b, t0 + tidx, hv].to(Float32)
                    bval = mBeta[b, t0 + tidx, hv].to(Float32)
                load_tiles(((gK, sK, K), (gV, sV, V)), length, tidx)
                if tidx < C:
                    if tidx < length:
                        gval, bval = gate_beta(gval, bval, mAlog, mDtb, hv)
                    sG[tidx] = gval
                    sB[tidx] = bval
                cute.arch.sync_threads()
                pmark(prof, 0)
                if tidx < C:
                    # in-chunk inclusive cumsum (padded rows have g = 0, so gc stays flat past the end)
                    acc = Float32(0.0)
                    for j in cutlass.range_constexpr(C):
                        if j <= tidx:
                            acc = acc + sG[j]
                    sGc[tidx] = acc
                    if tidx < length:
                        mGc[b, t0 + tidx, hv] = acc
                elif tidx < 2 * C:
                    r = tidx - C
                    rk = Float32(1.0)
                    if cutlass.const_expr(l2norm):
                        rk = wy_row_inv_norm(sK, r)
                    sRk[r] = rk
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
                pmark(prof, 1)

            # ---- A = strictly_lower(beta_i rk_i rk_j k_i.k_j exp(gc_i - gc_j))
            thr_kk = mma_kk.get_slice(tidx)
            accA = cute.make_rmem_tensor(thr_kk.partition_shape_C((C, C)), Float32)
            gemm(mma_kk, accA, mma_kk.make_fragment_A(thr_kk.partition_A(sK)),
                 mma_kk.make_fragment_B(thr_kk.partition_B(sK)), True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cA = thr_kk.partition_C(cute.make_identity_tensor((C, C)))
            if cutlass.const_expr(SCAN and l2norm):
                # the l2norm factors from the diagonal k_i.k_i (one thread holds each element)
                for e in cutlass.range_constexpr(cute.size(accA)):
                    i, j = cA[e]
                    if i == j:
                        sRk[i] = cute.math.rsqrt(accA[e] + L2NORM_EPS)
                cute.arch.sync_threads()
            if cutlass.const_expr(SCAN):
                pmark(prof, 1)
            if cutlass.const_expr(A2):
                # two passes: every element's value first, in registers (the factors read unconditionally, so
                # a thread's 16 elements share the loads of its 2 rows and 8 columns: no store to shared
                # memory between them to force a reload, no branch around them), then the stores. The same
                # operations on the same values as below: the same bits (exp2 of gc_i - gc_j > 0 above the
                # diagonal may be inf there, never kept)
                for e in cutlass.range_constexpr(cute.size(accA)):
                    i, j = cA[e]
                    a = accA[e] * a_coef(i, j, sB, sGc, sRk)
                    accA[e] = Float32(0.0)
                    if i > j:
                        accA[e] = a
                for e in cutlass.range_constexpr(cute.size(accA)):
                    i, j = cA[e]
                    sA[i, j] = accA[e]
            else:
                for e in cutlass.range_constexpr(cute.size(accA)):
                    i, j = cA[e]
                    a = Float32(0.0)
                    if i > j:
                        a = accA[e] * a_coef(i, j, sB, sGc, sRk)
                    sA[i, j] = a
            cute.arch.sync_threads()
            pmark(prof, 2)

            # ---- T = (I + A)^-1 in float32 by block doubling (see `solve` below)
            solve(sA, sT, sM, tidx)
            pmark(prof, 3)
            if cutlass.const_expr(INV):
                # T = (I + A)^-1 itself, rounded once, into its chunk rows of mTm (4 adjacent columns a thread)
                cg = tidx % (C // 4)
                for q in cutlass.range_constexpr(C * C // (4 * THREADS)):
                    i = tidx // (C // 4) + (4 * THREADS // C) * q
                    tv = cute.make_rmem_tensor((1, 4), Float32)
                    cute.autovec_copy(cute.local_tile(sT, (1, 4), (i, cg)), tv)
                    tt = cute.make_rmem_tensor((1, 4), dtype)
                    for j in cutlass.range_constexpr(4):
                        x = tv[j]
                        if i < cg * 4 + j:  # T is lower triangular; blocks above the diagonal are never written
                            x = Float32(0.0)
                        tt[j] = x.to(dtype)
                    if i < length:
                        cute.autovec_copy(tt, cute.local_tile(gTm, (1, 4), (i, cg)))
                pmark(prof, 4)
            else:
                # column-scaled copies of T in the input dtype: A operands of the w and u products
                # (a thread: 4 adjacent columns, 16-byte reads of T, 8-byte writes of each copy)
                cg = tidx % (C // 4)
                cw = cute.make_rmem_tensor((4,), Float32)
                cu = cute.make_rmem_tensor((4,), Float32)
                for j in cutlass.range_constexpr(4):
                    c = cg * 4 + j
                    cu[j] = sB[c]
                    cw[j] = sB[c] * cute.math.exp2(sGc[c] * LOG2E, fastmath=True)
                    if cutlass.const_expr(l2norm):
                        cw[j] = cw[j] * sRk[c]
                for q in cutlass.range_constexpr(C * C // (4 * THREADS)):
                    i = tidx // (C // 4) + (4 * THREADS // C) * q
                    tv = cute.make_rmem_tensor((1, 4), Float32)
                    cute.autovec_copy(cute.local_tile(sT, (1, 4), (i, cg)), tv)
                    tw = cute.make_rmem_tensor((1, 4), dtype)
                    tu = cute.make_rmem_tensor((1, 4), dtype)
                    tt = cute.make_rmem_tensor((1, 4), dtype)  # STORE_T: T itself, rounded once, for stage 3
                    for j in cutlass.range_constexpr(4):
                        x = tv[j]
                        if i < cg * 4 + j:  # T is lower triangular; blocks above the diagonal are never written
                            x = Float32(0.0)
                        tw[j] = (x * cw[j]).to(dtype)
                        tu[j] = (x * cu[j]).to(dtype)
                        if cutlass.const_expr(STORE_T):
                            tt[j] = x.to(dtype)
                    cute.autovec_copy(tw, cute.local_tile(sTw, (1, 4), (i, cg)))
                    cute.autovec_copy(tu, cute.local_tile(sTu, (1, 4), (i, cg)))
                    if cutlass.const_expr(STORE_T):
                        if i < length:
                            cute.autovec_copy(tt, cute.local_tile(gTm, (1, 4), (i, cg)))
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
                pmark(prof, 4)

                # ---- w = Tw k, u = Tu v  (B operands: MN-major views of the k and v tiles)
                thr_w = mma_w.get_slice(tidx)
                thr_u = mma_u.get_slice(tidx)
                accW = cute.make_rmem_tensor(thr_w.partition_shape_C((C, K)), Float32)
                accU = cute.make_rmem_tensor(thr_u.partition_shape_C((C, V)), Float32)
                gemm(mma_w, accW, mma_w.make_fragment_A(thr_w.partition_A(sTw)),
                     mma_w.make_fragment_B(thr_w.partition_B(cm.transpose_view(sK))), True)
                gemm(mma_u, accU, mma_u.make_fragment_A(thr_u.partition_A(sTu)),
                     mma_u.make_fragment_B(thr_u.partition_B(cm.transpose_view(sV))), True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                pmark(prof, 5)
                # staged through the k and v tiles (the products are done with them), then 16-byte rows
                cute.arch.sync_threads()
                stage_pairs(accW, thr_w.partition_C(cute.make_identity_tensor((C, K))), sK)
                stage_pairs(accU, thr_u.partition_C(cute.make_identity_tensor((C, V))), sV)
                cute.arch.sync_threads()
                store_tile(sK, gW, K, length, tidx)
                store_tile(sV, gU, V, length, tidx)
                pmark(prof, 6)
        pfinish(prof, mProf, cid * cute.arch.grid_dim()[1] + hv, tidx)

    @cute.jit
    def host(
        mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mAlog: cute.Tensor, mDtb: cute.Tensor,
        mCu: cute.Tensor, mCuC: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor, mTm: cute.Tensor,
        T: Int32, NT: Int32, nseq: Int32, group: Int32, nchunks_grid: Int32, mProf: cute.Tensor, stream,
    ):
        _static_checks(dtype, K, V)
        HV = mV.shape[2]
        kernel(mK, mV, mG, mBeta, mAlog, mDtb, mCu, mCuC, mW, mU, mGc, mTm, T, NT, nseq, group, mProf, mGc).launch(
            grid=[nchunks_grid, HV, 1], block=[THREADS, 1, 1], stream=stream, **cm.two_ctas_an_sm(WGS == 2),
        )

    @cute.jit
    def host_inv(
        mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor, mAlog: cute.Tensor, mDtb: cute.Tensor,
        mCu: cute.Tensor, mCuC: cute.Tensor, mGc: cute.Tensor, mTm: cute.Tensor, mBe: cute.Tensor,
        T: Int32, NT: Int32, nseq: Int32, group: Int32, nchunks_grid: Int32, mProf: cute.Tensor, stream,
    ):
        _static_checks(dtype, K, V)
        HV = mTm.shape[2]
        # k stands in for the v, w, u tensors that this variant never touches
        kernel(mK, mK, mG, mBeta, mAlog, mDtb, mCu, mCuC, mK, mK, mGc, mTm, T, NT, nseq, group, mProf, mBe).launch(
            grid=[nchunks_grid, HV, 1], block=[THREADS, 1, 1], stream=stream, **cm.two_ctas_an_sm(WGS == 2),
        )

    f = _fakes()
    if INV:
        args = (
            f.rows4(dtype, K), f.any3(g_dtype), f.any3(beta_dtype), f.vec(alog_dtype), f.vec(dtb_dtype),
            f.vec(cutlass.Int32), f.vec(cutlass.Int32), f.any3(Float32), f.rows4(dtype, C), f.any3(Float32),
            Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), f.vec(cutlass.Int64), f.stream(),
        )
        return cute.compile(host_inv, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")
    args = (
        f.rows4(dtype, K), f.rows4(dtype, V), f.any3(g_dtype), f.any3(beta_dtype), f.vec(alog_dtype), f.vec(dtb_dtype),
        f.vec(cutlass.Int32), f.vec(cutlass.Int32), f.rows4(dtype, K), f.rows4(dtype, V), f.any3(Float32),
        f.rows4(dtype, C), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), f.vec(cutlass.Int64), f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


# ------------------------------------------------------------------ kernel 2: state recurrence + output


def _build_state(dtype, K: int, V: int, l2norm: bool, varlen: bool, has_h0: bool, out_final: bool, state_vk: bool,
                 store_states: bool = False, prefetch: bool = False, profile: bool = False, WGS: int = 1,
                 PSEL: bool = False):
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import warpgroup

    C = CHUNK
    VB = VBLOCK
    THREADS = 128 * WGS
    LOG2E = cm.LOG2E
    U_STRIDE = VB + 8  # padded row-major u tile: conflict-free transposed reads
    # WGS = 2 (K = 128): the warpgroups split every product's N; the A operands that are accumulators
    # of an earlier step then come from one [VB, 128] shared tile, S^T at the start of a chunk and
    # [vn^T | its scaled copy] later; two CTAs an SM are asked for (128 registers a thread)
    regs_a = WGS == 1

    load_chunk = _make_load_chunk(K, VB, THREADS)
    issue_chunk = _make_issue_chunk(dtype, K, VB, THREADS)
    NBUF = 2 if prefetch else 1  # buffers of k, u and gc
    gemm = cm.make_gemm()
    row_inv_norm = cm.make_row_inv_norm(dtype, K, L2NORM_EPS)
    start_state, store_state = cm.make_state_io()
    store_p = cm.make_store_p(dtype, l2norm, select=PSEL)
    _, scale_o_rows = cm.make_p_frag_and_o_scale(dtype, l2norm)
    locate_seq = cm.make_seq_locator(varlen)

    @cute.kernel
    def kernel(
        mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor, mH0: cute.Tensor,
        mO: cute.Tensor, mHT: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor, mHs: cute.Tensor, scale: Float32,
        T: Int32, NT: Int32, group: Int32, mProf: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        n, hv, vb = cute.arch.block_idx()
        pstart, pmark, pfinish = make_profile(profile, len(STATE_PHASES))
        prof = pstart()
        h = hv // group
        v0 = vb * VB

        # S^T [v, d] += ..: A = vn^T (regs), B = k as (N = d, K = j): MN-major view of the k tile
        mma_s = cm.make_mma(dtype, K, a_regs=regs_a, b_mn_major=True, wgs=WGS)
        # S^T w^T, S^T q^T, vn^T P^T: A in regs, B K-major [64 rows, reduction dim]
        mma_x = cm.make_mma(dtype, C, a_regs=regs_a, b_mn_major=False, wgs=WGS)
        # P = q k^T
        mma_p = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False, wgs=WGS)
        if cutlass.const_expr(regs_a):
            map_s = cm.acc_to_frag_map(mma_s, (VB, K), mma_x, (VB, K))
            map_vn = cm.acc_to_frag_map(mma_x, (VB, C), mma_x, (VB, C))
            map_vd = cm.acc_to_frag_map(mma_x, (VB, C), mma_s, (VB, C))

        smem = cutlass.utils.SmemAllocator()
        lqk = cm.smem_tile_layout(dtype, C, K)
        lp = cm.smem_tile_layout(dtype, C, C)
        sQ = smem.allocate_tensor(dtype, lqk.outer, 1024, lqk.inner)
        sW = smem.allocate_tensor(dtype, lqk.outer, 1024, lqk.inner)
        sP = smem.allocate_tensor(dtype, lp.outer, 1024, lp.inner)
        # k, u and gc: NBUF buffers (chunk c in buffer c % NBUF)
        sKb = [smem.allocate_tensor(dtype, lqk.outer, 1024, lqk.inner) for _ in range(NBUF)]
        sUb = [smem.allocate_tensor(dtype, cute.make_layout((C, VB), stride=(U_STRIDE, 1)), 16) for _ in range(NBUF)]
        sGcb = [smem.allocate_tensor(Float32, cute.make_layout(C), 16) for _ in range(NBUF)]
        sRq = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        if cutlass.const_expr(not regs_a):
            sX = cm.alloc_tile(smem, dtype, VB, K)  # S^T [v, d]; later [vn^T | vn^T diag(exp(gl - gc) rk)]
            sVn = cute.local_tile(sX, (VB, C), (0, 0))
            sVd = cute.local_tile(sX, (VB, C), (0, 1))

        thr_s = mma_s.get_slice(tidx)
        thr_x = mma_x.get_slice(tidx)
        thr_p = mma_p.get_slice(tidx)
        tBw = mma_x.make_fragment_B(thr_x.partition_B(sW))
        tBq = mma_x.make_fragment_B(thr_x.partition_B(sQ))
        tBp = mma_x.make_fragment_B(thr_x.partition_B(sP))
        tAq = mma_p.make_fragment_A(thr_p.partition_A(sQ))
        tBkb = [mma_p.make_fragment_B(thr_p.partition_B(t)) for t in sKb]
        tBktb = [mma_s.make_fragment_B(thr_s.partition_B(cm.transpose_view(t))) for t in sKb]
        if cutlass.const_expr(regs_a):
            rS = mma_x.make_fragment_A(thr_x.partition_shape_A((VB, K)))
            rVn = mma_x.make_fragment_A(thr_x.partition_shape_A((VB, C)))
            rVd = mma_s.make_fragment_A(thr_s.partition_shape_A((VB, C)))
        else:
            rS = mma_x.make_fragment_A(thr_x.partition_A(sX))
            rVn = mma_x.make_fragment_A(thr_x.partition_A(sVn))
            rVd = mma_s.make_fragment_A(thr_s.partition_A(sVd))
        cS = thr_s.partition_C(cute.make_identity_tensor((VB, K)))  # (v, d)
        cX = thr_x.partition_C(cute.make_identity_tensor((VB, C)))  # (v, i)
        cP = thr_p.partition_C(cute.make_identity_tensor((C, C)))  # (i, j)

        b, ts, te, cbase, nchunks = locate_seq(n, mCu, mCuC, T, NT)

        # ---- state S^T [v, d] (float32 accumulators)
        accS = cute.make_rmem_tensor(thr_s.partition_shape_C((VB, K)), Float32)
        start_state(accS, cS, mH0, n, hv, v0, state_vk, has_h0)

        NPAR = 2 if prefetch else 1  # chunks a trip of the loop: one per buffer, so every tile stays static
        if cutlass.const_expr(prefetch):
            if nchunks > 0:
                issue_chunk(mQ, mK, mW, mU, mGc, sQ, sKb[0], sW, sUb[0], sGcb[0], b, h, hv, ts, v0,
                            cutlass.min(te - ts, C), tidx)
            cute.arch.cp_async_commit_group()
        for cp in cutlass.range((nchunks + NPAR - 1) // NPAR, unroll=1):
            for par in cutlass.range_constexpr(NPAR):
                ci = cp * NPAR + par
                if ci < nchunks:
                    t0 = ts + ci * C
                    length = cutlass.min(te - t0, C)
                    pmark(prof, -1)
                    if cutlass.const_expr(prefetch):
                        cute.arch.cp_async_wait_group(0)
                        cute.arch.fence_view_async_shared()
                        cute.arch.sync_threads()  # chunk ci is in smem; every thread is done with chunk ci - 1
                    else:
                        cute.arch.sync_threads()  # the previous chunk is done with every smem tile
                        load_chunk(mQ, mK, mW, mU, mGc, sQ, sKb[0], sW, sUb[0], sGcb[0], b, h, hv, t0, v0, length, tidx)
                        cute.arch.fence_view_async_shared()
                        cute.arch.sync_threads()
                    pmark(prof, 0)

                    # ---- S^T in the input dtype as a register A operand (two warpgroups: into sX, once
                    # every warpgroup is past the barrier above, so done with the previous chunk's sX)
                    if cutlass.const_expr(regs_a):
                        for f in cutlass.range_constexpr(cute.size(rS)):
                            rS[f] = accS[map_s[f]].to(dtype)
                    else:
                        for e in cutlass.range_constexpr(cute.size(accS)):
                            sv, sd = cS[e]
                            sX[sv, sd] = accS[e].to(dtype)
                        cute.arch.fence_view_async_shared()
                        cute.arch.sync_threads()
                    accX = cute.make_rmem_tensor(thr_x.partition_shape_C((VB, C)), Float32)
                    accO = cute.make_rmem_tensor(thr_x.partition_shape_C((VB, C)), Float32)
                    accP = cute.make_rmem_tensor(thr_p.partition_shape_C((C, C)), Float32)
                    gemm(mma_x, accX, rS, tBw, True)  # S^T w^T   [v, i]
                    gemm(mma_x, accO, rS, tBq, True)  # S^T q^T   [v, i]
                    gemm(mma_p, accP, tAq, tBkb[par], True)  # q k^T    [i, j]
                    warpgroup.commit_group()
                    if cutlass.const_expr(store_states):  # the chunk-start state, for the backward: stored while
                        # the products above run (they do not touch accS; the update below does, after their wait)
                        store_state(accS, cS, mHs, cbase + ci, hv, v0, False)  # input-dtype rows [K, V]
                    if cutlass.const_expr(l2norm):
                        if tidx < C:
                            sRq[tidx] = row_inv_norm(sQ, tidx)
                        elif tidx < 2 * C:
                            sRk[tidx - C] = row_inv_norm(sKb[par], tidx - C)
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(l2norm or prefetch or not regs_a):
                        cute.arch.sync_threads()  # sRq/sRk written; every read of sQ, sW (and sX) is done
                    if cutlass.const_expr(prefetch):
                        # chunk ci + 1: q, w over this chunk's (done with); k, u, gc into the other buffer
                        if ci + 1 < nchunks:
                            t1 = t0 + C
                            issue_chunk(mQ, mK, mW, mU, mGc, sQ, sKb[1 - par], sW, sUb[1 - par], sGcb[1 - par],
                                        b, h, hv, t1, v0, cutlass.min(te - t1, C), tidx)
                        cute.arch.cp_async_commit_group()
                    pmark(prof, 1)

                    # ---- vn^T = u^T - S^T w^T (in place)
                    for e in cutlass.range_constexpr(cute.size(accX)):
                        xv, xi = cX[e]
                        accX[e] = sUb[par][xi, xv].to(Float32) - accX[e]
                    # ---- P = scale tril(q k^T exp(gc_i - gc_j)) rq_i rk_j -> smem (B operand of the o update)
                    store_p(accP, cP, sP, sGcb[par], sRq, sRk, scale)
                    # ---- o^T = scale exp(gc_i) rq_i S^T q^T + ...
                    scale_o_rows(accO, cX, sGcb[par], sRq, scale, 1)
                    glast = sGcb[par][C - 1]
                    def dcoef(dj):  # the state update's column factor exp(gl - gc_j) rk_j
                        c = cute.math.exp2((glast - sGcb[par][dj]) * LOG2E, fastmath=True)
                        return c * sRk[dj] if cutlass.const_expr(l2norm) else c

                    if cutlass.const_expr(regs_a):
                        for f in cutlass.range_constexpr(cute.size(rVn)):
                            rVn[f] = accX[map_vn[f]].to(dtype)
                        for f in cutlass.range_constexpr(cute.size(rVd)):
                            _, dj = cX[map_vd[f]]
                            rVd[f] = (accX[map_vd[f]] * dcoef(dj)).to(dtype)
                    else:  # vn^T and its scaled copy into sX (visible after the barrier below)
                        for e in cutlass.range_constexpr(cute.size(accX)):
                            xv, dj = cX[e]
                            c = dcoef(dj)
                            sVn[xv, dj] = accX[e].to(dtype)
                            sVd[xv, dj] = (accX[e] * c).to(dtype)
                    decay = cute.math.exp2(glast * LOG2E, fastmath=True)
                    for e in cutlass.range_constexpr(cute.size(accS)):
                        accS[e] = accS[e] * decay
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()  # P visible to the async proxy
                    pmark(prof, 2)

                    gemm(mma_x, accO, rVn, tBp, False)  # o^T += vn^T P^T
                    gemm(mma_s, accS, rVd, tBktb[par], False)  # S^T += (vn^T diag(exp(gl - gc) rk)) k
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    pmark(prof, 3)

                    for e in cutlass.range_constexpr(cute.size(accO)):
                        ov, oi = cX[e]
                        if oi < length:
                            mO[b, t0 + oi, hv, v0 + ov] = accO[e].to(dtype)
                    pmark(prof, 4)

        if cutlass.const_expr(out_final):
            store_state(accS, cS, mHT, n, hv, v0, state_vk)
        pfinish(prof, mProf, (n * cute.arch.grid_dim()[1] + hv) * cute.arch.grid_dim()[2] + vb, tidx)

    @cute.jit
    def host(
        mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor, mH0: cute.Tensor,
        mO: cute.Tensor, mHT: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor, mHs: cute.Tensor, scale: Float32,
        T: Int32, NT: Int32, group: Int32, nseq: Int32, mProf: cute.Tensor, stream,
    ):
        _static_checks(dtype, K, V)
        HV = mU.shape[2]
        kernel(mQ, mK, mW, mU, mGc, mH0, mO, mHT, mCu, mCuC, mHs, scale, T, NT, group, mProf).launch(
            grid=[nseq, HV, V // VB], block=[THREADS, 1, 1], stream=stream, **cm.two_ctas_an_sm(not regs_a),
        )

    f = _fakes()
    args = (
        f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, V), f.any3(Float32),
        f.state(), f.rows4(dtype, V), f.state(), f.vec(cutlass.Int32), f.vec(cutlass.Int32),
        f.state(dtype if store_states else Float32),
        Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(1), f.vec(cutlass.Int64), f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


# ------------------------------------------------------------------ trace-time checks and fake tensors


def _static_checks(dtype, K: int, V: int) -> None:
    """Layout facts the kernels rely on, asserted while tracing (no GPU needed)."""
    cm.check_mn_major_view(dtype, CHUNK, K)
    cm.check_mn_major_view(dtype, CHUNK, V)


class _fakes:
    """Fake tensors with symbolic sizes and strides: one compile serves every shape."""

    def __init__(self):
        _, self.cute = kc.import_cute()

    def rows4(self, dtype, d: int):
        cute = self.cute
        s = [cute.sym_int(), cute.sym_int(), cute.sym_int()]
        st = [cute.sym_int(divisibility=8), cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)]
        return cute.runtime.make_fake_tensor(dtype, (*s, d), (*st, 1), assumed_align=16)

    def any3(self, dtype):
        cute = self.cute
        return cute.runtime.make_fake_tensor(
            dtype, (cute.sym_int(), cute.sym_int(), cute.sym_int()), (cute.sym_int(), cute.sym_int(), cute.sym_int()),
            assumed_align=dtype.width // 8,
        )

    def vec(self, dtype):
        cute = self.cute
        return cute.runtime.make_fake_tensor(dtype, (cute.sym_int(),), (cute.sym_int(),), assumed_align=dtype.width // 8)

    def state(self, dtype=None):
        cute = self.cute
        from cutlass import Float32

        dtype = Float32 if dtype is None else dtype
        return cute.runtime.make_fake_tensor(
            dtype, tuple(cute.sym_int() for _ in range(4)), tuple(cute.sym_int() for _ in range(4)),
            assumed_align=dtype.width // 8,
        )

    def stream(self):
        return self.cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


# ------------------------------------------------------------------ compile (cached)


def _dt(t: torch.dtype | None):
    # absent optional tensors get a float32 placeholder
    return cm.cute_dtype(torch.float32 if t is None else t)


def _wgs_choice(env: str, value: str, wgs, K: int, V: int) -> int:
    """Warpgroups of a kernel with a two-warpgroup variant at K = 128 (and V = 128 where ``V`` is
    given; None: any V): ``wgs``, else the env value."""
    serves = K == 128 and V in (None, 128)
    if wgs is None:
        if value not in ("1", "2"):
            raise ValueError(f"{env}={value!r}: expected 1 or 2")
        wgs = int(value) if serves else 1
    if wgs not in (1, 2) or (wgs == 2 and not serves):
        raise ValueError(f"wgs={wgs} at K={K}, V={V}: 1, or 2 at K = 128" + (" and V = 128" if V else ""))
    return wgs


def get_wy_kernel(dtype, g_dtype, beta_dtype, alog_dtype, dtb_dtype, K, V, l2norm, gate, has_dt_bias,
                  beta_sigmoid, beta_scale, varlen, profile=False, wgs=None, store_t=False, scan=None,
                  async_loads=None, a2=None, inv=False):
    """The wy kernel; with ``inv`` its gate-free chunk-inverse variant (``_build_wy``'s INV), launched as
    ``fn(k, g, beta, A_log, dt_bias, cu, cu_chunks, gc, tm, beta_eff, T, NT, nseq, group, chunks, prof)``."""
    if inv:
        scan, store_t = True, True
    wgs = _wgs_choice("CUDNN_TRAIN_GDN_WY_WGS", WY_WGS, wgs, K, V)
    scan = WY_SCAN if scan is None else bool(scan)
    async_loads = scan and (WY_ASYNC if async_loads is None else bool(async_loads))  # cp.async: scan prep only
    a2 = WY_A2 if a2 is None else bool(a2)
    key = ("wy", str(dtype), str(g_dtype), str(beta_dtype), str(alog_dtype), str(dtb_dtype), K, V, bool(l2norm),
           bool(gate), bool(has_dt_bias), bool(beta_sigmoid), float(beta_scale), bool(varlen)) + (
           ("profile",) if profile else ()) + ((("wgs", wgs),) if wgs != 1 else ()) + (("store_t",) if store_t else ()) + (
           () if scan else ("no_scan",)) + (("async",) if async_loads else ()) + (("a2",) if a2 else ()) + (
           ("inv",) if inv else ())

    def build():
        return _build_wy(_dt(dtype), _dt(g_dtype), _dt(beta_dtype), _dt(alog_dtype), _dt(dtb_dtype), K, V, l2norm,
                         gate, has_dt_bias, beta_sigmoid, beta_scale, varlen, bool(profile), wgs, bool(store_t), scan,
                         async_loads, a2, bool(inv))

    return kc.get_kernel("gdn_fwd_wy", key, build, _SOURCES)


def get_state_kernel(dtype, K, V, l2norm, varlen, has_h0, out_final, state_vk, store_states=False,
                     prefetch=None, profile=False, wgs=None, p_select=None):
    # by default at K = 128 for inference; not for the training forward's store_states variant (GPU-checked
    # with it, but slower there: see STATE_WGS)
    prefetch = (STATE_PREFETCH and K == 128 and not store_states) if prefetch is None else bool(prefetch)
    wgs = _wgs_choice("CUDNN_TRAIN_GDN_FWD_WGS", STATE_WGS or ("2" if store_states else "1"), wgs, K,
                      None)  # V only sets the grid
    key = ("state", str(dtype), K, V, bool(l2norm), bool(varlen), bool(has_h0), bool(out_final), bool(state_vk),
           bool(store_states)) + (("prefetch",) if prefetch else ()) + (("profile",) if profile else ()) + (
           (("wgs", wgs),) if wgs != 1 else ())
    p_select = STATE_PSEL if p_select is None else bool(p_select)
    key = key + (("psel",) if p_select else ())

    def build():
        return _build_state(_dt(dtype), K, V, l2norm, varlen, has_h0, out_final, state_vk, store_states, prefetch,
                            bool(profile), wgs, p_select)

    return kc.get_kernel("gdn_fwd_state", key, build, _SOURCES)


# ------------------------------------------------------------------ launch


_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DUMMIES: dict = {}


def _dummies(dev: torch.device):
    """Placeholders for absent optional tensors (never read by the kernels)."""
    d = _DUMMIES.get(dev)
    if d is None:
        d = _DUMMIES[dev] = (torch.zeros(1, dtype=torch.float32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
                             torch.zeros(1, dtype=torch.int64, device=dev))
    return d


def chunk_rows(B: int, T: int, nseq: int, varlen: bool) -> int:
    """How many chunk rows the kernels use: ``B * NT``, or with varlen the upper bound ``T // 64 + N``."""
    return T // CHUNK + nseq if varlen else B * -(-T // CHUNK)


def chunk_map(cu_seqlens, B: int, T: int, dev: torch.device):
    """``(cu, cu_chunks, rows, NT)`` for the kernels' chunk rows: int32 ``cu_seqlens`` and the
    cumulative chunk count on the device, the row count (``B * NT``, or with varlen the upper bound
    ``T // 64 + N``, so that nothing is read on the host) and ``NT`` (0 with varlen). Without
    varlen ``cu`` and ``cu_chunks`` are placeholders the kernels do not read."""
    if cu_seqlens is None:
        _, i32_dummy, _ = _dummies(dev)
        return i32_dummy, i32_dummy, chunk_rows(B, T, B, False), -(-T // CHUNK)
    cu = cu_seqlens.to(device=dev, dtype=torch.int32)
    nch = (cu[1:] - cu[:-1] + (CHUNK - 1)) // CHUNK
    cu_chunks = torch.cat([cu.new_zeros(1), torch.cumsum(nch, 0, dtype=torch.int32)])
    return cu, cu_chunks, chunk_rows(B, T, cu.numel() - 1, True), 0


def check_serve(q, k, v, g, beta, initial_state=None, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                cu_seqlens=None, chunk_size=64):
    """Raise Unsupported (touching no memory) for what these kernels do not serve; return q, k, v as the kernels
    take them (``check_rows_aligned``: the strides of size-1 dims set)."""
    cm.check_device(q)
    if chunk_size != CHUNK:
        raise Unsupported(f"chunk_size={chunk_size} (kernels use {CHUNK})")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise Unsupported(f"dtype {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise Unsupported("q, k, v dtypes differ")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise Unsupported("shapes")
    K, V = q.shape[-1], v.shape[-1]
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise Unsupported(f"head dims K={K}, V={V} (served: {HEAD_DIMS})")
    H, HV = q.shape[2], v.shape[2]
    if H == 0 or HV % H:
        raise Unsupported(f"HV={HV} is not a multiple of H={H}")
    for name, t in (("g", g), ("beta", beta)):
        if t.dtype not in _FLOAT_DTYPES or tuple(t.shape) != tuple(v.shape[:3]):
            raise Unsupported(f"{name}: dtype {t.dtype} / shape {tuple(t.shape)}")
    if use_gate_in_kernel:
        if A_log is None or A_log.dtype not in _FLOAT_DTYPES or A_log.numel() != HV:
            raise Unsupported("A_log")
        if dt_bias is not None and (dt_bias.dtype not in _FLOAT_DTYPES or dt_bias.numel() != HV):
            raise Unsupported("dt_bias")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise Unsupported(f"initial_state dtype {initial_state.dtype} (float32 served)")
    if cu_seqlens is not None and q.shape[0] != 1:
        raise Unsupported("cu_seqlens with B != 1")
    q, k, v = (cm.check_rows_aligned(name, t) for name, t in (("q", q), ("k", k), ("v", v)))
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if t is not None:
            if t.device != q.device:
                raise Unsupported(f"{name} on {t.device}")
            cm.check_index_range(name, t)
    if q.shape[0] * q.shape[1] * HV * max(K, V) >= 2**31:
        raise Unsupported("more than 2**31 elements in an intermediate")
    return q, k, v


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    chunk_size: int = 64,
    return_intermediates: bool = False,
    store_states: bool = False,
    keep_vn: bool = False,
    keep_tm: bool = False,
    train_onfly: bool = False,
):
    """The chunked GDN forward on SM90. Returns ``Served((o, final_state), "sm90")``.

    ``o`` has q's dtype and shape ``[B, T, HV, V]``; ``final_state`` is float32
    ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) or None. With
    ``return_intermediates`` the value is ``(o, final_state, (w, u, gc))``: the
    WY factors and the in-chunk cumulative gate (natural log, float32,
    ``[B, T, HV]``); ``store_states`` adds the state entering every chunk (input dtype
    ``[chunks, HV, K, V]``, chunk ``b * NT + c``, with varlen ``cu_chunks[n] + c`` on the upper
    bound ``T // 64 + N`` of the chunk count; surplus rows are not written) as a fourth
    intermediate, for the backward, and two more for the backward's stage 3: ``vn = u - w S`` of every chunk
    (input dtype ``[B, T, HV, V]``, as the split pass's chain writes it) with ``keep_vn``, and the chunks'
    ``Tm = (I + A)^-1`` (input dtype ``[B, T, HV, 64]``, row i of a chunk at its token, as the wy kernel
    solved it) with ``keep_tm``; each None when not asked for (vn also where the fused state kernel
    served). ``train_onfly`` (the training path's, with ``store_states``, ``keep_vn`` and ``keep_tm``): its backward
    takes Tm and the effective beta instead of w, so where the specialized warpgroups serve at 128 columns the
    chain may form w and u itself (``TRAIN_ONFLY``): then w is None and u's slot holds the effective beta
    (float32 ``[B, T, HV]``). Arguments follow ``fused.chunk_gated_delta_rule``; they
    are assumed validated there. Declines with ``Unsupported`` before any
    device work for what it does not serve (see ``check_serve``).
    """
    q, k, v = check_serve(q, k, v, g, beta, initial_state, use_gate_in_kernel, A_log, dt_bias, cu_seqlens, chunk_size)
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    nseq = (cu_seqlens.numel() - 1) if varlen else B
    if initial_state is not None:
        want = (nseq, HV, V, K) if state_v_first else (nseq, HV, K, V)
        if tuple(initial_state.shape) != want:
            raise Unsupported(f"initial_state shape {tuple(initial_state.shape)} (expected {want})")
    if store_states:  # the chunk rows (and the backward's dH rows) must be int32-addressable too
        rows = chunk_rows(B, T, nseq, varlen)
        if rows * HV * K * V >= 2**31:
            raise Unsupported(f"{rows} chunk rows of {HV} x {K} x {V} states: more than 2**31 elements")
    if scale is None:
        scale = K**-0.5
    beta_scale = 2.0 if (use_beta_sigmoid_in_kernel and allow_neg_eigval) else 1.0
    dev = q.device

    cu, cu_chunks, grid_chunks, NT = chunk_map(cu_seqlens, B, T, dev)
    # the state pass: chain + out kernels (gated_delta_rule_fwd_split_sm90) where the fused kernel's
    # grid leaves SMs idle, and always for the training forward (store_states: the chain writes the
    # chunk-start states as 16-byte rows of its shared state tile, where the fused kernel stores them
    # element by element from its accumulators: H200, B4 T4096 H16 HV32, chain 0.273 + out 0.249 ms
    # against 0.721 for the fused kernel with the stores), unless CUDNN_TRAIN_GDN_FWD_WS_TSTORE (on by
    # default) sends it to the specialized warpgroups (below); CUDNN_TRAIN_GDN_FWD_SPLIT=1: always, 0: never
    # (the training forward then takes the fused kernel, or with TSTORE the specialized warpgroups); not where
    # the split's chunk states would not be int32-addressable
    split = grid_chunks * HV * K * V < 2**31
    # the inference forward's specialized warpgroups in segments (CUDNN_TRAIN_GDN_FWD_WS_SEG, off by default): where
    # asked and more than one, they take the call the split pass would (few sequences), on nseg x the grid
    ws_nseg = 1
    if not store_states and not return_intermediates and SPLIT is not True and STATE_WS is not False:
        from . import gated_delta_rule_fwd_ws_sm90 as WS

        ws_nseg = WS.segments(nseq, HV, V, B * T, use_qk_l2norm_in_kernel, dev)
    # the training forward's stores by TMA from transposed tiles (CUDNN_TRAIN_GDN_FWD_WS_TSTORE, on by default): with
    # them the training forward takes the specialized warpgroups where the inference forward would (the split pass
    # where its grid leaves SMs idle; the carried split where that one would take the call, below), since what kept
    # it on the split pass was the gathered stores' cost
    tstore = False
    if store_states:
        from . import gated_delta_rule_fwd_ws_sm90 as WS

        tstore = WS.TSTORE
    # the carried split (CUDNN_TRAIN_GDN_FWD_CARRY, on by default): where it gives more than one segment (few long
    # sequences) it takes the call (over the segmented specialized warpgroups too, not over a forced split pass or
    # fused state kernel), w and u from the wy kernel; the training forward's only with tstore (its segments' passes
    # then write the chunk states and vn of their chunks, from exact start states)
    carry = 1
    if not ((store_states and not tstore) or return_intermediates or state_v_first or SPLIT is True
            or STATE_WS is False):
        from . import gated_delta_rule_fwd_split_sm90 as sp

        carry = sp.carry_segments(nseq, HV, K, V, B * T, use_qk_l2norm_in_kernel, dev, q.dtype)
    if carry > 1:
        ws_nseg, split = 1, False
    elif ws_nseg > 1:
        split = False
    elif split and SPLIT is None:
        from . import gated_delta_rule_fwd_split_sm90 as sp

        split = (store_states and STATE_WS is not True and not tstore) or sp.preferred(nseq, HV, V, dev)
    elif split:
        split = SPLIT
    ws = ws_nseg > 1 or (not split and ((not store_states or tstore) if STATE_WS is None else STATE_WS))
    onfly = ws and not store_states and not return_intermediates and carry == 1
    if ws and store_states and train_onfly and keep_vn and keep_tm and tstore and carry == 1 and ws_nseg == 1:
        from . import gated_delta_rule_fwd_ws_sm90 as WS

        onfly = TRAIN_ONFLY and onfly_default(K, V, WS.v_block(V, nseq, HV, dev, True, True))
    elif onfly and ONFLY is None:  # the measured default: where one CTA holds all of V (the vb state_pass_onfly takes)
        from . import gated_delta_rule_fwd_ws_sm90 as WS

        onfly = onfly_default(K, V, WS.v_block(V, nseq * ws_nseg, HV, dev))
    elif onfly:
        onfly = bool(ONFLY)
    # kernel 1: w, u, gc (with onfly its variant writing only the gate-free chunk inverses, gc and beta)
    wy = get_wy_kernel(
        q.dtype, g.dtype, beta.dtype, A_log.dtype if use_gate_in_kernel else None,
        dt_bias.dtype if (use_gate_in_kernel and dt_bias is not None) else None,
        K, V, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_gate_in_kernel and dt_bias is not None,
        use_beta_sigmoid_in_kernel, beta_scale, varlen, store_t=store_states and keep_tm, inv=onfly,
    )
    if not split and not ws:
        st = get_state_kernel(q.dtype, K, V, use_qk_l2norm_in_kernel, varlen, initial_state is not None,
                              output_final_state, state_v_first, store_states)

    o = _empty(B, T, HV, V, dtype=q.dtype, device=dev)
    w = None if onfly else _empty(B, T, HV, K, dtype=q.dtype, device=dev)
    u = None if onfly else _empty(B, T, HV, V, dtype=q.dtype, device=dev)
    gc = _empty(B, T, HV, dtype=torch.float32, device=dev)
    if output_final_state:
        ht = _empty(*((nseq, HV, V, K) if state_v_first else (nseq, HV, K, V)), dtype=torch.float32, device=dev)
    else:
        ht = None

    f32_dummy, _, i64_dummy = _dummies(dev)
    state_dummy = f32_dummy.view(1, 1, 1, 1)
    # chunk-start states [chunks, HV, K, V] (chunk b * NT + c, or cu_chunks[n] + c with varlen)
    hs = _empty(grid_chunks, HV, K, V, dtype=q.dtype, device=dev) if store_states else None
    vn = _empty(B, T, HV, V, dtype=q.dtype, device=dev) if (store_states and keep_vn and (split or ws)) else None
    tm = _empty(B, T, HV, CHUNK, dtype=q.dtype, device=dev) if (store_states and keep_tm) else None
    alog = A_log.reshape(HV) if use_gate_in_kernel else f32_dummy
    dtb = dt_bias.reshape(HV) if (use_gate_in_kernel and dt_bias is not None) else f32_dummy
    group = HV // H

    if onfly:  # the gate-free chunk inverses and the effective beta (train_onfly: in u's slot)
        a0 = _empty(B, T, HV, CHUNK, dtype=q.dtype, device=dev)
        beta_eff = _empty(B, T, HV, dtype=torch.float32, device=dev)
        u = beta_eff if store_states else None
    if T == 0 or nseq == 0:  # no tokens: the final state is the initial one
        if ht is not None:
            if initial_state is None:
                ht.zero_()
            else:
                ht.copy_(initial_state)
    elif onfly:
        from . import gated_delta_rule_fwd_ws_sm90 as WS

        wy(k, g, beta, alog, dtb, cu, cu_chunks, gc, a0, beta_eff, T, NT, nseq, group, grid_chunks, i64_dummy)
        WS.state_pass_onfly(q, k, v, a0, gc, beta_eff, o, initial_state, ht, cu, cu_chunks, NT, scale,
                            use_qk_l2norm_in_kernel, state_v_first, group, nseq, nseg=ws_nseg, hs=hs, vn=vn, tm=tm)
    else:
        wy(k, v, g, beta, alog, dtb, cu, cu_chunks, w, u, gc, w[..., :CHUNK] if tm is None else tm, T, NT, nseq, group,
           grid_chunks, i64_dummy)
        if carry > 1:
            from . import gated_delta_rule_fwd_split_sm90 as sp

            sp.carried_state_pass(q, k, w, u, gc, o, initial_state, ht, cu_seqlens, cu, cu_chunks, T, NT, scale,
                                  group, nseq, carry, hs=hs, vn=vn)
        elif split:
            from . import gated_delta_rule_fwd_split_sm90 as sp

            sp.state_pass(q, k, w, u, gc, o, initial_state, ht, cu, cu_chunks, grid_chunks, NT, scale,
                          use_qk_l2norm_in_kernel, state_v_first, group, nseq, hs=hs, vn=vn)
        elif ws:
            from . import gated_delta_rule_fwd_ws_sm90 as WS

            WS.state_pass(q, k, w, u, gc, o, initial_state, ht, cu, cu_chunks, NT, scale, use_qk_l2norm_in_kernel,
                          state_v_first, group, nseq, hs=hs, vn=vn, nseg=ws_nseg)
        else:
            st(q, k, w, u, gc, state_dummy if initial_state is None else initial_state, o,
               state_dummy if ht is None else ht, cu, cu_chunks, state_dummy if hs is None else hs, float(scale),
               T, NT, group, nseq, i64_dummy)
    if store_states:
        return Served((o, ht, (w, u, gc, hs, vn, tm)), "sm90")
    if return_intermediates:
        return Served((o, ht, (w, u, gc)), "sm90")
    return Served((o, ht), "sm90")


def _scale_or_default(scale, q) -> float:
    return q.shape[-1] ** -0.5 if scale is None else float(scale)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


FWD_OPT_IN = "CUDNN_TRAIN_GDN_SM90_FWD"


def _fla_serves() -> bool:
    """Whether the op's next backend, FLA's chunk_gated_delta_rule, imports (its own test)."""
    from ..fused.gated_delta_rule import fla_original

    try:
        fla_original("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule")
    except Unsupported:
        return False
    return True


def serve_switch(name: str) -> bool | None:
    """``CUDNN_TRAIN_GDN_SM90_FWD`` (calls without gradients) / ``CUDNN_TRAIN_GDN_SM90_TRAIN`` (with):
    True (1 / true / yes / on) serves every call the kernels can, False (any other value) none,
    None (unset or empty) leaves it to :func:`peer_is_faster`."""
    return env_flag(name) if os.environ.get(name, "").strip() else None


def flash_qla_takes(q, k, v, g, beta, *, initial_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                    use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens, scale) -> bool:
    """Whether FLA's chunk_gated_delta_rule would hand this call to FlashQLA (FLA 0.6 routes there when
    ``flash_qla`` is installed, FLA's backend dispatch is on (``FLA_DISABLE_BACKEND_DISPATCH`` not 1),
    ``FLA_FLASH_QLA`` is not 0 and FlashQLA's own check accepts the call: SM90 / SM100 / SM120, half
    precision, K = V = 128, none of the in-kernel gate / beta flags nor ``allow_neg_eigval``). Asked of
    FLA's FlashQLA backend itself; False when that cannot be asked (an FLA without it)."""
    try:
        import fla.backends as fla_backends
        from fla.ops.gated_delta_rule.backends.flash_qla import FlashQLABackend

        if getattr(fla_backends, "_DISPATCH_DISABLED", False):
            return False
        peer = FlashQLABackend()
        if not (peer.is_available() and peer.is_enabled()):
            return False
        extra = {"use_gate_in_kernel": True} if use_gate_in_kernel else {}
        ok, _ = peer.verify("chunk_gated_delta_rule", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                            state_v_first=state_v_first, cu_seqlens=cu_seqlens, **extra)
        return bool(ok)
    except Exception:  # an FLA without the backend registry, or one that fails to import it
        return False


def fla_takes(q, initial_state, chunk_size) -> bool:
    """Whether the op's fla backend would serve the call: FLA imports and its argument declines
    (``fused.gated_delta_rule.fla_argument_declines``: half or float32 inputs, chunk size 16 / 32 / 64, a
    float32 initial state or none, T > 0) pass; its host read of ``cu_seqlens`` is not made."""
    from ..fused.gated_delta_rule import FLA_CHUNK_SIZES, fla_argument_declines

    if not _fla_serves():
        return False
    try:
        fla_argument_declines(q, initial_state, FLA_CHUNK_SIZES, chunk_size)
    except Unsupported:
        return False
    return True


def peer_is_faster(*, fla_next: bool, fla_ok: bool, flash_qla: bool, host_read: bool) -> str | None:
    """Why the op's next backend should serve this call rather than these kernels, or None. Only FLA can
    be faster, and only where it comes next (``fla_next``: not left out of a forced backend list), would
    serve the call (``fla_ok``: :func:`fla_takes`), would not read ``cu_seqlens`` on the host during a
    CUDA-graph capture (``host_read``) and would hand it to FlashQLA (``flash_qla``: :func:`flash_qla_takes`),
    which is faster than us on the H200 (docs/PERFORMANCE.md, twelfth session, medians of three rounds:
    forward 0.44 vs 0.76 ms, forward+backward 1.80 vs 2.71 at B4 T4096 H16 HV32, K = V = 128). FLA's own
    kernels are slower at every call timed (B4 T4096 H16 HV32: K = V = 128 forward 0.94 vs 0.76 ms,
    forward+backward 3.81 vs 2.71; with the layers' in-kernel gate and beta sigmoid 1.69 vs 0.79 and 4.53 vs 2.80; K = V = 64
    0.63 vs 0.50 and 3.27 vs 1.83), and the torch backend is far slower: these kernels serve."""
    if fla_next and fla_ok and flash_qla and not host_read:
        return "FlashQLA (through FLA) is faster on SM90 for this call"
    return None


def cutedsl_backend(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                    cu_seqlens, chunk_size, cu_seqlens_cpu=None):
    """The ``cutedsl`` backend of op ``chunk_gated_delta_rule`` (keyword arguments of its torch backend).

    A call that needs gradients goes to the training path (``gated_delta_rule_train_sm90``), one
    without to the forward kernels, unless the op's next backend is faster for it
    (:func:`peer_is_faster`: FLA when it would hand the call to FlashQLA); ``CUDNN_TRAIN_GDN_SM90_TRAIN`` /
    ``CUDNN_TRAIN_GDN_SM90_FWD`` = 1 serve every call the kernels can, = 0 none (:func:`serve_switch`).
    ``cu_seqlens`` values are trusted as FLA does (never read on the host; ``cu_seqlens_cpu`` is not
    needed). A half-precision initial state is read as float32.
    """
    from . import gated_delta_rule_train_sm90 as tr

    if torch.compiler.is_compiling():  # first: nothing below is traced (FLA's cached lookups among it)
        raise Unsupported("traced by torch.compile (kernels launch on real tensors only)")
    if not q.is_cuda:
        raise Unsupported("no GPU" if not torch.cuda.is_available() else f"tensor on {q.device}")
    training = _needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    env = tr.OPT_IN if training else FWD_OPT_IN
    switch = serve_switch(env)
    if switch is False:
        raise Unsupported(f"{env}={os.environ[env].strip()}")
    if switch is None:
        fla_next = "fla" in get_op("chunk_gated_delta_rule").after("cutedsl")
        fla_ok = fla_next and fla_takes(q, initial_state, chunk_size)
        fq = fla_ok and flash_qla_takes(
            q, k, v, g, beta, initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens, scale=scale)
        host_read = cu_seqlens is not None and cu_seqlens_cpu is None and torch.cuda.is_current_stream_capturing()
        why = peer_is_faster(fla_next=fla_next, fla_ok=fla_ok, flash_qla=fq, host_read=host_read)
        if why is not None:
            raise Unsupported(f"{why} ({env}=1 serves it here)")
    if initial_state is not None and initial_state.dtype in (torch.float16, torch.bfloat16):
        # every other decline first: nothing is copied for a call that is not served
        check_serve(q, k, v, g, beta, None, use_gate_in_kernel, A_log, dt_bias, cu_seqlens, chunk_size)
        cm.check_index_range("initial_state", initial_state)
        if initial_state.device != q.device:
            raise Unsupported(f"initial_state on {initial_state.device}")
        initial_state = initial_state.float()
    if training:
        check_serve(q, k, v, g, beta, initial_state, use_gate_in_kernel, A_log, dt_bias, cu_seqlens, chunk_size)
        if initial_state is not None:
            want = (q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1, v.shape[2])
            want = (*want, *((v.shape[3], q.shape[3]) if state_v_first else (q.shape[3], v.shape[3])))
            if tuple(initial_state.shape) != want:
                raise Unsupported(f"initial_state shape {tuple(initial_state.shape)} (expected {want})")
        return Served(tr.train(
            q, k, v, g, beta, scale=_scale_or_default(scale, q), initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens,
        ), "sm90-train")
    return forward(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log if use_gate_in_kernel else None,
        dt_bias=dt_bias if use_gate_in_kernel else None, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, chunk_size=chunk_size,
    )

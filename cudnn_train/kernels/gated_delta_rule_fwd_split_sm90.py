"""The GDN forward's state pass split in two (SM90, CuTeDSL, WGMMA): a short sequential chain
and a parallel output kernel. Same math as ``gated_delta_rule_fwd_sm90``'s ``state`` kernel
(the notation of that module's docstring), same rounding points.

Kernel ``chain`` (grid: N x HV x V/VB, one warpgroup, VB = 32 or 64 columns of V): walks the
chunks of one sequence with the state block ``S [K, VB]`` in float32 accumulators (M = the K rows,
two M = 64 halves at K = 128), and per chunk does only what the next chunk needs::

    S (input dtype) -> smem -> global hs[chunk]          (the chunk-start state, for `out`)
    vn = u - w S                   WGMMA  M = 64 rows of the chunk, N = VB, A = w, B = S (smem)
    vn (input dtype) -> global                           (for `out`)
    S  = exp(gc_C) S + k^T (vn exp(gc_C - gc) rk)        WGMMA  A = k^T (MN-major view), B = vn (smem)

The next chunk's w, k, u and gc arrive while the current one is computed: w, k and u by TMA (by default since
the sixteenth session, :func:`chain_tma`; one elected thread issues them on the buffer's mbarrier, the sequence's
last chunk's rows past its end are zeroed once landed), gc by ``cp.async``; ``CUDNN_TRAIN_GDN_CHAIN_TMA=0`` brings
all four by ``cp.async`` (the same bits). Its stores (since the twenty-second session, :func:`chain_hs_tma`,
:func:`chain_vn_tma`): the chunk-start state by one TMA store from its shared tile, a full chunk's vn by one from a
tile of its own (a partial chunk's by 4-byte pairs).
Everything the output needs (q, the q k^T tile, its exp scaling, the o stores) is off this
chain, so a chunk costs two small WGMMA groups and the conversions between them; and the grid
is V/32 = 4 CTAs per (sequence, value head) at K = V = 128, so one long sequence still spreads
over 128 SMs.

Kernel ``out`` (grid: chunk x HV, one warpgroup; every chunk independent)::

    o = scale exp(gc_i) rq_i (q S) + tril(scale q k^T exp(gc_i - gc_j) rq_i rk_j) vn

with S the bf16/fp16 chunk-start state and vn from ``chain`` (the same values the fused kernel
converts to the input dtype before its products), P converted in registers into the A operand
of the second product. Its loads (:func:`out_tma`, the default since the seventeenth session) by TMA in two
groups, q, k and S on one mbarrier and vn on another, waited for only before ``P vn``, so that vn lands while
``q k^T`` and ``q S`` run (rows past a varlen sequence's end zeroed once landed, as cp.async zero-fills them:
the same bits); with ``CUDNN_TRAIN_GDN_OUT_TMA=0`` all four by ``cp.async``, waited for before the first product.

Cost: ``hs`` (input dtype, ``[chunk rows, HV, K, V]``, K V 2 bytes per chunk and value head) and
``vn`` (``[B, T, HV, V]``) round-trip through global memory, as FLA's forward does with its
``h``. The training forward (``store_states``) takes this pass at every grid: the chain's ``hs`` rows
are the chunk-start states the backward reads (input dtype), written from the shared state tile (as
16-byte rows until the twenty-second session, by one TMA store a chunk since; H200, B4 T4096 H16 HV32,
with the 16-byte rows: 0.85 ms whole training forward against 1.06 with the fused kernel's element-wise
stores).
"""

import torch

from . import compile as kc
from . import gated_delta_rule_common_sm90 as cm
from . import gated_delta_rule_fwd_sm90 as F

CHUNK = cm.CHUNK
THREADS = cm.THREADS
CHAIN_VBLOCKS = (16, 32, 64)  # 16: only by CUDNN_TRAIN_GDN_CHAIN_VB=16 (GPU-run, slower at every measured grid)
CHAIN_SEGMENTS = cm.SEGMENTS  # chain CTAs a (sequence, value head, V block): :func:`chain_segments`
_SOURCES = (__file__, F.__file__, cm.__file__)


def chain_vblock(nseq: int, HV: int, V: int, device: torch.device) -> int:
    """V columns per ``chain`` CTA: 64 when N x HV x V/64 CTAs already give every SM one, else 32
    (twice the CTAs on the same sequential chain). ``CUDNN_TRAIN_GDN_CHAIN_VB`` overrides (16, 32 or 64; 16,
    four times the CTAs of 64, only when asked: it measured slower everywhere).

    Measured (H200, K = V = 128, ``tools/time_gdn_fwd.py --chain-tma``, TMA loads, seventeenth session): 256 CTAs
    at VB 64 (B4 HV32) run the chain in 0.237 ms against 0.299 at VB 32 and 0.713 at VB 16; 32 sequence-heads
    (B1 HV32) in 0.645 at VB 64, 0.411 at VB 32 and 0.454 at VB 16."""
    vb = cm.env_vblock("CUDNN_TRAIN_GDN_CHAIN_VB", CHAIN_VBLOCKS, V)
    if vb is not None:
        return vb
    return 64 if nseq * HV * (V // 64) >= kc.num_sms(device) else 32


def chain_segments(nseq: int, HV: int, V: int, T: int, l2norm: bool, device: torch.device) -> int:
    """``chain`` CTAs a (sequence, value head, V block), each writing one segment of the sequence's chunks after a
    warm-up from a zero state that reaches back until the chunks' decay is below e^-20 (or to the sequence's start,
    with the initial state: the unsplit chain's bits); see ``_build_chain``. ``CUDNN_TRAIN_GDN_CHAIN_SEG``: unset or
    1, one (the unsplit chain, the default: see :func:`cm.segments` for why); ``auto``, the fewest of
    2, 4, 8, 16 that give every SM a CTA of 64 columns, keeping segments of at least ``SEG_MIN_CHUNKS`` chunks of a
    sequence's average length ``T / nseq`` (B1 T16384 H16 HV32: 4, the chain's grid of B4 T4096); 2 to 16 force
    that many (:func:`cm.segments`). Without l2norm always one: the truncation's bound needs unit-norm keys."""
    return cm.segments("CUDNN_TRAIN_GDN_CHAIN_SEG", nseq, HV * (V // 64), T, l2norm, device)


def preferred(nseq: int, HV: int, V: int, device: torch.device) -> bool:
    """Whether the split pass is the faster one: when the fused state kernel's N x HV x V/64 CTAs
    leave SMs idle. With one per SM or more the fused kernel moves less memory and wins (H200,
    K = V = 128: 0.94 vs 0.99 ms whole forward at B4 T4096 HV32; at B1 T16384 HV32 the split is
    1.13 ms against 1.98)."""
    return nseq * HV * (V // 64) < kc.num_sms(device)


def _static_checks(dtype, K: int, V: int, VB: int) -> None:
    cm.check_mn_major_view(dtype, K, VB)   # S block: B operand of w S
    cm.check_mn_major_view(dtype, CHUNK, VB)  # vn block: B operand of the state update
    cm.check_mn_major_view(dtype, CHUNK, 64)  # k halves: MN-major A operand of the state update
    cm.check_mn_major_view(dtype, K, V)    # whole state: B operand of q S
    cm.check_mn_major_view(dtype, CHUNK, V)  # vn: B operand of P vn


def _make_sum_sq(dtype, cols: int):
    """``sum_sq(sX, r)``: the float32 sum of squares of row ``r`` of a ``[rows, cols]`` smem tile."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32

    @cute.jit
    def sum_sq(sX: cute.Tensor, r: Int32):
        ss = Float32(0.0)
        for vc in cutlass.range_constexpr(cols // 8):
            frag = cute.make_rmem_tensor((1, 8), dtype)
            cute.autovec_copy(cute.local_tile(sX, (1, 8), (r, vc)), frag)
            xv = frag.load().to(Float32)
            ss = ss + (xv * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        return ss

    return sum_sq


def make_block_io(dtype, K: int, VB: int):
    """The helpers of a chain kernel whose state block ``[K, VB]`` (columns ``v0 :``) lives in float32
    accumulators split in ``K / 64`` M = 64 halves with coordinates ``cS = (d within the half, v)``
    (the forward's S, the backward's dH):

    * ``load_block(acc, cS, mX, n, hv, v0, state_vk)`` / ``store_block(...)``: from / to a float32 state
      ``mX[n, hv]`` (``[K, V]``, or ``[V, K]`` with ``state_vk``);
    * ``block_to_tile(acc, cS, sX)``: the block in the input dtype into the ``[K, VB]`` smem tile sX
      (element pairs, 4-byte stores);
    * ``tile_to_rows(sX, gX, v0, tidx)``: that tile into ``gX [K, V]`` (columns ``v0 :``), 16-byte vectors."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    KH = K // 64
    VPR = VB // 8  # 16-byte vectors of a block row
    RPP = THREADS // VPR

    @cute.jit
    def load_block(acc: cutlass.Constexpr, cS: cute.Tensor, mX: cute.Tensor, n: Int32, hv: Int32, v0: Int32,
                   state_vk: cutlass.Constexpr):
        for hf in cutlass.range_constexpr(KH):
            for e in cutlass.range_constexpr(cute.size(acc[hf])):
                dl, sv = cS[e]
                if cutlass.const_expr(state_vk):
                    acc[hf][e] = mX[n, hv, v0 + sv, hf * 64 + dl]
                else:
                    acc[hf][e] = mX[n, hv, hf * 64 + dl, v0 + sv]

    @cute.jit
    def store_block(acc: cutlass.Constexpr, cS: cute.Tensor, mX: cute.Tensor, n: Int32, hv: Int32, v0: Int32,
                    state_vk: cutlass.Constexpr):
        for hf in cutlass.range_constexpr(KH):
            for e in cutlass.range_constexpr(cute.size(acc[hf])):
                dl, sv = cS[e]
                if cutlass.const_expr(state_vk):
                    mX[n, hv, v0 + sv, hf * 64 + dl] = acc[hf][e]
                else:
                    mX[n, hv, hf * 64 + dl, v0 + sv] = acc[hf][e]

    @cute.jit
    def block_to_tile(acc: cutlass.Constexpr, cS: cute.Tensor, sX: cute.Tensor):
        for hf in cutlass.range_constexpr(KH):
            for e in cutlass.range_constexpr(cute.size(acc[hf]) // 2):
                rd, rv = cS[2 * e]
                pair = cute.make_rmem_tensor((1, 2), dtype)
                pair[0] = acc[hf][2 * e].to(dtype)
                pair[1] = acc[hf][2 * e + 1].to(dtype)
                cute.autovec_copy(pair, cute.local_tile(sX, (1, 2), (hf * 64 + rd, rv // 2)))

    @cute.jit
    def tile_to_rows(sX: cute.Tensor, gX: cute.Tensor, v0: Int32, tidx: Int32):
        for p in cutlass.range_constexpr(K // RPP):
            r = p * RPP + tidx // VPR
            vec = cute.make_rmem_tensor((1, 8), dtype)
            cute.autovec_copy(cute.local_tile(sX, (1, 8), (r, tidx % VPR)), vec)
            cute.autovec_copy(vec, cute.local_tile(gX, (1, 8), (r, v0 // 8 + tidx % VPR)))

    return load_block, store_block, block_to_tile, tile_to_rows


# ------------------------------------------------------------------ kernel: chain


def _build_chain(dtype, K: int, V: int, VB: int, l2norm: bool, varlen: bool, has_h0: bool, out_final: bool,
                 state_vk: bool, tma: bool = False, hs_tma: bool = False, vn_tma: bool = False, nseg: int = 1,
                 prep_cap: int = 0):
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup

    C = CHUNK
    KH = K // 64  # M = 64 halves of the state's K rows
    LOG2E = cm.LOG2E
    U_STRIDE = VB + 8  # padded row-major u tile: conflict-free pair reads
    issue_rows = F.make_issue_tiles(dtype, C)
    issue_gc = F.make_issue_gc()
    gemm = cm.make_gemm()
    sum_sq = _make_sum_sq(dtype, 64)
    locate_seq = cm.make_seq_locator(varlen)
    load_block, store_block, block_to_tile, tile_to_rows = make_block_io(dtype, K, VB)

    TX_BYTES = (2 * C * K + C * VB) * dtype.width // 8  # tma: w, k and u's columns of a chunk
    # hs_tma: the chunk-start state leaves from sS by one TMA store (warp 0) issued right after the top barrier, read
    # before the barrier after vn (sS is written again at the next chunk's top); vn_tma: a full chunk's vn goes into
    # its own tile sVo (4-byte pairs) and leaves by one TMA store issued after that barrier, read before the next
    # top barrier (a sequence's partial last chunk keeps the pair stores: a box would write the next sequence's rows)

    def tma_chunk(ta, sKs, sW, sU, bar, b, h, hv, t0, v0):
        # (tma, warp 0, while tracing) the chunk at row t0 on the mbarrier bar (cm.tma_load): w (value head hv),
        # k's 64-column halves (head h) and u's columns v0 : v0 + VB
        aW, aK, aU, tW, tK, tU = ta
        jobs = [(aW, cm.token_box(tW, b, hv, t0, 0, C, K), sW), (aU, cm.token_box(tU, b, hv, t0, v0, C, VB), sU)]
        jobs += [(aK, cm.token_box(tK, b, h, t0, hf * 64, C, 64), sKs[hf]) for hf in range(KH)]
        cm.tma_load(jobs, bar, TX_BYTES)

    zero_tail = cm.make_zero_rows(dtype, THREADS)  # (tma) the sequence's last chunk's rows past its end
    init_barriers = cm.make_tma_init()
    # nseg > 1 (:func:`chain_segments`): nseg CTAs a (sequence, value head, V block), segment s writing the chunks
    # [s n / nseg, (s + 1) n / nseg) of the sequence's n. Its walk starts from a zero state at the latest chunk c_w
    # before its first, c_lo, whose chunks c_w .. c_lo - 1 decay by less than e^SEG_LOG_DECAY in all
    # (cm.make_decay_reach), or, where no such chunk exists, from the sequence's first chunk and its initial state
    # (every chunk the unsplit chain takes, the same operations: the same bits). The warm-up chunks c_w .. c_lo - 1
    # store nothing. What the truncation drops is the state entering c_w times the chunks' transition, whose norm
    # is at most their decay when each I - beta_t k_t k_t^T has norm at most 1 (l2-normalized k, beta in [0, 2]):
    # below 2.1e-9 (cm.SEG_LOG_DECAY) of that state, under float32 rounding. Only with l2norm (asserted).
    assert nseg == 1 or (l2norm and nseg in CHAIN_SEGMENTS), (nseg, l2norm)
    # prep_cap > 0: the carried split's prepare step (:func:`carries`), nseg >= 2: CTA (n * (nseg - 1) + s, hv, vb)
    # walks into the boundary of segment s + 1 (cm.make_carry_walk) and stores its end state, nothing else, into
    # row n * (nseg - 1) + s of mHT [rows, HV, K, V + K]: columns below V the state walked from zero with u (L), the
    # K columns from V on the transition (M: u read as 0, from the identity's columns; zero where the boundary
    # warms up). The loop is the chain's own: L's bits are what the chain computes on that walk.
    PREP = prep_cap > 0
    assert not PREP or (nseg >= 2 and not (has_h0 or out_final or state_vk or hs_tma or vn_tma)), (nseg, prep_cap)
    SEG = nseg > 1 and not PREP
    walk = cm.make_segment_walk(forward=True)
    carry_walk = cm.make_carry_walk()
    identity_block = cm.make_identity_block()
    zero_unless = cm.make_zero_unless()

    @cute.jit
    def issue_chunk(mK: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor, sKs: cutlass.Constexpr,
                    sW: cute.Tensor, sU: cute.Tensor, sGc: cute.Tensor, b: Int32, h: Int32, hv: Int32, t0: Int32,
                    v0: Int32, length: Int32, tidx: Int32, ta: cutlass.Constexpr, bar):
        if cutlass.const_expr(tma):  # the tiles by TMA (warp 0), gc by cp.async (its rows are HV floats apart)
            issue_gc(mGc, sGc, b, hv, t0, length, tidx)
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                tma_chunk(ta, sKs, sW, sU, bar, b, h, hv, t0, v0)
        else:
            issue_rows_of_chunk(mK, mW, mU, mGc, sKs, sW, sU, sGc, b, h, hv, t0, v0, length, tidx)

    @cute.jit
    def issue_rows_of_chunk(mK: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor,
                            sKs: cutlass.Constexpr, sW: cute.Tensor, sU: cute.Tensor, sGc: cute.Tensor, b: Int32,
                            h: Int32, hv: Int32, t0: Int32, v0: Int32, length: Int32, tidx: Int32):
        gK = cute.domain_offset((t0, 0), mK[b, None, h, None])
        tiles = [(cute.domain_offset((t0, 0), mW[b, None, hv, None]), sW, K, 0),
                 (cute.domain_offset((t0, 0), mU[b, None, hv, None]), sU, VB, v0 // 8)]
        for hf in cutlass.range_constexpr(KH):
            tiles.append((gK, sKs[hf], 64, hf * 8))
        issue_rows(tuple(tiles), length, tidx)
        issue_gc(mGc, sGc, b, hv, t0, length, tidx)

    @cute.kernel
    def kernel(mK: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor, mH0: cute.Tensor,
               mHT: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor, mHs: cute.Tensor, mVn: cute.Tensor,
               T: Int32, NT: Int32, group: Int32, aW: cute.CopyAtom, aK: cute.CopyAtom, aU: cute.CopyAtom,
               tW: cute.Tensor, tK: cute.Tensor, tU: cute.Tensor, aHs: cute.CopyAtom, tHs: cute.Tensor,
               aVo: cute.CopyAtom, tVo: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        n, hv, vb = cute.arch.block_idx()
        seg = Int32(0)
        if cutlass.const_expr(SEG):  # segment seg of sequence n
            seg = n % nseg
            n = n // nseg
        if cutlass.const_expr(PREP):  # the boundary of segment seg + 1 of sequence n
            seg = n % (nseg - 1)
            n = n // (nseg - 1)
        warp0 = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        h = hv // group
        v0 = vb * VB
        vu0 = v0  # u's columns of this block (PREP: the transition's columns load u's first ones, read as 0)
        im = Int32(0)  # PREP: 1 in the transition's columns
        if cutlass.const_expr(PREP):
            im = cutlass.select_(v0 >= V, Int32(1), Int32(0))
            vu0 = cutlass.select_(v0 >= V, Int32(0), v0)

        mma_vn = cm.make_mma(dtype, VB, a_regs=False, b_mn_major=True)  # vn [i, v] = w S
        mma_up = cm.make_mma(dtype, VB, a_regs=False, b_mn_major=True, a_mn_major=True)  # S [d, v] += k^T vn_s
        cm.check_acc_pairs(mma_vn, (C, VB))
        cm.check_acc_pairs(mma_up, (64, VB))

        smem = cutlass.utils.SmemAllocator()
        sWb = [cm.alloc_tile(smem, dtype, C, K) for _ in range(2)]
        sKb = [[cm.alloc_tile(smem, dtype, C, 64) for _ in range(KH)] for _ in range(2)]
        sS = cm.alloc_tile(smem, dtype, K, VB)
        sVn = cm.alloc_tile(smem, dtype, C, VB)
        if cutlass.const_expr(vn_tma):  # a full chunk's vn (unscaled), for its TMA store
            sVo = cm.alloc_tile(smem, dtype, C, VB)
        if cutlass.const_expr(tma):  # TMA writes no padding: u in a swizzled tile
            sUb = [cm.alloc_tile(smem, dtype, C, VB) for _ in range(2)]
        else:
            sUb = [smem.allocate_tensor(dtype, cute.make_layout((C, VB), stride=(U_STRIDE, 1)), 16) for _ in range(2)]
        sGcb = [smem.allocate_tensor(Float32, cute.make_layout(C), 16) for _ in range(2)]
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        ta = (aW, aK, aU, tW, tK, tU)
        mbar = None
        if cutlass.const_expr(tma):  # one mbarrier a buffer: chunk ci in buffer ci % 2 completes its phase (ci // 2) % 2
            mbar = smem.allocate_array(cutlass.Int64, 2, byte_alignment=8)
            init_barriers(mbar, 2, (aW, aK, aU), 0)

        thr_vn = mma_vn.get_slice(tidx)
        thr_up = mma_up.get_slice(tidx)
        tAw = [mma_vn.make_fragment_A(thr_vn.partition_A(t)) for t in sWb]
        tBs = mma_vn.make_fragment_B(thr_vn.partition_B(cm.transpose_view(sS)))
        tAk = [[mma_up.make_fragment_A(thr_up.partition_A(cm.transpose_view(t))) for t in ks] for ks in sKb]
        tBvn = mma_up.make_fragment_B(thr_up.partition_B(cm.transpose_view(sVn)))
        cV = thr_vn.partition_C(cute.make_identity_tensor((C, VB)))  # (i, v)
        cS = thr_up.partition_C(cute.make_identity_tensor((64, VB)))  # (d within the half, v)

        b, ts, te, cbase, nchunks = locate_seq(n, mCu, mCuC, T, NT)
        # the chunks this CTA walks, c_w .. c_hi - 1, of which it stores c_lo .. c_hi - 1 (SEG: a segment, its walk
        # from c_w; an empty segment walks nothing, except the last, whose walk gives the final state)
        c_w = Int32(0)
        c_lo = Int32(0)
        c_hi = nchunks
        if cutlass.const_expr(SEG):  # sRk: free until the walk's first barrier
            c_w, c_lo, c_hi = walk(mGc, sRk, b, hv, ts, te, nchunks, seg, nseg, tidx)
        ic = Int32(0)  # PREP: 1 where the boundary carries
        if cutlass.const_expr(PREP):
            c_w, c_hi, carry = carry_walk(mGc, sRk, b, hv, ts, te, nchunks, seg, nseg, prep_cap, tidx)
            ic = cutlass.select_(carry, Int32(1), Int32(0))
            c_w = cutlass.select_(im * (1 - ic) > 0, c_hi, c_w)  # no transition where the boundary warms up

        accS = [cute.make_rmem_tensor(thr_up.partition_shape_C((64, VB)), Float32) for _ in range(KH)]
        if cutlass.const_expr(has_h0):
            load_block(accS, cS, mH0, n, hv, v0, state_vk)
            if cutlass.const_expr(SEG):  # a walk from a later chunk starts from zero
                for hf in cutlass.range_constexpr(KH):
                    zero_unless(accS[hf], c_w == 0)
        elif cutlass.const_expr(PREP):  # L from zero; M from the identity's columns v0 - V : where it carries
            for hf in cutlass.range_constexpr(KH):
                identity_block(accS[hf], cS, Int32(hf * 64), v0 - V, im * ic, False)
        else:
            for hf in cutlass.range_constexpr(KH):
                accS[hf].fill(0.0)

        nwalk = c_hi - c_w
        if nwalk > 0:
            issue_chunk(mK, mW, mU, mGc, sKb[0], sWb[0], sUb[0], sGcb[0], b, h, hv, ts + c_w * C, vu0,
                        cutlass.min(te - (ts + c_w * C), C), tidx, ta, mbar)
        cute.arch.cp_async_commit_group()
        for cp in cutlass.range((nwalk + 1) // 2, unroll=1):
            for par in cutlass.range_constexpr(2):  # walk step li in buffer par: every tile stays static
                li = cp * 2 + par
                if li < nwalk:
                    ci = c_w + li
                    keep = True
                    if cutlass.const_expr(SEG):
                        keep = ci >= c_lo  # a warm-up chunk stores nothing
                    t0 = ts + ci * C
                    length = cutlass.min(te - t0, C)
                    # ---- the chunk-start state in the input dtype -> sS (B operand of w S)
                    block_to_tile(accS, cS, sS)
                    if cutlass.const_expr(tma):
                        cute.arch.mbarrier_wait(mbar + par, cp % 2)
                        if length < C:  # the sequence's last chunk
                            zero_tail(sWb[par], K, length, tidx)
                            zero_tail(sUb[par], VB, length, tidx)
                            for hf in cutlass.range_constexpr(KH):
                                zero_tail(sKb[par][hf], 64, length, tidx)
                    cute.arch.cp_async_wait_group(0)
                    if cutlass.const_expr(vn_tma):  # chunk ci - 1's vn store has read sVo
                        if warp0:
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()  # chunk ci and sS in smem; every thread is done with chunk ci - 1
                    if cutlass.const_expr(hs_tma):  # sS -> the chunk's row of hs, one TMA store (warp 0)
                        if warp0:
                            if keep:
                                cm.tma_store(aHs, cm.token_box(tHs, cbase + ci, hv, 0, v0, K, VB), sS)
                    if ci + 1 < c_hi:
                        t1 = t0 + C
                        issue_chunk(mK, mW, mU, mGc, sKb[1 - par], sWb[1 - par], sUb[1 - par], sGcb[1 - par],
                                    b, h, hv, t1, vu0, cutlass.min(te - t1, C), tidx, ta,
                                    None if mbar is None else mbar + (1 - par))
                    cute.arch.cp_async_commit_group()

                    accVn = cute.make_rmem_tensor(thr_vn.partition_shape_C((C, VB)), Float32)
                    gemm(mma_vn, accVn, tAw[par], tBs, True)  # w S   [i, v]
                    warpgroup.commit_group()
                    # meanwhile: sS -> the chunk's row of hs (16-byte vectors, or the TMA store above), the k row norms
                    if cutlass.const_expr(not hs_tma and not PREP):
                        if keep:
                            tile_to_rows(sS, mHs[cbase + ci, hv, None, None], v0, tidx)
                    if cutlass.const_expr(l2norm):
                        if tidx < C:
                            ss = Float32(0.0)
                            for hf in cutlass.range_constexpr(KH):
                                ss = ss + sum_sq(sKb[par][hf], tidx)
                            sRk[tidx] = cute.math.rsqrt(ss + F.L2NORM_EPS)
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(l2norm):
                        cute.arch.sync_threads()  # sRk written

                    # ---- vn = u - w S: to global as is, to sVn scaled by exp(gc_C - gc_i) rk_i
                    glast = sGcb[par][C - 1]
                    gVn = cute.domain_offset((t0, 0), mVn[b, None, hv, None])
                    for e in cutlass.range_constexpr(cute.size(accVn) // 2):
                        vi, vc = cV[2 * e]
                        upair = cute.make_rmem_tensor((1, 2), dtype)
                        cute.autovec_copy(cute.local_tile(sUb[par], (1, 2), (vi, vc // 2)), upair)
                        if cutlass.const_expr(PREP):  # the transition's columns: vn = -w S (a select: u's values unread)
                            a0 = Float32(cutlass.select_(im > 0, Float32(0.0), upair[0].to(Float32))) - accVn[2 * e]
                            a1 = Float32(cutlass.select_(im > 0, Float32(0.0), upair[1].to(Float32))) - accVn[
                                2 * e + 1]
                        else:
                            a0 = upair[0].to(Float32) - accVn[2 * e]
                            a1 = upair[1].to(Float32) - accVn[2 * e + 1]
                        coef = cute.math.exp2((glast - sGcb[par][vi]) * LOG2E, fastmath=True)
                        if cutlass.const_expr(l2norm):
                            coef = coef * sRk[vi]
                        vpair = cute.make_rmem_tensor((1, 2), dtype)
                        vpair[0] = a0.to(dtype)
                        vpair[1] = a1.to(dtype)
                        if cutlass.const_expr(vn_tma):  # into sVo; a partial chunk's valid rows to global too
                            cute.autovec_copy(vpair, cute.local_tile(sVo, (1, 2), (vi, vc // 2)))
                            if length < C:  # (the sequence's last chunk: never a warm-up one)
                                if vi < length:
                                    cute.autovec_copy(vpair, cute.local_tile(gVn, (1, 2), (vi, (v0 + vc) // 2)))
                        elif cutlass.const_expr(not PREP):
                            if vi < length:
                                if keep:
                                    cute.autovec_copy(vpair, cute.local_tile(gVn, (1, 2), (vi, (v0 + vc) // 2)))
                        spair = cute.make_rmem_tensor((1, 2), dtype)
                        spair[0] = (a0 * coef).to(dtype)
                        spair[1] = (a1 * coef).to(dtype)
                        cute.autovec_copy(spair, cute.local_tile(sVn, (1, 2), (vi, vc // 2)))
                    decay = cute.math.exp2(glast * LOG2E, fastmath=True)
                    for hf in cutlass.range_constexpr(KH):
                        for e in cutlass.range_constexpr(cute.size(accS[hf])):
                            accS[hf][e] = accS[hf][e] * decay
                    if cutlass.const_expr(hs_tma):  # the hs store has read sS (written again at the next top)
                        if warp0:
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()  # sVn (and sVo) visible to the async proxy
                    if cutlass.const_expr(vn_tma):  # a full chunk's vn rows, one TMA store (warp 0)
                        if warp0:
                            if length == C:
                                if keep:
                                    cm.tma_store(aVo, cm.token_box(tVo, b, hv, t0, v0, C, VB), sVo)

                    for hf in cutlass.range_constexpr(KH):
                        gemm(mma_up, accS[hf], tAk[par][hf], tBvn, False)  # S += k^T vn_s
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)

        if cutlass.const_expr(PREP):
            store_block(accS, cS, mHT, n * (nseg - 1) + seg, hv, v0, False)
        if cutlass.const_expr(out_final):
            if cutlass.const_expr(SEG):
                if seg == nseg - 1:  # the last segment's walk ends the sequence
                    store_block(accS, cS, mHT, n, hv, v0, state_vk)
            else:
                store_block(accS, cS, mHT, n, hv, v0, state_vk)
        if cutlass.const_expr(hs_tma or vn_tma):  # every store done before the CTA's shared memory goes
            if warp0:
                cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def host(mK: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor, mH0: cute.Tensor,
             mHT: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor, mHs: cute.Tensor, mVn: cute.Tensor,
             T: Int32, NT: Int32, group: Int32, nseq: Int32, stream):
        _static_checks(dtype, K, V, VB)
        HV = mU.shape[2]
        atoms, tmas = cm.make_tma_rows_atoms(tma, dtype, ((mW, C, K), (mK, C, 64), (mU, C, VB)))
        aHs, tHs = cm.make_tma_store(hs_tma, dtype, mHs, cm.STATE_ROWS, K, VB)
        aVo, tVo = cm.make_tma_store(vn_tma, dtype, mVn, cm.TOKEN_ROWS, C, VB)
        kernel(mK, mW, mU, mGc, mH0, mHT, mCu, mCuC, mHs, mVn, T, NT, group, *atoms, *tmas, aHs, tHs, aVo,
               tVo).launch(
            grid=[nseq * (nseg - 1), HV, (V + K) // VB] if PREP else [nseq * nseg, HV, V // VB],
            block=[THREADS, 1, 1], stream=stream,
            **(dict(preferred_smem_carveout=100) if vn_tma else {}),  # 115.5 KB a CTA: two an SM only at the whole
        )

    f = F._fakes()
    args = (
        f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, V), f.any3(Float32), f.state(), f.state(),
        f.vec(cutlass.Int32), f.vec(cutlass.Int32), f.rows4(dtype, V), f.rows4(dtype, V),
        Int32(1), Int32(1), Int32(1), Int32(1), f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


# ------------------------------------------------------------------ kernel: out


def _build_out(dtype, K: int, V: int, l2norm: bool, varlen: bool, P_SELECT: bool = False, tma: bool = False,
               o_tma: bool = False):
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import warpgroup

    C = CHUNK
    LOG2E = cm.LOG2E
    issue_rows = F.make_issue_tiles(dtype, C)
    issue_state = F.make_issue_tiles(dtype, K)
    gemm = cm.make_gemm()
    row_inv_norm = cm.make_row_inv_norm(dtype, K, F.L2NORM_EPS)
    store_pairs = cm.make_store_pairs()
    p_to_frag, scale_o_rows = cm.make_p_frag_and_o_scale(dtype, l2norm)
    locate = cm.make_chunk_locator(varlen)
    # tma: two groups, q, k and the state on mbarrier 0, vn on mbarrier 1 (cm.tma_load)
    TX_QKS = (2 * C * K + K * V) * dtype.width // 8
    TX_VN = C * V * dtype.width // 8
    zero_tail = cm.make_zero_rows(dtype, THREADS)  # (tma) the rows past a sequence's end
    init_barriers = cm.make_tma_init()
    # o_tma: a full chunk's o goes as 4-byte pairs into vn's tile (free once P vn is done: the same [C, V] shape)
    # and leaves by one TMA store (warp 0); a partial chunk keeps the pair stores (a box would write the rows past a
    # varlen sequence's end, the next sequence's)
    pairs_to_tile = cm.make_pairs_to_tile(dtype) if o_tma else None

    @cute.kernel
    def kernel(mQ: cute.Tensor, mK: cute.Tensor, mHs: cute.Tensor, mVn: cute.Tensor, mGc: cute.Tensor,
               mO: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor, scale: Float32, T: Int32, NT: Int32,
               nseq: Int32, group: Int32, aQ: cute.CopyAtom, aK: cute.CopyAtom, aS: cute.CopyAtom,
               aVn: cute.CopyAtom, tQ: cute.Tensor, tK: cute.Tensor, tS: cute.Tensor, tVn: cute.Tensor,
               aO: cute.CopyAtom, tO: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cid, hv, _ = cute.arch.block_idx()
        h = hv // group

        mma_p = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False)  # q k^T  [i, j]
        mma_o = cm.make_mma(dtype, V, a_regs=False, b_mn_major=True)  # q S    [i, v]
        mma_ov = cm.make_mma(dtype, V, a_regs=True, b_mn_major=True)  # P vn   [i, v]
        cm.check_same_acc_layout(mma_o, mma_ov, (C, V))
        cm.check_acc_pairs(mma_o, (C, V))
        map_p = cm.acc_to_frag_map(mma_p, (C, C), mma_ov, (C, C))

        smem = cutlass.utils.SmemAllocator()
        sQ = cm.alloc_tile(smem, dtype, C, K)
        sK = cm.alloc_tile(smem, dtype, C, K)
        sS = cm.alloc_tile(smem, dtype, K, V)
        sVn = cm.alloc_tile(smem, dtype, C, V)
        sGc = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRq = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        mbar = None
        if cutlass.const_expr(tma):
            mbar = smem.allocate_array(cutlass.Int64, 2, byte_alignment=8)
            init_barriers(mbar, 2, (aQ, aK, aS, aVn), 0)

        b, t0, tend, valid = locate(cid, mCu, mCuC, T, NT, nseq)
        length = cutlass.min(tend - t0, C)
        if valid:
            if cutlass.const_expr(tma):
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                    cm.tma_load([(aQ, cm.token_box(tQ, b, h, t0, 0, C, K), sQ),
                                 (aK, cm.token_box(tK, b, h, t0, 0, C, K), sK),
                                 (aS, cm.token_box(tS, cid, hv, 0, 0, K, V), sS)], mbar, TX_QKS)
                    cm.tma_load([(aVn, cm.token_box(tVn, b, hv, t0, 0, C, V), sVn)], mbar + 1, TX_VN)
            else:
                issue_rows(((cute.domain_offset((t0, 0), mQ[b, None, h, None]), sQ, K, 0),
                            (cute.domain_offset((t0, 0), mK[b, None, h, None]), sK, K, 0),
                            (cute.domain_offset((t0, 0), mVn[b, None, hv, None]), sVn, V, 0)), length, tidx)
                issue_state(((mHs[cid, hv, None, None], sS, V, 0),), K, tidx)
                cute.arch.cp_async_commit_group()
            if tidx < C:
                sGc[tidx] = mGc[b, t0 + cutlass.min(tidx, length - 1), hv]
            if cutlass.const_expr(tma):
                cute.arch.mbarrier_wait(mbar, 0)  # q, k, S
                if length < C:  # rows past the sequence's end: as cp.async zero-fills them
                    zero_tail(sQ, K, length, tidx)
                    zero_tail(sK, K, length, tidx)
            else:
                cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()

            thr_p = mma_p.get_slice(tidx)
            thr_o = mma_o.get_slice(tidx)
            thr_ov = mma_ov.get_slice(tidx)
            accP = cute.make_rmem_tensor(thr_p.partition_shape_C((C, C)), Float32)
            accO = cute.make_rmem_tensor(thr_o.partition_shape_C((C, V)), Float32)
            gemm(mma_p, accP, mma_p.make_fragment_A(thr_p.partition_A(sQ)),
                 mma_p.make_fragment_B(thr_p.partition_B(sK)), True)
            gemm(mma_o, accO, mma_o.make_fragment_A(thr_o.partition_A(sQ)),
                 mma_o.make_fragment_B(thr_o.partition_B(cm.transpose_view(sS))), True)
            warpgroup.commit_group()
            if cutlass.const_expr(l2norm):
                if tidx < C:
                    sRq[tidx] = row_inv_norm(sQ, tidx)
                else:
                    sRk[tidx - C] = row_inv_norm(sK, tidx - C)
            warpgroup.wait_group(0)
            if cutlass.const_expr(l2norm):
                cute.arch.sync_threads()  # sRq, sRk written

            # ---- P = scale tril(q k^T exp(gc_i - gc_j)) rq_i rk_j, in registers as the A operand (with P_SELECT
            # the factors read unconditionally, the triangle by a select)
            cP = thr_p.partition_C(cute.make_identity_tensor((C, C)))
            rP = mma_ov.make_fragment_A(thr_ov.partition_shape_A((C, C)))
            p_to_frag(accP, rP, cP, map_p, sGc, sRq, sRk, scale, P_SELECT)
            # ---- o = scale exp(gc_i) rq_i q S + P vn
            cO = thr_o.partition_C(cute.make_identity_tensor((C, V)))
            scale_o_rows(accO, cO, sGc, sRq, scale)
            if cutlass.const_expr(tma):
                cute.arch.mbarrier_wait(mbar + 1, 0)  # vn, landed while q k^T and q S ran
                if length < C:
                    zero_tail(sVn, V, length, tidx)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()
            gemm(mma_ov, accO, rP, mma_ov.make_fragment_B(thr_ov.partition_B(cm.transpose_view(sVn))), False)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            if cutlass.const_expr(o_tma):
                if length == C:  # every thread's P vn is done reading sVn: o into it, then one TMA store
                    cute.arch.sync_threads()
                    pairs_to_tile(accO, cO, sVn)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()
                    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                        cm.tma_store(aO, cm.token_box(tO, b, hv, t0, 0, C, V), sVn)
                        cute.arch.cp_async_bulk_wait_group(0)
                else:
                    store_pairs(accO, cO, cute.domain_offset((t0, 0), mO[b, None, hv, None]), length)
            else:
                store_pairs(accO, cO, cute.domain_offset((t0, 0), mO[b, None, hv, None]), length)

    @cute.jit
    def host(mQ: cute.Tensor, mK: cute.Tensor, mHs: cute.Tensor, mVn: cute.Tensor, mGc: cute.Tensor,
             mO: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor, scale: Float32, T: Int32, NT: Int32,
             nseq: Int32, group: Int32, nchunks_grid: Int32, stream):
        _static_checks(dtype, K, V, 32)
        HV = mO.shape[2]
        hs_rows = cute.make_tensor(mHs.iterator, cute.select(mHs.layout, mode=[0, 2, 1, 3]))  # [chunk, K, HV, V]
        atoms, tmas = cm.make_tma_rows_atoms(tma, dtype, ((mQ, C, K), (mK, C, K), (hs_rows, K, V), (mVn, C, V)))
        aO, tO = cm.make_tma_store(o_tma, dtype, mO, cm.TOKEN_ROWS, C, V)
        kernel(mQ, mK, mHs, mVn, mGc, mO, mCu, mCuC, scale, T, NT, nseq, group, *atoms, *tmas, aO, tO).launch(
            grid=[nchunks_grid, HV, 1], block=[THREADS, 1, 1], stream=stream
        )

    f = F._fakes()
    args = (
        f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, V), f.rows4(dtype, V), f.any3(Float32),
        f.rows4(dtype, V), f.vec(cutlass.Int32), f.vec(cutlass.Int32), Float32(1.0),
        Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


# ------------------------------------------------------------------ compile (cached) and launch


def chain_tma() -> bool:
    """``CUDNN_TRAIN_GDN_CHAIN_TMA`` (on unless 0): ``chain`` loads each chunk's w, k and u's columns by TMA (one
    elected thread of warp 0 on the buffer's mbarrier; gc stays on cp.async; u then in a swizzled tile, TMA writes no
    padding) instead of its one warpgroup's 128 threads issuing about 20 ``cp.async`` each a chunk on the chain
    (B1 T16384's training forward: the chain 0.43 ms). The sequence's last chunk has its rows past the end
    zeroed once landed, as cp.async zero-fills them: the same bits. Measured (sixteenth session, bitwise):
    VB 64 0.238 against 0.271 ms at B4 T4096 H16 HV32, 0.646 against 0.742 at B1 T16384; VB 32 0.300 against
    0.374 and 0.410 against 0.426."""
    return cm.env_switch("CUDNN_TRAIN_GDN_CHAIN_TMA", True)


def chain_hs_tma() -> bool:
    """``CUDNN_TRAIN_GDN_CHAIN_HSTMA`` (on unless 0; twenty-second session): ``chain``'s
    chunk-start state leaves its shared tile sS by one TMA store (warp 0, right after the top barrier; waited for
    to have read sS before the barrier after vn, since sS is written again at the next chunk's top) instead of 128
    threads copying it out as 16-byte vectors (8 shared loads and 8 global stores a thread at K = 128, VB = 64,
    beside the chunk's first product). The same bytes. Measured with :func:`chain_vn_tma` there."""
    return cm.env_switch("CUDNN_TRAIN_GDN_CHAIN_HSTMA", True)


def chain_vn_tma() -> bool:
    """``CUDNN_TRAIN_GDN_CHAIN_VNTMA`` (on unless 0; twenty-second session): ``chain``'s vn
    of a full chunk goes as 4-byte pairs into its own shared tile (8 KB more at VB = 64, 115.5 KB a CTA: still two
    an SM) and leaves by one TMA store (warp 0, after the barrier that follows vn; waited for to have read the tile
    before the next top barrier) instead of 16 scattered 4-byte global stores a thread on the chain's critical path
    between ``w S`` and the state update: the pattern that cost the reverse sweep 20% (dH) and 9% (dvn) of its
    stall samples (Nsight Compute, twenty-first session), where the same change gave -17% and -8%. A sequence's
    partial last chunk keeps the pair stores (a box would write the next sequence's rows). The same bytes.
    Measured (H100, B4 T4096 H16 HV32, ``time_gdn_fwd.py --chain-stores``, hs and vn bitwise the default's in every
    variant): VB 64 0.333 ms, hs alone 0.340, vn alone 0.323, **both 0.310**; VB 32 (the grid of fewer sequences)
    0.470, 0.392, 0.356, **0.357**; the whole training forward 0.889 -> 0.865 ms."""
    return cm.env_switch("CUDNN_TRAIN_GDN_CHAIN_VNTMA", True)


def get_chain_kernel(dtype, K, V, VB, l2norm, varlen, has_h0, out_final, state_vk, tma=None, hs_tma=None,
                     vn_tma=None, nseg=1, prep_cap=0):
    """The chain kernel (``state_pass``); with ``prep_cap`` > 0 its variant for the carried split's prepare step
    (:func:`carries`: no initial or final state, chunk states or vn, ``[K, V]`` states; l2norm, nseg >= 2)."""
    if VB not in CHAIN_VBLOCKS or V % VB:
        raise ValueError(f"VB={VB}: expected one of {CHAIN_VBLOCKS} dividing V={V}")
    if nseg not in CHAIN_SEGMENTS or (nseg > 1 and not l2norm):
        raise ValueError(f"nseg={nseg}: expected one of {CHAIN_SEGMENTS}, more than 1 only with l2norm")
    if prep_cap < 0 or (prep_cap and (nseg < 2 or has_h0 or out_final or state_vk or K % VB)):
        raise ValueError(f"prep_cap={prep_cap}: the prepare step takes nseg >= 2, no initial or final state, [K, V] "
                         f"states and a V block dividing K")
    tma = chain_tma() if tma is None else bool(tma)
    hs_tma = False if prep_cap else (chain_hs_tma() if hs_tma is None else bool(hs_tma))
    vn_tma = False if prep_cap else (chain_vn_tma() if vn_tma is None else bool(vn_tma))
    key = ("chain", str(dtype), K, V, VB, bool(l2norm), bool(varlen), bool(has_h0), bool(out_final),
           bool(state_vk)) + (("tma",) if tma else ()) + (("hs_tma",) if hs_tma else ()) + (
        ("vn_tma",) if vn_tma else ()) + ((("nseg", nseg),) if nseg > 1 else ()) + (
        (("prep", prep_cap),) if prep_cap else ())

    def build():
        return _build_chain(F._dt(dtype), K, V, VB, l2norm, varlen, has_h0, out_final, state_vk, tma, hs_tma,
                            vn_tma, nseg, prep_cap)

    return kc.get_kernel("gdn_fwd_chain", key, build, _SOURCES)


def out_p_select() -> bool:
    """``CUDNN_TRAIN_GDN_OUT_PSEL=1``: the ``out`` kernel reads P's factors unconditionally and keeps the
    lower triangle by a select (the same bits; fewer shared loads and branches in its PTX). Prepared in the
    twelfth session, compiled, not yet GPU-run: off."""
    return cm.env_switch("CUDNN_TRAIN_GDN_OUT_PSEL", False)


def out_tma() -> bool:
    """``CUDNN_TRAIN_GDN_OUT_TMA=1``: ``out`` loads q, k and the chunk-start state by TMA on one mbarrier and vn on
    another, waited for only before ``P vn`` (one elected thread of warp 0 issues both groups; gc stays a plain
    load), instead of 128 threads issuing about 40 ``cp.async`` each and waiting for all of them before the first
    product. A varlen sequence's rows past its end are zeroed once landed, as cp.async zero-fills them: the same
    bits. Prepared in the sixteenth session; GPU-run in the seventeenth (bitwise cp.async's in every case; H200,
    B4 T4096 H16 HV32 and B1 T16384, the out kernel alone 0.236 against 0.248 ms): on unless ``=0``."""
    return cm.env_switch("CUDNN_TRAIN_GDN_OUT_TMA", True)


def out_o_tma() -> bool:
    """``CUDNN_TRAIN_GDN_OUT_OTMA`` (on unless ``=0``; prepared in the twenty-second session, GPU-run and made the
    default in the twenty-third): ``out`` writes a full chunk's o as 4-byte pairs into vn's shared tile (free once
    ``P vn`` is done; o has its shape) and one TMA store (warp 0) sends it, instead of 32 scattered 4-byte global
    stores a thread (the pattern the chain's and the sweep's TMA stores replaced). A partial chunk keeps the pair
    stores. The same bytes. H100, B4 T4096 H16 HV32, the out kernel alone: 0.256 / 0.257 ms against 0.270 / 0.272,
    o bitwise the pair stores'."""
    return cm.env_switch("CUDNN_TRAIN_GDN_OUT_OTMA", True)


def get_out_kernel(dtype, K, V, l2norm, varlen, p_select=None, tma=None, o_tma=None):
    p_select = out_p_select() if p_select is None else bool(p_select)
    tma = out_tma() if tma is None else bool(tma)
    o_tma = out_o_tma() if o_tma is None else bool(o_tma)
    key = ("out", str(dtype), K, V, bool(l2norm), bool(varlen)) + (("psel",) if p_select else ()) + (
        ("tma",) if tma else ()) + (("o_tma",) if o_tma else ())

    def build():
        return _build_out(F._dt(dtype), K, V, l2norm, varlen, p_select, tma, o_tma)

    return kc.get_kernel("gdn_fwd_out", key, build, _SOURCES)


def serves(rows: int, HV: int, K: int, V: int) -> bool:
    """Whether the split pass can take a forward: its ``hs`` rows must be int32-addressable."""
    return rows * HV * K * V < 2**31


def state_pass(q, k, w, u, gc, o, h0, ht, cu, cu_chunks, rows, NT, scale, l2norm, state_vk, group, nseq,
               vb=None, hs=None, vn=None):
    """Run ``chain`` then ``out``: fills ``o`` (and ``ht`` when given) from the WY factors of the
    forward's first kernel. ``h0`` / ``ht``: float32 states or None. ``hs``: where the chunk-start
    states go (input dtype ``[rows, HV, K, V]``, kept for the backward), or None for a scratch
    buffer; ``vn``: where ``vn = u - w S`` goes (input dtype ``[B, T, HV, V]``, kept for the backward),
    or None for a scratch buffer."""
    B, T, HV, V = u.shape
    K = q.shape[-1]
    varlen = NT == 0
    nseg = chain_segments(nseq, HV, V, B * T, l2norm, q.device)
    vb = chain_vblock(nseq * nseg, HV, V, q.device) if vb is None else vb
    chain = get_chain_kernel(q.dtype, K, V, vb, l2norm, varlen, h0 is not None, ht is not None, state_vk,
                             nseg=nseg)
    out = get_out_kernel(q.dtype, K, V, l2norm, varlen)
    if hs is None:
        hs = F._empty(rows, HV, K, V, dtype=q.dtype, device=q.device)
    if vn is None:
        vn = F._empty(B, T, HV, V, dtype=q.dtype, device=q.device)
    f32_dummy, _, _ = F._dummies(q.device)
    d4 = f32_dummy.view(1, 1, 1, 1)
    chain(k, w, u, gc, d4 if h0 is None else h0, d4 if ht is None else ht, cu, cu_chunks, hs, vn, T, NT, group,
          nseq)
    out(q, k, hs, vn, gc, o, cu, cu_chunks, float(scale), T, NT, nseq, group, rows)


# ------------------------------------------------------------------ the carried split (inference, the default)

CARRY_CAP = 16  # the prepare step's warm-up cap, chunks: a boundary whose decay needs more is carried exactly


def carry_segments(nseq: int, HV: int, K: int, V: int, T: int, l2norm: bool, device, dtype=None) -> int:
    """``CUDNN_TRAIN_GDN_FWD_CARRY``: the inference forward's *carried* sequence split (built in the twenty-sixth
    session, GPU-run and made the default in the twenty-seventh): ``auto``, the segment count the specialized
    warpgroups' split would take (:func:`cm.segments` on their grid of 128-column CTAs, 90% of the SMs; B1 T16384
    H16 HV32: 4, B4: 1, so only few long sequences are split); unset, ``auto`` for bf16 at K = V = 128 (what its GPU
    cases cover) and 1 otherwise; 1, off; 2 to 16 force it. Unlike
    ``CUDNN_TRAIN_GDN_FWD_WS_SEG`` no walk is longer than a segment whatever the gates (:func:`carried_state_pass`),
    so its time does not depend on how slowly a head decays. Only with l2norm."""
    covered = K == V == 128 and dtype == torch.bfloat16
    return cm.carry_segments("CUDNN_TRAIN_GDN_FWD_CARRY", nseq, HV * max(V // 128, 1), T, l2norm, device, HV, K, V,
                             default="auto" if covered else "1")


def carries(k, w, u, gc, cu, cu_chunks, T, NT, group, nseq, nseg, cap=CARRY_CAP, vb=32):
    """The prepare step: float32 ``[nseq * (nseg - 1), HV, K, V + K]``, row ``n * (nseg - 1) + s`` the carry into
    the boundary of segment s + 1 of sequence n: columns below V its L (the state walked from zero over the end of
    segment s), the K from V on its M (segment s's K x K transition, or zero where the boundary warms up within
    ``cap`` chunks). One chain CTA per (boundary, value head, ``vb`` columns of V + K)."""
    B, _, HV, V = u.shape
    K = k.shape[-1]
    kern = get_chain_kernel(k.dtype, K, V, vb, True, NT == 0, False, False, False, nseg=nseg, prep_cap=cap)
    LM = F._empty(nseq * (nseg - 1), HV, K, V + K, dtype=torch.float32, device=k.device)
    f32_dummy, _, _ = F._dummies(k.device)
    rows = F._empty(1, 1, 1, V, dtype=k.dtype, device=k.device)  # hs and vn: the prepare step writes neither
    kern(k, w, u, gc, f32_dummy.view(1, 1, 1, 1), LM, cu, cu_chunks, rows, rows, T, NT, group, nseq)
    return LM


def virtual_cu(cu_seqlens, B: int, T: int, nseg: int, device) -> torch.Tensor:
    """int32 ``cu_seqlens`` of the segments as sequences (``nseq * nseg + 1`` entries): segment s of a sequence of
    n chunks starts at its chunk ``n s // nseg`` (the prepare step's plan). By device ops (no read on the host)."""
    if cu_seqlens is None:  # by device ops too: a host list copied in would not be capturable in a CUDA graph
        cu = torch.arange(B + 1, dtype=torch.int32, device=device) * T
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
    n = (cu[1:] - cu[:-1] + (CHUNK - 1)) // CHUNK
    s = torch.arange(nseg, dtype=torch.int32, device=device)
    starts = cu[:-1, None] + (n[:, None] * s[None, :] // nseg) * CHUNK
    return torch.cat([starts.reshape(-1), cu[-1:]])


def carried_state_pass(q, k, w, u, gc, o, h0, ht, cu_seqlens, cu, cu_chunks, T, NT, scale, group, nseq, nseg, hs=None,
                       vn=None):
    """The inference forward's state pass with each sequence cut into ``nseg`` segments (``CUDNN_TRAIN_GDN_FWD_
    CARRY``): :func:`carries` (the prepare step: a warm-up of at most ``CARRY_CAP`` chunks before each boundary, or
    the previous segment's state from zero and its transition), :func:`cm.combine_carries`, then the specialized
    warpgroups' pass over the segments as sequences from their start states (``[K, V]`` states, l2norm). The plan
    and its exactness: ``tests/fused/test_gdn_segments_carry.py``. Fills ``o`` (and ``ht`` when given); the training
    forward's ``hs`` and ``vn`` too when given (with ``CUDNN_TRAIN_GDN_FWD_WS_TSTORE``): the segments start at chunk
    boundaries, so a segment's chunk rows and tokens as a sequence are the sequence's own."""
    from . import gated_delta_rule_fwd_ws_sm90 as WS

    B, _, HV, V = u.shape
    K = q.shape[3]
    LM = carries(k, w, u, gc, cu, cu_chunks, T, NT, group, nseq, nseg)
    starts = cm.combine_carries(LM, h0, nseq, nseg, V)
    cu_v, cuc_v, _, _ = F.chunk_map(virtual_cu(cu_seqlens, B, T, nseg, q.device), 1, B * T, q.device)
    ht_v = None if ht is None else F._empty(nseq * nseg, HV, K, V, dtype=torch.float32, device=q.device)
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, w, u, gc)]  # views where the strides allow
    WS.state_pass(*flat, o.view(1, B * T, HV, V), starts, ht_v, cu_v, cuc_v, 0, scale, True, False, group,
                  nseq * nseg, hs=hs, vn=None if vn is None else vn.view(1, B * T, HV, V))
    if ht is not None:
        ht.copy_(ht_v.view(nseq, nseg, HV, K, V)[:, -1])

"""Chunked Gated DeltaNet backward for SM90 (CuTeDSL, WGMMA): the reverse state sweep.

Stage 2 of ``fused/delta_rule_bwd.py`` (its ``reverse_sweep_ref`` is this kernel's oracle).
Kernel ``dstate`` (grid: N x HV x V/64, one warpgroup; or two splitting the N of every
product, ``wgs=2`` at K = 128, see below; or N x HV with both 64-column halves of V = 128 in one CTA,
one warpgroup each, where the grid a half exceeds a wave: :func:`vh2_default`) walks the chunks of one sequence
from the last to the first with ``dH^T`` [64 (V block), K] in float32 WGMMA accumulators,
dH being the gradient of the state leaving the chunk (at the start: the final state's
gradient, or zero). Per chunk, with q, k the (row-factor normalized) inputs, w and gc the
forward's WY output and cumulative gate, ``rq``/``rk`` the l2norm row factors::

    dvn^T = (dH^T k^T) diag(e^(gc_C - gc) rk)  +  do^T P            [v, i]   P as in the forward
    dH^T <- e^(gc_C) dH^T  +  (do diag(scale e^gc rq))^T q  -  dvn^T w          [v, d]

``dH^T k^T`` takes dH^T in the input dtype as a register A operand (like S^T in the forward);
``do^T P`` and ``do_s^T q`` read do (and its row-scaled copy) as MN-major A operands from
shared memory; ``-dvn^T`` goes back into registers as the A operand of the last product. With two
warpgroups each holds only its columns of dH^T and dvn^T, so those two A operands go through
shared memory instead (one store and one barrier more a chunk), and P's tile takes 64-byte
swizzles so that a warpgroup's 32-column half of its MN-major view starts on an atom. Launched
asking for two CTAs an SM (``min_blocks_per_mp=2``: 127 registers a thread, no spills, 3.1K
instructions against 254 and 4.1K), an SM runs 16 warps where the one-warpgroup kernel runs 8.
Two warpgroups are the default where N x HV x V/64 CTAs leave SMs idle (:func:`warpgroups`).

Loads (``PREFETCH``, the default; ``CUDNN_TRAIN_GDN_SWEEP_PREFETCH=0``: synchronous loads at the
top of every chunk): w, do and gc have two buffers and the next chunk's are fetched by
``cp.async`` at the top of this one; q and k are read only by the chunk's first product group
(``dH^T k^T``, ``q k^T`` and the q term of the update, ``e^(gc_C) dH^T + do_s^T q``, issued
together), so their single buffers are refilled with the next chunk's right after it. Same
products in the same order: bitwise the synchronous kernel's results.

Writes dvn (``[B, T, HV, V]``) and the dH of every chunk before its update (``[chunks, HV, K, V]``;
chunk index ``b * NT + c``, or ``cu_chunks[n] + c`` with varlen), both float32 or, for the
training path, rounded once to the input dtype (the precision the per-chunk gradient stage reads
them in), and the initial state's gradient (float32, either layout).

By default (:func:`tma_default`, ``reverse_sweep(tma=True)``; since the sixteenth session, bitwise the cp.async
prefetch and 0.585 against 0.615 ms at B4 T4096 H16 HV32; ``CUDNN_TRAIN_GDN_SWEEP_TMA=0`` gives cp.async back)
the prefetch's tiles arrive by TMA: one elected thread of warp 0 issues w and do on
their buffer's mbarrier and q, k on a third (gc stays on cp.async); the first chunk taken has its rows past the
end zeroed once landed, as cp.async zero-fills them: the same bits.

With the TMA loads, dH in the input dtype (the training path) and both V halves a CTA (:func:`dh_tma_default`,
since the twenty-first session) each chunk's dH leaves through shared memory: the update's accumulator, rounded once, goes by transposed
``stmatrix`` into a [K, columns] tile (128-byte swizzle; ``cm.check_stmatrix_order`` asserts the value order for
every thread while tracing) and one TMA store by warp 0, waited for (read) before the next chunk's top barrier.
Bitwise the per-element stores; H200 B4 T4096 H16 HV32 0.412 against 0.499 ms.

Status: its GPU tier (``tests/kernels/test_gated_delta_rule_bwd_sm90.py``, against
``reverse_sweep_ref``: odd T, GVA, varlen, both state layouts, one and two warpgroups, the
prefetch bitwise against synchronous loads) passes on the H200. Stage 2 of the training path
(``gated_delta_rule_train_sm90``); ``CUDNN_TRAIN_GDN_SWEEP_WGS`` = 1 or 2 overrides the warpgroup
choice at K = 128. Where this kernel's grid leaves SMs idle (one long sequence) the sweep runs split
in two kernels instead (``gated_delta_rule_bwd_split_sm90``: P^T do for every chunk in parallel, then
a chain over V blocks of 32 carrying dH [K, VB], twice this kernel's CTAs), where dvn and dH leave in
the input dtype (:func:`split_default`; ``CUDNN_TRAIN_GDN_SWEEP_SPLIT`` = 1 / 0 forces it).
"""


import os

import torch

from ..backend import Unsupported
from . import compile as kc
from . import gated_delta_rule_common_sm90 as cm
from . import gated_delta_rule_fwd_sm90 as fwd

CHUNK = cm.CHUNK
VBLOCK = fwd.VBLOCK
# Phases timed by the profile variant (``tools/time_gdn_sweep.py --profile``), summed over a CTA's chunks
SWEEP_PHASES = ("chunk wait (loads landed, next issued)", "l2norm rows, do_s, dH^T to smem",
                "dH store, dH^T k^T, q k^T, do_s^T q", "dvn scaling, P", "do^T P", "dvn stores, -dvn^T", "dvn^T w")
_SOURCES = (__file__, cm.__file__, fwd.__file__)


def _build_dstate(dtype, K: int, V: int, l2norm: bool, varlen: bool, has_dht: bool, state_vk: bool, odt=None,
                  WGS: int = 1, PREFETCH: bool = False, PROFILE: bool = False, EARLY_QK: bool = False,
                  TMA: bool = False, VH: int = 1, DHTMA: bool = False, DVNTMA: bool = False, NSEG: int = 1,
                  PREP_CAP: int = 0, NORM8: bool = False, TW: bool = False):
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup

    C = CHUNK
    # VH = 2 (two V halves a CTA): 128 columns, one warpgroup a 64-column half stacked along M of every product
    # but q k^T (split by N between them), sharing the loads of q, k, w, the l2norm rows and P
    VB = VBLOCK * VH  # V columns a CTA
    THREADS = 128 * WGS * VH  # two warpgroups: 16 warps an SM where two CTAs fit (without the prefetch, ~96 KB each)
    LOG2E = cm.LOG2E
    load_chunk = fwd._make_load_chunk(K, VB, THREADS)
    issue_qk, issue_wdg = fwd.make_issue_parts(dtype, K, VB, THREADS)
    # PREFETCH: w, do and gc have two buffers (chunk cr in buffer cr % 2) and the next chunk's are
    # fetched by cp.async at the top of this one; q and k (read only by the chunk's first products)
    # have one, refilled with the next chunk's once those products are done
    NBUF = 2 if PREFETCH else 1
    gemm = cm.make_gemm()
    row_inv_norm = cm.make_row_inv_norm(dtype, K, fwd.L2NORM_EPS)
    rows_inv_norm = cm.make_rows_inv_norm(dtype, K, fwd.L2NORM_EPS, THREADS)  # NORM8: eight threads a row
    start_state, store_state = cm.make_state_io()
    odt = cutlass.Float32 if odt is None else odt  # the dtype of dvn and the dH rows
    store_p = cm.make_store_p(dtype, l2norm)
    scale_rows = cm.make_scale_rows(dtype, VB, THREADS, l2norm)
    locate_seq = cm.make_seq_locator(varlen)
    # TMA (with PREFETCH): the same loads as bulk tensor copies by one elected thread of warp 0, w and do on their
    # buffer's mbarrier (0, 1: chunk cr completes phase (cr // 2) % 2 of barrier cr % 2), q and k on barrier 2
    # (chunk cr completes its phase cr % 2); gc stays on cp.async (its rows are HV floats apart)
    if TMA and not PREFETCH:
        raise ValueError("the TMA loads replace the prefetch's cp.async loads")
    if DHTMA and not (TMA and odt is not None and odt == dtype):
        raise ValueError("dH's TMA store takes the TMA loads and dH in the input dtype")
    if DVNTMA and not DHTMA:
        raise ValueError("dvn's TMA stores come with dH's (their bulk groups are waited for together)")
    issue_gc = fwd.make_issue_gc()
    # TW (the training forward that forms w and u in its chain, which leaves no w): mW holds the forward's gated
    # chunk inverse Tm [B, T, HV, C] (stage 3's, lower triangular) and mBe the effective beta; the state update's
    # term uses the identity w = Tm diag(beta exp(gc) rk) k,
    #     dvn^T w = ((dvn^T Tm) diag(beta exp(gc) rk)) k,
    # one more [VB, C] x [C, C] product (Y) before the update, whose B is then this chunk's k tile: k takes two
    # buffers (the next chunk's k lands in the other while this one's is still read). With the TMA loads, the
    # prefetch, one warpgroup a V half, not the prepare step or segments (their walks read w); Y rounds where w did.
    if TW and not (TMA and PREFETCH and WGS == 1 and not PREP_CAP and NSEG == 1):
        raise ValueError("TW: with the TMA loads and the prefetch, one warpgroup a V half, no segments or prepare")
    WC = C if TW else K  # columns of the tile in w's slot
    WD_BYTES = (C * WC + C * VB) * dtype.width // 8
    QK_BYTES = 2 * C * K * dtype.width // 8

    zero_tail = cm.make_zero_rows(dtype, THREADS)  # (TMA) the first chunk taken's rows past its end
    init_barriers = cm.make_tma_init()
    # NSEG > 1 (:func:`sweep_segments`): NSEG CTAs a (sequence, value head, V block); segment s stores the chunks
    # [s n / NSEG, (s + 1) n / NSEG) = [c_lo, c_hi) of the sequence's n. Its walk starts from a zero dH at the end
    # of the earliest chunk c_e - 1 >= c_hi whose chunks c_hi .. c_e - 1 decay by less than e^-20 in all
    # (cm.make_decay_reach), or, where none does, at the sequence's end from the final state's gradient (every chunk
    # the unsplit sweep takes: the same bits for those outputs). The warm-up chunks c_hi .. c_e - 1 store nothing;
    # the segment holding chunk 0 stores dh0. The dropped part is dH leaving c_e - 1 times the transposed
    # transitions of those chunks, of norm at most their decay with unit-norm keys and beta in [0, 2] (as in the
    # forward chain's split, ``gated_delta_rule_fwd_split_sm90``): only with l2norm.
    # PREP_CAP > 0: the carried split's prepare step for the sweep (:func:`sweep_carries`), NSEG >= 2: CTA
    # (n * (NSEG - 1) + s, hv, vb) walks into the end of segment s from the start of segment s + 1
    # (cm.make_carry_walk(forward=False)) and stores its dH, nothing else, into row n * (NSEG - 1) + s of mDH0
    # [rows, HV, K, V + K]: columns below V walked from a zero dH with do (L), the K columns from V on the segment's
    # transition (M: do read as 0, from the identity's columns; zero where the boundary warms up). The loop is the
    # sweep's own.
    PREP = PREP_CAP > 0
    SEG = NSEG > 1 and not PREP
    if (SEG or PREP) and not (l2norm and NSEG in cm.SEGMENTS and PREFETCH and not PROFILE):
        raise ValueError(f"NSEG={NSEG}: with l2norm and the prefetch, not the profile variant")
    if PREP and not (NSEG >= 2 and not (has_dht or state_vk or DHTMA or DVNTMA) and K % VB == 0):
        raise ValueError(f"PREP_CAP={PREP_CAP}: the prepare step takes NSEG >= 2, no final state's gradient, [K, V] "
                         "states, the element stores and a V block dividing K")
    walk = cm.make_segment_walk(forward=False)
    carry_walk = cm.make_carry_walk(forward=False)
    identity_block = cm.make_identity_block()
    zero_unless = cm.make_zero_unless()

    @cute.jit
    def next_qk(gm: cutlass.Constexpr, sQ: cute.Tensor, sK: cute.Tensor, ta: cutlass.Constexpr, mbar, b: Int32, h: Int32,
                t1: Int32, length: Int32, tidx: Int32):
        # (TW: sK is the k buffer of the chunk at row t1)
        # q and k of the chunk at row t1 into their one buffer: by TMA on mbarrier 2 (warp 0), or by cp.async
        if cutlass.const_expr(TMA):
            aQ, aK, _, _, tQ, tK, _, _ = ta
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                cm.tma_load([(aQ, cm.token_box(tQ, b, h, t1, 0, C, K), sQ), (aK, cm.token_box(tK, b, h, t1, 0, C, K), sK)],
                            mbar + 2, QK_BYTES)
        else:
            issue_qk(gm[0], gm[1], sQ, sK, b, h, t1, length, tidx)

    @cute.jit
    def next_wdg(gm: cutlass.Constexpr, sW: cute.Tensor, sDo: cute.Tensor, sGc: cute.Tensor, ta: cutlass.Constexpr,
                 bar, b: Int32, hv: Int32, t1: Int32, v0: Int32, length: Int32, tidx: Int32, sBe=None):
        # w (TW: Tm), do and gc (TW: and beta) of the chunk at row t1 into one buffer: w and do by TMA on that
        # buffer's mbarrier ``bar`` (warp 0) and gc by cp.async, or all by cp.async
        if cutlass.const_expr(TMA):
            _, _, aW, aDo, _, _, tW, tDo = ta
            issue_gc(gm[4], sGc, b, hv, t1, length, tidx)
            if cutlass.const_expr(TW):
                issue_gc(gm[5], sBe, b, hv, t1, length, tidx)
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                cm.tma_load([(aW, cm.token_box(tW, b, hv, t1, 0, C, WC), sW),
                             (aDo, cm.token_box(tDo, b, hv, t1, v0, C, VB), sDo)], bar, WD_BYTES)
        else:
            issue_wdg(gm[2], gm[3], gm[4], sW, sDo, sGc, b, hv, t1, v0, length, tidx)

    @cute.jit
    def store_dvn_rows(accX: cute.Tensor, cX: cute.Tensor, mDVN: cute.Tensor, b: Int32, t0: Int32, hv: Int32,
                       v0: Int32, length: Int32):
        # dvn^T's accumulator (v, i) into rows t0 + i < t0 + length of dvn, element by element
        for e in cutlass.range_constexpr(cute.size(accX)):
            xv, xi = cX[e]
            if xi < length:
                mDVN[b, t0 + xi, hv, v0 + xv] = accX[e].to(odt)

    @cute.kernel
    def kernel(
        mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mGc: cute.Tensor, mDO: cute.Tensor, mDHT: cute.Tensor,
        mDVN: cute.Tensor, mDH: cute.Tensor, mDH0: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor,
        scale: Float32, T: Int32, NT: Int32, group: Int32, mProf: cute.Tensor, aQ: cute.CopyAtom, aK: cute.CopyAtom,
        aW: cute.CopyAtom, aDo: cute.CopyAtom, tQ: cute.Tensor, tK: cute.Tensor, tW: cute.Tensor, tDo: cute.Tensor,
        aDH: cute.CopyAtom, tDH: cute.Tensor, aDV: cute.CopyAtom, tDV: cute.Tensor, mBe: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        n, hv, vb = cute.arch.block_idx()
        seg = Int32(0)
        if cutlass.const_expr(SEG):  # segment seg of sequence n
            seg = n % NSEG
            n = n // NSEG
        if cutlass.const_expr(PREP):  # the boundary after segment seg of sequence n
            seg = n % (NSEG - 1)
            n = n // (NSEG - 1)
        h = hv // group
        v0 = vb * VB
        vu0 = v0  # do's columns of this block (PREP: the transition's columns load do's first ones, then zero them)
        im = Int32(0)  # PREP: 1 in the transition's columns
        if cutlass.const_expr(PREP):
            im = cutlass.select_(v0 >= V, Int32(1), Int32(0))
            vu0 = cutlass.select_(v0 >= V, Int32(0), v0)
        pstart, pmark, pfinish = fwd.make_profile(PROFILE, len(SWEEP_PHASES))
        prof = pstart()

        # with WGS warpgroups every product's N is split between them (make_mma(wgs=)); the two
        # products whose A is an accumulator of the previous step (dH^T, then -dvn^T) then take it
        # from shared memory, since a warpgroup holds only its columns of it
        regs_a = WGS == 1
        mma_p = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False, wgs=WGS * VH)  # q k^T        [i, j]
        mma_x = cm.make_mma(dtype, C, a_regs=regs_a, b_mn_major=False, wgs=WGS, wgm=VH)  # dH^T k^T     [v, i]
        mma_t = cm.make_mma(dtype, C, a_regs=False, b_mn_major=True, a_mn_major=True, wgs=WGS, wgm=VH)  # do^T P
        mma_q = cm.make_mma(dtype, K, a_regs=False, b_mn_major=True, a_mn_major=True, wgs=WGS, wgm=VH)  # do_s^T q
        mma_s = cm.make_mma(dtype, K, a_regs=regs_a, b_mn_major=True, wgs=WGS, wgm=VH)  # dvn^T w      [v, d]
        # (TW) Y = -dvn^T Tm [v, j]: A the register -dvn^T of mma_s's layout (the same M and K), B Tm [i, j] read
        # MN-major; its accumulator is mma_x's layout (the same M and N), so map_vd turns it into mma_s's A too
        mma_y = cm.make_mma(dtype, C, a_regs=True, b_mn_major=True, wgs=WGS, wgm=VH)
        if cutlass.const_expr(regs_a):
            th = cm.sample_threads(VH)
            map_s = cm.acc_to_frag_map(mma_s, (VB, K), mma_x, (VB, K), th)
            map_vd = cm.acc_to_frag_map(mma_x, (VB, C), mma_s, (VB, C), th)
            if cutlass.const_expr(TW):  # rVd is Y's A as it is, and Y's accumulator is dvn^T's layout
                assert cm.acc_to_frag_map(mma_x, (VB, C), mma_y, (VB, C), th) == map_vd
                cm.check_same_acc_layout(mma_x, mma_y, (VB, C), th)

        smem = cutlass.utils.SmemAllocator()
        lqk = cm.smem_tile_layout(dtype, C, K)
        lp = cm.smem_tile_layout(dtype, C, C, 128 if WGS == 1 else 64)  # a 32-column half of P^T: on an atom
        ldo = cm.smem_tile_layout(dtype, C, VB)
        sQ = smem.allocate_tensor(dtype, lqk.outer, 1024, lqk.inner)
        sKb = [smem.allocate_tensor(dtype, lqk.outer, 1024, lqk.inner) for _ in range(2 if TW else 1)]
        sK = sKb[0]
        lw = cm.smem_tile_layout(dtype, C, C) if TW else lqk  # (TW: Tm's [C, C] tile)
        sWb = [smem.allocate_tensor(dtype, lw.outer, 1024, lw.inner) for _ in range(NBUF)]
        sP = smem.allocate_tensor(dtype, lp.outer, 1024, lp.inner)
        sDob = [smem.allocate_tensor(dtype, ldo.outer, 1024, ldo.inner) for _ in range(NBUF)]
        sDoS = smem.allocate_tensor(dtype, ldo.outer, 1024, ldo.inner)
        sGcb = [smem.allocate_tensor(Float32, cute.make_layout(C), 16) for _ in range(NBUF)]
        sRq = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sBeb = [smem.allocate_tensor(Float32, cute.make_layout(C), 16) for _ in range(NBUF)] if TW else sGcb
        sYc = smem.allocate_tensor(Float32, cute.make_layout(C), 16) if TW else sRk  # (TW) Y's column factors
        if cutlass.const_expr(not regs_a):
            sDHt = cm.alloc_tile(smem, dtype, VB, K)  # dH^T [v, d], the A of dH^T k^T
            sVd = cm.alloc_tile(smem, dtype, VB, C)  # -dvn^T [v, i], the A of the state update
        if cutlass.const_expr(DHTMA):  # the chunk's dH [d, v] in the input dtype, for its TMA store
            sDHo = cm.alloc_tile(smem, dtype, K, VB)
        if cutlass.const_expr(DVNTMA):  # a full chunk's dvn [i, v], stored by TMA at the next chunk's top
            sDVo = cm.alloc_tile(smem, dtype, C, VB)

        thr_p = mma_p.get_slice(tidx)
        thr_x = mma_x.get_slice(tidx)
        thr_t = mma_t.get_slice(tidx)
        thr_q = mma_q.get_slice(tidx)
        thr_s = mma_s.get_slice(tidx)
        tAq = mma_p.make_fragment_A(thr_p.partition_A(sQ))
        tBkb = [mma_p.make_fragment_B(thr_p.partition_B(t)) for t in sKb]
        tBkxb = [mma_x.make_fragment_B(thr_x.partition_B(t)) for t in sKb]  # [N = i, K = d]
        tAdob = [mma_t.make_fragment_A(thr_t.partition_A(cm.transpose_view(t))) for t in sDob]  # [M = v, K = i]
        tBpt = mma_t.make_fragment_B(thr_t.partition_B(cm.transpose_view(sP)))  # [N = j, K = i]
        tAdos = mma_q.make_fragment_A(thr_q.partition_A(cm.transpose_view(sDoS)))  # [M = v, K = i]
        tBqt = mma_q.make_fragment_B(thr_q.partition_B(cm.transpose_view(sQ)))  # [N = d, K = i]
        if cutlass.const_expr(TW):
            thr_y = mma_y.get_slice(tidx)
            tBtb = [mma_y.make_fragment_B(thr_y.partition_B(cm.transpose_view(t))) for t in sWb]  # Tm [N = j, K = i]
            tBwtb = [mma_s.make_fragment_B(thr_s.partition_B(cm.transpose_view(t))) for t in sKb]  # k [N = d, K = j]
            rYd = mma_s.make_fragment_A(thr_s.partition_shape_A((VB, C)))
        else:
            tBwtb = [mma_s.make_fragment_B(thr_s.partition_B(cm.transpose_view(t))) for t in sWb]  # [N = d, K = i]
        if cutlass.const_expr(regs_a):
            rD = mma_x.make_fragment_A(thr_x.partition_shape_A((VB, K)))
            rVd = mma_s.make_fragment_A(thr_s.partition_shape_A((VB, C)))
        else:
            rD = mma_x.make_fragment_A(thr_x.partition_A(sDHt))
            rVd = mma_s.make_fragment_A(thr_s.partition_A(sVd))
        cS = thr_s.partition_C(cute.make_identity_tensor((VB, K)))  # (v, d)
        if cutlass.const_expr(DHTMA):
            # stmatrix, transposed: each thread's (v, d), (v, d + 1) accumulator pairs as 8 x 8 blocks into the
            # [d, v] tile (rows of 8 v contiguous), i.e. the (v, d) view of sDHo with v contiguous
            r2s = cm.make_acc_stmatrix_t(dtype, mma_s)
            rDHo = cute.make_rmem_tensor(thr_s.partition_shape_C((VB, K)), dtype)
        if cutlass.const_expr(DVNTMA):  # the same for dvn^T (mma_x's accumulator, (v, i)) into sDVo [i, v]
            r2x = cm.make_acc_stmatrix_t(dtype, mma_x)
            rDVo = cute.make_rmem_tensor(thr_x.partition_shape_C((VB, C)), dtype)
        cX = thr_x.partition_C(cute.make_identity_tensor((VB, C)))  # (v, i)
        cP = thr_p.partition_C(cute.make_identity_tensor((C, C)))  # (i, j)

        mbar = None
        warp0 = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        if cutlass.const_expr(TMA):
            mbar = smem.allocate_array(cutlass.Int64, 3, byte_alignment=8)
            init_barriers(mbar, 3, (aQ, aK, aW, aDo) + ((aDH,) if DHTMA else ()) + ((aDV,) if DVNTMA else ()), 0)

        ta = (aQ, aK, aW, aDo, tQ, tK, tW, tDo)
        gm = (mQ, mK, mW, mDO, mGc, mBe)
        b, ts, te, cbase, nchunks = locate_seq(n, mCu, mCuC, T, NT)
        # the chunks this CTA walks, c_e - 1 down to c_lo, of which it stores those below c_hi (SEG: a segment)
        c_lo = Int32(0)
        c_hi = nchunks
        c_e = nchunks
        if cutlass.const_expr(SEG):  # sRk: free until the first barrier
            c_e, c_lo, c_hi = walk(mGc, sRk, b, hv, ts, te, nchunks, seg, NSEG, tidx)
        ic = Int32(0)  # PREP: 1 where the boundary carries
        if cutlass.const_expr(PREP):
            c_lo, c_e, carry = carry_walk(mGc, sRk, b, hv, ts, te, nchunks, seg, NSEG, PREP_CAP, tidx)
            ic = cutlass.select_(carry, Int32(1), Int32(0))
            c_lo = cutlass.select_(im * (1 - ic) > 0, c_e, c_lo)  # no transition where the boundary warms up

        accD = cute.make_rmem_tensor(thr_s.partition_shape_C((VB, K)), Float32)
        start_state(accD, cS, mDHT, n, hv, v0, state_vk, has_dht)
        if cutlass.const_expr(SEG):  # a walk from a chunk before the end starts from zero
            zero_unless(accD, c_e == nchunks)
        if cutlass.const_expr(PREP):  # L from zero; M from the identity's columns v0 - V : where it carries
            identity_block(accD, cS, Int32(0), v0 - V, im * ic, True)
        pend = Int32(-1)  # (DVNTMA) the first row of the chunk whose dvn waits in sDVo for its store, or -1

        nwalk = c_e - c_lo
        if cutlass.const_expr(PREFETCH):  # the first chunk of the sweep (the sequence's last, or a segment's)
            if nwalk > 0:
                t1 = ts + (c_e - 1) * C
                next_qk(gm, sQ, sK, ta, mbar, b, h, t1, te - t1, tidx)
                next_wdg(gm, sWb[0], sDob[0], sGcb[0], ta, mbar, b, hv, t1, vu0, te - t1, tidx, sBeb[0])
            cute.arch.cp_async_commit_group()
        for cp in cutlass.range((nwalk + NBUF - 1) // NBUF, unroll=1):
            for par in cutlass.range_constexpr(NBUF):  # one chunk a buffer, so every tile stays static
                cr = cp * NBUF + par
                if cr < nwalk:
                    ci = c_e - 1 - cr
                    keep = True
                    if cutlass.const_expr(SEG):
                        keep = ci < c_hi  # a warm-up chunk stores nothing
                    t0 = ts + ci * C
                    length = cutlass.min(te - t0, C)
                    sW, sDo, sGc = sWb[par], sDob[par], sGcb[par]
                    kb = par if TW else 0  # (TW: chunk cr's k in buffer cr % 2, the next chunk's in the other)
                    sKc = sKb[kb]  # this chunk's k tile
                    sKn = sKb[1 - par] if TW else sKc  # the next chunk's k buffer
                    pmark(prof, -1)
                    if cutlass.const_expr(PREFETCH):
                        if cutlass.const_expr(TMA):  # chunk cr = 2 cp + par: w, do on barrier par, q, k on 2
                            cute.arch.mbarrier_wait(mbar + par, cp % 2)
                            cute.arch.mbarrier_wait(mbar + 2, par)
                            if length < C:  # only the first chunk taken, the sequence's last, is partial
                                zero_tail(sQ, K, length, tidx)
                                zero_tail(sKc, K, length, tidx)
                                zero_tail(sW, WC, length, tidx)
                                zero_tail(sDo, VB, length, tidx)
                            if cutlass.const_expr(DHTMA):  # chunk cr - 1's dH store has read sDHo (issued a
                                if warp0:  # chunk ago: no wait in practice)
                                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                        cute.arch.cp_async_wait_group(0)
                        if cutlass.const_expr(PREP):  # the transition's columns: do read as 0
                            if im > 0:
                                zero_tail(sDo, VB, 0, tidx)
                        cute.arch.fence_view_async_shared()
                        cute.arch.sync_threads()  # chunk cr is in smem; every thread is done with chunk cr - 1
                        if cutlass.const_expr(DVNTMA):  # chunk cr - 1's dvn, if it was a full chunk (warp 0)
                            if warp0:
                                if pend >= 0:
                                    cm.tma_store(aDV, cm.token_box(tDV, b, hv, pend, v0, C, VB), sDVo)
                        if cr + 1 < nwalk:  # w, do, gc of chunk cr + 1 into the buffers chunk cr - 1 used
                            next_wdg(gm, sWb[1 - par], sDob[1 - par], sGcb[1 - par], ta,
                                     None if mbar is None else mbar + (1 - par), b, hv, t0 - C, vu0, C, tidx,
                                     sBeb[1 - par])
                        cute.arch.cp_async_commit_group()
                    else:
                        cute.arch.sync_threads()  # the previous chunk is done with every smem tile
                        load_chunk(mQ, mK, mW, mDO, mGc, sQ, sKc, sW, sDo, sGc, b, h, hv, t0, v0, length, tidx)
                        cute.arch.sync_threads()
                    pmark(prof, 0)
                    if cutlass.const_expr(l2norm):
                        if cutlass.const_expr(NORM8):  # every thread, eight a row
                            rows_inv_norm(sQ, sRq, tidx)
                            rows_inv_norm(sKc, sRk, tidx)
                        else:  # a thread a row
                            if tidx < C:
                                sRq[tidx] = row_inv_norm(sQ, tidx)
                            elif tidx < 2 * C:
                                sRk[tidx - C] = row_inv_norm(sKc, tidx - C)
                        cute.arch.sync_threads()
                    # do_s = do diag(scale e^gc rq): the A operand of the q term of the state update
                    scale_rows(sDo, sDoS, sGc, sRq, scale, tidx)
                    if cutlass.const_expr(TW):  # Y's column factors beta exp(gc) rk, once a chunk (sRk written, the
                        if tidx < C:  # barrier before the products publishes them)
                            yc = sBeb[par][tidx] * cute.math.exp2(sGc[tidx] * LOG2E, fastmath=True)
                            if cutlass.const_expr(l2norm):
                                yc = yc * sRk[tidx]
                            sYc[tidx] = yc
                    if cutlass.const_expr(not regs_a):  # dH^T in the input dtype, each warpgroup its columns
                        for e in cutlass.range_constexpr(cute.size(accD)):
                            sv, sd = cS[e]
                            sDHt[sv, sd] = accD[e].to(dtype)
                    if cutlass.const_expr(DHTMA):  # this chunk's dH (before the update) into sDHo by stmatrix
                        rDHo.store(accD.load().to(dtype))
                        cm.stmatrix_acc_t(r2s, rDHo, cm.transpose_view(sDHo), tidx)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()
                    if cutlass.const_expr(DHTMA):  # ... and to dH[chunk, hv, :, v0 : v0 + VB] by TMA (warp 0)
                        if warp0:
                            if keep:
                                cm.tma_store(aDH, cm.token_box(tDH, cbase + ci, hv, 0, v0, K, VB), sDHo)
                    pmark(prof, 1)

                    # ---- dH^T k^T, q k^T, and the q term of the update: dH^T <- e^(gc_C) dH^T + do_s^T q
                    # (dH^T k^T reads dH^T before it, in the input dtype: rD, or sDHt)
                    if cutlass.const_expr(regs_a):
                        for f in cutlass.range_constexpr(cute.size(rD)):
                            rD[f] = accD[map_s[f]].to(dtype)
                    if cutlass.const_expr(not DHTMA and not PREP):  # this chunk's dH (before the update), for stage 3
                        if keep:
                            store_state(accD, cS, mDH, cbase + ci, hv, v0, False)
                    glast = sGc[C - 1]
                    decay = cute.math.exp2(glast * LOG2E, fastmath=True)
                    for e in cutlass.range_constexpr(cute.size(accD)):
                        accD[e] = accD[e] * decay
                    accX = cute.make_rmem_tensor(thr_x.partition_shape_C((VB, C)), Float32)
                    accP = cute.make_rmem_tensor(thr_p.partition_shape_C((C, C)), Float32)
                    gemm(mma_x, accX, rD, tBkxb[kb], True)  # dH^T k^T  [v, i]
                    gemm(mma_p, accP, tAq, tBkb[kb], True)  # q k^T     [i, j]
                    gemm(mma_q, accD, tAdos, tBqt, False)  # dH^T += do_s^T q
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(PREFETCH and EARLY_QK):
                        # q, k of chunk cr + 1 now, not after P: nothing below reads sQ or sKc (the norms
                        # are in sRq, sRk), so once every warpgroup's products on them are done they load
                        # during P and do^T P too
                        cute.arch.sync_threads()
                        if cr + 1 < nwalk:
                            next_qk(gm, sQ, sKn, ta, mbar, b, h, t0 - C, C, tidx)
                        cute.arch.cp_async_commit_group()
                    pmark(prof, 2)

                    for e in cutlass.range_constexpr(cute.size(accX)):
                        _, xi = cX[e]
                        dcoef = cute.math.exp2((glast - sGc[xi]) * LOG2E, fastmath=True)
                        if cutlass.const_expr(l2norm):
                            dcoef = dcoef * sRk[xi]
                        accX[e] = accX[e] * dcoef
                    # P = scale tril(q k^T exp(gc_i - gc_j)) rq_i rk_j -> smem, as in the forward
                    store_p(accP, cP, sP, sGc, sRq, sRk, scale)
                    if cutlass.const_expr(DVNTMA):  # chunk cr - 1's dvn store has read sDVo (this chunk's dH
                        if warp0:  # store, the newest group, may still run)
                            # (with SEG a warm-up chunk issues no dH store, so the newest group is then another's;
                            # this holds because every warm-up chunk comes before every kept one in the walk: a
                            # dvn store pending here means chunk cr - 1 was kept, so this chunk is kept too)
                            cute.arch.cp_async_bulk_wait_group(1, read=True)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()  # P visible to the async proxy; every product on q, k is done
                    pmark(prof, 3)
                    if cutlass.const_expr(PREFETCH and not EARLY_QK):  # q, k of chunk cr + 1 (done with them)
                        if cr + 1 < nwalk:
                            next_qk(gm, sQ, sKn, ta, mbar, b, h, t0 - C, C, tidx)
                        cute.arch.cp_async_commit_group()

                    gemm(mma_t, accX, tAdob[par], tBpt, False)  # dvn^T += do^T P
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    pmark(prof, 4)

                    if cutlass.const_expr(DVNTMA):
                        if length == C:  # a full chunk: into sDVo by stmatrix, stored at the next chunk's top
                            rDVo.store(accX.load().to(dtype))
                            cm.stmatrix_acc_t(r2x, rDVo, cm.transpose_view(sDVo), tidx)
                            pend = t0
                            if cutlass.const_expr(SEG):
                                pend = cutlass.select_(keep, t0, Int32(-1))
                        else:  # a sequence's partial last chunk (the first taken): rows past its end untouched
                            if keep:  # (SEG: it may be a warm-up chunk)
                                store_dvn_rows(accX, cX, mDVN, b, t0, hv, v0, length)
                            pend = Int32(-1)
                    elif cutlass.const_expr(not PREP):
                        if keep:
                            store_dvn_rows(accX, cX, mDVN, b, t0, hv, v0, length)
                    if cutlass.const_expr(regs_a):
                        for f in cutlass.range_constexpr(cute.size(rVd)):
                            rVd[f] = (-accX[map_vd[f]]).to(dtype)
                    else:  # -dvn^T into shared memory for every warpgroup (the previous chunk's reads are done)
                        for e in cutlass.range_constexpr(cute.size(accX)):
                            xv, xi = cX[e]
                            sVd[xv, xi] = (-accX[e]).to(dtype)
                        cute.arch.fence_view_async_shared()
                        cute.arch.sync_threads()
                    pmark(prof, 5)
                    if cutlass.const_expr(TW):
                        # Y = -dvn^T Tm [v, j], its columns scaled by beta exp(gc) rk, then dH^T += Y k
                        accY = cute.make_rmem_tensor(thr_y.partition_shape_C((VB, C)), Float32)
                        gemm(mma_y, accY, rVd, tBtb[par], True)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        for e in cutlass.range_constexpr(cute.size(accY)):
                            _, yj = cX[e]
                            accY[e] = accY[e] * sYc[yj]
                        for f in cutlass.range_constexpr(cute.size(rYd)):
                            rYd[f] = accY[map_vd[f]].to(dtype)
                        gemm(mma_s, accD, rYd, tBwtb[kb], False)  # dH^T -= dvn^T w
                    else:
                        gemm(mma_s, accD, rVd, tBwtb[par], False)  # dH^T -= dvn^T w
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    pmark(prof, 6)

        if cutlass.const_expr(PREP):  # the carry: L's and M's columns of row n * (NSEG - 1) + seg
            store_state(accD, cS, mDH0, n * (NSEG - 1) + seg, hv, v0, False)
        elif cutlass.const_expr(SEG):  # dh0 from the segment holding chunk 0 (segment 0 when there is none)
            if seg == cutlass.select_(nchunks > 0, (NSEG + nchunks - 1) // cutlass.max(nchunks, 1) - 1, Int32(0)):
                store_state(accD, cS, mDH0, n, hv, v0, state_vk)
        else:
            store_state(accD, cS, mDH0, n, hv, v0, state_vk)
        if cutlass.const_expr(DVNTMA):  # the last chunk's dvn (the sequence's first chunk), if full
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            if warp0:
                if pend >= 0:
                    cm.tma_store(aDV, cm.token_box(tDV, b, hv, pend, v0, C, VB), sDVo)
        if cutlass.const_expr(DHTMA):  # the last dH store done before the CTA's shared memory goes
            if warp0:
                cute.arch.cp_async_bulk_wait_group(0)
        pfinish(prof, mProf, (n * cute.arch.grid_dim()[1] + hv) * cute.arch.grid_dim()[2] + vb, tidx)

    @cute.jit
    def host(
        mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mGc: cute.Tensor, mDO: cute.Tensor, mDHT: cute.Tensor,
        mDVN: cute.Tensor, mDH: cute.Tensor, mDH0: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor,
        scale: Float32, T: Int32, NT: Int32, group: Int32, nseq: Int32, mProf: cute.Tensor, mBe: cute.Tensor,
        stream,
    ):
        _static_checks(dtype, K, WGS, VH, DHTMA, DVNTMA)
        if cutlass.const_expr(TW):
            cm.check_mn_major_view(dtype, C, C)  # Tm: MN-major B of Y
        HV = mW.shape[2]
        atoms, tmas = cm.make_tma_rows_atoms(TMA, dtype, ((mQ, C, K), (mK, C, K), (mW, C, WC), (mDO, C, VB)))
        aDH, tDH = cm.make_tma_store(DHTMA, dtype, mDH, cm.STATE_ROWS, K, VB)
        aDV, tDV = cm.make_tma_store(DVNTMA, dtype, mDVN, cm.TOKEN_ROWS, C, VB)
        kernel(mQ, mK, mW, mGc, mDO, mDHT, mDVN, mDH, mDH0, mCu, mCuC, scale, T, NT, group, mProf, *atoms,
               *tmas, aDH, tDH, aDV, tDV, mBe).launch(
            grid=[nseq * (NSEG - 1), HV, (V + K) // VB] if PREP else [nseq * NSEG, HV, V // VB],
            block=[THREADS, 1, 1], stream=stream, **cm.two_ctas_an_sm(WGS == 2),
        )

    f = fwd._fakes()
    args = (
        f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, WC), f.any3(Float32), f.rows4(dtype, V), f.state(),
        f.rows4(odt, V), f.rows4(odt, V) if DHTMA else f.state(odt), f.state(), f.vec(cutlass.Int32),
        f.vec(cutlass.Int32),
        Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(1), f.vec(cutlass.Int64), f.any3(Float32), f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


def _static_checks(dtype, K: int, wgs: int = 1, vh: int = 1, dh_tma: bool = False, dvn_tma: bool = False) -> None:
    """Layout facts the kernel relies on, asserted while tracing (no GPU needed)."""
    cm.check_mn_major_view(dtype, CHUNK, K)
    cm.check_mn_major_view(dtype, CHUNK, CHUNK, 128 if wgs == 1 else 64)
    cm.check_mn_major_view(dtype, CHUNK, VBLOCK * vh)  # do and do_s: MN-major A operands, a 64-row half each
    if wgs != 1 and K // wgs < 64:
        raise AssertionError("a warpgroup's share of an MN-major q^T / w^T must span whole 128-byte atoms")
    if vh != 1 and wgs != 1:
        raise AssertionError("two V halves a CTA take one warpgroup each")
    regs = wgs == 1
    th = cm.sample_threads(wgs * vh)
    m = 64 * vh
    cm.check_same_acc_layout(cm.make_mma(dtype, CHUNK, regs, False, wgs=wgs, wgm=vh),
                             cm.make_mma(dtype, CHUNK, False, True, True, wgs, vh), (m, CHUNK), th)
    cm.check_same_acc_layout(cm.make_mma(dtype, K, regs, True, wgs=wgs, wgm=vh),
                             cm.make_mma(dtype, K, False, True, True, wgs, vh), (m, K), th)
    if dh_tma:  # the dH tile's stmatrix takes the update's accumulator (mma_s) value by value, flat
        mma_s = cm.make_mma(dtype, K, regs, True, wgs=wgs, wgm=vh)
        cm.check_stmatrix_order(mma_s, cm.make_acc_stmatrix_t(dtype, mma_s), (m, K), range(128 * wgs * vh))
    if dvn_tma:  # and dvn's, the accumulator of dH^T k^T and do^T P (mma_x)
        mma_x = cm.make_mma(dtype, CHUNK, regs, False, wgs=wgs, wgm=vh)
        cm.check_stmatrix_order(mma_x, cm.make_acc_stmatrix_t(dtype, mma_x), (m, CHUNK), range(128 * wgs * vh))


def prefetch_default() -> bool:
    """Whether the sweep fetches the next chunk by ``cp.async`` while it computes this one
    (``CUDNN_TRAIN_GDN_SWEEP_PREFETCH`` = 1, the default, or 0: every chunk loaded synchronously at
    its start). Same products in the same order either way: the results are bitwise equal."""
    return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_PREFETCH", True)


def early_qk_default(wgs: int) -> bool:
    """With the prefetch, whether the next chunk's q and k are issued right after this chunk's products
    on them instead of after P is stored: on one warpgroup (H200, B4 T4096 H16 HV32, the training path's
    call: 0.618 / 0.614 ms against 0.629 / 0.626, twelfth session), not on two (B1 T16384, where the split
    sweep is the default anyway: 1.622 / 1.619 against 1.609 / 1.610). ``CUDNN_TRAIN_GDN_SWEEP_EARLY_QK``
    = 1 / 0 forces it. The same data lands in the same tiles before any read: bitwise equal results."""
    return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_EARLY_QK", wgs == 1)


def tma_default() -> bool:
    """``CUDNN_TRAIN_GDN_SWEEP_TMA`` (on unless 0): the fused sweep's prefetch by TMA instead of ``cp.async`` (one elected
    thread of warp 0 issues a chunk's w, do and, after the products on them, q, k; gc stays on cp.async), so
    the warpgroup that runs the chain no longer issues about 28 16-byte copies a thread and chunk (the forward's
    state pass stalled half its chain's cycles issuing them). The first chunk taken, a sequence's last, has its
    rows past the end zeroed once landed, as cp.async zero-fills them: the same bits. Measured (sixteenth
    session): 0.585 against 0.615 ms at B4 T4096 H16 HV32."""
    return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_TMA", True)


def vh2_default(nseq: int, HV: int, V: int, device) -> bool:
    """Where the fused kernel runs on one warpgroup at V = 128, whether its CTA takes both 64-column halves of V on
    two warpgroups (``reverse_sweep(vh2=True)``), so that the two halves of a (sequence, value head) load q, k, w
    and gc once, form the l2norm rows and do_s once and split ``q k^T`` and P between them, where two CTAs each
    did all of it. Every product of a half is the one-warpgroup kernel's instruction for instruction (stacked
    along M; ``q k^T`` split by N): the results are bitwise its own. ``CUDNN_TRAIN_GDN_SWEEP_VH2`` = 1 / 0 always /
    never; unset, where the N x HV x V/64 CTAs a half would take more than one wave of the GPU's SMs (the grid
    halves; at one wave or less, halving it leaves SMs idle). Measured (H200, eighteenth session,
    ``tools/time_gdn_sweep.py --vh2``): B4 T4096 H16 HV32 (256 CTAs a half, 128 two-half) 0.495 ms against 0.586;
    B1 T16384 HV32 (64 against 32 CTAs, where the split sweep runs by default) 2.010 against 1.887."""
    env = os.environ.get("CUDNN_TRAIN_GDN_SWEEP_VH2", "").strip()
    if env:
        return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_VH2", False)
    return V == 2 * VBLOCK and nseq * HV * 2 > kc.num_sms(device)


def dh_tma_default() -> bool:
    """``CUDNN_TRAIN_GDN_SWEEP_DHTMA`` (on unless 0): where the fused kernel loads by TMA, writes dH in the input
    dtype (the training path) and takes both V halves in one CTA (the form measured; ``dh_tma=True`` asks for it
    with one half a CTA too, or at K = V = 64), each chunk's dH leaves by ``stmatrix`` (transposed: the accumulator's (v, d),
    (v, d + 1) pairs as 8 x 8 blocks, eight instructions a thread) into a [K, columns] tile and one TMA store
    (warp 0) instead of 64 scattered 2-byte global stores a thread. Nsight Compute (H100, B4 T4096, twenty-first
    session) put 20% of the sweep's stall samples on those stores: each waited for the previous one to have read
    its source register (one register carried every value at 255 registers a thread), a long-scoreboard chain.
    The same values rounded once: the same bits. Measured (H200, twenty-first session, B4 T4096 H16 HV32, both V
    halves a CTA): 0.412 against 0.499 ms (``time_gdn_sweep.py --dh-tma``), the op's forward+backward 2.318
    against 2.403; 212 registers instead of 255."""
    return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_DHTMA", True)


def dvn_tma_default() -> bool:
    """``CUDNN_TRAIN_GDN_SWEEP_DVNTMA`` (on unless 0; with the dH TMA stores, which it needs): a full chunk's dvn
    leaves the same way as dH: transposed ``stmatrix`` of the dvn^T accumulator (v, i) into a
    [C, columns] tile (16 KB with both V halves), stored by one TMA box at the next chunk's top barrier (no barrier
    of its own); warp 0 waits for the store to have read the tile before the barrier after P, ahead of the next
    write. A sequence's partial last chunk (the first taken) keeps the element stores: a box would write the rows
    past a varlen sequence's end, the next sequence's. Nsight Compute (H100, twenty-first session) put 8.8% of
    the sweep's stall samples on the dvn stores. The same values rounded once: the same bits. Measured (H100,
    twenty-second session, B4 T4096 H16 HV32, ``time_gdn_sweep.py --dvn-tma``): 0.375 / 0.379 against 0.410 /
    0.411 ms with dH's TMA stores alone, outputs bitwise equal."""
    return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_DVNTMA", True)


def norm8_default() -> bool:
    """``CUDNN_TRAIN_GDN_SWEEP_NORM8=1`` (thirty-third session; GPU-run the same session, within noise: off): the fused sweep's l2norm
    factors of each chunk's q and k rows (in its "l2norm rows, do_s, dH^T to smem" phase, on the chain's critical
    path) summed by every thread, eight a row with three butterfly shuffles
    (``gated_delta_rule_common_sm90.make_rows_inv_norm``), instead of a thread a row, whose 16-byte reads of one
    column of 32 rows conflict four ways. Another summation order: the outputs may differ in their last bits. H100,
    B4 T4096 H16 HV32, through the op with stage 3's switch: the sweep 0.377 against 0.380 and 0.378 ms."""
    return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_NORM8", False)


def sweep_segments(nseq: int, HV: int, V: int, T: int, l2norm: bool, device) -> int:
    """The fused sweep's CTAs a (sequence, value head, V block), each storing one segment of the sequence's chunks
    after a warm-up from a zero dH that reaches forward until the chunks' decay is below e^-20 (or from the
    sequence's end: the unsplit sweep's bits); see ``_build_dstate``. ``CUDNN_TRAIN_GDN_SWEEP_SEG``: unset or 1, one
    (the default: see :func:`cm.segments` for why); ``auto``, the fewest of 2, 4, 8, 16 whose grid of
    both-V-halves CTAs reaches 90% of the SMs, keeping segments of at least 16 chunks (B1 T16384 H16 HV32: 4, B4
    T4096's grid, where the fused sweep takes 0.375 ms on an H100 against the split sweep's 0.89 at B1); 2 to 16
    force that many (:func:`cm.segments`). With more than one the fused kernel serves the call (both V halves a
    CTA where V = 128), never the split pair; without l2norm, the prefetch, or with the profile variant, one."""
    return cm.segments("CUDNN_TRAIN_GDN_SWEEP_SEG", nseq, HV, T, l2norm, device, fill=0.9)


def get_dstate_kernel(dtype, K, V, l2norm, varlen, has_dht, state_vk, out_dtype=torch.float32, wgs=1,
                      prefetch=None, profile=False, early_qk=None, tma=None, vh=1, dh_tma=None, dvn_tma=None,
                      nseg=1, prep_cap=0, norm8=None, tw=False):
    """The fused sweep kernel (:func:`reverse_sweep`); with ``prep_cap`` > 0 its variant for the carried split's
    prepare step (:func:`sweep_carries`: no final state's gradient, ``[K, V]`` states, the element stores).
    ``norm8``: the l2norm rows by eight threads a row (default :func:`norm8_default`). ``tw``: w's slot holds the
    forward's gated chunk inverse Tm and the launch takes the effective beta (``_build_dstate``'s TW; the TMA loads,
    one warpgroup a V half, no segments)."""
    norm8 = bool(l2norm) and (norm8_default() if norm8 is None else bool(norm8))
    prefetch = prefetch_default() if prefetch is None else bool(prefetch)
    early_qk = prefetch and (early_qk_default(wgs) if early_qk is None else bool(early_qk))
    tma = prefetch and (tma_default() if tma is None else bool(tma))
    if tw and not (tma and wgs == 1 and nseg == 1 and not prep_cap and not profile):
        raise ValueError(f"tw: the TMA loads and the prefetch, one warpgroup a V half, no segments, prepare step or "
                         f"profile (tma={tma}, wgs={wgs}, nseg={nseg}, prep_cap={prep_cap}, profile={profile})")
    # unset: where both V halves share a CTA (the form measured); asked for: wherever the TMA loads run
    dh_tma = tma and out_dtype == dtype and (dh_tma_default() and vh == 2 if dh_tma is None else bool(dh_tma))
    dvn_tma = dh_tma and (dvn_tma_default() if dvn_tma is None else bool(dvn_tma))
    if prep_cap:  # the prepare step stores its carries alone
        dh_tma = dvn_tma = False
    if prep_cap < 0 or (prep_cap and (nseg < 2 or has_dht or state_vk or K % (VBLOCK * vh))):
        raise ValueError(f"prep_cap={prep_cap}: the prepare step takes nseg >= 2, no final state's gradient, [K, V] "
                         f"states and a V block dividing K")
    key = ("dstate", str(dtype), K, V, bool(l2norm), bool(varlen), bool(has_dht), bool(state_vk)) + (
        () if out_dtype == torch.float32 else (str(out_dtype),)) + (() if wgs == 1 else (("wgs", wgs),)) + (
        ("prefetch",) if prefetch else ()) + (("profile",) if profile else ()) + (("early_qk",) if early_qk else ()) + (
        ("tma",) if tma else ()) + (() if vh == 1 else (("vh", vh),)) + (("dh_tma",) if dh_tma else ()) + (
        ("dvn_tma",) if dvn_tma else ()) + ((("nseg", nseg),) if nseg > 1 else ()) + (
        (("prep", prep_cap),) if prep_cap else ()) + (("norm8",) if norm8 else ()) + (("tw",) if tw else ())
    if nseg not in cm.SEGMENTS or (nseg > 1 and not (l2norm and prefetch and not profile)):
        raise ValueError(f"nseg={nseg}: one of {cm.SEGMENTS}; more than 1 only with l2norm and the prefetch, "
                         "not the profile variant")
    if vh not in (1, 2) or (vh == 2 and (wgs != 1 or V != 2 * VBLOCK)):
        raise ValueError(f"vh={vh} with wgs={wgs} at V={V}: two V halves a CTA take one warpgroup each at V = 128")

    def build():
        return _build_dstate(fwd._dt(dtype), K, V, l2norm, varlen, has_dht, state_vk, fwd._dt(out_dtype), wgs,
                             prefetch, bool(profile), early_qk, tma, vh, dh_tma, dvn_tma, nseg, prep_cap, norm8,
                             bool(tw))

    return kc.get_kernel("gdn_bwd_dstate", key, build, _SOURCES)


def serves_tm(K: int, V: int, tma=None, prefetch=None, no_profile: bool = True) -> bool:
    """Whether :func:`reverse_sweep` can take the forward's chunk inverse Tm and beta instead of w (``beta=``): the
    fused kernel's TW variant, which needs its TMA loads and the prefetch (their switches, or ``tma`` / ``prefetch``
    as given) and no profile; at any head dims the fused kernel takes, one warpgroup a V half."""
    pf = prefetch_default() if prefetch is None else bool(prefetch)
    return (K in fwd.HEAD_DIMS and V in fwd.HEAD_DIMS and pf and no_profile
            and (tma_default() if tma is None else bool(tma)))


def sweep_takes_tm(nseq: int, HV: int, K: int, V: int, T: int, l2norm: bool, device) -> bool:
    """Whether :func:`reverse_sweep` called with its defaults (the training path's call) runs the fused kernel, whose
    TW variant can take Tm and the effective beta instead of w (:func:`serves_tm`): not the split pair
    (:func:`split_default`), the segments, the carried split or the specialized warpgroups."""
    from . import gated_delta_rule_bwd_ws_sm90 as WS

    return (serves_tm(K, V) and not WS.enabled() and not split_default(nseq, HV, V, device)
            and sweep_segments(nseq, HV, V, T, l2norm, device) == 1
            and carry_segments(nseq, HV, K, V, T, l2norm, device) == 1)


def warpgroups(nseq: int, HV: int, V: int, device) -> int:
    """The sweep's default warpgroups at K = 128: two where its N x HV x V/64 CTAs leave SMs idle, one
    where they fill the GPU. Measured (H200, K = V = 128, bf16, with the prefetch;
    ``tools/time_gdn_sweep.py``): B1 T16384 HV32 (64 CTAs) 1.62 ms on two against 1.97 on one; B4
    T4096 HV32 (256 CTAs) 0.815 against 0.628."""
    return 2 if nseq * HV * (V // VBLOCK) < kc.num_sms(device) else 1


def split_default(nseq: int, HV: int, V: int, device) -> bool:
    """Whether the sweep runs as the split pair of kernels of ``gated_delta_rule_bwd_split_sm90``
    (``dvl`` in parallel, then the ``dchain`` over V blocks of 16, 32 or 64: ``split_sm90.vblock``) where it
    serves (dvn and dH in the input dtype): ``CUDNN_TRAIN_GDN_SWEEP_SPLIT`` = 1 / 0 always / never; unset, where
    the fused kernel's N x HV x V/64 CTAs leave SMs idle (the chain then takes V blocks of 32 or 16, two or four
    times the CTAs).
    Measured (H200, K = V = 128, bf16, ``tools/time_gdn_sweep.py --split-only``): B1 T16384 HV32 (64
    fused CTAs) split 0.967 ms (VB 32) against 1.606 fused; B4 T4096 HV32 (256) 0.855 (VB 64) against 0.626."""
    env = os.environ.get("CUDNN_TRAIN_GDN_SWEEP_SPLIT", "").strip()
    if env:
        return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_SPLIT", False)
    return nseq * HV * (V // VBLOCK) < kc.num_sms(device)


def reverse_sweep(q, k, w, gc, do, dht=None, *, scale: float, use_qk_l2norm_in_kernel: bool = False,
                  cu_seqlens=None, state_v_first: bool = False, out_dtype=torch.float32, wgs: int | None = None,
                  prefetch: bool | None = None, split: bool | None = None, profile: torch.Tensor | None = None,
                  early_qk: bool | None = None, ws: bool | None = None, ws_tma: bool | None = None,
                  tma: bool | None = None, vh2: bool | None = None, dh_tma: bool | None = None,
                  dvn_tma: bool | None = None, nseg: int | None = None, carry: int | None = None, beta=None):
    """Launch the reverse sweep. q, k ``[B, T, H, K]``; w ``[B, T, HV, K]`` and gc ``[B, T, HV]``
    (the forward's ``return_intermediates``); do ``[B, T, HV, V]``; dht the final state's gradient
    (float32, the op's state layout) or None. Returns ``(dvn, dH, dh0)``: ``[B, T, HV, V]`` and
    ``[chunks, HV, K, V]`` in ``out_dtype`` (float32, or the input dtype that the per-chunk
    gradient kernel reads them in), and float32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with
    ``state_v_first``). ``wgs``: warpgroups per CTA (default ``CUDNN_TRAIN_GDN_SWEEP_WGS``, else
    :func:`warpgroups`; 2 at K = 128 splits every product's N); ``prefetch``: the next chunk's loads
    in flight during this one (default :func:`prefetch_default`), its q and k issued early with ``early_qk``
    (default :func:`early_qk_default`); ``split``: the split pair of kernels
    (default :func:`split_default`; served with ``out_dtype`` the input dtype, else the fused kernel runs).
    ``profile``: an int64 tensor of at least N x HV x V/64 x (len(SWEEP_PHASES) + 1) elements: runs the fused
    kernel's profile variant (never the split pair), which writes thread 0's clock64 cycles per phase,
    summed over the CTA's chunks, and the CTA's total (``tools/time_gdn_sweep.py --profile``). ``ws``: where the
    fused kernel would run, its variant on two specialized warpgroups instead (``gated_delta_rule_bwd_ws_sm90``;
    default ``CUDNN_TRAIN_GDN_SWEEP_WS``, off); ``ws_tma``: that variant's loads by TMA (default
    ``CUDNN_TRAIN_GDN_SWEEP_WS_TMA``, off; the same bits); ``tma``: the fused kernel's prefetch by TMA (default
    :func:`tma_default`, on; the same bits; nothing without the prefetch; the split sweep's chain follows
    ``CUDNN_TRAIN_GDN_DCHAIN_TMA`` instead); ``vh2``: where the fused kernel runs (not the split pair nor the
    specialized warpgroups, which ignore it), its CTA on both V halves, one warpgroup each (default
    :func:`vh2_default`: by the grid, never for ``profile``; True takes one warpgroup a half where ``wgs`` is unset,
    and is Unsupported at ``wgs=2`` or V = 64); ``dh_tma``: with the TMA loads and ``out_dtype`` the input dtype, dH
    leaves by stmatrix and TMA stores (default :func:`dh_tma_default`: on with both V halves a CTA; the same bits;
    ignored without the TMA loads or with float32 outputs); ``dvn_tma``: with ``dh_tma``, a full chunk's dvn
    leaves the same way (default :func:`dvn_tma_default`, on; the same bits); ``nseg``: segments a sequence for
    the fused kernel (default :func:`sweep_segments`; where more than one, the fused kernel runs whatever ``split``
    and ``ws`` say, on one warpgroup a V half unless ``wgs`` says otherwise, both halves a CTA where
    :func:`vh2_default` on the segments' grid says so, unless ``vh2`` decides); ``carry``: segments a sequence for
    the carried split (default :func:`carry_segments`, where ``nseg`` is not given; :func:`carried_sweep`).
    ``beta`` (float32 ``[B, T, HV]``, the forward's effective beta): then ``w`` is the forward's gated chunk
    inverse Tm ``[B, T, HV, 64]`` (stage 3's) instead of w, and the state update's ``dvn^T w`` is formed as
    ``((dvn^T Tm) diag(beta exp(gc) rk)) k`` (for the training forward that never forms w); served by the fused
    kernel alone, with its TMA loads and one warpgroup a V half (:func:`serves_tm`), else Unsupported."""
    cm.check_device(q)
    if q.dtype not in (torch.bfloat16, torch.float16) or do.dtype != q.dtype or w.dtype != q.dtype:
        raise Unsupported(f"dtypes q {q.dtype}, w {w.dtype}, do {do.dtype}")
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if K not in fwd.HEAD_DIMS or V not in fwd.HEAD_DIMS:
        raise Unsupported(f"head dims K={K}, V={V}")
    q, k, w, do = (cm.check_rows_aligned(name, t) for name, t in (("q", q), ("k", k), ("w", w), ("do", do)))
    varlen = cu_seqlens is not None
    nseq = cu_seqlens.numel() - 1 if varlen else B
    dev = q.device
    if beta is not None:  # w is Tm: the fused kernel's TW variant, nothing else
        if beta.dtype != torch.float32 or tuple(beta.shape) != tuple(gc.shape) or not beta.is_contiguous():
            raise ValueError(f"beta: contiguous float32 of gc's shape {tuple(gc.shape)} (got {beta.dtype}, "
                             f"{tuple(beta.shape)})")
        if w.shape[-1] != CHUNK:
            raise ValueError(f"w: with beta, the chunk inverse Tm [B, T, HV, {CHUNK}] (got {tuple(w.shape)})")
        if not serves_tm(K, V, tma, prefetch, profile is None) or split or ws or (nseg or 1) > 1 or (carry or 1) > 1 \
                or wgs == 2:
            raise Unsupported("the sweep on Tm: the fused kernel with its TMA loads, one warpgroup a V half")
        carry, nseg, split, ws, wgs = 1, 1, False, False, 1
    f32_dummy, _, i64_dummy = fwd._dummies(dev)
    cu, cu_chunks, total_chunks, NT = fwd.chunk_map(cu_seqlens, B, T, dev)
    if out_dtype not in (torch.float32, q.dtype):
        raise Unsupported(f"out_dtype {out_dtype} (float32 or q's dtype)")
    pf = prefetch_default() if prefetch is None else bool(prefetch)
    carry_ok = pf and profile is None and not state_v_first and use_qk_l2norm_in_kernel
    if carry is None:  # the env switch, where the prepare kernel can serve and nothing else is asked for
        carry = 1
        if nseg is None and carry_ok and split is not True and not ws:
            carry = carry_segments(nseq, HV, K, V, B * T, use_qk_l2norm_in_kernel, dev)
    elif int(carry) > 1 and not carry_ok:
        raise Unsupported(f"carry={carry}: the carried split takes l2norm, the prefetch, [K, V] states, no profile")
    if int(carry) > 1 and T > 0 and nseq > 0:
        return carried_sweep(q, k, w, gc, do, dht, cu_seqlens, int(carry), scale=scale,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, out_dtype=out_dtype, tma=tma)
    if nseg is None:  # the env switch, where the segments' kernel can serve
        nseg = sweep_segments(nseq, HV, V, B * T, use_qk_l2norm_in_kernel, dev)
        if not (pf and profile is None):
            nseg = 1
    nseg = int(nseg)
    if nseg > 1:  # the fused kernel on the grid of nseg x more sequences, one warpgroup a V half (two warpgroups
        split, ws = False, False  # splitting N spill 60 bytes with the segments' registers at their 128)
        if wgs is None and vh2 is None:
            vh2 = vh2_default(nseq * nseg, HV, V, dev)
        if wgs is None:
            wgs = 1
    if wgs is None and vh2:  # both V halves in one CTA asked for: one warpgroup a half
        wgs = 1
    if wgs is None:  # the env knob (a bad value is a ValueError naming it), else by the grid
        env = "CUDNN_TRAIN_GDN_SWEEP_WGS"
        wgs = fwd._wgs_choice(env, os.environ.get(env, "").strip() or str(warpgroups(nseq * nseg, HV, V, dev)), None,
                              K, None)
    elif wgs not in (1, 2) or (wgs == 2 and K != 128):
        raise Unsupported(f"wgs={wgs} at K={K} (1, or 2 at K = 128)")
    # dense: every token row of dvn is written; varlen: rows past the last sequence are not (zeros there)
    # (the dense outputs NaN-filled under the forward module's POISON, as the tests that check every element is
    # written set it)
    dvn = torch.zeros(B, T, HV, V, dtype=out_dtype, device=dev) if varlen else fwd._empty(B, T, HV, V, dtype=out_dtype,
                                                                                            device=dev)
    dH = fwd._empty(total_chunks, HV, K, V, dtype=out_dtype, device=dev)
    dh0 = fwd._empty(*((nseq, HV, V, K) if state_v_first else (nseq, HV, K, V)), dtype=torch.float32, device=dev)
    from . import gated_delta_rule_bwd_split_sm90 as sp

    split = (split_default(nseq, HV, V, dev) if split is None else bool(split)) and sp.serves(out_dtype, q.dtype)
    if profile is not None:
        need = nseq * HV * (V // VBLOCK) * (len(SWEEP_PHASES) + 1)
        if profile.dtype != torch.int64 or profile.device != dev or profile.numel() < need:
            raise ValueError(f"profile: int64 on {dev} with at least {need} elements")
        split = False
    from . import gated_delta_rule_bwd_ws_sm90 as WS

    ws = (WS.enabled() if ws is None else bool(ws)) and not split and profile is None
    if ws:
        fn = WS.get_kernel(q.dtype, K, V, use_qk_l2norm_in_kernel, varlen, dht is not None, state_v_first, out_dtype,
                           ws_tma)
    elif not split:
        vh_ok = wgs == 1 and V == 2 * VBLOCK
        if vh2 and not vh_ok:
            raise Unsupported(f"vh2 with wgs={wgs} at V={V} (one warpgroup a 64-column half, V = 128)")
        # the env switch never takes the profile variant (its phases are read per 64-column CTA)
        vh = 2 if vh_ok and (vh2 if vh2 is not None else profile is None and vh2_default(nseq * nseg, HV, V, dev)) else 1
        fn = get_dstate_kernel(q.dtype, K, V, use_qk_l2norm_in_kernel, varlen, dht is not None, state_v_first,
                               out_dtype, wgs, prefetch, profile is not None, early_qk, tma, vh, dh_tma, dvn_tma, nseg,
                               tw=beta is not None)
    if T == 0 or nseq == 0:
        if dht is None:
            dh0.zero_()
        else:
            dh0.copy_(dht)
        return dvn, dH, dh0
    if split:
        sp.sweep(q, k, w, gc, do, dht, dvn, dH, dh0, cu, cu_chunks, total_chunks, NT, scale,
                 use_qk_l2norm_in_kernel, state_v_first, HV // H, nseq)
        return dvn, dH, dh0
    # the specialized warpgroups take no profile and no beta
    tail = () if ws else (i64_dummy if profile is None else profile, gc if beta is None else beta)
    fn(q, k, w, gc, do, f32_dummy.view(1, 1, 1, 1) if dht is None else dht, dvn, dH, dh0, cu, cu_chunks,
       float(scale), T, NT, HV // H, nseq, *tail)
    return dvn, dH, dh0


# ------------------------------------------------------------------ the carried split (opt-in)


def carry_segments(nseq: int, HV: int, K: int, V: int, T: int, l2norm: bool, device) -> int:
    """``CUDNN_TRAIN_GDN_SWEEP_CARRY``: the reverse sweep's *carried* sequence split (built in the twenty-sixth
    session; its GPU cases passed in the twenty-seventh, where it was faster than the unsplit sweep at the
    benchmark's gates and slower at FLA's layer-init gates, so it stays opt-in): unset or 1, off; ``auto``, the count :func:`sweep_segments` would take
    (B1 T16384 H16 HV32: 4); 2 to 16 force it. No walk is longer than a segment whatever the gates
    (:func:`carried_sweep`). Only with l2norm and the prefetch, ``[K, V]`` states."""
    return cm.carry_segments("CUDNN_TRAIN_GDN_SWEEP_CARRY", nseq, HV, T, l2norm, device, HV, K, V)


def sweep_carries(q, k, w, gc, do, cu, cu_chunks, T, NT, scale, l2norm, group, nseq, nseg, cap, tma=None):
    """The sweep's prepare step: float32 ``[nseq * (nseg - 1), HV, K, V + K]``, row ``n * (nseg - 1) + s`` the carry
    into the end of segment s of sequence n from segment s + 1: columns below V its L (dH walked from zero with do
    over the start of segment s + 1), the K from V on its M (segment s + 1's K x K transition of dH, or zero where
    the boundary warms up within ``cap`` chunks)."""
    B, _, HV, V = do.shape
    K = q.shape[-1]
    vh = 2 if V == 2 * VBLOCK and K % (2 * VBLOCK) == 0 else 1  # the V + K columns in blocks dividing K
    fn = get_dstate_kernel(q.dtype, K, V, l2norm, NT == 0, False, False, q.dtype, 1, True, tma=tma, vh=vh,
                           nseg=nseg, prep_cap=cap)
    LM = fwd._empty(nseq * (nseg - 1), HV, K, V + K, dtype=torch.float32, device=q.device)
    f32_dummy, _, i64_dummy = fwd._dummies(q.device)
    rows = fwd._empty(1, 1, 1, V, dtype=q.dtype, device=q.device)  # dvn and dH: the prepare step writes neither
    fn(q, k, w, gc, do, f32_dummy.view(1, 1, 1, 1), rows, rows, LM, cu, cu_chunks, float(scale), T, NT, group, nseq,
       i64_dummy, gc)
    return LM


def carried_sweep(q, k, w, gc, do, dht, cu_seqlens, nseg, *, scale, use_qk_l2norm_in_kernel, out_dtype, tma=None,
                  cap=None):
    """The reverse sweep with each sequence cut into ``nseg`` segments (``CUDNN_TRAIN_GDN_SWEEP_CARRY``):
    :func:`sweep_carries` (a warm-up of at most ``cap`` chunks after each boundary, ``fwd_split.CARRY_CAP`` by
    default, or the next segment's dH from zero and its transition), :func:`cm.combine_carries` (reverse), then
    :func:`reverse_sweep` over the segments as sequences from their end gradients (``fwd_split.virtual_cu``: their
    chunk rows are the sequences' own, so dH needs no reordering). Returns ``(dvn, dH, dh0)`` as
    :func:`reverse_sweep` does."""
    from . import gated_delta_rule_fwd_split_sm90 as fsp

    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    nseq = B if cu_seqlens is None else cu_seqlens.numel() - 1
    cu, cu_chunks, total_chunks, NT = fwd.chunk_map(cu_seqlens, B, T, q.device)
    LM = sweep_carries(q, k, w, gc, do, cu, cu_chunks, T, NT, scale, use_qk_l2norm_in_kernel, HV // H, nseq, nseg,
                       fsp.CARRY_CAP if cap is None else cap, tma)
    ends = cm.combine_carries(LM, dht, nseq, nseg, V, reverse=True)
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, w, gc, do)]
    dvn, dH, dh0 = reverse_sweep(*flat, ends, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                 cu_seqlens=fsp.virtual_cu(cu_seqlens, B, T, nseg, q.device), out_dtype=out_dtype,
                                 tma=tma, nseg=1, carry=1)
    return dvn.view(B, T, HV, V), dH[:total_chunks], dh0.view(nseq, nseg, HV, K, V)[:, 0].contiguous()

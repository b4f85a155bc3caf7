"""The GDN backward's reverse state sweep split in two (SM90, CuTeDSL, WGMMA): a parallel kernel for
what does not depend on the state's gradient, then a short sequential chain. Same math as
``gated_delta_rule_bwd_sm90``'s ``dstate`` kernel (the notation of that module's docstring), for
the training path (dvn and the dH rows in the input dtype).

Kernel ``dvl`` (grid: chunk x HV, one warpgroup; every chunk independent)::

    dvl = P^T do                 [C, V] float32     P = scale tril(q k^T exp(gc_i - gc_j)) rq_i rk_j

(P as in the forward, in the input dtype in shared memory; A = P^T as an MN-major view of it.)

Kernel ``dchain`` (grid: N x HV x V/VB, one warpgroup, VB = 16, 32 or 64 columns of V: :func:`vblock`): walks the
chunks of one sequence from the last to the first with the block ``dH [K, VB]`` in float32
accumulators (M = the K rows, two M = 64 halves at K = 128), the transpose of the fused kernel's
``dH^T`` (whose M is the 64 columns of a V block, so that its grid is N x HV x V/64), and per chunk::

    dH (input dtype) -> smem -> global dH rows[chunk]                        (the chunk's dH, for stage 3)
    dvn = diag(exp(gc_C - gc) rk) (k dH) + dvl            WGMMA  M = 64 rows, N = VB, A = k, B = dH (smem)
    dH  = exp(gc_C) dH + q^T do_s - w^T dvn               WGMMA  A = q^T, w^T (MN-major halves), B = do_s, -dvn

with ``do_s = diag(scale exp(gc) rq) do`` (the fused kernel's row-scaled do). The next chunk's k, w,
q, do, gc arrive by ``cp.async`` while the current one is computed. With V blocks of 32 one long
sequence spreads over V/32 = 4 CTAs a value head (B1 T16384 HV32: 128 CTAs, where the fused kernel
has 64), and P, its exponentials and P^T do are off the chain. Rounding points as in the fused
kernel (dH and -dvn in the input dtype as operands, do_s rounded once); dvl adds to ``k dH`` in
float32 after the product instead of inside one accumulator, so results match the fused kernel's to
summation order, not bitwise. Writes dvn and the dH rows in the input dtype only (the float32
outputs of the fused kernel are not served: :func:`serves`), dh0 in float32 (either layout).

By default (:func:`dchain_tma`; since the sixteenth session, bitwise the cp.async loads, the split sweep 0.807
against 0.838 ms at B4 T4096 and 0.939 against 0.959 at B1 T16384; ``CUDNN_TRAIN_GDN_DCHAIN_TMA=0`` gives
cp.async back) ``dchain``'s k, q, w and do arrive by TMA, one elected thread of warp 0 issuing them on the buffer's mbarrier
(gc stays on cp.async); the first chunk taken has its rows past the end zeroed once landed: the same bits.

Status: its GPU cases (``tests/kernels/test_gated_delta_rule_bwd_sm90.py``, ``split``: dense T 1/65/300
at both V blocks, bf16 and fp16, varlen, GVA 4, K = 64, both state layouts, against the float32
reference and the fused kernel) pass on the H200. The sweep's default where the fused kernel's grid
leaves SMs idle (``gated_delta_rule_bwd_sm90.split_default``; ``CUDNN_TRAIN_GDN_SWEEP_SPLIT`` = 1 / 0
forces it). Measured (``tools/time_gdn_sweep.py --split-only``, H200, K = V = 128, bf16): B1 T16384
HV32 0.967 ms (VB 32) / 1.522 (VB 64) against 1.606 for the fused kernel; B4 T4096 HV32 0.956 / 0.855
against 0.626 (the fused kernel's 256 CTAs already fill the GPU).
"""

import torch

from . import compile as kc
from . import gated_delta_rule_common_sm90 as cm
from . import gated_delta_rule_fwd_sm90 as F
from . import gated_delta_rule_fwd_split_sm90 as FS

CHUNK = cm.CHUNK
THREADS = cm.THREADS
VBLOCKS = (16, 32, 64)
_SOURCES = (__file__, F.__file__, FS.__file__, cm.__file__)


def vblock(nseq: int, HV: int, V: int, device: torch.device, K: int = 128) -> int:
    """V columns per ``dchain`` CTA: 64 when N x HV x V/64 CTAs already give every SM one, else 32 when
    N x HV x V/32 do or K = 64, else 16 (at K = 128, where it was measured; K = 64 at 16 has run on no GPU).
    ``CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB`` overrides (16, 32 or 64; a bad value is a ValueError naming it).

    Measured (H200, K = V = 128, ``tools/time_gdn_sweep.py --split-only``, seventeenth session): B1 T16384 HV32
    (64 / 128 / 256 CTAs at VB 64 / 32 / 16) 1.442 / 0.931 / **0.886** ms; B4 T4096 HV32 **0.804** / 0.920 /
    1.157."""
    vb = cm.env_vblock("CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB", VBLOCKS, V)
    if vb is not None:
        return vb
    sms = kc.num_sms(device)
    if nseq * HV * (V // 64) >= sms:
        return 64
    return 32 if K != 128 or nseq * HV * (V // 32) >= sms else 16


def _static_checks(dtype, K: int, V: int, VB: int) -> None:
    cm.check_mn_major_view(dtype, K, VB)  # dH block: B operand of k dH
    cm.check_mn_major_view(dtype, CHUNK, VB)  # do_s and -dvn blocks: B operands of the update
    cm.check_mn_major_view(dtype, CHUNK, 64)  # q and w halves: MN-major A operands of the update
    cm.check_mn_major_view(dtype, CHUNK, CHUNK)  # P: MN-major A operand of P^T do
    cm.check_mn_major_view(dtype, CHUNK, V)  # do: B operand of P^T do


# ------------------------------------------------------------------ kernel: dvl


def _build_dvl(dtype, K: int, V: int, l2norm: bool, varlen: bool, P2: bool = False):
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import warpgroup

    C = CHUNK
    issue_rows = F.make_issue_tiles(dtype, C)
    issue_gc = F.make_issue_gc()
    gemm = cm.make_gemm()
    row_inv_norm = cm.make_row_inv_norm(dtype, K, F.L2NORM_EPS)
    store_p = cm.make_store_p(dtype, l2norm, P2)
    store_pairs = cm.make_store_pairs()
    locate = cm.make_chunk_locator(varlen)

    @cute.kernel
    def kernel(mQ: cute.Tensor, mK: cute.Tensor, mDO: cute.Tensor, mGc: cute.Tensor, mDvl: cute.Tensor,
               mCu: cute.Tensor, mCuC: cute.Tensor, scale: Float32, T: Int32, NT: Int32, nseq: Int32, group: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cid, hv, _ = cute.arch.block_idx()
        h = hv // group

        mma_p = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False)  # q k^T  [i, j]
        mma_l = cm.make_mma(dtype, V, a_regs=False, b_mn_major=True, a_mn_major=True)  # P^T do  [j, v]
        cm.check_acc_pairs(mma_l, (C, V))

        smem = cutlass.utils.SmemAllocator()
        sQ = cm.alloc_tile(smem, dtype, C, K)
        sK = cm.alloc_tile(smem, dtype, C, K)
        sDo = cm.alloc_tile(smem, dtype, C, V)
        sP = cm.alloc_tile(smem, dtype, C, C)
        sGc = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRq = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)

        b, t0, tend, valid = locate(cid, mCu, mCuC, T, NT, nseq)
        length = cutlass.min(tend - t0, C)
        if valid:
            issue_rows(((cute.domain_offset((t0, 0), mQ[b, None, h, None]), sQ, K, 0),
                        (cute.domain_offset((t0, 0), mK[b, None, h, None]), sK, K, 0),
                        (cute.domain_offset((t0, 0), mDO[b, None, hv, None]), sDo, V, 0)), length, tidx)
            issue_gc(mGc, sGc, b, hv, t0, length, tidx)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()

            thr_p = mma_p.get_slice(tidx)
            thr_l = mma_l.get_slice(tidx)
            accP = cute.make_rmem_tensor(thr_p.partition_shape_C((C, C)), Float32)
            gemm(mma_p, accP, mma_p.make_fragment_A(thr_p.partition_A(sQ)),
                 mma_p.make_fragment_B(thr_p.partition_B(sK)), True)
            warpgroup.commit_group()
            if cutlass.const_expr(l2norm):
                if tidx < C:
                    sRq[tidx] = row_inv_norm(sQ, tidx)
                else:
                    sRk[tidx - C] = row_inv_norm(sK, tidx - C)
            warpgroup.wait_group(0)
            if cutlass.const_expr(l2norm):
                cute.arch.sync_threads()  # sRq, sRk written
            store_p(accP, thr_p.partition_C(cute.make_identity_tensor((C, C))), sP, sGc, sRq, sRk, scale)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()  # P visible to the async proxy

            # ---- dvl = P^T do: A [M = j, K = i] the MN-major view of P [i, j]; B [N = v, K = i] of do [i, v]
            accL = cute.make_rmem_tensor(thr_l.partition_shape_C((C, V)), Float32)
            gemm(mma_l, accL, mma_l.make_fragment_A(thr_l.partition_A(cm.transpose_view(sP))),
                 mma_l.make_fragment_B(thr_l.partition_B(cm.transpose_view(sDo))), True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            store_pairs(accL, thr_l.partition_C(cute.make_identity_tensor((C, V))),
                        cute.domain_offset((t0, 0), mDvl[b, None, hv, None]), length)

    @cute.jit
    def host(mQ: cute.Tensor, mK: cute.Tensor, mDO: cute.Tensor, mGc: cute.Tensor, mDvl: cute.Tensor,
             mCu: cute.Tensor, mCuC: cute.Tensor, scale: Float32, T: Int32, NT: Int32, nseq: Int32, group: Int32,
             nchunks_grid: Int32, stream):
        _static_checks(dtype, K, V, 32)
        HV = mDO.shape[2]
        kernel(mQ, mK, mDO, mGc, mDvl, mCu, mCuC, scale, T, NT, nseq, group).launch(
            grid=[nchunks_grid, HV, 1], block=[THREADS, 1, 1], stream=stream
        )

    f = F._fakes()
    args = (
        f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, V), f.any3(Float32), f.rows4(Float32, V),
        f.vec(cutlass.Int32), f.vec(cutlass.Int32), Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1),
        f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


# ------------------------------------------------------------------ kernel: dchain


def _build_dchain(dtype, K: int, V: int, VB: int, l2norm: bool, varlen: bool, has_dht: bool, state_vk: bool,
                  tma: bool = False, dh_tma: bool = False, dvn_tma: bool = False):
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup

    C = CHUNK
    KH = K // 64  # M = 64 halves of the state's K rows
    LOG2E = cm.LOG2E
    issue_rows = F.make_issue_tiles(dtype, C)
    issue_gc = F.make_issue_gc()
    gemm = cm.make_gemm()
    sum_sq = FS._make_sum_sq(dtype, 64)
    row_inv_norm = cm.make_row_inv_norm(dtype, K, F.L2NORM_EPS)
    locate_seq = cm.make_seq_locator(varlen)
    load_block, store_block, block_to_tile, tile_to_rows = FS.make_block_io(dtype, K, VB)
    scale_rows = cm.make_scale_rows(dtype, VB, THREADS, l2norm)

    TX_BYTES = (3 * C * K + C * VB) * dtype.width // 8  # tma: k, q, w and do's columns of a chunk
    # dh_tma: the chunk's dH row leaves from sDH by one TMA store (warp 0) issued right after the top barrier, read
    # before the barrier after dvn (sDH is written again at the next chunk's top); dvn_tma: a full chunk's dvn goes
    # into its own tile sVo (4-byte pairs) and leaves by one TMA store issued after that barrier, read before the
    # next top barrier (the sequence's partial last chunk, the first taken, keeps the pair stores)

    def tma_chunk(ta, sQs, sK, sWs, sDo, bar, b, h, hv, t0, v0):
        # (tma, warp 0, while tracing) the chunk at row t0 on the mbarrier bar (cm.tma_load): k, q's and w's
        # 64-column halves (q and k at head h, w at value head hv) and do's columns v0 : v0 + VB
        aK, aQ, aW, aDo, tK, tQ, tW, tDo = ta
        jobs = [(aK, cm.token_box(tK, b, h, t0, 0, C, K), sK), (aDo, cm.token_box(tDo, b, hv, t0, v0, C, VB), sDo)]
        jobs += [(aQ, cm.token_box(tQ, b, h, t0, hf * 64, C, 64), sQs[hf]) for hf in range(KH)]
        jobs += [(aW, cm.token_box(tW, b, hv, t0, hf * 64, C, 64), sWs[hf]) for hf in range(KH)]
        cm.tma_load(jobs, bar, TX_BYTES)

    zero_tail = cm.make_zero_rows(dtype, THREADS)  # (tma) the first chunk taken's rows past its end
    init_barriers = cm.make_tma_init()

    @cute.jit
    def issue_chunk(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mDO: cute.Tensor, mGc: cute.Tensor,
                    sQs: cutlass.Constexpr, sK: cute.Tensor, sWs: cutlass.Constexpr, sDo: cute.Tensor,
                    sGc: cute.Tensor, b: Int32, h: Int32, hv: Int32, t0: Int32, v0: Int32, length: Int32,
                    tidx: Int32, ta: cutlass.Constexpr, bar):
        if cutlass.const_expr(tma):  # the tiles by TMA (warp 0), gc by cp.async (its rows are HV floats apart)
            issue_gc(mGc, sGc, b, hv, t0, length, tidx)
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                tma_chunk(ta, sQs, sK, sWs, sDo, bar, b, h, hv, t0, v0)
        else:
            issue_rows_of_chunk(mQ, mK, mW, mDO, mGc, sQs, sK, sWs, sDo, sGc, b, h, hv, t0, v0, length, tidx)

    @cute.jit
    def issue_rows_of_chunk(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mDO: cute.Tensor, mGc: cute.Tensor,
                            sQs: cutlass.Constexpr, sK: cute.Tensor, sWs: cutlass.Constexpr, sDo: cute.Tensor,
                            sGc: cute.Tensor, b: Int32, h: Int32, hv: Int32, t0: Int32, v0: Int32, length: Int32,
                            tidx: Int32):
        gQ = cute.domain_offset((t0, 0), mQ[b, None, h, None])
        gW = cute.domain_offset((t0, 0), mW[b, None, hv, None])
        tiles = [(cute.domain_offset((t0, 0), mK[b, None, h, None]), sK, K, 0),
                 (cute.domain_offset((t0, 0), mDO[b, None, hv, None]), sDo, VB, v0 // 8)]
        for hf in cutlass.range_constexpr(KH):
            tiles.append((gQ, sQs[hf], 64, hf * 8))
            tiles.append((gW, sWs[hf], 64, hf * 8))
        issue_rows(tuple(tiles), length, tidx)
        issue_gc(mGc, sGc, b, hv, t0, length, tidx)

    @cute.kernel
    def kernel(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mGc: cute.Tensor, mDO: cute.Tensor,
               mDvl: cute.Tensor, mDHT: cute.Tensor, mDVN: cute.Tensor, mDH: cute.Tensor, mDH0: cute.Tensor,
               mCu: cute.Tensor, mCuC: cute.Tensor, scale: Float32, T: Int32, NT: Int32, group: Int32,
               aK: cute.CopyAtom, aQ: cute.CopyAtom, aW: cute.CopyAtom, aDo: cute.CopyAtom, tK: cute.Tensor,
               tQ: cute.Tensor, tW: cute.Tensor, tDo: cute.Tensor, aDH: cute.CopyAtom, tDH: cute.Tensor,
               aDV: cute.CopyAtom, tDV: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        n, hv, vb = cute.arch.block_idx()
        warp0 = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        h = hv // group
        v0 = vb * VB

        mma_x = cm.make_mma(dtype, VB, a_regs=False, b_mn_major=True)  # k dH  [i, v]
        mma_up = cm.make_mma(dtype, VB, a_regs=False, b_mn_major=True, a_mn_major=True)  # dH [d, v] += X^T Y
        cm.check_acc_pairs(mma_x, (C, VB))
        cm.check_acc_pairs(mma_up, (64, VB))

        smem = cutlass.utils.SmemAllocator()
        sKb = [cm.alloc_tile(smem, dtype, C, K) for _ in range(2)]
        sQb = [[cm.alloc_tile(smem, dtype, C, 64) for _ in range(KH)] for _ in range(2)]
        sWb = [[cm.alloc_tile(smem, dtype, C, 64) for _ in range(KH)] for _ in range(2)]
        sDob = [cm.alloc_tile(smem, dtype, C, VB) for _ in range(2)]
        sDoS = cm.alloc_tile(smem, dtype, C, VB)
        sDH = cm.alloc_tile(smem, dtype, K, VB)
        sVn = cm.alloc_tile(smem, dtype, C, VB)  # -dvn
        if cutlass.const_expr(dvn_tma):  # a full chunk's dvn, for its TMA store
            sVo = cm.alloc_tile(smem, dtype, C, VB)
        sGcb = [smem.allocate_tensor(Float32, cute.make_layout(C), 16) for _ in range(2)]
        sRq = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)

        thr_x = mma_x.get_slice(tidx)
        thr_up = mma_up.get_slice(tidx)
        tAk = [mma_x.make_fragment_A(thr_x.partition_A(t)) for t in sKb]  # [M = i, K = d]
        tBdh = mma_x.make_fragment_B(thr_x.partition_B(cm.transpose_view(sDH)))  # [N = v, K = d]
        tAq = [[mma_up.make_fragment_A(thr_up.partition_A(cm.transpose_view(t))) for t in qs] for qs in sQb]
        tAw = [[mma_up.make_fragment_A(thr_up.partition_A(cm.transpose_view(t))) for t in ws] for ws in sWb]
        tBdos = mma_up.make_fragment_B(thr_up.partition_B(cm.transpose_view(sDoS)))  # [N = v, K = i]
        tBvn = mma_up.make_fragment_B(thr_up.partition_B(cm.transpose_view(sVn)))  # [N = v, K = i]
        cX = thr_x.partition_C(cute.make_identity_tensor((C, VB)))  # (i, v)
        cS = thr_up.partition_C(cute.make_identity_tensor((64, VB)))  # (d within the half, v)

        ta = (aK, aQ, aW, aDo, tK, tQ, tW, tDo)
        mbar = None
        if cutlass.const_expr(tma):  # one mbarrier a buffer: chunk cr in buffer cr % 2 completes its phase (cr // 2) % 2
            mbar = smem.allocate_array(cutlass.Int64, 2, byte_alignment=8)
            init_barriers(mbar, 2, (aK, aQ, aW, aDo), 0)

        b, ts, te, cbase, nchunks = locate_seq(n, mCu, mCuC, T, NT)

        # ---- dH [K, VB] (float32 accumulators): the final state's gradient, or zero
        accD = [cute.make_rmem_tensor(thr_up.partition_shape_C((64, VB)), Float32) for _ in range(KH)]
        if cutlass.const_expr(has_dht):
            load_block(accD, cS, mDHT, n, hv, v0, state_vk)
        else:
            for hf in cutlass.range_constexpr(KH):
                accD[hf].fill(0.0)

        if nchunks > 0:  # the sweep's first chunk: the sequence's last
            t1 = ts + (nchunks - 1) * C
            issue_chunk(mQ, mK, mW, mDO, mGc, sQb[0], sKb[0], sWb[0], sDob[0], sGcb[0], b, h, hv, t1, v0, te - t1,
                        tidx, ta, mbar)
        cute.arch.cp_async_commit_group()
        for cp in cutlass.range((nchunks + 1) // 2, unroll=1):
            for par in cutlass.range_constexpr(2):  # chunk cr in buffer par: every tile stays static
                cr = cp * 2 + par
                if cr < nchunks:
                    ci = nchunks - 1 - cr
                    t0 = ts + ci * C
                    length = cutlass.min(te - t0, C)
                    sGc = sGcb[par]
                    # ---- this chunk's dH (before its update) in the input dtype -> sDH
                    block_to_tile(accD, cS, sDH)
                    # dvl of this chunk into registers (rows past the chunk's end: zero), waited for later
                    gDvl = cute.domain_offset((t0, 0), mDvl[b, None, hv, None])
                    rL = cute.make_rmem_tensor(thr_x.partition_shape_C((C, VB)), Float32)
                    for e in cutlass.range_constexpr(cute.size(rL) // 2):
                        li, lv = cX[2 * e]
                        frag = cute.make_rmem_tensor((1, 2), Float32)
                        frag.fill(0.0)
                        if li < length:
                            cute.autovec_copy(cute.local_tile(gDvl, (1, 2), (li, (v0 + lv) // 2)), frag)
                        rL[2 * e] = frag[0]
                        rL[2 * e + 1] = frag[1]
                    if cutlass.const_expr(tma):
                        cute.arch.mbarrier_wait(mbar + par, cp % 2)
                        if length < C:  # only the first chunk taken, the sequence's last, is partial
                            zero_tail(sKb[par], K, length, tidx)
                            zero_tail(sDob[par], VB, length, tidx)
                            for hf in cutlass.range_constexpr(KH):
                                zero_tail(sQb[par][hf], 64, length, tidx)
                                zero_tail(sWb[par][hf], 64, length, tidx)
                    cute.arch.cp_async_wait_group(0)
                    if cutlass.const_expr(dvn_tma):  # chunk cr - 1's dvn store has read sVo
                        if warp0:
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()  # chunk cr and sDH in smem; every thread is done with chunk cr - 1
                    if cutlass.const_expr(dh_tma):  # sDH -> the chunk's dH row, one TMA store (warp 0)
                        if warp0:
                            cm.tma_store(aDH, cm.token_box(tDH, cbase + ci, hv, 0, v0, K, VB), sDH)
                    if cr + 1 < nchunks:  # chunk cr + 1 (the one before this) into the other buffers
                        t1 = t0 - C
                        issue_chunk(mQ, mK, mW, mDO, mGc, sQb[1 - par], sKb[1 - par], sWb[1 - par], sDob[1 - par],
                                    sGcb[1 - par], b, h, hv, t1, v0, C, tidx, ta,
                                    None if mbar is None else mbar + (1 - par))
                    cute.arch.cp_async_commit_group()

                    accX = cute.make_rmem_tensor(thr_x.partition_shape_C((C, VB)), Float32)
                    gemm(mma_x, accX, tAk[par], tBdh, True)  # k dH   [i, v]
                    warpgroup.commit_group()
                    # meanwhile: sDH -> the chunk's dH row (16-byte vectors, or the TMA store above), the row norms,
                    # the decay
                    if cutlass.const_expr(not dh_tma):
                        tile_to_rows(sDH, mDH[cbase + ci, hv, None, None], v0, tidx)
                    if cutlass.const_expr(l2norm):
                        if tidx < C:
                            ss = Float32(0.0)
                            for hf in cutlass.range_constexpr(KH):
                                ss = ss + sum_sq(sQb[par][hf], tidx)
                            sRq[tidx] = cute.math.rsqrt(ss + F.L2NORM_EPS)
                        else:
                            sRk[tidx - C] = row_inv_norm(sKb[par], tidx - C)
                    glast = sGc[C - 1]
                    decay = cute.math.exp2(glast * LOG2E, fastmath=True)
                    for hf in cutlass.range_constexpr(KH):
                        for e in cutlass.range_constexpr(cute.size(accD[hf])):
                            accD[hf][e] = accD[hf][e] * decay
                    cute.arch.sync_threads()  # sRq (and sRk) written
                    # do_s = diag(scale e^gc rq) do -> sDoS (B operand of the q term)
                    scale_rows(sDob[par], sDoS, sGc, sRq, scale, tidx)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()  # do_s visible to the async proxy
                    for hf in cutlass.range_constexpr(KH):
                        gemm(mma_up, accD[hf], tAq[par][hf], tBdos, False)  # dH += q^T do_s
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)  # k dH is done (the q term may still run)

                    # ---- dvn = diag(e^(gc_C - gc) rk) (k dH) + dvl: to global as is, -dvn to sVn
                    gVn = cute.domain_offset((t0, 0), mDVN[b, None, hv, None])
                    for e in cutlass.range_constexpr(cute.size(accX) // 2):
                        xi, xv = cX[2 * e]
                        coef = cute.math.exp2((glast - sGc[xi]) * LOG2E, fastmath=True)
                        if cutlass.const_expr(l2norm):
                            coef = coef * sRk[xi]
                        a0 = accX[2 * e] * coef + rL[2 * e]
                        a1 = accX[2 * e + 1] * coef + rL[2 * e + 1]
                        if cutlass.const_expr(dvn_tma):  # into sVo; a partial chunk's valid rows to global too
                            vpair = cute.make_rmem_tensor((1, 2), dtype)
                            vpair[0] = a0.to(dtype)
                            vpair[1] = a1.to(dtype)
                            cute.autovec_copy(vpair, cute.local_tile(sVo, (1, 2), (xi, xv // 2)))
                            if length < C:
                                if xi < length:
                                    cute.autovec_copy(vpair, cute.local_tile(gVn, (1, 2), (xi, (v0 + xv) // 2)))
                        elif xi < length:
                            vpair = cute.make_rmem_tensor((1, 2), dtype)
                            vpair[0] = a0.to(dtype)
                            vpair[1] = a1.to(dtype)
                            cute.autovec_copy(vpair, cute.local_tile(gVn, (1, 2), (xi, (v0 + xv) // 2)))
                        npair = cute.make_rmem_tensor((1, 2), dtype)
                        npair[0] = (-a0).to(dtype)
                        npair[1] = (-a1).to(dtype)
                        cute.autovec_copy(npair, cute.local_tile(sVn, (1, 2), (xi, xv // 2)))
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(dh_tma):  # the dH store has read sDH (written again at the next top)
                        if warp0:
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()  # -dvn (and dvn) visible to the async proxy
                    if cutlass.const_expr(dvn_tma):  # a full chunk's dvn rows, one TMA store (warp 0)
                        if warp0:
                            if length == C:
                                cm.tma_store(aDV, cm.token_box(tDV, b, hv, t0, v0, C, VB), sVo)

                    for hf in cutlass.range_constexpr(KH):
                        gemm(mma_up, accD[hf], tAw[par][hf], tBvn, False)  # dH -= w^T dvn
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)

        store_block(accD, cS, mDH0, n, hv, v0, state_vk)  # the initial state's gradient, float32
        if cutlass.const_expr(dh_tma or dvn_tma):  # every store done before the CTA's shared memory goes
            if warp0:
                cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def host(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mGc: cute.Tensor, mDO: cute.Tensor,
             mDvl: cute.Tensor, mDHT: cute.Tensor, mDVN: cute.Tensor, mDH: cute.Tensor, mDH0: cute.Tensor,
             mCu: cute.Tensor, mCuC: cute.Tensor, scale: Float32, T: Int32, NT: Int32, group: Int32, nseq: Int32,
             stream):
        _static_checks(dtype, K, V, VB)
        HV = mW.shape[2]
        atoms, tmas = cm.make_tma_rows_atoms(tma, dtype, ((mK, C, K), (mQ, C, 64), (mW, C, 64), (mDO, C, VB)))
        aDH, tDH = cm.make_tma_store(dh_tma, dtype, mDH, cm.STATE_ROWS, K, VB)
        aDV, tDV = cm.make_tma_store(dvn_tma, dtype, mDVN, cm.TOKEN_ROWS, C, VB)
        kernel(mQ, mK, mW, mGc, mDO, mDvl, mDHT, mDVN, mDH, mDH0, mCu, mCuC, scale, T, NT, group, *atoms,
               *tmas, aDH, tDH, aDV, tDV).launch(
            grid=[nseq, HV, V // VB], block=[THREADS, 1, 1], stream=stream,
            **(dict(preferred_smem_carveout=100) if dvn_tma else {}),  # VB 16: two CTAs an SM only at the whole
        )

    f = F._fakes()
    args = (
        f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, K), f.any3(Float32), f.rows4(dtype, V),
        f.rows4(Float32, V), f.state(), f.rows4(dtype, V), f.rows4(dtype, V), f.state(), f.vec(cutlass.Int32),
        f.vec(cutlass.Int32), Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(1), f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


# ------------------------------------------------------------------ compile (cached) and launch


def dvl_p_two_pass() -> bool:
    """``CUDNN_TRAIN_GDN_DVL_P2=1``: ``dvl`` builds P in two passes (``make_store_p(two_pass=True)``: a
    thread reads its rows' and columns' factors once, not once an element: 52 shared loads in the
    kernel's PTX against 152, 94 registers either way, no spills; the same bits: GPU cases passed, outputs
    bitwise equal in the timing tool). The default since the thirteenth session (H200, the split sweep at B1
    T16384 H16 HV32: 0.957 ms against 0.973; B4 0.839 against 0.850); ``=0``: the one pass. (The fused sweep
    and the forward's state kernel, at 255 registers, spill with it, so they keep the one pass.)"""
    return cm.env_switch("CUDNN_TRAIN_GDN_DVL_P2", True)


def get_dvl_kernel(dtype, K, V, l2norm, varlen, p2=None):
    p2 = dvl_p_two_pass() if p2 is None else bool(p2)
    key = ("dvl", str(dtype), K, V, bool(l2norm), bool(varlen)) + (("p2",) if p2 else ())

    def build():
        return _build_dvl(F._dt(dtype), K, V, l2norm, varlen, p2)

    return kc.get_kernel("gdn_bwd_dvl", key, build, _SOURCES)


def dchain_tma() -> bool:
    """``CUDNN_TRAIN_GDN_DCHAIN_TMA`` (on unless 0): ``dchain`` loads each chunk's k, q, w and do by TMA (one
    elected thread of warp 0 on the buffer's mbarrier; gc stays on cp.async) instead of 128 threads issuing about
    26 ``cp.async`` each a chunk on the one warpgroup that also runs the chain (the forward's state pass stalled
    half its chain's cycles issuing them). The first chunk taken, a sequence's last, has its rows past the end
    zeroed once landed, as cp.async zero-fills them: the same bits. Measured (sixteenth session): the split sweep
    0.939 against 0.959 ms at B1 T16384 H16 HV32."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHAIN_TMA", True)


def dchain_store_tma() -> bool:
    """``CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA`` (on unless ``=0``; prepared in the twenty-second session, GPU-run and made
    the default in the twenty-third: the split sweep 0.888 / 0.890 ms against 0.945 / 0.946 at B1 T16384 on an H100,
    outputs bitwise the element stores'): ``dchain``'s
    stores the way the forward's chain makes them since that session (``fwd_split.chain_hs_tma`` /
    ``chain_vn_tma``, measured there: the chain 0.333 -> 0.310 ms at VB 64, 0.470 -> 0.357 at VB 32, bitwise): each
    chunk's dH row leaves its shared tile sDH by one TMA store (warp 0, right after the top barrier; waited for to
    have read sDH before the barrier after dvn) instead of 16-byte rows copied by 128 threads, and a full chunk's
    dvn goes as 4-byte pairs into a tile of its own and leaves by one TMA store after that barrier (read before the
    next top barrier) instead of scattered 4-byte global stores on the chain's critical path; the sequence's partial
    last chunk (the first taken) keeps the pair stores. The same bytes."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA", True)


def get_dchain_kernel(dtype, K, V, VB, l2norm, varlen, has_dht, state_vk, tma=None, store_tma=None):
    if VB not in VBLOCKS or V % VB:
        raise ValueError(f"VB={VB}: expected one of {VBLOCKS} dividing V={V}")
    tma = dchain_tma() if tma is None else bool(tma)
    store_tma = dchain_store_tma() if store_tma is None else bool(store_tma)
    key = ("dchain", str(dtype), K, V, VB, bool(l2norm), bool(varlen), bool(has_dht), bool(state_vk)) + (
        ("tma",) if tma else ()) + (("store_tma",) if store_tma else ())

    def build():
        return _build_dchain(F._dt(dtype), K, V, VB, l2norm, varlen, has_dht, state_vk, tma, store_tma, store_tma)

    return kc.get_kernel("gdn_bwd_dchain", key, build, _SOURCES)


def serves(out_dtype, dtype) -> bool:
    """The split sweep writes dvn and the dH rows in the input dtype only (the training path's)."""
    return out_dtype == dtype


def sweep(q, k, w, gc, do, dht, dvn, dH, dh0, cu, cu_chunks, rows, NT, scale, l2norm, state_vk, group, nseq,
          vb=None, tma=None):
    """Run ``dvl`` then ``dchain``: fills ``dvn``, ``dH`` (input dtype) and ``dh0`` (float32), as the
    fused kernel does. ``dht``: the final state's gradient (float32) or None."""
    B, T, HV, V = do.shape
    K = q.shape[-1]
    varlen = NT == 0
    vb = vblock(nseq, HV, V, q.device, K) if vb is None else vb
    dvl_k = get_dvl_kernel(q.dtype, K, V, l2norm, varlen)
    chain = get_dchain_kernel(q.dtype, K, V, vb, l2norm, varlen, dht is not None, state_vk, tma)
    dvl = F._empty(B, T, HV, V, dtype=torch.float32, device=q.device)  # rows the chain reads are all written
    f32_dummy, _, _ = F._dummies(q.device)
    d4 = f32_dummy.view(1, 1, 1, 1)
    dvl_k(q, k, do, gc, dvl, cu, cu_chunks, float(scale), T, NT, nseq, group, rows)
    chain(q, k, w, gc, do, dvl, d4 if dht is None else dht, dvn, dH, dh0, cu, cu_chunks, float(scale), T, NT, group,
          nseq)

"""The GDN reverse state sweep on two specialized warpgroups (SM90, CuTeDSL, WGMMA).

Same math and notation as ``gated_delta_rule_bwd_sm90``'s ``dstate`` kernel (its oracle is the same
``reverse_sweep_ref``); one CTA per (sequence, value head, 64 columns of V), 256 threads, walking the
chunks from the last to the first:

* warpgroup 1, the **aux**, does everything of a chunk that does not depend on dH, one chunk *ahead*
  of the chain: the l2norm factors, ``do_s = do diag(scale e^gc rq)`` (into shared memory), P (as in the
  forward) and ``Y = do^T P`` (float32, into shared memory);
* warpgroup 0, the **chain**, carries ``dH^T [v, d]`` in float32 accumulators and per chunk does only
  what depends on it::

      dvn^T = (dH^T k^T) diag(e^(gc_C - gc) rk) + Y                              [v, i]
      dH^T <- e^(gc_C) dH^T + do_s^T q - dvn^T w                                 [v, d]

  storing the chunk's dH rows (before the update) and dvn as the fused kernel does.

One CTA barrier an iteration hands the aux's chunk to the chain. A chunk's q, k, w and gc live three
iterations (loaded, the aux's, the chain's), so they have three buffers; do, do_s, Y and the k factors
two; the loop is unrolled six times so every buffer index stays static. About 221 KB of shared memory, one
CTA an SM. Numerics: dvn's two terms are summed in float32 by the chain (the fused kernel lets the
``do^T P`` product accumulate onto the scaled ``dH^T k^T``), so results differ from it in the last bits.

With ``tma`` (``CUDNN_TRAIN_GDN_SWEEP_WS_TMA=1``, :func:`tma_enabled`) q, k, w and do arrive by TMA: one elected
thread of the aux's first warp issues a chunk's four tiles on the chunk's mbarrier (chunk cr on barrier cr % 6,
completing its phase (cr // 6) % 2), gc stays on cp.async (its rows are HV floats apart); the first chunk taken
(a sequence's last, the only partial one) has its rows past the end zeroed once landed, as cp.async zero-fills
them: the same bits. ptxas: 167 registers, no spill (174 with cp.async).

Status: prepared on the CPU machine (compiles for sm_90a), not yet run on a GPU: off unless
``CUDNN_TRAIN_GDN_SWEEP_WS=1`` (``gated_delta_rule_bwd_sm90.reverse_sweep``, where the fused kernel would
serve at K = 128); its TMA loads likewise.
"""

import torch

from . import compile as kc
from . import gated_delta_rule_common_sm90 as cm
from . import gated_delta_rule_fwd_sm90 as fwd

CHUNK = cm.CHUNK
VB = fwd.VBLOCK
THREADS = 256
BAR_ITER = 1  # the whole CTA, once an iteration
BAR_AUX = 2  # warpgroup 1
Y_STRIDE = CHUNK + 4  # float32 rows of Y: 8-byte pairs, rows 16 bytes apart in bank terms
_SOURCES = (__file__, fwd.__file__, cm.__file__)


def tma_enabled() -> bool:
    """``CUDNN_TRAIN_GDN_SWEEP_WS_TMA=1``: with this kernel, q, k, w and do by TMA (one elected thread of the
    aux's first warp issues a chunk's four tiles on the chunk's mbarrier; gc stays on cp.async, its rows HV
    floats apart), so the chain no longer spends issue slots on the next chunk's 16-byte copies (the forward's
    state pass, the same structure, stalled half its chain's cycles issuing them). Prepared in the fifteenth
    session; its GPU cases (bitwise the cp.async loads) passed in the sixteenth, not yet timed: off, as this
    kernel is."""
    return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_WS_TMA", False)


def enabled() -> bool:
    """``CUDNN_TRAIN_GDN_SWEEP_WS=1``: the fused reverse sweep on two specialized warpgroups."""
    return cm.env_switch("CUDNN_TRAIN_GDN_SWEEP_WS", False)


def _build(dtype, K: int, V: int, l2norm: bool, varlen: bool, has_dht: bool, state_vk: bool, odt, tma: bool = False):
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup

    C = CHUNK
    LOG2E = cm.LOG2E
    issue_qk, issue_wdg = fwd.make_issue_parts(dtype, K, VB, THREADS)
    gemm = cm.make_gemm()
    rows_inv_norm = cm.make_rows_inv_norm(dtype, K, fwd.L2NORM_EPS, 128)
    start_state, store_state = cm.make_state_io()
    store_p = cm.make_store_p(dtype, l2norm)
    scale_rows = cm.make_scale_rows(dtype, VB, 128, l2norm)
    locate_seq = cm.make_seq_locator(varlen)
    issue_gc = fwd.make_issue_gc()
    TMA_WARP = 4  # tma: the aux's first warp issues the copies (one elected thread arms the chunk's mbarrier)
    TX_BYTES = (3 * C * K + C * VB) * dtype.width // 8  # q, k, w, do of a chunk

    zero_tail = cm.make_zero_rows(dtype, THREADS)  # (tma) the first chunk taken's rows past its end
    init_barriers = cm.make_tma_init()

    def tma_chunk(ta, sQ, sK, sW, sDo, bar, b, h, hv, t0, v0):
        # (tma, warp TMA_WARP, while tracing) the chunk at row t0: q, k (head h), w and do's columns v0 : v0 + VB
        # (value head hv) on the mbarrier bar (cm.tma_load)
        aQ, aK, aW, aDo, tQ, tK, tW, tDo = ta
        cm.tma_load([(aQ, cm.token_box(tQ, b, h, t0, 0, C, K), sQ), (aK, cm.token_box(tK, b, h, t0, 0, C, K), sK),
                     (aW, cm.token_box(tW, b, hv, t0, 0, C, K), sW),
                     (aDo, cm.token_box(tDo, b, hv, t0, v0, C, VB), sDo)], bar, TX_BYTES)

    @cute.jit
    def issue_chunk(gm: cutlass.Constexpr, sb: cutlass.Constexpr, nb3: cutlass.Constexpr, nb2: cutlass.Constexpr,
                    b: Int32, h: Int32, hv: Int32, t1: Int32, v0: Int32, length: Int32, tidx: Int32,
                    ta: cutlass.Constexpr, bar):
        """The chunk at row t1 into buffers nb3 (q, k, w, gc) and nb2 (do): by cp.async, or with ``tma`` the
        tiles by TMA on ``bar`` (warp TMA_WARP) and gc by cp.async. The caller commits the cp.async group."""
        mQ, mK, mW, mDO, mGc = gm
        sQ, sK, sW, sGc = (x[nb3] for x in (sb[0], sb[1], sb[2], sb[4]))
        sDo = sb[3][nb2]
        if cutlass.const_expr(tma):
            issue_gc(mGc, sGc, b, hv, t1, length, tidx)
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == TMA_WARP:
                tma_chunk(ta, sQ, sK, sW, sDo, bar, b, h, hv, t1, v0)
        else:
            issue_qk(mQ, mK, sQ, sK, b, h, t1, length, tidx)
            issue_wdg(mW, mDO, mGc, sW, sDo, sGc, b, hv, t1, v0, length, tidx)

    @cute.jit
    def handover(gm: cutlass.Constexpr, sb: cutlass.Constexpr, p6: cutlass.Constexpr, b: Int32, h: Int32, hv: Int32,
                 ts: Int32, te: Int32, nchunks: Int32, it: Int32, v0: Int32, tidx: Int32, ta: cutlass.Constexpr, mbar):
        """The top of iteration ``it`` (``p6`` = it % 6), both warpgroups: this thread's copies of chunk it have
        landed (with ``tma`` its tiles on mbarrier it % 6, phase (it // 6) % 2; the first taken, the sequence's last
        chunk, has its rows past the end zeroed), the CTA barrier, then the copies of the chunk the aux takes next
        (the one before it in the sequence) into its buffers, the cp.async ones committed as one group. ``gm``: q,
        k, w, do, gc; ``sb``: their buffer lists."""
        if cutlass.const_expr(tma):
            if it < nchunks:
                cute.arch.mbarrier_wait(mbar + p6, (it // 6) % 2)
                if it == 0:
                    length = te - (ts + (nchunks - 1) * C)
                    if length < C:
                        for x in (sb[0][0], sb[1][0], sb[2][0]):
                            zero_tail(x, K, length, tidx)
                        zero_tail(sb[3][0], VB, length, tidx)
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_ITER, number_of_threads=THREADS)
        if it + 1 < nchunks:
            t1 = ts + (nchunks - 2 - it) * C  # only the sequence's last chunk (the first taken) can be partial
            issue_chunk(gm, sb, (p6 + 1) % 3, (p6 + 1) % 2, b, h, hv, t1, v0, C, tidx, ta,
                        None if mbar is None else mbar + (p6 + 1) % 6)
        cute.arch.cp_async_commit_group()

    @cute.kernel
    def kernel(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mGc: cute.Tensor, mDO: cute.Tensor,
               mDHT: cute.Tensor, mDVN: cute.Tensor, mDH: cute.Tensor, mDH0: cute.Tensor, mCu: cute.Tensor,
               mCuC: cute.Tensor, scale: Float32, T: Int32, NT: Int32, group: Int32, aQ: cute.CopyAtom,
               aK: cute.CopyAtom, aW: cute.CopyAtom, aDo: cute.CopyAtom, tQ: cute.Tensor, tK: cute.Tensor,
               tW: cute.Tensor, tDo: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        n, hv, vb = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        lt = tidx % 128
        h = hv // group
        v0 = vb * VB

        # the chain: the fused sweep's one-warpgroup products
        mma_x = cm.make_mma(dtype, C, a_regs=True, b_mn_major=False)  # dH^T k^T     [v, i]
        mma_q = cm.make_mma(dtype, K, a_regs=False, b_mn_major=True, a_mn_major=True)  # do_s^T q  [v, d]
        mma_s = cm.make_mma(dtype, K, a_regs=True, b_mn_major=True)  # dvn^T w      [v, d]
        map_s = cm.acc_to_frag_map(mma_s, (VB, K), mma_x, (VB, K))
        map_vd = cm.acc_to_frag_map(mma_x, (VB, C), mma_s, (VB, C))
        cm.check_same_acc_layout(mma_s, mma_q, (VB, K))
        # the aux
        mma_p = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False)  # q k^T        [i, j]
        mma_t = cm.make_mma(dtype, C, a_regs=False, b_mn_major=True, a_mn_major=True)  # do^T P  [v, j]
        cm.check_acc_pairs(mma_t, (VB, C))
        cm.check_acc_pairs(mma_x, (VB, C))

        smem = cutlass.utils.SmemAllocator()
        sQb = [cm.alloc_tile(smem, dtype, C, K) for _ in range(3)]
        sKb = [cm.alloc_tile(smem, dtype, C, K) for _ in range(3)]
        sWb = [cm.alloc_tile(smem, dtype, C, K) for _ in range(3)]
        sDob = [cm.alloc_tile(smem, dtype, C, VB) for _ in range(2)]
        sDoSb = [cm.alloc_tile(smem, dtype, C, VB) for _ in range(2)]
        sP = cm.alloc_tile(smem, dtype, C, C)
        sYb = [smem.allocate_tensor(Float32, cute.make_layout((VB, C), stride=(Y_STRIDE, 1)), 16) for _ in range(2)]
        sGcb = [smem.allocate_tensor(Float32, cute.make_layout(C), 16) for _ in range(3)]
        sRkb = [smem.allocate_tensor(Float32, cute.make_layout(C), 16) for _ in range(2)]
        sRq = smem.allocate_tensor(Float32, cute.make_layout(C), 16)

        ta = (aQ, aK, aW, aDo, tQ, tK, tW, tDo)
        mbar = None
        if cutlass.const_expr(tma):  # one mbarrier a chunk slot: chunk cr on cr % 6, completing phase (cr // 6) % 2
            mbar = smem.allocate_array(cutlass.Int64, 6, byte_alignment=8)
            init_barriers(mbar, 6, (aQ, aK, aW, aDo), TMA_WARP)

        b, ts, te, cbase, nchunks = locate_seq(n, mCu, mCuC, T, NT)
        niter = nchunks + cutlass.min(nchunks, 1)  # the chain takes chunk cr in iteration cr + 1
        gm = (mQ, mK, mW, mDO, mGc)
        sb = (sQb, sKb, sWb, sDob, sGcb)

        if nchunks > 0:  # the sequence's last chunk, the first taken (cr = 0)
            t1 = ts + (nchunks - 1) * C
            issue_chunk(gm, sb, 0, 0, b, h, hv, t1, v0, te - t1, tidx, ta, mbar)
        cute.arch.cp_async_commit_group()

        if wg == 0:
            # ---------------------------------------------------------------- the chain
            thr_x = mma_x.get_slice(lt)
            thr_q = mma_q.get_slice(lt)
            thr_s = mma_s.get_slice(lt)
            tBkx = [mma_x.make_fragment_B(thr_x.partition_B(t)) for t in sKb]  # [N = i, K = d]
            tAdos = [mma_q.make_fragment_A(thr_q.partition_A(cm.transpose_view(t))) for t in sDoSb]  # [v, i]
            tBqt = [mma_q.make_fragment_B(thr_q.partition_B(cm.transpose_view(t))) for t in sQb]  # [N = d, K = i]
            tBwt = [mma_s.make_fragment_B(thr_s.partition_B(cm.transpose_view(t))) for t in sWb]  # [N = d, K = i]
            rD = mma_x.make_fragment_A(thr_x.partition_shape_A((VB, K)))
            rVd = mma_s.make_fragment_A(thr_s.partition_shape_A((VB, C)))
            cS = thr_s.partition_C(cute.make_identity_tensor((VB, K)))  # (v, d)
            cX = thr_x.partition_C(cute.make_identity_tensor((VB, C)))  # (v, i)
            accD = cute.make_rmem_tensor(thr_s.partition_shape_C((VB, K)), Float32)
            start_state(accD, cS, mDHT, n, hv, v0, state_vk, has_dht)
            for cp in cutlass.range((niter + 5) // 6, unroll=1):
                for p6 in cutlass.range_constexpr(6):  # chunk cr in buffers cr % 3 and cr % 2: all static
                    it = cp * 6 + p6
                    if it < niter:
                        handover(gm, sb, p6, b, h, hv, ts, te, nchunks, it, v0, tidx, ta, mbar)
                        if it > 0:
                            b3 = (p6 + 2) % 3  # chunk cr = it - 1
                            b2 = (p6 + 1) % 2
                            ci = nchunks - it
                            t0 = ts + ci * C
                            length = cutlass.min(te - t0, C)
                            for f in cutlass.range_constexpr(cute.size(rD)):
                                rD[f] = accD[map_s[f]].to(dtype)
                            store_state(accD, cS, mDH, cbase + ci, hv, v0, False)  # dH before the update
                            glast = sGcb[b3][C - 1]
                            decay = cute.math.exp2(glast * LOG2E, fastmath=True)
                            for e in cutlass.range_constexpr(cute.size(accD)):
                                accD[e] = accD[e] * decay
                            accX = cute.make_rmem_tensor(thr_x.partition_shape_C((VB, C)), Float32)
                            gemm(mma_x, accX, rD, tBkx[b3], True)  # dH^T k^T  [v, i]
                            gemm(mma_q, accD, tAdos[b2], tBqt[b3], False)  # dH^T += do_s^T q
                            warpgroup.commit_group()
                            warpgroup.wait_group(0)
                            # ---- dvn^T = (dH^T k^T) diag(e^(gc_C - gc) rk) + Y
                            for e in cutlass.range_constexpr(cute.size(accX)):
                                xv, xi = cX[e]
                                dcoef = cute.math.exp2((glast - sGcb[b3][xi]) * LOG2E, fastmath=True)
                                if cutlass.const_expr(l2norm):
                                    dcoef = dcoef * sRkb[b2][xi]
                                accX[e] = accX[e] * dcoef + sYb[b2][xv, xi]
                            for e in cutlass.range_constexpr(cute.size(accX)):
                                xv, xi = cX[e]
                                if xi < length:
                                    mDVN[b, t0 + xi, hv, v0 + xv] = accX[e].to(odt)
                            for f in cutlass.range_constexpr(cute.size(rVd)):
                                rVd[f] = (-accX[map_vd[f]]).to(dtype)
                            gemm(mma_s, accD, rVd, tBwt[b3], False)  # dH^T -= dvn^T w
                            warpgroup.commit_group()
                            warpgroup.wait_group(0)
            store_state(accD, cS, mDH0, n, hv, v0, state_vk)
        else:
            # ---------------------------------------------------------------- the aux
            thr_p = mma_p.get_slice(lt)
            thr_t = mma_t.get_slice(lt)
            tAq = [mma_p.make_fragment_A(thr_p.partition_A(t)) for t in sQb]
            tBk = [mma_p.make_fragment_B(thr_p.partition_B(t)) for t in sKb]
            tAdo = [mma_t.make_fragment_A(thr_t.partition_A(cm.transpose_view(t))) for t in sDob]  # [M = v, K = i]
            tBpt = mma_t.make_fragment_B(thr_t.partition_B(cm.transpose_view(sP)))  # [N = j, K = i]
            cP = thr_p.partition_C(cute.make_identity_tensor((C, C)))  # (i, j)
            cT = thr_t.partition_C(cute.make_identity_tensor((VB, C)))  # (v, j)
            for cp in cutlass.range((niter + 5) // 6, unroll=1):
                for p6 in cutlass.range_constexpr(6):
                    it = cp * 6 + p6
                    if it < niter:
                        handover(gm, sb, p6, b, h, hv, ts, te, nchunks, it, v0, tidx, ta, mbar)
                        if it < nchunks:
                            b3 = p6 % 3  # chunk cr = it
                            b2 = p6 % 2
                            accP = cute.make_rmem_tensor(thr_p.partition_shape_C((C, C)), Float32)
                            gemm(mma_p, accP, tAq[b3], tBk[b3], True)  # q k^T  [i, j]
                            warpgroup.commit_group()
                            if cutlass.const_expr(l2norm):
                                rows_inv_norm(sQb[b3], sRq, lt)
                                rows_inv_norm(sKb[b3], sRkb[b2], lt)
                            warpgroup.wait_group(0)
                            cute.arch.barrier(barrier_id=BAR_AUX, number_of_threads=128)  # sRq, sRk written
                            # do_s = do diag(scale e^gc rq): the A operand of the chain's q term, next iteration
                            scale_rows(sDob[b2], sDoSb[b2], sGcb[b3], sRq, scale, lt)
                            # P = scale tril(q k^T exp(gc_i - gc_j)) rq_i rk_j -> smem, as in the forward
                            store_p(accP, cP, sP, sGcb[b3], sRq, sRkb[b2], scale)
                            cute.arch.fence_view_async_shared()
                            cute.arch.barrier(barrier_id=BAR_AUX, number_of_threads=128)  # P visible to the async proxy
                            accY = cute.make_rmem_tensor(thr_t.partition_shape_C((VB, C)), Float32)
                            gemm(mma_t, accY, tAdo[b2], tBpt, True)  # Y = do^T P  [v, j]
                            warpgroup.commit_group()
                            warpgroup.wait_group(0)
                            for e in cutlass.range_constexpr(cute.size(accY) // 2):
                                yv, yj = cT[2 * e]
                                pair = cute.make_rmem_tensor((1, 2), Float32)
                                pair[0] = accY[2 * e]
                                pair[1] = accY[2 * e + 1]
                                cute.autovec_copy(pair, cute.local_tile(sYb[b2], (1, 2), (yv, yj // 2)))

    @cute.jit
    def host(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mGc: cute.Tensor, mDO: cute.Tensor,
             mDHT: cute.Tensor, mDVN: cute.Tensor, mDH: cute.Tensor, mDH0: cute.Tensor, mCu: cute.Tensor,
             mCuC: cute.Tensor, scale: Float32, T: Int32, NT: Int32, group: Int32, nseq: Int32, stream):
        cm.check_mn_major_view(dtype, C, K)
        cm.check_mn_major_view(dtype, C, C)
        cm.check_mn_major_view(dtype, C, VB)
        HV = mW.shape[2]
        atoms, tmas = cm.make_tma_rows_atoms(tma, dtype, ((mQ, C, K), (mK, C, K), (mW, C, K), (mDO, C, VB)))
        kernel(mQ, mK, mW, mGc, mDO, mDHT, mDVN, mDH, mDH0, mCu, mCuC, scale, T, NT, group, *atoms, *tmas).launch(
            grid=[nseq, HV, V // VB], block=[THREADS, 1, 1], stream=stream,
        )

    f = fwd._fakes()
    args = (
        f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, K), f.any3(Float32), f.rows4(dtype, V), f.state(),
        f.rows4(odt, V), f.state(odt), f.state(), f.vec(cutlass.Int32), f.vec(cutlass.Int32),
        Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(1), f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


def get_kernel(dtype, K, V, l2norm, varlen, has_dht, state_vk, out_dtype=torch.float32, tma=None):
    if K not in fwd.HEAD_DIMS or V not in fwd.HEAD_DIMS:
        raise ValueError(f"K={K}, V={V}: expected each in {fwd.HEAD_DIMS}")
    tma = tma_enabled() if tma is None else bool(tma)
    key = ("sweep_ws", str(dtype), K, V, bool(l2norm), bool(varlen), bool(has_dht), bool(state_vk),
           str(out_dtype)) + (("tma",) if tma else ())

    def build():
        return _build(fwd._dt(dtype), K, V, l2norm, varlen, has_dht, state_vk, fwd._dt(out_dtype), tma)

    return kc.get_kernel("gdn_bwd_sweep_ws", key, build, _SOURCES)

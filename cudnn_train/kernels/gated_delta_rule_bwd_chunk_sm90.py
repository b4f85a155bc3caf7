"""Chunked Gated DeltaNet backward for SM90 (CuTeDSL, WGMMA): the per-chunk gradients (stage 3).

``fused/delta_rule_bwd.py:chunk_grads`` is this kernel's oracle. Grid: chunk x HV, every chunk
independent; two warpgroups per CTA (:func:`warpgroups`; four can be asked for at K = V = 128)
split the N of every product (each computes its columns from the whole A and its slice of B; at
four, and at K = 64 on two, the tiles are swizzled in 64-byte atoms so that a warpgroup's slice of
an MN-major view starts on one), and the row sums go through one buffer per warpgroup, summed in
a fixed order. The kernel is latency-bound (a long chain of dependent
MMA, CUDA-core and barrier steps for each chunk, one CTA per SM for its 204 KB of shared
memory): more warps on the same chain, and the end's dg pair sums and reverse cumulative sum
spread over every thread and one warp's shuffles instead of 64 threads and one, made it faster
(H200, B4 T4096 H16 HV32: 4.62 ms on one warpgroup; 2.14 / 1.69 ms on two / four with the serial
end; 1.60 / 1.73 ms with the parallel one). Inputs are the op's *prepared* tensors (q, k
l2-normalized, in the input dtype, at their own heads: value head hv reads head hv // group;
the effective log decay's in-chunk cumulative sum gc, the effective beta), the state entering
the chunk (``Sc``, from the forward) and the reverse sweep's ``dH`` (gradient of the state
leaving the chunk) and ``dvn``, all three in the input dtype. With
``E_ij = exp(gc_i - gc_j)`` (j <= i), ``Es`` its strictly lower part, ``eg = exp(gc)``,
``kd = k exp(gc_C - gc)``, per chunk::

    Ae = (k k^T) * Es               A = diag(beta) Ae            Tm = (I + A)^-1
    vn = Tm (diag(beta) v - diag(beta eg) k Sc)                  P  = scale (q k^T) * E
    dP = do vn^T        dQK = scale dP * E
    dq = scale diag(eg) do Sc^T + dQK k
    dw = -dvn Sc^T      dkb = Tm^T dw      dvb = Tm^T dvn
    dTm = (dw k^T) diag(beta eg) + (dvn v^T) diag(beta)
    dA = -strictly_lower(Tm^T dTm Tm^T)         dKK = diag(beta) dA * Es
    dk = diag(kdec) vn dH^T + dQK^T q + diag(beta eg) dkb + (dKK + dKK^T) k
    dv = diag(beta) dvb
    dbeta = rowsum(eg k * dkb) + rowsum(v * dvb) + rowsum(dA * Ae)
    dgc = rowsum(scale eg q * dqg) + beta eg rowsum(k * dkb) + pairs(dP * P + dA * A) - kdt
          (+ sum(kdt) + exp(gc_C) sum(Sc * dH) on the last row),  dg = reverse cumsum of dgc

(``dqg = do Sc^T``, ``kdt = rowsum(kd * (vn dH^T))``, ``pairs(t)_i = sum_j t_ij - sum_j t_ji``).
Seventeen 64-row WGMMAs; operands in shared memory in the input dtype (Sc, dH and dvn come
rounded to it once, as FLA's backward holds them; the tail's ``sum(Sc * dH)`` is summed in
float32 from those values while dH replaces Sc in its tile); the triangular inverse
in float32 on CUDA cores (the forward's ``solve``); row sums by quad shuffles
(:func:`common.quad_row_groups`); no atomics (deterministic). With ``l2norm`` q and k arrive as
the op got them: their rows are normalized in shared memory (factors ``r``, rounded once to the
input dtype, as the operands) and dq, dk leave as the gradients before the l2norm,
``r (dy - y rowsum(y * dy))``. Writes float32 dq, dk ``[B, T, HV, K]`` (per value head), dv
``[B, T, HV, V]`` in the input dtype, float32 dg, dbeta ``[B, T, HV]``; the caller sums dq/dk over
a GVA group and runs the rest of the preprocessing's backward (gate, beta sigmoid). For groups of two
value heads (the training path's default) (``sum_groups``, PAIR compiled in): the pair's CTAs (value heads 2h, 2h + 1, same
chunk) are one cluster of two; at dq (then dk) each sends half of its float32 accumulator pairs into
the other's exchange tile (over the solve's float32 tile, free at both points) by ``st.async`` on one
mbarrier, a phase each, and writes the other half, its value plus the peer's, rounded once into
dq, dk ``[B, T, H, K]``: no float32 dq, dk rows and no sum pass. Cluster arrives after the tile's last
local use and waits before the sends keep the peer from writing it early. (A first version that ran a
group's value heads one after another in one CTA took 3.82 ms against 1.80 for the default plus the
sum pass: half the CTAs, each twice as long and spilling; removed.)

With ``vn`` (``chunk_grads(vn=...)``, VNIN compiled in; the training path's default) the forward's
``vn = u - w Sc`` (as the split pass's chain wrote it, input dtype) is loaded into the vn tile instead of
recomputed: no ``k Sc``, ``Z``, ``Tm Z``, and ``dP = do vn^T`` joins the products in flight during the solve
(H200, B4 T4096 H16 HV32, pair sum: 1.420 against 1.491 ms; 39.8K against 42.3K cycles a CTA).

With ``tma`` (``chunk_grads(tma=True)``, TMA compiled in; only for the training path's call, vn and Tm read) the
three load groups are bulk tensor copies, issued by one elected thread of warp 0 on one mbarrier a group (Sc
moved from the first group to the second: the l2norm rows and k k^T wait for q and k alone);
rows past a varlen sequence's end are zeroed once landed, as cp.async zero-fills them (same bits). ptxas then: 241
registers, no spill, per tile (145 since the paired accesses below); 255 and 4 bytes spilled persistent (against
227 and 255 with cp.async). The default since the sixteenth session (:func:`tma_default`; ``CUDNN_TRAIN_GDN_DCHUNK_TMA=0`` gives cp.async back):
bitwise the cp.async loads, H200 B4 T4096 H16 HV32 1.228 ms against 1.263 (per tile), 1.295 against 1.358
(persistent, still off: slower than per tile).

With ``chains`` (``chunk_grads(chains=True)``, CHAINS = 1 compiled in; ``chains=2``: dvb and dv on warpgroup 0;
:func:`chains_default`, off: GPU-run in the nineteenth session, correct but 1.91 against 1.23 ms at B4 T4096)
the training path's call runs on the two-chain kernel
(``kernel_chains``): warpgroup 0 takes the q side and dk, warpgroup 1 the w side, each on whole [64, N] products
(one-warpgroup tiled MMAs), handing tiles over by named barriers (each used once: one side arrives, the other
syncs); dH comes by TMA into a tile of its own; with the pair sum, warpgroup 0 alone exchanges dq and dk with the
peer CTA through a tile of its own, an ``xfree`` mbarrier (the peer's remote arrive) ordering dk's sends after the
peer has read dq. Its profile variant writes each side's phases (``CHAIN_PHASES``). ptxas: 247 registers, no spill.

The elementwise phases read and write an accumulator's element pairs ``(e, e + 1)`` (columns n, n + 1 of one row,
``cm.check_acc_pairs``) with one 4-byte (input dtype) or 8-byte (float32) shared-memory access (``ld2``, ``st2``,
``ld2v``), the same arithmetic as element by element; ``dv_rows`` stays element by element, since in its paired
form LLVM fused its dbeta row-sum products into FMAs in the per-tile kernel but not in the persistent one (the
two then differed in dbeta's last bits). ptxas 145 registers instead of 241 (per tile), 109 without spill on four
warpgroups; H200, twentieth session: 1.16 against 1.23 ms at B4 T4096, outputs bitwise the element-by-element
kernel's; two chains 1.54 ms, four warpgroups 1.35 (both still slower, off).

Status: compiles for sm_90a (compile tier); its GPU test
(``tests/kernels/test_gated_delta_rule_bwd_chunk_sm90.py``, against the float32 torch stage) and the
training path's tier run it; the training path's default stage 3.
"""

import os

import torch

from ..backend import Unsupported
from . import compile as kc
from . import gated_delta_rule_common_sm90 as cm
from . import gated_delta_rule_fwd_sm90 as fwd

CHUNK = cm.CHUNK
_SOURCES = (__file__, cm.__file__, fwd.__file__)


def warpgroups(K: int) -> int:
    """Warpgroups per CTA: two, splitting every product's N. At K = V = 128 (H200, B4 T4096 H16 HV32,
    with the parallel dg tail) 4.43, 1.60 and 1.73 ms on one, two, four; at K = 64 (64-byte swizzles,
    :func:`_swizzle`; 138 registers against 168 on one) 0.910 against 1.012 ms, B4 T4096 and B1 T16384
    alike (``time_gdn_dchunk.py --k64``, twelfth session).
    ``CUDNN_TRAIN_GDN_DCHUNK_WGS`` = 1, 2 or 4 (4: K = 128 only) overrides it, for measurements."""
    env = os.environ.get("CUDNN_TRAIN_GDN_DCHUNK_WGS", "").strip()
    if env:
        if env not in ("1", "2", "4"):
            raise ValueError(f"CUDNN_TRAIN_GDN_DCHUNK_WGS={env!r}: expected 1, 2 or 4")
        return min(int(env), 2) if K != 128 else int(env)
    return 2


def _swizzle(K: int, wgs: int) -> int:
    """The [C, K], [C, V] and [K, V] tiles' swizzle (bytes): a warpgroup's share of an MN-major
    product's N (K / wgs elements) must start on a swizzle atom."""
    return 128 if K // wgs >= 64 else 64


# the profile variant's phases (tools/time_gdn_dchunk.py --profile): clock64 sums of thread 0 of every CTA
DCHUNK_PHASES = ("loads (issued; q, k (cp.async: + Sc) landed)", "l2norm rows, q k in place", "k k^T, A (+ k Sc, Z)",
                 "solve, Ae, Tm", "vn = Tm Z (not with vn)", "dP, dQK, dq (+ store)", "dw, dH in",
                 "dk: vn dH^T, dQK^T q, dkb, dvb, dv", "dTm, Tm^T dTm, dA, dKK", "dk: dKK k (+ store)",
                 "dg pair sums, tail, dg / dbeta")


# the two-chain kernel's profile phases: thread 0 (warpgroup 0, "q:") and thread 128 (warpgroup 1, "w:") each mark
# their own side's; the loads and l2norm rows, the join and the tail are thread 0's
CHAIN_PHASES = ("loads q, k landed", "l2norm rows",
                "q: q k^T, dP, dqg (Sc, vn, do landed)", "q: dQK, dP P, dq row sums", "q: dQK k, dq out",
                "q: vn dH^T (dH landed), kdt, dQK^T q (2: + dvb, dv)", "q: wait for dw", "q: Tm^T dw, row sums",
                "q: wait for dKK + dKK^T", "q: dKK k, dk out",
                "w: dw done (1: dvb issued; 2: k k^T)", "w: wait for do, Sc read", "w: dw tile (1: dvb, dv)",
                "w: dw k^T, dvn v^T (1: k k^T), Sc.dH", "w: dTm^T, Tm^T dTm", "w: dA = M1 Tm^T",
                "w: wait for dP P", "w: dA loop, dKK", "w: wait for dQK read, dKK + dKK^T",
                "join (the other side)", "pair sums, dg scan, stores")


def _build_dchunk(dtype, K: int, V: int, varlen: bool, l2norm: bool, WGS: int, OVERLAP: bool = False,
                  dqk_dtype=None, PAIR: bool = False, PROFILE: bool = False, ASYNC: bool = False,
                  VNIN: bool = False, TMIN: bool = False, PERSIST: bool = False, TMA: bool = False,
                  CHAINS: int = 0, RELAXED: bool = False, EREG: bool = False, DKKSYM: bool = False,
                  NORM8: bool = False, EARLYK: bool = False):
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from cutlass._mlir.dialects import nvvm

    C = CHUNK
    THREADS = 128 * WGS
    SW = _swizzle(K, WGS)
    LOG2E = cm.LOG2E
    load_tiles = fwd._make_load_tiles(C, THREADS)
    load_rows = fwd._make_load_tiles(K, THREADS)  # [K, V] state tiles
    issue_tiles = fwd.make_issue_tiles(dtype, C, THREADS)  # the same by cp.async (ASYNC)
    issue_rows = fwd.make_issue_tiles(dtype, K, THREADS)
    gemm = cm.make_gemm()
    solve = cm.make_solve(THREADS)
    row_inv_norm = cm.make_row_inv_norm(dtype, K, fwd.L2NORM_EPS)
    rows_normalize = cm.make_rows_inv_norm(dtype, K, fwd.L2NORM_EPS, THREADS, normalize=True)  # NORM8
    locate = cm.make_chunk_locator(varlen)
    store_rows = cm.make_store_pairs()  # rows < nvalid of a float32 accumulator, element pairs, into gX

    # accumulator elements (e, e + 1), e even, hold columns (n, n + 1), n even, of one row (cm.check_acc_pairs at
    # every accumulator shape): the elementwise phases read and write such pairs of a tile by one 4-byte (input
    # dtype) or 8-byte (float32) shared-memory access instead of two
    def pairs_of(group):
        # the even elements of a row's group (trace time): each the first of a pair
        if len(group) % 2 or any(group[p + 1] != group[p] + 1 or group[p] % 2 for p in range(0, len(group), 2)):
            raise AssertionError(f"accumulator row group {group} is not made of element pairs")
        return group[0::2]

    def ld2(sX, i, j):
        # sX[i, j], sX[i, j + 1] (j even) in float32
        frag = cute.make_rmem_tensor((1, 2), sX.element_type)
        cute.autovec_copy(cute.local_tile(sX, (1, 2), (i, j // 2)), frag)
        return frag[0].to(Float32), frag[1].to(Float32)

    def st2(sX, i, j, v0, v1):
        # sX[i, j], sX[i, j + 1] (j even) = v0, v1 in sX's dtype
        frag = cute.make_rmem_tensor((1, 2), sX.element_type)
        frag[0] = v0.to(sX.element_type)
        frag[1] = v1.to(sX.element_type)
        cute.autovec_copy(frag, cute.local_tile(sX, (1, 2), (i, j // 2)))

    def ld2v(sX, j):
        # sX[j], sX[j + 1] (j even) of a float32 vector
        frag = cute.make_rmem_tensor((2,), Float32)
        cute.autovec_copy(cute.local_tile(sX, (2,), (j // 2,)), frag)
        return frag[0], frag[1]
    PW = 2 if PAIR else 1  # value heads a CTA column covers (PAIR: the cluster's two)
    if PERSIST and not ASYNC:
        raise ValueError("the persistent variant loads by cp.async or TMA")
    if TMA and not (ASYNC and VNIN and TMIN):
        raise ValueError("the TMA loads replace the cp.async ones of the training path's call (vn and Tm read)")
    # CHAINS: 0 the per-tile kernel, 1 the two-chain kernel, 2 that with dvb, dv on the q side (chains_default)
    if CHAINS not in (0, 1, 2):
        raise ValueError(f"CHAINS={CHAINS}: 0, 1 or 2")
    if RELAXED and not (PAIR and TMIN and not PERSIST and not CHAINS):
        raise ValueError("the relaxed first cluster arrive serves the pair sum per tile with Tm read")
    if EREG and CHAINS:
        raise ValueError("EREG (E in registers) serves the per-tile and persistent kernels, not the two-chain one")
    if DKKSYM and CHAINS:
        raise ValueError("DKKSYM (dKK in dA's terms, dk's two products on it) serves the per-tile and persistent "
                         "kernels")
    if EARLYK and not PERSIST:
        raise ValueError("EARLYK (the next tile's k issued once dk's products and l2norm are done) serves the "
                         "persistent kernel")
    if CHAINS and not (TMA and not PERSIST and WGS == 2 and K == 128 and V == 128):
        raise ValueError("the two-chain stage 3 serves the training path's call per tile with the TMA loads, "
                         "two warpgroups, K = V = 128")
    # TMA: a tile's inputs by bulk tensor copies, issued by one elected thread of warp 0, one mbarrier a group of
    # them. Per tile, each group waited for where first read: q, k (the l2norm rows, k k^T); Sc, Tm, vn, do (the
    # products in flight during the solve phase; with cp.async Sc is in the first group, so the l2norm waits for
    # 64 KB instead of 32); v, dvn (dw). Persistent: the cp.async parts, each issued once its tiles are no longer
    # read, all waited for at the next tile's top.
    # CHAINS: dH by TMA too (its own tile, "h"), a fourth group, waited for only where read (vn dH^T, sum(Sc * dH))
    TMA_GROUPS = (("q", "s", "vn"), ("v", "do", "dvn", "tm"), ("k",)) if PERSIST else (
        ("q", "k"), ("s", "tm", "vn", "do"), ("v", "dvn")) + ((("h",),) if CHAINS else ())
    TMA_COLS = {"q": K, "k": K, "v": V, "do": V, "dvn": V, "vn": V, "tm": C}  # the [C, cols] token tiles (and Sc)
    STATES = ("s", "h")  # the [K, V] chunk-row tiles: Sc, dH
    TMA_BYTES = tuple(sum(K * V if x in STATES else C * TMA_COLS[x] for x in g) * dtype.width // 8 for g in TMA_GROUPS)

    def tile_of(u, by, ngrid, group):
        # PERSIST: tile unit u (chunk fastest) of CTA column by -> chunk, value head, q/k head
        hv = (u // ngrid) * PW + by
        return u % ngrid, hv, hv // group

    @cute.jit
    def next_inputs(ins, smem_in, u: Int32, nunits: Int32, by: Int32, ngrid: Int32, group: Int32, mCu: cute.Tensor,
                    mCuC: cute.Tensor, T: Int32, NT: Int32, nseq: Int32, tidx: Int32, part: cutlass.Constexpr):
        # PERSIST: part of tile unit u's inputs (if u < nunits) by cp.async as one group, rows past the chunk's
        # length zero: 0 q, Sc (and vn), read last in the dk phase; 1 v, do, dvn (and Tm), read last in the
        # dTm / dA phase; 2 k, read last in dKK k. Every thread commits a group (empty past the last unit).
        if u < nunits:
            cid, hv, h = tile_of(u, by, ngrid, group)
            b, t0, tend, _ = locate(cid, mCu, mCuC, T, NT, nseq)
            length = cutlass.max(cutlass.min(tend - t0, C), 0)
            mQ, mK, mV, mDo, mDvn, mHs, mVnI, mTmI = ins
            sQ, sK, sV, sDo, sDvn, sVn, sS, sTm = smem_in
            if cutlass.const_expr(part == 0):
                issue_tiles(((cute.domain_offset((t0, 0), mQ[b, None, h, None]), sQ, K, 0),), length, tidx)
                issue_rows(((mHs[cid, hv, None, None], sS, V, 0),), K, tidx)
                if cutlass.const_expr(VNIN):
                    issue_tiles(((cute.domain_offset((t0, 0), mVnI[b, None, hv, None]), sVn, V, 0),), length, tidx)
            elif cutlass.const_expr(part == 1):
                issue_tiles(((cute.domain_offset((t0, 0), mV[b, None, hv, None]), sV, V, 0),
                             (cute.domain_offset((t0, 0), mDo[b, None, hv, None]), sDo, V, 0),
                             (cute.domain_offset((t0, 0), mDvn[b, None, hv, None]), sDvn, V, 0)), length, tidx)
                if cutlass.const_expr(TMIN):
                    issue_tiles(((cute.domain_offset((t0, 0), mTmI[b, None, hv, None]), sTm, C, 0),), length, tidx)
            else:
                issue_tiles(((cute.domain_offset((t0, 0), mK[b, None, h, None]), sK, K, 0),), length, tidx)
        cute.arch.cp_async_commit_group()

    # the order of the kernel's atoms, tensors, tiles
    TMA_NAMES = ("q", "k", "v", "do", "dvn", "vn", "tm", "s") + (("h",) if CHAINS else ())
    zero_all = cm.make_zero_rows(dtype, THREADS)
    init_barriers = cm.make_tma_init()

    def tma_group(g, ta, tiles, bar, b, t0, h, hv, cid):
        # (TMA, warp 0, while tracing) group g of the inputs of the tile (chunk at row t0 of sequence b, its chunk
        # row cid, value head hv, q/k head h) on the mbarrier bar (cm.tma_load); rows past a varlen sequence's
        # end are zeroed by zero_tails once landed
        jobs = []
        for name in TMA_GROUPS[g]:
            i = TMA_NAMES.index(name)
            tT = ta[len(TMA_NAMES) + i]
            if name in STATES:  # the chunk-start state (or dH), [K, V] of chunk row cid
                gT = cute.local_tile(tT[None, None, cid, hv], (K, V), (0, 0))
            else:
                gT = cm.token_box(tT, b, h if name in ("q", "k") else hv, t0, 0, C, TMA_COLS[name])
            jobs.append((ta[i], gT, tiles[i]))
        cm.tma_load(jobs, bar, TMA_BYTES[g])

    @cute.jit
    def next_part(part: cutlass.Constexpr, ins: cutlass.Constexpr, smem_in: cutlass.Constexpr, ta: cutlass.Constexpr,
                  tiles: cutlass.Constexpr, tbar, u: Int32, nunits: Int32, by: Int32, ngrid: Int32, group: Int32,
                  mCu: cute.Tensor, mCuC: cute.Tensor, T: Int32, NT: Int32, nseq: Int32, tidx: Int32):
        # (PERSIST) part `part` of tile unit u's inputs, if u < nunits: by TMA on its mbarrier (warp 0), or by
        # cp.async as one group
        if cutlass.const_expr(TMA):
            if u < nunits:
                cid, hv, h = tile_of(u, by, ngrid, group)
                b, t0, _, _ = locate(cid, mCu, mCuC, T, NT, nseq)
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                    tma_group(part, ta, tiles, tbar + part, b, t0, h, hv, cid)
        else:
            next_inputs(ins, smem_in, u, nunits, by, ngrid, group, mCu, mCuC, T, NT, nseq, tidx, part)

    @cute.jit
    def zero_rows(sX: cute.Tensor, cols: cutlass.Constexpr, length: Int32, tidx: Int32):
        # (TMA) rows >= length of a partial chunk's [C, cols] tile zeroed (cm.make_zero_rows)
        if length < C:
            zero_all(sX, cols, length, tidx)

    def zero_tails(g, tiles, length, tidx):
        # (TMA, while tracing) zero_rows on group g's token tiles; the caller fences and syncs
        for name in TMA_GROUPS[g]:
            if name not in STATES:
                zero_rows(tiles[TMA_NAMES.index(name)], TMA_COLS[name], length, tidx)

    @cute.jit
    def swap_in_dot(gX: cute.Tensor, sX: cute.Tensor, tidx: Int32):
        # global [K, V] -> the smem tile sX in place of what it holds; returns this thread's part of
        # sum(old * new) in float32 (16-byte vectors; every thread rewrites only what it read)
        VPR = V // 8
        RPP = THREADS // VPR
        frags = []
        for p in cutlass.range_constexpr(K // RPP):
            r = p * RPP + tidx // VPR
            frag = cute.make_rmem_tensor((1, 8), dtype)
            cute.autovec_copy(cute.local_tile(gX, (1, 8), (r, tidx % VPR)), frag)
            frags.append(frag)
        parts = [Float32(0.0), Float32(0.0)]
        for p in cutlass.range_constexpr(K // RPP):
            r = p * RPP + tidx // VPR
            old = cute.make_rmem_tensor((1, 8), dtype)
            cute.autovec_copy(cute.local_tile(sX, (1, 8), (r, tidx % VPR)), old)
            for e in cutlass.range_constexpr(8):
                parts[p % 2] = parts[p % 2] + old[e].to(Float32) * frags[p][e].to(Float32)
            cute.autovec_copy(frags[p], cute.local_tile(sX, (1, 8), (r, tidx % VPR)))
        return parts[0] + parts[1]

    @cute.jit
    def prefetch_l2(gX: cute.Tensor, rows: cutlass.Constexpr, cols: cutlass.Constexpr, nvalid: Int32, tidx: Int32):
        # rows < nvalid of the [rows, cols] tile gX into L2, one 128-byte line a thread and step
        LPR = cols * dtype.width // 1024  # lines a row
        for p in cutlass.range_constexpr((rows * LPR + THREADS - 1) // THREADS):
            line = p * THREADS + tidx
            if line < rows * LPR and line // LPR < nvalid:
                row = gX[line // LPR, None]
                cute.arch.prefetch((row.iterator + (line % LPR) * (1024 // dtype.width)).llvm_ptr, cache_level="L2")

    @cute.jit
    def row_sums(vals: cute.Tensor, cAcc: cute.Tensor, sOut: cute.Tensor, groups: cutlass.Constexpr, tidx: Int32,
                 accumulate: cutlass.Constexpr):
        # sOut[wg, row] (+)= this warpgroup's part of the sum over the row of vals (a float32 tensor in
        # an accumulator layout: the warpgroup's columns); one thread per (wg, row) writes it
        wg = tidx // 128
        for gi in cutlass.range_constexpr(len(groups)):
            s = Float32(0.0)
            for e in cutlass.range_constexpr(len(groups[gi])):
                s = s + vals[groups[gi][e]]
            s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
            s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
            if tidx % 4 == 0:
                r, _ = cAcc[groups[gi][0]]
                if cutlass.const_expr(accumulate):
                    sOut[wg, r] = sOut[wg, r] + s
                else:
                    sOut[wg, r] = s

    @cute.jit
    def wg_sum(sX: cute.Tensor, r: Int32):
        # the warpgroups' parts of row r of a per-warpgroup buffer, summed in a fixed order
        s = sX[0, r]
        for w_ in cutlass.range_constexpr(1, WGS):
            s = s + sX[w_, r]
        return s

    @cute.jit
    def acc_to_tile(acc: cute.Tensor, cAcc: cute.Tensor, sX: cute.Tensor, negate: cutlass.Constexpr):
        # an accumulator into an input-dtype smem tile at its coordinates, element pairs
        for e2 in cutlass.range_constexpr(cute.size(acc) // 2):
            e = 2 * e2
            i, j = cAcc[e]
            if cutlass.const_expr(negate):
                st2(sX, i, j, -acc[e], -acc[e + 1])
            else:
                st2(sX, i, j, acc[e], acc[e + 1])

    # PAIR (GVA groups of two): the two value heads of a q/k head are one cluster of two CTAs; each
    # sends half of its dq (then dk) accumulator pairs into the other's exchange tile by st.async (one
    # mbarrier, a phase each) and writes the other half, its own values plus the peer's, rounded once
    PSLOTS = C * K // THREADS // 4  # slots a thread sends: every other pair of its accumulator
    XCH_BYTES = PSLOTS * THREADS * 8

    @cute.jit
    def pair_send(acc: cute.Tensor, sXch: cute.Tensor, mbar, keep: cutlass.Constexpr, tidx: Int32):
        # pairs p = 2 s + 1 - keep (the peer's rows) into slot s of the peer CTA's (rank 1 - keep) tile
        # (sXch [slots, threads, 2]: the slots of thread tidx of those that hold the accumulator)
        for sl in cutlass.range_constexpr(cute.size(sXch, mode=[0])):
            e = 2 * (2 * sl + 1 - keep)
            cute.arch.store_async_dsmem(sXch[sl, tidx, None].iterator, (acc[e].bitcast(Int32), acc[e + 1].bitcast(Int32)),
                                        mbar, 1 - keep)

    @cute.jit
    def pair_store(acc: cute.Tensor, cAcc: cute.Tensor, sXch: cute.Tensor, gX: cute.Tensor, nvalid: Int32,
                   keep: cutlass.Constexpr, tidx: Int32):
        # pairs p = 2 s + keep: this CTA's value plus the peer's (slot s), rows < nvalid into gX
        for sl in cutlass.range_constexpr(cute.size(sXch, mode=[0])):
            e = 2 * (2 * sl + keep)
            i, d = cAcc[e]
            if i < nvalid:
                frag = cute.make_rmem_tensor((1, 2), gX.element_type)
                frag[0] = (acc[e] + sXch[sl, tidx, 0]).to(gX.element_type)
                frag[1] = (acc[e + 1] + sXch[sl, tidx, 1]).to(gX.element_type)
                cute.autovec_copy(frag, cute.local_tile(gX, (1, 2), (i, d // 2)))

    @cute.jit
    def pair_exchange(acc: cute.Tensor, cAcc: cute.Tensor, sXch: cute.Tensor, mbar, gX: cute.Tensor, nvalid: Int32,
                      rank: Int32, nbytes: cutlass.Constexpr, phase: cutlass.Constexpr, tidx: Int32):
        # PAIR: half of acc's pairs into the peer's exchange tile, then (once the peer's nbytes have landed, phase
        # `phase` of mbar) the other half plus the peer's into gX
        if rank == 0:
            pair_send(acc, sXch, mbar, 0, tidx)
        else:
            pair_send(acc, sXch, mbar, 1, tidx)
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, nbytes)
        cute.arch.mbarrier_wait(mbar, phase)
        if rank == 0:
            pair_store(acc, cAcc, sXch, gX, nvalid, 0, tidx)
        else:
            pair_store(acc, cAcc, sXch, gX, nvalid, 1, tidx)

    @cute.jit
    def store_dqk(acc: cute.Tensor, cAcc: cute.Tensor, mX: cute.Tensor, sXch: cute.Tensor, mbar, b: Int32, t0: Int32,
                  h: Int32, hv: Int32, rank: Int32, nvalid: Int32, phase: cutlass.Constexpr, tidx: Int32):
        # dq or dk: per value head into mX [B, T, HV, K]; with PAIR summed over the pair into mX [B, T, H, K]
        if cutlass.const_expr(not PAIR):
            store_rows(acc, cAcc, cute.domain_offset((t0, 0), mX[b, None, hv, None]), nvalid)
        else:
            gX = cute.domain_offset((t0, 0), mX[b, None, h, None])
            cute.arch.cluster_wait()  # the peer is done with its exchange tile (see the arrives)
            pair_exchange(acc, cAcc, sXch, mbar, gX, nvalid, rank, XCH_BYTES, phase, tidx)

    # ---- elementwise phases shared by both kernels (an accumulator's elements at its coordinates cAcc; row sums
    # into a warpgroup's row of the sum buffers; by_row: one row_sums call a row, so that few temporaries are live)
    @cute.jit
    def dqk_tiles(accDP: cute.Tensor, accQK: cute.Tensor, cCC: cute.Tensor, sX1: cute.Tensor, sA: cute.Tensor,
                  sGc: cute.Tensor, scale: Float32, E: cute.Tensor, e_regs: cutlass.Constexpr):
        # dQK = scale dP E -> sX1 (input dtype) ; the pair terms dP * P -> sA (element pairs); e_regs: E from the
        # registers the EREG loop of the solve phase filled (the same values), else exponentiated here
        for e2 in cutlass.range_constexpr(cute.size(accDP) // 2):
            e = 2 * e2
            i, j = cCC[e]
            dqk0 = Float32(0.0)
            dqk1 = Float32(0.0)
            if cutlass.const_expr(e_regs):
                if j <= i:
                    dqk0 = scale * accDP[e] * E[e]
                if j + 1 <= i:
                    dqk1 = scale * accDP[e + 1] * E[e + 1]
            else:
                gi_ = sGc[i]
                gj0, gj1 = ld2v(sGc, j)
                if j <= i:
                    dqk0 = scale * accDP[e] * cute.math.exp2((gi_ - gj0) * LOG2E, fastmath=True)
                if j + 1 <= i:
                    dqk1 = scale * accDP[e + 1] * cute.math.exp2((gi_ - gj1) * LOG2E, fastmath=True)
            st2(sX1, i, j, dqk0, dqk1)
            st2(sA, i, j, dqk0 * accQK[e], dqk1 * accQK[e + 1])  # dP * P

    @cute.jit
    def scale_rows(acc: cute.Tensor, tmp: cute.Tensor, cAcc: cute.Tensor, groups: cutlass.Constexpr, sY: cute.Tensor,
                   sGc: cute.Tensor, x: Float32, decay: cutlass.Constexpr, sOut: cute.Tensor, tidx: Int32,
                   by_row: cutlass.Constexpr, accumulate: cutlass.Constexpr):
        # acc's row i times f_i, then sOut (+)= rowsum(y * acc) (y the tile sY): dq's f_i = x eg_i (x = scale:
        # dqg -> scale eg dqg, dgc += rowsum(scale eg q * dqg)); with `decay` dk's f_i = exp(gc_C - gc_i) (x = gc_C:
        # vn dH^T -> diag(kdec) vn dH^T, kdt = rowsum(kd * vn dH^T))
        for gi in cutlass.range_constexpr(len(groups)):
            i, _ = cAcc[groups[gi][0]]
            if cutlass.const_expr(decay):
                f = cute.math.exp2((x - sGc[i]) * LOG2E, fastmath=True)
            else:
                f = x * cute.math.exp2(sGc[i] * LOG2E, fastmath=True)
            for e in pairs_of(groups[gi]):
                _, d = cAcc[e]
                y0, y1 = ld2(sY, i, d)
                acc[e] = acc[e] * f
                tmp[e] = acc[e] * y0
                acc[e + 1] = acc[e + 1] * f
                tmp[e + 1] = acc[e + 1] * y1
            if cutlass.const_expr(by_row):
                row_sums(tmp, cAcc, sOut, (groups[gi],), tidx, accumulate)
        if cutlass.const_expr(not by_row):
            row_sums(tmp, cAcc, sOut, groups, tidx, accumulate)

    @cute.jit
    def dk_add_dkb(accDk: cute.Tensor, accDkb: cute.Tensor, cCK: cute.Tensor, groups: cutlass.Constexpr,
                   sK: cute.Tensor, sGc: cute.Tensor, sB: cute.Tensor, sDb: cute.Tensor, sDgc: cute.Tensor, tidx: Int32):
        # dk += beta eg dkb ; dbeta += rowsum(eg k dkb) ; dgc += beta eg rowsum(k dkb)
        for gi in cutlass.range_constexpr(len(groups)):
            i, _ = cCK[groups[gi][0]]
            eg = cute.math.exp2(sGc[i] * LOG2E, fastmath=True)
            beg = sB[i] * eg
            for e in pairs_of(groups[gi]):
                _, d = cCK[e]
                k0, k1 = ld2(sK, i, d)
                accDk[e] = accDk[e] + beg * accDkb[e]
                accDkb[e] = accDkb[e] * k0 * eg
                accDk[e + 1] = accDk[e + 1] + beg * accDkb[e + 1]
                accDkb[e + 1] = accDkb[e + 1] * k1 * eg
        row_sums(accDkb, cCK, sDb, groups, tidx, True)
        for gi in cutlass.range_constexpr(len(groups)):
            i, _ = cCK[groups[gi][0]]
            bi = sB[i]
            for e in groups[gi]:
                accDkb[e] = accDkb[e] * bi
        row_sums(accDkb, cCK, sDgc, groups, tidx, True)

    @cute.jit
    def dv_rows(accDvb: cute.Tensor, tmp: cute.Tensor, cCV: cute.Tensor, groups: cutlass.Constexpr, sV: cute.Tensor,
                sB: cute.Tensor, sDb: cute.Tensor, tidx: Int32, by_row: cutlass.Constexpr):
        # dvb -> dv = beta dvb ; dbeta += rowsum(v dvb)
        for gi in cutlass.range_constexpr(len(groups)):
            i, _ = cCV[groups[gi][0]]
            bi = sB[i]
            for e in groups[gi]:
                _, n = cCV[e]
                tmp[e] = accDvb[e] * sV[i, n].to(Float32)
                accDvb[e] = accDvb[e] * bi
            if cutlass.const_expr(by_row):
                row_sums(tmp, cCV, sDb, (groups[gi],), tidx, True)
        if cutlass.const_expr(not by_row):
            row_sums(tmp, cCV, sDb, groups, tidx, True)

    @cute.jit
    def dtm_tile(accX1: cute.Tensor, accX2: cute.Tensor, cCC: cute.Tensor, sX2: cute.Tensor, sB: cute.Tensor,
                 sGc: cute.Tensor):
        # dTm = (dw k^T) diag(beta eg) + (dvn v^T) diag(beta) -> sX2 as dTm^T (input dtype)
        for e2 in cutlass.range_constexpr(cute.size(accX1) // 2):
            e = 2 * e2
            i, j = cCC[e]
            bjs = ld2v(sB, j)
            gjs = ld2v(sGc, j)
            for u in cutlass.range_constexpr(2):
                sX2[j + u, i] = (accX1[e + u] * bjs[u] * cute.math.exp2(gjs[u] * LOG2E, fastmath=True)
                                 + accX2[e + u] * bjs[u]).to(dtype)

    @cute.jit
    def da_terms(accDA: cute.Tensor, accKK: cute.Tensor, tdb: cute.Tensor, cCC: cute.Tensor, groups: cutlass.Constexpr,
                 sM: cute.Tensor, sA: cute.Tensor, sT: cute.Tensor, sGc: cute.Tensor, sB: cute.Tensor, sDb: cute.Tensor,
                 tidx: Int32, kk_regs: cutlass.Constexpr, E: cute.Tensor, e_regs: cutlass.Constexpr,
                 sDkk: cute.Tensor, dkk_sym: cutlass.Constexpr):
        # accDA = M1 Tm^T -> dA = -strictly_lower(.) ; Ae = KK * Es from sM (kk_regs: from k k^T's accumulator accKK,
        # whose rows then go a row at a time) ; dbeta += rowsum(dA * Ae), sA += dA * A, dKK = beta dA * Es -> sT;
        # e_regs: Es from the registers the EREG loop of the solve phase filled (the same values), else exponentiated
        # here (gc then read: gi_, gjs; None with e_regs, never traced). dkk_sym: dKK into sDkk in the input dtype
        # (zeros on and above the diagonal) instead of float32 sT: the caller then adds dKK k and dKK^T k as two
        # products, no dKK + dKK^T tile (each element of that sum is one of the two, x + 0)
        for gi in cutlass.range_constexpr(len(groups)):
            i, _ = cCC[groups[gi][0]]
            gi_ = None if e_regs else sGc[i]
            bi = sB[i]
            for e0 in pairs_of(groups[gi]):
                _, j0 = cCC[e0]
                gjs = None if e_regs else ld2v(sGc, j0)
                olds = ld2(sA, i, j0)
                newA = [None, None]
                newT = [None, None]
                for u in cutlass.range_constexpr(2):
                    e = e0 + u
                    da = Float32(0.0)
                    ae = Float32(0.0)
                    es = Float32(0.0)
                    if i > j0 + u:
                        da = -accDA[e]
                        if cutlass.const_expr(e_regs):
                            es = E[e]
                        else:
                            es = cute.math.exp2((gi_ - gjs[u]) * LOG2E, fastmath=True)
                        if cutlass.const_expr(kk_regs):
                            ae = accKK[e] * es
                        else:
                            ae = sM[i, j0 + u]
                    tdb[e] = da * ae
                    newA[u] = olds[u] + bi * da * ae  # + dA * A
                    newT[u] = bi * da * es  # dKK
                st2(sA, i, j0, newA[0], newA[1])
                st2(sDkk if dkk_sym else sT, i, j0, newT[0], newT[1])
            if cutlass.const_expr(kk_regs and not e_regs):
                row_sums(tdb, cCC, sDb, (groups[gi],), tidx, True)
        # (e_regs: grouped as the default's; a row at a time measured 1.161-1.172 ms persistent against 1.140-1.150,
        # H100 B4, twenty-fifth session; dbeta's bits differ either way)
        if cutlass.const_expr(not kk_regs or e_regs):
            row_sums(tdb, cCC, sDb, groups, tidx, True)

    @cute.jit
    def chunk_rows(mGc: cute.Tensor, mB: cute.Tensor, sGc: cute.Tensor, sB: cute.Tensor, sDgc: cute.Tensor,
                   sDb: cute.Tensor, sKdt: cute.Tensor, b: Int32, t0: Int32, hv: Int32, length: Int32, tidx: Int32,
                   zero_kdt: cutlass.Constexpr):
        # (threads < C) the chunk's gc (past the end: the last row's) and beta (past the end: 0) into sGc, sB; every
        # warpgroup's row sums of dgc and dbeta (and with zero_kdt of kdt) zeroed
        if tidx < C:
            sGc[tidx] = mGc[b, t0 + cutlass.max(cutlass.min(tidx, length - 1), 0), hv]
            bval = Float32(0.0)
            if tidx < length:
                bval = mB[b, t0 + tidx, hv]
            sB[tidx] = bval
            for w_ in cutlass.range_constexpr(WGS):
                sDgc[w_, tidx] = Float32(0.0)
                sDb[w_, tidx] = Float32(0.0)
                if cutlass.const_expr(zero_kdt):
                    sKdt[w_, tidx] = Float32(0.0)

    @cute.jit
    def l2norm_rows(sQ: cute.Tensor, sK: cute.Tensor, sRq: cute.Tensor, sRk: cute.Tensor, tidx: Int32):
        # (every thread) the rows of q and k l2-normalized in place (input dtype), their factors into sRq, sRk.
        # NORM8: one pass, eight threads a row (no bank conflict), each scaling the vectors its sums loaded; else the
        # factors a thread a row (2 C threads), then the scaling pass
        if cutlass.const_expr(NORM8):
            rows_normalize(sQ, sRq, tidx)
            rows_normalize(sK, sRk, tidx)
        else:
            if tidx < C:
                sRq[tidx] = row_inv_norm(sQ, tidx)
            elif tidx < 2 * C:
                sRk[tidx - C] = row_inv_norm(sK, tidx - C)
            cute.arch.sync_threads()
            TPR = THREADS // C  # threads a row, 1 / TPR of a row each
            nr = tidx // TPR
            tiles = ((sQ, sRq), (sK, sRk))
            for vc in cutlass.range_constexpr(K // 8 // TPR):
                c = (tidx % TPR) * (K // 8 // TPR) + vc
                for w_ in cutlass.range_constexpr(2):
                    sX, sR = tiles[w_]
                    frag = cute.make_rmem_tensor((1, 8), dtype)
                    cute.autovec_copy(cute.local_tile(sX, (1, 8), (nr, c)), frag)
                    frag.store((frag.load().to(Float32) * sR[nr]).to(dtype))
                    cute.autovec_copy(frag, cute.local_tile(sX, (1, 8), (nr, c)))
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

    @cute.jit
    def pair_sums_dgc(sA: cute.Tensor, sKdt: cute.Tensor, sDgc: cute.Tensor, tidx: Int32):
        # (every thread) dgc's pair sums over sA (the terms dP * P + dA * A), R adjacent threads a row, each over
        # C / R columns, then butterfly shuffles: sDgc[0] = the row terms' sum + pair sums - kdt, the row's kdt
        # into sKdt[0] (for the tail); the caller syncs
        R = THREADS // C
        pi = tidx // R
        ps = Float32(0.0)
        for jj in cutlass.range_constexpr(C // R):
            j = (tidx % R) * (C // R) + jj
            ps = ps + (sA[pi, j] - sA[j, pi])
        for o in cutlass.range_constexpr(R.bit_length() - 1):
            ps = ps + cute.arch.shuffle_sync_bfly(ps, offset=1 << o)
        if tidx % R == 0:
            kt = wg_sum(sKdt, pi)
            sKdt[0, pi] = kt  # the row's kdt, for the tail below (only this thread reads row pi of sKdt)
            sDgc[0, pi] = wg_sum(sDgc, pi) + ps - kt

    @cute.jit
    def dg_scan_store(sDgc: cute.Tensor, sKdt: cute.Tensor, sRed: cute.Tensor, sDb: cute.Tensor, glast: Float32,
                      mDg: cute.Tensor, mDb: cute.Tensor, b: Int32, t0: Int32, hv: Int32, length: Int32, tidx: Int32):
        # (every thread) the tail (sum(kdt) + exp(gc_C) sum(Sc * dH), its parts a warp in sRed) on the last row and
        # the reverse cumulative sum on warp 0 (lane l holds rows 2l and 2l + 1), then dg and dbeta stored
        if tidx < 32:
            x0 = sDgc[0, 2 * tidx]
            x1 = sDgc[0, 2 * tidx + 1]
            tail = sKdt[0, 2 * tidx] + sKdt[0, 2 * tidx + 1]
            sc_dh = Float32(0.0)
            if tidx < THREADS // 32:
                sc_dh = sRed[tidx]
            for o in cutlass.range_constexpr(5):
                tail = tail + cute.arch.shuffle_sync_bfly(tail, offset=1 << o)
                sc_dh = sc_dh + cute.arch.shuffle_sync_bfly(sc_dh, offset=1 << o)
            if tidx == 31:
                x1 = x1 + tail + sc_dh * cute.math.exp2(glast * LOG2E, fastmath=True)
            suf = x0 + x1  # -> the sum of the pairs of lanes >= this one
            for o in cutlass.range_constexpr(5):
                nxt = cute.arch.shuffle_sync_down(suf, offset=1 << o)
                if tidx + (1 << o) < 32:
                    suf = suf + nxt
            after = cute.arch.shuffle_sync_down(suf, offset=1)  # the pairs of the lanes after this one
            if tidx == 31:
                after = Float32(0.0)
            run1 = x1 + after
            sDgc[0, 2 * tidx + 1] = run1
            sDgc[0, 2 * tidx] = x0 + run1
        cute.arch.sync_threads()
        if tidx < length:
            mDg[b, t0 + tidx, hv] = sDgc[0, tidx]
            mDb[b, t0 + tidx, hv] = wg_sum(sDb, tidx)

    @cute.jit
    def l2norm_bwd(acc: cute.Tensor, cAcc: cute.Tensor, sY: cute.Tensor, sR: cute.Tensor, sRow: cute.Tensor,
                   tmp: cute.Tensor, groups: cutlass.Constexpr, tidx: Int32, one_wg: cutlass.Constexpr = False):
        # acc: the gradient of the normalized rows y (sY); becomes that of the rows before the
        # l2norm, r (dy - y sum(y * dy)) with r the rows' factors (sR); sRow: row-sum scratch.
        # one_wg (CHAINS): acc is warpgroup 0's alone, whole rows; only its threads take part
        for e2 in cutlass.range_constexpr(cute.size(acc) // 2):
            e = 2 * e2
            i, d = cAcc[e]
            y0, y1 = ld2(sY, i, d)
            tmp[e] = acc[e] * y0
            tmp[e + 1] = acc[e + 1] * y1
        row_sums(tmp, cAcc, sRow, groups, tidx, False)
        if cutlass.const_expr(one_wg):
            cute.arch.barrier(barrier_id=BAR_Q, number_of_threads=128)
        else:
            cute.arch.sync_threads()
        for gi in cutlass.range_constexpr(len(groups)):  # row by row: its factors read once
            i, _ = cAcc[groups[gi][0]]
            ri = sR[i]
            if cutlass.const_expr(one_wg):
                si = sRow[0, i]
            else:
                si = wg_sum(sRow, i)
            for e in pairs_of(groups[gi]):
                _, d = cAcc[e]
                y0, y1 = ld2(sY, i, d)
                acc[e] = ri * (acc[e] - y0 * si)
                acc[e + 1] = ri * (acc[e + 1] - y1 * si)

    def acc_of(mma_, n, t):
        # a [64, n] float32 accumulator of thread t's slice of the tiled MMA mma_
        return cute.make_rmem_tensor(mma_.get_slice(t).partition_shape_C((C, n)), Float32)

    def mm1(acc, n, a_tile, a_mn, b_tile, b_mn, zero, t, wgs=1):
        # acc (+)= A B, A [64, k] / B [n, k] as views of smem tiles: on one warpgroup (t its thread within it), or
        # with wgs warpgroups each computing its columns (t the CTA's thread)
        m = cm.make_mma(dtype, n, a_regs=False, b_mn_major=b_mn, a_mn_major=a_mn, wgs=wgs)
        thr = m.get_slice(t)
        gemm(m, acc, m.make_fragment_A(thr.partition_A(a_tile)), m.make_fragment_B(thr.partition_B(b_tile)), zero)

    def mma_done():
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.kernel
    def kernel(
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mGc: cute.Tensor, mB: cute.Tensor, mDo: cute.Tensor,
        mDvn: cute.Tensor, mHs: cute.Tensor, mDH: cute.Tensor, mVnI: cute.Tensor, mTmI: cute.Tensor,
        mCu: cute.Tensor, mCuC: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor,
        mDg: cute.Tensor, mDb: cute.Tensor, scale: Float32, T: Int32, NT: Int32, nseq: Int32, group: Int32,
        ngrid: Int32, mProf: cute.Tensor, aQ: cute.CopyAtom, aK: cute.CopyAtom, aV: cute.CopyAtom, aDo: cute.CopyAtom,
        aDvn: cute.CopyAtom, aVn: cute.CopyAtom, aTm: cute.CopyAtom, aS: cute.CopyAtom, tQ: cute.Tensor, tK: cute.Tensor,
        tV: cute.Tensor, tDo: cute.Tensor, tDvn: cute.Tensor, tVn: cute.Tensor, tTm: cute.Tensor, tS: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cid, hv, _ = cute.arch.block_idx()
        h = hv // group
        niter = 1  # PERSIST: this CTA's tiles
        bx, by = cid, hv
        nctas = Int32(1)
        if cutlass.const_expr(PERSIST):
            nctas = cute.arch.grid_dim()[0]
            niter = (ngrid * (mV.shape[2] // PW) - bx + nctas - 1) // nctas
            by = cute.arch.block_idx()[1]
        pstart, pmark, pfinish = fwd.make_profile(PROFILE, len(DCHUNK_PHASES))
        prof = pstart()

        # ---- the MMAs: name = (N, A MN-major, B MN-major); accumulators of one N share a layout
        def mma(n, a_mn, b_mn):
            return cm.make_mma(dtype, n, a_regs=False, b_mn_major=b_mn, a_mn_major=a_mn, wgs=WGS)

        mma_cc = mma(C, False, False)  # canonical [C, C] accumulator
        mma_ck = mma(K, False, False)  # canonical [C, K]
        mma_cv = mma(V, False, False)  # canonical [C, V]
        threads = cm.sample_threads(WGS)
        grp_cc = cm.quad_row_groups(mma_cc, (C, C), threads, WGS)
        grp_ck = cm.quad_row_groups(mma_ck, (C, K), threads, WGS)
        grp_cv = cm.quad_row_groups(mma_cv, (C, V), threads, WGS)
        cm.check_acc_pairs(mma_cc, (C, C), threads)
        cm.check_acc_pairs(mma_ck, (C, K), threads)
        cm.check_acc_pairs(mma_cv, (C, V), threads)

        smem = cutlass.utils.SmemAllocator()
        sQ = cm.alloc_tile(smem, dtype, C, K, SW)
        sK = cm.alloc_tile(smem, dtype, C, K, SW)
        sV = cm.alloc_tile(smem, dtype, C, V, SW)
        sDo = cm.alloc_tile(smem, dtype, C, V, SW)  # do, later dw ([C, K]: K == V)
        sDvn = cm.alloc_tile(smem, dtype, C, V, SW)
        sVn = cm.alloc_tile(smem, dtype, C, V, SW)  # Z, then vn
        sS = cm.alloc_tile(smem, dtype, K, V, SW)  # Sc, then dH
        sTm = cm.alloc_tile(smem, dtype, C, C)
        sX1 = cm.alloc_tile(smem, dtype, C, C)  # dQK, then dKK + dKK^T
        sX2 = cm.alloc_tile(smem, dtype, C, C)  # dTm^T, then Tm^T dTm
        lf = cute.make_layout((C, C), stride=(cm.A_STRIDE, 1))
        sA = smem.allocate_tensor(Float32, lf, 16)  # A, then the pair-sum terms
        sT = smem.allocate_tensor(Float32, lf, 16)  # T, then dKK
        sM = smem.allocate_tensor(Float32, lf, 16)  # solve scratch, then Ae
        sGc = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sB = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        lw = cute.make_layout((WGS, C), stride=(C, 1))  # one row of C per warpgroup: its part of a row sum
        sDgc = smem.allocate_tensor(Float32, lw, 16)  # row terms of dgc
        sDb = smem.allocate_tensor(Float32, lw, 16)  # row terms of dbeta
        sKdt = smem.allocate_tensor(Float32, lw, 16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout(THREADS // 32), 16)
        sRq = smem.allocate_tensor(Float32, cute.make_layout(C), 16)  # l2norm row factors of q, k
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRow = smem.allocate_tensor(Float32, lw, 16)  # the l2norm backward's row sums
        sDw = sDo
        # PAIR: the exchange tile over sT, free when the pairs exchange dq (T is in sTm then) and dk (dKK is in
        # sX1 then); the peer writes it only after this CTA's cluster arrive that follows its last use
        sXch = cute.make_tensor(sT.iterator, cute.make_layout((PSLOTS, THREADS, 2), stride=(2 * THREADS, 2, 1)))
        mbar = None
        rank = Int32(0)
        if cutlass.const_expr(PAIR):
            mbar = smem.allocate_array(cutlass.Int64, 1)
            rank = cute.arch.block_idx_in_cluster()
            if tidx == 0:
                cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
        # TMA: the atoms and tensors in TMA_NAMES order, the tiles they fill, one mbarrier a group
        ta = (aQ, aK, aV, aDo, aDvn, aVn, aTm, aS, tQ, tK, tV, tDo, tDvn, tVn, tTm, tS)
        tma_tiles = (sQ, sK, sV, sDo, sDvn, sVn, sTm, sS)
        tbar = None
        if cutlass.const_expr(TMA):
            tbar = smem.allocate_array(cutlass.Int64, len(TMA_GROUPS), byte_alignment=8)
            init_barriers(tbar, len(TMA_GROUPS), ta[:len(TMA_NAMES)], 0)

        # the tile loop: one tile (chunk, value head) a CTA, or with PERSIST a CTA per SM (a cluster of two per
        # two SMs with PAIR) walking its tiles, the next tile's inputs loaded during this one's last phases
        ins = (mQ, mK, mV, mDo, mDvn, mHs, mVnI, mTmI)
        smem_in = (sQ, sK, sV, sDo, sDvn, sVn, sS, sTm)
        nunits = ngrid * (mV.shape[2] // PW)
        if cutlass.const_expr(PERSIST):  # the first tile's inputs
            for part in cutlass.range_constexpr(3):
                next_part(part, ins, smem_in, ta, tma_tiles, tbar, bx, nunits, by, ngrid, group, mCu, mCuC, T, NT, nseq,
                          tidx)
        for it in cutlass.range(niter, unroll=1):
            if cutlass.const_expr(PERSIST):
                cid, hv, h = tile_of(bx + it * nctas, by, ngrid, group)
            thr_cc = mma_cc.get_slice(tidx)
            thr_ck = mma_ck.get_slice(tidx)
            thr_cv = mma_cv.get_slice(tidx)
            cCC = thr_cc.partition_C(cute.make_identity_tensor((C, C)))
            cCK = thr_ck.partition_C(cute.make_identity_tensor((C, K)))
            cCV = thr_cv.partition_C(cute.make_identity_tensor((C, V)))

            def commit():
                warpgroup.commit_group()

            tv = cm.transpose_view
            b, t0, tend, _ = locate(cid, mCu, mCuC, T, NT, nseq)
            length = cutlass.max(cutlass.min(tend - t0, C), 0)
            # surplus CTAs of a varlen grid (past the last chunk) have length 0: their token loads are zeros,
            # their chunk rows (never written by the forward or the sweep) are read but only into
            # values that are never stored, since every store is predicated on length
            gQ = cute.domain_offset((t0, 0), mQ[b, None, h, None])
            gK = cute.domain_offset((t0, 0), mK[b, None, h, None])
            gV = cute.domain_offset((t0, 0), mV[b, None, hv, None])
            gDo = cute.domain_offset((t0, 0), mDo[b, None, hv, None])
            gDvn = cute.domain_offset((t0, 0), mDvn[b, None, hv, None])
            gVnI = cute.domain_offset((t0, 0), mVnI[b, None, hv, None])
            gTmI = cute.domain_offset((t0, 0), mTmI[b, None, hv, None])
            if cutlass.const_expr(TMA and not PERSIST):  # the same three groups by TMA, one mbarrier each
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                    for g in cutlass.range_constexpr(len(TMA_GROUPS)):
                        tma_group(g, ta, tma_tiles, tbar + g, b, t0, h, hv, cid)
            elif cutlass.const_expr(ASYNC and not PERSIST):
                # three cp.async groups in flight together, each waited for where it is first read: q, k and Sc
                # (before the l2norm rows and k k^T), v and do (before Z), dvn (before dw); with VNIN: the
                # forward's vn and do (before the products that run during the solve), v and dvn (before dw)
                issue_tiles(((gQ, sQ, K, 0), (gK, sK, K, 0)), length, tidx)
                issue_rows(((mHs[cid, hv, None, None], sS, V, 0),), K, tidx)
                cute.arch.cp_async_commit_group()
                if cutlass.const_expr(TMIN):  # the forward's Tm, first read after A's loop, with the second group
                    issue_tiles(((gTmI, sTm, C, 0),), length, tidx)
                if cutlass.const_expr(VNIN):
                    issue_tiles(((gVnI, sVn, V, 0), (gDo, sDo, V, 0)), length, tidx)
                    cute.arch.cp_async_commit_group()
                    issue_tiles(((gV, sV, V, 0), (gDvn, sDvn, V, 0)), length, tidx)
                else:
                    issue_tiles(((gV, sV, V, 0), (gDo, sDo, V, 0)), length, tidx)
                    cute.arch.cp_async_commit_group()
                    issue_tiles(((gDvn, sDvn, V, 0),), length, tidx)
                cute.arch.cp_async_commit_group()
            elif cutlass.const_expr(not PERSIST):  # (PERSIST: loaded before the loop or by the last tile)
                load_tiles(((gQ, sQ, K), (gK, sK, K)), length, tidx)
                load_tiles(((gV, sV, V), (gDo, sDo, V), (gDvn, sDvn, V)), length, tidx)
                load_rows(((mHs[cid, hv, None, None], sS, V),), K, tidx)
                if cutlass.const_expr(VNIN):
                    load_tiles(((gVnI, sVn, V),), length, tidx)
                if cutlass.const_expr(TMIN):
                    load_tiles(((gTmI, sTm, C),), length, tidx)
            if cutlass.const_expr(OVERLAP):  # dH, read halfway through, into L2 now
                prefetch_l2(mDH[cid, hv, None, None], K, V, K, tidx)
            chunk_rows(mGc, mB, sGc, sB, sDgc, sDb, sKdt, b, t0, hv, length, tidx, False)
            if cutlass.const_expr(PERSIST and TMA):  # every input, loaded during the last tile (or before the loop)
                for g in cutlass.range_constexpr(len(TMA_GROUPS)):
                    cute.arch.mbarrier_wait(tbar + g, it % 2)
                    zero_tails(g, tma_tiles, length, tidx)
            elif cutlass.const_expr(PERSIST):
                cute.arch.cp_async_wait_group(0)  # every input, loaded during the last tile (or before the loop)
            elif cutlass.const_expr(TMA):
                cute.arch.mbarrier_wait(tbar, 0)  # q, k
                zero_tails(0, tma_tiles, length, tidx)
            elif cutlass.const_expr(ASYNC):
                cute.arch.cp_async_wait_group(2)  # q, k, Sc
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            pmark(prof, 0)
            glast = sGc[C - 1]
            if cutlass.const_expr(l2norm):  # q, k -> their l2-normalized rows, in place (input dtype)
                l2norm_rows(sQ, sK, sRq, sRk, tidx)

            pmark(prof, 1)
            # ---- KK = k k^T -> A = beta_i KK_ij Es_ij (float32) ; Y = k Sc (not with VNIN: vn is given)
            accKK = acc_of(mma_cc, C, tidx)
            accY = acc_of(mma_cv, V, tidx)
            kk_top = not (EREG and TMIN)  # (EREG with Tm read: k k^T only where dA needs it, in the dTm group)
            if cutlass.const_expr(kk_top):
                mm1(accKK, C, sK, False, sK, False, True, tidx, WGS)
            if cutlass.const_expr(VNIN):
                if cutlass.const_expr(kk_top):
                    mma_done()
            else:
                if cutlass.const_expr(OVERLAP):
                    commit()
                mm1(accY, V, sK, False, tv(sS), True, True, tidx, WGS)  # B [N = v, K = d]: Sc [d, v] MN-major
                commit()
                warpgroup.wait_group(1 if OVERLAP else 0)  # with OVERLAP: k Sc still runs during A's loop
            # (the elementwise loops below go row by row of the thread's accumulator elements, so that
            # the per-row factors are read and exponentiated once a row)
            if cutlass.const_expr(not TMIN):  # A feeds only the solve
                for gi in cutlass.range_constexpr(len(grp_cc)):
                    i, _ = cCC[grp_cc[gi][0]]
                    gi_ = sGc[i]
                    bi = sB[i]
                    for e in grp_cc[gi]:
                        _, j = cCC[e]
                        a = Float32(0.0)
                        if i > j:
                            a = accKK[e] * cute.math.exp2((gi_ - sGc[j]) * LOG2E, fastmath=True)
                        sA[i, j] = bi * a
            if cutlass.const_expr(OVERLAP and not VNIN):
                warpgroup.wait_group(0)
            if cutlass.const_expr(ASYNC and not PERSIST):  # (PERSIST: every input is in at the top)
                if cutlass.const_expr(TMA):
                    cute.arch.mbarrier_wait(tbar + 1, 0)  # Sc, Tm, vn, do
                    zero_tails(1, tma_tiles, length, tidx)
                else:
                    cute.arch.cp_async_wait_group(1)  # v and do (VNIN: vn and do)
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
            if cutlass.const_expr(not VNIN):
                # Z = diag(beta) v - diag(beta eg) k Sc  -> sVn
                for gi in cutlass.range_constexpr(len(grp_cv)):
                    i, _ = cCV[grp_cv[gi][0]]
                    eg = cute.math.exp2(sGc[i] * LOG2E, fastmath=True)
                    bi = sB[i]
                    for e in grp_cv[gi]:
                        _, n = cCV[e]
                        sVn[i, n] = (bi * (sV[i, n].to(Float32) - eg * accY[e])).to(dtype)
            cute.arch.sync_threads()
            accQK = acc_of(mma_cc, C, tidx)
            accDq = acc_of(mma_ck, K, tidx)
            accDP = acc_of(mma_cc, C, tidx)
            if cutlass.const_expr(OVERLAP):  # q k^T and dqg = do Sc^T need no solve: in flight during it
                mm1(accQK, C, sQ, False, sK, False, True, tidx, WGS)
                mm1(accDq, K, sDo, False, sS, False, True, tidx, WGS)  # B [N = d, K = v]: Sc [d, v] K-major
                if cutlass.const_expr(VNIN):  # nor does dP = do vn^T with the forward's vn
                    mm1(accDP, C, sDo, False, sVn, False, True, tidx, WGS)
                commit()

            pmark(prof, 2)
            # ---- Tm = (I + A)^-1 (TMIN: the forward's, identity rows past the end) ; Ae -> sM (after the solve)
            if cutlass.const_expr(TMIN):
                if tidx < C and tidx >= length:
                    sTm[tidx, tidx] = Float32(1.0).to(dtype)
            else:
                solve(sA, sT, sM, tidx)
            E = acc_of(mma_cc, C, tidx)  # EREG: E = exp(gc_i - gc_j) on and below the diagonal, else 0
            for gi in cutlass.range_constexpr(len(grp_cc)):
                i, _ = cCC[grp_cc[gi][0]]
                gi_ = sGc[i]
                for e in pairs_of(grp_cc[gi]):
                    _, j = cCC[e]
                    gj0, gj1 = ld2v(sGc, j)
                    a0 = Float32(0.0)
                    a1 = Float32(0.0)
                    if cutlass.const_expr(EREG):  # once for dQK (here on the diagonal too) and dA's Ae and dKK
                        if j <= i:
                            a0 = cute.math.exp2((gi_ - gj0) * LOG2E, fastmath=True)
                        if j + 1 <= i:
                            a1 = cute.math.exp2((gi_ - gj1) * LOG2E, fastmath=True)
                        E[e] = a0
                        E[e + 1] = a1
                    else:  # Ae -> sM
                        if i > j:
                            a0 = accKK[e] * cute.math.exp2((gi_ - gj0) * LOG2E, fastmath=True)
                        if i > j + 1:
                            a1 = accKK[e + 1] * cute.math.exp2((gi_ - gj1) * LOG2E, fastmath=True)
                        st2(sM, i, j, a0, a1)
            if cutlass.const_expr(not TMIN):
                for q in cutlass.range_constexpr(C * C // THREADS):
                    idx = q * THREADS + tidx
                    i = idx // C
                    j = idx % C
                    t = Float32(0.0)
                    if i >= j:
                        t = sT[i, j]
                    sTm[i, j] = t.to(dtype)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            if cutlass.const_expr(PAIR and RELAXED):
                # sT is free: the peer may send dq into it. Per tile with Tm read, this CTA has not touched sT, so
                # the arrive orders nothing but the exchange mbarrier's init, which its init fence releases: relaxed
                # (the release form waits for every outstanding memory operation GPU-wide, the dH L2 prefetch's too)
                cute.arch.cluster_arrive_relaxed()
            elif cutlass.const_expr(PAIR):
                cute.arch.cluster_arrive()  # sT is free: the peer may send dq into it

            pmark(prof, 3)
            # ---- vn = Tm Z (not with VNIN) ; q k^T
            accVn = acc_of(mma_cv, V, tidx)
            if cutlass.const_expr(not VNIN):
                mm1(accVn, V, sTm, False, tv(sVn), True, True, tidx, WGS)  # B [N = v, K = j]: Z [j, v] MN-major
            if cutlass.const_expr(not OVERLAP):
                mm1(accQK, C, sQ, False, sK, False, True, tidx, WGS)
            mma_done()
            if cutlass.const_expr(not VNIN):
                cute.arch.sync_threads()  # every warp is done reading Z
                acc_to_tile(accVn, cCV, sVn, False)
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()

            pmark(prof, 4)
            # ---- dP = do vn^T -> dQK = scale dP E (-> sX1), pair terms dP * P (-> sA) ; dqg = do Sc^T
            if cutlass.const_expr(not (OVERLAP and VNIN)):
                mm1(accDP, C, sDo, False, sVn, False, True, tidx, WGS)
            if cutlass.const_expr(not OVERLAP):
                mm1(accDq, K, sDo, False, sS, False, True, tidx, WGS)  # B [N = d, K = v]: Sc [d, v] K-major
            mma_done()
            dqk_tiles(accDP, accQK, cCC, sX1, sA, sGc, scale, E, EREG)
            # dgc += rowsum(scale eg q * dqg); then dq = scale eg dqg + dQK k
            tmp = acc_of(mma_ck, K, tidx)  # one scratch array for every row-sum operand below
            scale_rows(accDq, tmp, cCK, grp_ck, sQ, sGc, scale, False, sDgc, tidx, False, True)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            mm1(accDq, K, sX1, False, tv(sK), True, False, tidx, WGS)  # B [N = d, K = j]: k [j, d] MN-major
            mma_done()
            if cutlass.const_expr(l2norm):
                l2norm_bwd(accDq, cCK, sQ, sRq, sRow, tmp, grp_ck, tidx)
            store_dqk(accDq, cCK, mDq, sXch, mbar, b, t0, h, hv, rank, length, 0, tidx)

            pmark(prof, 5)
            # ---- dw = -dvn Sc^T -> sDw (over do, which is no longer read)
            accDw = acc_of(mma_ck, K, tidx)
            if cutlass.const_expr(ASYNC and not PERSIST):
                if cutlass.const_expr(TMA):
                    cute.arch.mbarrier_wait(tbar + 2, 0)  # v, dvn
                    zero_tails(2, tma_tiles, length, tidx)
                else:
                    cute.arch.cp_async_wait_group(0)  # dvn
                cute.arch.fence_view_async_shared()
                cute.arch.sync_threads()
            mm1(accDw, K, sDvn, False, sS, False, True, tidx, WGS)
            mma_done()
            cute.arch.sync_threads()  # every warp is done with do and Sc
            acc_to_tile(accDw, cCK, sDw, True)
            # dH -> sS over Sc, and the tail's sum(Sc * dH) on the way
            part = swap_in_dot(mDH[cid, hv, None, None], sS, tidx)
            for off in cutlass.range_constexpr(5):
                part = part + cute.arch.shuffle_sync_bfly(part, offset=1 << off)
            if tidx % 32 == 0:
                sRed[tidx // 32] = part
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()

            pmark(prof, 6)
            # ---- dk = diag(kdec) vn dH^T + dQK^T q ; kdt = rowsum(kd * vn dH^T)
            accDk = acc_of(mma_ck, K, tidx)
            mm1(accDk, K, sVn, False, sS, False, True, tidx, WGS)  # B [N = d, K = v]: dH [d, v] K-major
            mma_done()
            scale_rows(accDk, tmp, cCK, grp_ck, sK, sGc, glast, True, sKdt, tidx, False, False)
            mm1(accDk, K, tv(sX1), True, tv(sQ), True, False, tidx, WGS)  # A [M = j, K = i]: dQK^T ; B: q [i, d] MN-major
            # ---- dkb = Tm^T dw: dk += beta eg dkb ; dbeta += rowsum(eg k dkb) ; dgc += beta eg rowsum(k dkb)
            accDkb = acc_of(mma_ck, K, tidx)
            mm1(accDkb, K, tv(sTm), True, tv(sDw), True, True, tidx, WGS)
            accDvb = acc_of(mma_cv, V, tidx)
            if cutlass.const_expr(OVERLAP):  # Tm^T dvn in flight during dkb's loop
                commit()
                mm1(accDvb, V, tv(sTm), True, tv(sDvn), True, True, tidx, WGS)
                commit()
                warpgroup.wait_group(1)
            else:
                mma_done()
            dk_add_dkb(accDk, accDkb, cCK, grp_ck, sK, sGc, sB, sDb, sDgc, tidx)
            # ---- dvb = Tm^T dvn: dv = beta dvb ; dbeta += rowsum(v dvb)
            if cutlass.const_expr(OVERLAP):
                warpgroup.wait_group(0)
            else:
                mm1(accDvb, V, tv(sTm), True, tv(sDvn), True, True, tidx, WGS)
                mma_done()
            dv_rows(accDvb, tmp, cCV, grp_cv, sV, sB, sDb, tidx, False)
            store_rows(accDvb, cCV, cute.domain_offset((t0, 0), mDv[b, None, hv, None]), length)
            if cutlass.const_expr(PERSIST):  # every warp is done with q, Sc / dH and vn: the next tile's
                cute.arch.sync_threads()
                next_part(0, ins, smem_in, ta, tma_tiles, tbar, bx + (it + 1) * nctas, nunits, by, ngrid, group, mCu,
                          mCuC, T, NT, nseq, tidx)

            pmark(prof, 7)
            # ---- dTm = (dw k^T) diag(beta eg) + (dvn v^T) diag(beta) -> sX2
            accX1 = acc_of(mma_cc, C, tidx)
            accX2 = acc_of(mma_cc, C, tidx)
            mm1(accX1, C, sDw, False, sK, False, True, tidx, WGS)
            mm1(accX2, C, sDvn, False, sV, False, True, tidx, WGS)
            accKK8 = accX1  # (unread without EREG)
            if cutlass.const_expr(EREG):  # k k^T again (sK unchanged since the top), in flight with dTm's products
                accKK8 = acc_of(mma_cc, C, tidx)
                mm1(accKK8, C, sK, False, sK, False, True, tidx, WGS)
            mma_done()
            dtm_tile(accX1, accX2, cCC, sX2, sB, sGc)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            # ---- M1 = Tm^T dTm -> sX2 ; dA = -strictly_lower(M1 Tm^T)
            # (DKKSYM: M1 -> sX1, free since dQK^T q, so no barrier for the other warpgroup's reads of dTm^T; then
            # dKK -> sX2 in dA's terms, free since every warpgroup passed the barrier after its M1 product)
            sM1 = sX1 if DKKSYM else sX2
            sDkk = sX2 if DKKSYM else sX1
            accM1 = acc_of(mma_cc, C, tidx)
            mm1(accM1, C, tv(sTm), True, sX2, False, True, tidx, WGS)  # B [N = c, K = j]: dTm^T [c, j] K-major
            mma_done()
            if cutlass.const_expr(not DKKSYM):
                cute.arch.sync_threads()
            acc_to_tile(accM1, cCC, sM1, False)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            accDA = acc_of(mma_cc, C, tidx)
            mm1(accDA, C, sM1, False, sTm, False, True, tidx, WGS)  # B [N = n, K = c]: Tm [n, c] K-major
            mma_done()
            tdb = acc_of(mma_cc, C, tidx)
            # (without EREG accKK8 and E unread: Ae from sM)
            da_terms(accDA, accKK8, tdb, cCC, grp_cc, sM, sA, sT, sGc, sB, sDb, tidx, EREG, E, EREG, sDkk, DKKSYM)
            if cutlass.const_expr(not DKKSYM):
                cute.arch.sync_threads()
                # dKK + dKK^T -> sX1 (dQK is no longer read)
                for q in cutlass.range_constexpr(C * C // THREADS):
                    idx = q * THREADS + tidx
                    i = idx // C
                    j = idx % C
                    sX1[i, j] = (sT[i, j] + sT[j, i]).to(dtype)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()
            if cutlass.const_expr(PAIR):
                cute.arch.cluster_arrive()  # sT (dKK) read: the peer may send dk into it
            if cutlass.const_expr(PERSIST):  # the next tile's v, do, dvn (and Tm), into the tiles no longer read
                next_part(1, ins, smem_in, ta, tma_tiles, tbar, bx + (it + 1) * nctas, nunits, by, ngrid, group, mCu,
                          mCuC, T, NT, nseq, tidx)
            pmark(prof, 8)
            mm1(accDk, K, sDkk, False, tv(sK), True, False, tidx, WGS)  # dk += (dKK + dKK^T) k (DKKSYM: dKK k)
            if cutlass.const_expr(DKKSYM):
                mm1(accDk, K, tv(sDkk), True, tv(sK), True, False, tidx, WGS)  # + dKK^T k: A [M = j, K = i] MN-major
            mma_done()
            if cutlass.const_expr(l2norm):
                l2norm_bwd(accDk, cCK, sK, sRk, sRow, tmp, grp_ck, tidx)
            if cutlass.const_expr(EARLYK):  # every thread is done with k (dk's products and l2norm): the next tile's,
                cute.arch.sync_threads()  # in flight during dk's store (the pair exchange), the pair sums, dg, dbeta
                next_part(2, ins, smem_in, ta, tma_tiles, tbar, bx + (it + 1) * nctas, nunits, by, ngrid, group, mCu,
                          mCuC, T, NT, nseq, tidx)
            store_dqk(accDk, cCK, mDk, sXch, mbar, b, t0, h, hv, rank, length, 1, tidx)

            pmark(prof, 9)
            # ---- dgc: pair sums, - kdt, the tail on the last row; dg = reverse cumsum ; dbeta
            pair_sums_dgc(sA, sKdt, sDgc, tidx)
            cute.arch.sync_threads()
            if cutlass.const_expr(PERSIST and not EARLYK):  # every thread is done with k: the next tile's
                next_part(2, ins, smem_in, ta, tma_tiles, tbar, bx + (it + 1) * nctas, nunits, by, ngrid, group, mCu,
                          mCuC, T, NT, nseq, tidx)
            dg_scan_store(sDgc, sKdt, sRed, sDb, glast, mDg, mDb, b, t0, hv, length, tidx)
            pmark(prof, 10)
            if cutlass.const_expr(not PERSIST):
                pfinish(prof, mProf, cid * cute.arch.grid_dim()[1] + hv, tidx)
            if cutlass.const_expr(PERSIST):
                cute.arch.sync_threads()  # the next tile's top rewrites sGc, sB, sDgc, sDb
        if cutlass.const_expr(PERSIST):  # the profile's sums over this CTA's tiles, a row per CTA (bx, by)
            pfinish(prof, mProf, bx * cute.arch.grid_dim()[1] + by, tidx)

    # ---- CHAINS (chains_default): the two-chain stage 3. Warpgroup 0 runs the q side and dk (q k^T, dP, dQK, dq;
    # vn dH^T, dQK^T q, Tm^T dw, (dKK + dKK^T) k into one dk accumulator), warpgroup 1 the w side (k k^T, dw, dvb
    # and dv, dTm, Tm^T dTm Tm^T, dA, dKK), each on whole [64, N] products, so that one's CUDA-core work and
    # barriers run while the other's products do; they hand tiles over through named barriers (each used once:
    # one arrives, the other syncs). dH comes by TMA into its own tile (a load group of its own); Sc's tile takes dKK
    # (float32) once both sides are past Sc, dw goes over do, dKK + dKK^T over dQK. PAIR: warpgroup 0 alone
    # exchanges dq, then dk, with the peer through a tile of its own: the peer arrives on this CTA's xfree mbarrier
    # (cluster scope) once it has read dq out of its tile, and dk is sent only after that.
    BAR_Q, BAR_W = 1, 2  # within warpgroup 0 / 1
    BAR_DOSC, BAR_DW, BAR_PP, BAR_DQK, BAR_KK = 3, 4, 5, 6, 7  # hand-overs: see kernel_chains
    QSLOTS = C * K // 128 // 4  # PAIR: the exchange slots of a warpgroup-0 thread
    QXCH_BYTES = QSLOTS * 128 * 8

    def bar_sync(bid, n=THREADS):
        cute.arch.barrier(barrier_id=bid, number_of_threads=n)

    def bar_arrive(bid):
        cute.arch.barrier_arrive(barrier_id=bid, number_of_threads=THREADS)

    @cute.jit
    def store_dqk_q(acc: cute.Tensor, cAcc: cute.Tensor, mX: cute.Tensor, sXch: cute.Tensor, xbar, xfree, b: Int32,
                    t0: Int32, h: Int32, hv: Int32, rank: Int32, nvalid: Int32, phase: cutlass.Constexpr, lt: Int32):
        # (CHAINS, warpgroup 0) dq (phase 0) or dk (1): per value head, or with PAIR summed over the pair
        if cutlass.const_expr(not PAIR):
            store_rows(acc, cAcc, cute.domain_offset((t0, 0), mX[b, None, hv, None]), nvalid)
        else:
            gX = cute.domain_offset((t0, 0), mX[b, None, h, None])
            if cutlass.const_expr(phase == 1):
                cute.arch.mbarrier_wait(xfree, 0)  # the peer has read this CTA's dq out of its exchange tile
                cute.arch.fence_acq_rel_cluster()  # (the wait acquires at CTA scope; the peer released at cluster)
            pair_exchange(acc, cAcc, sXch, xbar, gX, nvalid, rank, QXCH_BYTES, phase, lt)
            if cutlass.const_expr(phase == 0):
                bar_sync(BAR_Q, 128)  # every warpgroup-0 thread is done reading the exchange tile
                if lt == 0:
                    cute.arch.mbarrier_arrive(xfree, peer_cta_rank_in_cluster=1 - rank, scope=nvvm.MemScopeKind.CLUSTER)

    @cute.jit
    def dot_tiles(sX: cute.Tensor, sY: cute.Tensor, lt: Int32):
        # (one warpgroup) this thread's part of sum(sX * sY) over two [K, V] tiles, float32, 16-byte vectors
        VPR = V // 8
        RPP = 128 // VPR
        parts = [Float32(0.0), Float32(0.0)]
        for p in cutlass.range_constexpr(K // RPP):
            r = p * RPP + lt // VPR
            x = cute.make_rmem_tensor((1, 8), dtype)
            y = cute.make_rmem_tensor((1, 8), dtype)
            cute.autovec_copy(cute.local_tile(sX, (1, 8), (r, lt % VPR)), x)
            cute.autovec_copy(cute.local_tile(sY, (1, 8), (r, lt % VPR)), y)
            for e in cutlass.range_constexpr(8):
                parts[p % 2] = parts[p % 2] + x[e].to(Float32) * y[e].to(Float32)
        return parts[0] + parts[1]

    @cute.jit
    def profile_out(acc: cute.Tensor, mProf: cute.Tensor, cta: Int32, tidx: Int32):
        # (CHAINS, PROFILE) the CTA's row: thread 0's phases (the common ones, the q side's, the end) and its total,
        # thread 128's (the w side's)
        NP = len(CHAIN_PHASES)
        W_SIDE = tuple(n.startswith("w:") for n in CHAIN_PHASES) + (False,)  # (the total is thread 0's)
        acc[NP] = cute.arch.clock64() - acc[NP]
        for p in cutlass.range_constexpr(NP + 1):
            if cutlass.const_expr(W_SIDE[p]):
                if tidx == 128:
                    mProf[cta * (NP + 1) + p] = acc[p]
            else:
                if tidx == 0:
                    mProf[cta * (NP + 1) + p] = acc[p]

    @cute.kernel
    def kernel_chains(
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mGc: cute.Tensor, mB: cute.Tensor, mDo: cute.Tensor,
        mDvn: cute.Tensor, mHs: cute.Tensor, mDH: cute.Tensor, mVnI: cute.Tensor, mTmI: cute.Tensor,
        mCu: cute.Tensor, mCuC: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor,
        mDg: cute.Tensor, mDb: cute.Tensor, scale: Float32, T: Int32, NT: Int32, nseq: Int32, group: Int32,
        ngrid: Int32, mProf: cute.Tensor, aQ: cute.CopyAtom, aK: cute.CopyAtom, aV: cute.CopyAtom, aDo: cute.CopyAtom,
        aDvn: cute.CopyAtom, aVn: cute.CopyAtom, aTm: cute.CopyAtom, aS: cute.CopyAtom, aH: cute.CopyAtom,
        tQ: cute.Tensor, tK: cute.Tensor, tV: cute.Tensor, tDo: cute.Tensor, tDvn: cute.Tensor, tVn: cute.Tensor,
        tTm: cute.Tensor, tS: cute.Tensor, tH: cute.Tensor,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cid, hv, _ = cute.arch.block_idx()
        h = hv // group
        lt = tidx % 128  # the thread within its warpgroup
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        pstart, pmark, _ = fwd.make_profile(PROFILE, len(CHAIN_PHASES))
        prof = pstart()

        # whole [64, N] products on one warpgroup (wgs = 1)
        mma_cc = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False)
        mma_ck = cm.make_mma(dtype, K, a_regs=False, b_mn_major=False)
        mma_cv = cm.make_mma(dtype, V, a_regs=False, b_mn_major=False)
        threads = cm.sample_threads(1)
        grp_cc = cm.quad_row_groups(mma_cc, (C, C), threads)
        grp_ck = cm.quad_row_groups(mma_ck, (C, K), threads)
        grp_cv = cm.quad_row_groups(mma_cv, (C, V), threads)
        cm.check_acc_pairs(mma_cc, (C, C), threads)
        cm.check_acc_pairs(mma_ck, (C, K), threads)
        cm.check_acc_pairs(mma_cv, (C, V), threads)

        smem = cutlass.utils.SmemAllocator()
        sQ = cm.alloc_tile(smem, dtype, C, K, SW)
        sK = cm.alloc_tile(smem, dtype, C, K, SW)
        sV = cm.alloc_tile(smem, dtype, C, V, SW)
        sDo = cm.alloc_tile(smem, dtype, C, V, SW)  # do, then dw
        sDvn = cm.alloc_tile(smem, dtype, C, V, SW)
        sVn = cm.alloc_tile(smem, dtype, C, V, SW)
        sS = cm.alloc_tile(smem, dtype, K, V, SW)  # Sc, then dKK (float32, sT)
        sH = cm.alloc_tile(smem, dtype, K, V, SW)  # dH
        sTm = cm.alloc_tile(smem, dtype, C, C)
        sX1 = cm.alloc_tile(smem, dtype, C, C)  # dQK, then dKK + dKK^T
        sX2 = cm.alloc_tile(smem, dtype, C, C)  # dTm^T, then Tm^T dTm
        lf = cute.make_layout((C, C), stride=(cm.A_STRIDE, 1))
        sA = smem.allocate_tensor(Float32, lf, 16)  # the pair-sum terms dP * P + dA * A
        sT = cute.make_tensor(cute.recast_ptr(sS.iterator, dtype=Float32), lf)  # dKK, over Sc
        sGc = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sB = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        lw = cute.make_layout((WGS, C), stride=(C, 1))  # a row of C per warpgroup: its part of a row sum
        sDgc = smem.allocate_tensor(Float32, lw, 16)
        sDb = smem.allocate_tensor(Float32, lw, 16)
        sKdt = smem.allocate_tensor(Float32, lw, 16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout(THREADS // 32), 16)
        sRq = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)
        sRow = smem.allocate_tensor(Float32, lw, 16)
        sDw = sDo
        ta = (aQ, aK, aV, aDo, aDvn, aVn, aTm, aS, aH, tQ, tK, tV, tDo, tDvn, tVn, tTm, tS, tH)
        tma_tiles = (sQ, sK, sV, sDo, sDvn, sVn, sTm, sS, sH)
        tbar = smem.allocate_array(cutlass.Int64, len(TMA_GROUPS), byte_alignment=8)
        sXch = None
        xbar = None
        xfree = None
        rank = Int32(0)
        if cutlass.const_expr(PAIR):
            sXch = smem.allocate_tensor(Float32, cute.make_layout((QSLOTS, 128, 2), stride=(256, 2, 1)), 16)
            xbar = smem.allocate_array(cutlass.Int64, 2, byte_alignment=8)
            xfree = xbar + 1
            rank = cute.arch.block_idx_in_cluster()
            if tidx == 0:
                cute.arch.mbarrier_init(xbar, 1)
                cute.arch.mbarrier_init(xfree, 1)
        init_barriers(tbar, len(TMA_GROUPS), ta[:len(TMA_NAMES)], 0)  # (its fence and CTA barrier cover xbar's)
        if cutlass.const_expr(PAIR):  # the peer's mbarriers are initialized before any remote arrive or send
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

        tv = cm.transpose_view
        cCC = mma_cc.get_slice(lt).partition_C(cute.make_identity_tensor((C, C)))
        cCK = mma_ck.get_slice(lt).partition_C(cute.make_identity_tensor((C, K)))
        cCV = mma_cv.get_slice(lt).partition_C(cute.make_identity_tensor((C, V)))
        b, t0, tend, _ = locate(cid, mCu, mCuC, T, NT, nseq)
        length = cutlass.max(cutlass.min(tend - t0, C), 0)
        if warp == 0:
            for g in cutlass.range_constexpr(len(TMA_GROUPS)):
                tma_group(g, ta, tma_tiles, tbar + g, b, t0, h, hv, cid)
        chunk_rows(mGc, mB, sGc, sB, sDgc, sDb, sKdt, b, t0, hv, length, tidx, True)
        if tidx < THREADS // 32:
            sRed[tidx] = Float32(0.0)  # (the w side's warps write theirs)
        cute.arch.mbarrier_wait(tbar, 0)  # q, k
        # a partial chunk: every group in and its rows past the end zeroed before either side starts. (Tm's rows
        # past the end stay zero, where the per-tile kernel puts ones on the diagonal: they only meet rows and
        # columns of dw, dvn, dTm past the end, which are zero (zeroed tails, beta = 0 there), and reach no stored
        # output.)
        if length < C:
            for g in cutlass.range_constexpr(len(TMA_GROUPS)):
                cute.arch.mbarrier_wait(tbar + g, 0)
                zero_tails(g, tma_tiles, length, tidx)
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        pmark(prof, 0)
        glast = sGc[C - 1]
        if cutlass.const_expr(l2norm):
            l2norm_rows(sQ, sK, sRq, sRk, tidx)
        pmark(prof, 1)

        if warp < 4:
            # ======== warpgroup 0: q k^T, dP, dQK, dq; then dk
            accQK = acc_of(mma_cc, C, lt)
            accDP = acc_of(mma_cc, C, lt)
            accDq = acc_of(mma_ck, K, lt)
            mm1(accQK, C, sQ, False, sK, False, True, lt)
            cute.arch.mbarrier_wait(tbar + 1, 0)  # Sc, Tm, vn, do
            mm1(accDP, C, sDo, False, sVn, False, True, lt)  # dP = do vn^T
            mm1(accDq, K, sDo, False, sS, False, True, lt)  # dqg = do Sc^T; B [N = d, K = v]: Sc [d, v] K-major
            mma_done()
            bar_arrive(BAR_DOSC)  # do and Sc read: the w side may write dw over do, dKK over Sc
            pmark(prof, 2)
            # dQK = scale dP E -> sX1 ; the pair terms dP * P -> sA
            dqk_tiles(accDP, accQK, cCC, sX1, sA, sGc, scale, accQK, False)  # (E unread)
            bar_arrive(BAR_PP)  # dP * P in sA: the w side adds dA * A
            # dgc += rowsum(scale eg q * dqg); then dq = scale eg dqg + dQK k
            tmp = acc_of(mma_ck, K, lt)
            scale_rows(accDq, tmp, cCK, grp_ck, sQ, sGc, scale, False, sDgc, tidx, True, True)
            cute.arch.fence_view_async_shared()
            bar_sync(BAR_Q, 128)  # dQK in sX1
            pmark(prof, 3)
            mm1(accDq, K, sX1, False, tv(sK), True, False, lt)  # B [N = d, K = j]: k [j, d] MN-major
            mma_done()
            if cutlass.const_expr(l2norm):
                l2norm_bwd(accDq, cCK, sQ, sRq, sRow, tmp, grp_ck, tidx, True)
            store_dqk_q(accDq, cCK, mDq, sXch, xbar, xfree, b, t0, h, hv, rank, length, 0, lt)
            pmark(prof, 4)
            # dk = diag(kdec) vn dH^T (kdt = rowsum(kd * vn dH^T)) + dQK^T q + beta eg Tm^T dw + (dKK + dKK^T) k
            cute.arch.mbarrier_wait(tbar + 3, 0)  # dH
            if cutlass.const_expr(CHAINS == 2):
                cute.arch.mbarrier_wait(tbar + 2, 0)  # v, dvn (for dvb below)
            accDk = acc_of(mma_ck, K, lt)
            mm1(accDk, K, sVn, False, sH, False, True, lt)  # B [N = d, K = v]: dH [d, v] K-major
            accDvbQ = None
            if cutlass.const_expr(CHAINS == 2):  # dvb = Tm^T dvn here, in flight with vn dH^T
                accDvbQ = acc_of(mma_cv, V, lt)
                mm1(accDvbQ, V, tv(sTm), True, tv(sDvn), True, True, lt)
            mma_done()
            scale_rows(accDk, tmp, cCK, grp_ck, sK, sGc, glast, True, sKdt, tidx, True, True)
            mm1(accDk, K, tv(sX1), True, tv(sQ), True, False, lt)  # A [M = j, K = i]: dQK^T ; B: q [i, d] MN-major
            if cutlass.const_expr(CHAINS == 2):  # dv = beta dvb, dbeta += rowsum(v dvb) while dQK^T q runs
                warpgroup.commit_group()
                dv_rows(accDvbQ, tmp, cCV, grp_cv, sV, sB, sDb, tidx, True)
                store_rows(accDvbQ, cCV, cute.domain_offset((t0, 0), mDv[b, None, hv, None]), length)
                warpgroup.wait_group(0)
            else:
                mma_done()
            bar_arrive(BAR_DQK)  # dQK read: the w side may write dKK + dKK^T over it
            pmark(prof, 5)
            bar_sync(BAR_DW)  # dw in its tile
            pmark(prof, 6)
            accDkb = acc_of(mma_ck, K, lt)
            mm1(accDkb, K, tv(sTm), True, tv(sDw), True, True, lt)  # dkb = Tm^T dw
            mma_done()
            dk_add_dkb(accDk, accDkb, cCK, grp_ck, sK, sGc, sB, sDb, sDgc, tidx)
            pmark(prof, 7)
            bar_sync(BAR_KK)  # dKK + dKK^T in sX1
            pmark(prof, 8)
            mm1(accDk, K, sX1, False, tv(sK), True, False, lt)  # dk += (dKK + dKK^T) k
            mma_done()
            if cutlass.const_expr(l2norm):
                l2norm_bwd(accDk, cCK, sK, sRk, sRow, tmp, grp_ck, tidx, True)
            store_dqk_q(accDk, cCK, mDk, sXch, xbar, xfree, b, t0, h, hv, rank, length, 1, lt)
            pmark(prof, 9)
        else:
            # ======== warpgroup 1: dw, dvb and dv, dTm, k k^T (Ae), Tm^T dTm Tm^T, dA, dKK
            accKK = None
            if cutlass.const_expr(CHAINS == 2):  # k k^T first, while Sc and dvn land (no dvb accumulator here)
                accKK = acc_of(mma_cc, C, lt)
                mm1(accKK, C, sK, False, sK, False, True, lt)
                warpgroup.commit_group()
            cute.arch.mbarrier_wait(tbar + 1, 0)  # Sc, Tm
            cute.arch.mbarrier_wait(tbar + 2, 0)  # v, dvn
            accDw = acc_of(mma_ck, K, lt)
            mm1(accDw, K, sDvn, False, sS, False, True, lt)  # dvn Sc^T
            warpgroup.commit_group()
            accDvb = None
            if cutlass.const_expr(CHAINS == 1):  # (2: on the q side)
                accDvb = acc_of(mma_cv, V, lt)
                mm1(accDvb, V, tv(sTm), True, tv(sDvn), True, True, lt)  # dvb = Tm^T dvn
                warpgroup.commit_group()
                warpgroup.wait_group(1)  # dvn Sc^T
            else:
                warpgroup.wait_group(0)
            pmark(prof, 10)
            bar_sync(BAR_DOSC)  # the q side is done with do and Sc
            pmark(prof, 11)
            acc_to_tile(accDw, cCK, sDw, True)  # dw = -dvn Sc^T over do
            cute.arch.fence_view_async_shared()
            bar_arrive(BAR_DW)
            if cutlass.const_expr(CHAINS == 1):
                warpgroup.wait_group(0)  # Tm^T dvn
                # dv = beta dvb ; dbeta += rowsum(v dvb)
                tmpv = acc_of(mma_cv, V, lt)
                dv_rows(accDvb, tmpv, cCV, grp_cv, sV, sB, sDb, tidx, True)
                store_rows(accDvb, cCV, cute.domain_offset((t0, 0), mDv[b, None, hv, None]), length)
            pmark(prof, 12)
            # dTm = (dw k^T) diag(beta eg) + (dvn v^T) diag(beta) -> sX2 as dTm^T
            bar_sync(BAR_W, 128)  # every warpgroup-1 thread's dw is in its tile
            accX1 = acc_of(mma_cc, C, lt)
            accX2 = acc_of(mma_cc, C, lt)
            mm1(accX1, C, sDw, False, sK, False, True, lt)
            mm1(accX2, C, sDvn, False, sV, False, True, lt)
            # k k^T (for Ae, read in the dA loop) issued here rather than first with dvb on this side: its
            # accumulator then lives through the last products only, not through dw and dvb's (ptxas spilled with
            # it held from the start)
            if cutlass.const_expr(CHAINS == 1):
                accKK = acc_of(mma_cc, C, lt)
                mm1(accKK, C, sK, False, sK, False, True, lt)
            warpgroup.commit_group()
            # while they run: the tail's sum(Sc * dH), a part a warp (Sc and dH as stage 3 reads them, in the input
            # dtype; here, where few accumulators are in flight, so its loads do not raise the register count)
            cute.arch.mbarrier_wait(tbar + 3, 0)  # dH
            part = dot_tiles(sS, sH, lt)
            for off in cutlass.range_constexpr(5):
                part = part + cute.arch.shuffle_sync_bfly(part, offset=1 << off)
            if tidx % 32 == 0:
                sRed[tidx // 32] = part
            warpgroup.wait_group(0)
            pmark(prof, 13)
            dtm_tile(accX1, accX2, cCC, sX2, sB, sGc)
            cute.arch.fence_view_async_shared()
            bar_sync(BAR_W, 128)
            # M1 = Tm^T dTm -> sX2 ; dA = -strictly_lower(M1 Tm^T)
            accM1 = acc_of(mma_cc, C, lt)
            mm1(accM1, C, tv(sTm), True, sX2, False, True, lt)  # B [N = c, K = j]: dTm^T [c, j] K-major
            mma_done()
            bar_sync(BAR_W, 128)  # every warpgroup-1 warp is done reading dTm^T
            acc_to_tile(accM1, cCC, sX2, False)
            cute.arch.fence_view_async_shared()
            bar_sync(BAR_W, 128)
            pmark(prof, 14)
            accDA = acc_of(mma_cc, C, lt)
            mm1(accDA, C, sX2, False, sTm, False, True, lt)  # B [N = n, K = c]: Tm [n, c] K-major
            mma_done()
            pmark(prof, 15)
            bar_sync(BAR_PP)  # dP * P in sA
            pmark(prof, 16)
            tdb = acc_of(mma_cc, C, lt)
            # (sM and E unread)
            da_terms(accDA, accKK, tdb, cCC, grp_cc, sA, sA, sT, sGc, sB, sDb, tidx, True, accKK, False, sT, False)
            bar_sync(BAR_W, 128)  # dKK whole in sT
            pmark(prof, 17)
            bar_sync(BAR_DQK)  # the q side is done with dQK
            for q in cutlass.range_constexpr(C * C // 128):  # dKK + dKK^T -> sX1
                idx = q * 128 + lt
                i = idx // C
                j = idx % C
                sX1[i, j] = (sT[i, j] + sT[j, i]).to(dtype)
            cute.arch.fence_view_async_shared()
            bar_arrive(BAR_KK)
            pmark(prof, 18)
        cute.arch.sync_threads()
        pmark(prof, 19)
        # dgc: pair sums, - kdt, the tail on the last row; dg = reverse cumsum ; dbeta
        pair_sums_dgc(sA, sKdt, sDgc, tidx)
        cute.arch.sync_threads()
        dg_scan_store(sDgc, sKdt, sRed, sDb, glast, mDg, mDb, b, t0, hv, length, tidx)
        pmark(prof, 20)
        if cutlass.const_expr(PROFILE):
            profile_out(prof, mProf, cid * cute.arch.grid_dim()[1] + hv, tidx)

    @cute.jit
    def host(
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mGc: cute.Tensor, mB: cute.Tensor, mDo: cute.Tensor,
        mDvn: cute.Tensor, mHs: cute.Tensor, mDH: cute.Tensor, mVnI: cute.Tensor, mTmI: cute.Tensor,
        mCu: cute.Tensor, mCuC: cute.Tensor, mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor,
        mDg: cute.Tensor, mDb: cute.Tensor, scale: Float32, T: Int32, NT: Int32, nseq: Int32, group: Int32,
        nchunks_grid: Int32, nctas: Int32,
        mProf: cute.Tensor, stream,
    ):
        _static_checks(dtype, K, V, WGS)
        if cutlass.const_expr(CHAINS):  # its products on one warpgroup each
            _static_checks(dtype, K, V, 1)
        HV = mV.shape[2]
        grid = [nctas, PW, 1] if PERSIST else [nchunks_grid, HV, 1]  # PERSIST: nctas CTAs (clusters) walk the tiles
        srcs = (mQ, mK, mV, mDo, mDvn, mVnI, mTmI, mHs, mDH)[:len(TMA_NAMES)]  # in TMA_NAMES order
        if cutlass.const_expr(TMA):
            atoms, tmas = [], []
            for name, m in zip(TMA_NAMES, srcs):
                if cutlass.const_expr(name in STATES):  # [rows, HV, K, V] -> (K, V, rows, HV): a chunk row's state
                    view = cute.make_tensor(m.iterator, cute.select(m.layout, mode=[2, 3, 0, 1]))
                    a, t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), view,
                                                       cm.smem_tile_layout(dtype, K, V, SW), (K, V))
                else:  # the token tiles: (C rows, their columns)
                    a, t = cm.make_tma_rows_atom(dtype, m, C, TMA_COLS[name], 128 if name == "tm" else SW)
                atoms.append(a)
                tmas.append(t)
        else:  # placeholders, never used
            atoms = [cute.make_copy_atom(cpasync.CopyG2SOp(), dtype, num_bits_per_copy=128)] * len(TMA_NAMES)
            tmas = list(srcs)
        body = kernel_chains if CHAINS else kernel
        body(mQ, mK, mV, mGc, mB, mDo, mDvn, mHs, mDH, mVnI, mTmI, mCu, mCuC, mDq, mDk, mDv, mDg, mDb, scale, T,
             NT, nseq, group, nchunks_grid, mProf, *atoms, *tmas).launch(grid=grid, block=[THREADS, 1, 1], stream=stream,
                                                          **({"cluster": [1, 2, 1]} if PAIR else {}))

    f = fwd._fakes()
    args = (
        f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, V), f.any3(Float32), f.any3(Float32), f.rows4(dtype, V),
        f.rows4(dtype, V), f.rows4(dtype, V), f.rows4(dtype, V), f.rows4(dtype, V), f.rows4(dtype, C),
        f.vec(cutlass.Int32), f.vec(cutlass.Int32),
        f.rows4(dqk_dtype or Float32, K), f.rows4(dqk_dtype or Float32, K), f.rows4(dtype, V), f.any3(Float32),
        f.any3(Float32), Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), f.vec(cutlass.Int64),
        f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


def _static_checks(dtype, K: int, V: int, wgs: int) -> None:
    """Layout facts the kernel relies on, asserted while tracing (no GPU needed)."""
    if K != V:
        raise AssertionError("the dw tile reuses the do tile: K == V")
    if CHUNK != 64 or (128 * wgs) % CHUNK or 128 * wgs // 32 > 32:
        raise AssertionError("the dgc tail: two rows a lane of one warp, every row's threads in one warp")
    for rows, cols in ((CHUNK, K), (CHUNK, V), (K, V)):
        cm.check_mn_major_view(dtype, rows, cols, _swizzle(K, wgs))
    cm.check_mn_major_view(dtype, CHUNK, CHUNK)
    threads = cm.sample_threads(wgs)
    for n in (CHUNK, K, V):
        base = cm.make_mma(dtype, n, False, False, wgs=wgs)
        for a_mn in (False, True):
            for b_mn in (False, True):
                cm.check_same_acc_layout(base, cm.make_mma(dtype, n, False, b_mn, a_mn, wgs), (64, n), threads)
    # the row sums of every layout update a row from one and the same thread (lane 0 of its quad)
    _, cute = kc.import_cute()
    for t in threads:
        rows = set()
        for n in (CHUNK, K, V):
            mma = cm.make_mma(dtype, n, False, False, wgs=wgs)
            c = mma.get_slice(t).partition_C(cute.make_identity_tensor((64, n)))
            rows.add(frozenset(tuple(c[e])[0] for e in range(cute.size(c))))
        if len(rows) != 1:
            raise AssertionError(f"thread {t} holds different rows in the [64, N] accumulators")


def overlap_default(K: int, wgs: int) -> bool:
    """The variant that keeps products in flight during the CUDA-core work that does not need them
    (k Sc during A's loop; q k^T and do Sc^T during the solve; Tm^T dvn during dkb's loop) and
    prefetches dH into L2 at the start: the default at K = 128 (H200, B4 T4096 H16 HV32, two
    warpgroups: 1.48 ms against 1.60, results bitwise equal; ``tools/time_gdn_dchunk.py``) on two
    or four warpgroups (the counts its GPU cases cover), off at K = 64 until timed there.
    ``CUDNN_TRAIN_GDN_DCHUNK_OVERLAP`` = 1 / 0 overrides."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHUNK_OVERLAP", K == 128 and wgs > 1)


def async_loads_default() -> bool:
    """The loads by ``cp.async`` in three groups, each waited for where it is first read (q, k, Sc before
    the l2norm rows; v, do before Z; dvn before dw) instead of three synchronous rounds before any work:
    the loads took 21% of a CTA's cycles (9.3K of 44.5K, H200, B4 T4096 H16 HV32,
    ``tools/time_gdn_dchunk.py --profile``). ``CUDNN_TRAIN_GDN_DCHUNK_ASYNC_LOADS`` = 1 / 0 overrides. (Also
    prefetching, at the start, the inputs of the CTA one SM count further on into L2 made it slower: 1.70
    against 1.48 ms, the loads phase 15K cycles; removed.)"""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHUNK_ASYNC_LOADS", True)


def persist_default() -> bool:
    """``CUDNN_TRAIN_GDN_DCHUNK_PERSIST=1``: the persistent variant, a CTA per SM (a cluster of two per two
    SMs with the pair sum) walking its tiles in turn, the next tile's inputs loaded by ``cp.async`` during the
    current one's last three phases, each into its tile as soon as that is no longer read (q, Sc, vn after the
    dk phase; v, do, dvn, Tm after dTm / dA; k after the pair sums), so that the loads (17-20% of a CTA's
    cycles in the profile) overlap work instead of starting every CTA. Bitwise the per-tile kernel on the
    H200 but slower there (eleventh session: 1.353 vs 1.253 ms at B4 T4096 H16 HV32): off. Not profiled then; its
    profile variant (sums over each CTA's tiles, ``time_gdn_dchunk.py --persist``) is prepared since the fifteenth
    session, to say where its extra cycles go (ptxas: 255 registers against 227). With the paired accesses
    (twenty-first session, H100, B4 T4096): 1.216 against 1.223 ms per tile, the same within noise; its profile's
    loads phase 7.4% of a tile's cycles against 14.3%, but every later phase slower: still off. **On by default since
    the twenty-eighth session** (``=0`` turns it off), together with :func:`ereg_default`: persistent with E in
    registers is the fast pair (H100 B4 T4096, stage 3 alone 1.14 against 1.19-1.21 ms per tile; the op's graphed
    forward+backward 2.398 / 2.388 against 2.449 / 2.451 ms), and the GDN kernel tiers (359 cases) and the
    training tier's kernel half ran green with both on."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHUNK_PERSIST", True)


def tma_default() -> bool:
    """``CUDNN_TRAIN_GDN_DCHUNK_TMA`` (on unless 0): the training path's stage 3 (vn and Tm read, cp.async loads) loads its
    tiles by TMA instead: one elected thread of warp 0 issues each group's bulk copies on the group's mbarrier
    (per tile: q, k; Sc, Tm, vn, do; v, dvn, each waited for where first read; persistent: the three parts, each
    issued once its tiles are no longer read), so no warp spends issue slots on 16-byte copies and their
    addresses. Rows past a varlen sequence's end are zeroed once landed, as cp.async zero-fills them: the same
    bits. Measured (sixteenth session, bitwise): 1.228 against 1.263 ms at B4 T4096 H16 HV32."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHUNK_TMA", True)


def chains_default() -> int:
    """``CUDNN_TRAIN_GDN_DCHUNK_CHAINS=1``: the two-chain stage 3 (off: measured slower; ``=2``: the same
    with dvb = Tm^T dvn and dv moved to the q side, in flight with its vn dH^T and dQK^T q, so that the w side's chain
    is shorter by them; 0 or unset: the per-tile kernel). The per-tile
    kernel splits the N of every product between its two warpgroups, so both walk one chain of some twenty
    dependent steps a chunk (products, CUDA-core loops, CTA barriers): latency-bound at one CTA an SM (its 204 KB).
    The variant gives each warpgroup whole [64, N] products of its own chain: warpgroup 0 the q side and dk
    (q k^T, dP, dQK, dq; then vn dH^T, dQK^T q, Tm^T dw and (dKK + dKK^T) k into one dk accumulator), warpgroup 1
    the w side (k k^T, dw, dvb and dv, dTm, Tm^T dTm Tm^T, dA, dKK), handing tiles over by named barriers, so that
    one side's CUDA-core work runs while the other's products do. The same products and rounding points as the
    per-tile kernel (dw, dQK, dTm^T, Tm^T dTm, dKK + dKK^T rounded to the input dtype where it rounds them), only
    the row sums' order differs (one warpgroup sums a whole row). It is the first step of the fused backward's plan
    (docs/PERFORMANCE.md): a chain warpgroup carrying dH across the chunks would join these two. Only the training
    path's call per tile (vn and Tm read, TMA loads, two warpgroups) at K = V = 128. Measured (H200, nineteenth
    session, ``tools/time_gdn_dchunk.py --chains``, B4 T4096 H16 HV32, pair sum): 1.905 / 1.937 ms (forms 1 / 2)
    against 1.228 per tile, 55.7 K cycles a CTA against about 34 K: each side's CUDA-core loops run on 128
    threads instead of 256, so every side alone is about as long as the per-tile kernel's whole chunk."""
    env = os.environ.get("CUDNN_TRAIN_GDN_DCHUNK_CHAINS", "").strip()
    if env not in ("", "0", "1", "2"):
        raise ValueError(f"CUDNN_TRAIN_GDN_DCHUNK_CHAINS={env!r}: expected 0, 1 or 2")
    return int(env or 0)


def relaxed_default() -> bool:
    """``CUDNN_TRAIN_GDN_DCHUNK_RELAXED=1`` (off: GPU-run in the twenty-first session, bitwise but slower, H100 B4
    T4096 1.221 / 1.204 ms against 1.204 / 1.195 for the release form): with the GVA pair
    sum per tile and the forward's Tm read, the cluster arrive that lets the peer CTA send dq into this CTA's sT
    is the relaxed form. This CTA has not touched sT by then (no solve with Tm read), so the arrive has nothing to
    order but the exchange mbarrier's initialization, which its ``fence.mbarrier_init.release.cluster`` releases
    (CUTLASS's pattern for pipeline barriers). The release form compiles to ``MEMBAR.ALL.GPU; ERRBAR;
    CGAERRBAR`` before ``UCGABAR_ARV``: it waits for every memory operation in flight, the dH L2 prefetch's
    included; Nsight Compute put 2.0% of stage 3's stall samples on that ``ERRBAR`` (twentieth session). The
    second arrive (after the dKK + dKK^T loop has read sT) keeps its release. The same bits either way."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHUNK_RELAXED", False)


def ereg_default() -> bool:
    """``CUDNN_TRAIN_GDN_DCHUNK_EREG`` (on by default since the twenty-eighth session, with :func:`persist_default`;
    ``=0`` turns it off; GPU-run in the twenty-fifth session, not faster per tile, faster persistent): the per-tile
    and persistent kernels compute ``E = exp(gc_i - gc_j)`` once, into 16 float32 registers a thread, in the window
    where q k^T, do Sc^T and do vn^T are in flight, and both later users read it: dQK's tile (``dqk_tiles``) and dA's
    terms (``da_terms``: Ae = KK E, dKK = beta dA E), which each exponentiated it again (71 ``ex2`` a thread in the
    PTX, 39 with it; 38 shared loads and 8 stores fewer). Ae no longer goes through the float32 tile sM: ``da_terms``
    forms it from k k^T's accumulator, and with the forward's Tm read that product moves from the top of the chunk
    (issued and waited alone) to the dTm products' group, in flight with them. dq, dk, dv and dg are bitwise the
    default's; dbeta differs in the last bits (rel L2 4.7e-10: its row sums of dA * Ae contract into FMAs, since
    the branch holding Ae no longer loads or exponentiates and LLVM if-converts it). ptxas: 246 registers a thread
    per tile against 145 (no spill; one CTA an SM either way), 255 and 44 bytes spilled persistent. H100, B4 T4096
    H16 HV32, the training path's call (``tools/time_gdn_dchunk.py --ereg``, two alternating rounds): per tile
    1.217 / 1.201 ms against 1.202 / 1.191; persistent 1.150 / 1.140 against 1.223 / 1.212."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHUNK_EREG", True)


def dkk_sym_default() -> bool:
    """``CUDNN_TRAIN_GDN_DCHUNK_DKKSYM=1`` (twenty-eighth session, second form; GPU-run in the twenty-ninth: no gain,
    off): the per-tile and persistent kernels write dKK from dA's terms (``da_terms``) into an input-dtype tile (element
    pairs, as they went into the float32 tile sT) and add ``dKK k`` and ``dKK^T k`` to dk as two products (the second
    reads the tile transposed), instead of a pass over C x C elements that read sT twice (once transposed) and wrote
    ``dKK + dKK^T``: one CTA barrier and 16 such iterations a thread fewer. And ``Tm^T dTm`` goes into the tile dQK held
    (free by then), so writing it waits for no other warpgroup's reads of dTm^T: a second barrier fewer (dKK then takes
    dTm^T's tile). dq, dv, dg, dbeta as without it (dbeta to float32 rounding with E in registers); dk sums the same
    products in another order. The first form (GPU-run in the twenty-eighth session) wrote each strictly lower element
    to (i, j) and (j, i) of a ``dKK + dKK^T`` tile, bitwise the round trip: per tile 1.204 / 1.198 ms against 1.209 /
    1.192, persistent 1.202 / 1.184 against 1.228 / 1.210, but persistent with E in registers (the default) **1.323 /
    1.321 against 1.140 / 1.140**: its transposed 2-byte stores' addresses pushed ptxas to spill at 255 registers (32
    bytes against 4). The second form stores pairs only. GPU-run (twenty-ninth session, H100, ``gpu_next.sh s44``): its
    7 cases passed (dk within 4.4e-6 / 6.3e-6 relative L2 of the round trip, the rest bitwise), and B4 T4096 per tile
    1.202 / 1.198 ms against 1.197 / 1.198, persistent 1.203 / 1.200 against 1.215 / 1.202, persistent with E in
    registers (the default) **1.154 / 1.157 against 1.142 / 1.144**: no gain where it would count, so off."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHUNK_DKKSYM", False)


def norm8_default() -> bool:
    """``CUDNN_TRAIN_GDN_DCHUNK_NORM8=1`` (thirty-third session; GPU-run the same session: no gain, off): the l2norm factors of the
    q and k rows (the "l2norm rows" phase, 2.4K of the persistent kernel's 34.2K cycles a tile in the twenty-ninth
    session's profile) summed by every thread, eight a row with three butterfly shuffles
    (``gated_delta_rule_common_sm90.make_rows_inv_norm``, the forward's specialized warpgroups' form), instead of a
    thread a row on 128 of the threads, whose 16-byte reads of one column of 32 rows conflict four ways; and each
    thread scales the vectors its sums loaded, so the rows are normalized in the same pass (one CTA barrier and one
    read of the tiles fewer; the same scaling of the same values). Another summation order: the factors, and so
    every output, may differ in their last bits (B4: dq, dk 2e-5, dg 9e-6, dbeta 5e-7 relative L2, dv bitwise). H100,
    B4 T4096 H16 HV32: the phase 2,522 -> 1,697 cycles a CTA in the per-tile profile, but the training path's
    persistent call 1.147 against 1.140 ms (four alternating pairs): the shorter phase is absorbed."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHUNK_NORM8", False)


def early_k_default() -> bool:
    """``CUDNN_TRAIN_GDN_DCHUNK_EARLYK=1`` (thirty-third session; GPU-run in the thirty-fourth, H100: its four cases
    bitwise, the persistent training call 1.159 / 1.142 ms against 1.161 / 1.140, the op's forward+backward within
    noise, so off): the persistent
    kernel issues the next tile's k (its last input part, 16 KB) right after this tile's last reads of k (the dk
    products and the l2norm backward, then a CTA barrier), instead of after dk's store, the pair sums and a barrier:
    the load is then in flight during dk's store (with the pair sum, the exchange with the peer), the pair sums and dg,
    dbeta, where it had only dg's scan and stores before the next tile's top waits for it. That wait is the
    persistent kernel's "loads landed" phase, 2.7K of its 34.2K cycles a tile (twenty-ninth session's profile); the
    thirty-third session found the tile's top phases waiting rather than computing (a shorter l2norm phase gained
    nothing). One CTA barrier more a tile; the same operations on the same values, so the same bits."""
    return cm.env_switch("CUDNN_TRAIN_GDN_DCHUNK_EARLYK", False)


def get_dchunk_kernel(dtype, K, V, varlen, l2norm, wgs=None, overlap=None, dqk_dtype=torch.float32, pair=False,
                      profile=False, async_loads=None, vn_in=False, tm_in=False, persist=False, tma=False,
                      chains=0, relaxed=False, ereg=False, dkk_sym=False, norm8=False, early_k=False):
    wgs = warpgroups(K) if wgs is None else wgs
    overlap = overlap_default(K, wgs) if overlap is None else bool(overlap)
    overlap = overlap and not chains  # (the two-chain kernel has no such variant: one cache entry)
    async_loads = async_loads_default() if async_loads is None else bool(async_loads)
    if dqk_dtype not in (torch.float32, dtype):
        raise ValueError(f"dqk_dtype {dqk_dtype}: float32 or the input dtype {dtype}")
    key = ("dchunk", str(dtype), K, V, bool(varlen), bool(l2norm), wgs) + (("overlap",) if overlap else ()) + (
        () if dqk_dtype == torch.float32 else (("dqk", str(dqk_dtype)),)) + (("pair",) if pair else ()) + (
        ("profile",) if profile else ()) + (("async",) if async_loads else ()) + (("vn_in",) if vn_in else ()) + (
        ("tm_in",) if tm_in else ()) + (("persist",) if persist else ()) + (("tma",) if tma else ()) + (
        ("chains",) if chains else ()) + (("dvq",) if chains == 2 else ()) + (("relaxed",) if relaxed else ()) + (
        ("ereg",) if ereg else ()) + (("dkksym",) if dkk_sym else ()) + (("norm8",) if norm8 else ()) + (
        ("early_k",) if early_k else ())

    def build():
        return _build_dchunk(fwd._dt(dtype), K, V, varlen, l2norm, wgs, overlap,
                             None if dqk_dtype == torch.float32 else fwd._dt(dqk_dtype), bool(pair), bool(profile),
                             async_loads, bool(vn_in), bool(tm_in), bool(persist), bool(tma), int(chains),
                             bool(relaxed), bool(ereg), bool(dkk_sym), bool(norm8), bool(early_k))

    return kc.get_kernel("gdn_bwd_dchunk", key, build, _SOURCES)


def launch_choice(K: int, V: int, wgs: int | None, kept: bool, profiled: bool, async_loads: bool | None,
                  persist: bool | None, tma: bool | None, chains: bool | int | None) -> tuple[bool, bool, bool, int]:
    """:func:`chunk_grads`'s choice of loads and kernel form, its arguments (None: the switch's default) resolved:
    ``(async_loads, persist, tma, chains)``. ``kept``: the forward's vn and Tm given (the TMA loads need both);
    ``profiled``: a profile asked for (the persistent default steps aside for it). The two-chain kernel, asked for
    by ``chains`` or by its switch where it would serve, is per tile: the persistent default steps aside for it
    too; where asked for by ``chains`` and it cannot serve (or with ``persist=True``), a ValueError."""
    async_loads = async_loads_default() if async_loads is None else bool(async_loads)
    if chains is not None and chains not in (0, 1, 2):  # (False and True are 0 and 1)
        raise ValueError(f"chains={chains!r}: False / 0, True / 1 or 2")
    can_tma = async_loads and kept
    if tma is None:  # (the two-chain kernel, asked for, takes the TMA loads whatever their switch says)
        tma = (tma_default() or bool(chains)) and can_tma
    elif tma and not can_tma:
        raise ValueError("tma: the TMA loads need vn and tm given and the cp.async loads (async_loads)")
    serves = bool(tma) and (warpgroups(K) if wgs is None else wgs) == 2 and K == V == 128  # the two chains, per tile
    asked = chains_default()  # (parsed on every call: a typo is an error wherever it is read)
    if persist is None:
        two = bool(chains) if chains is not None else bool(asked) and serves
        persist = persist_default() and not profiled and async_loads and not two
    elif persist and not async_loads:
        raise ValueError("persist: the persistent variant loads by cp.async or TMA (async_loads)")
    can_chains = serves and not persist
    if chains is None:
        chains = asked if can_chains else 0
    elif chains and not can_chains:
        raise ValueError("chains: the two-chain kernel serves the TMA loads per tile (vn and tm given), two "
                         "warpgroups, K = V = 128")
    return async_loads, bool(persist), bool(tma), int(chains)


def chunk_grads(q, k, v, gc, beta, do, dvn, hs, dH, *, scale: float, cu_seqlens=None, l2norm: bool = False,
                wgs: int | None = None, overlap: bool | None = None, dqk_dtype=torch.float32,
                sum_groups: bool = False, profile=None, async_loads: bool | None = None, vn=None,
                tm=None, persist: bool | None = None, persist_ctas: int | None = None, tma: bool | None = None,
                chains: bool | int | None = None, relaxed: bool | None = None, ereg: bool | None = None,
                dkk_sym: bool | None = None, norm8: bool | None = None, early_k: bool | None = None):
    """Launch stage 3. q, k ``[B, T, H, K]`` (as the op got them; value head hv reads head
    ``hv // (HV // H)``; with ``l2norm`` the kernel normalizes their rows and applies the
    l2norm's backward to dq, dk), v, do and dvn ``[B, T, HV, V]`` (input dtype), gc and beta
    ``[B, T, HV]`` float32 (the in-chunk cumulative log decay and the effective beta), hs and dH
    chunk rows ``[rows, HV, K, V]`` in the input dtype (as the training forward and the reverse
    sweep write them). Returns ``(dq, dk, dv, dg, dbeta)``, float32 but dv (input dtype); dq and dk
    per value head ``[B, T, HV, K]`` (the caller sums them over a GVA group). ``wgs``: warpgroups
    per CTA (default :func:`warpgroups`; 1 at K = 128 is the one-warpgroup kernel, for comparison);
    ``overlap``: the variant of :func:`overlap_default` (default: that function's answer);
    ``dqk_dtype``: dq and dk in float32 (default) or, where no GVA sum follows, the input dtype
    (rounded once in the kernel, no cast pass after it); ``sum_groups`` (GVA groups of two value heads;
    larger groups are declined): each pair's two CTAs, one cluster, return dq, dk already summed over
    the pair, ``[B, T, H, K]`` in ``dqk_dtype`` (the float32 values summed once, rounded once), so no
    sum pass follows; without GVA it changes nothing. ``profile``: an int64 tensor of chunks x HV x
    (len(DCHUNK_PHASES) + 1) elements: runs the profile variant, which writes thread 0's clock64 cycles
    per phase and in total for every CTA there (``tools/time_gdn_dchunk.py --profile``; persistent: a row per CTA,
    ``(cta, cluster rank)``, the sums over its tiles, in the first rows). ``async_loads``: the
    loads by ``cp.async`` (default :func:`async_loads_default`) or synchronous, for comparison. ``vn``: the
    forward's ``vn = u - w Sc`` (v's shape and dtype, as the split pass's chain writes it), read instead
    of recomputed (no ``k Sc``, ``Z``, ``Tm Z``; ``do vn^T`` in flight during the solve); None: recomputed.
    ``tm``: the forward's chunk inverses ``Tm = (I + A)^-1`` (``[B, T, HV, 64]``, q's dtype, row i of a chunk at
    its token, as the wy kernel writes them with ``store_t``), read instead of solved again; None: solved.
    ``persist``: the persistent variant (default :func:`persist_default` where the loads are by cp.async, no
    profile is asked for and the two-chain kernel neither, by ``chains`` or by its switch where it can serve), a CTA
    per SM walking the tiles; the results are the same bits. ``persist_ctas``:
    that many CTAs (clusters with the pair sum) instead of one an SM, for tests (several tiles a CTA). ``tma``: the
    loads by TMA instead of ``cp.async`` (default :func:`tma_default`; only with ``vn`` and ``tm`` given and the
    cp.async loads asked for, per tile or persistent, with or without the profile variant); the results are the
    same bits. ``chains``: the two-chain kernel (True or 1; 2: with dv on the q side; default :func:`chains_default`
    where it can serve: the TMA loads per tile on two warpgroups at K = V = 128); asked for where it cannot, a
    ValueError; its profile variant writes
    ``len(CHAIN_PHASES) + 1`` elements a CTA (thread 0's phases and total, thread 128's "w:" phases). ``relaxed``:
    the relaxed first cluster arrive (default :func:`relaxed_default`). ``ereg``: E exponentiated once into registers
    (default :func:`ereg_default`; not the two-chain kernel, which ignores it): dq, dk, dv, dg the same bits, dbeta's
    last bits differ. ``dkk_sym``: dKK into an input-dtype tile in dA's terms and dk's two products on it (default
    :func:`dkk_sym_default`; not the two-chain kernel, which ignores it): dk in another summation order. ``norm8``: the
    l2norm factors of q's and k's rows by eight threads a row (default :func:`norm8_default`; with ``l2norm`` only):
    another summation order, so every output may differ in its last bits. ``early_k``: the persistent kernel issues
    the next tile's k once this tile's dk products and l2norm are done, before dk's store (default
    :func:`early_k_default`; ignored per tile): the same bits."""
    cm.check_device(q)
    dt = q.dtype
    if dt not in (torch.bfloat16, torch.float16) or any(t.dtype != dt for t in (k, v, do, dvn, hs, dH)):
        raise Unsupported(f"dtypes q {dt}, k {k.dtype}, v {v.dtype}, do {do.dtype}, dvn {dvn.dtype}, hs {hs.dtype}, "
                          f"dH {dH.dtype} (all one half-precision dtype)")
    if q.dim() != 4 or v.dim() != 4:
        raise Unsupported(f"shapes q {tuple(q.shape)}, v {tuple(v.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K not in fwd.HEAD_DIMS or V != K:
        raise Unsupported(f"head dims K={K}, V={V} (K == V in {fwd.HEAD_DIMS})")
    if gc.dtype != torch.float32 or beta.dtype != torch.float32:
        raise Unsupported("gc and beta must be float32")
    if tuple(k.shape) != tuple(q.shape) or tuple(v.shape[:2]) != (B, T) or H == 0 or HV % H:
        raise Unsupported(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (HV a multiple of H)")
    if tuple(do.shape) != tuple(v.shape) or tuple(dvn.shape) != tuple(v.shape):
        raise Unsupported("do and dvn must have v's shape")
    if vn is not None and (tuple(vn.shape) != tuple(v.shape) or vn.dtype != dt or vn.device != q.device):
        raise Unsupported(f"vn: {tuple(vn.shape)} {vn.dtype} on {vn.device} (v's shape, dtype and device)")
    if tm is not None and (tuple(tm.shape) != (B, T, HV, CHUNK) or tm.dtype != dt or tm.device != q.device):
        raise Unsupported(f"tm: {tuple(tm.shape)} {tm.dtype} on {tm.device} ([B, T, HV, {CHUNK}], q's dtype and device)")
    if tuple(gc.shape) != (B, T, HV) or tuple(beta.shape) != (B, T, HV):
        raise Unsupported("gc and beta must be [B, T, HV]")
    if cu_seqlens is not None and B != 1:
        raise Unsupported("cu_seqlens with B != 1")
    q, k, v, do, dvn, hs, dH, vn, tm = (None if t is None else cm.check_rows_aligned(name, t) for name, t in (
        ("q", q), ("k", k), ("v", v), ("do", do), ("dvn", dvn), ("hs", hs), ("dH", dH), ("vn", vn), ("tm", tm)))
    kept = tuple((name, t) for name, t in (("vn", vn), ("tm", tm)) if t is not None)  # the forward's, when given
    varlen = cu_seqlens is not None
    nseq = cu_seqlens.numel() - 1 if varlen else B
    dev = q.device
    cu, cu_chunks, grid, NT = fwd.chunk_map(cu_seqlens, B, T, dev)
    for name, t in (("hs", hs), ("dH", dH)):
        if not t.is_contiguous() or t.dim() != 4 or tuple(t.shape[1:]) != (HV, K, V):
            raise Unsupported(f"{name}: contiguous rows [rows, HV, K, V]")
        if t.shape[0] < grid:
            raise Unsupported(f"{name}: {t.shape[0]} chunk rows, {grid} needed")
    for name, t in (("q", q), ("k", k), ("v", v), ("gc", gc), ("beta", beta), ("do", do), ("dvn", dvn), ("hs", hs),
                    ("dH", dH)) + kept:
        if t.device != q.device:
            raise Unsupported(f"{name} on {t.device}")
        cm.check_index_range(name, t)  # every offset in int32 (dq and dk have v's size: K == V)
    # every token row is written, except with varlen those past the last sequence: zeros there
    new = torch.zeros if varlen else torch.empty
    if dqk_dtype not in (torch.float32, dt):
        raise Unsupported(f"dqk_dtype {dqk_dtype} (float32 or {dt})")
    if wgs not in (None, 1, 2) and not (K == 128 and wgs == 4):
        raise Unsupported(f"wgs={wgs} at K={K}")
    pair = sum_groups and HV == 2 * H
    if sum_groups and HV > 2 * H:
        raise Unsupported(f"sum_groups with groups of {HV // H} value heads (two only)")
    dq = new(B, T, H if pair else HV, K, dtype=dqk_dtype, device=dev)
    dk = new(B, T, H if pair else HV, K, dtype=dqk_dtype, device=dev)
    dv = new(B, T, HV, V, dtype=dt, device=dev)
    dg = new(B, T, HV, dtype=torch.float32, device=dev)
    db = new(B, T, HV, dtype=torch.float32, device=dev)
    if T == 0 or nseq == 0:
        return dq, dk, dv, dg, db
    if profile is not None and (profile.dtype != torch.int64 or profile.device != dev
                                or profile.numel() < grid * HV * (len(DCHUNK_PHASES) + 1)):
        raise ValueError(f"profile: int64 on {dev} with at least {grid * HV * (len(DCHUNK_PHASES) + 1)} elements")
    async_loads, persist, tma, chains = launch_choice(K, V, wgs, vn is not None and tm is not None, profile is not None,
                                                     async_loads, persist, tma, chains)
    phases = CHAIN_PHASES if chains else DCHUNK_PHASES
    if profile is not None and profile.numel() < grid * HV * (len(phases) + 1):
        raise ValueError(f"profile: at least {grid * HV * (len(phases) + 1)} elements for these phases")
    if relaxed is None:
        relaxed = relaxed_default()
    relaxed = bool(relaxed) and pair and tm is not None and not persist and not chains  # (elsewhere: nothing to relax)
    if ereg is None:
        ereg = ereg_default()
    ereg = bool(ereg) and not chains  # (the two-chain kernel keeps k k^T in registers already)
    if dkk_sym is None:
        dkk_sym = dkk_sym_default()
    dkk_sym = bool(dkk_sym) and not chains  # (the two-chain kernel forms the sum after its own hand-over)
    if norm8 is None:
        norm8 = norm8_default()
    norm8 = bool(norm8) and bool(l2norm)  # (without the l2norm nothing is normalized: one cache entry)
    if early_k is None:
        early_k = early_k_default()
    early_k = bool(early_k) and persist  # (per tile there is no next tile)
    fn = get_dchunk_kernel(dt, K, V, varlen, l2norm, wgs, overlap, dqk_dtype, pair, profile is not None, async_loads,
                           vn is not None, tm is not None, persist, bool(tma), int(chains), relaxed, ereg, dkk_sym,
                           norm8, early_k)
    prof = fwd._dummies(dev)[2] if profile is None else profile
    pw = 2 if pair else 1
    if persist_ctas is not None and (not persist or persist_ctas < 1):
        raise ValueError(f"persist_ctas={persist_ctas}: a positive count, with persist")
    if persist and not persist_ctas:  # a CTA per SM; with the pair sum as many two-CTA clusters as fit at once
        from .gemm_sm90 import _max_clusters

        sms = kc.num_sms(dev)
        persist_ctas = _max_clusters(dev, pw, sms) if pw > 1 else sms
    nctas = min(grid * (HV // pw), persist_ctas) if persist else 1
    fn(q, k, v, gc, beta, do, dvn, hs, dH, dvn if vn is None else vn, dvn[..., :CHUNK] if tm is None else tm, cu,
       cu_chunks, dq, dk, dv, dg, db, float(scale),
       T, NT, nseq, HV // H, grid, nctas,
       prof)
    return dq, dk, dv, dg, db

"""Chunked Gated DeltaNet backward for SM90 (CuTeDSL, WGMMA): the fused backward, one kernel for stages 2 and 3.

First build (thirty-ninth session): correct by construction of its schedule, not tuned. The plan it follows is
docs/PERFORMANCE.md's ("the first build, assigned in our notation", thirty-eighth session), with the changes written
below where the shared-memory and register budgets forced them.

One CTA per (sequence, value head), 512 threads, the chunks from the last to the first. Per chunk, with the
notation of ``fused/delta_rule_bwd.py`` (``E_ij = exp(gc_i - gc_j)``, j <= i; ``Es`` its strictly lower part;
``eg = exp(gc)``; ``kdec = exp(gc_C - gc)``; ``dH`` the gradient of the state leaving the chunk)::

    dvn = diag(kdec) (k dH) + P^T do            dvb = Tm^T dvn            dv = diag(beta) dvb
    dH <- e^(gc_C) dH + q^T diag(scale eg) do - k^T diag(beta eg) dvb      (the state entering the chunk)
    P = scale (q k^T) * E      dP = do vn^T      dQK = scale dP * E
    dq = scale diag(eg) do Sc^T + dQK k          dw = -dvn Sc^T
    dTm = (dw k^T) diag(beta eg) + (dvn v^T) diag(beta)      dA = -strictly_lower(Tm^T dTm Tm^T)
    dKK = diag(beta) dA * Es
    dk = diag(kdec) vn dH^T + dQK^T q + (diag(beta eg) Tm^T) dw + dKK k + dKK^T k
    dbeta = eg rowsum(k * dkb) + rowsum(v * dvb) + rowsum(dA * Es * KK)
    dgc = rowsum(scale eg q * dqg) + beta eg rowsum(k * dkb) + pairs(dP * P + dA * A) - kdt
          (+ sum(kdt) + exp(gc_C) sum(Sc * dH) on the last row),     dg = reverse cumsum of dgc

with ``rowsum(k * dkb)_i = sum_j Tm_ji (dw k^T)_ji`` (a column sum of ``Tm * (dw k^T)``, which the dTm product
gives anyway: dkb itself is never formed), ``kdt = kdec rowsum(k * (vn dH^T))``, ``pairs(t)_i = sum_j t_ij -
sum_j t_ji``, ``A = diag(beta) (k k^T) * Es``.

Warpgroups (``setmaxnreg``: :data:`REGS`):

* **W0, the chain** (dH [K, V] in float32 registers, the whole chunk loop): writes dH rounded to the input dtype
  into its tile (``sH``) for W1; the tail's ``sum(Sc * dH)`` from its float32 registers; ``do_s = diag(scale eg)
  do`` into the do_s / dw tile; then ``dH <- e^(gc_C) dH + q^T do_s`` and, once W1 hands ``-diag(beta eg) dvb``
  over, ``+ k^T (-diag(beta eg) dvb)``. After the first chunk: the initial state's gradient.
* **W1, dvn, dv and dk**: ``k dH`` (row-scaled by kdec), ``+ P^T do`` -> dvn (to its tile, for W2 and itself),
  ``Tm^T dvn`` -> dvb: dv stored, ``rowsum(v * dvb)``, ``-diag(beta eg) dvb`` to W0; then dk in one accumulator:
  ``vn dH^T`` (kdt, row-scaled by kdec), ``+ dQK^T q``, ``+ (diag(beta eg) Tm^T) dw`` (A in registers, formed
  from the Tm tile), ``+ dKK k + dKK^T k``; dk stored.
* **W2, the C x C work and dq**: ``q k^T`` -> P (to the X tile, for W1), ``do vn^T`` -> dP, dQK (its tile, for
  W1 and itself), dP * P's row and column sums; ``do Sc^T`` -> dq's first term, ``rowsum(q * dqg)``, ``+ dQK k``
  -> dq stored; ``dvn Sc^T`` -> dw (the do_s / dw tile, for W1 and itself); ``dw k^T``, ``dvn v^T`` -> dTm^T (X
  tile), the column sums of ``Tm * (dw k^T)``; ``Tm^T dTm`` (X tile), ``(.) Tm^T`` -> dA, ``k k^T``; dA's terms,
  dKK (X tile, for W1); then dg (the other warpgroups' row sums joined, the reverse cumulative sum) and dbeta.
* **W3, the loads**: one warp issues every input tile by TMA on its own ``full`` mbarrier once the tile's
  ``empty`` mbarrier says its readers of the previous chunk are done (single buffers), and writes the chunk's gc
  and beta (two buffers) with plain loads.

Between warpgroups every hand-over is an mbarrier pair (``full`` arrived by the writer's 128 threads after their
stores and a fence to the async proxy; ``empty`` by the readers' threads after their products completed), so no
warpgroup waits on a CTA barrier and the only order is the data's.

Inputs: q, k ``[B, T, H, K]`` l2-normalized already (the caller normalizes and applies the l2norm's backward),
v, do, vn ``[B, T, HV, V]``, the forward's chunk inverses tm ``[B, T, HV, 64]`` and chunk-start states hs
``[B * NT, HV, K, V]`` (input dtype), gc and beta ``[B, T, HV]`` float32 (the in-chunk cumulative log decay and
the effective beta), dht ``[B, HV, K, V]`` float32 or None. Outputs: dq, dk ``[B, T, HV, K]`` float32 per value
head, dv ``[B, T, HV, V]`` input dtype, dg, dbeta ``[B, T, HV]`` float32, dh0 ``[B, HV, K, V]`` float32. Dense
batches only (no ``cu_seqlens``), K = V = 128.

Status: compiles for sm_90a (compile tier); GPU tier ``tests/kernels/test_gated_delta_rule_bwd_fused_sm90.py``
against ``fused/delta_rule_bwd.py`` (prepared, not yet GPU-run). Not wired into the training path.
"""


import torch

from ..backend import Unsupported
from . import compile as kc
from . import gated_delta_rule_common_sm90 as cm
from . import gated_delta_rule_fwd_sm90 as fwd

CHUNK = cm.CHUNK
_SOURCES = (__file__, cm.__file__, fwd.__file__)
# setmaxnreg: the loads, W0 (dH in float32, 128 a thread), W1, W2; 512 threads launch with 128 a thread, so the four
# may sum to 4 x 128 at most. ptxas (offline, this build): W1 spills about 1.9 KB at 152 and about 0.1 KB from 168
# up; W0 at 168 and W2 at 152 some 0.1-0.3 KB each; this split spills 464 bytes in all
REGS = (24, 176, 168, 144)
assert sum(REGS) <= 512 and all(r % 8 == 0 for r in REGS)

# the input tiles in the loader's issue order (each on its own full / empty mbarrier pair), and how many warpgroups
# read each (the empty barrier's arrivals are 128 a warpgroup)
INPUTS = ("vn", "do", "s", "v", "tm", "q", "k")
READERS = {"vn": 2, "do": 3, "s": 2, "v": 2, "tm": 2, "q": 3, "k": 3}
# KDB (two k buffers): k first (its buffer's previous readers are a chunk behind), q before Tm (released earlier)
INPUTS_KDB = ("k", "vn", "do", "s", "v", "q", "tm")
# the hand-overs between warpgroups: name -> arrivals (128 a writing or reading warpgroup)
HANDOVERS = {
    "h_full": 128, "h_empty": 128,  # dH tile: W0 -> W1 (k dH, vn dH^T); W1 -> W0
    "p_full": 128, "x_empty": 128,  # X tile holds P: W2 -> W1; W1 done with the X tile's dKK: W1 -> W2
    "dvn_full": 128, "dvn_empty": 128,  # dvn tile: W1 -> W2; W2 done with it: W2 -> W1
    "dvb_full": 128, "dvb_empty": 128,  # -beta eg dvb tile: W1 -> W0; W0 -> W1
    "dos_free": 128, "dw_full": 128, "dw_empty": 256,  # do_s / dw tile: W0 -> W2; W2 -> W1; W1 + W2 -> W0
    "dqk_full": 128, "dqk_empty": 128,  # dQK tile: W2 -> W1; W1 -> W2
    "kk_full": 128,  # X tile holds dKK: W2 -> W1
    "do_free": 256,  # (KDB) W0's do_s and W2's do Sc^T are done with do: W1 may write dvb over it
    "dkp_full": 128,  # (SPLITDK) W1's part of dk is in dk's rows (global): W1 -> W2
}
# double-buffered (by chunk parity) row vectors: name -> arrivals
PAIRED = {"vec_full": 32, "vec_empty": 384, "rows_full": 128, "tail_full": 128, "rows_empty": 128,
          "kfull": 1, "kempty": 384}  # (kfull / kempty: KDB's k buffers)
# the profile variant's phases per warpgroup (W0, W1, W2): each mark adds the cycles since the warpgroup's previous
# mark (thread 0's clock64) to its phase; "wait ..." phases are mbarrier waits, the others work
PHASES = (
    ("wait h_empty", "dH -> tile", "wait Sc", "tail sum(Sc dH)", "wait vec, do, dw_empty", "do_s", "wait q",
     "q^T do_s", "wait dvb, k", "k^T dvb"),
    ("wait vec, dH, k", "k dH", "wait P, do", "P^T do", "wait dvn_empty", "dvn -> tile", "wait Tm", "Tm^T dvn",
     "wait v, dvb_empty, rows", "dvb rows, dv store", "wait vn", "vn dH^T, kdt", "wait dQK, q", "dQK^T q (+ A regs)",
     "wait dw", "A dw", "wait dKK", "dKK k (x2), dk store (SPLITDK: its part)", "(DQ1) wait Sc",
     "(DQ1) do Sc^T, dQK k, dq store"),
    ("wait vec, q, k", "q k^T", "wait x_empty", "P -> tile", "wait do, vn", "do vn^T, dP P sums",
     "wait dqk_empty", "dQK -> tile", "wait Sc", "do Sc^T, dQK k, dq store", "wait dvn", "dvn Sc^T",
     "wait dos_free", "dw -> tile", "wait v, Tm", "dw k^T, dvn v^T, dTm", "M1, dA, k k^T", "dA terms, dKK -> tile",
     "wait rows, tail", "dg, dbeta", "(SPLITDK) A dw, dKK k (x2)", "(SPLITDK) wait W1's dk part",
     "(SPLITDK) dk sum, store"),
)
NPH = max(len(x) for x in PHASES)
# W1's row vectors for W2: kdt, its part of dbeta (rowsum(v * dvb)), (DQ1) dq's part of dgc (rowsum(q * dqg));
# W0's: the tail's four warp sums
W1_ROWS = 3


def _build(dtype, K: int, V: int, has_dht: bool, state_vk: bool, KDB: bool = False, DEBUG: bool = False,
           L2BWD: bool = False, PROF: bool = False, SPLITDK: bool = False, DQ1: bool = False):
    # DQ1 (dq on W1) builds on SPLITDK and reads do after dvb is written: not with KDB's dvb over do
    assert not DQ1 or (SPLITDK and not KDB), "DQ1: with SPLITDK, without KDB"
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup

    C = CHUNK
    LOG2E = cm.LOG2E
    THREADS = 512
    gemm = cm.make_gemm()
    store_pairs = cm.make_store_pairs()
    tv = cm.transpose_view
    COLS = {"q": K, "k": K, "v": V, "do": V, "vn": V, "tm": C}
    TILE_BYTES = {x: (K * V if x == "s" else C * COLS[x]) * dtype.width // 8 for x in INPUTS}
    READ = dict(READERS)
    if DQ1:  # W1 reads Sc for dq's first term
        READ["s"] = 3
    HAND = dict(HANDOVERS)
    if SPLITDK:  # dw's only reader is W2; W1 reads neither dKK nor the X tile after P
        HAND["dw_empty"] = 128
    NBAR = 2 * len(INPUTS) + len(HAND) + 2 * len(PAIRED)

    def bar_index():
        idx = {}
        for i, x in enumerate(INPUTS):
            idx["full_" + x] = i
            idx["empty_" + x] = len(INPUTS) + i
        base = 2 * len(INPUTS)
        for i, x in enumerate(HAND):
            idx[x] = base + i
        base += len(HAND)
        for i, x in enumerate(PAIRED):
            idx[x] = base + 2 * i  # + parity
        return idx

    BAR = bar_index()

    def counts():
        cnt = [0] * NBAR
        for x in INPUTS:
            cnt[BAR["full_" + x]] = 1
            cnt[BAR["empty_" + x]] = 128 * READ[x]
        for x, n in HAND.items():
            cnt[BAR[x]] = n
        for x, n in PAIRED.items():
            cnt[BAR[x]] = cnt[BAR[x] + 1] = n
        return tuple(cnt)

    COUNTS = counts()

    # ------------------------------------------------------------------ small pieces
    def wait(mbar, name, it, paired=False):
        # wait for the completion of iteration it's phase of barrier `name` (a paired one: buffer it % 2)
        if paired:
            cute.arch.mbarrier_wait(mbar + BAR[name] + it % 2, (it // 2) % 2)
        else:
            cute.arch.mbarrier_wait(mbar + BAR[name], it % 2)

    def arrive(mbar, name, it=None, paired=False):
        if paired:
            cute.arch.mbarrier_arrive(mbar + BAR[name] + it % 2)
        else:
            cute.arch.mbarrier_arrive(mbar + BAR[name])

    def wait_k(mbar, it):
        # chunk it's k landed (KDB: in buffer it % 2)
        if KDB:
            wait(mbar, "kfull", it, paired=True)
        else:
            wait(mbar, "full_k", it)

    def release_k(mbar, it):
        if KDB:
            arrive(mbar, "kempty", it, paired=True)
        else:
            arrive(mbar, "empty_k")

    def published():
        # this thread's generic-proxy writes of a tile, visible to the async proxy (WGMMA, TMA) before its arrive
        cute.arch.fence_view_async_shared()

    def acc_of(mma_, m, n, t):
        return cute.make_rmem_tensor(mma_.get_slice(t).partition_shape_C((m, n)), Float32)

    def mm(mma_, acc, a_tile, b_tile, zero, t):
        thr = mma_.get_slice(t)
        gemm(mma_, acc, mma_.make_fragment_A(thr.partition_A(a_tile)), mma_.make_fragment_B(thr.partition_B(b_tile)),
             zero)

    def done():
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    def wg_bar(w):
        cute.arch.barrier(barrier_id=1 + w, number_of_threads=128)

    def ex2(x):
        return cute.math.exp2(x * LOG2E, fastmath=True)

    @cute.jit
    def quad_sum(x: Float32):
        x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
        return x + cute.arch.shuffle_sync_bfly(x, offset=2)

    @cute.jit
    def col_sum(x: Float32):
        # over the lanes holding the same columns (lane % 4 alike): see _col_groups
        x = x + cute.arch.shuffle_sync_bfly(x, offset=4)
        x = x + cute.arch.shuffle_sync_bfly(x, offset=8)
        return x + cute.arch.shuffle_sync_bfly(x, offset=16)

    @cute.jit
    def st2(sX: cute.Tensor, i, j, v0: Float32, v1: Float32):
        frag = cute.make_rmem_tensor((1, 2), sX.element_type)
        frag[0] = v0.to(sX.element_type)
        frag[1] = v1.to(sX.element_type)
        cute.autovec_copy(frag, cute.local_tile(sX, (1, 2), (i, j // 2)))

    @cute.jit
    def ld2(sX: cute.Tensor, i, j):
        frag = cute.make_rmem_tensor((1, 2), sX.element_type)
        cute.autovec_copy(cute.local_tile(sX, (1, 2), (i, j // 2)), frag)
        return frag[0].to(Float32), frag[1].to(Float32)

    @cute.jit
    def acc_to_tile(acc: cute.Tensor, cAcc: cute.Tensor, sX: cute.Tensor, negate: cutlass.Constexpr):
        # a float32 accumulator (element pairs: columns n, n + 1) rounded into its smem tile at its coordinates
        for e2 in cutlass.range_constexpr(cute.size(acc) // 2):
            i, j = cAcc[2 * e2]
            if cutlass.const_expr(negate):
                st2(sX, i, j, -acc[2 * e2], -acc[2 * e2 + 1])
            else:
                st2(sX, i, j, acc[2 * e2], acc[2 * e2 + 1])

    @cute.jit
    def col_parts(vals: cute.Tensor, cAcc: cute.Tensor, cols: cutlass.Constexpr, sCol: cute.Tensor, w: Int32,
                  lane: Int32, add: cutlass.Constexpr):
        # the column sums of a [C, C] float32 array held like an accumulator (vals, coordinates cAcc): this thread's
        # rows summed (cols: element lists a column), then over its warp's lanes with those columns; lanes 0-3
        # write (or with add, add) their warp's sums into sCol[w, column]
        for ci in cutlass.range_constexpr(len(cols)):
            s = Float32(0.0)
            for e in cols[ci]:
                s = s + vals[e]
            s = col_sum(s)
            if lane < 4:
                _, j = cAcc[cols[ci][0]]
                if cutlass.const_expr(add):
                    sCol[w, j] = sCol[w, j] + s
                else:
                    sCol[w, j] = s

    @cute.jit
    def scaled_lower(acc: cute.Tensor, cAcc: cute.Tensor, sGc: cute.Tensor, par: cutlass.Constexpr, scale: Float32):
        # a [C, C] accumulator times scale E (E_ij = exp(gc_i - gc_j), j <= i; zero above): P from q k^T, dQK from dP
        for e in cutlass.range_constexpr(cute.size(acc)):
            i, j = cAcc[e]
            val = Float32(0.0)
            if j <= i:
                val = acc[e] * scale * ex2(sGc[par, i] - sGc[par, j])
            acc[e] = val

    @cute.jit
    def l2norm_bwd_rows(acc: cute.Tensor, cAcc: cute.Tensor, groups: cutlass.Constexpr, sY: cute.Tensor,
                        mR: cute.Tensor, b: Int32, t0: Int32, h: Int32, length: Int32):
        # (L2BWD) acc: the gradient of the normalized rows y (the tile sY) -> that of the rows before the l2norm,
        # r (dy - y rowsum(y * dy)), r the rows' factors (mR [B, T, H], float32); a row's sum by its quad
        for gi in cutlass.range_constexpr(len(groups)):
            i, _ = cAcc[groups[gi][0]]
            sy = Float32(0.0)
            for e in groups[gi][0::2]:
                _, dd = cAcc[e]
                y0, y1 = ld2(sY, i, dd)
                sy = sy + y0 * acc[e] + y1 * acc[e + 1]
            sy = quad_sum(sy)
            ri = Float32(0.0)
            if i < length:
                ri = mR[b, t0 + i, h]
            for e in groups[gi][0::2]:
                _, dd = cAcc[e]
                y0, y1 = ld2(sY, i, dd)
                acc[e] = ri * (acc[e] - y0 * sy)
                acc[e + 1] = ri * (acc[e + 1] - y1 * sy)

    @cute.jit
    def tm_regs(rA: cute.Tensor, cA: cute.Tensor, sTm: cute.Tensor, sB: cute.Tensor, sGc: cute.Tensor,
                par: cutlass.Constexpr):
        # the register A operand diag(beta eg) Tm^T of dk's dw term
        for f in cutlass.range_constexpr(cute.size(rA)):
            i, j = cA[f]
            rA[f] = (sTm[j, i].to(Float32) * (sB[par, i] * ex2(sGc[par, i]))).to(dtype)

    @cute.jit
    def scaled_rows(acc: cute.Tensor, cAcc: cute.Tensor, groups: cutlass.Constexpr, sY: cute.Tensor,
                    sGc: cute.Tensor, par: cutlass.Constexpr, mult: Float32, offset: Float32, sign: cutlass.Constexpr,
                    rows: cute.Tensor):
        # acc's row i times mult * exp(offset + sign gc_i), in place; rows[gi] = rowsum(y * acc) over the row's quad:
        # dq's first term (scale eg, q) and kdt (kdec = exp(gc_C - gc), k)
        for gi in cutlass.range_constexpr(len(groups)):
            i, _ = cAcc[groups[gi][0]]
            f = mult * ex2(offset + sign * sGc[par, i])
            s = Float32(0.0)
            for e in groups[gi][0::2]:
                _, dd = cAcc[e]
                y0, y1 = ld2(sY, i, dd)
                acc[e] = acc[e] * f
                acc[e + 1] = acc[e + 1] * f
                s = s + y0 * acc[e] + y1 * acc[e + 1]
            rows[gi] = quad_sum(s)

    @cute.jit
    def add_pairs(acc: cute.Tensor, cAcc: cute.Tensor, gX: cute.Tensor, nvalid: Int32):
        # (SPLITDK) acc += the float32 rows < nvalid of gX at the accumulator's coordinates (pairs, 8-byte loads)
        for e in cutlass.range_constexpr(cute.size(acc) // 2):
            i, d = cAcc[2 * e]
            if i < nvalid:
                frag = cute.make_rmem_tensor((1, 2), Float32)
                cute.autovec_copy(cute.local_tile(gX, (1, 2), (i, d // 2)), frag)
                acc[2 * e] = acc[2 * e] + frag[0]
                acc[2 * e + 1] = acc[2 * e + 1] + frag[1]

    @cute.jit
    def _mark(sP: cute.Tensor, w: cutlass.Constexpr, p: cutlass.Constexpr, lt: Int32):
        if lt == 0:
            now = cute.arch.clock64()
            sP[w, p] = sP[w, p] + (now - sP[w, NPH + 1])
            sP[w, NPH + 1] = now

    def mark(sP, w, p, lt):
        # (PROF) the cycles since warpgroup w's previous mark to its phase p (PHASES[w][p])
        if PROF:
            _mark(sP, w, p, lt)

    @cute.jit
    def prof_start(sP: cute.Tensor, w: cutlass.Constexpr, lt: Int32):
        if lt == 0:
            for p in cutlass.range_constexpr(NPH):
                sP[w, p] = cutlass.Int64(0)
            now = cute.arch.clock64()
            sP[w, NPH] = now
            sP[w, NPH + 1] = now

    @cute.jit
    def prof_end(sP: cute.Tensor, mP: cute.Tensor, w: cutlass.Constexpr, lt: Int32, cta: Int32):
        # [phase sums..., the warpgroup's total] to mP[(cta * 3 + w) * (NPH + 1):]
        if lt == 0:
            sP[w, NPH] = cute.arch.clock64() - sP[w, NPH]
            for p in cutlass.range_constexpr(NPH + 1):
                mP[(cta * 3 + w) * (NPH + 1) + p] = sP[w, p]

    # ------------------------------------------------------------------ the kernel
    @cute.kernel
    def kernel(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mDo: cute.Tensor, mVn: cute.Tensor,
               mTm: cute.Tensor, mHs: cute.Tensor, mGc: cute.Tensor, mB: cute.Tensor, mDht: cute.Tensor,
               mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, mDg: cute.Tensor, mDb: cute.Tensor,
               mDh0: cute.Tensor, mDvnD: cute.Tensor, mDhD: cute.Tensor, mRq: cute.Tensor, mRk: cute.Tensor,
               mProf: cute.Tensor, scale: Float32, T: Int32, NT: Int32, group: Int32,
               aQ: cute.CopyAtom, aK: cute.CopyAtom, aV: cute.CopyAtom, aDo: cute.CopyAtom, aVn: cute.CopyAtom,
               aTm: cute.CopyAtom, aS: cute.CopyAtom, tQ: cute.Tensor, tK: cute.Tensor, tV: cute.Tensor,
               tDo: cute.Tensor, tVn: cute.Tensor, tTm: cute.Tensor, tS: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        b, hv, _ = cute.arch.block_idx()
        h = hv // group
        wg = cute.arch.make_warp_uniform(tidx // 128)
        lt = tidx % 128
        warp = lt // 32
        lane = lt % 32

        # MMAs (one warpgroup each; M = 64 a row block)
        mma_cc = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False)  # [C, C] = A [C, *] B [C, *]^T, K-major
        mma_ck = cm.make_mma(dtype, K, a_regs=False, b_mn_major=False)  # [C, K], B K-major
        mma_ckt = cm.make_mma(dtype, K, a_regs=False, b_mn_major=True)  # [C, K], B MN-major
        mma_ckta = cm.make_mma(dtype, K, a_regs=False, b_mn_major=True, a_mn_major=True)  # A, B MN-major
        mma_ckr = cm.make_mma(dtype, K, a_regs=True, b_mn_major=True)  # A in registers, B MN-major
        mma_cca = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False, a_mn_major=True)  # A MN-major
        mma_h = cm.make_mma(dtype, V, a_regs=False, b_mn_major=True, a_mn_major=True)  # dH [K, V] += A^T B
        cCC = mma_cc.get_slice(lt).partition_C(cute.make_identity_tensor((C, C)))
        cCK = mma_ck.get_slice(lt).partition_C(cute.make_identity_tensor((C, K)))
        cH = mma_h.get_slice(lt).partition_C(cute.make_identity_tensor((K, V)))

        smem = cutlass.utils.SmemAllocator()
        sQ = cm.alloc_tile(smem, dtype, C, K)
        sK = cm.alloc_tile(smem, dtype, C, K)
        sKb = [sK, cm.alloc_tile(smem, dtype, C, K) if KDB else sK]  # (KDB: chunk it's k in buffer it % 2)
        sV = cm.alloc_tile(smem, dtype, C, V)
        sDo = cm.alloc_tile(smem, dtype, C, V)
        sVn = cm.alloc_tile(smem, dtype, C, V)
        sS = cm.alloc_tile(smem, dtype, K, V)  # Sc [d, v]
        sTm = cm.alloc_tile(smem, dtype, C, C)
        sH = cm.alloc_tile(smem, dtype, K, V)  # dH [d, v], input dtype
        sDvn = cm.alloc_tile(smem, dtype, C, V)
        sDvb = sDo if KDB else cm.alloc_tile(smem, dtype, C, V)  # -diag(beta eg) dvb (KDB: over do)
        sDw = cm.alloc_tile(smem, dtype, C, V)  # do_s = diag(scale eg) do (W0), then dw (W2): K == V
        sX = cm.alloc_tile(smem, dtype, C, C)  # P, then dTm^T, Tm^T dTm, dKK
        sDqk = cm.alloc_tile(smem, dtype, C, C)
        lv = cute.make_layout((2, C), stride=(C, 1))
        sGc = smem.allocate_tensor(Float32, lv, 16)  # by chunk parity
        sB = smem.allocate_tensor(Float32, lv, 16)
        sR1 = smem.allocate_tensor(Float32, cute.make_layout((2, W1_ROWS, C), stride=(W1_ROWS * C, C, 1)), 16)
        sTail = smem.allocate_tensor(Float32, cute.make_layout((2, 4), stride=(4, 1)), 16)
        l4 = cute.make_layout((4, C), stride=(C, 1))
        sColP = smem.allocate_tensor(Float32, l4, 16)  # W2: per warp, column sums of dP * P + dA * A
        sColS = smem.allocate_tensor(Float32, l4, 16)  # W2: per warp, column sums of Tm * (dw k^T)
        sDgc = smem.allocate_tensor(Float32, cute.make_layout(C), 16)  # W2: the chunk's dgc, then dg
        mbar = smem.allocate_array(cutlass.Int64, NBAR, byte_alignment=8)
        sProf = sDgc  # (PROF: per warpgroup, the phases' sums, the start, the last mark; else unused)
        if cutlass.const_expr(PROF):
            sProf = smem.allocate_tensor(cutlass.Int64, cute.make_layout((3, NPH + 2), stride=(NPH + 2, 1)), 16)
        cta = b * cute.arch.grid_dim()[1] + hv
        tiles = {"q": sQ, "k": sK, "v": sV, "do": sDo, "vn": sVn, "tm": sTm, "s": sS}
        atoms = {"q": aQ, "k": aK, "v": aV, "do": aDo, "vn": aVn, "tm": aTm, "s": aS}
        tmas = {"q": tQ, "k": tK, "v": tV, "do": tDo, "vn": tVn, "tm": tTm, "s": tS}

        if tidx == 0:
            for i in cutlass.range_constexpr(NBAR):
                cute.arch.mbarrier_init(mbar + i, COUNTS[i])
        if warp == 0 and wg == 3:
            for x in INPUTS:
                cpasync.prefetch_descriptor(atoms[x])
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        nchunks = NT
        if wg == 3:
            # ================================================================ W3: the loads
            cute.arch.setmaxregister_decrease(REGS[0])
            if warp == 0:
                for itp in cutlass.range((nchunks + 1) // 2, unroll=1):
                    for par in cutlass.range_constexpr(2):  # chunk it in buffer par: every buffer static
                        it = itp * 2 + par
                        if it < nchunks:
                            c = nchunks - 1 - it
                            t0 = c * C
                            length = cutlass.min(T - t0, C)
                            # gc (past the end: the last row's) and beta (past the end: 0), two rows a lane
                            if it >= 2:
                                cute.arch.mbarrier_wait(mbar + BAR["vec_empty"] + par, ((it - 2) // 2) % 2)
                            for rr in cutlass.range_constexpr(2):
                                r = 2 * lane + rr
                                sGc[par, r] = mGc[b, t0 + cutlass.min(r, length - 1), hv]
                                bval = Float32(0.0)
                                if r < length:
                                    bval = mB[b, t0 + r, hv]
                                sB[par, r] = bval
                            cute.arch.mbarrier_arrive(mbar + BAR["vec_full"] + par)
                            order = INPUTS_KDB if KDB else INPUTS
                            for x in cutlass.range_constexpr(len(order)):
                                name = order[x]
                                if cutlass.const_expr(name == "s"):
                                    gT = cute.local_tile(tS[None, None, b * NT + c, hv], (K, V), (0, 0))
                                else:
                                    gT = cm.token_box(tmas[name], b, h if name in ("q", "k") else hv, t0, 0, C,
                                                      COLS[name])
                                if cutlass.const_expr(KDB and name == "k"):
                                    if it >= 2:
                                        cute.arch.mbarrier_wait(mbar + BAR["kempty"] + par, ((it - 2) // 2) % 2)
                                    cm.tma_load(((atoms[name], gT, sKb[par]),), mbar + BAR["kfull"] + par,
                                                TILE_BYTES[name])
                                else:
                                    if it > 0:
                                        cute.arch.mbarrier_wait(mbar + BAR["empty_" + name], (it - 1) % 2)
                                    cm.tma_load(((atoms[name], gT, tiles[name]),), mbar + BAR["full_" + name],
                                                TILE_BYTES[name])
        elif wg == 0:
            # ================================================================ W0: the chain (dH)
            cute.arch.setmaxregister_increase(REGS[1])
            if cutlass.const_expr(PROF):
                prof_start(sProf, 0, lt)
            accH = acc_of(mma_h, K, V, lt)
            if cutlass.const_expr(has_dht):
                for e in cutlass.range_constexpr(cute.size(accH)):
                    hd, hvv = cH[e]
                    if cutlass.const_expr(state_vk):
                        accH[e] = mDht[b, hv, hvv, hd]
                    else:
                        accH[e] = mDht[b, hv, hd, hvv]
            else:
                accH.fill(0.0)
            for itp in cutlass.range((nchunks + 1) // 2, unroll=1):
                for par in cutlass.range_constexpr(2):  # chunk it in buffer par: every buffer static
                    it = itp * 2 + par
                    if it < nchunks:
                        sKc = sKb[par]
                        # dH (leaving this chunk) into its tile for W1, once W1 is done with the previous one
                        if it > 0:
                            wait(mbar, "h_empty", it - 1)
                        mark(sProf, 0, 0, lt)
                        acc_to_tile(accH, cH, sH, False)
                        published()
                        arrive(mbar, "h_full")
                        mark(sProf, 0, 1, lt)
                        if cutlass.const_expr(DEBUG):  # this chunk's dH, float32, into its chunk row
                            cD = nchunks - 1 - it
                            for e in cutlass.range_constexpr(cute.size(accH)):
                                hd2, hv2 = cH[e]
                                mDhD[b * NT + cD, hv, hd2, hv2] = accH[e]
                        # the tail: sum(Sc * dH), this warp's part
                        wait(mbar, "full_s", it)
                        mark(sProf, 0, 2, lt)
                        part = Float32(0.0)
                        for e2 in cutlass.range_constexpr(cute.size(accH) // 2):
                            d, v = cH[2 * e2]
                            s0, s1 = ld2(sS, d, v)
                            part = part + s0 * accH[2 * e2] + s1 * accH[2 * e2 + 1]
                        arrive(mbar, "empty_s")
                        for o in cutlass.range_constexpr(5):
                            part = part + cute.arch.shuffle_sync_bfly(part, offset=1 << o)
                        if it >= 2:
                            wait(mbar, "rows_empty", it - 2, paired=True)
                        if lane == 0:
                            sTail[par, warp] = part
                        arrive(mbar, "tail_full", it, paired=True)
                        mark(sProf, 0, 3, lt)
                        # dH <- e^(gc_C) dH
                        wait(mbar, "vec_full", it, paired=True)
                        dec = ex2(sGc[par, C - 1])
                        for e in cutlass.range_constexpr(cute.size(accH)):
                            accH[e] = accH[e] * dec
                        # do_s = diag(scale eg) do into the do_s / dw tile, once W1 and W2 are done with the last dw
                        wait(mbar, "full_do", it)
                        if it > 0:
                            wait(mbar, "dw_empty", it - 1)
                        mark(sProf, 0, 4, lt)
                        for p in cutlass.range_constexpr(C * V // 8 // 128):
                            idx = p * 128 + lt
                            r = idx // (V // 8)
                            c8 = idx % (V // 8)
                            frag = cute.make_rmem_tensor((1, 8), dtype)
                            cute.autovec_copy(cute.local_tile(sDo, (1, 8), (r, c8)), frag)
                            frag.store((frag.load().to(Float32) * (scale * ex2(sGc[par, r]))).to(dtype))
                            cute.autovec_copy(frag, cute.local_tile(sDw, (1, 8), (r, c8)))
                        if cutlass.const_expr(KDB):  # do's tile takes dvb next: released after that product
                            arrive(mbar, "do_free")
                        else:
                            arrive(mbar, "empty_do")
                        published()
                        wg_bar(0)
                        mark(sProf, 0, 5, lt)
                        # dH += q^T do_s
                        wait(mbar, "full_q", it)
                        mark(sProf, 0, 6, lt)
                        mm(mma_h, accH, tv(sQ), tv(sDw), False, lt)
                        done()
                        arrive(mbar, "empty_q")
                        arrive(mbar, "dos_free")
                        mark(sProf, 0, 7, lt)
                        # dH += k^T (-diag(beta eg) dvb), once W1 hands it over
                        wait(mbar, "dvb_full", it)
                        wait_k(mbar, it)
                        mark(sProf, 0, 8, lt)
                        mm(mma_h, accH, tv(sKc), tv(sDvb), False, lt)
                        done()
                        mark(sProf, 0, 9, lt)
                        arrive(mbar, "dvb_empty")
                        if cutlass.const_expr(KDB):
                            arrive(mbar, "empty_do")
                        release_k(mbar, it)
                        arrive(mbar, "vec_empty", it, paired=True)
            # the initial state's gradient
            for e in cutlass.range_constexpr(cute.size(accH)):
                od, ov = cH[e]
                if cutlass.const_expr(state_vk):
                    mDh0[b, hv, ov, od] = accH[e]
                else:
                    mDh0[b, hv, od, ov] = accH[e]
            if cutlass.const_expr(PROF):
                prof_end(sProf, mProf, 0, lt, cta)
        elif wg == 1:
            # ================================================================ W1: dvn, dv, dk
            cute.arch.setmaxregister_increase(REGS[2])
            if cutlass.const_expr(PROF):
                prof_start(sProf, 1, lt)
            grp = facts["grp_ck"]
            thr_r = mma_ckr.get_slice(lt)
            cA = thr_r.partition_A(cute.make_identity_tensor((C, C)))
            for itp in cutlass.range((nchunks + 1) // 2, unroll=1):
                for par in cutlass.range_constexpr(2):  # chunk it in buffer par: every buffer static
                    it = itp * 2 + par
                    if it < nchunks:
                        sKc = sKb[par]
                        c = nchunks - 1 - it
                        t0 = c * C
                        length = cutlass.min(T - t0, C)
                        wait(mbar, "vec_full", it, paired=True)
                        glast = sGc[par, C - 1]
                        # dvn = diag(kdec) (k dH) + P^T do
                        wait(mbar, "h_full", it)
                        wait_k(mbar, it)
                        mark(sProf, 1, 0, lt)
                        acc = acc_of(mma_ckt, C, V, lt)
                        mm(mma_ckt, acc, sKc, tv(sH), True, lt)
                        done()
                        for e in cutlass.range_constexpr(cute.size(acc)):
                            i, _ = cCK[e]
                            acc[e] = acc[e] * ex2(glast - sGc[par, i])
                        mark(sProf, 1, 1, lt)
                        wait(mbar, "p_full", it)
                        wait(mbar, "full_do", it)
                        mark(sProf, 1, 2, lt)
                        mm(mma_ckta, acc, tv(sX), tv(sDo), False, lt)
                        done()
                        if cutlass.const_expr(not DQ1):  # (DQ1: do is read again for dq)
                            arrive(mbar, "empty_do")
                        mark(sProf, 1, 3, lt)
                        if cutlass.const_expr(DEBUG):  # dvn, float32
                            store_pairs(acc, cCK, cute.domain_offset((t0, 0), mDvnD[b, None, hv, None]), length)
                        if it > 0:
                            wait(mbar, "dvn_empty", it - 1)
                        mark(sProf, 1, 4, lt)
                        acc_to_tile(acc, cCK, sDvn, False)
                        published()
                        wg_bar(1)
                        arrive(mbar, "dvn_full")
                        mark(sProf, 1, 5, lt)
                        # dvb = Tm^T dvn ; dv = beta dvb ; rowsum(v * dvb) ; -diag(beta eg) dvb to W0
                        wait(mbar, "full_tm", it)
                        mark(sProf, 1, 6, lt)
                        mm(mma_ckta, acc, tv(sTm), tv(sDvn), True, lt)
                        done()
                        if cutlass.const_expr(SPLITDK):  # (W1's only read of Tm)
                            arrive(mbar, "empty_tm")
                        mark(sProf, 1, 7, lt)
                        wait(mbar, "full_v", it)
                        gDv = cute.domain_offset((t0, 0), mDv[b, None, hv, None])
                        if it > 0:
                            wait(mbar, "dvb_empty", it - 1)
                        if cutlass.const_expr(KDB):  # dvb goes over do: W0 and W2 are done reading it
                            wait(mbar, "do_free", it)
                        if it >= 2:  # W2 is done with this buffer's rows (two chunks ago)
                            wait(mbar, "rows_empty", it - 2, paired=True)
                        mark(sProf, 1, 8, lt)
                        for gi in cutlass.range_constexpr(len(grp)):
                            i, _ = cCK[grp[gi][0]]
                            bi = sB[par, i]
                            fneg = -bi * ex2(sGc[par, i])
                            rs = Float32(0.0)
                            for e in grp[gi][0::2]:
                                _, vv = cCK[e]
                                v0, v1 = ld2(sV, i, vv)
                                rs = rs + v0 * acc[e] + v1 * acc[e + 1]
                                st2(sDvb, i, vv, fneg * acc[e], fneg * acc[e + 1])
                                acc[e] = acc[e] * bi
                                acc[e + 1] = acc[e + 1] * bi
                            rs = quad_sum(rs)
                            if lt % 4 == 0:
                                sR1[par, 1, i] = rs
                        arrive(mbar, "empty_v")
                        published()
                        arrive(mbar, "dvb_full")
                        store_pairs(acc, cCK, gDv, length)
                        mark(sProf, 1, 9, lt)
                        # dk = diag(kdec) vn dH^T (kdt = kdec rowsum(k * vn dH^T)) + dQK^T q + (diag(beta eg) Tm^T) dw
                        #      + dKK k + dKK^T k
                        wait(mbar, "full_vn", it)
                        mark(sProf, 1, 10, lt)
                        mm(mma_ck, acc, sVn, sH, True, lt)
                        done()
                        arrive(mbar, "h_empty")
                        arrive(mbar, "empty_vn")
                        rk2 = cute.make_rmem_tensor((2,), Float32)
                        scaled_rows(acc, cCK, grp, sKc, sGc, par, Float32(1.0), glast, -1, rk2)
                        if lt % 4 == 0:
                            for gi in cutlass.range_constexpr(2):
                                i, _ = cCK[grp[gi][0]]
                                sR1[par, 0, i] = rk2[gi]
                        if cutlass.const_expr(SPLITDK and not DQ1):  # (W1's last read of k)
                            release_k(mbar, it)
                        mark(sProf, 1, 11, lt)
                        wait(mbar, "dqk_full", it)
                        wait(mbar, "full_q", it)
                        mark(sProf, 1, 12, lt)
                        mm(mma_ckta, acc, tv(sDqk), tv(sQ), False, lt)
                        gDk = cute.domain_offset((t0, 0), mDk[b, None, hv, None])
                        if cutlass.const_expr(SPLITDK):
                            # W1's part of dk (kdt + dQK^T q) into dk's rows; W2 adds the rest and stores the sum
                            done()
                            if cutlass.const_expr(not DQ1):  # (DQ1: dQK and q are read again for dq)
                                arrive(mbar, "dqk_empty")
                                arrive(mbar, "empty_q")
                            mark(sProf, 1, 13, lt)
                            store_pairs(acc, cCK, gDk, length)
                            arrive(mbar, "dkp_full")
                            if cutlass.const_expr(DQ1):
                                # dq = scale diag(eg) do Sc^T + dQK k ; dgc's rowsum(q * dqg) to W2
                                wait(mbar, "full_s", it)
                                mark(sProf, 1, 18, lt)
                                mm(mma_ck, acc, sDo, sS, True, lt)
                                done()
                                arrive(mbar, "empty_do")
                                arrive(mbar, "empty_s")
                                rq2 = cute.make_rmem_tensor((2,), Float32)
                                scaled_rows(acc, cCK, grp, sQ, sGc, par, scale, Float32(0.0), 1, rq2)
                                if lt % 4 == 0:
                                    for gi in cutlass.range_constexpr(2):
                                        i, _ = cCK[grp[gi][0]]
                                        sR1[par, 2, i] = rq2[gi]
                                mm(mma_ckt, acc, sDqk, tv(sKc), False, lt)
                                done()
                                arrive(mbar, "dqk_empty")
                                release_k(mbar, it)
                                if cutlass.const_expr(L2BWD):  # (reads q's tile: before its release)
                                    l2norm_bwd_rows(acc, cCK, grp, sQ, mRq, b, t0, h, length)
                                arrive(mbar, "empty_q")
                                store_pairs(acc, cCK, cute.domain_offset((t0, 0), mDq[b, None, hv, None]), length)
                                mark(sProf, 1, 19, lt)
                        else:
                            # A = diag(beta eg) Tm^T in registers while dQK^T q runs
                            rA = mma_ckr.make_fragment_A(thr_r.partition_shape_A((C, C)))
                            tm_regs(rA, cA, sTm, sB, sGc, par)
                            done()
                            arrive(mbar, "dqk_empty")
                            arrive(mbar, "empty_q")
                            mark(sProf, 1, 13, lt)
                            wait(mbar, "dw_full", it)
                            mark(sProf, 1, 14, lt)
                            gemm(mma_ckr, acc, rA, mma_ckr.make_fragment_B(thr_r.partition_B(tv(sDw))), False)
                            done()
                            arrive(mbar, "dw_empty")
                            arrive(mbar, "empty_tm")
                            mark(sProf, 1, 15, lt)
                            wait(mbar, "kk_full", it)
                            mark(sProf, 1, 16, lt)
                            mm(mma_ckt, acc, sX, tv(sKc), False, lt)
                            mm(mma_ckta, acc, tv(sX), tv(sKc), False, lt)
                            done()
                            arrive(mbar, "x_empty")
                            if cutlass.const_expr(L2BWD):  # (reads k's tile: before its release)
                                l2norm_bwd_rows(acc, cCK, grp, sKc, mRk, b, t0, h, length)
                            release_k(mbar, it)
                            store_pairs(acc, cCK, gDk, length)
                        arrive(mbar, "rows_full", it, paired=True)
                        arrive(mbar, "vec_empty", it, paired=True)
                        mark(sProf, 1, 17, lt)
            if cutlass.const_expr(PROF):
                prof_end(sProf, mProf, 1, lt, cta)
        else:
            # ================================================================ W2: the C x C work and dq
            cute.arch.setmaxregister_increase(REGS[3])
            if cutlass.const_expr(PROF):
                prof_start(sProf, 2, lt)
            grp_cc, grp_ck, cols_cc = facts["grp_cc"], facts["grp_ck"], facts["cols_cc"]
            thr_r = mma_ckr.get_slice(lt)  # (SPLITDK: dk's dw term, A in registers)
            cA = thr_r.partition_A(cute.make_identity_tensor((C, C)))
            for itp in cutlass.range((nchunks + 1) // 2, unroll=1):
                for par in cutlass.range_constexpr(2):  # chunk it in buffer par: every buffer static
                    it = itp * 2 + par
                    if it < nchunks:
                        sKc = sKb[par]
                        c = nchunks - 1 - it
                        t0 = c * C
                        length = cutlass.min(T - t0, C)
                        wait(mbar, "vec_full", it, paired=True)
                        # row terms of dgc and dbeta, each row's owned by its quad (the same rows in every accumulator)
                        rowg = [Float32(0.0), Float32(0.0)]
                        rowb = [Float32(0.0), Float32(0.0)]
                        # P = scale (q k^T) * E -> the X tile (W1's P^T do), kept in float32 for dP * P
                        wait(mbar, "full_q", it)
                        wait_k(mbar, it)
                        mark(sProf, 2, 0, lt)
                        accP = acc_of(mma_cc, C, C, lt)
                        mm(mma_cc, accP, sQ, sKc, True, lt)
                        done()
                        if cutlass.const_expr(DQ1):  # (W2's only read of q)
                            arrive(mbar, "empty_q")
                        mark(sProf, 2, 1, lt)
                        if cutlass.const_expr(not SPLITDK):  # (SPLITDK: W1 does not read the X tile after P)
                            if it > 0:
                                wait(mbar, "x_empty", it - 1)
                        mark(sProf, 2, 2, lt)
                        scaled_lower(accP, cCC, sGc, par, scale)
                        acc_to_tile(accP, cCC, sX, False)
                        published()
                        arrive(mbar, "p_full")
                        mark(sProf, 2, 3, lt)
                        # dP = do vn^T ; dQK = scale dP * E -> its tile ; dP * P's row and column sums
                        wait(mbar, "full_do", it)
                        wait(mbar, "full_vn", it)
                        mark(sProf, 2, 4, lt)
                        accD = acc_of(mma_cc, C, C, lt)
                        mm(mma_cc, accD, sDo, sVn, True, lt)
                        done()
                        arrive(mbar, "empty_vn")
                        if cutlass.const_expr(DQ1):  # (W2's last read of do)
                            arrive(mbar, "empty_do")
                        for gi in cutlass.range_constexpr(len(grp_cc)):
                            s = Float32(0.0)
                            for e in grp_cc[gi]:
                                s = s + accD[e] * accP[e]
                            rowg[gi] = rowg[gi] + quad_sum(s)
                        for e in cutlass.range_constexpr(cute.size(accP)):
                            accP[e] = accD[e] * accP[e]
                        col_parts(accP, cCC, cols_cc, sColP, warp, lane, False)
                        mark(sProf, 2, 5, lt)
                        if it > 0:
                            wait(mbar, "dqk_empty", it - 1)
                        mark(sProf, 2, 6, lt)
                        scaled_lower(accD, cCC, sGc, par, scale)
                        acc_to_tile(accD, cCC, sDqk, False)
                        published()
                        wg_bar(2)
                        arrive(mbar, "dqk_full")
                        mark(sProf, 2, 7, lt)
                        accQ = acc_of(mma_ck, C, K, lt)
                        if cutlass.const_expr(not DQ1):  # (DQ1: on W1)
                            # dq = scale diag(eg) do Sc^T + dQK k ; rowsum(scale eg q * do Sc^T)
                            wait(mbar, "full_s", it)
                            mark(sProf, 2, 8, lt)
                            mm(mma_ck, accQ, sDo, sS, True, lt)
                            done()
                            arrive(mbar, "empty_do")
                            if cutlass.const_expr(KDB):
                                arrive(mbar, "do_free")
                            rq2 = cute.make_rmem_tensor((2,), Float32)
                            scaled_rows(accQ, cCK, grp_ck, sQ, sGc, par, scale, Float32(0.0), 1, rq2)
                            for gi in cutlass.range_constexpr(2):
                                rowg[gi] = rowg[gi] + rq2[gi]
                            mm(mma_ckt, accQ, sDqk, tv(sKc), False, lt)
                            done()
                            if cutlass.const_expr(L2BWD):  # (reads q's tile: before its release)
                                l2norm_bwd_rows(accQ, cCK, grp_ck, sQ, mRq, b, t0, h, length)
                            arrive(mbar, "empty_q")
                            store_pairs(accQ, cCK, cute.domain_offset((t0, 0), mDq[b, None, hv, None]), length)
                            mark(sProf, 2, 9, lt)
                        # dw = -dvn Sc^T -> the do_s / dw tile, once W0's q^T do_s is done
                        if cutlass.const_expr(DQ1):  # (DQ1: no earlier wait of W2's saw Sc land)
                            wait(mbar, "full_s", it)
                        wait(mbar, "dvn_full", it)
                        mark(sProf, 2, 10, lt)
                        mm(mma_ck, accQ, sDvn, sS, True, lt)
                        done()
                        arrive(mbar, "empty_s")
                        mark(sProf, 2, 11, lt)
                        wait(mbar, "dos_free", it)
                        mark(sProf, 2, 12, lt)
                        acc_to_tile(accQ, cCK, sDw, True)
                        published()
                        wg_bar(2)
                        arrive(mbar, "dw_full")
                        mark(sProf, 2, 13, lt)
                        # dTm^T from dw k^T and dvn v^T ; the column sums of Tm * (dw k^T)
                        wait(mbar, "full_v", it)
                        wait(mbar, "full_tm", it)
                        mark(sProf, 2, 14, lt)
                        accX1 = acc_of(mma_cc, C, C, lt)
                        accX2 = acc_of(mma_cc, C, C, lt)
                        mm(mma_cc, accX1, sDw, sKc, True, lt)
                        mm(mma_cc, accX2, sDvn, sV, True, lt)
                        done()
                        arrive(mbar, "dvn_empty")
                        if cutlass.const_expr(not SPLITDK):  # (SPLITDK: dw is read again below)
                            arrive(mbar, "dw_empty")
                        arrive(mbar, "empty_v")
                        for e2 in cutlass.range_constexpr(cute.size(accX1) // 2):
                            e = 2 * e2
                            i, j = cCC[e]
                            t0v, t1v = ld2(sTm, i, j)
                            bj0 = sB[par, j]
                            bj1 = sB[par, j + 1]
                            x10 = accX1[e] * bj0 * ex2(sGc[par, j]) + accX2[e] * bj0
                            x11 = accX1[e + 1] * bj1 * ex2(sGc[par, j + 1]) + accX2[e + 1] * bj1
                            accX1[e] = accX1[e] * t0v
                            accX1[e + 1] = accX1[e + 1] * t1v
                            sX[j, i] = x10.to(dtype)
                            sX[j + 1, i] = x11.to(dtype)
                        col_parts(accX1, cCC, cols_cc, sColS, warp, lane, False)
                        published()
                        wg_bar(2)
                        mark(sProf, 2, 15, lt)
                        # M1 = Tm^T dTm -> the X tile ; dA = -strictly_lower(M1 Tm^T) ; k k^T
                        accM = acc_of(mma_cc, C, C, lt)
                        mm(mma_cca, accM, tv(sTm), sX, True, lt)
                        done()
                        wg_bar(2)
                        acc_to_tile(accM, cCC, sX, False)
                        published()
                        wg_bar(2)
                        mm(mma_cc, accM, sX, sTm, True, lt)
                        mm(mma_cc, accX2, sKc, sKc, True, lt)
                        done()
                        if cutlass.const_expr(not SPLITDK):  # (SPLITDK: Tm and k are read again below)
                            arrive(mbar, "empty_tm")
                            release_k(mbar, it)
                        wg_bar(2)
                        mark(sProf, 2, 16, lt)
                        # dA's terms: dAE = dA * Es ; dbeta += rowsum(dAE * KK) ; dA * A = beta dAE * KK (pairs) ;
                        # dKK = beta dAE -> the X tile
                        for gi in cutlass.range_constexpr(len(grp_cc)):
                            i, _ = cCC[grp_cc[gi][0]]
                            bi = sB[par, i]
                            gi_ = sGc[par, i]
                            sb_ = Float32(0.0)
                            for e in grp_cc[gi]:
                                _, j = cCC[e]
                                dae = Float32(0.0)
                                if j < i:
                                    dae = -accM[e] * ex2(gi_ - sGc[par, j])
                                t = dae * accX2[e]
                                sb_ = sb_ + t
                                accX2[e] = bi * t  # dA * A
                                accM[e] = bi * dae  # dKK
                            rowb[gi] = rowb[gi] + quad_sum(sb_)
                        for gi in cutlass.range_constexpr(len(grp_cc)):
                            s = Float32(0.0)
                            for e in grp_cc[gi]:
                                s = s + accX2[e]
                            rowg[gi] = rowg[gi] + quad_sum(s)
                        col_parts(accX2, cCC, cols_cc, sColP, warp, lane, True)
                        acc_to_tile(accM, cCC, sX, False)
                        published()
                        if cutlass.const_expr(not SPLITDK):
                            arrive(mbar, "kk_full")
                        wg_bar(2)
                        mark(sProf, 2, 17, lt)
                        if cutlass.const_expr(SPLITDK):
                            # dk's other part: (diag(beta eg) Tm^T) dw + dKK k + dKK^T k, then W1's part added
                            rA = mma_ckr.make_fragment_A(thr_r.partition_shape_A((C, C)))
                            tm_regs(rA, cA, sTm, sB, sGc, par)
                            accK = acc_of(mma_ck, C, K, lt)
                            gemm(mma_ckr, accK, rA, mma_ckr.make_fragment_B(thr_r.partition_B(tv(sDw))), True)
                            mm(mma_ckt, accK, sX, tv(sKc), False, lt)
                            mm(mma_ckta, accK, tv(sX), tv(sKc), False, lt)
                            done()
                            arrive(mbar, "dw_empty")
                            arrive(mbar, "empty_tm")
                            if cutlass.const_expr(not L2BWD):  # (k's last read here: W1's next k dH waits on it)
                                release_k(mbar, it)
                            mark(sProf, 2, 20, lt)
                            wait(mbar, "dkp_full", it)
                            mark(sProf, 2, 21, lt)
                            gDk = cute.domain_offset((t0, 0), mDk[b, None, hv, None])
                            add_pairs(accK, cCK, gDk, length)
                            if cutlass.const_expr(L2BWD):  # (reads k's tile: before its release)
                                l2norm_bwd_rows(accK, cCK, grp_ck, sKc, mRk, b, t0, h, length)
                                release_k(mbar, it)
                            store_pairs(accK, cCK, gDk, length)
                            mark(sProf, 2, 22, lt)
                        # dgc (the other warpgroups' rows joined) ; dg = reverse cumsum ; dbeta
                        wait(mbar, "rows_full", it, paired=True)
                        wait(mbar, "tail_full", it, paired=True)
                        mark(sProf, 2, 18, lt)
                        for gi in cutlass.range_constexpr(len(grp_cc)):
                            i, _ = cCC[grp_cc[gi][0]]
                            if lt % 4 == 0:
                                eg = ex2(sGc[par, i])
                                bi = sB[par, i]
                                cs = sColS[0, i] + sColS[1, i] + sColS[2, i] + sColS[3, i]
                                cp = sColP[0, i] + sColP[1, i] + sColP[2, i] + sColP[3, i]
                                kdt = sR1[par, 0, i]
                                sDgc[i] = rowg[gi] - cp + bi * eg * cs - kdt
                                if cutlass.const_expr(DQ1):
                                    sDgc[i] = sDgc[i] + sR1[par, 2, i]
                                db_ = rowb[gi] + eg * cs + sR1[par, 1, i]
                                if i < length:
                                    mDb[b, t0 + i, hv] = db_
                        wg_bar(2)
                        if warp == 0:
                            x0 = sDgc[2 * lane]
                            x1 = sDgc[2 * lane + 1]
                            tail = sR1[par, 0, 2 * lane] + sR1[par, 0, 2 * lane + 1]
                            sc_dh = Float32(0.0)
                            if lane < 4:
                                sc_dh = sTail[par, lane]
                            for o in cutlass.range_constexpr(5):
                                tail = tail + cute.arch.shuffle_sync_bfly(tail, offset=1 << o)
                                sc_dh = sc_dh + cute.arch.shuffle_sync_bfly(sc_dh, offset=1 << o)
                            if lane == 31:
                                x1 = x1 + tail + sc_dh * ex2(sGc[par, C - 1])
                            suf = x0 + x1  # -> the sum over the lanes >= this one
                            for o in cutlass.range_constexpr(5):
                                nxt = cute.arch.shuffle_sync_down(suf, offset=1 << o)
                                if lane + (1 << o) < 32:
                                    suf = suf + nxt
                            after = cute.arch.shuffle_sync_down(suf, offset=1)
                            if lane == 31:
                                after = Float32(0.0)
                            run1 = x1 + after
                            if 2 * lane < length:
                                mDg[b, t0 + 2 * lane, hv] = x0 + run1
                            if 2 * lane + 1 < length:
                                mDg[b, t0 + 2 * lane + 1, hv] = run1
                        wg_bar(2)
                        arrive(mbar, "rows_empty", it, paired=True)
                        arrive(mbar, "vec_empty", it, paired=True)
                        mark(sProf, 2, 19, lt)
            if cutlass.const_expr(PROF):
                prof_end(sProf, mProf, 2, lt, cta)

    # trace-time facts of the accumulator layouts the loops above rely on (checked in the host function, while
    # tracing, before the kernel's body reads them)
    facts = {}

    def trace_facts():
        threads = cm.sample_threads(1)
        mma_cc = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False)
        mma_ck = cm.make_mma(dtype, K, a_regs=False, b_mn_major=False)
        for m_, shp in ((mma_cc, (C, C)), (mma_ck, (C, K))):
            cm.check_acc_pairs(m_, shp, threads)
        for other in (cm.make_mma(dtype, K, a_regs=False, b_mn_major=True),
                      cm.make_mma(dtype, K, a_regs=False, b_mn_major=True, a_mn_major=True),
                      cm.make_mma(dtype, K, a_regs=True, b_mn_major=True)):
            cm.check_same_acc_layout(mma_ck, other, (C, K), threads)
        cm.check_same_acc_layout(mma_cc, cm.make_mma(dtype, C, a_regs=False, b_mn_major=False, a_mn_major=True),
                                 (C, C), threads)
        cm.check_acc_pairs(cm.make_mma(dtype, V, a_regs=False, b_mn_major=True, a_mn_major=True), (K, V), threads)
        grp_cc = cm.quad_row_groups(mma_cc, (C, C), threads)
        grp_ck = cm.quad_row_groups(mma_ck, (C, K), threads)
        if len(grp_cc) != 2 or len(grp_ck) != 2:
            raise AssertionError("two rows a thread in the [C, C] and [C, K] accumulators")
        for grp in grp_cc + grp_ck:  # a row's elements are whole pairs (e, e + 1), e even: [0::2] takes each once
            if len(grp) % 2 or any(grp[p + 1] != grp[p] + 1 or grp[p] % 2 for p in range(0, len(grp), 2)):
                raise AssertionError(f"accumulator row group {grp} is not made of element pairs")
        if _row_blocks(mma_cc, (C, C), threads) != _row_blocks(mma_ck, (C, K), threads):
            raise AssertionError("a row's owner differs between the [C, C] and [C, K] accumulators")
        for rows, cols in ((C, K), (C, V), (K, V), (C, C)):
            cm.check_mn_major_view(dtype, rows, cols)
        facts.update(grp_cc=grp_cc, grp_ck=grp_ck, cols_cc=_col_groups(mma_cc, (C, C), threads))

    @cute.jit
    def host(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mDo: cute.Tensor, mVn: cute.Tensor,
             mTm: cute.Tensor, mHs: cute.Tensor, mGc: cute.Tensor, mB: cute.Tensor, mDht: cute.Tensor,
             mDq: cute.Tensor, mDk: cute.Tensor, mDv: cute.Tensor, mDg: cute.Tensor, mDb: cute.Tensor,
             mDh0: cute.Tensor, mDvnD: cute.Tensor, mDhD: cute.Tensor, mRq: cute.Tensor, mRk: cute.Tensor,
             mProf: cute.Tensor, scale: Float32, T: Int32, NT: Int32, group: Int32, nseq: Int32, stream):
        trace_facts()
        HV = mV.shape[2]
        ta, tt = [], []
        for m, cols in ((mQ, K), (mK, K), (mV, V), (mDo, V), (mVn, V), (mTm, C)):
            a, t = cm.make_tma_rows_atom(dtype, m, C, cols)
            ta.append(a)
            tt.append(t)
        view = cute.make_tensor(mHs.iterator, cute.select(mHs.layout, mode=list(cm.STATE_ROWS)))
        a, t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), view, cm.smem_tile_layout(dtype, K, V),
                                           (K, V))
        kernel(mQ, mK, mV, mDo, mVn, mTm, mHs, mGc, mB, mDht, mDq, mDk, mDv, mDg, mDb, mDh0, mDvnD, mDhD, mRq, mRk,
               mProf, scale, T, NT, group,
               *ta, a, *tt, t).launch(grid=[nseq, HV, 1], block=[THREADS, 1, 1], stream=stream)

    f = fwd._fakes()
    args = (f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, V), f.rows4(dtype, V), f.rows4(dtype, V),
            f.rows4(dtype, C), f.rows4(dtype, V), f.any3(Float32), f.any3(Float32), f.state(),
            f.rows4(Float32, K), f.rows4(Float32, K), f.rows4(dtype, V), f.any3(Float32), f.any3(Float32), f.state(),
            f.rows4(Float32, V), f.state(), f.any3(Float32), f.any3(Float32), f.vec(cutlass.Int64), Float32(1.0),
            Int32(1), Int32(1), Int32(1), Int32(1), f.stream())
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


def _row_blocks(mma, shape_mn, threads):
    """Each sampled thread's rows of an accumulator (trace time)."""
    _, cute = kc.import_cute()
    out = []
    for t in threads:
        c = mma.get_slice(t).partition_C(cute.make_identity_tensor(shape_mn))
        out.append(tuple(sorted({tuple(c[e])[0] for e in range(cute.size(c))})))
    return tuple(out)


def _col_groups(mma, shape_mn, threads):
    """The accumulator elements of one thread grouped by column, ``((e, ...), ...)`` (trace time), the same for every
    thread; asserts that the lanes of a warp holding a column are those with the thread's ``lane % 4`` (so a column
    sum over the warp is three butterfly shuffles, offsets 4, 8, 16) and that the warp's lanes hold distinct rows."""
    _, cute = kc.import_cute()
    ref = None
    for t in threads:
        cols_of = {}
        c = mma.get_slice(t).partition_C(cute.make_identity_tensor(shape_mn))
        for e in range(cute.size(c)):
            cols_of.setdefault(tuple(c[e])[1], []).append(e)
        groups = tuple(tuple(v) for _, v in sorted(cols_of.items()))
        if ref is None:
            ref = groups
        elif groups != ref:
            raise AssertionError(f"thread {t}: column grouping differs")
        w0 = t - t % 32
        seen = set()
        for lane in range(32):
            cl = mma.get_slice(w0 + lane).partition_C(cute.make_identity_tensor(shape_mn))
            cset = {tuple(cl[e])[1] for e in range(cute.size(cl))}
            if (lane % 4 == t % 4) != (cset == set(cols_of)):
                raise AssertionError(f"lane {lane} of thread {t}'s warp: columns do not follow lane % 4")
            for e in range(cute.size(cl)):
                rc = tuple(cl[e])
                if rc in seen:
                    raise AssertionError(f"element {rc} held twice in a warp")
                seen.add(rc)
    return ref


def _static_checks(K: int, V: int) -> None:
    if K != 128 or V != 128:
        raise Unsupported(f"the fused backward serves K = V = 128, not K={K}, V={V}")


def kdb_default() -> bool:
    """``CUDNN_TRAIN_GDN_FUSED_KDB=1``: the fused backward with two k buffers (chunk it's k in buffer it % 2, loaded
    first, a chunk ahead) and dvb's hand-over tile over do's (released once W0's product on it is done) instead of
    a tile of its own: the next chunk's first products (W2's q k^T, W1's k dH) then wait for q alone, which is
    released mid-chunk, where a single k buffer is released only after the chunk's last products (W1's dKK k,
    W2's k k^T). Off until measured (prepared in the thirty-ninth session, not GPU-run)."""
    return cm.env_switch("CUDNN_TRAIN_GDN_FUSED_KDB", False)


def splitdk_default() -> bool:
    """``CUDNN_TRAIN_GDN_FUSED_SPLITDK=1``: dk's late terms on W2. W1 stores its part of dk (``kdt + dQK^T q``) to
    dk's rows and moves on to the next chunk; W2, once it has dw and dKK, forms ``(diag(beta eg) Tm^T) dw + dKK k
    + dKK^T k`` itself, adds W1's part (read back from the rows, after W1's ``dkp_full``) and stores the sum. W1
    then never waits for the end of W2's chain (dw -> dTm -> dA -> dKK) before the next chunk's dvn, which the plain
    schedule does: the chain's recurrence then holds the whole of W2's work in every chunk. The same products on
    the same roundings, summed in another order (the bits differ in the last place). Off until measured (fortieth
    session)."""
    return cm.env_switch("CUDNN_TRAIN_GDN_FUSED_SPLITDK", False)


def dq1_default() -> bool:
    """``CUDNN_TRAIN_GDN_FUSED_DQ1=1``: with split-dk, dq on W1 as well (``scale diag(eg) do Sc^T + dQK k``, its
    row sums for dg handed to W2 in a row vector), which balances the products a chunk at W0 2, W1 7, W2 11 (split-dk
    alone: 2, 5, 13). Implies split-dk; not with two k buffers (dvb goes over do's tile there, which dq still reads).
    The same bits as split-dk but for dg (dq's row sums join dgc last). Off until measured (fortieth session,
    prepared)."""
    return cm.env_switch("CUDNN_TRAIN_GDN_FUSED_DQ1", False)


def get_fused_bwd_kernel(dtype, K: int, V: int, has_dht: bool, state_vk: bool, kdb: bool = False,
                         debug: bool = False, l2bwd: bool = False, prof: bool = False, splitdk: bool = False,
                         dq1: bool = False):
    _static_checks(K, V)
    if dq1 and (kdb or not splitdk):
        raise Unsupported("dq on W1 (dq1) needs splitdk and one k buffer (not kdb)")
    key = ("fused_bwd", str(dtype), K, V, bool(has_dht), bool(state_vk)) + (("kdb",) if kdb else ()) + (
        ("debug",) if debug else ()) + (("l2bwd",) if l2bwd else ()) + (("prof",) if prof else ()) + (
        ("splitdk",) if splitdk else ()) + (("dq1",) if dq1 else ())
    return kc.get_kernel("gdn_bwd_fused", key, lambda: _build(fwd._dt(dtype), K, V, bool(has_dht), bool(state_vk),
                                                              bool(kdb), bool(debug), bool(l2bwd), bool(prof),
                                                              bool(splitdk), bool(dq1)), _SOURCES)


def fused_backward(q, k, v, gc, beta, do, vn, tm, hs, dht=None, *, scale: float, state_v_first: bool = False,
                   kdb: bool | None = None, debug: bool = False, rq=None, rk=None, profile=None,
                   splitdk: bool | None = None, dq1: bool | None = None):
    """Launch the fused backward (see the module docstring for the tensors). Returns ``(dq, dk, dv, dg, dbeta,
    dh0)``. Raises :class:`Unsupported` for what it does not serve (dtypes, head dims, layouts) before any launch.
    ``kdb``: the two-k-buffer variant (default :func:`kdb_default`); the same products and roundings, the same
    bits. ``debug``: a variant that also writes the chain's intermediates, float32, and returns them after the six
    outputs: dvn ``[B, T, HV, V]`` and the dH rows ``[B * NT, HV, K, V]`` (the gradient of the state leaving every
    chunk, [K, V] whatever the state layout), to locate a divergence from ``sweeps_ref`` on a GPU. ``rq``, ``rk``
    (``[B, T, H]`` float32, both or neither): the l2norm factors ``1 / sqrt(sum(x^2) + eps)`` of the rows q and k
    were normalized with; given, dq and dk leave through the l2norm's backward ``r (dy - y rowsum(y dy))`` (y the
    normalized rows, as given), the gradients of the rows before it. ``profile``: an int64 tensor of ``B * HV * 3 *
    (NPH + 1)`` elements on q's device: the profile variant (the same bits) writes there, per CTA (``b * HV + hv``)
    and warpgroup W0..W2, thread 0's clock64 cycles summed per phase (:data:`PHASES`) and the warpgroup's total."""
    cm.check_device(q)
    dt = q.dtype
    if dt not in (torch.bfloat16, torch.float16) or any(t.dtype != dt for t in (k, v, do, vn, tm, hs)):
        raise Unsupported("q, k, v, do, vn, tm, hs must share one half-precision dtype")
    if q.dim() != 4 or v.dim() != 4:
        raise Unsupported(f"shapes q {tuple(q.shape)}, v {tuple(v.shape)}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _static_checks(K, V)
    if tuple(k.shape) != tuple(q.shape) or tuple(v.shape[:2]) != (B, T) or H == 0 or HV % H:
        raise Unsupported(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (HV a multiple of H)")
    for name, t in (("do", do), ("vn", vn)):
        if tuple(t.shape) != tuple(v.shape):
            raise Unsupported(f"{name} must have v's shape")
    if tuple(tm.shape) != (B, T, HV, CHUNK):
        raise Unsupported(f"tm: {tuple(tm.shape)}, [B, T, HV, {CHUNK}] expected")
    for name, t in (("gc", gc), ("beta", beta)):
        if t.dtype != torch.float32 or tuple(t.shape) != (B, T, HV):
            raise Unsupported(f"{name}: float32 [B, T, HV]")
    if (rq is None) != (rk is None):
        raise Unsupported("rq and rk: both or neither")
    for name, t in (("rq", rq), ("rk", rk)):
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (B, T, H) or t.device != q.device):
            raise Unsupported(f"{name}: float32 [B, T, H] on q's device")
    NT = -(-T // CHUNK)
    if not hs.is_contiguous() or tuple(hs.shape) != (B * NT, HV, K, V):
        raise Unsupported(f"hs: contiguous [{B * NT}, {HV}, {K}, {V}] expected, got {tuple(hs.shape)}")
    if dht is not None and (dht.dtype != torch.float32 or tuple(dht.shape) != (B, HV, K, V)):
        raise Unsupported("dht: float32 [B, HV, K, V] ([B, HV, V, K] with state_v_first)")
    q, k, v, do, vn, tm = (cm.check_rows_aligned(n, t) for n, t in (("q", q), ("k", k), ("v", v), ("do", do),
                                                                    ("vn", vn), ("tm", tm)))
    for name, t in (("q", q), ("k", k), ("v", v), ("gc", gc), ("beta", beta), ("do", do), ("vn", vn), ("tm", tm),
                    ("hs", hs)) + ((("dht", dht),) if dht is not None else ()):
        if t.device != q.device:
            raise Unsupported(f"{name} on {t.device}")
        cm.check_index_range(name, t)
    kdb = kdb_default() if kdb is None else bool(kdb)
    dq1 = dq1_default() if dq1 is None else bool(dq1)
    splitdk = dq1 or (splitdk_default() if splitdk is None else bool(splitdk))
    if dq1 and kdb:
        raise Unsupported("dq on W1 (dq1) needs one k buffer (not kdb)")
    if profile is not None and (profile.dtype != torch.int64 or profile.numel() < B * HV * 3 * (NPH + 1)
                                or profile.device != q.device):
        raise Unsupported(f"profile: int64, {B * HV * 3 * (NPH + 1)} elements on q's device")
    dev = q.device
    dq = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dk = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dv = torch.empty(B, T, HV, V, dtype=dt, device=dev)
    dg = torch.empty(B, T, HV, dtype=torch.float32, device=dev)
    db = torch.empty(B, T, HV, dtype=torch.float32, device=dev)
    dh0 = torch.empty(B, HV, V, K, dtype=torch.float32, device=dev) if state_v_first else \
        torch.empty(B, HV, K, V, dtype=torch.float32, device=dev)
    dbg = ()
    if debug:
        dbg = (torch.zeros(B, T, HV, V, dtype=torch.float32, device=dev),
               torch.zeros(B * NT, HV, K, V, dtype=torch.float32, device=dev))
    if T == 0 or B == 0:
        if dht is None:
            dh0.zero_()
        else:
            dh0.copy_(dht)
        return (dq, dk, dv, dg, db, dh0) + dbg
    dht_t = dht  # (read in the layout dh0 is written in: [V, K] with state_v_first)
    fn = get_fused_bwd_kernel(dt, K, V, dht is not None, state_v_first, kdb, bool(debug), rq is not None,
                              profile is not None, splitdk, dq1)
    dummy, _, i64_dummy = fwd._dummies(dev)
    fn(q, k, v, do, vn, tm, hs, gc, beta, dummy.view(1, 1, 1, 1) if dht is None else dht_t,
       dq, dk, dv, dg, db, dh0, *(dbg or (torch.empty(1, 1, 1, V, dtype=torch.float32, device=dev),  # (unread)
                                          dummy.view(1, 1, 1, 1))),
       *((rq, rk) if rq is not None else (dummy.view(1, 1, 1), dummy.view(1, 1, 1))),
       i64_dummy if profile is None else profile.view(-1), float(scale), T, NT, HV // H, B)
    return (dq, dk, dv, dg, db, dh0) + dbg

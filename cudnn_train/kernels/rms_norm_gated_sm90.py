"""Gated RMSNorm kernels for SM90 (CuTeDSL): forward and backward, memory bound.

Layout: x, gate, y, dy are ``[M, D]`` with unit inner stride and a row stride
that is a multiple of 16 bytes; weight ``[D]``; rstd ``[M]`` float32.

Work split: a row is served by TPR consecutive threads (TPR = min(32, D / VEC),
a power of two), each owning NV vectors of VEC elements (16 bytes: 8 bf16/fp16
or 4 fp32), at columns ``(v * TPR + lane) * VEC`` so that a warp's accesses are
contiguous. A CTA of 128 threads holds 128 / TPR row groups; each thread serves
R rows, loading all of them before the first reduction so that several 16-byte
loads per thread are in flight. The row sum is a butterfly shuffle inside the
row group. All math is float32.

Forward: one CTA per ``ROWS = (128 / TPR) * R`` rows; writes y and rstd.

Backward: a persistent grid (at most ``CTAS_PER_SM`` CTAs per SM) walks the row
blocks; each thread accumulates its columns of dweight in registers over the
rows it visits; the row groups of a CTA are summed in shared memory in a fixed
order into one partial row per CTA of a float32 workspace ``[grid, D]``, which
a second kernel of the same launch sums in a fixed order into dweight (in the
weight's dtype). No float atomics: the result is bitwise
reproducible run to run.

Rows past M are loaded as zeros (they add nothing to dweight) and never stored.
"""


import torch

from ..backend import Served, Unsupported
from . import compile as kc

import os

# Tuning knobs (read when a kernel is first built; part of the compile key).
THREADS = 128  # threads per CTA
LOADS_IN_FLIGHT = 4  # 16-byte loads per thread per row block (the backward double-buffers them)
CTAS_PER_SM = 8  # backward persistent grid
MAX_D = 2048
_SOURCES = (__file__,)

# Tests set this to fill every output with NaN before the kernel writes it.
POISON = os.environ.get("CUDNN_TRAIN_POISON", "0") == "1"


def _out_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    return out.fill_(float("nan")) if POISON else out


def _plan(d: int, elem_bytes: int) -> tuple[int, int, int]:
    """(VEC, TPR, NV) for a row of d elements, or raise Unsupported."""
    vec = 16 // elem_bytes
    if d % vec != 0:
        raise Unsupported(f"D={d} is not a multiple of {vec}")
    if d > MAX_D:
        raise Unsupported(f"D={d} > {MAX_D}")
    nvec = d // vec
    if nvec <= 32:
        if nvec & (nvec - 1):
            raise Unsupported(f"D={d}: {nvec} vectors per row is not a power of two")
        return vec, nvec, 1
    if nvec % 32:
        raise Unsupported(f"D={d}: {nvec} vectors per row is not a multiple of 32")
    return vec, 32, nvec // 32


def _rows_per_thread(nv: int, tensors: int, loads: int) -> int:
    return max(1, loads // (nv * tensors))


_TORCH_TO_CUTE = {}


def _cute_dtype(dt: torch.dtype):
    cutlass, _ = kc.import_cute()
    if not _TORCH_TO_CUTE:
        _TORCH_TO_CUTE.update(
            {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
        )
    return _TORCH_TO_CUTE[dt]


_SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_serve(x2: torch.Tensor, w: torch.Tensor | None, others: tuple[torch.Tensor, ...]) -> None:
    """Decline (before touching memory) what these kernels do not serve."""
    if not x2.is_cuda:
        raise Unsupported("no GPU" if not torch.cuda.is_available() else f"tensor on {x2.device}")
    if kc.cuda_sm_major(x2.device) != 9:
        raise Unsupported(f"sm_{''.join(map(str, torch.cuda.get_device_capability(x2.device)))} is not SM90")
    if x2.dtype not in _SERVED_DTYPES:
        raise Unsupported(f"dtype {x2.dtype}")
    esize = x2.element_size()
    for t in (x2,) + others:
        st = t.stride()
        if st[1] != 1 or (st[0] * esize) % 16 or t.data_ptr() % 16:
            raise Unsupported("rows not 16-byte aligned")
    if w is not None and (w.dtype not in _SERVED_DTYPES or w.stride(0) != 1 or w.data_ptr() % 16):
        raise Unsupported(f"weight dtype {w.dtype} / stride {w.stride()} / alignment")
    if x2.numel() >= 2**31:
        raise Unsupported("2**31 elements or more")


# ------------------------------------------------------------------ kernels


def _build(kind: str, dtype, wdtype, d: int, act: str, threads: int, loads: int):
    """Compile the forward (kind='fwd') or backward (kind='bwd') kernel; returns the compiled object."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32

    elem_bytes = dtype.width // 8
    VEC, TPR, NV = _plan(d, elem_bytes)
    GROUPS = threads // TPR
    R = _rows_per_thread(NV, 2 if kind == "fwd" else 3, loads)
    ROWS = GROUPS * R
    HAS_W = wdtype is not None
    SWISH = act == "swish"
    LOG2E = 1.4426950408889634
    SHFL = [1 << i for i in range(TPR.bit_length() - 1)]
    D = d

    def vec_tile(t, row, v, lane):
        return cute.local_tile(t, (1, VEC), (row, v * TPR + lane))[0, None]

    @cute.jit
    def row_sum(val):
        for off in cutlass.range_constexpr(len(SHFL)):
            val = val + cute.arch.shuffle_sync_bfly(val, offset=SHFL[off])
        return val

    @cute.jit
    def load_vec(t, row, v, lane, M):
        frag = cute.make_rmem_tensor((VEC,), t.element_type)
        frag.fill(0)
        if row < M:
            cute.autovec_copy(vec_tile(t, row, v, lane), frag)
        return frag.load().to(Float32)

    @cute.jit
    def prefetch(mDY, mX, mG, mR, bDY, bX, bG, bR, base, lane, M):
        for r in cutlass.range_constexpr(R):
            row = base + r * GROUPS
            bR[r] = Float32(0.0)
            for v in cutlass.range_constexpr(NV):
                i = r * NV + v
                bDY[i, None].fill(0)
                bX[i, None].fill(0)
                bG[i, None].fill(0)
                if row < M:
                    cute.autovec_copy(vec_tile(mDY, row, v, lane), bDY[i, None])
                    cute.autovec_copy(vec_tile(mX, row, v, lane), bX[i, None])
                    cute.autovec_copy(vec_tile(mG, row, v, lane), bG[i, None])
            if row < M:
                bR[r] = mR[row]

    @cute.jit
    def load_weight(mW, lane):
        ws = []
        for v in cutlass.range_constexpr(NV):
            frag = cute.make_rmem_tensor((VEC,), mW.element_type)
            cute.autovec_copy(cute.local_tile(mW, (VEC,), (v * TPR + lane,)), frag)
            ws.append(frag.load().to(Float32))
        return ws

    @cute.jit
    def store_vec(t, val, row, v, lane):
        frag = cute.make_rmem_tensor((VEC,), t.element_type)
        frag.store(val.to(t.element_type))
        cute.autovec_copy(frag, vec_tile(t, row, v, lane))

    @cute.jit
    def sigmoid(g):
        return cute.math.rcp(1.0 + cute.math.exp2(g * (-LOG2E), fastmath=True), approx=True, ftz=True)

    if kind == "fwd":

        @cute.kernel
        def kernel(mX: cute.Tensor, mG: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mR: cute.Tensor, eps: Float32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            M = mX.shape[0]
            lane = tidx % TPR
            grp = tidx // TPR
            base = bidx * ROWS + grp
            xs = []
            gs = []
            for r in cutlass.range_constexpr(R):
                for v in cutlass.range_constexpr(NV):
                    xs.append(load_vec(mX, base + r * GROUPS, v, lane, M))
                    gs.append(load_vec(mG, base + r * GROUPS, v, lane, M))
            if cutlass.const_expr(HAS_W):
                ws = load_weight(mW, lane)
            for r in cutlass.range_constexpr(R):
                row = base + r * GROUPS
                ss = Float32(0.0)
                for v in cutlass.range_constexpr(NV):
                    xv = xs[r * NV + v]
                    ss = ss + (xv * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                ss = row_sum(ss)
                rstd = cute.math.rsqrt(ss * (1.0 / D) + eps)
                if row < M:
                    for v in cutlass.range_constexpr(NV):
                        g = gs[r * NV + v]
                        a = sigmoid(g)
                        if cutlass.const_expr(SWISH):
                            a = g * a
                        y = xs[r * NV + v] * rstd * a
                        if cutlass.const_expr(HAS_W):
                            y = y * ws[v]
                        store_vec(mY, y, row, v, lane)
                    if lane == 0:
                        mR[row] = rstd

        @cute.jit
        def host(mX: cute.Tensor, mG: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, mR: cute.Tensor, eps: Float32, stream):
            M = mX.shape[0]
            kernel(mX, mG, mW, mY, mR, eps).launch(grid=[cute.ceil_div(M, ROWS), 1, 1], block=[threads, 1, 1], stream=stream)

    else:

        @cute.kernel
        def kernel(
            mDY: cute.Tensor,
            mX: cute.Tensor,
            mG: cute.Tensor,
            mW: cute.Tensor,
            mR: cute.Tensor,
            mDX: cute.Tensor,
            mDG: cute.Tensor,
            mDWp: cute.Tensor,
        ):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            nctas, _, _ = cute.arch.grid_dim()
            M = mX.shape[0]
            lane = tidx % TPR
            grp = tidx // TPR
            nblocks = (M + ROWS - 1) // ROWS
            if cutlass.const_expr(HAS_W):
                ws = load_weight(mW, lane)
            dw = cute.make_rmem_tensor((NV, VEC), Float32)
            dw.fill(0.0)
            # Register double buffer: the raw 16-bit vectors of the next row block are
            # loaded while the current one is computed, so loads stay in flight.
            NBUF = R * NV
            bDY = cute.make_rmem_tensor((NBUF, VEC), mDY.element_type)
            bX = cute.make_rmem_tensor((NBUF, VEC), mX.element_type)
            bG = cute.make_rmem_tensor((NBUF, VEC), mG.element_type)
            bR = cute.make_rmem_tensor((R,), Float32)
            prefetch(mDY, mX, mG, mR, bDY, bX, bG, bR, bidx * ROWS + grp, lane, M)
            for blk in cutlass.range(bidx, nblocks, nctas):
                base = blk * ROWS + grp
                xs = []
                gs = []
                dys = []
                rs = []
                for i in cutlass.range_constexpr(NBUF):
                    dys.append(bDY[i, None].load().to(Float32))
                    xs.append(bX[i, None].load().to(Float32))
                    gs.append(bG[i, None].load().to(Float32))
                for r in cutlass.range_constexpr(R):
                    rs.append(bR[r])
                prefetch(mDY, mX, mG, mR, bDY, bX, bG, bR, (blk + nctas) * ROWS + grp, lane, M)
                for r in cutlass.range_constexpr(R):
                    row = base + r * GROUPS
                    rstd = rs[r]
                    ns = []
                    dns = []
                    c = Float32(0.0)
                    for v in cutlass.range_constexpr(NV):
                        i = r * NV + v
                        g = gs[i]
                        s = sigmoid(g)
                        if cutlass.const_expr(SWISH):
                            a = g * s
                            da = s * (1.0 + g * (1.0 - s))
                        else:
                            a = s
                            da = s * (1.0 - s)
                        n = xs[i] * rstd
                        dya = dys[i] * a
                        # dweight partial: dy * n * a
                        acc = dw[v, None].load() + dya * n
                        dw[v, None].store(acc)
                        if cutlass.const_expr(HAS_W):
                            dn = dya * ws[v]
                            dg = dys[i] * n * ws[v] * da
                        else:
                            dn = dya
                            dg = dys[i] * n * da
                        c = c + (dn * n).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                        ns.append(n)
                        dns.append(dn)
                        if row < M:
                            store_vec(mDG, dg, row, v, lane)
                    c = row_sum(c) * (1.0 / D)
                    if row < M:
                        for v in cutlass.range_constexpr(NV):
                            dx = (dns[v] - ns[v] * c) * rstd
                            store_vec(mDX, dx, row, v, lane)
            # reduce the row groups' dweight partials in shared memory, in a fixed order
            smem = cutlass.utils.SmemAllocator()
            sDW = smem.allocate_tensor(Float32, cute.make_layout((GROUPS, D), stride=(D, 1)), 16)
            for v in cutlass.range_constexpr(NV):
                frag = cute.make_rmem_tensor((VEC,), Float32)
                frag.store(dw[v, None].load())
                cute.autovec_copy(frag, vec_tile(sDW, grp, v, lane))
            cute.arch.sync_threads()
            for j in cutlass.range_constexpr((D + threads - 1) // threads):
                col = j * threads + tidx
                if col < D:
                    acc = Float32(0.0)
                    for gi in cutlass.range_constexpr(GROUPS):
                        acc = acc + sDW[gi, col]
                    mDWp[bidx, col] = acc

        # dweight reduction: a CTA of RW warps per 32 columns (a lane owns a column); each warp
        # walks every RW-th partial row, UNR predicated loads issued before any of them is added
        # (a plain unrolled loop puts a loop-exit branch between the loads: one in flight)
        RW = 32
        UNR = 8

        @cute.kernel
        def reduce_dw(mDWp: cute.Tensor, mDW: cute.Tensor):
            # dweight[c] = sum over the CTA partial rows p of mDWp[p, c], in a fixed order:
            # warp w sums rows w, w + RW, ... ; then the RW warp sums in warp order.
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            P = mDWp.shape[0]
            lane = tidx % 32
            wid = tidx // 32
            col = bidx * 32 + lane
            colc = col if col < D else D - 1  # lanes past D read a valid column, store nothing
            acc = Float32(0.0)
            buf = cute.make_rmem_tensor((UNR,), Float32)
            for p0 in cutlass.range(wid, P, RW * UNR):
                for j in cutlass.range_constexpr(UNR):
                    buf[j] = Float32(0.0)
                    if p0 + j * RW < P:
                        buf[j] = mDWp[p0 + j * RW, colc]
                for j in cutlass.range_constexpr(UNR):
                    acc = acc + buf[j]
            smem = cutlass.utils.SmemAllocator()
            sAcc = smem.allocate_tensor(Float32, cute.make_layout((RW, 32), stride=(33, 1)), 16)
            sAcc[wid, lane] = acc
            cute.arch.sync_threads()
            if wid == 0:
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(RW):
                    tot = tot + sAcc[w, lane]
                if col < D:
                    mDW[col] = tot.to(mDW.element_type)

        @cute.jit
        def host(
            mDY: cute.Tensor,
            mX: cute.Tensor,
            mG: cute.Tensor,
            mW: cute.Tensor,
            mR: cute.Tensor,
            mDX: cute.Tensor,
            mDG: cute.Tensor,
            mDWp: cute.Tensor,
            mDW: cute.Tensor,
            stream,
        ):
            nctas = mDWp.shape[0]
            kernel(mDY, mX, mG, mW, mR, mDX, mDG, mDWp).launch(grid=[nctas, 1, 1], block=[threads, 1, 1], stream=stream)
            if cutlass.const_expr(HAS_W):
                reduce_dw(mDWp, mDW).launch(grid=[(D + 31) // 32, 1, 1], block=[32 * RW, 1, 1], stream=stream)

    # fake tensors: symbolic M and row strides (16-byte aligned), static D
    m = cute.sym_int()
    div = VEC

    def rows_t(dt):
        return cute.runtime.make_fake_tensor(dt, (m, D), (cute.sym_int(divisibility=div), 1), assumed_align=16)

    w_fake = cute.runtime.make_fake_compact_tensor(wdtype if HAS_W else dtype, (D,), assumed_align=16)
    r_fake = cute.runtime.make_fake_compact_tensor(Float32, (m,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}"
    if kind == "fwd":
        return cute.compile(host, rows_t(dtype), rows_t(dtype), w_fake, rows_t(dtype), r_fake, Float32(1e-5), stream, options=opts)
    p = cute.sym_int()
    dwp_fake = cute.runtime.make_fake_compact_tensor(Float32, (p, D), stride_order=(1, 0), assumed_align=16)
    return cute.compile(
        host, rows_t(dtype), rows_t(dtype), rows_t(dtype), w_fake, r_fake, rows_t(dtype), rows_t(dtype), dwp_fake, w_fake, stream,
        options=opts,
    )


_launchers = kc.launcher_cache()


def get_compiled(kind: str, dtype: torch.dtype, wdtype: torch.dtype | None, d: int, act: str):
    """The launchable kernel for these static facts (compiled once, cached in memory and on disk)."""
    fast_key = (kind, dtype, wdtype, d, act, kc.target_arch(), THREADS, LOADS_IN_FLIGHT)
    fn = _launchers.get(fast_key)
    if fn is None:
        _plan(d, dtype.itemsize)
        threads, loads = THREADS, LOADS_IN_FLIGHT
        key = (kind, str(dtype), str(wdtype), d, act, threads, loads)

        def build():
            wd = None if wdtype is None else _cute_dtype(wdtype)
            return _build(kind, _cute_dtype(dtype), wd, d, act, threads, loads)

        fn = kc.get_kernel("rms_norm_gated", key, build, _SOURCES)
        _launchers[fast_key] = fn
    return fn


# ------------------------------------------------------------------ launch


_fwd_plans: dict = kc.launcher_cache()


def forward(x2: torch.Tensor, g2: torch.Tensor, w: torch.Tensor | None, eps: float, act: str):
    _check_serve(x2, w, (g2,))
    m, d = x2.shape
    wdtype = None if w is None else w.dtype
    key = (x2.dtype, wdtype, d, act, THREADS, LOADS_IN_FLIGHT)
    fn = _fwd_plans.get(key)
    if fn is None:
        _plan(d, x2.element_size())
        fn = _fwd_plans[key] = get_compiled("fwd", x2.dtype, wdtype, d, act)
    y = _out_like(x2)
    rstd = _out_like(x2.new_empty(m, dtype=torch.float32))
    if m > 0:
        fn(x2, g2, x2[0] if w is None else w, y, rstd, eps)
    return Served((y, rstd), "sm90")


_bwd_plans: dict = kc.launcher_cache()


def backward(dy2, x2, g2, w, rstd, act: str):
    _check_serve(x2, w, (g2, dy2))
    m, d = x2.shape
    wdtype = None if w is None else w.dtype
    key = (x2.dtype, wdtype, d, act, x2.device.index, THREADS, LOADS_IN_FLIGHT, CTAS_PER_SM)
    plan = _bwd_plans.get(key)
    if plan is None:
        vec, tpr, nv = _plan(d, x2.element_size())
        rows = (THREADS // tpr) * _rows_per_thread(nv, 3, LOADS_IN_FLIGHT)
        plan = (get_compiled("bwd", x2.dtype, wdtype, d, act), rows, kc.num_sms(x2.device) * CTAS_PER_SM)
        _bwd_plans[key] = plan
    fn, rows, max_ctas = plan
    nctas = max(1, min(-(-m // rows), max_ctas))
    dx = _out_like(x2)
    dg = _out_like(g2)
    if m == 0:
        return Served((dx, dg, None if w is None else torch.zeros_like(w)), "sm90")
    # dweight: per-CTA partial rows, reduced in a fixed order by a second kernel of the same launch
    part = x2.new_empty(nctas, d, dtype=torch.float32)
    dw = None if w is None else _out_like(w)
    fn(dy2, x2, g2, x2[0] if w is None else w, rstd, dx, dg, part, x2[0] if w is None else dw)
    return Served((dx, dg, dw), "sm90")

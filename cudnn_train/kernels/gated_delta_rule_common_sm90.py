"""Shared pieces of the SM90 Gated DeltaNet kernels (CuTeDSL): tiles, copies, WGMMA helpers.

Everything here runs at trace time inside ``@cute.jit`` / ``@cute.kernel`` code
of ``gated_delta_rule_fwd_sm90.py`` and ``gated_delta_rule_bwd_sm90.py``.

Conventions
-----------
* One CTA is one warpgroup (128 threads); every WGMMA has M = 64 (one atom).
* Operand tiles in shared memory are row-major ``[rows, cols]`` with ``cols``
  contiguous, in the canonical swizzled GMMA layout (128-byte swizzle when a
  row is 128 bytes or more). Such a tile is a K-major operand when ``cols``
  is the reduction dim, and its transposed view ``[cols, rows]`` is the
  MN-major operand of the same bytes (checked at trace time by
  :func:`check_mn_major_view`).
* Register reshuffles between an accumulator and an A fragment are derived
  from the MMAs' own coordinate maps (:func:`acc_to_frag_map`) and checked to
  be the same for every thread of the warpgroup, never assumed.
"""


import os

import torch

from ..backend import Unsupported
from . import compile as kc

CHUNK = 64
THREADS = 128
LOG2E = 1.4426950408889634

_TORCH_TO_CUTE: dict = {}


def cute_dtype(dt: torch.dtype):
    cutlass, _ = kc.import_cute()
    if not _TORCH_TO_CUTE:
        _TORCH_TO_CUTE.update(
            {
                torch.bfloat16: cutlass.BFloat16,
                torch.float16: cutlass.Float16,
                torch.float32: cutlass.Float32,
                torch.int32: cutlass.Int32,
                torch.int64: cutlass.Int64,
            }
        )
    return _TORCH_TO_CUTE[dt]


def check_device(t: torch.Tensor) -> None:
    """Decline unless ``t`` lives on an SM90 GPU."""
    if t.device.type != "cuda":
        raise Unsupported("no GPU" if not torch.cuda.is_available() else f"tensor on {t.device}")
    major = kc.cuda_sm_major(t.device)
    if major != 9:
        cap = torch.cuda.get_device_capability(t.device)
        raise Unsupported(f"sm_{cap[0]}{cap[1]} is not SM90")


def check_rows_aligned(name: str, t: torch.Tensor) -> torch.Tensor:
    """Decline unless the last dim is contiguous and every row starts on 16 bytes; return ``t`` with the strides
    of its size-1 dims (never used to address anything, and free in torch: a [B, 1, H, K] tensor can carry stride
    1 there and still be contiguous) set as a contiguous tensor would have them, so the kernels' stride
    divisibility holds."""
    if t.stride(-1) != 1:
        raise Unsupported(f"{name}: last dim not contiguous")
    if t.data_ptr() % 16:
        raise Unsupported(f"{name}: not 16-byte aligned")
    st = list(t.stride())
    for d in reversed(range(t.dim() - 1)):
        if t.shape[d] == 1:
            st[d] = st[d + 1] * t.shape[d + 1]
    el = t.element_size()
    if any((s * el) % 16 for s in st[:-1]):
        raise Unsupported(f"{name}: stride {t.stride()} not a multiple of 16 bytes")
    return t if st == list(t.stride()) else t.as_strided(t.shape, st)


def check_index_range(name: str, t: torch.Tensor) -> None:
    """Decline tensors whose element offsets might not fit in int32."""
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()) if s > 0)
    if span >= 2**31:
        raise Unsupported(f"{name}: more than 2**31 addressable elements")


# ---------------------------------------------------------------- trace-time helpers
# (only call these while tracing a cute.jit / cute.kernel function)


def smem_tile_layout(dtype, rows: int, cols: int, max_swizzle: int = 128):
    """Swizzled ``[rows, cols]`` smem layout, ``cols`` contiguous: a K-major GMMA operand tile.
    The swizzle spans ``max_swizzle`` bytes at most (64: an MN-major view can be cut into
    32-element halves of 16-bit data without cutting a swizzle atom)."""
    _, cute = kc.import_cute()
    from cutlass.cute.nvgpu import warpgroup

    bits = cols * dtype.width
    if bits % 1024 == 0 and max_swizzle >= 128:
        kind = warpgroup.SmemLayoutAtomKind.K_SW128
    elif bits % 512 == 0:
        kind = warpgroup.SmemLayoutAtomKind.K_SW64
    elif bits % 256 == 0:
        kind = warpgroup.SmemLayoutAtomKind.K_SW32
    else:
        kind = warpgroup.SmemLayoutAtomKind.K_INTER
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))


def alloc_tile(smem, dtype, rows: int, cols: int, max_swizzle: int = 128):
    """A swizzled ``[rows, cols]`` operand tile (:func:`smem_tile_layout`) from an ``SmemAllocator``."""
    lay = smem_tile_layout(dtype, rows, cols, max_swizzle)
    return smem.allocate_tensor(dtype, lay.outer, 1024, lay.inner)


def transpose_view(t):
    """The ``[cols, rows]`` view of a 2-D smem tensor (same bytes)."""
    _, cute = kc.import_cute()
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0]))


def check_mn_major_view(dtype, rows: int, cols: int, max_swizzle: int = 128) -> None:
    """Assert that the transposed view of ``smem_tile_layout(rows, cols, max_swizzle)`` is the
    canonical MN-major GMMA layout of a ``[cols (MN), rows (K)]`` operand, offset by offset."""
    _, cute = kc.import_cute()
    from cutlass.cute.nvgpu import warpgroup

    kmaj = smem_tile_layout(dtype, rows, cols, max_swizzle)
    bits = cols * dtype.width
    kind = {1024: warpgroup.SmemLayoutAtomKind.MN_SW128, 512: warpgroup.SmemLayoutAtomKind.MN_SW64,
            256: warpgroup.SmemLayoutAtomKind.MN_SW32}
    sizes = tuple(b for b in (1024, 512, 256) if b <= 8 * max_swizzle)
    k = next((kind[b] for b in sizes if bits % b == 0), warpgroup.SmemLayoutAtomKind.MN_INTER)
    atom = warpgroup.make_smem_layout_atom(k, dtype)
    mn = cute.tile_to_shape(atom, (cols, rows), order=(1, 0))
    if str(kmaj.inner) != str(mn.inner):
        raise AssertionError(f"swizzles differ: {kmaj.inner} vs {mn.inner}")
    t_outer = cute.select(kmaj.outer, mode=[1, 0])
    for c in range(cols):
        for r in range(0, rows, max(1, rows // 16)):
            a = cute.crd2idx((c, r), t_outer)
            b = cute.crd2idx((c, r), mn.outer)
            if a != b:
                raise AssertionError(f"MN-major view mismatch at {(c, r)}: {a} vs {b}")


SAMPLE_THREADS = (0, 1, 2, 3, 4, 7, 8, 16, 31, 32, 45, 63, 64, 97, 127)


def sample_threads(wgs: int = 1):
    """The sampled threads of every warpgroup of a ``wgs``-warpgroup CTA (the layout checks' threads)."""
    return tuple(128 * w + t for w in range(wgs) for t in SAMPLE_THREADS)


def check_acc_pairs(mma, shape_mn, threads=SAMPLE_THREADS) -> None:
    """Assert that accumulator elements (2e, 2e+1) are columns (n, n+1), n even, of one row:
    the stores of paired elements rely on it."""
    _, cute = kc.import_cute()
    for t in threads:
        c = mma.get_slice(t).partition_C(cute.make_identity_tensor(shape_mn))
        for e in range(cute.size(c) // 2):
            (m0, n0), (m1, n1) = tuple(c[2 * e]), tuple(c[2 * e + 1])
            if m1 != m0 or n1 != n0 + 1 or n0 % 2:
                raise AssertionError(f"thread {t}: acc elements {2 * e}, {2 * e + 1} are {(m0, n0)}, {(m1, n1)}")


def make_acc_stmatrix_t(dtype, mma):
    """The tiled ``stmatrix`` (transposed, four 8 x 8 blocks) that stores ``mma``'s accumulator, rounded to 16-bit
    ``dtype``, into an M-major tile: a (M, N) view whose M is contiguous in 8-element rows (the ``[N, M]`` tile of
    :func:`smem_tile_layout`, seen through :func:`transpose_view`)."""
    _, cute = kc.import_cute()
    from cutlass.cute.nvgpu import warp

    stm = cute.make_copy_atom(warp.StMatrix8x8x16bOp(True, 4), dtype)
    return cute.make_tiled_copy_S(stm, cute.make_tiled_copy_C_atom(stm, mma))


def stmatrix_acc_t(copy, vals, tile_mn, tidx) -> None:
    """(Every thread, while tracing) ``vals`` (this thread's accumulator of ``copy``'s MMA, already in the 16-bit
    dtype, in the accumulator's layout) into ``tile_mn``, the (M, N) view of an M-major smem tile, by the tiled
    transposed ``stmatrix`` of :func:`make_acc_stmatrix_t`. The retiled fragment goes to the copy value by value,
    flat (the two group their modes differently; :func:`check_stmatrix_order` asserts the order)."""
    _, cute = kc.import_cute()
    thr = copy.get_slice(tidx)
    src = cute.make_rmem_tensor(thr.partition_S(tile_mn).shape, vals.element_type)
    held = copy.retile(vals)
    for f in range(cute.size(held)):
        src[f] = held[f]
    cute.copy(copy, src, thr.partition_D(tile_mn))


def make_acc_stmatrix(dtype, mma):
    """The tiled ``stmatrix`` (not transposed, four 8 x 8 blocks) that stores ``mma``'s accumulator, rounded to
    16-bit ``dtype``, into an N-major tile (the ``[M, N]`` tile of :func:`smem_tile_layout`, N contiguous); the
    values go through :func:`acc_to_stmatrix_map` and :func:`stmatrix_acc_mapped` as the transposed copy's do."""
    _, cute = kc.import_cute()
    from cutlass.cute.nvgpu import warp

    stm = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), dtype)
    return cute.make_tiled_copy_S(stm, cute.make_tiled_copy_C_atom(stm, mma))


def make_acc_ldmatrix_t(dtype, mma):
    """The tiled ``ldmatrix`` (transposed, four 8 x 8 blocks) that loads a 16-bit M-major tile (the (M, N) view of
    an ``[N, M]`` tile, as :func:`make_acc_stmatrix_t` writes one) into registers laid out as ``mma``'s
    accumulator: the inverse of that stmatrix. :func:`acc_to_ldmatrix_map` says which accumulator element each
    loaded value is."""
    _, cute = kc.import_cute()
    from cutlass.cute.nvgpu import warp

    ldm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), dtype)
    return cute.make_tiled_copy_D(ldm, cute.make_tiled_copy_C_atom(ldm, mma))


def acc_to_ldmatrix_map(mma, copy, shape_mn, threads=SAMPLE_THREADS):
    """Static map ``value index -> accumulator index``: value f of ``copy``'s destination partition (a
    :func:`make_acc_ldmatrix_t` copy over ``shape_mn``) is the element that ``mma``'s accumulator value ``map[f]``
    holds, for every thread; each accumulator value is loaded once. Raises otherwise."""
    return _acc_copy_map(mma, shape_mn, threads, lambda t, ident: copy.get_slice(t).partition_D(ident), "ldmatrix")


def ldmatrix_acc_blocks(copy, tile_mn, tidx):
    """(Every thread, while tracing) the :func:`make_acc_ldmatrix_t` copy ``copy`` from ``tile_mn`` as blocks, one
    ``ldmatrix`` each: ``(nv, [(src, dst_shape, first), ...])``, block b's values being the copy's destination values
    ``first .. first + nv - 1`` (see :func:`acc_to_ldmatrix_map`), so that a kernel can load one block just before it
    uses its values (few live registers)."""
    _, cute = kc.import_cute()
    thr = copy.get_slice(tidx)
    src = thr.partition_S(tile_mn)
    dst = thr.partition_D(tile_mn)  # ((the atom's values), M iterations, N iterations)
    nv, nm, nn = cute.size(dst.shape[0]), cute.size(dst.shape[1]), cute.size(dst.shape[2])
    return nv, [(src[(None, mi, ni)], dst[(None, mi, ni)].shape, nv * (mi + nm * ni))
                for ni in range(nn) for mi in range(nm)]


def check_stmatrix_order(mma, copy, shape_mn, threads) -> None:
    """Assert that value f of ``copy.retile(acc)`` (acc: ``mma``'s accumulator over ``shape_mn``) is the element
    that value f of the copy's source partition writes, for every f and thread: a kernel then hands the retiled
    fragment to the copy value by value, flat (the two group their modes differently)."""
    _, cute = kc.import_cute()
    ident = cute.make_identity_tensor(shape_mn)
    for t in threads:
        held = copy.retile(mma.get_slice(t).partition_C(ident))
        dest = copy.get_slice(t).partition_S(ident)
        if cute.size(held) != cute.size(dest):
            raise AssertionError(f"thread {t}: {cute.size(held)} accumulator values, {cute.size(dest)} copied")
        for f in range(cute.size(dest)):
            if tuple(held[f]) != tuple(dest[f]):
                raise AssertionError(f"thread {t}, value {f}: holds {tuple(held[f])}, the copy writes {tuple(dest[f])}")


def _coordinate_map(threads, held_of, wanted_of, what: str):
    """Static map ``index -> accumulator index``: for every thread t of ``threads``, element i of ``wanted_of(t)``
    (coordinates another partition takes) is the accumulator element ``map[i]`` of ``held_of(t)`` (the
    accumulator's coordinates). Raises if a coordinate is not held or the map differs between threads."""
    _, cute = kc.import_cute()
    ref = None
    for t in threads:
        held, wanted = held_of(t), wanted_of(t)
        where = {tuple(held[e]): e for e in range(cute.size(held))}
        m = []
        for i in range(cute.size(wanted)):
            crd = tuple(wanted[i])
            if crd not in where:
                raise AssertionError(f"thread {t}: {what} coordinate {crd} is not held by the accumulator")
            m.append(where[crd])
        if ref is None:
            ref = m
        elif m != ref:
            raise AssertionError(f"thread {t}: acc->{what} map differs from thread {threads[0]}")
    return tuple(ref)


def acc_to_stmatrix_map(mma, copy, shape_mn, threads=SAMPLE_THREADS):
    """Static map ``value index -> accumulator index``: value f of ``copy``'s source partition (a
    :func:`make_acc_stmatrix_t` copy of ``mma``'s accumulator over ``shape_mn``) writes the element that accumulator
    value ``map[f]`` holds; for accumulators whose retiled order is not the copy's (M = 128 on one warpgroup: the
    two group their modes differently, so :func:`check_stmatrix_order` fails there). Every accumulator value is
    copied once. Raises if the map differs between threads."""
    return _acc_copy_map(mma, shape_mn, threads, lambda t, ident: copy.get_slice(t).partition_S(ident), "stmatrix")


def _acc_copy_map(mma, shape_mn, threads, register_side, what: str):
    """The map of :func:`acc_to_stmatrix_map` / :func:`acc_to_ldmatrix_map`: ``register_side(t, ident)`` is the
    copy's register-side partition of the identity tensor for thread t; every accumulator value must occur once."""
    _, cute = kc.import_cute()
    ident = cute.make_identity_tensor(shape_mn)
    amap = _coordinate_map(threads, lambda t: mma.get_slice(t).partition_C(ident), lambda t: register_side(t, ident),
                           what)
    if sorted(amap) != list(range(len(amap))):
        raise AssertionError(f"the {what} copy does not move each of the {len(amap)} accumulator values once")
    return amap


def stmatrix_acc_mapped(copy, acc, amap, dtype, tile_mn, tidx) -> None:
    """(Every thread, while tracing) the float32 accumulator ``acc`` rounded to ``dtype`` into ``tile_mn`` (the
    (M, N) view of an M-major tile) by the transposed ``stmatrix`` ``copy``, value f taking ``acc[amap[f]]``
    (:func:`acc_to_stmatrix_map`)."""
    _, cute = kc.import_cute()
    thr = copy.get_slice(tidx)
    dst = thr.partition_D(tile_mn)
    shp = thr.partition_S(tile_mn).shape  # ((the atom's values), M iterations, N iterations)
    nv, nm, nn = cute.size(shp[0]), cute.size(shp[1]), cute.size(shp[2])
    for ni in range(nn):  # one stmatrix at a time, its values converted just before it (few live registers)
        for mi in range(nm):
            d = dst[(None, mi, ni)]
            src = cute.make_rmem_tensor(d.shape, dtype)
            for f in range(nv):
                src[f] = acc[amap[f + nv * (mi + nm * ni)]].to(dtype)
            cute.copy(copy, src, d)


def acc_to_frag_map(mma_c, shape_mn, mma_a, shape_mk, threads=SAMPLE_THREADS):
    """Static map ``frag index -> acc index`` so that A-fragment element ``i`` of ``mma_a``
    (operand tile ``shape_mk``) holds the accumulator element of ``mma_c`` (tile ``shape_mn``)
    with the same coordinate (m, k = n). Raises if the map differs between threads."""
    _, cute = kc.import_cute()
    return _coordinate_map(threads, lambda t: mma_c.get_slice(t).partition_C(cute.make_identity_tensor(shape_mn)),
                           lambda t: mma_a.get_slice(t).partition_A(cute.make_identity_tensor(shape_mk)), "A")


def make_mma(ab_dtype, n: int, a_regs: bool, b_mn_major: bool, a_mn_major: bool = False, wgs: int = 1,
             wgm: int = 1):
    """WGMMA tiled MMA, M = 64, N = ``n``, fp32 accumulators; A K-major (MN-major with
    ``a_mn_major``, only from shared memory: the transposed view of a row-major tile). With
    ``wgs`` warpgroups they split N: warpgroup w computes columns ``[w n / wgs, (w + 1) n / wgs)``
    from the whole A and its slice of B (a thread's slice of the MMA follows from its index). With
    ``wgm`` warpgroups they stack along M instead (M = 64 wgm): warpgroup w computes rows ``[64 w, 64 w + 64)``
    from its rows of A and the whole B."""
    _, cute = kc.import_cute()
    from cutlass import Float32
    from cutlass.cute.nvgpu import warpgroup
    import cutlass.utils.hopper_helpers as sm90

    K = cute.nvgpu.OperandMajorMode.K
    MN = cute.nvgpu.OperandMajorMode.MN
    if a_mn_major and a_regs:
        raise ValueError("an MN-major A operand comes from shared memory")
    return sm90.make_trivial_tiled_mma(
        ab_dtype,
        ab_dtype,
        MN if a_mn_major else K,
        MN if b_mn_major else K,
        Float32,
        (wgm, wgs, 1),
        tiler_mn=(64, n // wgs),  # one warpgroup's instruction; the atom layout tiles them
        a_source=warpgroup.OperandSource.RMEM if a_regs else warpgroup.OperandSource.SMEM,
    )


def env_switch(name: str, default: bool) -> bool:
    """A kernel variant's measurement switch: ``name`` = 1 or 0, ``default`` when unset or empty; any
    other value is a ValueError naming the variable (a typo must not silently pick a variant)."""
    env = os.environ.get(name, "").strip()
    if not env:
        return default
    if env not in ("0", "1"):
        raise ValueError(f"{name}={env!r}: expected 0 or 1")
    return env == "1"


def env_vblock(name: str, choices: tuple, V: int):
    """A V-block override: the int in ``name`` when set (one of ``choices`` dividing V, else a ValueError naming
    ``name``), None when unset or empty."""
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    if env not in tuple(str(c) for c in choices) or V % int(env):
        raise ValueError(f"{name}={env!r}: expected one of {choices} dividing V={V}")
    return int(env)


def two_ctas_an_sm(on: bool) -> dict:
    """Launch options of the two-warpgroup kernels that fit two CTAs an SM: ``min_blocks_per_mp=2``
    (ptxas then keeps a 256-thread CTA to 128 registers a thread) and the whole shared-memory
    carveout; none when ``on`` is False."""
    return dict(min_blocks_per_mp=2, preferred_smem_carveout=100) if on else {}


def make_gemm():
    """``gemm(tiled_mma, acc, tA, tB, zero_init)``: one warpgroup MMA over every K block of the
    fragments (accumulating into ``acc`` unless ``zero_init``); the caller commits and waits."""
    cutlass, cute = kc.import_cute()
    from cutlass.cute.nvgpu import warpgroup

    @cute.jit
    def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, zero_init: cutlass.Constexpr):
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for kb in cutlass.range_constexpr(cute.size(tA.shape[2])):
            cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)

    return gemm


def make_row_inv_norm(dtype, cols: int, eps: float):
    """``row_inv_norm(sX, r)``: ``1 / sqrt(sum_c sX[r, c]^2 + eps)`` of one smem row (the l2norm factor)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32

    @cute.jit
    def row_inv_norm(sX: cute.Tensor, r: Int32):
        ss = Float32(0.0)
        for vc in cutlass.range_constexpr(cols // 8):
            frag = cute.make_rmem_tensor((1, 8), dtype)
            cute.autovec_copy(cute.local_tile(sX, (1, 8), (r, vc)), frag)
            xv = frag.load().to(Float32)
            ss = ss + (xv * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        return cute.math.rsqrt(ss + eps)

    return row_inv_norm


def make_rows_inv_norm(dtype, cols: int, eps: float, threads: int = THREADS, normalize: bool = False):
    """``rows_inv_norm(sX, sR, t)``: the l2norm factors ``1 / sqrt(sum_c sX[r, c]^2 + eps)`` of all CHUNK rows
    of a ``[CHUNK, cols]`` smem tile into ``sR``, by ``threads`` threads (``t`` = 0 .. threads - 1, whole warps):
    eight threads a row, each summing its 16-byte vectors, then three butterfly shuffles. A warp's load
    reads four whole rows, so every bank once per 128 bytes with the tile's swizzle (where
    :func:`make_row_inv_norm`, a thread a row, reads the same column of 32 rows: a 4-way conflict). Another
    summation order than that helper's: the factors may differ in their last bit. ``normalize``: also the rows
    scaled by their factor in place (``x * r`` rounded to the input dtype), from the vectors the sums loaded (the
    shuffles leave every thread of a row its total). The caller syncs before reading ``sR`` (or the rows)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32

    TPR = 8
    VPT = cols // 8 // TPR  # 16-byte vectors a thread
    RPP = threads // TPR  # rows a pass
    assert VPT >= 1 and cols % 64 == 0 and CHUNK % RPP == 0, (cols, threads)

    @cute.jit
    def rows_inv_norm(sX: cute.Tensor, sR: cute.Tensor, t: Int32):
        for p in cutlass.range_constexpr(CHUNK // RPP):
            r = p * RPP + t // TPR
            c = t % TPR
            ss = Float32(0.0)
            frags = [cute.make_rmem_tensor((1, 8), dtype) for _ in range(VPT)]
            for j in cutlass.range_constexpr(VPT):
                cute.autovec_copy(cute.local_tile(sX, (1, 8), (r, j * TPR + c)), frags[j])
                xv = frags[j].load().to(Float32)
                ss = ss + (xv * xv).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=1)
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=2)
            ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=4)
            rinv = cute.math.rsqrt(ss + eps)
            if c == 0:
                sR[r] = rinv
            if cutlass.const_expr(normalize):
                for j in cutlass.range_constexpr(VPT):
                    frags[j].store((frags[j].load().to(Float32) * rinv).to(dtype))
                    cute.autovec_copy(frags[j], cute.local_tile(sX, (1, 8), (r, j * TPR + c)))

    return rows_inv_norm


def check_same_acc_layout(mma_a, mma_b, shape_mn, threads=SAMPLE_THREADS) -> None:
    """Assert that two tiled MMAs give every thread the same accumulator coordinates (so one
    accumulator tensor can collect both)."""
    _, cute = kc.import_cute()
    for t in threads:
        ca = mma_a.get_slice(t).partition_C(cute.make_identity_tensor(shape_mn))
        cb = mma_b.get_slice(t).partition_C(cute.make_identity_tensor(shape_mn))
        if cute.size(ca) != cute.size(cb) or any(tuple(ca[e]) != tuple(cb[e]) for e in range(cute.size(ca))):
            raise AssertionError(f"thread {t}: the two MMAs' accumulator layouts differ")


def make_state_io():
    """``start_state(acc, cS, mH, n, hv, v0, state_vk, present)`` / ``store_state(acc, cS, mH, n, hv, v0,
    state_vk)``: a state block ``[v0 : v0 + VB, :]`` of ``mH[n, hv]`` (``[K, V]``, or ``[V, K]`` with
    ``state_vk``) to and from the float32 accumulator ``acc`` whose coordinates ``cS`` are ``(v, d)``; the start
    is zero unless the state is ``present`` (an initial state, or the final state's gradient); a store rounds
    once to ``mH``'s element type (float32 states, or input-dtype chunk rows)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    @cute.jit
    def start_state(acc: cute.Tensor, cS: cute.Tensor, mH: cute.Tensor, n: Int32, hv: Int32, v0: Int32,
                    state_vk: cutlass.Constexpr, present: cutlass.Constexpr):
        if cutlass.const_expr(present):
            for e in cutlass.range_constexpr(cute.size(acc)):
                sv, sd = cS[e]
                if cutlass.const_expr(state_vk):
                    acc[e] = mH[n, hv, v0 + sv, sd]
                else:
                    acc[e] = mH[n, hv, sd, v0 + sv]
        else:
            acc.fill(0.0)

    @cute.jit
    def store_state(acc: cute.Tensor, cS: cute.Tensor, mH: cute.Tensor, n: Int32, hv: Int32, v0: Int32,
                    state_vk: cutlass.Constexpr):
        for e in cutlass.range_constexpr(cute.size(acc)):
            sv, sd = cS[e]
            val = acc[e].to(mH.element_type)
            if cutlass.const_expr(state_vk):
                mH[n, hv, v0 + sv, sd] = val
            else:
                mH[n, hv, sd, v0 + sv] = val

    return start_state, store_state


def make_store_pairs():
    """``store_pairs(acc, cAcc, gX, nvalid)``: float32 accumulator element pairs ``(e, e + 1)``
    (columns n, n + 1 of one row, checked with ``cm.check_acc_pairs``) into rows < nvalid of
    ``gX`` in its dtype, 4-byte stores."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    @cute.jit
    def store_pairs(acc: cute.Tensor, cAcc: cute.Tensor, gX: cute.Tensor, nvalid: Int32):
        for e in cutlass.range_constexpr(cute.size(acc) // 2):
            i, d = cAcc[2 * e]
            if i < nvalid:
                frag = cute.make_rmem_tensor((1, 2), gX.element_type)
                frag[0] = acc[2 * e].to(gX.element_type)
                frag[1] = acc[2 * e + 1].to(gX.element_type)
                cute.autovec_copy(frag, cute.local_tile(gX, (1, 2), (i, d // 2)))

    return store_pairs


def make_pairs_to_tile(dtype):
    """``pairs_to_tile(acc, cAcc, sX)``: float32 accumulator element pairs ``(e, e + 1)`` (columns n, n + 1 of one
    row, checked with ``cm.check_acc_pairs``) into the smem tile ``sX`` in ``dtype``, 4-byte stores."""
    cutlass, cute = kc.import_cute()

    @cute.jit
    def pairs_to_tile(acc: cute.Tensor, cAcc: cute.Tensor, sX: cute.Tensor):
        for e in cutlass.range_constexpr(cute.size(acc) // 2):
            r, c = cAcc[2 * e]
            pair = cute.make_rmem_tensor((1, 2), dtype)
            pair[0] = acc[2 * e].to(dtype)
            pair[1] = acc[2 * e + 1].to(dtype)
            cute.autovec_copy(pair, cute.local_tile(sX, (1, 2), (r, c // 2)))

    return pairs_to_tile


def make_scale_rows(dtype, cols: int, threads: int, l2norm: bool):
    """``scale_rows(sX, sY, sGc, sR, scale, tidx)``: ``sY[i, c] = sX[i, c] scale exp(gc_i) (r_i)`` over a
    ``[CHUNK, cols]`` smem tile, rounded once to the input dtype, by ``threads`` threads (an element
    each a step); ``r`` (the l2norm row factors in ``sR``) only with ``l2norm``. The reverse sweeps'
    ``do_s = diag(scale e^gc rq) do``."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32

    @cute.jit
    def scale_rows(sX: cute.Tensor, sY: cute.Tensor, sGc: cute.Tensor, sR: cute.Tensor, scale: Float32,
                   tidx: Int32):
        for e in cutlass.range_constexpr(CHUNK * cols // threads):
            idx = e * threads + tidx
            si = idx // cols
            sc = idx % cols
            coef = scale * cute.math.exp2(sGc[si] * LOG2E, fastmath=True)
            if cutlass.const_expr(l2norm):
                coef = coef * sR[si]
            sY[si, sc] = (sX[si, sc].to(Float32) * coef).to(dtype)

    return scale_rows


def make_p_value(l2norm: bool):
    """``(p_value, p_kept)``, trace-time helpers for an element of ``P = scale tril(q k^T exp(gc_i - gc_j))
    rq_i rk_j`` (diagonal kept) from the ``q k^T`` accumulator element ``acc[e]`` at ``(pi, pj)``:
    ``p_value`` its value whatever the position (call it where ``pj <= pi``); ``p_kept`` the value read
    unconditionally and kept by a select, 0 above the diagonal (the same bits as a branch around
    ``p_value``; ``exp2`` there may be inf, never kept; no branch per element, so a thread's elements share
    the loads of their rows' and columns' factors)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32

    @cute.jit
    def p_value(acc: cute.Tensor, e: cutlass.Constexpr, pi, pj, sGc: cute.Tensor, sRq: cute.Tensor,
                sRk: cute.Tensor, scale: Float32):
        pcoef = scale * cute.math.exp2((sGc[pi] - sGc[pj]) * LOG2E, fastmath=True)
        if cutlass.const_expr(l2norm):
            pcoef = pcoef * sRq[pi] * sRk[pj]
        return acc[e] * pcoef

    @cute.jit
    def p_kept(acc: cute.Tensor, e: cutlass.Constexpr, pi, pj, sGc: cute.Tensor, sRq: cute.Tensor,
               sRk: cute.Tensor, scale: Float32):
        pv = p_value(acc, e, pi, pj, sGc, sRq, sRk, scale)
        pval = Float32(0.0)
        if pj <= pi:
            pval = pv
        return pval

    return p_value, p_kept


def make_p_frag_and_o_scale(dtype, l2norm: bool):
    """``(p_to_frag, scale_o_rows)``, for kernels whose P is the register A operand of ``P vn``:
    ``p_to_frag(accP, rP, cP, map_p, sGc, sRq, sRk, scale, select)``: P (:func:`make_p_value`) from the ``q k^T``
    accumulator into ``rP`` (element ``f`` from accumulator element ``map_p[f]``, coordinates ``cP``), a branch
    around each value or, with ``select``, the factors read unconditionally and the triangle kept by a select (the
    same bits); ``scale_o_rows(accO, cO, sGc, sRq, scale, tmode=0)``: o's first term ``q S`` scaled in place by
    ``scale exp(gc_i) (rq_i)``, the token i being mode ``tmode`` of the coordinates ``cO`` (0: ``o [i, v]``, 1: the
    transposed ``o^T [v, i]``)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32

    p_value, p_kept = make_p_value(l2norm)

    @cute.jit
    def p_to_frag(accP: cute.Tensor, rP: cute.Tensor, cP: cute.Tensor, map_p: cutlass.Constexpr, sGc: cute.Tensor,
                  sRq: cute.Tensor, sRk: cute.Tensor, scale: Float32, select: cutlass.Constexpr):
        for f in cutlass.range_constexpr(cute.size(rP)):
            pi, pj = cP[map_p[f]]
            pval = Float32(0.0)
            if cutlass.const_expr(select):
                pval = p_kept(accP, map_p[f], pi, pj, sGc, sRq, sRk, scale)
            elif pj <= pi:
                pval = p_value(accP, map_p[f], pi, pj, sGc, sRq, sRk, scale)
            rP[f] = pval.to(dtype)

    @cute.jit
    def scale_o_rows(accO: cute.Tensor, cO: cute.Tensor, sGc: cute.Tensor, sRq: cute.Tensor, scale: Float32,
                     tmode: cutlass.Constexpr = 0):
        for e in cutlass.range_constexpr(cute.size(accO)):
            oi = cO[e][tmode]
            ocoef = scale * cute.math.exp2(sGc[oi] * LOG2E, fastmath=True)
            if cutlass.const_expr(l2norm):
                ocoef = ocoef * sRq[oi]
            accO[e] = accO[e] * ocoef

    return p_to_frag, scale_o_rows


def make_store_p(dtype, l2norm: bool, two_pass: bool = False, select: bool = False):
    """``store_p(accP, cP, sP, sGc, sRq, sRk, scale)``: ``P`` (:func:`make_p_value`) from the ``q k^T``
    accumulator into the smem tile ``sP [i, j]``, an element at a time with a branch around each value.
    ``two_pass``: every element's value first, into ``accP`` (``p_kept``: no store to shared memory
    between the loads to force a reload, no branch around them), then the stores. ``select``: one pass
    with ``p_kept`` (no register kept across the stores: for kernels at the register limit). The same
    operations on the same values either way: the same bits."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32

    p_value, p_kept = make_p_value(l2norm)

    @cute.jit
    def store_p(accP: cute.Tensor, cP: cute.Tensor, sP: cute.Tensor, sGc: cute.Tensor, sRq: cute.Tensor,
                sRk: cute.Tensor, scale: Float32):
        if cutlass.const_expr(two_pass):
            for e in cutlass.range_constexpr(cute.size(accP)):
                pi, pj = cP[e]
                accP[e] = p_kept(accP, e, pi, pj, sGc, sRq, sRk, scale)
            for e in cutlass.range_constexpr(cute.size(accP)):
                pi, pj = cP[e]
                sP[pi, pj] = accP[e].to(dtype)
        elif cutlass.const_expr(select):
            for e in cutlass.range_constexpr(cute.size(accP)):
                pi, pj = cP[e]
                sP[pi, pj] = p_kept(accP, e, pi, pj, sGc, sRq, sRk, scale).to(dtype)
        else:
            for e in cutlass.range_constexpr(cute.size(accP)):
                pi, pj = cP[e]
                pval = Float32(0.0)
                if pj <= pi:
                    pval = p_value(accP, e, pi, pj, sGc, sRq, sRk, scale)
                sP[pi, pj] = pval.to(dtype)

    return store_p


A_STRIDE = CHUNK + 4  # float32 row stride of C x C tiles: 16-byte rows, broadcast reads


def make_solve(threads: int = THREADS):
    """``solve(sA, sT, sM, tidx)``: ``T = (I + A)^-1`` of a strictly lower 64 x 64 float32 smem
    tile (row stride ``A_STRIDE``) into the lower blocks of ``sT`` (``sM``: scratch), on CUDA cores,
    by the CTA's ``threads`` threads (128 or 256; it synchronizes the whole CTA)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32

    C = CHUNK

    @cute.jit
    def diag_inverse(sA: cute.Tensor, sT: cute.Tensor, tidx: Int32):
        # the four 16x16 diagonal blocks of T: thread (blk, c) solves column c of block blk
        # by forward substitution, x_i = [i == c] - sum_{m < i} A_im x_m (all in registers)
        if tidx < C:
            blk = tidx // 16
            c = tidx % 16
            o = blk * 16
            x = []
            for i in cutlass.range_constexpr(16):
                s = Float32(0.0)
                if c == i:
                    s = Float32(1.0)
                for m4 in cutlass.range_constexpr((i + 3) // 4):
                    arow = cute.make_rmem_tensor((1, 4), Float32)
                    cute.autovec_copy(cute.local_tile(cute.domain_offset((o, o), sA), (1, 4), (i, m4)), arow)
                    for q in cutlass.range_constexpr(4):
                        if cutlass.const_expr(4 * m4 + q < i):
                            s = s - arow[0, q] * x[4 * m4 + q]
                x.append(s)
            for i in cutlass.range_constexpr(16):
                sT[o + i, o + c] = x[i]
        elif tidx < 2 * C:
            # the zero blocks above the diagonal inside each 32-block, read by the 32 -> 64 merge
            t = tidx - C
            c = t % 16
            for q in cutlass.range_constexpr(8):
                r = t // 16 + 4 * q  # 0..31: rows 0..15 of block (0, 1), then of block (2, 3)
                o = (r // 16) * 32
                sT[o + r % 16, o + 16 + c] = Float32(0.0)

    @cute.jit
    def block_mm(sD: cute.Tensor, sL: cute.Tensor, sR: cute.Tensor, tidx: Int32, S: cutlass.Constexpr,
                 blocks: cutlass.Constexpr, negate: cutlass.Constexpr):
        # for each (dr, dc, lr, lc, rr, rc) in blocks: D[dr:+S, dc:+S] = (-1 if negate) L[lr:+S, lc:+S] @ R[rr:+S, rc:+S]
        # threads split evenly over the blocks; a thread owns one column and S / row_groups rows
        NB = len(blocks)
        TPB = threads // NB
        RG = TPB // S
        RPT = S // RG
        for bi in cutlass.range_constexpr(NB):
            dr, dc, lr, lc, rr, rc = blocks[bi]
            if tidx // TPB == bi:
                t = tidx % TPB
                c = t % S
                rg = t // S
                acc = cute.make_rmem_tensor((RPT,), Float32)
                acc.fill(0.0)
                gL = cute.domain_offset((lr, lc), sL)
                for m4 in cutlass.range_constexpr(S // 4):
                    # four terms at a time: one 16-byte (warp-broadcast) read of each L row
                    rv = cute.make_rmem_tensor((4,), Float32)
                    for j in cutlass.range_constexpr(4):
                        rv[j] = sR[rr + 4 * m4 + j, rc + c]
                    for k in cutlass.range_constexpr(RPT):
                        lv = cute.make_rmem_tensor((1, 4), Float32)
                        cute.autovec_copy(cute.local_tile(gL, (1, 4), (rg + RG * k, m4)), lv)
                        for j in cutlass.range_constexpr(4):
                            acc[k] = acc[k] + lv[j] * rv[j]
                for k in cutlass.range_constexpr(RPT):
                    val = acc[k]
                    if cutlass.const_expr(negate):
                        val = -val
                    sD[dr + rg + RG * k, dc + c] = val

    @cute.jit
    def solve(sA: cute.Tensor, sT: cute.Tensor, sM: cute.Tensor, tidx: Int32):
        """T = (I + A)^-1 for strictly lower A (64 x 64, float32, smem), lower blocks of sT.

        [[T1, 0], [X, T2]] with X = -T2 A21 T1 inverts [[I + A11, 0], [A21, I + A22]]:
        16x16 diagonal blocks by substitution, then merged to 32x32, then to 64x64."""
        diag_inverse(sA, sT, tidx)
        cute.arch.sync_threads()
        # 16 -> 32, both 32-blocks at once: M = A21 T1, then X = -T2 M
        block_mm(sM, sA, sT, tidx, 16, ((16, 0, 16, 0, 0, 0), (48, 32, 48, 32, 32, 32)), False)
        cute.arch.sync_threads()
        block_mm(sT, sT, sM, tidx, 16, ((16, 0, 16, 16, 16, 0), (48, 32, 48, 48, 48, 32)), True)
        cute.arch.sync_threads()
        # 32 -> 64
        block_mm(sM, sA, sT, tidx, 32, ((32, 0, 32, 0, 0, 0),), False)
        cute.arch.sync_threads()
        block_mm(sT, sT, sM, tidx, 32, ((32, 0, 32, 32, 32, 0),), True)
        cute.arch.sync_threads()

    return solve


def make_chunk_locator(varlen: bool):
    """``locate(cid, mCu, mCuC, T, NT, nseq) -> (b, t0, tend, valid)``: the batch row, first token
    and sequence end of chunk ``cid`` (dense: ``b * NT + c``; varlen: ``cu_chunks[n] + c``, found by
    bisection in the device-side cumulative chunk count; ``valid`` is False past the last chunk)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    C = CHUNK

    @cute.jit
    def locate(cid: Int32, mCu: cute.Tensor, mCuC: cute.Tensor, T: Int32, NT: Int32, nseq: Int32):
        b = Int32(0)
        t0 = Int32(0)
        tend = Int32(0)
        valid = False
        if cutlass.const_expr(varlen):
            total = mCuC[nseq]
            lo = Int32(0)
            hi = nseq
            for _ in cutlass.range_constexpr(32):
                if lo < hi:
                    mid = (lo + hi) // 2
                    if mCuC[mid + 1] <= cid:
                        lo = mid + 1
                    else:
                        hi = mid
            valid = cid < total
            if valid:
                t0 = mCu[lo] + (cid - mCuC[lo]) * C
                tend = mCu[lo + 1]
        else:
            b = cid // NT
            t0 = (cid % NT) * C
            tend = T
            valid = b < nseq
        return b, t0, tend, valid

    return locate


# ---- sequences cut into segments after a decay-truncated warm-up (the forward chain, the reverse sweep)
SEGMENTS = (1, 2, 4, 8, 16)
SEG_LOG_DECAY = -20.0  # a warm-up reaches over chunks until their log decays sum below this (e^-20 = 2.1e-9)
SEG_MIN_CHUNKS = 16  # auto: segments of at least this many chunks of a sequence's average length


def segments(env_name: str, nseq: int, ctas_a_seq: int, T: int, l2norm: bool, device, fill: float = 1.0,
             default: str = "1") -> int:
    """Segments a sequence for a recurrence kernel of ``ctas_a_seq`` CTAs a sequence (value heads x V blocks).
    ``env_name`` 1: one, every sequence whole; unset: ``default`` (1, except for the carried inference forward,
    whose time does not hang on the gates); ``auto``: the fewest of :data:`SEGMENTS`
    whose grid reaches ``fill`` of the SMs, keeping segments of at least :data:`SEG_MIN_CHUNKS` chunks of a
    sequence's average length ``T / nseq``; 2 to 16 force that many. Without l2norm always one: the warm-up's
    truncation bound needs unit-norm keys. The bound also needs beta in [0, 2] (each ``I - beta k k^T`` of norm at
    most 1), which holds for GDN's beta (a sigmoid, twice one with ``allow_neg_eigval``) but is not checked on a
    caller's beta tensor (that would read the device): outside it the recurrence itself grows without bound.

    Not the default, though the split kernels are correct (GPU cases, twenty-sixth session) and much faster where
    every head decays fast: a head whose decay never reaches e^-20 before a boundary warms up from the sequence's
    start, so its last segment's CTA walks the whole sequence, at the per-chunk cost of the split configuration
    (wider V blocks, or the fused sweep and the specialized warpgroups in place of the split passes the unsplit
    default runs at few sequences), and the kernel takes as long as that CTA: up to about twice the unsplit
    default's time. At FLA's layer initialization 5% of the boundaries of B1 T16384 HV32 in 4 segments are such
    heads (``tools/diag_gdn_decay_split.py``); the benchmark's gates have none. Which gates the calls bring is
    not known on the host without a device read."""
    env = os.environ.get(env_name, "").strip() or default
    if env != "auto" and env not in tuple(str(c) for c in SEGMENTS):
        raise ValueError(f"{env_name}={env!r}: expected auto or one of {SEGMENTS}")
    if not l2norm or env == "1":
        return 1
    if env != "auto":
        return int(env)
    chunks = max(T // max(nseq, 1), 1) // CHUNK
    for nseg in SEGMENTS:
        if nseq * ctas_a_seq * nseg >= fill * kc.num_sms(device) or chunks // (2 * nseg) < SEG_MIN_CHUNKS:
            return nseg
    return SEGMENTS[-1]


def make_decay_reach():
    """``reach(mGc, sBuf, b, hv, ts, te, c0, count, step, tidx) -> m`` (every thread of the CTA; ``step`` +1 or
    -1, a constant): how many of the chunks ``c0, c0 + step, ...`` (``count`` at most) of the sequence at rows
    ``ts .. te`` it takes for their log decays to sum below :data:`SEG_LOG_DECAY`, or 0 if all ``count`` do not.
    A chunk's log decay is gc (the in-chunk cumulative log decay, ``[B, T, HV]``) at its last row, the
    sequence's last row for its partial last chunk. ``CHUNK`` chunks a round: threads below CHUNK bring one each
    into ``sBuf`` (CHUNK float32), then every thread sums them in the same order (the same result everywhere,
    no broadcast); two CTA barriers a round, no round once the sum is reached."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32

    C = CHUNK

    @cute.jit
    def reach(mGc: cute.Tensor, sBuf: cute.Tensor, b: Int32, hv: Int32, ts: Int32, te: Int32, c0: Int32,
              count: Int32, step: cutlass.Constexpr, tidx: Int32):
        m = Int32(0)
        run = Float32(0.0)
        for blk in cutlass.range((count + C - 1) // C, unroll=1):
            if m == 0:  # the same m in every thread: a uniform branch around the barriers
                cute.arch.sync_threads()  # the previous round's reads are done
                if tidx < C:
                    tot = Float32(0.0)
                    j = blk * C + tidx
                    if j < count:
                        c = c0 + step * j
                        tot = mGc[b, cutlass.min(ts + c * C + C - 1, te - 1), hv]
                    sBuf[tidx] = tot
                cute.arch.sync_threads()
                for i in cutlass.range(C, unroll=1):
                    if m == 0:
                        if blk * C + i < count:
                            run = run + sBuf[i]
                            if run < SEG_LOG_DECAY:
                                m = blk * C + i + 1
        return m

    return reach


def make_segment_walk(forward: bool):
    """``walk(mGc, sBuf, b, hv, ts, te, nchunks, seg, nseg, tidx) -> (edge, c_lo, c_hi)`` (every thread of the
    CTA): segment ``seg`` of ``nseg`` of a sequence of ``nchunks`` chunks owns ``[c_lo, c_hi)``. A forward walk
    starts at chunk ``edge`` <= c_lo: the first of the chunks before c_lo whose log decays sum below
    :data:`SEG_LOG_DECAY` (:func:`make_decay_reach`), else 0 (the sequence's start, where the initial state
    enters). A reverse walk starts at the end of chunk ``edge - 1`` >= c_hi - 1, likewise after c_hi, else at the
    sequence's end. An empty segment walks nothing (``edge`` its c_hi, or its c_lo in reverse)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    reach = make_decay_reach()

    @cute.jit
    def walk(mGc: cute.Tensor, sBuf: cute.Tensor, b: Int32, hv: Int32, ts: Int32, te: Int32, nchunks: Int32,
             seg: Int32, nseg: cutlass.Constexpr, tidx: Int32):
        c_lo = nchunks * seg // nseg
        c_hi = nchunks * (seg + 1) // nseg
        if cutlass.const_expr(forward):
            m = reach(mGc, sBuf, b, hv, ts, te, c_lo - 1, c_lo, -1, tidx)
            edge = cutlass.select_(m > 0, c_lo - m, Int32(0))
            edge = cutlass.select_(c_hi > c_lo, edge, c_hi)
        else:
            m = reach(mGc, sBuf, b, hv, ts, te, c_hi, nchunks - c_hi, 1, tidx)
            edge = cutlass.select_(m > 0, c_hi + m, nchunks)
            edge = cutlass.select_(c_hi > c_lo, edge, c_lo)
        return edge, c_lo, c_hi

    return walk


def carry_segments(env_name: str, nseq: int, ctas_a_seq: int, T: int, l2norm: bool, device, HV: int, K: int,
                   V: int, default: str = "1") -> int:
    """The carried split's segment count (``CUDNN_TRAIN_GDN_FWD_CARRY`` / ``_SWEEP_CARRY``): :func:`segments` at 90%
    of the SMs (``default`` where the switch is unset), or one where its carries ``[nseq (nseg - 1), HV, K, V + K]``
    or its start / end states ``[nseq nseg, HV, K, V]`` would not be int32-addressable."""
    nseg = segments(env_name, nseq, ctas_a_seq, T, l2norm, device, fill=0.9, default=default)
    if max(nseq * (nseg - 1) * HV * K * (V + K), nseq * nseg * HV * K * V) >= 2**31:
        return 1
    return nseg


def combine_carries(LM, edge, nseq: int, nseg: int, V: int, reverse: bool = False):
    """The carried split's combine step, in float64 (the products are small; float32 matmuls could run in TF32
    where a caller allows it): from the prepare step's float32 ``LM [nseq (nseg - 1), HV, K, V + K]`` (row ``n
    (nseg - 1) + s``: L in the columns below V, the K x K transition M from V on), float32 ``[nseq nseg, HV, K,
    V]`` (row ``n nseg + s``). Forward: each segment's start state, ``S_0 = edge`` (the initial state, or zero),
    ``S_(s+1) = M_s S_s + L_s``; ``reverse`` (the sweep): dH at each segment's end, the last ``edge`` (the final
    state's gradient, or zero), ``E_s = M_s E_(s+1) + L_s`` before it."""
    import torch

    _, HV, K, _ = LM.shape
    L = LM[..., :V].double().view(nseq, nseg - 1, HV, K, V)
    M = LM[..., V:].double().view(nseq, nseg - 1, HV, K, K)
    X = LM.new_zeros(nseq, HV, K, V, dtype=torch.float64) if edge is None else edge.double()
    out = [X]
    for s in (range(nseg - 2, -1, -1) if reverse else range(nseg - 1)):
        X = torch.matmul(M[:, s], X) + L[:, s]
        out.append(X)
    return torch.stack(out[::-1] if reverse else out, 1).float().view(nseq * nseg, HV, K, V)


def make_carry_walk(forward: bool = True):
    """``carry_walk(mGc, sBuf, b, hv, ts, te, nchunks, s, nseg, cap, tidx) -> (c_a, c_b, carry)`` (every thread of
    the CTA): the walk of the carried split's *prepare* step into the boundary between segments s and s + 1 (of
    ``nseg`` of a sequence of ``nchunks`` chunks). Forward, over the end of segment s, ``[c_lo, c_hi)``: where its
    last chunks reach a summed log decay below :data:`SEG_LOG_DECAY` within ``min(cap, c_hi - c_lo)`` of them, a
    warm-up from zero over those (``carry`` false: the boundary's state is that walk's end), else the whole segment
    (``carry`` true: the boundary's state is that walk's end plus its transition times the state entering s);
    ``(c_a, c_b)`` the chunks walked. Reverse (the sweep), over the start of segment s + 1 the same way, walked
    from its end: ``(c_a, c_b)`` the chunks walked, ``c_b - 1`` down to ``c_a``. An empty segment carries (its
    transition is the identity). ``tests/fused/test_gdn_segments_carry.py`` checks the plan on the CPU."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    reach = make_decay_reach()

    @cute.jit
    def carry_walk(mGc: cute.Tensor, sBuf: cute.Tensor, b: Int32, hv: Int32, ts: Int32, te: Int32, nchunks: Int32,
                   s: Int32, nseg: cutlass.Constexpr, cap: cutlass.Constexpr, tidx: Int32):
        if cutlass.const_expr(forward):
            c_lo = nchunks * s // nseg
            c_hi = nchunks * (s + 1) // nseg
            m = reach(mGc, sBuf, b, hv, ts, te, c_hi - 1, cutlass.min(Int32(cap), c_hi - c_lo), -1, tidx)
            return cutlass.select_(m > 0, c_hi - m, c_lo), c_hi, m == 0
        c_lo = nchunks * (s + 1) // nseg
        c_hi = nchunks * (s + 2) // nseg
        m = reach(mGc, sBuf, b, hv, ts, te, c_lo, cutlass.min(Int32(cap), c_hi - c_lo), 1, tidx)
        return c_lo, cutlass.select_(m > 0, c_lo + m, c_hi), m == 0

    return carry_walk


def make_identity_block():
    """``identity_block(acc, cS, row0, col0, on, vd)``: the float32 accumulator ``acc`` of a state block set to the
    identity's entries at its coordinates ``cS`` (``(row, col)``, or ``(col, row)`` with the constant ``vd``), rows
    offset by ``row0`` and columns by ``col0``, where ``on`` (an Int32, 1 or 0) is 1, else zero: the carried split's
    transition columns (:func:`make_carry_walk`). A function of its own, so that its names do not join a kernel's
    (the DSL carries a kernel's names through its dynamic loops)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32

    @cute.jit
    def identity_block(acc: cute.Tensor, cS: cute.Tensor, row0: Int32, col0: Int32, on: Int32,
                       vd: cutlass.Constexpr):
        for e in cutlass.range_constexpr(cute.size(acc)):
            r, c = cS[e]
            if cutlass.const_expr(vd):
                c, r = cS[e]
            hit = cutlass.select_(row0 + r == col0 + c, Int32(1), Int32(0))
            acc[e] = Float32(cutlass.select_(on * hit > 0, Float32(1.0), Float32(0.0)))

    return identity_block


def make_zero_unless():
    """``zero_unless(acc, keep)``: every element of the float32 register tensor ``acc`` zeroed unless ``keep``, by
    selects (no branch around accumulator registers: ptxas would serialize the products that write them)."""
    cutlass, cute = kc.import_cute()
    from cutlass import Float32

    @cute.jit
    def zero_unless(acc: cute.Tensor, keep):
        for e in cutlass.range_constexpr(cute.size(acc)):
            acc[e] = Float32(cutlass.select_(keep, acc[e], Float32(0.0)))

    return zero_unless


def make_seq_locator(varlen: bool):
    """``locate_seq(n, mCu, mCuC, T, NT) -> (b, ts, te, cbase, nchunks)``: for sequence ``n`` of a
    sweep kernel, its batch row, first and end token, the chunk row of its first chunk
    (``n * NT``, or ``cu_chunks[n]`` with varlen) and its chunk count."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    C = CHUNK

    @cute.jit
    def locate_seq(n: Int32, mCu: cute.Tensor, mCuC: cute.Tensor, T: Int32, NT: Int32):
        b = n
        ts = Int32(0)
        te = T
        cbase = n * NT
        if cutlass.const_expr(varlen):
            b = Int32(0)
            ts = mCu[n]
            te = mCu[n + 1]
            cbase = mCuC[n]
        return b, ts, te, cbase, (te - ts + C - 1) // C

    return locate_seq


def quad_row_groups(mma, shape_mn, threads=SAMPLE_THREADS, wgs: int = 1):
    """The accumulator elements of one thread grouped by row: ``((e, ...), ...)``, the same for
    every thread. Asserts that the four lanes ``t ^ 0..3`` of a quad hold the same rows with
    disjoint columns covering the row (its warpgroup's ``1 / wgs`` of the row when ``wgs``
    warpgroups split N), so a row sum is the group's sum plus two butterfly shuffles (offsets 1
    and 2), after which every lane of the quad holds it."""
    _, cute = kc.import_cute()
    ref = None
    for t in threads:
        rows_of = {}
        c = mma.get_slice(t).partition_C(cute.make_identity_tensor(shape_mn))
        for e in range(cute.size(c)):
            rows_of.setdefault(tuple(c[e])[0], []).append(e)
        groups = tuple(tuple(v) for _, v in sorted(rows_of.items()))
        if ref is None:
            ref = groups
        elif groups != ref:
            raise AssertionError(f"thread {t}: row grouping differs")
        cols = {r: set() for r in rows_of}
        for lane in range(4):
            cl = mma.get_slice((t & ~3) | lane).partition_C(cute.make_identity_tensor(shape_mn))
            for e in range(cute.size(cl)):
                r, n = tuple(cl[e])
                if r not in cols:
                    raise AssertionError(f"thread {(t & ~3) | lane} holds row {r}, not held by thread {t}")
                if n in cols[r]:
                    raise AssertionError(f"row {r} column {n} held twice in the quad of thread {t}")
                cols[r].add(n)
        for r, cs in cols.items():
            if len(cs) != shape_mn[1] // wgs:
                raise AssertionError(f"the quad of thread {t} holds {len(cs)} of {shape_mn[1]} columns of row {r}")
    return ref


# ------------------------------------------------------------------ TMA loads of chunk tiles
# The kernels' TMA variants share one pattern: one warp (its elected thread) arms an mbarrier with a group's
# bytes and issues the group's bulk copies (CuTe splits a tile wider than its swizzle into boxes), every thread
# waits on the mbarrier's phase, and rows past a varlen sequence's end, which TMA brings as they are (the next
# sequence's, or whatever a tensor holds past its last sequence), are zeroed after landing, as cp.async
# zero-fills them.


TOKEN_ROWS = (1, 3, 0, 2)  # [B, T, heads, D] seen as (T, D, B, heads)
STATE_ROWS = (2, 3, 0, 1)  # [chunks, HV, K, V] seen as (K, V, chunks, HV)


def rows_first(m):
    """``[B, T, heads, D]`` -> its ``(T, D, B, heads)`` view (same memory): the TMA box is (rows, columns)."""
    _, cute = kc.import_cute()
    return cute.make_tensor(m.iterator, cute.select(m.layout, mode=list(TOKEN_ROWS)))


def make_tma_rows_atom(dtype, m, rows: int, cols: int, max_swizzle: int = 128):
    """(While tracing a host function) ``(atom, TMA tensor)`` loading ``rows x cols`` boxes of the ``[B, T, heads,
    D]`` tensor ``m`` into a :func:`smem_tile_layout` tile of the same shape and swizzle."""
    from cutlass.cute.nvgpu import cpasync

    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), rows_first(m),
                                       smem_tile_layout(dtype, rows, cols, max_swizzle), (rows, cols))


def tma_placeholder(dtype, m):
    """A TMA ``(atom, tensor)`` kernel parameter pair's placeholder where the variant is off: a cp.async atom and
    the tensor ``m`` itself, never used."""
    _, cute = kc.import_cute()
    from cutlass.cute.nvgpu import cpasync

    return cute.make_copy_atom(cpasync.CopyG2SOp(), dtype, num_bits_per_copy=128), m


def make_tma_rows_atoms(on: bool, dtype, specs):
    """(While tracing a host function) ``(atoms, TMA tensors)`` of :func:`make_tma_rows_atom` for each ``(m, rows,
    cols)`` of ``specs``; with ``on`` False placeholders of the kernel's parameters (a cp.async atom and the tensors
    themselves), never used."""
    if not on:
        return [tma_placeholder(dtype, specs[0][0])[0]] * len(specs), [m for m, _, _ in specs]
    pairs = [make_tma_rows_atom(dtype, m, rows, cols) for m, rows, cols in specs]
    return [a for a, _ in pairs], [t for _, t in pairs]


def make_tma_store(on: bool, dtype, m, rows_modes, rows: int, cols: int):
    """(While tracing a host function) ``(atom, TMA tensor)`` storing a ``rows x cols`` :func:`smem_tile_layout` tile
    into boxes of the 4-D tensor ``m`` seen with its modes in the order ``rows_modes`` (rows, columns, then the two
    that pick a box's place): :data:`TOKEN_ROWS` for ``[B, T, heads, D]`` (:func:`token_box` picks one),
    :data:`STATE_ROWS` for ``[chunks, HV, K, V]`` (a chunk's and value head's K rows). With ``on`` False
    :func:`tma_placeholder`."""
    _, cute = kc.import_cute()
    from cutlass.cute.nvgpu import cpasync

    if not on:
        return tma_placeholder(dtype, m)
    view = cute.make_tensor(m.iterator, cute.select(m.layout, mode=list(rows_modes)))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), view, smem_tile_layout(dtype, rows, cols),
                                       (rows, cols))


def tma_store(atom, gT, sX):
    """(One warp, while tracing) the smem tile ``sX`` into the global box ``gT`` by a bulk tensor store of ``atom``,
    committed as one bulk group; the caller fenced the tile's writes to the async proxy and synced before, and waits
    for the group (``cp_async_bulk_wait_group``) before the tile is written again and before the CTA exits."""
    _, cute = kc.import_cute()
    from cutlass.cute.nvgpu import cpasync

    tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gT, 0, 2))
    cute.copy(atom, tS, tG)
    cute.arch.cp_async_bulk_commit_group()


def token_box(tT, b, head, t0, c0, rows: int, cols: int):
    """(While tracing) the ``rows x cols`` box of a :func:`make_tma_rows_atom` tensor at row ``t0`` and column
    ``c0`` of sequence (batch) ``b`` and head ``head``; of a :data:`STATE_ROWS` view (:func:`make_tma_store`), ``b``
    is the chunk row and ``head`` the value head."""
    _, cute = kc.import_cute()
    return cute.local_tile(cute.domain_offset((t0, c0), tT[None, None, b, head]), (rows, cols), (0, 0))


def tma_load(jobs, bar, nbytes: int):
    """(One warp, while tracing) ``jobs`` = ((atom, global box, smem tile), ...) on the mbarrier ``bar``: one
    elected arrive expecting ``nbytes`` (every box's full size: rows past a tensor's end arrive as zeros and
    count), then the bulk copies (the copy elects its own thread)."""
    _, cute = kc.import_cute()
    from cutlass.cute.nvgpu import cpasync

    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
    for atom, gT, sX in jobs:
        tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                       cute.group_modes(gT, 0, 2))
        cute.copy(atom, tG, tS, tma_bar_ptr=bar)


def make_tma_init():
    """``init_barriers(mbar, n, atoms, warp)``: (every thread) warp ``warp`` prefetches the atoms' descriptors and
    initializes the ``n`` mbarriers at ``mbar`` (one arrival each), then the init fence and a CTA barrier."""
    cutlass, cute = kc.import_cute()
    from cutlass.cute.nvgpu import cpasync

    @cute.jit
    def init_barriers(mbar, n: cutlass.Constexpr, atoms: cutlass.Constexpr, warp: cutlass.Constexpr):
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == warp:
            for a in atoms:
                cpasync.prefetch_descriptor(a)
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(n):
                    cute.arch.mbarrier_init(mbar + i, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

    return init_barriers


def make_zero_rows(dtype, threads: int, rows: int = CHUNK):
    """``zero_rows(sX, cols, length, tidx)``: (every thread) rows ``>= length`` of the ``rows x cols`` smem tile
    ``sX`` zeroed by 16-byte stores, as cp.async zero-fills them; the caller fences to the async proxy and syncs
    before the tile is read."""
    cutlass, cute = kc.import_cute()
    from cutlass import Int32

    @cute.jit
    def zero_rows(sX: cute.Tensor, cols: cutlass.Constexpr, length: Int32, tidx: Int32):
        zero = cute.make_rmem_tensor((1, 8), dtype)
        zero.fill(0.0)
        for p in cutlass.range_constexpr(rows * cols // 8 // threads):
            idx = p * threads + tidx
            r = idx // (cols // 8)
            if r >= length:
                cute.autovec_copy(zero, cute.local_tile(sX, (1, 8), (r, idx % (cols // 8))))

    return zero_rows

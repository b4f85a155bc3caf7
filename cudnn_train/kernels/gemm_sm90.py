"""Hopper (SM90) GEMM in CuTeDSL: TMA, WGMMA, warp specialization, persistent tiles, fused epilogues.

Public API (all functions take torch tensors on one SM90 GPU and launch on the
current stream; none of them syncs the host):

``gemm(a, b, *, out=None, bias=None, alpha=1.0, beta=0.0, row_scale=None, out_dtype=None, group_offsets=None, b_tail=None)``
    ``out = row_scale[:, None] * (alpha * (a @ b) + bias) + beta * out``, math in float32.
    ``b_tail`` (dense only): a second ``[K2, N]`` operand that continues ``b`` along K,
    ``a @ cat([b, b_tail])`` without the copy (``b``'s K1 must be a multiple of 64, both of
    one major order); the MLP's ``dx = [dgate | dup] @ [w_gate; w_up]`` is one GEMM with it.
    ``a`` is ``[M, K]``, ``b`` is ``[K, N]`` (dense) or ``[G, K, N]`` (grouped, see
    below). ``bias`` is ``[N]``, ``row_scale`` is ``[M]``. ``beta`` is 0 (``out`` is
    only written) or any other value (``out`` is read first: accumulate into an
    existing buffer, e.g. a float32 ``main_grad``; ``out`` must then be given).
    ``out_dtype`` is ``a.dtype`` (default) or ``torch.float32``; a given ``out``
    fixes it.

``gemm_swiglu(a, b_gate, b_up, *, bias_gate=None, bias_up=None, row_scale=None, store_preact=False, out=None, out_gate=None, out_up=None, group_offsets=None)``
    One GEMM over both weights: ``gate = a @ b_gate + bias_gate``,
    ``up = a @ b_up + bias_up``, ``h = silu(gate) * up * row_scale[:, None]``.
    Returns ``h`` (``[M, I]`` in ``a.dtype``), or ``(h, gate, up)`` with
    ``store_preact=True`` (``gate``/``up`` bias included, before row_scale); ``out*``
    are optional preallocated outputs. ``b_gate`` and ``b_up`` are ``[K, I]`` views (for a
    stacked ``[2I, K]`` weight ``w``: ``w[:I].t()`` and ``w[I:].t()``; no copy).
    Each CTA loads the matching gate and up tiles into one shared-memory stage,
    so ``silu(gate) * up`` is formed in registers.

``gemm_dswiglu(a, b, gate, up, *, row_scale=None, out_dgate=None, out_dup=None, group_offsets=None)``
    The backward of the above: ``dh = (a @ b) * row_scale[:, None]`` (for the MLP,
    ``a = dout`` and ``b = w_down``), then ``dgate = dh * up * silu'(gate)`` and
    ``dup = dh * silu(gate)`` with ``silu'(g) = s * (1 + g * (1 - s))``,
    ``s = sigmoid(g)``. Returns ``(dgate, dup)`` in ``a.dtype`` (outputs must not
    overlap ``gate``/``up``).

``grouped_gemm(a, b, group_offsets, **kw)``
    ``gemm(a, b, group_offsets=group_offsets, **kw)``. ``group_offsets`` is an
    int32 ``[G + 1]`` tensor on the device (``group_offsets[0]`` is normally 0):
    rows ``group_offsets[g] : group_offsets[g + 1]`` of ``a`` (and of every
    ``[M, ...]`` operand) multiply ``b[g]`` (``b`` is ``[G, K, N]``; for per-group
    weights ``w`` of shape ``[G, N, K]`` pass ``w.transpose(1, 2)``). Empty groups
    are allowed; the offsets never come to the host (CUDA-graph capturable).
    Offsets must be non-decreasing; rows outside ``[offsets[0], offsets[G])``
    are not written; rows past ``M`` are never touched whatever the offsets
    say. The SwiGLU and dSwiGLU epilogues take ``group_offsets`` too
    (``b_gate``/``b_up``/``b`` are then ``[G, K, N]``).

``can_implement(a, b, *, epilogue="none", b_up=None, out=None, out_dtype=None, bias=None, bias_up=None, row_scale=None, beta=0.0, gate=None, up=None, store_preact=False, group_offsets=None)``
(``b`` is ``b_gate`` for ``epilogue="swiglu"``) returns None for a call the
kernel serves and raises ``cudnn_train.backend.Unsupported(reason)`` for what
it does not serve, before any memory is touched: no SM90 GPU, tensors not on a
CUDA device,
dtypes other than bf16/fp16 operands (both the same), K or N not a multiple of
8, base pointers not 16-byte aligned, strides that are neither row- nor
column-major or not multiples of 16 bytes, K == 0, more than 2**31 - 1 elements
in a tensor. Malformed arguments (shapes that do not match, wrong ranks,
mismatched epilogue operands, tensors on different devices) raise
``ValueError`` naming the argument. Outputs must not overlap the inputs.

Layouts served without copies (the kernel reads either major order through TMA):
``a`` row-major (K-major) or column-major (M-major: ``a = dy.t()``), ``b``
column-major (K-major: ``b = w.t()``) or row-major (N-major: ``b = w``).
So forward ``x @ W^T = gemm(x, W.t())``, dgrad ``dy @ W = gemm(dy, W)`` and
wgrad ``dy^T @ x = gemm(dy.t(), x)``. Outputs and the ``[M, N]`` epilogue
operands (``gate``, ``up``, an accumulated ``out``) are row-major with a
16-byte-aligned row stride.

Kernel
------
CTA = 3 warp groups (384 threads). Warp group 0 is the producer: it gives its
registers back (``setmaxnreg`` 24) and one warp issues the TMA loads of the A
and B tiles into a ring of ``stages`` shared-memory buffers, each guarded by a
full and an empty mbarrier (``PipelineTmaAsync``: the full barrier counts the
TMA transaction bytes, the empty barrier one arrive per consumer warp and
multicast peer). Warp groups 1 and 2 are the consumers (``setmaxnreg`` 240):
each owns 64 rows of the 128-row tile and runs ``m64nNk16`` WGMMAs from
shared memory, keeping one WGMMA batch in flight and releasing a stage as
soon as the batch that read it has retired.

The first k-block's WGMMAs run with ACCUMULATE off instead of zero-filling
the accumulators, and epilogue values are converted into fresh register
fragments before the first store: register moves or stores that touch the
accumulators between WGMMAs make ptxas serialize every WGMMA of the kernel
(its warning C7514), which the SwiGLU kernel with stored pre-activations
used to suffer.

The grid is persistent: ``min(#SMs, #tiles)`` CTAs (for 2-CTA clusters at
most the number of clusters resident at once, from
``cuOccupancyMaxActiveClusters``) walk the tiles ``t = cluster_id,
cluster_id + #clusters, ...``. Tiles are visited in a grouped (swizzled) order: bands of ``GROUP_M`` M-tiles are
walked column by column, so the CTAs in flight share a few A row-blocks and B
column-blocks in L2. The producer runs up to ``stages`` k-blocks ahead, across
tile boundaries, so the next tile's loads overlap the current tile's epilogue.
Grouped GEMMs walk the concatenation of every group's tiles: each role keeps a
cursor over ``group_offsets`` (a few scalar loads per group, no host sync); the
A tile of group g starts at row ``start_g + mt * 128`` (TMA zero-fills rows past
M), and B is the g-th slice of a 3-D TMA descriptor. ``start_g`` is
``group_offsets[g]`` for a row-major A; for a column-major A it is rounded down
to a multiple of 8 rows, because M is then A's innermost dimension and a TMA
box must start on a 16-byte boundary there (an unaligned start faults with an
illegal instruction). The rows of the previous group that this puts in the
first tile are computed but never stored (the epilogue stores rows
``[group_offsets[g], group_offsets[g + 1])`` only).

With a 2-CTA cluster (``cluster_m = 2``) the two CTAs of a cluster take
vertically adjacent tiles that share their B tile: each loads half of it and
multicasts it to both (``CopyBulkTensorTileG2SMulticastOp``).

Epilogue. Dense GEMMs whose outputs are 16-bit and only written (``tma_store`` in the spec:
every GEMM of the SwiGLU MLP but the dSwiGLU one, which runs on the epilogue warps below) store
through shared memory: each output tile leaves in BM x 32 subtiles, written from the accumulator layout with ``stmatrix`` into a ring of four 8 KB buffers
and stored by one TMA store each (issued by the first consumer warp; ``wait_group.read`` keeps at
most three in flight, so a buffer is reused only once its store has read it). The stores drain
while the next tile's main loop runs, and TMA clips what lies past the tensor's edge, so edge
tiles need no predicates. (On the H200 this made the MLP's forward+backward 4-7% faster than the
register-to-global epilogue below, 2026-12-03.) dSwiGLU on this path takes 128 x 256 tiles and
forms dgate / dup subtile by subtile from the accumulators and gate / up, which come into the ring
itself by TMA loads (``epi_tma_load``; each slot of two buffers on an mbarrier, two subtiles in
flight, subtile e + 2 loaded once subtile e's stores have read its slot) after the producer warp
has prefetched the tile's gate / up into L2 a few k-blocks before its last load; dup / dgate are
written back in place (a warp reads and writes only its own rows). No thread loads from global
memory there, which matters because the async-proxy fence before each TMA store is
``MEMBAR.ALL.CTA`` in SASS and waits for a thread's outstanding loads (5% less time for that GEMM
than reading gate / up from global memory one subtile ahead, which BN 64 still does).

dSwiGLU on the epilogue warps (``epi_wg``, where the TMA-store epilogue would take 128 x 256 tiles; the
default, ``EPI_WG_DEFAULT``): the producer warp group's three idle warps do the epilogue while the consumers
run the next tile's main loop. The consumers scale each row of dh by DH_SCALE over its largest finite
magnitude in the tile (four lanes hold a row: two shuffles; infs and NaNs pass through), store it as float16
into a padded [BM, BN + 8] shared tile (conflict-free 4-byte stores) with the inverse factor per row, and
arrive on a "full" mbarrier; each
epilogue warp takes every third row of the tile, a lane 8 columns (16-byte loads of gate / up from global
memory, of dh from the tile, 16-byte stores of dgate / dup, clamped loads and stores stopped at M and N) and
arrives on an "empty" mbarrier that the consumers wait for before the next hand-over. dh is rounded once to
11 significant bits relative to its row's maximum (float16 with a per-row factor, exact to that rounding for
values down to 2^-28 of the maximum), where the ring epilogue keeps it in float32 and eager rounds it to
bfloat16 (8 bits). The dh tile (66.5 KB) leaves room for 3 stages, not 4; registers 104 for the producer
warp group and 200 for each consumer (``EPI_WG_REGS``).

Every other call (grouped GEMMs: a group boundary can fall inside a tile, and a TMA store cannot
stop at one; float32 or accumulated outputs) stores straight from the accumulator registers.
Every thread holds pairs of adjacent columns, so full tiles store with 4-byte (16-bit outputs) or
8-byte (fp32) vector stores and no predicates; edge tiles (M, N, group tails, aligned group heads)
store element by element under ``row_first <= row < row_limit and col < N`` and read their
epilogue operands at clamped coordinates, so nothing outside the output (or outside the group) is
read or written. No atomics and no split-K on either path: every output element is reduced by one
thread in a fixed order, so results are bitwise reproducible run to run in every mode.

Tile heuristic (``choose_config``), BM = 128 and BK = 64 always:
  * BN (per B operand) = 256 for the plain epilogue (and dSwiGLU with the TMA-store
    epilogue) when the 128x256 grid still has at least one tile per SM; else 128, or 64 when
    N <= 256 and even 128-wide tiles would leave more than half of the SMs idle; always 128 for
    SwiGLU (two B operands: 256 MMA columns a tile), float32 outputs, beta != 0 and the
    register-to-global dSwiGLU (their epilogues hold more registers). Grouped GEMMs count
    ``ceil(M / 128) + G`` M-tiles (each group may end in a partial tile).
  * cluster_m = 2 (B multicast) for dense GEMMs with at least 2 M-tiles and
    at least 2 tiles per SM; 1 otherwise (grouped GEMMs: the two tiles of a
    cluster could belong to different groups).
  * stages = as many as fit in 227 KB of shared memory beside the TMA-store epilogue's
    32 KB ring (when it has one), at most 8 (4 for 128x256 and SwiGLU, 6 for 128x128; 7 for
    128x128 without the ring).
"""

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from ..backend import Unsupported
from . import compile as kc

__all__ = [
    "gemm",
    "gemm_swiglu",
    "gemm_dswiglu",
    "grouped_gemm",
    "can_implement",
    "choose_config",
    "KernelSpec",
    "EPILOGUES",
    "get_compiled",
]

EPILOGUES = ("none", "swiglu", "dswiglu")
BM = 128
BK = 64
GROUP_M = 16  # swizzle band height in M-tiles (16 vs 8: 1.6% less time over the MLP GEMMs, 2026-12-03)
THREADS = 384  # 1 producer + 2 consumer warp groups
PRODUCER_REGS = 24  # FA3's split: 24 * 128 + 240 * 256 = 168 * 384, the whole register file
CONSUMER_REGS = 240
SMEM_BYTES = 232448  # sm_90 opt-in shared memory per block (227 KB)
SMEM_RESERVE = 1024  # mbarriers and alignment slack
MAX_STAGES = 8
EPI_N = 32  # TMA-store epilogue: the tile leaves through shared memory in BM x EPI_N subtiles ...
EPI_STAGES = 4  # ... in a ring of this many buffers (32 KB for 16-bit outputs)
# dSwiGLU's epilogue on the producer warp group's three idle warps (KernelSpec.epi_wg): they form dgate / dup
# from dh handed over in shared memory (float16, a float32 scale per row) while the consumers run the next tile
EPI_WG_REGS = (104, 200)  # producer warp group, each consumer: 104 + 2 * 200 = 504 = 3 * 168, the register file
EPI_WARPS = 3  # warps 1-3 (warp 0 issues the TMA loads)
DH_PAD = 8  # the dh tile's rows are BN + 8 halves apart: the consumers' 4-byte stores hit 32 distinct banks
_SOURCES = (__file__,)
_AB_DTYPES = (torch.bfloat16, torch.float16)
_INT32_MAX = 2**31 - 1
_EXTRA_COMPILE_OPTIONS = ""  # tests set " --keep-cubin --dump-dir DIR" to inspect the cubin
# tools/sweep_gemm.py only: a dict of KernelSpec fields (bn, cluster_m, stages, group_m) that replaces
# what choose_config picked; never set in a served path.
_CONFIG_OVERRIDE: dict | None = None
# dSwiGLU's epilogue on the producer warp group's idle warps where it serves (_epi_wg_serves); False gives the
# store-ring epilogue back (thirty-seventh session: the GEMM ~0.5 ms faster, the MLP 0-1% at the 700 W cap)
EPI_WG_DEFAULT = True


@dataclass(frozen=True)
class KernelSpec:
    """Every static fact a compiled kernel depends on (the compile-cache key)."""

    ab_dtype: str  # "bfloat16" | "float16"
    out_dtype: str  # main output: ab dtype or "float32"
    a_major: str  # "k" | "m"
    b_major: str  # "k" | "n"
    epilogue: str  # "none" | "swiglu" | "dswiglu"
    grouped: bool
    bias_dtype: str  # "" when no bias
    rs_dtype: str  # "" when no row_scale
    has_beta: bool
    store_preact: bool
    bn: int
    cluster_m: int
    stages: int
    group_m: int = GROUP_M  # swizzle band height in M-tiles
    b_tail: bool = False  # B continues along K in a second tensor (gemm's b_tail)
    tma_store: bool = False  # outputs leave through shared memory and TMA stores (dense, 16-bit outputs)
    epi_tma_load: bool = False  # dSwiGLU with tma_store: gate / up come into the store ring by TMA loads
    epi_wg: bool = False  # dSwiGLU (dense, BN 256): the producer warp group's idle warps do the epilogue
    ewg_rows: int = 4  # epi_wg: rows of the tile a lane of an epilogue warp has in flight at once

    def key(self) -> tuple:
        return tuple(getattr(self, f) for f in self.__dataclass_fields__)


def _tname(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _stage_bytes(bn: int, nb: int, elem: int = 2) -> int:
    return (BM * BK + nb * bn * BK) * elem


def _epi_bytes(tma_store: bool) -> int:
    """Shared memory of the TMA-store epilogue's subtile ring (16-bit outputs), 0 without it."""
    return BM * EPI_N * 2 * EPI_STAGES if tma_store else 0


def _dh_bytes(bn: int) -> int:
    """Shared memory of the epilogue warps' hand-over: the float16 dh tile (padded rows) and a scale per row."""
    return BM * (bn + DH_PAD) * 2 + BM * 4


def _max_stages(bn: int, epilogue: str, tma_store: bool = False, epi_wg: bool = False) -> int:
    """As many ring stages of BN-wide tiles as fit the shared memory (beside the epilogue's ring or the
    epilogue warps' dh tile), at most MAX_STAGES."""
    nb = 2 if epilogue == "swiglu" else 1  # SwiGLU loads a gate and an up tile per stage
    beside = _dh_bytes(bn) if epi_wg else _epi_bytes(tma_store)
    return min(MAX_STAGES, (SMEM_BYTES - SMEM_RESERVE - beside) // _stage_bytes(bn, nb))


def _epi_wg_serves(epilogue: str, tma_store: bool, bn: int) -> bool:
    """dSwiGLU can run its epilogue on the producer warp group's idle warps (KernelSpec.epi_wg) where the
    TMA-store epilogue serves the call (dense, 16-bit outputs only written) with 128 x 256 tiles: a warp covers
    a tile row."""
    return epilogue == "dswiglu" and tma_store and bn == 256


def _epi_tma_load_serves(epilogue: str, tma_store: bool, bn: int) -> bool:
    """dSwiGLU reads gate / up by TMA into the store ring (KernelSpec.epi_tma_load) on the TMA-store
    epilogue with BN 128 or 256 (a ring slot then completes an even number of loads a tile)."""
    return epilogue == "dswiglu" and tma_store and bn % 128 == 0


def choose_config(m: int, n: int, epilogue: str, grouped: bool, wide_epilogue: bool, num_sms: int, groups: int = 1,
                  tma_store: bool = False):
    """(bn, cluster_m, stages) for a problem with M rows and N output columns (see the module docstring)."""
    m_tiles = -(-m // BM)
    if grouped:
        m_tiles = m_tiles + groups  # upper bound: every group may end in a partial tile
    if epilogue == "swiglu" or wide_epilogue or (epilogue == "dswiglu" and not tma_store):
        bn = 128
    elif m_tiles * -(-n // 256) >= num_sms:
        bn = 256
    elif m_tiles * -(-n // 128) * 2 >= num_sms or n > 64 * 4:
        bn = 128
    else:
        bn = 64
    tiles = m_tiles * -(-n // bn)
    cluster_m = 2 if (not grouped and m_tiles >= 2 and tiles >= 2 * num_sms) else 1
    return bn, cluster_m, _max_stages(bn, epilogue, tma_store)


# ------------------------------------------------------------------ kernel


def _build(spec: KernelSpec):
    """Trace and compile the kernel for ``spec``; returns the ``cute.compile`` result."""
    cutlass, cute = kc.import_cute()
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32, Int32, const_expr
    from cutlass.cute.nvgpu import cpasync, warp, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    types = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}
    AB = types[spec.ab_dtype]
    OUT = types[spec.out_dtype]
    BN = spec.bn
    CM = spec.cluster_m
    STAGES = spec.stages
    EPI = spec.epilogue
    GROUPED = spec.grouped
    HAS_BIAS = spec.bias_dtype != ""
    HAS_RS = spec.rs_dtype != ""
    HAS_BETA = spec.has_beta
    PREACT = spec.store_preact
    NB = 2 if EPI == "swiglu" else 1
    TAIL = spec.b_tail  # k-blocks from kt_head on come from the second B descriptor
    TMA_EPI = spec.tma_store  # outputs leave through a shared-memory subtile ring and TMA stores
    EPI_TILE = (BM, EPI_N)
    EPI_WARP = 4  # the first consumer warp issues the epilogue's TMA stores
    PF_LEAD = 4  # dSwiGLU: gate / up are prefetched into L2 this many k-blocks before the tile's last load
    # dSwiGLU with epi_tma_load: gate / up subtiles are TMA-loaded into the store ring (slot s = buffers
    # 2s, 2s + 1, two subtiles in flight, one mbarrier a slot) and dup / dgate written back in place: no
    # thread loads from global memory in the epilogue, so the async-proxy fence before each TMA store
    # (MEMBAR.ALL.CTA in SASS, which waits for a thread's outstanding loads) has nothing to wait for.
    # A slot completes BN / EPI_N / 2 loads a tile: an even count keeps each subtile's phase static.
    EPI_LD = spec.epi_tma_load
    assert not EPI_LD or (EPI == "dswiglu" and TMA_EPI and (BN // EPI_N) % 4 == 0 and EPI_STAGES == 4), spec
    # dSwiGLU's epilogue on the producer warp group's warps 1-3 (epi_wg): the consumers scale each row of dh
    # into float16 range (a float32 factor per row), store it into a padded [BM, BN + DH_PAD] tile and go on
    # to the next tile's main loop; the epilogue warps read gate / up from global memory, dh from that tile,
    # and write dgate / dup, a warp a whole tile row at a time (32 lanes x 8 columns = BN). Two mbarriers
    # pass the tile: full (every consumer thread arrives) and empty (every epilogue thread arrives).
    EWG = spec.epi_wg
    assert not EWG or (EPI == "dswiglu" and not TMA_EPI and not GROUPED and BN == 32 * 8), spec
    REGS_PRODUCER = EPI_WG_REGS[0] if EWG else PRODUCER_REGS
    REGS_CONSUMER = EPI_WG_REGS[1] if EWG else CONSUMER_REGS
    EPI_WG_ROWS = spec.ewg_rows
    DH_SCALE = 16384.0  # a row's largest finite |dh| maps to this (float16's largest finite value is 65504)
    DH_TINY = 1e-30  # rows of zeros (or smaller than this) keep a finite scale
    DH_FINITE = 3.4028234663852886e38  # float32's largest finite value: the row maximum skips infs (and NaNs)
    MMA_WG = 2  # consumer warp groups sharing one tile (64 rows each)
    GM = max(1, spec.group_m // CM)  # swizzle band height in cluster rows
    LOG2E = 1.4426950408889634
    a_layout = LayoutEnum.ROW_MAJOR if spec.a_major == "k" else LayoutEnum.COL_MAJOR
    b_layout = LayoutEnum.ROW_MAJOR if spec.b_major == "k" else LayoutEnum.COL_MAJOR
    TX_BYTES = _stage_bytes(BN, NB, AB.width // 8)
    # The innermost coordinate of a TMA box must be a multiple of 16 bytes (else the copy faults with
    # an illegal instruction). A column-major A has M innermost, so a grouped GEMM starts each group's
    # tiles at a row rounded down to a multiple of 8; dense tiles start at multiples of 128 anyway.
    A_ALIGN = 16 // (AB.width // 8) if (GROUPED and spec.a_major == "m") else 1
    st = {}  # host-traced objects the kernel body needs (shared storage struct)

    # ---------------------------------------------------------- scheduling helpers

    @cute.jit
    def ceil_div(x, d):
        return (x + (d - 1)) // d

    @cute.jit
    def tile_start(s):
        """First row of a group's first tile: the group's first row ``s``, rounded down to a multiple of
        A_ALIGN rows (a column-major A has M innermost, and a TMA box must start 16 bytes aligned there)."""
        r = s
        if const_expr(A_ALIGN > 1):
            r = s - (s & (A_ALIGN - 1))  # floor to a multiple (two's complement: also for s < 0)
        return r

    @cute.jit
    def group_mtiles(s, e):
        """M-tiles of the group of rows [s, e): 0 when it is empty, else enough to cover [tile_start(s), e)."""
        mt = Int32(0)
        if e > s:
            mt = ceil_div(e - tile_start(s), BM)
        return mt

    @cute.jit
    def group_tiles(s, e, n_tiles):
        return group_mtiles(s, e) * n_tiles

    @cute.jit
    def seek_group(t, g, tb, s, e, gt, mOffs, G, n_tiles):
        """Advance the group cursor (g, first tile tb, rows [s, e), tiles gt) until tile t is inside group g."""
        while cutlass.and_(g < G, t >= tb + gt):
            tb = tb + gt
            g = g + 1
            s = e
            if g < G:
                s = mOffs[g]
                e = mOffs[g + 1]
            gt = group_tiles(s, e, n_tiles)
        return g, tb, s, e, gt

    @cute.jit
    def first_tile(t, mOffs, G, n_tiles, dense_tiles, M):
        """The tile cursor (group g, its first tile tb, its rows [s, e), its tile count gt) at tile t."""
        g = Int32(0)
        tb = Int32(0)
        s = Int32(0)
        e = M
        gt = dense_tiles
        if const_expr(GROUPED):
            s = mOffs[0]
            e = mOffs[1]
            gt = group_tiles(s, e, n_tiles)
            g, tb, s, e, gt = seek_group(t, g, tb, s, e, gt, mOffs, G, n_tiles)
        return g, tb, s, e, gt

    @cute.jit
    def next_tile(t, g, tb, s, e, gt, n_clusters, mOffs, G, n_tiles):
        """Advance the cursor by one persistent step (n_clusters tiles)."""
        t = t + n_clusters
        if const_expr(GROUPED):
            g, tb, s, e, gt = seek_group(t, g, tb, s, e, gt, mOffs, G, n_tiles)
        return t, g, tb, s, e, gt

    @cute.jit
    def swizzle(r, m_rows, n_tiles):
        """Tile r of an (m_rows x n_tiles) grid in the grouped order: bands of GM rows, column by column."""
        band_tiles = GM * n_tiles
        band = r // band_tiles
        first = band * GM
        h = cutlass.min(m_rows - first, Int32(GM))
        rr = r - band * band_tiles
        return first + rr % h, rr // h

    # ---------------------------------------------------------- epilogue helpers

    @cute.jit
    def sigmoid(x):
        return 1.0 / (1.0 + cute.math.exp2(x * (-LOG2E), fastmath=True))

    @cute.jit
    def clamp_row(r, row_lo, row_lim):
        """Row r clamped into the tile's rows [row_lo, row_lim) and into [0, M) (for reads only; row_lo >= 0)."""
        if const_expr(GROUPED):
            r = cutlass.max(r, row_lo)
        return cutlass.max(cutlass.min(r, row_lim - 1), Int32(0))

    @cute.jit
    def tile_view(mT, row0, col0):
        """The (BM, BN) window of a row-major [rows, cols] tensor whose corner is (row0, col0)."""
        return cute.local_tile(cute.domain_offset((row0, col0), mT), (BM, BN), (0, 0))

    @cute.jit
    def load_frag(mT, thr_mma, tCc, row0, col0, row_lo, row_lim, col_lim, full):
        """An [M, N] epilogue operand at this thread's accumulator positions, in its own dtype."""
        tCg = thr_mma.partition_C(tile_view(mT, row0, col0))
        frag = cute.make_rmem_tensor(tCc.shape, mT.element_type)
        if full:
            cute.autovec_copy(tCg, frag)
        else:
            for i in cutlass.range_constexpr(cute.size(frag)):
                c = tCc[i]
                r = clamp_row(row0 + c[0], row_lo, row_lim)
                cc = cutlass.min(col0 + c[1], col_lim - 1)
                frag[i] = mT[r, cc]
        return frag

    @cute.jit
    def load_operand(mT, thr_mma, tCc, row0, col0, row_lo, row_lim, col_lim, full):
        """An [M, N] epilogue operand at this thread's accumulator positions, as float32 values."""
        return load_frag(mT, thr_mma, tCc, row0, col0, row_lo, row_lim, col_lim, full).load().to(Float32)

    @cute.jit
    def to_frag(vals, tCc, dtype):
        """float32 values at this thread's accumulator positions, converted into a register fragment."""
        frag = cute.make_rmem_tensor(tCc.shape, dtype)
        frag.store(vals.to(dtype))
        return frag

    @cute.jit
    def store_result(vals, mT, thr_mma, tCc, row0, col0, row_lo, row_lim, col_lim, full):
        """Store float32 values held at this thread's accumulator positions into mT (converted)."""
        store_frag(to_frag(vals, tCc, mT.element_type), mT, thr_mma, tCc, row0, col0, row_lo, row_lim, col_lim, full)

    @cute.jit
    def store_frag(frag, mT, thr_mma, tCc, row0, col0, row_lo, row_lim, col_lim, full):
        """Store a fragment of mT's dtype held at this thread's accumulator positions into mT."""
        tCg = thr_mma.partition_C(tile_view(mT, row0, col0))
        if full:
            cute.autovec_copy(frag, tCg)
        else:
            for i in cutlass.range_constexpr(cute.size(frag)):
                c = tCc[i]
                r = row0 + c[0]
                if cutlass.and_(r < row_lim, r >= row_lo, col0 + c[1] < col_lim):
                    tCg[i] = frag[i]

    @cute.jit
    def add_bias_scale(frag, mV, mRSv, tCc, row0, col0, row_lo, row_lim, col_lim, scale, add_bias, add_rs):
        """frag = (frag * scale + bias[col]) * row_scale[row], in place, per element (bias/row_scale at clamped indices)."""
        for i in cutlass.range_constexpr(cute.size(frag)):
            x = frag[i] * scale
            if const_expr(add_bias):
                x = x + mV[cutlass.min(col0 + tCc[i][1], col_lim - 1)].to(Float32)
            if const_expr(add_rs):
                x = x * mRSv[clamp_row(row0 + tCc[i][0], row_lo, row_lim)].to(Float32)
            frag[i] = x

    # TMA-store epilogue: BM x EPI_N subtiles go register -> shared memory (stmatrix) -> global
    # memory (one TMA store each, issued by EPI_WARP; TMA clips what lies past the tensor's edge).
    # ``epi`` counts the subtiles stored so far: it picks the ring buffer, and before a buffer is
    # written again the store that last read it has finished reading (``producer_acquire`` leaves at
    # most EPI_STAGES - 1 stores in flight).

    @cute.jit
    def epi_partition(atom, mT_tma, row0, col0, sC):
        """(shared, global) TMA views of the (BM, BN) tile at (row0, col0): (.., EPI_STAGES) and (.., BN / EPI_N)."""
        gT = cute.zipped_divide(tile_view(mT_tma, row0, col0), EPI_TILE)  # ((BM, EPI_N), (1, BN / EPI_N))
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gT)

    @cute.jit
    def epi_subtile(vals, atom, bSG_s, bSG_g, e, epi, tiled_r2s, tRS_sC, store_pipe, epi_bar, warp_idx):
        """Subtile e (this thread's values ``vals``, a register tensor shaped like one subtile) into the
        next ring buffer, then to global memory; returns ``epi`` advanced."""
        buf = epi % EPI_STAGES
        cute.copy(tiled_r2s, vals, tRS_sC[(None, None, None, buf)])
        # the TMA engine reads what the threads wrote: make the writes visible to the async proxy
        cute.arch.fence_proxy("async.shared", space="cta")
        epi_bar.arrive_and_wait()
        if warp_idx == EPI_WARP:
            cute.copy(atom, bSG_s[(None, buf)], bSG_g[(None, e)])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()  # the next buffer's previous store has read it
        epi_bar.arrive_and_wait()
        return epi + 1

    @cute.jit
    def epi_store(frag, atom, mT_tma, row0, col0, epi, tiled_r2s, tRS_sC, tRS_rC, sC, store_pipe, epi_bar, warp_idx):
        """Store a fragment of the output dtype held at this thread's accumulator positions into the
        (BM, BN) tile at (row0, col0) of mT_tma; returns ``epi`` advanced."""
        tRS_rF = tiled_r2s.retile(frag)
        bSG_s, bSG_g = epi_partition(atom, mT_tma, row0, col0, sC)
        nv = cute.size(tRS_rC)
        for e in cutlass.range_constexpr(BN // EPI_N):
            for v in cutlass.range_constexpr(nv):
                tRS_rC[v] = tRS_rF[e * nv + v]
            epi = epi_subtile(tRS_rC, atom, bSG_s, bSG_g, e, epi, tiled_r2s, tRS_sC, store_pipe, epi_bar, warp_idx)
        return epi

    @cute.jit
    def load_subtile(mT, thr_r2s, tRS_cc, e, nv, frag, row0, col0, row_lo, row_lim, col_lim, full):
        """Subtile e of the (BM, BN) window of an [M, N] operand at (row0, col0), in the order this
        thread holds subtile e of its retiled accumulators (clamped reads on edge tiles)."""
        if full:
            cute.autovec_copy(thr_r2s.partition_S(cute.local_tile(tile_view(mT, row0, col0), EPI_TILE, (0, e))), frag)
        else:
            for v in cutlass.range_constexpr(nv):
                c = tRS_cc[e * nv + v]
                frag[v] = mT[clamp_row(row0 + c[0], row_lo, row_lim), cutlass.min(col0 + c[1], col_lim - 1)]

    @cute.jit
    def epi_store_dswiglu(acc, mG, mU, tCc, row0, col0, row_lo, row_lim, col_lim, full, epi, atom_dgate, mDg_tma,
                          atom_dup, mDu_tma, thr_r2s, tiled_r2s, tRS_sC, tRS_rC, tRS_rC2, sC, store_pipe, epi_bar,
                          warp_idx):
        """dSwiGLU formed subtile by subtile from dh (the accumulators) and gate / up read subtile by
        subtile (one subtile ahead; the producer has prefetched the tile into L2), so that neither a
        whole output fragment nor the whole gate / up tiles need registers (a 128 x 256 tile has no
        registers to spare for them): dup then dgate of each subtile leave through the ring; returns
        ``epi`` advanced."""
        tRS_acc = tiled_r2s.retile(acc)
        tRS_cc = tiled_r2s.retile(tCc)
        gs, gg = epi_partition(atom_dgate, mDg_tma, row0, col0, sC)
        us, ug = epi_partition(atom_dup, mDu_tma, row0, col0, sC)
        nv = cute.size(tRS_rC)
        rg = [cute.make_rmem_tensor(tRS_rC.shape, mG.element_type) for _ in range(2)]
        ru = [cute.make_rmem_tensor(tRS_rC.shape, mU.element_type) for _ in range(2)]
        load_subtile(mG, thr_r2s, tRS_cc, 0, nv, rg[0], row0, col0, row_lo, row_lim, col_lim, full)
        load_subtile(mU, thr_r2s, tRS_cc, 0, nv, ru[0], row0, col0, row_lo, row_lim, col_lim, full)
        for e in cutlass.range_constexpr(BN // EPI_N):
            if const_expr(e + 1 < BN // EPI_N):  # the next subtile's operands are in flight meanwhile
                load_subtile(mG, thr_r2s, tRS_cc, e + 1, nv, rg[(e + 1) % 2], row0, col0, row_lo, row_lim, col_lim, full)
                load_subtile(mU, thr_r2s, tRS_cc, e + 1, nv, ru[(e + 1) % 2], row0, col0, row_lo, row_lim, col_lim, full)
            for v in cutlass.range_constexpr(nv):
                dh = tRS_acc[e * nv + v]
                g = rg[e % 2][v].to(Float32)
                sg = sigmoid(g)
                tRS_rC[v] = (dh * (g * sg)).to(tRS_rC.element_type)
                tRS_rC2[v] = (dh * ru[e % 2][v].to(Float32) * (sg * (1.0 + g * (1.0 - sg)))).to(tRS_rC.element_type)
            epi = epi_subtile(tRS_rC, atom_dup, us, ug, e, epi, tiled_r2s, tRS_sC, store_pipe, epi_bar, warp_idx)
            epi = epi_subtile(tRS_rC2, atom_dgate, gs, gg, e, epi, tiled_r2s, tRS_sC, store_pipe, epi_bar, warp_idx)
        return epi

    @cute.jit
    def epi_load_pair(e, slot, atom_g, gls, glg, atom_u, uls, ulg, ldbar):
        """(EPI_WARP) gate and up of subtile e into ring slot ``slot`` (buffers 2 slot, 2 slot + 1), on the
        slot's mbarrier (one elected arrive with the pair's bytes; TMA zero-fills past the edges)."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(ldbar + slot, 2 * BM * EPI_N * (AB.width // 8))
        cute.copy(atom_g, glg[(None, e)], gls[(None, 2 * slot)], tma_bar_ptr=ldbar + slot)
        cute.copy(atom_u, ulg[(None, e)], uls[(None, 2 * slot + 1)], tma_bar_ptr=ldbar + slot)

    @cute.jit
    def epi_store_dswiglu_tma(acc, tCc, row0, col0, atom_g, mG_tma, atom_u, mU_tma, atom_dgate, mDg_tma, atom_dup,
                              mDu_tma, ldbar, tiled_r2s, tRS_sC, tRS_rC, tRS_rC2, sC, epi_bar, warp_idx):
        """dSwiGLU through the ring both ways (EPI_LD): each subtile's gate / up arrive by TMA, every
        thread reads its positions from shared memory, and dup / dgate go back into the same two
        buffers (a warp reads and writes only its own rows) before their TMA stores; the stores of
        subtile e must have read a slot before subtile e + 2 is loaded into it."""
        tRS_acc = tiled_r2s.retile(acc)
        tRS_cc = tiled_r2s.retile(tCc)
        gls, glg = epi_partition(atom_g, mG_tma, row0, col0, sC)
        uls, ulg = epi_partition(atom_u, mU_tma, row0, col0, sC)
        gs, gg = epi_partition(atom_dgate, mDg_tma, row0, col0, sC)
        us, ug = epi_partition(atom_dup, mDu_tma, row0, col0, sC)
        nv = cute.size(tRS_rC)
        nsub = BN // EPI_N
        if warp_idx == EPI_WARP:  # the previous tile's stores have read the ring: the first two subtiles in
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            epi_load_pair(0, 0, atom_g, gls, glg, atom_u, uls, ulg, ldbar)
            epi_load_pair(1, 1, atom_g, gls, glg, atom_u, uls, ulg, ldbar)
        for e in cutlass.range_constexpr(nsub):
            slot = e % 2
            cute.arch.mbarrier_wait(ldbar + slot, (e // 2) % 2)
            for v in cutlass.range_constexpr(nv):
                c = tRS_cc[e * nv + v]
                g = sC[(c[0], c[1] - e * EPI_N, 2 * slot)].to(Float32)
                u = sC[(c[0], c[1] - e * EPI_N, 2 * slot + 1)].to(Float32)
                dh = tRS_acc[e * nv + v]
                sg = sigmoid(g)
                tRS_rC[v] = (dh * (g * sg)).to(tRS_rC.element_type)
                tRS_rC2[v] = (dh * u * (sg * (1.0 + g * (1.0 - sg)))).to(tRS_rC.element_type)
            cute.arch.sync_warp()  # the warp's reads of the slot are done before stmatrix overwrites them
            cute.copy(tiled_r2s, tRS_rC, tRS_sC[(None, None, None, 2 * slot)])
            cute.copy(tiled_r2s, tRS_rC2, tRS_sC[(None, None, None, 2 * slot + 1)])
            cute.arch.fence_proxy("async.shared", space="cta")
            epi_bar.arrive_and_wait()
            if warp_idx == EPI_WARP:
                cute.copy(atom_dup, us[(None, 2 * slot)], ug[(None, e)])
                cute.copy(atom_dgate, gs[(None, 2 * slot + 1)], gg[(None, e)])
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(e + 2 < nsub):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # these stores have read the slot
                    epi_load_pair(e + 2, slot, atom_g, gls, glg, atom_u, uls, ulg, ldbar)

    @cute.jit
    def hand_over_dh(acc, tCc, thr_mma, sDH, sScl, ctid):
        """(EWG, consumers) dh into the shared [BM, BN] float16 tile, each row multiplied by DH_SCALE over
        its largest finite |dh| in the tile, and the inverse factor into sScl[row]. A thread holds two rows of
        its warp's 16 (accumulator element i is on the second when (i // 2) % 2 == 1), each spread over
        the four lanes of a quad, so the row maxima take two butterfly shuffles."""
        n = cute.size(acc)
        mx = [Float32(0.0), Float32(0.0)]
        for i in cutlass.range_constexpr(n):
            x = acc[i]
            h = (i // 2) % 2
            a = cute.arch.fmax(x, -x)  # a NaN stays NaN here; the ordered compare maps it (and infs) to 0
            mx[h] = cute.arch.fmax(mx[h], cutlass.select_(a <= Float32(DH_FINITE), a, Float32(0.0)))
        scl = [None, None]
        inv = [None, None]
        for h in cutlass.range_constexpr(2):
            for off in cutlass.range_constexpr(1, 3):  # xor 1, 2: the quad
                mx[h] = cute.arch.fmax(mx[h], cute.arch.shuffle_sync_bfly(mx[h], offset=off))
            top = cute.arch.fmax(mx[h], Float32(DH_TINY))
            scl[h] = Float32(DH_SCALE) / top
            inv[h] = top * Float32(1.0 / DH_SCALE)
        frag = cute.make_rmem_tensor(tCc.shape, cutlass.Float16)
        for i in cutlass.range_constexpr(n):
            frag[i] = (acc[i] * scl[(i // 2) % 2]).to(cutlass.Float16)
        cute.autovec_copy(frag, thr_mma.partition_C(sDH))
        if ctid % 4 == 0:
            sScl[tCc[0][0]] = inv[0]
            sScl[tCc[2][0]] = inv[1]

    @cute.jit
    def epi_wg_tile(mG, mU, mDg, mDu, sDH, sScl, row0, col0, M, N, ewarp, lane):
        """(EWG, epilogue warps) dgate, dup of the tile at (row0, col0): epilogue warp w takes rows w, w + 3,
        ..., lane l columns 8 l .. 8 l + 7 (16-byte accesses, a warp a whole 512-byte row); EPI_WG_ROWS rows
        are loaded before any is computed. Loads read clamped coordinates, stores stop at M and N."""
        c = col0 + lane * 8
        cin = c < N
        cc = cutlass.min(c, N - 8) // 8
        for it in cutlass.range(-(-BM // (EPI_WARPS * EPI_WG_ROWS)), unroll=1):
            rg = [cute.make_rmem_tensor((1, 8), mG.element_type) for _ in range(EPI_WG_ROWS)]
            ru = [cute.make_rmem_tensor((1, 8), mU.element_type) for _ in range(EPI_WG_ROWS)]
            rd = [cute.make_rmem_tensor((1, 8), cutlass.Float16) for _ in range(EPI_WG_ROWS)]
            for u in cutlass.range_constexpr(EPI_WG_ROWS):
                r = cutlass.min(ewarp + EPI_WARPS * (it * EPI_WG_ROWS + u), BM - 1)
                gr = cutlass.min(row0 + r, M - 1)
                cute.autovec_copy(cute.local_tile(mG, (1, 8), (gr, cc)), rg[u])
                cute.autovec_copy(cute.local_tile(mU, (1, 8), (gr, cc)), ru[u])
                cute.autovec_copy(cute.local_tile(sDH, (1, 8), (r, lane)), rd[u])
            for u in cutlass.range_constexpr(EPI_WG_ROWS):
                r = ewarp + EPI_WARPS * (it * EPI_WG_ROWS + u)
                inv = sScl[cutlass.min(r, BM - 1)]
                og = cute.make_rmem_tensor((1, 8), mDg.element_type)
                ou = cute.make_rmem_tensor((1, 8), mDu.element_type)
                for v in cutlass.range_constexpr(8):
                    dh = rd[u][0, v].to(Float32) * inv
                    g = rg[u][0, v].to(Float32)
                    sg = sigmoid(g)
                    ou[0, v] = (dh * (g * sg)).to(mDu.element_type)
                    og[0, v] = (dh * ru[u][0, v].to(Float32) * (sg * (1.0 + g * (1.0 - sg)))).to(mDg.element_type)
                if cutlass.and_(r < BM, row0 + r < M, cin):
                    cute.autovec_copy(og, cute.local_tile(mDg, (1, 8), (row0 + r, cc)))
                    cute.autovec_copy(ou, cute.local_tile(mDu, (1, 8), (row0 + r, cc)))

    @cute.jit
    def copy_b(atom, src, dst, bar, mask):
        """One TMA load of a B tile (multicast to both CTAs of a 2-CTA cluster)."""
        if const_expr(CM > 1):
            cute.copy(atom, src, dst, tma_bar_ptr=bar, mcast_mask=mask)
        else:
            cute.copy(atom, src, dst, tma_bar_ptr=bar)

    # ---------------------------------------------------------- device kernel

    @cute.kernel
    def kernel(
        tma_atom_a: cute.CopyAtom,
        mA_tma: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_tma: cute.Tensor,
        tma_atom_b2: cute.CopyAtom,
        mB2_tma: cute.Tensor,
        tma_atom_d: cute.CopyAtom,
        mD_tma: cute.Tensor,
        tma_atom_e1: cute.CopyAtom,
        mE1_tma: cute.Tensor,
        tma_atom_e2: cute.CopyAtom,
        mE2_tma: cute.Tensor,
        tma_atom_g: cute.CopyAtom,
        mG_tma: cute.Tensor,
        tma_atom_u: cute.CopyAtom,
        mU_tma: cute.Tensor,
        mD: cute.Tensor,
        mE1: cute.Tensor,
        mE2: cute.Tensor,
        mG: cute.Tensor,
        mU: cute.Tensor,
        mBias: cute.Tensor,
        mBias2: cute.Tensor,
        mRS: cute.Tensor,
        mOffs: cute.Tensor,
        alpha: Float32,
        beta: Float32,
        tiled_mma: cute.TiledMma,
        cta_layout_mnk: cute.Layout,
        a_smem_staged: cute.ComposedLayout,
        b_smem_staged: cute.ComposedLayout,
        epi_smem_staged: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblocks, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            if const_expr(NB == 2 or TAIL):
                cpasync.prefetch_descriptor(tma_atom_b2)
            if const_expr(TMA_EPI):
                cpasync.prefetch_descriptor(tma_atom_d)
                if const_expr(EPI == "dswiglu" or PREACT):
                    cpasync.prefetch_descriptor(tma_atom_e1)
                if const_expr(PREACT):
                    cpasync.prefetch_descriptor(tma_atom_e2)

        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        rank_m = cluster_coord[0]

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(st["SharedStorage"])

        # full barrier: TMA bytes; empty barrier: one arrive per consumer warp and multicast peer
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, CM * MMA_WG * 4)  # warps reading a stage
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=STAGES,
            producer_group=producer_group,
            consumer_group=consumer_group,
            tx_count=TX_BYTES,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
            defer_sync=True,
        )
        ldbar = None  # EPI_LD: the two ring slots' mbarriers (one elected arrive + the pair's bytes)
        if const_expr(EPI_LD):
            ldbar = smem.allocate_array(cutlass.Int64, 2, byte_alignment=8)
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(ldbar, 1)
                    cute.arch.mbarrier_init(ldbar + 1, 1)
            cute.arch.mbarrier_init_fence()
        dhbar = None  # EWG: the dh tile's full and empty mbarriers
        if const_expr(EWG):
            dhbar = smem.allocate_array(cutlass.Int64, 2, byte_alignment=8)
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(dhbar, MMA_WG * 128)
                    cute.arch.mbarrier_init(dhbar + 1, EPI_WARPS * 32)
            cute.arch.mbarrier_init_fence()
        pipeline.pipeline_init_arrive(cluster_shape_mn=(CM, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem_staged.outer, swizzle=a_smem_staged.inner)
        sB = storage.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sB2 = sB
        if const_expr(NB == 2):
            sB2 = storage.sB2.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sC = sA  # placeholder without the TMA-store epilogue
        if const_expr(TMA_EPI):
            sC = smem.allocate_tensor(OUT, epi_smem_staged.outer, byte_alignment=1024, swizzle=epi_smem_staged.inner)
        sDH = sScl = None
        if const_expr(EWG):
            sDH = smem.allocate_tensor(cutlass.Float16, cute.make_layout((BM, BN), stride=(BN + DH_PAD, 1)),
                                       byte_alignment=128)
            sScl = smem.allocate_tensor(Float32, cute.make_layout(BM), byte_alignment=16)

        M = mD.shape[0]
        N = mD.shape[1]
        K = mA_tma.shape[1]
        k_tiles = ceil_div(K, BK)
        kt_head = k_tiles
        if const_expr(TAIL):
            kt_head = mB_tma.shape[1] // BK  # a multiple of BK (checked on the host)
        n_tiles = ceil_div(N, BN)
        cluster_id = bidx // CM
        n_clusters = nblocks // CM
        G = Int32(1)
        if const_expr(GROUPED):
            G = mOffs.shape[0] - 1
        m_cluster_rows = ceil_div(ceil_div(M, BM), CM)
        dense_tiles = m_cluster_rows * n_tiles

        pipeline.pipeline_init_wait(cluster_shape_mn=(CM, 1))

        # ------------------------------------------------------ producer warp group
        if wg_idx == 0:
            cute.arch.setmaxregister_decrease(REGS_PRODUCER)
            if warp_idx == 0:
                b_mcast_mask = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
                prod_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
                t = cluster_id
                g, tb, s, e, gt = first_tile(t, mOffs, G, n_tiles, dense_tiles, M)
                valid = cutlass.and_(g < G, t < tb + gt)
                while valid:
                    mt = Int32(0)
                    nt = Int32(0)
                    row0 = Int32(0)
                    if const_expr(GROUPED):
                        mt, nt = swizzle(t - tb, group_mtiles(s, e), n_tiles)
                        row0 = tile_start(s) + mt * BM
                    else:
                        cm, nt = swizzle(t, m_cluster_rows, n_tiles)
                        mt = cm * CM + rank_m
                        row0 = mt * BM
                    gA = cute.local_tile(cute.domain_offset((row0, 0), mA_tma), (BM, BK), (0, None))
                    tAsA, tAgA = cpasync.tma_partition(
                        tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
                    )
                    mB_g = mB_tma
                    mB2_g = mB2_tma
                    if const_expr(GROUPED):
                        mB_g = mB_tma[None, None, g]
                        mB2_g = mB2_tma[None, None, g]
                    gB = cute.local_tile(mB_g, (BN, BK), (nt, None))
                    tBsB, tBgB = cpasync.tma_partition(
                        tma_atom_b, rank_m, cute.make_layout(CM), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
                    )
                    tB2sB2 = tBsB
                    tB2gB2 = tBgB
                    tGg = tUg = None
                    if const_expr(EPI == "dswiglu" and TMA_EPI):  # the (BM, EPI_N) boxes of the tile's gate / up
                        _, tGg = epi_partition(tma_atom_g, mG_tma, row0, nt * BN, sC)
                        _, tUg = epi_partition(tma_atom_u, mU_tma, row0, nt * BN, sC)
                    if const_expr(TAIL):  # the tail's k-blocks land in B's stage buffers
                        gB2 = cute.local_tile(mB2_g, (BN, BK), (nt, None))
                        _, tB2gB2 = cpasync.tma_partition(
                            tma_atom_b2, rank_m, cute.make_layout(CM), cute.group_modes(sB, 0, 2), cute.group_modes(gB2, 0, 2)
                        )
                    if const_expr(NB == 2):
                        gB2 = cute.local_tile(mB2_g, (BN, BK), (nt, None))
                        tB2sB2, tB2gB2 = cpasync.tma_partition(
                            tma_atom_b2, rank_m, cute.make_layout(CM), cute.group_modes(sB2, 0, 2), cute.group_modes(gB2, 0, 2)
                        )
                    pf_kt = cutlass.max(k_tiles - PF_LEAD, Int32(0))
                    for kt in cutlass.range(k_tiles, unroll=1):
                        if const_expr(EPI == "dswiglu" and TMA_EPI):
                            if kt == pf_kt:  # gate / up of this tile into L2 for the epilogue
                                for j in cutlass.range_constexpr(BN // EPI_N):
                                    cute.prefetch(tma_atom_g, tGg[(None, j)])
                                    cute.prefetch(tma_atom_u, tUg[(None, j)])
                        ab_pipe.producer_acquire(prod_state)
                        bar = ab_pipe.producer_get_barrier(prod_state)
                        cute.copy(tma_atom_a, tAgA[(None, kt)], tAsA[(None, prod_state.index)], tma_bar_ptr=bar)
                        if const_expr(TAIL):
                            if kt < kt_head:
                                copy_b(tma_atom_b, tBgB[(None, kt)], tBsB[(None, prod_state.index)], bar, b_mcast_mask)
                            else:
                                copy_b(tma_atom_b2, tB2gB2[(None, kt - kt_head)], tBsB[(None, prod_state.index)], bar, b_mcast_mask)
                        else:
                            copy_b(tma_atom_b, tBgB[(None, kt)], tBsB[(None, prod_state.index)], bar, b_mcast_mask)
                            if const_expr(NB == 2):
                                copy_b(tma_atom_b2, tB2gB2[(None, kt)], tB2sB2[(None, prod_state.index)], bar, b_mcast_mask)
                        ab_pipe.producer_commit(prod_state)
                        prod_state.advance()
                    t, g, tb, s, e, gt = next_tile(t, g, tb, s, e, gt, n_clusters, mOffs, G, n_tiles)
                    valid = cutlass.and_(g < G, t < tb + gt)
                ab_pipe.producer_tail(prod_state)
            if const_expr(EWG):
                if warp_idx > 0:  # the epilogue warps: each tile's dSwiGLU once the consumers hand dh over
                    ewarp = warp_idx - 1
                    lane = tidx % 32
                    tile_it = Int32(0)
                    t = cluster_id
                    while t < dense_tiles:
                        cm, nt = swizzle(t, m_cluster_rows, n_tiles)
                        cute.arch.mbarrier_wait(dhbar, tile_it % 2)
                        epi_wg_tile(mG, mU, mD, mE1, sDH, sScl, (cm * CM + rank_m) * BM, nt * BN, M, N, ewarp, lane)
                        cute.arch.mbarrier_arrive(dhbar + 1)
                        tile_it = tile_it + 1
                        t = t + n_clusters

        # ------------------------------------------------------ consumer warp groups
        if wg_idx > 0:
            cute.arch.setmaxregister_increase(REGS_CONSUMER)
            ctid = tidx - 128
            thr_mma = tiled_mma.get_slice(ctid)
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA)
            tCrB = tiled_mma.make_fragment_B(tCsB)
            tCrB2 = tCrB
            if const_expr(NB == 2):
                tCrB2 = tiled_mma.make_fragment_B(thr_mma.partition_B(sB2))
            tCc = thr_mma.partition_C(cute.make_identity_tensor((BM, BN)))
            acc = cute.make_rmem_tensor(tCc.shape, Float32)
            acc2 = acc
            if const_expr(NB == 2):
                acc2 = cute.make_rmem_tensor(tCc.shape, Float32)
            num_k_blocks = cute.size(tCrA, mode=[2])
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
            # TMA-store epilogue: stmatrix from the accumulator layout into a BM x EPI_N subtile, a ring
            # of EPI_STAGES such buffers, a barrier over the two consumer warp groups
            tiled_r2s = thr_r2s = tRS_sC = tRS_rC = tRS_rC2 = store_pipe = epi_bar = None
            if const_expr(TMA_EPI):
                r2s_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, OUT, Float32)
                stm_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), OUT)
                tiled_r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm_atom, tiled_mma))
                thr_r2s = tiled_r2s.get_slice(ctid)
                tRS_sC = thr_r2s.partition_D(sC)
                tRS_rC = cute.make_rmem_tensor(cute.shape(thr_r2s.partition_S(sC))[:3], OUT)
                tRS_rC2 = cute.make_rmem_tensor(cute.shape(thr_r2s.partition_S(sC))[:3], OUT)
                store_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=EPI_STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, MMA_WG * 128),
                )
                epi_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=MMA_WG * 128)
            epi = Int32(0)
            tile_it = Int32(0)  # EWG: tiles handed over so far (the dh barriers' phases)

            t = cluster_id
            g, tb, s, e, gt = first_tile(t, mOffs, G, n_tiles, dense_tiles, M)
            valid = cutlass.and_(g < G, t < tb + gt)
            while valid:
                mt = Int32(0)
                nt = Int32(0)
                row0 = Int32(0)
                row_lo = Int32(0)
                row_lim = M
                if const_expr(GROUPED):
                    mt, nt = swizzle(t - tb, group_mtiles(s, e), n_tiles)
                    row0 = tile_start(s) + mt * BM
                    row_lo = cutlass.max(s, Int32(0))  # rows [tile_start(s), s) belong to the previous group
                    row_lim = cutlass.min(e, M)
                else:
                    cm, nt = swizzle(t, m_cluster_rows, n_tiles)
                    mt = cm * CM + rank_m
                    row0 = mt * BM
                col0 = nt * BN
                full = cutlass.and_(row0 >= row_lo, row0 + BM <= row_lim, col0 + BN <= N)

                # ---- main loop: one WGMMA batch in flight, release a stage when its batch retires.
                # The first k-block's WGMMAs overwrite the accumulators (ACCUMULATE off) instead of a
                # zero fill: register moves between WGMMAs make ptxas serialize them (C7514).
                warpgroup.fence()
                ab_pipe.consumer_wait(read_state)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
                for kb in cutlass.range_constexpr(num_k_blocks):
                    crd = (None, None, kb, read_state.index)
                    cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
                    if const_expr(NB == 2):
                        cute.gemm(tiled_mma, acc2, tCrA[crd], tCrB2[crd], acc2)
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                read_state.advance()
                for kt in cutlass.range(1, k_tiles, unroll=1):
                    ab_pipe.consumer_wait(read_state)
                    for kb in cutlass.range_constexpr(num_k_blocks):
                        crd = (None, None, kb, read_state.index)
                        cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
                        if const_expr(NB == 2):
                            cute.gemm(tiled_mma, acc2, tCrA[crd], tCrB2[crd], acc2)
                    warpgroup.commit_group()
                    warpgroup.wait_group(1)
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()
                    read_state.advance()
                warpgroup.wait_group(0)
                ab_pipe.consumer_release(release_state)
                release_state.advance()

                # ---- epilogue
                if const_expr(EPI == "none"):
                    # out = row_scale * (alpha * acc + bias) + beta * out
                    add_bias_scale(acc, mBias, mRS, tCc, row0, col0, row_lo, row_lim, N, alpha, HAS_BIAS, HAS_RS)
                    v = acc.load()
                    if const_expr(HAS_BETA):
                        v = v + beta * load_operand(mD, thr_mma, tCc, row0, col0, row_lo, row_lim, N, full)
                    if const_expr(TMA_EPI):
                        epi = epi_store(to_frag(v, tCc, OUT), tma_atom_d, mD_tma, row0, col0, epi,
                                        tiled_r2s, tRS_sC, tRS_rC, sC, store_pipe, epi_bar, warp_idx)
                    else:
                        store_result(v, mD, thr_mma, tCc, row0, col0, row_lo, row_lim, N, full)
                elif const_expr(EPI == "swiglu"):
                    # gate = acc + bias_gate, up = acc2 + bias_up, h = silu(gate) * up * row_scale
                    if const_expr(HAS_BIAS):
                        add_bias_scale(acc, mBias, mRS, tCc, row0, col0, row_lo, row_lim, N, Float32(1.0), True, False)
                        add_bias_scale(acc2, mBias2, mRS, tCc, row0, col0, row_lo, row_lim, N, Float32(1.0), True, False)
                    # every value is converted out of the accumulators before the first store
                    # (stores interleaved with accumulator reads make ptxas serialize the WGMMAs)
                    gv = acc.load()
                    uv = acc2.load()
                    hv = gv * sigmoid(gv) * uv
                    fg = acc  # placeholders when the pre-activations are not stored
                    fu = acc
                    if const_expr(PREACT):
                        fg = to_frag(gv, tCc, AB)
                        fu = to_frag(uv, tCc, AB)
                    if const_expr(HAS_RS):
                        acc2.store(hv)
                        add_bias_scale(acc2, mBias, mRS, tCc, row0, col0, row_lo, row_lim, N, Float32(1.0), False, True)
                        hv = acc2.load()
                    fh = to_frag(hv, tCc, AB)
                    if const_expr(TMA_EPI):
                        if const_expr(PREACT):
                            epi = epi_store(fg, tma_atom_e1, mE1_tma, row0, col0, epi,
                                            tiled_r2s, tRS_sC, tRS_rC, sC, store_pipe, epi_bar, warp_idx)
                            epi = epi_store(fu, tma_atom_e2, mE2_tma, row0, col0, epi,
                                            tiled_r2s, tRS_sC, tRS_rC, sC, store_pipe, epi_bar, warp_idx)
                        epi = epi_store(fh, tma_atom_d, mD_tma, row0, col0, epi,
                                        tiled_r2s, tRS_sC, tRS_rC, sC, store_pipe, epi_bar, warp_idx)
                    else:
                        if const_expr(PREACT):
                            store_frag(fg, mE1, thr_mma, tCc, row0, col0, row_lo, row_lim, N, full)
                            store_frag(fu, mE2, thr_mma, tCc, row0, col0, row_lo, row_lim, N, full)
                        store_frag(fh, mD, thr_mma, tCc, row0, col0, row_lo, row_lim, N, full)
                else:
                    # dh = acc * row_scale; dup = dh * silu(gate); dgate = dh * up * silu'(gate)
                    if const_expr(HAS_RS):
                        add_bias_scale(acc, mBias, mRS, tCc, row0, col0, row_lo, row_lim, N, Float32(1.0), False, True)
                    if const_expr(EWG):
                        # the epilogue warps have read the previous tile's dh (immediate on the first tile)
                        cute.arch.mbarrier_wait(dhbar + 1, (tile_it + 1) % 2)
                        hand_over_dh(acc, tCc, thr_mma, sDH, sScl, ctid)
                        cute.arch.mbarrier_arrive(dhbar)
                        tile_it = tile_it + 1
                    elif const_expr(EPI_LD):
                        epi_store_dswiglu_tma(acc, tCc, row0, col0, tma_atom_g, mG_tma, tma_atom_u, mU_tma, tma_atom_d,
                                              mD_tma, tma_atom_e1, mE1_tma, ldbar, tiled_r2s, tRS_sC, tRS_rC, tRS_rC2,
                                              sC, epi_bar, warp_idx)
                    elif const_expr(TMA_EPI):
                        epi = epi_store_dswiglu(acc, mG, mU, tCc, row0, col0, row_lo, row_lim, N, full, epi,
                                                tma_atom_d, mD_tma, tma_atom_e1, mE1_tma, thr_r2s, tiled_r2s, tRS_sC,
                                                tRS_rC, tRS_rC2, sC, store_pipe, epi_bar, warp_idx)
                    else:
                        gv = load_operand(mG, thr_mma, tCc, row0, col0, row_lo, row_lim, N, full)
                        uv = load_operand(mU, thr_mma, tCc, row0, col0, row_lo, row_lim, N, full)
                        sg = sigmoid(gv)
                        dh = acc.load()
                        store_result(dh * (gv * sg), mE1, thr_mma, tCc, row0, col0, row_lo, row_lim, N, full)
                        store_result(dh * uv * (sg * (1.0 + gv * (1.0 - sg))), mD, thr_mma, tCc, row0, col0, row_lo, row_lim, N, full)
                t, g, tb, s, e, gt = next_tile(t, g, tb, s, e, gt, n_clusters, mOffs, G, n_tiles)
                valid = cutlass.and_(g < G, t < tb + gt)
            if const_expr(TMA_EPI):
                store_pipe.producer_tail()  # every TMA store has read its buffer before the CTA exits

    # ---------------------------------------------------------- host side

    @cute.jit
    def host(
        mA: cute.Tensor,
        mB: cute.Tensor,
        mB2: cute.Tensor,
        mD: cute.Tensor,
        mE1: cute.Tensor,
        mE2: cute.Tensor,
        mG: cute.Tensor,
        mU: cute.Tensor,
        mBias: cute.Tensor,
        mBias2: cute.Tensor,
        mRS: cute.Tensor,
        mOffs: cute.Tensor,
        alpha: Float32,
        beta: Float32,
        num_ctas: Int32,
        stream,
    ):
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            AB,
            AB,
            a_layout.sm90_mma_major_mode(),
            b_layout.sm90_mma_major_mode(),
            Float32,
            (MMA_WG, 1, 1),
            tiler_mn=(64, BN),
        )
        a_smem_staged = sm90_utils.make_smem_layout_a(a_layout, (BM, BN, BK), AB, STAGES)
        b_smem_staged = sm90_utils.make_smem_layout_b(b_layout, (BM, BN, BK), AB, STAGES)
        a_smem = cute.slice_(a_smem_staged, (None, None, 0))
        b_smem = cute.slice_(b_smem_staged, (None, None, 0))
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA, a_smem, (BM, BK))
        b_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(CM > 1) else cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(b_op, mB, b_smem, (BN, BK), num_multicast=CM)
        tma_atom_b2 = tma_atom_b
        tma_b2 = tma_b
        if const_expr(NB == 2 or TAIL):
            tma_atom_b2, tma_b2 = cpasync.make_tiled_tma_atom(b_op, mB2, b_smem, (BN, BK), num_multicast=CM)
        cta_layout_mnk = cute.make_layout((CM, 1, 1))
        # TMA-store epilogue: a (BM, EPI_N) box per output; placeholders (A's) where unused
        epi_smem_staged = a_smem_staged
        tma_atom_d, tma_d = tma_atom_a, tma_a
        tma_atom_e1, tma_e1 = tma_atom_a, tma_a
        tma_atom_e2, tma_e2 = tma_atom_a, tma_a
        if const_expr(TMA_EPI):
            epi_smem_staged = sm90_utils.make_smem_layout_epi(OUT, LayoutEnum.ROW_MAJOR, EPI_TILE, EPI_STAGES)
            epi_smem = cute.slice_(epi_smem_staged, (None, None, 0))
            s2g = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_d, tma_d = cpasync.make_tiled_tma_atom(s2g, mD, epi_smem, EPI_TILE)
            if const_expr(EPI == "dswiglu" or PREACT):
                tma_atom_e1, tma_e1 = cpasync.make_tiled_tma_atom(s2g, mE1, epi_smem, EPI_TILE)
            if const_expr(PREACT):
                tma_atom_e2, tma_e2 = cpasync.make_tiled_tma_atom(s2g, mE2, epi_smem, EPI_TILE)
        tma_atom_g, tma_g = tma_atom_a, tma_a
        tma_atom_u, tma_u = tma_atom_a, tma_a
        if const_expr(EPI == "dswiglu" and TMA_EPI):  # gate / up subtiles: their L2 prefetch, and with EPI_LD their loads
            g2s = cpasync.CopyBulkTensorTileG2SOp()
            tma_atom_g, tma_g = cpasync.make_tiled_tma_atom(g2s, mG, epi_smem, EPI_TILE)
            tma_atom_u, tma_u = cpasync.make_tiled_tma_atom(g2s, mU, epi_smem, EPI_TILE)

        if const_expr(NB == 2):

            @cute.struct
            class SharedStorage2:
                mbar: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
                sA: cute.struct.Align[cute.struct.MemRange[AB, cute.cosize(a_smem_staged)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[AB, cute.cosize(b_smem_staged)], 1024]
                sB2: cute.struct.Align[cute.struct.MemRange[AB, cute.cosize(b_smem_staged)], 1024]

            st["SharedStorage"] = SharedStorage2
        else:

            @cute.struct
            class SharedStorage1:
                mbar: cute.struct.MemRange[cutlass.Int64, STAGES * 2]
                sA: cute.struct.Align[cute.struct.MemRange[AB, cute.cosize(a_smem_staged)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[AB, cute.cosize(b_smem_staged)], 1024]

            st["SharedStorage"] = SharedStorage1

        kernel(
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            tma_atom_b2,
            tma_b2,
            tma_atom_d,
            tma_d,
            tma_atom_e1,
            tma_e1,
            tma_atom_e2,
            tma_e2,
            tma_atom_g,
            tma_g,
            tma_atom_u,
            tma_u,
            mD,
            mE1,
            mE2,
            mG,
            mU,
            mBias,
            mBias2,
            mRS,
            mOffs,
            alpha,
            beta,
            tiled_mma,
            cta_layout_mnk,
            a_smem_staged,
            b_smem_staged,
            epi_smem_staged,
        ).launch(
            grid=[num_ctas, 1, 1],
            block=[THREADS, 1, 1],
            cluster=[CM, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ---------------------------------------------------------- fake tensors (symbolic sizes)

    m, n, k = cute.sym_int(), cute.sym_int(), cute.sym_int()

    def sym16(dt):
        return cute.sym_int(divisibility=128 // dt.width)

    def dummy(dt):
        return cute.runtime.make_fake_compact_tensor(dt, (cute.sym_int(),), assumed_align=16)

    def rows(dt):  # a row-major [M, N] tensor
        return cute.runtime.make_fake_tensor(dt, (m, n), (sym16(dt), 1), assumed_align=16)

    if spec.a_major == "k":
        fa = cute.runtime.make_fake_tensor(AB, (m, k), (sym16(AB), 1), assumed_align=16)
    else:
        fa = cute.runtime.make_fake_tensor(AB, (m, k), (1, sym16(AB)), assumed_align=16)

    def fake_b(k=k):
        if GROUPED:
            gs = cute.sym_int()
            if spec.b_major == "k":
                return cute.runtime.make_fake_tensor(AB, (n, k, gs), (sym16(AB), 1, sym16(AB)), assumed_align=16)
            return cute.runtime.make_fake_tensor(AB, (n, k, gs), (1, sym16(AB), sym16(AB)), assumed_align=16)
        if spec.b_major == "k":
            return cute.runtime.make_fake_tensor(AB, (n, k), (sym16(AB), 1), assumed_align=16)
        return cute.runtime.make_fake_tensor(AB, (n, k), (1, sym16(AB)), assumed_align=16)

    fb = fake_b()
    fb2 = fake_b() if NB == 2 else fb
    if TAIL:  # b = the first K1 rows of K, b2 = the rest
        fb, fb2 = fake_b(cute.sym_int(divisibility=BK)), fake_b(cute.sym_int())
    fd = rows(OUT)
    fe1 = rows(AB) if (EPI == "dswiglu" or (EPI == "swiglu" and PREACT)) else dummy(AB)
    fe2 = rows(AB) if (EPI == "swiglu" and PREACT) else dummy(AB)
    fg = rows(AB) if EPI == "dswiglu" else dummy(AB)
    fu = rows(AB) if EPI == "dswiglu" else dummy(AB)
    if HAS_BIAS:
        bdt = types[spec.bias_dtype]
        fbias = cute.runtime.make_fake_compact_tensor(bdt, (n,), assumed_align=bdt.width // 8)
        fbias2 = cute.runtime.make_fake_compact_tensor(bdt, (n,), assumed_align=bdt.width // 8) if NB == 2 else dummy(bdt)
    else:
        fbias = dummy(AB)
        fbias2 = dummy(AB)
    if HAS_RS:
        rdt = types[spec.rs_dtype]
        frs = cute.runtime.make_fake_compact_tensor(rdt, (m,), assumed_align=rdt.width // 8)
    else:
        frs = dummy(Float32)
    if GROUPED:
        foffs = cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
    else:
        foffs = dummy(Int32)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    opts = f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}" + _EXTRA_COMPILE_OPTIONS
    with warnings.catch_warnings():
        # the epilogue loops over a thread's 64-128 accumulator elements are unrolled on purpose
        # (static indices keep the fragments in registers)
        warnings.filterwarnings("ignore", message="This static loop has", category=Warning)
        return cute.compile(
            host, fa, fb, fb2, fd, fe1, fe2, fg, fu, fbias, fbias2, frs, foffs,
            Float32(1.0), Float32(0.0), Int32(1), stream, options=opts,
        )


def get_compiled(spec: KernelSpec):
    """The launchable kernel for ``spec`` (compiled once, cached in memory and on disk)."""
    return kc.get_kernel("gemm_sm90", spec.key(), lambda: _build(spec), _SOURCES)


# ------------------------------------------------------------------ planning (no memory touched)


@dataclass
class _Plan:
    spec: KernelSpec
    m: int
    n: int
    groups: int
    a: torch.Tensor  # kernel views
    b: torch.Tensor
    b2: torch.Tensor | None
    num_sms: int


def _is_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    return x


def _fix_unit_stride(t: torch.Tensor, dim: int, value: int) -> torch.Tensor:
    """Give a size-1 dimension the stride ``value`` (its stride is never used; TMA wants it aligned)."""
    if t.shape[dim] != 1 or t.stride(dim) == value:
        return t
    stride = list(t.stride())
    stride[dim] = value
    return t.as_strided(t.shape, stride)


def _round8(x: int) -> int:
    return -(-x // 8) * 8


def _max_offset(t: torch.Tensor) -> int:
    return sum((sz - 1) * st for sz, st in zip(t.shape, t.stride()) if sz > 0)


def _check_extent(t: torch.Tensor, name: str) -> None:
    if t.numel() > _INT32_MAX or _max_offset(t) > _INT32_MAX:
        raise Unsupported(f"{name}: more than 2**31 - 1 elements (32-bit indexing)")
    if any(st < 0 for st in t.stride()):
        raise Unsupported(f"{name}: negative strides")


def _check_aligned(t: torch.Tensor, name: str) -> None:
    if t.data_ptr() % 16:
        raise Unsupported(f"{name}: data pointer not 16-byte aligned")


def _operand_major(t: torch.Tensor, name: str, inner: str, outer: str) -> tuple[torch.Tensor, str]:
    """A [rows, cols] matrix as the kernel reads it: ``(view, major)`` with major ``inner`` when its
    columns are contiguous (row-major) and ``outer`` when its rows are (column-major)."""
    rows, cols = t.shape[-2], t.shape[-1]
    if t.stride(-1) == 1 and (rows == 1 or t.stride(-2) % 8 == 0):
        return _fix_unit_stride(t, t.dim() - 2, _round8(cols)), inner
    if t.stride(-2) == 1 and (cols == 1 or t.stride(-1) % 8 == 0):
        return _fix_unit_stride(t, t.dim() - 1, _round8(rows)), outer
    raise Unsupported(
        f"{name}: strides {tuple(t.stride())} are neither row- nor column-major with a 16-byte-aligned leading dimension"
    )


def _row_major(t: torch.Tensor, name: str) -> torch.Tensor:
    """An [M, N] epilogue tensor: unit column stride and a 16-byte-aligned row stride."""
    per16 = 16 // t.element_size()
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise Unsupported(f"{name}: must be row-major (stride {tuple(t.stride())})")
    t = _fix_unit_stride(t, 1, 1)
    if t.shape[0] > 1 and t.stride(0) % per16:
        raise Unsupported(f"{name}: row stride {t.stride(0)} is not a multiple of 16 bytes")
    t = _fix_unit_stride(t, 0, -(-t.shape[1] // per16) * per16)
    _check_aligned(t, name)
    _check_extent(t, name)
    return t


def _check_vector(v, name: str, length: int, device, dtypes) -> torch.Tensor:
    v = _is_tensor(v, name)
    if v.dim() != 1 or v.shape[0] != length:
        raise ValueError(f"{name}: expected shape [{length}], got {list(v.shape)}")
    if v.device != device:
        raise ValueError(f"{name}: on {v.device}, expected {device}")
    if v.dtype not in dtypes:
        raise Unsupported(f"{name}: dtype {v.dtype} (kernel serves {', '.join(map(str, dtypes))})")
    if v.shape[0] > 1 and v.stride(0) != 1:
        raise Unsupported(f"{name}: must be contiguous")
    return _fix_unit_stride(v, 0, 1)


def _check_device(device: torch.device) -> int:
    if device.type != "cuda":
        raise Unsupported("no GPU" if not torch.cuda.is_available() else f"tensors on {device}, not a CUDA device")
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        raise Unsupported(f"sm_{cap[0]}{cap[1]} is not SM90")
    return kc.num_sms(device)


def _plan(
    a,
    b,
    b2,
    *,
    epilogue: str,
    out=None,
    out_dtype=None,
    bias=None,
    bias2=None,
    row_scale=None,
    beta: float = 0.0,
    gate=None,
    up=None,
    store_preact: bool = False,
    group_offsets=None,
    b_tail=None,
    _device_check: bool = True,
    _num_sms: int = 132,
) -> _Plan:
    """Validate the arguments (ValueError), decide whether the kernel serves them (Unsupported)
    and pick the kernel. Touches no memory: no allocation, no launch."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue: expected one of {EPILOGUES}, got {epilogue!r}")
    a = _is_tensor(a, "a")
    b = _is_tensor(b, "b")
    grouped = group_offsets is not None
    if a.dim() != 2:
        raise ValueError(f"a: expected a 2-D tensor [M, K], got shape {list(a.shape)}")
    m, k = a.shape
    bname = "b_gate" if epilogue == "swiglu" else "b"
    if grouped:
        if b.dim() != 3 or b.shape[1] != k:
            raise ValueError(f"{bname}: expected [G, K={k}, N] for a grouped GEMM, got {list(b.shape)}")
        groups = b.shape[0]
        offs = _is_tensor(group_offsets, "group_offsets")
        if offs.dim() != 1 or offs.shape[0] != groups + 1:
            raise ValueError(f"group_offsets: expected shape [G + 1 = {groups + 1}], got {list(offs.shape)}")
        if offs.dtype != torch.int32:
            raise ValueError(f"group_offsets: expected int32, got {offs.dtype}")
        if groups < 1:
            raise ValueError("b: a grouped GEMM needs at least one group")
    else:
        k_head = k
        if b_tail is not None:
            b_tail = _is_tensor(b_tail, "b_tail")
            if b_tail.dim() != 2 or b.dim() != 2 or b_tail.shape[1] != b.shape[1] or b.shape[0] + b_tail.shape[0] != k:
                raise ValueError(f"b, b_tail: expected [K1, N] and [K2, N] with K1 + K2 = K={k}, got "
                                 f"{list(b.shape)} and {list(b_tail.shape)}")
            k_head = b.shape[0]
        if b.dim() != 2 or b.shape[0] != k_head:
            raise ValueError(f"{bname}: expected [K={k}, N], got {list(b.shape)}")
        groups = 1
    n = b.shape[-1]
    dev = a.device
    tensors = {bname: b}
    if b_tail is not None:
        if epilogue != "none":
            raise ValueError(f"b_tail: only the plain epilogue takes it (got {epilogue!r})")
        if grouped:
            raise ValueError("b_tail: not with group_offsets")
        tensors["b_tail"] = b_tail
    if epilogue == "swiglu":
        b2 = _is_tensor(b2, "b_up")
        if b2.shape != b.shape:
            raise ValueError(f"b_up: expected the shape of b_gate {list(b.shape)}, got {list(b2.shape)}")
        tensors["b_up"] = b2
    if epilogue == "dswiglu":
        for nm, t in (("gate", gate), ("up", up)):
            t = _is_tensor(t, nm)
            if t.shape != (m, n):
                raise ValueError(f"{nm}: expected shape [{m}, {n}], got {list(t.shape)}")
            tensors[nm] = t
    if grouped:
        tensors["group_offsets"] = group_offsets
    for nm, t in tensors.items():
        if t.device != dev:
            raise ValueError(f"{nm}: on {t.device}, expected a's device {dev}")
        if nm != "group_offsets" and t.dtype != a.dtype:
            raise ValueError(f"{nm}: dtype {t.dtype} differs from a's {a.dtype}")
    if out is not None:
        out = _is_tensor(out, "out")
        if out.shape != (m, n):
            raise ValueError(f"out: expected shape [{m}, {n}], got {list(out.shape)}")
        if out.device != dev:
            raise ValueError(f"out: on {out.device}, expected {dev}")
        if out_dtype is not None and out_dtype != out.dtype:
            raise ValueError(f"out_dtype: {out_dtype} contradicts out.dtype {out.dtype}")
        out_dtype = out.dtype
    if out_dtype is None:
        out_dtype = a.dtype
    if beta != 0.0 and out is None:
        raise ValueError("beta: accumulating (beta != 0) needs out=")
    if bias is not None:
        bias = _check_vector(bias, "bias_gate" if epilogue == "swiglu" else "bias", n, dev, (a.dtype, torch.float32))
    if bias2 is not None:
        bias2 = _check_vector(bias2, "bias_up", n, dev, (a.dtype, torch.float32))
    if epilogue == "swiglu" and (bias is None) != (bias2 is None):
        raise ValueError("bias_gate, bias_up: give both or neither")
    if bias is not None and bias2 is not None and bias.dtype != bias2.dtype:
        raise ValueError(f"bias_up: dtype {bias2.dtype} differs from bias_gate's {bias.dtype}")
    if row_scale is not None:
        row_scale = _check_vector(row_scale, "row_scale", m, dev, (torch.float32, a.dtype))

    # ---- what the kernel serves
    if a.dtype not in _AB_DTYPES:
        raise Unsupported(f"dtype {a.dtype} (kernel serves bfloat16 and float16)")
    if out_dtype not in (a.dtype, torch.float32):
        raise Unsupported(f"output dtype {out_dtype} (kernel writes {a.dtype} or float32)")
    if epilogue != "none" and out_dtype != a.dtype:
        raise Unsupported(f"{epilogue} epilogue writes {a.dtype} only")
    num_sms = _check_device(dev) if _device_check else _num_sms
    if k == 0:
        raise Unsupported("K == 0")
    if k % 8:
        raise Unsupported(f"K={k} is not a multiple of 8")
    if n % 8:
        raise Unsupported(f"N={n} is not a multiple of 8")
    av, a_major = _operand_major(a, "a", "k", "m")
    _check_aligned(av, "a")
    _check_extent(av, "a")
    # b is [K, N] (or [G, K, N]); the kernel reads it as [N, K]: K contiguous -> "k", N contiguous -> "n"
    bviews = []
    b_major = None
    if b_tail is not None and b.shape[0] % BK:
        raise Unsupported(f"b_tail: b's K={b.shape[0]} is not a multiple of {BK} (a k-block would span both)")
    for nm in [bname] + (["b_up"] if epilogue == "swiglu" else []) + (["b_tail"] if b_tail is not None else []):
        t = tensors[nm]
        bt = t.transpose(-1, -2)
        v, major = _operand_major(bt, nm, "k", "n")
        if b_major is not None and major != b_major:
            raise Unsupported(f"{bname} and {nm} have different major orders")
        b_major = major
        if grouped:
            if groups > 1 and v.stride(0) % 8:
                raise Unsupported(f"{nm}: group stride {v.stride(0)} is not a multiple of 16 bytes")
            v = _fix_unit_stride(v, 0, _round8(max(1, _max_offset(v[0]) + 1)))
            v = v.permute(1, 2, 0)  # [N, K, G]
        _check_aligned(v, nm)
        _check_extent(v, nm)
        bviews.append(v)
    if out is not None:
        _row_major(out, "out")
    for nm in ("gate", "up"):
        if nm in tensors:
            _row_major(tensors[nm], nm)
    if grouped and group_offsets.shape[0] > 1 and group_offsets.stride(0) != 1:
        raise Unsupported("group_offsets: must be contiguous")
    if m * max(n, 1) > _INT32_MAX:
        raise Unsupported("output has more than 2**31 - 1 elements (32-bit indexing)")

    wide = out_dtype == torch.float32 or beta != 0.0
    # outputs through shared memory and TMA stores: dense GEMMs with 16-bit outputs that are only
    # written (a group boundary can fall inside a tile, which a TMA store cannot stop at)
    tma_store = not grouped and not wide
    bn, cluster_m, stages = choose_config(m, n, epilogue, grouped, wide, num_sms, groups, tma_store)
    spec = KernelSpec(
        ab_dtype=_tname(a.dtype),
        out_dtype=_tname(out_dtype),
        a_major=a_major,
        b_major=b_major,
        epilogue=epilogue,
        grouped=grouped,
        bias_dtype=_tname(bias.dtype) if bias is not None else "",
        rs_dtype=_tname(row_scale.dtype) if row_scale is not None else "",
        has_beta=beta != 0.0,
        store_preact=bool(store_preact) and epilogue == "swiglu",
        bn=bn,
        cluster_m=cluster_m,
        stages=stages,
        b_tail=b_tail is not None,
        tma_store=tma_store,
        epi_tma_load=_epi_tma_load_serves(epilogue, tma_store, bn),
    )
    if _CONFIG_OVERRIDE:
        over = dict(_CONFIG_OVERRIDE)
        if over.get("tma_store") and not tma_store:  # the direct epilogue is the only one this call has
            del over["tma_store"]
        if "tma_store" in over and "bn" not in over:  # the tile the heuristic picks for that epilogue
            over["bn"] = choose_config(m, n, epilogue, grouped, wide, num_sms, groups, over["tma_store"])[0]
        if ("bn" in over or "tma_store" in over) and "stages" not in over:  # as many stages as fit the new tile
            over["stages"] = _max_stages(over.get("bn", bn), epilogue, over.get("tma_store", tma_store))
        spec = dataclasses.replace(spec, **over)
        if spec.epi_tma_load and not _epi_tma_load_serves(epilogue, spec.tma_store, spec.bn):
            spec = dataclasses.replace(spec, epi_tma_load=False)
    over = _CONFIG_OVERRIDE or {}
    if over.get("epi_wg", EPI_WG_DEFAULT) and spec.tma_store and _epi_wg_serves(epilogue, tma_store, spec.bn):
        spec = _with_epi_wg(spec, over.get("stages"))  # with the stages that fit beside the dh tile
    else:
        spec = dataclasses.replace(spec, epi_wg=False)
    return _Plan(spec, m, n, groups, av, bviews[0], bviews[1] if len(bviews) > 1 else None, num_sms)


def _with_epi_wg(spec: KernelSpec, stages: int | None = None) -> KernelSpec:
    """``spec`` with dSwiGLU's epilogue on the producer warp group's idle warps: no store ring, as many stages as
    fit beside the dh tile (``stages``, a sweep's override, at most that many)."""
    fit = _max_stages(spec.bn, spec.epilogue, False, True)
    return dataclasses.replace(spec, epi_wg=True, tma_store=False, epi_tma_load=False,
                               stages=min(stages, fit) if stages else fit)


# ------------------------------------------------------------------ launch

_dummy_cache: dict[tuple, torch.Tensor] = {}


def _dummy(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (device, dtype)
    t = _dummy_cache.get(key)
    if t is None:
        t = torch.zeros(16, device=device, dtype=dtype)
        _dummy_cache[key] = t
    return t


_cluster_cap: dict[tuple, int] = {}


def _max_clusters(device: torch.device, cm: int, num_sms: int) -> int:
    """How many cm-CTA clusters of a 1-CTA-per-SM kernel are resident at once (GPCs may leave SMs
    unpaired, so this can be below #SMs / cm); a persistent grid must not exceed it. Asked once per
    device from ``cuOccupancyMaxActiveClusters``; #SMs // cm if that query fails."""
    if cm == 1:
        return num_sms
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = (idx, cm)
    cap = _cluster_cap.get(key)
    if cap is None:
        cap = num_sms // cm
        try:
            kc.import_cute()
            from cutlass.utils import HardwareInfo

            with torch.cuda.device(idx):
                cap = max(1, min(cap, int(HardwareInfo(idx).get_max_active_clusters(cm))))
        except Exception:  # noqa: BLE001 - the conservative default stays correct
            pass
        _cluster_cap[key] = cap
    return cap


def _num_ctas(plan: _Plan) -> int:
    spec = plan.spec
    n_tiles = -(-plan.n // spec.bn)
    m_tiles = -(-plan.m // BM)
    if spec.grouped:
        # each group may end in a partial tile, and with a column-major A also start in one (its first
        # tile starts at a row rounded down to a multiple of 8)
        per_group = 2 if spec.a_major == "m" else 1
        return max(1, min(plan.num_sms, (m_tiles + per_group * plan.groups) * n_tiles))
    cm = spec.cluster_m
    clusters = -(-m_tiles // cm) * n_tiles
    return max(1, min(clusters, _max_clusters(plan.a.device, cm, plan.num_sms))) * cm


def _run(plan: _Plan, d, e1=None, e2=None, gate=None, up=None, bias=None, bias2=None, row_scale=None, offs=None,
         alpha: float = 1.0, beta: float = 0.0) -> None:
    spec = plan.spec
    dev = plan.a.device
    ab = plan.a.dtype
    fn = get_compiled(spec)
    dz = _dummy(dev, ab)
    d = _row_major(d, "out")
    args = (
        plan.a,
        plan.b,
        plan.b2 if plan.b2 is not None else plan.b,
        d,
        _row_major(e1, "e1") if e1 is not None else dz,
        _row_major(e2, "e2") if e2 is not None else dz,
        _row_major(gate, "gate") if gate is not None else dz,
        _row_major(up, "up") if up is not None else dz,
        _fix_unit_stride(bias, 0, 1) if bias is not None else dz,
        _fix_unit_stride(bias2, 0, 1) if bias2 is not None else _dummy(dev, getattr(torch, spec.bias_dtype or plan.spec.ab_dtype)),
        _fix_unit_stride(row_scale, 0, 1) if row_scale is not None else _dummy(dev, torch.float32),
        offs if offs is not None else _dummy(dev, torch.int32),
        float(alpha),
        float(beta),
        _num_ctas(plan),
    )
    with torch.cuda.device(dev):
        fn(*args)


def can_implement(a, b, *, epilogue: str = "none", b_up=None, out=None, out_dtype=None, bias=None, bias_up=None,
                  row_scale=None, beta: float = 0.0, gate=None, up=None, store_preact: bool = False,
                  group_offsets=None, b_tail=None) -> None:
    """Raise ``Unsupported(reason)`` if the kernel does not serve this call (``ValueError`` if it is
    malformed); return None if it does. Touches no memory. ``b`` is ``b_gate`` for ``epilogue="swiglu"``."""
    _plan(a, b, b_up, epilogue=epilogue, out=out, out_dtype=out_dtype, bias=bias, bias2=bias_up, row_scale=row_scale,
          beta=beta, gate=gate, up=up, store_preact=store_preact, group_offsets=group_offsets, b_tail=b_tail)


def gemm(a, b, *, out=None, bias=None, alpha: float = 1.0, beta: float = 0.0, row_scale=None, out_dtype=None,
         group_offsets=None, b_tail=None) -> torch.Tensor:
    """``row_scale[:, None] * (alpha * (a @ b) + bias) + beta * out`` (see the module docstring);
    with ``b_tail``, ``b`` stands for ``cat([b, b_tail])``."""
    plan = _plan(a, b, None, epilogue="none", out=out, out_dtype=out_dtype, bias=bias, row_scale=row_scale, beta=beta,
                 group_offsets=group_offsets, b_tail=b_tail)
    if out is None:
        out = torch.empty((plan.m, plan.n), device=a.device, dtype=getattr(torch, plan.spec.out_dtype))
    if plan.m == 0 or plan.n == 0:
        return out
    _run(plan, out, bias=bias, row_scale=row_scale, offs=group_offsets, alpha=alpha, beta=beta)
    return out


def grouped_gemm(a, b, group_offsets, **kwargs) -> torch.Tensor:
    """``gemm(a, b, group_offsets=group_offsets, **kwargs)``: ``b`` is ``[G, K, N]``."""
    return gemm(a, b, group_offsets=group_offsets, **kwargs)


def _given_out(t, name: str, plan: _Plan, dtype: torch.dtype):
    """A caller-provided [M, N] output buffer (checked), or a new one."""
    if t is None:
        return torch.empty((plan.m, plan.n), device=plan.a.device, dtype=dtype)
    t = _is_tensor(t, name)
    if t.shape != (plan.m, plan.n) or t.dtype != dtype or t.device != plan.a.device:
        raise ValueError(f"{name}: expected a {dtype} tensor of shape [{plan.m}, {plan.n}] on {plan.a.device}, "
                         f"got {t.dtype} {list(t.shape)} on {t.device}")
    _row_major(t, name)
    return t


def gemm_swiglu(a, b_gate, b_up, *, bias_gate=None, bias_up=None, row_scale=None, store_preact: bool = False,
                out=None, out_gate=None, out_up=None, group_offsets=None):
    """``h = silu(a @ b_gate + bias_gate) * (a @ b_up + bias_up) * row_scale[:, None]``; with
    ``store_preact=True`` returns ``(h, gate, up)`` (the pre-activations, bias included, before
    row_scale). ``out``, ``out_gate``, ``out_up``: optional preallocated outputs."""
    plan = _plan(a, b_gate, b_up, epilogue="swiglu", out=out, bias=bias_gate, bias2=bias_up, row_scale=row_scale,
                 store_preact=store_preact, group_offsets=group_offsets)
    h = _given_out(out, "out", plan, a.dtype)
    gate = _given_out(out_gate, "out_gate", plan, a.dtype) if store_preact else None
    up = _given_out(out_up, "out_up", plan, a.dtype) if store_preact else None
    if plan.m > 0 and plan.n > 0:
        _run(plan, h, e1=gate, e2=up, bias=bias_gate, bias2=bias_up, row_scale=row_scale, offs=group_offsets)
    return (h, gate, up) if store_preact else h


def gemm_dswiglu(a, b, gate, up, *, row_scale=None, out_dgate=None, out_dup=None, group_offsets=None):
    """``dh = (a @ b) * row_scale[:, None]``; returns ``(dgate, dup)`` =
    ``(dh * up * silu'(gate), dh * silu(gate))``. ``out_dgate``, ``out_dup``: optional preallocated
    outputs; they must not overlap ``gate`` or ``up``."""
    plan = _plan(a, b, None, epilogue="dswiglu", row_scale=row_scale, gate=gate, up=up, group_offsets=group_offsets)
    dgate = _given_out(out_dgate, "out_dgate", plan, a.dtype)
    dup = _given_out(out_dup, "out_dup", plan, a.dtype)
    if plan.m > 0 and plan.n > 0:
        _run(plan, dgate, e1=dup, gate=gate, up=up, row_scale=row_scale, offs=group_offsets)
    return dgate, dup

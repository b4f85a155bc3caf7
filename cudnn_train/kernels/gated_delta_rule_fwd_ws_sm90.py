"""The GDN forward's state pass on two specialized warpgroups (SM90, CuTeDSL, WGMMA).

Same math, same rounding points and the same notation as ``gated_delta_rule_fwd_sm90``'s fused
``state`` kernel (kernel 2 there); one CTA per (sequence, value head, VB = 64 columns of V; 128: below),
256 threads:

* warpgroup 0, the **chain**, carries the state ``S^T [v, d]`` (VB x K, float32 accumulators) over
  the chunks and does only what the next chunk needs, exactly as the fused kernel does it::

      S^T (input dtype) -> registers (A operand) and smem sS[c % 2] (for warpgroup 1)
      vn^T = u^T - S^T w^T                  -> smem sVo[c % 2], input dtype (for warpgroup 1)
      S^T  = exp(gc_C) S^T + (vn^T diag(exp(gc_C - gc) rk)) k

* warpgroup 1, the **output**, computes the chunk's o from what the chain left in shared memory,
  in the split pass's ``out`` orientation (``o [i, v]``, rows of o stored as element pairs)::

      o = scale exp(gc_i) rq_i (q S) + tril(scale q k^T exp(gc_i - gc_j) rq_i rk_j) vn

  ``q S`` and ``q k^T`` need only the chunk-start state, so they run in the chain's iteration;
  ``P vn`` waits for vn and runs in the next one, overlapped with that chunk's first products.

One CTA barrier an iteration (``bar.sync 1, 256``) hands everything over: by then every thread has
waited for its ``cp.async`` copies of chunk c, the chain has written S_c to sS and vn_{c-1} to
sVo, and both warpgroups are done with the buffers the next copies overwrite (q, k, w, u, gc of
chunk c + 1 go into the other of two buffers, issued by all 256 threads right after the barrier).
Everything else is private to a warpgroup (its own named barrier; each computes the l2norm
factors it needs). The chain's critical path per chunk is two WGMMA groups and the conversions
between them; the output's products and P, its exp2s and o's stores, which the fused kernel runs on
the same warpgroup in series with the chain, run beside it.

Loads: by default where K == V (since the sixteenth session; ``CUDNN_TRAIN_GDN_FWD_WS_TMA=0`` gives the
``cp.async`` loads back: all 256 threads, issued after each warpgroup's first product group, whose issue stalls
while the load queues are full; ``=1`` takes TMA at K != V too) q, k, w and u's columns by TMA, issued
by the output warpgroup's first warp (one elected thread arms the buffer's mbarrier with the bytes; every
thread waits on it before the CTA barrier), gc still by ``cp.async`` (its rows are HV floats apart, under
TMA's 16-byte minimum); u then sits in a swizzled tile. Rows past a varlen sequence's end then hold the
next sequence's tokens (or, past the last sequence, whatever the tensor holds) where ``cp.async`` zero-fills
them, so the chain zeroes those rows of vn by a select and every thread zeroes k's tail rows in shared memory
after the tile lands (the state update meets them with zero vn columns, and 0 x NaN is NaN): the same bits as
the ``cp.async`` loads.

``CUDNN_TRAIN_GDN_FWD_WS_VB=auto`` (the default since the sixteenth session; ``64`` or ``128`` force either):
where 2 N HV CTAs of 64 columns exceed the SMs (not for the training forward's call: slower there), all 128
columns of V in one CTA, half the CTAs (at B4 T4096 HV32 128 CTAs, one wave on 132 SMs, where 64
columns make 256 in two). The chain's S^T [128, K] then takes 128 accumulator registers a thread, so its first
product reads S^T from the sS tile (written and fenced before the CTA barrier anyway) instead of a register
copy; u sits in a swizzled tile (the padded one would not fit). Same values, same operations: o and the
states are bitwise those of 64 columns. ptxas: 255 registers, 8-24 bytes spilled. With the TMA loads it
combines with the two output warpgroups (no spill; measured slower there, so not by default), not with those
and ``onfly`` together. H200, B4 T4096 H16 HV32, the state pass alone (sixteenth session): 64 columns with
``cp.async`` 0.429 ms, with TMA 0.426, TMA and two output warpgroups 0.417; 128 columns 0.353, **with TMA
0.313**, TMA and two output warpgroups 0.330. At B1 T16384 (64 CTAs, so 64 columns under auto) 0.855, 0.853,
**0.824**; 128 columns there 1.19 with TMA.

Cost: about 164 KB of shared memory (two buffers of q, k, w, u; two of sS, sVo), one CTA an SM; at 128
columns 225 KB. Numerics: the state and the final state are the fused kernel's bit for bit (the chain's
instructions are its instructions); o's two products have the operand roles swapped (``q S`` with
the state tile as the B operand, where the fused kernel computes ``S^T q^T``).

Status: the inference forward's default state pass wherever it would take the fused kernel (GPU-run since the
thirteenth session: B4 T4096 0.432 ms against 0.474); ``CUDNN_TRAIN_GDN_FWD_WS=1`` also for the training
forward (``store_states``, with ``keep_vn``) where the grid fills the GPU: then warpgroup 1 also writes the
chunk-start states (the rows of sS) and vn (the rows of sVo) as 16-byte vectors while its products run. The
TMA loads (on where K == V), the two output warpgroups (on at 64 columns where K == V), the 128-column CTAs
(auto) and w and u formed in the chain (``onfly``; timed in the seventeenth session, on by default where one CTA
holds all 128 columns of V: ``gated_delta_rule_fwd_sm90.onfly_default``) ran on the GPU in the sixteenth
session; every case bitwise. A review (fourteenth session) found and fixed, before any run: the
onfly chain's beta never loaded with TMA; the two output warpgroups' setmaxnreg asking more registers than
the CTA holds (240 + 2 x 136 = 512 a lane against 3 x 168: a hang); k's tail rows past the last sequence
reaching the state update with TMA.
"""

import os

import torch

from . import compile as kc
from . import gated_delta_rule_common_sm90 as cm
from . import gated_delta_rule_fwd_sm90 as F

CHUNK = cm.CHUNK
VB = F.VBLOCK  # V columns per CTA (the default; 128 with v_block below)
THREADS = 256
BAR_ITER = 1  # the whole CTA, once an iteration
BAR_CHAIN = 2  # warpgroup 0
BAR_OUT = 3  # warpgroup 1
BAR_RK = 5  # (kshare) the chain's k factors written (its 128 threads arrive), the output's read (its 128 sync)
_SOURCES = (__file__, F.__file__, cm.__file__)
# q, k, w, u by TMA (CUDNN_TRAIN_GDN_FWD_WS_TMA): one thread issues a chunk's tiles, so neither warpgroup stalls
# issuing cp.async (half the chain's cycles in the thirteenth session's profile). GPU-run in the sixteenth session:
# bitwise the cp.async loads, 0.426 vs 0.429 ms at 64 columns, 0.313 vs 0.353 at 128. Unset (None): on where its
# GPU cases ran, K == V (128 and 64); 1 / 0: always / never. (K = 128 with V = 64 has its cases prepared, not yet
# run: gpu_next.sh s29.)
TMA = cm.env_switch("CUDNN_TRAIN_GDN_FWD_WS_TMA", None)
# With the TMA loads, two output warpgroups taking alternate chunks (CUDNN_TRAIN_GDN_FWD_WS_WG3; 384 threads,
# setmaxnreg 240 / 136): the output's 20 product units a chunk were the longer half once the chain stops stalling
# on copies. Measured faster at 64 columns a CTA (B4 T4096 H16 HV32 0.417 vs 0.426 ms; B1 T16384, where the split
# pass serves the forward, 0.824 vs 0.853), slower at 128 (0.330 vs 0.313). Unset (None): at 64 columns where K == V
# (the GPU-run cases); 1: wherever it can serve (with TMA, not the training forward, not with 128 columns and w, u
# formed in the chain); 0: never.
WG3 = cm.env_switch("CUDNN_TRAIN_GDN_FWD_WS_WG3", None)
# All 128 columns of V in one CTA (CUDNN_TRAIN_GDN_FWD_WS_VB=128, or auto: 128 where V/64 CTAs a (sequence, value
# head) would not all be resident at once, i.e. 2 N HV > SMs). The kernel is latency-bound (about 6.2K cycles a
# chunk against about 1.1K of products) and, at 164 KB of shared memory, one CTA an SM: at B4 T4096 HV32 its 256
# CTAs run in two waves on 132 SMs. With VB = 128 they are 128, one wave, each doing twice the products per chunk
# on the same dependent chain; the chain's S^T is then its A operand from the sS tile (128 float32 accumulator
# registers a thread for the state leave no room for a register copy), u sits in a swizzled tile (the padded one
# would not fit: 227.3 KB). GPU-run in the sixteenth session: auto by default (128 at B4 HV32: 0.313 ms against
# 0.417 for 64 columns, both with TMA; 64 at B1, where 128 columns leave 100 SMs idle: 1.19 against 0.82).
VB_MODE = os.environ.get("CUDNN_TRAIN_GDN_FWD_WS_VB", "").strip() or "auto"
if VB_MODE not in ("64", "128", "auto"):
    raise ValueError(f"CUDNN_TRAIN_GDN_FWD_WS_VB={VB_MODE!r}: expected 64, 128 or auto")
SMEM_BYTES = 227 * 1024  # an SM90 CTA's shared memory at most
# The training forward's stores by TMA from tiles the chain writes transposed (CUDNN_TRAIN_GDN_FWD_WS_TSTORE,
# twenty-ninth session, the default since the thirty-first: its cases, the GDN kernel tiers and the training tier's
# kernel half GPU-run with it; the training forward at B4 T4096 H16 HV32 0.633 against 0.689 ms H200, 0.685 against
# 0.840 H100; the op's forward+backward 3.7-9.1% faster at B1, B4, B8, H100, thirty-second session): with
# ``store_states`` the chain writes the chunk-start state
# as S [d, v] and vn as vn [i, v] (v contiguous, by transposed ``stmatrix`` from its accumulators, the reverse
# sweep's dH pattern) instead of S^T [v, d] and vn^T [v, i]; the output warpgroup and the chain's own first product
# at 128 columns read them as MN-major operands (the same products on the same values), and each leaves by one TMA
# store from the tile it is already in (a partial chunk's vn rows by 16-byte vectors from the same tile), where
# the output warpgroup now gathers every 16-byte row element by element out of the transposed tiles. Measured
# before it (H100, B4 T4096 H16 HV32, whole forward): the training forward on this pass at 64 columns 0.99 ms
# against 0.69 for the inference forward on it (the stores' 0.30 ms), and the inference forward at 128 columns
# 0.58 against the training forward's split pass 0.83. With it the training forward may take 128 columns (no
# more shared memory: the same tiles). Unset or 1: on (with store_states); 0: off (the split pass's stores).
TSTORE = cm.env_switch("CUDNN_TRAIN_GDN_FWD_WS_TSTORE", True)
# The inference forward on the same transposed tiles (CUDNN_TRAIN_GDN_FWD_WS_TLAYOUT, thirty-fourth session; the
# default since its GPU run): the chain writes the chunk-start state and vn by transposed stmatrix into S [d, v] / vn [i, v]
# tiles, read as MN-major operands, as TSTORE does for the training forward, without its stores. The inference kernel
# (128 columns, w and u formed in the chain) writes S^T [v, d] and vn^T [v, i] by 4-byte stores instead: 64 + 32 of
# them a thread and chunk with their swizzled addresses, about 420 and 130 of the chain's about 2,660 SASS
# instructions a chunk (nvdisasm on the sm_90a cubin), where 16 + 8 stmatrix do it. The same products on the same
# values: o and the final state bitwise (GPU cases passed, H100). Measured (H100, B4 T4096 H16 HV32, the inference
# forward as the op calls it, two alternating rounds): 0.556 / 0.533 ms off, 0.523 / 0.501 with it, 0.476 / 0.476
# with ULDM too. Unset or 1: on (inference only); 0: off.
TLAYOUT = cm.env_switch("CUDNN_TRAIN_GDN_FWD_WS_TLAYOUT", True)
# The chain's u^T (w and u formed in the chain: v^T) by transposed ldmatrix (CUDNN_TRAIN_GDN_FWD_WS_ULDM, thirty-fourth
# session; the default since its GPU run): vn^T = u^T - S^T w^T (or R^T) read u^T element by element, a 2-byte
# shared load with its swizzled address an element (64 a thread and chunk at 128 columns: the R phase's 88 LDS, 90
# LOP3 and 68 SHF of about 650 SASS instructions); 8 ldmatrix.x4.trans load the same values into the accumulator's
# layout. Wherever u's tile is swizzled (TMA loads or 128 columns), training and inference; the same bits (GPU cases
# passed). H100, B4 T4096: the inference forward 0.556 / 0.533 -> 0.510 / 0.494 ms alone, 0.476 / 0.476 with TLAYOUT;
# the training forward 0.685 / 0.690 -> 0.681 / 0.679 (its output warpgroup is the longer one there). Unset or 1: on;
# 0: off.
ULDM = cm.env_switch("CUDNN_TRAIN_GDN_FWD_WS_ULDM", True)
# o by TMA stores (CUDNN_TRAIN_GDN_FWD_WS_OTMA, prepared in the thirty-fourth session, the default since its GPU run
# in the thirty-fifth): the output warpgroup stored a chunk's o [64, VB] from its accumulators as 4-byte pairs, 32 a
# thread (the profile's "o stores", 2.3K of its 9.4K cycles a chunk at B4 T4096, H100, where it is the longer
# warpgroup of the training forward); with the switch a full chunk's o goes by stmatrix into the q tile of the
# chunk's buffer (free by then) and one TMA store. With the TMA loads, K == VB, one output warpgroup; training and
# inference. The same values (GPU cases: o bitwise). H100, B4 T4096: the training forward 0.678 / 0.677 -> 0.641 /
# 0.642 ms, the inference forward unchanged (0.482 / 0.477 -> 0.485 / 0.475). Unset or 1: on; 0: off.
OTMA = cm.env_switch("CUDNN_TRAIN_GDN_FWD_WS_OTMA", True)
# The output warpgroup on the chain's k factors (CUDNN_TRAIN_GDN_FWD_WS_KSHARE, thirty-fourth session; the default
# since the thirty-sixth): both warpgroups computed the l2norm factors of each chunk's k rows (the same helper on the
# same tile); with the switch the output takes the chain's (one named barrier: the chain arrives once written, the
# output syncs before P), about 260 of its 1,800 SASS instructions a chunk in the training forward. With the l2norm
# and one output warpgroup; the same values: o bitwise. H100, B4 T4096, OTMA off (thirty-fifth session): training
# 0.676 / 0.674 -> 0.680 / 0.678 ms, no gain. H200 over OTMA (thirty-sixth): inference 0.485 / 0.488 -> 0.456 /
# 0.457, training 0.572 / 0.572 -> 0.554 / 0.554; with CLOADS on too: inference 0.470 / 0.474 -> 0.453 / 0.457,
# training 0.551 / 0.554 -> 0.540 / 0.540 (bitwise in each). Unset or 1: on; 0: off.
KSHARE = cm.env_switch("CUDNN_TRAIN_GDN_FWD_WS_KSHARE", True)
# The next chunk's TMA loads issued by the chain's first warp (CUDNN_TRAIN_GDN_FWD_WS_CLOADS, thirty-fifth session;
# the default since the thirty-sixth) instead of the output warpgroup's store warp: in the training forward the output
# warpgroup is the longer one (the chain waits 2.6K of its 10.35K cycles a chunk at the barrier, B4 T4096, H100) and
# its "products issued, next chunk's copies" phase takes 3.5K cycles against 1.9K in inference; the loads go to
# buffers whose last readers (and, with the TMA stores, whose stores' reads: the store warp waits for them before
# the barrier) are past the iteration's CTA barrier, after which the chain issues them. The same data in the same
# tiles: the same bits (GPU cases). With the TMA loads. H200, B4 T4096: inference 0.485 / 0.488 -> 0.472 / 0.476 ms,
# training 0.571 / 0.575 -> 0.554 / 0.556. Unset or 1: on; 0: off.
CLOADS = cm.env_switch("CUDNN_TRAIN_GDN_FWD_WS_CLOADS", True)


def v_block(V: int, nseq: int, HV: int, device, store_states: bool = False, tstore: bool = False) -> int:
    """The specialized warpgroups' V columns per CTA: 64, or 128 (V = 128 only) as ``CUDNN_TRAIN_GDN_FWD_WS_VB``
    asks (auto: where 2 N HV CTAs of 64 columns exceed the SMs, and not for the training forward's call with its
    stores gathered out of the transposed tiles, which measured slower at 128: 1.30 against 0.98 ms at B4 T4096 H16
    HV32, sixteenth session; with ``tstore``, the stores by TMA, as for inference)."""
    if V != 128 or VB_MODE == "64" or (VB_MODE == "auto" and store_states and not tstore):
        return 64
    if VB_MODE == "128":
        return 128
    return 128 if 2 * nseq * HV > kc.num_sms(device) else 64


def segments(nseq: int, HV: int, V: int, T: int, l2norm: bool, device) -> int:
    """The inference forward's specialized-warpgroup CTAs a (sequence, value head, V block), each writing o for one
    segment of the sequence's chunks after a decay-truncated warm-up (see ``_build``). ``CUDNN_TRAIN_GDN_FWD_WS_SEG``:
    unset or 1, one (the default: see :func:`cm.segments` for why); ``auto``, the fewest of 2, 4, 8, 16
    whose grid of 128-column CTAs reaches 90% of the SMs, keeping segments of at least 16 chunks (B1 T16384 H16
    HV32: 4, B4 T4096's grid, where this kernel takes 0.389 ms on an H100 with w, u formed in its chain, against
    the split pass's 0.66 at B1); 2 to 16 force that many (:func:`cm.segments`). Without l2norm, one."""
    return cm.segments("CUDNN_TRAIN_GDN_FWD_WS_SEG", nseq, HV * max(V // 128, 1), T, l2norm, device, fill=0.9)


# Phases timed by the profile variant (``tools/time_gdn_fwd.py --ws-only --profile``), per warpgroup
WS_PHASES = (
    ("S -> registers + sS", "loads wait + CTA barrier", "S w^T issued, next chunk's copies", "k norms, S w^T wait",
     "vn, sVo, scaled vn, decay", "state update"),
    ("(none)", "loads wait + CTA barrier", "products issued, next chunk's copies", "norms, stores, products wait",
     "o stores", "P, o scaling"),
)


def _build(dtype, K: int, V: int, l2norm: bool, varlen: bool, has_h0: bool, out_final: bool, state_vk: bool,
           store_states: bool, keep_vn: bool, profile: bool = False, tma: bool = False, onfly: bool = False,
           wg3: bool = False, vb: int = VB, nseg: int = 1, tstore: bool = False, tlayout: bool = False,
           uldm: bool = False, otma: bool = False, kshare: bool = False, cloads: bool = False):
    cutlass, cute = kc.import_cute()
    from cutlass import Float32, Int32
    from cutlass.cute.nvgpu import cpasync, warpgroup

    C = CHUNK
    LOG2E = cm.LOG2E
    VB = vb  # V columns per CTA: 64, or 128 (V = 128)
    # two output warpgroups at 128 columns: 168 registers at launch, the chain 232 after setmaxnreg, no spill; with
    # onfly too the chain's 32 more registers (R^T) make ptxas spill and serialize the products (C7512): refused
    assert VB in (64, 128) and VB <= V and not (wg3 and VB == 128 and onfly), (VB, V, wg3, onfly)
    # VB = 128: the chain's S^T [128, K] takes 128 accumulator registers a thread, so its first product reads S^T
    # as the A operand from the sS tile it writes for the output anyway (no register copy); u's tile is swizzled
    SA = VB > 64
    U_STRIDE = VB + 8  # padded row-major u tile, read transposed (as in the fused kernel)
    # tma: q, k, w, u by TMA (one thread issues a chunk's four tiles on the buffer's mbarrier; u then in a
    # swizzled tile, TMA writes no padding), gc still by cp.async (its rows are HV floats apart)
    TX_BYTES = ((2 * C * K + C * (C if onfly else K) + C * VB) * (dtype.width // 8))
    # onfly: w and u never exist; the wy kernel's INV variant leaves the gate-free chunk inverse A0 (rows of mW's
    # slot, [B, T, HV, C]), gc and the effective beta (mBe), and the chain forms, per chunk,
    #     X^T = S^T k^T,  R^T = (v^T - X^T diag(exp(gc) rk)) diag(beta),  vn^T = R^T T^T,
    #     T = A0 * exp(gc_i - gc_j) (j <= i, else 0)      (the gated inverse is A0's similarity transform)
    # with v in u's slot (the tile of columns v0 : v0 + VB) and T built in shared memory while X^T runs; with tma
    # the rows past a varlen sequence's end (the next sequence's k, v, A0) are masked out of R and of vn
    WCOLS = C if onfly else K  # columns of the tile in w's slot
    # shared memory (the allocations below): two buffers of q, k, w (onfly: A0), u, S^T, vn^T; gc (onfly: beta too),
    # three factor rows; onfly's T (1 KB aligned after the rows); the mbarriers. The tiles before the rows are
    # multiples of 1 KB: no alignment padding between them
    u_bytes = C * (VB if (tma or SA) else U_STRIDE) * dtype.width // 8
    smem_bytes = (2 * ((2 * C * K + C * WCOLS + VB * K + VB * C) * dtype.width // 8 + u_bytes)
                  + (2 * (2 if onfly else 1) + 3) * C * 4 + (C * C * dtype.width // 8 + 1024 if onfly else 0) + 16)
    assert smem_bytes <= SMEM_BYTES, f"{smem_bytes} bytes of shared memory (VB={VB}, onfly={onfly})"
    # wg3: two output warpgroups taking alternate chunks (the one of the chunk's parity does q S, q k^T, P in the
    # chain's iteration, the same warpgroup P vn and the stores in the next, while the other starts the next
    # chunk), registers moved to the chain by setmaxnreg. 384 threads launch with at most 168 registers a thread
    # (65536 / 384, in steps of 8), so the three warpgroups' counts may sum to 3 x 168 = 504 at most: asking more,
    # the chain's setmaxnreg.inc would wait forever for registers the CTA does not have (a review found 240 + 2 x 136)
    assert not wg3 or (tma and not store_states and not profile), "wg3: with the TMA loads, inference, no profile"
    NTHR = 384 if wg3 else THREADS
    CHAIN_REGS, OUT_REGS = 232, 136
    assert CHAIN_REGS + 2 * OUT_REGS <= 3 * (65536 // 384 // 8 * 8)
    TMA_WARP = 4  # the output warpgroup's first warp issues them (one elected thread arms the mbarrier)
    LOAD_WARP = 0 if cloads else TMA_WARP  # (cloads: the chain's first warp issues the loads)
    assert not cloads or tma, (cloads, tma)
    init_barriers = cm.make_tma_init()
    # with TMA, right after the barrier: a one-thread branch between a warpgroup's products and their wait makes
    # ptxas serialize the products (C7520)
    late = not tma
    issue_tiles = F.make_issue_tiles(dtype, C, THREADS)
    issue_gc = F.make_issue_gc()
    gemm = cm.make_gemm()
    rows_inv_norm = cm.make_rows_inv_norm(dtype, K, F.L2NORM_EPS, 128)
    start_state, store_state = cm.make_state_io()
    p_to_frag, scale_o_rows = cm.make_p_frag_and_o_scale(dtype, l2norm)
    locate_seq = cm.make_seq_locator(varlen)
    NPH = len(WS_PHASES[0])
    pstart, pmark, _ = F.make_profile(profile, NPH)
    # nseg > 1 (:func:`segments`, the inference forward only): nseg CTAs a (sequence, value head, V block), segment s
    # writing o for the chunks [s n / nseg, (s + 1) n / nseg) = [c_lo, c_hi) of the sequence's n, after a warm-up
    # from a zero state at the latest chunk c_w < c_lo whose chunks c_w .. c_lo - 1 decay by less than e^-20 in all
    # (cm.make_decay_reach), or from the sequence's start with the initial state where none does (the unsplit
    # kernel's instructions: the same bits). The kernel walks the rows ts + c_w C .. min(ts + c_hi C, te) as if they
    # were the sequence (its rows rebased: every load, mask and store below is unchanged), storing o from local
    # chunk c_lo - c_w on; the last segment stores the final state. The bound is the forward chain's split's
    # (``gated_delta_rule_fwd_split_sm90``): only with l2norm.
    SEG = nseg > 1
    assert not SEG or (l2norm and nseg in cm.SEGMENTS and not store_states and not profile), (nseg, l2norm)
    # tstore (TSTORE): the state tile S [d, v] and the vn tile [i, v] (v contiguous, written by transposed stmatrix),
    # read as MN-major operands; hs and (keep_vn) vn leave by TMA stores from them (warp TMA_WARP of the output
    # warpgroup, issued after the CTA barrier that publishes them, their reads waited for before the next one)
    assert not tstore or (store_states and not wg3), (tstore, store_states, wg3)
    # onfly with store_states (the training forward with w and u formed in its chain, CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY):
    # the chain also writes the gated inverse T it builds, rounded as its B operand is, into the rows of mTm
    # ([B, T, HV, C], stage 3's Tm), the rows of the chunk only (the V block at column 0); the chunk states and vn
    # leave as in the training forward (vn^T = R^T T^T is the chain's vn)
    STORE_TM = onfly and store_states
    # tlayout (TLAYOUT, the inference forward): the same transposed tiles, written by stmatrix and read MN-major, without
    # the stores; tstore implies them. TL below is every place the tiles' orientation decides, tstore the stores alone
    assert not tlayout or not store_states, (tlayout, store_states)
    TL = tstore or tlayout
    # uldm (ULDM): the chain reads u^T (onfly: v^T) for vn^T = u^T - S^T w^T (R^T) by transposed ldmatrix from u's
    # swizzled [i, v] tile, straight into the accumulator's layout, instead of a 2-byte load an element; only where
    # that tile is swizzled (TMA loads or 128 columns)
    assert not uldm or tma or SA, (uldm, tma, SA)
    # otma (OTMA): the output warpgroup writes a full chunk's o by stmatrix into the q tile of its buffer (no reader
    # left once the chunk's q products and q norms are done; the next load into it is issued an iteration later, by
    # the warp that stores, after the store's reads) and stores it by one TMA store; a partial chunk's rows by pairs as
    # before. The q tile is o's [C, VB] tile only where K == VB; with the TMA loads and one output warpgroup
    assert not otma or (tma and K == VB and not wg3), (otma, tma, K, VB, wg3)
    BULK = tstore or otma  # the output's TMA_WARP has bulk stores in flight across iterations
    # kshare (KSHARE): the output warpgroup takes the chain's l2norm factors of k (sRk0, the same helper on the same
    # tile: the same values) instead of computing its own; the chain arrives on BAR_RK once they are written, the output
    # syncs on it before P (every chunk both compute, not in the last iteration); one output warpgroup
    assert not kshare or (l2norm and not wg3), (kshare, l2norm, wg3)
    walk = cm.make_segment_walk(forward=True)
    zero_unless = cm.make_zero_unless()

    @cute.jit
    def issue_rows(mGc: cute.Tensor, mBe: cute.Tensor, sGc: cute.Tensor, sBe: cute.Tensor, b: Int32, hv: Int32,
                   t0: Int32, length: Int32, tidx: Int32):
        """gc and (onfly) the effective beta of the chunk at row t0 by cp.async, with the tiles or beside their TMA
        (rows HV floats apart, under TMA's 16-byte minimum; rows past the end: never used)."""
        issue_gc(mGc, sGc, b, hv, t0, length, tidx)
        if cutlass.const_expr(onfly):
            issue_gc(mBe, sBe, b, hv, t0, length, tidx)

    @cute.jit
    def issue_chunk(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor,
                    sQ: cute.Tensor, sK: cute.Tensor, sW: cute.Tensor, sU: cute.Tensor, sGc: cute.Tensor,
                    b: Int32, h: Int32, hv: Int32, t0: Int32, v0: Int32, length: Int32, tidx: Int32,
                    mBe: cute.Tensor, sBe: cute.Tensor):
        issue_tiles(((cute.domain_offset((t0, 0), mQ[b, None, h, None]), sQ, K, 0),
                     (cute.domain_offset((t0, 0), mK[b, None, h, None]), sK, K, 0),
                     (cute.domain_offset((t0, 0), mW[b, None, hv, None]), sW, WCOLS, 0),
                     (cute.domain_offset((t0, 0), mU[b, None, hv, None]), sU, VB, v0 // 8)), length, tidx)
        issue_rows(mGc, mBe, sGc, sBe, b, hv, t0, length, tidx)

    def tma_chunk(ta, sQ, sK, sW, sU, bar, b, h, hv, t0, v0):
        """(One warp, while tracing) the chunk at row t0: q, k (head h), w and u's columns v0 : v0 + VB (value head
        hv) by TMA on the mbarrier ``bar`` (:func:`cm.tma_load`). Rows past the tensor's end arrive as zeros; rows
        past a varlen sequence's end are the next sequence's (the chain masks their vn)."""
        aQ, aK, aW, aU, tQ, tK, tW, tU = ta
        cm.tma_load([(aQ, cm.token_box(tQ, b, h, t0, 0, C, K), sQ), (aK, cm.token_box(tK, b, h, t0, 0, C, K), sK),
                     (aW, cm.token_box(tW, b, hv, t0, 0, C, WCOLS), sW),
                     (aU, cm.token_box(tU, b, hv, t0, v0, C, VB), sU)], bar, TX_BYTES)

    @cute.jit
    def issue_next(gm: cutlass.Constexpr, sb: cutlass.Constexpr, nb: cutlass.Constexpr, b: Int32, h: Int32,
                   hv: Int32, ts: Int32, te: Int32, ci: Int32, v0: Int32, tidx: Int32, ta: cutlass.Constexpr, mbar):
        """Chunk ci + 1's copies (if it exists) into buffer ``nb`` of the tiles ``sb`` (lists of buffers of q, k,
        w, u, gc, beta) from the tensors ``gm`` (q, k, w, u, gc, beta), the cp.async ones committed as one group
        (empty if none); with ``tma`` the tiles by TMA on buffer nb's mbarrier (warp TMA_WARP), gc by cp.async."""
        mQ, mK, mW, mU, mGc, mBe = gm
        sQ, sK, sW, sU, sGc, sBe = (x[nb] for x in sb)
        bar = None if mbar is None else mbar + nb
        if ci + 1 < (te - ts + C - 1) // C:
            t1 = ts + (ci + 1) * C
            if cutlass.const_expr(tma):
                issue_rows(mGc, mBe, sGc, sBe, b, hv, t1, cutlass.min(te - t1, C), tidx)
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == LOAD_WARP:
                    tma_chunk(ta, sQ, sK, sW, sU, bar, b, h, hv, t1, v0)
            else:
                issue_chunk(mQ, mK, mW, mU, mGc, sQ, sK, sW, sU, sGc, b, h, hv, t1, v0, cutlass.min(te - t1, C),
                            tidx, mBe, sBe)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def build_t(sA0: cute.Tensor, sGc: cute.Tensor, sT: cute.Tensor, lt: Int32, gTm: cute.Tensor, length: Int32,
                store: Int32):
        """(The chain, onfly) T[i, j] = A0[i, j] exp(gc_i - gc_j) for j <= i, else 0, in the input dtype: eight
        adjacent columns a thread and step, 16-byte reads and writes (the factor above the diagonal may be
        inf there, never kept); with STORE_TM and ``store`` also into the rows i < ``length`` of ``gTm``."""
        for p in cutlass.range_constexpr(C * C // 8 // 128):
            idx = p * 128 + lt
            i = idx // (C // 8)
            c8 = idx % (C // 8)
            a8 = cute.make_rmem_tensor((1, 8), dtype)
            cute.autovec_copy(cute.local_tile(sA0, (1, 8), (i, c8)), a8)
            t8 = cute.make_rmem_tensor((1, 8), dtype)
            gi = sGc[i]
            for e in cutlass.range_constexpr(8):
                j = c8 * 8 + e
                tv = a8[e].to(Float32) * cute.math.exp2((gi - sGc[j]) * LOG2E, fastmath=True)
                t8[e] = Float32(cutlass.select_(j <= i, tv, Float32(0.0))).to(dtype)
            cute.autovec_copy(t8, cute.local_tile(sT, (1, 8), (i, c8)))
            if cutlass.const_expr(STORE_TM):
                if store > 0 and i < length:
                    cute.autovec_copy(t8, cute.local_tile(gTm, (1, 8), (i, c8)))

    @cute.jit
    def p_and_scale(accP: cute.Tensor, rP: cute.Tensor, accO: cute.Tensor, cP: cute.Tensor, cO: cute.Tensor,
                    sGc: cute.Tensor, sRq: cute.Tensor, sRk: cute.Tensor, scale: Float32, map_p: cutlass.Constexpr,
                    bar_id=BAR_OUT):
        """(The output warpgroup) P from the q k^T accumulator into the register A operand rP, and o's first term
        scaled in place; the l2norm factors are in sRq, sRk once the warpgroup's barrier is passed."""
        if cutlass.const_expr(l2norm):
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)  # sRq, sRk written
        # ---- P = scale tril(q k^T exp(gc_i - gc_j)) rq_i rk_j, in registers (A of P vn), by a select
        p_to_frag(accP, rP, cP, map_p, sGc, sRq, sRk, scale, True)
        # ---- o = scale exp(gc_i) rq_i q S + ... (P vn in the next iteration)
        scale_o_rows(accO, cO, sGc, sRq, scale)

    @cute.jit
    def handover(ci: Int32, cp: Int32, nchunks: Int32, bar, sK: cute.Tensor, length: Int32, tidx: Int32):
        """The top of an iteration, every warpgroup: chunk ci's tiles have landed (with TMA its buffer's mbarrier
        ``bar``, phase cp % 2; gc, and without TMA every tile, by this thread's cp.async groups), then the CTA
        barrier that hands everything over. With TMA, k's rows past the chunk's ``length`` (the next sequence's, or
        whatever a varlen tensor holds past its last sequence, NaN included) are zeroed first, as cp.async
        zero-fills them: the state update's zero vn columns meet them in a product, and their l2norm factors
        scale those columns (0 x NaN would be NaN)."""
        if cutlass.const_expr(tma):
            if ci < nchunks:
                cute.arch.mbarrier_wait(bar, cp % 2)
                if length < C:
                    zero = cute.make_rmem_tensor((1, 8), dtype)
                    zero.fill(0.0)
                    for p in cutlass.range_constexpr((C * K // 8 + NTHR - 1) // NTHR):
                        idx = p * NTHR + tidx
                        r = idx // (K // 8)
                        if r < C and r >= length:
                            cute.autovec_copy(zero, cute.local_tile(sK, (1, 8), (r, idx % (K // 8))))
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_ITER, number_of_threads=NTHR)

    def output_operands(lt, mma_p, mma_o, mma_ov, sQb, sKb, sSb, sVob):
        """(An output warpgroup, while tracing) ``(thr_p, thr_o, thr_ov, tAq, tBk, tAqo, tBs, tBvo, cP, cO)``: the operand
        fragments of q k^T, q S and P vn over every buffer, and the coordinates of P and o."""
        thr_p = mma_p.get_slice(lt)
        thr_o = mma_o.get_slice(lt)
        thr_ov = mma_ov.get_slice(lt)
        return (thr_p, thr_o, thr_ov,
                [mma_p.make_fragment_A(thr_p.partition_A(t)) for t in sQb],
                [mma_p.make_fragment_B(thr_p.partition_B(t)) for t in sKb],
                [mma_o.make_fragment_A(thr_o.partition_A(t)) for t in sQb],
                [mma_o.make_fragment_B(thr_o.partition_B(t)) for t in sSb],
                [mma_ov.make_fragment_B(thr_ov.partition_B(t)) for t in sVob],
                thr_p.partition_C(cute.make_identity_tensor((C, C))),  # (i, j)
                thr_o.partition_C(cute.make_identity_tensor((C, VB))))  # (i, v)

    @cute.jit
    def store_o_rows(accO: cute.Tensor, cO: cute.Tensor, mO: cute.Tensor, b: Int32, hv: Int32, tp: Int32,
                     lp: Int32, v0: Int32):
        """The o rows < lp of the chunk at token tp (columns v0 :), element pairs, 4-byte stores."""
        gO = cute.domain_offset((tp, 0), mO[b, None, hv, None])
        for e in cutlass.range_constexpr(cute.size(accO) // 2):
            oi, ov = cO[2 * e]
            if oi < lp:
                pair = cute.make_rmem_tensor((1, 2), dtype)
                pair[0] = accO[2 * e].to(dtype)
                pair[1] = accO[2 * e + 1].to(dtype)
                cute.autovec_copy(pair, cute.local_tile(gO, (1, 2), (oi, (v0 + ov) // 2)))

    pairs_to_tile = cm.make_pairs_to_tile(dtype)  # accumulator pairs into a tile in the input dtype

    def ut_by_ldmatrix(accX, cX, sUt, l2u, map_lu, lt, sGc=None, sRk=None, sBe=None):
        """(The chain, uldm, while tracing) ``accX <- u^T - accX``, or with ``sBe`` (onfly, v in u's slot) ``R^T =
        (v^T - accX diag(exp(gc) rk)) diag(beta)``: the u^T values by transposed ldmatrix from ``sUt`` (the (v, i)
        view of u's tile), a block just before its values are used; each element's arithmetic is the scalar-load
        loop's, so the same bits."""
        nv, blocks = cm.ldmatrix_acc_blocks(l2u, sUt, lt)
        for srcb, dshape, f0 in blocks:
            frag = cute.make_rmem_tensor(dshape, dtype)
            cute.copy(l2u, srcb, frag)
            for f in range(nv):
                e = map_lu[f0 + f]
                uv = frag[f].to(Float32)
                if sBe is None:
                    accX[e] = uv - accX[e]
                else:
                    _, xi = cX[e]
                    xcoef = cute.math.exp2(sGc[xi] * LOG2E, fastmath=True)
                    if sRk is not None:
                        xcoef = xcoef * sRk[xi]
                    accX[e] = (uv - accX[e] * xcoef) * sBe[xi]

    @cute.jit
    def tile_to_rows(sX: cute.Tensor, gX: cute.Tensor, rows: cutlass.Constexpr, nvalid: Int32, v0: Int32, lt: Int32):
        """The transposed ``[VB, rows]`` smem tile ``sX`` (``[v, r]``) as rows ``r < nvalid`` of ``gX`` (``[r, v]``,
        columns ``v0 :``), 16-byte vectors; consecutive threads take consecutive rows (conflict-free reads)."""
        for p in cutlass.range_constexpr(rows * VB // 8 // 128):
            idx = p * 128 + lt
            r = idx % rows
            v8 = idx // rows
            if r < nvalid:
                vec = cute.make_rmem_tensor((1, 8), dtype)
                for e in cutlass.range_constexpr(8):
                    vec[e] = sX[v8 * 8 + e, r]
                cute.autovec_copy(vec, cute.local_tile(gX, (1, 8), (r, v0 // 8 + v8)))

    @cute.jit
    def store_o(accO: cute.Tensor, cO: cute.Tensor, mO: cute.Tensor, b: Int32, hv: Int32, tp: Int32, lp: Int32,
                v0: Int32, r2o: cutlass.Constexpr, map_so: cutlass.Constexpr, sO: cute.Tensor, store_warp,
                ot: cutlass.Constexpr, lt: Int32):
        """(The output warpgroup) chunk's o rows < lp at token tp: with ``otma`` a full chunk by stmatrix into
        ``sO`` (the buffer's q tile, once every thread of the warpgroup is past its q norms) and one TMA store by
        ``store_warp``, a partial one (and without otma every chunk) by pairs (:func:`store_o_rows`)."""
        if cutlass.const_expr(otma):
            if lp == C:
                aO, tO = ot
                cute.arch.barrier(barrier_id=BAR_OUT, number_of_threads=128)  # every q norm read done
                cm.stmatrix_acc_mapped(r2o, accO, map_so, dtype, sO, lt)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=BAR_OUT, number_of_threads=128)
                if store_warp:
                    cm.tma_store(aO, cm.token_box(tO, b, hv, tp, v0, C, VB), sO)
            else:
                store_o_rows(accO, cO, mO, b, hv, tp, lp, v0)
        else:
            store_o_rows(accO, cO, mO, b, hv, tp, lp, v0)

    @cute.jit
    def tstores(ci: Int32, par: cutlass.Constexpr, nchunks: Int32, b: Int32, hv: Int32, ts: Int32, te: Int32,
                cbase: Int32, v0: Int32, store_warp, lt: Int32, sts: cutlass.Constexpr):
        """(The output warpgroup, tstore, right after the CTA barrier of iteration ci) chunk ci's start state from
        its [d, v] tile to its row of hs, one TMA store (the warp ``store_warp``); with ``keep_vn`` chunk ci - 1's vn
        from its [i, v] tile: a full chunk's by one TMA store, a partial chunk's rows past its end left alone, its
        valid rows by 16-byte vectors (every thread of the warpgroup)."""
        aHs, tHs, aVo, tVo, sSb, sVob, mVn = sts
        if store_warp:
            if ci < nchunks:
                cm.tma_store(aHs, cm.token_box(tHs, cbase + ci, hv, 0, v0, K, VB), sSb[par])
        if cutlass.const_expr(keep_vn):
            if ci > 0:
                tq = ts + (ci - 1) * C
                lq = cutlass.min(te - tq, C)
                if lq == C:
                    if store_warp:
                        cm.tma_store(aVo, cm.token_box(tVo, b, hv, tq, v0, C, VB), sVob[1 - par])
                else:
                    gVn = cute.domain_offset((tq, 0), mVn[b, None, hv, None])
                    for p in cutlass.range_constexpr(C * VB // 8 // 128):
                        idx = p * 128 + lt
                        r = idx // (VB // 8)
                        c8 = idx % (VB // 8)
                        if r < lq:
                            vec = cute.make_rmem_tensor((1, 8), dtype)
                            cute.autovec_copy(cute.local_tile(sVob[1 - par], (1, 8), (r, c8)), vec)
                            cute.autovec_copy(vec, cute.local_tile(gVn, (1, 8), (r, v0 // 8 + c8)))

    @cute.kernel
    def kernel(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor,
               mH0: cute.Tensor, mO: cute.Tensor, mHT: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor,
               mHs: cute.Tensor, mVn: cute.Tensor, scale: Float32, T: Int32, NT: Int32, group: Int32,
               mProf: cute.Tensor, aQ: cute.CopyAtom, aK: cute.CopyAtom, aW: cute.CopyAtom, aU: cute.CopyAtom,
               tQ: cute.Tensor, tK: cute.Tensor, tW: cute.Tensor, tU: cute.Tensor, mBe: cute.Tensor,
               aHs: cute.CopyAtom, tHs: cute.Tensor, aVo: cute.CopyAtom, tVo: cute.Tensor, aO: cute.CopyAtom,
               tO: cute.Tensor, mTm: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        n, hv, vb = cute.arch.block_idx()
        seg = Int32(0)
        if cutlass.const_expr(SEG):  # segment seg of sequence n
            seg = n % nseg
            n = n // nseg
        wg = cute.arch.make_warp_uniform(tidx // 128)
        lt = tidx % 128  # thread within its warpgroup
        prof = pstart()
        h = hv // group
        v0 = vb * VB

        # chain: the fused kernel's orientation (S^T [v, d] accumulators, register A operands)
        mma_s = cm.make_mma(dtype, K, a_regs=True, b_mn_major=True)  # S^T += vd^T k      [v, d]
        mma_xr = cm.make_mma(dtype, C, a_regs=True, b_mn_major=False)  # [v, i] products, A in registers
        mma_x = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False, a_mn_major=TL) if SA else mma_xr  # S^T w^T
        cm.check_same_acc_layout(mma_x, mma_xr, (VB, C))
        map_s = None if SA else cm.acc_to_frag_map(mma_s, (VB, K), mma_x, (VB, K))
        map_vd = cm.acc_to_frag_map(mma_x, (VB, C), mma_s, (VB, C))
        map_vn = cm.acc_to_frag_map(mma_x, (VB, C), mma_xr, (VB, C))  # onfly: R^T as the A operand of R^T T^T
        cm.check_acc_pairs(mma_s, (VB, K))  # S^T pairs -> sS
        cm.check_acc_pairs(mma_x, (VB, C))  # vn^T pairs -> sVo
        # output: the out kernel's orientation (o [i, v])
        mma_p = cm.make_mma(dtype, C, a_regs=False, b_mn_major=False)  # q k^T   [i, j]
        # q S [i, v], B = the S^T tile [v, d] (TL: S [d, v], MN-major); P vn [i, v], B = vn^T [v, j] (vn [j, v])
        mma_o = cm.make_mma(dtype, VB, a_regs=False, b_mn_major=TL)
        mma_ov = cm.make_mma(dtype, VB, a_regs=True, b_mn_major=TL)
        cm.check_same_acc_layout(mma_o, mma_ov, (C, VB))
        cm.check_acc_pairs(mma_o, (C, VB))
        map_p = cm.acc_to_frag_map(mma_p, (C, C), mma_ov, (C, C))

        smem = cutlass.utils.SmemAllocator()
        sQb = [cm.alloc_tile(smem, dtype, C, K) for _ in range(2)]
        sKb = [cm.alloc_tile(smem, dtype, C, K) for _ in range(2)]
        sWb = [cm.alloc_tile(smem, dtype, C, WCOLS) for _ in range(2)]  # w, or with onfly A0
        # S^T [v, d] at a chunk's start, vn^T [v, i]; TL: S [d, v], vn [i, v] (the same bytes)
        sSb = [cm.alloc_tile(smem, dtype, K, VB) if TL else cm.alloc_tile(smem, dtype, VB, K) for _ in range(2)]
        sVob = [cm.alloc_tile(smem, dtype, C, VB) if TL else cm.alloc_tile(smem, dtype, VB, C) for _ in range(2)]
        # the (v, d) and (v, i) views every reader and writer below takes
        sSv = [cm.transpose_view(t) for t in sSb] if TL else sSb
        sVov = [cm.transpose_view(t) for t in sVob] if TL else sVob
        if cutlass.const_expr(tma or SA):
            sUb = [cm.alloc_tile(smem, dtype, C, VB) for _ in range(2)]
        else:
            sUb = [smem.allocate_tensor(dtype, cute.make_layout((C, VB), stride=(U_STRIDE, 1)), 16) for _ in range(2)]
        sGcb = [smem.allocate_tensor(Float32, cute.make_layout(C), 16) for _ in range(2)]
        sRk0 = smem.allocate_tensor(Float32, cute.make_layout(C), 16)  # the chain's k factors
        sBeb = sGcb  # onfly: the effective beta, like gc; and the chain's gated inverse T (input dtype)
        sT = sQb[0]
        if cutlass.const_expr(onfly):
            sBeb = [smem.allocate_tensor(Float32, cute.make_layout(C), 16) for _ in range(2)]
            sT = cm.alloc_tile(smem, dtype, C, C)
        sRq = smem.allocate_tensor(Float32, cute.make_layout(C), 16)  # the output's q and k factors
        sRk = smem.allocate_tensor(Float32, cute.make_layout(C), 16)

        ta = (aQ, aK, aW, aU, tQ, tK, tW, tU)
        gm = (mQ, mK, mW, mU, mGc, mBe)
        sb = (sQb, sKb, sWb, sUb, sGcb, sBeb)
        mbar = None
        if cutlass.const_expr(tma):  # one mbarrier a buffer: chunk c in buffer c % 2 completes its phase (c // 2) % 2
            mbar = smem.allocate_array(cutlass.Int64, 2, byte_alignment=8)
            # (the warp that issues the loads also issues tstore's stores: their descriptors too)
            stores = ((aHs,) if tstore else ()) + ((aVo,) if tstore and keep_vn else ()) + ((aO,) if otma else ())
            init_barriers(mbar, 2, (aQ, aK, aW, aU) + stores, TMA_WARP)

        b, ts, te, cbase, nchunks = locate_seq(n, mCu, mCuC, T, NT)
        c_w = Int32(0)  # (SEG) the walk's first chunk, and the first local chunk whose o is stored
        keep_from = Int32(0)
        if cutlass.const_expr(SEG):  # sRq: free until the first barrier
            c_w, c_lo, c_hi = walk(mGc, sRq, b, hv, ts, te, nchunks, seg, nseg, tidx)
            keep_from = c_lo - c_w
            te = cutlass.min(ts + c_hi * C, te)  # the walk's rows, rebased
            ts = ts + c_w * C
            nchunks = c_hi - c_w
        niter = nchunks + cutlass.min(nchunks, 1)  # the output finishes chunk c in iteration c + 1

        if nchunks > 0:
            if cutlass.const_expr(tma):
                issue_rows(mGc, mBe, sGcb[0], sBeb[0], b, hv, ts, cutlass.min(te - ts, C), tidx)
                if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == LOAD_WARP:
                    tma_chunk(ta, sQb[0], sKb[0], sWb[0], sUb[0], mbar, b, h, hv, ts, v0)
            else:
                issue_chunk(mQ, mK, mW, mU, mGc, sQb[0], sKb[0], sWb[0], sUb[0], sGcb[0], b, h, hv, ts, v0,
                            cutlass.min(te - ts, C), tidx, mBe, sBeb[0])
        cute.arch.cp_async_commit_group()

        if wg == 0:
            # ---------------------------------------------------------------- the chain
            if cutlass.const_expr(wg3):
                cute.arch.setmaxregister_increase(CHAIN_REGS)
            thr_s = mma_s.get_slice(lt)
            thr_x = mma_x.get_slice(lt)
            thr_xr = mma_xr.get_slice(lt)
            tBw = [mma_x.make_fragment_B(thr_x.partition_B(t)) for t in (sKb if onfly else sWb)]  # k: X^T = S^T k^T
            tBt = mma_xr.make_fragment_B(thr_xr.partition_B(sT))  # onfly: vn^T = R^T T^T
            rR = mma_xr.make_fragment_A(thr_xr.partition_shape_A((VB, C)))
            tBkt = [mma_s.make_fragment_B(thr_s.partition_B(cm.transpose_view(t))) for t in sKb]
            # S^T, the A operand of the first product: a register copy, or (SA) the sS tile itself
            rS = [mma_x.make_fragment_A(thr_x.partition_A(t)) for t in sSv] if SA else \
                mma_x.make_fragment_A(thr_x.partition_shape_A((VB, K)))
            rVd = mma_s.make_fragment_A(thr_s.partition_shape_A((VB, C)))
            cS = thr_s.partition_C(cute.make_identity_tensor((VB, K)))  # (v, d)
            cX = thr_x.partition_C(cute.make_identity_tensor((VB, C)))  # (v, i)
            if cutlass.const_expr(TL):  # S and vn rounded into their [d, v] / [i, v] tiles by stmatrix, each
                r2s = cm.make_acc_stmatrix_t(dtype, mma_s)  # copy value from the accumulator element of its place
                r2x = cm.make_acc_stmatrix_t(dtype, mma_x)
                map_ss = cm.acc_to_stmatrix_map(mma_s, r2s, (VB, K))
                map_sx = cm.acc_to_stmatrix_map(mma_x, r2x, (VB, C))
            if cutlass.const_expr(uldm):  # u^T [v, i] from u's [i, v] tile, in the accumulator's layout
                l2u = cm.make_acc_ldmatrix_t(dtype, mma_x)
                map_lu = cm.acc_to_ldmatrix_map(mma_x, l2u, (VB, C))
                sUt = [cm.transpose_view(t) for t in sUb]
            accS = cute.make_rmem_tensor(thr_s.partition_shape_C((VB, K)), Float32)
            start_state(accS, cS, mH0, n, hv, v0, state_vk, has_h0)
            if cutlass.const_expr(SEG and has_h0):  # a walk from a later chunk starts from zero
                zero_unless(accS, c_w == 0)
            for cp in cutlass.range((niter + 1) // 2, unroll=1):
                for par in cutlass.range_constexpr(2):  # chunk ci in buffer par: every tile stays static
                    ci = cp * 2 + par
                    if ci < niter:
                        pmark(prof, -1)
                        if ci < nchunks:
                            # S^T in the input dtype: this warpgroup's A operand, and sS for the output's q S
                            if cutlass.const_expr(not SA):
                                for f in cutlass.range_constexpr(cute.size(rS)):
                                    rS[f] = accS[map_s[f]].to(dtype)
                            if cutlass.const_expr(TL):
                                cm.stmatrix_acc_mapped(r2s, accS, map_ss, dtype, sSv[par], lt)
                            else:
                                pairs_to_tile(accS, cS, sSb[par])
                        pmark(prof, 0)
                        handover(ci, cp, nchunks, None if mbar is None else mbar + par, sKb[par],
                                 cutlass.min(te - (ts + ci * C), C), tidx)
                        pmark(prof, 1)
                        if cutlass.const_expr(not late):
                            issue_next(gm, sb, 1 - par, b, h, hv, ts, te, ci, v0, tidx, ta, mbar)
                        if ci < nchunks:
                            accX = cute.make_rmem_tensor(thr_x.partition_shape_C((VB, C)), Float32)
                            # S^T w^T [v, i] (onfly: S^T k^T); SA: S^T from sS, written and fenced before the barrier
                            gemm(mma_x, accX, rS[par] if SA else rS, tBw[par], True)
                            warpgroup.commit_group()
                            if cutlass.const_expr(late):  # the copies' issue stalls in the product's shadow
                                issue_next(gm, sb, 1 - par, b, h, hv, ts, te, ci, v0, tidx, ta, mbar)
                            pmark(prof, 2)
                            if cutlass.const_expr(l2norm):
                                rows_inv_norm(sKb[par], sRk0, lt)
                            if cutlass.const_expr(onfly):
                                tc = ts + ci * C
                                build_t(sWb[par], sGcb[par], sT, lt, cute.domain_offset((tc, 0), mTm[b, None, hv, None]),
                                        cutlass.min(te - tc, C), cutlass.select_(v0 == 0, Int32(1), Int32(0)))
                                cute.arch.fence_view_async_shared()  # T: B operand of the next product
                            warpgroup.wait_group(0)
                            if cutlass.const_expr(l2norm or onfly):
                                cute.arch.barrier(barrier_id=BAR_CHAIN, number_of_threads=128)  # sRk0 (sT) written
                            if cutlass.const_expr(kshare):  # sRk0 for the output warpgroup's P
                                cute.arch.barrier_arrive(barrier_id=BAR_RK, number_of_threads=256)
                            pmark(prof, 3)
                            if cutlass.const_expr(onfly):
                                # ---- R^T = (v^T - X^T diag(exp(gc) rk)) diag(beta), the A operand of vn^T = R^T T^T
                                if cutlass.const_expr(uldm):
                                    ut_by_ldmatrix(accX, cX, sUt[par], l2u, map_lu, lt, sGcb[par],
                                                   sRk0 if l2norm else None, sBeb[par])
                                else:
                                    for e in cutlass.range_constexpr(cute.size(accX)):
                                        xv, xi = cX[e]
                                        xcoef = cute.math.exp2(sGcb[par][xi] * LOG2E, fastmath=True)
                                        if cutlass.const_expr(l2norm):
                                            xcoef = xcoef * sRk0[xi]
                                        accX[e] = (sUb[par][xi, xv].to(Float32) - accX[e] * xcoef) * sBeb[par][xi]
                                if cutlass.const_expr(tma):  # rows past a varlen sequence's end: the next one's k, v
                                    rlen = cutlass.min(te - (ts + ci * C), C)
                                    for e in cutlass.range_constexpr(cute.size(accX)):
                                        _, xi = cX[e]
                                        accX[e] = Float32(cutlass.select_(xi < rlen, accX[e], Float32(0.0)))
                                for f in cutlass.range_constexpr(cute.size(rR)):
                                    rR[f] = accX[map_vn[f]].to(dtype)
                                gemm(mma_xr, accX, rR, tBt, True)  # vn^T [v, i]
                                warpgroup.commit_group()
                                warpgroup.wait_group(0)
                            else:
                                # ---- vn^T = u^T - S^T w^T (in place), to sVo for the output
                                if cutlass.const_expr(uldm):
                                    ut_by_ldmatrix(accX, cX, sUt[par], l2u, map_lu, lt)
                                else:
                                    for e in cutlass.range_constexpr(cute.size(accX)):
                                        xv, xi = cX[e]
                                        accX[e] = sUb[par][xi, xv].to(Float32) - accX[e]
                            if cutlass.const_expr(tma):  # rows past the chunk's end hold the next sequence's w, u
                                length = cutlass.min(te - (ts + ci * C), C)
                                for e in cutlass.range_constexpr(cute.size(accX)):  # a select, not a branch:
                                    _, xi = cX[e]  # accumulator registers written under one make ptxas serialize
                                    accX[e] = Float32(cutlass.select_(xi < length, accX[e], Float32(0.0)))
                            if cutlass.const_expr(TL):
                                cm.stmatrix_acc_mapped(r2x, accX, map_sx, dtype, sVov[par], lt)
                            else:
                                pairs_to_tile(accX, cX, sVob[par])
                            glast = sGcb[par][C - 1]
                            for f in cutlass.range_constexpr(cute.size(rVd)):
                                _, dj = cX[map_vd[f]]
                                dcoef = cute.math.exp2((glast - sGcb[par][dj]) * LOG2E, fastmath=True)
                                if cutlass.const_expr(l2norm):
                                    dcoef = dcoef * sRk0[dj]
                                rVd[f] = (accX[map_vd[f]] * dcoef).to(dtype)
                            decay = cute.math.exp2(glast * LOG2E, fastmath=True)
                            for e in cutlass.range_constexpr(cute.size(accS)):
                                accS[e] = accS[e] * decay
                            pmark(prof, 4)
                            gemm(mma_s, accS, rVd, tBkt[par], False)  # S^T += (vn^T diag(exp(gl - gc) rk)) k
                            warpgroup.commit_group()
                            warpgroup.wait_group(0)
                            pmark(prof, 5)
            if cutlass.const_expr(out_final):
                if cutlass.const_expr(SEG):
                    if seg == nseg - 1:  # the last segment's walk ends the sequence
                        store_state(accS, cS, mHT, n, hv, v0, state_vk)
                else:
                    store_state(accS, cS, mHT, n, hv, v0, state_vk)
        elif cutlass.const_expr(wg3):
            # ---------------------------------------------------------------- two outputs, alternate chunks
            cute.arch.setmaxregister_decrease(OUT_REGS)
            j = wg - 1  # this warpgroup's chunks: ci % 2 == j
            thr_p, thr_o, thr_ov, tAq, tBk, tAqo, tBs, tBvo, cP, cO = output_operands(
                lt, mma_p, mma_o, mma_ov, sQb, sKb, sSv, sVov)
            accO = cute.make_rmem_tensor(thr_o.partition_shape_C((C, VB)), Float32)
            rP = mma_ov.make_fragment_A(thr_ov.partition_shape_A((C, C)))
            for cp in cutlass.range((niter + 1) // 2, unroll=1):
                for par in cutlass.range_constexpr(2):
                    ci = cp * 2 + par
                    if ci < niter:
                        handover(ci, cp, nchunks, None if mbar is None else mbar + par, sKb[par],
                                 cutlass.min(te - (ts + ci * C), C), tidx)
                        issue_next(gm, sb, 1 - par, b, h, hv, ts, te, ci, v0, tidx, ta, mbar)
                        if j == par:
                            # ---- chunk ci (this warpgroup's parity): q k^T, q S, the norms, P, o's first term (in
                            # the last iteration, ci = nchunks, on stale tiles and never used: no branch around the
                            # P registers, which would make ptxas serialize the products)
                            accP = cute.make_rmem_tensor(thr_p.partition_shape_C((C, C)), Float32)
                            gemm(mma_p, accP, tAq[par], tBk[par], True)  # q k^T  [i, j]
                            gemm(mma_o, accO, tAqo[par], tBs[par], True)  # q S  [i, v]
                            warpgroup.commit_group()
                            if cutlass.const_expr(l2norm):
                                rows_inv_norm(sQb[par], sRq, lt)
                                rows_inv_norm(sKb[par], sRk, lt)
                            warpgroup.wait_group(0)
                            p_and_scale(accP, rP, accO, cP, cO, sGcb[par], sRq, sRk, scale, map_p, BAR_OUT + j)
                        else:
                            # ---- chunk ci - 1 (this warpgroup's, begun last iteration): o += P vn, its rows
                            if ci > 0:
                                gemm(mma_ov, accO, rP, tBvo[1 - par], False)
                                warpgroup.commit_group()
                                warpgroup.wait_group(0)
                                tp = ts + (ci - 1) * C
                                if cutlass.const_expr(SEG):
                                    if ci - 1 >= keep_from:  # not a warm-up chunk's
                                        store_o_rows(accO, cO, mO, b, hv, tp, cutlass.min(te - tp, C), v0)
                                else:
                                    store_o_rows(accO, cO, mO, b, hv, tp, cutlass.min(te - tp, C), v0)
        else:
            # ---------------------------------------------------------------- the output
            thr_p, thr_o, thr_ov, tAq, tBk, tAqo, tBs, tBvo, cP, cO = output_operands(
                lt, mma_p, mma_o, mma_ov, sQb, sKb, sSv, sVov)
            store_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == TMA_WARP
            sts = (aHs, tHs, aVo, tVo, sSb, sVob, mVn)
            r2o, map_so = None, None
            if cutlass.const_expr(otma):  # o [i, v] rounded into the q tile [C, K = VB] by stmatrix
                r2o = cm.make_acc_stmatrix(dtype, mma_o)
                map_so = cm.acc_to_stmatrix_map(mma_o, r2o, (C, VB))
            # chunk c's o and P live from iteration c (q S, P) to c + 1 (P vn, the stores): one of each a parity
            accOb = [cute.make_rmem_tensor(thr_o.partition_shape_C((C, VB)), Float32) for _ in range(2)]
            rPb = [mma_ov.make_fragment_A(thr_ov.partition_shape_A((C, C))) for _ in range(2)]
            for cp in cutlass.range((niter + 1) // 2, unroll=1):
                for par in cutlass.range_constexpr(2):
                    ci = cp * 2 + par
                    if ci < niter:
                        pmark(prof, -1)
                        if cutlass.const_expr(BULK):  # the last iteration's stores have read their tiles, which
                            if store_warp:  # the chain (otma: the next loads) writes again after the barrier below
                                cute.arch.cp_async_bulk_wait_group(0, read=True)
                        handover(ci, cp, nchunks, None if mbar is None else mbar + par, sKb[par],
                                 cutlass.min(te - (ts + ci * C), C), tidx)
                        pmark(prof, 1)
                        if cutlass.const_expr(tstore):  # chunk ci's start state, chunk ci - 1's vn (a full chunk)
                            tstores(ci, par, nchunks, b, hv, ts, te, cbase, v0, store_warp, lt, sts)
                        if cutlass.const_expr(not late):
                            issue_next(gm, sb, 1 - par, b, h, hv, ts, te, ci, v0, tidx, ta, mbar)
                        accP = cute.make_rmem_tensor(thr_p.partition_shape_C((C, C)), Float32)
                        if ci < nchunks:
                            gemm(mma_p, accP, tAq[par], tBk[par], True)  # q k^T  [i, j]
                            gemm(mma_o, accOb[par], tAqo[par], tBs[par], True)  # q S  [i, v]
                        if ci > 0:
                            gemm(mma_ov, accOb[1 - par], rPb[1 - par], tBvo[1 - par], False)  # chunk ci - 1: += P vn
                        warpgroup.commit_group()
                        if cutlass.const_expr(late):
                            issue_next(gm, sb, 1 - par, b, h, hv, ts, te, ci, v0, tidx, ta, mbar)
                        pmark(prof, 2)
                        # the gathered stores, while the products run (they only read sS, sVo)
                        if cutlass.const_expr(store_states and not tstore):
                            if ci < nchunks:  # chunk ci's start state: a row of the chunk states
                                tile_to_rows(sSb[par], mHs[cbase + ci, hv, None, None], K, K, v0, lt)
                            if cutlass.const_expr(keep_vn):
                                if ci > 0:  # chunk ci - 1's vn rows
                                    tq = ts + (ci - 1) * C
                                    tile_to_rows(sVob[1 - par], cute.domain_offset((tq, 0), mVn[b, None, hv, None]),
                                                 C, cutlass.min(te - tq, C), v0, lt)
                        if cutlass.const_expr(l2norm):
                            if ci < nchunks:
                                rows_inv_norm(sQb[par], sRq, lt)
                                if cutlass.const_expr(not kshare):
                                    rows_inv_norm(sKb[par], sRk, lt)
                        warpgroup.wait_group(0)
                        pmark(prof, 3)
                        if ci > 0:
                            # ---- chunk ci - 1's o rows
                            tp = ts + (ci - 1) * C
                            if cutlass.const_expr(SEG):
                                if ci - 1 >= keep_from:  # not a warm-up chunk's
                                    store_o(accOb[1 - par], cO, mO, b, hv, tp, cutlass.min(te - tp, C), v0, r2o,
                                            map_so, sQb[par], store_warp, (aO, tO), lt)
                            else:
                                store_o(accOb[1 - par], cO, mO, b, hv, tp, cutlass.min(te - tp, C), v0, r2o, map_so,
                                        sQb[par], store_warp, (aO, tO), lt)
                        pmark(prof, 4)
                        sRkP = sRk
                        if cutlass.const_expr(kshare):  # the chain's k factors of chunk ci (rewritten only after the
                            sRkP = sRk0  # next CTA barrier, which this warpgroup reaches after P)
                            if ci < nchunks:
                                cute.arch.barrier(barrier_id=BAR_RK, number_of_threads=256)
                        if cutlass.const_expr(tma):  # in the last iteration too (unused there): with the P
                            # registers written under a branch, ptxas serializes this kernel's products (C7520)
                            p_and_scale(accP, rPb[par], accOb[par], cP, cO, sGcb[par], sRq, sRkP, scale, map_p)
                        elif ci < nchunks:
                            p_and_scale(accP, rPb[par], accOb[par], cP, cO, sGcb[par], sRq, sRkP, scale, map_p)
                        pmark(prof, 5)
            if cutlass.const_expr(BULK):  # every store done before the CTA's shared memory goes
                if store_warp:
                    cute.arch.cp_async_bulk_wait_group(0)
        if cutlass.const_expr(profile):  # thread 0 of each warpgroup: [phase sums..., kernel total]
            prof[NPH] = cute.arch.clock64() - prof[NPH]
            if lt == 0:
                cta = (n * cute.arch.grid_dim()[1] + hv) * cute.arch.grid_dim()[2] + vb
                for p in cutlass.range_constexpr(NPH + 1):
                    mProf[(cta * 2 + wg) * (NPH + 1) + p] = prof[p]

    @cute.jit
    def host(mQ: cute.Tensor, mK: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mGc: cute.Tensor,
             mH0: cute.Tensor, mO: cute.Tensor, mHT: cute.Tensor, mCu: cute.Tensor, mCuC: cute.Tensor,
             mHs: cute.Tensor, mVn: cute.Tensor, scale: Float32, T: Int32, NT: Int32, group: Int32, nseq: Int32,
             mProf: cute.Tensor, mBe: cute.Tensor, mTm: cute.Tensor, stream):
        F._static_checks(dtype, K, V)
        cm.check_mn_major_view(dtype, C, K)  # k: MN-major B operand of the state update
        if cutlass.const_expr(TL):  # S [d, v] and vn [i, v]: MN-major operands through their (v, .) views
            cm.check_mn_major_view(dtype, K, VB)
            cm.check_mn_major_view(dtype, C, VB)
        HV = mU.shape[2]
        (aQ, aK, aW, aU), (tQ, tK, tW, tU) = cm.make_tma_rows_atoms(
            tma, dtype, ((mQ, C, K), (mK, C, K), (mW, C, WCOLS), (mU, C, VB)))
        aHs, tHs = cm.make_tma_store(tstore, dtype, mHs, cm.STATE_ROWS, K, VB)  # (tstore) [d, v] tiles -> hs rows
        aVo, tVo = cm.make_tma_store(tstore and keep_vn, dtype, mVn, cm.TOKEN_ROWS, C, VB)  # [i, v] tiles -> vn
        aO, tO = cm.make_tma_store(otma, dtype, mO, cm.TOKEN_ROWS, C, VB)  # (otma) o [i, v] from the q tile
        kernel(mQ, mK, mW, mU, mGc, mH0, mO, mHT, mCu, mCuC, mHs, mVn, scale, T, NT, group, mProf,
               aQ, aK, aW, aU, tQ, tK, tW, tU, mBe, aHs, tHs, aVo, tVo, aO, tO, mTm).launch(
            grid=[nseq * nseg, HV, V // VB], block=[NTHR, 1, 1], stream=stream,
        )

    f = F._fakes()
    args = (
        f.rows4(dtype, K), f.rows4(dtype, K), f.rows4(dtype, WCOLS), f.rows4(dtype, V), f.any3(Float32),
        f.state(), f.rows4(dtype, V), f.state(), f.vec(cutlass.Int32), f.vec(cutlass.Int32),
        f.rows4(dtype, V) if store_states else f.state(), f.rows4(dtype, V) if keep_vn else f.state(),
        Float32(1.0), Int32(1), Int32(1), Int32(1), Int32(1), f.vec(cutlass.Int64), f.any3(Float32),
        f.rows4(dtype, C) if STORE_TM else f.state(), f.stream(),
    )
    return cute.compile(host, *args, options=f"--enable-tvm-ffi --gpu-arch {kc.target_arch()}")


def get_kernel(dtype, K, V, l2norm, varlen, has_h0, out_final, state_vk, store_states=False, keep_vn=False,
               profile=False, tma=None, onfly=False, wg3=None, vb=VB, nseg=1, tstore=None, tlayout=None,
               uldm=None, otma=None, kshare=None, cloads=None):
    """The compiled state pass; ``tstore`` (default :data:`TSTORE`, only with ``store_states``): the chunk states
    and vn written by TMA stores from tiles the chain writes transposed (see ``TSTORE``); ``tlayout`` (default
    :data:`TLAYOUT`, inference only, ignored with ``store_states``): those transposed tiles without the stores;
    ``uldm`` (default :data:`ULDM`, ignored where u's tile is not swizzled): the chain's u^T by ldmatrix; ``otma``
    (default :data:`OTMA`, ignored where it cannot serve: K != vb, cp.async loads, two output warpgroups): o by TMA
    stores; ``kshare`` (default :data:`KSHARE`, ignored without the l2norm or with two output warpgroups): the output
    warpgroup on the chain's k factors; ``cloads`` (default :data:`CLOADS`, ignored without the TMA loads): the next
    chunk's TMA loads issued by the chain's first warp."""
    tma = (K == V if TMA is None else TMA) if tma is None else bool(tma)
    tstore = bool(store_states) and (TSTORE if tstore is None else bool(tstore))
    tlayout = not store_states and (TLAYOUT if tlayout is None else bool(tlayout))
    uldm = (tma or vb > 64) and (ULDM if uldm is None else bool(uldm))
    if wg3 is None:
        want = (vb == 64 and K == V) if WG3 is None else (WG3 and not (vb == 128 and onfly))
        wg3 = tma and want and not store_states and not profile
    wg3 = bool(wg3)
    otma = tma and K == vb and not wg3 and (OTMA if otma is None else bool(otma))
    kshare = bool(l2norm) and not wg3 and (KSHARE if kshare is None else bool(kshare))
    cloads = tma and (CLOADS if cloads is None else bool(cloads))
    if K not in F.HEAD_DIMS or V not in F.HEAD_DIMS:
        raise ValueError(f"K={K}, V={V}: expected each in {F.HEAD_DIMS}")
    if vb not in (64, 128) or vb > V or (wg3 and vb == 128 and onfly):
        raise ValueError(f"vb={vb}: expected 64, or 128 with V = 128 and not both two output warpgroups and w, u "
                         f"formed in the chain (V={V}, wg3={wg3}, onfly={onfly})")
    if keep_vn and not store_states:
        raise ValueError("keep_vn: only with store_states (the training forward)")
    if tstore and wg3:
        raise ValueError("tstore: the training forward's stores (one output warpgroup)")
    if nseg not in cm.SEGMENTS or (nseg > 1 and not (l2norm and not store_states and not profile)):
        raise ValueError(f"nseg={nseg}: one of {cm.SEGMENTS}; more than 1 only with l2norm, for inference, not the "
                         "profile variant")
    key = ("state_ws", str(dtype), K, V, bool(l2norm), bool(varlen), bool(has_h0), bool(out_final), bool(state_vk),
           bool(store_states), bool(keep_vn)) + (("profile",) if profile else ()) + (("tma",) if tma else ()) + (("onfly",) if onfly else ()) + (("wg3",) if wg3 else ()) + (("vb", vb) if vb != VB else ()) + (
        (("nseg", nseg),) if nseg > 1 else ()) + (("tstore",) if tstore else ()) + (("tlayout",) if tlayout else ()) + (
        ("uldm",) if uldm else ()) + (("otma",) if otma else ()) + (("kshare",) if kshare else ()) + (
        ("cloads",) if cloads else ())

    def build():
        return _build(F._dt(dtype), K, V, l2norm, varlen, has_h0, out_final, state_vk, bool(store_states),
                      bool(keep_vn), bool(profile), tma, bool(onfly), wg3, vb, nseg, tstore, tlayout, uldm, otma,
                      kshare, cloads)

    return kc.get_kernel("gdn_fwd_state_ws", key, build, _SOURCES)


# tools/time_gdn_fwd.py --profile-defaults only: while this is a list, state_pass and state_pass_onfly run the profile
# variant of the kernel they would launch and append its buffer (int64, the WS_PHASES sums of every CTA: a row of
# 2 x (phases + 1) a CTA, warpgroup 0 then 1) to the list
PROFILE_INTO = None


def _profile_buffer(ctas: int, device):
    """A zeroed profile buffer for ``ctas`` CTAs on ``device``, appended to :data:`PROFILE_INTO`, or None when not
    profiling."""
    if PROFILE_INTO is None:
        return None
    buf = torch.zeros(ctas * 2 * (len(WS_PHASES[0]) + 1), dtype=torch.int64, device=device)
    PROFILE_INTO.append(buf)
    return buf


def _launch(q, k, wa, uv, gc, last, o, h0, ht, cu, cu_chunks, NT, scale, l2norm, state_vk, group, nseq, hs, vn, tm,
            vb, nseg, onfly):
    """The one launch behind :func:`state_pass` and :func:`state_pass_onfly`: ``wa`` / ``uv`` are w / u, or a0 / v
    with ``onfly``; ``last`` is the kernel's float32 ``[B, T, HV]`` argument after the profile buffer (gc again, or
    the effective beta with ``onfly``)."""
    B, T, HV, V = uv.shape
    K = q.shape[-1]
    train = hs is not None
    vb = v_block(V, nseq * nseg, HV, q.device, train, train and TSTORE) if vb is None else vb
    prof = _profile_buffer(nseq * HV * (V // vb) * nseg, q.device)
    fn = get_kernel(q.dtype, K, V, l2norm, NT == 0, h0 is not None, ht is not None, state_vk, train, vn is not None,
                    onfly=onfly, vb=vb, nseg=nseg, profile=prof is not None)
    f32_dummy, _, i64_dummy = F._dummies(q.device)
    d4 = f32_dummy.view(1, 1, 1, 1)
    fn(q, k, wa, uv, gc, d4 if h0 is None else h0, o, d4 if ht is None else ht, cu, cu_chunks,
       d4 if hs is None else hs, d4 if vn is None else vn, float(scale), T, NT, group, nseq,
       i64_dummy if prof is None else prof, last, d4 if tm is None else tm)


def state_pass(q, k, w, u, gc, o, h0, ht, cu, cu_chunks, NT, scale, l2norm, state_vk, group, nseq, hs=None,
               vn=None, vb=None, nseg=1):
    """Fill ``o`` (and ``ht`` when given) from the wy kernel's w, u, gc: the fused state kernel's job.
    ``h0`` / ``ht``: float32 states or None. The training forward's ``hs`` (the chunk-start states, input dtype
    ``[rows, HV, K, V]``) and ``vn`` (input dtype ``[B, T, HV, V]``, only with ``hs``), when given, are
    written too. ``vb``: V columns per CTA (None: :func:`v_block`); ``nseg``: segments a sequence (:func:`segments`;
    inference only)."""
    _launch(q, k, w, u, gc, gc, o, h0, ht, cu, cu_chunks, NT, scale, l2norm, state_vk, group, nseq, hs, vn, None,
            vb, nseg, onfly=False)


def state_pass_onfly(q, k, v, a0, gc, beta_eff, o, h0, ht, cu, cu_chunks, NT, scale, l2norm, state_vk, group, nseq,
                     vb=None, nseg=1, hs=None, vn=None, tm=None):
    """The state pass from the wy kernel's INV outputs (``a0``: the gate-free chunk inverses, input
    dtype ``[B, T, HV, 64]``; ``gc``, ``beta_eff``: float32 ``[B, T, HV]``) and v: w and u are formed in the chain.
    Fills ``o`` (and ``ht`` when given). ``nseg``: segments a sequence (:func:`segments`; inference only). The
    training forward's (``CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY``): ``hs`` (chunk-start states, input dtype ``[rows, HV, K,
    V]``) and ``tm`` (the gated chunk inverses T the chain builds, input dtype ``[B, T, HV, 64]``, stage 3's Tm) given
    together, ``vn`` (input dtype ``[B, T, HV, V]``) with them or not."""
    train = hs is not None
    if train != (tm is not None) or (vn is not None and not train) or (train and nseg != 1):
        raise ValueError("hs and tm: both or neither; vn only with them; one segment with them")
    _launch(q, k, a0, v, gc, beta_eff, o, h0, ht, cu, cu_chunks, NT, scale, l2norm, state_vk, group, nseq, hs, vn,
            tm, vb, nseg, onfly=True)

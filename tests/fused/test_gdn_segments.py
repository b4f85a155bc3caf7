"""The plan of the SM90 kernels' sequence split (``CUDNN_TRAIN_GDN_CHAIN_SEG`` / ``_SWEEP_SEG``), checked on the CPU
in float64 against the unsplit references: the segment ranges, the decay-truncated warm-up (the same formulas as
the kernels' ``cm.make_decay_reach`` and their start / end selects), the owner of the initial state's gradient.
The kernels themselves are checked against their unsplit selves on the GPU (``test_split_chain_segments``,
``test_reverse_sweep_segments``); this file checks that the plan they implement is exact to the truncation's bound,
edge cases included (more segments than chunks, empty and one-token sequences, a partial last chunk that is a
warm-up chunk of the segments before it)."""

import pytest
import torch
import torch.nn.functional as F

from cudnn_train.fused.delta_rule_bwd import reverse_sweep_ref
from cudnn_train.fused.gated_delta_rule import chunked_core
from cudnn_train.kernels import gated_delta_rule_common_sm90 as cm
from tests.utils import gdn_seg_gates

C = cm.CHUNK


def reach(tot: list[float], c0: int, count: int, step: int) -> int:
    """``cm.make_decay_reach``: how many of the chunks c0, c0 + step, ... (count at most) it takes for their log
    decays to sum below cm.SEG_LOG_DECAY, else 0."""
    run = 0.0
    for j in range(count):
        run += tot[c0 + step * j]
        if run < cm.SEG_LOG_DECAY:
            return j + 1
    return 0


def forward_plan(n: int, nseg: int, s: int, tot: list[float]) -> tuple[int, int, int]:
    """The forward chain's segment s: (c_w, c_lo, c_hi), walking c_w .. c_hi - 1 and storing from c_lo."""
    c_lo, c_hi = n * s // nseg, n * (s + 1) // nseg
    m = reach(tot, c_lo - 1, c_lo, -1)
    c_w = c_lo - m if m > 0 else 0
    return (c_w if c_hi > c_lo else c_hi), c_lo, c_hi


def sweep_plan(n: int, nseg: int, s: int, tot: list[float]) -> tuple[int, int, int]:
    """The reverse sweep's segment s: (c_lo, c_hi, c_e), walking c_e - 1 down to c_lo and storing below c_hi."""
    c_lo, c_hi = n * s // nseg, n * (s + 1) // nseg
    m = reach(tot, c_hi, n - c_hi, 1)
    c_e = c_hi + m if m > 0 else n
    return c_lo, c_hi, (c_e if c_hi > c_lo else c_lo)


def dh0_owner(n: int, nseg: int) -> int:
    """The sweep's segment that stores dh0 (the kernel's select)."""
    return (nseg + n - 1) // max(n, 1) - 1 if n > 0 else 0


@pytest.mark.parametrize("nseg", cm.SEGMENTS[1:])
def test_segments_cover_every_chunk_once_and_dh0_has_one_owner(nseg):
    for n in range(0, 41):
        got = [c for s in range(nseg) for c in range(n * s // nseg, n * (s + 1) // nseg)]
        assert got == list(range(n)), (n, nseg)
        owner = dh0_owner(n, nseg)
        lo, hi = n * owner // nseg, n * (owner + 1) // nseg
        assert lo == 0 and (hi > 0 or n == 0), (n, nseg, owner)


def _inputs(T, HV=4, K=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    g = gdn_seg_gates(1, T, "cpu", torch.float64, gen)[..., :HV]
    h0 = torch.randn(1, HV, K, K, generator=gen, dtype=torch.float64)
    do = torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64)
    dht = torch.randn(1, HV, K, K, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, h0, do, dht


def _chunk_decays(g: torch.Tensor, h: int) -> list[float]:
    """Each chunk's log decay for head h: the sum over its tokens (gc at its last row; the partial last chunk's
    last row is the sequence's)."""
    T = g.shape[1]
    return [float(g[0, c * C:min((c + 1) * C, T), h].sum()) for c in range(-(-T // C))]


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("T, nseg", [(2000, 4), (2000, 16), (65, 4), (1, 2), (0, 4), (700, 8), (128, 4), (150, 4)])
def test_segmented_forward_matches_the_unsplit_chain(T, nseg):
    """o and the final state of the chain walked segment by segment from each plan's start (zero state, or the
    initial state from the sequence's start) equal the unsplit chain's to the truncation's bound, per head."""
    q, k, v, g, beta, h0, _, _ = _inputs(T)
    scale = q.shape[-1] ** -0.5
    o_ref, ht_ref = chunked_core(q, k, v, g.unsqueeze(-1), beta, scale, h0, C)
    n = -(-T // C)
    for h in range(q.shape[2]):
        tot = _chunk_decays(g, h)
        o = torch.full_like(o_ref[:, :, h], float("nan"))
        ht = None
        for s in range(nseg):
            c_w, c_lo, c_hi = forward_plan(n, nseg, s, tot)
            a, b = c_w * C, min(c_hi * C, T)
            S = h0[:, h:h + 1] if c_w == 0 else torch.zeros_like(h0[:, h:h + 1])
            sl = (slice(None), slice(a, b), slice(h, h + 1))
            o_s, S_end = chunked_core(q[sl], k[sl], v[sl], g[sl].unsqueeze(-1), beta[sl], scale, S, C)
            o[:, c_lo * C:b] = o_s[:, c_lo * C - a:, 0]
            if s == nseg - 1:
                ht = S_end[:, 0]
        if T == 2000 and h == 1:  # the case exercises a warm-up of several chunks, not only the exact fallback
            plans = [forward_plan(n, nseg, s, tot) for s in range(nseg)]
            assert any(0 < c_w < c_lo - 1 for c_w, c_lo, _ in plans), plans
        if T:
            assert torch.isfinite(o).all(), (h, "a token no segment wrote")
            assert _rel(o, o_ref[:, :, h]) < 1e-8, (h, _rel(o, o_ref[:, :, h]))
        assert _rel(ht, ht_ref[:, h]) < 1e-8, (h, _rel(ht, ht_ref[:, h]))


@pytest.mark.parametrize("T, nseg", [(2000, 4), (2000, 16), (1990, 4), (65, 4), (1, 2), (700, 8), (128, 4),
                                     (150, 4)])
def test_segmented_sweep_matches_the_unsplit_sweep(T, nseg):
    """dvn, every chunk's dH and dh0 of the reverse sweep walked segment by segment from each plan's end (zero dH,
    or the final state's gradient from the sequence's end) equal the unsplit sweep's to the truncation's bound,
    per head; T 1990 ends in a partial chunk that is a warm-up chunk of the segments before the last. (T = 0 never
    reaches the kernel: ``reverse_sweep`` returns dht as dh0 itself; the reference takes no empty sequence.)"""
    q, k, _, g, beta, _, do, dht = _inputs(T)
    scale = q.shape[-1] ** -0.5
    n = -(-T // C)
    dvn_ref, dH_ref, dh0_ref = reverse_sweep_ref(q, k, g.unsqueeze(-1), beta, scale, do, dht, C)
    for h in range(q.shape[2]):
        tot = _chunk_decays(g, h)
        dvn = torch.full_like(dvn_ref[:, :, h], float("nan"))
        dH = torch.full_like(dH_ref[:, h], float("nan"))
        dh0 = None
        for s in range(nseg):
            c_lo, c_hi, c_e = sweep_plan(n, nseg, s, tot)
            a, b = c_lo * C, min(c_e * C, T)
            end = dht[:, h:h + 1] if c_e == n else torch.zeros_like(dht[:, h:h + 1])
            sl = (slice(None), slice(a, b), slice(h, h + 1))
            if b > a:
                dvn_s, dH_s, dS0 = reverse_sweep_ref(q[sl], k[sl], g[sl].unsqueeze(-1), beta[sl], scale, do[sl], end, C)
                dvn[:, a:min(c_hi * C, T)] = dvn_s[:, :min(c_hi * C, T) - a, 0]
                dH[:, c_lo:c_hi] = dH_s[:, 0, :c_hi - c_lo]
            else:
                dS0 = end
            if s == dh0_owner(n, nseg):
                dh0 = dS0[:, 0]
        if T == 2000 and h == 1:  # the case exercises a warm-up of several chunks, not only the exact fallback
            plans = [sweep_plan(n, nseg, s, tot) for s in range(nseg)]
            assert any(c_hi + 1 < c_e < n for _, c_hi, c_e in plans), plans
        if T:
            assert torch.isfinite(dvn).all() and torch.isfinite(dH).all(), (h, "a chunk no segment wrote")
            assert _rel(dvn, dvn_ref[:, :, h]) < 1e-8, (h, _rel(dvn, dvn_ref[:, :, h]))
            assert _rel(dH, dH_ref[:, h]) < 1e-8, (h, _rel(dH, dH_ref[:, h]))
        assert _rel(dh0, dh0_ref[:, h]) < 1e-8, (h, _rel(dh0, dh0_ref[:, h]))

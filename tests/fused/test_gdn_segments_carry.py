"""The plan for a sequence split whose cost does not depend on the gates (twenty-sixth session, CPU only, float64;
no kernel implements it yet): the decay-truncated warm-up of ``test_gdn_segments.py`` capped at ``cap`` chunks,
and where a boundary's decay does not reach e^-20 within the cap, the exact carry the issue names.

Forward, ``nseg`` segments of a sequence's ``n`` chunks, segment s = chunks ``[lo_s, hi_s)``:

1. *prepare* (one independent walk per boundary ``lo_s``, s >= 1): if the chunks just before the boundary reach a
   summed log decay below -20 within ``min(cap, length of segment s - 1)`` chunks (``m`` of them), ``L`` = the
   state walked from zero over those m chunks and ``M = 0``; otherwise ``L`` = the state walked from zero over all
   of segment s - 1 and ``M`` = its K x K transition (the same recurrence with ``v = 0`` from ``I``);
2. *combine* (sequential, one ``[K, K] @ [K, V]`` product a boundary): ``S_0 = h0``, ``S_s = M S_(s-1) + L``;
3. *main*: each segment walked from ``S_s`` over its own chunks only, storing o (and the last one the final state).

No walk is longer than one segment (prepare's M and L are two walks of it, which a kernel would run side by side),
whatever the gates, where the uncapped warm-up walks up to the whole sequence for a head that never decays
(docs/PERFORMANCE.md, twenty-sixth session). The reverse sweep mirrors it: the carry into the end of segment s
comes from segment s + 1, its transition from the sweep with ``do = 0`` from ``dht = I``.
"""

import pytest
import torch

from cudnn_train.fused.delta_rule_bwd import reverse_sweep_ref
from cudnn_train.fused.gated_delta_rule import chunked_core
from cudnn_train.kernels import gated_delta_rule_common_sm90 as cm
from tests.fused.test_gdn_segments import _chunk_decays, _inputs, _rel, reach

C = cm.CHUNK


def _bounds(n: int, nseg: int) -> list[tuple[int, int]]:
    return [(n * s // nseg, n * (s + 1) // nseg) for s in range(nseg)]


def carried_forward(q, k, v, g, beta, scale, h0, h, nseg, cap, walks):
    """o ``[1, T, V]`` and the final state ``[1, K, V]`` of head h by the plan above; appends to ``walks`` each
    walk's (phase, chunks)."""
    T = q.shape[1]
    n = -(-T // C)
    tot = _chunk_decays(g, h)
    segs = _bounds(n, nseg)
    hsl = slice(h, h + 1)

    def walk(a, b, S, zero_v=False):  # chunks [a, b) of head h from state S: (o, end state)
        sl = (slice(None), slice(a * C, min(b * C, T)), hsl)
        vv = torch.zeros_like(q[sl]) if zero_v else v[sl]  # K = V here: a [K, K] state walks like a [K, V] one
        return chunked_core(q[sl], k[sl], vv, g[sl].unsqueeze(-1), beta[sl], scale, S, C)

    zero = torch.zeros_like(h0[:, hsl])
    carries = []  # (M, L) into the boundary of segment s, s >= 1
    for s in range(1, nseg):
        lo_p, hi_p = segs[s - 1]
        m = reach(tot, hi_p - 1, min(cap, hi_p - lo_p), -1) if hi_p > lo_p else 0
        if hi_p == lo_p:  # an empty segment before: nothing moves the state
            eye = torch.eye(q.shape[-1], dtype=q.dtype).expand_as(zero)
            carries.append((eye, zero))
        elif m > 0:
            carries.append((None, walk(hi_p - m, hi_p, zero)[1]))
            walks.append(("warm-up", m))
        else:
            eye = torch.eye(q.shape[-1], dtype=q.dtype).expand_as(zero).clone()
            carries.append((walk(lo_p, hi_p, eye, zero_v=True)[1], walk(lo_p, hi_p, zero)[1]))
            walks.append(("carry", hi_p - lo_p))
    starts = [h0[:, hsl]]
    for M, L in carries:  # combine
        starts.append(L if M is None else M @ starts[-1] + L)
    o = torch.full_like(v[:, :, h], float("nan"))
    ht = starts[0][:, 0]
    for s, (lo, hi) in enumerate(segs):  # main
        if hi > lo:
            o_s, S_end = walk(lo, hi, starts[s])
            o[:, lo * C:min(hi * C, T)] = o_s[:, :, 0]
            ht = S_end[:, 0]
            walks.append(("main", hi - lo))
    return o, ht


def carried_sweep(q, k, g, beta, scale, do, dht, h, nseg, cap, walks):
    """dvn ``[1, T, V]``, dH ``[1, n, K, V]`` and dh0 ``[1, K, V]`` of head h, the plan mirrored."""
    T = q.shape[1]
    n = -(-T // C)
    tot = _chunk_decays(g, h)
    segs = _bounds(n, nseg)
    hsl = slice(h, h + 1)

    def walk(a, b, end, zero_do=False):  # chunks b - 1 down to a of head h from the gradient ``end``
        sl = (slice(None), slice(a * C, min(b * C, T)), hsl)
        d = torch.zeros_like(do[sl]) if zero_do else do[sl]
        return reverse_sweep_ref(q[sl], k[sl], g[sl].unsqueeze(-1), beta[sl], scale, d, end, C)

    zero = torch.zeros_like(dht[:, hsl])
    eye = torch.eye(q.shape[-1], dtype=q.dtype).expand_as(zero).clone()
    carries = {}  # s -> (M, L): the gradient at the end of segment s from segment s + 1
    for s in range(nseg - 1):
        lo_n, hi_n = segs[s + 1]
        m = reach(tot, lo_n, min(cap, hi_n - lo_n), 1) if hi_n > lo_n else 0
        if hi_n == lo_n:
            carries[s] = (eye, zero)
        elif m > 0:
            carries[s] = (None, walk(lo_n, lo_n + m, zero)[2])
            walks.append(("warm-up", m))
        else:
            carries[s] = (walk(lo_n, hi_n, eye, zero_do=True)[2], walk(lo_n, hi_n, zero)[2])
            walks.append(("carry", hi_n - lo_n))
    ends = {nseg - 1: dht[:, hsl]}
    for s in range(nseg - 2, -1, -1):  # combine, from the sequence's end
        M, L = carries[s]
        ends[s] = L if M is None else M @ ends[s + 1] + L
    dvn = torch.full_like(do[:, :, h], float("nan"))
    dH = torch.full((1, n) + tuple(dht.shape[-2:]), float("nan"), dtype=dht.dtype)
    dh0 = ends[0][:, 0]
    for s in range(nseg - 1, -1, -1):  # main
        lo, hi = segs[s]
        if hi > lo:
            dvn_s, dH_s, dS0 = walk(lo, hi, ends[s])
            dvn[:, lo * C:min(hi * C, T)] = dvn_s[:, :, 0]
            dH[:, lo:hi] = dH_s[:, 0]
            dh0 = dS0[:, 0]
            walks.append(("main", hi - lo))
    return dvn, dH, dh0


CASES = [(2000, 4, 4), (2000, 4, 16), (2000, 16, 1), (1990, 4, 2), (700, 8, 16), (150, 4, 4), (65, 4, 16), (1, 2, 4)]


@pytest.mark.parametrize("T, nseg, cap", CASES)
def test_carried_forward_matches_the_unsplit_chain(T, nseg, cap):
    """o and the final state by prepare / combine / main equal the unsplit chain's to the truncation's bound for
    every head of gdn_seg_gates (head 0 never decays: every boundary carried exactly; head 1 needs about 8 chunks
    of warm-up: carried below a cap of 8, warmed up above; head 2 one or two chunks), and no walk is longer than a
    segment."""
    q, k, v, g, beta, h0, _, _ = _inputs(T)
    scale = q.shape[-1] ** -0.5
    o_ref, ht_ref = chunked_core(q, k, v, g.unsqueeze(-1), beta, scale, h0, C)
    n = -(-T // C)
    longest = max(hi - lo for lo, hi in _bounds(n, nseg))
    for h in range(q.shape[2]):
        walks = []
        o, ht = carried_forward(q, k, v, g, beta, scale, h0, h, nseg, cap, walks)
        assert max((c for _, c in walks), default=0) <= longest, (h, walks)
        if T:
            assert torch.isfinite(o).all(), (h, "a token no segment wrote")
            assert _rel(o, o_ref[:, :, h]) < 1e-8, (h, _rel(o, o_ref[:, :, h]))
        assert _rel(ht, ht_ref[:, h]) < 1e-8, (h, _rel(ht, ht_ref[:, h]))


@pytest.mark.parametrize("T, nseg, cap", CASES)
def test_carried_sweep_matches_the_unsplit_sweep(T, nseg, cap):
    """dvn, every chunk's dH and dh0 by the mirrored plan equal the unsplit sweep's to the truncation's bound, per
    head, no walk longer than a segment; T 1990's partial last chunk sits in the last segment's carry."""
    q, k, _, g, beta, _, do, dht = _inputs(T)
    scale = q.shape[-1] ** -0.5
    dvn_ref, dH_ref, dh0_ref = reverse_sweep_ref(q, k, g.unsqueeze(-1), beta, scale, do, dht, C)
    n = -(-T // C)
    longest = max(hi - lo for lo, hi in _bounds(n, nseg))
    for h in range(q.shape[2]):
        walks = []
        dvn, dH, dh0 = carried_sweep(q, k, g, beta, scale, do, dht, h, nseg, cap, walks)
        assert max((c for _, c in walks), default=0) <= longest, (h, walks)
        if T:
            assert torch.isfinite(dvn).all() and torch.isfinite(dH).all(), (h, "a chunk no segment wrote")
            assert _rel(dvn, dvn_ref[:, :, h]) < 1e-8, (h, _rel(dvn, dvn_ref[:, :, h]))
            assert _rel(dH, dH_ref[:, h]) < 1e-8, (h, _rel(dH, dH_ref[:, h]))
        assert _rel(dh0, dh0_ref[:, h]) < 1e-8, (h, _rel(dh0, dh0_ref[:, h]))


def test_the_cases_take_both_branches():
    """At T 2000 in 4 segments of 8 chunks the slow head is carried exactly at every boundary of both recurrences,
    the fast head warmed up at every one, and head 1 (about 8 chunks to e^-20) switches branch with the cap:
    carried at cap 4; warmed up at cap 16, except the sweep's last carry, whose 8 chunks end in a 16-token chunk
    and fall short of e^-20."""
    q, k, v, g, beta, h0, do, dht = _inputs(2000)
    scale = q.shape[-1] ** -0.5

    def kinds(h, cap):
        fwd, bwd = [], []
        carried_forward(q, k, v, g, beta, scale, h0, h, 4, cap, fwd)
        carried_sweep(q, k, g, beta, scale, do, dht, h, 4, cap, bwd)
        return [kind for kind, _ in fwd if kind != "main"], [kind for kind, _ in bwd if kind != "main"]

    assert kinds(0, 16) == (["carry"] * 3, ["carry"] * 3)
    assert kinds(2, 16) == (["warm-up"] * 3, ["warm-up"] * 3)
    assert kinds(1, 4) == (["carry"] * 3, ["carry"] * 3)
    assert kinds(1, 16) == (["warm-up"] * 3, ["warm-up", "warm-up", "carry"])  # the sweep: boundaries 1, 2, 3


@pytest.mark.parametrize("decay", [True, False])
def test_the_sweeps_transition_is_the_forwards_transposed(decay):
    """A lead for the carried sweep (docs/PERFORMANCE.md, twenty-seventh session): the sweep's K x K transition over a
    segment (dH walked back from the identity with do = 0) is the transpose of the forward's over the same chunks
    (the state walked from the identity with v = 0), being the adjoint of the same linear map; so a training
    forward that computed the forward's M could spare the sweep's prepare its K columns. Every head of
    gdn_seg_gates and without decay (M of order one), over 8 chunks and a partial one."""
    q, k, v, g, beta, _, _, _ = _inputs(650)
    if not decay:
        g = torch.zeros_like(g)
    K = q.shape[-1]
    eye = torch.eye(K, dtype=q.dtype).expand(1, 1, K, K).clone()
    for h in range(q.shape[2]):
        sl = (slice(None), slice(C * 2, 650), slice(h, h + 1))
        zero = torch.zeros_like(q[sl])
        M_fwd = chunked_core(q[sl], k[sl], zero, g[sl].unsqueeze(-1), beta[sl], q.shape[-1] ** -0.5, eye, C)[1]
        M_sweep = reverse_sweep_ref(q[sl], k[sl], g[sl].unsqueeze(-1), beta[sl], 1.0, zero, eye, C)[2]
        assert _rel(M_sweep, M_fwd.transpose(-1, -2)) < 1e-12, (decay, h)


@pytest.mark.parametrize("lengths", [None, [0, 1, 63, 130, 1, 257, 64, 0, 5, 2000]])
def test_the_segments_chunk_rows_are_the_sequences_own(lengths):
    """The carried training forward (CUDNN_TRAIN_GDN_FWD_WS_TSTORE) writes each segment's chunk states at the rows
    its pass over the segments as sequences computes (the chunk map of ``virtual_cu``): those must be the rows the
    unsplit forward gives the same chunks (``b NT + c`` dense, ``cu_chunks[n] + c`` varlen), for dense sequences with
    a partial last chunk and varlen ones with fewer chunks than segments, and the segments' tokens the sequences'."""
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP

    dev = torch.device("cpu")
    B, T = (2, 2000) if lengths is None else (1, sum(lengths))
    cu_in = None if lengths is None else torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    for nseg in (2, 4, 16):
        cu_v = SP.virtual_cu(cu_in, B, T, nseg, dev)
        _, cuc_v, _, _ = F90.chunk_map(cu_v, 1, B * T, dev)
        cu_real = torch.arange(B + 1, dtype=torch.int32) * T if cu_in is None else cu_in
        NT = -(-T // C)
        for n in range(len(cu_real) - 1):
            ts, te = int(cu_real[n]), int(cu_real[n + 1])
            nch = -(-(te - ts) // C)
            base = n * NT if cu_in is None else int(F90.chunk_map(cu_in, B, T, dev)[1][n])
            for s in range(nseg):
                r = n * nseg + s
                lo = nch * s // nseg
                assert int(cu_v[r]) == ts + lo * C, (nseg, n, s)  # the segment starts at its first chunk's token
                assert int(cuc_v[r]) == base + lo, (nseg, n, s)  # and its chunk rows are the sequence's
            assert int(cu_v[(n + 1) * nseg]) == te, (nseg, n)  # the last segment ends with the sequence

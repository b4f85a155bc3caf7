"""Explicit backward of the chunked delta rule with a per-head (scalar) decay, stage by stage.

This is the specification the SM90 backward kernels are to implement, written as readable
tensor math and checked (``tests/fused/test_delta_rule_bwd.py``) against autograd of
:func:`gated_delta_rule.chunked_core`: equal to float64 rounding. Each stage below is what one
kernel computes, so a kernel can be compared stage by stage. The torch backend keeps autograd
through ``chunked_core``: on the CPU this explicit form, which recomputes the forward in the
backward, took 41 ms against autograd's 22 ms (B=16, T=128, HV=2, K=V=64, C=64, 2 threads).

Forward, per chunk of C tokens entering with the state S (``[K, V]``), ``gc`` the in-chunk
cumulative log decay, ``E_ij = exp(gc_i - gc_j)`` for j <= i (0 above)::

    A  = strictly_lower(beta_i (k_i . k_j) E_ij)        T = (I + A)^-1
    w  = T (beta e^gc k)        u = T (beta v)          vn = u - w S
    o  = (scale e^gc q) S + P vn                        P  = scale (q k^T) * E
    S' = e^(gc_C) S + kd^T vn                           kd = k e^(gc_C - gc)

Backward (``dH`` the gradient of the state leaving a chunk; the last one is the gradient of
the final state):

1. recompute: gc, A, T, w, u, P, kd and the chunk-start states S_c (one forward sweep);
2. reverse sweep over chunks: ``dvn = P^T do + kd dH``, then the gradient of the state
   entering the chunk, ``qg^T do + e^(gc_C) dH - w^T dvn`` (qg = scale e^gc q), which is the
   previous chunk's dH; after the first chunk it is the gradient of the initial state;
3. per chunk, independently: ``dq``, ``dk`` through P, kd, w and A; ``dw = -dvn S^T``,
   ``du = dvn``; through the WY solve ``dkb = T^T dw``, ``dvb = T^T du``,
   ``dA = -strictly_lower(T^T (dw kb^T + du vb^T) T^T)``; ``dbeta``; and ``dgc`` from every
   place gc enters (e^gc on q and on kb, E in P and in A, kd, e^(gc_C)), turned into ``dg``
   by a reverse cumulative sum inside the chunk.

Stages 1 and 3 are parallel over chunks; only the two sweeps are sequential, as in the
forward. The cumulative decay and its differences are float64, as in the forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["chunk_grads", "chunked_core_bwd", "reverse_sweep_ref"]


def _chunks(x: torch.Tensor, nc: int, c: int) -> torch.Tensor:
    """[B, T, HV, D] -> [B, HV, NC, C, D], zero-padding the tail."""
    b, t, hv, d = x.shape
    if nc * c != t:
        x = F.pad(x, (0, 0, 0, 0, 0, nc * c - t))
    return x.reshape(b, nc, c, hv, d).permute(0, 3, 1, 2, 4)


def _unchunk(x: torch.Tensor, t: int) -> torch.Tensor:
    """[B, HV, NC, C, D] -> [B, T, HV, D]."""
    b, hv, nc, c, d = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(b, nc * c, hv, d)[:, :t]


def _pair_sums(t: torch.Tensor) -> torch.Tensor:
    """For M_ij = m_ij exp(gc_i - gc_j) and t = dM * M: the gradient sum_j t_ij - sum_i t_ji per row."""
    return t.sum(-1) - t.sum(-2)


def _recompute(q, k, v, g, b, scale, C):
    """Stage 1 (no state yet): the chunk quantities of the forward, on chunked tensors."""
    dt = q.dtype
    gc = g.to(torch.float64).cumsum(dim=-2)  # [B, HV, NC, C, 1]
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = lower.tril(-1)
    diff = gc - gc.transpose(-1, -2)
    E = torch.exp(diff.masked_fill(~lower, -math.inf)).to(dt)  # e^(gc_i - gc_j), j <= i
    Es = E * strict
    KK = k @ k.transpose(-1, -2)
    A = b * KK * Es
    eg = torch.exp(gc).to(dt)
    kb, vb = b * eg * k, (None if v is None else b * v)
    eye = torch.eye(C, dtype=dt, device=q.device).expand_as(A)
    Tm = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)  # (I + A)^-1
    glast = gc[..., -1:, :]  # [B, HV, NC, 1, 1]
    kdec = torch.exp(glast - gc).to(dt)  # [B, HV, NC, C, 1]
    return dict(
        E=E, Es=Es, strict=strict, KK=KK, A=A, eg=eg, kb=kb, vb=vb, Tm=Tm, w=Tm @ kb,
        u=None if v is None else Tm @ vb, P=scale * (q @ k.transpose(-1, -2)) * E, qg=scale * eg * q,
        kdec=kdec, kd=k * kdec, dec=torch.exp(glast).to(dt), scale=scale,
    )


def reverse_sweep_ref(q, k, g, beta, scale, do, dS_last, chunk_size):
    """Stage 2 alone, for the reverse-sweep kernel's tests: ``(dvn [B, T, HV, V], dH [B, HV, NC, K, V],
    dS0 [B, HV, K, V])`` from q, k ``[B, T, HV, K]`` (l2-normalized already if the op normalizes),
    g ``[B, T, HV, 1]``, beta ``[B, T, HV]``, do ``[B, T, HV, V]``, dS_last ``[B, HV, K, V]``."""
    T, C = q.shape[1], chunk_size
    NC = -(-T // C)
    lay = ChunkLayout(q.shape[0], T, C)
    q, k, g, do = (lay.to_chunks(x) for x in (q, k, g, do))
    r = _recompute(q, k, None, g, lay.to_chunks(beta.unsqueeze(-1)), scale, C)
    _, _, dHc, dvn, dS0 = sweeps_ref(r, lay, None, dS_last, do)
    return lay.from_chunks(dvn), dHc, dS0


def new_values(r, Sc):
    """``vn = u - w Sc`` of every chunk (chunked, as ``r["u"]``): the values left after the state entering the
    chunk predicted them, what the forward's state pass writes for the output and stage 3 reads."""
    return r["u"] - r["w"] @ Sc


def chunk_grads(q, k, v, b, Sc, dHc, dvn, do, r, vn=None):
    """Stage 3 on chunked tensors (``[B, HV, NC, C, D]``; b ``[..., C, 1]``; Sc and dHc
    ``[B, HV, NC, K, V]``, the state entering and the gradient of the state leaving each chunk;
    dvn from stage 2; r from :func:`_recompute`). Every chunk is independent of the others.
    Returns ``(dq, dk, dv, dg, dbeta)`` chunked (dg ``[..., C, 1]`` after the in-chunk reverse
    cumulative sum, dbeta ``[..., C]``)."""
    E, Es, strict, KK, A, eg = r["E"], r["Es"], r["strict"], r["KK"], r["A"], r["eg"]
    kb, vb, Tm, P, qg = r["kb"], r["vb"], r["Tm"], r["P"], r["qg"]
    kdec, kd, dec = r["kdec"], r["kd"], r["dec"]
    scale = r["scale"]
    dt = q.dtype
    if vn is None:
        vn = new_values(r, Sc)
    dqg = do @ Sc.transpose(-1, -2)  # o = qg S
    dP = do @ vn.transpose(-1, -2)  # o += P vn
    dQK = dP * E * scale
    dq = scale * eg * dqg + dQK @ k
    dk = dQK.transpose(-1, -2) @ q
    dkd = vn @ dHc.transpose(-1, -2)  # S' += kd^T vn
    dk = dk + kdec * dkd
    dw = -(dvn @ Sc.transpose(-1, -2))  # vn = u - w S
    du = dvn
    TmT = Tm.transpose(-1, -2)
    dkb, dvb = TmT @ dw, TmT @ du  # w = T kb, u = T vb
    dTm = dw @ kb.transpose(-1, -2) + du @ vb.transpose(-1, -2)
    dA = -(TmT @ dTm @ TmT) * strict  # T = (I + A)^-1
    dk = dk + b * eg * dkb
    dv = b * dvb
    dAE = dA * Es  # A = b * KK * Es
    dbeta = (eg * k * dkb).sum(-1) + (v * dvb).sum(-1) + (dAE * KK).sum(-1)
    dKK = b * dAE
    dk = dk + dKK @ k + dKK.transpose(-1, -2) @ k

    # the gate: every place gc enters, then dg = reverse cumsum of dgc inside the chunk
    dgc = (dqg * qg).sum(-1) + (dkb * kb).sum(-1)  # e^gc on q and on kb
    dgc = dgc + _pair_sums(dP * P) + _pair_sums(dA * A)  # E in P and in A
    kdt = (dkd * kd).sum(-1)  # kd_i = k_i e^(gc_C - gc_i)
    tail = kdt.sum(-1, keepdim=True) + (Sc * dHc).sum((-1, -2)).unsqueeze(-1) * dec[..., 0, :]  # d gc_C
    dgc = dgc - kdt
    dgc = torch.cat([dgc[..., :-1], dgc[..., -1:] + tail], dim=-1)
    dg = dgc.to(torch.float64).flip(-1).cumsum(-1).flip(-1).to(dt).unsqueeze(-1)  # [B, HV, NC, C, 1]
    return dq, dk, dv, dg, dbeta


def chunked_core_bwd(q, k, v, g, beta, scale, S0, do, dS_last, chunk_size):
    """Gradients of ``chunked_core(q, k, v, g, beta, scale, S0, chunk_size)`` for a scalar decay.

    q, k ``[B, T, HV, K]``, v and do ``[B, T, HV, V]``, g ``[B, T, HV, 1]`` (log decay), beta
    ``[B, T, HV]``, S0 and dS_last ``[B, HV, K, V]`` (dS_last: the gradient of the final state,
    zeros when it is not used). Returns ``(dq, dk, dv, dg, dbeta, dS0)`` in the inputs' shapes.
    """
    T, dt = q.shape[1], q.dtype
    C = chunk_size
    NC = -(-T // C)
    if NC == 0:
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g),
                torch.zeros_like(beta), dS_last.clone())
    q, k, v, g, do = (_chunks(x, NC, C) for x in (q, k, v, g, do))
    b = _chunks(beta.unsqueeze(-1), NC, C)  # [B, HV, NC, C, 1]

    # ---- stage 1: recompute the forward's chunk quantities; the chunk-start states Sc
    # ---- stage 2: the reverse sweep (state gradients dHc and dvn)
    r = _recompute(q, k, v, g, b, scale, C)
    Sc, _, dHc, dvn, dS0 = sweeps_ref(r, ChunkLayout(q.shape[0], T, C), S0, dS_last, do)

    # ---- stage 3: per-chunk gradients
    dq, dk, dv, dg, dbeta = chunk_grads(q, k, v, b, Sc, dHc, dvn, do, r)
    out = [_unchunk(x, T) for x in (dq, dk, dv, dg)]
    dbeta = _unchunk(dbeta.unsqueeze(-1), T).squeeze(-1)
    return (*out, dbeta, dS0)


# ---------------------------------------------------------------- the kernels' chunk rows
# The SM90 kernels keep one row per chunk for chunk-start states and state gradients
# (``[rows, HV, K, V]``): chunk ``b * NT + c`` of sequence b, or with varlen (B = 1)
# ``cu_chunks[n] + c`` on the upper bound ``T // C + N`` of the chunk count (no host read).
# ChunkLayout maps token-major tensors and those rows to the chunked ``[Bc, HV, NC, C, D]``
# form of the stages above, on the device, without reading cu_seqlens on the host.


class ChunkLayout:
    """Token <-> chunk maps for a dense batch ``[B, T]`` or packed sequences (``cu_seqlens``, B = 1)."""

    def __init__(self, B: int, T: int, C: int, cu_seqlens: torch.Tensor | None = None):
        self.B, self.T, self.C = B, T, C
        self.varlen = cu_seqlens is not None
        if not self.varlen:
            self.NC = -(-T // C)
            return
        dev = cu_seqlens.device
        cu = cu_seqlens.to(torch.long)
        N = cu.numel() - 1
        nch = (cu[1:] - cu[:-1] + C - 1) // C
        cuc = torch.cat([cu.new_zeros(1), torch.cumsum(nch, 0)])
        U = T // C + N
        c = torch.arange(U, device=dev)
        n = torch.searchsorted(cuc[1:], c, right=True).clamp(max=max(N - 1, 0))  # the sequence of chunk c
        self.valid_chunk = c < cuc[-1]
        start = cu[n] + (c - cuc[n]) * C
        tok = start[:, None] + torch.arange(C, device=dev)
        valid = self.valid_chunk[:, None] & (tok < cu[n + 1][:, None])
        self.gidx = torch.where(valid, tok, torch.full_like(tok, T))  # [U, C]; T = a zero row
        t = torch.arange(T, device=dev)
        nt = torch.searchsorted(cu[1:], t, right=True).clamp(max=max(N - 1, 0))
        pos = t - cu[nt]
        self.sidx = (cuc[nt] + pos // C) * C + pos % C  # token -> flat (chunk, slot)
        self.seq = n
        self.first = self.valid_chunk & (c == cuc[n])
        self.last = self.valid_chunk & (c == cuc[n + 1] - 1)
        self.N, self.NC = N, U

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, HV, D]`` -> ``[Bc, HV, NC, C, D]`` (zeros past every sequence's end)."""
        if not self.varlen:
            return _chunks(x, self.NC, self.C)
        xp = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])
        return xp[self.gidx].permute(2, 0, 1, 3).unsqueeze(0)

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """``[Bc, HV, NC, C, D]`` -> ``[B, T, HV, D]``."""
        if not self.varlen:
            return _unchunk(y, self.T)
        hv, d = y.shape[1], y.shape[-1]
        flat = y[0].permute(1, 2, 0, 3).reshape(self.NC * self.C, hv, d)
        return flat[self.sidx].unsqueeze(0)

    def rows_to_chunks(self, s: torch.Tensor) -> torch.Tensor:
        """Kernel rows ``[rows, HV, K, V]`` -> ``[Bc, HV, NC, K, V]`` (rows past the last chunk: zeros)."""
        if not self.varlen:
            return s[: self.B * self.NC].view(self.B, self.NC, *s.shape[1:]).permute(0, 2, 1, 3, 4)
        s = torch.where(self.valid_chunk[:, None, None, None], s[: self.NC], s.new_zeros(()))
        return s.permute(1, 0, 2, 3).unsqueeze(0)

    def chunks_to_rows(self, s: torch.Tensor) -> torch.Tensor:
        """``[Bc, HV, NC, K, V]`` -> kernel rows ``[rows, HV, K, V]``."""
        return s.permute(0, 2, 1, 3, 4).reshape(-1, *s.shape[1:2], *s.shape[3:])

    def sweep_marks(self, device):
        """Per ``[Bc, NC]`` chunk: the sequence it belongs to, whether it is that sequence's first
        and last chunk, and whether it is a chunk at all (dense: row b's chunks are sequence b's)."""
        if not self.varlen:
            c = torch.arange(self.NC, device=device).expand(self.B, self.NC)
            seq = torch.arange(self.B, device=device)[:, None].expand(self.B, self.NC)
            return seq, c == 0, c == self.NC - 1, torch.ones_like(c, dtype=torch.bool)
        return self.seq[None], self.first[None], self.last[None], self.valid_chunk[None]


def sweeps_ref(r, layout: ChunkLayout, h0, dht, do):
    """Stages 1 and 2 over the chunked form, restarting at every sequence: ``(Sc, final states)``,
    the state entering every chunk and the state leaving each sequence (None when ``r`` has no
    u, i.e. was recomputed without v), and with ``do`` also ``dHc``, ``dvn`` and ``dh0``.
    h0 and dht ``[N, HV, K, V]`` or None. The oracle of the kernels' two sweeps; every batch row
    of the chunked form advances together, each chunk masked by its sequence marks."""
    u, w, kd, dec, P, qg = r["u"], r["w"], r["kd"], r["dec"], r["P"], r["qg"]
    Bc, HV, NC, _, K = w.shape
    N = layout.N if layout.varlen else layout.B
    seq, first, last, valid = layout.sweep_marks(w.device)

    def mask(m):
        return m.view(-1, 1, 1, 1)

    def state_of(states, c, like):  # each row's value of states (None: zeros) for chunk c
        return torch.zeros_like(like) if states is None else states[seq[:, c]]

    Sc = ht = None
    if u is not None:
        V = u.shape[-1]
        S = w.new_zeros(Bc, HV, K, V)
        ht = w.new_zeros(N, HV, K, V) if h0 is None else h0.clone()
        starts = []
        for c in range(NC):
            S = torch.where(mask(first[:, c]), state_of(h0, c, S), S)
            starts.append(torch.where(mask(valid[:, c]), S, torch.zeros_like(S)))
            nxt = dec[:, :, c] * S + kd[:, :, c].transpose(-1, -2) @ (u[:, :, c] - w[:, :, c] @ S)
            S = torch.where(mask(valid[:, c]), nxt, S)
            ends = last[:, c]
            ht[seq[ends, c]] = S[ends]
        Sc = torch.stack(starts, dim=2)
    if do is None:
        return Sc, ht
    V = do.shape[-1]
    dH = w.new_zeros(Bc, HV, K, V)
    dh0 = w.new_zeros(N, HV, K, V) if dht is None else dht.clone()
    dHs, dvns = [None] * NC, [None] * NC
    for c in reversed(range(NC)):
        dH = torch.where(mask(last[:, c]), state_of(dht, c, dH), dH)
        dHs[c] = torch.where(mask(valid[:, c]), dH, torch.zeros_like(dH))
        dv = P[:, :, c].transpose(-1, -2) @ do[:, :, c] + kd[:, :, c] @ dH
        dvns[c] = torch.where(mask(valid[:, c]), dv, torch.zeros_like(dv))
        nxt = qg[:, :, c].transpose(-1, -2) @ do[:, :, c] + dec[:, :, c] * dH - w[:, :, c].transpose(-1, -2) @ dv
        dH = torch.where(mask(valid[:, c]), nxt, dH)
        starts_here = first[:, c]
        dh0[seq[starts_here, c]] = dH[starts_here]
    return Sc, ht, torch.stack(dHs, dim=2), torch.stack(dvns, dim=2), dh0

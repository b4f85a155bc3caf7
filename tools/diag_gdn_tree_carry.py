"""Could a chunk-parallel tree replace the carried split's prepare walk, and at what precision? (twenty-seventh
session; CPU, float64 emulation, no kernel)

The carried split's prepare step walks a whole segment, from zero (L) and from the identity (M), wherever a boundary's
decay allows no 16-chunk warm-up. At FLA's layer-init gates that made the carried sweep slower than the unsplit one
on the H100 (B1 T16384 forward+backward 3.10 against 3.01 ms; docs/PERFORMANCE.md, twenty-seventh session): two
walks of a segment where the unsplit kernel's walks are cheaper per chunk. But a segment's map ``S -> M S + L`` is
the composition of its chunks' affine maps ``S -> A_c S + b_c`` with

    A_c = e^(g_C) I - kd^T w,    b_c = kd^T u    (kd = e^(g_C - g) k; w, u the chunk's WY factors; [K, K], [K, V])

and composition is associative, ``(A2, b2) o (A1, b1) = (A2 A1, A2 b1 + b2)``: M and L could come from a log-depth
tree of ``[K, K] x [K, K + V]`` products, every chunk at once, instead of a walk. What it costs is precision: each
tree level rounds its operands for the tensor cores. This tool emulates one head's segment of ``n`` chunks (K = V =
128, the inputs rounded to bf16 first and then taken as exact) and prints the relative L2 error of the segment's end
state from a realistic start state for:

- ``chain``: the walk as the kernels run it (w S on the state rounded to bf16, v_new rounded to bf16, the state kept
  in float32): the error the unsplit kernel makes anyway;
- ``walk``: the carried split's prepare as built (M and L by that walk from I and from 0, stored in float32, the
  combine in float64);
- ``tree-bf16``, ``tree-tf32``, ``tree-bf16x3``: the tree with its operands rounded to bf16, to TF32, or each split
  into two bf16 parts (three products: hi hi + hi lo + lo hi), each level's results stored in float32.

Gate regimes: ``bench`` (``logsigmoid(U(0, 1))`` a token), ``layer`` (FLA's GatedDeltaNet initialization,
``benchmarks.bench_gated_delta_rule.fla_init_gate``, one head a draw), ``none`` (no decay at all, the worst case).

    PYENV_VERSION=3.12.1 python3.12 tools/diag_gdn_tree_carry.py [--chunks 64] [--draws 4]
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_gated_delta_rule import fla_init_gate  # noqa: E402

C, K, V = 64, 128, 128
D = torch.float64


def bf(x):
    return x.bfloat16().to(D)


def f32(x):
    return x.float().to(D)


def tf32(x):
    """x rounded to TF32's 10 mantissa bits (to nearest, ties away from zero), as a float64 tensor."""
    i = x.float().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32).to(D)


def mm(a, b, how):
    """a @ b as a tensor-core product with float32 accumulation and a float32 result (accumulated in float64 here,
    which is closer than any float32 order): operands rounded to bf16 or TF32, or split in two bf16 parts."""
    if how == "bf16x3":
        ah, bh = bf(a), bf(b)
        al, bl = bf(a - ah), bf(b - bh)
        return f32(ah @ bh + ah @ bl + al @ bh)
    r = bf if how == "bf16" else tf32
    return f32(r(a) @ r(b))


def gates(regime, n, gen):
    """Per-token log decay of one head, float64 [n * C]."""
    if regime == "none":
        return torch.zeros(n * C, dtype=D)
    if regime == "bench":
        return F.logsigmoid(torch.rand(n * C, generator=gen, dtype=D))
    A_log, dt_bias = fla_init_gate(1, "cpu", gen)
    a = torch.randn(n * C, generator=gen, dtype=D)
    return -A_log.exp().to(D) * F.softplus(a + dt_bias.to(D))


def chunks(n, regime, gen):
    """Each chunk's (exact float64) e^(g_C), kd, w, u from bf16 inputs: k l2-normalized, v ~ N(0, 1), beta a sigmoid."""
    k = F.normalize(torch.randn(n * C, K, generator=gen, dtype=D), dim=-1).bfloat16().to(D)
    v = torch.randn(n * C, V, generator=gen, dtype=D).bfloat16().to(D)
    beta = torch.sigmoid(torch.randn(n * C, generator=gen, dtype=D)).bfloat16().to(D)
    g = gates(regime, n, gen).float().to(D)
    out = []
    for c in range(n):
        sl = slice(c * C, (c + 1) * C)
        kc, vc, bc, gc = k[sl], v[sl], beta[sl], g[sl].cumsum(0)
        decay = (gc[:, None] - gc[None, :]).tril().exp().tril(-1)
        A = bc[:, None] * (kc @ kc.T) * decay
        Tm = torch.linalg.inv(torch.eye(C, dtype=D) + A)
        w = Tm @ (bc[:, None] * gc.exp()[:, None] * kc)
        u = Tm @ (bc[:, None] * vc)
        kd = (gc[-1] - gc).exp()[:, None] * kc
        out.append((gc[-1].exp(), kd, w, u))
    return out


def exact_maps(ch):
    return [(e * torch.eye(K, dtype=D) - kd.T @ w, kd.T @ u) for e, kd, w, u in ch]


def walk_exact(maps, S):
    for A, b in maps:
        S = A @ S + b
    return S


def walk_chain(ch, S, zero_u=False):
    """The kernels' walk: state float32, w S on its bf16 copy, v_new rounded to bf16, kd, w, u in bf16."""
    S = f32(S)
    for e, kd, w, u in ch:
        uu = torch.zeros(C, S.shape[1], dtype=D) if zero_u else bf(u)
        vn = bf(uu - bf(w) @ bf(S))
        S = f32(e * S + bf(kd).T @ vn)
    return S


def tree(ch, how):
    """(M, L) of the segment by pairwise composition, level by level, float32 results."""
    level = [(f32(e * torch.eye(K, dtype=D) - bf(kd).T @ bf(w)), f32(bf(kd).T @ bf(u))) for e, kd, w, u in ch]
    while len(level) > 1:
        nxt = []
        for i in range(0, len(level) - 1, 2):
            (A1, b1), (A2, b2) = level[i], level[i + 1]  # chunk order: 1 first, then 2
            nxt.append((mm(A2, A1, how), f32(mm(A2, b1, how) + b2)))
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def rel(a, b):
    return float((a - b).norm() / b.norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, default=64, help="chunks a segment (B1 T16384 in 4 segments: 64)")
    ap.add_argument("--draws", type=int, default=4, help="heads a gate regime (each its own inputs and gates)")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    n = args.chunks
    names = ["chain", "walk", "tree-bf16", "tree-tf32", "tree-bf16x3"]
    print(f"segment of {n} chunks, K = V = {K}: relative L2 error of its end state, float64 exact as reference")
    print("| gates | draw | log decay a segment | " + " | ".join(names) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in names) + " |")
    for regime in ("bench", "layer", "none"):
        for d in range(args.draws):
            prev, ch = chunks(n, regime, gen), chunks(n, regime, gen)
            S0 = walk_exact(exact_maps(prev), torch.zeros(K, V, dtype=D))  # a state as a segment leaves it
            ref = walk_exact(exact_maps(ch), S0)
            errs = {"chain": rel(walk_chain(ch, S0), ref)}
            M = walk_chain(ch, torch.eye(K, dtype=D), zero_u=True)
            L = walk_chain(ch, torch.zeros(K, V, dtype=D))
            errs["walk"] = rel(M @ S0 + L, ref)
            for how in ("bf16", "tf32", "bf16x3"):
                M, L = tree(ch, how)
                errs[f"tree-{how}"] = rel(M @ f32(S0) + L, ref)
            logd = float(sum(torch.log(e) for e, *_ in ch))
            print(f"| {regime} | {d} | {logd:.1f} | " + " | ".join(f"{errs[k]:.2e}" for k in names) + " |")


if __name__ == "__main__":
    main()

"""How far does a decay-truncated sequence split (FlashQLA's "warm-up chunks") reach, and what does it cost in
accuracy? A CPU experiment for the plan's step 3 (docs/PERFORMANCE.md, twenty-third session); nothing here is a
kernel or a test.

    python3 tools/diag_gdn_decay_split.py [--T 16384] [--segments 4] [--heads 32]

Part 1, the reach: for two gate regimes, the chunks (64 tokens) a segment boundary needs behind it before the
summed log decay falls below a threshold (-10 as FlashQLA, -20 below float32 rounding), over every boundary of a
T-token sequence cut into ``--segments`` pieces and every head; "fallback" counts the boundaries whose decay never
gets there (the exact carry is needed):

* ``bench``: the benchmark's ``g = logsigmoid(U(0, 1))`` (benchmarks/bench_gated_delta_rule.py).
* ``layer``: a GatedDeltaNet layer at FLA's initialization: ``g = -A softplus(a + dt_bias)`` with ``A ~ U(0, 16)``
  per head, ``dt_bias`` the inverse softplus of ``dt = exp(U(log 1e-3, log 1e-1))`` per head, and the gate input
  ``a ~ N(0, 1)`` per token (an assumption: the projection of unit-variance hidden states).

Part 2, the error: float64, l2-normalized q and k, beta in (0, 1), one sequence cut into segments whose start
states are computed from a zero state ``W`` chunks back (``W`` from the threshold, the whole prefix where it never
falls below), against the unsplit chunked reference (``chunked_core``): the largest |o - o_exact| / max |o_exact|.
"""

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_gated_delta_rule import fla_init_gate
from cudnn_train.fused.gated_delta_rule import chunked_core

C = 64


def gates(regime: str, T: int, HV: int, gen: torch.Generator) -> torch.Tensor:
    """[T, HV] float64 log decays."""
    if regime == "bench":
        return F.logsigmoid(torch.rand(T, HV, generator=gen, dtype=torch.float64))
    A_log, dt_bias = (t.double() for t in fla_init_gate(HV, device="cpu", generator=gen))
    a = torch.randn(T, HV, generator=gen, dtype=torch.float64)
    return -A_log.exp() * F.softplus(a + dt_bias)


def warmup_chunks(g: torch.Tensor, start: int, threshold: float) -> int | None:
    """Chunks behind token ``start`` (a chunk boundary) until their summed log decay is below ``threshold``;
    None when the whole prefix never gets there."""
    total = 0.0
    for w in range(1, start // C + 1):
        total += float(g[start - w * C:start - (w - 1) * C].sum())
        if total < threshold:
            return w
    return None


def reach(regime: str, T: int, segments: int, HV: int, gen: torch.Generator) -> None:
    g = gates(regime, T, HV, gen)
    per_chunk = g[: T // C * C].reshape(T // C, C, HV).sum(1)
    print(f"{regime}: log decay a chunk, over heads and chunks: median {per_chunk.median():.2f}, "
          f"10th percentile (slowest) {per_chunk.quantile(0.9):.3f}, min {per_chunk.min():.1f}")
    seg = T // segments // C * C
    for threshold in (-10.0, -20.0):
        ws, fallback, n = [], 0, 0
        for s in range(1, segments):
            for h in range(HV):
                n += 1
                w = warmup_chunks(g[:, h], s * seg, threshold)
                if w is None:
                    fallback += 1
                else:
                    ws.append(w)
        ws_t = torch.tensor(ws or [0], dtype=torch.float64)
        print(f"  threshold {threshold:g}: {n} boundaries, fallback {fallback} ({100 * fallback / n:.0f}%), "
              f"warm-up chunks of the others: median {ws_t.median():.0f}, max {ws_t.max():.0f}")


def split_error(regime: str, threshold: float, gen: torch.Generator, T=1024, HV=4, K=32, segments=4) -> float:
    q = F.normalize(torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, HV, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    g = gates(regime, T, HV, gen).unsqueeze(0)
    scale = K ** -0.5
    S0 = torch.zeros(1, HV, K, K, dtype=torch.float64)

    def run(a, b, S):
        return chunked_core(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b, :, None], beta[:, a:b], scale, S, C)

    o_exact, _ = run(0, T, S0)
    seg = T // segments
    outs = [run(0, seg, S0)[0]]
    for s in range(1, segments):
        start = s * seg
        S = torch.zeros_like(S0)
        for h in range(HV):  # each head's start state from its own warm-up window
            w = warmup_chunks(g[0, :, h], start, threshold)
            a = 0 if w is None else start - w * C
            S[:, h] = run(a, start, S0)[1][:, h]
        outs.append(run(start, start + seg, S)[0])
    o = torch.cat(outs, 1)
    return float((o - o_exact).abs().max() / o_exact.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--segments", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    for regime in ("bench", "layer"):
        reach(regime, args.T, args.segments, args.heads, gen)
    for regime in ("bench", "layer"):
        for threshold in (-10.0, -20.0):
            err = split_error(regime, threshold, gen)
            print(f"{regime}, threshold {threshold:g}: o's largest error / max |o| = {err:.2e} (float64)")


if __name__ == "__main__":
    main()

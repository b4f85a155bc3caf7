"""DSA (DeepSeek-V3.2 sparse attention): the torch backend of cudnn_train.fused.dsa vs the peers that import.

    python -m benchmarks.bench_dsa [--json out.json] [--quick]

Ops and shapes (bf16 inputs on a GPU, float32 on CPU; B = 1):
  indexer_logits          H=64, D=128, S=Sk in {4096, 8192}, causal
  indexer_topk            the same logits, k = 2048
  indexer_loss            S=Sk=4096, main attention Hm=128, Dm=576 (absorbed MLA, one shared key),
                          dense and sparse (k = 2048)
  sparse_mla_attention    T=Tk=4096, Dqk=576, d_v=512, H in {16, 64, 128}, topk 2048
``--quick``: tiny shapes of the same structure (a CPU smoke test, seconds).

FLOPs counted (useful work only, no recomputation): indexer scores 2*P*H*D with P the visible
(query, key) pairs; indexer loss adds the main-attention logits 2*P*Hm*Dm (P: visible pairs, or
the selected ones for the sparse loss); sparse MLA 2*T*topk*H*(Dqk + d_v). Backward = 2x forward
for the differentiated matmuls (so fwd+bwd = 3x the differentiated part, + the forward-only
main-attention logits for the loss). topk is reported in GB/s of logits read.

Peers, each used only if it imports and runs (a row's note says why one is absent):
cudnn-frontend's ``cudnn.DSA`` (``indexer_forward_wrapper``, ``indexer_top_k_wrapper``,
``sparse_attention_backward_wrapper``; SM90) and FlashMLA's ``flash_mla_sparse_fwd``. Where a
peer runs, its relL2 against our output is printed in the note (a check, not a test).
"""

from __future__ import annotations

import math

import torch

from benchmarks.common import bench, ceilings, device, parser, report
from cudnn_train import last_path, use_backend
from cudnn_train.fused.dsa import indexer_logits, indexer_loss, indexer_topk, sparse_mla_attention


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    fin = torch.isfinite(a) & torch.isfinite(b)
    return float((a[fin] - b[fin]).norm() / b[fin].norm().clamp_min(1e-30))


def _load_peers() -> dict[str, object]:
    peers: dict[str, object] = {}
    try:
        import cudnn  # noqa: F401

        from cudnn import DSA

        peers["cudnn"] = DSA
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is absent
        peers["cudnn"] = f"cudnn.DSA not importable ({type(e).__name__}: {e})"
    try:
        from flash_mla import flash_mla_sparse_fwd

        peers["flash_mla"] = flash_mla_sparse_fwd
    except Exception as e:  # noqa: BLE001
        peers["flash_mla"] = f"flash_mla not importable ({type(e).__name__}: {e})"
    return peers


def _try(fn):
    """(result, None) or (None, 'ExcType: message') for a peer call."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - a peer that cannot serve a shape is reported, not fatal
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _visible_pairs(s: int, sk: int) -> int:
    return sum(min(t + 1, sk) for t in range(s))


def _row(op, shape, impl, fwd_ms, fwd_flop, fb_ms, fb_flop, ceil, note=""):
    row = {"op": op, "shape": shape, "impl": impl, "fwd ms": fwd_ms,
           "fwd TFLOP/s": fwd_flop / fwd_ms / 1e9 if fwd_flop and fwd_ms == fwd_ms else float("nan"),
           "fwd+bwd ms": fb_ms,
           "fwd+bwd TFLOP/s": fb_flop / fb_ms / 1e9 if fb_flop and fb_ms == fb_ms else float("nan")}
    if ceil.get("bf16_tflops") and fb_ms == fb_ms:
        row["% bf16 mm (fwd+bwd)"] = 100 * fb_flop / fb_ms / 1e9 / ceil["bf16_tflops"]
    row["note"] = note
    return row


def bench_indexer(args, ceil, peers, dev, dt):
    nan = float("nan")
    h, d, topk = (64, 128, 2048) if not args.quick else (4, 16, 16)
    lengths = (4096, 8192) if not args.quick else (64, 96)
    rows = []
    for s in lengths:
        sk = s
        q = torch.randn(1, s, h, d, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(1, sk, d, device=dev, dtype=dt, requires_grad=True)
        w = (torch.randn(1, s, h, device=dev, dtype=dt) * (h**-0.5 * d**-0.5)).requires_grad_()
        pairs = _visible_pairs(s, sk)
        flop = 2 * pairs * h * d
        shape = f"S=Sk={s} H={h} D={d}"
        with use_backend("torch"):
            logits = indexer_logits(q, k, w)
            dl = torch.where(torch.isfinite(logits), torch.randn_like(logits), torch.zeros_like(logits))
            f_ms = bench(lambda: indexer_logits(q, k, w), args.warmup, args.rep)
            fb_ms = bench(lambda: torch.autograd.grad(indexer_logits(q, k, w), (q, k, w), dl), args.warmup, args.rep)
            path = last_path("dsa_indexer_logits")
            rows.append(_row("indexer_logits", shape, "torch", f_ms, flop, fb_ms, 3 * flop, ceil, path))
            ldet = logits.detach()
            t_ms = bench(lambda: indexer_topk(ldet, topk), args.warmup, args.rep)
            ours_idx = indexer_topk(ldet, topk)
            rows.append({"op": "indexer_topk", "shape": f"{shape} k={topk}", "impl": "torch", "fwd ms": t_ms,
                         "GB/s (logits read)": ldet.numel() * 4 / t_ms / 1e6, "note": last_path("dsa_indexer_topk")})
        dsa = peers["cudnn"]
        if isinstance(dsa, str):  # absent: said once at the top
            continue
        k4 = k.detach().unsqueeze(2)
        qd, wd = q.detach(), w.detach()
        out, err = _try(lambda: dsa.indexer_forward_wrapper(qd, k4, wd, ratio=1, sm_scale=1.0)["scores"])
        if err is None:
            c_ms = bench(lambda: dsa.indexer_forward_wrapper(qd, k4, wd, ratio=1, sm_scale=1.0), args.warmup, args.rep)
            rows.append(_row("indexer_logits", shape, "cudnn", c_ms, flop, nan, 0, ceil,
                             f"relL2 vs ours {_rel_l2(out, logits):.2e}; speedup of ours {c_ms / f_ms:.2f}x"))
        else:
            rows.append({"op": "indexer_logits", "shape": shape, "impl": "cudnn", "note": err})
        seq_lens = torch.arange(1, s + 1, device=dev, dtype=torch.int32).clamp(max=sk)
        flat = ldet.reshape(s, sk).contiguous()
        res, err = _try(lambda: dsa.indexer_top_k_wrapper(flat, seq_lens, top_k=topk, next_n=1, return_val=False))
        if err is None:
            c_ms = bench(lambda: dsa.indexer_top_k_wrapper(flat, seq_lens, top_k=topk, next_n=1, return_val=False),
                         args.warmup, args.rep)
            same = _same_sets(res["indices"].view(1, s, -1), ours_idx)
            rows.append({"op": "indexer_topk", "shape": f"{shape} k={topk}", "impl": "cudnn", "fwd ms": c_ms,
                         "GB/s (logits read)": flat.numel() * 4 / c_ms / 1e6,
                         "note": f"rows with the same key set as ours: {same:.4f}; speedup of ours {c_ms / t_ms:.2f}x"})
        else:
            rows.append({"op": "indexer_topk", "shape": f"{shape} k={topk}", "impl": "cudnn", "note": err})
        del q, k, w, logits, dl, ldet
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows whose valid indices form the same set (ties may legitimately differ)."""
    a = torch.where(a >= 0, a.long(), torch.full_like(a.long(), -1)).sort(-1).values
    b = torch.where(b >= 0, b.long(), torch.full_like(b.long(), -1)).sort(-1).values
    return float((a == b).all(-1).float().mean())


def bench_indexer_loss(args, ceil, dev, dt):
    h, d, hm, dm, topk, s = (64, 128, 128, 576, 2048, 4096) if not args.quick else (4, 16, 4, 24, 16, 64)
    q = torch.randn(1, s, h, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, s, d, device=dev, dtype=dt, requires_grad=True)
    w = (torch.randn(1, s, h, device=dev, dtype=dt) * (h**-0.5 * d**-0.5)).requires_grad_()
    query = torch.randn(1, s, hm, dm, device=dev, dtype=dt)
    key = torch.randn(1, s, dm, device=dev, dtype=dt)
    scale = dm**-0.5
    rows = []
    with use_backend("torch"):
        idx = indexer_topk(indexer_logits(q.detach(), k.detach(), w.detach()), topk)
        for variant, tk in (("dense", None), ("sparse", idx)):
            pairs = _visible_pairs(s, s) if tk is None else int((idx >= 0).sum())
            f_idx, f_main = 2 * pairs * h * d, 2 * pairs * hm * dm
            f_ms = bench(lambda: indexer_loss(q, k, w, query, key, scale, topk_indices=tk), args.warmup, args.rep)
            fb_ms = bench(lambda: torch.autograd.grad(indexer_loss(q, k, w, query, key, scale, topk_indices=tk),
                                                      (q, k, w)), args.warmup, args.rep)
            rows.append(_row(f"indexer_loss ({variant})", f"S=Sk={s} H={h} D={d} Hm={hm} Dm={dm}"
                             + ("" if tk is None else f" k={topk}"), "torch", f_ms, f_idx + f_main, fb_ms,
                             3 * f_idx + f_main, ceil, last_path("dsa_indexer_loss")))
    return rows


def bench_sparse_mla(args, ceil, peers, dev, dt):
    nan = float("nan")
    t, dqk, d_v, topk = (4096, 576, 512, 2048) if not args.quick else (64, 72, 64, 16)
    heads = (16, 64, 128) if not args.quick else (2, 4)
    scale = dqk**-0.5
    rows = []
    for h in heads:
        q = torch.randn(t, h, dqk, device=dev, dtype=dt, requires_grad=True)
        kv = torch.randn(t, dqk, device=dev, dtype=dt, requires_grad=True)
        # causal top-k: each query selects topk of its visible keys (-1 where fewer are visible)
        scores = torch.rand(t, t, device=dev).masked_fill(
            torch.ones(t, t, dtype=torch.bool, device=dev).triu(1), float("-inf"))
        vals, idx = scores.topk(topk, dim=-1)
        idx = idx.masked_fill(vals == float("-inf"), -1).int()
        del scores, vals
        flop = 2 * int((idx >= 0).sum()) * h * (dqk + d_v)
        shape = f"T={t} H={h} Dqk={dqk} dv={d_v} k={topk}"
        with use_backend("torch"):
            o, lse = sparse_mla_attention(q, kv, idx, scale, d_v)
            do = torch.randn_like(o)
            f_ms = bench(lambda: sparse_mla_attention(q, kv, idx, scale, d_v), args.warmup, args.rep)
            fb_ms = bench(lambda: torch.autograd.grad(sparse_mla_attention(q, kv, idx, scale, d_v)[0], (q, kv), do),
                          args.warmup, args.rep)
            rows.append(_row("sparse_mla_attention", shape, "torch", f_ms, flop, fb_ms, 3 * flop, ceil,
                             last_path("sparse_mla_attention")))
        fmla = peers["flash_mla"]
        if not isinstance(fmla, str):  # absent: said once at the top
            qd, kv3, i3 = q.detach(), kv.detach().unsqueeze(1), idx.unsqueeze(1)
            res, err = _try(lambda: fmla(qd, kv3, i3, scale, d_v))
            if err is None:
                p_ms = bench(lambda: fmla(qd, kv3, i3, scale, d_v), args.warmup, args.rep)
                rows.append(_row("sparse_mla_attention", shape, "flash_mla (fwd)", p_ms, flop, nan, 0, ceil,
                                 f"relL2 vs ours {_rel_l2(res[0], o):.2e}; speedup of ours {p_ms / f_ms:.2f}x"))
            else:
                rows.append({"op": "sparse_mla_attention", "shape": shape, "impl": "flash_mla (fwd)", "note": err})
        dsa = peers["cudnn"]
        if not isinstance(dsa, str):
            qd, kvd, od, lsed = q.detach(), kv.detach(), o.detach(), lse.detach()
            sink = torch.full((h,), float("-inf"), device=dev, dtype=torch.float32)
            lengths = (idx >= 0).sum(-1).int()

            def cudnn_bwd():
                return dsa.sparse_attention_backward_wrapper(qd, kvd, od, do, lsed, sink, idx, softmax_scale=scale,
                                                             topk_length=lengths)

            res, err = _try(cudnn_bwd)
            if err is None:
                b_ms = bench(cudnn_bwd, args.warmup, args.rep)
                dq_ours = torch.autograd.grad(sparse_mla_attention(q, kv, idx, scale, d_v)[0], q, do)[0]
                rows.append(_row("sparse_mla_attention", shape, "cudnn (bwd only)", nan, 0, b_ms, 2 * flop, ceil,
                                 f"relL2(dq) vs ours {_rel_l2(res['dq'], dq_ours):.2e}"))
            else:
                rows.append({"op": "sparse_mla_attention", "shape": shape, "impl": "cudnn (bwd)", "note": err})
        del q, kv, idx, o, lse, do
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    args = parser(__doc__).parse_args()
    dev = device()
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type != "cuda":
        print("bench_dsa: no CUDA GPU, timing the torch backend on CPU (a smoke test, not a measurement)")
        if not args.quick:
            print("bench_dsa: full DeepSeek shapes on CPU would take very long; pass --quick")
            return
    ceil = ceilings(args.quick)
    peers = _load_peers()
    for name, p in peers.items():
        if isinstance(p, str):
            print(f"peer {name}: {p}")
    torch.manual_seed(0)
    rows = bench_indexer(args, ceil, peers, dev, dt)
    rows += bench_indexer_loss(args, ceil, dev, dt)
    rows += bench_sparse_mla(args, ceil, peers, dev, dt)
    assert all(math.isfinite(r["fwd ms"]) for r in rows if r.get("impl") == "torch")
    report(rows, args, ceil, f"DSA ops, {str(dt).replace('torch.', '')} inputs")


if __name__ == "__main__":
    main()

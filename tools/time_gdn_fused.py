"""The fused GDN backward (``gated_delta_rule_bwd_fused_sm90``) against the two kernels it replaces, the reverse
sweep and stage 3 as the training path calls them (GPU machine), on the same shapes in one run.

    python3 tools/time_gdn_fused.py [--shapes N] [--rounds R] [--profile] [--rows fused,split,...] [--warm ROW]

The inputs are random, shaped as the training path gives them (q, k at their own heads, l2-normalized for the
fused kernel; the in-chunk cumulative log decay; bf16 chunk rows, vn and Tm): timings do not depend on the values.
The two-kernel row is ``reverse_sweep`` (w given, dvn and dH in bf16) then ``chunk_grads`` (vn and Tm read, l2norm
in kernel, the GVA pair sum: the training defaults); the fused rows (``--rows``, default ``fused,split,dq1``: ``fused``
the plain schedule, ``kdb`` with two k buffers, ``split`` with dk's late terms on W2 (``splitdk``), ``split_kdb``
both, ``dq1`` split with dq on W1 too) leave the l2norm's backward and the GVA sum to
the caller, so it does a little less. Median ms of ``benchmarks.common.bench`` (L2 cleared before every call),
rounds alternating. ``--profile``: then each row's profile variant once (its outputs must equal the row's kernel's),
and per warpgroup the mean cycles a chunk of every phase (thread 0's clock64, averaged over the CTAs).
``--warm ROW`` (a row, ``two``, or a row + ``_prof``: its profile variant): only build that row's kernels (on a small input: the kernels' keys do not hold the sizes) and
exit, so that several processes fill the disk cache side by side before the timing.
"""

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_gated_delta_rule import SHAPES
from benchmarks.common import bench


def inputs(B, T, H, HV, K=128, V=128, C=64, dtype=torch.bfloat16):
    dev = "cuda"
    NT = -(-T // C)
    q = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1).to(dtype)
    v, do, vn, w = (torch.randn(B, T, HV, V, device=dev, dtype=dtype) for _ in range(4))
    tm = (torch.randn(B, T, HV, C, device=dev) * 0.1).to(dtype)
    g = F.logsigmoid(torch.rand(B, T, HV, device=dev))
    gc = F.pad(g, (0, 0, 0, NT * C - T)).view(B, NT, C, HV).cumsum(2).view(B, NT * C, HV)[:, :T].contiguous()
    beta = torch.rand(B, T, HV, device=dev)
    hs = (torch.randn(B * NT, HV, K, V, device=dev) * 0.3).to(dtype)
    dht = torch.randn(B, HV, K, V, device=dev)
    return dict(q=q, k=k, v=v, do=do, vn=vn, w=w, tm=tm, gc=gc, beta=beta, hs=hs, dht=dht)


def main():
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B2

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--rows", default="fused,split,dq1", help=f"fused rows, of {', '.join(ROWS)}")
    ap.add_argument("--warm")
    args = ap.parse_args()
    rows = args.rows.split(",")
    for r in rows:
        if r not in ROWS:
            raise SystemExit(f"--rows: {r} is not one of {', '.join(ROWS)}")
    shapes = [(1, 100, 1, 2)] if args.warm else SHAPES[: args.shapes]  # (H, HV: the GVA pair sum, as timed)
    for B, T, H, HV in shapes:
        x = inputs(B, T, H, HV)
        scale = 128**-0.5

        def fused(row, profile=None):
            return BF.fused_backward(x["q"], x["k"], x["v"], x["gc"], x["beta"], x["do"], x["vn"], x["tm"], x["hs"],
                                     x["dht"], scale=scale, profile=profile, **ROWS[row])

        def two():
            dvn, dH, dh0 = B2.reverse_sweep(x["q"], x["k"], x["w"], x["gc"], x["do"], x["dht"], scale=scale,
                                            use_qk_l2norm_in_kernel=True, out_dtype=torch.bfloat16)
            return B3.chunk_grads(x["q"], x["k"], x["v"], x["gc"], x["beta"], x["do"], dvn, x["hs"], dH, scale=scale,
                                  l2norm=True, dqk_dtype=torch.bfloat16, sum_groups=HV == 2 * H, vn=x["vn"],
                                  tm=x["tm"])

        if args.warm:
            if args.warm == "two":
                two()
            elif args.warm.endswith("_prof"):
                BF.get_fused_bwd_kernel(torch.bfloat16, 128, 128, True, False, prof=True,
                                        **ROWS[args.warm[:-5]])
            else:
                fused(args.warm)
            torch.cuda.synchronize()
            return
        for r in rows:
            fused(r)
        two()
        torch.cuda.synchronize()
        for rnd in range(args.rounds):
            tt = bench(two, warmup=25, rep=200)
            parts = [f"sweep + stage 3 {tt:.3f} ms"]
            for r in rows:
                tf = bench(lambda: fused(r), warmup=25, rep=200)
                parts.append(f"{r} {tf:.3f} ms ({tt / tf:.2f}x)")
            print(f"B{B} T{T} H{H} HV{HV} round {rnd + 1}: " + ", ".join(parts), flush=True)
        if args.profile:
            for r in rows:
                profile(BF, fused, r, B, T, HV)


# the fused rows: fused_backward's variant arguments
ROWS = {"fused": dict(kdb=False, splitdk=False), "kdb": dict(kdb=True, splitdk=False),
        "split": dict(kdb=False, splitdk=True), "split_kdb": dict(kdb=True, splitdk=True),
        "dq1": dict(kdb=False, splitdk=True, dq1=True)}


def profile(BF, fused, row, B, T, HV):
    """A row's profile variant once: its outputs against the row's kernel's, then the phases' mean cycles a chunk."""
    NT = -(-T // 64)
    buf = torch.zeros(B * HV, 3, BF.NPH + 1, dtype=torch.int64, device="cuda")
    plain = fused(row)
    got = fused(row, profile=buf)
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(got, plain))
    print(f"  {row}: the profile variant's outputs equal the kernel's: {same}")
    mean = buf.double().mean(0) / NT  # [3, NPH + 1], cycles a chunk
    for w, names in enumerate(BF.PHASES):
        tot = mean[w, BF.NPH].item()
        parts = ", ".join(f"{n} {mean[w, p].item():.0f}" for p, n in enumerate(names) if mean[w, p].item() > 0)
        waits = sum(mean[w, p].item() for p, n in enumerate(names) if "wait" in n)
        print(f"  {row} W{w}: {tot:.0f} cycles a chunk ({waits:.0f} waiting): {parts}", flush=True)


if __name__ == "__main__":
    main()

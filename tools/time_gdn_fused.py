"""The fused GDN backward (``gated_delta_rule_bwd_fused_sm90``) against the two kernels it replaces, the reverse
sweep and stage 3 as the training path calls them (GPU machine), on the same shapes in one run.

    python3 tools/time_gdn_fused.py [--shapes N] [--rounds R]

The inputs are random, shaped as the training path gives them (q, k at their own heads, l2-normalized for the
fused kernel; the in-chunk cumulative log decay; bf16 chunk rows, vn and Tm): timings do not depend on the values.
The two-kernel row is ``reverse_sweep`` (w given, dvn and dH in bf16) then ``chunk_grads`` (vn and Tm read, l2norm
in kernel, the GVA pair sum: the training defaults); the fused rows (one k buffer, and the two-k-buffer variant,
``kdb=True``) leave the l2norm's backward and the GVA sum to
the caller, so it does a little less. Median ms of ``benchmarks.common.bench`` (L2 cleared before every call),
rounds alternating.
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
    args = ap.parse_args()
    for B, T, H, HV in SHAPES[: args.shapes]:
        x = inputs(B, T, H, HV)
        scale = 128**-0.5

        def fused(kdb=False):
            return BF.fused_backward(x["q"], x["k"], x["v"], x["gc"], x["beta"], x["do"], x["vn"], x["tm"], x["hs"],
                                     x["dht"], scale=scale, kdb=kdb)

        def two():
            dvn, dH, dh0 = B2.reverse_sweep(x["q"], x["k"], x["w"], x["gc"], x["do"], x["dht"], scale=scale,
                                            use_qk_l2norm_in_kernel=True, out_dtype=torch.bfloat16)
            return B3.chunk_grads(x["q"], x["k"], x["v"], x["gc"], x["beta"], x["do"], dvn, x["hs"], dH, scale=scale,
                                  l2norm=True, dqk_dtype=torch.bfloat16, sum_groups=HV == 2 * H, vn=x["vn"],
                                  tm=x["tm"])

        fused()
        fused(True)
        two()
        torch.cuda.synchronize()
        for r in range(args.rounds):
            tf = bench(fused, warmup=25, rep=200)
            tk = bench(lambda: fused(True), warmup=25, rep=200)
            tt = bench(two, warmup=25, rep=200)
            print(f"B{B} T{T} H{H} HV{HV} round {r + 1}: fused {tf:.3f} ms, fused two k buffers {tk:.3f} ms, "
                  f"sweep + stage 3 {tt:.3f} ms; two / fused {tt / tf:.2f}x, {tt / tk:.2f}x", flush=True)


if __name__ == "__main__":
    main()

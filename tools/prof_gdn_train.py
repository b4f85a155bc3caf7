"""Where the opt-in SM90 GDN training path's time goes (GPU machine): the forward+backward through
the op with the stage-3 kernel, under ``torch.profiler``, every kernel of one call in launch
order with its CUDA time, then the whole call timed next to FLA's forward+backward in the same run.

    python3 tools/prof_gdn_train.py [--shapes N] [--stage3 kernel|torch]

K = V = 128, bf16, ``use_qk_l2norm_in_kernel=True`` (the benchmark's setting). The total is the
mean over ``--iters`` profiled calls; each line is one launch of the last call, with its share.
"""

import argparse
import os

import torch

from benchmarks.bench_gated_delta_rule import SHAPES, load_peers, make_inputs
from benchmarks.common import bench, kernels_of_last_call
from cudnn_train import last_path
from cudnn_train.fused.gated_delta_rule import chunk_gated_delta_rule


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=1)
    ap.add_argument("--stage3", default="kernel")
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    os.environ["CUDNN_TRAIN_GDN_SM90_TRAIN"] = "1"
    os.environ["CUDNN_TRAIN_GDN_SM90_STAGE3"] = args.stage3
    peers = load_peers()
    kw = dict(use_qk_l2norm_in_kernel=True)
    for B, T, H, HV in SHAPES[: args.shapes]:
        q, k, v, g, beta = make_inputs(B, T, H, HV, 128, 128, requires_grad=True)
        leaves = (q, k, v, g, beta)
        do = torch.randn(B, T, HV, 128, device="cuda", dtype=torch.bfloat16)

        def ours():
            return torch.autograd.grad(chunk_gated_delta_rule(*leaves, **kw)[0], leaves, do)

        for _ in range(2):
            ours()
        torch.cuda.synchronize()
        print(f"B{B} T{T} H{H} HV{HV}: path {last_path('chunk_gated_delta_rule')}", flush=True)
        rows, per_call = kernels_of_last_call(ours, args.iters)
        print(f"  kernel time per fwd+bwd {per_call:.3f} ms, {len(rows)} launches; the last call in order:")
        for name, d in rows:
            if name.startswith("kernel_cutlass_kernel"):  # ours: the module's kernel name follows the prefix
                name = "cutedsl " + name[len("kernel_cutlass_kernel"):][:40] + " ... " + name[-40:]
            print(f"  {d:8.3f} ms {100 * d / per_call:5.1f}%  {name[:110]}")
        t_ours = bench(ours, 5, 20)
        line = f"  whole fwd+bwd: ours {t_ours:.3f} ms"
        for pname, fn in peers.items():
            pl = tuple(t.detach().clone().requires_grad_() for t in leaves)
            try:
                tp = bench(lambda: torch.autograd.grad(fn(*pl, **kw)[0], pl, do), 5, 20)
                line += f", {pname} {tp:.3f} ms ({tp / t_ours:.2f}x)"
            except Exception as e:  # noqa: BLE001
                line += f", {pname} failed: {type(e).__name__}"
        print(line, flush=True)


if __name__ == "__main__":
    main()

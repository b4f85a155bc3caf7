"""Where a SwiGLU MLP forward+backward spends its GPU time (GPU machine): ``fused.swiglu_mlp`` with
each GEMM epilogue (``--epilogues tma,direct``: the epilogues the planner picks -- for dSwiGLU the epilogue
warps, for the other GEMMs the TMA-store one -- or the register-to-global one through
``gemm_sm90._CONFIG_OVERRIDE``; ``ring`` / ``ewg``: dSwiGLU's epilogue in the consumers' store ring, or on
the producer warp group's idle warps) next to eager torch, in one run.

    python3 tools/prof_swiglu_mlp.py [--shapes 0,1] [--epilogues tma,direct] [--rounds 3]

For each implementation: every CUDA kernel of one forward+backward under ``torch.profiler`` in
launch order with its time, the sum of kernel time, and the gap to the wall time of the call (the
median of ``--rounds`` interleaved ``do_bench`` rounds: launch gaps, host stalls, allocator work).
Shapes: 0: M=16384 H=4096 I=12288, 1: M=8192 H=5120 I=17408 (bf16).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.bench_swiglu_mlp import eager  # noqa: E402
from benchmarks.common import bench, kernels_of_last_call  # noqa: E402
from cudnn_train import last_path  # noqa: E402
from cudnn_train.fused.swiglu_mlp import swiglu_mlp  # noqa: E402
from cudnn_train.kernels import gemm_sm90 as gk  # noqa: E402

SHAPES = [(16384, 4096, 12288), (8192, 5120, 17408)]
EPILOGUES = {"tma": None, "direct": {"tma_store": False},
             # dSwiGLU's epilogue on the producer warp group's idle warps (gemm_sm90.KernelSpec.epi_wg) off / on
             "ring": {"epi_wg": False}, "ewg": {"epi_wg": True}}


def clocks() -> str:
    """The SM clock and board power right now (NVML through torch), or why they are not readable."""
    try:
        return f"SM clock {torch.cuda.clock_rate()} MHz, power {torch.cuda.power_draw() / 1000:.0f} W"
    except Exception as e:  # noqa: BLE001 - NVML missing or not permitted: the timings still stand
        return f"clocks not readable ({type(e).__name__})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="0,1")
    ap.add_argument("--epilogues", default="tma,direct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=10)
    ap.add_argument("--rep", type=float, default=40)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("prof_swiglu_mlp needs a GPU; nothing was run.")
        return 0
    for si in (int(s) for s in args.shapes.split(",")):
        m, h, i = SHAPES[si]
        flops = 18.0 * m * h * i
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ws = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5).requires_grad_()
              for n, k in ((i, h), (i, h), (h, i))]
        dout = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)

        def call(f):
            return lambda: torch.autograd.grad(f(x, *ws), (x, *ws), dout)

        impls = {f"ours/{e}": (EPILOGUES[e], call(swiglu_mlp)) for e in args.epilogues.split(",")}
        impls["torch eager"] = (None, call(eager))
        print(f"\n## M={m} H={h} I={i}: forward+backward, {flops / 1e12:.1f} TFLOP", flush=True)
        walls: dict[str, list[float]] = {k: [] for k in impls}
        ksum = {}
        for name, (over, fn) in impls.items():
            gk._CONFIG_OVERRIDE = over
            try:
                fn()
                torch.cuda.synchronize()
                rows, ksum[name] = kernels_of_last_call(fn)
                if name.startswith("ours"):
                    print(f"{name}: {last_path('swiglu_mlp')} / {last_path('swiglu_mlp_bwd')}")
                print(f"{name}: {len(rows)} kernels, {ksum[name]:.3f} ms of kernel time per call")
                for kn, d in rows:
                    print(f"   {d:8.3f} ms  {'cutedsl gemm_sm90' if kn.startswith('kernel_cutlass_kernel') else kn[:90]}")
            finally:
                gk._CONFIG_OVERRIDE = None
        for _ in range(max(1, args.rounds)):  # interleaved: drift of the machine hits every implementation alike
            for name, (over, fn) in impls.items():
                gk._CONFIG_OVERRIDE = over
                try:
                    walls[name].append(bench(fn, args.warmup, args.rep))
                finally:
                    gk._CONFIG_OVERRIDE = None
            print(f"after round {_ + 1}: {clocks()}", flush=True)
        eager_ms = statistics.median(walls["torch eager"])
        print(f"| impl | wall ms (median of {args.rounds}) | rounds | kernel ms | gap ms | TFLOP/s | vs eager |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name in impls:
            w = statistics.median(walls[name])
            print(f"| {name} | {w:.3f} | {' '.join(f'{t:.2f}' for t in walls[name])} | {ksum[name]:.3f} | "
                  f"{w - ksum[name]:.3f} | {flops / w / 1e9:.0f} | {eager_ms / w:.3f}x |", flush=True)
        del x, ws, dout
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

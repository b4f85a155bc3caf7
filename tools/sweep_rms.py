"""Kernel-alone bandwidth of the RMSNormGated kernels for a few tuning knobs (one process, one GPU)."""
import sys

import torch

from benchmarks.common import bench, ceilings
from cudnn_train.kernels import compile as kc
from cudnn_train.kernels import rms_norm_gated_sm90 as k

copy = ceilings()["copy_gbs"]
print(f"copy {copy:.0f} GB/s")
variants = [(128, 4, 8), (128, 4, 6), (128, 4, 12), (256, 4, 4), (128, 8, 4), (256, 2, 4)]
if len(sys.argv) > 1:
    variants = [tuple(map(int, v.split(","))) for v in sys.argv[1:]]
for m, d in [(65536, 256), (65536, 128), (16384, 256)]:
    x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    w = torch.randn(d, device="cuda")
    dy = torch.randn_like(x)
    unit = m * d * 2
    for threads, loads, cps in variants:
        k.THREADS, k.LOADS_IN_FLIGHT, k.CTAS_PER_SM = threads, loads, cps
        kc.clear_memory_cache()
        y, rstd = k.forward(x, g, w, 1e-5, "swish").value
        tf = bench(lambda: k.forward(x, g, w, 1e-5, "swish"))
        tb = bench(lambda: k.backward(dy, x, g, w, rstd, "swish"))
        print(f"M={m} D={d} threads={threads} loads={loads} ctas/SM={cps}: fwd {tf*1e3:.1f} us {3*unit/tf/1e6:.0f} GB/s "
              f"({300*unit/tf/1e6/copy:.0f}%), bwd {tb*1e3:.1f} us {5*unit/tb/1e6:.0f} GB/s ({500*unit/tb/1e6/copy:.0f}%)")

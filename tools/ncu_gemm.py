"""One launch each of our gate/up GEMM and cuBLAS's at M=16384 N=24576 K=4096, for ncu:
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats python3 tools/ncu_gemm.py"""
import sys

import torch

sys.path.insert(0, ".")
from cudnn_train.kernels import gemm_sm90 as gk  # noqa: E402

m, n, k = (int(v) for v in (sys.argv[1:4] if len(sys.argv) > 3 else (16384, 24576, 4096)))
a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    gk.gemm(a, w.t())
    a @ w.t()
torch.cuda.synchronize()

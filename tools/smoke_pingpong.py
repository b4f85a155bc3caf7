"""Quick GPU check of the ping-pong GEMM schedule against torch (odd shapes, every epilogue); a hang
is caught by the caller's timeout. python3 tools/smoke_pingpong.py"""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from cudnn_train.kernels import gemm_sm90 as gk  # noqa: E402

torch.manual_seed(0)
bf = torch.bfloat16


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


worst = 0.0
for (m, n, k) in [(1, 136, 64), (129, 520, 136), (1000, 4096, 512), (4200, 4096, 512), (8192, 8192, 1024), (300, 64, 1024)]:
    a = torch.randn(m, k, device="cuda", dtype=bf)
    w = torch.randn(n, k, device="cuda", dtype=bf) / k**0.5
    a_mmajor = torch.zeros(k, -(-m // 8) * 8, device="cuda", dtype=bf)[:, :m].t()  # column-major, padded rows
    a_mmajor.copy_(a)
    for cm in (1, 2):
        gk._CONFIG_OVERRIDE = dict(pingpong=True, bn=128, cluster_m=cm)
        for name, fn, ref in [
            ("k,k", lambda: gk.gemm(a, w.t()), lambda: a.float() @ w.float().t()),
            ("m,n", lambda: gk.gemm(a_mmajor, w.t().contiguous()), lambda: a.float() @ w.float().t()),
        ]:
            r = rel(fn(), ref())
            worst = max(worst, r)
            print(f"none {name} m{m} n{n} k{k} cm{cm}: rel {r:.2e}", flush=True)
        gk._CONFIG_OVERRIDE = dict(pingpong=True, bn=64, cluster_m=cm)
        wu = torch.randn(n, k, device="cuda", dtype=bf) / k**0.5
        h, g, u = gk.gemm_swiglu(a, w.t(), wu.t(), store_preact=True)
        gr, ur = a.float() @ w.float().t(), a.float() @ wu.float().t()
        r = max(rel(h, F.silu(gr) * ur), rel(g, gr), rel(u, ur))
        worst = max(worst, r)
        print(f"swiglu m{m} n{n} k{k} cm{cm}: rel {r:.2e}", flush=True)
        gk._CONFIG_OVERRIDE = None
torch.cuda.synchronize()
print(f"worst rel {worst:.2e}: {'OK' if worst < 2e-3 else 'FAILED'}")

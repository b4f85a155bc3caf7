"""Host overhead of the RMSNormGated paths (us per call, CPU side, no sync inside the loop)."""
import time

import torch

from cudnn_train.fused.rms_norm_gated import rms_norm_gated
from cudnn_train.kernels import rms_norm_gated_sm90 as k


def host_us(fn, n=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    el = time.perf_counter() - t
    torch.cuda.synchronize()
    return el / n * 1e6


m, d = 1024, 128
x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn_like(x, requires_grad=True)
w = torch.randn(d, device="cuda", requires_grad=True)
dy = torch.randn_like(x)
xd, gd, wd = x.detach(), g.detach(), w.detach()
y, rstd = k.forward(xd, gd, wd, 1e-5, "swish").value
fn = k.get_compiled("fwd", x.dtype, w.dtype, d, "swish")
yy = torch.empty_like(xd)
rr = torch.empty(m, device="cuda")
print(f"raw tvm-ffi launch     {host_us(lambda: fn(xd, gd, wd, yy, rr, 1e-5)):.1f} us")
print(f"torch.add              {host_us(lambda: torch.add(xd, gd)):.1f} us")
print(f"k.forward              {host_us(lambda: k.forward(xd, gd, wd, 1e-5, 'swish')):.1f} us")
print(f"k.backward             {host_us(lambda: k.backward(dy, xd, gd, wd, rstd, 'swish')):.1f} us")
with torch.no_grad():
    print(f"op fwd (no grad)       {host_us(lambda: rms_norm_gated(xd, gd, wd)):.1f} us")
print(f"op fwd (grad)          {host_us(lambda: rms_norm_gated(x, g, w)):.1f} us")
print(f"op fwd+bwd autograd    {host_us(lambda: torch.autograd.grad(rms_norm_gated(x, g, w), (x, g, w), dy)):.1f} us")
class _Triv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, gy):
        return torch.empty_like(gy)


print(f"trivial Function fwd+bwd {host_us(lambda: torch.autograd.grad(_Triv.apply(x), (x,), dy)):.1f} us")
tc = torch.compile(lambda a, b: (a * torch.sigmoid(b)).sum())
print(f"compiled tiny fwd+bwd  {host_us(lambda: torch.autograd.grad(tc(x, g), (x, g))):.1f} us")
with torch.autograd.set_multithreading_enabled(False):
    print(f"op fwd+bwd, engine on the calling thread {host_us(lambda: torch.autograd.grad(rms_norm_gated(x, g, w), (x, g, w), dy)):.1f} us")
import threading


def in_thread(fn, n=2000):
    res = []
    th = threading.Thread(target=lambda: res.append(host_us(fn, n)))
    th.start()
    th.join()
    return res[0]


print(f"k.backward in a worker thread {in_thread(lambda: k.backward(dy, xd, gd, wd, rstd, 'swish')):.1f} us")
print(f"raw launch in a worker thread {in_thread(lambda: fn(xd, gd, wd, yy, rr, 1e-5)):.1f} us")
print(f"torch.add in a worker thread {in_thread(lambda: torch.add(xd, gd)):.1f} us")
import cProfile, pstats
pr = cProfile.Profile()
pr.enable()
for _ in range(500):
    torch.autograd.grad(rms_norm_gated(x, g, w), (x, g, w), dy)
pr.disable()
torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(8)

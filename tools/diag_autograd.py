"""Where the host time of RMSNormGated's forward+backward goes (GPU machine).

Times (us per call, host side, GPU kept far from saturated) a ladder of autograd
Functions whose backward does more and more of what ours does, with the engine's
device thread (default) and on the calling thread; inside each backward it records
the wall time from the ``autograd.grad`` call to the backward's entry, the backward's
own wall time and its thread CPU time.

    python3 tools/diag_autograd.py
"""

import statistics
import threading
import time

import torch

from cudnn_train.fused.rms_norm_gated import rms_norm_gated
from cudnn_train.kernels import rms_norm_gated_sm90 as k

m, d = 1024, 128
x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn_like(x, requires_grad=True)
w = torch.randn(d, device="cuda", requires_grad=True)
dy = torch.randn_like(x)
xd, gd, wd = x.detach(), g.detach(), w.detach()
y0, rstd = k.forward(xd, gd, wd, 1e-5, "swish").value
bwd_fn = k.get_compiled("bwd", x.dtype, w.dtype, d, "swish")
dx0, dg0 = torch.empty_like(xd), torch.empty_like(gd)
part0 = torch.empty(64, d, device="cuda")
dw0 = torch.empty_like(wd)

marks = {"entry": [], "wall": [], "cpu": []}
t_call = [0.0]


def record(fn):
    t0 = time.perf_counter()
    c0 = time.thread_time()
    marks["entry"].append((t0 - t_call[0]) * 1e6)
    out = fn()
    marks["wall"].append((time.perf_counter() - t0) * 1e6)
    marks["cpu"].append((time.thread_time() - c0) * 1e6)
    return out


def make(body):
    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return torch.empty_like(a)

        @staticmethod
        def backward(ctx, gy):
            return record(lambda: body(gy))

    return F


BODIES = {
    "trivial": lambda gy: torch.empty_like(gy),
    "4x empty_like": lambda gy: [torch.empty_like(gy) for _ in range(4)][0],
    "current_stream": lambda gy: (torch.cuda.current_stream(), torch.empty_like(gy))[1],
    "raw tvm-ffi launch": lambda gy: (bwd_fn(dy, xd, gd, wd, rstd, dx0, dg0, part0, dw0), dx0)[1],
    "k.backward": lambda gy: k.backward(dy, xd, gd, wd, rstd, "swish").value[0],
}


def host_us(fn, n=1000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    for v in marks.values():
        v.clear()
    t = time.perf_counter()
    for _ in range(n):
        t_call[0] = time.perf_counter()
        fn()
    el = time.perf_counter() - t
    torch.cuda.synchronize()
    return el / n * 1e6


def row(name, fn):
    for mt in (True, False):
        with torch.autograd.set_multithreading_enabled(mt):
            us = host_us(fn)
        med = {kk: (statistics.median(v) if v else float("nan")) for kk, v in marks.items()}
        print(
            f"{name:28s} engine {'device thread' if mt else 'caller thread'}: {us:7.1f} us/call"
            f" | backward entry after {med['entry']:6.1f} us, wall {med['wall']:6.1f}, cpu {med['cpu']:6.1f}"
        )


for name, body in BODIES.items():
    F = make(body)
    row(name, lambda F=F: torch.autograd.grad(F.apply(x), (x,), dy))

row("op rms_norm_gated", lambda: torch.autograd.grad(rms_norm_gated(x, g, w), (x, g, w), dy))

# OS thread wake-up latency: ping-pong between two Python threads over threading.Event
a, b = threading.Event(), threading.Event()
lat = []


def pong():
    for _ in range(2000):
        a.wait()
        a.clear()
        b.set()


th = threading.Thread(target=pong)
th.start()
for _ in range(2000):
    t0 = time.perf_counter()
    a.set()
    b.wait()
    b.clear()
    lat.append((time.perf_counter() - t0) * 1e6)
th.join()
print(f"thread ping-pong round trip: median {statistics.median(lat):.1f} us")

# the same op captured in a CUDA graph: GPU time only
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        torch.autograd.grad(rms_norm_gated(x, g, w), (x, g, w), dy)
torch.cuda.current_stream().wait_stream(s)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    outs = torch.autograd.grad(rms_norm_gated(x, g, w), (x, g, w), dy)
print(f"op fwd+bwd as a CUDA graph replay: {host_us(graph.replay):.1f} us/call (host)")

"""Does running our GDN kernels slow a peer down afterwards? The diagnostic for an order effect seen
by ``diag_gdn_host.py``: FLA's function (on the FlashQLA route at K = V = 128) took 0.40 ms a forward
before our forward kernels ran in the same process and 0.78 ms after, its host time per call rising
from about 320 to 700 us.

    python3 tools/diag_gdn_order.py [--calls N] [--train]

Times FLA's forward (GPU time as in the benchmark, and host time per call) in phases: first, after
one call of our forward kernels, after ``gc.collect()`` and ``torch.cuda.empty_cache()``, and after
many more calls of ours. Each phase prints the process's Python threads, the current CUDA context,
the caching allocator's reserved bytes, the op's time on its default dispatch, and the functions whose own time under cProfile grew most
against the first phase. ``--train``: the same with forward+backward, ours on the training path.
"""

import argparse
import cProfile
import gc
import pstats
import sys
import threading

import torch

from benchmarks.bench_gated_delta_rule import make_inputs
from benchmarks.common import bench
from cudnn_train import last_path
from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
from diag_gdn_host import host_us  # this folder is on sys.path when run as a script


def context() -> str:
    try:
        from cuda.bindings import driver
        err, ctx = driver.cuCtxGetCurrent()
        return f"{int(ctx):#x}"
    except Exception as e:  # noqa: BLE001 - a diagnostic line, never a failure
        return f"? ({type(e).__name__})"


def own_times(fn, calls: int) -> dict[str, float]:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof).stats
    return {f"{f}:{ln}({name})": v[2] / calls * 1e6 for (f, ln, name), v in st.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--train", action="store_true")
    args = ap.parse_args()
    B, T, H, HV, K = 4, 4096, 16, 32, 128
    q, k, v, g, beta = make_inputs(B, T, H, HV, K, K)
    kw = dict(use_qk_l2norm_in_kernel=True)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    from cudnn_train.fused.gated_delta_rule import chunk_gated_delta_rule as op

    fla_fn = getattr(fla_fn, "_cudnn_train_original", fla_fn)
    if args.train:
        leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v, g, beta))
        do = torch.randn(B, T, HV, K, device="cuda", dtype=torch.bfloat16)
        peer = lambda: torch.autograd.grad(fla_fn(*leaves, **kw)[0], leaves, do)  # noqa: E731
        import os
        os.environ["CUDNN_TRAIN_GDN_SM90_TRAIN"] = "1"
        ours = lambda: torch.autograd.grad(op(*leaves, **kw)[0], leaves, do)  # noqa: E731
    else:
        peer = lambda: fla_fn(q, k, v, g, beta, **kw)  # noqa: E731
        ours = lambda: F90.forward(q, k, v, g, beta, **kw)  # noqa: E731
    base = None
    # the op on its default dispatch: without gradients it declines to FLA (FlashQLA) at this call; with
    # them (--train) it is served by ours. diag_gdn_host.py saw the declining op at 0.42 ms first, 0.78 after
    # our kernels had run, so it is timed in every phase too
    op_call = (lambda: op(q, k, v, g, beta, **kw)) if not args.train else ours  # noqa: E731

    def phase(label: str) -> None:
        nonlocal base
        gpu = bench(peer, 10, 40)
        host = host_us(peer, args.calls)
        names = sorted(t.name for t in threading.enumerate())
        print(f"\n[{label}] peer bench {gpu:.3f} ms, host {host:.1f} us a call; threads {names}; ctx {context()}; "
              f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB; switchinterval {sys.getswitchinterval()}",
              flush=True)
        op_gpu = bench(op_call, 10, 40)
        print(f"    the op: bench {op_gpu:.3f} ms, host {host_us(op_call, args.calls):.1f} us a call "
              f"(served by {last_path('chunk_gated_delta_rule')})", flush=True)
        own = own_times(peer, args.calls)
        if base is None:
            base = own
            top = sorted(own.items(), key=lambda kv: -kv[1])[:10]
            for n, us in top:
                print(f"    {us:8.1f} us  {n[-110:]}")
        else:
            grew = sorted(((us - base.get(n, 0.0), us, n) for n, us in own.items()), key=lambda x: -x[0])[:10]
            for d, us, n in grew:
                print(f"    +{d:7.1f} us (now {us:7.1f})  {n[-100:]}")

    phase("first")
    ours()
    torch.cuda.synchronize()
    phase("after one call of ours")
    gc.collect()
    torch.cuda.empty_cache()
    phase("after gc.collect + empty_cache")
    for _ in range(20):
        ours()
    torch.cuda.synchronize()
    phase("after 20 more calls of ours")
    print(f"\nours: bench {bench(ours, 10, 40):.3f} ms, host {host_us(ours, args.calls):.1f} us a call")


if __name__ == "__main__":
    main()

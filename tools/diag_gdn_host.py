"""Host cost of the op ``chunk_gated_delta_rule`` on the GPU machine: what a call spends in Python
before its kernels run, for the calls the cutedsl backend serves and for those it declines to FLA.

    python3 tools/diag_gdn_host.py [--head-dim 128|64] [--calls N] [--cprofile]

For each path (the op with its default dispatch, FLA's function called directly, our forward kernels
called directly) it prints the GPU time of one call (``benchmarks.common.bench``, L2 cleared, host
launch gaps included as in the benchmark) and the host time of one call (wall time of N calls issued
back to back, with a synchronize only at the end, so the GPU queue never drains while the host works;
when that figure exceeds the GPU time, the call is host-bound). Then the host time of each piece of
the cutedsl backend's dispatch decision (``fla_takes``, ``flash_qla_takes``, the plan lookup), the
op's argument checks and the whole decline. Forward only (no gradients), bf16, B4 T4096 H16 HV32,
``use_qk_l2norm_in_kernel=True``. ``--cprofile``: then N calls of the op and N of FLA's function under
cProfile, the functions with the most own time first.
"""

import argparse
import cProfile
import pstats
import time

import torch

from benchmarks.bench_gated_delta_rule import make_inputs
from benchmarks.common import bench
from cudnn_train import last_path
from cudnn_train.backend import get_op, use_backend
from cudnn_train.fused import gated_delta_rule as G
from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90


def forced(fn):
    with use_backend("fla"):
        return fn()


def host_us(fn, calls: int) -> float:
    """Microseconds of host time per call of ``fn`` (calls issued back to back, one sync at the end)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--cprofile", action="store_true")
    args = ap.parse_args()
    B, T, H, HV, K = 4, 4096, 16, 32, args.head_dim
    q, k, v, g, beta = make_inputs(B, T, H, HV, K, K)  # the benchmark's inputs
    kw = dict(use_qk_l2norm_in_kernel=True)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn

    fla_fn = getattr(fla_fn, "_cudnn_train_original", fla_fn)
    # the keyword arguments the op's fla backend passes FLA (every one explicit)
    op_kw = dict(scale=K ** -0.5, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
                 use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                 allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, chunk_size=64, cu_seqlens_cpu=None)
    fla_kw = {n: x for n, x in op_kw.items() if n not in ("use_gate_in_kernel", "A_log", "dt_bias")}
    paths = {
        "op": lambda: G.chunk_gated_delta_rule(q, k, v, g, beta, **kw),
        "fla direct": lambda: fla_fn(q, k, v, g, beta, **kw),
        # where an op call's extra host time goes: FLA with the op's explicit arguments, the op's fla
        # backend function alone, the op forced onto its fla backend (no cutedsl decline)
        "fla, op's kwargs": lambda: fla_fn(q=q, k=k, v=v, g=g, beta=beta, **fla_kw),
        "fla backend fn": lambda: G._fla_backend(q, k, v, g, beta, **op_kw),
        "op, fla forced": lambda: forced(lambda: G.chunk_gated_delta_rule(q, k, v, g, beta, **kw)),
        "cutedsl direct": lambda: F90.forward(q, k, v, g, beta, **kw),
        "op (again)": lambda: G.chunk_gated_delta_rule(q, k, v, g, beta, **kw),  # an order effect, if any
    }
    print(f"B{B} T{T} H{H} HV{HV} K=V={K}, bf16, forward, no gradients")
    for name, fn in paths.items():
        gpu = bench(fn, 10, 40)
        served = f"  (served by {last_path('chunk_gated_delta_rule')})" if name.startswith("op") else ""
        print(f"  {name:16s} bench {gpu:.3f} ms   host {host_us(fn, args.calls):8.1f} us a call{served}", flush=True)
    scale = K ** -0.5
    pieces = {
        "check args (_check_gdn)": lambda: G._check_gdn(q, k, v, g, beta, None, None, False, None, None, False, False,
                                                        False, None, 64, None),
        "plan lookup (Op.after)": lambda: get_op("chunk_gated_delta_rule").after("cutedsl"),
        "fla_takes": lambda: F90.fla_takes(q, None, 64),
        "flash_qla_takes": lambda: F90.flash_qla_takes(
            q, k, v, g, beta, initial_state=None, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
            scale=scale),
    }
    for name, fn in pieces.items():
        fn()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        print(f"  {name:26s} {(time.perf_counter() - t0) / args.calls * 1e6:8.1f} us", flush=True)
    if args.cprofile:
        for name in ("op", "fla direct"):
            fn = paths[name]
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"\n== {name}: {args.calls} calls under cProfile")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()

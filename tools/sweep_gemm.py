"""Every GEMM of the SwiGLU MLP (forward and backward), ours vs torch on the same layouts, under
several tile configurations: where the MLP's time goes and which configuration each call wants.

    python3 tools/sweep_gemm.py [--sizes 0,1] [--cases fwd_swiglu,...] [--configs default,bn128,...]
                                [--budget SECONDS]

The MLP sizes are those of the issue (0: M=16384 H=4096 I=12288, 1: M=8192 H=5120 I=17408) and
8192^3 (size 2, the plain GEMM alone). A configuration is ``default`` (choose_config) or
``bn<BN>_cm<C>_s<S>_g<G>_t<0|1>_l<0|1>`` with any part left out keeping the default (``bn128``,
``cm1_g16``; ``t0`` is the register-to-global epilogue, ``t1`` the TMA-store one where the call allows
it (for dSwiGLU at 128 x 256, ``t1`` and ``default`` are the epilogue warps, ``w0`` the store ring);
``l1`` has dSwiGLU read gate / up by TMA into the store ring, ``w1`` does its epilogue on the producer
warp group's idle warps, with ``r<N>`` rows a lane in flight); it is applied through ``gemm_sm90._CONFIG_OVERRIDE``. Each line prints ms, TFLOP/s and ours /
torch (torch time over ours: above 1 is faster). Needs an SM90 GPU.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.common import bench  # noqa: E402
from cudnn_train.kernels import gemm_sm90 as gk  # noqa: E402

SIZES = [(16384, 4096, 12288), (8192, 5120, 17408), (8192, 8192, 8192)]
CASES = ["fwd_swiglu", "fwd_gateup", "fwd_down", "bwd_dswiglu", "bwd_dx", "bwd_dx_acc", "bwd_dx_tail", "bwd_wgrad_gu",
         "bwd_wgrad_stacked", "bwd_wgrad_down", "dense"]
FIELDS = {"bn": "bn", "cm": "cluster_m", "s": "stages", "g": "group_m", "t": "tma_store", "l": "epi_tma_load",
          "w": "epi_wg", "r": "ewg_rows"}
FLAGS = ("tma_store", "epi_tma_load", "epi_wg")


def parse_config(name: str) -> dict | None:
    if name == "default":
        return None
    out = {}
    for part in name.split("_"):
        m = re.fullmatch(r"(bn|cm|s|g|t|l|w|r)(\d+)", part)
        if not m:
            raise SystemExit(f"bad config {name!r}: parts are bn<N>, cm<N>, s<N>, g<N>, t<0|1>, l<0|1>, w<0|1>, r<N>")
        field = FIELDS[m.group(1)]
        out[field] = bool(int(m.group(2))) if field in FLAGS else int(m.group(2))
    return out


def make_case(case: str, m: int, h: int, i: int):
    """(flops, torch_fn, ours_fn) for one GEMM of the MLP at (M, H, I)."""
    dev, bf = "cuda", torch.bfloat16
    r = lambda *s: torch.randn(*s, device=dev, dtype=bf)  # noqa: E731
    if case == "dense":  # size 2 only: M x H x I = m x n x k
        a, w = r(m, i), r(h, i) / i**0.5
        return 2.0 * m * h * i, (lambda: a @ w.t()), (lambda: gk.gemm(a, w.t()))
    x, wgu, wd = r(m, h), r(2 * i, h) / h**0.5, r(h, i) / i**0.5
    wg, wu = wgu[:i], wgu[i:]
    if case == "fwd_swiglu":
        def t():
            gu = x @ wgu.t()
            return F.silu(gu[:, :i]) * gu[:, i:]
        return 4.0 * m * h * i, t, (lambda: gk.gemm_swiglu(x, wg.t(), wu.t(), store_preact=True))
    if case == "fwd_gateup":
        return 4.0 * m * h * i, (lambda: x @ wgu.t()), (lambda: gk.gemm(x, wgu.t()))
    hh, dout = r(m, i), r(m, h)
    if case == "fwd_down":
        return 2.0 * m * h * i, (lambda: hh @ wd.t()), (lambda: gk.gemm(hh, wd.t()))
    gate, up = r(m, i), r(m, i)
    if case == "bwd_dswiglu":
        def t():
            dh = dout @ wd
            s = torch.sigmoid(gate)
            return dh * up * s * (1 + gate * (1 - s)), dh * F.silu(gate)
        return 2.0 * m * h * i, t, (lambda: gk.gemm_dswiglu(dout, wd, gate, up))
    dg, du = r(m, i), r(m, i)
    if case == "bwd_dx":  # the first of the two dx GEMMs: dgate @ w_gate
        return 2.0 * m * h * i, (lambda: dg @ wg), (lambda: gk.gemm(dg, wg))
    if case == "bwd_dx_acc":  # both: dx = dgate @ wg, dx += dup @ wu
        def t():
            dx = dg @ wg
            return dx.addmm_(du, wu)

        def o():
            dx = gk.gemm(dg, wg)
            return gk.gemm(du, wu, out=dx, beta=1.0)
        return 4.0 * m * h * i, t, o
    dgu = torch.cat([dg, du], dim=1)
    if case == "bwd_dx_tail":  # both at once: dx = [dgate | dup] @ [wg; wu] (b_tail), vs torch's mm + addmm
        def t():
            dx = dg @ wg
            return dx.addmm_(du, wu)
        return 4.0 * m * h * i, t, (lambda: gk.gemm(dgu, wg, b_tail=wu))
    if case == "bwd_wgrad_stacked":  # [dw_gate; dw_up] = [dgate | dup]^T x in one GEMM, vs torch's two
        def o():
            out = gk.gemm(dgu.t(), x)
            return out[:i], out[i:]
        return 4.0 * m * h * i, (lambda: (dg.t() @ x, du.t() @ x)), o
    if case == "bwd_wgrad_gu":  # dw_gate = dgate^T x (one of two)
        return 2.0 * m * h * i, (lambda: dg.t() @ x), (lambda: gk.gemm(dg.t(), x))
    if case == "bwd_wgrad_down":  # dw_down = dout^T h
        return 2.0 * m * h * i, (lambda: dout.t() @ hh), (lambda: gk.gemm(dout.t(), hh))
    raise SystemExit(f"unknown case {case!r}")


def first(out):
    return out[0] if isinstance(out, tuple) else out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0,1")
    ap.add_argument("--cases", default=",".join(CASES[:-1]))
    ap.add_argument("--configs", default="default")
    ap.add_argument("--warmup", type=float, default=10)
    ap.add_argument("--rep", type=float, default=40)
    ap.add_argument("--budget", type=float, default=1e9, help="stop starting new lines after this many seconds")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("sweep_gemm needs an SM90 GPU; nothing was run.")
        return 0
    t0 = time.time()
    used = []  # the KernelSpecs each call of ours compiled or looked up
    real_get = gk.get_compiled
    gk.get_compiled = lambda spec: (used.append(spec), real_get(spec))[1]
    configs = [(c, parse_config(c)) for c in args.configs.split(",")]
    print(f"{'size':>22} {'case':>15} {'config':>18} {'ours ms':>8} {'TFLOP/s':>8} {'torch ms':>8} {'TFLOP/s':>8} {'ratio':>6}")
    for si in (int(s) for s in args.sizes.split(",")):
        m, h, i = SIZES[si]
        cases = ["dense"] if si == 2 else [c for c in args.cases.split(",") if c != "dense"]
        for case in cases:
            flops, tfn, ofn = make_case(case, m, h, i)
            tt = bench(tfn, warmup=args.warmup, rep=args.rep)
            ref = first(tfn()).float()
            for cname, cfg in configs:
                if time.time() - t0 > args.budget:
                    print("# budget spent")
                    return 0
                gk._CONFIG_OVERRIDE = cfg
                used.clear()
                try:
                    got = first(ofn()).float()
                    rel = ((got - ref).norm() / ref.norm()).item()
                    del got
                    ot = bench(ofn, warmup=args.warmup, rep=args.rep)
                except Exception as e:  # noqa: BLE001 - a configuration the kernel cannot build
                    print(f"{str(SIZES[si]):>22} {case:>15} {cname:>18} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                finally:
                    gk._CONFIG_OVERRIDE = None
                tf = lambda ms: flops / ms / 1e9  # noqa: E731
                print(f"{str(SIZES[si]):>22} {case:>15} {cname:>18} {ot:8.3f} {tf(ot):8.1f} {tt:8.3f} {tf(tt):8.1f} {tt / ot:6.3f} rel {rel:.1e} "
                      + " ".join(f"[bn{u.bn} cm{u.cluster_m} s{u.stages} g{u.group_m} t{int(u.tma_store)} l{int(u.epi_tma_load)}]" for u in used), flush=True)
            del ref
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

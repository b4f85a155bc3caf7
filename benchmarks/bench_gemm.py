"""GEMM benchmark: the SM90 CuTeDSL GEMM vs torch (cuBLAS) eager, torch.compile and quack, in one run.

    python -m benchmarks.bench_gemm [--quick] [--json PATH]

Rows (bf16, float32 accumulation, TFLOP/s = 2*M*N*K / time):
  * dense ``a @ w.t()`` at 8192^3 and at the MLP shapes (M=16384, H=4096, I=12288 and
    M=8192, H=5120, I=17408): the gate/up GEMM (N = 2I, plain and with the SwiGLU epilogue
    against ``mm`` + ``silu * mul``) and the down GEMM (N = H, K = I);
  * grouped ``a_g @ w[g].t()`` for E=8, M=4096 rows each, K=7168, N=4096 and
    E=128, M=256, K=2048, N=1536 against ``torch._grouped_mm`` and a loop of ``mm``.
Each row also reports relL2 of ours against the torch result, and the percentage of the
bf16 matmul ceiling measured at the start of the run. Without a CUDA GPU it prints that it
needs one and exits 0.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks.common import bench, ceilings, parser, report


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def _quack_gemm():
    try:
        from quack.gemm_interface import gemm as qgemm  # type: ignore

        return qgemm, ""
    except Exception as e:  # noqa: BLE001 - optional peer
        return None, f"quack not importable ({type(e).__name__})"


def _row(name, shape, flops, times, ceil, rel):
    row = {"case": name, "shape": shape}
    for k, ms in times.items():
        row[f"{k} ms"] = ms
        row[f"{k} TFLOP/s"] = flops / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
    if ceil.get("bf16_tflops") and "ours" in times:
        row["ours % ceiling"] = 100.0 * row["ours TFLOP/s"] / ceil["bf16_tflops"]
    peers = [v for k, v in times.items() if k != "ours" and v == v]
    if peers and "ours" in times:
        row["speedup vs best peer"] = min(peers) / times["ours"]
    row["relL2 ours"] = rel
    return row


def main(argv=None) -> int:
    args = parser(__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm needs a CUDA GPU (SM90); none here, nothing was run.")
        return 0
    from cudnn_train.kernels import gemm_sm90 as gk

    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        print(f"bench_gemm: the kernel serves SM90 only (this GPU is sm_{cap[0]}{cap[1]}); nothing was run.")
        return 0
    torch.manual_seed(0)
    dev = "cuda"
    bf = torch.bfloat16
    b_kw = dict(warmup=args.warmup, rep=args.rep)
    ceil = ceilings(args.quick)
    qgemm, qwhy = _quack_gemm()
    if qgemm is None:
        print(f"# quack column skipped: {qwhy}")
    mm_compiled = torch.compile(lambda x, y: x @ y)
    swiglu_compiled = torch.compile(lambda x, wg, wu: F.silu(x @ wg) * (x @ wu))
    rows = []

    def dense(name, m, n, k):
        a = torch.randn(m, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf) / k**0.5
        b = w.t()
        ref = a @ b
        ours = gk.gemm(a, b)
        times = {
            "ours": bench(lambda: gk.gemm(a, b), **b_kw),
            "torch.mm": bench(lambda: a @ b, **b_kw),
            "torch.compile": bench(lambda: mm_compiled(a, b), **b_kw),
        }
        if qgemm is not None:
            try:
                qgemm(a, b)
                times["quack"] = bench(lambda: qgemm(a, b), **b_kw)
            except Exception as e:  # noqa: BLE001
                print(f"# quack failed at {name}: {type(e).__name__}: {e}")
        rows.append(_row(name, f"{m}x{n}x{k}", 2.0 * m * n * k, times, ceil, _rel(ours, ref)))
        del a, w, b, ref, ours

    def swiglu(name, m, h, i):
        x = torch.randn(m, h, device=dev, dtype=bf)
        w = torch.randn(2 * i, h, device=dev, dtype=bf) / h**0.5
        wg, wu = w[:i].t(), w[i:].t()
        ref = F.silu(x @ wg) * (x @ wu)
        ours = gk.gemm_swiglu(x, wg, wu)
        wgu = w.t()

        def eager():
            gu = x @ wgu
            return F.silu(gu[:, :i]) * gu[:, i:]

        times = {
            "ours": bench(lambda: gk.gemm_swiglu(x, wg, wu), **b_kw),
            "torch.mm": bench(eager, **b_kw),
            "torch.compile": bench(lambda: swiglu_compiled(x, wg, wu), **b_kw),
        }
        rows.append(_row(name, f"{m}x{2 * i}x{h}", 2.0 * m * 2 * i * h, times, ceil, _rel(ours, ref)))
        del x, w, ref, ours

    def grouped(name, e, m, k, n):
        a = torch.randn(e * m, k, device=dev, dtype=bf)
        w = torch.randn(e, n, k, device=dev, dtype=bf) / k**0.5
        b = w.transpose(1, 2)
        ends = torch.arange(1, e + 1, device=dev, dtype=torch.int32) * m
        offs = torch.cat([torch.zeros(1, device=dev, dtype=torch.int32), ends])
        ours = gk.grouped_gemm(a, b, offs)
        ref = torch.cat([a[g * m:(g + 1) * m] @ b[g] for g in range(e)])
        times = {"ours": bench(lambda: gk.grouped_gemm(a, b, offs), **b_kw)}
        if hasattr(torch, "_grouped_mm"):
            try:
                torch._grouped_mm(a, b, offs=ends)
                times["torch._grouped_mm"] = bench(lambda: torch._grouped_mm(a, b, offs=ends), **b_kw)
            except Exception as ex:  # noqa: BLE001
                print(f"# torch._grouped_mm failed at {name}: {type(ex).__name__}: {ex}")
        times["loop of mm"] = bench(lambda: [a[g * m:(g + 1) * m] @ b[g] for g in range(e)], **b_kw)
        rows.append(_row(name, f"E{e} M{m} K{k} N{n}", 2.0 * e * m * n * k, times, ceil, _rel(ours, ref)))
        del a, w, b, ours, ref

    if args.quick:
        dense("dense", 2048, 2048, 2048)
        swiglu("mlp gate/up + swiglu", 2048, 1024, 2048)
        grouped("grouped", 4, 512, 1024, 1024)
    else:
        dense("dense 8192^3", 8192, 8192, 8192)
        for m, h, i in ((16384, 4096, 12288), (8192, 5120, 17408)):
            dense(f"mlp gate/up M{m} H{h} I{i}", m, 2 * i, h)
            swiglu(f"mlp gate/up + swiglu M{m} H{h} I{i}", m, h, i)
            dense(f"mlp down M{m} H{h} I{i}", m, h, i)
        grouped("grouped E8", 8, 4096, 7168, 4096)
        grouped("grouped E128", 128, 256, 2048, 1536)
        torch.cuda.empty_cache()
    report(rows, args, ceil, "GEMM (bf16): cudnn_train CuTeDSL SM90 vs cuBLAS / torch.compile / quack")
    return 0


if __name__ == "__main__":
    sys.exit(main())

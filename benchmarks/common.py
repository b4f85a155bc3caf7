"""Shared benchmark harness: median timing, ceilings measured in the same run, tables, JSON.

Every bench_<op>.py builds a list of rows (dicts) and calls ``report(rows, args)``.
Timing is the median of CUDA-event timings (``triton.testing.do_bench`` when
importable) after warm-up, on random inputs; on a CPU-only machine the
benchmarks run on CPU with wall-clock timing, which is only good for smoke tests.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from typing import Any, Callable, Iterable

import torch

__all__ = ["parser", "bench", "bench_graphed", "ceilings", "report", "device", "fmt", "kernels_of_last_call"]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", default=None, help="write the rows and the ceilings to this path")
    p.add_argument("--quick", action="store_true", help="small shapes, few repeats (smoke test)")
    p.add_argument("--warmup", type=float, default=25.0, help="warm-up time in ms per measurement")
    p.add_argument("--rep", type=float, default=100.0, help="measured time in ms per measurement")
    p.add_argument(
        "--rounds", type=int, default=1,
        help="measure every implementation this many times, interleaved (round r times each one before "
        "round r+1 starts), and report the median of the rounds: drift of the machine hits all alike",
    )
    return p


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bench(fn: Callable[[], Any], warmup: float = 25.0, rep: float = 100.0) -> float:
    """Median time of ``fn()`` in milliseconds."""
    if torch.cuda.is_available():
        try:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        except ImportError:
            pass
        fn()
        torch.cuda.synchronize()
        times = []
        t_end = time.perf_counter() + rep / 1e3
        while time.perf_counter() < t_end or len(times) < 5:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)
    fn()
    times = []
    t_end = time.perf_counter() + rep / 1e3
    while time.perf_counter() < t_end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_graphed(fn: Callable[[], Any], warmup: float = 25.0, rep: float = 100.0) -> float:
    """Median time of one replay of ``fn`` captured as a CUDA graph: GPU time, launch gaps removed.

    The host cost of issuing the work (Python, the autograd engine, launches) is left out,
    which is what METHOD.md asks for when many small launches are timed; ``bench`` keeps it.
    The L2 is still cleared before every replay (``do_bench``). Returns NaN off a GPU.
    """
    if not torch.cuda.is_available():
        return float("nan")
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture: compile, autotune, allocate
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - not capturable: say so, the eager figure still stands
        print(f"bench_graphed: capture failed ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
        torch.cuda.synchronize()
        return float("nan")
    t = bench(graph.replay, warmup, rep)
    del graph
    return t


def kernels_of_last_call(fn: Callable[[], Any], iters: int = 2) -> tuple[list[tuple[str, float]], float]:
    """``fn()`` run ``iters`` times under ``torch.profiler``: ``([(kernel name, ms)] of the last call
    in launch order, mean kernel ms per call)``. For the tools that say where an op's GPU time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kern = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kern.sort(key=lambda e: e.time_range.start)
    dur = [(getattr(e, "device_time_total", None) or e.cuda_time_total) / 1e3 for e in kern]
    per = len(kern) // iters
    return [(e.name, d) for e, d in zip(kern[-per:], dur[-per:])], sum(dur) / iters


def ceilings(quick: bool = False) -> dict[str, float]:
    """HBM copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s), measured now."""
    if not torch.cuda.is_available():
        return {}
    n = (256 << 20) if not quick else (32 << 20)
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
    m = 8192 if not quick else 2048
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    mm_tflops = 2 * m**3 / (ms * 1e-3) / 1e12
    del src, dst, a, b
    torch.cuda.empty_cache()
    return {"copy_gbs": copy_gbs, "bf16_tflops": mm_tflops}


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def report(rows: Iterable[dict[str, Any]], args: argparse.Namespace, ceil: dict[str, float], title: str) -> None:
    """Print a markdown table of the rows and write JSON to ``--json`` if given."""
    rows = list(rows)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    print(f"\n## {title}  ({dev}, torch {torch.__version__}, {date.today()})")
    if ceil:
        print("ceilings measured in this run: " + ", ".join(f"{k}={v:.0f}" for k, v in ceil.items()))
    if rows:
        cols: list[str] = []
        for r in rows:
            cols += [k for k in r if k not in cols]
        print("| " + " | ".join(cols) + " |")
        print("| " + " | ".join("---" for _ in cols) + " |")
        for r in rows:  # a cell never breaks the table: newlines and pipes are flattened
            cells = (fmt(r.get(c, "")).replace("\n", " ").replace("|", "/") for c in cols)
            print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"title": title, "device": dev, "torch": torch.__version__, "date": str(date.today()),
                 "argv": sys.argv, "ceilings": ceil, "rows": rows},
                f,
                indent=1,
            )

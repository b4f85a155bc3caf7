"""SwiGLU MLP forward+backward: ``fused.swiglu_mlp`` (cutedsl GEMMs) vs eager torch, torch.compile,
quack's ``gemm_act`` MLP and Liger's SwiGLU when importable, in one run.

    python -m benchmarks.bench_swiglu_mlp [--quick] [--rounds N] [--json PATH]

Shapes (bf16): M=16384, H=4096, I=12288 and M=8192, H=5120, I=17408 (the issue's; eager was
measured there at 656 and 664 TFLOP/s). FLOPs: forward 2*M*H*2I + 2*M*I*H = 6*M*H*I,
forward+backward 3x that (18*M*H*I). Also reported: the bytes autograd saves for the
backward (the inputs left out), ours with and without ``recompute`` next to eager's.
Without a CUDA GPU it prints that it needs one and exits 0.
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from benchmarks.common import bench, ceilings, parser, report
from cudnn_train import last_path
from cudnn_train.fused.swiglu_mlp import swiglu_mlp


def eager(x, wg, wu, wd):
    return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)


def _saved_bytes(fn, args) -> int:
    own = {t.untyped_storage().data_ptr() for t in args}
    seen: dict[int, int] = {}

    def pack(t):
        p = t.untyped_storage().data_ptr()
        if p not in own:
            seen[p] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    del out
    return sum(seen.values())


def _peers():
    peers, notes = {}, {}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction  # type: ignore

        def liger(x, wg, wu, wd):
            return F.linear(LigerSiLUMulFunction.apply(F.linear(x, wg), F.linear(x, wu)), wd)

        peers["liger swiglu"] = liger
    except Exception as e:  # noqa: BLE001 - optional peer
        notes["liger swiglu"] = f"not importable ({type(e).__name__})"
    try:
        from quack.linear import act_linear_func  # type: ignore # noqa: F401

        notes["quack"] = "quack.linear found but its MLP entry point differs by version: not timed"
    except Exception as e:  # noqa: BLE001
        notes["quack"] = f"not importable ({type(e).__name__})"
    return peers, notes


def main() -> None:
    args = parser(__doc__).parse_args()
    if not torch.cuda.is_available():
        print("bench_swiglu_mlp: needs a CUDA GPU; nothing to time here")
        return
    ceil = ceilings(args.quick)
    shapes = [(16384, 4096, 12288), (8192, 5120, 17408)] if not args.quick else [(2048, 1024, 2816)]
    peers, notes = _peers()
    compiled = torch.compile(eager)
    rows = []
    for m, h, i in shapes:
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ws = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5).requires_grad_()
              for n, k in ((i, h), (i, h), (h, i))]
        dout = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        impls = {
            "cutedsl": lambda *a: swiglu_mlp(*a),
            "cutedsl recompute": lambda *a: swiglu_mlp(*a, recompute=True),
            "torch eager": eager,
            "torch.compile": compiled,
            **peers,
        }
        flops_f = 6 * m * h * i
        runs: dict[str, list] = {name: [] for name in impls}  # (fwd, fwd+bwd) per round
        failed: dict[str, str] = {}
        names = list(impls)
        for rnd in range(max(1, args.rounds)):
            # rounds interleave the implementations, each round starting one further along, so that drift
            # within a round (the card heating toward its power cap) does not fall on the same ones every round
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                f = impls[name]
                if name in failed:
                    continue
                try:
                    tf = bench(lambda: f(x, *ws), args.warmup, args.rep)
                    tfb = bench(lambda: torch.autograd.grad(f(x, *ws), (x, *ws), dout), args.warmup, args.rep)
                    runs[name].append((tf, tfb))
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    failed[name] = f"failed: {type(e).__name__}: {e}"[:120]
                if name == "cutedsl":
                    path = f"{last_path('swiglu_mlp')} / {last_path('swiglu_mlp_bwd')}"
        times = {}
        for name, f in impls.items():
            if name in failed:
                times[name] = (float("nan"), float("nan"), 0, failed[name])
            else:
                tf = statistics.median(r[0] for r in runs[name])
                tfb = statistics.median(r[1] for r in runs[name])
                times[name] = (tf, tfb, _saved_bytes(f, [x, *ws]), "")
        eager_fb = times["torch eager"][1]
        for name, (tf, tfb, mem, note) in times.items():
            rows.append({
                "M": m, "H": h, "I": i, "impl": name,
                "fwd ms": tf, "fwd TFLOP/s": flops_f / tf / 1e9,
                "fwd+bwd ms": tfb, "fwd+bwd TFLOP/s": 3 * flops_f / tfb / 1e9,
                "% bf16 ceiling": 100 * 3 * flops_f / tfb / 1e9 / ceil["bf16_tflops"],
                "fwd+bwd vs eager": eager_fb / tfb,
                "saved MiB": mem / 2**20,
                "note": note or (path if name.startswith("cutedsl") else ""),
            })
        del x, ws, dout
        torch.cuda.empty_cache()
    for name, why in notes.items():
        rows.append({"impl": name, "note": why})
    report(rows, args, ceil, "swiglu_mlp forward+backward, bf16")


if __name__ == "__main__":
    main()

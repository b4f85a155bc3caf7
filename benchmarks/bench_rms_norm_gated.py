"""Gated RMSNorm: cutedsl vs torch eager, torch.compile and FLA's FusedRMSNormGated, in one run.

    python -m benchmarks.bench_rms_norm_gated [--json out.json] [--quick] [--rounds N]

Bytes counted (the ANCHORS convention): forward 3 tensors of M x D (x, gate read;
y written), forward+backward 8 (forward's 3, then dy, x, gate read and dx, dgate
written); rstd and weight are ignored (under 1%). The kernel-alone rows time one
launch of each kernel with the bytes it must move (forward: x, gate, y; backward:
dy, x, gate, dx, dgate) against the copy bandwidth measured in the same run.

Two timings of forward+backward per implementation: eager (``torch.autograd.grad`` as a user
calls it, host time of Python, the autograd engine and the launches included; the ANCHORS
figures are of this kind) and graphed (the same call captured once as a CUDA graph and
replayed: GPU time only, as a training step under CUDA graphs sees it). With ``--rounds N`` every
implementation is timed N times, interleaved, and each figure is the median of its N rounds.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.common import bench, bench_graphed, ceilings, parser, report
from cudnn_train import last_path
from cudnn_train.fused.rms_norm_gated import rms_norm_gated


def eager(x, g, w, eps=1e-5):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    gf = g.float()
    return (y * gf * torch.sigmoid(gf)).to(x.dtype)


def main() -> None:
    args = parser(__doc__).parse_args()
    if not torch.cuda.is_available():
        print("bench_rms_norm_gated: needs a CUDA GPU; nothing to time here")
        return
    ceil = ceilings(args.quick)
    compiled = torch.compile(eager)
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is absent
        print(f"FLA FusedRMSNormGated not importable: {e}")
        fla_rms_norm_gated = None

    shapes = [(16384, 128), (16384, 256), (65536, 128), (65536, 256)] if not args.quick else [(4096, 128)]
    rows = []
    for m, d in shapes:
        x = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(m, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(d, device="cuda", dtype=torch.float32, requires_grad=True)
        dy = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        unit = m * d * x.element_size()

        impls = {
            "cutedsl": lambda x, g, w: rms_norm_gated(x, g, w, 1e-5),
            "torch": eager,
            "torch.compile": compiled,
        }
        if fla_rms_norm_gated is not None:
            impls["fla"] = lambda x, g, w: fla_rms_norm_gated(x, g, w, None, activation="swish", eps=1e-5)

        samples = {name: [] for name in impls}
        for _ in range(max(1, args.rounds)):
            for name, f in impls.items():
                fwd = bench(lambda: f(x, g, w), args.warmup, args.rep)
                fb = bench(lambda: torch.autograd.grad(f(x, g, w), (x, g, w), dy), args.warmup, args.rep)
                fbg = bench_graphed(lambda: torch.autograd.grad(f(x, g, w), (x, g, w), dy), args.warmup, args.rep)
                samples[name].append((fwd, fb, fbg))
        times = {name: tuple(statistics.median(col) for col in zip(*s)) for name, s in samples.items()}
        assert last_path("rms_norm_gated") == "cutedsl:sm90", last_path("rms_norm_gated")
        best_peer_fb = min(t[1] for n, t in times.items() if n in ("torch.compile", "fla"))
        best_peer_f = min(t[0] for n, t in times.items() if n in ("torch.compile", "fla"))
        best_peer_fbg = min(t[2] for n, t in times.items() if n in ("torch.compile", "fla"))
        for name, (fwd, fb, fbg) in times.items():
            rows.append(
                {
                    "M": m,
                    "D": d,
                    "impl": name,
                    "fwd ms": fwd,
                    "fwd GB/s": 3 * unit / fwd / 1e6,
                    "fwd+bwd ms": fb,
                    "fwd+bwd GB/s": 8 * unit / fb / 1e6,
                    "% copy (fwd+bwd)": 100 * 8 * unit / fb / 1e6 / ceil["copy_gbs"],
                    "fwd speedup vs best peer": best_peer_f / fwd,
                    "fwd+bwd speedup vs best peer": best_peer_fb / fb,
                    "graphed fwd+bwd ms": fbg,
                    "graphed fwd+bwd GB/s": 8 * unit / fbg / 1e6,
                    "graphed speedup vs best peer": best_peer_fbg / fbg,
                }
            )

        # each kernel alone
        from cudnn_train.kernels import rms_norm_gated_sm90 as k

        x2, g2 = x.detach(), g.detach()
        y, rstd = k.forward(x2, g2, w.detach(), 1e-5, "swish").value
        fk = bench(lambda: k.forward(x2, g2, w.detach(), 1e-5, "swish"), args.warmup, args.rep)
        bk = bench(lambda: k.backward(dy, x2, g2, w.detach(), rstd, "swish"), args.warmup, args.rep)
        for name, t, n in (("kernel fwd", fk, 3), ("kernel bwd (+dw sum)", bk, 5)):
            gbs = n * unit / t / 1e6
            rows.append({"M": m, "D": d, "impl": name, "kernel ms": t, "kernel GB/s": gbs, "kernel % copy": 100 * gbs / ceil["copy_gbs"]})
        del x, g, w, dy, x2, g2, y, rstd
        torch.cuda.empty_cache()
    report(rows, args, ceil, "rms_norm_gated, bf16 x/gate, fp32 weight")


if __name__ == "__main__":
    main()

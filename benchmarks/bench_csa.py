"""CSA compressor: the torch backend vs torch.compile of it and cuDNN frontend's fused kernels, in one run.

    python -m benchmarks.bench_csa [--json out.json] [--quick]

Shapes: one packed sequence of 8192 tokens, d = 128, bf16 kv/score, fp32 ape, ratio 4 and
128, coff 1 and 2 (``--quick``: 512 tokens, d = 64, on whatever device is present).
Bytes counted (the minimum traffic of a fused kernel): forward reads kv and score
(``2 * T * coff * d`` elements) and writes the output (``T/ratio * d``); forward+backward
adds reading kv, score and dout and writing dkv and dscore (``4 * T * coff * d + T/ratio
* d``); ape is ignored. cuDNN frontend's ``cudnn.csa`` kernels are SM100-only (ratio 4):
elsewhere the row says why it did not run.
"""

from __future__ import annotations

import torch

from benchmarks.common import bench, ceilings, device, parser, report
from cudnn_train import last_path, use_backend
from cudnn_train.fused import csa as csa_mod
from cudnn_train.fused.csa import csa_compress, csa_cu_seqlens_comp


def _cudnn_peer():
    """cuDNN frontend's CSA compressor wrappers, or the reason they cannot be used."""
    try:
        from cudnn.csa.compressor.api import csa_compressor_backward_wrapper, csa_compressor_forward_wrapper
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is absent
        return None, f"cudnn-frontend CSA compressor not importable ({type(e).__name__}: {e})"
    return (csa_compressor_forward_wrapper, csa_compressor_backward_wrapper), ""


def main() -> None:
    args = parser(__doc__).parse_args()
    dev = device()
    ceil = ceilings(args.quick)
    t, d = (512, 64) if args.quick else (8192, 128)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    peer, peer_reason = _cudnn_peer() if dev.type == "cuda" else (None, "no GPU")
    rows = []
    for ratio in (4, 128):
        for coff in (1, 2):
            kv = torch.randn(t, coff * d, device=dev, dtype=dtype, requires_grad=True)
            score = torch.randn(t, coff * d, device=dev, dtype=dtype, requires_grad=True)
            ape = torch.randn(ratio, coff * d, device=dev, dtype=torch.float32, requires_grad=True)
            cu = torch.tensor([0, t], device=dev, dtype=torch.int32)
            cu_comp = csa_cu_seqlens_comp(cu, ratio)
            n = t // ratio
            dout = torch.randn(n, d, device=dev, dtype=dtype)
            elt = kv.element_size()
            fwd_bytes = (2 * t * coff * d + n * d) * elt
            fb_bytes = fwd_bytes + (4 * t * coff * d + n * d) * elt

            impls = {}

            def ours():
                return csa_compress(kv, score, ape, cu, ratio, coff, cu_seqlens_comp=cu_comp, total_comp=n)

            impls["torch backend"] = (ours, lambda: torch.autograd.grad(ours(), (kv, score, ape), dout))
            if dev.type == "cuda":
                fwd_c = torch.compile(csa_mod._torch_fwd, dynamic=False)
                bwd_c = torch.compile(csa_mod._torch_bwd, dynamic=False)
                impls["torch.compile(torch backend)"] = (
                    lambda: fwd_c(kv, score, ape, cu, cu_comp, n, ratio, coff),
                    lambda: (fwd_c(kv, score, ape, cu, cu_comp, n, ratio, coff),
                             bwd_c(dout, kv, score, ape, cu, cu_comp, ratio, coff)),
                )
            if peer is not None:
                fw, bw = peer
                kd, sd, ad = kv.detach(), score.detach(), ape.detach()
                try:
                    fw(kd, sd, ad, cu, cu_comp, ratio=ratio, coff=coff, total_comp=n)
                    impls["cudnn-frontend"] = (
                        lambda: fw(kd, sd, ad, cu, cu_comp, ratio=ratio, coff=coff, total_comp=n),
                        lambda: (fw(kd, sd, ad, cu, cu_comp, ratio=ratio, coff=coff, total_comp=n),
                                 bw(kd, sd, ad, cu, cu_comp, dout, ratio=ratio, coff=coff)),
                    )
                except (ValueError, RuntimeError) as e:  # outside its validated envelope
                    rows.append({"T": t, "d": d, "ratio": ratio, "coff": coff, "impl": "cudnn-frontend",
                                 "note": f"declined: {str(e)[:90]}"})
            elif ratio == 4 and coff == 2:
                rows.append({"T": t, "d": d, "ratio": ratio, "coff": coff, "impl": "cudnn-frontend", "note": peer_reason})

            with use_backend("torch"):
                times = {}
                for name, (f, fb) in impls.items():
                    try:
                        times[name] = (bench(f, args.warmup, args.rep), bench(fb, args.warmup, args.rep))
                    except Exception as e:  # noqa: BLE001 - report a peer that fails, keep timing the rest
                        rows.append({"T": t, "d": d, "ratio": ratio, "coff": coff, "impl": name,
                                     "note": f"failed: {type(e).__name__}: {str(e)[:80]}"})
            assert last_path("csa_compress").startswith("torch"), last_path("csa_compress")
            base = times["torch backend"]
            for name, (fwd, fb) in times.items():
                row = {"T": t, "d": d, "ratio": ratio, "coff": coff, "impl": name,
                       "fwd ms": fwd, "fwd GB/s": fwd_bytes / fwd / 1e6,
                       "fwd+bwd ms": fb, "fwd+bwd GB/s": fb_bytes / fb / 1e6,
                       "fwd speedup vs torch backend": base[0] / fwd,
                       "fwd+bwd speedup vs torch backend": base[1] / fb}
                if ceil:
                    row["% copy (fwd+bwd)"] = 100 * fb_bytes / fb / 1e6 / ceil["copy_gbs"]
                rows.append(row)
            del kv, score, ape, dout
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    report(rows, args, ceil, f"csa_compress, {str(dtype).replace('torch.', '')} kv/score, fp32 ape, one sequence")


if __name__ == "__main__":
    main()

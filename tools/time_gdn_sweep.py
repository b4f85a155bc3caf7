"""The GDN backward's reverse sweep (stage 2) alone (GPU machine): one warpgroup per CTA against two
splitting every product's N, each with the next chunk's loads in flight (cp.async, the default) and
with synchronous loads, on the same inputs, as the training path calls it (bf16 dvn and dH rows,
l2norm in kernel, no final-state gradient).

    python3 tools/time_gdn_sweep.py [--shapes N] [--split-only | --profile | --early-qk | --p2 | --ws | --tma |
                                     --dchain-tma | --dchain-stores | --vh2 | --dh-tma | --dvn-tma | --seg]

``--seg``: the sweep as called with whole sequences (``CUDNN_TRAIN_GDN_SWEEP_SEG=1``: the split pair where few
sequences leave SMs idle) against the fused kernel cut into segments a sequence (``=auto``, and 2, 4, 8
forced) and the unsplit fused kernel:
relative L2 of the outputs against the unsplit fused kernel's, then timed twice each, alternating.

Also the split sweep (``gated_delta_rule_bwd_split_sm90``: ``dvl`` then ``dchain``, V blocks of 16, 32 and
64; ``CUDNN_TRAIN_GDN_SWEEP_SPLIT=1`` forces it) against the fused kernel's defaults; ``--split-only``: the default and the
split rows only. ``--profile``: only the fused kernel's profile variant (``clock64`` sums per phase,
``SWEEP_PHASES`` of the kernel module, thread 0 of every CTA), its outputs checked against the plain
kernel's, printed as mean cycles a CTA and chunk. ``--early-qk``: the default kernel against the same with
the next chunk's q and k issued early (``early_qk=True``; outputs must be bitwise equal), timed twice each,
alternating, then the early variant's profile. ``--p2``: the split sweep with its ``dvl`` building P in two
passes (``CUDNN_TRAIN_GDN_DVL_P2=1``) against the one pass: bitwise check, timed twice each, alternating.
``--dchain-tma``: the same for the split sweep's ``dchain`` with its loads by TMA (``CUDNN_TRAIN_GDN_DCHAIN_TMA=1``);
``--dchain-stores``: the same for ``dchain``'s dH rows and dvn by TMA stores (``CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA=1``);
``--tma``: the same for the fused kernel's prefetch by TMA (``tma=True``, ``CUDNN_TRAIN_GDN_SWEEP_TMA``), then the
TMA variant's profile. ``--vh2``: the same for the fused kernel on one warpgroup with both V halves in one CTA
(``vh2=True``, ``CUDNN_TRAIN_GDN_SWEEP_VH2``) against a CTA a half (no profile: its grid has half the CTAs).
``--dh-tma``: the same for the fused kernel at its defaults with dH leaving by stmatrix and TMA stores
(``dh_tma=True``, ``CUDNN_TRAIN_GDN_SWEEP_DHTMA``) against the per-element stores. ``--dvn-tma``: the same for dvn
by TMA stores too (``dvn_tma=True``, ``CUDNN_TRAIN_GDN_SWEEP_DVNTMA``) against dH's alone.
``--ws``: the fused kernel (its defaults) against its variant on two specialized warpgroups
(``gated_delta_rule_bwd_ws_sm90``, ``CUDNN_TRAIN_GDN_SWEEP_WS``) and that variant with its loads by TMA
(``CUDNN_TRAIN_GDN_SWEEP_WS_TMA``): relative L2 of the outputs (TMA: bitwise), timed twice each, alternating.

Before timing, the variants' outputs are compared with the default's (relative L2; the prefetch
must not change a bit). Each line: median ms of
``benchmarks.common.bench`` (L2 cleared before every call).
"""

import argparse
import os

import torch
import torch.nn.functional as F

from benchmarks.bench_gated_delta_rule import SHAPES
from benchmarks.common import bench
from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90
from cudnn_train.kernels import gated_delta_rule_bwd_split_sm90 as S
from tests.utils import rel_l2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=2)
    ap.add_argument("--split-only", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="only the fused kernel's profile variant at its defaults: cycles a CTA and chunk per phase")
    ap.add_argument("--early-qk", action="store_true",
                    help="the default fused kernel against early_qk=True: bitwise check, time, profile")
    ap.add_argument("--ws", action="store_true",
                    help="the fused kernel against its specialized-warpgroup variant: compare, time")
    ap.add_argument("--p2", action="store_true",
                    help="the split sweep with dvl's P in two passes against one: bitwise check, time")
    ap.add_argument("--tma", action="store_true",
                    help="the fused kernel with its prefetch by TMA against cp.async: bitwise check, time, profile")
    ap.add_argument("--dchain-stores", action="store_true",
                    help="the split sweep's dchain with its dH and dvn stores by TMA against the element stores")
    ap.add_argument("--dchain-tma", action="store_true",
                    help="the split sweep with dchain's loads by TMA against cp.async: bitwise check, time")
    ap.add_argument("--vh2", action="store_true",
                    help="the fused kernel with both V halves in one CTA against a CTA a half: bitwise check, time")
    ap.add_argument("--dh-tma", action="store_true",
                    help="the fused kernel with dH by stmatrix and TMA stores against per-element stores: bitwise, time")
    ap.add_argument("--dvn-tma", action="store_true",
                    help="the fused kernel with dvn by TMA stores too against dH's alone: bitwise, time")
    ap.add_argument("--seg", action="store_true",
                    help="the sweep as called against the fused kernel in segments (auto, 2, 4, 8) and unsplit")
    ap.add_argument("--only", type=int, default=None, help="only the shape of this index (0: B4 T4096, 1: B1 T16384)")
    args = ap.parse_args()
    shapes = SHAPES[: args.shapes] if args.only is None else [SHAPES[args.only]]
    for B, T, H, HV in shapes:
        K = V = 128
        C = 64
        NT = -(-T // C)
        dev, dt = "cuda", torch.bfloat16
        q = torch.randn(B, T, H, K, device=dev, dtype=dt)
        k = torch.randn(B, T, H, K, device=dev, dtype=dt)
        w = (torch.randn(B, T, HV, K, device=dev) * 0.1).to(dt)
        do = torch.randn(B, T, HV, V, device=dev, dtype=dt)
        g = F.logsigmoid(torch.rand(B, T, HV, device=dev))
        gc = F.pad(g, (0, 0, 0, NT * C - T)).view(B, NT, C, HV).cumsum(2).view(B, NT * C, HV)[:, :T].contiguous()

        def run(wgs, prefetch, split=False):
            return B90.reverse_sweep(q, k, w, gc, do, None, scale=K**-0.5, use_qk_l2norm_in_kernel=True,
                                     out_dtype=dt, wgs=wgs, prefetch=prefetch, split=split)

        def run_split(vb):
            old = os.environ.get("CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB")
            os.environ["CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB"] = str(vb)
            try:
                return run(None, None, True)
            finally:
                if old is None:
                    del os.environ["CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB"]
                else:
                    os.environ["CUDNN_TRAIN_GDN_SWEEP_SPLIT_VB"] = old

        def run_profiled(buf, **kw):
            return B90.reverse_sweep(q, k, w, gc, do, None, scale=K**-0.5, use_qk_l2norm_in_kernel=True,
                                     out_dtype=dt, profile=buf, **kw)

        if args.profile:
            profile(run, run_profiled, B, T, HV, V, NT)
            continue
        if args.seg:  # the fused sweep in segments (CUDNN_TRAIN_GDN_SWEEP_SEG) against the call's default
            def seg_sweep(nseg):
                kw = {} if nseg == "called" else dict(split=False, ws=False, nseg=nseg)
                if nseg in ("auto", "called"):  # "called": with whole sequences, whatever the environment says
                    os.environ["CUDNN_TRAIN_GDN_SWEEP_SEG"] = "auto" if nseg == "auto" else "1"
                    kw["nseg"] = None
                try:
                    return B90.reverse_sweep(q, k, w, gc, do, None, scale=K**-0.5, use_qk_l2norm_in_kernel=True,
                                             out_dtype=dt, **kw)
                finally:
                    os.environ.pop("CUDNN_TRAIN_GDN_SWEEP_SEG", None)

            names = ("called", 1, "auto", 2, 4, 8)
            ref = [t.clone() for t in seg_sweep(1)]
            for nseg in names:
                out = seg_sweep(nseg)
                torch.cuda.synchronize()
                diffs = ", ".join(f"{n} {rel_l2(y.float(), x.float()):.1e}" for n, x, y in zip(("dvn", "dH", "dh0"),
                                                                                                ref, out))
                print(f"B{B} T{T} H{H} HV{HV}: sweep, segments {nseg}: vs the unsplit fused kernel {diffs}; finite "
                      f"{all(bool(torch.isfinite(y).all()) for y in out)}")
            for _ in range(2):
                for nseg in names:
                    print(f"  sweep, segments {str(nseg):8s} {bench(lambda: seg_sweep(nseg), warmup=10, rep=50):.3f} ms")
            continue
        if args.ws:
            def sweep_ws(ws, tma=False):
                return B90.reverse_sweep(q, k, w, gc, do, None, scale=K**-0.5, use_qk_l2norm_in_kernel=True,
                                         out_dtype=dt, split=False, ws=ws, ws_tma=tma)

            a = [t.clone() for t in sweep_ws(False)]
            b = [t.clone() for t in sweep_ws(True)]
            c = sweep_ws(True, True)
            torch.cuda.synchronize()
            diffs = ", ".join(f"{n} {rel_l2(y.float(), x.float()):.1e}" for n, x, y in zip(("dvn", "dH", "dh0"), a, b))
            print(f"B{B} T{T} H{H} HV{HV}: specialized warpgroups vs the fused kernel: {diffs}; "
                  f"finite {all(bool(torch.isfinite(y).all()) for y in b)}; "
                  f"TMA loads bitwise cp.async: {all(torch.equal(x, y) for x, y in zip(b, c))}")
            rows = ((False, False, "fused kernel, defaults"), (True, False, "specialized warpgroups"),
                    (True, True, "specialized, TMA loads"))
            for _ in range(2):
                for ws, tma, name in rows:
                    print(f"  {name:28s} {bench(lambda: sweep_ws(ws, tma), warmup=10, rep=50):.3f} ms")
            continue
        if (args.early_qk or args.p2 or args.dchain_tma or args.dchain_stores or args.tma or args.vh2 or args.dh_tma
                or args.dvn_tma):
            if args.dchain_stores:  # the split sweep's dchain, its dH rows and dvn by 16-byte rows / pairs or TMA
                base, alt, label = dict(dst="0"), dict(dst="1"), ("split, dchain element stores",
                                                                  "split, dchain TMA stores")
            elif args.dvn_tma:  # the fused kernel at its defaults with dH's TMA stores, dvn by elements or TMA
                base, alt, label = (dict(dh_tma=True, dvn_tma=False), dict(dh_tma=True, dvn_tma=True),
                                    ("fused, dH TMA stores", "fused, dH + dvn TMA stores"))
            elif args.dh_tma:  # the fused kernel at its defaults, dH by per-element or TMA stores
                base, alt, label = dict(dh_tma=False), dict(dh_tma=True), ("fused, dH element stores",
                                                                           "fused, dH TMA stores")
            elif args.vh2:  # one warpgroup a half at the defaults' loads, a CTA each or both in one
                base, alt, label = dict(wgs=1, vh2=False), dict(wgs=1, vh2=True), ("fused, a CTA a V half",
                                                                                   "fused, both V halves a CTA")
            elif args.early_qk:
                base, alt, label = dict(early_qk=False), dict(early_qk=True), ("q, k after P", "early q, k")
            elif args.tma:  # the fused kernel at its defaults (split=False), its prefetch by cp.async or TMA
                base, alt, label = dict(tma=False), dict(tma=True), ("fused, cp.async prefetch", "fused, TMA prefetch")
            elif args.p2:
                base, alt, label = dict(p2="0"), dict(p2="1"), ("split, dvl P in one pass", "split, dvl P in two")
            else:
                base, alt, label = dict(dtma="0"), dict(dtma="1"), ("split, dchain cp.async", "split, dchain TMA")
            switches = dict(p2="CUDNN_TRAIN_GDN_DVL_P2", dtma="CUDNN_TRAIN_GDN_DCHAIN_TMA",
                            dst="CUDNN_TRAIN_GDN_DCHAIN_STORE_TMA")

            def sweep(kw):
                if "p2" in kw or "dtma" in kw or "dst" in kw:  # the split sweep, a kernel's variant by its switch (read when fetched)
                    for key, val in kw.items():
                        os.environ[switches[key]] = val
                    return B90.reverse_sweep(q, k, w, gc, do, None, scale=K**-0.5, use_qk_l2norm_in_kernel=True,
                                             out_dtype=dt, split=True)
                return B90.reverse_sweep(q, k, w, gc, do, None, scale=K**-0.5, use_qk_l2norm_in_kernel=True,
                                         out_dtype=dt, split=False, **kw)

            a = [t.clone() for t in sweep(base)]
            b = sweep(alt)
            torch.cuda.synchronize()
            same = all(torch.equal(x, y) for x, y in zip(a, b))
            print(f"B{B} T{T} H{H} HV{HV}: {label[1]}: outputs bitwise {label[0]}'s: {same}")
            for _ in range(2):
                for kw, name in zip((base, alt), label):
                    print(f"  {name:28s} {bench(lambda: sweep(kw), warmup=10, rep=50):.3f} ms")
            if args.early_qk or args.tma:
                profile(run, lambda buf: run_profiled(buf, **alt), B, T, HV, V, NT)
            continue
        variants = (("one warpgroup, prefetch", 1, True), ("one warpgroup, sync loads", 1, False),
                    ("two warpgroups, prefetch", 2, True), ("two warpgroups, sync loads", 2, False))
        default = run(None, None)  # the fused kernel's defaults (split=False)
        for vb in S.VBLOCKS:
            other = run_split(vb)
            torch.cuda.synchronize()
            diffs = ", ".join(f"{n} {rel_l2(b.float(), a.float()):.1e}" for n, a, b in
                              zip(("dvn", "dH", "dh0"), default, other))
            print(f"B{B} T{T} H{H} HV{HV}: split sweep VB {vb} vs the fused kernel: {diffs}")
        print(f"  {'fused kernel, defaults':28s} {bench(lambda: run(None, None), warmup=10, rep=50):.3f} ms")
        for vb in S.VBLOCKS:
            print(f"  {f'split, VB {vb}':28s} {bench(lambda: run_split(vb), warmup=10, rep=50):.3f} ms")
        if args.split_only:
            continue
        base = run(1, True)
        for name, wgs, pf in variants[1:]:
            other = run(wgs, pf)
            torch.cuda.synchronize()
            diffs = ", ".join(f"{n} {rel_l2(b, a):.1e}" for n, a, b in zip(("dvn", "dH", "dh0"), base, other))
            print(f"B{B} T{T} H{H} HV{HV}: {name} vs one warpgroup, prefetch: {diffs}")
        for name, wgs, pf in variants:
            print(f"  {name:28s} {bench(lambda: run(wgs, pf), warmup=10, rep=50):.3f} ms")


def profile(run, run_profiled, B, T, HV, V, NT):
    """The fused sweep's profile variant once (the training path's call, default warpgroups and loads); its
    outputs must equal the plain kernel's, then the mean cycles a CTA spends in each phase, per chunk."""
    ctas = B * HV * (V // B90.VBLOCK)
    buf = torch.zeros(ctas * (len(B90.SWEEP_PHASES) + 1), dtype=torch.int64, device="cuda")
    plain = run(None, None, False)
    prof = run_profiled(buf)
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(plain, prof))
    tab = buf.view(ctas, -1).double().mean(0).tolist()
    print(f"B{B} T{T} HV{HV}: sweep profile variant's outputs equal the plain kernel's: {same}; "
          f"{tab[-1] / NT:,.0f} cycles a CTA and chunk (mean over {ctas} CTAs)")
    for name, cyc in zip(B90.SWEEP_PHASES, tab):
        print(f"    {name:40s} {cyc / NT:10,.0f} cycles  {100 * cyc / tab[-1]:5.1f}%")


if __name__ == "__main__":
    main()

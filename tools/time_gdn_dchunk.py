"""The GDN backward's stage-3 kernel alone (GPU machine): one warpgroup per CTA against two and
four warpgroups splitting every product's N, with and without the overlap variant (the default on
two and four), and the opt-in GVA pair sum in the kernel (a cluster of two CTAs per q/k head) against
the default call plus the training path's sum pass, on the same inputs.

    python3 tools/time_gdn_dchunk.py [--shapes N] [--pair-only] [--profile] [--loads] [--vn] [--persist] [--k64]
                                     [--tma] [--chains] [--relaxed] [--ereg] [--dkksym] [--norm8] [--early-k]

``--profile``: only the default kernel's profile variant, once per shape (its outputs checked bitwise
against the plain kernel's): the mean clock64 cycles a CTA spends in each phase
(``DCHUNK_PHASES``, thread 0 of every CTA). ``--loads``: only the default call (as the training path
makes it) with its loads by cp.async against synchronous loads (outputs checked bitwise). ``--vn``: only the
default call with a vn read (``chunk_grads(vn=...)``, random: the timing does not depend on its values)
against recomputing it, and with the chunk inverses read too (``tm=``), then the reading variants' profiles.
``--persist``: only the training path's call (vn and Tm read) per tile against the persistent variant
(``persist=True``; outputs checked bitwise), then both profiles (cycles a tile). ``--k64``: only K = V = 64, the training path's call (pair sum,
vn and Tm read) on one warpgroup against two (the default since the twelfth session; outputs compared,
relative L2), then the two timings. ``--tma``: only the training path's call with its loads by TMA against
cp.async (``tma=``; per tile, persistent, on four warpgroups; outputs checked bitwise), then both loads'
profiles. ``--relaxed``: only the training path's call (pair sum, vn and Tm read) with the
relaxed first cluster arrive (``relaxed=True``) against the release form, bitwise, then both timed twice,
alternating. ``--ereg``: the same with E exponentiated once into registers (``ereg=True``) against the
default, per tile and persistent. ``--dkksym``: the same with dKK in an input-dtype tile from dA's terms and
dk's two products on it (``dkk_sym=True``; dk not bitwise: the relative L2 of every output is printed), per tile,
persistent, and persistent with E in registers. ``--norm8``: the persistent training call with the l2norm rows eight
threads a row (``norm8=True``) against a thread a row (outputs compared: another summation order), twice each,
alternating. ``--early-k``: the persistent training call with the next tile's k issued early (``early_k=True``),
bitwise check, twice each, alternating. ``--chains``: only the training path's call per tile against the two-chain kernel (``chains=1``:
a warpgroup for the q side and dk, one for the w side) and its variant with dv on the q side (``chains=2``):
outputs compared (relative L2, since their row sums run in another order), the three timings, alternating, then
both profiles (each side's phases).

K = V = 128, bf16, l2norm in kernel. The inputs are random but shaped as the training path gives
them (q, k at their own heads, the in-chunk cumulative log decay, bf16 chunk rows). Before timing,
the variants' outputs are compared with the one-warpgroup kernel's (relative L2; they sum rows in different orders, so they are
close, not bitwise equal). Each line: median ms of ``benchmarks.common.bench`` (L2 cleared before
every call) and the issue's backward FLOP model (3x the forward's) per second.
"""

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_gated_delta_rule import SHAPES
from benchmarks.common import bench
from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3
from tests.utils import rel_l2


def bwd_flops(B, T, HV, K=128, V=128, C=64):
    return 3 * 2 * (3 * C * C * K + 2 * C * C * V + 2 * C * K * V) * B * (-(-T // C)) * HV


def inputs(B, T, H, HV, K=128, V=128, C=64, dtype=torch.bfloat16):
    dev = "cuda"
    NT = -(-T // C)
    q = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    k = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    v = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    do = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    dvn = torch.randn(B, T, HV, V, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.rand(B, T, HV, device=dev))
    gp = F.pad(g, (0, 0, 0, NT * C - T)).view(B, NT, C, HV).cumsum(2).view(B, NT * C, HV)[:, :T]
    beta = torch.rand(B, T, HV, device=dev)
    hs = (torch.randn(B * NT, HV, K, V, device=dev) * 0.3).to(dtype)
    dH = (torch.randn(B * NT, HV, K, V, device=dev) * 0.3).to(dtype)
    return q, k, v, gp.contiguous(), beta, do, dvn, hs, dH


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=2)
    ap.add_argument("--pair-only", action="store_true", help="only the GVA pair sum rows")
    ap.add_argument("--profile", action="store_true", help="only the per-phase cycles of the profile variant")
    ap.add_argument("--loads", action="store_true", help="only cp.async against synchronous loads")
    ap.add_argument("--vn", action="store_true", help="only the forward's vn read against recomputed")
    ap.add_argument("--persist", action="store_true", help="only the persistent variant against the per-tile one")
    ap.add_argument("--k64", action="store_true", help="only K = V = 64: one warpgroup against two")
    ap.add_argument("--tma", action="store_true",
                    help="only the training path's call with the TMA loads against cp.async: per tile, persistent, "
                         "four warpgroups; then the TMA variant's profile")
    ap.add_argument("--chains", action="store_true",
                    help="only the training path's call per tile against the two-chain kernel")
    ap.add_argument("--relaxed", action="store_true",
                    help="only the training path's call with the relaxed first cluster arrive against the release "
                         "form: bitwise check, timed twice each, alternating")
    ap.add_argument("--dkksym", action="store_true",
                    help="only the training path's call with dKK in dA's terms and dk's two products against the "
                         "sT round trip: outputs compared, timed twice each, alternating, per tile, persistent, "
                         "persistent with E in registers")
    ap.add_argument("--norm8", action="store_true",
                    help="only the persistent training call with the l2norm rows eight threads a row against a thread "
                         "a row: outputs compared, timed twice each, alternating")
    ap.add_argument("--early-k", action="store_true",
                    help="only the persistent training call with the next tile's k issued early against the default: "
                         "bitwise check, timed twice each, alternating")
    ap.add_argument("--ereg", action="store_true",
                    help="only the training path's call with E in registers against the default: bitwise check, "
                         "timed twice each, alternating, per tile and persistent")
    args = ap.parse_args()
    for B, T, H, HV in SHAPES[: args.shapes]:
        if args.k64:
            k64_rows(B, T, H, HV)
            continue
        x = inputs(B, T, H, HV)
        scale = 128**-0.5

        def run(wgs, overlap=False):
            return B3.chunk_grads(*x, scale=scale, l2norm=True, wgs=wgs, overlap=overlap)

        if args.profile:
            profile(x, B, T, H, HV, scale)
            continue
        if args.loads:
            loads(x, B, T, H, HV, scale)
            continue
        if args.vn:
            vn_rows(x, B, T, H, HV, scale)
            continue
        if args.persist:
            persist_rows(x, B, T, H, HV, scale)
            continue
        if args.tma:
            tma_rows(x, B, T, H, HV, scale)
            continue
        if args.chains:
            chains_rows(x, B, T, H, HV, scale)
            continue
        if args.relaxed:
            kw = train_kw(x, H, HV, scale)
            rows = (("release arrive", False), ("relaxed arrive", True))
            compare_switch(x, kw, "relaxed", rows + rows, f"B{B} T{T} H{H} HV{HV}: relaxed arrive bitwise the release")
            continue
        if args.dkksym:
            switch_rows(x, B, T, H, HV, scale, "dkk_sym", ("sT round trip", "dKK, two products"),
                        "dKK's two products bitwise the round trip (dk expected not: another summation order)",
                        ((False, False), (True, False), (True, True)))
            continue
        if args.norm8:
            switch_rows(x, B, T, H, HV, scale, "norm8", ("a thread a row", "eight a row"),
                        "eight threads a row bitwise a thread a row (expected not: another summation order)",
                        ((True, None),))
            continue
        if args.early_k:
            switch_rows(x, B, T, H, HV, scale, "early_k", ("k issued late", "k issued early"),
                        "the early k bitwise the late", ((True, None),))
            continue
        if args.ereg:
            switch_rows(x, B, T, H, HV, scale, "ereg", ("default", "E in registers"), "E in registers bitwise the default",
                        ((False, None), (True, None)))
            continue
        variants = (("one warpgroup", 1, False), ("two warpgroups", 2, False), ("four warpgroups", 4, False),
                    ("two, overlap", 2, True), ("four, overlap", 4, True))
        one = None if args.pair_only else run(1)
        for name, wgs, ov in ([] if args.pair_only else variants[1:]):
            other = run(wgs, ov)
            torch.cuda.synchronize()
            diffs = ", ".join(f"{n} {rel_l2(b, a):.1e}" for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), one, other))
            print(f"B{B} T{T} H{H} HV{HV}: {name} vs one: {diffs}")
        fl = bwd_flops(B, T, HV)
        for name, wgs, ov in ([] if args.pair_only else variants):
            ms = bench(lambda: run(wgs, ov), warmup=10, rep=50)
            print(f"  {name:16s} {ms:.3f} ms  {fl / ms / 1e9:.1f} TFLOP/s (backward model)")
        if HV != H:  # the default call plus the training path's GVA sums, against the group sum in the kernel
            from cudnn_train.kernels.gated_delta_rule_train_sm90 import _group_sum

            def per_head_then_sum():
                dq, dk, *rest = B3.chunk_grads(*x, scale=scale, l2norm=True)
                return (_group_sum(dq, H, torch.bfloat16), _group_sum(dk, H, torch.bfloat16), *rest)

            def in_kernel():
                return B3.chunk_grads(*x, scale=scale, l2norm=True, dqk_dtype=torch.bfloat16, sum_groups=True)

            a, b = per_head_then_sum(), in_kernel()
            torch.cuda.synchronize()
            same = all(torch.equal(u, w) for u, w in zip(a, b))
            print(f"B{B} T{T} H{H} HV{HV}: group sum in the kernel bitwise the default + sum pass: {same}")
            for name, fn in (("default + GVA sums", per_head_then_sum), ("group sum in kernel", in_kernel)):
                print(f"  {name:22s} {bench(fn, warmup=10, rep=50):.3f} ms")


def default_kw(H, HV, scale):
    """The stage-3 call's arguments as the training path makes them (the pair sum where HV = 2 H)."""
    kw = dict(scale=scale, l2norm=True)
    if HV == 2 * H:
        kw.update(dqk_dtype=torch.bfloat16, sum_groups=True)
    return kw


def train_kw(x, H, HV, scale):
    """The training path's stage-3 call on the inputs x (:func:`inputs`): :func:`default_kw` with vn and the chunk
    inverses Tm given (random: the timing does not depend on their values)."""
    return dict(default_kw(H, HV, scale), vn=torch.randn_like(x[2]),
                tm=torch.randn(*x[2].shape[:3], 64, device="cuda", dtype=x[2].dtype) * 0.1)


def compare_switch(x, kw, switch, rows, what):
    """``chunk_grads`` with the keyword ``switch`` at each of ``rows`` ((label, value), the reference first):
    every other value's outputs checked bitwise against the first's (``what`` names the claim), then each
    timed."""
    outs = [B3.chunk_grads(*x, **kw, **{switch: on}) for _, on in rows]
    torch.cuda.synchronize()
    same = all(torch.equal(u, w) for other in outs[1:] for u, w in zip(outs[0], other))
    print(f"{what}: {same}")
    if not same:  # how far each output is from the first row's (relative L2)
        for (name, _), other in zip(rows[1:], outs[1:]):
            diffs = ", ".join(f"{n} {rel_l2(b, a):.1e}" for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), outs[0],
                                                                          other))
            print(f"  {name}: {diffs}")
    for name, on in rows:
        print(f"  {name:22s} {bench(lambda: B3.chunk_grads(*x, **kw, **{switch: on}), warmup=10, rep=50):.3f} ms")


def switch_rows(x, B, T, H, HV, scale, switch, names, claim, kernels):
    """The training path's call with the keyword ``switch`` off and on (``names``), at each ``(persist, ereg)`` of
    ``kernels`` (None: the default), through :func:`compare_switch`: twice each, alternating."""
    for persist, ereg in kernels:
        kw = dict(train_kw(x, H, HV, scale), persist=persist)
        if ereg is not None:
            kw["ereg"] = ereg
        rows = ((names[0], False), (names[1], True))
        what = f"B{B} T{T} H{H} HV{HV}{' persistent' if persist else ''}{' E in registers' if ereg else ''}: {claim}"
        compare_switch(x, kw, switch, rows + rows, what)


def loads(x, B, T, H, HV, scale):
    """The default call with its loads by cp.async (three groups, each waited for where first read)
    against the synchronous loads: bitwise the same outputs, then the two timings."""
    compare_switch(x, default_kw(H, HV, scale), "async_loads", (("synchronous loads", False), ("cp.async loads", True)),
                   f"B{B} T{T} H{H} HV{HV}: cp.async loads bitwise the synchronous loads")


def vn_rows(x, B, T, H, HV, scale):
    """The default call recomputing vn against reading one (random, v's shape: the timing does not depend
    on its values), and the profile of the reading variant."""
    from time_gdn_fwd import _report

    kw = default_kw(H, HV, scale)
    vn = torch.randn_like(x[2])
    tm = torch.randn(*x[2].shape[:3], 64, device="cuda", dtype=x[2].dtype) * 0.1
    for name, extra in (("vn recomputed", {}), ("vn read", dict(vn=vn)), ("vn and Tm read", dict(vn=vn, tm=tm))):
        print(f"B{B} T{T}: {name:16s} {bench(lambda: B3.chunk_grads(*x, **kw, **extra), warmup=10, rep=50):.3f} ms")
    ctas = B * (-(-T // 64)) * HV
    buf = torch.zeros(ctas * (len(B3.DCHUNK_PHASES) + 1), dtype=torch.int64, device="cuda")
    for name, extra in (("vn read", dict(vn=vn)), ("vn and Tm read", dict(vn=vn, tm=tm))):
        buf.zero_()
        B3.chunk_grads(*x, profile=buf, **kw, **extra)
        torch.cuda.synchronize()
        _report(f"stage-3 kernel, {name}" + (", pair sum" if HV == 2 * H else ""), buf, B3.DCHUNK_PHASES, ctas)


def persist_rows(x, B, T, H, HV, scale):
    """The training path's call (vn and Tm read; random: the timing does not depend on their values) per tile
    against the persistent variant: bitwise the same outputs, then the two timings."""
    kw = train_kw(x, H, HV, scale)
    compare_switch(x, kw, "persist", (("per tile", False), ("persistent", True)),
                   f"B{B} T{T} H{H} HV{HV}: persistent variant bitwise the per-tile kernel")
    persist_profiles(x, B, T, H, HV, kw)


def persist_profiles(x, B, T, H, HV, kw):
    """The profile variants of the per-tile and the persistent kernel on the same call, cycles a tile: the
    persistent one writes a row per CTA (its sums over its tiles), so its means are divided by the tiles a CTA."""
    from time_gdn_fwd import _report

    from cudnn_train.kernels import compile as kc
    from cudnn_train.kernels.gemm_sm90 import _max_clusters

    tiles = B * (-(-T // 64)) * HV
    n = len(B3.DCHUNK_PHASES) + 1
    buf = torch.zeros(tiles * n, dtype=torch.int64, device="cuda")
    B3.chunk_grads(*x, profile=buf, persist=False, **kw)
    torch.cuda.synchronize()
    _report("stage-3 kernel per tile, vn and Tm read", buf, B3.DCHUNK_PHASES, tiles)
    pw = 2 if kw.get("sum_groups") and HV == 2 * H else 1
    dev = torch.device("cuda")
    sms = kc.num_sms(dev)
    clusters = min(tiles // pw, _max_clusters(dev, pw, sms) if pw > 1 else sms)  # as chunk_grads launches them
    ctas = clusters * pw
    buf.zero_()
    got = B3.chunk_grads(*x, profile=buf, persist=True, persist_ctas=clusters, **kw)
    want = B3.chunk_grads(*x, persist=False, **kw)
    torch.cuda.synchronize()
    print(f"B{B} T{T}: persistent profile variant's outputs equal the per-tile kernel's: "
          f"{all(torch.equal(a, b) for a, b in zip(got, want))}")
    _report("stage-3 kernel persistent, vn and Tm read", buf[: ctas * n], B3.DCHUNK_PHASES, ctas, per=tiles / ctas)


def tma_rows(x, B, T, H, HV, scale):
    """The training path's call (vn and Tm read; random: the timing does not depend on their values) with its loads
    by TMA against cp.async, per tile, persistent and on four warpgroups: each pair bitwise the same outputs, then
    the timings, then the per-tile TMA variant's profile (its loads phase against the cp.async one's)."""
    from time_gdn_fwd import _report

    kw = train_kw(x, H, HV, scale)
    for label, extra in (("per tile", {}), ("persistent", dict(persist=True)), ("four warpgroups", dict(wgs=4))):
        compare_switch(x, {**kw, **extra}, "tma", ((f"{label}, cp.async", False), (f"{label}, TMA", True)),
                       f"B{B} T{T} H{H} HV{HV}: {label}, TMA loads bitwise cp.async")
    ctas = B * (-(-T // 64)) * HV
    buf = torch.zeros(ctas * (len(B3.DCHUNK_PHASES) + 1), dtype=torch.int64, device="cuda")
    for name, on in (("cp.async", False), ("TMA", True)):
        buf.zero_()
        B3.chunk_grads(*x, profile=buf, tma=on, **kw)
        torch.cuda.synchronize()
        _report(f"stage-3 kernel, vn and Tm read, {name} loads" + (", pair sum" if HV == 2 * H else ""), buf,
                B3.DCHUNK_PHASES, ctas)


def chains_rows(x, B, T, H, HV, scale):
    """The training path's call (vn and Tm read, random: the timing does not depend on their values; TMA loads) per
    tile against the two-chain kernel (``chains=1``) and its variant with dvb and dv on the q side (``chains=2``):
    the outputs' relative L2 against the per-tile kernel (the row sums run in another order), then all three timed
    twice, alternating, then both two-chain kernels' profiles (each side's phases)."""
    from time_gdn_fwd import _report

    kw = dict(train_kw(x, H, HV, scale), persist=False)  # chains=0 per tile too, not the persistent default
    outs = [B3.chunk_grads(*x, **kw, chains=c) for c in (0, 1, 2)]
    torch.cuda.synchronize()
    for c in (1, 2):
        diffs = ", ".join(f"{n} {rel_l2(b.float(), a.float()):.1e}"
                          for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), outs[0], outs[c]))
        print(f"B{B} T{T} H{H} HV{HV}: chains={c} vs per tile: {diffs}")
    fl = bwd_flops(B, T, HV)
    label = {0: "per tile (default)", 1: "two chains", 2: "two chains, dv on q"}
    for c in (0, 1, 2, 0, 1, 2):
        ms = bench(lambda: B3.chunk_grads(*x, **kw, chains=c), warmup=10, rep=50)
        print(f"  {label[c]:20s} {ms:.3f} ms  {fl / ms / 1e9:.1f} TFLOP/s")
    ctas = B * (-(-T // 64)) * HV
    buf = torch.zeros(ctas * (len(B3.CHAIN_PHASES) + 1), dtype=torch.int64, device="cuda")
    for c in (1, 2):
        buf.zero_()
        prof = B3.chunk_grads(*x, **kw, chains=c, profile=buf)
        torch.cuda.synchronize()
        same = all(torch.equal(u, w) for u, w in zip(outs[c], prof))
        _report(f"{label[c]} (profile variant bitwise the plain one: {same})", buf, B3.CHAIN_PHASES, ctas)


def k64_rows(B, T, H, HV):
    """K = V = 64, the training path's call (pair sum, vn and Tm read; random: the timing does not depend on
    their values) on one warpgroup against two (their row sums differ in order: relative L2), then timings."""
    x = inputs(B, T, H, HV, K=64, V=64)
    kw = train_kw(x, H, HV, 64**-0.5)
    one, two = (B3.chunk_grads(*x, **kw, wgs=w) for w in (1, 2))
    torch.cuda.synchronize()
    diffs = ", ".join(f"{n} {rel_l2(b.float(), a.float()):.1e}" for n, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"),
                                                                                   one, two))
    print(f"B{B} T{T} H{H} HV{HV} K=V=64: two warpgroups vs one: {diffs}")
    fl = bwd_flops(B, T, HV, 64, 64)
    for w in (1, 2, 1, 2):
        ms = bench(lambda: B3.chunk_grads(*x, **kw, wgs=w), warmup=10, rep=50)
        print(f"  {w} warpgroup(s) {ms:.3f} ms  {fl / ms / 1e9:.1f} TFLOP/s (backward model)")


def profile(x, B, T, H, HV, scale):
    """The default stage-3 call (as the training path makes it: the pair sum where HV = 2 H) and its
    profile variant on the same inputs; the outputs must be bitwise equal."""
    from time_gdn_fwd import _report

    kw = default_kw(H, HV, scale)
    plain = B3.chunk_grads(*x, **kw)
    ctas = B * (-(-T // 64)) * HV
    buf = torch.zeros(ctas * (len(B3.DCHUNK_PHASES) + 1), dtype=torch.int64, device="cuda")
    prof = B3.chunk_grads(*x, profile=buf, **kw)
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for a, b in zip(plain, prof))
    print(f"B{B} T{T} H{H} HV{HV}: profile variant's outputs equal the plain kernel's: {same}")
    _report("stage-3 kernel" + (", pair sum" if HV == 2 * H else ""), buf, B3.DCHUNK_PHASES, ctas)


if __name__ == "__main__":
    main()

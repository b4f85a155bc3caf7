"""Where the SM90 GDN forward's time goes (GPU machine): each kernel alone (the fused state kernel
with and without the cp.async prefetch; the split pass's chain at both V blocks and its out kernel),
the whole forward as chosen and with each state pass forced, and FLA's forward in the same run;
also the wy and state kernels on two warpgroups (the wy kernel's default at K = V = 128; the state
kernel's opt-in ``CUDNN_TRAIN_GDN_FWD_WGS=2``) against one.

    python3 tools/time_gdn_fwd.py [--shapes N] [--profile] [--wy-only | --ws-only | --chain-tma | --out-tma |
                                   --onfly | --chain-stores | --out-otma | --chain-seg | --tstore |
                                   --profile-defaults | --tlayout | --otma | --kshare | --cloads | --train-onfly]

``--train-onfly``: the training forward as the training path calls it with w and u formed in the chain
(``CUDNN_TRAIN_GDN_FWD_TRAIN_ONFLY``) against the default (o, chunk states, vn, Tm: relative L2), then the reverse
sweep on each one's outputs (on w; on Tm and the effective beta: dvn, dH relative L2), each timed in two alternating
rounds.

``--otma``: the inference and training forwards with o by TMA stores (``CUDNN_TRAIN_GDN_FWD_WS_OTMA``) against the
pair stores: o (training: also the chunk states, vn) bitwise first, then two alternating timed rounds.
``--kshare``: the same with the output warpgroup on the chain's k factors (``CUDNN_TRAIN_GDN_FWD_WS_KSHARE``);
``--cloads``: with the next chunk's TMA loads issued by the chain's first warp (``CUDNN_TRAIN_GDN_FWD_WS_CLOADS``).

``--tlayout``: the inference forward with its specialized warpgroups on the transposed S / vn tiles
(``CUDNN_TRAIN_GDN_FWD_WS_TLAYOUT``), with the chain's u^T by ldmatrix (``_ULDM``) and with both, and the training
forward with ULDM, each against both off: o (and the training forward's chunk states, vn) bitwise first, then
timed in two alternating rounds.

``--profile-defaults``: the inference forward and the training forward (chunk states, vn and Tm kept) as the op
calls them, each timed, then run once more with their specialized-warpgroup state pass swapped for its profile
variant (``gated_delta_rule_fwd_ws_sm90.PROFILE_INTO``; o must come out bitwise): the mean cycles a CTA and chunk
each warpgroup spends in each phase (``WS_PHASES``), for the configuration the defaults take at that shape.

``--tstore``: only the training forward (chunk states, vn and Tm kept) on the split pass (TSTORE=0), on the
specialized warpgroups with the gathered stores at 64 columns, and with the stores by TMA from transposed tiles
(``CUDNN_TRAIN_GDN_FWD_WS_TSTORE``) at 64 and 128 columns: o, the chunk states and vn compared (bitwise expected
between the warpgroup rows), then each timed twice, alternating.

``--chain-seg``: only the split pass's chain cut into 1, 2, 4 and 8 segments a sequence (``CUDNN_TRAIN_GDN_CHAIN_SEG``,
each at the V block its grid takes): hs and vn against one segment's (bitwise, and the relative L2 where not),
then timed twice each, alternating; then the whole inference forward unsplit (both switches 1), with the chain in
segments and with the specialized warpgroups in segments (``CUDNN_TRAIN_GDN_FWD_WS_SEG=auto``: o's relative L2
to the unsplit one first), and the training forward unsplit and with the chain in segments.

``--out-otma``: only the split pass's out kernel with o leaving by one TMA store (``CUDNN_TRAIN_GDN_OUT_OTMA``)
against the pair stores, on one chain's hs and vn: o bitwise, then timed twice each, alternating.

``--chain-stores``: only the split pass's chain (TMA loads) at V blocks 64 and 32 with its stores by TMA: hs
(``CUDNN_TRAIN_GDN_CHAIN_HSTMA``), vn (``_VNTMA``) and both against the default's: hs and vn bitwise, then
timed twice each, alternating; then the whole training forward (``store_states``, vn and Tm kept) with both
switches 0 / 1, alternating.

``--out-tma``: only the split pass's out kernel with its loads by TMA (``CUDNN_TRAIN_GDN_OUT_TMA``) against
cp.async, on one chain's hs and vn: o bitwise, then timed twice each, alternating.

``--onfly``: only the whole forward with w and u formed in the chain (``CUDNN_TRAIN_GDN_FWD_ONFLY=1``) against w,
u from the wy kernel (``=0``), as called and with the specialized warpgroups forced: o compared, then timed twice
each, alternating.

``--chain-tma``: only the split pass's chain at both V blocks with its loads by TMA
(``CUDNN_TRAIN_GDN_CHAIN_TMA``) against cp.async: hs and vn bitwise, then timed twice each, alternating.
``--ws-only``: the fused state kernel (default) against its variant on two specialized warpgroups
(``gated_delta_rule_fwd_ws_sm90``, ``CUDNN_TRAIN_GDN_FWD_WS``): the outputs compared, alternating times,
and the whole forward with each.

``--wy-only``: the wy kernel alone in its variants (the scan preparation or the serial one, the tiles by
cp.async, the A matrix in two passes: ``CUDNN_TRAIN_GDN_WY_A2``), bitwise checks between them, alternating
times, and with ``--profile`` the default's per-phase cycles.

K = V = 128, bf16, ``use_qk_l2norm_in_kernel=True``, no initial or final state (the benchmark's
setting). Each line: median ms of ``triton.testing.do_bench`` (L2 cleared before every call)
and TFLOP/s with the issue's FLOP model. Before timing, the state kernel's two variants are
compared on the same inputs (they must agree bitwise). ``--profile`` then runs the kernels'
profile variants once (``clock64`` sums per phase, thread 0 of every CTA; the phases are
``WY_PHASES`` / ``STATE_PHASES`` of the kernel module) and prints the mean cycles a CTA spends
in each phase (for the state kernel also per chunk).
"""

import argparse
import os

import torch
import torch.nn.functional as F

from benchmarks.bench_gated_delta_rule import SHAPES
from benchmarks.common import bench
from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as SP
from tests.utils import rel_l2


def flops(B, T, HV, K=128, V=128, C=64):
    return 2 * (3 * C * C * K + 2 * C * C * V + 2 * C * K * V) * B * (-(-T // C)) * HV


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="per-phase cycles from the profile variants")
    ap.add_argument("--ws-only", action="store_true",
                    help="only the fused state kernel against its specialized-warpgroup variant (and whole forwards)")
    ap.add_argument("--wy-only", action="store_true",
                    help="only the wy kernel at its default warpgroups: its time and (with --profile) its phases")
    ap.add_argument("--chain-tma", action="store_true",
                    help="only the split pass's chain with its loads by TMA against cp.async, both V blocks")
    ap.add_argument("--chain-stores", action="store_true",
                    help="only the split pass's chain with its hs / vn stores by TMA against the default's")
    ap.add_argument("--out-otma", action="store_true",
                    help="only the split pass's out kernel with o by one TMA store against the pair stores")
    ap.add_argument("--out-tma", action="store_true",
                    help="only the split pass's out kernel with its loads by TMA against cp.async")
    ap.add_argument("--chain-seg", action="store_true",
                    help="only the split pass's chain cut into segments against one, then whole forwards 1 / auto")
    ap.add_argument("--onfly", action="store_true",
                    help="only the whole forward with w and u formed in the chain against the default, twice, alternating")
    ap.add_argument("--tstore", action="store_true",
                    help="only the training forward: the split pass, the specialized warpgroups with the gathered "
                         "stores and with the transposed tiles' TMA stores (64 and 128 columns): bitwise, then timed")
    ap.add_argument("--otma", action="store_true", help="the forwards with o by TMA stores, alternating")
    ap.add_argument("--kshare", action="store_true", help="the forwards with the chain's k factors shared")
    ap.add_argument("--cloads", action="store_true", help="the forwards with the chain issuing the TMA loads")
    ap.add_argument("--train-onfly", action="store_true",
                    help="the training forward with w, u formed in its chain and the sweep on Tm, alternating")
    ap.add_argument("--tlayout", action="store_true",
                    help="the inference forward with TLAYOUT / ULDM, the training forward with ULDM, alternating")
    ap.add_argument("--profile-defaults", action="store_true",
                    help="the default inference and training forwards' state pass, timed and profiled")
    ap.add_argument("--only", type=int, default=None, help="only the shape of this index (0: B4 T4096, 1: B1 T16384)")
    args = ap.parse_args()
    shapes = SHAPES[: args.shapes] if args.only is None else [SHAPES[args.only]]
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fwd
    except Exception as e:  # noqa: BLE001
        print(f"FLA not importable: {e}")
        fla_fwd = None
    for B, T, H, HV in shapes:
        K = V = 128
        dev = "cuda"
        q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
        g = F.logsigmoid(torch.rand(B, T, HV, device=dev))
        beta = torch.rand(B, T, HV, device=dev, dtype=torch.bfloat16)
        fl = flops(B, T, HV)
        w = torch.empty(B, T, HV, K, device=dev, dtype=torch.bfloat16)
        u = torch.empty(B, T, HV, V, device=dev, dtype=torch.bfloat16)
        gc = torch.empty(B, T, HV, device=dev)
        f32, i32, i64 = F90._dummies(q.device)
        cu, cuc, rows, NT = F90.chunk_map(None, B, T, q.device)
        group = HV // H
        d4 = f32.view(1, 1, 1, 1)
        wyd = F90.get_wy_kernel(torch.bfloat16, torch.float32, torch.bfloat16, None, None, K, V, True, False, False,
                                False, 1.0, False)  # the default wy kernel, l2norm in it

        def run_wy_default():  # w, u, gc for the state-pass kernels timed below
            wyd(k, v, g, beta, f32, f32, cu, cuc, w, u, gc, w[..., :64], T, NT, B, group, rows, i64)

        if args.tstore:
            tstore_rows(q, k, v, g, beta, B, T, H, HV)
            continue
        if args.tlayout:
            tlayout_rows(q, k, v, g, beta, B, T, H, HV)
            continue
        if args.train_onfly:
            train_onfly_rows(q, k, v, g, beta, B, T, H, HV)
            continue
        if args.otma or args.kshare or args.cloads:
            switch_rows(q, k, v, g, beta, B, T, H, HV, "OTMA" if args.otma else "KSHARE" if args.kshare else "CLOADS")
            continue
        if args.profile_defaults:
            profile_defaults(q, k, v, g, beta, B, T, H, HV, NT)
            continue

        if args.wy_only:  # the scan preparation against the serial one, its tile loads, the two-pass A; then times
            outs = {}
            variants = {"scan": dict(scan=True, async_loads=False, a2=False), "serial": dict(scan=False, a2=False),
                        "async": dict(scan=True, async_loads=True, a2=False),
                        "async+a2": dict(scan=True, async_loads=True, a2=True)}
            for name, kw in variants.items():
                wyd = F90.get_wy_kernel(torch.bfloat16, torch.float32, torch.bfloat16, None, None, K, V, True, False,
                                        False, False, 1.0, False, **kw)
                ws, us, gcs = torch.empty_like(w), torch.empty_like(u), torch.empty_like(gc)
                fn = (lambda wyd=wyd, ws=ws, us=us, gcs=gcs:
                      wyd(k, v, g, beta, f32, f32, cu, cuc, ws, us, gcs, ws[..., :64], T, NT, B, group, rows, i64))
                fn()
                torch.cuda.synchronize()
                outs[name] = (fn, ws, us, gcs)
            errs = ", ".join(f"{n} {rel_l2(a.float(), b.float()):.1e}" for n, a, b in zip("wu", outs["scan"][1:3],
                                                                                           outs["serial"][1:3]))
            print(f"\nB{B} T{T} H{H} HV{HV}: wy scan prep vs serial: {errs}, "
                  f"gc {rel_l2(outs['scan'][3], outs['serial'][3]):.1e}")
            for a, b in (("async", "scan"), ("async+a2", "async")):
                same = all(torch.equal(x, y) for x, y in zip(outs[a][1:], outs[b][1:]))
                print(f"  {a} bitwise {b} (w, u, gc): {same}")
            for name in (*variants, *variants):
                print(f"  wy kernel (default warpgroups), {name}: {bench(outs[name][0], 10, 40):.3f} ms")
            if args.profile:
                profile_wy(k, v, g, beta, w, u, gc, f32, cu, cuc, rows, NT, group)
            continue

        if args.onfly:  # w and u formed in the chain (CUDNN_TRAIN_GDN_FWD_ONFLY) against w, u from the wy kernel
            print(f"\nB{B} T{T} H{H} HV{HV}:")
            saved = F90.SPLIT, F90.STATE_WS, F90.ONFLY
            for forced in (False, True):  # the whole forward as called, then on the specialized warpgroups forced
                F90.SPLIT, F90.STATE_WS = (False, True) if forced else saved[:2]
                path = "specialized warpgroups forced" if forced else "as called"
                if not forced and SP.preferred(B, HV, V, q.device):
                    path += " (the split pass: onfly does not apply, both rows run the same kernels)"
                runs = {}
                for on in (False, True):
                    F90.ONFLY = on
                    runs[on] = F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True).value[0]
                F90.ONFLY = False
                print(f"  {path}: o with w, u in the chain vs without: rel L2 "
                      f"{rel_l2(runs[True].float(), runs[False].float()):.2e}, finite {bool(torch.isfinite(runs[True]).all())}")
                for _ in range(2):
                    for on in (False, True):
                        F90.ONFLY = on
                        ms = bench(lambda: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40)
                        print(f"  whole forward, {path}, w, u in the chain {on}: {ms:.3f} ms")
                    F90.ONFLY = False
            F90.SPLIT, F90.STATE_WS, F90.ONFLY = saved
            continue

        if args.out_tma or args.out_otma:  # the out kernel (CUDNN_TRAIN_GDN_OUT_TMA / _OTMA) on one chain's output:
            run_wy_default()  # bitwise, then times
            hs = torch.empty(rows, HV, K, V, device=dev, dtype=torch.bfloat16)
            vn = torch.empty_like(u)
            vb = SP.chain_vblock(B, HV, V, q.device)
            SP.get_chain_kernel(torch.bfloat16, K, V, vb, True, False, False, False, False)(
                k, w, u, gc, d4, d4, cu, cuc, hs, vn, T, NT, group, B)
            runs = {}
            what = "o_tma" if args.out_otma else "tma"
            names = {False: "pairs", True: "o TMA"} if args.out_otma else {False: "cp.async", True: "TMA"}
            for tma in (False, True):
                ot = SP.get_out_kernel(torch.bfloat16, K, V, True, False, **{what: tma})
                o_t = torch.full((B, T, HV, V), float("nan"), device=dev, dtype=torch.bfloat16)
                runs[tma] = (lambda ot=ot, o_t=o_t: ot(q, k, hs, vn, gc, o_t, cu, cuc, K**-0.5, T, NT, B, group, rows),
                             o_t)
                runs[tma][0]()
            torch.cuda.synchronize()
            print(f"B{B} T{T} H{H} HV{HV}: out kernel, {names[True]}: o bitwise {names[False]}'s: "
                  f"{torch.equal(runs[False][1], runs[True][1])}, finite {bool(torch.isfinite(runs[True][1]).all())}")
            for _ in range(2):
                for tma in (False, True):
                    print(f"  out kernel, {names[tma]:8s} {bench(runs[tma][0], 10, 40):.3f} ms")
            continue

        if args.chain_tma:  # the chain (CUDNN_TRAIN_GDN_CHAIN_TMA) on one wy output: bitwise, then alternating times
            run_wy_default()
            for vb in SP.CHAIN_VBLOCKS:
                runs = {}
                for tma in (False, True):
                    ch = SP.get_chain_kernel(torch.bfloat16, K, V, vb, True, False, False, False, False, tma=tma)
                    hs = torch.empty(rows, HV, K, V, device=dev, dtype=torch.bfloat16)
                    vn = torch.empty_like(u)
                    runs[tma] = (lambda ch=ch, hs=hs, vn=vn: ch(k, w, u, gc, d4, d4, cu, cuc, hs, vn, T, NT, group, B),
                                 hs, vn)
                    runs[tma][0]()
                torch.cuda.synchronize()
                same = torch.equal(runs[False][1], runs[True][1]) and torch.equal(runs[False][2], runs[True][2])
                print(f"B{B} T{T} H{H} HV{HV}: chain VB {vb}, TMA loads: hs and vn bitwise cp.async's: {same}")
                for _ in range(2):
                    for tma in (False, True):
                        print(f"  chain kernel, VB={vb}, {'TMA' if tma else 'cp.async':8s} "
                              f"{bench(runs[tma][0], 10, 40):.3f} ms")
            continue

        if args.chain_seg:  # the chain in segments (CUDNN_TRAIN_GDN_CHAIN_SEG) on one wy output, then whole forwards
            run_wy_default()
            runs = {}
            for nseg in (1, 2, 4, 8):
                vb = SP.chain_vblock(B * nseg, HV, V, q.device)
                ch = SP.get_chain_kernel(torch.bfloat16, K, V, vb, True, False, False, False, False, nseg=nseg)
                hs = torch.full((rows, HV, K, V), float("nan"), device=dev, dtype=torch.bfloat16)
                vn = torch.full_like(u, float("nan"))
                runs[nseg] = (lambda ch=ch, hs=hs, vn=vn: ch(k, w, u, gc, d4, d4, cu, cuc, hs, vn, T, NT, group, B),
                              hs, vn, vb)
                runs[nseg][0]()
            torch.cuda.synchronize()
            for nseg in (2, 4, 8):
                hs, vn = runs[nseg][1:3]
                print(f"B{B} T{T} H{H} HV{HV}: chain in {nseg} segments (VB {runs[nseg][3]}): hs bitwise one's "
                      f"{torch.equal(hs, runs[1][1])} (rel L2 {rel_l2(hs.float(), runs[1][1].float()):.1e}), vn "
                      f"{torch.equal(vn, runs[1][2])} ({rel_l2(vn.float(), runs[1][2].float()):.1e}), finite "
                      f"{bool(torch.isfinite(hs).all() and torch.isfinite(vn).all())}")
            for _ in range(2):
                for nseg in runs:
                    print(f"  chain kernel, {nseg} segments, VB={runs[nseg][3]}: {bench(runs[nseg][0], 10, 40):.3f} ms")
            train = dict(store_states=True, keep_vn=True, keep_tm=True)
            one = {"CHAIN_SEG": "1", "FWD_WS_SEG": "1"}  # the whole sequences, whatever the environment says
            rows = (("inference, unsplit", one, {}),
                    ("inference, chain in segments", {"CHAIN_SEG": "auto", "FWD_WS_SEG": "1"}, {}),
                    ("inference, specialized warpgroups in segments", {"FWD_WS_SEG": "auto"}, {}),
                    ("training, unsplit", one, train), ("training, chain in segments",
                                                        {"CHAIN_SEG": "auto"}, train))
            os.environ.update({f"CUDNN_TRAIN_GDN_{key}": val for key, val in one.items()})
            o_ref = F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True).value[0]
            for key in one:
                os.environ.pop(f"CUDNN_TRAIN_GDN_{key}", None)
            for name, env, kw in rows[1:3]:
                os.environ.update({f"CUDNN_TRAIN_GDN_{key}": val for key, val in env.items()})
                o_seg = F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True).value[0]
                print(f"  {name}: o vs unsplit rel L2 {rel_l2(o_seg.float(), o_ref.float()):.1e}")
                for key in env:
                    os.environ.pop(f"CUDNN_TRAIN_GDN_{key}", None)
            for _ in range(2):
                for name, env, kw in rows:
                    os.environ.update({f"CUDNN_TRAIN_GDN_{key}": val for key, val in env.items()})
                    ms = bench(lambda kw=kw: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw), 10, 40)
                    print(f"  whole {name} forward: {ms:.3f} ms")
                    for key in env:
                        os.environ.pop(f"CUDNN_TRAIN_GDN_{key}", None)
            continue

        if args.chain_stores:  # the chain's hs / vn TMA stores on one wy output: bitwise, then alternating times
            run_wy_default()
            variants = {"default": {}, "hs TMA": dict(hs_tma=True), "vn TMA": dict(vn_tma=True),
                        "hs+vn TMA": dict(hs_tma=True, vn_tma=True)}
            for vb in (64, 32):
                runs = {}
                for name, kw in variants.items():
                    kw = {"hs_tma": False, "vn_tma": False, **kw}
                    ch = SP.get_chain_kernel(torch.bfloat16, K, V, vb, True, False, False, False, False, tma=True, **kw)
                    hs = torch.full((rows, HV, K, V), float("nan"), device=dev, dtype=torch.bfloat16)
                    vn = torch.full_like(u, float("nan"))
                    runs[name] = (lambda ch=ch, hs=hs, vn=vn: ch(k, w, u, gc, d4, d4, cu, cuc, hs, vn, T, NT, group, B),
                                  hs, vn)
                    runs[name][0]()
                torch.cuda.synchronize()
                ref = runs["default"]
                for name in list(variants)[1:]:
                    same = torch.equal(ref[1], runs[name][1]) and torch.equal(ref[2], runs[name][2])
                    print(f"B{B} T{T} H{H} HV{HV}: chain VB {vb}, {name}: hs and vn bitwise the default's: {same}")
                for _ in range(2):
                    for name in variants:
                        print(f"  chain kernel, VB={vb}, {name:10s} {bench(runs[name][0], 10, 40):.3f} ms")
            def train_fwd():
                F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, store_states=True, keep_vn=True,
                            keep_tm=True)

            for _ in range(2):
                for on in ("0", "1"):
                    os.environ["CUDNN_TRAIN_GDN_CHAIN_HSTMA"] = os.environ["CUDNN_TRAIN_GDN_CHAIN_VNTMA"] = on
                    print(f"  training forward, chain stores by TMA {on}: {bench(train_fwd, 10, 40):.3f} ms")
            for name in ("CUDNN_TRAIN_GDN_CHAIN_HSTMA", "CUDNN_TRAIN_GDN_CHAIN_VNTMA"):
                os.environ.pop(name, None)
            continue

        if args.ws_only:  # the fused state kernel against its specialized-warpgroup variant, alternating
            from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

            run_wy_default()
            sk = F90.get_state_kernel(torch.bfloat16, K, V, True, False, False, False, False, False)
            o_def = torch.full((B, T, HV, V), float("nan"), device=dev, dtype=torch.bfloat16)

            def run_def():
                sk(q, k, w, u, gc, d4, o_def, d4, cu, cuc, d4, K**-0.5, T, NT, group, B, i64)

            run_def()
            torch.cuda.synchronize()
            print(f"\nB{B} T{T} H{H} HV{HV}:")
            run_ws, o_ws = ws_variant(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_def)
            run_tma, o_tma = ws_variant(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_def, tma=True)
            print(f"  TMA loads: o bitwise the cp.async loads': {torch.equal(o_tma, o_ws)}")
            run_wg3, o_wg3 = ws_variant(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_def, tma=True, wg3=True)
            print(f"  two output warpgroups: o bitwise one's: {torch.equal(o_wg3, o_tma)}")
            # all 128 columns of V a CTA (CUDNN_TRAIN_GDN_FWD_WS_VB=128): half the CTAs, one wave at B4 HV32
            run_vb, o_vb = ws_variant(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_def, vb=128)
            run_vbt, o_vbt = ws_variant(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_def, tma=True, vb=128)
            run_vbw, o_vbw = ws_variant(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_def, tma=True, wg3=True, vb=128)
            print(f"  128 columns a CTA: o bitwise 64's: {torch.equal(o_vb, o_ws)}, with TMA {torch.equal(o_vbt, o_ws)}, "
                  f"and two output warpgroups {torch.equal(o_vbw, o_ws)}")
            if args.profile:
                profile_ws(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_ws)
                profile_ws(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_tma, tma=True)
                profile_ws(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_vb, vb=128)
            for _ in range(2):
                print(f"  state kernel (default)               {bench(run_def, 10, 40):.3f} ms")
                print(f"  state kernel, specialized warpgroups {bench(run_ws, 10, 40):.3f} ms")
                print(f"  specialized warpgroups, TMA loads         {bench(run_tma, 10, 40):.3f} ms")
                print(f"  TMA loads, two output warpgroups          {bench(run_wg3, 10, 40):.3f} ms")
                print(f"  128 columns a CTA                         {bench(run_vb, 10, 40):.3f} ms")
                print(f"  128 columns a CTA, TMA loads              {bench(run_vbt, 10, 40):.3f} ms")
                print(f"  128 columns, TMA, two output warpgroups   {bench(run_vbw, 10, 40):.3f} ms")
            saved_paths = F90.SPLIT, F90.STATE_WS
            F90.SPLIT, F90.STATE_WS = False, False
            print(f"  whole forward, fused state kernel    "
                  f"{bench(lambda: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40):.3f} ms")
            onfly_was = F90.ONFLY
            F90.ONFLY = False  # like for like with the fused kernel's row: w, u from the wy kernel
            print(f"  whole forward, specialized warpgroups {whole_forward_ws(q, k, v, g, beta):.3f} ms")
            F90.ONFLY = onfly_was
            # w and u formed in the chain (CUDNN_TRAIN_GDN_FWD_ONFLY): the wy kernel's INV variant alone, the
            # whole forward against the default's, o compared
            inv = F90.get_wy_kernel(torch.bfloat16, torch.float32, torch.bfloat16, None, None, K, V, True, False,
                                    False, False, 1.0, False, inv=True)
            a0 = torch.empty(B, T, HV, 64, device=dev, dtype=torch.bfloat16)
            be = torch.empty(B, T, HV, device=dev)
            gci = torch.empty_like(gc)
            run_inv = lambda: inv(k, g, beta, f32, f32, cu, cuc, gci, a0, be, T, NT, B, group, rows, i64)  # noqa: E731
            for _ in range(2):
                print(f"  wy kernel (w, u)                      {bench(run_wy_default, 10, 40):.3f} ms")
                print(f"  wy kernel, gate-free inverse only     {bench(run_inv, 10, 40):.3f} ms")
            # the rows below: the whole forward as it is called (the split pass or the specialized warpgroups, as
            # split_sm90.preferred picks), then forced onto the specialized warpgroups at each VB and load path
            F90.SPLIT, F90.STATE_WS = saved_paths
            if SP.preferred(B, HV, V, q.device):
                print("  (the whole forward as called takes the split pass here: w, u in the chain does not apply)")
            onfly_saved = F90.ONFLY  # its default (None: on where one CTA holds all of V) for the default rows
            F90.ONFLY = True
            o_on = F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True).value[0]
            F90.ONFLY = False
            o_base = F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True).value[0]
            print(f"  w, u in the chain: o rel L2 to w, u from the wy kernel {rel_l2(o_on.float(), o_base.float()):.2e}, "
                  f"finite {bool(torch.isfinite(o_on).all())}")
            for _ in range(2):
                F90.ONFLY = onfly_saved
                print(f"  whole forward (default)               "
                      f"{bench(lambda: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40):.3f} ms")
                for on, name in ((False, "w, u from the wy kernel"), (True, "w, u in the chain     ")):
                    F90.ONFLY = on
                    print(f"  whole forward, {name} "
                          f"{bench(lambda: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40):.3f} ms")
                F90.ONFLY = False
                vb_mode, tma_mode, wg3_mode = WS.VB_MODE, WS.TMA, WS.WG3
                F90.SPLIT, F90.STATE_WS = False, True  # the specialized warpgroups, whatever the default picks
                WS.WG3 = False  # one output warpgroup in these rows
                for vb, vb_tma in (("64", False), ("64", True), ("128", False), ("128", True)):
                    WS.VB_MODE, WS.TMA = vb, vb_tma
                    print(f"  whole forward, specialized warpgroups, {vb} columns a CTA, TMA {vb_tma}, one output "
                          f"warpgroup: "
                          f"{bench(lambda: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40):.3f} ms,"
                          f" w, u in the chain too ", end="")
                    F90.ONFLY = True
                    print(f"{bench(lambda: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40):.3f} ms")
                    F90.ONFLY = False
                WS.VB_MODE, WS.TMA, WS.WG3 = vb_mode, tma_mode, wg3_mode
                F90.SPLIT, F90.STATE_WS, F90.ONFLY = *saved_paths, onfly_saved
            train = dict(use_qk_l2norm_in_kernel=True, store_states=True, keep_vn=True)
            for _ in range(2):  # the training forward: its default (the split pass) against the specialized warpgroups
                print(f"  training forward (store_states, keep_vn), default      "
                      f"{bench(lambda: F90.forward(q, k, v, g, beta, **train), 10, 40):.3f} ms")
                print(f"  training forward, specialized warpgroups               "
                      f"{whole_forward_ws(q, k, v, g, beta, **train):.3f} ms")
                WS.VB_MODE = "128"
                print(f"  training forward, specialized warpgroups, 128 columns  "
                      f"{whole_forward_ws(q, k, v, g, beta, **train):.3f} ms")
                WS.VB_MODE = vb_mode
            continue

        wy = F90.get_wy_kernel(torch.bfloat16, torch.float32, torch.bfloat16, None, None, K, V, True, False, False,
                               False, 1.0, False, wgs=1)

        def run_wy():
            wy(k, v, g, beta, f32, f32, cu, cuc, w, u, gc, w[..., :64], T, NT, B, group, rows, i64)

        run_wy()
        # the wy kernel on two warpgroups (the default at K = V = 128), into its own outputs
        wy2 = F90.get_wy_kernel(torch.bfloat16, torch.float32, torch.bfloat16, None, None, K, V, True, False, False,
                                False, 1.0, False, wgs=2)
        w2, u2, gc2 = torch.empty_like(w), torch.empty_like(u), torch.empty_like(gc)

        def run_wy2():
            wy2(k, v, g, beta, f32, f32, cu, cuc, w2, u2, gc2, w2[..., :64], T, NT, B, group, rows, i64)

        run_wy2()
        torch.cuda.synchronize()
        print(f"  two-warpgroup wy kernel vs one: w {rel_l2(w2, w):.1e}, u {rel_l2(u2, u):.1e}, "
              f"gc {rel_l2(gc2, gc):.1e}")
        st = {pf: F90.get_state_kernel(torch.bfloat16, K, V, True, False, False, False, False, False, prefetch=pf)
              for pf in (True, False)}
        outs = {pf: torch.full((B, T, HV, V), float("nan"), device=dev, dtype=torch.bfloat16) for pf in st}

        def run_state(pf):
            st[pf](q, k, w, u, gc, d4, outs[pf], d4, cu, cuc, d4, K**-0.5, T, NT, group, B, i64)

        for pf in st:
            run_state(pf)
        torch.cuda.synchronize()
        same = torch.equal(outs[True], outs[False])
        print(f"\nB{B} T{T} H{H} HV{HV}: state kernel prefetch vs synchronous loads bitwise equal: {same}; "
              f"finite: {bool(torch.isfinite(outs[True]).all())}")
        rows_out = [("wy kernel", bench(run_wy, 10, 40)), ("wy kernel, two warpgroups", bench(run_wy2, 10, 40))]
        for pf in (False, True):
            rows_out.append((f"state kernel, prefetch={pf}", bench(lambda pf=pf: run_state(pf), 10, 40)))
        def state_variant(**kw):
            """A state-kernel variant (prefetch on) into its own o: ``(run, o)``, run once."""
            sk = F90.get_state_kernel(torch.bfloat16, K, V, True, False, False, False, False, False, prefetch=True,
                                      **kw)
            o_v = torch.full_like(outs[True], float("nan"))

            def run_v():
                sk(q, k, w, u, gc, d4, o_v, d4, cu, cuc, d4, K**-0.5, T, NT, group, B, i64)

            run_v()
            torch.cuda.synchronize()
            return run_v, o_v

        # its P by a select (CUDNN_TRAIN_GDN_FWD_PSEL), against the default once more
        run_sel, o_sel = state_variant(p_select=not F90.STATE_PSEL)
        print(f"  state kernel, p_select={not F90.STATE_PSEL}: o bitwise the default's: {torch.equal(o_sel, outs[True])}")
        rows_out.append((f"state kernel, prefetch, p_select={not F90.STATE_PSEL}", bench(run_sel, 10, 40)))
        rows_out.append(("state kernel, prefetch=True (again)", bench(lambda: run_state(True), 10, 40)))
        # the fused state pass on two specialized warpgroups (CUDNN_TRAIN_GDN_FWD_WS), into its own o
        run_ws, o_ws = ws_variant(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, outs[True])
        rows_out.append(("state kernel, specialized warpgroups", bench(run_ws, 10, 40)))
        # two warpgroups splitting every product's N (CUDNN_TRAIN_GDN_FWD_WGS=2; for inference opt-in)
        run_state2, o2 = state_variant(wgs=2)
        print(f"  two-warpgroup state kernel: o vs one warpgroup's rel L2 {rel_l2(o2, outs[True]):.2e}")
        rows_out.append(("state kernel, prefetch, two warpgroups", bench(run_state2, 10, 40)))
        # the training forward's state kernel (store_states: the chunk-start states too; two warpgroups,
        # synchronous loads, its defaults) against the same kernel without the stores
        hs_tr = torch.empty(rows, HV, K, V, device=dev, dtype=torch.bfloat16)
        for store in (False, True):
            sk = F90.get_state_kernel(torch.bfloat16, K, V, True, False, False, False, False, store, prefetch=False,
                                      wgs=2)
            rows_out.append((f"state kernel, two wgs, sync, store_states={store}", bench(
                lambda sk=sk, store=store: sk(q, k, w, u, gc, d4, o2, d4, cu, cuc, hs_tr if store else d4, K**-0.5, T, NT, group,
                                 B, i64), 10, 40)))
        # the split state pass: chain (both V blocks) and out, each alone, on the same w, u, gc
        hs = torch.empty(rows, HV, K, V, device=dev, dtype=torch.bfloat16)
        vn = torch.empty_like(u)
        o_split = torch.full_like(outs[True], float("nan"))
        for vb in SP.CHAIN_VBLOCKS:
            ch = SP.get_chain_kernel(torch.bfloat16, K, V, vb, True, False, False, False, False)
            rows_out.append((f"chain kernel, VB={vb}", bench(
                lambda ch=ch: ch(k, w, u, gc, d4, d4, cu, cuc, hs, vn, T, NT, group, B), 10, 40)))
        ot = SP.get_out_kernel(torch.bfloat16, K, V, True, False)

        def run_out():
            ot(q, k, hs, vn, gc, o_split, cu, cuc, K**-0.5, T, NT, B, group, rows)

        rows_out.append(("out kernel", bench(run_out, 10, 40)))
        # the out kernel with P's factors read unconditionally (CUDNN_TRAIN_GDN_OUT_PSEL), into its own o
        ot_sel = SP.get_out_kernel(torch.bfloat16, K, V, True, False, p_select=not SP.out_p_select())
        o_sel = torch.full_like(o_split, float("nan"))

        def run_out_sel():
            ot_sel(q, k, hs, vn, gc, o_sel, cu, cuc, K**-0.5, T, NT, B, group, rows)

        run_out_sel()
        torch.cuda.synchronize()
        print(f"  out kernel, p_select={not SP.out_p_select()}: o bitwise the default's: {torch.equal(o_sel, o_split)}")
        rows_out.append((f"out kernel, p_select={not SP.out_p_select()}", bench(run_out_sel, 10, 40)))
        rows_out.append(("out kernel (again)", bench(run_out, 10, 40)))
        err = rel_l2(o_split, outs[True])
        print(f"  split pass o vs the fused state kernel's: rel L2 {err:.2e}; VB chosen: "
              f"{SP.chain_vblock(B, HV, V, q.device)}")
        default = "split" if SP.preferred(B, HV, V, q.device) else "specialized warpgroups"
        for split, name in ((None, f"whole forward (default: {default})"), (True, "whole forward, split pass"),
                            (False, "whole forward, fused state kernel")):
            F90.SPLIT, F90.STATE_WS = split, (False if split is False else None)
            rows_out.append((name, bench(lambda: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40)))
        rows_out.append(("whole forward, specialized warpgroups", whole_forward_ws(q, k, v, g, beta)))
        # the training forward (store_states): its default (the split pass) and kernel 2 with the stores
        for split, name in ((None, "training forward (store_states), default"),
                            (False, "training forward, fused state kernel")):
            F90.SPLIT = split
            rows_out.append((name, bench(lambda: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                             store_states=True), 10, 40)))
        F90.SPLIT, F90.STATE_WS = None, None
        if fla_fwd is not None:
            with torch.no_grad():
                rows_out.append(("FLA chunk_gated_delta_rule forward", bench(
                    lambda: fla_fwd(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40)))
        for name, ms in rows_out:
            print(f"  {name:38s} {ms:8.3f} ms  {fl / ms / 1e9:7.1f} TFLOP/s")
        if args.profile:
            profile(q, k, v, g, beta, w, u, gc, f32, cu, cuc, rows, NT, group, d4, outs)


def ws_variant(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_ref, **kw):
    """The state pass on two specialized warpgroups (``gated_delta_rule_fwd_ws_sm90``) into its own o, run
    once and compared with ``o_ref`` (the fused kernel's): ``(run, o)``."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    K, V = q.shape[-1], u.shape[-1]
    kw = dict(dict(tma=False, wg3=False), **kw)  # each variant as named: cp.async, one output warpgroup unless asked
    fn = WS.get_kernel(torch.bfloat16, K, V, True, False, False, False, False, **kw)
    i64 = F90._dummies(q.device)[2]
    o_ws = torch.full_like(o_ref, float("nan"))

    def run():
        fn(q, k, w, u, gc, d4, o_ws, d4, cu, cuc, d4, d4, K**-0.5, T, NT, group, B, i64, gc, d4)

    run()
    torch.cuda.synchronize()
    print(f"  specialized warpgroups {kw}: o finite {bool(torch.isfinite(o_ws).all())}, bitwise the fused kernel's "
          f"{torch.equal(o_ws, o_ref)}, rel L2 {rel_l2(o_ws.float(), o_ref.float()):.2e}")
    return run, o_ws


# the forwards as the op calls them: inference (nothing kept) and training (chunk states, vn and Tm kept)
FORWARDS = {"inference": dict(use_qk_l2norm_in_kernel=True),
            "training": dict(use_qk_l2norm_in_kernel=True, store_states=True, keep_vn=True, keep_tm=True)}


def compared(a, b, training: bool) -> str:
    """Two forwards' outputs (``forward(...).value``) compared: o, and for training the chunk states and vn, each
    'bitwise' or its relative L2 distance."""
    parts = [("o", a[0], b[0])] + ([("chunk_states", a[2][3], b[2][3]), ("vn", a[2][4], b[2][4])] if training else [])
    return ", ".join(f"{n} {'bitwise' if torch.equal(x, y) else f'rel L2 {rel_l2(x.float(), y.float()):.1e}'}"
                     for n, x, y in parts)


def tstore_rows(q, k, v, g, beta, B, T, H, HV):
    """The training forward (chunk states, vn and Tm kept, as the training path calls it) on the split pass (its
    default before the thirty-first session: ``TSTORE`` off), on the specialized warpgroups with the gathered stores
    (64 columns), and with the stores by TMA from transposed tiles (``CUDNN_TRAIN_GDN_FWD_WS_TSTORE``, the default
    now) at 64 and 128 columns: o, chunk states and vn bitwise the gathered stores' at 64 columns (and 128 against
    64), then each timed twice, alternating."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    saved = F90.SPLIT, F90.STATE_WS, WS.VB_MODE, WS.TSTORE
    rows = {"split pass (TSTORE=0)": (None, None, "auto", False),
            "warpgroups, gathered stores, 64": (False, True, "64", False),
            "warpgroups, TMA stores, 64": (False, True, "64", True),
            "warpgroups, TMA stores, 128": (False, True, "128", True)}

    def run(name):
        F90.SPLIT, F90.STATE_WS, WS.VB_MODE, WS.TSTORE = rows[name]
        try:
            return F90.forward(q, k, v, g, beta, **FORWARDS["training"]).value
        finally:
            F90.SPLIT, F90.STATE_WS, WS.VB_MODE, WS.TSTORE = saved

    outs = {name: run(name) for name in rows}
    torch.cuda.synchronize()

    names = list(rows)
    print(f"\nB{B} T{T} H{H} HV{HV}, the training forward:")
    for a, b in ((names[2], names[1]), (names[3], names[2]), (names[3], names[0])):
        print(f"  {a} against {b}: " + compared(outs[a], outs[b], True))
    for _ in range(2):
        for name in names:
            print(f"  {name:34s} {bench(lambda: run(name), 10, 40):.3f} ms")


def switch_rows(q, k, v, g, beta, B, T, H, HV, attr):
    """The inference and training forwards as the op calls them with the specialized-warpgroup module's switch
    ``attr`` off and on: outputs compared (bitwise expected), then two alternating timed rounds."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    saved = getattr(WS, attr)

    def run(name, on):
        setattr(WS, attr, on)
        try:
            return F90.forward(q, k, v, g, beta, **FORWARDS[name]).value
        finally:
            setattr(WS, attr, saved)

    print(f"\nB{B} T{T} H{H} HV{HV}, the forwards with {attr} off / on:")
    for name in FORWARDS:
        print(f"  {name}: " + compared(run(name, True), run(name, False), name == "training"))
    for _ in range(2):
        for name in FORWARDS:
            for on in (False, True):
                print(f"  {name:10s} {attr}={int(on)} {bench(lambda: run(name, on), 10, 40):.3f} ms")


def train_onfly_rows(q, k, v, g, beta, B, T, H, HV):
    """The training forward (``train_onfly=True``, as the training path asks where the fused sweep runs) with
    ``TRAIN_ONFLY`` off and on, and the reverse sweep on each one's saved tensors (w; Tm and the effective beta), as
    the training path calls it: outputs compared by relative L2, then two alternating timed rounds of each."""
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90

    kw = dict(FORWARDS["training"], train_onfly=True)
    saved = F90.TRAIN_ONFLY

    def fwd(on):
        F90.TRAIN_ONFLY = on
        try:
            return F90.forward(q, k, v, g, beta, **kw).value
        finally:
            F90.TRAIN_ONFLY = saved

    outs = {on: fwd(on) for on in (False, True)}
    if outs[True][2][0] is not None:
        print("  (the forward did not take the chain's w and u at this shape: not timed)")
        return
    do = torch.randn_like(v)
    scale = q.shape[-1] ** -0.5

    def sweep(on):
        w, u, gc = outs[on][2][:3]
        tm = outs[on][2][5]
        return B90.reverse_sweep(q, k, tm if on else w, gc, do, scale=scale, use_qk_l2norm_in_kernel=True,
                                 out_dtype=q.dtype, beta=u if on else None)

    sw = {on: sweep(on) for on in (False, True)}
    a, b = outs[True], outs[False]
    parts = [("o", a[0], b[0]), ("chunk_states", a[2][3], b[2][3]), ("vn", a[2][4], b[2][4]),
             ("Tm", a[2][5], b[2][5]), ("sweep dvn", sw[True][0], sw[False][0]), ("sweep dH", sw[True][1], sw[False][1])]
    print(f"\nB{B} T{T} H{H} HV{HV}, the training forward and sweep, TRAIN_ONFLY off / on:")
    print("  " + ", ".join(f"{n} rel L2 {rel_l2(x.float(), y.float()):.1e}" for n, x, y in parts))
    for _ in range(2):
        for on in (False, True):
            print(f"  training forward TRAIN_ONFLY={int(on)} {bench(lambda: fwd(on), 10, 40):.3f} ms")
        for on in (False, True):
            print(f"  reverse sweep {'on Tm' if on else 'on w '}            {bench(lambda: sweep(on), 10, 40):.3f} ms")


def tlayout_rows(q, k, v, g, beta, B, T, H, HV):
    """The forwards as the op calls them with TLAYOUT / ULDM off and on: outputs bitwise, then two timed rounds."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    infer, train = FORWARDS["inference"], FORWARDS["training"]
    rows = {"inference, both off": (infer, False, False), "inference, TLAYOUT": (infer, True, False),
            "inference, ULDM": (infer, False, True), "inference, both": (infer, True, True),
            "training, ULDM off": (train, False, False), "training, ULDM": (train, False, True)}
    saved = WS.TLAYOUT, WS.ULDM

    def run(name):
        kw, WS.TLAYOUT, WS.ULDM = rows[name]
        try:
            return F90.forward(q, k, v, g, beta, **kw).value
        finally:
            WS.TLAYOUT, WS.ULDM = saved

    outs = {name: run(name) for name in rows}
    torch.cuda.synchronize()
    print(f"\nB{B} T{T} H{H} HV{HV}, the forwards with TLAYOUT / ULDM:")
    for name, base in (("inference, TLAYOUT", "inference, both off"), ("inference, ULDM", "inference, both off"),
                       ("inference, both", "inference, both off"), ("training, ULDM", "training, ULDM off")):
        print(f"  {name} against {base}: " + compared(outs[name], outs[base], name.startswith("training")))
    for _ in range(2):
        for name in rows:
            print(f"  {name:22s} {bench(lambda: run(name), 10, 40):.3f} ms")


def profile_defaults(q, k, v, g, beta, B, T, H, HV, NT):
    """The default inference and training forwards: timed, then once with the state pass's profile variant."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    print(f"\nB{B} T{T} H{H} HV{HV}, the forwards as the op calls them:")
    for name, kw in FORWARDS.items():
        run = lambda kw=kw: F90.forward(q, k, v, g, beta, **kw).value  # noqa: E731
        o_ref = run()[0]
        print(f"  {name:10s} {bench(run, 10, 40):.3f} ms")
        WS.PROFILE_INTO = []
        try:
            o = run()[0]
            torch.cuda.synchronize()
            bufs = WS.PROFILE_INTO
        finally:
            WS.PROFILE_INTO = None
        if not bufs:
            print(f"  {name}: the specialized warpgroups did not serve this call (no profile)")
            continue
        print(f"  {name}: the profile variant's o equals the plain kernel's: {torch.equal(o, o_ref)}")
        nph = len(WS.WS_PHASES[0])
        per_wg = bufs[0].view(-1, 2, nph + 1)
        for wg in range(2):
            _report(f"{name}, warpgroup {wg}", per_wg[:, wg].contiguous().view(-1), WS.WS_PHASES[wg],
                    per_wg.shape[0], per=NT)


def profile_ws(q, k, w, u, gc, d4, cu, cuc, T, NT, group, B, o_ref, **kw):
    """The specialized-warpgroup kernel's profile variant once: mean cycles a CTA and chunk per phase, each
    warpgroup (its thread 0)."""
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS

    K, HV, V = q.shape[-1], u.shape[2], u.shape[-1]
    kw = dict(dict(tma=False), **kw)
    fn = WS.get_kernel(torch.bfloat16, K, V, True, False, False, False, False, profile=True, **kw)
    ctas = B * HV * (V // kw.get("vb", WS.VB))
    nph = len(WS.WS_PHASES[0])
    buf = torch.zeros(ctas * 2 * (nph + 1), dtype=torch.int64, device=q.device)
    o = torch.full_like(o_ref, float("nan"))
    fn(q, k, w, u, gc, d4, o, d4, cu, cuc, d4, d4, K**-0.5, T, NT, group, B, buf, gc, d4)
    torch.cuda.synchronize()
    print(f"  profile variant's o equals the plain kernel's: {torch.equal(o, o_ref)}")
    per_wg = buf.view(ctas, 2, nph + 1)
    for wg in range(2):
        _report(f"specialized warpgroups {kw}, warpgroup {wg}", per_wg[:, wg].contiguous().view(-1), WS.WS_PHASES[wg],
                ctas, per=NT)


def whole_forward_ws(q, k, v, g, beta, **kw) -> float:
    """ms of the whole forward with the fused state pass on the specialized warpgroups (split pass off);
    ``kw``: more of ``forward``'s arguments (default: the l2norm in the kernel)."""
    split, ws = F90.SPLIT, F90.STATE_WS
    F90.SPLIT, F90.STATE_WS = False, True
    kw = kw or dict(use_qk_l2norm_in_kernel=True)
    try:
        return bench(lambda: F90.forward(q, k, v, g, beta, **kw), 10, 40)
    finally:
        F90.SPLIT, F90.STATE_WS = split, ws


def _report(title, buf, phases, ctas, per=1):
    tab = buf.view(ctas, len(phases) + 1).double().mean(0).tolist()
    total = tab[-1]
    print(f"  {title}: {total / per:,.0f} cycles a CTA{' and chunk' if per > 1 else ''} (mean over {ctas} CTAs)")
    for name, cyc in zip(phases, tab):
        print(f"    {name:34s} {cyc / per:10,.0f} cycles  {100 * cyc / total:5.1f}%")


def profile_wy(k, v, g, beta, w, u, gc, f32, cu, cuc, rows, NT, group):
    """The wy kernel's profile variant (default warpgroups) once: mean cycles a CTA per phase."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    wyp = F90.get_wy_kernel(torch.bfloat16, torch.float32, torch.bfloat16, None, None, K, V, True, False, False,
                            False, 1.0, False, profile=True)
    ctas = rows * HV
    buf = torch.zeros(ctas * (len(F90.WY_PHASES) + 1), dtype=torch.int64, device=k.device)
    wyp(k, v, g, beta, f32, f32, cu, cuc, w, u, gc, w[..., :64], T, NT, B, group, rows, buf)
    torch.cuda.synchronize()
    _report("wy kernel", buf, F90.WY_PHASES, ctas)


def profile(q, k, v, g, beta, w, u, gc, f32, cu, cuc, rows, NT, group, d4, outs):
    """The profile variants once each; their outputs must equal the plain kernels' (``outs``)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    profile_wy(k, v, g, beta, w, u, gc, f32, cu, cuc, rows, NT, group)
    o = torch.empty(B, T, HV, V, device=q.device, dtype=q.dtype)
    for pf in (True, False):
        stp = F90.get_state_kernel(torch.bfloat16, K, V, True, False, False, False, False, False, prefetch=pf,
                                   profile=True)
        ctas = B * HV * (V // F90.VBLOCK)
        buf = torch.zeros(ctas * (len(F90.STATE_PHASES) + 1), dtype=torch.int64, device=q.device)
        stp(q, k, w, u, gc, d4, o, d4, cu, cuc, d4, K**-0.5, T, NT, group, B, buf)
        torch.cuda.synchronize()
        print(f"  profile variant's o equals the plain kernel's: {torch.equal(o, outs[pf])}")
        _report(f"state kernel, prefetch={pf}", buf, F90.STATE_PHASES, ctas, per=NT)


if __name__ == "__main__":
    main()

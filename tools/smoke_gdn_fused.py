"""One small case of the fused GDN backward on the GPU, every output's relative L2 error printed (not asserted):
the first thing to run on a new kernel, under a short ``timeout``, so that a hang or a wrong chain shows in
seconds and says where (the debug variant's dvn and dH rows are the chain; dq ... dh0 the per-chunk gradients).

    timeout 120 python3 tools/smoke_gdn_fused.py [--T 200] [--kdb] [--splitdk] [--dq1] [--no-debug]
"""

import argparse
import time

import torch

from tests.kernels.test_gated_delta_rule_bwd_fused_sm90 import _case
from tests.utils import rel_l2


def main():
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF

    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=200)
    ap.add_argument("--kdb", action="store_true")
    ap.add_argument("--splitdk", action="store_true")
    ap.add_argument("--dq1", action="store_true", help="split-dk with dq on W1 too")
    ap.add_argument("--no-debug", action="store_true", help="the plain variant alone (one build fewer)")
    args = ap.parse_args()
    ins, scale, want = _case(1, args.T, 1, 2, torch.bfloat16, True, False)
    call = [ins[x] for x in ("q", "k", "v", "gc", "beta", "do", "vn", "tm", "hs", "dht")]
    for debug in (False,) if args.no_debug else (True, False):
        t0 = time.perf_counter()
        got = BF.fused_backward(*call, scale=scale, debug=debug, kdb=args.kdb, splitdk=args.splitdk,
                                dq1=args.dq1)
        torch.cuda.synchronize()
        names = ("dq", "dk", "dv", "dg", "dbeta", "dh0") + (("dvn", "dH") if debug else ())
        errs = ", ".join(f"{n} {rel_l2(a.float(), want[n].float()):.2e}" for n, a in zip(names, got))
        took = time.perf_counter() - t0
        print(f"debug={debug} kdb={args.kdb} splitdk={args.splitdk} dq1={args.dq1} T={args.T} ({took:.1f} s with "
              f"compile): {errs}", flush=True)


if __name__ == "__main__":
    main()

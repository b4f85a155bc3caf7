"""Where the SM90 GDN forward's time goes (GPU machine): each kernel alone, the state kernel with
and without the cp.async prefetch, the whole forward, and FLA's forward in the same run.

    python3 tools/time_gdn_fwd.py [--shapes N]

K = V = 128, bf16, ``use_qk_l2norm_in_kernel=True``, no initial or final state (the benchmark's
setting). Each line: median ms of ``triton.testing.do_bench`` (L2 cleared before every call)
and TFLOP/s with the issue's FLOP model. Before timing, the state kernel's two variants are
compared on the same inputs (they must agree bitwise).
"""

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import bench
from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

SHAPES = [(4, 4096, 16, 32), (1, 16384, 16, 32), (8, 2048, 32, 32)]


def flops(B, T, HV, K=128, V=128, C=64):
    return 2 * (3 * C * C * K + 2 * C * C * V + 2 * C * K * V) * B * (-(-T // C)) * HV


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", type=int, default=2)
    args = ap.parse_args()
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fwd
    except Exception as e:  # noqa: BLE001
        print(f"FLA not importable: {e}")
        fla_fwd = None
    for B, T, H, HV in SHAPES[: args.shapes]:
        K = V = 128
        dev = "cuda"
        q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
        g = F.logsigmoid(torch.rand(B, T, HV, device=dev))
        beta = torch.rand(B, T, HV, device=dev, dtype=torch.bfloat16)
        fl = flops(B, T, HV)
        wy = F90.get_wy_kernel(torch.bfloat16, torch.float32, torch.bfloat16, None, None, K, V, True, False, False,
                               False, 1.0, False)
        w = torch.empty(B, T, HV, K, device=dev, dtype=torch.bfloat16)
        u = torch.empty(B, T, HV, V, device=dev, dtype=torch.bfloat16)
        gc = torch.empty(B, T, HV, device=dev)
        f32, i32 = F90._dummies(q.device)
        cu, cuc, rows, NT = F90.chunk_map(None, B, T, q.device)
        group = HV // H

        def run_wy():
            wy(k, v, g, beta, f32, f32, cu, cuc, w, u, gc, T, NT, B, group, rows)

        run_wy()
        st = {pf: F90.get_state_kernel(torch.bfloat16, K, V, True, False, False, False, False, False, prefetch=pf)
              for pf in (True, False)}
        outs = {}
        for pf, fn in st.items():
            outs[pf] = torch.full((B, T, HV, V), float("nan"), device=dev, dtype=torch.bfloat16)
        d4 = f32.view(1, 1, 1, 1)

        def run_state(pf):
            st[pf](q, k, w, u, gc, d4, outs[pf], d4, cu, cuc, d4, K**-0.5, T, NT, group, B)

        for pf in st:
            run_state(pf)
        torch.cuda.synchronize()
        same = torch.equal(outs[True], outs[False])
        print(f"\nB{B} T{T} H{H} HV{HV}: state kernel prefetch vs synchronous loads bitwise equal: {same}; "
              f"finite: {bool(torch.isfinite(outs[True]).all())}")
        rows_out = [("wy kernel", bench(run_wy, 10, 40))]
        for pf in (False, True):
            rows_out.append((f"state kernel, prefetch={pf}", bench(lambda pf=pf: run_state(pf), 10, 40)))
        rows_out.append(("whole forward (default)", bench(
            lambda: F90.forward(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40)))
        if fla_fwd is not None:
            with torch.no_grad():
                rows_out.append(("FLA chunk_gated_delta_rule forward", bench(
                    lambda: fla_fwd(q, k, v, g, beta, use_qk_l2norm_in_kernel=True), 10, 40)))
        for name, ms in rows_out:
            print(f"  {name:38s} {ms:8.3f} ms  {fl / ms / 1e9:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()

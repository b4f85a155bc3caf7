"""Launches of the GDN backward's two kernels for Nsight Compute (GPU machine): stage 3 as the training path calls it
(pair sum, vn and Tm read, its default loads) and the fused reverse sweep (its defaults), B4 T4096 H16 HV32, K = V =
128, bf16. Each kernel runs twice; the second call runs between cudaProfilerStart and Stop, so that

    ncu --clock-control none --profile-from-start off --set full -o rep python3 tools/ncu_gdn.py dchunk

profiles every kernel of that call and nothing else.

(``bash tools/gpu_next.sh ncu`` runs it and prints the stall reasons and the hottest SASS lines.)
"""

import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tools")
from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3  # noqa: E402
from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90  # noqa: E402
from time_gdn_dchunk import inputs, train_kw  # noqa: E402

which = sys.argv[1] if len(sys.argv) > 1 else "dchunk"
B, T, H, HV, K = 4, 4096, 16, 32, 128
x = inputs(B, T, H, HV)
if which == "dchunk":
    kw = train_kw(x, H, HV, K**-0.5)
    call = lambda: B3.chunk_grads(*x, **kw)  # noqa: E731
elif which == "sweep":
    q, k, v, gc = x[0], x[1], x[2], x[3]
    w = torch.randn_like(v) * 0.1
    do = x[5]
    call = lambda: B90.reverse_sweep(q, k, w, gc, do, None, scale=K**-0.5,  # noqa: E731
                                     use_qk_l2norm_in_kernel=True, out_dtype=v.dtype)
else:
    raise SystemExit(f"unknown kernel {which!r}: dchunk or sweep")
call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print(f"{which}: done")

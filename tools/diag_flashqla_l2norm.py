"""Why does FlashQLA's forward move between runs (0.43 ms in one H100 session, 0.65 in the next, B4 T4096 H16 HV32)?
The twenty-third session's per-kernel list (``bench_gated_delta_rule --kernels``) put 0.159 ms on each of its q and
k l2norms, ``torch.compile``d functions (``flash_qla.utils.math``) whose rows dimension is marked dynamic, so the
Triton reduction config Inductor picks at the first call decides their speed for the whole process.

    python3 tools/diag_flashqla_l2norm.py [--procs N] [--shape B T H K]

Runs N fresh Python processes (each compiles afresh: a private Inductor cache directory unless ``--shared-cache``);
each times FlashQLA's ``l2norm_fwd`` and ``l2norm_bwd`` on a [B, T, H, K] bf16 tensor (GPU time of 50 calls
by CUDA events, after 5 warm-up calls) and prints ms and GB/s (bytes: the forward reads x and writes y and the
row factors; the backward reads dy, y, the factors and writes dx), next to eager torch's same math.
"""

import argparse
import os
import subprocess
import sys
import tempfile


def child(shape: list[int]) -> None:
    import torch
    from flash_qla.utils.math import l2norm_bwd, l2norm_fwd

    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    n = x.numel()

    def timed(fn) -> float:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(50):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 50

    def eager_fwd():
        xf = x.float()
        r = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)
        return (x * r).to(x.dtype), r

    y, rstd = l2norm_fwd(x)
    rows = rstd.numel()
    fwd_bytes = 2 * n * 2 + rows * 4
    bwd_bytes = 3 * n * 2 + rows * 4
    for name, fn, nbytes in (("flashqla l2norm_fwd", lambda: l2norm_fwd(x), fwd_bytes),
                             ("flashqla l2norm_bwd", lambda: l2norm_bwd(y, rstd, dy), bwd_bytes),
                             ("eager torch forward", eager_fwd, fwd_bytes)):
        ms = timed(fn)
        print(f"  {name}: {ms:.4f} ms, {nbytes / ms / 1e6:.0f} GB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=3)
    ap.add_argument("--shape", type=int, nargs=4, default=[4, 4096, 16, 128])
    ap.add_argument("--shared-cache", action="store_true", help="keep Inductor's default cache directory")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.shape)
        return
    for p in range(args.procs):
        env = dict(os.environ)
        if not args.shared_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"inductor{p}_")
        print(f"process {p + 1} of {args.procs}, shape {args.shape}:", flush=True)
        subprocess.run([sys.executable, __file__, "--child", "--shape", *map(str, args.shape)], env=env, check=False)


if __name__ == "__main__":
    main()

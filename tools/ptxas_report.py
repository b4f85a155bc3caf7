"""Registers, spills and barriers of a CuTeDSL kernel, offline (no GPU): build the kernel with its PTX kept, run the
CUDA toolkit's ptxas on it for sm_90a and print ptxas's report for every entry function.

    CUTE_DSL_ARCH=sm_90a .venv/bin/python tools/ptxas_report.py "EXPR" [--keep DIR]

EXPR is a Python expression that builds one kernel, with these names in scope: torch, B3 (stage 3,
``gated_delta_rule_bwd_chunk_sm90``), BF (the fused backward), B90 (the reverse sweep, ``gated_delta_rule_bwd_sm90``), BS (the split
sweep), F90 (the forward), FS (the split forward), WS (the specialized-warpgroup forward), GEMM (``gemm_sm90``).
For example::

    tools/ptxas_report.py "B3.get_dchunk_kernel(torch.bfloat16, 128, 128, False, True, dqk_dtype=torch.bfloat16,
                           pair=True, vn_in=True, tm_in=True, tma=True, chains=2)"

The kernel is built afresh (the disk cache is off for the call), its PTX lands in a temporary folder (or ``--keep
DIR``), and, where the PTX's ``.version`` is newer than the ptxas found supports, it is lowered to that version
first (the DSL writes the newest ISA version; the kernels use nothing newer than ptxas 13.0 knows). ptxas is the
first of ``$PTXAS``, ``ptxas`` on PATH and ``/usr/local/cuda/bin/ptxas``.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile


def find_ptxas() -> str:
    for cand in (os.environ.get("PTXAS"), shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas"):
        if cand and os.path.exists(cand):
            return cand
    raise SystemExit("ptxas not found: set PTXAS")


def isa_version(ptxas: str) -> str:
    """The newest PTX ISA version this ptxas reads, from its own error on a too-new file (no table to keep)."""
    with tempfile.TemporaryDirectory() as d:
        probe = os.path.join(d, "probe.ptx")
        with open(probe, "w") as f:
            f.write(".version 99.9\n.target sm_90a\n.address_size 64\n")
        out = subprocess.run([ptxas, "-arch=sm_90a", probe, "-o", os.devnull], capture_output=True, text=True)
    m = re.search(r"current version is '([0-9.]+)'", out.stderr + out.stdout)
    if not m:
        raise SystemExit(f"could not tell the PTX ISA version of {ptxas}: {out.stderr.strip()}")
    return m.group(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("expr", help="a Python expression that builds one kernel (see the module docstring)")
    ap.add_argument("--keep", help="write the PTX and cubin here instead of a temporary folder")
    args = ap.parse_args()
    if os.environ.get("CUTE_DSL_ARCH", "") != "sm_90a":
        raise SystemExit("set CUTE_DSL_ARCH=sm_90a before running (the DSL reads it when cutlass is imported)")
    out_dir = args.keep or tempfile.mkdtemp(prefix="ptxas_report_")
    os.makedirs(out_dir, exist_ok=True)
    os.environ["CUDNN_TRAIN_DISK_CACHE"] = "0"  # build it now, so that its PTX is written
    os.environ["CUTE_DSL_KEEP"] = "ptx"
    os.environ["CUTE_DSL_DUMP_DIR"] = out_dir
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch
    from cudnn_train.kernels import gated_delta_rule_bwd_chunk_sm90 as B3
    from cudnn_train.kernels import gated_delta_rule_bwd_fused_sm90 as BF
    from cudnn_train.kernels import gated_delta_rule_bwd_sm90 as B90
    from cudnn_train.kernels import gated_delta_rule_bwd_split_sm90 as BS
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90
    from cudnn_train.kernels import gated_delta_rule_fwd_split_sm90 as FS
    from cudnn_train.kernels import gated_delta_rule_fwd_ws_sm90 as WS
    from cudnn_train.kernels import gemm_sm90 as GEMM

    before = set(glob.glob(os.path.join(out_dir, "*.ptx")))
    scope = dict(torch=torch, B3=B3, BF=BF, B90=B90, BS=BS, F90=F90, FS=FS, WS=WS, GEMM=GEMM)
    eval(args.expr, scope)  # noqa: S307 (a developer's own expression, run on purpose)
    new = sorted(set(glob.glob(os.path.join(out_dir, "*.ptx"))) - before)
    if not new:
        raise SystemExit(f"no PTX written to {out_dir}: was the kernel already built in this process?")
    ptxas = find_ptxas()
    isa = isa_version(ptxas)
    for path in new:
        text = open(path).read()
        text = re.sub(r"^\.version [0-9.]+", f".version {isa}", text, count=1, flags=re.M)
        lowered = path[:-4] + f".isa{isa}.ptx"
        with open(lowered, "w") as f:
            f.write(text)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", lowered, "-o", lowered[:-4] + ".cubin"],
                             capture_output=True, text=True)
        print(f"{os.path.basename(path)[:80]}... (ptxas {os.path.basename(ptxas)}, ISA {isa}):")
        for line in (res.stdout + res.stderr).splitlines():
            if any(w in line for w in ("registers", "spill", "error", "Compiling entry")):
                print("  " + re.sub(r"'kernel_cutlass_(\w{0,60})\w*'", r"\1...", line.strip()))
        if res.returncode:
            raise SystemExit(f"ptxas failed ({res.returncode}); the PTX is in {out_dir}")
    if not args.keep:
        shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()

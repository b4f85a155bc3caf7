"""The SM90 CuTeDSL GEMM: planning (CPU), compile tier (sm_90a on any machine), GPU tier.

Oracles: float32 ``torch.matmul`` on the same (bf16/fp16) inputs; ``torch.nn.functional.silu``;
``torch.autograd`` for the SwiGLU derivative. Tolerance relL2 <= 2e-3 for 16-bit outputs (rounding
a float32 result to bf16 alone costs about 1.7e-3).

GPU tests run in a child pytest process (see ``gpu`` below): a kernel fault (illegal instruction,
illegal address) kills the CUDA context of the process it happens in, and would otherwise turn
every later test into an error. The parent runs the remaining GPU tests of this file in one child
that stops at its first failure; the failed test reports the child's traceback (or, if the child
died, its output), and the tests after it go to a fresh child. Each test still runs in full,
with the same seed and the same checks, and passes or fails on its own. The child also
synchronizes after each test, so an asynchronous fault is charged to the test that launched the
kernel. ``CUDNN_TRAIN_GPU_TESTS_INPROCESS=1`` runs them in the pytest process instead.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cudnn_train.backend import Unsupported
from cudnn_train.kernels import compile as kc
from cudnn_train.kernels import gemm_sm90 as gk
from tests.utils import poison_, rel_l2

TOL16 = 2e-3
TOL32 = 1e-5


# ------------------------------------------------------------------ operand builders


def make_a(m, k, major, dtype=torch.bfloat16, device="cpu"):
    """[M, K], row-major ("k") or column-major ("m", leading dimension padded to a multiple of 8)."""
    if major == "k":
        return torch.randn(m, k, device=device).to(dtype)
    return torch.randn(k, -(-m // 8) * 8, device=device).to(dtype)[:, :m].t()


def make_b(k, n, major, dtype=torch.bfloat16, device="cpu"):
    """[K, N] as the kernel reads it: "k" = column-major (``w.t()`` of a [N, K] weight), "n" = row-major."""
    if major == "k":
        return (torch.randn(n, k, device=device) / k**0.5).to(dtype).t()
    return (torch.randn(k, n, device=device) / k**0.5).to(dtype)


def make_grouped_b(g, k, n, major, dtype=torch.bfloat16, device="cpu"):
    """[G, K, N]: "k" = ``w.transpose(1, 2)`` of [G, N, K] weights, "n" = contiguous [G, K, N]."""
    if major == "k":
        return (torch.randn(g, n, k, device=device) / k**0.5).to(dtype).transpose(1, 2)
    return (torch.randn(g, k, n, device=device) / k**0.5).to(dtype)


def offsets_of(sizes, start=0, device="cpu"):
    offs = [start]
    for s in sizes:
        offs.append(offs[-1] + s)
    return torch.tensor(offs, dtype=torch.int32, device=device)


# ------------------------------------------------------------------ references (float32)


def ref_gemm(a, b, bias=None, alpha=1.0, beta=0.0, row_scale=None, out0=None):
    y = alpha * (a.float() @ b.float())
    if bias is not None:
        y = y + bias.float()
    if row_scale is not None:
        y = y * row_scale.float()[:, None]
    if beta != 0.0:
        y = y + beta * out0.float()
    return y


def ref_swiglu(a, b_gate, b_up, bias_gate=None, bias_up=None, row_scale=None):
    gate = a.float() @ b_gate.float()
    up = a.float() @ b_up.float()
    if bias_gate is not None:
        gate = gate + bias_gate.float()
        up = up + bias_up.float()
    h = F.silu(gate) * up
    if row_scale is not None:
        h = h * row_scale.float()[:, None]
    return h, gate, up


def ref_dswiglu(a, b, gate, up, row_scale=None):
    """dgate, dup by autograd through silu(gate) * up."""
    dh = a.float() @ b.float()
    if row_scale is not None:
        dh = dh * row_scale.float()[:, None]
    g = gate.float().requires_grad_(True)
    u = up.float().requires_grad_(True)
    (F.silu(g) * u).backward(dh)
    return g.grad, u.grad


def ref_grouped(fn, a, offs, *per_group, rows_out):
    """Apply ``fn(a_g, *per_group[g]) -> tensor or tuple`` group by group; rows outside stay NaN."""
    offs = offs.tolist()
    outs = None
    for g in range(len(offs) - 1):
        lo, hi = offs[g], offs[g + 1]
        res = fn(a[lo:hi], *[p[g] for p in per_group])
        res = res if isinstance(res, tuple) else (res,)
        if outs is None:
            outs = [torch.full((rows_out, r.shape[1]), float("nan"), device=a.device) for r in res]
        for o, r in zip(outs, res):
            o[lo:hi] = r
    return outs


def plan_cpu(*args, **kwargs):
    return gk._plan(*args, _device_check=False, _num_sms=132, **kwargs)


# ------------------------------------------------------------------ planning (CPU, no compile)


@pytest.mark.parametrize(
    "case,a_major,b_major",
    [("forward x @ W^T", "k", "k"), ("dgrad dy @ W", "k", "n"), ("wgrad dy^T @ x", "m", "n")],
)
def test_plan_layouts_need_no_copies(case, a_major, b_major):
    m, k, n = 256, 192, 320
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    dy = torch.randn(m, n).bfloat16()
    if case.startswith("forward"):
        a, b = x, w.t()
    elif case.startswith("dgrad"):
        a, b = dy, w
    else:
        a, b = dy.t(), x
    p = plan_cpu(a, b, None, epilogue="none")
    assert (p.spec.a_major, p.spec.b_major) == (a_major, b_major)
    # the kernel views share storage with the inputs (no copies)
    assert p.a.data_ptr() == a.data_ptr() and p.b.data_ptr() == b.data_ptr()
    assert p.b.shape == (b.shape[1], b.shape[0])


def test_choose_config_documented_heuristic():
    sms = 132
    # dense 16-bit outputs that are only written take the TMA-store epilogue (its 32 KB subtile ring
    # beside the stages); everything else the register-to-global one
    t = dict(tma_store=True)
    # 8192^3 and the MLP down GEMM: 128x256 tiles, 2-CTA cluster, 4 stages
    assert gk.choose_config(8192, 8192, "none", False, False, sms, **t) == (256, 2, 4)
    assert gk.choose_config(16384, 4096, "none", False, False, sms, **t) == (256, 2, 4)
    # SwiGLU gate/up: 128 columns of each operand per tile (256 MMA columns), 4 stages
    assert gk.choose_config(16384, 12288, "swiglu", False, False, sms, **t) == (128, 2, 4)
    # dSwiGLU: 128x256 with the TMA-store epilogue (gate / up by TMA into its ring), 128x128 without
    assert gk.choose_config(8192, 17408, "dswiglu", False, False, sms, **t) == (256, 2, 4)
    assert gk.choose_config(8192, 17408, "dswiglu", True, False, sms, groups=8) == (128, 1, 7)
    # float32 / accumulating epilogues use 128-wide tiles
    assert gk.choose_config(4096, 4096, "none", False, True, sms)[0] == 128
    # small problems: narrower tiles, no cluster
    assert gk.choose_config(1, 256, "none", False, False, sms, **t) == (64, 1, 8)
    assert gk.choose_config(1000, 4096, "none", False, False, sms, **t) == (128, 1, 6)
    assert gk.choose_config(1000, 4096, "none", False, False, sms) == (128, 1, 7)
    # grouped: never clustered
    assert gk.choose_config(8 * 4096, 4096, "none", True, False, sms, groups=8)[1] == 1
    for bn, nb in ((64, 1), (128, 1), (256, 1), (128, 2)):
        for tma in (False, True):
            stages = gk._max_stages(bn, "swiglu" if nb == 2 else "none", tma)
            used = stages * gk._stage_bytes(bn, nb) + gk._epi_bytes(tma) + gk.SMEM_RESERVE
            assert stages >= 4 and used <= gk.SMEM_BYTES


def test_dswiglu_epilogue_warps_plan(monkeypatch):
    # dSwiGLU's epilogue on the producer warp group's idle warps (epi_wg) serves where the TMA-store
    # epilogue takes 128 x 256 tiles: no store ring, as many stages as fit beside the padded float16 dh tile
    dout, wd = torch.empty(8192, 5120, dtype=torch.bfloat16), torch.empty(5120, 17408, dtype=torch.bfloat16)
    g = torch.empty(8192, 17408, dtype=torch.bfloat16)
    kw = dict(epilogue="dswiglu", gate=g, up=torch.empty_like(g))
    monkeypatch.setattr(gk, "EPI_WG_DEFAULT", True)
    spec = plan_cpu(dout, wd, None, **kw).spec
    assert (spec.epi_wg, spec.tma_store, spec.epi_tma_load, spec.bn, spec.stages) == (True, False, False, 256, 3)
    assert spec.stages * gk._stage_bytes(256, 1) + gk._dh_bytes(256) + gk.SMEM_RESERVE <= gk.SMEM_BYTES
    # where 128-wide tiles are picked (a small grid), or the register-to-global epilogue is asked for: not served
    gs = torch.empty(1000, 776, dtype=torch.bfloat16)
    small = plan_cpu(torch.empty(1000, 384, dtype=torch.bfloat16), torch.empty(384, 776, dtype=torch.bfloat16), None,
                     epilogue="dswiglu", gate=gs, up=torch.empty_like(gs)).spec
    assert small.bn == 128 and not small.epi_wg and small.tma_store
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", {"tma_store": False})
    direct = plan_cpu(dout, wd, None, **kw).spec
    assert not direct.epi_wg and not direct.tma_store and direct.bn == 128
    # a sweep's stage count is honoured only as far as it fits beside the dh tile
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", {"stages": 4})
    assert plan_cpu(dout, wd, None, **kw).spec.stages == 3
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", {"stages": 2})
    assert plan_cpu(dout, wd, None, **kw).spec.stages == 2
    # off: the store ring with gate / up by TMA, as before
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", {"epi_wg": False})
    ring = plan_cpu(dout, wd, None, **kw).spec
    assert (ring.epi_wg, ring.tma_store, ring.epi_tma_load, ring.stages) == (False, True, True, 4)
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", None)
    monkeypatch.setattr(gk, "EPI_WG_DEFAULT", False)
    assert not plan_cpu(dout, wd, None, **kw).spec.epi_wg


def test_unit_dims_get_aligned_strides():
    # M == 1 views with an unaligned (irrelevant) row stride are re-strided, not declined
    x = torch.randn(3, 40).bfloat16()[1:2, :16]  # stride (40, 1) is fine; make a worse one:
    a = x.as_strided((1, 16), (3, 1))
    p = plan_cpu(a, torch.randn(16, 24).bfloat16(), None, epilogue="none")
    assert p.spec.a_major == "k" and p.a.stride() == (16, 1)


def _dense(m=64, k=64, n=64, dtype=torch.bfloat16):
    return torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)


@pytest.mark.parametrize(
    "what",
    ["K not a multiple of 8", "N not a multiple of 8", "float32", "unaligned pointer", "strided rows", "K == 0",
     "unaligned out rows", "int64 bias", "b_tail head not whole k-blocks", "b_tail of another major order"],
)
def test_declines(what):
    a, b = _dense()
    kw = {}
    if what == "K not a multiple of 8":
        a, b = torch.randn(64, 60).bfloat16(), torch.randn(60, 64).bfloat16()
    elif what == "N not a multiple of 8":
        b = torch.randn(64, 60).bfloat16()
    elif what == "float32":
        a, b = a.float(), b.float()
    elif what == "unaligned pointer":
        a = torch.randn(64, 72).bfloat16()[:, 1:65]  # 2-byte offset
    elif what == "strided rows":
        a = torch.randn(64, 128).bfloat16()[:, ::2]
    elif what == "K == 0":
        a, b = torch.randn(64, 0).bfloat16(), torch.randn(0, 64).bfloat16()
    elif what == "unaligned out rows":
        kw["out"] = torch.empty(64, 68).bfloat16()[:, :64]
    elif what == "int64 bias":
        kw["bias"] = torch.zeros(64, dtype=torch.int64)
    elif what == "b_tail head not whole k-blocks":
        a, b = torch.randn(64, 136).bfloat16(), torch.randn(72, 64).bfloat16()
        kw["b_tail"] = torch.randn(64, 64).bfloat16()
    elif what == "b_tail of another major order":
        a = torch.randn(64, 128).bfloat16()
        kw["b_tail"] = torch.randn(64, 64).bfloat16().t()
    with pytest.raises(Unsupported):
        plan_cpu(a, b, None, epilogue="none", **kw)


def test_declines_without_sm90_before_touching_memory():
    a, b = _dense()
    with pytest.raises(Unsupported):
        gk.can_implement(a, b)
    with pytest.raises(Unsupported):
        gk.gemm(a, b)


@pytest.mark.parametrize(
    "what,arg",
    [
        ("a 1-D", "a"), ("K mismatch", "b"), ("dtype mismatch", "b"), ("beta without out", "beta"),
        ("bias shape", "bias"), ("row_scale shape", "row_scale"), ("out shape", "out"), ("offsets dtype", "group_offsets"),
        ("offsets length", "group_offsets"), ("bad epilogue", "epilogue"), ("b_up shape", "b_up"), ("gate shape", "gate"),
        ("b_tail K", "b_tail"), ("b_tail dtype", "b_tail"), ("b_tail with swiglu", "b_tail"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(what, arg):
    a, b = _dense()
    kw = dict(epilogue="none")
    b2 = None
    if what == "a 1-D":
        a = torch.randn(64).bfloat16()
    elif what == "K mismatch":
        b = torch.randn(32, 64).bfloat16()
    elif what == "dtype mismatch":
        b = b.half()
    elif what == "beta without out":
        kw["beta"] = 1.0
    elif what == "bias shape":
        kw["bias"] = torch.zeros(63).bfloat16()
    elif what == "row_scale shape":
        kw["row_scale"] = torch.zeros(65)
    elif what == "out shape":
        kw["out"] = torch.empty(64, 72).bfloat16()
    elif what == "offsets dtype":
        b = torch.randn(2, 64, 64).bfloat16()
        kw["group_offsets"] = torch.tensor([0, 32, 64])
    elif what == "offsets length":
        b = torch.randn(2, 64, 64).bfloat16()
        kw["group_offsets"] = torch.tensor([0, 64], dtype=torch.int32)
    elif what == "bad epilogue":
        kw["epilogue"] = "gelu"
    elif what == "b_up shape":
        kw["epilogue"] = "swiglu"
        b2 = torch.randn(64, 32).bfloat16()
    elif what == "gate shape":
        kw.update(epilogue="dswiglu", gate=torch.randn(64, 32).bfloat16(), up=torch.randn(64, 64).bfloat16())
    elif what == "b_tail K":  # K1 + K2 must be a's K
        kw["b_tail"] = torch.randn(8, 64).bfloat16()
    elif what == "b_tail dtype":
        a = torch.randn(64, 128).bfloat16()
        kw["b_tail"] = torch.randn(64, 64).half()
    elif what == "b_tail with swiglu":
        a = torch.randn(64, 128).bfloat16()
        kw.update(epilogue="swiglu", b_tail=torch.randn(64, 64).bfloat16())
        b2 = b
    with pytest.raises(ValueError, match=arg):
        plan_cpu(a, b, b2, **kw)


# ------------------------------------------------------------------ compile tier (sm_90a, no GPU needed)


def _compile_cases():
    """(name, plan kwargs builder, expected spec facts): every epilogue, layout and schedule."""
    bf, fp = torch.bfloat16, torch.float16

    def fwd():
        x, w = torch.empty(16384, 4096, dtype=bf), torch.empty(4096, 4096, dtype=bf)
        return (x, w.t(), None), {}

    def dgrad_bias_rs():
        dy, w = torch.empty(1000, 4096, dtype=fp), torch.empty(4096, 1024, dtype=fp)
        return (dy, w, None), dict(bias=torch.empty(1024), row_scale=torch.empty(1000))

    def wgrad_accumulate():
        dy, x = torch.empty(8192, 4096, dtype=bf), torch.empty(8192, 4096, dtype=bf)
        return (dy.t(), x, None), dict(out=torch.empty(4096, 4096), beta=1.0)

    def dx_stacked():  # the MLP's dx = [dgate | dup] @ [w_gate; w_up]: w_up continues w_gate along K
        dgu, wg = torch.empty(16384, 2 * 12288, dtype=bf), torch.empty(12288, 4096, dtype=bf)
        return (dgu, wg, None), dict(b_tail=torch.empty_like(wg))

    def small_n():
        return (torch.empty(256, 512, dtype=bf), torch.empty(64, 512, dtype=bf).t(), None), {}

    def swiglu():
        x, w = torch.empty(16384, 4096, dtype=bf), torch.empty(2 * 12288, 4096, dtype=bf)
        return (x, w[:12288].t(), w[12288:].t()), dict(
            epilogue="swiglu", store_preact=True, bias=torch.empty(12288, dtype=bf), bias2=torch.empty(12288, dtype=bf)
        )

    def swiglu_mlp_forward():  # what fused.swiglu_mlp launches: pre-activations stored, no bias
        x, w = torch.empty(16384, 4096, dtype=bf), torch.empty(2 * 12288, 4096, dtype=bf)
        return (x, w[:12288].t(), w[12288:].t()), dict(epilogue="swiglu", store_preact=True)

    def dswiglu():
        dout, wd = torch.empty(8192, 5120, dtype=bf), torch.empty(5120, 17408, dtype=bf)
        g = torch.empty(8192, 17408, dtype=bf)
        return (dout, wd, None), dict(epilogue="dswiglu", gate=g, up=torch.empty_like(g), row_scale=torch.empty(8192))

    def dswiglu_ring():  # the store-ring epilogue (gate / up by TMA into it), asked for: epi_wg is the default here
        args, kw = dswiglu()
        return args, dict(kw, _over=dict(epi_wg=False))

    def dswiglu_global_loads():  # gate / up read from global memory one subtile ahead (before epi_tma_load)
        args, kw = dswiglu_ring()
        kw.pop("row_scale")
        return args, dict(kw, _spec=dict(epi_tma_load=False))

    def dswiglu_epilogue_warps():  # the epilogue on the producer warp group's idle warps (epi_wg): the default here
        return dswiglu()

    def grouped():
        h, w = torch.empty(8 * 4096, 7168, dtype=bf), torch.empty(8, 4096, 7168, dtype=bf)
        return (h, w.transpose(1, 2), None), dict(
            group_offsets=torch.zeros(9, dtype=torch.int32), row_scale=torch.empty(8 * 4096)
        )

    def grouped_swiglu():
        x, wg, wu = torch.empty(32768, 2048, dtype=bf), torch.empty(128, 2048, 768, dtype=bf), torch.empty(128, 2048, 768, dtype=bf)
        return (x, wg, wu), dict(epilogue="swiglu", group_offsets=torch.zeros(129, dtype=torch.int32))

    def grouped_dswiglu():
        dout, wd = torch.empty(4096, 2048, dtype=bf), torch.empty(16, 1536, 2048, dtype=bf)
        g = torch.empty(4096, 1536, dtype=bf)
        return (dout.t().contiguous().t(), wd.transpose(1, 2), None), dict(
            epilogue="dswiglu", gate=g, up=torch.empty_like(g), group_offsets=torch.zeros(17, dtype=torch.int32)
        )

    return [
        ("fwd_xWt", fwd, dict(a_major="k", b_major="k", bn=256, cluster_m=2, epilogue="none")),
        ("dgrad_fp16_bias_rowscale", dgrad_bias_rs, dict(a_major="k", b_major="n", ab_dtype="float16", bias_dtype="float32", rs_dtype="float32")),
        ("wgrad_fp32_accumulate", wgrad_accumulate, dict(a_major="m", b_major="n", out_dtype="float32", has_beta=True, bn=128)),
        ("small_n", small_n, dict(bn=64, cluster_m=1)),
        ("dx_b_tail", dx_stacked, dict(b_major="n", b_tail=True, bn=256, cluster_m=2)),
        ("swiglu_preact_bias", swiglu, dict(epilogue="swiglu", store_preact=True, bias_dtype="bfloat16", bn=128, cluster_m=2)),
        ("swiglu_mlp_forward", swiglu_mlp_forward, dict(epilogue="swiglu", store_preact=True, bias_dtype="", bn=128)),
        ("dswiglu_rowscale", dswiglu_ring, dict(epilogue="dswiglu", b_major="n", rs_dtype="float32", bn=256, tma_store=True,
                                           epi_tma_load=True)),
        ("dswiglu_global_loads", dswiglu_global_loads, dict(epilogue="dswiglu", bn=256, tma_store=True, epi_tma_load=False,
                                                            epi_wg=False)),
        ("dswiglu_epilogue_warps", dswiglu_epilogue_warps, dict(epilogue="dswiglu", bn=256, epi_wg=True, tma_store=False,
                                                                epi_tma_load=False, stages=3, rs_dtype="float32")),
        ("grouped_rowscale", grouped, dict(grouped=True, cluster_m=1, b_major="k", rs_dtype="float32")),
        ("grouped_swiglu", grouped_swiglu, dict(grouped=True, epilogue="swiglu", b_major="n")),
        ("grouped_dswiglu_m_major", grouped_dswiglu, dict(grouped=True, epilogue="dswiglu", a_major="m", b_major="k")),
    ]


_CASES = _compile_cases()


def _cubin_resources(path):
    """(registers per thread, stack frame bytes) of the one kernel in a cubin, from its ELF
    ``.nv.info`` section (EIATTR_REGCOUNT = 0x2f, EIATTR_FRAME_SIZE = 0x11; values are
    (symbol index, count) pairs)."""
    import struct

    d = open(path, "rb").read()
    shoff = struct.unpack_from("<Q", d, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * shentsize) for i in range(shnum)]
    names_off = secs[shstrndx][4]
    found = {}
    for sec in secs:
        name = d[names_off + sec[0]: d.index(b"\0", names_off + sec[0])]
        if name != b".nv.info":
            continue
        p, end = sec[4], sec[4] + sec[5]
        while p < end:
            fmt, attr = d[p], d[p + 1]
            if fmt == 0x04:  # EIFMT_SVAL: 2-byte size, then the value
                size = struct.unpack_from("<H", d, p + 2)[0]
                if attr in (0x2F, 0x11):
                    found[attr] = struct.unpack_from("<II", d, p + 4)[1]
                p += 4 + size
            else:
                p += 4
    return found.get(0x2F), found.get(0x11)


@pytest.mark.compile
@pytest.mark.parametrize("name,build,expect", _CASES, ids=[c[0] for c in _CASES])
def test_compiles_for_sm90a_and_caches_on_disk(name, build, expect, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDNN_TRAIN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUDNN_TRAIN_ARCH", "sm_90a")
    args, kw = build()
    kw.setdefault("epilogue", "none")
    over = kw.pop("_spec", {})
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", kw.pop("_over", None))  # through the planner
    spec = dataclasses.replace(plan_cpu(*args, **kw).spec, **over)
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", None)
    for field, value in expect.items():
        assert getattr(spec, field) == value, (field, spec)
    kc.clear_memory_cache()
    cubin_dir = tmp_path / "cubin"
    cubin_dir.mkdir()
    monkeypatch.setattr(gk, "_EXTRA_COMPILE_OPTIONS", f" --keep-cubin --dump-dir {cubin_dir}")
    fn = gk.get_compiled(spec)
    assert callable(fn)
    objs = list(tmp_path.rglob("*.o"))
    assert len(objs) == 1 and objs[0].stat().st_size > 0
    # setmaxnreg 24 (producer) / 240 (consumers) needs the whole register file at launch:
    # 168 registers x 384 threads = 24 x 128 + 240 x 256 (104 x 128 + 200 x 256 with the epilogue warps);
    # and no spills (no stack frame)
    (cubin,) = list(cubin_dir.glob("*.cubin"))
    regs, frame = _cubin_resources(cubin)
    producer, consumer = gk.EPI_WG_REGS if spec.epi_wg else (gk.PRODUCER_REGS, gk.CONSUMER_REGS)
    assert regs * gk.THREADS == producer * 128 + consumer * 256, regs
    assert frame == 0, f"{frame} bytes of stack: register spills"
    # a second process (simulated: empty memory cache) loads the object without compiling
    kc.clear_memory_cache()

    def no_compile(_spec):
        raise AssertionError("compiled again instead of loading from the disk cache")

    monkeypatch.setattr(gk, "_build", no_compile)
    assert callable(gk.get_compiled(spec))
    kc.clear_memory_cache()


def _ptxas():
    """A standalone ptxas (CUDA's, else the one Triton ships), or None."""
    import shutil

    found = shutil.which("ptxas")
    if found:
        return found
    try:
        import triton

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
        return str(cand) if cand.exists() else None
    except ImportError:
        return None


def _ptxas_report(ptx: Path, ptxas: str) -> str:
    """ptxas -v's report on a PTX file; a PTX ISA version newer than this ptxas knows is lowered
    to the one it names (the kernels use no instruction of the newer versions)."""
    import re

    def run():
        return subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull], capture_output=True, text=True)

    r = run()
    m = re.search(r"Unsupported \.version \S+; current version is '([\d.]+)'", r.stderr)
    if m:
        ptx.write_text(re.sub(r"^\.version \S+", f".version {m.group(1)}", ptx.read_text(), count=1, flags=re.M))
        r = run()
    assert r.returncode == 0, r.stderr
    return r.stderr


@pytest.mark.compile
@pytest.mark.parametrize("name,build,expect", _CASES, ids=[c[0] for c in _CASES])
def test_wgmmas_are_not_serialized(name, build, expect, tmp_path, monkeypatch):
    # ptxas serializes every WGMMA of a kernel (its note C7514) when a non-WGMMA instruction touches
    # accumulator registers inside a WGMMA pipeline stage; the SwiGLU kernel storing its
    # pre-activations once did; nor may it inject a wait (C7517) to protect accumulator registers.
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no standalone ptxas (neither CUDA's nor Triton's) to report on the PTX")
    monkeypatch.setenv("CUDNN_TRAIN_ARCH", "sm_90a")
    args, kw = build()
    kw.setdefault("epilogue", "none")
    over = kw.pop("_spec", {})
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", kw.pop("_over", None))  # through the planner
    spec = dataclasses.replace(plan_cpu(*args, **kw).spec, **over)
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", None)
    monkeypatch.setattr(gk, "_EXTRA_COMPILE_OPTIONS", f" --keep-ptx --dump-dir {tmp_path}")
    gk._build(spec)
    (ptx,) = list(tmp_path.glob("*.ptx"))
    report = _ptxas_report(ptx, ptxas)
    assert "C7514" not in report, report
    assert "C7517" not in report, report
    assert " 0 bytes spill stores" in report, report


# ------------------------------------------------------------------ GPU tier

DEV = "cuda"
_CHILD_LOG = os.environ.get("CUDNN_TRAIN_GPU_TEST_LOG")  # set: this process is a child running GPU tests
_INPROCESS = os.environ.get("CUDNN_TRAIN_GPU_TESTS_INPROCESS") == "1"
_CHILD_IDLE_S = 1800  # a child that finishes no test for this long (a hung kernel) is stopped
_CHILD_EXIT_S = 120  # a child that has run its last test and does not exit within this is stopped
_current: dict = {}  # the running test's item and config (set by the autouse fixture below)
_results: dict[str, tuple[str, str]] = {}  # parent: nodeid -> (outcome, detail) reported by a child


@pytest.fixture(autouse=True)
def _note_current_test(request):
    _current["node"] = request.node
    _current["config"] = request.config
    yield


def _child_log(nodeid: str, event: str, detail: str = "") -> None:
    with open(_CHILD_LOG, "a") as f:
        f.write(json.dumps({"nodeid": nodeid, "event": event, "detail": detail}) + "\n")


def _run_logged(fn, nodeid, args, kwargs):
    """Child side: run the test body, then wait for the GPU, and log the outcome as it happens."""
    _child_log(nodeid, "start")
    try:
        fn(*args, **kwargs)
        torch.cuda.synchronize()
    except pytest.skip.Exception as exc:
        _child_log(nodeid, "skipped", str(exc))
        raise
    except BaseException:
        _child_log(nodeid, "failed", traceback.format_exc())
        raise
    _child_log(nodeid, "passed")


def _read_child_log(log: Path) -> tuple[list[str], dict[str, tuple[str, str]]]:
    started, ended = [], {}
    if log.exists():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec["event"] == "start":
                started.append(rec["nodeid"])
            else:
                ended[rec["nodeid"]] = (rec["event"], rec["detail"])
    return started, ended


def _run_child(node, config) -> None:
    """Parent side: run this GPU test and the later ones of this file that have no result yet in one
    child pytest process (it stops at the first failure), and record what it reports."""
    items = node.session.items
    later = items[items.index(node):]
    batch = [it.nodeid for it in later
             if it.path == node.path and it.get_closest_marker("gpu") is not None and it.nodeid not in _results]
    root = str(config.rootpath)
    with tempfile.TemporaryDirectory() as tmp:
        log, out = Path(tmp) / "log.jsonl", Path(tmp) / "out.txt"
        env = dict(os.environ, CUDNN_TRAIN_GPU_TEST_LOG=str(log))
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.pop("PYTEST_ADDOPTS", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--maxfail=1", *batch]
        stopped = ""
        with open(out, "w") as f:
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT)
            seen, last, finished = -1, time.monotonic(), False
            while proc.poll() is None:
                time.sleep(0.5)
                size = log.stat().st_size if log.exists() else 0
                if size != seen:
                    seen, last = size, time.monotonic()
                    started, ended = _read_child_log(log)
                    # all done, or stopped at a failure: the child only has to exit now
                    finished = len(ended) == len(batch) or any(o == "failed" for o, _ in ended.values())
                idle = time.monotonic() - last
                if finished and idle > _CHILD_EXIT_S:
                    stopped = f"it did not exit within {_CHILD_EXIT_S} s of its last test, stopped"
                elif idle > _CHILD_IDLE_S:
                    stopped = f"no test finished for {_CHILD_IDLE_S} s, stopped"
                if stopped:
                    proc.kill()
                    proc.wait()
        started, ended = _read_child_log(log)
        _results.update(ended)
        why = stopped or f"exit code {proc.returncode}"
        tail = out.read_text(errors="replace")[-8000:]
        for nodeid in started:
            if nodeid not in _results:  # it began and never ended: the child died (or hung) in it
                _results[nodeid] = ("failed", f"the child process died during this test ({why}); its output:\n{tail}")
        if node.nodeid not in _results:
            _results[node.nodeid] = ("failed", f"the child process did not run this test ({why}); its output:\n{tail}")


def gpu(fn):
    """``@pytest.mark.gpu``, and run the test in a child process (see the module docstring)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        node = _current["node"]
        if _CHILD_LOG is not None:
            return _run_logged(fn, node.nodeid, args, kwargs)
        if _INPROCESS:
            return fn(*args, **kwargs)
        if node.nodeid not in _results:
            _run_child(node, _current["config"])
        outcome, detail = _results[node.nodeid]
        if outcome == "skipped":
            pytest.skip(detail)
        if outcome != "passed":
            pytest.fail(f"in the child process:\n{detail}", pytrace=False)

    return pytest.mark.gpu(run)


@gpu
@pytest.mark.parametrize("m", [1, 127, 129, 1000])
@pytest.mark.parametrize("a_major,b_major", [("k", "k"), ("k", "n"), ("m", "k"), ("m", "n")])
def test_gemm_layouts_and_odd_m(m, a_major, b_major):
    k, n = 136, 520  # K tail (136 = 2 * 64 + 8) and N tail (520 = 8 * 64 + 8)
    a = make_a(m, k, a_major, device=DEV)
    b = make_b(k, n, b_major, device=DEV)
    out = poison_(torch.empty(m, n, device=DEV, dtype=torch.bfloat16))
    gk.gemm(a, b, out=out)
    assert rel_l2(out, ref_gemm(a, b)) <= TOL16


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(4200, 4096, 512), (4096, 8192, 256), (300, 64, 1024)])
def test_gemm_tile_configs(dtype, m, n, k):
    # (4200, 4096): 128x256 tiles in 2-CTA clusters with an odd number of M-tiles (one CTA of the
    # last cluster has no rows); (4096, 8192): full tiles only; (300, 64): 128x64 tiles
    a = make_a(m, k, "k", dtype, device=DEV)
    b = make_b(k, n, "k", dtype, device=DEV)
    spec = gk._plan(a, b, None, epilogue="none").spec
    if (m, n) != (300, 64):
        assert (spec.bn, spec.cluster_m) == (256, 2)
    out = poison_(torch.empty(m, n, device=DEV, dtype=dtype))
    gk.gemm(a, b, out=out)
    assert rel_l2(out, ref_gemm(a, b)) <= TOL16


@gpu
@pytest.mark.parametrize("m,n", [(1, 520), (129, 520), (1000, 520), (4200, 4096)])
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_gemm_b_tail(m, n, b_major):
    # b_tail continues b along K: 192 = 3 k-blocks from b, then 136 (a K tail) from b_tail;
    # (4200, 4096) runs 128x256 tiles in 2-CTA clusters (b and b_tail multicast)
    k1, k2 = 192, 136
    a = make_a(m, k1 + k2, "k", device=DEV)
    b, bt = make_b(k1, n, b_major, device=DEV), make_b(k2, n, b_major, device=DEV)
    assert gk._plan(a, b, None, epilogue="none", b_tail=bt).spec.b_tail
    out = poison_(torch.empty(m, n, device=DEV, dtype=torch.bfloat16))
    gk.gemm(a, b, out=out, b_tail=bt)
    assert rel_l2(out, ref_gemm(a, torch.cat([b, bt]))) <= TOL16


@gpu
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_rs", [False, True])
def test_gemm_bias_alpha_row_scale(bias_dtype, with_rs):
    m, k, n = 1000, 256, 520
    a = make_a(m, k, "k", device=DEV)
    b = make_b(k, n, "n", device=DEV)
    bias = torch.randn(n, device=DEV).to(bias_dtype) if bias_dtype else None
    rs = torch.rand(m, device=DEV) if with_rs else None
    out = poison_(torch.empty(m, n, device=DEV, dtype=torch.bfloat16))
    gk.gemm(a, b, out=out, bias=bias, alpha=0.75, row_scale=rs)
    assert rel_l2(out, ref_gemm(a, b, bias=bias, alpha=0.75, row_scale=rs)) <= TOL16


@gpu
@pytest.mark.parametrize("m", [129, 2048])
def test_gemm_float32_out_and_accumulate(m):
    k, n = 264, 1024
    dy = make_a(m, k, "m", device=DEV)  # wgrad-like: a = dy.t()
    x = make_b(k, n, "n", device=DEV)
    out = poison_(torch.empty(m, n, device=DEV))
    gk.gemm(dy, x, out=out)
    assert rel_l2(out, ref_gemm(dy, x)) <= TOL32
    main_grad = torch.randn(m, n, device=DEV)
    expect = ref_gemm(dy, x, beta=1.0, out0=main_grad)
    res = gk.gemm(dy, x, out=main_grad, beta=1.0)
    assert res is main_grad
    assert rel_l2(main_grad, expect) <= TOL32
    fresh = gk.gemm(dy, x, out_dtype=torch.float32)
    assert fresh.dtype == torch.float32 and rel_l2(fresh, ref_gemm(dy, x)) <= TOL32


@gpu
@pytest.mark.parametrize("m", [1, 1000])
@pytest.mark.parametrize("store_preact,with_bias,with_rs", [(False, False, False), (True, True, True), (True, False, False)])
@pytest.mark.parametrize("b_major", ["k", "n"])
def test_swiglu(m, store_preact, with_bias, with_rs, b_major):
    # K-major B (a stacked [gate; up] nn.Linear weight, what swiglu_mlp passes) and N-major B
    k, i = 512, 1032
    x = make_a(m, k, "k", device=DEV)
    if b_major == "k":
        w = (torch.randn(2 * i, k, device=DEV) / k**0.5).bfloat16()  # stacked [gate; up]
        bg, bu = w[:i].t(), w[i:].t()
    else:
        bg, bu = make_b(k, i, "n", device=DEV), make_b(k, i, "n", device=DEV)
    biases = (torch.randn(i, device=DEV).bfloat16(), torch.randn(i, device=DEV).bfloat16()) if with_bias else (None, None)
    rs = torch.rand(m, device=DEV) if with_rs else None
    out = poison_(torch.empty(m, i, device=DEV, dtype=torch.bfloat16))
    outs = dict(out_gate=poison_(torch.empty_like(out)), out_up=poison_(torch.empty_like(out))) if store_preact else {}
    res = gk.gemm_swiglu(x, bg, bu, bias_gate=biases[0], bias_up=biases[1], row_scale=rs, store_preact=store_preact, out=out, **outs)
    h_ref, g_ref, u_ref = ref_swiglu(x, bg, bu, *biases, row_scale=rs)
    if store_preact:
        h, g, u = res
        assert g is outs["out_gate"] and u is outs["out_up"]
        assert rel_l2(g, g_ref) <= TOL16 and rel_l2(u, u_ref) <= TOL16
    else:
        h = res
    assert h is out
    assert rel_l2(h, h_ref) <= TOL16


@gpu
@pytest.mark.parametrize("m", [129, 1000])
@pytest.mark.parametrize("with_rs", [False, True])
def test_dswiglu(m, with_rs):
    k, i = 384, 776
    dout = make_a(m, k, "k", device=DEV)
    wd = make_b(k, i, "n", device=DEV)  # dh = dout @ w_down, w_down [H=k, I=i] row-major
    gate = torch.randn(m, i, device=DEV).bfloat16() * 3
    up = torch.randn(m, i, device=DEV).bfloat16()
    rs = torch.rand(m, device=DEV) if with_rs else None
    dg = poison_(torch.empty(m, i, device=DEV, dtype=torch.bfloat16))
    du = poison_(torch.empty_like(dg))
    gk.gemm_dswiglu(dout, wd, gate, up, row_scale=rs, out_dgate=dg, out_dup=du)
    dg_ref, du_ref = ref_dswiglu(dout, wd, gate, up, row_scale=rs)
    assert rel_l2(dg, dg_ref) <= TOL16
    assert rel_l2(du, du_ref) <= TOL16


@gpu
@pytest.mark.parametrize("variant", [{}, {"ewg_rows": 2}], ids=["default", "rows2"])
@pytest.mark.parametrize("m,n,with_rs", [(4200, 1032, True), (8200, 2056, False)])
def test_dswiglu_on_the_epilogue_warps(m, n, with_rs, variant, monkeypatch):
    # The producer warp group's idle warps form dgate / dup from dh handed over in shared memory as
    # float16 with a float32 factor per row and tile (epi_wg): held to the float32 reference whole and
    # row group by row group, with rows 1e24 apart in magnitude (each keeps its own factor) and a row of
    # zeros; M and N tails (TMA zero-filled rows, stores stopped at M and N) and several tiles per CTA
    # (4200 x 1032: 165 tiles of 128 x 256; 8200 x 2056: 585) on 132 persistent CTAs. Row 3's dh overflows
    # to inf in one column (3e38 * 2): its finite values keep their own scale (the row maximum skips infs).
    k = 320
    dout = make_a(m, k, "k", device=DEV)
    dout[0] = 0
    dout[1::7] *= 1e-20
    dout[2::7] *= 1e4
    dout[3, 0] = 3e38
    wd = make_b(k, n, "n", device=DEV)
    wd[0] = 0
    wd[0, 5] = 2
    gate = torch.randn(m, n, device=DEV).bfloat16() * 3
    up = torch.randn(m, n, device=DEV).bfloat16()
    rs = torch.rand(m, device=DEV) if with_rs else None
    monkeypatch.setattr(gk, "EPI_WG_DEFAULT", True)
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", variant or None)
    spec = gk._plan(dout, wd, None, epilogue="dswiglu", gate=gate, up=up, row_scale=rs).spec
    assert spec.epi_wg and spec.bn == 256 and all(getattr(spec, f) == v for f, v in variant.items())
    dg = poison_(torch.empty(m, n, device=DEV, dtype=torch.bfloat16))
    du = poison_(torch.empty_like(dg))
    gk.gemm_dswiglu(dout, wd, gate, up, row_scale=rs, out_dgate=dg, out_dup=du)
    dg_ref, du_ref = ref_dswiglu(dout, wd, gate, up, row_scale=rs)
    rows = torch.arange(m, device=DEV)
    fin = torch.isfinite(dout[3].float() @ wd.float())
    assert not fin[5] and fin.sum() == n - 1
    for got, want in ((dg, dg_ref), (du, du_ref)):
        finite = rows != 3
        assert rel_l2(got[finite], want[finite]) <= TOL16
        for sel in (rows % 7 == 1, rows % 7 == 2, (rows % 7 > 2) | (rows % 7 == 0)):
            sel = sel & (rows > 0) & finite
            assert rel_l2(got[sel], want[sel]) <= TOL16
        assert (got[0] == 0).all()
        assert rel_l2(got[3, fin], want[3, fin]) <= TOL16
        assert not torch.isfinite(got[3, 5])


GROUP_SIZES = [0, 1, 300, 0, 129, 7, 1000, 0, 2500, 128]


@gpu
@pytest.mark.parametrize("b_major", ["k", "n"])
@pytest.mark.parametrize("a_major", ["k", "m"])
@pytest.mark.parametrize("with_rs", [False, True])
def test_grouped_gemm_uneven_and_empty_groups(a_major, b_major, with_rs):
    k, n = 200, 392
    start, tail = 5, 3  # rows before the first group and after the last one are not written
    rows = start + sum(GROUP_SIZES) + tail
    a = make_a(rows, k, a_major, device=DEV)
    b = make_grouped_b(len(GROUP_SIZES), k, n, b_major, device=DEV)
    offs = offsets_of(GROUP_SIZES, start, device=DEV)
    rs = torch.rand(rows, device=DEV) if with_rs else None
    out = poison_(torch.empty(rows, n, device=DEV, dtype=torch.bfloat16))
    gk.grouped_gemm(a, b, offs, out=out, row_scale=rs)
    (ref,) = ref_grouped(lambda ag, bg, rsg: ref_gemm(ag, bg, row_scale=rsg), a, offs, b,
                         [None if rs is None else rs[offs[g]:offs[g + 1]] for g in range(len(GROUP_SIZES))],
                         rows_out=rows)
    inside = ~torch.isnan(ref[:, 0])
    assert torch.isnan(out[~inside].float()).all(), "rows outside every group were written"
    assert rel_l2(out[inside], ref[inside]) <= TOL16


@gpu
def test_grouped_swiglu_and_dswiglu():
    k, i = 256, 520
    sizes = [3, 0, 700, 129, 0, 1]
    rows = sum(sizes)
    offs = offsets_of(sizes, device=DEV)
    x = make_a(rows, k, "k", device=DEV)
    wg = make_grouped_b(len(sizes), k, i, "k", device=DEV)
    wu = make_grouped_b(len(sizes), k, i, "k", device=DEV)
    rs = torch.rand(rows, device=DEV)
    out = poison_(torch.empty(rows, i, device=DEV, dtype=torch.bfloat16))
    h, g, u = gk.gemm_swiglu(x, wg, wu, row_scale=rs, store_preact=True, out=out, group_offsets=offs)
    refs = ref_grouped(lambda xg, bg, bu, r: ref_swiglu(xg, bg, bu, row_scale=r), x, offs, wg, wu,
                       [rs[offs[j]:offs[j + 1]] for j in range(len(sizes))], rows_out=rows)
    for got, want in zip((h, g, u), refs):
        assert rel_l2(got, want) <= TOL16
    # backward: dgate/dup from dout @ w_down[g] (w_down [G, H=k, I] row-major -> b = [G, K=k, N=i])
    dout = make_a(rows, k, "k", device=DEV)
    wd = make_grouped_b(len(sizes), k, i, "n", device=DEV)
    dg, du = gk.gemm_dswiglu(dout, wd, g, u, row_scale=rs, group_offsets=offs)
    drefs = ref_grouped(lambda dg_, b_, g_, u_, r_: ref_dswiglu(dg_, b_, g_, u_, row_scale=r_), dout, offs, wd,
                        [g[offs[j]:offs[j + 1]] for j in range(len(sizes))],
                        [u[offs[j]:offs[j + 1]] for j in range(len(sizes))],
                        [rs[offs[j]:offs[j + 1]] for j in range(len(sizes))], rows_out=rows)
    assert rel_l2(dg, drefs[0]) <= TOL16
    assert rel_l2(du, drefs[1]) <= TOL16


@gpu
@pytest.mark.parametrize("epilogue", ["swiglu", "dswiglu"])
def test_grouped_epilogues_with_column_major_a(epilogue):
    # a column-major A has M innermost, and a TMA box must start on a 16-byte (8-row) boundary there:
    # every group below starts off that grid, so the kernel starts each group's tiles at a rounded-down
    # row and must not store the rows of the previous group (or before the first) that this brings in
    k, i = 136, 264
    sizes = [5, 0, 128, 300, 1, 0, 77]
    start, tail = 3, 6
    rows = start + sum(sizes) + tail
    offs = offsets_of(sizes, start, device=DEV)
    bounds = offsets_of(sizes, start).tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    a = make_a(rows, k, "m", device=DEV)
    rs = torch.rand(rows, device=DEV)
    new_out = lambda: poison_(torch.empty(rows, i, device=DEV, dtype=torch.bfloat16))  # noqa: E731
    if epilogue == "swiglu":
        wg = make_grouped_b(len(sizes), k, i, "n", device=DEV)
        wu = make_grouped_b(len(sizes), k, i, "n", device=DEV)
        out, out_gate, out_up = new_out(), new_out(), new_out()
        got = gk.gemm_swiglu(a, wg, wu, row_scale=rs, store_preact=True, out=out, out_gate=out_gate, out_up=out_up,
                             group_offsets=offs)
        assert got[0] is out and got[1] is out_gate and got[2] is out_up
        want = ref_grouped(lambda ag, bg, bu, r: ref_swiglu(ag, bg, bu, row_scale=r), a, offs, wg, wu,
                           [rs[lo:hi] for lo, hi in spans], rows_out=rows)
    else:
        wd = make_grouped_b(len(sizes), k, i, "k", device=DEV)
        gate = torch.randn(rows, i, device=DEV).bfloat16() * 3
        up = torch.randn(rows, i, device=DEV).bfloat16()
        out_dgate, out_dup = new_out(), new_out()
        got = gk.gemm_dswiglu(a, wd, gate, up, row_scale=rs, out_dgate=out_dgate, out_dup=out_dup, group_offsets=offs)
        assert got[0] is out_dgate and got[1] is out_dup
        want = ref_grouped(lambda ag, b_, g_, u_, r_: ref_dswiglu(ag, b_, g_, u_, row_scale=r_), a, offs, wd,
                           [gate[lo:hi] for lo, hi in spans], [up[lo:hi] for lo, hi in spans],
                           [rs[lo:hi] for lo, hi in spans], rows_out=rows)
    inside = ~torch.isnan(want[0][:, 0])
    assert int(inside.sum()) == sum(sizes)
    for o, w in zip(got, want):
        assert torch.isnan(o[~inside].float()).all(), "rows outside every group were written"
        assert rel_l2(o[inside], w[inside]) <= TOL16


@gpu
@pytest.mark.parametrize("m,n", [(1000, 2056), (4200, 4096)])
@pytest.mark.parametrize("epilogue", ["none", "swiglu", "dswiglu"])
def test_tma_store_epilogue_against_direct_stores(epilogue, m, n, monkeypatch):
    # Dense 16-bit outputs leave through shared memory and TMA stores (spec.tma_store); the
    # register-to-global epilogue (grouped GEMMs, float32 or accumulated outputs) computes the same
    # float32 values and rounds them once. With the same tile both give bitwise-equal outputs, tile
    # edges (M and N tails, TMA-clipped) and several tiles per CTA included; dSwiGLU's TMA-store
    # kernel takes 128 x 256 tiles where the direct one keeps 128 x 128 (4200 x 4096, 2-CTA
    # clusters): there both are held to the float32 reference. (dSwiGLU's ring epilogue is asked for here:
    # the epilogue warps, its default where they serve, have their own cases.)
    monkeypatch.setattr(gk, "EPI_WG_DEFAULT", False)
    k = 320
    a = make_a(m, k, "k", device=DEV)
    rs = torch.rand(m, device=DEV)
    if epilogue == "none":
        b = make_b(k, n, "n", device=DEV)
        kw = dict(bias=torch.randn(n, device=DEV), row_scale=rs, alpha=0.5)

        def run():
            return (gk.gemm(a, b, **kw),)

        refs = (ref_gemm(a, b, **kw),)
    elif epilogue == "swiglu":
        bg, bu = make_b(k, n, "k", device=DEV), make_b(k, n, "k", device=DEV)

        def run():
            return gk.gemm_swiglu(a, bg, bu, store_preact=True)

        refs = ref_swiglu(a, bg, bu)
    else:
        b = make_b(k, n, "n", device=DEV)
        gate = torch.randn(m, n, device=DEV).bfloat16() * 3
        up = torch.randn(m, n, device=DEV).bfloat16()

        def run():
            return gk.gemm_dswiglu(a, b, gate, up)

        refs = ref_dswiglu(a, b, gate, up)
    args = (a, bg, bu) if epilogue == "swiglu" else (a, b, None)
    extra = dict(gate=gate, up=up) if epilogue == "dswiglu" else {}
    spec_tma = gk._plan(*args, epilogue=epilogue, **extra).spec
    assert spec_tma.tma_store
    via_tma = run()
    monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", {"tma_store": False})
    spec_direct = gk._plan(*args, epilogue=epilogue, **extra).spec
    assert not spec_direct.tma_store
    direct = run()
    if epilogue == "dswiglu" and (m, n) == (4200, 4096):
        assert (spec_tma.bn, spec_direct.bn) == (256, 128)
    if epilogue == "dswiglu":  # gate / up by TMA into the store ring (the default) or from global memory
        assert spec_tma.epi_tma_load and not spec_direct.epi_tma_load
        monkeypatch.setattr(gk, "_CONFIG_OVERRIDE", {"epi_tma_load": False})
        spec_global = gk._plan(*args, epilogue=epilogue, **extra).spec
        assert spec_global.tma_store and not spec_global.epi_tma_load
        for t, d in zip(via_tma, run()):
            assert torch.equal(t, d)
    for t, d, r in zip(via_tma, direct, refs):
        assert rel_l2(t, r) <= TOL16
        if spec_tma.bn == spec_direct.bn:
            assert torch.equal(t, d)
        else:
            assert rel_l2(d, r) <= TOL16


@gpu
def test_deterministic_bitwise():
    a = make_a(3000, 1024, "k", device=DEV)
    b = make_b(1024, 2048, "k", device=DEV)
    r1 = gk.gemm(a, b)
    r2 = gk.gemm(a, b)
    assert torch.equal(r1, r2)
    offs = offsets_of([1000, 0, 1999, 1], device=DEV)
    bg = make_grouped_b(4, 1024, 512, "n", device=DEV)
    g1 = gk.grouped_gemm(a, bg, offs)
    g2 = gk.grouped_gemm(a, bg, offs)
    assert torch.equal(g1, g2)


@gpu
def test_grouped_gemm_is_graph_capturable_with_device_offsets():
    k, n = 128, 256
    rows = 1024
    a = make_a(rows, k, "k", device=DEV)
    b = make_grouped_b(4, k, n, "k", device=DEV)
    offs = offsets_of([100, 400, 0, 524], device=DEV)
    out = torch.zeros(rows, n, device=DEV, dtype=torch.bfloat16)
    gk.grouped_gemm(a, b, offs, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gk.grouped_gemm(a, b, offs, out=out)
    offs.copy_(offsets_of([0, 1, 1000, 23], device=DEV))  # new routing, same buffers, no host sync
    graph.replay()
    torch.cuda.synchronize()
    (ref,) = ref_grouped(lambda ag, bg: ref_gemm(ag, bg), a, offs, b, rows_out=rows)
    assert rel_l2(out, ref) <= TOL16


@gpu
def test_declines_on_gpu_before_touching_memory():
    a = make_a(64, 60, "k", device=DEV)
    b = make_b(60, 64, "k", device=DEV)
    with pytest.raises(Unsupported, match="K=60"):
        gk.gemm(a, b)
    with pytest.raises(Unsupported, match="dtype"):
        gk.gemm(a.float()[:, :56], b.float()[:56])

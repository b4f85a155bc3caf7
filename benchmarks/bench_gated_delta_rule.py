"""Gated DeltaNet (chunked, K = V = 128, bf16): cutedsl SM90 kernels vs FLA and FlashQLA, in one run.

    python -m benchmarks.bench_gated_delta_rule [--json out.json] [--quick] [--head-dim 64] [--layer-flags]
        [--rounds N]

Inputs as a GDN layer feeds the op: q, k, v bf16, ``use_qk_l2norm_in_kernel=True``,
g = logsigmoid(.) float32, beta = sigmoid(.) bf16, no initial state, no final state.
``--gates layer``: g from FLA's GatedDeltaNet layer at its initialization (:func:`fla_init_gate`: slow-decaying
heads, which a decay-truncated sequence split cannot cut short) instead of ``logsigmoid(U(0, 1))``; with
``--layer-flags`` the same A_log and dt_bias in the kernel. ``--seg`` adds the row ``op-seg``: the op with the
SM90 recurrences' sequence split on (``CUDNN_TRAIN_GDN_CHAIN_SEG``, ``_SWEEP_SEG``, ``_FWD_WS_SEG`` = auto, the
carried forward off),
forward+backward on the training path. ``--carry`` adds ``op-carry``: the op with the carried splits
(``CUDNN_TRAIN_GDN_FWD_CARRY`` and ``_SWEEP_CARRY`` = auto: each boundary warmed up within 16 chunks or carried
exactly; the inference forward, its default since the twenty-seventh session, so ``op`` has it too, and the
training path's reverse sweep, opt-in), forward+backward on the training path.
``--layer-flags``: the call FLA's and our GatedDeltaNet layers make instead (raw gate input and beta
logits, bf16, ``use_gate_in_kernel`` with A_log and dt_bias, ``use_beta_sigmoid_in_kernel``; gradients
also to A_log and dt_bias). ``--head-dim 64``: K = V = 64. FlashQLA serves neither, so its row is left out.

FLOP model (cuDNN's, ANCHORS.md): ``2 * (3 C^2 K + 2 C^2 V + 2 C K V)`` per chunk of
C = 64 tokens and value head (chunks counted per sequence, a partial chunk counting
whole); the backward counts 3x the forward, so forward+backward is 4x. Tokens/s counts
B * T tokens.

Rows: ``cutedsl`` is the SM90 kernel forward called directly (no dispatch);
``op`` is ``cudnn_train.fused.chunk_gated_delta_rule`` with its own backend choice,
reported with ``last_path``; forward+backward of the op (gradients to q, k, v, g, beta)
runs whatever backend serves a differentiable call (with FlashQLA installed and enabled in FLA, the
plain calls timed here go to FLA and FlashQLA; this benchmark sets ``FLA_FLASH_QLA=0`` unless given,
so FLA's row is FLA's own kernels and the op serves them on ours). ``sm90-train`` is the op with the
SM90 training path forced on (``CUDNN_TRAIN_GDN_SM90_TRAIN=1`` around each call),
its stage 3 on the kernel (the default; ``--torch-stage3`` adds ``sm90-train-t3``, stage 3 in
torch, for comparison). ``fla`` is FLA's
``chunk_gated_delta_rule`` and ``flashqla`` FlashQLA's (``flash-qla``), when they import.
A peer that fails to run is reported once with its error and left out. ``--graphed`` also times every row
captured as a CUDA graph (``benchmarks.common.bench_graphed``: GPU time with the host's cost left out, as the
peers' Python can be the bound; NaN with the capture's error where a row cannot be captured), in the same
rounds, with its own columns and ratios. ``--rounds N`` times every row
N times, interleaved, and reports each row's median: FlashQLA's calls are nearly host-bound (about
0.3-0.6 ms of Python a forward against 0.40 ms of GPU time), so one round can catch it slowed by
the machine (0.40 and 0.65 ms forwards were both measured at B4 T4096 in single rounds; in the twenty-second
session even its graphed forward was 0.65 ms, against 0.43 in the twenty-first). ``--kernels`` then lists each
row's kernels of one forward and one forward+backward with their GPU times (``torch.profiler``), to see which
kernel such a figure moves in.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from benchmarks.common import bench, bench_graphed, ceilings, kernels_of_last_call, parser, report

C = 64
TRAIN_ENV = "CUDNN_TRAIN_GDN_SM90_TRAIN"
STAGE3_ENV = "CUDNN_TRAIN_GDN_SM90_STAGE3"
TRAIN_ROWS = {"sm90-train": "kernel"}  # row -> its stage 3 (main() adds "sm90-train-t3": "torch" on request)
ROW_ENV: dict[str, dict[str, str]] = {}  # row -> environment set around its calls (main() adds "op-seg" on request)
FWD_ONLY = {"cutedsl"}  # rows timed forward only


SEG_ENVS = ("CUDNN_TRAIN_GDN_CHAIN_SEG", "CUDNN_TRAIN_GDN_SWEEP_SEG", "CUDNN_TRAIN_GDN_FWD_WS_SEG")


def with_env(f, env: dict[str, str]):
    """``f`` with the environment variables ``env`` set during the call (restored after)."""

    def g():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return f()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return g


def with_train_path(f, stage3):
    """``f`` with the SM90 training path forced on during the call, stage 3 as given."""
    return with_env(f, {TRAIN_ENV: "1", STAGE3_ENV: stage3})


def fla_init_gate(HV: int, device="cuda", generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_log, dt_bias)`` float32 ``[HV]`` as FLA's GatedDeltaNet layer initializes them: ``A ~ U(0, 16)``,
    ``dt_bias`` the inverse softplus of ``dt = exp(U(log 1e-3, log 1e-1))`` (at least 1e-4). Its decays
    ``-A softplus(a + dt_bias)`` for a gate input ``a ~ N(0, 1)`` are far slower than ``logsigmoid(U(0, 1))``'s:
    some heads never decay by e^-20 over thousands of tokens (``tools/diag_gdn_decay_split.py``)."""
    A = torch.rand(HV, generator=generator, dtype=torch.float64) * 16
    lo, hi = math.log(1e-3), math.log(1e-1)
    dt = torch.exp(torch.rand(HV, generator=generator, dtype=torch.float64) * (hi - lo) + lo).clamp(min=1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    return A.log().float().to(device), dt_bias.float().to(device)


def flops_forward(lengths: list[int], HV: int, K: int, V: int) -> float:
    chunks = sum(math.ceil(n / C) for n in lengths)
    return chunks * HV * 2.0 * (3 * C * C * K + 2 * C * C * V + 2 * C * K * V)


def make_inputs(B, T, H, HV, K, V, requires_grad=False, layer_flags=False, gate_params=None):
    """q, k, v, g, beta; with ``layer_flags`` g is the raw gate input and beta logits (bf16 projections, as a
    GatedDeltaNet layer passes them with ``use_gate_in_kernel`` and ``use_beta_sigmoid_in_kernel``). Without it,
    ``gate_params`` ``(A_log, dt_bias)`` make g the layer's float32 decay ``-exp(A_log) softplus(a + dt_bias)`` of a
    gate input ``a ~ N(0, 1)`` (the call FLA's layer would make with the gate computed outside the kernel) instead
    of ``logsigmoid(U(0, 1))``."""
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, HV, V, device=dev, dtype=torch.bfloat16)
    if layer_flags:
        g = torch.randn(B, T, HV, device=dev, dtype=torch.bfloat16)
        beta = torch.randn(B, T, HV, device=dev, dtype=torch.bfloat16)
    else:
        if gate_params is not None:
            A_log, dt_bias = gate_params
            g = -A_log.exp() * F.softplus(torch.randn(B, T, HV, device=dev, dtype=torch.float32) + dt_bias)
        else:
            g = F.logsigmoid(torch.rand(B, T, HV, device=dev, dtype=torch.float32))
        beta = torch.rand(B, T, HV, device=dev, dtype=torch.bfloat16).sigmoid()
    ts = (q, k, v, g, beta)
    if requires_grad:
        ts = tuple(t.requires_grad_() for t in ts)
    return ts


def load_peers():
    peers = {}
    # FLA 0.6 routes chunk_gated_delta_rule to FlashQLA whenever flash_qla imports (SM90, K = V = 128)
    # unless FLA_FLASH_QLA=0: keep the fla row FLA's own kernels (set before fla is imported)
    os.environ.setdefault("FLA_FLASH_QLA", "0")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn

        peers["fla"] = getattr(fla_fn, "_cudnn_train_original", fla_fn)
    except Exception as e:  # noqa: BLE001 - any import failure means the peer is absent
        print(f"FLA not importable: {type(e).__name__}: {e}")
    try:
        import flash_qla

        fn = getattr(flash_qla, "chunk_gated_delta_rule", None)
        if fn is None:
            from flash_qla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        peers["flashqla"] = fn
    except Exception as e:  # noqa: BLE001
        print(f"FlashQLA not importable: {type(e).__name__}: {e}")
    return peers


# the dense shapes (B, T, H, HV), K = V = 128; the GDN tools time the same ones
SHAPES = [(4, 4096, 16, 32), (1, 16384, 16, 32), (8, 2048, 32, 32)]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shapes", type=int, default=None, help="time only the first N shapes")
    ap.add_argument("--from-shape", type=int, default=0, help="start at this shape (0-based; with --shapes: N from it)")
    ap.add_argument("--skip", default="", help="comma-separated rows to leave out (e.g. flashqla,sm90-train)")
    ap.add_argument("--torch-stage3", action="store_true", help="also time the training path with stage 3 in torch")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128), help="K = V (default 128)")
    ap.add_argument("--layer-flags", action="store_true",
                    help="the GatedDeltaNet layer's call: gate and beta sigmoid in the kernel (FlashQLA rejects it)")
    ap.add_argument("--kernels", action="store_true",
                    help="after the rounds, each row's kernels of one forward and one forward+backward under "
                         "torch.profiler (GPU time each): where a row's time goes, e.g. when a peer's figure moves")
    ap.add_argument("--gates", choices=("bench", "layer"), default="bench",
                    help="g: logsigmoid(U(0, 1)) (bench, fast decay), or the decay of FLA's GatedDeltaNet layer at its "
                         "initialization (layer: fla_init_gate; with --layer-flags its A_log and dt_bias)")
    ap.add_argument("--seg", action="store_true",
                    help="also time the op with the SM90 recurrences' sequence split on (row op-seg, forward+backward "
                         "on the training path: CUDNN_TRAIN_GDN_CHAIN_SEG, _SWEEP_SEG, _FWD_WS_SEG = auto)")
    ap.add_argument("--carry", action="store_true",
                    help="also time the op with the carried splits (row op-carry: CUDNN_TRAIN_GDN_FWD_CARRY and "
                         "_SWEEP_CARRY = auto; forward+backward on the training path)")
    ap.add_argument("--graphed", action="store_true",
                    help="also time every row captured as a CUDA graph (GPU time, host cost left out; NaN where a "
                         "row cannot be captured)")
    args = ap.parse_args()
    if args.torch_stage3:
        TRAIN_ROWS["sm90-train-t3"] = "torch"
    if args.seg:
        TRAIN_ROWS["op-seg"] = "kernel"
        # the carried forward off, since where it splits it takes the call the warm-up split would
        ROW_ENV["op-seg"] = {**{name: "auto" for name in SEG_ENVS}, "CUDNN_TRAIN_GDN_FWD_CARRY": "1"}
    if args.carry:
        TRAIN_ROWS["op-carry"] = "kernel"
        ROW_ENV["op-carry"] = {"CUDNN_TRAIN_GDN_FWD_CARRY": "auto", "CUDNN_TRAIN_GDN_SWEEP_CARRY": "auto"}
    if not torch.cuda.is_available():
        print("bench_gated_delta_rule: needs a CUDA GPU; nothing to time here")
        return
    from cudnn_train import last_path
    from cudnn_train.fused.gated_delta_rule import chunk_gated_delta_rule
    from cudnn_train.kernels import gated_delta_rule_fwd_sm90 as F90

    ceil = ceilings(args.quick)
    peers = load_peers()
    broken: set[str] = set()
    K = V = args.head_dim
    if args.layer_flags or K != 128:  # FlashQLA serves neither (K = V = 128, no in-kernel gate or beta flags)
        peers.pop("flashqla", None)
    # (label, B, T, H, HV, varlen lengths or None)
    shapes = [(f"B{B} T{T}", B, T, H, HV, None) for B, T, H, HV in SHAPES]
    gen = torch.Generator().manual_seed(0)
    mixed = [int(x) for x in torch.randint(1, 4097, (12,), generator=gen)] + [1, 63, 65, 8192]
    shapes.append(("varlen mixed", 1, sum(mixed), 16, 32, mixed))
    if args.quick:
        shapes = [("B2 T1024", 2, 1024, 16, 32, None), ("varlen", 1, 1000, 16, 32, [1, 63, 65, 871])]
    shapes = shapes[args.from_shape:][: args.shapes]
    skip = {s for s in args.skip.split(",") if s}
    peers = {n: f for n, f in peers.items() if n not in skip}

    rows = []
    for label, B, T, H, HV, lengths in shapes:
        seq_lengths = lengths if lengths is not None else [T] * B
        fl = flops_forward(seq_lengths, HV, K, V)
        cu = None
        if lengths is not None:
            cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device="cuda", dtype=torch.int32)
        if args.gates == "layer":
            gate_params = fla_init_gate(HV, generator=torch.Generator().manual_seed(HV))
        else:  # the layer-flags call's own draw (fast decay, as the bench gates)
            gate_params = (torch.log(torch.empty(HV, device="cuda").uniform_(1, 16)),
                           torch.randn(HV, device="cuda") * 0.1) if args.layer_flags else None
        q, k, v, g, beta = make_inputs(B, T, H, HV, K, V, layer_flags=args.layer_flags,
                                       gate_params=None if args.layer_flags else gate_params)
        do = torch.randn(B, T, HV, V, device="cuda", dtype=torch.bfloat16)
        kw = dict(use_qk_l2norm_in_kernel=True)
        params = ()  # A_log, dt_bias: trained by the layer, gradients asked for with the others
        if args.layer_flags:
            A_log, dt_bias = gate_params
            kw.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
            params = (A_log, dt_bias)

        def fwd_fn(name):
            return with_env(fwd_call(name), ROW_ENV.get(name, {}))

        def fb_fn(name):
            return with_env(fb_call(name), ROW_ENV.get(name, {}))

        def fwd_call(name):
            if name == "cutedsl":
                return lambda: F90.forward(q, k, v, g, beta, cu_seqlens=cu, **kw)
            if name == "op" or name in TRAIN_ROWS:
                return lambda: chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, **kw)
            fn = peers[name]
            cul = None if cu is None else cu.long()
            return lambda: fn(q, k, v, g, beta, cu_seqlens=cul, **kw)

        def fb_call(name):
            leaves = tuple(t.detach().clone().requires_grad_() for t in (q, k, v, g, beta, *params))
            kwl = dict(kw, **dict(zip(("A_log", "dt_bias"), leaves[5:])))
            if name == "op" or name in TRAIN_ROWS:
                f = lambda: chunk_gated_delta_rule(*leaves[:5], cu_seqlens=cu, **kwl)[0]  # noqa: E731
                if name in TRAIN_ROWS:
                    return with_train_path(lambda: torch.autograd.grad(f(), leaves, do), TRAIN_ROWS[name])
            else:
                fn = peers[name]
                cul = None if cu is None else cu.long()
                f = lambda: fn(*leaves[:5], cu_seqlens=cul, **kwl)[0]  # noqa: E731
            return lambda: torch.autograd.grad(f(), leaves, do)

        runs: dict[str, list[tuple[float, ...]]] = {}
        paths = {}
        names = [n for n in ["cutedsl", "op", *TRAIN_ROWS, *peers] if n not in broken | skip]
        for rnd in range(max(1, args.rounds)):  # rounds interleave the rows: drift of the machine hits all alike
            for name in [n for n in names if n not in broken]:
                try:
                    t_f = bench(fwd_fn(name), args.warmup, args.rep)
                    if name == "op":
                        paths["fwd"] = last_path("chunk_gated_delta_rule")
                    t_fb = float("nan")
                    if name not in FWD_ONLY:
                        t_fb = bench(fb_fn(name), args.warmup, args.rep)
                        if name == "op":
                            paths["fwd+bwd"] = last_path("chunk_gated_delta_rule")
                        if name in TRAIN_ROWS:
                            assert last_path("chunk_gated_delta_rule") == "cutedsl:sm90-train"
                    t_g = (float("nan"), float("nan"))
                    if args.graphed:  # the same calls as CUDA graphs: GPU time alone
                        t_g = (bench_graphed(fwd_fn(name), args.warmup, args.rep),
                               float("nan") if name in FWD_ONLY else bench_graphed(fb_fn(name), args.warmup, args.rep))
                except Exception as e:  # noqa: BLE001 - report the peer's failure once, time the others
                    if name in peers or name in TRAIN_ROWS:
                        print(f"{name} failed at {label}: {type(e).__name__}: {e}")
                        broken.add(name)
                        runs.pop(name, None)
                        continue
                    raise
                runs.setdefault(name, []).append((t_f, t_fb, *t_g))
                # partial results survive a timeout
                graphed = f", graphed fwd {t_g[0]:.3f} ms, fwd+bwd {t_g[1]:.3f} ms" if args.graphed else ""
                print(f"{label}: round {rnd + 1}: {name} fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms{graphed}", flush=True)
        if args.kernels:  # where each row's GPU time goes, kernel by kernel (one call after the timings)
            for name in runs:
                for what, fn in (("fwd", fwd_fn(name)), ("fwd+bwd", None if name in FWD_ONLY else fb_fn(name))):
                    if fn is None:
                        continue
                    kern, total = kernels_of_last_call(fn)
                    print(f"{label}: {name} {what} kernels, {total:.3f} ms in all: " + "; ".join(
                        f"{kn[:60]} {ms:.3f}" for kn, ms in kern), flush=True)
        # each row's figure: the median of its rounds (a lower median for an even count; NaN rounds last)
        times = {n: tuple(sorted((r[i] for r in rs), key=lambda x: (x != x, x))[(len(rs) - 1) // 2]
                          for i in range(4)) for n, rs in runs.items()}

        def best_peer(i):
            ts = [t[i] for n, t in times.items() if n in peers and t[i] == t[i]]
            return min(ts) if ts else float("nan")

        best_f, best_fb, best_gf, best_gfb = (best_peer(i) for i in range(4))
        ntok = sum(seq_lengths)
        for name, (t_f, t_fb, t_gf, t_gfb) in times.items():
            impl = name if name != "op" else f"op [{paths.get('fwd')} / {paths.get('fwd+bwd')}]"
            rows.append(
                {
                    "shape": f"{label} H{H} HV{HV}",
                    "impl": impl,
                    "fwd ms": t_f,
                    "fwd Mtok/s": ntok / t_f / 1e3,
                    "fwd TFLOP/s": fl / t_f / 1e9,
                    "fwd % bf16 peak": 100 * fl / t_f / 1e9 / ceil["bf16_tflops"],
                    "fwd speedup vs best peer": best_f / t_f,
                    "fwd+bwd ms": t_fb,
                    "fwd+bwd TFLOP/s": 4 * fl / t_fb / 1e9,
                    "fwd+bwd speedup vs best peer": best_fb / t_fb,
                }
            )
            if args.graphed:
                rows[-1].update({"graphed fwd ms": t_gf, "graphed fwd vs best peer": best_gf / t_gf,
                                 "graphed fwd+bwd ms": t_gfb, "graphed fwd+bwd vs best peer": best_gfb / t_gfb})
        del q, k, v, g, beta, do
        torch.cuda.empty_cache()
    flags = "l2norm, gate and beta sigmoid in kernel" if args.layer_flags else "l2norm in kernel"
    report(rows, args, ceil, f"chunk_gated_delta_rule, K=V={K}, bf16, {flags}, {args.gates} gates")


if __name__ == "__main__":
    main()

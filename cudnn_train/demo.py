"""Train a small Qwen3-Next-style hybrid byte-level language model with cudnn_train's layers.

    python -m cudnn_train.demo                  # CPU preset: a few minutes on 2 cores
    python -m cudnn_train.demo --preset gpu     # about 100M parameters, a few minutes on an H200

The model: tied byte embeddings (vocabulary 256), then ``--layers`` blocks in a 3:1 pattern
(three Gated DeltaNet blocks, then one gated softmax-attention block, repeated; with fewer
than four layers there is no attention block), each block ``x + mixer(norm(x))`` then
``x + SwiGLUMLP(norm(x))``, a final RMSNorm and the tied output head.

* Gated DeltaNet: :class:`cudnn_train.layers.gated_deltanet.GatedDeltaNet` (FLA's layer:
  short convolutions, gated delta rule, gated RMSNorm output), ``num_v_heads = 2 * heads``,
  ``expand_v = 1``, head dim ``hidden / heads``, as in Qwen3-Next.
* Gated attention (Qwen3-Next): q/k RMSNorm per head, rotary positions counted from the start
  of each packed sequence, causal ``scaled_dot_product_attention`` that never crosses a
  sequence boundary, the output multiplied by ``sigmoid(x W_g)`` before ``o_proj``.
* MLP: :class:`cudnn_train.layers.mlp.SwiGLUMLP`, ffn size ``8/3 * hidden`` rounded up to 64.

Data: the ``.py`` files of the running Python's standard library (``sysconfig``; no download),
split into train and held-out *by file* with a fixed hash of the relative path (1 in 20 files
held out). A training step packs ``--batch`` rows of ``--seq-len`` bytes; half of the rows are
two windows from different places, so every step has sequences of several lengths, packed into
one row with ``cu_seqlens`` (the varlen path of every layer). Each sequence predicts its own
next bytes only. Held-out bits per byte are measured on fixed windows of held-out files before
and after training.

Training: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine
decay to a tenth of the peak, gradient clipping at 1; bf16 autocast on CUDA, float32 on CPU.

Writes into ``--out`` (default ``./demo_out``): ``loss_curve.png`` and ``log.json``. Bad options
(unknown names, a device that is not present, sizes that do not divide into heads, ...) print
one line and exit with code 2 before any work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PROG = "cudnn_train.demo"
PROMPT = b"import os\n\n\ndef "
HELD_OUT_ONE_IN = 20
EVAL_SEED = 1234  # held-out windows are the same whatever --seed is

PRESETS: dict[str, dict] = {
    # about 1.1M parameters, 2048 bytes a step: 1.8-2.7 min in all on 2 idle CPU cores (4.2 min with
    # another job on them); held-out bits/byte 7.48 -> 2.44
    "cpu": dict(steps=200, layers=4, hidden=128, heads=2, seq_len=128, batch=16, lr=3e-3,
                eval_windows=64, sample_bytes=120),
    # about 108M parameters, 16384 bytes a step: 2.2 steps/s (29k bytes/s) on an H200 with
    # CUDNN_TRAIN_BACKEND=torch, so 600 steps take about 5 minutes there
    "gpu": dict(steps=600, layers=12, hidden=768, heads=6, seq_len=1024, batch=16, lr=1e-3,
                eval_windows=256, sample_bytes=320),
}

PRECISIONS = ("bf16",)
NOT_YET = ("fp8", "mxfp8", "nvfp4", "fp16", "fp32", "float8", "fp4")


# ---------------------------------------------------------------------- options


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _BadOption(message)


class _BadOption(Exception):
    pass


def _parser() -> _Parser:
    p = _Parser(prog=PROG, description="Train a small hybrid (Gated DeltaNet + gated attention) byte-level LM.")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="size defaults (default: cpu)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="default: auto (cuda if present)")
    p.add_argument("--precision", default="bf16", help="bf16 (autocast on CUDA; float32 math on CPU); others not yet")
    p.add_argument("--layers", type=int, help="number of blocks (every 4th is attention)")
    p.add_argument("--hidden", type=int, help="model width")
    p.add_argument("--heads", type=int, help="heads of the attention and q/k heads of Gated DeltaNet")
    p.add_argument("--seq-len", type=int, help="bytes per packed row")
    p.add_argument("--batch", type=int, help="packed rows per step")
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--eval-windows", type=int, help="held-out windows of --seq-len bytes for bits per byte")
    p.add_argument("--sample-bytes", type=int, help="bytes of the greedy sample")
    p.add_argument("--seed", type=int, default=0, help="initialization and data order (default: 0)")
    p.add_argument("--out", default="demo_out", help="output directory (default: ./demo_out)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and check every option; raises _BadOption with a one-line message."""
    args = _parser().parse_args(argv)
    preset = PRESETS[args.preset]
    for key in ("steps", "layers", "hidden", "heads", "seq_len", "batch", "lr", "eval_windows", "sample_bytes"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    for key, low in (("steps", 1), ("layers", 1), ("hidden", 2), ("heads", 1), ("seq_len", 8), ("batch", 1),
                     ("eval_windows", 1), ("sample_bytes", 0)):
        if getattr(args, key) < low:
            raise _BadOption(f"--{key.replace('_', '-')} {getattr(args, key)}: must be at least {low}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise _BadOption(f"--lr {args.lr}: must be a positive number")
    if args.hidden % args.heads:
        raise _BadOption(f"--hidden {args.hidden} does not divide into --heads {args.heads} heads")
    head_dim = args.hidden // args.heads
    if head_dim % 2:
        raise _BadOption(f"--hidden / --heads = {head_dim}: the head dim must be even (rotary positions)")
    if head_dim > 256:
        raise _BadOption(f"--hidden / --heads = {head_dim}: the head dim must be at most 256 (Gated DeltaNet)")
    prec = args.precision.strip().lower()
    if prec not in PRECISIONS:
        why = "the low-precision recipes have not landed yet" if prec in NOT_YET else "unknown precision"
        raise _BadOption(f"--precision {args.precision}: only bf16 is available for now ({why})")
    args.precision = prec
    if args.device == "cuda" and not torch.cuda.is_available():
        raise _BadOption("--device cuda: no CUDA GPU is present")
    if args.device == "auto":
        if args.preset == "gpu" and not torch.cuda.is_available():
            raise _BadOption("--preset gpu: no CUDA GPU is present (pass --device cpu to run it on the CPU anyway)")
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise _BadOption(f"--out {args.out}: exists and is not a directory")
    return args


# ---------------------------------------------------------------------- data


class Corpus:
    """The standard library's .py files as one byte tensor, split into train and held-out by file."""

    def __init__(self, min_len: int):
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages", "__pycache__"}
        paths = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
        if not paths:
            raise RuntimeError(f"no .py files under the standard library {root}")
        self.root = root
        parts = {"train": [], "heldout": []}
        for p in paths:
            rel = p.relative_to(root).as_posix()
            split = "heldout" if zlib.crc32(rel.encode()) % HELD_OUT_ONE_IN == 0 else "train"
            try:
                parts[split].append(p.read_bytes())
            except OSError:
                continue
        self.splits = {name: _Split(files, min_len) for name, files in parts.items()}

    def describe(self) -> dict:
        return {
            "stdlib": str(self.root),
            **{f"{k}_files": v.n_files for k, v in self.splits.items()},
            **{f"{k}_bytes": v.n_bytes for k, v in self.splits.items()},
        }


class _Split:
    def __init__(self, files: list[bytes], min_len: int):
        files = [f for f in files if len(f) >= min_len]
        if not files:
            raise RuntimeError(f"no standard-library file is at least {min_len} bytes long")
        self.n_files = len(files)
        self.data = torch.frombuffer(bytearray(b"".join(files)), dtype=torch.uint8)
        lens = torch.tensor([len(f) for f in files], dtype=torch.int64)
        self.starts = torch.cumsum(lens, 0) - lens
        self.lens = lens
        self.n_bytes = int(lens.sum())
        self.min_len = min_len

    def window(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """n consecutive bytes of one file: the file drawn in proportion to its length."""
        f = int(torch.multinomial(self.lens.double(), 1, generator=gen))
        off = int(torch.randint(0, int(self.lens[f]) - n + 1, (1,), generator=gen))
        s = int(self.starts[f]) + off
        return self.data[s : s + n]


class Batch:
    """Packed rows: ``ids``/``targets`` ``[1, T]``, ``cu_seqlens`` ``[N + 1]``, ``seg`` ``[rows, L]``, ``pos`` ``[T]``."""

    def __init__(self, segments: list[torch.Tensor], rows: int, row_len: int, device: torch.device):
        ids = torch.cat([s[:-1] for s in segments]).long()
        tgt = torch.cat([s[1:] for s in segments]).long()
        lens = [len(s) - 1 for s in segments]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        assert cu[-1] == rows * row_len
        seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        pos = torch.cat([torch.arange(n) for n in lens])
        self.ids = ids.view(1, -1).to(device)
        self.targets = tgt.view(1, -1).to(device)
        self.cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
        self.seg = seg.view(rows, row_len).to(device)
        self.pos = pos.to(device)
        self.tokens = rows * row_len
        self.n_seqs = len(lens)


def train_batch(split: _Split, rows: int, row_len: int, gen: torch.Generator, device: torch.device) -> Batch:
    segments = []
    for _ in range(rows):
        if row_len >= 16 and float(torch.rand((), generator=gen)) < 0.5:
            a = int(torch.randint(row_len // 4, 3 * row_len // 4 + 1, (1,), generator=gen))
            segments += [split.window(a + 1, gen), split.window(row_len - a + 1, gen)]
        else:
            segments.append(split.window(row_len + 1, gen))
    return Batch(segments, rows, row_len, device)


def eval_batches(split: _Split, n_windows: int, rows: int, row_len: int, device: torch.device) -> list[Batch]:
    gen = torch.Generator().manual_seed(EVAL_SEED)
    windows = [split.window(row_len + 1, gen) for _ in range(n_windows)]
    return [Batch(windows[i : i + rows], len(windows[i : i + rows]), row_len, device) for i in range(0, n_windows, rows)]


# ---------------------------------------------------------------------- model


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary positions (rotate-half form) on ``x [..., T, H, D]`` with positions ``pos [T]``."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class GatedAttention(nn.Module):
    """Qwen3-Next's gated softmax attention: q/k RMSNorm, rotary, causal SDPA, ``* sigmoid(gate)``."""

    def __init__(self, hidden: int, heads: int, rms_norm: type[nn.Module]):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, 2 * hidden, bias=False)  # query and output gate
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.q_norm = rms_norm(self.head_dim, eps=1e-6)
        self.k_norm = rms_norm(self.head_dim, eps=1e-6)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, seg: torch.Tensor | None) -> torch.Tensor:
        _, t, hidden = x.shape
        h, d = self.heads, self.head_dim
        q, gate = self.q_proj(x).view(1, t, h, 2 * d).chunk(2, dim=-1)
        k = self.k_proj(x).view(1, t, h, d)
        v = self.v_proj(x).view(1, t, h, d)
        q = _rope(self.q_norm(q), pos)
        k = _rope(self.k_norm(k), pos)
        if seg is None:  # one sequence
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            o = o.transpose(1, 2)
        else:  # packed rows: causal and block-diagonal over the sequences of each row
            rows, row_len = seg.shape
            same = seg[:, :, None] == seg[:, None, :]
            mask = torch.tril(same)[:, None]  # [rows, 1, L, L]
            qr, kr, vr = (z.reshape(rows, row_len, h, d).transpose(1, 2) for z in (q, k, v))
            o = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
            o = o.transpose(1, 2).reshape(1, t, h, d)
        o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(1, t, hidden))


class Block(nn.Module):
    def __init__(self, kind: str, hidden: int, heads: int, ffn: int, layer_idx: int):
        super().__init__()
        from .layers.gated_deltanet import GatedDeltaNet, RMSNorm
        from .layers.mlp import SwiGLUMLP

        self.kind = kind
        self.mixer_norm = RMSNorm(hidden, eps=1e-6)
        if kind == "gdn":
            self.mixer = GatedDeltaNet(
                hidden_size=hidden, expand_v=1, head_dim=hidden // heads, num_heads=heads, num_v_heads=2 * heads,
                mode="chunk", use_gate=True, use_short_conv=True, conv_size=4, norm_eps=1e-6, layer_idx=layer_idx,
            )
        else:
            self.mixer = GatedAttention(hidden, heads, RMSNorm)
        self.mlp_norm = RMSNorm(hidden, eps=1e-6)
        self.mlp = SwiGLUMLP(hidden, ffn)

    def forward(self, x, cu_seqlens, pos, seg):
        h = self.mixer_norm(x)
        if self.kind == "gdn":
            h = self.mixer(h, cu_seqlens=cu_seqlens)[0]
        else:
            h = self.mixer(h, pos, seg)
        x = x + h
        return x + self.mlp(self.mlp_norm(x))


def layer_kinds(layers: int) -> list[str]:
    """The 3:1 pattern: every fourth block is attention."""
    return ["attn" if i % 4 == 3 else "gdn" for i in range(layers)]


class HybridLM(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int):
        super().__init__()
        from .layers.gated_deltanet import RMSNorm

        ffn = 64 * math.ceil(8 * hidden / 3 / 64)
        self.embed = nn.Embedding(256, hidden)
        self.blocks = nn.ModuleList(Block(k, hidden, heads, ffn, i) for i, k in enumerate(layer_kinds(layers)))
        self.norm = RMSNorm(hidden, eps=1e-6)
        self._init(layers)

    def _init(self, layers: int) -> None:
        std = 0.02
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear):
                scaled = name.endswith("o_proj") or name.endswith("down_proj")
                nn.init.normal_(mod.weight, std=std / math.sqrt(2 * layers) if scaled else std)
        nn.init.normal_(self.embed.weight, std=std)

    def forward(self, ids, cu_seqlens=None, pos=None, seg=None) -> torch.Tensor:
        """Logits ``[1, T, 256]`` for bytes ``ids [1, T]`` (one sequence, or packed with cu_seqlens/pos/seg)."""
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, cu_seqlens, pos, seg)
        return F.linear(self.norm(x), self.embed.weight)  # tied head


# ---------------------------------------------------------------------- training


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _loss(model: HybridLM, b: Batch, device: torch.device) -> torch.Tensor:
    with _autocast(device):
        logits = model(b.ids, b.cu_seqlens, b.pos, b.seg)
    return F.cross_entropy(logits.float().view(-1, 256), b.targets.view(-1))


@torch.no_grad()
def bits_per_byte(model: HybridLM, batches: list[Batch], device: torch.device) -> float:
    was = model.training
    model.eval()
    nats, n = 0.0, 0
    for b in batches:
        nats += float(_loss(model, b, device)) * b.tokens
        n += b.tokens
    model.train(was)
    return nats / n / math.log(2)


@torch.no_grad()
def greedy_sample(model: HybridLM, prompt: bytes, n: int, device: torch.device) -> bytes:
    was = model.training
    model.eval()
    ids = torch.tensor(list(prompt), dtype=torch.long, device=device)[None]
    for _ in range(n):
        with _autocast(device):
            logits = model(ids)
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    model.train(was)
    return bytes(ids[0, len(prompt) :].tolist())


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 10% of the steps (at least 1), cosine decay to peak / 10."""
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * frac)))


def _optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.dim() >= 2 and not name.startswith("embed") and not getattr(p, "_no_weight_decay", False):
            decay.append(p)
        else:
            no_decay.append(p)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _plot(path: Path, losses_bits: list[float], before: float, after: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(losses_bits) + 1))
    smooth, ema = [], None
    for v in losses_bits:
        ema = v if ema is None else 0.9 * ema + 0.1 * v
        smooth.append(ema)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, losses_bits, color="#9bb7d4", lw=0.8, label="train (per step)")
    ax.plot(steps, smooth, color="#1f4e79", lw=1.6, label="train (EMA 0.9)")
    ax.scatter([0, len(steps)], [before, after], color="#c0392b", zorder=3, label="held-out")
    ax.annotate(f"{before:.2f}", (0, before), textcoords="offset points", xytext=(6, -4), fontsize=8)
    ax.annotate(f"{after:.2f}", (len(steps), after), textcoords="offset points", xytext=(-28, 6), fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    import cudnn_train
    from tqdm import tqdm

    t_start = time.time()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    corpus = Corpus(min_len=args.seq_len + 1)
    train, heldout = corpus.splits["train"], corpus.splits["heldout"]
    model = HybridLM(args.layers, args.hidden, args.heads).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    kinds = layer_kinds(args.layers)
    compute = "bf16 autocast" if device.type == "cuda" else "float32"
    print(
        f"{PROG}: {n_params / 1e6:.2f}M parameters, {args.layers} blocks ({kinds.count('gdn')} GatedDeltaNet, "
        f"{kinds.count('attn')} attention), hidden {args.hidden}, {args.heads} heads; device {device} ({compute}); "
        f"{args.batch}x{args.seq_len} bytes a step, {args.steps} steps",
        flush=True,
    )
    print(
        f"{PROG}: data {corpus.root}: {train.n_files} train files ({train.n_bytes / 1e6:.1f} MB), "
        f"{heldout.n_files} held-out files ({heldout.n_bytes / 1e6:.1f} MB)",
        flush=True,
    )

    evals = eval_batches(heldout, args.eval_windows, args.batch, args.seq_len, device)
    bpb_before = bits_per_byte(model, evals, device)
    print(f"{PROG}: held-out bits/byte before training: {bpb_before:.3f} (at {time.time() - t_start:.1f} s)", flush=True)

    opt = _optimizer(model, args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    losses, lrs = [], []
    tokens = 0
    t_train = time.time()
    # steady-state rate: from the end of the first few steps (kernel compiles, autotuning) on
    skip = min(5, args.steps // 5)
    t_steady, tokens_steady = None, 0
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    for step in bar:
        lr = lr_at(step, args.steps, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        b = train_batch(train, args.batch, args.seq_len, gen, device)
        loss = _loss(model, b, device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.detach().item()
        if not math.isfinite(value):
            bar.close()
            raise RuntimeError(f"the training loss became {value} at step {step + 1}")
        losses.append(value / math.log(2))
        lrs.append(lr)
        tokens += b.tokens
        if step == 0:  # the first step compiles the kernels it needs: say how long it took
            tqdm.write(f"{PROG}: first training step done after {time.time() - t_train:.1f} s", file=sys.stderr)
        if step + 1 == skip:
            t_steady = time.time()
        elif t_steady is not None:
            tokens_steady += b.tokens
        tps = tokens / max(time.time() - t_train, 1e-9)
        bar.set_postfix_str(f"loss {losses[-1]:.3f} bits/byte, {tps:,.0f} tok/s, lr {lr:.1e}")
    bar.close()
    train_s = time.time() - t_train
    steady_tps = tokens_steady / max(time.time() - t_steady, 1e-9) if t_steady is not None and tokens_steady else None

    bpb_after = bits_per_byte(model, evals, device)
    sample = greedy_sample(model, PROMPT, args.sample_bytes, device)
    paths = cudnn_train.last_path()
    drop = 1.0 - bpb_after / bpb_before

    print(f"{PROG}: held-out bits/byte: {bpb_before:.3f} -> {bpb_after:.3f} ({100 * drop:.1f}% lower)")
    print(f"{PROG}: {tokens:,} bytes in {train_s:.1f} s of training, {tokens / train_s:,.0f} tokens/s"
          + (f" ({steady_tps:,.0f} tokens/s after the first {skip} steps)" if steady_tps else ""))
    print(f"{PROG}: backend that served each op (cudnn_train.last_path()):")
    width = max((len(k) for k in paths), default=0)
    for op in sorted(paths):
        print(f"    {op:<{width}}  {paths[op]}")
    text = (PROMPT + sample).decode("utf-8", errors="replace")
    print(f"{PROG}: greedy sample from the prompt {PROMPT.decode()!r}:")
    print("    " + text.replace("\n", "\n    "))

    png, log_path = out / "loss_curve.png", out / "log.json"
    title = (
        f"hybrid byte LM, {n_params / 1e6:.2f}M params, {args.layers} blocks, {device.type}; "
        f"held-out {bpb_before:.2f} -> {bpb_after:.2f} bits/byte"
    )
    _plot(png, losses, bpb_before, bpb_after, title)
    log = {
        "config": {k: v for k, v in vars(args).items()},
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "compute": compute,
        "torch": torch.__version__,
        "cudnn_train": cudnn_train.__version__,
        "parameters": n_params,
        "layer_kinds": kinds,
        "data": corpus.describe(),
        "tokens_per_step": args.batch * args.seq_len,
        "train_loss_bits_per_byte": losses,
        "lr": lrs,
        "heldout_bits_per_byte_before": bpb_before,
        "heldout_bits_per_byte_after": bpb_after,
        "heldout_drop_fraction": drop,
        "train_seconds": train_s,
        "tokens_per_second": tokens / train_s,
        "tokens_per_second_after_first_steps": steady_tps,
        "first_steps_left_out": skip,
        "total_seconds": time.time() - t_start,
        "last_path": paths,
        "backend_env": os.environ.get("CUDNN_TRAIN_BACKEND"),
        "sample_prompt": PROMPT.decode(),
        "sample": text,
    }
    log_path.write_text(json.dumps(log, indent=2) + "\n")
    print(f"{PROG}: wrote {png} and {log_path} ({time.time() - t_start:.1f} s in all)")
    return log


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``main(["--steps", "10"])``; bad options exit with code 2 before any work."""
    try:
        args = parse_args(argv)
    except _BadOption as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""cudnn_train.demo: a tiny run learns and writes its outputs; packing is right; bad options exit 2 at once."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cudnn_train import demo

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "4", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--batch", "4", "--device", "cpu",
        "--eval-windows", "16", "--sample-bytes", "24"]


def test_tiny_run_learns_and_writes_png_and_json(tmp_path, capsys):
    out = tmp_path / "out"
    assert demo.main([*TINY, "--steps", "12", "--lr", "1e-2", "--seed", "3", "--out", str(out)]) == 0
    log = json.loads((out / "log.json").read_text())
    png = (out / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    losses = log["train_loss_bits_per_byte"]
    assert len(losses) == 12 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5  # the training loss falls
    assert log["heldout_bits_per_byte_after"] < log["heldout_bits_per_byte_before"]
    assert log["layer_kinds"] == ["gdn", "gdn", "gdn", "attn"]
    # every layer's op ran and says which backend served it
    for op in ("chunk_gated_delta_rule", "swiglu_mlp", "swiglu_mlp_bwd", "rms_norm_gated", "rms_norm_gated_bwd"):
        assert op in log["last_path"], op
    printed = capsys.readouterr().out
    assert "held-out bits/byte" in printed and "swiglu_mlp" in printed and "greedy sample" in printed
    assert isinstance(log["sample"], str) and log["sample"].startswith(demo.PROMPT.decode())


def test_packed_batch_layout():
    corpus = demo.Corpus(min_len=65)
    gen = torch.Generator().manual_seed(0)
    b = demo.train_batch(corpus.splits["train"], rows=6, row_len=64, gen=gen, device=torch.device("cpu"))
    cu = b.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == 6 * 64 and all(x < y for x, y in zip(cu, cu[1:]))
    assert set(range(0, 6 * 64 + 1, 64)) <= set(cu)  # no sequence crosses a row
    assert b.n_seqs == len(cu) - 1 and b.seg.shape == (6, 64)
    for s, (lo, hi) in enumerate(zip(cu, cu[1:])):
        assert torch.equal(b.pos[lo:hi], torch.arange(hi - lo))
        assert bool((b.seg.flatten()[lo:hi] == s).all())
        # each target is the next byte of the same window
        assert torch.equal(b.ids[0, lo + 1 : hi], b.targets[0, lo : hi - 1])


def test_train_and_heldout_split_by_file():
    a, b = demo.Corpus(min_len=33), demo.Corpus(min_len=33)
    for name in ("train", "heldout"):
        assert torch.equal(a.splits[name].data, b.splits[name].data)
    assert a.splits["heldout"].n_files > 0 and a.splits["train"].n_files > 10 * a.splits["heldout"].n_files


def test_packed_forward_equals_each_sequence_alone():
    torch.manual_seed(0)
    model = demo.HybridLM(layers=4, hidden=32, heads=2).eval()
    gen = torch.Generator().manual_seed(1)
    corpus = demo.Corpus(min_len=49)
    b = demo.train_batch(corpus.splits["train"], rows=3, row_len=48, gen=gen, device=torch.device("cpu"))
    with torch.no_grad():
        packed = model(b.ids, b.cu_seqlens, b.pos, b.seg)
        cu = b.cu_seqlens.tolist()
        alone = torch.cat([model(b.ids[:, lo:hi]) for lo, hi in zip(cu, cu[1:])], dim=1)
    assert b.n_seqs > 3  # some rows were split: real varlen
    assert torch.allclose(packed, alone, atol=1e-4, rtol=1e-4)


def test_lr_schedule_warms_up_then_decays():
    lrs = [demo.lr_at(s, 100, 1.0) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(lrs[9:], lrs[10:])) and lrs[-1] >= 0.1 and lrs[-1] < 0.11


BAD = [
    (["--bogus"], "unrecognized arguments"),
    (["--hidden", "100", "--heads", "3"], "does not divide into --heads 3"),
    (["--precision", "fp8"], "--precision fp8: only bf16"),
    (["--precision", "int4"], "--precision int4: only bf16"),
    (["--steps", "0"], "--steps 0"),
    (["--preset", "huge"], "--preset"),
    (["--device", "tpu"], "--device"),
    (["--hidden", "1024", "--heads", "2"], "at most 256"),
    (["--seq-len", "abc"], "--seq-len"),
    (["--eval-windows", "0"], "--eval-windows 0"),
]


@pytest.mark.parametrize("argv, match", BAD)
def test_bad_options_exit_2_with_one_line(tmp_path, capsys, argv, match):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        demo.main([*argv, "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert not out.exists()  # nothing was done


def test_missing_cuda_is_a_bad_option(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present here: --device cuda is a valid option on this machine")
    with pytest.raises(SystemExit) as e:
        demo.main(["--device", "cuda", "--out", str(tmp_path / "never")])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == "cudnn_train.demo: error: --device cuda: no CUDA GPU is present"
    with pytest.raises(SystemExit) as e:
        demo.main(["--preset", "gpu", "--out", str(tmp_path / "never")])
    assert e.value.code == 2


def test_command_line_bad_option_exits_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "cudnn_train.demo", "--layers", "2", "--no-such-option", "--out", str(tmp_path / "x")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["cudnn_train.demo: error: unrecognized arguments: --no-such-option"]
    assert r.stdout == "" and not (tmp_path / "x").exists()


@pytest.mark.gpu
def test_tiny_run_on_cuda_bf16(tmp_path):
    out = tmp_path / "out"
    argv = ["--layers", "4", "--hidden", "128", "--heads", "1", "--seq-len", "64", "--batch", "4", "--device", "cuda",
            "--eval-windows", "8", "--sample-bytes", "16", "--steps", "12", "--lr", "1e-2", "--out", str(out)]
    assert demo.main(argv) == 0
    log = json.loads((out / "log.json").read_text())
    losses = log["train_loss_bits_per_byte"]
    assert log["compute"] == "bf16 autocast" and all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    assert (out / "loss_curve.png").stat().st_size > 5000
    for op in ("chunk_gated_delta_rule", "swiglu_mlp", "swiglu_mlp_bwd", "rms_norm_gated"):
        assert op in log["last_path"], op

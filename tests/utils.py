"""Helpers shared by the tests."""

import pytest
import torch


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64; NaN anywhere gives inf."""
    a64, b64 = a.detach().double(), b.detach().double()
    if not torch.isfinite(a64).all():
        return float("inf")
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den > 0 else num


def fla_compat_ok(ours: float, peer: float, slack: float = 3.0, floor: float = 3e-3) -> bool:
    """The FLA-compat rule: relL2(ours, ref) <= slack * max(relL2(peer, ref), floor)."""
    return ours <= slack * max(peer, floor)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so that any element a kernel forgets to write shows up."""
    return t.fill_(float("nan"))


def assert_env_override(monkeypatch, name: str, pick, good: str, want, bads) -> None:
    """``name=good`` makes ``pick()`` return ``want``; each value of ``bads`` is a ValueError naming ``name``."""
    monkeypatch.setenv(name, good)
    assert pick() == want, f"{name}={good}"
    for bad in bads:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            pick()


# per-token log decay of each of four value heads in the GDN segment-split cases (the SM90 chain's and sweep's
# CUDNN_TRAIN_GDN_CHAIN_SEG / _SWEEP_SEG, and their plan on the CPU): head 0 never decays by e^-20 over a sequence of
# a few thousand tokens (every segment walks from the sequence's start or end: the unsplit kernel's bits), head 1
# needs about 8 chunks of warm-up (-2.56 a chunk), heads 2 and 3 one
GDN_SEG_RATES = (1e-4, 0.04, 0.3, 0.5)

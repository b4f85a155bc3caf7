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

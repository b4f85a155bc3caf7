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


def cu_seqlens(lengths, device="cpu", dtype=torch.int32) -> torch.Tensor:
    """FLA's ``cu_seqlens`` for these sequence lengths: ``[0, l0, l0 + l1, ...]`` (``len(lengths) + 1`` entries)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=dtype, device=device)


# per-token log decay of the first three of four value heads in the GDN segment-split cases (the SM90 chain's, sweep's
# and specialized warpgroups' CUDNN_TRAIN_GDN_CHAIN_SEG / _SWEEP_SEG / _FWD_WS_SEG, and their plan on the CPU): head 0
# never decays by e^-20 over a sequence of a few thousand tokens (every segment walks from the sequence's start or end:
# the unsplit kernel's bits), head 1 needs about 8 chunks of warm-up (-2.56 to -2.82 a chunk), head 2 one or two
# (-19.2 to -21.1); head 3 is head 0's rate with spikes (gdn_seg_gates)
GDN_SEG_RATES = (1e-4, 0.04, 0.3)
GDN_SEG_SPIKE = (1 / 96, -30.0)  # head 3: a token's chance of a spike, and the spike's log decay


def gdn_seg_gates(B: int, T: int, device, dtype=torch.float32, generator=None) -> torch.Tensor:
    """The segment cases' per-token log decays ``[B, T, 4]``: heads 0-2 at GDN_SEG_RATES (+0-10% at random), head 3
    at head 0's rate plus a -30 spike at about one token in 96, at random places (about half the chunks hold one).
    Head 3's warm-up therefore ends at the nearest chunk with a spike, one to several chunks back: a decay search
    that sums one chunk too many or too few, or walks the wrong way, starts from zero where the state has not
    decayed and the rows before the spike differ by O(1), not by e^-20 (near-uniform rates would hide that)."""
    rates = torch.tensor(GDN_SEG_RATES + GDN_SEG_RATES[:1], dtype=dtype)
    g = -rates * (1 + 0.1 * torch.rand(B, T, 4, generator=generator, dtype=dtype))
    chance, spike = GDN_SEG_SPIKE
    g[..., 3] += spike * (torch.rand(B, T, generator=generator, dtype=dtype) < chance).to(dtype)
    return g.to(device)


# the segment cases' varlen sequence lengths: empty, one-token, long, a partial single chunk, 2 and 3 chunks (fewer
# than the 4 segments: the segments that own a chunk interleave with empty ones, and dh0's owner is not the first or
# the last), a long one ending mid-chunk, a short last one
SEG_VARLEN = (0, 1, 1300, 63, 128, 700, 150, 5)

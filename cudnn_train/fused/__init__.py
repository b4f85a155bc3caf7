"""Functional ops: each op family is one module holding its reference, autograd and dispatch."""

from .rms_norm_gated import rms_norm_gated, rms_norm_gated_ref

__all__ = ["rms_norm_gated", "rms_norm_gated_ref"]

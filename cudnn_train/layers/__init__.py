"""nn.Modules built on the fused ops."""

from .norm import RMSNormGated

__all__ = ["RMSNormGated"]

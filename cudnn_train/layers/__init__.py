"""nn.Modules built on the fused ops."""

from .csa import CSACompressor
from .dsa import DSAIndexer, attach_indexer_loss
from .gated_deltanet import GatedDeltaNet, ShortConvolution
from .gnn import SAGEAggregation
from .kda import KimiDeltaAttention
from .mlp import SwiGLUMLP
from .norm import RMSNormGated

__all__ = [
    "CSACompressor",
    "DSAIndexer",
    "GatedDeltaNet",
    "KimiDeltaAttention",
    "RMSNormGated",
    "SAGEAggregation",
    "ShortConvolution",
    "SwiGLUMLP",
    "attach_indexer_loss",
]

"""GNN aggregation: ``from cudnn_train.gnn import CscGraph, agg_simple, SAGEAggregation``.

Re-exports :mod:`cudnn_train.fused.gnn` (the op and its graph type) and
:mod:`cudnn_train.layers.gnn` (the GraphSAGE layer built on it).
"""

from .fused.gnn import AGGREGATIONS, CscGraph, CsrView, agg_simple, agg_simple_ref
from .layers.gnn import SAGEAggregation

__all__ = ["AGGREGATIONS", "CscGraph", "CsrView", "agg_simple", "agg_simple_ref", "SAGEAggregation"]

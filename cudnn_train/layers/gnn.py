"""GraphSAGE layer on :func:`cudnn_train.fused.gnn.agg_simple`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..fused.gnn import AGGREGATIONS, CscGraph, agg_simple

__all__ = ["SAGEAggregation"]


class SAGEAggregation(nn.Module):
    """GraphSAGE: ``out[v] = lin_l(reduce_{u -> v} x_src[u]) + lin_r(x_dst[v])``.

    The same computation, constructor arguments, parameters and state_dict keys as PyG's
    ``SAGEConv`` (``lin_l.weight``, ``lin_l.bias``, ``lin_r.weight``; without ``project``
    or multi-aggregation), so weights copy over with ``load_state_dict``. The graph is a
    :class:`~cudnn_train.fused.gnn.CscGraph` instead of an ``edge_index``: build it once
    with ``CscGraph.from_edge_index(edge_index, num_nodes)``.

    With ``root_weight`` the neighborhood reduction and the root features travel through
    one ``agg_simple`` call (``concat_features=x_dst``) and are split before the two
    linear maps.

    Args:
        in_channels: source feature size, or ``(source, destination)`` sizes.
        out_channels: output feature size.
        aggr: "mean" (default), "sum", "max" or "min" ("add" is accepted as "sum").
        normalize: L2-normalize each output row.
        root_weight: add ``lin_r(x_dst)``.
        bias: bias of ``lin_l``.
    """

    def __init__(
        self,
        in_channels: int | tuple[int, int],
        out_channels: int,
        aggr: str = "mean",
        normalize: bool = False,
        root_weight: bool = True,
        bias: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        aggr = "sum" if aggr == "add" else aggr
        if aggr not in AGGREGATIONS:
            raise ValueError(f"aggr: expected one of {AGGREGATIONS} (or 'add'), got {aggr!r}")
        pair = (in_channels, in_channels) if isinstance(in_channels, int) else tuple(in_channels)
        if len(pair) != 2 or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in pair):
            raise ValueError(f"in_channels: expected a positive int or a pair of them, got {in_channels!r}")
        if isinstance(out_channels, bool) or not isinstance(out_channels, int) or out_channels < 1:
            raise ValueError(f"out_channels: expected a positive int, got {out_channels!r}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.aggr, self.normalize, self.root_weight = aggr, normalize, root_weight
        factory = {"device": device, "dtype": dtype}
        self.lin_l = nn.Linear(pair[0], out_channels, bias=bias, **factory)
        if root_weight:
            self.lin_r = nn.Linear(pair[1], out_channels, bias=False, **factory)
        else:
            self.register_module("lin_r", None)

    def reset_parameters(self) -> None:
        self.lin_l.reset_parameters()
        if self.lin_r is not None:
            self.lin_r.reset_parameters()

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr={self.aggr}"

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], graph: CscGraph) -> torch.Tensor:
        """``x``: ``[num_src, F]`` (the destinations are its first ``num_dst`` rows) or ``(x_src, x_dst)``."""
        if not isinstance(graph, CscGraph):
            raise ValueError(f"graph: expected a CscGraph, got {type(graph).__name__}")
        if isinstance(x, torch.Tensor):
            x_src, x_dst = x, x[: graph.num_dst_nodes]
        else:
            x_src, x_dst = x
        fn = x_src.shape[-1]
        if self.root_weight:
            h = agg_simple(graph, node_features=x_src, concat_features=x_dst, aggr=self.aggr)
            out = self.lin_l(h[:, :fn]) + self.lin_r(h[:, fn:])
        else:
            out = self.lin_l(agg_simple(graph, node_features=x_src, aggr=self.aggr))
        if self.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out

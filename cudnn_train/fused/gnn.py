"""GNN neighborhood aggregation over a CSC graph (cuDNN's ``agg_simple``).

Graph: :class:`CscGraph` in destination-major compressed sparse column order.
``offsets [num_dst + 1]`` delimits, for destination ``v``, its incoming CSC edges
``e in [offsets[v], offsets[v+1])``; ``indices[e]`` is the source node of edge ``e``.
``map_csc_to_coo [E]`` (optional) maps each CSC edge position to its row of
``edge_features``: edge ``e``'s features are ``edge_features[map_csc_to_coo[e]]`` (without
a map, ``edge_features[e]``: CSC order). :meth:`CscGraph.from_edge_index` sorts a COO
``edge_index`` by destination (stably) and keeps the sort permutation as the map, so
edge features stay in ``edge_index`` order.

Aggregation, per destination ``v`` and feature column::

    y[v] = concat( reduce_{e in in(v)} node_features[indices[e]],
                   reduce_{e in in(v)} edge_features[map(e)],
                   concat_features[v] )

with ``reduce`` one of sum, mean, max, min; a destination with no incoming edge gets 0 in
the reduced columns (PyG's convention); omitted feature groups are left out of the
concatenation. Gradients: sum sends ``dy[v]`` to every incoming edge, mean ``dy[v] /
deg(v)``, max and min send it to one winner per (destination, column): the lowest CSC
edge position attaining the extremum (ties between duplicate edges or equal values go
to the first). Node-feature gradients are then summed per source node. NaN inputs make
the reduced value NaN and get no gradient under max/min.

Backends, in order: ``cutedsl`` (kernels to come) then ``torch`` (below). Forward and
backward are separate dispatch points (``agg_simple`` and ``agg_simple_bwd``). Math is
float32 for float32/float16/bfloat16 features (float64 for float64); outputs and
gradients have the features' dtype (all feature tensors share one dtype).

Determinism: the forward reduces each destination's contiguous CSC segment in order
(``torch.segment_reduce``), and the max/min winner is an integer minimum, so the forward
is bitwise reproducible. The node-feature backward is a scatter over source nodes: by
default ``index_add_`` (float atomics on a GPU); under ``deterministic(True)`` it gathers
the gradients in source-major order through the graph's cached reverse (CSR) view
(:meth:`CscGraph.reverse`) and reduces each source's segment in order: one stable sort of
``indices`` once per graph, then one extra gather of ``E x F`` values per backward.
Edge-feature gradients are one write per edge (``map_csc_to_coo`` must be a
permutation) and concat-feature gradients a copy, deterministic in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import backend
from .._validate import FLOAT_DTYPES, check_same_device, check_tensor, compute_dtype

__all__ = ["CscGraph", "CsrView", "agg_simple", "agg_simple_ref", "AGGREGATIONS"]

AGGREGATIONS = ("sum", "mean", "max", "min")
INDEX_DTYPES = (torch.int32, torch.int64)

fwd_op = backend.Op("agg_simple", ["cutedsl", "torch"])
bwd_op = backend.Op("agg_simple_bwd", ["cutedsl", "torch"])


# ---------------------------------------------------------------- graph


@dataclass(frozen=True, eq=False)
class CsrView:
    """Source-major view of a :class:`CscGraph`, for the backward.

    ``offsets [num_src + 1]``: source ``u``'s outgoing edges are
    ``csc_edges[offsets[u]:offsets[u+1]]``, CSC edge positions in increasing order.
    """

    offsets: torch.Tensor
    csc_edges: torch.Tensor


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, eq=False)
class CscGraph:
    """A directed graph in CSC (destination-major) order, validated at construction.

    Args:
        offsets: int32/int64 ``[num_dst + 1]``, starts at 0, non-decreasing, ends at E.
        indices: ``[E]`` source node of each CSC edge, in ``[0, num_src_nodes)``; same
            dtype and device as ``offsets``.
        num_src_nodes: number of source nodes (rows of ``node_features``).
        map_csc_to_coo: optional ``[E]`` integer permutation of ``range(E)``: CSC edge
            ``e`` reads ``edge_features[map_csc_to_coo[e]]``.

    Construction reads the index tensors once to check their values (a host sync for
    GPU tensors): build graphs outside ``torch.compile`` regions and pass them in.
    """

    offsets: torch.Tensor
    indices: torch.Tensor
    num_src_nodes: int
    map_csc_to_coo: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_tensor("offsets", self.offsets, dtypes=INDEX_DTYPES, ndim=1)
        check_tensor("indices", self.indices, dtypes=INDEX_DTYPES, ndim=1)
        if self.indices.dtype != self.offsets.dtype:
            raise ValueError(f"indices: expected offsets' dtype {self.offsets.dtype}, got {self.indices.dtype}")
        if not _is_int(self.num_src_nodes) or self.num_src_nodes < 0:
            raise ValueError(f"num_src_nodes: expected a non-negative int, got {self.num_src_nodes!r}")
        if self.offsets.numel() == 0:
            raise ValueError("offsets: expected num_dst + 1 >= 1 entries, got an empty tensor")
        num_edges = self.indices.numel()
        if self.map_csc_to_coo is not None:
            check_tensor("map_csc_to_coo", self.map_csc_to_coo, dtypes=INDEX_DTYPES, ndim=1)
            if self.map_csc_to_coo.numel() != num_edges:
                raise ValueError(f"map_csc_to_coo: expected {num_edges} entries (one per edge), got {self.map_csc_to_coo.numel()}")
        check_same_device(offsets=self.offsets, indices=self.indices, map_csc_to_coo=self.map_csc_to_coo)
        first, last = self.offsets[0], self.offsets[-1]
        bad_order = bool((self.offsets[1:] < self.offsets[:-1]).any()) if self.offsets.numel() > 1 else False
        if int(first) != 0:
            raise ValueError(f"offsets: must start at 0, got {int(first)}")
        if bad_order:
            raise ValueError("offsets: must be non-decreasing")
        if int(last) != num_edges:
            raise ValueError(f"offsets: must end at the number of edges len(indices)={num_edges}, got {int(last)}")
        if num_edges:
            lo, hi = int(self.indices.min()), int(self.indices.max())
            if lo < 0 or hi >= self.num_src_nodes:
                raise ValueError(f"indices: source ids must lie in [0, num_src_nodes={self.num_src_nodes}), got [{lo}, {hi}]")
        if self.map_csc_to_coo is not None and num_edges:
            srt = torch.sort(self.map_csc_to_coo.long()).values
            if not torch.equal(srt, torch.arange(num_edges, device=srt.device)):
                raise ValueError("map_csc_to_coo: must be a permutation of range(num_edges)")

    @classmethod
    def from_edge_index(cls, edge_index: torch.Tensor, num_nodes: int | tuple[int, int]) -> "CscGraph":
        """Build from a COO ``edge_index [2, E]`` (row 0 sources, row 1 destinations, PyG's layout).

        ``num_nodes``: an int (same node set) or ``(num_src, num_dst)``. Edges are sorted by
        destination, stably, so each destination keeps its edges in ``edge_index`` order;
        ``map_csc_to_coo`` is that permutation, so ``edge_features`` stay in ``edge_index``
        order. Index dtype: edge_index's (int32 or int64).
        """
        check_tensor("edge_index", edge_index, dtypes=INDEX_DTYPES, ndim=2)
        if edge_index.shape[0] != 2:
            raise ValueError(f"edge_index: expected shape (2, E), got {tuple(edge_index.shape)}")
        if _is_int(num_nodes):
            num_src = num_dst = num_nodes
        elif isinstance(num_nodes, tuple) and len(num_nodes) == 2 and all(map(_is_int, num_nodes)):
            num_src, num_dst = num_nodes
        else:
            raise ValueError(f"num_nodes: expected an int or a (num_src, num_dst) pair of ints, got {num_nodes!r}")
        if num_src < 0 or num_dst < 0:
            raise ValueError(f"num_nodes: expected non-negative counts, got {num_nodes!r}")
        src, dst = edge_index[0], edge_index[1]
        if dst.numel():
            lo, hi = int(dst.min()), int(dst.max())
            if lo < 0 or hi >= num_dst:
                raise ValueError(f"edge_index: destination ids must lie in [0, {num_dst}), got [{lo}, {hi}]")
            lo, hi = int(src.min()), int(src.max())
            if lo < 0 or hi >= num_src:
                raise ValueError(f"edge_index: source ids must lie in [0, {num_src}), got [{lo}, {hi}]")
        perm = torch.argsort(dst, stable=True)
        deg = torch.bincount(dst.long(), minlength=num_dst)
        offsets = torch.cat([deg.new_zeros(1), deg.cumsum(0)]).to(edge_index.dtype)
        return cls(offsets, src[perm].contiguous(), num_src, perm.to(edge_index.dtype))

    @property
    def num_dst_nodes(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_edges(self) -> int:
        return self.indices.numel()

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    def reverse(self) -> CsrView:
        """The source-major (CSR) view, computed on first use and cached on the graph."""
        view = self._cache.get("reverse")
        if view is None:
            idx = self.indices.long()
            order = torch.argsort(idx, stable=True)
            counts = torch.bincount(idx, minlength=self.num_src_nodes)
            offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            view = CsrView(offsets, order)
            self._cache["reverse"] = view
        return view


# ---------------------------------------------------------------- reference


def agg_simple_ref(
    graph: CscGraph,
    *,
    node_features: torch.Tensor | None = None,
    edge_features: torch.Tensor | None = None,
    concat_features: torch.Tensor | None = None,
    aggr: str = "sum",
) -> torch.Tensor:
    """The readable reference (forward only): one destination at a time, float32 math."""
    _check_aggr(aggr)
    parts = []
    off = graph.offsets.tolist()
    for feats, rows_of in (
        (node_features, lambda e0, e1: graph.indices[e0:e1]),
        (edge_features, lambda e0, e1: torch.arange(e0, e1) if graph.map_csc_to_coo is None else graph.map_csc_to_coo[e0:e1]),
    ):
        if feats is None:
            continue
        ct = compute_dtype(feats)
        out = torch.zeros(graph.num_dst_nodes, feats.shape[1], dtype=ct, device=feats.device)
        for v in range(graph.num_dst_nodes):
            e0, e1 = off[v], off[v + 1]
            if e1 == e0:
                continue
            msgs = feats[rows_of(e0, e1).to(feats.device).long()].to(ct)
            if aggr == "sum":
                out[v] = msgs.sum(0)
            elif aggr == "mean":
                out[v] = msgs.mean(0)
            elif aggr == "max":
                out[v] = msgs.amax(0)
            else:
                out[v] = msgs.amin(0)
        parts.append(out.to(feats.dtype))
    if concat_features is not None:
        parts.append(concat_features)
    return torch.cat(parts, dim=1)


# ---------------------------------------------------------------- torch backend


def _edge_dst(offsets: torch.Tensor, num_edges: int) -> torch.Tensor:
    """Destination of every CSC edge, int64 ``[E]`` (no host sync)."""
    deg = (offsets[1:] - offsets[:-1]).long()
    return torch.repeat_interleave(torch.arange(deg.numel(), device=offsets.device), deg, output_size=num_edges)


def _reduce_segments(msg: torch.Tensor, offsets: torch.Tensor, deg: torch.Tensor, aggr: str) -> torch.Tensor:
    """Reduce each destination's contiguous rows of ``msg [E, F]``; empty segments give 0."""
    num_dst = offsets.numel() - 1
    if msg.shape[1] == 0 or num_dst == 0:
        return msg.new_zeros(num_dst, msg.shape[1])
    red = "sum" if aggr == "mean" else aggr
    out = torch.segment_reduce(msg, red, offsets=offsets.long(), axis=0)
    if aggr == "mean":
        out = out / deg.clamp_min(1).to(out.dtype)[:, None]
    elif aggr in ("max", "min"):
        out = torch.where((deg > 0)[:, None], out, 0.0)
    return out


def _winners(msg: torch.Tensor, out: torch.Tensor, dst: torch.Tensor, num_dst: int, dtype: torch.dtype) -> torch.Tensor:
    """Lowest CSC edge attaining ``out`` per (destination, column); -1 where none (an integer minimum)."""
    e, f = msg.shape
    ids = torch.arange(e, device=msg.device, dtype=dtype)[:, None].expand(e, f)
    cand = torch.where(msg == out[dst], ids, e)
    pos = torch.full((num_dst, f), e, dtype=dtype, device=msg.device)
    pos = pos.scatter_reduce(0, dst[:, None].expand(e, f), cand, "amin", include_self=True)
    return torch.where(pos == e, -1, pos)


def _torch_fwd(offsets, indices, map_csc_to_coo, node_features, edge_features, concat_features, num_src_nodes, aggr,
               need_positions):
    """Output ``[num_dst, Fn+Fe+Fc]`` and, for max/min when a backward will need them, the winners
    ``[num_dst, Fn+Fe]`` (CSC edge positions, offsets' dtype; -1 for no in-edge); else an empty tensor."""
    feats = [t for t in (node_features, edge_features, concat_features) if t is not None]
    dtype = feats[0].dtype
    ct = compute_dtype(feats[0])
    num_dst, num_edges = offsets.numel() - 1, indices.numel()
    deg = (offsets[1:] - offsets[:-1]).long()
    dst = _edge_dst(offsets, num_edges) if need_positions and aggr in ("max", "min") else None
    parts, wins = [], []
    for feats_, rows in ((node_features, indices), (edge_features, map_csc_to_coo)):
        if feats_ is None:
            continue
        msg = (feats_ if rows is None else feats_[rows.long()]).to(ct)  # [E, F] in CSC order
        red = _reduce_segments(msg, offsets, deg, aggr)
        if dst is not None:
            wins.append(_winners(msg, red, dst, num_dst, offsets.dtype))
        parts.append(red.to(dtype))
    if concat_features is not None:
        parts.append(concat_features)
    out = torch.cat(parts, dim=1)
    positions = torch.cat(wins, dim=1) if wins else offsets.new_empty(0)
    return out, positions


def _torch_bwd(dout, offsets, indices, map_csc_to_coo, rev_offsets, rev_edges, positions,
               num_src_nodes, fn, fe, fc, aggr, need_node, need_edge, need_concat):
    """Gradients of ``_torch_fwd``: (dnode [num_src, fn], dedge [E, fe], dconcat [num_dst, fc]).

    A gradient that is not needed comes back as an empty placeholder (custom ops return no None).
    """
    ct = compute_dtype(dout)
    num_dst, num_edges = offsets.numel() - 1, indices.numel()
    deg = (offsets[1:] - offsets[:-1]).long()
    dst = _edge_dst(offsets, num_edges)
    g = dout.to(ct)
    if aggr == "mean":
        g = g / deg.clamp_min(1).to(ct)[:, None]

    def edge_grads(c0: int, c1: int) -> torch.Tensor:
        """Per-edge gradient of the reduced columns [c0, c1), in CSC order: [E, c1 - c0]."""
        ge = g[dst, c0:c1]
        if aggr in ("max", "min"):
            ids = torch.arange(num_edges, device=dout.device, dtype=positions.dtype)[:, None]
            ge = torch.where(positions[dst, c0:c1] == ids, ge, 0.0)
        return ge

    dnode = dout.new_zeros(num_src_nodes, fn) if need_node else dout.new_empty(0)
    if need_node and fn:
        ge = edge_grads(0, fn)
        if rev_offsets is not None:  # deterministic: reduce each source's segment in order
            if num_src_nodes:
                dn = torch.segment_reduce(ge[rev_edges], "sum", offsets=rev_offsets, axis=0)
                dnode = dn.to(dout.dtype)
        else:
            dnode = torch.zeros(num_src_nodes, fn, dtype=ct, device=dout.device)
            dnode = dnode.index_add_(0, indices.long(), ge).to(dout.dtype)
    dedge = dout.new_zeros(num_edges, fe) if need_edge else dout.new_empty(0)
    if need_edge and fe:
        ge = edge_grads(fn, fn + fe).to(dout.dtype)
        if map_csc_to_coo is None:
            dedge = ge
        else:  # a permutation: one write per row
            dedge = torch.empty_like(ge).index_copy_(0, map_csc_to_coo.long(), ge)
    dconcat = dout[:, fn + fe :].clone() if need_concat else dout.new_empty(0)
    return dnode, dedge, dconcat


@fwd_op.register("torch")
def _fwd_torch(offsets, indices, map_csc_to_coo, node_features, edge_features, concat_features, num_src_nodes, aggr,
               need_positions):
    return _torch_fwd(offsets, indices, map_csc_to_coo, node_features, edge_features, concat_features, num_src_nodes,
                      aggr, need_positions)


@bwd_op.register("torch")
def _bwd_torch(dout, offsets, indices, map_csc_to_coo, rev_offsets, rev_edges, positions, num_src_nodes, fn, fe, fc, aggr,
               need_node, need_edge, need_concat):
    return _torch_bwd(dout, offsets, indices, map_csc_to_coo, rev_offsets, rev_edges, positions, num_src_nodes, fn, fe, fc,
                      aggr, need_node, need_edge, need_concat)


# ---------------------------------------------------------------- custom ops (torch.compile)


@torch.library.custom_op("cudnn_train::agg_simple_fwd", mutates_args=())
def _fwd_custom(
    offsets: torch.Tensor,
    indices: torch.Tensor,
    map_csc_to_coo: torch.Tensor | None,
    node_features: torch.Tensor | None,
    edge_features: torch.Tensor | None,
    concat_features: torch.Tensor | None,
    num_src_nodes: int,
    aggr: str,
    need_positions: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return fwd_op(offsets, indices, map_csc_to_coo, node_features, edge_features, concat_features, num_src_nodes, aggr,
                  need_positions)


@_fwd_custom.register_fake
def _(offsets, indices, map_csc_to_coo, node_features, edge_features, concat_features, num_src_nodes, aggr,
      need_positions):
    feats = [t for t in (node_features, edge_features, concat_features) if t is not None]
    num_dst = offsets.shape[0] - 1
    reduced = sum(t.shape[1] for t in (node_features, edge_features) if t is not None)
    width = reduced + (0 if concat_features is None else concat_features.shape[1])
    out = feats[0].new_empty(num_dst, width)
    if need_positions and aggr in ("max", "min"):
        positions = offsets.new_empty(num_dst, reduced)
    else:
        positions = offsets.new_empty(0)
    return out, positions


@torch.library.custom_op("cudnn_train::agg_simple_bwd", mutates_args=())
def _bwd_custom(
    dout: torch.Tensor,
    offsets: torch.Tensor,
    indices: torch.Tensor,
    map_csc_to_coo: torch.Tensor | None,
    rev_offsets: torch.Tensor | None,
    rev_edges: torch.Tensor | None,
    positions: torch.Tensor,
    num_src_nodes: int,
    fn: int,
    fe: int,
    fc: int,
    aggr: str,
    need_node: bool,
    need_edge: bool,
    need_concat: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return bwd_op(dout, offsets, indices, map_csc_to_coo, rev_offsets, rev_edges, positions, num_src_nodes, fn, fe, fc, aggr,
                  need_node, need_edge, need_concat)


@_bwd_custom.register_fake
def _(dout, offsets, indices, map_csc_to_coo, rev_offsets, rev_edges, positions, num_src_nodes, fn, fe, fc, aggr,
      need_node, need_edge, need_concat):
    return (
        dout.new_empty(num_src_nodes, fn) if need_node else dout.new_empty(0),
        dout.new_empty(indices.shape[0], fe) if need_edge else dout.new_empty(0),
        dout.new_empty(offsets.shape[0] - 1, fc) if need_concat else dout.new_empty(0),
    )


# ---------------------------------------------------------------- autograd


class _AggSimpleFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, offsets, indices, map_csc_to_coo, rev_offsets, rev_edges,
                node_features, edge_features, concat_features, num_src_nodes, aggr):
        need_positions = any(ctx.needs_input_grad[5:7])  # a backward through node or edge features
        args = (offsets, indices, map_csc_to_coo, node_features, edge_features, concat_features, num_src_nodes, aggr,
                need_positions)
        if torch.compiler.is_compiling():
            out, positions = _fwd_custom(*args)
        else:  # eager: skip the custom-op dispatcher
            out, positions = fwd_op(*args)
        ctx.save_for_backward(offsets, indices, map_csc_to_coo, rev_offsets, rev_edges, positions)
        ctx.num_src_nodes, ctx.aggr = num_src_nodes, aggr
        ctx.dims = tuple(0 if t is None else t.shape[1] for t in (node_features, edge_features, concat_features))
        ctx.mark_non_differentiable(positions)
        return out, positions

    @staticmethod
    def backward(ctx, dout, _dpositions):
        offsets, indices, map_csc_to_coo, rev_offsets, rev_edges, positions = ctx.saved_tensors
        need = tuple(bool(n) for n in ctx.needs_input_grad[5:8])
        args = (dout.contiguous(), offsets, indices, map_csc_to_coo, rev_offsets, rev_edges, positions,
                ctx.num_src_nodes, *ctx.dims, ctx.aggr, *need)
        if torch.compiler.is_compiling():
            dnode, dedge, dconcat = _bwd_custom(*args)
        else:
            dnode, dedge, dconcat = bwd_op(*args)
        grads = [g if n else None for g, n in zip((dnode, dedge, dconcat), need)]
        return (None, None, None, None, None, *grads, None, None)


# ---------------------------------------------------------------- public function


def _check_aggr(aggr: object) -> None:
    if aggr not in AGGREGATIONS:
        raise ValueError(f"aggr: expected one of {AGGREGATIONS}, got {aggr!r}")


def agg_simple(
    graph: CscGraph,
    *,
    node_features: torch.Tensor | None = None,
    edge_features: torch.Tensor | None = None,
    concat_features: torch.Tensor | None = None,
    aggr: str = "sum",
) -> torch.Tensor:
    """Aggregate incoming source-node and edge features per destination, then append ``concat_features``.

    Args:
        graph: a :class:`CscGraph` (``num_dst`` destinations, ``E`` edges).
        node_features: ``[num_src_nodes, Fn]``, reduced over each destination's in-edges.
        edge_features: ``[E, Fe]``, row ``map_csc_to_coo[e]`` (or ``e``) for CSC edge ``e``.
        concat_features: ``[num_dst, Fc]``, appended unchanged.
        aggr: "sum", "mean", "max" or "min".

    At least one of node_features and edge_features is required; all features share one
    dtype (float32, float16, bfloat16 or float64) and the graph's device. Returns
    ``[num_dst, Fn + Fe + Fc]`` in that dtype.
    """
    if not isinstance(graph, CscGraph):
        raise ValueError(f"graph: expected a CscGraph, got {type(graph).__name__}")
    _check_aggr(aggr)
    if node_features is None and edge_features is None:
        raise ValueError("node_features: at least one of node_features and edge_features is required")
    num_dst, num_edges, num_src = graph.num_dst_nodes, graph.num_edges, graph.num_src_nodes
    dtype = None
    for name, t, rows in (
        ("node_features", node_features, num_src),
        ("edge_features", edge_features, num_edges),
        ("concat_features", concat_features, num_dst),
    ):
        if t is None:
            continue
        check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=2)
        if dtype is None:
            dtype, first = t.dtype, name
        elif t.dtype != dtype:
            raise ValueError(f"{name}: expected the dtype of {first} ({dtype}), got {t.dtype}")
        if t.shape[0] != rows:
            raise ValueError(f"{name}: expected {rows} rows, got {t.shape[0]}")
    check_same_device(
        offsets=graph.offsets, node_features=node_features, edge_features=edge_features, concat_features=concat_features
    )
    needs_node_grad = node_features is not None and node_features.requires_grad and torch.is_grad_enabled()
    rev_offsets = rev_edges = None
    if needs_node_grad and backend.is_deterministic():
        view = graph.reverse()
        rev_offsets, rev_edges = view.offsets, view.csc_edges
    out, _ = _AggSimpleFn.apply(
        graph.offsets, graph.indices, graph.map_csc_to_coo, rev_offsets, rev_edges,
        node_features, edge_features, concat_features, num_src, aggr,
    )
    return out

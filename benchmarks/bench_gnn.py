"""GNN aggregation: agg_simple's torch backend vs PyG's scatter, and SAGEAggregation vs PyG's SAGEConv, in one run.

    python -m benchmarks.bench_gnn [--json out.json] [--quick]

Graph: N = 100k nodes, E = 1M random edges (uniform sources and destinations),
F = 128 features, bf16 on a GPU (``--quick``: N = 2000, E = 20000, F = 32, on whatever
device is present; float32 on the CPU). The CSC graph is built once, outside the timing.
Bytes counted (the ANCHORS convention): ``E*F*elt + N_dst*F*elt + E*idx`` for the
forward (gather every edge's source row, write each destination row, read the edge
indices); forward+backward counts it twice (the backward scatters as many rows back).
"""

from __future__ import annotations

import torch

from benchmarks.common import bench, ceilings, device, parser, report
from cudnn_train import last_path, use_backend
from cudnn_train.gnn import CscGraph, SAGEAggregation, agg_simple


def main() -> None:
    args = parser(__doc__).parse_args()
    dev = device()
    ceil = ceilings(args.quick)
    n, e, f = (2000, 20000, 32) if args.quick else (100_000, 1_000_000, 128)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    try:
        from torch_geometric.nn import SAGEConv
        from torch_geometric.utils import scatter
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer is absent
        print(f"torch_geometric not importable ({exc}): timing the torch backend alone")
        SAGEConv = scatter = None

    edge_index = torch.randint(0, n, (2, e), device=dev)
    graph = CscGraph.from_edge_index(edge_index, n)
    x = torch.randn(n, f, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(n, f, device=dev, dtype=dtype)
    elt, idx = x.element_size(), graph.indices.element_size()
    fwd_bytes = e * f * elt + n * f * elt + e * idx
    rows = []

    def add_rows(case, impls):
        times = {}
        with use_backend("torch"):
            for name, (fw, fb) in impls.items():
                times[name] = (bench(fw, args.warmup, args.rep), bench(fb, args.warmup, args.rep))
        assert last_path("agg_simple").startswith("torch"), last_path("agg_simple")
        peers = [t for name, t in times.items() if name.startswith("PyG")]
        for name, (fwd, fb) in times.items():
            row = {"N": n, "E": e, "F": f, "case": case, "impl": name,
                   "fwd ms": fwd, "fwd GB/s": fwd_bytes / fwd / 1e6,
                   "fwd+bwd ms": fb, "fwd+bwd GB/s": 2 * fwd_bytes / fb / 1e6}
            if ceil:
                row["% copy (fwd+bwd)"] = 100 * 2 * fwd_bytes / fb / 1e6 / ceil["copy_gbs"]
            if peers:
                row["fwd speedup vs PyG"] = min(p[0] for p in peers) / fwd
                row["fwd+bwd speedup vs PyG"] = min(p[1] for p in peers) / fb
            rows.append(row)

    for aggr in ("sum", "mean", "max"):
        def ours(aggr=aggr):
            return agg_simple(graph, node_features=x, aggr=aggr)

        impls = {"torch backend": (ours, lambda ours=ours: torch.autograd.grad(ours(), x, dy))}
        if scatter is not None:
            def pyg(aggr=aggr):
                return scatter(x[edge_index[0]], edge_index[1], dim=0, dim_size=n, reduce=aggr)

            impls["PyG scatter"] = (pyg, lambda pyg=pyg: torch.autograd.grad(pyg(), x, dy))
        add_rows(f"agg {aggr}", impls)

    # the GraphSAGE layer: aggregation plus the two linear maps
    ours_layer = SAGEAggregation(f, f).to(dev, dtype)
    impls = {"torch backend": (lambda: ours_layer(x, graph), lambda: torch.autograd.grad(ours_layer(x, graph), x, dy))}
    if SAGEConv is not None:
        theirs = SAGEConv(f, f).to(dev, dtype)
        impls["PyG SAGEConv"] = (lambda: theirs(x, edge_index), lambda: torch.autograd.grad(theirs(x, edge_index), x, dy))
    add_rows("SAGE mean layer", impls)
    report(rows, args, ceil, f"agg_simple, {str(dtype).replace('torch.', '')} features, random graph")


if __name__ == "__main__":
    main()

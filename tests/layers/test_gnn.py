"""layers.SAGEAggregation vs PyG's SAGEConv with the same weights."""

import pytest
import torch

from cudnn_train.gnn import CscGraph, SAGEAggregation
from tests.utils import fla_compat_ok, rel_l2

pyg_nn = pytest.importorskip("torch_geometric.nn", reason="torch_geometric's SAGEConv is the oracle")


def _edges(num_src, num_dst, num_edges, device="cpu"):
    src = torch.randint(0, num_src, (num_edges,), device=device)
    dst = torch.randint(1, num_dst, (num_edges,), device=device)  # destination 0 has no in-edges
    ei = torch.stack([src, dst])
    return torch.cat([ei, ei[:, :2]], dim=1)  # duplicated edges


def _pair(in_channels, out_channels, dtype=torch.float64, **kw):
    theirs = pyg_nn.SAGEConv(in_channels, out_channels, **kw).to(dtype)
    ours = SAGEAggregation(in_channels, out_channels, **kw).to(dtype)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def _grads(out, leaves, dy):
    return torch.autograd.grad(out, leaves, dy)


@pytest.mark.parametrize("aggr", ["mean", "sum", "max", "min"])
@pytest.mark.parametrize("normalize, root_weight, bias", [(False, True, True), (True, True, False), (False, False, True)])
def test_matches_pyg_sageconv(aggr, normalize, root_weight, bias):
    n = 12
    ei = _edges(n, n, 40)
    g = CscGraph.from_edge_index(ei, n)
    ours, theirs = _pair(6, 5, aggr=aggr, normalize=normalize, root_weight=root_weight, bias=bias)
    x = torch.randn(n, 6, dtype=torch.float64, requires_grad=True)
    out = ours(x, g)
    ref = theirs(x, ei)
    assert rel_l2(out, ref) <= 1e-6
    dy = torch.randn_like(ref)
    leaves = (x, *ours.parameters())
    their_leaves = (x, *theirs.parameters())
    assert [p.shape for p in leaves] == [p.shape for p in their_leaves]
    for a, b in zip(_grads(out, leaves, dy), _grads(ref, their_leaves, dy)):
        assert rel_l2(a, b) <= 1e-6


@pytest.mark.parametrize("aggr", ["mean", "max"])
def test_bipartite_matches_pyg_sageconv(aggr):
    num_src, num_dst = 10, 7
    ei = _edges(num_src, num_dst, 30)
    g = CscGraph.from_edge_index(ei, (num_src, num_dst))
    ours, theirs = _pair((6, 4), 3, aggr=aggr)
    xs = torch.randn(num_src, 6, dtype=torch.float64, requires_grad=True)
    xd = torch.randn(num_dst, 4, dtype=torch.float64, requires_grad=True)
    out = ours((xs, xd), g)
    ref = theirs((xs, xd), ei, size=(num_src, num_dst))
    assert rel_l2(out, ref) <= 1e-6
    dy = torch.randn_like(ref)
    for a, b in zip(_grads(out, (xs, xd), dy), _grads(ref, (xs, xd), dy)):
        assert rel_l2(a, b) <= 1e-6


def test_single_tensor_uses_first_rows_as_destinations():
    ei = _edges(9, 5, 20)
    g = CscGraph.from_edge_index(ei, (9, 5))
    ours, theirs = _pair(4, 3)
    x = torch.randn(9, 4, dtype=torch.float64)
    ref = theirs((x, x[:5]), ei, size=(9, 5))
    assert rel_l2(ours(x, g), ref) <= 1e-6


def test_float32_training_step_reduces_the_loss():
    n = 30
    ei = _edges(n, n, 120)
    g = CscGraph.from_edge_index(ei, n)
    layer = SAGEAggregation(8, 4)
    x, target = torch.randn(n, 8), torch.randn(n, 4)
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(layer(x, g), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_state_dict_repr_and_bad_arguments():
    m = SAGEAggregation(6, 5)
    assert sorted(m.state_dict()) == ["lin_l.bias", "lin_l.weight", "lin_r.weight"]
    assert SAGEAggregation(6, 5, root_weight=False).lin_r is None
    assert SAGEAggregation(6, 5, aggr="add").aggr == "sum"
    assert "aggr=mean" in repr(m)
    with pytest.raises(ValueError, match="aggr"):
        SAGEAggregation(6, 5, aggr="lstm")
    with pytest.raises(ValueError, match="in_channels"):
        SAGEAggregation(0, 5)
    with pytest.raises(ValueError, match="out_channels"):
        SAGEAggregation(6, 0)
    with pytest.raises(ValueError, match="graph: expected a CscGraph"):
        m(torch.randn(3, 6), torch.tensor([[0, 1], [1, 2]]))


# ------------------------------------------------------------------ GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("aggr", ["mean", "sum", "max"])
def test_cuda_matches_pyg_sageconv(aggr):
    n = 5000
    ei = _edges(n, n, 50000, device="cuda")
    g = CscGraph.from_edge_index(ei, n)
    ours, theirs = _pair(64, 32, dtype=torch.float32, aggr=aggr)
    ours, theirs = ours.cuda(), theirs.cuda()
    x = torch.randn(n, 64, device="cuda", requires_grad=True)
    out = ours(x, g)
    ref = theirs(x, ei)
    # float64 oracle: PyG on float64 copies
    theirs64 = pyg_nn.SAGEConv(64, 32, aggr=aggr).double().cuda()
    theirs64.load_state_dict({k: v.double() for k, v in theirs.state_dict().items()})
    ref64 = theirs64(x.detach().double(), ei)
    e_ours, e_peer = rel_l2(out, ref64), rel_l2(ref, ref64)
    assert fla_compat_ok(e_ours, e_peer), f"ours {e_ours:.2e} vs PyG {e_peer:.2e}"
    dy = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, dy)
    (rx,) = torch.autograd.grad(ref, x, dy)
    assert rel_l2(gx, rx) <= 1e-4

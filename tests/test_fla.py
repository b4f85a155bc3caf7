"""cudnn_train.fla: accelerate_fla / restore_fla rebind FLA's functions everywhere, and only those."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import types

import pytest
import torch

import cudnn_train.fla as ctf
from cudnn_train import backend
from tests.utils import fla_compat_ok, rel_l2

pytest.importorskip("fla.ops.gated_delta_rule", reason="flash-linear-attention (fla) is not installed")
import fla.layers.gated_deltanet as fla_gdn_layer  # noqa: E402
import fla.ops.gated_delta_rule as fla_gdr  # noqa: E402
import fla.ops.kda as fla_kda  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule as copied_before_patching  # noqa: E402
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule  # noqa: E402
from fla.ops.kda.naive import naive_recurrent_kda  # noqa: E402

THIS = sys.modules[__name__]


@pytest.fixture(autouse=True, scope="module")
def one_cpu_thread():
    """Tiny tensors: intra-op threads only add contention on a small CI machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _unpatched():
    ctf.restore_fla()
    yield
    ctf.restore_fla()


def gdn_original():
    return ctf.original("gated_delta_rule", "chunk_gated_delta_rule")


# ---------------------------------------------------------------------- patch registry


def test_accelerate_rebinds_every_copy_and_restore_puts_them_back():
    orig = gdn_original()
    assert THIS.copied_before_patching is orig and fla_gdn_layer.chunk_gated_delta_rule is orig
    got = ctf.accelerate_fla(["gdn"])
    assert got == ("gated_delta_rule",) and ctf.is_accelerated("gdn") and ctf.is_accelerated()
    w = fla_gdr.chunk_gated_delta_rule
    assert w is not orig and w._cudnn_train_original is orig
    chunk_mod = sys.modules["fla.ops.gated_delta_rule.chunk"]
    for holder, name in [(THIS, "copied_before_patching"), (fla_gdn_layer, "chunk_gated_delta_rule"),
                         (fla_gdr, "chunk_gdn"), (chunk_mod, "chunk_gated_delta_rule")]:
        assert getattr(holder, name) is w, f"{holder.__name__}.{name} not rebound"
    # FLA keys its backend registry by inspect.unwrap and keeps this op out of torch.compile: so does the wrapper
    assert inspect.unwrap(w) is inspect.unwrap(orig)
    assert getattr(w, "_torchdynamo_disable", False) == getattr(orig, "_torchdynamo_disable", False)
    assert getattr(w, "_torchdynamo_orig_callable", None) is not inspect.unwrap(orig)
    assert fla_gdn_layer.fused_recurrent_gated_delta_rule._cudnn_train_original is not None
    assert not ctf.is_accelerated("kda")
    assert ctf.restore_fla() == ("gated_delta_rule",)
    assert THIS.copied_before_patching is orig and fla_gdn_layer.chunk_gated_delta_rule is orig
    assert fla_gdr.chunk_gdn is orig and not ctf.is_accelerated()


def test_idempotent_and_incremental():
    ctf.accelerate_fla(["gdn"])
    w = fla_gdr.chunk_gated_delta_rule
    assert ctf.accelerate_fla("gated_delta_rule") == ("gated_delta_rule",)
    assert fla_gdr.chunk_gated_delta_rule is w and w._cudnn_train_original is gdn_original()  # not wrapped twice
    assert ctf.accelerate_fla(["kda"]) == ("gated_delta_rule", "kda")
    assert fla_gdr.chunk_gated_delta_rule is w and ctf.is_accelerated("kda")
    assert ctf.restore_fla("gdn") == ("gated_delta_rule",)
    assert not ctf.is_accelerated("gdn") and ctf.is_accelerated("kda")
    assert fla_kda.chunk_kda._cudnn_train_original is ctf.original("kda", "chunk_kda")
    # a second restore has nothing left to do
    assert ctf.restore_fla("gdn") == ()


def test_unknown_target_raises_and_patches_nothing():
    with pytest.raises(ValueError, match="unknown target 'mamba'"):
        ctf.accelerate_fla(["gdn", "mamba"])
    assert not ctf.is_accelerated() and fla_gdr.chunk_gated_delta_rule is gdn_original()
    with pytest.raises(ValueError, match="targets"):
        ctf.accelerate_fla([])
    with pytest.raises(ValueError, match="targets"):
        ctf.accelerate_fla([3])
    with pytest.raises(ValueError, match="unknown target"):
        ctf.is_accelerated("nope")
    with pytest.raises(ValueError, match="unknown target"):
        ctf.restore_fla("nope")


def test_explicit_list_is_all_or_nothing(monkeypatch, capsys):
    broken = dataclasses.replace(ctf._SPECS["kda"][0], fla_module="fla.ops.kda_not_there")
    monkeypatch.setitem(ctf._SPECS, "kda", (broken,))
    with pytest.raises(RuntimeError, match=r"target 'kda'.*fla\.ops\.kda_not_there.*nothing was patched"):
        ctf.accelerate_fla(["gdn", "kda"])
    assert not ctf.is_accelerated() and fla_gdr.chunk_gated_delta_rule is gdn_original()
    # targets=None: best effort, the broken target is skipped with its reason
    got = ctf.accelerate_fla(verbose=True)
    assert "gated_delta_rule" in got and "kda" not in got
    assert "kda: skipped" in capsys.readouterr().out


def test_signature_other_than_fla_06_is_refused():
    def chunk_gated_delta_rule(q, k, v, beta, g, scale=None):  # another order: must not be wrapped
        raise AssertionError("never called")

    spec = ctf._SPECS["gated_delta_rule"][0]
    assert ctf._signature_problem(gdn_original(), spec.params) is None
    assert "not FLA 0.6's" in ctf._signature_problem(chunk_gated_delta_rule, spec.params)


def test_restore_leaves_foreign_rebinds_and_catches_later_copies():
    ctf.accelerate_fla(["gdn"])
    w = fla_gdr.chunk_gated_delta_rule

    def foreign(*args, **kwargs):
        return w(*args, **kwargs)

    late = types.ModuleType("late_user_module")
    late.chunk = w  # a copy of the wrapper made after patching
    sys.modules["late_user_module"] = late
    fla_gdn_layer.chunk_gated_delta_rule = foreign  # someone else rebinds after us
    try:
        ctf.restore_fla()
        assert fla_gdn_layer.chunk_gated_delta_rule is foreign  # not ours any more: left alone
        assert late.chunk is gdn_original()
        assert fla_gdr.chunk_gated_delta_rule is gdn_original()
    finally:
        fla_gdn_layer.chunk_gated_delta_rule = gdn_original()
        del sys.modules["late_user_module"]


def test_op_fla_backend_finds_the_original_not_the_wrapper():
    from cudnn_train.fused.gated_delta_rule import fla_original

    ctf.accelerate_fla(["gdn", "kda"])
    assert fla_original("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule") is gdn_original()
    assert fla_original("fla.ops.kda.chunk", "chunk_kda") is ctf.original("kda", "chunk_kda")
    assert fla_original("fla.ops.kda.fused_recurrent", "fused_recurrent_kda") is ctf.original(
        "kda", "fused_recurrent_kda")


# ---------------------------------------------------------------------- routing


def test_routing_serves_declines_and_falls_back():
    """The wrapper hands a call to FLA's function unchanged whenever cudnn_train declines it."""
    ours = importlib.import_module("cudnn_train.fused.gated_delta_rule")

    calls = []

    def spy(**kwargs):
        calls.append(kwargs)
        return "fla-answer"

    w = ctf._wrap_gdn_chunk(spy, ours)
    B, T, H, K = 1, 9, 2, 8
    q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    g, beta = -torch.rand(B, T, H), torch.rand(B, T, H)

    o, _ = w(q, k, v, g, beta)  # served by cudnn_train
    assert not calls and ctf.last_path("gdn").startswith("cudnn_train:torch")
    want, _ = naive_recurrent_gated_delta_rule(q, k, v, beta, g)
    assert rel_l2(o, want) <= 1e-5

    ctx = object()
    assert w(q, k, v, g, beta, cp_context=ctx) == "fla-answer"  # an argument we do not implement
    assert calls[-1]["cp_context"] is ctx and calls[-1]["q"] is q and ctf.last_path("gdn") == "fla:cp_context"
    assert w(q, k, v, g, beta, head_first=False) == "fla-answer"  # an unknown keyword
    assert calls[-1]["head_first"] is False and "head_first" in ctf.last_path()
    assert w(q, k, v[:, :, :1].expand(B, T, 3, K), g, beta) == "fla-answer"  # our ValueError: FLA's answer
    assert ctf.last_path("gdn").startswith("fla:ValueError")
    with backend.use_backend("cutedsl"):  # every allowed backend declines: Unsupported
        assert w(q, k, v, g, beta) == "fla-answer"
    assert len(calls) == 4 and ctf.last_path("gdn").startswith("fla:")


def test_kda_and_norm_routing_declines():
    # import_module: `import a.b as m` would find the function that fused/__init__ binds over the module name
    ours_kda = importlib.import_module("cudnn_train.fused.kda")
    ours_norm = importlib.import_module("cudnn_train.fused.rms_norm_gated")

    calls = []

    def spy(**kwargs):
        calls.append(kwargs)
        return "fla-answer"

    wk = ctf._wrap_kda_chunk(spy, ours_kda)
    q = torch.randn(1, 4, 2, 8)
    for bad in (dict(return_intermediate_states=True), dict(use_graph=True), dict(cp_context=object())):
        assert wk(q, q, q, -torch.rand(1, 4, 2, 8), torch.rand(1, 4, 2), **bad) == "fla-answer"
    wn = ctf._wrap_rms_norm_gated(spy, ours_norm)
    x = torch.randn(3, 8)
    assert wn(x, x, None, torch.zeros(8)) == "fla-answer"  # a bias: FLA's
    assert wn(x, x, None, None, prenorm=True) == "fla-answer"
    y = wn(x, x, torch.ones(8), None, activation="sigmoid", eps=1e-5)
    assert len(calls) == 5 and torch.is_tensor(y)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * torch.sigmoid(x)
    assert rel_l2(y, want) <= 1e-6


# ---------------------------------------------------------------------- FLA's ops on CPU


def test_fla_ops_run_on_cpu_after_accelerate():
    ctf.accelerate_fla(["gdn", "kda"])
    B, T, H, K, V = 2, 70, 2, 8, 16
    q, k = torch.randn(B, T, H, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V, requires_grad=True)
    g, beta = torch.nn.functional.logsigmoid(torch.randn(B, T, H)), torch.rand(B, T, H)
    h0 = torch.randn(B, H, K, V)
    o, ht = fla_gdr.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert ctf.last_path("gdn").startswith("cudnn_train:torch")
    want_o, want_ht = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=h0, output_final_state=True)
    assert rel_l2(o, want_o) <= 1e-5 and rel_l2(ht, want_ht) <= 1e-5
    dv, = torch.autograd.grad((o * o).sum(), v)
    dv_want, = torch.autograd.grad((want_o * want_o).sum(), v)
    assert rel_l2(dv, dv_want) <= 1e-5
    with torch.no_grad():
        o2, _ = fla_gdr.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0)
    assert rel_l2(o2, want_o) <= 1e-5

    HV = 4  # KDA with GVA, per-channel decay
    v = torch.randn(B, T, HV, V)
    gk = torch.nn.functional.logsigmoid(torch.randn(B, T, HV, K))
    beta = torch.rand(B, T, HV)
    o, _ = fla_kda.chunk_kda(q, k, v, gk, beta)
    assert ctf.last_path("kda").startswith("cudnn_train:torch")
    assert rel_l2(o, naive_recurrent_kda(q, k, v, gk, beta)[0]) <= 1e-5


def test_gated_mlp_target_routes_the_method_and_declines_what_it_does_not_fuse():
    from fla.modules.mlp import GatedMLP

    class Sub(GatedMLP):  # a subclass that does not override forward follows the class patch
        pass

    orig = ctf.original("gated_mlp")
    assert GatedMLP.forward is orig
    assert ctf.accelerate_fla("gated_mlp") == ("gated_mlp",)
    assert GatedMLP.forward is not orig and GatedMLP.forward._cudnn_train_original is orig
    assert ctf.accelerate_fla("gated_mlp") == ("gated_mlp",) and GatedMLP.forward._cudnn_train_original is orig
    for cls in (GatedMLP, Sub):
        m = cls(32, intermediate_size=64)
        x = torch.randn(2, 5, 32, requires_grad=True)
        y = m(x, some_kwarg_fla_ignores=1)
        assert ctf.last_path("gated_mlp").startswith("cudnn_train:torch")
        ref_m = cls(32, intermediate_size=64)
        ref_m.load_state_dict(m.state_dict())
        xr = x.detach().clone().requires_grad_()
        f = torch.nn.functional
        ref = ref_m.down_proj(f.silu(ref_m.gate_proj(xr)) * ref_m.up_proj(xr))
        assert rel_l2(y, ref) <= 1e-6
        y.square().sum().backward()
        ref.square().sum().backward()
        assert rel_l2(x.grad, xr.grad) <= 1e-5
        for name in ("gate_proj", "up_proj", "down_proj"):
            assert rel_l2(getattr(m, name).weight.grad, getattr(ref_m, name).weight.grad) <= 1e-5
    # what we do not fuse goes to FLA's forward, which says why in last_path
    m = GatedMLP(32, intermediate_size=64)
    m.gate_proj.register_forward_hook(lambda *a: None)
    try:
        m(torch.randn(3, 32))
    except Exception:  # noqa: BLE001 - FLA's own forward may need Triton on this machine
        pass
    assert ctf.last_path("gated_mlp") == "fla:a projection with a bias, hooks or a non-plain weight"
    assert ctf.restore_fla("gated_mlp") == ("gated_mlp",) and GatedMLP.forward is orig


# ---------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_patched_fla_op_agrees_with_fla(dtype):
    dev = "cuda"
    B, T, H, HV, K, V = 2, 300, 2, 4, 64, 64
    q, k = torch.randn(B, T, H, K, device=dev), torch.randn(B, T, H, K, device=dev)
    v = torch.randn(B, T, HV, V, device=dev)
    g, beta = torch.randn(B, T, HV, device=dev), torch.randn(B, T, HV, device=dev)
    A_log, dt_bias = torch.rand(HV, device=dev), torch.randn(HV, device=dev)
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias, state_v_first=True, output_final_state=True)
    args = [t.to(dtype) for t in (q, k, v, g, beta)]
    o_f, s_f = fla_gdr.chunk_gated_delta_rule(*args, **kw)  # FLA's own
    ctf.accelerate_fla(["gdn"])
    o_o, s_o = fla_gdr.chunk_gated_delta_rule(*args, **kw)
    assert ctf.last_path("gdn").startswith("cudnn_train:")
    with backend.use_backend("fla"):  # our fla backend reaches FLA's original, not the wrapper
        o_b, _ = fla_gdr.chunk_gated_delta_rule(*args, **kw)
    assert torch.equal(o_b, o_f)
    with backend.use_backend("torch"):
        o_r, s_r = fla_gdr.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    for what, a, f, r in (("o", o_o, o_f, o_r), ("state", s_o, s_f, s_r)):
        assert fla_compat_ok(rel_l2(a, r), rel_l2(f, r)), what


@pytest.mark.gpu
def test_gpu_patched_gated_mlp_agrees_with_fla_and_uses_the_sm90_gemms():
    from fla.modules.mlp import GatedMLP

    m = GatedMLP(512, intermediate_size=1536).cuda().to(torch.bfloat16)
    x = torch.randn(4, 128, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    theirs = m(x)
    ctf.accelerate_fla("gated_mlp")
    ours = m(x)
    assert ctf.last_path("gated_mlp") == "cudnn_train:cutedsl:sm90"
    xf = x.detach().float()
    mf = GatedMLP(512, intermediate_size=1536).cuda()
    mf.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    f = torch.nn.functional
    ref = mf.down_proj(f.silu(mf.gate_proj(xf)) * mf.up_proj(xf))
    assert fla_compat_ok(rel_l2(ours, ref), rel_l2(theirs, ref))

"""FLA drop-in: route flash-linear-attention's ops through cudnn_train's dispatchers.

    import cudnn_train.fla as ctf
    ctf.accelerate_fla()                 # every target that FLA and cudnn_train both provide
    ctf.accelerate_fla(["gdn", "kda"])   # exactly these, all or nothing
    ctf.restore_fla()                    # put FLA's functions back

Targets (``gdn`` is an alias of ``gated_delta_rule``) and the FLA functions they rebind:

* ``gated_delta_rule``: ``fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule`` (alias
  ``chunk_gdn``) and ``fla.ops.gated_delta_rule.fused_recurrent.fused_recurrent_gated_delta_rule``;
* ``kda``: ``fla.ops.kda.chunk.chunk_kda`` and ``fla.ops.kda.fused_recurrent.fused_recurrent_kda``;
* ``causal_conv1d``: ``fla.modules.causal_conv1d.ops.causal_conv1d`` (what ``ShortConvolution`` calls);
* ``rms_norm_gated``: ``fla.modules.norm.fused_norm_gate.rms_norm_gated`` (``FusedRMSNormGated``);
* ``gated_mlp``: the method ``fla.modules.mlp.GatedMLP.forward`` (a class attribute, rebound on
  the class, so every instance and every subclass that does not override it follows): with
  ``hidden_act='swish'``, bias-free plain ``nn.Linear`` projections without hooks, the whole
  MLP runs as ``cudnn_train.fused.swiglu_mlp`` (gate/up GEMM with the SwiGLU epilogue, down
  GEMM, fused backward); anything else goes to FLA's forward unchanged.

How it patches: FLA's layers (and many users) bind FLA's functions by name
(``from fla.ops.gated_delta_rule import chunk_gated_delta_rule``), so rebinding one module
attribute is not enough. ``accelerate_fla`` scans every module in ``sys.modules`` and rebinds
each attribute that *is* FLA's original function object to a wrapper with FLA's signature.
Modules imported later pick the wrapper up from FLA's own modules.

* incremental and idempotent: a second call patches only what is new (copies made since);
* atomic for an explicit target list: every target is resolved first (FLA and cudnn_train
  import, the function exists, its signature is FLA 0.6's); if any cannot be, nothing is
  patched and the error names the target and the reason. With ``targets=None`` each target
  that resolves is patched and the others are skipped (``verbose=True`` prints why);
* ``restore_fla`` puts FLA's function back only where an attribute still holds our wrapper:
  an attribute that someone else rebound after us is left alone.

Each patched call goes to the cudnn_train op (``cudnn_train.fused...``), whose dispatcher
picks a backend (``cutedsl`` -> ``fla`` -> ``torch``). It is handed back to FLA's original,
unchanged, when cudnn_train declines it: an argument it does not implement (``cp_context``,
``chunk_indices``, KDA's ``return_intermediate_states`` / ``use_graph``, a residual, an
unknown keyword), a ``ValueError`` from its argument checks, or ``Unsupported`` from every
allowed backend. A declined configuration therefore gets exactly FLA's answer (or FLA's error).
The op's own ``fla`` backend calls FLA's original (found through the wrapper's
``_cudnn_train_original`` attribute), never the wrapper, so there is no recursion.

Side benefit: on a machine without a GPU, FLA's ops (and, with ``causal_conv1d`` and
``rms_norm_gated``, FLA's ``GatedDeltaNet`` and ``KimiDeltaAttention`` layers in training
mode) run through cudnn_train's float32 torch reference. Not covered: FLA's single-token
decode step of ``ShortConvolution`` (``causal_conv1d_update``) and FLA's plain ``RMSNorm``.

A wrapper keeps FLA's ``torch.compile`` behaviour: where FLA's function is
``torch.compiler.disable``-d, so is the wrapper. ``inspect.unwrap`` of a wrapper reaches
FLA's function (FLA keys its backend registry that way). ``original(target, attr)`` returns
FLA's own function behind a target.

``last_path(target=None)`` tells who served the latest patched call:
``"cudnn_train:<backend path>"`` (e.g. ``"cudnn_train:torch:fallback(no GPU)"``) or
``"fla:<why cudnn_train declined>"``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import operator
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Iterable

import torch

from . import backend

__all__ = ["accelerate_fla", "restore_fla", "is_accelerated", "last_path", "original", "TARGETS"]

TARGETS = ("gated_delta_rule", "kda", "causal_conv1d", "rms_norm_gated", "gated_mlp")
_ALIASES = {"gdn": "gated_delta_rule"}

_lock = threading.RLock()
_last: dict[str, str] = {}
_last_any: list[str | None] = [None]


# ---------------------------------------------------------------------- routing


def _record(target: str, path: str) -> None:
    _last[target] = path
    _last_any[0] = path


def _route(target: str, op_name: str, original: Callable, fla_kwargs: dict, reason: str | None, ours: Callable):
    """Serve through cudnn_train unless it declines; a declined call goes to FLA unchanged."""
    if reason is None:
        try:
            out = ours()
        except backend.Unsupported as e:
            _record(target, f"fla:{e.reason}")
            return original(**fla_kwargs)  # inside the handler: an FLA error shows ours as context
        except ValueError as e:
            _record(target, f"fla:ValueError({e})")
            return original(**fla_kwargs)
        _record(target, f"cudnn_train:{backend.last_path(op_name)}")
        return out
    _record(target, f"fla:{reason}")
    return original(**fla_kwargs)


def _unknown(kwargs: dict, allowed: Iterable[str]) -> str | None:
    extra = sorted(set(kwargs) - set(allowed))
    return f"argument(s) {', '.join(extra)} not implemented" if extra else None


def _heads_differ(q, v) -> bool:
    return not (getattr(q, "ndim", 0) == 4 and getattr(v, "ndim", 0) == 4 and q.shape[2] == v.shape[2])


def _first(*reasons: str | None) -> str | None:
    for r in reasons:
        if r is not None:
            return r
    return None


# One wrapper factory per FLA function. Each wrapper has FLA 0.6's signature (checked
# against the original's at patch time), forwards every argument by name to FLA on a decline.


def _wrap_gdn_chunk(original: Callable, ours_mod: ModuleType) -> Callable:
    ours = ours_mod.chunk_gated_delta_rule

    @functools.wraps(original, updated=())  # not its __dict__: no torch.compile markers
    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                               allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                               chunk_indices=None, cp_context=None, **kwargs):
        fla_kwargs = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                          state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                          chunk_indices=chunk_indices, cp_context=cp_context, **kwargs)
        reason = _first(
            "cp_context" if cp_context is not None else None,
            "chunk_indices" if chunk_indices is not None else None,
            _unknown(kwargs, ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size")),
        )
        return _route("gated_delta_rule", "chunk_gated_delta_rule", original, fla_kwargs, reason, lambda: ours(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=kwargs.get("use_gate_in_kernel", False), A_log=kwargs.get("A_log"),
            dt_bias=kwargs.get("dt_bias"), use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            chunk_size=kwargs.get("chunk_size", 64), cu_seqlens_cpu=cu_seqlens_cpu,
        ))

    return chunk_gated_delta_rule


def _wrap_gdn_recurrent(original: Callable, ours_mod: ModuleType) -> Callable:
    ours = ours_mod.fused_recurrent_gated_delta_rule

    @functools.wraps(original, updated=())  # not its __dict__: no torch.compile markers
    def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                         initial_state=None, output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                                         dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                                         state_v_first=False, cu_seqlens=None, **kwargs):
        fla_kwargs = dict(q=q, k=k, v=v, g=g, gk=gk, gv=gv, beta=beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                          use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                          state_v_first=state_v_first, cu_seqlens=cu_seqlens, **kwargs)
        reason = _first(
            "gv (per-value-channel decay)" if gv is not None else None,
            # FLA fills a missing beta with ones over q's heads, not v's: with GVA leave that to FLA
            "beta=None with GVA" if beta is None and _heads_differ(q, v) else None,
            _unknown(kwargs, ()),
        )
        return _route("gated_delta_rule", "fused_recurrent_gated_delta_rule", original, fla_kwargs, reason,
                      lambda: ours(
                          q, k, v, g=g, gk=gk, beta=beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
                          use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                          state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                      ))

    return fused_recurrent_gated_delta_rule


def _wrap_kda_chunk(original: Callable, ours_mod: ModuleType) -> Callable:
    ours = ours_mod.chunk_kda

    @functools.wraps(original, updated=())  # not its __dict__: no torch.compile markers
    def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
        fla_kwargs = dict(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                          allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
                          disable_recompute=disable_recompute, return_intermediate_states=return_intermediate_states,
                          state_v_first=state_v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                          cp_context=cp_context, use_graph=use_graph, max_num_seqs=max_num_seqs, **kwargs)
        # disable_recompute only trades memory for time; max_num_seqs only matters with use_graph
        reason = _first(
            "cp_context" if cp_context is not None else None,
            "return_intermediate_states" if return_intermediate_states else None,
            "use_graph" if use_graph else None,
            _unknown(kwargs, ("A_log", "dt_bias", "chunk_size")),
        )
        return _route("kda", "chunk_kda", original, fla_kwargs, reason, lambda: ours(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
            A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"),
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            lower_bound=lower_bound, safe_gate=safe_gate, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
            chunk_size=kwargs.get("chunk_size", 64), cu_seqlens_cpu=cu_seqlens_cpu,
        ))

    return chunk_kda


def _wrap_kda_recurrent(original: Callable, ours_mod: ModuleType) -> Callable:
    ours = ours_mod.fused_recurrent_kda

    @functools.wraps(original, updated=())  # not its __dict__: no torch.compile markers
    def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                            output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                            use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                            state_v_first=False, cu_seqlens=None, **kwargs):
        fla_kwargs = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                          initial_state=initial_state, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                          use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                          lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, **kwargs)
        reason = _unknown(kwargs, ())
        return _route("kda", "fused_recurrent_kda", original, fla_kwargs, reason, lambda: ours(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
            allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
            cu_seqlens=cu_seqlens,
        ))

    return fused_recurrent_kda


def _wrap_causal_conv1d(original: Callable, ours_mod: ModuleType) -> Callable:
    ours = ours_mod.causal_conv1d

    @functools.wraps(original, updated=())  # not its __dict__: no torch.compile markers
    def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, backend="triton", cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                      cp_context=None, **kwargs):
        fla_kwargs = dict(x=x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
                          output_final_state=output_final_state, activation=activation, backend=backend,
                          cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices,
                          cp_context=cp_context, **kwargs)
        # FLA's `backend` picks its kernel (triton / cuda / mix), not the math
        reason = _first(
            "cp_context" if cp_context is not None else None,
            "chunk_indices" if chunk_indices is not None else None,
            "weight=None" if weight is None else None,
            "residual" if residual is not None else None,
            _unknown(kwargs, ()),
        )
        return _route("causal_conv1d", "causal_conv1d", original, fla_kwargs, reason, lambda: ours(
            x, weight, bias=bias, activation=activation, cu_seqlens=cu_seqlens, initial_state=initial_state,
            output_final_state=output_final_state, cu_seqlens_cpu=cu_seqlens_cpu,
        ))

    return causal_conv1d


def _wrap_rms_norm_gated(original: Callable, ours_mod: ModuleType) -> Callable:
    ours = ours_mod.rms_norm_gated

    @functools.wraps(original, updated=())  # not its __dict__: no torch.compile markers
    def rms_norm_gated(x, g, weight, bias, activation="swish", residual=None, prenorm=False,
                       residual_in_fp32=False, eps=1e-6):
        fla_kwargs = dict(x=x, g=g, weight=weight, bias=bias, activation=activation, residual=residual,
                          prenorm=prenorm, residual_in_fp32=residual_in_fp32, eps=eps)
        # residual_in_fp32 only shapes the residual output, which exists only with residual / prenorm
        reason = _first(
            "bias" if bias is not None else None,
            "residual" if residual is not None else None,
            "prenorm" if prenorm else None,
        )
        return _route("rms_norm_gated", "rms_norm_gated", original, fla_kwargs, reason,
                      lambda: ours(x, g, weight, eps=eps, activation=activation))

    return rms_norm_gated


def _plain_linear(m) -> bool:
    """An ``nn.Linear`` as torch makes it: no bias, no hooks, a plain tensor weight (not a DTensor)."""
    return (type(m) is torch.nn.Linear and m.bias is None and not m._forward_hooks and not m._forward_pre_hooks
            and type(m.weight.data) is torch.Tensor)


def _wrap_gated_mlp_forward(original: Callable, ours_mod: ModuleType) -> Callable:
    ours = ours_mod.swiglu_mlp

    @functools.wraps(original, updated=())
    def forward(self, x, **kwargs):
        projs = (getattr(self, "gate_proj", None), getattr(self, "up_proj", None), getattr(self, "down_proj", None))
        reason = _first(
            f"hidden_act={getattr(self, 'hidden_act', None)!r}" if getattr(self, "hidden_act", None) != "swish" else None,
            None if all(_plain_linear(m) for m in projs) else "a projection with a bias, hooks or a non-plain weight",
        )
        # FLA's forward ignores its **kwargs, and so does ours
        return _route("gated_mlp", "swiglu_mlp", functools.partial(original, self), dict(x=x, **kwargs), reason,
                      lambda: ours(x, projs[0].weight, projs[1].weight, projs[2].weight))

    return forward


@dataclass(frozen=True)
class _Spec:
    fla_module: str
    attr: str
    ours_module: str
    wrap: Callable[[Callable, ModuleType], Callable]
    params: tuple[str, ...]  # FLA 0.6's named parameters, in order (a **kwargs tail is allowed)
    owner: str | None = None  # a class of fla_module whose attribute ``attr`` is patched (a method)


_SPECS: dict[str, tuple[_Spec, ...]] = {
    "gated_delta_rule": (
        _Spec("fla.ops.gated_delta_rule.chunk", "chunk_gated_delta_rule", "cudnn_train.fused.gated_delta_rule",
              _wrap_gdn_chunk,
              ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
               "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
               "chunk_indices", "cp_context")),
        _Spec("fla.ops.gated_delta_rule.fused_recurrent", "fused_recurrent_gated_delta_rule",
              "cudnn_train.fused.gated_delta_rule", _wrap_gdn_recurrent,
              ("q", "k", "v", "g", "gk", "gv", "beta", "scale", "initial_state", "output_final_state",
               "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
               "allow_neg_eigval", "state_v_first", "cu_seqlens")),
    ),
    "kda": (
        _Spec("fla.ops.kda.chunk", "chunk_kda", "cudnn_train.fused.kda", _wrap_kda_chunk,
              ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
               "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "safe_gate", "lower_bound",
               "disable_recompute", "return_intermediate_states", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
               "cp_context", "use_graph", "max_num_seqs")),
        _Spec("fla.ops.kda.fused_recurrent", "fused_recurrent_kda", "cudnn_train.fused.kda", _wrap_kda_recurrent,
              ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "scale", "initial_state", "output_final_state",
               "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
               "lower_bound", "state_v_first", "cu_seqlens")),
    ),
    "causal_conv1d": (
        _Spec("fla.modules.causal_conv1d.ops", "causal_conv1d", "cudnn_train.fused.causal_conv1d", _wrap_causal_conv1d,
              ("x", "weight", "bias", "residual", "initial_state", "output_final_state", "activation", "backend",
               "cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "cp_context")),
    ),
    "rms_norm_gated": (
        _Spec("fla.modules.norm.fused_norm_gate", "rms_norm_gated", "cudnn_train.fused.rms_norm_gated",
              _wrap_rms_norm_gated,
              ("x", "g", "weight", "bias", "activation", "residual", "prenorm", "residual_in_fp32", "eps")),
    ),
    "gated_mlp": (
        _Spec("fla.modules.mlp", "forward", "cudnn_train.fused.swiglu_mlp", _wrap_gated_mlp_forward, ("self", "x"),
              owner="GatedMLP"),
    ),
}


# ---------------------------------------------------------------------- patch registry


@dataclass
class _Patch:
    """One FLA function: its original, our wrapper, and the attributes we rebound."""

    spec: _Spec
    original: Callable
    wrapper: Callable
    owned: list[tuple[ModuleType, str]] = field(default_factory=list)

    def live(self) -> list[tuple[ModuleType, str]]:
        return [(m, n) for m, n in self.owned if vars(m).get(n) is self.wrapper]


_patches: dict[tuple[str, str], _Patch] = {}  # (fla_module, attr) -> patch, kept across restore


class _Unavailable(Exception):
    pass


def _canon(name: object) -> str:
    if not isinstance(name, str):
        raise ValueError(f"targets: expected target names (str), got {name!r}")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _SPECS:
        known = ", ".join(list(TARGETS) + [f"{a} (= {t})" for a, t in _ALIASES.items()])
        raise ValueError(f"targets: unknown target {name!r}; known: {known}")
    return key


def _canon_list(targets: str | Iterable[str] | None) -> tuple[list[str], bool]:
    """The canonical target names, and whether the caller named them (explicit)."""
    if targets is None:
        return list(TARGETS), False
    if isinstance(targets, str):
        targets = [targets]
    names: list[str] = []
    for t in targets:
        key = _canon(t)
        if key not in names:
            names.append(key)
    if not names:
        raise ValueError("targets: expected at least one target name, or None for all")
    return names, True


def _signature_problem(fn: Callable, params: tuple[str, ...]) -> str | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "its signature cannot be read"
    names = tuple(p.name for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD)
    if names != params:
        return f"its signature {names} is not FLA 0.6's {params}"
    return None


def _resolve(spec: _Spec) -> _Patch:
    """Import both sides and build (or reuse) the wrapper; _Unavailable with the reason if not possible."""
    key = (spec.fla_module, spec.attr)
    known = _patches.get(key)
    if known is not None:
        return known
    try:
        fla_mod = importlib.import_module(spec.fla_module)
    except Exception as e:  # ImportError, or triton failing at import
        raise _Unavailable(f"{spec.fla_module} does not import ({type(e).__name__}: {e})") from None
    if spec.owner is not None:
        cls = getattr(fla_mod, spec.owner, None)
        current = vars(cls).get(spec.attr) if isinstance(cls, type) else None
        where = f"{spec.owner}.{spec.attr}"
    else:
        current = getattr(fla_mod, spec.attr, None)
        where = spec.attr
    if current is None:
        raise _Unavailable(f"{spec.fla_module} has no {where}")
    original = getattr(current, "_cudnn_train_original", current)
    problem = _signature_problem(original, spec.params)
    if problem:
        raise _Unavailable(f"{spec.fla_module}.{spec.attr}: {problem}")
    try:
        ours_mod = importlib.import_module(spec.ours_module)
    except Exception as e:
        raise _Unavailable(f"{spec.ours_module} does not import ({type(e).__name__}: {e})") from None
    wrapper = spec.wrap(original, ours_mod)
    if getattr(original, "_torchdynamo_disable", False):
        wrapper = torch.compiler.disable(wrapper)  # FLA keeps this op out of torch.compile graphs: so do we
    wrapper._cudnn_train_original = original  # the op's fla backend calls this, never the wrapper
    return _Patch(spec=spec, original=original, wrapper=wrapper)


def _modules() -> list[ModuleType | type]:
    """The modules in sys.modules, each once (FLA registers some under several names), and the
    FLA classes whose methods are targets (``_Spec.owner``)."""
    seen: dict[int, ModuleType | type] = {}
    for m in list(sys.modules.values()):
        if isinstance(m, ModuleType):
            seen.setdefault(id(m), m)
    for specs in _SPECS.values():
        for spec in specs:
            mod = sys.modules.get(spec.fla_module)
            cls = getattr(mod, spec.owner, None) if spec.owner is not None and mod is not None else None
            if isinstance(cls, type):
                seen.setdefault(id(cls), cls)
    return list(seen.values())


def _bindings(values: Iterable[object]) -> list[tuple[object, ModuleType, str]]:
    """Every (value, module, attribute) in sys.modules whose value is one of ``values`` (by identity)."""
    values = list(values)
    found = []
    for mod in _modules():
        try:
            vals = list(vars(mod).values())
        except TypeError:
            continue
        # C-speed identity pre-filter (no __eq__ or __hash__ of foreign objects is called)
        hits = [v for v in values if any(map(operator.is_, vals, itertools.repeat(v)))]
        if not hits:
            continue
        for name, v in list(vars(mod).items()):
            if any(v is h for h in hits):
                found.append((v, mod, name))
    return found


def _target_patches(target: str) -> list[_Patch]:
    return [p for s in _SPECS[target] if (p := _patches.get((s.fla_module, s.attr))) is not None]


def accelerate_fla(targets: str | Iterable[str] | None = None, verbose: bool = False) -> tuple[str, ...]:
    """Route FLA's functions for ``targets`` (default: all) through cudnn_train.

    Returns the targets accelerated after the call. Raises ``ValueError`` for an unknown
    target name (nothing is patched), and ``RuntimeError`` naming the target and the reason
    when an explicitly named target cannot be patched (nothing is patched). With
    ``targets=None`` a target that cannot be patched is skipped; if none can be,
    ``RuntimeError`` again.
    """
    names, explicit = _canon_list(targets)
    with _lock:
        resolved: dict[str, list[_Patch]] = {}
        skipped: dict[str, str] = {}
        for t in names:
            try:
                resolved[t] = [_resolve(s) for s in _SPECS[t]]
            except _Unavailable as e:
                if explicit:
                    raise RuntimeError(f"accelerate_fla: cannot patch target {t!r}: {e}; nothing was patched") from None
                skipped[t] = str(e)
        if not resolved:
            raise RuntimeError("accelerate_fla: no target can be patched: "
                               + "; ".join(f"{t}: {r}" for t, r in skipped.items()))
        # plan every rebinding first, then apply; undo all on a failure
        patches = [p for ps in resolved.values() for p in ps]
        plan = [(next(p for p in patches if p.original is v), mod, name)
                for v, mod, name in _bindings(p.original for p in patches)]
        done: list[tuple[_Patch, ModuleType, str]] = []
        try:
            for p, mod, name in plan:
                setattr(mod, name, p.wrapper)
                done.append((p, mod, name))
        except Exception:
            for p, mod, name in reversed(done):
                setattr(mod, name, p.original)
            raise
        for ps in resolved.values():
            for p in ps:
                _patches[(p.spec.fla_module, p.spec.attr)] = p
        for p, mod, name in done:
            if (mod, name) not in p.owned:
                p.owned.append((mod, name))
        if verbose:
            for t, ps in resolved.items():
                n_new = sum(1 for p_, _, _ in done if p_ in ps)
                where = sorted({f"{m.__name__}.{n}" for p in ps for m, n in p.live()})
                print(f"cudnn_train.accelerate_fla: {t}: {n_new} new binding(s); now {len(where)}: {', '.join(where)}")
            for t, r in skipped.items():
                print(f"cudnn_train.accelerate_fla: {t}: skipped ({r})")
        return tuple(t for t in TARGETS if _is_accelerated(t))


def restore_fla(targets: str | Iterable[str] | None = None) -> tuple[str, ...]:
    """Put FLA's original functions back for ``targets`` (default: all); returns the targets restored.

    Only attributes that still hold our wrapper are rebound (including copies of the wrapper
    made after patching); an attribute someone else rebound after us is left as it is.
    """
    names, _ = _canon_list(targets)
    with _lock:
        owners = [(t, p) for t in names for p in _target_patches(t)]
        restored = set()
        for v, mod, name in _bindings(p.wrapper for _, p in owners):
            t, p = next((t, p) for t, p in owners if p.wrapper is v)
            setattr(mod, name, p.original)
            restored.add(t)
        for _, p in owners:
            p.owned.clear()
    return tuple(t for t in names if t in restored)


def _is_accelerated(target: str) -> bool:
    return any(p.live() for p in _target_patches(target))


def is_accelerated(target: str | None = None) -> bool:
    """Whether ``target`` is patched now (we still own at least one of its bindings); None: any target."""
    with _lock:
        if target is None:
            return any(_is_accelerated(t) for t in TARGETS)
        return _is_accelerated(_canon(target))


def last_path(target: str | None = None) -> str | None:
    """Who served the latest patched call (of ``target``, or of any): ``cudnn_train:...`` or ``fla:<reason>``."""
    if target is None:
        return _last_any[0]
    return _last.get(_canon(target))


def original(target: str, attr: str | None = None) -> Callable:
    """FLA's own function behind a target (its first function, or the one named ``attr``)."""
    specs = _SPECS[_canon(target)]
    for s in specs:
        if attr is None or s.attr == attr:
            return _resolve(s).original
    raise ValueError(f"attr: target {target!r} has no function {attr!r}; it has {[s.attr for s in specs]}")


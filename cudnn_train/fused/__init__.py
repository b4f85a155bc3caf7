"""Functional ops: each op family is one module holding its reference, autograd and dispatch."""

from .causal_conv1d import causal_conv1d, causal_conv1d_ref
from .csa import csa_comp_positions, csa_compress, csa_compress_ref, csa_cu_seqlens_comp
from .dsa import (
    indexer_logits,
    indexer_logits_ref,
    indexer_loss,
    indexer_loss_ref,
    indexer_topk,
    indexer_topk_ref,
    sparse_mla_attention,
    sparse_mla_attention_ref,
)
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, naive_gated_delta_rule_ref
from .gnn import CscGraph, agg_simple, agg_simple_ref
from .kda import chunk_kda, fused_recurrent_kda, naive_kda_ref
from .rms_norm_gated import rms_norm_gated, rms_norm_gated_ref
from .swiglu_mlp import swiglu, swiglu_mlp, swiglu_mlp_ref

__all__ = [
    "CscGraph",
    "agg_simple",
    "agg_simple_ref",
    "causal_conv1d",
    "causal_conv1d_ref",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_kda",
    "naive_gated_delta_rule_ref",
    "naive_kda_ref",
    "csa_comp_positions",
    "csa_compress",
    "csa_compress_ref",
    "csa_cu_seqlens_comp",
    "indexer_logits",
    "indexer_logits_ref",
    "indexer_loss",
    "indexer_loss_ref",
    "indexer_topk",
    "indexer_topk_ref",
    "rms_norm_gated",
    "rms_norm_gated_ref",
    "sparse_mla_attention",
    "sparse_mla_attention_ref",
    "swiglu",
    "swiglu_mlp",
    "swiglu_mlp_ref",
]

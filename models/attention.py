"""Causal self-attention with grouped-query heads, optional QK-norm (per head, or over the
whole q and k projections) and rotary embeddings (on the whole head or its first part).

Under tp each rank owns ``num_heads/tp`` query heads together with the
``num_kv_heads/tp`` key/value heads they read, so attention itself needs no tp
communication: the fused q|k|v projection is column-parallel and the output projection
row-parallel. Under cp each rank holds its zigzag shard of every sequence
(:mod:`moe_fold.parallel.context_parallel`); the projections and rotary work token by token, and
only the attention proper crosses the cp group (``parallel.cp_kind``: ring or a2a).
Packed documents (:class:`moe_fold.parallel.varlen.Documents`): attention stays inside each
document, over the group the micro-batch names (a dynamic-cp sub-group may replace the
layout's cp group).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from moe_fold.comm import Group, group_size
from moe_fold.config import ModelConfig
from moe_fold.parallel.context_parallel import CP_KINDS, context_parallel_attention
from moe_fold.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, init_seed
from moe_fold.parallel.varlen import Documents

from .kv_cache import LayerCache, cached_attention
from .norm import RMSNorm, ShardedRMSNorm
from .rotary import apply_rotary


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, head_dim: int, tp_group: Group, sequence_parallel: bool,
                 *, seed: int, name: str, cp_group: Group = None, cp_kind: str = "ring"):
        super().__init__()
        tp = group_size(tp_group)
        for field in ("num_heads", "num_kv_heads"):
            if getattr(config, field) % tp:
                raise ValueError(f"model.{field}={getattr(config, field)} is not divisible by tp={tp}")
        if cp_kind not in CP_KINDS:
            raise ValueError(f"parallel.cp_kind={cp_kind!r} must be one of {', '.join(CP_KINDS)}")
        self.cp_group, self.cp_kind = cp_group, cp_kind
        self.head_dim = head_dim
        self.num_heads = config.num_heads // tp  # local query heads
        self.num_kv_heads = config.num_kv_heads // tp  # local key/value heads
        q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
        std = config.init_std
        self.qkv = ColumnParallelLinear(config.hidden_size, [q_size, kv_size, kv_size], tp_group,
                                        sequence_parallel, std=std, seed=init_seed(seed, f"{name}.qkv"),
                                        bias=config.qkv_bias)
        self.proj = RowParallelLinear(q_size, config.hidden_size, tp_group, sequence_parallel,
                                      std=std, seed=init_seed(seed, f"{name}.proj"),
                                      bias=config.attention_out_bias)  # gpt-oss: o_proj has a bias
        self.qk_norm = config.qk_norm
        self.norm_projection = config.qk_norm and config.qk_norm_scope == "projection"
        if self.norm_projection:
            # OLMoE: one norm over all heads of q (and of k); each tp rank holds its heads' slice.
            self.q_norm = ShardedRMSNorm(q_size, config.norm_eps, tp_group)
            self.k_norm = ShardedRMSNorm(kv_size, config.norm_eps, tp_group)
        elif self.qk_norm:
            # Every tp rank holds different heads, so these grads are partial over tp.
            self.q_norm = RMSNorm(head_dim, config.norm_eps, "tp_sum")
            self.k_norm = RMSNorm(head_dim, config.norm_eps, "tp_sum")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Documents] = None, kv_cache: Optional[LayerCache] = None) -> torch.Tensor:
        """``x [S_local, B, H]`` -> ``[S_local, B, H]``; cos/sin ``[S, head_dim]`` or ``[B, S, head_dim]``
        for this rank's tokens (``S = S_global/cp``, the zigzag shard's positions under cp).
        ``docs``: packed documents and the group to attend over (None: the layout's cp group,
        one causal sequence per row). ``kv_cache`` (sampling, no cp): the tokens before
        these, whose keys and values it holds; these tokens' keys and values are added."""
        qkv = self.qkv(x)  # [S, B, (heads + 2*kv_heads) * head_dim]
        S, B = qkv.shape[:2]
        if self.norm_projection:
            q, k, v = qkv.split([self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2, dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        q, k, v = qkv.view(S, B, -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)  # [S, B, heads, head_dim]
        if self.qk_norm and not self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, heads, S, head_dim]
        q, k = _rotate_part(q, cos, sin), _rotate_part(k, cos, sin)
        # Query head h reads key/value head h // (heads / kv_heads), as in Hugging Face.
        # A cp group of one rank (or None) is plain causal attention over the local sequence.
        if kv_cache is not None:
            out = cached_attention(q, *kv_cache.append(k, v))  # [B, heads, S, hd]
        else:
            group, doc_ids = (self.cp_group, None) if docs is None else (docs.cp_group, docs.doc_ids)
            out = context_parallel_attention(q, k, v, group, kind=self.cp_kind, doc_ids=doc_ids)  # [B, heads, S, hd]
        out = out.permute(2, 0, 1, 3).reshape(S, B, self.num_heads * self.head_dim)  # [S, B, heads*hd]
        return self.proj(out)


def _rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embeddings on the first ``cos.shape[-1]`` dims of each head of ``x``
    ``[B, heads, S, head_dim]``, the rest passed through (partial rotary, GLM-4.5)."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :width], cos, sin), x[..., width:]], dim=-1)

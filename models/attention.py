"""Causal self-attention with grouped-query heads, optional QK-norm (per head, over the
whole q and k projections, or Llama-4's unweighted L2 norm after rotary) and rotary
embeddings (on the whole head or its first part; none on NoPE layers).

Per-layer features (docs/attention.md; ``moe_fold.config.layer_attention`` says which a
layer has): attention sinks, a sliding window or chunked local attention, no rotary, and
temperature tuning of the queries on layers without rotary. Chunked attention runs as
documents cut at chunk boundaries (``moe_fold.parallel.varlen.chunk_doc_ids``); the
sliding window and sinks as one more term of the document mask
(``moe_fold.parallel.document_attention``); so all run under every cp kind and tp.

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

from moe_fold.comm import Group, group_rank, group_size
from moe_fold.config import ModelConfig, choice, heads_over_tp, layer_attention, require
from moe_fold.parallel.context_parallel import context_parallel_attention
from moe_fold.parallel.document_attention import apply_sinks, masked_block_attention
from moe_fold.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, global_normal, init_seed, mark, shard_tp,
)
from moe_fold.parallel.varlen import Documents, chunk_doc_ids

from .kv_cache import LayerCache, cached_attention
from .norm import RMSNorm, ShardedRMSNorm
from .rotary import apply_rotary, deinterleave


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, head_dim: int, tp_group: Group, sequence_parallel: bool,
                 *, seed: int, name: str, cp_group: Group = None, cp_kind: str = "ring", layer: int = 0):
        super().__init__()
        tp = group_size(tp_group)
        require(heads_over_tp, config.num_heads, config.num_kv_heads, tp)
        require(choice, "parallel.cp_kind", cp_kind)
        self.cp_group, self.cp_kind = cp_group, cp_kind
        self.head_dim = head_dim
        self.num_heads = config.num_heads // tp  # local query heads
        self.num_kv_heads = config.num_kv_heads // tp  # local key/value heads
        q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
        std = config.init_std
        # Qwen3-Next's output gate: one more part, after q, of the fused projection.
        self.gate_size = q_size // tp if config.attn_output_gate else 0
        parts = [q_size, q_size, kv_size, kv_size] if config.attn_output_gate else [q_size, kv_size, kv_size]
        self.qkv = ColumnParallelLinear(config.hidden_size, parts, tp_group,
                                        sequence_parallel, std=std, seed=init_seed(seed, f"{name}.qkv"),
                                        bias=config.qkv_bias)
        self.proj = RowParallelLinear(q_size, config.hidden_size, tp_group, sequence_parallel,
                                      std=std, seed=init_seed(seed, f"{name}.proj"),
                                      bias=config.attention_out_bias)  # gpt-oss: o_proj has a bias
        self.window, self.chunk, self.rope = layer_attention(config, layer)
        self.rope_interleave = config.rope_interleave  # rotary pairs interleaved (ERNIE-4.5, Llama-4)
        self.qk_norm = config.qk_norm and config.qk_norm_scope != "l2"
        self.norm_projection = config.qk_norm and config.qk_norm_scope == "projection"
        # Llama-4: an unweighted RMS ("L2") norm of each head after rotary, on rotary layers only.
        self.l2_norm_eps = config.norm_eps if config.qk_norm and config.qk_norm_scope == "l2" and self.rope else None
        self.temperature = None
        if config.attn_temperature_tuning and not self.rope:
            self.temperature = (config.attn_temperature_scale, config.attn_temperature_floor)
        self.sinks = None
        if config.attention_sinks:
            # One logit per query head, drawn globally and sliced like the heads over tp.
            full = global_normal([config.num_heads], std, init_seed(seed, f"{name}.sinks"))
            self.sinks = mark(nn.Parameter(shard_tp(full, 0, [config.num_heads], group_rank(tp_group), tp)),
                              "tp", 0, [config.num_heads])
        if self.norm_projection:
            # OLMoE: one norm over all heads of q (and of k); each tp rank holds its heads' slice.
            self.q_norm = ShardedRMSNorm(q_size, config.norm_eps, tp_group)
            self.k_norm = ShardedRMSNorm(kv_size, config.norm_eps, tp_group)
        elif self.qk_norm:
            # Every tp rank holds different heads, so these grads are partial over tp.
            self.q_norm = RMSNorm(head_dim, config.norm_eps, "tp_sum", config.norm_zero_centred)
            self.k_norm = RMSNorm(head_dim, config.norm_eps, "tp_sum", config.norm_zero_centred)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Documents] = None, kv_cache: Optional[LayerCache] = None,
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [S_local, B, H]`` -> ``[S_local, B, H]``; cos/sin ``[S, head_dim]`` or ``[B, S, head_dim]``
        for this rank's tokens (``S = S_global/cp``, the zigzag shard's positions under cp).
        ``docs``: packed documents and the group to attend over (None: the layout's cp group,
        one causal sequence per row). ``kv_cache`` (sampling, no cp): the tokens before
        these, whose keys and values it holds; these tokens' keys and values are added.
        ``positions`` ``[S]`` or ``[B, S]`` (those of cos/sin): needed by temperature tuning only."""
        qkv = self.qkv(x)  # [S, B, (heads + 2*kv_heads) * head_dim], the gate's heads after q's
        S, B = qkv.shape[:2]
        gate = None
        if self.gate_size:
            q_part, gate, kv_part = qkv.split([self.gate_size, self.gate_size, qkv.shape[-1] - 2 * self.gate_size], -1)
            qkv = torch.cat([q_part, kv_part], dim=-1)
        if self.norm_projection:
            q, k, v = qkv.split([self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2, dim=-1)
            qkv = torch.cat([self.q_norm(q), self.k_norm(k), v], dim=-1)
        q, k, v = qkv.view(S, B, -1, self.head_dim).split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)  # [S, B, heads, head_dim]
        if self.qk_norm and not self.norm_projection:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, heads, S, head_dim]
        if self.rope:
            q, k = _rotate_part(q, cos, sin, self.rope_interleave), _rotate_part(k, cos, sin, self.rope_interleave)
        if self.l2_norm_eps is not None:
            q, k = _l2_norm(q, self.l2_norm_eps), _l2_norm(k, self.l2_norm_eps)
        if self.temperature is not None:
            q = self._tune_temperature(q, positions)
        # Query head h reads key/value head h // (heads / kv_heads), as in Hugging Face.
        # A cp group of one rank (or None) is plain causal attention over the local sequence.
        if kv_cache is not None:
            out = self._cached(q, *kv_cache.append(k, v))  # [B, heads, S, hd]
        else:
            group, doc_ids = (self.cp_group, None) if docs is None else (docs.cp_group, docs.doc_ids)
            if self.chunk:
                doc_ids = chunk_doc_ids(doc_ids, B, S * group_size(group), self.chunk, q.device)
            out = context_parallel_attention(q, k, v, group, kind=self.cp_kind, doc_ids=doc_ids,
                                             window=self.window, sinks=self.sinks)  # [B, heads, S, hd]
        out = out.permute(2, 0, 1, 3).reshape(S, B, self.num_heads * self.head_dim)  # [S, B, heads*hd]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.proj(out)

    def _tune_temperature(self, q: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
        """Llama-4's temperature tuning: ``q [B, heads, S, hd]`` times
        ``1 + scale * log1p(floor((p + 1) / floor_scale))`` at each token's position p."""
        if positions is None:
            raise ValueError("model.attn_temperature_tuning=true: the attention needs the tokens' positions")
        scale, floor_scale = self.temperature
        p = positions.to(q.device, torch.float32)
        factor = torch.log1p(torch.floor((p + 1.0) / floor_scale)) * scale + 1.0  # [S] or [B, S]
        return (q * factor.view(-1 if factor.dim() == 2 else 1, 1, q.shape[2], 1)).to(q.dtype)

    def _cached(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Sampling: the newest tokens' q over every cached k, v (:func:`cached_attention`),
        with this layer's window, chunks and sinks through the same masks as training."""
        if not (self.window or self.chunk or self.sinks is not None):
            return cached_attention(q, k, v)
        n, length = q.shape[2], k.shape[2]
        pos_q = torch.arange(length - n, length, device=q.device)
        pos_k = torch.arange(length, device=q.device)
        docs = (None, None)
        if self.chunk:  # one sequence: chunk index = position // chunk
            docs = tuple((p // self.chunk).expand(q.shape[0], -1) for p in (pos_q, pos_k))
        out, lse = masked_block_attention(q, k, v, *docs, True, None, pos_q=pos_q, pos_k=pos_k, window=self.window)
        if self.sinks is not None:
            out, _ = apply_sinks(out, lse, self.sinks)
        return out.to(q.dtype)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-4's ``L2Norm``: ``x * rsqrt(mean(x^2) + eps)`` over the head dim, in float32
    (float64 for float64 inputs), no weight."""
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotary embeddings on the first ``cos.shape[-1]`` dims of each head of ``x``
    ``[B, heads, S, head_dim]``, the rest passed through (partial rotary, GLM-4.5);
    ``interleaved``: those dims come in pairs, de-interleaved first (q and k alike)."""
    width = cos.shape[-1]
    rotated = x if width == x.shape[-1] else x[..., :width]
    if interleaved:
        rotated = deinterleave(rotated)
    if width == x.shape[-1]:
        return apply_rotary(rotated, cos, sin)
    return torch.cat([apply_rotary(rotated, cos, sin), x[..., width:]], dim=-1)

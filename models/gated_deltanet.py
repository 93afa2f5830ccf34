"""Gated DeltaNet (Yang et al. 2024) as Qwen3-Next uses it: a linear-attention mixer with a
recurrent state per value head.

Per token: one projection gives q, k (``linear_num_key_heads`` heads of
``linear_key_head_dim``), v and the output gate z (``linear_num_value_heads`` heads of
``linear_value_head_dim``), the write strength b and the decay input a (one per value
head); q|k|v pass a depthwise causal conv1d and SiLU; q and k are L2-normalised (q also
scaled by ``dk**-0.5``); ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``;
the gated delta rule (:mod:`moe_fold.kernels.gated_delta`) runs with a key head serving
``value_heads / key_heads`` consecutive value heads; its output is RMS-normalised per
head, times a weight and ``silu(z)``, and projected back.

Under tp each rank owns whole key heads with their value heads (every part of the input
projection, the conv channels, ``A_log`` and ``dt_bias`` are split the same way); the
recurrence is per head, so it needs no tp communication. Under cp the layer keeps the
zigzag split and passes conv windows and states along the segments in sequence order
(:mod:`moe_fold.parallel.recurrent_cp`). Packed documents reset the conv window and the
state at every document start.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_fold.comm import Group, group_rank, group_size
from moe_fold.config import ModelConfig, linear_heads_over_tp, require
from moe_fold.kernels.delta_rule import delta_rule
from moe_fold.kernels.short_conv import short_conv
from moe_fold.parallel.recurrent_cp import conv_histories, local_segments, start_states
from moe_fold.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, global_normal, init_seed, mark, shard_tp,
)
from moe_fold.parallel.varlen import Documents

from .kv_cache import LayerCache


class GatedDeltaNet(nn.Module):
    """``x [S_local, B, H] -> [S_local, B, H]``.

    Parameters (global shapes): ``in_proj.weight [2*nk*dk + 2*nv*dv + 2*nv, H]`` (rows
    q|k|v|z|b|a), ``conv.weight [2*nk*dk + nv*dv, K]`` (channels q|k|v), ``A_log [nv]``,
    ``dt_bias [nv]``, ``norm.weight [dv]``, ``out_proj.weight [H, nv*dv]``.
    """

    def __init__(self, config: ModelConfig, tp_group: Group, sequence_parallel: bool, *, seed: int, name: str,
                 cp_group: Group = None):
        super().__init__()
        tp = group_size(tp_group)
        require(linear_heads_over_tp, config.linear_num_key_heads, config.linear_num_value_heads, tp)
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.nk, self.nv = nk // tp, nv // tp  # local heads
        self.cp_group = cp_group
        self.eps = config.norm_eps
        self.chunk_size = config.linear_chunk_size
        self.rule = delta_rule(config.linear_backend, "gated_delta_rule")
        std = config.init_std
        key, value = nk * self.dk, nv * self.dv
        self.conv = short_conv(config.conv_backend, config.linear_conv_kernel, (2 * key + value) // tp)
        self.in_proj = ColumnParallelLinear(config.hidden_size, [key, key, value, value, nv, nv], tp_group,
                                            sequence_parallel, std=std, seed=init_seed(seed, f"{name}.in_proj"))
        self.conv_weight, self.A_log, self.norm_weight, self.out_proj = recurrent_parameters(
            config, [key, key, value], nv, tp_group, sequence_parallel, seed=seed, name=name)
        self.dt_bias = mark(nn.Parameter(torch.ones(nv // tp)), "tp", 0, [nv])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Optional[Documents] = None,
                kv_cache: Optional[LayerCache] = None) -> torch.Tensor:
        """``x [S_local, B, H] -> [S_local, B, H]``, as attention is called (rotary ``cos``/``sin``
        unused: the recurrence orders tokens itself). ``kv_cache`` (sampling, no cp): the
        conv window and recurrent state the tokens before these left (:func:`conv_delta_rule`)."""
        key, value = self.nk * self.dk, self.nv * self.dv
        q, k, v, z, b, a = self.in_proj(x).split([key, key, value, value, self.nv, self.nv], dim=-1)
        o = conv_delta_rule(torch.cat([q, k, v], dim=-1), self.conv_weight, self.conv,
                            lambda conv: self._heads(conv, b, a, x.dtype), self.rule, self.chunk_size,
                            docs, self.cp_group, kv_cache)  # [B, nv, S, dv]
        return self._output(o, z, x.dtype)

    def _heads(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> tuple:
        """The conv's output ``qkv [S, B, 2key+value]`` and ``b``, ``a`` ``[S', B, nv]`` (S' >= S:
        a decode step's padding follows its S real tokens) -> ``q, k [B, nv, S, dk]``
        (L2-normalised, q scaled), ``v [B, nv, S, dv]``, ``g, beta [B, nv, S]``."""
        key = self.nk * self.dk
        q, k, v = qkv.split([key, key, self.nv * self.dv], dim=-1)
        S, B = q.shape[:2]
        b, a = b[:S], a[:S]
        # The recurrence runs in float32 (float64 for a float64 model), as fla's kernels do.
        work = torch.float64 if dtype == torch.float64 else torch.float32
        q = l2_normalize(q.reshape(S, B, self.nk, self.dk).to(work)) * self.dk ** -0.5
        k = l2_normalize(k.reshape(S, B, self.nk, self.dk).to(work))
        # A key head serves value_heads / key_heads consecutive value heads.
        q, k = (t.repeat_interleave(self.nv // self.nk, dim=2) for t in (q, k))  # [S, B, nv, dk]
        v = v.reshape(S, B, self.nv, self.dv)
        beta = b.to(work).sigmoid()  # [S, B, nv]
        g = -self.A_log.to(work).exp() * F.softplus(a.to(work) + self.dt_bias)  # [S, B, nv]
        q, k, v = (t.permute(1, 2, 0, 3).to(work) for t in (q, k, v))  # [B, nv, S, d]
        return q, k, v, g.permute(1, 2, 0), beta.permute(1, 2, 0)

    def _output(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The recurrence's ``o [B, nv, S, dv]`` RMS-normalised per head, times the weight and
        ``silu(z)``, projected back -> ``[S, B, H]``."""
        o = o.permute(2, 0, 1, 3)  # [S, B, nv, dv]
        S, B = o.shape[:2]
        z = z.reshape(S, B, self.nv, self.dv)
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.norm_weight * normed.to(dtype)).to(o.dtype) * F.silu(z.to(o.dtype))
        return self.out_proj(out.to(dtype).reshape(S, B, self.nv * self.dv))


def recurrent_parameters(config: ModelConfig, conv_parts: list[int], heads: int, tp_group: Group,
                         sequence_parallel: bool, *, seed: int, name: str) -> tuple:
    """What Gated DeltaNet and KDA hold alike: the conv weight ``[sum(conv_parts), K]``
    (channels split by ``conv_parts`` over tp), ``A_log [heads]`` (split over tp), the
    output norm's weight ``[dv]`` (shared by every head: its grad is partial over tp) and
    the output projection ``[H, heads*dv]``."""
    tp, rank = group_size(tp_group), group_rank(tp_group)
    K = config.linear_conv_kernel
    conv = global_normal([sum(conv_parts), K], K ** -0.5, init_seed(seed, f"{name}.conv"))
    conv_weight = mark(nn.Parameter(shard_tp(conv, 0, conv_parts, rank, tp)), "tp", 0, conv_parts)
    # Decay rates exp(A_log) spread over [1, 16], as Mamba2, Qwen3-Next and Kimi-Linear draw them.
    a = torch.rand(heads, generator=torch.Generator().manual_seed(init_seed(seed, f"{name}.A_log"))) * 15 + 1
    A_log = mark(nn.Parameter(shard_tp(a.log(), 0, [heads], rank, tp)), "tp", 0, [heads])
    norm_weight = mark(nn.Parameter(torch.ones(config.linear_value_head_dim)), "tp_sum")
    out_proj = RowParallelLinear(heads * config.linear_value_head_dim, config.hidden_size, tp_group,
                                 sequence_parallel, std=config.init_std, seed=init_seed(seed, f"{name}.out_proj"))
    return conv_weight, A_log, norm_weight, out_proj


def conv_delta_rule(qkv: torch.Tensor, conv_weight: torch.Tensor, conv: Callable, heads: Callable, rule: Callable,
                    chunk_size: int, docs: Optional[Documents], cp_group: Group,
                    cache: Optional[LayerCache]) -> torch.Tensor:
    """The recurrent core of Gated DeltaNet and KDA: the depthwise causal conv ``conv``
    (:func:`moe_fold.kernels.short_conv.short_conv`'s choice, SiLU included) of
    ``qkv [S_local, B, C]`` (``conv_weight [C, K]``), then the delta rule ``rule``
    (:func:`moe_fold.kernels.delta_rule.delta_rule`'s choice) on ``heads(conv) -> (q, k, v,
    g, beta)`` (:func:`~moe_fold.kernels.delta_rule.torch_delta_rule`'s arguments) ->
    ``o [B, heads, S_local, dv]``. Over this rank's cp segments with packed documents reset,
    or, when sampling (``cache``), continuing from the cache."""
    if cache is not None:
        return _decode_recurrence(qkv, conv_weight, conv, cache, heads, rule, chunk_size)
    group = cp_group if docs is None else docs.cp_group
    doc_ids = None if docs is None else docs.doc_ids  # [B, S_seq], natural order
    segments = local_segments(qkv.shape[0], group)
    starts = [None] * len(segments) if doc_ids is None else docs.starts
    out = segment_conv(qkv, conv_weight, None, conv, segments, doc_ids, group)
    return _segment_delta_rule(*heads(out), segments, starts, group, rule, chunk_size)


def _decode_recurrence(qkv: torch.Tensor, conv_weight: torch.Tensor, conv: Callable, cache: LayerCache,
                       heads: Callable, rule: Callable, chunk_size: int) -> torch.Tensor:
    """Sampling: the new tokens ``qkv [S, B, C]`` (their first ``cache.new_tokens`` real, the
    rest a decode step's padding) continue from the cache's conv window ``[K-1, B, C]`` and
    state ``[B, heads, dk, dv]`` (zeros before the first step), which they replace with
    those after the real tokens. ``heads(conv)``: the real tokens' ``q, k, v, g, beta`` from
    their conv output. Returns ``o [B, heads, S, dv]``, zeros for the padding."""
    n, K = cache.new_tokens, conv_weight.shape[1]
    real = qkv[:n]
    out = conv(real, conv_weight, None, cache.conv)
    cache.conv = _tail(real if cache.conv is None else torch.cat([cache.conv, real]), K - 1)
    o, cache.state = rule(*heads(out), initial_state=cache.state, chunk_size=chunk_size)
    return F.pad(o, (0, 0, 0, qkv.shape[0] - n))


def segment_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], conv: Callable,
                 segments: list, doc_ids: Optional[torch.Tensor], group: Group) -> torch.Tensor:
    """``conv`` (the causal conv with ``weight [C, K]`` and ``bias [C]`` or None, then SiLU)
    of each local segment of ``x [S, B, C]``, its window reaching into the segment before
    (another rank's under cp), never across a document start."""
    K = weight.shape[1]
    tails = torch.stack([_tail(x[lo:hi], K - 1) for lo, hi, _ in segments])  # [n, K-1, B, C]
    histories = conv_histories(tails, group)
    outs = []
    for (lo, hi, index), history in zip(segments, histories):
        ids = None if doc_ids is None else _window_ids(doc_ids, index * (hi - lo), hi - lo, K - 1)
        outs.append(conv(x[lo:hi], weight, bias, history, ids))
    return torch.cat(outs, dim=0)


def _segment_delta_rule(q, k, v, g, beta, segments: list, starts: list, group: Group, rule: Callable,
                        chunk_size: int) -> torch.Tensor:
    """The gated delta rule (``g`` per head or per key channel) over this rank's segments
    (``starts``: each one's :class:`~moe_fold.parallel.varlen.SequenceStarts`, or None), each
    from the state the segments before it leave (a prefix scan over cp) ->
    ``o [B, heads, S_local, dv]``."""
    parts = [tuple(t[:, :, lo:hi] for t in (q, k, v, g, beta)) for lo, hi, _ in segments]
    if group_size(group) == 1:
        return rule(*parts[0], starts=starts[0], chunk_size=chunk_size)[0]
    dk = q.shape[-1]
    eye = torch.eye(dk, dtype=q.dtype, device=q.device).expand(q.shape[0], q.shape[1], -1, -1)
    writes, transitions = [], []
    for (qs, ks, vs, gs, bs), seqs in zip(parts, starts):
        writes.append(rule(qs, ks, vs, gs, bs, seqs, chunk_size=chunk_size)[1])
        # The map's linear part: the end state from the identity, nothing written.
        zero_v = vs.new_zeros(*vs.shape[:-1], dk)
        transitions.append(rule(qs, ks, zero_v, gs, bs, seqs, eye, chunk_size)[1])
    states = start_states(torch.stack(transitions), torch.stack(writes), group)
    return torch.cat([rule(*p, starts=seqs, initial_state=state, chunk_size=chunk_size)[0]
                      for p, seqs, state in zip(parts, starts, states)], dim=2)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the head dim, as fla and Qwen3-Next do."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _tail(x: torch.Tensor, n: int) -> torch.Tensor:
    """The last ``n`` rows of ``x [S, ...]``, zero-padded in front when S < n."""
    if x.shape[0] >= n:
        return x[x.shape[0] - n:]
    return torch.cat([x.new_zeros(n - x.shape[0], *x.shape[1:]), x])


def _window_ids(doc_ids: torch.Tensor, start: int, length: int, back: int) -> torch.Tensor:
    """Documents of positions ``start-back .. start+length-1`` ``[B, back+length]``;
    positions before the sequence get ids of their own (-1, -2, ...), no document's."""
    before = max(0, back - start)
    ids = doc_ids[:, start - back + before:start + length]
    if before:
        own = -torch.arange(before, 0, -1, device=doc_ids.device).expand(doc_ids.shape[0], -1)
        ids = torch.cat([own, ids], dim=1)
    return ids

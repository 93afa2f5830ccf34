"""Kimi Delta Attention (KDA; Kimi-Linear): the gated delta rule with a decay per key
channel instead of one per head, as transformers' ``KimiDeltaAttention`` computes it.

Per token: q, k, v (``linear_num_key_heads`` heads of ``linear_key_head_dim``; KDA's
heads have one count and one width for all three) pass a depthwise causal conv1d and
SiLU; q and k are L2-normalised (q also scaled by ``dk**-0.5``); ``beta = sigmoid(b)``
with ``b`` one per head; the per-channel log-decay ``g = -exp(A_log[h]) * softplus(f +
dt_bias)`` with ``f = W_f_up W_f_down x`` a low-rank projection (rank ``dk``) to every
head's channels; the delta rule (:mod:`moe_fold.kernels.gated_delta`, its per-channel
form) runs; its output is RMS-normalised per head, times a weight and
``sigmoid(W_g_up W_g_down x)``, another low-rank projection (rank ``dv``), and projected
back.

Under tp each rank owns whole heads: the q|k|v|b projection, the up-projections, the
conv channels, ``A_log`` and ``dt_bias`` are split by heads, and the down-projections
are replicated on this rank's tokens (as MLA's latents: the narrow latents are what the
up-projections gather under SP). Under cp and with packed documents the layer is Gated
DeltaNet's (:func:`~.gated_deltanet.conv_delta_rule`): the zigzag segments stay where
they are, conv windows and states pass along the segments in sequence order, and
document starts reset both. The per-channel decay keeps the state update affine in the
start state, which is what the cp prefix scan needs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_fold.comm import Group, group_rank, group_size
from moe_fold.config import ModelConfig, linear_heads_over_tp, require
from moe_fold.kernels.delta_rule import delta_rule
from moe_fold.kernels.short_conv import short_conv
from moe_fold.parallel.tensor_parallel import ColumnParallelLinear, ReplicatedLinear, init_seed, mark, shard_tp
from moe_fold.parallel.varlen import Documents

from .gated_deltanet import conv_delta_rule, l2_normalize, recurrent_parameters
from .kv_cache import LayerCache

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(nn.Module):
    """``x [S_local, B, H] -> [S_local, B, H]``, with nh heads of width d (dk = dv).

    Parameters (global shapes): ``in_proj.weight [3*nh*d + nh, H]`` (rows q|k|v|b),
    ``gates_down.weight [2*d, H]`` (rows: the decay's latent | the output gate's),
    ``decay_up.weight [nh*d, d]``, ``gate_up.weight [nh*d, d]``, ``conv_weight [3*nh*d, K]``
    (channels q|k|v), ``A_log [nh]``, ``dt_bias [nh*d]``, ``norm_weight [d]``,
    ``out_proj.weight [H, nh*d]``.
    """

    def __init__(self, config: ModelConfig, tp_group: Group, sequence_parallel: bool, *, seed: int, name: str,
                 cp_group: Group = None):
        super().__init__()
        tp = group_size(tp_group)
        nh = config.linear_num_key_heads
        require(linear_heads_over_tp, nh, config.linear_num_value_heads, tp)
        self.d = config.linear_key_head_dim
        self.nh = nh // tp  # local heads
        self.cp_group = cp_group
        self.eps = config.norm_eps
        self.chunk_size = config.linear_chunk_size
        self.rule = delta_rule(config.linear_backend, "kda")
        std, width = config.init_std, nh * self.d
        self.conv = short_conv(config.conv_backend, config.linear_conv_kernel, 3 * width // tp)
        self.in_proj = ColumnParallelLinear(config.hidden_size, [width, width, width, nh], tp_group,
                                            sequence_parallel, std=std, seed=init_seed(seed, f"{name}.in_proj"))
        self.gates_down = ReplicatedLinear(config.hidden_size, 2 * self.d, sequence_parallel, std=std,
                                           seed=init_seed(seed, f"{name}.gates_down"))
        self.decay_up = ColumnParallelLinear(self.d, width, tp_group, sequence_parallel, std=std,
                                             seed=init_seed(seed, f"{name}.decay_up"))
        self.gate_up = ColumnParallelLinear(self.d, width, tp_group, sequence_parallel, std=std,
                                            seed=init_seed(seed, f"{name}.gate_up"))
        self.conv_weight, self.A_log, self.norm_weight, self.out_proj = recurrent_parameters(
            config, [width] * 3, nh, tp_group, sequence_parallel, seed=seed, name=name)
        # Per channel: softplus(dt_bias) spread over [1e-3, 0.1] (log-uniform), as fla and
        # Kimi-Linear draw it, so that the state starts out remembering many tokens.
        gen = torch.Generator().manual_seed(init_seed(seed, f"{name}.dt_bias"))
        dt = torch.exp(torch.rand(width, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # the inverse of softplus
        self.dt_bias = mark(nn.Parameter(shard_tp(dt_bias, 0, [width], group_rank(tp_group), tp)), "tp", 0, [width])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Optional[Documents] = None,
                kv_cache: Optional[LayerCache] = None) -> torch.Tensor:
        """``x [S_local, B, H] -> [S_local, B, H]``, as attention is called (rotary ``cos``/``sin``
        unused); ``kv_cache`` (sampling, no cp): the conv window and state so far."""
        width = self.nh * self.d
        q, k, v, b = self.in_proj(x).split([width, width, width, self.nh], dim=-1)  # [S, B, .]
        f, gate = self.gates_down(x).split([self.d, self.d], dim=-1)  # [S_local, B, d] each
        f, gate = self.decay_up(f), self.gate_up(gate)  # [S, B, nh*d] each
        o = conv_delta_rule(torch.cat([q, k, v], dim=-1), self.conv_weight, self.conv,
                            lambda conv: self._heads(conv, b, f, x.dtype), self.rule, self.chunk_size,
                            docs, self.cp_group, kv_cache)  # [B, nh, S, d]
        return self._output(o, gate, x.dtype)

    def _heads(self, qkv: torch.Tensor, b: torch.Tensor, f: torch.Tensor, dtype: torch.dtype) -> tuple:
        """The conv's output ``qkv [S, B, 3*nh*d]``, ``b [S', B, nh]`` and the decay input
        ``f [S', B, nh*d]`` (S' >= S: a decode step's padding follows its S real tokens) ->
        ``q, k, v [B, nh, S, d]`` (q, k L2-normalised, q scaled), ``g [B, nh, S, d]``, ``beta [B, nh, S]``."""
        S, B = qkv.shape[:2]
        # The recurrence runs in float32 (float64 for a float64 model), as fla's kernels do.
        work = torch.float64 if dtype == torch.float64 else torch.float32
        q, k, v = (t.reshape(S, B, self.nh, self.d).to(work) for t in qkv.split(self.nh * self.d, dim=-1))
        q, k = l2_normalize(q) * self.d ** -0.5, l2_normalize(k)
        beta = b[:S].to(work).sigmoid()  # [S, B, nh]
        decay = F.softplus(f[:S].to(work) + self.dt_bias).reshape(S, B, self.nh, self.d)
        g = -self.A_log.to(work).exp()[:, None] * decay  # [S, B, nh, d]: a log-decay per channel
        q, k, v, g = (t.permute(1, 2, 0, 3) for t in (q, k, v, g))  # [B, nh, S, d]
        return q, k, v, g, beta.permute(1, 2, 0)

    def _output(self, o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``o [B, nh, S, d]`` RMS-normalised per head, times the weight and ``sigmoid(gate)``
        (all in the recurrence's precision, as transformers' gated norm), projected back -> ``[S, B, H]``."""
        o = o.permute(2, 0, 1, 3)  # [S, B, nh, d]
        S, B = o.shape[:2]
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.norm_weight.to(o.dtype) * normed * gate.reshape(S, B, self.nh, self.d).to(o.dtype).sigmoid()
        return self.out_proj(out.to(dtype).reshape(S, B, self.nh * self.d))

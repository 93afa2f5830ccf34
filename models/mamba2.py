"""Mamba2 (Dao and Gu 2024) as Nemotron-H uses it: a state-space mixer with a recurrent
state per head.

Per token: one projection gives the output gate z and x (``mamba_num_heads`` heads of
``mamba_head_dim``), B and C (``mamba_num_groups`` groups of ``mamba_state_size``) and
the step input dt (one per head); x|B|C pass a depthwise causal conv1d with a bias and
SiLU; ``dt = max(softplus(dt + dt_bias), mamba_dt_min)``, the log-decay ``dt * A`` with
``A = -exp(A_log)``; the SSD recurrence (:mod:`moe_fold.kernels.ssd`) runs on ``x * dt``
with a group's B and C serving its ``heads / groups`` consecutive heads, plus the skip
``D x``; its output times ``silu(z)`` is RMS-normalised per group, times a weight, and
projected back.

Under tp each rank owns whole groups with their heads (every part of the input
projection, the conv channels, ``A_log``, ``D``, ``dt_bias`` and the norm weight are
split the same way); the recurrence and the norm are per head and per group, so they
need no tp communication. Under cp the layer keeps the zigzag split and passes conv
windows and states along the segments in sequence order
(:mod:`moe_fold.parallel.recurrent_cp`). Packed documents reset the conv window and the
state at every document start.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_fold.comm import Group, group_rank, group_size
from moe_fold.config import ModelConfig, mamba_groups_over_tp, require
from moe_fold.kernels.short_conv import short_conv
from moe_fold.kernels.ssd import chunk_ssd, ssd_decay
from moe_fold.kernels.ssd_scan import ssd_scan
from moe_fold.parallel.recurrent_cp import local_segments, start_states
from moe_fold.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, global_normal, init_seed, mark, shard_tp,
)
from moe_fold.parallel.varlen import Documents

from .gated_deltanet import _tail, segment_conv
from .kv_cache import LayerCache


class Mamba2(nn.Module):
    """``x [S_local, B, H] -> [S_local, B, H]``.

    Parameters (global shapes, ``I = heads * head_dim``, ``GN = groups * state_size``):
    ``in_proj.weight [2I + 2GN + heads, H]`` (rows z|x|B|C|dt), ``conv_weight [I + 2GN, K]``
    and ``conv_bias [I + 2GN]`` (channels x|B|C), ``A_log``, ``D``, ``dt_bias [heads]``,
    ``norm_weight [I]``, ``out_proj.weight [H, I]``.
    """

    def __init__(self, config: ModelConfig, tp_group: Group, sequence_parallel: bool, *, seed: int, name: str,
                 cp_group: Group = None):
        super().__init__()
        tp, rank = group_size(tp_group), group_rank(tp_group)
        require(mamba_groups_over_tp, config.mamba_num_groups, tp)
        heads, groups = config.mamba_num_heads, config.mamba_num_groups
        self.P, self.N = config.mamba_head_dim, config.mamba_state_size
        self.heads, self.groups = heads // tp, groups // tp  # local
        self.cp_group = cp_group
        self.eps = config.norm_eps
        self.chunk_size = config.mamba_chunk_size
        self.dt_min = config.mamba_dt_min
        self.scan = ssd_scan(config.mamba_backend)
        inner, bc = heads * self.P, groups * self.N
        self.in_proj = ColumnParallelLinear(config.hidden_size, [inner, inner, bc, bc, heads], tp_group,
                                            sequence_parallel, std=config.init_std,
                                            seed=init_seed(seed, f"{name}.in_proj"))
        conv_parts = [inner, bc, bc]
        K = config.mamba_conv_kernel
        conv = global_normal([sum(conv_parts), K], K ** -0.5, init_seed(seed, f"{name}.conv"))
        self.conv_weight = mark(nn.Parameter(shard_tp(conv, 0, conv_parts, rank, tp)), "tp", 0, conv_parts)
        self.conv_bias = mark(nn.Parameter(torch.zeros(sum(conv_parts) // tp)), "tp", 0, conv_parts)
        self.conv = short_conv(config.conv_backend, K, sum(conv_parts) // tp)
        # Decay rates exp(A_log) spread over [1, 16], as Mamba2 draws them.
        gen = torch.Generator().manual_seed(init_seed(seed, f"{name}.A_log"))
        a = torch.rand(heads, generator=gen) * 15 + 1
        self.A_log = mark(nn.Parameter(shard_tp(a.log(), 0, [heads], rank, tp)), "tp", 0, [heads])
        self.D = mark(nn.Parameter(torch.ones(heads // tp)), "tp", 0, [heads])
        # Initial steps log-uniform in [dt_min, dt_max] (floored at 1e-4), dt_bias their softplus^-1.
        gen = torch.Generator().manual_seed(init_seed(seed, f"{name}.dt_bias"))
        lo, hi = math.log(config.mamba_dt_min), math.log(config.mamba_dt_max)
        dt = (torch.rand(heads, generator=gen) * (hi - lo) + lo).exp().clamp(min=1e-4)
        dt_bias = dt + torch.log(-torch.expm1(-dt))
        self.dt_bias = mark(nn.Parameter(shard_tp(dt_bias, 0, [heads], rank, tp)), "tp", 0, [heads])
        self.norm_weight = mark(nn.Parameter(torch.ones(inner // tp)), "tp", 0, [inner])
        self.out_proj = RowParallelLinear(inner, config.hidden_size, tp_group, sequence_parallel,
                                          std=config.init_std, seed=init_seed(seed, f"{name}.out_proj"))

    def _split(self, x: torch.Tensor) -> tuple:
        inner, bc = self.heads * self.P, self.groups * self.N
        z, xbc, dt = self.in_proj(x).split([inner, inner + 2 * bc, self.heads], dim=-1)
        return z, xbc, dt

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Optional[Documents] = None,
                kv_cache: Optional[LayerCache] = None) -> torch.Tensor:
        """``x [S_local, B, H] -> [S_local, B, H]``, as attention is called (rotary ``cos``/``sin``
        unused: the recurrence orders tokens itself). ``kv_cache`` (sampling, no cp): the
        conv window and recurrent state the tokens before these left (:meth:`_decode`)."""
        z, xbc, dt = self._split(x)
        if kv_cache is not None:
            return self._output(self._decode(xbc, dt, kv_cache), z, x.dtype)
        group = self.cp_group if docs is None else docs.cp_group
        doc_ids = None if docs is None else docs.doc_ids  # [B, S_seq], natural order
        segments = local_segments(xbc.shape[0], group)  # [S_local] gathered over tp under SP
        xbc = segment_conv(xbc, self.conv_weight, self.conv_bias, self.conv, segments, doc_ids,
                           group)  # [S, B, I + 2GN], through SiLU
        resets = [None] * len(segments) if doc_ids is None else [seqs.resets for seqs in docs.starts]
        y = self._recurrence(*self._heads(xbc, dt, x.dtype), segments, resets, group)  # [B, h, S, P]
        return self._output(y, z, x.dtype)

    def _heads(self, xbc: torch.Tensor, dt: torch.Tensor, dtype: torch.dtype) -> tuple:
        """The conv's output ``xbc [S, B, I + 2GN]`` and ``dt [S, B, h]`` -> the scan's ``x``
        ``[B, h, S, P]``, step ``[B, h, S]``, ``A [h]``, ``b, c [B, g, S, N]`` (per group), and
        the skip ``D x [B, h, S, P]``."""
        inner, bc = self.heads * self.P, self.groups * self.N
        xs, b, c = xbc.split([inner, bc, bc], dim=-1)
        S, B = xs.shape[:2]
        # The recurrence runs in float32 (float64 for a float64 model), as mamba-ssm's kernels do.
        work = torch.float64 if dtype == torch.float64 else torch.float32
        xs = xs.reshape(S, B, self.heads, self.P).permute(1, 2, 0, 3).to(work)  # [B, h, S, P]
        b, c = (t.reshape(S, B, self.groups, self.N).permute(1, 2, 0, 3).to(work) for t in (b, c))  # [B, g, S, N]
        step = F.softplus(dt.to(work) + self.dt_bias).clamp(min=self.dt_min).permute(1, 2, 0)  # [B, h, S]
        skip = self.D.to(work)[:, None, None] * xs
        return xs, step, -self.A_log.to(work).exp(), b, c, skip

    def _output(self, y: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The recurrence's ``y [B, h, S, P]`` times ``silu(z)``, RMS-normalised per group,
        times the weight, projected back -> ``[S, B, H]``."""
        S, B = y.shape[2], y.shape[0]
        gated = y.permute(2, 0, 1, 3).reshape(S, B, -1) * F.silu(z.to(y.dtype))  # [S, B, I/tp]
        per_group = gated.reshape(S, B, self.groups, -1)
        normed = per_group * torch.rsqrt(per_group.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.norm_weight * normed.reshape(S, B, -1).to(dtype)
        return self.out_proj(out)

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """Sampling: the new tokens ``xbc [S, B, I + 2GN]`` (their first ``cache.new_tokens``
        real, the rest a decode step's padding) continue from the cache's conv window
        ``[K-1, B, C]`` and state ``[B, h, N, P]`` (zeros before the first step), which they
        replace with those after the real tokens. The padding's outputs are zeros."""
        n, K = cache.new_tokens, self.conv_weight.shape[1]
        real = xbc[:n]
        conv = self.conv(real, self.conv_weight, self.conv_bias, cache.conv)
        cache.conv = _tail(real if cache.conv is None else torch.cat([cache.conv, real]), K - 1)
        xs, step, A, b, c, skip = self._heads(conv, dt[:n], xbc.dtype)
        y, cache.state = self.scan(xs, step, A, b, c, initial_state=cache.state, chunk_size=self.chunk_size)
        return F.pad(y + skip, (0, 0, 0, xbc.shape[0] - n))  # [B, h, S, P]

    def _recurrence(self, xs, step, A, b, c, skip, segments: list, resets: list, group: Group) -> torch.Tensor:
        """The SSD over this rank's segments (``resets``: each one's document starts, or
        None), each from the state the segments before it leave (a prefix scan over cp, in
        torch), plus the skip."""
        if group_size(group) == 1:
            return self.scan(xs, step, A, b, c, resets=resets[0], chunk_size=self.chunk_size)[0] + skip
        # A group's B and C serve heads / groups consecutive heads.
        b, c = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (b, c))  # [B, h, S, N]
        xs, g = xs * step.unsqueeze(-1), A[:, None] * step
        parts = [tuple(t[:, :, lo:hi] for t in (xs, g, b, c)) for lo, hi, _ in segments]
        eye = torch.eye(self.N, dtype=xs.dtype, device=xs.device)
        writes, transitions = [], []
        for p, r in zip(parts, resets):
            writes.append(chunk_ssd(*p, resets=r, chunk_size=self.chunk_size)[1])  # [B, h, N, P]
            # The map's linear part is a scalar per head: the segment's whole decay.
            transitions.append(ssd_decay(p[1], r)[..., None, None] * eye)  # [B, h, N, N]
        starts = start_states(torch.stack(transitions), torch.stack(writes), group)
        return torch.cat([chunk_ssd(*p, resets=r, initial_state=s, chunk_size=self.chunk_size)[0]
                          for p, r, s in zip(parts, resets, starts)], dim=2) + skip

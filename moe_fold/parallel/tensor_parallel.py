"""Tensor-parallel layers with Megatron semantics, sequence parallel included.

Layout. Activations are sequence-first, ``[S, B, H]``, or the same flattened to tokens
``[S*B, H]``; dim 0 is always the sequence (token) dim. Under sequence parallel (SP) the
activations between TP regions are sharded along dim 0 over the tp group: rank r holds
rows ``[r*S/tp, (r+1)*S/tp)``. Sequence-first is what makes a rank's shard one contiguous
block, so flattening it to ``[S/tp*B, H]`` for the MoE layer is a view, and the all-gather
of flattened tokens gives the flattened full sequence.

- :class:`ColumnParallelLinear`: output features split over tp. Enters the TP region:
  all-gather of the sequence under SP, ``copy_to_tp_region`` otherwise.
- :class:`ReplicatedLinear`: the whole weight on every rank, on this rank's tokens.
- :class:`RowParallelLinear`: input features split over tp. Leaves the TP region:
  reduce-scatter to the sequence shard under SP, ``reduce_from_tp_region`` otherwise.
- :class:`VocabParallelEmbedding`: vocabulary rows split over tp; leaves the region the
  same way as a row-parallel linear.
- :func:`vocab_parallel_cross_entropy`: the loss from vocab-sharded logits, never
  gathering the full logits.

Weights. Every weight is drawn as the GLOBAL tensor from a seed of its own
(:func:`init_seed` of the run seed and the parameter's name) and then sliced, so any
tp layout holds slices of the very same global weights and a layout can be compared
number for number with one process. Materialising the global tensor on every rank costs
memory only at init and only one parameter at a time; loading real checkpoints slices the
same way (:func:`shard_tp`).

Every parameter carries ``param.parallel`` (what :mod:`moe_fold.training.grads` reads):
``"tp"`` sharded over tp; ``"replicated"`` the same on every tp rank with the same grad;
``"tp_sum"`` the same on every tp rank but each rank's grad is a partial sum to be added
over tp (under SP each rank saw a different sequence shard; a per-head norm saw
different heads); ``"expert"`` expert weights (sharded over ep x etp, replicated over edp).
A ``"tp"`` parameter also carries ``tp_dim`` (the split dim) and ``tp_parts`` (the global
sizes of the fused parts along it, see :func:`shard_tp`).
"""

from __future__ import annotations

import zlib
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from moe_fold.comm import (
    Group, all_reduce, copy_to_tp_region, gather_from_sequence_region, group_rank, group_size,
    reduce_from_tp_region, reduce_scatter_to_sequence_region,
)
from moe_fold.config import require, vocab_over_tp

__all__ = [
    "PARALLEL_KINDS", "init_seed", "global_normal", "mark", "shard_tp", "unshard_tp",
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
]

PARALLEL_KINDS = ("tp", "replicated", "tp_sum", "expert")


def init_seed(seed: int, name: str) -> int:
    """A seed for the parameter ``name`` of a run seeded ``seed``.

    crc32, not ``hash``: Python salts string hashes per process, and every rank must
    derive the same number."""
    return zlib.crc32(f"{seed}/{name}".encode())


def global_normal(shape: Sequence[int], std: float, seed: int) -> torch.Tensor:
    """The global ``N(0, std)`` tensor of ``shape`` for ``seed`` (float32, CPU)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=gen) * std


def mark(param: nn.Parameter, parallel: str, tp_dim: Optional[int] = None,
         tp_parts: Optional[Sequence[int]] = None) -> nn.Parameter:
    """Set ``param.parallel`` (one of :data:`PARALLEL_KINDS`) and, for ``"tp"``, the split."""
    if parallel not in PARALLEL_KINDS:
        raise ValueError(f"parallel={parallel!r} must be one of {', '.join(PARALLEL_KINDS)}")
    if parallel == "tp" and (tp_dim is None or tp_parts is None):
        raise ValueError(f"parallel='tp' needs tp_dim and tp_parts (got tp_dim={tp_dim}, tp_parts={tp_parts})")
    param.parallel = parallel
    if parallel == "tp":
        param.tp_dim = tp_dim
        param.tp_parts = list(tp_parts)
    return param


def _parts(sizes: Union[int, Sequence[int]]) -> list[int]:
    return [int(sizes)] if isinstance(sizes, int) else [int(s) for s in sizes]


def shard_tp(full: torch.Tensor, dim: int, parts: Sequence[int], rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` split over ``size`` tp ranks along ``dim``.

    ``full`` along ``dim`` is the concatenation of fused parts of sizes ``parts`` (q|k|v,
    gate|up; one part for a plain linear). Each part is split on its own, so the shard is
    ``[part0 chunk r, part1 chunk r, ...]``: a rank owns whole heads of q with their k and
    v heads, and matching halves of gate and up.
    """
    parts = _parts(parts)
    if sum(parts) != full.shape[dim]:
        raise ValueError(f"parts={parts} sum to {sum(parts)} but the tensor has {full.shape[dim]} along dim {dim}")
    for p in parts:
        if p % size:
            raise ValueError(f"a part of size {p} (parts={parts}) is not divisible by tp={size}")
    chunks = [part.chunk(size, dim)[rank] for part in full.split(parts, dim)]
    return torch.cat(chunks, dim).contiguous()


def unshard_tp(shards: Sequence[torch.Tensor], dim: int, parts: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`shard_tp`: the global tensor from every tp rank's shard, in rank order."""
    parts = _parts(parts)
    size = len(shards)
    local = [p // size for p in parts]
    per_rank = [s.split(local, dim) for s in shards]
    return torch.cat([torch.cat([pieces[i] for pieces in per_rank], dim) for i in range(len(parts))], dim)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with W's output features (and b) split over tp.

    ``out_features`` is an int or the sizes of fused parts (see :func:`shard_tp`); the
    local output is this rank's chunk of each part, concatenated. ``weight`` reuses an
    existing parameter of the same split (tied LM head = the vocab-parallel embedding).
    ``bias`` (zeros at init) is for Qwen2's q|k|v projection.
    Input ``[S_local, ..., in]`` (``S_local = S/tp`` under SP, else S);
    output ``[S, ..., sum(parts)/tp]``.
    """

    def __init__(self, in_features: int, out_features: Union[int, Sequence[int]], tp_group: Group,
                 sequence_parallel: bool, *, std: float, seed: int, weight: Optional[nn.Parameter] = None,
                 bias: bool = False):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        parts = _parts(out_features)
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if weight is None:
            full = global_normal((sum(parts), in_features), std, seed)  # [out, in]
            weight = mark(nn.Parameter(shard_tp(full, 0, parts, rank, tp)), "tp", 0, parts)
        elif tuple(weight.shape) != (sum(parts) // tp, in_features):
            raise ValueError(f"shared weight has shape {tuple(weight.shape)}, expected "
                             f"{(sum(parts) // tp, in_features)} (out_features={parts} over tp={tp})")
        self.weight = weight  # [out/tp, in]
        self.bias = mark(nn.Parameter(torch.zeros(sum(parts) // tp)), "tp", 0, parts) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.tp_group, dim=0)  # [S/tp, ...] -> [S, ...]
        else:
            x = copy_to_tp_region(x, self.tp_group)
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(nn.Module):
    """``y = x W^T`` with the whole W on every tp rank, run on this rank's tokens (its
    sequence shard under SP): a narrow down-projection (MLA's latents, KDA's low-rank
    gates) whose output a column-parallel linear then gathers, instead of the hidden
    states. Its grad is partial over tp under SP (``tp_sum``: the ranks saw different
    tokens) and whole without SP (``replicated``), the rule of the block norms."""

    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool, *, std: float, seed: int):
        super().__init__()
        weight = global_normal((out_features, in_features), std, seed)  # [out, in]
        self.weight = mark(nn.Parameter(weight), "tp_sum" if sequence_parallel else "replicated")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with W's input features split over tp; the partial outputs
    are summed over tp. Input ``[S, ..., in/tp]``; output ``[S_local, ..., out]``.
    ``bias`` (zeros at init; gpt-oss's attention output) is added once, after the sum; it
    is replicated over tp, and under SP each rank's grad covers its own tokens (``tp_sum``)."""

    def __init__(self, in_features: int, out_features: int, tp_group: Group, sequence_parallel: bool,
                 *, std: float, seed: int, bias: bool = False):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        full = global_normal((out_features, in_features), std, seed)  # [out, in]
        local = shard_tp(full, 1, [in_features], group_rank(tp_group), group_size(tp_group))
        self.weight = mark(nn.Parameter(local), "tp", 1, [in_features])  # [out, in/tp]
        self.bias = None
        if bias:
            self.bias = mark(nn.Parameter(torch.zeros(out_features)), "tp_sum" if sequence_parallel else "replicated")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # partial sum over this rank's input features
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.tp_group, dim=0)  # [S, ...] -> [S/tp, ...]
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split over tp (rank r owns ids
    ``[r*V/tp, (r+1)*V/tp)``). Input ids ``[S, B]``; output ``[S_local, B, H]``."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_group: Group, sequence_parallel: bool,
                 *, std: float, seed: int):
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        require(vocab_over_tp, vocab_size, group_size(tp_group))
        full = global_normal((vocab_size, hidden_size), std, seed)  # [V, H]
        local = shard_tp(full, 0, [vocab_size], group_rank(tp_group), group_size(tp_group))
        self.weight = mark(nn.Parameter(local), "tp", 0, [vocab_size])  # [V/tp, H]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - group_rank(self.tp_group) * rows
        outside = (local < 0) | (local >= rows)
        # Ids owned by another rank contribute zeros here; the sum over tp fills them in.
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [S, B, H]
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(x, self.tp_group, dim=0)  # -> [S/tp, B, H]
        return reduce_from_tp_region(x, self.tp_group)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Group) -> torch.Tensor:
    """Per-token cross-entropy from logits whose last dim is this rank's vocab shard.

    ``logits [..., V/tp]`` (rank r holds ids ``[r*V/tp, (r+1)*V/tp)``), ``target [...]`` of
    global ids; returns ``[...]`` float32, the same on every tp rank. Only two ``[...]``
    tensors and the max cross the tp group: the max and the sum of exponentials are
    reduced over tp and the target logit is taken on the rank that owns it. A target
    outside ``[0, V)`` (e.g. -100 on padding) owns no logit and gives a finite value
    without meaning: mask such tokens out of the loss.

    Backward: ``reduce_from_tp_region`` is the identity backward, so each rank gets
    ``softmax - onehot`` on its own shard, the gradient of the one loss all ranks share.
    """
    logits = logits.float()
    vocab_local = logits.shape[-1]
    # The max only keeps exp() in range; any constant gives the same loss and gradient.
    peak = all_reduce(logits.detach().amax(dim=-1, keepdim=True), tp_group, op="max")  # [..., 1]
    shifted = logits - peak
    local = target - group_rank(tp_group) * vocab_local
    inside = (local >= 0) & (local < vocab_local)
    picked = shifted.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)  # [...]
    picked = reduce_from_tp_region(picked.masked_fill(~inside, 0.0), tp_group)
    sum_exp = reduce_from_tp_region(shifted.exp().sum(dim=-1), tp_group)  # [...]
    return sum_exp.log() - picked

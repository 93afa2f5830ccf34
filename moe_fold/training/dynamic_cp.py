"""Dynamic context parallelism: per micro-batch, split the cp group into sub-groups sized
for its documents.

Static cp cuts every packed sequence over the whole cp group, so a short document pays
the ring's K/V traffic over all cp ranks, and each rank's share of the causal work
depends on where the documents happen to fall. Dynamic cp takes the documents a cp group
processes in one micro-batch (whole documents or loader pieces; padding dropped) and
picks:

- a partition of the group's ``cp`` ranks into aligned sub-groups whose sizes are powers
  of two (``[0, cp)`` whole, or its two halves each partitioned the same way; the
  torch groups of every such block are made once at start, :class:`DynamicCP`), and
- an assignment of documents to sub-groups,

minimising the largest per-rank cost of :class:`CostModel` subject to a memory capacity
in tokens per rank. A sub-group of size ``c`` concatenates its documents, pads to a
multiple of ``2c`` and runs ring (or a2a) attention with document masks over its zigzag
shards (:mod:`moe_fold.parallel.varlen`); a sub-group of one rank runs varlen attention locally.
Everything else in a layer is token-wise, so each rank runs it on whatever tokens it
holds; the MoE dispatcher handles unequal token counts, and the router's counts are
summed over the whole cp group, which holds exactly the micro-batch's tokens as under
static cp.

Gradients: the loss of each rank is ``sum(token losses) * dp*cp / N`` with ``N`` the
global count of loss tokens (:func:`moe_fold.training.step.forward_backward`), so the grads
averaged over dp x cp equal one process's. TP (sequence parallel needs equal shards per
tp group) and pp (one activation shape per stage boundary) are not combined with
dynamic cp; :func:`check_dynamic_cp` says so.

Every rank of a cp group computes the same plan from the same document lengths, so
planning needs no communication.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from moe_fold.comm import Group
from moe_fold.config import Config, dynamic_cp_layout, head_dim, mla_weight_shapes, moe_layer_flags, require
from moe_fold.parallel.context_parallel import zigzag_split
from moe_fold.data.loader import Batch
from moe_fold.layout import ParallelLayout, ProcessGroups
from moe_fold.parallel.varlen import Documents, sequence_starts

__all__ = ["CostModel", "cost_model", "SubGroup", "Plan", "partitions", "schedule", "static_plan", "group_pair_counts",
           "zigzag_pair_counts",
           "check_dynamic_cp", "documents_of", "DynamicCP"]



@dataclass(frozen=True)
class CostModel:
    """Per-rank cost of running documents on a sub-group, in FLOP-equivalents per layer.

    A sub-group of ``c`` ranks holding documents of lengths ``L_d`` (``T = sum L_d``):

    - attention: ``pair_flops`` per causal query-key pair inside a document, charged to the
      rank holding the query; spread evenly that is ``pair_flops * sum_d L_d (L_d+1)/2 / c``
      (:meth:`rank_cost`, what the assignment search uses), exactly it is the pairs of the
      rank's zigzag chunks of the group's padded sequence (:meth:`group_costs`, what plans
      are compared and reported by);
    - the rest of the layer: ``token_flops * T / c`` (projections, MLP/MoE: per token);
    - ring traffic: ``kv_token_cost * (c - 1) * T / c`` (each rank receives every other
      rank's K/V shard once per forward).

    ``pair_flops = 4 * num_heads * head_dim`` for q.k and p.v (2 FLOPs per multiply-add;
    MLA: ``2 * num_heads * (qk_nope + qk_rope + v_head_dim)``);
    ``kv_token_cost`` converts one token's K/V bytes into FLOPs at the machine's
    FLOP/byte ratio of compute to link bandwidth (0: communication is free).
    """

    pair_flops: float
    token_flops: float = 0.0
    kv_token_cost: float = 0.0

    def attention_flops(self, lengths: Sequence[int]) -> float:
        return self.pair_flops * sum(n * (n + 1) / 2 for n in lengths)

    def rank_cost(self, lengths: Sequence[int], c: int) -> float:
        tokens = sum(lengths)
        return (self.attention_flops(lengths) + self.token_flops * tokens
                + self.kv_token_cost * (c - 1) * tokens) / c

    def group_costs(self, lengths: Sequence[int], c: int) -> list[float]:
        """Exact cost of each of the ``c`` ranks when documents ``lengths`` (in this order)
        are concatenated, padded to a multiple of ``2c`` and zigzag-split."""
        pairs = group_pair_counts(lengths, c)
        tokens = _padded(sum(lengths), c)
        rest = (self.token_flops * tokens + self.kv_token_cost * (c - 1) * tokens) / c
        return [self.pair_flops * p + rest for p in pairs]


def cost_model(config: Config) -> CostModel:
    """The cost model of ``config``'s layers, averaged over layers: attention pairs, the
    projections and the (routed + shared, or dense) MLP per token, and ring K/V bytes at
    ``parallel.dynamic_cp_flops_per_byte``."""
    m, moe = config.model, config.moe
    if m.attention == "mla":
        # Per head q.k over nope + rope, p.v over v; K/V of every head travel the ring.
        qk, v = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim), m.num_heads * m.v_head_dim
        pair_flops, kv_width = 2.0 * (qk + v), qk + v
        projections = sum(2 * rows * cols for rows, cols in mla_weight_shapes(m).values())
    else:
        hd = head_dim(config)
        q, kv = m.num_heads * hd, m.num_kv_heads * hd
        pair_flops, kv_width = 4.0 * q, 2 * kv
        projections = 2 * m.hidden_size * (q + 2 * kv) + 2 * q * m.hidden_size
    flags = moe_layer_flags(config)
    moe_width = moe.topk * moe.ffn_hidden_size + moe.shared_expert_ffn_hidden_size
    mlp = sum(6 * m.hidden_size * (moe_width if f else m.ffn_hidden_size) for f in flags) / len(flags)
    element = 4 if config.train.precision == "fp32" else 2
    return CostModel(pair_flops=pair_flops, token_flops=float(projections + mlp),
                     kv_token_cost=kv_width * element * config.parallel.dynamic_cp_flops_per_byte)


def group_pair_counts(lengths: Sequence[int], c: int) -> list[int]:
    """Causal same-document query-key pairs of each rank when documents ``lengths`` are
    concatenated, padded to a multiple of ``2c`` (the padding one more document) and
    zigzag-split over ``c`` ranks."""
    total = sum(lengths)
    pad = _padded(total, c) - total
    runs = list(lengths) + ([pad] if pad else [])
    # Query t of a document sees the t+1 tokens of the document up to itself.
    pairs = np.concatenate([np.arange(1, n + 1) for n in runs])
    if c == 1:
        return [int(pairs.sum())]
    chunks = pairs.reshape(2 * c, -1).sum(axis=1)
    return [int(chunks[r] + chunks[2 * c - 1 - r]) for r in range(c)]


@dataclass(frozen=True)
class SubGroup:
    start: int  # first cp rank of the block
    size: int  # ranks in the block, a power of two
    docs: tuple[int, ...]  # indices of its documents, in the order they are concatenated

    def padded_tokens(self, lengths: Sequence[int]) -> int:
        """The group's sequence length: its documents, padded to a multiple of ``2*size`` for
        the zigzag split (no padding on one rank)."""
        return _padded(sum(lengths[d] for d in self.docs), self.size)


@dataclass(frozen=True)
class Plan:
    """Sub-groups covering the cp ranks, with per-rank cost and tokens (padding included)."""

    subgroups: tuple[SubGroup, ...]
    rank_cost: tuple[float, ...]
    rank_tokens: tuple[int, ...]

    def subgroup_of(self, cp_rank: int) -> SubGroup:
        for g in self.subgroups:
            if g.start <= cp_rank < g.start + g.size:
                return g
        raise ValueError(f"cp_rank={cp_rank} is in no sub-group of {self.subgroups}")


def _padded(tokens: int, c: int) -> int:
    return tokens if c == 1 else -(-tokens // (2 * c)) * (2 * c)


def _check_cp(cp: int) -> None:
    require(dynamic_cp_layout, cp, 1, 1)


def partitions(cp: int, start: int = 0) -> list[tuple[tuple[int, int], ...]]:
    """Every partition of cp ranks ``[start, start+cp)`` into aligned power-of-two blocks,
    each a tuple of ``(start, size)``; the whole group first."""
    _check_cp(cp)
    if cp == 1:
        return [((start, 1),)]
    half = cp // 2
    return [((start, cp),)] + [a + b for a in partitions(half, start) for b in partitions(half, start + half)]


def _assign(lengths: Sequence[int], blocks: Sequence[tuple[int, int]], capacity: int,
            cost: CostModel) -> Optional[list[list[int]]]:
    """Longest-processing-time greedy: documents by decreasing length, each to the block
    whose per-rank cost grows least while its tokens per rank stay within ``capacity``.
    None when a document fits nowhere or a block is left empty (its ranks would idle)."""
    docs: list[list[int]] = [[] for _ in blocks]
    for d in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        best, best_cost = None, math.inf
        for j, (_, c) in enumerate(blocks):
            with_d = [lengths[i] for i in docs[j]] + [lengths[d]]
            if _padded(sum(with_d), c) // c > capacity:
                continue
            value = cost.rank_cost(with_d, c)
            if value < best_cost:
                best, best_cost = j, value
        if best is None:
            return None
        docs[best].append(d)
    if any(not ds for ds in docs):
        return None
    return [sorted(ds) for ds in docs]


def _zigzag_order(lengths: Sequence[int], docs: Sequence[int], c: int) -> tuple[int, ...]:
    """An order of a sub-group's documents that evens out its ranks' zigzag attention
    pairs: the best of the given order, increasing length, and increasing length with the
    longest document moved to each place (concatenated documents are not one causal ramp,
    so where the long one sits decides which ranks get its late, expensive queries)."""
    if c == 1 or len(docs) < 2:
        return tuple(docs)
    rising = sorted(docs, key=lambda d: (lengths[d], d))
    rest, longest = rising[:-1], rising[-1]
    candidates = [list(docs), rising] + [rest[:i] + [longest] + rest[i:] for i in range(len(rest))]
    return tuple(min(candidates, key=lambda order: max(group_pair_counts([lengths[d] for d in order], c))))


def _plan(lengths: Sequence[int], blocks: Sequence[tuple[int, int]], docs: Sequence[Sequence[int]],
          cost: CostModel, reorder: bool = True) -> Plan:
    subgroups = tuple(SubGroup(s, c, _zigzag_order(lengths, ds, c) if reorder else tuple(ds))
                      for (s, c), ds in zip(blocks, docs))
    rank_cost, rank_tokens = [], []
    for g in subgroups:
        rank_cost += cost.group_costs([lengths[d] for d in g.docs], g.size)
        rank_tokens += [g.padded_tokens(lengths) // g.size] * g.size
    return Plan(subgroups, tuple(rank_cost), tuple(rank_tokens))


def schedule(lengths: Sequence[int], cp: int, capacity: int, cost: CostModel) -> Plan:
    """The plan of least maximum exact per-rank cost (:meth:`CostModel.group_costs`; then
    least per-rank tokens, then fewest ranks in multi-rank sub-groups) over every
    partition of the cp group, documents assigned by :func:`_assign`. ``capacity``:
    tokens per rank, padding included."""
    _check_cp(cp)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"document lengths {list(lengths)} must be a non-empty list of integers >= 1")
    best, best_key = None, None
    for blocks in partitions(cp):
        docs = _assign(lengths, blocks, capacity, cost)
        if docs is None:
            continue
        plan = _plan(lengths, blocks, docs, cost)
        key = (max(plan.rank_cost), max(plan.rank_tokens), sum(c for _, c in blocks if c > 1))
        if best_key is None or key < best_key:
            best, best_key = plan, key
    if best is None:
        whole = _padded(sum(lengths), cp) // cp
        raise ValueError(f"no dynamic cp plan fits capacity={capacity} tokens per rank for document lengths "
                         f"{list(lengths)} on cp={cp} (the whole group needs {whole} per rank)")
    return best


def static_plan(lengths: Sequence[int], cp: int, cost: CostModel) -> Plan:
    """Every document on the whole cp group: static cp in the same terms."""
    return _plan(lengths, [(0, cp)], [list(range(len(lengths)))], cost, reorder=False)


def zigzag_pair_counts(doc_ids: torch.Tensor, cp: int) -> list[int]:
    """Causal same-document query-key pairs whose query each cp rank holds when the
    natural-order sequences ``doc_ids [B, S]`` are zigzag-split over ``cp`` ranks: the
    useful attention work of each rank, exactly."""
    S = doc_ids.shape[1]
    # pairs of query t = tokens of its document at or before t
    first = torch.zeros_like(doc_ids)
    for b in range(doc_ids.shape[0]):
        change = torch.ones(S, dtype=torch.bool)
        change[1:] = doc_ids[b, 1:] != doc_ids[b, :-1]
        starts = torch.where(change, torch.arange(S), torch.zeros(S, dtype=torch.long))
        first[b] = torch.cummax(starts, 0).values
    pairs = torch.arange(S) - first + 1  # [B, S]
    return [int(zigzag_split(pairs, r, cp, dim=1).sum()) for r in range(cp)]


# --------------------------------------------------------------------------- running a plan

def check_dynamic_cp(layout: ParallelLayout) -> None:
    """Raise ValueError when dynamic cp cannot run on ``layout``."""
    require(dynamic_cp_layout, layout.cp, layout.tp, layout.pp)


def documents_of(batch: Batch) -> list[tuple[int, int]]:
    """``(start, end)`` over the flattened ``B*S`` positions of every segment of a whole
    (not cp-sliced) micro-batch that holds real tokens; padding segments are dropped."""
    cu = batch.cu_seqlens.tolist()
    real = batch.token_mask.reshape(-1) if batch.token_mask is not None else None
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if real is None or bool(real[a:b].any())]


class DynamicCP:
    """Dynamic cp on one rank: its cp group's sub-group process groups (made here, a
    collective over the world, once at start), the cost model and the capacity.

    ``capacity``: tokens per rank (padding included) a plan may place; at least what
    static cp places, ``micro_batch_size * seq_length / cp``.
    """

    def __init__(self, groups: ProcessGroups, cost: CostModel, capacity: int):
        layout = groups.layout
        check_dynamic_cp(layout)
        if capacity < 1:
            raise ValueError(f"capacity={capacity} tokens per rank must be >= 1")
        self.cp, self.cp_rank = layout.cp, groups.rank_in("cp")
        self.cost, self.capacity = cost, capacity
        self._groups: dict[tuple[int, int], Group] = {(0, self.cp): groups.cp}
        for c in range(self.cp):
            self._groups[(c, 1)] = None
        size = self.cp // 2
        while size > 1:
            self._groups.update(self._create(layout, groups.rank, size, groups.timeout))
            size //= 2

    def _create(self, layout: ParallelLayout, rank: int, size: int,
                timeout: Optional[datetime.timedelta]) -> dict[tuple[int, int], Group]:
        import torch.distributed as dist

        mine = {}
        for ranks in layout.cp_subgroups(size):
            pg = dist.new_group(ranks, timeout=timeout, group_desc="cp")  # every rank takes part in every group
            if rank in ranks:
                mine[(layout.group_of("cp", rank).index(ranks[0]), size)] = pg
        return mine

    def plan(self, batch: Batch) -> Plan:
        return schedule([b - a for a, b in documents_of(batch)], self.cp, self.capacity, self.cost)

    def shard(self, batch: Batch) -> tuple[Batch, Documents, Plan]:
        """This rank's share of a whole micro-batch of its cp group under the plan: its
        sub-group's documents concatenated and padded (``[1, L]``), its zigzag shard of
        that (``[1, L/c]``), and the :class:`Documents` that run attention over the
        sub-group."""
        plan = self.plan(batch)
        group = plan.subgroup_of(self.cp_rank)
        spans = documents_of(batch)
        flat = {name: getattr(batch, name).reshape(-1) for name in ("tokens", "labels", "loss_mask", "positions")}
        parts = {name: [flat[name][a:b] for a, b in (spans[d] for d in group.docs)] for name in flat}
        lengths = [b - a for a, b in (spans[d] for d in group.docs)]
        total = sum(lengths)
        pad = _padded(total, group.size) - total
        runs = lengths + ([pad] if pad else [])
        device = flat["tokens"].device
        if pad:
            # Padding: its own document, no loss, not counted by the router.
            for name in ("tokens", "labels", "loss_mask"):
                parts[name].append(torch.zeros(pad, dtype=flat[name].dtype, device=device))
            parts["positions"].append(torch.arange(pad, dtype=flat["positions"].dtype, device=device))
        seq = {name: torch.cat(p).unsqueeze(0) for name, p in parts.items()}  # [1, L]
        # output_size: the length is known here; without it the device would be read back.
        # Made on the host and copied over (as torch.tensor(..., device=) does) so that a dry
        # run, which follows host values through the copy, knows the document ids.
        doc_ids = torch.repeat_interleave(torch.arange(len(runs), device=device), torch.tensor(runs).to(device),
                                          output_size=total + pad).unsqueeze(0)  # [1, L]
        real = torch.arange(total + pad, device=device) < total
        cu = torch.tensor(np.concatenate([[0], np.cumsum(runs)]), dtype=torch.int32).to(device)
        i = self.cp_rank - group.start
        local = {name: zigzag_split(x, i, group.size, dim=1) for name, x in seq.items()}  # [1, L/c]
        token_mask = zigzag_split(real.unsqueeze(0), i, group.size, dim=1)
        local_batch = Batch(local["tokens"], local["labels"], local["loss_mask"], local["positions"], cu, token_mask)
        sub_group = self._groups[(group.start, group.size)]
        # The recurrent layers' sequences, from the host's runs (no device read).
        host_ids = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(runs)).unsqueeze(0)  # [1, L]
        docs = Documents(doc_ids, sub_group, token_mask.reshape(-1), sequence_starts(host_ids, sub_group, device))
        return local_batch, docs, plan

"""Data-parallel gradient sync and the global gradient norm (docs/architecture.md, "Parallel folding").

Each parameter says how it is laid out in ``param.parallel`` (set where it is created,
see :mod:`moe_fold.parallel.tensor_parallel`): ``"tp"``, ``"replicated"``, ``"tp_sum"`` or
``"expert"``. The model's loss on a rank is scaled so that the mean over dp x cp of the
per-rank losses is the global-batch loss (``Transformer.forward``); :func:`sync_grads`
turns every grad into the gradient of that global loss, equal to one process's:

- ``"tp"`` and ``"replicated"``: averaged over ``dp_cp``. Under tp the autograd
  collectives already give each rank the full gradient of its (replicated) loss with
  respect to its shard or copy.
- ``"tp_sum"``: summed over ``tp_dp_cp`` and divided by the dp x cp size: the sum over tp
  adds up the partial grads of the rank's sequence shards (SP) or heads (QK-norm), the
  sum over dp x cp is the data-parallel sum; one all-reduce does both.
- ``"expert"``: summed over ``edp`` and divided by the dp x cp size. An expert shard
  receives the tokens of every rank of its ``etp_ep`` group (sequence parallel: each
  token lives on exactly one rank), so the sum over its edp replicas has seen every
  token of the global batch exactly once, each weighted by its rank's loss scale; the
  data-parallel mean divides that sum by dp x cp, not by edp.

Expert copies (``moe.replicas``, :mod:`moe_fold.dispatch.placement`): each copy's grad
covers the tokens it computed; :func:`sum_expert_copies` (the first thing
:func:`sync_grads` does) sums the copies' grads over ep so every copy holds the whole
expert's grad and they take the same step. :func:`grad_norm` counts each global expert
once, in the order of global expert ids, so the norm has the same bits whatever the
placement.

With gradient accumulation, let the grads of all micro-batches add up and call
:func:`sync_grads` once per global batch.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from moe_fold.comm import all_reduce_
from moe_fold.layout import ProcessGroups
from moe_fold.training.buckets import DEFAULT_BUCKET_NUMEL, Bucket, GradSync, make_buckets, param_kind

__all__ = ["DEFAULT_BUCKET_NUMEL", "sum_expert_copies", "sync_grads", "grad_norm", "sharded_grad_norm",
           "clip_grad_norm_", "clip_sharded_grads_"]


@torch.no_grad()
def sum_expert_copies(params: Iterable[nn.Parameter], groups: ProcessGroups) -> None:
    """Sum the grads of the copies of every replicated expert (``param.replicated_experts``)
    over ep, in place: one all-reduce per parameter of the rows ``[replicated experts,
    slot numel]``, where each rank fills the rows of the copies it holds (zeros elsewhere)."""
    for p in params:
        replicated = getattr(p, "replicated_experts", None)
        if not replicated or not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        slots = p.grad.view(p.shape[0], -1)  # [S, slot numel]
        row = {e: r for r, e in enumerate(replicated)}
        mine = [(i, row[e]) for i, e in enumerate(p.slot_experts) if e in row]
        rows = slots.new_zeros(len(replicated), slots.shape[1])  # [R, slot numel]
        for i, r in mine:
            rows[r] = slots[i]
        all_reduce_(rows, groups.ep)
        for i, r in mine:
            slots[i] = rows[r]


@torch.no_grad()
def sync_grads(params: Iterable[nn.Parameter], groups: ProcessGroups,
               bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> None:
    """Make every ``param.grad`` the gradient of the global-batch loss (see module doc).

    Grads of one group kind are flattened into buckets of at most ``bucket_numel``
    elements, one all-reduce each (:class:`moe_fold.training.buckets.GradSync`). A
    parameter without a grad (unused on this rank, e.g. an expert that got no tokens) gets
    zeros, so all ranks reduce the same buckets. Every rank must pass its parameters in the
    same order (as ``model.parameters()`` does).
    """
    params = [p for p in params if p.requires_grad]
    sum_expert_copies(params, groups)
    GradSync(make_buckets([params], groups, bucket_numel), groups).finish()


@torch.no_grad()
def grad_norm(params: Iterable[nn.Parameter], groups: ProcessGroups) -> torch.Tensor:
    """The L2 norm of all grads of the whole model, after :func:`sync_grads`: the norm one
    process would compute. Squares of ``"tp"`` shards are summed over tp, of expert shards
    over ``etp_ep``; replicated grads (``"replicated"``, ``"tp_sum"``) count once; every
    kind is summed over pp stages, where the last stage's copy of a tied embedding
    (``param.tied_copy``, the same grad as the first stage's) is left out. Expert grads
    are summed per global expert (first copies only) and then in expert order, so the
    norm does not depend on the placement. A float32 scalar, the same on every rank."""
    params = [p for p in params if not getattr(p, "tied_copy", False)]
    # Placed experts count on every rank, with or without a grad: the same rows everywhere.
    placed = [p for p in params if param_kind(p) == "expert" and hasattr(p, "slot_experts")]
    params = [p for p in params if p.grad is not None and not (p.parallel == "expert" and hasattr(p, "slot_experts"))]
    # On the grads' device: NCCL reduces only GPU tensors.
    device = params[0].grad.device if params else placed[0].device if placed else torch.device("cpu")
    by_kind: dict[str, list[torch.Tensor]] = {key: [] for key in ("tp", "replicated", "expert")}
    per_expert = [_squares_per_expert(p) for p in placed]
    for p in params:
        kind = param_kind(p)
        by_kind["replicated" if kind == "tp_sum" else kind].append(p.grad)
    sums = {}
    for key, grads in by_kind.items():
        # One multi-tensor call per device and dtype, not a few ops per parameter: the sum
        # of squares of the per-tensor norms, as torch.nn.utils.clip_grad_norm_ does.
        sums[key] = torch.zeros((), dtype=torch.float32, device=device)
        for same in _by_device_and_dtype(grads).values():
            norms = torch._foreach_norm(same, 2, dtype=torch.float32)
            sums[key] += torch.stack(norms).to(device).square().sum()
    all_reduce_(sums["tp"], groups.tp)
    if per_expert:
        # [1 + expert params * E]: one rank of the ep group holds each per-expert entry (its
        # etp ranks their shards' parts), so the sum over ranks adds nothing but zeros.
        packed = torch.cat([sums["expert"].view(1), torch.stack(per_expert).to(device).view(-1)])
        all_reduce_(packed, groups.etp_ep)
        sums["expert"] = packed[0] + packed[1:].sum()
    else:
        all_reduce_(sums["expert"], groups.etp_ep)
    total = sums["tp"] + sums["replicated"] + sums["expert"]
    return all_reduce_(total.clone(), groups.pp).sqrt()


def _squares_per_expert(p: nn.Parameter) -> torch.Tensor:
    """``[E]`` float32: the squared norm of each global expert's grad in ``p``'s first
    copies on this rank (zero for the experts it does not hold)."""
    out = torch.zeros(p.num_experts, dtype=torch.float32, device=p.device)
    if p.grad is None:
        return out
    norms = torch.linalg.vector_norm(p.grad.reshape(p.shape[0], -1), dim=1, dtype=torch.float32)  # [S]
    for i, (expert, first) in enumerate(zip(p.slot_experts, p.slot_primary)):
        if first:
            out[expert] = norms[i].square()
    return out


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


@torch.no_grad()
def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, groups: ProcessGroups) -> torch.Tensor:
    """Scale all grads by ``min(1, max_norm / (norm + 1e-6))`` (torch's rule) where norm is
    :func:`grad_norm`; returns the norm before clipping."""
    params = list(params)
    norm = grad_norm(params, groups)
    params = [p for p in params if p.grad is not None]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for (device, dtype), grads in _by_device_and_dtype([p.grad for p in params]).items():
        torch._foreach_mul_(grads, coef.to(device, dtype))
    return norm


@torch.no_grad()
def sharded_grad_norm(buckets: Sequence[Bucket], groups: ProcessGroups) -> torch.Tensor:
    """:func:`grad_norm` when the grads were reduce-scattered (the distributed optimizer):
    each rank holds the reduced elements it owns of every sharded bucket. The squares of
    owned ranges are summed over the ranks of the pipeline stage (``tp_dp_cp``, the same
    ranks as ``etp_ep_edp``): ``"tp"`` and ``"tp_sum"`` ranges are distinct over tp x dp x
    cp, expert ranges over etp x ep x edp; a ``"replicated"`` range repeats over tp and
    counts on tp rank 0 only; an expert with copies (``moe.replicas``) counts once, in its
    first copy's slot. Then over pp. The sum runs in another order than
    :func:`grad_norm`'s: the two agree to float32 rounding."""
    repeated = groups.rank_in("tp") > 0  # a "replicated" range here repeats tp rank 0's
    grads = []
    for s in (s for b in buckets for s in b.slices):
        if s.stop <= s.start or getattr(s.param, "tied_copy", False) or (repeated and s.param.parallel == "replicated"):
            continue
        flat = s.param.grad.view(-1)
        primary = getattr(s.param, "slot_primary", None)
        if primary is None:
            grads.append(flat[s.start:s.stop])
            continue
        # Expert slots (moe.replicas): a global expert counts once, in its first copy's rows.
        row = s.param.numel() // s.param.shape[0]
        for i, first in enumerate(primary):
            lo, hi = max(s.start, i * row), min(s.stop, (i + 1) * row)
            if first and hi > lo:
                grads.append(flat[lo:hi])
    device = buckets[0].params[0].device if buckets else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for same in _by_device_and_dtype(grads).values():
        norms = torch._foreach_norm(same, 2, dtype=torch.float32)
        total += torch.stack(norms).to(device).square().sum()
    all_reduce_(total, groups.tp_dp_cp)
    return all_reduce_(total, groups.pp).sqrt()


@torch.no_grad()
def clip_sharded_grads_(buckets: Sequence[Bucket], max_norm: float, groups: ProcessGroups) -> torch.Tensor:
    """:func:`clip_grad_norm_` of reduce-scattered grads: scales the owned ranges by
    ``min(1, max_norm / (norm + 1e-6))`` with :func:`sharded_grad_norm`; returns the norm."""
    norm = sharded_grad_norm(buckets, groups)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    owned = [s.param.grad.view(-1)[s.start:s.stop] for b in buckets for s in b.slices if s.stop > s.start]
    for (device, dtype), grads in _by_device_and_dtype(owned).items():
        torch._foreach_mul_(grads, coef.to(device, dtype))
    return norm

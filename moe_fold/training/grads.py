"""Data-parallel gradient sync and the global gradient norm (DESIGN.md section 2).

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

from typing import Iterable

import torch
from torch import nn

from moe_fold.comm import all_reduce_
from moe_fold.layout import ProcessGroups
from moe_fold.parallel.tensor_parallel import PARALLEL_KINDS

__all__ = ["sum_expert_copies", "sync_grads", "grad_norm", "clip_grad_norm_"]

# parallel kind -> the group whose all-reduce (sum) completes the gradient
_SYNC_GROUP = {"tp": "dp_cp", "replicated": "dp_cp", "tp_sum": "tp_dp_cp", "expert": "edp"}

DEFAULT_BUCKET_NUMEL = 1 << 24


def _kind(param: nn.Parameter) -> str:
    kind = getattr(param, "parallel", None)
    if kind not in PARALLEL_KINDS:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has parallel={kind!r}; every parameter "
                         f"must be marked with one of {', '.join(PARALLEL_KINDS)} "
                         f"(moe_fold.parallel.tensor_parallel.mark)")
    return kind


def _buckets(params: list[nn.Parameter], max_numel: int) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of one dtype, each at most ``max_numel`` elements
    (a single larger parameter gets a bucket of its own)."""
    buckets: list[list[nn.Parameter]] = []
    numel = 0
    for p in params:
        if not buckets or numel + p.numel() > max_numel or p.dtype != buckets[-1][0].dtype:
            buckets.append([])
            numel = 0
        buckets[-1].append(p)
        numel += p.numel()
    return buckets


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
    elements, one all-reduce each. A parameter without a grad (unused on this rank, e.g.
    an expert that got no tokens) gets zeros, so all ranks reduce the same buckets.
    Every rank must pass its parameters in the same order (as ``model.parameters()`` does).
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel} must be >= 1")
    params = list(params)
    sum_expert_copies(params, groups)
    by_group: dict[str, list[nn.Parameter]] = {name: [] for name in dict.fromkeys(_SYNC_GROUP.values())}
    for p in params:
        if p.requires_grad:
            by_group[_SYNC_GROUP[_kind(p)]].append(p)
    scale = 1.0 / groups.size("dp_cp")
    for name, members in by_group.items():
        group = groups.group(name)
        if groups.size(name) == 1 and scale == 1.0:
            continue
        for p in members:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in _buckets(members, bucket_numel):
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # [sum numel]
            all_reduce_(flat, group)
            flat.mul_(scale)
            for p, g in zip(bucket, flat.split([p.numel() for p in bucket])):
                p.grad.copy_(g.view_as(p.grad))


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
    placed = [p for p in params if _kind(p) == "expert" and hasattr(p, "slot_experts")]
    params = [p for p in params if p.grad is not None and not (p.parallel == "expert" and hasattr(p, "slot_experts"))]
    # On the grads' device: NCCL reduces only GPU tensors.
    device = params[0].grad.device if params else placed[0].device if placed else torch.device("cpu")
    by_kind: dict[str, list[torch.Tensor]] = {key: [] for key in ("tp", "replicated", "expert")}
    per_expert = [_squares_per_expert(p) for p in placed]
    for p in params:
        kind = _kind(p)
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

"""AdamW with decoupled weight decay, its parameter groups, learning-rate schedules, and the
distributed (ZeRO-1) optimizer.

One step of training, after the backward passes of every micro-batch of the global batch
(their grads add up: that is gradient accumulation, with the loss scaled as
``Transformer.forward`` documents), is :func:`apply_gradients`: ``sync_grads`` makes every
grad the global-batch gradient, ``clip_grad_norm_`` clips by the norm of the whole model,
then :meth:`AdamW.step` updates. The scheduler's ``step()`` follows.

:class:`AdamW` computes exactly what ``torch.optim.AdamW(fused=True)`` computes: one call
of torch's fused multi-tensor kernel per parameter group (:func:`adamw_update_`). On CPU it
reads and writes each element once where the single-tensor path makes eight passes (about
3x faster on the optimizer step, bench/train.py). It rounds differently from
``foreach=False`` in the last bit (``exp_avg_sq`` through a fused multiply-add). With
``distributed=True`` (``optimizer.distributed``) it keeps the moments of only a slice of
the parameters (ZeRO-1): the parameters of one sharding group are flattened, in order,
into buckets; each bucket is cut into ``n`` nearly equal ranges and rank ``r`` of the group
owns range ``r``. A cut inside a parameter falls on a multiple of :data:`ALIGN` elements
from its start: the kernel works in vector blocks from a tensor's start and rounds a
block's tail differently, so aligned slices update every element bit for bit as the
whole parameter does. A step updates the owned range (with the owned moments) and
all-gathers the bucket, so every rank ends with the same parameters as without sharding,
and the moments of each element live on one rank of the group. Dense parameters
(``"tp"``, ``"replicated"``, ``"tp_sum"``) shard over ``dp_cp`` (the ranks holding the same
local tensor; a ``"tp_sum"`` or ``"replicated"`` parameter is also the same on every tp
rank, and each tp rank updates its own copy the same way); expert parameters over ``edp``.

A parameter whose grad is None (an expert that got no token, on one process) steps with a
zero grad, as :func:`moe_fold.training.grads.sync_grads` makes it on more than one rank: every
layout takes the same step (torch would skip the parameter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from moe_fold.comm import all_gather
from moe_fold.config import Config, OptimizerConfig
from moe_fold.training.grads import DEFAULT_BUCKET_NUMEL, clip_grad_norm_, grad_norm, sync_grads
from moe_fold.layout import ProcessGroups
from moe_fold.parallel.tensor_parallel import PARALLEL_KINDS

__all__ = [
    "SHARD_GROUP", "ALIGN", "decays", "param_groups", "adamw_update_", "AdamW", "lr_at", "LRScheduler",
    "build_optimizer", "build_scheduler", "apply_gradients",
]

# parallel kind -> the group over which the local tensor is replicated (and ZeRO shards it)
SHARD_GROUP = {"tp": "dp_cp", "replicated": "dp_cp", "tp_sum": "dp_cp", "expert": "edp"}


def decays(name: str, param: nn.Parameter) -> bool:
    """Whether weight decay applies: matrices yes; norms' gains and biases (1-D) no.

    The router's ``expert_bias`` is a buffer (updated by the router, not by gradients), so
    it never reaches the optimizer.
    """
    return param.dim() >= 2 and not name.endswith(".bias")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW parameter groups of ``model``'s trainable parameters, in
    ``named_parameters`` order (a tied weight once): ``weight_decay`` for :func:`decays`
    parameters, 0 for the rest. Each group also carries the parameters' ``names``."""
    decay = {"params": [], "names": [], "weight_decay": weight_decay}
    no_decay = {"params": [], "names": [], "weight_decay": 0.0}
    for name, p in model.named_parameters():
        if p.requires_grad:
            group = decay if decays(name, p) else no_decay
            group["params"].append(p)
            group["names"].append(name)
    return [g for g in (decay, no_decay) if g["params"]]


@torch.no_grad()
def adamw_update_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], step: int, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float) -> None:
    """One AdamW update (Loshchilov & Hutter 2019) in place of lists of tensors (whole
    parameters or slices of them, see :data:`ALIGN`): torch's fused kernel, the one
    ``torch.optim.AdamW(fused=True)`` runs, so the numbers match it. ``step`` counts
    updates including this one (1 on the first)."""
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        by_key.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), idx in by_key.items():
        # The kernel reads every tensor's step count from a float32 tensor on its device
        # (as torch keeps it); all of ours share one.
        steps = [torch.tensor(float(step), device=device)] * len(idx)
        torch._fused_adamw_([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
                            [exp_avg_sqs[i] for i in idx], [], steps, lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)


# Elements between a parameter's start and a ZeRO cut inside it: a multiple of the fused
# kernel's vector block (16 float32 elements with AVX-512, 64 bytes of a cache line; 64
# covers every dtype and CPU), see the module doc.
ALIGN = 64


@dataclass
class _Slice:
    """A parameter's owned elements ``[start, stop)`` of its flattened local tensor and
    where they sit in its bucket."""

    param: nn.Parameter
    group: dict
    offset: int  # of the parameter in the bucket
    start: int
    stop: int


@dataclass
class _Bucket:
    """Parameters of one sharding group and dtype, flattened one after another; rank r of
    the group owns ``sizes[r]`` consecutive elements of the flat buffer, in rank order."""

    group_name: str
    slices: list[_Slice]
    sizes: list[int]


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay; ``distributed=True`` shards its state (ZeRO-1).

    ``params``: parameters or parameter groups (:func:`param_groups`); every parameter
    must carry ``param.parallel`` when ``distributed``. ``groups`` is needed when
    ``distributed`` (``None`` otherwise means one process). State is created at
    construction (zeros), so a checkpoint can be loaded before the first step.

    State per parameter (``self.state[p]``): ``exp_avg`` and ``exp_avg_sq``, the moments
    of the elements ``[start, stop)`` of ``p`` flattened (:meth:`state_slice`): all of them
    without sharding, this rank's range with. ``step_count`` counts the steps taken.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, groups: Optional[ProcessGroups] = None,
                 distributed: bool = False, bucket_numel: int = DEFAULT_BUCKET_NUMEL):
        if not lr >= 0:
            raise ValueError(f"lr={lr!r} must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas!r} must both be in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps={eps!r} must be > 0")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
        if distributed and groups is None:
            raise ValueError("distributed=True needs groups (the ProcessGroups to shard over)")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel={bucket_numel} must be >= 1")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.groups = groups if groups is not None else ProcessGroups.single_process()
        self.distributed = distributed
        self.step_count = 0
        self._buckets: list[_Bucket] = self._make_buckets(bucket_numel) if distributed else []
        self._slices: dict[nn.Parameter, tuple[int, int]] = {}
        for bucket in self._buckets:
            for s in bucket.slices:
                self._slices[s.param] = (s.start, s.stop)
        for group in self.param_groups:
            for p in group["params"]:
                start, stop = self._slices.get(p, (0, p.numel()))
                shape = p.shape if not distributed else (stop - start,)
                self.state[p] = {"exp_avg": torch.zeros(shape, dtype=p.dtype, device=p.device),
                                 "exp_avg_sq": torch.zeros(shape, dtype=p.dtype, device=p.device)}

    def _make_buckets(self, bucket_numel: int) -> list[_Bucket]:
        by_key: dict[tuple[str, torch.dtype], list[tuple[nn.Parameter, dict]]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                kind = getattr(p, "parallel", None)
                if kind not in PARALLEL_KINDS:
                    raise ValueError(f"parameter of shape {tuple(p.shape)} has parallel={kind!r}; the "
                                     f"distributed optimizer needs one of {', '.join(PARALLEL_KINDS)}")
                if not p.is_contiguous():
                    raise ValueError(f"parameter of shape {tuple(p.shape)} must be contiguous: the "
                                     f"distributed optimizer updates slices of its flat view")
                by_key.setdefault((SHARD_GROUP[kind], p.dtype), []).append((p, group))
        buckets = []
        for (group_name, _), members in by_key.items():
            n, me = self.groups.size(group_name), self.groups.rank_in(group_name)
            run: list[tuple[nn.Parameter, dict]] = []
            numel = 0
            for p, group in members:
                if run and numel + p.numel() > bucket_numel:
                    buckets.append(_shard_bucket(group_name, run, n, me))
                    run, numel = [], 0
                run.append((p, group))
                numel += p.numel()
            buckets.append(_shard_bucket(group_name, run, n, me))
        return buckets

    def state_slice(self, param: nn.Parameter) -> tuple[int, int]:
        """``(start, stop)``: the elements of ``param`` flattened whose moments this rank holds."""
        return self._slices.get(param, (0, param.numel()))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AdamW.step takes no closure: compute the loss and grads before stepping")
        self.step_count += 1
        if not self.distributed:
            for group in self.param_groups:
                params = group["params"]
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                self._update(group, params, grads)
            return None
        for bucket in self._buckets:
            for group in self.param_groups:
                mine = [s for s in bucket.slices if s.group is group and s.stop > s.start]
                params = [s.param.view(-1)[s.start:s.stop] for s in mine]
                grads = [s.param.grad.reshape(-1)[s.start:s.stop] if s.param.grad is not None
                         else torch.zeros_like(f) for s, f in zip(mine, params)]
                self._update(group, params, grads, [s.param for s in mine])
            if self.groups.size(bucket.group_name) == 1:
                continue  # this rank owns the whole bucket and updated it in place
            mine = torch.cat([s.param.view(-1)[s.start:s.stop] for s in bucket.slices])  # [sizes[me]]
            full = all_gather(mine, self.groups.group(bucket.group_name), bucket.sizes)  # [bucket numel]
            for s in bucket.slices:
                s.param.view(-1).copy_(full[s.offset:s.offset + s.param.numel()])
        return None

    def _update(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor],
                owners: Optional[list[nn.Parameter]] = None) -> None:
        """AdamW on ``params`` (the parameters of ``group``, or the owned slices of
        ``owners``) with their moments."""
        states = [self.state[p] for p in (owners if owners is not None else params)]
        beta1, beta2 = group["betas"]
        adamw_update_(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                      self.step_count, group["lr"], beta1, beta2, group["eps"], group["weight_decay"])


def _shard_bucket(group_name: str, members: list[tuple[nn.Parameter, dict]], n: int, me: int) -> _Bucket:
    """Cut the flat bucket of ``members`` into ``n`` ranges at about ``r * numel / n``, each
    cut inside a parameter moved up to a multiple of :data:`ALIGN` from its start."""
    offsets, numel = [], 0
    for p, _ in members:
        offsets.append(numel)
        numel += p.numel()
    chunk = -(-numel // n)

    def aligned(cut: int) -> int:
        for (p, _), offset in zip(members, offsets):
            if offset < cut < offset + p.numel():
                return offset + min(-(-(cut - offset) // ALIGN) * ALIGN, p.numel())
        return cut

    cuts = [aligned(min(r * chunk, numel)) for r in range(n)] + [numel]
    lo, hi = cuts[me], cuts[me + 1]
    slices = []
    for (p, group), offset in zip(members, offsets):
        start = min(max(lo - offset, 0), p.numel())
        stop = max(min(hi - offset, p.numel()), start)
        slices.append(_Slice(p, group, offset, start, stop))
    return _Bucket(group_name, slices, [cuts[r + 1] - cuts[r] for r in range(n)])


def lr_at(step: int, config: OptimizerConfig, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total_steps``.

    Warmup (every schedule): ``lr * (step + 1) / warmup_steps`` for ``step < warmup_steps``,
    so the first step already moves and step ``warmup_steps - 1`` uses ``lr``. Then, with
    ``w = warmup_steps`` and ``T = total_steps``:

    - ``constant``: ``lr``;
    - ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2`` with
      ``p = (step - w) / (T - w)``, from ``lr`` down towards ``min_lr`` (reached at ``T``);
    - ``wsd`` (warmup-stable-decay): ``lr`` until ``d = max(w, T - round(decay_fraction * T))``,
      then linear ``lr - (lr - min_lr) * (step - d) / (T - d)``, towards ``min_lr`` at ``T``.

    Steps at or past ``T`` get ``min_lr`` (``lr`` for ``constant``).
    """
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    lr, min_lr, w = config.lr, config.min_lr, config.warmup_steps
    if step < w:
        return lr * (step + 1) / w
    if config.schedule == "constant":
        return lr
    if step >= total_steps:
        return min_lr
    if config.schedule == "cosine":
        progress = (step - w) / (total_steps - w)
        return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2
    if config.schedule == "wsd":
        decay_start = max(w, total_steps - round(config.decay_fraction * total_steps))
        if step < decay_start:
            return lr
        return lr - (lr - min_lr) * (step - decay_start) / (total_steps - decay_start)
    raise ValueError(f"optimizer.schedule={config.schedule!r} must be one of cosine, wsd, constant")


class LRScheduler:
    """Sets every parameter group's ``lr`` to :func:`lr_at` of the next step.

    Construction sets the rate of step 0; call :meth:`step` after each optimizer step.
    ``state_dict()`` is ``{"step": n}``, the optimizer steps taken so far."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int):
        lr_at(0, config, total_steps)  # rejects a bad schedule or total before any step
        self.optimizer = optimizer
        self.config = config
        self.total_steps = total_steps
        self.last_step = 0
        self._apply()

    def _apply(self) -> None:
        lr = lr_at(self.last_step, self.config, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> None:
        self.last_step += 1
        self._apply()

    def get_last_lr(self) -> float:
        """The rate the next optimizer step will use."""
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"scheduler state step={step!r} must be an integer >= 0")
        self.last_step = step
        self._apply()


def build_optimizer(model: nn.Module, config: OptimizerConfig, groups: ProcessGroups) -> AdamW:
    """AdamW over ``model``'s :func:`param_groups` with the hyper-parameters of ``config``,
    sharded when ``config.distributed``."""
    return AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=(config.beta1, config.beta2),
                 eps=config.eps, weight_decay=config.weight_decay, groups=groups, distributed=config.distributed)


def build_scheduler(optimizer: torch.optim.Optimizer, config: Config) -> LRScheduler:
    """The schedule of ``config.optimizer`` over ``config.train.steps`` steps."""
    return LRScheduler(optimizer, config.optimizer, config.train.steps)


def apply_gradients(params: Iterable[nn.Parameter], optimizer: AdamW, groups: ProcessGroups,
                    clip_grad: float, skip_nonfinite: bool = True) -> torch.Tensor:
    """Sync the accumulated grads, clip them by the global norm (``clip_grad > 0``; 0 turns
    clipping off), and step. Returns the global grad norm before clipping. A non-finite
    norm skips the update when ``skip_nonfinite`` (the same decision on every rank, as the
    norm is global); the grads are left as they are for the caller to zero."""
    if not clip_grad >= 0:
        raise ValueError(f"clip_grad={clip_grad!r} must be >= 0 (0 turns clipping off)")
    params = [p for p in params if p.requires_grad]
    sync_grads(params, groups)
    norm = clip_grad_norm_(params, clip_grad, groups) if clip_grad > 0 else grad_norm(params, groups)
    if torch.isfinite(norm) or not skip_nonfinite:
        optimizer.step()
    return norm

"""AdamW with decoupled weight decay, its parameter groups, learning-rate schedules, and the
distributed (ZeRO-1) optimizer.

One step of training, after the backward passes of every micro-batch of the global batch
(their grads add up: that is gradient accumulation, with the loss scaled as
``Transformer.forward`` documents), is :func:`apply_gradients`: ``sync_grads`` makes every
grad the global-batch gradient, ``clip_grad_norm_`` clips by the norm of the whole model,
then :meth:`AdamW.step` updates. The scheduler's ``step()`` follows. The training step
calls the first two alone (:func:`reduce_gradients`, which leaves the norm on the device)
and steps once its one host read finds the loss and the norm finite.

:class:`AdamW` computes exactly what ``torch.optim.AdamW(fused=True)`` computes: one call
of torch's fused multi-tensor kernel per parameter group (:func:`adamw_update_`). On CPU it
reads and writes each element once where the single-tensor path makes eight passes (about
3x faster on the optimizer step, bench/train.py). It rounds differently from
``foreach=False`` in the last bit (``exp_avg_sq`` through a fused multiply-add). With
``distributed=True`` (``optimizer.distributed``) it keeps the moments of only a slice of
the parameters (ZeRO-1), the slice of the gradient buckets
(:mod:`moe_fold.training.buckets`) this rank owns: each bucket's grads are
reduce-scattered so the rank receives only its owned elements summed; the step updates
them (with the owned moments) and all-gathers the bucket, so every rank ends with the same
parameters as without sharding, and the moments of each element live on one rank of the
group. Cuts inside a parameter fall on multiples of :data:`ALIGN` elements from its start,
so the update of every element is bit for bit the whole parameter's. Dense parameters
(``"tp"``, ``"replicated"``) shard over ``dp_cp`` (the ranks holding the same local tensor;
a ``"replicated"`` parameter is also the same on every tp rank, and each tp rank updates
its own copy the same way), ``"tp_sum"`` ones over ``tp_dp_cp`` (the group that sums their
partial grads), expert parameters over ``edp`` (:data:`SHARD_GROUP`).

``overlap_param_gather`` (``parallel.overlap_param_gather``): the step posts each bucket's
all-gather and returns; :meth:`AdamW.register_gather_hooks` makes every module wait for
the buckets of its own parameters just before its next forward (and :meth:`AdamW.wait_params`
waits for all, before anything else reads the parameters: a checkpoint, the end of training).

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
from torch.optim.adamw import adamw

from moe_fold.comm import Pending, all_gather_async
from moe_fold.config import (
    Config, OptimizerConfig, adamw_settings, bucket_size, choice, grad_clip, param_gather_needs_distributed, require,
)
from moe_fold.layout import ProcessGroups
from moe_fold.training.buckets import (
    ALIGN, DEFAULT_BUCKET_NUMEL, SYNC_GROUP, Bucket, GradSync, make_buckets, model_buckets,
)
from moe_fold.training.grads import (
    clip_grad_norm_, clip_sharded_grads_, grad_norm, sharded_grad_norm, sum_expert_copies,
)
from moe_fold.training.wait_timer import WaitTimer

__all__ = [
    "SHARD_GROUP", "ALIGN", "decays", "param_groups", "adamw_update_", "AdamW", "lr_at", "LRScheduler",
    "build_optimizer", "build_grad_sync", "build_scheduler", "reduce_gradients", "apply_gradients",
]

# parallel kind -> the group over which ZeRO shards the local tensor: the one whose sum
# completes its gradient, so a reduce-scatter over it delivers exactly the owned elements.
SHARD_GROUP = SYNC_GROUP


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
    parameters or slices of them, see :data:`ALIGN`), through torch's public functional
    ``torch.optim.adamw.adamw(fused=True)``: the kernel ``torch.optim.AdamW(fused=True)``
    runs, so the numbers match it bit for bit
    (``tests/training/test_optim.py::test_adamw_equals_torch_adamw_bit_for_bit``). ``step`` counts
    updates including this one (1 on the first)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(params):
        by_device.setdefault(p.device, []).append(i)
    for device, idx in by_device.items():
        # The functional adds 1 to each tensor's step count before the update (as the
        # optimizer does), so each gets its own float32 scalar holding step - 1: views of one
        # tensor made on the device (torch.full: no copy from the host).
        steps = list(torch.full((len(idx),), float(step - 1), device=device).unbind())
        adamw([params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
              [exp_avg_sqs[i] for i in idx], [], steps, fused=True, amsgrad=False, beta1=beta1, beta2=beta2,
              lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay; ``distributed=True`` shards its state (ZeRO-1).

    ``params``: parameters or parameter groups (:func:`param_groups`); every parameter
    must carry ``param.parallel`` when ``distributed``. ``groups`` is needed when
    ``distributed`` (``None`` otherwise means one process). ``buckets``: the sharded
    gradient buckets (:func:`moe_fold.training.buckets.model_buckets`; default: the
    parameters in group order as one chunk, ``bucket_numel`` elements each). State is
    created at construction (zeros), so a checkpoint can be loaded before the first step.

    State per parameter (``self.state[p]``): ``exp_avg`` and ``exp_avg_sq``, the moments
    of the elements ``[start, stop)`` of ``p`` flattened (:meth:`state_slice`): all of them
    without sharding, this rank's range with. ``step_count`` counts the steps taken.
    ``gather_wait_s`` adds up the seconds spent waiting for parameter all-gathers.
    ``targets`` (distributed only): parameters that mirror the optimizer's, the bf16
    model's for the float32 masters; each is overwritten (cast) from its master as soon as
    the master's bucket is current, and :meth:`register_gather_hooks` takes their modules.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, groups: Optional[ProcessGroups] = None,
                 distributed: bool = False, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 buckets: Optional[list[Bucket]] = None, overlap_param_gather: bool = False,
                 targets: Optional[dict[nn.Parameter, nn.Parameter]] = None):
        if not lr >= 0:
            raise ValueError(f"lr={lr!r} must be >= 0")
        require(adamw_settings, betas[0], betas[1], eps, weight_decay)
        if distributed and groups is None:
            raise ValueError("distributed=True needs groups (the ProcessGroups to shard over)")
        require(param_gather_needs_distributed, overlap_param_gather, distributed)
        require(bucket_size, bucket_numel)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.groups = groups if groups is not None else ProcessGroups.single_process()
        self.distributed = distributed
        self.overlap_param_gather = overlap_param_gather
        self.targets = targets or {}
        if self.targets and not distributed:
            raise ValueError("targets are for the distributed optimizer (without it, copy the parameters after "
                             "the step: MasterWeights.master_to_model)")
        self.step_count = 0
        self._gather_wait = WaitTimer()
        self._group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        self.buckets: list[Bucket] = []
        if distributed:
            mine = [p for group in self.param_groups for p in group["params"]]
            self.buckets = buckets if buckets is not None else make_buckets([mine], self.groups, bucket_numel,
                                                                            shard=True)
            _check_buckets(self.buckets, mine)
        self._slices: dict[nn.Parameter, tuple[int, int]] = {}
        for bucket in self.buckets:
            for s in bucket.slices:
                self._slices[s.param] = (s.start, s.stop)
        self._gathers: dict[int, Pending] = {}  # bucket index -> its all-gather in flight
        self._bucket_of = {id(self.targets.get(p, p)): i for i, b in enumerate(self.buckets) for p in b.params}
        for group in self.param_groups:
            for p in group["params"]:
                start, stop = self._slices.get(p, (0, p.numel()))
                shape = p.shape if not distributed else (stop - start,)
                self.state[p] = {"exp_avg": torch.zeros(shape, dtype=p.dtype, device=p.device),
                                 "exp_avg_sq": torch.zeros(shape, dtype=p.dtype, device=p.device)}

    @property
    def gather_wait_s(self) -> float:
        """Seconds the computation waited for parameter all-gathers (CUDA events on a GPU)."""
        return self._gather_wait.seconds

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
        for i, bucket in enumerate(self.buckets):
            self._wait_gather(i)  # the update reads the parameters
            for group in self.param_groups:
                mine = [s for s in bucket.slices if self._group_of[id(s.param)] is group and s.stop > s.start]
                params = [s.param.view(-1)[s.start:s.stop] for s in mine]
                grads = [s.param.grad.reshape(-1)[s.start:s.stop] if s.param.grad is not None
                         else torch.zeros_like(f) for s, f in zip(mine, params)]
                self._update(group, params, grads, [s.param for s in mine])
            if self.groups.size(bucket.group_name) == 1:
                self._to_targets(bucket)  # this rank owns the whole bucket and updated it in place
                continue
            mine = torch.cat([s.param.view(-1)[s.start:s.stop] for s in bucket.slices])  # [sizes[me]]
            self._gathers[i] = all_gather_async(mine, self.groups.group(bucket.group_name), bucket.sizes)
            if not self.overlap_param_gather:
                self._wait_gather(i)
        return None

    @torch.no_grad()
    def _wait_gather(self, i: int) -> None:
        """Wait for bucket ``i``'s all-gather (if one is in flight) and copy it into the parameters."""
        pending = self._gathers.pop(i, None)
        if pending is None:
            return
        bucket = self.buckets[i]
        with self._gather_wait.waiting(bucket.params[0].device):
            full = pending.wait()  # [bucket numel]
        for p, offset in zip(bucket.params, bucket.offsets):
            p.view(-1).copy_(full[offset:offset + p.numel()])
        self._to_targets(bucket)

    @torch.no_grad()
    def _to_targets(self, bucket: Bucket) -> None:
        for p in bucket.params:
            if p in self.targets:
                self.targets[p].copy_(p)

    def wait_params(self) -> None:
        """Wait for every parameter all-gather in flight: the parameters are then current."""
        for i in list(self._gathers):
            self._wait_gather(i)

    def register_gather_hooks(self, model: nn.Module) -> None:
        """With ``overlap_param_gather``: before each module's forward, wait for the
        all-gathers of the buckets holding its own parameters."""
        for module in model.modules():
            owned = sorted({self._bucket_of[id(p)] for p in module.parameters(recurse=False)
                            if id(p) in self._bucket_of})
            if owned:
                module.register_forward_pre_hook(lambda _module, _args, owned=owned: self._wait_buckets(owned))

    def _wait_buckets(self, indices: list[int]) -> None:
        if self._gathers:
            for i in indices:
                self._wait_gather(i)

    def _update(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor],
                owners: Optional[list[nn.Parameter]] = None) -> None:
        """AdamW on ``params`` (the parameters of ``group``, or the owned slices of
        ``owners``) with their moments."""
        states = [self.state[p] for p in (owners if owners is not None else params)]
        beta1, beta2 = group["betas"]
        adamw_update_(params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                      self.step_count, group["lr"], beta1, beta2, group["eps"], group["weight_decay"])


def _check_buckets(buckets: list[Bucket], params: list[nn.Parameter]) -> None:
    """The buckets must shard exactly the optimizer's parameters, each once."""
    held = [p for b in buckets for p in b.params]
    if any(b.sizes is None for b in buckets) or len(held) != len(params) or \
            {id(p) for p in held} != {id(p) for p in params}:
        raise ValueError("buckets must be sharded buckets (make_buckets(..., shard=True)) holding exactly the "
                         "optimizer's parameters, each once")


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
    require(choice, "optimizer.schedule", config.schedule)
    raise AssertionError(f"schedule {config.schedule} has no learning-rate rule")


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


def build_optimizer(model: nn.Module, config: OptimizerConfig, groups: ProcessGroups, *,
                    bucket_numel: int = DEFAULT_BUCKET_NUMEL, overlap_param_gather: bool = False,
                    compute_model: Optional[nn.Module] = None,
                    targets: Optional[dict[nn.Parameter, nn.Parameter]] = None) -> AdamW:
    """AdamW over ``model``'s :func:`param_groups` with the hyper-parameters of ``config``,
    sharded when ``config.distributed`` over the model's gradient buckets
    (:func:`moe_fold.training.buckets.model_buckets`); with ``overlap_param_gather`` its
    forward pre-hooks are registered on ``compute_model`` (default ``model``: the bf16 model
    of float32 masters, whose parameters are the ``targets`` of ``model``'s)."""
    buckets = model_buckets(model, groups, bucket_numel, shard=True) if config.distributed else None
    optimizer = AdamW(param_groups(model, config.weight_decay), lr=config.lr, betas=(config.beta1, config.beta2),
                      eps=config.eps, weight_decay=config.weight_decay, groups=groups, distributed=config.distributed,
                        buckets=buckets, overlap_param_gather=overlap_param_gather,
                      targets=targets if config.distributed else None)
    if overlap_param_gather:
        optimizer.register_gather_hooks(compute_model if compute_model is not None else model)
    return optimizer


def build_grad_sync(model: nn.Module, optimizer: AdamW, groups: ProcessGroups, *,
                    bucket_numel: int = DEFAULT_BUCKET_NUMEL, overlap: bool = False,
                    sources: Optional[dict[nn.Parameter, nn.Parameter]] = None) -> GradSync:
    """The gradient reduction of ``model`` for ``optimizer``: its sharded buckets
    (reduce-scatter) when distributed, else ``model``'s buckets (all-reduce).
    ``overlap``: reduce during the backward; ``sources``: see :class:`GradSync`."""
    buckets = optimizer.buckets if optimizer.distributed else model_buckets(model, groups, bucket_numel)
    return GradSync(buckets, groups, overlap=overlap, sources=sources)


def build_scheduler(optimizer: torch.optim.Optimizer, config: Config) -> LRScheduler:
    """The schedule of ``config.optimizer`` over ``config.train.steps`` steps."""
    return LRScheduler(optimizer, config.optimizer, config.train.steps)


def reduce_gradients(params: Iterable[nn.Parameter], optimizer: AdamW, groups: ProcessGroups,
                     clip_grad: float, grad_sync: Optional[GradSync] = None) -> torch.Tensor:
    """Sync the accumulated grads (``grad_sync``, :func:`build_grad_sync`; default: the
    optimizer's buckets, or ``params`` in buckets) and clip them by the global norm
    (``clip_grad > 0``; 0 turns clipping off). Returns the global grad norm before clipping,
    on the device: nothing here reads it, so the caller decides when the host waits for it
    (the training step reads it with the step's other scalars, in one copy). With the
    distributed optimizer only the owned ranges of the grads are reduced and clipped."""
    require(grad_clip, clip_grad)
    params = [p for p in params if p.requires_grad]
    if grad_sync is None:
        buckets = optimizer.buckets if optimizer.distributed else make_buckets([params], groups)
        grad_sync = GradSync(buckets, groups)
    elif optimizer.distributed and grad_sync.buckets is not optimizer.buckets:
        raise ValueError("grad_sync must reduce the distributed optimizer's own buckets (build_grad_sync)")
    # An expert's copies (moe.replicas) sum their grads over ep before the data-parallel sum.
    copies = [p for b in grad_sync.buckets for p in b.params if getattr(p, "replicated_experts", None)]
    if copies:
        grad_sync.take_grads(copies)
        sum_expert_copies(copies, groups)
    grad_sync.finish()
    if optimizer.distributed:
        return (clip_sharded_grads_(optimizer.buckets, clip_grad, groups) if clip_grad > 0
                else sharded_grad_norm(optimizer.buckets, groups))
    return clip_grad_norm_(params, clip_grad, groups) if clip_grad > 0 else grad_norm(params, groups)


def apply_gradients(params: Iterable[nn.Parameter], optimizer: AdamW, groups: ProcessGroups,
                    clip_grad: float, skip_nonfinite: bool = True,
                    grad_sync: Optional[GradSync] = None) -> torch.Tensor:
    """:func:`reduce_gradients`, then the optimizer step. Returns the global grad norm before
    clipping. A non-finite norm skips the update when ``skip_nonfinite`` (the same decision
    on every rank, as the norm is global; a read of the norm on the host); the grads are
    left as they are for the caller to zero."""
    norm = reduce_gradients(params, optimizer, groups, clip_grad, grad_sync)
    if torch.isfinite(norm) or not skip_nonfinite:
        optimizer.step()
    return norm

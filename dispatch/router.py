"""Routing: router logits -> each token's experts and weights, with Megatron-Core's semantics.

Pure functions (plain tensors in, tensors out):

- :func:`topk_routing`: scores (softmax before or after top-k, sigmoid), group-limited
  top-k (DeepSeek-V3), scaling factor, aux-loss-free expert bias;
- :func:`expert_capacity` / :func:`apply_capacity`: token dropping with the ``probs`` or
  ``position`` policy, optionally padding every expert to exactly its capacity;
- :func:`updated_expert_bias`: one aux-loss-free bias step;
- the loss functions of :mod:`moe_fold.dispatch.aux_losses` and the statistics of
  :mod:`moe_fold.dispatch.routing_stats`, re-exported here.

:class:`Router` is the module: the gate weight, the config's choices, the losses attached
through autograd, and the counts that cross ranks.

Ties are broken towards the lower index everywhere (expert index in top-k, group index in
group selection, token index in capacity dropping), so a kernel and a loop reference agree
on equal scores. ``torch.topk`` leaves that order unspecified, hence the stable sorts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from moe_fold.comm import all_reduce_
from moe_fold.config import (
    MoEConfig, capacity_factor_positive, choice, choices, experts_over_ep, group_ranked_scores, require,
    router_settings, routing_groups, zero_expert_settings,
)
from moe_fold.dispatch.aux_losses import attach_loss, aux_loss_scores, load_balancing_loss, z_loss
from moe_fold.dispatch.routing_stats import RoutingStats, load_stats, routing_stats
from moe_fold.kernels.topk import build_backend as build_topk_backend
from moe_fold.kernels.topk import topk_scores
from moe_fold.layout import ProcessGroups

__all__ = [
    "SCORE_FUNCTIONS", "DROP_POLICIES",
    "check_routing_args", "topk_routing", "routed", "expert_capacity", "capacity_of", "apply_capacity",
    "kept_within", "updated_expert_bias",
    "aux_loss_scores", "load_balancing_loss", "z_loss", "attach_loss", "RoutingStats", "routing_stats",
    "Router", "RouterOutput",
]

SCORE_FUNCTIONS = choices("moe.score_function")
DROP_POLICIES = choices("moe.drop_policy")


def check_routing_args(
    num_experts: int,
    topk: int,
    *,
    score: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    group_score: str = "topk_sum",
    scaling_factor: Optional[float] = None,
    expert_bias: bool = False,
    norm_min: Optional[float] = None,
) -> None:
    """Raise ConfigError naming the ``moe.*`` setting each argument stands for, its value and
    the rule it breaks (the rules of :func:`moe_fold.config.validate`)."""
    if not isinstance(topk, int) or isinstance(topk, bool):
        raise ValueError(f"topk={topk!r} must be an int")
    require(choice, "moe.score_function", score)
    require(choice, "moe.group_score", group_score)
    require(router_settings, MoEConfig(num_experts=num_experts, topk=topk, score_function=score,
                                       pre_softmax=pre_softmax, num_groups=num_groups, group_topk=group_topk,
                                       group_score=group_score, scaling_factor=scaling_factor,
                                       expert_bias=expert_bias, topk_norm_min=norm_min))
    require(routing_groups, num_experts, topk, num_groups, group_topk, group_score)


def _stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Ties go to the lower index (see the module docstring).
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def _select(scores: torch.Tensor, topk: int, num_groups: Optional[int],
            group_topk: Optional[int], ranked: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k values and expert indices per token, optionally limited to the best groups.
    A group's rank is the sum of its best ``ranked`` scores (max: the best one;
    :func:`moe_fold.config.group_ranked_scores` of ``moe.group_score``)."""
    if group_topk is None:
        return _stable_topk(scores, topk)
    num_tokens, num_experts = scores.shape
    per_group = num_experts // num_groups
    # [T, E] -> [T, groups, E/groups] -> [T, groups]
    group_scores = _stable_topk(scores.view(num_tokens, num_groups, per_group), ranked)[0].sum(-1)
    best = _stable_topk(group_scores, group_topk)[1]
    eligible = torch.zeros(num_tokens, num_groups, dtype=torch.bool, device=scores.device)
    eligible.scatter_(1, best, True)
    # [T, groups] -> [T, E]
    eligible = eligible.repeat_interleave(per_group, dim=1)
    return _stable_topk(scores.masked_fill(~eligible, float("-inf")), topk)


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score: str = "softmax",
    pre_softmax: bool = False,
    num_groups: Optional[int] = None,
    group_topk: Optional[int] = None,
    group_score: str = "topk_sum",
    scaling_factor: Optional[float] = None,
    expert_bias: Optional[torch.Tensor] = None,
    norm_min: Optional[float] = None,
    backend: str = "torch",
    forced: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to ``topk`` experts.

    Args:
        logits: ``[T, E]`` router logits.
        score: ``softmax`` or ``sigmoid``.
        pre_softmax: softmax only. True: softmax over all experts, then top-k (the probs are
            those softmax values, not renormalised). False (default): top-k of the logits,
            then softmax over the k chosen logits.
        num_groups, group_topk: group-limited routing. Experts form ``num_groups`` equal
            groups, ranked by ``group_score`` on the selection scores (logits for post-softmax,
            sigmoid + bias with an expert bias); only the best ``group_topk`` groups are eligible.
        group_score: ``topk_sum`` (Megatron-Core): the sum of a group's top ``topk/group_topk``
            scores; ``top2_sum`` (DeepSeek-V3, GLM-4.5): the sum of its top 2 whatever topk is;
            ``max`` (DeepSeek-V2): its best score.
        scaling_factor: multiplies the final probs.
        expert_bias: ``[E]``, sigmoid or pre_softmax. Selection uses ``scores + bias`` (the
            sigmoid, or the softmax over all experts: ERNIE-4.5); the probs use the unbiased
            scores. With k > 1 sigmoid probs are normalised over the k chosen.
        norm_min: pre_softmax only: the k probs are renormalised, divided by
            ``max(their sum, norm_min)`` (ERNIE-4.5's ``moe_norm_min``); None keeps them.
        backend: ``torch`` (sorts and scatters, here), ``triton`` (one fused kernel,
            :mod:`moe_fold.kernels.topk_triton`; not with groups or a bias) or ``auto``
            (:func:`moe_fold.kernels.topk.resolve_backend`: Triton on CUDA, torch on CPU).
            Both give the same experts (ties to the lower index) and probs and gradients
            within float rounding (tests/dispatch/test_router.py::test_triton_topk_equals_the_torch_path,
            rtol 1e-6 in float32).
        forced: ``[T, topk]`` int64, router replay: these experts instead of the selection
            (groups and the expert bias choose nothing then); the probs are the scores at
            them, computed as for a selection (Megatron-Core's router replay), so the
            router keeps its gradient.

    Returns:
        ``probs [T, E]`` (float32, or float64 for float64 logits; zero off the chosen
        experts; differentiable w.r.t. ``logits``) and ``routing_map [T, E]`` bool with
        exactly ``topk`` True per row.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    check_routing_args(num_experts, topk, score=score, pre_softmax=pre_softmax, num_groups=num_groups,
                       group_topk=group_topk, group_score=group_score, scaling_factor=scaling_factor,
                       expert_bias=expert_bias is not None, norm_min=norm_min)
    if expert_bias is not None and tuple(expert_bias.shape) != (num_experts,):
        raise ValueError(f"expert_bias must have shape ({num_experts},), got {tuple(expert_bias.shape)}")
    fusable = group_topk is None and expert_bias is None and norm_min is None and forced is None
    ranked = group_ranked_scores(group_score, topk, group_topk) if group_topk is not None else 0
    return routed(logits, topk, score=score, pre_softmax=pre_softmax, num_groups=num_groups, group_topk=group_topk,
                  ranked=ranked, scaling_factor=scaling_factor, expert_bias=expert_bias, norm_min=norm_min,
                  backend=build_topk_backend(backend, fusable=fusable), forced=forced)


def routed(logits: torch.Tensor, topk: int, *, score: str, pre_softmax: bool, num_groups: Optional[int],
           group_topk: Optional[int], ranked: int, scaling_factor: Optional[float],
           expert_bias: Optional[torch.Tensor], norm_min: Optional[float],
           backend: str, forced: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_routing` with every argument already checked and ``backend`` from
    :func:`moe_fold.kernels.topk.build_backend`: tensor work only, what :class:`Router`'s
    forward calls. ``ranked``: the best scores that rank a group (ignored without groups).
    Plain top-k is one op (:func:`moe_fold.kernels.topk.topk_scores`, the Triton kernel or
    torch); groups, a bias, a renormalisation floor or replayed experts (``forced``) run
    the torch ops here."""
    if group_topk is None and expert_bias is None and norm_min is None and forced is None:
        # The op computes in float32 (float64 for float64 logits), like `work` below.
        probs, routing_map = topk_scores(logits, topk, score, pre_softmax, backend)
        return (probs if scaling_factor is None else probs * scaling_factor), routing_map
    work = logits if logits.dtype == torch.float64 else logits.float()

    if score == "softmax" and not pre_softmax:
        if forced is not None:
            top = forced
            top_logits = work.gather(1, top)
        else:
            top_logits, top = _select(work, topk, num_groups, group_topk, ranked)
        probs = torch.softmax(top_logits, dim=-1)
    else:
        # Scores over all experts: the softmax (pre_softmax) or the sigmoid of each logit.
        scores = torch.softmax(work, dim=-1) if score == "softmax" else torch.sigmoid(work)
        if forced is not None:
            top = forced
            probs = scores.gather(1, forced)
        elif expert_bias is not None:
            top = _select(scores + expert_bias.to(scores.dtype), topk, num_groups, group_topk, ranked)[1]
            probs = scores.gather(1, top)
        else:
            probs, top = _select(scores, topk, num_groups, group_topk, ranked)
        if score == "sigmoid" and topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        elif norm_min is not None:
            probs = probs / probs.sum(dim=-1, keepdim=True).clamp(min=norm_min)
    if scaling_factor is not None:
        probs = probs * scaling_factor

    # [T, k] -> [T, E]
    dense = torch.zeros_like(work).scatter(1, top, probs)
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, top, True)
    return dense, routing_map


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens one expert accepts: ``ceil(T * k / E * capacity_factor)`` (Megatron's order of
    operations, so float rounding gives the same integer)."""
    if not isinstance(capacity_factor, (int, float)) or isinstance(capacity_factor, bool):
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a number")
    require(capacity_factor_positive, capacity_factor)
    return capacity_of(num_tokens, num_experts, topk, capacity_factor)


def capacity_of(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """:func:`expert_capacity` of a factor already checked: arithmetic only, for forwards."""
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def apply_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    capacity_factor: float,
    *,
    policy: str = "probs",
    pad_to_capacity: bool = False,
    topk: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the assignments beyond each expert's capacity.

    Capacity is :func:`expert_capacity` of ``T`` tokens with ``topk`` experts each (``topk``
    is read from ``routing_map`` when not given, which costs a host sync). Policy ``probs``
    keeps each expert's highest-prob tokens, ``position`` its earliest tokens; ties keep the
    earlier token. With ``pad_to_capacity`` every expert gets exactly ``min(capacity, T)``
    slots: its kept tokens, then the earliest tokens not routed to it, with prob 0 (so the
    dispatcher moves fixed-size blocks).

    Returns ``(probs * kept, kept)`` with ``kept [T, E]`` bool.
    """
    if probs.dim() != 2 or probs.shape != routing_map.shape:
        raise ValueError(f"probs {tuple(probs.shape)} and routing_map {tuple(routing_map.shape)} "
                         "must both be [tokens, experts]")
    if routing_map.dtype != torch.bool:
        raise ValueError(f"routing_map must be bool, got {routing_map.dtype}")
    require(choice, "moe.drop_policy", policy)
    num_tokens, num_experts = probs.shape
    if topk is None:
        per_token = routing_map.sum(dim=1)
        topk = int(per_token[0]) if num_tokens else 1
        if num_tokens and not bool((per_token == topk).all()):
            raise ValueError("routing_map rows choose different numbers of experts; pass topk=")
    capacity = min(expert_capacity(num_tokens, num_experts, topk, capacity_factor), num_tokens)
    return kept_within(probs, routing_map, capacity, policy=policy, pad_to_capacity=pad_to_capacity)


def kept_within(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, *, policy: str,
                pad_to_capacity: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_capacity` with ``capacity`` (at most T) given and the arguments already
    checked: tensor work only, what :class:`Router`'s forward calls."""
    # Routed tokens sort before the others (probs are >= 0 > -1); the stable sort keeps
    # equal keys in token order.
    if policy == "probs":
        key = torch.where(routing_map, probs.detach(), torch.full_like(probs, -1.0))
    else:
        key = routing_map.to(probs.dtype)
    order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]  # [capacity, E]
    kept = torch.zeros_like(routing_map).scatter_(0, order, True)
    if not pad_to_capacity:
        kept &= routing_map
    return probs * kept, kept


def updated_expert_bias(expert_bias: torch.Tensor, tokens_per_expert: torch.Tensor, rate: float,
                        zero_experts: int = 0) -> torch.Tensor:
    """One aux-loss-free balancing step: ``b + rate * sign(mean(count) - count)``.

    ``tokens_per_expert`` must already be summed over every rank that shares the router
    (tp x dp x cp) and over the step's micro-batches. The last ``zero_experts`` columns
    are zero-computation experts (LongCat-Flash): their bias stays, and every held expert
    aims at the mean over all columns, so at balance a share ``E / (E + Z)`` of the
    assignments reaches held experts (LongCat's budget of ``topk * E / (E + Z)`` computed
    experts per token on average).
    """
    counts = tokens_per_expert.to(torch.float64)
    step = rate * torch.sign(counts.mean() - counts)
    if zero_experts:
        step[counts.shape[0] - zero_experts:] = 0.0
    return expert_bias + step.to(expert_bias.dtype)


# --------------------------------------------------------------------------- the module

@dataclass
class RouterOutput:
    # [T, E] routing weights of the held experts, zero off the kept ones; the load-balancing
    # losses ride on it (see attach_loss), so it must feed the expert outputs.
    probs: torch.Tensor
    # [T, E] bool, after capacity dropping (with pad_to_capacity: exactly capacity per
    # expert): what the dispatcher moves, never a zero expert.
    routing_map: torch.Tensor
    # [T, E + Z] in the router dtype, z-loss attached (Z = moe.zero_experts).
    logits: torch.Tensor
    # [E] int64: this rank's assignments per held expert, what the dispatcher moves.
    tokens_per_expert: torch.Tensor
    # [T, E + Z] the router's choice before capacity dropping (without capacity and zero
    # experts, the same tensors as probs and routing_map): what route traces record.
    routed_probs: torch.Tensor
    routed_map: torch.Tensor
    # Detached micro-batch values without coefficients, for logging: "aux", "seq_aux",
    # "z" (whole micro-batch over tp x cp) and "global_aux" (over tp x dp x cp, with the
    # step's running counts, i.e. the value the gradient follows); only the enabled ones.
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    stats: Optional[RoutingStats] = None
    # [T] with moe.zero_experts: each token's summed gate weight on zero experts, the factor
    # on its own input that the MoE layer adds where the token is; None without.
    zero_probs: Optional[torch.Tensor] = None


_ROUTER_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class Router(nn.Module):
    """Gate ``[E, H]`` -> logits -> :func:`topk_routing` -> optional capacity, with the
    load-balancing losses and the aux-loss-free expert bias of ``MoEConfig``.

    Parallelism: the router weight is replicated; ranks of one tp x cp group hold
    different tokens of the same micro-batch (sequence parallel, context parallel), dp
    ranks different micro-batches. Counts are summed over tp x cp (``aux``, ``seq_aux``,
    ``z``) or tp x dp x cp (``global_aux``, expert bias) with a plain all-reduce; each rank
    back-propagates its own share of a loss. The gradient each rank attaches assumes the
    project's rule (docs/architecture.md, "Parallel folding"): router grads are summed over
    tp and averaged over dp x cp, and each micro-batch's main loss carries its share of
    the step's mean, which the training step passes to every forward as ``loss_scale``
    (1/num_microbatches). So a share is scaled by cp (by dp x cp for ``global_aux``, whose
    loss spans dp), and the gradients equal those of one process running the same global
    batch.

    Per optimizer step the training loop calls :meth:`finish_step` once, after the last
    backward: it updates the expert bias and closes the ``global_aux`` accumulation.
    A training forward adds to those step counts, so activation recompute must leave the
    router outside the recomputed region (a second forward would count twice).
    """

    def __init__(self, config: MoEConfig, hidden_size: int, groups: ProcessGroups, *, init_std: float = 0.02):
        super().__init__()
        for dotted in ("moe.score_function", "moe.group_score", "moe.topk_backend", "moe.router_dtype",
                       "moe.drop_policy"):
            require(choice, dotted, getattr(config, dotted.partition(".")[2]))
        require(router_settings, config)
        require(routing_groups, config.num_experts, config.topk, config.num_groups, config.group_topk,
                config.group_score, config.zero_experts)
        require(zero_expert_settings, config)
        require(experts_over_ep, config.num_experts, groups.size("ep"))
        self.groups = groups
        # The options a forward uses, as plain attributes: a forward reads no config object.
        self.num_experts, self.topk = config.num_experts, config.topk
        self.score_function, self.pre_softmax = config.score_function, config.pre_softmax
        self.num_groups, self.group_topk = config.num_groups, config.group_topk
        self.scaling_factor, self.topk_norm_min = config.scaling_factor, config.topk_norm_min
        self.capacity_factor, self.drop_policy = config.capacity_factor, config.drop_policy
        self.pad_to_capacity, self.input_jitter = config.pad_to_capacity, config.input_jitter
        self.z_loss_coeff, self.aux_loss_coeff = config.z_loss_coeff, config.aux_loss_coeff
        self.seq_aux_loss_coeff, self.global_aux_loss_coeff = config.seq_aux_loss_coeff, config.global_aux_loss_coeff
        self.bias_update_rate = config.bias_update_rate
        # Resolved here so that a forward only does tensor work (nothing of the config's rules).
        self._ranked = (group_ranked_scores(config.group_score, config.topk, config.group_topk)
                        if config.group_topk is not None else 0)
        fusable = config.num_groups is None and not config.expert_bias and config.topk_norm_min is None
        self.topk_backend = build_topk_backend(config.topk_backend, fusable=fusable)
        self.hidden_size = hidden_size
        self.dtype = _ROUTER_DTYPES[config.router_dtype]
        # Zero experts are router columns after the held experts (LongCat-Flash): scored,
        # biased and balanced like them, never dispatched.
        self.zero_experts = config.zero_experts
        E = self.num_columns = config.num_experts + config.zero_experts
        self.weight = nn.Parameter(torch.empty(E, hidden_size))
        nn.init.normal_(self.weight, std=init_std)
        # gpt-oss: the router is a linear with bias (moe.router_bias).
        self.bias = nn.Parameter(torch.zeros(E)) if config.router_bias else None
        self.collect_stats = True
        if config.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(E))
            self.register_buffer("_bias_counts", torch.zeros(E, dtype=torch.float64), persistent=False)
        else:
            self.expert_bias = None
        # global_aux accumulators over the micro-batches of the current step.
        self.register_buffer("_ga_counts", torch.zeros(E, dtype=torch.float64), persistent=False)
        self.register_buffer("_ga_prob_sums", torch.zeros(E, dtype=torch.float64), persistent=False)
        self.register_buffer("_ga_tokens", torch.zeros((), dtype=torch.float64), persistent=False)
        self._ga_microbatches = 0

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) must not cast the bias or the counts: bias steps of 1e-3 vanish
        # in bf16 and counts above 256 stop being exact. They follow the device only.
        dtypes = {name: b.dtype for name, b in self.named_buffers(recurse=False)}
        super()._apply(fn, recurse)
        for name, dtype in dtypes.items():
            buffer = getattr(self, name)
            if buffer.dtype != dtype:
                setattr(self, name, buffer.to(dtype))
        return self

    def forward(
        self,
        hidden: torch.Tensor,
        *,
        loss_mask: Optional[torch.Tensor] = None,
        seq_ids: Optional[torch.Tensor] = None,
        num_seqs: Optional[int] = None,
        forced: Optional[torch.Tensor] = None,
        loss_scale: float = 1.0,
    ) -> RouterOutput:
        """Route this rank's tokens.

        Args:
            hidden: ``[T, H]`` this rank's tokens.
            loss_mask: ``[T]`` bool, True for real tokens; padding is left out of the
                losses, the expert-bias counts and the statistics (it is still routed).
            seq_ids: ``[T]`` int64, each token's sequence in ``[0, num_seqs)`` within the
                micro-batch; needed when ``seq_aux_loss_coeff > 0``. Under SP/CP every rank
                of a tp x cp group holds a slice of each of the same ``num_seqs`` sequences.
            num_seqs: number of sequences in the micro-batch (the same on the tp x cp group).
            forced: ``[T, topk]`` int64, router replay: each token's experts (see
                :func:`topk_routing`); capacity and the losses then follow them.
            loss_scale: the factor on the gradients of the router losses: the micro-batch's
                share of the step (1/num_microbatches, from the training step).
        """
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden must be [tokens, {self.hidden_size}], got {tuple(hidden.shape)}")
        num_tokens = hidden.shape[0]
        if loss_mask is not None and (loss_mask.dtype != torch.bool or tuple(loss_mask.shape) != (num_tokens,)):
            raise ValueError(f"loss_mask must be a bool [{num_tokens}] tensor, got {loss_mask.dtype} "
                             f"{tuple(loss_mask.shape)}")
        if self.training and self.input_jitter > 0:
            eps = self.input_jitter
            hidden = hidden * torch.empty_like(hidden).uniform_(1.0 - eps, 1.0 + eps)
        # [T, H] x [E, H]^T -> [T, E]
        logits = hidden.to(self.dtype) @ self.weight.to(self.dtype).t()
        if self.bias is not None:
            logits = logits + self.bias.to(self.dtype)  # [E] on every token

        with_losses = self.training and torch.is_grad_enabled()
        losses: dict[str, torch.Tensor] = {}
        routed_logits = logits
        if with_losses and self.z_loss_coeff > 0:
            routed_logits = self._attach_z_loss(logits, loss_mask, losses, loss_scale)

        probs, routing_map = routed(
            routed_logits, self.topk, score=self.score_function, pre_softmax=self.pre_softmax,
            num_groups=self.num_groups, group_topk=self.group_topk, ranked=self._ranked,
            scaling_factor=self.scaling_factor, expert_bias=self.expert_bias, norm_min=self.topk_norm_min,
            backend=self.topk_backend, forced=forced)
        kept_probs, kept_map = probs, routing_map
        if self.capacity_factor is not None:
            capacity = min(capacity_of(num_tokens, self.num_experts, self.topk, self.capacity_factor), num_tokens)
            kept_probs, kept_map = kept_within(probs, routing_map, capacity, policy=self.drop_policy,
                                               pad_to_capacity=self.pad_to_capacity)
        if with_losses and (self.aux_loss_coeff > 0 or self.seq_aux_loss_coeff > 0 or self.global_aux_loss_coeff > 0):
            kept_probs = self._attach_balancing_losses(kept_probs, logits, routing_map, loss_mask,
                                                       seq_ids, num_seqs, losses, loss_scale)

        routed_counts = routing_map.sum(dim=0)  # [E + Z]
        if self.capacity_factor is None:
            routed_and_kept, kept_counts, tokens_per_expert = routing_map, routed_counts, routed_counts
        else:
            routed_and_kept = kept_map & routing_map
            kept_counts, tokens_per_expert = routed_and_kept.sum(dim=0), kept_map.sum(dim=0)
        if with_losses and self.expert_bias is not None:
            with torch.no_grad():
                if loss_mask is None:
                    self._bias_counts += kept_counts
                else:
                    self._bias_counts += (routed_and_kept & loss_mask.unsqueeze(1)).sum(dim=0)
        stats = None
        if self.collect_stats:
            if loss_mask is not None:
                # Statistics describe real tokens; padding is routed but not counted.
                real = loss_mask.unsqueeze(1)
                routed_counts, kept_counts = (routing_map & real).sum(dim=0), (routed_and_kept & real).sum(dim=0)
            held = self.num_experts
            stats = load_stats(routed_counts[:held], kept_counts[:held], self.groups.size("ep"),
                               routed_counts[held:].sum())
        zero_probs = None
        if self.zero_experts:
            # A zero expert returns its input: the layer adds input x gate weight where the
            # token is. [T, E + Z] -> [T, E] held experts (dispatched) and [T] zero weights.
            held = self.num_experts
            zero_probs = kept_probs[:, held:].sum(dim=1)
            kept_probs, kept_map, tokens_per_expert = kept_probs[:, :held], kept_map[:, :held], tokens_per_expert[:held]
        return RouterOutput(kept_probs, kept_map, routed_logits, tokens_per_expert, probs, routing_map, losses, stats,
                            zero_probs)

    def _attach_z_loss(self, logits, loss_mask, losses, loss_scale):
        local_sum = z_loss(logits, loss_mask, 1)
        with torch.no_grad():
            # torch.full, not torch.tensor: a Python number copied to a GPU blocks the host.
            valid = loss_mask.sum() if loss_mask is not None else torch.full((), logits.shape[0], device=logits.device)
            # [real tokens, sum of logsumexp^2] summed over tp x cp
            packed = torch.stack([valid.to(torch.float64), local_sum.detach().to(torch.float64)])
            all_reduce_(packed, self.groups.tp_cp)
        share = local_sum / packed[0].clamp(min=1).to(local_sum.dtype)
        losses["z"] = (packed[1] / packed[0].clamp(min=1)).to(logits.dtype)
        scale = self.z_loss_coeff * loss_scale * self.groups.size("cp")
        return attach_loss(logits, share, scale)

    def _attach_balancing_losses(self, probs, logits, routing_map, loss_mask, seq_ids, num_seqs, losses, loss_scale):
        # Every router column, zero experts included: balance pushes them to an equal share.
        E, k = self.num_columns, self.topk
        scores = aux_loss_scores(logits, self.score_function)
        if self.group_topk is not None or self.expert_bias is not None:
            # Megatron counts f_i from the plain top-k of these scores, without groups or bias.
            counted = torch.zeros_like(routing_map).scatter_(1, _stable_topk(scores.detach(), k)[1], True)
        else:
            counted = routing_map
        if loss_mask is not None:
            scores = scores * loss_mask.unsqueeze(1).to(scores.dtype)
            counted = counted & loss_mask.unsqueeze(1)
        with torch.no_grad():
            counts = counted.sum(dim=0).to(torch.float64)
            valid = (loss_mask.sum().to(torch.float64) if loss_mask is not None else
                     torch.full((), logits.shape[0], dtype=torch.float64, device=scores.device))
            prob_sums = scores.detach().sum(dim=0).to(torch.float64)

        total = torch.zeros((), dtype=scores.dtype, device=scores.device)
        cp = self.groups.size("cp")
        if self.aux_loss_coeff > 0 or self.seq_aux_loss_coeff > 0:
            parts = []
            if self.aux_loss_coeff > 0:
                parts += [counts, valid.view(1), prob_sums]
            if self.seq_aux_loss_coeff > 0:
                if seq_ids is None or num_seqs is None:
                    raise ValueError("moe.seq_aux_loss_coeff > 0 needs seq_ids and num_seqs in Router.forward")
                if tuple(seq_ids.shape) != (logits.shape[0],):
                    raise ValueError(f"seq_ids must have shape ({logits.shape[0]},), got {tuple(seq_ids.shape)}")
                with torch.no_grad():
                    # [T, E] -> [S, E]
                    seq_counts = torch.zeros(num_seqs, E, dtype=torch.float64, device=scores.device)
                    seq_counts.index_add_(0, seq_ids, counted.to(torch.float64))
                    seq_prob_sums = torch.zeros_like(seq_counts).index_add_(0, seq_ids, scores.detach().double())
                parts += [seq_counts.flatten(), seq_counts.sum(dim=1) / k, seq_prob_sums.flatten()]
            packed = torch.cat(parts)
            all_reduce_(packed, self.groups.tp_cp)
            if self.aux_loss_coeff > 0:
                c, n, p = packed[:E], packed[E], packed[E + 1:2 * E + 1]
                packed = packed[2 * E + 1:]
                total = total + self.aux_loss_coeff * cp * load_balancing_loss(scores, c, n, k)
                # The whole micro-batch's value: the summed scores as one row.
                losses["aux"] = load_balancing_loss(p.view(1, E), c, n, k).to(scores.dtype)
            if self.seq_aux_loss_coeff > 0:
                S = num_seqs
                c, n, p = packed[:S * E].view(S, E), packed[S * E:S * E + S], packed[S * E + S:].view(S, E)
                total = total + self.seq_aux_loss_coeff * cp * load_balancing_loss(scores, c, n, k, seq_ids=seq_ids)
                own = torch.arange(S, device=scores.device)
                losses["seq_aux"] = load_balancing_loss(p, c, n, k, seq_ids=own).to(scores.dtype)
        if self.global_aux_loss_coeff > 0:
            packed = torch.cat([counts, valid.view(1), prob_sums])
            all_reduce_(packed, self.groups.tp_dp_cp)
            c, n, p = packed[:E], packed[E], packed[E + 1:]
            with torch.no_grad():
                self._ga_counts += c
                self._ga_tokens += n
                self._ga_prob_sums += p
            self._ga_microbatches += 1
            # Counts of the micro-batches seen so far this step, per micro-batch (Megatron's
            # running estimate: a backward cannot wait for the step's later micro-batches).
            running = self._ga_counts / self._ga_microbatches
            dp = self.groups.size("dp")
            total = total + self.global_aux_loss_coeff * cp * dp * load_balancing_loss(scores, running, n, k)
            losses["global_aux"] = load_balancing_loss(p.view(1, E), running, n, k).to(scores.dtype)
        return attach_loss(probs, total, loss_scale)

    def finish_step(self) -> dict[str, torch.Tensor]:
        """Close one optimizer step: update the expert bias, return the step's exact
        ``global_aux`` value (counts and scores of every micro-batch on every tp x dp x cp
        rank, so it does not depend on how the global batch was split), reset the counts."""
        out = {}
        if self._ga_microbatches:
            E, k = self.num_columns, self.topk
            out["global_aux"] = load_balancing_loss(self._ga_prob_sums.view(1, E), self._ga_counts,
                                                    self._ga_tokens, k)
        self._ga_counts.zero_()
        self._ga_prob_sums.zero_()
        self._ga_tokens.zero_()
        self._ga_microbatches = 0
        if self.expert_bias is not None:
            self.update_expert_bias()
        return out

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """``b += rate * sign(mean_count - count_i)`` from the counts of every forward since
        the last update, summed over tp x dp x cp; then clear them. :meth:`finish_step`
        calls it; a second call in the same step sees no counts and changes nothing."""
        if self.expert_bias is None:
            raise ValueError("update_expert_bias needs moe.expert_bias=True")
        counts = self._bias_counts.clone()
        all_reduce_(counts, self.groups.tp_dp_cp)
        self.expert_bias.copy_(updated_expert_bias(self.expert_bias, counts, self.bias_update_rate,
                                                   self.zero_experts))
        self._bias_counts.zero_()

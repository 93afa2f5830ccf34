"""Rules of the MoE layers: which layers are MoE, the router, dispatch modes, the experts'
widths over etp, experts over ep, group-limited routing, overlap and expert placement."""

from __future__ import annotations

import math
from typing import Optional

from ..derived import etp_size, moe_layer_flags
from ..schema import Config, MoEConfig, _fmt
from .common import _at_least, _divisible, _positive, rule


def _check_layer_pattern(config: Config, out: list[str]) -> list[bool] | None:
    """Checks moe_layer_freq and first_k_dense; returns the MoE flags when defined."""
    m, moe = config.model, config.moe
    ok = True
    freq = moe.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers:
            out.append(f"moe.moe_layer_freq has {len(freq)} entries, expected one per layer "
                       f"(model.num_layers={m.num_layers})")
            ok = False
        for i, f in enumerate(freq):
            if f not in (0, 1):
                out.append(f"moe.moe_layer_freq[{i}]={f} must be 0 or 1")
                ok = False
    else:
        ok = _at_least(out, "moe.moe_layer_freq", freq, 0)
    if not 0 <= moe.first_k_dense <= m.num_layers:
        out.append(f"moe.first_k_dense={moe.first_k_dense} must be in [0, model.num_layers={m.num_layers}]")
    return moe_layer_flags(config) if ok else None


def _check_moe(config: Config, any_moe: bool, out: list[str]) -> None:
    moe, p = config.moe, config.parallel
    if config.model.block == "single_mixer" and (moe.moe_layer_freq != 1 or moe.first_k_dense):
        out.append(f"moe.moe_layer_freq={_fmt(moe.moe_layer_freq)} and moe.first_k_dense={moe.first_k_dense} "
                   f"with model.block=single_mixer: the MoE layers are the model.layer_types entries "
                   f"'moe'; leave moe.moe_layer_freq=1 and moe.first_k_dense=0")
    out.extend(router_settings(moe))
    out.extend(dispatch_modes(moe.dispatcher, moe.capacity_factor, moe.pad_to_capacity, moe.dedup))
    out.extend(gate_needs_shared_expert(moe.shared_expert_gate, moe.shared_expert_ffn_hidden_size))
    if moe.activation == "clamped_swiglu":
        _positive(out, "moe.swiglu_alpha", moe.swiglu_alpha)
        _positive(out, "moe.swiglu_limit", moe.swiglu_limit)
    out.extend(activation_backend(moe.activation, moe.swiglu_backend))
    _at_least(out, "moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size, 0)
    out.extend(overlap_problems(moe))
    out.extend(zero_expert_settings(moe))
    out.extend(latent_size_positive(moe.latent_size))
    _check_placement(config, out)
    if not any_moe:
        return
    out.extend(moe_needs_sequence_parallel(p.tp, p.sequence_parallel))
    if _at_least(out, "moe.ffn_hidden_size", moe.ffn_hidden_size, 1) and p.tp >= 1:
        out.extend(expert_width_over_etp(moe.ffn_hidden_size, etp_size(config), p.etp is None))
    if moe.shared_expert_ffn_hidden_size > 0:
        _divisible(out, "moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size,
                   "parallel.tp", p.tp)
    out.extend(expert_bias_over_etp(moe.expert_linear_bias, moe.latent_size or config.model.hidden_size,
                                    etp_size(config), p.etp is None, moe.latent_size is not None))
    if moe.num_experts < 1:
        out.append(f"moe.num_experts={moe.num_experts} must be >= 1 when any layer is MoE "
                   f"(moe.moe_layer_freq={_fmt(moe.moe_layer_freq)}, moe.first_k_dense={moe.first_k_dense})")
        return
    out.extend(experts_over_ep(moe.num_experts, p.ep))
    out.extend(routing_groups(moe.num_experts, moe.topk, moe.num_groups, moe.group_topk, moe.group_score,
                              moe.zero_experts))


@rule
def router_settings(moe: MoEConfig) -> list[str]:
    """The router's settings that need no expert count: score function pairs, the fused
    top-k's limits, scales and loss coefficients, the capacity factor."""
    out = []
    if moe.topk_backend == "triton" and (moe.num_groups is not None or moe.expert_bias):
        out.append(f"moe.topk_backend=triton fuses plain top-k only; moe.num_groups={_fmt(moe.num_groups)} and "
                   f"moe.expert_bias={_fmt(moe.expert_bias)} need moe.topk_backend=torch (or auto)")
    if moe.expert_bias and not (moe.score_function == "sigmoid" or moe.pre_softmax):
        out.append(f"moe.expert_bias=true requires moe.score_function=sigmoid, got {_fmt(moe.score_function)} (or "
                   f"moe.pre_softmax=true: the bias is added to the softmax over all experts, as in ERNIE-4.5)")
    # ERNIE-4.5's moe_norm_min: renormalising the top-k of the softmax over all experts.
    if moe.topk_norm_min is not None:
        if not moe.pre_softmax:
            out.append(f"moe.topk_norm_min={_fmt(moe.topk_norm_min)} requires moe.pre_softmax=true (it renormalises "
                       f"the top-k of the softmax over all experts)")
        if not (moe.topk_norm_min > 0 and math.isfinite(moe.topk_norm_min)):
            out.append(f"moe.topk_norm_min={_fmt(moe.topk_norm_min)} must be a finite number > 0 when set")
        if moe.topk_backend == "triton":
            out.append(f"moe.topk_backend=triton fuses plain top-k only; moe.topk_norm_min="
                       f"{_fmt(moe.topk_norm_min)} needs moe.topk_backend=torch (or auto)")
    if moe.pre_softmax and moe.score_function != "softmax":
        out.append(f"moe.pre_softmax=true requires moe.score_function=softmax, got {_fmt(moe.score_function)}")
    if moe.scaling_factor is not None and not moe.scaling_factor > 0:
        out.append(f"moe.scaling_factor={_fmt(moe.scaling_factor)} must be > 0 when set")
    for name in ("input_jitter", "bias_update_rate", "aux_loss_coeff", "seq_aux_loss_coeff",
                 "global_aux_loss_coeff", "z_loss_coeff"):
        if _at_least(out, f"moe.{name}", getattr(moe, name), 0) and not math.isfinite(getattr(moe, name)):
            out.append(f"moe.{name}={_fmt(getattr(moe, name))} must be finite")
    out.extend(capacity_factor_positive(moe.capacity_factor))
    return out


@rule
def capacity_factor_positive(capacity_factor: Optional[float]) -> list[str]:
    """An expert's capacity is ceil(tokens * topk / num_experts * capacity_factor)."""
    if capacity_factor is not None and not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        return [f"moe.capacity_factor={_fmt(capacity_factor)} must be > 0, or null for dropless"]
    return []


@rule
def dispatch_modes(dispatcher: str, capacity_factor: Optional[float], pad_to_capacity: bool,
                   dedup: bool) -> list[str]:
    """Which dispatcher runs padding to capacity and the rank-deduplicated exchange."""
    out = []
    if pad_to_capacity and capacity_factor is None:
        out.append("moe.pad_to_capacity=true requires moe.capacity_factor to be set, got null")
    if dedup and dispatcher != "alltoall":
        out.append(f"moe.dedup=true requires moe.dispatcher=alltoall, got {_fmt(dispatcher)}")
    if pad_to_capacity and dispatcher != "alltoall":
        out.append(f"moe.pad_to_capacity=true requires moe.dispatcher=alltoall, got {_fmt(dispatcher)}")
    if dedup and pad_to_capacity:
        out.append("moe.dedup=true cannot run with moe.pad_to_capacity=true: the padded exchange sends a fixed "
                   "capacity of rows per expert, the deduplicated one a data-dependent number per rank")
    return out


@rule
def gate_needs_shared_expert(gate: bool, shared_expert_ffn_hidden_size: int) -> list[str]:
    """The shared expert's gate scales a shared expert's output."""
    if gate and not shared_expert_ffn_hidden_size > 0:
        return [f"moe.shared_expert_gate=true requires a shared expert (moe.shared_expert_ffn_hidden_size > 0), "
                f"got {_fmt(shared_expert_ffn_hidden_size)}"]
    return []


@rule
def moe_needs_sequence_parallel(tp: int, sequence_parallel: bool) -> list[str]:
    """Under tp an MoE layer routes each token once: every token lives on one rank of the tp group."""
    if tp > 1 and not sequence_parallel:
        return [f"parallel.tp={tp} with MoE layers requires parallel.sequence_parallel=true"]
    return []


@rule
def expert_width_over_etp(ffn_hidden_size: int, etp: int, etp_is_tp: bool = False) -> list[str]:
    """An expert's ffn dim is split over etp (``etp_is_tp``: parallel.etp is null, so over tp)."""
    if etp < 1 or not ffn_hidden_size % etp:
        return []
    if etp_is_tp:
        return [f"moe.ffn_hidden_size={ffn_hidden_size} is not divisible by parallel.tp={etp} "
                f"(parallel.etp is null, so experts are split over tp)"]
    return [f"moe.ffn_hidden_size={ffn_hidden_size} is not divisible by parallel.etp={etp}"]


@rule
def activation_backend(activation: str, swiglu_backend: str) -> list[str]:
    """gpt-oss's clamped SwiGLU and Nemotron-H's relu2 run on torch ops only (kernels/swiglu.py)."""
    if activation in ("clamped_swiglu", "relu2") and swiglu_backend not in ("auto", "torch"):
        return [f"moe.swiglu_backend={_fmt(swiglu_backend)} with moe.activation={activation}: this activation "
                f"runs on torch ops only; set moe.swiglu_backend=torch (or auto)"]
    return []


@rule
def expert_bias_over_etp(linear_bias: bool, hidden_size: int, etp: int, etp_is_tp: bool = False,
                         latent: bool = False) -> list[str]:
    """Each etp rank adds its 1/etp slice of fc2's bias, so the etp sum adds it once; fc2's
    output is the experts' width, ``hidden_size`` here (``moe.latent_size`` when ``latent``)."""
    if not linear_bias or etp <= 1 or not hidden_size % etp:
        return []
    return [f"{'moe.latent_size' if latent else 'model.hidden_size'}={hidden_size} is not divisible by "
            f"{'parallel.tp' if etp_is_tp else 'parallel.etp'}={etp} (moe.expert_linear_bias=true splits fc2's bias "
            f"over the expert-tensor ranks)"]


@rule
def latent_size_positive(latent_size: Optional[int]) -> list[str]:
    """A latent MoE's experts work in ``moe.latent_size`` columns (null: off)."""
    if latent_size is not None and not latent_size >= 1:
        return [f"moe.latent_size={_fmt(latent_size)} must be >= 1 when set (the routed experts' width), or null "
                f"for experts in the hidden width"]
    return []


@rule
def experts_over_ep(num_experts: int, ep: int) -> list[str]:
    """Every ep rank holds num_experts/ep experts (dispatchers, experts, placements, statistics)."""
    if ep >= 1 and num_experts % ep:
        return [f"moe.num_experts={num_experts} is not divisible by parallel.ep={ep}"]
    return []


@rule
def routing_groups(num_experts: int, topk: int, num_groups: Optional[int], group_topk: Optional[int],
                   group_score: str, zero_experts: int = 0) -> list[str]:
    """A token's topk experts exist (zero experts count: the router picks among both);
    group-limited routing picks group_topk of num_groups groups, then topk experts inside
    them (ranking a group by moe.group_score)."""
    out = []
    if zero_experts > 0 and not 1 <= topk <= num_experts + zero_experts:
        out.append(f"moe.topk={topk} must be in [1, moe.num_experts + moe.zero_experts={num_experts + zero_experts}]")
    elif zero_experts <= 0 and not 1 <= topk <= num_experts:
        out.append(f"moe.topk={topk} must be in [1, moe.num_experts={num_experts}]")
    groups = num_groups
    if (groups is None) != (group_topk is None):
        out.append(f"moe.num_groups={_fmt(groups)} and moe.group_topk={_fmt(group_topk)} "
                   f"must be both set or both null")
        return out
    if groups is None:
        return out
    ok = _at_least(out, "moe.num_groups", groups, 1)
    ok &= _at_least(out, "moe.group_topk", group_topk, 1)
    if not ok:
        return out
    if num_experts % groups:
        out.append(f"moe.num_experts={num_experts} is not divisible by moe.num_groups={groups}")
        return out
    if group_topk > groups:
        out.append(f"moe.group_topk={group_topk} must be <= moe.num_groups={groups}")
        return out
    if group_score == "topk_sum":
        # Groups are ranked by the sum of their best topk/group_topk scores.
        _divisible(out, "moe.topk", topk, "moe.group_topk", group_topk,
                   " (each selected group is scored by its best topk/group_topk experts)")
    elif group_score == "top2_sum" and num_experts // groups < 2:
        out.append(f"moe.group_score=top2_sum needs >= 2 experts per group, got moe.num_experts/moe.num_groups="
                   f"{num_experts // groups}")
    reachable = group_topk * (num_experts // groups)
    if topk > reachable:
        out.append(f"moe.topk={topk} exceeds the {reachable} experts in the selected groups "
                   f"(moe.group_topk={group_topk} * moe.num_experts/moe.num_groups="
                   f"{num_experts // groups})")
    return out


@rule
def overlap_problems(moe: MoEConfig) -> list[str]:
    """What is wrong with ``moe.shared_expert_overlap`` / ``moe.overlap_chunks``."""
    problems = []
    if moe.shared_expert_overlap and moe.shared_expert_ffn_hidden_size <= 0:
        problems.append(f"moe.shared_expert_overlap=true needs a shared expert "
                        f"(moe.shared_expert_ffn_hidden_size > 0, got {moe.shared_expert_ffn_hidden_size})")
    if not moe.overlap_chunks >= 1:
        problems.append(f"moe.overlap_chunks={_fmt(moe.overlap_chunks)} must be >= 1")
    elif moe.overlap_chunks > 1 and moe.pad_to_capacity:
        problems.append(f"moe.overlap_chunks={moe.overlap_chunks} requires moe.pad_to_capacity=false: one chunk "
                        f"may hold all of an expert's tokens, so every chunk would be padded to the layer's "
                        f"whole capacity, multiplying the bytes sent by the number of chunks")
    return problems


@rule
def zero_expert_settings(moe: MoEConfig) -> list[str]:
    """Zero-computation experts (LongCat-Flash) are router columns after the routed experts
    that no rank holds: what needs every column to be a held expert refuses them."""
    out = []
    if not _at_least(out, "moe.zero_experts", moe.zero_experts, 0) or moe.zero_experts == 0:
        return out
    if moe.capacity_factor is not None:
        out.append(f"moe.zero_experts={moe.zero_experts} cannot run with moe.capacity_factor="
                   f"{_fmt(moe.capacity_factor)}: a capacity is per held expert, and a zero expert is held by "
                   f"no rank (set moe.capacity_factor=null, dropless)")
    if moe.num_groups is not None:
        out.append(f"moe.zero_experts={moe.zero_experts} cannot run with moe.num_groups={_fmt(moe.num_groups)}: "
                   f"routing groups split the held experts, and zero experts belong to no group")
    if moe.router_replay is not None:
        out.append(f"moe.zero_experts={moe.zero_experts} cannot run with moe.router_replay="
                   f"{_fmt(moe.router_replay)}: route files record held experts only")
    return out


def _check_placement(config: Config, out: list[str]) -> None:
    moe, ep = config.moe, config.parallel.ep
    replicas_ok = _at_least(out, "moe.replicas", moe.replicas, 0)
    every_ok = _at_least(out, "moe.replace_every", moe.replace_every, 0)
    if ep < 1 or moe.num_experts < 1:
        return
    if replicas_ok:
        out.extend(replicas_fit(moe.num_experts, ep, moe.replicas))
    if every_ok:
        out.extend(replacement_has_room(moe.replace_every, ep))


@rule
def replicas_fit(num_experts: int, ep: int, replicas: int) -> list[str]:
    """A rank's replicas spare slots hold copies of other ranks' experts, at most one copy of
    an expert on a rank."""
    if replicas <= 0:
        return []
    if ep == 1:
        return [f"moe.replicas={replicas} needs parallel.ep > 1, got 1 (a copy of an expert lives "
                f"on another ep rank)"]
    if not experts_over_ep(num_experts, ep) and replicas > num_experts - num_experts // ep:
        return [f"moe.replicas={replicas} must be <= moe.num_experts - moe.num_experts/parallel.ep="
                f"{num_experts - num_experts // ep} (a rank holds at most one copy of an expert)"]
    return []


@rule
def replacement_has_room(replace_every: int, ep: int) -> list[str]:
    """Re-placing experts moves them between ep ranks."""
    if replace_every > 0 and ep == 1:
        return [f"moe.replace_every={replace_every} needs parallel.ep > 1, got 1 (with one ep rank "
                f"there is nowhere to move an expert)"]
    return []

"""Routing-aware planning: what the expert loads a run measured do to its busiest ep rank.

A run records, every step, each MoE layer's expert load over the global batch
(``expert_load`` in ``<run_dir>/metrics.jsonl``, :mod:`moe_fold.training.metrics`). The
planner otherwise assumes balanced routing; here it replays the recorded loads through the
placement policies moe-fold has and measures, per step and layer, the busiest ep rank's
expert rows over the mean of the ranks:

- ``static``: the contiguous placement (rank j holds experts ``[j E/ep, (j+1) E/ep)``);
- ``replaced``: every ``replace_every`` steps, :func:`moe_fold.dispatch.placement.balanced_placement`
  from the load of the steps since the last re-placement, taken when it lowers that window's
  busiest-rank load by at least ``min_gain`` (:data:`MIN_GAIN`, what ``moe.replace_every``
  does in training, :mod:`moe_fold.training.replace`);
- ``replicated``: the same with ``replicas`` spare slots per rank for copies of the hottest
  experts (``moe.replicas``; a copied expert's tokens split evenly between its copies);
- ``capacity``: the static placement with every expert capped at ``capacity_factor`` times
  the mean expert load (``moe.capacity_factor``; the rest dropped).

A rank's rows are :func:`moe_fold.dispatch.placement.rank_loads` of the step's loads, the
same count :mod:`bench.placement` measures as the rows its dispatcher delivers. The
global batch's loads stand for every ep group's: with more data-parallel replicas of the
experts (edp > 1) each group sees a share of the batch, whose skew is at least as large.

The busiest rank's ratio averaged over steps (``time``) sets the step: every rank waits for
it in the combine. Its worst step (``peak``) sets the dropless activation memory, which is
where out-of-memory happens. :func:`skew` turns a policy's ratios into the
:class:`moe_fold.planner.estimate.RoutingSkew` that :func:`moe_fold.planner.estimate.estimate`
takes.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from moe_fold.dispatch.placement import Placement, balanced_placement, rank_loads
from moe_fold.planner.estimate import RoutingSkew

__all__ = ["MIN_GAIN", "LoadTrace", "PolicyLoads", "read_loads", "replay", "capacity", "skew", "skew_by_ep",
           "analyse"]

# moe_fold.training.replace.MIN_GAIN, restated so the planner does not import the training
# loop (tests check that they agree).
MIN_GAIN = 0.02


@dataclass
class LoadTrace:
    """Recorded expert loads: ``loads[step][layer][expert]``, at ``steps``, read from ``source``."""
    steps: list[int]
    loads: list[list[list[float]]]
    source: str

    @property
    def num_layers(self) -> int:
        return len(self.loads[0])

    @property
    def num_experts(self) -> int:
        return len(self.loads[0][0])


def read_loads(path: str | Path, first: Optional[int] = None, last: Optional[int] = None) -> LoadTrace:
    """The expert loads of a run directory (its ``metrics.jsonl``) or of a JSON-lines file
    of step records, over steps ``first..last`` (inclusive; default the whole run). Records
    without ``expert_load`` (validation rows) are skipped."""
    path = Path(path)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--loads {path}: no metrics.jsonl there (a run directory or a JSON-lines file of steps)")
    steps, loads = [], []
    with open(file) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{n}: not a JSON line ({e})") from None
            load = record.get("expert_load")
            if not load:
                continue
            step = int(record.get("step", len(steps)))
            if (first is not None and step < first) or (last is not None and step > last):
                continue
            if loads and (len(load) != len(loads[0]) or any(len(row) != len(loads[0][0]) for row in load)):
                raise ValueError(f"{file}:{n}: expert_load is {len(load)} layers x {len(load[0])} experts, earlier "
                                 f"steps had {len(loads[0])} x {len(loads[0][0])}")
            steps.append(step)
            loads.append([[float(x) for x in row] for row in load])
    if not loads:
        window = "" if first is None and last is None else f" in steps {first}..{last}"
        raise ValueError(f"{file}: no step records with expert_load{window}")
    return LoadTrace(steps, loads, str(file))


@dataclass
class PolicyLoads:
    """The busiest rank's rows over the mean, ``ratio[step][layer]``, of one policy; and, per
    step and layer, the busiest rank's rows (in the recorded batch) and the dropped share."""
    policy: str
    ratio: list[list[float]]
    busiest_rows: list[list[float]]
    dropped: list[list[float]] = field(default_factory=list)
    moves: int = 0

    def after(self, first: int) -> "PolicyLoads":
        """The same over steps ``first..`` of the trace (by position)."""
        return PolicyLoads(self.policy, self.ratio[first:], self.busiest_rows[first:],
                           self.dropped[first:] if self.dropped else [], self.moves)

    def mean_ratio(self) -> float:
        """The busiest rank over the mean, averaged over steps and layers."""
        return statistics.mean(x for step in self.ratio for x in step)

    def layer_time(self) -> list[float]:
        return [statistics.mean(step[i] for step in self.ratio) for i in range(len(self.ratio[0]))]

    def layer_peak(self) -> list[float]:
        return [max(step[i] for step in self.ratio) for i in range(len(self.ratio[0]))]


def _ratio(per_rank: Sequence[float], total: float, ep: int) -> float:
    return max(per_rank) / (total / ep) if total > 0 else 1.0


def replay(trace: LoadTrace, ep: int, replicas: int = 0, replace_every: int = 0,
           min_gain: float = MIN_GAIN) -> PolicyLoads:
    """The recorded loads through a placement policy (see the module doc): contiguous with
    ``replicas`` spare slots per rank, re-placed every ``replace_every`` steps (0: never)."""
    e = trace.num_experts
    name = "static" if not replicas and not replace_every else "replicated" if replicas else "replaced"
    # Placement.contiguous checks that the experts split over ep.
    placements = [Placement.contiguous(e, ep, replicas) for _ in range(trace.num_layers)]
    windows = [[0.0] * e for _ in range(trace.num_layers)]
    ratio, busiest, moves = [], [], 0
    for n, step in enumerate(trace.loads):
        ratio.append([])
        busiest.append([])
        for layer, load in enumerate(step):
            per_rank = rank_loads(placements[layer], load)
            ratio[-1].append(_ratio(per_rank, sum(load), ep))
            busiest[-1].append(max(per_rank))
            windows[layer] = [w + x for w, x in zip(windows[layer], load)]
        if replace_every and (n + 1) % replace_every == 0:
            for layer, window in enumerate(windows):
                old = placements[layer]
                new = balanced_placement(window, ep, replicas, previous=old)
                if max(rank_loads(new, window)) <= max(rank_loads(old, window)) * (1 - min_gain):
                    placements[layer] = new
                    moves += 1
                windows[layer] = [0.0] * e
    return PolicyLoads(name, ratio, busiest, moves=moves)


def capacity(trace: LoadTrace, ep: int, capacity_factor: float) -> PolicyLoads:
    """The static placement with each expert's load capped at ``capacity_factor`` times the
    mean expert load of its layer and step; the ratio is over the dropless mean, so it
    scales the balanced step like the others."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0")
    e = trace.num_experts
    placement = Placement.contiguous(e, ep)
    ratio, busiest, dropped = [], [], []
    for step in trace.loads:
        ratio.append([])
        busiest.append([])
        dropped.append([])
        for load in step:
            total = sum(load)
            cap = capacity_factor * total / e
            kept = [min(x, cap) for x in load]
            per_rank = rank_loads(placement, kept)
            ratio[-1].append(_ratio(per_rank, total, ep))
            busiest[-1].append(max(per_rank))
            dropped[-1].append(1 - sum(kept) / total if total > 0 else 0.0)
    return PolicyLoads(f"capacity {capacity_factor:g}", ratio, busiest, dropped)


def skew_by_ep(trace: LoadTrace, config) -> Callable[[int], Optional[RoutingSkew]]:
    """For :func:`moe_fold.planner.estimate.search`: the skew of ``config``'s placement policy
    (``moe.replicas``, ``moe.replace_every``; ratios after the first re-placement window) on
    ``ep`` ranks, None for ep 1 (one rank holds every expert: no rank waits for another)."""
    from moe_fold.planner.model import dims

    d = dims(config)
    if trace.num_experts != d.experts or trace.num_layers != sum(d.moe_flags):
        raise ValueError(f"the loads ({trace.num_layers} MoE layers x {trace.num_experts} experts, {trace.source}) "
                         f"do not match the config ({sum(d.moe_flags)} MoE layers x {d.experts} experts)")
    every = config.moe.replace_every
    cache: dict[int, RoutingSkew] = {}

    def skew_for(ep: int) -> Optional[RoutingSkew]:
        if ep == 1:
            return None
        if ep not in cache:
            policy = replay(trace, ep, config.moe.replicas, every)
            cache[ep] = skew(policy.after(every) if 0 < every < len(trace.loads) else policy)
        return cache[ep]

    return skew_for


def skew(policy: PolicyLoads) -> RoutingSkew:
    """The :class:`RoutingSkew` of a policy's ratios: per layer, mean and worst over steps."""
    return RoutingSkew(time=tuple(policy.layer_time()), peak=tuple(policy.layer_peak()))


def _options(trace: LoadTrace, ep: int, replace_every: int, max_replicas: int,
             capacity_factors: Sequence[float]) -> list[tuple[str, dict, PolicyLoads]]:
    """(name, config changes, loads after the first window) of every policy weighed."""
    skip = replace_every if 0 < replace_every < len(trace.loads) else 0
    out = [("static", {}, replay(trace, ep).after(skip))]
    if replace_every:
        out.append((f"re-place every {replace_every}", {"replace_every": replace_every},
                    replay(trace, ep, 0, replace_every).after(skip)))
    e = trace.num_experts
    for r in range(1, max_replicas + 1):
        if r > e - e // ep:
            break
        out.append((f"{r} cop{'y' if r == 1 else 'ies'} per rank" + (f", re-place every {replace_every}"
                                                                      if replace_every else ""),
                    {"replicas": r, "replace_every": replace_every},
                    replay(trace, ep, r, replace_every).after(skip)))
    for c in capacity_factors:
        out.append((f"capacity factor {c:g}", {"capacity_factor": c}, capacity(trace, ep, c).after(skip)))
    return out


def analyse(config, world: int, gpu, assumptions, trace: LoadTrace, replace_every: int,
            max_replicas: int = 2, capacity_factors: Sequence[float] = (1.0, 1.25, 1.5)) -> dict:
    """Each policy's busiest ep rank on ``config``'s layout: its rows over the mean (mean
    and worst step), its rows per step in the recorded batch, the predicted step time, the
    share of it the busiest rank's experts take, its dropless activation peak and total
    memory, whether that fits, the dropped share; and the recommendation: the fastest
    dropless policy that fits (a capacity factor only when none does, since dropping
    changes what is trained)."""
    import dataclasses

    from moe_fold.config import ConfigError
    from moe_fold.planner.compute_time import microbatch_compute
    from moe_fold.planner.estimate import estimate
    from moe_fold.planner.model import dims

    d = dims(config)
    moe_layers = sum(d.moe_flags)
    if trace.num_experts != d.experts or trace.num_layers != moe_layers:
        raise ValueError(f"the loads ({trace.num_layers} MoE layers x {trace.num_experts} experts, {trace.source}) "
                         f"do not match the config ({moe_layers} MoE layers x {d.experts} experts)")
    ep = config.parallel.ep
    if ep == 1:
        raise ValueError("--loads needs parallel.ep > 1: with one ep rank every rank holds every expert and none "
                         "waits for another")
    balanced = estimate(config, world, gpu, assumptions)
    rows, invalid = [], []
    for name, changes, policy in _options(trace, ep, replace_every, max_replicas, capacity_factors):
        moe = dataclasses.replace(config.moe, **changes)
        candidate = dataclasses.replace(config, moe=moe)
        routing = skew(policy)
        try:
            plan = estimate(candidate, world, gpu, assumptions, skew=routing)
        except (ConfigError, ValueError) as e:  # e.g. copies with parallel.overlap_grad_reduce
            invalid.append({"policy": name, "why": str(e).splitlines()[-1].strip(" -")})
            continue
        experts_s = 0.0
        if assumptions.compute_model == "shapes":
            r = plan.memory["stage"]
            experts_s = plan.microbatches * microbatch_compute(
                candidate, r, candidate.train.recompute, gpu, assumptions.matmul_efficiency,
                assumptions.elementwise_passes, assumptions.attention_kernel, assumptions.gemm_dtype,
                expert_rows=routing.stage(candidate, r, "time"), k_overhead=assumptions.gemm_k_overhead)["experts"]
        dropped = statistics.mean(x for step in policy.dropped for x in step) if policy.dropped else 0.0
        rows.append({
            "policy": name, "changes": changes,
            "busiest_over_mean": policy.mean_ratio(), "busiest_over_mean_worst": max(routing.peak),
            "busiest_rows_per_step": statistics.mean(max(step) for step in policy.busiest_rows),
            "step_s": plan.time["total"], "vs_balanced": plan.time["total"] / balanced.time["total"],
            "experts_share": experts_s / plan.time["total"],
            "activations_peak_bytes": plan.memory["activations"], "memory_bytes": plan.memory["total"],
            "fits": plan.fits, "dropped_fraction": dropped, "moves": policy.moves, "mfu": plan.mfu})
    dropless = [r for r in rows if "capacity_factor" not in r["changes"] and r["fits"]]
    static = rows[0]
    if dropless:
        best = min(dropless, key=lambda r: r["step_s"])
        if best is not static and static["fits"] and best["step_s"] > 0.98 * static["step_s"]:
            best = static  # under 2% faster: not worth the moves and the spare slots
        why = "the fastest dropless policy that fits in memory"
    else:
        fitting = [r for r in rows if r["fits"]]
        best = min(fitting, key=lambda r: r["dropped_fraction"]) if fitting else None
        why = ("no dropless policy fits: the capacity factor that drops the least" if best else
               "nothing fits: a larger world or more ep/pp")
    return {"source": trace.source, "steps": [trace.steps[0], trace.steps[-1]], "num_steps": len(trace.steps),
            "ep": ep, "replace_every": replace_every, "balanced_step_s": balanced.time["total"],
            "balanced_activations_bytes": balanced.memory["activations"], "policies": rows,
            "recommendation": None if best is None else best["policy"], "why": why, "invalid": invalid}

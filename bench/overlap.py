"""Communication hidden behind compute: per collective kind, the time one training step
spends on it and the part left exposed, and the step time, with its overlap off and on,
side by side in one run, next to the planner's exposed-communication terms.

    python bench/overlap.py [--world 4] [--preset mixtral-tiny] [--set key=value ...]
                            [--bucket-numel 65536] [--rounds 5] [--kinds dp_grads,param_gather,ep_alltoall]

Every rank trains the preset (the loop's own path: :func:`moe_fold.training.step.forward_backward`
with the gradient reduction's hooks, :func:`moe_fold.training.optim.apply_gradients`) on
``--world`` gloo ranks. A kind is one entry of :data:`KINDS`: the config of each setting
(``off`` and ``on``, or several overlapped settings, one JSON line each with its
``setting``) and the seconds a rank has spent waiting on that kind's communication:

- ``dp_grads``: the gradient buckets' all-reduce (``parallel.overlap_grad_reduce``);
  waiting = :attr:`moe_fold.training.buckets.GradSync.exposed_s`;
- ``param_gather``: the distributed optimizer's parameter all-gather
  (``parallel.overlap_param_gather``, gradients reduce-scattered without overlap in both);
  waiting = :attr:`moe_fold.training.optim.AdamW.gather_wait_s`;
- ``ep_alltoall``: the dispatcher's all-to-alls (token rows and probs, forward and
  backward; ``moe.dispatcher=alltoall``). Settings beside ``off``: ``chunks2``
  (``moe.overlap_chunks=2``) and, where the preset has a shared expert (``--preset
  qwen2-moe-tiny``), ``shared`` (``moe.shared_expert_overlap``) and ``shared+chunks2``;
  waiting = the time inside blocking all-to-alls, and in posting and waiting on
  asynchronous ones (the bench wraps ``torch.distributed.all_to_all_single``).

With a kind's overlap off a rank waits for each collective right after posting it, so
its waiting time is the collective's whole time: ``comm_ms``. With it on, the waiting
time is what compute did not hide: ``exposed_ms_on``, and ``exposed_fraction`` =
``exposed_ms_on / comm_ms`` (the primary figure: on a 2-core machine the ranks' compute
and gloo's threads share the cores, so a wall-clock gain is small). ``step_ratio`` =
step time off / on (> 1: overlap faster). Settings run interleaved, round after round, one
step each; medians over rounds, the slowest rank's step time and the mean rank's waiting.

The planner's terms: :func:`moe_fold.planner.estimate.estimate` on a "GPU" calibrated to
this run (its FLOP rate: the rank's model FLOPs per step over the step time less the
communication, overlap off; its link: the bytes per step of the kind's groups over the
time waited on them, overlap off), with
the setting's switches: ``planner_comm_ms`` (overlap off) and ``planner_exposed_ms``
(on), whose ratio ``planner_exposed_fraction`` stands next to the measured one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from moe_fold import comm
from moe_fold.config import Config, load_config
from moe_fold.data.loader import Batch
from moe_fold.launch import run_ranks

# Seconds this process has spent blocked in all-to-alls (see the module doc).
_ALL_TO_ALL_S = [0.0]


class _TimedWork:
    """An asynchronous all-to-all's work, whose wait counts as time blocked in it."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        begin = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            _ALL_TO_ALL_S[0] += time.perf_counter() - begin


def _timed_all_to_all(raw: Callable) -> Callable:
    def timed(*args, async_op=False, **kwargs):
        begin = time.perf_counter()
        try:
            work = raw(*args, async_op=async_op, **kwargs)
        finally:
            _ALL_TO_ALL_S[0] += time.perf_counter() - begin
        return _TimedWork(work) if async_op else work
    return timed


def _moe_overlap(preset: Config) -> dict[str, list[str]]:
    """The MoE layer's overlap settings: off, two chunks and, where the preset has a shared
    expert, the shared-expert overlap alone and with the chunks."""
    settings = {"off": [], "chunks2": ["moe.overlap_chunks=2"]}
    if preset.moe.shared_expert_ffn_hidden_size > 0:
        settings["shared"] = ["moe.shared_expert_overlap=true"]
        settings["shared+chunks2"] = settings["shared"] + settings["chunks2"]
    return settings


@dataclass
class Setup:
    """One setting's model, optimizer and gradient reduction on this rank."""
    config: Config
    model: torch.nn.Module
    optimizer: object
    grad_sync: object


@dataclass(frozen=True)
class Kind:
    """A collective kind: config overrides per setting (or a function of the preset's
    config that returns them; ``off`` is the blocking order), the seconds a rank has waited on it
    so far, its group kinds (bytes), the planner's time entries for it, and the seconds
    waited on all the traffic of those group kinds (the link's calibration)."""
    settings: dict[str, list[str]] | Callable[[Config], dict[str, list[str]]]
    waited: Callable[[Setup], float]
    byte_kinds: tuple[str, ...]
    planner_keys: Callable[[str], bool]
    link_waited: Callable[[Setup], float]


KINDS: dict[str, Kind] = {
    "dp_grads": Kind(
        settings={"off": ["parallel.overlap_grad_reduce=false"], "on": ["parallel.overlap_grad_reduce=true"]},
        waited=lambda s: s.grad_sync.exposed_s,
        byte_kinds=("dp_cp", "tp_dp_cp", "edp"),
        planner_keys=lambda key: key.endswith("grads (exposed)"),
        link_waited=lambda s: s.grad_sync.exposed_s),
    "param_gather": Kind(
        settings={"off": ["optimizer.distributed=true", "parallel.overlap_param_gather=false"],
                  "on": ["optimizer.distributed=true", "parallel.overlap_param_gather=true"]},
        waited=lambda s: s.optimizer.gather_wait_s,
        byte_kinds=("dp_cp", "tp_dp_cp", "edp"),
        planner_keys=lambda key: key.endswith("params (exposed)"),
        # the bytes are the reduce-scatter's and the all-gather's
        link_waited=lambda s: s.grad_sync.exposed_s + s.optimizer.gather_wait_s),
    "ep_alltoall": Kind(
        settings=_moe_overlap,
        waited=lambda s: _ALL_TO_ALL_S[0],
        byte_kinds=("ep", "etp_ep"),
        planner_keys=lambda key: key in ("ep", "etp_ep"),
        link_waited=lambda s: _ALL_TO_ALL_S[0]),
}


def _build(config: Config, groups) -> Setup:
    from moe_fold.models.model import build_model
    from moe_fold.training.optim import build_grad_sync, build_optimizer

    p = config.parallel
    torch.manual_seed(config.train.seed)
    model = build_model(config, groups)
    optimizer = build_optimizer(model, config.optimizer, groups, bucket_numel=p.grad_bucket_numel,
                                overlap_param_gather=p.overlap_param_gather)
    grad_sync = build_grad_sync(model, optimizer, groups, bucket_numel=p.grad_bucket_numel,
                                overlap=p.overlap_grad_reduce)
    return Setup(config, model, optimizer, grad_sync)


def _step(setup: Setup, groups, batches: list[Batch]) -> float:
    """One training step (the loop's path); returns its wall seconds on this rank."""
    from moe_fold.training.optim import apply_gradients
    from moe_fold.training.step import forward_backward

    dist.barrier()
    begin = time.perf_counter()
    forward_backward(setup.model, batches, groups, setup.config, grad_sync=setup.grad_sync)
    apply_gradients(setup.model.parameters(), setup.optimizer, groups, setup.config.optimizer.clip_grad,
                    grad_sync=setup.grad_sync)
    setup.optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - begin


def _batches(config: Config, groups) -> list[Batch]:
    t, m = config.train, config.model
    micro = t.global_batch_size // (t.micro_batch_size * groups.size("dp"))
    gen = torch.Generator().manual_seed(7 + groups.rank_in("dp"))
    out = []
    for _ in range(micro):
        ids = torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_length + 1), generator=gen)
        b, seq = t.micro_batch_size, m.seq_length
        out.append(Batch(tokens=ids[:, :-1], labels=ids[:, 1:], loss_mask=torch.ones(b, seq),
                         positions=torch.arange(seq).expand(b, seq),
                         cu_seqlens=torch.arange(0, b * seq + 1, seq, dtype=torch.int32)))  # one sequence a row
    return out


def _worker(rank: int, world: int, configs: dict[str, dict[str, Config]], rounds: int) -> dict:
    from moe_fold.training.train import build_groups

    dist.all_to_all_single = _timed_all_to_all(dist.all_to_all_single)
    first = next(iter(next(iter(configs.values())).values()))
    groups = build_groups(first)
    batches = _batches(first, groups)
    setups = {(k, s): _build(c, groups) for k, settings in configs.items() for s, c in settings.items()}
    samples: dict[tuple[str, str], dict[str, list[float]]] = {
        key: {"step": [], "waited": [], "link_waited": [], "bytes": []} for key in setups}
    for r in range(-1, rounds):  # round -1 warms every setting up
        order = list(setups) if r % 2 == 0 else list(reversed(setups))
        for key in order:
            setup, kind = setups[key], KINDS[key[0]]
            before, link_before = kind.waited(setup), kind.link_waited(setup)
            with comm.count_bytes() as sent:
                seconds = _step(setup, groups, batches)
            if r >= 0:
                samples[key]["step"].append(seconds)
                samples[key]["waited"].append(kind.waited(setup) - before)
                samples[key]["link_waited"].append(kind.link_waited(setup) - link_before)
                samples[key]["bytes"].append(sum(sent.get(k, 0) for k in kind.byte_kinds))
    return samples


def _median_over_ranks(ranks: list[dict], key, field: str, reduce: Callable) -> float:
    """Per round, ``reduce`` over ranks; then the median over rounds."""
    per_round = zip(*(r[key][field] for r in ranks))
    return statistics.median(reduce(values) for values in per_round)


def _planner(config: Config, world: int, kind: Kind, flops_per_s: float, bytes_per_s: float) -> float:
    """Seconds the planner charges for the kind's communication under ``config``'s switches,
    on a device with this run's FLOP rate and link."""
    from moe_fold.planner.estimate import Assumptions, estimate
    from moe_fold.planner.hardware import GPU

    gpu = GPU("calibrated", peak_flops=flops_per_s, memory=1e18, hbm_bw=1e18, nvlink_bw=bytes_per_s,
              inter_node_bw=bytes_per_s, gpus_per_node=world)
    plan = estimate(config, world, gpu, Assumptions(matmul_efficiency=1.0, memory_overhead=0))
    return sum(s for key, s in plan.time.items() if kind.planner_keys(key))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--preset", default="mixtral-tiny")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--bucket-numel", type=int, default=1 << 16, help="parallel.grad_bucket_numel")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, from {', '.join(KINDS)}")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    for k in kinds:
        if k not in KINDS:
            parser.error(f"--kinds {args.kinds!r}: {k} is not a kind; choose from {', '.join(KINDS)}")
    base = ["wandb.mode=disabled", "train.micro_batch_size=2", f"parallel.grad_bucket_numel={args.bucket_numel}",
            *args.set]
    preset = load_config(args.preset, base)
    settings = {k: KINDS[k].settings(preset) if callable(KINDS[k].settings) else KINDS[k].settings for k in kinds}
    configs = {k: {s: load_config(args.preset, base + extra) for s, extra in settings[k].items()} for k in kinds}
    ranks = run_ranks(_worker, args.world, configs, args.rounds, timeout=1200, threads=1)

    from moe_fold.planner.model import rank_flops_per_microbatch

    for k in kinds:
        kind = KINDS[k]
        off = (k, "off")
        step_off = _median_over_ranks(ranks, off, "step", max)
        comm_off = _median_over_ranks(ranks, off, "waited", statistics.mean)
        nbytes = _median_over_ranks(ranks, off, "bytes", statistics.mean)
        link_s = _median_over_ranks(ranks, off, "link_waited", statistics.mean)
        config_off = configs[k]["off"]
        t = config_off.train
        dp = args.world // (config_off.parallel.tp * config_off.parallel.cp * config_off.parallel.pp)
        micro = t.global_batch_size // (t.micro_batch_size * dp)
        flops = micro * rank_flops_per_microbatch(config_off, 0, t.recompute)
        flops_per_s = flops / max(step_off - comm_off, 1e-9)
        bytes_per_s = nbytes / max(link_s, 1e-9)
        record = {"bench": "overlap", "kind": k, "world": args.world, "preset": args.preset,
                  "bucket_numel": args.bucket_numel, "rounds": args.rounds, "bytes_per_step": nbytes,
                  "comm_ms": 1000 * comm_off, "step_ms_off": 1000 * step_off,
                  "planner_comm_ms": 1000 * _planner(config_off, args.world, kind, flops_per_s, bytes_per_s)}
        ons = [setting for setting in configs[k] if setting != "off"]
        if not ons:
            record.update({"exposed_fraction": 1.0, "note": "overlap off only (no switch of this kind here)",
                           "ms": step_off * 1000})
            print(json.dumps(record), flush=True)
        for setting in ons:  # one record per overlapped setting, each against off
            on = (k, setting)
            step_on = _median_over_ranks(ranks, on, "step", max)
            exposed_on = _median_over_ranks(ranks, on, "waited", statistics.mean)
            planner_on = _planner(configs[k][setting], args.world, kind, flops_per_s, bytes_per_s)
            print(json.dumps({
                **record, "setting": setting, "exposed_ms_on": 1000 * exposed_on,
                "exposed_fraction": exposed_on / comm_off, "step_ms_on": 1000 * step_on,
                "step_ratio": step_off / step_on, "planner_exposed_ms": 1000 * planner_on,
                "planner_exposed_fraction": planner_on / max(record["planner_comm_ms"] / 1000, 1e-12),
                "ms": 1000 * step_on}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

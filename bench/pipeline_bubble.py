"""Pipeline bubble: the fraction of time each stage sits idle, 1f1b against interleaved.

    python bench/pipeline_bubble.py [--pp 2,4 --vpp 2 --microbatches 4,8,16 --forward-ms 20 --repeats 3]

Each pp rank is a local gloo process whose model chunks only wait: a chunk's forward
sleeps ``forward_ms / vpp`` and its backward ``2 * forward_ms / vpp`` (the usual
backward = 2 x forward), so a rank has the same work per micro-batch under both schedules
and the tensors between stages are tiny. A chunk records the time it spends working;
``idle_fraction = 1 - work / total`` per rank, where ``total`` runs from a barrier before
:func:`moe_fold.parallel.pipeline.run_schedule` to its return (it ends with a collective over the
pp group, so every rank's total spans the whole pipeline).

Prints one JSON line per (schedule, pp, micro-batches), with the median over repeats of
the mean and max idle fraction over ranks, next to

- ``idle_fraction_theory``: idle / total of the textbook schedule,
  ``(p-1)/(m+p-1)`` for 1f1b and ``(p-1)/(v*m+p-1)`` for interleaved;
- ``bubble_over_ideal_theory``: the same bubble relative to the ideal (bubble-free) time,
  ``(p-1)/m`` and ``(p-1)/(v*m)``, the form of Narayanan et al. 2021, section 2.2;
- ``idle_fraction_plan``: what the schedule's plan predicts (:mod:`moe_fold.parallel.pipeline_schedules`).

The measured number is compared with ``idle_fraction_theory`` (both idle / total). What
the sleeps cannot hide shows up as extra idle time: every exchange a rank goes through
costs about ``exchange_ms`` (the median one-way time of a tiny exchange between ranks 0
and 1, measured first), and ``exchanges_per_rank`` says how many the plan has.
Interleaved needs micro-batch counts divisible by pp; other counts are left out.
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from moe_fold.comm import batch_send_recv
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.parallel.pipeline import run_schedule
from moe_fold.parallel.pipeline_schedules import Exchange, make_plan

WIDTH = 4


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, chunk):
        ctx.chunk = chunk
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.chunk.work(ctx.chunk.backward_s)
        return grad, None


class SleepChunk(nn.Module):
    """Sleeps a fixed time in forward and in backward; the last stage returns a scalar."""

    def __init__(self, forward_s, backward_s, last):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.forward_s, self.backward_s, self.last = forward_s, backward_s, last
        self.busy = 0.0

    def work(self, seconds):
        start = time.perf_counter()
        time.sleep(seconds)
        self.busy += time.perf_counter() - start

    def forward(self, x):
        self.work(self.forward_s)
        y = _SleepBackward.apply(x * self.scale, self)
        return y.sum() if self.last else y


def _exchange_ms(rank, rounds=20):
    """Median one-way time of a tiny exchange between ranks 0 and 1 (half a round trip)."""
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            batch_send_recv([("send", torch.ones(WIDTH), 1)])
            batch_send_recv([("recv", ((WIDTH,), torch.float32), 1)])
        elif rank == 1:
            batch_send_recv([("recv", ((WIDTH,), torch.float32), 0)])
            batch_send_recv([("send", torch.ones(WIDTH), 0)])
        times.append((time.perf_counter() - start) / 2 * 1000)
    return statistics.median(times)


def _worker(rank, world_size, schedule, vpp, counts, forward_ms, repeats):
    groups = create_process_groups(ParallelLayout(world_size, pp=world_size))
    pp, r = world_size, rank
    out = {"exchange_ms": _exchange_ms(rank)}
    # The first backward of a process starts autograd's machinery: keep it out of the timings.
    run_schedule([SleepChunk(0, 0, c * pp + r == pp * vpp - 1) for c in range(vpp)], [torch.ones(WIDTH)] * pp,
                 groups, tensor_shape=(WIDTH,), schedule=schedule)
    for m in counts:
        idle, totals = [], []
        for _ in range(repeats):
            chunks = [SleepChunk(forward_ms / 1000 / vpp, 2 * forward_ms / 1000 / vpp,
                                 c * pp + r == pp * vpp - 1) for c in range(vpp)]
            microbatches = [torch.ones(WIDTH) for _ in range(m)]
            dist.barrier()
            start = time.perf_counter()
            run_schedule(chunks, microbatches, groups, tensor_shape=(WIDTH,), schedule=schedule)
            totals.append(time.perf_counter() - start)
            idle.append(1 - sum(c.busy for c in chunks) / totals[-1])
        out[m] = {"idle": statistics.median(idle), "total": statistics.median(totals)}
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", default="2,4")
    parser.add_argument("--vpp", type=int, default=2, help="model chunks per rank for interleaved")
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--forward-ms", type=float, default=20.0, help="forward time of a whole stage")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    counts = [int(m) for m in args.microbatches.split(",")]
    for pp in (int(p) for p in args.pp.split(",")):
        for schedule, vpp in (("1f1b", 1), ("interleaved", args.vpp)):
            valid = [m for m in counts if schedule == "1f1b" or m % pp == 0]
            ranks = run_ranks(_worker, pp, schedule, vpp, valid, args.forward_ms, args.repeats, timeout=600)
            for m in valid:
                idle = [ranks[r][m]["idle"] for r in range(pp)]
                plan = make_plan(schedule, pp, vpp, m)
                print(json.dumps({
                    "bench": "pipeline_bubble", "schedule": schedule, "pp": pp, "vpp": vpp, "microbatches": m,
                    "forward_ms": args.forward_ms, "backward_ms": 2 * args.forward_ms,
                    "total_ms": round(1000 * max(ranks[r][m]["total"] for r in range(pp)), 1),
                    "idle_fraction": round(statistics.mean(idle), 4),
                    "idle_fraction_max": round(max(idle), 4),
                    "idle_fraction_plan": round(1 - statistics.mean(map(plan.busy, range(pp))) / plan.makespan, 4),
                    "idle_fraction_theory": round((pp - 1) / (vpp * m + pp - 1), 4),
                    "bubble_over_ideal_theory": round((pp - 1) / (vpp * m), 4),
                    "exchanges_per_rank": max(sum(isinstance(x, Exchange) for x in p) for p in plan.programs),
                    "exchange_ms": round(ranks[0]["exchange_ms"], 3),
                }), flush=True)


if __name__ == "__main__":
    main()

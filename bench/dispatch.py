"""Microbenchmark of the token dispatchers: dispatch, combine, and the round trip through an
identity expert, on ``ep x etp`` local ranks (gloo, CPU).

Prints one JSON line per (dispatcher, mode, routing) with, per rank:

- ``ms``: one round trip (dispatch + identity expert + combine), slowest rank, mean over
  iterations; ``dispatch_ms``, ``combine_ms`` its parts; ``backward_ms`` with --backward;
- ``tokens_per_s``: tokens of all ranks through the round trip per second;
- ``bytes_sent``: bytes one rank sent in the dispatch and the combine (token rows, probs,
  maps and count exchange; forward only), mean over ranks; ``bytes_tokens`` the token
  rows alone, ``bytes_sent_max`` the busiest rank;
- ``bytes_min``: the theoretical minimum per rank, mean over ranks: every token must reach
  each other rank that holds (a shard of) one of its experts once, and come back once:
  ``2 x distinct (token, remote destination rank) pairs x hidden x element size``;
- ``permute_ratio_to_copy``: time of the local permute + unpermute of this rank's tokens
  over a plain copy of the same rows (the permuted ``[N, H]`` tensor) in each direction.

Routing: ``random`` (top-k of Gaussian scores), ``balanced`` (every expert gets the same
count, each token a uniform random set of k experts), ``zipf`` (k distinct experts
drawn with probability proportional to ``1 / (e + 1) ** s``: the low experts, all on the
first ep rank, are hot). Capacity modes drop with the router's ``apply_capacity``
(``probs`` policy, padded for ``pad``) at ``--capacity-factor``.

Example::

    python bench/dispatch.py --tokens 4096 --hidden 1024 --experts 16 --topk 4 --ep 4 \\
        --dispatcher alltoall,allgather --mode dropless,dedup --routing balanced,zipf

``--dispatcher``, ``--mode`` and ``--routing`` take comma-separated lists; combinations
that do not exist (the all-gather dispatcher has no pad or dedup mode) are skipped with
a note on stderr.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
import torch.distributed as dist

from moe_fold.config import experts_over_ep
from moe_fold.dispatch.allgather import AllGatherDispatcher
from moe_fold.dispatch.alltoall import AllToAllDispatcher
from moe_fold.dispatch.router import apply_capacity
from moe_fold.kernels.permute import permute, unpermute
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups

DISPATCHERS = ("alltoall", "allgather")
MODES = ("dropless", "capacity", "pad", "dedup")
ROUTINGS = ("random", "balanced", "zipf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_routing(kind: str, num_tokens: int, num_experts: int, topk: int, seed: int, zipf_s: float):
    """``(probs[T, E], routing_map[T, E])`` for one rank's tokens."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(num_tokens, num_experts, generator=gen)
    if kind == "random":
        top = scores.topk(topk, dim=1).indices
    elif kind == "balanced":
        # Each block of E // k tokens shares one random permutation of the experts, k
        # each: every expert gets the same count (when k divides E), and a token's
        # experts are a uniform random k-subset.
        per_block = num_experts // topk
        blocks = -(-num_tokens // per_block)
        perms = [torch.randperm(num_experts, generator=gen)[: per_block * topk] for _ in range(blocks)]
        top = torch.cat(perms or [torch.empty(0, dtype=torch.long)]).view(-1, topk)[:num_tokens]  # [T, k]
    else:
        weights = 1.0 / (torch.arange(num_experts, dtype=torch.float64) + 1) ** zipf_s
        top = torch.multinomial(weights.expand(num_tokens, -1), topk, replacement=False, generator=gen)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
    return torch.softmax(scores, dim=1) * routing_map, routing_map


def min_bytes(routing_map: torch.Tensor, ep_rank: int, etp: int, num_local_experts: int, row_bytes: int) -> int:
    """Lower bound for one rank: each token once to every other rank holding a shard of
    one of its experts, and once back."""
    ep = routing_map.shape[1] // num_local_experts
    to_rank = routing_map.view(-1, ep, num_local_experts).any(dim=2)  # [T, ep]
    per_token = to_rank.sum(dim=1) * etp - to_rank[:, ep_rank].long()  # remote ranks per token
    return 2 * int(per_token.sum()) * row_bytes


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def permute_ratio(tokens, routing_map, iters, backend) -> float:
    """(permute + unpermute) time over the time of two copies of the permuted rows, one
    per direction (a copy reads and writes the same ``[N, H]`` bytes a permute writes)."""
    permute_s = copy_s = 0.0
    for it in range(iters + 1):  # the first round warms up
        (rows, _, idx), a = _timed(lambda: permute(tokens, routing_map, None, backend=backend))
        _, b = _timed(lambda: unpermute(rows, idx, tokens.shape[0], backend=backend))
        dst = torch.empty_like(rows)
        _, c = _timed(lambda: (dst.copy_(rows), rows.copy_(dst)))
        if it:
            permute_s, copy_s = permute_s + a + b, copy_s + c
    return permute_s / copy_s if copy_s > 0 else float("nan")


def rank_main(rank, world_size, args, runs):
    groups = create_process_groups(ParallelLayout(world_size, ep=args.ep, tp=args.etp, etp=args.etp))
    dtype = DTYPES[args.dtype]
    results = []
    for kind, mode, routing in runs:
        probs, routing_map = make_routing(routing, args.tokens, args.experts, args.topk,
                                          seed=args.seed + rank, zipf_s=args.zipf_s)
        if mode in ("capacity", "pad"):
            probs, routing_map = apply_capacity(probs, routing_map, args.capacity_factor, policy="probs",
                                                pad_to_capacity=mode == "pad", topk=args.topk)
        # The padding pairs the router adds (prob 0) carry nothing: not part of the minimum.
        kept_map = routing_map & (probs > 0) if mode == "pad" else routing_map
        gen = torch.Generator().manual_seed(args.seed + 100 + rank)
        tokens = torch.randn(args.tokens, args.hidden, generator=gen).to(dtype)
        tokens.requires_grad_(args.backward)
        if kind == "alltoall":
            d = AllToAllDispatcher(args.experts, args.topk, groups, mode="dropless" if mode == "dedup" else mode,
                                   capacity_factor=args.capacity_factor, dedup=mode == "dedup",
                                   permute_backend=args.permute_backend)
        else:
            d = AllGatherDispatcher(args.experts, args.topk, groups, mode=mode, permute_backend=args.permute_backend)
        times = {"dispatch": 0.0, "combine": 0.0, "ms": 0.0, "backward": 0.0}
        for it in range(args.warmup + args.iters):
            dist.barrier()
            out, t_dispatch = _timed(lambda: d.dispatch(tokens, probs, routing_map))
            expert_out = out.tokens  # identity expert
            y, t_combine = _timed(lambda: d.combine(expert_out, out.handle))
            t_backward = 0.0
            if args.backward:
                _, t_backward = _timed(lambda: y.sum().backward())
            if it >= args.warmup:
                times["dispatch"] += t_dispatch
                times["combine"] += t_combine
                times["ms"] += t_dispatch + t_combine
                times["backward"] += t_backward
        wire = out.handle.wire
        row_bytes = args.hidden * tokens.element_size()
        ratio = permute_ratio(tokens.detach(), routing_map, args.iters, args.permute_backend)
        results.append({
            "times": {k: v / args.iters * 1e3 for k, v in times.items()},
            "bytes_sent": wire.total, "bytes_tokens": wire.dispatch + wire.combine,
            "bytes_min": min_bytes(kept_map, d.ep_rank, d.etp, d.num_local_experts, row_bytes),
            "rows": out.tokens.shape[0], "ratio": ratio,
        })
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example: python bench/dispatch.py --tokens 4096 --hidden 1024 "
                                       "--experts 16 --topk 4 --ep 4 --dispatcher alltoall --mode dedup "
                                       "--routing zipf")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--dispatcher", default="alltoall", help="comma list of " + " ".join(DISPATCHERS))
    p.add_argument("--mode", default="dropless", help="comma list of " + " ".join(MODES))
    p.add_argument("--routing", default="balanced", help="comma list of " + " ".join(ROUTINGS))
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent of expert popularity")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backward", action="store_true", help="also time the backward of the round trip")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--permute-backend", choices=("torch", "triton"), default="torch")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    for name, allowed in (("dispatcher", DISPATCHERS), ("mode", MODES), ("routing", ROUTINGS)):
        values = getattr(args, name).split(",")
        bad = [v for v in values if v not in allowed]
        if bad:
            p.error(f"--{name} {','.join(bad)} is not one of {' '.join(allowed)}")
        setattr(args, name, values)
    for name in ("tokens", "hidden", "experts", "topk", "ep", "etp", "iters"):
        if getattr(args, name) < (0 if name == "tokens" else 1):
            p.error(f"--{name}={getattr(args, name)} must be positive")
    for problem in experts_over_ep(args.experts, args.ep):
        p.error(f"--experts={args.experts} --ep={args.ep}: {problem}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    runs = []
    for kind, mode, routing in itertools.product(args.dispatcher, args.mode, args.routing):
        if kind == "allgather" and mode in ("pad", "dedup"):
            print(f"skipping allgather with mode {mode}: the all-gather dispatcher has no such mode",
                  file=sys.stderr)
            continue
        runs.append((kind, mode, routing))
    world = args.ep * args.etp
    per_rank = run_ranks(rank_main, world, args, runs, timeout=args.timeout, threads=args.threads)
    lines = []
    for i, (kind, mode, routing) in enumerate(runs):
        res = [r[i] for r in per_rank]
        ms = max(r["times"]["ms"] for r in res)
        line = {
            "bench": "dispatch", "dispatcher": kind, "mode": mode, "routing": routing,
            "tokens": args.tokens, "hidden": args.hidden, "experts": args.experts, "topk": args.topk,
            "ep": args.ep, "etp": args.etp, "world": world, "dtype": args.dtype,
            "capacity_factor": args.capacity_factor if mode in ("capacity", "pad") else None,
            "zipf_s": args.zipf_s if routing == "zipf" else None,
            "ms": round(ms, 3),
            "dispatch_ms": round(max(r["times"]["dispatch"] for r in res), 3),
            "combine_ms": round(max(r["times"]["combine"] for r in res), 3),
            "tokens_per_s": round(args.tokens * world / (ms / 1e3)) if ms > 0 else None,
            "bytes_sent": sum(r["bytes_sent"] for r in res) // world,
            "bytes_tokens": sum(r["bytes_tokens"] for r in res) // world,
            "bytes_sent_max": max(r["bytes_sent"] for r in res),
            "bytes_min": sum(r["bytes_min"] for r in res) // world,
            "rows_per_rank_max": max(r["rows"] for r in res),
            "permute_ratio_to_copy": round(max(r["ratio"] for r in res), 3),
            "iters": args.iters,
        }
        if args.backward:
            line["backward_ms"] = round(max(r["times"]["backward"] for r in res), 3)
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()

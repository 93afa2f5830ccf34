"""Expert placement under skewed routing: static vs re-placed vs replicated, on ``ep`` gloo ranks.

One MoE layer (the all-to-all dispatcher, dropless, SwiGLU experts) runs forward and
backward every step on routing drawn from a skewed expert popularity, the same draws for
every policy, the policies interleaved step by step:

- ``static``: the default contiguous placement;
- ``replaced``: every ``--replace-every`` steps, :func:`balanced_placement` from the load of
  the steps since the last one, then :func:`move_experts` (weights and grads move);
- ``replicated``: the same with ``--replicas`` spare slots per rank for copies.

Routing: ``zipf`` (each token's k distinct experts drawn with probability proportional
to ``1 / (rank + 1) ** s``; a fixed random ranking of the experts) and ``drift`` (the
same, the ranking rotated by one expert every ``--drift-every`` steps: the hot spot moves,
and a placement made from the last window lags it until the next re-placement).

One JSON line per (routing, policy), over the steps after the first re-placement:

- ``busiest_over_mean``: the busiest ep rank's expert rows / the mean over ranks, mean over
  steps (1 = even); ``busiest_over_mean_first`` the same over the first window (every
  policy still static there);
- ``ms``: one step (dispatch, experts, combine, backward) of the slowest rank, median;
  ``ratio_vs_static``: static's ``ms`` / this policy's (>1: faster than static);
- ``peak_activation_bytes``: the largest expert activation footprint of any rank and step,
  from its rows: ``rows x (H + 2F + F + H) x element size`` (fc1's input and output, the
  SwiGLU output, fc2's output; a CPU has no allocator peak to read);
- ``moves``, ``move_bytes`` (sent by all ranks, per move, mean), ``move_ms`` (slowest rank,
  per move, mean): the cost of re-placing.

Example::

    python bench/placement.py --experts 16 --topk 2 --ep 4 --tokens 2048 --routing zipf,drift
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from moe_fold.comm import all_reduce_
from moe_fold.config import Config, experts_over_ep, replacement_has_room, replicas_fit
from moe_fold.dispatch.placement import Placement, balanced_placement, rank_loads
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.models.moe_layer import MoELayer
from moe_fold.training.replace import move_experts

ROUTINGS = ("zipf", "drift")
POLICIES = ("static", "replaced", "replicated")


def routing(kind: str, step: int, tokens: int, experts: int, topk: int, args, rank: int):
    """``(probs[T, E], routing_map[T, E])`` of one rank at one step."""
    ranking = torch.randperm(experts, generator=torch.Generator().manual_seed(args.seed))  # [E]: expert of each rank
    if kind == "drift":
        ranking = ranking.roll(step // args.drift_every)
    weights = torch.empty(experts, dtype=torch.float64)
    weights[ranking] = 1.0 / (torch.arange(experts, dtype=torch.float64) + 1) ** args.zipf_s
    gen = torch.Generator().manual_seed(args.seed + 1000 * step + rank)
    top = torch.multinomial(weights.expand(tokens, -1), topk, replacement=False, generator=gen)  # [T, k]
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    scores = torch.rand(tokens, experts, generator=gen)
    return (scores / scores.sum(1, keepdim=True)) * routing_map, routing_map


def _config(args, replicas: int) -> Config:
    config = Config()
    config.model.hidden_size = args.hidden
    m = config.moe
    m.num_experts, m.topk, m.ffn_hidden_size, m.replicas = args.experts, args.topk, args.ffn, replicas
    return config


def rank_main(rank, world_size, args):
    torch.set_num_threads(args.threads)
    groups = create_process_groups(ParallelLayout(world_size, ep=world_size))
    layers = {"static": MoELayer(_config(args, 0), groups, 0), "replaced": MoELayer(_config(args, 0), groups, 0),
              "replicated": MoELayer(_config(args, args.replicas), groups, 0)}
    results = []
    for kind in args.routing:
        for name, layer in layers.items():
            start = Placement.contiguous(args.experts, world_size, args.replicas if name == "replicated" else 0)
            if layer.placement != start:
                move_experts([layer], start, groups)
        window = torch.zeros(args.experts, dtype=torch.float64)
        stats = {name: {"balance": [], "first": [], "ms": [], "peak": 0, "moves": [], "move_bytes": [],
                        "move_ms": []} for name in layers}
        gen = torch.Generator().manual_seed(args.seed + 7 * rank)
        hidden = torch.randn(args.tokens, args.hidden, generator=gen)
        for step in range(args.steps):
            probs, routing_map = routing(kind, step, args.tokens, args.experts, args.topk, args, rank)
            load = routing_map.sum(0).double()
            all_reduce_(load, groups.ep)
            window += load
            for name, layer in layers.items():
                x = hidden.clone().requires_grad_()
                p = probs.clone().requires_grad_()
                dist.barrier()
                begin = time.perf_counter()
                out = layer.dispatcher.dispatch(x, p, routing_map)
                y = layer.experts(out.tokens, out.tokens_per_local_expert, out.probs,
                                  out.host_tokens_per_local_expert)
                layer.dispatcher.combine(y, out.handle).square().mean().backward()
                seconds = torch.tensor([time.perf_counter() - begin])
                all_reduce_(seconds, groups.ep, op="max")
                rows = torch.tensor([float(out.tokens.shape[0])])
                every = torch.zeros(world_size)
                every[groups.rank_in("ep")] = rows
                all_reduce_(every, groups.ep)
                s = stats[name]
                balance = float(every.max() / every.mean()) if every.sum() > 0 else 1.0
                (s["first"] if step < args.replace_every else s["balance"]).append(balance)
                if step >= args.replace_every:
                    s["ms"].append(seconds.item() * 1e3)
                    s["peak"] = max(s["peak"], int(every.max()) * (2 * args.hidden + 3 * args.ffn) * y.element_size())
                for param in layer.experts.parameters():
                    param.grad = None
            if (step + 1) % args.replace_every == 0:
                for name in ("replaced", "replicated"):
                    layer = layers[name]
                    old = layer.placement
                    new = balanced_placement(window.tolist(), world_size, old.slots_per_rank - args.experts // world_size,
                                             previous=old)
                    if max(rank_loads(new, window.tolist())) >= max(rank_loads(old, window.tolist())):
                        continue
                    dist.barrier()
                    begin = time.perf_counter()
                    done = move_experts([layer], new, groups)
                    seconds = torch.tensor([time.perf_counter() - begin])
                    all_reduce_(seconds, groups.ep, op="max")
                    sent = torch.tensor([float(done["bytes"])])
                    all_reduce_(sent, groups.ep)
                    stats[name]["moves"].append(len(done["moved"]))
                    stats[name]["move_bytes"].append(sent.item())
                    stats[name]["move_ms"].append(seconds.item() * 1e3)
                window.zero_()
        results.append((kind, stats))
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example: python bench/placement.py --experts 16 --topk 2 --ep 4 "
                                       "--tokens 2048 --routing zipf,drift")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=512, help="ffn width of one expert")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--ep", type=int, default=4)
    p.add_argument("--replicas", type=int, default=1, help="spare slots per rank of the replicated policy")
    p.add_argument("--replace-every", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--routing", default="zipf,drift", help="comma list of " + " ".join(ROUTINGS))
    p.add_argument("--zipf-s", type=float, default=1.2, help="Zipf exponent of expert popularity")
    p.add_argument("--drift-every", type=int, default=8, help="steps between two moves of the hot spot (drift)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    args.routing = args.routing.split(",")
    bad = [r for r in args.routing if r not in ROUTINGS]
    if bad:
        p.error(f"--routing {','.join(bad)} is not one of {' '.join(ROUTINGS)}")
    for name in ("tokens", "hidden", "ffn", "experts", "topk", "ep", "replace_every", "drift_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    for problem in experts_over_ep(args.experts, args.ep):
        p.error(f"--experts={args.experts} --ep={args.ep}: {problem}")
    if args.replicas < 1:
        p.error(f"--replicas={args.replicas} must be >= 1: the replicated policy needs spare slots")
    for problem in replacement_has_room(args.replace_every, args.ep) + replicas_fit(args.experts, args.ep,
                                                                                   args.replicas):
        p.error(f"--experts={args.experts} --ep={args.ep} --replicas={args.replicas} "
                f"--replace-every={args.replace_every}: {problem}")
    if args.steps <= args.replace_every:
        p.error(f"--steps={args.steps} must exceed --replace-every={args.replace_every}: the policies are "
                f"compared after the first re-placement")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    per_rank = run_ranks(rank_main, args.ep, args, timeout=args.timeout, threads=args.threads)
    lines = []
    for kind, stats in per_rank[0]:
        static_ms = statistics.median(stats["static"]["ms"])
        for name in POLICIES:
            s = stats[name]
            ms = statistics.median(s["ms"])
            line = {
                "bench": "placement", "routing": kind, "policy": name, "experts": args.experts, "topk": args.topk,
                "ep": args.ep, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
                "zipf_s": args.zipf_s, "drift_every": args.drift_every if kind == "drift" else None,
                "replicas": args.replicas if name == "replicated" else 0,
                "replace_every": args.replace_every if name != "static" else None, "steps": args.steps,
                "busiest_over_mean": round(statistics.mean(s["balance"]), 4),
                "busiest_over_mean_first": round(statistics.mean(s["first"]), 4),
                "ms": round(ms, 3), "ratio_vs_static": round(static_ms / ms, 3),
                "peak_activation_bytes": s["peak"],
                "moves": len(s["moves"]), "experts_moved": sum(s["moves"]),
                "move_bytes": round(statistics.mean(s["move_bytes"])) if s["move_bytes"] else 0,
                "move_ms": round(statistics.mean(s["move_ms"]), 3) if s["move_ms"] else 0.0,
            }
            print(json.dumps(line), flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    main()

"""Communication hidden behind compute, per collective kind, on gloo ranks (CPU).

    python bench/overlap.py [--kind ep] [--ep 2] [--tokens 2048] [--hidden 256] ...

Kinds (:data:`KINDS`; one measurement function each, all printing JSON lines with the same
fields):

- ``ep``: the MoE layer's expert-parallel all-to-all (the all-gather dispatcher's
  all-gather and reduce-scatter with ``--dispatcher allgather``), with
  ``moe.shared_expert_overlap`` and ``moe.overlap_chunks`` off and on
  (:func:`measure_ep`).

Fields of every line: ``kind``, ``variant`` (``off`` is the blocking order), ``comm_ms``
(the kind's collectives with the overlap off: the time the rank is blocked in them, all of
which is communication), ``exposed_ms`` (the time this variant leaves the rank blocked in
them: launches and waits), ``exposed_fraction = exposed_ms / comm_ms``,
``other_blocked_ms`` (blocked in other collectives: for ``ep``, the count exchange, one
per chunk, and the etp collectives), ``step_ms`` (what
the overlap is for: here one MoE layer's forward and backward), ``step_ms_off`` and
``ratio_to_off = step_ms / step_ms_off`` (below 1: faster), and
``planner_exposed_fraction``: the planner's term (:mod:`moe_fold.planner.moe_overlap`) for
the same switches, given the measured ``comm_ms`` and the matmul rate measured here.

How: every rank wraps torch.distributed's collectives to time the calls (a blocking call
in full, an asynchronous one's launch) and the waits on asynchronous ones, per group kind.
Variants run interleaved, in a rotating order, round after round, with the same weights and
inputs; a round's time is the slowest rank's; medians over rounds. On this 2-core machine
the gloo transfer threads compete with compute for the cores, so wall-clock gains are small
and noisy; the exposed fraction is the primary figure.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from moe_fold import comm  # noqa: E402
from moe_fold.config import Config, ModelConfig  # noqa: E402
from moe_fold.launch import run_ranks  # noqa: E402
from moe_fold.layout import ParallelLayout, create_process_groups  # noqa: E402
from moe_fold.models.moe_layer import MoELayer  # noqa: E402
from moe_fold.planner.model import layer_forward_flops  # noqa: E402
from moe_fold.planner.moe_overlap import exposed_ep_seconds  # noqa: E402

# The collectives moe_fold.comm calls; wrapped while a kind is measured.
_COLLECTIVES = ("all_to_all_single", "all_gather_single", "reduce_scatter_single", "all_reduce")


class _TimedWork:
    """An asynchronous collective's work whose wait is timed."""

    def __init__(self, work, blocked: dict, kind: str):
        self._work, self._blocked, self._kind = work, blocked, kind

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._blocked[self._kind] += time.perf_counter() - start


@contextlib.contextmanager
def blocked_seconds():
    """Yield a dict that accumulates, per group kind, the seconds this rank spends inside
    collective calls and waits on asynchronous ones (the exposed communication)."""
    blocked: dict[str, float] = collections.defaultdict(float)
    originals = {name: getattr(dist, name) for name in _COLLECTIVES}

    def timed(fn):
        def call(*args, group=None, async_op=False, **kwargs):
            kind, start = comm.group_kind(group), time.perf_counter()
            work = fn(*args, group=group, async_op=async_op, **kwargs)
            blocked[kind] += time.perf_counter() - start
            return _TimedWork(work, blocked, kind) if async_op else work
        return call

    for name, fn in originals.items():
        setattr(dist, name, timed(fn))
    try:
        yield blocked
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


# --------------------------------------------------------------------------- kind "ep"

EP_VARIANTS = {"off": {}, "shared": dict(shared_expert_overlap=True), "chunks2": dict(overlap_chunks=2),
               "shared+chunks2": dict(shared_expert_overlap=True, overlap_chunks=2)}


def _ep_config(args, variant: str) -> Config:
    config = Config()
    config.model = ModelConfig(vocab_size=64, hidden_size=args.hidden, num_layers=1, num_heads=4, num_kv_heads=4,
                               ffn_hidden_size=args.ffn, seq_length=args.tokens, init_std=0.02)
    moe = config.moe
    moe.num_experts, moe.topk, moe.ffn_hidden_size = args.experts, args.topk, args.ffn
    moe.shared_expert_ffn_hidden_size, moe.aux_loss_coeff = args.shared_ffn, 0.0
    moe.dispatcher, moe.capacity_factor = args.dispatcher, args.capacity_factor
    for key, value in EP_VARIANTS[variant].items():
        setattr(moe, key, value)
    config.parallel.ep = args.ep
    return config


def _ep_rank(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)
    groups = create_process_groups(ParallelLayout(world, ep=args.ep))
    layers = {v: MoELayer(_ep_config(args, v), groups, 0) for v in EP_VARIANTS}
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    upstream = torch.randn(args.tokens, args.hidden, generator=gen)
    kind = "ep" if args.dispatcher == "alltoall" else "etp_ep"
    names = list(EP_VARIANTS)
    rounds: list[dict] = []
    for r in range(args.warmup + args.rounds):
        row = {}
        for variant in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            layer, h = layers[variant], x.clone().requires_grad_()
            dist.barrier()
            with blocked_seconds() as blocked:
                start = time.perf_counter()
                out = layer(h)
                out.backward(upstream)
                step = time.perf_counter() - start
            row[variant] = (step, blocked[kind], sum(blocked.values()) - blocked[kind])
        if r >= args.warmup:
            rounds.append(row)
    # The matmul rate the planner's term needs: the shared expert and the experts on this
    # rank's share of rows, forward and backward, timed alone.
    layer = layers["off"]
    rows = args.tokens * args.topk
    counts = torch.full((layer.experts.num_local_experts,), rows // layer.experts.num_local_experts)
    tokens = torch.randn(int(counts.sum()), args.hidden, requires_grad=True)
    probs = torch.rand(int(counts.sum()))
    start = time.perf_counter()
    for _ in range(args.rounds):
        layer.experts(tokens, counts, probs).sum().backward()
        layer.shared_expert(x.requires_grad_()).sum().backward()
    matmul_s = (time.perf_counter() - start) / args.rounds
    return {"rounds": rounds, "matmul_s": matmul_s}


def measure_ep(args) -> list[dict]:
    """The ``ep`` kind: one JSON-ready dict per variant of :data:`EP_VARIANTS`."""
    results = run_ranks(_ep_rank, args.ep, args, timeout=args.timeout)
    # Per round: the slowest rank's step, the mean rank's blocked times.
    per_round = [{v: (max(res["rounds"][i][v][0] for res in results),
                      *(statistics.mean(res["rounds"][i][v][j] for res in results) for j in (1, 2)))
                  for v in EP_VARIANTS} for i in range(args.rounds)]
    med = {v: tuple(statistics.median(r[v][j] for r in per_round) for j in range(3)) for v in EP_VARIANTS}
    step_off, comm_off, _ = med["off"]
    config = _ep_config(args, "off")
    flops = layer_forward_flops(config, 0)
    matmul_flops = 3 * args.tokens * (flops["experts"] + flops["shared"])
    rate = matmul_flops / statistics.median(res["matmul_s"] for res in results)
    lines = []
    for variant, (step, exposed, other) in med.items():
        planner = exposed_ep_seconds(_ep_config(args, variant), 0, comm_off, rate)
        lines.append({"bench": "overlap", "kind": "ep", "variant": variant, "dispatcher": args.dispatcher,
                      "ep": args.ep, "tokens": args.tokens, "hidden": args.hidden, "ffn": args.ffn,
                      "shared_ffn": args.shared_ffn, "experts": args.experts, "topk": args.topk,
                      "rounds": args.rounds, "comm_ms": 1e3 * comm_off, "exposed_ms": 1e3 * exposed,
                      "exposed_fraction": exposed / comm_off, "other_blocked_ms": 1e3 * other,
                      "step_ms": 1e3 * step, "step_ms_off": 1e3 * step_off,
                      "ratio_to_off": step / step_off, "planner_exposed_fraction": planner / comm_off})
    return lines


# name -> the function measuring that collective kind; each returns JSON-ready dicts.
KINDS = {"ep": measure_ep}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--kind", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)} (default all)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    ep = p.add_argument_group("kind ep: one MoE layer with a shared expert on --ep gloo ranks")
    ep.add_argument("--ep", type=int, default=2)
    ep.add_argument("--dispatcher", choices=("alltoall", "allgather"), default="alltoall")
    ep.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ep.add_argument("--hidden", type=int, default=256)
    ep.add_argument("--ffn", type=int, default=256, help="routed expert width")
    ep.add_argument("--shared-ffn", type=int, default=512, help="shared expert width")
    ep.add_argument("--experts", type=int, default=8)
    ep.add_argument("--topk", type=int, default=2)
    ep.add_argument("--capacity-factor", type=float, default=None, help="default dropless")
    args = p.parse_args(argv)
    for kind in args.kind.split(","):
        if kind not in KINDS:
            raise SystemExit(f"--kind: {kind!r} is not one of {', '.join(KINDS)}")
        for line in KINDS[kind](args):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

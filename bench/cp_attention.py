"""Context parallel attention benchmark: ring and a2a causal attention, forward + backward,
on cp local ranks against single-process attention over the same total sequence.

    python -m bench.cp_attention [--seq 2048 --batch 1 --heads 8 --kv-heads 4 --head-dim 64
                                  --cps 2,4 --kinds ring,a2a --repeats 5 --threads 1]

For each cp size one run of ``cp`` gloo ranks (``moe_fold.launch.run_ranks``, ``--threads``
each) times, round after round and interleaved: the single-process step (full causal
SDPA on the whole sequence, run by rank 0 while the others wait) and one step of each
kind (every rank on its zigzag shard). A step is forward + backward of q, k, v, timed from
a barrier to a barrier, so a cp step is the slowest rank's time. Medians are reported
because the machine is noisy. One JSON line per (kind, cp):
``{"bench": "cp_attention", "kind", "cp", "seq", "ms", "single_ms", "ratio_to_single",
"bytes_sent", ...}``. ``ratio_to_single`` is single_ms / ms, measured in the same run:
above 1 the cp ranks beat one process (at most cp when each rank has the single
process's threads). ``bytes_sent`` is per rank over one forward + backward.
"""

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from bench.timing import barrier_timed_ms
from moe_fold.comm import count_bytes
from moe_fold.parallel.context_parallel import context_parallel_attention, zigzag_split
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups


def _bench_rank(rank, cp, args):
    cp_group = create_process_groups(ParallelLayout(cp, cp=cp), rank).cp
    gen = torch.Generator().manual_seed(0)
    shape_q = (args.batch, args.heads, args.seq, args.head_dim)
    shape_kv = (args.batch, args.kv_heads, args.seq, args.head_dim)
    q, dout = torch.randn(shape_q, generator=gen), torch.randn(shape_q, generator=gen)
    k, v = torch.randn(shape_kv, generator=gen), torch.randn(shape_kv, generator=gen)
    gqa = args.heads != args.kv_heads

    def single():
        if rank == 0:
            qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
            torch.autograd.grad(out, (qs, ks, vs), dout)

    local = [zigzag_split(t, rank, cp, dim=2) for t in (q, k, v, dout)]

    def sharded(kind):
        def step():
            ql, kl, vl = (t.detach().requires_grad_() for t in local[:3])
            out = context_parallel_attention(ql, kl, vl, cp_group, kind=kind)
            torch.autograd.grad(out, (ql, kl, vl), local[3])
        return step

    steps = {"single": single, **{kind: sharded(kind) for kind in args.kinds}}
    sent = {}
    for name, step in steps.items():  # warm-up round, and the bytes of one step
        with count_bytes() as sent[name]:
            step()
    times = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(barrier_timed_ms(step))
    return {name: statistics.median(ts) for name, ts in times.items()}, sent


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048, help="total sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cps", default="2,4", help="comma list of cp sizes")
    p.add_argument("--kinds", default="ring,a2a", help="comma list of ring, a2a")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (median reported)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (and for the single process)")
    args = p.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    for cp in (int(c) for c in args.cps.split(",")):
        per_rank = run_ranks(_bench_rank, cp, args, timeout=1800, threads=args.threads)
        medians, sent = per_rank[0]
        for kind in args.kinds:
            print(json.dumps({
                "bench": "cp_attention", "kind": kind, "cp": cp, "seq": args.seq, "batch": args.batch,
                "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                "threads": args.threads, "ms": round(medians[kind], 3),
                "single_ms": round(medians["single"], 3),
                "ratio_to_single": round(medians["single"] / medians[kind], 3),
                "bytes_sent": sum(sent[kind].values()),
            }), flush=True)


if __name__ == "__main__":
    main()

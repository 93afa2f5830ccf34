"""Static vs dynamic context parallelism on packed micro-batches: per-rank attention work
and measured step time, side by side in one run.

    python -m bench.dynamic_cp [--cp 4 --seq 1024 --batch 2 --micro-batches 4 --hidden 64
                                --layers 2 --dists longtail,corpus --repeats 3 --threads 1]

Document-length distributions:

- ``longtail``: lognormal lengths around ``seq/16`` with one document in ten drawn near
  the maximum length (``0.75..1 x seq``), seeded;
- ``corpus``: the default training corpus (``data.path`` null: the standard library's
  ``.py`` files, byte tokenizer), its real document lengths.

Both are packed the way training packs them (:class:`moe_fold.data.loader.GPTDataset`,
``packing=True``) into ``micro_batches`` micro-batches of ``batch`` rows of ``seq`` tokens
for one cp group of ``cp`` gloo ranks. Static cp gives every rank its zigzag slice of
every row; dynamic cp (:class:`moe_fold.training.dynamic_cp.DynamicCP`) places the documents on
sub-groups with the same memory (``batch*seq/cp`` tokens per rank).

One JSON line per distribution: ``{"bench": "dynamic_cp", "dist", "cp", "seq", ...}`` with

- ``static_attn_flops`` / ``dynamic_attn_flops``: per-rank attention FLOPs of the whole
  step (causal query-key pairs inside documents, padding included, whose queries the rank
  holds; ``4 * heads * head_dim * layers`` FLOPs per pair, forward), and
  ``static_balance`` / ``dynamic_balance``, max over mean of those (1 is perfect);
- ``flops_max_ratio``: static max / dynamic max (above 1: dynamic's slowest rank has less
  attention work);
- ``static_ms`` / ``dynamic_ms``: median step time (forward + backward of the micro-batches,
  barrier to barrier, so the slowest rank's), interleaved rounds; ``time_ratio`` =
  static_ms / dynamic_ms (above 1: dynamic is faster);
- ``static_cp_bytes`` / ``dynamic_cp_bytes``: bytes rank 0 sends over cp groups per step;
- ``static_padding_tokens`` / ``dynamic_padding_tokens``: padding in the step: the packer's
  (static cp attends over it; dynamic cp drops it and pads each sub-group's sequence to a
  multiple of ``2c`` only), part of both FLOP counts;
- ``plan_sizes``: the sub-group sizes of each micro-batch's plan.
"""

import argparse
import json
import os
import statistics
import tempfile

import numpy as np
import torch

from bench.timing import barrier_timed_ms
from moe_fold.comm import count_bytes
from moe_fold.config import Config, ModelConfig
from moe_fold.data.corpus import prepare_data_paths
from moe_fold.data.indexed_dataset import IndexedDataset, write_indexed_dataset
from moe_fold.data.loader import GPTDataset, collate
from moe_fold.training.dynamic_cp import CostModel, DynamicCP, documents_of, group_pair_counts, schedule, zigzag_pair_counts
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.models.model import build_model
from moe_fold.training.step import forward_backward
from moe_fold.parallel.varlen import doc_ids_from_cu_seqlens


def _config(args) -> Config:
    config = Config()
    config.model = ModelConfig(vocab_size=256, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                               num_kv_heads=2, ffn_hidden_size=2 * args.hidden, seq_length=args.seq)
    m = config.moe
    m.num_experts, m.topk, m.ffn_hidden_size = 4, 2, args.hidden
    m.aux_loss_coeff, m.z_loss_coeff, m.capacity_factor = 0.01, 0.001, None
    config.parallel.cp, config.parallel.ep = args.cp, args.cp
    return config


def _cost(args) -> CostModel:
    """Per layer: attention pairs, the other per-token work, and ring K/V bytes at
    ``--flops-per-byte``."""
    h, head_dim, kv_heads = args.hidden, args.hidden // 4, 2
    token = 2 * h * (h + 2 * kv_heads * head_dim) + 2 * h * h + 2 * 3 * h * h  # qkv, proj, topk=2 experts
    kv_bytes = 2 * kv_heads * head_dim * 4
    return CostModel(pair_flops=4.0 * h, token_flops=float(token), kv_token_cost=kv_bytes * args.flops_per_byte)


def _micro_batches(dataset: GPTDataset, args):
    rows = args.micro_batches * args.batch
    if len(dataset) < rows:
        raise ValueError(f"the packed dataset has {len(dataset)} samples of {args.seq} tokens, fewer than "
                         f"micro_batches*batch={rows}")
    samples = [dataset.raw_sample(j) for j in range(rows)]
    return [collate(samples[i:i + args.batch]) for i in range(0, rows, args.batch)]


def _longtail_dataset(args, folder: str) -> GPTDataset:
    rng = np.random.default_rng(args.seed)
    need = args.micro_batches * args.batch * args.seq * 2
    docs, total = [], 0
    while total < need:
        if rng.random() < 0.1:
            n = int(rng.integers(int(0.75 * args.seq), args.seq + 1))
        else:
            n = int(np.clip(rng.lognormal(np.log(args.seq / 16), 0.8), 4, args.seq))
        # The last token is the eod the writer's documents end with.
        docs.append(np.concatenate([rng.integers(1, 255, n - 1), [0]]))
        total += n
    prefix = write_indexed_dataset(os.path.join(folder, "longtail"), docs, 256, 0)
    return GPTDataset(prefix, args.seq, seed=args.seed, packing=True)


def _corpus_dataset(args) -> GPTDataset:
    prefix = prepare_data_paths(None, "byte", args.cache_dir)[0]
    return GPTDataset(IndexedDataset(prefix), args.seq, seed=args.seed, packing=True)


def _pairs_static(batches, cp):
    """Per-rank causal same-document pairs under static cp: every row zigzag-split."""
    out = np.zeros(cp)
    for b in batches:
        B, S = b.tokens.shape
        ids = doc_ids_from_cu_seqlens(b.cu_seqlens, B, S)
        if ids is None:
            ids = torch.arange(B).unsqueeze(1).expand(B, S)
        out += zigzag_pair_counts(ids, cp)
    return out


def _pairs_dynamic(batches, cp, capacity, cost):
    """Per-rank pairs under the dynamic plans (each sub-group's padded sequence zigzag-split),
    the plans' sub-group sizes and their padding tokens."""
    out, sizes, padding = np.zeros(cp), [], 0
    for b in batches:
        lengths = [e - s for s, e in documents_of(b)]
        plan = schedule(lengths, cp, capacity, cost)
        sizes.append([g.size for g in plan.subgroups])
        for g in plan.subgroups:
            out[g.start:g.start + g.size] += group_pair_counts([lengths[d] for d in g.docs], g.size)
            padding += g.padded_tokens(lengths) - sum(lengths[d] for d in g.docs)
    return out, sizes, padding


def _rank(rank, world, args, workloads):
    config = _config(args)
    groups = create_process_groups(ParallelLayout(world, cp=world, ep=world))
    dcp = DynamicCP(groups, _cost(args), capacity=args.batch * args.seq // world)
    model = build_model(config, groups)
    out = {}
    for name, batches in workloads.items():
        slices = [b.cp_slice(groups.rank_in("cp"), world) for b in batches]

        def static():
            model.zero_grad(set_to_none=True)
            forward_backward(model, slices, groups, config)

        def dynamic():
            model.zero_grad(set_to_none=True)
            forward_backward(model, batches, groups, config, dynamic_cp=dcp)

        with count_bytes() as static_bytes:
            static()
        with count_bytes() as dynamic_bytes:
            dynamic()
        times = {"static": [], "dynamic": []}
        for _ in range(args.repeats):
            times["static"].append(barrier_timed_ms(static))
            times["dynamic"].append(barrier_timed_ms(dynamic))
        out[name] = {"static_ms": statistics.median(times["static"]),
                     "dynamic_ms": statistics.median(times["dynamic"]),
                     "static_cp_bytes": static_bytes.get("cp", 0), "dynamic_cp_bytes": dynamic_bytes.get("cp", 0)}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dists", default="longtail,corpus")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--flops-per-byte", type=float, default=10.0,
                   help="compute to cp-link ratio the cost model charges ring traffic at")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default="data_cache")
    args = p.parse_args(argv)
    dists = [d for d in args.dists.split(",") if d]
    for d in dists:
        if d not in ("longtail", "corpus"):
            raise SystemExit(f"--dists: unknown distribution {d!r}; use longtail and/or corpus")
    with tempfile.TemporaryDirectory() as folder:
        datasets = {d: _longtail_dataset(args, folder) if d == "longtail" else _corpus_dataset(args) for d in dists}
        workloads = {d: _micro_batches(ds, args) for d, ds in datasets.items()}
    cost = _cost(args)
    capacity = args.batch * args.seq // args.cp
    times = run_ranks(_rank, args.cp, args, workloads, threads=args.threads, timeout=1800)
    flops_per_pair = cost.pair_flops * args.layers
    for d, batches in workloads.items():
        static = _pairs_static(batches, args.cp) * flops_per_pair
        dynamic, sizes, dynamic_padding = _pairs_dynamic(batches, args.cp, capacity, cost)
        dynamic = dynamic * flops_per_pair
        t = times[0][d]
        ms = {k: max(r[d][k] for r in times) for k in ("static_ms", "dynamic_ms")}
        lengths = [e - s for b in batches for s, e in documents_of(b)]
        print(json.dumps({
            "bench": "dynamic_cp", "dist": d, "cp": args.cp, "seq": args.seq, "batch": args.batch,
            "micro_batches": args.micro_batches, "hidden": args.hidden, "layers": args.layers,
            "documents": len(lengths), "max_doc": max(lengths), "mean_doc": float(np.mean(lengths)),
            "static_attn_flops": static.tolist(), "dynamic_attn_flops": dynamic.tolist(),
            "static_balance": float(static.max() / static.mean()),
            "dynamic_balance": float(dynamic.max() / dynamic.mean()),
            "flops_max_ratio": float(static.max() / dynamic.max()),
            "static_ms": ms["static_ms"], "dynamic_ms": ms["dynamic_ms"],
            "time_ratio": ms["static_ms"] / ms["dynamic_ms"],
            "static_cp_bytes": t["static_cp_bytes"], "dynamic_cp_bytes": t["dynamic_cp_bytes"],
            # A batch without padding has no mask (the loader's None).
            "static_padding_tokens": int(sum(int((~b.token_mask).sum()) for b in batches if b.token_mask is not None)),
            "dynamic_padding_tokens": dynamic_padding, "plan_sizes": sizes, "flops_per_byte": args.flops_per_byte, "threads": args.threads,
        }), flush=True)


if __name__ == "__main__":
    main()

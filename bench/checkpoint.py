"""Checkpoint stall: how long a save stops training, synchronous against asynchronous.

    python bench/checkpoint.py [--preset mixtral-tiny --set model.num_layers=8 ... --rounds 3 --train-steps 2]

One process builds the preset (by default mixtral-tiny scaled to about 107M parameters:
hidden 512, 8 layers, expert width 1024, 8 experts) with AdamW state, and saves it into
a temporary run folder through :class:`moe_fold.training.checkpoint.CheckpointSaver`
(what the training loop uses), rounds of a synchronous and an asynchronous save
interleaved, in one run:

- ``sync_stall_ms``: the synchronous ``save`` call, which returns with the checkpoint
  complete (pieces streamed from the live tensors, sha256, fsync, rename);
- ``async_stall_ms``: the asynchronous ``save`` call, which returns after the host copy of
  the pieces into the saver's buffers (kept from the first save, which is left out: it
  allocates them) and the agreement on the directory; ``async_write_ms``: from that
  call until the background write is complete (``wait``);
- ``ratio_async_to_sync``: ``async_stall_ms / sync_stall_ms`` (medians; target <= 0.25).

With ``--train-steps N`` a training step of the same model (forward, backward, AdamW;
``--micro-batch`` x ``--seq`` tokens) is timed alone (``step_ms``) and while a background
write runs (``step_during_write_ms``, N steps started right after the save call): what the
writer thread costs the steps it overlaps (the machine's cores are shared with it).

Prints one JSON line, ``{"bench": "checkpoint", ...}``.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from moe_fold.config import load_config
from moe_fold.data.loader import Batch
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import build_model
from moe_fold.training.checkpoint import CheckpointSaver
from moe_fold.training.optim import apply_gradients, build_optimizer, build_scheduler
from moe_fold.training.step import forward_backward

SCALED = ["model.hidden_size=512", "model.num_layers=8", "moe.ffn_hidden_size=1024", "model.num_heads=8",
          "model.num_kv_heads=4", "parallel.ep=1"]


def _batch(config, micro_batch: int, seq: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.model.vocab_size, (micro_batch, seq + 1), generator=g)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.ones(micro_batch, seq),
                 torch.arange(seq).repeat(micro_batch, 1), torch.arange(0, micro_batch * seq + 1, seq, dtype=torch.int32))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="mixtral-tiny")
    parser.add_argument("--set", dest="overrides", action="append", default=None,
                        help=f"config override (repeatable; default: {' '.join(SCALED)})")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved sync/async rounds after a warm-up pair")
    parser.add_argument("--train-steps", type=int, default=0, help="steps timed during a background write")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    overrides = SCALED if args.overrides is None else args.overrides
    config = load_config(args.preset, [*overrides, "model.seq_length=" + str(args.seq)])
    one = ProcessGroups.single_process()
    torch.manual_seed(0)
    model = build_model(config, one)
    optimizer = build_optimizer(model, config.optimizer, one)
    scheduler = build_scheduler(optimizer, config)
    params = list(model.parameters())
    batch = _batch(config, args.micro_batch, args.seq)

    def step() -> None:
        forward_backward(model, [batch], one, config)
        apply_gradients(params, optimizer, one, config.optimizer.clip_grad)
        optimizer.zero_grad(set_to_none=True)

    step()  # creates the AdamW moments, which the checkpoint holds
    num_params = sum(p.numel() for p in params)
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        sync = CheckpointSaver(os.path.join(root, "sync"), one, keep_last=1, async_save=False, config=config)
        background = CheckpointSaver(os.path.join(root, "async"), one, keep_last=1, async_save=True, config=config)
        stalls = {"sync": [], "async": []}
        writes = []
        for r in range(args.rounds + 1):  # round 0 warms up (the async saver allocates its buffers)
            sync_ms = _timed(lambda: sync.save(r + 1, model, optimizer, scheduler, {"step": r + 1}))
            async_ms = _timed(lambda: background.save(r + 1, model, optimizer, scheduler, {"step": r + 1}))
            write_ms = async_ms + _timed(background.wait)
            if r:
                stalls["sync"].append(sync_ms)
                stalls["async"].append(async_ms)
                writes.append(write_ms)
        latest = os.path.join(root, "async", "checkpoints", f"step_{args.rounds + 1:06d}")
        checkpoint_bytes = sum(os.path.getsize(os.path.join(latest, f)) for f in os.listdir(latest))
        record = {"bench": "checkpoint", "preset": args.preset, "overrides": overrides,
                  "params": num_params, "checkpoint_bytes": checkpoint_bytes, "rounds": args.rounds,
                  "sync_stall_ms": statistics.median(stalls["sync"]),
                  "async_stall_ms": statistics.median(stalls["async"]),
                  "async_write_ms": statistics.median(writes),
                  "sync_stall_all_ms": stalls["sync"], "async_stall_all_ms": stalls["async"]}
        record["ratio_async_to_sync"] = record["async_stall_ms"] / record["sync_stall_ms"]
        if args.train_steps:
            alone = [_timed(step) for _ in range(args.train_steps)]
            background.save(args.rounds + 2, model, optimizer, scheduler, {"step": args.rounds + 2})
            during = [_timed(step) for _ in range(args.train_steps)]
            still_writing = background.pending is not None
            background.wait()
            record.update(step_ms=statistics.median(alone), step_during_write_ms=statistics.median(during),
                          write_outlived_steps=still_writing)
        record["ms"] = record["async_stall_ms"]
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()

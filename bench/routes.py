"""Route-trace benchmark: the training step with ``train.route_trace_every=1`` against
the same step with tracing off, and the bytes a trace takes per token per MoE layer.

    python bench/routes.py [--preset mixtral-tiny] [--set key=value ...] [--rounds 5]
                           [--iters 2] [--threads N]

Two runs of the same config are built on one process (:func:`set_up_run`, ep=1), one
with tracing off and one writing a trace of every step into a temporary run folder.
Their steps (:func:`moe_fold.training.train.run_step`: forward, backward, optimizer,
and for the traced run the hooks and the shard it writes) run interleaved, round after
round, ``--iters`` steps each per round; medians over rounds of wall and process CPU
time per step are reported. Output: one JSON line per candidate, then a summary line
with ``overhead`` (traced / off - 1, from the medians) and ``bytes_per_token_layer``
(the shard of the last traced step over its tokens and MoE layers, keys included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from moe_fold.config import load_config, moe_layer_indices  # noqa: E402
from moe_fold.layout import ProcessGroups  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mixtral-tiny", help="a preset or YAML file")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="config override, repeatable")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--iters", type=int, default=2, help="steps per candidate per round (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per candidate first (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    return p.parse_args()


def build(args, run_dir: Path, every: int):
    from moe_fold.training.run_setup import set_up_run

    steps = args.warmup + args.rounds * args.iters + 1
    config = load_config(args.preset, ["parallel.ep=1", "wandb.mode=disabled", f"train.steps={steps}",
                                       f"train.run_dir={run_dir}", f"train.route_trace_every={every}",
                                       *args.overrides])
    run = set_up_run(config, torch.device("cpu"), ProcessGroups.single_process())
    run.model.train()
    return run


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from moe_fold.training.train import run_step

    with tempfile.TemporaryDirectory() as tmp:
        runs = {"off": build(args, Path(tmp) / "off", 0), "traced": build(args, Path(tmp) / "traced", 1)}
        step = {name: 0 for name in runs}

        def one(name: str) -> None:
            step[name] += 1
            torch.manual_seed(step[name])
            run_step(runs[name], step[name])

        for name in runs:
            for _ in range(args.warmup):
                one(name)
        wall = {name: [] for name in runs}
        cpu = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name in runs:
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.iters):
                    one(name)
                wall[name].append((time.perf_counter() - w0) / args.iters)
                cpu[name].append((time.process_time() - c0) / args.iters)
        config = runs["traced"].config
        shard = Path(tmp) / "traced" / "routes" / f"step_{step['traced']:06d}" / "rank_00000.safetensors"
        tokens = config.train.global_batch_size * config.model.seq_length
        layers = len(moe_layer_indices(config))
        med = {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in runs}
        for name in runs:
            print(json.dumps({"bench": "routes", "candidate": name, "step_ms": med[name][0] * 1e3,
                              "cpu_ms": med[name][1] * 1e3, "rounds_ms": [x * 1e3 for x in wall[name]]}))
        print(json.dumps({"bench": "routes", "summary": True, "preset": args.preset, "tokens_per_step": tokens,
                          "moe_layers": layers, "topk": config.moe.topk,
                          "overhead": med["traced"][0] / med["off"][0] - 1,
                          "overhead_cpu": med["traced"][1] / med["off"][1] - 1,
                          "bytes_per_token_layer": shard.stat().st_size / tokens / layers}))


if __name__ == "__main__":
    main()

"""Train a model: a preset name or a YAML config, overridden with --set.

Three ways to run:
  - one process:                         moe-fold train --config mixtral-tiny
  - N local CPU ranks (gloo), spawned:   moe-fold train --config mixtral-tiny --nproc 4
  - torchrun (GPUs with NCCL, or CPU):   torchrun --nproc-per-node 8 -m moe_fold.cli train --config ...
    (the ranks read RANK, WORLD_SIZE, MASTER_ADDR, ... from the environment)

The config is validated for the world size before any rank starts; a bad config prints
every problem and exits with code 2. Rank 0 prints what the --set overrides change in the
preset or file (the whole config is the run's config.yaml) and both layouts, a
progress bar, and a summary; the run folder (train.run_dir) gets config.yaml,
metrics.jsonl, checkpoints, heatmaps and (wandb.mode offline/online) the wandb run.

Long runs (moe_fold.training.stop): a signal of train.exit_signals (to this process, the
--nproc launcher, which passes it on, or any rank) or a budget (train.exit_after_minutes,
train.exit_at_step) stops every rank after the same step, with that step's checkpoint, and
one line saying so. Exit codes: 0 finished, or stopped at a budget; 128 + the signal number
after a signal (143 SIGTERM, 130 SIGINT, 138 SIGUSR1); 130 also when a second Ctrl-C
aborted at once (no checkpoint of that step); 1 failed; 2 bad config. --resume continues
from the newest complete checkpoint (a fresh start when there is none); under torchrun a
restarted group (TORCHELASTIC_RESTART_COUNT > 0 on any rank) always resumes, and so does a
group that --nproc N --max-restarts M starts again after a rank failed, died or hung
(moe_fold.training.heartbeat).

Elastic restarts (parallel.elastic=true, moe_fold.elastic): a world the configured layout
does not fit (torchrun --nnodes MIN:MAX after a node left or came back) takes a layout
derived from the config; rank 0 prints it and appends it to <run_dir>/elastic.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys

EPILOG = """examples:
  moe-fold train --config mixtral-tiny --nproc 4
      tiny Mixtral on 4 CPU ranks (ep 2 x dp 2), the demo corpus, ~3 minutes
  moe-fold train --config mixtral-tiny --nproc 4 --set train.steps=300 --set parallel.ep=4
  moe-fold train --config mixtral-tiny --nproc 4 --resume      # continue train.run_dir
  moe-fold train --config mixtral-tiny --resume --set train.exit_after_minutes=230   # a job's time limit
  moe-fold train --config mixtral-tiny --nproc 4 --max-restarts 3 --set train.hang_timeout_s=60
      a rank that fails, dies or makes no progress for 60 s: named, stacks in <run_dir>/hang/, the ranks
      restarted from the newest checkpoint (up to 3 times)
  moe-fold train --config mixtral-tiny --nproc 4 --set parallel.ep=4 --set moe.replace_every=50 --set moe.replicas=1
      experts move to where the load is, the hottest with a copy (docs/placement.md)
  moe-fold train --config my.yaml --set wandb.mode=disabled --set train.run_dir=runs/exp1
  torchrun --nproc-per-node 8 -m moe_fold.cli train --config qwen3-moe-tiny --set parallel.ep=8

presets: mixtral-8x7b mixtral-8x22b qwen2-57b-a14b qwen3-30b-a3b deepseek-v3
         mixtral-tiny qwen2-moe-tiny qwen3-moe-tiny deepseek-tiny deepseek-v3-tiny

SIGTERM, SIGINT (Ctrl-C) or SIGUSR1 (train.exit_signals) stop every rank after the same step,
with its checkpoint; a second Ctrl-C aborts at once.
exit codes: 0 done, or train.exit_after_minutes / train.exit_at_step reached; 128 + the signal
after a stop signal (143 SIGTERM, 130 SIGINT, 138 SIGUSR1); 1 failed (a rank ended by the hang
watch exits 75; the launcher then exits 1); 2 bad config
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--config", required=True, metavar="FILE_OR_PRESET",
                        help="a YAML config file or a preset name")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                        help="override one config key, e.g. --set train.steps=50 (repeatable)")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="spawn N local ranks on CPU with gloo (default: 1, or torchrun's world)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in train.run_dir (a fresh start when "
                             "there is none)")
    parser.add_argument("--no-progress", action="store_true", help="print one line per step instead of a bar")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="with --nproc: when a rank fails, dies or hangs (train.hang_timeout_s), start the ranks "
                             "again from the newest checkpoint, up to N times (torchrun's --max-restarts)")
    parser.add_argument("--faults", default="", metavar="PLAN",
                        help="inject faults to test the recovery paths, e.g. nan@batch=5,spike@step=9 "
                             "(moe_fold.training.faults: nan, inf or spike at a step or a global batch)")


def _torchrun_world() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def _rank_main(rank: int, world_size: int, config, resume: bool, progress: bool, faults, defaults):
    """One spawned rank (module level so the forkserver can import it)."""
    from rich.console import Console

    from moe_fold.launch import keep_freed_memory
    from moe_fold.training.train import compute_device, train

    # Each rank is its own process: the parent's setting does not reach it.
    keep_freed_memory(compute_device(config))
    console = Console(soft_wrap=True) if rank == 0 else None
    return train(config, resume=resume, console=console, progress=progress, faults=faults, defaults=defaults)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from moe_fold.config import ConfigError, load_config
    from moe_fold.training.faults import FaultPlan
    from moe_fold.training.train import check_trainable, resolve_backends

    err = Console(stderr=True, soft_wrap=True)
    torchrun = _torchrun_world()
    if torchrun is not None:
        from moe_fold.launch import parent_handle

        # Taken first: an agent that dies while the config loads is still noticed.
        agent = parent_handle()
    if args.nproc is not None and torchrun is not None:
        err.print(f"error: --nproc={args.nproc} cannot be used under torchrun (WORLD_SIZE={torchrun}); "
                  f"torchrun already started the ranks")
        return 2
    if args.nproc is not None and args.nproc < 1:
        err.print(f"error: --nproc={args.nproc} must be >= 1")
        return 2
    if args.max_restarts < 0 or (args.max_restarts and (args.nproc or 1) < 2):
        err.print(f"error: --max-restarts={args.max_restarts} must be >= 0 and needs --nproc 2 or more (torchrun "
                  f"has its own --max-restarts)")
        return 2
    world = torchrun or args.nproc or 1
    try:
        faults = FaultPlan.parse(args.faults)
        config = load_config(args.config, args.overrides)
        defaults = load_config(args.config)  # what the first screen shows the changes to
        if config.init.from_hf is not None:
            from moe_fold.models.hf import hf_config

            # The architecture (and tokenizer) come from the Hugging Face folder; the
            # preset or file keeps the rest (layout, data, optimizer, training).
            config = hf_config(config.init.from_hf, config)
        if config.init.upcycle_from is not None:
            from moe_fold.models.hf.upcycle import upcycled_config

            # The architecture comes from the dense folder, the experts' count, top-k
            # and routing from the preset or file.
            config = upcycled_config(config.init.upcycle_from, config)
        if config.parallel.elastic:
            # The one hook of elastic restarts: the layout for the world this start got.
            config = _elastic_layout(config, world, rank0=torchrun is None or os.environ["RANK"] == "0")
        try:
            check_trainable(config, world)
        except ConfigError as e:
            from moe_fold.elastic import with_elastic_hint

            # A world the layout does not fit: name the layout parallel.elastic=true would take.
            raise with_elastic_hint(e, config, world) from None
        from moe_fold.data.sources import check_data

        # A damaged or mismatched dataset fails here, before any rank starts.
        check_data(config)
        if torchrun is None:
            import torch

            # Before any rank starts, for the device the ranks will use: spawned ranks run
            # gloo on the CPU, a single process the GPU if there is one. (Under torchrun
            # each rank resolves the same way on its own GPU.)
            config = resolve_backends(config, torch.device("cpu") if world > 1 else None)
    except (ValueError, OSError) as e:  # ConfigError, HFConfigError, DatasetFormatError, unreadable files
        err.print(f"error: {e}", markup=False, highlight=False)
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if torchrun is not None else 0
        if restarts:
            # Under torchrun --nnodes MIN:MAX a node that left restarts the survivors in a smaller world.
            err.print(f"torchrun restarted the workers (restart {restarts}) in a world of {world} ranks: a node left "
                      f"or came back", markup=False, highlight=False)
        return 2
    if torchrun is None and world > 1 and config.train.device == "cuda":
        err.print(f"error: train.device=cuda cannot run on the gloo ranks of --nproc={world} (they compute on the "
                  f"CPU); start GPU ranks with torchrun (NCCL)")
        return 2
    progress = not args.no_progress
    if torchrun is not None:
        return _run_torchrun(config, args.resume, progress, agent, faults, defaults)
    if world == 1:
        from moe_fold.launch import keep_freed_memory
        from moe_fold.training.train import compute_device, train

        try:
            device = compute_device(config)
        except ConfigError as e:
            err.print(f"error: {e}", markup=False, highlight=False)
            return 2
        # A CPU training step allocates the same large tensors every step: keep their pages
        # mapped (spawned ranks and torchrun workers do it once their device is known).
        keep_freed_memory(device)
        return _ended(train(config, resume=args.resume, console=Console(soft_wrap=True), progress=progress,
                            faults=faults, defaults=defaults), config, err)
    import signal
    import time

    from moe_fold.launch import RankError, run_ranks
    from moe_fold.training.heartbeat import read_report

    # Idle OpenMP threads spin on the cores the other ranks compute on; libgomp reads this
    # when it loads, so it must be in the environment before the rank processes start.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    threads = max(1, (os.cpu_count() or 1) // world)
    resume = args.resume
    try:
        for attempt in range(args.max_restarts + 1):
            began = time.time()
            try:
                results = run_ranks(_rank_main, world, config, resume, progress, faults, defaults,
                                    timeout=7 * 24 * 3600.0,
                                    threads=threads, env={"MOE_FOLD_PG_TIMEOUT": str(int(config.parallel.timeout_s))},
                                    forward_signals=[signal.Signals[name] for name in config.train.exit_signals])
                break
            except RankError as e:
                hang = read_report(config.train.run_dir, since=began)
                err.print(f"error: training failed: {hang or e}", markup=False, highlight=False)
                if attempt == args.max_restarts:
                    return 1
                # As torchrun's restarted groups do: continue from the newest checkpoint.
                resume = True
                err.print(f"restarting the {world} ranks ({attempt + 1} of --max-restarts={args.max_restarts}) "
                          f"from the newest checkpoint in {config.train.run_dir}", markup=False, highlight=False)
    except KeyboardInterrupt:
        err.print(f"aborted: Ctrl-C killed the {world} ranks; the newest checkpoint in "
                  f"{config.train.run_dir} is the one to --resume from", markup=False, highlight=False)
        return 130
    return _ended(results[0], config, err)


def _elastic_layout(config, world: int, rank0: bool):
    """``config`` with the layout :func:`moe_fold.elastic.choose_layout` takes for ``world``
    ranks; on rank 0 said on stdout and appended to ``<run_dir>/elastic.jsonl`` (time, world,
    rule, sizes, reason). Every rank chooses the same: the choice depends on the config and
    the world only."""
    import json
    import time
    from pathlib import Path

    from moe_fold.elastic import choose_layout

    choice = choose_layout(config, world)
    if rank0:
        print(f"elastic layout: {choice.reason}", flush=True)
        run_dir = Path(config.train.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {"time": time.time(), "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                  **choice.record()}
        with open(run_dir / "elastic.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
    return choice.config


def _ended(result, config, err) -> int:
    """The exit code of a run that returned; a run that stopped early says why, in one line."""
    if result.stop is None:
        return 0
    err.print(result.stop.message(config.train.steps, result.checkpoint, ran=bool(result.losses)),
              markup=False, highlight=False)
    return result.stop.exit_code


def _run_torchrun(config, resume: bool, progress: bool, agent: int | None, faults, defaults) -> int:
    """One torchrun worker. ``agent``: a handle on its torchrun agent (launch.parent_handle,
    None where the system offers none); ``faults``: the --faults plan; ``defaults``: the
    config the first screen shows the changes to."""
    import datetime
    import signal

    import torch
    import torch.distributed as dist
    from rich.console import Console

    from moe_fold.launch import agree_on_round, exit_with_parent, keep_freed_memory
    from moe_fold.training.train import compute_device, train

    # torchrun starts each worker in a session of its own, so nothing ends a worker whose
    # agent was killed (SIGKILL, OOM killer): it would train on, writing into the run folder.
    # The watch stops it after its step (the first exit signal) and ends it soon after.
    stop = signal.Signals[config.train.exit_signals[0]] if config.train.exit_signals else None
    if agent is not None:
        exit_with_parent(agent, who=f"the torchrun agent (pid {os.getppid()})", stop_signal=stop)
    elif int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print("warning: no pidfd on this system: a worker whose torchrun agent is killed (SIGKILL) will not "
              "notice it; end the workers by pid", file=sys.stderr)

    if config.parallel.elastic and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
            and os.environ.get("RANK") == "0":
        # Seen with torch 2.13: the agents fail in the rendezvous when a node that left comes back.
        print("warning: parallel.elastic=true with torchrun's shared store: a node that leaves is survived, but "
              "one that comes back cannot rejoin; start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
              file=sys.stderr)
    backend = config.parallel.backend
    if backend == "auto":
        cuda = config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available())
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    timeout = datetime.timedelta(seconds=config.parallel.timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun's agent gives every start the same store, still holding the keys of the
    # start before (the gloo addresses of ranks it killed): each start gets its own prefix.
    start = agree_on_round(store, rank, world, timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"moe-fold/start_{start}", store), rank=rank,
                            world_size=world, timeout=timeout)
    try:
        # A group that torchrun restarted (--max-restarts, or a node that left or came back)
        # continues the run: starting over would overwrite its checkpoints. Any rank's agent
        # having restarted counts: a node that comes back has a fresh agent, whose count is 0.
        restarted = torch.tensor([int(resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)],
                                 device="cuda" if backend == "nccl" else "cpu")
        dist.all_reduce(restarted, op=dist.ReduceOp.MAX)
        resume = bool(restarted.item())
        keep_freed_memory(compute_device(config))
        rank0 = rank == 0
        result = train(config, resume=resume, console=Console(soft_wrap=True) if rank0 else None,
                       progress=progress and sys.stdout.isatty(), faults=faults, defaults=defaults)
    finally:
        dist.destroy_process_group()
    if not rank0:
        return 0 if result.stop is None else result.stop.exit_code
    return _ended(result, config, Console(stderr=True, soft_wrap=True))

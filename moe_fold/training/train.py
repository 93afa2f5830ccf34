"""The training loop: one optimizer step per global batch, on any layout of ranks.

Per step, every rank takes its micro-batches of the global batch
(``DataLoader.global_batch``: its dp shard, its cp slice; the ranks of one pipeline the
same ones) and runs their forward and backward with :func:`moe_fold.training.step.forward_backward`
(one after another letting the grads add up, or the pipeline schedule under pp; the loss
scaling that makes the summed grads the exact gradient of the global-batch mean loss,
and the routers' ``loss_scale = 1/num_microbatches``, are documented there). Then
:func:`moe_fold.training.optim.reduce_gradients` completes the gradient reduction (posted during
the backward with ``parallel.overlap_grad_reduce``, :mod:`moe_fold.training.buckets`) and clips
the global norm, and the routers close their step (:func:`close_routers`: expert-bias update,
``global_aux`` reset). Then the step reads its scalars on the host, once, packed in one
tensor (the LM loss, the gradient norm, the router and MTP losses, the routing
statistics: docs/performance.md, Host synchronisations), and on a finite loss and norm
steps AdamW (whose parameter all-gathers, with ``parallel.overlap_param_gather``, complete
during the next forward); the LR schedule steps. The step's loss is the LM loss plus the
auxiliary and MTP losses it weighs in (:mod:`moe_fold.training.step_losses`); the routing
metrics only read.

Determinism: with ``train.deterministic`` torch uses deterministic algorithms, and the
random state (torch's and Python's) is re-seeded from ``(train.seed, step, rank)`` at the start of every step,
so a resumed run draws the same numbers as an uninterrupted one without saving RNG state.

Expert placement: with ``moe.replace_every`` (or ``moe.replicas``) an
:class:`~moe_fold.training.replace.ExpertReplacer` re-places the experts after the step
from the load of the last window (weights, grads and optimizer moments move; the record
says what moved), and its state goes into checkpoints (docs/placement.md).

Non-finite steps: a non-finite global loss or grad norm takes no optimizer step; the
step's forwards run again under hooks to name the first module whose output went
non-finite (:mod:`moe_fold.training.numerics`); then the run goes on (``train.on_nonfinite=skip``:
a warning, ``skipped``/``nonfinite_module`` in metrics.jsonl) or raises before that step
is saved (``stop``). A loss above ``train.loss_spike_factor`` x the median of the previous
``train.loss_spike_window`` losses is logged as ``loss_spike`` with a warning.
Stopping early (a signal of ``train.exit_signals``, ``train.exit_after_minutes``,
``train.exit_at_step``): after each step the ranks agree whether to stop there
(:mod:`moe_fold.training.stop`), and then write that step's checkpoint.
docs/reliability.md lists every fault and what happens.

Checkpoints every ``train.save_every`` steps and at the last one go through a
:class:`moe_fold.training.checkpoint.CheckpointSaver` (in the background with
``train.async_save``); the run waits for the last write before it returns, and on an
error before it leaves. Validation (``train.eval_every``, :mod:`moe_fold.training.evaluate`)
writes its own rows to metrics.jsonl without changing the training data order or RNG.

How the code reads (:func:`_train`, top to bottom): :func:`_prepare_process` (checks,
device, torch's settings, process groups); :mod:`moe_fold.training.run_setup` builds the
run's collaborators (:func:`~moe_fold.training.run_setup.set_up_run`), loads what it starts
from (:func:`~moe_fold.training.run_setup.load_start_state`) and opens its logger; then per
step :func:`_seed_step`, :func:`run_step` (a :class:`~moe_fold.training.periodic.StepRecord`)
and the ordered periodic actions of :mod:`moe_fold.training.periodic` (re-place, loss
spikes, log, evaluate, stop, save).

Entry points: :func:`train` (one rank; torch.distributed already initialised, or a single
process), :func:`check_trainable` (rules of the loop on top of
:func:`moe_fold.config.validate`, checked before any rank starts) and
:func:`resolve_backends` (the kernel backends ``auto`` means on the run's device, also
before any rank starts; the run's config.yaml records them).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn

from moe_fold.comm import all_reduce_
from moe_fold.config import Config, ConfigError, validate
from moe_fold.dispatch.router import Router
from moe_fold.kernels.backends import resolve_config
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.model import Transformer
from moe_fold.models.model import build_model as build_transformer
from moe_fold.training.cadence import start_cadence
from moe_fold.training.checkpoint import CheckpointSaver
from moe_fold.training.faults import FaultPlan
from moe_fold.training.heartbeat import Heartbeat
from moe_fold.training.numerics import first_nonfinite_module
from moe_fold.training.optim import reduce_gradients
from moe_fold.training.periodic import (
    Action, CheckStop, Evaluate, LogStep, ReplaceExperts, RollBack, SaveCheckpoint, StepRecord, WatchLossSpikes,
    at_step, stopping,
)
from moe_fold.training.precision import autocast
from moe_fold.training.run_setup import Run, load_start_state, set_up_run, start_logging
from moe_fold.training.step import forward_backward as step_forward_backward
from moe_fold.training.stop import ExitSignals, Stop, StopRule

if TYPE_CHECKING:
    from rich.console import Console

    from moe_fold.training.metrics import MetricsLogger

__all__ = ["TrainResult", "check_trainable", "resolve_backends", "set_tf32", "train", "run_step", "build_groups",
           "read_metrics"]


@dataclass
class TrainResult:
    """What a run did, returned by every rank (the same values on every rank)."""
    losses: list[float] = field(default_factory=list)  # loss of each step run now, in order
    first_step: int = 1  # the step number of losses[0]
    final_loss: float = float("nan")
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    run_dir: str = ""
    checkpoint: Optional[str] = None
    wandb_dir: Optional[str] = None
    plots: list[str] = field(default_factory=list)  # <run_dir>/plots/*.png rank 0 wrote ([] elsewhere)
    stop: Optional[Stop] = None  # why the run ended before train.steps (None: it did not)

    def add(self, record: StepRecord) -> None:
        """Count in a step that ran, once its periodic actions are done."""
        self.losses.append(record.loss)
        if record.checkpoint is not None:
            self.checkpoint = record.checkpoint
        self.stop = record.stop


def check_trainable(config: Config, world_size: int) -> None:
    """``validate`` plus what the loop itself cannot do yet; raises ConfigError."""
    validate(config, world_size)
    problems = []
    if config.moe.seq_aux_loss_coeff > 0 and config.parallel.dynamic_cp:
        # Dynamic cp concatenates documents of different samples on one row, so the
        # router can no longer tell which sample a token came from.
        problems.append(f"moe.seq_aux_loss_coeff={config.moe.seq_aux_loss_coeff} needs the micro-batch's samples, "
                        f"which parallel.dynamic_cp=true regroups; use moe.aux_loss_coeff (batch-level) instead")
    if problems:
        raise ConfigError(problems)


def build_groups(config: Config) -> ProcessGroups:
    """This rank's process groups (a single process when torch.distributed is not running)."""
    if not (dist.is_available() and dist.is_initialized()):
        return ProcessGroups.single_process()
    p = config.parallel
    layout = ParallelLayout(dist.get_world_size(), tp=p.tp, cp=p.cp, pp=p.pp, ep=p.ep, etp=p.etp, order=p.order)
    # torch gives new groups its 30-minute default, not the world's: a rank that hangs
    # would hold its peers in an all-to-all that long.
    return create_process_groups(layout, timeout=datetime.timedelta(seconds=p.timeout_s))


# --------------------------------------------------------------------------- the loop

def compute_device(config: Config) -> torch.device:
    """The device this rank computes on (``train.device``). ``cpu`` and ``cuda`` are
    explicit; ``auto`` is CUDA under NCCL (one GPU per rank, LOCAL_RANK) and, in a single
    process, when a GPU is visible and ``parallel.backend`` is not gloo; CPU otherwise
    (gloo ranks). Raises ConfigError for a choice this process cannot honour, before any
    work: ``cuda`` where no GPU is visible, or a device the process group cannot reduce."""
    setting = config.train.device
    distributed = dist.is_available() and dist.is_initialized()
    backend = dist.get_backend() if distributed else None
    if setting == "auto":
        cuda = backend == "nccl" if distributed else torch.cuda.is_available() and config.parallel.backend != "gloo"
    else:
        cuda = setting == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ConfigError([f"train.device={setting} needs CUDA, but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}, CUDA build {torch.version.cuda})"])
    if distributed and cuda != (backend == "nccl"):
        raise ConfigError([f"train.device={setting} computes on {'CUDA' if cuda else 'the CPU'}, but the process "
                           f"group is {backend}: NCCL reduces CUDA tensors, gloo runs CPU ranks"])
    # Environment: the launcher's (torchrun's) LOCAL_RANK names this rank's GPU.
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")


def resolve_backends(config: Config, device: Optional[torch.device] = None) -> Config:
    """``config`` with each ``moe.*_backend`` that is ``auto``
    resolved for ``device`` (default: the one this process trains on) and
    ``train.precision`` by :func:`moe_fold.kernels.backends.resolve_config`; raises
    ConfigError naming each backend that cannot run there."""
    return resolve_config(config, compute_device(config) if device is None else device)


def set_tf32(config: Config, device: torch.device) -> None:
    """``train.tf32``: TF32 tensor cores for float32 matmuls and convolutions on CUDA. A
    CPU run leaves torch's setting as it is (it has no TF32)."""
    if device.type == "cuda":
        precision = "tf32" if config.train.tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = precision
        torch.backends.cudnn.conv.fp32_precision = precision


def _set_determinism(config: Config, device: torch.device) -> None:
    if config.train.deterministic:
        if device.type == "cuda":
            # Environment: cuBLAS reads it to make its reductions deterministic (torch's
            # deterministic mode asks for it).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def _seed_step(config: Config, step: int, rank: int) -> None:
    seed = (config.train.seed * 1_000_003 + step) * 4099 + rank
    torch.manual_seed(seed)
    # Python's generator too: a forked rank's is seeded from the OS at the fork (random's
    # at-fork hook), and a checkpoint saves its state (rng_<rank>.json), so without this two
    # runs of one config on several ranks write different checkpoint bytes.
    random.seed(seed)


def train(config: Config, resume: bool = False, console: Optional[Console] = None, progress: bool = True,
          stop_at: Optional[int] = None, *, defaults: Optional[Config] = None, metrics: bool = True,
          faults: FaultPlan = FaultPlan(),
          build_model: Callable[[Config, ProcessGroups], Transformer] = build_transformer,
          forward_backward: Callable = step_forward_backward,
          on_heartbeat: Optional[Callable[[Heartbeat], None]] = None) -> TrainResult:
    """Run ``config`` on this rank; see the module docstring.

    ``resume`` continues from the latest checkpoint in ``train.run_dir`` (a fresh start
    when there is none). ``stop_at`` ends this run after that step (with a checkpoint),
    leaving the schedule of ``train.steps`` intact for a later ``resume``. A signal of
    ``train.exit_signals`` or a budget (``train.exit_after_minutes``, ``train.exit_at_step``)
    ends it early, every rank after the same step, with that step's checkpoint
    (:mod:`moe_fold.training.stop`; ``TrainResult.stop`` says why). A fresh run
    with ``init.from_hf`` starts from that Hugging Face folder's weights, one with
    ``init.upcycle_from`` from a dense folder's weights upcycled into experts (the config
    must come from :func:`moe_fold.models.hf.upcycle.upcycled_config`). Rank 0 prints to
    ``console`` (a rich Console; None: no output): first the config's changes to
    ``defaults`` (the preset or file it came from; None: the dataclasses' defaults) and
    the layouts; it writes ``metrics.jsonl`` and the wandb run. Returns the same
    :class:`TrainResult` on every rank.

    The run's collaborators: ``metrics=False`` leaves out the routing metrics (the steps
    are the same, bit for bit); ``faults`` (:class:`moe_fold.training.faults.FaultPlan`)
    injects faults; ``build_model`` and ``forward_backward`` replace the model builder and
    the step's forward and backward (:func:`moe_fold.training.run_setup.set_up_run`);
    ``on_heartbeat`` is given the run's :class:`Heartbeat` once it exists (its measured
    step and save times give a torchrun worker's stop grace: ``cli/train.py``)."""
    # train.deterministic and train.tf32 switch torch's process-wide settings for the run only.
    previous = torch.are_deterministic_algorithms_enabled()
    previous_fp32 = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    began = time.monotonic()
    try:
        # train.compile=blocks: the dropless layer's counts trace as unbacked sizes.
        compiling = torch._dynamo.config.patch(capture_scalar_outputs=config.train.compile == "blocks")
        with ExitSignals(config.train.exit_signals) as signals, compiling:
            config, device, groups = _prepare_process(config)
            run = set_up_run(config, device, groups, resume, metrics=metrics, faults=faults, build_model=build_model,
                             forward_backward=forward_backward)
            return _train(run, resume, console, progress, stop_at, signals, began, defaults, on_heartbeat)
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = previous_fp32


def _train(run: Run, resume: bool, console: Optional[Console], progress: bool, stop_at: Optional[int],
           signals: ExitSignals, began: float, defaults: Optional[Config],
           on_heartbeat: Optional[Callable[[Heartbeat], None]] = None) -> TrainResult:
    config, groups, device = run.config, run.groups, run.device
    start_step, checkpoint_path = load_start_state(run, resume)
    logger = start_logging(run, console, progress, start_step, resumed_from=checkpoint_path, defaults=defaults)
    result = TrainResult(first_step=start_step + 1, run_dir=str(run.run_dir), checkpoint=checkpoint_path)
    t, rank = config.train, groups.rank
    run.model.train()
    begin = time.perf_counter()
    last_step = t.steps if stop_at is None else min(stop_at, t.steps)
    cadence = start_cadence(config, device, groups.layout.world_size, logger, start_step)
    # The checkpoint clock's decision rides in the stop check's all-reduce: one per step.
    stops = StopRule(config, signals, device, groups.layout.world_size, began, votes=[cadence])
    # A signal or budget before the first step: no step, and nothing new to save.
    result.stop = stops.check(start_step, after_a_step=False)
    saver = CheckpointSaver(run.run_dir, groups, t.keep_last, async_save=t.async_save, config=config,
                            timeout_s=config.parallel.timeout_s)
    # Hang detection: one beat as each phase begins (moe_fold.training.heartbeat).
    heartbeat = Heartbeat.for_run(config, rank, groups.layout.world_size)
    if on_heartbeat is not None:
        on_heartbeat(heartbeat)
    tokens_per_step = t.global_batch_size * config.model.seq_length
    # After each step, in this order (moe_fold/training/periodic.py says how to add one).
    actions: list[Action] = [
        ReplaceExperts(replacer=run.replacer, optimizer=run.optimizer, beat=heartbeat.beat),
        WatchLossSpikes(spikes=run.spikes, warn=rank == 0, stop=t.on_loss_spike == "stop"),
        LogStep(logger=logger, collector=run.collector, tokens_per_step=tokens_per_step),
        RollBack(run=run, saver=saver, logger=logger),
        Evaluate(run=run, logger=logger, beat=heartbeat.beat),
        CheckStop(stops=stops, console=console if rank == 0 else None),
        SaveCheckpoint(run=run, saver=saver, cadence=cadence, logger=logger, when=[at_step(last_step), stopping],
                       beat=heartbeat.beat),
    ]
    with _closing(run, logger, saver, heartbeat):
        step = start_step
        while result.stop is None and step < last_step:  # a while loop: a rollback sets step back
            step += 1
            heartbeat.beat(step, "step")
            _seed_step(config, step, rank)
            record = run_step(run, step)
            for action in actions:
                action(record)
                if record.rolled_back_to is not None:
                    break  # the step is undone: no later action sees it
            result.add(record)
            if record.rolled_back_to is not None:
                step = record.rolled_back_to
                del result.losses[step - start_step:]  # the steps undone
        heartbeat.beat(step, "finish")
    return _finish(run, logger, result, began_at=begin, console=console)


def _prepare_process(config: Config) -> tuple[Config, torch.device, ProcessGroups]:
    """Check ``config`` (:func:`check_trainable`), choose the device, switch torch's
    process-wide settings (determinism, TF32), resolve the kernel backends and build this
    rank's process groups."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    check_trainable(config, world)
    device = compute_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _set_determinism(config, device)
    set_tf32(config, device)
    # What ran is what the run's config.yaml and printout say (a no-op when the command
    # line already resolved it before starting the ranks).
    config = resolve_backends(config, device)
    return config, device, build_groups(config)


def run_step(run: Run, step: int) -> StepRecord:
    """One optimizer step of ``run`` on the next global batch: the micro-batches' forward
    and backward, the global-batch loss (all-reduced over dp x cp), the gradient reduction
    and clipping, the routers' step closed (:func:`close_routers`), one host read of the
    step's scalars, then AdamW or, on a non-finite loss or gradient norm, the non-finite
    path (no optimizer step; :func:`_diagnose_nonfinite`); the LR schedule steps. Every
    change to the training state happens here or in a periodic action, none in a
    collector. Returns the step's record, whose ``loss`` the step computes
    (:mod:`moe_fold.training.step_losses`). A collective: every rank runs it for every
    step (the caller seeds the step first, :func:`_seed_step`)."""
    config, groups, optimizer = run.config, run.groups, run.optimizer
    began = time.perf_counter()
    micro_batches = [b.to(run.device) for b in run.loader.global_batch()]
    run.losses.start_step()
    if run.collector is not None:
        run.collector.start_step()
    run.routes.start_step(step, micro_batches)
    losses = run.forward_backward(run.model, micro_batches, groups, config, forward_context=run.forward_context,
                                  dynamic_cp=run.dynamic_cp, grad_sync=run.grad_sync)
    run.routes.finish_step(step)
    lm_loss = losses.sum()
    all_reduce_(lm_loss, groups.dp_cp)
    lm_loss = run.faults.apply(lm_loss, step, run.loader.last_batch) / groups.size("dp_cp")
    lr = run.scheduler.get_last_lr()
    # The grads are reduced and clipped whatever the loss (the same collectives on every
    # rank), and the routers close their step, before anything is read: whether to step
    # is decided on the host from the one read below.
    grad_norm = reduce_gradients(run.train_params, optimizer, groups, config.optimizer.clip_grad,
                                 grad_sync=run.grad_sync)
    closed = close_routers(run.routers)
    losses_packed = run.losses.reduce(groups, closed)
    routing_packed = run.collector.reduce(groups) if run.collector is not None else losses_packed[:0]
    # The step's one host read: its scalars (the LM loss and the gradient norm, which the
    # finite check reads, the router and MTP losses, the routing statistics) packed on the
    # device and copied once.
    read = torch.cat([lm_loss.double().reshape(1), grad_norm.double().reshape(1), losses_packed,
                      routing_packed]).cpu()
    lm, norm = read[:2].tolist()
    losses_read, routing_read = read[2:].split([losses_packed.numel(), routing_packed.numel()])
    if not math.isfinite(lm):
        norm = float("nan")  # no step: a loss that is not finite leaves its norm unreported
    finite = math.isfinite(lm) and math.isfinite(norm)
    if finite:
        optimizer.step()
        if run.master is not None and not optimizer.distributed:
            run.master.master_to_model()
    where = None if finite else _diagnose_nonfinite(run, step, micro_batches, lm, norm)
    optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    step_losses = run.losses.values(losses_read)
    routing = run.collector.read(routing_read, step_losses) if run.collector is not None else {}
    return StepRecord(step, loss=lm + step_losses.weighted, lm_loss=lm, grad_norm=norm, lr=lr, skipped=not finite,
                      nonfinite_module=where, losses=step_losses.fields(), routing=routing, began=began)


def close_routers(routers: list[Router]) -> dict[Router, torch.Tensor]:
    """Close the step of every router (:meth:`Router.finish_step`): the expert-bias update
    from the step's counts and the step's exact ``global_aux``, which it returns per router
    (routers without that loss left out). Runs before the step's read, on every rank."""
    closed = {}
    for router in routers:
        out = router.finish_step()
        if "global_aux" in out:
            closed[router] = out["global_aux"]
    return closed


def _diagnose_nonfinite(run: Run, step: int, micro_batches: list, lm: float, norm: float) -> Optional[str]:
    """A non-finite step: name the first module whose output went non-finite
    (:func:`_first_nonfinite`, a collective), then raise (``train.on_nonfinite=stop``)
    or warn on rank 0 and return that module's name (``skip``; None: the forward ran
    again is finite)."""
    where = _first_nonfinite(run, micro_batches)
    problem = (f"step {step}: loss {lm}, gradient norm {norm}; first non-finite output: "
               f"{where or 'none (the forward ran again is finite)'}")
    mode = run.config.train.on_nonfinite
    if mode == "stop":
        raise FloatingPointError(f"{problem}; stopping (train.on_nonfinite=stop)")
    if run.groups.rank == 0:  # a rollback (periodic.RollBack) says what it undoes
        warnings.warn(f"{problem}; step skipped (train.on_nonfinite=skip)" if mode == "skip" else problem,
                      stacklevel=3)
    return where


@contextlib.contextmanager
def _closing(run: Run, logger: MetricsLogger, saver: CheckpointSaver, heartbeat: Heartbeat) -> Iterator[None]:
    """Around the steps: every rank leaves with the last checkpoint complete on disk (a
    stop's included); on an error, a background write still finishes (or fails) before
    leaving, so no process exits believing in a checkpoint that is half written. The
    logger, the collectors and the heartbeat close either way."""
    finished = False
    try:
        yield
        saver.wait(collective=True)
        finished = True
    finally:
        heartbeat.close()
        if not finished:
            with contextlib.suppress(Exception):
                saver.wait()
        logger.close()
        run.losses.close()
        if run.collector is not None:
            run.collector.close()


def _finish(run: Run, logger: MetricsLogger, result: TrainResult, began_at: float,
            console: Optional[Console]) -> TrainResult:
    """Fill ``result`` in once the steps are done (timing, final loss, wandb folder), and
    on rank 0 write the run's plots and print its summary."""
    run.optimizer.wait_params()  # the caller gets current parameters
    result.seconds = time.perf_counter() - began_at
    steps_run = len(result.losses)
    tokens_per_step = run.config.train.global_batch_size * run.config.model.seq_length
    result.tokens_per_s = steps_run * tokens_per_step / result.seconds if steps_run else 0.0
    result.final_loss = result.losses[-1] if result.losses else float("nan")
    result.wandb_dir = logger.wandb_dir
    if run.groups.rank == 0:
        from moe_fold.training.plots import write_run_plots

        result.plots = [str(p) for p in write_run_plots(run.run_dir)]
        if console is not None:
            logger.print_summary(result)
    return result


def _first_nonfinite(run: Run, micro_batches: list) -> Optional[str]:
    """The first module whose output is non-finite when the step's forwards run again
    (:func:`moe_fold.training.numerics.first_nonfinite_module`; a collective: every rank runs its
    part, pipeline stages included), named with its rank when there are several; None
    when every output is finite (the non-finite values arose in the backward)."""
    config, groups, device = run.config, run.groups, run.device

    def forwards():
        run.forward_backward(run.model, micro_batches, groups, config, forward_only=True, dynamic_cp=run.dynamic_cp,
                             forward_context=lambda: autocast(config.train.precision, device))

    found = first_nonfinite_module(run.model, forwards)
    world = groups.layout.world_size
    if world == 1:
        return found[0] if found else None
    everyone: list = [None] * world
    dist.all_gather_object(everyone, None if found is None else (groups.rank_in("pp"), found[1], groups.rank, found[0]))
    # The earliest stage, then the earliest output: a non-finite value spreads from where it
    # started (to other ep ranks through the combine, to later stages) and only later.
    first = min((f for f in everyone if f is not None), default=None)
    return None if first is None else f"{first[3]} (rank {first[2]})"


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl``, in order."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]

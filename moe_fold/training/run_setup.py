"""Setting up a training run on this rank: everything the loop uses, built once before
the first step (:func:`set_up_run`), and the weights and data position it starts from
(:func:`load_start_state`: a resumed checkpoint, a Hugging Face folder, or a dense folder
upcycled into experts).

The order of the set-up is part of the run's numerics: the model is built right after
``torch.manual_seed(train.seed)`` (its routers draw from torch's generator), and rank 0
builds the data caches before the others read them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_fold.config import Config, dump_config, moe_layer_indices
from moe_fold.dispatch.router import Router
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import Transformer, compile_blocks
from moe_fold.models.model import build_model as build_transformer
from moe_fold.training.faults import FaultPlan
from moe_fold.training.numerics import LossSpikes
from moe_fold.training.precision import MasterWeights, autocast, exclude_from_autocast, param_dtype
from moe_fold.training.rollback import Rollbacks
from moe_fold.training.routes import RouteActions
from moe_fold.training.step import forward_backward as step_forward_backward
from moe_fold.training.step_losses import StepLosses

if TYPE_CHECKING:
    from rich.console import Console

    from moe_fold.data.loader import BlendedDataset, DataLoader, GPTDataset
    from moe_fold.training.buckets import GradSync
    from moe_fold.training.dynamic_cp import DynamicCP
    from moe_fold.training.metrics import MetricsLogger, RoutingCollector
    from moe_fold.training.optim import AdamW, LRScheduler
    from moe_fold.training.replace import ExpertReplacer

__all__ = ["Run", "set_up_run", "build_trainable", "load_start_state", "load_state", "start_logging"]


@dataclass(kw_only=True)
class Run:
    """The collaborators of one training run on this rank (built by :func:`set_up_run`)."""
    config: Config  # validated, kernel backends resolved
    device: torch.device
    groups: ProcessGroups
    run_dir: Path
    loader: DataLoader  # this rank's micro-batches of each global batch
    valid_dataset: Optional[GPTDataset | BlendedDataset]  # the validation data (train.eval_every > 0)
    dynamic_cp: Optional[DynamicCP]  # under parallel.dynamic_cp with cp > 1
    model: Transformer  # the model that computes (bf16 under train.precision=bf16)
    master: Optional[MasterWeights]  # its float32 masters under bf16, else None
    state_model: nn.Module  # what the optimizer updates and checkpoints hold: the masters, or the model
    optimizer: AdamW
    grad_sync: GradSync  # the gradient reduction
    scheduler: LRScheduler
    routers: list[Router]  # every router of the model: the step closes their step (expert bias, global aux)
    losses: StepLosses  # the step's auxiliary and MTP loss values
    collector: Optional[RoutingCollector]  # routing metrics (also the load re-placement reads), else None
    replacer: Optional[ExpertReplacer]  # moe.replace_every or moe.replicas
    spikes: LossSpikes  # the loss-spike window (train.loss_spike_factor, loss_spike_window)
    rollbacks: Rollbacks  # what a bad step does and the batches skipped (moe_fold.training.rollback)
    faults: FaultPlan  # faults to inject (tests, the goodput bench); FaultPlan(): none
    forward_backward: Callable  # one global batch's forward and backward (moe_fold.training.step)
    routes: RouteActions  # route traces and router replay

    @property
    def train_params(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps (and whose gradient norm is clipped)."""
        return list(self.state_model.parameters())

    def validation_loss(self) -> dict[str, float]:
        """The validation loss of the model (:func:`moe_fold.training.evaluate.evaluate`;
        a collective)."""
        from moe_fold.training.evaluate import evaluate

        return evaluate(self.model, self.valid_dataset, self.groups, self.config, self.device, self.dynamic_cp)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """What a training forward runs in: the precision's autocast, with the step's
        losses and the routing metrics recording."""
        with autocast(self.config.train.precision, self.device), self.losses.recording(), \
                self.collector.recording() if self.collector is not None else contextlib.nullcontext():
            yield


def set_up_run(config: Config, device: torch.device, groups: ProcessGroups, resume: bool = False, *,
               metrics: bool = True, faults: FaultPlan = FaultPlan(),
               build_model: Callable[[Config, ProcessGroups], Transformer] = build_transformer,
               forward_backward: Callable = step_forward_backward) -> Run:
    """Build this rank's data loaders, model (and float32 masters under bf16), optimizer,
    gradient reduction, LR schedule, step losses, routing collector, expert replacer and
    rollback policy for ``config`` (already validated, backends resolved) on ``device`` in
    the layout of ``groups``; ``resume``: the run continues one (its skipped batches stay
    skipped). ``metrics=False``: no routing collector unless re-placement reads its load.
    ``faults``, ``build_model`` (``(config, groups) -> model``) and ``forward_backward``
    (:func:`moe_fold.training.step.forward_backward`'s signature) are the run's
    collaborators: tests and benches pass their own. A collective where the data caches
    are built (rank 0 first) and where the model is (pp)."""
    from moe_fold.data.loader import DataLoader
    from moe_fold.training.metrics import RoutingCollector
    from moe_fold.training.optim import build_scheduler

    t, p = config.train, config.parallel
    run_dir = Path(t.run_dir)
    if groups.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    dataset = _dataset(config, groups)
    dynamic_cp = None
    if p.dynamic_cp and groups.size("cp") > 1:
        from moe_fold.training.dynamic_cp import DynamicCP, cost_model

        # Static cp's memory: a micro-batch's tokens over the cp group.
        dynamic_cp = DynamicCP(groups, cost_model(config),
                               capacity=t.micro_batch_size * config.model.seq_length // groups.size("cp"))
    # Under dynamic cp every cp rank takes its group's whole micro-batches and keeps its share.
    cp_rank, cp_size = (0, 1) if dynamic_cp is not None else (groups.rank_in("cp"), groups.size("cp"))
    loader = DataLoader(dataset, t.global_batch_size, t.micro_batch_size, dp_rank=groups.rank_in("dp"),
                        dp_size=groups.size("dp"), cp_rank=cp_rank, cp_size=cp_size)
    valid_dataset = None
    if t.eval_every > 0:
        from moe_fold.data.loader import validation_dataset_from_config

        valid_dataset = _dataset(config, groups, validation_dataset_from_config)
    model, master, state_model, optimizer, grad_sync = build_trainable(config, device, groups, build_model)
    replaces = config.moe.replace_every > 0 or config.moe.replicas > 0
    collector = RoutingCollector(model, config) if metrics or replaces else None
    replacer = None
    if replaces:
        from moe_fold.training.replace import ExpertReplacer

        replacer = ExpertReplacer(config, [state_model] + ([model] if master else []), groups, optimizer,
                                  collector.moe_layers)
    spikes = LossSpikes(t.loss_spike_factor, t.loss_spike_window)
    return Run(config=config, device=device, groups=groups, run_dir=run_dir, loader=loader,
               valid_dataset=valid_dataset, dynamic_cp=dynamic_cp, model=model, master=master,
               state_model=state_model, optimizer=optimizer, grad_sync=grad_sync,
               scheduler=build_scheduler(optimizer, config),
               routers=[m for m in model.modules() if isinstance(m, Router)], losses=StepLosses(model, config),
               collector=collector, replacer=replacer, spikes=spikes,
               rollbacks=Rollbacks(config, groups, loader, spikes, resume), faults=faults,
               forward_backward=forward_backward,
               routes=RouteActions.build(model, config, groups, run_dir, moe_layer_indices(config)))


def build_trainable(config: Config, device: torch.device, groups: ProcessGroups,
                    build_model: Callable[[Config, ProcessGroups], Transformer] = build_transformer
                    ) -> tuple[nn.Module, Optional[MasterWeights], nn.Module, "AdamW", "GradSync"]:
    """This rank's model (bf16 under ``train.precision=bf16``), its float32 masters (else
    None), the model the optimizer steps (the masters, or the model), the optimizer and the
    gradient reduction: what :func:`set_up_run` trains and the dry run
    (:mod:`moe_fold.training.dryrun`) measures. Seeds torch with ``train.seed`` first (the
    routers draw from torch's generator)."""
    from moe_fold.training.optim import build_grad_sync, build_optimizer

    t, p = config.train, config.parallel
    torch.manual_seed(t.seed)
    model = build_model(config, groups).to(device)
    if t.compile == "blocks":
        compile_blocks(model)
    master = None
    if t.precision == "bf16":
        master = MasterWeights(model.to(param_dtype(t.precision)), build_model(config, groups).to(device))
    state_model = master.master if master else model
    if t.precision == "bf16-autocast":
        exclude_from_autocast(model, device)
    # Under bf16 the model's grads feed the float32 masters' buckets (cast, then reduced),
    # and the distributed optimizer copies each master bucket into the model once current.
    sources = {m: q for q, m in master.pairs} if master is not None else None
    optimizer = build_optimizer(state_model, config.optimizer, groups, bucket_numel=p.grad_bucket_numel,
                                overlap_param_gather=p.overlap_param_gather, compute_model=model, targets=sources)
    grad_sync = build_grad_sync(state_model, optimizer, groups, bucket_numel=p.grad_bucket_numel,
                                overlap=p.overlap_grad_reduce, sources=sources)
    return model, master, state_model, optimizer, grad_sync


def load_start_state(run: Run, resume: bool) -> tuple[int, Optional[str]]:
    """Load what the run starts from; returns ``(start_step, checkpoint)``: the steps
    already done and the checkpoint resumed from (``(0, None)`` for a fresh run).

    ``resume``: the newest intact checkpoint of ``train.run_dir`` (:func:`load_state`; a
    damaged newer one is moved aside, :func:`~moe_fold.training.checkpoint.load_newest_intact`),
    or a fresh start when there is none. A fresh start loads ``init.from_hf`` (a Hugging
    Face folder) or ``init.upcycle_from`` (a dense folder upcycled into experts) when set."""
    config, master = run.config, run.master
    start_step, checkpoint_path = 0, None
    if resume:
        from moe_fold.training.checkpoint import load_newest_intact

        loaded = load_newest_intact(run.run_dir, lambda path: load_state(run, path), run.groups)
        if loaded is not None:
            found, extra = loaded
            start_step, checkpoint_path = int(extra["step"]), str(found)
    if start_step == 0 and config.init.from_hf is not None:
        from moe_fold.models.hf.importer import load_hf_into

        with torch.no_grad():
            load_hf_into(run.state_model, config.init.from_hf, run.groups)
        if master is not None:
            master.master_to_model()
    if start_step == 0 and config.init.upcycle_from is not None:
        from moe_fold.models.hf.upcycle import load_upcycled_into

        with torch.no_grad():
            load_upcycled_into(run.state_model, config.init.upcycle_from, run.groups)
        if master is not None:
            master.master_to_model()
    return start_step, checkpoint_path


def load_state(run: Run, path) -> dict:
    """Load checkpoint ``path`` into ``run`` (a resume, or a rollback): weights, optimizer,
    schedule, data position, expert placement, skipped batches and the loss-spike window;
    returns the checkpoint's extra state."""
    from moe_fold.training.checkpoint import load_checkpoint

    run.optimizer.wait_params()  # a parameter all-gather in flight would overwrite the loaded values
    extra = load_checkpoint(path, run.state_model, run.optimizer, run.scheduler, run.groups)
    if run.master is not None:
        run.master.master_to_model()
    run.loader.load_state_dict(extra["data"])
    if run.replacer is not None and "experts" in extra:
        run.replacer.load_state_dict(extra["experts"])
    run.rollbacks.load_state_dict(extra)  # the batches skipped so far, the spike window
    return extra


def start_logging(run: Run, console: Optional[Console], progress: bool, start_step: int, resumed_from: Optional[str],
                  defaults: Optional[Config] = None) -> MetricsLogger:
    """Rank 0 writes the run's config.yaml (only now: a resume that fails on its checkpoint
    leaves the run folder as it was) and prints the run's start to ``console`` (None: no
    output): the config's changes to ``defaults`` (the preset or file the run came from;
    None: the dataclasses' defaults) and the layouts. Returns the
    :class:`moe_fold.training.metrics.MetricsLogger` of the run
    (metrics.jsonl, wandb, the console; active on rank 0)."""
    from moe_fold.training.metrics import MetricsLogger

    rank = run.groups.rank
    if rank == 0:
        dump_config(run.config, run.run_dir / "config.yaml")
    logger = MetricsLogger(run.config, run.groups, console=console if rank == 0 else None, progress=progress,
                           start_step=start_step)
    if rank == 0 and console is not None:
        logger.print_start(run.groups.layout.world_size, resumed_from=resumed_from,
                           defaults=Config() if defaults is None else defaults)
    return logger


def _barrier(groups: ProcessGroups) -> None:
    if groups.layout.world_size > 1:
        dist.barrier()


def _dataset(config: Config, groups: ProcessGroups, build: Optional[Callable] = None):
    """``build(config)`` (default: the training dataset): rank 0 tokenizes the corpus into
    the cache (when needed) first; the others then find it built."""
    from moe_fold.data.loader import dataset_from_config

    build = build or dataset_from_config
    if groups.rank == 0:
        dataset = build(config)
    _barrier(groups)
    if groups.rank != 0:
        dataset = build(config)
    return dataset

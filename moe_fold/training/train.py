"""The training loop: one optimizer step per global batch, on any layout of ranks.

Per step, every rank takes its micro-batches of the global batch
(``DataLoader.global_batch``: its dp shard, its cp slice; the ranks of one pipeline the
same ones) and runs their forward and backward with :func:`moe_fold.training.step.forward_backward`
(one after another letting the grads add up, or the pipeline schedule under pp; the loss
scaling that makes the summed grads the exact gradient of the global-batch mean loss,
and the routers' ``grad_scale = 1/num_microbatches``, are documented there). Then
:func:`moe_fold.training.optim.apply_gradients` completes the gradient reduction (posted during
the backward with ``parallel.overlap_grad_reduce``, :mod:`moe_fold.training.buckets`), clips
the global norm and steps AdamW (whose parameter all-gathers, with
``parallel.overlap_param_gather``, complete during the next forward); the LR schedule
steps, and the routers close their step (``Router.finish_step``: expert-bias update,
``global_aux`` reset).

Determinism: with ``train.deterministic`` torch uses deterministic algorithms, and the
random state is re-seeded from ``(train.seed, step, rank)`` at the start of every step,
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
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_fold.comm import all_reduce_
from moe_fold.config import Config, ConfigError, dump_config, validate
from moe_fold.kernels.backends import resolve_config
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.training.heartbeat import Heartbeat
from moe_fold.training.numerics import LossSpikes, first_nonfinite_module
from moe_fold.training.precision import MasterWeights, autocast, exclude_from_autocast, param_dtype
from moe_fold.training.stop import ExitSignals, Stop, StopRule

__all__ = ["TrainResult", "check_trainable", "resolve_backends", "set_tf32", "train", "apply_recompute",
           "build_groups", "read_metrics"]


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


# --------------------------------------------------------------------------- recompute

def apply_recompute(model: nn.Module, mode: str) -> None:
    """Activation recompute (``train.recompute``), by wrapping forwards in
    ``torch.utils.checkpoint`` (non-reentrant):

    - ``full``: every dense block whole; in an MoE block the attention (after its norm)
      and the MoE layer's expert computation (routed experts and shared expert). The
      router and the dispatcher stay outside: the router counts tokens for the expert
      bias and the global aux loss as a side effect of its forward, which a second
      forward would count twice (and recomputing the dispatcher would redo its
      all-to-alls).
    - ``moe``: the MoE layers' expert computation only (routed and shared experts; with
      ``moe.shared_expert_overlap`` the shared expert's two halves each, keeping the
      SwiGLU output between them).
    - ``expert_act``: inside the routed experts, the SwiGLU activation and the fc2 GEMM
      that consumes it, so the activation output ``[rows, F]`` is not kept (fc1's output
      is); the backward recomputes the activation and fc2's forward.
    """
    if mode == "none":
        return
    from moe_fold.models.experts import Experts
    from moe_fold.models.model import Block
    from moe_fold.models.moe_layer import MoELayer

    for module in model.modules():
        if mode == "full" and isinstance(module, Block):
            _wrap(module.attn if isinstance(module.mlp, MoELayer) else module)
        if mode in ("full", "moe") and isinstance(module, Experts):
            _wrap(module)
        if mode in ("full", "moe") and isinstance(module, MoELayer) and module.shared_expert is not None:
            if module.shared_expert_overlap:
                # The layer runs the halves apart (under the dispatch and the combine): each
                # is recomputed on its own, and the SwiGLU output between them is kept.
                _wrap(module.shared_expert, "activation")
                _wrap(module.shared_expert.fc2)
            else:
                _wrap(module.shared_expert)
        if mode == "expert_act" and isinstance(module, Experts):
            module.forward = _experts_act_recomputed(module)


def _wrap(module: nn.Module, method: str = "forward") -> None:
    run = getattr(module, method)
    setattr(module, method, lambda *args, **kwargs: checkpoint(run, *args, use_reentrant=False, **kwargs))


def _experts_act_recomputed(experts: nn.Module) -> Callable:
    from moe_fold.kernels.gmm import gmm
    from moe_fold.kernels.swiglu import swiglu

    def forward(tokens, tokens_per_expert, probs, host_tokens_per_expert=None):
        # The host counts ride in the closure, so the recompute in backward reads nothing back.
        def act_fc2(h, tokens_per_expert, probs):
            return gmm(swiglu(h, probs, backend=experts.swiglu_backend), experts.fc2, tokens_per_expert,
                       backend=experts.gemm_backend, host_counts=host_tokens_per_expert)

        h = gmm(tokens, experts.fc1, tokens_per_expert, backend=experts.gemm_backend,
                host_counts=host_tokens_per_expert)  # [N, 2F/etp]
        return checkpoint(act_fc2, h, tokens_per_expert, probs, use_reentrant=False)  # [N, H]
    return forward


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
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")


def resolve_backends(config: Config, device: Optional[torch.device] = None) -> Config:
    """``config`` with each ``moe.*_backend`` that is ``auto`` (and MOE_FOLD_GEMM_BACKEND)
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
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def _seed_step(config: Config, step: int, rank: int) -> None:
    torch.manual_seed((config.train.seed * 1_000_003 + step) * 4099 + rank)


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


def train(config: Config, resume: bool = False, console: Any = None, progress: bool = True,
          stop_at: Optional[int] = None) -> TrainResult:
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
    ``console`` (a rich Console; None: no output) and writes ``metrics.jsonl`` and the
    wandb run. Returns the same :class:`TrainResult` on every rank."""
    # train.deterministic and train.tf32 switch torch's process-wide settings for the run only.
    previous = torch.are_deterministic_algorithms_enabled()
    previous_fp32 = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision
    began = time.monotonic()
    try:
        with ExitSignals(config.train.exit_signals) as signals:
            return _train(config, resume, console, progress, stop_at, signals, began)
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision = previous_fp32


def _train(config: Config, resume: bool, console: Any, progress: bool, stop_at: Optional[int],
           signals: ExitSignals, began: float) -> TrainResult:
    from moe_fold.data.loader import DataLoader
    from moe_fold.training.metrics import MetricsLogger, MTPCollector, RoutingCollector
    from moe_fold.models.model import build_model
    from moe_fold.training.optim import apply_gradients, build_grad_sync, build_optimizer, build_scheduler
    from moe_fold.training.step import forward_backward
    from moe_fold.training.checkpoint import CheckpointSaver

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    check_trainable(config, world)
    t = config.train
    device = compute_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _set_determinism(config, device)
    set_tf32(config, device)
    # What ran is what the run's config.yaml and printout say (a no-op when the command
    # line already resolved it before starting the ranks).
    config = resolve_backends(config, device)
    groups = build_groups(config)
    rank = groups.rank
    run_dir = Path(t.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)

    dataset = _dataset(config, groups)
    dynamic_cp = None
    if config.parallel.dynamic_cp and groups.size("cp") > 1:
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
    torch.manual_seed(t.seed)
    model = build_model(config, groups).to(device)
    master = None
    if t.precision == "bf16":
        master = MasterWeights(model.to(param_dtype(t.precision)), build_model(config, groups).to(device))
    # What the optimizer updates and checkpoints hold: the float32 masters under bf16.
    state_model = master.master if master else model
    if t.precision == "bf16-autocast":
        exclude_from_autocast(model, device)
    apply_recompute(model, t.recompute)
    p = config.parallel
    # Under bf16 the model's grads feed the float32 masters' buckets (cast, then reduced),
    # and the distributed optimizer copies each master bucket into the model once current.
    sources = {m: q for q, m in master.pairs} if master is not None else None
    optimizer = build_optimizer(state_model, config.optimizer, groups, bucket_numel=p.grad_bucket_numel,
                                overlap_param_gather=p.overlap_param_gather, compute_model=model, targets=sources)
    grad_sync = build_grad_sync(state_model, optimizer, groups, bucket_numel=p.grad_bucket_numel,
                                overlap=p.overlap_grad_reduce, sources=sources)
    scheduler = build_scheduler(optimizer, config)
    collector = RoutingCollector(model, config)
    mtp_collector = MTPCollector(model, config)
    replacer = None
    if config.moe.replace_every > 0 or config.moe.replicas > 0:
        from moe_fold.training.replace import ExpertReplacer

        replacer = ExpertReplacer(config, [state_model] + ([model] if master else []), groups, optimizer,
                                  collector.moe_layers)

    @contextlib.contextmanager
    def forward_context() -> Iterator[None]:
        with autocast(t.precision, device), collector.recording(), mtp_collector.recording():
            yield

    start_step = 0
    checkpoint_path: Optional[str] = None
    if resume:
        from moe_fold.training.checkpoint import latest_checkpoint, load_checkpoint

        found = latest_checkpoint(run_dir)
        if found is not None:
            extra = load_checkpoint(found, state_model, optimizer, scheduler, groups)
            if master is not None:
                master.master_to_model()
            start_step = int(extra["step"])
            loader.load_state_dict(extra["data"])
            if replacer is not None and "experts" in extra:
                replacer.load_state_dict(extra["experts"])
            checkpoint_path = str(found)
    if start_step == 0 and config.init.from_hf is not None:
        from moe_fold.models.hf.importer import load_hf_into

        with torch.no_grad():
            load_hf_into(state_model, config.init.from_hf, groups)
        if master is not None:
            master.master_to_model()
    if start_step == 0 and config.init.upcycle_from is not None:
        from moe_fold.models.hf.upcycle import load_upcycled_into

        with torch.no_grad():
            load_upcycled_into(state_model, config.init.upcycle_from, groups)
        if master is not None:
            master.master_to_model()
    if rank == 0:
        # Only now: a resume that fails on its checkpoint leaves the run folder as it was.
        dump_config(config, run_dir / "config.yaml")
    logger = MetricsLogger(config, groups, console=console if rank == 0 else None, progress=progress,
                           start_step=start_step)
    if rank == 0 and console is not None:
        logger.print_start(world, resumed_from=checkpoint_path)

    result = TrainResult(first_step=start_step + 1, run_dir=str(run_dir), checkpoint=checkpoint_path)
    tokens_per_step = t.global_batch_size * config.model.seq_length
    model.train()
    begin = time.perf_counter()
    train_params = list(state_model.parameters())
    last_step = t.steps if stop_at is None else min(stop_at, t.steps)
    spikes = LossSpikes(t.loss_spike_factor, t.loss_spike_window)
    stops = StopRule(config, signals, device, world, began)
    # A signal or budget before the first step: no step, and nothing new to save.
    stop = stops.check(start_step, after_a_step=False)
    saver = CheckpointSaver(run_dir, groups, t.keep_last, async_save=t.async_save, config=config,
                            timeout_s=config.parallel.timeout_s)
    # Hang detection: one beat as each phase begins (moe_fold.training.heartbeat).
    heartbeat = Heartbeat.for_run(config, rank, world)
    finished = False
    try:
        for step in range(start_step + 1, last_step + 1) if stop is None else ():
            heartbeat.beat(step, "step")
            step_begin = time.perf_counter()
            _seed_step(config, step, rank)
            micro_batches = [b.to(device) for b in loader.global_batch()]
            collector.start_step()
            mtp_collector.start_step()
            losses = forward_backward(model, micro_batches, groups, config, forward_context=forward_context,
                                      dynamic_cp=dynamic_cp, grad_sync=grad_sync)
            lm_loss = losses.sum()
            all_reduce_(lm_loss, groups.dp_cp)
            lm = (lm_loss / groups.size("dp_cp")).item()
            lr = scheduler.get_last_lr()
            if math.isfinite(lm):
                grad_norm = apply_gradients(train_params, optimizer, groups, config.optimizer.clip_grad,
                                            grad_sync=grad_sync)
            else:
                # No step; the loss is global, so every rank does the same: it completes the
                # reductions posted during the backward (the collectives must match) and
                # leaves the grads to be zeroed.
                grad_sync.finish()
                grad_norm = torch.tensor(float("nan"))
            # One read of the norm serves the check and the record.
            norm = grad_norm.item()
            finite = math.isfinite(lm) and math.isfinite(norm)
            if finite and master is not None and not optimizer.distributed:
                master.master_to_model()
            nonfinite = {}
            if not finite:
                where = _first_nonfinite(model, micro_batches, groups, config, device, dynamic_cp)
                problem = (f"step {step}: loss {lm}, gradient norm {norm}; first non-finite output: "
                           f"{where or 'none (the forward ran again is finite)'}")
                if t.on_nonfinite == "stop":
                    raise FloatingPointError(f"{problem}; stopping (train.on_nonfinite=stop)")
                if rank == 0:
                    warnings.warn(f"{problem}; step skipped (train.on_nonfinite=skip)", stacklevel=2)
                nonfinite = {"nonfinite_module": where}
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            routing = collector.finish_step(groups)
            mtp = mtp_collector.finish_step(groups)
            if replacer is not None:
                optimizer.wait_params()  # the replacer moves expert weights
                if replacer.every and step % replacer.every == 0:  # a re-placement step
                    heartbeat.beat(step, "replace")
                routing.update(replacer.after_step(step, routing["expert_load"]))
            seconds = time.perf_counter() - step_begin
            loss = lm + routing.pop("weighted_loss", 0.0) + mtp.pop("weighted_loss")
            median = spikes.median()
            spike = spikes.check(loss)
            if spike and rank == 0:
                warnings.warn(f"step {step}: loss spike: {loss:.6g} > train.loss_spike_factor={t.loss_spike_factor} "
                              f"x {median:.6g}, the median of the previous {t.loss_spike_window} losses", stacklevel=2)
            record = {"step": step, "loss": loss, "lm_loss": lm, "grad_norm": norm, "lr": lr,
                      "tokens_per_s": tokens_per_step / seconds, "skipped": not finite, "loss_spike": spike,
                      **nonfinite, **routing, **mtp}
            logger.log(record, collector)
            result.losses.append(record["loss"])
            # Validation: its own loader and a forked RNG, so training is unchanged.
            if valid_dataset is not None and (step % t.eval_every == 0 or step == t.steps):
                from moe_fold.training.evaluate import evaluate

                heartbeat.beat(step, "eval")
                logger.log_eval({"step": step, **evaluate(model, valid_dataset, groups, config, device, dynamic_cp)})
            stop = stops.check(step)
            if stop is not None and rank == 0 and console is not None:
                console.print(f"stopping after step {step}: {stop.reason}; writing its checkpoint")
            if step % t.save_every == 0 or step == last_step or stop is not None:
                heartbeat.beat(step, "save")
                optimizer.wait_params()  # the checkpoint reads the parameters
                extra = {"step": step, "data": loader.state_dict()}
                if replacer is not None:
                    extra["experts"] = replacer.state_dict()
                checkpoint_path = str(saver.save(step, state_model, optimizer, scheduler, extra))
                result.checkpoint = checkpoint_path
            if stop is not None:
                break
        heartbeat.beat(start_step + len(result.losses), "finish")
        # Every rank returns with the last checkpoint complete on disk (a stop's included).
        saver.wait(collective=True)
        finished = True
    finally:
        heartbeat.close()
        if not finished:
            # An error: still let a background write finish (or fail) before leaving, so no
            # process exits believing in a checkpoint that is half written.
            with contextlib.suppress(Exception):
                saver.wait()
        logger.close()
        collector.close()
        mtp_collector.close()
    optimizer.wait_params()  # the caller gets current parameters
    result.seconds = time.perf_counter() - begin
    steps_run = len(result.losses)
    result.tokens_per_s = steps_run * tokens_per_step / result.seconds if steps_run else 0.0
    result.final_loss = result.losses[-1] if result.losses else float("nan")
    result.wandb_dir = logger.wandb_dir
    result.stop = stop
    if rank == 0:
        from moe_fold.training.plots import write_run_plots

        result.plots = [str(p) for p in write_run_plots(run_dir)]
    if rank == 0 and console is not None:
        logger.print_summary(result)
    return result


def _first_nonfinite(model: nn.Module, micro_batches: list, groups: ProcessGroups, config: Config,
                     device: torch.device, dynamic_cp) -> Optional[str]:
    """The first module whose output is non-finite when the step's forwards run again
    (:func:`moe_fold.training.numerics.first_nonfinite_module`; a collective: every rank runs its
    part, pipeline stages included), named with its rank when there are several; None
    when every output is finite (the non-finite values arose in the backward)."""
    from moe_fold.training.step import forward_backward

    def run():
        forward_backward(model, micro_batches, groups, config, forward_only=True, dynamic_cp=dynamic_cp,
                         forward_context=lambda: autocast(config.train.precision, device))

    found = first_nonfinite_module(model, run)
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

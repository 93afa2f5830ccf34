"""Rules of the run: steps and cadences, batch sizes over dp, device and backend, loss
spikes and rollback, stopping, hang detection, evaluation, the optimizer, wandb and the
model's initialisation."""

from __future__ import annotations

from ..derived import pipeline_schedule
from ..schema import EXIT_SIGNALS, Config, _fmt
from .common import _at_least, _minimum, _positive, rule
from .parallel import interleaved_micro_batches


def _check_train(config: Config, world_size: int, parallel_ok: bool, out: list[str]) -> None:
    t, p = config.train, config.parallel
    _at_least(out, "train.steps", t.steps, 1)
    _at_least(out, "train.save_every", t.save_every, 1)
    out.extend(checkpoints_kept(t.keep_last))
    _at_least(out, "train.log_every", t.log_every, 1)
    batch_ok = _at_least(out, "train.micro_batch_size", t.micro_batch_size, 1)
    batch_ok &= _at_least(out, "train.global_batch_size", t.global_batch_size, 1)
    if batch_ok and parallel_ok:
        dp = world_size // (p.tp * p.cp * p.pp)
        batch_problems = batch_over_dp(t.global_batch_size, t.micro_batch_size, dp)
        out.extend(batch_problems)
        if not batch_problems and p.pp > 1 and pipeline_schedule(config) == "interleaved":
            out.extend(interleaved_micro_batches(
                t.global_batch_size // (t.micro_batch_size * dp), p.pp,
                f"; global_batch_size={t.global_batch_size}, micro_batch_size={t.micro_batch_size}, dp={dp}"))
    backend = config.parallel.backend
    if t.device == "cpu" and backend == "nccl":
        out.append("train.device=cpu cannot run with parallel.backend=nccl (NCCL reduces CUDA tensors only); "
                   "use parallel.backend=gloo or auto")
    if t.device == "cuda" and backend == "gloo":
        out.append("train.device=cuda cannot run with parallel.backend=gloo (gloo ranks compute on the CPU); "
                   "use parallel.backend=nccl or auto")
    out.extend(spike_detection(t.loss_spike_factor, t.loss_spike_window))
    # Rollback and checkpoint cadence.
    if t.on_loss_spike != "log" and t.loss_spike_factor == 0:
        out.append(f"train.on_loss_spike={t.on_loss_spike} needs spike detection, but train.loss_spike_factor=0 "
                   f"turns it off")
    _at_least(out, "train.rollback_skip_batches", t.rollback_skip_batches, 1)
    _at_least(out, "train.max_rollbacks", t.max_rollbacks, 1)
    for batch in t.skip_batches:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            out.append(f"train.skip_batches: {_fmt(batch)} is not a global batch index (an integer >= 0)")
    if t.save_every_minutes is not None:
        _positive(out, "train.save_every_minutes", t.save_every_minutes)
    if t.expected_mtbf_minutes is not None:
        _positive(out, "train.expected_mtbf_minutes", t.expected_mtbf_minutes)
    if t.save_every_minutes is not None and t.expected_mtbf_minutes is not None:
        out.append(f"train.save_every_minutes={_fmt(t.save_every_minutes)} and train.expected_mtbf_minutes="
                   f"{_fmt(t.expected_mtbf_minutes)} both set the time between saves (fixed, or derived from the "
                   f"failure rate); set one")
    for name in t.exit_signals:
        if name not in EXIT_SIGNALS:
            out.append(f"train.exit_signals: {_fmt(name)} is not a signal a run can stop on; "
                       f"use {', '.join(EXIT_SIGNALS)}")
    if t.exit_after_minutes is not None:
        _positive(out, "train.exit_after_minutes", t.exit_after_minutes)
    if t.exit_at_step is not None:
        _at_least(out, "train.exit_at_step", t.exit_at_step, 1)
    if t.hang_timeout_s is not None:
        if t.hang_timeout_s < 0:
            out.append(f"train.hang_timeout_s={_fmt(t.hang_timeout_s)} must be >= 0 (0: off, unset: derived)")
        elif t.hang_timeout_s >= config.parallel.timeout_s:
            out.append(f"train.hang_timeout_s={_fmt(t.hang_timeout_s)} must be below parallel.timeout_s="
                       f"{_fmt(config.parallel.timeout_s)}: the collective timeout would fire first")
    _at_least(out, "train.eval_every", t.eval_every, 0)
    _at_least(out, "train.eval_iters", t.eval_iters, 1)


@rule
def batch_over_dp(global_batch_size: int, micro_batch_size: int, dp: int) -> list[str]:
    """A global batch is whole micro-batches on every dp rank."""
    if global_batch_size % (micro_batch_size * dp):
        return [f"train.global_batch_size={global_batch_size} is not divisible by "
                f"train.micro_batch_size*dp={micro_batch_size * dp} "
                f"(micro_batch_size={micro_batch_size}, dp=world_size/(tp*cp*pp)={dp})"]
    return []


@rule
def spike_detection(factor: float, window: int) -> list[str]:
    """A loss spike is a loss above factor x the median of the previous window losses
    (factor 0: off)."""
    out: list[str] = []
    _at_least(out, "train.loss_spike_factor", factor, 0)
    if isinstance(window, bool) or not isinstance(window, int):
        out.append(f"train.loss_spike_window={_fmt(window)} must be an integer >= 1")
    else:
        _at_least(out, "train.loss_spike_window", window, 1)
    return out


@rule
def checkpoints_kept(keep_last: int) -> list[str]:
    """A run keeps its newest keep_last checkpoints; at least the one it resumes from."""
    return _minimum("train.keep_last", keep_last, 1)


def _check_optimizer(config: Config, out: list[str]) -> None:
    o, t = config.optimizer, config.train
    if _positive(out, "optimizer.lr", o.lr) and not 0 <= o.min_lr <= o.lr:
        out.append(f"optimizer.min_lr={_fmt(o.min_lr)} must be in [0, optimizer.lr={_fmt(o.lr)}]")
    out.extend(adamw_settings(o.beta1, o.beta2, o.eps, o.weight_decay))
    out.extend(grad_clip(o.clip_grad))
    if _at_least(out, "optimizer.warmup_steps", o.warmup_steps, 0) and o.warmup_steps > t.steps:
        out.append(f"optimizer.warmup_steps={o.warmup_steps} must be <= train.steps={t.steps}")
    if not 0 < o.decay_fraction <= 1:
        out.append(f"optimizer.decay_fraction={_fmt(o.decay_fraction)} must be in (0, 1]")


@rule
def adamw_settings(beta1: float, beta2: float, eps: float, weight_decay: float) -> list[str]:
    """AdamW's moment decays, its denominator's epsilon and its decoupled weight decay.
    (The learning rate is set by the schedule at every step, between min_lr and lr.)"""
    out = []
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0 <= value < 1:
            out.append(f"optimizer.{name}={_fmt(value)} must be in [0, 1)")
    _positive(out, "optimizer.eps", eps)
    _at_least(out, "optimizer.weight_decay", weight_decay, 0)
    return out


@rule
def grad_clip(clip_grad: float) -> list[str]:
    """The global grad norm is clipped to clip_grad (0: no clipping)."""
    return _minimum("optimizer.clip_grad", clip_grad, 0)


def _check_wandb_and_init(config: Config, out: list[str]) -> None:
    w = config.wandb
    _at_least(out, "wandb.heatmap_every", w.heatmap_every, 1)
    init = config.init
    out.extend(upcycle_slices(init.upcycle_granularity))
    if init.from_hf is not None and init.upcycle_from is not None:
        out.append(f"init.from_hf={init.from_hf!r} and init.upcycle_from={init.upcycle_from!r} are both set: a run "
                   f"starts from an MoE checkpoint or upcycles a dense one, not both")
    if init.upcycle_granularity != 1 and init.upcycle_from is None:
        out.append(f"init.upcycle_granularity={init.upcycle_granularity} is set but init.upcycle_from is null")


@rule
def upcycle_slices(granularity: int) -> list[str]:
    """Upcycling cuts the dense MLP into granularity expert slices."""
    return _minimum("init.upcycle_granularity", granularity, 1)

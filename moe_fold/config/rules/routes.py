"""The rules of route traces, router replay and batch-invariant routing (docs/routes.md)."""

from __future__ import annotations

from ..schema import Config
from .common import _at_least, _fmt


def _check_routes(config: Config, out: list[str]) -> None:
    t, moe = config.train, config.moe
    _at_least(out, "train.route_trace_every", t.route_trace_every, 0)
    for dotted, value, on in (("train.route_trace_every", t.route_trace_every, t.route_trace_every > 0),
                              ("moe.router_replay", moe.router_replay, moe.router_replay is not None)):
        if on and config.parallel.dynamic_cp:
            out.append(f"{dotted}={_fmt(value)} cannot run with parallel.dynamic_cp=true: dynamic cp moves "
                       f"tokens between ranks by document, so a token's place in the data is not known where "
                       f"it is routed")
    if t.route_trace_every > 0 and moe.zero_experts > 0:
        out.append(f"train.route_trace_every={t.route_trace_every} cannot run with moe.zero_experts="
                   f"{moe.zero_experts}: route traces record held experts only, and a zero expert is held by no rank")
    if moe.router_replay is not None and not moe.router_replay.strip():
        out.append(f"moe.router_replay={_fmt(moe.router_replay)} must name a route trace or a routes file")
    if t.batch_invariant:
        _check_batch_invariant(config, out)


# Rows every GEMM of a batch-invariant run computes in: a multiple of this (docs/routes.md).
BATCH_INVARIANT_ROWS = 16


def _check_batch_invariant(config: Config, out: list[str]) -> None:
    t, moe, p = config.train, config.moe, config.parallel
    if moe.capacity_factor is not None:
        out.append(f"train.batch_invariant=true cannot run with moe.capacity_factor={_fmt(moe.capacity_factor)}: "
                   f"capacity dropping keeps an expert's best tokens of the whole micro-batch, so a token's route "
                   f"depends on the other sequences by definition")
    if moe.gemm_backend not in ("auto", "torch", "loop"):
        out.append(f"train.batch_invariant=true needs moe.gemm_backend torch, loop or auto (on CPU), got "
                   f"{moe.gemm_backend}: only those were measured to give a row the same bits whatever rows "
                   f"surround it (bench/batch_invariance.py)")
    if t.device == "cuda":
        out.append("train.batch_invariant=true runs on the CPU only (train.device=cuda): GPU GEMM kernels are "
                   "chosen by shape, and no fixed-order kernel is wired in")
    shards = max(1, p.cp * p.tp)
    if config.model.seq_length % shards or (config.model.seq_length // shards) % BATCH_INVARIANT_ROWS:
        out.append(f"train.batch_invariant=true needs model.seq_length / (parallel.cp x parallel.tp) to be a "
                   f"multiple of {BATCH_INVARIANT_ROWS}, got {config.model.seq_length} / {shards}: CPU GEMMs "
                   f"give a row other bits when the row count is small or ragged")

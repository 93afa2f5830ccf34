"""Rules of the layouts: sizes, the world, the rank order, gradient buckets, dynamic cp,
elastic layouts and the pipeline split and schedule."""

from __future__ import annotations

from typing import Optional

from ..derived import parse_elastic_layout, vpp_size
from ..schema import Config, _fmt
from .common import _at_least, _minimum, _positive, rule


def _check_parallel(config: Config, world_size: int, out: list[str]) -> bool:
    """Sizes and world divisibility; returns whether dp and edp are well defined."""
    p = config.parallel
    ok = _at_least(out, "world_size", world_size, 1)
    for name in ("tp", "cp", "pp", "ep"):
        ok &= _at_least(out, f"parallel.{name}", getattr(p, name), 1)
    for name in ("etp", "vpp"):
        if getattr(p, name) is not None:
            ok &= _at_least(out, f"parallel.{name}", getattr(p, name), 1)
    if ok:
        layout_problems = world_fits_layouts(world_size, p.tp, p.cp, p.pp, p.ep, p.etp)
        out.extend(layout_problems)
        ok = not layout_problems
    out.extend(order_is_permutation(p.order))
    if p.dynamic_cp:
        out.extend(dynamic_cp_layout(p.cp, p.tp, p.pp))
        _at_least(out, "parallel.dynamic_cp_flops_per_byte", p.dynamic_cp_flops_per_byte, 0)
    _positive(out, "parallel.timeout_s", p.timeout_s)
    out.extend(bucket_size(p.grad_bucket_numel))
    if p.overlap_grad_reduce and config.moe.replicas > 0:
        out.append(f"parallel.overlap_grad_reduce=true cannot run with moe.replicas={config.moe.replicas} yet: the "
                   f"copies of an expert sum their grads over ep after the whole backward, before the "
                   f"data-parallel reduction")
    if p.elastic_layouts is not None:
        if not p.elastic:
            out.append(f"parallel.elastic_layouts={_fmt(p.elastic_layouts)} needs parallel.elastic=true "
                       f"(the layouts are tried on a restart onto another world size only then)")
        for i, entry in enumerate(p.elastic_layouts):
            try:
                parse_elastic_layout(entry)
            except ValueError as e:
                out.append(f"parallel.elastic_layouts[{i}]={_fmt(entry)}: {e}")
    out.extend(param_gather_needs_distributed(p.overlap_param_gather, config.optimizer.distributed))
    return ok


@rule
def world_fits_layouts(world_size: int, tp: int, cp: int, pp: int, ep: int, etp: Optional[int]) -> list[str]:
    """The world is whole attention layouts (tp*cp*pp) and whole expert layouts (etp*ep*pp;
    etp null: tp). Sizes below 1 are reported by the size checks, not here."""
    if min(world_size, tp, cp, pp, ep, tp if etp is None else etp) < 1:
        return []
    out = []
    if world_size % (tp * cp * pp):
        out.append(f"world_size={world_size} is not divisible by parallel.tp*cp*pp={tp * cp * pp} "
                   f"(tp={tp}, cp={cp}, pp={pp})")
    expert_tp = tp if etp is None else etp
    if world_size % (expert_tp * ep * pp):
        etp_text = f"etp={etp}" if etp is not None else f"etp=null -> tp={tp}"
        out.append(f"world_size={world_size} is not divisible by parallel.etp*ep*pp={expert_tp * ep * pp} "
                   f"({etp_text}, ep={ep}, pp={pp})")
    return out


@rule
def order_is_permutation(order: str) -> list[str]:
    """parallel.order names every dimension once (the layout itself also takes an order that
    leaves out dimensions of size 1: moe_fold/layout.py, for tools that build one directly)."""
    if not isinstance(order, str) or sorted(order.split("-")) != sorted(["tp", "cp", "ep", "dp", "pp"]):
        return [f"parallel.order={_fmt(order)} must be a permutation of tp, cp, ep, dp, pp joined by '-'"]
    return []


@rule
def bucket_size(grad_bucket_numel: int) -> list[str]:
    """A gradient bucket holds at least one element."""
    return _minimum("parallel.grad_bucket_numel", grad_bucket_numel, 1)


@rule
def param_gather_needs_distributed(overlap_param_gather: bool, distributed: bool) -> list[str]:
    """Only the distributed optimizer all-gathers parameters after its step."""
    if overlap_param_gather and not distributed:
        return ["parallel.overlap_param_gather=true needs optimizer.distributed=true (only the distributed "
                "optimizer all-gathers parameters after its step)"]
    return []


# Dynamic cp searches every partition of the cp group into sub-groups; partitions of 2^k
# ranks number 1, 2, 5, 26, 677, 458330 for k = 0..5: search all up to 16.
MAX_DYNAMIC_CP = 16


@rule
def dynamic_cp_layout(cp: int, tp: int, pp: int) -> list[str]:
    """Dynamic cp splits the cp group into power-of-two sub-groups, and its ranks hold unequal
    token counts, which tp shards and pipeline stages cannot take."""
    out = []
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or cp & (cp - 1) or cp > MAX_DYNAMIC_CP:
        out.append(f"parallel.dynamic_cp=true needs parallel.cp a power of two up to {MAX_DYNAMIC_CP}, "
                   f"got cp={cp}")
    for name, size in (("tp", tp), ("pp", pp)):
        if size != 1:
            out.append(f"parallel.dynamic_cp=true needs parallel.{name}=1, got {size} (ranks "
                       f"hold unequal token counts under dynamic cp)")
    return out


def _check_pipeline(config: Config, out: list[str]) -> None:
    p, m = config.parallel, config.model
    if p.pp < 1 or (p.vpp is not None and p.vpp < 1) or m.num_layers < 1:
        return
    out.extend(pipeline_split(m.num_layers, p.pp, vpp_size(config), p.pp_layers))
    if vpp_size(config) > 1 and p.pp == 1:
        # Only a run's config: the schedules themselves run vpp chunks on one rank (their tests do).
        out.append(f"parallel.vpp={vpp_size(config)} requires parallel.pp > 1, got 1")
    out.extend(schedule_chunks(p.pp_schedule, p.vpp))


@rule
def pipeline_split(num_layers: int, pp: int, vpp: int, pp_layers: Optional[list[int]]) -> list[str]:
    """The layers split over the pp*vpp model chunks: evenly, or as parallel.pp_layers says."""
    chunks = pp * vpp
    out = []
    if pp_layers is None:
        if num_layers % chunks:
            out.append(f"model.num_layers={num_layers} is not divisible by parallel.pp*vpp={chunks} "
                       f"(set parallel.pp_layers to split the layers unevenly)")
        return out
    if len(pp_layers) != chunks:
        out.append(f"parallel.pp_layers has {len(pp_layers)} entries, expected one per model chunk "
                   f"(parallel.pp*vpp={chunks})")
    for i, n in enumerate(pp_layers):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            out.append(f"parallel.pp_layers[{i}]={_fmt(n)} must be >= 1")
    # (A direct caller may pass what is not a number: then there is no sum to compare.)
    if all(isinstance(n, int) for n in pp_layers) and sum(pp_layers) != num_layers:
        out.append(f"parallel.pp_layers={_fmt(list(pp_layers))} sums to {sum(pp_layers)}, "
                   f"expected model.num_layers={num_layers}")
    return out


@rule
def schedule_chunks(schedule: str, vpp: Optional[int]) -> list[str]:
    """Several model chunks per rank (vpp > 1) need the interleaved schedule, and it needs them;
    ``schedule`` is parallel.pp_schedule (auto allowed), ``vpp`` parallel.vpp (null: 1)."""
    chunks = 1 if vpp is None else vpp
    out = []
    if chunks > 1 and schedule == "1f1b":
        out.append(f"parallel.vpp={chunks} requires parallel.pp_schedule=interleaved (or auto), got 1f1b")
    if schedule == "interleaved" and chunks == 1:
        out.append(f"parallel.pp_schedule=interleaved requires parallel.vpp > 1, got {_fmt(vpp)}")
    return out


@rule
def interleaved_micro_batches(micro_batches: int, pp: int, how: str = "") -> list[str]:
    """The interleaved schedule sends the micro-batches round the pipeline in groups of pp;
    ``how`` says where the count comes from (the batch sizes), for the message."""
    if micro_batches % pp:
        return [f"train.global_batch_size/(micro_batch_size*dp)={micro_batches} micro-batches is not divisible by "
                f"parallel.pp={pp} (the interleaved schedule sends the micro-batches round the pipeline in groups "
                f"of pp{how})"]
    return []

"""Where a rank's local tensor sits in the global tensor, for checkpoints and gathers.

A parameter's local tensor is made of *pieces*: boxes (an offset and a size per dim) of
the local tensor, each equal to a box of the global tensor. A ``"tp"`` parameter with
fused parts (q|k|v, gate|up) has one piece per part, since a rank holds a chunk of each
part (:func:`moe_fold.parallel.tensor_parallel.shard_tp`); on a dim split over one rank the whole
parts are adjacent in both tensors, one piece. An expert parameter is also cut along
dim 0 over ep (rank ``e`` holds experts ``[e*E_local, (e+1)*E_local)``) and along its etp
dim over etp; a replicated parameter is one piece, the whole tensor. Under an expert
placement (``param.slot_experts``, :mod:`moe_fold.dispatch.placement`) local slot ``i`` is
global expert ``slot_experts[i]``: a piece per run of slots holding consecutive experts.
A slot that is not its expert's first copy (``param.slot_primary``) gives pieces marked
``copy``: they are loaded like the others but never written (the first copy writes).

Each local tensor lives on several ranks (its replicas); the *writer* is the first of
them, so that a checkpoint stores every element once:

- ``"tp"``: replicated over ``dp_cp``;
- ``"replicated"``, ``"tp_sum"`` and persistent buffers: over ``tp_dp_cp`` (every rank of
  the pipeline stage);
- ``"expert"``: over ``edp``.

``tp_dp_cp`` holds every rank of a pipeline stage (in both layouts), so
:func:`full_tensor` builds a global tensor with one all-reduce over it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from moe_fold.comm import all_reduce_
from moe_fold.layout import ProcessGroups
from moe_fold.parallel.tensor_parallel import PARALLEL_KINDS

__all__ = ["Piece", "ShardInfo", "REPLICA_GROUP", "shard_info", "buffer_info", "flat_boxes", "intersect", "box",
           "full_tensor"]

# parallel kind -> the group over which the same local tensor is repeated
REPLICA_GROUP = {"tp": "dp_cp", "replicated": "tp_dp_cp", "tp_sum": "tp_dp_cp", "expert": "edp"}


@dataclass(frozen=True)
class Piece:
    """A box of the local tensor (``local`` offsets, ``sizes``) that is the box of the
    global tensor at ``global_`` offsets with the same sizes."""

    local: tuple[int, ...]
    global_: tuple[int, ...]
    sizes: tuple[int, ...]
    # A copy of an expert held elsewhere too: read on load, never written.
    copy: bool = False


@dataclass(frozen=True)
class ShardInfo:
    """The global shape of a local tensor, its pieces (covering the local tensor exactly)
    and whether this rank is the one replica that writes it."""

    global_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    writer: bool


def _segments(parts: list[int], size: int, rank: int, local: int, what: str) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of rank ``rank``'s chunk of each part."""
    if any(p % size for p in parts) or sum(parts) // size != local:
        raise ValueError(f"{what}: parts {parts} over {size} ranks do not give the local size {local}")
    if size == 1:  # whole parts, adjacent in both tensors: one piece (contiguous, written without a copy)
        return [(0, 0, local)]
    out, local_start, global_start = [], 0, 0
    for p in parts:
        n = p // size
        out.append((local_start, global_start + rank * n, n))
        local_start += n
        global_start += p
    return out


def _splits(param: torch.Tensor, groups: ProcessGroups) -> list[tuple[int, list[int], int, int]]:
    """``(dim, global part sizes, ranks, this rank)`` of each dim the parameter is split on."""
    kind = getattr(param, "parallel", None)
    if kind not in PARALLEL_KINDS:
        raise ValueError(f"parameter of shape {tuple(param.shape)} has parallel={kind!r}; it must be marked "
                         f"with one of {', '.join(PARALLEL_KINDS)} (moe_fold.parallel.tensor_parallel.mark)")
    if kind == "tp":
        return [(param.tp_dim, list(param.tp_parts), groups.size("tp"), groups.rank_in("tp"))]
    if kind == "expert":
        ep_size = groups.size("ep")
        local_experts = param.shape[0]
        slots = getattr(param, "slot_experts", None)
        if slots is not None:
            splits = [(0, (param.num_experts, slots, param.slot_primary), ep_size, groups.rank_in("ep"))]
        else:
            splits = [(0, [local_experts * ep_size], ep_size, groups.rank_in("ep"))]
        etp_dim = getattr(param, "etp_dim", None)
        if etp_dim is not None:
            splits.append((etp_dim, list(param.etp_parts), groups.size("etp"), groups.rank_in("etp")))
        elif groups.size("etp") > 1:
            raise ValueError(f"expert parameter of shape {tuple(param.shape)} has no etp_dim but etp="
                             f"{groups.size('etp')}; mark it with moe_fold.parallel.tensor_parallel.mark_expert")
        return splits
    return []


def _slot_segments(slots: list[int], primary: list[bool]) -> list[tuple[int, int, int, bool]]:
    """(local start, global start, length, copy) of each run of slots holding consecutive
    experts, all first copies or all not."""
    out: list[tuple[int, int, int, bool]] = []
    for i, (expert, first) in enumerate(zip(slots, primary)):
        if out and out[-1][1] + out[-1][2] == expert and out[-1][3] == (not first):
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1, out[-1][3])
        else:
            out.append((i, expert, 1, not first))
    return out


def _info(shape: tuple[int, ...], splits, writer: bool, what: str) -> ShardInfo:
    per_dim = [[(0, 0, n, False)] for n in shape]
    global_shape = list(shape)
    for dim, parts, size, rank in splits:
        if isinstance(parts, tuple):  # expert slots: (num_experts, slot_experts, slot_primary)
            per_dim[dim] = _slot_segments(parts[1], parts[2])
            global_shape[dim] = parts[0]
            continue
        per_dim[dim] = [seg + (False,) for seg in _segments(parts, size, rank, shape[dim], f"{what} dim {dim}")]
        global_shape[dim] = sum(parts)
    pieces = tuple(Piece(tuple(s[0] for s in combo), tuple(s[1] for s in combo), tuple(s[2] for s in combo),
                         any(s[3] for s in combo))
                   for combo in itertools.product(*per_dim))
    return ShardInfo(tuple(global_shape), pieces, writer)


def shard_info(param: torch.Tensor, groups: ProcessGroups, name: str = "parameter") -> ShardInfo:
    """The :class:`ShardInfo` of ``param`` (marked with ``param.parallel``) on this rank."""
    splits = _splits(param, groups)
    return _info(tuple(param.shape), splits, groups.rank_in(REPLICA_GROUP[param.parallel]) == 0, name)


def buffer_info(buffer: torch.Tensor, groups: ProcessGroups) -> ShardInfo:
    """A persistent buffer (the router's ``expert_bias``) is the same on every rank of a stage."""
    return _info(tuple(buffer.shape), [], groups.rank_in("tp_dp_cp") == 0, "buffer")


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The elements ``[start, stop)`` of a row-major tensor of ``shape``, flattened, as
    boxes ``(flat offset, offsets, sizes)`` each contiguous in flat order (at most two per
    dim: a partial row at each end around a block of whole rows)."""
    if not 0 <= start <= stop <= _numel(shape):
        raise ValueError(f"flat range [{start}, {stop}) is outside a tensor of shape {tuple(shape)}")
    if start == stop:
        return []
    if not shape:
        return [(0, (), ())]
    row = _numel(shape[1:])  # elements per index of dim 0
    first, last = start // row, (stop - 1) // row
    boxes = []
    if start % row or (first == last and stop - start < row):
        # a partial row: recurse into the remaining dims of row `first`
        stop_in = min(stop, (first + 1) * row)
        for off, offs, sizes in flat_boxes(shape[1:], start - first * row, stop_in - first * row):
            boxes.append((first * row + off, (first,) + offs, (1,) + sizes))
        start = stop_in
    whole_stop = stop // row * row
    if start < whole_stop:
        rows = whole_stop // row - start // row
        boxes.append((start, (start // row,) + (0,) * (len(shape) - 1), (rows,) + tuple(shape[1:])))
        start = whole_stop
    if start < stop:
        row_i = start // row
        for off, offs, sizes in flat_boxes(shape[1:], 0, stop - start):
            boxes.append((start + off, (row_i,) + offs, (1,) + sizes))
    return boxes


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def intersect(a_offsets, a_sizes, b_offsets, b_sizes) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The box common to boxes a and b as ``(offsets, sizes)``, None when empty."""
    lo = tuple(max(a, b) for a, b in zip(a_offsets, b_offsets))
    hi = tuple(min(a + n, b + m) for a, n, b, m in zip(a_offsets, a_sizes, b_offsets, b_sizes))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def box(offsets, sizes) -> tuple[slice, ...]:
    """The index of a box, for ``tensor[box(...)]``."""
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


@torch.no_grad()
def full_tensor(local: torch.Tensor, info: ShardInfo, groups: ProcessGroups) -> torch.Tensor:
    """The global tensor of ``local`` (laid out as ``info``), on every rank of the stage.

    Only the writer places its pieces (not its expert copies'); the others add zeros, so
    the sum over ``tp_dp_cp`` is exact. Costs the global tensor's memory: for tests and export."""
    out = torch.zeros(info.global_shape, dtype=local.dtype, device=local.device)
    if info.writer:
        for p in (p for p in info.pieces if not p.copy):
            out[box(p.global_, p.sizes)] = local[box(p.local, p.sizes)]
    return all_reduce_(out, groups.tp_dp_cp)

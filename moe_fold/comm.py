"""Autograd-aware collectives: the one all-to-all, all-gather and reduce-scatter wrappers,
the tensor/sequence-parallel mappings, pipeline point-to-point, and a byte counter.

Every function takes ``group``, a torch ``ProcessGroup`` or ``None``. ``None`` and any
group of size 1 mean *no communication*: the input comes back unchanged (the same
tensor, which is the identity for autograd) and nothing is counted. This differs from
torch.distributed, where ``None`` means the world group; here a caller that wants the
world passes ``dist.group.WORLD``. Point-to-point is the exception: ``send``/``recv``
always communicate, ``group=None`` picks the default group, and peers are GLOBAL ranks.

Backward passes follow the usual rule "the loss is the sum of every rank's loss":
the backward of all-gather is reduce-scatter, of reduce-scatter all-gather, of
all-to-all the all-to-all with the splits swapped, of all-reduce (sum) all-reduce.
The four Megatron TP/SP mappings (``copy_to_tp_region`` ...) instead assume that the
tensors downstream are replicated over TP and use identity where Megatron does.

Asynchronous collectives (outside autograd, for gradients and parameters):
``all_reduce_async_``, ``reduce_scatter_async``, ``all_gather_async`` and
``all_to_all_async`` post the collective and return a :class:`Pending` whose ``wait()``
gives the result; work meant to overlap runs in between. They count their bytes when
posted, by the rules below. Inside autograd (the MoE dispatcher's overlap):
``all_to_all_start``, ``all_gather_start`` and ``reduce_scatter_start``, whose backward
collective is posted early and waited late too (the section's comment says how).

Byte counter
------------
Each process keeps a count of the bytes it SENDS to other ranks, keyed by the kind of
the group (``group.group_desc``: ``tp cp dp pp dp_cp tp_cp tp_dp_cp ep etp etp_ep edp``;
the default group is named ``world``, a group made without ``group_desc`` counts under
torch's ``undefined``). Forward and backward calls both count: the
backward communication is real. The numbers are the logical volume of the operation,
independent of how the backend moves it (padding for uneven sizes is not counted).
With ``n`` the group size, ``B`` bytes of the named tensor and ``row`` the bytes of one
row (slice along the split dim):

- ``all_to_all``: ``sum(input_split_sizes[j] for j != own rank) * row``;
- ``all_gather``: ``B(own shard) * (n - 1)``;
- ``reduce_scatter``: ``B(input) - B(own output slice)``;
- ``all_reduce`` / ``all_reduce_``: ``2 * (n - 1) * B // n`` (ring volume, floored);
- ``send`` and the sends of ``batch_send_recv``: ``B``; receiving counts nothing;
- ``copy_to_tp_region`` (backward), ``reduce_from_tp_region`` (forward): all-reduce;
  ``gather_from_sequence_region`` / ``gather_from_tp_region`` (forward): all-gather;
  ``reduce_scatter_to_sequence_region`` (forward): reduce-scatter; their backward
  counterparts count by the rule of the collective they run, and pure slicing counts 0;
- groups of size 1 and ``None`` count 0.

:func:`all_to_all_bytes`, :func:`all_gather_bytes` and :func:`reduce_scatter_bytes` are
these rules as functions of a call's arguments: the counter adds what they return, and
the token dispatchers record it on their handles (``Handle.wire``), so the library's own
accounting never reads the counter.

The counter is process-wide state on purpose: it is instrumentation read by benchmarks
and the planner's tests, never an input to any computation, and the installed package
never reads it (tests/meta/test_architecture.py).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = [
    "group_kind", "group_size", "group_rank",
    "all_to_all", "all_gather", "reduce_scatter", "all_reduce", "all_reduce_",
    "copy_to_tp_region", "reduce_from_tp_region", "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region", "scatter_to_sequence_region", "gather_from_tp_region",
    "send", "recv", "batch_send_recv",
    "Pending", "all_reduce_async_", "reduce_scatter_async", "all_gather_async", "all_to_all_async",
    "all_to_all_start", "all_gather_start", "reduce_scatter_start",
    "bytes_sent", "reset_bytes", "count_bytes", "all_to_all_bytes", "all_gather_bytes", "reduce_scatter_bytes",
]

Group = Optional[dist.ProcessGroup]

_BYTES_SENT: dict[str, int] = {}


# --------------------------------------------------------------------------- groups

def group_size(group: Group) -> int:
    """Number of ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This rank's index inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def group_kind(group: Group) -> str:
    """The kind of ``group`` (its ``group_desc``), ``world`` for the default group."""
    if group is None or group is dist.group.WORLD:
        return "world"
    desc = group.group_desc
    return "world" if desc == "default_pg" else desc


def _count(group: Group, nbytes: int) -> None:
    if nbytes:
        kind = group_kind(group)
        _BYTES_SENT[kind] = _BYTES_SENT.get(kind, 0) + int(nbytes)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _ring_bytes(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n


def all_to_all_bytes(x: torch.Tensor, input_split_sizes: Optional[Sequence[int]], group: Group) -> int:
    """The bytes this rank sends in :func:`all_to_all` of ``x`` (every row not its own)."""
    if not _active(group):
        return 0
    n, me = dist.get_world_size(group), dist.get_rank(group)
    own = x.shape[0] // n if input_split_sizes is None else int(input_split_sizes[me])
    return (x.shape[0] - own) * x.element_size() * math.prod(x.shape[1:])


def all_gather_bytes(x: torch.Tensor, group: Group) -> int:
    """The bytes this rank sends in :func:`all_gather` of ``x`` (its shard to every other rank)."""
    return _nbytes(x) * (dist.get_world_size(group) - 1) if _active(group) else 0


def reduce_scatter_bytes(x: torch.Tensor, group: Group, sizes: Optional[Sequence[int]] = None,
                         dim: int = 0) -> int:
    """The bytes this rank sends in :func:`reduce_scatter` of ``x`` (every slice not its own)."""
    if not _active(group):
        return 0
    n, me = dist.get_world_size(group), dist.get_rank(group)
    own = x.shape[dim] // n if sizes is None else int(sizes[me])
    # No division by the scattered size: under compile it may be an unbacked symbolic int.
    return (x.shape[dim] - own) * x.element_size() * math.prod(x.shape[:dim] + x.shape[dim + 1:])


def bytes_sent() -> dict[str, int]:
    """A copy of the bytes this process has sent, per group kind, since the last reset."""
    return dict(_BYTES_SENT)


def reset_bytes() -> None:
    """Zero the byte counter."""
    _BYTES_SENT.clear()


@contextlib.contextmanager
def count_bytes() -> Iterator[dict[str, int]]:
    """Yield a dict that, on exit, holds the bytes sent inside the block, per kind.

    Does not reset the process counter, so blocks may nest.
    """
    before = bytes_sent()
    result: dict[str, int] = {}
    try:
        yield result
    finally:
        after = bytes_sent()
        for kind, total in after.items():
            delta = total - before.get(kind, 0)
            if delta:
                result[kind] = delta


# --------------------------------------------------------------------------- raw ops
# The _raw_* helpers communicate and count; they know nothing of autograd. Each takes
# a group of size >= 2.

def _check_sizes(name: str, sizes: Sequence[int], n: int) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != n:
        raise ValueError(f"{name} has {len(sizes)} entries but the group has {n} ranks")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{name}={sizes} must be non-negative")
    return sizes


def _post_all_to_all(x: torch.Tensor, output_split_sizes: Optional[list[int]],
                     input_split_sizes: Optional[list[int]], group: dist.ProcessGroup,
                     async_op: bool) -> tuple[Optional[dist.Work], Callable[[], torch.Tensor]]:
    """Post the all-to-all of ``x`` along dim 0 and count its bytes; returns the work (None
    when not ``async_op``) and the function that returns the received rows once it is done."""
    n = dist.get_world_size(group)
    x = x.contiguous()
    if x.dim() == 0:
        raise ValueError("all_to_all: the input must have at least one dim (rows along dim 0)")
    if input_split_sizes is None:
        if x.shape[0] % n:
            raise ValueError(f"all_to_all: input rows {x.shape[0]} not divisible by group size {n} "
                             "and input_split_sizes is None")
        input_split_sizes = [x.shape[0] // n] * n
    else:
        input_split_sizes = _check_sizes("input_split_sizes", input_split_sizes, n)
        if sum(input_split_sizes) != x.shape[0]:
            raise ValueError(f"all_to_all: input_split_sizes={input_split_sizes} sum to "
                             f"{sum(input_split_sizes)} but the input has {x.shape[0]} rows")
    if output_split_sizes is None:
        out_rows = x.shape[0]
    else:
        output_split_sizes = _check_sizes("output_split_sizes", output_split_sizes, n)
        out_rows = sum(output_split_sizes)
    out = x.new_empty((out_rows,) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
    _count(group, all_to_all_bytes(x, input_split_sizes, group))
    return work, lambda: out


def _raw_all_to_all(x: torch.Tensor, output_split_sizes: Optional[list[int]],
                    input_split_sizes: Optional[list[int]], group: dist.ProcessGroup) -> torch.Tensor:
    _, finish = _post_all_to_all(x, output_split_sizes, input_split_sizes, group, async_op=False)
    return finish()


def _post_all_gather(x0: torch.Tensor, sizes: Optional[list[int]], group: dist.ProcessGroup,
                     async_op: bool) -> tuple[Optional[dist.Work], Callable[[], torch.Tensor]]:
    """Post the all-gather of every rank's ``x0`` along dim 0; returns the work (None when
    not ``async_op``) and the function that assembles ``[sum(sizes), ...rest]`` once it is done."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    rest = tuple(x0.shape[1:])
    if sizes is None:
        out = x0.new_empty((n * x0.shape[0],) + rest)  # [n*s, ...rest]
        return dist.all_gather_single(out, x0, group=group, async_op=async_op), lambda: out
    sizes = _check_sizes("sizes", sizes, n)
    if sizes[me] != x0.shape[0]:
        raise ValueError(f"all_gather: sizes[{me}]={sizes[me]} but this rank's tensor has "
                         f"{x0.shape[0]} along the gathered dim")
    # The collective needs equal shapes on every rank: pad to the largest shard.
    pad = max(sizes)
    padded = x0.new_zeros((pad,) + rest)
    padded[: x0.shape[0]] = x0
    gathered = x0.new_empty((n * pad,) + rest)  # [n*max, ...rest]
    work = dist.all_gather_single(gathered, padded, group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        rows = gathered.view((n, pad) + rest)  # [n, max, ...rest]
        return torch.cat([rows[r, : sizes[r]] for r in range(n)])  # [sum(sizes), ...rest]
    return work, finish


def _raw_all_gather(x: torch.Tensor, sizes: Optional[list[int]], dim: int,
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``."""
    x0 = x.movedim(dim, 0).contiguous()  # [s, ...rest]
    _, finish = _post_all_gather(x0, sizes, group, async_op=False)
    _count(group, all_gather_bytes(x0, group))
    return finish().movedim(0, dim)


def _post_reduce_scatter(x0: torch.Tensor, sizes: Optional[list[int]], group: dist.ProcessGroup,
                         async_op: bool) -> tuple[Optional[dist.Work], Callable[[], torch.Tensor]]:
    """Post the reduce-scatter (sum) of ``x0`` along dim 0; returns the work (None when not
    ``async_op``) and the function that returns this rank's slice once it is done."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    rest = tuple(x0.shape[1:])
    if sizes is None:
        if x0.shape[0] % n:
            raise ValueError(f"reduce_scatter: size {x0.shape[0]} along the scattered dim is not divisible by "
                             f"group size {n}; pass sizes= for uneven slices")
        out = x0.new_empty((x0.shape[0] // n,) + rest)  # [total/n, ...rest]
        return dist.reduce_scatter_single(out, x0, group=group, async_op=async_op), lambda: out
    sizes = _check_sizes("sizes", sizes, n)
    if sum(sizes) != x0.shape[0]:
        raise ValueError(f"reduce_scatter: sizes={sizes} sum to {sum(sizes)} but the input has "
                         f"{x0.shape[0]} along the scattered dim")
    # The collective needs equal slices: pad every rank's slice to the largest.
    pad = max(sizes)
    padded = x0.new_zeros((n, pad) + rest)  # [n, max, ...rest]
    for r, chunk in enumerate(torch.split(x0, sizes)):
        padded[r, : sizes[r]] = chunk
    out = x0.new_empty((pad,) + rest)
    work = dist.reduce_scatter_single(out, padded.view((n * pad,) + rest), group=group, async_op=async_op)
    return work, lambda: out[: sizes[me]]  # [sizes[me], ...rest]


def _raw_reduce_scatter(x: torch.Tensor, sizes: Optional[list[int]], dim: int,
                        group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice along ``dim``."""
    x0 = x.movedim(dim, 0).contiguous()  # [total, ...rest]
    _, finish = _post_reduce_scatter(x0, sizes, group, async_op=False)
    out = finish()
    _count(group, reduce_scatter_bytes(x0, group, sizes))
    return out.movedim(0, dim)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _reduce_op(op: str) -> dist.ReduceOp:
    if op not in _REDUCE_OPS:
        raise ValueError(f"op={op!r} must be one of {sorted(_REDUCE_OPS)}")
    return _REDUCE_OPS[op]


def _raw_all_reduce_(x: torch.Tensor, group: dist.ProcessGroup, op: str = "sum") -> torch.Tensor:
    dist.all_reduce(x, op=_reduce_op(op), group=group)
    _count(group, _ring_bytes(_nbytes(x), dist.get_world_size(group)))
    return x


def _own_slice(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's equal slice of ``x`` along ``dim`` (a copy, so it owns its storage)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"size {x.shape[dim]} along dim {dim} is not divisible by group size {n}")
    step = x.shape[dim] // n
    return x.narrow(dim, me * step, step).contiguous()


def _copy(sizes: Optional[Sequence[int]]) -> Optional[list[int]]:
    return None if sizes is None else [int(s) for s in sizes]


def _active(group: Group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _norm_dim(dim: int, x: torch.Tensor) -> int:
    if not -x.dim() <= dim < max(1, x.dim()):
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


# --------------------------------------------------------------------------- traced
# Under torch.compile (train.compile=blocks) the collectives with a backward run as
# torch's functional collectives, which the compiler sees as ops with fake kernels and
# autograd formulas (the backward of each is the collective the eager Function runs),
# and whose split sizes may be unbacked symbolic ints from the count exchange. Eager
# calls keep the Functions below (their byte counts, checks and asynchronous overlap).
# A compiled block's collectives are not counted: the counter is a Python side effect
# and a compiled backward has no place to run one.

def _traced_all_to_all(x: torch.Tensor, output_split_sizes: Optional[Sequence[int]],
                       input_split_sizes: Optional[Sequence[int]], group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    if output_split_sizes is None and input_split_sizes is None:
        return funcol.all_to_all_single(x.contiguous(), None, None, group)
    equal = [x.shape[0] // n] * n
    outs = list(output_split_sizes) if output_split_sizes is not None else equal
    ins = list(input_split_sizes) if input_split_sizes is not None else equal
    return funcol.all_to_all_single(x.contiguous(), outs, ins, group)


def _traced_all_gather(x: torch.Tensor, sizes: Optional[Sequence[int]], dim: int,
                       group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    x0 = x.movedim(dim, 0).contiguous()  # [s, ...rest]
    if sizes is None:
        return funcol.all_gather_tensor(x0, 0, group).movedim(0, dim)  # [n*s, ...rest]
    # Uneven shards: an all-to-all that sends this rank's shard to every rank and receives
    # sizes[r] rows from rank r, so no size is sliced by an unbacked symbolic int (a sum of
    # the count exchange's sizes, which AOT autograd cannot rebind). Its backward sums the
    # rows every rank sends back: the reduce-scatter.
    received = funcol.all_to_all_single(x0.repeat((n,) + (1,) * (x0.dim() - 1)), list(sizes),
                                        [x0.shape[0]] * n, group)  # [sum(sizes), ...rest]
    return received.movedim(0, dim)


def _traced_reduce_scatter(x: torch.Tensor, sizes: Optional[Sequence[int]], dim: int,
                           group: dist.ProcessGroup) -> torch.Tensor:
    n, me = dist.get_world_size(group), dist.get_rank(group)
    x0 = x.movedim(dim, 0).contiguous()  # [total, ...rest]
    if sizes is None:
        return funcol.reduce_scatter_tensor(x0, "sum", 0, group).movedim(0, dim)  # [total/n, ...rest]
    # Uneven slices: an all-to-all that sends slice r to rank r, then the sum of what every
    # rank sent (as _traced_all_gather, no slicing by unbacked sizes).
    own, rest = sizes[me], tuple(x0.shape[1:])
    received = funcol.all_to_all_single(x0, [own] * n, list(sizes), group)  # [n*own, ...rest]
    return received.view((n, own) + rest).sum(dim=0).movedim(0, dim)  # [own, ...rest]


# --------------------------------------------------------------------------- autograd ops

class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group):
        ctx.group = group
        # Copies: the caller may reuse its lists before backward runs.
        ctx.splits = (_copy(output_split_sizes), _copy(input_split_sizes))
        return _raw_all_to_all(x, output_split_sizes, input_split_sizes, group)

    @staticmethod
    def backward(ctx, grad):
        output_split_sizes, input_split_sizes = ctx.splits
        return _raw_all_to_all(grad, input_split_sizes, output_split_sizes, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_split_sizes: Optional[list[int]],
               input_split_sizes: Optional[list[int]], group: Group) -> torch.Tensor:
    """All-to-all along dim 0: rows ``input_split_sizes[j]`` go to rank j of ``group``,
    and ``output_split_sizes[j]`` rows arrive from rank j, in rank order.

    ``None`` splits mean equal splits. Uneven and zero splits are allowed; any trailing
    shape and dtype (integers carry no grad). Backward: the same with the splits swapped.
    ``[sum(input_split_sizes), ...] -> [sum(output_split_sizes), ...]``.
    """
    if not _active(group):
        # One rank keeps its rows: the splits, when given, must say exactly that.
        for name, sizes in (("input_split_sizes", input_split_sizes), ("output_split_sizes", output_split_sizes)):
            if sizes is not None and _check_sizes(name, sizes, 1) != [x.shape[0]]:
                raise ValueError(f"all_to_all: {name}={list(sizes)} on a group of one rank must be "
                                 f"[{x.shape[0]}], the input's rows")
        return x
    if torch.compiler.is_compiling():
        return _traced_all_to_all(x, output_split_sizes, input_split_sizes, group)
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes, dim):
        ctx.group, ctx.sizes, ctx.dim = group, _copy(sizes), dim
        return _raw_all_gather(x, sizes, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _raw_reduce_scatter(grad, ctx.sizes, ctx.dim, ctx.group), None, None, None


def all_gather(x: torch.Tensor, group: Group, sizes: Optional[list[int]] = None, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order).

    ``sizes[r]`` is rank r's size along ``dim`` when they differ (``None``: all equal).
    Backward: reduce-scatter, each rank gets the sum over ranks of its slice of the grad.
    """
    if not _active(group):
        return x
    if torch.compiler.is_compiling():
        return _traced_all_gather(x, sizes, _norm_dim(dim, x), group)
    return _AllGather.apply(x, group, sizes, _norm_dim(dim, x))


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes, dim):
        ctx.group, ctx.sizes, ctx.dim = group, _copy(sizes), dim
        return _raw_reduce_scatter(x, sizes, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _raw_all_gather(grad, ctx.sizes, ctx.dim, ctx.group), None, None, None


def reduce_scatter(x: torch.Tensor, group: Group, sizes: Optional[list[int]] = None, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's slice along ``dim``.

    Slices are ``sizes`` (one per rank, summing to ``x.shape[dim]``) or equal when
    ``None``. Backward: all-gather.
    """
    if not _active(group):
        return x
    if torch.compiler.is_compiling():
        return _traced_reduce_scatter(x, sizes, _norm_dim(dim, x), group)
    return _ReduceScatter.apply(x, group, sizes, _norm_dim(dim, x))


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _raw_all_reduce_(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad):
        return _raw_all_reduce_(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


def all_reduce(x: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """All-reduce returning a new tensor. ``op="sum"`` has a backward (all-reduce sum);
    ``"max"``/``"min"`` are for tensors without grad."""
    if not _active(group):
        return x
    if torch.compiler.is_compiling():
        _reduce_op(op)
        return funcol.all_reduce(x, op, group)
    if op == "sum":
        return _AllReduceSum.apply(x, group)
    if x.requires_grad:
        raise ValueError(f"all_reduce(op={op!r}) has no backward; only op='sum' accepts a tensor "
                         "that requires grad")
    return _raw_all_reduce_(x.clone(memory_format=torch.contiguous_format), group, op)


def all_reduce_(tensor: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of a contiguous tensor, outside autograd (grads, statistics)."""
    _reduce_op(op)
    if not tensor.is_contiguous():
        raise ValueError(f"all_reduce_: tensor of shape {tuple(tensor.shape)} must be contiguous")
    if _active(group):
        with torch.no_grad():
            if torch.compiler.is_compiling():
                tensor.copy_(funcol.all_reduce(tensor, op, group))
            else:
                _raw_all_reduce_(tensor, group, op)
    return tensor


# --------------------------------------------------------------------------- TP / SP mappings

def _tp_sum(x: torch.Tensor, group: dist.ProcessGroup, traced: bool) -> torch.Tensor:
    """All-reduce sum into a new tensor: a functional collective under compile."""
    if traced:
        return funcol.all_reduce(x.contiguous(), "sum", group)
    return _raw_all_reduce_(x.clone(memory_format=torch.contiguous_format), group)


def _tp_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup, traced: bool) -> torch.Tensor:
    """Equal all-gather along ``dim``: a functional collective under compile."""
    return (_traced_all_gather if traced else _raw_all_gather)(x, None, dim, group)


# Each mapping takes ``traced`` (torch.compiler.is_compiling() at the call) so that one
# Function serves both eager and compiled blocks: only the collective differs.

class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, traced):
        ctx.group, ctx.traced = group, traced
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _tp_sum(grad, ctx.group, ctx.traced), None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, traced):
        return _tp_sum(x, group, traced)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, traced):
        ctx.group, ctx.dim, ctx.traced = group, dim, traced
        return _own_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _tp_gather(grad, ctx.dim, ctx.group, ctx.traced), None, None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, traced):
        ctx.group, ctx.dim = group, dim
        return _tp_gather(x, dim, group, traced)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.dim, ctx.group), None, None, None


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a TP region with a replicated input: forward identity, backward all-reduce."""
    if not _active(group):
        return x
    return _CopyToTP.apply(x, group, torch.compiler.is_compiling())


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP region by summing partial outputs: forward all-reduce, backward identity."""
    if not _active(group):
        return x
    return _ReduceFromTP.apply(x, group, torch.compiler.is_compiling())


def gather_from_sequence_region(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """SP -> TP: forward all-gather along the sequence dim, backward reduce-scatter."""
    return all_gather(x, group, dim=dim)


def reduce_scatter_to_sequence_region(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """TP -> SP: forward reduce-scatter along the sequence dim, backward all-gather."""
    return reduce_scatter(x, group, dim=dim)


def scatter_to_sequence_region(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Replicated -> SP: forward keep this rank's equal slice along ``dim``, backward all-gather."""
    if not _active(group):
        return x
    return _ScatterToSP.apply(x, group, _norm_dim(dim, x), torch.compiler.is_compiling())


def gather_from_tp_region(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Column-parallel output -> replicated: forward all-gather along ``dim`` (the last by
    default), backward keep this rank's slice (the grad is replicated over TP)."""
    if not _active(group):
        return x
    return _GatherFromTP.apply(x, group, _norm_dim(dim, x), torch.compiler.is_compiling())


# --------------------------------------------------------------------------- point-to-point

def _default_device(group: Group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send(x: torch.Tensor, dst: int, group: Group = None) -> None:
    """Blocking send of ``x`` to GLOBAL rank ``dst``; ``group=None`` is the default group."""
    x = x.detach().contiguous()
    dist.send(x, dst, group=group)
    _count(group, _nbytes(x))


def recv(shape: Sequence[int], dtype: torch.dtype, src: int, group: Group = None,
         device: Optional[torch.device] = None) -> torch.Tensor:
    """Blocking receive of a ``shape``/``dtype`` tensor from GLOBAL rank ``src``.

    ``device`` defaults to the current CUDA device under NCCL and to the CPU otherwise.
    """
    out = torch.empty(tuple(shape), dtype=dtype, device=device or _default_device(group))
    dist.recv(out, src, group=group)
    return out


RecvSpec = Union[torch.Tensor, tuple]


def batch_send_recv(ops: Sequence[tuple[str, RecvSpec, int]], group: Group = None,
                    device: Optional[torch.device] = None) -> list[torch.Tensor]:
    """Post several sends and receives together, then wait for all of them.

    ``ops`` holds ``("send", tensor, dst)`` and ``("recv", buffer_or_spec, src)`` with
    GLOBAL peer ranks; a receive takes a buffer to fill or a ``(shape, dtype)`` spec.
    Posting both directions before waiting is what lets two pipeline stages exchange
    activations and grads without deadlock. Returns the received tensors, in order.
    """
    p2p, received, sent = [], [], 0
    for i, op in enumerate(ops):
        if len(op) != 3:
            raise ValueError(f"batch_send_recv: ops[{i}]={op!r} must be (kind, tensor_or_spec, peer)")
        kind, obj, peer = op
        if kind == "send":
            t = obj.detach().contiguous()
            p2p.append(dist.P2POp(dist.isend, t, peer, group))
            sent += _nbytes(t)
        elif kind == "recv":
            if isinstance(obj, torch.Tensor):
                if not obj.is_contiguous():
                    raise ValueError(f"batch_send_recv: ops[{i}] receive buffer must be contiguous")
                t = obj
            else:
                shape, dtype = obj
                t = torch.empty(tuple(shape), dtype=dtype, device=device or _default_device(group))
            p2p.append(dist.P2POp(dist.irecv, t, peer, group))
            received.append(t)
        else:
            raise ValueError(f"batch_send_recv: ops[{i}] kind={kind!r} must be 'send' or 'recv'")
    if p2p:
        for work in dist.batch_isend_irecv(p2p):
            work.wait()
    _count(group, sent)
    return received


# --------------------------------------------------------------------------- asynchronous

class Pending:
    """A collective in flight: :meth:`wait` blocks until it is done and returns its result
    (the same tensor on every later call). The bytes were counted when it was posted."""

    def __init__(self, work: Optional[dist.Work], finish: Callable[[], torch.Tensor]):
        self._work, self._finish = work, finish
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            self._result = self._finish()
        return self._result


def all_reduce_async_(tensor: torch.Tensor, group: Group) -> Pending:
    """Start the in-place sum of a contiguous tensor over ``group`` (outside autograd);
    the :class:`Pending` returns ``tensor`` once summed."""
    if not tensor.is_contiguous():
        raise ValueError(f"all_reduce_async_: tensor of shape {tuple(tensor.shape)} must be contiguous")
    if not _active(group):
        return Pending(None, lambda: tensor)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    _count(group, _ring_bytes(_nbytes(tensor), dist.get_world_size(group)))
    return Pending(work, lambda: tensor)


def reduce_scatter_async(x: torch.Tensor, group: Group, sizes: Optional[list[int]] = None) -> Pending:
    """Start the sum of ``x`` over ``group`` keeping this rank's slice along dim 0
    (``sizes`` as in :func:`reduce_scatter`), outside autograd. Counted as a reduce-scatter."""
    if not _active(group):
        if sizes is not None:
            _check_sizes("sizes", sizes, 1)
        return Pending(None, lambda: x)
    x0 = x.contiguous()
    work, finish = _post_reduce_scatter(x0, sizes, group, async_op=True)
    _count(group, reduce_scatter_bytes(x0, group, sizes))
    return Pending(work, finish)


def all_gather_async(x: torch.Tensor, group: Group, sizes: Optional[list[int]] = None) -> Pending:
    """Start the concatenation of every rank's ``x`` along dim 0 (``sizes`` as in
    :func:`all_gather`), outside autograd. Counted as an all-gather."""
    if not _active(group):
        return Pending(None, lambda: x)
    x0 = x.contiguous()
    work, finish = _post_all_gather(x0, sizes, group, async_op=True)
    _count(group, all_gather_bytes(x0, group))
    return Pending(work, finish)


def all_to_all_async(x: torch.Tensor, output_split_sizes: Optional[list[int]],
                     input_split_sizes: Optional[list[int]], group: Group) -> Pending:
    """Start :func:`all_to_all` outside autograd. Counted as an all-to-all."""
    if not _active(group):
        received = all_to_all(x, output_split_sizes, input_split_sizes, group)  # checks the splits
        return Pending(None, lambda: received)
    return Pending(*_post_all_to_all(x, output_split_sizes, input_split_sizes, group, async_op=True))


# --------------------------------------------------------------------------- asynchronous, in autograd
# ``*_start`` posts a collective and returns a Pending at once. Two autograd nodes bracket
# it: the start (input -> an empty edge tensor) and the wait (edge -> result), run by the
# Pending's wait(). Backward runs them in reverse: the wait's backward posts the backward
# collective and returns at once, the start's backward waits for it. Autograd runs the
# nodes recorded between the start and the wait of the forward (the work that overlapped
# it) between those two, so the backward collective overlaps their backward. The data
# travel outside autograd's edges, on the shared _Flight; the edge is an empty tensor, so
# its shape never has to match the collective's buffers.

class _Flight:
    """One collective of the forward and the one of its backward: ``post(x)`` and
    ``post_backward(grad)`` start them (the ``*_async`` functions above)."""

    def __init__(self, post: Callable[[torch.Tensor], Pending], post_backward: Callable[[torch.Tensor], Pending]):
        self.post, self.post_backward = post, post_backward
        self.forward: Optional[Pending] = None
        self.backward: Optional[Pending] = None


class _StartAsync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, flight):
        ctx.flight = flight
        flight.forward = flight.post(x)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _edge):
        grad, ctx.flight.backward = ctx.flight.backward.wait(), None
        return grad, None


class _WaitAsync(torch.autograd.Function):
    @staticmethod
    def forward(ctx, _edge, flight):
        ctx.flight = flight
        out, flight.forward = flight.forward.wait(), None
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.flight.backward = ctx.flight.post_backward(grad)
        return grad.new_empty(0), None


def _in_autograd(x: torch.Tensor, flight: _Flight) -> Pending:
    edge = _StartAsync.apply(x, flight)
    return Pending(None, lambda: _WaitAsync.apply(edge, flight))


def all_to_all_start(x: torch.Tensor, output_split_sizes: Optional[list[int]],
                     input_split_sizes: Optional[list[int]], group: Group) -> Pending:
    """:func:`all_to_all`, asynchronous in forward and backward: returns once the collective
    is posted; the :class:`Pending` returns the rows."""
    if not _active(group):
        return all_to_all_async(x, output_split_sizes, input_split_sizes, group)
    if torch.compiler.is_compiling():
        # A functional collective is already asynchronous: the compiler waits at first use.
        received = _traced_all_to_all(x, output_split_sizes, input_split_sizes, group)
        return Pending(None, lambda: received)
    outs, ins = _copy(output_split_sizes), _copy(input_split_sizes)
    return _in_autograd(x, _Flight(lambda t: all_to_all_async(t, outs, ins, group),
                                   lambda g: all_to_all_async(g, ins, outs, group)))


def all_gather_start(x: torch.Tensor, group: Group, sizes: Optional[list[int]] = None) -> Pending:
    """:func:`all_gather` along dim 0, asynchronous in forward and backward (reduce-scatter)."""
    if not _active(group):
        return Pending(None, lambda: x)
    if torch.compiler.is_compiling():
        gathered = _traced_all_gather(x, sizes, 0, group)
        return Pending(None, lambda: gathered)
    sizes = _copy(sizes)
    return _in_autograd(x, _Flight(lambda t: all_gather_async(t, group, sizes),
                                   lambda g: reduce_scatter_async(g, group, sizes)))


def reduce_scatter_start(x: torch.Tensor, group: Group, sizes: Optional[list[int]] = None) -> Pending:
    """:func:`reduce_scatter` along dim 0, asynchronous in forward and backward (all-gather)."""
    if not _active(group):
        return reduce_scatter_async(x, group, sizes)
    if torch.compiler.is_compiling():
        reduced = _traced_reduce_scatter(x, sizes, 0, group)
        return Pending(None, lambda: reduced)
    sizes = _copy(sizes)
    return _in_autograd(x, _Flight(lambda t: reduce_scatter_async(t, group, sizes),
                                   lambda g: all_gather_async(g, group, sizes)))

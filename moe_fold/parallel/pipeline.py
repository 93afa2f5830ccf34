"""Pipeline parallelism: which layers each stage holds, running a schedule over model
chunks with point-to-point activations and grads, and tied embeddings across stages.

Stage interface. A model chunk is any ``nn.Module`` whose ``forward`` takes one input and
returns one output:

- the chunk of virtual stage 0 receives the micro-batch object itself (``microbatches[i]``,
  e.g. a dict of input ids and labels) and returns hidden states;
- middle chunks map hidden states ``tensor_shape``/``dtype`` to hidden states of the
  same shape (every micro-batch and every stage boundary has that one shape);
- the chunk of the last virtual stage returns the micro-batch's loss, a scalar, or
  something ``loss_fn(output, microbatches[i])`` turns into that scalar;
- with ``side_inputs``, every chunk also gets the keyword arguments
  ``side_inputs(microbatches[i])``: per-micro-batch data that middle stages need too
  (positions, sequence boundaries for varlen attention, masks).

The schedule back-propagates each micro-batch's loss with gradient 1, so the loss must
already carry its share of the average (e.g. divided by the number of micro-batches).
Anything else that must reach the gradients, such as MoE aux and z-losses, attaches to
the graph through autograd (an identity op whose backward adds the loss gradient, with
the same 1/m share in its scale): the backward of a chunk is
``torch.autograd.backward(output, output_grad)``, which runs those ops on whichever rank
and in whichever schedule slot the chunk runs. Nothing is collected in module globals.

Parameter grads accumulate over the micro-batches of one call (zero them before).
Virtual stage ``s = c*pp + r`` is chunk ``c`` of pp rank ``r``
(:mod:`moe_fold.parallel.pipeline_schedules` has the schedules and how they communicate).

Tied embeddings. With pp > 1 the input embedding lives on the first stage and the output
head on the last. :func:`create_embedding_group` makes, for every pp group, a group of its
first and last ranks (``group_desc="embedding"``); :func:`copy_embedding_from_first` makes
the last stage's copy equal to the first's once at initialisation, and
:func:`all_reduce_embedding_grads` sums the two copies' grads after every backward (before
the data-parallel sync and the optimizer step), so both copies get the gradient of the
shared weight and stay equal step after step.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from moe_fold.comm import all_reduce_, batch_send_recv
from moe_fold.config import pipeline_split, require
from moe_fold.layout import ProcessGroups
from moe_fold.parallel.pipeline_schedules import Exchange, check_schedule, make_plan

__all__ = ["stage_layers", "run_schedule", "create_embedding_group", "copy_embedding_from_first",
           "all_reduce_embedding_grads"]


def stage_layers(num_layers: int, pp: int, vpp: int = 1,
                 pp_layers: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Global layer indices of each virtual stage ``0..pp*vpp-1``, consecutive in stage
    order: ``pp_layers[s]`` layers on stage ``s`` (``parallel.pp_layers``, in virtual stage
    order), or an even split when None. The embedding goes with stage 0, the head and
    loss with the last stage. Pp rank ``r`` holds stages ``r, pp + r, 2*pp + r, ...``."""
    for name, value in (("num_layers", num_layers), ("pp", pp), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    require(pipeline_split, num_layers, pp, vpp, pp_layers)
    stages = pp * vpp
    counts = [num_layers // stages] * stages if pp_layers is None else list(pp_layers)
    out, first = [], 0
    for n in counts:
        out.append(list(range(first, first + n)))
        first += n
    return out


# A training loop asks for the same plan every step; plans are never modified.
_plan = functools.lru_cache(maxsize=16)(make_plan)


def _device(chunks: Sequence[nn.Module]) -> torch.device:
    for chunk in chunks:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


def run_schedule(chunks: Sequence[nn.Module], microbatches: Sequence[Any], groups: ProcessGroups, *,
                 tensor_shape: Sequence[int], dtype: torch.dtype = torch.float32, schedule: str = "1f1b",
                 loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                 side_inputs: Optional[Callable[[Any], dict[str, Any]]] = None, forward_only: bool = False,
                 device: Optional[torch.device] = None,
                 backward_context: Optional[Callable[[int, int], ContextManager]] = None) -> torch.Tensor:
    """Run forward and backward of every micro-batch through the pipeline.

    ``chunks``: this pp rank's model chunks, ``chunks[c]`` is virtual stage
    ``c*pp + rank_in("pp")``; one chunk for ``"1f1b"``, ``vpp >= 2`` for
    ``"interleaved"`` (the schedule's vpp is ``len(chunks)``). ``microbatches``: one entry
    per micro-batch, the same count on every pp rank; only the ranks of the first and last
    stage read the entries (others may pass ``[None] * m``), or every rank with
    ``side_inputs``. ``tensor_shape``/``dtype``: the hidden states between chunks.
    ``forward_only``: no backward, no graph (evaluation). ``device``: where received
    tensors go (default: the chunks' parameters' device). ``backward_context(mb, chunk)``:
    entered around the backward of micro-batch ``mb`` through ``chunks[chunk]`` (the
    gradient reduction's hook point, :meth:`moe_fold.training.buckets.GradSync.backward_of`).

    Returns the ``[m]`` float64 tensor of micro-batch losses (as the last stage computed
    them) on every rank of the pp group; its sum is the step's loss when each loss carries
    its 1/m share.
    """
    pp, me, peers = groups.size("pp"), groups.rank_in("pp"), groups.ranks("pp")
    vpp, m = len(chunks), len(microbatches)
    if vpp < 1:
        raise ValueError("chunks is empty; pass this rank's model chunks (one for 1f1b, vpp for interleaved)")
    if m < 1:
        raise ValueError("microbatches is empty; pass at least one micro-batch")
    check_schedule(schedule, pp, vpp, m)
    stages = pp * vpp
    shape = tuple(int(d) for d in tensor_shape)
    device = device if device is not None else _device(chunks)
    plan = _plan(schedule, pp, vpp, m, forward_only)

    inputs: dict[tuple[int, int], torch.Tensor] = {}  # (micro-batch, stage) -> its input
    out_grads: dict[tuple[int, int], torch.Tensor] = {}  # (micro-batch, stage) -> grad of its output
    outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # message key -> tensor to send
    saved: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # (input, output) kept for backward
    losses = torch.zeros(m, dtype=torch.float64, device=device)

    def hand_over(kind: str, mb: int, stage: int, tensor: torch.Tensor) -> None:
        """Deliver ``tensor`` to ``stage``: locally when that stage is ours, else by message."""
        if stage % pp == me:
            (inputs if kind == "act" else out_grads)[(mb, stage)] = tensor
        else:
            outbox[(kind, mb, stage)] = tensor

    def forward(mb: int, stage: int) -> None:
        if stage == 0:
            x = microbatches[mb]
        else:
            x = inputs.pop((mb, stage))
            if not forward_only:
                x.requires_grad_(True)
        with torch.set_grad_enabled(not forward_only):
            kwargs = side_inputs(microbatches[mb]) if side_inputs is not None else {}
            y = chunks[stage // pp](x, **kwargs)
            if stage == stages - 1:
                y = loss_fn(y, microbatches[mb]) if loss_fn is not None else y
                if not isinstance(y, torch.Tensor) or y.numel() != 1:
                    raise ValueError(f"the last stage must produce a scalar loss per micro-batch, got "
                                     f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
                losses[mb] = y.detach().reshape(())
        if stage < stages - 1:
            if tuple(y.shape) != shape or y.dtype != dtype:
                raise ValueError(f"stage {stage} returned {tuple(y.shape)} {y.dtype}, but tensor_shape={shape} "
                                 f"dtype={dtype} (every stage boundary must carry that shape)")
            hand_over("act", mb, stage + 1, y.detach())
        if not forward_only:
            saved[(mb, stage)] = (x, y)

    def backward(mb: int, stage: int) -> None:
        x, y = saved.pop((mb, stage))
        around = backward_context(mb, stage // pp) if backward_context is not None else contextlib.nullcontext()
        with around:
            if stage == stages - 1:
                torch.autograd.backward(y.reshape(()))
            else:
                torch.autograd.backward(y, out_grads.pop((mb, stage)))
        if stage > 0:
            hand_over("grad", mb, stage - 1, x.grad if x.grad is not None else torch.zeros_like(x))

    def exchange(item: Exchange) -> None:
        ops, keys = [], []
        for msg in item.messages:
            if msg.src == me:
                ops.append(("send", outbox.pop((msg.kind, msg.microbatch, msg.stage)), peers[msg.dst]))
            else:
                ops.append(("recv", (shape, dtype), peers[msg.src]))
                keys.append(msg)
        for msg, tensor in zip(keys, batch_send_recv(ops, group=groups.pp, device=device)):
            (inputs if msg.kind == "act" else out_grads)[(msg.microbatch, msg.stage)] = tensor

    for item in plan.programs[me]:
        if isinstance(item, Exchange):
            exchange(item)
        elif item.kind == "F":
            forward(item.microbatch, item.stage)
        else:
            backward(item.microbatch, item.stage)
    # Only the last stage's rank has the losses; the others add zeros.
    return all_reduce_(losses, groups.pp)


def create_embedding_group(groups: ProcessGroups,
                           timeout: Optional[datetime.timedelta] = None) -> Optional[dist.ProcessGroup]:
    """Create the {first, last} pp rank group of every pp group; return this rank's, or
    None where the rank is in neither end or pp == 1 (nothing to tie).

    Collective over the world: every rank must call it, in the same order relative to
    other group creations (torch requires every rank to take part in every new group).
    ``timeout=None`` takes the one ``groups`` were created with.
    """
    timeout = timeout if timeout is not None else groups.timeout
    mine = None
    for ranks in groups.layout.groups("pp"):
        if len(ranks) < 2:
            continue
        ends = [ranks[0], ranks[-1]]
        pg = dist.new_group(ends, timeout=timeout, group_desc="embedding")
        if groups.rank in ends:
            mine = pg
    return mine


def copy_embedding_from_first(weight: torch.Tensor, groups: ProcessGroups,
                              group: Optional[dist.ProcessGroup]) -> None:
    """Overwrite the last stage's copy of a tied weight with the first stage's (call once,
    after initialisation, on both ends; a no-op where ``group`` is None)."""
    if group is None:
        return
    with torch.no_grad():
        if groups.rank_in("pp") != 0:
            weight.zero_()
        all_reduce_(weight.data, group)


def all_reduce_embedding_grads(weight: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """Sum the grads of the two copies of a tied weight, so each holds the gradient of the
    shared weight (a no-op where ``group`` is None). A copy without grad counts as zero."""
    if group is None:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    all_reduce_(weight.grad, group)

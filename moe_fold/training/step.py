"""One global batch's forward and backward on any layout: what the training loop calls
once per optimizer step, before :func:`moe_fold.training.optim.reduce_gradients`.

Every rank passes its micro-batches of the step (``DataLoader.global_batch``: its dp
shard, its cp zigzag slice; the ranks of one pipeline pass the same ones, since every
stage reads the positions and the last one the labels). Then:

- Loss scaling: each micro-batch's loss is ``sum(token losses) * dp*cp / N`` where ``N``
  counts the unmasked tokens of the whole global batch (every dp x cp rank, every
  micro-batch; one all-reduce over dp x cp), so the grads summed over micro-batches and
  averaged over dp x cp (:func:`moe_fold.training.grads.sync_grads`) are the exact gradient of the
  global-batch mean loss (:meth:`Transformer.forward`).
- Routers: every forward gets ``loss_scale = 1/num_microbatches``, so the aux and z
  losses, attached per micro-batch through autograd, are the mean over the step's
  micro-batches.
- pp = 1: the micro-batches one after another, grads accumulating. pp > 1: the
  pipeline schedule ``parallel.pp_schedule`` over this rank's model chunks
  (:func:`moe_fold.parallel.pipeline.run_schedule`; ``interleaved`` with ``parallel.vpp`` chunks).
- Tied embeddings under pp: the grads of the first and last stages' copies are summed,
  so both copies take the same step.
- Gradient reduction (``grad_sync``, :class:`moe_fold.training.buckets.GradSync`): every
  backward runs inside its ``backward_of(micro-batch, chunk)``, so with
  ``parallel.overlap_grad_reduce`` the buckets of a chunk are posted during the backward
  of its last micro-batch; the tied embedding's after the copies' sum.
- Packed samples: each micro-batch's ``cu_seqlens`` and real-token mask become the
  model's :class:`moe_fold.parallel.varlen.Documents` (attention inside documents, padding out of
  the router losses).
- Multi-token prediction: the rank holding the last stage shifts each micro-batch's
  targets for the MTP depths (:meth:`Transformer.mtp_targets`) and counts each depth's
  targets over the global batch in the same all-reduce as the LM tokens, so every depth's
  loss is its exact global-batch mean too.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from moe_fold.comm import all_reduce_
from moe_fold.config import Config, dynamic_cp_layout, pipeline_schedule, require
from moe_fold.data.loader import Batch
from moe_fold.training.dynamic_cp import DynamicCP
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import Transformer
from moe_fold.models.mtp import MTPTargets
from moe_fold.parallel.pipeline import all_reduce_embedding_grads, run_schedule
from moe_fold.training.buckets import GradSync

__all__ = ["forward_backward"]


class _Chunk(nn.Module):
    """Virtual stage ``model.stages[chunk]`` in :func:`run_schedule`'s stage interface:
    the first stage gets the :class:`Batch` itself, every stage gets it as ``batch``."""

    def __init__(self, model: Transformer, chunk: int, num_loss_tokens: torch.Tensor,
                 forward_context: Callable[[], ContextManager], loss_scale: float):
        super().__init__()
        self.model, self.chunk = model, chunk
        self.num_loss_tokens, self.forward_context = num_loss_tokens, forward_context
        self.loss_scale = loss_scale

    def forward(self, x, batch: Batch, mtp: Optional[MTPTargets] = None) -> torch.Tensor:
        hidden = None if isinstance(x, Batch) else x  # [S_local, B, H] from the stage before
        with self.forward_context():
            return self.model.chunk_forward(self.chunk, hidden, batch.tokens, batch.labels, batch.positions,
                                            batch.loss_mask, self.num_loss_tokens, docs=_documents(self.model, batch),
                                            mtp=mtp, loss_scale=self.loss_scale)


def _documents(model: Transformer, batch: Batch):
    """The micro-batch's packed documents (``cu_seqlens``, padding), None for plain rows."""
    return model.documents(batch.cu_seqlens, batch.token_mask, tuple(batch.tokens.shape))


def _num_loss_tokens(microbatches: Sequence[Batch], mtp: Optional[list[MTPTargets]],
                     groups: ProcessGroups) -> torch.Tensor:
    """Unmasked label tokens of the global batch, at least 1 (a fully masked batch has loss 0);
    with ``mtp`` (this rank holds the last stage), the same count of each MTP depth's
    targets after it: ``[1 + D]``, in one all-reduce. Written into ``mtp``'s ``num_tokens``."""
    # float64: float32 counts stop being exact above 2**24 tokens.
    count = torch.stack([b.loss_mask.sum(dtype=torch.float64) for b in microbatches]).sum().reshape(1)
    if mtp:
        depths = torch.stack([t.mask.sum(dim=(1, 2), dtype=torch.float64) for t in mtp]).sum(0)  # [D]
        count = torch.cat([count, depths])
    counts = all_reduce_(count, groups.dp_cp).clamp(min=1).float()
    for t in mtp or ():
        t.num_tokens = counts[1:]
    return counts[0]


def forward_backward(model: Transformer, microbatches: Sequence[Batch], groups: ProcessGroups, config: Config, *,
                     forward_context: Callable[[], ContextManager] = contextlib.nullcontext,
                     forward_only: bool = False, dynamic_cp: Optional[DynamicCP] = None,
                     grad_sync: Optional[GradSync] = None) -> torch.Tensor:
    """Forward and backward of this rank's ``microbatches`` of one global batch (see the
    module doc); parameter grads accumulate (zero them before).

    ``forward_context()`` is entered around every forward (a micro-batch, or one chunk
    of it under pp), e.g. autocast or routing-statistics recording; backwards run
    outside it. ``forward_only``: losses only, no graph (evaluation). ``grad_sync``: the
    step's gradient reduction, whose hooks the backwards run under (see the module doc);
    the caller finishes it.

    Returns the ``[m]`` float64 micro-batch losses of this rank, the same on every rank
    of its pipeline: their sum averaged over dp x cp is the global batch's mean LM loss.
    """
    if not microbatches:
        raise ValueError("microbatches is empty; pass this rank's micro-batches of the global batch")
    m = len(microbatches)
    if dynamic_cp is not None:
        require(dynamic_cp_layout, dynamic_cp.cp, 1, model.num_stages)
        placed = [dynamic_cp.shard(b) for b in microbatches]
        microbatches, docs = [p[0] for p in placed], [p[1] for p in placed]
    elif model.num_stages == 1:
        docs = [_documents(model, b) for b in microbatches]
    mtp = None
    if model.mtp is not None:
        if model.num_stages > 1:
            docs = [_documents(model, b) for b in microbatches]
        mtp = [model.mtp_targets(b.tokens, b.labels, b.loss_mask, d) for b, d in zip(microbatches, docs)]
    num_loss_tokens = _num_loss_tokens(microbatches, mtp, groups)

    def backward_of(mb: int, chunk: int) -> ContextManager:
        return grad_sync.backward_of(mb, chunk, m) if grad_sync is not None else contextlib.nullcontext()

    if model.num_stages == 1:
        losses = []
        for i, (b, d) in enumerate(zip(microbatches, docs)):
            with torch.set_grad_enabled(not forward_only), forward_context():
                loss = model(b.tokens, b.labels, positions=b.positions, loss_mask=b.loss_mask,
                             num_loss_tokens=num_loss_tokens, docs=d, mtp=mtp[i] if mtp else None,
                             loss_scale=1.0 / m)
            if not forward_only:
                with backward_of(i, 0):
                    loss.backward()
            losses.append(loss.detach().double())
        return torch.stack(losses)

    batch, seq = microbatches[0].tokens.shape
    if config.parallel.sequence_parallel:
        seq //= groups.size("tp")
    chunks = [_Chunk(model, c, num_loss_tokens, forward_context, 1.0 / m) for c in range(len(model.stages))]
    # The schedule hands each chunk its micro-batch; the last stage's MTP targets go with it.
    index = {id(b): i for i, b in enumerate(microbatches)}

    def side_inputs(b: Batch) -> dict:
        return {"batch": b, "mtp": mtp[index[id(b)]] if mtp else None}

    width = model.boundary_width(microbatches[0].tokens.shape[1])
    losses = run_schedule(chunks, microbatches, groups, tensor_shape=(seq, batch, width),
                          dtype=next(model.parameters()).dtype, schedule=pipeline_schedule(config),
                          side_inputs=side_inputs, forward_only=forward_only,
                          backward_context=backward_of)
    if not forward_only and model.embedding_group is not None:
        all_reduce_embedding_grads(model.embed.weight, model.embedding_group)
        if grad_sync is not None:
            grad_sync.deferred_ready()
    return losses

"""How much of the expert-parallel all-to-all the MoE layer's overlap hides, per micro-batch.

What :class:`moe_fold.models.moe_layer.MoELayer` runs while the dispatcher's collectives are
in flight (``moe.shared_expert_overlap``, ``moe.overlap_chunks``), forward and backward:

- with ``c`` chunks, chunk i's expert GEMMs run while chunk i+1's dispatch and chunk i-1's
  combine are on the wire. All but the first dispatch and the last combine, ``(c-1)/c`` of
  the all-to-all time ``A``, can hide behind the GEMMs of ``c-1`` chunks, ``(c-1)/c`` of the
  expert time ``G``: exposed ``max(0, (A - G)(c-1)/c)``;
- the first dispatch and the last combine, ``A/c``, have only the shared expert beside them
  (fc1 under the dispatch, fc2 under the combine), shared-expert time ``S``: exposed
  ``max(0, A/c - S)`` with ``moe.shared_expert_overlap``, ``A/c`` without.

``A`` is the ``ep`` kind of :func:`moe_fold.planner.comm.microbatch_bytes` (dispatch and
combine, forward and backward) at the link speeds of :mod:`moe_fold.planner.estimate`; ``G``
and ``S`` are the stage's expert and shared-expert FLOPs (forward and backward, no
recompute) at the achieved matmul rate. The etp all-gather and reduce-scatter and the count
exchange stay exposed: the dispatcher runs them blocking (they depend on the all-to-all).
The model assumes that communication does not slow the compute it overlaps.
"""

from __future__ import annotations

from moe_fold.config import Config
from moe_fold.planner.model import dims, layer_forward_flops, stage_layers

__all__ = ["exposed_ep_seconds"]


def exposed_ep_seconds(config: Config, pp_rank: int, ep_seconds: float, flops_per_second: float) -> float:
    """Seconds of one micro-batch's ep all-to-all (``ep_seconds`` in all) left on the
    critical path of a rank of stage ``pp_rank`` under ``config.moe``'s overlap switches."""
    moe, d, p = config.moe, dims(config), config.parallel
    tokens = config.train.micro_batch_size * d.seq / (p.tp * p.cp)  # per rank, as the planner's FLOPs
    experts = shared = 0.0
    for i in stage_layers(config, pp_rank):
        if d.moe_flags[i]:
            parts = layer_forward_flops(config, i)
            experts += 3 * tokens * parts["experts"] / flops_per_second  # forward + backward
            shared += 3 * tokens * parts["shared"] / flops_per_second
    c = moe.overlap_chunks
    middle = max(0.0, (ep_seconds - experts) * (c - 1) / c)
    edge = ep_seconds / c
    if moe.shared_expert_overlap:
        edge = max(0.0, edge - shared)
    return middle + edge

"""Router losses (Megatron-Core's math) and the autograd op that attaches them.

- :func:`aux_loss_scores`: the per-expert scores a load-balancing loss uses: softmax over
  all experts, or sigmoid normalised to sum 1 over all experts;
- :func:`load_balancing_loss`: Switch loss ``E / (k T^2) * sum_i P_i c_i`` (``P_i`` the
  summed scores of expert i, ``c_i`` its routed-token count), per sequence when given
  sequence ids (then averaged over sequences);
- :func:`z_loss`: mean over tokens of ``logsumexp(logits)^2``;
- :func:`attach_loss`: identity on a tensor whose backward also sends ``scale`` as the
  gradient of a loss, so the loss reaches the parameters without being added to the model
  output or kept in a module-level list (which breaks under pipeline schedules).

Under sequence or context parallelism a rank holds a slice of the tokens: pass its own
scores with counts and token totals summed over the ranks sharing the batch. The rank's
value is then its share, and the shares sum to the whole batch's loss.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

__all__ = ["aux_loss_scores", "load_balancing_loss", "z_loss", "attach_loss"]


def aux_loss_scores(logits: torch.Tensor, score: str = "softmax") -> torch.Tensor:
    """``[T, E]`` scores over all experts for the load-balancing loss (at least float32)."""
    work = logits if logits.dtype == torch.float64 else logits.float()
    if score == "softmax":
        return torch.softmax(work, dim=-1)
    if score == "sigmoid":
        s = torch.sigmoid(work)
        return s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    raise ValueError(f"score={score!r} is not a known score function; use 'softmax' or 'sigmoid'")


def load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    num_tokens: Union[int, float, torch.Tensor],
    topk: int,
    *,
    seq_ids: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Switch load-balancing loss ``E * sum_i f_i * P_i`` with ``f_i = c_i / (k T)`` and
    ``P_i = sum_x scores[x, i] / T``.

    Without ``seq_ids``: ``tokens_per_expert [E]`` and ``num_tokens`` (a number) describe the
    batch. With ``seq_ids [T]`` (each token's sequence, in ``[0, S)``): ``tokens_per_expert
    [S, E]`` and ``num_tokens [S]`` describe each sequence, and the result is the mean over
    the S sequences of each sequence's loss (a sequence without tokens adds 0).
    ``loss_mask [T]`` (True = real token) zeroes the scores of padding; counts and totals
    passed in must already leave padding out. No coefficient is applied.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [tokens, experts], got shape {tuple(scores.shape)}")
    num_experts = scores.shape[1]
    if not isinstance(topk, int) or not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk!r} must be an int with 1 <= topk <= num_experts={num_experts}")
    if loss_mask is not None:
        if tuple(loss_mask.shape) != (scores.shape[0],):
            raise ValueError(f"loss_mask must have shape ({scores.shape[0]},), got {tuple(loss_mask.shape)}")
        scores = scores * loss_mask.unsqueeze(1).to(scores.dtype)
    num_tokens = torch.as_tensor(num_tokens, dtype=scores.dtype, device=scores.device)
    counts = tokens_per_expert.to(scores.dtype)
    if seq_ids is None:
        if tuple(counts.shape) != (num_experts,):
            raise ValueError(f"tokens_per_expert must have shape ({num_experts},), got {tuple(counts.shape)}")
        return (scores.sum(dim=0) * counts).sum() * num_experts / (topk * num_tokens.clamp(min=1) ** 2)
    if tuple(seq_ids.shape) != (scores.shape[0],):
        raise ValueError(f"seq_ids must have shape ({scores.shape[0]},), got {tuple(seq_ids.shape)}")
    if counts.dim() != 2 or counts.shape[1] != num_experts or tuple(num_tokens.shape) != (counts.shape[0],):
        raise ValueError(f"with seq_ids, tokens_per_expert must be [S, {num_experts}] and num_tokens [S], "
                         f"got {tuple(counts.shape)} and {tuple(num_tokens.shape)}")
    # [T, E] -> [S, E]
    seq_scores = torch.zeros_like(counts).index_add(0, seq_ids, scores)
    per_seq = (seq_scores * counts).sum(dim=1) * num_experts / (topk * num_tokens.clamp(min=1) ** 2)
    return per_seq.mean()


def z_loss(
    logits: torch.Tensor,
    loss_mask: Optional[torch.Tensor] = None,
    num_tokens: Optional[Union[int, float, torch.Tensor]] = None,
) -> torch.Tensor:
    """``sum over real tokens of logsumexp(logits)^2 / num_tokens`` (ST-MoE router z-loss).

    ``num_tokens`` defaults to the number of real tokens here (the mean); a rank holding a
    slice of the batch passes the batch's total to get its share.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    work = logits if logits.dtype == torch.float64 else logits.float()
    sq = torch.logsumexp(work, dim=-1) ** 2
    if loss_mask is not None:
        if tuple(loss_mask.shape) != (logits.shape[0],):
            raise ValueError(f"loss_mask must have shape ({logits.shape[0]},), got {tuple(loss_mask.shape)}")
        sq = sq * loss_mask.to(sq.dtype)
    if num_tokens is None:
        num_tokens = loss_mask.sum() if loss_mask is not None else logits.shape[0]
    if isinstance(num_tokens, torch.Tensor):
        return sq.sum() / num_tokens.to(sq.dtype).clamp(min=1)
    # A Python number divides as it is: copying it to a GPU first would block the host.
    return sq.sum() / max(num_tokens, 1)


class _AttachLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, loss, scale):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """Return ``x`` unchanged; when the backward reaches it, ``loss`` is back-propagated too,
    with gradient ``scale`` (the loss coefficient times the factor the main loss gets, e.g.
    1/num_microbatches). ``loss`` must be a scalar computed from ``x``'s inputs."""
    if loss.dim() != 0:
        raise ValueError(f"loss must be a scalar, got shape {tuple(loss.shape)}")
    return _AttachLoss.apply(x, loss, float(scale))

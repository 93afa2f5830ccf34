"""Mamba2's state-space dual (SSD, Dao and Gu 2024) computed chunk by chunk in torch, with
state resets at document boundaries.

Notation (one head): state ``S [N, P]``; per token t an input ``x_t [P]`` (already times
its step ``dt_t``), a log-decay ``g_t = dt_t A <= 0``, and ``b_t``, ``c_t [N]`` (Mamba2's B
and C, shared by the heads of a group). The recurrence, token by token::

    S_t = exp(g_t) S_{t-1} + b_t x_t^T,    y_t = S_t^T c_t

Chunked form: inside a chunk of C tokens with start state S0 and G_t the cumulative sum
of g from the chunk start::

    Y   = exp(G) C S0 + (C B^T * D) X          D[t, j] = exp(G_t - G_j), j <= t
    S_C = exp(G_C) S0 + (B * exp(G_C - G))^T X

The state's update is affine in the start state, ``S_end = a S_start + W`` with a scalar
``a`` per head, which is what context parallelism composes
(:mod:`moe_fold.parallel.recurrent_cp`). A document start at token t (``resets``)
zeroes the state before t's update: every ``exp(G_t - G_j)`` with a start in (j, t] and
every carry of S0 past a start become 0, so the chunked result equals the recurrence run
on each document alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .gated_delta import chunk_reach


def chunk_ssd(x: torch.Tensor, g: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              resets: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
              chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, H, S, P]`` (times dt), ``g [B, H, S]`` (log-decays), ``b, c [B, H, S, N]``
    (float32 or float64); ``resets`` bool ``[B, S]``: a document starts at this token
    (None: none); ``initial_state [B, H, N, P]`` (None: zeros; a reset at token 0 discards
    it). Returns ``(y [B, H, S, P], final_state [B, H, N, P])``, without Mamba2's D skip."""
    Bsz, H, S, P = x.shape
    N = b.shape[-1]
    C = chunk_size
    n = -(-S // C)
    pad = n * C - S
    if pad:
        # Padded tokens write nothing (x = 0) and do not decay (g = 0).
        x, b, c = (F.pad(t, (0, 0, 0, pad)) for t in (x, b, c))
        g = F.pad(g, (0, pad))
        if resets is not None:
            resets = F.pad(resets, (0, pad))
    x, b, c = (t.reshape(Bsz, H, n, C, -1) for t in (x, b, c))  # [B, H, n, C, d]
    G = g.reshape(Bsz, H, n, C).cumsum(-1)  # [B, H, n, C]
    same, carry = chunk_reach(resets, Bsz, n, C, x.device)
    # exp(G_t - G_j) where it is reachable, 0 elsewhere (masked before exp: no inf * 0).
    D = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~same, float("-inf")).exp()  # [B, H, n, C, C]
    decay_in = G.exp() * carry  # [B, H, n, C]: exp(G_t), or 0 past a start
    decay_out = (G[..., -1:] - G).masked_fill(~same[..., -1, :], float("-inf")).exp()  # [B, H, n, C]

    y_intra = ((c @ b.transpose(-1, -2)) * D) @ x  # [B, H, n, C, P]
    writes = (decay_out.unsqueeze(-1) * b).transpose(-1, -2) @ x  # [B, H, n, N, P]
    c_in = decay_in.unsqueeze(-1) * c  # [B, H, n, C, N]
    state_decay = decay_in[..., -1]  # [B, H, n]: exp(G_C), 0 if the chunk holds a start

    state = x.new_zeros(Bsz, H, N, P) if initial_state is None else initial_state.to(x.dtype)
    outs = []
    for k in range(n):
        outs.append(y_intra[:, :, k] + c_in[:, :, k] @ state)
        state = state_decay[:, :, k, None, None] * state + writes[:, :, k]
    y = torch.stack(outs, dim=2).reshape(Bsz, H, n * C, P)[:, :, :S]
    return y, state


def ssd_decay(g: torch.Tensor, resets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The factor ``a`` of ``S_end = a S_start + W`` over a whole segment: ``g [B, H, S]``
    -> ``[B, H]``, ``exp(sum g)``, or 0 when a document starts in the segment."""
    a = g.sum(-1).exp()
    if resets is None:
        return a
    return a * (~resets.any(-1)).to(a.dtype).unsqueeze(-1)

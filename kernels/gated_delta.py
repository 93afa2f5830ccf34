"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3-Next's linear attention)
computed chunk by chunk in torch, and the depthwise causal conv1d in front of it, both
with state resets at document boundaries.

Notation (one head): state ``S [dk, dv]``; per token t a key ``k_t`` and query ``q_t``
``[dk]``, a value ``v_t [dv]``, a log-decay ``g_t <= 0`` and a write strength ``b_t``.
The recurrence, token by token::

    S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t

Chunked form (the WY representation): inside a chunk of C tokens with start state S0
and G_t the cumulative sum of g from the chunk start, write the update as
``S_t = exp(g_t) S_{t-1} + k_t u_t^T``. The corrections U ``[C, dv]`` solve a unit lower
triangular system, ``(I + L) U = b (V - exp(G) K S0)`` with
``L[t, j] = b_t exp(G_t - G_j) k_t.k_j`` (j < t); then::

    O   = exp(G) Q S0 + (Q K^T * D) U            D[t, j] = exp(G_t - G_j), j <= t
    S_C = exp(G_C) S0 + (K * exp(G_C - G))^T U

A document start at token t (``resets``) zeroes the state before t's update: every
``exp(G_t - G_j)`` with a start in (j, t] and every carry of S0 past a start become 0.
So the chunked result equals the recurrence run on each document alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, resets: Optional[torch.Tensor] = None,
                           initial_state: Optional[torch.Tensor] = None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k [B, H, S, dk]``, ``v [B, H, S, dv]``, ``g, beta [B, H, S]`` (float32 or
    float64; q and k as the recurrence reads them, already normalised and scaled);
    ``resets`` bool ``[B, S]``: a document starts at this token (None: none);
    ``initial_state [B, H, dk, dv]`` (None: zeros; a reset at token 0 discards it).
    Returns ``(o [B, H, S, dv], final_state [B, H, dk, dv])``."""
    B, H, S, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    n = -(-S // C)
    pad = n * C - S
    if pad:
        # Padded tokens write nothing (k = v = beta = 0) and do not decay (g = 0).
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        if resets is not None:
            resets = F.pad(resets, (0, pad))
    q, k, v = (t.reshape(B, H, n, C, -1) for t in (q, k, v))  # [B, H, n, C, d]
    g, beta = g.reshape(B, H, n, C), beta.reshape(B, H, n, C)
    G = g.cumsum(-1)  # [B, H, n, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= t
    if resets is None:
        same = causal.expand(B, 1, n, C, C)
        carry = torch.ones(B, 1, n, C, dtype=torch.bool, device=q.device)  # S0 reaches token t
    else:
        starts = resets.reshape(B, 1, n, C).to(torch.int64).cumsum(-1)  # starts in [chunk start, t]
        same = (starts.unsqueeze(-1) == starts.unsqueeze(-2)) & causal  # no start in (j, t]
        carry = starts == 0
    # exp(G_t - G_j) where it is reachable, 0 elsewhere (masked before exp: no inf * 0).
    diff = (G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~same, float("-inf"))
    D = diff.exp()  # [B, H, n, C, C]
    decay_in = G.exp() * carry  # [B, H, n, C]: exp(G_t), or 0 past a start
    decay_out = (G[..., -1:] - G).masked_fill(~same[..., -1, :], float("-inf")).exp()  # [B, H, n, C]

    kk = k @ k.transpose(-1, -2)  # [B, H, n, C, C]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    lower = eye + (beta.unsqueeze(-1) * kk * D).tril(-1)
    # Per chunk: U = Uv - W S0, from one triangular solve of the two right-hand sides.
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * decay_in).unsqueeze(-1) * k], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    Uv, W = solved.split([dv, dk], dim=-1)  # [B, H, n, C, dv], [B, H, n, C, dk]
    qk = (q @ k.transpose(-1, -2)) * D  # [B, H, n, C, C]
    q_in = decay_in.unsqueeze(-1) * q  # [B, H, n, C, dk]
    k_out = decay_out.unsqueeze(-1) * k  # [B, H, n, C, dk]
    state_decay = decay_in[..., -1]  # [B, H, n]: exp(G_C), 0 if the chunk holds a start

    state = q.new_zeros(B, H, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for c in range(n):
        u = Uv[:, :, c] - W[:, :, c] @ state  # [B, H, C, dv]
        outs.append(q_in[:, :, c] @ state + qk[:, :, c] @ u)
        state = state_decay[:, :, c, None, None] * state + k_out[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(B, H, n * C, dv)[:, :, :S]
    return o, state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, history: Optional[torch.Tensor] = None,
                  doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depthwise causal convolution over the sequence: ``out[t] = sum_i weight[:, i] *
    x[t - (K-1) + i]``, a token reading only earlier tokens of its own document.

    ``x [S, B, C]``; ``weight [C, K]``; ``history [K-1, B, C]``: the K-1 tokens before
    ``x`` (None: zeros, the sequence starts here); ``doc_ids [B, K-1+S]``: the documents
    of ``history`` and ``x`` tokens (None: one document)."""
    K = weight.shape[1]
    if history is None:
        history = x.new_zeros(K - 1, *x.shape[1:])
    full = torch.cat([history, x], dim=0)  # [K-1+S, B, C]
    S = x.shape[0]
    out = x.new_zeros(x.shape)
    for shift in range(K):  # tap K-1-shift reads the token `shift` back
        term = full[K - 1 - shift:K - 1 - shift + S] * weight[:, K - 1 - shift]
        if doc_ids is not None and shift:
            same = (doc_ids[:, K - 1 - shift:K - 1 - shift + S] == doc_ids[:, K - 1:]).t()  # [S, B]
            term = term * same.unsqueeze(-1).to(term.dtype)
        out = out + term
    return out

"""The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3-Next's linear attention)
and its per-channel form (Kimi Delta Attention, KDA; Kimi-Linear) computed chunk by chunk
in torch, and the depthwise causal conv1d in front of them, all with state resets at
document boundaries.

Notation (one head): state ``S [dk, dv]``; per token t a key ``k_t`` and query ``q_t``
``[dk]``, a value ``v_t [dv]``, a log-decay ``g_t <= 0`` and a write strength ``b_t``.
The decay is one number per head and token (Gated DeltaNet) or one per key channel,
``g_t [dk]`` (KDA), decaying row c of the state by ``exp(g_t[c])``; write
``a_t = diag(exp(g_t))`` (a scalar times I in the first case). The recurrence, token by
token::

    S_t = (I - b_t k_t k_t^T) a_t S_{t-1} + b_t k_t v_t^T,    o_t = S_t^T q_t

(for a scalar decay ``a_t`` commutes and this is ``exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + ...``).

Chunked form (the WY representation): inside a chunk of C tokens with start state S0
and G_t the cumulative sum of g from the chunk start, write the update as
``S_t = a_t S_{t-1} + k_t u_t^T``. The corrections U ``[C, dv]`` solve a unit lower
triangular system, ``(I + L) U = b (V - (exp(G) * K) S0)`` with
``L[t, j] = b_t <k_t, k_j>_D`` (j < t), where ``<x_t, y_j>_D = sum_c x_t[c] y_j[c]
exp(G_t[c] - G_j[c])`` (for a scalar decay ``exp(G_t - G_j) x_t.y_j``); then::

    O   = (exp(G) * Q) S0 + <Q, K>_D U            (j <= t)
    S_C = exp(G_C) * S0 + (K * exp(G_C - G))^T U   (exp(G_C) scaling S0's rows)

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
    """``q, k [B, H, S, dk]``, ``v [B, H, S, dv]``, ``g`` ``[B, H, S]`` (a decay per head:
    Gated DeltaNet) or ``[B, H, S, dk]`` (per key channel: KDA), ``beta [B, H, S]`` (float32
    or float64; q and k as the recurrence reads them, already normalised and scaled);
    ``resets`` bool ``[B, S]``: a document starts at this token (None: none);
    ``initial_state [B, H, dk, dv]`` (None: zeros; a reset at token 0 discards it).
    Returns ``(o [B, H, S, dv], final_state [B, H, dk, dv])``."""
    B, H, S, dk = k.shape
    dv = v.shape[-1]
    C = chunk_size
    n = -(-S // C)
    pad = n * C - S
    g = g if g.dim() == 4 else g.unsqueeze(-1)  # [B, H, S, dk or 1]
    if pad:
        # Padded tokens write nothing (k = v = beta = 0) and do not decay (g = 0).
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
        if resets is not None:
            resets = F.pad(resets, (0, pad))
    q, k, v, g = (t.reshape(B, H, n, C, -1) for t in (q, k, v, g))  # [B, H, n, C, d]
    beta = beta.reshape(B, H, n, C)
    G = g.cumsum(-2)  # [B, H, n, C, dk or 1]
    same, carry = chunk_reach(resets, B, n, C, q.device)
    # exp(G_t - G_j) where it is reachable, 0 elsewhere (masked before exp: no inf * 0).
    diff = (G.unsqueeze(-2) - G.unsqueeze(-3)).masked_fill(~same.unsqueeze(-1), float("-inf"))
    D = diff.exp()  # [B, H, n, C, C, dk or 1]
    decay_in = G.exp() * carry.unsqueeze(-1)  # [B, H, n, C, dk or 1]: exp(G_t), or 0 past a start
    decay_out = (G[..., -1:, :] - G).masked_fill(~same[..., -1, :].unsqueeze(-1), float("-inf")).exp()

    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    lower = eye + (beta.unsqueeze(-1) * _decayed_products(k, k, D)).tril(-1)  # [B, H, n, C, C]
    # Per chunk: U = Uv - W S0, from one triangular solve of the two right-hand sides.
    rhs = torch.cat([beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * decay_in * k], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    Uv, W = solved.split([dv, dk], dim=-1)  # [B, H, n, C, dv], [B, H, n, C, dk]
    qk = _decayed_products(q, k, D)  # [B, H, n, C, C]
    q_in = decay_in * q  # [B, H, n, C, dk]
    k_out = decay_out * k  # [B, H, n, C, dk]
    state_decay = decay_in[..., -1, :].unsqueeze(-1)  # [B, H, n, dk or 1, 1]: exp(G_C), 0 if a start

    state = q.new_zeros(B, H, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for c in range(n):
        u = Uv[:, :, c] - W[:, :, c] @ state  # [B, H, C, dv]
        outs.append(q_in[:, :, c] @ state + qk[:, :, c] @ u)
        state = state_decay[:, :, c] * state + k_out[:, :, c].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(B, H, n * C, dv)[:, :, :S]
    return o, state


def chunk_reach(resets: Optional[torch.Tensor], batch: int, chunks: int, size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Within each of ``chunks`` chunks of ``size`` tokens: ``same [B, 1, n, C, C]``, token
    j's write reaches token t (j <= t, no document start in (j, t]), and ``carry [B, 1, n, C]``,
    the chunk's start state reaches token t (no start in [chunk start, t]). ``resets`` bool
    ``[B, n*C]`` marks document starts (None: one document)."""
    causal = torch.ones(size, size, dtype=torch.bool, device=device).tril()  # j <= t
    if resets is None:
        return (causal.expand(batch, 1, chunks, size, size),
                torch.ones(batch, 1, chunks, size, dtype=torch.bool, device=device))
    starts = resets.reshape(batch, 1, chunks, size).to(torch.int64).cumsum(-1)  # starts in [chunk start, t]
    return (starts.unsqueeze(-1) == starts.unsqueeze(-2)) & causal, starts == 0


def _decayed_products(a: torch.Tensor, b: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """``<a_t, b_j>_D = sum_c a_t[c] b_j[c] D[t, j, c]`` ``[.., C, C]`` for ``a, b [.., C, dk]``
    and ``D [.., C, C, dk or 1]``: one matmul under a per-head decay; a per-channel decay
    weighs each channel's product before the sum."""
    if D.shape[-1] == 1:
        return (a @ b.transpose(-1, -2)) * D.squeeze(-1)
    return (a.unsqueeze(-2) * b.unsqueeze(-3) * D).sum(-1)


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

"""Context parallelism (cp) for attention: the zigzag sequence layout and the two ways to
attend over a sequence split across the cp ranks (``parallel.cp_kind``).

Layout. A sequence of ``S`` tokens is cut into ``2*cp`` equal chunks; cp rank ``r`` holds
chunks ``r`` and ``2cp-1-r``, in that order (``S_local = S/cp``). Pairing an early chunk
with a late one gives every rank the same causal work. Data loading slices tokens and
rotary positions with :func:`zigzag_split` / :func:`zigzag_positions`; both kinds below
take this layout.

Kinds:

- ``ring`` (p2p, :mod:`moe_fold.parallel.ring_attention`): queries stay, K/V blocks travel the cp
  ring, partial outputs merge by log-sum-exp. Any head counts.
- ``a2a`` (Ulysses): all-to-all from sequence-sharded to head-sharded, full causal
  attention over the whole sequence for ``H/cp`` heads, all-to-all back. Needs ``Hq``
  divisible by cp. GQA: when ``Hkv`` is divisible by cp the kv heads are split like the
  query heads; otherwise each kv head is repeated ``cp / gcd(Hkv, cp)`` times (the fewest
  copies that split evenly; ``Hq`` divisible by cp guarantees the repeated count divides
  ``Hq``), e.g. Hq=6, Hkv=3 on cp 2, or Hq=4, Hkv=2 on cp 4. The repeats cost all-to-all
  bytes, not math; their grads sum back through autograd.

Packed documents (``doc_ids``, :mod:`moe_fold.parallel.varlen`): attention stays inside each
document. Every rank holds the ids of the whole sequence in natural order: the ring
derives each rank's shard of them locally and masks its blocks; a2a runs varlen attention
on the natural-order sequence it gathers; a group of one rank runs varlen attention.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from moe_fold.comm import Group, all_to_all, group_rank, group_size
from moe_fold.config import choices, require, sequence_over_cp
from moe_fold.parallel.document_attention import apply_sinks, masked_block_attention
from moe_fold.parallel.ring_attention import ring_attention
from moe_fold.parallel.varlen import sdpa, varlen_attention

__all__ = ["CP_KINDS", "zigzag_split", "zigzag_gather", "zigzag_positions",
           "a2a_kv_repeats", "context_parallel_attention", "local_masked_attention"]

CP_KINDS = choices("parallel.cp_kind")


# --------------------------------------------------------------------------- zigzag layout

def _check_cp(cp_rank: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} must be >= 1")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")


def zigzag_split(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """cp rank ``cp_rank``'s zigzag shard of ``x`` along ``dim`` (the sequence dim):
    chunks ``cp_rank`` and ``2*cp_size-1-cp_rank`` of ``2*cp_size``.
    ``[..., S, ...] -> [..., S/cp_size, ...]``; cp_size 1 returns ``x``.
    """
    _check_cp(cp_rank, cp_size)
    if cp_size == 1:
        return x
    require(sequence_over_cp, x.shape[dim], cp_size)
    n = 2 * cp_size
    chunks = x.chunk(n, dim)
    return torch.cat([chunks[cp_rank], chunks[n - 1 - cp_rank]], dim)


def zigzag_gather(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`zigzag_split`: every cp rank's shard, in cp-rank order, back to the
    sequence in natural order. ``cp x [..., S/cp, ...] -> [..., S, ...]``.
    """
    if not shards:
        raise ValueError("zigzag_gather: shards is empty; pass one shard per cp rank")
    if len(shards) == 1:
        return shards[0]
    halves = []
    for r, shard in enumerate(shards):
        if shard.shape[dim] % 2:
            raise ValueError(f"zigzag_gather: shards[{r}] has odd length {shard.shape[dim]} along "
                             f"dim {dim}; a zigzag shard is two equal chunks")
        halves.append(shard.chunk(2, dim))
    # Rank r's first chunk is chunk r, its second chunk 2cp-1-r: late chunks come in reverse.
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def zigzag_positions(seq_len: int, cp_rank: int, cp_size: int,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """Positions (int64 ``[seq_len/cp_size]``) of the tokens cp rank ``cp_rank`` holds, for
    rotary embeddings."""
    return zigzag_split(torch.arange(seq_len, device=device), cp_rank, cp_size, dim=0)


# --------------------------------------------------------------------------- a2a (Ulysses)

def a2a_kv_repeats(num_heads: int, num_kv_heads: int, cp: int) -> int:
    """How many times a2a repeats each kv head on a cp group of size ``cp`` (1: none).

    ``num_kv_heads * repeats = lcm(num_kv_heads, cp)``, which divides ``num_heads`` whenever
    ``num_heads`` is divisible by both cp and ``num_kv_heads``: then every rank's query
    heads map onto its own kv heads. Raises ValueError naming the rule otherwise.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} must be a multiple of kv heads {num_kv_heads} (GQA)")
    if num_heads % cp:
        raise ValueError(f"cp_kind='a2a': query heads {num_heads} must be divisible by cp={cp}")
    return cp // math.gcd(num_kv_heads, cp)


def _seq_to_heads(x: torch.Tensor, group: Group, cp: int) -> torch.Tensor:
    """Sequence-sharded (zigzag) -> head-sharded, natural order:
    ``[B, H, S/cp, D] -> [B, H/cp, S, D]``."""
    # Head block j goes to cp rank j; block j that comes back holds cp rank j's tokens
    # for this rank's heads.
    x = all_to_all(x.transpose(0, 1), None, None, group)  # [H, B, S/cp, D] -> [cp*H/cp, B, S/cp, D]
    return zigzag_gather(x.chunk(cp, 0), dim=2).transpose(0, 1)  # [H/cp, B, S, D] -> [B, H/cp, S, D]


def _heads_to_seq(y: torch.Tensor, group: Group, cp: int) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: ``[B, H/cp, S, D] -> [B, H, S/cp, D]``."""
    y = y.transpose(0, 1)  # [H/cp, B, S, D]
    # Block r: cp rank r's tokens of this rank's heads.
    y = torch.cat([zigzag_split(y, r, cp, dim=2) for r in range(cp)])  # [cp*H/cp, B, S/cp, D]
    # Block j back from cp rank j: the tokens of this rank for head block j, i.e. heads in order.
    return all_to_all(y, None, None, group).transpose(0, 1)  # [H, B, S/cp, D] -> [B, H, S/cp, D]


def _a2a_attention(q, k, v, group, causal, scale, doc_ids, window, sinks):
    cp = group_size(group)
    repeats = a2a_kv_repeats(q.shape[1], k.shape[1], cp)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, 1), v.repeat_interleave(repeats, 1)
    q, k, v = (_seq_to_heads(t, group, cp) for t in (q, k, v))  # [B, H/cp, S, D]
    if window or sinks is not None:
        # This rank holds query head block group_rank(group) (see _seq_to_heads).
        sinks = None if sinks is None else sinks.chunk(cp)[group_rank(group)]
        out = local_masked_attention(q, k, v, doc_ids, scale, window, sinks)
    elif doc_ids is not None:
        out = varlen_attention(q, k, v, doc_ids, scale)
    else:
        out = sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return _heads_to_seq(out, group, cp)


# --------------------------------------------------------------------------- entry point

def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [B, heads, S_local, head_dim]")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch, heads and sequence "
                         "(v's head_dim may differ: MLA)")
    b, hq, s, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, "
                         "sequence and head_dim")
    if hq % k.shape[1]:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {k.shape[1]} (GQA)")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, *,
                               kind: str = "ring", causal: bool = True,
                               scale: Optional[float] = None,
                               doc_ids: Optional[torch.Tensor] = None, window: int = 0,
                               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention over a sequence sharded across the cp ``group`` in the zigzag layout.

    q/k ``[B, Hq|Hkv, S_local, D]``, v ``[B, Hkv, S_local, Dv]`` (Hq a multiple of Hkv; query
    head h uses kv head ``h // (Hq/Hkv)``; ``Dv`` may differ from ``D``, as in MLA), each
    rank's zigzag shard; returns this rank's output ``[B, Hq, S_local, Dv]``, equal to its
    shard of full attention over the gathered sequence. ``kind``: ``"ring"`` or ``"a2a"`` (see the module doc). ``scale`` defaults to
    ``1/sqrt(D)``. ``group`` None or of size 1: plain SDPA on the local (whole) sequence.
    ``doc_ids`` int64 ``[B, S]`` (the whole sequence, natural order, the same on every cp
    rank): packed documents, attention causal inside each document only (needs causal).
    ``window`` (> 0, needs causal): a query sees only its last ``window`` keys (itself
    included); ``sinks [Hq]`` (the local query heads): attention sinks
    (:func:`moe_fold.parallel.document_attention.apply_sinks`). Both run on every kind.
    """
    if kind not in CP_KINDS:
        # An argument check of this function (the config's parallel.cp_kind is checked by
        # its rule when the model is built); a constant to the compiler.
        raise ValueError(f"context_parallel_attention: kind={kind!r} is not one of {', '.join(CP_KINDS)}")
    _check_qkv(q, k, v)
    cp = group_size(group)
    if doc_ids is not None:
        if not causal:
            raise ValueError("doc_ids (packed documents) needs causal=True")
        if tuple(doc_ids.shape) != (q.shape[0], q.shape[2] * cp):
            raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}; expected [B, S_local*cp] = "
                             f"{(q.shape[0], q.shape[2] * cp)}")
    if window and not causal:
        raise ValueError(f"window={window} (sliding window) needs causal=True")
    if cp == 1:
        if window or sinks is not None:
            return local_masked_attention(q, k, v, doc_ids, scale, window, sinks)
        if doc_ids is not None:
            return varlen_attention(q, k, v, doc_ids, scale)
        return sdpa(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if q.shape[2] % 2:
        raise ValueError(f"local sequence length {q.shape[2]} on cp rank {group_rank(group)} must be "
                         "even: a zigzag shard is two equal chunks (sequence divisible by 2*cp)")
    if kind == "ring":
        shards = None
        if doc_ids is not None:
            shards = torch.stack([zigzag_split(doc_ids, r, cp, dim=1)
                                  for r in range(cp)]).to(q.device)  # [cp, B, S_local]
        pos_shards = None
        if window or sinks is not None:
            pos_shards = torch.stack([zigzag_positions(q.shape[2] * cp, r, cp, device=q.device) for r in range(cp)])
        return ring_attention(q, k, v, group, causal=causal, scale=scale, doc_shards=shards, window=window,
                              sinks=sinks, pos_shards=pos_shards)
    return _a2a_attention(q, k, v, group, causal, scale, doc_ids, window, sinks)


def local_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: Optional[torch.Tensor],
                           scale: Optional[float], window: int, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Causal attention over a whole (natural order) sequence with a sliding window and/or
    sinks, inside documents when ``doc_ids [B, S]`` is given: one
    :func:`~moe_fold.parallel.document_attention.masked_block_attention` call, sinks applied
    through its differentiable log-sum-exp. q/k/v as in :func:`context_parallel_attention`
    with cp 1 -> ``[B, Hq, S, Dv]``."""
    positions = torch.arange(q.shape[2], device=q.device)
    out, lse = masked_block_attention(q, k, v, doc_ids, doc_ids, True, scale, pos_q=positions, pos_k=positions,
                                      window=window)
    if sinks is not None:
        out, _ = apply_sinks(out, lse, sinks)
    return out.to(q.dtype)

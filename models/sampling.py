"""Sampling from a model: greedy or temperature / top-k / top-p, with a KV cache (and the
recurrent state of Gated DeltaNet layers).

:func:`generate` runs the prompt once (prefill), then one token per step: attention reads
the cached keys and values of the tokens before (:mod:`.kv_cache`), and each MoE layer
routes the new tokens only. It works in any layout :func:`~moe_fold.models.model.build_model`
builds except context parallel:

- tp (with sequence parallel): every tp rank must hold a slice of the new tokens, so a
  step pads them to a multiple of tp. The padding comes after the real tokens, which
  causal attention never lets them see, and its cached keys and values are dropped after
  the step; a Gated DeltaNet layer keeps the conv window and state after the real tokens.
- ep, etp, dp replicas: every rank runs the same sequences; the dispatcher moves the
  tokens to the ranks that own their experts as in training.
- pp (and vpp): the stages run one after another, each sending its hidden states to the
  next one's rank.

One rank (the first tp/dp rank of the last stage) picks each token and broadcasts it,
so every rank continues the same sequences. The same seed gives the same tokens in every
layout (up to ties in float32 logits).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from moe_fold.comm import gather_from_tp_region, recv, send
from moe_fold.config import rotary_dim

from .kv_cache import KVCache
from .rotary import rotary_cos_sin, yarn_of

__all__ = ["next_token", "forward_cached", "generate"]


def next_token(logits: torch.Tensor, generator: Optional[torch.Generator] = None, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The next token of each row of ``logits [B, V]`` -> ``[B]``.

    ``temperature=0``: the most likely token (greedy). Otherwise a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens
    (0: all) and to the smallest set whose probability reaches ``top_p`` (1: all),
    computed in float64 so that the draw depends on the logits, not on rounding."""
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature={temperature} must be >= 0, top_k={top_k} >= 0 and top_p={top_p} in (0, 1]")
    if temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.double() / temperature  # [B, V]
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1:
        probs, order = scores.softmax(dim=-1).sort(dim=-1, descending=True)  # [B, V]
        # A token stays when the tokens more likely than it hold less than top_p.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _pp_peer(model, stage: int) -> int:
    """The global rank of this rank's pipeline group that holds virtual stage ``stage``."""
    pp_ranks = model.groups.ranks("pp")
    return pp_ranks[stage % len(pp_ranks)]


@torch.no_grad()
def forward_cached(model, ids: torch.Tensor, cache: KVCache) -> Optional[torch.Tensor]:
    """Run the new tokens ``ids [B, n]`` after the ``cache.length`` cached ones and add
    them to ``cache``. Returns their full-vocab logits ``[B, n, V]`` on the ranks of the
    last pipeline stage, None on the others. Every rank of the model calls it."""
    groups, config = model.groups, model.config
    if groups.size("cp") > 1:
        raise ValueError(f"parallel.cp={groups.size('cp')}: sampling runs without context parallel")
    batch, n = ids.shape
    tp = groups.size("tp") if config.parallel.sequence_parallel else 1
    padded = -(-n // tp) * tp
    ids = torch.nn.functional.pad(ids, (0, padded - n), value=0)  # [B, n_pad]
    start = cache.length
    cache.begin(n)
    dtype = next(model.parameters()).dtype
    positions = torch.arange(start, start + padded, device=ids.device)
    cos, sin = rotary_cos_sin(positions, rotary_dim(config), config.model.rope_theta, dtype,
                              yarn_of(config.model))  # [n_pad, rotary dims]
    x = None
    last = model.num_stages - 1
    for stage in range(model.num_stages):
        if stage not in model.stages:
            continue
        chunk = model.stages.index(stage)
        if stage == 0:
            x = model.embed(ids.t())  # [n_pad/tp, B, H]
        else:
            x = recv((padded // tp, batch, config.model.hidden_size), dtype, _pp_peer(model, stage - 1),
                     device=ids.device)
        selections: dict = {}  # DSA: each full layer's selection, for the shared layers after it
        for i in model.stage_layer_ids[chunk]:
            x = model.layers[i](x, cos, sin, kv_cache=cache[i], positions=positions, selections=selections)
        if stage < last:
            send(x, _pp_peer(model, stage + 1))
    cache.truncate(start + n)
    if last not in model.stages:
        return None
    logits = model.lm_head(model.norm(x))  # [n_pad, B, V/tp]
    return gather_from_tp_region(logits, groups.tp, dim=-1).transpose(0, 1)[:, :n]  # [B, n, V]


def _token_source(model) -> int:
    """The global rank that picks the tokens: the first rank holding the last stage."""
    return model.groups.layout.groups("pp")[0][-1]


@torch.no_grad()
def generate(model, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop_id: Optional[int] = None, vocab_limit: Optional[int] = None,
             on_token: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
    """The tokens that follow ``prompt [B, n]`` -> ``[B, m]``, ``m <= max_new_tokens``.

    Every rank of the model calls it with the same arguments and gets the same tokens.
    ``stop_id``: a row that produces it stops (its later positions repeat ``stop_id``);
    generation ends when every row has. ``vocab_limit``: tokens from that id on (the
    vocabulary's padding to a multiple of tp) are never picked. ``on_token(tokens [B])``
    is called after each step (streaming)."""
    model.eval()
    cache = KVCache([i for ids in model.stage_layer_ids for i in ids])
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    world = model.groups.layout.world_size
    source = _token_source(model)
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    new, out = prompt, []
    for _ in range(max_new_tokens):
        logits = forward_cached(model, new, cache)
        token = torch.empty(prompt.shape[0], dtype=torch.long, device=prompt.device)
        if model.groups.rank == source:
            last = logits[:, -1]  # [B, V]
            if vocab_limit is not None:
                last = last[:, :vocab_limit]
            token = next_token(last, generator, temperature, top_k, top_p)
        if world > 1:
            dist.broadcast(token, source)
        if stop_id is not None:
            token = token.masked_fill(done, stop_id)
            done |= token == stop_id
        out.append(token)
        if on_token is not None:
            on_token(token)
        if bool(done.all()):
            break
        new = token[:, None]  # [B, 1]
    return torch.stack(out, dim=1) if out else prompt.new_empty((prompt.shape[0], 0))

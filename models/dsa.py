"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2 report, GLM-5): multi-head latent attention
whose every query attends only to the ``index_topk`` keys a lightning indexer scores highest.

The lightning indexer of a layer, per query token ``t`` and key token ``s``
(transformers' ``DeepseekV32Indexer``):

- ``n = index_n_heads`` query heads ``q_t,j = W_q c_t`` of width ``d = index_head_dim`` read
  MLA's normed query latent ``c_t``; one key ``k_s = LayerNorm(W_k x_s)`` (with a bias,
  eps 1e-6) reads the attention's input ``x_s``;
- rotary on the first ``qk_rope_head_dim`` dims of ``q`` and ``k`` (the MLA's cos/sin), as two
  halves (DeepSeek-V3.2) or interleaved pairs (``index_rope_interleave``, GLM-5);
- head weights ``w_t = W_w x_t * n^-1/2``; the score
  ``I_ts = sum_j w_t,j * relu(q_t,j . k_s * d^-1/2)``.

Each query keeps the ``index_topk`` causally visible keys of highest score (all of them
while it sees fewer), and MLA's softmax runs over those only. A GLM-5 ``shared`` layer
(``model.indexer_types``) has no indexer: it reuses the selection of the nearest full
layer before it, which travels in the forward's ``selections`` dict.

Training (``model.dsa_stage``, the DeepSeek-V3.2 report's two stages). The indexer's
inputs are detached and its selection is an index set, so the LM loss gives it no
gradient, and its KL loss gives the rest of the model none:

- ``dense_warmup``: MLA attends densely (causally); the indexer's softmax over the
  visible keys is pulled towards the main attention's distribution, summed over heads
  and L1-normalised, by ``KL(target || softmax(I))``;
- ``sparse``: MLA attends over the selected keys; the KL is over the selected keys only.

The KL (mean over the micro-batch's real queries: padding tokens, ``Documents.token_mask``,
train nothing) rides on the attention output through autograd
(:func:`~moe_fold.dispatch.aux_losses.attach_loss`) with weight
``dsa_indexer_loss_weight``; :class:`IndexerKL` returns its value for the step metrics.

Parallel: heads split over tp as in MLA. The indexer is replicated over tp: under SP its
detached inputs are gathered over tp, so every tp rank scores every query of its cp shard
(the indexer's grads are equal on the tp ranks) and the KL's target sums the heads of all
tp ranks (an all-reduce). Under cp a rank's queries select among every causally visible
key of the whole sequence: the indexer keys and MLA's keys and values are all-gathered over
cp (whatever ``parallel.cp_kind``) and put back in sequence order, and each rank attends its
zigzag queries to them. Under dynamic cp (``parallel.dynamic_cp``) the same runs over the
sub-group that holds the rank's documents (``Documents.cp_group``), and the KL of each rank is
its real queries' sum over the micro-batch's real queries on the whole cp group (its count is
an all-reduce), so the KL averaged over cp is one process's whatever the shards hold.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from moe_fold.comm import Group, all_gather, all_reduce_, gather_from_sequence_region, group_rank, group_size
from moe_fold.config import ModelConfig
from moe_fold.dispatch.aux_losses import attach_loss
from moe_fold.parallel.context_parallel import zigzag_gather, zigzag_positions, zigzag_split
from moe_fold.parallel.tensor_parallel import global_normal, init_seed, mark
from moe_fold.parallel.varlen import Documents

from .kv_cache import LayerCache
from .mla import MLAttention
from .rotary import apply_rotary, deinterleave

__all__ = ["LightningIndexer", "IndexerKL", "DSAttention", "select_topk", "visible_keys", "indexer_kl"]


class LightningIndexer(nn.Module):
    """The indexer's weights and its score ``I [B, S_q, S_k]`` (see the module docstring).

    Parameters: ``wq.weight [n*d, q_lora_rank]``, ``wk.weight [d, H]``, ``k_norm.weight``
    and ``k_norm.bias [d]``, ``weights_proj.weight [n, H]``; all replicated over tp."""

    def __init__(self, config: ModelConfig, *, seed: int, name: str):
        super().__init__()
        self.n_heads, self.head_dim, self.rope = config.index_n_heads, config.index_head_dim, config.qk_rope_head_dim
        self.interleave = config.index_rope_interleave
        std, hidden = config.init_std, config.hidden_size

        def linear(part: str, out: int, inp: int) -> nn.Linear:
            layer = nn.Linear(inp, out, bias=False)
            layer.weight = mark(nn.Parameter(global_normal((out, inp), std, init_seed(seed, f"{name}.{part}"))),
                                "replicated")
            return layer

        self.wq = linear("wq", self.n_heads * self.head_dim, config.q_lora_rank)
        self.wk = linear("wk", self.head_dim, hidden)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        mark(self.k_norm.weight, "replicated")
        mark(self.k_norm.bias, "replicated")
        self.weights_proj = linear("weights_proj", self.n_heads, hidden)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary on the first ``rope`` dims of ``x [B, heads, S, d]``."""
        rot, rest = x.split([self.rope, self.head_dim - self.rope], dim=-1)
        if self.interleave:
            rot = deinterleave(rot)
        return torch.cat([apply_rotary(rot, cos, sin), rest], dim=-1)

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [S, B, H]``, ``q_latent [S, B, q_lora]`` -> queries ``[B, S, n, d]`` and head
        weights ``[B, S, n]``."""
        S, B = x.shape[:2]
        q = self.wq(q_latent).view(S, B, self.n_heads, self.head_dim).permute(1, 2, 0, 3)  # [B, n, S, d]
        q = self._rotate(q, cos, sin).transpose(1, 2)  # [B, S, n, d]
        weights = self.weights_proj(x).transpose(0, 1) * self.n_heads ** -0.5  # [B, S, n]
        return q, weights

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [S, B, H]`` -> keys ``[B, S, d]``."""
        k = self.k_norm(self.wk(x)).transpose(0, 1).unsqueeze(1)  # [B, 1, S, d]
        return self._rotate(k, cos, sin).squeeze(1)

    def scores(self, q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``q [B, S_q, n, d]``, ``weights [B, S_q, n]``, ``k [B, S_k, d]`` -> ``I [B, S_q, S_k]``
        (float32 at least)."""
        work = torch.promote_types(q.dtype, torch.float32)
        per_head = torch.matmul(q.to(work), k.to(work).transpose(-1, -2).unsqueeze(1)) * self.head_dim ** -0.5
        per_head = F.relu(per_head)  # [B, S_q, n, S_k]
        return torch.matmul(weights.to(work).unsqueeze(-2), per_head).squeeze(-2)


def visible_keys(pos_q: torch.Tensor, pos_k: torch.Tensor, doc_q: Optional[torch.Tensor],
                 doc_k: Optional[torch.Tensor]) -> torch.Tensor:
    """bool ``[B or 1, S_q, S_k]``: key ``s`` is causally visible to query ``t`` (sequence
    indices ``pos_q [S_q]``, ``pos_k [S_k]``), inside its document when ``doc_q [B, S_q]``
    and ``doc_k [B, S_k]`` are given."""
    allowed = (pos_k[None, :] <= pos_q[:, None]).unsqueeze(0)
    if doc_q is not None:
        allowed = allowed & (doc_q[:, :, None] == doc_k[:, None, :])
    return allowed


def select_topk(scores: torch.Tensor, allowed: torch.Tensor, topk: int) -> torch.Tensor:
    """bool ``[B, S_q, S_k]``: the ``topk`` visible keys of highest score per query (every
    visible key when a query sees fewer). Equal scores (relu makes exact zeros common) go to
    the earlier key: a stable sort, so a query selects the same keys whatever else is in its
    batch (a cached decode step, another cp split) where ``topk``'s order among ties is open."""
    masked = scores.detach().masked_fill(~allowed, float("-inf"))
    order = masked.sort(dim=-1, descending=True, stable=True).indices
    top = order[..., :min(topk, masked.shape[-1])]  # [B, S_q, k]
    chosen = torch.zeros(masked.shape, dtype=torch.bool, device=masked.device).scatter_(-1, top, True)
    return chosen & allowed


def indexer_kl(target: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
               real: Optional[torch.Tensor] = None, count: Union[float, torch.Tensor, None] = None) -> torch.Tensor:
    """``KL(target_t || softmax(scores_t over mask_t))`` summed over the real queries ``t``
    (``real [B, S_q]`` bool; None: all) and divided by ``count`` (None: the number of
    queries, the mean); ``target`` ``[B, S_q, S_k]`` sums to 1 over each query's masked keys
    and is 0 elsewhere."""
    log_q = torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    terms = torch.where(mask, torch.xlogy(target, target) - target * log_q.masked_fill(~mask, 0.0),
                        torch.zeros_like(target)).sum(-1)  # [B, S_q]
    if real is not None:
        terms = terms.masked_fill(~real, 0.0)
    return terms.sum() / (terms.numel() if count is None else count)


class IndexerKL(nn.Module):
    """The indexer's KL loss of one layer (:func:`indexer_kl`); a module so that the step
    metrics read its value by a forward hook."""

    def forward(self, target: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                real: Optional[torch.Tensor] = None, count: Union[float, torch.Tensor, None] = None) -> torch.Tensor:
        return indexer_kl(target, scores, mask, real, count)


class DSAttention(MLAttention):
    """MLA with DSA (the module docstring), with :class:`MLAttention`'s constructor plus
    ``layer`` (this layer's index) and forward plus ``selections`` (the selection of every
    full layer run so far in this forward, by layer index) and ``loss_scale`` (this
    micro-batch's share of the step, as the routers get it)."""

    def __init__(self, config: ModelConfig, tp_group: Group, sequence_parallel: bool, *, seed: int, name: str,
                 layer: int, cp_group: Group = None, cp_kind: str = "ring"):
        super().__init__(config, tp_group, sequence_parallel, seed=seed, name=name, cp_group=cp_group,
                         cp_kind=cp_kind, layer=layer)
        types = config.indexer_types
        shared = types is not None and layer < len(types) and types[layer] == "shared"
        self.layer = layer
        # The full layer whose selection a shared layer reuses (its nearest full layer before it).
        self.source = max(i for i in range(layer) if types[i] == "full") if shared else layer
        self.indexer = None if shared else LightningIndexer(config, seed=seed, name=f"{name}.indexer")
        self.sparse = config.dsa_stage == "sparse"
        self.topk = config.index_topk
        self.loss_weight = config.dsa_indexer_loss_weight if not shared else 0.0
        self.kl = IndexerKL()

    def _indexer_inputs(self, x: torch.Tensor, q_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's inputs over the whole (cp-local) sequence, detached: the LM loss
        reaches neither through the indexer."""
        x, q_latent = x.detach(), q_latent.detach()
        if self.sequence_parallel:
            x = gather_from_sequence_region(x, self.tp_group, dim=0)  # [S/tp, B, H] -> [S, B, H]
            q_latent = gather_from_sequence_region(q_latent, self.tp_group, dim=0)
        return x, q_latent

    def _real_queries(self, docs: Optional[Documents],
                      batch: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The KL's real queries ``[B, S]`` (None: all) and its divisor: the real queries of
        the micro-batch over the whole ``parallel.cp`` group divided by its size, so that the
        KL averaged over cp (as the gradients are) is the micro-batch's mean over its real
        queries, whatever each rank holds (padding; dynamic cp's unequal shards)."""
        if docs is None or docs.token_mask is None:
            return None, None
        real = docs.token_mask.view(-1, batch).float()  # [S_local(/tp), B]
        if self.sequence_parallel:
            real = gather_from_sequence_region(real, self.tp_group, dim=0)  # [S, B]
        count = real.sum()
        all_reduce_(count, self.cp_group)
        return real.t() > 0, count.clamp(min=1) / group_size(self.cp_group)

    @staticmethod
    def _gather_cp(t: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
        """This rank's zigzag shard along ``dim`` -> the whole sequence of ``group`` in order
        (autograd: the backward returns each rank the grads of its own tokens)."""
        cp = group_size(group)
        if cp == 1:
            return t
        return zigzag_gather(all_gather(t, group, dim=dim).chunk(cp, dim=dim), dim=dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Documents] = None, kv_cache: Optional[LayerCache] = None,
                selections: Optional[dict] = None, loss_scale: float = 1.0) -> torch.Tensor:
        """``x [S_local, B, H]`` -> ``[S_local, B, H]`` (as :meth:`MLAttention.forward`)."""
        q, k, v, q_latent = self.project(x, cos, sin)  # [B, heads, S, *]
        S = q.shape[2]
        index_q = index_w = index_k = None
        if self.indexer is not None:
            ix, iq = self._indexer_inputs(x, q_latent)
            index_q, index_w = self.indexer.queries(ix, iq, cos, sin)  # [B, S, n, d], [B, S, n]
            index_k = self.indexer.keys(ix, cos, sin)  # [B, S, d]
        doc_q = doc_k = None
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # [B, heads, L, *]
            if index_k is not None:
                index_k = kv_cache.append_index_keys(index_k)  # [B, L, d]
            length = k.shape[2]
            pos_q = torch.arange(length - S, length, device=q.device)
        else:
            # The group attention runs over: the cp group, or dynamic cp's sub-group.
            group = self.cp_group if docs is None else docs.cp_group
            cp, rank = group_size(group), group_rank(group)
            k, v = self._gather_cp(k, 2, group), self._gather_cp(v, 2, group)  # [B, heads, S*cp, *]
            if index_k is not None:
                index_k = self._gather_cp(index_k, 1, group)  # [B, S*cp, d]
            length = S * cp
            pos_q = zigzag_positions(length, rank, cp, device=q.device)
            if docs is not None and docs.doc_ids is not None:
                doc_k = docs.doc_ids
                doc_q = zigzag_split(doc_k, rank, cp, dim=1)
        allowed = visible_keys(pos_q, torch.arange(length, device=q.device), doc_q, doc_k)  # [B|1, S, L]
        scores = None
        if self.indexer is not None:
            scores = self.indexer.scores(index_q, index_w, index_k)  # [B, S, L]
            selected = select_topk(scores, allowed, self.topk)
            if selections is not None:
                selections[self.layer] = selected
        else:
            selected = selections[self.source]
        mask = selected if self.sparse else allowed.expand(q.shape[0], -1, -1)
        work = torch.promote_types(q.dtype, torch.float32)  # the softmax in float32 at least
        logits = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * self.scale  # [B, heads, S, L]
        probs = torch.softmax(logits.masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)
        out = torch.matmul(probs.to(v.dtype), v)  # [B, heads, S, v]
        if scores is not None and self.loss_weight > 0:
            target = probs.detach().sum(1)  # [B, S, L], this rank's heads
            all_reduce_(target, self.tp_group)
            target = target / target.sum(-1, keepdim=True)
            real, count = self._real_queries(docs, q.shape[0]) if kv_cache is None else (None, None)
            out = attach_loss(out, self.kl(target, scores, mask, real, count), self.loss_weight * loss_scale)
        return self.proj(self.merge_heads(out))

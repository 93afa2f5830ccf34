"""Multi-head latent attention (MLA; DeepSeek-V2 and -V3 technical reports).

Per token ``x [H]``:

- query: ``q = W_uq RMSNorm(W_dq x)`` (low rank ``q_lora_rank``), or ``q = W_q x`` when
  ``q_lora_rank`` is None; per head ``[qk_nope_head_dim | qk_rope_head_dim]``;
- keys and values from one compressed vector ``W_dkv x = [c | k_rope]``
  (``[kv_lora_rank + qk_rope_head_dim]``): ``W_ukv RMSNorm(c)`` gives per head
  ``[k_nope | v]`` (``qk_nope_head_dim``, ``v_head_dim``); ``k_rope`` is one rotary key
  shared by every head;
- rotary embeddings on ``q_rope`` and ``k_rope`` only (none on a layer whose
  ``model.rope_layers`` flag is 0: Kimi-Linear's MLA is NoPE, its ``k_rope`` dims shared and unrotated); head ``h`` attends with
  ``q = [q_nope_h | q_rope_h]``, ``k = [k_nope_h | k_rope]``, ``v_h``, softmax scale
  ``1/sqrt(qk_nope + qk_rope)`` times YaRN's ``mscale^2`` when ``model.rope_scaling`` is
  yarn (:meth:`moe_fold.models.rotary.YaRN.softmax_mscale`), as transformers'
  DeepseekV3Attention computes it;
- output ``W_o [heads * v_head_dim -> H]``.

LongCat-Flash (``model.mla_lora_scale``) multiplies the query by ``sqrt(H / q_lora_rank)``
and the normed latent ``RMSNorm(c)`` by ``sqrt(H / kv_lora_rank)`` before ``W_ukv``, as
transformers' LongcatFlashMLA does; ``model.mla_norm_eps`` is the latents' norms' epsilon
(transformers builds them with 1e-6 whatever ``rms_norm_eps`` is).

Under ``model.rope_interleave`` the rotary dims of a query head and of ``k_rope`` come in
pairs ``(x0, x1), (x2, x3)...`` (DeepSeek's checkpoints); they are de-interleaved to two
halves before the rotation, which is then the usual ``rotate_half`` one.

Tensor parallel: heads are split over tp, so ``W_uq``/``W_q`` and ``W_ukv`` are
column-parallel and ``W_o`` row-parallel, as in :class:`~moe_fold.models.attention.Attention`.
The down-projections ``W_dq``, ``W_dkv`` and their norms are replicated over tp and run
on this rank's tokens (its sequence shard under SP, like the block norms): the narrow
latents, not the hidden states, are what the up-projections gather over tp (a
full-rank query gathers the hidden states), and ``k_rope`` is gathered beside them. Their grads are then ``"tp_sum"`` under SP and
``"replicated"`` without it, the same rule as the block norms. Context parallel and
packed documents go through :func:`moe_fold.parallel.context_parallel.context_parallel_attention`
like standard attention; v's head width differs from q/k's and the cp paths take that.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from moe_fold.comm import Group, copy_to_tp_region, gather_from_sequence_region, group_size
from moe_fold.config import ModelConfig, choice, heads_over_tp, layer_attention, mla_weight_shapes, require
from moe_fold.parallel.context_parallel import context_parallel_attention
from moe_fold.parallel.tensor_parallel import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, init_seed
from moe_fold.parallel.varlen import Documents

from .kv_cache import LayerCache, cached_attention
from .norm import RMSNorm
from .rotary import apply_rotary, deinterleave, yarn_of

__all__ = ["MLAttention"]


class MLAttention(nn.Module):
    """MLA over this rank's heads, with the same constructor and forward as
    :class:`~moe_fold.models.attention.Attention` (cos/sin cover ``qk_rope_head_dim``).

    Parameters: ``q.weight`` (no ``q_lora_rank``) or ``q_down.weight``, ``q_norm.weight``,
    ``q_up.weight``; ``kv_down.weight`` (rows ``c | k_rope``), ``kv_norm.weight``,
    ``kv_up.weight`` (per head ``k_nope | v``); ``proj.weight``.
    """

    def __init__(self, config: ModelConfig, tp_group: Group, sequence_parallel: bool, *, seed: int, name: str,
                 cp_group: Group = None, cp_kind: str = "ring", layer: int = 0):
        super().__init__()
        tp = group_size(tp_group)
        require(heads_over_tp, config.num_heads, config.num_kv_heads, tp)
        require(choice, "parallel.cp_kind", cp_kind)
        self.cp_group, self.cp_kind = cp_group, cp_kind
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.num_heads = config.num_heads // tp  # local heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_interleave = config.rope_interleave
        self.rotary = layer_attention(config, layer)[2]
        yarn = yarn_of(config)
        self.scale = (self.nope + self.rope) ** -0.5 * (yarn.softmax_mscale() if yarn is not None else 1.0)
        std = config.init_std
        eps = config.norm_eps if config.mla_norm_eps is None else config.mla_norm_eps
        # LongCat-Flash's LoRA scaling; None: none (a multiply by 1 would only cost time).
        scaled = config.mla_lora_scale
        self.q_scale = (config.hidden_size / config.q_lora_rank) ** 0.5 if scaled else None
        self.kv_scale = (config.hidden_size / config.kv_lora_rank) ** 0.5 if scaled else None
        shapes = mla_weight_shapes(config)
        # Replicated over tp: under SP each rank projects its own tokens, so grads add over tp.
        kind = "tp_sum" if sequence_parallel else "replicated"

        def replicated(part: str) -> ReplicatedLinear:
            out, inp = shapes[part]
            return ReplicatedLinear(inp, out, sequence_parallel, std=std, seed=init_seed(seed, f"{name}.{part}"))

        def column(part: str) -> ColumnParallelLinear:
            out, inp = shapes[part]
            return ColumnParallelLinear(inp, out, tp_group, sequence_parallel, std=std,
                                        seed=init_seed(seed, f"{name}.{part}"))

        self.q_lora = config.q_lora_rank is not None
        if self.q_lora:
            self.q_down = replicated("q_down")  # [q_lora_rank, H]
            self.q_norm = RMSNorm(config.q_lora_rank, eps, kind)
            self.q_up = column("q_up")
        else:
            self.q = column("q")
        self.kv_down = replicated("kv_down")  # [kv_lora_rank + rope, H]
        self.kv_norm = RMSNorm(config.kv_lora_rank, eps, kind)
        self.kv_up = column("kv_up")
        out, inp = shapes["proj"]
        self.proj = RowParallelLinear(inp, out, tp_group, sequence_parallel, std=std,
                                      seed=init_seed(seed, f"{name}.proj"))

    def _enter_tp(self, x: torch.Tensor) -> torch.Tensor:
        """The rotary key (computed on this rank's tokens) over the whole sequence, as the
        column-parallel outputs it meets are: gathered over tp under SP; without SP, its
        grad summed over tp in the backward (each rank's heads give a part)."""
        if self.sequence_parallel:
            return gather_from_sequence_region(x, self.tp_group, dim=0)  # [S/tp, ...] -> [S, ...]
        return copy_to_tp_region(x, self.tp_group)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``x [S_local, B, H]`` -> ``q [B, heads, S, nope + rope]``, ``k`` (the same),
        ``v [B, heads, S, v]`` after rotary, and the query latent ``[S_local, B, q_lora]``
        (None without ``q_lora_rank``), which DSA's indexer reads."""
        q_latent = None
        if self.q_lora:
            q_latent = self.q_norm(self.q_down(x))  # [S_local, B, q_lora]
            q = self.q_up(q_latent)  # [S, B, heads * (nope + rope)]
        else:
            q = self.q(x)
        if self.q_scale is not None:
            q = q * self.q_scale
        kv = self.kv_down(x)  # [S_local, B, kv_lora + rope]
        c, k_rope = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        c = self.kv_norm(c)
        if self.kv_scale is not None:
            c = c * self.kv_scale
        kv = self.kv_up(c)  # [S, B, heads * (nope + v)]
        k_rope = self._enter_tp(k_rope)  # [S, B, rope]
        S, B = q.shape[:2]
        q_nope, q_rope = q.view(S, B, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        k_nope, v = kv.view(S, B, self.num_heads, -1).split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.unsqueeze(2)  # [S, B, 1, rope]
        if self.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_nope, q_rope, k_nope, k_rope, v = (t.permute(1, 2, 0, 3) for t in (q_nope, q_rope, k_nope, k_rope, v))
        if self.rotary:
            q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)  # [B, heads|1, S, rope]
        q = torch.cat([q_nope, q_rope], dim=-1)  # [B, heads, S, nope + rope]
        k = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return q, k, v, q_latent

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Documents] = None, kv_cache: Optional[LayerCache] = None) -> torch.Tensor:
        """``x [S_local, B, H]`` -> ``[S_local, B, H]``; cos/sin ``[S, rope]`` or ``[B, S, rope]``
        (see :meth:`Attention.forward <moe_fold.models.attention.Attention.forward>`).
        ``kv_cache`` (sampling): holds every head's full key and value (not the latent)."""
        q, k, v, _ = self.project(x, cos, sin)
        if kv_cache is not None:
            out = cached_attention(q, *kv_cache.append(k, v), scale=self.scale)  # [B, heads, S, v]
        else:
            group, doc_ids = (self.cp_group, None) if docs is None else (docs.cp_group, docs.doc_ids)
            out = context_parallel_attention(q, k, v, group, kind=self.cp_kind, scale=self.scale,
                                             doc_ids=doc_ids)  # [B, heads, S, v]
        return self.proj(self.merge_heads(out))

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, heads, S, v]`` -> ``[S, B, heads*v]``, the output projection's input."""
        B, _, S, _ = out.shape
        return out.permute(2, 0, 1, 3).reshape(S, B, self.num_heads * self.v_dim)

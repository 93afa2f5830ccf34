"""The decoder-only transformer: embedding, blocks (attention + MLP or MoE), final norm,
LM head and loss. Mixtral / Qwen2-MoE / Qwen3-MoE layout (pre-norm, RMSNorm, rotary,
grouped-query attention, SwiGLU).

Activations are sequence-first, ``[S, B, H]``. With tensor parallel and sequence parallel
(SP) every tp rank holds its own slice of the sequence, ``[S/tp, B, H]``, between the
column- and row-parallel layers; norms and residual adds run on that slice. The MLP of a
block sees this rank's tokens flattened, ``[S_local*B, H]``, which is the contract the MoE
layer implements: ``mlp(hidden [T_local, H]) -> [T_local, H]`` (its aux losses ride on the
autograd graph, not on a return value).

Weights are slices of global tensors drawn from per-parameter seeds
(:mod:`moe_fold.tensor_parallel`), so every layout of the same config and seed holds the
same model.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from moe_fold.comm import all_reduce_, gather_from_tp_region
from moe_fold.config import Config, head_dim, moe_layer_flags
from moe_fold.layout import ProcessGroups
from moe_fold.tensor_parallel import (
    ColumnParallelLinear, VocabParallelEmbedding, init_seed, vocab_parallel_cross_entropy,
)

from .attention import Attention
from .mlp import MLP
from .moe_layer import MoELayer
from .norm import RMSNorm
from .rotary import rotary_cos_sin


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    ``mlp`` is the dense :class:`MLP` or an MoE layer: any module taking this rank's
    tokens ``[T_local, H]`` and returning ``[T_local, H]``.
    """

    def __init__(self, config: Config, groups: ProcessGroups, layer: int, mlp: nn.Module):
        super().__init__()
        m, sp = config.model, config.parallel.sequence_parallel
        # Under SP each tp rank normalises a different slice of the sequence.
        norm_kind = "tp_sum" if sp else "replicated"
        self.attn_norm = RMSNorm(m.hidden_size, m.norm_eps, norm_kind)
        self.attn = Attention(m, head_dim(config), groups.tp, sp, seed=config.train.seed,
                              name=f"layers.{layer}.attn")
        self.mlp_norm = RMSNorm(m.hidden_size, m.norm_eps, norm_kind)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # [S_local, B, H]
        h = self.mlp(self.mlp_norm(x).flatten(0, 1))  # [S_local*B, H]
        return x + h.reshape(x.shape)


def make_mlp(config: Config, groups: ProcessGroups, layer: int) -> nn.Module:
    """The MLP of ``layer``: an MoE layer where ``moe_layer_flags`` says so, else dense.

    The MoE layer is built as ``MoELayer(config, groups, layer)`` and called as
    ``mlp(hidden [T_local, H]) -> [T_local, H]``. It marks its parameters for gradient
    sync (``moe_fold.tensor_parallel.mark``): experts ``"expert"``; router weights and a
    shared-expert gate ``"tp_sum"`` under SP (each tp rank routes its own tokens); a
    shared expert built as :class:`MLP` is already marked.
    """
    if moe_layer_flags(config)[layer]:
        return MoELayer(config, groups, layer)
    m = config.model
    return MLP(m.hidden_size, m.ffn_hidden_size, groups.tp, config.parallel.sequence_parallel,
               std=m.init_std, seed=config.train.seed, name=f"layers.{layer}.mlp")


class Transformer(nn.Module):
    """This rank's model: ``forward`` returns the loss, ``logits`` the full logits.

    Parameter names (what checkpoint and Hugging Face conversion map): ``embed.weight``;
    ``layers.{i}.attn_norm.weight``, ``.attn.qkv.weight`` (rows q|k|v), ``.attn.proj.weight``,
    ``.attn.q_norm.weight``/``.attn.k_norm.weight`` (QK-norm), ``.mlp_norm.weight``,
    ``.mlp.fc1.weight`` (rows gate|up), ``.mlp.fc2.weight``; ``norm.weight``;
    ``lm_head.weight`` (tied: the same parameter as ``embed.weight``). A ``"tp"``
    parameter holds this rank's shard (``tp_dim``, ``tp_parts``;
    :func:`moe_fold.tensor_parallel.shard_tp`).
    """

    def __init__(self, config: Config, groups: ProcessGroups):
        super().__init__()
        m, sp, seed = config.model, config.parallel.sequence_parallel, config.train.seed
        self.config = config
        self.groups = groups
        self.embed = VocabParallelEmbedding(m.vocab_size, m.hidden_size, groups.tp, sp,
                                            std=m.init_std, seed=init_seed(seed, "embed"))
        self.layers = nn.ModuleList(Block(config, groups, i, make_mlp(config, groups, i))
                                    for i in range(m.num_layers))
        self.norm = RMSNorm(m.hidden_size, m.norm_eps, "tp_sum" if sp else "replicated")
        # Tied: the head is the embedding's own parameter (same vocab split over tp).
        tied = self.embed.weight if m.tie_embeddings else None
        self.lm_head = ColumnParallelLinear(m.hidden_size, m.vocab_size, groups.tp, sp, std=m.init_std,
                                            seed=init_seed(seed, "lm_head"), weight=tied)

    def _vocab_logits(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
        """``input_ids [B, S]`` -> this rank's vocab shard of the logits ``[S, B, V/tp]``."""
        m = self.config.model
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = rotary_cos_sin(positions, head_dim(self.config), m.rope_theta, self.embed.weight.dtype)
        x = self.embed(input_ids.t())  # [S_local, B, H]
        for block in self.layers:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))  # [S, B, V/tp]

    def logits(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Full logits ``[B, S, V]`` (gathered over tp): for evaluation and tests, not training."""
        local = self._vocab_logits(input_ids, positions)
        return gather_from_tp_region(local, self.groups.tp, dim=-1).transpose(0, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, positions: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None,
                num_loss_tokens: Optional[Union[float, torch.Tensor]] = None) -> torch.Tensor:
        """This rank's loss for ``input_ids``/``labels`` ``[B, S_local]`` (labels already shifted).

        ``positions``: ``[S_local]`` or ``[B, S_local]`` (default ``arange(S_local)``);
        ``loss_mask``: ``[B, S_local]``, 0 where a token does not count (padding).
        ``num_loss_tokens``: the unmasked tokens of the whole global batch (every dp x cp
        rank, every micro-batch); None counts this micro-batch over dp x cp.

        The result is ``sum(token losses * mask) * (dp*cp) / num_loss_tokens``: averaging
        it, and its grads, over dp x cp (what ``moe_fold.grads.sync_grads`` does) gives the
        mean loss over the global batch and its exact gradient, whatever the number of
        unmasked tokens on each rank; summing grads over micro-batches before the sync
        keeps it exact when ``num_loss_tokens`` covers them all.
        """
        logits = self._vocab_logits(input_ids, positions)  # [S, B, V/tp]
        losses = vocab_parallel_cross_entropy(logits, labels.t(), self.groups.tp)  # [S, B]
        dp_cp = self.groups.size("dp_cp")
        if loss_mask is not None:
            mask = loss_mask.t().to(losses.dtype)
            losses = losses * mask
        if num_loss_tokens is None:
            if loss_mask is None:
                # Every dp x cp rank holds a micro-batch of the same shape.
                num_loss_tokens = losses.numel() * dp_cp
            else:
                count = mask.sum().detach().clone()
                # A global batch with every token masked has loss 0, not 0/0.
                num_loss_tokens = all_reduce_(count, self.groups.dp_cp).clamp(min=1)
        return losses.sum() * (dp_cp / num_loss_tokens)


def build_model(config: Config, groups: ProcessGroups) -> Transformer:
    """This rank's part of the model of ``config`` in the layout of ``groups``
    (``ProcessGroups.single_process()`` for the one-process model)."""
    # Causal attention over a contiguous sequence and one stage holding every layer are
    # what this model computes; a layout that needs otherwise must not run silently.
    for name, what in (("cp", "context-parallel attention"), ("pp", "pipeline stages")):
        if groups.size(name) > 1:
            raise NotImplementedError(f"parallel.{name}={groups.size(name)}: {what} are not built by "
                                      f"build_model yet; use parallel.{name}=1")
    return Transformer(config, groups)

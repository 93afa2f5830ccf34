"""Multi-token prediction (MTP), as DeepSeek-V3 defines it (DeepSeek-AI 2024, section 2.2).

``model.mtp_num_layers`` = D modules run one after another on the last pipeline stage,
after the main model. Depth k (1-based) predicts token ``t+1+k`` at position ``t``:

    h^k = Block_k(eh_proj_k([enorm_k(Emb(token[t+k])); hnorm_k(h^{k-1})]))   # 2H -> H
    logits^k = Head(norm_k(h^k))

``h^0`` is the main model's last hidden state before its final norm; ``Emb`` and ``Head``
are the main model's (shared, so under pp the last stage keeps a copy of the embedding in
the embedding group, :func:`moe_fold.parallel.pipeline.create_embedding_group`). The block
is a dense or MoE block like the model's last layer, with the main sequence's rotary
positions and packed documents. The objective adds ``mtp_loss_weight / D`` times the sum
of the D depths' mean cross-entropies (:meth:`Transformer.forward`).

The shifted inputs and labels of depth k are the main ones moved k places left along the
whole sequence (:func:`mtp_targets`): under cp a rank's zigzag shard does not hold the
tokens k places on, so the shift is done on the sequence gathered over cp (token ids, a
few bytes each) and then cut back to the shard. A target counts only where it stays in
the same document as position ``t`` (packed sequences) and the main label there counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from moe_fold.comm import Group, all_gather, group_rank, group_size
from moe_fold.config import Config
from moe_fold.parallel.context_parallel import zigzag_gather, zigzag_split
from moe_fold.parallel.tensor_parallel import global_normal, init_seed, mark
from moe_fold.parallel.varlen import Documents

from .norm import RMSNorm

__all__ = ["MTPTargets", "shift_for_depths", "mtp_targets", "MTPLayer", "MTP"]


@dataclass
class MTPTargets:
    """One micro-batch's MTP inputs on this rank, depth-major: ``tokens`` int64, ``labels``
    int64 and ``mask`` float ``[D, B, S_local]`` (row k-1 is depth k). ``num_tokens``:
    float ``[D]``, the unmasked targets of each depth in the whole global batch (the
    normaliser of its mean loss); None counts this micro-batch over dp x cp."""

    tokens: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor
    num_tokens: Optional[torch.Tensor] = None


def shift_for_depths(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                     doc_ids: Optional[torch.Tensor], depths: int) -> tuple[torch.Tensor, ...]:
    """Depth k's inputs ``tokens[t+k]``, labels ``labels[t+k]`` and mask on whole
    sequences ``[B, S]`` (natural order) -> three ``[D, B, S]``. The mask is
    ``loss_mask[t+k]`` where ``t+k`` is in the row and in ``t``'s document, else 0."""
    B, S = tokens.shape
    docs = doc_ids if doc_ids is not None else torch.zeros(B, S, dtype=torch.int64, device=tokens.device)
    shifted_tokens, shifted_labels, masks = [], [], []
    for k in range(1, depths + 1):
        # Position t reads t+k; the last k positions of a row have no t+k (zeros, masked).
        tail = (B, k)
        shifted_tokens.append(torch.cat([tokens[:, k:], tokens.new_zeros(tail)], dim=1))  # [B, S]
        shifted_labels.append(torch.cat([labels[:, k:], labels.new_zeros(tail)], dim=1))
        same_doc = docs[:, k:] == docs[:, :S - k]  # [B, S-k]
        masks.append(torch.cat([loss_mask[:, k:] * same_doc.to(loss_mask.dtype), loss_mask.new_zeros(tail)], dim=1))
    return torch.stack(shifted_tokens), torch.stack(shifted_labels), torch.stack(masks)  # [D, B, S] each


def mtp_targets(tokens: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
                doc_ids: Optional[torch.Tensor], depths: int, cp_group: Group = None) -> MTPTargets:
    """This rank's :class:`MTPTargets` for its ``tokens``/``labels``/``loss_mask``
    ``[B, S_local]`` (its zigzag shard under cp) and the micro-batch's ``doc_ids``
    ``[B, S]`` over the whole sequence (:class:`~moe_fold.parallel.varlen.Documents`;
    None: one document per row)."""
    cp = group_size(cp_group)
    mask = loss_mask if loss_mask is not None else torch.ones(tokens.shape, device=tokens.device)
    # float64 carries token ids exactly (< 2**53) beside the mask in one gather.
    local = torch.stack([tokens.double(), labels.double(), mask.double()])  # [3, B, S_local]
    if cp > 1:
        shards = all_gather(local.unsqueeze(0), cp_group, dim=0).unbind(0)  # cp x [3, B, S_local]
        local = zigzag_gather(shards, dim=2)  # [3, B, S]
    t, lab, m = shift_for_depths(local[0].long(), local[1].long(), local[2], doc_ids, depths)  # [D, B, S]
    if cp > 1:
        rank = group_rank(cp_group)
        t, lab, m = (zigzag_split(x, rank, cp, dim=2) for x in (t, lab, m))  # [D, B, S_local]
    return MTPTargets(t, lab, m.to(mask.dtype))


class MTPLayer(nn.Module):
    """Depth ``depth`` (1-based): the two input norms, ``eh_proj`` and the block, and the
    final norm before the shared head. ``block`` is the model's block for layer
    ``num_layers + depth - 1`` (the index DeepSeek-V3 checkpoints give it).

    ``eh_proj`` ``[H, 2H]`` (columns: embedding | hidden) is replicated over tp: every tp
    rank projects its own tokens (its sequence slice under SP), like the norms."""

    def __init__(self, config: Config, depth: int, block: nn.Module):
        super().__init__()
        m, sp = config.model, config.parallel.sequence_parallel
        kind = "tp_sum" if sp else "replicated"
        self.enorm = RMSNorm(m.hidden_size, m.norm_eps, kind)
        self.hnorm = RMSNorm(m.hidden_size, m.norm_eps, kind)
        proj = global_normal((m.hidden_size, 2 * m.hidden_size), m.init_std,
                             init_seed(config.train.seed, f"mtp.{depth - 1}.eh_proj"))
        self.eh_proj = nn.Linear(2 * m.hidden_size, m.hidden_size, bias=False)
        self.eh_proj.weight = mark(nn.Parameter(proj), kind)
        self.block = block
        self.norm = RMSNorm(m.hidden_size, m.norm_eps, kind)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Documents], loss_scale: float = 1.0) -> torch.Tensor:
        """``h`` (depth k-1) and ``emb`` (tokens t+k) ``[S_local, B, H]`` -> ``h^k`` ``[S_local, B, H]``;
        ``loss_scale`` as in :meth:`moe_fold.models.model.Transformer.forward`."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))  # [S, B, 2H] -> [S, B, H]
        return self.block(x, cos, sin, docs, loss_scale=loss_scale)


class MTP(nn.Module):
    """The D depths in order, named ``0 .. D-1`` (``mtp.{k}.*`` in the model);
    ``forward`` returns each depth's loss."""

    def __init__(self, config: Config, blocks: list[nn.Module]):
        super().__init__()
        for k, block in enumerate(blocks):
            self.add_module(str(k), MTPLayer(config, k + 1, block))

    def __getitem__(self, k: int) -> MTPLayer:
        return self._modules[str(k)]

    def __len__(self) -> int:
        return len(self._modules)

    def forward(self, h: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor], targets: MTPTargets,
                cos: torch.Tensor, sin: torch.Tensor, docs: Optional[Documents],
                loss: Callable[..., torch.Tensor], loss_scale: float = 1.0) -> torch.Tensor:
        """``h`` ``[S_local, B, H]``: the main model's last hidden states (before its norm);
        ``embed(ids [S, B])`` the shared embedding; ``loss(normed [S_local, B, H], labels
        [B, S_local], mask, num_tokens)`` the main model's scaled cross-entropy through the
        shared head; ``loss_scale`` goes to the depths' routers. Returns ``[D]``: depth k's
        loss at row k-1."""
        out = []
        for k, layer in enumerate(self.children()):
            h = layer(h, embed(targets.tokens[k].t()), cos, sin, docs, loss_scale)  # [S_local, B, H]
            count = None if targets.num_tokens is None else targets.num_tokens[k]
            out.append(loss(layer.norm(h), targets.labels[k], targets.mask[k], count))
        return torch.stack(out)

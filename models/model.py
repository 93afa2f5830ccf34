"""The decoder-only transformer: embedding, blocks (attention + MLP or MoE), final norm,
LM head and loss. Mixtral / Qwen2-MoE / Qwen3-MoE layout (pre-norm, RMSNorm, rotary,
grouped-query attention, SwiGLU), or DeepSeek-V3's with multi-head latent attention
(``model.attention: mla``, :mod:`moe_fold.models.mla`).

Activations are sequence-first, ``[S, B, H]``. With tensor parallel and sequence parallel
(SP) every tp rank holds its own slice of the sequence, ``[S/tp, B, H]``, between the
column- and row-parallel layers; norms and residual adds run on that slice. The MLP of a
block sees this rank's tokens flattened, ``[S_local*B, H]``, which is the contract the MoE
layer implements: ``mlp(hidden [T_local, H]) -> [T_local, H]`` (its aux losses ride on the
autograd graph, not on a return value).

Weights are slices of global tensors drawn from per-parameter seeds
(:mod:`moe_fold.parallel.tensor_parallel`), so every layout of the same config and seed holds the
same model.

Context parallel (cp): a rank holds its zigzag shard of every sequence
(:func:`moe_fold.parallel.context_parallel.zigzag_split`), its tokens, labels and rotary
positions; only attention crosses the cp group. Pipeline parallel (pp): a rank builds
the layers of its virtual stages (:func:`moe_fold.parallel.pipeline.stage_layers`), the
embedding with stage 0, the final norm, head and loss with the last stage, and runs
them with :meth:`Transformer.chunk_forward` under :func:`moe_fold.training.step.forward_backward`.
Layers keep their global index in parameter names (``layers.{i}``) under every split.

Packed documents: a micro-batch may carry :class:`moe_fold.parallel.varlen.Documents`
(:meth:`Transformer.documents` builds it from the loader's ``cu_seqlens`` and real-token
mask): attention stays inside each document, and MoE routers leave padding out of their
losses and counts. The per-sequence aux loss (``moe.seq_aux_loss_coeff``) balances each
sample (loader row) of a micro-batch, not each packed document.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from moe_fold.comm import all_reduce_, gather_from_sequence_region, gather_from_tp_region
from moe_fold.config import (
    CHANNEL_MIXERS, Config, head_dim, layer_mixer, moe_layer_flags, require, rotary_dim, rotary_pairs,
    shortcut_moe_block, vpp_size,
)
from moe_fold.dispatch.aux_losses import attach_loss
from moe_fold.parallel.context_parallel import zigzag_positions
from moe_fold.layout import ProcessGroups
from moe_fold.parallel.pipeline import create_embedding_group, stage_layers
from moe_fold.parallel.pipeline_schedules import rank_stages
from moe_fold.parallel.tensor_parallel import (
    ColumnParallelLinear, VocabParallelEmbedding, init_seed, vocab_parallel_cross_entropy,
)
from moe_fold.parallel.varlen import Documents, doc_ids_from_cu_seqlens, router_token_mask, sequence_starts

from .attention import Attention
from .experts import Experts
from .gated_deltanet import GatedDeltaNet
from .kda import KimiDeltaAttention
from .kv_cache import LayerCache
from .dsa import DSAttention
from .mamba2 import Mamba2
from .mla import MLAttention
from .mlp import MLP
from .moe_layer import MoELayer
from .mtp import MTP, MTPTargets, mtp_targets
from .norm import RMSNorm
from .recompute import recomputed
from .rotary import cos_sin, yarn_of


def make_norm(config: Config) -> RMSNorm:
    """A block's RMSNorm over the hidden size."""
    m = config.model
    # Under SP each tp rank normalises a different slice of the sequence.
    kind = "tp_sum" if config.parallel.sequence_parallel else "replicated"
    return RMSNorm(m.hidden_size, m.norm_eps, kind, m.norm_zero_centred)


def make_mixer(config: Config, groups: ProcessGroups, layer: int, name: str) -> nn.Module:
    """Layer ``layer``'s token mixer, its weights drawn under ``name``: Gated DeltaNet, KDA or
    Mamba2 where ``model.layer_types`` says so, else MLA (with DSA under ``model.dsa``) or standard attention."""
    m, sp = config.model, config.parallel.sequence_parallel
    where = dict(seed=config.train.seed, name=name, cp_group=groups.cp)
    if layer_mixer(m, layer) == "gated_deltanet":
        return GatedDeltaNet(m, groups.tp, sp, **where)
    if layer_mixer(m, layer) == "kda":
        return KimiDeltaAttention(m, groups.tp, sp, **where)
    if layer_mixer(m, layer) == "mamba2":
        return Mamba2(m, groups.tp, sp, **where)
    where["cp_kind"] = config.parallel.cp_kind
    if m.attention == "mla" and m.dsa:
        return DSAttention(m, groups.tp, sp, **where, layer=layer)
    if m.attention == "mla":
        return MLAttention(m, groups.tp, sp, **where, layer=layer)
    return Attention(m, head_dim(config), groups.tp, sp, **where, layer=layer)


def routed_mlp(mlp: MoELayer, h: torch.Tensor, x_shape: torch.Size, docs: Optional[Documents],
               loss_scale: float) -> torch.Tensor:
    """The MoE layer ``mlp`` on this rank's tokens ``h [S_local*B, H]`` of a block whose
    hidden states are ``x_shape = [S_local, B, H]``."""
    s_local, batch = x_shape[0], x_shape[1]
    # Sequence-first flattening: row t is sample t % B. SP (tp) and cp shards hold
    # slices of the same B samples, so the router's tp x cp sums meet per sample. A
    # sample is the loader's row even when it packs several documents (Megatron's
    # seq_aux_loss counts per sample too).
    seq_ids = torch.arange(batch, device=h.device).repeat(s_local)  # [S_local*B]
    loss_mask = docs.token_mask if docs is not None else None
    return mlp(h, loss_mask=loss_mask, seq_ids=seq_ids, num_seqs=batch, loss_scale=loss_scale)


class Block(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    ``mlp`` is the dense :class:`MLP` or an MoE layer: any module taking this rank's
    tokens ``[T_local, H]`` and returning ``[T_local, H]``. With
    ``model.block: single_mixer`` (Nemotron-H) a block has one of the two: a token mixer
    without ``mlp`` (None), or an ``mlp`` without ``attn`` (its layer type ``mlp`` or ``moe``).
    """

    def __init__(self, config: Config, groups: ProcessGroups, layer: int, mlp: Optional[nn.Module]):
        super().__init__()
        channel_only = layer_mixer(config.model, layer) in CHANNEL_MIXERS
        self.attn_norm = None if channel_only else make_norm(config)
        self.attn = None if channel_only else make_mixer(config, groups, layer, f"layers.{layer}.attn")
        self.mlp_norm = None if mlp is None else make_norm(config)
        self.mlp = mlp
        # Decided here, not in a forward: whether the attention takes the rotary positions
        # (temperature tuning reads them; MLA, Gated DeltaNet and KDA have none) or the DSA
        # selections and loss scale, and whether the MLP is an MoE layer (it takes the
        # router's per-token arguments).
        self.attn_takes_positions = isinstance(self.attn, Attention)
        self.attn_selects = isinstance(self.attn, DSAttention)
        self.mlp_routes = isinstance(mlp, MoELayer)
        # What the backward runs again (train.recompute, models/recompute.py): "none",
        # "all" (the whole block) or "attention" (the attention after its norm).
        self.recompute = "none"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Documents] = None, kv_cache: Optional[LayerCache] = None,
                positions: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
                selections: Optional[dict] = None) -> torch.Tensor:
        """``loss_scale``: the factor on the router losses' gradients, this micro-batch's
        share of the training step (:meth:`moe_fold.dispatch.router.Router.forward`), and on
        the DSA indexer's loss. ``selections``: the DSA selections of this forward's layers
        so far (:class:`~moe_fold.models.dsa.DSAttention`)."""
        if self.recompute == "all":
            return recomputed(self._residuals, x, cos, sin, docs, kv_cache, positions, loss_scale, selections)
        return self._residuals(x, cos, sin, docs, kv_cache, positions, loss_scale, selections)

    def _residuals(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Optional[Documents],
                   kv_cache: Optional[LayerCache], positions: Optional[torch.Tensor],
                   loss_scale: float, selections: Optional[dict] = None) -> torch.Tensor:
        # positions (those of cos/sin): only temperature tuning reads them, which MLA has not.
        extra = {"positions": positions} if self.attn_takes_positions else {}
        if self.attn_selects:
            extra = {"selections": selections, "loss_scale": loss_scale}
        if self.attn is None:
            pass
        elif self.recompute == "attention":
            x = x + recomputed(self.attn, self.attn_norm(x), cos, sin, docs, kv_cache, **extra)  # [S_local, B, H]
        else:
            x = x + self.attn(self.attn_norm(x), cos, sin, docs, kv_cache, **extra)  # [S_local, B, H]
        if self.mlp is None:
            return x
        h = self.mlp_norm(x).flatten(0, 1)  # [S_local*B, H]
        h = routed_mlp(self.mlp, h, x.shape, docs, loss_scale) if self.mlp_routes else self.mlp(h)
        return x + h.reshape(x.shape)


class Sublayer(nn.Module):
    """One of a :class:`ShortcutMoEBlock`'s two sublayers: ``x + attn(norm(x))``, then a
    dense MLP ``mlp`` on its own norm ``mlp_norm`` (the block adds its output)."""

    def __init__(self, config: Config, groups: ProcessGroups, layer: int, index: int):
        super().__init__()
        m, name = config.model, f"layers.{layer}.sublayers.{index}"
        self.attn_norm = make_norm(config)
        self.attn = make_mixer(config, groups, layer, f"{name}.attn")
        self.mlp_norm = make_norm(config)
        self.mlp = MLP(m.hidden_size, m.ffn_hidden_size, groups.tp, config.parallel.sequence_parallel,
                       std=m.init_std, seed=config.train.seed, name=f"{name}.mlp")

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, docs: Optional[Documents],
               kv_cache: Optional[LayerCache], recompute: bool) -> torch.Tensor:
        """``x + attn(attn_norm(x))`` ``[S_local, B, H]``; ``recompute``: the attention (after
        its norm) runs again in the backward."""
        if recompute:
            return x + recomputed(self.attn, self.attn_norm(x), cos, sin, docs, kv_cache)
        return x + self.attn(self.attn_norm(x), cos, sin, docs, kv_cache)

    def dense(self, h: torch.Tensor) -> torch.Tensor:
        """The dense MLP of the normed ``h [S_local, B, H]``, same shape."""
        return self.mlp(h.flatten(0, 1)).reshape(h.shape)


class ShortcutMoEBlock(nn.Module):
    """LongCat-Flash's block (``model.block: shortcut_moe``; transformers'
    LongcatFlashDecoderLayer): two :class:`Sublayer` s of attention and a dense MLP, and
    a shortcut-connected MoE ``mlp`` that reads the first sublayer's normed output and
    whose output joins the residual stream at the block's end::

        x = x + attn_0(norm(x));  h = norm(x)
        m = moe(h);  x = x + mlp_0(h)
        x = x + attn_1(norm(x))
        out = x + mlp_1(norm(x)) + m

    The MoE's dispatch can thus overlap the second sublayer's work. Its mixers are
    attention (MLA in LongCat-Flash), the second one's KV cache is
    :meth:`LayerCache.sublayer` ``(1)``. ``recompute``: ``"none"`` or ``"attention"``
    (each attention after its norm runs again in the backward).
    """

    def __init__(self, config: Config, groups: ProcessGroups, layer: int):
        super().__init__()
        require(shortcut_moe_block, config.model.block, moe_layer_flags(config), config.model.layer_types,
                config.model.mtp_num_layers)
        self.sublayers = nn.ModuleList([Sublayer(config, groups, layer, j) for j in (0, 1)])
        self.mlp = MoELayer(config, groups, layer)
        self.recompute = "none"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                docs: Optional[Documents] = None, kv_cache: Optional[LayerCache] = None,
                positions: Optional[torch.Tensor] = None, loss_scale: float = 1.0,
                selections: Optional[dict] = None) -> torch.Tensor:
        """As :meth:`Block.forward` (``positions``: unused, MLA has no temperature tuning;
        ``selections``: unused, DSA is refused with this block)."""
        first, second = self.sublayers
        again = self.recompute == "attention"
        x = first.attend(x, cos, sin, docs, kv_cache, again)  # [S_local, B, H]
        h = first.mlp_norm(x)
        # The shortcut: the MoE reads the first sublayer's normed output, added at the end.
        shortcut = routed_mlp(self.mlp, h.flatten(0, 1), x.shape, docs, loss_scale).reshape(x.shape)
        x = x + first.dense(h)
        x = second.attend(x, cos, sin, docs, kv_cache.sublayer(1) if kv_cache is not None else None, again)
        return x + second.dense(second.mlp_norm(x)) + shortcut


def make_block(config: Config, groups: ProcessGroups, layer: int) -> nn.Module:
    """Layer ``layer``'s block of the kind ``model.block`` names: a :class:`Block` with
    :func:`make_mlp`'s MLP, or LongCat-Flash's :class:`ShortcutMoEBlock`. MTP depths
    (``layer >= num_layers``) are standard blocks."""
    if config.model.block == "shortcut_moe" and layer < config.model.num_layers:
        return ShortcutMoEBlock(config, groups, layer)
    return Block(config, groups, layer, make_mlp(config, groups, layer))


def make_mlp(config: Config, groups: ProcessGroups, layer: int) -> Optional[nn.Module]:
    """The MLP of ``layer``: an MoE layer where ``moe_layer_flags`` says so, else dense;
    None for a token-mixer layer under ``model.block: single_mixer``.

    The MoE layer is built as ``MoELayer(config, groups, layer)`` and called as
    ``mlp(hidden [T_local, H], loss_mask=, seq_ids=, num_seqs=) -> [T_local, H]`` (real
    tokens; each token's sample in the micro-batch, for the per-sequence aux loss). It marks its parameters for gradient
    sync (``moe_fold.parallel.tensor_parallel.mark``): experts ``"expert"``; router weights and a
    shared-expert gate ``"tp_sum"`` under SP (each tp rank routes its own tokens); a
    shared expert built as :class:`MLP` is already marked. Layers past ``model.num_layers``
    are the MTP depths' blocks, of the kind of the last layer.
    """
    flags = moe_layer_flags(config)
    m = config.model
    if m.block == "single_mixer" and layer_mixer(m, layer) not in CHANNEL_MIXERS:
        return None
    if flags[min(layer, len(flags) - 1)]:
        return MoELayer(config, groups, layer)
    return MLP(m.hidden_size, m.ffn_hidden_size, groups.tp, config.parallel.sequence_parallel,
               std=m.init_std, seed=config.train.seed, name=f"layers.{layer}.mlp", activation=m.mlp_activation)


def layer_index(name: str, num_layers: int) -> int:
    """The global layer index of a module or parameter name: ``layers.{i}.*`` is i, MTP
    depth ``mtp.{k}.*`` is ``num_layers + k`` (the index DeepSeek-V3 checkpoints give it)."""
    parts = name.split(".")
    if parts[0] == "mtp":
        return num_layers + int(parts[1])
    return int(parts[parts.index("layers") + 1])


class Layers(nn.Module):
    """This rank's blocks, named and indexed by their global layer index: ``layers[i]``
    is layer ``i`` whichever pipeline stage holds it; iterating yields the blocks in
    layer order."""

    def __init__(self, blocks: dict[int, nn.Module]):
        super().__init__()
        for i, block in blocks.items():
            self.add_module(str(i), block)

    def __getitem__(self, layer: int) -> nn.Module:
        return self._modules[str(layer)]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


class Transformer(nn.Module):
    """This rank's model: its pipeline stages' layers, the embedding on the first stage,
    final norm and LM head on the last. ``forward`` returns the loss and ``logits`` the
    full logits of a whole model (pp = 1); under pp, :meth:`chunk_forward` runs one
    virtual stage.

    Parameter names (what checkpoint and Hugging Face conversion map): ``embed.weight``;
    ``layers.{i}.attn_norm.weight``, ``.attn.qkv.weight`` (rows q|k|v), ``.attn.proj.weight``,
    ``.attn.q_norm.weight``/``.attn.k_norm.weight`` (QK-norm), ``.mlp_norm.weight``,
    ``.mlp.fc1.weight`` (rows gate|up), ``.mlp.fc2.weight``; MLA layers have
    ``.attn.{q,q_down,q_norm,q_up,kv_down,kv_norm,kv_up,proj}.weight`` instead
    (:class:`~moe_fold.models.mla.MLAttention`); ``norm.weight``;
    ``lm_head.weight`` (tied: the same parameter as ``embed.weight``). A ``"tp"``
    parameter holds this rank's shard (``tp_dim``, ``tp_parts``;
    :func:`moe_fold.parallel.tensor_parallel.shard_tp`).

    Tied embeddings under pp: the last stage holds its own copy of the embedding, also
    named ``embed.weight`` (drawn from the same seed, so equal to the first stage's) and
    marked ``tied_copy = True`` (the grad norm counts it once). After each backward
    ``forward_backward`` sums the two copies' grads over :attr:`embedding_group`, so
    both take the same optimizer steps (:mod:`moe_fold.parallel.pipeline`). Multi-token
    prediction (``model.mtp_num_layers``, :mod:`moe_fold.models.mtp`) runs on the last stage
    as ``mtp.{k}.*`` (depth k+1: ``enorm``, ``hnorm``, ``eh_proj``, ``block``, ``norm``)
    and reads the embedding there: under pp the last stage then holds an embedding copy
    as for tied embeddings.
    """

    def __init__(self, config: Config, groups: ProcessGroups):
        super().__init__()
        m, sp, seed = config.model, config.parallel.sequence_parallel, config.train.seed
        self.config = config
        self.groups = groups
        # The rotary setup, checked once here: a forward does tensor work only.
        self.rotary_dim, self.yarn = rotary_dim(config), yarn_of(m)
        require(rotary_pairs, self.rotary_dim)
        # What the forwards read, as plain attributes: a forward reads no config object.
        self.rope_theta, self.sequence_parallel = m.rope_theta, sp
        self.mtp_num_layers = m.mtp_num_layers
        self.mtp_loss_factor = m.mtp_loss_weight / m.mtp_num_layers if m.mtp_num_layers > 0 else 0.0
        pp = groups.size("pp")
        vpp = vpp_size(config) if pp > 1 else 1
        layers_of = stage_layers(m.num_layers, pp, vpp, config.parallel.pp_layers if pp > 1 else None)
        # Chunk c of this rank is virtual stage stages[c]; stage 0 embeds, the last one ends in the loss.
        self.stages = rank_stages(pp, vpp, groups.rank_in("pp"))
        self.num_stages = pp * vpp
        self.stage_layer_ids = [layers_of[s] for s in self.stages]
        first, last = 0 in self.stages, self.num_stages - 1 in self.stages
        # DSA under pp with GLM-5's shared layers: where a stage begins with a shared layer,
        # every stage boundary (the pipeline's one activation shape) carries the selection of
        # the last full layer before it. Per chunk: the full layer whose selection comes with
        # its input, and the one its output carries (None: none).
        types = m.indexer_types if m.dsa else None
        carries = types is not None and any(types[layers_of[s][0]] == "shared" for s in range(1, pp * vpp))
        self.selection_in = [_last_full(types, ids[0]) if carries and s > 0 else None
                             for s, ids in zip(self.stages, self.stage_layer_ids)]
        self.selection_out = [_last_full(types, ids[-1] + 1) if carries and s < self.num_stages - 1 else None
                              for s, ids in zip(self.stages, self.stage_layer_ids)]
        self.hidden_size, self.tp_rank = m.hidden_size, groups.rank_in("tp")

        # The last stage reads the embedding for a tied head or for the MTP depths' inputs.
        shares_embedding = m.tie_embeddings or m.mtp_num_layers > 0
        self.embed: Optional[VocabParallelEmbedding] = None
        if first or (last and shares_embedding):
            self.embed = VocabParallelEmbedding(m.vocab_size, m.hidden_size, groups.tp, sp,
                                                std=m.init_std, seed=init_seed(seed, "embed"))
            if not first:
                self.embed.weight.tied_copy = True
        self.layers = Layers({i: make_block(config, groups, i) for ids in self.stage_layer_ids for i in ids})
        self.norm: Optional[RMSNorm] = None
        self.lm_head: Optional[ColumnParallelLinear] = None
        if last:
            self.norm = RMSNorm(m.hidden_size, m.norm_eps, "tp_sum" if sp else "replicated", m.norm_zero_centred)
            # Tied: the head is the embedding's own parameter (same vocab split over tp).
            tied = self.embed.weight if m.tie_embeddings else None
            self.lm_head = ColumnParallelLinear(m.hidden_size, m.vocab_size, groups.tp, sp, std=m.init_std,
                                                seed=init_seed(seed, "lm_head"), weight=tied)
        self.mtp: Optional[MTP] = None
        if last and m.mtp_num_layers > 0:
            self.mtp = MTP(config, [Block(config, groups, m.num_layers + k, make_mlp(config, groups, m.num_layers + k))
                                    for k in range(m.mtp_num_layers)])
        # Collective over the world (every rank builds its model): the {first, last} stage pair.
        self.embedding_group = create_embedding_group(groups) if pp > 1 and shares_embedding else None

    def boundary_width(self, seq_local: int) -> int:
        """The last dim of the hidden states between pipeline stages, whose micro-batches
        hold ``seq_local`` tokens of each sequence: the hidden size, plus a carried DSA
        selection (a bit per key of the whole sequence, ``seq_local * cp``, eight an element)."""
        carries = any(c is not None for c in self.selection_in + self.selection_out)
        return self.hidden_size + (-(-seq_local * self.groups.size("cp") // 8) if carries else 0)

    def _pack_selection(self, x: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """``x [S_local(/tp), B, H]`` and a selection, bool ``[B, S_local, L]`` (the same on
        every tp rank) -> ``[S_local(/tp), B, H + ceil(L/8)]``: the selection's bits, eight
        keys a value in ``x``'s dtype (integers up to 255, exact in any float dtype), this tp
        rank's sequence slice under SP."""
        sel = selected.transpose(0, 1)  # [S_local, B, L]
        if self.sequence_parallel:
            sel = sel.chunk(self.groups.size("tp"), dim=0)[self.tp_rank]  # [S_local/tp, B, L]
        sel = F.pad(sel.to(torch.uint8), (0, -sel.shape[-1] % 8))
        bits = sel.unflatten(-1, (-1, 8)).long() << torch.arange(8, device=sel.device)  # [S, B, L/8, 8]
        return torch.cat([x, bits.sum(-1).to(x.dtype)], dim=-1)

    def _unpack_selection(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_pack_selection`'s inverse: the hidden states and the bool selection."""
        h, packed = x.split([self.hidden_size, x.shape[-1] - self.hidden_size], dim=-1)
        packed = packed.detach()
        if self.sequence_parallel:
            packed = gather_from_sequence_region(packed, self.groups.tp, dim=0)  # [S_local, B, L/8]
        keys = packed.shape[0] * self.groups.size("cp")  # L: the whole sequence
        bits = (packed.long().unsqueeze(-1) >> torch.arange(8, device=packed.device)) & 1  # [S_local, B, L/8, 8]
        return h, bits.flatten(-2)[..., :keys].transpose(0, 1) > 0

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = next(self.parameters()).dtype
        return cos_sin(positions, self.rotary_dim, self.rope_theta, dtype, self.yarn)

    def _default_positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[S_local]``: this rank's zigzag shard of ``0..S-1`` (``arange`` without cp)."""
        cp = self.groups.size("cp")
        return zigzag_positions(input_ids.shape[1] * cp, self.groups.rank_in("cp"), cp, device=input_ids.device)

    def documents(self, cu_seqlens: torch.Tensor, token_mask: Optional[torch.Tensor],
                  local_shape: tuple[int, int]) -> Optional[Documents]:
        """A micro-batch's packed documents in this layout (None when each row is one
        sequence of real tokens): ``cu_seqlens`` over the whole (unsharded) ``B*S``
        positions, ``token_mask`` bool ``[B, S_local]`` (None: all real), ``local_shape``
        ``(B, S_local)`` of this rank's inputs."""
        B, s_local = local_shape
        cp, tp = self.groups.size("cp"), self.groups.size("tp")
        doc_ids = doc_ids_from_cu_seqlens(cu_seqlens, B, s_local * cp)  # on cu_seqlens' device (the host)
        starts = None
        if doc_ids is not None:
            device = next(self.parameters()).device
            # Made from the host's ids here, once per micro-batch: no layer reads the device back.
            starts = sequence_starts(doc_ids, self.groups.cp, device)
            doc_ids = doc_ids.to(device, non_blocking=True)
        # An all-true mask is not turned into None here: that would read it back from the
        # device every micro-batch; the loader gives None when no token is padding.
        mask = router_token_mask(token_mask, self.groups.rank_in("tp"), tp, self.sequence_parallel)
        if doc_ids is None and mask is None:
            return None
        return Documents(doc_ids, self.groups.cp, mask, starts)

    def _chunk_hidden(self, chunk: int, x: Optional[torch.Tensor], input_ids: torch.Tensor,
                      positions: torch.Tensor, docs: Optional[Documents] = None,
                      rotary: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                      loss_scale: float = 1.0) -> torch.Tensor:
        """The hidden states ``[S_local, B, H]`` after chunk ``chunk``'s layers; stage 0
        embeds ``input_ids`` ``[B, S_local]``, the others start from ``x``. ``rotary``:
        the ``(cos, sin)`` of ``positions`` when the caller made them (the MTP depths
        reuse them). ``loss_scale``: see :meth:`forward`."""
        cos, sin = rotary if rotary is not None else self._rotary(positions)
        if self.stages[chunk] == 0:
            x = self.embed(input_ids.t())  # [S_local, B, H]
        selections: dict = {}  # DSA: each full layer's selection, for the shared layers after it
        if self.selection_in[chunk] is not None:
            x, selections[self.selection_in[chunk]] = self._unpack_selection(x)
        for i in self.stage_layer_ids[chunk]:
            x = self.layers[i](x, cos, sin, docs, positions=positions, loss_scale=loss_scale, selections=selections)
        if self.selection_out[chunk] is not None:
            x = self._pack_selection(x, selections[self.selection_out[chunk]])
        return x

    def _whole_model_positions(self, what: str, input_ids: torch.Tensor,
                               positions: Optional[torch.Tensor]) -> torch.Tensor:
        if self.num_stages > 1:
            raise RuntimeError(f"Transformer.{what} runs a whole model, but this rank holds pipeline stages "
                               f"{self.stages} of {self.num_stages}; use moe_fold.training.step.forward_backward")
        return self._default_positions(input_ids) if positions is None else positions

    def mtp_targets(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
                    docs: Optional[Documents]) -> MTPTargets:
        """The MTP depths' shifted inputs, labels and masks of this rank's micro-batch
        (:func:`moe_fold.models.mtp.mtp_targets`); a collective over cp."""
        doc_ids = docs.doc_ids if docs is not None else None
        return mtp_targets(input_ids, labels, loss_mask, doc_ids, self.mtp_num_layers, self.groups.cp)

    def _loss(self, x: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
              num_loss_tokens: Optional[Union[float, torch.Tensor]], input_ids: torch.Tensor,
              rotary: tuple, docs: Optional[Documents], mtp: Optional[MTPTargets],
              loss_scale: float) -> torch.Tensor:
        """The LM loss of the last hidden states ``x``; with MTP, the depths' weighted loss
        rides on it through autograd (:func:`~moe_fold.dispatch.aux_losses.attach_loss`), so
        the value returned stays the LM loss."""
        loss = self._token_loss(self.norm(x), labels, loss_mask, num_loss_tokens)
        if self.mtp is None:
            return loss
        if mtp is None:
            mtp = self.mtp_targets(input_ids, labels, loss_mask, docs)
        depth_losses = self.mtp(x, self.embed, mtp, *rotary, docs, self._token_loss, loss_scale)  # [D]
        return attach_loss(loss, depth_losses.sum(), self.mtp_loss_factor)

    def _token_loss(self, normed: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
                    num_loss_tokens: Optional[Union[float, torch.Tensor]]) -> torch.Tensor:
        logits = self.lm_head(normed)  # [S, B, V/tp]
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

    def logits(self, input_ids: torch.Tensor, positions: Optional[torch.Tensor] = None,
               docs: Optional[Documents] = None) -> torch.Tensor:
        """Full-vocab logits ``[B, S_local, V]`` (gathered over tp) of this rank's tokens:
        for evaluation and tests, not training."""
        positions = self._whole_model_positions("logits", input_ids, positions)
        x = self._chunk_hidden(0, None, input_ids, positions, docs)
        local = self.lm_head(self.norm(x))  # [S, B, V/tp]
        return gather_from_tp_region(local, self.groups.tp, dim=-1).transpose(0, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, positions: Optional[torch.Tensor] = None,
                loss_mask: Optional[torch.Tensor] = None,
                num_loss_tokens: Optional[Union[float, torch.Tensor]] = None,
                docs: Optional[Documents] = None, mtp: Optional[MTPTargets] = None,
                loss_scale: float = 1.0) -> torch.Tensor:
        """This rank's loss for ``input_ids``/``labels`` ``[B, S_local]`` (labels already shifted;
        under cp this rank's zigzag shard of each sequence).

        ``positions``: ``[S_local]`` or ``[B, S_local]`` (default: this rank's zigzag shard
        of ``arange(S)``, ``arange(S_local)`` without cp);
        ``loss_mask``: ``[B, S_local]``, 0 where a token does not count (padding).
        ``num_loss_tokens``: the unmasked tokens of the whole global batch (every dp x cp
        rank, every micro-batch); None counts this micro-batch over dp x cp.
        ``docs``: packed documents (:meth:`documents`); None: one sequence per row.
        ``mtp``: the MTP depths' targets (:meth:`mtp_targets`, with the global batch's
        counts); None: built here, counted over this micro-batch.
        ``loss_scale``: the factor on the router losses' gradients, this micro-batch's share
        of the step (``1/num_microbatches``, passed by
        :func:`moe_fold.training.step.forward_backward`); 1 for a single micro-batch.

        The result is ``sum(token losses * mask) * (dp*cp) / num_loss_tokens``: averaging
        it, and its grads, over dp x cp (what ``moe_fold.training.grads.sync_grads`` does) gives the
        mean loss over the global batch and its exact gradient, whatever the number of
        unmasked tokens on each rank; summing grads over micro-batches before the sync
        keeps it exact when ``num_loss_tokens`` covers them all.
        """
        positions = self._whole_model_positions("forward", input_ids, positions)
        rotary = self._rotary(positions)
        x = self._chunk_hidden(0, None, input_ids, positions, docs, rotary, loss_scale)
        return self._loss(x, labels, loss_mask, num_loss_tokens, input_ids, rotary, docs, mtp, loss_scale)

    def chunk_forward(self, chunk: int, x: Optional[torch.Tensor], input_ids: torch.Tensor, labels: torch.Tensor,
                      positions: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                      num_loss_tokens: Optional[Union[float, torch.Tensor]] = None,
                      docs: Optional[Documents] = None, mtp: Optional[MTPTargets] = None,
                      loss_scale: float = 1.0) -> torch.Tensor:
        """Virtual stage ``stages[chunk]`` of one micro-batch (fields as in :meth:`forward`).

        The first stage embeds ``input_ids`` (``x`` is ignored); the others take the hidden
        states ``x [S_local, B, H]`` (``S_local/tp`` under SP) of the stage before. Returns
        the hidden states for the next stage, or on the last stage the loss of
        :meth:`forward`."""
        rotary = self._rotary(positions)
        x = self._chunk_hidden(chunk, x, input_ids, positions, docs, rotary, loss_scale)
        if self.stages[chunk] == self.num_stages - 1:
            return self._loss(x, labels, loss_mask, num_loss_tokens, input_ids, rotary, docs, mtp, loss_scale)
        return x


def _last_full(types: list[str], layer: int) -> int:
    """The last layer before ``layer`` that runs its DSA indexer (``types[0]`` is full)."""
    return max(i for i in range(layer) if types[i] == "full")


def build_model(config: Config, groups: ProcessGroups) -> Transformer:
    """This rank's part of the model of ``config`` in the layout of ``groups``
    (``ProcessGroups.single_process()`` for the one-process model), recomputing what
    ``train.recompute`` says. Under pp with tied embeddings every rank must call it (it
    creates the embedding group)."""
    model = Transformer(config, groups)
    set_recompute(model, config.train.recompute)
    return model


# train.recompute -> the recompute attribute of: a dense block, an MoE block, the routed
# experts, a shared expert (whose "all" is "halves" when the MoE layer overlaps them).
_RECOMPUTE = {
    "none": ("none", "none", "none", "none"),
    "full": ("all", "attention", "all", "all"),
    "moe": ("none", "none", "all", "all"),
    "expert_act": ("none", "none", "activation", "none"),
}


def compile_blocks(model: nn.Module, backend: str = "inductor") -> None:
    """``train.compile=blocks``: compile every :class:`Block` of ``model`` (MTP depths
    included) in place, each on its own with ``fullgraph=True`` (a graph break is an error,
    not a silent fallback), as torchtitan compiles its TransformerBlocks. Parameter names
    and the module tree stay as they are, so checkpoints, gradient buckets and the
    pipeline see the same model. The dropless MoE layer's per-expert counts become unbacked
    symbolic sizes: the caller runs the model under
    ``torch._dynamo.config.patch(capture_scalar_outputs=True)``
    (:func:`moe_fold.training.train.train` does). ``backend``: torch.compile's (tests use
    ``aot_eager``: the same graphs, fake kernels and autograd formulas without Inductor's
    code generation)."""
    for module in model.modules():
        if isinstance(module, (Block, ShortcutMoEBlock)):
            module.compile(fullgraph=True, backend=backend)


def set_recompute(model: nn.Module, mode: str) -> None:
    """Set the recompute attributes (:mod:`moe_fold.models.recompute`) of every module of
    ``model`` (a whole model or any part, e.g. one MoE layer) for ``train.recompute=mode``:

    - ``none``: nothing is recomputed;
    - ``full``: every dense block whole; in an MoE block the attention (after its norm)
      and the MoE layer's expert computation (routed experts and shared expert). The
      router and the dispatcher stay outside: the router counts tokens for the expert
      bias and the global aux loss as a side effect of its forward, which a second
      forward would count twice (and recomputing the dispatcher would redo its
      all-to-alls);
    - ``moe``: the MoE layers' expert computation only (routed and shared experts; with
      ``moe.shared_expert_overlap`` the shared expert's two halves each, keeping the
      SwiGLU output between them);
    - ``expert_act``: inside the routed experts, the SwiGLU activation and the fc2 GEMM
      that consumes it.
    """
    dense_block, moe_block, experts, shared = _RECOMPUTE[mode]  # a mode config.validate accepts
    for module in model.modules():
        if isinstance(module, Block):
            module.recompute = moe_block if isinstance(module.mlp, MoELayer) else dense_block
        if isinstance(module, ShortcutMoEBlock):
            module.recompute = moe_block  # "none" or "attention": its dense MLPs keep their activations
        if isinstance(module, Experts):
            module.recompute = experts
        if isinstance(module, MoELayer) and module.shared_expert is not None:
            # With the overlap the layer runs the halves apart (under the dispatch and the
            # combine): each is recomputed on its own.
            module.shared_expert.recompute = "halves" if shared == "all" and module.shared_expert_overlap else shared

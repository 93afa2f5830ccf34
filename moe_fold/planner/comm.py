"""Bytes one rank sends per training step, per group kind, by the counting rules of
:mod:`moe_fold.comm` (its module docstring): all-gather ``B(shard) (n-1)``, reduce-scatter
``B(input) - B(own slice)``, all-reduce ``floor(2 (n-1) B / n)``, all-to-all the rows sent
to other ranks, point-to-point ``B``; forward and backward both count.

A training step is what :func:`moe_fold.training.train.train` runs per global batch: forward and
backward of ``m = global_batch / (micro_batch * dp)`` micro-batches, then
:func:`moe_fold.training.optim.apply_gradients` (gradient all-reduce in float32 buckets, the global
norm, the optimizer step, whose distributed variant all-gathers the float32 parameters).
The loop's logging reductions (loss, token counts, routing statistics) are left out.

Per micro-batch and layer (``X`` the bytes of one ``[s/cp, b, H]`` activation):

- tp, sequence parallel: each column-parallel linear all-gathers its input forward and
  reduce-scatters its input's grad backward; each row-parallel linear reduce-scatters
  forward and all-gathers backward: ``X (tp-1)/tp`` each, 4 per column/row pair
  (attention; dense MLP; shared expert), 2 for the embedding and 2 for the head; plus the
  vocab-parallel cross entropy's three float32 ``[s/cp, b]`` all-reduces. Without SP: one
  all-reduce of ``X`` per linear (backward for column, forward for row). Recompute reruns
  the forward collectives of what it recomputes, up to the last op whose saved tensors the
  backward needs (torch's non-reentrant checkpoints stop there): a checkpoint ending in a
  row-parallel linear does not redo its reduce-scatter (all-reduce without SP), so a
  recomputed attention (MLA: its latents' gathers) or shared expert reruns only its
  gather, and a dense block under ``full`` also the attention's reduce-scatter before its
  MLP (Megatron's reentrant checkpoints rerun all of it). moe-fold keeps the gathered input for
  the weight gradient, so unlike Megatron the backward does not all-gather it again.
  A shortcut_moe block (LongCat-Flash) counts two attentions and two dense MLPs, its
  attentions recomputed under ``full``, its dense MLPs never. A DSA layer with its own
  indexer adds, per forward and per recompute of its attention, the gather of its detached
  inputs (hidden states and q latent, under SP) and the all-reduce of its KL target
  (float32 ``[b, s/cp, seq]``).
- ep (all-to-all dispatcher): dispatch sends ``sent`` rows and combine sends back the
  ``received`` ones, both again in the backward: ``2 (sent + received) H a`` bytes, plus
  the routing probs (router dtype) forward (``sent``) and their grads backward
  (``received``). Balanced routing: ``sent = received = T topk (ep-1)/ep`` with ``T =
  s b/(cp tp)`` tokens per rank (the dispatcher's wire accounting,
  :class:`moe_fold.dispatch.interface.WireBytes`, counts the forward half).
- etp: all-gather of the ``held`` rows (and probs) after the all-to-all, reduce-scatter of
  the outputs before it, and their backward counterparts.
- etp_ep: the per-expert int64 count exchange (forward only; none when padded).
- tp_cp / tp_dp_cp: the router's loss statistics (float64), per MoE layer.
- cp: the K/V ring of ring attention (or the all-to-alls of a2a attention; DSA's
  all-gathers of its keys and values), forward and backward (:func:`_cp_attention_bytes`).
- pp: one activation ``[s/(cp g), b, H]`` per virtual-stage boundary forward, its grad
  backward.

Per step, the float32 gradient buckets (:func:`moe_fold.planner.memory.grad_buckets`,
``parallel.grad_bucket_numel`` elements) of dp_cp (tp-split and replicated parameters),
tp_dp_cp (``tp_sum`` ones: norms and router under SP) and edp (experts): each all-reduced,
or with the distributed optimizer reduce-scattered (the bucket less the rank's owned share,
:func:`moe_fold.planner.memory.shard_sizes`) and its owned share all-gathered to the others
of the group: the same volume as the all-reduce, the least a step can send. The norm's
float32 scalars: over tp, etp_ep (with the per-expert squares, see ``grad_norm``) and pp, or with the distributed optimizer over tp_dp_cp
(every rank of the stage) and pp. With tied embeddings or MTP over pp, the embedding-grad
all-reduce between the first and last stage.

Multi-token prediction (``model.mtp_num_layers`` = D, on the last stage): each depth's
block moves what a layer of its kind moves (tp, cp, ep, etp), and its embedding and head
what the first stage's embedding and the head do over tp; the shifted targets are
all-gathered over cp once per micro-batch (ids, labels and mask as float64).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from moe_fold.config import Config, dp_size, edp_size, etp_size, vpp_size
from moe_fold.planner.memory import grad_buckets, shard_sizes
from moe_fold.planner.model import act_bytes, dims, held_rows_per_token, param_manifest, router_bytes, stage_blocks

__all__ = ["GRAD_BYTES", "Routing", "uniform_routing", "moe_layer_bytes", "microbatch_bytes",
           "step_bytes"]

GRAD_BYTES = 4  # gradients are synced (and masters kept) in float32



def _all_reduce(nbytes: float, n: int) -> float:
    if n <= 1:
        return 0
    if isinstance(nbytes, int):
        return 2 * (n - 1) * nbytes // n
    return 2 * (n - 1) * nbytes / n


def _share(nbytes: float, n: int) -> float:
    """``B (n-1)/n``: an all-gather of ``B/n`` shards, or a reduce-scatter of ``B``."""
    if isinstance(nbytes, int) and nbytes % n == 0:
        return nbytes // n * (n - 1)
    return nbytes * (n - 1) / n


@dataclass(frozen=True)
class Routing:
    """Rows one rank moves in one MoE layer and micro-batch: ``sent`` to and ``received``
    from other ep ranks in the all-to-all, ``held`` after it (its own included; the input
    of the etp all-gather), ``held_etp`` summed over its etp group; ``meta`` bytes of
    probs (and dedup's routing map) per row."""
    sent: float
    received: float
    held: float
    held_etp: float
    meta: int


def uniform_routing(config: Config) -> Routing:
    """The rows of :class:`Routing` when every expert gets the same share of every rank's
    tokens (the planner's assumption). Dropless: ``topk`` rows per token. Padded: ``C``
    rows per expert from every rank (``C = ceil(T topk/E * capacity_factor)``). Dedup:
    one row per token and destination rank, taken by a token with probability ``1 -
    C(E - E/ep, topk)/C(E, topk)`` (uniform random expert sets)."""
    d, p, moe = dims(config), config.parallel, config.moe
    ep, etp = p.ep, etp_size(config)
    tokens = config.train.micro_batch_size * d.seq // (p.cp * p.tp)
    rb = router_bytes(config)
    local = d.experts // ep
    if moe.pad_to_capacity and moe.capacity_factor is not None:
        cap = math.ceil((tokens * d.topk / d.experts) * moe.capacity_factor)
        rows, meta = cap * d.experts, rb
    elif moe.dedup:
        # Expert sets drawn over every router column, zero experts included (held by no rank).
        columns = d.experts + d.zero_experts
        rows = tokens * ep * (1 - math.comb(columns - local, d.topk) / math.comb(columns, d.topk))
        meta = 2 * local * rb
    else:
        # Slots on zero experts stay where the token is: no row leaves.
        rows, meta = tokens * held_rows_per_token(config), rb
    off = rows * (ep - 1) / ep
    return Routing(sent=off, received=off, held=rows, held_etp=rows * etp, meta=meta)


def moe_layer_bytes(config: Config, routing: Routing) -> dict[str, float]:
    """Bytes of one MoE layer's dispatch and combine, forward and backward, for one
    micro-batch on one rank: ``ep``, ``etp`` and ``etp_ep`` (count exchange)."""
    d, p, moe = dims(config), config.parallel, config.moe
    ep, etp = p.ep, etp_size(config)
    row = d.expert_width * act_bytes(config)  # a latent MoE sends latent rows
    out: dict[str, float] = {}
    if ep > 1:
        moved = routing.sent + routing.received
        out["ep"] = 2 * moved * row + moved * routing.meta
    if etp > 1:
        gathered = routing.held * (etp - 1)  # all-gather forward, and its backward (combine's)
        scattered = routing.held_etp - routing.held  # reduce-scatter forward, and its backward
        out["etp"] = 2 * (gathered + scattered) * row + (gathered + scattered) * routing.meta
    if ep * etp > 1 and not moe.pad_to_capacity:
        counts = d.experts + (ep if moe.dedup else 0)
        out["etp_ep"] = 8 * counts * (ep * etp - 1)
    return out


def microbatch_bytes(config: Config, world_size: int, pp_rank: int, recompute: str,
                     routing: Optional[Sequence[Routing]] = None,
                     implementation: str = "moe-fold") -> dict[str, float]:
    """Bytes one rank of stage ``pp_rank`` sends for one micro-batch, forward and backward,
    per group kind. ``implementation``: ``moe-fold`` (non-reentrant checkpoints, which
    stop their recompute at the last saved tensor) or ``megatron`` (its reentrant
    checkpoints rerun the whole region). ``routing``: one :class:`Routing` per MoE layer of
    the stage, in layer order (default :func:`uniform_routing` for each)."""
    d, p, moe = dims(config), config.parallel, config.moe
    tp, cp = p.tp, p.cp
    sp = p.sequence_parallel and tp > 1
    a = act_bytes(config)
    b, s = config.train.micro_batch_size, d.seq // cp
    x = b * s * d.hidden * a  # one [s/cp, b, H] activation
    out: dict[str, float] = defaultdict(float)

    def pair() -> float:
        """A column-parallel linear followed by a row-parallel one."""
        return 4 * _share(x, tp) if sp else 2 * _all_reduce(x, tp)

    # MLA enters the tp region with its latents (q's, or the hidden states without
    # q_lora_rank, the kv latent and the rotary key), not the hidden states, and leaves it
    # like any row-parallel linear.
    entered = b * s * ((d.q_lora or d.hidden) + d.kv_lora + d.rope_dim) * a if d.mla else x

    def attention() -> float:
        """The attention's tp traffic, forward and backward."""
        if sp:
            return 2 * (_share(entered, tp) + _share(x, tp))
        return _all_reduce(x, tp) + _all_reduce(entered, tp)

    def recomputed(enters: float, leaves: bool) -> float:
        """A recomputed column/row region's forward collectives: the gather of its
        ``enters`` bytes (none without SP: the copy into the region is the identity
        forward), and its reduce-scatter (all-reduce) only when ``leaves``: a saved tensor
        after it is recomputed too."""
        gather = _share(enters, tp) if sp else 0
        return gather + ((_share(x, tp) if sp else _all_reduce(x, tp)) if leaves else 0)

    norm_projection = d.qk_norm and config.model.qk_norm_scope == "projection"
    layers = stage_blocks(config, pp_rank)  # the MTP depths' blocks too, on the last stage
    moe_layers = [i for i in layers if d.moe_flags[i]]
    last = pp_rank == p.pp - 1
    if routing is None:
        routing = [uniform_routing(config)] * len(moe_layers)
    elif len(routing) != len(moe_layers):
        raise ValueError(f"routing has {len(routing)} entries, expected one per MoE layer of stage "
                         f"{pp_rank} ({len(moe_layers)})")
    # DSA's indexer reads the hidden states and the q latent detached (no backward), gathered
    # over tp under SP, and its KL target, the float32 [b, s, seq] sum of the attention's
    # probabilities over heads, is all-reduced over tp; both run again when the attention is
    # recomputed.
    indexer_inputs = _share(b * s * (d.hidden + d.q_lora) * a, tp) if sp else 0
    indexer_target = _all_reduce(b * s * d.seq * 4, tp) if config.model.dsa_indexer_loss_weight > 0 else 0
    if tp > 1:
        for i in layers:
            is_moe = d.moe_flags[i]
            # A shortcut_moe block: two attention sublayers, each with a dense MLP (never
            # recomputed), beside its MoE.
            shortcut = d.shortcut and i < d.layers
            sublayers = 2 if shortcut else 1
            runs = 1 + (recompute == "full")
            if i not in d.no_mixer:  # a single-mixer MLP or MoE layer has no token mixer
                out["tp"] += sublayers * attention()
            if i in d.indexer:
                out["tp"] += runs * (indexer_inputs + indexer_target)
            if norm_projection:  # OLMoE's q and k norms: their sums of squares, forward and backward
                out["tp"] += (4 + 2 * (recompute == "full")) * _all_reduce(b * s * 4, tp)
            dense_mlps = 2 if shortcut else int(not is_moe and i not in d.no_mlp)  # a lone mixer has no MLP
            out["tp"] += (dense_mlps + (is_moe and d.shared_ffn > 0)) * pair()  # dense MLPs, shared expert
            whole = implementation == "megatron"
            if recompute == "full":
                # A dense block is one checkpoint: its MLP's input follows the attention's
                # reduce-scatter. An MoE block's attention is a checkpoint of its own.
                out["tp"] += sublayers * recomputed(entered, leaves=whole or not is_moe)
            if (recompute == "full" or (recompute == "moe" and is_moe)) and (not is_moe or d.shared_ffn > 0):
                out["tp"] += recomputed(x, leaves=whole)
        embeddings = (pp_rank == 0) + (d.mtp if last else 0)
        heads = (1 + d.mtp) if last else 0
        out["tp"] += embeddings * (2 * _share(x, tp) if sp else _all_reduce(x, tp))
        out["tp"] += heads * (2 * _share(x, tp) if sp else _all_reduce(x, tp))
        out["tp"] += heads * 3 * _all_reduce(b * s * 4, tp)  # cross entropy: max, target logit, sum of exp
    if cp > 1 and last and d.mtp > 0:
        out["cp"] += _share(3 * 8 * b * d.seq, cp)  # the MTP targets' all-gather
    if cp > 1:
        for i in layers:
            forward, backward = _cp_attention_bytes(config, i)
            out["cp"] += forward + backward + (forward if recompute == "full" else 0)
    dp = dp_size(config, world_size)
    layer_bytes: dict[Routing, dict[str, float]] = {}  # every layer of balanced routing is the same
    for r in routing:
        if r not in layer_bytes:
            layer_bytes[r] = moe_layer_bytes(config, r)
        for kind, nbytes in layer_bytes[r].items():
            out[kind] += nbytes
        stats = 8 * (2 * (d.experts + d.zero_experts) + 1)  # counts, tokens, prob sums (float64), every column
        # The per-sequence aux loss packs the same per sequence beside the micro-batch's.
        packed = (moe.aux_loss_coeff > 0) + (moe.seq_aux_loss_coeff > 0) * config.train.micro_batch_size
        if packed:
            out["tp_cp"] += _all_reduce(packed * stats, tp * cp)
        if moe.z_loss_coeff > 0:
            out["tp_cp"] += _all_reduce(16, tp * cp)
        if moe.global_aux_loss_coeff > 0:
            out["tp_dp_cp"] += _all_reduce(stats, tp * dp * cp)
    if p.pp > 1:
        v = vpp_size(config)
        g = tp if sp else 1
        message = b * s // g * d.hidden * a
        sends = (v - (pp_rank == p.pp - 1)) + (v - (pp_rank == 0))
        out["pp"] += sends * message
    return {k: v for k, v in out.items() if v}


def _cp_attention_bytes(config: Config, layer: int) -> tuple[float, float]:
    """Forward and backward bytes of layer ``layer``'s context-parallel attention for one
    micro-batch. Ring (:mod:`moe_fold.parallel.ring_attention`): the local K/V pass ``cp-1`` hops
    forward; backward they go round again with float32 dK/dV accumulators, which take one
    more hop home. A2a (:mod:`moe_fold.parallel.context_parallel`): q, k, v (kv heads repeated to
    ``lcm(kv_heads, cp)``) and the output each all-to-all'd, ``(cp-1)/cp`` of them leaving;
    the backward the same. MLA: k is ``qk_nope + qk_rope`` wide per head, v and the
    output ``v_head_dim``. DSA (:class:`moe_fold.models.dsa.DSAttention`, whatever
    ``parallel.cp_kind``): k, v and, with the layer's own indexer, the indexer's keys
    ``[s/cp, index_head_dim]`` are all-gathered over cp, and their grads reduce-scattered
    back (the indexer's keys only when its KL loss trains them)."""
    d, p = dims(config), config.parallel
    cp, a = p.cp, act_bytes(config)
    tokens = config.train.micro_batch_size * d.seq // cp
    heads, kv_heads = d.heads // p.tp, d.kv_heads // p.tp
    if d.dsa:
        kv = (cp - 1) * tokens * d.kv_pass_size // p.tp * a
        index_keys = (cp - 1) * tokens * d.index_dim * a if layer in d.indexer else 0
        return kv + index_keys, kv + (index_keys if d.index_loss else 0)
    if d.mla:  # every head has its own k (qk wide) and v (v wide): no repeats under a2a
        kv = tokens * d.kv_pass_size // p.tp
        if p.cp_kind == "ring":
            return (cp - 1) * kv * a, (cp - 1) * kv * a + cp * kv * 4
        moved = (d.q_size + d.out_size) // p.tp * tokens * a * (cp - 1) / cp + kv * a * (cp - 1) / cp
        return moved, moved
    if p.cp_kind == "ring":
        kv = 2 * tokens * kv_heads * d.head_dim
        return (cp - 1) * kv * a, (cp - 1) * kv * a + cp * kv * 4
    kv_heads = kv_heads * (cp // math.gcd(kv_heads, cp))
    moved = (2 * heads + 2 * kv_heads) * tokens * d.head_dim * a * (cp - 1) / cp
    return moved, moved


def step_bytes(config: Config, world_size: int, pp_rank: int = 0, recompute: Optional[str] = None,
               distributed: Optional[bool] = None,
               routing: Optional[Sequence[Sequence[Routing]]] = None,
               shard_ranks: Optional[dict[str, int]] = None, implementation: str = "moe-fold") -> dict[str, float]:
    """Bytes one rank of stage ``pp_rank`` sends in one training step, per group kind
    (``implementation``: see :func:`microbatch_bytes`).

    ``recompute`` and ``distributed`` default to ``train.recompute`` and
    ``optimizer.distributed``. ``routing``: per micro-batch, one :class:`Routing` per MoE
    layer of the stage (default balanced). ``shard_ranks``: the rank's place in its
    ``dp_cp``, ``tp_dp_cp`` and ``edp`` groups (default 0 in each), which sets how many
    elements it owns and all-gathers under the distributed optimizer."""
    p = config.parallel
    recompute = config.train.recompute if recompute is None else recompute
    distributed = config.optimizer.distributed if distributed is None else distributed
    dp, edp, etp = dp_size(config, world_size), edp_size(config, world_size), etp_size(config)
    t = config.train
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    if routing is not None and len(routing) != micro:
        raise ValueError(f"routing has {len(routing)} micro-batches, the step has {micro}")
    out: dict[str, float] = defaultdict(float)
    for i in range(micro):
        for kind, nbytes in microbatch_bytes(config, world_size, pp_rank, recompute,
                                             None if routing is None else routing[i], implementation).items():
            out[kind] += nbytes

    sizes = {"dp_cp": dp * p.cp, "tp_dp_cp": p.tp * dp * p.cp, "edp": edp}
    ranks = {"dp_cp": 0, "tp_dp_cp": 0, "edp": 0}
    ranks.update(shard_ranks or {})
    manifest = param_manifest(config, pp_rank)
    for group, numels in grad_buckets(config, pp_rank, manifest):
        n = sizes[group]
        if n == 1:
            continue
        nbytes = GRAD_BYTES * sum(numels)
        if distributed:
            # reduce-scatter (all but the owned share sent), then the owned share all-gathered
            own = GRAD_BYTES * shard_sizes(numels, n)[ranks[group]]
            out[group] += nbytes - own + own * (n - 1)
        else:
            out[group] += _all_reduce(nbytes, n)
    if distributed:
        out["tp_dp_cp"] += _all_reduce(4, p.tp * dp * p.cp)  # grad norm: squares of the owned ranges
    else:
        out["tp"] += _all_reduce(4, p.tp)  # grad norm: squares of tp shards
        # ... of expert shards: one scalar and, per expert parameter, a float32 per global expert
        expert_params = sum(1 for e in manifest if e.kind == "expert")
        out["etp_ep"] += _all_reduce(4 * (1 + expert_params * dims(config).experts), etp * p.ep)
    out["pp"] += _all_reduce(4, p.pp)  # ... of every stage
    d = dims(config)
    if (d.tied or d.mtp > 0) and p.pp > 1 and pp_rank in (0, p.pp - 1):
        # The model's own grad is summed (pipeline.all_reduce_embedding_grads), in its dtype:
        # bf16 under train.precision=bf16, not the float32 of the buckets.
        model_grad_bytes = 2 if config.train.precision == "bf16" else 4
        out["embedding"] += _all_reduce(model_grad_bytes * d.vocab * d.hidden // p.tp, 2)
    return {k: v for k, v in out.items() if v}

"""Memory per rank as moe-fold itself keeps it (``Assumptions.implementation="moe-fold"``),
derived from the code of the training path, next to the Megatron-LM reference figures of
:mod:`moe_fold.planner.model` (``"megatron"``, kept for comparison with the papers).

Parameters, gradients and optimizer state, per local parameter (:func:`state_bytes`):

- ``fp32`` and ``bf16-autocast``: float32 weights (4), float32 grads (4), AdamW moments
  ``exp_avg`` and ``exp_avg_sq`` (8): 16 bytes.
- ``bf16`` (:class:`moe_fold.training.precision.MasterWeights`): bf16 model weights (2) and a float32
  master copy (4); the backward writes bf16 grads (2), ``grads_to_master`` makes float32
  master grads (4) that the sync, clipping and optimizer use; moments 8: 20 bytes.
- ``optimizer.distributed`` (:class:`moe_fold.training.optim.AdamW`, ZeRO-1) shards only the moments:
  each sharding group's parameters are flattened in the gradient buckets' order
  (:func:`grad_buckets`, ``parallel.grad_bucket_numel`` elements), each bucket cut into
  nearly equal ranges with cuts inside a parameter moved up to a multiple of
  ``moe_fold.training.buckets.ALIGN`` elements (:func:`owned_by_rank` redoes that
  arithmetic): about ``12 + 8/d`` bytes per parameter under bf16, to the element what the
  optimizer allocates. Masters are not sharded.

Activations, bytes one rank keeps for the backward per local token (what autograd saves,
one count per storage: views of one tensor count once; parameters not at all). ``a`` is
the activation element size (2 under bf16, 4 under fp32), ``rb`` the router's (4, 8 for
float64), ``g`` the sequence-parallel gather factor (tp under SP, else 1):

- RMSNorm (:mod:`moe_fold.models.norm`): its input ``aH`` and the float32 ``rsqrt`` per
  token (4).
- Attention (:class:`moe_fold.models.attention.Attention`, SDPA on one cp rank): the
  gathered qkv input ``aHg``; the qkv output ``a(q+2kv)g/tp`` (SDPA keeps ``v``, a view of
  it); rotated ``q`` and ``k`` ``a(q+kv)g/tp`` (rotary multiplies by constant cos/sin and
  keeps nothing else); SDPA's output ``a q g/tp`` (the projection's input is a view of it)
  and its float32 log-sum-exp ``4 heads g/tp``; QK-norm adds its per-head ``rsqrt``
  ``4 (heads + kv_heads) g/tp`` (its inputs are views of the qkv output); Llama-4's L2
  norm (``qk_norm_scope: l2``, rotary layers) runs in float32 and keeps the float32 q and
  k, ``4 (q + kv) g/tp``. Gated attention (``model.attn_output_gate``: the gate's columns
  come out of the qkv projection and q, k, v are concatenated again without them) adds
  the gate's sigmoid, SDPA's output reshaped and the gated product ``3 a q g/tp``.
- Gated DeltaNet layers (``model.layer_types``): see :func:`_gated_deltanet` (the torch
  recurrence's float32 chunk terms dominate). KDA layers: see :func:`_kda` (its
  per-channel decays make ``[C, C, d]`` float32 tensors) and, for their backward,
  :func:`kda_backward_bytes`.
- Dense MLP (:class:`moe_fold.models.mlp.MLP`): gathered input ``aHg``, fc1 output
  ``2aFg/tp`` (silu and the product keep views of it), silu output ``aFg/tp``, fc2 input
  ``aFg/tp``. relu2 (Nemotron-H): the input, relu's output ``aFg/tp`` (square reads the
  same) and fc2's input ``aFg/tp``.
- Nemotron-H's single-mixer layers: a layer keeps its one mixer's activations and one
  norm's.
- Mamba2 (:class:`moe_fold.models.mamba2.Mamba2`, the chunked torch SSD; ``I`` heads x
  head width, ``Cc`` its conv channels, ``h`` heads, ``N`` state, ``P`` head width, ``C``
  chunk, ``w = 4`` the float32 recurrence; per local token, all but the input over
  ``g/tp``): the gathered input ``aHg``; under fp32 in_proj's output ``a(2I + 2GN + h)``
  (z's silu keeps a view of it) and the conv's padded input, its output and SiLU's ``3aCc``;
  under bf16 ``2aCc`` and x's float32 copy ``wI``; the SSD's B and C per head with their
  transposed, decayed and sliced copies ``5whN`` (one cp rank), x times dt ``wI``, the chunk's decays,
  scores and their product ``3whC``, the states at chunk edges ``whNP/C``, per-head gates
  ``6wh`` and masks ``2C``; the gated norm's ``y``, ``silu(z)`` (and z's float32 copy under
  bf16), their product ``3wI`` (``4wI``), its rsqrt per group, the normed values ``wI``
  (their bf16 cast ``aI``) and out_proj's input ``aI``.
- MoE layer, router (:class:`moe_fold.dispatch.router.Router`): its input in the router
  dtype ``rb H`` (the norm output itself when ``a == rb``). Plain top-k (no groups, no
  expert bias, no renormalisation floor) is one op (:func:`moe_fold.kernels.topk.topk_scores`)
  that keeps its logits ``rb E``, its dense probs ``rb E`` and its bool routing map ``E``.
  Otherwise the torch ops keep the stable sort's indices ``8E`` (int64); the top-k softmax
  output ``rb k`` (post-softmax) or the softmax over all experts ``rb E`` (pre-softmax), or
  the sigmoid ``rb E`` and, with top-k > 1, the sort values and the sum it normalises by
  ``rb (E + 1)`` (with the expert bias the top-k scores gathered unbiased and their sum,
  ``rb (k + 1)``). The aux losses' softmax ``rb E`` (any of aux / seq_aux / global_aux on),
  ``seq_ids`` ``8`` (seq_aux); the z-loss's log-sum-exp ``rb`` and its logits ``rb E``
  (the top-k op's own, counted once, when it keeps them). Per micro-batch, under bf16,
  the float32 copy of the router weight ``4 E H``.
- Dispatcher (:class:`moe_fold.dispatch.alltoall.AllToAllDispatcher`, dropless): per routed
  row on the source rank ``16`` (:func:`moe_fold.kernels.permute.routing_indices`: the rows'
  source tokens, which the gather and the unpermute keep, and the index of each row's prob,
  which the probs' gather keeps, int64 each); per held row, when chunks are sorted (two or
  more of etp, ep and the local experts above 1), ``24`` (the int64 gather index of the
  rows and of the probs, and of the rows on the way back).
- Experts (:class:`moe_fold.models.experts.Experts`), per held row (``k etp`` per local
  token with balanced routing: the etp group's rows reach every etp rank): fc1 input
  ``aH``, fc1 output ``2aF/etp``, the row's prob ``rb``, fc2 input ``aF/etp``. With
  ``moe.score_on_input`` (Llama-4) the row before its prob scales it, ``aH`` more (the
  product keeps it for the prob's gradient; the scaled row is fc1's input).; relu2
  experts keep relu's float32 output and its square ``8F/etp`` instead of fc1's output.
- Shared expert: a dense MLP of width ``F_s``; with its gate, the gate's input ``aH``
  (the norm output), the sigmoid ``a`` and the shared output ``aH``. The local norm
  output is kept once, by whichever of the router (``a == rb``), the gate or the
  ungathered shared MLP (``g == 1``) reads it.
- Latent MoE (``moe.latent_size = L``): the expert rows are ``L`` wide (``aL`` where the
  terms above say ``aH``); the projection into the latent width keeps its input (the norm
  output, kept once as above), the projection back its input, the combined rows ``aL``;
  neither is recomputed.
- Zero-computation experts: no row is sent for a slot on one (the dispatcher's and the
  experts' terms count ``topk E/(E+Z)`` rows per token,
  :func:`moe_fold.planner.model.held_rows_per_token`); their output, the layer's input
  times the token's summed gate weight on them, keeps that input (the norm output, kept
  once as above) and the weight ``rb``.
- Embedding (first stage): the local ids and the out-of-shard mask, ``9g``.
- Head and loss (last stage): final norm ``aH + 4``, gathered head input ``aHg``, the
  float32 shifted logits and their ``exp`` ``8 V g/tp``, the target index, mask, sum of
  exps and the loss mask ``8 + 1 + 4 + 4`` times ``g``.
- Multi-head latent attention (:class:`moe_fold.models.mla.MLAttention`): see
  :func:`moe_fold.planner.model.mla_attention_bytes` (the latents, not the hidden
  states, are gathered over tp).
- DSA (``model.dsa``, :class:`moe_fold.models.dsa.DSAttention`, its torch path, cp
  included): see :func:`dsa_attention_bytes` (the dense float32 probabilities over every
  key of the sequence, the indexer's per-head scores, the KL loss's tensors); a
  recomputed chunk holds each full layer's selection (:func:`dsa_selection_bytes`); its
  peaks, the softmax and the indexer's backward, :func:`dsa_forward_bytes` and
  :func:`dsa_backward_bytes`.
- Per micro-batch and model chunk: rotary cos and sin, ``2 (s/cp) d_rot a`` (``d_rot``
  the head width, ``qk_rope_head_dim`` under MLA).

Recompute (:func:`moe_fold.models.model.set_recompute`, non-reentrant checkpoints keep their
inputs): ``full`` keeps only a dense block's input ``aH``; an MoE block keeps its attention
input (the attention norm's output ``aH``) with the attention norm itself, and the MoE
layer as with ``moe``. ``moe`` keeps the experts'
inputs (held rows ``aH`` and their probs ``rb``) and the shared expert's input, not their
insides. ``expert_act`` drops the silu-and-fc2 part of the experts: their fc1 output and
prob stay (the checkpoint's inputs), the fc2 input goes.

Not modelled: cp > 1 outside DSA (ring / a2a attention keep other tensors; the SDPA terms are used),
capacity dropping and padding (balanced dropless rows are used), ``dedup``, the
all-gather dispatcher, ``bf16-autocast``'s cast copies (counted as bf16).
"""

from __future__ import annotations

import bisect

from moe_fold.config import (Config, choice, dp_size, edp_size, etp_size, layer_attention, pp_layer_counts, require,
                             rotary_dim)
from moe_fold.planner.model import (ParamEntry, dims, expert_rows_per_token, mla_attention_bytes, mla_latent_bytes,
                                    router_bytes)

__all__ = ["IMPLEMENTATIONS", "state_bytes", "grad_buckets", "shard_sizes", "owned_by_rank", "owned_numel", "zero_sizes",
           "layer_activation_bytes", "held_row_bytes", "head_activation_bytes", "loss_backward_bytes",
           "mtp_activation_bytes", "step_buffer_bytes", "mixer_forward_bytes", "kda_backward_bytes",
           "dsa_attention_bytes", "dsa_selection_bytes", "dsa_forward_bytes", "dsa_backward_bytes",
           "embedding_activation_bytes", "microbatch_constant_bytes"]

IMPLEMENTATIONS = ("moe-fold", "megatron")

# moe_fold.training.buckets.ALIGN, restated so the planner imports no torch (tests check they agree).
ALIGN = 64
# moe_fold.training.buckets.SYNC_GROUP (= moe_fold.training.optim.SHARD_GROUP)
_SHARD_GROUP = {"tp": "dp_cp", "replicated": "dp_cp", "tp_sum": "tp_dp_cp", "expert": "edp"}


def shard_sizes(numels: list[int], n: int) -> list[int]:
    """Elements each of ``n`` ranks owns of one bucket of parameters of ``numels``
    elements (moe_fold.training.buckets.shard_sizes): cuts at ``r * ceil(total/n)``, a cut
    inside a parameter moved up to a multiple of ALIGN elements from its start."""
    offsets, total = [0], 0
    for k in numels:
        total += k
        offsets.append(total)
    chunk = -(-total // n)
    cuts = []
    for r in range(n):
        cut = min(r * chunk, total)
        i = bisect.bisect_right(offsets, cut) - 1  # the parameter the cut falls in
        if i < len(numels) and offsets[i] < cut:
            cut = offsets[i] + min(-(-(cut - offsets[i]) // ALIGN) * ALIGN, numels[i])
        cuts.append(cut)
    cuts.append(total)
    return [cuts[r + 1] - cuts[r] for r in range(n)]


def grad_buckets(config: Config, pp_rank: int, manifest: list[ParamEntry]) -> list[tuple[str, list[int]]]:
    """The gradient buckets of a rank of stage ``pp_rank`` holding ``manifest``, as
    ``moe_fold.training.buckets.model_buckets`` makes them: ``(group, element counts)`` in
    posting order: model chunks last to first, each chunk's parameters in reverse, runs of
    one group of at most ``parallel.grad_bucket_numel`` elements; a pipeline's tied
    embedding (and the last stage's copy) last."""
    p = config.parallel
    counts = pp_layer_counts(config)
    starts = [sum(counts[:c]) for c in range(len(counts))]
    chunks = list(range(pp_rank, len(counts), p.pp))  # virtual stages of this rank
    chunk_of_layer = {starts[s] + i: c for c, s in enumerate(chunks) for i in range(counts[s])}
    tied_pp = dims(config).tied and p.pp > 1
    per_chunk: list[list[ParamEntry]] = [[] for _ in chunks]
    deferred = []
    for e in manifest:
        if tied_pp and e.name in ("embed.weight", "lm_head.weight"):
            deferred.append(e)
        elif e.name.startswith("layers."):
            per_chunk[chunk_of_layer[int(e.name.split(".")[1])]].append(e)
        elif e.name.startswith("embed."):
            per_chunk[0].append(e)
        else:
            per_chunk[-1].append(e)
    limit = p.grad_bucket_numel
    out: list[tuple[str, list[int]]] = []
    for entries in [per_chunk[c] for c in reversed(range(len(chunks)))] + [deferred]:
        runs: dict[str, list[int]] = {}
        closed: list[tuple[str, list[int]]] = []
        for e in reversed(entries):
            group = _SHARD_GROUP[e.kind]
            run = runs.setdefault(group, [])
            if run and sum(run) + e.numel > limit:
                closed.append((group, run))
                run = runs[group] = []
            run.append(e.numel)
        out.extend(closed + [(group, run) for group, run in runs.items() if run])
    return out


def owned_by_rank(buckets: list[tuple[str, list[int]]], group: str, n: int) -> list[int]:
    """Elements of the ``group`` buckets (:func:`grad_buckets`; ``n`` ranks) each rank of
    the group owns under the distributed optimizer: it receives them reduced, updates them
    and holds their AdamW moments."""
    owned = [0] * n
    for name, numels in buckets:
        if name == group:
            owned = [a + b for a, b in zip(owned, shard_sizes(numels, n))]
    return owned


def owned_numel(buckets: list[tuple[str, list[int]]], sizes: dict[str, int], ranks: dict[str, int]) -> int:
    """Parameter elements whose AdamW moments this rank holds under the distributed
    optimizer; ``sizes`` and ``ranks``: the rank's group sizes (:func:`zero_sizes`) and its
    rank in each."""
    return sum(owned_by_rank(buckets, group, sizes[group])[ranks[group]] for group in sizes)


def state_bytes(config: Config, manifest: list[ParamEntry], owned: float) -> dict[str, float]:
    """Bytes of weights, grads and optimizer state of one rank holding ``manifest`` whose
    moments cover ``owned`` elements (all of them without the distributed optimizer), by
    tensor kind: ``weights`` and ``grads`` in the model's dtype, ``master_weights`` and
    ``main_grads`` (float32, bf16 only), ``optimizer`` (the moments)."""
    local = sum(e.numel for e in manifest)
    bf16 = config.train.precision == "bf16"
    return {"weights": local * (2 if bf16 else 4), "master_weights": 4 * local if bf16 else 0,
            "grads": local * (2 if bf16 else 4), "main_grads": 4 * local if bf16 else 0,
            "optimizer": 8 * owned}


def _act(config: Config) -> int:
    return 4 if config.train.precision == "fp32" else 2


def _attention(config: Config, g: int, layer: int) -> float:
    d, tp, a = dims(config), config.parallel.tp, _act(config)
    if d.dsa:
        return dsa_attention_bytes(config, g, layer)
    if d.mla:
        return mla_attention_bytes(d, a, g, tp)
    rope = layer_attention(config.model, layer)[2]
    # Rotary makes new q and k; without it SDPA keeps views of the qkv output, and only
    # temperature tuning (Llama-4's NoPE layers) makes a new q.
    rotated = d.q_size + d.kv_size if rope else d.q_size * config.model.attn_temperature_tuning
    inside = a * (d.q_size + 2 * d.kv_size) + a * rotated + a * d.q_size + 4 * d.heads
    if d.qk_norm:
        inside += 4 * (d.heads + d.kv_heads)
        if d.qk_norm_scope == "l2" and rope:
            inside += 4 * (d.q_size + d.kv_size)  # the L2 norm's float32 q and k
    if d.output_gate:
        # out * sigmoid(gate): the gate's sigmoid, the attention output reshaped out of
        # SDPA's layout, and the product (the projection's input).
        inside += 3 * a * d.q_size
    return a * d.hidden * g + inside * g / tp


def _mamba2(config: Config, g: int) -> float:
    """A Mamba2 mixer's saved bytes per local token (see the module doc), ``w`` the
    recurrence's work dtype (float32)."""
    d, tp, a, w = dims(config), config.parallel.tp, _act(config), 4
    heads, inner, bc = d.m2_heads, d.m2_inner, d.m2_groups * d.m2_state
    same = a == w  # the float32 copies are the tensors themselves
    n, C = d.m2_state, d.m2_chunk
    local = a * (2 * inner + 2 * bc + heads) if same else 0  # in_proj's output (z's silu keeps a view)
    local += a * d.m2_conv_size * (3 if same else 2) + (0 if same else w * inner)  # conv, silu; x in float32
    # The chunked SSD (one cp rank): B and C repeated per head in the scan, their transposed /
    # decayed / sliced copies (5 in all), x times dt, the C x C decays, scores and their
    # product, the chunk-edge states, the per-head gates and the masks.
    local += 5 * w * heads * n + w * inner + 3 * w * heads * C + w * heads * n * d.m2_head_dim / C + 6 * w * heads
    local += 2 * C
    # The gated norm: y, silu(z) (and z's float32 copy), their product, the per-group rsqrt,
    # the normed values (float32, or their cast), out_proj's input.
    local += w * inner * (3 if same else 4) + w * d.m2_groups + (w if same else a) * inner + a * inner
    return a * d.hidden * g + local * g / tp


def _gated_deltanet(config: Config, g: int) -> float:
    """Bytes a Gated DeltaNet layer (:class:`moe_fold.models.gated_deltanet.GatedDeltaNet`,
    the chunked torch recurrence of :func:`moe_fold.kernels.gated_delta.chunk_gated_delta_rule`)
    keeps per local token, one cp rank, ``seq/cp`` a multiple of the chunk ``C``. Per
    gathered token, with ``Hk, Hv`` the local key and value heads, ``K = Hk dk``,
    ``V = Hv dv``, ``f = 4`` (the recurrence runs in float32):

    - the input projection's gathered input ``aH``; ``z`` for ``silu(z)``: the projection's
      whole output ``a(2K + 2V + 2Hv)`` when ``a = f`` (z is a view of it), else its float32
      copy ``fV``;
    - the causal conv's input with the ``k-1`` tokens before it, ``a(2K + V)(1 + (k-1)/(s/cp))``,
      and its output (SiLU's input) ``a(2K + V)``; the L2 norms' inputs: SiLU's output
      ``a(2K + V)`` when ``a = f``, else the float32 copies of q and k ``2fK`` (and of v,
      ``fV``, which the recurrence keeps); their rsqrt ``2fHk``; beta's sigmoid ``fHv``;
      the decay's softplus input and output ``2fHv``;
    - the recurrence: the repeated q and k ``2fHv dk`` and the contiguous copies its batched
      products make of them ``4fHv dk``; the decay matrix, ``k kT``, ``beta k kT``, the
      triangular system, ``q kT`` and its decayed copy ``6fHv C``; the solve's output
      ``fHv(dk + dv)``; the decayed q and k ``2fHv dk``; each chunk's ``u`` ``fHv dv`` and
      its start state ``fHv dk dv / C``; four float32 and ``C + 2`` bool per-head terms;
    - the output: the recurrence output ``fV`` and its rsqrt ``fHv``; the normalised output
      in the model's dtype ``aV``, the weighted product and ``silu(z)`` ``2fV``; the output
      projection's input ``aV``."""
    d, p, a, f = dims(config), config.parallel, _act(config), 4
    hk, hv = d.lin_key_heads / p.tp, d.lin_value_heads / p.tp
    dk, dv, c = d.lin_key_dim, d.lin_value_dim, d.lin_chunk
    key, value = hk * dk, hv * dv
    conv = a * (2 * key + value)
    out = a * (2 * key + 2 * value + 2 * hv) if a == f else f * value
    out += conv * (1 + (d.lin_conv - 1) / (d.seq / p.cp)) + conv
    out += (conv if a == f else 2 * f * key + f * value) + 2 * f * hk + 3 * f * hv
    out += (2 + 4 + 6 * c / dk + 2) * f * hv * dk + f * hv * (dk + dv) + f * hv * dv + f * hv * dk * dv / c \
        + 4 * f * hv + c + 2
    out += f * value + f * hv + a * value + 2 * f * value + a * value
    return a * d.hidden * g + out * g


def _dsa_core(config: Config) -> float:
    """Bytes DSA's attention over the heads keeps per query token of this rank (see
    :func:`dsa_attention_bytes`)."""
    d, p, a, f = dims(config), config.parallel, _act(config), 4
    h, keys, cp = d.heads / p.tp, d.seq, p.cp
    value = a * h * (d.qk_head - d.rope_dim + d.v_head) if cp == 1 else a * h * d.v_head * cp
    return f * h * d.qk_head * (1 + cp) + value + f * h * keys + (a * h * keys if a != f else 0) + keys + a * h * d.v_head


def _dsa_indexer(config: Config, g: int, layer: int) -> float:
    """Bytes ``layer``'s lightning indexer's graph holds per query token of this rank while
    its scores live (none on a GLM-5 shared layer: see :func:`dsa_attention_bytes`); kept
    for the backward only with the KL loss, which also keeps :func:`_dsa_kl`."""
    d, p, a, f = dims(config), config.parallel, _act(config), 4
    if layer not in d.indexer:
        return 0.0
    n, width, keys, b = d.index_heads, d.index_dim, d.seq, config.train.micro_batch_size
    inputs = a * (d.hidden + d.q_lora) if g > 1 else 0
    index_keys = f * width * keys if b > 1 else f * width * p.cp
    scores = f * n * width + index_keys + f * n * keys + f * n + a * width + 8
    return inputs + scores


def _dsa_kl(config: Config, layer: int) -> float:
    """What the indexer's KL loss keeps per query token: its float32 target and
    log-softmax, two masks and the selection (the dense stage's causal mask, one for the
    micro-batch)."""
    d = dims(config)
    if layer not in d.indexer or not d.index_loss:
        return 0.0
    return 2 * 4 * d.seq + 2 * d.seq + (d.seq if d.index_sparse else d.seq / config.train.micro_batch_size)


def _dsa_after_softmax(config: Config, layer: int) -> float:
    """What DSA's attention keeps per query token that it makes after its softmax: the
    probabilities cast to the model's dtype, the projection's input and the KL loss's
    tensors."""
    d, p, a = dims(config), config.parallel, _act(config)
    h = d.heads / p.tp
    return (a * h * d.seq if a != 4 else 0) + a * h * d.v_head + _dsa_kl(config, layer)


def dsa_attention_bytes(config: Config, g: int, layer: int) -> float:
    """Bytes a DSA layer (:class:`moe_fold.models.dsa.DSAttention`, its torch path) keeps per
    local token, norm before it aside: MLA's latents (:func:`moe_fold.planner.model.mla_latent_bytes`)
    and, per query token of this rank (``g`` per local token), with ``h`` the local heads,
    ``L = seq`` the keys a query may select from (every key of the sequence under cp),
    ``f = 4`` (the scores run in float32 at least):

    - the attention over the heads: the float32 q and the float32 keys (gathered over cp)
      its score product keeps ``f h qk (1 + cp)``; the values its output product keeps,
      a view of the kv up-projection's output ``a h (nope + v)`` (under cp the gathered
      values ``a h v cp``); the dense float32 probabilities of its masked softmax ``f h L``
      and (``a != f``) their cast ``a h L``; the masked-out keys ``L`` (bool); the output
      projection's input ``a h v``;
    - with its own indexer and the KL loss on (without the loss nothing reaches the
      indexer's graph, which dies with the forward): under SP its gathered detached inputs
      ``a (H + q_lora)`` (else they are MLA's own); the float32 queries ``f n d``, the
      float32 keys ``f d cp`` (with a micro-batch above 1, their broadcast over the
      queries ``f d L``), the per-head scores after the relu ``f n L`` and the float32
      head weights ``f n``; the key norm's input ``a d`` with its float32 mean and rstd;
      the KL's float32 target and log-softmax ``2 f L``, two masks ``2 L`` and the
      selection it reads (bool, ``L``; the dense stage's causal mask is one ``[s, L]``
      for the micro-batch, ``L/b`` per token)."""
    d, a = dims(config), _act(config)
    indexer = _dsa_indexer(config, g, layer) + _dsa_kl(config, layer) if d.index_loss else 0.0
    return mla_latent_bytes(d, a, g) + (_dsa_core(config) + indexer) * g


def dsa_selection_bytes(config: Config, layer: int, recompute: str) -> float:
    """Bytes per local token ``layer``'s selection (bool ``[b, s/cp, L]``) stays alive
    after its forward outside autograd: the chunk's forward hands every full layer's
    selection to the shared layers after it in one dict, which a recomputed attention's
    checkpoint holds (its inputs) until its backward: ``L g`` under ``full`` recompute on a
    layer with its own indexer (an MTP depth hands none on)."""
    d, p = dims(config), config.parallel
    if recompute != "full" or layer not in d.indexer or layer >= d.layers:
        return 0.0
    return d.seq * (p.tp if p.sequence_parallel else 1)


def dsa_forward_bytes(config: Config, layer: int) -> float:
    """Bytes per local token a DSA layer's attention holds at its softmax in a forward
    whose tensors a checkpoint does not keep (``full`` recompute): MLA's latents, and per
    query token q and the keys (gathered over cp) in the model's dtype ``a h qk (1 + cp)``,
    the values' storage (:func:`dsa_attention_bytes`), the float32 scores, their masked
    copy and the probabilities ``3 f h L``; the indexer's queries, head weights and keys
    ``a (n d + n + d cp)`` (under SP its gathered inputs ``a (H + q_lora)``), its
    float32 scores ``f L``, the selection and the causal mask ``L + L/b``."""
    d, p, a, f = dims(config), config.parallel, _act(config), 4
    g = p.tp if p.sequence_parallel else 1
    h, keys, cp, b = d.heads / p.tp, d.seq, p.cp, config.train.micro_batch_size
    value = a * h * (d.qk_head - d.rope_dim + d.v_head) if cp == 1 else a * h * d.v_head * cp
    out = a * h * d.qk_head * (1 + cp) + value + 3 * f * h * keys + f * keys + keys + keys / b
    if layer in d.indexer:
        out += a * (d.index_heads * d.index_dim + d.index_heads + d.index_dim * cp)
        out += a * (d.hidden + d.q_lora) if g > 1 else 0
    return mla_latent_bytes(d, a, g) + out * g


def dsa_backward_bytes(config: Config, layer: int, recompute: str) -> float:
    """Bytes per local token a DSA layer's attention holds in its backward above what its
    chunk keeps, at its peak: under ``full`` recompute its forward rebuilt
    (:func:`dsa_attention_bytes`); then the larger of two moments, per query token:

    - the softmax (the rebuilding forward's, or its backward): two float32 ``[h, L]``
      tensors beside the kept probabilities (the scores and their masked copy, or the
      gradients of the probabilities and of the scores), while what the attention makes
      after its softmax (:func:`_dsa_after_softmax`) is not made yet or already freed:
      ``2 f h L`` less that;
    - the indexer's backward (its KL loss on), after the attention's, while the
      attention's tensors over the heads and the KL's are freed: at the relu the gradients
      of the per-head scores before and after it ``2 f n L``; at the product of queries
      and keys, the relu's output freed, the gradient of the keys as broadcast over the
      queries ``f d L`` and of the queries ``f n d``."""
    d, p, f = dims(config), config.parallel, 4
    g = p.tp if p.sequence_parallel else 1
    rebuilt = dsa_attention_bytes(config, g, layer) if recompute == "full" else 0.0
    h, keys = d.heads / p.tp, d.seq
    late = _dsa_after_softmax(config, layer)
    # Without the loss the indexer's graph is not kept, but it lives through a forward
    # that keeps its tensors (the rebuilding one) until its scores go at the forward's end.
    moments = [2 * f * h * keys - late + (0.0 if d.index_loss else _dsa_indexer(config, g, layer))]
    if layer in d.indexer and d.index_loss:
        n, width = d.index_heads, d.index_dim
        backward = max(2 * f * n * keys, f * width * keys + f * n * width)
        moments.append(backward - _dsa_core(config) - _dsa_kl(config, layer))
    return rebuilt + max(moments) * g


def _kda(config: Config, g: int) -> float:
    """Bytes a KDA layer (:class:`moe_fold.models.kda.KimiDeltaAttention`, the chunked torch
    recurrence of :func:`moe_fold.kernels.gated_delta.chunk_gated_delta_rule` with a decay
    per key channel) keeps per local token, one cp rank, ``seq/cp`` a multiple of the chunk
    ``C``. Per gathered token, with ``h`` the local heads of width ``d`` (keys and values
    alike), ``W = h d``, ``f = 4`` (the recurrence runs in float32):

    - the input projection's gathered input ``aH`` (under SP the down-projection's local
      input ``aH`` more, per local token); the down-projection's output, both latents,
      which the up-projections keep (gathered under SP) ``2ad``;
    - the causal conv's input with the ``k-1`` tokens before it ``3aW(1 + (k-1)/(s/cp))``
      and its output (SiLU's input) ``3aW``; SiLU's output (``a = f``) or the float32 q, k
      and v made from it ``3fW``; the L2 norms' rsqrt ``2fh``; beta's sigmoid ``fh``;
      the decay's softplus input and output ``2fW``;
    - the recurrence: the normalised q and k ``2fW``; the per-channel decays ``exp(G_t -
      G_j)`` and the products ``q_t k_j`` and ``k_t k_j`` they weigh ``3fWC`` (the [C, C,
      d] tensors that dominate); ``exp(G)``, the in- and out-decays and beta times the
      in-decay ``4fW``; ``k kT`` summed, the triangular system and ``q kT`` ``3fhC``; the
      solve's output ``2fW``; the decayed q and k ``2fW``; each chunk's ``u`` ``fW`` and
      its start state ``fWd/C``; ``C + 2`` bool masks;
    - the output: the recurrence output ``fW`` and its rsqrt ``fh``, the normalised
      output, its product with the weight and the gate's sigmoid ``3fW``; the output
      projection's input ``aW``."""
    d, p, a, f = dims(config), config.parallel, _act(config), 4
    h, w, c = d.lin_key_heads / p.tp, d.lin_key_heads * d.lin_key_dim / p.tp, d.lin_chunk
    out = 2 * a * d.lin_key_dim + 3 * a * w * (1 + (d.lin_conv - 1) / (d.seq / p.cp)) + 3 * a * w + a * w
    out += (3 + 2 + 2 + 4 + 2 + 2 + 1 + 1 + 3) * f * w + 3 * f * w * c + 3 * f * h * c + f * w * d.lin_key_dim / c
    out += 2 * f * h + f * h + f * h + c + 2
    return a * d.hidden * g + (a * d.hidden if g > 1 else 0) + out * g


def kda_backward_bytes(config: Config, recompute: str) -> float:
    """Bytes per local token a KDA layer's backward holds above what its chunk keeps, at its
    peak, the backward of the per-channel products: under ``full`` recompute the mixer's
    tensors rebuilt (:func:`_kda`); four float32 ``[C, C, d]`` gradients at once (the
    weighed product's and the decays' of ``q kT``, kept for ``k kT``'s, and of ``k kT``'s
    two factors) while ``q_t k_j``, consumed, is freed: three ``fWC`` more."""
    d, p = dims(config), config.parallel
    g = p.tp if p.sequence_parallel else 1
    rebuilt = _kda(config, g) if recompute == "full" else 0.0
    return rebuilt + 3 * 4 * d.lin_key_heads * d.lin_key_dim / p.tp * d.lin_chunk * g

def _mixer(config: Config, layer: int, g: int) -> float:
    d = dims(config)
    if layer in d.mamba:
        return _mamba2(config, g)
    if layer in d.kda:
        return _kda(config, g)
    return _gated_deltanet(config, g) if layer in d.deltanet else _attention(config, g, layer)


def mixer_forward_bytes(config: Config, layer: int) -> float:
    """Bytes per local token ``layer``'s attention or Gated DeltaNet holds at the end of its
    forward (its gathered input included): what it keeps without recompute, less, for
    Gated DeltaNet, the recurrence's ``[C, C]`` matrices (``6fHv C`` and the ``C`` bool
    mask, :func:`_gated_deltanet`), freed when the recurrence returns, before the output
    part runs. DSA: what it holds at its softmax (:func:`dsa_forward_bytes`)."""
    d, p = dims(config), config.parallel
    g = p.tp if p.sequence_parallel else 1
    if d.dsa and layer not in d.mamba | d.kda | d.deltanet:
        return dsa_forward_bytes(config, layer)
    out = _mixer(config, layer, g)
    if layer in d.deltanet:
        out -= (6 * 4 * d.lin_value_heads / p.tp * d.lin_chunk + d.lin_chunk) * g
    if layer in d.kda:  # its [C, C, d] and [C, C] tensors and the mask
        out -= (3 * 4 * d.lin_key_heads / p.tp * d.lin_chunk * (d.lin_key_dim + 1) + d.lin_chunk) * g
    return out


def _mlp(config: Config, ffn: int, g: int) -> float:
    d, a, tp = dims(config), _act(config), config.parallel.tp
    if not d.gated_mlp:  # relu2: relu keeps its output, square its input (the same), fc2 its input
        return a * d.hidden * g + 2 * a * ffn * g / tp
    return a * d.hidden * g + 4 * a * ffn * g / tp


def _router(config: Config) -> float:
    d, moe, rb = dims(config), config.moe, router_bytes(config)
    e, k = d.experts + d.zero_experts, d.topk
    out = rb * d.hidden
    fused = moe.group_topk is None and not moe.expert_bias and moe.topk_norm_min is None
    if fused:
        out += rb * e + rb * e + e
    elif moe.score_function == "softmax":
        out += 8 * e + rb * (e if moe.pre_softmax else k)
    else:
        # The sort's values when it ranks the scores themselves; with the expert bias it
        # ranks the biased ones and the top-k scores are gathered: those and their sum.
        out += 8 * e + rb * e + (rb * ((k if moe.expert_bias else e) + 1) if k > 1 else 0)
    if moe.aux_loss_coeff > 0 or moe.seq_aux_loss_coeff > 0 or moe.global_aux_loss_coeff > 0:
        out += rb * e
    if moe.seq_aux_loss_coeff > 0:
        out += 8
    if moe.z_loss_coeff > 0:
        out += rb + (0 if fused else rb * e)
    return out


def layer_activation_bytes(config: Config, layer: int, recompute: str) -> float:
    """Bytes one rank keeps per local token for ``layer`` (see the module doc)."""
    require(choice, "train.recompute", recompute)
    d, p = dims(config), config.parallel
    a, h, rb, etp = _act(config), d.hidden, router_bytes(config), etp_size(config)
    g = p.tp if p.sequence_parallel else 1
    norm = a * h + 4
    mixer = _mixer(config, layer, g)
    selection = dsa_selection_bytes(config, layer, recompute)
    if layer in d.no_mlp:  # a token mixer alone (model.block=single_mixer)
        return a * h if recompute == "full" else norm + mixer
    if not d.moe_flags[layer]:
        if recompute == "full":
            return a * h + selection
        return (0 if layer in d.no_mixer else norm + _mixer(config, layer, g)) + norm + _mlp(config, d.ffn, g)
    attention = norm + (a * h + selection if recompute == "full" else _mixer(config, layer, g))
    if layer in d.no_mixer:
        attention = a * h if recompute == "full" else 0
    k = expert_rows_per_token(config)
    held = k * etp
    dispatch = 16 * k
    experts = held * held_row_bytes(config, recompute)
    shared = 0.0
    norm_out_kept = a == rb
    if d.shared_ffn > 0:
        if recompute in ("full", "moe"):
            # The checkpoint keeps the shared expert's input: the local norm output.
            norm_out_kept = True
        else:
            norm_out_kept = norm_out_kept or g == 1 or d.shared_gate
            shared = _mlp(config, d.shared_ffn, g)
            if g == 1:
                shared -= a * h  # its input is the norm output, counted below
        if d.shared_gate:
            norm_out_kept = True
            shared += a + a * h
    if d.shortcut and layer < d.layers:
        # The second attention sublayer and the two dense MLPs (kept under every recompute mode).
        attention = 2 * attention + 2 * (norm + _mlp(config, d.ffn, g))
    latent = 0.0
    if d.latent:
        norm_out_kept = True  # the projection into the latent width reads it
        latent = a * d.latent  # the combined rows, the projection back's input
    zero = 0.0
    if d.zero_experts:
        # A zero expert's output, the layer's input times the token's gate weight on zero
        # experts, keeps both.
        norm_out_kept = True
        zero = rb
    return zero + attention + norm + _router(config) + (a * h if norm_out_kept and a != rb else 0) + dispatch \
        + experts + shared + latent


def held_row_bytes(config: Config, recompute: str) -> float:
    """Bytes a rank keeps per expert row it holds (the dispatcher's sort indices and the
    experts' saved tensors, see the module doc): what grows with the busiest rank's load."""
    d, p = dims(config), config.parallel
    a, h, rb, etp = _act(config), d.expert_width, router_bytes(config), etp_size(config)
    # The dispatcher sorts received chunks unless at most one of etp, ep and the local
    # experts is above 1 (then they already are in expert order).
    sorts = sum(n > 1 for n in (etp, p.ep, d.experts // p.ep)) >= 2
    if recompute in ("full", "moe"):
        experts = a * h + rb
    elif recompute == "expert_act":
        experts = a * h + (0 if not d.gated_experts else 2 * a * d.expert_ffn / etp) + rb
    elif not d.gated_experts:
        # relu2 in float32: relu's output and its square (the prob's product keeps it), and
        # fc2's input (the product cast back).
        experts = a * h + (8 + a) * d.expert_ffn / etp + rb
    else:
        experts = a * h + 3 * a * d.expert_ffn / etp + rb
    if config.moe.score_on_input:
        experts += a * h  # the rows before their prob scales them, kept for the prob's grad
    return experts + (24 if sorts else 0)


def head_activation_bytes(config: Config) -> float:
    """Bytes the last stage keeps per local token for the final norm, head and loss."""
    d, p, a = dims(config), config.parallel, _act(config)
    g = p.tp if p.sequence_parallel else 1
    return a * d.hidden + 4 + a * d.hidden * g + (8 * d.vocab / p.tp + 8 + 1 + 4 + 4) * g


def loss_backward_bytes(config: Config) -> float:
    """Bytes per local token the vocab-parallel cross entropy's backward holds above what
    its forward kept, at its peak: the float32 gradient of the logits is built from the
    kept ``exp`` (divided by the sum, a float32 ``[.., V/tp]``) and a zeroed float32
    ``[.., V/tp]`` the target's ``-1`` is scatter-added into, while the ``exp`` is freed:
    ``8 V g/tp``. One head's backward runs at a time (MTP's, then the model's)."""
    d, p = dims(config), config.parallel
    g = p.tp if p.sequence_parallel else 1
    return 8 * d.vocab / p.tp * g


def mtp_activation_bytes(config: Config) -> float:
    """Bytes the last stage keeps per local token for the MTP depths besides their blocks:
    per depth the embedding's ids and mask (as on the first stage), the input norms'
    per-row rsqrt and the embedding norm's input (the hidden norm's input is the tensor the
    final norm before it keeps), ``eh_proj``'s input ``[.., 2H]``, and the depth's final
    norm, head and loss (:func:`head_activation_bytes`). The depths reuse the last chunk's
    rotary tables."""
    d, a = dims(config), _act(config)
    per_depth = (embedding_activation_bytes(config) + a * d.hidden + 2 * 4 + 2 * a * d.hidden
                 + head_activation_bytes(config))
    return d.mtp * per_depth


def embedding_activation_bytes(config: Config) -> float:
    """Bytes the first stage keeps per local token for the embedding (ids and mask)."""
    p = config.parallel
    return 9 * (p.tp if p.sequence_parallel else 1)


def microbatch_constant_bytes(config: Config, layers: list[int], chunks: int) -> float:
    """Bytes per micro-batch that do not scale with tokens: rotary cos/sin per model chunk,
    the float32 router weight copy per MoE layer under bf16."""
    d, a = dims(config), _act(config)
    out = chunks * 2 * (d.seq // config.parallel.cp) * rotary_dim(config) * a
    if config.train.precision == "bf16":
        out += sum(4 * d.experts * d.hidden for i in layers if d.moe_flags[i])
    return out


def step_buffer_bytes(config: Config, world: int, pp_rank: int, manifest: list[ParamEntry]) -> float:
    """The most bytes the gradient reduction and the distributed optimizer's parameter
    gather hold at once after the pipeline schedule, when no activation is left
    (``moe_fold.training.buckets.GradSync.finish`` and ``moe_fold.training.optim.AdamW.step``,
    one bucket at a time): for the largest bucket of ``B`` elements (:func:`grad_buckets`)
    reduced over a group of ``n`` ranks,

    - sharded (the distributed optimizer, ``n > 1``): the float32 bucket and its padded
      copy for the reduce-scatter; later the all-gather's padded output and the bucket
      assembled from it, with this rank's slice: ``8 B + 4 ceil(B/n)``;
    - all-reduced in place: the float32 bucket, and under bf16 the float32 copies of the
      grads it is cut from: ``4 B`` or ``8 B``.

    One parameter larger than ``parallel.grad_bucket_numel`` (an embedding, a head) is a
    bucket of its own. Overlapped reductions (``parallel.overlap_grad_reduce``) post
    buckets during the last backward and are not modelled."""
    sizes = zero_sizes(config, world)
    bf16 = config.train.precision == "bf16"
    peak = 0.0
    for group, numels in grad_buckets(config, pp_rank, manifest):
        total, n = sum(numels), sizes[group]
        if config.optimizer.distributed and n > 1:
            peak = max(peak, 8 * total + 4 * max(shard_sizes(numels, n)))
        else:
            peak = max(peak, (8 if bf16 else 4) * total)
    return peak


def zero_sizes(config: Config, world: int) -> dict[str, int]:
    """The sizes of the groups the distributed optimizer shards over."""
    dp_cp = dp_size(config, world) * config.parallel.cp
    return {"dp_cp": dp_cp, "tp_dp_cp": config.parallel.tp * dp_cp, "edp": edp_size(config, world)}

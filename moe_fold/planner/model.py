"""What one rank of a layout holds and computes: parameters, FLOPs and activation memory of
the model :mod:`moe_fold.models.model` builds, as arithmetic on the config (no torch).

Parameters. :func:`param_manifest` lists one rank's parameters in ``model.parameters()``
order with their element counts and gradient-sync kinds (``tp``, ``replicated``,
``tp_sum``, ``expert``; :mod:`moe_fold.training.grads`), for the pp stage it sits on. Sharding:
attention, dense MLP, shared-expert linears, embedding and head are split over tp; norms,
the router and the shared-expert gate are replicated; each ep rank holds
``num_experts / ep`` experts, each split over etp along its ffn dim. With tied embeddings
and pp > 1 the last stage holds a copy of the embedding as its head (Megatron's scheme,
:mod:`moe_fold.parallel.pipeline`), and with MTP a copy for the depths' inputs.

FLOPs. Matmul FLOPs per token, 2 per multiply-add, as in Narayanan et al. 2021 ("Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 5.1):
their ``72 B s l h^2 (1 + s/6h + V/12lh)`` is ``3 x`` (forward + backward = 3 forwards)
the per-layer forward ``24 B s h^2 + 4 B s^2 h`` plus the logits ``2 B s h V``. Here each
term is written from the model's shapes, which generalises it to grouped-query attention
(q|k|v projection ``H (q + 2 kv)``), multi-head latent attention (its down- and
up-projections, :func:`moe_fold.config.mla_weight_shapes`; the core over ``qk_nope +
qk_rope`` for scores and ``v_head_dim`` for the context), SwiGLU (three ``H x F`` matrices)
and MoE layers (the router ``H x E``, ``topk`` routed experts, the shared expert and its
gate; only activated experts count). The attention core counts the full ``s x s`` score and context products
(``4 s q`` per token), the convention of Narayanan 2021 and of Megatron's
``num_floating_point_operations``, so MFU is comparable with published numbers (a causal
kernel does about half of that work). Norms, rotary, softmax and SwiGLU elementwise work
are not counted.

Activations. Bytes kept for the backward per token and layer, in the style of Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4):
each tensor a fused implementation keeps is listed in :func:`layer_activation_bytes`,
with flash attention (q, k, v, output and the fp32 log-sum-exp; no ``s x s`` scores) and
no dropout. Where moe-fold differs from Megatron it is modelled as moe-fold does it: a
column-parallel linear under sequence parallelism keeps its GATHERED input (autograd
saves it) instead of re-gathering it in the backward, so that input costs ``tp`` times
Korthikanti's ``2sbh/t``. Recompute (``train.recompute``, :func:`moe_fold.models.model.set_recompute`)
keeps only the inputs of the recomputed parts.
These are the Megatron reference figures (``Assumptions.implementation="megatron"``);
what moe-fold's own layers keep is :mod:`moe_fold.planner.memory`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from moe_fold.config import (
    CHANNEL_MIXERS, Config, ModelConfig, MoEConfig, choice, choices, etp_size, head_dim, layer_mixer, mla_weight_shapes, moe_layer_flags,
    pp_layer_counts, require, vpp_size,
)

__all__ = ["Dims", "dims", "ParamEntry", "param_manifest", "stage_layers", "stage_blocks", "layer_forward_flops",
           "head_forward_flops", "mtp_forward_flops", "mtp_activation_bytes", "model_flops_per_step",
           "rank_flops_per_microbatch", "act_bytes", "router_bytes", "expert_rows_per_token", "held_rows_per_token", "layer_activation_bytes",
           "mla_attention_bytes", "mla_latent_bytes", "head_activation_bytes",
           "microbatches_in_flight", "RECOMPUTE_MODES"]

RECOMPUTE_MODES = choices("train.recompute")


@dataclass(frozen=True)
class Dims:
    """The sizes of one model, from its config."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    ffn: int
    layers: int
    seq: int
    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int
    shared_gate: bool
    qk_norm: bool
    qkv_bias: bool
    tied: bool
    # One flag per block: the model's layers, then the MTP depths' blocks (last layer's kind).
    moe_flags: tuple[bool, ...]
    mtp: int = 0
    qk_norm_scope: str = "head"
    # Attention sinks (model.attention_sinks): one logit per query head, split over tp.
    sinks: bool = False
    # gpt-oss: a bias on attention's output projection, on the router, on every expert's fc1 and fc2.
    out_bias: bool = False
    router_bias: bool = False
    expert_linear_bias: bool = False
    # Spare expert slots per ep rank (moe.replicas): copies held besides the E/ep experts.
    replicas: int = 0
    # Zero-computation experts (moe.zero_experts): router columns that compute nothing.
    zero_experts: int = 0
    # The latent MoE (moe.latent_size): the experts' width, 0 without one (the hidden width).
    latent: int = 0
    # Multi-head latent attention: its linears' global [out, in] shapes (None: standard
    # attention), q_lora_rank (0: none), kv_lora_rank, the q/k and v head widths.
    mla: tuple[tuple[str, int, int], ...] | None = None
    q_lora: int = 0
    kv_lora: int = 0
    qk_head: int = 0
    v_head: int = 0
    rope_dim: int = 0
    # Gated attention (model.attn_output_gate): q_proj also gives a sigmoid gate of q's width.
    output_gate: bool = False
    # The Gated DeltaNet blocks and the KDA blocks (model.layer_types; block indices as
    # moe_flags) and their sizes: key and value heads, their widths, and the short conv's kernel
    # (KDA: as many value heads as key heads, of the same width).
    deltanet: frozenset[int] = frozenset()
    kda: frozenset[int] = frozenset()
    lin_key_heads: int = 0
    lin_value_heads: int = 0
    lin_key_dim: int = 0
    lin_value_dim: int = 0
    lin_conv: int = 0
    lin_chunk: int = 0
    # Nemotron-H (model.block=single_mixer): the blocks without a token mixer (mlp, moe) and
    # those without an MLP (attention, mamba2); whether the dense MLPs and shared experts
    # (mlp_activation) and the routed experts (moe.activation) are gated (fc1 gate|up) or relu2.
    no_mixer: frozenset[int] = frozenset()
    no_mlp: frozenset[int] = frozenset()
    gated_mlp: bool = True
    gated_experts: bool = True
    # The Mamba2 blocks and their sizes: heads, head width, state, groups, conv kernel, chunk.
    mamba: frozenset[int] = frozenset()
    m2_heads: int = 0
    m2_head_dim: int = 0
    m2_state: int = 0
    m2_groups: int = 0
    m2_conv: int = 0
    m2_chunk: int = 0

    @property
    def m2_inner(self) -> int:
        return self.m2_heads * self.m2_head_dim

    @property
    def m2_conv_size(self) -> int:
        """Mamba2's conv channels: x, B and C."""
        return self.m2_inner + 2 * self.m2_groups * self.m2_state
    # DSA (model.dsa): the blocks with a lightning indexer (block indices as moe_flags; a GLM-5
    # shared layer has none), its heads and width, and the keys each query keeps.
    indexer: frozenset[int] = frozenset()
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    index_sparse: bool = False  # model.dsa_stage=sparse: the attention core covers the kept keys only
    dsa: bool = False  # model.dsa: every attention block is DSA (its own indexer or a shared layer's selection)
    index_loss: bool = False  # model.dsa_indexer_loss_weight > 0: the indexer's KL loss trains it
    # LongCat-Flash's blocks (model.block=shortcut_moe): two attention sublayers, each with a
    # dense MLP of width ffn, and the MoE.
    shortcut: bool = False

    @property
    def sublayers(self) -> int:
        """Attention sublayers of a model block: 2 in a shortcut_moe block, else 1."""
        return 2 if self.shortcut else 1

    @property
    def lin_in_size(self) -> int:
        """Gated DeltaNet's input projection width: q, k, v, the output gate z, beta and a."""
        return (2 * self.lin_key_heads * self.lin_key_dim + 2 * self.lin_value_heads * self.lin_value_dim
                + 2 * self.lin_value_heads)

    @property
    def lin_conv_size(self) -> int:
        """The channels of Gated DeltaNet's short conv: q, k and v."""
        return 2 * self.lin_key_heads * self.lin_key_dim + self.lin_value_heads * self.lin_value_dim

    @property
    def q_size(self) -> int:
        """Query (and, under MLA, key) width of all heads."""
        return self.heads * (self.qk_head if self.mla else self.head_dim)

    @property
    def kv_size(self) -> int:
        """Key and value width of all kv heads (standard attention)."""
        return self.kv_heads * self.head_dim

    @property
    def out_size(self) -> int:
        """Attention output (context) width of all heads: the projection's input."""
        return self.heads * (self.v_head if self.mla else self.head_dim)

    @property
    def expert_width(self) -> int:
        """The width of a routed expert's rows: ``moe.latent_size`` in a latent MoE, else the hidden size."""
        return self.latent or self.hidden

    @property
    def kv_pass_size(self) -> int:
        """Per token: the K and V widths attention reads (what ring cp moves)."""
        return self.heads * (self.qk_head + self.v_head) if self.mla else 2 * self.kv_size


@functools.lru_cache(maxsize=256)
def _moe_flags(num_layers: int, freq: int | tuple[int, ...], first_k_dense: int) -> tuple[bool, ...]:
    """``moe_layer_flags`` memoised: the planner asks for it per layer of every layout."""
    config = Config(model=ModelConfig(num_layers=num_layers),
                    moe=MoEConfig(moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
                                  first_k_dense=first_k_dense))
    return tuple(moe_layer_flags(config))


def dims(config: Config) -> Dims:
    m, moe = config.model, config.moe
    freq = tuple(moe.moe_layer_freq) if isinstance(moe.moe_layer_freq, list) else moe.moe_layer_freq
    if m.block == "single_mixer":
        flags = tuple(moe_layer_flags(config))
    else:
        flags = _moe_flags(m.num_layers, freq, moe.first_k_dense)
    return Dims(hidden=m.hidden_size, heads=m.num_heads, kv_heads=m.num_kv_heads, head_dim=head_dim(config),
                vocab=m.vocab_size, ffn=m.ffn_hidden_size, layers=m.num_layers, seq=m.seq_length,
                experts=moe.num_experts, topk=moe.topk, expert_ffn=moe.ffn_hidden_size,
                shared_ffn=moe.shared_expert_ffn_hidden_size, shared_gate=moe.shared_expert_gate,
                qk_norm=m.qk_norm, qkv_bias=m.qkv_bias, tied=m.tie_embeddings,
                moe_flags=flags + flags[-1:] * m.mtp_num_layers, mtp=m.mtp_num_layers,
                qk_norm_scope=m.qk_norm_scope, sinks=m.attention_sinks, replicas=moe.replicas,
                out_bias=m.attention_out_bias, router_bias=moe.router_bias, zero_experts=moe.zero_experts,
                latent=moe.latent_size or 0,
                expert_linear_bias=moe.expert_linear_bias, output_gate=m.attn_output_gate,
                gated_mlp=m.mlp_activation != "relu2", gated_experts=moe.activation != "relu2",
                shortcut=m.block == "shortcut_moe", **_mla_dims(m), **_deltanet_dims(m), **_dsa_dims(m),
                **_single_mixer_dims(m), **_mamba_dims(m))


def _single_mixer_dims(m: ModelConfig) -> dict:
    if not m.block == "single_mixer":
        return {}
    kinds = [layer_mixer(m, i) for i in range(m.num_layers)]
    return dict(no_mixer=frozenset(i for i, k in enumerate(kinds) if k in CHANNEL_MIXERS),
                no_mlp=frozenset(i for i, k in enumerate(kinds) if k not in CHANNEL_MIXERS))


def _mamba_dims(m: ModelConfig) -> dict:
    layers = frozenset(i for i in range(m.num_layers) if layer_mixer(m, i) == "mamba2")
    if not layers:
        return {}
    return dict(mamba=layers, m2_heads=m.mamba_num_heads, m2_head_dim=m.mamba_head_dim, m2_state=m.mamba_state_size,
                m2_groups=m.mamba_num_groups, m2_conv=m.mamba_conv_kernel, m2_chunk=m.mamba_chunk_size)


def _mamba_params(d: Dims, pre: str, tp: int) -> list[tuple[str, int, str]]:
    """One Mamba2 layer's parameters on one tp rank (groups with their heads split over tp),
    in ``model.parameters()`` order: the layer's own, then in_proj's and out_proj's."""
    in_rows = 2 * d.m2_inner + 2 * d.m2_groups * d.m2_state + d.m2_heads
    return [(f"{pre}.attn.conv_weight", d.m2_conv_size * d.m2_conv // tp, "tp"),
            (f"{pre}.attn.conv_bias", d.m2_conv_size // tp, "tp"),
            (f"{pre}.attn.A_log", d.m2_heads // tp, "tp"),
            (f"{pre}.attn.D", d.m2_heads // tp, "tp"),
            (f"{pre}.attn.dt_bias", d.m2_heads // tp, "tp"),
            (f"{pre}.attn.norm_weight", d.m2_inner // tp, "tp"),
            (f"{pre}.attn.in_proj.weight", in_rows * d.hidden // tp, "tp"),
            (f"{pre}.attn.out_proj.weight", d.hidden * d.m2_inner // tp, "tp")]


def _dsa_dims(m: ModelConfig) -> dict:
    if not m.dsa:
        return {}
    types = m.indexer_types
    blocks = frozenset(i for i in range(m.num_layers + m.mtp_num_layers)
                       if types is None or i >= m.num_layers or types[i] == "full")
    return dict(indexer=blocks, index_heads=m.index_n_heads, index_dim=m.index_head_dim, index_topk=m.index_topk,
                index_sparse=m.dsa_stage == "sparse", dsa=True, index_loss=m.dsa_indexer_loss_weight > 0)


def _deltanet_dims(m: ModelConfig) -> dict:
    layers = frozenset(i for i in range(m.num_layers) if layer_mixer(m, i) == "gated_deltanet")
    kda = frozenset(i for i in range(m.num_layers) if layer_mixer(m, i) == "kda")
    if not layers and not kda:
        return {}
    return dict(deltanet=layers, kda=kda, lin_key_heads=m.linear_num_key_heads, lin_value_heads=m.linear_num_value_heads,
                lin_key_dim=m.linear_key_head_dim, lin_value_dim=m.linear_value_head_dim,
                lin_conv=m.linear_conv_kernel, lin_chunk=m.linear_chunk_size)


def _mla_dims(m: ModelConfig) -> dict:
    if m.attention != "mla":
        return {}
    shapes = tuple((name, out, inp) for name, (out, inp) in mla_weight_shapes(m).items())
    return dict(mla=shapes, q_lora=m.q_lora_rank or 0, kv_lora=m.kv_lora_rank,
                qk_head=m.qk_nope_head_dim + m.qk_rope_head_dim, v_head=m.v_head_dim, rope_dim=m.qk_rope_head_dim)


def _deltanet_params(d: Dims, pre: str, tp: int) -> list[tuple[str, int, str]]:
    """One Gated DeltaNet layer's parameters on one tp rank (heads split over tp; the
    norm's weight is shared by every head, so its grad is partial over tp)."""
    value = d.lin_value_heads * d.lin_value_dim
    return [(f"{pre}.attn.conv_weight", d.lin_conv_size * d.lin_conv // tp, "tp"),
            (f"{pre}.attn.A_log", d.lin_value_heads // tp, "tp"),
            (f"{pre}.attn.norm_weight", d.lin_value_dim, "tp_sum"),
            (f"{pre}.attn.dt_bias", d.lin_value_heads // tp, "tp"),
            (f"{pre}.attn.in_proj.weight", d.lin_in_size * d.hidden // tp, "tp"),
            (f"{pre}.attn.out_proj.weight", d.hidden * value // tp, "tp")]


def _indexer_params(d: Dims, pre: str) -> list[tuple[str, int, str]]:
    """A DSA layer's lightning indexer: replicated over tp, where every rank scores every
    query of its (gathered) sequence, so its grads are equal there, not partial."""
    ix = f"{pre}.attn.indexer"
    return [(f"{ix}.wq.weight", d.index_heads * d.index_dim * d.q_lora, "replicated"),
            (f"{ix}.wk.weight", d.index_dim * d.hidden, "replicated"),
            (f"{ix}.k_norm.weight", d.index_dim, "replicated"), (f"{ix}.k_norm.bias", d.index_dim, "replicated"),
            (f"{ix}.weights_proj.weight", d.index_heads * d.hidden, "replicated")]


def _kda_params(d: Dims, pre: str, tp: int, replicated: str) -> list[tuple[str, int, str]]:
    """One KDA layer's parameters on one tp rank: q|k|v|beta projected like Gated DeltaNet's,
    a decay per channel (``dt_bias``), the low-rank decay and output-gate projections (their
    shared down-projection replicated over tp, as MLA's latents)."""
    nh, width = d.lin_key_heads, d.lin_key_heads * d.lin_key_dim
    return [(f"{pre}.attn.conv_weight", 3 * width * d.lin_conv // tp, "tp"),
            (f"{pre}.attn.A_log", nh // tp, "tp"),
            (f"{pre}.attn.norm_weight", d.lin_key_dim, "tp_sum"),
            (f"{pre}.attn.dt_bias", width // tp, "tp"),
            (f"{pre}.attn.in_proj.weight", (3 * width + nh) * d.hidden // tp, "tp"),
            (f"{pre}.attn.gates_down.weight", 2 * d.lin_key_dim * d.hidden, replicated),
            (f"{pre}.attn.decay_up.weight", width * d.lin_key_dim // tp, "tp"),
            (f"{pre}.attn.gate_up.weight", width * d.lin_key_dim // tp, "tp"),
            (f"{pre}.attn.out_proj.weight", d.hidden * width // tp, "tp")]


def _attention_params(d: Dims, pre: str, tp: int, replicated: str) -> list[tuple[str, int, str]]:
    """One layer's attention parameters on one tp rank, in ``model.parameters()`` order."""
    if d.mla:
        out = []
        for name, rows, cols in d.mla:
            if name in ("q_down", "kv_down"):  # replicated over tp, then their latents' norms
                out.append((f"{pre}.attn.{name}.weight", rows * cols, replicated))
                width = d.q_lora if name == "q_down" else d.kv_lora
                out.append((f"{pre}.attn.{name[:-5]}_norm.weight", width, replicated))
            else:
                out.append((f"{pre}.attn.{name}.weight", rows * cols // tp, "tp"))
        return out
    # A module's own parameters come before its children's: the sinks first.
    out = [(f"{pre}.attn.sinks", d.heads // tp, "tp")] if d.sinks else []
    q_out = 2 * d.q_size if d.output_gate else d.q_size  # the gate comes out of the q projection
    out.append((f"{pre}.attn.qkv.weight", (q_out + 2 * d.kv_size) * d.hidden // tp, "tp"))
    if d.qkv_bias:
        out.append((f"{pre}.attn.qkv.bias", (q_out + 2 * d.kv_size) // tp, "tp"))
    out.append((f"{pre}.attn.proj.weight", d.hidden * d.q_size // tp, "tp"))
    if d.out_bias:  # added once after the tp sum: replicated (a partial grad under SP)
        out.append((f"{pre}.attn.proj.bias", d.hidden, replicated))
    if d.qk_norm and d.qk_norm_scope == "projection":  # OLMoE: the whole q and k, split over tp
        out.append((f"{pre}.attn.q_norm.weight", d.q_size // tp, "tp"))
        out.append((f"{pre}.attn.k_norm.weight", d.kv_size // tp, "tp"))
    elif d.qk_norm and d.qk_norm_scope != "l2":  # Llama-4's L2 norm has no weight
        # Each tp rank normalises its own heads, so the grads are partial over tp.
        out.append((f"{pre}.attn.q_norm.weight", d.head_dim, "tp_sum"))
        out.append((f"{pre}.attn.k_norm.weight", d.head_dim, "tp_sum"))
    return out


# --------------------------------------------------------------------------- parameters

@dataclass(frozen=True)
class ParamEntry:
    """One parameter on one rank: its name in ``model.named_parameters()``, its local
    element count and its gradient-sync kind."""
    name: str
    numel: int
    kind: str


def stage_layers(config: Config, pp_rank: int) -> list[int]:
    """Global layer indices held by pipeline rank ``pp_rank``: its chunks ``pp_rank,
    pp + pp_rank, ...`` of the ``pp * vpp`` chunks of ``pp_layer_counts``."""
    pp = config.parallel.pp
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, parallel.pp={pp})")
    counts = pp_layer_counts(config)
    starts = [sum(counts[:c]) for c in range(len(counts))]
    return [starts[c] + i for c in range(pp_rank, len(counts), pp) for i in range(counts[c])]


def stage_blocks(config: Config, pp_rank: int) -> list[int]:
    """The transformer blocks of stage ``pp_rank``: its layers, and on the last stage the
    MTP depths' blocks as ``num_layers + k`` (index into ``Dims.moe_flags``)."""
    m = config.model
    mtp = list(range(m.num_layers, m.num_layers + m.mtp_num_layers)) if pp_rank == config.parallel.pp - 1 else []
    return stage_layers(config, pp_rank) + mtp


def param_manifest(config: Config, pp_rank: int = 0) -> list[ParamEntry]:
    """The parameters of one rank on pipeline stage ``pp_rank``, in ``model.parameters()``
    order, under ``config.parallel`` (tp, ep, etp, pp, vpp, sequence_parallel)."""
    d, p = dims(config), config.parallel
    tp, ep, etp, pp = p.tp, p.ep, etp_size(config), p.pp
    replicated = "tp_sum" if p.sequence_parallel else "replicated"
    out: list[ParamEntry] = []

    def add(name: str, numel: int, kind: str) -> None:
        out.append(ParamEntry(name, numel, kind))

    up = 2 if d.gated_mlp else 1  # fc1 is gate|up, or up alone (relu2)
    expert_up = 2 if d.gated_experts else 1

    def dense(pre: str) -> None:
        add(f"{pre}.mlp.fc1.weight", up * d.ffn * d.hidden // tp, "tp")
        add(f"{pre}.mlp.fc2.weight", d.hidden * d.ffn // tp, "tp")

    def mixer_and_norms(pre: str, i: int) -> None:
        if i not in d.no_mixer:  # Nemotron-H's mlp and moe layers have no token mixer
            add(f"{pre}.attn_norm.weight", d.hidden, replicated)
            if i in d.deltanet:
                mixer = _deltanet_params(d, pre, tp)
            elif i in d.kda:
                mixer = _kda_params(d, pre, tp, replicated)
            elif i in d.mamba:
                mixer = _mamba_params(d, pre, tp)
            else:
                mixer = _attention_params(d, pre, tp, replicated)
            if i in d.indexer:
                mixer += _indexer_params(d, pre)
            for entry in mixer:
                add(*entry)
        if i not in d.no_mlp:  # nor its token-mixer layers an MLP
            add(f"{pre}.mlp_norm.weight", d.hidden, replicated)

    def block(pre: str, i: int) -> None:
        if d.shortcut and i < d.layers:  # the sublayers (norms, attention, dense MLP), then the MoE
            for j in range(d.sublayers):
                mixer_and_norms(f"{pre}.sublayers.{j}", i)
                dense(f"{pre}.sublayers.{j}")
        else:
            mixer_and_norms(pre, i)
        if i in d.no_mlp:
            return
        if d.moe_flags[i]:
            local = d.experts // ep + d.replicas  # expert slots: the copies take memory too
            # A module's own parameters come before its submodules' (the gate first).
            if d.shared_ffn > 0 and d.shared_gate:
                add(f"{pre}.mlp.shared_expert_gate", d.hidden, replicated)
            add(f"{pre}.mlp.router.weight", (d.experts + d.zero_experts) * d.hidden, replicated)
            if d.router_bias:
                add(f"{pre}.mlp.router.bias", d.experts + d.zero_experts, replicated)
            if d.latent:  # replicated like the router
                add(f"{pre}.mlp.latent_in.weight", d.hidden * d.latent, replicated)
                add(f"{pre}.mlp.latent_out.weight", d.latent * d.hidden, replicated)
            w = d.expert_width
            add(f"{pre}.mlp.experts.fc1", local * w * expert_up * d.expert_ffn // etp, "expert")
            add(f"{pre}.mlp.experts.fc2", local * d.expert_ffn * w // etp, "expert")
            if d.expert_linear_bias:  # fc1's bias split like its columns, fc2's over its output width
                add(f"{pre}.mlp.experts.fc1_bias", local * expert_up * d.expert_ffn // etp, "expert")
                add(f"{pre}.mlp.experts.fc2_bias", local * w // etp, "expert")
            if d.shared_ffn > 0:
                add(f"{pre}.mlp.shared_expert.fc1.weight", up * d.shared_ffn * d.hidden // tp, "tp")
                add(f"{pre}.mlp.shared_expert.fc2.weight", d.hidden * d.shared_ffn // tp, "tp")
        else:
            dense(pre)

    last = pp_rank == pp - 1
    # A tied head and the MTP depths read the embedding on the last stage: with pp > 1 it
    # holds its own copy, named like the first stage's.
    if pp_rank == 0 or (last and (d.tied or d.mtp > 0)):
        add("embed.weight", d.vocab * d.hidden // tp, "tp")
    for i in stage_layers(config, pp_rank):
        block(f"layers.{i}", i)
    if last:
        add("norm.weight", d.hidden, replicated)
        if not d.tied:  # tied: the head IS the embedding (one parameter)
            add("lm_head.weight", d.vocab * d.hidden // tp, "tp")
        for k in range(d.mtp):
            pre = f"mtp.{k}"
            add(f"{pre}.enorm.weight", d.hidden, replicated)
            add(f"{pre}.hnorm.weight", d.hidden, replicated)
            add(f"{pre}.eh_proj.weight", 2 * d.hidden * d.hidden, replicated)
            block(f"{pre}.block", d.layers + k)
            add(f"{pre}.norm.weight", d.hidden, replicated)
    return out


# --------------------------------------------------------------------------- FLOPs

def held_rows_per_token(config: Config) -> float:
    """Rows a token sends to held experts under balanced routing: ``topk``, less the
    expected share on zero experts, ``topk * E / (E + Z)`` (routing balanced over every
    router column, the expert bias's aim; LongCat-Flash's budget: 12 * 512/768 = 8)."""
    moe = config.moe
    if not moe.zero_experts:  # also a dense model's rows (no experts at all)
        return moe.topk
    return moe.topk * moe.num_experts / (moe.num_experts + moe.zero_experts)


def expert_rows_per_token(config: Config) -> float:
    """Rows the experts compute per routed token: :func:`held_rows_per_token` (dropless; the
    planner assumes balanced routing, so a capacity drops nothing), ``topk *
    capacity_factor`` when every expert is padded to its capacity."""
    moe = config.moe
    if moe.pad_to_capacity and moe.capacity_factor is not None:
        return moe.topk * moe.capacity_factor
    return held_rows_per_token(config)


def layer_forward_flops(config: Config, layer: int, rows_per_token: float | None = None) -> dict[str, float]:
    """Forward matmul FLOPs per token of ``layer``, by part: ``attention`` (projections),
    ``core`` (scores and context over the full sequence), ``mlp`` (dense; a shortcut_moe
    block's two attention sublayers and two dense MLPs count twice), ``router``,
    ``experts`` (``rows_per_token`` rows, default :func:`expert_rows_per_token`, in the
    experts' width: ``moe.latent_size`` in a latent MoE), ``latent`` (a latent MoE's two
    projections, ``H -> L`` and ``L -> H`` once per token; never recomputed),
    ``shared`` (shared expert and its gate)."""
    d = dims(config)
    h = d.hidden
    if layer in d.no_mixer:
        projections = core = 0
    elif layer in d.mamba:
        in_rows = 2 * d.m2_inner + 2 * d.m2_groups * d.m2_state + d.m2_heads
        projections = 2 * h * in_rows + 2 * d.m2_inner * h
        # The chunked SSD, per head and token: C.B scores within its chunk of C tokens and
        # their product with x (counted in full, as attention's core is), and two products
        # with the N x P state (its read by C, its write by B x). The conv, gates and the
        # gated norm are element-wise.
        core = d.m2_heads * (2 * d.m2_chunk * (d.m2_state + d.m2_head_dim) + 4 * d.m2_state * d.m2_head_dim)
    elif layer in d.deltanet:
        value = d.lin_value_heads * d.lin_value_dim
        projections = 2 * h * d.lin_in_size + 2 * value * h
        # The chunked gated delta rule, per value head and token: scores and context within
        # its chunk of C tokens (counted in full, as attention's core is), and three
        # products with the dk x dv state (its read by q, its read by k for the delta, its
        # update). The short conv and the gates are element-wise.
        core = d.lin_value_heads * (2 * d.lin_chunk * (d.lin_key_dim + d.lin_value_dim)
                                    + 6 * d.lin_key_dim * d.lin_value_dim)
    elif layer in d.kda:
        nh, dk = d.lin_key_heads, d.lin_key_dim
        # q|k|v|beta, the low-rank decay and gate (down to dk, up to every channel), the output.
        projections = 2 * h * (3 * nh * dk + nh) + 2 * h * 2 * dk + 2 * 2 * dk * nh * dk + 2 * nh * dk * h
        # The same chunked rule with a decay per key channel: in-chunk scores weigh each
        # channel's product by its own decay (counted as the matmul it replaces) and the
        # state products are Gated DeltaNet's.
        core = nh * (2 * d.lin_chunk * 2 * dk + 6 * dk * dk)
    else:
        if d.mla:
            projections = sum(2 * rows * cols for _, rows, cols in d.mla)
        else:
            projections = 2 * h * (d.q_size + 2 * d.kv_size) + 2 * d.q_size * h
        if d.output_gate:  # the sigmoid gate's columns of the q projection
            projections += 2 * h * d.q_size
        keys = min(d.index_topk, d.seq) if d.index_sparse else d.seq  # DSA: the kept keys (a shared layer's too)
        core = 2 * keys * (d.q_size + d.out_size)
        if layer in d.indexer:
            # The indexer's projections (query from the q latent, key, head weights), and its
            # scores: every query against every key, per head, then the weighted head sum.
            projections += 2 * (d.q_lora * d.index_heads * d.index_dim + h * d.index_dim + h * d.index_heads)
            core += 2 * d.seq * d.index_heads * (d.index_dim + 1)
    # A shortcut_moe block: two attention sublayers, each with a dense MLP, beside its MoE.
    sublayers = d.sublayers if layer < d.layers else 1
    # A gated MLP's fc1 is gate|up (three matrices in all), relu2's up alone (two).
    per_width = 6 * h if d.gated_mlp else 4 * h
    out = {"attention": sublayers * projections, "core": sublayers * core,
           "mlp": per_width * d.ffn * (sublayers if d.shortcut else 0), "router": 0.0, "experts": 0.0, "latent": 0.0,
           "shared": 0.0}
    if layer in d.no_mlp:
        pass
    elif d.moe_flags[layer]:
        rows = expert_rows_per_token(config) if rows_per_token is None else rows_per_token
        out["router"] = 2 * h * (d.experts + d.zero_experts)
        out["experts"] = rows * (6 if d.gated_experts else 4) * d.expert_width * d.expert_ffn
        out["latent"] = 4 * h * d.latent
        out["shared"] = per_width * d.shared_ffn + (2 * h if d.shared_ffn and d.shared_gate else 0)
    else:
        out["mlp"] = per_width * d.ffn
    return out


def head_forward_flops(config: Config) -> float:
    """Forward FLOPs per token of the LM head (the logits)."""
    d = dims(config)
    return 2 * d.hidden * d.vocab


def mtp_forward_flops(config: Config) -> float:
    """Forward FLOPs per token of the MTP depths besides their blocks: each depth's
    ``eh_proj`` (``2H -> H``) and its logits through the shared head."""
    d = dims(config)
    return d.mtp * (4 * d.hidden * d.hidden + head_forward_flops(config))


def model_flops_per_step(config: Config) -> float:
    """Model FLOPs of one optimizer step (the MFU numerator): 3 x forward (the backward is
    twice the forward) for ``global_batch_size * seq_length`` tokens, activated experts
    only (``topk`` per token, less those on zero experts), no recompute; the MTP depths
    included (DeepSeek-V3 counts them in its training FLOPs too)."""
    d = dims(config)
    rows = held_rows_per_token(config)
    per_token = sum(sum(layer_forward_flops(config, i, rows).values()) for i in range(d.layers + d.mtp))
    per_token += head_forward_flops(config) + mtp_forward_flops(config)
    return 3.0 * config.train.global_batch_size * d.seq * per_token


def _recomputed_forward(parts: dict[str, float], is_moe: bool, recompute: str) -> float:
    """Forward FLOPs run again in the backward under ``recompute`` (what
    :func:`moe_fold.models.model.set_recompute` marks; the router never reruns)."""
    if recompute == "none":
        return 0.0
    if recompute == "full":
        if not is_moe:
            return parts["attention"] + parts["core"] + parts["mlp"]
        return parts["attention"] + parts["core"] + parts["experts"] + parts["shared"]
    if recompute == "moe":
        return parts["experts"] + parts["shared"] if is_moe else 0.0
    if recompute == "expert_act":
        return parts["experts"] / 3  # fc2 is one of the expert's three H x F matmuls
    require(choice, "train.recompute", recompute)
    raise AssertionError(f"recompute mode {recompute} has no activation rule")


def rank_flops_per_microbatch(config: Config, pp_rank: int, recompute: str) -> float:
    """FLOPs one rank of stage ``pp_rank`` runs for one micro-batch, forward, backward and
    recompute. Each rank of a ``tp x cp`` group computes ``1/(tp*cp)`` of every dense
    matmul; with balanced routing each rank's experts get as many rows as its own tokens
    route (an ``etp x ep`` group holds the tokens of its ranks), so the experts split the
    same way."""
    d, p = dims(config), config.parallel
    tokens = config.train.micro_batch_size * d.seq / (p.tp * p.cp)
    total = 0.0
    for i in stage_blocks(config, pp_rank):
        parts = layer_forward_flops(config, i)
        total += 3 * sum(parts.values()) + _recomputed_forward(parts, d.moe_flags[i], recompute)
    if pp_rank == p.pp - 1:
        total += 3 * (head_forward_flops(config) + mtp_forward_flops(config))
    return tokens * total


# --------------------------------------------------------------------------- activations

def act_bytes(config: Config) -> int:
    """Bytes of one activation element: 4 under ``fp32``, 2 under ``bf16`` (and
    ``bf16-autocast``, whose matmul outputs are bf16)."""
    return 4 if config.train.precision == "fp32" else 2


def router_bytes(config: Config) -> int:
    """Bytes of one routing prob (``moe.router_dtype``)."""
    return 8 if config.moe.router_dtype == "float64" else 4


def layer_activation_bytes(config: Config, layer: int, recompute: str) -> float:
    """Bytes one rank keeps for the backward, per token it holds (``s*b/(cp*tp)`` tokens
    under sequence parallelism, ``s*b/cp`` without), for ``layer``.

    ``g`` is the gather factor: a column-parallel input gathered over tp holds ``g = tp``
    tokens per local token under SP (1 without). Kept tensors (``a`` bytes per element):
    norm inputs ``aH``; the gathered q|k|v input ``aHg``; q, k, v and the attention output
    ``a(2q + 2kv)g/tp`` and the fp32 log-sum-exp ``4 heads g/tp``; the projection input
    ``a q g/tp``. Dense MLP: gathered input ``aHg``, fc1 output ``2aFg/tp``, fc2 input
    ``aFg/tp``. MoE: the norm output ``aH`` (router, gate and dispatcher read it), the
    router's input copy and its logits, scores and probs (router dtype); per expert row
    (``topk`` per token, the etp group's rows on every etp rank): the gathered rows ``aH``
    each, fc1 output ``2aF_e/etp``, SwiGLU output ``aF_e/etp``; the shared expert like a
    dense MLP, and its output ``aH`` when gated.
    A shortcut_moe block keeps two attention sublayers' and two dense MLPs' tensors besides
    its MoE's (the dense MLPs are not recomputed).
    Recompute keeps only the inputs of what reruns: ``full`` a dense block's input ``aH``,
    an MoE block's attention input and the experts' and shared expert's inputs;
    ``moe`` the experts' and shared expert's inputs; ``expert_act`` drops the SwiGLU output.
    """
    require(choice, "train.recompute", recompute)
    d, p = dims(config), config.parallel
    a, h, tp, etp = act_bytes(config), d.hidden, p.tp, etp_size(config)
    g = tp if p.sequence_parallel else 1
    if d.mla:
        attention = a * h + mla_attention_bytes(d, a, g, tp)
    else:
        attention = (a * h + a * h * g + a * (2 * d.q_size + 2 * d.kv_size) * g / tp
                     + 4 * d.heads * g / tp + a * d.q_size * g / tp)
    mlp = a * h + a * h * g + 3 * a * d.ffn * g / tp
    if not d.moe_flags[layer]:
        return a * h if recompute == "full" else attention + mlp
    if recompute == "full":
        attention = a * h
    # A shortcut_moe block: a second attention sublayer, and a dense MLP after each (not recomputed).
    sublayers = d.sublayers if layer < d.layers else 1
    attention = sublayers * attention + (sublayers * mlp if d.shortcut and layer < d.layers else 0.0)
    rb = router_bytes(config)
    routed = rb * h + 3 * rb * d.experts
    rows = expert_rows_per_token(config) * etp
    expert_in = rows * a * h
    expert_mid = rows * 3 * a * d.expert_ffn / etp
    if recompute in ("full", "moe"):
        expert_mid = 0.0
    elif recompute == "expert_act":
        expert_mid = rows * 2 * a * d.expert_ffn / etp
    shared = 0.0
    if d.shared_ffn > 0:
        if recompute not in ("full", "moe"):
            shared = a * h * g + 3 * a * d.shared_ffn * g / tp
        if d.shared_gate:
            shared += a * h
    return attention + a * h + a * h + routed + expert_in + expert_mid + shared


def mla_attention_bytes(d: Dims, a: int, g: int, tp: int) -> float:
    """Bytes an MLA layer keeps per local token (``a`` per element, ``g`` the SP gather
    factor), norm before it aside: the down-projections' input ``aH``; the q latent and
    its gathered copy ``a q_lora (1 + g)`` (or, full-rank, under SP the gathered input
    ``aHg``: without SP the q projection keeps the down-projections' input); the
    compressed kv ``a (kv_lora + rope)``, the normed latent as the up-projection keeps it
    (gathered under SP) ``a kv_lora g`` (the rotary key is kept by no op: rotary multiplies
    by constants, the concatenation keeps nothing); per local head (``g/tp``): q and k ``2 a heads qk``, v and
    the output padded to the q/k width for the fused kernel
    (:func:`moe_fold.parallel.varlen.sdpa`) ``2 a heads qk``, the projection's input
    ``a heads v`` and the float32 log-sum-exp ``4 heads``. The latents' norms keep an fp32
    ``rsqrt`` each (4). The fused kernel keeps no ``s x s`` scores."""
    heads = a * (4 * d.q_size + d.out_size) + 4 * d.heads
    return mla_latent_bytes(d, a, g) + heads * g / tp


def mla_latent_bytes(d: Dims, a: int, g: int) -> float:
    """The part of :func:`mla_attention_bytes` before the heads: the down-projections'
    input, the q latent (or the gathered input) and the kv latent, with their norms'
    ``rsqrt``; DSA's attention (:func:`moe_fold.planner.memory.dsa_attention_bytes`)
    keeps the same."""
    query = a * d.q_lora * (1 + g) + 4 if d.q_lora else (a * d.hidden * g if g > 1 else 0)
    latent = a * (d.kv_lora + d.rope_dim) + a * d.kv_lora * g + 4
    return a * d.hidden + query + latent


def head_activation_bytes(config: Config) -> float:
    """Bytes the last stage keeps per local token for the head and loss: the final norm's
    input, the gathered head input, and the logits ``[.., V/tp]`` (bf16 while the fp32
    exp the cross entropy saves is made)."""
    d, p = dims(config), config.parallel
    a = act_bytes(config)
    g = p.tp if p.sequence_parallel else 1
    return a * d.hidden + a * d.hidden * g + (a + 4) * d.vocab * g / p.tp


def mtp_activation_bytes(config: Config) -> float:
    """Bytes the last stage keeps per local token for the MTP depths besides their blocks:
    per depth the two input norms' inputs ``2aH``, ``eh_proj``'s input ``2aH`` and the
    head and loss of :func:`head_activation_bytes`."""
    d = dims(config)
    a = act_bytes(config)
    return d.mtp * (4 * a * d.hidden + head_activation_bytes(config))


def microbatches_in_flight(config: Config, pp_rank: int, num_microbatches: int) -> float:
    """How many micro-batches' worth of stage ``pp_rank``'s activations are alive at its
    peak. 1F1B (Narayanan 2021): stage r runs ``pp - r`` forwards before its first
    backward. Interleaved (Megatron's schedule): ``2(pp - r - 1) + (vpp - 1) pp + 1``
    chunk-forwards, each ``1/vpp`` of the stage's layers, which on stage 0 is
    Korthikanti's ``1 + (pp - 1)/(pp vpp)`` factor. Never more than the micro-batches."""
    pp, v = config.parallel.pp, vpp_size(config)
    if v == 1:
        return float(min(num_microbatches, pp - pp_rank))
    chunks = min(num_microbatches * v, 2 * (pp - pp_rank - 1) + (v - 1) * pp + 1)
    return chunks / v

"""The config's sections: one dataclass per YAML section, each field under the comment
that documents it (docs/configuration.md is generated from these comments by reference.py).

Also here, because every other part of ``moe_fold.config`` uses them: ``ConfigError``,
``SECTIONS`` (section name -> dataclass), a section's field types, and a value written
as YAML writes it (for messages).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union


# The signals train.exit_signals may name: those a job scheduler, a container runtime or a
# terminal sends to end a process politely (SIGKILL and SIGSTOP cannot be caught).
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")


@dataclass
class ModelConfig:
    """The transformer: sizes, attention (standard or MLA), rotary embeddings, multi-token prediction."""

    # Token ids are in [0, vocab_size): the embedding and output head rows.
    vocab_size: int = 512
    # Width of the residual stream.
    hidden_size: int = 128
    # Transformer blocks (MTP depths not counted).
    num_layers: int = 4
    # Query heads of each attention layer.
    num_heads: int = 4
    # Key/value heads (grouped-query attention: num_heads is a multiple of it).
    num_kv_heads: int = 2
    # Per-head width; None means hidden_size // num_heads.
    head_dim: Optional[int] = None
    # Width of the dense SwiGLU MLP in dense (non-MoE) layers.
    ffn_hidden_size: int = 256
    # Tokens per training sample.
    seq_length: int = 128
    # Base of the rotary embeddings' frequencies.
    rope_theta: float = 10000.0
    # Epsilon of every RMSNorm.
    norm_eps: float = 1e-6
    # Qwen3-style RMSNorm on each query and key head.
    qk_norm: bool = False
    # What the QK-norm normalises: head (each head, Qwen3, GLM-4.5) | projection (the whole
    # q and k projections, OLMoE; under tp the sum of squares is reduced over tp) | l2 (each
    # head, no weight, after rotary, on rotary layers only: Llama-4's L2 norm).
    qk_norm_scope: Literal["head", "projection", "l2"] = "head"
    # Fraction of each head's dims that rotary embeddings rotate (the first ones; GLM-4.5: 0.5).
    partial_rotary_factor: float = 1.0
    # Biases on the q, k and v projections (Qwen2-MoE).
    qkv_bias: bool = False
    # A bias on attention's output projection (gpt-oss; standard attention only).
    attention_out_bias: bool = False
    # The output head reuses the input embedding's weight.
    tie_embeddings: bool = False
    # Standard deviation of the normal initialisation of every weight matrix.
    init_std: float = 0.02
    # Multi-token prediction (DeepSeek-V3): depth k predicts token t+1+k; 0 disables it.
    mtp_num_layers: int = 0
    # The MTP loss (mean over depths) is added to the objective times this weight.
    mtp_loss_weight: float = 0.1

    # Attention kind: mha (grouped-query multi-head attention) | mla (DeepSeek's multi-head
    # latent attention: low-rank query and joint key/value compression, decoupled rotary part).
    attention: Literal["mha", "mla"] = "mha"
    # MLA (names as in Hugging Face's DeepseekV3Config): rank of the query compression; null: a
    # full-rank query.
    q_lora_rank: Optional[int] = None
    # MLA: rank of the joint key/value compression (required with attention=mla).
    kv_lora_rank: Optional[int] = None
    # MLA: per-head query/key width without rotary embeddings.
    qk_nope_head_dim: Optional[int] = None
    # MLA: per-head query/key width that rotary embeddings rotate (even).
    qk_rope_head_dim: Optional[int] = None
    # MLA: per-head value width.
    v_head_dim: Optional[int] = None
    # The rotary dims of q and k come in interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's,
    # ERNIE-4.5's and Llama-4's checkpoints) instead of two halves.
    rope_interleave: bool = False
    # Rotary scaling: null (none) | yarn (Peng et al. 2023, as DeepSeek-V3 uses it).
    rope_scaling: Optional[Literal["yarn"]] = None
    # YaRN: context extension factor (>= 1; required with rope_scaling=yarn).
    yarn_factor: Optional[float] = None
    # YaRN: the context length the model was trained at before extension.
    yarn_original_max_position_embeddings: Optional[int] = None
    # YaRN: rotations at the original context above which a dim keeps its frequency (extrapolation).
    yarn_beta_fast: float = 32.0
    # YaRN: rotations below which a dim's frequency is divided by yarn_factor (interpolation).
    yarn_beta_slow: float = 1.0
    # YaRN: cos/sin scale mscale(yarn_mscale) / mscale(yarn_mscale_all_dim) when both are set, else
    # mscale(1); the MLA softmax scale also takes mscale(yarn_mscale_all_dim)^2 when set.
    yarn_mscale: Optional[float] = None
    # YaRN: see yarn_mscale.
    yarn_mscale_all_dim: Optional[float] = None
    # YaRN's correction range rounded to whole dims (DeepSeek-V3); false keeps it fractional (gpt-oss).
    yarn_truncate: bool = True

    # Attention features (models/attention.py, docs/attention.md; mha only).
    # Attention sinks (gpt-oss): a learned logit per query head joins each softmax denominator.
    attention_sinks: bool = False
    # Sliding window on the local layers: a query sees its last sliding_window keys, itself included; 0: none.
    sliding_window: int = 0
    # Chunked local attention on the local layers (Llama-4): a query sees only the keys of its own
    # chunk of attention_chunk positions (positions restart in each packed document); 0: none.
    attention_chunk: int = 0
    # The local layers: null every layer, or one 0/1 per layer (1: sliding_window/attention_chunk applies).
    local_attention_layers: Optional[list[int]] = None
    # The layers with rotary embeddings: null every layer, or one 0/1 per layer (0: no rotary, NoPE;
    # MLA layers too: Kimi-Linear's).
    rope_layers: Optional[list[int]] = None
    # Temperature tuning on layers without rotary (Llama-4): a query at position p is multiplied by
    # 1 + attn_temperature_scale * log1p(floor((p + 1) / attn_temperature_floor)).
    attn_temperature_tuning: bool = False
    # Temperature tuning: the scale of the log term (Llama-4's attn_scale).
    attn_temperature_scale: float = 0.1
    # Temperature tuning: positions per step of the floor (Llama-4's floor_scale).
    attn_temperature_floor: int = 8192

    # Layer types (models/gated_deltanet.py, Qwen3-Next; models/kda.py, Kimi-Linear).
    # Each layer's mixer: null attention on every layer, or one name per layer: attention |
    # gated_deltanet (Gated DeltaNet linear attention) | kda (Kimi Delta Attention) | mamba2 (Mamba2's SSD).
    layer_types: Optional[list[str]] = None
    # A sigmoid gate on every attention head's output, projected with the query (Qwen3-Next; mha only).
    attn_output_gate: bool = False
    # RMSNorm weights are zero-centred: a norm multiplies by 1 + weight, which starts at 0 (Qwen3-Next).
    norm_zero_centred: bool = False
    # Gated DeltaNet and KDA: query and key heads.
    linear_num_key_heads: int = 2
    # Gated DeltaNet and KDA: value heads (a multiple of linear_num_key_heads; each has its own state;
    # KDA: equal to linear_num_key_heads).
    linear_num_value_heads: int = 4
    # Gated DeltaNet and KDA: per-head query and key width (KDA: also its low-rank gates' rank).
    linear_key_head_dim: int = 32
    # Gated DeltaNet and KDA: per-head value width (KDA: equal to linear_key_head_dim).
    linear_value_head_dim: int = 32
    # Gated DeltaNet and KDA: taps of the depthwise causal conv1d on q, k and v.
    linear_conv_kernel: int = 4
    # Gated DeltaNet and KDA: tokens per chunk of the chunked delta rule (a speed knob; results do not depend on it).
    linear_chunk_size: int = 64
    # Gated DeltaNet and KDA: the kernel of the delta rule. auto: the device rule of
    # moe_fold.kernels.backends (fla on CUDA sm80+ where flash-linear-attention runs, else
    # torch) | torch (the chunked rule of moe_fold.kernels.gated_delta) | fla (pip install 'moe-fold[fla]').
    linear_backend: Literal["auto", "torch", "fla"] = "auto"

    # Block structure and MLA scaling (models/model.py, models/mla.py; LongCat-Flash).
    # The blocks: standard (attention, then the MLP or MoE; pre-norm residuals) | shortcut_moe
    # (LongCat-Flash's shortcut-connected MoE: two attention sublayers, each followed by a dense
    # MLP of width ffn_hidden_size, and an MoE that reads the first sublayer's normed output and
    # is added at the block's end; every block has it) | single_mixer (Nemotron-H: each layer has
    # one mixer, its model.layer_types entry, under one pre-norm and residual: attention |
    # gated_deltanet | mamba2 (no MLP after it) | mlp (a dense MLP alone) | moe (an MoE layer
    # alone; such layers are the MoE layers)).
    block: Literal["standard", "shortcut_moe", "single_mixer"] = "standard"
    # MLA: the query times sqrt(hidden_size / q_lora_rank) and the normed key/value latent times
    # sqrt(hidden_size / kv_lora_rank) (LongCat-Flash's LoRA scaling; needs q_lora_rank).
    mla_lora_scale: bool = False
    # MLA: epsilon of the latent RMSNorms (of the compressed query and key/value); null:
    # model.norm_eps (Kimi-Linear's, LongCat-Flash's and GLM-5's are 1e-6 beside a norm_eps of 1e-5).
    mla_norm_eps: Optional[float] = None

    # DeepSeek Sparse Attention (models/dsa.py, docs/attention.md; DeepSeek-V3.2, GLM-5): MLA whose
    # queries each attend only to the index_topk keys a lightning indexer scores highest.
    # DSA on the attention layers (needs model.attention=mla with model.q_lora_rank).
    dsa: bool = False
    # DSA: the lightning indexer's query heads.
    index_n_heads: int = 4
    # DSA: the indexer's query/key width (its first qk_rope_head_dim dims take rotary).
    index_head_dim: int = 32
    # DSA: keys each query attends to (all its causal keys while it has fewer).
    index_topk: int = 64
    # DSA: the indexer's rotary dims come in interleaved pairs (GLM-5) instead of two halves (DeepSeek-V3.2).
    index_rope_interleave: bool = False
    # DSA: null (every layer runs its indexer) or one name per layer: full | shared (the layer reuses
    # the selection of the nearest full layer before it; GLM-5).
    indexer_types: Optional[list[str]] = None
    # DSA training stage: dense_warmup (dense MLA; the indexer learns the attention's distribution by
    # KL) | sparse (MLA over the selected keys; the indexer learns by KL on them). The indexer takes no
    # gradient from the LM loss and its KL loss none to the rest of the model, in either stage.
    dsa_stage: Literal["dense_warmup", "sparse"] = "sparse"
    # DSA: the weight of the indexer's KL loss (0: the indexer is not trained).
    dsa_indexer_loss_weight: float = 1.0

    # The dense MLPs' and shared experts' activation: swiglu (fc1 is gate|up) | relu2
    # (Nemotron-H: relu(up)^2, not gated; fc1 is the up projection alone).
    mlp_activation: Literal["swiglu", "relu2"] = "swiglu"
    # Mamba2 (models/mamba2.py; Nemotron-H): heads, each with its own state.
    mamba_num_heads: int = 4
    # Mamba2: per-head width of x (the heads' widths together are the layer's inner width).
    mamba_head_dim: int = 16
    # Mamba2: width N of the state per head dim (B and C are N wide per group).
    mamba_state_size: int = 16
    # Mamba2: groups of heads sharing B and C (and one group of the gated norm each).
    mamba_num_groups: int = 1
    # Mamba2: taps of the depthwise causal conv1d (with a bias) on x, B and C.
    mamba_conv_kernel: int = 4
    # Mamba2: tokens per chunk of the chunked SSD (a speed knob; results do not depend on it).
    mamba_chunk_size: int = 64
    # Mamba2: the step dt = softplus(in_proj + dt_bias) is clamped below at this value; dt_bias
    # starts at softplus^-1 of steps drawn log-uniformly from [mamba_dt_min, mamba_dt_max].
    mamba_dt_min: float = 0.001
    # Mamba2: the largest step the initial dt_bias gives (see mamba_dt_min).
    mamba_dt_max: float = 0.1
    # Mamba2: the kernel of the SSD scan. auto: the device rule of moe_fold.kernels.backends
    # (mamba_ssm on CUDA sm80+ where mamba-ssm runs, else torch) | torch (the chunked scan of
    # moe_fold.kernels.ssd) | mamba_ssm (pip install 'moe-fold[mamba]').
    mamba_backend: Literal["auto", "torch", "mamba_ssm"] = "auto"
    # Gated DeltaNet, KDA and Mamba2: the kernel of the short causal conv. auto: the device rule of
    # moe_fold.kernels.backends (causal_conv1d on CUDA sm80+ where causal-conv1d runs and every
    # conv's width is 2 to 4 with channels per tp rank in multiples of 8, else torch) | torch
    # (moe_fold.kernels.gated_delta.causal_conv1d) | causal_conv1d (pip install 'moe-fold[conv]').
    conv_backend: Literal["auto", "torch", "causal_conv1d"] = "auto"


@dataclass
class MoEConfig:
    """The MoE layers: which layers, the experts, routing (Megatron-Core semantics), load
    balancing, token dispatch, expert placement and kernel backends."""

    # Routed experts of each MoE layer.
    num_experts: int = 8
    # Experts each token is routed to.
    topk: int = 2
    # Width of one routed expert's SwiGLU MLP.
    ffn_hidden_size: int = 256
    # Which layers are MoE: an int N means every N-th layer (1 = all, 0 = none),
    # a list gives one 0/1 flag per layer.
    moe_layer_freq: Union[int, list[int]] = 1
    # The first K layers are dense whatever moe_layer_freq says (DeepSeek style).
    first_k_dense: int = 0
    # Shared expert (always active): 0 disables it.
    shared_expert_ffn_hidden_size: int = 0
    # Qwen2-MoE style sigmoid(x . w) gate on the shared expert's output.
    shared_expert_gate: bool = False

    # Router scores from the logits (Megatron-Core semantics): softmax | sigmoid (DeepSeek-V3;
    # with topk > 1 the chosen scores are normalised to sum to 1).
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    # softmax only: softmax over all experts, then top-k (false: top-k of the logits, then
    # softmax over the k chosen).
    pre_softmax: bool = False
    # Group-limited routing (DeepSeek-V3): the experts form num_groups equal groups and a
    # token picks its experts in its best group_topk groups; null (with group_topk) is off.
    num_groups: Optional[int] = None
    # Groups a token may pick experts from (with num_groups).
    group_topk: Optional[int] = None
    # How group-limited routing ranks a group (dispatch/router.py): topk_sum, the sum of its
    # best topk/group_topk scores (Megatron-Core); top2_sum, the sum of its best 2 whatever
    # topk is (DeepSeek-V3, GLM-4.5); max, its best score (DeepSeek-V2's group_limited_greedy).
    group_score: Literal["topk_sum", "top2_sum", "max"] = "topk_sum"
    # pre_softmax only: renormalise the top-k probs, dividing by max(their sum, this floor)
    # (ERNIE-4.5's moe_norm_min); null keeps them as they are.
    topk_norm_min: Optional[float] = None
    # Multiplies the routing probabilities (DeepSeek's routed_scaling_factor); null: 1.
    scaling_factor: Optional[float] = None
    # Dtype of the router's logits and scores, whatever train.precision is.
    router_dtype: Literal["float32", "float64"] = "float32"
    # Training only: the router's input times uniform noise in [1 - eps, 1 + eps]; 0: off.
    input_jitter: float = 0.0
    # Llama-4: the router's prob scales each routed expert's input, expert(p * x), instead of its
    # output, p * expert(x) (the same for a linear expert, not for SwiGLU).
    score_on_input: bool = False
    # Aux-loss-free load balancing: a per-expert bias used for selection only (sigmoid
    # scores, or pre_softmax softmax scores as in ERNIE-4.5).
    expert_bias: bool = False
    # Step of the expert-bias update: the bias of an under-loaded expert rises by this much,
    # an over-loaded one's falls (sign of the load error).
    bias_update_rate: float = 1e-3
    # A learned bias on the router's logits, a linear with bias (gpt-oss).
    router_bias: bool = False
    # LongCat-Flash's zero-computation experts: this many identity experts after the routed
    # ones. The router scores and picks among all num_experts + zero_experts (topk counts
    # both); a token's slot on a zero expert adds its input times its gate weight where the
    # token is, so it is never dispatched and costs no expert FLOPs. 0: none.
    zero_experts: int = 0
    # Latent MoE (Nemotron 3 Super; transformers' moe_latent_size): the routed experts work in
    # this width. A token is projected hidden -> latent_size before the dispatch (the all-to-all
    # carries latent_size-wide rows) and the combined rows latent_size -> hidden after it; the
    # router and the shared expert read the hidden state. null: off (experts in the hidden width).
    latent_size: Optional[int] = None

    # gpt-oss's experts (models/experts.py): biases on every routed expert's fc1 (gate|up) and fc2.
    expert_linear_bias: bool = False
    # The routed experts' activation: swiglu | clamped_swiglu (gpt-oss: (clamp(up) + 1) *
    # g * sigmoid(swiglu_alpha * g), g = min(gate, swiglu_limit); kernels/swiglu.py) | relu2
    # (Nemotron-H: relu(up)^2, not gated; fc1 is the up projection alone).
    activation: Literal["swiglu", "clamped_swiglu", "relu2"] = "swiglu"
    # clamped_swiglu: the gate's sigmoid slope (gpt-oss's alpha).
    swiglu_alpha: float = 1.702
    # clamped_swiglu: the gate is clamped above, and up to +-, this limit.
    swiglu_limit: float = 7.0

    # Switch-style load-balancing loss per micro-batch (Megatron-Core's aux_loss); each kind of
    # router loss is on when its coefficient is > 0.
    aux_loss_coeff: float = 1e-2
    # Per-sequence load-balancing loss (DeepSeek-V3).
    seq_aux_loss_coeff: float = 0.0
    # Load-balancing loss over the whole global batch (counts summed over dp).
    global_aux_loss_coeff: float = 0.0
    # Router z-loss: the mean squared logsumexp of the router logits.
    z_loss_coeff: float = 0.0

    # Token dispatcher: alltoall (tokens sent to the ep ranks of their experts) | allgather (every
    # rank gathers every token of the etp x ep group and keeps those of its experts).
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    # None means dropless; a number enables token dropping at that capacity factor.
    capacity_factor: Optional[float] = None
    # With a capacity: which tokens an over-full expert keeps: probs (the highest routing
    # probabilities) | position (the first in the micro-batch).
    drop_policy: Literal["probs", "position"] = "probs"
    # With a capacity: every expert receives exactly its capacity of rows (padding), so the
    # all-to-all's sizes are known without a count exchange.
    pad_to_capacity: bool = False
    # Rank-deduplicated all-to-all: a token goes once to each destination rank.
    dedup: bool = False
    # Overlap (moe_fold.models.moe_layer): run the shared expert while the dispatch and
    # combine collectives are in flight.
    shared_expert_overlap: bool = False
    # Dispatch the layer's routed tokens in this many chunks (routing stays per layer), so
    # one chunk's all-to-all overlaps another chunk's expert GEMMs; 1 = off.
    overlap_chunks: int = 1

    # Expert placement (docs/placement.md): spare expert slots per ep rank, holding copies
    # of the hottest experts; 0: none.
    replicas: int = 0
    # Re-place the experts from the last window's load every N steps; 0: never.
    replace_every: int = 0

    # Kernel of the experts' grouped GEMMs. ``auto`` is the rule of moe_fold.kernels.backends (device, CUDA
    # capability, train.precision): on CPU gemm torch, permute torch, swiglu cpu (C loops;
    # needs a C compiler), topk torch; on sm90/sm100 bf16 gemm torch (grouped_mm), the rest
    # triton. A run resolves ``auto`` before its ranks start and writes the names it chose
    # into its config.yaml (and the printed config). The config (``--set``) is the one way
    # to choose.
    gemm_backend: Literal["auto", "grouped_gemm", "torch", "triton", "loop"] = "auto"
    # Kernel of the token permutation (see gemm_backend).
    permute_backend: Literal["auto", "torch", "triton"] = "auto"
    # Kernel of the experts' SwiGLU (see gemm_backend).
    swiglu_backend: Literal["auto", "torch", "triton", "cpu"] = "auto"
    # The router's top-k; triton fuses plain top-k only (not num_groups or expert_bias).
    topk_backend: Literal["auto", "torch", "triton"] = "auto"

    # Router replay (docs/routes.md): force every token's experts to those recorded in
    # PATH, a route trace (a run folder or its routes/ folder) or a routes file of the
    # inference format; gating weights come from the current router's scores at those
    # experts. None: the router chooses.
    router_replay: Optional[str] = None


@dataclass
class ParallelConfig:
    """The parallel layout: attention runs on tp x cp x dp x pp, the experts on etp x ep x edp x pp
    over the same ranks (MoE parallel folding); the process groups and their overlap."""

    # Tensor-parallel size (attention heads, MLP width, vocabulary split over tp ranks).
    tp: int = 1
    # Context-parallel size (each sequence split over cp ranks).
    cp: int = 1
    # Pipeline-parallel size (layers split into pp stages).
    pp: int = 1
    # Expert-parallel size (each ep rank holds num_experts/ep experts).
    ep: int = 1
    # Expert-tensor parallel size; None means the same as tp.
    etp: Optional[int] = None
    # Virtual pipeline stages (model chunks) per pp rank; None means 1.
    vpp: Optional[int] = None
    # Under tp, norms and dropout-free regions hold a 1/tp share of the tokens (required
    # with MoE layers when tp > 1: the router sees each token once).
    sequence_parallel: bool = False
    # How ranks map to groups: the dims tp, cp, ep, dp, pp joined by '-', leftmost varying
    # fastest (Megatron-Core's convention); the expert layout reads etp for tp and edp for dp.
    order: str = "tp-cp-ep-dp-pp"
    # Context-parallel attention: ring (key/value blocks passed round the cp group) | a2a
    # (all-to-all to heads split over cp, then full-sequence attention).
    cp_kind: Literal["ring", "a2a"] = "ring"
    # Dynamic cp: parallel.cp is the largest cp group; each micro-batch's documents run on
    # sub-groups sized for them (moe_fold.training.dynamic_cp). Needs tp=1, pp=1, cp a power of 2.
    dynamic_cp: bool = False
    # Compute FLOPs per byte of cp link bandwidth: how dynamic cp's cost model charges ring traffic.
    dynamic_cp_flops_per_byte: float = 10.0
    # auto: interleaved when vpp > 1, else 1f1b (pipeline_schedule() resolves it). Interleaved
    # needs the micro-batches of a step (global_batch_size / (micro_batch_size * dp)) to be a
    # multiple of pp.
    pp_schedule: Literal["auto", "1f1b", "interleaved"] = "auto"
    # Explicit number of layers on each pipeline stage; None splits evenly.
    pp_layers: Optional[list[int]] = None
    # torch.distributed backend: auto is nccl when the ranks compute on CUDA, else gloo.
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # Seconds a collective may wait before the run stops with an error.
    timeout_s: float = 300.0
    # Data-parallel overlap (moe_fold.training.buckets): reduce each gradient bucket during the
    # backward of the last micro-batch, as soon as its grads are final; all-gather each
    # parameter bucket of the distributed optimizer during the next forward, waited just
    # before the bucket's first use (per model chunk under pp/vpp). Off: after the backward, and
    # before the next step. On or off, the steps are the same bit for bit
    # (tests/training/test_train.py::test_overlaps_take_the_same_steps).
    overlap_grad_reduce: bool = False
    # See overlap_grad_reduce (needs optimizer.distributed).
    overlap_param_gather: bool = False
    # Elements per gradient bucket (and distributed-optimizer shard bucket).
    grad_bucket_numel: int = 1 << 24
    # Elastic restarts (moe_fold.elastic, docs/reliability.md): a world the layout does not fit
    # (a torchrun --nnodes MIN:MAX restart on fewer or more nodes) takes the first
    # elastic_layouts entry that fits, or else the largest ep <= parallel.ep that fits.
    elastic: bool = False
    # Layouts to try in order, each "name=size,..." over tp cp pp ep etp, e.g. ["ep=2", "ep=1"].
    elastic_layouts: Optional[list[str]] = None


@dataclass
class DataConfig:
    """Training and validation data, the tokenizer, and the checks made before training."""

    # Dataset prefix(es) (``.bin``/``.idx``) or text to tokenize; None: the demo corpus.
    path: Optional[Union[str, list[str]]] = None
    # Blend weights, one per path.
    weights: Optional[list[float]] = None
    # ``byte`` (no file needed) or a path to a Hugging Face tokenizer.json.
    tokenizer: str = "byte"
    # Pack whole documents into each sample and mask across document boundaries.
    packing: bool = False
    # Where text data is tokenized to, once; later runs reuse it.
    cache_dir: str = "data_cache"
    # Validation data (train.eval_every): a dataset prefix or text like ``path``, or
    # ``valid_fraction`` of each training dataset's documents (its last ones), held out.
    valid_path: Optional[str] = None
    # See valid_path.
    valid_fraction: float = 0.0
    # Tokenized data made elsewhere (moe_fold.data.sources): the end-of-document id of
    # formats that do not store one (Megatron, .npy/.bin token files, Hugging Face
    # input_ids; None: data.tokenizer's), and the token dtype of a raw .bin (nanoGPT: uint16).
    eod_id: Optional[int] = None
    # See eod_id: the token dtype of a raw .bin file.
    dtype: Optional[Literal["uint8", "uint16", "int16", "uint32", "int32", "int64"]] = None
    # Column / JSONL field holding the text of a document.
    text_key: str = "text"
    # Token-id check before training: ``sampled`` (8 blocks of 2^20 tokens per dataset)
    # or ``full`` (every token); the loader also checks each sample it reads.
    verify: Literal["sampled", "full"] = "sampled"


@dataclass
class OptimizerConfig:
    """AdamW, the learning-rate schedule, gradient clipping, the distributed optimizer."""

    # AdamW: the peak learning rate (after warmup).
    lr: float = 3e-3
    # The learning rate at the end of a cosine or WSD schedule.
    min_lr: float = 3e-4
    # AdamW's decoupled weight decay (not applied to norms and biases).
    weight_decay: float = 0.1
    # AdamW's first-moment decay.
    beta1: float = 0.9
    # AdamW's second-moment decay.
    beta2: float = 0.95
    # AdamW's denominator epsilon.
    eps: float = 1e-8
    # Clip the global gradient norm (over every rank) to this; 0: no clipping.
    clip_grad: float = 1.0
    # Learning rate after warmup: cosine (to min_lr) | wsd (warmup-stable-decay: constant,
    # then linear to min_lr over decay_fraction of the steps) | constant.
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    # Linear warmup from 0 to lr over this many steps.
    warmup_steps: int = 10
    # Fraction of steps spent decaying at the end of a WSD schedule.
    decay_fraction: float = 0.2
    # ZeRO-1: shard the AdamW state over dp x cp (dense) and edp (experts): each gradient bucket
    # is reduce-scattered, a rank updates the slice it owns, and the parameters are all-gathered
    # (the bytes of one all-reduce).
    distributed: bool = False


@dataclass
class TrainConfig:
    """The run: steps and batch sizes, precision and device, recompute, checkpoints, numerics,
    early stopping, evaluation."""

    # Optimizer steps of the run.
    steps: int = 100
    # Samples per rank in one forward/backward.
    micro_batch_size: int = 4
    # Samples per optimizer step over all dp ranks: micro_batch_size x dp x the micro-batches
    # each rank accumulates.
    global_batch_size: int = 16
    # Seeds the weights (the same under every layout), the data order and the router's noise.
    seed: int = 1234
    # Deterministic torch algorithms, so a resumed run repeats an uninterrupted one bit for
    # bit (tests/training/test_train.py::test_resume_is_exact).
    deterministic: bool = False
    # The run's folder: config.yaml, metrics.jsonl, checkpoints/, heatmaps/, plots/, wandb/.
    run_dir: str = "runs/default"
    # Save a checkpoint every N steps (and at the last one).
    save_every: int = 50
    # Checkpoints kept; older ones are deleted once a newer one is complete.
    keep_last: int = 2
    # Print the step's metrics every N steps (metrics.jsonl gets every step).
    log_every: int = 1
    # fp32 | bf16-autocast (fp32 weights, bf16 matmuls) | bf16 (bf16 weights, fp32 master
    # weights in the optimizer; on GPUs the full-size presets use it, and its expert GEMMs
    # take torch._grouped_mm's fast path on sm90/sm100). The router computes in
    # moe.router_dtype whatever this is.
    precision: Literal["fp32", "bf16-autocast", "bf16"] = "fp32"
    # Where a rank computes: auto is CUDA under NCCL and, in one process, when a GPU is
    # visible and parallel.backend is not gloo; CPU otherwise (moe_fold.training.train.compute_device).
    # A choice the process cannot honour (cuda without a GPU) stops the run before any work.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # TF32 tensor cores for float32 matmuls and convolutions on CUDA (10 mantissa bits in
    # the products, float32 accumulation); no effect on CPU.
    tf32: bool = True
    # torch.compile: none (eager) | blocks (every transformer block compiled on its own with
    # fullgraph=True, as torchtitan does; data-dependent sizes become unbacked symbolic
    # sizes). See docs/gpu.md, "Compiled blocks".
    compile: Literal["none", "blocks"] = "none"
    # Activation recompute in the backward: none | full (whole blocks) | moe (the experts and
    # shared expert) | expert_act (the experts' SwiGLU output only).
    recompute: Literal["none", "full", "moe", "expert_act"] = "none"
    # A non-finite loss or grad norm takes no optimizer step; the step's forwards run again
    # to name the first module that went non-finite; then skip (a warning, skipped and
    # nonfinite_module in metrics.jsonl) | stop (raise before that step is saved) | rollback
    # (load the last checkpoint again and skip the batches that caused it:
    # moe_fold.training.rollback).
    on_nonfinite: Literal["skip", "stop", "rollback"] = "skip"
    # A loss above loss_spike_factor x the median of the previous loss_spike_window
    # losses is logged as a spike (metrics.jsonl loss_spike, a warning); 0: off.
    loss_spike_factor: float = 3.0
    # See loss_spike_factor.
    loss_spike_window: int = 20
    # What a spike does besides being logged: nothing (log), end the run (stop), or roll back.
    on_loss_spike: Literal["log", "stop", "rollback"] = "log"
    # Rollback (moe_fold.training.rollback): the last checkpoint is loaded again and the
    # rollback_skip_batches global batches up to the bad step's are skipped for good;
    # more than max_rollbacks rollbacks to the same checkpoint end the run.
    rollback_skip_batches: int = 1
    # See rollback_skip_batches.
    max_rollbacks: int = 3
    # Global batches (0-based, in the order of the data) the run never trains on.
    skip_batches: list[int] = field(default_factory=list)
    # A save also every save_every_minutes, or every sqrt(2 x measured save stall x
    # expected_mtbf_minutes) (Young/Daly; moe_fold.training.cadence); None: steps only.
    save_every_minutes: Optional[float] = None
    # See save_every_minutes: the expected minutes between failures of the job.
    expected_mtbf_minutes: Optional[float] = None
    # Stopping early with a checkpoint of the step (moe_fold.training.stop): on one of
    # these signals, after exit_after_minutes of wall clock, after step exit_at_step.
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    # See exit_signals.
    exit_after_minutes: Optional[float] = None
    # See exit_signals.
    exit_at_step: Optional[int] = None
    # Hang detection (moe_fold.training.heartbeat): seconds a step may go without progress before
    # the rank is named, stacks are written and the job exits 75 to be restarted. None: 10 x the
    # longest recent step, at least 30 s; 0: off. Below parallel.timeout_s.
    hang_timeout_s: Optional[float] = None
    # Validation LM loss every eval_every steps and at the last one (0: never), over
    # eval_iters global batches of the validation data (data.valid_path/valid_fraction).
    eval_every: int = 0
    # See eval_every.
    eval_iters: int = 10
    # Write checkpoints in a background thread; the step only waits for a host copy
    # (kept allocated between saves: one copy of the rank's weights and optimizer state).
    async_save: bool = True

    # Route traces (docs/routes.md): every N steps, each MoE layer's route of every token
    # (experts, probabilities, dropped), keyed by sample and position, into
    # run_dir/routes/step_N/; 0: off.
    route_trace_every: int = 0
    # A sequence's routes and logits do not depend on the other sequences of its
    # micro-batch nor on the micro-batch size (docs/routes.md, "Batch invariance"): every
    # expert's rows are padded to a multiple of 16 for its GEMMs. CPU only, gemm_backend
    # torch or loop, no capacity dropping.
    batch_invariant: bool = False


@dataclass
class WandbConfig:
    """Logging to Weights & Biases (the same scalars as metrics.jsonl) and the expert-load heatmaps."""

    # offline (the default; needs no network, `wandb sync RUN_DIR/wandb/offline-run-*` uploads
    # it) | online (logs live) | disabled.
    mode: Literal["offline", "online", "disabled"] = "offline"
    # The wandb project.
    project: str = "moe-fold"
    # The wandb run name; null: wandb picks one.
    name: Optional[str] = None
    # Write an expert-load heatmap (MoE layers x experts) to RUN_DIR/heatmaps/ every N steps.
    heatmap_every: int = 50


@dataclass
class InitConfig:
    """Where the weights start: fresh (the default), a Hugging Face MoE checkpoint, or a dense one upcycled."""

    # Start from a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 (MTP layers
    # included), GLM-4.5-MoE or OLMoE folder (config.json + safetensors; moe_fold.models.to_hf
    # writes one back): the architecture and tokenizer.json (if there is one) come from the
    # folder, the layout, data and optimizer from the config.
    from_hf: Optional[str] = None
    # Start an MoE model from a dense Hugging Face Llama, Qwen2 or Qwen3 folder: experts
    # made from the dense MLP so that step 0 computes the dense model's function
    # (moe_fold.models.hf.upcycle): attention, norms and embeddings copied, every expert a copy
    # of the MLP; moe.num_experts, moe.topk and the layer pattern come from the config.
    upcycle_from: Optional[str] = None
    # G > 1 cuts the dense MLP's ffn into G slices, one an expert, with the router initialised by
    # groups of slices so that step 0 still computes the dense function.
    upcycle_granularity: int = 1


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    init: InitConfig = field(default_factory=InitConfig)


class ConfigError(ValueError):
    """One or more problems with a config; ``problems`` holds one line per problem."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        n = len(self.problems)
        head = f"invalid config: {n} problem{'s' if n != 1 else ''}"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fmt(value: Any) -> str:
    """A value as the user would write it in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, str) and (not value or value.strip() != value):
        return repr(value)
    return str(value)

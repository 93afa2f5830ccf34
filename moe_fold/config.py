"""Typed run configuration: one dataclass per section, loaded from YAML, overridden
from the command line, validated before any process group exists.

Sections: ``model``, ``moe``, ``parallel``, ``data``, ``optimizer``, ``train``,
``wandb``, ``init``. Field names are the keys of the YAML file and of ``--set``
(``--set moe.topk=4``).

``load_config(file_or_preset, overrides)`` builds a type-checked Config;
``validate(config, world_size)`` checks the rules between fields and raises one
``ConfigError`` listing every violation. A field with choices is typed ``Literal[...]``:
validate() reads the allowed values from the type (``choices("moe.dispatcher")`` gives them
to other modules). A rule that a module also applies at run time is a function of
``RULES``, which validate() and the module (through ``require``) both call. The reference
docs/configuration.md is generated from the dataclasses and their field comments
(``python -m moe_fold.config --reference``). Derived sizes (``dp_size``, ``edp_size``,
``etp_size``, ``vpp_size``, ``moe_layer_flags``, ``moe_layer_indices``, ``pp_layer_counts``) live here so every
module uses one definition.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import inspect
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import yaml

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
    # The layers with rotary embeddings: null every layer, or one 0/1 per layer (0: no rotary, NoPE).
    rope_layers: Optional[list[int]] = None
    # Temperature tuning on layers without rotary (Llama-4): a query at position p is multiplied by
    # 1 + attn_temperature_scale * log1p(floor((p + 1) / attn_temperature_floor)).
    attn_temperature_tuning: bool = False
    # Temperature tuning: the scale of the log term (Llama-4's attn_scale).
    attn_temperature_scale: float = 0.1
    # Temperature tuning: positions per step of the floor (Llama-4's floor_scale).
    attn_temperature_floor: int = 8192


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

    # gpt-oss's experts (models/experts.py): biases on every routed expert's fc1 (gate|up) and fc2.
    expert_linear_bias: bool = False
    # The routed experts' activation: swiglu | clamped_swiglu (gpt-oss: (clamp(up) + 1) *
    # g * sigmoid(swiglu_alpha * g), g = min(gate, swiglu_limit); kernels/swiglu.py).
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
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
    # into its config.yaml (and the printed config). gemm: a value other than auto wins,
    # else the environment variable MOE_FOLD_GEMM_BACKEND if set, else the rule.
    gemm_backend: Literal["auto", "grouped_gemm", "torch", "triton", "loop"] = "auto"
    # Kernel of the token permutation (see gemm_backend).
    permute_backend: Literal["auto", "torch", "triton"] = "auto"
    # Kernel of the experts' SwiGLU (see gemm_backend).
    swiglu_backend: Literal["auto", "torch", "triton", "cpu"] = "auto"
    # The router's top-k; triton fuses plain top-k only (not num_groups or expert_bias).
    topk_backend: Literal["auto", "torch", "triton"] = "auto"


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
    # (tests/test_train.py::test_overlaps_take_the_same_steps).
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
    # bit (tests/test_train.py::test_resume_is_exact).
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


# ---------------------------------------------------------------------------
# Loading: YAML file or preset, then --set overrides, each value type-checked.


def presets_dir() -> Path:
    """The folder of preset YAML files installed with ``moe_fold.models``."""
    # find_spec locates the package without running its __init__ (which imports torch).
    spec = importlib.util.find_spec("moe_fold.models")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("cannot locate the moe_fold.models package to read presets; is moe-fold installed?")
    return Path(next(iter(spec.submodule_search_locations))) / "presets"


def list_presets() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def resolve_source(source: str | os.PathLike) -> Path:
    """A YAML path as given, or the file of the preset named ``source``."""
    source = os.fspath(source)
    path = Path(source)
    if path.is_file():
        return path
    if path.suffix in (".yaml", ".yml") or os.sep in source or "/" in source:
        raise ConfigError(f"config file not found: {source}")
    preset = presets_dir() / f"{source}.yaml"
    if preset.is_file():
        return preset
    names = list_presets()
    close = difflib.get_close_matches(source, names, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    available = ", ".join(names) if names else "none"
    raise ConfigError(f"unknown preset '{source}'; {hint}available presets: {available} (in {presets_dir()})")


def load_config(source: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Build a Config from a YAML file or preset name (None: defaults), then apply
    ``section.field=value`` overrides in order. Types are checked here; cross-field
    rules are checked by ``validate``, which needs the world size."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of section.field=value strings, got the string {overrides!r}")
    data: dict = {}
    if source is not None:
        path = resolve_source(source)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot parse {path} as YAML: {e}") from e
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must map section names to sections, got {type(data).__name__}")
    config = config_from_dict(data)
    problems = [p for text in overrides for p in _apply_override(config, text)]
    if problems:
        raise ConfigError(problems)
    return config


def config_from_dict(data: dict) -> Config:
    """A Config from ``{section: {field: value}}``; missing keys keep their defaults."""
    problems: list[str] = []
    sections = {}
    for name, section in data.items():
        if name not in SECTIONS:
            problems.append(_unknown(f"{name}", list(SECTIONS), "section"))
        elif section is not None and not isinstance(section, dict):
            problems.append(f"section '{name}' must be a mapping of field: value, got {section!r}")
    for name, cls in SECTIONS.items():
        given = data.get(name) or {}
        if not isinstance(given, dict):
            continue
        hints = _field_types(cls)
        values = {}
        for key, value in given.items():
            dotted = f"{name}.{key}"
            if key not in hints:
                problems.append(_unknown(dotted, [f"{name}.{k}" for k in hints], "key"))
                continue
            converted = _coerce(value, hints[key])
            if converted is _MISMATCH:
                problems.append(_type_problem(dotted, value, hints[key]))
            else:
                values[key] = converted
        sections[name] = cls(**values)
    if problems:
        raise ConfigError(problems)
    return Config(**sections)


def _apply_override(config: Config, text: str) -> list[str]:
    key, sep, raw = text.partition("=")
    key = key.strip()
    section, dot, name = key.partition(".")
    if not sep or not dot or not section or not name:
        return [f"override '{text}' must look like section.field=value"]
    known = [f"{s}.{f}" for s, cls in SECTIONS.items() for f in _field_types(cls)]
    if key not in known:
        return [_unknown(key, known, "key")]
    tp = _field_types(SECTIONS[section])[name]
    try:
        parsed = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        return [f"cannot parse the value of override '{text}' as YAML: {e}"]
    value = _coerce(parsed, tp)
    # A string field given a bare 123 or true on the command line means that text.
    if value is _MISMATCH and isinstance(parsed, (bool, int, float)):
        value = _coerce(raw, tp)
    if value is _MISMATCH:
        return [_type_problem(key, parsed, tp)]
    setattr(getattr(config, section), name, value)
    return []


def _unknown(dotted: str, candidates: list[str], what: str) -> str:
    close = difflib.get_close_matches(dotted, candidates, n=1)
    if close:
        return f"unknown config {what} '{dotted}'; did you mean '{close[0]}'?"
    section = dotted.partition(".")[0]
    if what == "key" and section in SECTIONS:
        return f"unknown config key '{dotted}'; {section} has: {', '.join(_field_types(SECTIONS[section]))}"
    return f"unknown config {what} '{dotted}'; sections are: {', '.join(SECTIONS)}"


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_MISMATCH = object()


def _coerce(value: Any, tp: Any, parse_floats: bool = True) -> Any:
    """``value`` converted to the annotated type ``tp``, or ``_MISMATCH``.

    With ``parse_floats``, floats also accept strings because YAML 1.1 reads ``1e-3``
    (no dot) as a string. bool is never taken for int or float, nor int for bool."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        # Loading checks the type of a choice; validate() checks the value against the
        # choices (choice_problems), with the other rules.
        return _coerce(value, type(typing.get_args(tp)[0]), parse_floats)
    if origin is Union:
        for arm in typing.get_args(tp):
            out = _coerce(value, arm, parse_floats)
            if out is not _MISMATCH:
                return out
        return _MISMATCH
    if tp is type(None):
        return None if value is None else _MISMATCH
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return _MISMATCH
        (item,) = typing.get_args(tp)
        out = [_coerce(v, item, parse_floats) for v in value]
        return _MISMATCH if any(o is _MISMATCH for o in out) else out
    if isinstance(value, bool):
        return value if tp is bool else _MISMATCH
    if tp is int:
        return value if isinstance(value, int) else _MISMATCH
    if tp is float:
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str) and parse_floats:
            try:
                return float(value)
            except ValueError:
                return _MISMATCH
        return _MISMATCH
    if tp in (str, bool):
        return value if isinstance(value, tp) else _MISMATCH
    raise TypeError(f"config field type {tp} is not supported by the loader")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return type(typing.get_args(tp)[0]).__name__
    if typing.get_origin(tp) is Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    return "null" if tp is type(None) else tp.__name__


def _type_problem(dotted: str, value: Any, tp: Any) -> str:
    if value is None:
        return f"{dotted}=null is not allowed: expected {_type_name(tp)}"
    return f"{dotted}={value!r} has type {type(value).__name__}: expected {_type_name(tp)}"


# ---------------------------------------------------------------------------
# Writing.


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def dump_config(config: Config, path: str | os.PathLike) -> None:
    """Write the config as YAML that ``load_config(path)`` reads back to an equal Config."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


# ---------------------------------------------------------------------------
# Derived quantities: one definition each, used by every module.


def etp_size(config: Config) -> int:
    p = config.parallel
    return p.tp if p.etp is None else p.etp


def vpp_size(config: Config) -> int:
    return 1 if config.parallel.vpp is None else config.parallel.vpp


def pipeline_schedule(config: Config) -> str:
    """``parallel.pp_schedule`` resolved: ``auto`` is interleaved with vpp > 1 chunks, else 1f1b."""
    schedule = config.parallel.pp_schedule
    if schedule == "auto":
        return "interleaved" if vpp_size(config) > 1 else "1f1b"
    return schedule


def dp_size(config: Config, world_size: int) -> int:
    """Data-parallel size of the attention layout: world / (tp*cp*pp)."""
    p = config.parallel
    return _exact_div(world_size, p.tp * p.cp * p.pp, "world_size", "parallel.tp*cp*pp")


def edp_size(config: Config, world_size: int) -> int:
    """Expert data-parallel size of the expert layout: world / (etp*ep*pp)."""
    p = config.parallel
    return _exact_div(world_size, etp_size(config) * p.ep * p.pp, "world_size", "parallel.etp*ep*pp")


def head_dim(config: Config) -> int:
    """Per-head width of standard attention (MLA's widths are its own fields)."""
    m = config.model
    return m.hidden_size // m.num_heads if m.head_dim is None else m.head_dim


def rotary_dim(config: Config) -> int:
    """Width of the rotary part of a query/key head: its first ``partial_rotary_factor``
    (default: the whole head) under mha, ``qk_rope_head_dim`` under mla."""
    m = config.model
    return m.qk_rope_head_dim if m.attention == "mla" else int(head_dim(config) * m.partial_rotary_factor)


def mla_weight_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Global ``[out, in]`` shapes of an MLA layer's linears, by our parameter name under
    ``attn.`` (norms aside): what the model builds and the planner and dynamic-cp cost
    model count."""
    heads, qk = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    shapes = {}
    if m.q_lora_rank is None:
        shapes["q"] = (heads * qk, m.hidden_size)
    else:
        shapes["q_down"] = (m.q_lora_rank, m.hidden_size)
        shapes["q_up"] = (heads * qk, m.q_lora_rank)
    shapes["kv_down"] = (m.kv_lora_rank + m.qk_rope_head_dim, m.hidden_size)
    shapes["kv_up"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    shapes["proj"] = (m.hidden_size, heads * m.v_head_dim)
    return shapes


def group_ranked_scores(group_score: str, topk: int, group_topk: int) -> int:
    """How many of a group's best scores add up to its rank in group-limited routing
    (``moe.group_score``): topk/group_topk for topk_sum, 2 for top2_sum, 1 for max. Two
    rules with the same count route identically."""
    return {"topk_sum": topk // group_topk, "top2_sum": 2, "max": 1}[group_score]


MLA_SIZES = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def moe_layer_flags(config: Config) -> list[bool]:
    """One flag per layer, True where the layer's MLP is an MoE layer: every
    ``moe_layer_freq``-th layer from layer 0 (or the given 0/1 list), then the first
    ``first_k_dense`` layers forced dense."""
    m, moe = config.model, config.moe
    freq = moe.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers or any(f not in (0, 1) for f in freq):
            raise ConfigError(f"moe.moe_layer_freq={_fmt(freq)} must be {m.num_layers} flags of 0 or 1 "
                              f"(one per layer of model.num_layers={m.num_layers})")
        flags = [f == 1 for f in freq]
    else:
        if freq < 0:
            raise ConfigError(f"moe.moe_layer_freq={freq} must be >= 0")
        flags = [freq > 0 and i % freq == 0 for i in range(m.num_layers)]
    return [flag and i >= moe.first_k_dense for i, flag in enumerate(flags)]


def _layer_list(m: ModelConfig, name: str) -> list[bool]:
    """``model.<name>`` (null: every layer; else one 0/1 per layer) as one flag per layer."""
    flags = getattr(m, name)
    if flags is None:
        return [True] * m.num_layers
    if len(flags) != m.num_layers or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"model.{name}={_fmt(flags)} must be {m.num_layers} flags of 0 or 1 "
                          f"(one per layer of model.num_layers={m.num_layers})")
    return [f == 1 for f in flags]


def layer_attention(m: ModelConfig, layer: int) -> tuple[int, int, bool]:
    """``(sliding window, attention chunk, rotary?)`` of layer ``layer`` (0: none); MTP
    depths (``layer >= num_layers``) are of the last layer's kind, as their MLP."""
    layer = min(layer, m.num_layers - 1)
    local = _layer_list(m, "local_attention_layers")[layer]
    return (m.sliding_window if local else 0, m.attention_chunk if local else 0,
            _layer_list(m, "rope_layers")[layer])


def moe_layer_indices(config: Config) -> list[int]:
    """The MoE layers' indices, then the MTP depths' blocks as ``num_layers + k`` when they
    are MoE (they are of the last layer's kind): the rows of routing metrics and heatmaps."""
    flags = moe_layer_flags(config)
    mtp = config.model.mtp_num_layers if flags and flags[-1] else 0
    return [i for i, flag in enumerate(flags) if flag] + [len(flags) + k for k in range(mtp)]


def pp_layer_counts(config: Config) -> list[int]:
    """Layers in each of the pp*vpp model chunks, in chunk order."""
    p = config.parallel
    if p.pp_layers is not None:
        return list(p.pp_layers)
    chunks = p.pp * vpp_size(config)
    return [_exact_div(config.model.num_layers, chunks, "model.num_layers", "parallel.pp*vpp")] * chunks


def data_paths(config: Config) -> list[str]:
    """``data.path`` as a list (empty when None: the demo corpus)."""
    path = config.data.path
    return [] if path is None else [path] if isinstance(path, str) else list(path)


# The sizes a parallel.elastic_layouts entry may set.
ELASTIC_SIZES = ("tp", "cp", "pp", "ep", "etp")


def parse_elastic_layout(text: str) -> dict[str, int]:
    """One ``parallel.elastic_layouts`` entry, ``"ep=2"`` or ``"tp=1,ep=4"``, as ``{name: size}``;
    raises ValueError saying what is wrong."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or name not in ELASTIC_SIZES or name in sizes or not value.isdigit() or int(value) < 1:
            raise ValueError(f"{part.strip()!r} must be name=size with a name of {', '.join(ELASTIC_SIZES)} "
                             f"(each once) and a size >= 1")
        sizes[name] = int(value)
    return sizes


def _exact_div(a: int, b: int, a_name: str, b_name: str) -> int:
    if b < 1 or a % b:
        raise ConfigError(f"{a_name}={a} is not divisible by {b_name}={b}")
    return a // b


# ---------------------------------------------------------------------------
# Rules that modules apply too: each written once, here.
#
# validate() checks the whole config before any rank starts. A module built from its own
# arguments (a test, a bench, a tool) checks them with the same rule function, through
# require(), so both paths raise one message from one definition. RULES lists those
# functions; tests/test_rules.py checks that validate() applies every one and that no module
# checks a config field by itself.

RULES: dict[str, Callable[..., list[str]]] = {}


def rule(fn: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """Register ``fn`` (the rule's inputs -> one message per problem found) in RULES."""
    RULES[fn.__name__] = fn
    return fn


def require(check: Callable[..., list[str]], *args: Any) -> None:
    """Raise ConfigError with what the registered rule ``check`` finds wrong with ``args``."""
    if RULES.get(check.__name__) is not check:
        raise TypeError(f"{check.__name__} is not a rule of moe_fold.config.RULES")
    problems = check(*args)
    if problems:
        raise ConfigError(problems)


def _literal_choices(tp: Any) -> Optional[tuple]:
    """The values of a ``Literal[...]`` type, also inside ``Optional[...]``; None for other types."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) is Union:
        for arm in typing.get_args(tp):
            if typing.get_origin(arm) is Literal:
                return typing.get_args(arm)
    return None


def choices(dotted: str) -> tuple:
    """The values the ``Literal`` field ``section.field`` allows, read from its type."""
    section, _, name = dotted.partition(".")
    allowed = _literal_choices(_field_types(SECTIONS[section]).get(name))
    if allowed is None:
        raise TypeError(f"config field {dotted} is not a Literal choice")
    return allowed


@rule
def choice(dotted: str, value: Any) -> list[str]:
    """``value`` is one of the choices of the ``Literal`` field ``dotted`` (or None where the
    field is Optional)."""
    allowed = choices(dotted)
    section, _, name = dotted.partition(".")
    if value is None and _coerce(None, _field_types(SECTIONS[section])[name]) is None:
        return []
    if isinstance(value, str) and value in allowed:
        return []
    return [f"{dotted}={_fmt(value)} must be one of {', '.join(allowed)}"]


def _choice_problems(config: Config) -> list[str]:
    """Every ``Literal`` field checked against the choices its type lists."""
    return [problem for name, cls in SECTIONS.items() for key, tp in _field_types(cls).items()
            if _literal_choices(tp) is not None
            for problem in choice(f"{name}.{key}", getattr(getattr(config, name), key))]


# ---------------------------------------------------------------------------
# Validation of cross-field rules, before any process group exists.


def validate(config: Config, world_size: int) -> None:
    """Check every rule that relates fields to each other and to ``world_size``.

    Raises one ConfigError listing every violated rule. Rules about experts (counts,
    routing groups, expert widths, sequence parallel with tp) apply only when some
    layer is MoE; the dense MLP width is checked only when some layer is dense."""
    problems = _type_problems(config)
    if problems:
        # The rules below do arithmetic on the fields; wrong types would only add noise.
        raise ConfigError(problems)
    out = _choice_problems(config)
    parallel_ok = _check_parallel(config, world_size, out)
    flags = _check_layer_pattern(config, out)
    any_moe = flags is None or any(flags)
    any_dense = flags is None or not all(flags)
    _check_model(config, any_dense, out)
    _check_moe(config, any_moe, out)
    _check_pipeline(config, out)
    _check_train(config, world_size, parallel_ok, out)
    _check_optimizer(config, out)
    _check_data_wandb_and_init(config, out)
    if out:
        raise ConfigError(out)


def _type_problems(config: Config) -> list[str]:
    problems = []
    for name, cls in SECTIONS.items():
        section = getattr(config, name)
        if not isinstance(section, cls):
            problems.append(f"config.{name} must be a {cls.__name__}, got {type(section).__name__}")
            continue
        for key, tp in _field_types(cls).items():
            value = getattr(section, key)
            if _coerce(value, tp, parse_floats=False) is _MISMATCH:
                problems.append(_type_problem(f"{name}.{key}", value, tp))
    return problems


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


def _at_least(out: list[str], dotted: str, value: float, low: float) -> bool:
    if not value >= low:  # also catches nan
        out.append(f"{dotted}={_fmt(value)} must be >= {low}")
        return False
    return True


def _minimum(dotted: str, value: float, low: float) -> list[str]:
    """A one-field rule: its problem when ``value`` is below ``low`` (none when it is not)."""
    out: list[str] = []
    _at_least(out, dotted, value, low)
    return out


def _positive(out: list[str], dotted: str, value: float) -> bool:
    if not value > 0:
        out.append(f"{dotted}={_fmt(value)} must be > 0")
        return False
    return True


def _divisible(out: list[str], a_name: str, a: int, b_name: str, b: int, why: str = "") -> None:
    if b >= 1 and a % b:
        out.append(f"{a_name}={a} is not divisible by {b_name}={b}{why}")


def _check_parallel(config: Config, world_size: int, out: list[str]) -> bool:
    """Sizes and world divisibility; returns whether dp and edp are well defined."""
    p = config.parallel
    ok = _at_least(out, "world_size", world_size, 1)
    for name in ("tp", "cp", "pp", "ep"):
        ok &= _at_least(out, f"parallel.{name}", getattr(p, name), 1)
    for name in ("etp", "vpp"):
        if getattr(p, name) is not None:
            ok &= _at_least(out, f"parallel.{name}", getattr(p, name), 1)
    if ok:
        layout_problems = world_fits_layouts(world_size, p.tp, p.cp, p.pp, p.ep, p.etp)
        out.extend(layout_problems)
        ok = not layout_problems
    out.extend(order_is_permutation(p.order))
    if p.dynamic_cp:
        out.extend(dynamic_cp_layout(p.cp, p.tp, p.pp))
        _at_least(out, "parallel.dynamic_cp_flops_per_byte", p.dynamic_cp_flops_per_byte, 0)
    _positive(out, "parallel.timeout_s", p.timeout_s)
    out.extend(bucket_size(p.grad_bucket_numel))
    if p.overlap_grad_reduce and config.moe.replicas > 0:
        out.append(f"parallel.overlap_grad_reduce=true cannot run with moe.replicas={config.moe.replicas} yet: the "
                   f"copies of an expert sum their grads over ep after the whole backward, before the "
                   f"data-parallel reduction")
    if p.elastic_layouts is not None:
        if not p.elastic:
            out.append(f"parallel.elastic_layouts={_fmt(p.elastic_layouts)} needs parallel.elastic=true "
                       f"(the layouts are tried on a restart onto another world size only then)")
        for i, entry in enumerate(p.elastic_layouts):
            try:
                parse_elastic_layout(entry)
            except ValueError as e:
                out.append(f"parallel.elastic_layouts[{i}]={_fmt(entry)}: {e}")
    out.extend(param_gather_needs_distributed(p.overlap_param_gather, config.optimizer.distributed))
    return ok


@rule
def world_fits_layouts(world_size: int, tp: int, cp: int, pp: int, ep: int, etp: Optional[int]) -> list[str]:
    """The world is whole attention layouts (tp*cp*pp) and whole expert layouts (etp*ep*pp;
    etp null: tp). Sizes below 1 are reported by the size checks, not here."""
    if min(world_size, tp, cp, pp, ep, tp if etp is None else etp) < 1:
        return []
    out = []
    if world_size % (tp * cp * pp):
        out.append(f"world_size={world_size} is not divisible by parallel.tp*cp*pp={tp * cp * pp} "
                   f"(tp={tp}, cp={cp}, pp={pp})")
    expert_tp = tp if etp is None else etp
    if world_size % (expert_tp * ep * pp):
        etp_text = f"etp={etp}" if etp is not None else f"etp=null -> tp={tp}"
        out.append(f"world_size={world_size} is not divisible by parallel.etp*ep*pp={expert_tp * ep * pp} "
                   f"({etp_text}, ep={ep}, pp={pp})")
    return out


@rule
def order_is_permutation(order: str) -> list[str]:
    """parallel.order names every dimension once (the layout itself also takes an order that
    leaves out dimensions of size 1: moe_fold/layout.py, for tools that build one directly)."""
    if not isinstance(order, str) or sorted(order.split("-")) != sorted(["tp", "cp", "ep", "dp", "pp"]):
        return [f"parallel.order={_fmt(order)} must be a permutation of tp, cp, ep, dp, pp joined by '-'"]
    return []


@rule
def bucket_size(grad_bucket_numel: int) -> list[str]:
    """A gradient bucket holds at least one element."""
    return _minimum("parallel.grad_bucket_numel", grad_bucket_numel, 1)


@rule
def param_gather_needs_distributed(overlap_param_gather: bool, distributed: bool) -> list[str]:
    """Only the distributed optimizer all-gathers parameters after its step."""
    if overlap_param_gather and not distributed:
        return ["parallel.overlap_param_gather=true needs optimizer.distributed=true (only the distributed "
                "optimizer all-gathers parameters after its step)"]
    return []


# Dynamic cp searches every partition of the cp group into sub-groups; partitions of 2^k
# ranks number 1, 2, 5, 26, 677, 458330 for k = 0..5: search all up to 16.
MAX_DYNAMIC_CP = 16


@rule
def dynamic_cp_layout(cp: int, tp: int, pp: int) -> list[str]:
    """Dynamic cp splits the cp group into power-of-two sub-groups, and its ranks hold unequal
    token counts, which tp shards and pipeline stages cannot take."""
    out = []
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or cp & (cp - 1) or cp > MAX_DYNAMIC_CP:
        out.append(f"parallel.dynamic_cp=true needs parallel.cp a power of two up to {MAX_DYNAMIC_CP}, "
                   f"got cp={cp}")
    for name, size in (("tp", tp), ("pp", pp)):
        if size != 1:
            out.append(f"parallel.dynamic_cp=true needs parallel.{name}=1, got {size} (ranks "
                       f"hold unequal token counts under dynamic cp)")
    return out


@rule
def upcycle_slices(granularity: int) -> list[str]:
    """Upcycling cuts the dense MLP into granularity expert slices."""
    return _minimum("init.upcycle_granularity", granularity, 1)


def _check_layer_pattern(config: Config, out: list[str]) -> list[bool] | None:
    """Checks moe_layer_freq and first_k_dense; returns the MoE flags when defined."""
    m, moe = config.model, config.moe
    ok = True
    freq = moe.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers:
            out.append(f"moe.moe_layer_freq has {len(freq)} entries, expected one per layer "
                       f"(model.num_layers={m.num_layers})")
            ok = False
        for i, f in enumerate(freq):
            if f not in (0, 1):
                out.append(f"moe.moe_layer_freq[{i}]={f} must be 0 or 1")
                ok = False
    else:
        ok = _at_least(out, "moe.moe_layer_freq", freq, 0)
    if not 0 <= moe.first_k_dense <= m.num_layers:
        out.append(f"moe.first_k_dense={moe.first_k_dense} must be in [0, model.num_layers={m.num_layers}]")
    return moe_layer_flags(config) if ok else None


def _check_model(config: Config, any_dense: bool, out: list[str]) -> None:
    m, p = config.model, config.parallel
    sizes_ok = True
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "seq_length"):
        sizes_ok &= _at_least(out, f"model.{name}", getattr(m, name), 1)
    if m.head_dim is not None:
        _at_least(out, "model.head_dim", m.head_dim, 1)
    if any_dense:
        _at_least(out, "model.ffn_hidden_size", m.ffn_hidden_size, 1)
    for name in ("rope_theta", "norm_eps", "init_std"):
        _positive(out, f"model.{name}", getattr(m, name))
    _check_mtp(config, out)
    _check_attention_features(config, out)
    if not 0 < m.partial_rotary_factor <= 1:
        out.append(f"model.partial_rotary_factor={_fmt(m.partial_rotary_factor)} must be in (0, 1]")
    elif m.partial_rotary_factor != 1 and m.attention == "mla":
        out.append(f"model.partial_rotary_factor={_fmt(m.partial_rotary_factor)} must be 1 when model.attention=mla "
                   f"(MLA's rotary part is model.qk_rope_head_dim)")
    elif (m.partial_rotary_factor != 1 and m.attention != "mla" and m.num_heads >= 1
          and (m.head_dim is not None or m.hidden_size % m.num_heads == 0)):
        width = head_dim(config) * m.partial_rotary_factor
        if width != int(width) or int(width) % 2 or int(width) < 2:
            out.append(f"model.partial_rotary_factor={_fmt(m.partial_rotary_factor)} of head_dim={head_dim(config)} "
                       f"gives {width:g} rotary dims: it must be a positive even integer")
    if not sizes_ok:
        return
    if m.num_heads % m.num_kv_heads:
        out.append(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}")
    if m.attention != "mla" and m.head_dim is None and m.hidden_size % m.num_heads:
        out.append(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads} "
                   f"(required when model.head_dim is null)")
    elif m.attention != "mla":
        out.extend(rotary_pairs(head_dim(config), "model.head_dim" if m.head_dim is not None
                                else "model.hidden_size/num_heads"))
    _check_attention(m, out)
    if p.tp < 1 or p.cp < 1:
        return
    out.extend(heads_over_tp(m.num_heads, m.num_kv_heads, p.tp))
    out.extend(vocab_over_tp(m.vocab_size, p.tp))
    if any_dense:
        out.extend(dense_width_over_tp(m.ffn_hidden_size, p.tp))
    out.extend(sequence_over_tp(m.seq_length, p.tp, p.cp, p.sequence_parallel))
    out.extend(sequence_over_cp(m.seq_length, p.cp))
    if p.cp > 1:
        if p.cp_kind == "a2a":
            # Kv heads need only divide by tp: a2a repeats each tp rank's kv heads up to a
            # multiple of cp (context_parallel.a2a_kv_repeats), which divides the query heads.
            why = " (parallel.cp_kind=a2a splits each tp rank's heads over cp)"
            _divisible(out, "model.num_heads", m.num_heads, "parallel.tp*cp", p.tp * p.cp, why)


@rule
def heads_over_tp(num_heads: int, num_kv_heads: int, tp: int) -> list[str]:
    """Each tp rank holds num_heads/tp query and num_kv_heads/tp key/value heads."""
    out: list[str] = []
    _divisible(out, "model.num_heads", num_heads, "parallel.tp", tp)
    _divisible(out, "model.num_kv_heads", num_kv_heads, "parallel.tp", tp)
    return out


@rule
def rotary_pairs(width: int, dotted: str = "model.head_dim") -> list[str]:
    """Rotary embeddings rotate pairs of dimensions: the rotated width is even."""
    if width % 2:
        return [f"{dotted}={width} must be even (rotary embeddings rotate pairs of dimensions)"]
    return []


@rule
def vocab_over_tp(vocab_size: int, tp: int) -> list[str]:
    """Each tp rank holds vocab_size/tp rows of the embedding and the output layer."""
    out: list[str] = []
    _divisible(out, "model.vocab_size", vocab_size, "parallel.tp", tp)
    return out


@rule
def dense_width_over_tp(ffn_hidden_size: int, tp: int) -> list[str]:
    """Each tp rank holds ffn_hidden_size/tp columns of a dense MLP."""
    out: list[str] = []
    _divisible(out, "model.ffn_hidden_size", ffn_hidden_size, "parallel.tp", tp)
    return out


@rule
def sequence_over_tp(seq_length: int, tp: int, cp: int, sequence_parallel: bool) -> list[str]:
    """Sequence parallelism splits each cp shard of the sequence over tp."""
    out: list[str] = []
    if sequence_parallel and tp > 1:
        _divisible(out, "model.seq_length", seq_length, "parallel.tp*cp", tp * cp,
                   " (parallel.sequence_parallel=true splits each cp shard of the sequence over tp)")
    return out


@rule
def sequence_over_cp(seq_length: int, cp: int) -> list[str]:
    """Context parallelism cuts the sequence into 2*cp chunks (the zigzag layout)."""
    out: list[str] = []
    if cp > 1:
        _divisible(out, "model.seq_length", seq_length, "2*parallel.cp", 2 * cp,
                   " (context parallel splits the sequence into 2*cp chunks)")
    return out


def _check_mtp(config: Config, out: list[str]) -> None:
    m, p = config.model, config.parallel
    if not _at_least(out, "model.mtp_num_layers", m.mtp_num_layers, 0):
        return
    _at_least(out, "model.mtp_loss_weight", m.mtp_loss_weight, 0)
    if m.mtp_num_layers == 0:
        return
    if m.seq_length >= 1 and m.mtp_num_layers >= m.seq_length:
        out.append(f"model.mtp_num_layers={m.mtp_num_layers} must be < model.seq_length={m.seq_length} "
                   f"(depth k predicts token t+1+k inside the sequence)")
    if p.dynamic_cp:
        out.append(f"model.mtp_num_layers={m.mtp_num_layers} is not supported with parallel.dynamic_cp=true "
                   f"(the MTP targets are shifted along the layout's cp shards)")


def _check_attention_features(config: Config, out: list[str]) -> None:
    """Sinks, sliding window, chunked attention, NoPE layers, temperature tuning."""
    m = config.model
    window_ok = _at_least(out, "model.sliding_window", m.sliding_window, 0)
    chunk_ok = _at_least(out, "model.attention_chunk", m.attention_chunk, 0)
    if window_ok and chunk_ok and m.sliding_window and m.attention_chunk:
        out.append(f"model.sliding_window={m.sliding_window} and model.attention_chunk={m.attention_chunk}: "
                   f"set at most one (a local layer has one kind of mask)")
    for name in ("local_attention_layers", "rope_layers"):
        flags = getattr(m, name)
        if flags is not None and m.num_layers >= 1 and (
                len(flags) != m.num_layers or any(f not in (0, 1) for f in flags)):
            out.append(f"model.{name}={_fmt(flags)} must be {m.num_layers} flags of 0 or 1 "
                       f"(one per layer of model.num_layers={m.num_layers})")
    if m.local_attention_layers is not None and not (m.sliding_window or m.attention_chunk):
        out.append(f"model.local_attention_layers={_fmt(m.local_attention_layers)} is set but "
                   f"model.sliding_window and model.attention_chunk are 0 (no local attention)")
    _positive(out, "model.attn_temperature_scale", m.attn_temperature_scale)
    _at_least(out, "model.attn_temperature_floor", m.attn_temperature_floor, 1)
    if m.attn_temperature_tuning and m.mtp_num_layers > 0:
        out.append(f"model.attn_temperature_tuning=true is not supported with model.mtp_num_layers="
                   f"{m.mtp_num_layers} (the MTP depths' attention gets no token positions)")
    if m.qk_norm and m.qk_norm_scope == "l2" and m.rope_layers is not None and not any(m.rope_layers):
        out.append("model.qk_norm_scope=l2 normalises rotary layers only, but model.rope_layers has none")
    if m.attention == "mla":
        for name, off in (("attention_sinks", False), ("sliding_window", 0), ("attention_chunk", 0),
                          ("rope_layers", None), ("attn_temperature_tuning", False)):
            if getattr(m, name) != off:
                out.append(f"model.{name}={_fmt(getattr(m, name))} requires model.attention=mha "
                           f"(MLA's attention does not take it)")


def _check_attention(m: ModelConfig, out: list[str]) -> None:
    """The attention kind, MLA's sizes and the rotary scaling."""
    if m.attention == "mla":
        for name in MLA_SIZES:
            value = getattr(m, name)
            if value is None:
                out.append(f"model.{name}=null must be set when model.attention=mla")
            else:
                _at_least(out, f"model.{name}", value, 1)
        if m.q_lora_rank is not None:
            _at_least(out, "model.q_lora_rank", m.q_lora_rank, 1)
        if m.qk_rope_head_dim is not None and m.qk_rope_head_dim % 2:
            out.append(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even (rotary pairs)")
        if m.num_kv_heads != m.num_heads:
            out.append(f"model.num_kv_heads={m.num_kv_heads} must equal model.num_heads={m.num_heads} when "
                       f"model.attention=mla (every head has its own key and value)")
        if m.qk_norm or m.qkv_bias:
            out.append("model.qk_norm and model.qkv_bias must be false when model.attention=mla")
        if m.attention_out_bias:
            out.append("model.attention_out_bias=true requires model.attention=mha (MLA's output projection has "
                       "no bias)")
        if m.head_dim is not None:
            out.append(f"model.head_dim={m.head_dim} must be null when model.attention=mla (MLA's head widths are "
                       f"model.qk_nope_head_dim, model.qk_rope_head_dim and model.v_head_dim)")
    elif m.attention == "mha":
        for name in ("q_lora_rank",) + MLA_SIZES:
            if getattr(m, name) is not None:
                out.append(f"model.{name}={getattr(m, name)} is an MLA size: set model.attention=mla or leave "
                           f"it null")
    if m.rope_scaling is None:
        for name in ("yarn_factor", "yarn_original_max_position_embeddings", "yarn_mscale", "yarn_mscale_all_dim"):
            if getattr(m, name) is not None:
                out.append(f"model.{name}={_fmt(getattr(m, name))} is set but model.rope_scaling is null")
        return
    if m.rope_scaling != "yarn":
        return
    if m.yarn_factor is None:
        out.append("model.yarn_factor=null must be set when model.rope_scaling=yarn")
    elif not m.yarn_factor >= 1:
        out.append(f"model.yarn_factor={_fmt(m.yarn_factor)} must be >= 1")
    if m.yarn_original_max_position_embeddings is None:
        out.append("model.yarn_original_max_position_embeddings=null must be set when model.rope_scaling=yarn")
    else:
        _at_least(out, "model.yarn_original_max_position_embeddings", m.yarn_original_max_position_embeddings, 1)
    _positive(out, "model.yarn_beta_fast", m.yarn_beta_fast)
    _positive(out, "model.yarn_beta_slow", m.yarn_beta_slow)
    if not m.yarn_beta_fast >= m.yarn_beta_slow:
        out.append(f"model.yarn_beta_fast={_fmt(m.yarn_beta_fast)} must be >= "
                   f"model.yarn_beta_slow={_fmt(m.yarn_beta_slow)}")
    for name in ("yarn_mscale", "yarn_mscale_all_dim"):
        if getattr(m, name) is not None:
            _at_least(out, f"model.{name}", getattr(m, name), 0)


def _check_moe(config: Config, any_moe: bool, out: list[str]) -> None:
    moe, p = config.moe, config.parallel
    out.extend(router_settings(moe))
    out.extend(dispatch_modes(moe.dispatcher, moe.capacity_factor, moe.pad_to_capacity, moe.dedup))
    out.extend(gate_needs_shared_expert(moe.shared_expert_gate, moe.shared_expert_ffn_hidden_size))
    if moe.activation == "clamped_swiglu":
        _positive(out, "moe.swiglu_alpha", moe.swiglu_alpha)
        _positive(out, "moe.swiglu_limit", moe.swiglu_limit)
    out.extend(activation_backend(moe.activation, moe.swiglu_backend))
    _at_least(out, "moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size, 0)
    out.extend(overlap_problems(moe))
    _check_placement(config, out)
    if not any_moe:
        return
    out.extend(moe_needs_sequence_parallel(p.tp, p.sequence_parallel))
    if _at_least(out, "moe.ffn_hidden_size", moe.ffn_hidden_size, 1) and p.tp >= 1:
        out.extend(expert_width_over_etp(moe.ffn_hidden_size, etp_size(config), p.etp is None))
    if moe.shared_expert_ffn_hidden_size > 0:
        _divisible(out, "moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size,
                   "parallel.tp", p.tp)
    out.extend(expert_bias_over_etp(moe.expert_linear_bias, config.model.hidden_size, etp_size(config),
                                    p.etp is None))
    if moe.num_experts < 1:
        out.append(f"moe.num_experts={moe.num_experts} must be >= 1 when any layer is MoE "
                   f"(moe.moe_layer_freq={_fmt(moe.moe_layer_freq)}, moe.first_k_dense={moe.first_k_dense})")
        return
    out.extend(experts_over_ep(moe.num_experts, p.ep))
    out.extend(routing_groups(moe.num_experts, moe.topk, moe.num_groups, moe.group_topk, moe.group_score))


@rule
def router_settings(moe: MoEConfig) -> list[str]:
    """The router's settings that need no expert count: score function pairs, the fused
    top-k's limits, scales and loss coefficients, the capacity factor."""
    out = []
    if moe.topk_backend == "triton" and (moe.num_groups is not None or moe.expert_bias):
        out.append(f"moe.topk_backend=triton fuses plain top-k only; moe.num_groups={_fmt(moe.num_groups)} and "
                   f"moe.expert_bias={_fmt(moe.expert_bias)} need moe.topk_backend=torch (or auto)")
    if moe.expert_bias and not (moe.score_function == "sigmoid" or moe.pre_softmax):
        out.append(f"moe.expert_bias=true requires moe.score_function=sigmoid, got {_fmt(moe.score_function)} (or "
                   f"moe.pre_softmax=true: the bias is added to the softmax over all experts, as in ERNIE-4.5)")
    # ERNIE-4.5's moe_norm_min: renormalising the top-k of the softmax over all experts.
    if moe.topk_norm_min is not None:
        if not moe.pre_softmax:
            out.append(f"moe.topk_norm_min={_fmt(moe.topk_norm_min)} requires moe.pre_softmax=true (it renormalises "
                       f"the top-k of the softmax over all experts)")
        if not (moe.topk_norm_min > 0 and math.isfinite(moe.topk_norm_min)):
            out.append(f"moe.topk_norm_min={_fmt(moe.topk_norm_min)} must be a finite number > 0 when set")
        if moe.topk_backend == "triton":
            out.append(f"moe.topk_backend=triton fuses plain top-k only; moe.topk_norm_min="
                       f"{_fmt(moe.topk_norm_min)} needs moe.topk_backend=torch (or auto)")
    if moe.pre_softmax and moe.score_function != "softmax":
        out.append(f"moe.pre_softmax=true requires moe.score_function=softmax, got {_fmt(moe.score_function)}")
    if moe.scaling_factor is not None and not moe.scaling_factor > 0:
        out.append(f"moe.scaling_factor={_fmt(moe.scaling_factor)} must be > 0 when set")
    for name in ("input_jitter", "bias_update_rate", "aux_loss_coeff", "seq_aux_loss_coeff",
                 "global_aux_loss_coeff", "z_loss_coeff"):
        if _at_least(out, f"moe.{name}", getattr(moe, name), 0) and not math.isfinite(getattr(moe, name)):
            out.append(f"moe.{name}={_fmt(getattr(moe, name))} must be finite")
    out.extend(capacity_factor_positive(moe.capacity_factor))
    return out


@rule
def capacity_factor_positive(capacity_factor: Optional[float]) -> list[str]:
    """An expert's capacity is ceil(tokens * topk / num_experts * capacity_factor)."""
    if capacity_factor is not None and not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        return [f"moe.capacity_factor={_fmt(capacity_factor)} must be > 0, or null for dropless"]
    return []


@rule
def dispatch_modes(dispatcher: str, capacity_factor: Optional[float], pad_to_capacity: bool,
                   dedup: bool) -> list[str]:
    """Which dispatcher runs padding to capacity and the rank-deduplicated exchange."""
    out = []
    if pad_to_capacity and capacity_factor is None:
        out.append("moe.pad_to_capacity=true requires moe.capacity_factor to be set, got null")
    if dedup and dispatcher != "alltoall":
        out.append(f"moe.dedup=true requires moe.dispatcher=alltoall, got {_fmt(dispatcher)}")
    if pad_to_capacity and dispatcher != "alltoall":
        out.append(f"moe.pad_to_capacity=true requires moe.dispatcher=alltoall, got {_fmt(dispatcher)}")
    if dedup and pad_to_capacity:
        out.append("moe.dedup=true cannot run with moe.pad_to_capacity=true: the padded exchange sends a fixed "
                   "capacity of rows per expert, the deduplicated one a data-dependent number per rank")
    return out


@rule
def gate_needs_shared_expert(gate: bool, shared_expert_ffn_hidden_size: int) -> list[str]:
    """The shared expert's gate scales a shared expert's output."""
    if gate and not shared_expert_ffn_hidden_size > 0:
        return [f"moe.shared_expert_gate=true requires a shared expert (moe.shared_expert_ffn_hidden_size > 0), "
                f"got {_fmt(shared_expert_ffn_hidden_size)}"]
    return []


@rule
def moe_needs_sequence_parallel(tp: int, sequence_parallel: bool) -> list[str]:
    """Under tp an MoE layer routes each token once: every token lives on one rank of the tp group."""
    if tp > 1 and not sequence_parallel:
        return [f"parallel.tp={tp} with MoE layers requires parallel.sequence_parallel=true"]
    return []


@rule
def expert_width_over_etp(ffn_hidden_size: int, etp: int, etp_is_tp: bool = False) -> list[str]:
    """An expert's ffn dim is split over etp (``etp_is_tp``: parallel.etp is null, so over tp)."""
    if etp < 1 or not ffn_hidden_size % etp:
        return []
    if etp_is_tp:
        return [f"moe.ffn_hidden_size={ffn_hidden_size} is not divisible by parallel.tp={etp} "
                f"(parallel.etp is null, so experts are split over tp)"]
    return [f"moe.ffn_hidden_size={ffn_hidden_size} is not divisible by parallel.etp={etp}"]


@rule
def activation_backend(activation: str, swiglu_backend: str) -> list[str]:
    """gpt-oss's clamped SwiGLU runs on torch ops only (kernels/swiglu.py)."""
    if activation == "clamped_swiglu" and swiglu_backend not in ("auto", "torch"):
        return [f"moe.swiglu_backend={_fmt(swiglu_backend)} with moe.activation=clamped_swiglu: the clamped SwiGLU "
                f"runs on torch ops only; set moe.swiglu_backend=torch (or auto)"]
    return []


@rule
def expert_bias_over_etp(linear_bias: bool, hidden_size: int, etp: int, etp_is_tp: bool = False) -> list[str]:
    """Each etp rank adds its 1/etp slice of fc2's bias, so the etp sum adds it once."""
    if not linear_bias or etp <= 1 or not hidden_size % etp:
        return []
    return [f"model.hidden_size={hidden_size} is not divisible by {'parallel.tp' if etp_is_tp else 'parallel.etp'}="
            f"{etp} (moe.expert_linear_bias=true splits fc2's bias over the expert-tensor ranks)"]


@rule
def experts_over_ep(num_experts: int, ep: int) -> list[str]:
    """Every ep rank holds num_experts/ep experts (dispatchers, experts, placements, statistics)."""
    if ep >= 1 and num_experts % ep:
        return [f"moe.num_experts={num_experts} is not divisible by parallel.ep={ep}"]
    return []


@rule
def routing_groups(num_experts: int, topk: int, num_groups: Optional[int], group_topk: Optional[int],
                   group_score: str) -> list[str]:
    """A token's topk experts exist; group-limited routing picks group_topk of num_groups
    groups, then topk experts inside them (ranking a group by moe.group_score)."""
    out = []
    if not 1 <= topk <= num_experts:
        out.append(f"moe.topk={topk} must be in [1, moe.num_experts={num_experts}]")
    groups = num_groups
    if (groups is None) != (group_topk is None):
        out.append(f"moe.num_groups={_fmt(groups)} and moe.group_topk={_fmt(group_topk)} "
                   f"must be both set or both null")
        return out
    if groups is None:
        return out
    ok = _at_least(out, "moe.num_groups", groups, 1)
    ok &= _at_least(out, "moe.group_topk", group_topk, 1)
    if not ok:
        return out
    if num_experts % groups:
        out.append(f"moe.num_experts={num_experts} is not divisible by moe.num_groups={groups}")
        return out
    if group_topk > groups:
        out.append(f"moe.group_topk={group_topk} must be <= moe.num_groups={groups}")
        return out
    if group_score == "topk_sum":
        # Groups are ranked by the sum of their best topk/group_topk scores.
        _divisible(out, "moe.topk", topk, "moe.group_topk", group_topk,
                   " (each selected group is scored by its best topk/group_topk experts)")
    elif group_score == "top2_sum" and num_experts // groups < 2:
        out.append(f"moe.group_score=top2_sum needs >= 2 experts per group, got moe.num_experts/moe.num_groups="
                   f"{num_experts // groups}")
    reachable = group_topk * (num_experts // groups)
    if topk > reachable:
        out.append(f"moe.topk={topk} exceeds the {reachable} experts in the selected groups "
                   f"(moe.group_topk={group_topk} * moe.num_experts/moe.num_groups="
                   f"{num_experts // groups})")
    return out


@rule
def overlap_problems(moe: MoEConfig) -> list[str]:
    """What is wrong with ``moe.shared_expert_overlap`` / ``moe.overlap_chunks``."""
    problems = []
    if moe.shared_expert_overlap and moe.shared_expert_ffn_hidden_size <= 0:
        problems.append(f"moe.shared_expert_overlap=true needs a shared expert "
                        f"(moe.shared_expert_ffn_hidden_size > 0, got {moe.shared_expert_ffn_hidden_size})")
    if not moe.overlap_chunks >= 1:
        problems.append(f"moe.overlap_chunks={_fmt(moe.overlap_chunks)} must be >= 1")
    elif moe.overlap_chunks > 1 and moe.pad_to_capacity:
        problems.append(f"moe.overlap_chunks={moe.overlap_chunks} requires moe.pad_to_capacity=false: one chunk "
                        f"may hold all of an expert's tokens, so every chunk would be padded to the layer's "
                        f"whole capacity, multiplying the bytes sent by the number of chunks")
    return problems


def _check_placement(config: Config, out: list[str]) -> None:
    moe, ep = config.moe, config.parallel.ep
    replicas_ok = _at_least(out, "moe.replicas", moe.replicas, 0)
    every_ok = _at_least(out, "moe.replace_every", moe.replace_every, 0)
    if ep < 1 or moe.num_experts < 1:
        return
    if replicas_ok:
        out.extend(replicas_fit(moe.num_experts, ep, moe.replicas))
    if every_ok:
        out.extend(replacement_has_room(moe.replace_every, ep))


@rule
def replicas_fit(num_experts: int, ep: int, replicas: int) -> list[str]:
    """A rank's replicas spare slots hold copies of other ranks' experts, at most one copy of
    an expert on a rank."""
    if replicas <= 0:
        return []
    if ep == 1:
        return [f"moe.replicas={replicas} needs parallel.ep > 1, got 1 (a copy of an expert lives "
                f"on another ep rank)"]
    if not experts_over_ep(num_experts, ep) and replicas > num_experts - num_experts // ep:
        return [f"moe.replicas={replicas} must be <= moe.num_experts - moe.num_experts/parallel.ep="
                f"{num_experts - num_experts // ep} (a rank holds at most one copy of an expert)"]
    return []


@rule
def replacement_has_room(replace_every: int, ep: int) -> list[str]:
    """Re-placing experts moves them between ep ranks."""
    if replace_every > 0 and ep == 1:
        return [f"moe.replace_every={replace_every} needs parallel.ep > 1, got 1 (with one ep rank "
                f"there is nowhere to move an expert)"]
    return []


def _check_pipeline(config: Config, out: list[str]) -> None:
    p, m = config.parallel, config.model
    if p.pp < 1 or (p.vpp is not None and p.vpp < 1) or m.num_layers < 1:
        return
    out.extend(pipeline_split(m.num_layers, p.pp, vpp_size(config), p.pp_layers))
    if vpp_size(config) > 1 and p.pp == 1:
        # Only a run's config: the schedules themselves run vpp chunks on one rank (their tests do).
        out.append(f"parallel.vpp={vpp_size(config)} requires parallel.pp > 1, got 1")
    out.extend(schedule_chunks(p.pp_schedule, p.vpp))


@rule
def pipeline_split(num_layers: int, pp: int, vpp: int, pp_layers: Optional[list[int]]) -> list[str]:
    """The layers split over the pp*vpp model chunks: evenly, or as parallel.pp_layers says."""
    chunks = pp * vpp
    out = []
    if pp_layers is None:
        if num_layers % chunks:
            out.append(f"model.num_layers={num_layers} is not divisible by parallel.pp*vpp={chunks} "
                       f"(set parallel.pp_layers to split the layers unevenly)")
        return out
    if len(pp_layers) != chunks:
        out.append(f"parallel.pp_layers has {len(pp_layers)} entries, expected one per model chunk "
                   f"(parallel.pp*vpp={chunks})")
    for i, n in enumerate(pp_layers):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            out.append(f"parallel.pp_layers[{i}]={_fmt(n)} must be >= 1")
    # (A direct caller may pass what is not a number: then there is no sum to compare.)
    if all(isinstance(n, int) for n in pp_layers) and sum(pp_layers) != num_layers:
        out.append(f"parallel.pp_layers={_fmt(list(pp_layers))} sums to {sum(pp_layers)}, "
                   f"expected model.num_layers={num_layers}")
    return out


@rule
def schedule_chunks(schedule: str, vpp: Optional[int]) -> list[str]:
    """Several model chunks per rank (vpp > 1) need the interleaved schedule, and it needs them;
    ``schedule`` is parallel.pp_schedule (auto allowed), ``vpp`` parallel.vpp (null: 1)."""
    chunks = 1 if vpp is None else vpp
    out = []
    if chunks > 1 and schedule == "1f1b":
        out.append(f"parallel.vpp={chunks} requires parallel.pp_schedule=interleaved (or auto), got 1f1b")
    if schedule == "interleaved" and chunks == 1:
        out.append(f"parallel.pp_schedule=interleaved requires parallel.vpp > 1, got {_fmt(vpp)}")
    return out


@rule
def interleaved_micro_batches(micro_batches: int, pp: int, how: str = "") -> list[str]:
    """The interleaved schedule sends the micro-batches round the pipeline in groups of pp;
    ``how`` says where the count comes from (the batch sizes), for the message."""
    if micro_batches % pp:
        return [f"train.global_batch_size/(micro_batch_size*dp)={micro_batches} micro-batches is not divisible by "
                f"parallel.pp={pp} (the interleaved schedule sends the micro-batches round the pipeline in groups "
                f"of pp{how})"]
    return []


def _check_train(config: Config, world_size: int, parallel_ok: bool, out: list[str]) -> None:
    t, p = config.train, config.parallel
    _at_least(out, "train.steps", t.steps, 1)
    _at_least(out, "train.save_every", t.save_every, 1)
    out.extend(checkpoints_kept(t.keep_last))
    _at_least(out, "train.log_every", t.log_every, 1)
    batch_ok = _at_least(out, "train.micro_batch_size", t.micro_batch_size, 1)
    batch_ok &= _at_least(out, "train.global_batch_size", t.global_batch_size, 1)
    if batch_ok and parallel_ok:
        dp = world_size // (p.tp * p.cp * p.pp)
        batch_problems = batch_over_dp(t.global_batch_size, t.micro_batch_size, dp)
        out.extend(batch_problems)
        if not batch_problems and p.pp > 1 and pipeline_schedule(config) == "interleaved":
            out.extend(interleaved_micro_batches(
                t.global_batch_size // (t.micro_batch_size * dp), p.pp,
                f"; global_batch_size={t.global_batch_size}, micro_batch_size={t.micro_batch_size}, dp={dp}"))
    backend = config.parallel.backend
    if t.device == "cpu" and backend == "nccl":
        out.append("train.device=cpu cannot run with parallel.backend=nccl (NCCL reduces CUDA tensors only); "
                   "use parallel.backend=gloo or auto")
    if t.device == "cuda" and backend == "gloo":
        out.append("train.device=cuda cannot run with parallel.backend=gloo (gloo ranks compute on the CPU); "
                   "use parallel.backend=nccl or auto")
    out.extend(spike_detection(t.loss_spike_factor, t.loss_spike_window))
    # Rollback and checkpoint cadence (issue 28).
    if t.on_loss_spike != "log" and t.loss_spike_factor == 0:
        out.append(f"train.on_loss_spike={t.on_loss_spike} needs spike detection, but train.loss_spike_factor=0 "
                   f"turns it off")
    _at_least(out, "train.rollback_skip_batches", t.rollback_skip_batches, 1)
    _at_least(out, "train.max_rollbacks", t.max_rollbacks, 1)
    for batch in t.skip_batches:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
            out.append(f"train.skip_batches: {_fmt(batch)} is not a global batch index (an integer >= 0)")
    if t.save_every_minutes is not None:
        _positive(out, "train.save_every_minutes", t.save_every_minutes)
    if t.expected_mtbf_minutes is not None:
        _positive(out, "train.expected_mtbf_minutes", t.expected_mtbf_minutes)
    if t.save_every_minutes is not None and t.expected_mtbf_minutes is not None:
        out.append(f"train.save_every_minutes={_fmt(t.save_every_minutes)} and train.expected_mtbf_minutes="
                   f"{_fmt(t.expected_mtbf_minutes)} both set the time between saves (fixed, or derived from the "
                   f"failure rate); set one")
    for name in t.exit_signals:
        if name not in EXIT_SIGNALS:
            out.append(f"train.exit_signals: {_fmt(name)} is not a signal a run can stop on; "
                       f"use {', '.join(EXIT_SIGNALS)}")
    if t.exit_after_minutes is not None:
        _positive(out, "train.exit_after_minutes", t.exit_after_minutes)
    if t.exit_at_step is not None:
        _at_least(out, "train.exit_at_step", t.exit_at_step, 1)
    if t.hang_timeout_s is not None:
        if t.hang_timeout_s < 0:
            out.append(f"train.hang_timeout_s={_fmt(t.hang_timeout_s)} must be >= 0 (0: off, unset: derived)")
        elif t.hang_timeout_s >= config.parallel.timeout_s:
            out.append(f"train.hang_timeout_s={_fmt(t.hang_timeout_s)} must be below parallel.timeout_s="
                       f"{_fmt(config.parallel.timeout_s)}: the collective timeout would fire first")
    _at_least(out, "train.eval_every", t.eval_every, 0)
    _at_least(out, "train.eval_iters", t.eval_iters, 1)
    d = config.data
    if not 0 <= d.valid_fraction < 1:
        out.append(f"data.valid_fraction={_fmt(d.valid_fraction)} must be in [0, 1)")
    if d.valid_path is not None and d.valid_fraction > 0:
        out.append(f"data.valid_path={_fmt(d.valid_path)} and data.valid_fraction={_fmt(d.valid_fraction)} are "
                   f"exclusive: validate on another dataset or on a held-out fraction of the training data")
    if d.valid_path == "":
        out.append("data.valid_path='' must be a dataset path, or null")
    if t.eval_every > 0 and d.valid_path is None and not d.valid_fraction > 0:
        out.append(f"train.eval_every={t.eval_every} needs validation data: set data.valid_path or "
                   f"data.valid_fraction > 0")


@rule
def batch_over_dp(global_batch_size: int, micro_batch_size: int, dp: int) -> list[str]:
    """A global batch is whole micro-batches on every dp rank."""
    if global_batch_size % (micro_batch_size * dp):
        return [f"train.global_batch_size={global_batch_size} is not divisible by "
                f"train.micro_batch_size*dp={micro_batch_size * dp} "
                f"(micro_batch_size={micro_batch_size}, dp=world_size/(tp*cp*pp)={dp})"]
    return []


@rule
def spike_detection(factor: float, window: int) -> list[str]:
    """A loss spike is a loss above factor x the median of the previous window losses
    (factor 0: off)."""
    out: list[str] = []
    _at_least(out, "train.loss_spike_factor", factor, 0)
    if isinstance(window, bool) or not isinstance(window, int):
        out.append(f"train.loss_spike_window={_fmt(window)} must be an integer >= 1")
    else:
        _at_least(out, "train.loss_spike_window", window, 1)
    return out


@rule
def checkpoints_kept(keep_last: int) -> list[str]:
    """A run keeps its newest keep_last checkpoints; at least the one it resumes from."""
    return _minimum("train.keep_last", keep_last, 1)


def _check_optimizer(config: Config, out: list[str]) -> None:
    o, t = config.optimizer, config.train
    if _positive(out, "optimizer.lr", o.lr) and not 0 <= o.min_lr <= o.lr:
        out.append(f"optimizer.min_lr={_fmt(o.min_lr)} must be in [0, optimizer.lr={_fmt(o.lr)}]")
    out.extend(adamw_settings(o.beta1, o.beta2, o.eps, o.weight_decay))
    out.extend(grad_clip(o.clip_grad))
    if _at_least(out, "optimizer.warmup_steps", o.warmup_steps, 0) and o.warmup_steps > t.steps:
        out.append(f"optimizer.warmup_steps={o.warmup_steps} must be <= train.steps={t.steps}")
    if not 0 < o.decay_fraction <= 1:
        out.append(f"optimizer.decay_fraction={_fmt(o.decay_fraction)} must be in (0, 1]")


@rule
def adamw_settings(beta1: float, beta2: float, eps: float, weight_decay: float) -> list[str]:
    """AdamW's moment decays, its denominator's epsilon and its decoupled weight decay.
    (The learning rate is set by the schedule at every step, between min_lr and lr.)"""
    out = []
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0 <= value < 1:
            out.append(f"optimizer.{name}={_fmt(value)} must be in [0, 1)")
    _positive(out, "optimizer.eps", eps)
    _at_least(out, "optimizer.weight_decay", weight_decay, 0)
    return out


@rule
def grad_clip(clip_grad: float) -> list[str]:
    """The global grad norm is clipped to clip_grad (0: no clipping)."""
    return _minimum("optimizer.clip_grad", clip_grad, 0)


def _check_data_wandb_and_init(config: Config, out: list[str]) -> None:
    d, w = config.data, config.wandb
    paths = data_paths(config)
    if isinstance(d.path, list) and not paths:
        out.append("data.path=[] must name at least one dataset, or be null for the demo corpus")
    for i, path in enumerate(paths if isinstance(d.path, list) else []):
        if not path:
            out.append(f"data.path[{i}]='' must be a dataset path")
    if d.path == "":
        out.append("data.path='' must be a dataset path, or null for the demo corpus")
    if d.weights is not None:
        if d.path is None:
            out.append(f"data.weights={_fmt(d.weights)} is set but data.path is null")
        elif len(d.weights) != len(paths):
            out.append(f"data.weights has {len(d.weights)} entries, expected one per data.path entry ({len(paths)})")
        for i, weight in enumerate(d.weights):
            if not weight > 0:
                out.append(f"data.weights[{i}]={_fmt(weight)} must be > 0")
    if not d.tokenizer:
        out.append("data.tokenizer='' must be byte or a path to a tokenizer.json")
    if d.eod_id is not None and not 0 <= d.eod_id < config.model.vocab_size:
        out.append(f"data.eod_id={d.eod_id} must be in [0, model.vocab_size={config.model.vocab_size})")
    if not d.text_key:
        out.append("data.text_key='' must name the text column or JSONL field")
    _at_least(out, "wandb.heatmap_every", w.heatmap_every, 1)
    init = config.init
    out.extend(upcycle_slices(init.upcycle_granularity))
    if init.from_hf is not None and init.upcycle_from is not None:
        out.append(f"init.from_hf={init.from_hf!r} and init.upcycle_from={init.upcycle_from!r} are both set: a run "
                   f"starts from an MoE checkpoint or upcycles a dense one, not both")
    if init.upcycle_granularity != 1 and init.upcycle_from is None:
        out.append(f"init.upcycle_granularity={init.upcycle_granularity} is set but init.upcycle_from is null")


# ---------------------------------------------------------------------------
# The configuration reference (docs/configuration.md), generated from the dataclasses
# above: each field's type, default and comment, so the docs cannot drift from the code.


def field_comments(cls: type) -> dict[str, str]:
    """Each field of the config dataclass ``cls`` -> the comment that documents it: the
    comment lines just above it (the source is the documentation)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        name = text.partition(":")[0]
        if name in fields and above:
            comments[name] = " ".join(above)
        above = []
    return comments


def _type_doc(tp: Any) -> str:
    """A field type as the reference shows it: choices spelled out, Optional as "or null"."""
    if typing.get_origin(tp) is Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(tp))
    if typing.get_origin(tp) is Union:
        return " or ".join(_type_doc(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_doc(typing.get_args(tp)[0])}"
    return "null" if tp is type(None) else tp.__name__


def _default_doc(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return f"`{_fmt(value)}`"


def reference_markdown() -> str:
    """docs/configuration.md: one section per config dataclass, one row per field."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from the dataclasses of moe_fold/config.py by",
        "     `python -m moe_fold.config --reference > docs/configuration.md`: edit the field",
        "     comments there; tests/test_config_reference.py fails when this file differs. -->",
        "",
        "A run is configured by a YAML file or preset (`--config`) of `section: {key: value}`",
        "mappings, then `--set section.key=value` overrides. Loading checks each value's type;",
        "`validate()` then checks the rules between keys and the world size, and lists every",
        "problem (field, value, rule) before any rank starts. A key with choices takes exactly",
        "one of the values listed.",
        "",
    ]
    for name, cls in SECTIONS.items():
        doc = inspect.cleandoc(cls.__doc__ or "")
        lines += [f"## {name}", "", doc, "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
        comments = field_comments(cls)
        types = _field_types(cls)
        for f in dataclasses.fields(cls):
            text = comments.get(f.name, "").replace("|", "\\|")
            lines.append(f"| `{name}.{f.name}` | {_type_doc(types[f.name])} | {_default_doc(f)} | {text} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--reference"]:
        sys.exit("usage: python -m moe_fold.config --reference > docs/configuration.md")
    from moe_fold.config import reference_markdown as _reference  # the installed module, not __main__'s copy

    sys.stdout.write(_reference())

"""Typed run configuration: one dataclass per section, loaded from YAML, overridden
from the command line, validated before any process group exists.

Sections: ``model``, ``moe``, ``parallel``, ``data``, ``optimizer``, ``train``,
``wandb``, ``init``. Field names are the keys of the YAML file and of ``--set``
(``--set moe.topk=4``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class ModelConfig:
    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    # Per-head width; None means hidden_size // num_heads.
    head_dim: Optional[int] = None
    # Width of the dense SwiGLU MLP in dense (non-MoE) layers.
    ffn_hidden_size: int = 256
    seq_length: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # Qwen3-style RMSNorm on each query and key head.
    qk_norm: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02


@dataclass
class MoEConfig:
    num_experts: int = 8
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

    # Routing (Megatron-Core semantics).
    score_function: str = "softmax"  # softmax | sigmoid
    pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    scaling_factor: Optional[float] = None
    router_dtype: str = "float32"  # float32 | float64
    input_jitter: float = 0.0
    # Aux-loss-free load balancing: a per-expert bias used for selection only.
    expert_bias: bool = False
    bias_update_rate: float = 1e-3

    # Load-balancing losses; each kind is on when its coefficient is > 0.
    aux_loss_coeff: float = 1e-2
    seq_aux_loss_coeff: float = 0.0
    global_aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0

    # Token dispatch.
    dispatcher: str = "alltoall"  # alltoall | allgather
    # None means dropless; a number enables token dropping at that capacity factor.
    capacity_factor: Optional[float] = None
    drop_policy: str = "probs"  # probs | position
    pad_to_capacity: bool = False
    # Rank-deduplicated all-to-all: a token goes once to each destination rank.
    dedup: bool = False

    # Kernel backends.
    gemm_backend: str = "auto"  # auto | grouped_gemm | torch | triton | loop
    permute_backend: str = "torch"  # torch | triton


@dataclass
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    # Expert-tensor parallel size; None means the same as tp.
    etp: Optional[int] = None
    # Virtual pipeline stages (model chunks) per pp rank; None means 1.
    vpp: Optional[int] = None
    sequence_parallel: bool = False
    order: str = "tp-cp-ep-dp-pp"
    cp_kind: str = "ring"  # ring | a2a
    pp_schedule: str = "1f1b"  # 1f1b | interleaved
    # Explicit number of layers on each pipeline stage; None splits evenly.
    pp_layers: Optional[list[int]] = None
    backend: str = "auto"  # auto | gloo | nccl
    # Seconds a collective may wait before the run stops with an error.
    timeout_s: float = 300.0


@dataclass
class DataConfig:
    # Dataset prefix(es) (``.bin``/``.idx``) or text to tokenize; None: the demo corpus.
    path: Optional[Union[str, list[str]]] = None
    # Blend weights, one per path.
    weights: Optional[list[float]] = None
    # ``byte`` (no file needed) or a path to a Hugging Face tokenizer.json.
    tokenizer: str = "byte"
    # Pack whole documents into each sample and mask across document boundaries.
    packing: bool = False
    cache_dir: str = "data_cache"


@dataclass
class OptimizerConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 10
    # Fraction of steps spent decaying at the end of a WSD schedule.
    decay_fraction: float = 0.2
    # ZeRO-1: shard optimizer state over dp x cp (dense) and edp (experts).
    distributed: bool = False


@dataclass
class TrainConfig:
    steps: int = 100
    micro_batch_size: int = 4
    global_batch_size: int = 16
    seed: int = 1234
    deterministic: bool = False
    run_dir: str = "runs/default"
    save_every: int = 50
    keep_last: int = 2
    log_every: int = 1
    precision: str = "fp32"  # fp32 | bf16-autocast | bf16
    recompute: str = "none"  # none | full | moe | expert_act
    on_nonfinite: str = "skip"  # skip | stop


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "moe-fold"
    name: Optional[str] = None
    heatmap_every: int = 50


@dataclass
class InitConfig:
    # Start from a Hugging Face model folder (config.json + safetensors).
    from_hf: Optional[str] = None


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

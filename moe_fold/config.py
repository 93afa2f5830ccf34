"""Typed run configuration: one dataclass per section, loaded from YAML, overridden
from the command line, validated before any process group exists.

Sections: ``model``, ``moe``, ``parallel``, ``data``, ``optimizer``, ``train``,
``wandb``, ``init``. Field names are the keys of the YAML file and of ``--set``
(``--set moe.topk=4``).

``load_config(file_or_preset, overrides)`` builds a type-checked Config;
``validate(config, world_size)`` checks the rules between fields and raises one
``ConfigError`` listing every violation. Derived sizes (``dp_size``, ``edp_size``,
``etp_size``, ``vpp_size``, ``moe_layer_flags``, ``moe_layer_indices``, ``pp_layer_counts``) live here so every
module uses one definition.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

# The signals train.exit_signals may name: those a job scheduler, a container runtime or a
# terminal sends to end a process politely (SIGKILL and SIGSTOP cannot be caught).
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")
# moe.group_score: how group-limited routing ranks a group (see MoEConfig).
GROUP_SCORES = ("topk_sum", "top2_sum", "max")

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
    # What the QK-norm normalises: head (each head, Qwen3, GLM-4.5) | projection (the whole
    # q and k projections, OLMoE; under tp the sum of squares is reduced over tp).
    qk_norm_scope: str = "head"
    # Fraction of each head's dims that rotary embeddings rotate (the first ones; GLM-4.5: 0.5).
    partial_rotary_factor: float = 1.0
    # Biases on the q, k and v projections (Qwen2-MoE).
    qkv_bias: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Multi-token prediction (DeepSeek-V3): depth k predicts token t+1+k; 0 disables it.
    mtp_num_layers: int = 0
    # The MTP loss (mean over depths) is added to the objective times this weight.
    mtp_loss_weight: float = 0.1

    # Attention kind: mha (grouped-query multi-head attention) | mla (DeepSeek's multi-head
    # latent attention: low-rank query and joint key/value compression, decoupled rotary part).
    attention: str = "mha"
    # MLA sizes (names as in Hugging Face's DeepseekV3Config). q_lora_rank None: a full-rank query.
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    # The rotary dims of q and k come in interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's
    # checkpoints) instead of two halves.
    rope_interleave: bool = False
    # Rotary scaling: null (none) | yarn (Peng et al. 2023, as DeepSeek-V3 uses it).
    rope_scaling: Optional[str] = None
    yarn_factor: Optional[float] = None
    yarn_original_max_position_embeddings: Optional[int] = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # cos/sin scale mscale(yarn_mscale) / mscale(yarn_mscale_all_dim) when both are set, else
    # mscale(1); the MLA softmax scale also takes mscale(yarn_mscale_all_dim)^2 when set.
    yarn_mscale: Optional[float] = None
    yarn_mscale_all_dim: Optional[float] = None


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
    # How group-limited routing ranks a group (dispatch/router.py): topk_sum, the sum of its
    # best topk/group_topk scores (Megatron-Core); top2_sum, the sum of its best 2 whatever
    # topk is (DeepSeek-V3, GLM-4.5); max, its best score (DeepSeek-V2's group_limited_greedy).
    group_score: str = "topk_sum"  # topk_sum | top2_sum | max
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
    # Overlap (moe_fold.models.moe_layer): run the shared expert while the dispatch and
    # combine collectives are in flight.
    shared_expert_overlap: bool = False
    # Dispatch the layer's routed tokens in this many chunks (routing stays per layer), so
    # one chunk's all-to-all overlaps another chunk's expert GEMMs; 1 = off.
    overlap_chunks: int = 1

    # Expert placement (docs/placement.md). Spare expert slots per ep rank, holding copies
    # of the hottest experts; 0: none.
    replicas: int = 0
    # Re-place the experts from the last window's load every N steps; 0: never.
    replace_every: int = 0

    # Kernel backends. ``auto`` is the rule of moe_fold.kernels.backends (device, CUDA
    # capability, train.precision): on CPU gemm torch, permute torch, swiglu cpu (C loops;
    # needs a C compiler), topk torch; on sm90/sm100 bf16 gemm torch (grouped_mm), the rest
    # triton. A run resolves ``auto`` before its ranks start and writes the names it chose
    # into its config.yaml (and the printed config). gemm: a value other than auto wins,
    # else the environment variable MOE_FOLD_GEMM_BACKEND if set, else the rule.
    gemm_backend: str = "auto"  # auto | grouped_gemm | torch | triton | loop
    permute_backend: str = "auto"  # auto | torch | triton
    swiglu_backend: str = "auto"  # auto | torch | triton | cpu
    # The router's top-k; triton fuses plain top-k only (not num_groups or expert_bias).
    topk_backend: str = "auto"  # auto | torch | triton


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
    # Dynamic cp: parallel.cp is the largest cp group; each micro-batch's documents run on
    # sub-groups sized for them (moe_fold.training.dynamic_cp). Needs tp=1, pp=1, cp a power of 2.
    dynamic_cp: bool = False
    # Compute FLOPs per byte of cp link bandwidth: how dynamic cp's cost model charges ring traffic.
    dynamic_cp_flops_per_byte: float = 10.0
    # auto: interleaved when vpp > 1, else 1f1b (pipeline_schedule() resolves it).
    pp_schedule: str = "auto"  # auto | 1f1b | interleaved
    # Explicit number of layers on each pipeline stage; None splits evenly.
    pp_layers: Optional[list[int]] = None
    backend: str = "auto"  # auto | gloo | nccl
    # Seconds a collective may wait before the run stops with an error.
    timeout_s: float = 300.0
    # Data-parallel overlap (moe_fold.training.buckets): reduce each gradient bucket during the
    # backward of the last micro-batch, as soon as its grads are final; all-gather each
    # parameter bucket of the distributed optimizer during the next forward, waited just
    # before the bucket's first use. Off: after the backward, and before the next step.
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # Elements per gradient bucket (and distributed-optimizer shard bucket).
    grad_bucket_numel: int = 1 << 24


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
    # Validation data (train.eval_every): a dataset prefix or text like ``path``, or
    # ``valid_fraction`` of each training dataset's documents (its last ones), held out.
    valid_path: Optional[str] = None
    valid_fraction: float = 0.0
    # Tokenized data made elsewhere (moe_fold.data.sources): the end-of-document id of
    # formats that do not store one (Megatron, .npy/.bin token files, Hugging Face
    # input_ids; None: data.tokenizer's), and the token dtype of a raw .bin (nanoGPT: uint16).
    eod_id: Optional[int] = None
    dtype: Optional[str] = None
    # Column / JSONL field holding the text of a document.
    text_key: str = "text"
    # Token-id check before training: ``sampled`` (8 blocks of 2^20 tokens per dataset)
    # or ``full`` (every token); the loader also checks each sample it reads.
    verify: str = "sampled"


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
    # Where a rank computes: auto is CUDA under NCCL and, in one process, when a GPU is
    # visible and parallel.backend is not gloo; CPU otherwise (moe_fold.training.train.compute_device).
    device: str = "auto"  # auto | cpu | cuda
    # TF32 tensor cores for float32 matmuls and convolutions on CUDA (10 mantissa bits in
    # the products, float32 accumulation); no effect on CPU.
    tf32: bool = True
    recompute: str = "none"  # none | full | moe | expert_act
    on_nonfinite: str = "skip"  # skip | stop
    # A loss above loss_spike_factor x the median of the previous loss_spike_window
    # losses is logged as a spike (metrics.jsonl loss_spike, a warning); 0: off.
    loss_spike_factor: float = 3.0
    loss_spike_window: int = 20
    # Stopping early with a checkpoint of the step (moe_fold.training.stop): on one of
    # these signals, after exit_after_minutes of wall clock, after step exit_at_step.
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])
    exit_after_minutes: Optional[float] = None
    exit_at_step: Optional[int] = None
    # Hang detection (moe_fold.training.heartbeat): seconds a step may go without progress before
    # the rank is named, stacks are written and the job exits 75 to be restarted. None: 10 x the
    # longest recent step, at least 30 s; 0: off. Below parallel.timeout_s.
    hang_timeout_s: Optional[float] = None
    # Validation LM loss every eval_every steps and at the last one (0: never), over
    # eval_iters global batches of the validation data (data.valid_path/valid_fraction).
    eval_every: int = 0
    eval_iters: int = 10
    # Write checkpoints in a background thread; the step only waits for a host copy
    # (kept allocated between saves: one copy of the rank's weights and optimizer state).
    async_save: bool = True


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
    # Start an MoE model from a dense Hugging Face Llama, Qwen2 or Qwen3 folder: experts
    # made from the dense MLP so that step 0 computes the dense model's function
    # (moe_fold.models.hf.upcycle); granularity G > 1 cuts the MLP into G expert slices.
    upcycle_from: Optional[str] = None
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


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_MISMATCH = object()


def _coerce(value: Any, tp: Any, parse_floats: bool = True) -> Any:
    """``value`` converted to the annotated type ``tp``, or ``_MISMATCH``.

    With ``parse_floats``, floats also accept strings because YAML 1.1 reads ``1e-3``
    (no dot) as a string. bool is never taken for int or float, nor int for bool."""
    origin = typing.get_origin(tp)
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


def _exact_div(a: int, b: int, a_name: str, b_name: str) -> int:
    if b < 1 or a % b:
        raise ConfigError(f"{a_name}={a} is not divisible by {b_name}={b}")
    return a // b


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
    out: list[str] = []
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


def _one_of(out: list[str], dotted: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        out.append(f"{dotted}={_fmt(value)} must be one of {', '.join(allowed)}")


def _at_least(out: list[str], dotted: str, value: float, low: float) -> bool:
    if not value >= low:  # also catches nan
        out.append(f"{dotted}={_fmt(value)} must be >= {low}")
        return False
    return True


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
        attn = p.tp * p.cp * p.pp
        if world_size % attn:
            out.append(f"world_size={world_size} is not divisible by parallel.tp*cp*pp={attn} "
                       f"(tp={p.tp}, cp={p.cp}, pp={p.pp})")
            ok = False
        etp = etp_size(config)
        expert = etp * p.ep * p.pp
        if world_size % expert:
            etp_text = f"etp={etp}" if p.etp is not None else f"etp=null -> tp={etp}"
            out.append(f"world_size={world_size} is not divisible by parallel.etp*ep*pp={expert} "
                       f"({etp_text}, ep={p.ep}, pp={p.pp})")
            ok = False
    dims = p.order.split("-")
    if sorted(dims) != sorted(["tp", "cp", "ep", "dp", "pp"]):
        out.append(f"parallel.order={_fmt(p.order)} must be a permutation of tp, cp, ep, dp, pp joined by '-'")
    _one_of(out, "parallel.cp_kind", p.cp_kind, ("ring", "a2a"))
    if p.dynamic_cp:
        if p.cp < 1 or p.cp & (p.cp - 1) or p.cp > 16:
            out.append(f"parallel.dynamic_cp=true needs parallel.cp a power of two up to 16, got cp={p.cp}")
        for name in ("tp", "pp"):
            if getattr(p, name) != 1:
                out.append(f"parallel.dynamic_cp=true needs parallel.{name}=1, got {getattr(p, name)} (ranks "
                           f"hold unequal token counts under dynamic cp)")
        _at_least(out, "parallel.dynamic_cp_flops_per_byte", p.dynamic_cp_flops_per_byte, 0)
    _one_of(out, "parallel.pp_schedule", p.pp_schedule, ("auto", "1f1b", "interleaved"))
    _one_of(out, "parallel.backend", p.backend, ("auto", "gloo", "nccl"))
    _positive(out, "parallel.timeout_s", p.timeout_s)
    _at_least(out, "parallel.grad_bucket_numel", p.grad_bucket_numel, 1)
    if p.overlap_grad_reduce and config.moe.replicas > 0:
        out.append(f"parallel.overlap_grad_reduce=true cannot run with moe.replicas={config.moe.replicas} yet: the "
                   f"copies of an expert sum their grads over ep after the whole backward, before the "
                   f"data-parallel reduction")
    if p.overlap_param_gather and not config.optimizer.distributed:
        out.append("parallel.overlap_param_gather=true needs optimizer.distributed=true (only the distributed "
                   "optimizer all-gathers parameters after its step)")
    return ok


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
    _one_of(out, "model.qk_norm_scope", m.qk_norm_scope, ("head", "projection"))
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
    elif m.attention != "mla" and head_dim(config) % 2:
        what = "model.head_dim" if m.head_dim is not None else "model.hidden_size/num_heads"
        out.append(f"{what}={head_dim(config)} must be even (rotary embeddings rotate pairs of dimensions)")
    _check_attention(m, out)
    if p.tp < 1 or p.cp < 1:
        return
    _divisible(out, "model.num_heads", m.num_heads, "parallel.tp", p.tp)
    _divisible(out, "model.num_kv_heads", m.num_kv_heads, "parallel.tp", p.tp)
    _divisible(out, "model.vocab_size", m.vocab_size, "parallel.tp", p.tp)
    if any_dense:
        _divisible(out, "model.ffn_hidden_size", m.ffn_hidden_size, "parallel.tp", p.tp)
    if p.sequence_parallel and p.tp > 1:
        _divisible(out, "model.seq_length", m.seq_length, "parallel.tp*cp", p.tp * p.cp,
                   " (parallel.sequence_parallel=true splits each cp shard of the sequence over tp)")
    if p.cp > 1:
        _divisible(out, "model.seq_length", m.seq_length, "2*parallel.cp", 2 * p.cp,
                   " (context parallel splits the sequence into 2*cp chunks)")
        if p.cp_kind == "a2a":
            # Kv heads need only divide by tp: a2a repeats each tp rank's kv heads up to a
            # multiple of cp (context_parallel.a2a_kv_repeats), which divides the query heads.
            why = " (parallel.cp_kind=a2a splits each tp rank's heads over cp)"
            _divisible(out, "model.num_heads", m.num_heads, "parallel.tp*cp", p.tp * p.cp, why)


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


def _check_attention(m: ModelConfig, out: list[str]) -> None:
    """The attention kind, MLA's sizes and the rotary scaling."""
    _one_of(out, "model.attention", m.attention, ("mha", "mla"))
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
        if m.head_dim is not None:
            out.append(f"model.head_dim={m.head_dim} must be null when model.attention=mla (MLA's head widths are "
                       f"model.qk_nope_head_dim, model.qk_rope_head_dim and model.v_head_dim)")
    elif m.attention == "mha":
        for name in ("q_lora_rank",) + MLA_SIZES:
            if getattr(m, name) is not None:
                out.append(f"model.{name}={getattr(m, name)} is an MLA size: set model.attention=mla or leave "
                           f"it null")
    if m.rope_interleave and m.attention != "mla":
        out.append("model.rope_interleave=true requires model.attention=mla")
    if m.rope_scaling is None:
        for name in ("yarn_factor", "yarn_original_max_position_embeddings", "yarn_mscale", "yarn_mscale_all_dim"):
            if getattr(m, name) is not None:
                out.append(f"model.{name}={_fmt(getattr(m, name))} is set but model.rope_scaling is null")
        return
    _one_of(out, "model.rope_scaling", m.rope_scaling, ("yarn",))
    if m.rope_scaling != "yarn":
        return
    if m.attention != "mla":
        out.append("model.rope_scaling=yarn requires model.attention=mla (YaRN is implemented for MLA models)")
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
    _one_of(out, "moe.score_function", moe.score_function, ("softmax", "sigmoid"))
    _one_of(out, "moe.router_dtype", moe.router_dtype, ("float32", "float64"))
    _one_of(out, "moe.drop_policy", moe.drop_policy, ("probs", "position"))
    _one_of(out, "moe.dispatcher", moe.dispatcher, ("alltoall", "allgather"))
    _one_of(out, "moe.gemm_backend", moe.gemm_backend, ("auto", "grouped_gemm", "torch", "triton", "loop"))
    _one_of(out, "moe.permute_backend", moe.permute_backend, ("auto", "torch", "triton"))
    _one_of(out, "moe.swiglu_backend", moe.swiglu_backend, ("auto", "torch", "triton", "cpu"))
    _one_of(out, "moe.topk_backend", moe.topk_backend, ("auto", "torch", "triton"))
    if moe.topk_backend == "triton" and (moe.num_groups is not None or moe.expert_bias):
        out.append(f"moe.topk_backend=triton fuses plain top-k only; moe.num_groups={_fmt(moe.num_groups)} and "
                   f"moe.expert_bias={_fmt(moe.expert_bias)} need moe.topk_backend=torch (or auto)")
    if moe.expert_bias and moe.score_function != "sigmoid":
        out.append(f"moe.expert_bias=true requires moe.score_function=sigmoid, got {_fmt(moe.score_function)}")
    if moe.pre_softmax and moe.score_function != "softmax":
        out.append(f"moe.pre_softmax=true requires moe.score_function=softmax, got {_fmt(moe.score_function)}")
    if moe.scaling_factor is not None and not moe.scaling_factor > 0:
        out.append(f"moe.scaling_factor={_fmt(moe.scaling_factor)} must be > 0 when set")
    for name in ("input_jitter", "bias_update_rate", "aux_loss_coeff", "seq_aux_loss_coeff",
                 "global_aux_loss_coeff", "z_loss_coeff"):
        _at_least(out, f"moe.{name}", getattr(moe, name), 0)
    if moe.capacity_factor is not None and not moe.capacity_factor > 0:
        out.append(f"moe.capacity_factor={_fmt(moe.capacity_factor)} must be > 0, or null for dropless")
    if moe.pad_to_capacity and moe.capacity_factor is None:
        out.append("moe.pad_to_capacity=true requires moe.capacity_factor to be set, got null")
    if moe.dedup and moe.dispatcher != "alltoall":
        out.append(f"moe.dedup=true requires moe.dispatcher=alltoall, got {_fmt(moe.dispatcher)}")
    if moe.pad_to_capacity and moe.dispatcher != "alltoall":
        out.append(f"moe.pad_to_capacity=true requires moe.dispatcher=alltoall, got {_fmt(moe.dispatcher)}")
    if moe.shared_expert_gate and not moe.shared_expert_ffn_hidden_size > 0:
        out.append(f"moe.shared_expert_gate=true requires a shared expert (moe.shared_expert_ffn_hidden_size > 0), "
                   f"got {_fmt(moe.shared_expert_ffn_hidden_size)}")
    _at_least(out, "moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size, 0)
    out.extend(overlap_problems(moe))
    _check_placement(config, out)
    if not any_moe:
        return
    if p.tp > 1 and not p.sequence_parallel:
        out.append(f"parallel.tp={p.tp} with MoE layers requires parallel.sequence_parallel=true")
    if _at_least(out, "moe.ffn_hidden_size", moe.ffn_hidden_size, 1):
        if p.etp is None:
            _divisible(out, "moe.ffn_hidden_size", moe.ffn_hidden_size, "parallel.tp", p.tp,
                       " (parallel.etp is null, so experts are split over tp)")
        else:
            _divisible(out, "moe.ffn_hidden_size", moe.ffn_hidden_size, "parallel.etp", p.etp)
    if moe.shared_expert_ffn_hidden_size > 0:
        _divisible(out, "moe.shared_expert_ffn_hidden_size", moe.shared_expert_ffn_hidden_size,
                   "parallel.tp", p.tp)
    if moe.num_experts < 1:
        out.append(f"moe.num_experts={moe.num_experts} must be >= 1 when any layer is MoE "
                   f"(moe.moe_layer_freq={_fmt(moe.moe_layer_freq)}, moe.first_k_dense={moe.first_k_dense})")
        return
    _divisible(out, "moe.num_experts", moe.num_experts, "parallel.ep", p.ep)
    if not 1 <= moe.topk <= moe.num_experts:
        out.append(f"moe.topk={moe.topk} must be in [1, moe.num_experts={moe.num_experts}]")
    _check_groups(config, out)


def overlap_problems(moe: MoEConfig) -> list[str]:
    """What is wrong with ``moe.shared_expert_overlap`` / ``moe.overlap_chunks`` (also
    checked by the MoE layer itself, which can be built without :func:`validate`)."""
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
    if replicas_ok and moe.replicas > 0:
        if ep == 1:
            out.append(f"moe.replicas={moe.replicas} needs parallel.ep > 1, got 1 (a copy of an expert lives "
                       f"on another ep rank)")
        elif moe.num_experts % ep == 0 and moe.replicas > moe.num_experts - moe.num_experts // ep:
            out.append(f"moe.replicas={moe.replicas} must be <= moe.num_experts - moe.num_experts/parallel.ep="
                       f"{moe.num_experts - moe.num_experts // ep} (a rank holds at most one copy of an expert)")
    if every_ok and moe.replace_every > 0 and ep == 1:
        out.append(f"moe.replace_every={moe.replace_every} needs parallel.ep > 1, got 1 (with one ep rank "
                   f"there is nowhere to move an expert)")


def _check_groups(config: Config, out: list[str]) -> None:
    """Group-limited routing: pick group_topk groups, then topk experts inside them."""
    moe = config.moe
    groups, group_topk = moe.num_groups, moe.group_topk
    _one_of(out, "moe.group_score", moe.group_score, GROUP_SCORES)
    if (groups is None) != (group_topk is None):
        out.append(f"moe.num_groups={_fmt(groups)} and moe.group_topk={_fmt(group_topk)} "
                   f"must be both set or both null")
        return
    if groups is None:
        return
    ok = _at_least(out, "moe.num_groups", groups, 1)
    ok &= _at_least(out, "moe.group_topk", group_topk, 1)
    if not ok:
        return
    if moe.num_experts % groups:
        out.append(f"moe.num_experts={moe.num_experts} is not divisible by moe.num_groups={groups}")
        return
    if group_topk > groups:
        out.append(f"moe.group_topk={group_topk} must be <= moe.num_groups={groups}")
        return
    if moe.group_score == "topk_sum":
        # Groups are ranked by the sum of their best topk/group_topk scores.
        _divisible(out, "moe.topk", moe.topk, "moe.group_topk", group_topk,
                   " (each selected group is scored by its best topk/group_topk experts)")
    elif moe.group_score == "top2_sum" and moe.num_experts // groups < 2:
        out.append(f"moe.group_score=top2_sum needs >= 2 experts per group, got moe.num_experts/moe.num_groups="
                   f"{moe.num_experts // groups}")
    reachable = group_topk * (moe.num_experts // groups)
    if moe.topk > reachable:
        out.append(f"moe.topk={moe.topk} exceeds the {reachable} experts in the selected groups "
                   f"(moe.group_topk={group_topk} * moe.num_experts/moe.num_groups="
                   f"{moe.num_experts // groups})")


def _check_pipeline(config: Config, out: list[str]) -> None:
    p, m = config.parallel, config.model
    if p.pp < 1 or (p.vpp is not None and p.vpp < 1) or m.num_layers < 1:
        return
    vpp = vpp_size(config)
    chunks = p.pp * vpp
    if p.pp_layers is None:
        if m.num_layers % chunks:
            out.append(f"model.num_layers={m.num_layers} is not divisible by parallel.pp*vpp={chunks} "
                       f"(set parallel.pp_layers to split the layers unevenly)")
    else:
        if len(p.pp_layers) != chunks:
            out.append(f"parallel.pp_layers has {len(p.pp_layers)} entries, expected one per model chunk "
                       f"(parallel.pp*vpp={chunks})")
        for i, n in enumerate(p.pp_layers):
            if n < 1:
                out.append(f"parallel.pp_layers[{i}]={n} must be >= 1")
        if sum(p.pp_layers) != m.num_layers:
            out.append(f"parallel.pp_layers={_fmt(p.pp_layers)} sums to {sum(p.pp_layers)}, "
                       f"expected model.num_layers={m.num_layers}")
    if vpp > 1 and p.pp == 1:
        out.append(f"parallel.vpp={vpp} requires parallel.pp > 1, got 1")
    if vpp > 1 and p.pp_schedule == "1f1b":
        out.append(f"parallel.vpp={vpp} requires parallel.pp_schedule=interleaved (or auto), got 1f1b")
    if p.pp_schedule == "interleaved" and vpp == 1:
        out.append(f"parallel.pp_schedule=interleaved requires parallel.vpp > 1, got {_fmt(p.vpp)}")


def _check_train(config: Config, world_size: int, parallel_ok: bool, out: list[str]) -> None:
    t, p = config.train, config.parallel
    for name in ("steps", "save_every", "keep_last", "log_every"):
        _at_least(out, f"train.{name}", getattr(t, name), 1)
    batch_ok = _at_least(out, "train.micro_batch_size", t.micro_batch_size, 1)
    batch_ok &= _at_least(out, "train.global_batch_size", t.global_batch_size, 1)
    if batch_ok and parallel_ok:
        dp = world_size // (p.tp * p.cp * p.pp)
        if t.global_batch_size % (t.micro_batch_size * dp):
            out.append(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                       f"train.micro_batch_size*dp={t.micro_batch_size * dp} "
                       f"(micro_batch_size={t.micro_batch_size}, dp=world_size/(tp*cp*pp)={dp})")
        elif p.pp > 1 and pipeline_schedule(config) == "interleaved":
            micro_batches = t.global_batch_size // (t.micro_batch_size * dp)
            if micro_batches % p.pp:
                out.append(f"train.global_batch_size/(micro_batch_size*dp)={micro_batches} micro-batches is not "
                           f"divisible by parallel.pp={p.pp} (the interleaved schedule sends the micro-batches "
                           f"round the pipeline in groups of pp; global_batch_size={t.global_batch_size}, "
                           f"micro_batch_size={t.micro_batch_size}, dp={dp})")
    _one_of(out, "train.precision", t.precision, ("fp32", "bf16-autocast", "bf16"))
    _one_of(out, "train.device", t.device, ("auto", "cpu", "cuda"))
    backend = config.parallel.backend
    if t.device == "cpu" and backend == "nccl":
        out.append("train.device=cpu cannot run with parallel.backend=nccl (NCCL reduces CUDA tensors only); "
                   "use parallel.backend=gloo or auto")
    if t.device == "cuda" and backend == "gloo":
        out.append("train.device=cuda cannot run with parallel.backend=gloo (gloo ranks compute on the CPU); "
                   "use parallel.backend=nccl or auto")
    _one_of(out, "train.recompute", t.recompute, ("none", "full", "moe", "expert_act"))
    _one_of(out, "train.on_nonfinite", t.on_nonfinite, ("skip", "stop"))
    _at_least(out, "train.loss_spike_factor", t.loss_spike_factor, 0)
    _at_least(out, "train.loss_spike_window", t.loss_spike_window, 1)
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


def _check_optimizer(config: Config, out: list[str]) -> None:
    o, t = config.optimizer, config.train
    if _positive(out, "optimizer.lr", o.lr) and not 0 <= o.min_lr <= o.lr:
        out.append(f"optimizer.min_lr={_fmt(o.min_lr)} must be in [0, optimizer.lr={_fmt(o.lr)}]")
    for name in ("beta1", "beta2"):
        value = getattr(o, name)
        if not 0 <= value < 1:
            out.append(f"optimizer.{name}={_fmt(value)} must be in [0, 1)")
    _positive(out, "optimizer.eps", o.eps)
    _at_least(out, "optimizer.clip_grad", o.clip_grad, 0)
    _at_least(out, "optimizer.weight_decay", o.weight_decay, 0)
    if _at_least(out, "optimizer.warmup_steps", o.warmup_steps, 0) and o.warmup_steps > t.steps:
        out.append(f"optimizer.warmup_steps={o.warmup_steps} must be <= train.steps={t.steps}")
    _one_of(out, "optimizer.schedule", o.schedule, ("cosine", "wsd", "constant"))
    if not 0 < o.decay_fraction <= 1:
        out.append(f"optimizer.decay_fraction={_fmt(o.decay_fraction)} must be in (0, 1]")


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
    if d.dtype is not None:
        _one_of(out, "data.dtype", d.dtype, ("uint8", "uint16", "int16", "uint32", "int32", "int64"))
    _one_of(out, "data.verify", d.verify, ("sampled", "full"))
    if not d.text_key:
        out.append("data.text_key='' must name the text column or JSONL field")
    _one_of(out, "wandb.mode", w.mode, ("offline", "online", "disabled"))
    _at_least(out, "wandb.heatmap_every", w.heatmap_every, 1)
    init = config.init
    _at_least(out, "init.upcycle_granularity", init.upcycle_granularity, 1)
    if init.from_hf is not None and init.upcycle_from is not None:
        out.append(f"init.from_hf={init.from_hf!r} and init.upcycle_from={init.upcycle_from!r} are both set: a run "
                   f"starts from an MoE checkpoint or upcycles a dense one, not both")
    if init.upcycle_granularity != 1 and init.upcycle_from is None:
        out.append(f"init.upcycle_granularity={init.upcycle_granularity} is set but init.upcycle_from is null")

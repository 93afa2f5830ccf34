"""The layout planner: memory per rank, FLOPs, communication and an estimated step time and
MFU for a model, a world size, a layout and a GPU; and a search over layouts.

:func:`estimate` returns a :class:`Plan`; :func:`search` ranks the valid layouts of a world
by estimated MFU among those that fit in memory. The arithmetic lives in
:mod:`moe_fold.planner.model` (parameters, FLOPs, activations), :mod:`moe_fold.planner.comm`
(bytes per group kind, the rules of :mod:`moe_fold.comm`) and
:mod:`moe_fold.planner.hardware` (GPU figures and their sources).

Memory per rank: ``Assumptions.implementation`` picks whose footprint. ``"moe-fold"`` (the
default): what moe-fold's own training path keeps, every term derived from its code in
:mod:`moe_fold.planner.memory` (bf16 with float32 masters is 20 bytes per parameter,
``12 + 8/d`` with the distributed optimizer, which shards only the moments; activations as
autograd saves them in our layers). ``"megatron"``: the reference figures below, for
comparison with the papers. Megatron, mixed-precision Adam (ZeRO, Rajbhandari et al. 2020,
section 3; the figures of Megatron-LM's distributed optimizer): bf16 weights (2 bytes/parameter),
float32 main gradients (4; Megatron accumulates and reduces gradients in float32), and
float32 master weight, first and second moment (12). The distributed optimizer (ZeRO-1)
shards the 12 bytes over the ranks holding the same parameter shard, dp x cp for dense
parameters and edp for experts (:data:`moe_fold.training.optim.SHARD_GROUP`); weights and main
gradients stay whole: ``6 + 12/d`` bytes per parameter. Under ``fp32`` training the weights
are the masters: 4 + 4 + 8. Activations: :mod:`moe_fold.planner.model` (Korthikanti 2022's
fused kernels), times the micro-batches a pipeline stage holds at its peak. Plus :attr:`Assumptions.memory_overhead`.

Step time, per micro-batch on the slowest pipeline stage: its compute seconds
(``Assumptions.compute_model``: ``"flat"``, its FLOPs at ``peak * matmul_efficiency``; or
``"shapes"``, each kernel timed from its shape by :mod:`moe_fold.planner.compute_time`, with
the figures :data:`CALIBRATED` fitted on published runs, docs/planner.md) plus its tp, cp,
ep, etp and pp traffic on the critical path (pp hidden under ``overlap="megatron"`` with
vpp > 1): all of it, except the ep all-to-all under the MoE layer's overlap switches
(``moe.shared_expert_overlap``, ``moe.overlap_chunks``), of which only the part
:func:`moe_fold.planner.moe_overlap.exposed_ep_seconds` leaves exposed counts. A
step is ``(m + (pp-1)/vpp)`` such micro-batch times (1F1B and interleaved schedules; the
bubble ``(pp-1)/(vpp m)`` of Narayanan et al. 2021, section 2.2), plus the exposed part of
the data-parallel traffic (gradient buckets over dp_cp, tp_dp_cp and edp: all-reduced, or
reduce-scattered and all-gathered by the distributed optimizer, whose time splits half and
half), plus the optimizer update, bound by HBM bandwidth. ``Assumptions.overlap`` says
which of that traffic runs behind compute: ``"moe-fold"`` (the default) reads the config's
``parallel.overlap_grad_reduce`` and ``parallel.overlap_param_gather``, so the MFU is what
moe-fold's own loop would reach; ``"megatron"`` assumes both (Megatron-LM's
``--overlap-grad-reduce --overlap-param-gather``, as in the papers' runs); ``"none"``
neither. An overlapped part is hidden behind one micro-batch's backward (the gradient
reduction, 2/3 of its FLOPs) or forward (the gather, 1/3) on the slowest stage, except at
least one bucket (``parallel.grad_bucket_numel`` float32 elements), the first posted or the
last waited for, which nothing hides. The tied-embedding sum between the first and last
stage runs after the schedule and is always exposed.

Link model: a group whose ranks sit in one node (``gpus_per_node`` consecutive ranks) uses
NVLink, else the per-GPU network bandwidth, for the whole ring; an all-to-all sends each
peer's share over NVLink or the network and takes the longer of the two.

Measured routing (``skew``, :class:`RoutingSkew` from :mod:`moe_fold.planner.loads`): the
busiest ep rank's expert rows over the mean scale its expert compute and received
all-to-all rows (mean over steps) and its held-row activations (worst step).

MFU = model FLOPs per step (activated parameters only, no recompute; Narayanan 2021's
formula generalised, :func:`moe_fold.planner.model.model_flops_per_step`) / (world x peak
dense BF16 FLOP/s x step time).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

from moe_fold.config import (Config, ConfigError, ParallelConfig, dp_size, edp_size, etp_size, pipeline_schedule,
                             pp_layer_counts, validate, vpp_size)
from moe_fold.layout import ParallelLayout
from moe_fold.parallel.pipeline_schedules import Exchange, make_plan, rank_order
from moe_fold.planner.comm import GRAD_BYTES, Routing, microbatch_bytes, step_bytes, uniform_routing
from moe_fold.planner.compute_time import ATTENTION_KERNELS, GEMM_DTYPES, microbatch_compute
from moe_fold.planner.hardware import GPU
from moe_fold.planner.moe_overlap import exposed_ep_seconds
from moe_fold.planner import memory as planner_memory
from moe_fold.planner.model import (
    act_bytes, dims, head_activation_bytes, held_rows_per_token, layer_activation_bytes, microbatches_in_flight,
    ParamEntry, layer_forward_flops, model_flops_per_step, mtp_activation_bytes, param_manifest,
    rank_flops_per_microbatch, stage_blocks,
)

__all__ = ["OVERLAPS", "COMPUTE_MODELS", "CALIBRATED", "CALIBRATED_EFFICIENCY", "FITTED_EFFICIENCY", "calibrated",
           "Assumptions", "Plan", "RoutingSkew", "overlaps", "estimate",
           "search", "model_params", "with_layout", "activation_bytes", "chunk_activation_bytes", "backward_peak_bytes", "forward_peak_bytes",
           "activation_peak_bytes",
           "busiest_owned_numel",
           "stage_memory"]

# Kinds whose traffic happens per micro-batch, on the critical path.
_CRITICAL = ("tp", "cp", "ep", "etp", "etp_ep", "tp_cp", "tp_dp_cp", "pp")
# Kinds of the step-level gradient and parameter traffic.
_DATA_PARALLEL = ("dp_cp", "tp_dp_cp", "edp", "embedding")
# Which layout group a kind's bytes travel over.
_GROUP_OF = {"tp": "tp", "cp": "cp", "ep": "ep", "etp": "etp", "etp_ep": "etp_ep", "tp_cp": "tp_cp",
             "tp_dp_cp": "tp_dp_cp", "pp": "pp", "dp_cp": "dp_cp", "edp": "edp", "embedding": "pp"}


OVERLAPS = ("moe-fold", "megatron", "none")
COMPUTE_MODELS = ("flat", "shapes")


@dataclass(frozen=True)
class Assumptions:
    # Achieved / peak FLOP/s of the GEMMs and attention kernels (0.7: well-tuned large
    # bf16 GEMMs on H100 reach 70-80% of peak; grouped GEMMs and attention somewhat less).
    matmul_efficiency: float = 0.7
    # Which data-parallel overlaps the step time assumes: "moe-fold" (what the config's
    # parallel.overlap_grad_reduce and parallel.overlap_param_gather switch on), "megatron"
    # (both on: --overlap-grad-reduce and, with the distributed optimizer,
    # --overlap-param-gather, as the papers' runs) or "none".
    overlap: str = "moe-fold"
    # HBM bytes the Adam update moves per parameter it owns: reads of the float32 master,
    # grad, m and v (16), writes of master, m and v (12) and of the bf16 weight (2).
    optimizer_bytes_per_param: float = 30.0
    # CUDA context, NCCL buffers, workspace and allocator fragmentation, bytes.
    memory_overhead: float = 4e9
    # Whose memory footprint: "moe-fold" (this code's, moe_fold.planner.memory) or
    # "megatron" (Megatron-LM's fused kernels and 18-byte mixed-precision Adam).
    implementation: str = "moe-fold"
    # How compute seconds are counted: "flat" (a stage's FLOPs at peak x matmul_efficiency)
    # or "shapes" (each kernel timed from its shape, moe_fold.planner.compute_time; then
    # matmul_efficiency is what a large tile-aligned GEMM reaches). CALIBRATED holds the
    # figures fitted on bench/published's calibration rows.
    compute_model: str = "flat"
    # "shapes" only: [tokens, H] activation passes per layer forward of the memory-bound
    # element-wise work, the attention kernel (flash | unfused) and the linear layers' GEMM
    # dtype (bf16 | fp8).
    elementwise_passes: float = 0.0
    attention_kernel: str = "flash"
    gemm_dtype: str = "bf16"
    # "shapes" only: the reduction length each GEMM output tile pays on top of its own k for
    # its prologue and epilogue (compute_time.gemm_seconds: compute x (k + k0)/k).
    gemm_k_overhead: float = 0.0

    def __post_init__(self):
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"matmul_efficiency={self.matmul_efficiency} must be in (0, 1]")
        if self.memory_overhead < 0 or self.optimizer_bytes_per_param < 0:
            raise ValueError("memory_overhead and optimizer_bytes_per_param must be >= 0")
        if self.overlap not in OVERLAPS:
            raise ValueError(f"overlap={self.overlap!r} must be one of {', '.join(OVERLAPS)}")
        if self.compute_model not in COMPUTE_MODELS:
            raise ValueError(f"compute_model={self.compute_model!r} must be one of {', '.join(COMPUTE_MODELS)}")
        if self.elementwise_passes < 0:
            raise ValueError(f"elementwise_passes={self.elementwise_passes} must be >= 0")
        if self.gemm_k_overhead < 0:
            raise ValueError(f"gemm_k_overhead={self.gemm_k_overhead} must be >= 0")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r} must be one of {', '.join(ATTENTION_KERNELS)}")
        if self.gemm_dtype not in GEMM_DTYPES:
            raise ValueError(f"gemm_dtype={self.gemm_dtype!r} must be one of {', '.join(GEMM_DTYPES)}")
        if self.implementation not in planner_memory.IMPLEMENTATIONS:
            raise ValueError(f"implementation={self.implementation!r} must be one of "
                             f"{', '.join(planner_memory.IMPLEMENTATIONS)}")


# The kernel figures fitted on the calibration rows of bench/published (bench/plan_validation.py
# --fit prints them; docs/planner.md has the table): Assumptions(**CALIBRATED, ...).
# The achieved/peak FLOP/s of a large GEMM differs by GPU generation, so it is fitted per GPU
# (H200 shares H100's GH100 compute; B200 has no published row yet and borrows H100's).
FITTED_EFFICIENCY = {"v100": 0.516, "a100": 0.863, "h100": 0.636}
BORROWED_EFFICIENCY = {"h200": "h100", "b200": "h100"}
CALIBRATED_EFFICIENCY = {**FITTED_EFFICIENCY, **{gpu: FITTED_EFFICIENCY[src] for gpu, src in BORROWED_EFFICIENCY.items()}}
CALIBRATED = {"compute_model": "shapes", "elementwise_passes": 30.0, "gemm_k_overhead": 1024.0}


def calibrated(gpu: str, **overrides) -> Assumptions:
    """The fitted :class:`Assumptions` for GPU ``gpu`` (a key of
    :data:`moe_fold.planner.hardware.GPUS`), with ``overrides``."""
    key = gpu.lower()
    if key not in CALIBRATED_EFFICIENCY:
        raise ValueError(f"gpu={gpu!r} has no calibrated efficiency; known: {', '.join(CALIBRATED_EFFICIENCY)}")
    return Assumptions(**{**CALIBRATED, "matmul_efficiency": CALIBRATED_EFFICIENCY[key], **overrides})


@dataclass
class Plan:
    """One layout's estimate. Bytes, FLOPs and seconds; per rank where it says so."""
    gpu: str
    world: int
    layout: dict[str, int]
    recompute: str
    distributed_optimizer: bool
    microbatches: int
    params: dict[str, float]  # model totals and the busiest rank's count
    memory: dict[str, float]  # the busiest stage's bytes by part, total, limit
    fits: bool
    flops: dict[str, float]  # model FLOPs per step, per rank per step (with recompute)
    comm_bytes: dict[str, float]  # per rank per step, per group kind (busiest stage)
    comm_links: dict[str, str]  # per kind: nvlink | network
    time: dict[str, float]  # seconds per step by part, and the total
    mfu: float
    notes: list[str] = field(default_factory=list)
    implementation: str = "moe-fold"  # whose memory footprint ``memory`` describes
    overlaps: list[str] = field(default_factory=list)  # data-parallel overlaps the step time assumes
    overlap_model: str = "moe-fold"  # Assumptions.overlap
    # The MoE layer's overlap switches it assumes (moe.shared_expert_overlap, moe.overlap_chunks)
    # and the ep all-to-all seconds per step, in all and left exposed (time["ep"]).
    moe_overlap: dict = field(default_factory=dict)
    # How compute seconds were counted (Assumptions.compute_model and its figures), and the
    # measured routing's busiest-rank factors when the plan used them.
    compute: dict = field(default_factory=dict)
    routing: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def with_layout(config: Config, *, tp: Optional[int] = None, cp: Optional[int] = None, pp: Optional[int] = None,
                ep: Optional[int] = None, etp: Optional[int] = None, vpp: Optional[int] = None,
                mbs: Optional[int] = None, gbs: Optional[int] = None, seq: Optional[int] = None,
                recompute: Optional[str] = None, distributed: Optional[bool] = None) -> Config:
    """A copy of ``config`` with the given sizes; sequence parallel on whenever tp > 1 and
    the interleaved schedule whenever vpp > 1 (what such a layout needs to run)."""
    p = config.parallel
    par = dataclasses.replace(p, tp=p.tp if tp is None else tp, cp=p.cp if cp is None else cp,
                              pp=p.pp if pp is None else pp, ep=p.ep if ep is None else ep,
                              etp=p.etp if etp is None else etp, vpp=p.vpp if vpp is None else vpp)
    par.vpp = None if par.vpp in (None, 1) else par.vpp
    par.sequence_parallel = par.tp > 1 or p.sequence_parallel
    par.pp_schedule = "interleaved" if par.vpp else "1f1b"
    if par.pp_layers is not None and len(par.pp_layers) != par.pp * (par.vpp or 1):
        par.pp_layers = None
    model = dataclasses.replace(config.model, seq_length=config.model.seq_length if seq is None else seq)
    train = dataclasses.replace(config.train,
                                micro_batch_size=config.train.micro_batch_size if mbs is None else mbs,
                                global_batch_size=config.train.global_batch_size if gbs is None else gbs,
                                recompute=config.train.recompute if recompute is None else recompute)
    optimizer = dataclasses.replace(config.optimizer, distributed=config.optimizer.distributed
                                    if distributed is None else distributed)
    return dataclasses.replace(config, model=model, parallel=par, train=train, optimizer=optimizer)


def model_params(config: Config) -> dict[str, float]:
    """Parameters of the whole model: ``total``, ``experts`` (routed), and ``activated``
    per token (everything but the routed experts, plus ``topk`` experts' worth)."""
    one = dataclasses.replace(config, parallel=ParallelConfig())
    manifest = param_manifest(one)
    total = sum(e.numel for e in manifest)
    experts = sum(e.numel for e in manifest if e.kind == "expert")
    moe = config.moe
    # Slots on zero experts activate nothing: held_rows_per_token experts' worth.
    activated = total - experts + (experts * held_rows_per_token(config) / moe.num_experts if moe.num_experts else 0)
    return {"total": total, "experts": experts, "activated": activated}


@functools.lru_cache(maxsize=64)
def _layout(world: int, tp: int, cp: int, pp: int, ep: int, etp: int, order: str) -> ParallelLayout:
    """Layouts memoised: a search estimates many configs on few layouts."""
    return ParallelLayout(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)


def _links(layout: ParallelLayout, gpu: GPU) -> dict[str, tuple[float, float, str]]:
    """Per layout group: (bandwidth inside a node share, across nodes share, link name).
    For ring collectives the whole group runs at the slowest link; the all-to-all's
    per-peer split is in the fractions: (fraction of peers inside the node, outside)."""
    out = {}
    for kind in set(_GROUP_OF.values()):
        groups = layout.groups(kind)
        spans = any(len({r // gpu.gpus_per_node for r in g}) > 1 for g in groups)
        g = groups[0]
        n = len(g)
        node = g[0] // gpu.gpus_per_node
        inside = sum(1 for r in g[1:] if r // gpu.gpus_per_node == node)
        out[kind] = (inside / max(n - 1, 1), (n - 1 - inside) / max(n - 1, 1), "network" if spans else "nvlink")
    return out


def _seconds(kind: str, nbytes: float, links: dict, gpu: GPU) -> float:
    inside, outside, link = links[_GROUP_OF[kind]]
    if kind == "ep":
        return max(nbytes * inside / gpu.nvlink_bw, nbytes * outside / gpu.inter_node_bw)
    return nbytes / (gpu.inter_node_bw if link == "network" else gpu.nvlink_bw)


def _memory(config: Config, world: int, pp_rank: int, micro: int, assumptions: Assumptions,
            manifest: list[ParamEntry]) -> dict[str, float]:
    """Bytes per rank of stage ``pp_rank`` (whose parameters are ``manifest``) by part;
    ``optimizer`` is the one ``optimizer.distributed`` picks, and both are given."""
    if assumptions.implementation == "moe-fold":
        return _memory_moe_fold(config, world, pp_rank, micro, assumptions, manifest)
    d, p = dims(config), config.parallel
    local = sum(e.numel for e in manifest)
    experts = sum(e.numel for e in manifest if e.kind == "expert")
    bf16 = config.train.precision != "fp32"
    weights = local * (2 if bf16 else 4)
    grads = local * GRAD_BYTES
    state = 12 if bf16 else 8
    full = state * local
    sharded = state * ((local - experts) / (dp_size(config, world) * p.cp) + experts / edp_size(config, world))
    optimizer = sharded if config.optimizer.distributed else full
    g = p.tp if p.sequence_parallel else 1
    tokens = config.train.micro_batch_size * d.seq / (p.cp * g)
    per_micro = sum(layer_activation_bytes(config, i, config.train.recompute) for i in stage_blocks(config, pp_rank))
    if pp_rank == p.pp - 1:
        per_micro += head_activation_bytes(config) + mtp_activation_bytes(config)
    activations = tokens * per_micro * microbatches_in_flight(config, pp_rank, micro)
    total = weights + grads + optimizer + activations + assumptions.memory_overhead
    # Both optimizer footprints, whichever the total uses (optimizer.distributed).
    return {"weights": weights, "grads": grads, "optimizer": optimizer, "activations": activations,
            "overhead": assumptions.memory_overhead, "total": total,
            "optimizer_not_distributed": full, "optimizer_distributed": sharded}


def stage_memory(config: Config, world: int, pp_rank: int, assumptions: Assumptions = Assumptions()
                 ) -> dict[str, float]:
    """Bytes per rank of pipeline stage ``pp_rank`` by kind (as ``moe-fold plan``'s
    ``memory``), and ``params``: the parameters the rank holds."""
    t = config.train
    micro = t.global_batch_size // (t.micro_batch_size * dp_size(config, world))
    manifest = param_manifest(config, pp_rank)
    return dict(_memory(config, world, pp_rank, micro, assumptions, manifest),
                params=sum(e.numel for e in manifest))


def overlaps(config: Config, assumptions: Assumptions) -> tuple[bool, bool]:
    """Whether the step time hides the gradient reduction, and the parameter all-gather,
    behind compute (:attr:`Assumptions.overlap`). The gather exists only with the
    distributed optimizer."""
    if assumptions.overlap == "none":
        return False, False
    if assumptions.overlap == "megatron":
        return True, config.optimizer.distributed
    p = config.parallel
    return p.overlap_grad_reduce, p.overlap_param_gather and config.optimizer.distributed


def busiest_owned_numel(config: Config, world: int, pp_rank: int, manifest: list[ParamEntry]) -> int:
    """The most parameter elements any rank of ``manifest``'s stage holds moments for under
    moe-fold's distributed optimizer (the ranks of a sharding group own slightly different
    counts: cuts fall on multiples of ALIGN elements)."""
    sizes = planner_memory.zero_sizes(config, world)
    buckets = planner_memory.grad_buckets(config, pp_rank, manifest)
    return sum(max(planner_memory.owned_by_rank(buckets, group, n)) for group, n in sizes.items())


def activation_bytes(config: Config, pp_rank: int, implementation: str = "moe-fold") -> float:
    """Bytes of activations one micro-batch leaves on a rank of stage ``pp_rank`` for its
    backward (one micro-batch in flight)."""
    d, p = dims(config), config.parallel
    g = p.tp if p.sequence_parallel else 1
    tokens = config.train.micro_batch_size * d.seq / (p.cp * g)
    layers = stage_blocks(config, pp_rank)
    recompute = config.train.recompute
    if implementation == "megatron":
        per_token = sum(layer_activation_bytes(config, i, recompute) for i in layers)
        if pp_rank == p.pp - 1:
            per_token += head_activation_bytes(config) + mtp_activation_bytes(config)
        return tokens * per_token
    per_token = sum(planner_memory.layer_activation_bytes(config, i, recompute) for i in layers)
    if pp_rank == 0:
        per_token += planner_memory.embedding_activation_bytes(config)
    if pp_rank == p.pp - 1:
        per_token += planner_memory.head_activation_bytes(config) + planner_memory.mtp_activation_bytes(config)
    return tokens * per_token + planner_memory.microbatch_constant_bytes(config, layers, vpp_size(config))


def chunk_activation_bytes(config: Config, pp_rank: int) -> list[float]:
    """Bytes each model chunk of a rank of stage ``pp_rank`` keeps for one micro-batch's
    backward (their sum is :func:`activation_bytes`): its layers, the embedding on the
    first chunk of stage 0, the rotary tables and router-weight copies of the chunk, and
    on the last chunk of the last stage the MTP depths, heads and losses."""
    d, p = dims(config), config.parallel
    g = p.tp if p.sequence_parallel else 1
    tokens = config.train.micro_batch_size * d.seq / (p.cp * g)
    recompute = config.train.recompute
    counts = pp_layer_counts(config)
    starts = [sum(counts[:c]) for c in range(len(counts))]
    out = []
    virtual = list(range(pp_rank, len(counts), p.pp))
    for n, v in enumerate(virtual):
        layers = list(range(starts[v], starts[v] + counts[v]))
        if pp_rank == p.pp - 1 and n == len(virtual) - 1:
            layers += list(range(config.model.num_layers, config.model.num_layers + d.mtp))
        per_token = sum(planner_memory.layer_activation_bytes(config, i, recompute) for i in layers)
        if pp_rank == 0 and n == 0:
            per_token += planner_memory.embedding_activation_bytes(config)
        if pp_rank == p.pp - 1 and n == len(virtual) - 1:
            per_token += planner_memory.head_activation_bytes(config) + planner_memory.mtp_activation_bytes(config)
        out.append(tokens * per_token + planner_memory.microbatch_constant_bytes(config, layers, 1))
    return out


def backward_peak_bytes(config: Config, pp_rank: int, chunk: int, manifest: list[ParamEntry],
                        accumulating: bool) -> float:
    """What a rank of stage ``pp_rank`` holds above its kept activations at the busiest
    moment of model chunk ``chunk``'s backward: the larger of

    - on the last chunk of the last stage, a loss's backward
      (:func:`moe_fold.planner.memory.loss_backward_bytes`);
    - in a chunk with MoE layers, an expert block's backward: the grads of the SwiGLU's
      input ``2aF/etp`` and of the held rows ``aH`` per held row, while the grouped GEMM
      writes an expert weight's gradient in the model's dtype before it is added to the
      gradient already there (``accumulating``: every backward of the chunk after its
      first, which writes the gradient itself): the largest local expert weight; under
      ``moe`` or ``full`` recompute also the experts' forward rerun before it: per held
      row the rows gathered again ``aH``, fc1's output ``2aF/etp``, the SwiGLU's ``aF/etp``
      and fc2's output ``aH``;
    - in a chunk with dense layers, a dense block's backward: under recompute, what the
      recompute rebuilds (the block's activations without recompute, less what it kept),
      and, at the MLP's second linear, the grad of its output gathered over tp ``aHg``,
      the grad of its input ``aFg/tp`` and (``accumulating``) its weight's gradient in
      the model's dtype ``aHF/tp``;
    - in a chunk with KDA layers, the backward of its per-channel products
      (:func:`moe_fold.planner.memory.kda_backward_bytes`), and in one with DSA layers the
      softmax or the indexer's backward (:func:`moe_fold.planner.memory.dsa_backward_bytes`),
      less what the layers after it and the heads kept, freed by then (for an MTP depth's
      block, the later depths and its own head: the model's head runs its backward
      after it)."""
    d, p = dims(config), config.parallel
    g = p.tp if p.sequence_parallel else 1
    tokens = config.train.micro_batch_size * d.seq / (p.cp * g)
    a = act_bytes(config)
    counts = pp_layer_counts(config)
    v = pp_rank + chunk * p.pp
    layers = list(range(sum(counts[:v]), sum(counts[:v + 1])))
    last = pp_rank == p.pp - 1 and chunk == vpp_size(config) - 1
    if last:
        layers += list(range(config.model.num_layers, config.model.num_layers + d.mtp))
    peaks = [0.0]
    if last:
        peaks.append(tokens * planner_memory.loss_backward_bytes(config))
    recompute = config.train.recompute
    for n, i in enumerate(layers):
        if i in d.kda or (d.dsa and i not in d.mamba | d.deltanet):
            # The layers after it, the heads and the losses have freed what they kept.
            freed = sum(planner_memory.layer_activation_bytes(config, j, recompute) for j in layers[n + 1:])
            if last and i >= config.model.num_layers:
                # An MTP depth's block: the depths after it and its own head and loss have
                # run their backward; the model's head has not.
                later = d.mtp - (i - config.model.num_layers) - 1
                freed += later * planner_memory.mtp_activation_bytes(config) / d.mtp \
                    + planner_memory.head_activation_bytes(config)
            elif last:
                freed += planner_memory.head_activation_bytes(config) + planner_memory.mtp_activation_bytes(config)
            working = planner_memory.kda_backward_bytes(config, recompute) if i in d.kda else \
                planner_memory.dsa_backward_bytes(config, i, recompute)
            peaks.append(tokens * (working - freed))
        if not d.moe_flags[i]:
            rebuilt = (planner_memory.layer_activation_bytes(config, i, "none")
                       - planner_memory.layer_activation_bytes(config, i, recompute))
            peaks.append(tokens * (rebuilt + a * d.hidden * g + a * d.ffn * g / p.tp)
                         + (a * d.hidden * d.ffn / p.tp if accumulating else 0))
    if any(d.moe_flags[i] for i in layers):
        held = uniform_routing(config).held_etp  # rows this rank computes
        expert = max((e.numel for e in manifest if e.kind == "expert"), default=0)
        fc1 = 2 * a * d.expert_ffn / etp_size(config)  # a row's fc1 output
        rerun = recompute in ("full", "moe")
        row = a * d.expert_width  # an expert row (latent-wide in a latent MoE)
        peaks.append(held * (fc1 + row) + (a * expert if accumulating else 0))
        if rerun:
            peaks.append(held * (2 * row + 1.5 * fc1))
    return max(peaks)


def forward_peak_bytes(config: Config, pp_rank: int, chunk: int) -> float:
    """What a rank of stage ``pp_rank`` holds above what model chunk ``chunk`` keeps while
    a layer of it runs its forward under ``full`` recompute: the checkpointed part's
    tensors, alive until it returns though none is kept (the whole block of a dense layer;
    the attention or Gated DeltaNet mixer of an MoE layer as its forward ends,
    :func:`moe_fold.planner.memory.mixer_forward_bytes`); the largest layer's."""
    if config.train.recompute != "full":
        return 0.0
    d, p = dims(config), config.parallel
    g = p.tp if p.sequence_parallel else 1
    tokens = config.train.micro_batch_size * d.seq / (p.cp * g)
    counts = pp_layer_counts(config)
    v = pp_rank + chunk * p.pp
    layers = list(range(sum(counts[:v]), sum(counts[:v + 1])))
    if pp_rank == p.pp - 1 and chunk == vpp_size(config) - 1:
        layers += list(range(config.model.num_layers, config.model.num_layers + d.mtp))
    out = 0.0
    for i in layers:
        if d.moe_flags[i]:
            out = max(out, planner_memory.mixer_forward_bytes(config, i))
        else:
            out = max(out, planner_memory.layer_activation_bytes(config, i, "none")
                      - planner_memory.layer_activation_bytes(config, i, "full"))
    return tokens * out


def activation_peak_bytes(config: Config, pp_rank: int, micro: int, manifest: list[ParamEntry]) -> float:
    """The most activation bytes a rank of stage ``pp_rank`` holds at once over a step of
    ``micro`` micro-batches: its pipeline schedule run step by step, each forward adding
    what its chunk keeps (:func:`chunk_activation_bytes`) with its working memory on top
    while it runs (:func:`forward_peak_bytes`), each backward holding its working memory
    (:func:`backward_peak_bytes`) on top before it frees them. The chunks of one stage
    keep different amounts (the embedding, dense layers, the head), so which chunks are in
    flight at the peak matters, not only how many.

    Under pp the schedule (:func:`moe_fold.parallel.pipeline.run_schedule`, the program
    :func:`moe_fold.parallel.pipeline_schedules.make_plan` gives) also holds hidden states
    ``[s/(cp g), b, H]`` (``g``: tp under sequence parallelism) between the stages: each
    chunk's output until its backward (the one sent on; no layer of the chunk keeps it),
    a received activation from its exchange until its forward (which then keeps it as the
    chunk's input), a received grad until its backward ends, and the grad of a chunk's
    input from its backward until the exchange that sends it."""
    kept = chunk_activation_bytes(config, pp_rank)
    rebuilt = [forward_peak_bytes(config, pp_rank, c) for c in range(len(kept))]
    # A chunk's first backward writes its weights' gradients; the later ones add to them.
    working = {(c, later): backward_peak_bytes(config, pp_rank, c, manifest, later)
               for c in range(len(kept)) for later in (False, True)}
    done: set[int] = set()
    p = config.parallel
    live = peak = 0.0
    if p.pp == 1:
        for step in rank_order(pipeline_schedule(config), p.pp, vpp_size(config), micro, pp_rank):
            if step.kind == "F":
                live += kept[0]
                peak = max(peak, live + rebuilt[0])
            else:
                peak = max(peak, live + working[0, 0 in done])
                done.add(0)
                live -= kept[0]
        return peak
    d = dims(config)
    g = p.tp if p.sequence_parallel else 1
    hidden = act_bytes(config) * config.train.micro_batch_size * d.seq / (p.cp * g) * d.hidden
    last = p.pp * vpp_size(config) - 1
    for item in _pipeline_plan(pipeline_schedule(config), p.pp, vpp_size(config), micro).programs[pp_rank]:
        if isinstance(item, Exchange):
            for msg in item.messages:
                if msg.dst == pp_rank:
                    live += hidden  # received: kept until its step
                elif msg.kind == "grad":
                    live -= hidden  # the grad of a chunk's input, sent
            peak = max(peak, live)
            continue
        c = item.stage // p.pp
        output = hidden if item.stage < last else 0.0
        received = hidden if item.stage > 0 else 0.0
        if item.kind == "F":
            live += kept[c] - received + output
            peak = max(peak, live + rebuilt[c])
        else:
            peak = max(peak, live + working[c, c in done])
            done.add(c)
            # Its kept tensors, its output and the grad it received go; its input's grad waits to be sent.
            live -= kept[c] + 2 * output - received
    return peak


_pipeline_plan = functools.lru_cache(maxsize=64)(make_plan)


def _memory_moe_fold(config: Config, world: int, pp_rank: int, micro: int, assumptions: Assumptions,
                     manifest: list[ParamEntry]) -> dict[str, float]:
    """:func:`_memory` for moe-fold's own footprint (:mod:`moe_fold.planner.memory`)."""
    local = sum(e.numel for e in manifest)
    full = planner_memory.state_bytes(config, manifest, local)
    sharded = planner_memory.state_bytes(config, manifest, busiest_owned_numel(config, world, pp_rank, manifest))
    state = sharded if config.optimizer.distributed else full
    # The gradient reduction's buffers come after the schedule has freed every activation.
    activations = max(activation_peak_bytes(config, pp_rank, micro, manifest),
                      planner_memory.step_buffer_bytes(config, world, pp_rank, manifest))
    weights = state["weights"] + state["master_weights"]
    # The gradient reduction frees each bf16 grad as it writes the float32 main grad
    # (GradSync.wait, bucket by bucket): the two never all live at once, and the most
    # alive is the main grads' (moe-fold dryrun measures it).
    grads = max(state["grads"], state["main_grads"])
    total = weights + grads + state["optimizer"] + activations + assumptions.memory_overhead
    return {"weights": weights, "grads": grads, "optimizer": state["optimizer"], "activations": activations,
            "overhead": assumptions.memory_overhead, "total": total,
            "optimizer_not_distributed": full["optimizer"], "optimizer_distributed": sharded["optimizer"],
            "master_weights": state["master_weights"], "main_grads": state["main_grads"]}


@dataclass(frozen=True)
class RoutingSkew:
    """Measured routing as the planner uses it (:mod:`moe_fold.planner.loads`): per MoE
    block of the model, in layer order (MTP blocks last), the busiest ep rank's expert rows
    over the mean of the ranks: averaged over the steps (``time``, what every step waits
    for) and at the worst step (``peak``, what its memory must hold)."""
    time: tuple[float, ...]
    peak: tuple[float, ...]

    def stage(self, config: Config, pp_rank: int, which: str) -> list[float]:
        """The factors of the MoE blocks of stage ``pp_rank`` (``which``: time | peak)."""
        d = dims(config)
        moe = [i for i in range(len(d.moe_flags)) if d.moe_flags[i]]
        values = getattr(self, which)
        if len(values) != len(moe):
            raise ValueError(f"the routing skew has {len(values)} MoE layers, the model has {len(moe)}")
        position = {layer: n for n, layer in enumerate(moe)}
        return [values[position[i]] for i in stage_blocks(config, pp_rank) if d.moe_flags[i]]


def _skewed_routing(config: Config, factors: list[float]) -> list[Routing]:
    """The busiest rank's :class:`Routing` per MoE layer: it sends its own tokens' rows as
    under balanced routing and holds ``factor`` times the mean rows (dropless all-to-all)."""
    base = uniform_routing(config)
    ep = config.parallel.ep
    rows = base.held
    return [Routing(sent=base.sent, received=max(0.0, rows * f - rows / ep), held=rows * f,
                    held_etp=base.held_etp * f, meta=base.meta) for f in factors]


def _stage_compute(config: Config, r: int, gpu: GPU, assumptions: Assumptions, rate: float,
                   factors: Optional[list[float]]) -> tuple[float, float]:
    """(seconds, FLOPs) one rank of stage ``r`` computes per micro-batch; ``factors``: the
    busiest rank's expert rows over the mean per MoE layer of the stage (None: balanced)."""
    t = config.train
    flops = rank_flops_per_microbatch(config, r, t.recompute)
    if assumptions.compute_model == "shapes":
        seconds = microbatch_compute(config, r, t.recompute, gpu, assumptions.matmul_efficiency,
                                     assumptions.elementwise_passes, assumptions.attention_kernel,
                                     assumptions.gemm_dtype, expert_rows=factors,
                                     k_overhead=assumptions.gemm_k_overhead)["total"]
    else:
        seconds = flops / rate
        if factors:
            d, p = dims(config), config.parallel
            local = t.micro_batch_size * d.seq / (p.tp * p.cp)
            reruns = {"full": 1.0, "moe": 1.0, "expert_act": 1 / 3}.get(t.recompute, 0.0)
            moe = [i for i in stage_blocks(config, r) if d.moe_flags[i]]
            extra = sum((f - 1) * (3 + reruns) * local * layer_forward_flops(config, i)["experts"]
                        for i, f in zip(moe, factors))
            seconds += extra / rate
    return seconds, flops


def estimate(config: Config, world: int, gpu: GPU, assumptions: Assumptions = Assumptions(),
             skew: Optional[RoutingSkew] = None) -> Plan:
    """The :class:`Plan` of ``config``'s layout on ``world`` GPUs of kind ``gpu``.
    ``skew``: measured routing (:class:`RoutingSkew`); the step then waits for the busiest
    ep rank's experts and all-to-all, and memory holds its rows (dropless all-to-all).
    Raises :class:`moe_fold.config.ConfigError` for a layout ``validate`` rejects."""
    validate(config, world)
    p, t = config.parallel, config.train
    dp, edp, etp, v = dp_size(config, world), edp_size(config, world), etp_size(config), vpp_size(config)
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    layout = _layout(world, p.tp, p.cp, p.pp, p.ep, etp, p.order)
    links = _links(layout, gpu)
    rate = gpu.peak_flops * assumptions.matmul_efficiency
    skewed = skew is not None and p.ep > 1 and config.moe.dispatcher == "alltoall" and not config.moe.dedup \
        and not (config.moe.pad_to_capacity and config.moe.capacity_factor is not None)
    if skew is not None and not skewed:
        raise ValueError("measured routing (skew) is modelled for the dropless all-to-all dispatcher with "
                         "parallel.ep > 1 only")

    stages = []
    for r in range(p.pp):
        factors = skew.stage(config, r, "time") if skewed else None
        compute_s, flops = _stage_compute(config, r, gpu, assumptions, rate, factors)
        sent = microbatch_bytes(config, world, r, t.recompute,
                                _skewed_routing(config, factors) if factors is not None else None,
                                assumptions.implementation)
        comm = {k: _seconds(k, sent[k], links, gpu) for k in sent if k in _CRITICAL}
        if assumptions.overlap == "megatron" and v > 1:
            # Megatron's interleaved schedule posts its sends and receives behind the
            # next chunk's compute (--overlap-p2p-communication, on by default).
            comm.pop("pp", None)
        a2a = comm.get("ep", 0.0)
        if a2a:
            # The overlap hides the all-to-all behind this stage's own achieved FLOP rate.
            comm["ep"] = exposed_ep_seconds(config, r, a2a, flops / compute_s)
        stages.append((compute_s + sum(comm.values()), flops, comm, r, a2a, compute_s))
    slowest = max(stages, key=lambda stage: stage[0])
    per_micro, flops_micro, comm_micro, r_slow, a2a_micro, compute_micro = slowest

    routing = [_skewed_routing(config, skew.stage(config, r_slow, "time"))] * micro if skewed else None
    step = step_bytes(config, world, r_slow, routing=routing, implementation=assumptions.implementation)
    grad_overlap, gather_overlap = overlaps(config, assumptions)
    # What one micro-batch's backward (about 2/3 of its FLOPs) and forward (1/3) on the
    # slowest stage leave to hide the gradient reduction and the parameter gather behind.
    windows = {"grads": 2 / 3 * compute_micro, "params": 1 / 3 * compute_micro}
    exposed = {}
    for kind in _DATA_PARALLEL:
        if kind not in step:
            continue
        nbytes = step[kind] - (micro * microbatch_bytes(config, world, r_slow, t.recompute,
                                                        routing[0] if routing else None,
                                                        assumptions.implementation).get(kind, 0))
        n = 2 if kind == "embedding" else len(layout.groups(_GROUP_OF[kind])[0])
        seconds = _seconds(kind, nbytes, links, gpu)
        # Of the bytes: the all-reduce's, or the reduce-scatter's and the all-gather's halves.
        gather = seconds / 2 if config.optimizer.distributed and kind != "embedding" else 0.0
        parts = {"grads": (seconds - gather, grad_overlap), "params": (gather, gather_overlap)}
        for part, (s_part, hidden) in parts.items():
            if s_part <= 0:
                continue
            if hidden and kind != "embedding":
                # Every bucket but one runs behind compute as long as the window lasts.
                bucket = _seconds(kind, GRAD_BYTES * config.parallel.grad_bucket_numel * (n - 1) / n, links, gpu)
                s_part = min(s_part, max(bucket, s_part - windows[part]))
            exposed[f"{kind} {part}"] = s_part

    manifests = [param_manifest(config, r) for r in range(p.pp)]
    manifest = manifests[r_slow]
    local = sum(e.numel for e in manifest)
    experts = sum(e.numel for e in manifest if e.kind == "expert")
    owned = local
    if config.optimizer.distributed:
        owned = (local - experts) / (dp * p.cp) + experts / edp
    optimizer_s = owned * assumptions.optimizer_bytes_per_param / gpu.hbm_bw

    bubble = (p.pp - 1) / v * per_micro
    time = {"compute": micro * compute_micro}
    for kind, s in comm_micro.items():
        time[kind] = micro * s
    time["bubble"] = bubble
    for kind, seconds in exposed.items():
        time[f"{kind} (exposed)"] = seconds
    time["optimizer"] = optimizer_s
    time["total"] = micro * per_micro + bubble + sum(exposed.values()) + optimizer_s

    memories = [_memory(config, world, r, micro, assumptions, manifests[r]) for r in range(p.pp)]
    if skewed:
        # The busiest rank holds more expert rows than the mean in every micro-batch in flight.
        rows = uniform_routing(config).held_etp
        per_row = planner_memory.held_row_bytes(config, t.recompute)
        for r, m in enumerate(memories):
            extra = sum(f - 1 for f in skew.stage(config, r, "peak")) * rows * per_row \
                * microbatches_in_flight(config, r, micro)
            m["activations"] += extra
            m["total"] += extra
            m["skew_activations"] = extra
    memory = max(memories, key=lambda m: m["total"])
    memory = dict(memory, limit=gpu.memory, stage=memories.index(memory))
    model_flops = model_flops_per_step(config)
    counts = model_params(config)
    counts["rank_max"] = max(sum(e.numel for e in m) for m in manifests)
    notes = []
    if act_bytes(config) == 4:
        notes.append("train.precision=fp32: activations counted at 4 bytes, step time still at the bf16 peak")
    if assumptions.implementation == "moe-fold" and (p.cp > 1 or config.moe.capacity_factor is not None
                                                     or config.moe.dedup or config.moe.dispatcher != "alltoall"):
        notes.append("memory: cp > 1, capacity, dedup and the all-gather dispatcher are estimated with the "
                     "one-cp-rank, dropless all-to-all terms (moe_fold.planner.memory)")
    return Plan(
        gpu=gpu.name, world=world,
        layout={"tp": p.tp, "cp": p.cp, "pp": p.pp, "vpp": v, "ep": p.ep, "etp": etp, "dp": dp, "edp": edp,
                "mbs": t.micro_batch_size, "gbs": t.global_batch_size, "seq": config.model.seq_length},
        recompute=t.recompute, distributed_optimizer=config.optimizer.distributed, microbatches=micro,
        params=counts, memory=memory, fits=memory["total"] <= gpu.memory,
        flops={"model_per_step": model_flops, "rank_per_step": micro * flops_micro,
               "model_per_rank_per_s": model_flops / world / time["total"]},
        comm_bytes=step, comm_links={k: links[_GROUP_OF[k]][2] for k in step},
        time=time, mfu=model_flops / (world * gpu.peak_flops * time["total"]), notes=notes,
        implementation=assumptions.implementation,
        overlaps=[name for name, on in (("grad_reduce", grad_overlap), ("param_gather", gather_overlap)) if on],
        overlap_model=assumptions.overlap,
        moe_overlap={"shared_expert_overlap": config.moe.shared_expert_overlap,
                     "overlap_chunks": config.moe.overlap_chunks, "ep_a2a_s": micro * a2a_micro,
                     "ep_a2a_exposed_s": micro * comm_micro.get("ep", 0.0)},
        compute={"model": assumptions.compute_model, "matmul_efficiency": assumptions.matmul_efficiency,
                 **({"elementwise_passes": assumptions.elementwise_passes, "attention_kernel":
                     assumptions.attention_kernel, "gemm_dtype": assumptions.gemm_dtype,
                     "gemm_k_overhead": assumptions.gemm_k_overhead}
                    if assumptions.compute_model == "shapes" else {})},
        routing={"busiest_over_mean_time": list(skew.time), "busiest_over_mean_peak": list(skew.peak)}
        if skewed else {})


def _divisors(n: int, limit: int) -> list[int]:
    return [k for k in range(1, min(n, limit) + 1) if n % k == 0]


def search(config: Config, world: int, gpu: GPU, assumptions: Assumptions = Assumptions(),
           max_tp: int = 8, max_cp: int = 8, max_vpp: int = 8,
           skew_for: Optional[Callable[[int], Optional[RoutingSkew]]] = None) -> list[Plan]:
    """Every layout of ``world`` that ``validate`` accepts (tp, cp, pp, vpp, ep, etp in
    {1, tp}; micro and global batch, sequence, recompute and optimizer from ``config``),
    that fits in ``gpu.memory``, best estimated MFU first. ``skew_for(ep)``: measured
    routing for a layout of that ep size (:func:`moe_fold.planner.loads.skew_by_ep`); each
    layout is then estimated on its busiest ep rank, and must fit with that rank's memory."""
    d = dims(config)
    plans = []
    for tp in _divisors(world, max_tp):
        for cp in _divisors(world // tp, max_cp):
            for pp in _divisors(world // (tp * cp), d.layers):
                for vpp in ([1] if pp == 1 else _divisors(d.layers // pp if d.layers % pp == 0 else 1, max_vpp)):
                    for ep in _divisors(max(d.experts, 1), world // pp):
                        for etp in sorted({1, tp}):
                            if world % (etp * ep * pp):
                                continue
                            candidate = with_layout(config, tp=tp, cp=cp, pp=pp, vpp=vpp, ep=ep, etp=etp)
                            candidate.parallel.pp_layers = None
                            try:
                                plan = estimate(candidate, world, gpu, assumptions,
                                                skew=skew_for(ep) if skew_for else None)
                            except (ConfigError, ValueError):
                                continue
                            if plan.fits:
                                plans.append(plan)
    plans.sort(key=lambda plan: -plan.mfu)
    return plans

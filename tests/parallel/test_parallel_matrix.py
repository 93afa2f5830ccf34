"""Everything composes: context parallel (ring and a2a) and pipeline parallel (1f1b and
interleaved, tied embeddings) folded with tp, dp, ep and etp train the same model as one
process, with standard attention and with multi-head latent attention (MLA_MODEL).

A tiny Mixtral-like model (4 MoE layers, 8 experts top-2, GQA, aux and z losses, the
all-to-all dispatcher, dropless) trains three steps of :class:`moe_fold.training.optim.AdamW`
after ``sync_grads`` and global-norm clipping (every layout with its state sharded over
dp x cp and edp, ZeRO-1; the reference unsharded), every layout through
:func:`moe_fold.training.step.forward_backward` (its micro-batches: its dp rank's rows of the
global batch, cut into micro-batches, each sliced to its cp zigzag shard). It must give
one process's losses, first-step gradients (gathered to global tensors over tp, ep, etp
and pp) and gradient norms.

The reference runs the same global batch on one process as the layout's ``dp x m``
micro-batches (the router's losses are per micro-batch and per dp rank, see
tests/parallel/test_layout_invariance.py), accumulating grads by hand with the router's
``loss_scale = 1/(dp*m)`` and the main loss normalised by the global count of unmasked
tokens. The loss mask leaves out a different number of tokens in every row, so cp and dp
ranks hold unequal counts and the normalisation is tested for exactness.
"""

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe_fold.comm import all_reduce_
from moe_fold.config import Config, ModelConfig, OptimizerConfig, ParallelConfig
from moe_fold.data.loader import Batch
from moe_fold.training.grads import clip_grad_norm_, sync_grads
from moe_fold.launch import run_ranks
from moe_fold.layout import GROUP_NAMES, ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.gated_deltanet import GatedDeltaNet
from moe_fold.models.model import build_model, compile_blocks
from moe_fold.parallel.sharding import full_tensor, shard_info
from moe_fold.training.optim import AdamW, apply_gradients, build_grad_sync, build_optimizer, param_groups
from moe_fold.training.step import forward_backward
from tests.helpers.pipeline_union import unite_over_pp
from tests.helpers.router_outputs import max_dropped_fraction, router_outputs
from tests.parallel.test_layout_invariance import _global_grads
from tests.models.test_mla import MLA_MODEL

VOCAB, HIDDEN, LAYERS, SEQ, BATCH, STEPS, LR, MAX_NORM = 64, 32, 4, 16, 4, 3, 1e-2, 0.5

GPTOSS_ATTENTION = dict(attention_sinks=True, sliding_window=5, local_attention_layers=[1, 0, 1, 0])
LLAMA4_ATTENTION = dict(attention_chunk=6, local_attention_layers=[1, 1, 1, 0], rope_layers=[1, 1, 1, 0],
                        qk_norm=True, qk_norm_scope="l2", attn_temperature_tuning=True, attn_temperature_floor=4)

QWEN3_NEXT_LAYERS = dict(layer_types=["gated_deltanet", "gated_deltanet", "gated_deltanet", "attention"],
                         attn_output_gate=True, norm_zero_centred=True, qk_norm=True, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=6, linear_value_head_dim=5,
                         linear_conv_kernel=4, linear_chunk_size=3)

# Kimi-Linear's layers: KDA in three of four layers, MLA without rotary (latent norms eps 1e-6)
# in the fourth; sigmoid routing with the expert bias, scaled.
KIMI_LINEAR_LAYERS = dict(layer_types=["kda", "kda", "kda", "attention"], attention="mla", num_kv_heads=4,
                          kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, rope_layers=[0] * 4,
                          mla_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=6,
                          linear_value_head_dim=6, linear_conv_kernel=4, linear_chunk_size=3,
                          moe=dict(score_function="sigmoid", expert_bias=True, scaling_factor=2.5))
# Nemotron-H's layers: one mixer each (Mamba2, relu2 MoE with the sigmoid expert bias and
# an ungated relu2 shared expert, attention without rotary, a relu2 MLP); Mamba2 4 heads of 6
# in 2 groups, state 5, chunks of 3. The initial steps (dt 0.001 to 0.1) keep the decays
# slow, so a state not passed along cp or not reset at a document start shows.
NEMOTRON_H_LAYERS = dict(layer_types=["mamba2", "moe", "attention", "mlp"], block="single_mixer",
                         rope_layers=[0, 0, 0, 0], mlp_activation="relu2", mamba_num_heads=4, mamba_head_dim=6,
                         mamba_state_size=5, mamba_num_groups=2, mamba_conv_kernel=4, mamba_chunk_size=3,
                         moe=dict(activation="relu2", score_function="sigmoid", expert_bias=True,
                                  shared_expert_ffn_hidden_size=40))

# Nemotron 3 Super's latent MoE on Nemotron-H's layers: the experts in a latent width of 20
# (hidden 32), the tokens projected before the dispatch and back after the combine.
NEMOTRON_LATENT = dict(NEMOTRON_H_LAYERS, moe=dict(NEMOTRON_H_LAYERS["moe"], latent_size=20))

# LongCat-Flash's router: 4 zero-computation experts after the 8 held ones, top-3 of the
# softmax over all 12 plus the expert bias, scaled weights (the bias's update across ranks:
# tests/dispatch/test_router_parallel.py).
LONGCAT_ZERO = dict(moe=dict(zero_experts=4, topk=3, pre_softmax=True, expert_bias=True, scaling_factor=1.5))

# DeepSeek Sparse Attention on MLA: an indexer of 3 heads of 6 keeping 5 keys per query, its KL
# weighted 0.5; GLM-5's form rotates the indexer's interleaved pairs and shares layer 0's and
# layer 2's selections with the layers after them.
DSA_LAYERS = dict(MLA_MODEL, dsa=True, index_n_heads=3, index_head_dim=6, index_topk=5, dsa_indexer_loss_weight=0.5)
GLM5_LAYERS = dict(DSA_LAYERS, index_rope_interleave=True, indexer_types=["full", "shared", "full", "shared"])
# Stages [0, 1] [2, 3] under pp 2: the second begins with a shared layer (layer 1's selection);
# one layer a stage under pp 2 x vpp 2: layers 1 and 2 share layer 0's, passed on by stage 1.
GLM5_BOUNDARY = dict(GLM5_LAYERS, indexer_types=["full", "full", "shared", "shared"])
GLM5_PASS_THROUGH = dict(GLM5_LAYERS, indexer_types=["full", "shared", "shared", "full"])
# LongCat-Flash's blocks (model.block=shortcut_moe): two MLA sublayers, each with a dense MLP,
# and the shortcut MoE with its zero experts; MLA's LoRA scaling and latent epsilon.
LONGCAT_BLOCK = dict(MLA_MODEL, block="shortcut_moe", mla_lora_scale=True, mla_norm_eps=1e-6, **LONGCAT_ZERO)

# name -> (world, layout sizes, micro-batches per rank, parallel config, model overrides).
# tp > 1 implies SP; etp defaults to tp.
CASES = {
    # 2 ranks
    "cp2-ring": (2, dict(cp=2), 2, dict(cp_kind="ring"), {}),
    "cp2-a2a-ep2": (2, dict(cp=2, ep=2), 2, dict(cp_kind="a2a"), {}),
    "pp2-tied": (2, dict(pp=2), 4, dict(), dict(tie_embeddings=True)),
    "mla-cp2-ring": (2, dict(cp=2), 2, dict(cp_kind="ring"), MLA_MODEL),
    # 4 ranks
    "pp2-ep2-dp2": (4, dict(pp=2, ep=2), 2, dict(), {}),
    "pp2-vpp2-ep2-dp2-tied": (4, dict(pp=2, ep=2), 2, dict(vpp=2, pp_schedule="interleaved"),
                              dict(tie_embeddings=True)),
    "pp2-cp2-ring-ep2": (4, dict(pp=2, cp=2, ep=2), 2, dict(cp_kind="ring"), {}),
    # Multi-head latent attention: interleaved pipeline, a2a cp folded with tp + SP.
    "mla-pp2-vpp2-ep2-dp2": (4, dict(pp=2, ep=2), 2, dict(vpp=2, pp_schedule="interleaved"), MLA_MODEL),
    "mla-cp2-a2a-tp2": (4, dict(cp=2, tp=2), 2, dict(cp_kind="a2a"), MLA_MODEL),
    # 8 ranks
    "pp2-tp2-ep2-dp2-edp2": (8, dict(pp=2, tp=2, ep=2, etp=1), 2, dict(), {}),
    "cp2-a2a-tp2-ep4-dp2-edp2": (8, dict(cp=2, tp=2, ep=4, etp=1), 2, dict(cp_kind="a2a"), {}),
    # Multi-token prediction (2 depths), on packed documents where the name says so.
    "mtp-tp2-etp2-packed": (2, dict(tp=2), 2, dict(), dict(mtp_num_layers=2)),
    "mtp-cp2-ring-packed": (2, dict(cp=2), 2, dict(cp_kind="ring"), dict(mtp_num_layers=2)),
    "mtp-cp2-a2a-ep2-packed": (2, dict(cp=2, ep=2), 2, dict(cp_kind="a2a"), dict(mtp_num_layers=2)),
    "mtp-pp2-vpp2-ep2-dp2": (4, dict(pp=2, ep=2), 2, dict(vpp=2, pp_schedule="interleaved"),
                             dict(mtp_num_layers=2)),
    "mtp-pp2-tp2-ep2-etp1-packed": (4, dict(pp=2, tp=2, ep=2, etp=1), 2, dict(), dict(mtp_num_layers=2)),
    # MTP on a DeepSeek-V3-shaped model (MLA with a low-rank query, interleaved rotary pairs).
    "mtp-mla-cp2-a2a-ep2-packed": (2, dict(cp=2, ep=2), 2, dict(cp_kind="a2a"), dict(
        mtp_num_layers=1, attention="mla", num_kv_heads=4, q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6,
        qk_rope_head_dim=4, v_head_dim=5, rope_interleave=True)),
    # OLMoE's QK-norm over the whole (tp-split) projections, GLM-4.5's partial rotary.
    "tp2-qknorm-projection-partial-rotary": (2, dict(tp=2), 2, dict(), dict(
        qk_norm=True, qk_norm_scope="projection", partial_rotary_factor=0.5)),
    # ERNIE-4.5: interleaved rotary pairs in standard attention; the expert bias on the
    # softmax over all experts and the top-k renormalised over max(sum, 0.5) (the "moe" key
    # holds moe settings).
    "family-ernie-tp2-cp2-a2a-ep2-packed": (4, dict(tp=2, cp=2, ep=2, etp=1), 2, dict(cp_kind="a2a"), dict(
        rope_interleave=True, moe=dict(pre_softmax=True, expert_bias=True, topk_norm_min=0.5))),
    # Issue 29's attention features: gpt-oss's sinks with sliding and full layers alternating,
    # Llama-4's chunked layers, NoPE layer, L2 QK-norm and temperature tuning (floor 4, so the
    # factor changes inside these short sequences).
    "attn-gptoss-cp2-ring-packed": (2, dict(cp=2), 2, dict(cp_kind="ring"), GPTOSS_ATTENTION),
    "attn-gptoss-tp2-ep2-etp1": (2, dict(tp=2, ep=2, etp=1), 2, dict(), GPTOSS_ATTENTION),
    "attn-llama4-cp2-a2a-ep2-packed": (2, dict(cp=2, ep=2), 2, dict(cp_kind="a2a"), LLAMA4_ATTENTION),
    "attn-gptoss-cp2-a2a-tp2-packed": (4, dict(cp=2, tp=2), 2, dict(cp_kind="a2a"), GPTOSS_ATTENTION),
    "attn-llama4-pp2-cp2-ring-ep2-packed": (4, dict(pp=2, cp=2, ep=2), 2, dict(cp_kind="ring"), LLAMA4_ATTENTION),
    "attn-llama4-tp2-ep2-etp1-dp2": (4, dict(tp=2, ep=2, etp=1), 2, dict(), LLAMA4_ATTENTION),
    # Qwen3-Next's layers: Gated DeltaNet in three of four layers (state and conv window
    # passed along cp in sequence order, reset at documents), gated attention in the fourth,
    # zero-centred norms.
    "gdn-cp2-ring-packed": (2, dict(cp=2), 2, dict(cp_kind="ring"), QWEN3_NEXT_LAYERS),
    "gdn-tp2-ep2-etp1": (2, dict(tp=2, ep=2, etp=1), 2, dict(), QWEN3_NEXT_LAYERS),
    "gdn-pp2-cp2-ring-ep2-packed": (4, dict(pp=2, cp=2, ep=2), 2, dict(cp_kind="ring"), QWEN3_NEXT_LAYERS),
    "gdn-tp2-cp2-a2a-ep2-packed": (4, dict(tp=2, cp=2, ep=2, etp=1), 2, dict(cp_kind="a2a"), QWEN3_NEXT_LAYERS),
    # Kimi-Linear's layers: KDA (per-channel decays; state and conv window passed along cp in
    # sequence order, reset at documents) and NoPE MLA, under ring and a2a cp, tp + SP, pp, ep.
    "kda-cp2-ring-packed": (2, dict(cp=2), 2, dict(cp_kind="ring"), KIMI_LINEAR_LAYERS),
    "kda-tp2-ep2-etp1": (2, dict(tp=2, ep=2, etp=1), 2, dict(), KIMI_LINEAR_LAYERS),
    "kda-pp2-cp2-a2a-ep2-packed": (4, dict(pp=2, cp=2, ep=2), 2, dict(cp_kind="a2a"), KIMI_LINEAR_LAYERS),
    "kda-tp2-cp2-ring-ep2-packed": (4, dict(tp=2, cp=2, ep=2, etp=1), 2, dict(cp_kind="ring"), KIMI_LINEAR_LAYERS),
    # Nemotron-H's single-mixer layers with Mamba2 (its state and conv window passed along
    # cp in sequence order, reset at documents).
    "m2-cp2-ring-packed": (2, dict(cp=2), 2, dict(cp_kind="ring"), NEMOTRON_H_LAYERS),
    "m2-tp2-ep2-etp1": (2, dict(tp=2, ep=2, etp=1), 2, dict(), NEMOTRON_H_LAYERS),
    "m2-cp2-a2a-ep2-dp2-packed": (4, dict(cp=2, ep=2), 2, dict(cp_kind="a2a"), NEMOTRON_H_LAYERS),
    "m2-pp2-cp2-ring-ep2-packed": (4, dict(pp=2, cp=2, ep=2), 2, dict(cp_kind="ring"), NEMOTRON_H_LAYERS),
    "m2-tp2-cp2-a2a-ep2-packed": (4, dict(tp=2, cp=2, ep=2, etp=1), 2, dict(cp_kind="a2a"), NEMOTRON_H_LAYERS),
    # The latent MoE (Nemotron 3 Super): latent rows dispatched over ep and gathered over etp,
    # the projections replicated (summed over tp under SP), pp splitting the layers.
    "latent-ep2": (2, dict(ep=2), 2, dict(), NEMOTRON_LATENT),
    "latent-tp2-etp2": (2, dict(tp=2), 2, dict(), NEMOTRON_LATENT),
    "latent-pp2-ep2-dp2": (4, dict(pp=2, ep=2), 2, dict(), NEMOTRON_LATENT),
    "latent-tp2-ep2-etp2-packed": (4, dict(tp=2, ep=2), 2, dict(), NEMOTRON_LATENT),
    # Zero-computation experts (LongCat-Flash): never dispatched, added where the token is.
    "zero-ep2": (2, dict(ep=2), 2, dict(), LONGCAT_ZERO),
    "zero-tp2-ep2-etp1": (2, dict(tp=2, ep=2, etp=1), 2, dict(), LONGCAT_ZERO),
    "zero-tp2-ep2-etp1-dp2-packed": (4, dict(tp=2, ep=2, etp=1), 2, dict(), LONGCAT_ZERO),
    # DSA: under cp a rank's queries select among every visible key of the whole sequence
    # (indexer keys, keys and values gathered over cp); the indexer is replicated over tp.
    "dsa-cp2-ring-packed": (2, dict(cp=2), 2, dict(cp_kind="ring"), DSA_LAYERS),
    "dsa-glm5-cp2-a2a-ep2-packed": (2, dict(cp=2, ep=2), 2, dict(cp_kind="a2a"), GLM5_LAYERS),
    "dsa-glm5-tp2-ep2-etp1": (2, dict(tp=2, ep=2, etp=1), 2, dict(), GLM5_LAYERS),
    "dsa-glm5-pp2-cp2-ring-ep2-packed": (4, dict(pp=2, cp=2, ep=2), 2, dict(cp_kind="ring"), GLM5_LAYERS),
    "dsa-warmup-tp2-cp2-a2a": (4, dict(tp=2, cp=2), 2, dict(cp_kind="a2a"), dict(DSA_LAYERS,
                                                                                    dsa_stage="dense_warmup")),
    # GLM-5's shared layers beginning pipeline stages: the boundary carries the selection of the
    # last full layer before it (through a stage of shared layers only, under vpp), sliced over
    # tp under SP and gathered back.
    "dsa-glm5-boundary-pp2-cp2-ring-ep2-packed": (4, dict(pp=2, cp=2, ep=2), 2, dict(cp_kind="ring"),
                                                  GLM5_BOUNDARY),
    "dsa-glm5-boundary-pp2-vpp2-ep2-dp2": (4, dict(pp=2, ep=2), 2, dict(vpp=2, pp_schedule="interleaved"),
                                           GLM5_PASS_THROUGH),
    "dsa-glm5-boundary-pp2-tp2-ep2-etp1": (4, dict(pp=2, tp=2, ep=2, etp=1), 2, dict(), GLM5_BOUNDARY),
    # LongCat-Flash's shortcut-connected MoE blocks.
    "longcat-tp2-ep2-etp1": (2, dict(tp=2, ep=2, etp=1), 2, dict(), LONGCAT_BLOCK),
    "longcat-pp2-cp2-ring-ep2-packed": (4, dict(pp=2, cp=2, ep=2), 2, dict(cp_kind="ring"), LONGCAT_BLOCK),
    "longcat-tp2-cp2-a2a-ep2-packed": (4, dict(tp=2, cp=2, ep=2, etp=1), 2, dict(cp_kind="a2a"), LONGCAT_BLOCK),
}

# Documents (lengths) of each row of the packed global batch; a row's documents fill it.
ROW_DOCS = [[5, 11], [16], [3, 6, 7], [9, 7]]


def _config(model=None, **parallel):
    config = Config()
    model = dict(model or {})
    moe = model.pop("moe", {})
    config.model = ModelConfig(**{**dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4,
                                         num_kv_heads=2, ffn_hidden_size=48, seq_length=SEQ, init_std=0.1),
                                  **model})
    c = config.moe
    c.num_experts, c.topk, c.ffn_hidden_size = 8, 2, 32
    c.aux_loss_coeff, c.z_loss_coeff = 0.1, 0.01
    c.dispatcher, c.capacity_factor = "alltoall", None
    for key, value in moe.items():
        setattr(c, key, value)
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    config.train.seed = 11
    return config


# The MoE layer's overlap (moe.shared_expert_overlap, moe.overlap_chunks): name -> (world,
# layout sizes, micro-batches per rank, moe settings), each trained with every MOE_OVERLAPS
# variant, with a gated shared expert to overlap. Capacity drops where tp = 1 (each rank
# routes one of the reference's micro-batches, as in tests/parallel/test_layout_invariance.py); under
# tp > 1 a rank routes part of a sequence, so there the factor is too large to drop.
SHARED = dict(shared_expert_ffn_hidden_size=40, shared_expert_gate=True)
MOE_OVERLAP_CASES = {
    "ep2": (2, dict(ep=2), 2, {}),
    "ep2-allgather-capacity-drop": (2, dict(ep=2), 2, dict(dispatcher="allgather", capacity_factor=1.0)),
    "ep4-dedup-capacity-drop": (4, dict(ep=4), 1, dict(capacity_factor=1.0, dedup=True)),
    "etp2-ep2": (4, dict(tp=2, ep=2, etp=2), 2, {}),
    "tp2-ep2-allgather": (4, dict(tp=2, ep=2, etp=1), 2, dict(dispatcher="allgather", capacity_factor=8.0)),
    "pp2-ep2-capacity-drop": (4, dict(pp=2, ep=2), 2, dict(capacity_factor=1.0)),
}
MOE_OVERLAPS = {"off": {}, "shared": dict(shared_expert_overlap=True),
                "shared-chunks2": dict(shared_expert_overlap=True, overlap_chunks=2)}


def _case(name):
    """``(world, sizes, micro-batches, parallel, model)`` of a CASES or MOE_OVERLAP_CASES name."""
    if name in MOE_OVERLAP_CASES:
        world, sizes, m, _ = MOE_OVERLAP_CASES[name]
        return world, sizes, m, {}, {}
    return CASES[name]


def _case_config(name, moe_overlap="off"):
    _, sizes, _, parallel, model = _case(name)
    config = _config(model, tp=sizes.get("tp", 1), cp=sizes.get("cp", 1), pp=sizes.get("pp", 1),
                     ep=sizes.get("ep", 1), etp=sizes.get("etp"), sequence_parallel=sizes.get("tp", 1) > 1,
                     **parallel)
    if name in MOE_OVERLAP_CASES:
        for key, value in {**SHARED, **MOE_OVERLAP_CASES[name][3], **MOE_OVERLAPS[moe_overlap]}.items():
            setattr(config.moe, key, value)
    return config


def _global_batch():
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    # Row r leaves out its first 3r labels: every row, and every zigzag chunk, counts differently.
    mask = (torch.arange(SEQ)[None, :] >= 3 * torch.arange(BATCH)[:, None]).float()
    return tokens, tokens.roll(-1, dims=1), mask


def _rows(first, count, packed=False):
    """Rows ``[first, first+count)`` of the global batch as a :class:`Batch`; ``packed``:
    the rows hold the documents of :data:`ROW_DOCS` (positions restart at each, the
    label after a document's last token is masked)."""
    tokens, labels, mask = (t[first:first + count] for t in _global_batch())
    positions = torch.arange(SEQ).expand(count, SEQ).contiguous()
    cu = torch.arange(0, count * SEQ + 1, SEQ, dtype=torch.int32)
    if packed:
        positions, starts = positions.clone(), []
        for r, docs in enumerate(ROW_DOCS[first:first + count]):
            edges = np.cumsum([0] + docs)
            for a, b in zip(edges[:-1], edges[1:]):
                positions[r, a:b] = torch.arange(b - a)
                mask[r, b - 1] = 0.0
                starts.append(r * SEQ + int(a))
        cu = torch.tensor(starts + [count * SEQ], dtype=torch.int32)
    return Batch(tokens, labels, mask, positions, cu)


def _micro_batches(dp_rank, dp, m, packed=False):
    """Micro-batches of dp rank ``dp_rank``: its ``BATCH/dp`` rows in ``m`` consecutive blocks."""
    size = BATCH // (dp * m)
    return [_rows((dp_rank * m + i) * size, size, packed) for i in range(m)]


def _pp_gathered(model, groups):
    """Global grads of the whole model on every rank: :func:`_global_grads` of each stage,
    united over pp (the two copies of a tied embedding must agree)."""
    return unite_over_pp(_global_grads(model, groups), groups)


def _tied_copies_differ(model, groups):
    """Largest difference between the first and last stages' embedding shards (0.0 when
    not tied over pp)."""
    if groups.size("pp") == 1 or not model.config.model.tie_embeddings:
        return 0.0
    parts = [None] * groups.size("pp")
    mine = model.embed.weight.detach().clone() if model.embed is not None else None
    dist.all_gather_object(parts, mine, group=groups.pp)
    return (parts[0] - parts[-1]).abs().max().item()


def _train_layout(model, groups, config, micro_batches, watch_routers=True):
    """``watch_routers``: hook the routers for the fraction dropped (not on compiled blocks,
    which would inline the hook and recompile as its list grows)."""
    opt = AdamW(param_groups(model, 0.1), lr=LR, groups=groups, distributed=True)
    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        opt.zero_grad()
        with router_outputs(model) if watch_routers else contextlib.nullcontext([]) as seen:
            losses = forward_backward(model, micro_batches, groups, config)
        sync_grads(model.parameters(), groups)
        if step == 0:
            out["grads"] = _pp_gathered(model, groups)
        out["norms"].append(clip_grad_norm_(model.parameters(), MAX_NORM, groups).item())
        loss = all_reduce_(losses.sum(), groups.dp_cp) / groups.size("dp_cp")
        out["losses"].append(loss.item())
        opt.step()
    out["tied_diff"] = _tied_copies_differ(model, groups)
    out["stages"] = model.stages
    if watch_routers:
        out["dropped"] = max_dropped_fraction(seen)  # the last step's forwards
    return out


# name -> (optimizer.distributed, parallel.overlap_grad_reduce, parallel.overlap_param_gather):
# the training loop's own path (forward_backward with its GradSync, apply_gradients) with
# buckets of OVERLAP_BUCKET elements, several per model chunk.
OVERLAP_VARIANTS = {
    "allreduce": (False, False, False),
    "allreduce_overlap": (False, True, False),
    "zero": (True, False, False),
    "zero_overlap": (True, True, True),
}
OVERLAP_BUCKET = 3000


def _build(config, groups):
    """The rank's model. Gated DeltaNet layers get slow decays (exp(A_log) = 0.05, dt_bias =
    -2: about 0.01 per token): at their initial rates (1 to 16 per token) a cp segment
    forgets its start state, and a state not composed along cp would not show. Mamba2
    layers keep their initial steps (dt 0.001 to 0.1, about 0.04 per token): a state not
    passed along cp shows there as it is."""
    model = build_model(config, groups)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, GatedDeltaNet):
                layer.A_log.fill_(math.log(0.05))
                layer.dt_bias.fill_(-2.0)
    return model


def _train_loop_path(config, groups, micro_batches, distributed, overlap_grad, overlap_param):
    """STEPS steps as :func:`moe_fold.training.train.train` runs them; the losses, grad
    norms and final global parameters."""
    model = _build(config, groups)
    opt_config = OptimizerConfig(lr=LR, weight_decay=0.1, beta1=0.9, beta2=0.999, eps=1e-8, distributed=distributed)
    opt = build_optimizer(model, opt_config, groups, bucket_numel=OVERLAP_BUCKET, overlap_param_gather=overlap_param)
    sync = build_grad_sync(model, opt, groups, bucket_numel=OVERLAP_BUCKET, overlap=overlap_grad)
    # the whole schedule under one constant rate: AdamW's lr, as in _train_layout
    for group in opt.param_groups:
        group["lr"] = LR
    out = {"losses": [], "norms": []}
    for _ in range(STEPS):
        opt.zero_grad()
        losses = forward_backward(model, micro_batches, groups, config, grad_sync=sync)
        out["norms"].append(apply_gradients(model.parameters(), opt, groups, MAX_NORM, grad_sync=sync).item())
        out["losses"].append((all_reduce_(losses.sum(), groups.dp_cp) / groups.size("dp_cp")).item())
    opt.wait_params()
    out["params"] = unite_over_pp({n: full_tensor(p.detach(), shard_info(p, groups, n), groups).numpy()
                                   for n, p in model.named_parameters()}, groups)
    out["tied_diff"] = _tied_copies_differ(model, groups)
    return out


def _rank(rank, world_size, names, moe_overlap="off", compiled=False):
    """Train every case of ``names`` in turn: starting ranks costs more than a case. Each
    also through the training loop's path in every OVERLAP_VARIANTS (not the MoE overlap
    cases, whose variants are MOE_OVERLAPS). ``compiled``: every block compiled as
    ``train.compile=blocks`` compiles it (fullgraph, the ``aot_eager`` backend), the loop's
    variants left out."""
    groups_of, results = {}, []
    for name in names:
        sizes = _case(name)[1]
        key = tuple(sorted(sizes.items()))
        if key not in groups_of:
            groups_of[key] = create_process_groups(ParallelLayout(world_size, **sizes))
        groups = groups_of[key]
        config = _case_config(name, moe_overlap)
        model = _build(config, groups)
        m, cp = _case(name)[2], groups.size("cp")
        micro = [b.cp_slice(groups.rank_in("cp"), cp)
                 for b in _micro_batches(groups.rank_in("dp"), groups.size("dp"), m, name.endswith("packed"))]
        if compiled:
            compile_blocks(model, backend="aot_eager")
            with torch._dynamo.config.patch(capture_scalar_outputs=True):
                results.append(_train_layout(model, groups, config, micro, watch_routers=False))
            continue
        result = _train_layout(model, groups, config, micro)
        if name not in MOE_OVERLAP_CASES:
            result["loop"] = {variant: _train_loop_path(config, groups, micro, *switches)
                              for variant, switches in OVERLAP_VARIANTS.items()}
        results.append(result)
    return results


def _moe_overlap_rank(rank, world_size, names):
    """Every MOE_OVERLAPS variant of every case: ``{variant: results}``."""
    return {overlap: _rank(rank, world_size, names, overlap) for overlap in MOE_OVERLAPS}


_REFERENCES: dict = {}


def _reference(name):
    """One process: the layout's dp x m micro-batches, accumulated by hand."""
    world, sizes, m, _, model_overrides = _case(name)
    num_micro = world // (sizes.get("tp", 1) * sizes.get("cp", 1) * sizes.get("pp", 1)) * m
    config = _case_config(name)
    config.parallel = ParallelConfig()
    key = (repr(config), num_micro, name.endswith("packed"))
    if key in _REFERENCES:
        return _REFERENCES[key]
    groups = ProcessGroups.single_process()
    model = _build(config, groups)
    micro = _micro_batches(0, 1, num_micro, name.endswith("packed"))
    num_loss_tokens = sum(b.loss_mask.sum() for b in micro)
    docs = [model.documents(b.cu_seqlens, None, tuple(b.tokens.shape)) for b in micro]
    mtp = [None] * len(micro)
    if model.mtp is not None:
        # Each depth's loss is its mean over the global batch: its own global target count.
        mtp = [model.mtp_targets(b.tokens, b.labels, b.loss_mask, d) for b, d in zip(micro, docs)]
        for t in mtp:
            t.num_tokens = sum(u.mask.sum(dim=(1, 2)) for u in mtp)
    opt = AdamW(param_groups(model, 0.1), lr=LR)
    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        opt.zero_grad()
        loss = 0.0
        for b, d, t in zip(micro, docs, mtp):
            mb_loss = model(b.tokens, b.labels, positions=b.positions, loss_mask=b.loss_mask,
                            num_loss_tokens=num_loss_tokens, docs=d, mtp=t, loss_scale=1.0 / num_micro)
            mb_loss.backward()
            loss += mb_loss.item()
        if step == 0:
            out["grads"] = _global_grads(model, groups)
        out["norms"].append(clip_grad_norm_(model.parameters(), MAX_NORM, groups).item())
        out["losses"].append(loss)
        opt.step()
    _REFERENCES[key] = out
    return out


def _check(names, results):
    for i, name in enumerate(names):
        ref = _reference(name)
        assert ref["norms"][0] > MAX_NORM, f"{name}: clipping is not exercised"
        assert ref["losses"][-1] < ref["losses"][0], name
        # The Gated DeltaNet and KDA models are sensitive to rounding: the gated norm rescales each
        # head's small output to unit RMS (init grad norm ~200), so float32 sums in another
        # order (SP's reduce-scatter, cp's composed segment states) move its grads by ~1e-5 of
        # their largest, though its layers under tp and cp equal one process to 1e-14 in
        # float64 (tests/parallel/test_recurrent_cp.py). And Adam's first step moves every weight
        # by lr times its grad's sign, flipping on grads below 1e-7, so later steps differ by
        # ~1e-2 between any two float32 orders: only its first step is compared, with a
        # tolerance scaled to each tensor's largest grad (with _build's slow decays, a state
        # not passed along cp, or one segment's state alone passed on, is off by 6,000 times it;
        # KDA's own initial decays are slow: softplus(dt_bias) in [1e-3, 0.1] per channel).
        gdn = name in LAYER_TYPES or name in KDA_LAYERS or name in MAMBA2
        steps, rtol = (1, 1e-4) if gdn else (STEPS, 1e-5)
        for rank, per_rank in enumerate(results):
            got, where = per_rank[i], f"{name} rank {rank}"
            assert got["grads"].keys() == ref["grads"].keys(), where
            for pname, g in ref["grads"].items():
                assert np.abs(g).max() > 0, f"{where}: reference grad {pname} is zero"
                atol = 1e-4 * float(np.abs(g).max()) if gdn else 2e-6
                torch.testing.assert_close(torch.from_numpy(got["grads"][pname]), torch.from_numpy(g),
                                           rtol=1e-4, atol=atol, msg=lambda m: f"{where} grad {pname}: {m}")
            torch.testing.assert_close(got["norms"][:steps], ref["norms"][:steps], rtol=rtol, atol=0,
                                       msg=lambda m: f"{where} grad norms: {m}")
            torch.testing.assert_close(got["losses"][:steps], ref["losses"][:steps], rtol=rtol, atol=0,
                                       msg=lambda m: f"{where} losses: {m}")
            assert got["tied_diff"] == 0.0, f"{where}: tied embedding copies drifted apart"
            # the MoE overlap cases skip the loop's variants; tests/dispatch/test_placement.py checks its runs without them
            loop = got.get("loop", {})
            # each overlap reduces the same buckets in the same order: the same bits
            for on, off in (("allreduce_overlap", "allreduce"), ("zero_overlap", "zero")) if loop else ():
                assert loop[on]["losses"] == loop[off]["losses"], f"{where} {on}"
                assert loop[on]["norms"] == loop[off]["norms"], f"{where} {on}"
                for pname, value in loop[off]["params"].items():
                    assert (loop[on]["params"][pname] == value).all(), f"{where} {on} {pname}"
            for variant, run in loop.items():
                torch.testing.assert_close(run["norms"][:steps], ref["norms"][:steps], rtol=rtol, atol=0,
                                           msg=lambda m: f"{where} {variant} grad norms: {m}")
                torch.testing.assert_close(run["losses"][:steps], ref["losses"][:steps], rtol=rtol, atol=0,
                                           msg=lambda m: f"{where} {variant} losses: {m}")
                assert run["tied_diff"] == 0.0, f"{where} {variant}: tied embedding copies drifted apart"


# Issue 20's cases: multi-token prediction, and OLMoE's / GLM-4.5's attention variants.
ISSUE_20 = {name for name in CASES if name.startswith("mtp-") or name == "tp2-qknorm-projection-partial-rotary"}
# Issue 29's: the model features of the families it added (ERNIE-4.5's).
ISSUE_20 |= {name for name in CASES if name.startswith("family-")}


ISSUE_29 = {name for name in CASES if name.startswith("attn-")}


LAYER_TYPES = {name for name in CASES if name.startswith("gdn-")}


KDA_LAYERS = {name for name in CASES if name.startswith("kda-")}


ZERO_EXPERTS = {name for name in CASES if name.startswith("zero-")}
MAMBA2 = {name for name in CASES if name.startswith("m2-")}
LATENT = {name for name in CASES if name.startswith("latent-")}


DSA = {name for name in CASES if name.startswith("dsa-")}


LONGCAT = {name for name in CASES if name.startswith("longcat-")}


def _names(world, issue_20=False, issue_29=False, layer_types=False, zero_experts=False, kda=False, longcat=False,
           dsa=False, mamba2=False, latent=False):
    return [name for name, case in CASES.items()
            if case[0] == world and (name in ISSUE_20) == issue_20 and (name in ISSUE_29) == issue_29
            and (name in LAYER_TYPES) == layer_types and (name in ZERO_EXPERTS) == zero_experts
            and (name in KDA_LAYERS) == kda and (name in LONGCAT) == longcat and (name in DSA) == dsa
            and (name in MAMBA2) == mamba2 and (name in LATENT) == latent]


@pytest.mark.parametrize("world", [2, 4])
def test_cp_and_pp_layouts_match_single_process(world):
    names = _names(world)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_mtp_and_attention_variants_match_single_process(world):
    """MTP (tp+SP with etp, ring and a2a cp on packed documents, MLA, pp with vpp, ep), the
    projection-wide QK-norm with partial rotary under tp, and ERNIE-4.5's interleaved rotary
    and softmax expert bias with a renormalisation floor under tp x cp x ep on packed documents."""
    names = _names(world, issue_20=True)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_new_attention_features_match_single_process(world):
    """Sinks with sliding/full layers, and Llama-4's chunked + NoPE + L2 QK-norm +
    temperature tuning, under ring and a2a cp (packed documents), tp + SP, pp and ep."""
    names = _names(world, issue_29=True)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_gated_deltanet_layers_match_single_process(world):
    """Qwen3-Next's layer types (Gated DeltaNet, gated attention, zero-centred norms) under
    cp (ring and a2a, packed documents), tp + SP, pp and ep."""
    names = _names(world, layer_types=True)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_kda_layers_match_single_process(world):
    """Kimi-Linear's layer types (KDA, MLA without rotary) under cp (ring and a2a, packed
    documents), tp + SP, pp and ep."""
    names = _names(world, kda=True)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_mamba2_layers_match_single_process(world):
    """Nemotron-H's single-mixer layers (Mamba2, relu2 MoE and MLP, attention without rotary)
    under cp2 (ring and a2a, packed documents; cp4 would leave segments of 2 tokens, shorter
    than the conv window: tests/parallel/test_recurrent_cp.py runs the layer on cp4), tp + SP,
    pp and ep."""
    names = _names(world, mamba2=True)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_latent_moe_matches_single_process(world):
    """Nemotron 3 Super's latent MoE (moe.latent_size) on Nemotron-H's layers under ep, tp + SP
    with the experts over etp, pp with ep and dp, and tp x ep with etp on packed documents."""
    names = _names(world, latent=True)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_zero_experts_match_single_process(world):
    """LongCat-Flash's zero-computation experts (with its softmax expert bias and scaling)
    under ep, tp + SP with ep over the tp ranks, and dp on packed documents."""
    names = _names(world, zero_experts=True)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_dsa_matches_single_process(world):
    """DeepSeek Sparse Attention (the sparse stage, GLM-5's shared selections and interleaved
    indexer rotary, the dense warm-up) under ring and a2a cp on packed documents, tp + SP,
    pp and ep: the loss, and every gradient, the indexer's KL-trained ones included."""
    names = _names(world, dsa=True)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_shortcut_moe_blocks_match_single_process(world):
    """LongCat-Flash's blocks (two MLA sublayers with their dense MLPs, the shortcut MoE with
    zero experts) under tp + SP with ep over the tp ranks, pp x ring cp and tp x a2a cp on
    packed documents."""
    names = _names(world, longcat=True)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.slow
def test_eight_rank_cp_and_pp_layouts_match_single_process():
    names = _names(8)
    _check(names, run_ranks(_rank, 8, names, timeout=400))


@pytest.mark.parametrize("world", [2, 4])
def test_moe_overlap_matches_no_overlap_and_single_process(world):
    """The shared-expert overlap gives the blocking layer's losses, grads and norms bit for
    bit (the same operations in the same order); with two chunks the expert GEMMs and their
    weight grads are summed per chunk: fp32 rounding. Every variant matches one process."""
    names = [name for name, case in MOE_OVERLAP_CASES.items() if case[0] == world]
    results = run_ranks(_moe_overlap_rank, world, names, timeout=400)
    for overlap in MOE_OVERLAPS:
        _check(names, [per_rank[overlap] for per_rank in results])
    for rank, per_rank in enumerate(results):
        for i, name in enumerate(names):
            off, where = per_rank["off"][i], f"{name} rank {rank}"
            assert (off["dropped"] > 0) == name.endswith("-drop"), f"{where}: dropped {off['dropped']}"
            for overlap, tol in (("shared", dict(rtol=0, atol=0)), ("shared-chunks2", dict(rtol=1e-5, atol=1e-7))):
                got = per_rank[overlap][i]
                assert got["dropped"] == off["dropped"], f"{where} {overlap}"
                for pname, g in off["grads"].items():
                    torch.testing.assert_close(torch.from_numpy(got["grads"][pname]), torch.from_numpy(g), **tol,
                                               msg=lambda m: f"{where} {overlap} grad {pname}: {m}")
                torch.testing.assert_close(got["norms"], off["norms"], **tol, msg=lambda m: f"{where} {overlap}: {m}")
                torch.testing.assert_close(got["losses"], off["losses"], **tol,
                                           msg=lambda m: f"{where} {overlap}: {m}")


# Compiled blocks (train.compile=blocks, docs/gpu.md "Compiled blocks"): every block one
# graph, its collectives torch's functional collectives (cp's a2a and ep's all-to-all with
# the count exchange's unbacked splits, tp's SP mappings, the router's all-reduces), pp's
# sends between the compiled blocks. Ring cp is not among them (docs/gpu.md says why).
COMPILED_CASES = ["cp2-a2a-ep2", "pp2-tied", "tp2-qknorm-projection-partial-rotary", "longcat-tp2-ep2-etp1",
                  "dsa-glm5-cp2-a2a-ep2-packed", "dsa-glm5-tp2-ep2-etp1"]


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED_CASES)
def test_compiled_blocks_match_single_process(name):
    """ep 2 with a2a cp 2, pp 2 with tied embeddings, tp 2 + SP, LongCat-Flash's blocks under
    tp 2 + SP x ep 2, GLM-5's DSA layers (shared selections, the indexer's KL) under cp 2 on
    packed documents (keys gathered over cp) and tp 2 + SP x ep 2: with every block compiled,
    one process's losses, grads and grad norms at the matrix's tolerances."""
    _check([name], run_ranks(_rank, 2, [name], compiled=True, timeout=600))


# --------------------------------------------------------------------------- one process

def _stage_groups(world, rank, **sizes):
    """A rank's groups of a layout, sizes only: building a model needs no communication
    (without tied embeddings)."""
    return ProcessGroups(ParallelLayout(world, **sizes), rank, {kind: None for kind in GROUP_NAMES})


@pytest.mark.parametrize("vpp, pp_layers, expected", [
    (1, None, [[[0, 1]], [[2, 3]]]),
    (2, None, [[[0], [2]], [[1], [3]]]),
    (1, [1, 3], [[[0]], [[1, 2, 3]]]),
])
def test_pipeline_stages_hold_their_layers_under_global_names(vpp, pp_layers, expected):
    config = _config(vpp=vpp, pp_layers=pp_layers)
    whole = dict(build_model(config, ProcessGroups.single_process()).named_parameters())
    seen = {}
    for r in range(2):
        model = build_model(config, _stage_groups(2, r, pp=2))
        assert model.stage_layer_ids == expected[r]
        assert [i for ids in expected[r] for i in ids] == [int(n) for n in model.layers._modules]
        assert (model.embed is not None) == (r == 0)
        assert (model.lm_head is not None) == (r == 1)
        for name, p in model.named_parameters():
            assert name not in seen, f"{name} on two stages"
            seen[name] = p
    assert seen.keys() == whole.keys()
    for name, p in whole.items():  # the same global weights, whatever the split
        torch.testing.assert_close(seen[name], p, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_pipeline_stage_refuses_whole_model_calls():
    model = build_model(_config(), _stage_groups(2, 0, pp=2))
    b = _rows(0, 2)
    with pytest.raises(RuntimeError, match=r"Transformer.forward runs a whole model.*stages \[0\] of 2"):
        model(b.tokens, b.labels)
    with pytest.raises(RuntimeError, match=r"Transformer.logits runs a whole model"):
        model.logits(b.tokens)


def test_cp_kind_is_checked():
    config = _config(cp_kind="ulysses")
    with pytest.raises(ValueError, match=r"parallel.cp_kind=ulysses must be one of ring, a2a"):
        build_model(config, ProcessGroups.single_process())

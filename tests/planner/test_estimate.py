"""The layout planner's arithmetic: parameter counts equal the real model's, communication
bytes equal the counters of a real training step on gloo ranks, and hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from moe_fold import comm
from moe_fold.config import config_from_dict, list_presets, load_config
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.planner.comm import Routing, step_bytes, uniform_routing
from moe_fold.planner.model import param_manifest

from tests.helpers.router_outputs import router_outputs

# Two layouts of world 4 with every group kind the MoE step uses:
# "etp2": tp 2 (SP), ep 2, etp 2 -> dp 2, edp 1; distributed optimizer; qk-norm, a gated
#         shared expert, z-loss and the global aux loss; one dense and one MoE layer; one
#         MTP depth (an MoE block, like the last layer).
# "etp1": tp 2 (SP), ep 2, etp 1 -> dp 2, edp 2; experts padded to capacity, so every
#         split is known from the config: the planner's uniform rows are exact; OLMoE's
#         QK-norm over the whole (tp-split) q and k projections.
LAYOUTS = {
    "etp2": {
        "model": {"qk_norm": True, "mtp_num_layers": 1},
        "moe": {"moe_layer_freq": [0, 1], "shared_expert_ffn_hidden_size": 32, "shared_expert_gate": True,
                "z_loss_coeff": 1e-3, "global_aux_loss_coeff": 1e-3},
        "parallel": {"tp": 2, "ep": 2, "sequence_parallel": True},
        "optimizer": {"distributed": True},
    },
    "etp1": {
        "model": {"qk_norm": True, "qk_norm_scope": "projection"},
        "moe": {"moe_layer_freq": 1, "capacity_factor": 1.5, "pad_to_capacity": True},
        "parallel": {"tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True},
    },
    # "mla": "etp1" with multi-head latent attention (its latents, not the hidden states,
    # gathered over tp), a dense first layer and an ungated shared expert.
    "mla": {
        "model": {"attention": "mla", "num_kv_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 10,
                  "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5},
        "moe": {"moe_layer_freq": [0, 1], "capacity_factor": 1.5, "pad_to_capacity": True,
                "shared_expert_ffn_hidden_size": 32},
        "parallel": {"tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True},
    },
}


def _config(name: str):
    base = {
        "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 64, "seq_length": 16},
        "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 32},
        "train": {"micro_batch_size": 2, "global_batch_size": 8},
    }
    for section, values in LAYOUTS[name].items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


def _train_step(rank: int, world: int, names: list[str]) -> dict:
    """One training step (forward and backward of every micro-batch, then
    apply_gradients) per layout, inside the byte counter; also this rank's parameters
    and the per-expert token counts of every MoE layer and micro-batch."""
    from moe_fold.models.model import build_model
    from moe_fold.training.optim import apply_gradients, build_optimizer

    out = {}
    for name in names:
        config = _config(name)
        p = config.parallel
        groups = create_process_groups(ParallelLayout(world, tp=p.tp, ep=p.ep, etp=p.etp))
        model = build_model(config, groups)
        optimizer = build_optimizer(model, config.optimizer, groups)
        t = config.train
        micro = t.global_batch_size // (t.micro_batch_size * groups.size("dp"))
        gen = torch.Generator().manual_seed(100 + groups.rank_in("dp"))
        counts = []
        with comm.count_bytes() as sent:
            for _ in range(micro):
                ids = torch.randint(0, config.model.vocab_size, (t.micro_batch_size, config.model.seq_length),
                                    generator=gen)
                mtp = None
                if model.mtp is not None:
                    # Every rank's rows are whole and unmasked: each depth's count is known
                    # without the per-micro-batch all-reduce (training counts once per step).
                    mtp = model.mtp_targets(ids, ids, None, None)
                    mtp.num_tokens = mtp.mask.sum(dim=(1, 2)) * groups.size("dp")
                with router_outputs(model) as seen:
                    loss = model(ids, ids, mtp=mtp)
                counts.append([out.stats.tokens_per_expert.tolist() for _, out in seen])
                loss.backward()
            apply_gradients(list(model.parameters()), optimizer, groups, config.optimizer.clip_grad)
        params = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
        out[name] = {"sent": dict(sent), "counts": counts, "params": params}
    return out


@pytest.fixture(scope="module")
def gloo_step():
    return run_ranks(_train_step, 4, list(LAYOUTS), timeout=300)


def _measured_routing(layout: ParallelLayout, counts: list, rank: int, num_experts: int) -> list[list[Routing]]:
    """Rows of each MoE layer and micro-batch on ``rank`` from every rank's per-expert
    counts: the dispatcher sends a rank's rows for other ep ranks' experts, receives its
    ep peers' rows for its own experts (peers share its etp rank), and all-gathers the
    rows it holds over its etp group."""
    local = num_experts // layout.ep

    def mine(r):
        j = layout.coords(r)["ep"]
        return range(j * local, (j + 1) * local)

    def held(r, mb, layer):
        return sum(counts[q][mb][layer][e] for q in layout.group_of("ep", r) for e in mine(r))

    out = []
    for mb in range(len(counts[rank])):
        layers = []
        for layer in range(len(counts[rank][mb])):
            own = counts[rank][mb][layer]
            sent = sum(own) - sum(own[e] for e in mine(rank))
            received = held(rank, mb, layer) - sum(own[e] for e in mine(rank))
            held_etp = sum(held(t, mb, layer) for t in layout.group_of("etp", rank))
            layers.append(Routing(sent, received, held(rank, mb, layer), held_etp, meta=4))
        out.append(layers)
    return out


def test_step_bytes_equal_counters_with_measured_routing(gloo_step):
    config = _config("etp2")
    layout = ParallelLayout(4, tp=2, ep=2)
    counts = [r["etp2"]["counts"] for r in gloo_step]
    for rank in range(4):
        shard_ranks = {g: layout.group_of(g, rank).index(rank) for g in ("dp_cp", "tp_dp_cp", "edp")}
        planned = step_bytes(config, 4, routing=_measured_routing(layout, counts, rank, 4), shard_ranks=shard_ranks)
        measured = gloo_step[rank]["etp2"]["sent"]
        assert set(planned) == set(measured), rank
        for kind, nbytes in measured.items():
            assert planned[kind] == nbytes, (rank, kind)
    # Every kind of the folded MoE step is there.
    assert set(gloo_step[0]["etp2"]["sent"]) == {"tp", "tp_cp", "tp_dp_cp", "dp_cp", "ep", "etp", "etp_ep"}


@pytest.mark.parametrize("name", ["etp1", "mla"])
def test_step_bytes_equal_counters_padded_uniform(gloo_step, name):
    config = _config(name)
    # 2 x 16 tokens split over tp 2: 16 per rank. Padding makes every split
    # C = ceil(16 * 2 / 4 * 1.5) = 12 rows per expert and source rank whatever the router
    # picks, so the planner's default rows are the real ones: 4 experts x 12 = 48 rows,
    # half of them (the other ep rank's 2 experts) sent, as many received, 2 x 2 x 12 held.
    assert uniform_routing(config) == Routing(sent=24.0, received=24.0, held=48, held_etp=48, meta=4)
    for rank in range(4):
        planned = step_bytes(config, 4)
        measured = gloo_step[rank][name]["sent"]
        assert set(planned) == set(measured), rank
        for kind, nbytes in measured.items():
            assert planned[kind] == nbytes, (rank, kind)
    assert {"ep", "edp", "tp", "dp_cp"} <= set(gloo_step[0][name]["sent"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_params_equal_real_model_under_tp_ep(gloo_step, name):
    config = _config(name)
    planned = [(e.name, e.numel, e.kind) for e in param_manifest(config)]
    for rank in range(4):
        assert [tuple(x) for x in gloo_step[rank][name]["params"]] == planned


TINY = [name for name in list_presets() if name.endswith("-tiny")]


@pytest.mark.parametrize("preset", TINY)
def test_params_equal_single_process_model(preset):
    from moe_fold.models.model import build_model

    config = load_config(preset, ["parallel.tp=1", "parallel.ep=1", "parallel.etp=null", "parallel.pp=1",
                                  "parallel.cp=1", "parallel.vpp=null", "parallel.pp_schedule=1f1b"])
    model = build_model(config, ProcessGroups.single_process())
    real = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
    assert [(e.name, e.numel, e.kind) for e in param_manifest(config)] == real
    assert sum(e.numel for e in param_manifest(config)) == sum(q.numel() for q in model.parameters())


def test_params_with_attention_sinks_equal_single_process_model():
    """Attention sinks (issue 29) are one tp-split logit per query head in every layer."""
    from moe_fold.models.model import build_model

    config = load_config("mixtral-tiny", ["parallel.ep=1", "model.attention_sinks=true", "model.sliding_window=8"])
    model = build_model(config, ProcessGroups.single_process())
    real = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
    assert any(n.endswith("attn.sinks") for n, _, _ in real)
    assert [(e.name, e.numel, e.kind) for e in param_manifest(config)] == real


def _mtp_params_rank(rank: int, world: int, overrides: list[str]) -> list:
    from moe_fold.models.model import build_model

    config = load_config("mixtral-tiny", overrides)
    groups = create_process_groups(ParallelLayout(world, pp=config.parallel.pp))
    model = build_model(config, groups)
    return [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]


@pytest.mark.parametrize("tied", [False, True])
def test_mtp_params_equal_real_model_under_pp(tied):
    """With MTP the last stage holds the depths (and, untied, an embedding copy)."""
    overrides = ["model.mtp_num_layers=2", f"model.tie_embeddings={str(tied).lower()}", "parallel.ep=1",
                 "parallel.pp=2"]
    real = run_ranks(_mtp_params_rank, 2, overrides, timeout=120)
    config = load_config("mixtral-tiny", overrides)
    for rank in range(2):
        assert [(e.name, e.numel, e.kind) for e in param_manifest(config, rank)] == [tuple(x) for x in real[rank]]
    assert real[1][0][0] == "embed.weight" and any(n.startswith("mtp.1.block.mlp.experts") for n, _, _ in real[1])


# --------------------------------------------------------------------------- by hand

def _hand_config(**parallel):
    """V 16, H 8, 2 heads of 4 with 1 kv head, layer 0 dense (F 12), layer 1 MoE (4
    experts of width 6, top-2, a gated shared expert of width 4), seq 4, untied, bf16."""
    return config_from_dict({
        "model": {"vocab_size": 16, "hidden_size": 8, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                  "ffn_hidden_size": 12, "seq_length": 4},
        "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 6, "moe_layer_freq": [0, 1],
                "shared_expert_ffn_hidden_size": 4, "shared_expert_gate": True},
        "parallel": parallel,
        "train": {"micro_batch_size": 1, "global_batch_size": 2, "precision": "bf16"},
    })


def test_params_by_hand():
    from moe_fold.planner.estimate import model_params

    # embed 16*8 = 128
    # layer 0: norms 2*8 + qkv (8 + 2*4)*8 = 128 + proj 8*8 = 64 + fc1 2*12*8 = 192 + fc2 8*12 = 96 -> 496
    # layer 1: norms 16 + qkv 128 + proj 64 + gate 8 + router 4*8 = 32 + experts fc1 4*8*12 = 384,
    #          fc2 4*6*8 = 192 + shared fc1 2*4*8 = 64, fc2 8*4 = 32 -> 920
    # final norm 8, head 128: total 128 + 496 + 920 + 8 + 128 = 1680
    # activated: 1680 - 576 experts + 2/4 of them = 1392
    assert model_params(_hand_config()) == {"total": 1680, "experts": 576, "activated": 1392}
    # Two MTP depths: each norms 2*8 + eh_proj 8*16 = 128 + a block like layer 1 (920) + its norm 8
    config = _hand_config()
    config.model.mtp_num_layers = 2
    assert model_params(config)["total"] == 1680 + 2 * (16 + 128 + 920 + 8)
    # tp 2, ep 2, etp 1: embed 64; layer 0: 8 + 64 + 32 + 8 + 96 + 48 = 256;
    # layer 1: 8 + 64 + 32 + 8 + gate 8 + router 32 + 2 experts 2*8*12 + 2*6*8 = 288 + shared 32 + 16
    # = 488; norm 8, head 64 -> 880
    config = _hand_config(tp=2, ep=2, etp=1, sequence_parallel=True)
    assert sum(e.numel for e in param_manifest(config)) == 880


def test_flops_by_hand():
    from moe_fold.planner.model import head_forward_flops, layer_forward_flops, model_flops_per_step

    config = _hand_config()
    # layer 0: projections 2*8*16 + 2*8*8 = 384, core 4*seq 4*q 8 = 128, MLP 6*8*12 = 576
    assert layer_forward_flops(config, 0) == {"attention": 384, "core": 128, "mlp": 576, "router": 0.0,
                                              "experts": 0.0, "shared": 0.0}
    # layer 1: router 2*8*4 = 64, 2 experts 2*6*8*6 = 576, shared 6*8*4 + gate 2*8 = 208
    assert layer_forward_flops(config, 1) == {"attention": 384, "core": 128, "mlp": 0.0, "router": 64,
                                              "experts": 576, "shared": 208}
    assert head_forward_flops(config) == 2 * 8 * 16
    # 3 x (1088 + 1360 + 256) per token x 2 sequences x 4 tokens
    assert model_flops_per_step(config) == 3 * 2704 * 8
    # Two MTP depths: each an MoE block like layer 1 (1360), eh_proj 2*16*8 = 256 and a head 256.
    config.model.mtp_num_layers = 2
    assert layer_forward_flops(config, 3) == layer_forward_flops(config, 1)
    assert model_flops_per_step(config) == 3 * (2704 + 2 * (1360 + 256 + 256)) * 8


def test_hybrid_layers_projection_flops_are_their_weights():
    """Qwen3-Next's layers: a Gated DeltaNet layer's projections (q, k, v, z, beta, a in;
    out) and a gated attention layer's (q with its gate, k, v; out) are 2 FLOPs per weight
    per token, read off the built model's matrices; the chunked rule's core is counted
    from its chunk and state sizes."""
    from moe_fold.models.model import build_model
    from moe_fold.planner.model import layer_forward_flops

    config = load_config("qwen3-next-tiny", ["parallel.ep=1"])
    model = build_model(config, ProcessGroups.single_process())
    m = config.model
    assert set(m.layer_types) == {"gated_deltanet", "attention"}
    for i, layer in enumerate(model.layers):
        matrices = sum(q.numel() for n, q in layer.attn.named_parameters() if q.dim() == 2 and n != "conv_weight")
        flops = layer_forward_flops(config, i)
        assert flops["attention"] == 2 * matrices, (i, m.layer_types[i])
        if m.layer_types[i] == "gated_deltanet":
            dk, dv = m.linear_key_head_dim, m.linear_value_head_dim
            assert flops["core"] == m.linear_num_value_heads * (2 * m.linear_chunk_size * (dk + dv) + 6 * dk * dv)


def test_zero_experts_by_hand():
    """Zero experts (4 beside the 4 held, top-2): the router scores 8 columns, and a token
    sends 2 * 4/8 = 1 row on average, so expert FLOPs, activated parameters, expert
    activation rows and the rows on the wire all halve."""
    from moe_fold.planner.estimate import model_params
    from moe_fold.planner.memory import held_row_bytes, layer_activation_bytes
    from moe_fold.planner.model import held_rows_per_token, layer_forward_flops

    config, plain = _hand_config(), _hand_config()
    config.moe.zero_experts = 4
    assert held_rows_per_token(config) == 1.0 and held_rows_per_token(plain) == 2.0
    # router 2*8*8 = 128, 1 expert row 6*8*6 = 288, shared as before
    assert layer_forward_flops(config, 1) == {"attention": 384, "core": 128, "mlp": 0.0, "router": 128,
                                              "experts": 288, "shared": 208}
    # the router grows by 4*8 = 32 -> 1712; activated 1712 - 576 + 1/4 of the experts (144)
    assert model_params(config) == {"total": 1712, "experts": 576, "activated": 1280}
    # Activations: one expert row fewer (its kept bytes, 56 here, and the dispatcher's 16),
    # the router's 4 more columns (the top-k op's float32 logits and probs and bool map,
    # 9*4, the aux loss's float32 scores 4*4).
    assert held_row_bytes(plain, "none") == 56
    assert layer_activation_bytes(config, 1, "none") == layer_activation_bytes(plain, 1, "none") - (56 + 16) + 52
    # ep 2: a token's one held row leaves for the other rank half the time: 1 row sent and
    # 1 received per rank (2 tokens), each way, of H*a = 16 bytes, probs 4 bytes each way.
    config = _hand_config(tp=2, ep=2, etp=1, sequence_parallel=True)
    config.moe.zero_experts = 4
    assert step_bytes(config, 4)["ep"] == 2 * 2 * 16 + 2 * 2 * 4 // 2
    # aux-loss statistics over every column: 2*8 + 1 float64 over tp x cp = 2 ranks
    assert step_bytes(config, 4)["tp_cp"] == 8 * (2 * 8 + 1)


def test_zero_expert_params_equal_the_real_model():
    from moe_fold.models.model import build_model

    config = load_config("mixtral-tiny", ["parallel.ep=1", "moe.zero_experts=3"])
    model = build_model(config, ProcessGroups.single_process())
    real = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
    assert [(e.name, e.numel, e.kind) for e in param_manifest(config)] == real


def test_memory_by_hand():
    from moe_fold.planner.estimate import Assumptions, _memory
    from moe_fold.planner.model import head_activation_bytes, layer_activation_bytes

    config = _hand_config()
    # bf16 activations, a = 2. Attention per token: norm in 2*8 + qkv in 2*8 + q,k,v,out
    # 2*(2*8 + 2*4) + lse 4*2 heads + proj in 2*8 = 104; dense MLP: 16 + 16 + 3*2*12 = 104
    assert layer_activation_bytes(config, 0, "none") == 208
    # MoE: attention 104, norm in and out 32, router fp32 input 4*8 + logits/scores/probs 3*4*4 = 80,
    # 2 rows: inputs 2*2*8 = 32, fc1 out + SwiGLU out 2*3*2*6 = 72, shared 16 + 3*2*4 = 40, gated 16
    assert layer_activation_bytes(config, 1, "none") == 376
    # full recompute keeps the block input of a dense layer; of an MoE layer its attention
    # input, the norm, router and expert inputs and the gated shared output: 16+32+80+32+16
    assert layer_activation_bytes(config, 0, "full") == 16
    assert layer_activation_bytes(config, 1, "full") == 176
    # head: norm in 16 + head in 16 + logits (2 + 4) * 16
    assert head_activation_bytes(config) == 128

    # world 2: dp 2, edp 2, one micro-batch of 4 tokens each; Megatron's footprint
    memory = _memory(config, 2, 0, 1, Assumptions(memory_overhead=0, implementation="megatron"),
                     param_manifest(config))
    # the distributed optimizer shards the 12 bytes over dp (1104 dense) and edp (576 experts)
    assert memory == {"weights": 2 * 1680, "grads": 4 * 1680, "optimizer": 12 * 1680,
                      "activations": 4 * (208 + 376 + 128), "overhead": 0, "total": 18 * 1680 + 4 * 712,
                      "optimizer_not_distributed": 12 * 1680, "optimizer_distributed": 12 * (1104 / 2 + 576 / 2)}
    config.optimizer.distributed = True
    memory = _memory(config, 2, 0, 1, Assumptions(memory_overhead=0, implementation="megatron"),
                     param_manifest(config))
    assert memory["optimizer"] == 12 * (1104 / 2 + 576 / 2)
    assert memory["total"] == 6 * 1680 + 12 * (1104 / 2 + 576 / 2) + 4 * 712


def test_comm_by_hand():
    # world 4: tp 2 with SP, ep 2, etp 1 -> dp 2, edp 2; one micro-batch per rank.
    config = _hand_config(tp=2, ep=2, etp=1, sequence_parallel=True)
    got = step_bytes(config, 4)
    # One [s 4, b 1, H 8] bf16 activation X = 64 bytes; each gather or scatter over tp 2
    # moves X/2 = 32. Per column/row pair 4 * 32 = 128: attention and MLP of layer 0,
    # attention and shared expert of layer 1 -> 512; embedding 2*32, head 2*32; cross
    # entropy 3 all-reduces of 4*4 bytes over 2 ranks, 16 each -> 48; the grad norm's
    # float32 all-reduce 2*1*4//2 = 4.
    assert got["tp"] == 512 + 64 + 64 + 48 + 4
    # 2 tokens per rank route 4 rows, 2 of them to the other ep rank and 2 back in:
    # 2 (sent + received) * H*a = 2*4*16 = 128, probs 4 bytes each way: 16
    assert got["ep"] == 144
    # count exchange: 4 int64 counts to 1 peer; grad norm: its scalar and the squares of
    # fc1 and fc2 per global expert, (1 + 2 * 4) float32 over 2 ranks
    assert got["etp_ep"] == 8 * 4 + 4 * (1 + 2 * 4)
    # aux-loss statistics: 2*4 + 1 float64 over tp x cp = 2 ranks
    assert got["tp_cp"] == 72
    # grads (float32) over dp_cp = 2 ranks: the tp shards, 64 + 240 + 144 + 64 = 512 elements
    assert got["dp_cp"] == 4 * 512
    # tp_sum (norms, router, gate): 16 + 16 + 8 + 32 + 8 = 80 elements over tp*dp = 4 ranks
    assert got["tp_dp_cp"] == 2 * 3 * 4 * 80 // 4
    # experts: 288 elements over edp = 2 ranks
    assert got["edp"] == 4 * 288
    assert set(got) == {"tp", "ep", "etp_ep", "tp_cp", "dp_cp", "tp_dp_cp", "edp"}


def test_step_time_and_mfu_by_hand():
    from moe_fold.planner.estimate import Assumptions, estimate
    from moe_fold.planner.hardware import GPU

    # world 2 in one node, dp 2 and edp 2: the only traffic is the gradient all-reduce.
    config = _hand_config()
    gpu = GPU("toy", peak_flops=1e6, memory=1e9, hbm_bw=1e6, nvlink_bw=1e3, inter_node_bw=1e2)
    plan = estimate(config, 2, gpu, Assumptions(matmul_efficiency=0.5, memory_overhead=0))
    # each rank: one micro-batch of 4 tokens, 3 * 2704 FLOPs each, at 0.5 * 1e6 FLOP/s
    compute = 4 * 3 * 2704 / 0.5e6
    # float32 grads all-reduced over 2 ranks send B each: the dense ones over dp_cp, the
    # experts over edp, 4 * 1680 bytes in all, at NVLink's 1e3 B/s (one node)
    grads = 4 * 1680 / 1e3
    optimizer = 1680 * 30 / 1e6
    assert plan.time["compute"] == pytest.approx(compute)
    # the config leaves both overlaps off: every byte is exposed, as moe-fold runs it
    assert plan.overlaps == [] and plan.overlap_model == "moe-fold"
    assert plan.time["dp_cp grads (exposed)"] + plan.time["edp grads (exposed)"] == pytest.approx(grads)
    assert plan.time["total"] == pytest.approx(compute + grads + optimizer)
    assert plan.mfu == pytest.approx(3 * 2704 * 8 / (2 * 1e6 * plan.time["total"]))
    # Megatron's overlap: hidden behind the backward (2/3 of the compute) except one bucket,
    # which here (2^24 elements) covers all of it: nothing changes
    megatron = estimate(config, 2, gpu, Assumptions(matmul_efficiency=0.5, memory_overhead=0, overlap="megatron"))
    assert megatron.overlaps == ["grad_reduce"]
    assert megatron.time["total"] == pytest.approx(plan.time["total"])
    # buckets of 64 elements: each group's reduction is hidden but for the part longer than
    # the backward window, at least one bucket (64 * 4 / 2 bytes over 2 ranks)
    config.parallel.overlap_grad_reduce = True
    config.parallel.grad_bucket_numel = 64
    small = estimate(config, 2, gpu, Assumptions(matmul_efficiency=0.5, memory_overhead=0))
    assert small.overlaps == ["grad_reduce"]
    window = 2 / 3 * compute
    for kind in ("dp_cp", "edp"):
        full = plan.time[f"{kind} grads (exposed)"]
        assert small.time[f"{kind} grads (exposed)"] == pytest.approx(max(64 * 4 / 2 / 1e3, full - window))
    # the distributed optimizer: the same bytes, half of the time the parameter gather,
    # hidden behind the forward (1/3 of the compute) with parallel.overlap_param_gather
    config.optimizer.distributed = True
    config.parallel.overlap_param_gather = True
    zero = estimate(config, 2, gpu, Assumptions(matmul_efficiency=0.5, memory_overhead=0))
    assert zero.overlaps == ["grad_reduce", "param_gather"]
    for kind in ("dp_cp", "edp"):
        full = plan.time[f"{kind} grads (exposed)"] / 2
        assert zero.time[f"{kind} grads (exposed)"] == pytest.approx(max(64 * 4 / 2 / 1e3, full - window))
        assert zero.time[f"{kind} params (exposed)"] == pytest.approx(max(64 * 4 / 2 / 1e3, full - compute / 3))


@pytest.mark.parametrize("overlap, exposed", [
    (dict(), 2e-2),
    # the shared expert (S) hides its time of the whole all-to-all (A): A - S
    (dict(shared_expert_overlap=True), 2e-2 - 4.992e-3),
    # two chunks: half of A behind half of the experts (G), the other half exposed: (A - G)/2 + A/2
    (dict(overlap_chunks=2), (2e-2 - 1.3824e-2) / 2 + 1e-2),
    # both: the shared expert under the first dispatch and the last combine: (A - G)/2 + (A/2 - S)
    (dict(shared_expert_overlap=True, overlap_chunks=2), (2e-2 - 1.3824e-2) / 2 + 1e-2 - 4.992e-3),
])
def test_moe_overlap_exposed_all_to_all_by_hand(overlap, exposed):
    from moe_fold.planner.estimate import Assumptions, estimate
    from moe_fold.planner.hardware import GPU

    # world 2: ep 2, dp 2; one micro-batch of 4 tokens per rank, 8 rows, 4 to the other ep
    # rank and 4 back: 2 * 8 * H*a 16 + 8 probs * 4 = 288 bytes at 1.44e4 B/s: A = 2e-2 s. At
    # 0.5 * 1e6 FLOP/s, forward and backward of 4 tokens: experts G = 3*4*576/5e5 = 1.3824e-2 s,
    # shared expert S = 3*4*208/5e5 = 4.992e-3 s (test_flops_by_hand).
    config = _hand_config(ep=2)
    gpu = GPU("toy", peak_flops=1e6, memory=1e9, hbm_bw=1e6, nvlink_bw=1.44e4, inter_node_bw=1e2)
    assumptions = Assumptions(matmul_efficiency=0.5, memory_overhead=0)
    base = estimate(config, 2, gpu, assumptions)
    for key, value in overlap.items():
        setattr(config.moe, key, value)
    plan = estimate(config, 2, gpu, assumptions)
    assert base.comm_bytes["ep"] == 288 and base.time["ep"] == pytest.approx(2e-2)
    assert plan.time["ep"] == pytest.approx(exposed)
    assert plan.time["total"] == pytest.approx(base.time["total"] - 2e-2 + exposed)
    assert plan.moe_overlap == {"shared_expert_overlap": overlap.get("shared_expert_overlap", False),
                                "overlap_chunks": overlap.get("overlap_chunks", 1),
                                "ep_a2a_s": pytest.approx(2e-2), "ep_a2a_exposed_s": pytest.approx(exposed)}


def test_bubble_and_in_flight():
    from moe_fold.planner.estimate import Assumptions, estimate
    from moe_fold.planner.hardware import GPU
    from moe_fold.planner.model import microbatches_in_flight

    config = load_config("mixtral-tiny", ["parallel.pp=2", "parallel.ep=1", "train.global_batch_size=16",
                                          "train.micro_batch_size=4", "train.precision=bf16"])
    # 1F1B: stage r holds pp - r micro-batches; interleaved stage 0 with pp 2, vpp 2:
    # 2*(2-1) + (2-1)*2 + 1 = 5 chunk-forwards of half the stage = 2.5 micro-batches
    assert microbatches_in_flight(config, 0, 8) == 2
    assert microbatches_in_flight(config, 1, 8) == 1
    assert microbatches_in_flight(config, 0, 1) == 1
    config.parallel.vpp, config.parallel.pp_schedule = 2, "interleaved"
    assert microbatches_in_flight(config, 0, 8) == 2.5
    gpu = GPU("toy", peak_flops=1e9, memory=1e12, hbm_bw=1e12, nvlink_bw=1e15, inter_node_bw=1e15)
    plan = estimate(config, 2, gpu, Assumptions(matmul_efficiency=1.0))
    # 4 micro-batches (16 / (4 * dp 1)); bubble (pp - 1)/vpp = 1/2 of the slowest stage's micro-batch
    per_micro = plan.time["compute"] / 4 + plan.time.get("pp", 0) / 4
    assert plan.time["bubble"] == pytest.approx(per_micro / 2)


# --------------------------------------------------------------------------- search and CLI

def test_search_ranks_valid_fitting_layouts():
    from moe_fold.planner.estimate import estimate, search
    from moe_fold.planner.hardware import get_gpu

    config = load_config("mixtral-tiny", ["train.precision=bf16"])
    plans = search(config, 8, get_gpu("h100"))
    layouts = [tuple(p.layout[k] for k in ("tp", "cp", "pp", "vpp", "ep", "etp")) for p in plans]
    assert len(layouts) == len(set(layouts)) > 10
    assert all(p.fits for p in plans)
    assert [p.mfu for p in plans] == sorted((p.mfu for p in plans), reverse=True)
    # every candidate's numbers are what estimate gives for that layout
    best = plans[0]
    from moe_fold.planner.estimate import with_layout
    lay = best.layout
    again = estimate(with_layout(config, tp=lay["tp"], cp=lay["cp"], pp=lay["pp"], vpp=lay["vpp"], ep=lay["ep"],
                                 etp=lay["etp"]), 8, get_gpu("h100"))
    assert again.mfu == best.mfu


def test_cp_bytes_by_hand():
    from moe_fold.planner.comm import microbatch_bytes

    # seq 8 over cp 2 (4 tokens per rank), tp 1: local K and V 4 tokens x 1 kv head x 4
    # dims, 2 bytes each = 2*32 = 64 bytes. Ring: forward 1 hop (64), backward 1 hop (64)
    # plus 2 hops of float32 dK/dV (2 * 128); two layers.
    config = _hand_config(cp=2)
    config.model.seq_length = 8
    assert microbatch_bytes(config, 2, 0, "none")["cp"] == 2 * (64 + 64 + 256)
    # a2a: q (2 heads) 64 bytes, k and v repeated to lcm(1, 2) = 2 heads 64 each, output 64:
    # half of 256 leaves forward, as much backward
    config.parallel.cp_kind = "a2a"
    assert microbatch_bytes(config, 2, 0, "none")["cp"] == 2 * (128 + 128)
    # One MTP depth: its block's attention (a third layer), and the all-gather of the shifted
    # targets: ids, labels and mask as float64 for 1 x 8 tokens, half of them from the peer.
    config.model.mtp_num_layers = 1
    assert microbatch_bytes(config, 2, 0, "none")["cp"] == 3 * (128 + 128) + 3 * 8 * 8 // 2


@pytest.mark.parametrize("pp, vpp, pp_layers", [(2, None, None), (4, 2, None), (2, 2, [1, 2, 3, 2])])
def test_stage_layers_match_pipeline(pp, vpp, pp_layers):
    from moe_fold.parallel.pipeline import stage_layers as pipeline_stages
    from moe_fold.planner.model import stage_layers

    config = load_config("mixtral-tiny", [f"model.num_layers={8}", f"parallel.pp={pp}", "parallel.ep=1"])
    config.parallel.vpp, config.parallel.pp_layers = vpp, pp_layers
    chunks = pipeline_stages(8, pp, vpp or 1, pp_layers)
    for rank in range(pp):
        expected = [layer for chunk in chunks[rank::pp] for layer in chunk]
        assert stage_layers(config, rank) == expected
        manifest = param_manifest(config, rank)
        # embedding on the first stage, final norm and head on the last
        assert ("embed.weight" in [e.name for e in manifest]) == (rank == 0)
        assert ("lm_head.weight" in [e.name for e in manifest]) == (rank == pp - 1)
    # the stages' parameters add up to the whole model's
    one = load_config("mixtral-tiny", ["model.num_layers=8", "parallel.ep=1"])
    assert sum(e.numel for r in range(pp) for e in param_manifest(config, r)) == \
        sum(e.numel for e in param_manifest(one))

"""The planner's model (moe_fold/planner/model.py): the parameter manifest equals the real
model's parameters (one process, tp/ep ranks, MTP under pp, attention sinks, zero experts),
the FLOPs by hand and for hybrid layers, and the pipeline's stage layers."""

import pytest

from moe_fold.config import list_presets, load_config
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.planner.model import param_manifest

from tests.helpers.planner_cases import LAYOUTS, hand_config, layout_config

TINY = [name for name in list_presets() if name.endswith("-tiny")]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_params_equal_real_model_under_tp_ep(gloo_step, name):
    config = layout_config(name)
    planned = [(e.name, e.numel, e.kind) for e in param_manifest(config)]
    for rank in range(4):
        assert [tuple(x) for x in gloo_step[rank][name]["params"]] == planned


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


def test_params_by_hand():
    from moe_fold.planner.estimate import model_params

    # embed 16*8 = 128
    # layer 0: norms 2*8 + qkv (8 + 2*4)*8 = 128 + proj 8*8 = 64 + fc1 2*12*8 = 192 + fc2 8*12 = 96 -> 496
    # layer 1: norms 16 + qkv 128 + proj 64 + gate 8 + router 4*8 = 32 + experts fc1 4*8*12 = 384,
    #          fc2 4*6*8 = 192 + shared fc1 2*4*8 = 64, fc2 8*4 = 32 -> 920
    # final norm 8, head 128: total 128 + 496 + 920 + 8 + 128 = 1680
    # activated: 1680 - 576 experts + 2/4 of them = 1392
    assert model_params(hand_config()) == {"total": 1680, "experts": 576, "activated": 1392}
    # Two MTP depths: each norms 2*8 + eh_proj 8*16 = 128 + a block like layer 1 (920) + its norm 8
    config = hand_config()
    config.model.mtp_num_layers = 2
    assert model_params(config)["total"] == 1680 + 2 * (16 + 128 + 920 + 8)
    # tp 2, ep 2, etp 1: embed 64; layer 0: 8 + 64 + 32 + 8 + 96 + 48 = 256;
    # layer 1: 8 + 64 + 32 + 8 + gate 8 + router 32 + 2 experts 2*8*12 + 2*6*8 = 288 + shared 32 + 16
    # = 488; norm 8, head 64 -> 880
    config = hand_config(tp=2, ep=2, etp=1, sequence_parallel=True)
    assert sum(e.numel for e in param_manifest(config)) == 880


def test_flops_by_hand():
    from moe_fold.planner.model import head_forward_flops, layer_forward_flops, model_flops_per_step

    config = hand_config()
    # layer 0: projections 2*8*16 + 2*8*8 = 384, core 4*seq 4*q 8 = 128, MLP 6*8*12 = 576
    assert layer_forward_flops(config, 0) == {"attention": 384, "core": 128, "mlp": 576, "router": 0.0,
                                              "experts": 0.0, "latent": 0.0, "shared": 0.0}
    # layer 1: router 2*8*4 = 64, 2 experts 2*6*8*6 = 576, shared 6*8*4 + gate 2*8 = 208
    assert layer_forward_flops(config, 1) == {"attention": 384, "core": 128, "mlp": 0.0, "router": 64,
                                              "experts": 576, "latent": 0.0, "shared": 208}
    assert head_forward_flops(config) == 2 * 8 * 16
    # 3 x (1088 + 1360 + 256) per token x 2 sequences x 4 tokens
    assert model_flops_per_step(config) == 3 * 2704 * 8
    # Two MTP depths: each an MoE block like layer 1 (1360), eh_proj 2*16*8 = 256 and a head 256.
    config.model.mtp_num_layers = 2
    assert layer_forward_flops(config, 3) == layer_forward_flops(config, 1)
    assert model_flops_per_step(config) == 3 * (2704 + 2 * (1360 + 256 + 256)) * 8


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "kimi-linear-tiny"])
def test_hybrid_layers_projection_flops_are_their_weights(preset):
    """Qwen3-Next's layers: a Gated DeltaNet layer's projections (q, k, v, z, beta, a in;
    out) and a gated attention layer's (q with its gate, k, v; out); Kimi-Linear's: a KDA
    layer's (q|k|v|beta, the low-rank decay and output gate, out) and an MLA layer's. Each is
    2 FLOPs per weight per token, read off the built model's matrices; the chunked rule's
    core is counted from its chunk and state sizes."""
    from moe_fold.models.model import build_model
    from moe_fold.planner.model import layer_forward_flops

    config = load_config(preset, ["parallel.ep=1"])
    model = build_model(config, ProcessGroups.single_process())
    m = config.model
    assert len(set(m.layer_types)) == 2 and "attention" in m.layer_types
    dk, dv, chunk = m.linear_key_head_dim, m.linear_value_head_dim, m.linear_chunk_size
    core = {"gated_deltanet": m.linear_num_value_heads * (2 * chunk * (dk + dv) + 6 * dk * dv),
            "kda": m.linear_num_key_heads * (2 * chunk * 2 * dk + 6 * dk * dk)}
    for i, layer in enumerate(model.layers):
        matrices = sum(q.numel() for n, q in layer.attn.named_parameters() if q.dim() == 2 and n != "conv_weight")
        flops = layer_forward_flops(config, i)
        assert flops["attention"] == 2 * matrices, (i, m.layer_types[i])
        if m.layer_types[i] in core:
            assert flops["core"] == core[m.layer_types[i]], (i, m.layer_types[i])


@pytest.mark.parametrize("sets", [["parallel.ep=1"], ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                    "parallel.ep=1"],
                                  ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=1",
                                   "moe.latent_size=40"]], ids=["one", "tp2", "tp2-latent"])
def test_nemotron_h_params_equal_the_real_model(sets):
    """nemotron-h-tiny's single-mixer layers (Mamba2, relu2 MoE, attention, relu2 MLP; and
    with a latent MoE): the planner's parameter manifest is the built model's, names, sizes
    and sync kinds."""
    from moe_fold.launch import run_ranks
    from moe_fold.models.model import build_model

    config = load_config("nemotron-h-tiny", sets)
    if config.parallel.tp == 1:
        model = build_model(config, ProcessGroups.single_process())
        real = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
        assert [(e.name, e.numel, e.kind) for e in param_manifest(config)] == real
        return
    for real in run_ranks(_real_params, 2, sets, timeout=120):
        assert [(e.name, e.numel, e.kind) for e in param_manifest(config)] == real


def _real_params(rank, world_size, sets):
    from moe_fold.layout import ParallelLayout, create_process_groups
    from moe_fold.models.model import build_model

    config = load_config("nemotron-h-tiny", sets)
    model = build_model(config, create_process_groups(ParallelLayout(world_size, tp=2)))
    return [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]


def test_nemotron_h_projection_flops_are_their_weights():
    """Each Nemotron-H layer's matmul FLOPs are 2 per weight per token, read off the built
    model (the mixer's matrices for Mamba2 and attention, the MLP's for mlp, the experts' at
    topk rows for moe); the chunked SSD's core from its chunk and state sizes."""
    from moe_fold.models.model import build_model
    from moe_fold.planner.model import layer_forward_flops

    config = load_config("nemotron-h-tiny", ["parallel.ep=1"])
    model = build_model(config, ProcessGroups.single_process())
    m, moe = config.model, config.moe

    def matrices(module):
        return sum(q.numel() for n, q in module.named_parameters() if q.dim() == 2 and n != "conv_weight")

    for i, layer in enumerate(model.layers):
        flops = layer_forward_flops(config, i)
        kind = m.layer_types[i]
        if kind in ("mamba2", "attention"):
            assert flops["attention"] == 2 * matrices(layer.attn), (i, kind)
            assert flops["mlp"] == flops["experts"] == flops["shared"] == 0
        if kind == "mamba2":
            N, P = m.mamba_state_size, m.mamba_head_dim
            assert flops["core"] == m.mamba_num_heads * (2 * m.mamba_chunk_size * (N + P) + 4 * N * P)
        if kind == "mlp":
            assert flops["mlp"] == 2 * matrices(layer.mlp) and flops["attention"] == flops["core"] == 0
        if kind == "moe":
            per_expert = (layer.mlp.experts.fc1.numel() + layer.mlp.experts.fc2.numel()) / moe.num_experts
            assert flops["experts"] == 2 * moe.topk * per_expert
            assert flops["shared"] == 2 * matrices(layer.mlp.shared_expert)
            assert flops["router"] == 2 * layer.mlp.router.weight.numel()
            assert flops["attention"] == flops["core"] == 0


def test_zero_expert_params_equal_the_real_model():
    from moe_fold.models.model import build_model

    config = load_config("mixtral-tiny", ["parallel.ep=1", "moe.zero_experts=3"])
    model = build_model(config, ProcessGroups.single_process())
    real = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
    assert [(e.name, e.numel, e.kind) for e in param_manifest(config)] == real


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

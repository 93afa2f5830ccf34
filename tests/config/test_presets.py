"""Presets: each validates for the world its comment names, the large ones have the
published parameter counts (total and active, from the config by formula), and the tiny
ones train."""

from __future__ import annotations

import pytest

from moe_fold.config import head_dim, list_presets, load_config, moe_layer_flags, validate
from moe_fold.config import mla_weight_shapes
from moe_fold.training.train import train

WORLDS = {"mixtral-8x7b": 64, "mixtral-8x22b": 128, "qwen2-57b-a14b": 64, "qwen3-30b-a3b": 8,
          "deepseek-v3": 1024, "mixtral-tiny": 4, "qwen2-moe-tiny": 1, "qwen3-moe-tiny": 1,
          "deepseek-tiny": 1, "deepseek-v3-tiny": 1, "deepseek-v2-lite": 8, "deepseek-v2-lite-tiny": 1,
          "ernie-4.5-21b-a3b": 8, "ernie-4.5-tiny": 1, "minimax-m2": 128, "minimax-m2-tiny": 1,
          "llama4-scout": 64, "llama4-tiny": 1, "gpt-oss-20b": 8, "gpt-oss-tiny": 1,
          "qwen3-next-80b-a3b": 32, "qwen3-next-tiny": 1, "qwen3.5-35b-a3b": 16,
          "kimi-linear-48b-a3b": 32, "kimi-linear-tiny": 1,
          "longcat-flash": 1024, "longcat-flash-tiny": 1, "deepseek-v32": 1024, "deepseek-v32-tiny": 1,
          "glm-5": 768, "glm-5-tiny": 1, "nemotron-h-tiny": 1, "nemotron-3-nano-30b-a3b": 16}

# Published sizes in billions (total, active per token): model cards / reports.
PUBLISHED = {"mixtral-8x7b": (46.7, 12.9), "mixtral-8x22b": (141.0, 39.0), "qwen2-57b-a14b": (57.4, 14.2),
             "qwen3-30b-a3b": (30.5, 3.3), "deepseek-v3": (671.0, 37.0), "deepseek-v2-lite": (15.7, 2.4),
             "ernie-4.5-21b-a3b": (21, 3), "minimax-m2": (230.0, 10.0), "llama4-scout": (109.0, 17.0),
             "gpt-oss-20b": (20.91, 3.61), "qwen3-next-80b-a3b": (80.0, 3), "qwen3.5-35b-a3b": (35.0, 3),
             "kimi-linear-48b-a3b": (48, 3),
             "longcat-flash": (560.0, 27.0), "deepseek-v32": (671.0, 37.0), "glm-5": (744.0, 40.0),
             "nemotron-3-nano-30b-a3b": (31.6, 3.2)}

# Whose published active count leaves out the input embedding (a lookup, no FLOPs): the
# DeepSeek-V2 report's 2.4B of V2-Lite (2.66B with it, 2.45B without; the embedding is 8%)
# and the gpt-oss model card's 3.61B active of gpt-oss-20b. LongCat-Flash's 27B on average
# (at balance 8 of its 12 slots on held experts; 12 x 512/768) likewise: its report's range
# 18.6B-31.3B (no slot or every slot on a held expert) is ours, 19.5B-32.2B, less the 0.8B embedding.
# Nemotron 3 Nano's 3.2B (3.6B with the embedding) likewise.
ACTIVE_WITHOUT_INPUT_EMBEDDING = {"deepseek-v2-lite", "gpt-oss-20b", "longcat-flash", "nemotron-3-nano-30b-a3b"}
# MiniMax counts M2's 10B active parameters without the embedding and the head: 9.8B
# without them, 11.0B with them (they are 1.2B of it).
# Qwen3-Next-80B-A3B's 3B active likewise: 3.25B without them, 3.87B with them.
# GLM-5's 40B active likewise: 39.9B without them, 41.8B with them.
ACTIVE_WITHOUT_EMBEDDING_AND_HEAD = {"minimax-m2", "qwen3-next-80b-a3b", "glm-5"}
# DeepSeek-V3.2-Exp's card repeats DeepSeek-V3's 671B / 37B: its 61 indexers (0.85B, all
# active) come on top.
INDEXERS_NOT_COUNTED = {"deepseek-v32"}
# The model card gives whole billions, rounded down: ERNIE-4.5-21B-A3B is 21.8B with 3.35B active;
# Kimi-Linear-48B-A3B is 49.12B (transformers' model counts the same) with 3.48B active, its 48B
# total without the embedding and the head (48.37B).
ROUNDED_DOWN = {"ernie-4.5-21b-a3b", "kimi-linear-48b-a3b"}
TOTAL_WITHOUT_EMBEDDING_AND_HEAD = {"kimi-linear-48b-a3b"}
# Only the active count in whole billions, rounded down (Qwen3-Next-80B-A3B: 79.7B total, 3.25B active;
# Qwen3.5-35B-A3B: 34.7B total, 3.45B active with the embedding and head).
ACTIVE_ROUNDED_DOWN = {"qwen3-next-80b-a3b", "qwen3.5-35b-a3b"}


def test_every_preset_is_listed_and_validates():
    assert sorted(WORLDS) == list_presets()
    for name, world in WORLDS.items():
        validate(load_config(name), world)


def _counts(name: str) -> tuple[float, float, float]:
    """(total, active, total without attention) parameters in billions, by formula (a
    Gated DeltaNet layer's mixer counted as such)."""
    c = load_config(name)
    m, moe = c.model, c.moe
    H, hd = m.hidden_size, head_dim(c)
    attn = H * m.num_heads * hd * 2 + 2 * H * m.num_kv_heads * hd + 2 * H  # q, o, k, v, two norms
    if m.qk_norm and m.qk_norm_scope != "l2":  # Llama-4's L2 QK-norm has no weights
        attn += 2 * hd
    # gpt-oss: q|k|v and o biases, one sink per head.
    attn += (m.num_heads + 2 * m.num_kv_heads) * hd * m.qkv_bias + H * m.attention_out_bias
    attn += m.num_heads * m.attention_sinks
    attn += H * m.num_heads * hd * m.attn_output_gate  # Qwen3-Next's output gate, projected with q
    if m.attention == "mla":  # the linears, the latents' norms, two block norms
        attn = sum(a * b for a, b in mla_weight_shapes(m).values()) + (m.q_lora_rank or 0) + m.kv_lora_rank + 2 * H
    if m.dsa:  # the lightning indexer: query, key (and its LayerNorm), head weights
        attn += m.q_lora_rank * m.index_n_heads * m.index_head_dim + H * m.index_head_dim + 2 * m.index_head_dim
        attn += H * m.index_n_heads
    key, value = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    # Gated DeltaNet: q|k|v|z|b|a in, the conv on q|k|v, A_log and dt_bias per value head,
    # the gated norm, out, two block norms.
    deltanet = (H * (2 * key + 2 * value + 2 * m.linear_num_value_heads) + (2 * key + value) * m.linear_conv_kernel
                + 2 * m.linear_num_value_heads + m.linear_value_head_dim + value * H + 2 * H)
    # KDA: q|k|v|b in, the low-rank decay and output gate (down to d, up to every channel),
    # the conv on q|k|v, A_log per head, dt_bias per channel, the gated norm, out, two block norms.
    d = m.linear_key_head_dim
    kda = (H * (3 * key + m.linear_num_key_heads) + 2 * d * H + 2 * key * d + 3 * key * m.linear_conv_kernel
           + m.linear_num_key_heads + key + d + key * H + 2 * H)
    # Mamba2: z|x|B|C|dt in, the conv (with its bias) on x|B|C, A_log, D and dt_bias per head,
    # the gated norm, out, one block norm (a single-mixer layer has one).
    inner, bc = m.mamba_num_heads * m.mamba_head_dim, m.mamba_num_groups * m.mamba_state_size
    conv = inner + 2 * bc
    mamba = (H * (2 * inner + 2 * bc + m.mamba_num_heads) + conv * (m.mamba_conv_kernel + 1)
             + 3 * m.mamba_num_heads + inner + inner * H + H)
    if m.block == "single_mixer":
        attn -= H  # one norm per layer
    embed = m.vocab_size * H * (1 if m.tie_embeddings else 2) + H
    kinds = m.layer_types or ["attention"] * m.num_layers
    # LongCat-Flash's shortcut_moe blocks: two attention sublayers, each with a dense MLP.
    sublayers = 2 if m.block == "shortcut_moe" else 1
    per_kind = {"gated_deltanet": deltanet, "kda": kda, "mamba2": mamba, "mlp": H, "moe": H}
    mixers = sublayers * sum(per_kind.get(kind, attn) for kind in kinds)
    if m.block == "shortcut_moe":
        mixers += 2 * m.num_layers * 3 * H * m.ffn_hidden_size
    total = active = embed + mixers
    no_attn = embed
    mats, expert_mats = (2 if m.mlp_activation == "relu2" else 3), (2 if moe.activation == "relu2" else 3)
    for i, is_moe in enumerate(moe_layer_flags(c)):
        if m.block == "single_mixer" and kinds[i] not in ("mlp", "moe"):
            continue
        if is_moe:
            shared = mats * H * moe.shared_expert_ffn_hidden_size + (H if moe.shared_expert_gate else 0)
            router = (moe.num_experts + moe.zero_experts) * (H + moe.router_bias)
            expert = expert_mats * H * moe.ffn_hidden_size + (2 * moe.ffn_hidden_size + H) * moe.expert_linear_bias
            held = moe.topk * moe.num_experts / (moe.num_experts + moe.zero_experts)  # zero experts hold nothing
            total += moe.num_experts * expert + shared + router
            active += held * expert + shared + router
            no_attn += moe.num_experts * expert + shared + router
        else:
            dense = mats * H * m.ffn_hidden_size
            total, active, no_attn = total + dense, active + dense, no_attn + dense
    return total / 1e9, active / 1e9, no_attn / 1e9


def test_full_size_presets_say_bf16_for_gpus():
    """The full-size presets are GPU runs: bf16 weights with fp32 masters, whose expert
    GEMMs take grouped_mm's fast path on sm90/sm100 (kernels/backends.py)."""
    assert sorted(PUBLISHED) == [name for name in list_presets() if "tiny" not in name]
    for name in PUBLISHED:
        assert load_config(name).train.precision == "bf16", name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    total, active, _ = _counts(name)
    want_total, want_active = PUBLISHED[name]
    if name in ACTIVE_WITHOUT_INPUT_EMBEDDING:
        c = load_config(name)
        active -= c.model.vocab_size * c.model.hidden_size / 1e9
    if name in ACTIVE_WITHOUT_EMBEDDING_AND_HEAD:
        c = load_config(name)
        active -= 2 * c.model.vocab_size * c.model.hidden_size / 1e9
    if name in INDEXERS_NOT_COUNTED:
        m = load_config(name).model
        indexer = (m.q_lora_rank * m.index_n_heads * m.index_head_dim + m.hidden_size * m.index_head_dim
                   + 2 * m.index_head_dim + m.hidden_size * m.index_n_heads) * m.num_layers / 1e9
        total, active = total - indexer, active - indexer
    if name in TOTAL_WITHOUT_EMBEDDING_AND_HEAD:
        c = load_config(name)
        total -= 2 * c.model.vocab_size * c.model.hidden_size / 1e9
    if name in ROUNDED_DOWN:
        assert (int(total), int(active)) == (want_total, want_active)
        return
    if name in ACTIVE_ROUNDED_DOWN:
        assert total == pytest.approx(want_total, rel=0.015) and int(active) == want_active
        return
    assert total == pytest.approx(want_total, rel=0.015)
    assert active == pytest.approx(want_active, rel=0.03)


def test_deepseek_v3_attention_is_mla_sized():
    # DeepSeek-V3's MLA is 61 x 187M = 11.4B of its 671B parameters.
    total, _, no_attn = _counts("deepseek-v3")
    assert (total - no_attn) / 61 == pytest.approx(0.187, rel=0.005)


def test_deepseek_v3_mtp_module_is_the_published_14b():
    """The report: 685B = 671B main model + 14B MTP module (whose checkpoint layer repeats
    the embedding and the head, which moe-fold shares)."""
    from moe_fold.planner.estimate import model_params

    config = load_config("deepseek-v3")
    assert config.model.mtp_num_layers == 1
    with_mtp = model_params(config)["total"]
    config.model.mtp_num_layers = 0
    mtp = with_mtp - model_params(config)["total"]
    copies = 2 * config.model.vocab_size * config.model.hidden_size
    assert (mtp + copies) / 1e9 == pytest.approx(14.0, rel=0.05)


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny", "deepseek-tiny",
                                  "deepseek-v3-tiny", "deepseek-v2-lite-tiny", "ernie-4.5-tiny",
                                  "minimax-m2-tiny", "llama4-tiny", "gpt-oss-tiny", "qwen3-next-tiny",
                                  "kimi-linear-tiny",
                                  "longcat-flash-tiny", "deepseek-v32-tiny", "glm-5-tiny", "nemotron-h-tiny"])
def test_tiny_presets_train(tmp_path, name):
    config = load_config(name, [f"train.run_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}",
                                "parallel.ep=1", "model.seq_length=32", "train.steps=4", "optimizer.warmup_steps=1",
                                "wandb.mode=disabled"])
    result = train(config)
    assert len(result.losses) == 4
    assert result.losses[-1] < result.losses[0] - 0.3

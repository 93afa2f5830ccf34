"""Sparse upcycling: a dense Hugging Face Llama, Qwen2 or Qwen3 model (tiny, random, built
with transformers' own classes) becomes an MoE model whose logits at step 0 equal the
dense model's, plain (every expert a copy) and granular (experts are slices of the MLP);
refusals of settings under which that cannot hold; and a run started from the upcycled
weights trains under ep2 x dp2 from the command line."""

import json

import pytest
import torch
import transformers

from moe_fold import cli
from moe_fold.config import Config, ConfigError, load_config, validate
from moe_fold.layout import ProcessGroups
from moe_fold.models.hf import HFConfigError
from moe_fold.models.hf.upcycle import load_upcycled_into, upcycled_config
from moe_fold.models.model import build_model

VOCAB, SEQ, BATCH = 64, 12, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
DENSE = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(rope_theta=5e5)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict()),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),
}


def save_dense(family: str, path, seed: int = 0, **overrides):
    model_cls, config_cls, extra = DENSE[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that every layer matters
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 if p.dim() > 1 else torch.rand(p.shape, generator=gen) + 0.5)
    model.save_pretrained(path)
    return model


def base_config(experts: int, topk: int, granularity: int = 1, **moe) -> Config:
    config = load_config("qwen3-moe-tiny", [f"moe.num_experts={experts}", f"moe.topk={topk}",
                                            f"init.upcycle_granularity={granularity}", "model.seq_length=16",
                                            "parallel.ep=1"])
    for key, value in moe.items():
        setattr(config.moe, key, value)
    return config


def upcycled_logits(path, config: Config, ids: torch.Tensor) -> torch.Tensor:
    config = upcycled_config(path, config)
    validate(config, 1)
    model = build_model(config, ProcessGroups.single_process())
    load_upcycled_into(model, path)
    with torch.no_grad():
        return model.eval().logits(ids)


@pytest.mark.parametrize("family", sorted(DENSE))
@pytest.mark.parametrize("experts,topk,granularity,first_k_dense",
                         [(4, 2, 1, 0), (8, 2, 2, 0), (8, 4, 4, 1), (6, 3, 3, 0)])
def test_upcycled_model_computes_the_dense_function(tmp_path, family, experts, topk, granularity, first_k_dense):
    dense = save_dense(family, tmp_path)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    config = base_config(experts, topk, granularity, first_k_dense=first_k_dense)
    ours = upcycled_logits(tmp_path, config, ids)
    with torch.no_grad():
        want = dense(ids).logits.double()
    assert (ours.double() - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))


def test_upcycled_experts_are_copies_or_scaled_slices(tmp_path):
    dense = save_dense("llama", tmp_path)
    mlp = dense.model.layers[0].mlp
    for granularity, experts, topk in ((1, 4, 2), (2, 4, 2)):
        config = upcycled_config(tmp_path, base_config(experts, topk, granularity))
        model = build_model(config, ProcessGroups.single_process())
        load_upcycled_into(model, tmp_path)
        layer = model.layers[0].mlp
        width = 48 // granularity
        assert config.moe.ffn_hidden_size == width
        for e in range(experts):
            s = (e % granularity) * width
            gate, up = layer.experts.fc1[e].split(width, dim=1)  # [H, 2F/G] -> [H, F/G] x2
            assert torch.equal(gate, mlp.gate_proj.weight[s:s + width].T)
            assert torch.equal(up, mlp.up_proj.weight[s:s + width].T)
            assert torch.equal(layer.experts.fc2[e], mlp.down_proj.weight[:, s:s + width].T * granularity)
        router = layer.router.weight
        for e in range(experts):  # one router row per group of slices
            assert torch.equal(router[e], router[e - e % granularity])
        assert len({tuple(r.tolist()) for r in router}) == experts // granularity


@pytest.mark.parametrize("moe,message", [
    (dict(topk=3), "moe.topk=3 is not divisible by init.upcycle_granularity=2"),
    (dict(num_experts=6, topk=2), "moe.num_experts=6 is not divisible by init.upcycle_granularity=4"),
    (dict(pre_softmax=True), "moe.pre_softmax=true: the top-k of the full softmax does not sum to 1"),
    (dict(capacity_factor=1.0), "moe.capacity_factor=1.0: dropped tokens would skip the MLP"),
    (dict(shared_expert_ffn_hidden_size=16), "moe.shared_expert_ffn_hidden_size=16: the dense MLP becomes"),
    (dict(scaling_factor=2.5), "moe.scaling_factor=2.5 scales the routed output"),
    (dict(zero_experts=2), "moe.zero_experts=2: a slot on a zero expert returns the token, not the dense MLP"),
    (dict(latent_size=8), "moe.latent_size=8: latent experts cannot hold the dense MLP's hidden-width slices"),
])
def test_settings_that_would_change_the_function_are_refused(tmp_path, moe, message):
    save_dense("qwen3", tmp_path)
    granularity = 4 if "num_experts" in moe else 2
    config = base_config(8, 4, granularity, **{k: v for k, v in moe.items() if k not in ("num_experts", "topk")})
    config.moe.num_experts = moe.get("num_experts", config.moe.num_experts)
    config.moe.topk = moe.get("topk", config.moe.topk)
    with pytest.raises(HFConfigError, match="cannot upcycle") as err:
        upcycled_config(tmp_path, config)
    assert message in str(err.value)


def test_granularity_must_divide_the_dense_ffn(tmp_path):
    save_dense("llama", tmp_path)
    with pytest.raises(HFConfigError, match=r"init.upcycle_granularity=5 must divide the dense intermediate_size=48"):
        upcycled_config(tmp_path, base_config(10, 5, 5))


def test_an_moe_or_unknown_checkpoint_is_refused(tmp_path):
    save_dense("llama", tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "model_type": "mixtral"}))
    with pytest.raises(HFConfigError, match=r"model_type='mixtral' is not a dense family that can be upcycled"):
        upcycled_config(tmp_path, base_config(4, 2))
    (tmp_path / "config.json").write_text(json.dumps({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(HFConfigError, match=r"rope_scaling="):
        upcycled_config(tmp_path, base_config(4, 2))


def test_init_rules_are_checked_with_the_config():
    config = base_config(4, 2, 2)
    with pytest.raises(ConfigError, match=r"init.upcycle_granularity=2 is set but init.upcycle_from is null"):
        validate(config, 1)
    config.init.upcycle_from, config.init.from_hf = "dense", "moe"
    with pytest.raises(ConfigError, match=r"init.from_hf='moe' and init.upcycle_from='dense' are both set"):
        validate(config, 1)
    config.init.from_hf, config.init.upcycle_granularity = None, 0
    with pytest.raises(ConfigError, match=r"init.upcycle_granularity=0 must be >= 1"):
        validate(config, 1)


@pytest.mark.slow
def test_upcycled_run_trains_under_ep2_dp2_from_the_cli(tmp_path):
    save_dense("qwen3", tmp_path / "dense", vocab_size=258)  # the demo corpus is byte-tokenized
    run_dir = tmp_path / "run"
    code = cli.main([
        "train", "--config", "qwen3-moe-tiny", "--nproc", "4", "--no-progress",
        "--set", f"init.upcycle_from={tmp_path / 'dense'}", "--set", "init.upcycle_granularity=2",
        "--set", "moe.num_experts=8", "--set", "moe.topk=2", "--set", "parallel.ep=2", "--set", "parallel.etp=1",
        "--set", "model.seq_length=32", "--set", "train.steps=12", "--set", "train.micro_batch_size=2",
        "--set", "train.global_batch_size=8", "--set", "train.save_every=100", "--set", f"train.run_dir={run_dir}",
        "--set", "wandb.mode=disabled", "--set", "optimizer.warmup_steps=2", "--set", "optimizer.lr=3e-3",
    ])
    assert code == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["lm_loss"] for r in rows if "lm_loss" in r]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    saved = json.loads(json.dumps(load_config(str(run_dir / "config.yaml")).init.__dict__))
    assert saved["upcycle_granularity"] == 2

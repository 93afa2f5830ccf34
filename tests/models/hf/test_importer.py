"""Hugging Face interop on one process: tiny random models built with transformers' own
classes (no downloads), saved with save_pretrained, imported, and compared logit for
logit with transformers' forward; export and from_pretrained round trips; refusals of
what we cannot represent."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from moe_fold.config import Config
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, HFWeightError, config_from_hf, hf_config, read_hf_config
from tests.helpers.hf_family_checks import hf_logits, randomize

VOCAB, SEQ, BATCH, TOL = 64, 12, 2, 1e-4

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)

# name -> (class name, config class name, config overrides)
CASES = {
    "mixtral_gqa": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, rope_theta=5e5)),
    # Gated shared expert, layer 1 dense (mlp_only_layers), top-k of the full softmax.
    "qwen2_shared_dense": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                           dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                mlp_only_layers=[1], norm_topk_prob=False)),
    # Layers 0 and 2 dense (decoder_sparse_step=2), renormalised top-k.
    "qwen2_sparse_step_norm": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                               dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                    decoder_sparse_step=2, norm_topk_prob=True, num_hidden_layers=4)),
    "qwen3_norm_topk": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        dict(num_experts=4, moe_intermediate_size=24, head_dim=16, norm_topk_prob=True)),
    "qwen3_no_norm_tied": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                           dict(num_experts=4, moe_intermediate_size=24, norm_topk_prob=False,
                                tie_word_embeddings=True, mlp_only_layers=[0], rms_norm_eps=1e-5)),
}


def hf_model(case: str, seed: int = 0, **overrides):
    """A tiny transformers model of ``case`` with weights large enough that routing and
    every layer matter (matrices N(0, 0.2), norm weights and biases U(0.5, 1.5))."""
    model_cls, config_cls, extra = CASES[case]
    kwargs = {**COMMON, **extra, **overrides}
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    return randomize(model, seed)


def save_hf(case: str, path, **kwargs):
    model = hf_model(case, **kwargs.pop("model_kwargs", {}))
    model.save_pretrained(path, **kwargs)
    return model


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@torch.no_grad()
def our_logits(model, ids):
    return model.eval().logits(ids)


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------- import


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers_logits_and_export_round_trips(case, tmp_path):
    ids = token_ids()
    ref_model = save_hf(case, tmp_path / "hf")
    ref = hf_logits(ref_model, ids)
    model = from_hf(tmp_path / "hf")
    diff = max_diff(our_logits(model, ids), ref)
    print(f"{case}: max abs logit diff vs transformers {diff:.3g}")
    assert diff <= TOL
    to_hf(model, tmp_path / "out")
    back = type(ref_model).from_pretrained(tmp_path / "out").eval()
    assert max_diff(hf_logits(back, ids), ref) <= TOL
    # Export writes exactly the tensors transformers saved, with the same values.
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_config_mapping():
    hf = hf_model("qwen2_shared_dense").config.to_dict()
    config = config_from_hf(hf)
    m, moe = config.model, config.moe
    assert (m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (64, 32, 3, 4, 2, 8)
    assert m.qkv_bias and not m.qk_norm and m.seq_length == 64 and m.ffn_hidden_size == 48
    assert moe.moe_layer_freq == [1, 0, 1] and moe.pre_softmax
    assert (moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate, moe.ffn_hidden_size) == (40, True, 24)
    step = config_from_hf(hf_model("qwen2_sparse_step_norm").config.to_dict())
    assert step.moe.moe_layer_freq == [0, 1, 0, 1] and not step.moe.pre_softmax
    mix = hf_model("mixtral_gqa", router_jitter_noise=0.1, router_aux_loss_coef=0.02).config.to_dict()
    mc = config_from_hf(mix)
    assert (mc.moe.input_jitter, mc.moe.aux_loss_coeff, mc.model.rope_theta, mc.model.norm_eps) == (0.1, 0.02, 5e5, 1e-5)
    q3 = config_from_hf(hf_model("qwen3_no_norm_tied").config.to_dict())
    assert q3.model.qk_norm and q3.model.tie_embeddings and q3.moe.pre_softmax and q3.moe.moe_layer_freq == [0, 1, 1]
    # A base config keeps its non-architecture settings (and its sequence length).
    base = Config()
    base.model.seq_length, base.moe.dispatcher, base.train.steps = 32, "allgather", 7
    kept = config_from_hf(hf, base)
    assert (kept.model.seq_length, kept.moe.dispatcher, kept.train.steps) == (32, "allgather", 7)


def test_sharded_checkpoint_with_index(tmp_path):
    ids = token_ids()
    ref_model = save_hf("qwen2_shared_dense", tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    assert max_diff(our_logits(from_hf(tmp_path / "hf"), ids), hf_logits(ref_model, ids)) <= TOL


def test_fused_expert_layout_is_read(tmp_path):
    """Checkpoints holding experts as transformers 5 does in memory: gate_up_proj
    [E, 2F, H] and down_proj [E, H, F] under mlp.experts."""
    ids = token_ids()
    ref_model = save_hf("mixtral_gqa", tmp_path / "hf")
    src = tmp_path / "hf" / "model.safetensors"
    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fused = {}
    for i in range(3):
        old = f"model.layers.{i}.block_sparse_moe."
        new = f"model.layers.{i}.mlp."
        fused[f"{new}gate.weight"] = tensors.pop(f"{old}gate.weight")
        gate_up = [torch.cat([tensors.pop(f"{old}experts.{e}.w1.weight"), tensors.pop(f"{old}experts.{e}.w3.weight")])
                   for e in range(4)]
        fused[f"{new}experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{new}experts.down_proj"] = torch.stack([tensors.pop(f"{old}experts.{e}.w2.weight") for e in range(4)])
    save_file({**tensors, **fused}, str(src), metadata={"format": "pt"})
    assert max_diff(our_logits(from_hf(tmp_path / "hf"), ids), hf_logits(ref_model, ids)) <= TOL


def test_export_in_shards_loads_in_transformers(tmp_path):
    ids = token_ids()
    ref_model = save_hf("qwen3_norm_topk", tmp_path / "hf")
    to_hf(from_hf(tmp_path / "hf"), tmp_path / "out", max_shard_bytes=30_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (tmp_path / "out" / "model.safetensors").exists()
    back = type(ref_model).from_pretrained(tmp_path / "out").eval()
    assert max_diff(hf_logits(back, ids), hf_logits(ref_model, ids)) <= TOL


def test_trained_model_exports_and_reloads_equal(tmp_path):
    """A few optimizer steps move every weight; the export then loads in transformers
    with our logits and re-imports to the very same parameters."""
    ids, labels = token_ids(1), token_ids(2)
    ref_model = save_hf("qwen2_shared_dense", tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(3):
        opt.zero_grad()
        model(ids, labels).backward()
        opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    to_hf(model, tmp_path / "out")
    back = type(ref_model).from_pretrained(tmp_path / "out").eval()
    ours = our_logits(model, ids)
    assert max_diff(hf_logits(back, ids), ours) <= TOL
    again = from_hf(tmp_path / "out")
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name


def test_tokenizer_json_becomes_the_data_tokenizer(tmp_path):
    save_hf("mixtral_gqa", tmp_path / "hf")
    assert hf_config(tmp_path / "hf").data.tokenizer == "byte"
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    assert hf_config(tmp_path / "hf").data.tokenizer == str(tmp_path / "hf")


# --------------------------------------------------------------------------- refusals


def _refused_config(tmp_path, case, edit, base=None):
    save_hf(case, tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    hf = json.loads(file.read_text())
    edit(hf)
    file.write_text(json.dumps(hf))
    with pytest.raises(HFConfigError) as err:
        from_hf(tmp_path / "hf", config=base)
    return str(err.value)


def test_mixtral_sliding_window_imports_and_exports(tmp_path):
    """A window shorter than the sequence is model.sliding_window on every layer (issue 29):
    transformers' logits, and the export writes the window back."""
    ref_model = save_hf("mixtral_gqa", tmp_path / "hf", model_kwargs=dict(sliding_window=5))
    model = from_hf(tmp_path / "hf")  # model.seq_length = max_position_embeddings = 64
    assert (model.config.model.sliding_window, model.config.model.local_attention_layers) == (5, None)
    ids = token_ids()
    assert max_diff(our_logits(model, ids), hf_logits(ref_model, ids)) <= TOL
    to_hf(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 5
    # A window covering the whole training sequence (12 <= 5 is false, 4 is) stays unset.
    base = Config()
    base.model.seq_length = 4
    assert from_hf(tmp_path / "hf", config=base).config.model.sliding_window == 0


def test_qwen_sliding_window_is_refused_only_when_used(tmp_path):
    message = _refused_config(tmp_path, "qwen3_norm_topk", lambda hf: hf.update(use_sliding_window=True,
                                                                                sliding_window=8))
    assert "sliding_window=8" in message
    hf = read_hf_config(tmp_path / "hf")
    hf.update(use_sliding_window=False, sliding_window=8)
    config_from_hf(hf)


@pytest.mark.parametrize("case,edit,named", [
    ("mixtral_gqa", lambda hf: hf["rope_parameters"].update(rope_type="linear", factor=2.0), "rope_type='linear'"),
    ("mixtral_gqa", lambda hf: hf.update(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling"),
    ("qwen3_norm_topk", lambda hf: hf.update(attention_bias=True), "attention_bias=True"),
    ("mixtral_gqa", lambda hf: hf.update(hidden_act="gelu"), "hidden_act='gelu'"),
    ("qwen2_shared_dense", lambda hf: hf.update(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    ("qwen2_shared_dense", lambda hf: hf.update(model_type="qwen2"), "model_type='qwen2'"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, case, edit, named):
    assert named in _refused_config(tmp_path, case, edit)


def test_tensor_without_a_place_is_refused(tmp_path):
    save_hf("mixtral_gqa", tmp_path / "hf")
    src = tmp_path / "hf" / "model.safetensors"
    with safe_open(str(src), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(32)
    save_file(tensors, str(src))
    with pytest.raises(HFWeightError, match="o_proj.bias"):
        from_hf(tmp_path / "hf")


def test_export_refuses_what_the_family_cannot_hold(tmp_path):
    save_hf("mixtral_gqa", tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError, match="qk_norm=false"):
        to_hf(model, tmp_path / "out", family="qwen3_moe")
    model.config.moe.score_function = "sigmoid"
    with pytest.raises(HFConfigError, match="moe.score_function=sigmoid"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- real configs

# preset -> the config its checkpoint was released with, and the auxiliary-loss
# coefficients (aux_loss_coeff, seq_aux_loss_coeff) that config sets. The config.json
# files stand in released/ as the Hub holds them (transformers 4.x keys, remote code for
# DeepSeek; DeepSeek-V3's less its fp8 quantization_config, which a bf16 conversion of the
# checkpoint has none of). transformers' defaults for ERNIE-4.5 and MiniMax-M2 are those
# checkpoints' (their documented ones), but for MiniMax-M2's rotary width, which its
# config.json sets (rotary_dim 64).
RELEASED = {
    "mixtral-8x7b": (lambda: released("mixtral-8x7b"), (0.02, 0.0)),
    "qwen3-30b-a3b": (lambda: released("qwen3-30b-a3b"), (0.001, 0.0)),
    "deepseek-v2-lite": (lambda: released("deepseek-v2-lite"), (0.0, 0.001)),
    "deepseek-v3": (lambda: released("deepseek-v3"), (0.0, 0.001)),
    "ernie-4.5-21b-a3b": (lambda: transformers.Ernie4_5_MoeConfig().to_dict(), (0.001, 0.0)),
    "minimax-m2": (lambda: transformers.MiniMaxM2Config(rotary_dim=64).to_dict(), (0.001, 0.0)),
}


def released(name: str) -> dict:
    """The config.json of a released checkpoint, from released/."""
    return json.loads((Path(__file__).parent / "released" / f"{name}.json").read_text())


@pytest.mark.parametrize("preset", list(RELEASED))
def test_released_configs_import_to_our_presets(preset):
    from moe_fold.config import load_config, moe_layer_flags
    from moe_fold.models.hf.importer import _architecture_mismatch

    hf, aux = RELEASED[preset]
    ours = load_config(preset)
    imported = config_from_hf(hf(), ours)
    assert _architecture_mismatch(ours, imported) == []
    assert moe_layer_flags(imported) == moe_layer_flags(ours)
    assert (imported.moe.aux_loss_coeff, imported.moe.seq_aux_loss_coeff) == aux


def test_released_qwen2_moe_config():
    config = config_from_hf(released("qwen1.5-moe-a2.7b"))
    m, moe = config.model, config.moe
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.rope_theta) == (24, 2048, 16, 16,
                                                                                                  128, 1e6)
    assert m.qkv_bias and m.seq_length == 8192 and moe.moe_layer_freq == 1 and moe.pre_softmax
    assert (moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.shared_expert_ffn_hidden_size) == (60, 4, 1408, 5632)


def test_qwen2_moe_without_shared_expert(tmp_path):
    """shared_expert_intermediate_size=0: the shared expert adds exactly zero, so none is built."""
    ids = token_ids()
    ref_model = save_hf("qwen2_shared_dense", tmp_path / "hf", model_kwargs=dict(shared_expert_intermediate_size=0))
    model = from_hf(tmp_path / "hf")
    assert model.layers[0].mlp.shared_expert is None
    assert max_diff(our_logits(model, ids), hf_logits(ref_model, ids)) <= TOL


def test_bfloat16_checkpoints_both_ways(tmp_path):
    """bf16 weights import exactly (widened to our float32 parameters); a bf16 model
    exports bf16 tensors and says so in config.json."""
    ids = token_ids()
    save_hf("qwen3_norm_topk", tmp_path / "hf_fp32")
    half = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf_fp32", dtype=torch.bfloat16)
    half.save_pretrained(tmp_path / "hf")
    wide = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    model = from_hf(tmp_path / "hf")
    assert max_diff(our_logits(model, ids), hf_logits(wide, ids)) <= TOL
    to_hf(model.to(torch.bfloat16), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert b.get_tensor(key).dtype == torch.bfloat16 and torch.equal(a.get_tensor(key), b.get_tensor(key))


def test_latent_norm_epsilon_compares_as_the_norms_use_it():
    """``model.mla_norm_eps`` null means ``model.norm_eps``: a preset at norm_eps 1e-6 and a
    checkpoint that names 1e-6 for the latents agree; 1e-5 latents against 1e-6 do not."""
    from moe_fold.config import load_config
    from moe_fold.models.hf.importer import _architecture_mismatch

    ours = load_config("deepseek-v3-tiny")
    theirs = load_config("deepseek-v3-tiny", ["model.mla_norm_eps=1e-6"])
    assert ours.model.mla_norm_eps is None and ours.model.norm_eps == 1e-6
    assert _architecture_mismatch(ours, theirs) == []
    other = load_config("deepseek-v3-tiny", ["model.mla_norm_eps=1e-5"])
    assert _architecture_mismatch(ours, other) == ["model.mla_norm_eps: the model has None, the checkpoint 1e-05"]

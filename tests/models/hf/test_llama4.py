"""Llama-4 text Hugging Face interop (docs/families/llama4.md): tiny random
``Llama4ForCausalLM`` models of odd sizes, built with transformers' own classes and saved
with save_pretrained, import with transformers' logits on one process and under tp2 x ep2
and pp2 x cp2 on gloo ranks; export writes back the very same safetensors tensors; what
the importer cannot represent is refused by name.

The model: top-1 sigmoid routing whose prob scales the expert's input, an ungated shared
expert, MoE on every other layer (dense layers of their own width), chunked attention
(chunks of 5 in sequences of 12) on the rotary layers, a NoPE layer with temperature
tuning (``floor_scale`` 4, so the factor changes inside the sequence), the L2 QK-norm,
interleaved rotary pairs."""

import json

import pytest
import torch
import transformers

from moe_fold.config import ConfigError
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, config_from_hf, export_family
from tests.helpers.hf_family_checks import check_layouts
from tests.models.hf.test_deepseek_v3 import VOCAB, _tensors, hf_logits, max_diff, randomize, token_ids

# Odd sizes: vocab 70, 6 heads of 8 over 2 kv heads (hidden 42), dense ffn 50, experts of 22.
LLAMA4 = dict(vocab_size=VOCAB, hidden_size=42, intermediate_size=22, intermediate_size_mlp=50, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=2, head_dim=8, num_local_experts=6, num_experts_per_tok=1,
              interleave_moe_layer_step=2, attention_chunk_size=5, no_rope_layer_interval=4, floor_scale=4,
              attn_scale=0.3, max_position_embeddings=64, rope_parameters=dict(rope_type="default", rope_theta=1e4))

CASES = {
    "llama4": {},
    # Every layer MoE, two NoPE layers, no QK-norm, no temperature tuning.
    "llama4_all_moe": dict(interleave_moe_layer_step=1, no_rope_layers=[1, 0, 1, 0], use_qk_norm=False,
                           attn_temperature_tuning=False),
}


def hf_model(case: str = "llama4", seed: int = 0, **overrides):
    config = transformers.Llama4TextConfig(**{**LLAMA4, **CASES[case], **overrides})
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(config).eval()
    return randomize(model, seed)


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers_and_export_round_trips(case, tmp_path):
    ids = token_ids()
    ref_model = hf_model(case)
    ref_model.save_pretrained(tmp_path / "hf")
    ref = hf_logits(ref_model, ids)
    model = from_hf(tmp_path / "hf")
    assert export_family(model.config) == "llama4_text"
    diff = max_diff(model.eval().logits(ids), ref)
    print(f"{case}: max abs logit diff vs transformers {diff:.3g}")
    assert diff <= 1e-5
    to_hf(model, tmp_path / "out")
    a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is transformers.Llama4ForCausalLM
    assert max_diff(hf_logits(back, ids), ref) <= 1e-5


def test_config_mapping():
    config = config_from_hf(hf_model().config.to_dict())
    m, moe = config.model, config.moe
    assert (m.attention_chunk, m.local_attention_layers, m.rope_layers) == (5, [1, 1, 1, 0], [1, 1, 1, 0])
    assert (m.qk_norm, m.qk_norm_scope, m.rope_interleave, m.head_dim, m.ffn_hidden_size) == (True, "l2", True, 8, 50)
    assert (m.attn_temperature_tuning, m.attn_temperature_floor, m.attn_temperature_scale) == (True, 4, 0.3)
    assert (moe.score_function, moe.topk, moe.score_on_input, moe.num_experts, moe.ffn_hidden_size) == (
        "sigmoid", 1, True, 6, 22)
    assert (moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate, moe.moe_layer_freq) == (22, False, [0, 1, 0, 1])


def _refused(tmp_path, edit):
    hf_model().save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    hf = json.loads(file.read_text())
    edit(hf)
    file.write_text(json.dumps(hf))
    with pytest.raises((HFConfigError, ConfigError)) as err:
        from_hf(tmp_path / "hf")
    return str(err.value)


@pytest.mark.parametrize("edit, named", [
    (lambda hf: hf.update(num_experts_per_tok=2), "num_experts_per_tok=2 is not supported"),
    (lambda hf: hf.update(rope_scaling=dict(rope_type="llama3", factor=8.0)), "rope_scaling="),
    (lambda hf: hf.update(attention_bias=True), "attention_bias=True"),
    (lambda hf: hf.update(attention_chunk_size=None), "attention_chunk_size is null"),
    (lambda hf: hf.update(layer_types=["sliding_attention"] * 4), "layer_types="),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, edit, named):
    assert named in _refused(tmp_path, edit)


def test_export_refuses_what_the_family_cannot_hold(tmp_path):
    hf_model().save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError, match="moe.score_on_input=true: mixtral scales each expert's output"):
        to_hf(model, tmp_path / "out", family="mixtral")
    with pytest.raises(HFConfigError, match="model.attention_chunk=5: qwen3_moe has no such attention setting"):
        to_hf(model, tmp_path / "out", family="qwen3_moe")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, cp=2)], ids=["tp2_ep2", "pp2_cp2"])
def test_import_under_layouts(tmp_path, sizes):
    check_layouts({case: hf_model(case) for case in CASES}, "llama4_text", sizes, tmp_path)


# --------------------------------------------------------------------------- a trained preset exported

def test_trained_preset_exports_and_generates_what_sample_gives(tmp_path):
    """llama4-tiny trained 12 steps from the preset (chunks of 8, temperature floor 4, so
    both act inside the 32 tokens sampled), converted by the CLI: transformers'
    AutoTokenizer + AutoModelForCausalLM.generate give ``moe-fold sample``'s greedy tokens."""
    import warnings
    from pathlib import Path

    from moe_fold.cli import main
    from moe_fold.config import load_config
    from moe_fold.data.hf_tokenizer import prompt_ids
    from moe_fold.data.tokenizer import load_tokenizer
    from moe_fold.training.train import train
    from tests.models.test_sampling import GREEDY, PROMPT, _ours

    config = load_config("llama4-tiny", [
        "model.hidden_size=64", "model.seq_length=64", "model.attention_chunk=8", "model.attn_temperature_floor=4",
        "train.steps=12", "train.save_every=12", "train.micro_batch_size=4", "train.global_batch_size=8",
        "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1",
        f"train.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"])
    checkpoint = Path(train(config, progress=False).checkpoint)
    out = tmp_path / "hf"
    assert main(["convert", str(checkpoint), str(out), "--no-progress"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is transformers.Llama4ForCausalLM
    enc = tokenizer(PROMPT, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == prompt_ids(load_tokenizer("byte"), PROMPT)
    hf = model.generate(**enc, max_new_tokens=GREEDY["max_new_tokens"], do_sample=False)
    new = hf[0, enc["input_ids"].shape[1]:].tolist()
    assert new == _ours(checkpoint, "byte", GREEDY)[0]

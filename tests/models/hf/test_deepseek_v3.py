"""DeepSeek-V3 (multi-head latent attention) Hugging Face interop: tiny random
``DeepseekV3ForCausalLM`` models of odd sizes, built with transformers' own classes and
saved with save_pretrained, import with transformers' logits (q_lora_rank set and
unset, interleaved and plain rotary pairs, default and YaRN rotary) on one process and
under tp2 x ep2 and pp2 x cp2 on gloo ranks; export (from one process and from both
layouts) writes back the very same safetensors tensors; what the importer cannot
represent is refused by name."""

import copy
import json

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from moe_fold.config import load_config
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, HFWeightError, config_from_hf
from tests.models.hf.test_importer import hf_logits

VOCAB, SEQ, BATCH, TOL = 70, 12, 2, 1e-4

# Odd sizes: 6 heads, hidden 42, q/kv ranks 14/10, qk 6+4, v 5; 8 experts in 4 groups.
COMMON = dict(vocab_size=VOCAB, hidden_size=42, intermediate_size=50, moe_intermediate_size=22, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=6, n_routed_experts=8, n_group=4, topk_group=2,
              num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=10, qk_nope_head_dim=6,
              qk_rope_head_dim=4, v_head_dim=5, max_position_embeddings=64, num_nextn_predict_layers=0,
              routed_scaling_factor=2.5)

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.8)

CASES = {
    # Low-rank query, interleaved rotary pairs, YaRN with a softmax mscale.
    "q_lora_yarn": dict(q_lora_rank=14, rope_interleave=True, rope_parameters=YARN),
    # Full-rank query, plain rotary halves, no rotary scaling, two shared experts, no groups.
    "no_q_lora": dict(q_lora_rank=None, rope_interleave=False, n_shared_experts=2, n_group=1, topk_group=1,
                      num_experts_per_tok=3, routed_scaling_factor=1.7,
                      rope_parameters=dict(rope_type="default", rope_theta=5e4)),
    # num_experts_per_tok 3 != 2 x topk_group: a group still ranks by its best 2 scores.
    "groups_k3": dict(q_lora_rank=14, rope_interleave=False, num_experts_per_tok=3,
                      rope_parameters=dict(rope_type="default", rope_theta=1e4)),
}


def hf_model(case: str, seed: int = 0):
    """A tiny transformers DeepSeek-V3 with weights large enough that routing and every
    layer matter (matrices N(0, 0.2), norms U(0.5, 1.5), score correction bias N(0, 0.1))."""
    config = transformers.DeepseekV3Config(**{**COMMON, **CASES[case]})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    # transformers' grouped-mm experts want 16-byte rows, which odd widths do not have.
    model.set_experts_implementation("eager")
    return randomize(model, seed)


def randomize(model, seed: "int | torch.Generator"):
    """``model`` with matrices N(0, 0.2), vectors U(0.5, 1.5) and any score correction
    bias N(0, 0.1), drawn from ``seed`` (or from a generator the caller goes on using):
    large enough that routing and every layer matter."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            else:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model


def saved_with_logits(folder, models: dict, ids) -> tuple[dict, dict]:
    """Save each of ``models`` (name -> transformers model) under ``folder/name``; returns
    ``(logits of ids, path)`` dicts by name, the references a layout test compares with."""
    refs, paths = {}, {}
    for name, model in models.items():
        model.save_pretrained(folder / name)
        refs[name], paths[name] = hf_logits(model, ids), str(folder / name)
    return refs, paths


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def _tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers_and_export_round_trips(case, tmp_path):
    from tests.helpers.hf_family_checks import check_import_and_round_trip  # it imports this module's helpers

    model = check_import_and_round_trip(hf_model(case), "deepseek_v3", tmp_path, label=case)
    m = model.config.model
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == ("mla", CASES[case]["q_lora_rank"], 10, 5)
    assert model.layers[1].mlp.router.expert_bias.abs().sum() > 0


def test_config_mapping():
    config = config_from_hf(hf_model("q_lora_yarn").config.to_dict())
    m, moe = config.model, config.moe
    assert (m.num_heads, m.num_kv_heads, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim) == (6, 6, 14, 6, 4)
    assert m.rope_interleave and m.rope_scaling == "yarn"
    assert (m.yarn_factor, m.yarn_original_max_position_embeddings, m.yarn_mscale, m.yarn_mscale_all_dim) == (
        4.0, 16, 1.0, 0.8)
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.group_topk, moe.topk) == ("sigmoid", True, 4, 2, 4)
    assert (moe.first_k_dense, moe.scaling_factor, moe.shared_expert_ffn_hidden_size) == (1, 2.5, 22)
    assert moe.group_score == "top2_sum"
    plain = config_from_hf(hf_model("no_q_lora").config.to_dict())
    assert plain.model.q_lora_rank is None and plain.model.rope_scaling is None and not plain.model.rope_interleave
    assert (plain.moe.num_groups, plain.moe.shared_expert_ffn_hidden_size, plain.model.rope_theta) == (None, 44, 5e4)


# The config.json of DeepSeek-V3 as the Hub holds it (4.x keys, remote code), less its
# fp8 quantization_config (a bf16 conversion of the checkpoint has none).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def test_released_config_imports_to_our_preset():
    from moe_fold.models.hf.importer import _architecture_mismatch

    ours = load_config("deepseek-v3")
    imported = config_from_hf(DEEPSEEK_V3, ours)
    assert _architecture_mismatch(ours, imported) == []
    assert imported.moe.first_k_dense == 3 and imported.moe.seq_aux_loss_coeff == 0.001


def test_checkpoint_loads_into_a_model_that_ranks_groups_alike():
    """A DeepSeek-V3 checkpoint (top2_sum) fits a model with Megatron-Core's topk_sum when
    topk = 2 x group_topk (the same ranking), not one with max."""
    from moe_fold.models.hf.importer import _architecture_mismatch

    theirs = config_from_hf(hf_model("q_lora_yarn").config.to_dict())
    ours = copy.deepcopy(theirs)
    ours.moe.group_score = "topk_sum"
    assert _architecture_mismatch(ours, theirs) == []
    ours.moe.group_score = "max"
    assert _architecture_mismatch(ours, theirs) == ["moe.group_score: the model has 'max', the checkpoint 'top2_sum'"]


def _refused(tmp_path, edit, case="q_lora_yarn"):
    hf_model(case).save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    hf = json.loads(file.read_text())
    edit(hf)
    file.write_text(json.dumps(hf))
    with pytest.raises(HFConfigError) as err:
        from_hf(tmp_path / "hf")
    return str(err.value)


@pytest.mark.parametrize("edit,named", [
    (lambda hf: hf.update(norm_topk_prob=False), "norm_topk_prob=False"),
    (lambda hf: hf.update(topk_group=1), "topk_group=1"),
    (lambda hf: hf.update(attention_bias=True), "attention_bias=True"),
    (lambda hf: hf.update(num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads=6"),
    (lambda hf: hf["rope_parameters"].update(rope_type="linear"), "rope_type='linear'"),
    (lambda hf: hf["rope_parameters"].update(attention_factor=0.5), "attention_factor=0.5"),
    (lambda hf: hf.update(scoring_func="softmax"), "scoring_func='softmax'"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, edit, named):
    assert named in _refused(tmp_path, edit)


def test_multi_token_prediction_tensors_are_refused(tmp_path):
    """With num_nextn_predict_layers=0 an MTP layer's tensors (model.layers.{num_hidden_layers}.*)
    have no place (tests/models/hf/test_mtp.py imports them when the config declares them)."""
    hf_model("no_q_lora").save_pretrained(tmp_path / "hf")
    tensors = _tensors(tmp_path / "hf")
    tensors["model.layers.4.eh_proj.weight"] = torch.zeros(42, 84)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(HFWeightError, match="model.layers.4.eh_proj.weight"):
        from_hf(tmp_path / "hf")


def test_export_refuses_what_deepseek_v3_cannot_hold(tmp_path):
    hf_model("no_q_lora").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf")
    with pytest.raises(HFConfigError, match="model.attention=mla: mixtral has standard attention"):
        to_hf(model, tmp_path / "out", family="mixtral")
    model.config.moe.shared_expert_gate = True
    with pytest.raises(HFConfigError, match="shared_expert_gate=true"):
        to_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_takes_the_group_scores_deepseek_v3_ranks_alike(tmp_path):
    """transformers ranks a group by its best 2 scores: Megatron-Core's topk_sum exports when
    topk = 2 x group_topk (the same ranking: the re-import gives the same logits); max, or
    topk_sum with another ratio, is refused by name."""
    hf_model("q_lora_yarn").save_pretrained(tmp_path / "hf")
    model = from_hf(tmp_path / "hf").eval()
    ids = token_ids()
    want = model.logits(ids)
    model.config.moe.group_score = "topk_sum"  # topk 4, group_topk 2: the best 2 scores
    assert torch.equal(model.logits(ids), want)
    to_hf(model, tmp_path / "megatron")
    assert torch.equal(from_hf(tmp_path / "megatron").eval().logits(ids), want)
    model.config.moe.group_score = "max"
    assert not torch.equal(model.logits(ids), want)  # the router reads the config: max routes otherwise
    with pytest.raises(HFConfigError, match=r"moe.group_score=max with moe.topk=4 and moe.group_topk=2: .* "
                                            r"rank a group by the sum of its best 2 scores, this model by its best 1"):
        to_hf(model, tmp_path / "max")
    model.config.moe.group_score, model.config.moe.group_topk = "topk_sum", 4
    with pytest.raises(HFConfigError, match="moe.group_score=topk_sum with moe.topk=4 and moe.group_topk=4"):
        to_hf(model, tmp_path / "ratio")
    assert not (tmp_path / "max").exists() and not (tmp_path / "ratio").exists()


# --------------------------------------------------------------------------- layouts

def _gathered_logits(model, groups, ids):
    """Full logits ``[B, S, V]`` of the whole batch, on every rank: the pipeline stages
    run in turn (stage 0's hidden states sent to stage 1), the last stage's logits are
    gathered over tp and over cp (zigzag shards back to natural order)."""
    from moe_fold.comm import gather_from_tp_region
    from moe_fold.parallel.context_parallel import zigzag_gather, zigzag_positions, zigzag_split

    cp, cp_rank, pp = groups.size("cp"), groups.rank_in("cp"), groups.size("pp")
    local_ids = zigzag_split(ids, cp_rank, cp, dim=1)
    positions = zigzag_positions(SEQ, cp_rank, cp)
    with torch.no_grad():
        x = None
        if model.stages[0] > 0:
            x = torch.empty(SEQ // cp // (groups.size("tp") if model.config.parallel.sequence_parallel else 1),
                            BATCH, model.config.model.hidden_size)
            dist.recv(x, dist.get_global_rank(groups.pp, groups.rank_in("pp") - 1))
        x = model._chunk_hidden(0, x, local_ids, positions)
        if model.stages[0] < pp - 1:
            dist.send(x.contiguous(), dist.get_global_rank(groups.pp, groups.rank_in("pp") + 1))
            logits = torch.zeros(BATCH, SEQ, VOCAB)
        else:
            local = gather_from_tp_region(model.lm_head(model.norm(x)), groups.tp, dim=-1)  # [S_local, B, V]
            shards = [torch.empty_like(local) for _ in range(cp)]
            dist.all_gather(shards, local.contiguous(), group=groups.cp)
            logits = zigzag_gather(shards, dim=0).transpose(0, 1).contiguous()  # [B, S, V]
    # Every rank returns the last stage's logits.
    dist.broadcast(logits, dist.get_global_rank(groups.pp, pp - 1), group=groups.pp)
    return logits


def _import_export(rank, world_size, sizes, paths, out_dir):
    from tests.models.hf.test_parallel import count_reads

    groups = create_process_groups(ParallelLayout(world_size, **sizes))
    counted = count_reads()
    results = {}
    for case, path in paths.items():
        counted[0] = 0
        model = from_hf(path, groups).eval()
        local = sum(t.numel() for t in model.state_dict().values())  # parameters and the expert bias
        results[case] = {"logits": _gathered_logits(model, groups, token_ids()), "read": counted[0], "local": local}
        to_hf(model, f"{out_dir}/{case}")
    return results


@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, cp=2)], ids=["tp2_ep2", "pp2_cp2"])
def test_import_under_layouts(tmp_path, sizes):
    refs, paths = saved_with_logits(tmp_path, {case: hf_model(case) for case in CASES}, token_ids())
    results = run_ranks(_import_export, 4, sizes, paths, str(tmp_path / "out"), timeout=240)
    for case, ref in refs.items():
        for rank, result in enumerate(results):
            diff = max_diff(result[case]["logits"], ref)
            print(f"{sizes} {case} rank {rank}: max abs logit diff vs transformers {diff:.3g}")
            assert diff <= TOL
            # Every local element read once, nothing else: the rank read only its slices.
            assert result[case]["read"] == result[case]["local"], (case, rank)
        # The export gathered from the shards (and, under pp, the stages) writes the same tensors.
        a, b = _tensors(tmp_path / case), _tensors(tmp_path / "out" / case)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), case


def test_other_families_reset_an_mla_base():
    """A Mixtral config.json over the deepseek-v3 preset as base gives standard attention."""
    from tests.models.hf.test_importer import hf_model as mixtral_like
    from moe_fold.config import validate

    config = config_from_hf(mixtral_like("mixtral_gqa").config.to_dict(), load_config("deepseek-v3-tiny"))
    m = config.model
    assert (m.attention, m.kv_lora_rank, m.rope_scaling, m.yarn_factor, m.rope_interleave) == ("mha", None, None,
                                                                                                  None, False)
    validate(config, 1)

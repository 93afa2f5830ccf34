"""Multi-token prediction weights in DeepSeek-V3 and GLM-4.5 checkpoints.

Transformers builds no MTP layer (it drops ``model.layers.{num_hidden_layers}.*`` when it
loads), so the checkpoint is made here as the released ones are laid out: a transformers
model with one more decoder layer supplies layer L's block tensors, and layer L gets the
MTP's ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm`` and the copies of the
embedding (``embed_tokens``) and head (``shared_head.head``); ``num_hidden_layers`` says L
and ``num_nextn_predict_layers`` 1. Imported: the main logits equal transformers' (which
ignores layer L), MTP depth 1's logits equal DeepSeek-V3's formula run with transformers'
own decoder layer L, and export writes back the very same tensors."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from moe_fold.models import from_hf, to_hf
from tests.helpers.hf_family_checks import SEQ, max_diff, randomize, tensors as _tensors, token_ids
from tests.models.hf.test_families import DEEPSEEK_V3 as DEEPSEEK, GLM, SPECS

TOL = 1e-4
DEEPSEEK_CASES = SPECS["deepseek_v3"].cases

FAMILIES = {
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    {**DEEPSEEK, **DEEPSEEK_CASES["q_lora_yarn"]}),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM, GLM),
}


def _checkpoint_with_mtp(family, path):
    """Write the checkpoint (see the module doc); return transformers' model with L + 1
    layers, whose layer L is the MTP block, and the MTP tensors added."""
    config_cls, model_cls, kwargs = FAMILIES[family]
    layers = kwargs["num_hidden_layers"]
    overrides = dict(num_hidden_layers=layers + 1)
    overrides["num_nextn_predict_layers" if family == "deepseek_v3" else "num_mtp_layers"] = 0
    big = model_cls(config_cls(**{**kwargs, **overrides})).eval()
    big.set_experts_implementation("eager")
    gen = torch.Generator().manual_seed(5)
    randomize(big, gen)  # the MTP tensors below come from the same generator
    big.save_pretrained(path)
    tensors = _tensors(path)
    H = kwargs["hidden_size"]
    pre = f"model.layers.{layers}."
    mtp = {f"{pre}eh_proj.weight": torch.randn(H, 2 * H, generator=gen) * 0.2,
           f"{pre}enorm.weight": torch.rand(H, generator=gen) + 0.5,
           f"{pre}hnorm.weight": torch.rand(H, generator=gen) + 0.5,
           f"{pre}shared_head.norm.weight": torch.rand(H, generator=gen) + 0.5,
           f"{pre}embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
           f"{pre}shared_head.head.weight": tensors["lm_head.weight"].clone()}
    save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    file = path / "config.json"
    hf = json.loads(file.read_text())
    hf.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    hf.pop("num_mtp_layers", None)
    file.write_text(json.dumps(hf))
    return big, mtp


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def _mtp_reference(big, mtp, ids, layers):
    """Depth 1's logits ``[B, S-1, V]`` by DeepSeek-V3's formula with transformers' modules:
    h0 = the first L layers' output, x = eh_proj([enorm(emb(t+1)); hnorm(h0(t))]), then
    decoder layer L, shared_head.norm and the head."""
    inner, eps, pre = big.model, big.config.rms_norm_eps, f"model.layers.{layers}."
    S = ids.shape[1]
    positions = torch.arange(S).unsqueeze(0)
    x = inner.embed_tokens(ids)
    rotary = inner.rotary_emb(x, positions)
    for layer in inner.layers[:layers]:
        x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
    emb = inner.embed_tokens(ids[:, 1:])
    h = torch.cat([_rms(emb, mtp[f"{pre}enorm.weight"], eps), _rms(x[:, :-1], mtp[f"{pre}hnorm.weight"], eps)], -1)
    h = h @ mtp[f"{pre}eh_proj.weight"].t()
    short = inner.rotary_emb(h, positions[:, :-1])
    h = inner.layers[layers](h, attention_mask=None, position_ids=positions[:, :-1], position_embeddings=short)
    return big.lm_head(_rms(h, mtp[f"{pre}shared_head.norm.weight"], eps))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mtp_weights_import_compute_deepseek_v3_formula_and_export_back(family, tmp_path):
    ids = token_ids()
    big, mtp = _checkpoint_with_mtp(family, tmp_path / "hf")
    layers = FAMILIES[family][2]["num_hidden_layers"]
    main = FAMILIES[family][1].from_pretrained(tmp_path / "hf", experts_implementation="eager").eval()
    with torch.no_grad():
        ref = main(ids).logits.float()
    model = from_hf(tmp_path / "hf").eval()
    assert model.config.model.mtp_num_layers == 1
    diff = max_diff(model.logits(ids), ref)
    print(f"{family}: main logits max abs diff vs transformers {diff:.3g}")
    assert diff <= TOL

    with torch.no_grad():
        positions = torch.arange(SEQ)
        rotary = model._rotary(positions)
        x = model._chunk_hidden(0, None, ids, positions, None, rotary)
        shifted = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
        depth = model.mtp[0]
        h = depth(x, model.embed(shifted.t()), *rotary, None)
        ours = model.lm_head(depth.norm(h)).transpose(0, 1)[:, :-1]  # [B, S-1, V]
    diff = max_diff(ours, _mtp_reference(big, mtp, ids, layers))
    print(f"{family}: MTP depth 1 logits max abs diff vs the formula on transformers' layer {diff:.3g}")
    assert diff <= TOL

    to_hf(model, tmp_path / "out")
    a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(a) == set(b) and set(mtp) <= set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_checkpoint_without_mtp_tensors_imports_without_mtp(tmp_path):
    """transformers saves no MTP tensors though its config keeps num_nextn_predict_layers."""
    config_cls, model_cls, kwargs = FAMILIES["glm4_moe"]
    model_cls(config_cls(**{**kwargs, "num_mtp_layers": 1})).save_pretrained(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert from_hf(tmp_path / "hf").config.model.mtp_num_layers == 0


def _import_export(rank, world_size, sizes, paths, out_dir):
    from moe_fold.layout import ParallelLayout, create_process_groups
    from tests.helpers.hf_family_checks import gathered_logits as _gathered_logits

    groups = create_process_groups(ParallelLayout(world_size, **sizes))
    results = {}
    for family, path in paths.items():
        model = from_hf(path, groups).eval()
        results[family] = (model.mtp is not None, _gathered_logits(model, groups, token_ids()))
        to_hf(model, f"{out_dir}/{family}")
    return results


@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2), dict(pp=2, cp=2)], ids=["tp2_ep2", "pp2_cp2"])
def test_mtp_checkpoints_under_layouts(tmp_path, sizes):
    """The MTP depths land on the last stage (an embedding copy there under pp2, read from
    the same tensor), the main logits are transformers', and the export gathered from
    the shards (and stages) writes back the same tensors, MTP layer and copies included."""
    from moe_fold.launch import run_ranks

    ids, refs, paths = token_ids(), {}, {}
    for family in FAMILIES:
        _checkpoint_with_mtp(family, tmp_path / family)
        main = FAMILIES[family][1].from_pretrained(tmp_path / family, experts_implementation="eager").eval()
        with torch.no_grad():
            refs[family] = main(ids).logits.float()
        paths[family] = str(tmp_path / family)
    results = run_ranks(_import_export, 4, sizes, paths, str(tmp_path / "out"), timeout=300)
    for family, ref in refs.items():
        for rank, result in enumerate(results):
            has_mtp, logits = result[family]
            assert has_mtp == (sizes.get("pp", 1) == 1 or rank >= 2), (family, rank)  # pp rank 1 = ranks 2, 3
            assert max_diff(logits, ref) <= TOL, (family, rank)
        a, b = _tensors(tmp_path / family), _tensors(tmp_path / "out" / family)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), family

"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, docs/families/deepseek-v3.md): multi-head latent
attention (``model.attention: mla`` with the same size names), ``rope_interleave``, default
or YaRN rotary (``rope_parameters``); sigmoid scores with the ``e_score_correction_bias``
(our expert bias), renormalised over the top-k (``norm_topk_prob: true``; we always
renormalise sigmoid top-k > 1) and scaled by ``routed_scaling_factor``; group-limited
routing that ranks a group by its best two scores whatever ``num_experts_per_tok`` is
(``moe.group_score: top2_sum``; the exporter also takes Megatron-Core's ``topk_sum`` when
topk = 2 x group_topk, where the two rules agree, and refuses the others);
``n_shared_experts`` ungated shared experts of width ``moe_intermediate_size`` each (one
shared expert of the summed width); the first ``first_k_dense_replace`` layers dense.
``num_nextn_predict_layers`` is ``model.mtp_num_layers`` (the importer keeps only the depths
whose tensors the checkpoint holds: transformers drops them when it saves)."""

from __future__ import annotations

from moe_fold.config import Config

from .base import Family, Keys, Refuse, rope_to_hf
from .deepseek_common import (MOE_NAMES_BIASED, deepseek_moe_from_hf, deepseek_moe_refusals, deepseek_moe_to_hf,
                              latent_eps_refusal, mla_from_hf, mla_tail_to_hf, mla_to_hf)


def from_hf(keys: Keys, config: Config) -> None:
    mla_from_hf(keys, config, "deepseek_v3")
    config.model.rope_interleave = bool(keys.get("rope_interleave", True))
    keys.must_be("scoring_func", ("sigmoid",), "DeepSeek-V3 routes with sigmoid scores")
    keys.must_be("topk_method", ("noaux_tc",), "routing is group-limited top-k with the score correction bias")
    keys.must_be("moe_layer_freq", (1,), "every layer after first_k_dense_replace is MoE")
    deepseek_moe_from_hf(keys, config)


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    refuse(config.model.attention != "mla", "model.attention=mha: DeepSeek-V3 has multi-head latent attention")
    latent_eps_refusal(config, refuse, "deepseek_v3")
    deepseek_moe_refusals(config, flags, refuse)


def to_hf(config: Config, flags: list) -> dict:
    m = config.model
    return {**mla_to_hf(config), "rope_interleave": m.rope_interleave, **mla_tail_to_hf(config),
            "rope_parameters": rope_to_hf(m), **deepseek_moe_to_hf(config)}


FAMILY = Family(
    model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM",
    features=frozenset({"mla", "mla_norm_eps", "mtp", "rope_interleave", "yarn"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: config.model.attention == "mla", export_priority=20,
    moe_names=MOE_NAMES_BIASED)

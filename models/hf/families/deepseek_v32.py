"""DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, docs/families/deepseek-v3.2.md): DeepSeek-V3's
model (:mod:`.deepseek_v3`: MLA with a query latent and interleaved rotary pairs, sigmoid
routing with the score correction bias over groups, ungated shared experts, the first
layers dense) plus DeepSeek Sparse Attention on every layer (``model.dsa``,
:mod:`moe_fold.models.dsa`): a lightning indexer of ``index_n_heads`` heads of
``index_head_dim`` whose rotary rotates two halves, and MLA over each query's
``index_topk`` best keys. transformers holds no MTP depths for it."""

from __future__ import annotations

from moe_fold.config import Config

from .base import Family, Keys, Refuse
from .deepseek_common import MOE_NAMES_BIASED, dsa_from_hf, dsa_mixer_sources, dsa_refusals, dsa_to_hf


def from_hf(keys: Keys, config: Config) -> None:
    dsa_from_hf(keys, config, "deepseek_v32")
    config.model.index_rope_interleave = False


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m = config.model
    dsa_refusals(config, flags, refuse, "deepseek_v32", interleave=False)
    refuse(m.indexer_types is not None and "shared" in m.indexer_types,
           f"model.indexer_types={m.indexer_types}: every deepseek_v32 layer runs its own indexer (GLM-5 shares)")


def to_hf(config: Config, flags: list) -> dict:
    return dsa_to_hf(config)


FAMILY = Family(
    model_type="deepseek_v32", architecture="DeepseekV32ForCausalLM",
    features=frozenset({"mla", "mla_norm_eps", "rope_interleave", "yarn", "dsa"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: config.model.dsa and not config.model.index_rope_interleave, export_priority=15,
    moe_names=MOE_NAMES_BIASED, mixer_sources=dsa_mixer_sources)

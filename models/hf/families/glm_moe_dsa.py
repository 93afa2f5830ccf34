"""GLM-5 (``GlmMoeDsaForCausalLM``, model_type ``glm_moe_dsa``, docs/families/glm-5.md):
DeepSeek-V3.2's model (:mod:`.deepseek_v32`) whose indexer rotates interleaved pairs
(``model.index_rope_interleave``), and whose ``indexer_types`` let a ``shared`` layer reuse
the selection of the nearest ``full`` layer before it (``model.indexer_types``; such a
layer has no indexer tensors)."""

from __future__ import annotations

from moe_fold.config import Config

from .base import Family, Keys, Refuse
from .deepseek_common import MOE_NAMES_BIASED, dsa_from_hf, dsa_mixer_sources, dsa_refusals, dsa_to_hf


def from_hf(keys: Keys, config: Config) -> None:
    m = config.model
    dsa_from_hf(keys, config, "glm_moe_dsa")
    m.index_rope_interleave = True
    types = keys.get("indexer_types", None)
    if types is not None:
        odd = sorted(set(types) - {"full", "shared"})
        if odd:
            keys.problems.append(f"indexer_types has {odd}: only full and shared are known")
        elif len(types) != m.num_layers:
            keys.problems.append(f"indexer_types has {len(types)} entries; num_hidden_layers={m.num_layers} needs "
                                 f"one each")
        elif "shared" in types:
            m.indexer_types = list(types)


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    dsa_refusals(config, flags, refuse, "glm_moe_dsa", interleave=True)


def to_hf(config: Config, flags: list) -> dict:
    m = config.model
    return {**dsa_to_hf(config), "indexer_types": m.indexer_types or ["full"] * m.num_layers}


FAMILY = Family(
    model_type="glm_moe_dsa", architecture="GlmMoeDsaForCausalLM",
    features=frozenset({"mla", "mla_norm_eps", "rope_interleave", "yarn", "dsa"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: config.model.dsa and config.model.index_rope_interleave, export_priority=15,
    moe_names=MOE_NAMES_BIASED, mixer_sources=dsa_mixer_sources)

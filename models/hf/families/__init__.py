"""The Hugging Face families, one module each (``families/<model_type>.py``), registered by
``model_type``. Each module builds one :class:`~.base.Family`: its config mapping both ways,
its tensor names, the model features it holds and its refusals with their reasons. Shared
pieces live in :mod:`.base`, :mod:`.deepseek_common` (DeepSeek-V2/V3/V3.2, GLM-4.5 and GLM-5) and
:mod:`.standard` (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE). Adding a family: a module here and
its line in ``_MODULES`` (docs/families/README.md, "Adding a family")."""

from __future__ import annotations

from . import (deepseek_v2, deepseek_v3, deepseek_v32, ernie4_5_moe, glm4_moe, glm_moe_dsa, gpt_oss, kimi_linear,
               llama4_text, longcat_flash, minimax_m2, mixtral, nemotron_h, olmoe, qwen2_moe, qwen3_5_moe, qwen3_moe,
               qwen3_next)
from .base import FEATURES, METADATA_KEYS, Family, HFConfigError

__all__ = ["REGISTRY", "ALIASES", "FAMILIES", "FEATURES", "METADATA_KEYS", "Family", "HFConfigError", "lookup"]

# In the order error messages list them.
_MODULES = (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3, glm4_moe, olmoe, ernie4_5_moe, minimax_m2,
            llama4_text, gpt_oss, qwen3_next, qwen3_5_moe, kimi_linear, longcat_flash, deepseek_v32, glm_moe_dsa,
            nemotron_h)

# model_type -> Family
REGISTRY: dict[str, Family] = {module.FAMILY.model_type: module.FAMILY for module in _MODULES}

# A model_type a family reads besides its own -> that family (import only).
ALIASES: dict[str, Family] = {alias: family for family in REGISTRY.values() for alias in family.aliases}

# model_type -> the causal-LM class that reads it
FAMILIES: dict[str, str] = {name: family.architecture for name, family in REGISTRY.items()}


def lookup(model_type, field: str = "model_type", where: str = "unsupported Hugging Face model",
           aliases: bool = False) -> Family:
    """The family of ``model_type`` (or, with ``aliases``, of a model_type it reads: import);
    an :class:`HFConfigError` naming ``field``, the value and the supported ones when there is none."""
    if aliases and model_type in ALIASES:
        return ALIASES[model_type]
    if model_type not in REGISTRY:
        known = list(REGISTRY) + (list(ALIASES) if aliases else [])
        raise HFConfigError([f"{field}={model_type!r} is not one of {', '.join(known)}"], where)
    return REGISTRY[model_type]

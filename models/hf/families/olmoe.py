"""OLMoE (``OlmoeForCausalLM``, docs/families/olmoe.md): softmax top-k without
renormalisation (``norm_topk_prob: false``, our ``pre_softmax: true``), and a QK-norm over
the whole q and k projections (``model.qk_norm_scope: projection``); every layer MoE, its
experts ``intermediate_size`` wide; ``clip_qkv`` must be null."""

from __future__ import annotations

from moe_fold.config import Config, head_dim

from . import standard
from .base import Family, Keys, Refuse


def from_hf(keys: Keys, config: Config) -> None:
    standard.sizes_from_hf(keys, config, "olmoe", norm_eps=1e-6, theta=1e4, qk_norm=True)
    config.model.qk_norm_scope = "projection"
    standard.qwen_layers_from_hf(keys, config, experts_are_dense_wide=True)
    keys.must_be("clip_qkv", (None,), "q, k and v are not clipped here")
    standard.no_attention_bias(keys)


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m = config.model
    standard.refusals(config, refuse, "olmoe", qk_norm=True, qk_norm_scope="projection")
    refuse(not all(flags), f"moe layer pattern {[int(f) for f in flags]}: every OLMoE layer is MoE")
    refuse(head_dim(config) * m.num_heads != m.hidden_size,
           f"head_dim={head_dim(config)}: OLMoE's heads span model.hidden_size={m.hidden_size} exactly")


def to_hf(config: Config, flags: list) -> dict:
    hf = standard.qwen_to_hf(config, flags)
    for key in ("head_dim", "decoder_sparse_step", "mlp_only_layers", "use_sliding_window", "moe_intermediate_size"):
        del hf[key]
    hf.update(intermediate_size=config.moe.ffn_hidden_size, attention_bias=False, clip_qkv=None)
    return hf


FAMILY = Family(
    model_type="olmoe", architecture="OlmoeForCausalLM",
    features=frozenset({"qk_norm_scope"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: config.model.qk_norm and config.model.qk_norm_scope == "projection",
    export_priority=61)

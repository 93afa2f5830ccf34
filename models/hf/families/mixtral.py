"""Mixtral (``MixtralForCausalLM``, docs/families/mixtral.md): every layer MoE, the top-k of
the softmax always renormalised (our ``moe.pre_softmax: false``), a sliding window on every
layer, ``router_jitter_noise`` -> ``moe.input_jitter`` (ours jitters the router's input only;
Mixtral's also scales the experts' input, which changes nothing at evaluation). Its MoE
block is ``block_sparse_moe.`` with experts ``w1``/``w3``/``w2``."""

from __future__ import annotations

from moe_fold.config import Config

from . import standard
from .base import Family, Keys, MoeNames, Refuse, num_experts


def from_hf(keys: Keys, config: Config) -> None:
    m, moe = config.model, config.moe
    standard.sizes_from_hf(keys, config, "mixtral", norm_eps=1e-5, theta=1e6, qk_norm=False)
    moe.num_experts = num_experts(keys, "num_local_experts", "num_experts")
    moe.ffn_hidden_size = m.ffn_hidden_size
    moe.moe_layer_freq = 1
    moe.pre_softmax = False
    moe.input_jitter = float(keys.get("router_jitter_noise", 0.0))
    # Mixtral slides every layer's window (i - j < sliding_window, as model.sliding_window);
    # a window covering model.seq_length changes nothing in training and stays unset.
    window = keys.get("sliding_window", None)
    if window is not None and window < m.seq_length:
        m.sliding_window = int(window)


def refusals(config: Config, flags: list, refuse: Refuse) -> None:
    m, moe = config.model, config.moe
    standard.refusals(config, refuse, "mixtral", qk_norm=False)
    refuse(not all(flags), f"moe layer pattern {[int(f) for f in flags]}: every Mixtral layer is MoE")
    refuse(m.local_attention_layers is not None,
           f"model.local_attention_layers={m.local_attention_layers}: Mixtral's sliding window is on every layer")
    refuse(moe.pre_softmax, "moe.pre_softmax=true: Mixtral renormalises the top-k probabilities")


def to_hf(config: Config, flags: list) -> dict:
    moe = config.moe
    hf = standard.to_hf(config, moe.ffn_hidden_size)
    hf.update(num_local_experts=moe.num_experts, router_jitter_noise=moe.input_jitter,
              sliding_window=config.model.sliding_window or None)
    return hf


FAMILY = Family(
    model_type="mixtral", architecture="MixtralForCausalLM",
    features=frozenset({"sliding_window"}),
    from_hf=from_hf, refusals=refusals, to_hf=to_hf,
    exports=lambda config: True, export_priority=100,
    moe_names=MoeNames(block="block_sparse_moe.", experts=("w1", "w3", "w2")))

"""Where each of our parameters lives in a Hugging Face checkpoint, both ways: the
:class:`~.sources.Source` tree of every parameter of a model, for its family.

Hugging Face names (what ``save_pretrained`` writes and the Hub holds) shared by every
family, per layer ``model.layers.{i}.``: ``self_attn.{q,k,v,o}_proj.weight`` (``.bias`` on
q, k, v with ``model.qkv_bias``, on o with ``model.attention_out_bias``),
``self_attn.{q,k}_norm.weight`` (a QK-norm with a weight), ``self_attn.sinks``,
``input_layernorm`` and ``post_attention_layernorm``. Multi-head latent attention is
``self_attn.q_proj`` (no q_lora_rank) or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``;
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``. The MLP or MoE block
of a layer is the family's (``Family.mlp_sources``: by default ``mlp.`` with the router's
``gate.weight`` and per-expert ``gate_proj``/``up_proj``/``down_proj``, each ``[out, in]``,
named per family by its :class:`~.families.base.MoeNames`). Transformers 5 holds experts
fused in memory (``mlp.experts.gate_up_proj [E, 2F, H]``, ``mlp.experts.down_proj [E, H, F]``);
checkpoints in that form are read too. Export writes the per-expert form.
"""

from __future__ import annotations

from moe_fold.config import Config, moe_layer_flags

from .families import Family, lookup
from .families.base import attention_sources
from .sources import Cat, Copies, FirstRow, Halves, HFWeightError, SafetensorsFolder, Source, Stack, Take

__all__ = ["HFWeightError", "SafetensorsFolder", "Source", "Take", "Cat", "Stack", "Copies", "FirstRow", "Halves",
           "weight_sources", "attention_sources", "ignorable_hf_names"]

def weight_sources(config: Config, family: str, hf_names: frozenset = frozenset()) -> dict[str, Source]:
    """Our parameter (or persistent buffer: the expert bias) name -> its :class:`Source`,
    for a model of ``config`` in the Hugging Face ``family``. ``hf_names`` (the checkpoint's tensor names) tells which
    expert form a checkpoint uses; export passes none and gets the per-expert form.

    MTP depth k (DeepSeek-V3, GLM-4.5) is layer ``num_layers + k`` of the checkpoint: its
    block's tensors as a layer's, ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``
    (our ``mtp.{k}.norm``); its ``embed_tokens`` and ``shared_head.head`` are copies of
    the shared embedding and head (:class:`Copies`: read from the model's own, written
    to every copy)."""
    target = lookup(family, field="family", where="no Hugging Face weight names")
    m = config.model
    mtp = range(m.num_layers, m.num_layers + m.mtp_num_layers)
    model = target.model_prefix(hf_names)  # "model." (a multimodal wrapper's text model: elsewhere)

    def copies(name: str) -> tuple:
        # Export writes every copy; import reads the model's own and places the copies it finds.
        names = [f"{model}layers.{i}.{name}" for i in mtp]
        return tuple(Take(n) for n in names if not hf_names or n in hf_names)

    embed_copies, head_copies = copies("embed_tokens.weight"), copies("shared_head.head.weight")
    embed = f"{model}{target.embed_name}"
    head = Take(embed if m.tie_embeddings else "lm_head.weight")
    out: dict[str, Source] = {"embed.weight": Copies((Take(embed),) + embed_copies
                                                     + (head_copies if m.tie_embeddings else ())),
                              "norm.weight": Take(f"{model}{target.final_norm_name}")}
    if not m.tie_embeddings:
        out["lm_head.weight"] = Copies((head,) + head_copies)
    flags = moe_layer_flags(config)
    for i, is_moe in enumerate(flags):
        out.update(_layer_sources(config, target, i, f"{model}layers.{i}.", f"layers.{i}.", is_moe, hf_names))
    for k, i in enumerate(mtp):
        hf, ours = f"{model}layers.{i}.", f"mtp.{k}."
        out[f"{ours}enorm.weight"] = Take(f"{hf}enorm.weight")
        out[f"{ours}hnorm.weight"] = Take(f"{hf}hnorm.weight")
        out[f"{ours}eh_proj.weight"] = Take(f"{hf}eh_proj.weight")
        out[f"{ours}norm.weight"] = Take(f"{hf}shared_head.norm.weight")
        out.update(_layer_sources(config, target, i, hf, f"{ours}block.", flags[-1], hf_names))
    return out


def _layer_sources(config: Config, family: Family, layer: int, hf: str, ours: str, is_moe: bool,
                   hf_names: frozenset) -> dict[str, Source]:
    """The sources of one block's parameters: ours under ``ours``, theirs under ``hf``."""
    if family.layer_sources is not None:
        return family.layer_sources(config, layer, hf, ours, hf_names)
    out: dict[str, Source] = {}
    out[f"{ours}attn_norm.weight"] = Take(f"{hf}input_layernorm.weight")
    out[f"{ours}mlp_norm.weight"] = Take(f"{hf}post_attention_layernorm.weight")
    out.update((family.mixer_sources or attention_sources)(config, layer, hf, ours))
    out.update(family.mlp_sources(config, hf, ours, is_moe, hf_names))
    return out


def ignorable_hf_names(config: Config, hf_names: frozenset) -> set[str]:
    """Checkpoint tensors that hold nothing our model computes with: rotary frequency
    buffers some old checkpoints stored, a tied LM head saved beside the embedding, and
    a Qwen2-MoE shared expert of width 0 (its output is exactly zero)."""
    out = {n for n in hf_names if n.endswith("rotary_emb.inv_freq")}
    if config.model.tie_embeddings and "lm_head.weight" in hf_names:
        out.add("lm_head.weight")
    if config.moe.shared_expert_ffn_hidden_size == 0:
        out |= {n for n in hf_names if ".mlp.shared_expert" in n}
    return out

"""Hugging Face interop: import and export Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2,
DeepSeek-V3, GLM-4.5-MoE, OLMoE, ERNIE-4.5-MoE and MiniMax-M2 checkpoints
(``config.json`` + safetensors) in any parallel layout.

- :func:`from_hf` ``(path, groups=None, config=None) -> model``: a model with the
  checkpoint's weights, sharded for ``groups``; ``model.config`` is our Config.
- :func:`to_hf` ``(model, path)``: the inverse, loadable by transformers'
  ``from_pretrained`` with the same logits (a collective: every rank calls it);
  :func:`write_generation_config` adds the tokenizer's special ids.
- :func:`hf_config` and :func:`load_hf_into`: the two steps of :func:`from_hf`, for a
  training loop that builds its own model (``init.from_hf``).
"""

from .config_map import HFConfigError, config_from_hf, config_to_hf, export_family, hf_family
from .exporter import to_hf, write_generation_config
from .importer import from_hf, hf_config, hf_tokenizer, load_hf_into, read_hf_config
from .weights import HFWeightError

__all__ = ["from_hf", "to_hf", "write_generation_config", "hf_config", "hf_tokenizer", "load_hf_into", "read_hf_config", "config_from_hf",
           "config_to_hf", "export_family", "hf_family", "HFConfigError", "HFWeightError"]

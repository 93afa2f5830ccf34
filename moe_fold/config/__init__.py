"""Typed run configuration: one dataclass per section, loaded from YAML, overridden
from the command line, validated before any process group exists.

Sections: ``model``, ``moe``, ``parallel``, ``data``, ``optimizer``, ``train``,
``wandb``, ``init``. Field names are the keys of the YAML file and of ``--set``
(``--set moe.topk=4``).

``load_config(file_or_preset, overrides)`` builds a type-checked Config;
``validate(config, world_size)`` checks the rules between fields and raises one
``ConfigError`` listing every violation. A field with choices is typed ``Literal[...]``:
validate() reads the allowed values from the type (``choices("moe.dispatcher")`` gives them
to other modules). A rule that a module also applies at run time is a function of
``RULES``, which validate() and the module (through ``require``) both call. The reference
docs/configuration.md is generated from the dataclasses and their field comments
(``python -m moe_fold.config --reference``). Derived sizes (``dp_size``, ``edp_size``,
``etp_size``, ``vpp_size``, ``moe_layer_flags``, ``moe_layer_indices``, ``pp_layer_counts``) live here so every
module uses one definition.

The package's parts: schema.py (the dataclasses and their comments), load.py (YAML,
presets, ``--set``), derived.py (derived sizes), rules/ (every rule, by concern) and
reference.py (the generator of docs/configuration.md). Every name is imported from
``moe_fold.config`` itself.
"""

from __future__ import annotations

from .derived import (CHANNEL_MIXERS, ELASTIC_SIZES, MLA_SIZES, conv_shape_problem, conv_shapes, data_paths, dp_size, edp_size, etp_size, group_ranked_scores,
                      head_dim, layer_attention, layer_mixer, mla_weight_shapes, moe_layer_flags, moe_layer_indices,
                      parse_elastic_layout, pipeline_schedule, pp_layer_counts, rotary_dim, vpp_size)
from .load import config_from_dict, config_to_dict, dump_config, list_presets, load_config, presets_dir, resolve_source
from .reference import field_comments, reference_markdown
from .rules import (BATCH_INVARIANT_ROWS, MAX_DYNAMIC_CP, RULES, activation_backend, adamw_settings, batch_over_dp, bucket_size,
                    capacity_factor_positive, checkpoints_kept, choice, choices, dense_width_over_tp, dispatch_modes,
                    dynamic_cp_layout, expert_bias_over_etp, expert_width_over_etp, experts_over_ep,
                    gate_needs_shared_expert, grad_clip, heads_over_tp, interleaved_micro_batches, latent_size_positive,
                    linear_heads_over_tp, mamba_groups_over_tp,
                    moe_needs_sequence_parallel, order_is_permutation, overlap_problems,
                    param_gather_needs_distributed, pipeline_split, replacement_has_room, replicas_fit, require,
                    rotary_pairs, router_settings, routing_groups, rule, schedule_chunks, sequence_over_cp,
                    sequence_over_tp, shortcut_moe_block, spike_detection, upcycle_slices, validate, vocab_over_tp, world_fits_layouts,
                    zero_expert_settings)
from .schema import (EXIT_SIGNALS, SECTIONS, Config, ConfigError, DataConfig, InitConfig, MoEConfig, ModelConfig,
                     OptimizerConfig, ParallelConfig, TrainConfig, WandbConfig)

# Private helpers that tests/config/test_rules.py imports from here: a section's field types and
# a Literal field's choices.
from .rules.common import _literal_choices  # noqa: F401,E402
from .schema import _field_types  # noqa: F401,E402

__all__ = [
    "BATCH_INVARIANT_ROWS", "CHANNEL_MIXERS", "Config", "conv_shape_problem", "conv_shapes", "ConfigError", "DataConfig", "ELASTIC_SIZES", "EXIT_SIGNALS", "InitConfig", "MAX_DYNAMIC_CP",
    "MLA_SIZES", "MoEConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig", "RULES", "SECTIONS",
    "TrainConfig", "WandbConfig", "activation_backend", "adamw_settings", "batch_over_dp", "bucket_size",
    "capacity_factor_positive", "checkpoints_kept", "choice", "choices", "config_from_dict", "config_to_dict",
    "data_paths", "dense_width_over_tp", "dispatch_modes", "dp_size", "dump_config", "dynamic_cp_layout",
    "edp_size", "etp_size", "expert_bias_over_etp", "expert_width_over_etp", "experts_over_ep", "field_comments",
    "gate_needs_shared_expert", "grad_clip", "group_ranked_scores", "head_dim", "heads_over_tp",
    "interleaved_micro_batches", "latent_size_positive", "layer_attention", "layer_mixer", "linear_heads_over_tp", "mamba_groups_over_tp", "list_presets", "load_config", "mla_weight_shapes",
    "moe_layer_flags", "moe_layer_indices", "moe_needs_sequence_parallel", "order_is_permutation",
    "overlap_problems", "param_gather_needs_distributed", "parse_elastic_layout", "pipeline_schedule",
    "pipeline_split", "pp_layer_counts", "presets_dir", "reference_markdown", "replacement_has_room",
    "replicas_fit", "require", "resolve_source", "rotary_dim", "rotary_pairs", "router_settings", "routing_groups",
    "rule", "schedule_chunks", "sequence_over_cp", "sequence_over_tp", "shortcut_moe_block", "spike_detection", "upcycle_slices",
    "validate", "vocab_over_tp", "vpp_size", "world_fits_layouts", "zero_expert_settings",
]

"""Every rule between config fields, in one package: ``validate(config, world_size)`` runs
them all before any process group exists.

By concern: parallel.py (layouts, the pipeline), model.py, moe.py, train.py (the run, the
optimizer, wandb, initialisation), data.py and routes.py (route traces, router replay);
common.py holds the registry ``RULES`` of the rules that modules apply too (through
``require``) and the helpers every rule uses.
"""

from __future__ import annotations

from ..schema import Config, ConfigError
from .common import RULES, _choice_problems, _type_problems, choice, choices, require, rule
from .data import _check_data, _check_validation_data
from .model import (_check_block, _check_model, dense_width_over_tp, heads_over_tp, linear_heads_over_tp,
                    mamba_groups_over_tp, rotary_pairs, sequence_over_cp, sequence_over_tp, shortcut_moe_block,
                    vocab_over_tp)
from .moe import (_check_layer_pattern, _check_moe, activation_backend, capacity_factor_positive, dispatch_modes,
                  expert_bias_over_etp, expert_width_over_etp, experts_over_ep, gate_needs_shared_expert,
                  latent_size_positive, moe_needs_sequence_parallel, overlap_problems, replacement_has_room, replicas_fit, router_settings,
                  routing_groups, zero_expert_settings)
from .routes import BATCH_INVARIANT_ROWS, _check_routes
from .parallel import (MAX_DYNAMIC_CP, _check_parallel, _check_pipeline, bucket_size, dynamic_cp_layout,
                       interleaved_micro_batches, order_is_permutation, param_gather_needs_distributed,
                       pipeline_split, schedule_chunks, world_fits_layouts)
from .train import (_check_optimizer, _check_train, _check_wandb_and_init, adamw_settings, batch_over_dp,
                    checkpoints_kept, grad_clip, spike_detection, upcycle_slices)

__all__ = [
    "BATCH_INVARIANT_ROWS", "MAX_DYNAMIC_CP", "RULES", "activation_backend", "adamw_settings", "batch_over_dp", "bucket_size",
    "capacity_factor_positive", "checkpoints_kept", "choice", "choices", "dense_width_over_tp", "dispatch_modes",
    "dynamic_cp_layout", "expert_bias_over_etp", "expert_width_over_etp", "experts_over_ep",
    "gate_needs_shared_expert", "grad_clip", "heads_over_tp", "interleaved_micro_batches", "latent_size_positive",
    "linear_heads_over_tp", "mamba_groups_over_tp", "moe_needs_sequence_parallel", "order_is_permutation", "overlap_problems", "param_gather_needs_distributed",
    "pipeline_split", "replacement_has_room", "replicas_fit", "require", "rotary_pairs", "router_settings",
    "routing_groups", "rule", "schedule_chunks", "sequence_over_cp", "sequence_over_tp", "shortcut_moe_block", "spike_detection",
    "upcycle_slices", "validate", "vocab_over_tp", "world_fits_layouts", "zero_expert_settings",
]


def validate(config: Config, world_size: int) -> None:
    """Check every rule that relates fields to each other and to ``world_size``.

    Raises one ConfigError listing every violated rule. Rules about experts (counts,
    routing groups, expert widths, sequence parallel with tp) apply only when some
    layer is MoE; the dense MLP width is checked only when some layer is dense."""
    problems = _type_problems(config)
    if problems:
        # The rules below do arithmetic on the fields; wrong types would only add noise.
        raise ConfigError(problems)
    out = _choice_problems(config)
    parallel_ok = _check_parallel(config, world_size, out)
    flags = _check_layer_pattern(config, out)
    any_moe = flags is None or any(flags)
    # A shortcut_moe block holds two dense MLPs beside its MoE.
    any_dense = flags is None or not all(flags) or config.model.block == "shortcut_moe"
    _check_model(config, any_dense, out)
    _check_block(config, flags, out)
    _check_moe(config, any_moe, out)
    _check_pipeline(config, out)
    _check_train(config, world_size, parallel_ok, out)
    _check_validation_data(config, out)
    _check_optimizer(config, out)
    _check_data(config, out)
    _check_wandb_and_init(config, out)
    _check_routes(config, out)
    if out:
        raise ConfigError(out)

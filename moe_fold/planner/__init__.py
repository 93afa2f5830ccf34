"""The planner behind ``moe-fold plan``: ``estimate`` (memory, FLOPs, bytes, step time and
MFU of a layout, and the layout search), ``model`` (parameters, FLOPs and Megatron's
reference activations), ``memory`` (the bytes moe-fold itself keeps), ``comm`` (bytes per
process group), ``compute_time`` (kernel seconds from their shapes), ``loads`` (measured
routing: the busiest ep rank per placement policy), ``precedent`` (published runs as
configs, the closest to a plan) and ``hardware`` (GPU figures). docs/planner.md has the
model and its validation. Import from the modules."""

"""The training loop and what it drives: ``train`` (the loop: groups, model, data,
checkpoints, metrics), ``step`` (one forward and backward over a global batch, any
pipeline schedule), ``optim`` (AdamW, ZeRO-1, schedules), ``grads`` (reduction and
clipping), ``precision``, ``numerics`` (non-finite steps), ``checkpoint``, ``metrics``,
and ``dynamic_cp`` (the per-batch context-parallel plan). Import from the modules."""

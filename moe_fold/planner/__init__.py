"""The planner behind ``moe-fold plan``: ``estimate`` (memory, FLOPs, bytes, step time and
MFU of a layout, and the layout search), ``model`` (parameters, FLOPs and Megatron's
reference activations), ``memory`` (the bytes moe-fold itself keeps), ``comm`` (bytes per
process group) and ``hardware`` (GPU figures). Import from the modules."""

"""The transformer stack, presets and Hugging Face interop (import as ``moe_fold.models``)."""

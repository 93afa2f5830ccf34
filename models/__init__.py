"""The transformer stack, presets and Hugging Face interop (import as ``moe_fold.models``).

``from_hf`` and ``to_hf`` load :mod:`moe_fold.models.hf` on first use, so importing this
package stays light."""

_LAZY = {"from_hf", "to_hf"}


def __getattr__(name: str):
    if name in _LAZY:
        from moe_fold.models import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'moe_fold.models' has no attribute {name!r}")

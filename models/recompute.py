"""Activation recompute (``train.recompute``): parts of the model whose activations the
forward does not keep; the backward runs their forward again.

Each recomputable module holds its own setting, an attribute its forward reads (``"none"``
by default):

- :class:`~moe_fold.models.model.Block` ``.recompute``: ``"all"`` (the whole block) or
  ``"attention"`` (the attention, after its norm);
- :class:`~moe_fold.models.experts.Experts` ``.recompute``: ``"all"`` (both grouped GEMMs
  and the SwiGLU) or ``"activation"`` (the SwiGLU and the fc2 GEMM that consumes it: the
  activation output ``[rows, F]`` is not kept, fc1's output is);
- :class:`~moe_fold.models.mlp.MLP` ``.recompute``: ``"all"`` or ``"halves"`` (its two
  halves apart, :meth:`~moe_fold.models.mlp.MLP.activation` and
  :meth:`~moe_fold.models.mlp.MLP.project`, keeping the SwiGLU output between them: what
  the MoE layer needs when it runs the shared expert's halves apart).

:func:`~moe_fold.models.model.set_recompute` sets them for a ``train.recompute`` mode;
:func:`~moe_fold.models.model.build_model` calls it. Every recomputed region runs
through :func:`recomputed`.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.utils.checkpoint import checkpoint

__all__ = ["recomputed"]


def recomputed(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under a non-reentrant ``torch.utils.checkpoint``: only the
    tensor inputs are kept, and the backward runs ``fn`` again (with the forward's RNG
    and autocast state). Under ``torch.no_grad`` it just runs ``fn``."""
    return checkpoint(fn, *args, use_reentrant=False, **kwargs)

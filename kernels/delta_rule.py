"""The delta rule of Gated DeltaNet and KDA, one interface over two backends: ``torch`` (the
chunked rule of :mod:`moe_fold.kernels.gated_delta`, any device) and ``fla``
(flash-linear-attention's Triton kernels, CUDA: ``chunk_gated_delta_rule`` for a decay per
head, ``chunk_kda`` for one per key channel; ``pip install 'moe-fold[fla]'``, imported only
when chosen; :mod:`moe_fold.kernels.delta_rule_fla` converts the arguments to fla's layout).
``auto`` is the device rule of :mod:`moe_fold.kernels.backends`. Both take
:func:`torch_delta_rule`'s arguments (the chunked rule's, packed documents as the batch's
:class:`~moe_fold.parallel.varlen.SequenceStarts`) and return ``(o, final_state)``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from moe_fold.parallel.varlen import SequenceStarts

from . import backends
from .delta_rule_fla import fla_delta_rule, fla_function
from .gated_delta import chunk_gated_delta_rule

__all__ = ["BACKENDS", "delta_rule", "torch_delta_rule"]

BACKENDS = ("auto",) + backends.OPS["delta_rule"]


def torch_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     starts: Optional[SequenceStarts] = None, initial_state: Optional[torch.Tensor] = None,
                     chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~moe_fold.kernels.gated_delta.chunk_gated_delta_rule` with the documents of
    ``starts`` (None: each row is one sequence)."""
    return chunk_gated_delta_rule(q, k, v, g, beta, None if starts is None else starts.resets, initial_state,
                                  chunk_size)


def delta_rule(backend: str, kind: str) -> Callable:
    """The delta rule a layer built with ``model.linear_backend=backend`` calls, chosen once
    when it is built: ``torch`` or ``fla`` (fla's function for ``kind`` imported here), or
    for ``auto`` the rule's choice for the operands' device, made on the first call there."""
    if backend not in BACKENDS:
        raise ValueError(f"delta rule: backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return torch_delta_rule
    if backend == "fla":
        return functools.partial(fla_delta_rule, fla_function(kind))
    return functools.partial(_auto, kind)


def _auto(kind: str, q: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``auto``: the backend :func:`moe_fold.kernels.backends.resolve` gives for ``q``
    (cached per device and dtype there)."""
    if backends.resolve("delta_rule", "auto", q) == "fla":
        return fla_delta_rule(fla_function(kind), q, *args, **kwargs)
    return torch_delta_rule(q, *args, **kwargs)

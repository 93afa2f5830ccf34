"""The short causal depthwise conv of Gated DeltaNet, KDA and Mamba2, then SiLU, one
interface over two backends: ``torch`` (:func:`~moe_fold.kernels.gated_delta.causal_conv1d`,
any device) and ``causal_conv1d`` (the causal-conv1d package's CUDA ``causal_conv1d_fn``;
``pip install 'moe-fold[conv]'``, imported only when chosen). ``auto`` is the device rule of
:mod:`moe_fold.kernels.backends` (op ``conv``, ``model.conv_backend``).

Both take ``x [S, B, C]``, ``weight [C, K]``, ``bias [C]`` (or None), ``history [K-1, B, C]``
(the tokens before ``x``; None: zeros) and ``doc_ids [B, K-1+S]`` (the documents of the
history and of ``x``; None: one document), and return ``silu(conv(x) + bias) [S, B, C]``,
a token reading only earlier tokens of its own document.

:mod:`moe_fold.kernels.short_conv_causal_conv1d` converts to causal-conv1d's layout.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from moe_fold.config import conv_shape_problem

from . import backends
from .gated_delta import causal_conv1d
from .short_conv_causal_conv1d import causal_conv1d_function, library_conv

__all__ = ["BACKENDS", "short_conv", "torch_conv"]

BACKENDS = ("auto",) + backends.OPS["conv"]


def torch_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
               history: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The conv in torch, plus the bias, through SiLU."""
    out = causal_conv1d(x, weight, history, doc_ids)
    return F.silu(out if bias is None else out + bias)


def short_conv(backend: str, width: int, channels: int) -> Callable:
    """The conv a layer built with ``model.conv_backend=backend`` calls for ``width`` taps over
    ``channels`` (this rank's) channels, chosen once when it is built: ``torch``,
    ``causal_conv1d`` (imported here; a ValueError when the shape is one its kernels do not
    take), or for ``auto`` the rule's choice for the operands' device, made on the first call
    there (torch for a shape causal-conv1d does not take)."""
    if backend not in BACKENDS:
        raise ValueError(f"short conv: backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "torch":
        return torch_conv
    why = conv_shape_problem(width, channels)
    if backend == "causal_conv1d":
        if why is not None:
            raise ValueError(why)
        fn = causal_conv1d_function()
        return lambda *args, **kwargs: library_conv(fn, *args, **kwargs)
    return torch_conv if why is not None else _auto


def _auto(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``auto``: the backend :func:`moe_fold.kernels.backends.resolve` gives for ``x``
    (cached per device and dtype there)."""
    if backends.resolve("conv", "auto", x) == "causal_conv1d":
        return library_conv(causal_conv1d_function(), x, *args, **kwargs)
    return torch_conv(x, *args, **kwargs)

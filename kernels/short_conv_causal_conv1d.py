"""causal-conv1d as the ``causal_conv1d`` backend of the short conv
(:mod:`moe_fold.kernels.short_conv`): its ``causal_conv1d_fn``, imported when asked for, and
the conversion of :func:`~moe_fold.kernels.short_conv.torch_conv`'s arguments to its layout
and back:

- ``x [S, B, C]`` (contiguous) -> ``(batch, dim, seqlen)`` with the channels innermost
  (``x.permute(1, 2, 0)``: no copy), the only layout in which it takes ``seq_idx``;
- packed documents: ``seq_idx [B, K-1+S]`` int32, the document ids, a tap reading a token only
  where its index equals the output token's;
- it takes no ``initial_states`` beside ``seq_idx``, so the history (the K-1 tokens before
  ``x``) is prepended to ``x`` and its outputs dropped;
- the bias and SiLU are fused (``activation="silu"``).

Its kernels take widths 2 to 4, channels in multiples of 8
(:func:`moe_fold.config.conv_shape_problem`) and no float64.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch

__all__ = ["CONV_INSTALL", "causal_conv1d_function", "library_conv"]

CONV_INSTALL = "pip install 'moe-fold[conv]' (causal-conv1d's CUDA kernels, built against this torch; needs CUDA)"
_MODULE, _NAME = "causal_conv1d", "causal_conv1d_fn"


def causal_conv1d_function() -> Callable:
    """causal-conv1d's ``causal_conv1d_fn``, imported here; an ImportError naming the install
    when causal-conv1d is absent or does not import."""
    try:
        imported = importlib.import_module(_MODULE)
    except Exception as err:  # a missing install, or one built against another torch
        raise ImportError(f"import {_MODULE} failed ({type(err).__name__}: {err}); {CONV_INSTALL}") from err
    return getattr(imported, _NAME)


def library_conv(fn: Callable, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 history: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`~moe_fold.kernels.short_conv.torch_conv` through ``fn`` (causal-conv1d's
    ``causal_conv1d_fn`` or a function of the same contract), in the layout the module
    docstring describes."""
    back = weight.shape[1] - 1
    # Contiguous: its channel-last kernels want the batch and token strides in multiples of 8,
    # which a slice of a wider projection (Mamba2's x|B|C) does not have.
    full = x.contiguous() if history is None else torch.cat([history, x], dim=0)  # [K-1+S, B, C] (or [S, B, C])
    seq_idx = None
    if doc_ids is not None:
        # doc_ids cover the history's positions; without a history those are not in `full`.
        seq_idx = (doc_ids if history is not None else doc_ids[:, back:]).to(torch.int32).contiguous()
    out = fn(full.permute(1, 2, 0), weight, bias, seq_idx=seq_idx, activation="silu")  # [B, C, K-1+S]
    out = out.permute(2, 0, 1)  # [K-1+S, B, C]
    return out if history is None else out[back:]

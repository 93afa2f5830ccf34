"""The router top-k's backend switch: ``torch`` (:func:`moe_fold.dispatch.router.topk_routing`,
sorts and scatters) or ``triton`` (:mod:`moe_fold.kernels.topk_triton`, one fused kernel
each way), or ``auto``: the rule of :mod:`moe_fold.kernels.backends`, Triton on CUDA and torch
on CPU. Config key ``moe.topk_backend``; the router makes the call.

The kernel fuses plain top-k with softmax (before or after) or sigmoid scores; group-limited
routing and the aux-loss-free expert bias stay in torch (``fusable=False``), and the router
applies the scaling factor to either's probs."""

import torch

from . import backends

BACKENDS = ("auto",) + backends.OPS["topk"]


def resolve_backend(backend: str, logits: torch.Tensor, *, fusable: bool = True) -> str:
    """The concrete backend for router ``logits [T, E]``: ``backend``, or for ``auto`` the
    device rule. ``fusable``: the routing is one the kernel computes (no expert groups, no
    expert bias); ``triton`` named for one that is not raises."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "triton" and not fusable:
        raise ValueError("topk backend 'triton' fuses plain top-k only: group-limited routing (num_groups) and "
                         "the expert bias need backend 'torch' (or 'auto')")
    return backends.resolve("topk", backend, logits, topk_fusable=fusable)

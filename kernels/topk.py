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


def build_backend(backend: str, *, fusable: bool) -> str:
    """What a router built with ``moe.topk_backend=backend`` passes to :func:`topk_scores`:
    checked once when the module is built. Routing the kernel does not fuse always runs
    the torch path (``auto`` included), so only a fusable routing keeps ``auto``, which
    the op resolves by the logits' device."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "triton" and not fusable:
        raise ValueError("topk backend 'triton' fuses plain top-k only: group-limited routing (num_groups) and "
                         "the expert bias need backend 'torch' (or 'auto')")
    return backend if fusable else "torch"


def _stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Ties go to the lower index, as the router promises (torch.topk leaves the order open).
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def topk_torch(logits: torch.Tensor, topk: int, score: str, pre_softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain top-k routing in torch ops (no groups, no bias): ``probs [T, E]`` (float32, or
    float64 for float64 logits) and ``routing_map [T, E]`` bool; the scores are those of
    :func:`moe_fold.dispatch.router.topk_routing`."""
    work = logits if logits.dtype == torch.float64 else logits.float()
    if score == "softmax" and not pre_softmax:
        top_logits, top = _stable_topk(work, topk)
        probs = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.softmax(work, dim=-1) if score == "softmax" else torch.sigmoid(work)
        probs, top = _stable_topk(scores, topk)
        if score == "sigmoid" and topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    # [T, k] -> [T, E]
    dense = torch.zeros_like(work).scatter(1, top, probs)
    routing_map = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, top, True)
    return dense, routing_map


def topk_torch_backward(grad_probs: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor,
                        routing_map: torch.Tensor, topk: int, score: str, pre_softmax: bool) -> torch.Tensor:
    """The logits' gradient of :func:`topk_torch`: the softmax (over the chosen k, or over
    all experts before top-k) or the normalised sigmoid, differentiated by hand."""
    work = logits if logits.dtype == torch.float64 else logits.float()
    g = grad_probs.to(work.dtype) * routing_map  # [T, E], zero off the chosen experts
    if score == "softmax" and not pre_softmax:
        # probs are the softmax over the chosen k and zero elsewhere.
        grad = probs * (g - (probs * g).sum(dim=-1, keepdim=True))
    elif score == "softmax":
        scores = torch.softmax(work, dim=-1)  # [T, E]
        grad = scores * (g - (scores * g).sum(dim=-1, keepdim=True))
    else:
        s = torch.sigmoid(work)
        if topk > 1:
            total = (s * routing_map).sum(dim=-1, keepdim=True) + 1e-20
            g = (g - (g * probs).sum(dim=-1, keepdim=True)) / total * routing_map
        grad = g * s * (1 - s)
    return grad.to(logits.dtype)


@torch.library.custom_op("moe_fold::topk_scores", mutates_args=())
def topk_scores(logits: torch.Tensor, topk: int, score: str, pre_softmax: bool,
                backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain top-k routing as one op the compiler does not look into: ``logits [T, E]`` ->
    ``(probs [T, E], routing_map [T, E] bool)``. ``backend``: ``torch``, ``triton`` or
    ``auto`` (the device rule, resolved from the logits' device like any kernel dispatch)."""
    if backends.resolve("topk", backend, logits) == "triton":
        from .topk_triton import topk_softmax_triton

        return topk_softmax_triton(logits, topk, score=score, pre_softmax=pre_softmax)
    return topk_torch(logits, topk, score, pre_softmax)


@topk_scores.register_fake
def _(logits, topk, score, pre_softmax, backend):
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return (logits.new_empty(logits.shape, dtype=dtype), logits.new_empty(logits.shape, dtype=torch.bool))


@torch.library.custom_op("moe_fold::topk_scores_backward", mutates_args=())
def topk_scores_backward(grad_probs: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor,
                         routing_map: torch.Tensor, topk: int, score: str, pre_softmax: bool,
                         backend: str) -> torch.Tensor:
    """The logits' gradient of :func:`topk_scores`."""
    if backends.resolve("topk", backend, logits) == "triton":
        from .topk_triton import topk_backward_triton

        return topk_backward_triton(grad_probs, logits, probs, routing_map, topk, score, pre_softmax)
    return topk_torch_backward(grad_probs, logits, probs, routing_map, topk, score, pre_softmax)


@topk_scores_backward.register_fake
def _(grad_probs, logits, probs, routing_map, topk, score, pre_softmax, backend):
    return torch.empty_like(logits)


def _topk_setup(ctx, inputs, output):
    logits, topk, score, pre_softmax, backend = inputs
    ctx.save_for_backward(logits, *output)
    ctx.args = (topk, score, pre_softmax, backend)


def _topk_backward(ctx, grad_probs, _grad_map):
    logits, probs, routing_map = ctx.saved_tensors
    return topk_scores_backward(grad_probs, logits, probs, routing_map, *ctx.args), None, None, None, None


topk_scores.register_autograd(_topk_backward, setup_context=_topk_setup)

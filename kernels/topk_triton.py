"""Fused router top-k: scores, top-k selection and prob normalisation in one kernel.

``topk_softmax_triton(logits[T, E], topk, *, score="softmax", pre_softmax=False)
-> (probs[T, E], routing_map[T, E] bool)`` with Megatron-Core's semantics:

- ``score="softmax"``, ``pre_softmax=False`` (default): top-k of the logits, then a
  softmax over those k values.
- ``score="softmax"``, ``pre_softmax=True``: softmax over all E, then the top-k
  of those probabilities (not renormalised).
- ``score="sigmoid"``: sigmoid of the logits, top-k, then divided by their sum
  (``+ 1e-20``) when ``topk > 1``.

Ties are broken towards the lower expert index (torch.topk documents no order for
ties, so on tied scores the two may pick different experts). ``probs`` is zero
where ``routing_map`` is False; it is float32 (float64 for float64 logits, the
router's ``router_dtype=float64``). One program handles one token with all E
experts in registers, so E up to a few hundred is fine.

It is differentiable w.r.t. the logits: the backward is a second kernel with the
closed-form gradient of each normalisation (it recomputes the scores from the
saved logits). Group-limited routing, expert bias and the scaling factor are not
fused here: the router in ``moe_fold.dispatch.router`` handles those in torch.
"""
import torch
import triton
import triton.language as tl

from moe_fold.config import choices

SCORES = choices("moe.score_function")


@triton.jit
def _scores(x, in_e, SIGMOID: tl.constexpr, PRE_SOFTMAX: tl.constexpr):
    """The values top-k ranks: sigmoid, softmax over all E, or the logits."""
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    elif PRE_SOFTMAX:
        e = tl.where(in_e, tl.exp(x - tl.max(x, axis=0)), 0.0)
        s = e / tl.sum(e, axis=0)
    else:
        s = x
    return s


@triton.jit
def _topk_fwd_kernel(logits_ptr, probs_ptr, map_ptr, E, stride_l, stride_p, stride_m,
                     K: tl.constexpr, SIGMOID: tl.constexpr, PRE_SOFTMAX: tl.constexpr,
                     ACC: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    in_e = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=in_e,
                other=-float("inf")).to(ACC)
    s = _scores(x, in_e, SIGMOID, PRE_SOFTMAX)
    # k rounds of "take the largest remaining, lowest index on ties"; `free` (not
    # the value) marks what is left, so -inf scores are still picked correctly.
    free = in_e
    cand = tl.where(in_e, s, -float("inf"))
    sel = offs < 0
    for _ in tl.static_range(K):
        best = tl.max(tl.where(free, cand, -float("inf")), axis=0)
        pick = tl.min(tl.where(free & (cand == best), offs, BLOCK_E), axis=0)
        hit = offs == pick
        sel = sel | hit
        free = free & (offs != pick)
    if SIGMOID:
        probs = tl.where(sel, s, 0.0)
        if K > 1:
            probs = probs / (tl.sum(probs, axis=0) + 1e-20)
    elif PRE_SOFTMAX:
        probs = tl.where(sel, s, 0.0)
    else:
        z = tl.where(sel, x, -float("inf"))
        e = tl.where(sel, tl.exp(z - tl.max(z, axis=0)), 0.0)
        probs = e / tl.sum(e, axis=0)
    tl.store(probs_ptr + row * stride_p + offs, probs.to(probs_ptr.dtype.element_ty),
             mask=in_e)
    tl.store(map_ptr + row * stride_m + offs, sel.to(tl.int8), mask=in_e)


@triton.jit
def _topk_bwd_kernel(grad_ptr, logits_ptr, probs_ptr, map_ptr, grad_logits_ptr, E,
                     stride_g, stride_l, stride_p, stride_m, stride_gl,
                     K: tl.constexpr, SIGMOID: tl.constexpr, PRE_SOFTMAX: tl.constexpr,
                     ACC: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    in_e = offs < E
    g = tl.load(grad_ptr + row * stride_g + offs, mask=in_e, other=0.0).to(ACC)
    p = tl.load(probs_ptr + row * stride_p + offs, mask=in_e, other=0.0).to(ACC)
    sel = tl.load(map_ptr + row * stride_m + offs, mask=in_e, other=0) != 0
    x = tl.load(logits_ptr + row * stride_l + offs, mask=in_e,
                other=-float("inf")).to(ACC)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
        if K > 1:
            # probs = q / (sum q + eps) with q = s on the selected experts.
            total = tl.sum(tl.where(sel, s, 0.0), axis=0) + 1e-20
            dq = (g - tl.sum(p * g, axis=0)) / total
        else:
            dq = g
        dx = tl.where(sel, dq * s * (1.0 - s), 0.0)
    elif PRE_SOFTMAX:
        s = _scores(x, in_e, SIGMOID, PRE_SOFTMAX)
        ds = tl.where(sel, g, 0.0)
        dx = tl.where(in_e, s * (ds - tl.sum(s * ds, axis=0)), 0.0)
    else:
        # Softmax over the selected logits; p is zero elsewhere so dx is too.
        dx = p * (g - tl.sum(p * g, axis=0))
    tl.store(grad_logits_ptr + row * stride_gl + offs,
             dx.to(grad_logits_ptr.dtype.element_ty), mask=in_e)


def _meta(logits: torch.Tensor, topk: int, score: str, pre_softmax: bool) -> dict:
    return dict(K=topk, SIGMOID=score == "sigmoid", PRE_SOFTMAX=pre_softmax,
                ACC=tl.float64 if logits.dtype == torch.float64 else tl.float32,
                BLOCK_E=triton.next_power_of_2(logits.shape[1]))


class _TopkRouting(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, topk, score, pre_softmax):
        logits = logits.contiguous()
        num_tokens, num_experts = logits.shape
        out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        probs = torch.empty(num_tokens, num_experts, dtype=out_dtype, device=logits.device)
        routing = torch.empty(num_tokens, num_experts, dtype=torch.int8,
                              device=logits.device)
        meta = _meta(logits, topk, score, pre_softmax)
        if num_tokens:
            _topk_fwd_kernel[(num_tokens,)](
                logits, probs, routing, num_experts,
                logits.stride(0), probs.stride(0), routing.stride(0), **meta)
        ctx.save_for_backward(logits, probs, routing)
        ctx.meta = meta
        routing_map = routing.view(torch.bool)
        ctx.mark_non_differentiable(routing_map)
        return probs, routing_map

    @staticmethod
    def backward(ctx, grad_probs, _grad_map):
        logits, probs, routing = ctx.saved_tensors
        return _backward(grad_probs, logits, probs, routing, ctx.meta), None, None, None


def _backward(grad_probs: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor, routing: torch.Tensor,
              meta: dict) -> torch.Tensor:
    grad = grad_probs.contiguous()
    grad_logits = torch.empty_like(logits)
    if logits.shape[0]:
        _topk_bwd_kernel[(logits.shape[0],)](
            grad, logits, probs, routing, grad_logits, logits.shape[1],
            grad.stride(0), logits.stride(0), probs.stride(0), routing.stride(0),
            grad_logits.stride(0), **meta)
    return grad_logits


def topk_backward_triton(grad_probs: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor,
                         routing_map: torch.Tensor, topk: int, score: str, pre_softmax: bool) -> torch.Tensor:
    """The logits' gradient of :func:`topk_softmax_triton` from ``grad_probs [T, E]``."""
    logits = logits.contiguous()
    return _backward(grad_probs, logits, probs.contiguous(), routing_map.contiguous().view(torch.int8),
                     _meta(logits, topk, score, pre_softmax))


def topk_softmax_triton(logits: torch.Tensor, topk: int, *, score: str = "softmax",
                        pre_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router scores and top-k in one kernel; see the module docstring."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got shape {tuple(logits.shape)}")
    if not 1 <= topk <= logits.shape[1]:
        raise ValueError(f"topk={topk} must be in [1, num_experts={logits.shape[1]}]")
    if score not in SCORES:
        raise ValueError(f"score={score!r} is not one of {SCORES}")
    if pre_softmax and score != "softmax":
        raise ValueError(f"pre_softmax=True needs score='softmax', got score={score!r}")
    return _TopkRouting.apply(logits, topk, score, pre_softmax)

"""Attention under a document mask as one fused kernel call, with its log-sum-exp, and the
rule that picks the kernel per device.

Packed sequences (:mod:`moe_fold.parallel.varlen`) and ring attention blocks
(:mod:`moe_fold.parallel.ring_attention`) both need "query i sees key j only inside the
same document (and only j <= i on a causal block)". Two kernels do it:

- ``"flex"`` (every device but the CPU): one ``flex_attention`` call, compiled on CUDA,
  with a block mask built from the document ids on the device. Blocks of 128 x 128 that
  share no document are skipped, so the work is about ``sum(len^2)``, with no per-document
  Python loop and no host sync (no ``tolist``/``nonzero`` of the ids). Its log-sum-exp
  comes back with the output; ring blocks merge with it.
- ``"cpu_flash"`` (CPU, and meta tensors): aten's fused CPU flash kernel once per document
  (:func:`moe_fold.parallel.varlen.varlen_attention`, the ring's document pieces). Why not
  one masked call on CPU: that kernel takes a mask but computes every block of it (no
  block skipping), so one call costs ``S^2`` whatever the documents. Measured with
  ``bench/attention.py`` on the 2-core CI machine, 64 documents of 64 tokens in 4096, forward
  and backward: 721 ms for one masked call, 83 ms for one call per document (see
  docs/performance.md). Reading the ids on the host costs nothing on a CPU.

A sliding window and attention sinks (docs/attention.md) add a term to the same mask
(:func:`_mask_mod`, which compares the tokens' sequence positions) and a column to each
row's denominator (:func:`apply_sinks`). :func:`masked_block_attention` runs them: flex off
the CPU; on CPU :func:`math_block_attention`, the same mask rule evaluated densely under
autograd (flex has no CPU backward, aten's CPU flash kernel takes no window).

Backward of a ring block needs the grads of the block given the FINAL output and
log-sum-exp of the row (over all blocks). ``flex_attention`` has no backward that takes
them, so :func:`flex_block_backward` recomputes the block under autograd and backpropagates
into both its output and its log-sum-exp: with ``w = exp(lse_block - lse)``, the upstream
grads ``w * dO`` (output) and ``w * rowsum(dO * (out_block - out))`` (lse) give exactly
``P (dO V^T - rowsum(dO * out))`` with ``P`` the final probabilities, the block's share of
the full attention's grads. The price is one more forward of the block in the backward.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

__all__ = ["DOCUMENT_KERNELS", "document_kernel", "flex_block_attention", "flex_block_backward",
           "math_block_attention", "masked_block_attention", "masked_block_backward", "apply_sinks"]

DOCUMENT_KERNELS = ("flex", "cpu_flash")


def document_kernel(device: torch.device) -> str:
    """The kernel that runs document-masked attention and ring blocks on ``device`` (one
    of :data:`DOCUMENT_KERNELS`; see the module doc for why). Meta tensors (a dry run)
    take the CPU kernel: flex refuses them, aten's CPU flash kernel has meta functions."""
    return "cpu_flash" if torch.device(device).type in ("cpu", "meta") else "flex"


@functools.cache
def _compiled(fn):
    # Wrapped once per process; flex_attention without torch.compile runs an unfused
    # reference that materialises the scores. Default dynamic-shape policy: the ring's
    # block shapes (c or 2c rows) then share a kernel instead of each taking a recompile.
    return torch.compile(fn)


def _mask_mod(doc_q: Optional[torch.Tensor], doc_k: Optional[torch.Tensor], causal: bool,
              pos_q: Optional[torch.Tensor] = None, pos_k: Optional[torch.Tensor] = None, window: int = 0):
    """flex's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for documents, causality and a
    sliding window; None when nothing is masked. ``pos_q [Sq]``/``pos_k [Sk]``: the tokens'
    sequence indices (causal and window compare them; None: the block's own indices,
    top-left aligned). Query i sees key j inside the window iff ``pos_i - pos_j < window``
    (itself and the ``window - 1`` keys before it, as Hugging Face's sliding window).

    The same function evaluated on broadcast index tensors gives the dense mask of the
    math kernel (:func:`dense_mask`): one mask rule for both kernels."""
    if window and pos_q is None:
        raise ValueError("_mask_mod: a sliding window needs the tokens' positions (pos_q, pos_k)")
    terms = []
    if doc_q is not None:
        terms.append(lambda b, h, qi, ki: doc_q[b, qi] == doc_k[b, ki])
    if causal and pos_q is None:
        terms.append(lambda b, h, qi, ki: qi >= ki)
    elif causal:
        terms.append(lambda b, h, qi, ki: pos_q[qi] >= pos_k[ki])
    if window:
        terms.append(lambda b, h, qi, ki: pos_q[qi] - pos_k[ki] < window)
    if not terms:
        return None

    def mask_mod(b, h, qi, ki):
        keep = terms[0](b, h, qi, ki)
        for term in terms[1:]:
            keep = keep & term(b, h, qi, ki)
        return keep
    return mask_mod


def dense_mask(mask_mod, batch: int, sq: int, sk: int, device: torch.device) -> Optional[torch.Tensor]:
    """``mask_mod`` (:func:`_mask_mod`) as a bool ``[batch, Sq, Sk]`` tensor (None: no mask)."""
    if mask_mod is None:
        return None
    b = torch.arange(batch, device=device).view(batch, 1, 1)
    qi = torch.arange(sq, device=device).view(1, sq, 1)
    ki = torch.arange(sk, device=device).view(1, 1, sk)
    return mask_mod(b, 0, qi, ki).expand(batch, sq, sk)


def flex_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_q: Optional[torch.Tensor],
                         doc_k: Optional[torch.Tensor], causal: bool,
                         scale: Optional[float] = None, **window) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[B, Hq, Sq, D]`` over k ``[B, Hkv, Sk, D]``, v ``[B, Hkv, Sk, Dv]``
    (GQA: query head h reads kv head ``h // (Hq/Hkv)``) where query i sees key j iff
    ``doc_q[b, i] == doc_k[b, j]`` (int ``[B, Sq]``, ``[B, Sk]``; both None: no documents)
    and, when ``causal``, ``j <= i`` (top-left aligned). One flex_attention call.

    Returns out ``[B, Hq, Sq, Dv]`` (q's dtype) and lse ``[B, Hq, Sq]`` (float32, float64
    for float64 inputs; natural log), both differentiable. A query row that sees no key
    gets out 0 and lse ``-inf``. ``window``: optional ``pos_q``, ``pos_k``, ``window`` of
    :func:`_mask_mod` (a sliding window; causal then compares positions).
    """
    if (doc_q is None) != (doc_k is None):
        raise ValueError("flex_block_attention: pass both doc_q and doc_k, or neither")
    B, _, Sq, _ = q.shape
    Sk = k.shape[2]
    if doc_q is not None:
        # The loader's ids may still be on the host; the mask is evaluated on q's device.
        doc_q, doc_k = doc_q.to(q.device, non_blocking=True), doc_k.to(q.device, non_blocking=True)
    block_mask = None
    mask_mod = _mask_mod(doc_q, doc_k, causal, **window)
    if mask_mod is not None:
        make_mask = _compiled(create_block_mask) if q.is_cuda else create_block_mask
        block_mask = make_mask(mask_mod, B, None, Sq, Sk, device=q.device)
    attend = _compiled(flex_attention) if q.is_cuda else flex_attention
    out, aux = attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                      return_aux=AuxRequest(lse=True))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out, aux.lse.to(acc)


def math_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_q: Optional[torch.Tensor],
                         doc_k: Optional[torch.Tensor], causal: bool, scale: Optional[float] = None,
                         **window) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flex_block_attention`'s contract (same arguments, same masks, out 0 and lse
    ``-inf`` on a row without keys, differentiable in both) as an explicit masked softmax
    under autograd. What the CPU runs for a sliding window or sinks: flex has no backward on
    CPU and aten's CPU flash kernel takes no window. It keeps the ``[B, Hq, Sq, Sk]`` scores
    (the cost of this path; a document-only mask takes the per-document kernel instead)."""
    B, _, Sq, _ = q.shape
    Sk = k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if doc_q is not None:
        doc_q, doc_k = doc_q.to(q.device), doc_k.to(q.device)
    allowed = dense_mask(_mask_mod(doc_q, doc_k, causal, **window), B, Sq, Sk, q.device)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    g = q.shape[1] // k.shape[1]
    s = q.to(acc) @ k.to(acc).repeat_interleave(g, 1).transpose(-1, -2) * scale  # [B, Hq, Sq, Sk]
    if allowed is None:
        lse = torch.logsumexp(s, -1)
        return (s - lse.unsqueeze(-1)).exp().matmul(v.to(acc).repeat_interleave(g, 1)).to(q.dtype), lse
    allowed = allowed.unsqueeze(1)  # [B, 1, Sq, Sk]
    seen = allowed.any(-1).expand(s.shape[:3])  # [B, Hq, Sq]
    # Rows without keys take scores 0 inside the graph, then out 0 and lse -inf by torch.where:
    # no -inf - -inf in the graph, so their grads stay 0 (not NaN).
    s = s.masked_fill(~allowed, -math.inf).masked_fill(~seen.unsqueeze(-1), 0)
    lse = torch.logsumexp(s, -1)  # [B, Hq, Sq]
    p = (s - lse.unsqueeze(-1)).exp() * seen.unsqueeze(-1)
    out = p @ v.to(acc).repeat_interleave(g, 1)  # [B, Hq, Sq, Dv]
    return out.to(q.dtype), torch.where(seen, lse, -math.inf)


def masked_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_q: Optional[torch.Tensor],
                           doc_k: Optional[torch.Tensor], causal: bool, scale: Optional[float] = None,
                           **window) -> tuple[torch.Tensor, torch.Tensor]:
    """One block under any mask of :func:`_mask_mod` (documents, causality, a sliding
    window): :func:`flex_block_attention` on a flex device, :func:`math_block_attention` on
    CPU. Returns out and lse, both differentiable."""
    if document_kernel(q.device) == "flex":
        return flex_block_attention(q, k, v, doc_q, doc_k, causal, scale, **window)
    return math_block_attention(q, k, v, doc_q, doc_k, causal, scale, **window)


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention sinks (gpt-oss): a learned logit per query head joins every row's softmax
    denominator (a key whose value is zero). From a row's ``out [B, Hq, S, Dv]`` and ``lse
    [B, Hq, S]`` over its real keys and ``sinks [Hq]``: ``lse' = logaddexp(lse, sink)``
    and ``out' = out * exp(lse - lse')``. Differentiable in all three."""
    lse_all = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, -1, 1))
    return (out * (lse - lse_all).exp().unsqueeze(-1).to(out.dtype)), lse_all


def masked_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, doc_q: Optional[torch.Tensor],
                          doc_k: Optional[torch.Tensor], causal: bool, scale: float,
                          **window) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block (as :func:`masked_block_attention` masks it) given the row's
    FINAL ``out`` ``[B, Hq, Sq, Dv]`` and ``lse`` ``[B, Hq, Sq]`` over all blocks, by
    recomputing the block under autograd (see the module doc). Summing dq over blocks and
    gathering dk/dv gives the grads of attention over all keys. With sinks, the final
    ``out``/``lse`` are the sink-corrected ones (:func:`apply_sinks`): the sink is one more
    key of value zero, so the same formula gives the grads with it."""
    with torch.enable_grad():
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
        if window:
            blk_out, blk_lse = masked_block_attention(qd, kd, vd, doc_q, doc_k, causal, scale, **window)
        else:
            blk_out, blk_lse = flex_block_attention(qd, kd, vd, doc_q, doc_k, causal, scale)
    # Every row sees at least itself over the whole ring, so the final lse is finite; a
    # row without keys in this block has blk_lse -inf, weight 0 and blk_out 0.
    w = (blk_lse.detach() - lse).exp()  # [B, Hq, Sq]
    dout_acc = dout.to(w.dtype)
    grad_out = (w.unsqueeze(-1) * dout_acc).to(blk_out.dtype)
    grad_lse = w * (dout_acc * (blk_out.detach().to(w.dtype) - out.to(w.dtype))).sum(-1)
    dq, dk, dv = torch.autograd.grad((blk_out, blk_lse), (qd, kd, vd), (grad_out, grad_lse.to(blk_lse.dtype)))
    return dq, dk, dv


def flex_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, doc_q: Optional[torch.Tensor],
                        doc_k: Optional[torch.Tensor], causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`masked_block_backward` of a :func:`flex_block_attention` block (documents
    and causality only)."""
    return masked_block_backward(dout, q, k, v, out, lse, doc_q, doc_k, causal, scale)

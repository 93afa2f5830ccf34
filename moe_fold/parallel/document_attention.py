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
- ``"cpu_flash"`` (CPU): aten's fused CPU flash kernel once per document
  (:func:`moe_fold.parallel.varlen.varlen_attention`, the ring's document pieces). Why not
  one masked call on CPU: that kernel takes a mask but computes every block of it (no
  block skipping), so one call costs ``S^2`` whatever the documents. Measured with
  ``bench/attention.py`` on the 2-core CI machine, 64 documents of 64 tokens in 4096, forward
  and backward: 721 ms for one masked call, 83 ms for one call per document (see
  docs/performance.md). Reading the ids on the host costs nothing on a CPU.

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
from typing import Optional

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

__all__ = ["DOCUMENT_KERNELS", "document_kernel", "flex_block_attention", "flex_block_backward"]

DOCUMENT_KERNELS = ("flex", "cpu_flash")


def document_kernel(device: torch.device) -> str:
    """The kernel that runs document-masked attention and ring blocks on ``device`` (one
    of :data:`DOCUMENT_KERNELS`; see the module doc for why)."""
    return "cpu_flash" if torch.device(device).type == "cpu" else "flex"


@functools.cache
def _compiled(fn):
    # Wrapped once per process; flex_attention without torch.compile runs an unfused
    # reference that materialises the scores. Default dynamic-shape policy: the ring's
    # block shapes (c or 2c rows) then share a kernel instead of each taking a recompile.
    return torch.compile(fn)


def _mask_mod(doc_q: Optional[torch.Tensor], doc_k: Optional[torch.Tensor], causal: bool):
    """flex's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for documents and/or causality."""
    if doc_q is None:
        return lambda b, h, qi, ki: qi >= ki
    if causal:
        return lambda b, h, qi, ki: (doc_q[b, qi] == doc_k[b, ki]) & (qi >= ki)
    return lambda b, h, qi, ki: doc_q[b, qi] == doc_k[b, ki]


def flex_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_q: Optional[torch.Tensor],
                         doc_k: Optional[torch.Tensor], causal: bool,
                         scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[B, Hq, Sq, D]`` over k ``[B, Hkv, Sk, D]``, v ``[B, Hkv, Sk, Dv]``
    (GQA: query head h reads kv head ``h // (Hq/Hkv)``) where query i sees key j iff
    ``doc_q[b, i] == doc_k[b, j]`` (int ``[B, Sq]``, ``[B, Sk]``; both None: no documents)
    and, when ``causal``, ``j <= i`` (top-left aligned). One flex_attention call.

    Returns out ``[B, Hq, Sq, Dv]`` (q's dtype) and lse ``[B, Hq, Sq]`` (float32, float64
    for float64 inputs; natural log), both differentiable. A query row that sees no key
    gets out 0 and lse ``-inf``.
    """
    if (doc_q is None) != (doc_k is None):
        raise ValueError("flex_block_attention: pass both doc_q and doc_k, or neither")
    B, _, Sq, _ = q.shape
    Sk = k.shape[2]
    if doc_q is not None:
        # The loader's ids may still be on the host; the mask is evaluated on q's device.
        doc_q, doc_k = doc_q.to(q.device, non_blocking=True), doc_k.to(q.device, non_blocking=True)
    block_mask = None
    if doc_q is not None or causal:
        make_mask = _compiled(create_block_mask) if q.is_cuda else create_block_mask
        block_mask = make_mask(_mask_mod(doc_q, doc_k, causal), B, None, Sq, Sk, device=q.device)
    attend = _compiled(flex_attention) if q.is_cuda else flex_attention
    out, aux = attend(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                      return_aux=AuxRequest(lse=True))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return out, aux.lse.to(acc)


def flex_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, doc_q: Optional[torch.Tensor],
                        doc_k: Optional[torch.Tensor], causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block (as :func:`flex_block_attention` masks it) given the row's
    FINAL ``out`` ``[B, Hq, Sq, Dv]`` and ``lse`` ``[B, Hq, Sq]`` over all blocks, by
    recomputing the block under autograd (see the module doc). Summing dq over blocks and
    gathering dk/dv gives the grads of attention over all keys."""
    with torch.enable_grad():
        qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
        blk_out, blk_lse = flex_block_attention(qd, kd, vd, doc_q, doc_k, causal, scale)
    # Every row sees at least itself over the whole ring, so the final lse is finite; a
    # row without keys in this block has blk_lse -inf, weight 0 and blk_out 0.
    w = (blk_lse.detach() - lse).exp()  # [B, Hq, Sq]
    dout_acc = dout.to(w.dtype)
    grad_out = (w.unsqueeze(-1) * dout_acc).to(blk_out.dtype)
    grad_lse = w * (dout_acc * (blk_out.detach().to(w.dtype) - out.to(w.dtype))).sum(-1)
    dq, dk, dv = torch.autograd.grad((blk_out, blk_lse), (qd, kd, vd), (grad_out, grad_lse.to(blk_lse.dtype)))
    return dq, dk, dv

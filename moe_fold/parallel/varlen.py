"""Packed sequences: attention confined to each document (varlen attention) and the
per-micro-batch description the model needs to do it.

A packed sample holds several documents back to back; its ``cu_seqlens`` (the data
loader's segment starts over the ``B*S`` flattened positions) say where each starts.
Attention must never cross a document boundary. Two representations are used:

- ``doc_ids`` ``[B, S]`` (int64): the document of every token of the whole sequence the
  attention group sees, in natural (unsharded) order, numbered over the flattened batch,
  so equal ids mean "same document" across the batch too. Under context parallelism every
  rank of the group holds the same ``doc_ids``; a rank derives the ids of any rank's
  zigzag shard from it without communication (ring attention, block by block).
- segments: runs of equal ids; :func:`varlen_attention` runs causal attention on each
  run separately: off the CPU one flex_attention call with a document block mask, on
  CPU one fused SDPA call per document (see :mod:`moe_fold.parallel.document_attention`);
  either way the work is about ``sum(len^2)``, not ``S^2``.

:class:`Documents` carries one micro-batch's ids, the group attention runs over (the
layout's cp group, or a dynamic-cp sub-group, :mod:`moe_fold.training.dynamic_cp`) and the mask of
real (non-padding) tokens the router uses for its losses and counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from moe_fold.comm import Group, group_size
from moe_fold.parallel import document_attention
from moe_fold.parallel.recurrent_cp import local_segments

__all__ = ["Documents", "SequenceStarts", "sequence_starts", "starts_from_resets", "doc_ids_from_cu_seqlens", "chunk_doc_ids", "segment_bounds", "pad_head", "sdpa",
           "varlen_attention", "router_token_mask"]


@dataclass(frozen=True)
class SequenceStarts:
    """Where the recurrent layers' sequences start in one local segment ``[B, L]`` of the
    sequence (:func:`moe_fold.parallel.recurrent_cp.local_segments`): at every row start and
    every document start, the state and the conv window reset at the latter.

    ``resets``: bool ``[B, L]``, a document starts at this token (a row's token 0 only where
    one does). ``cu_seqlens``: int64 ``[N+1]``, the N sequences' starts over the ``B*L``
    flattened tokens, then ``B*L``. ``cu_seqlens_cpu``: the same on the host, for kernels that
    size their grid by the sequences (fla), so that no layer reads the device back."""

    resets: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor


def sequence_starts(doc_ids: torch.Tensor, group: Group, device: torch.device) -> list[SequenceStarts]:
    """The :class:`SequenceStarts` of each of this rank's local segments (in local order),
    on ``device``, from ``doc_ids [B, S_seq]`` (natural order; best on the host, where the
    loader makes them: on a device this reads them back once)."""
    S_seq = doc_ids.shape[1]
    ids = doc_ids.cpu()
    out = []
    for lo, hi, index in local_segments(S_seq // group_size(group), group):
        start, length = index * (hi - lo), hi - lo
        seg = ids[:, start:start + length]
        prev = ids[:, start - 1:start + length - 1] if start else torch.cat([seg[:, :1] - 1, seg[:, :-1]], dim=1)
        out.append(starts_from_resets(seg != prev, device))
    return out


def starts_from_resets(resets: torch.Tensor, device: torch.device) -> SequenceStarts:
    """The :class:`SequenceStarts` on ``device`` of one segment whose documents start where
    ``resets`` (bool ``[B, L]``) says (on the host, or read back from the device here)."""
    resets = resets.cpu()
    B, L = resets.shape
    begins = resets.clone()
    begins[:, 0] = True  # every row starts a sequence
    first = begins.flatten().nonzero().flatten()  # [N]
    cu = torch.cat([first, first.new_tensor([B * L])])
    return SequenceStarts(resets.to(device, non_blocking=True), cu.to(device, non_blocking=True), cu)


@dataclass
class Documents:
    """Where attention may look, for one micro-batch on this rank.

    ``doc_ids``: int64 ``[B, S_seq]``, natural order, over the whole sequence the attention
    group attends across (``S_seq = S_local * group size``); None: each row is one causal
    sequence. ``cp_group``: the group attention runs over (None or size 1: local).
    ``token_mask``: bool ``[T_local]`` in the MLP's token order (``[S_local(/tp), B]``
    flattened), True for real tokens; None: every token is real. ``starts``: with
    ``doc_ids``, the recurrent layers' sequences in each local segment
    (:func:`sequence_starts`), made once per micro-batch; made from ``doc_ids`` here when not given.
    """

    doc_ids: Optional[torch.Tensor]
    cp_group: Group
    token_mask: Optional[torch.Tensor] = None
    starts: Optional[list[SequenceStarts]] = None

    def __post_init__(self):
        if self.doc_ids is not None and self.starts is None:
            self.starts = sequence_starts(self.doc_ids, self.cp_group, self.doc_ids.device)


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> Optional[torch.Tensor]:
    """``cu_seqlens`` (segment starts over ``batch*seq_len`` flattened positions, then
    ``batch*seq_len``) -> ``doc_ids [batch, seq_len]``; None when every row is exactly one
    segment (plain causal attention needs no ids)."""
    cu = cu_seqlens.to(torch.int64)
    total = batch * seq_len
    if cu.dim() != 1 or len(cu) < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} must start at 0 and end at batch*seq_len={total}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} must be strictly increasing")
    rows = torch.arange(0, total + 1, seq_len, dtype=torch.int64, device=cu.device)
    if len(cu) == batch + 1 and torch.equal(cu, rows):
        return None
    # A segment crossing a row boundary would let attention run across samples.
    if not bool(torch.isin(rows, cu).all()):
        raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} must contain every row start (multiples of "
                         f"seq_len={seq_len}): a document may not span two samples")
    lengths = cu[1:] - cu[:-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)  # [B*S]
    return ids.view(batch, seq_len)


def chunk_doc_ids(doc_ids: Optional[torch.Tensor], batch: int, seq_len: int, chunk: int,
                  device: torch.device) -> torch.Tensor:
    """Chunked local attention (Llama-4) as documents: ids ``[batch, seq_len]`` equal iff two
    tokens share a document (``doc_ids [batch, seq_len]``; None: each row is one) and the
    chunk of ``chunk`` positions they fall in, positions counted from their document's
    start (the positions the loader gives packed documents). Every document path (varlen,
    ring, a2a, dynamic cp) then runs chunked attention as it is."""
    idx = torch.arange(seq_len, device=device).expand(batch, seq_len)  # [B, S]
    if doc_ids is None:
        docs, pos = torch.arange(batch, device=device).view(batch, 1).expand(batch, seq_len), idx
    else:
        docs = doc_ids.to(device)
        start = torch.ones_like(docs, dtype=torch.bool)
        start[:, 1:] = docs[:, 1:] != docs[:, :-1]
        # Each token's document start: the last start at or before it.
        pos = idx - torch.cummax(torch.where(start, idx, 0), dim=1).values
    per_doc = -(-seq_len // chunk)  # chunks a document of the row can have, at most
    return docs * per_doc + torch.div(pos, chunk, rounding_mode="floor")


def segment_bounds(doc_ids: torch.Tensor) -> list[int]:
    """Starts of the runs of equal ids in ``doc_ids [B, S]`` flattened, then ``B*S``; a new
    row always starts a run."""
    B, S = doc_ids.shape
    flat = doc_ids.reshape(-1)
    change = torch.ones(B * S, dtype=torch.bool, device=doc_ids.device)
    change[1:] = flat[1:] != flat[:-1]
    change[::S] = True
    # .cpu() (a no-op on the CPU, where this runs): a dry run answers it for meta ids
    return torch.nonzero(change).flatten().cpu().tolist() + [B * S]


def pad_head(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [..., D]`` with zero columns up to ``[..., width]`` (itself when ``D == width``)."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _one_width(q, k, v, scale):
    """q, k, v padded with zero columns to one head width, and the scale of the unpadded
    q/k. A zero column of q/k adds nothing to a score, one of v gives a zero output
    column: the result cut back to v's width is exact. Why: the fused SDPA kernels (CPU
    flash, CUDA flash) take one head width, and without them SDPA falls back to its math
    path, which keeps the ``S x S`` probabilities (MLA's v is narrower than q/k)."""
    width = max(q.shape[-1], v.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return pad_head(q, width), pad_head(k, width), pad_head(v, width), scale


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool, scale: Optional[float] = None,
         enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` that also takes v of another head width than
    q/k (q/k ``[..., D]``, v ``[..., Dv]`` -> ``[..., Dv]``; see :func:`_one_width`)."""
    dv = v.shape[-1]
    if q.shape[-1] == dv:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    q, k, v, scale = _one_width(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)[..., :dv]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: Optional[torch.Tensor],
                     scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention inside each document: q/k ``[B, Hq|Hkv, S, D]``, v ``[B, Hkv, S, Dv]``
    (GQA as in SDPA's ``enable_gqa``), ``doc_ids [B, S]`` natural order (None: one
    causal sequence per row). Returns ``[B, Hq, S, Dv]``.

    The kernel follows :func:`moe_fold.parallel.document_attention.document_kernel`: one
    flex_attention call off the CPU; on CPU one fused CPU flash call per document."""
    gqa = q.shape[1] != k.shape[1]
    if doc_ids is None:
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    B, _, S, _ = q.shape
    if tuple(doc_ids.shape) != (B, S):
        raise ValueError(f"doc_ids has shape {tuple(doc_ids.shape)}; expected [B, S] = {(B, S)} of q {tuple(q.shape)}")
    if document_attention.document_kernel(q.device) == "flex":
        return document_attention.flex_block_attention(q, k, v, doc_ids, doc_ids, True, scale)[0]
    dv = v.shape[-1]
    if q.shape[-1] != dv:
        q, k, v, scale = _one_width(q, k, v, scale)
    bounds = segment_bounds(doc_ids)
    # One document is a slice of one row; 4-D slices keep SDPA on the CPU flash kernel
    # (it takes no 3-D input and would fall back to the math path, which keeps len^2 scores).
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        row, a, b = a // S, a % S, a % S + (b - a)
        outs.append(F.scaled_dot_product_attention(q[row:row + 1, :, a:b], k[row:row + 1, :, a:b],
                                                   v[row:row + 1, :, a:b], is_causal=True, scale=scale,
                                                   enable_gqa=gqa))  # [1, Hq, len, D]
    out = torch.cat(outs, dim=2)  # [1, Hq, B*S, D]: the rows back to back
    return out.view(q.shape[1], B, S, -1).transpose(0, 1)[..., :dv]


def router_token_mask(token_mask: Optional[torch.Tensor], tp_rank: int, tp: int,
                      sequence_parallel: bool) -> Optional[torch.Tensor]:
    """Real-token mask ``[B, S_local]`` -> ``[T_local]`` in the order the MLP sees this rank's
    tokens: ``[S_local, B]`` flattened, this tp rank's sequence slice under SP."""
    if token_mask is None:
        return None
    m = token_mask.t()  # [S_local, B]
    if sequence_parallel and tp > 1:
        m = m.chunk(tp, dim=0)[tp_rank]  # [S_local/tp, B]
    return m.reshape(-1).to(torch.bool)

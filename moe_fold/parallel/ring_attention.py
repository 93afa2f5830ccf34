"""Ring attention: attention over a sequence split across the cp ranks in the zigzag layout.

The sequence is cut into ``2*cp`` chunks of ``c`` tokens; cp rank ``r`` holds chunks ``r``
and ``2cp-1-r`` (see :func:`moe_fold.parallel.context_parallel.zigzag_split`). Each rank keeps its
queries and passes its K/V block around the cp ring: at step ``i`` rank ``r`` holds the K/V
of rank ``src = (r - i) mod cp``. Under a causal mask every step costs the same ``2c*c``
query-key pairs on every rank, which is why the zigzag layout is used:

- step 0 (``src == r``): the local block, causal (local order is increasing position);
- ``src < r``: both local query chunks see only the first K/V chunk (``src``), unmasked;
- ``src > r``: only the second query chunk (``2cp-1-r``) sees anything, all of it, unmasked.

Partial results are merged with their log-sum-exp. The backward runs the ring again: K/V
travel with float32 dK/dV accumulators; after the last step one more hop brings each
accumulator home. Each block's backward uses the FINAL output and log-sum-exp, which
makes the block grads add up to the full attention's grads.

Bytes sent per rank and call (``comm`` counter, under the group's kind), with
``kv = bytes(k) + bytes(v)`` of the local shard and ``kv_acc`` the same in the
accumulation dtype (float32; float64 for float64 inputs): forward ``(cp-1) * kv``;
backward ``(cp-1) * kv + cp * kv_acc``.

Block kernels (:func:`moe_fold.parallel.document_attention.document_kernel` picks by
device): on CPU, aten's fused flash attention for CPU (returns the log-sum-exp and takes
it back in its backward; handles GQA natively); elsewhere one flex_attention call per
block (compiled on CUDA), which returns the log-sum-exp too; its backward recomputes the
block (:func:`moe_fold.parallel.document_attention.flex_block_backward`). Neither keeps an
``S x S`` score matrix. V's head width may differ from q/k's (MLA: ``v_head_dim`` vs
``qk_nope + qk_rope``). flex takes that as it is; the CPU kernel wants one width, so the
narrower side is padded with zero columns for the call and the result cut back: a zero
column of q/k adds nothing to a score, a zero column of v gives a zero output column.
Only the kernel call is padded; the ring moves K and V at their own widths.

Packed documents: with ``doc_shards`` (every cp rank's document ids of its shard) each
block is masked to query/key pairs of the same document. flex does it in the one call
(the block mask skips tiles without a shared document; no host sync). On CPU each block
runs varlen: for every document on both sides, its queries against its keys with the CPU
kernel (causal on the diagonal block), so the work is the documents' pairs, not the
block's; a block without a shared document is skipped. A query row whose document has
no keys in a block has lse ``-inf`` there and adds nothing in the merge.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from moe_fold.comm import Group, batch_send_recv, group_rank, group_size
from moe_fold.parallel import document_attention
from moe_fold.parallel.varlen import pad_head

__all__ = ["ring_attention", "block_attention_forward", "block_attention_backward"]

_ALL = slice(None)


# --------------------------------------------------------------------------- block kernels

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block with its log-sum-exp.

    q ``[B, Hq, Sq, D]``, k ``[B, Hkv, Sk, D]``, v ``[B, Hkv, Sk, Dv]`` (Hq a multiple of Hkv,
    query head h uses kv head ``h // (Hq/Hkv)``). ``causal`` masks key j > query i (top-left
    aligned; the ring uses it only on square blocks). Returns out ``[B, Hq, Sq, Dv]`` (q's dtype) and lse
    ``[B, Hq, Sq]`` (float32, float64 for float64 inputs: the natural log of the softmax
    denominator of the scaled scores).
    """
    if document_attention.document_kernel(q.device) == "flex":
        return document_attention.flex_block_attention(q, k, v, None, None, causal, scale)
    d, dv = q.shape[-1], v.shape[-1]
    width = max(d, dv)
    q, k, v = pad_head(q, width), pad_head(k, width), pad_head(v, width)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[..., :dv], lse.to(_acc_dtype(q.dtype))


def block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool,
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one block given the row's FINAL ``out`` and ``lse`` (over all blocks).

    With the final statistics the block grads are exact shares of the full grads: summing
    dq over blocks and concatenating dk/dv gives the grads of attention over all keys.
    """
    if document_attention.document_kernel(q.device) == "flex":
        return document_attention.flex_block_backward(dout, q, k, v, out, lse, None, None, causal, scale)
    d, dv = q.shape[-1], v.shape[-1]
    width = max(d, dv)
    dq, dk, dv_ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        pad_head(dout, width), pad_head(q, width), pad_head(k, width), pad_head(v, width), pad_head(out, width),
        lse, 0.0, causal, scale=scale)
    return dq[..., :d], dk[..., :d], dv_[..., :dv]


# --------------------------------------------------------------------------- the ring

def _step_blocks(i: int, src: int, rank: int, c: int, causal: bool) -> tuple[slice, slice, bool]:
    """(local query rows, rows of the visiting K/V, causal mask?) for ring step ``i``."""
    if not causal:
        return _ALL, _ALL, False
    if i == 0:
        return _ALL, _ALL, True
    if src < rank:
        return _ALL, slice(0, c), False
    return slice(c, None), _ALL, False


def _merge_(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running float32 (out, lse), in place. Rows that
    have seen no key yet (lse -inf on both sides) stay at out 0, lse -inf."""
    new = torch.logaddexp(lse, blk_lse)
    ref = new.masked_fill(new == -math.inf, 0)
    out.mul_((lse - ref).exp().unsqueeze(-1))
    out.add_(blk_out.to(out.dtype) * (blk_lse - ref).exp().unsqueeze(-1))
    lse.copy_(new)


def _doc_pieces(doc_q: torch.Tensor, doc_k: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(batch row, query indices, key indices)`` of every document present on both sides
    of a block (``doc_q [B, Sq]``, ``doc_k [B, Sk]``): the only query/key pairs that may
    meet. Empty when the block has nothing to compute."""
    pieces = []
    for b in range(doc_q.shape[0]):
        for d in torch.unique(doc_q[b]).cpu().tolist():  # .cpu(): a dry run's meta ids answer it
            keys = torch.nonzero(doc_k[b] == d).flatten()
            if len(keys):
                pieces.append((b, torch.nonzero(doc_q[b] == d).flatten(), keys))
    return pieces


def _pieces_forward(q, k, v, pieces, causal, scale):
    """Block attention restricted to ``pieces`` (:func:`_doc_pieces`): each document's
    queries against its keys (causal on the diagonal block, where both sides are the same
    tokens in position order). Rows of documents without keys here get out 0, lse -inf."""
    out = q.new_zeros(q.shape[:3] + v.shape[3:])  # [B, Hq, Sq, Dv]
    lse = torch.full(q.shape[:3], -math.inf, dtype=_acc_dtype(q.dtype), device=q.device)
    for b, qi, ki in pieces:
        o, l = block_attention_forward(q[b:b + 1, :, qi], k[b:b + 1, :, ki], v[b:b + 1, :, ki], causal, scale)
        out[b, :, qi], lse[b, :, qi] = o[0], l[0].to(lse.dtype)
    return out, lse


def _pieces_backward_(dq, dk, dv, dout, q, k, v, out, lse, pieces, causal, scale):
    """Add the block's grads over ``pieces`` into the accumulators, in place."""
    for b, qi, ki in pieces:
        bq, bk, bv = block_attention_backward(dout[b:b + 1, :, qi], q[b:b + 1, :, qi], k[b:b + 1, :, ki],
                                              v[b:b + 1, :, ki], out[b:b + 1, :, qi], lse[b:b + 1, :, qi],
                                              causal, scale)
        dq[b].index_add_(1, qi, bq[0].to(dq.dtype))
        dk[b].index_add_(1, ki, bk[0].to(dk.dtype))
        dv[b].index_add_(1, ki, bv[0].to(dv.dtype))


def _ring_peers(group: Group) -> tuple[int, int, int, int]:
    """(cp size, this rank's cp index, GLOBAL rank of the next and of the previous rank)."""
    cp, rank = group_size(group), group_rank(group)
    nxt, prv = (dist.get_global_rank(group, (rank + step) % cp) for step in (1, -1))
    return cp, rank, nxt, prv


def _rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    return x[:, :, rows]


def _masked_args(doc_shards, positions, window, rank, src, rows, kv_rows):
    """The document ids and :func:`document_attention._mask_mod` keywords of one ring block
    in masked mode (a sliding window or sinks): the causal mask compares the tokens' zigzag
    positions, so it holds on every block, not only the diagonal one."""
    docs = (None, None) if doc_shards is None else (doc_shards[rank][:, rows], doc_shards[src][:, kv_rows])
    return docs, dict(pos_q=positions[rank][rows], pos_k=positions[src][kv_rows], window=window)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, doc_shards, pos_shards, window, sinks):
        cp, rank, nxt, prv = _ring_peers(group)
        c = q.shape[2] // 2
        flex = document_attention.document_kernel(q.device) == "flex"
        # Masked mode: every block through masked_block_attention (window and/or sinks).
        masked_mode = bool(window) or sinks is not None
        positions = pos_shards
        out = lse = None
        kb, vb = k, v
        for i in range(cp):
            src = (rank - i) % cp
            rows, kv_rows, masked = _step_blocks(i, src, rank, c, causal)
            bq, bk, bv = _rows(q, rows), _rows(kb, kv_rows), _rows(vb, kv_rows)
            pieces = None
            if masked_mode:
                docs, win = _masked_args(doc_shards, positions, window, rank, src, rows, kv_rows)
                blk_out, blk_lse = document_attention.masked_block_attention(bq, bk, bv, *docs, causal, scale, **win)
            elif doc_shards is None:
                blk_out, blk_lse = block_attention_forward(bq, bk, bv, masked, scale)
            elif flex:  # one call: the document mask skips blocks without a shared document
                blk_out, blk_lse = document_attention.flex_block_attention(
                    bq, bk, bv, doc_shards[rank][:, rows], doc_shards[src][:, kv_rows], masked, scale)
            else:
                pieces = _doc_pieces(doc_shards[rank][:, rows], doc_shards[src][:, kv_rows])
                blk_out, blk_lse = _pieces_forward(bq, bk, bv, pieces, masked, scale)
            if i == 0:  # step 0 covers every local row (every token sees itself)
                out, lse = blk_out.to(blk_lse.dtype), blk_lse.clone()
            elif pieces is None or pieces:
                _merge_(_rows(out, rows), _rows(lse, rows), blk_out, blk_lse)
            if i < cp - 1:
                kb, vb = batch_send_recv(
                    [("send", kb, nxt), ("send", vb, nxt),
                     ("recv", (kb.shape, kb.dtype), prv), ("recv", (vb.shape, vb.dtype), prv)],
                    group, device=q.device)
        if sinks is not None:
            # The sink joins each row's denominator once, after all blocks; the backward then
            # runs on these final statistics (document_attention.masked_block_backward).
            out, lse = document_attention.apply_sinks(out, lse, sinks.detach())
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.causal, ctx.scale, ctx.doc_shards = group, causal, scale, doc_shards
        ctx.window, ctx.masked_mode, ctx.positions = window, masked_mode, positions
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp, rank, nxt, prv = _ring_peers(group)
        c = q.shape[2] // 2
        flex = document_attention.document_kernel(q.device) == "flex"
        doc_shards = ctx.doc_shards
        dout = dout.contiguous()
        acc = _acc_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        # Accumulators in acc dtype (float32 at least): a block's dK/dV sums over all cp ranks' queries.
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        kb, vb = k, v
        for i in range(cp):
            src = (rank - i) % cp
            rows, kv_rows, masked = _step_blocks(i, src, rank, c, causal)
            args = (_rows(dout, rows), _rows(q, rows), _rows(kb, kv_rows), _rows(vb, kv_rows),
                    _rows(out, rows), _rows(lse, rows))
            if ctx.masked_mode or doc_shards is None or flex:
                if ctx.masked_mode:
                    docs, win = _masked_args(doc_shards, ctx.positions, ctx.window, rank, src, rows, kv_rows)
                    bq, bk, bv = document_attention.masked_block_backward(*args, *docs, causal, scale, **win)
                elif doc_shards is None:
                    bq, bk, bv = block_attention_backward(*args, masked, scale)
                else:
                    bq, bk, bv = document_attention.flex_block_backward(
                        *args, doc_shards[rank][:, rows], doc_shards[src][:, kv_rows], masked, scale)
                _rows(dq, rows).add_(bq)
                _rows(dk, kv_rows).add_(bk)
                _rows(dv, kv_rows).add_(bv)
            else:
                pieces = _doc_pieces(doc_shards[rank][:, rows], doc_shards[src][:, kv_rows])
                _pieces_backward_(_rows(dq, rows), _rows(dk, kv_rows), _rows(dv, kv_rows), *args, pieces,
                                  masked, scale)
            if i < cp - 1:
                kb, vb, dk, dv = batch_send_recv(
                    [("send", kb, nxt), ("send", vb, nxt), ("send", dk, nxt), ("send", dv, nxt),
                     ("recv", (kb.shape, kb.dtype), prv), ("recv", (vb.shape, vb.dtype), prv),
                     ("recv", (dk.shape, dk.dtype), prv), ("recv", (dv.shape, dv.dtype), prv)],
                    group, device=q.device)
        # After cp steps a rank holds the finished accumulator of the next rank's block.
        dk, dv = batch_send_recv(
            [("send", dk, nxt), ("send", dv, nxt),
             ("recv", (dk.shape, dk.dtype), prv), ("recv", (dv.shape, dv.dtype), prv)],
            group, device=q.device)
        dsinks = None
        if sinks is not None:
            # d lse'/d sink = p_sink; d out'/d lse' = -out': d sink = -sum(p_sink * rowsum(dO * out')),
            # this rank's rows only (the grad sync sums the cp ranks).
            p_sink = (sinks.to(lse.dtype).view(1, -1, 1) - lse).exp()  # [B, Hq, S_local]
            dsinks = -(p_sink * (dout.to(acc) * out.to(acc)).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, dsinks


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                   causal: bool = True, scale: Optional[float] = None,
                   doc_shards: Optional[torch.Tensor] = None, window: int = 0,
                   sinks: Optional[torch.Tensor] = None, pos_shards: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Ring attention over ``group`` (size >= 2) for zigzag-sharded q ``[B, Hq, S_local, D]``,
    k ``[B, Hkv, S_local, D]`` and v ``[B, Hkv, S_local, Dv]``; returns this rank's output
    ``[B, Hq, S_local, Dv]``.
    ``doc_shards`` ``[cp, B, S_local]``: the document ids of every cp rank's shard (packed
    sequences); attention stays inside each document. ``window`` (> 0): a sliding window
    of that many keys (needs causal); ``sinks [Hq]``: attention sinks
    (:func:`moe_fold.parallel.document_attention.apply_sinks`). Either runs every block
    through :func:`moe_fold.parallel.document_attention.masked_block_attention`, with
    ``pos_shards [cp, S_local]``: every cp rank's tokens' sequence indices (its zigzag
    positions), which the masks compare.

    Callers normally go through :func:`moe_fold.parallel.context_parallel.context_parallel_attention`,
    which validates the shapes and sends a group of one rank to plain attention.
    """
    if group_size(group) < 2:
        raise ValueError(f"ring_attention needs a cp group of at least 2 ranks, got {group_size(group)}")
    if q.shape[2] % 2:
        raise ValueError(f"ring_attention: local sequence length {q.shape[2]} must be even "
                         "(a zigzag shard is two equal chunks)")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if doc_shards is not None and tuple(doc_shards.shape) != (group_size(group), q.shape[0], q.shape[2]):
        raise ValueError(f"doc_shards has shape {tuple(doc_shards.shape)}; expected [cp, B, S_local] = "
                         f"{(group_size(group), q.shape[0], q.shape[2])}")
    if (window or sinks is not None) and (not causal or pos_shards is None):
        raise ValueError("ring_attention: a sliding window or sinks need causal=True and pos_shards")
    return _RingAttention.apply(q, k, v, group, causal, float(scale), doc_shards, pos_shards, int(window), sinks)

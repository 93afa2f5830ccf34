"""All-to-all token dispatcher over the ep group, with expert-tensor parallelism (etp).

Dispatch, on every rank of an etp x ep group (each rank holds its own tokens):

1. count the routed tokens per expert and all-gather the counts over etp x ep (the one
   host synchronisation; the padded mode skips it), permute the tokens to expert-major
   order, which is also destination-rank-major;
2. all-to-all over ep: each rank receives, from the ep ranks with its own etp rank, the
   rows for its local experts; then all-gather over etp, so the etp ranks of one ep
   rank (which hold shards of the same experts) all see the rows of all their sources;
3. sort the received chunks ``[etp source][ep source][local expert]`` to
   ``[local expert][ep source][etp source]``.

Combine is the exact reverse: sort back, reduce-scatter over etp (which also sums the
etp shards' partial outputs), all-to-all back over ep, unpermute (scatter-add).

The asynchronous steps (``dispatch_start`` / ``combine_start``) keep the all-to-all over ep
in flight; the etp all-gather and reduce-scatter depend on it (they send what it received,
or make what it sends), so they run blocking, right after the wait or before the post.

Modes:

- ``dropless``: any number of tokens per expert, zero included;
- ``capacity``: the router already dropped tokens over capacity; moved like dropless;
- ``pad``: every expert gets exactly C rows from every source rank (empty slots are zero
  rows with prob 0), so every split is known from the config: no count exchange and no
  host synchronisation. Every rank must hold the same number of tokens.

``dedup=True`` (rank-deduplicated all-to-all): a token routed to several experts on one
destination rank is sent there once, with its probs and routing map over that rank's
experts; the destination expands it to one row per expert, and on combine sums the
token's expert outputs (already prob-weighted) before sending one row back. Same
results as the plain mode, fewer bytes when topk > 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from moe_fold import comm
from moe_fold.config import capacity_factor_positive, dispatch_modes, require
from moe_fold.dispatch.interface import MODES, Handle, TokenDispatcher, WireBytes, expert_major_order
from moe_fold.dispatch.placement import Placement, expert_order
from moe_fold.dispatch.router import capacity_of
from moe_fold.kernels.permute import chunks_sorted, padded_rows, permuted_rows, unpermuted

if TYPE_CHECKING:
    from moe_fold.layout import ProcessGroups

__all__ = ["AllToAllDispatcher", "AllToAllHandle"]


@dataclass
class AllToAllHandle(Handle):
    # Source side: the token of each sent row (permute's sorted_indices).
    sorted_indices: Optional[torch.Tensor] = None
    # Rows sent to / received from each ep rank, rows received from each etp rank
    # (None in the padded mode: equal splits).
    input_splits: Optional[list[int]] = None
    output_splits: Optional[list[int]] = None
    etp_splits: Optional[list[int]] = None
    # Chunk sizes after the all-gather over etp, in [etp][ep][local expert] order
    # (dedup: [etp][ep]), and the same in the expert order for the way back (plain modes);
    # int64 tensors on the tokens' device, for sort_chunks.
    chunk_sizes: Optional[torch.Tensor] = None
    sorted_chunk_sizes: Optional[torch.Tensor] = None
    # Rows per local expert, on the host (from the count exchange) and on the device.
    tokens_per_local_expert: Optional[list[int]] = None
    device_tokens_per_local_expert: Optional[torch.Tensor] = None
    # Dedup only: the received row of each expanded row, and the number of received rows.
    local_indices: Optional[torch.Tensor] = None
    num_received: int = 0
    # A placement other than the default (plain modes): the rows sent to each slot, in
    # slot order (on the device), to put the rows coming back in expert order
    # (sorted_indices' order).
    slot_sizes: Optional[torch.Tensor] = None


class AllToAllDispatcher(TokenDispatcher):
    """All-to-all dispatcher; see the module docstring.

    ``mode`` is ``dropless``, ``capacity`` or ``pad``; ``capacity_factor`` is required
    by ``capacity`` and ``pad`` (``pad`` uses it for the capacity
    ``expert_capacity(T, E, topk, capacity_factor)`` from the router). ``dedup`` works with
    ``dropless`` and ``capacity``.

    Under a placement other than the default, the rows that come back are put in the
    default's expert-major order before the unpermute, so each token sums its expert
    outputs in the same order whatever the placement (the same bits; dedup sums a token's
    rows per destination rank, so there the order follows the placement).
    """

    def __init__(self, num_experts: int, topk: int, groups: "ProcessGroups", *,
                 mode: str = "dropless", capacity_factor: Optional[float] = None,
                 dedup: bool = False, permute_backend: str = "torch", placement: Optional[Placement] = None):
        super().__init__(num_experts, topk, groups, permute_backend=permute_backend, placement=placement)
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {MODES}")
        if mode != "dropless" and capacity_factor is None:
            raise ValueError(f"mode={mode!r} needs capacity_factor, got None")
        require(capacity_factor_positive, capacity_factor)
        require(dispatch_modes, "alltoall", capacity_factor, mode == "pad", dedup)
        self.mode = mode
        self.capacity_factor = capacity_factor
        self.dedup = dedup
        self._chunk_orders()

    def set_placement(self, placement: Placement) -> None:
        super().set_placement(placement)
        if hasattr(self, "dedup"):  # not during the base class's __init__
            self._chunk_orders()

    def _chunk_orders(self) -> None:
        # [etp][ep][local expert] -> [local expert][ep][etp], and dedup's [etp][ep] -> [ep][etp].
        self._order = expert_major_order(self.etp, self.ep, self.num_local_experts)
        self._inverse_order = expert_major_order(self.etp, self.ep, self.num_local_experts, inverse=True)
        self._rank_order = expert_major_order(self.etp, self.ep, 1)
        self._rank_inverse_order = expert_major_order(self.etp, self.ep, 1, inverse=True)
        # With at most one of etp, ep, E_local above 1 the received order already is the
        # expert order; sorting would copy the rows for nothing (10% of a one-process MoE
        # layer's fwd+bwd at 16 experts, bench/moe_layer.py).
        self._sorts = self._order != list(range(len(self._order)))
        # Slot-major -> expert-major (the default placement's order) for the combine.
        self._expert_order = None if self.placement.is_default else expert_order(self.placement)
        self._slot_order = None if self._expert_order is None else \
            sorted(range(self.num_slots), key=self._expert_order.__getitem__)

    def capacity(self, num_tokens: int) -> int:
        """Rows per expert and source rank in the padded mode (the factor was checked when
        the dispatcher was built)."""
        return capacity_of(num_tokens, self.num_experts, self.topk, self.capacity_factor)

    def _capacity(self, num_tokens: int) -> Optional[int]:
        """Rows per slot the router keeps (the capacity mode), None when dropless."""
        return None if self.mode == "dropless" else self.capacity(num_tokens)

    # ------------------------------------------------------------------ dispatch

    def dispatch_preprocess(self, tokens, probs, routing_map):
        handle = AllToAllHandle(num_tokens=tokens.shape[0], wire=WireBytes())
        if self.dedup:
            return self._dedup_preprocess(tokens, probs, routing_map, handle)
        device = tokens.device
        if self.mode == "pad":
            c = self.capacity(tokens.shape[0])
            # Splits stay None: equal for every rank, the collectives need no sizes.
            chunks = self.etp * self.ep * self.num_local_experts
            handle.chunk_sizes = handle.sorted_chunk_sizes = torch.full((chunks,), c, dtype=torch.int64, device=device)
            handle.tokens_per_local_expert = [c * self.etp * self.ep] * self.num_local_experts
            handle.device_tokens_per_local_expert = torch.full((self.num_local_experts,), c * self.etp * self.ep,
                                                               dtype=torch.int64, device=device)
            slot_sizes = torch.full((self.num_slots,), c, dtype=torch.int64, device=device)
            x, p = self._permute(tokens, probs, routing_map, handle, slot_sizes, capacity=c)  # [ep*S*C, H]
            return handle, x, p

        el = self.num_local_experts
        counts = routing_map.sum(dim=0)  # [E] routed tokens per expert
        g, dev = self._gather_counts(counts, handle.wire, "slots", tokens.shape[0],
                                     self._capacity(tokens.shape[0]))  # [ep][etp][E] host ints, [ep, etp, E] on the device
        mine = slice(self.local_expert_start, self.local_expert_start + el)
        handle.input_splits = [sum(g[self.ep_rank][self.etp_rank][j * el:(j + 1) * el]) for j in range(self.ep)]
        handle.output_splits = [sum(g[j][self.etp_rank][mine]) for j in range(self.ep)]
        handle.etp_splits = [sum(sum(g[j][t][mine]) for j in range(self.ep)) for t in range(self.etp)]
        handle.tokens_per_local_expert = [sum(g[j][t][self.local_expert_start + le]
                                              for j in range(self.ep) for t in range(self.etp)) for le in range(el)]
        # The same sizes on the device, taken from the gathered tensor: [ep, etp, E_local] ->
        # [etp][ep][local expert] chunks, and in the expert order for the way back.
        handle.chunk_sizes = dev[:, :, mine].transpose(0, 1).reshape(-1)
        handle.sorted_chunk_sizes = handle.chunk_sizes.index_select(0, self._on_device("_order", device))
        handle.device_tokens_per_local_expert = dev[:, :, mine].sum(dim=(0, 1))
        x, p = self._permute(tokens, probs, routing_map, handle, dev[self.ep_rank, self.etp_rank],
                             num_rows=sum(handle.input_splits))  # [T, H] -> [N, H]
        return handle, x, p

    def _permute(self, tokens, probs, routing_map, handle, slot_sizes, *, capacity=None, num_rows=None):
        """Rows in slot-major order (destination-rank-major), padded to ``capacity`` if
        given (else ``num_rows`` of them, known on the host). ``slot_sizes``: the rows of
        each slot, on the device. Under a placement other than the default, the rows are
        gathered in the default's expert-major order and then reordered by slot, so a
        token's rows (and the grads that flow back into it) are summed in one order
        whatever the placement."""
        if self._expert_order is not None:
            cols = self._on_device("_expert_order", routing_map.device)
            routing_map, probs = routing_map.index_select(1, cols), probs.index_select(1, cols)
        if capacity is None:
            x, p, handle.sorted_indices = permuted_rows(tokens, routing_map, probs, backend=self.permute_backend,
                                                  num_rows=num_rows)
        else:
            x, p, handle.sorted_indices = padded_rows(tokens, routing_map, probs, capacity,
                                                         backend=self.permute_backend)
        if self._expert_order is not None:
            handle.slot_sizes = slot_sizes
            expert_sizes = slot_sizes.index_select(0, cols)
            slot_order = self._on_device("_slot_order", x.device)
            x = chunks_sorted(x, expert_sizes, slot_order, backend=self.permute_backend)
            p = chunks_sorted(p, expert_sizes, slot_order, backend=self.permute_backend)
        return x, p

    def dispatch_communicate(self, x, probs, handle):
        groups, wire = self.groups, handle.wire
        wire.dispatch += comm.all_to_all_bytes(x, handle.input_splits, groups.ep)
        wire.meta += comm.all_to_all_bytes(probs, handle.input_splits, groups.ep)
        x = comm.all_to_all(x, handle.output_splits, handle.input_splits, groups.ep)
        probs = comm.all_to_all(probs, handle.output_splits, handle.input_splits, groups.ep)
        return self._gather_over_etp(x, probs, handle)

    def dispatch_communicate_start(self, x, probs, handle):
        # Only the all-to-all over ep is in flight: the all-gather over etp sends what it
        # received, so it runs inside wait().
        groups, wire = self.groups, handle.wire
        wire.dispatch += comm.all_to_all_bytes(x, handle.input_splits, groups.ep)
        wire.meta += comm.all_to_all_bytes(probs, handle.input_splits, groups.ep)
        rows = comm.all_to_all_start(x, handle.output_splits, handle.input_splits, groups.ep)
        meta = comm.all_to_all_start(probs, handle.output_splits, handle.input_splits, groups.ep)
        return comm.Pending(None, lambda: self._gather_over_etp(rows.wait(), meta.wait(), handle))

    def _gather_over_etp(self, x, probs, handle):
        groups, wire = self.groups, handle.wire
        sent = comm.all_gather_bytes(x, groups.etp)
        wire.dispatch += sent
        wire.dispatch_etp += sent
        wire.meta += comm.all_gather_bytes(probs, groups.etp)
        x = comm.all_gather(x, groups.etp, handle.etp_splits)
        probs = comm.all_gather(probs, groups.etp, handle.etp_splits)
        return x, probs

    def dispatch_postprocess(self, x, probs, handle):
        if self.dedup:
            x, probs = self._dedup_postprocess(x, probs, handle)
        elif self._sorts:
            order = self._on_device("_order", x.device)
            x = chunks_sorted(x, handle.chunk_sizes, order, backend=self.permute_backend)
            probs = chunks_sorted(probs, handle.chunk_sizes, order, backend=self.permute_backend)
        return x, probs, handle.device_tokens_per_local_expert, handle.tokens_per_local_expert

    # ------------------------------------------------------------------ combine

    def combine_preprocess(self, x, handle):
        if self.dedup:
            # Sum each received token's expert outputs here, so one row goes back.
            x = unpermuted(x, handle.local_indices, handle.num_received,
                          backend=self.permute_backend)  # [N, H] -> [R, H]
            if self.etp > 1:
                sizes = handle.chunk_sizes.index_select(0, self._on_device("_rank_order", x.device))
                x = chunks_sorted(x, sizes, self._on_device("_rank_inverse_order", x.device),
                                backend=self.permute_backend)
            return x
        if self._sorts:
            x = chunks_sorted(x, handle.sorted_chunk_sizes, self._on_device("_inverse_order", x.device),
                            backend=self.permute_backend)
        return x

    def combine_communicate(self, x, handle):
        x = self._reduce_scatter_over_etp(x, handle)
        handle.wire.combine += comm.all_to_all_bytes(x, handle.output_splits, self.groups.ep)
        return comm.all_to_all(x, handle.input_splits, handle.output_splits, self.groups.ep)

    def combine_communicate_start(self, x, handle):
        # The reduce-scatter over etp makes what the all-to-all sends: it runs before the post.
        x = self._reduce_scatter_over_etp(x, handle)
        handle.wire.combine += comm.all_to_all_bytes(x, handle.output_splits, self.groups.ep)
        back = comm.all_to_all_start(x, handle.input_splits, handle.output_splits, self.groups.ep)
        return comm.Pending(None, back.wait)

    def _reduce_scatter_over_etp(self, x, handle):
        sent = comm.reduce_scatter_bytes(x, self.groups.etp, handle.etp_splits)
        handle.wire.combine += sent
        handle.wire.combine_etp += sent
        x = comm.reduce_scatter(x, self.groups.etp, handle.etp_splits)
        return x

    def combine_postprocess(self, x, handle):
        if handle.slot_sizes is not None:
            # Slot-major -> expert-major, the order the rows were gathered in (_permute).
            x = chunks_sorted(x, handle.slot_sizes, self._on_device("_expert_order", x.device),
                            backend=self.permute_backend)
        return unpermuted(x, handle.sorted_indices, handle.num_tokens,
                         backend=self.permute_backend)  # [N, H] -> [T, H]

    # ------------------------------------------------------------------ dedup

    def _dedup_preprocess(self, tokens, probs, routing_map, handle):
        num_tokens, el, ep = tokens.shape[0], self.num_local_experts, self.ep
        local_map = routing_map.reshape(num_tokens, ep, el)  # [T, E] -> [T, ep, E_local]
        rank_map = local_map.any(dim=2)  # [T, ep]: does the token go to ep rank j at all
        # One count exchange carries both the per-expert counts (for the experts) and
        # the per-rank row counts (for the splits).
        counts = torch.cat([routing_map.sum(dim=0), rank_map.sum(dim=0)])  # [ep*S + ep]
        g, dev = self._gather_counts(counts, handle.wire, "slots+ranks", num_tokens,
                                     self._capacity(num_tokens))  # [ep][etp][ep*S + ep], and [ep, etp, ep*S + ep]
        rows = [[g[j][t][self.num_slots + self.ep_rank] for t in range(self.etp)] for j in range(ep)]
        handle.input_splits = g[self.ep_rank][self.etp_rank][self.num_slots:]
        handle.output_splits = [rows[j][self.etp_rank] for j in range(ep)]
        handle.etp_splits = [sum(rows[j][t] for j in range(ep)) for t in range(self.etp)]
        handle.num_received = sum(handle.etp_splits)
        handle.tokens_per_local_expert = [
            sum(g[j][t][self.local_expert_start + le] for j in range(ep) for t in range(self.etp))
            for le in range(el)]
        # On the device: [ep, etp] rows from each source -> [etp][ep] chunks; per local expert.
        handle.chunk_sizes = dev[:, :, self.num_slots + self.ep_rank].t().reshape(-1)
        mine = slice(self.local_expert_start, self.local_expert_start + el)
        handle.device_tokens_per_local_expert = dev[:, :, mine].sum(dim=(0, 1))

        # [T, H] -> [R, H]: one row per (token, destination rank), destination-major.
        x, _, handle.sorted_indices = permuted_rows(tokens, rank_map, None, backend=self.permute_backend,
                                              num_rows=sum(handle.input_splits))
        dest = torch.repeat_interleave(torch.arange(ep, device=tokens.device),
                                       dev[self.ep_rank, self.etp_rank, self.num_slots:],
                                       output_size=x.shape[0])  # [R]: destination of each row
        # What the destination needs to expand a row: probs and map over its experts.
        row_probs = probs.reshape(num_tokens, ep, el)[handle.sorted_indices, dest]  # [R, E_local]
        row_map = local_map[handle.sorted_indices, dest].to(probs.dtype)  # [R, E_local]
        meta = torch.cat([row_probs, row_map], dim=1)  # [R, 2 * E_local]
        return handle, x, meta

    def _dedup_postprocess(self, x, meta, handle):
        el = self.num_local_experts
        if self.etp > 1:
            # [etp][ep] -> [ep][etp], so the expanded rows come out in the plain mode's order.
            order = self._on_device("_rank_order", x.device)
            x = chunks_sorted(x, handle.chunk_sizes, order, backend=self.permute_backend)
            meta = chunks_sorted(meta, handle.chunk_sizes, order, backend=self.permute_backend)
        row_probs, row_map = meta[:, :el], meta[:, el:] > 0.5
        # [R, H] -> [N, H]: one row per (token, local expert), local-expert-major.
        x, probs, handle.local_indices = permuted_rows(x, row_map, row_probs, backend=self.permute_backend,
                                                 num_rows=sum(handle.tokens_per_local_expert))
        return x, probs

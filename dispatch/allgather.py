"""All-gather token dispatcher: the simple baseline.

Dispatch all-gathers every rank's tokens, probs and routing map over the etp x ep
group, keeps the (token, expert) pairs of this rank's local experts and permutes them
to local-expert-major order. Combine unpermutes (scatter-add, so rows of the same token
are summed here) and reduce-scatters over etp x ep: each rank gets the sum over ranks
of its own tokens' rows, which also sums the etp shards' partial outputs.

Every token crosses the wire to every rank of the group whatever its routing, so this
sends more than the all-to-all when the group is large. Its one count exchange carries
each rank's token count (the all-gather's sizes) and its routed pairs per expert (so the
rows of this rank's experts are known on the host without reading the gathered map back).
The asynchronous steps keep both the all-gather and the reduce-scatter in flight. Modes
``dropless`` and ``capacity`` (the router already dropped tokens); the padded mode belongs
to the all-to-all dispatcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from moe_fold import comm
from moe_fold.config import dispatch_modes, require
from moe_fold.dispatch.interface import MODES, Handle, TokenDispatcher, WireBytes
from moe_fold.dispatch.placement import Placement
from moe_fold.kernels.permute import permuted_rows, unpermuted

if TYPE_CHECKING:
    from moe_fold.layout import ProcessGroups

__all__ = ["AllGatherDispatcher", "AllGatherHandle"]


@dataclass
class AllGatherHandle(Handle):
    # Tokens held by each rank of the etp x ep group.
    sizes: Optional[list[int]] = None
    # The gathered token of each row handed to the experts.
    sorted_indices: Optional[torch.Tensor] = None
    # Rows per local expert, on the host (from the count exchange) and on the device.
    tokens_per_local_expert: Optional[list[int]] = None
    device_tokens_per_local_expert: Optional[torch.Tensor] = None


class AllGatherDispatcher(TokenDispatcher):
    """All-gather dispatcher over the etp x ep group; see the module docstring."""

    def __init__(self, num_experts: int, topk: int, groups: "ProcessGroups", *,
                 mode: str = "dropless", permute_backend: str = "torch", placement: Optional[Placement] = None):
        super().__init__(num_experts, topk, groups, permute_backend=permute_backend, placement=placement)
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} must be one of {MODES}")
        # The router drops for mode capacity: the all-gather takes no capacity factor.
        require(dispatch_modes, "allgather", None, mode == "pad", False)
        self.mode = mode

    def dispatch_preprocess(self, tokens, probs, routing_map):
        handle = AllGatherHandle(num_tokens=tokens.shape[0], wire=WireBytes())
        # [1 + ep*S]: this rank's tokens, then its routed pairs per slot (expert by default).
        num_tokens = torch.full((1,), tokens.shape[0], dtype=torch.int64, device=tokens.device)
        g, dev = self._gather_counts(torch.cat([num_tokens, routing_map.sum(dim=0)]), handle.wire, "tokens+slots",
                                     tokens.shape[0])
        handle.sizes = [row[0] for etp_rows in g for row in etp_rows]
        mine = slice(1 + self.local_expert_start, 1 + self.local_expert_start + self.num_local_experts)
        handle.tokens_per_local_expert = [sum(col) for col in zip(*(row[mine] for etp_rows in g for row in etp_rows))]
        handle.device_tokens_per_local_expert = dev[:, :, mine].sum(dim=(0, 1))
        # The map travels with the probs as 0/1 in their dtype: one collective for both.
        meta = torch.cat([probs, routing_map.to(probs.dtype)], dim=1)  # [T, 2 * ep*S] (slots; E by default)
        return handle, tokens, meta

    def dispatch_communicate(self, x, meta, handle):
        group, wire = self.groups.etp_ep, handle.wire
        wire.dispatch += comm.all_gather_bytes(x, group)
        wire.meta += comm.all_gather_bytes(meta, group)
        x = comm.all_gather(x, group, handle.sizes)  # [T, H] -> [sum(T), H]
        meta = comm.all_gather(meta, group, handle.sizes)  # [T, 2E] -> [sum(T), 2E]
        return x, meta

    def dispatch_communicate_start(self, x, meta, handle):
        group, wire = self.groups.etp_ep, handle.wire
        wire.dispatch += comm.all_gather_bytes(x, group)
        wire.meta += comm.all_gather_bytes(meta, group)
        rows = comm.all_gather_start(x, group, handle.sizes)
        meta = comm.all_gather_start(meta, group, handle.sizes)
        return comm.Pending(None, lambda: (rows.wait(), meta.wait()))

    def dispatch_postprocess(self, x, meta, handle):
        e, mine = self.num_slots, slice(self.local_expert_start, self.local_expert_start + self.num_local_experts)
        local_probs = meta[:, :e][:, mine]  # [sum(T), E_local]
        local_map = meta[:, e:][:, mine] > 0.5
        x, probs, handle.sorted_indices = permuted_rows(x, local_map, local_probs, backend=self.permute_backend,
                                                  num_rows=sum(handle.tokens_per_local_expert))  # [sum(T), H] -> [N, H]
        return x, probs, handle.device_tokens_per_local_expert, handle.tokens_per_local_expert

    def combine_preprocess(self, x, handle):
        return unpermuted(x, handle.sorted_indices, sum(handle.sizes),
                         backend=self.permute_backend)  # [N, H] -> [sum(T), H]

    def combine_communicate(self, x, handle):
        handle.wire.combine += comm.reduce_scatter_bytes(x, self.groups.etp_ep, handle.sizes)
        x = comm.reduce_scatter(x, self.groups.etp_ep, handle.sizes)  # -> [T, H]
        return x

    def combine_communicate_start(self, x, handle):
        handle.wire.combine += comm.reduce_scatter_bytes(x, self.groups.etp_ep, handle.sizes)
        back = comm.reduce_scatter_start(x, self.groups.etp_ep, handle.sizes)
        return comm.Pending(None, back.wait)

    def combine_postprocess(self, x, handle):
        return x

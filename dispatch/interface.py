"""The token dispatcher interface: move routed tokens to the ranks that own their experts
and bring the expert outputs back.

A dispatcher is used in two calls per MoE layer and micro-batch::

    out = dispatcher.dispatch(tokens, probs, routing_map)
    # out.tokens[N, H] are grouped by local expert: out.tokens_per_local_expert[i] rows
    # for local expert i, in order; out.probs[N] is the routing weight of each row.
    y = dispatcher.combine(expert_output, out.handle)  # [N, H] -> [T, H]

Everything ``combine`` needs is on ``out.handle``, never on the dispatcher, so two
micro-batches can be in flight at once (pipeline schedules do that).

The experts apply the probs themselves (inside their activation), so ``combine`` only
sums rows: a token's output is the plain sum of the rows that came from it. That is
what lets the rank-deduplicated all-to-all add a token's partial outputs on the
destination rank before sending a single row back.

Each call is split in three steps that keep local work apart from communication, so
communication can later overlap other work:

- dispatch: ``dispatch_preprocess`` (counts, splits, permute to expert-major order)
  -> ``dispatch_communicate`` -> ``dispatch_postprocess`` (sort to local-expert-major);
- combine: ``combine_preprocess`` (the reverse sort) -> ``combine_communicate``
  -> ``combine_postprocess`` (unpermute, scatter-add to tokens).

Asynchronous variant, for overlap (``moe.shared_expert_overlap``, ``moe.overlap_chunks``
in :class:`moe_fold.models.moe_layer.MoELayer`)::

    pending = dispatcher.dispatch_start(tokens, probs, routing_map)  # collectives posted
    ...                                   # work that does not need the dispatched rows
    out = pending.wait()                  # the same DispatchOutput as dispatch()
    pending = dispatcher.combine_start(expert_output, out.handle)
    ...
    y = pending.wait()

Each implementation's ``dispatch_communicate_start`` / ``combine_communicate_start`` post
the all-to-all over ep (or the all-gather dispatcher's collectives over etp x ep) with
:func:`moe_fold.comm.all_to_all_start` and friends and return a
:class:`moe_fold.comm.Pending`. Autograd keeps the overlap in the backward pass: the
backward all-to-all is posted where the forward was waited on and waited where the
forward was posted. The results, the bytes and the order of every collective within a
group are those of the blocking calls.

Wire accounting: every handle carries a :class:`WireBytes` with the bytes this rank
sent in that dispatch and combine: each collective's bytes by the byte rule of
:mod:`moe_fold.comm` (:func:`~moe_fold.comm.all_to_all_bytes` and its siblings), from the
call's own arguments, so nothing is read from the process-wide counter.

Implementations: :class:`~moe_fold.dispatch.alltoall.AllToAllDispatcher` and
:class:`~moe_fold.dispatch.allgather.AllGatherDispatcher`;
:func:`moe_fold.dispatch.dispatcher.build_dispatcher` picks one from the ``moe`` config
section.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from moe_fold import comm
from moe_fold.dispatch.placement import Placement, slot_routing
from moe_fold.dispatch.planned_routing import read_gathered
from moe_fold.kernels.permute import BACKENDS as PERMUTE_BACKENDS

if TYPE_CHECKING:
    from moe_fold.layout import ProcessGroups

__all__ = ["WireBytes", "DispatchOutput", "Handle", "TokenDispatcher", "MODES",
           "expert_major_order"]


@dataclass
class WireBytes:
    """Bytes one rank sent to other ranks during one dispatch and its combine.

    ``dispatch`` and ``combine`` count the token rows (hidden states) over every
    collective of that direction; ``dispatch_etp`` and ``combine_etp`` are the part of
    them sent over the etp group (all-gather after, reduce-scatter before the
    all-to-all). ``meta`` is everything else: the routing probs and maps that travel
    with the rows and the exchange of counts. Backward passes are not included.
    """

    dispatch: int = 0
    combine: int = 0
    dispatch_etp: int = 0
    combine_etp: int = 0
    meta: int = 0

    @property
    def total(self) -> int:
        return self.dispatch + self.combine + self.meta


@dataclass
class DispatchOutput:
    """What the experts receive from :meth:`TokenDispatcher.dispatch`.

    ``tokens[N, H]`` grouped by local expert, ``tokens_per_local_expert`` an int64
    tensor ``[num_local_experts]`` on the tokens' device summing to N (the grouped GEMMs'
    group sizes), ``host_tokens_per_local_expert`` the same as a host list (what the
    dispatcher's one host synchronisation read, for the GEMM backends that need host
    sizes), ``probs[N]`` the routing weight of each row (0 on padding rows), ``handle``
    the state :meth:`TokenDispatcher.combine` needs.
    """

    tokens: torch.Tensor
    tokens_per_local_expert: torch.Tensor
    probs: torch.Tensor
    handle: Any
    host_tokens_per_local_expert: Optional[list[int]] = None


@dataclass
class Handle:
    """State of one dispatch, read by its combine. Subclasses add their own fields."""

    num_tokens: int
    # Passed by the dispatcher (a default factory is a call the compiler cannot trace).
    wire: WireBytes
    # Rows handed to the experts; combine expects as many.
    num_rows: int = 0


def expert_major_order(etp: int, ep: int, num_local_experts: int, inverse: bool = False) -> list[int]:
    """Chunk order (for ``sort_chunks``) between the received and the expert layout.

    Rows arrive (after the all-to-all over ep and the all-gather over etp) in chunks
    ``[etp source][ep source][local expert]``; the experts want ``[local expert][ep
    source][etp source]``, which is also the order of the etp x ep group's ranks (etp
    varies fastest), so every dispatcher hands the experts the same rows in the same
    order. ``inverse=True`` maps the expert layout back (its input chunks are in the
    expert order).
    """
    if inverse:
        return [(le * ep + j) * etp + t
                for t in range(etp) for j in range(ep) for le in range(num_local_experts)]
    return [(t * ep + j) * num_local_experts + le
            for le in range(num_local_experts) for j in range(ep) for t in range(etp)]


class TokenDispatcher(ABC):
    """Base class: input checks, the three-step dispatch and combine, wire accounting.

    ``num_experts`` experts are split evenly over the ep group: ep rank j owns global
    experts ``[j * E_local, (j + 1) * E_local)``; the etp ranks of one ep rank each hold
    a shard of the same experts and receive the same rows. ``topk`` is the number of
    experts per token (used for the capacity of the padded mode).

    ``placement`` (:class:`~moe_fold.dispatch.placement.Placement`, default contiguous)
    puts the experts on other ranks' slots, copies included: :meth:`dispatch` maps the
    routing to slots first, and the implementations then treat the ``ep * S`` slots as
    their experts (``num_local_experts`` is ``S``, the slots of this rank).
    """

    def __init__(self, num_experts: int, topk: int, groups: "ProcessGroups", *,
                 permute_backend: str = "torch", placement: Optional[Placement] = None):
        if num_experts < 1:
            raise ValueError(f"num_experts={num_experts} must be >= 1")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk={topk} must be in [1, num_experts={num_experts}]")
        if permute_backend not in PERMUTE_BACKENDS:
            raise ValueError(f"permute_backend={permute_backend!r} is not one of {PERMUTE_BACKENDS}")
        self.ep = groups.size("ep")
        self.etp = groups.size("etp")
        self.num_experts = num_experts
        self.topk = topk
        self.groups = groups
        self.permute_backend = permute_backend
        self.ep_rank = groups.rank_in("ep")
        self.etp_rank = groups.rank_in("etp")
        # The count exchange reads the etp x ep group as [ep][etp]: check that is its order.
        if groups.rank_in("etp_ep") != self.ep_rank * self.etp + self.etp_rank:
            raise ValueError(f"the etp_ep group does not list ranks etp-fastest (rank "
                             f"{groups.rank_in('etp_ep')} in it, ep rank {self.ep_rank}, etp rank "
                             f"{self.etp_rank}); the layout order must put tp before ep")
        # How the count exchange is read: the gathered counts themselves, or a routing
        # rule's counts (dispatch/planned_routing.py, the dry run's tensors carry no values).
        self.read_counts = read_gathered
        # Placement.contiguous checks that num_experts splits over ep.
        self.set_placement(placement if placement is not None else Placement.contiguous(num_experts, self.ep))

    def set_placement(self, placement: Placement) -> None:
        """Use ``placement`` from the next dispatch on (its ep and experts must be this
        dispatcher's; the number of slots per rank may change only with the experts)."""
        if placement.num_experts != self.num_experts or placement.ep != self.ep:
            raise ValueError(f"placement of {placement.num_experts} experts over ep={placement.ep} does not fit "
                             f"a dispatcher of {self.num_experts} experts over ep={self.ep}")
        self.placement = placement
        self._device_lists: dict[tuple[str, torch.device], torch.Tensor] = {}
        self.num_slots = len(placement.slots)
        self.num_local_experts = placement.slots_per_rank
        self.local_expert_start = self.ep_rank * self.num_local_experts

    # ------------------------------------------------------------------ public calls

    def dispatch(self, tokens: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> DispatchOutput:
        """Send ``tokens[T, H]`` to the experts chosen by ``routing_map[T, E]`` (bool),
        with ``probs[T, E]`` (the weight of each routed pair). Differentiable w.r.t.
        tokens and probs."""
        handle, x, p = self._checked_preprocess(tokens, probs, routing_map)
        x, p = self.dispatch_communicate(x, p, handle)
        return self._output(x, p, handle)

    def combine(self, expert_output: torch.Tensor, handle: Handle) -> torch.Tensor:
        """Return ``[T, H]``: each token's expert output rows summed, on the rank the
        token came from. ``expert_output[N, H]`` is in the order of the dispatched rows."""
        self._check_expert_output(expert_output, handle)
        x = self.combine_preprocess(expert_output, handle)
        x = self.combine_communicate(x, handle)
        return self.combine_postprocess(x, handle)

    def dispatch_start(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> comm.Pending:
        """:meth:`dispatch` that returns once its collectives are posted; ``.wait()``
        returns the :class:`DispatchOutput`. The preprocess (with its count exchange) runs
        before this returns, the postprocess inside ``wait``."""
        handle, x, p = self._checked_preprocess(tokens, probs, routing_map)
        sent = self.dispatch_communicate_start(x, p, handle)
        return comm.Pending(None, lambda: self._output(*sent.wait(), handle))

    def combine_start(self, expert_output: torch.Tensor, handle: Handle) -> comm.Pending:
        """:meth:`combine` that returns once its collectives are posted; ``.wait()``
        returns ``[T, H]``."""
        self._check_expert_output(expert_output, handle)
        sent = self.combine_communicate_start(self.combine_preprocess(expert_output, handle), handle)
        return comm.Pending(None, lambda: self.combine_postprocess(sent.wait(), handle))

    # ------------------------------------------------------------------ steps

    @abstractmethod
    def dispatch_preprocess(self, tokens, probs, routing_map) -> tuple[Handle, torch.Tensor, torch.Tensor]:
        """Local work before communication; returns the handle and what to send.
        ``probs`` and ``routing_map`` are over the ``num_slots`` slots (the experts
        themselves under the default placement)."""

    @abstractmethod
    def dispatch_communicate(self, x, probs, handle) -> tuple[torch.Tensor, torch.Tensor]:
        """The collectives of the dispatch; records their bytes on ``handle.wire``."""

    @abstractmethod
    def dispatch_communicate_start(self, x, probs, handle) -> comm.Pending:
        """:meth:`dispatch_communicate`, posted without waiting: ``.wait()`` returns
        ``(x, probs)``. Same results, bytes and per-group order of collectives."""

    @abstractmethod
    def dispatch_postprocess(self, x, probs, handle) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """Local work after communication: rows, probs and counts for the experts (an
        int64 tensor on the rows' device, and the same as a host list)."""

    @abstractmethod
    def combine_preprocess(self, x, handle) -> torch.Tensor:
        """Local work before the combine's communication."""

    @abstractmethod
    def combine_communicate(self, x, handle) -> torch.Tensor:
        """The collectives of the combine; records their bytes on ``handle.wire``."""

    @abstractmethod
    def combine_communicate_start(self, x, handle) -> comm.Pending:
        """:meth:`combine_communicate`, posted without waiting: ``.wait()`` returns ``x``."""

    @abstractmethod
    def combine_postprocess(self, x, handle) -> torch.Tensor:
        """Local work after communication: rows back to ``[T, H]``."""

    # ------------------------------------------------------------------ helpers

    def _check_inputs(self, tokens, probs, routing_map) -> None:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [T, H], got shape {tuple(tokens.shape)}")
        shape = (tokens.shape[0], self.num_experts)
        if routing_map.dtype != torch.bool or tuple(routing_map.shape) != shape:
            raise ValueError(f"routing_map must be a bool tensor of shape {shape} [tokens, num_experts], "
                             f"got {routing_map.dtype} {tuple(routing_map.shape)}")
        if tuple(probs.shape) != shape or not probs.is_floating_point():
            raise ValueError(f"probs must be a float tensor of shape {shape} [tokens, num_experts], "
                             f"got {probs.dtype} {tuple(probs.shape)}")

    def _checked_preprocess(self, tokens, probs, routing_map) -> tuple[Handle, torch.Tensor, torch.Tensor]:
        """What :meth:`dispatch` and :meth:`dispatch_start` do before communicating."""
        self._check_inputs(tokens, probs, routing_map)
        if not self.placement.is_default:
            routing_map, probs = slot_routing(self.placement, routing_map, probs)  # [T, E] -> [T, ep*S]
        return self.dispatch_preprocess(tokens, probs, routing_map)

    def _output(self, x, p, handle) -> DispatchOutput:
        """What :meth:`dispatch` and :meth:`dispatch_start` do after communicating."""
        x, p, counts, host_counts = self.dispatch_postprocess(x, p, handle)
        handle.num_rows = x.shape[0]
        return DispatchOutput(tokens=x, tokens_per_local_expert=counts, probs=p, handle=handle,
                              host_tokens_per_local_expert=host_counts)

    @staticmethod
    def _check_expert_output(expert_output: torch.Tensor, handle: Handle) -> None:
        if expert_output.dim() != 2 or expert_output.shape[0] != handle.num_rows:
            raise ValueError(f"expert_output must be [N={handle.num_rows}, H] (one row per dispatched row), "
                             f"got shape {tuple(expert_output.shape)}")

    def _gather_counts(self, counts: torch.Tensor, wire: WireBytes, columns: str, num_tokens: int,
                       capacity: Optional[int] = None) -> tuple[list[list[list[int]]], torch.Tensor]:
        """All-gather ``counts[C]`` (int64, on the tokens' device) over the etp x ep group;
        returns them as a host list ``[ep][etp][C]`` and as the device tensor ``[ep, etp, C]``.
        The list is the dispatcher's one host synchronisation (through :attr:`read_counts`;
        ``columns`` says what the C columns hold, ``num_tokens`` and ``capacity`` this
        rank's tokens and the slots' capacity); sizes that kernels need on the device are
        taken from the tensor, never copied back from the list."""
        row = counts.unsqueeze(0)  # [1, C]
        wire.meta += comm.all_gather_bytes(row, self.groups.etp_ep)
        gathered = comm.all_gather(row, self.groups.etp_ep)  # [1, C] -> [etp*ep, C]
        flat = self.read_counts(gathered, columns, num_tokens, self.topk, self.ep, capacity)
        host = [[flat[j * self.etp + t] for t in range(self.etp)] for j in range(self.ep)]
        return host, gathered.view(self.ep, self.etp, -1)

    def _on_device(self, name: str, device: torch.device) -> torch.Tensor:
        """The int list ``self.<name>`` (a chunk order) as an int64 tensor on ``device``,
        copied once per placement: a list copied to a GPU at every call would block the host."""
        key = (name, device)
        if key not in self._device_lists:
            self._device_lists[key] = torch.tensor(getattr(self, name), dtype=torch.int64, device=device)
        return self._device_lists[key]


MODES = ("dropless", "capacity", "pad")

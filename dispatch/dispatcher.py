"""Choosing a token dispatcher from the ``moe`` config section: :func:`build_dispatcher`.

The interface every dispatcher implements (``dispatch`` / ``combine`` and their
preprocess, communicate and postprocess steps, the handle, the wire byte counts) is in
:mod:`moe_fold.dispatch.interface`; the implementations are
:mod:`moe_fold.dispatch.alltoall` and :mod:`moe_fold.dispatch.allgather`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from moe_fold.config import choice, dispatch_modes, require
from moe_fold.dispatch.allgather import AllGatherDispatcher
from moe_fold.dispatch.alltoall import AllToAllDispatcher
from moe_fold.dispatch.interface import TokenDispatcher

if TYPE_CHECKING:
    from moe_fold.config import MoEConfig
    from moe_fold.layout import ProcessGroups

__all__ = ["dispatch_mode", "build_dispatcher"]


def dispatch_mode(moe: "MoEConfig") -> str:
    """``dropless``, ``capacity`` (the router drops, no padding) or ``pad`` (drop and pad
    every expert to its capacity) from ``moe.capacity_factor`` and ``moe.pad_to_capacity``."""
    if moe.pad_to_capacity:
        require(dispatch_modes, moe.dispatcher, moe.capacity_factor, moe.pad_to_capacity, moe.dedup)
        return "pad"
    return "dropless" if moe.capacity_factor is None else "capacity"


def build_dispatcher(moe: "MoEConfig", groups: "ProcessGroups") -> TokenDispatcher:
    """The dispatcher the ``moe`` config section asks for (``moe.dispatcher``,
    ``capacity_factor``, ``pad_to_capacity``, ``dedup``, ``permute_backend``)."""
    require(choice, "moe.dispatcher", moe.dispatcher)
    require(dispatch_modes, moe.dispatcher, moe.capacity_factor, moe.pad_to_capacity, moe.dedup)
    mode = dispatch_mode(moe)
    # A token sends at most this many rows: its slots on zero experts stay where it is.
    rows_per_token = min(moe.topk, moe.num_experts)
    if moe.dispatcher == "alltoall":
        return AllToAllDispatcher(moe.num_experts, rows_per_token, groups, mode=mode,
                                  capacity_factor=moe.capacity_factor, dedup=moe.dedup,
                                  permute_backend=moe.permute_backend)
    return AllGatherDispatcher(moe.num_experts, rows_per_token, groups, mode=mode,
                               permute_backend=moe.permute_backend)

"""Online expert re-placement: experts move to where the load is (docs/placement.md).

Every ``moe.replace_every`` steps, :class:`ExpertReplacer` takes each MoE layer's expert
load summed over the steps since the last re-placement (``RoutingCollector.expert_load``,
the same on every rank), computes a placement that keeps the busiest ep rank's tokens low
(:func:`moe_fold.dispatch.placement.balanced_placement`, with ``moe.replicas`` spare slots
per rank for copies of the hottest experts) and, when it lowers the busiest rank's load
of the window by at least :data:`MIN_GAIN`, moves the layer there with
:func:`move_experts`.

A move is a permutation of expert slots over the ep group, done with one all-to-all per
dtype: every rank sends the slots another rank needs and does not hold yet (copying
locally what it keeps), for the weights, the gradient accumulators when there are any,
and AdamW's moments. Under ZeRO-1 (``optimizer.distributed``) a rank holds a flat range
of the moments, not whole slots: the moments of the experts are first summed over edp
into whole tensors (the ranges are disjoint), moved, and each rank keeps its range again.
Weights and moments are copied, never recomputed, so the math is unchanged: a run that
re-places gives the same losses as one that does not (bit for bit without copies;
copies change the grouped GEMMs' row counts and so the last bits).

The state (each layer's placement and the load window) goes into checkpoints; a resumed
run moves back to the saved placement, so resuming across a move is exact.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from moe_fold import comm
from moe_fold.comm import all_reduce_
from moe_fold.config import Config
from moe_fold.dispatch.placement import Placement, balanced_placement, rank_loads
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import layer_index
from moe_fold.models.moe_layer import MoELayer
from moe_fold.training.optim import AdamW

__all__ = ["MIN_GAIN", "moe_layers", "move_experts", "ExpertReplacer"]

# A new placement is taken only when it lowers the window's busiest-rank load by this
# fraction: a move costs an all-to-all of the experts' weights and moments.
MIN_GAIN = 0.02


def moe_layers(model: nn.Module) -> dict[int, MoELayer]:
    """This rank's MoE layers by global layer index."""
    # The MTP depths' MoE blocks are layers num_layers + k, as in the routing metrics.
    return {layer_index(n, model.config.model.num_layers): m for n, m in model.named_modules()
            if isinstance(m, MoELayer)}


def _plan(old: Placement, new: Placement, ep_rank: int) -> tuple[list[list[int]], list[list[int]], list]:
    """What this rank sends and receives: ``sends[d]`` (old local slots, for rank d's new
    slots in order), ``recvs[r]`` (new local slots filled from rank r, in order), and
    ``local``: ``(new slot, old slot)`` kept on this rank. Every rank computes every rank's
    plan the same way, so the orders match."""
    s = new.slots_per_rank
    sends: list[list[int]] = [[] for _ in range(new.ep)]
    recvs: list[list[int]] = [[] for _ in range(new.ep)]
    local = []
    for d in range(new.ep):
        held = old.rank_slots(d)
        for i, expert in enumerate(new.rank_slots(d)):
            if expert in held:
                if d == ep_rank:
                    local.append((i, held.index(expert)))
                continue
            src_slot = old.copies(expert)[0]
            src = src_slot // s
            if src == ep_rank:
                sends[d].append(src_slot % s)
            if d == ep_rank:
                recvs[src].append(i)
    return sends, recvs, local


@torch.no_grad()
def _move_rows(tensors: list[torch.Tensor], old: Placement, new: Placement, groups: ProcessGroups) -> int:
    """Move slots (dim 0 of each ``[S, ...]`` tensor) from ``old`` to ``new`` in place;
    returns the bytes this rank sent."""
    sends, recvs, local = _plan(old, new, groups.rank_in("ep"))
    sent = 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        rows = torch.cat([t.reshape(t.shape[0], -1) for t in same], dim=1)  # [S, sum of slot numels]
        out = rows.clone()
        for i, j in local:
            out[i] = rows[j]
        send_rows = rows[[j for d in sends for j in d]]  # [sent slots, ...], destination-major
        splits = [len(d) for d in sends]
        sent += comm.all_to_all_bytes(send_rows, splits, groups.ep)
        got = comm.all_to_all(send_rows, [len(r) for r in recvs], splits, groups.ep)
        out[[i for r in recvs for i in r]] = got
        offset = 0
        for t in same:
            n = t[0].numel() if t.shape[0] else 0
            t.copy_(out[:, offset:offset + n].reshape(t.shape))
            offset += n
    return sent


@torch.no_grad()
def move_experts(layers: list[MoELayer], placement: Placement, groups: ProcessGroups,
                 optimizer: Optional[AdamW] = None) -> dict:
    """Move one MoE layer to ``placement``: ``layers`` are its instances whose weights must
    follow (the model, and under bf16 also the float32 masters the ``optimizer`` updates).
    Weights, gradient accumulators and the optimizer's moments of the experts move; every
    instance then routes by the new placement. A collective over the ep group.

    Returns ``{"moved": [[expert, from ep rank, to ep rank], ...], "bytes": n}``: the slots
    that changed rank and the bytes this rank sent."""
    old = layers[0].placement
    tensors, moments = [], []
    for layer in layers:
        for p in layer.experts.expert_params():
            tensors.append(p.data)
            if p.grad is not None:
                tensors.append(p.grad)
            if optimizer is not None and p in optimizer.state:
                start, stop = optimizer.state_slice(p)
                for key in ("exp_avg", "exp_avg_sq"):
                    state = optimizer.state[p][key]
                    if optimizer.distributed:
                        whole = state.new_zeros(p.numel())
                        whole[start:stop] = state
                        all_reduce_(whole, groups.edp)  # the edp ranks' ranges are disjoint
                        moments.append((state, whole.view(p.shape), start, stop))
                        tensors.append(whole.view(p.shape))
                    else:
                        tensors.append(state)
    sent = _move_rows(tensors, old, placement, groups)
    for state, whole, start, stop in moments:
        state.copy_(whole.reshape(-1)[start:stop])
    for layer in layers:
        layer.set_placement(placement)
    s = placement.slots_per_rank
    moved = [[e, old.copies(e)[0] // s, d] for d in range(placement.ep) for e in placement.rank_slots(d)
             if e not in old.rank_slots(d)]
    return {"moved": moved, "bytes": sent}


class ExpertReplacer:
    """Re-places the MoE layers of a run every ``moe.replace_every`` steps; see the module doc.

    ``models``: the instances whose experts move together (the model, and the float32
    masters under bf16; the optimizer's parameters are among them). ``moe_layer_ids``: the
    global layer index of each row of the load matrix (``RoutingCollector.moe_layers``).
    """

    def __init__(self, config: Config, models: list[nn.Module], groups: ProcessGroups,
                 optimizer: Optional[AdamW], moe_layer_ids: list[int]):
        self.every = config.moe.replace_every
        self.replicas = config.moe.replicas
        self.groups, self.optimizer = groups, optimizer
        per_model = [moe_layers(m) for m in models]
        self.layers = {i: [layers[i] for layers in per_model] for i in per_model[0]}
        self.rows = {layer: row for row, layer in enumerate(moe_layer_ids)}
        # Collectives carry tensors on the compute device (NCCL reduces only GPU tensors).
        self.device = next(models[0].parameters()).device
        # The load window is host bookkeeping: the placement policy reads it as Python lists.
        self.window = torch.zeros(len(moe_layer_ids), config.moe.num_experts, dtype=torch.float64, device="cpu")

    def after_step(self, step: int, expert_load: list[list[int]]) -> dict:
        """Add the step's load to the window; on a re-placement step, re-place and return
        the record fields (``replace_moves``, ``replace_bytes``, ``replace_seconds`` and
        ``placement`` per layer); ``{}`` otherwise. Every rank calls it."""
        if expert_load:
            self.window += torch.tensor(expert_load, dtype=torch.float64, device="cpu")
        if self.every == 0 or step % self.every:
            return {}
        begin = time.perf_counter()
        layers, sent = {}, 0
        for index, instances in sorted(self.layers.items()):
            load = self.window[self.rows[index]].tolist()
            old = instances[0].placement
            new = balanced_placement(load, old.ep, self.replicas, previous=old)
            before, after = max(rank_loads(old, load)), max(rank_loads(new, load))
            mean = sum(load) / old.ep
            if after > before * (1 - MIN_GAIN) or mean == 0:
                continue
            done = move_experts(instances, new, self.groups, self.optimizer)
            sent += done["bytes"]
            layers[f"layer{index}"] = {"moved": done["moved"], "busiest_over_mean_before": before / mean,
                                       "busiest_over_mean_after": after / mean, "slots": new.to_list()}
        self.window.zero_()
        # Every rank's bytes and the layers of every pipeline stage.
        total = torch.full((1,), float(sent), dtype=torch.float64, device=self.device)
        all_reduce_(total, self.groups.tp_dp_cp)
        all_reduce_(total, self.groups.pp)
        if self.groups.size("pp") > 1:
            parts: list = [None] * self.groups.size("pp")
            dist.all_gather_object(parts, layers, group=self.groups.pp)
            layers = {k: v for part in parts for k, v in part.items()}
        return {"replace_moves": sum(len(v["moved"]) for v in layers.values()), "replace_bytes": int(total.item()),
                "replace_seconds": time.perf_counter() - begin, "placement": layers}

    def state_dict(self) -> dict:
        """This stage's placements and the load window, for the checkpoint's ``extra``."""
        placements = {str(i): layers[0].placement.to_list() for i, layers in self.layers.items()}
        if self.groups.size("pp") > 1:
            parts: list = [None] * self.groups.size("pp")
            dist.all_gather_object(parts, placements, group=self.groups.pp)
            placements = {k: v for part in parts for k, v in part.items()}
        return {"placements": placements, "window": self.window.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Move every layer to its saved placement (the weights were loaded by global
        expert, in the placement the model was built with) and restore the window."""
        for index, instances in sorted(self.layers.items()):
            slots = state["placements"].get(str(index))
            old = instances[0].placement
            if slots is None or list(old.slots) == list(slots):
                continue
            if len(slots) != len(old.slots):
                continue  # saved with another ep or moe.replicas: the built placement stays
            new = Placement(old.num_experts, old.ep, tuple(slots))
            move_experts(instances, new, self.groups, self.optimizer)
        window = torch.tensor(state["window"], dtype=torch.float64, device="cpu")
        if window.shape == self.window.shape:
            self.window = window

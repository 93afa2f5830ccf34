"""The step's objective beyond the LM loss: what the routers' auxiliary losses and the
multi-token prediction depths add, as their coefficients weigh them.

These losses ride on autograd (``attach_loss``): their gradients reach the weights, their
values do not reach the loss a forward returns. :class:`StepLosses` reads the values
where they are made (a forward hook on every :class:`~moe_fold.dispatch.router.Router`,
whose output carries its detached loss values, and one on the model's
:class:`~moe_fold.models.mtp.MTP`), adds them up over a step's micro-batches and reduces
them over the ranks once per step. The training step owns it
(:func:`moe_fold.training.train.run_step`): the step's ``loss`` is ``lm_loss`` plus
:attr:`StepLossValues.weighted`, whatever metrics are collected.

- per MoE layer (in layer order), each enabled kind (``aux``, ``seq_aux``, ``z``, without
  coefficients): the mean over micro-batches and dp ranks; ``global_aux``: the step's exact
  value, which :meth:`Router.finish_step` returns when the step closes the routers;
- per MTP depth: its mean cross-entropy over the global batch;
- per DSA layer with an indexer (:class:`~moe_fold.models.dsa.IndexerKL`, a forward hook):
  the indexer's KL loss, mean over micro-batches and dp x cp ranks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

from moe_fold.comm import all_reduce_
from moe_fold.config import Config, moe_layer_indices
from moe_fold.dispatch.router import Router
from moe_fold.layout import ProcessGroups
from moe_fold.models.dsa import IndexerKL
from moe_fold.models.model import layer_index

__all__ = ["StepLosses", "StepLossValues", "COEFF", "router_rows", "indexer_loss_layers"]

BALANCING = ("aux", "seq_aux", "global_aux")
KINDS = ("aux", "seq_aux", "z")  # per micro-batch values; global_aux comes from Router.finish_step
COEFF = {"aux": "aux_loss_coeff", "seq_aux": "seq_aux_loss_coeff", "global_aux": "global_aux_loss_coeff",
         "z": "z_loss_coeff"}


@dataclass
class StepLossValues:
    """One step's auxiliary loss values, the same on every rank."""
    per_layer: dict[str, torch.Tensor]  # enabled kind -> [MoE layers] float64, without coefficients
    mtp: Optional[list[float]]  # each MTP depth's mean loss (None without MTP)
    weighted: float  # what they add to the step's loss: coefficients x values, summed over layers and depths
    indexer: Optional[float] = None  # the DSA indexers' KL loss, mean over their layers (None without)

    def fields(self) -> dict:
        """The step's row fields: ``aux_loss`` (the enabled balancing losses summed per
        layer, mean over layers), ``z_loss`` (mean over layers), ``mtp_loss`` (per depth);
        None for a loss that is off."""
        balancing = [v for k, v in self.per_layer.items() if k in BALANCING]
        return {"aux_loss": float(sum(balancing).mean()) if balancing else None,
                "z_loss": float(self.per_layer["z"].mean()) if "z" in self.per_layer else None,
                "mtp_loss": self.mtp, "indexer_loss": self.indexer}


def router_rows(model: nn.Module, config: Config) -> list[tuple[int, Router]]:
    """Each router of ``model`` with its row: the place of its layer among all the MoE
    layers of ``config`` (those on other pipeline stages included)."""
    slot = {layer: k for k, layer in enumerate(moe_layer_indices(config))}
    L = config.model.num_layers
    return [(slot[layer_index(n, L)], m) for n, m in model.named_modules() if isinstance(m, Router)]


def indexer_loss_layers(config: Config) -> list[int]:
    """The layers (MTP depths at ``num_layers + k``) whose DSA indexer is trained by its KL
    loss: every full layer when ``model.dsa`` is on and its loss weight is above 0."""
    m = config.model
    if not m.dsa or m.dsa_indexer_loss_weight <= 0:
        return []
    types = m.indexer_types
    return [i for i in range(m.num_layers + m.mtp_num_layers)
            if types is None or i >= m.num_layers or types[i] == "full"]


class StepLosses:
    """The routers' and MTP's loss values of one step (see the module docstring).

    Rows are indexed by the model's MoE layers in order (all of them, also those on other
    pipeline stages: a stage fills its own rows and the reduction over pp fills the rest)."""

    def __init__(self, model: nn.Module, config: Config):
        self.config = config
        self.moe_layers = moe_layer_indices(config)
        self.routers = router_rows(model, config)
        self.device = next(model.parameters()).device
        moe = config.moe
        # Which losses the routers compute: each kind is on when its coefficient is > 0.
        self.kinds = [k for k in KINDS if getattr(moe, COEFF[k]) > 0]
        self.depths, self.mtp_weight = config.model.mtp_num_layers, config.model.mtp_loss_weight
        self._recording = False
        self._hooks = [m.register_forward_hook(self._router_hook(row)) for row, m in self.routers]
        mtp = getattr(model, "mtp", None)
        if mtp is not None:
            self._hooks.append(mtp.register_forward_hook(self._mtp_hook))
        # DSA: a row per layer whose indexer is trained (those on other stages included).
        self.kl_layers = indexer_loss_layers(config)
        self.kl_weight = config.model.dsa_indexer_loss_weight
        kl_row = {layer: k for k, layer in enumerate(self.kl_layers)}
        L = config.model.num_layers
        self._hooks += [m.register_forward_hook(self._kl_hook(kl_row[layer_index(n, L)]))
                        for n, m in model.named_modules() if isinstance(m, IndexerKL) and layer_index(n, L) in kl_row]
        self.start_step()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Count the forwards run inside (the training step's, not a recompute's second call)."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def start_step(self) -> None:
        # On the model's device: the hooks add without a host sync per layer.
        zeros = dict(dtype=torch.float64, device=self.device)
        self._sums = torch.zeros(len(self.moe_layers), len(KINDS), **zeros)
        self._calls = torch.zeros(len(self.moe_layers), **zeros)
        self._mtp_sums = torch.zeros(self.depths, **zeros)
        self._kl_sums = torch.zeros(len(self.kl_layers), **zeros)
        self._kl_calls = torch.zeros(len(self.kl_layers), **zeros)

    def _router_hook(self, row: int):
        def hook(module, args, output):
            if not self._recording:
                return
            self._calls[row] += 1
            for k, kind in enumerate(KINDS):
                if kind in output.losses:
                    self._sums[row, k] += output.losses[kind].detach().double()
        return hook

    def _kl_hook(self, row: int):
        def hook(module, args, output):
            if self._recording:
                self._kl_calls[row] += 1
                self._kl_sums[row] += output.detach().double()
        return hook

    def _mtp_hook(self, module, args, output) -> None:
        # [D] depth losses of one micro-batch, each scaled so that the sum over the step's
        # micro-batches, averaged over dp x cp, is the depth's global-batch mean.
        if self._recording:
            self._mtp_sums += output.detach().double()

    def reduce(self, groups: ProcessGroups, global_aux: dict[Router, torch.Tensor]) -> torch.Tensor:
        """This step's values reduced over the ranks, packed on the device and not read:
        ``[L * len(KINDS) + L + D]`` float64, the same on every rank (:meth:`values` reads
        them once they are on the host; the step copies them there with its other scalars,
        in one read). ``global_aux``: each router's exact value of the step (what
        :meth:`Router.finish_step` returned; empty when that loss is off). A collective:
        every rank calls it once per step."""
        L = len(self.moe_layers)
        parts = []
        if L:
            # Values that are the same on every rank of tp x dp x cp enter divided by its
            # size, so that one sum over it (and over pp, which holds other layers) gives
            # them back; a loss value is already over tp x cp, so its mean over dp is its
            # sum over tp x dp x cp times ``same``.
            same = 1.0 / groups.size("tp_dp_cp")
            exact = torch.zeros(L, dtype=torch.float64, device=self.device)
            for row, router in self.routers:
                if router in global_aux:
                    exact[row] = global_aux[router].double() * same
            means = self._sums / self._calls.clamp(min=1).unsqueeze(1) * same
            packed = torch.cat([means.flatten(), exact])
            all_reduce_(packed, groups.tp_dp_cp)
            parts.append(all_reduce_(packed, groups.pp))
        if self.depths:
            sums = self._mtp_sums.clone()
            all_reduce_(sums, groups.dp_cp)
            all_reduce_(sums, groups.pp)  # only the last stage holds the depths
            parts.append(sums / groups.size("dp_cp"))
        if self.kl_layers:
            # A layer's KL is the same on its tp ranks, and on a cp rank its share of the
            # micro-batch's mean over real queries (models/dsa.py): its mean over tp x cp is the
            # micro-batch's whatever each cp rank holds (dynamic cp), and over dp the mean of
            # the dp ranks' micro-batches, as one process's micro-batches average.
            means = self._kl_sums / self._kl_calls.clamp(min=1) / groups.size("tp_dp_cp")
            all_reduce_(means, groups.tp_dp_cp)
            parts.append(all_reduce_(means, groups.pp))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=self.device)

    def values(self, packed: torch.Tensor) -> StepLossValues:
        """The step's loss values from :meth:`reduce`'s tensor, copied to the host."""
        moe, L = self.config.moe, len(self.moe_layers)
        means, exact, depths, kl = packed.split([L * len(KINDS), L, self.depths, len(self.kl_layers)])
        means = means.view(L, len(KINDS))
        per_layer: dict[str, torch.Tensor] = {kind: means[:, KINDS.index(kind)] for kind in self.kinds} if L else {}
        if L and moe.global_aux_loss_coeff > 0:
            per_layer["global_aux"] = exact
        weighted = sum(float(getattr(moe, COEFF[k])) * float(v.sum()) for k, v in per_layer.items())
        mtp = None
        if self.depths:
            mtp = depths.tolist()
            weighted += self.mtp_weight * sum(mtp) / self.depths
        indexer = None
        if self.kl_layers:
            indexer = float(kl.mean())
            weighted += self.kl_weight * float(kl.sum())
        return StepLossValues(per_layer, mtp, weighted, indexer)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

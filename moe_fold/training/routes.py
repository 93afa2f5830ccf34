"""Route traces and router replay in the training loop (docs/routes.md).

Both key every token by its place in the data: the global sample number the loader
gave its row (``Batch.sample_ids``) and its index in the sample's sequence. A MoE layer
sees this rank's tokens as ``[S_local, B]`` flattened (``models/model.py``, ``Block``):
``S_local`` is this cp rank's zigzag share of the sequence, cut again over tp under
sequence parallel, so :func:`token_keys` rebuilds both keys in that order from the
layout alone.

- :class:`RouteRecorder`: forward hooks on the main stack's routers collect each
  micro-batch's route (experts before capacity, their probabilities, dropped or not);
  after the step the rank writes one safetensors shard under
  ``run_dir/routes/step_N/`` (:mod:`moe_fold.routes` reads them back).
- :class:`RouteReplayer`: before the step, each router gets its micro-batches' replayed
  experts ``[T_local, topk]`` in a queue, in micro-batch order (the order its forwards
  run under every schedule); a forward pre-hook hands the next one to
  :meth:`Router.forward <moe_fold.dispatch.router.Router.forward>` as ``forced``.

Both act only inside a training step; evaluation forwards route by the router. The MTP
depths' MoE blocks are neither traced nor replayed.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from moe_fold.config import Config
from moe_fold.data.loader import Batch
from moe_fold.dispatch.router import Router
from moe_fold.layout import ProcessGroups
from moe_fold.models.moe_layer import MoELayer
from moe_fold.parallel.context_parallel import zigzag_positions
from moe_fold.routes import RouteSignature, expert_dtype, load_replay, step_dir

__all__ = ["local_positions", "token_keys", "route_signature", "main_routers", "RouteRecorder", "RouteReplayer", "RouteActions"]


def local_positions(groups: ProcessGroups, config: Config) -> torch.Tensor:
    """``[S_local]`` int64: the sequence positions of this rank's share of every row, in
    the order its MoE layers see them."""
    S, cp, tp = config.model.seq_length, groups.size("cp"), groups.size("tp")
    positions = zigzag_positions(S, groups.rank_in("cp"), cp)  # [S/cp]
    if config.parallel.sequence_parallel and tp > 1:
        positions = positions.chunk(tp)[groups.rank_in("tp")]  # [S/cp/tp]
    return positions


def token_keys(batch: Batch, groups: ProcessGroups, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sample [T_local], position [T_local])`` int64 of this rank's tokens of ``batch``
    in the order its MoE layers see them."""
    if batch.sample_ids is None:
        raise ValueError("route traces and router replay need the loader's sample ids (Batch.sample_ids)")
    positions = local_positions(groups, config)
    B = batch.sample_ids.shape[0]
    # [S_local, B] flattened, sequence first
    return batch.sample_ids.repeat(positions.shape[0]), positions.repeat_interleave(B)


def route_signature(config: Config, moe_layers: Sequence[int]) -> RouteSignature:
    return RouteSignature(config.moe.num_experts, config.moe.topk, tuple(moe_layers), config.model.seq_length,
                          config.model.hidden_size)


def main_routers(model: nn.Module) -> dict[int, Router]:
    """This rank's routers of the main stack by global layer index (no MTP depths)."""
    return {int(name): block.mlp.router for name, block in model.layers.named_children()
            if isinstance(block.mlp, MoELayer)}


class RouteRecorder:
    """Writes a route trace every ``train.route_trace_every`` steps (module docstring)."""

    def __init__(self, model: nn.Module, config: Config, groups: ProcessGroups, run_dir: Path,
                 moe_layers: Sequence[int]):
        self.config, self.groups, self.run_dir = config, groups, Path(run_dir)
        self.every = config.train.route_trace_every
        self.signature = route_signature(config, moe_layers)
        self.routers = main_routers(model)
        self._routes: dict[int, list] = {i: [] for i in self.routers}
        self._keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._on = False
        self._hooks = [r.register_forward_hook(self._hook(i)) for i, r in self.routers.items()]

    def _hook(self, layer: int):
        k = self.config.moe.topk

        def hook(module, args, output):
            if not self._on:
                return
            with torch.no_grad():
                # The k chosen experts of each token, ascending: [T, E] -> [T, k]
                experts = torch.topk(output.routed_map.to(torch.float32), k, dim=1).indices.sort(dim=1).values
                probs = output.routed_probs.gather(1, experts).to(torch.bfloat16)
                dropped = ~output.routing_map.gather(1, experts)
            self._routes[layer].append((experts, probs, dropped))
        return hook

    def start_step(self, step: int, microbatches: Sequence[Batch]) -> None:
        self._on = step % self.every == 0
        if self._on:
            self._keys = [token_keys(b, self.groups, self.config) for b in microbatches]

    def finish_step(self, step: int) -> None:
        """Write this rank's shard of ``step``'s trace (when the step was traced)."""
        if not self._on:
            return
        from safetensors.torch import save_file

        self._on = False
        tensors = {"sample": torch.cat([s for s, _ in self._keys]),
                   "position": torch.cat([p for _, p in self._keys]).to(torch.int32)}
        dtype = expert_dtype(self.config.moe.num_experts)
        for layer, parts in self._routes.items():
            if len(parts) != len(self._keys):
                raise RuntimeError(f"route trace of step {step}: layer {layer} routed {len(parts)} micro-batches, "
                                   f"the step has {len(self._keys)}")
            experts, probs, dropped = (torch.cat(x).cpu() for x in zip(*parts))
            tensors[f"layer.{layer}.experts"] = experts.to(dtype)
            tensors[f"layer.{layer}.probs"] = probs
            tensors[f"layer.{layer}.dropped"] = dropped
            parts.clear()
        folder = step_dir(self.run_dir, step)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".rank_{self.groups.rank:05d}.tmp"
        save_file(tensors, str(tmp), metadata=self.signature.metadata())
        tmp.rename(folder / f"rank_{self.groups.rank:05d}.safetensors")


class RouteReplayer:
    """Forces every router of the main stack to ``moe.router_replay``'s experts during
    training steps (module docstring)."""

    def __init__(self, model: nn.Module, config: Config, groups: ProcessGroups, moe_layers: Sequence[int]):
        self.config, self.groups = config, groups
        self.routes = load_replay(config.moe.router_replay, route_signature(config, moe_layers))
        self.column = {layer: j for j, layer in enumerate(moe_layers)}
        self.routers = main_routers(model)
        self.device = next(model.parameters()).device
        self._queues: dict[int, deque] = {i: deque() for i in self.routers}
        self._hooks = [r.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, r in self.routers.items()]

    def _hook(self, layer: int):
        def hook(module, args, kwargs):
            queue = self._queues[layer]
            if queue:
                return args, {**kwargs, "forced": queue.popleft()}
            return None
        return hook

    def start_step(self, step: int, microbatches: Sequence[Batch]) -> None:
        positions = local_positions(self.groups, self.config)  # [S_local]
        for b in microbatches:
            if b.sample_ids is None:
                raise ValueError("router replay needs the loader's sample ids (Batch.sample_ids)")
            recorded = torch.stack([self.routes.of(s, step) for s in b.sample_ids.tolist()])  # [B, S, L, k]
            # [B, S_local, L, k] -> [S_local, B, L, k] -> [T_local, L, k], the MoE layers' order
            forced = recorded[:, positions].transpose(0, 1).flatten(0, 1)
            for layer, queue in self._queues.items():
                queue.append(forced[:, self.column[layer]].to(self.device, non_blocking=True))

    def finish_step(self, step: int) -> None:
        left = {layer: len(q) for layer, q in self._queues.items() if q}
        if left:
            for q in self._queues.values():
                q.clear()
            raise RuntimeError(f"router replay at step {step}: layers {sorted(left)} did not route every "
                               f"micro-batch of the step ({left} left)")


class RouteActions:
    """The step's route recorder and replayer, each present when configured."""

    def __init__(self, recorder: Optional[RouteRecorder], replayer: Optional[RouteReplayer]):
        self.recorder, self.replayer = recorder, replayer

    @classmethod
    def build(cls, model: nn.Module, config: Config, groups: ProcessGroups, run_dir: Path,
              moe_layers: Sequence[int]) -> "RouteActions":
        main = [i for i in moe_layers if i < config.model.num_layers]
        recorder = (RouteRecorder(model, config, groups, run_dir, main)
                    if config.train.route_trace_every > 0 and main else None)
        replayer = RouteReplayer(model, config, groups, main) if config.moe.router_replay is not None else None
        return cls(recorder, replayer)

    def start_step(self, step: int, microbatches: Sequence[Batch]) -> None:
        for action in (self.replayer, self.recorder):
            if action is not None:
                action.start_step(step, microbatches)

    def finish_step(self, step: int) -> None:
        for action in (self.replayer, self.recorder):
            if action is not None:
                action.finish_step(step)

"""Routes from transformers, for router replay (docs/routes.md): run a Hugging Face MoE
model's forward with ``output_router_logits=True`` and take each token's top-k experts.

The top-k of the router logits is the route of a plain top-k router (softmax before or
after the top-k, or sigmoid without a bias). A router whose choice adds an expert bias
(DeepSeek-V3, GLM-4.5, ERNIE-4.5, MiniMax-M2) or limits groups (DeepSeek-V2/V3) chooses
otherwise, so those are refused rather than converted wrongly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from moe_fold.config import moe_layer_indices
from moe_fold.routes import RouteSignature, write_inference

from .config_map import config_from_hf

__all__ = ["routes_from_transformers"]


@torch.no_grad()
def routes_from_transformers(hf_model, input_ids: torch.Tensor, sample_ids: Sequence[int],
                             path: Optional[str | Path] = None) -> dict[int, torch.Tensor]:
    """The routes of ``input_ids [N, S]`` (the inputs of samples ``sample_ids``, the
    global sample numbers a moe-fold run gives them) through ``hf_model``: sample number ->
    int64 ``[S, moe_layers, topk]``, experts ascending. With ``path``, also written there
    in the inference format of :mod:`moe_fold.routes`."""
    config = config_from_hf(hf_model.config.to_dict())
    moe = config.moe
    if moe.expert_bias or moe.group_topk is not None:
        raise ValueError(f"routes_from_transformers: {type(hf_model).__name__} routes with "
                         f"moe.expert_bias={moe.expert_bias} and moe.group_topk={moe.group_topk}; the rule: the "
                         f"top-k of its router logits is its route only without an expert bias or groups")
    N, S = input_ids.shape
    if len(sample_ids) != N:
        raise ValueError(f"sample_ids has {len(sample_ids)} numbers for {N} sequences of input_ids")
    out = hf_model(input_ids=input_ids, output_router_logits=True)
    layers = [i for i in moe_layer_indices(config) if i < config.model.num_layers]
    logits = out.router_logits
    if logits is None or len(logits) != len(layers):
        raise ValueError(f"{type(hf_model).__name__} returned {0 if logits is None else len(logits)} router "
                         f"logits for its {len(layers)} MoE layers")
    # per layer [N*S, E] -> [N*S, k] -> [N, S, L, k]
    top = torch.stack([torch.topk(x.float(), moe.topk, dim=-1).indices.sort(dim=-1).values for x in logits], 1)
    routes = {int(s): r for s, r in zip(sample_ids, top.view(N, S, len(layers), moe.topk))}
    if path is not None:
        signature = RouteSignature(moe.num_experts, moe.topk, tuple(layers), S, config.model.hidden_size)
        write_inference(path, routes, signature)
    return routes

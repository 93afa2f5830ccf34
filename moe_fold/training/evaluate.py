"""Validation: the LM loss and perplexity of held-out data, on any layout.

:func:`evaluate` runs ``train.eval_iters`` global batches of the validation dataset
(``data.valid_path``, or the documents ``data.valid_fraction`` holds out:
:func:`moe_fold.data.loader.validation_dataset_from_config`) forward only, in eval mode and
without grads, through the same path as training (:func:`moe_fold.training.step.forward_backward`
with ``forward_only``: the pipeline schedule under pp, the cp slices, the dp shards), so
the value is the single-process one under every layout.

- The same batches every time: each evaluation reads the validation data from its first
  sample, so the values of a run are comparable from one evaluation to the next.
- The LM loss only: routers in eval mode attach no aux or z loss and count nothing for the
  expert bias (:class:`moe_fold.dispatch.router.Router`); the value is the mean over every
  unmasked label token of the ``eval_iters`` batches (batches weighted by their tokens).
- Training is untouched: the validation loader is its own (the training data position
  does not move), and the random states are forked around the evaluation, so a run with
  evaluation trains exactly as one without.
"""

from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from moe_fold.comm import all_reduce_
from moe_fold.config import Config
from moe_fold.data.loader import BlendedDataset, DataLoader, GPTDataset
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import Transformer
from moe_fold.training.dynamic_cp import DynamicCP
from moe_fold.training.precision import autocast
from moe_fold.training.step import forward_backward

__all__ = ["evaluate", "validation_loader"]


def validation_loader(dataset: GPTDataset | BlendedDataset, config: Config, groups: ProcessGroups,
                      dynamic_cp: Optional[DynamicCP] = None) -> DataLoader:
    """This rank's share of the validation batches, from the first sample: sharded like
    the training loader (dp shard; cp slice unless dynamic cp regroups the documents)."""
    t = config.train
    cp_rank, cp_size = (0, 1) if dynamic_cp is not None else (groups.rank_in("cp"), groups.size("cp"))
    return DataLoader(dataset, t.global_batch_size, t.micro_batch_size, dp_rank=groups.rank_in("dp"),
                      dp_size=groups.size("dp"), cp_rank=cp_rank, cp_size=cp_size)


@torch.no_grad()
def evaluate(model: Transformer, dataset: GPTDataset | BlendedDataset, groups: ProcessGroups, config: Config,
             device: torch.device, dynamic_cp: Optional[DynamicCP] = None) -> dict[str, float]:
    """``{"valid_loss", "valid_ppl", "valid_tokens"}`` over ``train.eval_iters`` global
    batches of ``dataset`` (see the module docstring); the same on every rank. A
    collective: every rank calls it at the same step."""
    needed = config.train.eval_iters * config.train.global_batch_size
    if len(dataset) < needed and groups.rank == 0:
        warnings.warn(f"the validation data has {len(dataset)} samples, fewer than train.eval_iters x "
                      f"train.global_batch_size = {needed}: some are evaluated more than once", stacklevel=2)
    loader = validation_loader(dataset, config, groups, dynamic_cp)
    # Under dynamic cp every cp rank holds the whole micro-batches: count them over dp only.
    count_group = groups.dp if dynamic_cp is not None else groups.dp_cp
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    tokens = torch.zeros((), dtype=torch.float64)
    cuda = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            for _ in range(config.train.eval_iters):
                micro_batches = [b.to(device) for b in loader.global_batch()]
                losses = forward_backward(model, micro_batches, groups, config, forward_only=True,
                                          forward_context=lambda: autocast(config.train.precision, device),
                                          dynamic_cp=dynamic_cp)
                # [m] float64 -> the global batch's mean LM loss (step.py: sum over dp x cp / (dp*cp))
                mean = all_reduce_(losses.sum(), groups.dp_cp) / groups.size("dp_cp")
                count = all_reduce_(sum(b.loss_mask.sum(dtype=torch.float64) for b in micro_batches), count_group)
                total += (mean * count).cpu()
                tokens += count.cpu()
    finally:
        model.train(was_training)
    loss = (total / tokens.clamp(min=1)).item()
    return {"valid_loss": loss, "valid_ppl": math.exp(loss) if loss < 700 else float("inf"),
            "valid_tokens": int(tokens.item())}

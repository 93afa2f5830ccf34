"""Training precision: ``train.precision`` = ``fp32`` | ``bf16-autocast`` | ``bf16``.

- ``fp32``: parameters, activations and optimizer in float32.
- ``bf16-autocast``: float32 parameters; matmuls run in bfloat16 under
  ``torch.autocast`` (CPU and CUDA). The experts' grouped GEMM
  (:func:`moe_fold.kernels.gmm.gmm`) casts its operands as ``F.linear`` does, whatever the
  backend (tests/training/test_device_paths.py).
- ``bf16``: bfloat16 parameters and activations, float32 *master* weights that the
  optimizer updates (:class:`MasterWeights`). The gradient sync and clipping run on the
  float32 copies of the grads, so the all-reduce sums in float32.

The router computes its logits in ``moe.router_dtype`` (float32 by default) whatever the
precision: it casts its input and weight itself, its buffers (expert bias, counts) keep
their dtype under ``model.to(bfloat16)``, and :func:`exclude_from_autocast` runs it with
autocast off (autocast would otherwise compute its matmul in bfloat16 whatever the
operands' dtype). The MoE combine (a sum of expert rows per token) runs outside autocast
too: it accumulates in float32, and torch's CPU sparse matmul it uses has no bfloat16 kernel.
"""

from __future__ import annotations

import contextlib
import functools
import torch
from torch import nn

from moe_fold.config import choice, choices, require

__all__ = ["PRECISIONS", "param_dtype", "autocast", "exclude_from_autocast", "MasterWeights"]

PRECISIONS = choices("train.precision")


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the model's parameters are stored in."""
    require(choice, "train.precision", precision)
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward pass runs in: bf16 autocast for ``bf16-autocast``, else nothing."""
    if precision == "bf16-autocast":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def exclude_from_autocast(model: nn.Module, device: torch.device) -> None:
    """Run every router's forward and every MoE layer's combine with autocast off."""
    from moe_fold.dispatch.router import Router

    def outside(fn):
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with torch.autocast(device_type=device.type, enabled=False):
                return fn(*args, **kwargs)
        return wrapped

    for module in model.modules():
        if isinstance(module, Router):
            module.forward = outside(module.forward)
        dispatcher = getattr(module, "dispatcher", None)
        if dispatcher is not None:
            dispatcher.combine = outside(dispatcher.combine)


class MasterWeights:
    """float32 master weights of a bf16 model, for the optimizer and checkpoints.

    ``master`` is a second instance of the same model (same config, groups and seed) in
    float32; ``model`` is the bf16 instance that computes. They share their buffers (the
    routers' expert bias and counts, which the bf16 model updates and checkpoints must
    hold), so the optimizer and :mod:`moe_fold.training.checkpoint` work on ``master`` as on any
    model and a resumed bf16 run continues from the exact float32 weights. Per step:
    backward into the bf16 params, :meth:`grads_to_master`, sync/clip/step on
    ``master``'s parameters, then :meth:`master_to_model`.
    """

    def __init__(self, model: nn.Module, master: nn.Module):
        names = [n for n, _ in model.named_parameters()]
        if names != [n for n, _ in master.named_parameters()]:
            raise ValueError("model and master must be two instances of one model (their parameters differ)")
        self.model, self.master = model, master
        self.pairs = list(zip([p for _, p in model.named_parameters()], [p for _, p in master.named_parameters()]))
        for name, buffer in model.named_buffers():
            owner, _, attr = name.rpartition(".")
            setattr(master.get_submodule(owner), attr, buffer)
        self.master_to_model()

    @property
    def params(self) -> list[nn.Parameter]:
        return [m for _, m in self.pairs]

    @torch.no_grad()
    def grads_to_master(self) -> None:
        """Move the model's grads into float32 master grads (model grads cleared); a
        parameter without a grad gets none, as sync_grads expects."""
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def master_to_model(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)

"""What the routers of a model return, read through the public output of
:meth:`moe_fold.dispatch.router.Router.forward` (a forward hook, as the training
metrics read it), for tests that check losses and load statistics."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from moe_fold.dispatch.router import Router, RouterOutput


@contextlib.contextmanager
def router_outputs(model: nn.Module) -> Iterator[list[tuple[Router, RouterOutput]]]:
    """Yield a list that fills, in call order, with ``(router, output)`` for every router
    forward of ``model`` (a router itself included) inside the block."""
    seen: list[tuple[Router, RouterOutput]] = []
    routers = [m for m in model.modules() if isinstance(m, Router)]
    hooks = [r.register_forward_hook(lambda module, args, output: seen.append((module, output))) for r in routers]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def max_dropped_fraction(seen: list[tuple[Router, RouterOutput]]) -> float:
    """The largest capacity-dropped fraction among ``seen`` outputs (0 when none)."""
    return max([0.0] + [out.stats.dropped_fraction.item() for _, out in seen])


def first_sequence_outputs(model: nn.Module, ids: torch.Tensor, batch: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Sequence 0's logits, and every router's routing map of its tokens (in call order),
    from one forward of ``ids[:batch]`` without grad: what batch invariance compares."""
    seq = ids.shape[1]
    with router_outputs(model) as seen, torch.no_grad():
        logits = model.logits(ids[:batch])[0]
    return logits, [out.routing_map.view(seq, batch, -1)[:, 0] for _, out in seen]

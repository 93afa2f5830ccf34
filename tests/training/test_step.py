"""forward_backward on one process: its losses and grads are the loop over micro-batches
with the global batch's token count and the router's 1/m written out by hand, and
every router forward of a step (the MTP depths' too) given that 1/m. The same
step on every layout against one process: tests/parallel/test_parallel_matrix.py."""

import pytest
import torch

from moe_fold.dispatch.router import Router
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import build_model
from moe_fold.training.step import forward_backward
from tests.parallel.test_parallel_matrix import LAYERS, _config, _micro_batches


def test_every_router_forward_of_a_step_gets_the_micro_batch_share():
    """forward_backward hands every router forward of its step, the MTP depths' too, the
    share 1/m of each of its m micro-batches (the factor on the router losses' gradients)."""
    config = _config(dict(mtp_num_layers=1))
    model = build_model(config, ProcessGroups.single_process())
    seen = []
    for module in model.modules():
        if isinstance(module, Router):
            module.register_forward_pre_hook(lambda m, args, kwargs: seen.append((m, kwargs["loss_scale"])),
                                             with_kwargs=True)
    forward_backward(model, _micro_batches(0, 1, 4), ProcessGroups.single_process(), config)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert len(routers) == LAYERS + 1 and model.mtp is not None
    assert sorted(id(m) for m, _ in seen) == sorted(id(m) for m in routers for _ in range(4))
    assert {scale for _, scale in seen} == {0.25}


def test_forward_backward_one_process_is_the_hand_loop():
    """pp = 1: forward_backward's losses and grads equal the loop with the global token
    count and the router's 1/m written out here."""
    config = _config()
    micro = _micro_batches(0, 1, 2)
    a = build_model(config, ProcessGroups.single_process())
    losses = forward_backward(a, micro, ProcessGroups.single_process(), config)
    b = build_model(config, ProcessGroups.single_process())
    n = sum(mb.loss_mask.sum() for mb in micro)
    expected = []
    for mb in micro:
        loss = b(mb.tokens, mb.labels, loss_mask=mb.loss_mask, num_loss_tokens=n, loss_scale=0.5)
        loss.backward()
        expected.append(loss.item())
    assert losses.dtype == torch.float64 and losses.shape == (2,)
    torch.testing.assert_close(losses.tolist(), expected, rtol=1e-6, atol=0)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")
    # forward_only: the same losses, no grads.
    c = build_model(config, ProcessGroups.single_process())
    again = forward_backward(c, micro, ProcessGroups.single_process(), config, forward_only=True)
    torch.testing.assert_close(again, losses, rtol=1e-6, atol=0)
    assert all(p.grad is None for p in c.parameters())


def test_forward_backward_rejects_no_micro_batches():
    config = _config()
    model = build_model(config, ProcessGroups.single_process())
    with pytest.raises(ValueError, match="microbatches is empty"):
        forward_backward(model, [], ProcessGroups.single_process(), config)

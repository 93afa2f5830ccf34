"""On CUDA: a compiled MoE layer, and one MoE layer step (forward and backward) captured
in CUDA graphs and replayed, each equal to eager. Run by the gpu child process
(tests/helpers/gpu_support.py); skipped with the reason where no GPU is usable."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from moe_fold.models.moe_layer import MoELayer

from tests.meta.test_forward_decides_nothing import _groups
from tests.models.test_moe_layer import _config, _inputs

pytestmark = pytest.mark.gpu

PADDED = dict(capacity_factor=1.0, pad_to_capacity=True)


def _layer(dtype=torch.bfloat16):
    return MoELayer(_config(**PADDED), _groups(), 0).to(device="cuda", dtype=dtype)


def _step(layer, x):
    x = x.detach().clone().requires_grad_()
    out = layer(x)
    out.float().square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    layer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def test_compiled_moe_layer_on_cuda_equals_eager():
    layer = _layer()
    x = _inputs().to(device="cuda", dtype=torch.bfloat16)
    want = _step(layer, x)
    dynamo.reset()
    got = _step(torch.compile(layer, fullgraph=True), x)
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())


def test_moe_layer_step_replays_in_a_cuda_graph():
    """The padded layer makes no host sync, so its forward and backward capture as CUDA
    graphs (make_graphed_callables); a replay on new input equals eager."""
    layer = _layer()
    static = _inputs(0).to(device="cuda", dtype=torch.bfloat16).requires_grad_()
    graphed = torch.cuda.make_graphed_callables(layer, (static,))
    fresh = _inputs(1).to(device="cuda", dtype=torch.bfloat16)
    got = _step(graphed, fresh)
    want = _step(layer, fresh)
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        torch.testing.assert_close(a, b)

"""Training precision (moe_fold/training/precision.py): the parameter dtype and the forward's
autocast per train.precision, and the float32 master weights of a bf16 model: the copy
between them, the grads moved to float32, shared buffers, and mismatched models refused."""

import pytest
import torch
from torch import nn

from moe_fold.config import ConfigError
from moe_fold.training.precision import MasterWeights, autocast, param_dtype


def test_param_dtype_and_autocast_follow_the_precision():
    assert param_dtype("bf16") == torch.bfloat16
    assert param_dtype("fp32") == param_dtype("bf16-autocast") == torch.float32
    with pytest.raises(ConfigError, match="train.precision"):
        param_dtype("fp16")
    x = torch.randn(2, 3)
    with autocast("bf16-autocast", torch.device("cpu")):
        assert (x @ x.t()).dtype == torch.bfloat16
    for precision in ("fp32", "bf16"):
        with autocast(precision, torch.device("cpu")):
            assert (x @ x.t()).dtype == torch.float32


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2, bias=False))


def test_master_weights_copy_move_grads_and_share_buffers():
    model, master = _net(0).to(torch.bfloat16), _net(1)
    weights = MasterWeights(model, master)
    # The bf16 model starts from the master's float32 weights, rounded.
    for p, m in weights.pairs:
        assert p.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert torch.equal(p, m.to(torch.bfloat16))
    assert weights.params == list(master.parameters())
    # The buffers the bf16 model updates are the master's (checkpoints read the master).
    assert master[1].running_mean is model[1].running_mean
    model(torch.randn(5, 4, dtype=torch.bfloat16)).sum().backward()
    model[2].weight.grad = None  # a parameter without a grad keeps none
    grads = [None if p.grad is None else p.grad.clone() for p, _ in weights.pairs]
    weights.grads_to_master()
    for (p, m), g in zip(weights.pairs, grads):
        assert p.grad is None
        assert (m.grad is None) if g is None else (m.grad.dtype == torch.float32 and torch.equal(m.grad, g.float()))
    with torch.no_grad():
        master[0].weight.add_(1.0)
    weights.master_to_model()
    assert torch.equal(model[0].weight, master[0].weight.to(torch.bfloat16))


def test_master_weights_refuse_two_different_models():
    with pytest.raises(ValueError, match="two instances of one model"):
        MasterWeights(nn.Linear(2, 2), nn.Linear(2, 2, bias=False))

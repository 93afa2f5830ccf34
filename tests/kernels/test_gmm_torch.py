"""The torch backend of the grouped GEMM (kernels/gmm_torch.py): the path it takes (bmm for equal
counts known on the host, grouped_mm otherwise), its paths agreeing with each other, and the bmm
path's grads reaching one operand only. Every backend against the loop: tests/kernels/test_gmm.py."""

import pytest
import torch

from moe_fold.kernels.gmm import gmm
from moe_fold.kernels.gmm_torch import torch_path


def test_torch_backend_path_choice():
    # bmm only where the counts are known on the host, all equal, and the tensors on CPU;
    # tests/kernels/test_gmm.py checks both paths against the float64 loop.
    x = torch.randn(4, 8)
    assert torch_path(x, [2, 2]) == "bmm"
    assert torch_path(x, [0, 0, 0]) == "bmm"
    assert torch_path(x, [4]) == "bmm"
    assert torch_path(x, [3, 1]) == "grouped_mm"
    assert torch_path(x, [0, 4]) == "grouped_mm"
    assert torch_path(x, None) == "grouped_mm"
    assert torch_path(x.to("meta"), [2, 2]) == "grouped_mm"


@pytest.mark.parametrize("trans_b", [False, True])
def test_torch_paths_agree_with_each_other(trans_b):
    # The same equal-count problem through bmm (counts on the host) and through grouped_mm
    # (the grouped_mm Function called directly): one answer within float32 rounding.
    from moe_fold.kernels.gmm_torch import _GroupedMM

    torch.manual_seed(2)
    x = torch.randn(30, 12, requires_grad=True)
    w = torch.randn(3, 20, 12) if trans_b else torch.randn(3, 12, 20)
    w.requires_grad_()
    g = torch.randn(30, 20)
    y_bmm = gmm(x, w, [10, 10, 10], trans_b=trans_b, backend="torch")
    grads_bmm = torch.autograd.grad(y_bmm, [x, w], g)
    y_gmm = _GroupedMM.apply(x, w, torch.tensor([10, 20, 30], dtype=torch.int32), trans_b)
    grads_gmm = torch.autograd.grad(y_gmm, [x, w], g)
    torch.testing.assert_close(y_bmm, y_gmm, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads_bmm, grads_gmm):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_torch_bmm_path_grads_to_one_operand_only():
    torch.manual_seed(3)
    x, w = torch.randn(8, 6), torch.randn(2, 6, 5)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    (dx,) = torch.autograd.grad(gmm(xg, w, [4, 4], backend="torch").sum(), [xg])
    (dw,) = torch.autograd.grad(gmm(x, wg, [4, 4], backend="torch").sum(), [wg])
    torch.testing.assert_close(dx, torch.cat([w[0].sum(1).expand(4, 6), w[1].sum(1).expand(4, 6)]))
    torch.testing.assert_close(dw, torch.stack([x[:4].sum(0)[:, None].expand(6, 5), x[4:].sum(0)[:, None].expand(6, 5)]))

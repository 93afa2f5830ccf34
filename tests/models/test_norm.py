"""RMSNorm's and rotary's written-out backwards against autograd through the plain
formulas (Hugging Face's op for op); RMSNorm in float32, bfloat16 and with a bfloat16 weight."""

import pytest
import torch

from moe_fold.models.norm import RMSNorm
from moe_fold.models.rotary import apply_rotary, rotary_cos_sin


def _reference(x, weight, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype,weight_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
def test_rmsnorm_forward_and_grads_equal_autograd_reference(dtype, weight_dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, 1e-5).to(weight_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=gen) + 0.5)
    x = torch.randn(5, 3, 48, generator=gen).to(dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    w_ref = norm.weight.detach().clone().requires_grad_()
    y, y_ref = norm(x), _reference(x_ref, w_ref, 1e-5)
    assert y.dtype == y_ref.dtype and torch.equal(y, y_ref)  # the forward is the same ops
    grad = torch.randn(y.shape, generator=gen).to(y.dtype)
    y.backward(grad)
    y_ref.backward(grad)
    assert x.grad.dtype == dtype and norm.weight.grad.dtype == weight_dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x.grad, x_ref.grad, **tol)
    torch.testing.assert_close(norm.weight.grad, w_ref.grad, **tol)


def test_rotary_equals_rotate_half_formula_and_its_autograd():
    """apply_rotary's two-pass forward and written-out backward against Hugging Face's
    ``x * cos + rotate_half(x) * sin`` through autograd, for [S] and [B, S] positions."""
    gen = torch.Generator().manual_seed(1)
    B, heads, S, hd = 2, 3, 5, 8
    for positions in (torch.arange(S), torch.randint(0, 50, (B, S), generator=gen)):
        cos, sin = rotary_cos_sin(positions, hd, 10000.0)
        x = torch.randn(B, S, heads, hd, generator=gen).permute(0, 2, 1, 3).requires_grad_()  # non-contiguous
        x_ref = x.detach().clone().requires_grad_()
        c, s = cos.unsqueeze(-3), sin.unsqueeze(-3)
        x1, x2 = x_ref.chunk(2, dim=-1)
        ref = x_ref * c + torch.cat([-x2, x1], dim=-1) * s
        out = apply_rotary(x, cos, sin)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        grad = torch.randn(out.shape, generator=gen)
        out.backward(grad)
        ref.backward(grad)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)

"""The chunked SSD (Mamba2) against a float64 token-by-token reference, forward and
gradients, several chunk sizes, with and without packed documents."""

from __future__ import annotations

import pytest
import torch

from moe_fold.kernels.ssd import chunk_ssd, ssd_decay
from tests.helpers.float64_reference import assert_close_to_float64


def recurrent_reference(x, g, b, c, resets=None, initial_state=None):
    """``S_t = exp(g_t) S_{t-1} + b_t x_t^T``, ``y_t = S_t^T c_t``, one token at a time."""
    B, H, S, P = x.shape
    N = b.shape[-1]
    state = x.new_zeros(B, H, N, P) if initial_state is None else initial_state.clone()
    outs = []
    for t in range(S):
        if resets is not None:
            state = state * (~resets[:, t]).to(state.dtype)[:, None, None, None]
        state = state * g[:, :, t].exp()[..., None, None] + b[:, :, t, :, None] * x[:, :, t, None, :]
        outs.append(torch.einsum("bhnp,bhn->bhp", state, c[:, :, t]))
    return torch.stack(outs, dim=2), state


def _inputs(B=2, H=3, S=37, P=5, N=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, S, P, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, H, S, generator=gen, dtype=torch.float64) * 0.7
    b = torch.randn(B, H, S, N, generator=gen, dtype=torch.float64)
    c = torch.randn(B, H, S, N, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (x, g, b, c)]


def _resets(B, S, starts):
    resets = torch.zeros(B, S, dtype=torch.bool)
    for row, cols in enumerate(starts):
        resets[row, cols] = True
    return resets


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
@pytest.mark.parametrize("packed", [False, True])
def test_chunked_equals_recurrent_forward_and_grads(chunk, packed):
    inputs = _inputs()
    B, S = inputs[0].shape[0], inputs[0].shape[2]
    # Starts inside a chunk, on a chunk edge (16) and at the last token.
    resets = _resets(B, S, [[0, 5, 16, 36], [0, 9, 10, 30]]) if packed else None
    init = torch.randn(B, 3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want, want_state = recurrent_reference(*inputs, resets=resets, initial_state=init)
    probe = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * probe).sum() + want_state.sum(), inputs)

    f32 = [t.detach().float().requires_grad_() for t in inputs]
    got, got_state = chunk_ssd(*f32, resets=resets, initial_state=init.float(), chunk_size=chunk)
    grads_got = torch.autograd.grad((got * probe.float()).sum() + got_state.sum(), f32)
    assert_close_to_float64(got, want.detach(), rtol=1e-5, atol=1e-6)
    assert_close_to_float64(got_state, want_state.detach(), rtol=1e-5, atol=1e-6)
    for name, a, w in zip("xgbc", grads_got, grads_want):
        assert_close_to_float64(a, w, rtol=1e-4, atol=1e-5, msg=f"grad of {name}")


def test_packed_equals_each_document_alone():
    """A packed row gives each document what the recurrence gives it alone from a zero
    state, even when the row starts from a nonzero state."""
    x, g, b, c = (t.detach().float() for t in _inputs(B=1, S=30))
    bounds = [0, 7, 19, 30]
    resets = _resets(1, 30, [bounds[:-1]])
    init = torch.randn(1, 3, 4, 5)
    packed, _ = chunk_ssd(x, g, b, c, resets=resets, initial_state=init, chunk_size=8)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        alone, _ = chunk_ssd(*(t[:, :, lo:hi] for t in (x, g, b, c)), chunk_size=8)
        torch.testing.assert_close(packed[:, :, lo:hi], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_segment_map_is_affine_in_the_start_state(packed):
    """``S_end = ssd_decay * S_start + (the end state from zeros)``: what cp composes."""
    x, g, b, c = (t.detach() for t in _inputs(S=23))
    resets = _resets(2, 23, [[11], []]) if packed else None
    start = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    _, end = chunk_ssd(x, g, b, c, resets=resets, initial_state=start, chunk_size=8)
    _, write = chunk_ssd(x, g, b, c, resets=resets, chunk_size=8)
    torch.testing.assert_close(end, ssd_decay(g, resets)[..., None, None] * start + write)

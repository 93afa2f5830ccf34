"""The block kernels of ring attention (moe_fold/parallel/ring_attention.py): each key block's
output and log-sum-exp, and block grads that sum (dq) and concatenate (dk, dv) to the full
attention's, against a float64 reference. Ring attention across ranks:
tests/parallel/test_context_parallel.py."""

import math

import pytest
import torch

from moe_fold.parallel import ring_attention as ra

from tests.parallel.test_context_parallel import TOL, _reference_grads


@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 3), (6, 2)])
def test_block_kernels_give_lse_and_exact_block_grads(hq, hkv):
    """Forward: out and log-sum-exp of each key block. Backward with the full row's out and
    lse: block grads sum (dq) and concatenate (dk, dv) to the full attention's grads.
    (The flex block kernel of other devices: tests/parallel/test_document_attention.py.)"""
    fwd, bwd = ra.block_attention_forward, ra.block_attention_backward
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    q, k, v, dout = (torch.randn(2, h, 8, 4, generator=gen) for h in (hq, hkv, hkv, hq))
    scale = 0.3
    for causal in (True, False):
        out, lse = fwd(q, k, v, causal, scale)
        ref_out, ref_dq, ref_dk, ref_dv = _reference_grads(q, k, v, dout, causal, scale)
        assert lse.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref_out, **TOL)
        scores = (q.double() * scale) @ k.double().repeat_interleave(hq // hkv, 1).transpose(-1, -2)
        if causal:
            scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).tril().logical_not(), -math.inf)
        torch.testing.assert_close(lse.double(), scores.logsumexp(-1), **TOL)
        if causal:
            continue
        # Two key blocks, each with the full row's statistics.
        dq = 0
        dks, dvs = [], []
        for keys in (slice(0, 3), slice(3, 8)):
            bq, bk, bv = bwd(dout, q, k[:, :, keys], v[:, :, keys], out, lse, False, scale)
            dq, dks, dvs = dq + bq, dks + [bk], dvs + [bv]
        torch.testing.assert_close(dq.double(), ref_dq, **TOL)
        torch.testing.assert_close(torch.cat(dks, 2).double(), ref_dk, **TOL)
        torch.testing.assert_close(torch.cat(dvs, 2).double(), ref_dv, **TOL)
    # The causal backward on a square block equals the full causal grads.
    out, lse = fwd(q, k, v, True, scale)
    bq, bk, bv = bwd(dout, q, k, v, out, lse, True, scale)
    _, ref_dq, ref_dk, ref_dv = _reference_grads(q, k, v, dout, True, scale)
    torch.testing.assert_close(bq.double(), ref_dq, **TOL)
    torch.testing.assert_close(bk.double(), ref_dk, **TOL)
    torch.testing.assert_close(bv.double(), ref_dv, **TOL)

"""Context parallel attention against single-process attention on the gathered sequence.

Every rank builds the global q, k, v and output grad from one seed, keeps its zigzag
shard, and runs ring or a2a attention forward and backward; the parent gathers the
shards and compares them with a float64 reference written here (explicit scores, mask
and softmax over the whole sequence). Byte counts are checked against the formulas in
``moe_fold.parallel.ring_attention`` and of the a2a all-to-alls.
"""

import math

import pytest
import torch
import torch.distributed as dist

from moe_fold.parallel import ring_attention as ra
from moe_fold.comm import count_bytes
from moe_fold.parallel.context_parallel import (a2a_kv_repeats, context_parallel_attention, zigzag_gather,
                                       zigzag_positions, zigzag_split)
from moe_fold.launch import run_ranks

TOL = dict(atol=1e-5, rtol=1e-5)


def _reference(q, k, v, causal, scale=None):
    """Attention in float64 over the whole sequence: head h uses kv head h // (Hq/Hkv)."""
    hq, hkv, s, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    scale = d ** -0.5 if scale is None else scale
    k = k.double().repeat_interleave(hq // hkv, 1)
    v = v.double().repeat_interleave(hq // hkv, 1)
    scores = q.double() @ k.transpose(-1, -2) * scale  # [B, Hq, S, S]
    if causal:
        future = torch.arange(s)[None, :] > torch.arange(s)[:, None]
        scores = scores.masked_fill(future, -math.inf)
    return scores.softmax(-1) @ v


def _reference_grads(q, k, v, dout, causal, scale=None):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = _reference(q, k, v, causal, scale)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _global(case):
    """q, k, v, dout of a case, in the case's dtype (float32 unless it names one)."""
    kind, b, hq, hkv, s, d, causal, seed = case[:8]
    dtype = case[8] if len(case) > 8 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d), (b, hq, s, d))
    return tuple(torch.randn(shape, generator=gen).to(dtype) for shape in shapes)


# ----------------------------------------------------------------- zigzag layout

def test_zigzag_split_takes_chunks_r_and_mirror():
    x = torch.arange(2 * 24).view(2, 24)
    for cp in (1, 2, 3, 4):
        c = 24 // (2 * cp)
        shards = [zigzag_split(x, r, cp, dim=1) for r in range(cp)]
        for r, shard in enumerate(shards):
            want = [p for j in (r, 2 * cp - 1 - r) for p in range(j * c, (j + 1) * c)]
            assert shard[0].tolist() == want and shard[1].tolist() == [24 + p for p in want]
            assert zigzag_positions(24, r, cp).tolist() == want
        assert torch.equal(zigzag_gather(shards, dim=1), x)


# The zigzag layout written out: the sequence in 2*cp equal chunks, rank r takes chunk r
# and chunk 2*cp-1-r (so every rank has the same causal work). Positions of each rank.
ZIGZAG = {
    (8, 1): [[0, 1, 2, 3, 4, 5, 6, 7]],
    (8, 2): [[0, 1, 6, 7], [2, 3, 4, 5]],
    (12, 3): [[0, 1, 10, 11], [2, 3, 8, 9], [4, 5, 6, 7]],
    (16, 4): [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]],
    (16, 2): [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]],
}


@pytest.mark.parametrize("seq, cp", list(ZIGZAG))
def test_zigzag_split_and_the_data_loader_give_the_written_layout(seq, cp):
    """zigzag_split / zigzag_positions (the cp attention's layout) and the data loader's
    cp_zigzag_slice (which cuts each rank's tokens and positions) against the layout
    written out by hand; the gather puts the rank pieces back in order."""
    from moe_fold.data.loader import cp_zigzag_slice

    tokens = torch.arange(3 * seq).view(3, seq)  # row b holds b*seq + position
    for r, want in enumerate(ZIGZAG[seq, cp]):
        want_tokens = torch.tensor([[b * seq + p for p in want] for b in range(3)])
        assert zigzag_positions(seq, r, cp).tolist() == want
        assert torch.equal(zigzag_split(tokens, r, cp, dim=1), want_tokens)
        local, positions = cp_zigzag_slice(tokens, r, cp)
        assert torch.equal(local, want_tokens) and positions.tolist() == want
    assert torch.equal(zigzag_gather([zigzag_split(tokens, r, cp, dim=1) for r in range(cp)], dim=1), tokens)


def test_zigzag_errors():
    with pytest.raises(ValueError, match="model.seq_length=6 is not divisible by 2\\*parallel.cp=4"):
        zigzag_split(torch.zeros(6), 0, 2, dim=0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        zigzag_positions(8, 2, 2)
    with pytest.raises(ValueError, match="odd length 3"):
        zigzag_gather([torch.zeros(3), torch.zeros(3)], dim=0)


# ----------------------------------------------------------------- single rank and arguments

def test_single_rank_is_plain_causal_attention():
    q, k, v, dout = _global(("ring", 2, 6, 2, 10, 4, True, 3))
    ref_out, ref_dq, ref_dk, ref_dv = _reference_grads(q, k, v, dout, True)
    for kind in ("ring", "a2a"):
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(ql, kl, vl, None, kind=kind)
        out.backward(dout)
        torch.testing.assert_close(out.double(), ref_out, **TOL)
        for got, want in ((ql.grad, ref_dq), (kl.grad, ref_dk), (vl.grad, ref_dv)):
            torch.testing.assert_close(got.double(), want, **TOL)


def test_argument_errors():
    q, k = torch.zeros(1, 4, 8, 2), torch.zeros(1, 3, 8, 2)
    with pytest.raises(ValueError, match="kind=.ulysses. is not one of ring, a2a"):
        context_parallel_attention(q, q, q, None, kind="ulysses")
    with pytest.raises(ValueError, match="multiple of kv heads 3"):
        context_parallel_attention(q, k, k, None)
    with pytest.raises(ValueError, match="expected \\[B, heads, S_local, head_dim\\]"):
        context_parallel_attention(q[0], q[0], q[0], None)
    with pytest.raises(ValueError, match="must agree in batch, heads and sequence"):
        context_parallel_attention(q, q, q[:, :2], None)
    with pytest.raises(ValueError, match="at least 2 ranks, got 1"):
        ra.ring_attention(q, q, q, None)


def test_a2a_kv_repeats():
    assert a2a_kv_repeats(8, 4, 4) == 1
    assert a2a_kv_repeats(6, 3, 2) == 2
    assert a2a_kv_repeats(4, 2, 4) == 2
    assert a2a_kv_repeats(12, 3, 4) == 4
    assert a2a_kv_repeats(8, 1, 4) == 4
    with pytest.raises(ValueError, match="query heads 6 must be divisible by cp=4"):
        a2a_kv_repeats(6, 2, 4)


# ----------------------------------------------------------------- cp ranks

# (kind, B, Hq, Hkv, S, D, causal, seed[, dtype]); odd seeds pass q, k, v as
# non-contiguous [B, S, H, D] -> [B, H, S, D] views, as an attention module makes them.
CASES = {
    2: [("ring", 2, 4, 2, 8, 8, True, 1), ("ring", 1, 6, 3, 24, 4, True, 2),
        ("ring", 1, 3, 3, 16, 4, True, 3), ("ring", 1, 4, 2, 8, 4, False, 4),
        ("a2a", 2, 4, 2, 8, 8, True, 5), ("a2a", 1, 6, 3, 16, 4, True, 6),
        ("a2a", 1, 6, 2, 24, 4, True, 7), ("a2a", 1, 4, 4, 8, 4, False, 8),
        ("ring", 1, 4, 2, 16, 8, True, 9, torch.bfloat16), ("a2a", 1, 4, 2, 16, 8, True, 10, torch.bfloat16)],
    4: [("ring", 2, 4, 2, 16, 8, True, 11), ("ring", 1, 6, 3, 24, 4, True, 12),
        ("ring", 1, 6, 2, 8, 4, True, 13), ("ring", 1, 2, 1, 16, 4, False, 14),
        ("a2a", 2, 4, 2, 16, 8, True, 15), ("a2a", 1, 8, 4, 24, 4, True, 16),
        ("a2a", 1, 12, 3, 8, 4, True, 17)],
}


def _run_cases(rank, world_size, cases):
    # The one group this needs, named like the layout's cp groups (for the byte counter).
    cp_group = dist.new_group(list(range(world_size)), group_desc="cp")
    results = []
    for case in cases:
        q, k, v, dout = (zigzag_split(t, rank, world_size, dim=2) for t in _global(case))
        if case[7] % 2:
            q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with count_bytes() as fwd:
            out = context_parallel_attention(q, k, v, cp_group, kind=case[0], causal=case[6])
        with count_bytes() as bwd:
            out.backward(dout)
        # numpy, not tensors: a tensor crosses the result queue as a shared-memory handle
        # that dies with the rank process.
        assert out.dtype == q.dtype and q.grad.dtype == k.grad.dtype == q.dtype
        results.append(dict(out=out.detach().float().numpy(), dq=q.grad.float().numpy(),
                            dk=k.grad.float().numpy(), dv=v.grad.float().numpy(), fwd=fwd, bwd=bwd))
    errors = []
    q = torch.zeros(1, 5, 8, 4)
    for kind, qq, why in (("a2a", q, "query heads 5 must be divisible by cp"),
                          ("ring", q[:, :, :3], "local sequence length 3")):
        try:
            context_parallel_attention(qq, qq, qq, cp_group, kind=kind)
            errors.append(f"{kind}: no error")
        except ValueError as e:
            errors.append(why if why in str(e) else str(e))
    return results, errors


def _expected_bytes(case, cp):
    kind, b, hq, hkv, s, d = case[:6]
    elem = _global(case)[0].element_size()
    local = b * (s // cp) * d * elem  # bytes of one head's local shard
    if kind == "ring":
        kv = 2 * hkv * local
        return (cp - 1) * kv, (cp - 1) * kv + cp * kv * 4 // elem  # dK/dV accumulate in float32
    # a2a: q, k, v (kv heads repeated) and the output each keep 1/cp of their bytes.
    hkv = hkv * a2a_kv_repeats(hq, hkv, cp)
    moved = (2 * hq + 2 * hkv) * local * (cp - 1) // cp
    return moved, moved


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_matches_full_attention(cp):
    per_rank = run_ranks(_run_cases, cp, CASES[cp], timeout=120)
    for i, case in enumerate(CASES[cp]):
        q, k, v, dout = _global(case)
        # bfloat16 keeps 8 bits of mantissa; the reference sees the same rounded inputs.
        tol = TOL if q.dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
        want = dict(zip(("out", "dq", "dk", "dv"), _reference_grads(q, k, v, dout, case[6])))
        for name, ref in want.items():
            got = zigzag_gather([torch.from_numpy(res[i][name]) for res, _ in per_rank], dim=2)
            torch.testing.assert_close(got.double(), ref, **tol, msg=lambda m: f"{case} {name}: {m}")
        fwd, bwd = _expected_bytes(case, cp)
        for rank, (res, _) in enumerate(per_rank):
            assert (res[i]["fwd"], res[i]["bwd"]) == ({"cp": fwd}, {"cp": bwd}), (case, rank)
    for _, errors in per_rank:
        assert errors == ["query heads 5 must be divisible by cp", "local sequence length 3"]

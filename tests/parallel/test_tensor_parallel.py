"""Tensor-parallel layers against full (one-process) computations written here: fused
shards, column/row-parallel linears with and without sequence parallel, the
vocab-parallel embedding and the vocab-parallel cross-entropy."""

import pytest
import torch
import torch.nn.functional as F

from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, global_normal, init_seed, mark,
    shard_tp, unshard_tp, vocab_parallel_cross_entropy,
)

S, B, H, V = 8, 2, 16, 32
PARTS = [16, 8, 8]  # a fused q|k|v-like output


def test_shard_keeps_fused_parts_together_and_unshard_inverts():
    full = torch.arange(32.0 * 3).view(32, 3)
    shards = [shard_tp(full, 0, PARTS, r, 4) for r in range(4)]
    # Rank 1 holds rows 4:8 of part 0, 18:20 of part 1 and 26:28 of part 2.
    torch.testing.assert_close(shards[1], torch.cat([full[4:8], full[18:20], full[26:28]]))
    torch.testing.assert_close(unshard_tp(shards, 0, PARTS), full)
    cols = [shard_tp(full.T, 1, [32], r, 2) for r in range(2)]
    torch.testing.assert_close(unshard_tp(cols, 1, [32]), full.T)


def test_shard_rejects_indivisible_parts():
    with pytest.raises(ValueError, match="part of size 16 .* not divisible by tp=3"):
        shard_tp(torch.zeros(24, 2), 0, [16, 8], 0, 3)
    with pytest.raises(ValueError, match="parts=\\[16, 4\\] sum to 20"):
        shard_tp(torch.zeros(24, 2), 0, [16, 4], 0, 2)


def test_init_is_seeded_per_parameter():
    assert init_seed(1, "a") == init_seed(1, "a") != init_seed(1, "b") != init_seed(2, "a")
    torch.testing.assert_close(global_normal((3, 4), 0.5, 9), global_normal((3, 4), 0.5, 9))
    assert global_normal((1000,), 0.5, 9).std().sub(0.5).abs() < 0.05


def test_mark_rejects_unknown_kind():
    with pytest.raises(ValueError, match="parallel='dense' must be one of tp, replicated, tp_sum, expert"):
        mark(torch.nn.Parameter(torch.zeros(1)), "dense")
    with pytest.raises(ValueError, match="parallel='tp' needs tp_dim and tp_parts"):
        mark(torch.nn.Parameter(torch.zeros(1)), "tp")


def test_cross_entropy_one_process_matches_torch():
    logits = torch.randn(5, 3, V, requires_grad=True)
    target = torch.randint(0, V, (5, 3))
    got = vocab_parallel_cross_entropy(logits, target, None)
    expected = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="none").view(5, 3)
    torch.testing.assert_close(got, expected)
    weights = torch.rand(5, 3)
    (g_got,) = torch.autograd.grad((got * weights).sum(), logits)
    (g_exp,) = torch.autograd.grad((expected * weights).sum(), logits)
    torch.testing.assert_close(g_got, g_exp)
    # Targets out of range (padding) stay finite, so a zero mask removes them exactly.
    pad = vocab_parallel_cross_entropy(logits, torch.full((5, 3), -100), None)
    assert torch.isfinite(pad).all()


def _full_references():
    """Inputs, weights and the full results/grads every rank is compared with."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, H, generator=gen)
    z = torch.randn(S, B, sum(PARTS), generator=gen)  # input of the row-parallel linear
    rc = torch.randn(S, B, sum(PARTS), generator=gen)  # weights of the column output's loss
    w_col = global_normal((sum(PARTS), H), 0.3, 11)  # what ColumnParallelLinear(seed=11) draws
    col_bias = torch.randn(sum(PARTS), generator=gen)
    w_row = global_normal((H, sum(PARTS)), 0.3, 12)
    emb = global_normal((V, H), 0.3, 13)
    r = torch.randn(S, B, H, generator=gen)  # weights of the scalar loss
    ids = torch.randint(0, V, (S, B), generator=gen)
    logits = torch.randn(S, B, V, generator=gen) * 3
    target = torch.randint(0, V, (S, B), generator=gen)
    tensors = dict(x=x, col_bias=col_bias, z=z, rc=rc, r=r, ids=ids, logits=logits, target=target)

    ref = {}
    xr, wc = x.clone().requires_grad_(), w_col.clone().requires_grad_()
    bc = col_bias.clone().requires_grad_()
    y = xr @ wc.T + bc  # [S, B, sum(PARTS)]
    (y * rc).sum().backward()
    ref.update(col_out=y.detach(), x_grad=xr.grad, col_grad=wc.grad, bias_grad=bc.grad)
    zr, wr = z.clone().requires_grad_(), w_row.clone().requires_grad_()
    y = zr @ wr.T  # [S, B, H]
    (y * r).sum().backward()
    ref.update(row_out=y.detach(), z_grad=zr.grad, row_grad=wr.grad)
    e = emb.clone().requires_grad_()
    out = F.embedding(ids, e)
    (out * r).sum().backward()
    ref.update(emb_out=out.detach(), emb_grad=e.grad)
    lg = logits.clone().requires_grad_()
    loss = F.cross_entropy(lg.reshape(-1, V), target.reshape(-1), reduction="none").view(S, B)
    (loss * r[..., 0]).sum().backward()
    ref.update(ce=loss.detach(), ce_grad=lg.grad)
    return tensors, ref


def _tp_rank(rank, world_size):
    groups = create_process_groups(ParallelLayout(world_size, tp=world_size))
    tp, me = groups.tp, groups.rank_in("tp")
    t, _ = _full_references()
    chunk = lambda a: a.chunk(world_size, 0)[me]  # this rank's sequence shard
    out = {}
    for sp in (False, True):
        # Column: each rank's loss is its own output slice's part of the total; the
        # backward of the entry collective adds the parts up.
        col = ColumnParallelLinear(H, PARTS, tp, sp, std=0.3, seed=11, bias=True)
        with torch.no_grad():
            col.bias.copy_(shard_tp(t["col_bias"], 0, PARTS, me, world_size))
        x = (chunk(t["x"]) if sp else t["x"]).clone().requires_grad_()
        y = col(x)  # [S, B, sum(PARTS)/tp], the full sequence either way
        (y * shard_tp(t["rc"], 2, PARTS, me, world_size)).sum().backward()
        res = dict(col_out=y.detach().numpy(), x_grad=x.grad.numpy(), col_grad=col.weight.grad.numpy(),
                   bias_grad=col.bias.grad.numpy())
        # Row: under SP a rank holds its sequence shard of the output and of the loss;
        # without SP every rank holds the whole (replicated) output and loss.
        row = RowParallelLinear(sum(PARTS), H, tp, sp, std=0.3, seed=12)
        z = shard_tp(t["z"], 2, [sum(PARTS)], me, world_size).requires_grad_()
        y = row(z)  # SP: [S/tp, B, H]; else [S, B, H]
        (y * (chunk(t["r"]) if sp else t["r"])).sum().backward()
        res.update(row_out=y.detach().numpy(), z_grad=z.grad.numpy(), row_grad=row.weight.grad.numpy())
        out[f"sp{sp}"] = res
        emb = VocabParallelEmbedding(V, H, tp, sp, std=0.3, seed=13)
        e = emb(t["ids"])
        (e * (chunk(t["r"]) if sp else t["r"])).sum().backward()
        res.update(emb_out=e.detach().numpy(), emb_grad=emb.weight.grad.numpy())
    logits = shard_tp(t["logits"], 2, [V], me, world_size).requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, t["target"], tp)
    (loss * t["r"][..., 0]).sum().backward()
    out["ce"] = loss.detach().numpy()
    out["ce_grad"] = logits.grad.numpy()
    return out


def test_tp_layers_match_full_computation():
    tp = 4
    t, ref = _full_references()
    results = run_ranks(_tp_rank, tp, timeout=120)
    close = lambda got, expected, what: torch.testing.assert_close(
        torch.from_numpy(got), expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    for me, got in enumerate(results):
        for sp in (False, True):
            g = got[f"sp{sp}"]
            seq = (lambda a: a.chunk(tp, 0)[me]) if sp else (lambda a: a)
            close(g["col_out"], shard_tp(ref["col_out"], 2, PARTS, me, tp), f"rank {me} sp={sp} column output")
            close(g["x_grad"], seq(ref["x_grad"]), f"rank {me} sp={sp} column input grad")
            close(g["col_grad"], shard_tp(ref["col_grad"], 0, PARTS, me, tp), f"rank {me} sp={sp} column grad")
            close(g["bias_grad"], shard_tp(ref["bias_grad"], 0, PARTS, me, tp), f"rank {me} sp={sp} bias grad")
            close(g["row_out"], seq(ref["row_out"]), f"rank {me} sp={sp} row output")
            close(g["z_grad"], shard_tp(ref["z_grad"], 2, [sum(PARTS)], me, tp), f"rank {me} sp={sp} row input grad")
            close(g["row_grad"], shard_tp(ref["row_grad"], 1, [sum(PARTS)], me, tp), f"rank {me} sp={sp} row grad")
            close(g["emb_out"], seq(ref["emb_out"]), f"rank {me} sp={sp} embedding")
            close(g["emb_grad"], shard_tp(ref["emb_grad"], 0, [V], me, tp), f"rank {me} sp={sp} embedding grad")
        close(got["ce"], ref["ce"], f"rank {me} cross-entropy")
        close(got["ce_grad"], shard_tp(ref["ce_grad"], 2, [V], me, tp), f"rank {me} cross-entropy grad")

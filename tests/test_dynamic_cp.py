"""Dynamic context parallelism (issue 12): the partitions and the scheduler by hand, the
exact per-rank attention work of a zigzag split, and a packed micro-batch trained on
dynamic cp 2 and 4 giving one process's losses and gradients."""

import pytest
import torch

from moe_fold.dynamic_cp import (
    CostModel, DynamicCP, check_dynamic_cp, partitions, schedule, static_plan, zigzag_pair_counts,
)
from moe_fold.context_parallel import zigzag_split
from moe_fold.grads import sync_grads
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.model import build_model
from moe_fold.step import forward_backward

from test_layout_invariance import _global_grads
from test_packed import _config, _packed_batch

S = 16


def test_partitions_are_aligned_power_of_two_blocks():
    assert partitions(1) == [((0, 1),)]
    assert partitions(2) == [((0, 2),), ((0, 1), (1, 1))]
    for cp, count in ((4, 5), (8, 26)):
        parts = partitions(cp)
        assert len(parts) == count == len(set(parts))
        for blocks in parts:
            ranks = [r for s, c in blocks for r in range(s, s + c)]
            assert ranks == list(range(cp))
            assert all(s % c == 0 and c & (c - 1) == 0 for s, c in blocks)
    with pytest.raises(ValueError, match="power of two"):
        partitions(6)


def test_schedule_by_hand():
    # One document of 16 and four of 4 on cp 4, 8 tokens per rank. Cost per rank:
    # pairs(L) = L(L+1)/2, kv_token_cost w = 4: the whole group costs
    # (136 + 4*10 + 4*3*32)/4 = 140 per rank; {0,1} with the 16 costs (136 + 4*16)/2 = 100
    # and two single ranks with two 4s each cost 20. {2,3} as one pair costs (40+64)/2 = 52,
    # the same maximum, but more ranks in multi-rank groups: singles win.
    cost = CostModel(pair_flops=1.0, kv_token_cost=4.0)
    plan = schedule([16, 4, 4, 4, 4], cp=4, capacity=8, cost=cost)
    assert [(g.start, g.size, g.docs) for g in plan.subgroups] == [(0, 2, (0,)), (2, 1, (1, 3)), (3, 1, (2, 4))]
    assert plan.rank_cost == (100.0, 100.0, 20.0, 20.0)
    assert plan.rank_tokens == (8, 8, 8, 8)
    # Free communication: the whole group is the best balance.
    free = schedule([16, 4, 4, 4, 4], cp=4, capacity=8, cost=CostModel(pair_flops=1.0))
    assert [(g.start, g.size) for g in free.subgroups] == [(0, 4)]
    assert free.rank_cost == static_plan([16, 4, 4, 4, 4], 4, CostModel(pair_flops=1.0)).rank_cost == (44.0,) * 4
    # Memory: with 4 tokens per rank the 16 needs all four ranks.
    with pytest.raises(ValueError, match="capacity=3"):
        schedule([16, 4, 4, 4, 4], cp=4, capacity=3, cost=cost)
    with pytest.raises(ValueError, match="lengths"):
        schedule([16, 0], cp=4, capacity=8, cost=cost)


def test_zigzag_pair_counts_by_loop():
    ids = torch.tensor([[0] * 5 + [1] * 9 + [2] * 2, [3] * 16])
    for cp in (1, 2, 4):
        expected = [0] * cp
        for r in range(cp):
            pos = zigzag_split(torch.arange(16), r, cp, dim=0).tolist()
            for b in range(2):
                for t in pos:
                    expected[r] += sum(1 for j in range(t + 1) if ids[b, j] == ids[b, t])
        assert zigzag_pair_counts(ids, cp) == expected


def test_dynamic_cp_refuses_tp_and_pp():
    with pytest.raises(ValueError, match="parallel.tp=2"):
        check_dynamic_cp(ParallelLayout(4, tp=2, cp=2))
    with pytest.raises(ValueError, match="parallel.pp=2"):
        check_dynamic_cp(ParallelLayout(4, pp=2, cp=2))
    with pytest.raises(ValueError, match="power of two"):
        check_dynamic_cp(ParallelLayout(3, cp=3))


# Three micro-batches of mixed lengths (2 rows of 16, padding included). With this cost
# and the memory of static cp (16 tokens per rank on cp 2, 8 on cp 4) the plans are:
# cp 2: two single ranks, two single ranks, the whole group; cp 4: two pairs, a pair and
# two single ranks, the whole group.
MICRO_BATCHES = [[[11, 2, 3], [1, 6, 4, 5]], [[5, 4], [3, 3, 7]], [[14], [3, 3, 7]]]
COST = CostModel(pair_flops=1.0, kv_token_cost=1.0)
PLAN_SIZES = {2: [[1, 1], [1, 1], [2]], 4: [[2, 2], [2, 1, 1], [4]]}


def _reference():
    config = _config()
    model = build_model(config, ProcessGroups.single_process())
    batches = [_packed_batch(row_docs=docs) for docs in MICRO_BATCHES]
    losses = forward_backward(model, batches, ProcessGroups.single_process(), config)
    return losses.sum().item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _dynamic_rank(rank, world, ep):
    config = _config(cp=world, ep=ep)
    groups = create_process_groups(ParallelLayout(world, cp=world, ep=ep))
    dcp = DynamicCP(groups, COST, capacity=2 * S // world)
    model = build_model(config, groups)
    batches = [_packed_batch(row_docs=docs) for docs in MICRO_BATCHES]
    losses = forward_backward(model, batches, groups, config, dynamic_cp=dcp)
    sync_grads(model.parameters(), groups)
    loss = losses.sum().clone()
    torch.distributed.all_reduce(loss, group=groups.dp_cp)
    plans = [[(g.start, g.size, g.docs) for g in dcp.plan(b).subgroups] for b in batches]
    return {"loss": loss.item() / world, "grads": _global_grads(model, groups), "plans": plans}


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4)])
def test_dynamic_cp_equals_one_process(world, ep):
    results = run_ranks(_dynamic_rank, world, ep, timeout=240)
    loss, grads = _reference()
    # The plans mix sub-group sizes: a long document on several ranks, short ones alone.
    assert [[g[1] for g in plan] for plan in results[0]["plans"]] == PLAN_SIZES[world], results[0]["plans"]
    for r in results:
        assert r["plans"] == results[0]["plans"]
        assert r["loss"] == pytest.approx(loss, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(r["grads"][name]), torch.from_numpy(g),
                                       rtol=1e-4, atol=1e-6, msg=name)

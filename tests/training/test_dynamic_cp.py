"""Dynamic context parallelism (issue 12): the partitions and the scheduler by hand, the
exact per-rank attention work of a zigzag split, and a packed micro-batch trained on
dynamic cp 2 and 4 giving one process's losses and gradients."""

import pytest
import torch

from moe_fold.training.dynamic_cp import (
    CostModel, DynamicCP, check_dynamic_cp, group_pair_counts, partitions, schedule, static_plan,
    zigzag_pair_counts,
)
from moe_fold.parallel.context_parallel import zigzag_split
from moe_fold.training.grads import sync_grads
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.model import build_model
from moe_fold.training.step import forward_backward

from tests.parallel.test_layout_invariance import _global_grads
from tests.models.test_mla import MLA_MODEL
from tests.parallel.test_varlen import _config, _packed_batch

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
    # One document of 16 and four of 4 on cp 4, 8 tokens per rank, pair_flops 1 and
    # kv_token_cost w = 4. Pairs per query: 1..16 in the long document, 1..4 in a short one.
    # - Whole group: 32 tokens in 8 chunks of 4 with pair sums 10, 26, 42, 58, 10, 10, 10, 10;
    #   rank r holds chunks r and 7-r: 20, 36, 52, 68 pairs, plus w*3*32/4 = 96 of traffic.
    # - {0,1} with the 16: 136/2 = 68 pairs each + w*1*16/2 = 32 -> 100; ranks 2 and 3 alone
    #   with two 4s each: 20. {2,3} as one pair costs 20 + 32 = 52: the same maximum and
    #   per-rank tokens, but more ranks in multi-rank groups, so the single ranks win.
    cost = CostModel(pair_flops=1.0, kv_token_cost=4.0)
    plan = schedule([16, 4, 4, 4, 4], cp=4, capacity=8, cost=cost)
    assert [(g.start, g.size, g.docs) for g in plan.subgroups] == [(0, 2, (0,)), (2, 1, (1, 3)), (3, 1, (2, 4))]
    assert plan.rank_cost == (100.0, 100.0, 20.0, 20.0)
    assert plan.rank_tokens == (8, 8, 8, 8)
    assert static_plan([16, 4, 4, 4, 4], 4, cost).rank_cost == (116.0, 132.0, 148.0, 164.0)
    assert plan.subgroup_of(3).docs == (2, 4)
    # One document of 32 needs the whole group (8 tokens per rank); the zigzag split gives
    # every rank chunks k and 7-k, 16*7 + 2*10 = 132 pairs.
    free = CostModel(pair_flops=1.0)
    whole = schedule([32], cp=4, capacity=8, cost=free)
    assert [(g.start, g.size) for g in whole.subgroups] == [(0, 4)] and whole.rank_cost == (132.0,) * 4
    # Memory: with 3 tokens per rank nothing fits.
    with pytest.raises(ValueError, match="capacity=3"):
        schedule([16, 4, 4, 4, 4], cp=4, capacity=3, cost=cost)
    with pytest.raises(ValueError, match="lengths"):
        schedule([16, 0], cp=4, capacity=8, cost=cost)


def test_documents_are_ordered_for_the_zigzag_split():
    # 924, 162, 72 in this order on 4 ranks: the long document's late queries land on ranks
    # 2 and 3. Each candidate order is scored by its largest rank; the plan keeps the best.
    lengths = [924, 162, 72]
    plan = schedule(lengths, cp=4, capacity=512, cost=CostModel(pair_flops=1.0))
    (group,) = plan.subgroups
    assert sorted(group.docs) == [0, 1, 2]
    given = max(group_pair_counts(lengths, 4))
    chosen = max(group_pair_counts([lengths[d] for d in group.docs], 4))
    assert chosen == max(plan.rank_cost) and chosen < 0.8 * given
    rising = [72, 162, 924]
    others = [rising, [924, 72, 162], [72, 924, 162], lengths]
    assert chosen <= min(max(group_pair_counts(o, 4)) for o in others)


def test_group_pair_counts_match_zigzag_of_the_padded_sequence():
    for lengths, c in (([5, 9, 2], 2), ([3], 4), ([7, 1, 6], 4), ([4, 4], 1)):
        total = sum(lengths)
        padded = total if c == 1 else -(-total // (2 * c)) * 2 * c
        runs = lengths + ([padded - total] if padded > total else [])
        ids = torch.repeat_interleave(torch.arange(len(runs)), torch.tensor(runs)).unsqueeze(0)
        assert group_pair_counts(lengths, c) == zigzag_pair_counts(ids, c)


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
    with pytest.raises(ValueError, match="parallel.dynamic_cp=true needs parallel.tp=1, got 2"):
        check_dynamic_cp(ParallelLayout(4, tp=2, cp=2))
    with pytest.raises(ValueError, match="parallel.dynamic_cp=true needs parallel.pp=1, got 2"):
        check_dynamic_cp(ParallelLayout(4, pp=2, cp=2))
    with pytest.raises(ValueError, match="power of two"):
        check_dynamic_cp(ParallelLayout(3, cp=3))


# Four micro-batches of mixed lengths (2 rows of 16, padding included). With this cost
# and the memory of static cp (16 tokens per rank on cp 2, 8 on cp 4) the plans are, by
# sub-group sizes: cp 2: ranks alone, alone, the whole group, alone; cp 4: two pairs (the
# documents of one reordered for the zigzag split), a pair for the longest document and two
# single ranks twice, two pairs.
MICRO_BATCHES = [[[11, 2, 3], [1, 6, 4, 5]], [[5, 4], [3, 3, 7]], [[14], [3, 3, 7]], [[16], [16]]]
COST = CostModel(pair_flops=1.0, kv_token_cost=1.0)
PLAN_SIZES = {2: [[1, 1], [1, 1], [2], [1, 1]], 4: [[2, 2], [2, 1, 1], [2, 1, 1], [2, 2]]}


def _reference(model_overrides=None):
    config = _config(model_overrides)
    model = build_model(config, ProcessGroups.single_process())
    batches = [_packed_batch(row_docs=docs) for docs in MICRO_BATCHES]
    losses = forward_backward(model, batches, ProcessGroups.single_process(), config)
    return losses.sum().item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


def _dynamic_rank(rank, world, ep, model_overrides=None):
    config = _config(model_overrides, cp=world, ep=ep)
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


# Issue 29's attention features on this 2-layer model: gpt-oss's (sinks, a sliding layer and
# a full one) and Llama-4's (a chunked rotary layer, a NoPE layer with temperature tuning).
GPTOSS_2 = dict(attention_sinks=True, sliding_window=3, local_attention_layers=[1, 0])
LLAMA4_2 = dict(attention_chunk=4, local_attention_layers=[1, 0], rope_layers=[1, 0], qk_norm=True,
                qk_norm_scope="l2", attn_temperature_tuning=True, attn_temperature_floor=2)


# DeepSeek Sparse Attention on MLA (top 3 keys, so documents of 4 tokens and more select):
# GLM-5's form (layer 1 shares layer 0's selection) in the sparse stage, and the dense
# warm-up; each trains its indexer by the KL, weighted 0.5, over the real queries.
DSA_2 = dict(MLA_MODEL, dsa=True, index_n_heads=3, index_head_dim=6, index_topk=3, dsa_indexer_loss_weight=0.5,
             index_rope_interleave=True, indexer_types=["full", "shared"])
DSA_WARMUP_2 = dict(MLA_MODEL, dsa=True, index_n_heads=3, index_head_dim=6, index_topk=3,
                    dsa_indexer_loss_weight=0.5, dsa_stage="dense_warmup")


@pytest.mark.parametrize("world,ep,model_overrides", [(2, 2, None), (4, 4, None), (2, 2, MLA_MODEL),
                                                      (2, 2, GPTOSS_2), (2, 2, LLAMA4_2), (2, 2, DSA_2),
                                                      (4, 4, DSA_WARMUP_2)],
                         ids=["cp2", "cp4", "mla-cp2", "gptoss-attention-cp2", "llama4-attention-cp2",
                              "dsa-glm5-cp2", "dsa-warmup-cp4"])
def test_dynamic_cp_equals_one_process(world, ep, model_overrides):
    results = run_ranks(_dynamic_rank, world, ep, model_overrides, timeout=240)
    loss, grads = _reference(model_overrides)
    # The plans mix sub-group sizes: a long document on several ranks, short ones alone.
    assert [[g[1] for g in plan] for plan in results[0]["plans"]] == PLAN_SIZES[world], results[0]["plans"]
    for r in results:
        assert r["plans"] == results[0]["plans"]
        assert r["loss"] == pytest.approx(loss, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(r["grads"][name]), torch.from_numpy(g),
                                       rtol=1e-4, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- the training loop

def _train_rank(rank, world, config):
    """The losses, and the sub-group sizes of every plan this rank ran (recorded by
    wrapping DynamicCP.shard in this rank's process)."""
    from moe_fold.training import dynamic_cp
    from moe_fold.training.train import train

    plans, shard = [], dynamic_cp.DynamicCP.shard

    def recording_shard(self, batch):
        out = shard(self, batch)
        plans.append([g.size for g in out[2].subgroups])
        return out

    dynamic_cp.DynamicCP.shard = recording_shard
    return train(config).losses, plans


def _train_config(tmp_path, name, *extra):
    import json as _json

    from moe_fold.config import load_config

    docs = tmp_path / "docs.jsonl"
    if not docs.exists():
        # Documents of 3-19 tokens against 16 tokens per rank: packed micro-batches hold a
        # mix that some plans split (a long one cannot be split; with 3-60 tokens, the
        # loader's Feistel order put no short enough mix in the first 4 micro-batches).
        gen = torch.Generator().manual_seed(3)
        lengths = torch.randint(3, 20, (60,), generator=gen).tolist()
        docs.write_text("".join(_json.dumps({"text": "".join(chr(97 + (i * 7 + j) % 26) for j in range(n))}) + "\n"
                                for i, n in enumerate(lengths)))
    return load_config("mixtral-tiny", [
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=64", "model.seq_length=32", "moe.ffn_hidden_size=32",
        "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=2", "train.save_every=1000",
        "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1", "data.packing=true",
        f"data.path={docs}",
        f"data.cache_dir={tmp_path / 'cache'}", f"train.run_dir={tmp_path / name}", *extra])


def test_training_with_dynamic_cp_matches_one_process(tmp_path):
    """Two steps of `train` with data.packing on dynamic cp 4 (ep 2) take the losses of one
    process on the same global batches."""
    from moe_fold.training.train import train
    one = train(_train_config(tmp_path, "one"))
    four = run_ranks(_train_rank, 4, _train_config(tmp_path, "four", "parallel.cp=4", "parallel.ep=2",
                                                   "parallel.dynamic_cp=true"), timeout=300)
    for losses, plans in four:
        assert losses == pytest.approx(one.losses, rel=2e-5)
        # 2 steps x 2 micro-batches, and dynamic cp did split the group somewhere.
        assert len(plans) == 4 and any(sizes != [4] for sizes in plans), plans


def test_config_refuses_dynamic_cp_with_tp():
    from moe_fold.config import ConfigError, load_config, validate

    config = load_config("mixtral-tiny", ["parallel.dynamic_cp=true", "parallel.cp=2", "parallel.tp=2",
                                          "parallel.sequence_parallel=true"])
    with pytest.raises(ConfigError, match="parallel.dynamic_cp=true needs parallel.tp=1"):
        validate(config, 4)
    config = load_config("mixtral-tiny", ["parallel.dynamic_cp=true", "parallel.cp=3"])
    with pytest.raises(ConfigError, match="power of two"):
        validate(config, 3)

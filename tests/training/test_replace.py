"""Re-placing experts during training (moe.replace_every, moe.replicas): the math does not
change, the moves are logged, checkpoints saved after a move load under any layout and
placement, and resuming across a move is exact."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moe_fold.dispatch.placement import Placement
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.model import build_model
from moe_fold.parallel.sharding import full_tensor, shard_info
from moe_fold.training.checkpoint import latest_checkpoint, load_checkpoint, read_index
from moe_fold.training.optim import build_optimizer
from moe_fold.training.metrics import read_wandb_history
from moe_fold.training.replace import moe_layers
from moe_fold.training.train import read_metrics, train
from tests.dispatch.test_placement import _place_randomly
from tests.training.test_train import _train_rank, small_config

DET = ["train.steps=6", "train.deterministic=true", "optimizer.warmup_steps=2", "train.save_every=3"]


def _moves(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if r.get("replace_moves")}


def test_replacing_keeps_the_losses_bit_for_bit(tmp_path, cache_dir):
    """ep4 on 4 ranks: re-placing every 2 steps gives the losses and gradient norms of never
    re-placing, bit for bit; with a spare slot per rank (copies change the grouped GEMMs' row counts)
    within float32 rounding. The moves are in metrics.jsonl."""
    ep4 = ["parallel.ep=4"]
    static = run_ranks(_train_rank, 4, small_config(tmp_path / "static", cache_dir, *DET, *ep4), timeout=300)[0]
    moved = run_ranks(_train_rank, 4, small_config(tmp_path / "moved", cache_dir, *DET, *ep4, "moe.replace_every=2"),
                      timeout=300)[0]
    assert moved.losses == static.losses
    # The norm counts every global expert once in expert order: the same bits in any placement.
    assert [r["grad_norm"] for r in read_metrics(tmp_path / "moved")] == \
        [r["grad_norm"] for r in read_metrics(tmp_path / "static")]
    moves = _moves(tmp_path / "moved")
    assert moves, "no re-placement happened"
    for step, record in moves.items():
        assert step % 2 == 0 and record["replace_bytes"] > 0
        for layer in record["placement"].values():
            assert layer["busiest_over_mean_after"] < layer["busiest_over_mean_before"]
            assert all(0 <= src < 4 and 0 <= dst < 4 and src != dst for _, src, dst in layer["moved"])
    copies = run_ranks(_train_rank, 4, small_config(tmp_path / "copies", cache_dir, *DET, *ep4, "moe.replicas=1",
                                                    "moe.replace_every=2"), timeout=300)[0]
    assert copies.losses == pytest.approx(static.losses, rel=1e-5)
    assert _moves(tmp_path / "copies")


def test_replacing_under_bf16_keeps_the_losses_bit_for_bit(tmp_path, cache_dir):
    """bf16 weights with float32 masters: both move, the losses do not change. The moves
    reach the (offline) wandb run too."""
    opts = [*DET, "parallel.ep=2", "train.precision=bf16"]
    static = run_ranks(_train_rank, 2, small_config(tmp_path / "static", cache_dir, *opts), timeout=300)[0]
    moved = run_ranks(_train_rank, 2, small_config(tmp_path / "moved", cache_dir, *opts, "moe.replace_every=2",
                                                   "wandb.mode=offline"), timeout=300)[0]
    assert moved.losses == static.losses
    moves = _moves(tmp_path / "moved")
    assert moves
    logged = {row["_step"]: row for row in read_wandb_history(moved.wandb_dir) if "replace_moves" in row}
    assert {step: (r["replace_moves"], r["replace_bytes"]) for step, r in moves.items()} == \
        {step: (row["replace_moves"], row["replace_bytes"]) for step, row in logged.items() if row["replace_moves"]}


def test_replacing_under_zero1_keeps_the_losses(tmp_path, cache_dir):
    """ep2 x edp2 with the distributed optimizer: the moments move with their experts."""
    opts = [*DET, "parallel.ep=2", "optimizer.distributed=true"]
    static = run_ranks(_train_rank, 4, small_config(tmp_path / "static", cache_dir, *opts), timeout=300)[0]
    moved = run_ranks(_train_rank, 4, small_config(tmp_path / "moved", cache_dir, *opts, "moe.replace_every=2",
                                                   "moe.replicas=1"), timeout=300)[0]
    assert moved.losses == pytest.approx(static.losses, rel=1e-5)
    assert _moves(tmp_path / "moved")


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_replacing_under_pp_keeps_the_losses_bit_for_bit(tmp_path, cache_dir, dispatcher):
    """pp2 x ep2: each stage moves its own layers; the record lists every stage's. The
    all-gather dispatcher sums a token's rows per rank first: with top-2 that is one order."""
    opts = [*DET, "parallel.pp=2", "parallel.ep=2", f"moe.dispatcher={dispatcher}"]
    static = run_ranks(_train_rank, 4, small_config(tmp_path / "static", cache_dir, *opts), timeout=300)[0]
    moved = run_ranks(_train_rank, 4, small_config(tmp_path / "moved", cache_dir, *opts, "moe.replace_every=2"),
                      timeout=300)[0]
    assert moved.losses == static.losses
    layers = {name for record in _moves(tmp_path / "moved").values() for name in record["placement"]}
    assert layers == {"layer0", "layer1"}


def test_the_replacer_state_round_trips(tmp_path, cache_dir):
    """The load window (the loads since the last re-placement) and the placements go into
    the checkpoint and come back into a fresh replacer unchanged."""
    from moe_fold.training.replace import ExpertReplacer

    config = small_config(tmp_path, cache_dir, "moe.replace_every=4")
    groups = ProcessGroups.single_process()

    def replacer():
        model = build_model(config, groups)
        layers = sorted(moe_layers(model))
        return ExpertReplacer(config, [model], groups, build_optimizer(model, config.optimizer, groups), layers)
    saved = replacer()
    assert saved.after_step(1, [[5, 1, 0, 2, 9, 0, 0, 3], [0, 0, 7, 1, 1, 4, 2, 5]]) == {}
    assert saved.after_step(2, [[1, 0, 0, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 0, 0, 0]]) == {}
    state = saved.state_dict()
    assert state["window"] == [[6, 1, 0, 2, 9, 0, 0, 4], [2, 0, 7, 1, 1, 4, 2, 5]]
    assert state["placements"] == {"0": list(range(8)), "1": list(range(8))}
    loaded = replacer()
    loaded.load_state_dict(json.loads(json.dumps(state)))
    assert loaded.state_dict() == state


def _global_state(rank, world_size, config, path, replicas):
    """Load ``path`` into a model (a random placement with ``replicas`` copies per rank when
    ep > 1) and return every parameter and moment as a global tensor."""
    groups = ProcessGroups.single_process()
    if world_size > 1:
        p = config.parallel
        groups = create_process_groups(ParallelLayout(world_size, tp=p.tp, ep=p.ep, etp=p.etp))
    config.moe.replicas = replicas
    model = build_model(config, groups)
    if world_size > 1:
        _place_randomly(model, groups, replicas, seed=3)
    optimizer = build_optimizer(model, config.optimizer, groups)
    load_checkpoint(path, model, optimizer, None, groups)
    out = {}
    for name, param in model.named_parameters():
        info = shard_info(param, groups, name)
        out[name] = full_tensor(param.detach(), info, groups)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}/{name}"] = full_tensor(optimizer.state[param][key].view(param.shape), info, groups)
    out["placed"] = [layer.placement.slots for layer in moe_layers(model).values()]
    return out


def test_resume_across_a_move_is_exact_and_checkpoints_load_anywhere(tmp_path, cache_dir):
    """ep4 with a spare slot per rank, re-placing every 2 steps, saving every 3: 6 steps
    straight equal 3 steps (saved after the move of step 2) + a resume, bit for bit: the
    losses, and every step's ``placement``, ``replace_moves`` and ``replace_bytes`` (the
    step-4 re-placement needs step 3's load, which only the restored window holds), and
    the replacer's state in the step-6 checkpoint. The first part runs to step 4 and loses
    its step-4 checkpoint (a crash after the step's record): the resume starts from step 3
    and metrics.jsonl keeps one record per step. The step-3 checkpoint loads under one
    process and under ep2 x dp2 in a random placement with copies to the same global
    weights and moments; one process resumed from it continues with the losses of the
    straight run."""
    opts = [*DET, "parallel.ep=4", "moe.replicas=1", "moe.replace_every=2"]
    straight = run_ranks(_train_rank, 4, small_config(tmp_path / "straight", cache_dir, *opts), timeout=300)[0]
    run_ranks(_train_rank, 4, small_config(tmp_path / "split", cache_dir, *opts), stop_at=4, timeout=300)
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step_000004")
    shutil.copytree(tmp_path / "split", tmp_path / "one")
    second = run_ranks(_train_rank, 4, small_config(tmp_path / "split", cache_dir, *opts), resume=True,
                       timeout=300)[0]
    assert second.first_step == 4
    ref, got = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "split")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(ref, got):
        for key in ("placement", "replace_moves", "replace_bytes", "loss"):
            assert b.get(key) == a.get(key), (a["step"], key)
    assert straight.losses[:3] + second.losses == straight.losses
    assert {2, 4, 6} <= set(_moves(tmp_path / "split"))
    assert (read_index(tmp_path / "split" / "checkpoints" / "step_000006")["extra"]["experts"]
            == read_index(tmp_path / "straight" / "checkpoints" / "step_000006")["extra"]["experts"])

    path = latest_checkpoint(tmp_path / "one")
    assert path.name == "step_000003"
    one_cfg = small_config(tmp_path / "one", cache_dir, *DET)
    one = _global_state(0, 1, one_cfg, path, 0)
    two = run_ranks(_global_state, 2, small_config(tmp_path / "x", cache_dir, *DET, "parallel.ep=2"), path, 1,
                    timeout=300)
    assert all(slots != Placement.contiguous(8, 2, 1).slots for slots in two[0]["placed"])
    for name, value in one.items():
        if name != "placed":
            assert torch.equal(two[0][name], value), name
    resumed = train(one_cfg, resume=True)
    assert resumed.first_step == 4
    assert resumed.losses == pytest.approx(straight.losses[3:], rel=1e-5)

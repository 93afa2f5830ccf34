"""Checkpoints: a bit-exact round trip on one process (model, buffers, AdamW moments,
schedule, extra, random states), the atomic save and its leftovers, keep_last, corrupted
files; then resharding on 4 gloo ranks: saved under one layout, loaded under another, the
gathered global tensors equal the saved ones exactly and the next step's loss agrees."""

import json
import math
import logging
import os
import random
import warnings

import numpy as np
import pytest
import torch

from moe_fold.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from moe_fold.config import load_config
from moe_fold.launch import run_ranks
from moe_fold.layout import GROUP_NAMES, ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.experts import Experts
from moe_fold.models.model import build_model
from moe_fold.optim import AdamW, build_optimizer, build_scheduler
from moe_fold.sharding import box, flat_boxes, full_tensor, shard_info
from moe_fold.tensor_parallel import mark, shard_tp
from test_optim import _config, _step

ONE = ProcessGroups.single_process()


def _setup(config, groups):
    model = build_model(config, groups)
    opt = build_optimizer(model, config.optimizer, groups)
    return model, opt, build_scheduler(opt, config)


def _set_expert_bias(model):
    """A non-zero persistent buffer (the router's expert_bias), the same on every rank."""
    for name, b in model.named_buffers():
        if name.endswith("expert_bias"):
            b.copy_(torch.linspace(-0.5, 0.5, b.numel()))


def _trained(config, groups, steps=2):
    model, opt, sched = _setup(config, groups)
    with torch.no_grad():
        _set_expert_bias(model)
    for step in range(steps):
        _step(model, opt, sched, groups, step, config.optimizer.clip_grad)
    return model, opt, sched


def _draws():
    return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]


# --------------------------------------------------------------------------- sharding

def test_flat_boxes_cover_a_flat_range_with_contiguous_boxes():
    for shape in [(5,), (3, 4), (2, 3, 4), (1, 5, 1, 3), ()]:
        numbers = torch.arange(math.prod(shape)).reshape(shape)
        n = numbers.numel()
        for start in range(n + 1):
            for stop in range(start, n + 1):
                seen = []
                for offset, offsets, sizes in flat_boxes(shape, start, stop):
                    values = numbers[box(offsets, sizes)].reshape(-1).tolist()
                    assert values == list(range(offset, offset + len(values)))  # contiguous, where it says
                    seen += values
                assert seen == list(range(start, stop))


def _fake_groups(layout, rank):
    """Sizes and coordinates of ``rank`` without torch.distributed (enough to build and describe)."""
    return ProcessGroups(layout, rank, {name: None for name in GROUP_NAMES})


def test_pieces_place_every_rank_shard_in_the_global_tensor():
    """Experts (ep x etp, fused gate|up) as models/experts.py builds them, and fused tp
    weights as tensor_parallel.shard_tp cuts them, on each rank of tp2 x ep2 x etp2 (world 8)."""
    layout = ParallelLayout(8, tp=2, ep=2)  # etp 2, edp 2, dp 4
    gen = torch.Generator().manual_seed(0)
    dense = {"qkv": (torch.randn(16, 6, generator=gen), 0, [8, 4, 4]),  # q|k|v rows
             "proj": (torch.randn(6, 8, generator=gen), 1, [8])}
    full = {n: p.detach() for n, p in Experts(4, 6, 8, ONE, std=1.0, seed=3, name="e").named_parameters()}
    full.update({n: value for n, (value, _, _) in dense.items()})
    written = {n: torch.zeros(v.shape, dtype=torch.int64) for n, v in full.items()}
    for rank in range(8):
        groups = _fake_groups(layout, rank)
        local = dict(Experts(4, 6, 8, groups, std=1.0, seed=3, name="e").named_parameters())
        for n, (value, dim, parts) in dense.items():
            shard = shard_tp(value, dim, parts, groups.rank_in("tp"), 2)
            local[n] = mark(torch.nn.Parameter(shard), "tp", tp_dim=dim, tp_parts=parts)
        for name, p in local.items():
            info = shard_info(p, groups, name)
            assert info.global_shape == tuple(full[name].shape), name
            assert sum(math.prod(piece.sizes) for piece in info.pieces) == p.numel()
            for piece in info.pieces:
                assert torch.equal(p.detach()[box(piece.local, piece.sizes)],
                                   full[name][box(piece.global_, piece.sizes)]), (rank, name)
                if info.writer:
                    written[name][box(piece.global_, piece.sizes)] += 1
    for name, count in written.items():
        assert (count == 1).all(), name  # each global element has exactly one writer


# --------------------------------------------------------------------------- one process

@pytest.mark.parametrize("moe", [False, True])
def test_round_trip_is_bit_exact_and_training_continues_identically(tmp_path, moe):
    config = _config(moe=moe)
    config.model.tie_embeddings = not moe  # a tied weight is stored once
    model, opt, sched = _trained(config, ONE)
    extra = {"data": {"consumed_samples": 8}, "note": "x"}
    path = save_checkpoint(tmp_path, 2, model, opt, sched, extra, ONE, keep_last=2)
    assert path == tmp_path / "checkpoints" / "step_000002" and latest_checkpoint(tmp_path) == path
    draws = _draws()
    index = json.loads((path / "index.json").read_text())
    assert (moe and "model/layers.1.mlp.router.expert_bias" in index["tensors"]) or not moe
    assert ("model/lm_head.weight" in index["tensors"]) == moe  # the tied head is the embedding
    assert load_config(path / "config.yaml") == config

    config.train.seed = 99  # a different initial model: everything must come from the file
    fresh, fresh_opt, fresh_sched = _setup(config, ONE)
    torch.manual_seed(0)
    assert load_checkpoint(tmp_path, fresh, fresh_opt, fresh_sched, ONE) == extra
    assert _draws() == draws  # random states restored
    assert fresh_opt.step_count == opt.step_count == 2 and fresh_sched.state_dict() == sched.state_dict()
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][moment], fresh_opt.state[q][moment])
    clip = config.optimizer.clip_grad
    assert _step(model, opt, sched, ONE, 2, clip) == _step(fresh, fresh_opt, fresh_sched, ONE, 2, clip)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_keep_last_and_resave_of_a_step(tmp_path):
    config = _config()
    model, opt, sched = _setup(config, ONE)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, opt, sched, {"step": step}, ONE, keep_last=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000003", "step_000004"]
    save_checkpoint(tmp_path, 4, model, opt, sched, {"again": True}, ONE, keep_last=2)
    assert load_checkpoint(tmp_path, model, opt, sched, ONE) == {"again": True}
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000003", "step_000004"]
    with pytest.raises(ValueError, match="keep_last=0"):
        save_checkpoint(tmp_path, 5, model, opt, sched, {}, ONE, keep_last=0)
    with pytest.raises(ValueError, match="extra must be JSON"):
        save_checkpoint(tmp_path, 5, model, opt, sched, {"t": torch.ones(1)}, ONE, keep_last=2)


def test_crash_mid_save_leaves_previous_checkpoint_and_leftovers_are_ignored_then_removed(
        tmp_path, monkeypatch, caplog):
    config = _config()
    model, opt, sched = _setup(config, ONE)
    good = save_checkpoint(tmp_path, 1, model, opt, sched, {"good": 1}, ONE, keep_last=3)

    def crash(*args):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError, match="disk gone"):
        save_checkpoint(tmp_path, 2, model, opt, sched, {"good": 2}, ONE, keep_last=3)
    monkeypatch.undo()
    leftover = [p for p in os.listdir(tmp_path / "checkpoints") if ".tmp-" in p]
    assert len(leftover) == 1 and leftover[0].startswith("step_000002.tmp-")
    (tmp_path / "checkpoints" / "step_000009").mkdir()  # a step directory without index.json
    with caplog.at_level(logging.WARNING, logger="moe_fold.checkpoint"):
        assert latest_checkpoint(tmp_path) == good
    assert leftover[0] in caplog.text and "step_000009" in caplog.text
    assert load_checkpoint(tmp_path, model, opt, sched, ONE) == {"good": 1}
    save_checkpoint(tmp_path, 3, model, opt, sched, {}, ONE, keep_last=3)
    assert not (tmp_path / "checkpoints" / leftover[0]).exists()


def test_corrupt_truncated_and_mismatched_checkpoints_fail_clearly(tmp_path):
    config = _config()
    model, opt, sched = _setup(config, ONE)
    path = save_checkpoint(tmp_path, 1, model, opt, sched, {}, ONE, keep_last=1)
    shard = path / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors is corrupt: sha256"):
        load_checkpoint(path, model, opt, sched, ONE)
    shard.write_bytes(bytes(data[:-100]))
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors has \d+ bytes, index.json says"):
        load_checkpoint(path, model, opt, sched, ONE)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path / "nothing", model, opt, sched, ONE)

    path = save_checkpoint(tmp_path, 2, model, None, None, {}, ONE, keep_last=1)
    with pytest.raises(CheckpointError, match="saved without optimizer state"):
        load_checkpoint(path, model, opt, sched, ONE)
    other = _config()
    other.model.qk_norm = False
    with pytest.raises(CheckpointError, match=r"unexpected \['model/layers.0.attn.k_norm.weight'"):
        load_checkpoint(path, build_model(other, ONE), None, None, ONE)
    other = _config()
    other.model.vocab_size = 32
    with pytest.raises(CheckpointError, match=r"model/embed.weight: the checkpoint's global shape \[64, 32\]"):
        load_checkpoint(path, build_model(other, ONE), None, None, ONE)


def test_zero_dim_parameter_and_sharded_moments_round_trip(tmp_path):
    def toy():
        m = torch.nn.Module()
        m.gain = mark(torch.nn.Parameter(torch.tensor(1.5)), "replicated")
        m.w = mark(torch.nn.Parameter(torch.arange(6.0).view(3, 2)), "tp", tp_dim=0, tp_parts=[3])
        return m

    m = toy()
    opt = AdamW(m.parameters(), lr=0.1, weight_decay=0.1, groups=ONE, distributed=True)
    m.gain.grad, m.w.grad = torch.tensor(2.0), torch.ones(3, 2)
    opt.step()
    save_checkpoint(tmp_path, 1, m, opt, None, {}, ONE, keep_last=1)
    fresh = toy()
    fresh_opt = AdamW(fresh.parameters())  # unsharded now
    load_checkpoint(tmp_path, fresh, fresh_opt, None, ONE)
    for p, q in zip(m.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][moment].view(-1), fresh_opt.state[q][moment].view(-1))
    assert fresh_opt.state[fresh.gain]["exp_avg"].item() == pytest.approx(0.2)


# --------------------------------------------------------------------------- resharding

# (saved layout, loaded layout), each (model kind, tp, ep, etp, distributed optimizer)
RESHARD = [
    (dict(tp=2, distributed=True), dict(tp=1)),  # dense tp2 x dp2 (ZeRO) -> dp4
    (dict(tp=1), dict(tp=2, sp=True, distributed=True)),  # dense dp4 -> tp2 x dp2 (ZeRO)
    (dict(moe=True, ep=2, distributed=True), dict(moe=True, ep=4)),  # ep2 x dp2 (ZeRO) -> ep4
    (dict(moe=True, ep=2), dict(moe=True, tp=2, sp=True, ep=2, distributed=True)),  # -> tp2 x etp2 x ep2
    (dict(moe=True, ep=2, distributed=True), dict(moe=True, ep=2, distributed=True)),  # resume: same layout
]


def _groups(world_size, case):
    return create_process_groups(ParallelLayout(world_size, tp=case.get("tp", 1), ep=case.get("ep", 1),
                                                etp=case.get("etp")))


def _global(model, groups):
    return {n: full_tensor(p.detach(), shard_info(p, groups, n), groups).numpy()
            for n, p in model.named_parameters()}


def _reshard_rank(rank, world_size, root, pairs):
    out = []
    for i, (saved, loaded) in enumerate(pairs):
        groups = _groups(world_size, saved)
        config = _config(**saved)
        model, opt, sched = _trained(config, groups)
        save_checkpoint(f"{root}/saved{i}", 2, model, opt, sched, {"consumed_samples": 8}, groups, keep_last=1)
        before = _global(model, groups)
        next_loss = _step(model, opt, sched, groups, 2, config.optimizer.clip_grad)
        next_params = _global(model, groups)
        draws = _draws()

        groups = _groups(world_size, loaded)
        config = _config(**loaded)
        model, opt, sched = _setup(config, groups)
        if saved == loaded:
            torch.manual_seed(1000 + rank)  # to be undone by the restored random states
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                extra = load_checkpoint(f"{root}/saved{i}", model, opt, sched, groups)
        else:
            with pytest.warns(UserWarning, match="random states are not restored"):
                extra = load_checkpoint(f"{root}/saved{i}", model, opt, sched, groups)
        loaded_params = _global(model, groups)
        # saved again from the new layout: a one-process load compares the moments
        save_checkpoint(f"{root}/resaved{i}", 2, model, opt, sched, extra, groups, keep_last=1)
        loaded_loss = _step(model, opt, sched, groups, 2, config.optimizer.clip_grad)
        same_next_params = all((v == next_params[n]).all() for n, v in _global(model, groups).items())
        out.append(dict(before=before, loaded=loaded_params, extra=extra, next_loss=next_loss,
                        loaded_loss=loaded_loss, same_draws=_draws() == draws, same_next_params=same_next_params))
    return out


def _one_process_state(path, moe):
    model, opt, sched = _setup(_config(moe=moe), ONE)
    with pytest.warns(UserWarning, match="random states are not restored"):
        extra = load_checkpoint(path, model, opt, sched, ONE)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for moment in ("exp_avg", "exp_avg_sq"):
            state[f"{moment}/{n}"] = opt.state[p][moment].clone()
    for n, b in model.named_buffers():
        if n.endswith("expert_bias"):
            state[n] = b.clone()
    return state, extra, opt.step_count, sched.state_dict()


def test_checkpoint_saved_under_one_layout_loads_under_another(tmp_path):
    results = run_ranks(_reshard_rank, 4, str(tmp_path), RESHARD, timeout=240)
    for i, ((saved, loaded), got) in enumerate(zip(RESHARD, results[0])):
        moe = saved.get("moe", False)
        assert got["extra"] == {"consumed_samples": 8}
        for name, value in got["before"].items():
            assert (got["loaded"][name] == value).all(), (saved, loaded, name)
        assert got["loaded_loss"] == pytest.approx(got["next_loss"], abs=1e-5), (saved, loaded)
        if saved == loaded:  # a resumed run continues exactly, random states included
            assert got["loaded_loss"] == got["next_loss"] and got["same_draws"] and got["same_next_params"]
        state, extra, step_count, sched_state = _one_process_state(tmp_path / f"saved{i}", moe)
        again, _, again_count, again_sched = _one_process_state(tmp_path / f"resaved{i}", moe)
        assert (step_count, sched_state) == (again_count, again_sched) == (2, {"step": 2})
        for name, value in got["before"].items():
            assert torch.equal(state[name], torch.from_numpy(value)), name
        assert state.keys() == again.keys()
        for name, value in state.items():
            assert torch.equal(value, again[name]), (saved, loaded, name)
        if moe:
            assert torch.equal(state["layers.1.mlp.router.expert_bias"], torch.linspace(-0.5, 0.5, 4))
    for r in results[1:]:
        for a, b in zip(r, results[0]):
            assert a["loaded_loss"] == b["loaded_loss"]


# --------------------------------------------------------------------------- pipeline parallel

def _tied_pp_save_rank(rank, world_size, root):
    config = _config()
    config.model.tie_embeddings, config.parallel.pp = True, 2
    groups = create_process_groups(ParallelLayout(world_size, pp=2))
    model, opt, sched = _setup(config, groups)
    save_checkpoint(root, 1, model, opt, sched, {}, groups, keep_last=1)


def test_pipeline_checkpoint_writes_a_tied_embedding_once(tmp_path):
    run_ranks(_tied_pp_save_rank, 2, str(tmp_path), timeout=120)
    index = json.loads((tmp_path / "checkpoints" / "step_000001" / "index.json").read_text())
    for name in ("model/embed.weight", "optim/exp_avg/embed.weight", "optim/exp_avg_sq/embed.weight"):
        files = {piece["file"] for piece in index["tensors"][name]["pieces"]}
        assert files == {"rank_00000.safetensors"}, name  # the first stage only
    assert "model/lm_head.weight" not in index["tensors"]

"""Checkpoints: a bit-exact round trip on one process (model, buffers, AdamW moments,
schedule, extra, random states), the atomic save and its leftovers, keep_last, corrupted
files; then resharding on 4 gloo ranks: saved under one layout, loaded under another, the
gathered global tensors equal the saved ones exactly and the next step's loss agrees; the
same across pipeline layouts (pp, interleaved vpp, tied embeddings) on 2 and 4 ranks,
where a same-layout resume continues bit for bit; the streamed file reads back with the
safetensors library, and saving adds no copy of the state to the peak memory."""

import hashlib
import json
import logging
import os
import random
import resource
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from moe_fold.training.checkpoint import (
    CheckpointError, _write_safetensors, latest_checkpoint, load_checkpoint, save_checkpoint,
)
from moe_fold.comm import all_reduce_
from moe_fold.config import Config, ModelConfig, load_config
from moe_fold.data.loader import Batch
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.model import build_model
from moe_fold.training.optim import AdamW, apply_gradients, build_optimizer, build_scheduler
from moe_fold.parallel.sharding import full_tensor, shard_info
from moe_fold.training.step import forward_backward
from moe_fold.parallel.tensor_parallel import mark
from tests.helpers.pipeline_union import unite_over_pp
from tests.training.test_optim import SEQ, VOCAB, _config, _step

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
    with caplog.at_level(logging.WARNING, logger="moe_fold.training.checkpoint"):
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


def _one_process_state(path, moe=False, config=None):
    model, opt, sched = _setup(config or _config(moe=moe), ONE)
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

PP_ROWS = 8  # global batch rows: 2 micro-batches on each of up to 4 dp ranks


def _pp_config(pp=1, vpp=1, tp=1, ep=1, moe=False, distributed=False, tied=True, num_layers=4):
    """test_optim's tiny model with 4 layers (1 dense then MoE with ``moe``), split over
    ``pp`` stages (``vpp`` chunks each: the interleaved schedule)."""
    config = _config(tp=tp, sp=tp > 1, distributed=distributed, ep=ep, moe=moe)
    config.model.num_layers, config.model.tie_embeddings = num_layers, tied
    config.parallel.pp, config.parallel.vpp = pp, vpp
    config.parallel.pp_schedule = "interleaved" if vpp > 1 else "1f1b"
    return config


def _pp_groups(world_size, config):
    p = config.parallel
    return create_process_groups(ParallelLayout(world_size, tp=p.tp, ep=p.ep, pp=p.pp))


def _pp_micro_batches(step, groups):
    """This dp rank's two micro-batches of the global batch of ``step`` (every stage of a
    pipeline passes the same ones)."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (PP_ROWS, SEQ + 1), generator=gen)
    mask = (torch.rand(PP_ROWS, SEQ, generator=gen) > 0.2).float()
    size = PP_ROWS // groups.size("dp") // 2
    out = []
    for i in range(2):
        lo = (groups.rank_in("dp") * 2 + i) * size
        rows = tokens[lo:lo + size]
        out.append(Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), mask[lo:lo + size],
                         torch.arange(SEQ).expand(size, SEQ).contiguous(),
                         torch.arange(0, size * SEQ + 1, SEQ, dtype=torch.int32)))
    return out


def _pp_step(model, opt, sched, groups, config, step):
    """One training step as moe_fold.training.train runs it; returns the global-batch loss."""
    losses = forward_backward(model, _pp_micro_batches(step, groups), groups, config)
    apply_gradients(model.parameters(), opt, groups, config.optimizer.clip_grad)
    opt.zero_grad()
    sched.step()
    return all_reduce_(losses.sum(), groups.dp_cp).item() / groups.size("dp_cp")


def _pp_global(model, groups):
    """The whole model's global parameters on every rank: each stage's, united over pp
    (the two copies of a tied embedding must be equal)."""
    return unite_over_pp({n: full_tensor(p.detach(), shard_info(p, groups, n), groups)
                          for n, p in model.named_parameters()}, groups)


def _pp_rank(rank, world_size, root, pairs):
    """For each (saved, loaded) pair of configs: train 2 steps under ``saved``, save, take
    one more step; then build ``loaded``, load, take the same step."""
    out = []
    for i, (saved, loaded) in enumerate(pairs):
        path = f"{root}/saved{i}"
        groups = _pp_groups(world_size, saved)
        model, opt, sched = _setup(saved, groups)
        losses = [_pp_step(model, opt, sched, groups, saved, step) for step in range(2)]
        save_checkpoint(path, 2, model, opt, sched, {"consumed_samples": 16}, groups, keep_last=1)
        before = _pp_global(model, groups)
        next_loss = _pp_step(model, opt, sched, groups, saved, 2)
        next_params = _pp_global(model, groups)
        draws = _draws()

        groups = _pp_groups(world_size, loaded)
        model, opt, sched = _setup(loaded, groups)
        same = saved == loaded
        torch.manual_seed(1000 + rank)  # undone by the restored random states when the layout is the same
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extra = load_checkpoint(path, model, opt, sched, groups)
        restored = not any("random states are not restored" in str(w.message) for w in caught)
        loaded_params = _pp_global(model, groups)
        save_checkpoint(f"{root}/resaved{i}", 2, model, opt, sched, extra, groups, keep_last=1)
        loaded_loss = _pp_step(model, opt, sched, groups, loaded, 2)
        same_next = same and all(torch.equal(v, next_params[n]) for n, v in _pp_global(model, groups).items())
        result = dict(losses=losses, next_loss=next_loss, loaded_loss=loaded_loss, extra=extra,
                      restored=restored, same_draws=_draws() == draws, same_next_params=same_next)
        if rank == 0:
            result.update(before=before, loaded=loaded_params)
        out.append(result)
    return out


def _check_pp_results(root, pairs, results):
    for i, ((saved, loaded), got) in enumerate(zip(pairs, results[0])):
        what = (i, saved.parallel, loaded.parallel)
        assert got["extra"] == {"consumed_samples": 16}
        assert got["before"].keys() == got["loaded"].keys(), what
        for name, value in got["before"].items():
            assert torch.equal(got["loaded"][name], value), (what, name)
        assert got["loaded_loss"] == pytest.approx(got["next_loss"], abs=1e-5), what
        if saved == loaded:  # a resumed run continues exactly, random states included
            assert got["restored"] and got["same_draws"] and got["same_next_params"], what
            assert got["loaded_loss"] == got["next_loss"], what
        else:
            assert not got["restored"], what
        # Both checkpoints, read by the one-process model: the same parameters, moments and
        # buffers, and the parameters are the ones the saving layout held.
        one = _pp_config(moe=saved.moe.moe_layer_freq != 0, tied=saved.model.tie_embeddings)
        state, extra, step_count, sched_state = _one_process_state(f"{root}/saved{i}", config=one)
        again, _, again_count, again_sched = _one_process_state(f"{root}/resaved{i}", config=one)
        assert (step_count, sched_state) == (again_count, again_sched) == (2, {"step": 2})
        for name, value in got["before"].items():
            assert torch.equal(state[name], value), (what, name)
        assert state.keys() == again.keys()
        for name, value in state.items():
            assert torch.equal(value, again[name]), (what, name)
        for r in results[1:]:
            assert r[i]["loaded_loss"] == got["loaded_loss"] and r[i]["losses"] == got["losses"], what


def _stage_files(pp_rank, layout):
    """The checkpoint files of the ranks of pipeline stage ``pp_rank``."""
    return {f"rank_{r:05d}.safetensors" for r in range(layout.world_size)
            if layout.coords(r)["pp"] == pp_rank}


def _refuse_other_models_rank(rank, world_size, root):
    """A pp2 checkpoint of a tied model: the copy is written once, and loading refuses a
    model with other tensors, or more layers, on every rank."""
    config = _pp_config(pp=2, num_layers=2)
    groups = _pp_groups(world_size, config)
    model, opt, sched = _setup(config, groups)
    path = save_checkpoint(root, 1, model, opt, sched, {}, groups, keep_last=1)
    errors = []
    for change in ("model.qk_norm=false", "model.num_layers=4"):
        other = _pp_config(pp=2, num_layers=4 if "num_layers" in change else 2)
        other.model.qk_norm = "qk_norm" not in change
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path, build_model(other, groups), None, None, groups)
        errors.append(str(info.value))
    return errors


def test_pipeline_checkpoint_writes_a_tied_embedding_once_and_refuses_other_models(tmp_path):
    errors = run_ranks(_refuse_other_models_rank, 2, str(tmp_path), timeout=120)
    index = json.loads((tmp_path / "checkpoints" / "step_000001" / "index.json").read_text())
    layout = ParallelLayout(2, pp=2)
    for name in ("model/embed.weight", "optim/exp_avg/embed.weight", "optim/exp_avg_sq/embed.weight"):
        files = {piece["file"] for piece in index["tensors"][name]["pieces"]}
        assert files == _stage_files(0, layout), name  # the first stage only
    assert "model/lm_head.weight" not in index["tensors"]
    assert errors[0] == errors[1]  # both stages take the same decision
    fewer, more = errors[0]
    assert "missing [], unexpected ['model/layers.0.attn.k_norm.weight', 'model/layers.0.attn.q_norm" in fewer
    assert "missing ['model/layers.2.attn.k_norm.weight'" in more and more.endswith("unexpected []")


# (saved, loaded) on 2 ranks: tied embeddings, interleaved vpp2, to pp1 x dp2 and back
PP2_PAIRS = [
    (_pp_config(pp=2, vpp=2), _pp_config(pp=2, vpp=2)),  # resume: same layout
    (_pp_config(pp=2, vpp=2), _pp_config()),
    (_pp_config(distributed=True), _pp_config(pp=2)),
]

# (saved, loaded) on 4 ranks: MoE stages with another tp / ep, ZeRO, to and from pp1
PP4_PAIRS = [
    (_pp_config(pp=2, ep=2, moe=True, distributed=True), _pp_config(pp=2, ep=2, moe=True, distributed=True)),
    (_pp_config(pp=2, tp=2, moe=True), _pp_config(pp=2, ep=2, moe=True, distributed=True)),
    (_pp_config(pp=2, ep=2, moe=True, distributed=True), _pp_config(tp=2, ep=2, moe=True)),
    (_pp_config(ep=4, moe=True), _pp_config(pp=2, vpp=2, tp=2, moe=True, distributed=True)),
]


def test_pipeline_checkpoints_reshard_and_resume_on_2_ranks(tmp_path):
    results = run_ranks(_pp_rank, 2, str(tmp_path), PP2_PAIRS, timeout=240)
    _check_pp_results(tmp_path, PP2_PAIRS, results)


@pytest.mark.slow
def test_pipeline_checkpoints_reshard_and_resume_on_4_ranks(tmp_path):
    results = run_ranks(_pp_rank, 4, str(tmp_path), PP4_PAIRS, timeout=400)
    _check_pp_results(tmp_path, PP4_PAIRS, results)


# --------------------------------------------------------------------------- writing without a copy

def test_streamed_safetensors_file_reads_back_with_the_safetensors_library(tmp_path):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=gen)
    tensors = [("f32#0", base), ("rows#0", base[1:3]), ("cols#0", base[:, 2:5]),  # a view, and a strided one
               ("bf16#0", base.to(torch.bfloat16)), ("f64#0", base.double()[0]), ("scalar#0", torch.tensor(2.5)),
               ("i64#0", torch.arange(5)), ("mask#0", base > 0), ("empty#0", torch.zeros(0, 3))]
    record = _write_safetensors(tmp_path / "x.safetensors", tensors)
    data = (tmp_path / "x.safetensors").read_bytes()
    assert record == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == dict(tensors).keys()
    for key, t in tensors:
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
    with pytest.raises(CheckpointError, match=r"c#0: dtype torch.complex64 cannot be stored"):
        _write_safetensors(tmp_path / "y.safetensors", [("c#0", torch.zeros(2, dtype=torch.complex64))])


def test_save_adds_no_copy_of_the_model_to_peak_memory(tmp_path):
    """Saving streams the live tensors to the file: the peak RSS grows by far less than the
    state saved (copying the state before writing it would double it)."""
    config = Config()
    config.model = ModelConfig(vocab_size=4096, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                               ffn_hidden_size=512, seq_length=16)
    config.moe.num_experts, config.moe.topk, config.moe.ffn_hidden_size = 8, 2, 512
    model, opt, _ = _setup(config, ONE)
    state = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # weights and two moments
    assert state > 100 * 2**20
    with open("/proc/self/clear_refs", "w") as f:  # the peak RSS starts again from the current RSS
        f.write("5")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    save_checkpoint(tmp_path, 0, model, opt, None, {}, ONE, keep_last=1)
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert extra < 0.1 * state, (extra, state)

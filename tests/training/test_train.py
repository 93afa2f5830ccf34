"""The training loop: layouts agree with one process, the loss falls, metrics.jsonl and
the offline wandb run hold the scalars, recompute and precision modes. The command
`moe-fold train`: tests/cli/test_train.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moe_fold.config import load_config
from moe_fold.launch import run_ranks
from moe_fold.training.metrics import read_wandb_history
from moe_fold.training.optim import lr_at
from moe_fold.training.train import read_metrics, train

# A small Mixtral-style model: 2 MoE layers of 8 experts, top-2, aux and z losses on.
SMALL = [
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "model.seq_length=32", "moe.ffn_hidden_size=64",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.save_every=1000",
    "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1",
]


def small_config(run_dir, cache_dir, *extra):
    return load_config("mixtral-tiny", SMALL + [f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", *extra])


def _train_rank(rank, world_size, config, **kwargs):
    return train(config, **kwargs)


# --------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("layout, data", [
    (["parallel.ep=2"], []),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=1"], []),
    pytest.param(["parallel.pp=2", "parallel.ep=2"], [], marks=pytest.mark.slow),
    pytest.param(["parallel.cp=2", "parallel.ep=2"], [], marks=pytest.mark.slow),
    pytest.param(["parallel.ep=2"], ["data.packing=true"], marks=pytest.mark.slow),
    pytest.param(["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved", "parallel.ep=2"],
                 ["model.num_layers=4"], marks=pytest.mark.slow),
    pytest.param(["parallel.ep=2"], ["optimizer.distributed=true"], marks=pytest.mark.slow),
], ids=["ep2xdp2", "tp2xep2", "pp2xep2", "cp2xep2", "ep2xdp2-packed", "pp2vpp2xep2", "ep2xdp2-zero1"])
def test_four_ranks_match_one_process(tmp_path, cache_dir, layout, data):
    """Three steps on 4 ranks (grad accumulation over the micro-batches of each dp rank,
    or the 1f1b pipeline schedule; fixed-length or packed samples) give the losses, grad norms, expert loads and aux/z
    values of one process running the same global batches in 4 micro-batches."""
    steps = ["train.steps=3", *data]
    one = train(small_config(tmp_path / "one", cache_dir, *steps))
    four = run_ranks(_train_rank, 4, small_config(tmp_path / "four", cache_dir, *steps, *layout), timeout=300)
    ref, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "four")
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(ref, got):
        for key in ("loss", "lm_loss", "grad_norm", "aux_loss", "z_loss"):
            assert b[key] == pytest.approx(a[key], rel=2e-5, abs=1e-6), key
        assert b["lr"] == a["lr"]
        assert b["expert_load"] == a["expert_load"]
    assert all(r.losses == pytest.approx(one.losses, rel=2e-5) for r in four)


def test_metrics_fields_and_counts(tmp_path, cache_dir):
    steps = 4
    cfg = small_config(tmp_path, cache_dir, f"train.steps={steps}", "moe.capacity_factor=1.0")
    result = train(cfg)
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    for r in records:
        for key in ("step", "loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "lr", "tokens_per_s",
                    "expert_load", "dropped_fraction"):
            assert key in r, key
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg.optimizer, steps))
        # Capacity 1.0 keeps at most ceil(T*k/E) per expert per micro-batch; the kept
        # assignments plus the dropped share are every token's top-k.
        kept = [sum(row) for row in r["expert_load"]]
        assert len(kept) == cfg.model.num_layers
        total_kept = sum(kept)
        assert total_kept == pytest.approx((1 - r["dropped_fraction"]) * tokens * 2 * len(kept), abs=0.5)
        assert 0 < r["dropped_fraction"] < 1
        capacity = -(-cfg.train.micro_batch_size * cfg.model.seq_length * 2 // 8)
        micro_batches = cfg.train.global_batch_size // cfg.train.micro_batch_size
        assert max(max(row) for row in r["expert_load"]) <= capacity * micro_batches
        # loss = lm_loss + aux_coeff * (sum over layers) + z_coeff * (sum over layers)
        layers = cfg.model.num_layers
        expected = r["lm_loss"] + layers * (cfg.moe.aux_loss_coeff * r["aux_loss"] + cfg.moe.z_loss_coeff * r["z_loss"])
        assert r["loss"] == pytest.approx(expected, rel=1e-9)
    assert result.losses == [r["loss"] for r in records]


def test_mtp_loss_per_depth_in_metrics_and_under_pp(tmp_path, cache_dir):
    """With two MTP depths metrics.jsonl has ``mtp_loss`` per depth; the step's loss adds
    ``mtp_loss_weight`` times their mean; the MTP depths' MoE blocks report routing as
    layers 2 and 3; pp2 (the depths and an embedding copy on the last stage) logs the
    same numbers as one process."""
    extra = ["train.steps=2", "model.mtp_num_layers=2", "model.mtp_loss_weight=0.5"]
    one = train(small_config(tmp_path / "one", cache_dir, *extra))
    run_ranks(_train_rank, 2, small_config(tmp_path / "pp2", cache_dir, *extra, "parallel.pp=2"), timeout=300)
    ref, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "pp2")
    cfg = small_config(tmp_path, cache_dir)
    layers = cfg.model.num_layers + 2
    for a, b in zip(ref, got):
        assert len(a["mtp_loss"]) == 2 and all(v > 0 for v in a["mtp_loss"])
        assert len(a["expert_load"]) == layers
        router = layers * (cfg.moe.aux_loss_coeff * a["aux_loss"] + cfg.moe.z_loss_coeff * a["z_loss"])
        expected = a["lm_loss"] + router + 0.5 * sum(a["mtp_loss"]) / 2
        assert a["loss"] == pytest.approx(expected, rel=1e-9)
        for key in ("loss", "lm_loss", "grad_norm", "aux_loss", "z_loss"):
            assert b[key] == pytest.approx(a[key], rel=2e-5, abs=1e-6), key
        assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=2e-5)
        assert b["expert_load"] == a["expert_load"]
    assert one.losses == [r["loss"] for r in ref]


def _checkpoint_tensors(run_dir) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    (folder,) = sorted((Path(run_dir) / "checkpoints").iterdir())[-1:]
    with safe_open(str(folder / "rank_00000.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_metrics_off_take_the_same_steps(tmp_path, cache_dir):
    """Collectors only read: a run without the routing metrics (``train(..., metrics=False)``)
    takes the steps of one with them, bit for bit: every step's loss, and every weight,
    expert bias and optimizer moment of the last checkpoint. The expert bias, the global
    aux loss and an MTP depth are on: the routing state the step changes, and the losses it
    adds to the LM loss."""
    extra = ["train.steps=3", "train.save_every=3", "moe.score_function=sigmoid", "moe.expert_bias=true",
             "moe.bias_update_rate=0.01",
             "moe.global_aux_loss_coeff=0.01", "model.mtp_num_layers=1"]
    on = train(small_config(tmp_path / "on", cache_dir, *extra))
    off = train(small_config(tmp_path / "off", cache_dir, *extra), metrics=False)
    assert on.losses == off.losses and len(on.losses) == 3
    a, b = _checkpoint_tensors(tmp_path / "on"), _checkpoint_tensors(tmp_path / "off")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    biases = [k for k in a if "router.expert_bias" in k]
    assert biases and all(a[k].abs().sum() > 0 for k in biases)  # the bias moved
    ran, bare = read_metrics(tmp_path / "on"), read_metrics(tmp_path / "off")
    # Without metrics the rows keep the step's own fields, not the collector's.
    assert [r["loss"] for r in bare] == off.losses and all("expert_load" not in r for r in bare)
    assert all(r["aux_loss"] == s["aux_loss"] and r["mtp_loss"] == s["mtp_loss"] for r, s in zip(ran, bare))
    assert all("expert_load" in r for r in ran)


# --------------------------------------------------------------------------- resume

def _train_each(rank, world_size, configs):
    return [train(config) for config in configs]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_overlaps_take_the_same_steps(tmp_path, cache_dir, precision):
    """The loop with the gradient reduction overlapped with the backward and the parameter
    gather with the forward (distributed optimizer, small buckets: several per step) takes
    the steps it takes without them, bit for bit; and the loss falls."""
    opts = ["train.steps=3", "parallel.ep=2", "optimizer.distributed=true", "parallel.grad_bucket_numel=20000",
            f"train.precision={precision}", "train.global_batch_size=16"]
    on = ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]
    configs = [small_config(tmp_path / "off", cache_dir, *opts), small_config(tmp_path / "on", cache_dir, *opts, *on)]
    off_run, on_run = run_ranks(_train_each, 2, configs, timeout=300)[0]
    assert on_run.losses == off_run.losses
    off, got = read_metrics(tmp_path / "off"), read_metrics(tmp_path / "on")
    assert [r["grad_norm"] for r in got] == [r["grad_norm"] for r in off]
    assert got[-1]["lm_loss"] < got[0]["lm_loss"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_exact(tmp_path, cache_dir, precision):
    """6 steps straight equal 3 steps, a resume from the checkpoint, and 3 more, bit for
    bit (deterministic mode; the cosine schedule spans the 6 steps in both). The first
    part runs a 4th step whose checkpoint is lost (a crash after its record): the resume
    starts from step 3 and metrics.jsonl holds one record per step."""
    opts = ["train.steps=6", "train.deterministic=true", "optimizer.warmup_steps=2", f"train.precision={precision}",
            "moe.z_loss_coeff=0.001", "train.save_every=3"]
    straight = train(small_config(tmp_path / "straight", cache_dir, *opts))
    first = train(small_config(tmp_path / "split", cache_dir, *opts), stop_at=4)
    assert first.checkpoint is not None and Path(first.checkpoint).name == "step_000004"
    shutil.rmtree(first.checkpoint)
    second = train(small_config(tmp_path / "split", cache_dir, *opts), resume=True)
    assert second.first_step == 4 and Path(second.checkpoint).name == "step_000006"
    assert first.losses[:3] + second.losses == straight.losses
    split, whole = read_metrics(tmp_path / "split"), read_metrics(tmp_path / "straight")
    assert [r["step"] for r in split] == list(range(1, 7))
    for a, b in zip(split, whole):
        assert (a["grad_norm"], a["expert_load"], a["lr"]) == (b["grad_norm"], b["expert_load"], b["lr"])


@pytest.mark.slow
def test_resume_under_other_layouts(tmp_path, cache_dir):
    """Save under ep2 x dp2 at step 2, resume under ep4 (dp4) and under tp2 x ep2 (SP,
    etp1): step 3 has the loss of the run that went on under ep2 x dp2."""
    import shutil

    opts = ["train.steps=3", "optimizer.warmup_steps=1"]
    ep2 = ["parallel.ep=2"]
    straight = run_ranks(_train_rank, 4, small_config(tmp_path / "straight", cache_dir, *opts, *ep2), timeout=300)[0]
    run_ranks(_train_rank, 4, small_config(tmp_path / "saved", cache_dir, *opts, *ep2), stop_at=2, timeout=300)
    for name, layout in [("ep4", ["parallel.ep=4"]),
                         ("tp2ep2", ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2",
                                     "parallel.etp=1"])]:
        shutil.copytree(tmp_path / "saved", tmp_path / name)
        resumed = run_ranks(_train_rank, 4, small_config(tmp_path / name, cache_dir, *opts, *layout), resume=True,
                            timeout=300)[0]
        assert resumed.first_step == 3
        assert resumed.losses == pytest.approx(straight.losses[2:], rel=1e-5), name


def test_mtp_checkpoint_saved_under_pp2_resumes_on_one_process(tmp_path, cache_dir):
    """The MTP depths and the last stage's embedding copy are saved under pp2 (the copy
    once, as the embedding) and resume on one process: steps 3-4 have the losses and MTP
    losses of the run that went on uninterrupted."""
    opts = ["train.steps=4", "optimizer.warmup_steps=1", "model.mtp_num_layers=1", "train.save_every=2"]
    straight = train(small_config(tmp_path / "straight", cache_dir, *opts))
    run_ranks(_train_rank, 2, small_config(tmp_path / "run", cache_dir, *opts, "parallel.pp=2"), stop_at=2,
              timeout=300)
    resumed = train(small_config(tmp_path / "run", cache_dir, *opts), resume=True)
    assert resumed.first_step == 3
    assert resumed.losses == pytest.approx(straight.losses[2:], rel=1e-5)
    ref, got = read_metrics(tmp_path / "straight")[2:], read_metrics(tmp_path / "run")[2:]
    mtp = [v for r in ref for v in r["mtp_loss"]]
    assert [v for r in got for v in r["mtp_loss"]] == pytest.approx(mtp, rel=1e-5)


@pytest.mark.slow
def test_quick_start_loss_falls_with_offline_wandb(tmp_path, cache_dir):
    """The quick start, short: mixtral-tiny on 4 ranks (ep2 x dp2), 30 steps. The loss
    falls; metrics.jsonl, the offline wandb run (its .wandb file read back), the expert-load
    heatmap and the final checkpoint are written."""
    steps = 30
    cfg = load_config("mixtral-tiny", [f"train.steps={steps}", f"train.run_dir={tmp_path}",
                                       f"data.cache_dir={cache_dir}", "model.seq_length=64", "wandb.mode=offline",
                                       "wandb.heatmap_every=10", "train.save_every=1000"])
    result = run_ranks(_train_rank, 4, cfg, timeout=600)[0]
    records = read_metrics(tmp_path)
    assert len(records) == steps
    losses = [r["loss"] for r in records]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    assert Path(result.checkpoint).name == f"step_{steps:06d}" and (Path(result.checkpoint) / "index.json").is_file()
    assert sorted(p.name for p in (tmp_path / "heatmaps").iterdir()) == [
        f"expert_load_step{s:07d}.png" for s in (10, 20, 30)]
    rows = read_wandb_history(result.wandb_dir)
    assert [row["_step"] for row in rows if "loss" in row] == list(range(1, steps + 1))
    by_step = {row["_step"]: row for row in rows if "loss" in row}
    for r in records:
        row = by_step[r["step"]]
        for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "lr", "dropped_fraction"):
            assert row[key] == pytest.approx(r[key], rel=1e-12), key
        for layer, load in enumerate(r["expert_load"]):
            assert row[f"moe/layer{layer}/max_load"] == max(load)
            assert [row[f"moe/layer{layer}/tokens_expert{e}"] for e in range(8)] == load
    # With Pillow the heatmap is a logged wandb.Image; without it the PNG is a run file.
    files = Path(result.wandb_dir, "files")
    images = sorted(files.glob("media/images/moe/expert_load_heatmap_*.png"))
    saved = files / "heatmaps" / "expert_load_step0000030.png"
    try:
        import PIL  # noqa: F401
    except ModuleNotFoundError:
        assert saved.is_file() and not images
    else:
        assert [p.name.split("_")[3] for p in images] == ["10", "20", "30"]
        assert images[-1].read_bytes() == (tmp_path / "heatmaps" / "expert_load_step0000030.png").read_bytes()


def test_init_from_hf_starts_from_those_weights(tmp_path, cache_dir):
    """init.from_hf: step 1's loss is the loss of the exported model (another seed) on the
    first global batch, computed here in one forward."""
    import dataclasses

    from moe_fold.data.loader import DataLoader, dataset_from_config
    from moe_fold.layout import ProcessGroups
    from moe_fold.models import to_hf
    from moe_fold.models.model import build_model

    # Mixtral's config has one MLP width, the experts'; the (unused) dense width must match it.
    cfg = small_config(tmp_path / "run", cache_dir, "train.steps=1", "moe.z_loss_coeff=0", "moe.aux_loss_coeff=0",
                       "model.ffn_hidden_size=64", f"init.from_hf={tmp_path / 'hf'}")
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=7))
    exported = build_model(other, ProcessGroups.single_process())
    to_hf(exported, tmp_path / "hf")
    gbs = cfg.train.global_batch_size
    batch = next(iter(DataLoader(dataset_from_config(cfg), gbs, gbs)))
    with torch.no_grad():
        want = float(exported(batch.tokens, batch.labels, positions=batch.positions))
        fresh = float(build_model(cfg, ProcessGroups.single_process())(batch.tokens, batch.labels,
                                                                        positions=batch.positions))
    result = train(cfg)
    assert result.losses[0] == pytest.approx(want, rel=1e-5)
    assert abs(want - fresh) > 1e-3


# --------------------------------------------------------------------------- recompute, precision

def test_recompute_modes_give_the_same_steps(tmp_path, cache_dir):
    runs = {}
    for mode in ("none", "full", "moe", "expert_act"):
        runs[mode] = train(small_config(tmp_path / mode, cache_dir, "train.steps=2", f"train.recompute={mode}",
                                        "moe.shared_expert_ffn_hidden_size=32"))
        grad_norms = [r["grad_norm"] for r in read_metrics(tmp_path / mode)]
        runs[mode] = (runs[mode].losses, grad_norms)
    for mode in ("full", "moe", "expert_act"):
        assert runs[mode][0] == pytest.approx(runs["none"][0], rel=1e-6), mode
        assert runs[mode][1] == pytest.approx(runs["none"][1], rel=1e-5), mode


def test_recompute_is_a_property_of_the_modules(cache_dir):
    """build_model sets each module's recompute attribute from train.recompute, and no
    module's forward is replaced on the instance."""
    from moe_fold.layout import ProcessGroups
    from moe_fold.models.experts import Experts
    from moe_fold.models.mlp import MLP
    from moe_fold.models.model import Block, build_model

    def settings(mode, *extra):
        model = build_model(small_config("unused", cache_dir, f"train.recompute={mode}", "moe.first_k_dense=1",
                                         "moe.shared_expert_ffn_hidden_size=32", *extra),
                            ProcessGroups.single_process())
        assert not [name for name, m in model.named_modules() if "forward" in vars(m)], mode
        return {name: m.recompute for name, m in model.named_modules() if isinstance(m, (Block, Experts, MLP))}

    def expect(dense_block, moe_block, experts, shared):
        return {"layers.0": dense_block, "layers.0.mlp": "none", "layers.1": moe_block,
                "layers.1.mlp.experts": experts, "layers.1.mlp.shared_expert": shared}

    assert settings("expert_act") == expect("none", "none", "activation", "none")
    assert settings("none") == expect("none", "none", "none", "none")
    assert settings("moe") == expect("none", "none", "all", "all")
    assert settings("moe", "moe.shared_expert_overlap=true") == expect("none", "none", "all", "halves")
    # An MoE block recomputes its attention only: the router stays outside.
    assert settings("full") == expect("all", "attention", "all", "all")


def test_recompute_modes_keep_fewer_activations(cache_dir):
    """Bytes of the tensors autograd keeps for backward over one forward (a recomputed
    region keeps only its inputs): full < moe < none and expert_act < none."""
    from moe_fold.data.loader import DataLoader, dataset_from_config
    from moe_fold.layout import ProcessGroups
    from moe_fold.models.model import build_model, set_recompute

    cfg = small_config("unused", cache_dir, "moe.shared_expert_ffn_hidden_size=32")
    batch = next(iter(DataLoader(dataset_from_config(cfg), 2, 2)))
    kept = {}
    for mode in ("none", "full", "moe", "expert_act"):
        model = build_model(cfg, ProcessGroups.single_process())
        set_recompute(model, mode)
        seen = {}

        def pack(t):
            seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(batch.tokens, batch.labels, positions=batch.positions)
        loss.backward()
        kept[mode] = sum(seen.values())
    assert kept["full"] < kept["moe"] < kept["none"], kept
    assert kept["expert_act"] < kept["none"], kept


def _record_router_logit_dtypes(monkeypatch) -> set:
    from moe_fold.dispatch.router import Router

    logit_dtypes = set()
    forward = Router.forward

    def recording_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        logit_dtypes.add(out.logits.dtype)
        return out
    monkeypatch.setattr(Router, "forward", recording_forward)
    return logit_dtypes


def test_bf16_autocast_tracks_fp32(tmp_path, cache_dir, monkeypatch):
    """bf16-autocast follows the fp32 run closely and learns; the router's logits stay float32."""
    logit_dtypes = _record_router_logit_dtypes(monkeypatch)
    steps = ["train.steps=4", "optimizer.lr=3e-3"]
    ref = train(small_config(tmp_path / "fp32", cache_dir, *steps))
    got = train(small_config(tmp_path / "autocast", cache_dir, *steps, "train.precision=bf16-autocast"))
    assert logit_dtypes == {torch.float32}
    assert got.losses[0] == pytest.approx(ref.losses[0], abs=0.05)
    assert got.losses[-1] < got.losses[0] - 0.3
    assert all(abs(a - b) < 0.15 for a, b in zip(got.losses, ref.losses))


def test_bf16_keeps_float32_masters_and_tracks_fp32(tmp_path, cache_dir, monkeypatch):
    """train.precision=bf16 at a small learning rate (1e-4), where an update is often
    smaller than a bf16 ulp of the weight: only float32 masters keep it. The checkpoint's
    parameters (the masters) are float32 and most of their elements are not bf16 values
    (a master rounded to its bf16 copy would be), and the loss stays within 1e-3 of the
    fp32 run's at every step (measured: 2e-4; masters rounded to bf16 after each step:
    4.7e-3 at step 6). The router's logits stay float32."""
    from safetensors.torch import load_file

    logit_dtypes = _record_router_logit_dtypes(monkeypatch)
    steps = ["train.steps=6", "optimizer.lr=1e-4", "optimizer.min_lr=1e-5"]
    ref = train(small_config(tmp_path / "fp32", cache_dir, *steps))
    got = train(small_config(tmp_path / "bf16", cache_dir, *steps, "train.precision=bf16"))
    assert logit_dtypes == {torch.float32}
    index = json.loads((Path(got.checkpoint) / "index.json").read_text())
    params = {f"model/{n}" for g in index["optimizer"]["param_groups"] for n in g["names"]}
    stored = load_file(Path(got.checkpoint) / "rank_00000.safetensors")
    masters = {key.split("#")[0]: value for key, value in stored.items() if key.split("#")[0] in params}
    assert set(masters) == params and all(index["tensors"][n]["dtype"] == "float32" for n in params)
    assert {m.dtype for m in masters.values()} == {torch.float32}
    flat = torch.cat([m.flatten() for m in masters.values()])
    off_bf16 = (flat != flat.bfloat16().float()).double().mean().item()
    assert off_bf16 > 0.9, f"only {off_bf16:.3f} of the master elements are not bf16 values"
    assert max(abs(a - b) for a, b in zip(got.losses, ref.losses)) < 1e-3, (got.losses, ref.losses)
    assert got.losses[-1] < got.losses[0]

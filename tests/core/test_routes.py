"""Route traces, `moe-fold routes diff` and router replay (docs/routes.md): traces keyed
by sample and position read the same under any layout, replay forces every token's
experts under any layout (from a trace or from transformers), bad routes are refused."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import transformers

from moe_fold import cli, routes
from moe_fold.data.loader import Batch
from moe_fold.dispatch.router import Router, topk_routing
from moe_fold.launch import run_ranks
from moe_fold.layout import ProcessGroups
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf.routes import routes_from_transformers
from moe_fold.routes import RouteSignature, load_replay, write_inference
from moe_fold.training.routes import RouteReplayer
from moe_fold.training.train import read_metrics, train
from tests.helpers.router_outputs import first_sequence_outputs
from tests.models.hf.test_importer import hf_model, token_ids
from tests.training.test_train import small_config

TRACE = "train.route_trace_every=1"
TP2_CP2 = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp=2", "parallel.ep=2", "parallel.etp=1"]
PP2_DP2 = ["parallel.pp=2", "parallel.ep=2"]


def _train_rank(rank, world_size, config):
    return train(config)


def _run(tmp_path, cache_dir, name, *extra, world=1):
    config = small_config(tmp_path / name, cache_dir, *extra)
    if world == 1:
        train(config)
    else:
        run_ranks(_train_rank, world, config, timeout=300)
    return tmp_path / name


# --------------------------------------------------------------------------- traces and diff

@pytest.mark.parametrize("layout", [TP2_CP2, PP2_DP2], ids=["tp2-sp-cp2-ep2", "pp2-dp2-ep2"])
def test_trace_reads_the_same_under_any_layout(tmp_path, cache_dir, layout, capsys):
    """Two steps traced on one process and on 4 ranks (cp zigzag slices and sequence-parallel
    shards, or dp shards and pipeline micro-batches): every token of each global batch is
    in both tables once, keyed by sample and position, with the same experts; `routes
    diff` says so (0 tokens apart)."""
    one = _run(tmp_path, cache_dir, "one", "train.steps=2", TRACE)
    four = _run(tmp_path, cache_dir, "four", "train.steps=2", TRACE, *layout, world=4)
    assert [r["lm_loss"] for r in read_metrics(four)] == pytest.approx([r["lm_loss"] for r in read_metrics(one)],
                                                                       rel=2e-5)
    S, gbs = 32, 8
    for step in (1, 2):
        a, b = routes.load(one, step), routes.load(four, step)
        samples = torch.arange((step - 1) * gbs, step * gbs)
        assert torch.equal(a.sample, samples.repeat_interleave(S))
        assert torch.equal(a.position, torch.arange(S).repeat(gbs))
        assert torch.equal(b.sample, a.sample) and torch.equal(b.position, a.position)
        assert a.layers == b.layers == [0, 1]
        assert torch.equal(a.experts, b.experts)
        assert torch.equal(a.dropped, b.dropped)
        assert (a.probs - b.probs).abs().max() <= 1e-2  # bf16 storage of float32-close values
    assert cli.main(["routes", "diff", str(one), str(four)]) == 0
    out = capsys.readouterr().out
    assert "first apart: never" in out and "0.0000" in out


def test_trace_is_compact(tmp_path, cache_dir):
    """Experts in the smallest integer type, probabilities in bf16."""
    run = _run(tmp_path, cache_dir, "run", "train.steps=1", TRACE)
    from safetensors.torch import load_file

    shard = load_file(str(routes.step_dir(run, 1) / "rank_00000.safetensors"))
    assert shard["layer.0.experts"].dtype == torch.uint8 and list(shard["layer.0.experts"].shape) == [8 * 32, 2]
    assert shard["layer.0.probs"].dtype == torch.bfloat16
    assert shard["layer.0.dropped"].dtype == torch.bool
    assert routes.expert_dtype(256) == torch.uint8 and routes.expert_dtype(257) == torch.int16


def test_diff_finds_where_runs_part(tmp_path, cache_dir, capsys):
    """Two runs from the same weights with different learning rates route alike at step 1
    and apart from step 2; the diff names step 2 and lists the largest changes."""
    a = _run(tmp_path, cache_dir, "a", "train.steps=2", TRACE)
    b = _run(tmp_path, cache_dir, "b", "train.steps=2", TRACE, "optimizer.lr=0.01")
    d = routes.diff(a, b)
    assert d.differing[1] == [0.0, 0.0]
    assert max(d.differing[2]) > 0
    assert d.first is not None and d.first[0] == 2
    assert d.largest and d.largest[0][0] == 2 and d.largest[0][-1] > 0
    assert cli.main(["routes", "diff", str(a), str(b), "--step", "2"]) == 1
    assert f"first apart: step 2, layer {d.first[1]}" in capsys.readouterr().out


def test_diff_refuses_other_data(tmp_path, cache_dir, capsys):
    a = _run(tmp_path, cache_dir, "a", "train.steps=1", TRACE)
    b = _run(tmp_path, cache_dir, "b", "train.steps=1", TRACE, "train.seed=7", "train.global_batch_size=4")
    assert cli.main(["routes", "diff", str(a), str(b)]) == 2
    assert "traced different tokens" in capsys.readouterr().err


# --------------------------------------------------------------------------- replay in training

def test_replay_forces_routes_under_another_layout(tmp_path, cache_dir):
    """Record on one process, replay on 4 ranks (tp2 x cp2 x ep2): the replaying run's own
    trace equals the recorded one and its losses equal the recording run's. And replay
    really forces: a run whose routes part from a trace (another learning rate) routes
    exactly as the trace when it replays it."""
    steps = "train.steps=3"
    rec = _run(tmp_path, cache_dir, "rec", steps, TRACE)
    rep = _run(tmp_path, cache_dir, "rep", steps, TRACE, f"moe.router_replay={rec}", *TP2_CP2, world=4)
    assert [r["lm_loss"] for r in read_metrics(rep)] == pytest.approx([r["lm_loss"] for r in read_metrics(rec)],
                                                                      rel=2e-5)
    assert routes.diff(rec, rep).first is None
    other = _run(tmp_path, cache_dir, "other", steps, TRACE, "optimizer.lr=0.01")
    assert routes.diff(rec, other).first is not None
    forced = _run(tmp_path, cache_dir, "forced", steps, TRACE, "optimizer.lr=0.01", f"moe.router_replay={rec}")
    d = routes.diff(rec, forced)
    assert d.first is None, d.differing


def test_replay_forces_routes_under_the_allgather_dispatcher(tmp_path, cache_dir):
    """The forcing happens in the router, before any dispatcher: a run of another learning
    rate on 2 ranks (ep2, the all-gather dispatcher) replays a one-process trace exactly."""
    steps = "train.steps=2"
    rec = _run(tmp_path, cache_dir, "rec", steps, TRACE)
    allgather = ["moe.dispatcher=allgather", "parallel.ep=2"]
    free = _run(tmp_path, cache_dir, "free", steps, TRACE, "optimizer.lr=0.01", *allgather, world=2)
    assert routes.diff(rec, free).first is not None
    forced = _run(tmp_path, cache_dir, "forced", steps, TRACE, "optimizer.lr=0.01", f"moe.router_replay={rec}",
                  *allgather, world=2)
    d = routes.diff(rec, forced)
    assert d.first is None, d.differing


def test_replay_capacity_follows_the_replayed_choice(tmp_path, cache_dir):
    """With capacity dropping, a replaying run drops what the recording run dropped."""
    cap = ["moe.capacity_factor=1.0"]
    rec = _run(tmp_path, cache_dir, "rec", "train.steps=2", TRACE, *cap)
    assert bool(routes.load(rec, 1).dropped.any())
    rep = _run(tmp_path, cache_dir, "rep", "train.steps=2", TRACE, *cap, "optimizer.lr=0.01",
               f"moe.router_replay={rec}")
    for step in (1, 2):
        a, b = routes.load(rec, step), routes.load(rep, step)
        assert torch.equal(a.experts, b.experts)
    assert torch.equal(routes.load(rec, 1).dropped, routes.load(rep, 1).dropped)


def test_replay_without_a_sample_is_refused_before_the_step(tmp_path, cache_dir):
    rec = _run(tmp_path, cache_dir, "rec", "train.steps=1", TRACE)
    with pytest.raises(ValueError, match=r"has no routes for sample 8, which step 2 trains on"):
        _run(tmp_path, cache_dir, "rep", "train.steps=2", f"moe.router_replay={rec}")


# --------------------------------------------------------------------------- the router

def test_forced_experts_keep_the_router_gradient():
    """Replayed experts: the routing map is theirs, the probs are the softmax of the
    current logits at them (as for a selection), and the router weight gets a gradient."""
    torch.manual_seed(0)
    logits = torch.randn(6, 8, requires_grad=True)
    forced = torch.tensor([[0, 1], [2, 7], [3, 4], [5, 6], [1, 7], [0, 6]])
    probs, routing_map = topk_routing(logits, 2, forced=forced)
    assert torch.equal(routing_map, torch.zeros(6, 8, dtype=torch.bool).scatter_(1, forced, True))
    assert torch.allclose(probs.gather(1, forced), torch.softmax(logits.gather(1, forced), -1))
    probs.gather(1, forced)[:, 0].sum().backward()
    assert logits.grad.abs().sum() > 0
    for kwargs in (dict(pre_softmax=True), dict(score="sigmoid")):
        p, _ = topk_routing(logits, 2, forced=forced, **kwargs)
        scores = torch.softmax(logits, -1) if kwargs.get("pre_softmax") else torch.sigmoid(logits)
        want = scores.gather(1, forced)
        want = want / want.sum(-1, keepdim=True) if "score" in kwargs else want
        assert torch.allclose(p.gather(1, forced), want)


# --------------------------------------------------------------------------- transformers

def _captured_routes(model) -> list:
    seen = []
    for block in model.layers:
        block.mlp.router.register_forward_hook(
            lambda m, a, out: seen.append(torch.topk(out.routed_map.float(), 2).indices.sort(-1).values))
    return seen


def test_replay_routes_from_transformers(tmp_path):
    """Routes taken from transformers on an exported Mixtral; then the routers' weights are
    perturbed. Without replay moe-fold's routes differ from transformers'; with replay
    they are transformers' exactly, and the logits match transformers' (perturbed
    weights, its routers forced to the same experts) to 1e-5."""
    hf = hf_model("mixtral_gqa")
    hf.save_pretrained(tmp_path / "hf")
    ids = token_ids()
    N, S = ids.shape
    recorded = routes_from_transformers(hf, ids, [0, 1], tmp_path / "routes.safetensors")
    want = torch.stack([recorded[0], recorded[1]])  # [N, S, L, k]

    model = from_hf(tmp_path / "hf").eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.layers:
            w = block.mlp.router.weight
            w.add_(torch.randn(w.shape, generator=gen) * 0.05)
    seen = _captured_routes(model)

    def as_table(found):  # L x [S*N, k] in [S, N] order -> [N, S, L, k]
        return torch.stack(found, 1).view(S, N, len(found), 2).transpose(0, 1)

    with torch.no_grad():
        model.logits(ids)
    assert not torch.equal(as_table(seen), want)
    seen.clear()

    config = model.config
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, seq_length=S),
                                 moe=dataclasses.replace(config.moe, router_replay=str(tmp_path / "routes.safetensors")))
    replayer = RouteReplayer(model, config, ProcessGroups.single_process(), [0, 1, 2])
    batch = Batch(ids, ids, torch.ones(N, S), torch.arange(S).repeat(N, 1), torch.tensor([0, S, 2 * S]),
                  sample_ids=torch.tensor([0, 1]))
    replayer.start_step(1, [batch])
    with torch.no_grad():
        ours = model.logits(ids)
    replayer.finish_step(1)
    assert torch.equal(as_table(seen), want)

    to_hf(model, tmp_path / "perturbed")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "perturbed",
                                                            experts_implementation="eager").eval()
    for j, layer in enumerate(ref.model.layers):
        def forced(module, args, out, j=j):
            logits = out[0]
            top = want[:, :, j].reshape(-1, 2)
            scores = torch.softmax(logits.float(), -1).gather(1, top)
            return logits, scores / scores.sum(-1, keepdim=True), top
        layer.mlp.gate.register_forward_hook(forced)
    with torch.no_grad():
        theirs = ref(ids).logits.float()
    diff = (ours - theirs).abs().max().item()
    print(f"replayed transformers routes: max abs logit diff {diff:.3g}")
    assert diff <= 1e-5


# --------------------------------------------------------------------------- refusals

SIG = RouteSignature(num_experts=8, topk=2, moe_layers=(0, 1), seq_length=4, hidden_size=64)


@pytest.mark.parametrize("written, shape, message", [
    (dataclasses.replace(SIG, num_experts=16), (4, 2, 2), r"num_experts=16 but moe.num_experts=8; the rule"),
    (dataclasses.replace(SIG, moe_layers=(0, 1, 2)), (4, 3, 2), r"moe_layers=0,1,2 but the model's MoE layers=0,1"),
    (dataclasses.replace(SIG, hidden_size=32), (4, 2, 2), r"hidden_size=32 but model.hidden_size=64.*another model"),
    (dataclasses.replace(SIG, topk=1), (4, 2, 1), r"topk=1 but moe.topk=2"),
    (SIG, (3, 2, 2), r"sample.0 is torch.uint8 \[3, 2, 2\]; the rule: integer \[tokens=4, moe_layers=2, topk=2\]"),
    (dataclasses.replace(SIG, seq_length=3), (3, 2, 2), r"seq_length=3 but model.seq_length=4"),
], ids=["experts", "layers", "other-model", "topk", "shape", "seq-length"])
def test_wrong_routes_are_refused_by_field(tmp_path, written, shape, message):
    path = tmp_path / "routes.safetensors"
    write_inference(path, {0: torch.zeros(shape, dtype=torch.long) + torch.arange(shape[-1])}, written)
    with pytest.raises(ValueError, match=message):
        load_replay(path, SIG)


def test_bad_expert_ids_are_refused(tmp_path):
    path = tmp_path / "routes.safetensors"
    r = torch.zeros(4, 2, 2, dtype=torch.long) + torch.arange(2)
    write_inference(path, {0: r}, SIG)
    assert torch.equal(load_replay(path, SIG).samples[0], r)
    r2 = r.clone()
    r2[1, 0] = torch.tensor([3, 3])
    write_inference(path, {0: r2}, SIG)
    with pytest.raises(ValueError, match=r"names an expert twice.*moe.topk=2 experts are distinct"):
        load_replay(path, SIG)
    r3 = r.clone()
    r3[2, 1, 1] = 8
    write_inference(path, {0: r3}, SIG)
    with pytest.raises(ValueError, match=r"names expert 8; the rule: experts lie in \[0, moe.num_experts=8\)"):
        load_replay(path, SIG)


def test_trace_of_another_model_is_refused_before_training(tmp_path, cache_dir):
    rec = _run(tmp_path, cache_dir, "rec", "train.steps=1", TRACE, "moe.num_experts=4")
    with pytest.raises(ValueError, match=r"moe.router_replay=.*num_experts=4 but moe.num_experts=8"):
        _run(tmp_path, cache_dir, "rep", "train.steps=1", f"moe.router_replay={rec}")


# --------------------------------------------------------------------------- batch invariance

@pytest.mark.parametrize("backend", ["torch", "loop"])
def test_batch_invariant_sequence_alone_equals_among_others(backend):
    """train.batch_invariant: sequence 0's logits and routes, alone and among 1, 3 and 7
    other sequences, are the same bits (every GEMM backend that runs on the CPU; its
    experts' GEMMs see a multiple of 16 rows)."""
    from moe_fold.config import load_config
    from moe_fold.models.model import build_model

    config = load_config("mixtral-tiny", ["parallel.ep=1", f"moe.gemm_backend={backend}", "moe.swiglu_backend=torch",
                                          "train.batch_invariant=true"])
    torch.manual_seed(0)
    model = build_model(config, ProcessGroups.single_process()).eval()
    ids = torch.randint(0, config.model.vocab_size, (8, config.model.seq_length),
                        generator=torch.Generator().manual_seed(1))
    alone, alone_routes = first_sequence_outputs(model, ids, 1)
    for batch in (2, 4, 8):
        logits, found = first_sequence_outputs(model, ids, batch)
        assert torch.equal(logits, alone), (batch, (logits - alone).abs().max().item())
        assert len(found) == len(alone_routes) > 0
        assert all(torch.equal(a, b) for a, b in zip(found, alone_routes))


@pytest.mark.parametrize("setting, message", [
    ("moe.capacity_factor=1.0", "train.batch_invariant=true cannot run with moe.capacity_factor=1.0"),
    ("moe.gemm_backend=triton", "needs moe.gemm_backend torch, loop or auto (on CPU), got triton"),
    ("model.seq_length=40", "multiple of 16, got 40 / 1"),
], ids=["capacity", "backend", "rows"])
def test_batch_invariant_refusals(setting, message):
    from moe_fold.config import ConfigError, load_config, validate

    config = load_config("mixtral-tiny", ["parallel.ep=1", "train.batch_invariant=true", setting])
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(config, 1)

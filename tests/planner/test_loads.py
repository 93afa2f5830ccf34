"""Routing-aware planning (moe_fold.planner.loads, `moe-fold plan --loads`) against what
bench/placement.py measures for the same skewed loads on 4 gloo ranks: the busiest ep
rank's rows over the mean, static, re-placed and replicated, within 5%; and the busiest
rank's expert activation bytes against what autograd keeps for that many rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.paths import REPO

from bench import placement as bench_placement

from tests.planner.test_memory import saved_activation_bytes

BENCH = ["--experts", "16", "--topk", "2", "--ep", "4", "--tokens", "256", "--hidden", "32", "--ffn", "64",
         "--steps", "16", "--replace-every", "4", "--replicas", "1", "--drift-every", "4", "--routing", "zipf,drift"]


def _write_run(folder: Path, kind: str, args) -> None:
    """A run directory whose metrics.jsonl holds, per step, the global expert load of the
    bench's routing (the sum over its ep ranks' tokens), as training records it."""
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(args.steps):
            load = sum(bench_placement.routing(kind, step, args.tokens, args.experts, args.topk, args, rank)[1].sum(0)
                       for rank in range(args.ep))
            f.write(json.dumps({"step": step, "loss": 1.0, "expert_load": [load.tolist()]}) + "\n")
        f.write(json.dumps({"step": args.steps, "valid_loss": 1.0}) + "\n")  # skipped: no expert_load


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    lines = bench_placement.main(BENCH)
    args = bench_placement.parse_args(BENCH)
    runs = {}
    for kind in args.routing:
        runs[kind] = tmp_path_factory.mktemp("runs") / kind
        _write_run(runs[kind], kind, args)
    return {(l["routing"], l["policy"]): l for l in lines}, runs, args


def _config_file(tmp_path: Path, args) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(f"""model: {{hidden_size: {args.hidden}, num_layers: 1, num_heads: 4, num_kv_heads: 4,
  ffn_hidden_size: {args.ffn}, vocab_size: 128, seq_length: {args.tokens}}}
moe: {{num_experts: {args.experts}, topk: {args.topk}, ffn_hidden_size: {args.ffn}}}
parallel: {{ep: {args.ep}}}
train: {{micro_batch_size: 1, global_batch_size: {args.ep}, precision: fp32}}
""")
    return path


@pytest.mark.parametrize("kind", ["zipf", "drift"])
def test_busiest_rank_load_matches_the_placement_bench(measured, kind):
    from moe_fold.planner.loads import read_loads, replay

    bench, runs, args = measured
    trace = read_loads(runs[kind])
    assert len(trace.steps) == args.steps and trace.num_experts == args.experts
    skip = args.replace_every
    planned = {"static": replay(trace, args.ep), "replaced": replay(trace, args.ep, 0, args.replace_every),
               "replicated": replay(trace, args.ep, args.replicas, args.replace_every)}
    for policy, loads in planned.items():
        got = loads.after(skip).mean_ratio()
        want = bench[(kind, policy)]["busiest_over_mean"]
        assert got == pytest.approx(want, rel=0.05), (kind, policy, got, want)
        # before the first re-placement every policy but the copies runs the static placement
        if policy != "replicated":
            first = statistics_mean(loads.ratio[:skip])
            assert first == pytest.approx(bench[(kind, policy)]["busiest_over_mean_first"], rel=0.05)
    # skewed routing: the static busiest rank is well above the mean; re-placing helps a fixed
    # hot spot and lags one that moves every window (the placement follows the last window)
    assert bench[(kind, "static")]["busiest_over_mean"] > 1.2
    replaced, static = planned["replaced"].after(skip).mean_ratio(), planned["static"].after(skip).mean_ratio()
    assert replaced < static if kind == "zipf" else replaced > static


def statistics_mean(ratios):
    return sum(x for step in ratios for x in step) / sum(len(step) for step in ratios)


def test_plan_loads_command_reports_every_policy(measured, tmp_path, capsys):
    from moe_fold.cli import main

    bench, runs, args = measured
    config = _config_file(tmp_path, args)
    base = ["plan", "--config", str(config), "--world", str(args.ep), "--ep", str(args.ep), "--gpu", "h100",
            "--loads", str(runs["zipf"]), "--replace-every", str(args.replace_every)]
    assert main(base + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    report = out["loads"]
    policies = {p["policy"]: p for p in report["policies"]}
    assert policies["static"]["busiest_over_mean"] == pytest.approx(
        bench[("zipf", "static")]["busiest_over_mean"], rel=0.05)
    assert policies[f"re-place every {args.replace_every}"]["busiest_over_mean"] == pytest.approx(
        bench[("zipf", "replaced")]["busiest_over_mean"], rel=0.05)
    assert policies[f"1 copy per rank, re-place every {args.replace_every}"]["busiest_over_mean"] == pytest.approx(
        bench[("zipf", "replicated")]["busiest_over_mean"], rel=0.05)
    # the skew costs time and memory against balanced routing; dropping caps both
    static = policies["static"]
    assert static["vs_balanced"] > 1 and static["activations_peak_bytes"] > report["balanced_activations_bytes"]
    assert 0 < policies["capacity factor 1"]["dropped_fraction"] < 1
    assert policies["capacity factor 1"]["busiest_over_mean"] <= 1.0 + 1e-9
    assert report["recommendation"] in policies
    # a window of the run, and the table
    assert main(base[:-2] + ["--loads-steps", "4:11"]) == 0
    text = capsys.readouterr().out
    assert "busiest ep rank" in text and "recommended" in text and "steps 4..11" in text
    # loads that do not fit the config
    assert main(["plan", "--config", "mixtral-tiny", "--world", "4", "--ep", "4", "--loads", str(runs["zipf"])]) == 2
    assert "do not match the config" in capsys.readouterr().err


def test_busiest_rank_activation_peak_matches_saved_bytes(measured):
    """The planner's dropless activation peak of the busiest rank's experts (rows x
    ``held_row_bytes`` less the dispatcher's 24 sort bytes, which the experts do not keep)
    against the bytes autograd keeps when that rank's experts run its rows."""
    from moe_fold.config import load_config
    from moe_fold.dispatch.placement import Placement
    from moe_fold.layout import ProcessGroups
    from moe_fold.models.experts import Experts
    from moe_fold.planner.loads import read_loads, replay
    from moe_fold.planner.memory import held_row_bytes

    bench, runs, args = measured
    trace = read_loads(runs["zipf"])
    static = replay(trace, args.ep)
    step = max(range(len(static.ratio)), key=lambda s: static.ratio[s][0])
    load = trace.loads[step][0]
    placement = Placement.contiguous(args.experts, args.ep)
    busiest = max(range(args.ep), key=lambda j: sum(load[e] for e in placement.rank_slots(j)))
    counts = [int(load[e]) for e in placement.rank_slots(busiest)]
    rows = sum(counts)
    assert rows == pytest.approx(static.busiest_rows[step][0])

    config = load_config("mixtral-tiny", [f"model.hidden_size={args.hidden}", f"moe.num_experts={args.experts}",
                                          f"moe.topk={args.topk}", f"moe.ffn_hidden_size={args.ffn}",
                                          f"parallel.ep={args.ep}", "train.precision=fp32"])
    predicted = rows * (held_row_bytes(config, "none") - 24)
    torch.manual_seed(0)
    experts = Experts(len(counts), args.hidden, args.ffn, ProcessGroups.single_process(), std=0.02, seed=0,
                      name="experts", gemm_backend="torch")
    tokens = torch.randn(rows, args.hidden, requires_grad=True)
    probs = torch.rand(rows, requires_grad=True)
    got, _ = saved_activation_bytes(experts, lambda: experts(tokens, torch.tensor(counts), probs))
    assert got == pytest.approx(predicted, rel=0.05)


def test_restated_min_gain_matches_the_training_loop():
    from moe_fold.planner.loads import MIN_GAIN
    from moe_fold.training.replace import MIN_GAIN as TRAINING

    assert MIN_GAIN == TRAINING


def test_replay_by_hand(tmp_path):
    from moe_fold.planner.loads import capacity, read_loads, replay

    # 4 experts on 2 ranks; expert 0 takes 6 of 10 tokens every step
    path = tmp_path / "loads.jsonl"
    path.write_text("".join(json.dumps({"step": s, "expert_load": [[6, 2, 1, 1]]}) + "\n" for s in range(4)))
    trace = read_loads(path)
    static = replay(trace, 2)
    assert static.ratio == [[8 / 5]] * 4 and static.busiest_rows == [[8.0]] * 4
    # re-placed after 2 steps: {0, 3} and {1, 2} -> 7 of 10 on the busiest rank
    replaced = replay(trace, 2, 0, 2)
    assert replaced.ratio[:2] == [[8 / 5]] * 2 and replaced.ratio[2:] == [[7 / 5]] * 2 and replaced.moves == 1
    # one copy per rank: expert 0 on both ranks, 3 + the rest split 3+... = 5 each
    copies = replay(trace, 2, 1, 2)
    assert copies.ratio[2:] == [[1.0]] * 2
    # capacity 1: each expert capped at 2.5 tokens; the busiest rank keeps 2.5 + 2 of a mean of 5
    capped = capacity(trace, 2, 1.0)
    assert capped.ratio[0] == [4.5 / 5] and capped.dropped[0] == [pytest.approx(0.35)]
    assert read_loads(path, first=1, last=2).steps == [1, 2]
    with pytest.raises(ValueError, match="no step records with expert_load in steps 7..9"):
        read_loads(path, first=7, last=9)
    with pytest.raises(ValueError, match="not divisible by parallel.ep=3"):
        replay(trace, 3)


def test_skew_by_hand_flat_model():
    """Measured routing on the flat model: the busiest rank's extra expert FLOPs on the
    critical path, its extra rows in memory for each micro-batch in flight."""
    from moe_fold.config import load_config
    from moe_fold.planner.estimate import Assumptions, RoutingSkew, estimate
    from moe_fold.planner.hardware import get_gpu
    from moe_fold.planner.memory import held_row_bytes
    from moe_fold.planner.model import layer_forward_flops

    config = load_config("mixtral-tiny", ["parallel.ep=4", "train.precision=bf16"])
    gpu = get_gpu("h100")
    a = Assumptions(memory_overhead=0)
    layers = sum(1 for f in range(config.model.num_layers))
    base = estimate(config, 4, gpu, a)
    skewed = estimate(config, 4, gpu, a, skew=RoutingSkew(time=(1.5,) * layers, peak=(2.0,) * layers))
    local = config.train.micro_batch_size * config.model.seq_length
    extra = sum(0.5 * 3 * local * layer_forward_flops(config, i)["experts"] for i in range(layers))
    assert skewed.time["compute"] - base.time["compute"] == pytest.approx(
        base.microbatches * extra / (gpu.peak_flops * a.matmul_efficiency))
    rows = local * config.moe.topk
    assert skewed.memory["activations"] - base.memory["activations"] == pytest.approx(
        layers * 1.0 * rows * held_row_bytes(config, "none"))
    assert skewed.comm_bytes["ep"] > base.comm_bytes["ep"] and skewed.time["ep"] > base.time["ep"]
    with pytest.raises(ValueError, match="has 1 MoE layers, the model has"):
        estimate(config, 4, gpu, a, skew=RoutingSkew(time=(1.5,), peak=(1.5,)))


def test_search_on_measured_loads_never_proposes_a_busiest_rank_out_of_memory(tmp_path):
    """With one expert taking most tokens, ep layouts whose busiest rank no longer fits drop
    out of the search; every layout kept fits with its busiest rank's memory."""
    import dataclasses

    from moe_fold.config import load_config
    from moe_fold.planner.estimate import Assumptions, search
    from moe_fold.planner.hardware import get_gpu
    from moe_fold.planner.loads import read_loads, skew_by_ep

    config = load_config("mixtral-tiny", ["train.precision=bf16", "train.micro_batch_size=8",
                                          "model.seq_length=1024", "train.global_batch_size=64"])
    layers, experts = config.model.num_layers, config.moe.num_experts
    path = tmp_path / "metrics.jsonl"
    hot = [[1000] + [10] * (experts - 1)] * layers
    path.write_text("".join(json.dumps({"step": s, "expert_load": hot}) + "\n" for s in range(3)))
    trace = read_loads(path)
    a = Assumptions(memory_overhead=0)
    balanced = search(config, 8, get_gpu("h100"), a)
    limit = sorted(p.memory["total"] for p in balanced)[len(balanced) // 2]
    gpu = dataclasses.replace(get_gpu("h100"), memory=limit)
    plain = search(config, 8, gpu, a)
    measured = search(config, 8, gpu, a, skew_for=skew_by_ep(trace, config))
    assert measured and all(p.fits and p.memory["total"] <= limit for p in measured)
    key = lambda p: tuple(p.layout[k] for k in ("tp", "cp", "pp", "vpp", "ep", "etp"))  # noqa: E731
    dropped = {key(p) for p in plain} - {key(p) for p in measured}
    assert dropped and all(layout[4] > 1 for layout in dropped)  # only layouts with several ep ranks
    assert all(p.memory.get("skew_activations", 0) > 0 for p in measured if p.layout["ep"] > 1)

"""The layout planner's arithmetic: parameter counts equal the real model's, communication
bytes equal the counters of a real training step on gloo ranks, and hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from moe_fold import comm
from moe_fold.config import config_from_dict, list_presets, load_config
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.planner_comm import Routing, step_bytes, uniform_routing
from moe_fold.planner_model import param_manifest

# Two layouts of world 4 with every group kind the MoE step uses:
# "etp2": tp 2 (SP), ep 2, etp 2 -> dp 2, edp 1; distributed optimizer; qk-norm, a gated
#         shared expert, z-loss and the global aux loss; one dense and one MoE layer.
# "etp1": tp 2 (SP), ep 2, etp 1 -> dp 2, edp 2; experts padded to capacity, so every
#         split is known from the config: the planner's uniform rows are exact.
LAYOUTS = {
    "etp2": {
        "model": {"qk_norm": True},
        "moe": {"moe_layer_freq": [1, 0], "shared_expert_ffn_hidden_size": 32, "shared_expert_gate": True,
                "z_loss_coeff": 1e-3, "global_aux_loss_coeff": 1e-3},
        "parallel": {"tp": 2, "ep": 2, "sequence_parallel": True},
        "optimizer": {"distributed": True},
    },
    "etp1": {
        "moe": {"moe_layer_freq": 1, "capacity_factor": 1.5, "pad_to_capacity": True},
        "parallel": {"tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True},
    },
}


def _config(name: str):
    base = {
        "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 64, "seq_length": 16},
        "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 32},
        "train": {"micro_batch_size": 2, "global_batch_size": 8},
    }
    for section, values in LAYOUTS[name].items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


def _train_step(rank: int, world: int, names: list[str]) -> dict:
    """One training step (forward and backward of every micro-batch, then
    apply_gradients) per layout, inside the byte counter; also this rank's parameters
    and the per-expert token counts of every MoE layer and micro-batch."""
    from moe_fold.models.model import build_model
    from moe_fold.models.moe_layer import MoELayer
    from moe_fold.optim import apply_gradients, build_optimizer

    out = {}
    for name in names:
        config = _config(name)
        p = config.parallel
        groups = create_process_groups(ParallelLayout(world, tp=p.tp, ep=p.ep, etp=p.etp))
        model = build_model(config, groups)
        optimizer = build_optimizer(model, config.optimizer, groups)
        t = config.train
        micro = t.global_batch_size // (t.micro_batch_size * groups.size("dp"))
        gen = torch.Generator().manual_seed(100 + groups.rank_in("dp"))
        counts = []
        with comm.count_bytes() as sent:
            for _ in range(micro):
                ids = torch.randint(0, config.model.vocab_size, (t.micro_batch_size, config.model.seq_length),
                                    generator=gen)
                loss = model(ids, ids)
                counts.append([m.last_stats.tokens_per_expert.tolist()
                               for m in model.modules() if isinstance(m, MoELayer)])
                loss.backward()
            apply_gradients(list(model.parameters()), optimizer, groups, config.optimizer.clip_grad)
        params = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
        out[name] = {"sent": dict(sent), "counts": counts, "params": params}
    return out


@pytest.fixture(scope="module")
def gloo_step():
    return run_ranks(_train_step, 4, list(LAYOUTS), timeout=300)


def _measured_routing(layout: ParallelLayout, counts: list, rank: int, num_experts: int) -> list[list[Routing]]:
    """Rows of each MoE layer and micro-batch on ``rank`` from every rank's per-expert
    counts: the dispatcher sends a rank's rows for other ep ranks' experts, receives its
    ep peers' rows for its own experts (peers share its etp rank), and all-gathers the
    rows it holds over its etp group."""
    local = num_experts // layout.ep

    def mine(r):
        j = layout.coords(r)["ep"]
        return range(j * local, (j + 1) * local)

    def held(r, mb, layer):
        return sum(counts[q][mb][layer][e] for q in layout.group_of("ep", r) for e in mine(r))

    out = []
    for mb in range(len(counts[rank])):
        layers = []
        for layer in range(len(counts[rank][mb])):
            own = counts[rank][mb][layer]
            sent = sum(own) - sum(own[e] for e in mine(rank))
            received = held(rank, mb, layer) - sum(own[e] for e in mine(rank))
            held_etp = sum(held(t, mb, layer) for t in layout.group_of("etp", rank))
            layers.append(Routing(sent, received, held(rank, mb, layer), held_etp, meta=4))
        out.append(layers)
    return out


def test_step_bytes_equal_counters_with_measured_routing(gloo_step):
    config = _config("etp2")
    layout = ParallelLayout(4, tp=2, ep=2)
    counts = [r["etp2"]["counts"] for r in gloo_step]
    for rank in range(4):
        planned = step_bytes(config, 4, routing=_measured_routing(layout, counts, rank, 4))
        measured = gloo_step[rank]["etp2"]["sent"]
        assert set(planned) == set(measured), rank
        for kind, nbytes in measured.items():
            assert planned[kind] == nbytes, (rank, kind)
    # Every kind of the folded MoE step is there.
    assert set(gloo_step[0]["etp2"]["sent"]) == {"tp", "tp_cp", "tp_dp_cp", "dp_cp", "ep", "etp", "etp_ep"}


def test_step_bytes_equal_counters_padded_uniform(gloo_step):
    config = _config("etp1")
    # 2 x 16 tokens split over tp 2: 16 per rank. Padding makes every split
    # C = ceil(16 * 2 / 4 * 1.5) = 12 rows per expert and source rank whatever the router
    # picks, so the planner's default rows are the real ones: 4 experts x 12 = 48 rows,
    # half of them (the other ep rank's 2 experts) sent, as many received, 2 x 2 x 12 held.
    assert uniform_routing(config) == Routing(sent=24.0, received=24.0, held=48, held_etp=48, meta=4)
    for rank in range(4):
        planned = step_bytes(config, 4)
        measured = gloo_step[rank]["etp1"]["sent"]
        assert set(planned) == set(measured), rank
        for kind, nbytes in measured.items():
            assert planned[kind] == nbytes, (rank, kind)
    assert {"ep", "edp", "tp", "dp_cp"} <= set(gloo_step[0]["etp1"]["sent"])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rank_params_equal_real_model_under_tp_ep(gloo_step, name):
    config = _config(name)
    planned = [(e.name, e.numel, e.kind) for e in param_manifest(config)]
    for rank in range(4):
        assert [tuple(x) for x in gloo_step[rank][name]["params"]] == planned


TINY = [name for name in list_presets() if name.endswith("-tiny")]


@pytest.mark.parametrize("preset", TINY)
def test_params_equal_single_process_model(preset):
    from moe_fold.models.model import build_model

    config = load_config(preset, ["parallel.tp=1", "parallel.ep=1", "parallel.etp=null", "parallel.pp=1",
                                  "parallel.cp=1", "parallel.vpp=null", "parallel.pp_schedule=1f1b"])
    model = build_model(config, ProcessGroups.single_process())
    real = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
    assert [(e.name, e.numel, e.kind) for e in param_manifest(config)] == real
    assert sum(e.numel for e in param_manifest(config)) == sum(q.numel() for q in model.parameters())

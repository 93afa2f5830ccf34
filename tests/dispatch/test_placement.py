"""Expert placement (dispatch/placement.py) and moving experts (training/replace.py).

The math must not change: with any placement (random permutations of the experts over
the ep ranks, with copies on spare slots) a model trains to one process's losses,
gradients and gradient norms, in the layouts and dispatcher modes of the invariance
matrices (tests/parallel/test_layout_invariance.py, tests/parallel/test_parallel_matrix.py), whose
references and checks are reused as they are. A model is built in the default placement
and moved to a random one with :func:`move_experts` (which also exercises the move);
gradients are gathered to global tensors by global expert id
(:func:`moe_fold.parallel.sharding.full_tensor`), and the copies of every expert must
stay exactly equal.
"""

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tests.parallel.test_layout_invariance as li
import tests.parallel.test_parallel_matrix as pm
from moe_fold.comm import all_reduce_
from moe_fold.dispatch.placement import Placement, balanced_placement, expert_order, rank_loads, slot_routing
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models import to_hf
from moe_fold.models.model import build_model
from moe_fold.parallel.sharding import full_tensor, shard_info
from moe_fold.parallel.tensor_parallel import unshard_tp
from moe_fold.training.grads import clip_grad_norm_, sync_grads
from moe_fold.training.optim import AdamW, param_groups
from moe_fold.training.replace import moe_layers, move_experts
from moe_fold.training.step import forward_backward
from tests.helpers.pipeline_union import unite_over_pp


# --------------------------------------------------------------------------- placements

def random_placement(num_experts, ep, replicas, seed):
    """The experts shuffled over the ranks, each rank's spare slots holding random other experts."""
    rng = random.Random(seed)
    experts = list(range(num_experts))
    rng.shuffle(experts)
    el = num_experts // ep
    slots = []
    for j in range(ep):
        mine = experts[j * el:(j + 1) * el]
        others = [e for e in range(num_experts) if e not in mine]
        slots += mine + rng.sample(others, replicas)
    return Placement(num_experts, ep, tuple(slots))


def test_contiguous_placement_is_the_default_split():
    p = Placement.contiguous(8, 4)
    assert p.is_default and p.slots_per_rank == 2 and p.rank_slots(1) == (2, 3)
    q = Placement.contiguous(8, 4, replicas=1)
    assert not q.is_default
    assert q.rank_slots(0) == (0, 1, 2) and q.rank_slots(3) == (6, 7, 0)
    assert q.copies(0) == (0, 11) and q.primary(0) and not q.primary(11) and q.copy_index(11) == 1


@pytest.mark.parametrize("slots, message", [
    ((0, 1, 2), "placement has 3 slots: it needs a multiple of ep=2 and at least num_experts=4"),
    ((0, 1, 2, 2), "placement leaves experts [3] without a slot"),
    ((0, 0, 1, 2, 3, 1), "placement puts two copies of one expert on ep rank 0: [0, 0, 1]"),
    ((0, 1, 2, 9), "placement slots hold experts [9] outside [0, num_experts=4)"),
])
def test_placement_rejects_bad_slots(slots, message):
    with pytest.raises(ValueError) as err:
        Placement(4, 2, slots)
    assert str(err.value) == message


def test_too_many_replicas_are_rejected():
    rule = r"moe.replicas=7 must be <= moe.num_experts - moe.num_experts/parallel.ep=6 \(a rank holds at most one copy"
    with pytest.raises(ValueError, match=rule):
        Placement.contiguous(8, 4, replicas=7)
    with pytest.raises(ValueError, match=rule):
        balanced_placement([1.0] * 8, 4, replicas=7)


def test_slot_routing_puts_every_pair_on_one_copy_in_token_runs():
    gen = torch.Generator().manual_seed(0)
    t, e = 50, 4
    routing_map = torch.rand(t, e, generator=gen) < 0.5
    probs = torch.rand(t, e, generator=gen) * routing_map
    p = Placement(4, 2, (0, 1, 2, 3, 0, 1))  # experts 0 and 1 have two copies
    slot_map, slot_probs = slot_routing(p, routing_map, probs)
    # Every routed pair exactly once, with its prob.
    back = torch.zeros(t, e, dtype=torch.long).index_add_(1, torch.tensor(p.slots), slot_map.long())
    assert torch.equal(back, routing_map.long())
    assert torch.equal(slot_probs[slot_map], probs[:, list(p.slots)][slot_map])
    for expert in (0, 1):
        first, second = p.copies(expert)
        tokens = routing_map[:, expert].nonzero().squeeze(1)
        a, b = slot_map[:, first].nonzero().squeeze(1), slot_map[:, second].nonzero().squeeze(1)
        assert torch.equal(torch.cat([a, b]), tokens)  # contiguous runs in token order
        assert abs(len(a) - len(b)) <= 1
    assert expert_order(p) == [0, 4, 1, 5, 2, 3]


def _zipf(num_experts, s):
    return [1.0 / (k + 1) ** s for k in range(num_experts)]


def test_balanced_placement_evens_the_load():
    load = _zipf(16, 1.2)
    static = Placement.contiguous(16, 4)
    mean = sum(load) / 4
    moved = balanced_placement(load, 4)
    replicated = balanced_placement(load, 4, replicas=1)
    # The hottest expert alone is over a rank's fair share: only copies get under it.
    assert max(load) / mean > 1.15
    # Moving alone: the hottest expert's rank also holds the three coldest, the least it can.
    assert max(rank_loads(moved, load)) == pytest.approx(max(load) + sum(sorted(load)[:3]))
    assert max(rank_loads(replicated, load)) / mean < 1.15 < max(rank_loads(static, load)) / mean
    # Without a dominant expert, moving alone is enough.
    rng = random.Random(3)
    flat = [rng.uniform(0.5, 1.5) for _ in range(16)]
    flat_mean = sum(flat) / 4
    assert max(rank_loads(balanced_placement(flat, 4), flat)) / flat_mean < 1.02
    assert max(rank_loads(static, flat)) / flat_mean > 1.05


def test_balanced_placement_keeps_experts_in_place_when_it_can():
    load = [5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]
    first = balanced_placement(load, 2)
    again = balanced_placement(load, 2, previous=first)
    assert again == first
    swapped = Placement(8, 2, first.slots[4:] + first.slots[:4])
    assert balanced_placement(load, 2, previous=swapped) == swapped


def test_move_plan_moves_weights_by_expert_on_one_rank():
    """ep = 1: a permutation of the slots is a local move (no communication)."""
    groups = ProcessGroups.single_process()
    config = li._config("mixtral")
    model = build_model(config, groups)
    layer = moe_layers(model)[0]
    before = layer.experts.fc1.detach().clone()
    new = Placement(8, 1, (3, 1, 0, 2, 7, 6, 5, 4))
    done = move_experts([layer], new, groups)
    assert done == {"moved": [], "bytes": 0}
    assert torch.equal(layer.experts.fc1, before[list(new.slots)])
    assert layer.dispatcher.placement == new and layer.experts.fc1.slot_experts == list(new.slots)


# --------------------------------------------------------------------------- invariance

def _global(p, groups, grad=True):
    """The global tensor of a parameter (or its grad), expert slots placed by global id."""
    t = (p.grad if grad else p).detach()
    if p.parallel == "expert":
        return full_tensor(t, shard_info(p, groups), groups)
    if p.parallel == "tp":
        return unshard_tp(li._gather(t, groups.tp, p.tp_dim), p.tp_dim, p.tp_parts)
    return t


def _global_grads(model, groups):
    return {name: _global(p, groups).numpy().copy() for name, p in model.named_parameters()}


def _place_randomly(model, groups, replicas, seed):
    for index, layer in sorted(moe_layers(model).items()):
        old = layer.placement
        new = random_placement(old.num_experts, old.ep, replicas, seed * 100 + index)
        move_experts([layer], new, groups)


def _copies_equal(model, groups):
    """Every copy of every expert holds exactly its first copy's weights."""
    for layer in moe_layers(model).values():
        p = layer.placement
        for param in (layer.experts.fc1, layer.experts.fc2):
            parts = li._gather(param.detach(), groups.ep, 0)
            rows = torch.cat(parts)  # [ep*S, ...] in slot order
            for expert in range(p.num_experts):
                copies = p.copies(expert)
                if any(not torch.equal(rows[c], rows[copies[0]]) for c in copies[1:]):
                    return False
    return True


# layout-invariance case -> spare slots per rank
LI_CASES = {
    "ep2": 0, "ep2-capacity-drop": 1, "ep2-pad-drop": 1,
    "ep4": 2, "etp2-ep2": 1, "ep4-allgather": 1, "ep4-capacity-drop": 0,
    "dp4-ep2-capacity-drop-allgather": 1, "ep4-dedup": 1,
}


def _li_train(model, groups, micro_batches):
    """tests/parallel/test_layout_invariance.py's ``_train`` with placement-aware grad gathering."""
    out = li._train(model, groups, micro_batches, global_grads=_global_grads)
    out["copies_equal"] = _copies_equal(model, groups)
    return out


def _li_rank(rank, world_size, names):
    groups_of, results = {}, []
    for name in names:
        sizes = li.CASES[name][1]
        key = tuple(sorted(sizes.items()))
        if key not in groups_of:
            groups_of[key] = create_process_groups(ParallelLayout(world_size, **sizes))
        groups = groups_of[key]
        config = li._case_config(name)
        config.moe.replicas = LI_CASES[name]
        model = build_model(config, groups)
        _place_randomly(model, groups, LI_CASES[name], seed=len(name))
        ids, labels = li._batch()
        dp, me = groups.size("dp_cp"), groups.rank_in("dp_cp")
        rows = slice(me * li.BATCH // dp, (me + 1) * li.BATCH // dp)
        results.append(_li_train(model, groups, [(ids[rows], labels[rows])]))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_any_placement_matches_single_process(world):
    names = [n for n in LI_CASES if li.CASES[n][0] == world]
    results = run_ranks(_li_rank, world, names, timeout=400)
    li._check(names, results)
    assert all(r["copies_equal"] for per_rank in results for r in per_rank)


def _pm_rank(rank, world_size, name, replicas):
    """tests/parallel/test_parallel_matrix.py's ``_rank`` for one case, in a random placement."""
    sizes = pm.CASES[name][1]
    groups = create_process_groups(ParallelLayout(world_size, **sizes))
    config = pm._case_config(name)
    config.moe.replicas = replicas
    model = build_model(config, groups)
    _place_randomly(model, groups, replicas, seed=7)
    m, cp = pm.CASES[name][2], groups.size("cp")
    micro = [b.cp_slice(groups.rank_in("cp"), cp) for b in pm._micro_batches(groups.rank_in("dp"), groups.size("dp"), m)]
    opt = AdamW(param_groups(model, 0.1), lr=pm.LR, groups=groups, distributed=True)
    out = {"losses": [], "norms": []}
    for step in range(pm.STEPS):
        opt.zero_grad()
        losses = forward_backward(model, micro, groups, config)
        sync_grads(model.parameters(), groups)
        if step == 0:
            out["grads"] = unite_over_pp(_global_grads(model, groups), groups)
        out["norms"].append(clip_grad_norm_(model.parameters(), pm.MAX_NORM, groups).item())
        out["losses"].append((all_reduce_(losses.sum(), groups.dp_cp) / groups.size("dp_cp")).item())
        opt.step()
    out["tied_diff"] = 0.0
    out["copies_equal"] = _copies_equal(model, groups)
    return [out]


def test_any_placement_matches_single_process_under_pp():
    """ep2 x pp2 (x dp2), ZeRO-1 and global-norm clipping, with copies."""
    results = run_ranks(_pm_rank, 4, "pp2-ep2-dp2", 1, timeout=400)
    pm._check(["pp2-ep2-dp2"], results)
    assert all(r[0]["copies_equal"] for r in results)


# --------------------------------------------------------------------------- Hugging Face

def _hf_rank(rank, world_size, src, out):
    """Import a Hugging Face Mixtral on ep2 with a spare slot per rank, move to a random
    placement with copies, export."""
    from moe_fold.models.hf.importer import hf_config, load_hf_into

    groups = create_process_groups(ParallelLayout(world_size, ep=world_size))
    config = hf_config(src)
    config.parallel.ep, config.moe.replicas = world_size, 1
    model = build_model(config, groups)
    load_hf_into(model, src, groups)
    _place_randomly(model, groups, 1, seed=5)
    to_hf(model, out, groups=groups)
    return [layer.placement.slots for layer in moe_layers(model).values()]


def test_hf_import_and_export_under_a_placement_with_copies(tmp_path):
    """The exported folder holds exactly the imported tensors, whatever slots the experts sat in."""
    from safetensors import safe_open

    from tests.models.hf.test_importer import save_hf

    save_hf("mixtral_gqa", tmp_path / "hf")
    placed = run_ranks(_hf_rank, 2, tmp_path / "hf", tmp_path / "out", timeout=300)[0]
    assert all(slots != Placement.contiguous(4, 2, 1).slots for slots in placed)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a.get_tensor(key), b.get_tensor(key)), key


def test_planner_counts_the_spare_slots():
    """``moe-fold plan``'s parameter manifest (memory, optimizer state) holds the copies."""
    from moe_fold.layout import GROUP_NAMES
    from moe_fold.planner.model import param_manifest

    config = li._config("mixtral")
    config.parallel.ep, config.moe.replicas = 2, 2
    groups = ProcessGroups(ParallelLayout(2, ep=2), 1, {kind: None for kind in GROUP_NAMES})
    model = build_model(config, groups)
    assert model.layers[0].mlp.experts.fc1.shape[0] == 6
    real = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
    assert [(e.name, e.numel, e.kind) for e in param_manifest(config)] == real


def _move_rank(rank, world_size):
    """ep2 x edp2, with ZeRO-1 and with the plain optimizer (whole moments on every
    rank): move a layer with copies; return what each slot holds."""
    groups = create_process_groups(ParallelLayout(world_size, ep=2))
    config = li._config("mixtral")
    config.parallel.ep, config.moe.replicas = 2, 1
    results = {}
    for distributed in (True, False):
        model = build_model(config, groups)
        opt = AdamW(param_groups(model, 0.1), lr=1e-3, groups=groups, distributed=distributed)
        layer = moe_layers(model)[0]
        params = (layer.experts.fc1, layer.experts.fc2)
        before = [_global(p, groups, grad=False) for p in params]  # [E, ...] by global expert
        with torch.no_grad():
            for p in params:
                p.grad = p.detach() * 3
                start, stop = opt.state_slice(p)
                opt.state[p]["exp_avg"].view(-1).copy_((p.detach() * 2).reshape(-1)[start:stop])
                opt.state[p]["exp_avg_sq"].view(-1).copy_(p.detach().square().reshape(-1)[start:stop])
        new = random_placement(8, 2, 1, seed=11)
        done = move_experts([layer], new, groups, opt)
        out = {"moved": done["moved"], "bytes": done["bytes"], "ok": layer.placement == new}
        for p, whole in zip(params, before):
            start, stop = opt.state_slice(p)
            assert distributed or (start, stop) == (0, p.numel())
            out["ok"] &= all(torch.equal(p[i], whole[e]) for i, e in enumerate(p.slot_experts))
            out["ok"] &= torch.equal(p.grad, p.detach() * 3)
            out["ok"] &= torch.equal(opt.state[p]["exp_avg"].reshape(-1), (p.detach() * 2).reshape(-1)[start:stop])
            out["ok"] &= torch.equal(opt.state[p]["exp_avg_sq"].reshape(-1),
                                     p.detach().square().reshape(-1)[start:stop])
        out["slot_bytes"] = sum(p[0].numel() for p in params) * 4 * 4  # weights, grads, two moments
        results["zero1" if distributed else "plain"] = out
    return results


def test_move_carries_weights_grads_and_moments_by_expert():
    """Each slot holds its new expert's weights, grads and AdamW moments (exp_avg = 2 w,
    exp_avg_sq = w^2, set before the move) after the move, under ZeRO-1 (each rank's
    moment slice) and under the plain optimizer (whole moments)."""
    per_rank = run_ranks(_move_rank, 4, timeout=300)
    for mode in ("zero1", "plain"):
        results = [r[mode] for r in per_rank]
        assert all(r["ok"] for r in results), mode
        moved = results[0]["moved"]
        assert moved and all(r["moved"] == moved for r in results), mode
        # Each moved slot crossed the wire once per edp replica: weights, grads and both moments.
        assert sum(r["bytes"] for r in results) == 2 * len(moved) * results[0]["slot_bytes"], mode

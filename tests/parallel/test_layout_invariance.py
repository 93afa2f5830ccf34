"""The layout-invariance matrix of MoE models (docs/architecture.md, "Testing doctrine").

Three tiny models, a Mixtral-like one (every layer MoE, 8 experts, top-2, GQA, aux loss),
a Qwen2-MoE-like one (gated shared expert, dense and MoE layers interleaved,
softmax before top-k, aux and z losses) and a DeepSeek-V3-like one (multi-head latent
attention, sigmoid group-limited routing with expert bias, shared expert), train three AdamW steps on 2, 4 and 8 gloo
ranks in many layouts (dp, tp with SP, ep, etp, and their folds) and dispatcher modes
(all-to-all and all-gather; dropless, capacity, padded, deduplicated). Every layout must
give one process's losses, first-step gradients (gathered from the tp, ep and etp
shards to the global tensors, on every rank) and gradient norm.

The reference. The router's losses are computed per micro-batch: over the tokens of one
tp x cp group, i.e. one dp rank's share of the global batch (Router docstring). So the
one-process reference of a layout with data-parallel size D runs the same global batch
as D micro-batches, the dp shards in rank order, accumulating grads with the router's
``loss_scale = 1/D`` and the main loss normalised by the global token count, which is
exactly what the training loop does with D micro-batches. Dropless routing is the same
whether the batch is split or not; the load-balancing loss is not (it is not linear in
the counts), hence D.

Capacity. An expert's capacity is ``ceil(T k / E * factor)`` of the T tokens one rank
routes, so dropping depends on which tokens a rank holds: under SP a rank routes half a
sequence, which no one-process run of the model routes. Layouts with tp = 1 route whole
dp shards, the reference's micro-batches, so there the capacity and padded modes are
compared with drops happening (``factor=1``; the test checks that tokens were dropped).
Under tp > 1 the dropping modes are run with a factor large enough that nothing drops
(``factor=8``: capacity >= every token): the same code path (capacity, padding to it)
with a decision that does not depend on the split.
"""

import pytest
import torch
import torch.distributed as dist

from moe_fold.comm import all_reduce
from moe_fold.config import Config, ModelConfig
from moe_fold.training.grads import grad_norm, sync_grads
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.model import build_model
from moe_fold.models.moe_layer import MoELayer
from moe_fold.parallel.tensor_parallel import unshard_tp
from tests.helpers.router_outputs import max_dropped_fraction, router_outputs
from tests.helpers.compare import assert_run_matches
from tests.models.test_mla import MLA_MODEL

VOCAB, HIDDEN, SEQ, BATCH, STEPS, LR = 64, 32, 16, 4, 3, 1e-2


def _config(family, sp=False, **moe):
    config = Config()
    config.model = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2,
                               ffn_hidden_size=48, seq_length=SEQ, init_std=0.1)
    c = config.moe
    c.num_experts, c.topk, c.ffn_hidden_size, c.aux_loss_coeff = 8, 2, 32, 0.1
    if family == "qwen2":
        c.pre_softmax = True
        c.shared_expert_ffn_hidden_size, c.shared_expert_gate = 40, True
        c.moe_layer_freq = [0, 1]  # a dense layer, then an MoE layer
        c.z_loss_coeff = 0.05
    if family == "gptoss":
        # gpt-oss's MoE side: router bias, biased experts (fc2's bias split over etp), the
        # clamped SwiGLU with a limit small enough to clamp some of these activations.
        c.router_bias, c.expert_linear_bias = True, True
        c.activation, c.swiglu_alpha, c.swiglu_limit = "clamped_swiglu", 1.702, 0.3
    if family.startswith("mla"):
        # DeepSeek-V3's shape: MLA, a dense first layer, sigmoid scores with expert bias,
        # group-limited top-2 (4 groups, the best 1), scaling, an ungated shared expert.
        for key, value in MLA_MODEL.items():
            setattr(config.model, key, value)
        c.score_function, c.expert_bias, c.num_groups, c.group_topk, c.scaling_factor = "sigmoid", True, 4, 1, 2.5
        c.shared_expert_ffn_hidden_size, c.first_k_dense = 40, 1
        if family == "mla-dense":
            c.moe_layer_freq = 0
    for key, value in moe.items():
        setattr(c, key, value)
    config.parallel.sequence_parallel = sp
    config.train.seed = 5
    return config


def _batch():
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, ids.roll(-1, dims=1)


def _moe_layers(model):
    return [block.mlp for block in model.layers if isinstance(block.mlp, MoELayer)]


def _gather(t, group, dim):
    """Every rank's ``t`` in group order (just ``[t]`` in the one-process reference)."""
    if group is None:
        return [t]
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _global_grads(model, groups):
    """Every grad as its global tensor: tp shards unsharded, expert shards unsharded over
    etp and stacked over ep."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach()
        if p.parallel == "tp":
            g = unshard_tp(_gather(g, groups.tp, p.tp_dim), p.tp_dim, p.tp_parts)
        elif p.parallel == "expert":
            g = unshard_tp(_gather(g, groups.etp, p.etp_dim), p.etp_dim, p.etp_parts)
            g = torch.cat(_gather(g, groups.ep, 0))
        out[name] = g.numpy().copy()
    return out


def _train(model, groups, micro_batches, global_grads=None):
    """STEPS AdamW steps over ``micro_batches`` (one per dp rank here, D in the reference):
    losses, the first step's global grads and grad norm, whether capacity dropped tokens.
    ``global_grads(model, groups)`` gathers the grads (default: by the contiguous expert split)."""
    global_grads = global_grads or _global_grads
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    num_tokens = sum(ids.numel() for ids, _ in micro_batches) * groups.size("dp_cp")
    losses, out, dropped = [], {}, 0.0
    for step in range(STEPS):
        opt.zero_grad()
        loss = 0.0
        for ids, labels in micro_batches:
            with router_outputs(model) as seen:
                mb_loss = model(ids, labels, num_loss_tokens=num_tokens, loss_scale=1.0 / len(micro_batches))
            mb_loss.backward()
            loss += mb_loss.detach()
            dropped = max(dropped, max_dropped_fraction(seen))
        sync_grads(model.parameters(), groups)
        if step == 0:
            out["grads"] = global_grads(model, groups)
            out["norm"] = grad_norm(model.parameters(), groups).item()
        losses.append((all_reduce(loss, groups.dp_cp) / groups.size("dp_cp")).item())
        opt.step()
    out["losses"], out["dropped"] = losses, dropped
    return out


# name -> (world, parallel sizes, model family, moe overrides). tp > 1 implies SP; etp
# defaults to tp (so "tp2" also splits every expert over etp 2). "dp4-ep2-edp2" is dp and
# ep folded with expert data parallelism: 4 ranks, attention dp4, experts ep2 x edp2.
DROP = dict(capacity_factor=1.0)
NO_DROP = dict(capacity_factor=8.0)
CASES = {
    # 2 ranks
    "dp2": (2, dict(), "mixtral", {}),
    "tp2": (2, dict(tp=2), "mixtral", {}),
    "ep2": (2, dict(ep=2), "mixtral", {}),
    "qwen2-dp2": (2, dict(), "qwen2", {}),
    "qwen2-tp2": (2, dict(tp=2), "qwen2", {}),
    "qwen2-ep2": (2, dict(ep=2), "qwen2", {}),
    "tp2-allgather": (2, dict(tp=2), "mixtral", dict(dispatcher="allgather")),
    "ep2-capacity-drop": (2, dict(ep=2), "mixtral", dict(DROP, drop_policy="position")),
    "ep2-pad-drop": (2, dict(ep=2), "qwen2", dict(DROP, pad_to_capacity=True)),
    # Multi-head latent attention: tp with SP (down-projections replicated, latents
    # gathered), tp without SP (dense layers only), ep, etp.
    "mla-tp2": (2, dict(tp=2), "mla", {}),
    "mla-dense-tp2-no-sp": (2, dict(tp=2), "mla-dense", {}),
    "gptoss-ep2": (2, dict(ep=2), "gptoss", {}),
    # 4 ranks
    "ep4": (4, dict(ep=4), "mixtral", {}),
    "mla-tp2-ep2": (4, dict(tp=2, ep=2, etp=1), "mla", {}),
    "mla-etp2-ep2": (4, dict(tp=2, ep=2, etp=2), "mla", {}),
    "tp2-ep2": (4, dict(tp=2, ep=2, etp=1), "mixtral", {}),
    "etp2-ep2": (4, dict(tp=2, ep=2, etp=2), "mixtral", {}),
    "gptoss-etp2-ep2": (4, dict(tp=2, ep=2, etp=2), "gptoss", {}),
    "gptoss-tp2-ep2": (4, dict(tp=2, ep=2, etp=1), "gptoss", {}),
    "dp4-ep2-edp2": (4, dict(ep=2), "mixtral", {}),
    "qwen2-ep4": (4, dict(ep=4), "qwen2", {}),
    "qwen2-tp2-ep2": (4, dict(tp=2, ep=2, etp=1), "qwen2", {}),
    "qwen2-etp2-ep2": (4, dict(tp=2, ep=2, etp=2), "qwen2", {}),
    "qwen2-dp4-ep2-edp2": (4, dict(ep=2), "qwen2", {}),
    "ep4-allgather": (4, dict(ep=4), "mixtral", dict(dispatcher="allgather")),
    "etp2-ep2-allgather": (4, dict(tp=2, ep=2, etp=2), "qwen2", dict(dispatcher="allgather")),
    "ep4-capacity-drop": (4, dict(ep=4), "mixtral", DROP),
    "dp4-ep2-capacity-drop-allgather": (4, dict(ep=2), "qwen2", dict(DROP, dispatcher="allgather")),
    "ep4-pad-drop": (4, dict(ep=4), "mixtral", dict(DROP, pad_to_capacity=True)),
    "tp2-ep2-capacity": (4, dict(tp=2, ep=2, etp=1), "mixtral", NO_DROP),
    "etp2-ep2-pad": (4, dict(tp=2, ep=2, etp=2), "qwen2", dict(NO_DROP, pad_to_capacity=True)),
    "ep4-dedup": (4, dict(ep=4), "mixtral", dict(dedup=True)),
    "tp2-ep2-dedup": (4, dict(tp=2, ep=2, etp=1), "qwen2", dict(dedup=True)),
    "etp2-ep2-dedup-capacity": (4, dict(tp=2, ep=2, etp=2), "mixtral", dict(NO_DROP, dedup=True)),
    # 8 ranks: tp2 x dp4 attention, etp1 x ep4 x edp2 experts
    "tp2-ep4-dp4-edp2": (8, dict(tp=2, ep=4, etp=1), "mixtral", {}),
    "qwen2-tp2-ep4-dp4-edp2-dedup": (8, dict(tp=2, ep=4, etp=1), "qwen2", dict(dedup=True)),
}


def _case_config(name):
    _, sizes, family, moe = CASES[name]
    # tp > 1 implies SP, but for the dense model that checks tp without it.
    return _config(family, sp=sizes.get("tp", 1) > 1 and family != "mla-dense", **moe)


def _rank(rank, world_size, names):
    """Train every case of ``names`` in turn: starting ranks costs more than a case."""
    groups_of, results = {}, []
    for name in names:
        sizes = CASES[name][1]
        key = tuple(sorted(sizes.items()))
        if key not in groups_of:
            groups_of[key] = create_process_groups(ParallelLayout(world_size, **sizes))
        groups = groups_of[key]
        model = build_model(_case_config(name), groups)
        ids, labels = _batch()
        dp, me = groups.size("dp_cp"), groups.rank_in("dp_cp")
        rows = slice(me * BATCH // dp, (me + 1) * BATCH // dp)
        # Whole sequences: under SP the embedding keeps this rank's shard and the LM head
        # gathers the sequence back, so every tp rank computes the same loss.
        results.append(_train(model, groups, [(ids[rows], labels[rows])]))
    return results


_REFERENCES: dict = {}


def _reference(name):
    """One process, the dp shards of the layout as micro-batches (see the module docstring)."""
    world, sizes, _, _ = CASES[name]
    d = world // sizes.get("tp", 1)
    config = _case_config(name)
    config.parallel.sequence_parallel = False
    key = (repr(config), d)
    if key not in _REFERENCES:
        groups = ProcessGroups.single_process()
        ids, labels = _batch()
        micro = [(ids[i * BATCH // d:(i + 1) * BATCH // d], labels[i * BATCH // d:(i + 1) * BATCH // d])
                 for i in range(d)]
        _REFERENCES[key] = _train(build_model(config, groups), groups, micro)
    return _REFERENCES[key]


def _check(names, results):
    for i, name in enumerate(names):
        ref = _reference(name)
        assert ref["losses"][-1] < ref["losses"][0], name
        drops = name.endswith("-drop") or "-drop-" in name
        assert (ref["dropped"] > 0) == drops, f"{name}: dropped fraction {ref['dropped']}"
        for rank, per_rank in enumerate(results):
            got, where = per_rank[i], f"{name} rank {rank}"
            assert_run_matches(got, ref, where)
            assert got["dropped"] > 0 if drops else got["dropped"] == 0, where


def _names(world):
    return [name for name, case in CASES.items() if case[0] == world]


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(world):
    names = _names(world)
    _check(names, run_ranks(_rank, world, names, timeout=400))


@pytest.mark.slow
def test_eight_rank_layouts_match_single_process():
    names = _names(8)
    _check(names, run_ranks(_rank, 8, names, timeout=400))

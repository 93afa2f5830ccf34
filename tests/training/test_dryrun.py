"""The dry run (moe_fold/training/dryrun.py): every rank of a fake world of 32 built with the
real code and stepped once on meta tensors.

- The collective order: for every group, its ranks issue the same collectives in the same
  order with matching sizes (all-to-all splits: what i sends to j is what j expects), and
  every send meets its receive, over the folded layouts of tests/parallel/test_parallel_matrix.py
  (folding, dedup, overlap chunks, interleaved pp, all-to-all cp) under adversarial
  routing: an ep rank no token reaches, every token to the same experts, Zipf.
- Memory by kind against the parameters the rank holds, and the planner against the dry run
  (weights, grads, optimizer bytes per rank, bytes per group per step).
- The routing rules and the dry run's refusals (the command: tests/cli/test_dryrun.py).
"""

import dataclasses

import pytest

from moe_fold.config import ConfigError
from moe_fold.dispatch.planned_routing import parse_routing
from moe_fold.layout import ParallelLayout
from moe_fold.training.dryrun import _Tracer, default_ranks, dry_run, order_mismatches, trace_rank
from tests.parallel.test_parallel_matrix import QWEN3_NEXT_LAYERS, ROW_DOCS, _config

WORLD = 32

# name -> (parallel settings, moe settings, routing[, packed documents[, model settings]]):
# each a layout of the parallel matrix grown to 32 ranks, under a routing that leaves a rank
# or an expert without tokens.
ORDER_CASES = {
    "fold-tp2-ep4-etp1-pp2-starve": (dict(tp=2, ep=4, etp=1, pp=2, sequence_parallel=True), {}, "starve-rank:1"),
    "dedup-tp2-ep8-etp1-one-expert": (dict(tp=2, ep=8, etp=1, sequence_parallel=True), dict(dedup=True),
                                      "one-expert"),
    "overlap-chunks-ep8-starve": (dict(ep=8), dict(overlap_chunks=2, shared_expert_overlap=False),
                                  "starve-rank:7"),
    "pp2-vpp2-ep4-interleaved-zipf": (dict(pp=2, vpp=2, ep=4, pp_schedule="interleaved"), {}, "zipf:2"),
    "cp2-a2a-tp2-ep4-etp2-one-expert": (dict(cp=2, tp=2, ep=4, cp_kind="a2a", sequence_parallel=True), {},
                                        "one-expert"),
    "cp2-ring-tp2-pp2-ep2-etp1-one-expert": (dict(cp=2, tp=2, pp=2, ep=2, etp=1, cp_kind="ring",
                                                  sequence_parallel=True), {}, "one-expert"),
    "cp2-ring-ep4-packed-starve": (dict(cp=2, ep=4, cp_kind="ring"), {}, "starve-rank:2", ROW_DOCS),
    "dynamic-cp4-ring-ep4-packed-zipf": (dict(cp=4, ep=4, cp_kind="ring", dynamic_cp=True), {}, "zipf:2",
                                         ROW_DOCS),
    "dynamic-cp2-a2a-ep8-packed-starve": (dict(cp=2, ep=8, cp_kind="a2a", dynamic_cp=True), {}, "starve-rank:5",
                                          ROW_DOCS),
    "gdn-cp2-ring-ep4-packed-one-expert": (dict(cp=2, ep=4, cp_kind="ring"), {}, "one-expert", ROW_DOCS,
                                           QWEN3_NEXT_LAYERS),
}


def _tiny(parallel: dict, moe: dict, model: dict = None):
    config = _config(model)
    config.train.micro_batch_size, config.train.global_batch_size = 1, 2 * WORLD
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    for key, value in moe.items():
        setattr(config.moe, key, value)
    return config


def _trace_all(config, routing, row_docs=None):
    shapes = {}
    return [trace_rank(config, WORLD, r, parse_routing(routing), shapes, row_docs) for r in range(WORLD)]


def _case(name):
    parallel, moe, routing, row_docs, model = (ORDER_CASES[name] + (None, None))[:5]
    return _tiny(parallel, moe, model), routing, row_docs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ORDER_CASES))
def test_every_group_issues_one_order_of_collectives(name):
    config, routing, row_docs = _case(name)
    traces = _trace_all(config, routing, row_docs)
    assert order_mismatches(traces) == []
    # The step really communicated over the expert groups and (pp > 1) between stages.
    ops = {(c.op, c.group) for t in traces for c in t.collectives}
    assert ("all_to_all", "ep") in ops and ("all_gather", "etp_ep") in ops
    if config.parallel.pp > 1:
        assert ("send", "pp") in ops and ("recv", "pp") in ops


def test_collective_order_holds_with_a_starved_rank():
    """The fast row of the matrix above (folded tp2 x ep4 x pp2, ep rank 1 starved)."""
    traces = _trace_all(*_case("fold-tp2-ep4-etp1-pp2-starve"))
    assert order_mismatches(traces) == []
    starved = [t for t in traces if t.coords["ep"] == 1]
    received = [c.shape[1] for t in starved for c in t.collectives if c.op == "all_to_all"]
    # Dispatches into the starved rank carry no rows (combines send none back).
    assert received and any(sum(splits) == 0 for splits in received)


def test_order_check_names_the_group_the_position_and_the_ranks():
    traces = _trace_all(_tiny(dict(ep=4), {}), "balanced")
    victim = traces[5]
    first_a2a = next(i for i, c in enumerate(victim.collectives) if c.op == "all_to_all")
    del victim.collectives[first_a2a]
    problems = order_mismatches(traces)
    ep_group = ParallelLayout(WORLD, ep=4).group_of("ep", 5)
    assert problems and f"group ep {ep_group}" in problems[0]
    assert "rank 5" in problems[0] and f"rank {ep_group[0]}" in problems[0]


def test_the_tracer_follows_host_values_through_the_ops_they_feed():
    """Document ids copied from the host keep their values on meta tensors: host reads and
    value-sized ops (nonzero) are answered from them; a write from unknown values forgets them."""
    import torch

    tracer = _Tracer()
    with tracer:
        ids = torch.repeat_interleave(torch.arange(3, device="meta"), torch.tensor([2, 1, 3]).to("meta"),
                                      output_size=6)
        change = torch.ones(6, dtype=torch.bool, device="meta")
        change[1:] = ids[1:] != ids[:-1]
        assert torch.nonzero(change).flatten().cpu().tolist() == [0, 2, 3]
        assert int(ids.sum()) == 7 and ids.is_meta
        ids.add_(torch.empty(6, device="meta").long())
        with pytest.raises(RuntimeError, match="cannot read an integer from a meta tensor"):
            int(ids.sum())


def test_default_ranks_cover_every_stage_and_the_last_ep_rank():
    layout = ParallelLayout(32, tp=2, ep=4, etp=1, pp=2)
    ranks = default_ranks(layout)
    assert sorted({layout.coords(r)["pp"] for r in ranks}) == [0, 1]
    assert {layout.coords(r)["ep"] for r in ranks} == {0, 3}


def test_dry_run_refuses_bad_input():
    config = _tiny(dict(ep=4), {})
    with pytest.raises(ValueError, match="--ranks names rank 40, outside the world of 32 ranks"):
        dry_run(config, WORLD, [40], parse_routing("balanced"))
    with pytest.raises(ConfigError, match="parallel.ep"):
        dry_run(dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, ep=5)), WORLD, [0],
                parse_routing("balanced"))


def test_zero_experts_are_routed_counted_and_not_sent():
    """Zero-computation experts: the planned routing gives them their share of each token's
    slots, the dispatcher sends none of those rows, and the planner (``topk E/(E+Z)`` rows
    a token; the zero experts' output keeps the layer's input and its gate weight) agrees
    with the step: the ep bytes to the byte on the ranks whose tokens split evenly, the
    activations within 1.5%."""
    from moe_fold.config import load_config
    from moe_fold.planner.comm import step_bytes
    from moe_fold.planner.estimate import Assumptions, stage_memory

    world, shapes = 4, {}
    base = ["parallel.ep=4", "train.micro_batch_size=4", "train.global_batch_size=16", "train.precision=bf16"]
    sent = {}
    for zero in (0, 4):
        config = load_config("mixtral-tiny", base + [f"moe.zero_experts={zero}"])
        for rank in (0, 3):
            trace = trace_rank(config, world, rank, parse_routing("balanced"), shapes)
            sent[zero, rank] = sum(c.bytes for c in trace.collectives if c.group == "ep")
            planned = stage_memory(config, world, trace.pp_stage, Assumptions(memory_overhead=0))["activations"]
            assert trace.memory["activations"] == pytest.approx(planned, rel=0.015), (zero, rank)
        assert sent[zero, 3] == step_bytes(config, world, 0)["ep"], zero
    # 8 experts and 4 zero experts: two thirds of the rows travel.
    assert sent[4, 3] == pytest.approx(sent[0, 3] * 2 / 3, rel=0.01)


@pytest.mark.parametrize("sets", [["parallel.ep=4"], ["parallel.tp=2", "parallel.sequence_parallel=true",
                                                    "parallel.ep=2"]], ids=["ep4", "tp2-ep2-etp2"])
def test_latent_moe_planner_agrees_with_the_dry_run(sets):
    """A latent MoE (nemotron-h-tiny's experts in 40 of its 128 hidden columns): the planner's
    parameters are the built rank's, its weight, gradient and optimizer bytes and its
    activations within 1% of what the step held, and its bytes per group what the step sent
    (ep: latent rows, under half the bytes of the same model with hidden-wide experts)."""
    from moe_fold.config import load_config
    from moe_fold.planner.comm import step_bytes
    from moe_fold.planner.estimate import Assumptions, stage_memory

    world, shapes, seen = 4, {}, {}
    base = sets + ["train.micro_batch_size=2", "train.global_batch_size=8", "train.precision=bf16"]
    for latent in ("null", "40"):
        config = load_config("nemotron-h-tiny", base + [f"moe.latent_size={latent}"])
        for rank in (0, world - 1):
            trace = trace_rank(config, world, rank, parse_routing("balanced"), shapes)
            plan = stage_memory(config, world, trace.pp_stage, Assumptions(memory_overhead=0))
            sent: dict = {}
            for c in trace.collectives:
                sent[c.group] = sent.get(c.group, 0) + c.bytes
            seen[latent, rank] = sent["ep"]
            if latent == "null":
                continue
            assert trace.params == plan["params"], rank
            for kind in ("weights", "grads", "optimizer", "activations"):
                assert trace.memory[kind] == pytest.approx(plan[kind], rel=0.01), (rank, kind)
            planned = step_bytes(config, world, trace.pp_stage)
            for kind in set(planned) | set(sent):
                assert sent.get(kind, 0) == pytest.approx(planned.get(kind, 0), rel=0.01), (rank, kind)
    for rank in (0, world - 1):
        assert seen["40", rank] < 0.5 * seen["null", rank], rank


# A full-size preset at the world its comment names, or at a published layout of its model
# (bench/published/, the row's id in the name), cut to a few layers and micro-batches so
# the test is quick: (preset, world, overrides).
_FOLDING_57B = ["model.num_layers=8", "parallel.tp=2", "parallel.pp=4", "parallel.vpp=2", "parallel.ep=4",
                "parallel.pp_schedule=interleaved", "parallel.sequence_parallel=true", "moe.capacity_factor=1.0",
                "moe.shared_expert_overlap=true", "optimizer.distributed=true", "train.global_batch_size=32"]
AGREEMENT_CASES = {
    "mixtral-8x22b": ("mixtral-8x22b", 128, ["model.num_layers=8", "parallel.vpp=null", "parallel.pp_schedule=1f1b",
                                             "train.global_batch_size=32"]),
    "deepseek-v3": ("deepseek-v3", 1024, ["model.num_layers=16", "moe.first_k_dense=1", "parallel.vpp=null",
                                          "parallel.pp_layers=null", "parallel.pp_schedule=1f1b",
                                          "train.global_batch_size=512"]),
    "mixtral-8x7b": ("mixtral-8x7b", 64, ["model.num_layers=8", "train.global_batch_size=8"]),
    "mcore08-mixtral-8x7b": ("mixtral-8x7b", 64, ["model.num_layers=8", "parallel.tp=1", "parallel.pp=4",
                                                  "parallel.vpp=2", "parallel.pp_schedule=interleaved",
                                                  "parallel.sequence_parallel=false", "optimizer.distributed=true",
                                                  "train.global_batch_size=64"]),
    "qwen2-57b-a14b": ("qwen2-57b-a14b", 64, ["model.num_layers=4", "train.global_batch_size=16"]),
    "liu25-qwen2-57b-a14b-folding": ("qwen2-57b-a14b", 64, _FOLDING_57B + ["parallel.etp=1"]),
    "liu25-qwen2-57b-a14b-mcore": ("qwen2-57b-a14b", 64, _FOLDING_57B + ["parallel.etp=2"]),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", 8, ["model.num_layers=2", "train.global_batch_size=16"]),
    "bridge2604-qwen3-30b-a3b": ("qwen3-30b-a3b", 16, ["model.num_layers=2", "parallel.ep=16",
                                                       "optimizer.distributed=true", "train.recompute=none",
                                                       "train.global_batch_size=32"]),
    "deepseek-v2-lite": ("deepseek-v2-lite", 8, ["model.num_layers=3", "train.global_batch_size=16"]),
    "ernie-4.5-21b-a3b": ("ernie-4.5-21b-a3b", 8, ["model.num_layers=3", "train.global_batch_size=8"]),
    "gpt-oss-20b": ("gpt-oss-20b", 8, ["model.num_layers=2", "model.local_attention_layers=[1,0]",
                                       "train.global_batch_size=16"]),
    "llama4-scout": ("llama4-scout", 64, ["model.num_layers=4", "model.local_attention_layers=[1,1,1,0]",
                                          "model.rope_layers=[1,1,1,0]", "train.global_batch_size=32"]),
    "minimax-m2": ("minimax-m2", 128, ["model.num_layers=4", "parallel.pp_layers=null", "train.global_batch_size=64"]),
    # Nemotron-H's single-mixer layers: Mamba2, relu2 MoE and NoPE attention, one per layer.
    "nemotron-3-nano-30b-a3b": ("nemotron-3-nano-30b-a3b", 16, [
        "model.num_layers=6", "model.layer_types=[mamba2,moe,attention,mamba2,moe,attention]",
        "model.rope_layers=[0,0,0,0,0,0]", "train.global_batch_size=16"]),
    "qwen3.5-35b-a3b": ("qwen3.5-35b-a3b", 16, ["model.num_layers=4", "train.global_batch_size=16",
                                                "model.layer_types=[gated_deltanet,attention,gated_deltanet,attention]"]),
    "kimi-linear-48b-a3b": ("kimi-linear-48b-a3b", 32, ["model.num_layers=3", "model.layer_types=[kda,kda,attention]",
                                                        "model.rope_layers=[0,0,0]", "train.global_batch_size=32"]),
    "longcat-flash": ("longcat-flash", 1024, ["model.num_layers=4", "train.global_batch_size=128"]),
    "deepseek-v32": ("deepseek-v32", 1024, ["model.num_layers=16", "moe.first_k_dense=1", "parallel.vpp=null",
                                            "parallel.pp_layers=null", "parallel.pp_schedule=1f1b",
                                            "train.global_batch_size=512"]),
    "glm-5": ("glm-5", 768, ["model.num_layers=12", "moe.first_k_dense=1", "train.global_batch_size=1024"]),
    # DSA under cp: keys, values and the indexer's keys all-gathered (not a ring).
    "deepseek-v32-cp2": ("deepseek-v32", 128, ["model.num_layers=4", "moe.first_k_dense=1", "parallel.pp=2",
                                               "parallel.vpp=null", "parallel.pp_layers=null", "parallel.pp_schedule=1f1b",
                                               "parallel.cp=2", "train.global_batch_size=16"]),
}


@pytest.mark.parametrize("name", list(AGREEMENT_CASES))
def test_planner_agrees_with_the_dry_run(name):
    """Per rank: the planner's parameters, weight, gradient and optimizer bytes equal what
    the built rank holds (1%), and its bytes per group per step what the step sent."""
    from moe_fold.config import load_config
    from moe_fold.planner.comm import step_bytes
    from moe_fold.planner.estimate import Assumptions, stage_memory

    preset, world, overrides = AGREEMENT_CASES[name]
    config = load_config(preset, overrides)
    p = config.parallel
    layout = ParallelLayout(world, tp=p.tp, cp=p.cp, pp=p.pp, ep=p.ep, etp=p.etp)
    shapes = {}
    for rank in (layout.groups("pp")[0][0], layout.groups("pp")[-1][-1]):
        trace = trace_rank(config, world, rank, parse_routing("balanced"), shapes)
        plan = stage_memory(config, world, trace.pp_stage, Assumptions(memory_overhead=0))
        assert trace.params == plan["params"], (rank, trace.params, plan["params"])
        for kind in ("weights", "grads", "optimizer"):
            assert trace.memory[kind] == pytest.approx(plan[kind], rel=0.01), (rank, kind)
        sent: dict = {}
        for c in trace.collectives:
            sent[c.group] = sent.get(c.group, 0) + c.bytes
        planned = step_bytes(config, world, trace.pp_stage)
        for kind in set(planned) | set(sent):
            assert sent.get(kind, 0) == pytest.approx(planned.get(kind, 0), rel=0.01, abs=1e5), (rank, kind)


# (preset, world, overrides, ranks): ranks whose peak of activations the planner is held to
# within 5% of the dry run's (docs/dryrun.md has the table). The fast rows are reduced
# models whose peak one effect sets.
_DS16 = ["model.num_layers=16", "parallel.vpp=2", "parallel.pp_layers=null", "train.global_batch_size=512"]
_DSA4 = ["model.num_layers=4", "moe.first_k_dense=1", "parallel.pp=2", "parallel.vpp=null", "parallel.pp_layers=null",
         "parallel.pp_schedule=1f1b", "train.global_batch_size=32"]
ACTIVATION_CASES = {
    # The interleaved schedule holds 4.5 micro-batches in flight on the last stage, but its
    # last chunk runs each backward straight after the forward: the heads, MTP and the
    # loss's backward for one micro-batch (the loss's float32 logit grads are the peak).
    "deepseek-v3-vpp2-last": ("deepseek-v3", 1024, _DS16 + ["moe.first_k_dense=1"], [1023]),
    # The schedule keeps each chunk's output until its backward: 15 chunk-micro-batches in
    # flight on the first stage, one hidden state each.
    "deepseek-v3-vpp2-first": ("deepseek-v3", 1024, _DS16 + ["moe.first_k_dense=1"], [0]),
    # Dense layers only on the first stage, under full recompute: the peak is a dense
    # block's backward, with the block rebuilt by its recompute (a small vocabulary keeps
    # the embedding's gradient bucket below it).
    "deepseek-v3-dense-backward": ("deepseek-v3", 1024, _DS16 + ["moe.first_k_dense=9", "model.vocab_size=16384"],
                                   [0]),
    # The same with the full vocabulary: the peak is the distributed optimizer's
    # all-gather of the embedding's own 463M-element float32 bucket, after the schedule.
    "deepseek-v3-embedding-bucket": ("deepseek-v3", 1024, _DS16 + ["moe.first_k_dense=9"], [0]),
    # One layer a stage under 1F1B: the first stage's peak is an expert backward whose
    # weight gradient is the first (nothing to add it to); the last stage's is the
    # all-reduced float32 bucket of the head, with the bf16 grads' float32 copies.
    "mixtral-8x22b-reduced": ("mixtral-8x22b", 128, ["model.num_layers=8", "parallel.vpp=null",
                                                     "parallel.pp_schedule=1f1b", "train.global_batch_size=32"],
                              [0, 127]),
    # Gated DeltaNet under full recompute: the first stage's peak is a layer's forward,
    # whose recurrence's tensors live until it returns though the checkpoint keeps none.
    "qwen3-next-reduced": ("qwen3-next-80b-a3b", 32, [
        "model.num_layers=8", "train.global_batch_size=32", "model.layer_types=[gated_deltanet,gated_deltanet,"
        "gated_deltanet,attention,gated_deltanet,gated_deltanet,gated_deltanet,attention]"], [0]),
    # KDA under full recompute: the peak is a KDA layer's backward, its mixer rebuilt and
    # the per-channel products' [C, C, d] float32 gradients, after the head's backward freed
    # its logits.
    "kimi-linear-reduced": ("kimi-linear-48b-a3b", 32, ["model.num_layers=4", "model.layer_types=[kda,kda,kda,attention]",
                                                        "model.rope_layers=[0,0,0,0]", "train.global_batch_size=32"],
                            [0]),
    # DSA under full recompute: the peak is the softmax of a DSA attention rebuilt in its
    # backward (its dense float32 scores, their masked copy and the probabilities, with the
    # indexer's per-head scores), in both training stages and under cp (every key gathered);
    # on the last stage the MTP depth's, while the model's head still holds its logits;
    # GLM-5's, with shared layers, the indexer's backward (the gradient of its keys
    # broadcast over the queries).
    "deepseek-v32-reduced": ("deepseek-v32", 128, _DSA4, [0, 127]),
    "deepseek-v32-reduced-dense": ("deepseek-v32", 128, _DSA4 + ["model.dsa_stage=dense_warmup"], [0]),
    "deepseek-v32-reduced-cp2": ("deepseek-v32", 128, _DSA4 + ["parallel.cp=2", "train.global_batch_size=16"], [0]),
    # Without the KL loss the indexer keeps nothing, but its graph lives through the forward
    # that rebuilds the attention, up to the softmax.
    "deepseek-v32-reduced-no-kl": ("deepseek-v32", 128, _DSA4 + ["model.dsa_indexer_loss_weight=0"], [0]),
    "glm-5-reduced": ("glm-5", 128, ["model.num_layers=4", "moe.first_k_dense=1", "parallel.pp=2",
                                     "train.global_batch_size=32", "model.indexer_types=[full,shared,full,shared]"],
                      [0, 127]),
    "mixtral-8x22b": ("mixtral-8x22b", 128, [], [0, 127]),
    # The MoE Parallel Folding paper's Table 3 layouts (bench/published/moe_parallel_folding.csv).
    "mixtral-8x22b-folding": ("mixtral-8x22b", 128, ["parallel.tp=2", "parallel.ep=8", "parallel.etp=1",
                                                     "moe.capacity_factor=1.0"], [0, 127]),
    "mixtral-8x22b-mcore": ("mixtral-8x22b", 128, ["parallel.tp=2", "parallel.ep=4", "parallel.etp=2",
                                                   "moe.capacity_factor=1.0"], [0, 127]),
    "deepseek-v3": ("deepseek-v3", 1024, [], [0, 256, 1023]),
    # At its comment's layout (PP2 EP16 on 32 GPUs), two micro-batches a rank.
    "qwen3-next-80b-a3b": ("qwen3-next-80b-a3b", 32, ["train.global_batch_size=32"], [0, 31]),
    # A sliding window and sinks: the dry run holds them as flex does (out and lse), not as
    # the CPU's math path (the float32 scores).
    "gpt-oss-20b-2-layers": ("gpt-oss-20b", 8, ["model.num_layers=2", "model.local_attention_layers=[1,0]",
                                                "train.global_batch_size=16"], [0]),
    # Llama-4's float32 L2 QK-norm and its scores scaling the expert rows (vocabulary cut
    # so the layers, not the loss, make the peak).
    "llama4-scout-8-layers": ("llama4-scout", 64, ["model.num_layers=8", "model.local_attention_layers=[1,1,1,0,1,1,1,0]",
                                                   "model.rope_layers=[1,1,1,0,1,1,1,0]", "model.vocab_size=2048",
                                                   "train.recompute=none", "train.global_batch_size=16"], [0]),
}
FULL_SIZE = ("mixtral-8x22b", "mixtral-8x22b-folding", "mixtral-8x22b-mcore", "deepseek-v3", "qwen3-next-80b-a3b")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in FULL_SIZE else n
                                  for n in ACTIVATION_CASES])
def test_planned_activations_agree_with_the_dry_run(name):
    """The planner's activations (the most a rank holds at once over its pipeline
    schedule, the hidden states the schedule holds and a backward's working memory
    included, or the gradient reduction's buffers after it) within 5% of what the dry
    run's step held. The full-size presets are the slow rows."""
    from moe_fold.config import load_config
    from moe_fold.planner.estimate import Assumptions, stage_memory

    preset, world, overrides, ranks = ACTIVATION_CASES[name]
    config = load_config(preset, overrides)
    shapes = {}
    for rank in ranks:
        trace = trace_rank(config, world, rank, parse_routing("balanced"), shapes)
        planned = stage_memory(config, world, trace.pp_stage, Assumptions(memory_overhead=0))["activations"]
        assert trace.memory["activations"] == pytest.approx(planned, rel=0.05), (rank, trace.memory, planned)

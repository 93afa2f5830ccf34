"""The curated mutants: the bugs we most fear in this code, and the tests that must catch them.

Each :class:`Mutant` replaces one snippet of one file (the snippet must occur exactly once)
with a plausible mistake. ``tests`` are pytest node ids, the fewest that must fail, the
fastest first (the runner stops at the first failure). How to run them and how to add
one: the docstring of ``run.py`` beside this file.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    original: str  # occurs exactly once in the file
    replacement: str
    bug: str  # the real mistake it models, one line
    tests: tuple[str, ...]  # pytest node ids that must fail with the mutant planted


ROUTER = "dispatch/router.py"
ALLTOALL = "dispatch/alltoall.py"
CP = "moe_fold/parallel/context_parallel.py"
SCHEDULES = "moe_fold/parallel/pipeline_schedules.py"
GRADS = "moe_fold/training/grads.py"
BUCKETS = "moe_fold/training/buckets.py"
OPTIM = "moe_fold/training/optim.py"
CHECKPOINT = "moe_fold/training/checkpoint.py"
TRAIN = "moe_fold/training/train.py"
RUN_SETUP = "moe_fold/training/run_setup.py"
LOADER = "moe_fold/data/loader.py"
REPLACE = "moe_fold/training/replace.py"
MTP = "models/mtp.py"
ROLLBACK = "moe_fold/training/rollback.py"
CADENCE = "moe_fold/training/cadence.py"
DELTA = "kernels/gated_delta.py"
SSD = "kernels/ssd.py"
MAMBA2 = "models/mamba2.py"
RECURRENT_CP = "moe_fold/parallel/recurrent_cp.py"
DSA = "models/dsa.py"

T_ROUTER = "tests/dispatch/test_router.py"
T_ROUTER_PARALLEL = "tests/dispatch/test_router_parallel.py::test_router_layout_invariance"
T_DISPATCH = "tests/dispatch/test_dispatcher.py"
T_PIPELINE = "tests/parallel/test_pipeline.py"
T_SCHEDULES = "tests/parallel/test_pipeline_schedules.py"
T_GRADS = "tests/training/test_grads.py::test_sync_and_norm_match_one_process"
T_ZERO = "tests/training/test_optim.py::test_distributed_optimizer_and_overlap_equal_plain_adamw"
T_ROUND_TRIP = "tests/training/test_checkpoint.py::test_round_trip_is_bit_exact_and_training_continues_identically"
T_LOADER = "tests/data/test_loader.py"
T_PLACEMENT = "tests/dispatch/test_placement.py"
T_ROLLBACK = "tests/training/test_rollback.py"
T_CADENCE = "tests/training/test_cadence.py"
T_DELTA = "tests/models/test_gated_deltanet.py"
T_KDA = "tests/models/test_kda.py"
T_SSD = "tests/kernels/test_ssd.py"
T_MAMBA2 = "tests/models/test_mamba2.py"
T_RECURRENT_CP = "tests/parallel/test_recurrent_cp.py"
T_DSA = "tests/models/test_dsa.py"
T_FAMILIES = "tests/models/hf/test_families.py"

MUTANTS: list[Mutant] = [
    # ------------------------------------------------------------------ routing
    Mutant(
        "router-presoftmax-dim", ROUTER,
        "scores = torch.softmax(work, dim=-1) if score",
        "scores = torch.softmax(work, dim=0) if score",
        "pre-softmax scores normalised over the tokens instead of the experts (swapped dims)",
        (f"{T_ROUTER}::test_topk_routing_matches_loop",)),
    Mutant(
        "router-group-blocks", ROUTER,
        "eligible = eligible.repeat_interleave(per_group, dim=1)",
        "eligible = eligible.repeat(1, per_group)",
        "group-limited routing: the group mask laid out strided (group g = experts g, g+G, ...) "
        "instead of in contiguous blocks",
        (f"{T_ROUTER}::test_group_limited_excludes_losing_groups",)),
    Mutant(
        "router-group-score-top1", ROUTER,
        "group_scores = _stable_topk(scores.view(num_tokens, num_groups, per_group), ranked)[0].sum(-1)",
        "group_scores = _stable_topk(scores.view(num_tokens, num_groups, per_group), 1)[0].sum(-1)",
        "a group scored by its best expert only, not the sum of its top topk/group_topk (or top 2)",
        (f"{T_ROUTER}::test_topk_routing_matches_loop",)),
    Mutant(
        "router-group-score-top2-as-megatron", "moe_fold/config/derived.py",
        '''return {"topk_sum": topk // group_topk, "top2_sum": 2, "max": 1}[group_score]''',
        '''return {"topk_sum": topk // group_topk, "top2_sum": topk // group_topk, "max": 1}[group_score]''',
        "DeepSeek-V3's top2_sum ranks a group by its best topk/group_topk scores (Megatron-Core's rule), "
        "which differs from transformers when num_experts_per_tok != 2 x topk_group",
        (f"{T_ROUTER}::test_group_score_by_hand",
         "tests/models/hf/test_families.py::test_import_matches_transformers_and_export_round_trips[deepseek_v3-groups_k3]")),
    Mutant(
        "router-sigmoid-norm-dim", ROUTER,
        "probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)",
        "probs = probs / (probs.sum(dim=0, keepdim=True) + 1e-20)",
        "sigmoid top-k probs normalised over the tokens instead of each token's k experts",
        (f"{T_ROUTER}::test_topk_routing_matches_loop",)),
    Mutant(
        "router-bias-in-probs", ROUTER,
        "probs = scores.gather(1, top)",
        "probs = (scores + expert_bias.to(scores.dtype)).gather(1, top)",
        "the aux-loss-free expert bias leaks into the routing weights (it must only steer selection)",
        (f"{T_ROUTER}::test_bias_changes_selection_not_probs",)),
    Mutant(
        "router-scaling-dropped", ROUTER,
        "        probs = probs * scaling_factor\n",
        "        probs = probs * 1.0\n",
        "moe.scaling_factor (routed_scaling_factor) ignored: a missing scale",
        (f"{T_ROUTER}::test_topk_routing_matches_loop",)),
    Mutant(
        "router-bias-update-sign", ROUTER,
        "step = rate * torch.sign(counts.mean() - counts)",
        "step = rate * torch.sign(counts - counts.mean())",
        "expert-bias step with the sign flipped: busy experts get more tokens, not fewer",
        (f"{T_ROUTER}::test_updated_expert_bias_by_hand",)),
    Mutant(
        "router-aux-group", ROUTER,
        "            packed = torch.cat(parts)\n            all_reduce_(packed, self.groups.tp_cp)",
        "            packed = torch.cat(parts)\n            all_reduce_(packed, self.groups.tp_dp_cp)",
        "the micro-batch aux loss counts reduced over tp x dp x cp (wrong group: dp ranks hold "
        "other micro-batches)",
        (T_ROUTER_PARALLEL,)),
    Mutant(
        "router-aux-cp-scale", ROUTER,
        "total = total + self.aux_loss_coeff * cp * load_balancing_loss(scores, c, n, k)",
        "total = total + self.aux_loss_coeff * load_balancing_loss(scores, c, n, k)",
        "the aux-loss gradient share not scaled by cp (grads are averaged over dp x cp afterwards)",
        (T_ROUTER_PARALLEL,)),
    Mutant(
        "router-global-aux-dp-scale", ROUTER,
        "total = total + self.global_aux_loss_coeff * cp * dp * load_balancing_loss(scores, running, n, k)",
        "total = total + self.global_aux_loss_coeff * cp * load_balancing_loss(scores, running, n, k)",
        "the global aux loss share not scaled by dp, although its loss spans the dp ranks",
        (T_ROUTER_PARALLEL,)),
    Mutant(
        "step-router-loss-scale", "moe_fold/training/step.py",
        "                             loss_scale=1.0 / m)",
        "                             loss_scale=1.0)",
        "the router losses' gradients not divided over the step's micro-batches (counted m times over)",
        ("tests/training/test_step.py::test_forward_backward_one_process_is_the_hand_loop",)),
    Mutant(
        "mtp-router-loss-scale", MTP,
        "        return self.block(x, cos, sin, docs, loss_scale=loss_scale)",
        "        return self.block(x, cos, sin, docs)",
        "an MTP depth's router takes its losses at full weight in every micro-batch of a step",
        ("tests/training/test_step.py::test_every_router_forward_of_a_step_gets_the_micro_batch_share",)),
    Mutant(
        "router-bias-counts-group", ROUTER,
        "all_reduce_(counts, self.groups.tp_dp_cp)",
        "all_reduce_(counts, self.groups.tp_cp)",
        "expert-bias counts summed over tp x cp only: dp ranks step their biases apart",
        (T_ROUTER_PARALLEL,)),
    Mutant(
        "seq-aux-token-count", ROUTER,
        "parts += [seq_counts.flatten(), seq_counts.sum(dim=1) / k, seq_prob_sums.flatten()]",
        "parts += [seq_counts.flatten(), seq_counts.sum(dim=1), seq_prob_sums.flatten()]",
        "sequence aux loss: each sequence's token count taken as its routed pairs (k per token)",
        (f"{T_ROUTER}::test_router_losses_and_gradient_match_reference",)),
    # ------------------------------------------------------------------ capacity
    Mutant(
        "capacity-floor", ROUTER,
        "return math.ceil((num_tokens * topk / num_experts) * capacity_factor)",
        "return int((num_tokens * topk / num_experts) * capacity_factor)",
        "expert capacity rounded down instead of up (off by one token per expert)",
        (f"{T_ROUTER}::test_capacity_values_and_policies_by_hand",)),
    Mutant(
        "capacity-position-policy", ROUTER,
        "        key = routing_map.to(probs.dtype)\n",
        "        key = torch.where(routing_map, probs.detach(), torch.full_like(probs, -1.0))\n",
        "drop policy 'position' keeps the highest-prob tokens (the 'probs' policy) instead of the earliest",
        (f"{T_ROUTER}::test_capacity_values_and_policies_by_hand",)),
    # ------------------------------------------------------------------ dispatch and combine
    Mutant(
        "a2a-chunk-sizes-order", ALLTOALL,
        "handle.chunk_sizes = dev[:, :, mine].transpose(0, 1).reshape(-1)",
        "handle.chunk_sizes = dev[:, :, mine].reshape(-1)",
        "received chunk sizes listed [ep][etp] while the rows arrive [etp][ep] (a dropped transpose)",
        (f"{T_DISPATCH}::test_four_ranks",)),
    Mutant(
        "a2a-tokens-per-expert-unsorted", ALLTOALL,
        "self._on_device(\"_order\", device))\n"
        "        handle.device_tokens_per_local_expert = dev[:, :, mine].sum(dim=(0, 1))",
        "self._on_device(\"_order\", device))\n"
        "        handle.device_tokens_per_local_expert = dev[:, :, :el].sum(dim=(0, 1))",
        "rows per local expert counted at ep rank 0's experts (global index le) instead of this rank's",
        (f"{T_DISPATCH}::test_four_ranks",)),
    Mutant(
        "a2a-combine-order", ALLTOALL,
        "x = chunks_sorted(x, handle.sorted_chunk_sizes, self._on_device(\"_inverse_order\", x.device),",
        "x = chunks_sorted(x, handle.sorted_chunk_sizes, self._on_device(\"_order\", x.device),",
        "combine sorts the expert outputs back with the forward chunk order, not its inverse",
        # The 2- and 4-rank layouts have self-inverse chunk orders (2 x 2, 2 x 2 x 2): only
        # ep 8 with 2 local experts, or ep 4 x etp 2, tells the order from its inverse.
        (f"{T_DISPATCH}::test_eight_ranks",)),
    Mutant(
        "dedup-row-map-first-rank", ALLTOALL,
        "row_map = local_map[handle.sorted_indices, dest].to(probs.dtype)  # [R, E_local]",
        "row_map = local_map[handle.sorted_indices, 0].to(probs.dtype)  # [R, E_local]",
        "deduplicated all-to-all: every row carries its routing map over ep rank 0's experts, "
        "not over its destination's",
        (f"{T_DISPATCH}::test_two_ranks",)),
    Mutant(
        "allgather-local-experts", "dispatch/allgather.py",
        "e, mine = self.num_slots, slice(self.local_expert_start, self.local_expert_start + self.num_local_experts)",
        "e, mine = self.num_slots, slice(0, self.num_local_experts)",
        "all-gather dispatcher: every ep rank keeps the rows of the first ep rank's experts",
        (f"{T_DISPATCH}::test_two_ranks",)),
    Mutant(
        "permute-padded-slot-off-by-one", "kernels/permute.py",
        "pos = torch.cumsum(routing_map, dim=0) - 1  # [T, E]: rank within the expert",
        "pos = torch.cumsum(routing_map, dim=0)  # [T, E]: rank within the expert",
        "padded layout: a token's slot counts itself (1-based), so each expert's rows shift by one",
        ("tests/kernels/test_permute.py::test_permute_padded_layout",)),
    Mutant(
        "expert-probs-dropped", "models/experts.py",
        "inner = probs if self.fc2_bias is None else None",
        "inner = torch.ones_like(probs) if self.fc2_bias is None else None",
        "expert outputs not weighted by their routing probs before the combine (a dropped term)",
        ("tests/models/test_moe_layer.py::test_layer_matches_loop_reference_forward_and_backward",)),
    Mutant(
        "expert-bias-etp-repeated", "models/experts.py",
        "start = self.etp_rank * width",
        "start = 0",
        "every etp rank adds its fc2 bias slice into the first columns: the bias lands in the wrong "
        "columns and the etp sum adds it etp times there",
        ("tests/parallel/test_layout_invariance.py::test_layouts_match_single_process[4]",)),
    Mutant(
        "gmm-bias-group-order", "kernels/gmm.py",
        "return out + bias.repeat_interleave(counts, dim=0, output_size=out.shape[0])",
        "return out + bias.flip(0).repeat_interleave(counts, dim=0, output_size=out.shape[0])",
        "per-expert biases gathered in the wrong expert order",
        ("tests/kernels/test_gmm.py::test_bias_with_tensor_counts_and_bad_bias_raises",)),
    # ------------------------------------------------------------------ context parallel, rotary
    Mutant(
        "zigzag-mirror", CP,
        "return torch.cat([chunks[cp_rank], chunks[n - 1 - cp_rank]], dim)",
        "return torch.cat([chunks[cp_rank], chunks[cp_rank + cp_size]], dim)",
        "cp rank r takes chunks r and r+cp (striped) instead of r and 2cp-1-r (zigzag)",
        ("tests/parallel/test_context_parallel.py::test_zigzag_split_takes_chunks_r_and_mirror",)),
    Mutant(
        "zigzag-gather-late-chunks", CP,
        "return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)",
        "return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)",
        "gathering zigzag shards puts the late chunks in rank order instead of reversed",
        ("tests/parallel/test_context_parallel.py::test_context_parallel_matches_full_attention",)),
    Mutant(
        "a2a-heads-to-seq-order", CP,
        "y = torch.cat([zigzag_split(y, r, cp, dim=2) for r in range(cp)])  # [cp*H/cp, B, S/cp, D]",
        "y = torch.cat([zigzag_split(y, r, cp, dim=2) for r in reversed(range(cp))])  # [cp*H/cp, B, S/cp, D]",
        "a2a (Ulysses) cp: the outputs go back to the cp ranks in reverse order",
        ("tests/parallel/test_context_parallel.py::test_context_parallel_matches_full_attention",)),
    Mutant(
        "rotary-default-positions", "models/model.py",
        "return zigzag_positions(input_ids.shape[1] * cp, self.groups.rank_in(\"cp\"), cp, device=input_ids.device)",
        "return torch.arange(input_ids.shape[1], device=input_ids.device)",
        "under cp the default rotary positions are 0..S_local-1, not the rank's zigzag positions",
        ("tests/models/test_model.py::test_context_parallel_default_positions_are_the_rank_zigzag_shard",)),
    Mutant(
        "rotary-backward-sign", "models/rotary.py",
        "out[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1.0)",
        "out[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=1.0)",
        "the hand-written rotary backward rotates by +angle instead of the transpose (-angle)",
        ("tests/models/test_norm.py::test_rotary_equals_rotate_half_formula_and_its_autograd",)),
    Mutant(
        "loss-scale-dp", "models/model.py",
        "return losses.sum() * (dp_cp / num_loss_tokens)",
        "return losses.sum() / num_loss_tokens",
        "the per-rank loss not scaled by dp x cp, while the grads are averaged over dp x cp",
        ("tests/models/test_model.py::test_layouts_match_single_process",)),
    Mutant(
        "pp-tied-grads-not-summed", "moe_fold/parallel/pipeline.py",
        "    all_reduce_(weight.grad, group)\n",
        "    pass\n",
        "under pp the two copies of a tied embedding keep their own grads (not summed): they drift apart",
        (f"{T_PIPELINE}::test_pp2_schedules_match_single_process",)),
    # ------------------------------------------------------------------ pipeline schedules
    Mutant(
        "1f1b-warmup", SCHEDULES,
        "warmup = min(pp - rank - 1, m)",
        "warmup = min(pp - rank, m)",
        "1F1B warm-up one forward too many (a rank holds pp - r + 1 micro-batches' activations)",
        (f"{T_SCHEDULES}::test_1f1b_order_pp4_rank1",)),
    Mutant(
        "interleaved-backward-chunks", SCHEDULES,
        "chunks = range(vpp) if kind == \"F\" else range(vpp - 1, -1, -1)",
        "chunks = range(vpp)",
        "interleaved backwards visit the model chunks first to last instead of last to first",
        (f"{T_SCHEDULES}::test_interleaved_order_pp2_vpp2_rank1",)),
    Mutant(
        "interleaved-warmup", SCHEDULES,
        "warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, m * vpp)",
        "warmup = min((pp - rank - 1) + (vpp - 1) * pp, m * vpp)",
        "interleaved warm-up without the factor 2 on the rank's distance to the last stage",
        (f"{T_SCHEDULES}::test_plan_is_complete_consistent_and_has_the_textbook_bubble",)),
    Mutant(
        "pp-stage-placement", SCHEDULES,
        "return [c * pp + rank for c in range(vpp)]",
        "return [rank * vpp + c for c in range(vpp)]",
        "virtual stages placed contiguously per rank instead of Megatron's round-robin c*pp + r",
        (f"{T_SCHEDULES}::test_rank_stages_megatron_placement",)),
    # ------------------------------------------------------------------ grad norm
    Mutant(
        "norm-tp-sum-counted-per-tp", GRADS,
        "by_kind[\"replicated\" if kind == \"tp_sum\" else kind].append(p.grad)",
        "by_kind[\"tp\" if kind == \"tp_sum\" else kind].append(p.grad)",
        "grad norm: a tp_sum grad (the same on every tp rank after sync) summed over tp, counted tp times",
        (T_GRADS,)),
    Mutant(
        "norm-tp-group", GRADS,
        "all_reduce_(sums[\"tp\"], groups.tp)",
        "all_reduce_(sums[\"tp\"], groups.tp_dp_cp)",
        "grad norm: the squares of tp shards summed over tp x dp x cp (wrong group, counts dp copies)",
        (T_GRADS,)),
    Mutant(
        "norm-expert-group", GRADS,
        "        all_reduce_(packed, groups.etp_ep)\n",
        "        all_reduce_(packed, groups.ep)\n",
        "grad norm: per-expert squares summed over ep only, missing the etp shards' parts",
        ("tests/parallel/test_layout_invariance.py::test_layouts_match_single_process",)),
    Mutant(
        "norm-pp-dropped", GRADS,
        "return all_reduce_(total.clone(), groups.pp).sqrt()",
        "return total.sqrt()",
        "grad norm not summed over the pipeline stages: each stage clips by its own norm",
        ("tests/dispatch/test_placement.py::test_any_placement_matches_single_process_under_pp",)),
    Mutant(
        "norm-tied-copy-counted", GRADS,
        "params = [p for p in params if not getattr(p, \"tied_copy\", False)]",
        "params = list(params)",
        "grad norm under pp counts the last stage's copy of a tied embedding a second time",
        ("tests/parallel/test_parallel_matrix.py::test_cp_and_pp_layouts_match_single_process",)),
    Mutant(
        "zero-norm-replicated-repeat", GRADS,
        "(repeated and s.param.parallel == \"replicated\")",
        "(repeated and s.param.parallel == \"tp_sum\")",
        "ZeRO grad norm: skips the wrong kind on tp ranks > 0 (replicated ranges counted tp times)",
        (T_GRADS,)),
    Mutant(
        "zero-norm-group", GRADS,
        "    all_reduce_(total, groups.tp_dp_cp)\n",
        "    all_reduce_(total, groups.dp_cp)\n",
        "ZeRO grad norm: owned squares summed over dp x cp only, missing the tp ranks' ranges",
        (T_GRADS,)),
    Mutant(
        "expert-copies-sum-group", GRADS,
        "all_reduce_(rows, groups.ep)",
        "all_reduce_(rows, groups.edp)",
        "an expert's copies (moe.replicas) sum their grads over edp instead of over ep",
        (f"{T_PLACEMENT}::test_any_placement_matches_single_process",)),
    Mutant(
        "sync-tp-sum-group", BUCKETS,
        "SYNC_GROUP = {\"tp\": \"dp_cp\", \"replicated\": \"dp_cp\", \"tp_sum\": \"tp_dp_cp\", \"expert\": \"edp\"}",
        "SYNC_GROUP = {\"tp\": \"dp_cp\", \"replicated\": \"dp_cp\", \"tp_sum\": \"dp_cp\", \"expert\": \"edp\"}",
        "grad sync: tp_sum grads (norms under SP) reduced over dp x cp only, missing the tp ranks' partial sums",
        (T_GRADS,)),
    # ------------------------------------------------------------------ ZeRO-1 shards
    Mutant(
        "zero-owned-offset", BUCKETS,
        "a = s.offset + s.start - lo",
        "a = s.start - lo",
        "reduce-scattered grads copied from the owned range without the parameter's offset in the bucket",
        (f"{T_ZERO}[2-cases0]",)),
    Mutant(
        "zero-update-slice", OPTIM,
        "grads = [s.param.grad.reshape(-1)[s.start:s.stop] if s.param.grad is not None",
        "grads = [s.param.grad.reshape(-1)[:s.stop - s.start] if s.param.grad is not None",
        "the distributed optimizer updates its owned slice with the grad's first elements, not the owned ones",
        (f"{T_ZERO}[2-cases0]",)),
    Mutant(
        "lr-warmup-off-by-one", OPTIM,
        "return lr * (step + 1) / w",
        "return lr * step / w",
        "warm-up starts at lr 0: the first optimizer step does not move",
        ("tests/training/test_optim.py::test_cosine_schedule_hand_computed",)),
    # ------------------------------------------------------------------ checkpoints, resume, data position
    Mutant(
        "ckpt-step-count", CHECKPOINT,
        "optimizer.step_count = int(index[\"optimizer\"][\"step_count\"])",
        "optimizer.step_count = 0",
        "resume restarts AdamW's step count (its bias correction starts over)",
        (f"{T_ROUND_TRIP}[False]",)),
    Mutant(
        "ckpt-rng-not-restored", CHECKPOINT,
        "_set_rng_state(json.loads(reader.verify(rng_name).read_text()))",
        "json.loads(reader.verify(rng_name).read_text())",
        "resume on the same layout does not restore the random states",
        (f"{T_ROUND_TRIP}[False]",)),
    Mutant(
        "ckpt-reshard-box", CHECKPOINT,
        "out[box(_sub(lo, offsets), size)] = value",
        "out[box(_sub(lo, piece[\"offsets\"]), size)] = value",
        "loading under another layout places a piece's overlap at its offset within the piece, "
        "not within the box asked for",
        ("tests/training/test_checkpoint.py::test_checkpoint_saved_under_one_layout_loads_under_another",)),
    Mutant(
        "ckpt-tied-written-twice", CHECKPOINT,
        "entries.append(_Entry(f\"model/{name}\", p.detach(), tuple(p.shape), info, 0, p.numel(),\n"
        "                              info.writer and not _tied_copy(p)))",
        "entries.append(_Entry(f\"model/{name}\", p.detach(), tuple(p.shape), info, 0, p.numel(),\n"
        "                              info.writer))",
        "under pp both stages write the tied embedding (the last stage's copy must only load it)",
        ("tests/training/test_checkpoint.py::test_pipeline_checkpoint_writes_a_tied_embedding_once_and_refuses_other_models",)),
    Mutant(
        "ckpt-verify-no-checksum", "moe_fold/training/checkpoint_verify.py",
        "problem = file_problem(report.path / name, record, checksum=checksums)",
        "problem = file_problem(report.path / name, record, checksum=False)",
        "`moe-fold checkpoint verify` checks sizes only, so a same-size corruption passes",
        ("tests/training/test_checkpoint_verify.py::test_a_flipped_byte_is_named_at_load_and_by_verify",)),
    Mutant(
        "ckpt-verify-bad-file-covers", "moe_fold/training/checkpoint_verify.py",
        "        if piece[\"file\"] in bad_files:\n            continue\n",
        "",
        "verify counts the expert rows of a missing or corrupt file as present",
        ("tests/training/test_checkpoint_verify.py::test_a_lost_expert_shard_is_reported_and_refused_by_export",)),
    Mutant(
        "resume-data-position", RUN_SETUP,
        "    run.loader.load_state_dict(extra[\"data\"])\n",
        "",
        "a resumed run starts the data over from sample 0 instead of the saved position",
        ("tests/training/test_train.py::test_resume_is_exact[fp32]",)),
    Mutant(
        "resume-bf16-model-stale", RUN_SETUP,
        "    if run.master is not None:\n        run.master.master_to_model()\n",
        "",
        "a resumed bf16 run loads the float32 masters but computes with the bf16 model's initial weights",
        ("tests/training/test_train.py::test_resume_is_exact[bf16]",)),
    Mutant(
        "packed-loss-mask-boundary", LOADER,
        "loss_mask[ends[ends <= S] - 1] = 0  # the label after a part's last token is another part",
        "loss_mask[ends[ends < S]] = 0  # the label after a part's last token is another part",
        "packed samples mask the label of a document's first token instead of the one across the boundary",
        (f"{T_LOADER}::test_packing_matches_reference_loop",)),
    Mutant(
        "data-dp-block", LOADER,
        "first = start_sample + dp_rank * micro_batch_size",
        "first = start_sample + dp_rank",
        "dp ranks take overlapping samples: rank r starts at sample r, not at r * micro_batch_size",
        (f"{T_LOADER}::test_dp_shards_cover_each_global_batch_once",)),
    Mutant(
        "data-consumed-per-rank", LOADER,
        "            self.consumed_samples += self.micro_batch_size * self.dp_size\n",
        "            self.consumed_samples += self.micro_batch_size\n",
        "the checkpointed data position counts this rank's samples, not every dp rank's",
        (f"{T_LOADER}::test_resume_equals_straight_iteration", "tests/training/test_train.py::test_resume_is_exact[fp32]")),
    Mutant(
        "data-epoch-reshuffle", LOADER,
        "j = int(self._order(i // self.num_samples, np.asarray([i % self.num_samples]))[0])",
        "j = int(self._order(0, np.asarray([i % self.num_samples]))[0])",
        "every epoch repeats the first epoch's order instead of its own shuffle",
        (f"{T_LOADER}::test_fixed_samples_tile_the_stream",)),
    # ------------------------------------------------------------------ expert re-placement
    Mutant(
        "replace-kept-slot", REPLACE,
        "local.append((i, held.index(expert)))",
        "local.append((i, i))",
        "an expert that stays on its rank keeps the slot index it had, not its own weights",
        (f"{T_PLACEMENT}::test_move_carries_weights_grads_and_moments_by_expert",)),
    Mutant(
        "replace-zero1-moments-group", REPLACE,
        "all_reduce_(whole, groups.edp)  # the edp ranks' ranges are disjoint",
        "all_reduce_(whole, groups.dp_cp)  # the edp ranks' ranges are disjoint",
        "under ZeRO-1 the experts' moment ranges are summed over dp x cp (wrong group) before a move",
        (f"{T_PLACEMENT}::test_move_carries_weights_grads_and_moments_by_expert",)),
    Mutant(
        "replace-window-not-restored", REPLACE,
        "            self.window = window\n",
        "            pass\n",
        "a resumed run forgets the re-placement load window, so it picks other placements than a straight run",
        ("tests/training/test_replace.py::test_resume_across_a_move_is_exact_and_checkpoints_load_anywhere",)),
    # ------------------------------------------------------------------ multi-token prediction
    Mutant(
        "mtp-document-boundary", MTP,
        "same_doc = docs[:, k:] == docs[:, :S - k]  # [B, S-k]",
        "same_doc = docs[:, k:] == docs[:, k:]  # [B, S-k]",
        "MTP targets cross into the next packed document (the same-document mask dropped)",
        ("tests/models/test_mtp.py::test_shift_stays_in_the_row_and_the_document",)),
    Mutant(
        "mtp-depth-mean", "models/model.py",
        "self.mtp_loss_factor = m.mtp_loss_weight / m.mtp_num_layers if m.mtp_num_layers > 0 else 0.0",
        "self.mtp_loss_factor = m.mtp_loss_weight if m.mtp_num_layers > 0 else 0.0",
        "the MTP loss sums the depths without dividing by their number (a missing scale)",
        ("tests/models/test_mtp.py::test_objective_is_deepseek_v3_formula",)),
    Mutant(
        "mtp-cp-natural-order", MTP,
        "local = zigzag_gather(shards, dim=2)  # [3, B, S]",
        "local = torch.cat(shards, dim=2)  # [3, B, S]",
        "MTP shifts under cp on the shards concatenated in rank order, not the zigzag-gathered sequence",
        ("tests/parallel/test_parallel_matrix.py::test_mtp_and_attention_variants_match_single_process",)),
    # ------------------------------------------------------------------ precision
    Mutant(
        "bf16-model-not-updated", TRAIN,
        "        if run.master is not None and not optimizer.distributed:\n"
        "            run.master.master_to_model()\n",
        "        if run.master is not None and not optimizer.distributed:\n"
        "            pass\n",
        "bf16: the optimizer steps the float32 masters but the bf16 model that computes is never refreshed",
        ("tests/training/test_train.py::test_bf16_keeps_float32_masters_and_tracks_fp32",)),
    Mutant(
        "autocast-router", "moe_fold/training/precision.py",
        "            module.forward = outside(module.forward)\n",
        "            pass\n",
        "under bf16 autocast the router's matmul runs in bf16 (its logits must stay float32)",
        ("tests/training/test_train.py::test_bf16_autocast_tracks_fp32",)),
    Mutant(
        "autocast-combine", "moe_fold/training/precision.py",
        "            dispatcher.combine = outside(dispatcher.combine)\n",
        "            pass\n",
        "under bf16 autocast the MoE combine runs inside autocast (it must sum expert rows in float32)",
        ("tests/training/test_train.py::test_bf16_autocast_tracks_fp32",)),
    # ------------------------------------------------------------------ issue 27's planted bugs
    Mutant(
        "bf16-masters-rounded", "moe_fold/training/precision.py",
        "            p.copy_(m)\n",
        "            p.copy_(m)\n            m.copy_(p)\n",
        "bf16: the float32 masters are rounded to bf16 after every step (they become copies of the model)",
        ("tests/training/test_train.py::test_bf16_keeps_float32_masters_and_tracks_fp32",)),
    Mutant(
        "ckpt-load-checksums-shards-only", CHECKPOINT,
        "        problem = file_problem(path, record)\n",
        "        problem = file_problem(path, record, checksum=name.endswith(\".safetensors\"))\n",
        "loading checks sha256 for the shard files only (random states, config.yaml and the index trusted)",
        ("tests/training/test_checkpoint_verify.py::test_same_size_damage_to_any_file_is_named_at_load_and_by_verify",)),
    Mutant(
        "combine-relative-error", ALLTOALL,
        "        return unpermuted(x, handle.sorted_indices, handle.num_tokens,\n",
        "        return (1 + 1e-6) * unpermuted(x, handle.sorted_indices, handle.num_tokens,\n",
        "every combine off by 1e-6 relative (dispatch compared at atol = rtol = 0 catches it)",
        (f"{T_DISPATCH}::test_two_ranks",)),
    # ------------------------------------------------------------------ GPU readiness (issue 26)
    Mutant(
        "allgather-count-on-host", "dispatch/allgather.py",
        "num_tokens = torch.full((1,), tokens.shape[0], dtype=torch.int64, device=tokens.device)",
        "num_tokens = torch.tensor([tokens.shape[0]], dtype=torch.int64)",
        "the all-gather dispatcher's token count built on the host: NCCL cannot gather it",
        ("tests/training/test_device_paths.py::test_moe_layer_collectives_get_device_tensors",)),
    Mutant(
        "gmm-autocast-not-cast", "kernels/gmm.py",
        "    x, w = _autocast_operands(x, w)\n    host = None if host_counts is None else list(host_counts)\n",
        "    host = None if host_counts is None else list(host_counts)\n",
        "the grouped GEMM ignores autocast: bf16 activations meet float32 weights",
        ("tests/training/test_device_paths.py::test_gmm_under_autocast_is_the_gemm_of_cast_operands",)),
    Mutant(
        "permute-row-count-synced", ALLTOALL,
        "num_rows=sum(handle.input_splits))  # [T, H] -> [N, H]",
        "num_rows=None)  # [T, H] -> [N, H]",
        "permute counts its rows with nonzero (a second host sync per MoE layer forward)",
        ("tests/core/test_host_syncs.py::test_moe_layer_syncs_once_per_forward_and_never_in_backward",)),
    # ------------------------------------------------------------------ the loop's parts (issue 31)
    Mutant(
        "save-not-on-stop", "moe_fold/training/periodic.py",
        "    return record.stop is not None\n",
        "    return False\n",
        "a run stopped early (signal, budget) writes no checkpoint of its last step",
        ("tests/training/test_periodic.py::test_save_checkpoint_when_due_with_the_data_position_and_placement",)),
    Mutant(
        "replace-after-log", TRAIN,
        "        ReplaceExperts(replacer=run.replacer, optimizer=run.optimizer, beat=heartbeat.beat),\n"
        "        WatchLossSpikes(spikes=run.spikes, warn=rank == 0, stop=t.on_loss_spike == \"stop\"),\n"
        "        LogStep(logger=logger, collector=run.collector, tokens_per_step=tokens_per_step),\n",
        "        WatchLossSpikes(spikes=run.spikes, warn=rank == 0, stop=t.on_loss_spike == \"stop\"),\n"
        "        LogStep(logger=logger, collector=run.collector, tokens_per_step=tokens_per_step),\n"
        "        ReplaceExperts(replacer=run.replacer, optimizer=run.optimizer, beat=heartbeat.beat),\n",
        "the periodic actions out of order: the step is logged before the re-placement adds what moved",
        ("tests/training/test_replace.py::test_replacing_under_bf16_keeps_the_losses_bit_for_bit",)),
    Mutant(
        "routers-closed-through-collector", TRAIN,
        "    closed = close_routers(run.routers)\n",
        "    closed = close_routers([router for _, router in run.collector.routers] if run.collector is not None\n"
        "                           else [])\n",
        "the step closes the routers the metrics collector found: without metrics the expert bias never moves",
        ("tests/training/test_train.py::test_metrics_off_take_the_same_steps",)),
    Mutant(
        "step-reads-the-norm-again", TRAIN,
        "    if finite:\n        optimizer.step()\n",
        "    if finite and torch.isfinite(grad_norm):\n        optimizer.step()\n",
        "the step checks the gradient norm on the device again: a second host sync per step",
        ("tests/core/test_host_syncs.py::test_a_static_shape_step_reads_the_host_once",)),
    Mutant(
        "expert-act-not-recomputed", "models/experts.py",
        "        if self.recompute == \"activation\":\n",
        "        if self.recompute == \"activations\":\n",
        "train.recompute=expert_act silently keeps the SwiGLU output (a setting name the module does not honour)",
        ("tests/training/test_train.py::test_recompute_modes_keep_fewer_activations",)),
    # ------------------------------------------------------------------ rollback and cadence (issue 28)
    Mutant(
        "rollback-skips-first-batch", ROLLBACK,
        "skipped = run[-self.skip_count:]",
        "skipped = run[:self.skip_count]",
        "a rollback skips the first batch after the checkpoint instead of the bad step's",
        (f"{T_ROLLBACK}::test_rollback_equals_a_run_that_never_saw_the_batches",)),
    Mutant(
        "rollback-window-kept", ROLLBACK,
        "        self.spikes.history.clear()\n        self.spikes.history.extend(extra.get(\"loss_window\", []))\n",
        "",
        "a rollback keeps the undone steps' losses in the spike window",
        (f"{T_ROLLBACK}::test_rollback_equals_a_run_that_never_saw_the_batches",)),
    Mutant(
        "rollback-limit-off-by-one", ROLLBACK,
        "if count > self.limit:",
        "if count >= self.limit:",
        "train.max_rollbacks=N stops at the N-th rollback instead of the one after",
        (f"{T_ROLLBACK}::test_repeated_rollbacks_to_one_checkpoint_stop_at_the_limit",)),
    Mutant(
        "rollback-resume-ignores-file", ROLLBACK,
        "read_skipped_batches(t.run_dir) if resume else ([], [])",
        "([], [])",
        "a resume forgets the batches a rollback skipped after the last checkpoint",
        (f"{T_ROLLBACK}::test_rollback_before_the_first_checkpoint_stops_and_resume_starts_without_the_batch",
         f"{T_ROLLBACK}::test_rollback_equals_a_run_that_never_saw_the_batches")),
    Mutant(
        "rollback-losses-off-by-one", TRAIN,
        "del result.losses[step - start_step:]",
        "del result.losses[step - start_step + 1:]",
        "the result keeps the loss of the checkpoint's step twice after a rollback",
        (f"{T_ROLLBACK}::test_rollback_equals_a_run_that_never_saw_the_batches",)),
    Mutant(
        "rollback-placement-not-restored", RUN_SETUP,
        "    if run.replacer is not None and \"experts\" in extra:\n        run.replacer.load_state_dict(extra[\"experts\"])\n",
        "",
        "a rollback (and a resume) keeps the expert placement of the bad step, not the checkpoint's",
        (f"{T_ROLLBACK}::test_rollback_on_four_ranks_with_ep_and_dp_equals_the_run_without_the_batches",)),
    Mutant(
        "loader-skips-one-of-a-run", LOADER,
        "while self.consumed_samples // self.global_batch_size in self.skip:",
        "if self.consumed_samples // self.global_batch_size in self.skip:",
        "two skipped global batches in a row: the second is trained on",
        (f"{T_ROLLBACK}::test_loader_passes_over_skipped_global_batches",)),
    Mutant(
        "young-daly-without-2", CADENCE,
        "return math.sqrt(2.0 * stall_s * mtbf_s)",
        "return math.sqrt(stall_s * mtbf_s)",
        "the Young/Daly interval without its factor 2",
        (f"{T_CADENCE}::test_young_daly_interval",)),
    Mutant(
        "cadence-clock-not-reset", CADENCE,
        "        self.last_save = self.clock()\n",
        "",
        "the time between saves counted from the start of the run, not from the last save",
        (f"{T_CADENCE}::test_fixed_minutes_add_saves_between_the_steps",)),
    Mutant(
        "cadence-all-stalls", CADENCE,
        "self.stalls: deque[float] = deque(maxlen=STALLS_KEPT)",
        "self.stalls: deque[float] = deque()",
        "the stall estimate never forgets the first save (which also allocates the host buffer)",
        (f"{T_CADENCE}::test_young_daly_measures_first_then_follows_the_stalls",)),
    Mutant(
        "replay-skips-a-layer", "moe_fold/training/routes.py",
        "            if queue:\n                return args, {**kwargs, \"forced\": queue.popleft()}\n",
        "            if queue and layer == 1:\n                queue.popleft()\n                return None\n"
        "            if queue:\n                return args, {**kwargs, \"forced\": queue.popleft()}\n",
        "router replay ignored for one layer: layer 1 routes by its own router",
        ("tests/core/test_routes.py::test_replay_routes_from_transformers",
         "tests/core/test_routes.py::test_replay_forces_routes_under_another_layout",
         "tests/core/test_routes.py::test_replay_forces_routes_under_the_allgather_dispatcher")),
    Mutant(
        "route-keyed-by-rank", "moe_fold/training/routes.py",
        "    B = batch.sample_ids.shape[0]\n",
        "    B = batch.sample_ids.shape[0]\n"
        "    positions = torch.arange(positions.shape[0]) + groups.rank * positions.shape[0]\n",
        "a route keyed by the rank's own token order instead of the token's place in the sequence",
        ("tests/core/test_routes.py::test_trace_reads_the_same_under_any_layout",)),
    Mutant(
        "batch-invariant-no-padding", "models/experts.py",
        "        m = self.row_multiple\n",
        "        m = 1\n",
        "train.batch_invariant without the row padding: an expert's GEMM reduces a row in an order that "
        "depends on how many rows the other sequences sent it",
        ("tests/core/test_routes.py::test_batch_invariant_sequence_alone_equals_among_others",)),
    Mutant(
        "zero-expert-rows-sent", "dispatch/router.py",
        "            kept_probs, kept_map, tokens_per_expert = kept_probs[:, :held], kept_map[:, :held], "
        "tokens_per_expert[:held]\n",
        "            kept_probs, kept_map, tokens_per_expert = kept_probs[:, :held], kept_map[:, :held].clone(), "
        "tokens_per_expert[:held]\n"
        "            kept_map[:, 0] |= routing_map[:, held:].any(dim=1)\n",
        "a token on a zero expert also sent to held expert 0 with weight 0: the output is right, the rows "
        "and bytes are not",
        ("tests/models/test_moe_layer.py::test_zero_experts_are_never_dispatched_on_two_ranks",)),
    Mutant(
        "zero-expert-gate-detached", "models/moe_layer.py",
        "            out = out + (hidden * routing.zero_probs.unsqueeze(1)).to(out.dtype)\n",
        "            out = out + (hidden * routing.zero_probs.detach().unsqueeze(1)).to(out.dtype)\n",
        "the zero experts' gate weight without its gradient: the router never learns from them",
        ("tests/models/test_moe_layer.py::test_zero_experts_match_longcat_written_out_forward_and_backward",)),
    Mutant(
        "zero-expert-bias-moves", "dispatch/router.py",
        "        step[counts.shape[0] - zero_experts:] = 0.0\n",
        "        step[counts.shape[0] - zero_experts:] = step[counts.shape[0] - zero_experts:]\n",
        "the zero experts' bias updated like a held expert's",
        ("tests/dispatch/test_router.py::"
         "test_updated_expert_bias_leaves_zero_experts_and_aims_held_ones_at_the_all_column_mean",)),
    Mutant(
        "planner-zero-experts-computed", "moe_fold/planner/model.py",
        "    return moe.topk * moe.num_experts / (moe.num_experts + moe.zero_experts)\n",
        "    return float(moe.topk)\n",
        "the planner counts a token's slots on zero experts as expert rows",
        ("tests/planner/test_estimate.py::test_zero_experts_by_hand",)),
    Mutant(
        "zero-expert-outputs-nothing", "models/moe_layer.py",
        "            out = out + (hidden * routing.zero_probs.unsqueeze(1)).to(out.dtype)\n",
        "            out = out + 0 * (hidden * routing.zero_probs.unsqueeze(1)).to(out.dtype)\n",
        "a zero-computation expert read as one that outputs zeros instead of its input",
        ("tests/models/test_moe_layer.py::test_zero_experts_give_transformers_longcat_flash_moe",)),
    Mutant(
        "zero-experts-counted-dropped", "moe_fold/training/metrics.py",
        "        dropped = 1.0 - float(kept.sum() + zero.sum()) / max(float(routed.sum()), 1.0)\n",
        "        dropped = 1.0 - float(kept.sum()) / max(float(routed.sum()), 1.0)\n",
        "the slots on zero experts reported as dropped by capacity",
        ("tests/training/test_metrics.py::test_zero_expert_assignments_are_neither_loads_nor_drops",)),
    # ------------------------------------------------------------------ LongCat-Flash's blocks
    Mutant(
        "shortcut-moe-reads-unnormed-stream", "models/model.py",
        "        shortcut = routed_mlp(self.mlp, h.flatten(0, 1), x.shape, docs, loss_scale).reshape(x.shape)\n",
        "        shortcut = routed_mlp(self.mlp, x.flatten(0, 1), x.shape, docs, loss_scale).reshape(x.shape)\n",
        "the shortcut MoE reads the first sublayer's residual stream instead of its normed output",
        ("tests/models/test_model.py::test_shortcut_moe_block_is_longcat_flash_layer_written_out_forward_and_backward",
         "tests/models/hf/test_families.py::test_import_matches_transformers_and_export_round_trips"
         "[longcat_flash-longcat_flash]")),
    Mutant(
        "shortcut-second-sublayer-shares-cache", "models/model.py",
        "        x = second.attend(x, cos, sin, docs, kv_cache.sublayer(1) if kv_cache is not None else None, again)\n",
        "        x = second.attend(x, cos, sin, docs, kv_cache, again)\n",
        "sampling: the second attention sublayer appends its keys to the first one's cache",
        ("tests/models/test_model.py::test_shortcut_moe_cached_decode_equals_the_full_forward",)),
    Mutant(
        "mla-kv-lora-unscaled", "models/mla.py",
        "        self.kv_scale = (config.hidden_size / config.kv_lora_rank) ** 0.5 if scaled else None\n",
        "        self.kv_scale = None\n",
        "LongCat-Flash's MLA without the key/value latent's LoRA scaling",
        ("tests/models/hf/test_families.py::test_import_matches_transformers_and_export_round_trips"
         "[longcat_flash-longcat_flash]",)),
    Mutant(
        "longcat-zero-expert-rows-not-written", "models/hf/sources.py",
        "        return self.part.split(value) + [(name, value.new_zeros(shape)) for name, shape in self.extra]\n",
        "        return self.part.split(value)\n",
        "the export leaves out the zero experts' gate and up rows that transformers needs to load",
        ("tests/models/hf/test_families.py::test_import_matches_transformers_and_export_round_trips"
         "[longcat_flash-longcat_flash]",)),
    Mutant(
        "planner-shortcut-dense-missing", "moe_fold/planner/model.py",
        "                dense(f\"{pre}.sublayers.{j}\")\n",
        "",
        "the planner forgets a shortcut_moe block's dense MLPs",
        ("tests/planner/test_model.py::test_params_equal_single_process_model[longcat-flash-tiny]",)),
    # ------------------------------------------------------------------ recurrent layers: document starts
    Mutant(
        "delta-rule-carry-past-start", DELTA,
        "    decay_in = G.exp() * carry.unsqueeze(-1)  # [B, H, n, C, dk or 1]: exp(G_t), or 0 past a start\n",
        "    decay_in = G.exp()  # [B, H, n, C, dk or 1]: exp(G_t), or 0 past a start\n",
        "Gated DeltaNet / KDA: a chunk's start state carried past a document start inside the chunk",
        (f"{T_DELTA}::test_packed_equals_each_document_alone[head]",
         f"{T_DELTA}::test_packed_equals_each_document_alone[channel]",
         f"{T_KDA}::test_packed_kda_equals_each_document_alone")),
    Mutant(
        "delta-rule-end-state-keeps-old-document", DELTA,
        "    decay_out = (G[..., -1:, :] - G).masked_fill(~same[..., -1, :].unsqueeze(-1), float(\"-inf\")).exp()\n",
        "    decay_out = (G[..., -1:, :] - G).exp()\n",
        "Gated DeltaNet / KDA: a chunk's end state keeps what a document that ended inside the chunk wrote",
        (f"{T_DELTA}::test_packed_equals_each_document_alone[head]",
         f"{T_DELTA}::test_packed_equals_each_document_alone[channel]")),
    Mutant(
        "chunk-reach-ignores-starts", DELTA,
        "    return (starts.unsqueeze(-1) == starts.unsqueeze(-2)) & causal, starts == 0\n",
        "    return causal.expand(batch, 1, chunks, size, size), starts == 0\n",
        "inside a chunk a token reads the writes of an earlier document (the delta rule's and SSD's "
        "intra-chunk mask without the starts)",
        (f"{T_DELTA}::test_packed_equals_each_document_alone[head]",
         f"{T_DELTA}::test_packed_equals_each_document_alone[channel]",
         f"{T_SSD}::test_packed_equals_each_document_alone")),
    Mutant(
        "ssd-carry-past-start", SSD,
        "    decay_in = G.exp() * carry  # [B, H, n, C]: exp(G_t), or 0 past a start\n",
        "    decay_in = G.exp()  # [B, H, n, C]: exp(G_t), or 0 past a start\n",
        "Mamba2: a chunk's start state carried past a document start inside the chunk",
        (f"{T_SSD}::test_packed_equals_each_document_alone",
         f"{T_MAMBA2}::test_packed_equals_each_document_alone")),
    Mutant(
        "ssd-end-state-keeps-old-document", SSD,
        "    decay_out = (G[..., -1:] - G).masked_fill(~same[..., -1, :], float(\"-inf\")).exp()  # [B, H, n, C]\n",
        "    decay_out = (G[..., -1:] - G).exp()  # [B, H, n, C]\n",
        "Mamba2: a chunk's end state keeps what a document that ended inside the chunk wrote",
        (f"{T_SSD}::test_packed_equals_each_document_alone",
         f"{T_MAMBA2}::test_packed_equals_each_document_alone")),
    Mutant(
        "gated-deltanet-forgets-documents", "models/gated_deltanet.py",
        "                            docs, self.cp_group, kv_cache)  # [B, nv, S, dv]\n",
        "                            None, self.cp_group, kv_cache)  # [B, nv, S, dv]\n",
        "the Gated DeltaNet layer runs a packed row as one document (neither state nor conv window reset)",
        (f"{T_RECURRENT_CP}::test_packed_layer_equals_each_document_alone[gated_deltanet]",)),
    Mutant(
        "kda-forgets-documents", "models/kda.py",
        "                            docs, self.cp_group, kv_cache)  # [B, nh, S, d]\n",
        "                            None, self.cp_group, kv_cache)  # [B, nh, S, d]\n",
        "the KDA layer runs a packed row as one document (neither state nor conv window reset)",
        (f"{T_KDA}::test_packed_kda_equals_each_document_alone",
         f"{T_RECURRENT_CP}::test_packed_layer_equals_each_document_alone[kda]")),
    Mutant(
        "mamba2-scan-forgets-documents", MAMBA2,
        "            return self.scan(xs, step, A, b, c, resets=resets[0], chunk_size=self.chunk_size)[0] + skip\n",
        "            return self.scan(xs, step, A, b, c, resets=None, chunk_size=self.chunk_size)[0] + skip\n",
        "Mamba2 in one process: the SSD state not reset at a document start (the conv window still is)",
        (f"{T_MAMBA2}::test_packed_equals_each_document_alone",
         f"{T_RECURRENT_CP}::test_packed_layer_equals_each_document_alone[mamba2]")),
    # ------------------------------------------------------------------ recurrent layers: the conv window
    Mutant(
        "conv-window-crosses-start", DELTA,
        "            term = term * same.unsqueeze(-1).to(term.dtype)\n",
        "            term = term + 0 * same.unsqueeze(-1).to(term.dtype)\n",
        "the short causal conv reads the last tokens of the document before",
        (f"{T_DELTA}::test_causal_conv1d[True]",
         f"{T_RECURRENT_CP}::test_packed_layer_equals_each_document_alone")),
    Mutant(
        "delta-conv-forgets-documents", "models/gated_deltanet.py",
        "        outs.append(conv(x[lo:hi], weight, bias, history, ids))\n",
        "        outs.append(conv(x[lo:hi], weight, bias, history, None))\n",
        "Gated DeltaNet / KDA (and Mamba2, whose conv is this one): the conv window not reset at a document "
        "start (the state still is)",
        (f"{T_RECURRENT_CP}::test_packed_layer_equals_each_document_alone[gated_deltanet]",
         f"{T_RECURRENT_CP}::test_packed_layer_equals_each_document_alone[kda]",
         f"{T_KDA}::test_packed_kda_equals_each_document_alone")),
    Mutant(
        "mamba2-conv-forgets-documents", MAMBA2,
        "        xbc = segment_conv(xbc, self.conv_weight, self.conv_bias, self.conv, segments, doc_ids,\n",
        "        xbc = segment_conv(xbc, self.conv_weight, self.conv_bias, self.conv, segments, None,\n",
        "Mamba2: the conv window not reset at a document start (the state still is)",
        (f"{T_MAMBA2}::test_packed_equals_each_document_alone",
         f"{T_RECURRENT_CP}::test_packed_layer_equals_each_document_alone[mamba2]")),
    # ------------------------------------------------------------------ recurrent layers: states along cp
    Mutant(
        "cp-scan-drops-transition", RECURRENT_CP,
        "        states.append(A[i] @ states[-1] + B[i])  # the state after segment i\n",
        "        states.append(B[i])  # the state after segment i\n",
        "the cp prefix scan drops A S: a segment's end state is only what it wrote from zero",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-gated_deltanet]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-kda]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-mamba2]")),
    Mutant(
        "cp-scan-zero-start", RECURRENT_CP,
        "    return torch.stack([states[i] for _, _, i in local_segments(2, group)])\n",
        "    return torch.zeros_like(writes)\n",
        "every cp segment starts from a zero state: no state passed along cp",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-gated_deltanet]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-kda]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-mamba2]")),
    Mutant(
        "cp-segments-in-rank-order", RECURRENT_CP,
        "    return gathered[order]\n",
        "    return gathered\n",
        "the gathered segments composed in rank order (0, 2cp-1, 1, ...) instead of sequence order",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-gated_deltanet]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-kda]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-mamba2]")),
    Mutant(
        "delta-cp-transition-from-zero", "models/gated_deltanet.py",
        "        transitions.append(rule(qs, ks, zero_v, gs, bs, seqs, eye, chunk_size)[1])\n",
        "        transitions.append(rule(qs, ks, zero_v, gs, bs, seqs, None, chunk_size)[1])\n",
        "Gated DeltaNet / KDA under cp: the segment map's linear part run from a zero state (A = 0)",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-gated_deltanet]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-kda]")),
    Mutant(
        "ssd-cp-decay-last-token", SSD,
        "    a = g.sum(-1).exp()\n",
        "    a = g[..., -1].exp()\n",
        "Mamba2 under cp: a segment's decay is its last token's, not the product over the segment",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-mamba2]",)),
    Mutant(
        "ssd-cp-decay-ignores-start", SSD,
        "    return a * (~resets.any(-1)).to(a.dtype).unsqueeze(-1)\n",
        "    return a\n",
        "Mamba2 under cp: the state passed across a segment that holds a document start",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[True-2-mamba2]",)),
    Mutant(
        "mamba2-cp-start-state-unused", MAMBA2,
        "        return torch.cat([chunk_ssd(*p, resets=r, initial_state=s, chunk_size=self.chunk_size)[0]\n",
        "        return torch.cat([chunk_ssd(*p, resets=r, initial_state=None, chunk_size=self.chunk_size)[0]\n",
        "Mamba2 under cp: the scanned start states computed and then not used",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-mamba2]",)),
    Mutant(
        "delta-cp-conv-history-dropped-when-packed", "models/gated_deltanet.py",
        "        ids = None if doc_ids is None else _window_ids(doc_ids, index * (hi - lo), hi - lo, K - 1)\n",
        "        ids = None if doc_ids is None else _window_ids(doc_ids[:, index * (hi - lo):], 0, hi - lo, K - 1)\n",
        "Gated DeltaNet / KDA / Mamba2 under cp with packed documents: the conv window's positions counted "
        "from the segment's start, so a document running across a segment edge loses the tokens before it",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[True-2-gated_deltanet]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[True-2-kda]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[True-2-mamba2]")),
    Mutant(
        "cp-reset-at-every-segment", "moe_fold/parallel/varlen.py",
        "        prev = ids[:, start - 1:start + length - 1] if start else "
        "torch.cat([seg[:, :1] - 1, seg[:, :-1]], dim=1)\n",
        "        prev = ids[:, start - 1:start + length - 1] if False else "
        "torch.cat([seg[:, :1] - 1, seg[:, :-1]], dim=1)\n",
        "under cp with packed documents every segment's first token starts a document: the state (and Mamba2's) "
        "is not passed along cp",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[True-2-gated_deltanet]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[True-2-kda]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[True-2-mamba2]")),
    Mutant(
        "cp-start-states-detached", RECURRENT_CP,
        "    both = all_gather(torch.cat([transitions, writes], dim=-1), group, dim=0)  # [2cp, B, H, dk, dk+dv]\n",
        "    both = all_gather(torch.cat([transitions, writes], dim=-1).detach(), group, dim=0)"
        "  # [2cp, B, H, dk, dk+dv]\n",
        "the states passed along cp carry no gradient back: the outputs are right, the grads of earlier "
        "segments' tokens are not",
        (f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-gated_deltanet]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-kda]",
         f"{T_RECURRENT_CP}::test_cp_equals_one_process[False-2-mamba2]")),
    # ------------------------------------------------------------------ DSA
    Mutant(
        "dsa-topk-one-short", DSA,
        "    top = order[..., :min(topk, masked.shape[-1])]  # [B, S_q, k]\n",
        "    top = order[..., :min(topk - 1, masked.shape[-1])]  # [B, S_q, k]\n",
        "the indexer keeps index_topk - 1 keys per query",
        (f"{T_DSA}::test_selection_keeps_topk_visible_keys",
         f"{T_DSA}::test_dsa_layer_matches_transformers")),
    Mutant(
        "dsa-topk-one-extra", DSA,
        "    top = order[..., :min(topk, masked.shape[-1])]  # [B, S_q, k]\n",
        "    top = order[..., :min(topk + 1, masked.shape[-1])]  # [B, S_q, k]\n",
        "the indexer keeps index_topk + 1 keys per query",
        (f"{T_DSA}::test_selection_keeps_topk_visible_keys",
         f"{T_DSA}::test_dsa_layer_matches_transformers")),
    Mutant(
        "dsa-selects-invisible-keys", DSA,
        "    return chosen & allowed\n",
        "    return chosen\n",
        "a query that sees fewer than index_topk keys also selects future (or other documents') keys",
        (f"{T_DSA}::test_selection_keeps_topk_visible_keys",
         f"{T_DSA}::test_dsa_layer_matches_transformers")),
    Mutant(
        "dsa-indexer-inputs-not-detached", DSA,
        "        x, q_latent = x.detach(), q_latent.detach()\n",
        "        x, q_latent = x, q_latent\n",
        "the indexer's inputs not detached: its KL loss trains the main attention's weights and the layers below",
        (f"{T_DSA}::test_indexer_kl_trains_the_indexer_only[deepseek_v32-sparse]",)),
    Mutant(
        "dsa-kl-target-not-detached", DSA,
        "            target = probs.detach().sum(1)  # [B, S, L], this rank's heads\n",
        "            target = probs.sum(1)  # [B, S, L], this rank's heads\n",
        "the KL's target (the main attention) not detached: the indexer's loss trains the main attention",
        (f"{T_DSA}::test_indexer_kl_trains_the_indexer_only[deepseek_v32-sparse]",)),
    Mutant(
        "dsa-sparse-kl-over-visible-keys", DSA,
        "            out = attach_loss(out, self.kl(target, scores, mask, real, count), self.loss_weight * loss_scale)\n",
        "            out = attach_loss(out, self.kl(target, scores, allowed.expand_as(mask), real, count), "
        "self.loss_weight * loss_scale)\n",
        "the sparse stage's KL normalises the indexer over every visible key instead of the selected ones",
        (f"{T_DSA}::test_indexer_kl_matches_float64[deepseek_v32-sparse]",)),
    Mutant(
        "dsa-cp-contiguous-positions", DSA,
        "            pos_q = zigzag_positions(length, rank, cp, device=q.device)\n",
        "            pos_q = torch.arange(rank * S, (rank + 1) * S, device=q.device)\n",
        "under cp a rank's queries take contiguous positions, not their zigzag ones: they see and select "
        "the wrong keys",
        ("tests/parallel/test_parallel_matrix.py::test_dsa_matches_single_process[2]",)),
    Mutant(
        "dsa-shared-layer-recomputes", DSA,
        "        self.indexer = None if shared else LightningIndexer(config, seed=seed, name=f\"{name}.indexer\")\n",
        "        self.indexer = LightningIndexer(config, seed=seed, name=f\"{name}.indexer\")\n",
        "GLM-5: a shared layer runs an indexer of its own instead of reusing the full layer's selection",
        (f"{T_FAMILIES}::test_import_matches_transformers_and_export_round_trips[glm_moe_dsa-glm_moe_dsa_shared]",)),
    Mutant(
        "dsa-shared-reuses-first-full", DSA,
        "        self.source = max(i for i in range(layer) if types[i] == \"full\") if shared else layer\n",
        "        self.source = min(i for i in range(layer) if types[i] == \"full\") if shared else layer\n",
        "GLM-5: a shared layer reuses the first full layer's selection, not the nearest one before it",
        (f"{T_FAMILIES}::test_import_matches_transformers_and_export_round_trips[glm_moe_dsa-glm_moe_dsa_shared]",)),
    Mutant(
        "dsa-shared-layer-dense", DSA,
        "            selected = selections[self.source]\n",
        "            selected = allowed.expand(q.shape[0], -1, -1)\n",
        "GLM-5: a shared layer attends to every visible key instead of the full layer's selection",
        (f"{T_FAMILIES}::test_import_matches_transformers_and_export_round_trips[glm_moe_dsa-glm_moe_dsa_shared]",)),
    Mutant(
        "dsa-kl-added-to-output", DSA,
        "            out = attach_loss(out, self.kl(target, scores, mask, real, count), self.loss_weight * loss_scale)\n",
        "            out = out + self.loss_weight * loss_scale * self.kl(target, scores, mask, real, count)\n",
        "the indexer's KL added to the attention output: the LM loss's gradient reaches the indexer",
        (f"{T_DSA}::test_indexer_kl_trains_the_indexer_only[deepseek_v32-sparse]",)),
    Mutant(
        "dsa-cp-selects-local-keys", DSA,
        "            selected = select_topk(scores, allowed, self.topk)\n",
        "            selected = select_topk(scores, allowed & torch.isin(torch.arange(length, device=q.device), "
        "pos_q),\n"
        "                                   self.topk)\n",
        "under cp a rank's queries select only among the keys of its own zigzag segments",
        ("tests/parallel/test_parallel_matrix.py::test_dsa_matches_single_process[2]",)),
    # ------------------------------------------------------------------ zero experts in the loads
    Mutant(
        "zero-expert-columns-taken-first", ROUTER,
        "            stats = load_stats(routed_counts[:held], kept_counts[:held], self.groups.size(\"ep\"),\n"
        "                               routed_counts[held:].sum())\n",
        "            stats = load_stats(routed_counts[-held:], kept_counts[-held:], self.groups.size(\"ep\"),\n"
        "                               routed_counts[:-held].sum())\n",
        "the load statistics (what re-placement reads) take the zero experts as the first router columns",
        ("tests/training/test_metrics.py::test_zero_expert_assignments_are_neither_loads_nor_drops",)),
    # ------------------------------------------------------------------ the latent MoE
    Mutant(
        "latent-projected-after-dispatch", "models/moe_layer.py",
        "            sent = self.dispatcher.dispatch(x, routing.probs, routing.routing_map)  # [N, L] by local expert\n"
        "            rows = self.experts(sent.tokens,",
        "            sent = self.dispatcher.dispatch(hidden, routing.probs, routing.routing_map)  # [N, L] by local expert\n"
        "            rows = self.experts(sent.tokens if self.latent_in is None else self.latent_in(sent.tokens),",
        "the latent projection applied on the expert's rank after the dispatch: the same output, "
        "hidden-wide rows on the wire",
        ("tests/models/test_moe_layer.py::test_latent_moe_sends_latent_rows_on_two_ranks[blocking]",)),
    Mutant(
        "latent-back-projection-wrong", "models/moe_layer.py",
        "        return combined if self.latent_out is None else self.latent_out(combined)\n",
        "        return combined if self.latent_out is None else combined @ self.latent_in.weight\n",
        "the combined rows projected back with the first projection's transpose instead of fc2_latent_proj",
        ("tests/models/test_moe_layer.py::test_latent_moe_gives_transformers_nemotron_h_moe_forward_and_backward",)),
    Mutant(
        "latent-projection-not-summed-over-tp", "models/moe_layer.py",
        "            self.latent_in = self._replicated_linear(m.hidden_size, width, std, seed, f\"{name}.latent_in\", "
        "replicated)\n",
        "            self.latent_in = self._replicated_linear(m.hidden_size, width, std, seed, f\"{name}.latent_in\", "
        "\"replicated\")\n",
        "the projection into the latent width averaged over dp only under SP: its tp ranks saw different tokens",
        ("tests/parallel/test_parallel_matrix.py::test_latent_moe_matches_single_process[2]",)),
    Mutant(
        "latent-size-not-exported", "models/hf/families/nemotron_h.py",
        "\"moe_latent_size\": moe.latent_size,",
        "\"moe_latent_size\": None,",
        "the export writes no moe_latent_size: transformers builds hidden-wide experts and refuses the tensors",
        ("tests/models/hf/test_families.py::test_import_matches_transformers_and_export_round_trips"
         "[nemotron_h-nemotron_h_latent]",)),
    Mutant(
        "planner-latent-rows-hidden-wide", "moe_fold/planner/comm.py",
        "    row = d.expert_width * act_bytes(config)  # a latent MoE sends latent rows\n",
        "    row = d.hidden * act_bytes(config)\n",
        "the planner sends hidden-wide rows in a latent MoE",
        ("tests/planner/test_estimate.py::test_latent_moe_by_hand",
         "tests/training/test_dryrun.py::test_latent_moe_planner_agrees_with_the_dry_run[ep4]")),
    Mutant(
        "planner-latent-combined-rows-not-kept", "moe_fold/planner/memory.py",
        "        latent = a * d.latent  # the combined rows, the projection back's input\n",
        "        latent = 0.0\n",
        "the planner forgets the combined latent rows the projection back keeps",
        ("tests/planner/test_memory.py::test_nemotron_h_layer_activation_bytes[fp32-latent]",)),
    # ------------------------------------------------------------------ DSA training
    Mutant(
        "dsa-recompute-drops-kl-share", "models/model.py",
        "            x = x + recomputed(self.attn, self.attn_norm(x), cos, sin, docs, kv_cache, **extra)",
        "            x = x + recomputed(self.attn, self.attn_norm(x), cos, sin, docs, kv_cache, "
        "selections=extra.get(\"selections\"))",
        "a recomputed DSA attention weighs its indexer's KL as a whole step's, not its micro-batch's share",
        ("tests/models/test_dsa.py::test_recompute_gives_the_same_loss_grads_and_indexer_loss",)),
    Mutant(
        "dsa-kl-count-not-reduced", "models/dsa.py",
        "        all_reduce_(count, self.cp_group)\n",
        "",
        "each dynamic cp rank averages the indexer's KL over its own real queries, not its share of the "
        "micro-batch's",
        ("tests/training/test_dynamic_cp.py::test_dynamic_cp_equals_one_process[dsa-glm5-cp2]",)),
    Mutant(
        "dsa-padding-queries-train", "models/dsa.py",
        "        terms = terms.masked_fill(~real, 0.0)\n",
        "        terms = terms + 0.0 * real\n",
        "padding queries train the indexer",
        ("tests/models/test_dsa.py::test_padding_queries_train_no_indexer",)),
    Mutant(
        "dsa-boundary-selection-lost", "models/model.py",
        "        return h, bits.flatten(-2)[..., :keys].transpose(0, 1) > 0\n",
        "        return h, bits.flatten(-2)[..., :keys].transpose(0, 1) >= 0\n",
        "a shared layer beginning a pp stage attends to every key: the carried selection is lost",
        ("tests/parallel/test_parallel_matrix.py::test_dsa_matches_single_process",)),
    Mutant(
        "dsa-boundary-selection-wrong-tp-slice", "models/model.py",
        "            sel = sel.chunk(self.groups.size(\"tp\"), dim=0)[self.tp_rank]",
        "            sel = sel.chunk(self.groups.size(\"tp\"), dim=0)[0]",
        "under SP every tp rank sends the first tp rank's queries' selection across the stage boundary",
        ("tests/parallel/test_parallel_matrix.py::test_dsa_matches_single_process",)),
]

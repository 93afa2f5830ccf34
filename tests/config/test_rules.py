"""One source for each config rule (moe_fold.config.RULES).

A rule that a module also applies at run time (a dispatcher, the experts, a placement, the
router, a checkpoint manager...) is a function registered in ``RULES``: ``validate()``
applies it to the whole config before any rank starts, and the module calls the same
function on its own arguments through ``require()``. So:

- every registered rule has a case here, and ``check_trainable`` (the pre-spawn check)
  reports that case's problem *through the registered function* (the function is wrapped
  and must have returned the message): a rule a module raises at run time that validate()
  does not apply fails here;
- no module raises on a config field's value by itself (an AST scan of the package): a new
  run-time check must be a rule of the registry;
- ``num_experts % ep`` is written once (an AST scan for ``% ep``), and no module writes
  a copy of a ``Literal`` field's choices (an AST scan for string tuples).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from moe_fold import config as config_module
from moe_fold.cli import main
from moe_fold.config import RULES, SECTIONS, ConfigError, _field_types, _literal_choices, load_config
from moe_fold.training.train import check_trainable

from tests.helpers.paths import REPO
# The package's source folders (pyproject's package-dir).
PACKAGE = ("moe_fold", "models", "dispatch", "kernels")
# The config package, where every rule lives, and the file of the experts' split over ep.
CONFIG = "moe_fold/config/"
EXPERTS_OVER_EP = "moe_fold/config/rules/moe.py"

SP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]
MLA = ["model.attention=mla", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
       "model.v_head_dim=16"]

# (registered rule, overrides of mixtral-tiny, world size, the problem validate() reports)
RULE_CASES = [
    ("heads_over_tp", SP2 + ["model.num_heads=6", "model.num_kv_heads=3", "model.hidden_size=96"], 2,
     "model.num_kv_heads=3 is not divisible by parallel.tp=2"),
    ("heads_over_tp", MLA + SP2 + ["model.num_heads=3", "model.num_kv_heads=3", "model.hidden_size=96"], 2,
     "model.num_heads=3 is not divisible by parallel.tp=2"),
    ("linear_heads_over_tp", SP2 + ["model.num_layers=2", "model.layer_types=[gated_deltanet, attention]",
                                    "model.linear_num_key_heads=3", "model.linear_num_value_heads=6"], 2,
     "model.linear_num_key_heads=3 is not divisible by parallel.tp=2"),
    ("mamba_groups_over_tp", SP2 + ["model.num_layers=2", "model.layer_types=[mamba2, attention]",
                                    "model.mamba_num_groups=3", "model.mamba_num_heads=6"], 2,
     "model.mamba_num_groups=3 is not divisible by parallel.tp=2"),
    ("choice", ["parallel.cp_kind=ulysses"], 1, "parallel.cp_kind=ulysses must be one of ring, a2a"),
    ("choice", ["moe.gemm_backend=cutlass"], 1,
     "moe.gemm_backend=cutlass must be one of auto, grouped_gemm, torch, triton, loop"),
    ("choice", ["moe.swiglu_backend=c"], 1, "moe.swiglu_backend=c must be one of auto, torch, triton, cpu"),
    ("choice", ["moe.dispatcher=deepep"], 1, "moe.dispatcher=deepep must be one of alltoall, allgather"),
    ("choice", ["moe.router_dtype=float16"], 1, "moe.router_dtype=float16 must be one of float32, float64"),
    ("choice", ["moe.topk_backend=fused"], 1, "moe.topk_backend=fused must be one of auto, torch, triton"),
    ("choice", ["moe.drop_policy=random"], 1, "moe.drop_policy=random must be one of probs, position"),
    ("choice", ["moe.score_function=relu"], 1, "moe.score_function=relu must be one of softmax, sigmoid"),
    ("choice", ["moe.num_groups=4", "moe.group_topk=2", "moe.group_score=top3"], 1,
     "moe.group_score=top3 must be one of topk_sum, top2_sum, max"),
    ("choice", ["parallel.pp_schedule=gpipe"], 1, "parallel.pp_schedule=gpipe must be one of auto, 1f1b, interleaved"),
    ("choice", ["train.precision=fp8"], 1, "train.precision=fp8 must be one of fp32, bf16-autocast, bf16"),
    ("choice", ["train.recompute=all"], 1, "train.recompute=all must be one of none, full, moe, expert_act"),
    ("choice", ["optimizer.schedule=linear"], 1, "optimizer.schedule=linear must be one of cosine, wsd, constant"),
    ("choice", ["data.verify=some"], 1, "data.verify=some must be one of sampled, full"),
    ("choice", ["data.dtype=float16"], 1,
     "data.dtype=float16 must be one of uint8, uint16, int16, uint32, int32, int64"),
    ("moe_needs_sequence_parallel", ["parallel.tp=2"], 2,
     "parallel.tp=2 with MoE layers requires parallel.sequence_parallel=true"),
    ("gate_needs_shared_expert", ["moe.shared_expert_gate=true"], 1,
     "moe.shared_expert_gate=true requires a shared expert (moe.shared_expert_ffn_hidden_size > 0), got 0"),
    ("overlap_problems", ["moe.shared_expert_overlap=true"], 1,
     "moe.shared_expert_overlap=true needs a shared expert (moe.shared_expert_ffn_hidden_size > 0, got 0)"),
    ("overlap_problems", ["moe.overlap_chunks=0"], 1, "moe.overlap_chunks=0 must be >= 1"),
    ("overlap_problems", ["moe.overlap_chunks=2", "moe.capacity_factor=1.0", "moe.pad_to_capacity=true"], 1,
     "moe.overlap_chunks=2 requires moe.pad_to_capacity=false: one chunk may hold all of an expert's tokens, so "
     "every chunk would be padded to the layer's whole capacity, multiplying the bytes sent by the number of chunks"),
    ("experts_over_ep", ["parallel.ep=3"], 3, "moe.num_experts=8 is not divisible by parallel.ep=3"),
    ("expert_width_over_etp", ["parallel.etp=3"], 3, "moe.ffn_hidden_size=128 is not divisible by parallel.etp=3"),
    ("expert_width_over_etp", SP2 + ["moe.ffn_hidden_size=127"], 2,
     "moe.ffn_hidden_size=127 is not divisible by parallel.tp=2 (parallel.etp is null, so experts are split over tp)"),
    ("dispatch_modes", ["moe.pad_to_capacity=true"], 1,
     "moe.pad_to_capacity=true requires moe.capacity_factor to be set, got null"),
    ("dispatch_modes", ["moe.capacity_factor=1.0", "moe.pad_to_capacity=true", "moe.dispatcher=allgather"], 1,
     "moe.pad_to_capacity=true requires moe.dispatcher=alltoall, got allgather"),
    ("dispatch_modes", ["moe.dedup=true", "moe.dispatcher=allgather"], 1,
     "moe.dedup=true requires moe.dispatcher=alltoall, got allgather"),
    # Passed validate() and failed in every rank's AllToAllDispatcher before the rules had one source.
    ("dispatch_modes", ["moe.dedup=true", "moe.capacity_factor=1.0", "moe.pad_to_capacity=true"], 1,
     "moe.dedup=true cannot run with moe.pad_to_capacity=true: the padded exchange sends a fixed capacity of rows "
     "per expert, the deduplicated one a data-dependent number per rank"),
    ("router_settings", ["moe.topk_backend=triton", "moe.score_function=sigmoid", "moe.expert_bias=true"], 1,
     "moe.topk_backend=triton fuses plain top-k only; moe.num_groups=null and moe.expert_bias=true need "
     "moe.topk_backend=torch (or auto)"),
    ("router_settings", ["moe.score_function=sigmoid", "moe.pre_softmax=true"], 1,
     "moe.pre_softmax=true requires moe.score_function=softmax, got sigmoid"),
    ("router_settings", ["moe.expert_bias=true"], 1,
     "moe.expert_bias=true requires moe.score_function=sigmoid, got softmax (or moe.pre_softmax=true: the bias is "
     "added to the softmax over all experts, as in ERNIE-4.5)"),
    ("router_settings", ["moe.scaling_factor=-1.0"], 1, "moe.scaling_factor=-1.0 must be > 0 when set"),
    ("router_settings", ["moe.topk_norm_min=1e-12"], 1,
     "moe.topk_norm_min=1e-12 requires moe.pre_softmax=true (it renormalises the top-k of the softmax over all "
     "experts)"),
    # Passed validate() and failed in every rank's Router before the rules had one source.
    ("router_settings", ["moe.z_loss_coeff=.inf"], 1, "moe.z_loss_coeff=inf must be finite"),
    ("activation_backend", ["moe.activation=clamped_swiglu", "moe.swiglu_backend=cpu"], 1,
     "moe.swiglu_backend=cpu with moe.activation=clamped_swiglu: this activation runs on torch ops only; set "
     "moe.swiglu_backend=torch (or auto)"),
    ("expert_bias_over_etp", ["moe.expert_linear_bias=true", "model.hidden_size=66", "parallel.etp=4",
                              "parallel.ep=4"], 4,
     "model.hidden_size=66 is not divisible by parallel.etp=4 (moe.expert_linear_bias=true splits fc2's bias over "
     "the expert-tensor ranks)"),
    ("expert_bias_over_etp", ["moe.expert_linear_bias=true", "moe.latent_size=30", "parallel.etp=4",
                              "parallel.ep=4"], 4,
     "moe.latent_size=30 is not divisible by parallel.etp=4 (moe.expert_linear_bias=true splits fc2's bias over "
     "the expert-tensor ranks)"),
    ("latent_size_positive", ["moe.latent_size=0"], 1,
     "moe.latent_size=0 must be >= 1 when set (the routed experts' width), or null for experts in the hidden width"),
    ("capacity_factor_positive", ["moe.capacity_factor=0"], 1,
     "moe.capacity_factor=0.0 must be > 0, or null for dropless"),
    ("routing_groups", ["moe.num_groups=4"], 1,
     "moe.num_groups=4 and moe.group_topk=null must be both set or both null"),
    ("routing_groups", ["moe.num_groups=8", "moe.group_topk=2", "moe.group_score=top2_sum"], 1,
     "moe.group_score=top2_sum needs >= 2 experts per group, got moe.num_experts/moe.num_groups=1"),
    ("routing_groups", ["moe.topk=9"], 1, "moe.topk=9 must be in [1, moe.num_experts=8]"),
    ("routing_groups", ["moe.zero_experts=4", "moe.topk=13"], 1,
     "moe.topk=13 must be in [1, moe.num_experts + moe.zero_experts=12]"),
    ("zero_expert_settings", ["moe.zero_experts=-1"], 1, "moe.zero_experts=-1 must be >= 0"),
    ("zero_expert_settings", ["moe.zero_experts=4", "moe.capacity_factor=1.0"], 1,
     "moe.zero_experts=4 cannot run with moe.capacity_factor=1.0: a capacity is per held expert, and a zero "
     "expert is held by no rank (set moe.capacity_factor=null, dropless)"),
    ("zero_expert_settings", ["moe.zero_experts=4", "moe.num_groups=4", "moe.group_topk=2"], 1,
     "moe.zero_experts=4 cannot run with moe.num_groups=4: routing groups split the held experts, and zero "
     "experts belong to no group"),
    ("zero_expert_settings", ["moe.zero_experts=4", "moe.router_replay=runs/a"], 1,
     "moe.zero_experts=4 cannot run with moe.router_replay=runs/a: route files record held experts only"),
    ("shortcut_moe_block", ["model.block=shortcut_moe", "moe.moe_layer_freq=2"], 1,
     "model.block=shortcut_moe needs an MoE in every block, but the MoE layers are [1, 0, 1, 0] (set "
     "moe.moe_layer_freq=1 and moe.first_k_dense=0)"),
    ("shortcut_moe_block", ["model.block=shortcut_moe", "model.mtp_num_layers=1"], 1,
     "model.mtp_num_layers=1 cannot run with model.block=shortcut_moe: an MTP depth is a standard block"),
    ("shortcut_moe_block", ["model.block=shortcut_moe", "model.num_layers=2",
                            "model.layer_types=[gated_deltanet, attention]"], 1,
     "model.layer_types=[gated_deltanet, attention] cannot run with model.block=shortcut_moe: its two sublayers "
     "are attention"),
    ("dynamic_cp_layout", ["parallel.dynamic_cp=true", "parallel.cp=3", "model.seq_length=126"], 3,
     "parallel.dynamic_cp=true needs parallel.cp a power of two up to 16, got cp=3"),
    ("dynamic_cp_layout", ["parallel.dynamic_cp=true", "parallel.cp=2", "parallel.pp=2"], 4,
     "parallel.dynamic_cp=true needs parallel.pp=1, got 2 (ranks hold unequal token counts under dynamic cp)"),
    ("upcycle_slices", ["init.upcycle_granularity=0"], 1, "init.upcycle_granularity=0 must be >= 1"),
    ("checkpoints_kept", ["train.keep_last=0"], 1, "train.keep_last=0 must be >= 1"),
    ("replicas_fit", ["parallel.ep=2", "moe.replicas=5"], 2,
     "moe.replicas=5 must be <= moe.num_experts - moe.num_experts/parallel.ep=4 (a rank holds at most one copy of "
     "an expert)"),
    ("replicas_fit", ["moe.replicas=1"], 1,
     "moe.replicas=1 needs parallel.ep > 1, got 1 (a copy of an expert lives on another ep rank)"),
    ("replacement_has_room", ["moe.replace_every=10"], 1,
     "moe.replace_every=10 needs parallel.ep > 1, got 1 (with one ep rank there is nowhere to move an expert)"),
    ("rotary_pairs", ["model.head_dim=15"], 1,
     "model.head_dim=15 must be even (rotary embeddings rotate pairs of dimensions)"),
    ("dense_width_over_tp", SP2 + ["moe.moe_layer_freq=0", "model.ffn_hidden_size=255"], 2,
     "model.ffn_hidden_size=255 is not divisible by parallel.tp=2"),
    ("vocab_over_tp", SP2 + ["model.vocab_size=263"], 2, "model.vocab_size=263 is not divisible by parallel.tp=2"),
    ("sequence_over_tp", SP2 + ["model.seq_length=127"], 2,
     "model.seq_length=127 is not divisible by parallel.tp*cp=2 "
     "(parallel.sequence_parallel=true splits each cp shard of the sequence over tp)"),
    ("sequence_over_cp", ["parallel.cp=2", "model.seq_length=126"], 2,
     "model.seq_length=126 is not divisible by 2*parallel.cp=4 (context parallel splits the sequence into 2*cp chunks)"),
    ("pipeline_split", ["parallel.pp=3"], 3,
     "model.num_layers=4 is not divisible by parallel.pp*vpp=3 (set parallel.pp_layers to split the layers unevenly)"),
    ("pipeline_split", ["parallel.pp=2", "parallel.pp_layers=[2,3]"], 2,
     "parallel.pp_layers=[2, 3] sums to 5, expected model.num_layers=4"),
    ("pipeline_split", ["parallel.pp=2", "parallel.pp_layers=[4]"], 2,
     "parallel.pp_layers has 1 entries, expected one per model chunk (parallel.pp*vpp=2)"),
    ("schedule_chunks", ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=1f1b"], 2,
     "parallel.vpp=2 requires parallel.pp_schedule=interleaved (or auto), got 1f1b"),
    ("schedule_chunks", ["parallel.pp=2", "parallel.pp_schedule=interleaved"], 2,
     "parallel.pp_schedule=interleaved requires parallel.vpp > 1, got null"),
    ("interleaved_micro_batches", ["model.num_layers=8", "parallel.pp=2", "parallel.vpp=2",
                                   "train.micro_batch_size=1", "train.global_batch_size=3"], 2,
     "train.global_batch_size/(micro_batch_size*dp)=3 micro-batches is not divisible by parallel.pp=2 (the "
     "interleaved schedule sends the micro-batches round the pipeline in groups of pp; global_batch_size=3, "
     "micro_batch_size=1, dp=1)"),
    ("world_fits_layouts", ["parallel.cp=3", "model.seq_length=126"], 4,
     "world_size=4 is not divisible by parallel.tp*cp*pp=3 (tp=1, cp=3, pp=1)"),
    ("world_fits_layouts", ["parallel.ep=3"], 4,
     "world_size=4 is not divisible by parallel.etp*ep*pp=3 (etp=null -> tp=1, ep=3, pp=1)"),
    ("order_is_permutation", ["parallel.order=tp-cp-dp-pp"], 1,
     "parallel.order=tp-cp-dp-pp must be a permutation of tp, cp, ep, dp, pp joined by '-'"),
    ("batch_over_dp", ["train.global_batch_size=6"], 1,
     "train.global_batch_size=6 is not divisible by train.micro_batch_size*dp=4 (micro_batch_size=4, "
     "dp=world_size/(tp*cp*pp)=1)"),
    ("adamw_settings", ["optimizer.beta2=1.0"], 1, "optimizer.beta2=1.0 must be in [0, 1)"),
    ("adamw_settings", ["optimizer.beta1=-0.1"], 1, "optimizer.beta1=-0.1 must be in [0, 1)"),
    ("adamw_settings", ["optimizer.eps=0"], 1, "optimizer.eps=0.0 must be > 0"),
    ("adamw_settings", ["optimizer.weight_decay=-0.1"], 1, "optimizer.weight_decay=-0.1 must be >= 0"),
    ("grad_clip", ["optimizer.clip_grad=-1.0"], 1, "optimizer.clip_grad=-1.0 must be >= 0"),
    ("param_gather_needs_distributed", ["parallel.overlap_param_gather=true"], 1,
     "parallel.overlap_param_gather=true needs optimizer.distributed=true (only the distributed optimizer "
     "all-gathers parameters after its step)"),
    ("bucket_size", ["parallel.grad_bucket_numel=0"], 1, "parallel.grad_bucket_numel=0 must be >= 1"),
    ("spike_detection", ["train.loss_spike_factor=-1.0"], 1, "train.loss_spike_factor=-1.0 must be >= 0"),
    ("spike_detection", ["train.loss_spike_window=0"], 1, "train.loss_spike_window=0 must be >= 1"),
]

# Raises in the package whose message names a config field's value but that check no rule
# of a config (what they check is not in the config): (file, the message's start) -> why.
NOT_CONFIG_RULES = {
    ("models/sampling.py", "parallel.cp={}: sampling runs"): "sampling's own command line (tests/models/test_sampling.py)",
    ("dispatch/router.py", "update_expert_bias needs"): "a call on a router built without moe.expert_bias",
    ("models/experts.py", "placement of {} experts"): "a placement argument built for other experts",
    ("moe_fold/planner/model.py", "pp_rank={} must be"): "a pp_rank argument outside [0, parallel.pp)",
    ("moe_fold/data/loader.py", "data.valid_fraction={} of {} documents"): "the documents a dataset holds",
    ("moe_fold/data/loader.py", "dataset {} was tokenized"): "what a dataset file holds",
    ("moe_fold/data/sources.py", "{}: "): "what a dataset file holds (check_data runs before spawning)",
    ("moe_fold/training/train.py", "{}; stopping"): "the step's outcome under train.on_nonfinite=stop",
    ("moe_fold/training/periodic.py", "{}; stopping"): "the step's outcome under train.on_loss_spike=stop",
    ("moe_fold/training/rollback.py", "{}; this is rollback"): "the run's outcome: rollbacks past "
                                                               "train.max_rollbacks",
    ("models/attention.py", "model.attn_temperature_tuning=true: the attention needs"): "a caller that gives no "
                                                                                        "token positions",
    ("moe_fold/elastic.py", "choose_layout needs parallel.elastic=true"): "a caller's mistake: the command line "
                                                                          "calls it only for elastic runs",
    ("moe_fold/routes.py", "{}: "): "what a routes file holds, against the model that replays it",
    ("moe_fold/routes.py", "moe.router_replay={} has no routes for sample"): "what a routes file holds",
    ("models/hf/routes.py", "routes_from_transformers: {} routes with"): "what a transformers model's router "
                                                                          "does",
}


def _wrap_rules(monkeypatch) -> dict[str, list[str]]:
    """Replace every rule of moe_fold.config by a wrapper recording the problems it returned,
    in every module of the config package that holds it (validate() calls a rule through the
    module of the caller)."""
    returned: dict[str, list[str]] = {name: [] for name in RULES}
    modules = [module for name, module in sys.modules.items()
               if name == "moe_fold.config" or name.startswith("moe_fold.config.")]
    for name, fn in RULES.items():
        def recording(*args, _fn=fn, _name=name):
            problems = _fn(*args)
            returned[_name].extend(problems)
            return problems
        for module in modules:
            if getattr(module, name, None) is fn:
                monkeypatch.setattr(module, name, recording)
    return returned


def _problems(overrides: list[str], world: int) -> list[str]:
    config = load_config("mixtral-tiny", ["wandb.mode=disabled", "parallel.ep=1"] + overrides)
    with pytest.raises(ConfigError) as info:
        check_trainable(config, world)
    return info.value.problems


@pytest.mark.parametrize("rule, overrides, world, message", RULE_CASES,
                         ids=[f"{r[0]}: {' '.join(r[1][-2:])}" for r in RULE_CASES])
def test_validate_applies_the_registered_rule(monkeypatch, rule, overrides, world, message):
    returned = _wrap_rules(monkeypatch)
    problems = _problems(overrides, world)
    assert message in problems, problems
    assert message in returned[rule], f"validate() reported {message!r} but not through config.{rule}"


def test_every_registered_rule_has_a_case():
    assert set(RULES) == {r[0] for r in RULE_CASES}


def test_a_module_applies_the_one_rule():
    """A module built on its own gets the registered rule's message (not a copy's)."""
    from moe_fold.dispatch.placement import Placement
    from moe_fold.dispatch.routing_stats import routing_stats
    from moe_fold.models.experts import Experts
    from moe_fold.layout import ProcessGroups
    import torch

    rule = config_module.experts_over_ep(6, 4)
    assert rule == ["moe.num_experts=6 is not divisible by parallel.ep=4"]
    for build in (lambda: Placement.contiguous(6, 4), lambda: routing_stats(torch.ones(6), torch.ones(6), ep=4)):
        with pytest.raises(ConfigError) as info:
            build()
        assert info.value.problems == rule
    with pytest.raises(ConfigError) as info:
        Experts(4, 8, 16, ProcessGroups.single_process(), std=0.1, seed=0, name="e", swiglu_backend="c")
    assert info.value.problems == config_module.choice("moe.swiglu_backend", "c")


def test_choice_reads_the_allowed_values_from_the_type():
    assert config_module.choices("moe.dispatcher") == ("alltoall", "allgather")
    assert config_module.choice("moe.dispatcher", "allgather") == []
    assert config_module.choice("moe.dispatcher", None) == ["moe.dispatcher=null must be one of alltoall, allgather"]
    assert config_module.choice("data.dtype", None) == []  # Optional[Literal[...]]: null is allowed
    assert config_module.choice("data.dtype", "uint7") == [
        "data.dtype=uint7 must be one of uint8, uint16, int16, uint32, int32, int64"]
    with pytest.raises(TypeError, match="config field moe.topk is not a Literal choice"):
        config_module.choices("moe.topk")


def _message_text(node: ast.expr) -> str:
    """The literal text of a message (a string or f-string; ``{}`` for each placeholder)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return ""


def _package_files(folders=PACKAGE):
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "presets" not in path.parts:
                yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text(), filename=str(path))


def test_no_module_checks_a_config_value_by_itself():
    """A raise naming a config field and its value (``moe.x=...``) lives in moe_fold/config/
    only; a module applies the rule with ``require(rule, ...)``, a rule of RULES."""
    field = re.compile(r"\b(" + "|".join(SECTIONS) + r")\.[a-z_]+=")
    found, unknown = set(), []
    for name, tree in _package_files():
        if name.startswith(CONFIG):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                text = _message_text(node.exc.args[0])
                if field.search(text) and not any(name == f and text.startswith(start)
                                                  for f, start in NOT_CONFIG_RULES):
                    found.add(f"{name}:{node.lineno}: {text}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require":
                rule = node.args[0]
                if not (isinstance(rule, ast.Name) and rule.id in RULES):
                    unknown.append(f"{name}:{node.lineno}")
    assert not found, sorted(found)
    assert not unknown, unknown


def _is_ep(node: ast.expr) -> bool:
    """``ep``, ``x.ep`` or ``groups.size("ep")``: an expert-parallel size."""
    if isinstance(node, ast.Name):
        return node.id == "ep"
    if isinstance(node, ast.Attribute):
        return node.attr == "ep"
    return (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "size" and node.args
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "ep")


# `% ep` that is not the experts' split: the slots of a placement (E + replicas per rank).
OTHER_SPLITS_OVER_EP = {("dispatch/placement.py", "n")}


def test_the_expert_split_over_ep_is_written_once():
    """``num_experts % ep`` (in any spelling) appears in config.experts_over_ep only, in the
    package and in the benchmarks."""
    rule = next(node for node in ast.walk(ast.parse((REPO / EXPERTS_OVER_EP).read_text()))
                if isinstance(node, ast.FunctionDef) and node.name == "experts_over_ep")
    inside_rule = range(rule.lineno, rule.end_lineno + 1)
    found = []
    for name, tree in _package_files(PACKAGE + ("bench",)):
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and _is_ep(node.right):
                if name == EXPERTS_OVER_EP and node.lineno in inside_rule:
                    continue
                if (name, ast.unparse(node.left)) not in OTHER_SPLITS_OVER_EP:
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_no_module_copies_a_list_of_choices():
    """The values of a Literal field are written in its type only; a module reads them with
    ``config.choices("section.field")``."""
    lists = {}
    for section, cls in SECTIONS.items():
        for key, tp in _field_types(cls).items():
            values = _literal_choices(tp)
            if values and len(values) > 1:
                lists[frozenset(values)] = f"{section}.{key}"
                lists.setdefault(frozenset(values) - {"auto"}, f"{section}.{key} less auto")
    found = []
    for name, tree in _package_files():
        if name.startswith(CONFIG):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1 and all(
                    isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                values = frozenset(e.value for e in node.elts)
                if values in lists:
                    found.append(f"{name}:{node.lineno}: {lists[values]}")
    assert not found, found


def test_interleaved_micro_batches_fail_in_the_cli_before_any_rank(tmp_path, capsys):
    """Used to pass the pre-spawn check and fail inside rank 0 with a traceback."""
    run_dir = tmp_path / "run"
    code = main(["train", "--config", "mixtral-tiny", "--nproc", "2", "--set", "model.num_layers=8",
                 "--set", "parallel.pp=2", "--set", "parallel.vpp=2", "--set", "parallel.ep=1",
                 "--set", "train.micro_batch_size=1", "--set", "train.global_batch_size=3",
                 "--set", f"train.run_dir={run_dir}", "--set", "wandb.mode=disabled"])
    assert code == 2
    err = capsys.readouterr().err
    assert "3 micro-batches is not divisible by parallel.pp=2" in err
    assert not run_dir.exists()  # nothing was started


def test_vpp_alone_selects_interleaved():
    from moe_fold.config import pipeline_schedule

    config = load_config("mixtral-tiny", ["model.num_layers=8", "parallel.pp=2", "parallel.vpp=2", "parallel.ep=1"])
    check_trainable(config, 2)
    assert config.parallel.pp_schedule == "auto" and pipeline_schedule(config) == "interleaved"
    config.parallel.vpp = None
    assert pipeline_schedule(config) == "1f1b"


def _module_refusals():
    """(a module built from bad direct arguments, the registered rule's message for them)."""
    import torch

    from moe_fold.data.loader import batches
    from moe_fold.layout import ParallelLayout, ProcessGroups
    from moe_fold.models.mlp import MLP
    from moe_fold.models.rotary import rotary_cos_sin
    from moe_fold.parallel.context_parallel import zigzag_split
    from moe_fold.parallel.pipeline import stage_layers
    from moe_fold.parallel.pipeline_schedules import check_schedule
    from moe_fold.parallel.tensor_parallel import VocabParallelEmbedding
    from moe_fold.training.buckets import make_buckets
    from moe_fold.training.numerics import LossSpikes
    from moe_fold.training.optim import AdamW, apply_gradients

    one = ProcessGroups.single_process()
    param = [torch.nn.Parameter(torch.ones(1))]
    c = config_module
    return [
        (lambda: rotary_cos_sin(torch.arange(4), 7, 1e4), c.rotary_pairs(7)),
        (lambda: zigzag_split(torch.zeros(6), 0, 2, dim=0), c.sequence_over_cp(6, 2)),
        (lambda: stage_layers(7, 2), c.pipeline_split(7, 2, 1, None)),
        (lambda: stage_layers(8, 2, 1, [3, 4]), c.pipeline_split(8, 2, 1, [3, 4])),
        (lambda: check_schedule("1f1b", 2, 2, 4), c.schedule_chunks("1f1b", 2)),
        (lambda: check_schedule("interleaved", 2, 1, 4), c.schedule_chunks("interleaved", 1)),
        (lambda: check_schedule("interleaved", 4, 2, 6), c.interleaved_micro_batches(6, 4)),
        (lambda: ParallelLayout(world_size=6, ep=4), c.world_fits_layouts(6, 1, 1, 1, 4, None)),
        (lambda: next(batches(None, 6, 2, 0, 2)), c.batch_over_dp(6, 2, 2)),
        (lambda: AdamW(param, betas=(0.9, 1.0)), c.adamw_settings(0.9, 1.0, 1e-8, 0.0)),
        (lambda: AdamW(param, overlap_param_gather=True), c.param_gather_needs_distributed(True, False)),
        (lambda: AdamW(param, bucket_numel=0), c.bucket_size(0)),
        (lambda: make_buckets([param], one, bucket_numel=0), c.bucket_size(0)),
        (lambda: apply_gradients([], AdamW(param), one, -1.0), c.grad_clip(-1.0)),
        (lambda: LossSpikes(2.0, 0), c.spike_detection(2.0, 0)),
        (lambda: LossSpikes(-1.0, 3), c.spike_detection(-1.0, 3)),
    ]


def test_modules_refuse_bad_arguments_with_the_rules_message(monkeypatch):
    """A module built on its own from bad arguments raises the registered rule's problems."""
    from moe_fold.layout import ProcessGroups
    from moe_fold.models import mlp
    from moe_fold.parallel import tensor_parallel

    for build, rule_problems in _module_refusals():
        with pytest.raises(ConfigError) as info:
            build()
        assert info.value.problems == rule_problems
    # The tp-sharded layers, on a tp group said to have 2 ranks (the rule runs before any shard).
    one = ProcessGroups.single_process()
    monkeypatch.setattr(mlp, "group_size", lambda group: 2)
    with pytest.raises(ConfigError) as info:
        mlp.MLP(8, 13, one.tp, False, std=0.1, seed=0, name="m")
    assert info.value.problems == config_module.dense_width_over_tp(13, 2)
    monkeypatch.setattr(tensor_parallel, "group_size", lambda group: 2)
    with pytest.raises(ConfigError) as info:
        tensor_parallel.VocabParallelEmbedding(11, 8, one.tp, False, std=0.1, seed=0)
    assert info.value.problems == config_module.vocab_over_tp(11, 2)

import dataclasses

import pytest

import moe_fold.config as config_module
import moe_fold.config.load as config_load
from moe_fold.config import (
    Config,
    ConfigError,
    config_to_dict,
    dump_config,
    list_presets,
    load_config,
    validate,
)


def problems_of(overrides: list[str], world_size: int) -> list[str]:
    config = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        validate(config, world_size)
    return info.value.problems


def load_problems(source=None, overrides=()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    return info.value.problems


# ---------------------------------------------------------------------------
# Loading and overrides.


def test_defaults_validate_for_world_1():
    config = load_config()
    assert config == Config()
    validate(config, 1)


def test_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  num_layers: 6\n  head_dim: 64\n"
        "moe:\n  num_experts: 16\n  moe_layer_freq: [0, 1, 1, 1, 1, 1]\n  capacity_factor: 1.25\n"
        "parallel:\n  etp: null\n  pp_layers: [3, 3]\n"
        "optimizer:\n  lr: 1e-3\n  min_lr: 1\n"
        "data:\n  path: [a, b]\n  weights: [1, 2.5]\n"
        "wandb:\n"  # an empty section keeps its defaults
    )
    config = load_config(str(path))
    assert config.model.num_layers == 6 and config.model.head_dim == 64
    assert config.moe.num_experts == 16 and config.moe.moe_layer_freq == [0, 1, 1, 1, 1, 1]
    assert config.moe.capacity_factor == 1.25
    assert config.parallel.etp is None and config.parallel.pp_layers == [3, 3]
    # YAML 1.1 reads 1e-3 as a string and 1 as an int: both become floats.
    assert config.optimizer.lr == 1e-3 and isinstance(config.optimizer.lr, float)
    assert config.optimizer.min_lr == 1.0 and isinstance(config.optimizer.min_lr, float)
    assert config.data.path == ["a", "b"] and config.data.weights == [1.0, 2.5]
    assert config.wandb == config_module.WandbConfig()
    assert config.model.hidden_size == 128  # untouched default


def test_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(str(path)) == Config()


def test_yaml_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("moee:\n  topk: 2\nmoe:\n  topkk: 3\n  num_experts: eight\ntrain: 5\n")
    assert load_problems(str(path)) == [
        "unknown config section 'moee'; did you mean 'moe'?",
        "section 'train' must be a mapping of field: value, got 5",
        "unknown config key 'moe.topkk'; did you mean 'moe.topk'?",
        "moe.num_experts='eight' has type str: expected int",
    ]
    path.write_text("- 1\n- 2\n")
    assert load_problems(str(path)) == [f"{path} must map section names to sections, got list"]
    assert load_problems(str(tmp_path / "missing.yaml")) == [f"config file not found: {tmp_path / 'missing.yaml'}"]


def test_presets(tmp_path, monkeypatch):
    (tmp_path / "mixtral-tiny.yaml").write_text("moe:\n  num_experts: 4\n")
    monkeypatch.setattr(config_load, "presets_dir", lambda: tmp_path)
    assert list_presets() == ["mixtral-tiny"]
    assert load_config("mixtral-tiny", ["moe.topk=1"]).moe.num_experts == 4
    assert load_problems("mixtral-tiyn") == [
        f"unknown preset 'mixtral-tiyn'; did you mean 'mixtral-tiny'? available presets: mixtral-tiny (in {tmp_path})"
    ]
    assert load_problems("llama") == [f"unknown preset 'llama'; available presets: mixtral-tiny (in {tmp_path})"]


def test_installed_presets_load_and_round_trip(tmp_path):
    # Presets are added by other parts of the project; every one must load and survive a dump.
    for name in list_presets():
        config = load_config(name)
        dump_config(config, tmp_path / f"{name}.yaml")
        assert load_config(str(tmp_path / f"{name}.yaml")) == config, name


@pytest.mark.parametrize("override, section, field, expected", [
    ("train.steps=7", "train", "steps", 7),
    ("optimizer.lr=1e-3", "optimizer", "lr", 1e-3),
    ("optimizer.lr=0.5", "optimizer", "lr", 0.5),
    ("optimizer.lr=2", "optimizer", "lr", 2.0),
    ("train.deterministic=true", "train", "deterministic", True),
    ("moe.dedup=false", "moe", "dedup", False),
    ("moe.shared_expert_overlap=true", "moe", "shared_expert_overlap", True),
    ("moe.overlap_chunks=2", "moe", "overlap_chunks", 2),
    ("train.run_dir=runs/x", "train", "run_dir", "runs/x"),
    ("wandb.name=123", "wandb", "name", "123"),  # a str field keeps the text as typed
    ("data.tokenizer=true", "data", "tokenizer", "true"),
    ("wandb.name=null", "wandb", "name", None),
    ("parallel.etp=2", "parallel", "etp", 2),
    ("parallel.vpp=null", "parallel", "vpp", None),
    ("moe.capacity_factor=1.5", "moe", "capacity_factor", 1.5),
    ("moe.capacity_factor=null", "moe", "capacity_factor", None),
    ("moe.moe_layer_freq=2", "moe", "moe_layer_freq", 2),
    ("moe.moe_layer_freq=[1,0,1]", "moe", "moe_layer_freq", [1, 0, 1]),
    ("parallel.pp_layers=[1, 3]", "parallel", "pp_layers", [1, 3]),
    ("data.weights=[1, 0.5]", "data", "weights", [1.0, 0.5]),
    ("data.path=corpus", "data", "path", "corpus"),
    ("data.path=[a,b]", "data", "path", ["a", "b"]),
    ("data.path=null", "data", "path", None),
    ("parallel.order=tp-ep-cp-dp-pp", "parallel", "order", "tp-ep-cp-dp-pp"),
])
def test_override_types(override, section, field, expected):
    value = getattr(getattr(load_config(None, [override]), section), field)
    assert value == expected
    assert type(value) is type(expected)
    if isinstance(expected, list):
        assert [type(v) for v in value] == [type(v) for v in expected]


def test_overrides_apply_in_order():
    assert load_config(None, ["moe.topk=1", "moe.topk=3"]).moe.topk == 3


@pytest.mark.parametrize("override, message", [
    ("moe.topkk=4", "unknown config key 'moe.topkk'; did you mean 'moe.topk'?"),
    ("moee.topk=4", "unknown config key 'moee.topk'; did you mean 'moe.topk'?"),
    ("zz.qq=1", "unknown config key 'zz.qq'; sections are: model, moe, parallel, data, optimizer, train, wandb, init"),
    ("init.xyz=1", "unknown config key 'init.xyz'; init has: from_hf, upcycle_from, upcycle_granularity"),
    ("topk=4", "override 'topk=4' must look like section.field=value"),
    ("moe.topk", "override 'moe.topk' must look like section.field=value"),
    ("train.steps=1.5", "train.steps=1.5 has type float: expected int"),
    ("train.steps=true", "train.steps=True has type bool: expected int"),
    ("train.steps=null", "train.steps=null is not allowed: expected int"),
    ("optimizer.lr=fast", "optimizer.lr='fast' has type str: expected float"),
    ("moe.expert_bias=1", "moe.expert_bias=1 has type int: expected bool"),
    ("moe.moe_layer_freq=[1,x]", "moe.moe_layer_freq=[1, 'x'] has type list: expected int or list[int]"),
    ("parallel.etp=two", "parallel.etp='two' has type str: expected int or null"),
    ("data.path=[a, 1]", "data.path=['a', 1] has type list: expected str or list[str] or null"),
    ("data.weights=0.5", "data.weights=0.5 has type float: expected list[float] or null"),
])
def test_override_errors(override, message):
    assert load_problems(None, [override]) == [message]


def test_overrides_must_be_a_list():
    assert load_problems(None, "moe.topk=4") == [
        "overrides must be a list of section.field=value strings, got the string 'moe.topk=4'"
    ]


def test_override_yaml_syntax_error():
    (problem,) = load_problems(None, ["moe.moe_layer_freq=[1,0"])
    assert problem.startswith("cannot parse the value of override 'moe.moe_layer_freq=[1,0' as YAML")


def test_all_load_problems_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["moe.topkk=4", "train.steps=x"])
    assert str(info.value) == (
        "invalid config: 2 problems\n"
        "  - unknown config key 'moe.topkk'; did you mean 'moe.topk'?\n"
        "  - train.steps='x' has type str: expected int"
    )


def test_round_trip(tmp_path):
    config = load_config(None, [
        "optimizer.lr=1e-4", "optimizer.eps=1e-12", "moe.moe_layer_freq=[0,1,1,1]",
        "moe.capacity_factor=1.25", "parallel.pp_layers=[1,3]", "parallel.pp=2",
        "data.path=[a,b]", "data.weights=[0.3,0.7]", "wandb.name=123", "parallel.timeout_s=.inf",
    ])
    path = tmp_path / "dump.yaml"
    dump_config(config, path)
    assert load_config(str(path)) == config
    assert config_to_dict(load_config(str(path))) == config_to_dict(config)
    dump_config(Config(), path)
    assert load_config(path) == Config()  # a Path works as well as a str
    assert set(config_to_dict(config)) == {"model", "moe", "parallel", "data", "optimizer", "train", "wandb", "init"}


# ---------------------------------------------------------------------------
# Validation: every rule, with its exact message.

SP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]

RULES = [
    # multi-token prediction
    (["model.mtp_num_layers=-1"], 1, ["model.mtp_num_layers=-1 must be >= 0"]),
    (["model.mtp_loss_weight=-0.5"], 1, ["model.mtp_loss_weight=-0.5 must be >= 0"]),
    (["model.mtp_num_layers=128"], 1,
     ["model.mtp_num_layers=128 must be < model.seq_length=128 (depth k predicts token t+1+k inside the sequence)"]),
    (["model.mtp_num_layers=1", "parallel.cp=2", "parallel.dynamic_cp=true"], 2,
     ["model.mtp_num_layers=1 is not supported with parallel.dynamic_cp=true (the MTP targets are shifted "
      "along the layout's cp shards)"]),
    # partial rotary and the QK-norm's scope
    (["model.qk_norm_scope=heads"], 1, ["model.qk_norm_scope=heads must be one of head, projection, l2"]),
    # attention features (issue 29): sinks, sliding window, chunks, NoPE, temperature tuning
    (["model.sliding_window=-1"], 1, ["model.sliding_window=-1 must be >= 0"]),
    (["model.sliding_window=4", "model.attention_chunk=8"], 1,
     ["model.sliding_window=4 and model.attention_chunk=8: set at most one (a local layer has one kind of mask)"]),
    (["model.local_attention_layers=[1, 0]"], 1,
     ["model.local_attention_layers=[1, 0] must be 4 flags of 0 or 1 (one per layer of model.num_layers=4)",
      "model.local_attention_layers=[1, 0] is set but model.sliding_window and model.attention_chunk are 0 "
      "(no local attention)"]),
    (["model.rope_layers=[1, 1, 2, 0]"], 1,
     ["model.rope_layers=[1, 1, 2, 0] must be 4 flags of 0 or 1 (one per layer of model.num_layers=4)"]),
    (["model.attn_temperature_floor=0", "model.attn_temperature_scale=0"], 1,
     ["model.attn_temperature_scale=0.0 must be > 0", "model.attn_temperature_floor=0 must be >= 1"]),
    (["model.attn_temperature_tuning=true", "model.mtp_num_layers=1"], 1,
     ["model.attn_temperature_tuning=true is not supported with model.mtp_num_layers=1 (the MTP depths' "
      "attention gets no token positions)"]),
    (["model.qk_norm=true", "model.qk_norm_scope=l2", "model.rope_layers=[0, 0, 0, 0]"], 1,
     ["model.qk_norm_scope=l2 normalises rotary layers only, but model.rope_layers has none"]),
    (["model.partial_rotary_factor=0"], 1, ["model.partial_rotary_factor=0.0 must be in (0, 1]"]),
    (["model.partial_rotary_factor=1.5"], 1, ["model.partial_rotary_factor=1.5 must be in (0, 1]"]),
    (["model.partial_rotary_factor=0.3"], 1,
     ["model.partial_rotary_factor=0.3 of head_dim=32 gives 9.6 rotary dims: it must be a positive even integer"]),
    (["model.partial_rotary_factor=0.5", "model.attention=mla", "model.num_kv_heads=4", "model.kv_lora_rank=8",
      "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8"], 1,
     ["model.partial_rotary_factor=0.5 must be 1 when model.attention=mla (MLA's rotary part is "
      "model.qk_rope_head_dim)"]),
    # sizes and world divisibility
    (["parallel.tp=0"], 1, ["parallel.tp=0 must be >= 1"]),
    (["parallel.cp=0"], 1, ["parallel.cp=0 must be >= 1"]),
    (["parallel.pp=0"], 1, ["parallel.pp=0 must be >= 1"]),
    (["parallel.ep=0"], 1, ["parallel.ep=0 must be >= 1"]),
    (["parallel.etp=0"], 1, ["parallel.etp=0 must be >= 1"]),
    (["parallel.vpp=0"], 1, ["parallel.vpp=0 must be >= 1"]),
    ([], 0, ["world_size=0 must be >= 1"]),
    (SP2, 3, ["world_size=3 is not divisible by parallel.tp*cp*pp=2 (tp=2, cp=1, pp=1)",
              "world_size=3 is not divisible by parallel.etp*ep*pp=2 (etp=null -> tp=2, ep=1, pp=1)"]),
    (["parallel.etp=2"], 1, ["world_size=1 is not divisible by parallel.etp*ep*pp=2 (etp=2, ep=1, pp=1)"]),
    (["parallel.ep=8"], 4, ["world_size=4 is not divisible by parallel.etp*ep*pp=8 (etp=null -> tp=1, ep=8, pp=1)"]),
    # experts and top-k
    (["moe.num_experts=6", "parallel.ep=4"], 4, ["moe.num_experts=6 is not divisible by parallel.ep=4"]),
    (["moe.topk=9"], 1, ["moe.topk=9 must be in [1, moe.num_experts=8]"]),
    (["moe.topk=0"], 1, ["moe.topk=0 must be in [1, moe.num_experts=8]"]),
    (["moe.num_experts=0"], 1,
     ["moe.num_experts=0 must be >= 1 when any layer is MoE (moe.moe_layer_freq=1, moe.first_k_dense=0)"]),
    # attention heads and tp/cp
    (SP2 + ["model.num_heads=3", "model.num_kv_heads=1", "model.head_dim=32"], 2,
     ["model.num_heads=3 is not divisible by parallel.tp=2", "model.num_kv_heads=1 is not divisible by parallel.tp=2"]),
    (SP2 + ["model.num_kv_heads=1"], 2, ["model.num_kv_heads=1 is not divisible by parallel.tp=2"]),
    (["model.num_kv_heads=3"], 1, ["model.num_heads=4 is not divisible by model.num_kv_heads=3"]),
    (["model.hidden_size=130"], 1,
     ["model.hidden_size=130 is not divisible by model.num_heads=4 (required when model.head_dim is null)"]),
    (SP2 + ["model.seq_length=127"], 2,
     ["model.seq_length=127 is not divisible by parallel.tp*cp=2 "
      "(parallel.sequence_parallel=true splits each cp shard of the sequence over tp)"]),
    (["parallel.tp=4", "parallel.sequence_parallel=true", "parallel.cp=2", "model.num_kv_heads=4",
      "model.seq_length=12"], 8,
     ["model.seq_length=12 is not divisible by parallel.tp*cp=8 "
      "(parallel.sequence_parallel=true splits each cp shard of the sequence over tp)"]),
    (["parallel.cp=2", "model.seq_length=130"], 2,
     ["model.seq_length=130 is not divisible by 2*parallel.cp=4 (context parallel splits the sequence into 2*cp chunks)"]),
    (["parallel.cp=2", "parallel.cp_kind=a2a", "model.num_heads=3", "model.num_kv_heads=1", "model.head_dim=32"], 2,
     ["model.num_heads=3 is not divisible by parallel.tp*cp=2 (parallel.cp_kind=a2a splits each tp rank's heads over cp)"]),
    (SP2 + ["parallel.cp=2", "parallel.cp_kind=a2a", "model.num_heads=6", "model.head_dim=32"], 4,
     ["model.num_heads=6 is not divisible by parallel.tp*cp=4 (parallel.cp_kind=a2a splits each tp rank's heads over cp)"]),
    # MoE with tp, widths
    (["parallel.tp=2"], 2, ["parallel.tp=2 with MoE layers requires parallel.sequence_parallel=true"]),
    (SP2 + ["model.ffn_hidden_size=255", "moe.first_k_dense=1"], 2,
     ["model.ffn_hidden_size=255 is not divisible by parallel.tp=2"]),
    (SP2 + ["moe.shared_expert_ffn_hidden_size=255"], 2,
     ["moe.shared_expert_ffn_hidden_size=255 is not divisible by parallel.tp=2"]),
    (SP2 + ["moe.ffn_hidden_size=255"], 2, ["moe.ffn_hidden_size=255 is not divisible by parallel.tp=2 (parallel.etp is null, so experts are split over tp)"]),
    (["parallel.etp=2", "moe.ffn_hidden_size=255"], 2, ["moe.ffn_hidden_size=255 is not divisible by parallel.etp=2"]),
    (SP2 + ["model.vocab_size=511"], 2, ["model.vocab_size=511 is not divisible by parallel.tp=2"]),
    # group-limited routing
    (["moe.num_groups=4"], 1, ["moe.num_groups=4 and moe.group_topk=null must be both set or both null"]),
    (["moe.group_topk=2"], 1, ["moe.num_groups=null and moe.group_topk=2 must be both set or both null"]),
    (["moe.num_groups=0", "moe.group_topk=1"], 1, ["moe.num_groups=0 must be >= 1"]),
    (["moe.num_groups=4", "moe.group_topk=0"], 1, ["moe.group_topk=0 must be >= 1"]),
    (["moe.num_groups=3", "moe.group_topk=1"], 1, ["moe.num_experts=8 is not divisible by moe.num_groups=3"]),
    (["moe.num_groups=4", "moe.group_topk=5"], 1, ["moe.group_topk=5 must be <= moe.num_groups=4"]),
    (["moe.num_groups=4", "moe.group_topk=2", "moe.topk=3"], 1,
     ["moe.topk=3 is not divisible by moe.group_topk=2 (each selected group is scored by its best topk/group_topk experts)"]),
    (["moe.num_groups=4", "moe.group_topk=1", "moe.topk=3"], 1,
     ["moe.topk=3 exceeds the 2 experts in the selected groups (moe.group_topk=1 * moe.num_experts/moe.num_groups=2)"]),
    (["moe.group_score=top3"], 1, ["moe.group_score=top3 must be one of topk_sum, top2_sum, max"]),
    (["moe.num_groups=8", "moe.group_topk=2", "moe.group_score=top2_sum"], 1,
     ["moe.group_score=top2_sum needs >= 2 experts per group, got moe.num_experts/moe.num_groups=1"]),
    (["moe.num_groups=4", "moe.group_topk=1", "moe.topk=3", "moe.group_score=max"], 1,
     ["moe.topk=3 exceeds the 2 experts in the selected groups (moe.group_topk=1 * moe.num_experts/moe.num_groups=2)"]),
    # router options
    (["moe.score_function=tanh"], 1, ["moe.score_function=tanh must be one of softmax, sigmoid"]),
    (["moe.router_dtype=float16"], 1, ["moe.router_dtype=float16 must be one of float32, float64"]),
    (["moe.expert_bias=true"], 1, ["moe.expert_bias=true requires moe.score_function=sigmoid, got softmax (or "
                                   "moe.pre_softmax=true: the bias is added to the softmax over all experts, as in "
                                   "ERNIE-4.5)"]),
    (["moe.topk_norm_min=1e-12"], 1, ["moe.topk_norm_min=1e-12 requires moe.pre_softmax=true (it renormalises the "
                                      "top-k of the softmax over all experts)"]),
    (["moe.pre_softmax=true", "moe.topk_norm_min=0"], 1, ["moe.topk_norm_min=0.0 must be a finite number > 0 when set"]),
    (["moe.pre_softmax=true", "moe.score_function=sigmoid"], 1,
     ["moe.pre_softmax=true requires moe.score_function=softmax, got sigmoid"]),
    (["moe.scaling_factor=0"], 1, ["moe.scaling_factor=0.0 must be > 0 when set"]),
    (["moe.input_jitter=-0.1"], 1, ["moe.input_jitter=-0.1 must be >= 0"]),
    (["moe.input_jitter=.nan"], 1, ["moe.input_jitter=nan must be >= 0"]),
    (["moe.bias_update_rate=-1"], 1, ["moe.bias_update_rate=-1.0 must be >= 0"]),
    (["moe.aux_loss_coeff=-1"], 1, ["moe.aux_loss_coeff=-1.0 must be >= 0"]),
    (["moe.seq_aux_loss_coeff=-1"], 1, ["moe.seq_aux_loss_coeff=-1.0 must be >= 0"]),
    (["moe.global_aux_loss_coeff=-1"], 1, ["moe.global_aux_loss_coeff=-1.0 must be >= 0"]),
    (["moe.z_loss_coeff=-1"], 1, ["moe.z_loss_coeff=-1.0 must be >= 0"]),
    # dispatch and kernels
    (["moe.capacity_factor=0"], 1, ["moe.capacity_factor=0.0 must be > 0, or null for dropless"]),
    (["moe.pad_to_capacity=true"], 1, ["moe.pad_to_capacity=true requires moe.capacity_factor to be set, got null"]),
    (["moe.drop_policy=random"], 1, ["moe.drop_policy=random must be one of probs, position"]),
    (["moe.dispatcher=flex"], 1, ["moe.dispatcher=flex must be one of alltoall, allgather"]),
    (["moe.dedup=true", "moe.dispatcher=allgather"], 1,
     ["moe.dedup=true requires moe.dispatcher=alltoall, got allgather"]),
    (["moe.shared_expert_overlap=true"], 1,
     ["moe.shared_expert_overlap=true needs a shared expert (moe.shared_expert_ffn_hidden_size > 0, got 0)"]),
    (["moe.overlap_chunks=0"], 1, ["moe.overlap_chunks=0 must be >= 1"]),
    (["moe.overlap_chunks=2", "moe.capacity_factor=1.0", "moe.pad_to_capacity=true"], 1,
     ["moe.overlap_chunks=2 requires moe.pad_to_capacity=false: one chunk may hold all of an expert's tokens, "
      "so every chunk would be padded to the layer's whole capacity, multiplying the bytes sent by the number "
      "of chunks"]),
    (["moe.gemm_backend=cutlass"], 1, ["moe.gemm_backend=cutlass must be one of auto, grouped_gemm, torch, triton, loop"]),
    (["moe.permute_backend=cuda"], 1, ["moe.permute_backend=cuda must be one of auto, torch, triton"]),
    (["moe.swiglu_backend=c"], 1, ["moe.swiglu_backend=c must be one of auto, torch, triton, cpu"]),
    (["moe.topk_backend=fused"], 1, ["moe.topk_backend=fused must be one of auto, torch, triton"]),
    (["moe.topk_backend=triton", "moe.num_groups=4", "moe.group_topk=2"], 1,
     ["moe.topk_backend=triton fuses plain top-k only; moe.num_groups=4 and moe.expert_bias=false need "
      "moe.topk_backend=torch (or auto)"]),
    # expert placement
    (["moe.replicas=-1"], 1, ["moe.replicas=-1 must be >= 0"]),
    (["moe.replace_every=-2"], 1, ["moe.replace_every=-2 must be >= 0"]),
    (["moe.replicas=1"], 1, ["moe.replicas=1 needs parallel.ep > 1, got 1 (a copy of an expert lives on another ep rank)"]),
    (["moe.replicas=7", "parallel.ep=4"], 4,
     ["moe.replicas=7 must be <= moe.num_experts - moe.num_experts/parallel.ep=6 (a rank holds at most one copy of an expert)"]),
    (["moe.replace_every=10"], 1,
     ["moe.replace_every=10 needs parallel.ep > 1, got 1 (with one ep rank there is nowhere to move an expert)"]),
    # layer pattern
    (["moe.moe_layer_freq=-1"], 1, ["moe.moe_layer_freq=-1 must be >= 0"]),
    (["moe.moe_layer_freq=[1,0,1]"], 1,
     ["moe.moe_layer_freq has 3 entries, expected one per layer (model.num_layers=4)"]),
    (["moe.moe_layer_freq=[1,2,1,0]"], 1, ["moe.moe_layer_freq[1]=2 must be 0 or 1"]),
    (["moe.first_k_dense=5"], 1, ["moe.first_k_dense=5 must be in [0, model.num_layers=4]"]),
    (["moe.first_k_dense=-1"], 1, ["moe.first_k_dense=-1 must be in [0, model.num_layers=4]"]),
    # pipeline and other parallel settings
    (["parallel.pp=3"], 3,
     ["model.num_layers=4 is not divisible by parallel.pp*vpp=3 (set parallel.pp_layers to split the layers unevenly)"]),
    (["parallel.pp=2", "parallel.vpp=4", "parallel.pp_schedule=interleaved"], 2,
     ["model.num_layers=4 is not divisible by parallel.pp*vpp=8 (set parallel.pp_layers to split the layers unevenly)"]),
    (["parallel.pp=3", "parallel.pp_layers=[2,2]"], 3,
     ["parallel.pp_layers has 2 entries, expected one per model chunk (parallel.pp*vpp=3)"]),
    (["parallel.pp=2", "parallel.pp_layers=[4,0]"], 2, ["parallel.pp_layers[1]=0 must be >= 1"]),
    (["parallel.pp=2", "parallel.pp_layers=[2,3]"], 2,
     ["parallel.pp_layers=[2, 3] sums to 5, expected model.num_layers=4"]),
    (["parallel.vpp=2", "parallel.pp_schedule=interleaved"], 1, ["parallel.vpp=2 requires parallel.pp > 1, got 1"]),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=1f1b"], 2,
     ["parallel.vpp=2 requires parallel.pp_schedule=interleaved (or auto), got 1f1b"]),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved"], 2,
     ["parallel.pp_schedule=interleaved requires parallel.vpp > 1, got null"]),
    (["parallel.pp_schedule=gpipe"], 1, ["parallel.pp_schedule=gpipe must be one of auto, 1f1b, interleaved"]),
    (["parallel.cp_kind=ulysses"], 1, ["parallel.cp_kind=ulysses must be one of ring, a2a"]),
    (["parallel.backend=mpi"], 1, ["parallel.backend=mpi must be one of auto, gloo, nccl"]),
    (["parallel.order=tp-cp-dp-pp"], 1,
     ["parallel.order=tp-cp-dp-pp must be a permutation of tp, cp, ep, dp, pp joined by '-'"]),
    (["parallel.order=tp-cp-ep-dp-dp"], 1,
     ["parallel.order=tp-cp-ep-dp-dp must be a permutation of tp, cp, ep, dp, pp joined by '-'"]),
    (["parallel.timeout_s=0"], 1, ["parallel.timeout_s=0.0 must be > 0"]),
    (["parallel.grad_bucket_numel=0"], 1, ["parallel.grad_bucket_numel=0 must be >= 1"]),
    (["parallel.overlap_grad_reduce=true", "parallel.ep=2", "moe.num_experts=4", "moe.replicas=1"], 2,
     ["parallel.overlap_grad_reduce=true cannot run with moe.replicas=1 yet: the copies of an expert sum their grads "
      "over ep after the whole backward, before the data-parallel reduction"]),
    (["parallel.overlap_param_gather=true"], 1,
     ["parallel.overlap_param_gather=true needs optimizer.distributed=true (only the distributed optimizer "
      "all-gathers parameters after its step)"]),
    # model sizes
    (["model.vocab_size=0"], 1, ["model.vocab_size=0 must be >= 1"]),
    (["model.hidden_size=0"], 1, ["model.hidden_size=0 must be >= 1"]),
    (["model.num_layers=0"], 1, ["model.num_layers=0 must be >= 1"]),
    (["model.num_heads=0"], 1, ["model.num_heads=0 must be >= 1"]),
    (["model.num_kv_heads=0"], 1, ["model.num_kv_heads=0 must be >= 1"]),
    (["model.seq_length=0"], 1, ["model.seq_length=0 must be >= 1"]),
    (["model.head_dim=0"], 1, ["model.head_dim=0 must be >= 1"]),
    (["model.ffn_hidden_size=0", "moe.moe_layer_freq=2"], 1, ["model.ffn_hidden_size=0 must be >= 1"]),
    (["model.rope_theta=0"], 1, ["model.rope_theta=0.0 must be > 0"]),
    (["model.norm_eps=0"], 1, ["model.norm_eps=0.0 must be > 0"]),
    (["model.init_std=-0.02"], 1, ["model.init_std=-0.02 must be > 0"]),
    (["moe.ffn_hidden_size=0"], 1, ["moe.ffn_hidden_size=0 must be >= 1"]),
    (["moe.shared_expert_ffn_hidden_size=-1"], 1, ["moe.shared_expert_ffn_hidden_size=-1 must be >= 0"]),
    # training
    (["train.global_batch_size=10"], 1,
     ["train.global_batch_size=10 is not divisible by train.micro_batch_size*dp=4 "
      "(micro_batch_size=4, dp=world_size/(tp*cp*pp)=1)"]),
    ([], 8, ["train.global_batch_size=16 is not divisible by train.micro_batch_size*dp=32 "
             "(micro_batch_size=4, dp=world_size/(tp*cp*pp)=8)"]),
    (["train.steps=0"], 1, ["train.steps=0 must be >= 1", "optimizer.warmup_steps=10 must be <= train.steps=0"]),
    (["train.save_every=0"], 1, ["train.save_every=0 must be >= 1"]),
    (["train.keep_last=0"], 1, ["train.keep_last=0 must be >= 1"]),
    (["train.log_every=0"], 1, ["train.log_every=0 must be >= 1"]),
    (["train.micro_batch_size=0"], 1, ["train.micro_batch_size=0 must be >= 1"]),
    (["train.global_batch_size=0"], 1, ["train.global_batch_size=0 must be >= 1"]),
    (["train.precision=fp16"], 1, ["train.precision=fp16 must be one of fp32, bf16-autocast, bf16"]),
    (["train.recompute=all"], 1, ["train.recompute=all must be one of none, full, moe, expert_act"]),
    (["train.device=gpu"], 1, ["train.device=gpu must be one of auto, cpu, cuda"]),
    (["train.device=cpu", "parallel.backend=nccl"], 1,
     ["train.device=cpu cannot run with parallel.backend=nccl (NCCL reduces CUDA tensors only); use "
      "parallel.backend=gloo or auto"]),
    (["train.device=cuda", "parallel.backend=gloo"], 1,
     ["train.device=cuda cannot run with parallel.backend=gloo (gloo ranks compute on the CPU); use "
      "parallel.backend=nccl or auto"]),
    (["train.on_nonfinite=ignore"], 1, ["train.on_nonfinite=ignore must be one of skip, stop, rollback"]),
    (["train.exit_signals=[SIGTERM, SIGKILL]"], 1,
     ["train.exit_signals: SIGKILL is not a signal a run can stop on; use SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP"]),
    (["train.exit_after_minutes=0"], 1, ["train.exit_after_minutes=0.0 must be > 0"]),
    (["train.exit_at_step=0"], 1, ["train.exit_at_step=0 must be >= 1"]),
    (["train.eval_every=-1"], 1, ["train.eval_every=-1 must be >= 0"]),
    (["train.eval_iters=0"], 1, ["train.eval_iters=0 must be >= 1"]),
    (["data.valid_fraction=1"], 1, ["data.valid_fraction=1.0 must be in [0, 1)"]),
    (["data.valid_fraction=0.1", "data.valid_path=data/valid"], 1,
     ["data.valid_path=data/valid and data.valid_fraction=0.1 are exclusive: validate on another dataset or on "
      "a held-out fraction of the training data"]),
    (["data.valid_path=''"], 1, ["data.valid_path='' must be a dataset path, or null"]),
    (["train.eval_every=10"], 1, ["train.eval_every=10 needs validation data: set data.valid_path or "
                                  "data.valid_fraction > 0"]),
    # optimizer
    (["optimizer.lr=0"], 1, ["optimizer.lr=0.0 must be > 0"]),
    (["optimizer.min_lr=0.01"], 1, ["optimizer.min_lr=0.01 must be in [0, optimizer.lr=0.003]"]),
    (["optimizer.min_lr=-1"], 1, ["optimizer.min_lr=-1.0 must be in [0, optimizer.lr=0.003]"]),
    (["optimizer.beta1=1"], 1, ["optimizer.beta1=1.0 must be in [0, 1)"]),
    (["optimizer.beta2=-0.1"], 1, ["optimizer.beta2=-0.1 must be in [0, 1)"]),
    (["optimizer.eps=0"], 1, ["optimizer.eps=0.0 must be > 0"]),
    (["optimizer.clip_grad=-1"], 1, ["optimizer.clip_grad=-1.0 must be >= 0"]),
    (["optimizer.weight_decay=-0.1"], 1, ["optimizer.weight_decay=-0.1 must be >= 0"]),
    (["optimizer.warmup_steps=-1"], 1, ["optimizer.warmup_steps=-1 must be >= 0"]),
    (["optimizer.warmup_steps=200"], 1, ["optimizer.warmup_steps=200 must be <= train.steps=100"]),
    (["optimizer.schedule=linear"], 1, ["optimizer.schedule=linear must be one of cosine, wsd, constant"]),
    (["optimizer.decay_fraction=0"], 1, ["optimizer.decay_fraction=0.0 must be in (0, 1]"]),
    (["optimizer.decay_fraction=1.5"], 1, ["optimizer.decay_fraction=1.5 must be in (0, 1]"]),
    # data and wandb
    (["data.path=[a,b]", "data.weights=[1]"], 1,
     ["data.weights has 1 entries, expected one per data.path entry (2)"]),
    (["data.path=a", "data.weights=[1, 2]"], 1,
     ["data.weights has 2 entries, expected one per data.path entry (1)"]),
    (["data.path=[a,b]", "data.weights=[1, 0]"], 1, ["data.weights[1]=0.0 must be > 0"]),
    (["data.weights=[1]"], 1, ["data.weights=[1.0] is set but data.path is null"]),
    (["data.path=[]"], 1, ["data.path=[] must name at least one dataset, or be null for the demo corpus"]),
    (["data.path=[a, '']"], 1, ["data.path[1]='' must be a dataset path"]),
    (["data.path=''"], 1, ["data.path='' must be a dataset path, or null for the demo corpus"]),
    (["data.tokenizer=''"], 1, ["data.tokenizer='' must be byte or a path to a tokenizer.json"]),
    (["wandb.mode=on"], 1, ["wandb.mode=on must be one of offline, online, disabled"]),
    (["wandb.heatmap_every=0"], 1, ["wandb.heatmap_every=0 must be >= 1"]),
]


@pytest.mark.parametrize("overrides, world_size, expected", RULES, ids=[" ".join(r[0]) or "default" for r in RULES])
def test_rule(overrides, world_size, expected):
    assert problems_of(overrides, world_size) == expected


@pytest.mark.parametrize("overrides, world_size", [
    (["moe.num_experts=0", "moe.topk=0", "moe.moe_layer_freq=0"], 1),  # dense model: no expert rules
    (["parallel.tp=2", "moe.moe_layer_freq=0"], 2),  # dense tp without sequence parallel
    (SP2 + ["model.ffn_hidden_size=255"], 2),  # all layers MoE: the dense width is unused
    (["model.hidden_size=130", "model.head_dim=32"], 1),
    # ERNIE-4.5's routing: the expert bias on the softmax over all experts, renormalised top-k.
    (["moe.pre_softmax=true", "moe.expert_bias=true", "moe.topk_norm_min=1e-12"], 1),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=4", "parallel.etp=1"], 8),
    (["parallel.pp=2", "parallel.pp_layers=[1,3]"], 2),
    (["parallel.ep=4", "moe.replicas=6", "moe.replace_every=1"], 4),
    (["model.num_layers=8", "parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=interleaved"], 2),
    (["moe.num_experts=8", "moe.num_groups=4", "moe.group_topk=2", "moe.topk=4",
      "moe.score_function=sigmoid", "moe.expert_bias=true", "moe.scaling_factor=2.5"], 1),
    (["moe.capacity_factor=1.0", "moe.pad_to_capacity=true", "moe.drop_policy=position"], 1),
    (["moe.capacity_factor=1.0", "moe.drop_policy=position", "moe.dispatcher=allgather"], 1),
    # vpp > 1 picks the interleaved schedule when pp_schedule is auto (the default)
    (["model.num_layers=8", "parallel.pp=2", "parallel.vpp=2"], 2),
    (["parallel.cp=2", "parallel.cp_kind=a2a", "model.num_kv_heads=2"], 2),
    # a2a repeats kv heads up to a multiple of cp: kv heads need only divide by tp
    (["parallel.cp=2", "parallel.cp_kind=a2a", "model.num_kv_heads=1"], 2),
    (SP2 + ["parallel.cp=2", "parallel.cp_kind=a2a", "model.num_kv_heads=2"], 8),
    (["parallel.cp=4", "parallel.cp_kind=a2a", "model.num_heads=8", "model.num_kv_heads=2", "model.head_dim=32"], 4),
    (["data.path=[a,b]", "data.weights=[1,3]", "data.tokenizer=tok/tokenizer.json"], 1),
    (["parallel.order=pp-dp-ep-cp-tp", "optimizer.min_lr=0", "optimizer.warmup_steps=100"], 1),
    (["train.exit_signals=[]", "train.exit_after_minutes=0.5", "train.exit_at_step=1"], 1),
    (SP2 + ["parallel.ep=2", "moe.shared_expert_ffn_hidden_size=64", "moe.shared_expert_overlap=true",
            "moe.overlap_chunks=2", "moe.capacity_factor=1.0", "moe.dedup=true"], 4),
])
def test_valid_configs(overrides, world_size):
    validate(load_config(None, overrides), world_size)


def test_validate_reports_every_violation_in_one_error():
    config = load_config(None, ["moe.num_experts=6", "parallel.ep=4", "moe.expert_bias=true"])
    with pytest.raises(ConfigError) as info:
        validate(config, 4)
    assert str(info.value) == (
        "invalid config: 2 problems\n"
        "  - moe.expert_bias=true requires moe.score_function=sigmoid, got softmax (or moe.pre_softmax=true: the bias "
        "is added to the softmax over all experts, as in ERNIE-4.5)\n"
        "  - moe.num_experts=6 is not divisible by parallel.ep=4"
    )
    assert isinstance(info.value, ValueError)


def test_validate_checks_types_of_a_config_built_in_code():
    config = Config()
    config.train.steps = "10"
    config.optimizer.lr = "1e-3"
    config.parallel.etp = None
    config.moe.moe_layer_freq = [1, 0, True, 1]
    with pytest.raises(ConfigError) as info:
        validate(config, 1)
    assert info.value.problems == [
        "moe.moe_layer_freq=[1, 0, True, 1] has type list: expected int or list[int]",
        "optimizer.lr='1e-3' has type str: expected float",
        "train.steps='10' has type str: expected int",
    ]
    config = dataclasses.replace(Config(), model=None)
    with pytest.raises(ConfigError, match="config.model must be a ModelConfig, got NoneType"):
        validate(config, 1)

"""Every rule a rank raises on a config value at start (model, dispatcher, router,
pipeline schedule, optimizer, precision, checkpoints, data, layout) is caught by the
pre-spawn check, ``check_trainable``, with the field, the value and the rule: a bad
config never reaches a rank.

Each row names where the rank raises (file: the check it would fail) so a new rank-side
raise on a config value gets a row here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_fold.cli import main
from moe_fold.config import ConfigError, load_config
from moe_fold.training.train import check_trainable

SP2 = ["parallel.tp=2", "parallel.sequence_parallel=true"]
MLA = ["model.attention=mla", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=8",
       "model.v_head_dim=16"]

# (where the rank raises, overrides, world size, the pre-spawn message)
RANK_RULES = [
    ("models/attention.py: heads % tp", SP2 + ["model.num_heads=6", "model.num_kv_heads=3", "model.hidden_size=96"], 2,
     "model.num_kv_heads=3 is not divisible by parallel.tp=2"),
    ("models/attention.py: cp_kind", ["parallel.cp_kind=ulysses"], 1,
     "parallel.cp_kind=ulysses must be one of ring, a2a"),
    ("models/mla.py: heads % tp", MLA + SP2 + ["model.num_heads=3", "model.num_kv_heads=3", "model.hidden_size=96"], 2,
     "model.num_heads=3 is not divisible by parallel.tp=2"),
    ("models/mla.py: cp_kind", MLA + ["model.num_kv_heads=4", "parallel.cp_kind=ulysses"], 1,
     "parallel.cp_kind=ulysses must be one of ring, a2a"),
    ("models/rotary.py: head_dim even", ["model.head_dim=15"], 1,
     "model.head_dim=15 must be even (rotary embeddings rotate pairs of dimensions)"),
    ("models/moe_layer.py: tp needs SP", ["parallel.tp=2"], 2,
     "parallel.tp=2 with MoE layers requires parallel.sequence_parallel=true"),
    ("models/moe_layer.py: gate needs a shared expert", ["moe.shared_expert_gate=true"], 1,
     "moe.shared_expert_gate=true requires a shared expert (moe.shared_expert_ffn_hidden_size > 0), got 0"),
    ("models/moe_layer.py: shared-expert overlap needs a shared expert", ["moe.shared_expert_overlap=true"], 1,
     "moe.shared_expert_overlap=true needs a shared expert (moe.shared_expert_ffn_hidden_size > 0, got 0)"),
    ("models/moe_layer.py: overlap chunks >= 1", ["moe.overlap_chunks=0"], 1, "moe.overlap_chunks=0 must be >= 1"),
    ("models/moe_layer.py: overlap chunks without padding",
     ["moe.overlap_chunks=2", "moe.capacity_factor=1.0", "moe.pad_to_capacity=true"], 1,
     "moe.overlap_chunks=2 requires moe.pad_to_capacity=false: one chunk may hold all of an expert's tokens, so "
     "every chunk would be padded to the layer's whole capacity, multiplying the bytes sent by the number of chunks"),
    ("models/experts.py: experts % ep", ["parallel.ep=3"], 3,
     "moe.num_experts=8 is not divisible by parallel.ep=3"),
    ("models/experts.py: ffn % etp", ["parallel.etp=3"], 3,
     "moe.ffn_hidden_size=128 is not divisible by parallel.etp=3"),
    ("models/experts.py: gemm backend", ["moe.gemm_backend=cutlass"], 1,
     "moe.gemm_backend=cutlass must be one of auto, grouped_gemm, torch, triton, loop"),
    ("models/experts.py: swiglu backend", ["moe.swiglu_backend=c"], 1,
     "moe.swiglu_backend=c must be one of auto, torch, triton, cpu"),
    ("models/mlp.py: dense ffn % tp", SP2 + ["moe.moe_layer_freq=0", "model.ffn_hidden_size=255"], 2,
     "model.ffn_hidden_size=255 is not divisible by parallel.tp=2"),
    ("moe_fold/parallel/tensor_parallel.py: vocab % tp", SP2 + ["model.vocab_size=263"], 2,
     "model.vocab_size=263 is not divisible by parallel.tp=2"),
    ("moe_fold/comm.py: reduce_scatter, sequence % tp under SP", SP2 + ["model.seq_length=127"], 2,
     "model.seq_length=127 is not divisible by parallel.tp*cp=2 "
     "(parallel.sequence_parallel=true splits each cp shard of the sequence over tp)"),
    ("moe_fold/parallel/context_parallel.py: sequence % 2cp", ["parallel.cp=2", "model.seq_length=126"], 2,
     "model.seq_length=126 is not divisible by 2*parallel.cp=4 "
     "(context parallel splits the sequence into 2*cp chunks)"),
    ("dispatch/dispatcher.py: pad needs a capacity", ["moe.pad_to_capacity=true"], 1,
     "moe.pad_to_capacity=true requires moe.capacity_factor to be set, got null"),
    ("dispatch/dispatcher.py: pad needs alltoall", ["moe.capacity_factor=1.0", "moe.pad_to_capacity=true",
                                                     "moe.dispatcher=allgather"], 1,
     "moe.pad_to_capacity=true requires moe.dispatcher=alltoall, got allgather"),
    ("dispatch/dispatcher.py: dedup needs alltoall", ["moe.dedup=true", "moe.dispatcher=allgather"], 1,
     "moe.dedup=true requires moe.dispatcher=alltoall, got allgather"),
    ("dispatch/dispatcher.py: dispatcher name", ["moe.dispatcher=deepep"], 1,
     "moe.dispatcher=deepep must be one of alltoall, allgather"),
    ("dispatch/router.py: router dtype", ["moe.router_dtype=float16"], 1,
     "moe.router_dtype=float16 must be one of float32, float64"),
    ("dispatch/router.py: topk backend", ["moe.topk_backend=fused"], 1,
     "moe.topk_backend=fused must be one of auto, torch, triton"),
    ("dispatch/router.py: triton top-k is plain top-k", ["moe.topk_backend=triton", "moe.score_function=sigmoid",
                                                         "moe.expert_bias=true"], 1,
     "moe.topk_backend=triton fuses plain top-k only; moe.num_groups=null and moe.expert_bias=true need "
     "moe.topk_backend=torch (or auto)"),
    ("dispatch/router.py: drop policy", ["moe.drop_policy=random"], 1,
     "moe.drop_policy=random must be one of probs, position"),
    ("dispatch/router.py: topk range", ["moe.topk=9"], 1, "moe.topk=9 must be in [1, moe.num_experts=8]"),
    ("dispatch/router.py: score function", ["moe.score_function=relu"], 1,
     "moe.score_function=relu must be one of softmax, sigmoid"),
    ("dispatch/router.py: pre_softmax needs softmax", ["moe.score_function=sigmoid", "moe.pre_softmax=true"], 1,
     "moe.pre_softmax=true requires moe.score_function=softmax, got sigmoid"),
    ("dispatch/router.py: expert bias needs sigmoid", ["moe.expert_bias=true"], 1,
     "moe.expert_bias=true requires moe.score_function=sigmoid, got softmax (or moe.pre_softmax=true: the bias is "
     "added to the softmax over all experts, as in ERNIE-4.5)"),
    ("dispatch/router.py: norm_min needs pre_softmax", ["moe.topk_norm_min=1e-12"], 1,
     "moe.topk_norm_min=1e-12 requires moe.pre_softmax=true (it renormalises the top-k of the softmax over all "
     "experts)"),
    ("dispatch/router.py: groups set together", ["moe.num_groups=4"], 1,
     "moe.num_groups=4 and moe.group_topk=null must be both set or both null"),
    ("dispatch/router.py: group score", ["moe.num_groups=4", "moe.group_topk=2", "moe.group_score=top3"], 1,
     "moe.group_score=top3 must be one of topk_sum, top2_sum, max"),
    ("dispatch/router.py: top2_sum needs 2 experts a group",
     ["moe.num_groups=8", "moe.group_topk=2", "moe.group_score=top2_sum"], 1,
     "moe.group_score=top2_sum needs >= 2 experts per group, got moe.num_experts/moe.num_groups=1"),
    ("dispatch/router.py: capacity factor", ["moe.capacity_factor=0"], 1,
     "moe.capacity_factor=0.0 must be > 0, or null for dropless"),
    ("dispatch/router.py: scaling factor", ["moe.scaling_factor=-1.0"], 1,
     "moe.scaling_factor=-1.0 must be > 0 when set"),
    ("moe_fold/parallel/pipeline.py: layers % pp*vpp", ["parallel.pp=3"], 3,
     "model.num_layers=4 is not divisible by parallel.pp*vpp=3 (set parallel.pp_layers to split the layers unevenly)"),
    ("moe_fold/parallel/pipeline.py: pp_layers sum", ["parallel.pp=2", "parallel.pp_layers=[2,3]"], 2,
     "parallel.pp_layers=[2, 3] sums to 5, expected model.num_layers=4"),
    ("moe_fold/parallel/pipeline_schedules.py: vpp needs interleaved",
     ["parallel.pp=2", "parallel.vpp=2", "parallel.pp_schedule=1f1b"], 2,
     "parallel.vpp=2 requires parallel.pp_schedule=interleaved (or auto), got 1f1b"),
    ("moe_fold/parallel/pipeline_schedules.py: interleaved needs vpp",
     ["parallel.pp=2", "parallel.pp_schedule=interleaved"], 2,
     "parallel.pp_schedule=interleaved requires parallel.vpp > 1, got null"),
    ("moe_fold/parallel/pipeline_schedules.py: interleaved micro-batches % pp",
     ["model.num_layers=8", "parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=1",
      "train.global_batch_size=3"], 2,
     "train.global_batch_size/(micro_batch_size*dp)=3 micro-batches is not divisible by parallel.pp=2 (the "
     "interleaved schedule sends the micro-batches round the pipeline in groups of pp; global_batch_size=3, "
     "micro_batch_size=1, dp=1)"),
    ("moe_fold/parallel/pipeline_schedules.py: schedule name", ["parallel.pp_schedule=gpipe"], 1,
     "parallel.pp_schedule=gpipe must be one of auto, 1f1b, interleaved"),
    ("moe_fold/layout.py: world % tp*cp*pp", ["parallel.cp=3", "model.seq_length=126"], 4,
     "world_size=4 is not divisible by parallel.tp*cp*pp=3 (tp=1, cp=3, pp=1)"),
    ("moe_fold/layout.py: order", ["parallel.order=tp-cp-dp-pp"], 1,
     "parallel.order=tp-cp-dp-pp must be a permutation of tp, cp, ep, dp, pp joined by '-'"),
    ("moe_fold/training/dynamic_cp.py: cp a power of two", ["parallel.dynamic_cp=true", "parallel.cp=3",
                                                    "model.seq_length=126"], 3,
     "parallel.dynamic_cp=true needs parallel.cp a power of two up to 16, got cp=3"),
    ("moe_fold/training/step.py: dynamic cp without pipeline stages",
     ["parallel.dynamic_cp=true", "parallel.cp=2", "parallel.pp=2"], 4,
     "parallel.dynamic_cp=true needs parallel.pp=1, got 2 (ranks hold unequal token counts under dynamic cp)"),
    ("models/hf/upcycle.py: granularity", ["init.upcycle_granularity=0"], 1,
     "init.upcycle_granularity=0 must be >= 1"),
    ("moe_fold/data/loader.py: global batch % micro*dp", ["train.global_batch_size=6"], 1,
     "train.global_batch_size=6 is not divisible by train.micro_batch_size*dp=4 (micro_batch_size=4, "
     "dp=world_size/(tp*cp*pp)=1)"),
    ("moe_fold/training/precision.py: precision", ["train.precision=fp8"], 1,
     "train.precision=fp8 must be one of fp32, bf16-autocast, bf16"),
    ("moe_fold/training/optim.py: lr", ["optimizer.lr=0"], 1, "optimizer.lr=0.0 must be > 0"),
    ("moe_fold/training/optim.py: betas", ["optimizer.beta2=1.0"], 1, "optimizer.beta2=1.0 must be in [0, 1)"),
    ("moe_fold/training/optim.py: eps", ["optimizer.eps=0"], 1, "optimizer.eps=0.0 must be > 0"),
    ("moe_fold/training/optim.py: weight decay", ["optimizer.weight_decay=-0.1"], 1,
     "optimizer.weight_decay=-0.1 must be >= 0"),
    ("moe_fold/training/optim.py: clip", ["optimizer.clip_grad=-1.0"], 1, "optimizer.clip_grad=-1.0 must be >= 0"),
    ("moe_fold/training/optim.py: schedule", ["optimizer.schedule=linear"], 1,
     "optimizer.schedule=linear must be one of cosine, wsd, constant"),
    ("moe_fold/training/optim.py: parameter gather needs the distributed optimizer",
     ["parallel.overlap_param_gather=true"], 1,
     "parallel.overlap_param_gather=true needs optimizer.distributed=true (only the distributed optimizer "
     "all-gathers parameters after its step)"),
    ("moe_fold/training/buckets.py: bucket size", ["parallel.grad_bucket_numel=0"], 1,
     "parallel.grad_bucket_numel=0 must be >= 1"),
    ("moe_fold/training/checkpoint.py: keep_last", ["train.keep_last=0"], 1, "train.keep_last=0 must be >= 1"),
    ("dispatch/placement.py: a rank holds one copy of an expert", ["parallel.ep=2", "moe.replicas=5"], 2,
     "moe.replicas=5 must be <= moe.num_experts - moe.num_experts/parallel.ep=4 (a rank holds at most one copy of "
     "an expert)"),
    ("moe_fold/training/replace.py: somewhere to move to", ["moe.replace_every=10"], 1,
     "moe.replace_every=10 needs parallel.ep > 1, got 1 (with one ep rank there is nowhere to move an expert)"),
    ("moe_fold/training/numerics.py: spike factor", ["train.loss_spike_factor=-1.0"], 1,
     "train.loss_spike_factor=-1.0 must be >= 0"),
    ("moe_fold/training/numerics.py: spike window", ["train.loss_spike_window=0"], 1,
     "train.loss_spike_window=0 must be >= 1"),
]


@pytest.mark.parametrize("where, overrides, world, message", RANK_RULES, ids=[r[0] for r in RANK_RULES])
def test_rank_rule_fails_before_spawning(where, overrides, world, message):
    config = load_config("mixtral-tiny", ["wandb.mode=disabled", "parallel.ep=1"] + overrides)
    with pytest.raises(ConfigError) as info:
        check_trainable(config, world)
    assert message in info.value.problems, info.value.problems


def test_every_file_raising_on_a_config_field_has_a_row():
    """A rank-side raise whose message names a config field (``moe.x``, ``parallel.x``, ``init.x`` ...)
    must have a row above: its file is listed, so adding one without a pre-spawn rule fails here."""
    repo = Path(__file__).resolve().parents[1]
    field = re.compile(r'raise (ValueError|ConfigError)\(f?"[^"]*\b(moe|parallel|model|train|optimizer|data|init)\.[a-z_]+')
    # Checked before spawning elsewhere: sampling's own command line (tests/test_sample.py);
    # the data files, by moe_fold.data.sources.check_data itself (tests/test_data_formats.py).
    elsewhere = {"models/sampling.py", "moe_fold/data/sources.py"}
    raising = set()
    for folder in ("models", "dispatch", "kernels", "moe_fold/parallel", "moe_fold/training", "moe_fold/data"):
        for path in (repo / folder).rglob("*.py"):
            if field.search(path.read_text()):
                raising.add(str(path.relative_to(repo)))
    covered = {where.split(":")[0] for where, *_ in RANK_RULES}
    assert raising - elsewhere <= covered, sorted(raising - elsewhere - covered)


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
